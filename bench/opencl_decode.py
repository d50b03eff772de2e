"""OpenCL decode beside the CUDA backend and the copy-bandwidth floor, batch 1, random weights.

Shapes: Llama-3-8B in bf16, and with its layers' matrices in GGUF Q4_K (the embedding and head bf16), the same
random weights for each backend (vulkan_decode.RandomStore, seed 0); both decode greedily on the device through
the same loop (common.greedy_generate: prefill the prompt, then one token a step, 4 bytes read back a step).
Reported per backend: decode tok/s, the bytes a step reads (every weight but the embedding table, plus the mean
KV read) times tok/s as GB/s, and that against the measured copy bandwidth (the floor: the tok/s at which one
step's bytes take the copy time). For OpenCL also the host time of one decode step's run() (enqueueing the bound
kernels) and the kernels a step enqueues. Target on the H200 (NVIDIA's OpenCL driver): >= 50% of the copy
bandwidth in bf16. The CUDA backend runs in the same process when CUDA is present.

    python bench/opencl_decode.py [--out results.json] [--models llama8b,llama8b_q4k] [--no-cuda] [--layers N]
    python bench/opencl_decode.py --smoke    # tiny shapes, a few tokens (pocl): checks the script only
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vulkan_decode  # noqa: E402  (its RandomStore, decode loop and step accounting, shared by every backend)
from gpu_decode import HF_LLAMA3_8B  # noqa: E402

import common  # noqa: E402

MODELS = {"llama8b": (HF_LLAMA3_8B, "bfloat16"), "llama8b_q4k": (HF_LLAMA3_8B, "gguf.Q4_K")}
log = common.log


def opencl_extras(backend_result: dict[str, Any], hf: dict[str, Any], kind: str, prompt: int, new: int) -> None:
    """The host time of one decode step's run() and its launch count, on a fresh program of the same model."""
    from poot_core import open_executor
    from poot_family_llama.plugin import DenseDecoder

    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    ex = open_executor("opencl")
    store = vulkan_decode.RandomStore(vulkan_decode.llama_shapes(hf), kind)
    weights = ex.upload(store)
    program = common.step_programs(family, config, ex, weights, store.shapes(), prompt + new)
    dec, graph = program(1)
    state = ex.allocate_state(graph)
    backend_result["host_run_ms"] = vulkan_decode.host_run_ms(ex, dec, state, prompt, new)
    backend_result["launches_per_step"] = len(dec.step.launches)
    backend_result["device"] = ex.capabilities().notes


def run(backend: str, key: str, hf: dict[str, Any], kind: str, args: Any, bandwidth: float) -> dict[str, Any]:
    result = vulkan_decode.decode_run(backend, hf, args.prompt, args.new, bandwidth, kind)
    if backend == "opencl":
        opencl_extras(result, hf, kind, args.prompt, args.new)
    return result


def row(key: str, backend: str, r: dict[str, Any]) -> str:
    extra = ""
    if backend == "opencl":
        extra = f", host run() {r['host_run_ms']:.2f} ms a step, {r['launches_per_step']} kernels"
    return (f"{r['decode_tok_s']:7.1f} tok/s {r['achieved_GBps']:6.1f} GB/s "
            f"({100 * r['fraction_of_copy_bandwidth']:.1f}% of copy; floor {r['floor_tok_s']:.0f} tok/s){extra}")


def main() -> None:
    common.decode_rows(__doc__, "opencl", MODELS, run, row, tiny=lambda key: vulkan_decode.TINY)


if __name__ == "__main__":
    main()
