"""Host-to-device uploads through one pinned ring buffer, without waiting for the device.

An upload from pageable numpy memory costs a staging copy inside the driver on every call;
from pinned memory it is a plain enqueue. The ring hands out slices of one pinned buffer;
a slice may be reused only once the device has consumed the copy out of it, which the
owner vouches for by calling ``reset`` after it synchronised with the stream (a replay does
so at every flush). When the ring runs out before that, it synchronises itself.
"""

from __future__ import annotations

import numpy as np
import torch


class Uploads:
    """``upload(array) -> device tensor`` (same dtype and shape), queued on the stream."""

    def __init__(self, device: torch.device, nbytes: int = 16 << 20) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        # Only a GPU needs the ring; on the CPU an upload is a private copy.
        self._ring = torch.empty(
            nbytes if self.pinned else 0, dtype=torch.uint8, pin_memory=self.pinned
        )
        self._host = self._ring.numpy()
        self._used = 0
        self.waits = 0  # times the ring ran out and had to wait for the device

    def upload(self, arr: np.ndarray) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        if not self.pinned:  # a CPU "device": a private copy will do
            return torch.from_numpy(arr.copy())
        return self.stage(arr).to(self.device, non_blocking=True)

    def stage(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` copied into the ring: a pinned host tensor to copy from, non-blocking."""
        arr = np.ascontiguousarray(arr)
        if not self.pinned:
            return torch.from_numpy(arr.copy())
        size = arr.nbytes
        if size > len(self._host):  # larger than the ring: a one-off pinned copy
            return torch.from_numpy(arr.copy()).pin_memory()
        start = -(-self._used // 16) * 16  # 16-byte aligned slices
        if start + size > len(self._host):
            torch.cuda.current_stream(self.device).synchronize()
            self.waits += 1
            start = 0
        self._host[start : start + size].view(arr.dtype).reshape(arr.shape)[...] = arr
        self._used = start + size
        return self._ring[start : start + size].view(_TORCH_DTYPES[arr.dtype.str]).view(arr.shape)

    def reset(self) -> None:
        """The device has consumed every upload so far (the caller synchronised)."""
        self._used = 0


_TORCH_DTYPES = {
    np.dtype(np.int32).str: torch.int32,
    np.dtype(np.int64).str: torch.int64,
    np.dtype(np.uint8).str: torch.uint8,
}
