"""DuckDB over a trace: one view per table, lazily reading the validated Parquet parts."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from mgtrace.errors import UsageError
from mgtrace.schemas.tables import TABLES
from mgtrace.termination import interrupt_on_stop, is_query_interrupt, raise_if_stopped

if TYPE_CHECKING:
    from mgtrace.schemas.reader import TraceReader


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def connect(
    reader: TraceReader, *, connection: duckdb.DuckDBPyConnection | None = None
) -> duckdb.DuckDBPyConnection:
    """Create (or extend) a DuckDB connection with a view per trace table.

    Tables with parts read them through ``read_parquet`` so DuckDB prunes columns and row
    groups; tables without parts become empty views with the right columns.
    """
    con = interrupt_on_stop(connection if connection is not None else duckdb.connect())
    for name, spec in TABLES.items():
        files = reader.part_files(name)
        if files:
            file_list = "[" + ", ".join(_sql_str(str(f)) for f in files) + "]"
            con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet({file_list})")
        else:
            con.execute(f"CREATE OR REPLACE VIEW {name} AS {_empty_select(con, spec.schema)}")
    return con


def _empty_select(con: duckdb.DuckDBPyConnection, schema: pa.Schema) -> str:
    """A query of no rows with the schema's columns, typed as DuckDB reads them from
    Parquet, standing alone: no helper table a user would see in ``SHOW TABLES``."""
    types = con.from_arrow(schema.empty_table()).types
    columns = ", ".join(
        f"CAST(NULL AS {t}) AS {_sql_ident(f.name)}" for f, t in zip(schema, types, strict=True)
    )
    return f"SELECT {columns} LIMIT 0"


def _sql_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _one_error_line(exc: duckdb.Error) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__


_PIVOT = re.compile(r"\bPIVOT\b", re.IGNORECASE)  # at the top, in a WITH or a subquery
_QUERY_FORMS = "SELECT, WITH, FROM, VALUES, PIVOT, DESCRIBE, SHOW or SUMMARIZE"
# past whitespace, -- line comments and /* block comments */
_FIRST_WORD = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*([A-Za-z]+)", re.DOTALL)


def check_read_only(query: str) -> None:
    """Refuse anything but one query: the trace views read files in the trace, and a COPY,
    CREATE, ATTACH, INSTALL or a second statement could overwrite or change them.

    EXPLAIN is refused too: EXPLAIN ANALYZE runs the statement it explains, COPY included.
    DESCRIBE, SHOW and SUMMARIZE parse as queries and stay allowed."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise UsageError(f"the query failed: {_one_error_line(exc)}") from None
    if not statements:
        raise UsageError("the query is empty; give one SELECT query")
    if len(statements) > 1:
        raise UsageError(f"give one query at a time, not {len(statements)} statements")
    kind = statements[0].type
    first = _first_keyword(statements[0].query)
    multi = kind == duckdb.StatementType.MULTI
    # DuckDB expands a PIVOT into several statements (it makes an enum type of the
    # pivoted values first): a query all the same, but only where the statement around the
    # PIVOT is a query (a COPY or INSERT of a PIVOT is typed MULTI as well)
    main = _main_keyword(statements[0].query) if multi else ""
    pivot = multi and _PIVOT.search(statements[0].query) is not None and main in _READ_WORDS
    if kind != duckdb.StatementType.SELECT and not pivot:
        # past a WITH, the statement's own type says what it does (INSERT, DELETE, ...)
        named = (main or kind.name) if first in ("", "WITH") else first
        raise UsageError(f"only a read-only query runs over a trace ({_QUERY_FORMS}), not {named}")


_READ_WORDS = frozenset(
    ("SELECT", "FROM", "VALUES", "PIVOT", "UNPIVOT", "DESCRIBE", "SHOW", "SUMMARIZE", "TABLE")
)
_CTE_WORDS = frozenset(("WITH", "RECURSIVE", "AS", "NOT", "MATERIALIZED", "USING", "KEY"))


def _tokens(sql: str) -> list[tuple[str, duckdb.token_type, int]]:
    """DuckDB's tokens of ``sql``: each one's stripped text, type, and where the next
    token starts."""
    found = duckdb.tokenize(sql)
    ends = [pos for pos, _ in found[1:]] + [len(sql)]
    return [(sql[pos:end].strip(), kind, end) for (pos, kind), end in zip(found, ends, strict=True)]


def _main_keyword(sql: str) -> str:
    """The keyword that says what the statement does, past comments, opening parentheses
    and a WITH's common table expressions (``WITH a AS (...) INSERT`` inserts); "" when
    there is none."""
    depth, in_with, leading = 0, False, True
    for text, kind, _ in _tokens(sql):
        if kind == duckdb.token_type.comment:
            continue
        if kind == duckdb.token_type.operator:
            if not leading:  # `(SELECT ...)` is a query: its opening parentheses are not
                depth = max(0, depth + text.count("(") - text.count(")"))
            continue
        leading = False
        if depth:
            continue
        word = text.upper()
        if kind == duckdb.token_type.keyword and (
            word == "WITH" or (in_with and word in _CTE_WORDS)
        ):
            in_with = True
            continue
        if kind == duckdb.token_type.keyword:
            return word
        if not in_with:  # a CTE's name is an identifier; anything else starts no query
            return ""
    return ""


def _without_terminator(sql: str) -> str:
    """``sql`` without the semicolons and comments after its last token: the relation
    wraps the query in a subquery for a LIMIT or a count, where ``SELECT 1; -- note``
    was a syntax error."""
    end = None
    for text, kind, stop in _tokens(sql):
        if kind == duckdb.token_type.comment or (
            kind == duckdb.token_type.operator and text and set(text) <= {";"}
        ):
            continue
        end = stop
    return sql if end is None else sql[:end].rstrip()


def _first_keyword(sql: str) -> str:
    """The statement's first word as the user typed it (DuckDB's statement type names
    INSTALL as LOAD), past leading comments."""
    found = _FIRST_WORD.match(sql)
    return found.group(1).upper() if found else ""


def run_query(con: duckdb.DuckDBPyConnection, query: str) -> duckdb.DuckDBPyRelation:
    """Run one user query (see ``check_read_only``); a DuckDB error becomes one sentence and
    a usage exit code."""
    check_read_only(query)
    raise_if_stopped()
    try:
        rel = con.sql(_without_terminator(query))
    except duckdb.Error as exc:
        if is_query_interrupt(exc):  # Ctrl-C or a stop signal, not a bad query
            raise KeyboardInterrupt from exc
        raise UsageError(f"the query failed: {_one_error_line(exc)}") from None
    if rel is None:
        raise UsageError("the query returned no result set; mgtrace sql runs SELECT-like queries")
    return rel


def fetch_arrow(rel: duckdb.DuckDBPyRelation, limit: int | None = None) -> pa.Table:
    """The rows of a query; an error DuckDB meets only while running it (a failed cast,
    ``error()``) becomes one sentence and a usage exit code too."""
    raise_if_stopped()
    try:
        return (rel if limit is None else rel.limit(limit)).to_arrow_table()
    except duckdb.Error as exc:
        if is_query_interrupt(exc):  # Ctrl-C or a stop signal, not a bad query
            raise KeyboardInterrupt from exc
        raise UsageError(f"the query failed: {_one_error_line(exc)}") from None


def list_views(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str, str]]:
    """(view, column, type, doc) for every trace view, in schema order."""
    out = []
    for name, spec in TABLES.items():
        types = {row[0]: row[1] for row in con.execute(f"DESCRIBE {name}").fetchall()}
        for field in spec.schema:
            doc = (field.metadata or {}).get(b"doc", b"").decode()
            out.append((name, field.name, str(types.get(field.name, field.type)), doc))
    return out
