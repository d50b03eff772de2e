"""`poot serve --tp N` / `--pp N`: the server on rank 0, every rank stepping the same serving engine.

A placed engine's ranks must make the same Driver calls in the same order (their collectives line up inside each
step). Rank 0 takes the HTTP requests; before each engine step it sends the other ranks what it did to its engine
since the last one (the requests it submitted, with their arguments, and the aborts), and every rank applies the
same and steps. The scheduler is deterministic, so all ranks then run the same steps. A request that samples
without a seed gets one drawn on rank 0 before it is sent, so every rank samples the same tokens. When rank 0 has
nothing to do it still sends an empty message every idle wait (a heartbeat), so an idle server never trips the
ranks' collective timeout; at the end it sends a stop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from poot_core.driver.core import GenerateRequest

STEP, STOP = "step", "stop"


class Lead:
    """Rank 0's side: the operations on its engine since the last step, sent to the other ranks before each."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self._ops: list[tuple[Any, ...]] = []

    @staticmethod
    def seeded(request: GenerateRequest) -> GenerateRequest:
        """The request with a drawn seed when it samples without one (each rank would draw its own)."""
        sampler = request.sampler
        if sampler.temperature == 0.0 or sampler.seed is not None:
            return request
        seed = int(np.random.SeedSequence().entropy % (1 << 63))
        return dataclasses.replace(request, sampler=dataclasses.replace(sampler, seed=seed))

    def submitted(self, request_id: int, request: GenerateRequest, kwargs: dict[str, Any]) -> None:
        self._ops.append(("submit", request_id, request, kwargs))

    def aborted(self, request_id: int) -> None:
        self._ops.append(("abort", request_id))

    def step(self) -> None:
        """Before rank 0's engine step: the other ranks apply the same operations and step too."""
        self._send(STEP)

    def stop(self) -> None:
        self._send(STOP)

    def _send(self, kind: str) -> None:
        ops, self._ops = self._ops, []
        self.coordinator.broadcast_object((kind, ops), 0)


def follow(engine: Any, coordinator: Any) -> None:
    """A rank other than 0: apply rank 0's operations to this rank's engine and step it, until rank 0 stops."""
    while True:
        kind, ops = coordinator.broadcast_object(None, 0)
        for op in ops:
            if op[0] == "submit":
                _, request_id, request, kwargs = op
                got = engine.submit(request, **kwargs)
                if got != request_id:
                    raise RuntimeError(f"rank {coordinator.rank} gave request {got} the id rank 0 gave as "
                                       f"{request_id}: the ranks' engines have diverged")
            else:
                engine.abort(op[1])
        if kind == STOP:
            return
        engine.step()


__all__ = ["Lead", "follow"]
