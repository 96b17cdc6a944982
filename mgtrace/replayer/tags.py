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
from typing import TYPE_CHECKING

import numpy as np

from mgtrace.errors import UsageError
from mgtrace.kernels.pool import StatePool, StateSpec
from mgtrace.replayer.requests import NO_REQUEST
from mgtrace.schemas.manifest import RunMetadata

if TYPE_CHECKING:
    from mgtrace.kernels.staging import Slot

CONV_TAG_INTS = 2  # uid, position
TEMPORAL_TAG_INTS = 4  # uid, tokens, step, flags
STEP_FIELD = 2  # a temporal tag's step word

# settle's ring on a GPU: a slot holds one settle's writes (a step's are a few thousand
# words, 12 bytes each with the word's index), 256 of them between waits for the device
WRITE_SLOT_BYTES = 128 << 10
WRITE_SLOTS = 256

# Temporal tag flags.
DRAFTS_FOLDED = 1  # written by a prefill-split pass over unverified draft tokens
SPECULATIVE = 2  # a state after a draft token (window column > 0)
DUMMY = 4  # written by a padded row of a CUDA-graph batch


class _IntView:
    """The pool as int32 words: a numpy view on the CPU; on a GPU, indexed through torch.

    On a GPU every device operation costs a launch, so writes wait in a host list and go out
    together (one upload, one scatter) right before anything that reads the pool: a gather,
    a kernel launch (``settle``). A read either copies back at once (``[]``) or, with
    ``gather_later``, gathers into a device log that ``collect`` copies back in one transfer,
    so a replay waits for the device once per batch of reads, not once per read.

    Mirrored (``host`` and ``device``): reads come from the host copy at once, and every
    write goes to both, the device's share waiting for ``settle`` as above.
    """

    def __init__(
        self, host: np.ndarray | None, pool: StatePool, device: StatePool | None = None
    ) -> None:
        self.host = host
        self.pool = pool
        self.mirrored = host is not None and device is not None
        self._words = None
        self._log: list = []  # device tensors gathered by gather_later, in order
        self._writes: list[tuple[np.ndarray, np.ndarray]] = []  # not yet on the device
        self._last: np.ndarray | None = None  # scratch: the last write of each word
        if host is None or device is not None:
            import torch

            from mgtrace.kernels.staging import SlotUploads, Uploads

            self._words = (device or pool).buffer.view(torch.int32)
            self._uploads = Uploads(self._words.device)
            self._write_slots = SlotUploads(
                self._words.device, slot_bytes=WRITE_SLOT_BYTES, slots=WRITE_SLOTS
            )

    def _upload(self, arr: np.ndarray):
        return self._uploads.upload(arr)

    def _synced(self) -> None:
        """The device has caught up (a copy back just waited for it)."""
        self._uploads.reset()
        self._write_slots.reset()

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        if self.host is not None:
            return self.host[idx]
        self.settle()
        flat = self._upload(np.ascontiguousarray(idx, dtype=np.int64).ravel())
        out = self._words[flat].cpu().numpy().reshape(np.shape(idx))
        self._synced()
        return out

    def __setitem__(self, idx: np.ndarray, values: np.ndarray) -> None:
        if self.host is not None:
            self.host[idx] = values
            if not self.mirrored:
                return
        idx = np.asarray(idx, dtype=np.int64)
        self._writes.append((idx.ravel(), np.broadcast_to(values, idx.shape).ravel()))

    def settle(self) -> None:
        """Send the waiting writes to the device: one upload, one scatter. Where several
        write one word the last one wins, as with numpy (a scatter alone leaves it open)."""
        if not self._writes:
            return
        writes, self._writes = self._writes, []
        idx = np.concatenate([w[0] for w in writes])
        values = np.concatenate([w[1] for w in writes])
        keep = self._last_writes(idx)
        slot = self._write_slot(len(keep))
        if slot is None:  # more writes than a slot holds
            packed = np.empty((2, len(keep)), dtype=np.int64)
            packed[0] = idx[keep]
            packed[1] = values[keep]
            dev = self._upload(packed)
            self._words.index_put_((dev[0],), dev[1].to(self._words.dtype))
            return
        at, value = slot.host
        n = len(keep)
        at[:n] = idx[keep]
        value[:n] = values[keep]  # int32 words, as the cast on the device did
        # padding repeats the last write: a word written twice with one value is
        # deterministic, and the padded length lets one cached view serve many settles
        at[n:] = at[n - 1]
        value[n:] = value[n - 1]
        self._write_slots.send(slot)
        self._words.index_put_((slot.dev[0],), slot.dev[1])

    def _write_slot(self, n: int) -> Slot | None:
        """A slot for ``n`` (word, value) pairs, padded; None if they do not fit one."""
        from mgtrace.kernels.staging import parts, rows_for

        width = rows_for(n)
        layout = parts((np.int64, (width,)), (np.int32, (width,)))
        slots = self._write_slots
        if not slots.fits(layout):
            return None
        slot = slots.take(layout)
        if slot is None:  # every slot is taken: wait for the device, then reuse them
            slots.wait()
            slot = slots.take(layout)
        return slot

    def _last_writes(self, idx: np.ndarray) -> np.ndarray:
        """Positions in ``idx`` of the last write to each word."""
        n = len(idx)
        words = self._words.numel()
        if words <= 1 << 24:  # a scratch array over the pool's words: linear time
            if self._last is None:
                self._last = np.empty(words, dtype=np.int64)
            order = np.arange(n)
            self._last[idx] = -1
            np.maximum.at(self._last, idx, order)  # unbuffered: the latest position wins
            return order[self._last[idx] == order]
        order = np.argsort(idx, kind="stable")
        ordered = idx[order]
        last = np.ones(n, dtype=bool)
        last[:-1] = ordered[1:] != ordered[:-1]  # the last of each run of equal indices
        return order[last]

    def gather_later(self, idx: np.ndarray) -> int:
        """Gather ``idx`` now (on the stream), copy back at the next ``collect``."""
        if self.host is not None:
            self._log.append(self.host[idx])
        else:
            self.settle()
            flat = self._upload(np.ascontiguousarray(idx, dtype=np.int64).ravel())
            self._log.append(self._words[flat])
        return len(self._log) - 1

    def collect(self, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        """Everything gathered since the last collect, one array per gather (one transfer)."""
        log, self._log = self._log, []
        if not log:
            return []
        if self.host is not None:
            return log
        import torch

        flat = torch.cat(log).cpu().numpy()
        self._synced()
        sizes = [int(np.prod(s)) for s in shapes]
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        return [p.reshape(s) for p, s in zip(parts, shapes, strict=True)]

    def discard(self) -> None:
        self._log = []


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
            if len(s.shape) != 2:  # readable (info, sql), but not a window this replay models
                raise UsageError(
                    f"group {group}'s conv state has shape {list(s.shape)}; the replay models "
                    "a conv state of two dimensions per block (SD or DS)"
                )
            layout = s.conv_layout or "SD"
            return int(s.shape[0] if layout == "SD" else s.shape[1]), layout
    return 0, "SD"


def _has_temporal(run: RunMetadata, group: int) -> bool:
    return any(s.group == group and s.kind == "temporal" for s in run.states)


def _load(pool: StatePool, data: np.ndarray) -> None:
    """Pool bytes ``data`` into ``pool``, wherever it lives."""
    if pool.on_host:
        pool.numpy()[: len(data)] = data
    else:
        import torch

        pool.buffer.copy_(torch.from_numpy(data).to(pool.device))


class TagPool:
    """A StatePool whose states carry provenance tags, plus tag read/write helpers."""

    def __init__(
        self,
        run: RunMetadata,
        *,
        layout: str = "compact",
        device: str = "cpu",
        mirror: str | None = None,
    ) -> None:
        """``mirror``: also keep a copy of the pool on that device, for kernels to run on
        (``device_pool``); the tags are read from the pool on ``device``."""
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
        on_cpu = self.pool.on_host
        self.device_pool = self.pool.clone(mirror) if mirror is not None else None
        self._ints = _IntView(
            self.pool.numpy().view(np.int32) if on_cpu else None, self.pool, self.device_pool
        )
        self._temporal_fields = np.arange(TEMPORAL_TAG_INTS, dtype=np.int64)[None, :]
        # int32 words from a conv row's uid to its position (next word, or next SD row).
        self._conv_field_step = [
            (1 if spec.layout == "SD" else spec.row_bytes // 4) if spec.kind == "conv" else 0
            for spec in self.pool.specs
        ]
        self._word_offsets = np.array(self.pool.offsets, dtype=np.int64) // 4
        # Per state, [1, 4]: its temporal tag words from the start of a page (the layout
        # never changes, so made once; reads use them every step).
        self._temporal_words_of = [o + self._temporal_fields for o in self._word_offsets]
        self._page_words = np.int64(self.pool.page_bytes // 4)
        self._conv_tables: dict[tuple[int, int, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._offsets: dict[int, np.ndarray] = {}
        self._word_aligned = self.pool.page_bytes % 4 == 0 and all(
            o % 4 == 0 for o in self.pool.offsets
        )

    # ----------------------------------------------------------------- addressing
    def _ints_view(self) -> _IntView:
        return self._ints

    def _base(self, state: int, blocks: np.ndarray) -> np.ndarray:
        if self._word_aligned:  # one multiply-add in int64 words
            return np.asarray(blocks, dtype=np.int64) * self._page_words + self._word_offsets[state]
        pool = self.pool
        return (np.asarray(blocks, dtype=np.int64) * pool.page_bytes + pool.offsets[state]) // 4

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
        width = self.groups[group].width
        # The first table row: words of every window row's uid, then of its position.
        words = self._conv_rows_table(state, width, relative=True)[0][0]
        at = self._base(state, blocks)[:, None] + words
        values = np.empty(at.shape, dtype=np.int64)
        values[:, :width] = uid[:, None]
        np.add(last_pos[:, None], self._window_offsets(width), out=values[:, width:])
        self._ints[at] = values

    def read_conv(self, group: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        state = self.groups[group].conv
        if state is None:
            return None
        ints = self._ints_view()
        return ints[self._conv_index(state, blocks, 0)], ints[self._conv_index(state, blocks, 1)]

    # ----------------------------------------------------------------- reads
    def read_index(
        self,
        group: int,
        temporal_blocks: np.ndarray,
        conv_blocks: np.ndarray,
        conv_offset: np.ndarray,
        keep: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """int32-word indices of everything a read checks, [rows, 4 + 2*keep]: the temporal
        tag, then uid and position of conv window rows ``offset .. offset+keep-1``; and
        whether each of those conv rows lies inside the window ([rows, keep]; rows past it
        read row W-1). Negative blocks read block 0 (callers mask them out)."""
        gs = self.groups[group]
        if not self._word_aligned:
            return self._read_index_bytes(gs, temporal_blocks, conv_blocks, conv_offset, keep)
        n = len(temporal_blocks)
        at = np.zeros((n, TEMPORAL_TAG_INTS + 2 * keep), dtype=np.int64)
        conv = gs.conv is not None and keep > 0
        if gs.temporal is not None:
            page = np.maximum(temporal_blocks, 0) * self._page_words
            np.add(page[:, None], self._temporal_words(gs.temporal), out=at[:, :TEMPORAL_TAG_INTS])
        if not conv:
            return at, np.zeros((n, keep), dtype=bool)
        words, inside = self._conv_rows_table(gs.conv, keep)
        # A window offset past the window reads its last row only: one table row for all.
        first = np.minimum(conv_offset, len(words) - 1)  # offsets are never negative
        page = np.maximum(conv_blocks, 0) * self._page_words
        np.add(page[:, None], words[first], out=at[:, TEMPORAL_TAG_INTS:])
        return at, inside[first]

    def _read_index_bytes(
        self,
        gs: GroupStates,
        temporal_blocks: np.ndarray,
        conv_blocks: np.ndarray,
        conv_offset: np.ndarray,
        keep: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``read_index`` for pools whose pages or offsets are not whole int32 words."""
        n = len(temporal_blocks)
        at = np.zeros((n, TEMPORAL_TAG_INTS + 2 * keep), dtype=np.int64)
        if gs.temporal is not None:
            base = self._base(gs.temporal, np.maximum(temporal_blocks, 0))
            at[:, :TEMPORAL_TAG_INTS] = base[:, None] + self._temporal_fields
        if gs.conv is None or keep <= 0:
            return at, np.zeros((n, keep), dtype=bool)
        words, inside = self._conv_rows_table(gs.conv, keep, relative=True)
        first = np.minimum(conv_offset, len(words) - 1)
        base = self._base(gs.conv, np.maximum(conv_blocks, 0))
        at[:, TEMPORAL_TAG_INTS:] = base[:, None] + words[first]
        return at, inside[first]

    def _temporal_words(self, state: int) -> np.ndarray:
        """[1, 4]: words of the temporal tag fields from the start of a page."""
        return self._temporal_words_of[state]

    def _window_offsets(self, width: int) -> np.ndarray:
        """Positions of window rows 0..W-1 relative to the last: -(W-1) .. 0."""
        offsets = self._offsets.get(width)
        if offsets is None:
            offsets = np.arange(width, dtype=np.int64)[None, :] - (width - 1)
            self._offsets[width] = offsets
        return offsets

    def _conv_rows_table(
        self, state: int, keep: int, *, relative: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per first window row 0..W: words of ``keep`` rows' uids then positions
        ([W+1, 2*keep]) from the start of a page (from the state's start with
        ``relative``), and whether each row lies inside the window ([W+1, keep])."""
        cached = self._conv_tables.get((state, keep, relative))
        if cached is None:
            spec = self.pool.specs[state]
            rows = np.arange(spec.width + 1)[:, None] + np.arange(keep)[None, :]
            inside = rows < spec.width
            unit = spec.unit_bytes // 4 if spec.layout == "SD" else spec.elem_size // 4
            uid_at = np.minimum(rows, spec.width - 1) * unit
            words = np.concatenate([uid_at, uid_at + self._conv_field_step[state]], axis=1)
            if not relative:
                words = words + self._word_offsets[state]
            cached = (words.astype(np.int64), inside)
            self._conv_tables[(state, keep, relative)] = cached
        return cached

    def settle(self) -> None:
        """Make every tag write so far visible to the device (before a kernel launch)."""
        self._ints.settle()

    def through_torch(self) -> None:
        """Address the pool through torch even on the CPU, as on a GPU (for tests)."""
        self._ints = _IntView(None, self.pool)

    def gather(self, at: np.ndarray) -> np.ndarray:
        return self._ints[at]

    def gather_later(self, at: np.ndarray) -> int:
        """Gather now, hand the values back at the next ``collect`` (one transfer on a GPU)."""
        return self._ints.gather_later(at)

    def collect(self, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        return self._ints.collect(shapes)

    def discard_gathered(self) -> None:
        self._ints.discard()

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy whole blocks, every state of every group, ``src[i]`` onto ``dst[i]`` in
        order: the scheduler's copy-on-write block copies. Tags move with the bytes."""
        if not len(src):
            return
        self.settle()  # the tags written so far are what gets copied
        page = self.pool.page_bytes
        for pool in (self.pool, self.device_pool):
            if pool is None:
                continue
            pages = pool.buffer[: pool.num_blocks * page].view(pool.num_blocks, page)
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                pages[d].copy_(pages[s])

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
        at = self._base(state, blocks)[:, None] + self._temporal_fields
        values = np.empty(at.shape, dtype=np.int64)
        values[:, 0] = uid
        values[:, 1] = tokens
        values[:, 2] = step
        values[:, 3] = flags
        self._ints[at] = values

    def read_temporal(self, group: int, blocks: np.ndarray) -> np.ndarray | None:
        """[len(blocks), 4]: uid, tokens, step, flags."""
        state = self.groups[group].temporal
        if state is None:
            return None
        ints = self._ints_view()
        base = self._base(state, blocks)
        return ints[base[:, None] + np.arange(TEMPORAL_TAG_INTS)[None, :]]

    def shift_steps(self, delta: int) -> None:
        """Add ``delta`` to the step of every written temporal tag: the pool of a trace whose
        steps are renumbered (a repro cut from a later step) names its writers' steps as
        the new numbering does. Conv tags hold no step."""
        blocks = np.arange(self.pool.num_blocks, dtype=np.int64)
        for index, gs in enumerate(self.groups):
            tags = self.read_temporal(index, blocks)
            if tags is None:
                continue
            written = np.flatnonzero(tags[:, 0] != NO_REQUEST)
            at = self._base(gs.temporal, blocks[written]) + STEP_FIELD
            self._ints[at] = tags[written, STEP_FIELD] + delta

    def name_words(self, base: int) -> None:
        """Set word ``i`` of the pool to ``base + i``: a placeholder that names the word it
        stands in for, wherever the kernels' copies take it (host pools whose tags are whole
        int32 words only, so that a copy never splits a placeholder). A device copy of the
        pool (``mirror``) gets the same words, so that the two stay byte for byte equal."""
        if not self.pool.on_host or not self._word_aligned:
            raise UsageError("only a word-aligned tag pool in host memory takes placeholders")
        self.settle()
        words = self.pool.view(np.int32)
        words[:] = np.arange(base, base + len(words), dtype=np.int64)
        if self.device_pool is not None:
            _load(self.device_pool, self.pool.numpy())

    # ----------------------------------------------------------------- checkpoints
    def snapshot(self) -> np.ndarray:
        self.settle()
        if self.pool.on_host:
            return self.pool.numpy().copy()
        return self.pool.buffer.detach().cpu().numpy().copy()

    def restore(self, data: np.ndarray) -> None:
        self.settle()
        for pool in (self.pool, self.device_pool):
            if pool is not None:
                _load(pool, data)

    def mirror_mismatch(self) -> tuple[int, int] | None:
        """(block, byte in its page) of the first byte where the device copy differs from
        the pool, or None (one copy back, which waits for the device)."""
        if self.device_pool is None:
            return None
        self.settle()
        size = self.pool.num_blocks * self.pool.page_bytes
        device = self.device_pool.buffer[:size].cpu().numpy()
        self._ints._synced()
        host = self.pool.numpy()[:size]
        differ = np.flatnonzero(device != host)
        if not len(differ):
            return None
        return divmod(int(differ[0]), self.pool.page_bytes)
