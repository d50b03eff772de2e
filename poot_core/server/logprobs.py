"""Token log-probabilities in the response shapes of vLLM's OpenAI server.

Chat: choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}. Completions: choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs" (one dict of token
to logprob per position: the top alternatives and the sampled token), "text_offset"}. Each token is its id
decoded alone; -inf (a token a constraint refused) is written as -9999.0, as vLLM and OpenAI do.
"""

from __future__ import annotations

from typing import Any

from poot_core.driver.sampling import TokenLogprobs
from poot_core.text.services import TextServices

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def _token(text: TextServices, token: int) -> str:
    return text.decode([token])


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_content(text: TextServices, steps: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """The `content` list of a chat choice's logprobs, one entry per generated token."""
    out = []
    for step in steps:
        entry = _entry(_token(text, step.token), step.logprob)
        entry["top_logprobs"] = [_entry(_token(text, t), lp) for t, lp in step.top]
        out.append(entry)
    return out


class CompletionLogprobs:
    """A completion choice's logprobs, built a few tokens at a time (a stream) or all at once; text_offset
    counts characters of the decoded tokens from the start of the completion."""

    def __init__(self, text: TextServices) -> None:
        self.text = text
        self.offset = 0

    def block(self, steps: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for step in steps:
            token = _token(self.text, step.token)
            tokens.append(token)
            values.append(_value(step.logprob))
            top = {_token(self.text, t): _value(lp) for t, lp in step.top}
            top.setdefault(token, _value(step.logprob))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(token)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}
