"""Steps ahead: the serving engine launches the next step before it reads the ids of the step in flight.

When every row that picks a token in the step in flight takes the device's argmax (a greedy sampler, no
log-probabilities or kept logits; a constraint only where its mask is applied on the device: the argmax is then
the masked logits'), the model has no recurrent state and the executor feeds steps
from the device (executor.FedSteps), the engine does not wait for that step's ids to schedule the next one:
each picking sequence gets a placeholder token (Sequence.unknown), the next step is scheduled and its inputs
built as usual, and the executor writes the argmax ids into the placeholders' token slots on the device before
the step runs. Only then are the ids read (the device already has the next step queued behind this one) and
settled in each request, and the text, stop strings and events follow while the device runs.

A sequence whose length limit ends with the step in flight gets no placeholder, so it is not scheduled again. A
request that end-of-sequence or a stop string ends has one row in the launched step; the row is dropped when
read (no event), as a stop string's row is in the pipelined order. The K/V that row writes is the real token's
(the device fed the id itself), so nothing it leaves in the blocks is wrong. Placeholders live within one
engine step: each is filled before step() returns. A sequence preempted while it holds one is not admitted
again before its id is read (Scheduler._admit), and the prefix cache keys no block that holds one
(Scheduler.advance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from poot_core.executor import FedSteps, Output, fed_steps

if TYPE_CHECKING:
    from poot_core.driver.engine import Event, ServingDriver, _Launched, _Request
    from poot_core.driver.scheduler import Sequence


class StepsAhead:
    def __init__(self, engine: ServingDriver) -> None:
        self.engine = engine
        self.executor: FedSteps | None = fed_steps(engine.driver.executor)
        self.on = True  # False: every step waits for the ids of the one before (the pipelined order)
        self.steps = 0  # steps launched ahead of the read of the one before
        self._slot: dict[int, int] = {}  # sequence id -> its slot in the step in flight, while it holds a placeholder

    def ready(self, done: _Launched) -> bool:
        """Whether the step after `done` may be launched before `done`'s ids are read."""
        engine = self.engine
        if not self.on or self.executor is None or engine.slots is not None or engine.keep_logits:
            return False
        if done.rows is not None:  # prompt scoring (the serial order; kept for safety)
            return False
        masks_on_device = engine.driver.masks.device is not None
        return all((req.constraint is None or masks_on_device) and req.logprobs is None
                   and req.request.sampler.is_greedy for _, req in done.picks)

    def launch(self, done: _Launched) -> tuple[list[Event], Any, list[tuple[Sequence, int]], Any]:
        """`done`'s constrained rows masked on the device (their masks were computed while it ran), placeholders
        for its picks, then the next step scheduled and launched, fed from `done`'s ids on the device: (the events
        of requests whose constraint failed; those ids, not read; the batch; what engine._launch returned, None
        for no batch)."""
        engine = self.engine
        assert self.executor is not None
        events: list[Event] = []
        out = done.out
        if any(req.constraint is not None for _, req in done.picks):
            picks = list(done.picks)  # _masked drops a request whose constraint failed, which then ends
            masked = engine._masked(picks, out, events)
            done.picks = picks
            if masked is not None:
                out = masked.output
        ids = self.executor.greedy_ids(out) if done.picks else None
        for slot, req in done.picks:
            seq = req.seq
            # a request ended while the step ran is gone; one whose limit this token reaches is not scheduled again
            if seq.id in engine._requests and len(req.generated) + 1 < req.limit:
                seq.unknown = len(seq.tokens)
                seq.tokens.append(0)
                self._slot[seq.id] = slot
        # none may fit while requests wait: blocks of a request this step ends are given back only when it is read
        batch = engine.scheduler.schedule()
        launched = engine._launch(batch, self._fed(batch, ids)) if batch else None
        self.steps += launched is not None
        return events, ids, batch, launched

    def _fed(self, batch: list[tuple[Sequence, int]], ids: Any) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """The step's token slots whose ids come from the step in flight, and those ids' slots there."""
        at, rows = [], []
        start = 0
        for seq, count in batch:
            if seq.computed <= seq.unknown < seq.computed + count:
                at.append(start + seq.unknown - seq.computed)
                rows.append(self._slot[seq.id])
            start += count
        if not at:
            return None
        return ids, np.array(at, dtype=np.int64), np.array(rows, dtype=np.int64)

    def run(self, program: Any, state: Any, inputs: dict[str, np.ndarray],
            fed: tuple[Any, np.ndarray, np.ndarray]) -> list[Output]:
        assert self.executor is not None
        return self.executor.run_fed(program, state, inputs, *fed)

    def settle(self, done: _Launched, ids: Any) -> None:
        """`done`'s ids read and taken by their requests (placeholders filled), text and events held."""
        engine = self.engine
        self._slot.clear()
        if ids is None:
            return
        assert self.executor is not None
        host = self.executor.read_ids(ids)
        for slot, req in done.picks:
            if req.seq.id in engine._requests:
                engine._hold(req, int(host[slot]), None)


def fill(seq: Sequence, token: int) -> bool:
    """Put a read id where the sequence held its placeholder; False when it held none."""
    if seq.unknown < 0:
        return False
    seq.tokens[seq.unknown] = token
    seq.unknown = -1
    return True


def picks(requests: dict[int, _Request], batch: list[tuple[Sequence, int]]) -> list[tuple[int, _Request]]:
    """The slots of a launched step whose sequence reached the end of its tokens (its next token is picked from
    the slot's logits), with their requests."""
    return [(slot, req) for slot, (seq, _) in enumerate(batch)
            if len(seq.tokens) == seq.computed and (req := requests.get(seq.id)) is not None]
