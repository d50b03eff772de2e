"""`poot generate`: llama-cli's flags where poot has the capability.

Every refusal that needs no weights (flag combinations, template values and files, a conversation on a
model without a template) happens before the weights are touched, as a one-line message and exit 1.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from poot_core.errors import CapacityError, RequestError

BACKENDS = ("auto", "cpu", "cuda", "ptx", "rocm", "vulkan", "wgpu")
BACKEND_NAMES = {"ptx": "cuda", "wgpu": "vulkan"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (llama-cli flags)")
    p.add_argument("-m", "--model", required=True, help="a safetensors checkpoint directory or a .gguf file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the prompt (a user turn when the model has a chat template)")
    src.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("--system-prompt", help="a system turn before the prompt")
    p.add_argument("--no-chat-template", action="store_true", help="continue the text as written")
    p.add_argument("--chat-template", metavar="JINJA", help="render turns through this jinja template")
    p.add_argument("--chat-template-file", metavar="FILE", help="read the jinja chat template from a file")
    p.add_argument("--conversation", action="store_true", help="read one user turn per line of stdin")
    p.add_argument("--single-turn", action="store_true", help="end after one reply")
    p.add_argument("-n", "--n-predict", type=int, default=-1, help="new tokens (-1: until end of sequence)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context window (0: the model's own)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy, exact tokens)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("-s", "--seed", type=int, default=-1, help="random seed (-1: random)")
    p.add_argument("-r", "--reverse-prompt", action="append", default=[], help="stop at this string")
    p.add_argument("--ignore-eos", action="store_true", help="generate through end-of-sequence")
    p.add_argument("--show-timings", action=argparse.BooleanOptionalAction, default=True,
                   help="print prefill and decode tokens/s to stderr (default: on)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the run does to stderr")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--prefill-chunk", type=int, default=256, help=argparse.SUPPRESS)
    p.set_defaults(run=run)


class Session:
    """What one `poot generate` run holds: the driver, the conversation so far, and the output stream."""

    def __init__(self, args: argparse.Namespace, template: str | None) -> None:
        self.args = args
        self.template = template
        self.interrupted = False
        self.messages: list[dict[str, str]] = []
        self.stops: list[str] = []  # the chat template's turn-end markers
        if args.system_prompt:
            self.messages.append({"role": "system", "content": args.system_prompt})

    def log(self, text: str) -> None:
        if self.args.verbose:
            print(f"[poot] {text}", file=sys.stderr, flush=True)


def _read_template(args: argparse.Namespace) -> str | None:
    """The --chat-template/--chat-template-file value, checked to be a template that compiles."""
    from poot_core.text.chat import compile_template, looks_like_jinja

    if args.chat_template is not None:
        if not looks_like_jinja(args.chat_template):
            raise RequestError(f"--chat-template {args.chat_template!r} is not a jinja template; poot has no "
                               "built-in template names: pass the template text or --chat-template-file")
        source = args.chat_template
    elif args.chat_template_file is not None:
        try:
            source = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RequestError(f"cannot read --chat-template-file {args.chat_template_file}: {exc}") from exc
    else:
        return None
    compile_template(source, origin="--chat-template")  # a TemplateError names what does not compile
    return source


def _check_flags(args: argparse.Namespace) -> None:
    if args.no_chat_template and (args.chat_template is not None or args.chat_template_file is not None):
        raise RequestError("--no-chat-template does not combine with --chat-template or --chat-template-file")
    if args.chat_template is not None and args.chat_template_file is not None:
        raise RequestError("--chat-template and --chat-template-file do not combine; give one")
    if args.conversation and args.no_chat_template:
        raise RequestError("--conversation needs a chat template; it does not combine with --no-chat-template")
    if not args.conversation and args.prompt is None and args.file is None:
        raise RequestError("give a prompt with -p or -f (or use --conversation)")
    if args.n_predict < -1:
        raise RequestError(f"-n must be -1 or >= 0, got {args.n_predict}")
    if args.ctx_size < 0:
        raise RequestError(f"-c must be >= 0, got {args.ctx_size}")


def _model_has_template(model: Path) -> bool:
    """Whether the checkpoint ships a chat template, read from its small metadata only (no weights)."""
    import json

    if model.is_dir():
        if (model / "chat_template.jinja").exists():
            return True
        try:
            tc = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return bool(tc.get("chat_template"))
    from poot_core.checkpoint.gguf_file import GGUFFile

    return bool(GGUFFile.open(model).metadata.get("tokenizer.chat_template"))


def _prompt_text(args: argparse.Namespace) -> str | None:
    if args.file is not None:
        try:
            return Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RequestError(f"cannot read the prompt file {args.file}: {exc}") from exc
    return args.prompt


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    template = _read_template(args)
    model = Path(args.model)
    if not model.exists():
        raise RequestError(f"no such checkpoint: {model}")
    use_chat = not args.no_chat_template and (template is not None or _model_has_template(model))
    if args.conversation and not use_chat:
        raise RequestError(f"--conversation needs a chat template and {model} ships none; "
                           "pass --chat-template-file")
    prompt = _prompt_text(args)
    session = Session(args, template)

    from poot_core import Driver, DriverOptions, ModelHandle, open_executor
    from poot_core.cli.progress import warm_with_progress

    t0 = time.perf_counter()
    warm_with_progress(model)
    handle = ModelHandle.load(model)
    config = handle.config()
    ctx = args.ctx_size or config.max_positions
    first_ids = _turn_ids(session, handle, prompt, use_chat) if prompt is not None else None
    if first_ids is not None:
        _check_fits(len(first_ids), args.n_predict, ctx)
    backend = BACKEND_NAMES.get(args.backend, args.backend)
    executor = open_executor(backend)
    session.log(f"model {model} ({config.family}, {config.architecture}); backend {executor.name}; "
                f"context {ctx}")
    driver = Driver(handle, executor, DriverOptions(capacity=ctx, prefill_chunk=args.prefill_chunk)).serve()
    session.log(f"loaded in {time.perf_counter() - t0:.2f} s")

    previous = signal.signal(signal.SIGINT, lambda *_: setattr(session, "interrupted", True))
    try:
        if first_ids is not None:
            reply = _answer(session, driver, handle, first_ids)
            if use_chat:
                session.messages.append({"role": "assistant", "content": reply})
        if args.conversation and not args.single_turn:
            for line in sys.stdin:
                if session.interrupted:
                    break
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                ids = _turn_ids(session, handle, line, True)
                _check_fits(len(ids), args.n_predict, ctx)
                reply = _answer(session, driver, handle, ids)
                session.messages.append({"role": "assistant", "content": reply})
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130 if session.interrupted else 0


def _check_fits(prompt_tokens: int, n_predict: int, ctx: int) -> None:
    if prompt_tokens + max(n_predict, 0) > ctx or prompt_tokens >= ctx:
        raise CapacityError(f"the prompt ({prompt_tokens} tokens) plus -n {n_predict} does not fit the context "
                            f"window of {ctx} (-c)")


def _turn_ids(session: Session, handle: Any, text: str, use_chat: bool) -> list[int]:
    """Token ids of the whole conversation so far plus this user turn (or of the plain text)."""
    services = handle.text()
    if not use_chat:
        return services.encode(text)
    session.messages.append({"role": "user", "content": text})
    rendered = services.render_chat_value(session.messages, template=session.template)
    session.stops = list(rendered.stops)
    return services.encode_chat(rendered)


def _answer(session: Session, driver: Any, handle: Any, ids: list[int]) -> str:
    from poot_core import GenerateRequest, GenerationControl, Sampler

    a = session.args
    sampler = Sampler(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                      repeat_penalty=a.repeat_penalty, seed=None if a.seed < 0 else a.seed)
    stops = [*a.reverse_prompt, *session.stops]

    def on_token(token: int, piece: str) -> GenerationControl:
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
        return GenerationControl.BREAK if session.interrupted else GenerationControl.CONTINUE

    request = GenerateRequest(ids, a.n_predict, sampler, stops, a.ignore_eos)
    result = driver.generate(request, on_token)
    sys.stdout.write("\n")
    sys.stdout.flush()
    t = result.timings
    session.log(f"turn: {len(ids)} prompt tokens, {t.reused_tokens} reused from the cache, "
                f"{t.prefill_tokens} prefilled; {len(result.tokens)} generated; stopped by {result.stop_reason}")
    if a.show_timings:
        print(f"prefill: {t.prefill_tokens} tokens in {t.prefill_seconds:.3f} s ({t.prefill_tok_s:.1f} tok/s) | "
              f"decode: {t.decode_tokens} tokens in {t.decode_seconds:.3f} s ({t.decode_tok_s:.1f} tok/s)",
              file=sys.stderr, flush=True)
    return result.text

