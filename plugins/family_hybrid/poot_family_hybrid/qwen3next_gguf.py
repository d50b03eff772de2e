"""Qwen3-Next from the GGUF files llama.cpp's converter writes (`qwen3next`): its keys read as llama.cpp reads them,
its tensor names mapped to the Hugging Face names qwen3next.py traces.

The converter stores in_proj_qkvz as attn_qkv and attn_gate (the rows the step reads), A as -exp(A_log) (ssm_a,
from which A_log is derived), the (1 + w) norms as 1 + w, and experts stacked. Multi-token-prediction blocks
(nextn_predict_layers, after the model's own) are not read.
"""

from __future__ import annotations

from poot_core import (
    CheckpointError,
    DerivedWeight,
    GGUFKeys,
    GGUFTensors,
    ModelConfig,
    Reason,
    Unsupported,
    rope_from_gguf,
)
from poot_family_hybrid.gguf import BLOCK_NAME, a_log_weights, table_name
from poot_family_hybrid.qwen3next import Qwen3NextParams

BLOCK = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{n}.weight": f"self_attn.{n}_proj.weight" for n in "qkv"},
    "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": None, "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{n}_exps.weight": f"mlp.experts.{n}_exps.weight" for n in ("gate", "up", "down")},
    **{f"ffn_{n}_shexp.weight": f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")},
    **{f"ffn_{n}.weight": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}


def qwen3next_tensor_name(config: ModelConfig, name: str) -> str | None:
    p: Qwen3NextParams = config.params
    match = BLOCK_NAME.match(name)
    if match and int(match.group(1)) >= p.layers:  # a multi-token-prediction block
        return None
    return table_name(name, TOP, BLOCK, "qwen3next", "model.layers")


def qwen3next_gguf_derived(config: ModelConfig, tensors: GGUFTensors) -> dict[str, DerivedWeight]:
    p: Qwen3NextParams = config.params
    linear = [i for i, kind in enumerate(p.layer_types) if kind == "linear_attention"]
    return a_log_weights(tensors, linear, "model.layers.{}.linear_attn.A_log", p.v_heads)


def qwen3next_params_from_gguf(keys: GGUFKeys, tensors: GGUFTensors) -> Qwen3NextParams:
    """ssm.group_count is the key heads, ssm.time_step_rank the value heads, ssm.state_size a key head's width,
    ssm.inner_size all value heads' width; attention.recurrent_layers the layout. llama.cpp renormalizes the
    chosen experts' weights (expert_weights_norm, when written, says so too)."""
    mtp = int(keys("nextn_predict_layers", 0))
    layers = int(keys("block_count")) - mtp
    hidden, heads = int(keys("embedding_length")), int(keys("attention.head_count"))
    recurrent = list(keys.raw("attention.recurrent_layers"))[:layers]
    if len(recurrent) != layers:
        raise CheckpointError(str(tensors.path), f"{keys.key('attention.recurrent_layers')} has {len(recurrent)} "
                                                 f"entries for {layers} layers")
    keys.understood("full_attention_interval")  # recurrent_layers says the layout
    head_dim = int(keys("attention.key_length", hidden // heads))
    if int(keys("attention.value_length", head_dim)) != head_dim:
        raise Unsupported(Reason.SHAPE, f"{keys.key('attention.value_length')} != key_length",
                          "Qwen3-Next's attention heads have one width")
    theta, scaling = rope_from_gguf(keys, tensors)
    k_heads, v_heads = int(keys("ssm.group_count")), int(keys("ssm.time_step_rank"))
    experts = int(keys("expert_count", 0))
    # the weights say the widths of the experts, the shared expert and a dense MLP
    keys.understood("feed_forward_length", "expert_feed_forward_length", "expert_shared_feed_forward_length")
    names = set(tensors.names())
    return Qwen3NextParams(
        layers=layers, hidden=hidden, heads=heads, kv_heads=int(keys("attention.head_count_kv", heads)),
        head_dim=head_dim, rotary_dim=int(keys("rope.dimension_count", head_dim // 4)), theta=theta,
        scaling=scaling, norm_eps=float(keys("attention.layer_norm_rms_epsilon", 1e-6)),
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent], k_heads=k_heads,
        v_heads=v_heads, k_dim=int(keys("ssm.state_size")), v_dim=int(keys("ssm.inner_size")) // v_heads,
        conv_kernel=int(keys("ssm.conv_kernel")),
        moe_layers=[f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)], experts=experts,
        top_k=int(keys("expert_used_count")) if experts else 0, norm_topk=bool(keys("expert_weights_norm", True)),
        norm_offset=0.0)
