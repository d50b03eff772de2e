"""What `poot generate` and `poot perplexity` share: the flags that pick the device, the context window and
the CPU threads, and loading a model with them.

The context window defaults to 4096 positions (or the model's window if smaller), as llama-cli's does: the
KV cache is allocated for the whole window, so a 128k-window model must not get a 128k cache unasked. On
the CPU, a window whose cache would not fit in the memory the machine has is refused before it is
allocated, with the numbers.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poot_core.errors import CapacityError, RequestError

BACKENDS = ("auto", "cpu", "cuda", "ptx", "rocm", "vulkan", "wgpu", "opencl", "cl")
BACKEND_NAMES = {"ptx": "cuda", "wgpu": "vulkan", "cl": "opencl"}
CPU_STATE_BYTES = 4  # the CPU executor keeps K/V in float32
MIN_BATCH = 256  # -b by default: a prefill step of at least this many tokens


def add_device_flags(p: argparse.ArgumentParser, default_ctx: int) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help=f"context window in positions; 0: the model's own (default: {default_ctx}, or the "
                        "model's window if smaller)")
    p.add_argument("-b", "--batch-size", type=int, default=None, metavar="N",
                   help=f"tokens per prefill step (default: {MIN_BATCH}, or the backend's own step when larger: "
                        "2048 on a GPU)")
    p.add_argument("-t", "--threads", type=int, default=-1, metavar="N",
                   help="CPU threads for decode (default: -1, torch's choice: one per physical core)")
    p.add_argument("-tb", "--threads-batch", type=int, default=None, metavar="N",
                   help="CPU threads for prefill (default: the same as -t)")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="the device to run on")
    p.add_argument("--cpu-activations", choices=("exact", "q8"), default="exact",
                   help="CPU decode from GGUF block weights: exact float32 activations, or q8: activations "
                        "quantized to 8 bits per 32 values with integer products, as llama.cpp (faster, ~1e-2)")
    p.add_argument("-v", "--verbose", "--log-verbose", action="store_true", help="log what the run does to stderr")


def batch_size(args: argparse.Namespace, executor: Any) -> int:
    """-b, or its default for the backend: MIN_BATCH, or the backend's own prefill step when larger."""
    if args.batch_size is not None:
        return int(args.batch_size)
    return max(MIN_BATCH, executor.capabilities().defaults.prefill_chunk)


def load_options(args: argparse.Namespace) -> Any:
    """The LoadOptions the device flags ask for."""
    from poot_core import LoadOptions

    return LoadOptions(cpu_activations=getattr(args, "cpu_activations", "exact"))


def check_device_flags(args: argparse.Namespace) -> None:
    if args.ctx_size is not None and args.ctx_size < 0:
        raise RequestError(f"-c must be >= 0 (0: the model's window), got {args.ctx_size}")
    if args.batch_size is not None and args.batch_size < 1:
        raise RequestError(f"-b must be >= 1, got {args.batch_size}")
    for flag, value in (("-t", args.threads), ("-tb", args.threads_batch)):
        if value is not None and value != -1 and value < 1:
            raise RequestError(f"{flag} must be >= 1 (or -1: torch's choice), got {value}")


def log(args: argparse.Namespace, text: str) -> None:
    if args.verbose:
        print(f"[poot] {text}", file=sys.stderr, flush=True)


def warn(text: str) -> None:
    print(f"poot: warning: {text}", file=sys.stderr, flush=True)


def human(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class Threads:
    """-t for decode, -tb for prefill. The CPU executor's torch ops and C kernels both read
    torch.get_num_threads(), so setting torch's count sets theirs."""

    def __init__(self, decode: int, prefill: int | None) -> None:
        import torch

        self._torch = torch
        default = torch.get_num_threads()
        self.decode = decode if decode > 0 else default
        self.prefill = prefill if prefill is not None and prefill > 0 else self.decode

    def for_prefill(self) -> None:
        if self._torch.get_num_threads() != self.prefill:
            self._torch.set_num_threads(self.prefill)

    def for_decode(self) -> None:
        if self._torch.get_num_threads() != self.decode:
            self._torch.set_num_threads(self.decode)


@dataclass
class Loaded:
    handle: Any
    config: Any
    executor: Any
    driver: Any
    ctx: int
    threads: Threads
    load_seconds: float


def open_device(args: argparse.Namespace) -> Any:
    """The executor --backend names; a named backend whose device is absent is refused here."""
    from poot_core import open_executor

    executor = open_executor(BACKEND_NAMES.get(args.backend, args.backend))
    if executor.name != "cpu" and (args.threads != -1 or args.threads_batch is not None):
        warn(f"-t/-tb set the CPU's threads; the {executor.name} backend computes on its device")
    return executor


def choose_context(args: argparse.Namespace, window: int, default_ctx: int) -> int:
    if args.ctx_size is None:
        return min(default_ctx, window)
    if args.ctx_size == 0:
        return window
    if args.ctx_size > window:
        raise CapacityError(f"-c {args.ctx_size} is larger than the model's window of {window} positions; "
                            f"give -c {window} or less (-c 0 takes the whole window)")
    return args.ctx_size


def state_values(handle: Any, config: Any, ctx: int) -> int | None:
    """Values the decode step's state (the KV cache) holds for `ctx` positions, read from the traced step;
    None when the step does not trace (the driver then refuses it with the reason)."""
    from poot_core import StepShape, Tracer

    shape = StepShape(1, 1, ctx)
    tracer = Tracer(shape, handle.store().shapes())
    try:
        handle.family.trace(config, tracer, shape)
    except KeyError:
        return None
    return sum(math.prod(spec.shape) for spec in tracer.graph.state.values())


def check_memory(args: argparse.Namespace, model: Path, executor: Any, handle: Any, config: Any, ctx: int) -> None:
    """Show the KV cache's size under -v and, on the CPU, refuse a window whose cache would not fit."""
    values = state_values(handle, config, ctx)
    if values is None:
        return
    if executor.name != "cpu":  # GPU executors choose the cache's type and check their memory when allocating
        log(args, f"KV cache: {values} values for {ctx} positions")
        return
    from poot_core.cli.progress import checkpoint_files

    kv = values * CPU_STATE_BYTES
    weights = sum(f.stat().st_size for f in checkpoint_files(model))
    free = int(executor.memory()["free"])
    log(args, f"KV cache: {human(kv)} for {ctx} positions (float32); weights {human(weights)}; "
              f"{human(free)} of memory available")
    if kv + weights > free:
        per_position = max(kv // ctx, 1)
        fits = max((free - weights) // per_position, 0)
        raise CapacityError(f"-c {ctx} needs a KV cache of {human(kv)} ({human(per_position)} per position, "
                            f"float32) beside {human(weights)} of weights, and this machine has {human(free)} "
                            f"available; give -c {fits} or less")


def load(args: argparse.Namespace, model: Path, *, default_ctx: int, logits: bool = False,
         draft: Any = None) -> Loaded:
    """Open the device, load the checkpoint and prepare the driver for the chosen window (and `draft`, a
    DraftPolicy, for speculative decoding)."""
    from poot_core import DriverOptions, ModelHandle
    from poot_core.cli import placed
    from poot_core.cli.progress import warm_with_progress

    t0 = time.perf_counter()
    executor = open_device(args)
    threads = Threads(args.threads, args.threads_batch)
    threads.for_prefill()
    warm_with_progress(model)
    handle = ModelHandle.load(model, options=load_options(args))
    config = handle.config()
    if config.kind == "encoder":
        raise RequestError(f"{model} is an encoder model ({config.architecture}): it gives embeddings, not text; "
                           "use `poot embed`")
    ctx = choose_context(args, config.max_positions, default_ctx)
    log(args, f"model {model} ({config.family}, {config.architecture}); backend {executor.name}; context {ctx} "
              f"of the model's {config.max_positions}; threads {threads.decode} (prefill {threads.prefill})")
    check_memory(args, model, executor, handle, config, ctx)
    options = DriverOptions(capacity=ctx, prefill_chunk=min(batch_size(args, executor), ctx))
    if draft is not None:
        options.draft = draft
    driver = placed.driver(args, handle, executor, options)  # placed over --tp/--pp ranks when there are any
    if not logits:
        driver.serve()
    seconds = time.perf_counter() - t0
    log(args, f"loaded in {seconds:.2f} s")
    return Loaded(handle, config, executor, driver, ctx, threads, seconds)
