"""Several devices: one model over a Coordinator of ranks (torch.distributed: gloo on CPUs, NCCL on GPUs).

  coordinator.py   Coordinator: the ranks, collectives with a timeout (RankFailure instead of a hang)
  spawn.py         Coordinator.spawn: n local processes on a free TCP port (torchrun: Coordinator.from_env)
  placement.py     Placement.TENSOR (Megatron split) / Placement.PIPELINE (contiguous layer ranges)
  capacity.py      Planner(handle, targets, placement): each device fitted to its free memory, or refused
  shards.py        a rank's weights: what its share reads, split slices in their stored layout
  executor.py      PlacedExecutor: the rank's executor, preparing the rank's share of each traced step
  placed.py        Driver.placed
The graph passes live in poot_core.graph (pipeline.py: the layer stages; tensor_parallel.py: the split) and the
collectives are graph ops (all_reduce, all_gather) with a handler per backend.
"""

from poot_core.distributed.capacity import Plan, Planner, Target
from poot_core.distributed.coordinator import Coordinator
from poot_core.distributed.failures import RankFailure
from poot_core.distributed.placement import Placement

__all__ = ["Coordinator", "Placement", "Plan", "Planner", "RankFailure", "Target"]
