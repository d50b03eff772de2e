"""Dense bf16 products of the Llama-3-8B projections on the GPU: the Triton GEMM against the vendor's BLAS (torch's
F.linear: cuBLAS, hipBLASLt) by row count, the measurement behind Tuning.vendor_gemm_rows.

    python bench/gemm_probe.py [--rows 8,16,32,64,128,256,512,2048,4096]

Prints microseconds, TFLOP/s and the weight's GB/s per (matrix, rows, route), each the median of CUDA-event timed
calls over weights rotated past the L2 cache; writes bench/results/gemm_probe.json.
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

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_route(x: torch.Tensor, weights: list[torch.Tensor], route: str, triton_only: object) -> float:
    """Median ms of x @ w^T by `route`, over `weights` in turn."""
    from poot_kernels_triton.matmul import dense_linear
    from poot_kernels_triton.tuning import use_tuning

    turn = [0]

    def call() -> None:
        w = weights[turn[0] % len(weights)]
        turn[0] += 1
        if route == "vendor":
            torch.nn.functional.linear(x, w)
        else:
            with use_tuning(triton_only):
                dense_linear(x, w)

    return gpu_decode.events_ms(call, reps=30, warmup=5)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,16,32,64,128,256,512,2048,4096")
    args = ap.parse_args()
    from poot_kernels_triton.matmul import dense_linear
    from poot_kernels_triton.tuning import tuning_for_device, use_tuning

    device = torch.device("cuda")
    triton_only = dataclasses.replace(tuning_for_device(device), vendor_gemm_rows=0)
    rows_list = [int(r) for r in args.rows.split(",")]
    out = {"device": torch.cuda.get_device_name(), "rows": rows_list, "results": []}
    for name, (n, k) in MATRICES.items():
        copies = max(2, (1 << 30) // (n * k * 2))  # rotate past the 50 MB L2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            row: dict = {"matrix": name, "n": n, "k": k, "rows": m}
            for route in ("triton", "vendor"):
                ms = time_route(x, weights, route, triton_only)
                row[route] = {"us": ms * 1e3, "TFLOPs": 2 * m * n * k / (ms * 1e-3) / 1e12,
                              "weight_GBps": n * k * 2 / (ms * 1e-3) / 1e9}
            ref = torch.nn.functional.linear(x.float(), weights[0].float())
            with use_tuning(triton_only):
                ours = dense_linear(x, weights[0]).float()
            vendor = torch.nn.functional.linear(x, weights[0]).float()
            row["triton_rel_err"] = float((ours - ref).norm() / ref.norm())
            row["vendor_rel_err"] = float((vendor - ref).norm() / ref.norm())
            out["results"].append(row)
            common.log(f"{name:8s} m={m:5d}: triton {row['triton']['us']:8.1f} us ({row['triton']['TFLOPs']:5.0f} TF), "
                       f"vendor {row['vendor']['us']:8.1f} us ({row['vendor']['TFLOPs']:5.0f} TF) "
                       f"-> {row['triton']['us'] / row['vendor']['us']:.2f}x")
        del weights
        torch.cuda.empty_cache()
    print("wrote", common.write("gemm_probe", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
