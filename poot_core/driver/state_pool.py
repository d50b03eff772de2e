"""Recurrent state in the serving engine: one fixed-size slot per running sequence, next to the KV blocks.

A hybrid family's recurrent layers (graph.RECURRENT_KINDS: convolution windows, SSM and delta-rule states) keep a
state of fixed size per sequence that summarizes every token it holds. In a paged step each such layer's state is
a pool of `slots` slots (Paging.state_slots); a sequence takes one slot at admission (the same index in every
layer's pool), gives it back when it finishes, is aborted or is preempted, and the step tells each recurrent op
which slot each sequence reads and writes (the `state_slots` input). A run that starts at position 0 (a new
sequence, or a preempted one being recomputed from its tokens) starts its slot from zeros.

Such state cannot be cut back to a shorter prefix, so the prefix cache is off for these models (a cached KV block
would need the recurrent state at its boundary too): reuse is exact or not at all. What is reused is a finished
sequence's whole state: when a sequence ends (end of sequence, its length limit, a stop string) its slot and KV
blocks are kept (KeptStates), and a later request whose prompt starts with every token they hold, and is longer,
continues from them (a conversation's next turn), prefilling only its new tokens. Kept states are given back,
least recently kept first, whenever an admission or a running sequence needs their slot or blocks, so keeping
never holds back or preempts a request. Speculative decoding, whose rejected tokens would have to be taken back
out of the state, is refused.

The pools are sized together from one budget: `DriverOptions.state_slots` slots (default: max_running), each
counted at its real bytes, and the KV blocks from what is left.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from poot_core.errors import CapacityError, RequestError
from poot_core.executor import state_nbytes
from poot_core.graph import Graph, Paging, StepShape

if TYPE_CHECKING:
    from poot_core.driver.core import Driver
    from poot_core.driver.scheduler import Sequence


class StatePool:
    """Which recurrent state slots are free; the slots themselves are the executor's state buffers."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a state pool needs slots >= 1, got {slots}")
        self.slots = slots
        self._free: deque[int] = deque(range(slots))
        self._held: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        return len(self._held)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("the state pool is empty (the scheduler checks `available` first)")
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"state slot {slot} released but not held")
        self._held.discard(slot)
        self._free.append(slot)


@dataclasses.dataclass(eq=False)
class Kept:
    """A finished sequence's recurrent state slot and KV blocks, which hold exactly `tokens`."""

    tokens: list[int]
    salt: str | None
    blocks: list[int]
    slot: int


class KeptStates:
    """Finished sequences' states, oldest first, found again by a prompt that extends their tokens."""

    def __init__(self) -> None:
        self._kept: OrderedDict[Kept, None] = OrderedDict()  # least recently kept first
        self.reused = 0  # kept states a request continued from

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def blocks(self) -> int:
        """KV blocks the kept states hold."""
        return sum(len(kept.blocks) for kept in self._kept)

    def keep(self, kept: Kept) -> None:
        self._kept[kept] = None

    def find(self, tokens: list[int], salt: str | None) -> Kept | None:
        """The longest kept state whose tokens begin `tokens` (at least one token of `tokens` is left to run: its
        logits pick the next token), under the same cache salt; not taken."""
        best: Kept | None = None
        for kept in self._kept:
            n = len(kept.tokens)
            if (n < len(tokens) and kept.salt == salt and (best is None or n > len(best.tokens))
                    and kept.tokens[-1] == tokens[n - 1] and tokens[:n] == kept.tokens):
                best = kept
        return best

    def take(self, kept: Kept) -> None:
        """A request continues from `kept`: it owns the slot and blocks now."""
        del self._kept[kept]
        self.reused += 1

    def oldest(self, spare: Kept | None = None) -> Kept | None:
        """Forget the least recently kept state other than `spare` and give it to the caller, who frees its slot
        and blocks; None when there is none."""
        victim = next((kept for kept in self._kept if kept is not spare), None)
        if victim is not None:
            del self._kept[victim]
        return victim


def slot_index(batch: Iterable[tuple[Sequence, int]], seqs: int) -> np.ndarray:
    """The step's state_slots input: the slot of each sequence slot of the step (padding slots read slot 0 and
    own no token, so nothing is written there for them)."""
    index = np.zeros(seqs, dtype=np.int64)
    slots = [seq.slot for seq, _ in batch]
    index[: len(slots)] = slots
    return index


def pool_sizes(driver: Driver, block_size: int, max_blocks: int, recurrent: bool) -> tuple[int, int]:
    """(KV blocks, state slots; 0 without recurrent state) of a serving engine. kv_blocks and state_slots are
    taken as given; otherwise the slots' bytes come out of kv_fraction of the free memory first (each slot with
    at least one block beside it) and the blocks fill the rest, never more than max_running full windows."""
    options = driver.options
    slots = 0
    if recurrent:
        slots = options.state_slots if options.state_slots is not None else options.max_running
        if slots < 1:
            raise RequestError(f"state_slots must be positive, got {slots}")
    enough = options.max_running * max_blocks  # every running sequence at its full window
    if options.kv_blocks is not None:
        if options.kv_blocks < 1:
            raise RequestError(f"kv_blocks must be positive, got {options.kv_blocks}")
        return options.kv_blocks, slots
    if not 0.0 < options.kv_fraction <= 1.0:
        raise RequestError(f"kv_fraction must be in (0, 1], got {options.kv_fraction}")
    paging = Paging(1, block_size, 1, max_blocks, state_slots=1 if recurrent else 0)
    probe = driver._trace(StepShape(1, 1, block_size, paging=paging))  # one block and one slot of every pool
    per_block, per_slot = _bytes(driver, probe, recurrent=False), _bytes(driver, probe, recurrent=True)
    budget = int(options.kv_fraction * driver.executor.memory()["free"])
    if recurrent:
        slots = min(slots, budget // (per_slot + per_block))
        if slots < 1:
            raise CapacityError(f"not one recurrent state slot of {per_slot} bytes (and a KV block of {per_block}) "
                                f"fits in {options.kv_fraction} of the free memory; raise kv_fraction or set "
                                "kv_blocks and state_slots")
    if per_block == 0:  # no attention layer (Mamba2): the blocks are bookkeeping only
        return enough, slots
    blocks = min((budget - slots * per_slot) // per_block, enough)
    if blocks < 1:
        raise CapacityError(f"not one KV block of {per_block} bytes fits in {options.kv_fraction} of the "
                            "free memory; raise kv_fraction or set kv_blocks")
    return blocks, slots


def _bytes(driver: Driver, graph: Graph, recurrent: bool) -> int:
    """The executor's bytes of the graph's recurrent (or KV) state alone."""
    part = dataclasses.replace(graph, state={n: s for n, s in graph.state.items() if s.recurrent == recurrent})
    return state_nbytes(driver.executor, part, driver.weights)
