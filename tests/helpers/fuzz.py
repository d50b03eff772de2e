"""What the checkpoint fuzz tests require of every read of a mutated file: it ends, in time, either well or
with poot's own typed error (anything else, a crash or a hang, fails the test)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

BUDGET_S = 2.0  # one parse of a file this small must never take longer


def outcome(read: Callable[[Path], object], path: Path) -> str:
    """"ok" or "error" (a PootError) of read(path), asserting it took less than BUDGET_S."""
    from poot_core.errors import PootError

    start = time.perf_counter()
    try:
        read(path)
        result = "ok"
    except PootError:
        result = "error"
    assert time.perf_counter() - start < BUDGET_S
    return result
