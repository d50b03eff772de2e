"""Prompt log-probabilities from the serving engine's own prefill chunks (completions' echo, prompt_logprobs).

A request submitted with `prompt_logprobs=k` gets, for every prompt token after the first, the log-softmax of
the model's logits at the position before it: the token's own log-probability, its rank and the k most likely
tokens. They come out of the steps that run the request's prompt anyway: the step reads the logits of the
chunk's positions through extra sequence slots (a slot that owns no token but whose logit_index points at one
of the chunk's positions, as the speculative engine reads a verify run), and each chunk's rows are reduced to
their PromptStep at once, so nothing of size prompt x vocab is kept and no second prefill runs.

The steps reach the caller as a PromptEvent among the step's events, before the request's first token (a
request with max_new 0 runs its prompt, gives the event, then finishes with "length").

Such a request reads no block of the prefix cache (vLLM's rule too: a cached block has no logits to give): its
blocks are keyed with a salt of its own, so its prompt is computed in full. After a preemption it recomputes
from its own cached blocks, whose positions it has already scored. The first token has no step (None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from poot_core.driver.sampling import TokenLogprobs, token_logprobs

if TYPE_CHECKING:
    from poot_core.driver.engine import ServingDriver
    from poot_core.driver.scheduler import Sequence
    from poot_core.executor import Output


@dataclass(frozen=True)
class PromptStep:
    """One prompt token after the first: its log-probability and top alternatives, and its rank in the
    model's distribution (1: the most likely)."""

    logprobs: TokenLogprobs
    rank: int


def prompt_step(logits: np.ndarray, token: int, top: int) -> PromptStep:
    """The step of `token` from the logits of the position before it."""
    row = np.asarray(logits, dtype=np.float64)
    return PromptStep(token_logprobs(row, token, top), 1 + int(np.count_nonzero(row > row[token])))


@dataclass(frozen=True)
class PromptEvent:
    """A request's prompt steps: None for the first token, then one per prompt token."""

    request_id: int
    steps: list[PromptStep | None]


@dataclass
class _Scoring:
    prompt: list[int]
    top: int
    steps: list[PromptStep | None] = field(default_factory=lambda: [None])

    @property
    def scored(self) -> int:
        """Positions scored so far: position p gives the step of prompt token p + 1."""
        return len(self.steps) - 1


@dataclass
class RowPlan:
    """The logit rows one step reads for prompt scoring: (request id, logit slot, position) in position order
    per request, and the extra slots that needs beyond one per sequence."""

    rows: list[tuple[int, int, int]]
    extra: list[tuple[int, int]]  # (slot, flat token index) for the slots that own no token


class PromptScores:
    def __init__(self, engine: ServingDriver) -> None:
        from poot_core.driver.engine import _buckets

        self.engine = engine
        options = engine.driver.options
        self._open: dict[int, _Scoring] = {}  # request id -> its scoring, until its last prompt position ran
        self.slot_buckets = _buckets(options.max_running + options.step_tokens)  # sequences and scored rows

    def begin(self, request_id: int, prompt: list[int], top: int, salt: str | None) -> str:
        """Start scoring a submitted request's prompt; returns the cache salt its blocks are keyed with (one of
        its own: no cached block is read). A one-token prompt's event is ready at once."""
        scoring = _Scoring(list(prompt), top)
        if len(prompt) == 1:
            self.engine._backlog.append(PromptEvent(request_id, scoring.steps))
        else:
            self._open[request_id] = scoring
        return f"{salt or ''}\x00prompt-logprobs {request_id}"

    def scoring(self, request_id: int) -> bool:
        """Whether the request's prompt still has positions to score."""
        return request_id in self._open

    def open(self) -> bool:
        """Whether any request's prompt is still being scored."""
        return bool(self._open)

    def end(self, request_id: int) -> None:
        """The request finished or was aborted."""
        self._open.pop(request_id, None)

    def plan(self, batch: list[tuple[Sequence, int]]) -> RowPlan | None:
        """The rows this step must read, or None when no sequence of it scores prompt positions. A sequence's
        last position in the step keeps its own slot; the others get extra slots after the batch's."""
        if not self._open:
            return None
        rows: list[tuple[int, int, int]] = []
        extra: list[tuple[int, int]] = []
        flat = 0
        for slot, (seq, count) in enumerate(batch):
            scoring = self._open.get(seq.id)
            if scoring is not None:
                first, last = seq.computed, seq.computed + count - 1
                for position in range(max(first, scoring.scored), min(last + 1, len(scoring.prompt) - 1)):
                    if position == last:
                        rows.append((seq.id, slot, position))
                    else:
                        extra.append((len(batch) + len(extra), flat + position - first))
                        rows.append((seq.id, extra[-1][0], position))
            flat += count
        return RowPlan(rows, extra) if rows else None

    def point(self, plan: RowPlan, logit_index: np.ndarray) -> None:
        for slot, index in plan.extra:
            logit_index[slot] = index

    def score(self, plan: RowPlan, out: Output) -> list:
        """Reduce the step's rows to prompt steps. A request whose last prompt position ran gets its event; one
        that generates nothing (max_new 0) then finishes."""
        engine = self.engine
        logits = engine.driver.executor.to_numpy(out)[0]
        touched: dict[int, _Scoring] = {}
        for request_id, slot, position in plan.rows:
            scoring = self._open[request_id]
            assert position == scoring.scored, "a request's rows come in position order, each once"
            scoring.steps.append(prompt_step(logits[slot], scoring.prompt[position + 1], scoring.top))
            touched[request_id] = scoring
        events: list = []
        for request_id, scoring in touched.items():
            if scoring.scored == len(scoring.prompt) - 1:
                del self._open[request_id]
                events.append(PromptEvent(request_id, scoring.steps))
                req = engine._requests[request_id]
                if req.limit == 0:
                    events.extend(engine._finish(req, "length"))
        return events
