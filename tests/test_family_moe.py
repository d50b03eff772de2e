"""The mixture-of-experts family against transformers' float32 forward on tiny random checkpoints (Hugging Face
and GGUF written with llama.cpp's names), the latent attention cache size, and routing that skips experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf

import tiny
from poot_core import Driver, DriverOptions, GenerateRequest, ModelHandle, open_executor
from poot_core.cpu import moe as cpu_moe

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
EXPERTS = 8
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(40)]  # longer than prefill_chunk (16) and mixtral's window (8)


def moe_config(arch: str) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    if arch in ("mixtral", "mixtral_gguf"):
        return tf.MixtralConfig(
            **common,
            intermediate_size=64,
            num_key_value_heads=2,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
            sliding_window=8 if arch == "mixtral" else None,  # llama.cpp's llama GGUF carries no window
        )
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            num_key_value_heads=2,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )
    latent = dict(
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    )
    if arch == "deepseek_v2":  # no q LoRA, grouped greedy routing
        return tf.DeepseekV2Config(
            **common, **latent, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5
        )
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common, **latent, q_lora_rank=48, routed_scaling_factor=2.5, num_nextn_predict_layers=1
        )
    if arch == "deepseek_v3_yarn":
        # YaRN rope as real V3 checkpoints ship it (it also scales the attention softmax by mscale squared).
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
        return tf.DeepseekV3Config(**common, **latent, q_lora_rank=48, routed_scaling_factor=2.5,
                                   rope_parameters=yarn)
    raise ValueError(arch)


def _add_mtp_layer(path: Path, config: Any) -> list[str]:
    """Real DeepSeek V3 checkpoints carry the next-token-prediction layer as model.layers.<layers>.*;
    transformers drops it, poot keeps it in the store."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    layer, d = config.num_hidden_layers, config.hidden_size
    g = torch.Generator().manual_seed(1)
    extra = {
        f"model.layers.{layer}.eh_proj.weight": torch.randn(d, 2 * d, generator=g),
        f"model.layers.{layer}.enorm.weight": torch.ones(d),
        f"model.layers.{layer}.hnorm.weight": torch.ones(d),
        f"model.layers.{layer}.shared_head.norm.weight": torch.ones(d),
    }
    dtype = tensors["model.norm.weight"].dtype
    tensors.update({k: v.to(dtype) for k, v in extra.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    return list(extra)


def build(path: Path, arch: str, dtype: torch.dtype, seed: int = 0) -> Path:
    config = moe_config(arch)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    tiny._randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: give the choice bias a real effect
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    model.to(dtype).save_pretrained(path)
    tiny.save_tokenizer(path)
    if arch == "deepseek_v3":
        _add_mtp_layer(path, config)
    return path


_BUILT: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    def make(arch: str, dtype: torch.dtype = torch.float32) -> Path:
        key = (arch, str(dtype))
        if key not in _BUILT:
            _BUILT[key] = build(tmp_path_factory.mktemp(f"{arch}-{str(dtype)[6:]}"), arch, dtype)
        return _BUILT[key]

    return make


def _driver(path: Path) -> Driver:
    return Driver(ModelHandle.load(path), open_executor("cpu"), DriverOptions(capacity=128, prefill_chunk=16))


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(checkpoint, arch, dtype, bound):
    path = checkpoint(arch, dtype)
    ours = _driver(path).logits(PROMPT)
    ref = tiny.reference_logits(path, PROMPT)
    assert ours.shape == tuple(ref.shape)
    assert tiny.rel_error(ours, ref) <= bound


def test_deepseek_v3_with_yarn_rope_matches_transformers(checkpoint):
    """float32 only: in bf16 a near-tie between two experts' router scores can flip one token's choice."""
    path = checkpoint("deepseek_v3_yarn", torch.float32)
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
def test_greedy_tokens_match_transformers(checkpoint, arch):
    path = checkpoint(arch)
    ours = _driver(path).serve().generate(GenerateRequest(PROMPT[:20], max_new=12, ignore_eos=True)).tokens
    assert ours == _reference_greedy(path, 12)


def test_routing_runs_only_chosen_experts(checkpoint, monkeypatch):
    """Over the prompt every expert of every sparse layer gets tokens; a decode step runs top_k of them."""
    calls: list[set[int]] = []
    real = cpu_moe.run_experts

    def spy(x, ids, weights, experts, act):
        calls.append(set(ids.reshape(-1).tolist()))
        return real(x, ids, weights, experts, act)

    monkeypatch.setattr(cpu_moe, "run_experts", spy)
    driver = _driver(checkpoint("mixtral")).serve()
    driver.generate(GenerateRequest(PROMPT, max_new=3, ignore_eos=True))
    layers = 3
    prefill, decode = calls[: layers * 3], calls[layers * 3 :]  # 40 prompt tokens: 3 chunks of 16
    for layer in range(layers):
        assert set().union(*prefill[layer::layers]) == set(range(EXPERTS))
    assert decode and all(len(hit) == 2 for hit in decode)


def test_latent_cache_holds_latent_and_rope_key_only(checkpoint):
    path = checkpoint("deepseek_v3")
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


def test_mtp_weights_are_kept_not_traced(checkpoint):
    path = checkpoint("deepseek_v3")
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
GGUF_ARCHS = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
              "mixtral_gguf": "llama"}
MIXTRAL_EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _gguf_metadata(w: Any, arch: str, hf: dict[str, Any]) -> None:
    a = GGUF_ARCHS[arch]
    w.add_uint32(f"{a}.block_count", hf["num_hidden_layers"])
    w.add_uint32(f"{a}.embedding_length", hf["hidden_size"])
    w.add_uint32(f"{a}.attention.head_count", hf["num_attention_heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", hf["num_key_value_heads"])
    w.add_uint32(f"{a}.feed_forward_length", hf["intermediate_size"])
    w.add_uint32(f"{a}.context_length", hf["max_position_embeddings"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hf["rms_norm_eps"])
    w.add_float32(f"{a}.rope.freq_base", hf.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_uint32(f"{a}.vocab_size", hf["vocab_size"])
    w.add_uint32(f"{a}.expert_count", EXPERTS)
    w.add_uint32(f"{a}.expert_used_count", hf["num_experts_per_tok"])
    w.add_uint32(f"{a}.expert_feed_forward_length", hf.get("moe_intermediate_size", hf["intermediate_size"]))
    if arch == "qwen2_moe":
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", hf["shared_expert_intermediate_size"])
    if arch == "qwen3_moe":
        w.add_uint32(f"{a}.attention.key_length", hf["head_dim"])
    if arch.startswith("deepseek"):
        w.add_uint32(f"{a}.attention.kv_lora_rank", hf["kv_lora_rank"])
        w.add_uint32(f"{a}.attention.q_lora_rank", hf["q_lora_rank"] or 0)
        w.add_uint32(f"{a}.attention.key_length", hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])
        w.add_uint32(f"{a}.attention.value_length", hf["v_head_dim"])
        w.add_uint32(f"{a}.rope.dimension_count", hf["qk_rope_head_dim"])
        w.add_uint32(f"{a}.leading_dense_block_count", hf["first_k_dense_replace"])
        w.add_uint32(f"{a}.expert_shared_count", hf["n_shared_experts"])
        w.add_float32(f"{a}.expert_weights_scale", hf["routed_scaling_factor"])
        w.add_uint32(f"{a}.expert_group_count", hf["n_group"])
        w.add_uint32(f"{a}.expert_group_used_count", hf["topk_group"])
        v3 = arch == "deepseek_v3"
        w.add_bool(f"{a}.expert_weights_norm", v3)
        w.add_uint32(f"{a}.expert_gating_func", 2 if v3 else 1)
        if v3:
            w.add_uint32(f"{a}.nextn_predict_layers", 1)


def _gguf_tokenizer(w: Any) -> None:
    """A byte-level BPE vocabulary in llama.cpp's gpt2 form. The tiny checkpoints' own tokenizer has no merges
    (its 200 entries are the byte alphabet), which GGUF cannot express, so a larger one is trained; the tests
    pass token ids, and the model's vocab_size (256) comes from the metadata."""
    data = json.loads(tiny.train_tokenizer(320).to_str())
    vocab = data["model"]["vocab"]
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    tokens = [""] * (max([*vocab.values(), *added.values()]) + 1)
    for text, i in {**vocab, **added}.items():
        tokens[i] = text
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    merges = data["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(added["<|bos|>"])
    w.add_eos_token_id(added["<|eos|>"])


def write_gguf(src: Path, dst: Path, arch: str) -> Path:
    """A GGUF file of the checkpoint at `src` with llama.cpp's names, experts stacked [E, F, D] and stored
    as Q8_0 (kv_b too); `dst` also receives a Hugging Face copy holding exactly the dequantized values."""
    import gguf
    from safetensors.torch import load_file, save_file

    hf = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    q8 = gguf.GGMLQuantizationType.Q8_0

    def round_trip(t: torch.Tensor) -> np.ndarray:
        return gguf.quants.quantize(t.numpy(), q8)

    out: dict[str, tuple[np.ndarray, bool]] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and ".experts." in name:
            parts = name.split(".")  # model.layers.L.mlp.experts.E.gate_proj.weight
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = t
            continue
        if name.endswith("kv_b_proj.weight"):
            blocks = round_trip(t)
            tensors[name] = torch.from_numpy(gguf.quants.dequantize(blocks, q8).copy())
            gname = f"blk.{name.split('.')[2]}.attn_kv_b.weight"
            out[gname] = (blocks, True)
            continue
        stem, _, kind = name.rpartition(".")
        if GGUF_ARCHS[arch] == "llama" and stem.endswith(("q_proj", "k_proj")):
            # llama.cpp's converter permutes q/k rows of llama models for its interleaved rope layout
            heads = hf["num_attention_heads"] if stem.endswith("q_proj") else hf["num_key_value_heads"]
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        if stem.startswith("model.layers."):
            layer, rest = stem.split(".", 3)[2:]
            if int(layer) >= hf["num_hidden_layers"]:  # DeepSeek V3's next-token-prediction layer
                gname = f"blk.{layer}.nextn.{rest.replace('shared_head.norm', 'shared_head_norm')}"
            elif kind == "e_score_correction_bias":
                gname, kind = f"blk.{layer}.exp_probs_b", "bias"
            else:
                gname = f"blk.{layer}.{HF_TO_GGUF[rest]}"
        else:
            gname = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[stem]
        out[f"{gname}.{kind}"] = (t.numpy(), False)
    for (layer, proj), per in experts.items():
        stacked = torch.stack([per[e] for e in range(EXPERTS)])  # [E, out, in]
        blocks = round_trip(stacked)
        deq = torch.from_numpy(gguf.quants.dequantize(blocks, q8).copy())
        moe = "block_sparse_moe" if proj in MIXTRAL_EXPERT_NAMES else "mlp"
        for e in range(EXPERTS):
            tensors[f"model.layers.{layer}.{moe}.experts.{e}.{proj}.weight"] = deq[e].clone()
        short = MIXTRAL_EXPERT_NAMES.get(proj, proj.removesuffix("_proj"))
        out[f"blk.{layer}.ffn_{short}_exps.weight"] = (blocks, True)
    reference = dst / "hf"
    reference.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (reference / f.name).write_bytes(f.read_bytes())
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    path = dst / f"{arch}.gguf"
    w = gguf.GGUFWriter(path, GGUF_ARCHS[arch])
    _gguf_metadata(w, arch, hf)
    _gguf_tokenizer(w)
    for gname, (array, quantized) in out.items():
        w.add_tensor(gname, array, raw_dtype=q8 if quantized else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_checkpoint(checkpoint, tmp_path_factory):
    made: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_gguf(checkpoint(arch), tmp_path_factory.mktemp(f"{arch}-gguf"), arch)
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
