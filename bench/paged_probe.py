"""The paged decode attention of serving steps on the GPU, by tile and split size, for the Llama-3-8B heads (32 query
heads over 8 kv heads of 128): the measurement behind Tuning.paged_decode and Tuning.paged_split_keys.

    python bench/paged_probe.py [--cases 1x768,64x768,256x1088] [--splits 0,128,256,512,1024]

Each case is T tokens of T sequences, each at the given context (its keys in random blocks of 16 of one pool, as
the serving engine lays them out). Prints microseconds and the KV bytes' GB/s of each (tile, split) beside the
shipped setting; writes bench/results/paged_probe.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

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
Q_HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x768,64x768,256x1088,256x4000")
    ap.add_argument("--splits", default="0,128,256,512,1024")
    args = ap.parse_args()
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

            try:
                ms = gpu_decode.events_ms(call, reps=20, warmup=3)
                row["runs"][label] = {"us": ms * 1e3, "GBps": kv_bytes / (ms * 1e-3) / 1e9}
            except Exception as exc:  # a tile the device cannot run: noted, not fatal
                row["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        timed = {k: v for k, v in row["runs"].items() if "us" in v}
        best = min(timed, key=lambda k: timed[k]["us"])
        row["best"] = best
        common.log(f"{tokens:4d} tokens at {context:5d}: shipped {timed['shipped']['us']:8.1f} us "
                   f"({timed['shipped']['GBps']:5.0f} GB/s); best {best} {timed[best]['us']:8.1f} us "
                   f"({timed[best]['GBps']:5.0f} GB/s)")
        ranked = sorted(timed.items(), key=lambda kv: kv[1]["us"])
        common.log("   " + ", ".join(f"{k} {v['us']:.0f}" for k, v in ranked))
        out["cases"].append(row)
        torch.cuda.empty_cache()
    print("wrote", common.write("paged_probe", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
