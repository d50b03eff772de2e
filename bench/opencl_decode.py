"""OpenCL decode beside the CUDA backend and the copy-bandwidth floor, batch 1, random weights.

Shapes: SmolLM2-135M in bf16, Llama-3-8B in bf16 and with its layers' matrices in GGUF Q4_K (the embedding and
head bf16), the same random weights for each backend (vulkan_decode.RandomStore, seed 0); both decode greedily on
the device through the same loop (common.greedy_generate: prefill the prompt, then one token a step, 4 bytes
read back a step).
Reported per backend: decode tok/s, the bytes a step reads (every weight but the embedding table, plus the mean
KV read) times tok/s as GB/s, and that against the measured copy bandwidth (the floor: the tok/s at which one
step's bytes take the copy time). For OpenCL also the host time of one decode step's run() (enqueueing the bound
kernels) and the kernels a step enqueues, and where a step's time goes, from a separate timing pass (never the
timed loop): the host time of the step's enqueue alone, the wait after it, the host CPU time of the enqueue with
the queue held (nothing running) through the library call the step uses and through pyopencl's enqueue with
events, and, from a profiling queue of the same context, the device time of the products (gemv/linear kernels)
against every other kernel, by kernel name. Target on the H200 (NVIDIA's OpenCL driver): >= 50% of the copy
bandwidth in bf16.
The CUDA backend runs in the same process when CUDA is present.

    python bench/opencl_decode.py [--out results.json] [--models smollm2,llama8b,llama8b_q4k] [--no-cuda] [--layers N]
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

MODELS = {"smollm2": (vulkan_decode.SMOLLM2_135M, "bfloat16"), "llama8b": (HF_LLAMA3_8B, "bfloat16"),
          "llama8b_q4k": (HF_LLAMA3_8B, "gguf.Q4_K")}
log = common.log


# linear/logits products: cl/gemv.cl (one token), cl/linear.cl
PRODUCTS = ("gemv", "gemv3", "gemv_gated", "linear")
HOLD_LIMIT_S = 5.0  # the held-queue enqueue's limit: past it the queue is let go (and the figure is flagged)


def held_enqueue_ms(rt: Any, enqueue: Any, rounds: int) -> dict[str, float]:
    """Median host ms of one step's enqueue with the queue held by a user event (nothing runs until it is
    released, so no device work competes with the enqueuing thread): the pure host cost of a step's launches,
    as the enqueuing thread's CPU time and as wall time."""
    import statistics
    import threading
    import time

    cl = rt.cl
    cpu, wall, released_late = [], [], False
    for _ in range(rounds):
        hold = cl.UserEvent(rt.context)
        cl.enqueue_marker(rt.queue, wait_for=[hold])
        lock, done = threading.Lock(), []

        def release(hold: Any = hold, lock: Any = lock, done: list[bool] = done) -> None:
            with lock:
                if not done:
                    done.append(True)
                    hold.set_status(cl.command_execution_status.COMPLETE)

        # a driver that blocks an enqueue behind a held queue would never return: a timer lets the queue go
        timer = threading.Timer(HOLD_LIMIT_S, release)
        timer.start()
        t0, w0 = time.thread_time(), time.perf_counter()
        enqueue()
        cpu.append(time.thread_time() - t0)
        wall.append(time.perf_counter() - w0)
        timer.cancel()
        released_late = released_late or bool(done)
        release()
        rt.finish()
    return {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall),
            "released_by_timer": released_late}


def step_profile(ex: Any, dec: Any, state: dict[str, Any], position: int, rounds: int = 5) -> dict[str, Any]:
    """Where one decode step's time goes (medians over `rounds` steps at `position`): host ms of the step's
    enqueue alone (as run() does it, on the program's own queue), host ms waiting for the queue after it, and
    from a second enqueue of the same launches on a profiling queue of the same context (pyopencl, with
    events), the device ms of every kernel summed by kernel name, products against the rest."""
    import statistics
    import time

    import numpy as np
    from poot_backend_opencl.kernels.enqueue import Enqueuer

    rt, step = ex.runtime, dec.step
    profiling = rt.cl.CommandQueue(rt.context, properties=rt.cl.command_queue_properties.PROFILING_ENABLE)
    enqueue, wait, per_name = [], [], {}
    held = {"library": held_enqueue_ms(rt, step.enqueue, rounds),
            "pyopencl": held_enqueue_ms(rt, Enqueuer(rt.queue, step.launches, direct=False), rounds)}
    for _ in range(rounds):
        dec.run(state, {"tokens": np.array([[1]]), "positions": np.array([[position]])})
        rt.finish()
        t0 = time.perf_counter()
        step.enqueue()  # the step's own enqueue path (no events)
        t1 = time.perf_counter()
        rt.finish()
        enqueue.append(t1 - t0)
        wait.append(time.perf_counter() - t1)
        events = [(launch.kernel.function_name, launch.enqueue(profiling)) for launch in step.launches]
        profiling.finish()
        sums: dict[str, float] = {}
        for name, event in events:
            if event is not None:
                sums[name] = sums.get(name, 0.0) + (event.profile.end - event.profile.start) * 1e-6
        for name, ms in sums.items():
            per_name.setdefault(name, []).append(ms)
    kernels = {name: statistics.median(v) for name, v in per_name.items()}
    products = sum(ms for name, ms in kernels.items() if name in PRODUCTS)
    return {"enqueue_ms": 1e3 * statistics.median(enqueue), "wait_after_enqueue_ms": 1e3 * statistics.median(wait),
            "held_enqueue": held,
            "device_ms": sum(kernels.values()), "products_ms": products,
            "other_ms": sum(kernels.values()) - products, "kernel_ms": dict(sorted(kernels.items()))}


def opencl_extras(backend_result: dict[str, Any], hf: dict[str, Any], kind: str, prompt: int, new: int) -> None:
    """The host time of one decode step's run(), its launch count and the step profile, on a fresh program of
    the same model (a plain queue, as the timed loop's; step_profile adds a profiling queue for its events)."""
    from poot_backend_opencl.executor import OpenCLExecutor
    from poot_backend_opencl.kernels.runtime import Runtime

    from poot_family_llama.plugin import DenseDecoder

    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    ex = OpenCLExecutor(Runtime())
    store = vulkan_decode.RandomStore(vulkan_decode.llama_shapes(hf), kind)
    weights = ex.upload(store)
    program = common.step_programs(family, config, ex, weights, store.shapes(), prompt + new)
    dec, graph = program(1)
    state = ex.allocate_state(graph)
    backend_result["host_run_ms"] = vulkan_decode.host_run_ms(ex, dec, state, prompt, new)
    backend_result["launches_per_step"] = len(dec.step.launches)
    backend_result["direct_enqueue"] = dec.step.enqueue.direct
    backend_result["device"] = ex.capabilities().notes
    backend_result["profile"] = step_profile(ex, dec, state, prompt + new // 2)


def run(backend: str, key: str, hf: dict[str, Any], kind: str, args: Any, bandwidth: float) -> dict[str, Any]:
    result = vulkan_decode.decode_run(backend, hf, args.prompt, args.new, bandwidth, kind)
    if backend == "opencl":
        opencl_extras(result, hf, kind, args.prompt, args.new)
    return result


def row(key: str, backend: str, r: dict[str, Any]) -> str:
    extra = ""
    if backend == "opencl":
        p = r["profile"]
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(p["kernel_ms"].items(), key=lambda kv: -kv[1])[:6])
        held = p["held_enqueue"]
        extra = (f", host run() {r['host_run_ms']:.2f} ms a step, {r['launches_per_step']} kernels; timing pass: "
                 f"enqueue {p['enqueue_ms']:.2f} ms + wait {p['wait_after_enqueue_ms']:.2f} ms (queue held, cpu/wall: "
                 f"library call {held['library']['cpu_ms']:.2f}/{held['library']['wall_ms']:.2f} ms, pyopencl "
                 f"{held['pyopencl']['cpu_ms']:.2f}/{held['pyopencl']['wall_ms']:.2f} ms), device "
                 f"{p['device_ms']:.2f} ms = products {p['products_ms']:.2f} + rest {p['other_ms']:.2f} "
                 f"(ms by kernel: {top})")
    return (f"{r['decode_tok_s']:7.1f} tok/s {r['achieved_GBps']:6.1f} GB/s "
            f"({100 * r['fraction_of_copy_bandwidth']:.1f}% of copy; floor {r['floor_tok_s']:.0f} tok/s){extra}")


def main() -> None:
    common.decode_rows(__doc__, "opencl", MODELS, run, row, tiny=lambda key: vulkan_decode.TINY)


if __name__ == "__main__":
    main()
