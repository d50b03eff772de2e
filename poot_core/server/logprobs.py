"""Token log-probabilities in the response shapes of vLLM's OpenAI server.

Chat: choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}. Completions: choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs" (one dict of token
to logprob per position: the top alternatives and the sampled token), "text_offset"}. Each token is its id
decoded alone; -inf (a token a constraint refused) is written as -9999.0, as vLLM and OpenAI do.

Prompt tokens (completions' echo with logprobs, and vLLM's prompt_logprobs): the log-softmax of the model's logits
at each prompt position for the next prompt token, the first token None (nothing predicts it), as vLLM gives
them. The serving engine gives them from the request's own prefill chunks (driver/prompt_logprobs.py);
`prompt_steps` here runs a prefill of its own through Driver.logits, for an engine that speculates (its verify
steps read no prompt rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poot_core.driver.prompt_logprobs import PromptStep, prompt_step
from poot_core.driver.sampling import TokenLogprobs
from poot_core.text.services import TextServices

if TYPE_CHECKING:
    from poot_core.driver.core import Driver

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


def prompt_steps(driver: Driver, prompt: list[int], top: int) -> list[PromptStep | None]:
    """The prompt's log-probabilities with `top` alternatives each: None for the first token, then one step per
    token from the logits of the position before it."""
    logits = driver.logits(prompt)
    return [None, *(prompt_step(logits[i - 1], prompt[i], top) for i in range(1, len(prompt)))]


def prompt_logprobs_field(text: TextServices, steps: list[PromptStep | None], top: int) -> list[Any]:
    """vLLM's choices[].prompt_logprobs: per prompt position None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}} for the `top` most likely tokens and the prompt's own."""
    out: list[Any] = []
    for step in steps:
        if step is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": _value(lp), "rank": r, "decoded_token": _token(text, t)}
                 for r, (t, lp) in enumerate(step.logprobs.top[:top], 1)}
        entry[str(step.logprobs.token)] = {"logprob": _value(step.logprobs.logprob), "rank": step.rank,
                                           "decoded_token": _token(text, step.logprobs.token)}
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

    def prompt(self, ids: list[int], steps: list[PromptStep | None], top: int) -> dict[str, Any]:
        """The echoed prompt's block: the first token's logprob and top_logprobs None (vLLM), then `top`
        alternatives per token."""
        out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token_id, step in zip(ids, steps, strict=True):
            if step is None:
                token = _token(self.text, token_id)
                out["tokens"].append(token)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                out["text_offset"].append(self.offset)
                self.offset += len(token)
                continue
            trimmed = TokenLogprobs(step.logprobs.token, step.logprobs.logprob, step.logprobs.top[:top])
            for key, values in self.block([trimmed]).items():
                out[key] += values
        return out


def joined(*blocks: dict[str, Any]) -> dict[str, Any]:
    """Completion logprobs blocks one after the other (the echoed prompt's, then the reply's)."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for block in blocks:
        for key in out:
            out[key] += block[key]
    return out
