"""GPU decode and prefill of a Llama-3-8B-shaped model on the cuda backend, every weight layout, beside the
floor and transformers, with the shipped launch settings (no tuning run: what a fresh process gets).

Weights are random and built directly on the GPU in the layout as a file stores it (bf16; GGUF blocks;
GPTQ/AWQ parts; FP8 with its scales), then uploaded as the executor uploads any checkpoint. The embedding
table and the output head stay bf16 in every variant, so the layouts differ in the 32 layers only. Prints,
in one run: the device-to-device copy bandwidth; per layout poot's decode tok/s (prompt 128, 256 new tokens,
greedy on the device, decode steps replayed from CUDA graphs), the bytes a step reads and the achieved GB/s,
the floor (those bytes at the copy bandwidth), prefill tok/s at 2048 tokens; transformers' static-cache
decode and its prefill on the bf16 shape.

    python bench/gpu_decode.py --out results.json [--layouts bf16,gptq4,...] [--no-hf] [--layers 32]
    python bench/gpu_decode.py --sweep 240 --out sweep.json   # planes GEMV tiles by layout and shape class
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

HF_LLAMA3_8B = common.hf_config("llama3_8b")

# bench name -> stored kind; the issue's list, in its order
LAYOUTS = {
    "bf16": "bfloat16",
    "q8_0": "gguf.Q8_0",
    "q6_k": "gguf.Q6_K",
    "q5_k": "gguf.Q5_K",
    "q5_0": "gguf.Q5_0",
    "q4_k": "gguf.Q4_K",
    "q4_0": "gguf.Q4_0",
    "iq4_xs": "gguf.IQ4_XS",
    "gptq4": "gptq.4",
    "awq4": "awq.4",
    "fp8": "fp8.channel",
}
HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q5_0": (32, 22), "Q4_K": (256, 144), "Q5_K": (256, 176),
               "Q6_K": (256, 210), "IQ4_XS": (256, 136)}  # fmt: skip


log = common.log


def events_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(fn, calls: int = 20, reps: int = 10) -> float:
    """Microseconds per call of `fn`, captured `calls` times in one CUDA graph and replayed (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return events_ms(graph.replay, reps=reps) * 1e3 / calls


def copy_bandwidth() -> float:
    """Bytes read plus written per second of a large device-to-device copy (GB/s)."""
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), reps=10)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


# --- weights, as files store them ------------------------------------------------------------------------


def random_weight(kind: str, rows: int, cols: int, gen: torch.Generator) -> Any:
    """A random [rows, cols] matrix in `kind`'s stored form, on the GPU: valid scales, random codes (bf16 also
    on the generator's device)."""
    from poot_core import PackedWeight

    if kind == "bfloat16":
        return torch.empty(rows, cols, dtype=torch.bfloat16, device=gen.device).normal_(0.0, 0.02, generator=gen)
    big = 2**31 - 1
    if kind.startswith("gguf."):
        t = kind.removeprefix("gguf.")
        elems, size = GGUF_BLOCKS[t]
        b = torch.randint(0, 256, (rows, cols // elems, size), dtype=torch.uint8, device="cuda", generator=gen)
        d = torch.tensor([0.001], dtype=torch.float16).view(torch.uint8).cuda()
        for off in HALF_FIELDS[t]:
            b[:, :, off : off + 2] = d
        return PackedWeight("gguf", (rows, cols), {"blocks": b.reshape(rows, -1)}, {"type": t})
    if kind in ("gptq.4", "awq.4"):
        groups = cols // 128
        scales = torch.full((groups, rows), 0.001, dtype=torch.float16, device="cuda")
        if kind == "gptq.4":
            parts = {
                "qweight": torch.randint(-big, big, (cols // 8, rows), dtype=torch.int32, device="cuda",
                                         generator=gen),
                "qzeros": torch.randint(-big, big, (groups, rows // 8), dtype=torch.int32, device="cuda",
                                        generator=gen),
                "scales": scales,
                "g_idx": torch.arange(cols, device="cuda", dtype=torch.int32) // 128,
            }
            return PackedWeight("gptq", (rows, cols), parts, {"bits": 4, "group_size": 128, "desc_act": False})
        parts = {
            "qweight": torch.randint(-big, big, (cols, rows // 8), dtype=torch.int32, device="cuda", generator=gen),
            "qzeros": torch.randint(-big, big, (groups, rows // 8), dtype=torch.int32, device="cuda", generator=gen),
            "scales": scales,
        }
        return PackedWeight("awq", (rows, cols), parts, {"bits": 4, "group_size": 128, "version": "gemm"})
    if kind == "fp8.channel":
        codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device="cuda", generator=gen)
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)  # no NaN codes
        scale = torch.full((rows, 1), 1e-4, dtype=torch.float32, device="cuda")
        return PackedWeight("fp8", (rows, cols), {"weight": codes.view(torch.float8_e4m3fn), "scale": scale},
                            {"granularity": "channel"})  # fmt: skip
    raise ValueError(kind)


def stored_bytes(w: Any) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in w.parts.values())


class GpuStore(common.DeviceStore):
    """Random weights of `kind` made on the GPU (bf16 also on the CPU: device="cpu")."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], kind: str, seed: int = 0, device: str = "cuda") -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, shape in shapes.items():
            matrix = len(shape) == 2 and "embed" not in name and "lm_head" not in name
            if len(shape) == 1:
                self.w[name] = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                self.w[name] = random_weight(kind if matrix else "bfloat16", shape[0], shape[1], gen)
        self.layer_bytes = sum(stored_bytes(w) for n, w in self.w.items() if ".layers." in n)


def llama_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hd = d // hf["num_attention_heads"]
    kv = hf["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    return shapes


def kernel_profile(dec: Any, state: Any, inputs: dict[str, Any], steps: int = 3) -> dict[str, float]:
    """Device microseconds per decode step by kernel name (eager steps under the profiler; kernel times
    match the replayed graph's, the launch gaps do not)."""
    from torch.profiler import ProfilerActivity, profile

    captured, dec.use_graph = dec.use_graph, False
    try:
        dec.run(state, inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.run(state, inputs)
            torch.cuda.synchronize()
    finally:
        dec.use_graph = captured
    totals: dict[str, float] = {}
    launches = 0
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us:
            totals[ev.key[:80]] = us / steps
            launches += ev.count
    # the whole step's kernel time and launch count, beside the names (the graph step minus this is the gaps)
    totals["_kernels_total_us"] = sum(totals.values())
    totals["_launches_per_step"] = launches / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


# --- poot ------------------------------------------------------------------------------------------------


def poot_run(hf: dict[str, Any], name: str, prompt: int, new: int, prefill: int, bandwidth: float,
             profile: bool) -> dict[str, Any]:  # fmt: skip
    from poot_backend_cuda.executor import CudaExecutor
    from poot_family_llama.plugin import DenseDecoder

    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    t0 = time.perf_counter()
    store = GpuStore(llama_shapes(hf), LAYOUTS[name])
    file_layer_bytes = store.layer_bytes
    ex = CudaExecutor()
    weights = ex.upload(store)
    del store
    torch.cuda.synchronize()
    upload_s = time.perf_counter() - t0
    weight_bytes = weights.nbytes()
    capacity = max(prompt + new, prefill)
    program = common.step_programs(family, config, ex, weights, {n: tuple(w.shape) for n, w in
                                                                  weights.tensors.items()}, capacity)
    pre, graph = program(prompt)
    dec, _ = program(1)
    state = ex.allocate_state(graph)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf["vocab_size"], prompt)

    def generate() -> tuple[float, list[int]]:
        _, decode_s, tokens = common.greedy_generate(ex, pre, dec, state, ids, new, torch.cuda.synchronize)
        return decode_s, tokens

    t0 = time.perf_counter()
    generate()  # compiles kernels and captures the decode graph
    first_s = time.perf_counter() - t0
    runs = [generate() for _ in range(2)]
    decode_s = min(r[0] for r in runs)
    decode_tok_s = (new - 1) / decode_s
    # KV read per step grows with the position; count its mean with the weights
    kv_bytes = 2 * hf["num_hidden_layers"] * (hf["num_key_value_heads"] * 128) * 2 * (prompt + new / 2)
    embed_bytes = hf["vocab_size"] * hf["hidden_size"] * 2  # the table is not read, one row is
    step_bytes = weight_bytes - embed_bytes + kv_bytes
    floor = bandwidth * 1e9 / step_bytes
    result = {
        "layout": name,
        "kind": LAYOUTS[name],
        "weight_GB": weight_bytes / 1e9,
        "layer_GB_as_stored": file_layer_bytes / 1e9,
        "step_GB": step_bytes / 1e9,
        "upload_s": upload_s,
        "first_generate_s": first_s,
        "decode_tok_s": decode_tok_s,
        "decode_ms_per_token": 1e3 / decode_tok_s,
        "achieved_GBps": step_bytes * decode_tok_s / 1e9,
        "floor_tok_s": floor,
        "fraction_of_floor": decode_tok_s / floor,
        "tokens_deterministic": runs[0][1] == runs[1][1],
    }
    step_inputs = {"tokens": np.array([[1]]), "positions": np.array([[prompt + new // 2]])}
    result["graph_step_ms"] = events_ms(lambda: dec._cuda_graph.replay(), reps=30)
    if profile:
        try:
            prof = kernel_profile(dec, state, step_inputs)
            result["kernel_us_per_step"] = prof
            log(f"  {name} step by kernel (us): " + ", ".join(f"{k[:40]} {v:.0f}" for k, v in list(prof.items())[:14]))
        except Exception as exc:  # the profile is a diagnosis, never a reason to lose the run
            result["kernel_profile_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if prefill:
        big, _ = program(prefill)
        ids2 = rng.integers(0, hf["vocab_size"], prefill)
        inputs = {"tokens": ids2[None, :], "positions": np.arange(prefill)[None, :]}
        ms = events_ms(lambda: big.run(state, inputs), reps=3, warmup=1)
        result["prefill_tokens"] = prefill
        result["prefill_tok_s"] = prefill / (ms * 1e-3)
    return result


# --- planes GEMV sweep (not part of the headline: it finds the tiles tuning.py ships) ---------------------

# (block_n, warps, stages): 4 columns a thread (512/4, 128/1) won the 2026-12-01 sweep at the deepest split then
# tried (32); 8 columns a thread (256/1, 512/2) for gate/up of some layouts; pipelined loads not yet measured
SWEEP_TILES = [(512, 4, 1, 128), (128, 1, 1, 128), (256, 1, 1, 128), (512, 2, 1, 128), (512, 4, 2, 128),
               (128, 1, 2, 128)]  # (block_n, warps, stages, block_k)
SWEEP_SPLITS = [8, 16, 32, 48, 64]


def parse_tiles(text: str) -> list[tuple[int, int, int, int]]:
    """"32x1x1x64,64x1x1x128": block_n x warps x stages x block_k, comma separated."""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",") if t]  # type: ignore[misc]


def sweep_one(kind: str, label: str, n: int, k: int, gen: torch.Generator, bandwidth: float) -> dict[str, Any]:
    """One layout and shape over SWEEP_TILES x SWEEP_SPLITS, each tile checked against the GEMM route."""
    import poot_kernels_triton as ktr
    from poot_kernels_triton import matmul, relayout
    from poot_kernels_triton.tuning import Tile

    first = relayout.to_planes(random_weight(kind, n, k, gen))
    nbytes = sum(t.numel() * t.element_size() for t in first.parts.values())
    ws = [first] + [relayout.to_planes(random_weight(kind, n, k, gen)) for _ in range(max(0, int(2e8 // nbytes)))]
    turn = [0]

    def step() -> None:
        turn[0] = (turn[0] + 1) % len(ws)
        ktr.linear(x, ws[turn[0]])

    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    ref = ktr.linear(x.expand(8, k).contiguous(), ws[0])[0:1].float()  # the GEMM route
    default_us = graph_us(step)
    rows = []
    for bn, warps, stages, bk in SWEEP_TILES:
        for split in SWEEP_SPLITS:
            matmul.GEMV_OVERRIDE["planes"] = Tile(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                                  split_k=split)  # fmt: skip
            try:
                err = float((ktr.linear(x, ws[0]).float() - ref).norm() / ref.norm())
                rows.append((graph_us(step), bn, warps, split, err, stages, bk))
            except Exception as exc:  # a tile that fails to compile is skipped, reported
                log(f"  {kind} {label} {bn}/{warps}/{split}/s{stages}/k{bk} failed: "
                    f"{type(exc).__name__}: {str(exc)[:200]}")
    matmul.GEMV_OVERRIDE.pop("planes", None)
    best = min(rows, key=lambda r: r[0])
    log(f"  sweep {kind:12s} {label:8s} default {default_us:6.1f} us ({nbytes / default_us / 1e3:5.0f} GB/s), "
        f"best {best[1]}/{best[2]}w/s{best[5]}/k{best[6]} split {best[3]} {best[0]:6.1f} us "
        f"({nbytes / best[0] / 1e3:5.0f} GB/s, "
        f"{100 * nbytes / best[0] / 1e3 / bandwidth:.0f}% of copy) err {best[4]:.1e}")
    return {"n": n, "k": k, "bytes": nbytes, "default_us": default_us, "default_GBps": nbytes / default_us / 1e3,
            "best": {"us": best[0], "block_n": best[1], "warps": best[2], "split": best[3], "stages": best[5],
                     "block_k": best[6], "GBps": nbytes / best[0] / 1e3, "err": best[4]}, "all": rows}  # fmt: skip


def planes_sweep(hf: dict[str, Any], bandwidth: float, names: list[str], seconds: float) -> dict[str, Any]:
    """Time the planes GEMV of each layout on the shape classes of the Llama-3-8B step (q/k/v joined,
    o, gate/up joined, down) over tiles x splits, inside CUDA graphs on weights rotated past the L2."""
    from poot_kernels_triton.tuning import shape_class

    d, f = hf["hidden_size"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * d // hf["num_attention_heads"]
    shapes = {"qkv": (d + 2 * kv, d), "o": (d, d), "gate_up": (2 * f, d), "down": (d, f)}
    deadline = time.perf_counter() + seconds
    report: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name in names:
        kind = LAYOUTS[name]
        if kind == "bfloat16":
            continue
        for label, (n, k) in shapes.items():
            if time.perf_counter() > deadline:
                report.setdefault("_stopped", f"time budget of {seconds} s spent before {name} {label}")
                return report
            entry = sweep_one(kind, label, n, k, gen, bandwidth)
            entry["class"] = shape_class(n, k)
            report[f"{kind}|{label}"] = entry
            torch.cuda.empty_cache()
    return report


# --- compiling ahead, in parallel ---------------------------------------------------------------------------


def step_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The matrices one decode step multiplies by, as the executor joins them (q/k/v, gate/up)."""
    d, f = hf["hidden_size"], hf["intermediate_size"]
    kv = hf["num_key_value_heads"] * d // hf["num_attention_heads"]
    return {"qkv": (d + 2 * kv, d), "o": (d, d), "gate_up": (2 * f, d), "down": (d, f)}


def warm_one(hf: dict[str, Any], name: str, rows: tuple[int, ...]) -> None:
    """Compile (into Triton's on-disk cache) the GEMV and GEMM launches a layout's run will make."""
    import poot_kernels_triton as ktr
    from poot_kernels_triton.weights import to_device

    gen = torch.Generator(device="cuda").manual_seed(2)
    for n, k in step_shapes(hf).values():
        w = to_device(random_weight(LAYOUTS[name], n, k, gen), torch.device("cuda"))
        for m in rows:
            ktr.linear(torch.zeros(m, k, dtype=torch.bfloat16, device="cuda"), w)
    torch.cuda.synchronize()


def warm_all(names: list[str], layers: int, prefill: int, prompt: int) -> float:
    """Every packed layout's kernels compiled by one process each, side by side (the CPU has the cores; one
    process compiles one kernel at a time). Returns the seconds it took."""
    import subprocess

    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--warm-one", name, "--layers", str(layers), "--prefill",
                               str(prefill), "--prompt", str(prompt)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
             for name in names if LAYOUTS[name] != "bfloat16"]  # fmt: skip
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            log(f"  warm-up {p.args[3]} failed: {err[-500:]}")
    return time.perf_counter() - t0


# --- transformers ----------------------------------------------------------------------------------------


def hf_run(hf: dict[str, Any], prompt: int, new: int, prefill: int, result: dict[str, Any]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**hf)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, hf["vocab_size"], (1, prompt), device="cuda")
    with torch.inference_mode():
        if prefill:
            big = torch.randint(0, hf["vocab_size"], (1, prefill), device="cuda")
            ms = events_ms(lambda: model(big, use_cache=False, logits_to_keep=1), reps=5, warmup=2)
            result["prefill_tok_s_eager_sdpa"] = prefill / (ms * 1e-3)
        # transformers compiles the decoding forward itself when the cache is static (its compile_config:
        # torch.compile with CUDA graphs); compiling forward by hand as well breaks its graph replays

        def gen(n: int) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static", pad_token_id=0
            )
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        t = time.perf_counter()
        gen(new)
        gen(new)  # compiles prefill and decode graphs
        result["compile_s"] = time.perf_counter() - t
        full = statistics.median(gen(new) for _ in range(2))
        first = statistics.median(gen(1) for _ in range(2))
    result["decode_tok_s"] = (new - 1) / (full - first)
    result["generate_s"] = full


def summary(out: dict[str, Any]) -> None:
    bf16 = next((r for r in out["poot"] if r.get("layout") == "bf16" and "error" not in r), None)
    log(f"\n=== Llama-3-8B shape, batch 1, prompt {out['prompt']}, {out['new_tokens']} new; defaults only ===")
    log(f"copy bandwidth {out['copy_GBps']:.0f} GB/s; {out['device']}, torch {out['torch']}, triton {out['triton']}")
    log(f"{'layout':8s} {'decode tok/s':>12s} {'GB/step':>8s} {'GB/s':>6s} {'floor':>7s} {'of floor':>8s} "
        f"{'x bf16':>6s} {'prefill tok/s':>13s}")  # fmt: skip
    for r in out["poot"]:
        if "error" in r:
            log(f"{r['layout']:8s} ERROR {r['error'][:200]}")
            continue
        ratio = r["decode_tok_s"] / bf16["decode_tok_s"] if bf16 else float("nan")
        log(f"{r['layout']:8s} {r['decode_tok_s']:12.1f} {r['step_GB']:8.2f} {r['achieved_GBps']:6.0f} "
            f"{r['floor_tok_s']:7.1f} {100 * r['fraction_of_floor']:7.0f}% {ratio:6.2f} "
            f"{r.get('prefill_tok_s', 0):13.0f}")  # fmt: skip
    t = out.get("transformers", {})
    if t:
        log(f"transformers bf16 (static cache, compiled): decode {t.get('decode_tok_s', 0):.1f} tok/s, prefill "
            f"(eager sdpa) {t.get('prefill_tok_s_eager_sdpa', 0):.0f} tok/s" + (f"; {t['error'][:200]}" if "error" in t
                                                                               else ""))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--sweep", type=float, default=0.0, help="seconds for a planes GEMV tile sweep instead")
    ap.add_argument("--sweep-tiles", default="", help="the sweep's tiles: 32x1x1x64,... (block_n x warps x stages x "
                    "block_k)")
    ap.add_argument("--sweep-splits", default="", help="the sweep's split counts: 16,32,64")
    ap.add_argument("--profile", action="store_true", help="kernel times per decode step (eager, profiler)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds: start no layout after this, then transformers")
    ap.add_argument("--hf-seconds", type=float, default=150.0, help="the budget's share kept for transformers")
    ap.add_argument("--warm", action="store_true", help="compile every layout's kernels first, in parallel")
    ap.add_argument("--warm-one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=2048)
    args = ap.parse_args()
    hf = {**HF_LLAMA3_8B, "num_hidden_layers": args.layers}
    if args.warm_one:
        warm_one(hf, args.warm_one, (1, args.prompt, args.prefill))
        return 0
    import triton

    start = time.perf_counter()
    names = [n for n in args.layouts.split(",") if n]
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": "llama-3-8b",
        "layers": args.layers,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "poot": [],
    }
    bw = copy_bandwidth()
    out["copy_GBps"] = bw
    log(f"device {out['device']}, torch {torch.__version__}, triton {triton.__version__}; copy {bw:.0f} GB/s")

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))

    if args.sweep:
        global SWEEP_TILES, SWEEP_SPLITS
        SWEEP_TILES = parse_tiles(args.sweep_tiles) or SWEEP_TILES
        SWEEP_SPLITS = [int(v) for v in args.sweep_splits.split(",") if v] or SWEEP_SPLITS
        out["sweep"] = planes_sweep(hf, bw, names, args.sweep)
        save()
        return 0
    if args.warm:
        out["warm_s"] = warm_all(names, args.layers, args.prefill, args.prompt)
        log(f"kernels of {len(names) - 1} packed layouts compiled in {out['warm_s']:.0f} s")
    for name in names:
        left = args.budget - (time.perf_counter() - start) if args.budget else float("inf")
        if left < (args.hf_seconds if not args.no_hf else 0):
            out["poot"].append({"layout": name, "error": "not run: the time budget was spent"})
            continue
        try:
            r = poot_run(hf, name, args.prompt, args.new, args.prefill, bw, args.profile)
        except Exception as exc:  # report and go on to the next layout
            r = {"layout": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        out["poot"].append(r)
        torch.cuda.empty_cache()
        log("poot", json.dumps({k: v for k, v in r.items() if k != "kernel_us_per_step"}))
        save()
    summary(out)  # before transformers' compile, which can take minutes
    if not args.no_hf:
        out["transformers"] = {}
        try:
            hf_run(hf, args.prompt, args.new, args.prefill, out["transformers"])
        except Exception as exc:  # keep what was measured before the failure
            out["transformers"]["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log("transformers", json.dumps(out["transformers"]))
    save()
    summary(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
