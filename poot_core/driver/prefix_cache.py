"""The prefix cache of the serving engine: full KV blocks found again by what they hold.

A full block's key digests (the key of the block before it, its tokens, the request's salt), so a key names a
whole prefix: two requests share a block only when everything before it and in it is the same and their salts
are. A cached block that no sequence holds is idle: it stays findable until the pool needs it, and idle blocks
are given back least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CacheCounters:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0  # ... and found
    evictions: int = 0  # idle cached blocks taken back by the pool
    inserted: int = 0  # full blocks made findable


class PrefixCache:
    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.counters = CacheCounters()

    @staticmethod
    def key(previous: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(previous or b"\0" * 16)
        h.update(array("I", tokens).tobytes())  # 4 bytes a token: keys live in one process, any byte order
        h.update(b"\1" + salt.encode() if salt is not None else b"\0")
        return h.digest()

    def find(self, key: bytes) -> int | None:
        """The block cached under `key`, counted as a query (and a hit)."""
        self.counters.queries += 1
        block = self._block_of.get(key)
        if block is not None:
            self.counters.hits += 1
        return block

    def peek(self, key: bytes) -> int | None:
        """As find, uncounted (admission checks whether a request fits before it commits)."""
        return self._block_of.get(key)

    def add(self, key: bytes, block: int) -> None:
        """Make a full block findable; a key cached already keeps its block (this one stays private)."""
        if key in self._block_of or block in self._key_of:
            return
        self._block_of[key] = block
        self._key_of[block] = key
        self.counters.inserted += 1

    def holds(self, block: int) -> bool:
        return block in self._key_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def idle(self, block: int) -> None:
        """No sequence holds the cached `block` any more: it becomes the most recently used idle block."""
        self._idle[block] = None

    def claim(self, block: int) -> None:
        """A sequence holds the cached `block` again."""
        self._idle.pop(block, None)

    @property
    def idle_blocks(self) -> int:
        return len(self._idle)

    @property
    def cached_blocks(self) -> int:
        return len(self._key_of)

    def evict(self) -> int:
        """Forget the least recently used idle block and give it to the caller (the pool)."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        self.counters.evictions += 1
        return block
