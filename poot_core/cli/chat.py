"""The replies of `poot generate`: one prompt, a conversation read from piped stdin, or a chat on a terminal.

A conversation keeps its messages and the driver keeps their K/V, so each turn prefills only its new
tokens. On a terminal (stdin is a tty) the chat shows a banner and a `> ` prompt with line editing and
history (readline); a line ending in \\ continues on the next; Ctrl-C stops the reply being generated and
the conversation goes on, Ctrl-C at the prompt or Ctrl-D ends it; /reset, /save FILE, /load FILE and
/help are commands. Piped stdin is one user turn per line, as before.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from poot_core.cli import runtime
from poot_core.cli.args import version
from poot_core.cli.interrupt import exit_130, on_interrupt
from poot_core.errors import CapacityError, RequestError

HELP = ("/reset forgets the conversation, /save FILE writes it as JSON, /load FILE reads one back, "
        "/exit ends (so do Ctrl-D and Ctrl-C at the prompt); //text sends a line that starts with /")


class Conversation:
    """The messages so far, the driver that holds their K/V, and how replies are shown."""

    def __init__(self, args: argparse.Namespace, loaded: runtime.Loaded, template: str | None, use_chat: bool):
        self.args = args
        self.loaded = loaded
        self.template = template
        self.use_chat = use_chat
        self.interrupted = False  # Ctrl-C during the reply being generated
        self.interactive = False
        self.messages: list[dict[str, str]] = self._first_messages()
        self.stops: list[str] = []  # the chat template's end-of-turn markers
        self.last_prompt_tokens = 0
        self._load_shown = False

    def _first_messages(self) -> list[dict[str, str]]:
        if self.args.system_prompt is None:
            return []
        return [{"role": "system", "content": self.args.system_prompt}]

    @property
    def show_timings(self) -> bool:
        if self.args.show_timings is not None:
            return bool(self.args.show_timings)
        return self.args.verbose or not self.interactive

    # --- one reply ------------------------------------------------------------------------------------
    def _prompt_ids(self, text: str) -> list[int]:
        """Token ids of the conversation so far plus this user turn (or of the plain text)."""
        services = self.loaded.handle.text()
        if not self.use_chat:
            if self.args.verbose_prompt:
                print(f"prompt: {text!r}", file=sys.stderr)
            return services.encode(text)
        rendered = services.render_chat_value([*self.messages, {"role": "user", "content": text}],
                                              template=self.template)
        self.stops = list(rendered.stops)
        if self.args.verbose_prompt:
            print(f"prompt: {rendered.text!r}", file=sys.stderr)
        return services.encode_chat(rendered)

    def _check_fits(self, ids: list[int]) -> None:
        n, ctx = self.args.n_predict, self.loaded.ctx
        if len(ids) + max(n, 0) > ctx or len(ids) >= ctx:
            what = "the conversation" if len(self.messages) > 1 else "the prompt"
            raise CapacityError(f"context full: {what} ({len(ids)} tokens) plus -n {n} does not fit the "
                                f"context window of {ctx} (-c)")

    def answer(self, text: str, stream: bool = True) -> Any:
        """Generate the reply to `text`, streaming it to stdout; returns the driver's Generation."""
        from poot_core import GenerateRequest, GenerationControl, Sampler

        a = self.args
        ids = self._prompt_ids(text)
        self._check_fits(ids)
        self.last_prompt_tokens = len(ids)
        if a.verbose_prompt:
            self._show_tokens(ids)
        sampler = Sampler(temperature=a.temp, top_k=_or(a.top_k, 40), top_p=_or(a.top_p, 0.95),
                          min_p=_or(a.min_p, 0.05), repeat_penalty=a.repeat_penalty,
                          seed=None if a.seed is None or a.seed < 0 else a.seed)
        # --ignore-eos generates through the template's end-of-turn markers too, as it says
        stops = [*a.reverse_prompt, *([] if a.ignore_eos else self.stops)]
        threads = self.loaded.threads
        decoding = False

        def on_token(token: int, piece: str) -> GenerationControl:
            nonlocal decoding
            if not decoding:  # the prompt is in: the steps from here on decode
                threads.for_decode()
                decoding = True
            if piece and stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            return GenerationControl.BREAK if self.interrupted else GenerationControl.CONTINUE

        threads.for_prefill()
        self.interrupted = False
        with on_interrupt(self._on_interrupt):
            request = GenerateRequest(ids, a.n_predict, sampler, stops, a.ignore_eos,
                                      constraint=getattr(a, "constraint", None))
            result = self.loaded.driver.generate(request, on_token)
        if stream:
            sys.stdout.write("\n")
            sys.stdout.flush()
        if a.n_predict < 0 and result.stop_reason == "length":
            result.stop_reason = "capacity"  # -n -1 ran to the end of the window (the driver counts it as length)
        if self.use_chat:
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": result.text}]
        self._report(ids, result)
        return result

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        if self.interrupted:  # a second Ctrl-C before the reply stopped: give up on the run
            exit_130()
        self.interrupted = True

    def _show_tokens(self, ids: list[int]) -> None:
        services = self.loaded.handle.text()
        print(f"number of tokens in prompt = {len(ids)}", file=sys.stderr)
        for i in ids:
            print(f"{i:6d} -> {services.decode([i])!r}", file=sys.stderr)
        sys.stderr.flush()

    def _report(self, ids: list[int], result: Any) -> None:
        t = result.timings
        runtime.log(self.args, f"turn: {len(ids)} prompt tokens, {t.reused_tokens} reused from the cache, "
                               f"{t.prefill_tokens} prefilled; {len(result.tokens)} generated; "
                               f"stopped by {result.stop_reason}")
        if result.stop_reason == "capacity":
            hint = "; /reset starts a new conversation" if self.interactive else ""
            print(f"poot: context full: the reply stopped at the end of the {self.loaded.ctx}-position window "
                  f"(-c){hint}", file=sys.stderr, flush=True)
        if self.show_timings:
            load = "" if self._load_shown else f"load: {self.loaded.load_seconds:.2f} s | "
            self._load_shown = True
            print(f"{load}prefill: {t.prefill_tokens} tokens in {t.prefill_seconds:.3f} s "
                  f"({t.prefill_tok_s:.1f} tok/s) | decode: {t.decode_tokens} tokens in {t.decode_seconds:.3f} s "
                  f"({t.decode_tok_s:.1f} tok/s){_speculation(t)}", file=sys.stderr, flush=True)

    # --- commands -------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.messages = self._first_messages()
        self.loaded.driver.reset()

    def save(self, path: str) -> None:
        try:
            Path(path).write_text(json.dumps({"messages": self.messages}, indent=2, ensure_ascii=False) + "\n",
                                  encoding="utf-8")
        except OSError as exc:
            raise RequestError(f"cannot write {path}: {exc}") from exc

    def load(self, path: str) -> None:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RequestError(f"cannot read a conversation from {path}: {exc}") from exc
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in messages
        ):
            raise RequestError(f"{path} holds no conversation: expected {{\"messages\": [{{\"role\": ..., "
                               "\"content\": ...}, ...]}} as /save writes it")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]


def _count(messages: list[Any]) -> str:
    return f"{len(messages)} message{'' if len(messages) == 1 else 's'}"


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def run_conversation(chat: Conversation, prompt: str | None) -> int:
    if sys.stdin.isatty():
        return Terminal(chat).run(prompt)
    return _piped(chat, prompt)


def _piped(chat: Conversation, prompt: str | None) -> int:
    """One user turn per line of stdin (-p/-f is the first turn, answered before stdin is read)."""
    if prompt is not None:
        chat.answer(prompt)
        if chat.interrupted or chat.args.single_turn:
            return 130 if chat.interrupted else 0
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        chat.answer(line)
        if chat.interrupted:
            return 130
        if chat.args.single_turn:
            break
    return 0


class Terminal:
    """The interactive chat: banner, `> ` prompt with readline, commands, Ctrl-C and Ctrl-D."""

    def __init__(self, chat: Conversation) -> None:
        self.chat = chat
        chat.interactive = True
        try:
            import readline  # noqa: F401  (importing it gives input() line editing and history)
        except ImportError:  # Python built without readline: plain input
            pass

    def banner(self) -> None:
        c, loaded = self.chat, self.chat.loaded
        cfg = loaded.config
        kind = cfg.family if cfg.family == cfg.architecture else f"{cfg.family}, {cfg.architecture}"
        print(f"poot {version()}: {Path(c.args.model).name} ({kind}) on "
              f"{loaded.executor.name}, context {loaded.ctx} of {cfg.max_positions}, loaded in "
              f"{loaded.load_seconds:.1f} s", file=sys.stderr)
        print("Enter sends a turn; end a line with \\ to continue it. Ctrl-C stops a reply; Ctrl-D or /exit quits; "
              "/help lists the commands.", file=sys.stderr, flush=True)

    def read_turn(self) -> str:
        with on_interrupt(signal.default_int_handler):  # Ctrl-C at the prompt: KeyboardInterrupt from input()
            lines = [input("> ")]
            while lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1]
                lines.append(input(". "))
        return "\n".join(lines)

    def run(self, prompt: str | None) -> int:
        self.banner()
        if prompt is not None:
            print(f"> {prompt}", flush=True)
            if self._turn(prompt) and self.chat.args.single_turn:
                return 0
        while True:
            try:
                text = self.read_turn()
            except EOFError:  # Ctrl-D
                print(flush=True)
                return 0
            except KeyboardInterrupt:  # Ctrl-C at the prompt
                print(flush=True)
                return 130
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                if self._command(text.strip()):
                    return 0
                continue
            if self._turn(text.removeprefix("/")) and self.chat.args.single_turn:
                return 0

    def _turn(self, text: str) -> bool:
        """Answer one turn; False when it could not run (said why)."""
        try:
            self.chat.answer(text)
        except CapacityError as exc:
            print(f"poot: {exc}; /reset starts a new conversation", file=sys.stderr, flush=True)
            return False
        if self.chat.interrupted:
            print("[stopped]", file=sys.stderr, flush=True)
        return True

    def _command(self, line: str) -> bool:
        """Run a /command; True when it ends the chat."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        try:
            if name in ("/exit", "/quit"):
                return True
            if name == "/reset":
                self.chat.reset()
                print("[conversation reset]", file=sys.stderr, flush=True)
            elif name in ("/save", "/load") and not rest:
                print(f"{name} needs a file name: {name} FILE", file=sys.stderr, flush=True)
            elif name == "/save":
                self.chat.save(rest)
                print(f"[saved {_count(self.chat.messages)} to {rest}]", file=sys.stderr, flush=True)
            elif name == "/load":
                self.chat.load(rest)
                print(f"[loaded {_count(self.chat.messages)} from {rest}]", file=sys.stderr, flush=True)
            else:
                print(("" if name == "/help" else f"unknown command {name}; ") + HELP, file=sys.stderr, flush=True)
        except RequestError as exc:
            print(f"poot: {exc}", file=sys.stderr, flush=True)
        return False


def _speculation(t: Any) -> str:
    if not t.proposed:
        return ""
    return f" | draft: {t.accepted} of {t.proposed} proposed tokens accepted ({100 * t.acceptance_rate:.0f}%)"
