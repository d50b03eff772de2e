"""Nanoseconds per 256 weights of the CPU C kernels' decode product (y = x @ W^T for a few rows of x, straight
from the GGUF blocks), per block type, on one matrix.

    python bench/cpu_block_gemv.py [--types Q4_K,Q2_K,Q3_K,IQ4_XS] [--shape 2048x2048] [--rows 1] [--threads N]

The blocks are random bytes with finite float16 scales (the speed does not depend on the values). Rounds
alternate between the types and the best round of each is kept, so a busy machine slows all types alike.
Beside wall time it prints the process's CPU time per product: on a shared machine, with --threads 1, that
is the kernel's own cost even while other work takes turns on the core (with more threads it also counts
OpenMP's waiting).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from poot_core.checkpoint.quant import gguf_blocks as gb
from poot_core.cpu import c_kernels
from poot_core.cpu.packed_linear import C_TYPES

# Byte offsets of each block's float16 fields (ggml's block structs); every other byte is random.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_XS": [0]}


def random_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    block, size = gb.BLOCK_SIZES[type_name]
    n = rows * cols // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        raw[:, at : at + 2] = rng.uniform(1e-3, 1e-2, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q2_K,Q3_K,IQ4_XS")
    parser.add_argument("--shape", default="2048x2048", help="out x in")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (decode: 1)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50, help="products per round")
    args = parser.parse_args()
    lib = c_kernels.load(c_kernels.build())
    n, k = (int(v) for v in args.shape.split("x"))
    x = np.random.default_rng(1).standard_normal((args.rows, k)).astype(np.float32)
    y = np.empty((args.rows, n), np.float32)
    calls = {}
    for name in args.types.split(","):
        kernel, block = C_TYPES[name], gb.BLOCK_SIZES[name][0]
        blocks = random_blocks(name, n, k)
        fn = getattr(lib, kernel.gemv)
        call = (kernel.type_id, blocks.ctypes.data, blocks.shape[1], n, k // block, x.ctypes.data, args.rows,
                y.ctypes.data, args.threads)
        calls[name] = (fn, call, blocks)
    best = {name: [float("inf"), float("inf")] for name in calls}  # wall, CPU seconds per product
    for _ in range(args.rounds):
        for name, (fn, call, _blocks) in calls.items():
            fn(*call)  # warm: the matrix in cache as far as it fits
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                fn(*call)
            best[name][0] = min(best[name][0], (time.perf_counter() - start) / args.calls)
            best[name][1] = min(best[name][1], (time.process_time() - cpu) / args.calls)
    print(f"{n}x{k}, {args.rows} row(s) of x, {args.threads} thread(s), features "
          f"{','.join(sorted(c_kernels.features(lib)))}")
    print(f"{'type':<8}{'us/product':>12}{'ns/256 weights':>16}{'weight GB/s':>13}{'CPU ns/256 weights':>20}")
    per_block = 1e9 / (n * k / 256)
    for name, (wall, cpu) in best.items():
        rate = calls[name][2].nbytes / wall / 1e9
        print(f"{name:<8}{wall * 1e6:>12.1f}{wall * per_block:>16.2f}{rate:>13.2f}{cpu * per_block:>20.2f}")


if __name__ == "__main__":
    main()
