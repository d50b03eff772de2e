"""GGUF block dequantization and packed_linear against the `gguf` package's reference decoders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from helpers.gguf_blocks import QUANTIZABLE, RANDOM_ONLY, quantized_blocks, random_blocks
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize, supported_kinds
from poot_core.cpu import packed_linear as pl
from poot_core.cpu.packed_linear import packed_linear


def packed(blocks: np.ndarray, type_name: str, cols: int) -> PackedWeight:
    return PackedWeight("gguf", (blocks.shape[0], cols), {"blocks": torch.from_numpy(blocks)}, {"type": type_name})


@pytest.mark.parametrize("type_name", QUANTIZABLE + RANDOM_ONLY)
def test_dequantize_equals_gguf_reference(type_name: str) -> None:
    rows, cols = 12, 512
    make = quantized_blocks if type_name in QUANTIZABLE else random_blocks
    blocks = make(type_name, rows, cols)
    ref = quants.dequantize(blocks, GGMLQuantizationType[type_name])
    w = packed(blocks, type_name, cols)
    ours = dequantize(w)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dequantize(w, slice(3, 7)).numpy(), ref[3:7], rtol=1e-6, atol=1e-7)
    assert f"gguf.{type_name}" in supported_kinds()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS"])
@pytest.mark.parametrize("batch", [1, 3])
def test_packed_linear_equals_dequantized_matmul(type_name: str, batch: int) -> None:
    rows, cols = 300, 512  # rows not a multiple of any tile
    make = quantized_blocks if type_name in QUANTIZABLE else random_blocks
    w = packed(make(type_name, rows, cols, seed=1), type_name, cols)
    x = torch.randn(batch, 2, cols)
    bias = torch.randn(rows)
    ref = x @ dequantize(w).T + bias
    out = packed_linear(x, w, bias)
    assert out.shape == (batch, 2, rows) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_unknown_block_type_is_refused() -> None:
    from poot_core.errors import Unsupported

    w = PackedWeight("gguf", (1, 256), {"blocks": torch.zeros(1, 66, dtype=torch.uint8)}, {"type": "IQ2_XXS"})
    with pytest.raises(Unsupported, match="IQ2_XXS"):
        dequantize(w)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_fast_int4_route_is_close(type_name: str) -> None:
    """The explicit fast route (torch's int4 kernel, bfloat16 activations) stays within bfloat16 rounding."""
    make = quantized_blocks if type_name in QUANTIZABLE else random_blocks
    w = packed(make(type_name, 96, 512, seed=2), type_name, 512)
    x = torch.randn(3, 512)
    ref = x @ dequantize(w).T
    out = packed_linear(x, w, fast=True)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(packed_linear(x, w, fast=True), out)  # the cached re-layout gives the same answer


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_dense_types_widen_exactly(type_name: str) -> None:
    qtype = GGMLQuantizationType[type_name]
    values = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    stored = quants.quantize(values, qtype) if type_name != "F32" else values
    raw = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8))
    w = PackedWeight("gguf", (4, 64), {"blocks": raw}, {"type": type_name})
    expect = torch.from_numpy(quants.dequantize(stored, qtype)).float()
    torch.testing.assert_close(dequantize(w), expect, rtol=0, atol=0)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K"])
def test_c_kernel_route_equals_torch_route(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled route carries the decode speed: it must build on this machine and agree with torch's."""
    assert pl.kernels() is not None, "the C kernels did not build: is a C compiler (cc) installed?"
    make = quantized_blocks if type_name in QUANTIZABLE else random_blocks
    w = packed(make(type_name, 300, 768, seed=9), type_name, 768)
    assert pl.uses_c_kernel(w)
    for rows in (1, 2, 4, 5, 64):  # the fused matrix-vector kernel up to 4 rows, C tiles + matmul beyond
        x = torch.randn(rows, 768)
        ref = (x.double() @ dequantize(w).double().T).float()
        fast = packed_linear(x, w)
        assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()
        torch.testing.assert_close(fast, pl._tiled(x, w), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    monkeypatch.setenv("POOT_CPU_KERNELS", "0")
    assert not pl.uses_c_kernel(w)


def test_non_contiguous_blocks_take_the_torch_route() -> None:
    blocks = torch.from_numpy(quantized_blocks("Q4_1", 8, 64, seed=2))
    wide = torch.zeros(8, 2 * blocks.shape[1], dtype=torch.uint8)
    wide[:, ::2] = blocks
    w = PackedWeight("gguf", (8, 64), {"blocks": wide[:, ::2]}, {"type": "Q4_1"})
    assert not pl.uses_c_kernel(w)
    x = torch.randn(1, 64)
    ref = x @ dequantize(w).T
    torch.testing.assert_close(packed_linear(x, w), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "F32"])
def test_empty_matrices_decode_to_empty(type_name: str) -> None:
    """Regression (found by fuzzing a GGUF with a zero-row tensor): an empty block matrix decodes to an empty
    float matrix of the right width instead of a raw reshape error."""
    from poot_core.checkpoint.quant.gguf_blocks import dequantize_rows

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    assert dequantize_rows(torch.zeros(0, 2 * size, dtype=torch.uint8), type_name).shape == (0, 2 * block)
    assert dequantize_rows(torch.zeros(3, 0, dtype=torch.uint8), type_name).shape == (3, 0)
