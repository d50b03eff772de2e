"""Tiny random mixture-of-experts checkpoints (Hugging Face) and their GGUF form with llama.cpp's names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf

from helpers import tiny
from helpers.gguf_edit import finish_gguf

EXPERTS = 8


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


def add_nextn_layer(path: Path, donor_dir: Path) -> Any:
    """Give the tiny V3 checkpoint at `path` a whole nextn layer, model.layers.<layers>.*: the decoder layer of
    a random model one layer deeper (saved by transformers, so its names are the checkpoint's), random norms
    and a head of its own. Returns that deeper model, whose last layer is the reference's decoder layer."""
    from safetensors.torch import load_file, save_file

    config = moe_config("deepseek_v3")
    layers, d = config.num_hidden_layers, config.hidden_size
    deeper = moe_config("deepseek_v3")
    deeper.num_hidden_layers = layers + 1
    torch.manual_seed(5)
    donor = tf.AutoModelForCausalLM.from_config(deeper)
    tiny._randomize(donor, 5)
    donor.save_pretrained(donor_dir)
    pre = f"model.layers.{layers}."
    extra = {k: v for k, v in load_file(donor_dir / "model.safetensors").items() if k.startswith(pre)}
    g = torch.Generator().manual_seed(7)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{pre}{name}.weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    extra[f"{pre}eh_proj.weight"] = torch.randn(d, 2 * d, generator=g) * (0.5 / (2 * d) ** 0.5)
    extra[f"{pre}shared_head.head.weight"] = torch.randn(config.vocab_size, d, generator=g) * (0.5 / d**0.5)
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})
    donor.eval()
    return donor


def build(path: Path, arch: str, dtype: torch.dtype, seed: int = 0, layers: int | None = None) -> Path:
    """`layers`: fewer decoder layers than the config's 3; 2 still hold one dense and one MoE layer in every
    family but mixtral (all MoE)."""
    config = tiny.with_layers(moe_config(arch), layers)
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


def gguf_tokenizer(w: Any) -> None:
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
    gguf_tokenizer(w)
    for gname, (array, quantized) in out.items():
        w.add_tensor(gname, array, raw_dtype=q8 if quantized else None)
    finish_gguf(w)
    return path
