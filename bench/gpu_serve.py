"""Offline serving on the GPU: the batched engine (Layout.PAGED, many sequences per step) on a Llama-3-8B-shaped
model with random bf16 weights, beside transformers' continuous batching (`generate_batch`) on the same shapes in
the same run.

Each workload is N requests of P random prompt tokens and G new tokens (end-of-sequence ignored), all submitted
at once: 256 x (1024 + 128) and 64 x (512 + 256) by default. Prints output and total tok/s, TTFT and TPOT
percentiles, the floor (the workload's products at the measured bf16 matmul rate, and each decode step's weight
bytes at the measured copy bandwidth, whichever is slower), and the decode step at batch 64 against batch 1
(the engine's own decode programs, replayed from CUDA graphs, 768 positions of context each).

    python bench/gpu_serve.py [--workloads 256x1024+128,64x512+256] [--no-hf] [--layers 32]
                              [--orders pipelined,ahead]

--orders runs each workload once per step order after the warm-up run: "ahead" (the default: the next step
launched before the ids of the one in flight are read, its tokens fed on the GPU; poot_core/driver/ahead.py) and
"pipelined" (each step's ids read before the next is scheduled); the first order's figure is the row's, and a
batch of 16 of the workload's requests is run in every order to check that they give the same tokens.

The random model has no tokenizer; its ids are shown through the tiny test tokenizer (id mod its vocabulary),
so every generated token still pays a real incremental detokenization.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import gpu_decode  # noqa: E402
import serve_timeline  # noqa: E402

import common  # noqa: E402

log = common.log


# --- the model ---------------------------------------------------------------------------------------------


class ModuloText:
    """A small tokenizer's text services for the ids of a larger vocabulary (`vocab` of them): id mod the small
    vocabulary. What it does not define is the small tokenizer's own (encoding text, chat templates)."""

    def __init__(self, text: Any, size: int, vocab: int) -> None:
        self.text, self.size, self.vocab, self._ids = text, size, text.vocab, vocab

    def __getattr__(self, name: str) -> Any:
        return getattr(self.text, name)

    def vocab_size(self) -> int:
        return self._ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.text.decode([t % self.size for t in ids], skip_special)

    def stream(self, context: list[int] | None = None) -> Any:
        return _ModuloStream(self.text.stream([t % self.size for t in context or []]), self.size)


class _ModuloStream:
    def __init__(self, inner: Any, size: int) -> None:
        self.inner, self.size = inner, size

    def push(self, token: int) -> str:
        return self.inner.push(token % self.size)

    def flush(self) -> str:
        return self.inner.flush()


def random_handle(hf: dict[str, Any], device: str = "cuda") -> Any:
    """A ModelHandle over random bf16 weights of the `hf` shape, made on `device` (the GPU, or "cpu")."""
    from helpers import tiny
    from poot_core import ModelHandle
    from poot_family_llama.plugin import DenseDecoder

    family = DenseDecoder("llama", "llama", ("LlamaForCausalLM", "llama"))
    config = family.config_from_hf({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    small = ModelHandle.load(tiny.build(Path(tempfile.mkdtemp()), "llama", layers=1))
    text = ModuloText(small.text(), small.config().vocab_size, hf["vocab_size"])
    store = gpu_decode.GpuStore(gpu_decode.llama_shapes(hf), "bfloat16", device=device)
    return ModelHandle(Path("llama-3-8b-shape"), family, config, text, store, [])


# --- floors ------------------------------------------------------------------------------------------------


def matmul_tflops() -> float:
    """Measured bf16 matmul rate (8192^3), the compute floor's denominator."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = gpu_decode.events_ms(lambda: a @ b, reps=10, warmup=3)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def floor_seconds(hf: dict[str, Any], n: int, prompt: int, new: int, tflops: float, gbps: float) -> dict[str, float]:
    d, f, v, layers = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["num_hidden_layers"]
    kv = hf["num_key_value_heads"] * (d // hf["num_attention_heads"])
    layer_params = d * (2 * d + 2 * kv) + 3 * d * f
    per_token = 2 * layers * layer_params  # the products of one token through the layers
    head = 2 * d * v  # the output head, for each token whose logits are read

    def attention(context: float) -> float:  # q.k and p.v of one token over `context` keys, every layer
        return 4 * layers * d * context

    prefill = n * prompt * (per_token + attention(prompt / 2)) + n * head
    weight_bytes = 2 * (layers * layer_params + d * v)
    decode = 0.0
    for g in range(1, new):
        flops = n * (per_token + head + attention(prompt + g))
        kv_bytes = n * 2 * layers * kv * 2 * (prompt + g)
        decode += max(flops / (tflops * 1e12), (weight_bytes + kv_bytes) / (gbps * 1e9))
    total = prefill / (tflops * 1e12) + decode
    return {"prefill_s": prefill / (tflops * 1e12), "decode_s": decode, "total_s": total,
            "output_tok_s": n * new / total}


# --- poot --------------------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) * 1000 for q in (50, 90, 99)} if values else {}


def engine_options(n: int, prompt: int, new: int, step_tokens: int | None) -> Any:
    from poot_core import DriverOptions

    capacity = prompt + new
    blocks = n * math.ceil(capacity / 16)  # every request's whole window, so nothing is preempted
    options = DriverOptions(capacity=capacity, max_running=n, kv_blocks=blocks)
    if step_tokens:
        options.step_tokens = step_tokens
        options.prefill_chunk = min(step_tokens, prompt)
    return options


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (None where they are equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def poot_workload(handle: Any, ex: Any, n: int, prompt: int, new: int, step_tokens: int | None,
                  orders: tuple[str, ...] = ("ahead",)) -> dict[str, Any]:
    from poot_core import Driver, GenerateRequest, Layout

    engine = Driver(handle, ex, engine_options(n, prompt, new, step_tokens)).serve(Layout.PAGED)
    options = engine.driver.options  # with the backend's defaults filled in
    vocab = handle.config().vocab_size
    rng = np.random.default_rng(n * 1000 + prompt)

    def requests() -> list[Any]:
        return [GenerateRequest(rng.integers(0, vocab, prompt).tolist(), max_new=new, ignore_eos=True)
                for _ in range(n)]

    def run(batch: list[Any]) -> tuple[float, list[Any], int, int]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps0, ahead0 = engine.steps, engine.ahead.steps
        gens = engine.generate_batch(batch)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, gens, engine.steps - steps0, engine.ahead.steps - ahead0

    first_s = run(requests())[0]  # compiles kernels and captures graphs
    timed = {}
    for order in orders:  # each on new prompts (the same ones would hit the prefix cache)
        engine.ahead.on = order == "ahead"
        timed[order] = run(requests())
    check, tokens = requests()[:16], {}
    for order in orders:  # a cache salt per order: a prefix-cache hit would change the prefill's shapes (bf16 sums)
        engine.ahead.on = order == "ahead"
        tokens[order] = [g.tokens for g in engine.generate_batch(check, cache_salt=order)]
    engine.ahead.on = True
    first_change = {order: [first_difference(a, b) for a, b in zip(v, tokens[orders[0]], strict=True)]
                    for order, v in tokens.items()}
    seconds, gens, steps, _ = timed[orders[0]]
    out_tokens = sum(len(g.tokens) for g in gens)
    return {
        "orders": {order: {"seconds": t[0], "output_tok_s": sum(len(g.tokens) for g in t[1]) / t[0],
                           "steps": t[2], "steps_ahead": t[3]} for order, t in timed.items()},
        "same_tokens_in_every_order": all(v == tokens[orders[0]] for v in tokens.values()),
        "first_token_that_differs": first_change,  # per checked request, against the first order (None: equal)
        "seconds": seconds, "first_run_s": first_s, "steps": steps,
        "output_tok_s": out_tokens / seconds, "total_tok_s": (out_tokens + n * prompt) / seconds,
        "output_tokens": out_tokens,
        "ttft_ms": percentiles([g.timings.prefill_seconds for g in gens]),
        "tpot_ms": percentiles([g.timings.decode_seconds / g.timings.decode_tokens for g in gens
                                if g.timings.decode_tokens]),
        "options": {"step_tokens": options.step_tokens, "prefill_chunk": options.prefill_chunk,
                    "max_running": options.max_running, "kv_blocks": options.kv_blocks},
        "programs": len(engine._programs),
        "engine": engine,
    }


def decode_step_ms(engine: Any, width: int, context: int, reps: int = 20) -> float:
    """Median ms of one engine decode step of `width` sequences at `context` positions each (the step's
    inputs copied in, the replay, the logits copied out), through the engine's own program for that shape."""
    prog, inputs = common.paged_step(engine, width, 1, context)
    return common.synced_ms(lambda: prog.run(engine._state, inputs), reps=reps)


def profiles(engine: Any, n: int, prompt: int, new: int, chunk: int) -> dict[str, dict[str, float]]:
    """Device microseconds by kernel of a decode step at the workload's batch and of a step of prefill chunks."""
    out = {}
    width = 1 << (n.bit_length() - 1)
    whole = min(chunk, prompt)  # a step of whole prompts as the workload's prefill runs them, within the tables
    fill = max(1, chunk // whole)
    for label, (seqs, each, context) in {f"decode{width}": (width, 1, prompt + new // 2),
                                         f"prefill{fill}x{whole}": (fill, whole, whole - 1)}.items():
        try:
            prog, inputs = common.paged_step(engine, seqs, each, context)
            prof = gpu_decode.kernel_profile(prog, engine._state, inputs)
            out[label] = {k: round(v, 1) for k, v in list(prof.items())[:16]}
            log(f"  {label} by kernel (us): " + ", ".join(f"{k[:50]} {v:.0f}" for k, v in out[label].items()))
        except Exception as exc:  # a diagnosis, never a reason to lose the run
            out[label] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def timeline(engine: Any, vocab: int, n: int, prompt: int, new: int) -> dict[str, Any]:
    """The workload once more on new prompts under the profiler (serve_timeline.py), reduced to figures."""
    from poot_core import GenerateRequest

    rng = np.random.default_rng(n * 7919 + prompt)
    requests = [GenerateRequest(rng.integers(0, vocab, prompt).tolist(), max_new=new, ignore_eos=True)
                for _ in range(n)]
    try:
        t0 = time.perf_counter()
        device, host, steps = serve_timeline.record(engine, requests)
        out = {"profiled_run_s": time.perf_counter() - t0, **serve_timeline.reduce(device, host, steps)}
    except Exception as exc:  # a diagnosis, never a reason to lose the run
        out = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    log("  timeline:", json.dumps(out))
    return out


# --- transformers ------------------------------------------------------------------------------------------


def hf_workload(model: Any, vocab: int, n: int, prompt: int, new: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    rng = np.random.default_rng(n * 1000 + prompt)
    gen_config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    runs = []
    for _ in range(2):
        prompts = [rng.integers(0, vocab, prompt).tolist() for _ in range(n)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen_config)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0, out))
    seconds, out = runs[1]
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {"seconds": seconds, "first_run_s": runs[0][0], "output_tokens": tokens,
            "output_tok_s": tokens / seconds, "total_tok_s": (tokens + n * prompt) / seconds}


# --- main --------------------------------------------------------------------------------------------------


def parse_workloads(text: str) -> list[tuple[int, int, int]]:
    """"256x1024+128,64x512+256" -> [(256, 1024, 128), (64, 512, 256)]."""
    out = []
    for item in text.split(","):
        n, rest = item.split("x")
        p, g = rest.split("+")
        out.append((int(n), int(p), int(g)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="256x1024+128,64x512+256")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--step-tokens", type=int, default=None, help="the engine's step budget (default: its own)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="device time by kernel of a decode and a prefill step")
    ap.add_argument("--capture-mixed", action="store_true",
                    help="capture mixed serving steps as CUDA graphs too (TritonExecutor.capture_mixed_steps)")
    ap.add_argument("--timeline", action="store_true",
                    help="one more run of each workload under the profiler: device busy time, gaps and host work")
    ap.add_argument("--orders", default="ahead", help="step orders to time: ahead, pipelined (comma-separated)")
    ap.add_argument("--out", default=str(common.RESULTS / "gpu_serve.json"))
    args = ap.parse_args()
    from poot_backend_cuda.executor import CudaExecutor

    hf = {**gpu_decode.HF_LLAMA3_8B, "num_hidden_layers": args.layers}
    workloads = parse_workloads(args.workloads)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "shape": "llama-3-8b", "layers": args.layers, "workloads": []}
    tflops, gbps = matmul_tflops(), gpu_decode.copy_bandwidth()
    result.update({"matmul_TFLOPs": tflops, "copy_GBps": gbps})
    log(f"{result['device']}: bf16 matmul {tflops:.0f} TFLOP/s, copy {gbps:.0f} GB/s")

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    handle = random_handle(hf)
    ex = CudaExecutor()
    ex.capture_mixed_steps = args.capture_mixed
    result["capture_mixed_steps"] = args.capture_mixed
    for n, prompt, new in workloads:
        row: dict[str, Any] = {"requests": n, "prompt": prompt, "new": new,
                               "floor": floor_seconds(hf, n, prompt, new, tflops, gbps)}
        try:
            poot = poot_workload(handle, ex, n, prompt, new, args.step_tokens, tuple(args.orders.split(",")))
            engine = poot.pop("engine")
            poot["memory_reserved_gib"] = torch.cuda.memory_reserved() / 2**30  # KV pool, captured steps, weights
            row["poot"] = poot
            if n >= 64 and prompt + new >= 769:
                one, many = decode_step_ms(engine, 1, 768), decode_step_ms(engine, 64, 768)
                row["decode_step_ms"] = {"batch1": one, "batch64": many, "ratio": many / one}
            if args.profile:
                row["profile_us"] = profiles(engine, n, prompt, new, poot["options"]["prefill_chunk"])
            if args.timeline:
                row["timeline"] = timeline(engine, handle.config().vocab_size, n, prompt, new)
            del engine
        except Exception as exc:  # report and go on
            row["poot"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        torch.cuda.empty_cache()
        result["workloads"].append(row)
        log("poot", json.dumps(row))
        save()
    del handle, ex
    torch.cuda.empty_cache()
    if not args.no_hf:
        try:
            from transformers import LlamaConfig, LlamaForCausalLM

            with torch.device("cuda"):
                model = LlamaForCausalLM(LlamaConfig(**hf)).to(torch.bfloat16).eval()
            for row in result["workloads"]:
                try:
                    row["transformers"] = hf_workload(model, hf["vocab_size"], row["requests"], row["prompt"],
                                                      row["new"])
                except Exception as exc:
                    row["transformers"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                log("transformers", json.dumps(row["transformers"]))
                save()
        except Exception as exc:
            result["transformers_error"] = f"{type(exc).__name__}: {exc}"[:2000]
    save()
    log(f"\n=== Llama-3-8B shape ({args.layers} layers), bf16, all requests at once, EOS ignored ===")
    for row in result["workloads"]:
        p, h, fl = row.get("poot", {}), row.get("transformers", {}), row["floor"]
        log(f"{row['requests']} x ({row['prompt']} + {row['new']}): poot {p.get('output_tok_s', 0):.0f} output tok/s "
            f"({p.get('total_tok_s', 0):.0f} total), floor {fl['output_tok_s']:.0f} "
            f"({p.get('output_tok_s', 0) / fl['output_tok_s']:.0%}), " +
            (f"transformers {h['output_tok_s']:.0f} -> {p.get('output_tok_s', 0) / h['output_tok_s']:.1f}x"
             if "output_tok_s" in h else "transformers not run"))
        if "ttft_ms" in p:
            log("  TTFT ms " + " ".join(f"{k} {v:.0f}" for k, v in p["ttft_ms"].items()) +
                " | TPOT ms " + " ".join(f"{k} {v:.1f}" for k, v in p["tpot_ms"].items()))
        if "orders" in p:
            log("  step orders: " + "; ".join(f"{k} {v['output_tok_s']:.0f} output tok/s ({v['steps']} steps, "
                                               f"{v['steps_ahead']} ahead)" for k, v in p["orders"].items()) +
                f"; same tokens in every order: {p['same_tokens_in_every_order']}")
            if not p["same_tokens_in_every_order"]:
                log(f"  first token that differs, per checked request: {p['first_token_that_differs']}")
        if "decode_step_ms" in row:
            s = row["decode_step_ms"]
            log(f"  decode step at 768 positions: batch 1 {s['batch1']:.2f} ms, batch 64 {s['batch64']:.2f} ms "
                f"({s['ratio']:.2f}x; target <= 1.5x)")
    log("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
