"""A speculative verify step against a decode step on the GPU, Llama-3-8B shape, bf16 random weights: the step of
k + 1 tokens that checks k drafted tokens (logits at every position) beside the one-token decode step, both as
the Driver runs them (CUDA-graph replays, the step's inputs copied in, the logits read back), at several
contexts.

    python bench/gpu_verify.py [--widths 5,9] [--contexts 768,4096]

Prints ms per step and the ratio (target for width 9, a k=8 draft: <= 1.3x); writes bench/results/gpu_verify.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_decode  # noqa: E402

import common  # noqa: E402


def step_ms(prog, state, tokens: int, context: int, reps: int = 30) -> float:
    inputs = {"tokens": np.ones((1, tokens), dtype=np.int64),
              "positions": np.arange(context, context + tokens, dtype=np.int64)[None, :]}
    # three warm-up runs: eager, then the capture, then a replay
    return common.synced_ms(lambda: prog.run(state, inputs), reps=reps, warmup=3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="5,9")
    ap.add_argument("--contexts", default="768,4096")
    args = ap.parse_args()
    from poot_backend_cuda.executor import CudaExecutor
    from poot_core import StepShape, Tracer
    from poot_family_llama.plugin import DenseDecoder

    hf = gpu_decode.HF_LLAMA3_8B
    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    ex = CudaExecutor()
    weights = ex.upload(gpu_decode.GpuStore(gpu_decode.llama_shapes(hf), "bfloat16"))
    contexts = [int(c) for c in args.contexts.split(",")]
    capacity = max(contexts) + 32
    shapes = {n: tuple(w.shape) for n, w in weights.tensors.items()}

    def program(tokens: int, all_logits: bool):
        shape = StepShape(1, tokens, capacity, all_logits=all_logits)
        tracer = Tracer(shape, shapes)
        family.trace(config, tracer, shape)
        return ex.prepare(tracer.graph, weights), tracer.graph

    decode, graph = program(1, False)
    state = ex.allocate_state(graph)
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for context in contexts:
        base = step_ms(decode, state, 1, context)
        for width in (int(w) for w in args.widths.split(",")):
            verify, _ = program(width, True)
            ms = step_ms(verify, state, width, context)
            row = {"context": context, "width": width, "decode_ms": base, "verify_ms": ms, "ratio": ms / base,
                   "verify_replayed": verify.use_graph}
            out["rows"].append(row)
            common.log(f"context {context}: decode {base:.2f} ms, verify of {width} tokens {ms:.2f} ms "
                       f"({ms / base:.2f}x{'; target <= 1.3x' if width == 9 else ''})")
    print("wrote", common.write("gpu_verify", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
