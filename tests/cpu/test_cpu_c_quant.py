"""The C kernels for GGUF block types, called directly, in two builds: the machine's (-march=native: its vector
routes) and one without vector instructions (the portable C). Dequantization must equal the gguf package's bit
for bit; products must match the float64 product of those weights on fresh random blocks."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from helpers.c_builds import BUILDS, library
from helpers.gguf_blocks import QUANTIZABLE, quantized_blocks, random_blocks
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.cpu import c_kernels
from poot_core.cpu.packed_linear import (
    C_TYPES,
    DECODE_ROWS,
    FUSED_MAX_ROWS,
    dense16_tiles,
    embed_rows,
    tile_rows,
)

pytestmark = pytest.mark.skipif(shutil.which(c_kernels.compiler()) is None, reason="no C compiler")


def blocks_of(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row]: quantized normal data where gguf can quantize the type, else random bytes
    with random finite float16 scales (both shapes of input the kernels meet)."""
    if type_name in QUANTIZABLE and seed % 2 == 0:
        return quantized_blocks(type_name, rows, cols, seed)
    return random_blocks(type_name, rows, cols, seed)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("type_name", list(C_TYPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_dequant_and_products_match_gguf(type_name: str, build: str, seed: int) -> None:
    lib, kernel = library(build), C_TYPES[type_name]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    rows, cols = 37, 8 * block  # rows: not a multiple of any vector width
    blocks = blocks_of(type_name, rows, cols, seed)
    ref = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)
    nb = cols // block

    out = np.full((rows, cols), np.nan, np.float32)
    getattr(lib, kernel.dequant)(kernel.type_id, blocks.ctypes.data, blocks.shape[1], rows, nb, out.ctypes.data, 2)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))

    ref64 = ref.astype(np.float64)
    for m in range(1, FUSED_MAX_ROWS + 1):
        x = np.random.default_rng(100 * seed + m).standard_normal((m, cols)).astype(np.float32)
        y = np.full((m, rows), np.nan, np.float32)
        getattr(lib, kernel.gemv)(kernel.type_id, blocks.ctypes.data, blocks.shape[1], rows, nb, x.ctypes.data, m,
                                  y.ctypes.data, 2)
        expect = x.astype(np.float64) @ ref64.T
        # float32 sums over `cols` terms: a few ulp of the largest partial sums
        bound = 1e-6 * np.abs(x.astype(np.float64)) @ np.abs(ref64).T + 1e-30
        assert (np.abs(y - expect) <= bound).all(), f"m={m}: {np.abs(y - expect).max()}"


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("half", [False, True])
def test_16_bit_products_match_float64(build: str, half: bool) -> None:
    """poot_gemv16 (F16 and BF16 weights, as GGUF stores them unquantized): the float32 product of the exactly
    widened weights, for 1 to DECODE_ROWS + 1 x rows (more than one group of rows a call) and a width that leaves
    a tail after the vector loop; each row's result is bit for bit the one it gets alone (a verify step's rows
    are decode rows)."""
    rows, cols = 37, 1000
    rng = np.random.default_rng(int(half))
    wf = rng.standard_normal((rows, cols)).astype(np.float32)
    if half:
        w16 = wf.astype(np.float16).view(np.uint16)
        wide = w16.view(np.float16).astype(np.float64)
    else:
        w16 = (wf.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: any bit pattern will do
        wide = (w16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    lib = library(build)

    def product(x: np.ndarray) -> np.ndarray:
        y = np.full((x.shape[0], rows), np.nan, np.float32)
        lib.poot_gemv16(w16.ctypes.data, cols, rows, cols, x.ctypes.data, x.shape[0], y.ctypes.data, int(half), 2)
        return y

    for m in (*range(1, 10), DECODE_ROWS, DECODE_ROWS + 1):
        x = rng.standard_normal((m, cols)).astype(np.float32)
        y = product(x)
        expect = x.astype(np.float64) @ wide.T
        bound = 1e-6 * np.abs(x.astype(np.float64)) @ np.abs(wide).T
        assert (np.abs(y - expect) <= bound).all(), f"m={m}: {np.abs(y - expect).max()}"
        alone = np.concatenate([product(np.ascontiguousarray(x[r : r + 1])) for r in range(m)])
        np.testing.assert_array_equal(y.view(np.uint32), alone.view(np.uint32), err_msg=f"m={m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_prefill_tiles_match_float64(dtype: torch.dtype) -> None:
    """Many rows of x against 16-bit weights: float32 tiles of the exactly widened weights (also where the CPU
    has a native 16-bit product, whose rounding of x and of the output would break exactness)."""
    w = torch.randn(1100, 2048).to(dtype)  # tiles of 512 rows (4 MB of float32): two and a partial one
    x = torch.randn(3, 7, 2048)
    assert tile_rows(2048) == 512
    y = dense16_tiles(x, w)
    expect = x.double() @ w.double().T
    assert y.shape == (3, 7, 1100) and y.dtype == torch.float32
    assert ((y.double() - expect).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T)).all()


@pytest.mark.parametrize("type_name", list(C_TYPES))
def test_embedding_rows_are_the_dequantized_rows(type_name: str) -> None:
    """The embedding lookup of a packed table (small models store it as Q5_0, Q6_K, Q8_0... and tie the head
    to it) dequantizes only the picked rows, in C, bit for bit as gguf does; repeated tokens, one token, and
    enough tokens for the parallel loop."""
    if c_kernels.kernels() is None:
        pytest.skip("the executor does not use the C kernels on this machine")
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    blocks = blocks_of(type_name, 50, 2 * block, seed=1)
    ref = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float32)
    table = PackedWeight("gguf", (50, 2 * block), {"blocks": torch.from_numpy(blocks)}, {"type": type_name})
    for tokens in ([7], [3, 3, 49, 0], list(range(49, 9, -3))):
        out = embed_rows(table, torch.tensor(tokens))
        assert out is not None
        np.testing.assert_array_equal(out.numpy().view(np.uint32), ref[tokens].view(np.uint32))
    with pytest.raises(IndexError, match="50"):
        embed_rows(table, torch.tensor([2, 50]))
    with pytest.raises(IndexError):
        embed_rows(table, torch.tensor([-1]))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("type_name", [t for t, kernel in C_TYPES.items() if kernel.many])
@pytest.mark.parametrize("nb", [40, 41])
def test_many_rows_kernel_gives_each_row_its_lone_bits(type_name: str, build: str, nb: int) -> None:
    """The `many` kernel of a type (any number of rows: eight at a time, then four, two, the rest) gives every
    row of x the bits the decode kernel gives it alone (m = 1), in both builds, and agrees with float64; rows of
    an even and an odd number of blocks (Q8_0's kernels sum blocks in pairs)."""
    lib, kernel = library(build), C_TYPES[type_name]
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    rows, cols, m = 203, nb * block, 23
    blocks = blocks_of(type_name, rows, cols, seed=5)
    x = np.random.default_rng(9).standard_normal((m, cols)).astype(np.float32)
    lone = np.full((m, rows), np.nan, np.float32)
    for r in range(m):
        getattr(lib, kernel.gemv)(kernel.type_id, blocks.ctypes.data, blocks.shape[1], rows, nb, x[r].ctypes.data, 1,
                                  lone[r].ctypes.data, 2)
    y = np.full((m, rows), np.nan, np.float32)
    getattr(lib, kernel.many)(kernel.type_id, blocks.ctypes.data, blocks.shape[1], rows, nb, x.ctypes.data, m,
                              y.ctypes.data, 2)
    np.testing.assert_array_equal(y.view(np.uint32), lone.view(np.uint32))
    ref64 = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64)
    bound = 1e-6 * np.abs(x.astype(np.float64)) @ np.abs(ref64).T + 1e-30
    assert (np.abs(y - x.astype(np.float64) @ ref64.T) <= bound).all()


@pytest.mark.parametrize("activations", ["exact", "q8"])
@pytest.mark.parametrize("type_name", list(C_TYPES))
def test_serving_rows_are_decode_rows(type_name: str, activations: str) -> None:
    """A batched step's product of many rows (up to fusion.ROWWISE_MAX, through csrc/rows.c) gives each row
    the bits a decode step of that row alone gives it, whatever the other rows: so a request's tokens do not
    depend on the batch around it. Enough output rows for several cache chunks."""
    from poot_core.cpu.fusion import ROWWISE_MAX
    from poot_core.cpu.packed_linear import few_rows_product

    if c_kernels.kernels() is None:
        pytest.skip("the executor does not use the C kernels on this machine")
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    rows, cols = 301, 4 * block if block == 256 else 24 * block  # 32-value types: a long sum of minimum terms
    blocks = blocks_of(type_name, rows, cols, seed=0)
    meta = {"type": type_name} | ({"cpu_activations": "q8"} if activations == "q8" else {})
    weight = PackedWeight("gguf", (rows, cols), {"blocks": torch.from_numpy(blocks)}, meta)
    many, few = few_rows_product(weight, ROWWISE_MAX), few_rows_product(weight)
    assert many is not None and few is not None
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((ROWWISE_MAX, cols)).astype(np.float32))
    lone = torch.cat([few(x[i : i + 1]) for i in range(ROWWISE_MAX)])  # each row as a decode step of one
    for m in (2, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1, 8, 13, 16, ROWWISE_MAX):  # 32-value types: 8 rows a pass
        y = many(x[:m])
        assert y is not None and y.shape == (m, rows)
        assert torch.equal(y, lone[:m]), f"{m} rows"
    mixed = many(torch.cat([x[:3], x.flip(0), x[:7]]), lone=3)  # a step with prefill rows after its decode rows
    assert mixed is not None and torch.equal(mixed[:3], lone[:3])
    assert many(x[:1].expand(ROWWISE_MAX + 1, cols)) is None  # beyond the limit: the caller's tiles
