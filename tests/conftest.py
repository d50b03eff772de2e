"""Shared fixtures: tiny random checkpoints built once per test session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# The one place the Triton mode is chosen, for the whole run (triton.jit reads it when a kernel is decorated, so a
# test module setting it would decide for every module imported after it): without a GPU the kernels run in
# Triton's interpreter; with one they are compiled for it, unless TRITON_INTERPRET=1 is given.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # triton must load before lavapipe's Vulkan driver: each bundles its own LLVM, and the other order crashes
    import triton  # noqa: F401
except ImportError:
    pass

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from helpers import tiny  # noqa: E402
from helpers.triton_mode import interpreted  # noqa: E402

torch.set_num_threads(1)  # test workers run side by side (pytest -n 2): one thread each avoids oversubscription

_BUILT: dict[tuple[str, str, str], Path] = {}
Build = Callable[[Path, str, torch.dtype], Path]


def _built(factory: pytest.TempPathFactory, build: Build, arch: str, dtype: torch.dtype) -> Path:
    """The checkpoint `build` saves for (arch, dtype), built at its first request in this session."""
    key = (build.__module__, arch, str(dtype))
    if key not in _BUILT:
        _BUILT[key] = build(factory.mktemp(f"{arch}-{str(dtype).removeprefix('torch.')}"), arch, dtype)
    return _BUILT[key]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_checkpoint(arch, dtype) -> path of a saved random dense checkpoint (helpers.tiny)."""
    return lambda arch, dtype=torch.float32: _built(tmp_path_factory, tiny.build, arch, dtype)


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """moe_checkpoint(arch, dtype) -> path of a saved random mixture-of-experts checkpoint (helpers.moe)."""
    from helpers import moe  # imports transformers: only for the tests that ask

    return lambda arch, dtype=torch.float32: _built(tmp_path_factory, moe.build, arch, dtype)


@pytest.fixture(scope="session")
def hybrid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """hybrid_checkpoint(arch, dtype) -> path of a saved random hybrid checkpoint (helpers.hybrid)."""
    from helpers import hybrid  # imports transformers: only for the tests that ask

    return lambda arch, dtype=torch.float32: _built(tmp_path_factory, hybrid.build, arch, dtype)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interpreter: Triton kernels on CPU tensors, run only under TRITON_INTERPRET=1 (the default without a GPU)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if interpreted():
        return
    skip = pytest.mark.skip(reason="Triton kernels are compiled for the GPU in this run; TRITON_INTERPRET=1 runs this")
    for item in items:
        if item.get_closest_marker("interpreter"):
            item.add_marker(skip)
