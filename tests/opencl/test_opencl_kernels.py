"""The OpenCL backend's kernels (plugins/backend_opencl, cl/*.cl) against the CPU executor's ops and the gguf
package's dequantizers, on fresh random inputs, on any OpenCL device (CI: pocl, installed by
plugins/backend_opencl/setup_pocl.sh). Shapes are tiny: pocl compiles each program with LLVM (once per machine,
then from pyopencl's binary cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from poot_backend_opencl.kernels import ops
from poot_backend_opencl.kernels.launch import Arr, DeviceWeight
from poot_backend_opencl.kernels.runtime import Runtime, opencl_devices

from helpers.gguf_blocks import quantized_blocks, random_blocks
from poot_core.cpu import ops as cpu_ops
from poot_core.moe import choose_experts
from poot_core.rope import inverse_frequencies

pytestmark = pytest.mark.skipif(not opencl_devices(), reason="no OpenCL device on this machine (pocl-opencl-icd)")

GGUF = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def rt() -> Runtime:
    return Runtime()


def rel(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def arr(rt: Runtime, host: np.ndarray) -> Arr:
    host = np.ascontiguousarray(host)
    return Arr(rt.upload(host), host.shape, "u32" if host.dtype == np.uint32 else "f32")


def empty(rt: Runtime, *shape: int) -> Arr:
    return Arr(rt.buffer(4 * int(np.prod(shape))), tuple(shape))


def read(rt: Runtime, a: Arr) -> np.ndarray:
    rt.finish()
    return rt.read(a.buf, a.size).reshape(a.shape)


def run(rt: Runtime, *launches) -> None:
    for launch in launches:
        launch.enqueue(rt.queue)


def stored(fmt: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the weight's bytes as stored, the float32 values they stand for: numpy's or gguf's dequantizer)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if fmt == "f32":
        return w.view(np.uint8), w
    if fmt == "f16":
        h = w.astype(np.float16)
        return h.view(np.uint8), h.astype(np.float32)
    if fmt == "bf16":
        bits = (w.view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8), (bits.astype(np.uint32) << 16).view(np.float32)
    quantizable = fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    data = quantized_blocks(fmt, rows, cols, seed) if quantizable else random_blocks(fmt, rows, cols, seed)
    return data, quants.dequantize(data, GGMLQuantizationType[fmt]).astype(np.float32)


def device_weight(rt: Runtime, data: np.ndarray, fmt: str, rows: int, cols: int) -> DeviceWeight:
    return DeviceWeight(rt.upload(data.reshape(-1)), fmt, rows, cols, ops.row_bytes(fmt, cols))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", *GGUF])
def test_linear_and_embed_every_format(rt, fmt):
    """Products of 1 (decode), 3 and 9 tokens (past one tile of 8) and embedding rows, from the stored blocks;
    the reference is float64 over gguf's dequantized values (float32 x on the CPU for the dense formats)."""
    rows, cols = 12, 512
    data, values = stored(fmt, rows, cols, seed=len(fmt))
    w = device_weight(rt, data, fmt, rows, cols)
    rng = np.random.default_rng(1)
    for tokens in (1, 3, 9):
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        y = empty(rt, tokens, rows)
        run(rt, ops.linear(rt, w, arr(rt, x), y, tokens))
        assert rel(read(rt, y), x.astype(np.float64) @ values.astype(np.float64).T) < 1e-5
    ids = np.array([5, 0, 11, 5], dtype=np.uint32)
    out = empty(rt, 4, cols)
    run(rt, ops.embed(rt, w, arr(rt, ids), out, 4, 0.5))
    np.testing.assert_allclose(read(rt, out), values[ids] * 0.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_dense_rows_with_a_tail_and_bias_match_cpu(rt, fmt):
    """Rows of 80 values (two whole 32-value pieces and a tail of 16) with a bias, as the CPU executor's linear."""
    rows, cols, tokens = 7, 80, 2
    data, values = stored(fmt, rows, cols, seed=3)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    y = empty(rt, tokens, rows)
    run(rt, ops.linear(rt, device_weight(rt, data, fmt, rows, cols), arr(rt, x), y, tokens, bias=arr(rt, bias)))
    want = cpu_ops.linear(torch.from_numpy(x), torch.from_numpy(values), torch.from_numpy(bias))
    assert rel(read(rt, y), want.numpy()) < 1e-5


@pytest.mark.parametrize(("fmt", "rows", "cols"), [
    ("bf16", 7, 80), ("f16", 13, 88), ("f32", 5, 84), ("bf16", 6, 84), ("Q4_K", 13, 512), ("Q8_0", 9, 96),
])
def test_one_token_products_on_ragged_shapes(rt, fmt, rows, cols):
    """One token through cl/gemv.cl: rows not a multiple of a work-group's rows, a dense row's tail past its
    8-value units (84 f32), a bf16 row not 16-byte aligned (84: cl/linear.cl instead), with a bias; an expert's
    product gives 0 when the token did not choose it. Reference: float64 over the stored values."""
    data, values = stored(fmt, rows, cols, seed=rows + cols)
    w = device_weight(rt, data, fmt, rows, cols)
    assert (ops.gemv_shape(rt, w) is None) == (fmt == "bf16" and cols == 84)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    y = empty(rt, 1, rows)
    run(rt, ops.linear(rt, w, arr(rt, x), y, 1, bias=arr(rt, bias)))
    assert rel(read(rt, y), x.astype(np.float64) @ values.astype(np.float64).T + bias) < 1e-5
    for chosen in (0.0, 0.5):
        gated = arr(rt, np.full((1, rows), 7.0, dtype=np.float32))
        run(rt, ops.linear(rt, w, arr(rt, x), gated, 1, gate=(arr(rt, np.array([[1.0, chosen]], np.float32)), 2, 1)))
        want = np.zeros((1, rows)) if chosen == 0.0 else x.astype(np.float64) @ values.astype(np.float64).T
        assert rel(read(rt, gated), want) < 1e-5 if chosen else not read(rt, gated).any()


@pytest.mark.parametrize(("fmt", "counts"), [("bf16", (7, 3, 5)), ("Q4_K", (13, 4)), ("Q6_K", (9, 9, 2))])
def test_joint_one_token_products(rt, fmt, counts):
    """Two or three matrices of one x in one launch (q/k/v, gate/up), rows not a multiple of a work-group's
    rows, a bias on the second only; each output against float64 over its stored values."""
    cols = 256
    rng = np.random.default_rng(len(counts))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    stores = [stored(fmt, rows, cols, seed=i + rows) for i, rows in enumerate(counts)]
    ws = [device_weight(rt, data, fmt, rows, cols) for (data, _), rows in zip(stores, counts, strict=True)]
    biases = [None, rng.standard_normal(counts[1]).astype(np.float32), None][: len(counts)]
    ys = [empty(rt, 1, rows) for rows in counts]
    assert ops.fusable(rt, ws)
    run(rt, ops.linear_many(rt, ws, arr(rt, x), ys, [None if b is None else arr(rt, b) for b in biases]))
    for (_, values), y, b in zip(stores, ys, biases, strict=True):
        want = x.astype(np.float64) @ values.astype(np.float64).T + (0.0 if b is None else b)
        assert rel(read(rt, y), want) < 1e-5


@pytest.mark.parametrize(("fmt", "rows", "cols", "act"), [
    ("bf16", 7, 256, "silu"), ("f32", 10, 96, "gelu_tanh"), ("Q4_K", 13, 512, "silu"), ("Q8_0", 5, 96, "relu"),
])
def test_gate_up_products_with_their_activation(rt, fmt, rows, cols, act):
    """One token's gate and up products and act(gate) * up in one launch (cl/gemv.cl gemv_gated), rows not a
    multiple of a work-group's, against float64 over the stored values and the CPU executor's activation; as
    an expert's, chosen and not."""
    (gate, g_values), (up, u_values) = stored(fmt, rows, cols, seed=rows), stored(fmt, rows, cols, seed=rows + 1)
    wg, wu = device_weight(rt, gate, fmt, rows, cols), device_weight(rt, up, fmt, rows, cols)
    assert ops.gated_fusable(rt, wg, wu)
    x = np.random.default_rng(cols).standard_normal((1, cols)).astype(np.float32) * 0.2
    y = empty(rt, 1, rows)
    run(rt, ops.linear_gated(rt, wg, wu, arr(rt, x), y, act))
    g, u = (x.astype(np.float64) @ values.astype(np.float64).T for values in (g_values, u_values))
    want = cpu_ops.activation(torch.from_numpy(g), act).numpy() * u
    assert rel(read(rt, y), want) < 1e-5
    for chosen in (0.0, 0.5):  # an expert's products: 0 where the token did not choose it
        expert = arr(rt, np.full((1, rows), 7.0, dtype=np.float32))
        routing = arr(rt, np.array([[1.0, chosen]], np.float32))
        run(rt, ops.linear_gated(rt, wg, wu, arr(rt, x), expert, act, chosen=(routing, 1)))
        assert rel(read(rt, expert), want) < 1e-5 if chosen else not read(rt, expert).any()


def test_expert_gate_skips_unchosen_tokens(rt):
    """An expert's product (gate column e of the routing weights): tokens that did not choose it give 0."""
    rows, cols, tokens = 4, 64, 10
    data, values = stored("f32", rows, cols, seed=4)
    x = np.random.default_rng(5).standard_normal((tokens, cols)).astype(np.float32)
    weights = np.zeros((tokens, 3), dtype=np.float32)
    weights[[1, 9], 2] = 0.5  # tokens 0-7 (one whole tile) chose nothing of expert 2
    y = empty(rt, tokens, rows)
    run(rt, ops.linear(rt, device_weight(rt, data, "f32", rows, cols), arr(rt, x), y, tokens,
                       gate=(arr(rt, weights), 3, 2)))
    want = x @ values.T
    want[weights[:, 2] == 0] = 0.0
    np.testing.assert_allclose(read(rt, y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [200, 9000])
def test_rms_norm_with_residual_matches_cpu(rt, width):
    """A row held in registers (200: ragged against the work-group) and one too wide for them (9000: the loop)."""
    rng = np.random.default_rng(6)
    tokens = 3
    x, r, w = (rng.standard_normal(s).astype(np.float32) for s in ((tokens, width), (tokens, width), (width,)))
    out, total = empty(rt, tokens, width), empty(rt, tokens, width)
    run(rt, ops.rms_norm(rt, arr(rt, x), arr(rt, w), out, tokens, width, 1e-6, 1.0, residual=arr(rt, r),
                         sum_out=total))
    s = torch.from_numpy(x + r)
    assert rel(read(rt, total), s.numpy()) == 0.0
    assert rel(read(rt, out), cpu_ops.rms_norm(s, torch.from_numpy(w) + 1.0, 1e-6).numpy()) < 1e-6
    plain = empty(rt, tokens, width)
    run(rt, ops.rms_norm(rt, arr(rt, x), arr(rt, w), plain, tokens, width, 1e-5, 0.0))
    assert rel(read(rt, plain), cpu_ops.rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-5).numpy()) < 1e-6


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_and_its_cache_write_match_cpu(rt, style):
    """A partial rotation (24 of 32 features), YaRN-style factor, positions 5..8, and the rotated rows written
    into the KV cache at those positions."""
    rng = np.random.default_rng(7)
    tokens, heads, head_dim, dim, capacity, start = 4, 3, 32, 24, 12, 5
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    positions = torch.arange(start, start + tokens)[None]
    scaling = {"rope_type": "linear", "factor": 2.0}
    inv = inverse_frequencies(10000.0, dim, tuple(sorted(scaling.items())))
    cos, sin = cpu_ops.rope_tables(positions, 10000.0, dim, scaling)
    want = cpu_ops.rope(torch.from_numpy(x)[None], cos, sin, style)[0].numpy()
    out = empty(rt, tokens, heads, head_dim)
    cache = Arr(rt.zeros(4 * capacity * heads * head_dim), (capacity, heads, head_dim))
    run(rt, ops.rope(rt, arr(rt, x), out, arr(rt, positions.numpy()[0].astype(np.uint32)),
                     arr(rt, np.asarray(inv, dtype=np.float32)), tokens, heads, head_dim, dim, style == "neox", 1.0,
                     cache=cache))
    assert rel(read(rt, out), want) < 1e-5
    kept = read(rt, cache)
    assert rel(kept[start : start + tokens], want) < 1e-5
    assert not kept[:start].any() and not kept[start + tokens :].any()


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_qkv_rotates_q_and_k_and_writes_the_caches(rt, style):
    """An attention's q and k ropes and its k/v cache writes in one launch: GQA (4 query heads over 2), a
    partial rotation (24 of 32 features), positions 5..7, against the CPU executor's rope; k and v rows land in
    the caches at those positions and nowhere else."""
    rng = np.random.default_rng(17)
    tokens, heads, kv_heads, head_dim, dim, capacity, start = 3, 4, 2, 32, 24, 12, 5
    q = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    positions = torch.arange(start, start + tokens)[None]
    scaling = {"rope_type": "linear", "factor": 2.0}
    inv = inverse_frequencies(10000.0, dim, tuple(sorted(scaling.items())))
    cos, sin = cpu_ops.rope_tables(positions, 10000.0, dim, scaling)
    want_q, want_k = (cpu_ops.rope(torch.from_numpy(a)[None], cos, sin, style)[0].numpy() for a in (q, k))
    q_out, k_out = empty(rt, tokens, heads, head_dim), empty(rt, tokens, kv_heads, head_dim)
    kc, vc = (Arr(rt.zeros(4 * capacity * kv_heads * head_dim), (capacity, kv_heads, head_dim)) for _ in range(2))
    run(rt, ops.rope_qkv(rt, arr(rt, q), q_out, arr(rt, k), k_out, arr(rt, v), kc, vc,
                         arr(rt, positions.numpy()[0].astype(np.uint32)), arr(rt, np.asarray(inv, dtype=np.float32)),
                         tokens, heads, kv_heads, head_dim, dim, style == "neox", 1.0))
    assert rel(read(rt, q_out), want_q) < 1e-5 and rel(read(rt, k_out), want_k) < 1e-5
    for cache, want in ((read(rt, kc), want_k), (read(rt, vc), v)):
        assert rel(cache[start : start + tokens], want) < 1e-5
        assert not cache[:start].any() and not cache[start + tokens :].any()


@pytest.mark.parametrize(("tokens", "start", "window", "softcap", "split_len", "head_dim"), [
    (1, 70, 0, 0.0, 16, 40),  # decode over 5 splits of 16 keys, the last one partial
    (1, 70, 0, 0.0, 16, 38),  # a head size not a multiple of 4: a key's dot reads one float at a time
    (1, 70, 20, 30.0, 16, 40),  # decode in a sliding window with a soft-cap: early splits see nothing
    (5, 0, 0, 0.0, 64, 40),  # a prompt's first chunk
    (6, 9, 4, 0.0, 8, 40),  # a later chunk in a window of 4, splits of 8
])
def test_attention_matches_cpu(rt, tokens, start, window, softcap, split_len, head_dim):
    """GQA (4 query heads over 2), keys already cached before `start`; the new keys and values written by
    kv_write, then split attention and its combine, against the CPU executor's attention."""
    rng = np.random.default_rng(tokens + start)
    heads, kv_heads, capacity = 4, 2, 80
    q = rng.standard_normal((1, tokens, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((1, tokens, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((1, tokens, kv_heads, head_dim)).astype(np.float32)
    k_cache = rng.standard_normal((1, kv_heads, capacity, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((1, kv_heads, capacity, head_dim)).astype(np.float32)
    k_cache[:, :, start:], v_cache[:, :, start:] = 0.0, 0.0
    positions = np.arange(start, start + tokens)[None]
    scale = head_dim**-0.5
    want = cpu_ops.attention(*(torch.from_numpy(a.copy()) for a in (q, k, v, positions, k_cache, v_cache)), scale,
                             window or None, softcap or None).numpy()
    kc = arr(rt, k_cache[0].transpose(1, 0, 2))  # the backend's layout: [capacity, kv_heads, head_dim]
    vc = arr(rt, v_cache[0].transpose(1, 0, 2))
    pos = arr(rt, positions[0].astype(np.uint32))
    splits = -(-capacity // split_len)
    out, part = empty(rt, tokens, heads, head_dim), empty(rt, tokens, heads, splits, head_dim + 2)
    width = kv_heads * head_dim
    run(rt, ops.kv_write(rt, arr(rt, k[0]), kc, pos, tokens, width), ops.kv_write(rt, arr(rt, v[0]), vc, pos, tokens,
                                                                                   width),
        *ops.attention(rt, arr(rt, q[0]), kc, vc, pos, out, part, tokens, heads, kv_heads, head_dim, split_len, splits,
                       scale, window, softcap))
    assert rel(read(rt, out), want[0]) < 1e-5


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu", "relu", "sigmoid"])
def test_activations_match_cpu(rt, act):
    rng = np.random.default_rng(8)
    g, u = (rng.standard_normal(300).astype(np.float32) * 3 for _ in range(2))
    gated, single = empty(rt, 300), empty(rt, 300)
    run(rt, ops.gated(rt, arr(rt, g), arr(rt, u), gated, act), ops.activation(rt, arr(rt, g), single, act))
    want = cpu_ops.activation(torch.from_numpy(g), act).numpy()
    assert rel(read(rt, single), want) < 1e-5
    assert rel(read(rt, gated), want * u) < 1e-5


def test_elementwise_and_softcap_match_numpy(rt):
    rng = np.random.default_rng(9)
    a, b = (rng.standard_normal(130).astype(np.float32) * 20 for _ in range(2))
    outs = [empty(rt, 130) for _ in range(5)]
    run(rt, ops.binary(rt, "add", arr(rt, a), arr(rt, b), outs[0]), ops.binary(rt, "mul", arr(rt, a), arr(rt, b),
                                                                                  outs[1]),
        ops.scale(rt, arr(rt, a), outs[2], 0.25), ops.softcap(rt, arr(rt, a), outs[3], 15.0),
        ops.copy(rt, arr(rt, a), outs[4], 30, 100))
    np.testing.assert_allclose(read(rt, outs[0]), a + b, rtol=1e-6)
    np.testing.assert_allclose(read(rt, outs[1]), a * b, rtol=1e-6)
    np.testing.assert_allclose(read(rt, outs[2]), a * 0.25, rtol=1e-6)
    assert rel(read(rt, outs[3]), np.tanh(a.astype(np.float64) / 15.0) * 15.0) < 1e-6
    np.testing.assert_array_equal(read(rt, outs[4])[:30], a[100:])


def test_argmax_takes_the_lowest_id_on_ties(rt):
    rng = np.random.default_rng(10)
    for n in (1000, 5003):  # 5003: past eight loads a work-item, then a tail
        x = rng.standard_normal((4, n)).astype(np.float32)
        x[1, [17, 640]] = 50.0  # a tie: numpy's argmax takes 17
        x[2, :] = -3.0
        x[3, [n - 1, 300, 4000 % n]] = 60.0  # a tie of lanes read in different rounds
        ids = Arr(rt.buffer(16), (4,), "u32")
        run(rt, ops.argmax(rt, arr(rt, x), ids, 4, n))
        rt.finish()
        np.testing.assert_array_equal(rt.read(ids.buf, 4, np.uint32), np.argmax(x, axis=1))


@pytest.mark.parametrize("attrs", [
    {"scoring": "softmax", "top_k": 2, "norm_topk": True, "routed_scale": 1.0, "groups": 1},  # mixtral, qwen3-moe
    {"scoring": "softmax", "top_k": 3, "norm_topk": False, "routed_scale": 1.5, "groups": 4, "topk_groups": 2,
     "group_score": "max"},  # deepseek-v2
    {"scoring": "sigmoid", "top_k": 2, "norm_topk": True, "routed_scale": 2.5, "groups": 4, "topk_groups": 2,
     "group_score": "top2", "bias": True},  # deepseek-v3
])
def test_moe_routing_matches_cpu(rt, attrs):
    a = {"topk_groups": 1, "group_score": "max", **attrs}
    rng = np.random.default_rng(11)
    tokens, experts = 9, 16
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    bias = rng.standard_normal(experts).astype(np.float32) * 0.1 if attrs.get("bias") else None
    weights = empty(rt, tokens, experts)
    run(rt, ops.moe_route(rt, arr(rt, logits), None if bias is None else arr(rt, bias), weights, tokens, experts, a))
    ids, w = choose_experts(torch.from_numpy(logits), None if bias is None else torch.from_numpy(bias), a)
    want = np.zeros((tokens, experts), dtype=np.float32)
    np.put_along_axis(want, ids.numpy(), w.numpy(), axis=1)
    np.testing.assert_allclose(read(rt, weights), want, rtol=1e-5, atol=1e-7)


def test_moe_accumulate_modes(rt):
    rng = np.random.default_rng(12)
    tokens, width = 3, 70
    y, base = (rng.standard_normal((tokens, width)).astype(np.float32) for _ in range(2))
    weights = np.array([[0.0, 0.5], [1.5, 0.0], [0.25, -1.0]], dtype=np.float32)
    out = arr(rt, base)
    run(rt, ops.moe_accumulate(rt, arr(rt, weights), 2, 1, arr(rt, y), out, width, tokens, ops.ADD))
    want = base + weights[:, 1:2] * y
    np.testing.assert_allclose(read(rt, out), want, rtol=1e-6)
    run(rt, ops.moe_accumulate(rt, arr(rt, weights), 2, 0, arr(rt, y), out, width, tokens, ops.SIGMOID))
    want = want + y / (1 + np.exp(-weights[:, 0:1]))
    np.testing.assert_allclose(read(rt, out), want, rtol=1e-5)
    run(rt, ops.moe_accumulate(rt, arr(rt, weights), 2, 0, arr(rt, y), out, width, tokens, ops.ASSIGN))
    np.testing.assert_allclose(read(rt, out), weights[:, 0:1] * y, rtol=1e-6)
