"""Host side of a Vulkan decode step, on any Vulkan adapter (lavapipe included: its device time means nothing,
but the host's work and the dispatch count are real): dispatches per step (by kernel), the host time to encode
one step's command buffer, and the host time of one decode step's run() (inputs and uniforms written, the
recorded step submitted, the next one encoded), for a SmolLM2-135M shape (bf16, 30 layers) and a
Llama-3.2-1B shape (bf16 and Q4_K layers, fewer layers and a smaller vocabulary by default: the count a layer
and the encode time a dispatch do not depend on them). Random weights; no token is checked.

    python bench/vulkan_host.py [--models smollm2,llama1b,llama1b_q4k] [--layers N] [--out results.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vulkan_decode  # noqa: E402
from gpu_decode import llama_shapes  # noqa: E402

import common  # noqa: E402

LLAMA_1B = {**vulkan_decode.HF_LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 8, "vocab_size": 32000}
MODELS = {"smollm2": (vulkan_decode.SMOLLM2_135M, "bfloat16"), "llama1b": (LLAMA_1B, "bfloat16"),
          "llama1b_q4k": (LLAMA_1B, "gguf.Q4_K")}


def host_profile(hf: dict[str, Any], kind: str, capacity: int = 96, steps: int = 12) -> dict[str, Any]:
    from poot_core import open_executor
    from poot_family_llama.plugin import DenseDecoder

    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    ex = open_executor("vulkan")
    store = vulkan_decode.RandomStore(llama_shapes(hf), kind)
    weights = ex.upload(store)
    dec, graph = common.step_programs(family, config, ex, weights, store.shapes(), capacity)(1)
    state = ex.allocate_state(graph)
    slots = {name: array.buffer for name, array in state.items()}
    dec.step.command_buffer(slots)  # binds
    encode = []
    for _ in range(20):
        t0 = time.perf_counter()
        dec.step.command_buffer(slots)
        encode.append(time.perf_counter() - t0)
    runs, token = [], 0
    for position in range(steps):
        t0 = time.perf_counter()
        out = dec.run(state, {"tokens": np.array([[token]]), "positions": np.array([[position]])})[0]
        runs.append(time.perf_counter() - t0)
        token = ex.greedy_token(out)  # waits for the device: the next run() starts on an idle device
    kinds = collections.Counter(str(pipeline.label) for pipeline, _, _ in dec.step.bind(slots))
    vulkan_decode.destroy_buffers(ex.runtime, weights, state)
    layers = hf["num_hidden_layers"]
    return {"layers": layers, "dispatches_per_step": dec.step.dispatch_count,
            "dispatches_per_layer": dec.step.dispatch_count / layers, "by_kernel": dict(kinds),
            "host_encode_ms": 1e3 * statistics.median(encode), "host_run_ms": 1e3 * statistics.median(runs[2:]),
            "encode_us_per_dispatch": 1e6 * statistics.median(encode) / dec.step.dispatch_count,
            "adapter": ex.runtime.adapter.info.get("device", "?")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", type=int, default=None, help="layers of every model (default: each its own)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    payload: dict[str, Any] = {"models": {}}
    for key in args.models.split(","):
        hf, kind = MODELS[key]
        hf = {**hf, **({"num_hidden_layers": args.layers} if args.layers else {})}
        r = payload["models"][key] = host_profile(hf, kind)
        common.log(f"{key:12s} {r['layers']:2d} layers: {r['dispatches_per_step']} dispatches a step "
                   f"({r['dispatches_per_layer']:.1f} a layer), encode {r['host_encode_ms']:.2f} ms "
                   f"({r['encode_us_per_dispatch']:.1f} us a dispatch), run() {r['host_run_ms']:.2f} ms "
                   f"[{r['adapter']}]")
        common.log(f"{'':16s}{', '.join(f'{k} {v}' for k, v in r['by_kernel'].items())}")
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1))
    else:
        common.log(f"wrote {common.write('vulkan_host', payload)}")


if __name__ == "__main__":
    main()
