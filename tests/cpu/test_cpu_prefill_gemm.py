"""Products of many rows in C: the exact prefill panels (csrc/gemm.c) and q8 serving rows (poot_gemm_q8).

Exact: every block type of C_TYPES and bf16/f16 through poot_gemm_panels, against float64 products of the gguf
package's dequantization (or torch's exact widening), in the machine's build and the portable one; shapes with
partial panels of rows (37 = 2 * 16 + 5) and of k (768 = 512 + 256 values), rows of x not a multiple of the
micro-kernel's 6. Each output is one FMA chain over k, so a row's result is bit for bit the same whatever other
rows share the call. q8: each row of poot_gemm_q8 bit for bit poot_gemv_q8's for that row, and within the
bound of the numpy reference of llama.cpp's arithmetic (test_cpu_q8_activations' reference, rewritten here:
test modules do not import each other).
"""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from helpers.c_builds import BUILDS, library
from helpers.gguf_blocks import QUANTIZABLE, quantized_blocks, random_blocks
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.cpu import c_kernels
from poot_core.cpu import packed_linear as pl

pytestmark = pytest.mark.skipif(shutil.which(c_kernels.compiler()) is None, reason="no C compiler")

ROWS = 37  # weight rows: two full panels of 16 and a partial one


def blocks_of(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    if type_name in QUANTIZABLE and seed % 2 == 0:
        return quantized_blocks(type_name, rows, cols, seed)
    return random_blocks(type_name, rows, cols, seed)


def _cols(type_name: str) -> int:
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    return 3 * 256 if block == 256 else 23 * 32  # k panels of 512 and a partial one


def _x(m: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, cols)) * rng.uniform(0.1, 3, size=(m, cols // 32)).repeat(32, 1)).astype(
        np.float32)


def _panels(lib: ctypes.CDLL, type_name: str, blocks: np.ndarray, x: np.ndarray, decoder: str = "blocks"
            ) -> np.ndarray:
    """poot_gemm_panels with the panel decoders of csrc/blocks.h (the executor's choice; AVX2 builds only, the
    portable build falls back to the type's dequant function) or, decoder="dequant", the dequant function."""
    kernel = pl.C_TYPES[type_name]
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    dequant = ctypes.cast(getattr(lib, kernel.dequant), ctypes.c_void_p).value
    m, cols = x.shape
    y = np.full((m, blocks.shape[0]), np.nan, np.float32)
    block_type = pl.Q8_TYPES[type_name] if decoder == "blocks" else -1
    lib.poot_gemm_panels(dequant, kernel.type_id, block_type, blocks.ctypes.data, blocks.shape[1], blocks.shape[0],
                         cols // block, block, size, x.ctypes.data, m, y.ctypes.data, 2)
    return y


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("decoder", ["blocks", "dequant"])
@pytest.mark.parametrize("type_name", list(pl.C_TYPES))
def test_panels_dequantize_exactly(build: str, decoder: str, type_name: str) -> None:
    """x = the identity: each output is one product w * 1 plus zeros, so y is W^T bit for bit."""
    lib = library(build)
    cols = _cols(type_name)
    blocks = blocks_of(type_name, ROWS, cols, seed=7 + len(type_name))
    weights = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)
    y = _panels(lib, type_name, blocks, np.eye(cols, dtype=np.float32), decoder)
    np.testing.assert_array_equal(y, weights.T)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("decoder", ["blocks", "dequant"])
@pytest.mark.parametrize("type_name", list(pl.C_TYPES))
def test_exact_panels_match_float64(build: str, decoder: str, type_name: str) -> None:
    lib = library(build)
    cols = _cols(type_name)
    blocks = blocks_of(type_name, ROWS, cols, seed=len(type_name))
    weights = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64)
    x = _x(13, cols, seed=1)
    y = _panels(lib, type_name, blocks, x, decoder)
    expect = x.astype(np.float64) @ weights.T
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(weights).T) + 1e-30
    assert (np.abs(y - expect) <= bound).all(), np.abs(y - expect).max()
    # a row's result does not depend on the rows beside it: alone, or as the first of a call of 7
    for i in (0, 5, 12):
        np.testing.assert_array_equal(_panels(lib, type_name, blocks, x[i : i + 1].copy(), decoder), y[i : i + 1])
        np.testing.assert_array_equal(_panels(lib, type_name, blocks, x[i : i + 7].copy(), decoder)[0], y[i])


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("half", [0, 1])
def test_16_bit_panels_match_float64(build: str, half: int) -> None:
    """bf16 / f16 weights through poot_widen16 (blocks of one value: any k, here 600 = 512 + 88)."""
    lib = library(build)
    dtype = torch.float16 if half else torch.bfloat16
    w = torch.randn(ROWS, 600).to(dtype)
    x = torch.randn(9, 600)
    y = torch.full((9, ROWS), float("nan"))
    widen = ctypes.cast(lib.poot_widen16, ctypes.c_void_p).value
    lib.poot_gemm_panels(widen, half, -1, w.data_ptr(), 2 * w.stride(0), ROWS, 600, 1, 2, x.data_ptr(), 9, y.data_ptr(),
                         2)
    expect = x.double() @ w.double().T
    assert ((y.double() - expect).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T)).all()


def test_packed_linear_prefill_is_row_invariant() -> None:
    """Through packed_linear (the executor's prefill route): a prompt's rows give the same bits in a chunk of 5
    as in a chunk of 11, and dense16_tiles (where it applies) too."""
    type_name, cols = "Q5_0", 512
    w = PackedWeight("gguf", (ROWS, cols), {"blocks": torch.from_numpy(blocks_of(type_name, ROWS, cols, 2))},
                     {"type": type_name})
    x = torch.randn(11, cols)
    torch.testing.assert_close(pl.packed_linear(x[:5], w), pl.packed_linear(x, w)[:5], rtol=0, atol=0)
    w16 = torch.randn(ROWS, cols).to(torch.bfloat16)
    small, large = pl.dense16_tiles(x[:5], w16), pl.dense16_tiles(x, w16)
    if small is not None and large is not None:
        torch.testing.assert_close(small, large[:5], rtol=0, atol=0)


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's 8-bit quantization of float32 x [m, k] per 32 values: int q [m, k], float32 d [m, k / 32]."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(d != 0, d, np.float32(1))
    inv = np.where(d != 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])  # float32 product, rounded half to even
    return q.reshape(x.shape).astype(np.int64), d


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("type_name", list(pl.Q8_TYPES))
def test_q8_prefill_is_the_decode_arithmetic(build: str, type_name: str) -> None:
    lib = library(build)
    cols = _cols(type_name)
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    blocks = blocks_of(type_name, ROWS, cols, seed=3)
    x = _x(11, cols, seed=4)
    y = np.full((11, ROWS), np.nan, np.float32)
    t = pl.Q8_TYPES[type_name]
    lib.poot_gemm_q8(t, blocks.ctypes.data, blocks.shape[1], ROWS, cols // block, x.ctypes.data, 11, y.ctypes.data,
                     2)
    for i in range(11):
        one = np.full((1, ROWS), np.nan, np.float32)
        lib.poot_gemv_q8(t, blocks.ctypes.data, blocks.shape[1], ROWS, cols // block, x[i : i + 1].ctypes.data, 1,
                         one.ctypes.data, 1)
        np.testing.assert_array_equal(y[i], one[0])
    q, d = quantize_reference(x)
    xq = (q.reshape(11, -1, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
    weights = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64)
    expect, scale = xq @ weights.T, np.abs(xq) @ np.abs(weights).T
    assert (np.abs(y - expect) <= 1e-5 * scale + 1e-30).all(), np.abs(y - expect).max()


def test_q8_serving_rows_take_poot_gemm_q8_and_prefill_stays_exact() -> None:
    """Under q8, a serving step of 9 rows gives each row its decode bits (poot_gemm_q8), and a prefill product
    (packed_linear) is the exact panels' product, bit for bit the unmarked weight's."""
    type_name, cols = "Q6_K", 512
    blocks = torch.from_numpy(random_blocks(type_name, ROWS, cols, 6))
    marked = PackedWeight("gguf", (ROWS, cols), {"blocks": blocks}, {"type": type_name, "cpu_activations": "q8"})
    exact = PackedWeight("gguf", (ROWS, cols), {"blocks": blocks}, {"type": type_name})
    x = torch.randn(9, cols)
    serving, decode = pl.few_rows_product(marked, 16), pl.few_rows_product(marked)
    assert serving is not None and decode is not None
    y = serving(x)
    assert y is not None
    for i in range(0, 9, 4):  # the decode route of the same rows: the same bits
        torch.testing.assert_close(decode(x[i : i + 4]), y[i : i + 4], rtol=0, atol=0)
    torch.testing.assert_close(pl.packed_linear(x, marked), pl.packed_linear(x, exact), rtol=0, atol=0)
    assert (pl.packed_linear(x, marked) - y).abs().max() > 0  # the two routes differ: the test can fail
