"""Chat templates: the model's jinja `chat_template`, rendered in an immutable sandbox.

The environment offers what Hugging Face templates expect (trim_blocks, lstrip_blocks, loop controls, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`, a `namespace` that refuses dunder
names), so the text equals transformers' `apply_chat_template`. A template that fails to compile or to render
is a TemplateError carrying the template's own message; nothing falls back to another format.

Rendering also records which parts of the text came from message content (`segments`), so `encode_segments`
can tokenize a control token spelled inside a message as plain text: a message cannot open a turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

from poot_core.errors import TemplateError


def looks_like_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not set {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it only renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


@dataclass(frozen=True)
class RenderedChat:
    text: str
    stops: tuple[str, ...]
    # (piece, from_message): the text split into what the template wrote and what came from messages.
    segments: tuple[tuple[str, bool], ...]
    # Message texts the template changed beyond recognition (not found in `text`): encode_chat refuses them
    # when they spell a control token, since it could not keep that token plain.
    unplaced: tuple[str, ...] = ()


class ChatTemplate:
    def __init__(self, source: str, origin: str) -> None:
        self.source = source
        self.origin = origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TemplateError(f"{origin} does not compile: {exc.message} (line {exc.lineno})") from exc

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, bos_token: str | None, eos_token: str | None,
                extra: dict[str, Any]) -> str:
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "", **extra)
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"{self.origin} was refused by the sandbox: {exc}") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"{self.origin} failed to render: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            raise TemplateError(f"{self.origin} failed to render: {type(exc).__name__}: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, bos_token: str | None = None, eos_token: str | None = None,
               **extra: Any) -> RenderedChat:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TemplateError("messages must be a list of objects with a role and a content")
        text = self._render(messages, tools, add_generation_prompt, bos_token, eos_token, extra)
        segments, unplaced = _segments(text, messages, tools)
        stops = self._stops(bos_token, eos_token, extra)
        return RenderedChat(text, stops, segments, unplaced)

    def _stops(self, bos_token: str | None, eos_token: str | None, extra: dict[str, Any]) -> tuple[str, ...]:
        """The turn-end marker the template writes after an assistant reply, read off a probe conversation."""
        reply = "POOT_PROBE_REPLY"
        found: list[str] = []
        try:
            probe = self._render([{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply}],
                                 None, False, bos_token, eos_token, extra)
        except TemplateError:
            probe = ""
        if reply in probe:
            after = probe[probe.index(reply) + len(reply):].strip(" ")
            marker = after.split("\n", 1)[0].strip()
            if marker:
                found.append(marker)
        if eos_token and eos_token not in found:
            found.append(eos_token)
        return tuple(found)


def compile_template(source: str, origin: str = "chat template") -> ChatTemplate:
    if not isinstance(source, str) or not source.strip():
        raise TemplateError(f"{origin} is empty")
    return ChatTemplate(source, origin)


def _message_texts(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[str]:
    """Every piece of user-supplied text a template may copy into the prompt, in conversation order."""
    texts: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part.get("text", "") for part in content if isinstance(part, dict))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                texts.append(args)
    return [t for t in texts if t]


def _segments(text: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
              ) -> tuple[tuple[tuple[str, bool], ...], tuple[str, ...]]:
    """Split `text` into template-written pieces and message pieces by finding each message's text, in order.
    A template may trim content, so a stripped copy is looked for too; text not found stays template text."""
    spans: list[tuple[int, int]] = []
    unplaced: list[str] = []
    cursor = 0
    for piece in _message_texts(messages, tools):
        for candidate in (piece, piece.strip()):
            at = text.find(candidate, cursor) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
        else:
            unplaced.append(piece)
    segments: list[tuple[str, bool]] = []
    last = 0
    for start, end in spans:
        if start > last:
            segments.append((text[last:start], False))
        segments.append((text[start:end], True))
        last = end
    if last < len(text):
        segments.append((text[last:], False))
    return tuple(segments), tuple(unplaced)


def encode_segments(tokenizer: tokenizers.Tokenizer, segments: tuple[tuple[str, bool], ...]) -> list[int]:
    """Template text with control tokens matched; message text with every special spelled as plain text.
    No BOS/EOS is added here. The tokenizer's flag is restored before returning."""
    ids: list[int] = []
    previous = tokenizer.encode_special_tokens
    try:
        for piece, from_message in segments:
            tokenizer.encode_special_tokens = from_message
            ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
    finally:
        tokenizer.encode_special_tokens = previous
    return ids
