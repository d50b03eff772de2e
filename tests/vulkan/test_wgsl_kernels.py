"""The Vulkan backend's WGSL kernels against numpy / gguf / transformers references, on any Vulkan adapter
(CI uses Mesa's lavapipe, installed by plugins/backend_vulkan/setup_lavapipe.sh)."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest

from helpers.paths import ROOT

try:
    import poot_backend_vulkan.kernels  # noqa: F401
except ImportError:  # the distribution is not installed yet: use the checkout
    sys.path.insert(0, str(ROOT / "plugins" / "backend_vulkan"))

from gguf import GGMLQuantizationType, quants

from poot_backend_vulkan.kernels.attention import attention_decode, attention_prefill
from poot_backend_vulkan.kernels.elementwise import add, argmax, gated_activation
from poot_backend_vulkan.kernels.linear import embed, gemv, linear
from poot_backend_vulkan.kernels.norms import layer_norm, rms_norm
from poot_backend_vulkan.kernels.positional import kv_write, rope, rope_inv_freq, rope_kv
from poot_backend_vulkan.kernels.runtime import Runtime, vulkan_adapters
from poot_backend_vulkan.kernels.weights import upload_weight
from poot_core.errors import CapacityError, Unsupported

F32, HALF, QUANT = 1e-5, 1e-3, 1e-4
SMALL_BINDING = 4096  # a lowered storage binding limit that forces row-chunking


@pytest.fixture(scope="module")
def rt() -> Runtime:
    if not vulkan_adapters():
        pytest.skip("no Vulkan adapter on this machine (install mesa-vulkan-drivers for lavapipe)")
    return Runtime()


@pytest.fixture(scope="module")
def small_rt(rt: Runtime) -> Runtime:
    return Runtime(adapter=rt.adapter, max_binding_bytes=SMALL_BINDING)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def run(runtime: Runtime, record) -> None:
    batch = runtime.batch()
    record(batch)
    batch.submit()


# -- weights in every stored format, with their dequantized references ---------------------------------


def make_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(stored data as upload_weight takes it, f32 values it stands for)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if fmt == "f32":
        return w, w
    if fmt == "f16":
        data = w.astype(np.float16)
        return data, data.astype(np.float32)
    if fmt == "bf16":
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
        return data, (data.astype(np.uint32) << 16).view(np.float32)
    qtype = GGMLQuantizationType[fmt]
    if fmt in ("Q4_0", "Q4_1", "Q8_0"):
        data = quants.quantize(w, qtype)
    else:  # gguf's Python side cannot quantize K-quants: random blocks with sane f16 scales
        block_values, block_bytes = quants.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
        for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[fmt]:
            scales = rng.uniform(0.001, 0.05, blocks.shape[:2]).astype(np.float16)
            blocks[:, :, at : at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
        data = blocks.reshape(rows, -1)
    return data, quants.dequantize(data, qtype).astype(np.float32)


BOUNDS = {"f32": F32, "f16": HALF, "bf16": HALF, "Q4_0": QUANT, "Q4_1": QUANT, "Q8_0": QUANT}
BOUNDS |= {"Q4_K": QUANT, "Q6_K": QUANT}


@pytest.mark.parametrize("fmt", list(BOUNDS))
def test_linear_matches_dequantized_matmul(rt: Runtime, fmt: str) -> None:
    rng = np.random.default_rng(1)
    rows, cols = 24, 512
    data, dense = make_weight(fmt, rows, cols, rng)
    weight = upload_weight(rt, data, fmt, (rows, cols))
    for tokens in (1, 6):  # matrix-vector and matrix-matrix (not a multiple of the 4-token group)
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        out = rt.empty((tokens, rows))
        run(rt, lambda b, x=x, out=out: linear(b, rt.upload(x), weight, out))
        assert rel_err(rt.read(out), x.astype(np.float64) @ dense.T.astype(np.float64)) < BOUNDS[fmt]


def _reductions(runtime: Runtime) -> list[tuple[bool, bool]]:
    """(subgroups, warp) of every GEMV reduction this device can run: the tree, subgroupAdd over 64 lanes,
    a row per 32-lane subgroup (NVIDIA only: the one width known for certain)."""
    found = [(False, False)] + ([(True, False)] if runtime.has_subgroups else [])
    return found + ([(True, True)] if runtime.subgroup_width == 32 else [])


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_gemv_matches_matmul_with_both_reductions(rt: Runtime, small_rt: Runtime, fmt: str) -> None:
    """The one-token dense shader: rows not a multiple of the 4 per workgroup, a row long enough for the
    four-word unrolled loop and its remainder, a bias, and a matrix split across bindings."""
    rng = np.random.default_rng(11)
    long_row = {"f32": 4 * 600, "f16": 8 * 536, "bf16": 8 * 536}[fmt]
    for runtime, rows, cols in ((rt, 37, long_row), (small_rt, 9, 512)):
        data, dense = make_weight(fmt, rows, cols, rng)
        weight = upload_weight(runtime, data, fmt, (rows, cols))
        assert (len(weight.chunks) > 1) == (runtime is small_rt)
        x = rng.standard_normal((1, cols)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32)
        want = x.astype(np.float64) @ dense.T.astype(np.float64) + bias
        for subgroups, splits in itertools.product(_reductions(runtime), (1, 3)):  # split-K: ranges and a combine
            args = (runtime.upload(x), weight, runtime.empty((1, rows)), runtime.upload(bias), *subgroups, splits)
            out = args[2]
            run(runtime, lambda batch, args=args: gemv(batch, *args))
            assert rel_err(runtime.read(out), want) < BOUNDS[fmt], (subgroups, splits)


@pytest.mark.parametrize("parts", [(24, 8, 8), (40, 40)])
def test_gemv_writes_a_concatenation_to_its_parts(rt: Runtime, small_rt: Runtime, parts) -> None:
    """q/k/v (or gate/up) stored as one matrix: one dispatch fills each part's own buffer, also when the
    concatenation is split across bindings; a row range of it alone runs through linear."""
    from poot_backend_vulkan.kernels.weights import row_range

    rng = np.random.default_rng(12)
    rows, cols = sum(parts), 128
    data, dense = make_weight("bf16", rows, cols, rng)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    want = x.astype(np.float64) @ dense.T.astype(np.float64)
    for runtime in (rt, small_rt):
        weight = upload_weight(runtime, data, "bf16", (rows, cols))
        for subgroups, splits in itertools.product(_reductions(runtime), (1, 2)):
            outs = [runtime.empty((1, n)) for n in parts]
            args = (runtime.upload(x), weight, outs, None, *subgroups, splits)
            run(runtime, lambda batch, args=args: gemv(batch, *args))
            got = np.concatenate([runtime.read(o) for o in outs], axis=1)
            assert rel_err(got, want) < HALF
        start = parts[0]
        part = row_range(weight, start, start + parts[1])
        for tokens in (1, 3):
            xs = rng.standard_normal((tokens, cols)).astype(np.float32)
            args = (runtime.upload(xs), part, runtime.empty((tokens, parts[1])))
            out = args[2]
            run(runtime, lambda batch, args=args: linear(batch, *args))
            ref = xs.astype(np.float64) @ dense[start : start + parts[1]].T.astype(np.float64)
            assert rel_err(runtime.read(out), ref) < HALF


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _gelu_tanh(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1.0 + np.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))


@pytest.mark.parametrize("fmt", ["bf16", "Q4_K"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_gemv_writes_the_activation_of_gate_times_up(rt: Runtime, fmt: str, act: str) -> None:
    """gate/up as one matrix (37 gate rows, then 37 up rows: a workgroup's last pairs past the end) and the
    activation applied where the products are summed, with every reduction and with split-K (the combine
    gates then); the result is act(x @ gate^T) * (x @ up^T)."""
    rng = np.random.default_rng(14)
    inter, cols = 37, 512
    data, dense = make_weight(fmt, 2 * inter, cols, rng)
    weight = upload_weight(rt, data, fmt, (2 * inter, cols))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    both = x.astype(np.float64) @ dense.T.astype(np.float64)
    want = {"silu": _silu, "gelu_tanh": _gelu_tanh}[act](both[:, :inter]) * both[:, inter:]
    for subgroups, splits in itertools.product(_reductions(rt), (1, 2)):
        out = rt.empty((1, inter))
        args = (rt.upload(x), weight, out, None, *subgroups, splits, act)
        run(rt, lambda batch, args=args: gemv(batch, *args))
        assert rel_err(rt.read(out), want) < BOUNDS[fmt], (subgroups, splits)
    with pytest.raises(Unsupported):
        gemv(rt.batch(), rt.upload(x), weight, rt.empty((1, inter)), gated="relu")


@pytest.mark.parametrize("fmt", ["f16", "Q8_0", "Q6_K"])
def test_linear_splits_a_matrix_larger_than_one_binding(small_rt: Runtime, fmt: str) -> None:
    rng = np.random.default_rng(2)
    rows, cols = 70, 256
    data, dense = make_weight(fmt, rows, cols, rng)
    assert data.nbytes > SMALL_BINDING
    weight = upload_weight(small_rt, data, fmt, (rows, cols))
    assert len(weight.chunks) > 1
    assert all(c.buffer.size <= SMALL_BINDING for c in weight.chunks)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    out = small_rt.empty((3, rows))
    run(small_rt, lambda b: linear(b, small_rt.upload(x), weight, out))
    assert rel_err(small_rt.read(out), x.astype(np.float64) @ dense.T.astype(np.float64)) < BOUNDS[fmt]


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "Q8_0", "Q4_K"])
def test_embed_gathers_rows_across_chunks(small_rt: Runtime, fmt: str) -> None:
    rng = np.random.default_rng(3)
    rows, cols = 40, 256
    data, dense = make_weight(fmt, rows, cols, rng)
    table = upload_weight(small_rt, data, fmt, (rows, cols))
    assert len(table.chunks) > 1
    ids = np.array([0, 39, 17, 17, 5, 31], dtype=np.uint32)
    out = small_rt.empty((len(ids), cols))
    run(small_rt, lambda b: embed(b, table, small_rt.upload(ids, "u32"), out))
    np.testing.assert_array_equal(small_rt.read(out), dense[ids])


def test_weight_upload_refuses_bad_input(rt: Runtime, small_rt: Runtime) -> None:
    with pytest.raises(Unsupported):
        upload_weight(rt, np.zeros((4, 10), np.uint8), "Q5_K", (4, 256))
    with pytest.raises(Unsupported):  # wrong byte count for the shape
        upload_weight(rt, np.zeros((4, 30), np.uint8), "Q8_0", (4, 32))
    with pytest.raises(CapacityError):  # one row larger than the binding limit
        upload_weight(small_rt, np.zeros((2, 2048), np.float32), "f32", (2, 2048))


# -- norms ----------------------------------------------------------------------------------------------


def rms_reference(h: np.ndarray, w: np.ndarray, eps: float, offset: float) -> np.ndarray:
    h = h.astype(np.float64)
    return h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * (w + offset)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("cols", [200, 4100, 201])  # 16-byte loads (one pass, several), and the 64-thread shader
def test_rms_norm_plain_and_with_fused_residual(rt: Runtime, offset: float, cols: int) -> None:
    rng = np.random.default_rng(4)
    rows = 5
    x, res = rng.standard_normal((2, rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    dx, dres, dw = rt.upload(x), rt.upload(res), rt.upload(w)
    out, fused_out, h_out = rt.empty((rows, cols)), rt.empty((rows, cols)), rt.empty((rows, cols))

    def record(b):
        rms_norm(b, dx, dw, out, eps=1e-6, weight_offset=offset)
        rms_norm(b, dx, dw, fused_out, eps=1e-6, weight_offset=offset, residual=dres, residual_out=h_out)

    run(rt, record)
    assert rel_err(rt.read(out), rms_reference(x, w, 1e-6, offset)) < F32
    assert rel_err(rt.read(fused_out), rms_reference(x + res, w, 1e-6, offset)) < F32
    np.testing.assert_array_equal(rt.read(h_out), x + res)


@pytest.mark.parametrize("splits", [2, 3])
def test_rms_norm_adds_the_partial_sums_of_a_split_product(rt: Runtime, splits: int) -> None:
    """A one-token product left as its split-K partial sums (gemv partials=True, no combine) and the residual
    add + rms_norm that reads them: the same as the product summed first."""
    rng = np.random.default_rng(15)
    rows, cols = 200, 2048
    data, dense = make_weight("bf16", rows, cols, rng)
    weight = upload_weight(rt, data, "bf16", (rows, cols))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    stream = rng.standard_normal((1, rows)).astype(np.float32)
    norm_w = rng.standard_normal(rows).astype(np.float32)
    partials = rt.empty((splits, rows))
    flat = type(partials)(partials.buffer, (1, rows))
    h, out = rt.empty((1, rows)), rt.empty((1, rows))
    args = (rt.upload(stream), rt.upload(norm_w))

    def record(batch) -> None:
        gemv(batch, rt.upload(x), weight, flat, splits=splits, partials=True)
        rms_norm(batch, args[0], args[1], out, eps=1e-6, residual=flat, residual_out=h, residual_splits=splits)

    run(rt, record)
    want_h = stream.astype(np.float64) + x.astype(np.float64) @ dense.T.astype(np.float64)
    assert rel_err(rt.read(h), want_h) < HALF
    assert rel_err(rt.read(out), rms_reference(want_h, norm_w, 1e-6, 0.0)) < HALF
    with pytest.raises(Unsupported):  # the buffer must hold every split
        gemv(rt.batch(), rt.upload(x), weight, rt.empty((1, rows)), splits=splits, partials=True)


@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm(rt: Runtime, with_bias: bool) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 130)) * 3 + 2).astype(np.float32)
    w, bias = rng.standard_normal((2, 130)).astype(np.float32)
    out = rt.empty(x.shape)
    dbias = rt.upload(bias) if with_bias else None
    run(rt, lambda b: layer_norm(b, rt.upload(x), rt.upload(w), out, eps=1e-5, bias=dbias))
    h = x.astype(np.float64)
    want = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5) * w
    assert rel_err(rt.read(out), want + (bias if with_bias else 0)) < F32


# -- rotary embedding and KV cache ---------------------------------------------------------------------


def test_llama3_inverse_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inv_freq(64, 500000.0, scaling)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert not np.allclose(got, rope_inv_freq(64, 500000.0))  # the table really is scaled


@pytest.mark.parametrize("rot_dim", [32, 16])  # full and partial rotary
def test_rope_rotates_half_at_each_position(rt: Runtime, rot_dim: int) -> None:
    rng = np.random.default_rng(6)
    tokens, heads, head_dim = 4, 3, 32
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    positions = np.array([0, 7, 8, 41], dtype=np.uint32)
    inv = rope_inv_freq(
        rot_dim,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    dx = rt.upload(x)
    run(rt, lambda b: rope(b, dx, rt.upload(positions, "u32"), rt.upload(inv), heads=heads, head_dim=head_dim))
    angle = (positions[:, None].astype(np.float32) * inv[None, :]).astype(np.float64)[:, None, :]
    half = rot_dim // 2
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:rot_dim].astype(np.float64)
    want = x.astype(np.float64).copy()
    want[..., :half] = x1 * np.cos(angle) - x2 * np.sin(angle)
    want[..., half:rot_dim] = x2 * np.cos(angle) + x1 * np.sin(angle)
    assert rel_err(rt.read(dx), want) < F32


def rope_reference(x: np.ndarray, positions: np.ndarray, inv: np.ndarray, style: str) -> np.ndarray:
    """x [tokens, heads, head_dim] rotated in float64 at the float32 angles the shader computes."""
    angle = (positions[:, None].astype(np.float32) * inv[None, :]).astype(np.float64)[:, None, :]
    rot = 2 * inv.size
    first, second = (np.arange(rot // 2), np.arange(rot // 2, rot)) if style == "neox" else \
        (np.arange(0, rot, 2), np.arange(1, rot, 2))
    x1, x2 = x[..., first].astype(np.float64), x[..., second].astype(np.float64)
    want = x.astype(np.float64).copy()
    want[..., first] = x1 * np.cos(angle) - x2 * np.sin(angle)
    want[..., second] = x2 * np.cos(angle) + x1 * np.sin(angle)
    return want


@pytest.mark.parametrize(("style", "rot_dim"), [("neox", 32), ("neox", 16), ("interleaved", 32), ("interleaved", 8)])
def test_rope_kv_rotates_q_and_writes_the_caches(rt: Runtime, style: str, rot_dim: int) -> None:
    """The one dispatch before attention: q rotated into its own buffer, k rotated and v copied into the
    caches' rows from the start on (other rows untouched), as rope and kv_write compute them."""
    rng = np.random.default_rng(13)
    tokens, heads, kv_heads, head_dim, capacity, start = 3, 4, 2, 32, 10, 5
    q, k, v = (rng.standard_normal((tokens, h, head_dim)).astype(np.float32) for h in (heads, kv_heads, kv_heads))
    k_host, v_host = (rng.standard_normal((capacity, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    positions = np.arange(start, start + tokens, dtype=np.uint32)
    inv = rope_inv_freq(rot_dim, 10000.0)
    q_out, k_cache, v_cache = rt.empty(q.shape), rt.upload(k_host), rt.upload(v_host)
    args = (rt.upload(q), rt.upload(k), rt.upload(v), q_out, k_cache, v_cache, rt.upload(positions, "u32"),
            rt.upload(inv), start)
    run(rt, lambda b: rope_kv(b, *args, style=style, factor=1.5))
    assert rel_err(rt.read(q_out), 1.5 * rope_reference(q, positions, inv, style) - 0.5 * (
        np.arange(head_dim) >= rot_dim) * q) < F32
    want_k = k_host.astype(np.float64).copy()
    want_k[start : start + tokens] = 1.5 * rope_reference(k, positions, inv, style) - 0.5 * (
        np.arange(head_dim) >= rot_dim) * k
    assert rel_err(rt.read(k_cache), want_k) < F32
    v_host[start : start + tokens] = v
    np.testing.assert_array_equal(rt.read(v_cache), v_host)
    with pytest.raises(CapacityError):
        rope_kv(rt.batch(), *args[:-1], capacity - 2)
    # q, k and v as two partial sums each, in one buffer (a split q/k/v product): the sums are rotated and written
    sizes = [a.size for a in (q, k, v)]
    parts = rng.standard_normal((2, sum(sizes))).astype(np.float32)
    buffer = rt.upload(parts)
    views = [type(buffer)(buffer.buffer, a.shape) for a in (q, k, v)]
    run(rt, lambda b: rope_kv(b, *views, q_out, k_cache, v_cache, *args[6:], style=style, factor=1.5,
                              partials=(2, sum(sizes), (0, sizes[0], sizes[0] + sizes[1]))))
    summed = parts.astype(np.float64).sum(0)
    q2, k2 = summed[: sizes[0]].reshape(q.shape), summed[sizes[0] : sizes[0] + sizes[1]].reshape(k.shape)
    keep = 0.5 * (np.arange(head_dim) >= rot_dim)
    assert rel_err(rt.read(q_out), 1.5 * rope_reference(q2, positions, inv, style) - keep * q2) < F32
    assert rel_err(rt.read(k_cache)[start : start + tokens], 1.5 * rope_reference(k2, positions, inv, style) -
                   keep * k2) < F32
    assert rel_err(rt.read(v_cache)[start : start + tokens], summed[sizes[0] + sizes[1] :].reshape(v.shape)) < F32


def test_kv_write_places_rows_and_refuses_overflow(rt: Runtime) -> None:
    rng = np.random.default_rng(7)
    cache_host = rng.standard_normal((10, 2, 8)).astype(np.float32)
    new = rng.standard_normal((3, 2, 8)).astype(np.float32)
    cache = rt.upload(cache_host)
    run(rt, lambda b: kv_write(b, rt.upload(new), cache, 6))
    cache_host[6:9] = new
    np.testing.assert_array_equal(rt.read(cache), cache_host)
    with pytest.raises(CapacityError):
        kv_write(rt.batch(), rt.upload(new), cache, 8)


# -- attention -----------------------------------------------------------------------------------------


def attention_reference(q, k, v, start, scale, window, softcap) -> np.ndarray:
    tokens, heads, dim = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(tokens):
        pos = start + t
        lo = max(0, pos + 1 - window) if window else 0
        for h in range(heads):
            s = k[lo : pos + 1, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h] = p @ v[lo : pos + 1, h // group] / p.sum()
    return out


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 20.0), (70, 5.0)])
def test_prefill_attention_causal_gqa(rt: Runtime, window: int, softcap: float) -> None:
    rng = np.random.default_rng(8)
    capacity, heads, kv_heads, dim = 96, 4, 2, 32
    start, tokens = 11, 70  # a second prefill chunk: positions 11..80, more keys than one 64-key tile
    k, v = rng.standard_normal((2, capacity, kv_heads, dim)).astype(np.float32)
    q = (rng.standard_normal((tokens, heads, dim)) * 2).astype(np.float32)
    out = rt.empty(q.shape)
    scale = dim**-0.5
    dq, dk, dv = rt.upload(q), rt.upload(k), rt.upload(v)
    run(
        rt,
        lambda b: attention_prefill(b, dq, dk, dv, out, start=start, scale=scale, window=window, softcap=softcap),
    )
    assert rel_err(rt.read(out), attention_reference(q, k, v, start, scale, window, softcap)) < F32


@pytest.mark.parametrize(("window", "softcap", "split_len"), [(0, 0.0, 16), (20, 0.0, 16), (0, 30.0, 256)])
def test_decode_attention_split_k(rt: Runtime, window: int, softcap: float, split_len: int) -> None:
    rng = np.random.default_rng(9)
    capacity, heads, kv_heads, dim, position = 80, 8, 2, 64, 57
    k, v = rng.standard_normal((2, capacity, kv_heads, dim)).astype(np.float32)
    q = (rng.standard_normal((1, heads, dim)) * 2).astype(np.float32)
    out = rt.empty(q.shape)
    dq, dk, dv = rt.upload(q), rt.upload(k), rt.upload(v)
    run(
        rt,
        lambda b: attention_decode(
            b,
            dq,
            dk,
            dv,
            out,
            position=position,
            scale=0.125,
            window=window,
            softcap=softcap,
            split_len=split_len,
        ),
    )
    assert rel_err(rt.read(out), attention_reference(q, k, v, position, 0.125, window, softcap)) < F32


# -- activations, add, argmax, and a whole decode step in one submit -------------------------------------


def test_gated_activations_and_add(rt: Runtime) -> None:
    import torch

    rng = np.random.default_rng(10)
    gate, up = (rng.standard_normal((2, 3, 300)) * 4).astype(np.float32)
    dg, du = rt.upload(gate), rt.upload(up)
    silu_out, gelu_out, sum_out = rt.empty(gate.shape), rt.empty(gate.shape), rt.empty(gate.shape)

    def record(b):
        gated_activation(b, dg, du, silu_out, "silu")
        gated_activation(b, dg, du, gelu_out, "gelu_tanh")
        add(b, dg, du, sum_out)

    run(rt, record)
    tg, tu = torch.from_numpy(gate).double(), torch.from_numpy(up).double()
    assert rel_err(rt.read(silu_out), (torch.nn.functional.silu(tg) * tu).numpy()) < F32
    want_gelu = torch.nn.functional.gelu(tg, approximate="tanh") * tu
    assert rel_err(rt.read(gelu_out), want_gelu.numpy()) < F32
    np.testing.assert_array_equal(rt.read(sum_out), gate + up)
    with pytest.raises(Unsupported):
        gated_activation(rt.batch(), dg, du, silu_out, "relu2")


def test_argmax_takes_first_of_ties(rt: Runtime) -> None:
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)
    logits[1, [123, 800]] = 50.0  # a tie: the lower index wins, as in numpy
    logits[2, 999] = 60.0
    ids = rt.empty(3, "u32")
    run(rt, lambda b: argmax(b, rt.upload(logits), ids))
    np.testing.assert_array_equal(rt.read(ids), logits.argmax(-1))


def test_decode_step_is_one_submit(rt: Runtime) -> None:
    """embed -> rms_norm -> linear head -> argmax recorded in one encoder; only the id is read back."""
    rng = np.random.default_rng(12)
    vocab, hidden = 300, 64
    table_data, table = make_weight("Q8_0", vocab, hidden, rng)
    head_data, head = make_weight("f16", vocab, hidden, rng)
    norm_w = rng.standard_normal(hidden).astype(np.float32)
    d_table, d_head = (
        upload_weight(rt, table_data, "Q8_0", (vocab, hidden)),
        upload_weight(rt, head_data, "f16", (vocab, hidden)),
    )
    token = rt.upload(np.array([42], np.uint32), "u32")
    x, normed, logits, next_id = (
        rt.empty((1, hidden)),
        rt.empty((1, hidden)),
        rt.empty((1, vocab)),
        rt.empty(1, "u32"),
    )
    batch = rt.batch()
    embed(batch, d_table, token, x)
    rms_norm(batch, x, rt.upload(norm_w), normed, eps=1e-5)
    linear(batch, normed, d_head, logits)
    argmax(batch, logits, next_id)
    batch.submit()
    assert batch.dispatches == 4
    want_logits = rms_reference(table[[42]], norm_w, 1e-5, 0.0) @ head.T.astype(np.float64)
    assert rel_err(rt.read(logits), want_logits) < HALF
    assert int(rt.read(next_id)[0]) == int(want_logits.argmax())


def test_split_k_is_chosen_for_few_long_rows() -> None:
    from poot_backend_vulkan.kernels.linear import MAX_SPLITK, SPLITK_GROUPS, split_count

    assert split_count(SPLITK_GROUPS, 4096) == 1  # enough rows alone
    assert split_count(SPLITK_GROUPS // 2, 4096) == 2
    assert split_count(8, 4096) == MAX_SPLITK
    assert split_count(8, 300) == 1  # a short row is not cut
