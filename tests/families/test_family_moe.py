"""The mixture-of-experts family against transformers' float32 forward on tiny random checkpoints (Hugging Face
and GGUF written with llama.cpp's names), the latent attention cache size, and routing that skips experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf

from helpers import tiny
from helpers.moe import EXPERTS, GGUF_ARCHS, write_gguf
from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor
from poot_core.cpu import moe as cpu_moe

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(40)]  # longer than prefill_chunk (16) and mixtral's window (8)

def _driver(path: Path) -> Driver:
    return Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(moe_checkpoint, arch, dtype, bound):
    path = moe_checkpoint(arch, dtype)
    ours = _driver(path).logits(PROMPT)
    ref = tiny.reference_logits(path, PROMPT)
    assert ours.shape == tuple(ref.shape)
    assert tiny.rel_error(ours, ref) <= bound


def test_deepseek_v3_with_yarn_rope_matches_transformers(moe_checkpoint):
    """float32 only: in bf16 a near-tie between two experts' router scores can flip one token's choice."""
    path = moe_checkpoint("deepseek_v3_yarn", torch.float32)
    assert tiny.rel_error(_driver(path).logits(PROMPT), tiny.reference_logits(path, PROMPT)) <= 1e-4


def _reference_greedy(path: Path, n: int) -> list[int]:
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(
        torch.tensor([PROMPT[:20]]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, 20:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(moe_checkpoint, arch):
    path = moe_checkpoint(arch)
    ours = _driver(path).serve().generate(GenerateRequest(PROMPT[:20], max_new=12, ignore_eos=True)).tokens
    assert ours == _reference_greedy(path, 12)


def test_routing_runs_only_chosen_experts(moe_checkpoint, monkeypatch):
    """Over the prompt every expert of every sparse layer gets tokens; a decode step runs top_k of them."""
    calls: list[set[int]] = []
    real = cpu_moe.run_experts

    def spy(x, ids, weights, experts, act):
        calls.append(set(ids.reshape(-1).tolist()))
        return real(x, ids, weights, experts, act)

    monkeypatch.setattr(cpu_moe, "run_experts", spy)
    driver = _driver(moe_checkpoint("mixtral")).serve()
    driver.generate(GenerateRequest(PROMPT, max_new=3, ignore_eos=True))
    layers = 3
    prefill, decode = calls[: layers * 3], calls[layers * 3 :]  # 40 prompt tokens: 3 chunks of 16
    for layer in range(layers):
        assert set().union(*prefill[layer::layers]) == set(range(EXPERTS))
    assert decode and all(len(hit) == 2 for hit in decode)


def test_latent_cache_holds_latent_and_rope_key_only(moe_checkpoint):
    path = moe_checkpoint("deepseek_v3")
    config = json.loads((path / "config.json").read_text())
    driver = _driver(path)
    driver.logits(PROMPT[:8])
    state = driver._state[1]
    per_token = config["kv_lora_rank"] + config["qk_rope_head_dim"]  # 32 + 8
    layers, capacity = config["num_hidden_layers"], driver.options.capacity
    assert sorted(state) == [f"latent{i}" for i in range(layers)]
    assert all(tuple(buf.shape) == (1, 1, capacity, per_token) for buf in state.values())
    total = sum(buf.numel() for buf in state.values())
    expanded = (
        layers
        * capacity
        * config["num_attention_heads"]
        * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"])
    )
    print(f"latent cache: {total} values ({per_token} per token per layer); expanded K/V would be {expanded}")
    assert total == layers * capacity * per_token
    assert 4 * total <= expanded


def test_mtp_weights_are_kept_not_traced(moe_checkpoint):
    path = moe_checkpoint("deepseek_v3")
    handle = ModelHandle.load(path)
    mtp = [n for n in handle.store().names() if n.startswith("model.layers.3.")]
    assert "model.layers.3.eh_proj.weight" in mtp
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=32, prefill_chunk=16))
    graph_weights = set()
    driver.logits(PROMPT[:4])
    for prog in driver._programs.values():
        graph_weights |= set(prog.graph.weights)
    assert not graph_weights & set(mtp)


def test_absorbed_and_expanded_latent_attention_agree():
    """The packed-kv_b path (expanded K/V) and the dense path (absorbed projections) compute one function."""
    from poot_core.checkpoint.layouts import PackedWeight
    from poot_core.cpu import mla, ops

    g = torch.Generator().manual_seed(0)
    heads, dn, dr, dv, latent, tokens = 3, 8, 4, 6, 32, 5
    q = torch.randn(1, tokens, heads, dn + dr, generator=g)
    kv = torch.randn(1, tokens, latent + dr, generator=g)
    kv_b = torch.randn(heads * (dn + dv), latent, generator=g)
    pos = torch.arange(tokens)[None]
    cos, sin = ops.rope_tables(pos, 10000.0, dr, {})
    a = {"nope_dim": dn, "rope_dim": dr, "v_dim": dv, "eps": 1e-6, "style": "interleaved", "scale": 0.3}
    import gguf

    blocks = gguf.quants.quantize(kv_b.numpy(), gguf.GGMLQuantizationType.Q8_0)
    packed_b = PackedWeight("gguf", tuple(kv_b.shape), {"blocks": torch.from_numpy(blocks)}, {"type": "Q8_0"})
    dense_b = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).copy())
    outs = [
        mla.mla_attention(q, kv, pos, torch.ones(latent), w, torch.zeros(1, 1, 8, latent + dr), cos, sin, a)
        for w in (dense_b, packed_b)
    ]
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-4)


# --- GGUF ------------------------------------------------------------------------------------------------------




@pytest.fixture(scope="module")
def gguf_checkpoint(moe_checkpoint, tmp_path_factory):
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_gguf(moe_checkpoint(arch), tmp_path_factory.mktemp(f"{arch}-gguf"), arch)
        return made[arch]

    return make


@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_gguf_logits_and_greedy_match_transformers(gguf_checkpoint, arch):
    path = gguf_checkpoint(arch)
    handle = ModelHandle.load(path)
    assert handle.config().source_format == "gguf" and handle.config().family == arch.removesuffix("_gguf")
    store = handle.store()
    stacked = store.get(next(n for n in store.names() if n.endswith("experts.gate_exps.weight")))
    assert stacked.kind == "gguf.Q8_0" and tuple(stacked.shape)[0] == EXPERTS
    driver = Driver(handle, open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))
    reference = path.parent / "hf"
    assert tiny.rel_error(driver.logits(PROMPT), tiny.reference_logits(reference, PROMPT)) <= 1e-4
    ours = driver.serve().generate(GenerateRequest(PROMPT[:20], max_new=12, ignore_eos=True)).tokens
    assert ours == _reference_greedy(reference, 12)
    if arch == "deepseek_v3":  # the next-token-prediction layer's tensors are kept
        assert "model.layers.3.nextn.eh_proj.weight" in store.names()
