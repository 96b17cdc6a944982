"""Writing query results as CSV, JSON or Parquet: whole files or nothing.

JSON is strict JSON: NaN and infinities become null, and a column name that repeats gets a
suffix (a, a_1), since an object holds a key once. A BLOB is its bytes in hex in JSON and
CSV, an interval ISO 8601 text (inside lists and structs too).
"""

from __future__ import annotations

import functools
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from mgtrace.atomic import atomic_write, is_a_stream
from mgtrace.errors import OutputError
from mgtrace.outputs import require_output_folder, trace_holding

FORMATS = ("table", "csv", "json", "parquet")


def _json_default(value: Any) -> Any:
    return str(value)


def _json_value(value: Any) -> Any:
    """``value`` as strict JSON holds it: no NaN or infinity (JSON has none), bytes as hex
    (not Python's b'..'), nested values alike; the rest as ``json`` writes it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, pa.MonthDayNano):  # a tuple, but an interval: ISO 8601 as on top
        return _iso_duration(value)
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def _json_text(value: Any, **kwargs: Any) -> str:
    return json.dumps(_json_value(value), default=_json_default, allow_nan=False, **kwargs)


def unique_names(names: list[str]) -> list[str]:
    """``names`` with a repeat suffixed _1, _2, ... (a name not taken by another column)."""
    taken = set(names)
    out: list[str] = []
    seen: set[str] = set()
    for name in names:
        new, i = name, 0
        while new in seen or (i and new in taken):
            i += 1
            new = f"{name}_{i}"
        seen.add(new)
        out.append(new)
    return out


def _flat(column: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """A list, struct or map column as JSON text (CSV has no cell for nested values, e.g.
    ``sched.new_block_ids``), a BLOB as hex (as in JSON: its bytes need not be text); any
    other column as it is."""
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        return pa.array([None if v is None else v.hex() for v in column.to_pylist()], pa.string())
    if not pa.types.is_nested(column.type):
        return column
    return pa.array(
        [None if v is None else _json_text(v) for v in column.to_pylist()],
        pa.string(),
    )


def _interval_text(column: pa.ChunkedArray) -> pa.Array:
    """An interval column as ISO 8601 durations (P1M2DT3.5S): one text in CSV and JSON."""
    return pa.array(
        [None if v is None else _iso_duration(v) for v in column.to_pylist()], pa.string()
    )


def with_iso_intervals(value: Any) -> Any:
    """``value`` with the intervals inside its lists and structs as ISO 8601 text, for a
    terminal cell (Python would show each as ``MonthDayNano(months=...)``)."""
    if isinstance(value, pa.MonthDayNano):
        return _iso_duration(value)
    if isinstance(value, dict):
        return {k: with_iso_intervals(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_iso_intervals(v) for v in value]
    return value


def _iso_duration(v: pa.MonthDayNano) -> str:
    return f"P{v.months}M{v.days}DT{v.nanoseconds / 1e9:g}S"


def intervals_as_text(table: pa.Table) -> pa.Table:
    """``table`` with its interval columns as ISO 8601 text (Arrow's CSV and Parquet writers
    have no form for them; JSON and the terminal would show a tuple)."""
    if not any(pa.types.is_interval(c.type) for c in table.columns):
        return table
    columns = [_interval_text(c) if pa.types.is_interval(c.type) else c for c in table.columns]
    return pa.Table.from_arrays(columns, names=table.column_names)


def _write_csv(table: pa.Table, fh: IO[bytes]) -> None:
    table = intervals_as_text(table)
    columns = [_flat(c) for c in table.columns]
    pacsv.write_csv(pa.Table.from_arrays(columns, names=table.column_names), fh)


def python_rows(table: pa.Table, shown_as: str) -> list[dict]:
    """``table``'s rows as Python values; one sentence where a value has none (a timestamp
    in nanoseconds, an infinite date, a year before 1)."""
    try:
        return table.to_pylist()
    except (ValueError, OverflowError) as exc:  # ArrowInvalid is a ValueError too
        raise OutputError(
            f"a value of the result cannot be shown as {shown_as} ({str(exc).split('. ')[0]}); "
            "CAST that column to VARCHAR in the query"
        ) from None


# Rows turned into Python values at a time by the JSON writer: a long result (millions of
# rows) is never held as Python objects, nor as one string, all at once.
JSON_CHUNK_ROWS = 8192


def _write_json(table: pa.Table, fh: IO[bytes]) -> None:
    """A JSON array of one object a row, as ``json.dumps(rows, indent=1)`` writes it,
    written a chunk of rows at a time."""
    table = intervals_as_text(table)
    table = table.rename_columns(unique_names(table.column_names))
    if table.num_rows == 0:
        fh.write(b"[]\n")
        return
    fh.write(b"[\n")
    for start in range(0, table.num_rows, JSON_CHUNK_ROWS):
        rows = python_rows(table.slice(start, JSON_CHUNK_ROWS), "json")
        # each object one level in: every line of it one more space (JSON text holds no
        # newline but between its tokens)
        text = ",\n".join(" " + _json_text(row, indent=1).replace("\n", "\n ") for row in rows)
        fh.write((",\n" if start else "").encode() + text.encode())
    fh.write(b"\n]\n")


def _write_parquet(table: pa.Table, fh: IO[bytes]) -> None:
    # Parquet keeps repeated names, but readers cannot select such a column by name
    table = intervals_as_text(table)
    table = table.rename_columns(unique_names(table.column_names))
    pq.write_table(table, fh, compression="zstd")


_WRITERS: dict[str, Callable[[pa.Table, IO[bytes]], None]] = {
    "csv": _write_csv,
    "json": _write_json,
    "parquet": _write_parquet,
}


def _write_as(fmt: str, table: pa.Table, fh: IO[bytes]) -> None:
    """Write ``table`` in ``fmt``; a column type the format cannot hold is one sentence."""
    try:
        _WRITERS[fmt](table, fh)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as exc:  # pyarrow's own errors
        raise OutputError(
            f"the result cannot be written as {fmt} ({exc}); CAST that column to VARCHAR in "
            "the query"
        ) from None


def check_output_path(path: Path, *, force: bool) -> None:
    """Refuse before any work is done, so a bad -o never costs a long query."""
    if path.is_dir():  # said first: --force would not help
        raise OutputError(f"{path} is a directory; give a file name")
    if is_a_stream(path):  # /dev/stdout, a FIFO: written in place, nothing to lose
        return
    holder = trace_holding(path)
    if holder is not None:
        raise OutputError(f"{path} lies inside the trace {holder}; write it elsewhere")
    if path.exists() and not force:
        raise OutputError(f"{path} already exists; pass --force to overwrite it")
    require_output_folder(path, str(path))  # a file or /proc above it fails here, not later


def export_table(table: pa.Table, fmt: str, output: Path | None) -> None:
    """Write ``table`` in ``fmt`` to ``output`` (atomically) or to stdout."""
    writer = functools.partial(_write_as, fmt)
    if output is None:
        if fmt == "parquet":
            raise OutputError("--format parquet needs -o FILE")
        buf = io.BytesIO()  # all or nothing: a value that cannot be written fails first
        writer(table, buf)
        sys.stdout.buffer.write(buf.getbuffer())  # not a copy of a long output
        sys.stdout.flush()
        return
    atomic_write(output, lambda fh: writer(table, fh))
