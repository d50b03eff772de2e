"""Decode GEMVs under the Triton interpreter: split-K (partials summed by the last program of a tile), the
word-wise Q4_K kernel of blocks kept as the file stores them, and GPTQ through the planes GEMV, against
float64 references built independently (gguf's dequantizer, plain integer unpacking)."""

from __future__ import annotations

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.interpreter  # kernels on CPU tensors

import poot_kernels_triton as ktr  # noqa: E402
from helpers.triton_checks import counters_are_zero, rel_err  # noqa: E402
from poot_core.checkpoint.layouts import PackedWeight  # noqa: E402
from poot_kernels_triton import splitk  # noqa: E402
from poot_kernels_triton.tuning import Tile  # noqa: E402

BF16_BOUND = 1.2e-2
F16_BOUND = 2e-3


@pytest.mark.parametrize("split", [1, 2, 3, 8])
@pytest.mark.parametrize("m", [1, 3])
def test_dense_split_k(gemv_override, split: int, m: int) -> None:
    torch.manual_seed(split * 10 + m)
    n, k = 37, 200  # neither a multiple of the tile: masked edges in both directions
    gemv_override["dense"] = Tile(block_n=8, block_k=32, num_warps=1, num_stages=1, split_k=split)
    x = torch.randn(m, k).to(torch.float16)
    w = torch.randn(n, k).to(torch.float16)
    b = torch.randn(n).to(torch.float16)
    ref = x.double() @ w.double().T + b.double()
    for _ in range(2):  # the counters reset themselves: a second launch is right too
        assert rel_err(ktr.dense_linear(x, w, b), ref) < F16_BOUND
        assert counters_are_zero()


def test_split_k_default_choice() -> None:
    tuning = ktr.tuning_for_target("cuda", 90)
    tile = Tile(block_n=8, block_k=512)
    assert splitk.choose_split(tile, 512, 8, tuning) == 5  # 4096 wide in 8-row tiles, 4096 deep
    assert splitk.choose_split(tile, 4096, 8, tuning) == 1  # enough programs already
    assert splitk.choose_split(tile, 16, 3, tuning) == 3  # never more programs than steps
    assert splitk.choose_split(Tile(block_n=8, block_k=512, split_k=2), 16, 8, tuning) == 2


def q4k_rows(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    data = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    for off in (0, 2):
        half = rng.uniform(-0.05, 0.05, size=(n, k // 256)).astype(np.float16)
        data[:, :, off : off + 2] = half.view(np.uint8).reshape(n, k // 256, 2)
    return data.reshape(n, -1)


@pytest.mark.parametrize(
    "tile",
    [
        Tile(block_n=4, block_k=128, num_warps=1, num_stages=1),  # 2 chunks a step, no split
        Tile(block_n=8, block_k=64, num_warps=1, num_stages=1, split_k=3),  # uneven split
        Tile(block_n=16, block_k=256, num_warps=1, num_stages=1, split_k=2),  # one block a step
    ],
)
@pytest.mark.parametrize("m", [1, 2])
def test_q4k_words_gemv(gemv_override, tile: Tile, m: int) -> None:
    rng = np.random.default_rng(m)
    n, k = 13, 768
    blocks = q4k_rows(n, k, rng)
    w_ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).astype(np.float64)
    x = torch.from_numpy(rng.standard_normal((m, k))).to(torch.bfloat16)
    b = torch.from_numpy(rng.standard_normal(n)).to(torch.bfloat16)
    ref = x.double() @ torch.from_numpy(w_ref).T + b.double()
    gemv_override["q4_k"] = tile
    weight = PackedWeight("gguf", (n, k), {"blocks": torch.from_numpy(blocks)}, {"type": "Q4_K"})
    assert rel_err(ktr.linear(x, weight, b), ref) < BF16_BOUND
    # rows of a concatenation are views: the kernel reads them through an int32 view too
    joined = torch.from_numpy(np.concatenate([q4k_rows(3, k, rng), blocks]))
    assert rel_err(ktr.gguf_linear(x, joined[3:], "Q4_K", b), ref) < BF16_BOUND
    assert counters_are_zero()


def gptq_parts(k: int, n: int, group: int, act_order: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    groups = k // group
    big = 2**31 - 1
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {
        "qweight": torch.randint(-big, big, (k // 8, n), dtype=torch.int32, generator=gen),
        "qzeros": torch.randint(-big, big, (groups, n // 8), dtype=torch.int32, generator=gen),
        "scales": (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }


def gptq_reference(p: dict[str, torch.Tensor], zero_offset: int) -> torch.Tensor:
    """W [k, n], float64, by plain integer unpacking."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    qw, qz = p["qweight"].long(), p["qzeros"].long()
    q = ((qw[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qw.shape[1])
    z = ((qz[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qz.shape[0], -1)
    g = p["g_idx"].long()
    return (q - (z[g] + zero_offset)).double() * p["scales"][g].double()


@pytest.mark.parametrize("group", [64, 512])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_words_gemv(gemv_override, group: int, split: int, act_order: bool) -> None:
    gen = torch.Generator().manual_seed(group + split + act_order)
    k, n = 512, 40
    p = gptq_parts(k, n, group, act_order, gen)
    x = torch.randn(2, k, generator=gen).to(torch.float16)
    gemv_override["planes"] = Tile(block_n=16, block_k=256, num_warps=1, num_stages=1, split_k=split)
    meta = {"bits": 4, "group_size": -1 if group == k else group, "desc_act": act_order}
    weight = PackedWeight("gptq", (n, k), p, meta)
    for offset, fmt in ((1, "gptq"), (0, "gptq_v2")):
        w = PackedWeight("gptq", (n, k), p, {**meta, "checkpoint_format": fmt})
        assert rel_err(ktr.linear(x, w), x.double() @ gptq_reference(p, offset)) < F16_BOUND
    # per-row groups from g_idx (what act-order needs) give the same on plain groups
    plain = ktr.gptq_linear(x, p["qweight"], p["qzeros"], p["scales"], p["g_idx"])
    assert rel_err(plain, x.double() @ gptq_reference(p, 1)) < F16_BOUND
    assert rel_err(ktr.linear(x[:1], weight), x[:1].double() @ gptq_reference(p, 1)) < F16_BOUND
    assert counters_are_zero()
