"""Speculative decoding in the serving engine (Layout.PAGED): each sequence speculates on its own.

Before a step is scheduled, every running sequence that decodes next asks its own proposer (prompt lookup over
its own history, or a draft model) for a few tokens; the scheduler gives such a sequence 1 + len(draft) tokens
of the step's budget, and the step is the ordinary flat paged step with those tokens in the sequence's run. The
logits of every position of the run are read through extra sequence slots: a slot that owns no token but whose
logit_index points at one of the run's positions (the run's last position stays with the sequence's own slot).
The kept tokens (speculation.accept) then go through the engine's path one by one (end of sequence, stops,
callbacks, limits) and the sequence's computed count covers only the kept ones: the rejected positions stay in
the blocks, unread, until later tokens write over them (no copy), and blocks past the kept run go back to the
pool.

Proposal lengths follow each sequence's own tokens (the schedule of Speculation: 2 more after a proposal kept
whole, else one past what was kept), so a sequence's tokens never depend on its neighbours. Speculation pauses
while more than DriverOptions.draft_max_batch sequences run: a batched step already reads the weights once for
many tokens, and the verify positions then cost more than they save. Requests under a constraint decode without
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from poot_core.driver.sampling import token_logprobs
from poot_core.driver.speculation import (
    DraftModel,
    DraftModelProposer,
    LookupProposer,
    Off,
    PromptLookup,
    Proposal,
    Speculation,
    accept,
)
from poot_core.errors import PootError, Reason, Unsupported

if TYPE_CHECKING:
    from poot_core.driver.engine import Event, ServingDriver, _Request
    from poot_core.driver.scheduler import Sequence


@dataclass
class SpeculationCounters:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # ... and kept
    verify_steps: int = 0  # sequence runs that verified a proposal

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class EngineSpeculation:
    def __init__(self, engine: ServingDriver) -> None:
        self.engine = engine
        options = engine.driver.options
        self.policy = options.draft
        self.max_batch = options.draft_max_batch
        self.counters = SpeculationCounters()
        self._own: dict[int, Speculation] = {}  # request id -> its speculation
        self._proposals: dict[int, Proposal] = {}  # request id -> the proposal of the step being scheduled
        from poot_core.driver.engine import _buckets

        # a verify step's slots: the sequences and one per draft token
        self._slot_buckets = _buckets(options.max_running + options.step_tokens)

    def begin(self, req: _Request) -> None:
        """A submitted request gets its own proposer (none under a constraint)."""
        if req.constraint is not None:
            return
        policy = self.policy
        if isinstance(policy, PromptLookup):
            proposer = LookupProposer(policy)
        else:
            assert isinstance(policy, DraftModel)
            # one draft model for all sequences: its contiguous cache keeps the prefix it shares with the
            # sequence it proposes for, so switching sequences re-runs the rest of the history
            shared = self.engine.driver._speculation
            assert shared is not None and isinstance(shared.proposer, DraftModelProposer)
            proposer = DraftModelProposer(policy, self.engine.driver, shared.proposer.driver)
        spec = Speculation(proposer, policy.k, policy.min_k, scheduled=True)
        spec.begin(req.seq.tokens)
        self._own[req.seq.id] = spec

    def end(self, request_id: int) -> None:
        self._own.pop(request_id, None)
        self._proposals.pop(request_id, None)

    def propose(self) -> None:
        """Drafts for the running sequences that decode next (Sequence.draft); none above max_batch."""
        engine = self.engine
        running = engine.scheduler.running
        on = len(running) <= self.max_batch
        self._proposals.clear()
        for seq in running:
            seq.draft = []
            spec = self._own.get(seq.id)
            if not on or spec is None or seq.pending != 1:
                continue
            req = engine._requests[seq.id]
            position = len(seq.tokens) - 1
            room = min(req.limit - len(req.generated), engine.capacity - position) - 1
            proposal = spec.propose(seq.tokens, room, req.request.sampler)
            if proposal is not None:
                seq.draft = list(proposal.tokens)
                self._proposals[seq.id] = proposal

    def verify(self, batch: list[tuple[Sequence, int]]) -> list[Event]:
        """Run a step in which some sequences verify drafts; their kept tokens and the others' picks as events."""
        from poot_core.driver.engine import _bucket

        engine = self.engine
        plain = [(seq, n) for seq, n in batch if not seq.draft]
        drafted = [(seq, n) for seq, n in batch if seq.draft]
        ordered = plain + drafted  # plain sequences in slots 0.., as the engine's own sampling reads them
        tokens = sum(n for _, n in batch)
        slots = len(batch) + sum(n - 1 for _, n in drafted)
        shape = engine._shape(_bucket(engine._token_buckets, tokens), _bucket(self._slot_buckets, slots))
        inputs = engine._inputs(shape, ordered)
        rows = self._verify_rows(ordered, inputs["logit_index"])
        try:
            out = engine.program(shape).run(engine._state, inputs)[0]
        except PootError as exc:
            events: list[Event] = []
            for seq, _ in batch:
                events.extend(engine._finish(engine._requests[seq.id], "error", exc))
            return events
        engine.steps += 1
        engine.scheduler.advance(plain)
        events = engine._sample(plain, out)
        logits = engine.driver.executor.to_numpy(out)[0]
        for seq, _ in drafted:
            events.extend(self._keep(engine._requests[seq.id], logits[rows[seq.id]]))
        return events

    def _verify_rows(self, ordered: list[tuple[Sequence, int]], logit_index: np.ndarray) -> dict[int, list[int]]:
        """Point one extra slot at each position of a drafted run but its last: sequence id -> its logit rows."""
        rows: dict[int, list[int]] = {}
        start, extra = 0, len(ordered)
        for slot, (seq, n) in enumerate(ordered):
            if seq.draft:
                own = list(range(extra, extra + n - 1))
                logit_index[own] = np.arange(start, start + n - 1)
                rows[seq.id] = [*own, slot]
                extra += n - 1
            start += n
        return rows

    def _keep(self, req: _Request, logits: np.ndarray) -> list[Event]:
        """The verify rule over one sequence's rows, then its kept tokens through the engine's path."""
        engine, seq = self.engine, req.seq
        proposal = self._proposals.pop(seq.id)
        drafts = seq.draft  # the scheduler may have cut it to the step's budget
        proposal = Proposal(drafts, None if proposal.q is None else proposal.q[: len(drafts)])
        seq.draft = []
        try:
            decided = accept(logits, proposal, req.request.sampler, seq.tokens, req.prompt_len)
        except PootError as exc:
            return engine._finish(req, "error", exc)
        kept = len(decided) - 1
        self._own[seq.id].kept(len(drafts), kept)
        self.counters.proposed += len(drafts)
        self.counters.accepted += kept
        self.counters.verify_steps += 1
        req.proposed += len(drafts)
        req.accepted += kept
        req.verify_steps += 1
        events: list[Event] = []
        for i, token in enumerate(decided):
            logprobs = None
            if req.logprobs is not None:
                logprobs = token_logprobs(logits[i], token, req.request.logprobs or 0)
                req.logprobs.append(logprobs)
            if engine.keep_logits:
                engine.logits[seq.id].append(logits[i].copy())
            events.extend(engine._accept(req, token, logprobs))
            if seq.id not in engine._requests:  # it ended inside the run: its blocks are already given back
                return events
        engine.scheduler.verified(seq, 1 + kept)  # the last token and the kept drafts are computed
        return events


def engine_speculation(engine: ServingDriver) -> EngineSpeculation | None:
    """The engine's speculation for the driver's policy; None for OFF. MTP has no paged form yet."""
    policy = engine.driver.options.draft
    if isinstance(policy, Off):
        return None
    if not isinstance(policy, PromptLookup | DraftModel):
        raise Unsupported(Reason.SHAPE, f"{type(policy).__name__} speculation in the paged layout",
                          "the paged engine speculates with prompt lookup or a draft model; serve(Layout.CONTIGUOUS) "
                          "runs MTP")
    return EngineSpeculation(engine)
