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


class PinnedStage:
    """One pinned host buffer, kept, for an array that crosses to the device every step (a constraint's masks):
    the copy is queued on the current stream and the call returns at once. The next put waits for that copy
    before it writes the buffer again (a step later, it has long run). Unlike to_device, no pinned block is taken
    from torch's pool per call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # uint8, pinned
        self._copied: torch.cuda.Event | None = None

    def put(self, array: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(array)
        source = torch.from_numpy(array)
        if self.device.type == "cpu":
            return source
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.numel() < array.nbytes:
            self._host = torch.empty(max(array.nbytes, 2 * (self._host.numel() if self._host is not None else 0)),
                                     dtype=torch.uint8, pin_memory=True)
        host = self._host[: array.nbytes].view(source.dtype).view(source.shape)
        host.copy_(source)
        out = torch.empty(source.shape, dtype=source.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        return out


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


__all__ = ["DeviceIds", "PinnedStage", "to_device"]
