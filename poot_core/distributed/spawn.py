"""Local runs: n processes on one machine, a free TCP port for their rendezvous, results back in rank order.

The parent never waits without a bound: a rank that raises reports its error, a rank that dies (no report, a
non-zero exit code) is named, and the whole run is stopped after `timeout` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from poot_core.distributed.failures import RankFailure


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world: int, port: int, out: Any,
               collective_timeout: float, threads: int | None, backend: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        from poot_core.distributed.coordinator import Coordinator

        coordinator = Coordinator.from_env(timeout=collective_timeout, backend=backend)
        try:
            result = fn(coordinator, *args)
        finally:
            coordinator.close()
        out.put((rank, True, result))
    except BaseException as exc:  # reported to the parent, which names it; the process then exits 1
        tail = "".join(traceback.format_exception(exc)[-3:]).strip()
        out.put((rank, False, f"{type(exc).__name__}: {exc}\n{tail}"))
        raise SystemExit(1) from None


STOP_GRACE = 10.0  # seconds the other ranks get to end after rank 0 did, once a SIGTERM came


def _forward_sigterm(first: Any, received: list[float]) -> Any:
    """While the ranks run, a SIGTERM to this process goes to rank 0 instead (a server there drains and tells the
    others to stop) rather than ending this process and leaving the ranks behind; its time goes into `received`.
    Returns the handler it replaced (None off the main thread, where none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        received.append(time.monotonic())
        if first.is_alive() and first.pid is not None:
            os.kill(first.pid, signal.SIGTERM)

    return signal.signal(signal.SIGTERM, handler)


def spawn(n: int, fn: Callable[..., Any], args: tuple[Any, ...], *, timeout: float, collective_timeout: float,
          threads: int | None = None, backend: str | None = None) -> list[Any]:
    if n < 1:
        raise ValueError(f"spawn needs at least one rank, got {n}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, n, port, out, collective_timeout, threads, backend),
                         daemon=True, name=f"poot-rank-{r}") for r in range(n)]
    for p in procs:
        p.start()
    sigterm: list[float] = []
    forward = _forward_sigterm(procs[0], sigterm)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    silent_exit: dict[int, float] = {}  # rank -> when it was first seen exited without a report
    first_gone = 0.0  # when rank 0 was first seen exited after a SIGTERM
    try:
        while len(results) + len(errors) < n and time.monotonic() < deadline:
            try:
                rank, ok, payload = out.get(timeout=0.2)
                (results if ok else errors)[rank] = payload
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            if sigterm and procs[0].exitcode is not None:
                first_gone = first_gone or now
                if now - first_gone > STOP_GRACE:  # stopped by SIGTERM: rank 0 is gone and the others had their
                    break  # time (a run that is not a server does not tell them; they would wait out a timeout)
            for r, p in enumerate(procs):
                if r in results or r in errors or p.exitcode is None:
                    continue
                # a report may still be in the pipe for a moment after the exit
                if now - silent_exit.setdefault(r, now) > 1.0:
                    errors[r] = f"exited with code {p.exitcode} without a result"
    finally:
        if forward is not None:
            signal.signal(signal.SIGTERM, forward)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
    for r in range(n):
        if r not in results and r not in errors:
            errors[r] = f"did not finish within {timeout:g} s (stopped)"
    if errors:
        lines = [f"rank {r}: {errors[r]}" for r in sorted(errors)]
        raise RankFailure(f"{len(errors)} of {n} ranks failed:\n" + "\n".join(lines), results=results)
    return [results[r] for r in range(n)]


__all__ = ["free_port", "spawn"]
