"""`poot generate`: llama-cli's flags where poot has the capability.

Every refusal that needs no weights (flag combinations, template values and files, a conversation or a
system prompt on a model without a template) happens before the weights are touched, as a one-line
message and exit 1. A flag that cannot change anything in the run it is given to (a sampling flag under
greedy decoding) is a one-line warning. llama-cli's flags that poot does not have are refused by name
(llama_flags.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from poot_core.cli import placed, runtime
from poot_core.cli.args import version
from poot_core.cli.chat import Conversation, run_conversation
from poot_core.errors import RequestError

DEFAULT_CTX = 4096
# Sampling flags whose default is None so that poot can tell whether they were given.
SAMPLING_DEFAULTS = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (llama-cli flags)",
                       description="Generate text from a prompt, or chat with --conversation.")
    p.add_argument("-m", "--model", required=True, help="a safetensors checkpoint directory or a .gguf file "
                   "(required)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the prompt (a user turn when the model has a chat template)")
    src.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("--system-prompt", metavar="TEXT", help="a system turn before the prompt (needs a chat template)")
    p.add_argument("--no-chat-template", action="store_true", help="continue the text as written")
    p.add_argument("--chat-template", metavar="JINJA", help="render turns through this jinja template")
    p.add_argument("--chat-template-file", metavar="FILE", help="read the jinja chat template from a file")
    p.add_argument("--conversation", action=argparse.BooleanOptionalAction, default=None,
                   help="chat: on a terminal with a prompt and line editing, else one user turn per line of stdin "
                        "(default: off)")
    p.add_argument("--single-turn", action="store_true",
                   help="a conversation of one turn: -p/-f, or else the first line of stdin (implies "
                        "--conversation)")
    p.add_argument("-n", "--n-predict", "--predict", type=int, default=-1, metavar="N",
                   help="new tokens per reply; -1: until end of sequence or the end of the window")
    runtime.add_device_flags(p, DEFAULT_CTX)
    p.add_argument("--temp", "--temperature", type=float, default=0.0, metavar="T",
                   help="temperature; 0 is greedy, poot's exact-token convention (llama-cli samples at 0.80)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="top-k sampling (default: 40; with --temp > 0)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="top-p sampling (default: 0.95; with --temp > 0)")
    p.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="min-p sampling (default: 0.05; with --temp > 0)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, metavar="X", help="penalty for repeated tokens")
    p.add_argument("-s", "--seed", type=int, default=None, metavar="N",
                   help="random seed (default: -1, a random one; with --temp > 0)")
    p.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                   help="stop at this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate through end-of-sequence and the chat template's end-of-turn markers")
    p.add_argument("--show-timings", action=argparse.BooleanOptionalAction, default=None,
                   help="print load, prefill and decode speed to stderr after each reply (default: on, except "
                        "in an interactive chat unless -v)")
    p.add_argument("--verbose-prompt", action="store_true", help="print the rendered prompt and its tokens to stderr")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, tokens, stop reason, timings) instead of streaming the text")
    spec = p.add_argument_group("speculative decoding (greedy output is unchanged)")
    spec.add_argument("-md", "--model-draft", metavar="FILE",
                      help="a smaller model of the same vocabulary proposes tokens the model verifies in one step")
    spec.add_argument("--lookup", action="store_true",
                      help="prompt lookup: propose the tokens that followed the last ones earlier in the prompt "
                           "and reply")
    spec.add_argument("--mtp", type=int, default=None, metavar="N",
                      help="the model's multi-token-prediction (nextn) layers propose N tokens")
    spec.add_argument("--draft-max", type=int, default=None, metavar="N",
                      help="most tokens proposed per verify step (default: 8; 15 with --lookup)")
    spec.add_argument("--draft-min", type=int, default=None, metavar="N",
                      help="fewest proposed tokens worth a verify step (default: 1)")
    structured = p.add_argument_group("structured output (the reply follows a grammar or a JSON schema)")
    structured.add_argument("--grammar", metavar="GBNF", help="a grammar in llama.cpp's GBNF (or llguidance's Lark)")
    structured.add_argument("--grammar-file", metavar="FILE", help="read the --grammar from a file")
    structured.add_argument("-j", "--json-schema", metavar="SCHEMA",
                            help="a JSON schema the reply is an instance of: its JSON text or a file holding it")
    structured.add_argument("-jf", "--json-schema-file", metavar="FILE", help="read the --json-schema from a file")
    structured.add_argument("--json-object", action="store_true",
                            help="the reply is one JSON object (--json prints the result as JSON instead)")
    placed.add_flags(p)
    p.add_argument("--prefill-chunk", type=int, dest="batch_size", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--version", action="version", version=f"poot {version()}")
    p.set_defaults(run=run)


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
    if args.single_turn:
        if args.conversation is False:
            raise RequestError("--single-turn is a conversation of one turn; it does not combine with "
                               "--no-conversation")
        args.conversation = True
    if args.no_chat_template and (args.chat_template is not None or args.chat_template_file is not None):
        raise RequestError("--no-chat-template does not combine with --chat-template or --chat-template-file")
    if args.chat_template is not None and args.chat_template_file is not None:
        raise RequestError("--chat-template and --chat-template-file do not combine; give one")
    if args.conversation and args.no_chat_template:
        raise RequestError("--conversation needs a chat template; it does not combine with --no-chat-template")
    if args.system_prompt is not None and args.no_chat_template:
        raise RequestError("--system-prompt is a turn of the chat template; it does not combine with "
                           "--no-chat-template")
    if args.json and args.conversation:
        raise RequestError("--json prints one reply as one object; it does not combine with --conversation")
    if not args.conversation and args.prompt is None and args.file is None:
        raise RequestError("give a prompt with -p or -f (or use --conversation)")
    if args.n_predict < -1:
        raise RequestError(f"-n must be -1 or >= 0, got {args.n_predict}")
    runtime.check_device_flags(args)
    _check_draft_flags(args)
    args.constraint = _constraint(args)
    if args.temp <= 0:
        unused = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                           ("--min-p", args.min_p), ("-s", args.seed)) if value is not None]
        if unused:
            runtime.warn(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect at --temp 0 "
                         "(greedy decoding); give --temp above 0 to sample")


def _check_draft_flags(args: argparse.Namespace) -> None:
    given = [flag for flag, on in (("-md", args.model_draft is not None), ("--lookup", args.lookup),
                                   ("--mtp", args.mtp is not None)) if on]
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} are different ways to propose tokens; give one")
    sizes = [flag for flag, v in (("--draft-max", args.draft_max), ("--draft-min", args.draft_min)) if v is not None]
    if sizes and not given:
        raise RequestError(f"{', '.join(sizes)} {'sets' if len(sizes) == 1 else 'set'} speculative decoding's "
                           "proposals; give -md FILE, --lookup or --mtp N with it")
    if args.mtp is not None and args.draft_max is not None:
        raise RequestError("--mtp N sets how many tokens the nextn layers propose; it does not combine with "
                           "--draft-max")
    k = args.mtp if args.mtp is not None else args.draft_max
    if k is not None and k < 1:
        raise RequestError(f"{'--mtp' if args.mtp is not None else '--draft-max'} must be >= 1, got {k}")
    if args.draft_min is not None and not 0 <= args.draft_min <= (k if k is not None else 8):
        raise RequestError(f"--draft-min must be between 0 and the tokens proposed ({k or 8}), got "
                           f"{args.draft_min}")
    if args.model_draft is not None and not Path(args.model_draft).exists():
        raise RequestError(f"no such draft checkpoint: {args.model_draft}")


def _read(flag: str, path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"cannot read {flag} {path}: {exc}") from exc


def _constraint(args: argparse.Namespace) -> Any:
    """The Constraint the structured-output flags ask for, compiled once without the model so that a schema or
    grammar that does not compile is refused before the weights are read."""
    from poot_core.driver.constraints import Constraint

    given = [flag for flag, on in (("--grammar", args.grammar is not None),
                                   ("--grammar-file", args.grammar_file is not None),
                                   ("--json-schema", args.json_schema is not None),
                                   ("--json-schema-file", args.json_schema_file is not None),
                                   ("--json-object", args.json_object)) if on]
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} each constrain the reply; give one")
    if not given:
        return None
    if args.grammar is not None or args.grammar_file is not None:
        constraint = Constraint.grammar(args.grammar if args.grammar is not None
                                        else _read("--grammar-file", args.grammar_file))
    elif args.json_object:
        constraint = Constraint.json_object()
    else:
        if args.json_schema_file is not None:
            text = _read("--json-schema-file", args.json_schema_file)
        else:
            text = args.json_schema
            try:
                json.loads(text)
            except ValueError:  # not JSON text: a file that holds the schema
                if not Path(text).is_file():
                    raise RequestError(f"--json-schema {text[:60]!r} is neither JSON nor a file") from None
                text = _read("--json-schema", text)
        constraint = Constraint.json_schema(text)
    constraint.check()
    return constraint


def _draft_policy(args: argparse.Namespace, model: Path) -> Any:
    """The DraftPolicy the flags ask for, checked against the model from configs and tokenizers only (a draft
    of another vocabulary, MTP on a model without nextn layers): refused before any tensor is read."""
    from poot_core import DraftPolicy, ModelHandle
    from poot_core.driver.speculation import check_draft

    sizes = {key: v for key, v in (("k", args.draft_max), ("min_k", args.draft_min)) if v is not None}
    if args.lookup:
        return DraftPolicy.PromptLookup(**sizes)
    if args.model_draft is None and args.mtp is None:
        return DraftPolicy.OFF
    if args.mtp is not None:
        policy = DraftPolicy.Mtp(k=args.mtp, **sizes)
    else:
        policy = DraftPolicy.DraftModel(ModelHandle.load(Path(args.model_draft)), **sizes)
    check_draft(policy, ModelHandle.load(model))
    return policy


def _model_has_template(model: Path) -> bool:
    """Whether the checkpoint ships a chat template, read from its small metadata only (no weights)."""
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
    spawned = placed.launch(args)  # --tp/--pp: N ranks run this command; None: this process runs the model
    if spawned is not None:
        return spawned
    template = _read_template(args)
    model = Path(args.model)
    if not model.exists():
        raise RequestError(f"no such checkpoint: {model}")
    use_chat = not args.no_chat_template and (template is not None or _model_has_template(model))
    if args.conversation and not use_chat:
        raise RequestError(f"--conversation needs a chat template and {model} ships none; "
                           "pass --chat-template-file")
    if args.system_prompt is not None and not use_chat:
        raise RequestError(f"--system-prompt needs a chat template and {model} ships none; pass "
                           "--chat-template-file, or put the text in the prompt")
    prompt = _prompt_text(args)
    draft = _draft_policy(args, model)
    loaded = runtime.load(args, model, default_ctx=DEFAULT_CTX, draft=draft)
    chat = Conversation(args, loaded, template, use_chat)
    if args.conversation:
        return run_conversation(chat, prompt)
    result = chat.answer(prompt or "", stream=not args.json)
    if args.json:
        print(json.dumps(_json_result(chat, result)))
    return 130 if chat.interrupted else 0


def _json_result(chat: Conversation, result: Any) -> dict[str, Any]:
    t = result.timings
    return {"model": str(chat.args.model), "backend": chat.loaded.executor.name, "context": chat.loaded.ctx,
            "text": result.text, "tokens": list(result.tokens), "prompt_tokens": chat.last_prompt_tokens,
            "stop_reason": result.stop_reason,
            "timings": {"load_seconds": chat.loaded.load_seconds, "prefill_tokens": t.prefill_tokens,
                        "prefill_seconds": t.prefill_seconds, "prefill_tok_s": t.prefill_tok_s,
                        "decode_tokens": t.decode_tokens, "decode_seconds": t.decode_seconds,
                        "decode_tok_s": t.decode_tok_s, "reused_tokens": t.reused_tokens,
                        "proposed": t.proposed, "accepted": t.accepted}}
