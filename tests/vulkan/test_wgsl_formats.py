"""The GGUF block layouts the Vulkan kernels read in packed form (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS beside
the older ones) against the gguf package's dequantization: the many-token product, the one-token (decode)
product, the embedding gather and the gathered MoE experts; every layout's one-token GEMV (linear.gemv) with each
reduction, split-K and a concatenation's parts. On any Vulkan adapter (CI: lavapipe)."""

from __future__ import annotations

try:  # triton bundles its own LLVM: imported after lavapipe has loaded Mesa's LLVM, it crashes the process
    import triton  # noqa: F401
except ImportError:
    pass

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from helpers.gguf_blocks import QUANTIZABLE, quantized_blocks, random_blocks
from poot_backend_vulkan.kernels import moe as moe_kernels
from poot_backend_vulkan.kernels.linear import embed, gemv, linear
from poot_backend_vulkan.kernels.runtime import Runtime, vulkan_adapters
from poot_backend_vulkan.kernels.weights import FORMATS, upload_stack, upload_weight
from poot_backend_vulkan.upload import WEIGHT_KINDS
from poot_core.checkpoint.quant import supported_kinds

NEW = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS"]


@pytest.fixture(scope="module")
def rt() -> Runtime:
    if not vulkan_adapters():
        pytest.skip("no Vulkan adapter on this machine (install mesa-vulkan-drivers for lavapipe)")
    return Runtime()


def blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(the stored blocks, gguf's dequantization of them as float64)."""
    data = quantized_blocks(fmt, rows, cols, seed) if fmt in QUANTIZABLE else random_blocks(fmt, rows, cols, seed)
    return data, quants.dequantize(data, GGMLQuantizationType[fmt]).astype(np.float64)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def test_every_gguf_layout_of_the_cpu_is_read_on_vulkan() -> None:
    cpu = {k.removeprefix("gguf.") for k in supported_kinds() if k.startswith("gguf.")}
    assert cpu <= set(FORMATS), cpu - set(FORMATS)
    assert {f"gguf.{f}" for f in NEW} <= WEIGHT_KINDS
    for fmt in cpu:  # the block sizes the shaders assume are gguf's
        form = FORMATS[fmt]
        assert (form.block_values, form.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("tokens", [1, 5])  # the one-token variant and the 4-token groups (one partial)
def test_linear_matches_gguf_dequantization(rt: Runtime, fmt: str, tokens: int) -> None:
    rows, cols = 12, 512
    data, dense = blocks(fmt, rows, cols)
    x = np.random.default_rng(1).standard_normal((tokens, cols)).astype(np.float32)
    out = rt.empty((tokens, rows))
    batch = rt.batch()
    linear(batch, rt.upload(x), upload_weight(rt, data, fmt, (rows, cols)), out)
    batch.submit()
    assert rel_err(rt.read(out), x.astype(np.float64) @ dense.T) < 1e-4


@pytest.mark.parametrize("fmt", ["Q5_1", "Q5_K", "IQ4_XS"])
def test_embed_gathers_rows(rt: Runtime, fmt: str) -> None:
    rows, cols = 10, 256
    data, dense = blocks(fmt, rows, cols, seed=2)
    ids = np.array([3, 0, 9, 3], dtype=np.uint32)
    out = rt.empty((len(ids), cols))
    batch = rt.batch()
    embed(batch, upload_weight(rt, data, fmt, (rows, cols)), rt.upload(ids, "u32"), out, 0.5)
    batch.submit()
    assert rel_err(rt.read(out), 0.5 * dense[ids]) < 1e-6


@pytest.mark.parametrize("fmt", ["Q5_0", "IQ4_NL", "Q3_K"])
def test_gathered_experts_read_packed_stacks(rt: Runtime, fmt: str) -> None:
    """gate_up + down over packed stacks against numpy on the dequantized experts, with fixed choices."""
    count, width, inter, top_k = 4, 256, 256, 2
    gu, dn, ref = [], [], []
    for e in range(count):
        (g, g_ref), (u, u_ref), (d, d_ref) = (blocks(fmt, r, c, 3 * e + j)
                                              for j, (r, c) in enumerate([(inter, width)] * 2 + [(width, inter)]))
        gu.append([g, u])
        dn.append([d])
        ref.append((g_ref, u_ref, d_ref))
    gate_up, down = upload_stack(rt, gu, fmt, width), upload_stack(rt, dn, fmt, inter)
    assert gate_up is not None and down is not None
    x = np.random.default_rng(4).standard_normal((1, width)).astype(np.float32)
    ids, chosen = np.array([[3, 1]], dtype=np.uint32), np.array([[0.7, 0.3]], dtype=np.float32)
    d_ids, out = rt.upload(ids, "u32"), rt.empty((1, width))
    h = rt.empty((top_k, inter))
    batch = rt.batch()
    moe_kernels.gate_up(batch, rt.upload(x), gate_up, d_ids, h, "silu")
    moe_kernels.down(batch, h, down, d_ids, rt.upload(chosen), out)
    batch.submit()
    want = np.zeros(width)
    for e, w in zip(ids[0], chosen[0], strict=True):
        g_ref, u_ref, d_ref = ref[e]
        a, b = g_ref @ x[0], u_ref @ x[0]
        want += w * (d_ref @ (a / (1 + np.exp(-a)) * b))
    assert rel_err(rt.read(out)[0], want) < 1e-4


ALL = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("reduce", ["tree", "subgroups", "splitk"])
def test_one_token_gemv_of_every_layout(rt: Runtime, fmt: str, reduce: str) -> None:
    """The packed one-token GEMV against gguf's dequantization: row counts that are not a multiple of a
    workgroup's rows, and (for the 32-value blocks) rows of k not a multiple of 256."""
    assert set(ALL) == {name for name, form in FORMATS.items() if form.block_values > 1}  # every packed layout
    if reduce == "subgroups" and not rt.has_subgroups:
        pytest.skip("the adapter has no subgroups")
    short = 768 if FORMATS[fmt].block_values == 256 else 96
    options = {"tree": {"subgroups": False}, "subgroups": {"subgroups": True, "warp": False},
               "splitk": {"subgroups": False, "splits": 3}}[reduce]
    for rows, cols in [(13, 512), (37, short)]:
        data, dense = blocks(fmt, rows, cols, seed=rows)
        x = np.random.default_rng(rows).standard_normal((1, cols)).astype(np.float32)
        out = rt.empty((1, rows))
        batch = rt.batch()
        gemv(batch, rt.upload(x), upload_weight(rt, data, fmt, (rows, cols)), out, **options)
        batch.submit()
        assert rel_err(rt.read(out), x.astype(np.float64) @ dense.T) < 1e-5, (rows, cols)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "IQ4_NL"])
def test_packed_concatenation_writes_its_parts(rt: Runtime, fmt: str) -> None:
    """q/k/v stored one after another as packed rows: one gemv writes each part's output, and linear() of one
    token on a single packed matrix (with a bias) takes the same path."""
    cols, parts = 256, [(20, 0), (6, 1), (6, 2)]
    datas, refs = zip(*(blocks(fmt, r, cols, seed=s) for r, s in parts), strict=True)
    whole = upload_weight(rt, np.concatenate(datas), fmt, (sum(r for r, _ in parts), cols))
    x = np.random.default_rng(5).standard_normal((1, cols)).astype(np.float32)
    outs = [rt.empty((1, r)) for r, _ in parts]
    bias = np.random.default_rng(6).standard_normal(parts[0][0]).astype(np.float32)
    single = rt.empty((1, parts[0][0]))
    batch = rt.batch()
    gemv(batch, rt.upload(x), whole, outs)
    linear(batch, rt.upload(x), upload_weight(rt, datas[0], fmt, (parts[0][0], cols)), single, bias=rt.upload(bias))
    batch.submit()
    for out, ref in zip(outs, refs, strict=True):
        assert rel_err(rt.read(out), x.astype(np.float64) @ ref.T) < 1e-5
    assert rel_err(rt.read(single), x.astype(np.float64) @ refs[0].T + bias) < 1e-5
