"""The CPU's C attention kernels (a few queries per row; blocks of queries), against attention written out in
float64."""

from __future__ import annotations

import math

import pytest
import torch

from poot_core.cpu import ops
from poot_core.cpu.c_attention import MAX_QUERIES, attend_blocks, attend_few
from poot_core.cpu.c_kernels import features, kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler: the torch route is the only route")
# The vector route attend_blocks takes in this build: AVX-512, else AVX2 + FMA (the loader accepts no build
# without AVX2 + FMA, so one of the two is always there).
ROUTE = None if kernels() is None else "avx512f" if "avx512f" in features(kernels()) else "avx2"


def reference(q, positions, k_cache, v_cache, scale, window, softcap):
    """Per query: scores against the kept keys, softcap, softmax and the weighted values, in float64."""
    rows, tokens, heads, _ = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(rows, tokens, heads, v_cache.shape[-1], dtype=torch.float64)
    for r in range(rows):
        for t in range(tokens):
            p = int(positions[r, t])
            first = 0 if window is None else max(0, p - window + 1)
            for h in range(heads):
                keys = k_cache[r, h // group, first : p + 1].double()
                scores = keys @ q[r, t, h].double() * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                out[r, t, h] = torch.softmax(scores, 0) @ v_cache[r, h // group, first : p + 1].double()
    return out


@pytest.mark.parametrize("rows,tokens,heads,kv_heads,dk,dv,window,softcap", [
    (1, 1, 9, 3, 64, 64, None, None),     # SmolLM2's decode step
    (2, 1, 4, 4, 32, 32, None, None),     # two requests at different positions, no grouping
    (1, 3, 8, 2, 16, 24, None, None),     # a few queries (speculative) and values wider than keys
    (1, 9, 9, 3, 64, 64, None, None),     # a verify step of 8 proposed tokens
    (1, 1, 4, 1, 20, 20, 5, None),        # a sliding window, a head size that is not a multiple of 16
    (3, 2, 6, 2, 64, 64, 7, 30.0),        # window and gemma-style soft-capping together
])
def test_matches_float64_attention(rows, tokens, heads, kv_heads, dk, dv, window, softcap):
    g = torch.Generator().manual_seed(rows * 100 + tokens * 10 + heads)
    capacity = 300
    k_cache = torch.randn(rows, kv_heads, capacity, dk, generator=g)
    v_cache = torch.randn(rows, kv_heads, capacity, dv, generator=g)
    q = torch.randn(rows, tokens, heads, dk, generator=g) * 2
    starts = torch.tensor([17, 250, 1][:rows])
    positions = starts[:, None] + torch.arange(tokens)[None, :]
    scale = 1 / math.sqrt(dk)
    k = torch.randn(rows, tokens, kv_heads, dk, generator=g)
    v = torch.randn(rows, tokens, kv_heads, dv, generator=g)
    k_ref, v_ref = written(k_cache, k, positions), written(v_cache, v, positions)
    ours = attend_few(q, k, v, positions, k_cache, v_cache, scale, window, softcap)
    assert ours is not None
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    ref = reference(q, positions, k_ref, v_ref, scale, window, softcap)
    assert (ours.double() - ref).abs().max().item() < 2e-6


def written(cache, new, positions):
    """The cache with the step's keys (or values) [R, T, Hkv, D] put at their positions, by plain indexing."""
    out = cache.clone()
    for r in range(new.shape[0]):
        for t in range(new.shape[1]):
            out[r, :, int(positions[r, t])] = new[r, t]
    return out


def test_large_scores_do_not_overflow():
    """The softmax subtracts the largest score first: scores far beyond float32's exp range still work."""
    k_cache = torch.randn(1, 1, 64, 16)
    v_cache = torch.randn(1, 1, 64, 16)
    q = torch.randn(1, 1, 2, 16) * 1000
    positions = torch.tensor([[63]])
    ref_caches = k_cache.clone(), v_cache.clone()
    ours = attend_few(q, k_cache[:, :, 63:64].transpose(1, 2), v_cache[:, :, 63:64].transpose(1, 2), positions,
                      k_cache, v_cache, 1.0, None, None)
    assert torch.equal(k_cache, ref_caches[0]) and torch.equal(v_cache, ref_caches[1])
    ref = reference(q, positions, k_cache, v_cache, 1.0, None, None)
    assert torch.isfinite(ours).all()
    assert (ours.double() - ref).abs().max().item() < 1e-5


def test_ops_attention_writes_the_cache_and_agrees_with_torch(monkeypatch):
    """ops.attention takes the kernel for decode; with the kernels off it takes torch's route: same answer."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 1, 6, 32, generator=g) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    positions = torch.tensor([[40], [9]])
    caches = [torch.randn(2, 2, 64, 32, generator=g) for _ in range(2)]
    fast = ops.attention(q, k, v, positions, caches[0].clone(), caches[1].clone(), 0.2, None, None)
    monkeypatch.setenv("POOT_CPU_KERNELS", "0")
    kc, vc = caches[0].clone(), caches[1].clone()
    slow = ops.attention(q, k, v, positions, kc, vc, 0.2, None, None)
    assert torch.equal(kc[0, :, 40], k[0, 0]) and torch.equal(vc[1, :, 9], v[1, 0])
    assert (fast - slow).abs().max().item() < 1e-5


def test_prefill_and_odd_inputs_are_left_to_torch():
    k_cache = torch.zeros(1, 2, 32, 16)
    n = MAX_QUERIES + 1  # a prefill chunk: more queries than a decode or verify step
    new = torch.ones(1, n, 2, 16)
    assert attend_few(torch.zeros(1, n, 4, 16), new, new, torch.arange(n)[None], k_cache, k_cache, 1.0, None,
                      None) is None
    assert k_cache.abs().sum() == 0  # refused before writing anything
    half = k_cache.to(torch.bfloat16)
    assert attend_few(torch.zeros(1, 1, 4, 16), new[:, :1], new[:, :1], torch.tensor([[3]]), half, half, 1.0, None,
                      None) is None


@pytest.mark.parametrize("rows,tokens,heads,kv_heads,d,start,window,softcap", [
    (1, 130, 9, 3, 64, 0, None, None),   # a prompt from position 0: causal, grouped heads, a partial last tile
    (2, 70, 4, 4, 32, 60, None, None),   # a later chunk: earlier keys are in the cache already
    (1, 90, 6, 2, 64, 3, 20, None),      # a sliding window shorter than the chunk
    (1, 23, 2, 1, 16, 150, 40, 25.0),    # window and soft-capping
])
def test_blocks_match_float64_attention(rows, tokens, heads, kv_heads, d, start, window, softcap):
    g = torch.Generator().manual_seed(tokens + d)
    capacity = 256
    k_cache = torch.randn(rows, kv_heads, capacity, d, generator=g)
    v_cache = torch.randn(rows, kv_heads, capacity, d, generator=g)
    joined = torch.randn(rows, tokens, heads * d + 8, generator=g) * 2  # q as a view into a joined product
    q = joined[..., : heads * d].reshape(rows, tokens, heads, d)
    positions = torch.tensor([start, start + 11][:rows])[:, None] + torch.arange(tokens)[None, :]
    scale = 1 / math.sqrt(d)
    ours = attend_blocks(q, positions, k_cache, v_cache, scale, window, softcap)
    assert ours is not None, f"attend_blocks refused on its {ROUTE} route"
    ref = reference(q, positions, k_cache, v_cache, scale, window, softcap)
    assert (ours.double() - ref).abs().max().item() < 2e-6


def test_blocks_leave_odd_head_sizes_to_torch():
    cache = torch.zeros(1, 1, 32, 20)
    assert attend_blocks(torch.zeros(1, 8, 2, 20), torch.arange(8)[None], cache, cache, 1.0, None, None) is None


@pytest.mark.parametrize("style,dim", [("neox", 32), ("interleaved", 32), ("neox", 16)])  # 16: partial rotary
def test_rope_inside_the_call_equals_rope_before_it(style, dim):
    g = torch.Generator().manual_seed(dim)
    q, k, v = torch.randn(2, 1, 4, 32, generator=g), torch.randn(2, 1, 2, 32, generator=g), torch.randn(2, 1, 2, 32)
    positions = torch.tensor([[30], [7]])
    caches = [torch.randn(2, 2, 48, 32, generator=g) for _ in range(2)]
    cos, sin = ops.rope_tables(positions, 10000.0, dim, {})
    kc, vc = caches[0].clone(), caches[1].clone()
    fused = attend_few(q, k, v, positions, kc, vc, 0.3, None, None, rope=(cos, sin, style == "interleaved"))
    kc2, vc2 = caches[0].clone(), caches[1].clone()
    plain = attend_few(ops.rope(q, cos, sin, style), ops.rope(k, cos, sin, style), v, positions, kc2, vc2, 0.3,
                       None, None)
    assert torch.allclose(kc, kc2, atol=1e-6) and torch.equal(vc, vc2)  # the cache holds the rotated keys
    assert torch.allclose(fused, plain, atol=1e-6)


def test_positions_outside_the_cache_are_refused_before_anything_is_written(tiny_checkpoint):
    """The kernels index the cache by position without bounds checks of their own: the program checks."""
    import numpy as np

    from poot_core import ModelHandle, RequestError, StepShape, Tracer, open_executor

    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    shape = StepShape(1, 1, 16)
    tracer = Tracer(shape, handle.store().shapes())
    handle.family.trace(handle.config(), tracer, shape)
    ex = open_executor("cpu")
    program = ex.prepare(tracer.graph, ex.upload(handle.store()))
    state = ex.allocate_state(tracer.graph)
    for bad in (16, -1):
        with pytest.raises(RequestError, match="outside the KV cache"):
            program.run(state, {"tokens": np.array([[5]]), "positions": np.array([[bad]])})
    assert all(float(buf.abs().sum()) == 0.0 for buf in state.values())
    program.run(state, {"tokens": np.array([[5]]), "positions": np.array([[15]])})  # the last position is fine


def _random_case(data, max_tokens):
    from hypothesis import strategies as st

    kv_heads = data.draw(st.integers(1, 3))
    heads = kv_heads * data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from([16, 32, 48, 64, 128]))
    rows = data.draw(st.integers(1, 2))
    tokens = data.draw(st.integers(1, max_tokens))
    capacity = data.draw(st.integers(tokens, tokens + 150))
    starts = [data.draw(st.integers(0, capacity - tokens)) for _ in range(rows)]
    window = data.draw(st.one_of(st.none(), st.integers(1, 80)))
    softcap = data.draw(st.one_of(st.none(), st.floats(5.0, 50.0)))
    return rows, tokens, heads, kv_heads, d, capacity, starts, window, softcap


def test_kernels_agree_with_float64_on_random_shapes():
    """Random head counts, head sizes, chunk lengths, cache sizes, positions, windows and soft-caps: both
    kernels index the cache by hand, so their edges (partial tiles, windows cutting tiles, the last position
    of the cache) are drawn at random here."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        few = data.draw(st.booleans())
        rows, tokens, heads, kv_heads, d, capacity, starts, window, softcap = _random_case(data, 4 if few else 140)
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
        k_cache = torch.randn(rows, kv_heads, capacity, d, generator=g)
        v_cache = torch.randn(rows, kv_heads, capacity, d, generator=g)
        q = torch.randn(rows, tokens, heads, d, generator=g) * 2
        positions = torch.tensor(starts)[:, None] + torch.arange(tokens)[None, :]
        scale = 1 / math.sqrt(d)
        if few:
            k, v = torch.randn(rows, tokens, kv_heads, d, generator=g), torch.randn(rows, tokens, kv_heads, d)
            k_ref, v_ref = written(k_cache, k, positions), written(v_cache, v, positions)
            ours = attend_few(q, k, v, positions, k_cache, v_cache, scale, window, softcap)
            assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        else:
            if d > 256:
                return
            k_ref, v_ref = k_cache, v_cache
            ours = attend_blocks(q, positions, k_cache, v_cache, scale, window, softcap)
        assert ours is not None
        ref = reference(q, positions, k_ref, v_ref, scale, window, softcap)
        # soft-capping multiplies tanh's float32 error (the vector tanh goes through exp) by the cap
        bound = 5e-6 if softcap is None else 5e-6 * softcap
        assert (ours.double() - ref).abs().max().item() < bound

    check()


@pytest.mark.parametrize("heads,kv_heads,dk,dv,block,window,softcap", [
    (9, 3, 64, 64, 16, None, None),   # SmolLM2's shape in blocks of 16
    (4, 4, 20, 24, 5, None, None),    # odd block and head sizes, values wider than keys
    (6, 2, 32, 32, 8, 11, 30.0),      # a sliding window and soft-capping
])
def test_paged_decode_gives_the_contiguous_bits(heads, kv_heads, dk, dv, block, window, softcap):
    """Tokens of several sequences whose keys lie in scattered blocks of a pool: the keys written where the
    tables say, and each query's output equal, bit for bit, to attend_few over the same keys laid out
    contiguously (both against float64 too)."""
    from poot_core.cpu.c_attention import attend_paged

    gen = torch.Generator().manual_seed(7)
    lengths = [1, block, 3 * block + 2, 2 * block - 1]  # positions already cached per sequence, then 1 or 2 new
    new = [1, 2, 1, 2]
    capacity = (max(lengths) + 2 + block - 1) // block * block
    per_seq = capacity // block
    n_blocks = per_seq * len(lengths) + 3
    order = torch.randperm(n_blocks, generator=gen)
    tables = order[: per_seq * len(lengths)].reshape(len(lengths), per_seq)
    k_pool = torch.randn(n_blocks, kv_heads, block, dk, generator=gen)
    v_pool = torch.randn(n_blocks, kv_heads, block, dv, generator=gen)
    seqs = torch.tensor([s for s, m in enumerate(new) for _ in range(m)])
    positions = torch.tensor([lengths[s] + j for s, m in enumerate(new) for j in range(m)])
    count = len(seqs)
    q = torch.randn(count, heads, dk, generator=gen)
    k = torch.randn(count, kv_heads, dk, generator=gen)
    v = torch.randn(count, kv_heads, dv, generator=gen)
    # the contiguous copy of every sequence's cache before the step
    k_flat = k_pool[tables].transpose(1, 2).reshape(len(lengths), kv_heads, capacity, dk).contiguous()
    v_flat = v_pool[tables].transpose(1, 2).reshape(len(lengths), kv_heads, capacity, dv).contiguous()
    scale = 1 / math.sqrt(dk)
    out = attend_paged(q, k, v, positions, seqs, tables, k_pool, v_pool, scale, window, softcap)
    assert out is not None
    for s in range(len(new)):
        at = (seqs == s).nonzero().flatten()
        pos = positions[at][None]
        want = attend_few(q[at][None], k[at][None], v[at][None], pos, k_flat[s : s + 1], v_flat[s : s + 1],
                          scale, window, softcap)
        assert torch.equal(out[at], want[0])
        ref = reference(q[at][None], pos, k_flat[s : s + 1], v_flat[s : s + 1], scale, window, softcap)
        assert torch.allclose(out[at].double(), ref[0], rtol=1e-4, atol=1e-5)
        for j, p in zip(at.tolist(), pos[0].tolist(), strict=True):  # the new keys went where the table says
            b, off = int(tables[s, p // block]), p % block
            assert torch.equal(k_pool[b, :, off], k[j]) and torch.equal(v_pool[b, :, off], v[j])


@pytest.mark.parametrize("heads,kv_heads,d,block,window,softcap", [
    (9, 3, 64, 16, None, None),   # SmolLM2's shape in blocks of 16
    (4, 4, 32, 5, None, None),    # an odd block size: a key tile spans parts of many blocks
    (6, 2, 16, 8, 37, 30.0),      # a sliding window and soft-capping
])
def test_paged_prefill_gives_the_contiguous_bits(heads, kv_heads, d, block, window, softcap):
    """Prefill chunks of several sequences in one step (token rows of q apart, as a joined product leaves them),
    keys in scattered blocks: each query's output equal, bit for bit, to attend_blocks over the same keys laid
    out contiguously (and to float64)."""
    from poot_core.cpu.c_attention import attend_paged_blocks

    gen = torch.Generator().manual_seed(11)
    cached = [0, 70, 3, 130]  # positions already cached per sequence; then a chunk of new ones
    new = [67, 9, 130, 5]
    capacity = (max(c + n for c, n in zip(cached, new, strict=True)) + block - 1) // block * block
    per_seq = capacity // block
    n_blocks = per_seq * len(cached) + 3
    tables = torch.randperm(n_blocks, generator=gen)[: per_seq * len(cached)].reshape(len(cached), per_seq)
    k_pool = torch.randn(n_blocks, kv_heads, block, d, generator=gen)
    v_pool = torch.randn(n_blocks, kv_heads, block, d, generator=gen)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new, strict=True)])
    starts = [sum(new[:s]) for s in range(len(new))]
    runs = [(s, starts[s], starts[s] + new[s]) for s in range(len(new))]
    joined = torch.randn(len(positions), heads * d + 8, generator=gen) * 2
    q = joined[:, : heads * d].reshape(len(positions), heads, d)
    scale = 1 / math.sqrt(d)
    out = attend_paged_blocks(q, positions, runs, tables, k_pool, v_pool, scale, window, softcap)
    assert out is not None, f"attend_paged_blocks refused on its {ROUTE} route"
    k_flat = k_pool[tables].transpose(1, 2).reshape(len(cached), kv_heads, capacity, d).contiguous()
    v_flat = v_pool[tables].transpose(1, 2).reshape(len(cached), kv_heads, capacity, d).contiguous()
    for s, t0, t1 in runs:
        pos = positions[t0:t1][None]
        want = attend_blocks(q[None, t0:t1], pos, k_flat[s : s + 1], v_flat[s : s + 1], scale, window, softcap)
        assert want is not None
        assert torch.equal(out[t0:t1], want[0]), f"sequence {s}"
        ref = reference(q[None, t0:t1], pos, k_flat[s : s + 1], v_flat[s : s + 1], scale, window, softcap)
        assert torch.allclose(out[t0:t1].double(), ref[0], rtol=1e-4, atol=1e-5)
