"""Running a prepared step: bind the state's buffers (once per state), enqueue every launch, copy the outputs.

Host work per step is one enqueue per kernel (kernels/enqueue.py: the library's call, no event): arguments
were bound when the step was prepared, the start position travels in the positions buffer, and the KV caches
are rebound only when the caller hands a different state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .kernels.enqueue import Enqueuer
from .kernels.launch import Arr, Launch
from .kernels.runtime import Runtime


@dataclass
class Output:
    """One output of a step in its own device buffer. `ids` (u32, one per position) holds the argmax of each
    logits row when the output is logits, so greedy decoding reads back 4 bytes a row."""

    runtime: Runtime
    buf: Any
    shape: tuple[int, ...]
    ids: Any | None = None


class Step:
    def __init__(self, runtime: Runtime, launches: list[Launch]) -> None:
        self.runtime = runtime
        self.launches = launches
        self._slotted = [launch for launch in launches if launch.slots]
        self._bound: tuple[int, ...] | None = None
        self.enqueue = Enqueuer(runtime.queue, launches)

    def bind(self, state: dict[str, Any]) -> None:
        key = tuple(id(state[name]) for name in sorted(state))
        if key != self._bound:
            for launch in self._slotted:
                launch.bind(state)
            self._bound = key

    def run(self, state: dict[str, Any], outputs: list[Arr], ids: Arr | None) -> list[Output]:
        self.bind(state)
        self.enqueue()
        results = []
        for value in outputs:
            nbytes = 4 * value.size
            fresh = self.runtime.buffer(nbytes)
            self.runtime.copy(value.buf, fresh, nbytes)
            results.append(Output(self.runtime, fresh, tuple(value.shape)))
        if ids is not None and results:
            fresh = self.runtime.buffer(4 * ids.size)
            self.runtime.copy(ids.buf, fresh, 4 * ids.size)
            results[0].ids = fresh
        return results
