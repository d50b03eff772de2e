"""The recurrent ops of a paged serving step (StepShape.paging) on the Triton executor.

Each recurrent layer's state is a pool of slots (Paging.state_slots, [slots, ...] float32 on the device), and the
op's extra inputs are positions, seq_index and state_slots (each sequence slot's pool slot).

Decode tokens (a sequence's run of one token) go through one launch per op for all of them: the step kernels
of recurrent.py with a PagedRows, one program per row and head, each reading its sequence's slot index on the
device and updating that slot in place (a padding row writes nothing, a row at position 0 starts from zeros).
A step of decode tokens only (Paging.decode: token i in sequence slot i) then reads nothing on the host, so the
executor replays it as a CUDA graph like a dense decode step.

A mixed step's runs are found on the host (its inputs are host arrays; the step runs eagerly): its decode tokens
are gathered into the one launch above, and each longer run (a prefill chunk) goes through the contiguous kernel
as one row over its own slot, a view updated in place, zeroed first when the run starts at position 0. Either
way a sequence's arithmetic is the one it gets alone in the contiguous layout, whatever shares its step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from poot_core.graph import Node, sequence_runs

from .recurrent import PagedRows

if TYPE_CHECKING:
    from .program import Step

# compute(values [R, t, ...], state, paged): state is one row's slot [1, ...] (paged None) or the whole pool
# (paged: the rows' sequences and positions, t = 1)
Compute = Callable[[list[torch.Tensor], torch.Tensor, PagedRows | None], torch.Tensor]


def is_paged(node: Node, state_index: int) -> bool:
    """Whether a recurrent op (its state input at `state_index`) belongs to a paged step."""
    return node.input(state_index + 1) is not None


def bind(node: Node, state_index: int, values: list[str], compute: Compute,
         decode_only: bool) -> Callable[[Step], None]:
    """The op over a paged step; decode_only (Paging.decode): one launch over every token, nothing read on the
    host. Padding tokens (sequence -1) give zeros."""
    state_name = node.inputs[state_index].name
    pos_name, seq_name, slot_name = (r.name for r in node.inputs[state_index + 1 : state_index + 4])
    out_name, shape = node.output, node.shape

    def run_decode(s: Step) -> None:
        rows = PagedRows(s.env[seq_name], s.env[slot_name], s.env[pos_name][0])
        y = compute([s.env[name][0].unsqueeze(1) for name in values], s.state[state_name], rows)
        s.env[out_name] = y.reshape(shape)

    def run_mixed(s: Step) -> None:
        plan = s.cache.get("recurrent_runs")
        if plan is None:  # once per step: every recurrent op of the step shares it
            plan = s.cache["recurrent_runs"] = _plan(s, pos_name, seq_name, slot_name)
        decode, rows, runs = plan
        pool = s.state[state_name]
        vals = [s.env[name] for name in values]
        out = torch.zeros(shape, dtype=torch.float32, device=pool.device)
        if decode is not None:
            out[0, decode] = compute([v[0, decode].unsqueeze(1) for v in vals], pool, rows)[:, 0]
        for slot, t0, t1, fresh in runs:
            row = pool[slot : slot + 1]
            if fresh:
                row.zero_()
            out[:, t0:t1] = compute([v[:, t0:t1] for v in vals], row, None)
        s.env[out_name] = out

    return run_decode if decode_only else run_mixed


def _plan(s: Step, pos_name: str, seq_name: str, slot_name: str
          ) -> tuple[torch.Tensor | None, PagedRows | None, list[tuple[int, int, int, bool]]]:
    """A mixed step's split: its decode tokens (their indices on the device and their PagedRows, or None) and
    its longer runs (slot, first token, end token, whether it starts the sequence)."""
    slots, starts = s.host[slot_name], s.host[pos_name][0]
    singles: list[int] = []
    runs = []
    for seq, t0, t1 in sequence_runs(s.host[seq_name]):
        if t1 - t0 == 1:
            singles.append(t0)
        else:
            runs.append((int(slots[seq]), t0, t1, int(starts[t0]) == 0))
    if not singles:
        return None, None, runs
    device = s.env[seq_name].device
    index = torch.from_numpy(np.asarray(singles, dtype=np.int64)).to(device)
    rows = PagedRows(s.env[seq_name][index], s.env[slot_name], s.env[pos_name][0, index])
    return index, rows, runs
