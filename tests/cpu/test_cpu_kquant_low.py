"""The C kernels for GGUF Q2_K, Q3_K and IQ4_XS (csrc/kquant_low.c) against the gguf package and float64.

Blocks are fresh random bytes with float16 scales of realistic sizes (the gguf package cannot quantize these
types), plus blocks at the edges: zero scales, subnormal and largest float16 scales, all-zero and all-one
codes. Dequantization must equal gguf.quants.dequantize bit for bit, in the machine's build (its vector
route) and in one without vector instructions (the portable C); products must match the float64 product of
those weights, and packed_linear must reach them through the C route for few and many rows alike.
"""

from __future__ import annotations

import ctypes
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from helpers import gguf_models as tiny_models
from helpers import tiny
from helpers.c_builds import BUILDS, library
from helpers.gguf_blocks import F16_FIELDS  # byte offsets of each block's float16 fields
from poot_core import Driver, DriverOptions, ModelHandle, open_executor
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.cpu import c_kernels
from poot_core.cpu import packed_linear as pl

pytestmark = pytest.mark.skipif(shutil.which(c_kernels.compiler()) is None, reason="no C compiler")

TYPES = ["Q2_K", "Q3_K", "IQ4_XS"]


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def blocks_of(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row]: random codes and sub-scales, float16 scales of either sign with magnitudes
    from 2^-20 (subnormal in float16) to 2^-4; the first blocks are edge cases."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        scale = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-20, -4, n))
        raw[:, at : at + 2] = _f16_bytes(scale)
    edges = min(n, 4)
    raw[0:edges:4, :] = 0  # zero codes and scales
    raw[1:edges:4, :] = 255  # all bits set: largest codes, NaN scales, rewritten next
    for at in F16_FIELDS[type_name]:
        raw[1:edges:4, at : at + 2] = _f16_bytes(np.array([65504.0]))
        raw[2:edges:4, at : at + 2] = _f16_bytes(np.array([-6e-8]))  # the smallest subnormal
    return raw.reshape(rows, -1)


def _reference(blocks: np.ndarray, type_name: str) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)


def _case(build: str, type_name: str, rows: int, cols: int, seed: int) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """The library of `build`, the C kernel of the type, random blocks of a rows x cols matrix and their values
    as gguf dequantizes them."""
    blocks = blocks_of(type_name, rows, cols, seed=seed)
    return library(build), pl.C_TYPES[type_name], blocks, _reference(blocks, type_name)


def _bound(x: np.ndarray, w: np.ndarray, rel: float) -> np.ndarray:
    """rel times the sum of |x| |w| per output: what float32 sums in some order may be off by."""
    return rel * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-30


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("type_name", TYPES)
def test_dequant_is_bit_exact(type_name: str, build: str) -> None:
    rows, cols = 37, 5 * 256
    lib, kernel, blocks, ref = _case(build, type_name, rows, cols, seed=1)
    for start, count, threads in ((0, rows, 2), (5, 13, 1)):  # a tile starting inside the matrix
        out = np.full((count, cols), np.nan, np.float32)
        lib.poot_dequant_kl(kernel.type_id, blocks[start:].ctypes.data, blocks.shape[1], count, cols // 256,
                            out.ctypes.data, threads)
        np.testing.assert_array_equal(out.view(np.uint32), ref[start : start + count].view(np.uint32))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("type_name", TYPES)
def test_gemv_matches_float64(type_name: str, build: str) -> None:
    rows, cols = 29, 6 * 256
    lib, kernel, blocks, ref = _case(build, type_name, rows, cols, seed=2)
    for m in (1, 2, 3, 4, 5, 9):  # above four, rows are taken four at a time
        x = np.random.default_rng(m).standard_normal((m, cols)).astype(np.float32)
        y = np.full((m, rows), np.nan, np.float32)
        lib.poot_gemv_kl(kernel.type_id, blocks.ctypes.data, blocks.shape[1], rows, cols // 256, x.ctypes.data, m,
                         y.ctypes.data, 2)
        expect = x.astype(np.float64) @ ref.astype(np.float64).T
        assert (np.abs(y - expect) <= _bound(x, ref, 1e-6)).all(), f"m={m}: {np.abs(y - expect).max()}"


class CountingLib:
    """The kernel library with its calls counted by name (to show which route a product took). Each function is
    a C function pointer of the kernel's signature (callable, and castable to an address like the real one)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib, self.calls = lib, Counter[str]()
        self._wrapped: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name not in self._wrapped:
            fn = getattr(self.lib, name)
            argtypes, restype = c_kernels.SIGNATURES[name]

            def counted(*args: Any) -> Any:
                self.calls[name] += 1
                return fn(*args)

            self._wrapped[name] = ctypes.CFUNCTYPE(restype, *argtypes)(counted)
        return self._wrapped[name]


@pytest.fixture
def c_route(monkeypatch: pytest.MonkeyPatch) -> CountingLib:
    """packed_linear with the machine's kernels (whatever the executor's own feature policy for this machine)
    and no torch fallback: a packed product that does not take the C route fails."""
    lib = CountingLib(library("native"))
    monkeypatch.setattr(pl, "kernels", lambda: lib)
    monkeypatch.setattr(pl, "_plans", type(pl._plans)())  # plans made here hold the counting library

    def no_torch(*args: Any) -> None:
        raise AssertionError("the torch route was taken")

    monkeypatch.setattr(pl, "_tiled", no_torch)
    return lib


def _packed(blocks: np.ndarray, type_name: str, cols: int) -> PackedWeight:
    return PackedWeight("gguf", (blocks.shape[0], cols), {"blocks": torch.from_numpy(blocks)}, {"type": type_name})


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("batch", [1, 3, 64, 77])
def test_packed_linear_takes_the_c_route(c_route: CountingLib, type_name: str, batch: int) -> None:
    out_features, cols = 300, 512
    blocks = blocks_of(type_name, out_features, cols, seed=batch)
    w = _packed(blocks, type_name, cols)
    assert pl.uses_c_kernel(w)
    x = torch.randn(batch, cols)
    y = pl.packed_linear(x, w)
    ref = _reference(blocks, type_name)
    expect = x.double().numpy() @ ref.astype(np.float64).T
    # the prefill panels sum each output in one FMA chain over k: a looser sum-order bound than the kernel's own
    assert (np.abs(y.numpy() - expect) <= _bound(x.numpy(), ref, 1e-5)).all()
    few = batch <= pl.FUSED_MAX_ROWS
    if not few:
        # csrc/gemm.c: one call, dequantizing W in panels by its own vector decoders (not poot_dequant_kl)
        assert c_route.calls == Counter({"poot_gemm_panels": 1})
    elif batch == 1:
        assert c_route.calls == Counter({"poot_gemv_kl": 1})
    else:  # 2-4 rows of these types: csrc/rows.c gives each row gemv calls of its own (one per chunk of W), since
        # their lone row sums in another order than grouped rows (CKernel.one_row_route): bit for bit lone rows
        assert set(c_route.calls) == {"poot_gemv_rows", "poot_gemv_kl"} and c_route.calls["poot_gemv_rows"] == 1
        assert c_route.calls["poot_gemv_kl"] % batch == 0
    if few:
        product = pl.few_rows_product(w)
        assert product is not None
        torch.testing.assert_close(product(x), y, rtol=0, atol=0)


@pytest.mark.parametrize("type_name", TYPES)
def test_tiny_model_runs_on_the_c_kernels(c_route: CountingLib, tmp_path: Path, type_name: str) -> None:
    path, reference = tiny_models.build(tmp_path, type_name)
    expect = tiny.reference_logits(reference, tiny_models.PROMPT)
    handle = ModelHandle.load(path)
    for chunk in (3, pl.DECODE_ROWS + 1):  # decode-sized steps (the few-rows kernel), then prefill panels
        c_route.calls.clear()
        driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=chunk))
        assert tiny.rel_error(driver.logits(tiny_models.PROMPT), expect) <= 1e-3
        assert c_route.calls["poot_gemv_kl" if chunk <= pl.DECODE_ROWS else "poot_gemm_panels"] > 0
