"""Host-to-device uploads through pinned ring buffers, without waiting for the device.

An upload from pageable numpy memory costs a staging copy inside the driver on every call;
from pinned memory it is a plain enqueue. A ring hands out parts of one pinned buffer; a
part may be reused only once the device has consumed the copy out of it, which the owner
vouches for by calling ``reset`` after it synchronised with the stream (a replay does so at
every flush).

``Uploads`` hands out slices of any size and returns a fresh device tensor per upload; when
it runs out before a reset it synchronises itself. ``SlotUploads`` is for the replay's hot
path, a few small uploads per step: fixed slots, each mirrored by a slot of one device
buffer, and every view of a slot (host and device, per layout) made once and cached, so an
upload costs one copy call. On a GPU host every torch call costs tens of microseconds of
Python and dispatch, several times the copy itself: slicing and viewing a fresh upload took
four calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

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


SLOT_BYTES = 32 << 10  # a 1,024-row launch's seven input vectors
SLOTS = 512
_ALIGN = 16  # part offsets: pointers Triton specialises as 16-byte aligned, in every slot

# parts of a slot, in order: (numpy dtype string, shape) each
Layout = tuple[tuple[str, tuple[int, ...]], ...]


@functools.lru_cache(maxsize=256)
def _spans(layout: Layout) -> tuple[tuple[int, int], ...]:
    """(start, bytes) of each part of ``layout`` in a slot."""
    out, end = [], 0
    for dtype, shape in layout:
        start = -(-end // _ALIGN) * _ALIGN
        end = start + np.dtype(dtype).itemsize * int(np.prod(shape))
        out.append((start, end - start))
    return tuple(out)


def layout_bytes(layout: Layout) -> int:
    spans = _spans(layout)
    return spans[-1][0] + spans[-1][1] if spans else 0


class Slot:
    """One slot cut into a layout's parts: numpy views of its pinned host memory to fill,
    and device tensors over the slot's device copy."""

    __slots__ = ("dev", "host", "index", "nbytes")

    def __init__(self, index: int, host: torch.Tensor, dev: torch.Tensor, layout: Layout) -> None:
        self.index = index
        self.host: list[np.ndarray] = []
        self.dev: list[torch.Tensor] = []
        host_np = host.numpy()
        for (dtype, shape), (start, size) in zip(layout, _spans(layout), strict=True):
            self.host.append(host_np[start : start + size].view(dtype).reshape(shape))
            torch_dtype = _TORCH_DTYPES[np.dtype(dtype).str]
            self.dev.append(dev[start : start + size].view(torch_dtype).view(shape))
        self.nbytes = layout_bytes(layout)


class SlotUploads:
    """``take(layout) -> Slot`` (None once every slot is taken: the owner synchronises and
    calls ``reset``), fill ``slot.host``, then ``send(slot)``: one copy to the device."""

    def __init__(
        self, device: torch.device | str, *, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS
    ) -> None:
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self._host: torch.Tensor | None = None  # both made at the first take
        self._dev: torch.Tensor | None = None
        self._rows: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots
        self._cut: dict[tuple[int, Layout], Slot] = {}
        # (slot, bytes rounded up to a power of two) -> the host and device parts copied
        self._spans: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._next = 0
        self.exhausted = 0  # takes that found every slot taken (the owner then waited)

    def fits(self, layout: Layout) -> bool:
        return layout_bytes(layout) <= self.slot_bytes

    def take(self, layout: Layout) -> Slot | None:
        """The next free slot cut as ``layout`` (which must fit), or None."""
        i = self._next
        if i == len(self._rows):
            self.exhausted += 1
            return None
        self._next = i + 1
        slot = self._cut.get((i, layout))
        if slot is None:
            host, dev = self._row(i)
            slot = self._cut[(i, layout)] = Slot(i, host, dev, layout)
        return slot

    def send(self, slot: Slot) -> None:
        """Queue the copy of the slot's filled bytes to the device (non-blocking)."""
        span = max(1024, 1 << (slot.nbytes - 1).bit_length())  # a few sizes: a few views
        key = (slot.index, span)
        parts = self._spans.get(key)
        if parts is None:
            host, dev = self._row(slot.index)
            parts = self._spans[key] = (host[:span], dev[:span])
        parts[1].copy_(parts[0], non_blocking=True)

    def _row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self._rows[i]
        if row is None:
            if self._host is None or self._dev is None:
                shape = (len(self._rows), self.slot_bytes)
                pinned = self.device.type == "cuda"
                self._host = torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
                self._dev = torch.empty(shape, dtype=torch.uint8, device=self.device)
            row = self._rows[i] = (self._host[i], self._dev[i])
        return row

    def wait(self) -> None:
        """Wait for the device to consume every copy queued so far, then reuse the slots."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.reset()

    def reset(self) -> None:
        """The device has consumed every upload so far (the caller synchronised)."""
        self._next = 0


def rows_for(n: int) -> int:
    """Vector length for ``n`` rows: a multiple of 128, so that a few layouts (and their
    cached views) serve every launch."""
    return max(128, -(-n // 128) * 128)


@functools.lru_cache(maxsize=256)
def parts(*specs: tuple[type | str, Sequence[int]]) -> Layout:
    """A layout from (dtype, shape) pairs."""
    return tuple((np.dtype(d).str, tuple(int(x) for x in shape)) for d, shape in specs)
