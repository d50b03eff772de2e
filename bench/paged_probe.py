"""The paged attention of serving steps on the GPU, by tile, for the Llama-3-8B heads (32 query heads over 8 kv
heads of 128): the measurement behind Tuning.paged_decode, Tuning.paged_split_keys and Tuning.prefill.

    python bench/paged_probe.py [--cases 1x768,64x768,256x1088] [--splits 0,128,256,512,1024]
    python bench/paged_probe.py --prefill [--cases 2x1024@0,4x512@512]

Decode: each case is T tokens of T sequences, each at the given context (its keys in random blocks of 16 of one
pool, as the serving engine lays them out). Prints microseconds and the KV bytes' GB/s of each (tile, split)
beside the shipped setting.

--prefill: each case SxN@P is S sequences of N new tokens each from position P (the keys before them already in
the pool), as one step of the paged prefill kernel. Prints microseconds and TFLOP/s of each prefill tile beside
the shipped tile, the dense bf16 peak (989 TFLOP/s on an H100/H200 SXM) and, in the same run, torch's
scaled_dot_product_attention (flash) on the same sequences laid out contiguously (cases from position 0) and
the contiguous prefill kernel a sequence at a time. Writes bench/results/paged_probe.json (or
paged_prefill_probe.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_decode  # noqa: E402

import common  # noqa: E402

TILES = {  # block_m x block_n, warps, stages
    "16x64w4s2": dict(block_m=16, block_n=64, num_warps=4, num_stages=2),
    "16x128w4s2": dict(block_m=16, block_n=128, num_warps=4, num_stages=2),
    "16x64w2s3": dict(block_m=16, block_n=64, num_warps=2, num_stages=3),
    "16x128w8s2": dict(block_m=16, block_n=128, num_warps=8, num_stages=2),
}
PREFILL_TILES = {  # block_m x block_n, warps, stages
    f"{m}x{n}w{w}s{st}": dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
    for m, n, w, st in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3),
                        (64, 32, 4, 4)]  # fmt: skip
}
Q_HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
PEAK_TFLOPS = 989.0  # dense bf16, H100/H200 SXM


def case_inputs(tokens: int, context: int, capacity: int) -> tuple[torch.Tensor, ...]:
    width = capacity // BLOCK
    blocks = tokens * width
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    k_pool = torch.randn(blocks, KV_HEADS, BLOCK, DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(blocks, device="cuda", generator=gen).reshape(tokens, width)
    q = torch.randn(tokens, Q_HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    positions = torch.full((tokens,), context, dtype=torch.int64, device="cuda")
    seqs = torch.arange(tokens, device="cuda")
    return q, k_pool, v_pool, positions, seqs, tables


def _timed(runs: dict[str, Any], label: str, call: Any, reps: int, **amounts: float) -> None:
    """runs[label]: the call's microseconds and, for each amount (bytes, flops) given in its unit, that amount a
    second; or the error of a tile the device cannot run (noted, not fatal)."""
    try:
        ms = gpu_decode.events_ms(call, reps=reps, warmup=3)
        runs[label] = {"us": ms * 1e3, **{name: amount / (ms * 1e-3) for name, amount in amounts.items()}}
    except Exception as exc:
        runs[label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}


def _ranked(runs: dict[str, Any], figure: str) -> None:
    """One line: every run's figure, fastest first."""
    ranked = sorted(runs.items(), key=lambda kv: kv[1]["us"])
    common.log("   " + ", ".join(f"{k} {v[figure]:.0f}" for k, v in ranked))


def prefill_inputs(seqs: int, new: int, start: int) -> tuple[torch.Tensor, ...]:
    """A step of `seqs` prefill runs of `new` tokens from `start`, their keys in random blocks of one pool."""
    width = -(-(start + new) // BLOCK)
    gen = torch.Generator(device="cuda").manual_seed(seqs * new + start)
    k_pool = torch.randn(seqs * width, KV_HEADS, BLOCK, DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    v_pool = torch.randn_like(k_pool)
    tables = torch.randperm(seqs * width, device="cuda", generator=gen).reshape(seqs, width)
    q = torch.randn(seqs * new, Q_HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=gen)
    positions = (start + torch.arange(new, device="cuda")).repeat(seqs)
    slots = torch.arange(seqs, device="cuda").repeat_interleave(new)
    return q, k_pool, v_pool, positions, slots, tables


def prefill_case(case: str, shipped: Any) -> dict[str, Any]:
    """One --prefill case SxN@P: every tile's time, and the peers'."""
    import torch.nn.functional as F

    from poot_kernels_triton.attention import prefill_attention
    from poot_kernels_triton.paged import paged_prefill_attention, prefill_tile, prefill_tiles
    from poot_kernels_triton.tuning import Tile, use_tuning

    shape, at = case.split("@")
    seqs, new = (int(v) for v in shape.split("x"))
    start = int(at)
    q, k_pool, v_pool, positions, slots, tables = prefill_inputs(seqs, new, start)
    tflop = 4.0 * DIM * Q_HEADS * seqs * sum(start + i + 1 for i in range(new)) / 1e12
    row: dict[str, Any] = {"case": case, "gflop": tflop * 1e3, "runs": {}}
    # the same keys laid out contiguously [seqs, kv_heads, keys, dim], for the peers and the reference
    width = tables.shape[1] * BLOCK
    k = k_pool[tables].permute(0, 2, 1, 3, 4).reshape(seqs, KV_HEADS, width, DIM)[:, :, : start + new].contiguous()
    v = v_pool[tables].permute(0, 2, 1, 3, 4).reshape(seqs, KV_HEADS, width, DIM)[:, :, : start + new].contiguous()
    qs = q.view(seqs, new, Q_HEADS, DIM)
    qt = qs.transpose(1, 2).contiguous()
    result = torch.empty_like(q)
    runs = [("shipped", shipped)] + [(name, dataclasses.replace(shipped, prefill=Tile(**tile)))
                                      for name, tile in PREFILL_TILES.items()]  # fmt: skip
    for label, tuning in runs:
        with use_tuning(tuning):
            tiles = prefill_tiles(slots, positions, prefill_tile(q.device, DIM).block_m, seqs)[0]

        def call(tuning: Any = tuning, tiles: torch.Tensor = tiles) -> None:
            with use_tuning(tuning):
                paged_prefill_attention(q, k_pool, v_pool, positions, slots, tables, tiles, result, scale=DIM**-0.5)

        _timed(row["runs"], label, call, 10, tflops=tflop)
        if label == "shipped" and start == 0 and "us" in row["runs"][label]:  # result holds the shipped output
            want = F.scaled_dot_product_attention(qt.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
            got = result.view(seqs, new, Q_HEADS, DIM).transpose(1, 2).float()
            row["shipped_max_abs_error_vs_float32"] = float((got - want).abs().max())
    _timed(row["runs"], "contiguous kernel, a sequence at a time",
           lambda: [prefill_attention(qs[i], k[i], v[i], start) for i in range(seqs)], 10, tflops=tflop)
    if start == 0:
        _timed(row["runs"], "torch sdpa (flash)",
               lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True), 10, tflops=tflop)
    return row


def prefill_main(cases: str) -> int:
    """The --prefill probe (see the module's text)."""
    from poot_kernels_triton.tuning import tuning_for_device

    shipped = tuning_for_device(torch.device("cuda"))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shipped": str(shipped.prefill),
                           "peak_tflops": PEAK_TFLOPS, "cases": []}  # fmt: skip
    for case in cases.split(","):
        row = prefill_case(case, shipped)
        done = {k: v for k, v in row["runs"].items() if "us" in v}
        best = min(done, key=lambda k: done[k]["us"])
        row["best"] = best
        common.log(f"{case:>12}: shipped {done['shipped']['us']:8.1f} us ({done['shipped']['tflops']:5.0f} TFLOP/s,"
                   f" {done['shipped']['tflops'] / PEAK_TFLOPS:.0%} of peak); best {best} {done[best]['us']:8.1f} us"
                   f" ({done[best]['tflops']:5.0f} TFLOP/s); error vs float32 "
                   f"{row.get('shipped_max_abs_error_vs_float32', '-')}")  # fmt: skip
        _ranked(done, "tflops")
        out["cases"].append(row)
        torch.cuda.empty_cache()
    print("wrote", common.write("paged_prefill_probe", out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None)
    ap.add_argument("--splits", default="0,128,256,512,1024")
    ap.add_argument("--prefill", action="store_true", help="the paged prefill kernel's tiles (see above)")
    args = ap.parse_args()
    if args.prefill:
        return prefill_main(args.cases or "2x1024@0,1x2048@0,4x512@512,8x256@768,1x512@3584")
    args.cases = args.cases or "1x768,64x768,256x1088,256x4000"
    from poot_kernels_triton.paged import paged_decode_attention
    from poot_kernels_triton.tuning import Tile, tuning_for_device, use_tuning

    shipped = tuning_for_device(torch.device("cuda"))
    out = {"device": torch.cuda.get_device_name(), "shipped": {"tile": str(shipped.paged_decode or shipped.decode),
                                                                "split_keys": shipped.paged_split_keys}, "cases": []}
    for case in args.cases.split(","):
        tokens, context = (int(v) for v in case.split("x"))
        capacity = -(-(context + 129) // 128) * 128
        inputs = case_inputs(tokens, context, capacity)
        kv_bytes = tokens * (context + 1) * KV_HEADS * DIM * 2 * 2
        row = {"tokens": tokens, "context": context, "kv_GB": kv_bytes / 1e9, "runs": {}}
        runs = [("shipped", shipped)] + [
            (f"{name}/split{split}", dataclasses.replace(shipped, paged_decode=Tile(**tile), paged_split_keys=split))
            for name, tile in TILES.items() for split in (int(s) for s in args.splits.split(","))]
        for label, tuning in runs:
            def call(tuning=tuning, inputs=inputs) -> None:
                with use_tuning(tuning):
                    paged_decode_attention(*inputs, scale=DIM**-0.5)

            _timed(row["runs"], label, call, 20, GBps=kv_bytes / 1e9)
        timed = {k: v for k, v in row["runs"].items() if "us" in v}
        best = min(timed, key=lambda k: timed[k]["us"])
        row["best"] = best
        common.log(f"{tokens:4d} tokens at {context:5d}: shipped {timed['shipped']['us']:8.1f} us "
                   f"({timed['shipped']['GBps']:5.0f} GB/s); best {best} {timed[best]['us']:8.1f} us "
                   f"({timed[best]['GBps']:5.0f} GB/s)")
        _ranked(timed, "us")
        out["cases"].append(row)
        torch.cuda.empty_cache()
    print("wrote", common.write("paged_probe", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
