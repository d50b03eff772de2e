"""Tool calls in a free chat reply (tool_choice "auto"), in the formats of vLLM's parsers of the same names:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5/3); the text
  before the first block is content.
- mistral: `[TOOL_CALLS]` then a JSON array (or object) of {"name", "arguments"}, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (repeated per call); the text before the token is content.
- llama3_json: an optional `<|python_tag|>`, then one or more JSON objects {"name", "parameters" or "arguments"}
  separated by `;`, naming tools of the request (Llama 3.1+).

Text after complete JSON calls is dropped (a stream has sent the calls by the time it comes).
- pythonic: a Python list of calls with keyword arguments of literal values, `[f(a=1), g(b="x")]`, optionally
  within `<|python_start|>`/`<|python_end|>` (Llama 3.2 / 4).

`--tool-call-parser NAME` picks one; without it the chat template decides (`choose`). A reply that does not
parse in the format is plain content (never an error). For streams, `partial_calls` reads the calls begun so far
with the raw text of their arguments, always a prefix of the finished arguments (JSON values end where their
brackets close), so a stream can send the arguments in fragments as vLLM does; pythonic calls are read only
whole (their arguments are Python, written out as JSON).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poot_core.driver.constraints import HERMES_OPEN, _call, _tool_functions, tool_call_start, tool_calls_from_reply
from poot_core.errors import RequestError

NAMES = ("hermes", "mistral", "llama3_json", "pythonic")
MISTRAL, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"
PYTHONIC_START, PYTHONIC_END = "<|python_start|>", "<|python_end|>"
REQUIRED = "required"  # the JSON array a forced "required" call is constrained to (constraints.tool_call_constraint)

Calls = tuple[str | None, list[dict[str, Any]]]


def choose(name: str | None, chat_template: str | None) -> str:
    """The parser: the one named (--tool-call-parser), else the chat template's format: Hermes when it spells
    `<tool_call>`, Mistral when it spells `[TOOL_CALLS]`, else Llama 3's JSON."""
    if name is not None:
        if name not in NAMES:
            raise RequestError(f"unknown tool-call parser {name!r}; choose one of {', '.join(NAMES)}")
        return name
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL in template:
        return "mistral"
    return "llama3_json"


def parse(fmt: str, text: str, tools: Sequence[Mapping[str, Any]] | None) -> Calls:
    """(content, tool_calls) of a whole reply; (text, []) when it holds no call or one that does not parse."""
    try:
        if fmt == "hermes":
            return tool_calls_from_reply(text, tools, "hermes")
        if fmt == "mistral":
            return _mistral(text)
        if fmt == "llama3_json":
            return _llama3_json(text, set(_tool_functions(tools)))
        if fmt == "pythonic":
            return _pythonic(text)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, RequestError):
        return text, []  # SyntaxError: a pythonic reply that is not Python
    raise RequestError(f"unknown tool-call parser {fmt!r}")


def start(fmt: str, text: str) -> int:
    """How much of a streamed reply is content for certain: where a call may begin."""
    if fmt == "hermes":
        return tool_call_start(text, "hermes")
    if fmt == "mistral":
        return _marker_start(text, MISTRAL)
    head = text.lstrip()
    opens = ("{", PYTHON_TAG) if fmt == "llama3_json" else ("[", PYTHONIC_START)
    if not head or any(head.startswith(o) or o.startswith(head) for o in opens):
        return 0
    return len(text)


def _marker_start(text: str, marker: str) -> int:
    at = text.find(marker)
    if at >= 0:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _mistral(text: str) -> Calls:
    at = text.find(MISTRAL)
    if at < 0:
        return text, []
    calls = []
    for segment in text[at + len(MISTRAL) :].split(MISTRAL):
        seg = segment.strip()
        if not seg:
            continue
        if seg[0] in "[{":
            value = json.JSONDecoder().raw_decode(seg)[0]  # text after it is dropped, as a stream would have
            items = value if isinstance(value, list) else [value]
        else:
            name, sep, args = seg.partition(MISTRAL_ARGS)
            name = name.split(MISTRAL_CALL_ID, 1)[0].strip()
            if not sep or not name:
                return text, []
            items = [{"name": name, "arguments": json.JSONDecoder().raw_decode(args.lstrip())[0]}]
        for item in items:
            call = _call(item, None)
            if call is None:
                return text, []
            calls.append(call)
    if not calls:
        return text, []
    return _content(text[:at]), calls


def _llama3_json(text: str, names: set[str]) -> Calls:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        value, i = decoder.raw_decode(body, i)
        call = _call(value, names)
        if call is None:
            return text, []
        calls.append(call)
        i = _skip(body, i)
        if i < len(body):
            if body[i] != ";":
                break  # text after the calls is dropped (a stream has sent the calls by then)
            i = _skip(body, i + 1)
    return None, calls


def _pythonic(text: str) -> Calls:
    body = text.strip().removeprefix(PYTHONIC_START).removesuffix(PYTHONIC_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    tree = ast.parse(body, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls = []
    for element in tree.elts:
        if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name) or element.args:
            return text, []
        args = {}
        for keyword in element.keywords:
            if keyword.arg is None:  # **kwargs
                return text, []
            args[keyword.arg] = ast.literal_eval(keyword.value)
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)  # a set, bytes or NaN: not a call
        call = _call({"name": element.func.id, "arguments": json.loads(arguments)}, None)
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


# --- streaming: calls begun so far ---------------------------------------------------------------------------
@dataclass
class Partial:
    """A call read so far: its name once complete, the raw text of its arguments so far (a prefix of the
    finished arguments), whether they are finished; ok False once the text cannot be a call any more."""

    name: str | None = None
    arguments: str = ""
    done: bool = False
    ok: bool = True


_WS = " \t\r\n"


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Where the JSON value starting at s[i] ends; None while it may still grow."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None


def _scan_object(s: str, i: int, keys: tuple[str, ...]) -> tuple[Partial, int | None]:
    """The call in the JSON object at s[i] ("{"): its name and arguments so far, and where the object ends."""
    call, j = Partial(), i + 1
    while True:
        j = _skip(s, j)
        if j >= len(s):
            return call, None
        if s[j] == "}":
            return call, j + 1
        if s[j] == ",":
            j += 1
            continue
        if s[j] != '"':
            call.ok = False
            return call, None
        key_end = _string_end(s, j)
        if key_end is None:
            return call, None
        key = s[j + 1 : key_end - 1]
        j = _skip(s, key_end)
        if j >= len(s):
            return call, None
        if s[j] != ":":
            call.ok = False
            return call, None
        j = _skip(s, j + 1)
        if j >= len(s):
            return call, None
        end = _value_end(s, j)
        if key == "name":
            if end is None:
                return call, None
            try:
                name = json.loads(s[j:end])
            except ValueError:
                name = None
            if not isinstance(name, str):
                call.ok = False
                return call, None
            call.name = name
        elif key in keys and not call.done:
            call.arguments, call.done = (s[j:], False) if end is None else (s[j:end], True)
            if end is None:
                return call, None
        elif end is None:
            return call, None
        j = end


def _objects(s: str, i: int, keys: tuple[str, ...], separators: str) -> list[Partial]:
    """The calls of a run of JSON objects from s[i], between `separators`."""
    out: list[Partial] = []
    while True:
        i = _skip(s, i)
        while i < len(s) and s[i] in separators:
            i = _skip(s, i + 1)
        if i >= len(s):
            return out
        if s[i] != "{":
            if out:
                out[-1].ok = out[-1].ok and s[i] in "]"
            return out
        call, end = _scan_object(s, i, keys)
        out.append(call)
        if end is None or not call.ok:
            return out
        i = end


def partial_calls(fmt: str, text: str) -> list[Partial]:
    """The calls begun so far in a streamed reply in format `fmt` (or REQUIRED: a forced call's array)."""
    args = ("arguments", "parameters")
    if fmt == REQUIRED:
        head = _skip(text, 0)
        return _objects(text, head + 1, ("parameters",), ",") if text[head : head + 1] == "[" else []
    if fmt == "hermes":
        out = []
        for block in text.split(HERMES_OPEN)[1:]:
            at = _skip(block, 0)
            if at < len(block) and block[at] == "{":
                out.append(_scan_object(block, at, args)[0])
            elif at < len(block):
                out.append(Partial(ok=False))
        return out
    if fmt == "llama3_json":
        at = _skip(text, 0)
        if text.startswith(PYTHON_TAG, at):
            at += len(PYTHON_TAG)
        return _objects(text, at, args, ";")
    if fmt == "mistral":
        at = text.find(MISTRAL)
        if at < 0:
            return []
        rest = text[at + len(MISTRAL) :]
        head = _skip(rest, 0)
        if head >= len(rest):
            return []
        if rest[head] in "[{":
            return _objects(rest, head + (rest[head] == "["), ("arguments",), ",")
        out = []
        for segment in rest.split(MISTRAL):
            name, sep, raw = segment.partition(MISTRAL_ARGS)
            if not sep:
                if segment.strip():
                    out.append(Partial())  # the name is still being written
                break
            call = Partial(name=name.split(MISTRAL_CALL_ID, 1)[0].strip())
            j = _skip(raw, 0)
            end = _value_end(raw, j) if j < len(raw) else None
            call.arguments, call.done = (raw[j:], False) if end is None else (raw[j:end], True)
            out.append(call)
        return out
    return []  # pythonic: read whole at the end
