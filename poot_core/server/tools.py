"""A chat reply as tool calls: the whole reply at the end, and a stream that shows content until a call may
begin (tool_parsers.py reads the calls in the request's format). A stream sends each call's arguments in
fragments as they are generated, as vLLM does: under a named tool_choice the reply is the arguments; for
"required" and free ("auto") replies the calls begun so far are read (tool_parsers.partial_calls) and each call's
first delta carries its id and name, the next ones the arguments' new text. Pythonic calls arrive whole."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from poot_core.driver.constraints import _tool_functions, tool_calls_from_text
from poot_core.errors import RequestError
from poot_core.server import tool_parsers
from poot_core.server.generation import Tools


def read_calls(tools: Tools, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls). A forced call that does not parse (a reply cut short by max_tokens) stays content."""
    if tools.forced:
        try:
            return "", tool_calls_from_text(text, tools.choice)
        except (RequestError, KeyError, TypeError):
            return text, []
    return tool_parsers.parse(tools.format, text, tools.tools)


def finish(tools: Tools, calls: Sequence[Any], reason: str) -> str:
    """vLLM's finish_reason: "tool_calls" when calls were read from a free reply or a "required" one; a named
    function keeps the engine's reason (OpenAI's convention)."""
    if calls and not isinstance(tools.choice, dict):
        return "tool_calls"
    return reason


class ToolStream:
    """One streamed choice: `push` returns what a piece of the reply adds to the stream now and `end` the rest,
    each as (content, tool_calls deltas)."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.named = isinstance(tools.choice, dict)
        self.text = ""
        self.shown = 0
        self.fmt = tool_parsers.REQUIRED if tools.forced else tools.format
        # llama3_json reads only calls that name one of the tools (else the reply is content)
        self.names = set(_tool_functions(tools.tools)) if self.fmt == "llama3_json" else None
        self.sent: list[int] = []  # per call streamed: characters of its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.sent) or (self.named and bool(self.text))

    def push(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        if self.named:
            if not piece and self.text:
                return "", []
            first = not self.text
            self.text += piece
            if first:
                call = {"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": self.tools.choice["function"]["name"], "arguments": piece}}
                return "", [call]
            return "", [{"index": 0, "function": {"arguments": piece}}]
        self.text += piece
        out = ""
        if not self.sent:
            safe = 0 if self.tools.forced else tool_parsers.start(self.fmt, self.text)
            safe = max(safe, self.shown)
            out, self.shown = self.text[self.shown : safe], safe
        return out, self._deltas()

    def _deltas(self) -> list[dict[str, Any]]:
        """The calls' new deltas: a call is streamed once its name is read (and, for llama3_json, is a tool's),
        in order, stopping at the first that cannot be one. Arguments written as a JSON string go out whole."""
        out = []
        for k, call in enumerate(tool_parsers.partial_calls(self.fmt, self.text)):
            if not call.ok or call.name is None or (self.names is not None and call.name not in self.names):
                break
            args = call.arguments
            if args.startswith('"'):
                args = _unquoted(args) if call.done else ""
            if k == len(self.sent):
                self.sent.append(len(args))
                out.append({"index": k, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": call.name, "arguments": args}})
            elif len(args) > self.sent[k]:
                out.append({"index": k, "function": {"arguments": args[self.sent[k] :]}})
                self.sent[k] = len(args)
        return out

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        if self.named:
            return "", []
        deltas = self._deltas()
        if self.sent:  # the calls went out in fragments; what the reply held before them was shown
            return "", deltas
        content, calls = read_calls(self.tools, self.text)
        if calls:
            shown = self.text[: self.shown]
            rest = (content or "")[len(shown):] if (content or "").startswith(shown) else ""
            self.sent = [len(c["function"]["arguments"]) for c in calls]
            return rest, [{"index": i, **call} for i, call in enumerate(calls)]
        return self.text[self.shown :], []


def _unquoted(raw: str) -> str:
    """Arguments a model wrote as a JSON string holding JSON: that JSON (or "" when it is not)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""
