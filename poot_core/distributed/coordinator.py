"""The Coordinator: one process per device over torch.distributed (gloo on CPUs, NCCL on GPUs).

`Coordinator.from_env()` joins the group the environment names (env:// rendezvous: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), which is what `torchrun` sets, across hosts too; `Coordinator.spawn(n, fn)` starts n local
processes on a free TCP port and runs fn(coordinator, ...) in each (spawn.py).

Every collective waits at most `timeout` seconds: a rank that died or stopped makes the others raise a
RankFailure naming the collective, instead of hanging. Graph ops (all_reduce, all_gather) reach the coordinator
by the key in their attributes (`group(key)`), so a prepared program holds no process group itself.

Tensors may live on any device: NCCL sums GPU tensors where they are, gloo sums CPU tensors, and a tensor on the
other kind of device goes through a copy. Inside a CUDA graph capture a collective is launched without the
timed host wait (a captured graph cannot wait on the host; NCCL's own watchdog still bounds it).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from poot_core.distributed.failures import RankFailure

DEFAULT_TIMEOUT = 60.0  # seconds any one collective may wait for the other ranks

_GROUPS: dict[str, Coordinator] = {}


def group(key: str) -> Coordinator:
    """The coordinator a graph op's `group` attribute names, in this process."""
    found = _GROUPS.get(key)
    if found is None:
        raise RankFailure(f"no coordinator {key!r} in this process: a placed program runs only inside the ranks "
                          "of the Coordinator it was placed over", op="group")
    return found


class Coordinator:
    """This process's place in a group of `world` ranks. Collectives act on CPU tensors under gloo (on the
    device's tensors under NCCL) and return their result."""

    def __init__(self, rank: int, world: int, timeout: float = DEFAULT_TIMEOUT, key: str = "world",
                 joined: bool = False) -> None:
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.key = key
        # collectives go through torch.distributed: several ranks, or one rank that joined a group on purpose
        # (a one-rank NCCL group runs the same calls as many ranks do)
        self.joined = world > 1 or joined
        _GROUPS[key] = self

    # --- joining and leaving -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, timeout: float = DEFAULT_TIMEOUT, backend: str | None = None) -> Coordinator:
        """Join the group named by the environment (torchrun's variables); one rank alone needs none unless a
        backend is named (then even one rank joins, and its collectives are real calls)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        joined = world > 1 or backend is not None
        if joined and not dist.is_initialized():
            chosen = backend or ("nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo")
            try:
                dist.init_process_group(chosen, init_method="env://", rank=rank, world_size=world,
                                        timeout=timedelta(seconds=timeout))
            except Exception as exc:  # the rendezvous timed out or the address is wrong
                raise RankFailure(f"rank {rank} of {world} could not join the group at "
                                  f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: {exc}",
                                  rank=rank, op="init") from exc
        return cls(rank, world, timeout, joined=joined)

    @staticmethod
    def spawn(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              collective_timeout: float = DEFAULT_TIMEOUT, threads: int | None = None,
              backend: str | None = None) -> list[Any]:
        """Run fn(coordinator, *args) in n new local processes; their results in rank order. A rank that raises
        or dies, or a run past `timeout` seconds, is a RankFailure naming each rank's outcome. `backend`: the
        process group's ("gloo" for ranks on the CPU executor of a machine that has GPUs; default as from_env)."""
        from poot_core.distributed.spawn import spawn

        return spawn(n, fn, args, timeout=timeout, collective_timeout=collective_timeout, threads=threads,
                     backend=backend)

    def close(self) -> None:
        _GROUPS.pop(self.key, None)
        if self.joined and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    # --- where collectives run ------------------------------------------------------------------------
    @property
    def on_gpu(self) -> bool:
        """Whether collectives act on GPU tensors where they are (NCCL); else on CPU tensors (gloo)."""
        return self.joined and dist.is_initialized() and dist.get_backend() == "nccl"

    @property
    def device(self) -> torch.device:
        """Where this group's collective buffers live."""
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        """x itself when the group's backend takes it where it is, else a contiguous copy on the group's device."""
        return x if x.device.type == self.device.type and x.is_contiguous() else x.to(self.device).contiguous()

    # --- collectives ---------------------------------------------------------------------------------
    def _wait(self, op: str, start: Callable[..., Any]) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            start(False)  # recorded into the graph: launched in stream order, no host wait
            return
        t0 = time.monotonic()
        try:
            work = start(True)
            if work is not None:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:  # gloo/NCCL: a lost peer, or nobody answered within the timeout
            raise RankFailure(f"rank {self.rank} of {self.world}: {op} failed after {time.monotonic() - t0:.1f} s "
                              f"(timeout {self.timeout:g} s): another rank died or stopped answering "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                              rank=self.rank, op=op) from exc

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x is overwritten with it and returned)."""
        if self.joined:
            buf = self._wire(x)
            self._wait("all_reduce", lambda on: dist.all_reduce(buf, async_op=on))
            if buf is not x:
                x.copy_(buf)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The ranks' x joined along the last axis; rank r's x has sizes[r] entries there."""
        if not self.joined:
            return x
        widest = max(sizes)
        padded = self._wire(x if x.shape[-1] == widest else torch.nn.functional.pad(x, (0, widest - x.shape[-1])))
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self._wait("all_gather", lambda on: dist.all_gather(parts, padded, async_op=on))
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1).to(x.device)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """src's x on every rank (x is overwritten with it and returned)."""
        if self.joined:
            buf = self._wire(x)
            self._wait(f"broadcast from rank {src}", lambda on: dist.broadcast(buf, src, async_op=on))
            if buf is not x:
                x.copy_(buf)
        return x

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """src's picklable `obj` on every rank (the others pass anything): its length, then its bytes."""
        if not self.joined:
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast(torch.tensor([len(data)], dtype=torch.int64), src)
        mine = self.rank == src
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(int(size[0]),
                                                                                             dtype=torch.uint8)
        buf = self.broadcast(buf, src)
        return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())  # noqa: S301 - from our own rank 0

    def send(self, x: torch.Tensor, dst: int) -> None:
        buf = self._wire(x)
        self._wait(f"send to rank {dst}", lambda on: dist.isend(buf, dst) if on else dist.send(buf, dst))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """The tensor rank `src` sends, on this group's device (the CPU under gloo)."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(f"receive from rank {src}", lambda on: dist.irecv(x, src) if on else dist.recv(x, src))
        return x

    def barrier(self) -> None:
        if self.joined:
            self._wait("barrier", lambda on: dist.barrier(async_op=True))


__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "group"]
