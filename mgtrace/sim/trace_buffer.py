"""Steps buffered per rank and table, handed to the trace writer many at a time.

Per step the simulator records ~400 rows in a few chunks of a dozen columns. Handed over one
step at a time, the writer pays per (chunk, column) Python overhead and converts Python lists
value by value. Here chunks are only collected; every ``steps_per_write`` steps each table of
each rank becomes one chunk with a ``step`` column (``TraceWriter.write_steps``), in the
writer's cheap column forms: numeric columns as numpy arrays, nullable ones as masked arrays,
categorical strings as integer codes, a string repeated over the whole chunk as one ``str``.
The rows, their order within a step and their values are those ``write_step`` would record.

Ownership: chunks are kept by reference until the flush, as the writer itself does.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain, repeat
from typing import Any

import numpy as np
import pyarrow as pa

from mgtrace.schemas.tables import TABLES, categories_of
from mgtrace.schemas.writer import TraceWriter
from mgtrace.sim.columns import COMPACT_COLUMNS, GroupIds, ReqIds
from mgtrace.sim.runner_common import Nullable

Columns = Mapping[str, Any]

NUM, CAT, STR, OTHER = range(4)


def _field_kinds() -> dict[str, dict[str, tuple[int, Any]]]:
    """Per table and column: how its chunks are joined, and the numpy dtype or categories."""
    out: dict[str, dict[str, tuple[int, Any]]] = {}
    for name, spec in TABLES.items():
        if not spec.per_step:
            continue
        kinds: dict[str, tuple[int, Any]] = {}
        for f in spec.schema:
            if f.name in ("rank", "step"):
                continue
            t = f.type
            if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
                kinds[f.name] = (NUM, np.dtype(t.to_pandas_dtype()))
            elif categories_of(f):
                cats = categories_of(f)
                kinds[f.name] = (CAT, {c: i for i, c in enumerate(cats)})
            elif pa.types.is_string(t):
                kinds[f.name] = (STR, None)
            else:
                kinds[f.name] = (OTHER, None)
        out[name] = kinds
    return out


_KINDS = _field_kinds()


def _rows(columns: Columns) -> int:
    """Rows of a chunk, as the writer counts them: scalars broadcast, all-scalar is one row."""
    for v in columns.values():
        t = type(v)
        if t is np.ndarray and v.ndim:
            return v.shape[0]
        if t in _SEQUENCES:
            return len(v)
    return 1


_NONE = type(None)
_SEQUENCES = frozenset((list, tuple, np.ndarray, np.ma.MaskedArray, Nullable, GroupIds, ReqIds))
_ARRAY_ONLY = frozenset((np.ndarray,))
_LIST_ONLY = frozenset((list,))
_ARRAYS_OR_NONE = frozenset((np.ndarray, Nullable, _NONE))
_NONE_ONLY = frozenset((_NONE,))
_GROUP_IDS_OR_NONE = frozenset((GroupIds, _NONE))
_REQ_IDS_ONLY = frozenset((ReqIds,))
_STR_ONLY = frozenset((str,))


def _is_scalar(v: Any) -> bool:
    return type(v) not in _SEQUENCES


def _join_numeric(values: list[Any], counts: np.ndarray, dtype: np.dtype, types: set[type]) -> Any:
    """One array (masked where a value is null) from per-chunk arrays, lists and scalars.

    ``types`` is the set of the values' types (one pass over them picks the path).
    """
    if types == _ARRAY_ONLY:  # the common case: one concatenation
        joined = np.concatenate(values)
        if joined.dtype != object:
            return joined.astype(dtype, copy=False)
    if types <= _ARRAYS_OR_NONE:
        joined = _join_arrays(values, counts, dtype, types)
        if joined is not None:
            return joined
    if types == _LIST_ONLY:  # per-row Python values (row moves): one conversion
        return _join_number_lists(values, dtype)
    if types.isdisjoint(_SEQUENCES):
        if _NONE in types:
            mask = np.array([v is None for v in values])
            data = np.array([0 if v is None else v for v in values], dtype)
            return np.ma.MaskedArray(np.repeat(data, counts), np.repeat(mask, counts))
        return np.repeat(np.array(values, dtype), counts)
    data: list[np.ndarray] = []
    masks: list[np.ndarray | None] = []
    for v, n in zip(values, counts.tolist(), strict=True):
        t = type(v)
        if t is np.ndarray and v.dtype != object:
            data.append(v)
            masks.append(None)
        elif t is Nullable:
            data.append(v.data)
            masks.append(v.mask)
        elif t is np.ma.MaskedArray:
            data.append(np.ma.getdata(v))
            masks.append(np.ma.getmaskarray(v))
        elif v is None:
            data.append(np.zeros(n, dtype))
            masks.append(np.ones(n, bool))
        elif _is_scalar(v):
            data.append(np.full(n, v, dtype))
            masks.append(None)
        else:
            items = v.tolist() if t is np.ndarray else list(v)
            if any(x is None for x in items):
                data.append(np.array([0 if x is None else x for x in items], dtype))
                masks.append(np.array([x is None for x in items]))
            else:
                data.append(np.array(items, dtype))
                masks.append(None)
    joined = np.concatenate(data).astype(dtype, copy=False)
    if all(m is None for m in masks):
        return joined
    mask = np.concatenate(
        [np.zeros(len(d), bool) if m is None else m for d, m in zip(data, masks, strict=True)]
    )
    return np.ma.MaskedArray(joined, mask)


def _join_number_lists(values: list[list[Any]], dtype: np.dtype) -> Any:
    """Lists of numbers and None (null) as one array, masked where a value is null."""
    flat = list(chain.from_iterable(values))
    if not any(x is None for x in flat):
        return np.array(flat, dtype)
    data = np.array([0 if x is None else x for x in flat], dtype)
    return np.ma.MaskedArray(data, np.array([x is None for x in flat], bool))


def _join_arrays(
    values: list[Any], counts: np.ndarray, dtype: np.dtype, types: set[type]
) -> Any | None:
    """Arrays, ``Nullable`` columns and chunks without the column (null rows) joined by a
    few whole-buffer operations, not one per chunk; None when an array holds objects."""
    given = [v for v in values if v is not None]
    arrays = [v.data if type(v) is Nullable else v for v in given] if Nullable in types else given
    joined = np.concatenate(arrays)
    if joined.dtype == object:  # an array of objects among them (the result says so)
        return None
    null = None
    if Nullable in types:
        null = np.concatenate(
            [v.mask if type(v) is Nullable else np.zeros(len(v), bool) for v in given]
        )
    if _NONE not in types:
        joined = joined.astype(dtype, copy=False)
        return joined if null is None else np.ma.MaskedArray(joined, null)
    absent = np.repeat(np.array([v is None for v in values]), counts)
    present = ~absent
    data = np.zeros(len(absent), dtype)
    data[present] = joined
    if null is not None:
        absent[present] = null
    return np.ma.MaskedArray(data, absent)


_UNKNOWN = -2  # a scalar outside the categories (codes are >= -1)


class _NotACategory(Exception):
    """A string outside the column's categories: the column goes over as strings."""


def _code(index: dict[str, int], v: Any) -> int:
    if v is None:
        return -1  # the writer decodes an out-of-range code to null
    try:
        return index[v]
    except KeyError:
        raise _NotACategory(v) from None


def _join_categorical(
    values: list[Any], counts: np.ndarray, index: dict[str, int], types: set[type]
) -> Any:
    """Integer codes into the categories from codes, strings, string lists and None."""
    try:
        if types == _LIST_ONLY:  # per-row names (row moves): one pass over all of them
            return np.array([_code(index, x) for x in chain.from_iterable(values)], np.int32)
        if types.isdisjoint(_SEQUENCES):  # one value per chunk
            get = index.get
            codes = [-1 if v is None else get(v, _UNKNOWN) for v in values]
            if _UNKNOWN in codes:
                raise _NotACategory(values[codes.index(_UNKNOWN)])
            return np.repeat(np.array(codes, np.int32), counts)
        parts: list[np.ndarray] = []
        for v, n in zip(values, counts.tolist(), strict=True):
            t = type(v)
            if t is np.ndarray and v.dtype.kind in "iu":
                parts.append(v)
            elif _is_scalar(v):
                parts.append(np.full(n, _code(index, v), np.int32))
            else:
                items = v.tolist() if t is np.ndarray else v
                parts.append(np.array([_code(index, x) for x in items], np.int32))
        return np.concatenate(parts).astype(np.int32, copy=False)
    except _NotACategory:
        cats = list(index)
        return _join_list(
            [
                [cats[c] if 0 <= c < len(cats) else None for c in v.tolist()]
                if type(v) is np.ndarray and v.dtype.kind in "iu"
                else v
                for v in values
            ],
            counts,
        )


def _join_group_ids(values: list[GroupIds | None], counts: np.ndarray) -> pa.Array:
    """One ``list<list<int32>>`` column from sparse chunks (None: a chunk without the
    column, null rows): offsets in numpy, and a Python step only per row that got blocks."""
    rows = int(counts.sum())
    lengths = np.zeros(rows, np.int32)
    absent = np.zeros(rows, bool)
    flat: list[int] = []
    base = 0
    for v, n in zip(values, counts.tolist(), strict=True):
        if v is None:
            absent[base : base + n] = True
        else:
            for row, ids in v.ids.items():
                lengths[base + row] = len(ids)
                flat.extend(ids)
        base += n
    inner_offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(lengths, out=inner_offsets[1:])
    inner = pa.ListArray.from_arrays(pa.array(inner_offsets), pa.array(flat, pa.int32()))
    outer_offsets = np.arange(rows + 1, dtype=np.int32)
    mask = pa.array(absent) if absent.any() else None
    return pa.ListArray.from_arrays(pa.array(outer_offsets), inner, mask=mask)


def _join_req_ids(values: list[ReqIds]) -> pa.DictionaryArray:
    """Request ids as codes into the ids of the requests numbered between the lowest and
    the highest code (the requests live in these steps, a short window of the run)."""
    codes = np.concatenate([v.codes for v in values])
    if not len(codes):
        return pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    lo, hi = int(codes.min()), int(codes.max())
    # the longest (newest) array holds every id the others hold; an empty chunk may
    # carry an empty one
    names = max((v.names for v in values), key=len)
    indices = pa.array((codes - lo).astype(np.int32, copy=False))
    # codes - lo lies in [0, hi - lo] by construction: no need to validate the indices
    return pa.DictionaryArray.from_arrays(
        indices, pa.array(names[lo : hi + 1].tolist(), pa.string()), safe=False
    )


def _join_list(values: list[Any], counts: np.ndarray) -> list[Any]:
    out: list[Any] = []
    for v, n in zip(values, counts.tolist(), strict=True):
        if _is_scalar(v):
            out.extend([v] * n)
        elif type(v) is np.ndarray:
            out.extend(v.tolist())
        else:
            out.extend(v)
    return out


def _join_string(values: list[Any], counts: np.ndarray) -> Any:
    """A string repeated over every row stays one ``str``; else a list."""
    first = values[0]
    if type(first) is str and all(v == first and type(v) is str for v in values):
        return first
    return _join_list(values, counts)


class _TableBuffer:
    __slots__ = ("chunks", "counts", "dicts", "names", "steps")

    def __init__(self) -> None:
        self.chunks: list[Columns] = []
        self.counts: list[int] = []
        self.steps: list[int] = []
        self.names: set[str] = set()  # the columns some chunk gives
        self.dicts = True  # every chunk is a dict (its get can be mapped over them)

    def add(self, step: int, columns: Columns) -> None:
        self.chunks.append(columns)
        self.counts.append(_rows(columns))
        self.steps.append(step)
        self.names.update(columns)
        if type(columns) is not dict:
            self.dicts = False

    def column(self, name: str) -> list[Any]:
        """The column's value in every chunk, None where a chunk does not give it."""
        chunks = self.chunks
        if self.dicts:
            return list(map(dict.get, chunks, repeat(name, len(chunks))))
        return [c.get(name) for c in chunks]

    def to_columns(self, kinds: dict[str, tuple[int, Any]]) -> dict[str, Any]:
        counts = np.asarray(self.counts, np.int64)
        out: dict[str, Any] = {"step": np.repeat(np.asarray(self.steps, np.int64), counts)}
        for name, (kind, info) in kinds.items():
            if name not in self.names:
                continue  # the writer records nulls for a column nobody gave
            values = self.column(name)
            types = set(map(type, values))
            if types == _NONE_ONLY:
                continue  # given as None everywhere: as above
            if kind == NUM:
                out[name] = _join_numeric(values, counts, info, types)
            elif kind == CAT:
                out[name] = _join_categorical(values, counts, info, types)
            elif kind == STR:
                if types == _REQ_IDS_ONLY:
                    out[name] = _join_req_ids(values)
                elif types == _STR_ONLY and values.count(values[0]) == len(values):
                    out[name] = values[0]  # one string over every row stays one str
                else:
                    values = [v.tolist() if type(v) is ReqIds else v for v in values]
                    out[name] = _join_string(values, counts)
            elif types <= _GROUP_IDS_OR_NONE:
                out[name] = _join_group_ids(values, counts)
            else:
                out[name] = _join_list(
                    [v.tolist() if type(v) in COMPACT_COLUMNS else v for v in values], counts
                )
        return out


class StepBuffer:
    """Collect steps per rank; hand them to ``writer`` every ``steps_per_write`` steps."""

    def __init__(self, writer: TraceWriter, steps_per_write: int = 64) -> None:
        self.writer = writer
        self.steps_per_write = max(1, steps_per_write)
        self._tables: dict[int, dict[str, _TableBuffer]] = {}
        self._span: dict[int, list[int]] = {}  # rank -> [first, last] buffered step
        self._steps = 0

    def add(self, rank: int, step: int, table: str, columns: Columns) -> None:
        """One chunk of a step's table (several chunks of one table keep their order)."""
        tables = self._tables.get(rank)
        if tables is None:
            tables = self._tables[rank] = {}
        buf = tables.get(table)
        if buf is None:
            buf = tables[table] = _TableBuffer()
        buf.add(step, columns)
        span = self._span.get(rank)
        if span is None:
            self._span[rank] = [step, step]
        else:
            span[1] = step

    def end_step(self) -> None:
        """Call once per step after its chunks: flushes every ``steps_per_write`` steps."""
        self._steps += 1
        if self._steps >= self.steps_per_write:
            self.flush()

    def flush(self) -> None:
        """Hand everything buffered to the writer (also at the end and on interruption)."""
        tables_by_rank, spans = self._tables, self._span
        self._tables, self._span, self._steps = {}, {}, 0
        for rank in sorted(spans):
            first, last = spans[rank]
            bulk = {
                name: buf.to_columns(_KINDS[name])
                for name, buf in tables_by_rank.get(rank, {}).items()
            }
            self.writer.write_steps(rank, first, last, bulk)


__all__ = ["StepBuffer"]
