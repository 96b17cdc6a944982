"""TraceWriter: turns steps from any source into Parquet parts without blocking the caller.

The caller's side is one bounded deque append: when the queue is full the step is dropped
and counted, never waited for. A background thread validates the steps, batches them per
(table, rank) and writes zstd Parquet parts. Each part is written under a temporary name,
renamed when complete, and followed by an atomic rewrite of the manifest, so a process
killed at any instant leaves a readable trace that lacks at most the part being written.

Ownership: ``write_step`` keeps references to the arrays it is given. A caller that reuses
buffers must hand over copies.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import shutil
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mgtrace import __version__
from mgtrace.atomic import (
    atomic_write,
    clear_stale_siblings,
    hidden_sibling,
    remove_tree,
    replacing_directory,
)
from mgtrace.errors import OutputError
from mgtrace.schemas import ranks
from mgtrace.schemas.manifest import (
    MANIFEST_NAME,
    Manifest,
    PartInfo,
    RunMetadata,
    is_trace_directory,
    load_manifest,
    save_manifest,
)
from mgtrace.schemas.tables import TABLES, TableSpec, categories_of

log = logging.getLogger("mgtrace.writer")

PART_SUFFIX = ".parquet"
TMP_SUFFIX = ".tmp"
APPEND_LOCK = ".append.lock"  # serialises the processes that add parts to a closed trace
WRITING_LOCK = ".writing.lock"  # held by the open TraceWriter, removed when it closes
WRITING_LOCK_TRIES = 50  # 10 ms apart: how long a new writer waits out a probe of the lock
COMPRESSION = "zstd"
IDLE_WAKE_S = 0.25  # the writer thread's longest sleep (steps then wait at most this long)
WAKE_BATCH = 64  # queued single steps that wake the writer thread before IDLE_WAKE_S
BULK_CHUNK_ROWS = 1024  # rows per chunk, on average, from which chunks are not joined

Columns = Mapping[str, Any]
StepTables = Mapping[str, Columns]


@dataclass
class WriterStats:
    steps_queued: int
    steps_written: int
    steps_dropped: int
    malformed_steps: int
    parts: int
    bytes_written: int
    queue_depth: int
    failed: str | None


class MalformedStep(ValueError):
    """A step whose tables do not match the schemas; refused and counted."""


def _column_length(value: Any) -> int | None:
    """Rows a column value holds, or None for a scalar that broadcasts."""
    kind = type(value)
    if kind is list or kind is tuple:
        return len(value)
    if kind is np.ndarray:
        return value.shape[0] if value.ndim else None
    if value is None or isinstance(value, (str, bytes, int, float, bool, np.generic)):
        return None
    return len(value)


@dataclass(frozen=True)
class _ColumnRules:
    """Per table, what a caller may and must pass (precomputed: validation is per step)."""

    allowed: frozenset[str]
    required: frozenset[str]


def _rules(spec: TableSpec) -> _ColumnRules:
    implicit = ("rank", "step") if spec.per_step else ()
    return _ColumnRules(
        allowed=frozenset(n for n in spec.schema.names if n not in implicit),
        required=frozenset(
            f.name for f in spec.schema if not f.nullable and f.name not in implicit
        ),
    )


_RULES = {name: _rules(spec) for name, spec in TABLES.items()}


def _validate_chunk(spec: TableSpec, columns: Columns) -> int:
    """Return the chunk's row count; raise MalformedStep when columns disagree."""
    rules = _RULES[spec.name]
    names = columns.keys()
    if not names <= rules.allowed:
        bad = sorted(names - rules.allowed)
        raise MalformedStep(f"table {spec.name!r} has no column {bad[0]!r}")
    if not rules.required <= names:
        missing = sorted(rules.required - names)
        raise MalformedStep(f"table {spec.name!r} misses required column {missing[0]!r}")
    lengths = {_column_length(v) for v in columns.values()}
    lengths.discard(None)
    if len(lengths) > 1:
        detail = ", ".join(f"{k}={_column_length(v)}" for k, v in columns.items())
        raise MalformedStep(f"table {spec.name!r}: columns disagree on row count ({detail})")
    return lengths.pop() if lengths else 1


def _is_numeric(type_: pa.DataType) -> bool:
    return pa.types.is_integer(type_) or pa.types.is_floating(type_) or pa.types.is_boolean(type_)


def _is_codes(value: Any) -> bool:
    return type(value) is np.ndarray and value.dtype.kind in "iu"


def _numeric_chunks(values: list[Any], counts: list[int], type_: pa.DataType) -> pa.Array | None:
    """Fast path for null-free numbers: all scalars, or arrays / flat lists; else None."""
    np_type = type_.to_pandas_dtype()
    if any(type(v) is np.ma.MaskedArray for v in values):
        return None  # np.concatenate would drop the masks: the masked path keeps them
    try:
        if _column_length(values[0]) is None:
            if any(v is None for v in values):  # numpy would turn None into False or raise
                return None
            scalars = np.asarray(values, dtype=np_type)
            if scalars.shape != (len(values),):
                return None
            return pa.array(np.repeat(scalars, counts), type=type_)
        joined = _join(values)
    except (ValueError, TypeError):
        return None
    if joined.shape != (sum(counts),) or joined.dtype == object:  # object: nulls inside
        return None
    return pa.array(joined.astype(np_type, copy=False), type=type_)


def _masked_numeric_chunks(
    values: list[Any], counts: list[int], type_: pa.DataType
) -> pa.Array | None:
    """Numbers with nulls, vectorised per chunk: arrays, masked arrays, scalars and None.

    Plain lists are left to the generic path (their nulls would need a look at every value).
    """
    np_type = type_.to_pandas_dtype()
    data, masks = [], []
    for v, n in zip(values, counts, strict=True):
        kind = type(v)
        if v is None:
            data.append(np.zeros(n, np_type))
            masks.append(np.ones(n, bool))
        elif kind is np.ndarray and v.ndim == 1 and v.dtype != object:
            data.append(v)
            masks.append(np.zeros(n, bool))
        elif kind is np.ma.MaskedArray:
            data.append(np.ma.getdata(v))
            masks.append(np.ma.getmaskarray(v))
        elif _column_length(v) is None:
            data.append(np.full(n, v, np_type))
            masks.append(np.zeros(n, bool))
        else:
            return None
    return _with_nulls(_join(data).astype(np_type, copy=False), _join(masks), type_)


def _with_nulls(data: np.ndarray, nulls: np.ndarray, type_: pa.DataType) -> pa.Array:
    """``pa.array(data, type=type_, mask=nulls)``, the validity bitmap packed by numpy: Arrow
    reads a mask a value at a time (several times slower). Booleans, whose values are bits
    too, and other dtypes than the column's take ``pa.array``."""
    if pa.types.is_boolean(type_) or data.dtype != type_.to_pandas_dtype() or len(data) == 0:
        return pa.array(data, type=type_, mask=nulls)
    valid = np.packbits(~nulls, bitorder="little")
    buffers = [pa.py_buffer(valid), pa.py_buffer(np.ascontiguousarray(data))]
    return pa.Array.from_buffers(type_, len(data), buffers, null_count=int(np.count_nonzero(nulls)))


def _join(arrays: list[Any]) -> np.ndarray:
    """One array from several; a single one as it is (Arrow then takes it without a copy)."""
    return np.asarray(arrays[0]) if len(arrays) == 1 else np.concatenate(arrays)


def _scalar_string_chunks(values: list[Any], counts: list[int]) -> pa.Array | None:
    """One string (or None) per chunk, repeated: dictionary codes, never decoded here."""
    if not all(v is None or type(v) is str for v in values):
        return None
    uniques: dict[str, int] = {}
    codes = np.fromiter(
        (-1 if v is None else uniques.setdefault(v, len(uniques)) for v in values),
        dtype=np.int32,
        count=len(values),
    )
    repeated = np.repeat(codes, counts)
    dictionary = pa.array(list(uniques), pa.string())
    return _dictionary(repeated, dictionary, repeated < 0 if (codes < 0).any() else None)


def _category_chunks(values: list[Any], categories: tuple[str, ...]) -> pa.Array:
    """Integer codes into a categorical column's values, kept as dictionary codes."""
    codes = _join(values).astype(np.int32, copy=False)
    # a bad code becomes null (checked in numpy: cheaper than three Arrow kernels)
    bad = (codes < 0) | (codes >= len(categories))
    return _dictionary(codes, _category_values(categories), bad if bad.any() else None)


@functools.cache
def _category_values(categories: tuple[str, ...]) -> pa.Array:
    """A categorical column's values as one Arrow array, built once: every part and bulk
    chunk takes it as its dictionary (building it from the tuple costs ~10 us a time)."""
    return pa.array(categories, pa.string())


def _dictionary(
    codes: np.ndarray, values: pa.Array, nulls: np.ndarray | None
) -> pa.DictionaryArray:
    """A string column as codes into its values. Parquet stores a dictionary page either
    way; handing it the dictionary spares decoding every row to a string and hashing it
    back. Readers get plain strings: ``TraceReader`` reads with the table's schema, and
    DuckDB sees a Parquet string column."""
    indices = pa.array(codes, pa.int32(), mask=nulls)
    return pa.DictionaryArray.from_arrays(indices, values)


def _as_type(array: pa.Array, type_: pa.DataType) -> pa.Array:
    """``array`` as a column of ``type_``; a dictionary of ``type_`` values stays one
    (Parquet takes its dictionary as it is)."""
    if array.type == type_:
        return array
    if pa.types.is_dictionary(array.type) and array.type.value_type == type_:
        return array.cast(pa.dictionary(pa.int32(), type_))
    return array.cast(type_)


def _column(values: list[Any], counts: list[int], field: pa.Field) -> pa.Array | pa.ChunkedArray:
    """One column of a part. Numeric chunks and category codes of many rows each (bulk
    hand-overs) become one Arrow chunk each, from their arrays without a copy: joining them
    first copied every value once more. Short chunks (single steps) are joined: an Arrow
    chunk each would cost more than the copy."""
    if (
        len(values) > 1
        and sum(counts) >= BULK_CHUNK_ROWS * len(values)
        and (
            _is_numeric(field.type) or (categories_of(field) and all(_is_codes(v) for v in values))
        )
    ):
        arrays = [_chunks_to_arrow([v], [n], field) for v, n in zip(values, counts, strict=True)]
        return pa.chunked_array(arrays)
    return _chunks_to_arrow(values, counts, field)


def _chunks_to_arrow(values: list[Any], counts: list[int], field: pa.Field) -> pa.Array:
    """Concatenate one column's per-step values (arrays, lists, scalars or None)."""
    type_ = field.type
    if all(isinstance(v, pa.Array) for v in values):  # built by the producer: taken as is
        return pa.concat_arrays([_as_type(v, type_) for v in values])
    if _is_numeric(type_):
        fast = _numeric_chunks(values, counts, type_)
        if fast is None:
            fast = _masked_numeric_chunks(values, counts, type_)
        if fast is not None:
            return fast
    categories = categories_of(field)
    if categories and all(_is_codes(v) for v in values):
        return _category_chunks(values, categories)
    if pa.types.is_string(type_):
        fast = _scalar_string_chunks(values, counts)
        if fast is not None:
            return fast
    flat: list[Any] = []
    for v, n in zip(values, counts, strict=True):
        if _column_length(v) is None:
            flat.extend(itertools.repeat(v.item() if isinstance(v, np.generic) else v, n))
        elif categories and _is_codes(v):
            flat.extend(categories[c] if 0 <= c < len(categories) else None for c in v.tolist())
        else:
            flat.extend(v.tolist() if isinstance(v, np.ndarray) else v)
    return pa.array(flat, type=type_)


class _Pending:
    """Steps of one (table, rank) waiting for the next part, kept as handed over."""

    __slots__ = ("chunks", "counts", "rank", "rows", "spec", "steps")

    def __init__(self, spec: TableSpec, rank: int | None) -> None:
        self.spec = spec
        self.rank = rank
        self.counts: list[int] = []
        self.steps: list[int] = []
        self.chunks: list[Columns] = []
        self.rows = 0

    def add(self, step: int | None, columns: Columns, n: int) -> None:
        """``step`` is the chunk's step; None for a bulk chunk (a ``step`` column) or rows
        of a table without steps."""
        self.rows += n
        self.counts.append(n)
        self.chunks.append(columns)
        self.steps.append(step)

    def to_table(self) -> pa.Table:
        spec = self.spec
        rows = self.rows
        arrays = []
        for f in spec.schema:
            name = f.name
            if spec.per_step and name == "rank":
                arrays.append(pa.array(np.full(rows, self.rank, np.int32)))
            elif spec.per_step and name == "step":
                values = [
                    c["step"] if s is None else s
                    for c, s in zip(self.chunks, self.steps, strict=True)
                ]
                arrays.append(_column(values, self.counts, f))
            else:
                values = [c.get(name) for c in self.chunks]
                if all(v is None for v in values):
                    arrays.append(pa.nulls(rows, f.type))
                else:
                    arrays.append(_column(values, self.counts, f))
            if not f.nullable and arrays[-1].null_count:  # Parquet would refuse the part
                raise MalformedStep(f"table {spec.name!r}: column {name!r} holds nulls")
        return pa.Table.from_arrays(arrays, schema=_with_array_types(spec.schema, arrays))

    def step_numbers(self) -> list[np.ndarray]:
        """The step of every row, per chunk (per-step tables only)."""
        return [
            np.broadcast_to(np.asarray(c["step"] if s is None else s, np.int64), n)
            for c, s, n in zip(self.chunks, self.steps, self.counts, strict=True)
        ]

    def without(self, bad: set[int]) -> tuple[_Pending, int]:
        """These rows less those of the steps ``bad``; and how many rows that left out."""
        kept = _Pending(self.spec, self.rank)
        for c, s, n, steps in zip(
            self.chunks, self.steps, self.counts, self.step_numbers(), strict=True
        ):
            keep = ~np.isin(steps, list(bad))
            if keep.all():
                kept.add(s, c, n)
            elif keep.any():
                kept.add(s, {k: _take(v, keep) for k, v in c.items()}, int(keep.sum()))
        return kept, self.rows - kept.rows

    def by_step(self) -> list[tuple[int, _Pending]]:
        """These rows one step at a time."""
        out = []
        for c, s, n, steps in zip(
            self.chunks, self.steps, self.counts, self.step_numbers(), strict=True
        ):
            for step in np.unique(steps).tolist():
                keep = steps == step
                rows = int(keep.sum())
                one = _Pending(self.spec, self.rank)
                one.add(s, c if rows == n else {k: _take(v, keep) for k, v in c.items()}, rows)
                out.append((step, one))
        return out


def _take(value: Any, keep: np.ndarray) -> Any:
    """The rows ``keep`` of one column value (a scalar applies to every row)."""
    if _column_length(value) is None:
        return value
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value.filter(pa.array(keep))
    if isinstance(value, np.ndarray):
        return value[keep]
    return list(itertools.compress(value, keep))


def _with_array_types(schema: pa.Schema, arrays: list[pa.Array | pa.ChunkedArray]) -> pa.Schema:
    """``schema`` with a dictionary type where a string column came as dictionary codes
    (field names, nullability and metadata kept)."""
    for i, array in enumerate(arrays):
        if pa.types.is_dictionary(array.type) and not pa.types.is_dictionary(schema.field(i).type):
            schema = schema.set(i, schema.field(i).with_type(array.type))
    return schema


# Columns written without a dictionary page. Dictionary pages suit strings, step numbers and
# token and accepted counts (values repeat within a part but follow no pattern); row, slot and
# state-column positions and small counts come in runs and sequences that zstd packs as well
# from plain values, and encoding them through a dictionary took two to three times as long
# (simulated traces: a fifth off the part encoding time at the same size). List columns go
# plain as well (their values are nested leaves, not named here): the same size either way.
PLAIN_COLUMNS = frozenset(
    {
        "rank",
        "group",
        "seq",
        "row",
        "row_a",
        "row_b",
        "batch_row",
        "req_slot",
        "bt_row",
        "state_idx",
        "src_col",
        "prev_state_col",
        "state_col",
        "num_scheduled",
        "num_draft",
        "num_spec",
        "num_prompt",
        "seq_len",
        "is_prefilling",
        "accepted_prev_cpu",
        "num_accepted_cpu",
    }
)


def write_part_file(trace_dir: Path, rel_path: str, table: pa.Table) -> PartInfo:
    """Write one Parquet part atomically (temporary name, then rename) and describe it."""
    sink = pa.BufferOutputStream()
    # Statistics are kept for the key columns that queries prune on. (Integer columns
    # byte-stream split write a fifth quicker and smaller, but only DuckDB releases from 2026
    # read that: traces are shared, so they stay readable by older readers.)
    keys = [n for n in ("rank", "step") if n in table.column_names]
    dictionary = [n for n in table.column_names if n not in PLAIN_COLUMNS]
    pq.write_table(
        table,
        sink,
        compression=COMPRESSION,
        use_dictionary=dictionary,
        write_statistics=keys or False,
    )
    data = sink.getvalue()
    target = trace_dir / rel_path
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, lambda fh: fh.write(memoryview(data)))  # no .tmp left on failure
    steps = table.column("step") if "step" in table.column_names else None
    min_step = max_step = None
    if steps is not None and len(steps) and steps.null_count < len(steps):
        min_step = int(pc.min(steps).as_py())
        max_step = int(pc.max(steps).as_py())
    ranks = table.column("rank") if "rank" in table.column_names else None
    rank = None
    if ranks is not None and len(ranks) and ranks.null_count == 0:
        lo, hi = pc.min(ranks).as_py(), pc.max(ranks).as_py()
        rank = int(lo) if lo == hi else None
    return PartInfo(
        table=table.schema.metadata[b"table"].decode() if table.schema.metadata else "",
        path=rel_path,
        rows=table.num_rows,
        bytes=len(data),
        sha256=hashlib.sha256(memoryview(data)).hexdigest(),
        rank=rank,
        min_step=min_step,
        max_step=max_step,
    )


_OPEN_WRITERS: weakref.WeakSet[TraceWriter] = weakref.WeakSet()


def _drop_inherited_writing_locks() -> None:
    """In a forked child: close the copies of the open writers' lock descriptors. The lock
    is the parent's; a child that kept a copy would hold it for as long as it lives."""
    for writer in list(_OPEN_WRITERS):
        fd, writer._writing_lock = writer._writing_lock, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


os.register_at_fork(after_in_child=_drop_inherited_writing_locks)


@contextlib.contextmanager
def _appending(trace_dir: Path) -> Iterator[None]:
    """Hold the trace's append lock: adding a part reads, extends and rewrites the manifest,
    and two processes doing that at once would each drop the other's part.

    The lock file is removed before the lock is released, so a finished trace holds only
    its own files. A process that waited on a file removed meanwhile holds a lock nobody
    else sees: it finds the path gone or naming another file, and opens the path anew."""
    path = trace_dir / APPEND_LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still locked: no one can hold this file's lock after us
        os.close(fd)  # releases the lock


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def writer_is_open(trace_dir: Path) -> bool:
    """Whether a TraceWriter still has this trace open (in any process): it holds the
    writing lock until it closes, and a writer that was killed holds it no more."""
    try:
        fd = os.open(trace_dir / WRITING_LOCK, os.O_RDONLY)
    except FileNotFoundError:  # closed, or written before writers locked
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def append_table(
    trace_dir: str | Path,
    table_name: str,
    table: pa.Table,
    *,
    tag: str,
    metadata: dict[bytes, bytes] | None = None,
    read_from: Manifest | None = None,
) -> PartInfo:
    """Add one part to an existing, closed trace (replay findings) and update its manifest;
    ``metadata``: key-value pairs kept in the part's footer (what the columns cannot say);
    ``read_from``: the manifest of the trace the part was derived from (a replay's).

    Raises OutputError while the trace's writer is still open: it rewrites the manifest from
    its own copy after every part and on close, which would drop this part's entry; and
    where the trace at ``trace_dir`` is no longer the one ``read_from`` describes (another
    process replaced it, ``simulate --force``, while the replay ran): findings of one run
    added to another would be read as that run's.
    """
    trace_dir = Path(trace_dir)
    spec = TABLES[table_name]
    table = table.cast(spec.schema)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    load_manifest(trace_dir)  # a directory that is no trace is refused before the lock file
    with _appending(trace_dir):
        if writer_is_open(trace_dir):
            raise OutputError("the trace is still being written")
        manifest = load_manifest(trace_dir)  # under the lock: the parts others added
        if read_from is not None and _source_parts(manifest, table_name) != _source_parts(
            read_from, table_name
        ):
            raise OutputError(
                f"another process replaced the trace at {trace_dir} after it was read, "
                f"and these {table_name} are of the trace it replaced"
            )
        if ranks.is_merged(manifest):  # the rank parts stay in the ranks' own manifests
            manifest.parts = ranks.own_parts(manifest.parts)
        rel = f"{table_name}/{tag}{PART_SUFFIX}"
        listed = any(p.path == rel for p in manifest.parts)
        # a part the manifest lists is replaced: its old bytes stay under a hidden name
        # until the manifest that lists the new ones is saved, and come back if it is not
        # (the old manifest beside the new part would make the whole trace unreadable)
        kept = _keep_old_part(trace_dir / rel) if listed else None
        try:
            info = write_part_file(trace_dir, rel, table)
            manifest.parts = [p for p in manifest.parts if p.path != rel] + [info]
            save_manifest(trace_dir, manifest)
        except BaseException:
            with contextlib.suppress(OSError):
                if kept is not None:
                    os.replace(kept, trace_dir / rel)
                elif not listed:  # leave no part, nor folder, that the manifest does not list
                    (trace_dir / rel).unlink(missing_ok=True)
                    (trace_dir / table_name).rmdir()  # only when empty
            raise
        if kept is not None:
            with contextlib.suppress(OSError):
                kept.unlink()
    return info


def _source_parts(manifest: Manifest, table_name: str) -> set[tuple[str, str]]:
    """The parts of a trace's tables other than ``table_name``: what a part added to that
    table was derived from."""
    return {(p.path, p.sha256) for p in manifest.parts if p.table != table_name}


def _keep_old_part(part: Path) -> Path | None:
    """The bytes of a listed ``part`` about to be replaced, under a hidden name beside it
    (a hard link, or a copy where the file system has none); None when the part is gone
    already (a damaged trace, read with --skip-bad-parts), which leaves nothing to keep."""
    if not part.is_file():
        return None
    kept = part.with_name(f".{part.name}.kept")
    kept.unlink(missing_ok=True)
    try:
        os.link(part, kept)
    except OSError:
        shutil.copyfile(part, kept)
    return kept


def refuse_unless_replaceable(path: Path, overwrite: bool) -> bool:
    """Raise OutputError unless a trace may be written at ``path``; True when an old trace
    there is to be replaced. Callers that print before writing check first."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return False
    if path.is_dir() and writer_is_open(path):  # swapping it out would take its later parts
        raise OutputError(
            f"another process is writing a trace at {path}; wait for it to finish, or "
            "write elsewhere"
        )
    if not is_trace_directory(path):  # said first: --force would not help
        raise OutputError(
            f"{path} exists and is not an mgtrace trace; choose another path "
            "(--force replaces only a trace)"
        )
    if not overwrite:
        raise OutputError(f"{path} already exists; pass --force to overwrite it")
    return True


class TraceWriter:
    """Write a trace directory from steps handed over as plain Python / numpy values (or Arrow
    arrays of the column's type or dictionaries of its values, taken as they are).

    ``write_step(rank, step, {"batch_rows": {"batch_row": arr, "req_id": [...], ...}, ...})``
    never blocks and never raises: it returns False when the step was dropped.

    With ``overwrite``, an old trace at ``path`` stays until the new one is whole: the new
    one is written beside it under a hidden name and swapped in by ``close`` (by
    ``install`` after ``close(install=False)``); an incomplete or failed new trace is removed
    and the old one kept. ``path`` is where the trace is being written, ``destination``
    where it ends up.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        run: RunMetadata | None = None,
        source: dict[str, Any] | None = None,
        max_queue_steps: int = 8192,
        rows_per_part: int = 1 << 20,
        flush_seconds: float = 2.0,
        overwrite: bool = False,
        announce_failure: bool = True,
    ) -> None:
        """``announce_failure=False`` leaves saying that the disk refused a part to a caller
        that checks ``failure`` and reports it itself (the writer logs it at once, else)."""
        self.destination = Path(path)
        self.path = self.destination
        self._replacing = False  # True while self.path is a hidden sibling of destination
        self._prepare_directory(overwrite)
        self.manifest = Manifest(
            run=run or RunMetadata(),
            source=dict(source or {}),
            created_unix=time.time(),
            mgtrace_version=__version__,
        )
        self._writing_lock = self._hold_writing_lock()  # before the manifest makes it a trace
        try:
            save_manifest(self.path, self.manifest)
        except OutputError:  # nothing of the trace exists yet: leave no directory it made
            self._release_writing_lock()
            if self._made_directory:
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._max_queue = max_queue_steps
        self._rows_per_part = rows_per_part
        self._flush_seconds = flush_seconds
        self._queue: deque[tuple[Any, ...]] = deque()
        self._dropped: deque[tuple[int, int, int]] = deque()
        self._pending: dict[tuple[str, int | None], _Pending] = {}
        self._part_seq: dict[tuple[str, int | None], int] = {}
        self._steps_queued = 0
        self._steps_written = 0
        self._bytes_written = 0
        self._failed: str | None = None
        self.failure: Exception | None = None  # what stopped the writer, as raised
        self._announce_failure = announce_failure
        self._closing = threading.Event()
        # set by a bulk item, by the WAKE_BATCH-th queued step and on close: the thread sleeps
        # until then, or until a part is due or IDLE_WAKE_S passes, instead of polling a
        # producer that shares its core (a wake-up per single step would cost that producer
        # a lock and a notify per call)
        self._wake = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # guards manifest mutation between threads
        self._thread = threading.Thread(target=self._run, name="mgtrace-writer", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- caller side
    def write_step(self, rank: int, step: int, tables: StepTables) -> bool:
        """Queue one step. Never blocks; False when dropped (queue full or writer closed)."""
        if len(self._queue) >= self._max_queue or self._closed or self._failed is not None:
            self._dropped.append((rank, step, _rows_of(tables)))
            return False
        self._queue.append((rank, step, tables))
        self._steps_queued += 1
        if len(self._queue) == WAKE_BATCH:  # single steps wake the thread a batch at a time
            self._wake.set()
        return True

    def count_dropped_step(self, rank: int, step: int, rows: int = 0) -> None:
        """Count a step that was lost before it reached this writer (a producer upstream
        could not hand it on); it goes into the manifest's drops like the writer's own."""
        self._dropped.append((rank, step, rows))

    def write_steps(self, rank: int, first: int, last: int, tables: StepTables) -> bool:
        """Queue steps ``first..last`` at once: every per-step table carries a ``step`` column.

        For producers that buffer many steps (the simulator): one queue item and one chunk per
        table instead of one per step. Never blocks; False when dropped (all those steps).
        """
        if len(self._queue) >= self._max_queue or self._closed or self._failed is not None:
            for step in range(first, last + 1):
                self._dropped.append((rank, step, 0))
            return False
        self._queue.append((rank, (first, last), tables))
        self._steps_queued += last - first + 1
        self._wake.set()  # a bulk item is many steps: worth a wake-up
        return True

    def write_rows(self, table: str, columns: Columns) -> None:
        """Queue rows of a table that is not keyed by step (requests, findings)."""
        if self._closed:
            raise OutputError("the trace writer is closed")
        self._queue.append((None, None, {table: columns}))
        self._wake.set()

    def set_ground_truth(self, truth: dict[str, Any]) -> None:
        with self._lock:
            self.manifest.ground_truth = truth

    def update_source(self, **fields: Any) -> None:
        with self._lock:
            self.manifest.source.update(fields)

    def count_error(self, kind: str, message: str) -> None:
        """Count an error from the producer (e.g. a hook); the first message is kept."""
        with self._lock:
            entry = self.manifest.errors.setdefault(kind, {"count": 0, "first": message})
            entry["count"] += 1

    def stats(self) -> WriterStats:
        drops = self.manifest.drops
        return WriterStats(
            steps_queued=self._steps_queued,
            steps_written=self._steps_written,
            steps_dropped=drops.steps + len(self._dropped),
            malformed_steps=drops.malformed_steps,
            parts=len(self.manifest.parts),
            bytes_written=self._bytes_written,
            queue_depth=len(self._queue),
            failed=self._failed,
        )

    def close(self, *, complete: bool = True, install: bool = True) -> Manifest:
        """Flush everything queued, mark the trace complete (unless the caller knows it is
        not: an interrupted run, a recording whose engine died) and stop the thread.

        A trace that replaces an old one is then swapped in when it is complete, and removed
        (the old one kept) when it is not; ``install=False`` leaves that to ``install`` or
        ``discard``, for a caller that judges the closed trace first."""
        if self._closed:
            return self.manifest
        self._closed = True
        self._closing.set()
        self._wake.set()
        self._thread.join()
        try:
            with self._lock:
                self._fold_drops()
                self.manifest.complete = complete and self._failed is None
                self.manifest.closed_unix = time.time()
                if self._failed is not None:
                    self.manifest.errors.setdefault("writer", {"count": 1, "first": self._failed})
                save_manifest(self.path, self.manifest)
        except BaseException:
            self._release_writing_lock()
            if self._replacing and install:
                self.discard()
            raise
        self._release_writing_lock()  # the manifest is final: others may add parts now
        if self._replacing and install:
            if self.manifest.complete:
                self.install()
            else:  # an interrupted or failed trace never replaces a whole one
                self.discard()
        return self.manifest

    def install(self) -> None:
        """Swap a closed trace written beside the old one it replaces into its place; on
        failure the old one stays as it was and the new one is removed."""
        if not self._replacing:
            return
        try:
            with replacing_directory(self.path, self.destination):
                pass
        except BaseException as exc:
            self.discard()
            if isinstance(exc, OSError):
                raise OutputError(
                    f"cannot replace {self.destination}: {exc.strerror or exc}; "
                    "the old trace was kept"
                ) from None
            raise
        self._replacing = False
        self.path = self.destination

    def discard(self) -> None:
        """Stop and remove the trace directory: for a writer whose trace cannot be whole
        (the disk refused it), where part of one is worse than none. A trace that was to
        replace an old one goes, and the old one stays."""
        with contextlib.suppress(Exception):
            self.close(complete=False, install=False)
        remove_tree(self.path)
        self._replacing = False

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(complete=exc_type is None)  # an exception means the trace is not whole

    @property
    def kept_old(self) -> bool:
        """Whether an old trace stays at ``destination`` instead of this one (so far)."""
        return self.path != self.destination

    def _hold_writing_lock(self) -> int | None:
        """Lock WRITING_LOCK while this writer is open, so that ``append_table`` refuses the
        trace until the manifest is final; the kernel drops the lock of a killed writer.

        Raises OutputError where another writer holds it, or wrote a trace here meanwhile:
        two writers that both found no trace at ``destination`` (two ``simulate -o`` to one
        new folder) would otherwise write into one folder, each over the other's parts and
        manifest, and leave a trace neither wrote whole."""
        try:
            fd = os.open(self.path / WRITING_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None  # the manifest write that follows says why
        try:
            # a process probing the lock (writer_is_open) holds it for an instant only
            for attempt in itertools.count():
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt >= WRITING_LOCK_TRIES:
                        raise OutputError(
                            f"another process is writing a trace at {self.destination}; "
                            "wait for it to finish, or write elsewhere"
                        ) from None
                    time.sleep(0.01)
                except OSError:  # a file system without flock: written unlocked, as before
                    break
            # the lock of a writer that closed meanwhile (it removes the file, then unlocks)
            # is no lock: its trace is whole in this folder, which this writer found empty
            ours = _same_file(fd, self.path / WRITING_LOCK)
            if not self._replacing and (not ours or (self.path / MANIFEST_NAME).exists()):
                if ours:  # the lock file this writer made in that trace: not one of its files
                    with contextlib.suppress(OSError):
                        (self.path / WRITING_LOCK).unlink()
                raise OutputError(
                    f"another process wrote a trace at {self.destination} meanwhile; pass "
                    "--force to replace it, or write elsewhere"
                )
        except BaseException:
            os.close(fd)
            raise
        _OPEN_WRITERS.add(self)
        return fd

    def _release_writing_lock(self) -> None:
        fd, self._writing_lock = self._writing_lock, None
        if fd is not None:
            with contextlib.suppress(OSError):
                (self.path / WRITING_LOCK).unlink()
            os.close(fd)

    # ---------------------------------------------------------------- writer thread
    def _prepare_directory(self, overwrite: bool) -> None:
        clear_stale_siblings(self.destination)  # may put back an old trace a killed run moved
        if refuse_unless_replaceable(self.destination, overwrite):
            self.path = hidden_sibling(self.destination, "new")
            self._replacing = True
        p = self.path
        self._made_directory = not p.exists()
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create {p}: {exc.strerror}") from None

    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            self._wake.clear()  # before the drain: a wake-up during it is kept for the wait
            drained = self._drain()
            now = time.monotonic()
            pending_rows = max((p.rows for p in self._pending.values()), default=0)
            if pending_rows >= self._rows_per_part or (
                pending_rows and now - last_flush >= self._flush_seconds
            ):
                self._flush()
                last_flush = now
                pending_rows = 0
            if self._closing.is_set() and not self._queue:
                self._flush()
                return
            if not drained:
                due = last_flush + self._flush_seconds - now if pending_rows else IDLE_WAKE_S
                self._wake.wait(min(max(due, 0.001), IDLE_WAKE_S))

    def _drain(self) -> int:
        n = 0
        budget = 4096  # give the flush check a turn under sustained load
        while self._queue and n < budget:
            rank, step, tables = self._queue.popleft()
            n += 1
            if self._failed is not None:
                first, last = step if isinstance(step, tuple) else (step, step)
                if first is not None:
                    self._dropped.extend((rank, s, 0) for s in range(first, last + 1))
                continue
            try:
                self._accept(rank, step, tables)
            except MalformedStep as exc:
                self._refuse(rank, step, tables, str(exc))
            except Exception as exc:  # never let one bad step kill the thread
                self._refuse(rank, step, tables, f"{exc.__class__.__name__}: {exc}")
        return n

    def _accept(self, rank: int | None, step: Any, tables: StepTables) -> None:
        bulk = isinstance(step, tuple)
        checked = []
        for name, columns in tables.items():
            spec = TABLES.get(name)
            if spec is None:
                raise MalformedStep(f"unknown table {name!r}")
            if spec.per_step and step is None:
                raise MalformedStep(f"table {name!r} rows must be written with write_step")
            if bulk and spec.per_step:
                if "step" not in columns:
                    raise MalformedStep(f"bulk rows of table {name!r} need a step column")
                try:  # as numbers now: a flush that fails sorts its rows by step
                    steps = np.asarray(columns["step"], np.int64)
                except (TypeError, ValueError):
                    raise MalformedStep(
                        f"table {name!r}: the step column is not integers"
                    ) from None
                columns = {k: v for k, v in columns.items() if k != "step"} | {"step": steps}
                n = _validate_chunk(spec, {k: v for k, v in columns.items() if k != "step"})
                if _column_length(columns["step"]) not in (None, n):
                    raise MalformedStep(f"table {name!r}: the step column has the wrong length")
            else:
                n = _validate_chunk(spec, columns)
            checked.append((spec, columns, n))
        for spec, columns, n in checked:
            part_rank = rank if spec.per_step else None
            pend = self._pending.get((spec.name, part_rank))
            if pend is None:
                pend = self._pending[(spec.name, part_rank)] = _Pending(spec, part_rank)
            pend.add(None if bulk or not spec.per_step else step, columns, n)
        if bulk:
            self._steps_written += step[1] - step[0] + 1
        elif step is not None:
            self._steps_written += 1

    def _refuse(self, rank: int | None, step: Any, tables: StepTables, why: str) -> None:
        with self._lock:
            drops = self.manifest.drops
            if step is None:
                self.manifest.errors.setdefault("malformed_rows", {"count": 0, "first": why})
                self.manifest.errors["malformed_rows"]["count"] += 1
                return
            first, last = step if isinstance(step, tuple) else (step, step)
            drops.malformed_steps += last - first + 1
            drops.rows += _rows_of(tables)
            for s in range(int(first), int(last) + 1):
                drops.add_step(int(rank or 0), s)
            entry = self.manifest.errors.setdefault("malformed_step", {"count": 0, "first": why})
            entry["count"] += 1
        if entry["count"] == 1:
            log.warning("mgtrace: refused malformed step %s: %s", step, why)

    def _fold_drops(self) -> None:
        drops = self.manifest.drops
        while self._dropped:
            rank, step, rows = self._dropped.popleft()
            drops.steps += 1
            drops.rows += rows
            drops.add_step(int(rank or 0), int(step))

    def _flush(self) -> None:
        """Write what is pending, one part per (table, rank), all or nothing: a step is in
        every table's part or in none, and the manifest names the parts only once all are
        written. A part that cannot be written (disk full) stops the writer: the steps of
        this flush are counted as dropped and its parts already written removed."""
        pending = {k: p for k, p in self._pending.items() if p.counts}
        self._pending = {}
        if not pending:
            return
        if self._failed is not None:
            self._count_unwritten(pending)
            return
        written: list[PartInfo] = []
        for (table, rank), arrow in self._convert(pending):
            seq = self._part_seq.get((table, rank), 0)
            self._part_seq[(table, rank)] = seq + 1
            tag = "all" if rank is None else f"r{rank:03d}"
            rel = f"{table}/{tag}-{seq:06d}{PART_SUFFIX}"
            try:
                written.append(self._write_part(rel, arrow))
            except Exception as exc:  # disk full, permissions: stop writing, say so on close
                self._stop_writing(f"writing {rel} failed: {exc.__class__.__name__}: {exc}", exc)
                for info in written:
                    with contextlib.suppress(OSError):
                        (self.path / info.path).unlink()
                self._count_unwritten(pending)
                return
        with self._lock:
            self._fold_drops()
            self.manifest.parts += written
            self._bytes_written += sum(info.bytes for info in written)
            try:
                save_manifest(self.path, self.manifest)
            except Exception as exc:  # as a part that fails: stop writing, say so
                self._stop_writing(f"updating the manifest failed: {exc}", exc)

    def _stop_writing(self, why: str, exc: Exception) -> None:
        self._failed, self.failure = why, exc
        if self._announce_failure:
            log.error("mgtrace: %s; further steps are dropped and counted", why)

    def _convert(
        self, pending: dict[tuple[str, int | None], _Pending]
    ) -> list[tuple[tuple[str, int | None], pa.Table]]:
        """The pending rows as Arrow tables, in part order. When some do not convert (a
        value of the wrong type, a null where none may be), the steps at fault are found
        one by one and refused, in every table, and the rest is kept; were no single step
        at fault, the flush's steps are all refused. Either way the writer goes on."""
        order = sorted(pending, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
        try:
            return [(key, pending[key].to_table()) for key in order]
        except Exception:
            pass  # rare: look for the steps at fault
        parts = [pending[k] for k in order]
        per_step = [p for p in parts if p.spec.per_step]
        bad, why = _unconvertible_steps(per_step)
        tables, left_out, failure, lost_rows = _convert_without(parts, bad)
        if failure is not None:  # no single step at fault: the flush's steps are refused
            bad, why = _steps_by_rank(per_step), failure
            tables, left_out, _, lost_rows = _convert_without(parts, bad)
        for message in lost_rows:  # rows of a table without steps: only they are lost
            self.count_error("malformed_rows", message)
        for rank, steps in bad.items():
            self._count_refused(rank, sorted(steps), why)
        with self._lock:
            self.manifest.drops.rows += left_out
        return [((t.spec.name, t.rank), table) for t, table in tables]

    def _count_refused(self, rank: int | None, steps: list[int], why: str) -> None:
        """Steps found malformed at a flush: counted as refused, none of their rows kept."""
        self._steps_written -= len(steps)
        with self._lock:
            drops = self.manifest.drops
            drops.malformed_steps += len(steps)
            for s in steps:
                drops.add_step(int(rank or 0), s)
            entry = self.manifest.errors.setdefault("malformed_step", {"count": 0, "first": why})
            entry["count"] += len(steps)
        if entry["count"] == len(steps):
            log.warning("mgtrace: refused malformed steps %s: %s", steps[:8], why)

    def _count_unwritten(self, pending: dict[tuple[str, int | None], _Pending]) -> None:
        """The steps of a flush that could not be written: counted as dropped."""
        steps = _steps_by_rank([p for p in pending.values() if p.spec.per_step])
        with self._lock:
            drops = self.manifest.drops
            for rank, numbers in sorted(steps.items(), key=lambda kv: kv[0] or 0):
                self._steps_written -= len(numbers)
                drops.steps += len(numbers)
                for s in sorted(numbers):
                    drops.add_step(int(rank or 0), s)
            drops.rows += sum(p.rows for p in pending.values() if p.spec.per_step)

    def _write_part(self, rel_path: str, table: pa.Table) -> PartInfo:
        return write_part_file(self.path, rel_path, table)


def _steps_by_rank(pending: list[_Pending]) -> dict[int | None, set[int]]:
    """The steps the rows of these per-step tables belong to, per rank."""
    out: dict[int | None, set[int]] = {}
    for pend in pending:
        steps = out.setdefault(pend.rank, set())
        for numbers in pend.step_numbers():
            steps.update(np.unique(numbers).tolist())
    return out


def _convert_without(
    parts: list[_Pending], bad: dict[int | None, set[int]]
) -> tuple[list[tuple[_Pending, pa.Table]], int, str | None, list[str]]:
    """``parts`` less the rows of the steps ``bad``, converted: the tables, the rows left
    out, why a per-step table still did not convert (None when all did) and why each table
    without steps did not (those are left out)."""
    tables, left_out, failure, lost_rows = [], 0, None, []
    for pend in parts:
        if pend.spec.per_step and bad.get(pend.rank):
            pend, n = pend.without(bad[pend.rank])
            left_out += n
        if not pend.counts:
            continue
        try:
            tables.append((pend, pend.to_table()))
        except Exception as exc:
            why = f"{exc.__class__.__name__}: {exc}"
            if pend.spec.per_step:
                failure = why
            else:
                lost_rows.append(why)
    return tables, left_out, failure, lost_rows


def _unconvertible_steps(pending: list[_Pending]) -> tuple[dict[int | None, set[int]], str]:
    """Per rank, the steps whose rows of some table do not convert on their own; and why
    the last of them did not."""
    bad: dict[int | None, set[int]] = {}
    why = ""
    for pend in pending:
        try:
            pend.to_table()
            continue
        except Exception as exc:
            why = f"{exc.__class__.__name__}: {exc}"
        for step, one in pend.by_step():
            try:
                one.to_table()
            except Exception as exc:
                why = f"{exc.__class__.__name__}: {exc}"
                bad.setdefault(pend.rank, set()).add(step)
    return bad, why


def _rows_of(tables: StepTables) -> int:
    try:
        return sum(_column_length(next(iter(c.values()))) or 1 for c in tables.values() if c)
    except Exception:
        return 0


__all__ = ["TraceWriter", "WriterStats", "append_table", "write_part_file"]
