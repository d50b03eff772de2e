"""The KV pool's bookkeeping: which of its fixed-size blocks are free, held (reference counts) or idle in the
prefix cache. The blocks themselves are the executor's state buffers ([blocks, kv_heads, block_size, dim] per
layer); this module only hands out their ids.

Recurrent state (a hybrid family's convolution windows and SSM states: one fixed-size slot per layer and running
sequence) has its own pool of the same form next to this one (state_pool.py).
"""

from __future__ import annotations

from collections import deque

from poot_core.driver.prefix_cache import PrefixCache


class KVPool:
    def __init__(self, blocks: int, block_size: int, cache: PrefixCache | None = None) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs blocks and block_size >= 1, got {blocks} and {block_size}")
        self.blocks, self.block_size, self.cache = blocks, block_size, cache
        self.refs = [0] * blocks
        self._free: deque[int] = deque(range(blocks))

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free ones, then idle cached ones (evicted)."""
        return len(self._free) + (self.cache.idle_blocks if self.cache else 0)

    @property
    def held(self) -> int:
        return self.blocks - self.available

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self.cache is not None and self.cache.idle_blocks:
            block = self.cache.evict()
        else:
            raise RuntimeError("the KV pool is empty (the scheduler checks `available` first)")
        self.refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        """One more holder of a (cached) block."""
        if self.refs[block] == 0 and self.cache is not None:
            self.cache.claim(block)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] < 0:
            raise RuntimeError(f"KV block {block} released more often than held")
        if self.refs[block] == 0:
            if self.cache is not None and self.cache.holds(block):
                self.cache.idle(block)
            else:
                self._free.append(block)
