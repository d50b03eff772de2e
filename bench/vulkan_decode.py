"""Vulkan decode beside the CUDA backend and the copy-bandwidth floor, batch 1, random weights.

Shapes: SmolLM2-135M bf16 (untied head, so the head is its own matrix as in the 8B), Llama-3-8B bf16 and with its
layers' matrices in GGUF Q4_K (the embedding and head bf16), and a Qwen3-30B-A3B-shaped MoE beside a dense
Qwen3 with the same active bytes (gpu_moe.py's models: its decode should cost about what the dense one does). The same
weights (RandomStore, seed 0) go to each executor; both decode greedily on the device through the
same loop (prefill the prompt, then one token per step, 4 bytes read back a step). Reported per backend: decode
tok/s, the bytes a step reads (every weight but the embedding table, plus the mean KV read) times tok/s as
achieved GB/s, and that as a fraction of the measured device-to-device copy bandwidth (read + write counted).
For Vulkan also: the device time of one step alone (many recorded steps submitted back to back), the host time
to encode one step, the dispatches per step, and a GEMV sweep over the 8B projection shapes (weights rotated
past the L2) so the step time can be split into matmul and the rest.

    python bench/vulkan_decode.py --out results.json [--models smollm2,llama8b,llama8b_q4k,qwen3moe] [--no-cuda]
        [--layers N]
    python bench/vulkan_decode.py --smoke    # every model at tiny shapes (lavapipe): checks the script only
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "backend_vulkan"))

import gpu_moe  # noqa: E402
from gpu_decode import GGUF_BLOCKS, HALF_FIELDS, HF_LLAMA3_8B, llama_shapes  # noqa: E402

import common  # noqa: E402

SMOLLM2_135M = common.hf_config("smollm2_135m")
# name -> (Hugging Face config, stored kind of the layers' matrices)
MODELS = {"smollm2": (SMOLLM2_135M, "bfloat16"), "llama8b": (HF_LLAMA3_8B, "bfloat16"),
          "llama8b_q4k": (HF_LLAMA3_8B, "gguf.Q4_K"), "qwen3moe": (gpu_moe.QWEN3_30B_A3B, "bfloat16")}
# --smoke: dense shapes small enough for lavapipe on two cores (rows a multiple of Q4_K's 256)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            num_hidden_layers=2)


log = common.log


class RandomStore(common.DeviceStore):
    """bf16 weights N(0, 0.02) (norm scales 1), made on the GPU when there is one, seeded per run so every
    executor gets the same values (on a GPU, those of gpu_decode.GpuStore's bf16 layout). With a GGUF `kind`
    the layers' matrices are random blocks of that type with small scales (the embedding and head stay bf16)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], kind: str = "bfloat16", seed: int = 0) -> None:
        super().__init__()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, shape in shapes.items():
            if len(shape) == 1:
                self.w[name] = torch.ones(shape, dtype=torch.bfloat16, device=device)
            elif kind != "bfloat16" and ".layers." in name:
                self.w[name] = gguf_blocks(kind.removeprefix("gguf."), shape, gen, device)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device=device)
                self.w[name] = t.normal_(0.0, 0.02, generator=gen)


def gguf_blocks(type_name: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> Any:
    """A random [rows, cols] GGUF matrix of `type_name`: random codes, every f16 scale 0.001."""
    from poot_core import PackedWeight

    rows, cols = shape
    elems, size = GGUF_BLOCKS[type_name]
    b = torch.randint(0, 256, (rows, cols // elems, size), dtype=torch.uint8, device=device, generator=gen)
    scale = torch.tensor([0.001], dtype=torch.float16).view(torch.uint8).to(device)
    for at in HALF_FIELDS[type_name]:
        b[:, :, at : at + 2] = scale
    return PackedWeight("gguf", (rows, cols), {"blocks": b.reshape(rows, -1)}, {"type": type_name})


def step_bytes(hf: dict[str, Any], weight_bytes: int, prompt: int, new: int) -> float:
    """Bytes one decode step reads: every weight but the embedding table (a gather), plus the mean KV read."""
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    kv = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 2 * (prompt + new / 2)
    return weight_bytes - hf["vocab_size"] * hf["hidden_size"] * 2 + kv


def decode_run(backend: str, hf: dict[str, Any], prompt: int, new: int, bandwidth: float,
               kind: str = "bfloat16") -> dict[str, Any]:
    from poot_core import open_executor
    from poot_family_llama.plugin import DenseDecoder

    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    ex = open_executor(backend)
    store = RandomStore(llama_shapes(hf), kind)
    shapes = store.shapes()
    t0 = time.perf_counter()
    weights = ex.upload(store)
    upload_s = time.perf_counter() - t0
    del store
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    weight_bytes = weights.nbytes()
    capacity = prompt + new

    program = common.step_programs(family, config, ex, weights, shapes, capacity)
    pre, graph = program(prompt)
    dec, _ = program(1)
    state = ex.allocate_state(graph)
    ids = np.random.default_rng(0).integers(0, hf["vocab_size"], prompt)

    def generate() -> tuple[float, float, list[int]]:
        return common.greedy_generate(ex, pre, dec, state, ids, new)

    generate()  # compiles and records
    runs = [generate() for _ in range(3)]
    decode_s = statistics.median(r[1] for r in runs)
    tok_s = (new - 1) / decode_s
    nbytes = step_bytes(hf, weight_bytes, prompt, new)
    result: dict[str, Any] = {
        "backend": backend,
        "kind": kind,
        "weight_GB": weight_bytes / 1e9,
        "step_GB": nbytes / 1e9,
        "upload_s": upload_s,
        "prefill_tokens": prompt,
        "prefill_s": statistics.median(r[0] for r in runs),
        "decode_tok_s": tok_s,
        "decode_ms_per_token": 1e3 / tok_s,
        "achieved_GBps": nbytes * tok_s / 1e9,
        "floor_tok_s": bandwidth / nbytes,
        "fraction_of_copy_bandwidth": nbytes * tok_s / bandwidth,
        "tokens_deterministic": runs[0][2] == runs[1][2],
        "tokens": runs[0][2],
    }
    if backend == "vulkan":
        result.update(vulkan_step_profile(ex, dec, state, prompt + new // 2, nbytes))
        result["host_run_ms"] = host_run_ms(ex, dec, state, prompt, new)
        result["host_over_device"] = result["host_run_ms"] / result["device_step_ms"]
        destroy_buffers(ex.runtime, weights, state)
    return result


def destroy_buffers(runtime: Any, weights: Any, state: dict[str, Any]) -> None:
    """Free a Vulkan model's device memory now (weights, KV state, scratch) instead of whenever the garbage
    collector reaches the wgpu objects, so the next row (the CUDA one, the next model) finds it free."""
    buffers = {id(c.buffer): c.buffer for w in weights.matrices.values() for c in w.chunks}
    for stacks in weights.expert_tensors.values():
        buffers.update((id(c.buffer), c.buffer) for s in stacks for c in s.weight.chunks)
    buffers.update((id(v.buffer), v.buffer) for v in [*weights.vectors.values(), *state.values()])
    buffers.update((id(b), b) for b in runtime._scratch.values())
    for buffer in buffers.values():
        buffer.destroy()


def release() -> None:
    """Drop the last model's objects (reference cycles included) and CUDA's cached blocks before the next row."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_run_ms(ex: Any, dec: Any, state: dict[str, Any], prompt: int, new: int) -> float:
    """Median host milliseconds of one decode step's run() (inputs and uniforms written, the recorded step
    submitted, the next step's command buffer encoded): the wait for its token is timed apart, not here."""
    times = []
    token = 0
    for step in range(min(new - 1, 16)):
        t0 = time.perf_counter()
        out = dec.run(state, {"tokens": np.array([[token]]), "positions": np.array([[prompt + step]])})[0]
        times.append(time.perf_counter() - t0)
        token = ex.greedy_token(out)
    return 1e3 * statistics.median(times)


def moe_run(backend: str, hf: dict[str, Any], prompt: int, new: int, bandwidth: float) -> dict[str, Any]:
    """gpu_moe.py's MoE model and its dense twin (same attention, an MLP as wide as the chosen experts) on one
    backend: decode tok/s of each and their ratio (the MoE target: within 1.5x of the dense model's time)."""
    from poot_core import open_executor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = {}
    for label, model in (("moe", hf), ("dense", gpu_moe.dense_twin(hf))):
        runs[label] = gpu_moe.run_model(model, open_executor(backend), device, prompt, new, 0, bandwidth / 1e9)
        release()
    runs["moe_time_over_dense"] = runs["dense"]["decode_tok_s"] / runs["moe"]["decode_tok_s"]
    return runs


def vulkan_step_profile(ex: Any, dec: Any, state: dict[str, Any], position: int, nbytes: float) -> dict[str, Any]:
    """The device time of one recorded decode step (40 submitted back to back, one wait) and the host time to
    encode one step's command buffer."""
    runtime = ex.runtime
    slots = {name: array.buffer for name, array in state.items()}
    encode = []
    for _ in range(10):
        t0 = time.perf_counter()
        dec.step.command_buffer(slots)
        encode.append(time.perf_counter() - t0)
    dec.step.write_uniforms(position)
    probe = dec.ids.buffer if dec.ids is not None else dec.outputs[0].buffer
    times = []
    for _ in range(3):
        buffers = [dec.step.command_buffer(slots) for _ in range(40)]
        runtime.device.queue.read_buffer(probe, 0, 4)  # idle before timing
        t0 = time.perf_counter()
        runtime.device.queue.submit(buffers)
        runtime.device.queue.read_buffer(probe, 0, 4)
        times.append((time.perf_counter() - t0) / 40)
    step_s = min(times)
    by_kernel = kernel_profile(runtime, dec.step.bind(slots), probe)
    return {
        "kernels": by_kernel,
        "dispatches_per_step": dec.step.dispatch_count,
        "host_encode_ms": 1e3 * statistics.median(encode),
        "device_step_ms": 1e3 * step_s,
        "device_step_GBps": nbytes / step_s / 1e9,
        "adapter": runtime.adapter.info.get("device", "?"),
        "gemv_subgroups": runtime.gemv_subgroups,
    }


def kernel_profile(runtime: Any, bound: list[tuple[Any, Any, Any]], probe: Any) -> dict[str, Any]:
    """Device ms per step of each kind of kernel (by pipeline label): the step's dispatches of that kind alone,
    20 steps' worth submitted back to back. The kinds' times add up to about the whole step."""
    kinds: dict[str, list[tuple[Any, Any, Any]]] = {}
    for item in bound:
        kinds.setdefault(str(item[0].label).split(":")[0], []).append(item)
    report = {}
    for kind, items in kinds.items():

        def encoded(items=items) -> Any:
            encoder = runtime.device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            for pipeline, group, grid in items:
                compute.set_pipeline(pipeline)
                compute.set_bind_group(0, group)
                compute.dispatch_workgroups(*grid)
            compute.end()
            return encoder.finish()

        best = float("inf")
        for _ in range(2):
            buffers = [encoded() for _ in range(20)]
            runtime.device.queue.read_buffer(probe, 0, 4)
            t0 = time.perf_counter()
            runtime.device.queue.submit(buffers)
            runtime.device.queue.read_buffer(probe, 0, 4)
            best = min(best, (time.perf_counter() - t0) / 20)
        report[kind] = {"dispatches": len(items), "ms": best * 1e3, "us_per_dispatch": best * 1e6 / len(items)}
    return report


def gemv_sweep(hf: dict[str, Any], bandwidth: float, fmt: str = "bf16") -> dict[str, Any]:
    """Each projection shape of the model through the one-token GEMV of `fmt` (bf16 or a GGUF layout), weights
    rotated past the L2."""
    from poot_backend_vulkan.kernels.linear import gemv
    from poot_backend_vulkan.kernels.runtime import Runtime
    from poot_backend_vulkan.kernels.weights import FORMATS, upload_weight

    rt = Runtime()
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    kv = hf["num_key_value_heads"] * d // hf["num_attention_heads"]
    shapes = {"qkv": (d + 2 * kv, d), "o": (d, d), "gate_up": (2 * f, d), "down": (d, f), "lm_head": (v, d)}
    report = {}
    for label, (n, k) in shapes.items():
        nbytes = n * FORMATS[fmt].row_bytes(k)
        copies = max(1, int(240e6 // nbytes))
        if fmt == "bf16":
            data = np.full((n, k), 0x3C23, dtype=np.uint16)  # the values do not change the time
        else:  # every byte 0x11: f16 scales of about 2e-4, small codes
            data = np.full((n, nbytes // n), 0x11, dtype=np.uint8)
        ws = [upload_weight(rt, data, fmt, (n, k)) for _ in range(copies)]
        x = rt.upload(np.ones((1, k), dtype=np.float32))
        out = rt.empty((1, n))
        reps = max(20, 3 * copies)
        for _attempt in range(2):  # the first compiles
            batch = rt.batch()
            for i in range(reps):
                gemv(batch, x, ws[i % copies], out)
            rt.read(out)
            t0 = time.perf_counter()
            batch.submit()
            rt.read(out)
            seconds = (time.perf_counter() - t0) / reps
        report[label] = {
            "n": n,
            "k": k,
            "us": seconds * 1e6,
            "GBps": nbytes / seconds / 1e9,
            "floor_us": nbytes / bandwidth * 1e6,
        }
        log(f"  vulkan gemv {fmt} {label:8s} n={n:6d} k={k:5d}: {seconds * 1e6:8.1f} us "
            f"{nbytes / seconds / 1e9:6.0f} GB/s")
        for w in ws:
            for chunk in w.chunks:
                chunk.buffer.destroy()
        del ws
    release()
    return report


def run(backend: str, key: str, hf: dict[str, Any], kind: str, args: Any, bandwidth: float) -> dict[str, Any]:
    try:
        if key == "qwen3moe":
            return moe_run(backend, hf, args.prompt, args.new, bandwidth)
        return decode_run(backend, hf, args.prompt, args.new, bandwidth, kind)
    finally:
        release()


def llama8b_gemv(key: str, hf: dict[str, Any], entry: dict[str, Any], args: Any, bandwidth: float) -> None:
    if key in ("llama8b", "llama8b_q4k") and not args.smoke:
        entry["vulkan_gemv"] = gemv_sweep(hf, bandwidth, "bf16" if key == "llama8b" else "Q4_K")


def row(key: str, backend: str, r: dict[str, Any]) -> str:
    if key == "qwen3moe":
        moe, dense = r["moe"], r["dense"]
        return (f"MoE {moe['decode_tok_s']:7.1f} tok/s ({moe['achieved_GBps']:.0f} GB/s active), dense twin "
                f"{dense['decode_tok_s']:7.1f} tok/s: MoE takes {r['moe_time_over_dense']:.2f}x the dense step time "
                "(target <= 1.5)")
    extra = ""
    if backend == "vulkan":
        extra = (
            f", step on device {r['device_step_ms']:.2f} ms ({r['device_step_GBps']:.0f} GB/s), "
            f"host encode {r['host_encode_ms']:.2f} ms, host run() {r['host_run_ms']:.2f} ms a step "
            f"({100 * r['host_over_device']:.0f}% of the device step; target <= 25%), "
            f"{r['dispatches_per_step']} dispatches"
        )
        kernels = ", ".join(f"{k} {v['ms']:.2f} ms/{v['dispatches']}" for k, v in r["kernels"].items())
        extra += f"\n{'':17s}per kernel: {kernels}"
    return (f"{r['decode_tok_s']:7.1f} tok/s {r['achieved_GBps']:6.0f} GB/s "
            f"({100 * r['fraction_of_copy_bandwidth']:.0f}% of copy){extra}")


def main() -> None:
    common.decode_rows(__doc__, "vulkan", MODELS, run, row,
                       tiny=lambda key: gpu_moe.SMOKE if key == "qwen3moe" else TINY, extra=llama8b_gemv)


if __name__ == "__main__":
    main()
