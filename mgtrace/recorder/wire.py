"""The byte form of raw step records on their way to the assembler process.

Records are pickled (protocol 5) with one change: a numpy array travels as its raw bytes,
dtype and shape. numpy's own reduction costs several microseconds per array in Python,
while ``tobytes`` is a memcpy; a step record holds a dozen small arrays, and this pickling
runs on the recorder thread, which shares the engine's GIL.

A scheduler output is reduced to the plain containers the step tables read (references to
the scheduler's own lists and dicts, no per-request Python), so that no vLLM object and no
prompt token list crosses the pipe.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

HEADER = struct.Struct("<Q")  # frame length, then the pickle


def _array_from(data: bytes, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # a bytearray keeps the array writable, as the engine-side copy was
    return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _reduce_array(a: np.ndarray) -> tuple[Any, tuple[bytes, str, tuple[int, ...]]]:
    return _array_from, (a.tobytes(), a.dtype.str, a.shape)


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[np.ndarray] = _reduce_array


def encode(messages: list[tuple[Any, ...]]) -> bytes:
    """One frame: the length header and the pickled messages."""
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


def _new_request(r: Any) -> SimpleNamespace:
    plen = getattr(r, "prompt_len", None)
    if plen is None and getattr(r, "prompt_token_ids", None) is not None:
        plen = len(r.prompt_token_ids)
    return SimpleNamespace(
        req_id=r.req_id,
        prompt_len=plen,
        prompt_token_ids=None,
        num_computed_tokens=r.num_computed_tokens,
        block_ids=r.block_ids,
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


def sched_view(so: Any) -> SimpleNamespace | None:
    """What ``step_tables`` and ``assemble.sched_columns`` read of a scheduler output; the
    draft tokens only as counts, which is all the tables keep of them."""
    if so is None:
        return None
    cached = so.scheduled_cached_reqs
    drafts = getattr(so, "scheduled_spec_decode_tokens", None)
    return SimpleNamespace(
        total_num_scheduled_tokens=getattr(so, "total_num_scheduled_tokens", None),
        num_scheduled_tokens=so.num_scheduled_tokens,
        scheduled_spec_decode_tokens=drafts and draft_counts(drafts),
        scheduled_new_reqs=[_new_request(r) for r in so.scheduled_new_reqs],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=cached.req_ids,
            resumed_req_ids=getattr(cached, "resumed_req_ids", None),
            new_block_ids=cached.new_block_ids,
            num_computed_tokens=cached.num_computed_tokens,
        ),
        finished_req_ids=so.finished_req_ids,
        preempted_req_ids=getattr(so, "preempted_req_ids", None),
    )


# ---------------------------------------------------------------- step records
# A record's numpy arrays travel as (bytes, dtype char, shape): a few attribute reads here
# instead of a Python-level reduction inside pickle. Values that usually repeat from one
# step to the next (request ids, the runner's state-column dicts, the scheduler's per-request
# dicts) travel as SAME when equal to what was last sent under that name; the assembler
# keeps the last value of each name. Both sides see every step in order, so they agree.
SAME = "\0same"
# the runner's state-column dict after one step is usually the one before the next
_REPEATING = {"req_ids": "req_ids", "sidx_before": "sidx", "sidx_after": "sidx"}
_REPEATING_SO = ("num_scheduled_tokens",)
_REPEATING_CACHED = ("req_ids", "resumed_req_ids", "new_block_ids")


Raw = tuple[bytes, str, tuple[int, ...]]

# Step-record keys whose values are arrays (the hooks may store them raw already)
_V1_ARRAYS = ("computed", "prompt", "acc_prev", "computed_pre")
_V2_ARRAYS = ("idx", "scheduled", "draft", "prefilling", "bt_counts")
ARRAY_KEYS = frozenset((*_V1_ARRAYS, *_V2_ARRAYS))


def raw(a: np.ndarray) -> Raw:
    """A host array as the wire carries it. Taken on the engine thread in place of a copy,
    at about the same cost (0.2 µs for 96 int32), so that the recorder thread, which shares
    the GIL, has nothing left to convert (it saved that thread about 17 µs a step)."""
    return a.tobytes(), a.dtype.char, a.shape


def _raw(a: np.ndarray | Raw) -> Raw:
    return a if type(a) is tuple else (a.tobytes(), a.dtype.char, a.shape)


def _array(raw: tuple[bytes, str, tuple[int, ...]]) -> np.ndarray:
    data, char, shape = raw
    return np.frombuffer(bytearray(data), dtype=char).reshape(shape)


def _raw_values(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _raw(v) if type(v) is np.ndarray else v for k, v in d.items()}


def _array_values(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _array(v) if type(v) is tuple else v for k, v in d.items()}


class Packer:
    """Engine-process side: records and capture tags into their wire form. A record that
    fails to pack changes nothing here, so the two sides stay in step."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}
        self._seen: dict[str, Any] = {}  # this record's new values, kept once it packed

    def _same(self, name: str, value: Any) -> Any:
        last = self._seen.get(name, self._last.get(name))
        if value is not None and type(value) is type(last):
            try:
                if value == last:
                    return SAME
            except Exception:  # a value without a plain equality
                pass
        self._seen[name] = value
        return value

    def reset(self) -> None:
        """Forget what was sent (a frame was dropped): the next values go in full."""
        self._last = {}

    def record(self, rec: dict[str, Any]) -> dict[str, Any]:
        self._seen = {}
        out: dict[str, Any] = {}
        arrays: dict[str, Any] = {}
        for key, value in rec.items():
            if type(value) is np.ndarray or (key in ARRAY_KEYS and type(value) is tuple):
                arrays[key] = _raw(value)
            elif key in _REPEATING:
                continue
            elif key == "staged":
                out[key] = _raw_values(value)
            elif key == "bt":
                out[key] = [(g, _raw(rows), _raw(counts)) for g, rows, counts in value]
            elif key == "moves":
                out[key] = [
                    (m[0], m[1], m[2], _raw(m[3])) if m[0] == "condense" else m for m in value
                ]
            elif key == "so":
                out[key] = self._sched(sched_view(value))
            else:
                out[key] = value
        for key, name in _REPEATING.items():  # a fixed order: the unpacker follows it
            if key in rec:
                out[key] = self._same(name, rec[key])
        out["arrays"] = arrays
        self._last.update(self._seen)
        return out

    def _sched(self, view: SimpleNamespace | None) -> SimpleNamespace | None:
        if view is None:
            return None
        return _map_sched(view, self._same, lambda ids, counts: (ids, counts))

    @staticmethod
    def tag(tag: dict[str, Any]) -> dict[str, Any]:
        cpu = tag.get("cpu")
        if cpu:
            tag = {**tag, "cpu": _raw_values(cpu)}
        return tag


def _map_sched(
    view: SimpleNamespace, same: Callable[[str, Any], Any], drafts: Callable[[Any, Any], Any]
) -> SimpleNamespace:
    """Pass the repeating parts of a scheduler-output view through ``same`` (the back-reference
    of one side of the wire), the draft tokens as ``drafts(ids, counts)``; both sides walk the
    fields in this one order."""
    pair = view.scheduled_spec_decode_tokens
    if pair:
        view.scheduled_spec_decode_tokens = drafts(
            same("so.drafts.ids", pair[0]), same("so.drafts.counts", pair[1])
        )
    for name in _REPEATING_SO:
        setattr(view, name, same("so." + name, getattr(view, name)))
    cached = view.scheduled_cached_reqs
    for name in _REPEATING_CACHED:
        setattr(cached, name, same("so.cached." + name, getattr(cached, name)))
    return view


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
        for key, raw in rec.pop("arrays").items():
            rec[key] = _array(raw)
        for key, name in _REPEATING.items():  # the order they were packed in
            if key in rec:
                rec[key] = self._same(name, rec[key])
        if "staged" in rec:
            rec["staged"] = _array_values(rec["staged"])
        if "bt" in rec:
            rec["bt"] = [(g, _array(rows), _array(counts)) for g, rows, counts in rec["bt"]]
        if "moves" in rec:
            rec["moves"] = [
                (m[0], m[1], m[2], _array(m[3])) if m[0] == "condense" else m for m in rec["moves"]
            ]
        view = rec.get("so")
        if view is not None:
            _map_sched(view, self._same, drafts_of)
        return rec

    @staticmethod
    def tag(tag: dict[str, Any]) -> dict[str, Any]:
        cpu = tag.get("cpu")
        if cpu:
            tag = {**tag, "cpu": _array_values(cpu)}
        return tag
