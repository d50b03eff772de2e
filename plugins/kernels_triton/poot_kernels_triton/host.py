"""Host arrays to the device, and ids back from it, without waiting for the stream.

A plain copy of a pageable numpy array to a GPU makes torch wait until the stream is idle (every step queued
before it has run) before it returns. A serving step is built while the step before it still runs on the device
(the engine's steps ahead), so its inputs go through pinned memory and an asynchronous copy instead: the call
returns at once and the copy runs in stream order; torch's pinned allocator keeps the staging buffer until the
copy has run.

The other way, a plain copy of ids to the host waits for everything queued on the stream, the next step too when
it was launched ahead (the engine launches it before it reads these ids): DeviceIds queues the copy into pinned
memory right behind the kernels that compute the ids, and reading waits for that copy alone.
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


class DeviceIds:
    """Ids computed on the device (`device`) and their copy to the host, queued behind the kernels before it."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.device = ids
        self._ready: torch.cuda.Event | None = None
        if ids.device.type == "cpu":
            self._host = ids
            return
        self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        self._host.copy_(ids, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(ids.device))

    def numpy(self) -> np.ndarray:
        """The ids on the host (waits for their copy, not for later work on the stream)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.numpy()


__all__ = ["DeviceIds", "to_device"]
