"""Chat templates: the model's jinja `chat_template`, rendered in an immutable sandbox.

The environment offers what Hugging Face templates expect (trim_blocks, lstrip_blocks, loop controls, a
`tojson` that does not escape HTML, `raise_exception`, `strftime_now`, a `namespace` that refuses underscore
names, a `dict` that hands out plain dicts), and the inputs are prepared as transformers' apply_chat_template
prepares them (keys whose value is None dropped, reasoning fields aliased, `documents` passed as None, special
tokens passed only when the model has them), so the text equals `apply_chat_template(..., tokenize=False)`.
A template that fails to compile or to render is a TemplateError carrying the template's own message; nothing
falls back to another format.

Rendering also records which parts of the text came from messages (`segments`), so that
`poot_core.text.chat_tokens.encode_segments` can tokenize a control token spelled inside a message as plain
text: a message cannot open a turn.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from poot_core.errors import TemplateError

Segments = tuple[tuple[str, bool], ...]

# Names a message's reasoning arrives under; transformers copies it to `reasoning_content` and `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def looks_like_jinja(text: str) -> bool:
    """True for template source; False for a bare format name such as "chatml"."""
    return "{{" in text or "{%" in text


# --- the sandbox --------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """The `dict` global: builds plain dicts without exposing the dict type itself to the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


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


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja's sandbox hands back an undefined value for an unsafe attribute (`x.__class__` renders as nothing);
    here the reach itself is refused, so such a template fails loudly instead of rendering silently."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


# --- inputs, prepared as apply_chat_template prepares them ----------------------------------------------------


def _plain(value: Any) -> Any:
    """A fresh copy built of JSON types only: the template never sees (or mutates) the caller's objects, and any
    other object becomes an inert placeholder naming its type, as in transformers."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise TemplateError("messages must be a list of objects with a role and a content")
    prepared = []
    for message in messages:
        # OpenAI-style `content: null` / `tool_calls: null`: templates handle a missing key, not None.
        m = {k: _plain(v) for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        prepared.append(m)
    return prepared


# --- rendering ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderedChat:
    text: str
    # Turn-end markers the template writes after an assistant reply (plus eos_token when the template uses it).
    stops: tuple[str, ...]
    # (piece, from_message): the text split into what the template wrote and what came from messages.
    segments: Segments
    # Message texts the template changed beyond recognition (not found in `text`): encode_chat refuses them
    # when they spell a control token, since it could not keep that token plain.
    unplaced: tuple[str, ...] = ()


class ChatTemplate:
    def __init__(self, source: str, origin: str) -> None:
        self.source = source
        self.origin = origin
        self._stops_cache: dict[tuple[str | None, str | None], tuple[str, ...]] = {}
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TemplateError(f"{origin} does not compile: {exc.message} (line {exc.lineno})") from exc

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        add_generation_prompt: bool,
        bos_token: str | None,
        eos_token: str | None,
        extra: dict[str, Any],
    ) -> str:
        variables: dict[str, Any] = {"documents": None}
        # Like a tokenizer's special_tokens_map: a token the model does not have is not passed at all.
        if bos_token is not None:
            variables["bos_token"] = bos_token
        if eos_token is not None:
            variables["eos_token"] = eos_token
        variables.update(_plain(extra))
        variables.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"{self.origin} was refused by the sandbox: {exc}") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"{self.origin} failed to render: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
            raise TemplateError(f"{self.origin} failed to render: {type(exc).__name__}: {exc}") from exc
        except RecursionError as exc:
            raise TemplateError(f"{self.origin} failed to render: it recursed too deeply") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **extra: Any,
    ) -> RenderedChat:
        prepared = _prepare_messages(messages)
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
            raise TemplateError("tools must be a list of JSON schema objects")
        tools = _plain(tools)

        def render_messages(messages: list[dict[str, Any]]) -> str:
            return self._render(messages, tools, add_generation_prompt, bos_token, eos_token, extra)

        text = render_messages(prepared)
        spans, unplaced = _message_spans(text, prepared, render_messages)
        key = (bos_token, eos_token)
        if extra:  # the probe depends on the extra variables too; only the common case is kept
            stops = self._stops(bos_token, eos_token, extra)
        elif key in self._stops_cache:
            stops = self._stops_cache[key]
        else:
            stops = self._stops_cache[key] = self._stops(bos_token, eos_token, extra)
        return RenderedChat(text, stops, _cut(text, spans), tuple(unplaced))

    def _stops(self, bos_token: str | None, eos_token: str | None, extra: dict[str, Any]) -> tuple[str, ...]:
        """The turn-end marker the template writes after an assistant reply, read off a probe conversation:
        whatever follows the reply text up to the next line break."""
        reply = "POOT_PROBE_REPLY"
        found: list[str] = []
        probe = ""
        for conversation in (
            [{"role": "user", "content": "hello"}, {"role": "assistant", "content": reply}],
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "thanks"},
            ],
        ):
            try:
                probe = self._render(conversation, None, False, bos_token, eos_token, extra)
            except TemplateError:  # some templates insist on a system turn or a final user turn
                continue
            if reply in probe:
                break
        if reply in probe:
            after = probe[probe.index(reply) + len(reply) :].lstrip(" ")
            marker = after.split("\n", 1)[0].strip()
            if marker:
                found.append(marker)
        if eos_token and eos_token not in found and eos_token in probe:
            found.append(eos_token)
        return tuple(found)


# --- where the message text lies -------------------------------------------------------------------


def _message_spans(
    text: str, messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]
) -> tuple[list[tuple[int, int]], list[str]]:
    """Character spans of `text` that came from messages (`render` renders a conversation as `text` was). First
    try an exact alignment: render again with every message string replaced by a unique marker and check the
    real text is that render with the markers filled in. A template that inspects or rewrites content breaks the
    alignment; then each message's text is searched for in conversation order (a trimmed copy too)."""
    originals: list[str] = []

    def mark(value: str) -> str:
        originals.append(value)
        return f"\ue000{len(originals) - 1}\ue001"

    marked = [_map_message_strings(m, mark) for m in messages]
    try:
        marked_text = render(marked)
    except TemplateError:
        marked_text = None
    if marked_text is not None:
        spans = _align(text, marked_text, originals)
        if spans is not None:  # every message text the template wrote is accounted for
            return [(s, e) for s, e, _ in spans], []
    return _search(text, messages)


_MARKER = re.compile("\ue000(\\d+)\ue001")


def _map_message_strings(message: dict[str, Any], mark: Any) -> dict[str, Any]:
    """The message with its content text, reasoning and tool-call argument strings replaced by `mark(text)`."""

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return mark(value) if value else value
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = walk(content)
    elif isinstance(content, list):
        out["content"] = [
            {**p, "text": walk(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
            for p in content
        ]
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        marker = walk(reasoning)
        for key in _REASONING_FIELDS:
            if message.get(key) == reasoning:
                out[key] = marker
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        new_calls = []
        for call in calls:
            if isinstance(call, dict) and isinstance(call.get("function"), dict) and "arguments" in call["function"]:
                call = {**call, "function": {**call["function"], "arguments": walk(call["function"]["arguments"])}}
            new_calls.append(call)
        out["tool_calls"] = new_calls
    return out


def _align(text: str, marked_text: str, originals: list[str]) -> list[tuple[int, int, int]] | None:
    """Match `text` against the marked render: template pieces must be equal, each marker stands for its message
    text (as given, trimmed as `| trim` leaves it, or JSON-escaped). None when they do not line up."""
    parts = _MARKER.split(marked_text)  # [template, index, template, index, ..., template]
    spans: list[tuple[int, int, int]] = []
    pos = 0
    for k in range(0, len(parts), 2):
        template_piece = parts[k]
        if not text.startswith(template_piece, pos):
            return None
        pos += len(template_piece)
        if k + 1 == len(parts):
            break
        index = int(parts[k + 1])
        if index >= len(originals):
            return None
        following = parts[k + 2]
        original = originals[index]
        # As given, trimmed, or JSON-escaped (a template that writes `arguments | tojson` on a string).
        candidates = (original, original.strip(), original.rstrip(), original.lstrip())
        candidates += (json.dumps(original, ensure_ascii=False)[1:-1], json.dumps(original)[1:-1])
        for candidate in dict.fromkeys(candidates):
            end = pos + len(candidate)
            if text.startswith(candidate, pos) and text.startswith(following, end):
                if candidate:
                    spans.append((pos, end, index))
                pos = end
                break
        else:
            return None
    return spans if pos == len(text) else None


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """Every piece of user-supplied text a template may copy into the prompt, in conversation order."""
    texts: list[str] = []
    for m in messages:
        reasoning = m.get("reasoning_content")
        if isinstance(reasoning, str):
            texts.append(reasoning)
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                texts.append(args)
            elif args is not None:
                texts.append(json.dumps(args, ensure_ascii=False))
    return [t for t in texts if t]


def _search(text: str, messages: list[dict[str, Any]]) -> tuple[list[tuple[int, int]], list[str]]:
    """Find each message text in order after the previous one (the trimmed copy too); text not found stays
    template text and is reported as unplaced."""
    spans: list[tuple[int, int]] = []
    unplaced: list[str] = []
    cursor = 0
    for piece in _message_texts(messages):
        for candidate in dict.fromkeys((piece, piece.strip())):
            at = text.find(candidate, cursor) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
        else:
            if piece.strip():
                unplaced.append(piece)
    return spans, unplaced


def _cut(text: str, spans: list[tuple[int, int]]) -> Segments:
    segments: list[tuple[str, bool]] = []
    last = 0
    for start, end in sorted(spans):
        if start < last:  # overlapping finds: keep the first
            continue
        if start > last:
            segments.append((text[last:start], False))
        segments.append((text[start:end], True))
        last = end
    if last < len(text):
        segments.append((text[last:], False))
    return tuple(segments)


def compile_template(source: str, origin: str = "chat template") -> ChatTemplate:
    if not isinstance(source, str) or not source.strip():
        raise TemplateError(f"{origin} is empty")
    return ChatTemplate(source, origin)
