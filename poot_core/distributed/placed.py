"""Driver.placed: the plan agreed by every rank (each device's free memory gathered first), then a Driver over
the rank's PlacedExecutor."""

from __future__ import annotations

from typing import Any

import torch

from poot_core.distributed.capacity import Planner, Target
from poot_core.distributed.coordinator import Coordinator
from poot_core.distributed.executor import PlacedExecutor
from poot_core.distributed.placement import Placement
from poot_core.errors import Reason, Unsupported


def targets(coordinator: Coordinator, executor: Any) -> list[Target]:
    """Every rank's device and free memory, the same list on every rank."""
    free = torch.zeros(coordinator.world, dtype=torch.int64)
    free[coordinator.rank] = int(executor.memory()["free"])
    coordinator.all_reduce(free)
    return [Target(f"rank {r} ({executor.name})", int(free[r])) for r in range(coordinator.world)]


def place(cls: Any, handle: Any, coordinator: Coordinator, placement: Placement, executor: Any, options: Any,
          split: list[float] | None) -> Any:
    from poot_core.driver.core import DriverOptions
    from poot_core.driver.speculation import DraftPolicy
    from poot_core.executor import open_executor

    options = options or DriverOptions()
    if options.draft is not DraftPolicy.OFF:
        raise Unsupported(Reason.SHAPE, "speculative decoding on a placed model",
                          "drafts are not placed over several devices yet; use DraftPolicy.OFF")
    executor = executor if executor is not None else open_executor("auto")
    plan = Planner(handle, targets(coordinator, executor), Placement(placement), context=options.capacity,
                   split=split).plan()
    return cls(handle, PlacedExecutor(executor, handle, coordinator, placement, plan), options)


__all__ = ["place", "targets"]
