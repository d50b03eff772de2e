"""A chat reply as tool calls: the whole reply at the end, and a stream that shows content until a call may
begin (poot_core.driver.constraints reads the calls)."""

from __future__ import annotations

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
    """One streamed choice: `push` returns the content that is safe to show now; `end` returns the rest as
    (content, tool_calls)."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.text = ""
        self.shown = 0

    def push(self, piece: str) -> str:
        self.text += piece
        safe = 0 if self.tools.forced else tool_call_start(self.text, self.tools.format)
        safe = max(safe, self.shown)
        out, self.shown = self.text[self.shown : safe], safe
        return out

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = read_calls(self.tools, self.text)
        if calls:
            shown = self.text[: self.shown]
            rest = (content or "")[len(shown):] if (content or "").startswith(shown) else ""
            return rest, calls
        return self.text[self.shown :], []


def deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as one stream delta's tool_calls (each with its index)."""
    return [{"index": i, **call} for i, call in enumerate(calls)]
