"""Triton launches queued on the device stream, for replays of many launches in a row.

``run_triton`` runs one launch and waits for it: it builds the device layout, uploads every
column separately and copies the accepted counts back, a handful of transfers and a device
synchronisation per launch. A replay runs thousands of launches whose inputs and decisions
the trace already fixes, so :class:`StreamedTriton` runs the same kernels (the same
validation on the host, the same sanitised rows) without ever waiting:

- block tables live in persistent device buffers, refreshed by one upload when the host
  snapshot changes, so the device layout (table addresses) is built once;
- a launch's columns travel in one upload, into a slot of a ring whose device views are made
  once (``SlotUploads``): the vectors are padded to a multiple of 128 rows with refused rows
  (req_slot -1), so that a few slot layouts serve every launch;
- the accepted counts the launch returns are the host decision (``Validation.accepted_out``,
  the same arithmetic as the kernel's); the kernel's own counts stay on the device, and
  ``verify`` compares them all with the host's in one transfer, raising on any difference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.pool import BlockTables, StatePool
from mgtrace.kernels.reference import LaunchResult
from mgtrace.kernels.staging import Slot, SlotUploads, Uploads, parts, rows_for
from mgtrace.kernels.triton_align import (
    DeviceLayout,
    launch_postprocess,
    launch_precopy,
    run_triton,
)
from mgtrace.kernels.validate import Validation, validate_launch

# Column order of a launch's single upload (postprocess: "num_accepted" twice, the second
# row pre-fills the separate output buffer the kernel writes its resets into).
_POSTPROCESS = ("req_slot", "state_idx", "num_scheduled", "num_computed", "num_draft")
_PRECOPY = ("req_slot", "state_idx", "src_col", "token_bias")
_VECTORS = len(_POSTPROCESS) + 2  # the most a launch uploads
TILE_BYTES = 64 << 10
# the ring of launch inputs: 512 launches (a 1,024-row launch's seven vectors a slot)
VECTOR_SLOT_BYTES = 32 << 10
VECTOR_SLOTS = 512


def _sender(slots: SlotUploads, slot: Slot, count: int) -> Callable[[], list[torch.Tensor]]:
    def send() -> list[torch.Tensor]:
        slots.send(slot)
        return slot.dev[:count]

    return send


class KernelDisagreement(RuntimeError):
    """A kernel computed something other than the host decision it must match: a bug in
    the kernels (or the device), never in the trace."""


class StreamedTriton:
    """A backend (``launch, pool, tables -> LaunchResult``) that never waits for the device."""

    def __init__(self, *, tiles: int | None = None) -> None:
        self.tiles = tiles  # None: from the state sizes (see ``_tiles``)
        self._layouts: dict[tuple, tuple[weakref.ref, DeviceLayout, torch.Tensor]] = {}
        self._loaded: dict[tuple, BlockTables] = {}  # host snapshot each buffer holds now
        self._uploads: dict[torch.device, Uploads] = {}
        self._slots: dict[torch.device, SlotUploads] = {}
        self._device_counts: list[torch.Tensor] = []
        self._host_counts: list[np.ndarray] = []
        self.launches = 0  # kernels enqueued

    def _layout(self, pool: StatePool, tables: BlockTables) -> DeviceLayout:
        """The layout over persistent device tables, holding ``tables`` (uploaded if new)."""
        shape = tables.common_shape
        if shape is None:  # tables of different shapes: no shared buffer, build anew
            return DeviceLayout.build(pool, tables)
        key = (id(pool), len(tables), shape)
        entry = self._layouts.get(key)
        if entry is None or entry[0]() is not pool:  # new, or a dead pool's id reused
            buffer = torch.empty((len(tables), *shape), dtype=torch.int32, device=pool.device)
            layout = DeviceLayout.over(pool, list(buffer))
            entry = self._layouts[key] = (weakref.ref(pool), layout, buffer)
            self._loaded.pop(key, None)
        _, layout, buffer = entry
        if self._loaded.get(key) is not tables:
            # Stream-ordered: launches queued earlier still see the tables they were given.
            staged = self._staging(pool.device).stage(np.stack(tables.tables))
            buffer.copy_(staged, non_blocking=True)
            self._loaded[key] = tables  # held, so its id cannot be reused while cached
        return layout

    # a replay may keep its tags on the host and run this backend on a device copy
    runs_on_device_pool = True

    def __call__(
        self,
        launch: AlignLaunch,
        pool: StatePool,
        tables: BlockTables,
        validation: Validation | None = None,
    ) -> LaunchResult:
        """``validation``: the host validation of this launch, when the caller has it."""
        if launch.kernel == "aligned_indices":  # returns a gather: it has to wait anyway
            return run_triton(launch, pool, tables, tiles=self._tiles(pool))
        if validation is None:
            validation = validate_launch(launch, pool, tables)
        result = LaunchResult(validation=validation)
        if launch.kernel == "postprocess":
            result.accepted_out = validation.accepted_out(launch)
        safe = validation.sanitized(launch)
        n = safe.num_rows
        if n == 0 or not (safe.column("req_slot") >= 0).any():
            return result  # nothing survives validation: launch nothing
        layout = self._layout(pool, tables)
        row_is_slot = safe.row_rule == "req_slot"
        if safe.kernel == "postprocess":
            decision = safe.mode == "decision"
            # Precomputed mode reads no scheduled or draft counts: computed stands in for them.
            names = _POSTPROCESS if decision else (*_POSTPROCESS[:2], "num_computed")
            row = {name: i for i, name in enumerate(names)}
            packed, send = self._vectors(pool.device, len(names) + 2, n)
            for name, i in row.items():
                packed[i][:n] = safe.column(name)
            packed[-2][:n] = packed[-1][:n] = safe.column("num_accepted")
            if validation.problems and result.accepted_out is not None:
                # Refused rows never run: their output counts start as the host decision.
                packed[-1][:n] = np.where(validation.bad, result.accepted_out, packed[-2][:n])
            dev = send()
            computed = dev[row["num_computed"]]
            launch_postprocess(
                layout,
                len(pool.specs),
                dev[row["req_slot"]],
                dev[-2],
                dev[row["state_idx"]],
                dev[row.get("num_scheduled", row["num_computed"])],
                computed,
                dev[row.get("num_draft", row["num_computed"])],
                dev[-1],
                block_size=safe.block_size,
                precomputed=not decision,
                row_is_slot=row_is_slot,
                tiles=self._tiles(pool),
            )
            self._device_counts.append(dev[-1])
            # padded rows never run: their counts stay as staged (0)
            want = np.zeros(len(packed[-1]), np.int32)
            want[:n] = result.accepted_out
            self._host_counts.append(want)
        else:
            packed, send = self._vectors(pool.device, len(_PRECOPY), n)
            for i, name in enumerate(_PRECOPY):
                packed[i][:n] = safe.column(name)
            dev = send()
            launch_precopy(
                layout,
                len(pool.specs),
                dev[0],
                dev[1],
                dev[2],
                dev[3],
                row_is_slot=row_is_slot,
                tiles=self._tiles(pool),
            )
        self.launches += 1
        return result

    def _vectors(
        self, device: torch.device, count: int, n: int
    ) -> tuple[list[np.ndarray], Callable[[], list[torch.Tensor]]]:
        """``count`` int32 vectors of ``n`` rows, padded to ``rows_for(n)`` as refused rows
        (req_slot -1 in vector 0, 0 elsewhere): host arrays to fill, and the call that
        uploads them and returns their device tensors."""
        width = rows_for(n)
        # one layout for both kernels (the precopy uses the first vectors): half the cuts
        layout = parts(*[(np.int32, (width,))] * _VECTORS)
        slots = self._slots.get(device)
        if slots is None:
            slots = self._slots[device] = SlotUploads(
                device, slot_bytes=VECTOR_SLOT_BYTES, slots=VECTOR_SLOTS
            )
        slot = slots.take(layout) if slots.fits(layout) else None
        if slot is None and slots.fits(layout):
            self.verify()  # every slot is taken: wait for the device, then reuse them
            slot = slots.take(layout)
        if slot is None:  # more rows than a slot holds: a one-off upload
            packed = np.zeros((count, width), dtype=np.int32)
            packed[0, n:] = -1
            return list(packed), lambda: list(self._staging(device).upload(packed).unbind(0))
        host = slot.host[:count]
        host[0][n:] = -1
        for vector in host[1:]:
            vector[n:] = 0
        return host, _sender(slots, slot, count)

    def _staging(self, device: torch.device) -> Uploads:
        uploads = self._uploads.get(device)
        if uploads is None:
            uploads = self._uploads[device] = Uploads(device)
        return uploads

    def _tiles(self, pool: StatePool) -> int:
        """Programs per temporal state: a replay's launch copies a row or two, so large
        states are split across the GPU (one program per ~64 KiB, up to 64)."""
        if self.tiles is not None:
            return self.tiles
        largest = max((s.nbytes for s in pool.specs if s.kind == "temporal"), default=0)
        return int(min(64, max(1, largest // TILE_BYTES)))

    def verify(self) -> None:
        """Compare the kernels' accepted counts since the last call with the host decisions
        (one transfer); raise if any differs."""
        device, host = self._device_counts, self._host_counts
        self._device_counts, self._host_counts = [], []
        if not device:
            for slots in self._slots.values():
                slots.wait()
            return
        got = torch.cat(device).cpu().numpy()
        for uploads in (*self._uploads.values(), *self._slots.values()):
            uploads.reset()  # the copy back waited for every launch so far
        want = np.concatenate(host)
        if not np.array_equal(got, want):
            at = int(np.flatnonzero(got != want)[0])
            raise KernelDisagreement(
                f"the post-process kernel's accepted counts differ from the host decision "
                f"(entry {at}: kernel {int(got[at])}, host {int(want[at])})"
            )
