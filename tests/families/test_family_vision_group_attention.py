"""The group_attention op (Gemma 3's bidirectional attention inside an image): the CPU handler against a float64
reference of transformers' mask rule (causal, or both new tokens in one group; within the window), the tracer's
refusal of a paged step, and the refusal by name of the executors that have no handler for it yet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poot_core import Node, Reason, StepShape, Tracer, Unsupported
from poot_core.cpu.group_attention import group_attention
from poot_core.graph import passes
from poot_core.graph.ir import Paging

HEADS, KV_HEADS, DIM, CAPACITY = 4, 2, 8, 24


def _reference(q, k_all, v_all, start, groups, scale, window, softcap):
    """float64 [T, Hq, D]: every query against the keys its mask lets it see, from the rule itself."""
    tokens = q.shape[0]
    out = np.zeros(q.shape)
    for i in range(tokens):
        qp = start + i
        seen = [kp for kp in range(start + tokens)
                if (kp <= qp or (kp >= start and groups[kp - start] == groups[i] >= 0))
                and (window is None or qp - kp < window)]
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            scores = np.array([q[i, h] @ k_all[kp, kv] for kp in seen]) * scale
            if softcap is not None:
                scores = np.tanh(scores / softcap) * softcap
            w = np.exp(scores - scores.max())
            out[i, h] = (w / w.sum()) @ v_all[seen, kv]
    return out


@pytest.mark.parametrize(("start", "window", "softcap"), [(0, None, None), (5, None, None), (3, 4, None),
                                                          (0, 3, 30.0)])
def test_cpu_handler_matches_the_mask_rule(start, window, softcap):
    rng = np.random.default_rng(start + (window or 0))
    tokens = 10
    groups = np.array([-1, 0, 0, 0, 0, 0, -1, 1, 1, -1])  # two images, text around them
    q = rng.normal(size=(tokens, HEADS, DIM))
    k_all, v_all = rng.normal(size=(start + tokens, KV_HEADS, DIM)), rng.normal(size=(start + tokens, KV_HEADS, DIM))
    k_cache, v_cache = torch.zeros(1, KV_HEADS, CAPACITY, DIM), torch.zeros(1, KV_HEADS, CAPACITY, DIM)
    k_cache[0, :, :start] = torch.from_numpy(k_all[:start]).float().transpose(0, 1)  # an earlier step's keys
    v_cache[0, :, :start] = torch.from_numpy(v_all[:start]).float().transpose(0, 1)
    f32 = lambda a: torch.from_numpy(a).float()[None]  # noqa: E731
    positions = torch.arange(start, start + tokens)[None]
    ours = group_attention(f32(q), f32(k_all[start:]), f32(v_all[start:]), positions, k_cache, v_cache,
                           torch.from_numpy(groups)[None], 0.3, window, softcap)
    ref = _reference(q, k_all, v_all, start, groups, 0.3, window, softcap)
    assert np.abs(ours[0].numpy() - ref).max() <= 1e-5
    assert torch.equal(k_cache[0, :, start : start + tokens], f32(k_all[start:])[0].transpose(0, 1))
    # and it is not plain causal attention: an image's first token sees the image's later ones
    causal = _reference(q, k_all, v_all, start, np.full(tokens, -1), 0.3, window, softcap)
    assert np.abs(ours[0].numpy() - causal).max() > 1e-2


def _group_attention_node() -> Node:
    t = Tracer(StepShape(1, 4, 8), {})
    q = t.input("q", (1, 4, HEADS, DIM), "f32")
    k = t.input("k", (1, 4, KV_HEADS, DIM), "f32")
    t.attention(q, k, k, t.input("positions", (1, 4)), layer=0, scale=1.0, groups=t.input("groups", (1, 4)))
    (node,) = t.graph.nodes
    assert node.op == "group_attention"
    return node


def test_a_paged_step_reads_the_block_tables():
    """In a paged step (the serving engine runs Gemma 3's images so) group attention reads the pools of blocks
    through the step's sequence index and block tables, as attention does."""
    shape = StepShape(1, 4, 8, paging=Paging(blocks=4, block_size=4, seqs=1, max_blocks=2))
    t = Tracer(shape, {})
    q = t.input("q", (1, 4, HEADS, DIM), "f32")
    t.attention(q, q, q, t.input("positions", (1, 4)), layer=0, scale=1.0, groups=t.input("groups", (1, 4)))
    (node,) = [n for n in t.graph.nodes if n.op == "group_attention"]
    assert [r.name for r in node.inputs[6:]] == ["groups", "seq_index", "block_tables"]
    assert t.graph.state["k0"].shape == (4, HEADS, 4, DIM)  # a pool of 4 blocks of 4 positions


def _refused_by(cls: type, backend: str) -> None:
    assert "group_attention" not in passes.handled_ops(cls)
    with pytest.raises(Unsupported, match="group_attention") as err:
        passes.Dispatch(cls, backend)(_group_attention_node())
    assert err.value.reason == Reason.OPERATION


def test_vulkan_refuses_it_by_name():
    from poot_backend_vulkan.program import VulkanProgram

    _refused_by(VulkanProgram, "vulkan")
