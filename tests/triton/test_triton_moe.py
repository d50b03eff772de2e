"""The fused mixture-of-experts kernels (decode) against the grouped route, which runs each chosen expert
through the package's tested `linear` and activation."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

from poot_kernels_triton import moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_experts(count, d, inter, dtype, stacked, gen):
    def make(*shape):
        return (torch.randn(*shape, generator=gen) * 0.2).to(dtype).to(DEVICE)

    if stacked:  # one [E, ...] tensor per projection, as GGUF stores them; experts are views into it
        gate, up, down = make(count, inter, d), make(count, inter, d), make(count, d, inter)
        return [(gate[e], up[e], down[e]) for e in range(count)]
    return [(make(inter, d), make(inter, d), make(d, inter)) for _ in range(count)]


@pytest.mark.parametrize("tokens,slots,dtype,act,stacked", [
    (1, 2, torch.float32, "silu", False),
    (3, 4, torch.bfloat16, "silu", True),
    (4, 1, torch.float16, "gelu_tanh", False),
])
def test_fused_experts_match_the_grouped_route(tokens, slots, dtype, act, stacked):
    gen = torch.Generator().manual_seed(tokens * 10 + slots)
    count, d, inter = 6, 80, 48  # not multiples of the tiles: the edges are masked
    experts = random_experts(count, d, inter, dtype, stacked, gen)
    assert moe.FusedExperts.suits(experts)
    x = torch.randn(tokens, d, generator=gen).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(count, generator=gen)[:slots] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, slots, generator=gen).to(DEVICE)
    ours = moe.FusedExperts(experts).run(x, ids, weights, act)
    ref = moe.run_experts(x.float(), ids, weights, [tuple(w.float() for w in e) for e in experts], act)
    assert ours.dtype == torch.float32 and ours.shape == (tokens, d)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_packed_or_mismatched_experts_take_the_grouped_route():
    gen = torch.Generator().manual_seed(0)
    experts = random_experts(3, 32, 16, torch.float32, False, gen)
    assert not moe.FusedExperts.suits([experts[0], (experts[1][0], experts[1][1], experts[1][1])])  # down shape
    strided = torch.randn(16, 64, generator=gen).to(DEVICE)[:, ::2]
    assert not moe.FusedExperts.suits([(strided, experts[0][1], experts[0][2])])  # rows not contiguous
    from poot_core import PackedWeight

    packed = PackedWeight("gguf", (16, 32), {"blocks": torch.zeros(16, 34, dtype=torch.uint8)}, {"type": "Q8_0"})
    assert not moe.FusedExperts.suits([(packed, packed, packed)])


@pytest.mark.parametrize("experts,top_k,norm,scale", [(8, 2, True, 1.0), (60, 4, False, 1.0), (128, 8, True, 2.5)])
def test_routing_kernel_chooses_as_the_torch_ops_do(experts, top_k, norm, scale, monkeypatch):
    from poot_core import choose_experts

    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(5, experts, generator=gen) * 3).to(DEVICE)
    attrs = {"top_k": top_k, "scoring": "softmax", "norm_topk": norm, "routed_scale": scale, "groups": 1,
             "topk_groups": 1, "group_score": "max"}
    with monkeypatch.context() as patch:  # the kernel must do the work, not the torch ops it is checked against
        patch.setattr(moe, "choose_experts", lambda *a: pytest.fail("routed by the torch ops"))
        ids, weights = moe.route(logits, attrs)
    ref_ids, ref_weights = choose_experts(logits, None, attrs)
    assert torch.equal(ids, ref_ids)  # both highest first; random scores have no ties
    assert torch.allclose(weights, ref_weights, rtol=1e-5, atol=1e-7)


def test_grouped_or_sigmoid_routing_stays_with_the_torch_ops(monkeypatch):
    logits = torch.randn(2, 16).to(DEVICE)
    attrs = {"top_k": 2, "scoring": "sigmoid", "norm_topk": True, "routed_scale": 1.0, "groups": 4,
             "topk_groups": 2, "group_score": "top2"}
    called = []
    monkeypatch.setattr(moe, "choose_experts", lambda *a: called.append(a) or (None, None))
    moe.route(logits, attrs)
    assert called


def test_fused_experts_on_random_shapes():
    """Expert counts, widths (tile edges), tokens and slots drawn at random: the kernels find each pair's
    expert through an address table, so a wrong index or edge mask would show here. Under the interpreter the
    tiles are 16 columns by 64 inputs: widths up to 160 still end inside a tile and after two or more k steps,
    at half the cost of widths up to 300 (the cost grows with width times inter)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.integers(1, 9), st.integers(1, 160), st.integers(1, 90), st.integers(1, 4), st.data())
    def check(count, d, inter, tokens, data):
        slots = data.draw(st.integers(1, count))
        gen = torch.Generator().manual_seed(count * 1000 + d)
        experts = random_experts(count, d, inter, torch.bfloat16, data.draw(st.booleans()), gen)
        x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16).to(DEVICE)
        ids = torch.stack([torch.randperm(count, generator=gen)[:slots] for _ in range(tokens)]).to(DEVICE)
        weights = torch.rand(tokens, slots, generator=gen).to(DEVICE)
        ours = moe.FusedExperts(experts).run(x, ids, weights, "silu")
        ref = moe.run_experts(x.float(), ids, weights, [tuple(w.float() for w in e) for e in experts], "silu")
        assert ((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() < 1e-5

    check()
