"""One decode GEMV per (layout, Llama-3-8B projection shape), for a look inside the kernels: run it under
Nsight Compute to read each launch's bandwidth, issue rate, occupancy and stall reasons, or alone for CUDA-graph
timings (weights rotated past the L2) beside the bytes each launch must read.

    ncu --clock-control none -k regex:gemv --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats python bench/planes_probe.py --once
    python bench/planes_probe.py            # timings only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import HF_LLAMA3_8B, graph_us, random_weight, step_shapes  # noqa: E402

KINDS = ["bfloat16", "gguf.Q4_K", "gguf.Q4_0", "gguf.Q8_0", "gguf.Q6_K"]


def weights(kind: str, n: int, k: int, copies: int, gen: torch.Generator) -> list:
    from poot_kernels_triton.weights import to_device

    return [to_device(random_weight(kind, n, k, gen), torch.device("cuda")) for _ in range(copies)]


def nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in w.parts.values())


def rotating_us(linear, x: torch.Tensor, ws: list) -> float:
    """Microseconds per launch, each launch on the next of the weights (together past the L2)."""
    turn = [0]

    def step() -> None:
        turn[0] = (turn[0] + 1) % len(ws)
        linear(x, ws[turn[0]])

    return graph_us(step)


def main() -> int:
    import poot_kernels_triton as ktr

    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true", help="one launch each (for a profiler), no timing")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for kind in args.kinds.split(","):
        for label, (n, k) in step_shapes(HF_LLAMA3_8B).items():
            first = weights(kind, n, k, 1, gen)
            size = nbytes(first[0])
            ws = first if args.once else first + weights(kind, n, k, max(1, int(4e8 // size)), gen)
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            if args.once:
                ktr.linear(x, ws[0])
                torch.cuda.synchronize()
                continue
            us = rotating_us(ktr.linear, x, ws)
            rows.append({"kind": kind, "shape": label, "n": n, "k": k, "bytes": size, "us": us,
                         "GBps": size / us / 1e3})  # fmt: skip
            print(f"{kind:12s} {label:8s} {n:6d}x{k:<6d} {size / 1e6:7.1f} MB {us:7.1f} us {size / us / 1e3:6.0f} GB/s",
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
