"""Shared pieces of the benchmarks: the memory-bandwidth floor, timing, and writing results as JSON."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Measured bytes/s of a large memory copy (read + write counted), the floor's denominator."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def write(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def step_programs(family: Any, config: Any, executor: Any, weights: Any, shapes: dict[str, tuple[int, ...]],
                  capacity: int) -> Any:
    """A function tokens -> (prepared program, graph) for steps of one row of `tokens` tokens: the family's
    model traced for that shape and prepared on `executor` over the uploaded `weights`."""
    from poot_core import StepShape, Tracer

    def program(tokens: int) -> tuple[Any, Any]:
        shape = StepShape(1, tokens, capacity)
        tracer = Tracer(shape, shapes)
        family.trace(config, tracer, shape)
        return executor.prepare(tracer.graph, weights), tracer.graph

    return program
