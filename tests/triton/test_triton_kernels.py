"""poot_kernels_triton under the Triton interpreter, against plain float32 torch references.

Inputs are stored in the tested dtype and the references read those same values upcast to float32, so the
bounds measure the kernels' own error (float32 accumulation, one rounding to the output dtype).
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

import poot_kernels_triton as ktr
from helpers.gguf_blocks import F16_FIELDS
from helpers.triton_checks import rel_err
from poot_core.checkpoint.layouts import PackedWeight
from poot_core.errors import RequestError, Unsupported
from poot_kernels_triton.attention import _prefill_shared, fitted_prefill_tile
from poot_kernels_triton.tuning import TUNINGS

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors

# ||out - ref|| / ||ref|| bounds by the dtype the output is rounded to
BOUND = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------- norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm(dtype: torch.dtype, offset: float) -> None:
    x = torch.randn(5, 200).to(dtype)
    res = torch.randn(5, 200).to(dtype)
    w = torch.randn(200).to(dtype)
    new_res, out = ktr.add_rms_norm(x, res, w, 1e-6, weight_offset=offset)
    total = x.float() + res.float()
    assert rel_err(new_res, total) < BOUND[dtype]
    s = total.to(dtype).float()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + offset)
    assert out.dtype == dtype and new_res.dtype == dtype
    assert rel_err(out, ref) < BOUND[dtype]


def test_rms_norm_without_residual_and_inplace() -> None:
    x = torch.randn(3, 64)
    w = torch.randn(64)
    res, out = ktr.add_rms_norm(x, None, w, 1e-5)
    assert res is x
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert rel_err(out, ref) < BOUND[torch.float32]
    r = torch.randn(3, 64)
    expect = x + r
    back, _ = ktr.add_rms_norm(x, r, w, 1e-5, inplace=True)
    assert back is r and rel_err(r, expect) < BOUND[torch.float32]


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_gated_activation(dtype: torch.dtype, kind: str) -> None:
    gate_up = (torch.randn(4, 2 * 300) * 3).to(dtype)
    gate, up = gate_up[:, :300], gate_up[:, 300:]
    g, u = gate.float(), up.float()
    act = torch.nn.functional.silu(g) if kind == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    ref = act * u
    assert rel_err(ktr.gated_activation(gate, up, kind=kind), ref) < BOUND[dtype]
    assert rel_err(ktr.gated_activation(gate_up, kind=kind), ref) < BOUND[dtype]


def test_gated_activation_unknown_kind() -> None:
    with pytest.raises(Unsupported):
        ktr.gated_activation(torch.randn(2, 8), kind="relu2")


# ---------------------------------------------------------------- rope and kv cache


def rope_reference(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    rot = 2 * inv_freq.shape[0]
    angles = pos.double()[:, None] * inv_freq.double()[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    xr = x[..., :rot].double()
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    rotated = xr * cos + torch.cat([-x2, x1], -1) * sin
    return torch.cat([rotated, x[..., rot:].double()], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("inplace", [True, False])
def test_apply_rope(dtype: torch.dtype, rotary_dim: int, inplace: bool) -> None:
    q = torch.randn(6, 4, 64).to(dtype)
    k = torch.randn(6, 2, 64).to(dtype)
    pos = torch.tensor([0, 5, 17, 3, 30, 31])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = ktr.rope_cos_sin(inv_freq, 32)
    ref_q, ref_k = rope_reference(q, pos, inv_freq), rope_reference(k, pos, inv_freq)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = ktr.apply_rope(q_in, k_in, pos, cos, sin, inplace=inplace)
    assert (q_out is q_in) == inplace
    if not inplace:
        assert torch.equal(q_in, q)  # the input is left alone
    assert rel_err(q_out, ref_q) < BOUND[dtype]
    assert rel_err(k_out, ref_k) < BOUND[dtype]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv(cache_dtype: torch.dtype) -> None:
    layers, kv_heads, cap, dim = 3, 2, 16, 32
    kc = torch.zeros(layers, kv_heads, cap, dim, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    k = torch.randn(4, kv_heads, dim)
    v = torch.randn(4, kv_heads, dim)
    pos = torch.tensor([2, 9, 10, 15], dtype=torch.int32)
    ktr.write_kv(k, v, kc, vc, pos, layer=1)
    ref_k = torch.zeros(layers, kv_heads, cap, dim)
    ref_v = torch.zeros_like(ref_k)
    ref_k[1][:, pos.long()] = k.transpose(0, 1)
    ref_v[1][:, pos.long()] = v.transpose(0, 1)
    if cache_dtype == torch.float32:
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    else:
        # the interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest): within one ulp
        torch.testing.assert_close(kc.float(), ref_k, rtol=2**-7, atol=0.0)
        torch.testing.assert_close(vc.float(), ref_v, rtol=2**-7, atol=0.0)


# ---------------------------------------------------------------- attention


def attention_reference(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: int,
    *,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [t, h, d] at positions q_pos against cache [kh, cap, d]; float64 softmax."""
    group = q.shape[1] // kc.shape[0]
    k = kc[:, :kv_len].double().repeat_interleave(group, 0)
    v = vc[:, :kv_len].double().repeat_interleave(group, 0)
    s = torch.einsum("thd,hnd->htn", q.double(), k) / math.sqrt(q.shape[2])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(kv_len)
    visible = torch.ones(q.shape[0], kv_len, dtype=torch.bool)
    if causal:
        visible &= j[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= (q_pos[:, None] - j[None, :]) < window
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("htn,hnd->thd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "start,window,softcap,causal",
    [
        (0, None, None, True),
        (9, None, None, True),
        (9, 7, None, True),
        (5, None, 20.0, True),
        (0, None, None, False),
    ],
)
def test_prefill_attention(
    dtype: torch.dtype, start: int, window: int | None, softcap: float | None, causal: bool
) -> None:
    tokens, q_heads, kv_heads, dim, cap = 21, 4, 2, 40, 48  # head size 40: a padded, masked head dim
    q = torch.randn(tokens, q_heads, dim).to(dtype)
    kc = torch.randn(kv_heads, cap, dim).to(dtype)
    vc = torch.randn(kv_heads, cap, dim).to(dtype)
    out = ktr.prefill_attention(q, kc, vc, start, causal=causal, window=window, softcap=softcap)
    ref = attention_reference(
        q,
        kc,
        vc,
        torch.arange(start, start + tokens),
        start + tokens,
        causal=causal,
        window=window,
        softcap=softcap,
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "window,softcap,splits", [(None, None, None), (None, None, 1), (6, 30.0, None), (20, None, 3)]
)
def test_decode_attention(
    dtype: torch.dtype, window: int | None, softcap: float | None, splits: int | None
) -> None:
    batch, q_heads, kv_heads, dim, cap = 3, 8, 2, 32, 50
    q = torch.randn(batch, q_heads, dim).to(dtype)
    kc = torch.randn(batch, kv_heads, cap, dim).to(dtype)
    vc = torch.randn(batch, kv_heads, cap, dim).to(dtype)
    lens = torch.tensor([1, 37, 50], dtype=torch.int32)
    out = ktr.decode_attention(q, kc, vc, lens, window=window, softcap=softcap, num_splits=splits)
    for b in range(batch):
        n = int(lens[b])
        ref = attention_reference(
            q[b : b + 1], kc[b], vc[b], torch.tensor([n - 1]), n, window=window, softcap=softcap
        )
        assert rel_err(out[b : b + 1], ref) < BOUND[dtype], f"row {b}"


def test_decode_attention_single_sequence_cache() -> None:
    q = torch.randn(1, 4, 16)
    kc, vc = torch.randn(4, 20, 16), torch.randn(4, 20, 16)
    out = ktr.decode_attention(q, kc, vc, torch.tensor([20]))
    ref = attention_reference(q, kc, vc, torch.tensor([19]), 20)
    assert rel_err(out, ref) < BOUND[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_with_wide_heads(dtype: torch.dtype) -> None:
    """Heads of 256 (Gemma's): on the H200 the tuned tile once asked for more shared memory than there is."""
    tokens, q_heads, kv_heads, dim, cap = 70, 2, 1, 256, 80
    q = torch.randn(tokens, q_heads, dim).to(dtype)
    kc = torch.randn(kv_heads, cap, dim).to(dtype)
    vc = torch.randn(kv_heads, cap, dim).to(dtype)
    out = ktr.prefill_attention(q, kc, vc, 3, window=40)
    ref = attention_reference(q, kc, vc, torch.arange(3, 3 + tokens), 3 + tokens, causal=True, window=40)
    assert rel_err(out, ref) < BOUND[dtype]


@pytest.mark.parametrize("name", sorted(n for n in TUNINGS if n != "interpreter"))  # it has no shared memory
def test_every_target_fits_wide_heads_in_the_shared_memory_its_tile_holds_at_128(name: str) -> None:
    tile = TUNINGS[name].prefill
    fitted = fitted_prefill_tile(tile, 256)
    assert _prefill_shared(fitted, 256) <= _prefill_shared(tile, 128)
    assert fitted.num_stages == 1 or fitted.block_n == tile.block_n  # the stages go first
    assert fitted_prefill_tile(tile, 128) == tile and fitted_prefill_tile(tile, 64) == tile


def test_attention_rejects_bad_grouping() -> None:
    with pytest.raises(RequestError):
        ktr.prefill_attention(torch.randn(2, 3, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16), 0)


# ---------------------------------------------------------------- dense linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 20])
def test_dense_linear(dtype: torch.dtype, m: int) -> None:
    x = torch.randn(m, 80).to(dtype)
    w = torch.randn(50, 80).to(dtype)
    b = torch.randn(50).to(dtype)
    ref = x.double() @ w.double().T
    assert rel_err(ktr.dense_linear(x, w), ref) < BOUND[dtype]
    assert rel_err(ktr.linear(x, w, b), ref + b.double()) < BOUND[dtype]


# ---------------------------------------------------------------- GGUF blocks



def random_gguf_rows(gguf_type: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose scale fields are sane float16 values; all other bits are random."""
    _, elems, nbytes = ktr.GGUF_TYPES[gguf_type]
    data = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[gguf_type]:
        half = rng.uniform(-0.05, 0.05, size=(n, k // elems)).astype(np.float16)
        data[:, :, off : off + 2] = half.view(np.uint8).reshape(n, k // elems, 2)
    return data.reshape(n, -1)


@pytest.mark.parametrize("gguf_type", sorted(ktr.GGUF_TYPES))
@pytest.mark.parametrize("m", [2, 6])
def test_gguf_linear(gguf_type: str, m: int) -> None:
    rng = np.random.default_rng(1)
    n, k = 12, 512
    blocks = random_gguf_rows(gguf_type, n, k, rng)
    w_ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[gguf_type]).astype(np.float64)
    assert w_ref.shape == (n, k)
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = x.double() @ torch.from_numpy(w_ref).T
    weight = PackedWeight("gguf", (n, k), {"blocks": torch.from_numpy(blocks)}, {"type": gguf_type})
    out = ktr.linear(x, weight)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < BOUND[torch.bfloat16]


def test_gguf_rejects_unknown_type_and_bad_rows() -> None:
    x = torch.randn(1, 256)
    with pytest.raises(Unsupported):
        ktr.gguf_linear(x, torch.zeros(4, 66, dtype=torch.uint8), "IQ2_XXS")
    with pytest.raises(RequestError):
        ktr.gguf_linear(x, torch.zeros(4, 100, dtype=torch.uint8), "Q4_K")


# ---------------------------------------------------------------- GPTQ


def gptq_reference(qweight, qzeros, scales, g_idx, zero_offset: int) -> torch.Tensor:
    """W [k, n] from GPTQ parts, unpacked with plain integer ops (float64)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    q = ((qweight.long()[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])
    z = ((qzeros.long()[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qzeros.shape[0], -1)
    g = g_idx.long()
    return (q - (z[g] + zero_offset)).double() * scales[g].double()


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 4-bit values eight to an int32 along `dim` (value i in bits 4i..4i+3)."""
    v = values.long().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    word = (v << torch.arange(0, 32, 4)).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).movedim(-1, dim)


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_linear(m: int, act_order: bool) -> None:
    k, n, group = 256, 24, 64
    groups = k // group
    q = torch.randint(0, 16, (k, n))
    z = torch.randint(0, 15, (groups, n))
    scales = (torch.rand(groups, n) * 0.02 + 0.001).to(torch.float16)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    g_idx = g_idx.to(torch.int32)
    qweight, qzeros = pack_int4(q, 0), pack_int4(z, 1)
    w_ref = gptq_reference(qweight, qzeros, scales, g_idx, 1)
    # the packing helper and the reference unpacking agree with the plain values
    assert torch.equal(w_ref, (q - z[g_idx.long()] - 1).double() * scales[g_idx.long()].double())
    x = torch.randn(m, k).to(torch.float16)
    weight = PackedWeight(
        "gptq", (n, k), {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}, {"bits": 4}
    )
    out = ktr.linear(x, weight)
    assert rel_err(out, x.double() @ w_ref) < BOUND[torch.float16]
    out_v2 = ktr.gptq_linear(x, qweight, qzeros, scales, g_idx, zero_offset=0)
    assert (
        rel_err(out_v2, x.double() @ gptq_reference(qweight, qzeros, scales, g_idx, 0)) < BOUND[torch.float16]
    )


# ---------------------------------------------------------------- sampling


def test_greedy() -> None:
    logits = torch.randn(4, 1000)
    logits[2, 700] = 50.0
    logits[3, 10] = logits[3, 900] = 60.0  # tie: lowest id wins, as torch.argmax
    assert torch.equal(ktr.greedy(logits), torch.argmax(logits, -1))
    bf = torch.randn(3, 777).to(torch.bfloat16)
    assert torch.equal(ktr.greedy(bf), torch.argmax(bf.float(), -1))


def sample_reference(logits, u, temperature, top_k, top_p, min_p) -> list[int]:
    """Sort-based filters in float64, then inverse CDF in vocabulary order."""
    tokens = []
    for r in range(logits.shape[0]):
        z = logits[r].double()
        if temperature[r] <= 0:
            tokens.append(int(torch.argmax(z)))
            continue
        z = z / temperature[r]
        keep = torch.ones_like(z, dtype=torch.bool)
        if top_k[r] > 0:
            keep &= z >= torch.topk(z, int(top_k[r])).values[-1]
        if top_p[r] < 1.0:
            p = torch.where(keep, torch.softmax(z.masked_fill(~keep, float("-inf")), 0), 0.0)
            order = torch.argsort(p, descending=True)
            above = torch.cumsum(p[order], 0) - p[order]  # mass of strictly better tokens
            kept_sorted = above < top_p[r]
            keep_p = torch.zeros_like(keep)
            keep_p[order[kept_sorted]] = True
            keep &= keep_p
        if min_p[r] > 0.0:
            keep &= z >= z.max() + math.log(min_p[r])
        weights = torch.where(keep, torch.exp(z - z.max()), 0.0)
        cum = torch.cumsum(weights, 0)
        tokens.append(int(torch.searchsorted(cum, u[r].double() * cum[-1], right=True)))
    return tokens


def test_sample_matches_reference() -> None:
    rows, vocab = 8, 600
    logits = torch.randn(rows, vocab) * 3
    u = torch.rand(rows)
    temperature = [0.7, 1.0, 1.3, 0.0, 0.9, 1.0, 0.5, 2.0]
    top_k = [0, 5, 40, 0, 0, 600, 1, 10]
    top_p = [1.0, 1.0, 0.9, 1.0, 0.5, 0.95, 1.0, 0.3]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0]
    out = ktr.sample(
        logits,
        u,
        temperature=torch.tensor(temperature),
        top_k=torch.tensor(top_k),
        top_p=torch.tensor(top_p),
        min_p=torch.tensor(min_p),
    )
    assert out.dtype == torch.int64
    assert out.tolist() == sample_reference(logits, u, temperature, top_k, top_p, min_p)


def test_sample_follows_uniform_across_the_kept_set() -> None:
    # with top_k=3 and many uniforms, every kept token and only those are drawn, in CDF order
    logits = torch.randn(1, 300).repeat(16, 1)
    u = torch.linspace(0.0, 0.999, 16)
    out = ktr.sample(logits, u, temperature=1.0, top_k=3)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    assert set(out.tolist()) == top3
    ref = sample_reference(logits, u, [1.0] * 16, [3] * 16, [1.0] * 16, [0.0] * 16)
    assert out.tolist() == ref


def test_sample_rejects_bad_settings() -> None:
    with pytest.raises(RequestError):
        ktr.sample(torch.randn(2, 10), torch.rand(2), top_p=1.5)
    with pytest.raises(RequestError):
        ktr.sample(torch.randn(2, 10), torch.rand(3))
