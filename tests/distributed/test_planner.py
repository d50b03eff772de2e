"""capacity.Planner on given device memories, against byte counts worked out from the model's config."""

from __future__ import annotations

import pytest

from poot_core import ModelHandle
from poot_core.distributed import Placement, Planner, Target
from poot_core.errors import Reason, Unsupported

CTX = 64


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama"))
    c = handle.config().params  # 3 layers; float32 weights; the head is the embedding (tied)
    layer = 4 * (c.hidden * c.head_dim * (2 * c.heads + 2 * c.kv_heads) + 3 * c.hidden * c.intermediate
                 + 2 * c.hidden)
    kv = 4 * 2 * c.kv_heads * c.head_dim * CTX
    embed = 4 * handle.config().vocab_size * c.hidden
    return handle, {"layer": layer + kv, "weights": layer, "kv": kv, "embed": embed, "norm": 4 * c.hidden}


def plan(handle, frees, placement=Placement.PIPELINE, split=None):
    targets = [Target(f"dev{i}", f) for i, f in enumerate(frees)]
    return Planner(handle, targets, placement, context=CTX, split=split).plan()


def test_pipeline_fits_each_device(llama):
    handle, b = llama
    first2 = b["embed"] + 2 * b["layer"]
    last1 = b["layer"] + b["norm"] + b["embed"]
    # the second device holds one layer and the head only: the plan gives the first two layers to the first
    p = plan(handle, [first2 + 10, last1 + 10])
    assert p.layers == [(0, 2), (2, 3)] and p.need == [first2, last1]
    p = plan(handle, [10**9, 10**9], split=[1, 2])  # --tensor-split 1,2: a third of the layers, then the rest
    assert p.layers == [(0, 1), (1, 3)] and p.need[0] == b["embed"] + b["layer"]


def test_pipeline_refuses_naming_the_device_and_the_bytes(llama):
    handle, b = llama
    last1 = b["layer"] + b["norm"] + b["embed"]
    with pytest.raises(Unsupported) as err:
        plan(handle, [10**9, last1 - 1])
    e = err.value
    assert e.reason is Reason.CAPACITY and e.name == "dev1"
    assert f"needs {last1} bytes" in e.detail and f"KV/state {b['kv']} bytes" in e.detail
    assert f"has {last1 - 1} bytes" in e.detail
    with pytest.raises(Unsupported, match="some device gets none"):
        plan(handle, [10**9, 10**9], split=[10, 1])
    with pytest.raises(Unsupported, match="a pipeline of 4 stages"):
        plan(handle, [10**9] * 4)


def test_tensor_parallel_halves_the_layers(llama):
    handle, b = llama
    # per rank: the whole embedding and norms, half of every layer's weights and KV, half of the head's rows
    c = handle.config().params
    half = 3 * (b["weights"] - 4 * 2 * c.hidden) // 2 + 3 * 4 * 2 * c.hidden + 3 * b["kv"] // 2
    need = half + b["embed"] + b["embed"] // 2 + b["norm"]
    p = plan(handle, [need, need], Placement.TENSOR)
    assert p.need == [need, need]
    with pytest.raises(Unsupported) as err:
        plan(handle, [need, need - 1], Placement.TENSOR)
    assert err.value.reason is Reason.CAPACITY and err.value.name == "dev1"
    with pytest.raises(Unsupported, match="uneven split is a pipeline's"):
        plan(handle, [need, need], Placement.TENSOR, split=[3, 1])
