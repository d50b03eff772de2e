"""A chat reply as tool calls: the whole reply at the end, and a stream that shows content until a call may
begin (poot_core.driver.constraints reads the calls). A stream under a named tool_choice sends the arguments as
they are generated, as vLLM does (the constrained reply is the arguments); other calls arrive in one delta."""

from __future__ import annotations

import uuid
from typing import Any

from poot_core.driver.constraints import tool_call_start, tool_calls_from_reply, tool_calls_from_text
from poot_core.errors import RequestError
from poot_core.server.generation import Tools


def read_calls(tools: Tools, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls). A forced call that does not parse (a reply cut short by max_tokens) stays content."""
    if tools.forced:
        try:
            return "", tool_calls_from_text(text, tools.choice)
        except (RequestError, KeyError, TypeError):
            return text, []
    return tool_calls_from_reply(text, tools.tools, tools.format)


def finish(tools: Tools, calls: list[dict[str, Any]], reason: str) -> str:
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
        safe = 0 if self.tools.forced else tool_call_start(self.text, self.tools.format)
        safe = max(safe, self.shown)
        out, self.shown = self.text[self.shown : safe], safe
        return out, []

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        if self.named:
            return "", []
        content, calls = read_calls(self.tools, self.text)
        if calls:
            shown = self.text[: self.shown]
            rest = (content or "")[len(shown):] if (content or "").startswith(shown) else ""
            return rest, [{"index": i, **call} for i, call in enumerate(calls)]
        return self.text[self.shown :], []
