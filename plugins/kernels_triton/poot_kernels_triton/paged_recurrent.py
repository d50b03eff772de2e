"""The recurrent ops of a paged serving step (StepShape.paging) on the Triton executor.

Each recurrent layer's state is a pool of slots (Paging.state_slots, [slots, ...] float32 on the device), and the
op's extra inputs are positions, seq_index and state_slots (each sequence slot's pool slot). The step's runs of
tokens of one sequence are found on the host (the engine's inputs are host arrays, so the step runs eagerly) and
each run goes through the contiguous kernel as one row over its own slot, a view updated in place; a run that
starts at position 0 (a new or recomputed sequence) zeroes its slot first. A sequence's arithmetic is then the
one it gets alone in the contiguous layout, whatever shares its step.

Not built: one launch for all decode tokens of a step (each row's slot index read by the kernel) and CUDA graphs
of such steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from poot_core.graph import Node, sequence_runs

if TYPE_CHECKING:
    from .program import Step

Compute = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]


def is_paged(node: Node, state_index: int) -> bool:
    """Whether a recurrent op (its state input at `state_index`) belongs to a paged step."""
    return node.input(state_index + 1) is not None


def per_run(node: Node, state_index: int, values: list[str], compute: Compute) -> Callable[[Step], None]:
    """`compute(values of one run [1, t, ...], its slot's state [1, ...])` for each sequence's run of tokens;
    padding tokens (sequence -1) give zeros."""
    state_name = node.inputs[state_index].name
    pos_name, seq_name, slot_name = (r.name for r in node.inputs[state_index + 1 : state_index + 4])
    out_name, shape = node.output, node.shape

    def run(s: Step) -> None:
        runs = s.cache.get("recurrent_runs")
        if runs is None:  # (slot, first token, end token, whether it starts the sequence), once per step
            slots, starts = s.host[slot_name], s.host[pos_name][0]
            runs = s.cache["recurrent_runs"] = [(int(slots[seq]), t0, t1, int(starts[t0]) == 0)
                                                for seq, t0, t1 in sequence_runs(s.host[seq_name])]
        pool = s.state[state_name]
        vals = [s.env[name] for name in values]
        out = torch.zeros(shape, dtype=torch.float32, device=pool.device)
        for slot, t0, t1, fresh in runs:
            row = pool[slot : slot + 1]
            if fresh:
                row.zero_()
            out[:, t0:t1] = compute([v[:, t0:t1] for v in vals], row)
        s.env[out_name] = out

    return run
