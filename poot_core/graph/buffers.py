"""The device buffers of one prepared step: a value gets a buffer, and the buffer goes back to a free list
once the last value aliasing it has had its last reader (passes.last_use), so a later value of the same size
reuses it.

A backend that plans a step node by node (OpenCL, Vulkan) gives the pool how to allocate a buffer of a
number of bytes, how to wrap a buffer as its own array type, and how to find the buffer under an array (a
reshape is a second value over the same buffer). Every value is counted in 32-bit words, as those backends
keep them (float32 activations, uint32 ids).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from poot_core.errors import Reason, Unsupported
from poot_core.graph.ir import Graph, Node, ValueRef
from poot_core.graph.passes import last_use

B = TypeVar("B")  # the backend's device buffer
A = TypeVar("A")  # the backend's array: a buffer with a shape and a dtype

WORD = 4  # bytes per element


class BufferPool(Generic[B, A]):
    """Buffers for a graph's values, reused by size once the values they hold are dead.

    `take` gives a buffer that belongs to no value yet (scratch, or one `define` then names); `define` names
    an array as a value, counting one more live value on its buffer; `release` after node i drops the values
    whose last reader was node i and frees each buffer left with no live value. Only buffers the pool took
    are ever freed: a view of a step input or a weight is counted but never handed out again."""

    def __init__(
        self,
        graph: Graph,
        allocate: Callable[[int], B],
        array: Callable[[B, tuple[int, ...], str], A],
        buffer_of: Callable[[A], B],
    ) -> None:
        self._allocate, self._array, self._buffer_of = allocate, array, buffer_of
        self.values: dict[str, A] = {}
        self.last_use = last_use(graph)
        self._late: dict[int, list[str]] = {}  # node index -> values an earlier node's fusion made it read
        self._free: dict[int, list[B]] = {}  # bytes -> free buffers of that size
        self._bytes: dict[int, int] = {}  # id(buffer) -> its bytes, for every buffer the pool took
        self._users: dict[int, int] = {}  # id(buffer) -> live values aliasing it
        self._scratch: dict[tuple[str, tuple[int, ...]], A] = {}

    def take(self, shape: tuple[int, ...], dtype: str = "f32") -> A:
        nbytes = max(WORD, WORD * math.prod(shape))
        free = self._free.get(nbytes)
        buffer = free.pop() if free else self._allocate(nbytes)
        self._bytes[id(buffer)] = nbytes
        self._users[id(buffer)] = 0
        return self._array(buffer, tuple(shape), dtype)

    def define(self, name: str, array: A) -> A:
        self.values[name] = array
        key = id(self._buffer_of(array))
        self._users[key] = self._users.get(key, 0) + 1
        return array

    def new(self, name: str, shape: tuple[int, ...]) -> A:
        return self.define(name, self.take(tuple(shape)))

    def scratch(self, key: str, shape: tuple[int, ...]) -> A:
        """A buffer for what lives inside one node's kernels, shared by every node asking for the same key and
        shape (a step's kernels run in order); never freed."""
        found = self._scratch.get((key, shape))
        if found is None:
            found = self._scratch[(key, shape)] = self.take(shape)
        return found

    def value(self, node: Node, name: str) -> A:
        """The value `name` that `node` reads; refused by name when no earlier node computed it."""
        found = self.values.get(name)
        if found is None:
            raise Unsupported(Reason.OPERATION, f"{node.op} input {name}", "the value is not computed by the step")
        return found

    def read_later(self, names: Iterable[str], at: int, reader: int | None = None) -> None:
        """Node `reader` (default `at + 1`) reads these too (a fusion moved node `at`'s work into it): a value
        whose last reader was `at` lives until after `reader`."""
        reader = at + 1 if reader is None else reader
        for name in names:
            if at <= self.last_use.get(name, -1) < reader:
                self.last_use[name] = reader
                self._late.setdefault(reader, []).append(name)

    def last_reader(self, name: str, at: int) -> bool:
        """Whether node `at` is the last reader of value `name` and nothing else lives in its buffer (so the
        node may overwrite it in place)."""
        found = self.values.get(name)
        return (found is not None and self.last_use.get(name) == at
                and self._users.get(id(self._buffer_of(found))) == 1)

    def release(self, at: int, node: Node) -> None:
        """After node `at`: a buffer whose every aliasing value is dead goes back to the free list."""
        read = (r.name for r in node.inputs if isinstance(r, ValueRef))
        for name in {*read, node.output, *self._late.get(at, ())}:
            found = self.values.get(name)
            if found is None or self.last_use.get(name, -1) > at:
                continue
            buffer = self._buffer_of(found)
            key = id(buffer)
            self._users[key] -= 1
            if self._users[key] == 0 and key in self._bytes:
                self._free.setdefault(self._bytes[key], []).append(buffer)


__all__ = ["WORD", "BufferPool"]
