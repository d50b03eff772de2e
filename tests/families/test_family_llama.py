"""The llama family against transformers' float32 forward on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers import tiny
from poot_core import (
    CheckpointError,
    Driver,
    DriverOptions,
    GenerateRequest,
    ModelHandle,
    Registry,
    StepShape,
    open_executor,
)

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# Longer than prefill_chunk (16) and than the sliding windows (8) of mistral and gemma3.
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(40)]


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_checkpoint, arch, dtype, bound):
    path = tiny_checkpoint(arch, dtype)
    handle = ModelHandle.load(path)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))
    ours = driver.logits(PROMPT)
    ref = tiny.reference_logits(path, PROMPT)
    assert ours.shape == tuple(ref.shape)
    assert tiny.rel_error(ours, ref) <= bound


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, torch.float32)
    handle = ModelHandle.load(path)
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16)).serve()
    result = driver.generate(GenerateRequest(PROMPT[:20], max_new=12, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([PROMPT[:20]]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0, min_new_tokens=12)
    assert result.tokens == out[0, 20:].tolist()


def test_weights_stay_bf16(tiny_checkpoint):
    """A bf16 checkpoint stays bf16 in the store and on the CPU executor: no float32 copy of a weight."""
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.bfloat16))
    store = handle.store()
    weights = open_executor("cpu").upload(store)
    matrices = [n for n in store.names() if store.get(n).dim() == 2]
    assert matrices
    for name in store.names():
        assert store.get(name).dtype == torch.bfloat16, name
        assert weights[name].dtype == torch.bfloat16, name
        assert weights[name].data_ptr() == store.get(name).data_ptr(), name


def test_rope_style_matters(tiny_checkpoint):
    """The comparison above can fail: the wrong rope layout gives clearly different logits."""
    path = tiny_checkpoint("llama", torch.float32)
    handle = ModelHandle.load(path)
    handle.config().params.rope_style = "interleaved"
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=16))
    assert tiny.rel_error(driver.logits(PROMPT), tiny.reference_logits(path, PROMPT)) > 1e-2


def test_back_to_back_weights_are_joined_without_copies(tiny_checkpoint, monkeypatch):
    """gate/up (and q/v) stored back to back become one product over a view of the same memory; the logits
    are those of separate products."""
    from poot_core.cpu import fusion

    path = tiny_checkpoint("qwen3", torch.bfloat16)
    handle = ModelHandle.load(path)
    weights = open_executor("cpu").upload(handle.store())
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=16))
    graph_nodes = driver.program(StepShape(1, 1, 64)).graph.nodes
    groups = fusion.adjacent_groups(graph_nodes, weights)
    joined = {graph_nodes[i].inputs[1].name for g in groups for i in g}
    assert any("gate_proj" in n for n in joined) and any("up_proj" in n for n in joined)
    fused = driver.logits(PROMPT)
    monkeypatch.setattr(fusion, "adjacent_groups", lambda nodes, weights: [])
    plain = Driver(handle, open_executor("cpu"), DriverOptions(capacity=64, prefill_chunk=16)).logits(PROMPT)
    assert abs(fused - plain).max() <= 1e-6 * abs(plain).max()


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size"])
@pytest.mark.parametrize("spelling", ["absent", "null"])
def test_a_missing_config_key_is_refused_by_name(key, spelling):
    """A key the family needs, absent from config.json or null there, is a CheckpointError naming it (not a
    TypeError from int(None) further on)."""
    hf = tiny.tiny_config("llama").to_dict()
    if spelling == "absent":
        del hf[key]
    else:
        hf[key] = None
    family = Registry.builtin().resolve("LlamaForCausalLM", "llama")
    with pytest.raises(CheckpointError, match=f"missing key '{key}'"):
        family.config_from_hf(hf)
