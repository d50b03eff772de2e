"""The serving engine's scheduler: which sequences run in the next step, with how many tokens, and their KV
blocks.

Each step has a token budget and a limit on running sequences. Running sequences that decode go first (one
token each, oldest first), then prefill chunks of running sequences, then waiting requests are admitted in
order of priority, first come first served within one tenant (a request that does not fit yet holds back those
behind it). Between tenants of one priority the next admission goes to the tenant with the fewest sequences
running, then to the one admitted longest ago (round robin), so a tenant that floods the queue gets its share
of the running slots and no more; without tenants (all None) this is plain first come, first served.
When a running sequence needs a block and the pool has none, the newest running sequence is
preempted: its blocks are given back and it waits again, keeping its tokens, so that it is recomputed later
and finishes as it would have. A sequence's tokens are its prompt and what it generated; `computed` of them
have their K/V in its blocks. A model with recurrent state also gives each running sequence one slot of a
StatePool (state_pool.py): admission waits for a free slot, and aborting or preemption gives it back. A sequence
that finishes leaves its slot and blocks as a kept state (state_pool.KeptStates) that a later request extending
its tokens continues from; kept states are given back first whenever an admission or a running sequence needs
room.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from poot_core.driver.embeddings import whole_spans
from poot_core.driver.kv_pool import KVPool
from poot_core.driver.prefix_cache import PrefixCache
from poot_core.driver.state_pool import Kept, KeptStates, StatePool


@dataclass(eq=False)
class Sequence:
    id: int
    tokens: list[int]
    priority: int = 0
    salt: str | None = None
    tenant: str | None = None  # whose request: admission is fair between tenants of one priority
    arrival: int = 0  # submission order
    computed: int = 0  # tokens whose K/V is in the blocks
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the first full blocks
    preemptions: int = 0
    reused: int = 0  # prompt tokens found in the prefix cache (or a kept state) at the last admission
    # speculative decoding: tokens proposed to follow `tokens`, run after its last one in the next step (they
    # are not in `tokens` until the verify step keeps them)
    draft: list[int] = field(default_factory=list)
    slot: int = -1  # its recurrent state slot while it runs (StatePool), else -1
    # steps ahead (ahead.py): the index in `tokens` of a token the step in flight computes on the device and the
    # next step already runs (its id is not read yet; tokens holds 0 there), else -1
    unknown: int = -1
    # prompt runs no step may split ([start, end): an image's tokens that attend to each other both ways)
    whole: list[tuple[int, int]] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    def order(self) -> tuple[int, int]:
        return (-self.priority, self.arrival)


@dataclass
class Limits:
    step_tokens: int
    max_running: int
    prefill_chunk: int


class Scheduler:
    def __init__(self, pool: KVPool, limits: Limits, slots: StatePool | None = None) -> None:
        if limits.step_tokens < 1 or limits.max_running < 1 or limits.prefill_chunk < 1:
            raise ValueError(f"scheduler limits must be positive: {limits}")
        self.pool, self.limits, self.slots = pool, limits, slots
        self.kept = KeptStates() if slots is not None else None  # finished sequences' recurrent states
        self.waiting: list[Sequence] = []  # kept in order()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self._running: set[Sequence] = set()  # the same sequences, for membership tests in O(1)
        self.preemptions = 0
        # tokens the next step keeps from decode for a sequence whose whole run (an image) found no room in this
        # one: without it such a run could wait as long as others keep decoding
        self._held_back = 0
        self._admissions = 0  # admissions so far, and each tenant's last one (its turn in the round robin)
        self._last_admitted: dict[str | None, int] = {}

    @property
    def cache(self) -> PrefixCache | None:
        return self.pool.cache

    # --- queues ---------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._wait(seq)

    def _wait(self, seq: Sequence) -> None:
        at = len(self.waiting)
        while at > 0 and self.waiting[at - 1].order() > seq.order():
            at -= 1
        self.waiting.insert(at, seq)

    def remove(self, seq: Sequence, keep: bool = False) -> None:
        """Forget a sequence (finished or aborted), giving its blocks back; keep: a running sequence that finished
        leaves its recurrent state and blocks as a kept state instead."""
        if seq in self._running:
            self.running.remove(seq)
            self._running.discard(seq)
            if keep and self.kept is not None and seq.slot >= 0 and seq.unknown < 0 and seq.computed > 0:
                self.kept.keep(Kept(seq.tokens[: seq.computed], seq.salt, seq.blocks, seq.slot))
                seq.blocks, seq.keys, seq.computed, seq.draft, seq.slot = [], [], 0, [], -1
                return
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _drop_kept(self, spare: Kept | None = None) -> bool:
        """Give back the oldest kept state's slot and blocks (other than `spare`); False when none is kept."""
        kept = self.kept.oldest(spare) if self.kept is not None else None
        if kept is None:
            return False
        for block in kept.blocks:
            self.pool.release(block)
        assert self.slots is not None
        self.slots.release(kept.slot)
        return True

    def _free(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self.pool.release(block)
        seq.blocks, seq.keys, seq.computed, seq.draft = [], [], 0, []
        if seq.slot >= 0:
            assert self.slots is not None
            self.slots.release(seq.slot)
            seq.slot = -1

    # --- one step -------------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, tokens it runs) in step order, within the budgets."""
        chosen: dict[Sequence, int] = {}
        budget = self.limits.step_tokens - self._held_back  # decode gives way to a whole run that waited
        self._held_back = 0
        size, running = self.pool.block_size, self._running
        for seq in list(self.running):  # decode first
            if budget == 0:
                break
            if not seq.draft:  # one token, in room its last block has, or in a block reserved for it
                if seq in running and len(seq.tokens) - seq.computed == 1 and (
                        len(seq.blocks) * size > seq.computed or self._reserve(seq, seq.computed + 1, chosen)):
                    chosen[seq] = 1
                    budget -= 1
                continue
            n = min(1 + len(seq.draft), budget)  # with its draft, if any: as much of it as the budget holds
            if n > 1 and self.pool.blocks_for(seq.computed + n) - len(seq.blocks) > self.pool.available:
                n = 1  # draft tokens never preempt anyone: they run only in blocks the pool has to spare
            if seq in self._running and seq.pending == 1 and self._reserve(seq, seq.computed + n, chosen):
                chosen[seq] = n
                del seq.draft[n - 1 :]
                budget -= n
        used = sum(chosen.values())
        for seq in list(self.running):  # then the prefill chunks of running sequences
            budget = self.limits.step_tokens - used
            if budget == 0:
                break
            if seq in running and seq not in chosen and len(seq.tokens) - seq.computed > 1:
                n = self._chunk(seq, seq.computed, min(seq.pending, self.limits.prefill_chunk, budget), budget)
                if n == 0:
                    continue
                preempted = self.preemptions
                if self._reserve(seq, seq.computed + n, chosen):
                    chosen[seq] = n
                    used += n
                if self.preemptions != preempted:  # a preemption may have taken chosen tokens out of the step
                    used = sum(chosen.values())
        budget = self.limits.step_tokens - sum(chosen.values())
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_running:
            seq = self._next_waiting()
            n = self._admit(seq, budget)
            if n == 0:
                break  # first come, first served: nothing behind it goes first
            chosen[seq] = n
            budget -= n
        return list(chosen.items())

    def _chunk(self, seq: Sequence, start: int, n: int, budget: int) -> int:
        """The tokens of a prefill chunk from `start`: n, or fewer or more so that it splits none of the
        sequence's whole runs (0: the run waits, and the next step keeps room for it)."""
        if not seq.whole:
            return n
        taken = whole_spans(seq.whole, start, n, budget)
        if taken == 0:
            self._held_back = max(self._held_back, whole_spans(seq.whole, start, n, self.limits.step_tokens))
        return taken

    def _next_waiting(self) -> Sequence:
        """The request to admit next: of the highest priority waiting, each tenant's oldest is a candidate, and
        the tenant with the fewest running sequences wins, then the one whose last admission is the oldest, then
        the earliest arrival."""
        top = self.waiting[0].priority
        heads: dict[str | None, Sequence] = {}
        for seq in self.waiting:
            if seq.priority != top:
                break
            heads.setdefault(seq.tenant, seq)
        if len(heads) == 1:
            return self.waiting[0]
        running: dict[str | None, int] = {}
        for seq in self.running:
            running[seq.tenant] = running.get(seq.tenant, 0) + 1
        return min(heads.values(), key=lambda s: (running.get(s.tenant, 0), self._last_admitted.get(s.tenant, -1),
                                                  s.arrival))

    def _reserve(self, seq: Sequence, positions: int, chosen: dict[Sequence, int]) -> bool:
        """Blocks for `positions` positions of a running sequence, preempting the newest others when the pool
        is short. False when `seq` itself had to be preempted."""
        need = self.pool.blocks_for(positions) - len(seq.blocks)
        while need > self.pool.available:
            if self._drop_kept():
                continue
            victim = self.running[-1]
            self._preempt(victim, chosen)
            if victim is seq:
                return False
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
        return True

    def _preempt(self, seq: Sequence, chosen: dict[Sequence, int]) -> None:
        self.running.remove(seq)
        self._running.discard(seq)
        chosen.pop(seq, None)
        self._free(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self._wait(seq)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Admit the head of the queue with its first chunk when the pool has room (never preempting for it):
        the tokens it runs now, or 0."""
        if seq.unknown >= 0:  # preempted while a token of it was in flight: it waits until the id is read
            return 0
        kept = self.kept.find(seq.tokens, seq.salt) if self.kept is not None else None
        hits = self._cached_prefix(seq, count=False)  # none with recurrent state (no prefix cache)
        have = kept.blocks if kept is not None else hits
        computed = len(kept.tokens) if kept is not None else len(hits) * self.pool.block_size
        n = self._chunk(seq, computed, min(len(seq.tokens) - computed, self.limits.prefill_chunk, budget), budget)
        if n == 0:
            return 0
        idle_hits = sum(1 for b in hits if self.cache is not None and self.cache.is_idle(b))
        need = max(self.pool.blocks_for(computed + n) - len(have), 0)

        def short() -> bool:
            slot_short = self.slots is not None and kept is None and not self.slots.available
            return need > self.pool.available - idle_hits or slot_short

        while short() and self._drop_kept(spare=kept):
            pass
        if short():
            return 0
        if kept is not None:
            self.kept.take(kept)  # type: ignore[union-attr]
            seq.blocks, seq.slot = list(kept.blocks), kept.slot
        else:
            hits = self._cached_prefix(seq, count=True)
            for block in hits:
                self.pool.retain(block)
            seq.blocks = list(hits)
            if self.slots is not None:
                seq.slot = self.slots.allocate()
        seq.computed = seq.reused = computed
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
        self.waiting.remove(seq)
        self.running.append(seq)
        self._running.add(seq)
        self._last_admitted[seq.tenant] = self._admissions
        self._admissions += 1
        return n

    def _cached_prefix(self, seq: Sequence, count: bool) -> list[int]:
        """The cached blocks of the sequence's full leading blocks, stopping at the first miss; at least one
        token is left to run (its logits pick the next token). Fills seq.keys when counted."""
        cache = self.cache
        if cache is None:
            return []
        size = self.pool.block_size
        found, keys, previous = [], [], None
        for i in range((len(seq.tokens) - 1) // size):
            key = cache.key(previous, seq.tokens[i * size : (i + 1) * size], seq.salt)
            block = cache.find(key) if count else cache.peek(key)
            if block is None:
                break
            found.append(block)
            keys.append(key)
            previous = key
        if count:
            seq.keys = keys
        return found

    def verified(self, seq: Sequence, kept: int) -> None:
        """After a verify step that kept `kept` of the sequence's run (its last token and the drafts kept): those
        are computed; blocks reserved only for rejected drafts go back (their positions are written over later)."""
        self.advance([(seq, kept)])
        keep = self.pool.blocks_for(seq.computed + 1)
        for block in reversed(seq.blocks[keep:]):
            self.pool.release(block)
        seq.blocks = seq.blocks[:keep]  # a new list: a list of blocks is only ever appended to (the engine's tables)

    def known(self, seq: Sequence) -> None:
        """The sequence's placeholder took its id (ahead.py): blocks it completed are made findable."""
        if self.cache is not None and len(seq.keys) < seq.computed // self.pool.block_size:
            self.advance([(seq, 0)])

    def advance(self, ran: Iterable[tuple[Sequence, int]]) -> None:
        """After the step: the tokens ran are computed; blocks that became full of known tokens are made
        findable."""
        cache, size = self.cache, self.pool.block_size
        for seq, n in ran:
            seq.computed += n
            if cache is None:
                continue
            full = (seq.computed if seq.unknown < 0 else min(seq.computed, seq.unknown)) // size
            while len(seq.keys) < full:
                i = len(seq.keys)
                key = cache.key(seq.keys[-1] if seq.keys else None, seq.tokens[i * size : (i + 1) * size], seq.salt)
                seq.keys.append(key)
                cache.add(key, seq.blocks[i])
