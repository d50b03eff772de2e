"""Host arrays to the device without waiting for it.

A plain copy of a pageable numpy array to a GPU makes torch wait until the stream is idle (every step queued
before it has run) before it returns. A serving step is built while the step before it still runs on the device
(the engine's steps ahead), so its inputs go through pinned memory and an asynchronous copy instead: the call
returns at once and the copy runs in stream order; torch's pinned allocator keeps the staging buffer until the
copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 copy of `array` on `device`, queued on the current stream (on the CPU: a view of the array)."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["to_device"]
