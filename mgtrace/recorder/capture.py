"""Stream-ordered capture of the small integer vectors an align kernel reads.

On the engine thread, right before a launch: one ``torch.cat`` of the input vectors into a
preallocated device staging slot and one event recorded on the current (launch) stream.
Both are queued on the launch stream before the kernel, so the staging slot holds exactly
the bytes the kernel reads, including values that later kernels overwrite in place. The
device-to-host copy is the recorder thread's: once a slot's event has completed it copies
each run of consecutive completed slots into the pinned host ring with one non-blocking copy
on a side stream, and reads a slot when that copy's event has completed. Nothing here waits
for the device (only ``Event.query``), so a slow device delays the trace, never the engine;
and the engine thread pays two CUDA calls per launch, not three.

For CPU tensors (vLLM on the CPU, and the tests) the kernel runs synchronously, so a capture
is complete when taken: the vectors' bytes, joined, land at once in a queue the recorder
thread empties, as many as the ring has slots (copying into a slot and out of it again cost
the engine thread about 3 µs a step more: ``benchmarks/recorder_floor.py``, A/B).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

DEFAULT_SLOTS = 512  # two captures per step for the ~10 ms the recorder thread may wait for
# the GIL on a busy engine (a sleep, then a switch interval)
DEFAULT_SLOT_ELEMS = 1 << 13  # int32 elements: 4 slot-indexed vectors of 2048 requests
MAX_VIEWS = 64
_INT32 = np.dtype(np.int32)
# The widest capture: V2 reads three vectors indexed by request slot beside one per row;
# V1's fused post-process five vectors per row. Eight per request covers both.
VECTORS_PER_REQUEST = 8


def slot_elems_for(max_num_seqs: int | None) -> int:
    """A slot wide enough for every launch of an engine with ``max_num_seqs`` requests."""
    need = VECTORS_PER_REQUEST * (max_num_seqs or 0)
    return max(DEFAULT_SLOT_ELEMS, -(-need // 1024) * 1024)


def consecutive_runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``slots`` in order, one per run of consecutive
    numbers: the fewest copies for a batch of ring slots."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs


def _from_words(slot: np.ndarray, lengths: tuple[int, ...]) -> tuple[bytes, tuple[int, ...]]:
    """A slot's bytes and lengths with every vector int32: those stored as int64 words (a
    negated length) converted back (the values fit: they are request slots)."""
    parts, start = [], 0
    for n in lengths:
        if n < 0:
            parts.append(slot[start : start - 2 * n].view(np.int64).astype(np.int32))
            start -= 2 * n
        else:
            parts.append(slot[start : start + n])
            start += n
    return b"".join([p.tobytes() for p in parts]), tuple(abs(n) for n in lengths)


class _HostCut:
    """Numpy views of a group of host tensors, cut to the lengths a capture copies, and how
    each view becomes bytes as the device path stores them (int32)."""

    __slots__ = (
        "lengths",
        "tail",
        "tail_ids",
        "tail_to_bytes",
        "tensors",
        "to_bytes",
        "total",
        "views",
    )

    def __init__(
        self, tensors: Sequence[Any], views: list[np.ndarray], lengths: Sequence[int]
    ) -> None:
        self.tensors = tuple(tensors)  # held, so that their ids stay theirs
        self.tail_ids = tuple(map(id, self.tensors[1:]))
        self.views, self.tail = views, views[1:]
        self.to_bytes = _bytes_of(views)
        self.tail_to_bytes = _bytes_of(self.tail)
        self.lengths = tuple(lengths)
        self.total = sum(self.lengths)


def _int32_bytes(v: np.ndarray) -> bytes:
    return v.tobytes() if v.dtype == _INT32 else v.astype(np.int32).tobytes()


def _bytes_of(views: list[np.ndarray]) -> Callable[[np.ndarray], bytes]:
    """The plain copy where every view is int32 already, else one that converts."""
    return np.ndarray.tobytes if all(v.dtype == _INT32 for v in views) else _int32_bytes


class CaptureRing:
    """A fixed number of capture slots; a capture with no free slot is dropped and counted."""

    def __init__(
        self,
        device: Any,
        *,
        slots: int = DEFAULT_SLOTS,
        slot_elems: int = DEFAULT_SLOT_ELEMS,
    ) -> None:
        import torch

        self._torch = torch
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.slot_elems = slot_elems
        self.slots = slots
        self.host = None
        self._host_np: np.ndarray | None = None  # made on the recorder thread, in reap
        self.staging = None
        self.events: list[Any] = []
        # host captures, complete when taken: (bytes, lengths, tag), in launch order
        self._landed: deque[tuple[bytes, tuple[int, ...], Any]] = deque()
        if self.cuda:
            # int32: every vector the align kernels read is int32, and a cat that converts
            # dtypes costs several times one that does not
            self.host = torch.empty((slots, slot_elems), dtype=torch.int32, pin_memory=True)
            self.staging = torch.empty((slots, slot_elems), dtype=torch.int32, device=device)
            # torch.Event records on the current stream in C++; torch.cuda.Event.record()
            # looks the stream up in Python first, which costs more than the copy
            self._make_event = getattr(torch, "Event", None) or (lambda device: torch.cuda.Event())
            self.events = [self._make_event(device=device) for _ in range(slots)]
            self._copy_stream = torch.cuda.Stream(device=device)
        self._views: dict[int, tuple[Any, np.ndarray]] = {}
        self._cuts: dict[int, tuple[Any, ...]] = {}  # id of the first tensor -> _cut_views
        self._slots: dict[tuple[int, int], Any] = {}  # staging views
        self._free: deque[int] = deque(range(slots))
        # [slot, lengths, tag, event of the copy to the host (None until it is issued)]
        self._pending: deque[list[Any]] = deque()
        self._issued = 0  # pending entries, from the left, whose host copy is issued
        self._thread_on_device = False  # the recorder thread's current device is the ring's
        self.captured = 0
        self.dropped = 0
        self.refusal = ""  # why the last refused capture was refused

    def _refuse(self, why: str) -> bool:
        self.dropped += 1
        self.refusal = why
        return False

    def grab(self, tensors: Sequence[Any], lengths: Sequence[int], tag: Any) -> bool:
        """Queue the copy of ``tensors[i][:lengths[i]]`` (or more: on the device whole
        vectors when they fit, so callers slice what they need); engine thread, never
        blocks. Host tensors' views are cached for ``lengths`` given as a tuple (a list is
        read right, only anew each time)."""
        if not self._free:
            return self._refuse("full")
        if self.staging is not None:
            # Whole tensors when they fit: slicing costs a torch call per vector, and the
            # assembler trims to the rows the launch read.
            whole = [t.shape[0] for t in tensors]
            if sum(whole) <= self.slot_elems:
                lengths = whole
                parts = tensors
            else:
                parts = [t[:n] for t, n in zip(tensors, lengths, strict=True)]
            # V2's launches pass their int64 idx_mapping first: one comparison decides (an
            # int64 vector elsewhere is converted by the cat, as right and only slower)
            if parts[0].dtype == self._torch.int64:
                parts, lengths = self._as_words(parts, lengths)
                total = sum(2 * -n if n < 0 else n for n in lengths)
            else:
                total = sum(lengths)
            if total > self.slot_elems:
                return self._refuse(f"{total} values, over the {self.slot_elems} of a slot")
            i = self._free.popleft()
            try:
                self._torch.cat(parts, out=self._slot(i, total))
                self.events[i].record()
            except BaseException:
                self._free.appendleft(i)  # the next capture takes it: slots stay in order
                raise
        else:
            if len(self._landed) >= self.slots:
                return self._refuse("full")
            # Host tensors: numpy views of them are free, and their bytes cost a fraction of
            # a torch op, which matters on a busy engine thread. The views are cached per
            # group, found by the last tensor: V2's launches pass a fresh ``idx_mapping``
            # first every step and the same slot vectors after it, so a new first tensor
            # costs one view, not the whole group's.
            hit = self._cuts.get(id(tensors[-1]))
            # the cache holds the tensors: equal ids are the same tensors
            if hit is None or hit.lengths != lengths or hit.tail_ids != tuple(map(id, tensors[1:])):
                hit = self._cut_views(tensors, lengths)
            if hit.total > self.slot_elems:
                return self._refuse(f"{hit.total} values, over the {self.slot_elems} of a slot")
            if tensors[0] is hit.tensors[0]:
                data = b"".join(map(hit.to_bytes, hit.views))
            else:  # a new first tensor: one view of it, the others' cached ones
                first = _int32_bytes(tensors[0].numpy()[: lengths[0]])
                data = b"".join([first, *map(hit.tail_to_bytes, hit.tail)])
            self._landed.append((data, hit.lengths, tag))
            self.captured += 1
            return True
        self._pending.append([i, tuple(lengths), tag, None])
        self.captured += 1
        return True

    def _as_words(
        self, parts: Sequence[Any], lengths: Sequence[int]
    ) -> tuple[list[Any], list[int]]:
        """Contiguous int64 vectors (V2's ``idx_mapping``) as their int32 words, a free
        view: a ``torch.cat`` that converts dtypes costs the engine thread about three
        times one that does not (``benchmarks/capture_ops_gpu.py``). Such a vector's length
        is given negated; the recorder thread converts its words back when it reaps."""
        int64, int32 = self._torch.int64, self._torch.int32
        out_parts, out_lengths = [], []
        for t, n in zip(parts, lengths, strict=True):
            if t.dtype == int64 and t.is_contiguous():
                out_parts.append(t.view(int32))
                out_lengths.append(-n)
            else:
                out_parts.append(t)
                out_lengths.append(n)
        return out_parts, out_lengths

    def _slot(self, i: int, total: int) -> Any:
        """The device staging view of slot ``i``'s first ``total`` elements, cached:
        indexing a tensor costs more in Python than the copy it feeds."""
        key = (i, total)
        hit = self._slots.get(key)
        if hit is None:
            if len(self._slots) >= 8 * len(self.events):
                self._slots.clear()
            hit = self._slots[key] = self.staging[i, :total]
        return hit

    def _host_view(self) -> np.ndarray:
        if self._host_np is None:
            self._host_np = self.host.numpy()
        return self._host_np

    def _cut_views(self, tensors: Sequence[Any], lengths: Sequence[int]) -> _HostCut:
        """Numpy views of host tensors cut to ``lengths``, cached by the last tensor (a
        launch passes the same buffers step after step, and one look-up costs less than a
        view and a slice per tensor). The cache holds the tensors, so their ids cannot be
        reused while cached; it is bounded for callers that pass fresh tensors."""
        if len(self._cuts) >= MAX_VIEWS:
            self._cuts.clear()
        entry = _HostCut(
            tensors, [self._view(t)[:n] for t, n in zip(tensors, lengths, strict=True)], lengths
        )
        self._cuts[id(tensors[-1])] = entry
        return entry

    def _view(self, t: Any) -> np.ndarray:
        """A cached numpy view of a host tensor (the cache holds the tensor, so its id
        cannot be reused while cached); bounded for callers that pass fresh tensors."""
        hit = self._views.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        if len(self._views) >= MAX_VIEWS:
            self._views.clear()
        view = t.numpy()
        self._views[id(t)] = (t, view)
        return view

    @property
    def pending(self) -> int:
        """Captures not reaped yet (a host capture is complete, but its step must wait for
        it all the same)."""
        return len(self._pending) + len(self._landed)

    def oldest_pending_tag(self) -> Any:
        """The tag of the oldest capture not reaped yet, or None."""
        if self._landed:
            return self._landed[0][2]
        return self._pending[0][2] if self._pending else None

    def pending_steps(self) -> set[int]:
        """Steps with a capture that has not been reaped (recorder thread)."""
        return {entry[2]["step"] for entry in [*self._pending, *self._landed]}

    def _issue_host_copies(self) -> None:
        """Recorder thread: copy the staged slots whose launch-stream event has completed to
        the host, one non-blocking copy per run of consecutive slots (slots are taken and
        returned in ring order, so pending slots are consecutive but for the wrap)."""
        ready = []
        # one C-level snapshot: the engine thread appends to the deque meanwhile
        for entry in list(itertools.islice(self._pending, self._issued, None)):
            if not self.events[entry[0]].query():
                break
            ready.append(entry)
        if not ready:
            return
        if not self._thread_on_device:
            # A new thread's current device is 0; the stream switch below would make it
            # look there (and could open a context on GPU 0 from a rank that runs on
            # another GPU). This thread only ever copies from the ring's device.
            self._torch.cuda.set_device(self.staging.device)
            self._thread_on_device = True
        with self._torch.cuda.stream(self._copy_stream):
            for start, stop in consecutive_runs([entry[0] for entry in ready]):
                self.host[start:stop].copy_(self.staging[start:stop], non_blocking=True)
            done = self._make_event(device=self.staging.device)
            done.record()
        for entry in ready:
            entry[3] = done
        self._issued += len(ready)

    def reap_raw(self) -> list[tuple[bytes, tuple[int, ...], Any]]:
        """Completed captures in launch order, each the int32 bytes of its slot and the
        vector lengths in it; recorder thread."""
        if not self.cuda:
            landed = self._landed
            return [landed.popleft() for _ in range(len(landed))]
        self._issue_host_copies()
        out = []
        host = self._host_view()  # a view of host memory: nothing to wait for
        # the slots of one issue share its copy event: asked once, not once per slot (a
        # call into the driver each, beside the engine thread's launches)
        asked, landed = None, False
        while self._pending:
            i, lengths, tag, copied = self._pending[0]
            if copied is None:
                break
            if copied is not asked:
                asked, landed = copied, copied.query()
            if not landed:
                break
            self._issued -= 1
            self._pending.popleft()
            if min(lengths) < 0:
                raw, lengths = _from_words(host[i], lengths)
            else:
                raw = host[i, : sum(lengths)].tobytes()
            self._free.append(i)
            out.append((raw, lengths, tag))
        return out

    def reap(self) -> list[tuple[list[np.ndarray], Any]]:
        """Completed captures in launch order, as int32 arrays; recorder thread."""
        out = []
        for raw, lengths, tag in self.reap_raw():
            flat = np.frombuffer(bytearray(raw), dtype=np.int32)
            arrays, start = [], 0
            for n in lengths:
                arrays.append(flat[start : start + n])
                start += n
            out.append((arrays, tag))
        return out
