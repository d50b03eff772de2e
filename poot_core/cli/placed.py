"""`--tp N` / `--pp N` / `--tensor-split`: one model over N local processes (or the ranks torchrun started).

Without torchrun, the command spawns N ranks (Coordinator.spawn) that each run the same command as one rank of
a placed Driver; rank 0 prints, the others are silent. Under torchrun (WORLD_SIZE set) this process is already a
rank: it joins the group from the environment. Each rank gets the CPU's cores shared out unless -t is given.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from typing import Any

import numpy as np

from poot_core.errors import RequestError

RANK_TIMEOUT = 300.0  # seconds one collective waits (loading a large model on a slow disk included)
RUN_TIMEOUT = 7 * 24 * 3600.0  # a spawned run is stopped only past this


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several devices (one process per device; torchrun across hosts)")
    g.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallel over N ranks: every layer's heads and MLP split (vLLM's "
                        "--tensor-parallel-size)")
    g.add_argument("--pp", type=int, default=None, metavar="N",
                   help="layer pipeline over N ranks, contiguous layer ranges sized to each device's memory")
    g.add_argument("-ts", "--tensor-split", default=None, metavar="SHARES",
                   help="each rank's share of the layers, e.g. 3,1 (with --pp; llama.cpp's -ts)")
    g.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT, metavar="S",
                   help="seconds a rank waits for the others before failing")


def _ranks(args: argparse.Namespace) -> int | None:
    tp, pp = args.tp, args.pp
    if tp is not None and pp is not None:
        raise RequestError("--tp and --pp are different placements; give one")
    n = tp if tp is not None else pp
    if n is not None and n < 1:
        raise RequestError(f"{'--tp' if tp is not None else '--pp'} must be >= 1, got {n}")
    if args.tensor_split is not None:
        if n is None:
            raise RequestError("--tensor-split shares the layers between ranks; give --pp N (or --tp N) with it")
        try:
            args.split = [float(s) for s in args.tensor_split.split(",")]
        except ValueError:
            raise RequestError(f"--tensor-split takes shares such as 3,1, got {args.tensor_split!r}") from None
        if len(args.split) != n:
            raise RequestError(f"--tensor-split gives {len(args.split)} shares for {n} ranks")
    else:
        args.split = None
    return n


def launch(args: argparse.Namespace) -> int | None:
    """The exit code of a spawned run, or None when this process runs the model (alone, or as a rank)."""
    from poot_core.distributed import Coordinator, Placement

    if getattr(args, "coordinator", None) is not None:
        return None  # a spawned rank
    n = _ranks(args)
    if n is None:
        return None
    if getattr(args, "conversation", False):
        raise RequestError("--conversation reads turns from this terminal; it does not combine with --tp/--pp yet")
    if any(getattr(args, f, None) for f in ("model_draft", "lookup", "mtp")):
        raise RequestError("speculative decoding does not combine with --tp/--pp yet")
    args.placement = Placement.TENSOR if args.tp is not None else Placement.PIPELINE
    if args.threads == -1:
        args.threads = max(1, (os.cpu_count() or 1) // n)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # torchrun started this process as one rank
        if world != n:
            raise RequestError(f"torchrun started {world} ranks and the command asks for {n}")
        args.coordinator = Coordinator.from_env(timeout=args.rank_timeout)
        # leave the group before the interpreter ends: a gloo group still open at exit can abort the process
        # ("terminate called without an active exception") after a run that succeeded
        atexit.register(args.coordinator.close)
        _quiet_unless_first(args.coordinator.rank)
        _shared_seed(args, args.coordinator)
        return None
    _shared_seed(args)
    codes = Coordinator.spawn(n, _rank, args, timeout=RUN_TIMEOUT, collective_timeout=args.rank_timeout)
    return int(codes[0])


def _shared_seed(args: argparse.Namespace, coordinator: Any = None) -> None:
    """A sampling run without a seed gets one here, the same on every rank (rank 0's under torchrun): each rank
    samples the next token itself, so ranks that drew their own seeds would feed the model different tokens."""
    if getattr(args, "temp", 0) <= 0 or (getattr(args, "seed", None) is not None and args.seed >= 0):
        return
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    args.seed = seed if coordinator is None else int(coordinator.broadcast_object(seed, 0))


def _quiet_unless_first(rank: int) -> None:
    if rank:
        devnull = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
        sys.stdout = sys.stderr = devnull


def _rank(coordinator: Any, args: argparse.Namespace) -> int:
    from poot_core.cli.main import _run

    args.coordinator = coordinator
    _quiet_unless_first(coordinator.rank)
    return _run(args)  # a refusal prints as one line (from rank 0) and exits 1, as without ranks


def driver(args: argparse.Namespace, handle: Any, executor: Any, options: Any) -> Any:
    """The Driver for the run: placed over the ranks when there are any."""
    from poot_core import Driver

    coordinator = getattr(args, "coordinator", None)
    if coordinator is None:
        return Driver(handle, executor, options)
    return Driver.placed(handle, coordinator, args.placement, executor, options, split=args.split)


__all__ = ["add_flags", "driver", "launch"]
