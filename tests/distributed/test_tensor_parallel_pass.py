"""The tensor-parallel pass and the pipeline cut on traced steps, in this process: what each rank computes and
reads (the spawned tests show the numbers are right)."""

from __future__ import annotations

import pytest

from helpers import gguf_models
from poot_core import ModelHandle, StepShape
from poot_core.distributed.shards import rank_store, split, splittable
from poot_core.driver.core import trace_step
from poot_core.errors import Reason, Unsupported
from poot_core.graph import pipeline
from poot_core.graph import tensor_parallel as tp

SHAPE = StepShape(1, 4, 32)


def graph_of(path):
    handle = ModelHandle.load(path)
    return handle, trace_step(handle, SHAPE)


def test_dense_layers_split_by_heads_and_features(tiny_checkpoint):
    handle, graph = graph_of(tiny_checkpoint("llama"))  # 3 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 256
    covered: dict[str, list[tuple[int, int, int]]] = {}
    for rank in range(2):
        local, shards = tp.shard(graph, rank, 2, "g")
        ops = [n.op for n in local.nodes]
        assert ops.count("all_reduce") == 2 * 3 and ops.count("all_gather") == 1
        assert all(n.shape[2] == 2 for n in local.nodes if n.op == "attention")
        assert all(spec.shape[1] == 1 for spec in local.state.values())  # one of the two KV heads each
        gather = next(n for n in local.nodes if n.op == "all_gather")
        assert gather.attrs["sizes"] == [128, 128] and gather.shape[-1] == 256
        for s in shards.values():
            covered.setdefault(f"{s.base}/{s.axis}", []).append((rank, s.start, s.stop))
            assert local.weights[s.name] == s.shape(graph.weights[s.base])
    q = covered["model.layers.0.self_attn.q_proj.weight/0"]
    assert q == [(0, 0, 32), (1, 32, 64)]
    assert covered["model.layers.2.self_attn.o_proj.weight/1"] == [(0, 0, 32), (1, 32, 64)]
    assert covered["model.layers.1.mlp.down_proj.weight/1"] == [(0, 0, 64), (1, 64, 128)]
    assert covered["model.embed_tokens.weight/0"] == [(0, 0, 128), (1, 128, 256)]  # the tied head's rows
    # the embedding itself stays whole on every rank
    assert "model.embed_tokens.weight" in tp.shard(graph, 0, 2, "g")[0].weights


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_checkpoint):
    _, graph = graph_of(tiny_checkpoint("llama"))
    for rank in range(4):
        _, shards = tp.shard(graph, rank, 4, "g")
        k = shards[next(n for n in shards if n.startswith("model.layers.0.self_attn.k_proj"))]
        assert (k.start, k.stop) == (16 * (rank // 2), 16 * (rank // 2) + 16)  # ranks 0, 1 read KV head 0


def test_heads_that_do_not_divide_are_refused_by_name(tiny_checkpoint):
    _, graph = graph_of(tiny_checkpoint("llama"))
    with pytest.raises(Unsupported) as err:
        tp.shard(graph, 0, 3, "g")
    assert err.value.reason is Reason.SHAPE and "4 attention heads over 3 ranks" in err.value.name


def test_packed_blocks_split_only_along_blocks(tmp_path):
    for kind, attention_split in (("Q8_0", True), ("Q4_K", False)):
        path, _ = gguf_models.build(tmp_path / kind, kind)
        handle, graph = graph_of(path)
        store = handle.store()
        local, shards = tp.shard(graph, 1, 2, "g", splittable(store))
        reduces = sum(n.op == "all_reduce" for n in local.nodes)
        # 2 layers; Q4_K's 256-value blocks cannot give o_proj's 128-column halves: attention stays replicated
        assert reduces == (4 if attention_split else 2), kind
        weights = rank_store(store, set(local.weights), shards)
        for name, s in shards.items():
            w = weights.get(name)
            full = store.get(s.base)
            if hasattr(full, "parts"):
                assert w.kind == full.kind and tuple(w.shape) == s.shape(tuple(full.shape))
                # bytes are the stored blocks themselves, not a widened copy
                assert w.nbytes() * (full.shape[s.axis]) == full.nbytes() * (s.stop - s.start)
                if s.axis == 0:
                    assert w.parts["blocks"].data_ptr() == full.parts["blocks"][s.start].data_ptr()
        down = next(s for s in shards.values() if "down" in s.base and s.axis == 1)
        with pytest.raises(Unsupported):
            split(store.get(down.base), tp.Shard(down.base, 1, 16, 48))


def test_latent_attention_and_experts_split(moe_checkpoint):
    _, graph = graph_of(moe_checkpoint("deepseek_v2"))  # 4 heads; layer 0 dense, layers 1-2 8 experts + shared
    local, shards = tp.shard(graph, 1, 2, "g")
    mla = [n for n in local.nodes if n.op == "mla_attention"]
    assert len(mla) == 3 and all(n.shape[2] == 2 for n in mla)
    assert local.state == graph.state  # the latent cache stays whole on every rank
    kv_b = shards[mla[0].inputs[4].name]
    assert (kv_b.axis, kv_b.start, kv_b.stop) == (0, 2 * 32, 4 * 32)  # heads 2, 3 of nope 16 + v 16
    moes = [n for n in local.nodes if n.op == "moe"]
    assert len(moes) == 2 and all(shards[w.name].stop - shards[w.name].start == 16 for n in moes
                                   for w in n.inputs[5:])  # half of each expert's 32 features
    # per layer: one sum after attention; after the dense MLP or the moe (which also sums the shared expert's part)
    assert sum(n.op == "all_reduce" for n in local.nodes) == 6
    for n in moes:
        assert n.inputs[3].name.endswith(".partial")


def test_pipeline_stages_cover_the_step_once(tiny_checkpoint):
    _, graph = graph_of(tiny_checkpoint("gemma3"))  # 4 layers
    stages = [pipeline.stage(graph, a, b) for a, b in ((0, 1), (1, 3), (3, 4))]
    assert sum(len(s.nodes) for s in stages) == len(graph.nodes)
    assert [sorted(s.state) for s in stages] == [["k0", "v0"], ["k1", "k2", "v1", "v2"], ["k3", "v3"]]
    assert "tokens" in stages[0].inputs and "tokens" not in stages[1].inputs
    assert stages[1].inputs.keys() - graph.inputs.keys() == set(stages[0].outputs)
    assert stages[-1].outputs == graph.outputs
