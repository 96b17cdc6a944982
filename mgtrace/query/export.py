"""Writing query results as CSV, JSON or Parquet: whole files or nothing."""

from __future__ import annotations

import functools
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from mgtrace.atomic import atomic_write
from mgtrace.errors import OutputError

FORMATS = ("table", "csv", "json", "parquet")


def _json_default(value: Any) -> Any:
    return str(value)


def _flat(column: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """A list, struct or map column as JSON text (CSV has no cell for nested values, e.g.
    ``sched.new_block_ids``); any other column as it is."""
    if not pa.types.is_nested(column.type):
        return column
    return pa.array(
        [None if v is None else json.dumps(v, default=_json_default) for v in column.to_pylist()],
        pa.string(),
    )


def _interval_text(column: pa.ChunkedArray) -> pa.Array:
    """An interval column as ISO 8601 durations (P1M2DT3.5S): one text in CSV and JSON."""
    return pa.array(
        [
            None if v is None else f"P{v.months}M{v.days}DT{v.nanoseconds / 1e9:g}S"
            for v in column.to_pylist()
        ],
        pa.string(),
    )


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


def _write_json(table: pa.Table, fh: IO[bytes]) -> None:
    table = intervals_as_text(table)
    text = json.dumps(table.to_pylist(), default=_json_default, indent=1)
    fh.write(text.encode() + b"\n")


def _write_parquet(table: pa.Table, fh: IO[bytes]) -> None:
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
    if path.exists() and not force:
        raise OutputError(f"{path} already exists; pass --force to overwrite it")
    if path.exists() and path.is_dir():
        raise OutputError(f"{path} is a directory; give a file name")
    if not path.parent.exists():
        raise OutputError(f"the directory {path.parent} does not exist")


def export_table(table: pa.Table, fmt: str, output: Path | None) -> None:
    """Write ``table`` in ``fmt`` to ``output`` (atomically) or to stdout."""
    writer = functools.partial(_write_as, fmt)
    if output is None:
        if fmt == "parquet":
            raise OutputError("--format parquet needs -o FILE")
        buf = io.BytesIO()
        writer(table, buf)
        sys.stdout.buffer.write(buf.getvalue())
        sys.stdout.flush()
        return
    atomic_write(output, lambda fh: writer(table, fh))
