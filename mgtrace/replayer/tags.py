"""Provenance tags: what the replay pool holds instead of model numbers.

Every conv row holds ``(request uid, token position)`` of the token it stands for; every
temporal state holds ``(request uid, tokens folded in, step written, flags)``. The tags sit
in the first bytes of each row / state as int32, so the align kernels move them with the
very byte copies they do on real states, and the oracle can read, after any step, whose
tokens a request is about to build on.

The compact layout (the default) keeps one conv and one temporal state per Mamba group,
each just large enough for its tags: all layers of a group move identically, so one stands
for all. The full layout uses the recorded state shapes (for bandwidth measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgtrace.errors import UsageError
from mgtrace.kernels.pool import StatePool, StateSpec
from mgtrace.schemas.manifest import RunMetadata

CONV_TAG_INTS = 2  # uid, position
TEMPORAL_TAG_INTS = 4  # uid, tokens, step, flags

# Temporal tag flags.
DRAFTS_FOLDED = 1  # written by a prefill-split pass over unverified draft tokens
SPECULATIVE = 2  # a state after a draft token (window column > 0)
DUMMY = 4  # written by a padded row of a CUDA-graph batch


class _IntView:
    """The pool as int32 words: a numpy view on the CPU; on a GPU, indexed through torch
    (each access a small copy, so a replay on a GPU pays for its tag checks)."""

    def __init__(self, host: np.ndarray | None, pool: StatePool) -> None:
        self.host = host
        self.pool = pool

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        if self.host is not None:
            return self.host[idx]
        import torch

        words = self.pool.buffer.view(torch.int32)
        flat = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64).ravel())
        return words[flat.to(words.device)].cpu().numpy().reshape(np.shape(idx))

    def __setitem__(self, idx: np.ndarray, values: np.ndarray) -> None:
        if self.host is not None:
            self.host[idx] = values
            return
        import torch

        words = self.pool.buffer.view(torch.int32)
        idx = np.array(idx, dtype=np.int64)  # a private, writable copy for torch
        vals = np.array(np.broadcast_to(np.asarray(values, dtype=np.int32), idx.shape))
        words[torch.from_numpy(idx.ravel()).to(words.device)] = torch.from_numpy(
            vals.ravel()
        ).to(words.device)


@dataclass(frozen=True)
class GroupStates:
    """Indices, in the pool, of the conv and temporal states that stand for one group."""

    group: int
    conv: int | None
    temporal: int | None
    width: int  # conv window length in tokens (0 without a conv state)


def _group_conv_width(run: RunMetadata, group: int) -> tuple[int, str]:
    for s in run.states:
        if s.group == group and s.kind == "conv":
            layout = s.conv_layout or "SD"
            return int(s.shape[0] if layout == "SD" else s.shape[1]), layout
    return 0, "SD"


def _has_temporal(run: RunMetadata, group: int) -> bool:
    return any(s.group == group and s.kind == "temporal" for s in run.states)


class TagPool:
    """A StatePool whose states carry provenance tags, plus tag read/write helpers."""

    def __init__(self, run: RunMetadata, *, layout: str = "compact", device: str = "cpu") -> None:
        if run.num_blocks is None or run.num_blocks < 2:
            raise UsageError("the trace does not say how many state blocks the pool has")
        groups = sorted({s.group for s in run.states}) or [0]
        specs: list[StateSpec] = []
        per_group: list[GroupStates] = []
        if layout == "compact":
            for g in groups:
                width, conv_layout = _group_conv_width(run, g)
                conv = temporal = None
                if width:
                    conv = len(specs)
                    shape = (
                        (width, CONV_TAG_INTS) if conv_layout == "SD" else (CONV_TAG_INTS, width)
                    )
                    specs.append(StateSpec(g, "conv", shape, "int32", conv_layout))
                if _has_temporal(run, g):
                    temporal = len(specs)
                    specs.append(StateSpec(g, "temporal", (TEMPORAL_TAG_INTS,), "int32"))
                per_group.append(GroupStates(g, conv, temporal, width))
        elif layout == "full":
            for g in groups:
                conv = temporal = None
                width = 0
                for s in run.states:
                    if s.group != g:
                        continue
                    spec = StateSpec.from_layout(s)
                    if spec.kind == "conv" and conv is None:
                        conv, width = len(specs), spec.width
                    elif spec.kind == "temporal" and temporal is None:
                        temporal = len(specs)
                    specs.append(spec)
                per_group.append(GroupStates(g, conv, temporal, width))
            for spec in specs:
                if spec.kind == "conv" and spec.unit_bytes < 4 * CONV_TAG_INTS:
                    raise UsageError("a conv state row is too narrow to carry a provenance tag")
                if spec.kind == "temporal" and spec.nbytes < 4 * TEMPORAL_TAG_INTS:
                    raise UsageError("a temporal state is too small to carry a provenance tag")
        else:
            raise UsageError(f"unknown state layout {layout!r}; choose compact or full")
        self.layout = layout
        self.groups = per_group
        self.pool = StatePool(specs, run.num_blocks, device=device)
        on_cpu = self.pool.device.type == "cpu"
        self._ints = _IntView(self.pool.numpy().view(np.int32) if on_cpu else None, self.pool)

    # ----------------------------------------------------------------- addressing
    def _ints_view(self) -> _IntView:
        return self._ints

    def _base(self, state: int, blocks: np.ndarray) -> np.ndarray:
        pool = self.pool
        return (blocks.astype(np.int64) * pool.page_bytes + pool.offsets[state]) // 4

    def _conv_index(self, state: int, blocks: np.ndarray, field: int) -> np.ndarray:
        """int32 indices of one tag field of every window row: shape [len(blocks), W]."""
        spec = self.pool.specs[state]
        base = self._base(state, blocks)[:, None]
        t = np.arange(spec.width, dtype=np.int64)[None, :]
        if spec.layout == "SD":
            return base + t * (spec.unit_bytes // 4) + field
        return base + field * (spec.row_bytes // 4) + t * (spec.elem_size // 4)

    # ----------------------------------------------------------------- conv rows
    def write_conv(
        self, group: int, blocks: np.ndarray, uid: np.ndarray, last_pos: np.ndarray
    ) -> None:
        """Rows hold positions last_pos-W+1 .. last_pos of request ``uid``."""
        state = self.groups[group].conv
        if state is None or not len(blocks):
            return
        ints = self._ints_view()
        width = self.groups[group].width
        pos = last_pos[:, None] - (width - 1) + np.arange(width)[None, :]
        ints[self._conv_index(state, blocks, 0)] = uid[:, None]
        ints[self._conv_index(state, blocks, 1)] = pos

    def read_conv_rows(
        self, group: int, blocks: np.ndarray, first: np.ndarray, count: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tags of window rows ``first .. first+count-1`` per block: uids, positions, and
        whether each row lies inside the window (rows past it read as row W-1, masked)."""
        state = self.groups[group].conv
        spec = self.pool.specs[state]
        rows = first[:, None] + np.arange(count)[None, :]
        inside = rows < spec.width
        rows = np.minimum(rows, spec.width - 1)
        base = self._base(state, blocks)[:, None]
        if spec.layout == "SD":
            at = base + rows * (spec.unit_bytes // 4)
            step = 1
        else:
            at = base + rows * (spec.elem_size // 4)
            step = spec.row_bytes // 4
        ints = self._ints_view()
        return ints[at], ints[at + step], inside

    def read_conv(self, group: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        state = self.groups[group].conv
        if state is None:
            return None
        ints = self._ints_view()
        return ints[self._conv_index(state, blocks, 0)], ints[self._conv_index(state, blocks, 1)]

    # ----------------------------------------------------------------- temporal
    def write_temporal(
        self,
        group: int,
        blocks: np.ndarray,
        uid: np.ndarray,
        tokens: np.ndarray,
        step: int,
        flags: np.ndarray,
    ) -> None:
        state = self.groups[group].temporal
        if state is None or not len(blocks):
            return
        ints = self._ints_view()
        base = self._base(state, blocks)
        ints[base] = uid
        ints[base + 1] = tokens
        ints[base + 2] = np.full(len(base), step)
        ints[base + 3] = flags

    def read_temporal_head(self, group: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uid and tokens folded in, the two fields every read checks."""
        base = self._base(self.groups[group].temporal, blocks)
        ints = self._ints_view()
        return ints[base], ints[base + 1]

    def read_temporal(self, group: int, blocks: np.ndarray) -> np.ndarray | None:
        """[len(blocks), 4]: uid, tokens, step, flags."""
        state = self.groups[group].temporal
        if state is None:
            return None
        ints = self._ints_view()
        base = self._base(state, blocks)
        return ints[base[:, None] + np.arange(TEMPORAL_TAG_INTS)[None, :]]

    # ----------------------------------------------------------------- checkpoints
    def snapshot(self) -> np.ndarray:
        return self.pool.buffer.detach().cpu().numpy().copy()

    def restore(self, data: np.ndarray) -> None:
        import torch

        self.pool.buffer.copy_(torch.from_numpy(data).to(self.pool.device))
