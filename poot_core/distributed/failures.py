"""The typed failure of a group of ranks: a collective that timed out or lost its peer, or a spawned rank that
raised or died. Raised in every surviving rank (and by `Coordinator.spawn` in the parent) instead of a hang or a
raw gloo/NCCL trace."""

from __future__ import annotations

from typing import Any

from poot_core.errors import PootError


class RankFailure(PootError):
    """A rank of a placed model failed. `rank`: the rank that reports it (None: the spawning parent); `op`: the
    collective or step that failed; the message says which peer or what timed out, and what to do."""

    def __init__(self, message: str, *, rank: int | None = None, op: str = "",
                 results: dict[int, Any] | None = None) -> None:
        self.rank = rank
        self.op = op
        self.results = results or {}  # from spawn: what the ranks that finished returned
        super().__init__(message)


__all__ = ["RankFailure"]
