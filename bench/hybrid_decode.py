"""Decode ms per token of a Granite-4.0-H-shaped hybrid (Mamba2 layers beside a few attention layers) at several
context lengths, beside two models cut from the same shape: its Mamba2 layers alone (their share of the step;
with the embedding and the output head, which do not grow with the context either) and a pure-attention model
of the same depth and width (the peer whose cost grows with the context).

Weights are random, made directly on the executor's device in the layout transformers saves (bf16 on a GPU,
float32 on the CPU); each variant's one-token decode program runs at positions `context` over a state of that
capacity, as the Driver replays it (CUDA graphs on the GPU). Prints ms per token per context and the growth from
the first context to the last (target, issue 21: the Mamba2 layers' share at 16k <= 1.3x its time at 512);
writes bench/results/hybrid_decode.json.

    python bench/hybrid_decode.py                                   # cuda, Granite-4.0-H-Micro-like shape
    python bench/hybrid_decode.py --backend cpu --shape tiny --contexts 64,512 --reps 3   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# Granite-4.0-H-Micro-like (dense hybrid, ~3B): 40 layers of which 4 attention, Mamba2 heads of 64 with a state
# of 128 in one group, GQA 32/8 without rope; the tiny shape is for smoke runs.
SHAPES: dict[str, dict[str, Any]] = {
    "granite_h": dict(hidden_size=2560, num_hidden_layers=40, attention_layers=(9, 19, 29, 39),
                      num_attention_heads=40, num_key_value_heads=8, shared_intermediate_size=8192,
                      mamba_n_heads=80, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                      mamba_expand=2, mamba_chunk_size=256, vocab_size=100352),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, attention_layers=(1,), num_attention_heads=4,
                 num_key_value_heads=2, shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16,
                 mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                 vocab_size=320),
}
VARIANTS = ("hybrid", "mamba_layers", "attention")


def hf_config(shape: dict[str, Any], variant: str, capacity: int) -> Any:
    """The transformers config of one variant: the hybrid, its Mamba2 layers only, or all layers attention."""
    import transformers as tf

    fields = {k: v for k, v in shape.items() if k != "attention_layers"}
    layers = fields["num_hidden_layers"]
    types = ["attention" if i in shape["attention_layers"] else "mamba" for i in range(layers)]
    if variant == "mamba_layers":
        types = [t for t in types if t == "mamba"]
    elif variant == "attention":
        types = ["attention"] * layers
    fields.update(num_hidden_layers=len(types), layer_types=types, intermediate_size=fields["shared_intermediate_size"],
                  num_local_experts=0, position_embedding_type=None, tie_word_embeddings=False,
                  max_position_embeddings=capacity, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return tf.GraniteMoeHybridConfig(**fields)


class RandomStore(common.DeviceStore):
    """The checkpoint's tensors (names and shapes of transformers' model, built on the meta device), random on
    `device`: small normal values, the per-head A_log and dt_bias in the ranges Mamba2 initializes them to."""

    def __init__(self, config: Any, device: torch.device, dtype: torch.dtype) -> None:
        import transformers as tf

        super().__init__()
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
        g = torch.Generator(device=device).manual_seed(0)
        for name, p in model.state_dict().items():
            if name.endswith("A_log"):
                w = torch.rand(p.shape, generator=g, device=device) * 2.7  # A in [1, 16)
            elif name.endswith("dt_bias"):
                w = torch.rand(p.shape, generator=g, device=device) * 4 - 6
            elif name.endswith(("norm.weight", ".D")):
                w = torch.ones(p.shape, device=device)
            else:
                w = torch.randn(p.shape, generator=g, device=device) * 0.02
            self.w[name] = w.to(dtype)


def open_backend(name: str) -> tuple[Any, torch.device, torch.dtype, Any]:
    """The executor, its device, the weights' dtype and a timer of one call in ms."""
    if name == "cpu":
        from poot_core import open_executor

        def cpu_ms(fn: Any, reps: int) -> float:
            for _ in range(2):
                fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1000

        return open_executor("cpu"), torch.device("cpu"), torch.float32, cpu_ms
    from poot_backend_cuda.executor import CudaExecutor

    return CudaExecutor(), torch.device("cuda", 0), torch.bfloat16, lambda fn, reps: common.synced_ms(fn, reps=reps)


def decode_ms(executor: Any, device: torch.device, dtype: torch.dtype, timer: Any, config: Any,
              contexts: list[int], capacity: int, reps: int) -> dict[int, float]:
    """ms per one-token decode step of `config` at each context (the step at that position)."""
    from poot_core import Registry

    hf = {**config.to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"]}
    family = Registry.builtin().resolve("GraniteMoeHybridForCausalLM")
    model_config = family.config_from_hf(hf)
    weights = executor.upload(RandomStore(config, device, dtype))
    shapes = {n: tuple(w.shape) for n, w in weights.items()} if isinstance(weights, dict) else \
        {n: tuple(w.shape) for n, w in weights.tensors.items()}
    program = common.step_programs(family, model_config, executor, weights, shapes, capacity)
    decode, graph = program(1)
    state = executor.allocate_state(graph)
    out = {}
    for context in contexts:
        inputs = {"tokens": np.ones((1, 1), dtype=np.int64), "positions": np.array([[context]], dtype=np.int64)}
        out[context] = timer(lambda inputs=inputs: decode.run(state, inputs), reps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="granite_h", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="hybrid_decode", help="results name (bench/results/<name>.json)")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    capacity = max(contexts) + 16
    executor, device, dtype, timer = open_backend(args.backend)
    shape = SHAPES[args.shape]
    result: dict[str, Any] = {"backend": args.backend, "shape": args.shape, "shape_fields": shape,
                              "dtype": str(dtype), "contexts": contexts, "variants": {}}
    if device.type == "cuda":
        result["device"] = torch.cuda.get_device_name(device)
    for variant in args.variants.split(","):
        ms = decode_ms(executor, device, dtype, timer, hf_config(shape, variant, capacity), contexts, capacity,
                       args.reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the variant's weights and state are gone: give their memory back
        growth = ms[contexts[-1]] / ms[contexts[0]]
        result["variants"][variant] = {"ms_per_token": {str(c): v for c, v in ms.items()}, "growth": growth}
        common.log(f"{variant:>12}: " + ", ".join(f"{c}: {v:.3f} ms" for c, v in ms.items())
                   + f"; {contexts[-1]}/{contexts[0]}: {growth:.2f}x")
    variants = result["variants"]
    if "hybrid" in variants and "mamba_layers" in variants:
        share = {str(c): variants["mamba_layers"]["ms_per_token"][str(c)] / variants["hybrid"]["ms_per_token"][str(c)]
                 for c in contexts}
        result["mamba_share"] = share
        common.log("Mamba2 layers' share of the hybrid's step: " + ", ".join(f"{c}: {v:.0%}" for c, v in share.items())
                   + f"; their growth {variants['mamba_layers']['growth']:.2f}x (target <= 1.3x)")
    print("wrote", common.write(args.out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
