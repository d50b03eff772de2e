"""MoE decode on the GPU: a Qwen3-30B-A3B-shaped model beside a dense model with the same active parameters.

Both are random bf16 checkpoints built on the device (attention, router and norms random; each expert filled
with one small value, which costs the same to read as random values and takes a memset to make). Decode cost
should follow the active parameters (attention, router, the 8 chosen experts of 128, the output head), not
the total. Prints, for each model: decode tok/s (prompt 128, greedy on the device, decode steps replayed from
CUDA graphs), the bytes a step reads, achieved GB/s and the floor from the measured copy bandwidth; and the MoE
model's prefill tok/s at 2048 tokens. No transformers peer here: its Qwen3-MoE forward loops over the experts
in Python and a second 61 GB copy does not fit beside ours; the peer comparison is gpu_decode.py's, on the
dense 8B shape.

    python bench/gpu_moe.py --out results.json [--layers 48] [--new 128]
    python bench/gpu_moe.py --smoke          # tiny shapes on the CPU executor: checks the script, measures nothing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# every layer is an MoE layer; the config still reads intermediate_size
QWEN3_30B_A3B = common.hf_config("qwen3_30b_a3b")
SMOKE = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2)


log = common.log


def dense_twin(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3 dense with the MoE model's attention and an MLP as wide as its chosen experts together."""
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    return {**{k: hf[k] for k in keep}, "intermediate_size": hf["moe_intermediate_size"] * hf["num_experts_per_tok"],
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


def shapes(hf: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Weight shapes by Hugging Face name, and the names of the expert matrices."""
    d, v, hd = hf["hidden_size"], hf["vocab_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
                                       "lm_head.weight": (v, d)}
    experts: set[str] = set()
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if "num_experts" in hf:
            f = hf["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (hf["num_experts"], d)
            for e in range(hf["num_experts"]):
                names = {f"{p}mlp.experts.{e}.{n}.weight": s for n, s in
                         (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f)))}
                out.update(names)
                experts.update(names)
        else:
            f = hf["intermediate_size"]
            out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                        p + "mlp.down_proj.weight": (d, f)})
    return out, experts


class RandomStore(common.DeviceStore):
    """Random bf16 weights made on `device` (the experts constant, so every expert costs the same)."""

    def __init__(self, hf: dict[str, Any], device: str, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        named, experts = shapes(hf)
        for name, shape in named.items():
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            if len(shape) == 1:
                t.fill_(1.0)
            elif name in experts:
                t.fill_(0.01)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            self.w[name] = t


def active_bytes(hf: dict[str, Any]) -> int:
    """Weight bytes one decode step reads: everything but the embedding table and the experts not chosen."""
    named, experts = shapes(hf)
    total = sum(int(np.prod(s)) * 2 for n, s in named.items() if n not in experts and "embed_tokens" not in n)
    if experts:
        per_expert = 3 * hf["moe_intermediate_size"] * hf["hidden_size"] * 2
        total += hf["num_hidden_layers"] * hf["num_experts_per_tok"] * per_expert
    return total


def run_model(hf: dict[str, Any], executor: Any, device: str, prompt: int, new: int, prefill: int,
              bandwidth: float | None) -> dict[str, Any]:
    from poot_core import Registry

    family = Registry.builtin().resolve(hf["architectures"][0], hf["model_type"])
    config = family.config_from_hf(hf)
    t0 = time.perf_counter()
    store = RandomStore(hf, device)
    shapes = store.shapes()
    weights = executor.upload(store)
    del store
    made_s = time.perf_counter() - t0
    program = common.step_programs(family, config, executor, weights, shapes, max(prompt + new, prefill))
    pre, graph = program(prompt)
    dec, _ = program(1)
    state = executor.allocate_state(graph)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf["vocab_size"], prompt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def generate() -> tuple[float, list[int]]:
        _, decode_s, tokens = common.greedy_generate(executor, pre, dec, state, ids, new, sync)
        return decode_s, tokens

    generate()  # compiles kernels, captures the decode graph
    runs = [generate() for _ in range(2)]
    decode_s = statistics.median(r[0] for r in runs)
    step_bytes = active_bytes(hf) + 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * hf["head_dim"] * 2 * (
        prompt + new // 2)  # keys and values read, at the mean position
    result: dict[str, Any] = {
        "model": hf["model_type"],
        "layers": hf["num_hidden_layers"],
        "weights_made_s": made_s,
        "graph_replayed": bool(getattr(dec, "use_graph", False)),
        "decode_tok_s": (new - 1) / decode_s,
        "step_bytes": step_bytes,
        "tokens_deterministic": runs[0][1] == runs[1][1],
    }
    result["achieved_GBps"] = step_bytes * result["decode_tok_s"] / 1e9
    if bandwidth:
        result["floor_tok_s"] = bandwidth * 1e9 / step_bytes
        result["fraction_of_floor"] = result["decode_tok_s"] / result["floor_tok_s"]
    if prefill:
        big, _ = program(prefill)
        inputs = {"tokens": rng.integers(0, hf["vocab_size"], prefill)[None, :],
                  "positions": np.arange(prefill)[None, :]}
        big.run(state, inputs)
        sync()
        t1 = time.perf_counter()
        for _ in range(3):
            big.run(state, inputs)
        sync()
        result["prefill_tokens"] = prefill
        result["prefill_tok_s"] = 3 * prefill / (time.perf_counter() - t1)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU executor")
    args = ap.parse_args()
    out: dict[str, Any] = {"prompt": args.prompt, "new_tokens": args.new}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)

    if args.smoke:
        from poot_core import open_executor

        hf, device, bandwidth = dict(SMOKE), "cpu", None
        make_executor = lambda: open_executor("cpu")  # noqa: E731
        args.prefill = min(args.prefill, 64)
    else:
        from gpu_decode import copy_bandwidth

        from poot_backend_cuda.executor import CudaExecutor

        hf, device = {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}, "cuda"
        bandwidth = copy_bandwidth()
        make_executor = CudaExecutor
        out["device"] = torch.cuda.get_device_name()
        out["copy_GBps"] = bandwidth
        log(f"device {out['device']}, copy {bandwidth:.0f} GB/s, Qwen3-30B-A3B shape with {args.layers} layers")
    out["runs"] = []
    for model in (hf, dense_twin(hf)):
        try:
            r = run_model(model, make_executor(), device, args.prompt, args.new,
                          args.prefill if model is hf else 0, bandwidth)
        except Exception as exc:  # report and go on to the next model
            r = {"model": model["model_type"], "error": f"{type(exc).__name__}: {exc}"[:2000]}
        out["runs"].append(r)
        log(json.dumps(r))
        save()
        if device == "cuda":
            torch.cuda.empty_cache()
    moe, dense = out["runs"]
    if "error" not in moe and "error" not in dense:
        out["moe_over_dense_time"] = dense["decode_tok_s"] / moe["decode_tok_s"]
        out["moe_over_dense_bytes"] = moe["step_bytes"] / dense["step_bytes"]
        log(f"MoE step time / dense step time {out['moe_over_dense_time']:.2f}, "
            f"active bytes ratio {out['moe_over_dense_bytes']:.2f}")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
