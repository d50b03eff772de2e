"""The serving engine's own host time per step, with the device's work taken away: an executor that computes
nothing (its programs return at once and its greedy picks are seeded random ids) runs the engine over SmolLM2's
real tokenizer and graphs, so what is timed is scheduling, building the step's inputs, tracing new bucket
shapes, picking and detokenizing, stops and events: the time a GPU waits between steps when this work is on its
critical path (on the H200, about 2.8 s of a 10.9 s run of 256 x (1024 + 128) went there).

  python bench/engine_host.py [--requests 256] [--prompt 1024] [--new 128] [--step-tokens 2048] [--profile]
                              [--device-ms 10]

--device-ms D simulates a device: a step's run() returns at once and reading its output blocks until D ms of
device time have passed (steps queue behind each other, as on one stream; a timer thread marks each done). The
workload then runs three times: in the old order (engine.pipeline = False: read, detokenize, schedule, launch),
pipelined (engine.ahead.on = False: read, schedule, launch, detokenize) and ahead (the default: the next step
launched before the ids of the one in flight are read, its tokens fed on the device; driver/ahead.py), printing
the wall times beside host + device and max(host, device).

Prints the whole run's host seconds, the mean host time of a decode step and of a step with prefill chunks,
and beside them the device time of the same steps measured on the H200 (the floor this host time should stay
well under); --profile prints the engine's top functions by own time. Writes bench/results/engine_host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import common  # noqa: E402
from helpers import smollm  # noqa: E402
from poot_core import (  # noqa: E402
    Capabilities,
    Driver,
    DriverOptions,
    GenerateRequest,
    Layout,
    ModelHandle,
    RunDefaults,
)

# Device time of a step on the H200 (bench/gpu_serve.py --profile, Llama-3-8B shape, bf16; NOTES.md, issue 16)
H200_DECODE_256_MS = 22.1  # a decode step of 256 sequences at 1088 positions
H200_PREFILL_2048_MS = 41.3  # a step of two 1024-token prefill chunks


class _Idle:
    """The output of a step that computed nothing: how many sequence slots it had, and when the simulated
    device is done with it (set at once without a simulated device)."""

    def __init__(self, slots: int, ready: threading.Event) -> None:
        self.slots = slots
        self.ready = ready


class _Device:
    """A simulated device of one stream: each step takes `seconds` after the one before it is done."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.busy_until = 0.0
        self.busy = 0.0  # total simulated device seconds

    def launch(self) -> threading.Event:
        ready = threading.Event()
        if self.seconds <= 0:
            ready.set()
            return ready
        now = time.perf_counter()
        self.busy_until = max(now, self.busy_until) + self.seconds
        self.busy += self.seconds
        timer = threading.Timer(self.busy_until - now, ready.set)
        timer.daemon = True
        timer.start()
        return ready


class _IdleProgram:
    def __init__(self, slots: int, device: _Device) -> None:
        self.slots = slots
        self.device = device

    def run(self, state: Any, inputs: dict[str, np.ndarray]) -> list[Any]:
        return [_Idle(self.slots, self.device.launch())]  # returns at once; reading the output waits


class IdleExecutor:
    """Every protocol method the serving engine calls, doing no arithmetic."""

    name = "idle"

    def __init__(self, vocab: int, defaults: RunDefaults, seed: int = 0, device_seconds: float = 0.0) -> None:
        self.vocab = vocab
        self.defaults = defaults
        self.rng = np.random.default_rng(seed)
        self.device = _Device(device_seconds)

    def capabilities(self) -> Capabilities:
        return Capabilities(frozenset(), frozenset(), layouts=frozenset({"contiguous", "paged"}),
                            defaults=self.defaults)

    def upload(self, store: Any) -> None:
        return None

    def prepare(self, graph: Any, weights: Any) -> _IdleProgram:
        return _IdleProgram(graph.shape.paging.seqs if graph.shape.paging else 1, self.device)

    def allocate_state(self, graph: Any) -> dict:
        return {}

    def copy_state_rows(self, state: Any, src_row: int, dst_row: int, length: int) -> None:
        pass

    def memory(self) -> dict[str, int]:
        return {"total": 1 << 40, "free": 1 << 40}

    def to_numpy(self, value: _Idle) -> np.ndarray:
        value.ready.wait()
        return np.zeros((1, value.slots, self.vocab), dtype=np.float32)

    def greedy_rows(self, value: _Idle) -> np.ndarray:
        value.ready.wait()
        return self.rng.integers(100, self.vocab, value.slots)

    def greedy_ids(self, value: _Idle) -> _Idle:  # steps ahead (poot_core.executor.FedSteps)
        return value

    def read_ids(self, value: _Idle) -> np.ndarray:
        return self.greedy_rows(value)

    def run_fed(self, program: _IdleProgram, state: Any, inputs: dict[str, np.ndarray], ids: _Idle,
                at: np.ndarray, rows: np.ndarray) -> list[Any]:
        return program.run(state, inputs)


def _timed(engine: Any, requests: list[GenerateRequest], profile: bool) -> tuple[float, dict[str, list[float]]]:
    """Run the requests to their end; the wall seconds and each step's wall and CPU seconds, by kind."""
    step_times: dict[str, list[float]] = {"decode": [], "prefill": [], "decode_cpu": [], "prefill_cpu": []}
    submitted = [engine.submit(r) for r in requests]
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    finished = 0
    while finished < len(submitted):
        # pending 0: in flight (pipelined or ahead), its token not read yet
        decode = not engine.scheduler.waiting and all(s.pending <= 1 for s in engine.scheduler.running)
        s0, c0 = time.perf_counter(), time.thread_time()
        events = engine.step()
        kind = "decode" if decode else "prefill"
        step_times[kind].append(time.perf_counter() - s0)
        step_times[kind + "_cpu"].append(time.thread_time() - c0)  # this thread's CPU time: less load-bound
        finished += sum(1 for e in events if type(e).__name__ == "FinishedEvent")
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - t0
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return seconds, step_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--step-tokens", type=int, default=2048, help="the step budget (the GPU's default: 2048)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device-ms", type=float, default=0.0, help="simulated device time a step (0: none)")
    args = ap.parse_args()

    handle = ModelHandle.load(smollm.gguf_path())
    vocab = handle.config().vocab_size
    defaults = RunDefaults(prefill_chunk=args.step_tokens, step_tokens=args.step_tokens,
                           max_running=args.requests, kv_fraction=0.8)
    capacity = args.prompt + args.new
    options = DriverOptions(capacity=capacity, kv_blocks=args.requests * -(-capacity // 16))
    executor = IdleExecutor(vocab, defaults)
    engine = Driver(handle, executor, options).serve(Layout.PAGED)
    rng = np.random.default_rng(1)

    def requests() -> list[GenerateRequest]:
        return [GenerateRequest(rng.integers(100, vocab, args.prompt).tolist(), max_new=args.new, ignore_eos=True)
                for _ in range(args.requests)]

    engine.generate_batch(requests())  # traces every bucket shape once, as a server's first requests do
    if args.device_ms <= 0:
        seconds, step_times = _timed(engine, requests(), args.profile)
    else:
        executor.device.seconds = args.device_ms / 1000
        walls, steps = {}, {}
        for order, pipeline, ahead in (("old order", False, False), ("pipelined", True, False), ("ahead", True, True)):
            engine.pipeline, engine.ahead.on = pipeline, ahead
            executor.device.busy, first = 0.0, engine.steps
            walls[order], _ = _timed(engine, requests(), False)
            device, steps[order] = executor.device.busy, engine.steps - first
        executor.device.seconds = 0.0
        seconds, step_times = _timed(engine, requests(), args.profile)  # host time alone
        print(f"simulated device {args.device_ms} ms a step, {device:.2f} s in all; host alone {seconds:.2f} s; "
              f"host + device {seconds + device:.2f} s, max {max(seconds, device):.2f} s")
        print("  wall: " + "; ".join(f"{order} {walls[order]:.2f} s ({steps[order]} steps)" for order in walls))
    def mean_ms(kind: str) -> float:
        return 1000 * float(np.mean(step_times[kind])) if step_times[kind] else 0.0

    decode_ms, prefill_ms = mean_ms("decode"), mean_ms("prefill")
    print(f"engine host time, {args.requests} x ({args.prompt} + {args.new}), step budget {args.step_tokens}: "
          f"{seconds:.2f} s over {len(step_times['decode']) + len(step_times['prefill'])} steps")
    print(f"  decode step   {decode_ms:7.2f} ms host, {mean_ms('decode_cpu'):.2f} ms CPU   "
          f"(H200 device time of a 256-sequence decode step: {H200_DECODE_256_MS} ms)")
    print(f"  prefill step  {prefill_ms:7.2f} ms host, {mean_ms('prefill_cpu'):.2f} ms CPU   "
          f"(H200 device time of a 2 x 1024 chunk step: {H200_PREFILL_2048_MS} ms)")
    extra = {} if args.device_ms <= 0 else {"device_ms": args.device_ms, "device_seconds": device,
                                            "wall_old_order": walls["old order"],
                                            "wall_pipelined": walls["pipelined"], "wall_ahead": walls["ahead"]}
    common.write("engine_host", {"requests": args.requests, "prompt": args.prompt, "new": args.new,
                                 "step_tokens": args.step_tokens, "seconds": seconds,
                                 "decode_steps": len(step_times["decode"]), "decode_ms": decode_ms,
                                 "decode_cpu_ms": mean_ms("decode_cpu"), "prefill_cpu_ms": mean_ms("prefill_cpu"),
                                 "prefill_steps": len(step_times["prefill"]), "prefill_ms": prefill_ms,
                                 "h200_decode_256_ms": H200_DECODE_256_MS,
                                 "h200_prefill_2048_ms": H200_PREFILL_2048_MS, **extra})


if __name__ == "__main__":
    main()
