"""The byte form of raw step records on their way to the assembler process.

Records are pickled (protocol 5) with one change: a numpy array travels as its raw bytes,
dtype and shape. numpy's own reduction costs several microseconds per array in Python,
while ``tobytes`` is a memcpy; a step record holds a dozen small arrays, and this pickling
runs on the recorder thread, which shares the engine's GIL.

A scheduler output is reduced to one tuple of the plain containers the step tables read
(references to the scheduler's own lists and dicts, no per-request Python), so that no
vLLM object and no prompt token list crosses the pipe; the assembler side rebuilds the
attribute view the tables read.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np

HEADER = struct.Struct("<Q")  # frame length, then the pickle
_INT32 = np.dtype(np.int32)
_INT32_STR = _INT32.str
_DTYPE_STRS: dict[np.dtype, str] = {}  # few: the dtypes of the arrays the hooks copy


def _array_from(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # a bytearray keeps the array writable, as the engine-side copy was
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _reduce_array(a: np.ndarray) -> tuple[Any, tuple[bytes, str, tuple[int, ...]]]:
    return _array_from, (a.tobytes(), a.dtype.str, a.shape)


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[np.ndarray] = _reduce_array


# Messages per pickle call. A frame of many steps goes out as several pickles, joined: one
# pickle call is C that never lets go of the GIL, while between calls the engine thread can
# take it back at its next switch request. One pickle of a 256-step frame held the engine
# thread up to 14.7 ms on a slow GPU host (``bench_recorder.py``'s longest step).
MESSAGES_PER_PICKLE = 64  # about 20 steps: two launch captures and one record each


def encode(messages: list[tuple[Any, ...]]) -> bytes:
    """Frames for ``messages``, each the length header and a pickle of at most
    ``MESSAGES_PER_PICKLE`` of them, joined (the assembler reads frames one after another)."""
    if len(messages) <= MESSAGES_PER_PICKLE:
        return _frame(messages)
    n = MESSAGES_PER_PICKLE
    return b"".join([_frame(messages[i : i + n]) for i in range(0, len(messages), n)])


def _frame(messages: list[tuple[Any, ...]]) -> bytes:
    buf = io.BytesIO()
    buf.write(HEADER.pack(0))
    pickler = pickle.Pickler(buf, protocol=5)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(messages)
    view = buf.getbuffer()
    HEADER.pack_into(view, 0, len(view) - HEADER.size)
    del view
    return buf.getvalue()


def decode(payload: bytes) -> list[tuple[Any, ...]]:
    return pickle.loads(payload)


def take_frames(buf: bytearray) -> list[list[tuple[Any, ...]]]:
    """The messages of each whole frame at the start of ``buf``, in order, removed from it;
    a frame not yet whole stays for the bytes still to come."""
    out, start = [], 0
    while len(buf) - start >= HEADER.size:
        (size,) = HEADER.unpack_from(buf, start)
        end = start + HEADER.size + size
        if len(buf) < end:
            break
        out.append(decode(bytes(buf[start + HEADER.size : end])))
        start = end
    del buf[:start]
    return out


def _new_request(r: Any) -> tuple[Any, ...]:
    plen = getattr(r, "prompt_len", None)
    if plen is None and getattr(r, "prompt_token_ids", None) is not None:
        plen = len(r.prompt_token_ids)
    return r.req_id, plen, r.num_computed_tokens, r.block_ids


def _new_request_view(fields: tuple[Any, ...]) -> SimpleNamespace:
    req_id, plen, computed, block_ids = fields
    return SimpleNamespace(
        req_id=req_id,
        prompt_len=plen,
        prompt_token_ids=None,
        num_computed_tokens=computed,
        block_ids=block_ids,
    )


_BLANKS = [(0,) * k for k in range(257)]


def draft_counts(drafts: dict[str, Any]) -> tuple[list[str], list[int]]:
    """A scheduler's draft tokens per request as (request ids, counts): two C-level copies,
    cheap to compare and to pickle."""
    return list(drafts), list(map(len, drafts.values()))


def drafts_of(ids: list[str], counts: list[int]) -> dict[str, tuple[int, ...]]:
    """The inverse, for the tables: each request's drafts as that many zeros (the tables
    read only the count)."""
    try:
        blanks = list(map(_BLANKS.__getitem__, counts))
    except IndexError:
        blanks = [(0,) * k for k in counts]
    return dict(zip(ids, blanks, strict=True))


# ---------------------------------------------------------------- step records
# The hooks store host arrays raw (see ``raw``), so a record is plain containers and packs
# without a conversion pass; an array stored as is travels by
# ``_reduce_array`` instead. Values that usually repeat from one step to the next (request
# ids, the runner's state-column dicts, the scheduler's per-request dicts) travel as SAME
# when equal to what was last sent under that name; the assembler keeps the last value of
# each name. Both sides see every step in order, so they agree.
SAME = "\0same"
# the runner's state-column dict after one step is usually the one before the next
_REPEATING = {"req_ids": "req_ids", "sidx_before": "sidx", "sidx_after": "sidx"}


# A raw array: a vector of int32 (what the hooks copy but for a few) as its bytes alone;
# any other as (bytes, dtype string, shape). Bytes are not tracked by the garbage collector;
# a step's dozen raw vectors as tuples were two dozen more tracked objects a step, each a
# share of a collection on the engine thread.
Raw = bytes | tuple[bytes, str, tuple[int, ...]]

# Step-record keys whose values are arrays (the hooks store them raw)
_V1_ARRAYS = ("computed", "prompt", "acc_prev", "computed_pre")
_V2_ARRAYS = ("idx", "scheduled", "draft", "prefilling", "bt_counts")
ARRAY_KEYS = (*_V1_ARRAYS, *_V2_ARRAYS)


def raw(a: np.ndarray) -> Raw:
    """A host array as the wire carries it. Taken on the engine thread in place of a copy,
    at about the same cost (0.2 µs for 96 int32), so that the recorder thread, which shares
    the GIL, has nothing left to convert (it saved that thread about 17 µs a step)."""
    dtype = a.dtype
    if dtype is _INT32:  # native int32 (a byte-swapped one is not this)
        # a block table: the str made once (``dtype.str`` formats it anew, 0.5 µs)
        return a.tobytes() if a.ndim == 1 else (a.tobytes(), _INT32_STR, a.shape)
    # the str keeps the byte order (char does not); made once per dtype, as formatting it
    # costs several times the copy
    name = _DTYPE_STRS.get(dtype)
    if name is None:
        name = _DTYPE_STRS[dtype] = dtype.str
    return a.tobytes(), name, a.shape


def _array(a: np.ndarray | Raw) -> np.ndarray:
    """An array from its raw form (an array that travelled as one stays as it is)."""
    kind = type(a)
    if kind is bytes:
        return np.frombuffer(bytearray(a), dtype=np.int32)
    if kind is not tuple:
        return a  # type: ignore[return-value]
    data, dtype, shape = a  # type: ignore[misc]
    out = np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    # the tables take native byte order (Arrow refuses a byte-swapped array)
    return out if out.dtype.isnative else out.astype(out.dtype.newbyteorder("="))


def _array_values(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _array(v) for k, v in d.items()}


class Packer:
    """Engine-process side: step records into their wire form. A record that fails to pack
    changes nothing here (every read that can fail comes before the first back-reference),
    so the two sides stay in step."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def _same(self, name: str, value: Any) -> Any:
        last = self._last.get(name)
        if value is not None and type(value) is type(last):
            try:
                if value == last:
                    return SAME
            except Exception:  # a value without a plain equality
                pass
        self._last[name] = value
        return value

    def reset(self) -> None:
        """Forget what was sent (a frame was dropped): the next values go in full."""
        self._last = {}

    def record(self, rec: dict[str, Any]) -> dict[str, Any]:
        out = dict(rec)
        out.pop("staged", None)  # the post-process launch's tag carries it to the assembler
        so = out.get("so")
        if so is not None:
            out["so"] = self._sched(so)
        for key, name in _REPEATING.items():  # a fixed order: the unpacker follows it
            if key in out:
                out[key] = self._same(name, out[key])
        return out

    def _sched(self, so: Any) -> tuple[Any, ...]:
        """What ``step_tables`` and ``assemble.sched_columns`` read of a scheduler output, as
        one tuple (a namespace costs a reduction call to pickle); the draft tokens only as
        counts, which is all the tables keep of them. Field order: ``Unpacker._sched``."""
        cached = so.scheduled_cached_reqs
        drafts = getattr(so, "scheduled_spec_decode_tokens", None)
        pair = drafts and draft_counts(drafts)
        total = getattr(so, "total_num_scheduled_tokens", None)
        new = [_new_request(r) for r in so.scheduled_new_reqs]
        nst, finished = so.num_scheduled_tokens, so.finished_req_ids
        preempted = getattr(so, "preempted_req_ids", None)
        ids, blocks, computed = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        resumed = getattr(cached, "resumed_req_ids", None)
        # (source, destination) pairs; a NamedTuple each in vLLM, plain tuples here
        copies = getattr(so, "kv_cache_block_copies", None)
        copies = [(int(c[0]), int(c[1])) for c in copies] if copies else None
        same = self._same  # nothing below can fail: a record that fails changes nothing
        if pair:
            pair = (same("so.drafts.ids", pair[0]), same("so.drafts.counts", pair[1]))
        return (
            total,
            same("so.num_scheduled_tokens", nst),
            pair,
            new,
            same("so.cached.req_ids", ids),
            same("so.cached.resumed_req_ids", resumed),
            same("so.cached.new_block_ids", blocks),
            computed,
            finished,
            preempted,
            copies,
        )


class Unpacker:
    """Assembler side: the inverse of ``Packer``."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def _same(self, name: str, value: Any) -> Any:
        if isinstance(value, str) and value == SAME:
            return self._last[name]
        self._last[name] = value
        return value

    def record(self, wire_rec: dict[str, Any]) -> dict[str, Any]:
        rec = dict(wire_rec)
        for key in ARRAY_KEYS:
            if key in rec:
                rec[key] = _array(rec[key])
        for key, name in _REPEATING.items():  # the order they were packed in
            if key in rec:
                rec[key] = self._same(name, rec[key])
        if "bt" in rec:
            rec["bt"] = [(g, _array(rows), _array(counts)) for g, rows, counts in rec["bt"]]
        split = rec.get("mamba")
        if split is not None and split[2] is not None:  # GDN's decode mask, counted here
            decodes = _array(split[2]).astype(bool)
            rec["mamba"] = (int(np.count_nonzero(decodes)), split[1], decodes)
        if "moves" in rec:
            rec["moves"] = [
                (m[0], m[1], m[2], _array(m[3])) if m[0] == "condense" else m for m in rec["moves"]
            ]
        so = rec.get("so")
        if so is not None:
            rec["so"] = self._sched(so)
        return rec

    def _sched(self, fields: tuple[Any, ...]) -> SimpleNamespace:
        """The scheduler-output view the tables read, from ``Packer._sched``'s tuple."""
        total, nst, pair, new, ids, resumed, blocks, computed, finished, preempted, copies = fields
        same = self._same
        if pair:
            pair = drafts_of(same("so.drafts.ids", pair[0]), same("so.drafts.counts", pair[1]))
        return SimpleNamespace(
            total_num_scheduled_tokens=total,
            num_scheduled_tokens=same("so.num_scheduled_tokens", nst),
            scheduled_spec_decode_tokens=pair,
            scheduled_new_reqs=[_new_request_view(r) for r in new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=same("so.cached.req_ids", ids),
                resumed_req_ids=same("so.cached.resumed_req_ids", resumed),
                new_block_ids=same("so.cached.new_block_ids", blocks),
                num_computed_tokens=computed,
            ),
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            kv_cache_block_copies=copies,
        )

    @staticmethod
    def tag(tag: dict[str, Any]) -> dict[str, Any]:
        cpu = tag.get("cpu")
        if cpu:
            tag = {**tag, "cpu": _array_values(cpu)}
        return tag
