"""Where a serving run's wall time goes on the GPU: a torch profiler timeline of the engine's steps, reduced to the
device's busy time, the gaps in which it waits for the host, and the host work that was running in each gap.

Used by `bench/gpu_serve.py --timeline`; the reduction (`reduce`) takes plain intervals so it is tested without a GPU.
The engine's own methods are wrapped in profiler ranges for the run only (instance attributes, removed after).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The engine's host work, by the attribute that holds it: (owner path from the engine, method name).
WRAPPED = (
    ("", "_launch"), ("", "_inputs"), ("", "_sample"), ("", "_emit_all"), ("", "program"), ("", "_collect"),
    ("scheduler", "schedule"), ("ahead", "launch"), ("ahead", "settle"),
    ("ahead.executor", "greedy_ids"), ("ahead.executor", "read_ids"), ("ahead.executor", "run_fed"),
    ("driver.executor", "run"),
)
STEP = "engine.step"
# CUDA runtime calls in which the host waits for the device: a gap inside one is the host waiting, not working
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
# and the calls that put work on the device: a gap inside one is the cost of launching
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC")


@dataclass(frozen=True)
class Span:
    name: str
    start: int  # nanoseconds
    end: int


def _owner(engine: Any, path: str) -> Any:
    obj = engine
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
    return obj


@contextlib.contextmanager
def wrapped(engine: Any) -> Iterator[None]:
    """The engine's methods in WRAPPED, each inside a profiler range named after it, while the block runs."""
    import torch

    undo: list[tuple[Any, str]] = []

    def wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)
        return inner

    for path, name in WRAPPED:
        owner = _owner(engine, path)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None or name in vars(owner):
            continue
        setattr(owner, name, wrap(fn, f"{path or 'engine'}.{name}"))
        undo.append((owner, name))
    try:
        yield
    finally:
        for owner, name in undo:
            delattr(owner, name)


def record(engine: Any, requests: list[Any]) -> tuple[list[Span], list[Span], int]:
    """Submit `requests`, step the engine until they end under the profiler: (device spans, host ranges, steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for r in requests:
        engine.submit(r)
    steps = 0
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with wrapped(engine), profile(activities=activities) as prof:
        while engine.in_flight:
            with torch.profiler.record_function(STEP):
                engine.step()
            steps += 1
        sync()
    device, host = [], []
    names = {STEP} | {f"{p or 'engine'}.{n}" for p, n in WRAPPED}
    for ev in prof.profiler.kineto_results.events():
        start = _field(ev, "start_ns")
        span = Span(str(_field(ev, "name")), start, start + _field(ev, "duration_ns"))
        if span.name in names:  # the profiler mirrors each range onto the device's timeline too: host work
            if "CUDA" not in str(_field(ev, "device_type")):
                host.append(span)
        elif "CUDA" in str(_field(ev, "device_type")):
            device.append(span)
        elif span.name.startswith(WAITS + LAUNCHES):
            host.append(span)
    return device, host, steps


def _field(ev: Any, name: str) -> Any:
    """A kineto event's field: a method in some torch versions, a plain attribute in others."""
    value = getattr(ev, name)
    return value() if callable(value) else value


def busy(spans: list[Span]) -> list[tuple[int, int]]:
    """The union of the spans' intervals, in order."""
    out: list[tuple[int, int]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], s.end))
        else:
            out.append((s.start, s.end))
    return out


def reduce(device: list[Span], host: list[Span], steps: int, min_gap_us: float = 20.0) -> dict[str, Any]:
    """The timeline in figures: the window from the first step's start to the last one's end, the device's busy
    time in it, its idle gaps longer than `min_gap_us`, and each gap's time given to the innermost host range
    running at the gap's middle (none: "outside the engine's ranges")."""
    stepped = [h for h in host if h.name == STEP]
    if not stepped:
        return {"error": "no step ranges recorded"}
    lo, hi = min(h.start for h in stepped), max(h.end for h in stepped)
    intervals = [(max(a, lo), min(b, hi)) for a, b in busy(device) if b > lo and a < hi]
    busy_ns = sum(b - a for a, b in intervals)
    inner = sorted(host, key=lambda h: h.start)
    starts = [h.start for h in inner]
    gaps: dict[str, list[float]] = {}
    edges = [lo] + [x for ab in intervals for x in ab] + [hi]
    for a, b in zip(edges[0::2], edges[1::2], strict=True):
        if (b - a) / 1e3 < min_gap_us:
            continue
        mid = (a + b) // 2
        # the ranges nest, so the latest-starting one that holds the middle is the innermost
        i = bisect.bisect_right(starts, mid) - 1
        while i >= 0 and inner[i].end < mid:
            i -= 1
        label = inner[i].name if i >= 0 else "outside the engine's ranges"
        gaps.setdefault(label, []).append((b - a) / 1e3)
    host_ms: dict[str, float] = {}
    calls: dict[str, int] = {}
    for h in host:
        host_ms[h.name] = host_ms.get(h.name, 0.0) + (h.end - h.start) / 1e6
        calls[h.name] = calls.get(h.name, 0) + 1
    kernels: dict[str, float] = {}
    for d in device:
        kernels[d.name[:80]] = kernels.get(d.name[:80], 0.0) + (d.end - d.start) / 1e6
    gap_ms = {k: round(sum(v) / 1e3, 3) for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))}
    return {
        "steps": steps, "window_ms": round((hi - lo) / 1e6, 3), "device_busy_ms": round(busy_ns / 1e6, 3),
        "idle_ms": round((hi - lo - busy_ns) / 1e6, 3),
        "gaps_over_min_ms": gap_ms, "gap_counts": {k: len(v) for k, v in gaps.items()},
        "host_inclusive_ms": {k: round(v, 3) for k, v in sorted(host_ms.items(), key=lambda kv: -kv[1])},
        "host_calls": calls, "device_spans": len(device),
        "top_kernels_ms": {k: round(v, 3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]},
    }
