"""Whether this test run executes Triton kernels in Triton's interpreter (chosen once, in tests/conftest.py)."""

from __future__ import annotations

import os


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
