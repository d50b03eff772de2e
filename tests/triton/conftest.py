"""Fixtures of the Triton kernel tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def gemv_override() -> Iterator[dict[str, Any]]:
    """matmul.GEMV_OVERRIDE (GEMV kind -> Tile) for the test to force tiles in, restored afterwards."""
    from poot_kernels_triton import matmul

    saved = dict(matmul.GEMV_OVERRIDE)
    yield matmul.GEMV_OVERRIDE
    matmul.GEMV_OVERRIDE.clear()
    matmul.GEMV_OVERRIDE.update(saved)
