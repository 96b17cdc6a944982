"""mgtrace sql / info output formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mgtrace.cli import main
from mgtrace.schemas.tables import TABLES
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.unit

QUERY = "SELECT step, count(*) AS n FROM batch_rows GROUP BY step ORDER BY step LIMIT 4"


def test_table_output(sample_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sql", str(sample_trace), QUERY, "--max-rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 of 4 rows shown" in out and "16" in out


def test_csv_json_parquet(sample_trace: Path, tmp_path: Path, capsys) -> None:
    assert main(["sql", str(sample_trace), QUERY, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"step","n"', "0,16", "1,16", "2,16", "3,16"]
    assert main(["sql", str(sample_trace), QUERY, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[3] == {"step": 3, "n": 16}
    out = tmp_path / "r.parquet"
    assert main(["sql", str(sample_trace), QUERY, "--format", "parquet", "-o", str(out)]) == 0
    assert pq.read_table(out).column("n").to_pylist() == [16] * 4


def test_csv_writes_nested_columns_as_json(sample_trace: Path, capsys) -> None:
    """CSV has no nested cells: a list, struct or map column goes out as JSON text (pyarrow's
    CSV writer refused the query, an internal error); flat columns are unchanged."""
    query = (
        "SELECT step, [[0, 4], []] AS ids, {'a': 1, 'b': [2]} AS s, "
        "CAST(NULL AS INTEGER[]) AS none FROM steps ORDER BY step LIMIT 1"
    )
    assert main(["sql", str(sample_trace), query, "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ['"step","ids","s","none"', '0,"[[0, 4], []]","{""a"": 1, ""b"": [2]}",']
    assert main(["sql", str(sample_trace), query, "--format", "json"]) == 0  # the control
    assert json.loads(capsys.readouterr().out)[0]["ids"] == [[0, 4], []]


def test_an_interval_column_is_text_in_every_format(
    sample_trace: Path, tmp_path: Path, capsys
) -> None:
    """Arrow's CSV and Parquet writers have no form for an interval: once an internal error,
    then a refusal for Parquet. Every format says it as an ISO 8601 duration. Control: an
    integer column alongside is untouched."""
    query = "SELECT INTERVAL 1 DAY + INTERVAL 90 MINUTE AS c, 1 AS x"
    assert main(["sql", str(sample_trace), query, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"c","x"', '"P0M1DT5400S",1']
    assert main(["sql", str(sample_trace), query, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"c": "P0M1DT5400S", "x": 1}]
    assert main(["sql", str(sample_trace), query]) == 0
    assert "P0M1DT5400S" in capsys.readouterr().out
    out = tmp_path / "iv.parquet"
    assert main(["sql", str(sample_trace), query, "-o", str(out)]) == 0
    assert pq.read_table(out).to_pylist() == [{"c": "P0M1DT5400S", "x": 1}]


def test_intervals_inside_lists_and_blobs_are_text_in_csv_and_json(
    sample_trace: Path, capsys
) -> None:
    """An interval inside a list or struct came out as [0, 1, 0]; a BLOB in CSV was written
    when its bytes were UTF-8 and refused when not. Now an interval is ISO 8601 text at any
    depth and a BLOB hex in both, and the terminal table shows nested intervals alike.
    Control: a top-level interval, as before."""
    query = (
        "SELECT [INTERVAL 90 MINUTE] AS l, {'a': INTERVAL 1 DAY} AS s, "
        "'\\x00\\xFF'::BLOB AS b, INTERVAL 1 DAY AS c"
    )
    assert main(["sql", str(sample_trace), query, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"l": ["P0M0DT5400S"], "s": {"a": "P0M1DT0S"}, "b": "00ff", "c": "P0M1DT0S"}
    ]
    assert main(["sql", str(sample_trace), query, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        '"[""P0M0DT5400S""]","{""a"": ""P0M1DT0S""}","00ff","P0M1DT0S"'
    )
    # the terminal table too (it showed MonthDayNano(months=0, ...) inside them)
    assert main(["sql", str(sample_trace), query]) == 0
    shown = capsys.readouterr().out
    assert "['P0M0DT5400S']" in shown and "{'a': 'P0M1DT0S'}" in shown, shown
    assert "MonthDayNano" not in shown


def test_json_is_strict_and_keeps_every_column(sample_trace: Path, capsys) -> None:
    """A repeated column name dropped a column ([{"a": 2}]), NaN and Infinity made invalid
    JSON and a BLOB came out as "b'ab'". Now: a, a_1; null; hex, nested values alike.
    Control: a finite float and a plain string are unchanged."""
    query = (
        "SELECT 1 AS a, 2 AS a, 'nan'::DOUBLE AS n, '-inf'::DOUBLE AS i, 'ab'::BLOB AS b, "
        "[1.5, 'inf'::DOUBLE] AS l, {'x': '\\xFF'::BLOB} AS s, 0.5::DOUBLE AS f, 'x' AS t"
    )
    assert main(["sql", str(sample_trace), query, "--format", "json"]) == 0
    text = capsys.readouterr().out
    rows = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert rows == [
        {
            "a": 1,
            "a_1": 2,
            "n": None,
            "i": None,
            "b": "6162",
            "l": [1.5, None],
            "s": {"x": "ff"},
            "f": 0.5,
            "t": "x",
        }
    ]


def test_a_parquet_file_keeps_repeated_names_readable(sample_trace: Path, tmp_path: Path) -> None:
    """Parquet kept both columns named a, and pyarrow could not read the file back (Multiple
    matches for FieldRef). Now a, a_1 as in JSON. Control: distinct names are unchanged."""
    out = tmp_path / "dup.parquet"
    assert main(["sql", str(sample_trace), "SELECT 1 AS a, 2 AS a, 3 AS b", "-o", str(out)]) == 0
    assert pq.read_table(out).to_pylist() == [{"a": 1, "a_1": 2, "b": 3}]


def test_parquet_needs_output(sample_trace: Path, capsys) -> None:
    assert main(["sql", str(sample_trace), QUERY, "--format", "parquet"]) == 2
    assert "needs -o" in capsys.readouterr().err


def test_list_shows_every_view(sample_trace: Path, capsys) -> None:
    assert main(["sql", str(sample_trace), "--list"]) == 0
    out = capsys.readouterr().out
    for name, spec in TABLES.items():
        assert name in out
        for column in spec.schema.names:
            assert column in out


def test_show_tables_names_the_trace_views_only(tmp_path: Path) -> None:
    """A table with no parts was a view over a registered helper, which SHOW TABLES listed
    beside the views (``__empty_findings``). Its view now stands alone, with the column types
    DuckDB reads from a written part. Control: a simulated trace has no findings part."""
    import duckdb

    import mgtrace

    trace = mgtrace.simulate(tmp_path / "run.trace", steps=40, seed=0)
    assert not list((tmp_path / "run.trace" / "findings").glob("*.parquet"))
    shown = {name for (name,) in trace.sql("SHOW TABLES").fetchall()}
    assert shown == set(TABLES)
    written = tmp_path / "findings.parquet"
    pq.write_table(TABLES["findings"].schema.empty_table(), written)
    expected = duckdb.connect().read_parquet(str(written)).types
    assert trace.sql("SELECT * FROM findings").types == expected
    assert trace.sql("SELECT count(*) FROM findings").fetchall() == [(0,)]


@pytest.mark.parametrize(
    "extra", [["SELECT 1"], ["--format", "csv"], ["-o", "list.csv"]], ids=["query", "fmt", "out"]
)
def test_list_refuses_what_it_would_ignore(sample_trace: Path, extra: list[str], capsys) -> None:
    """--list once printed its table and silently skipped a QUERY, -o or --format."""
    assert main(["sql", str(sample_trace), "--list", *extra]) == 2
    assert "--list prints the views to the terminal" in capsys.readouterr().err


def test_info_json(sample_trace: Path, capsys) -> None:
    assert main(["info", str(sample_trace), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["complete"] is True
    assert info["steps"] == 120 and info["ranks"] == 1
    assert info["rows"]["batch_rows"] == 120 * 16
    assert info["run"]["num_speculative_tokens"] == 3
    assert info["drops"]["steps"] == 0
    assert info["bytes_on_disk"] > 0


def test_info_counts_only_the_parts_the_manifest_lists(fresh_trace: Path, capsys) -> None:
    """A part renamed by a writer killed before it updated the manifest is no part of the
    trace: it was counted in the size on disk."""
    import shutil

    assert main(["info", str(fresh_trace), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    listed = next((fresh_trace / "batch_rows").glob("*.parquet"))
    shutil.copy(listed, fresh_trace / "batch_rows" / "r0-999999.parquet")
    assert main(["info", str(fresh_trace), "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert after["bytes_on_disk"] == before["bytes_on_disk"]
    assert after["unlisted_parts"] == ["batch_rows/r0-999999.parquet"]
    assert main(["info", str(fresh_trace)]) == 0
    assert "batch_rows/r0-999999.parquet (not counted" in capsys.readouterr().out


def test_info_table(sample_trace: Path, capsys) -> None:
    assert main(["info", str(sample_trace)]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "rows per table" in out and "batch_rows" in out


def test_unknown_command_is_usage_error(capsys) -> None:
    assert main(["frobnicate"]) == 2


@pytest.mark.parametrize("name", ["batch-composition", "accepted-distribution"])
def test_a_canned_query_by_name_runs_its_sql(sample_trace: Path, name: str, capsys) -> None:
    from mgtrace.query.canned import NAMED

    assert main(["sql", str(sample_trace), f"@{name}", "--format", "json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert main(["sql", str(sample_trace), NAMED[name][0], "--format", "json"]) == 0
    assert by_name and by_name == json.loads(capsys.readouterr().out)  # its SQL's rows


def test_canned_queries_are_listed_and_unknown_names_refused(sample_trace: Path, capsys) -> None:
    from mgtrace.query.canned import NAMED

    assert main(["sql", str(sample_trace), "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"@{name}" in out for name in NAMED)
    assert main(["sql", str(sample_trace), "@nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mgtrace: error: no canned query '@nope'") and len(err.splitlines()) == 1


def test_wrote_line_prints_a_path_with_brackets_as_it_is(
    sample_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The "wrote" line went through rich markup: "x[bold]y.csv" was printed as "xy.csv"."""
    monkeypatch.chdir(tmp_path)
    assert main(["sql", str(sample_trace), "SELECT 1 AS one", "-o", "x[bold]y.csv"]) == 0
    assert (tmp_path / "x[bold]y.csv").is_file()
    assert "wrote x[bold]y.csv" in capsys.readouterr().err


def test_output_format_follows_the_file_suffix(sample_trace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    assert main(["sql", str(sample_trace), QUERY, "-o", str(out)]) == 0
    assert json.loads(out.read_text())[3] == {"step": 3, "n": 16}
    assert main(["sql", str(sample_trace), QUERY, "-o", str(tmp_path / "r.parquet")]) == 0
    assert pq.read_table(tmp_path / "r.parquet").column("n").to_pylist() == [16] * 4
    capsys.readouterr()
    assert main(["sql", str(sample_trace), QUERY, "-o", str(tmp_path / "r.txt")]) == 2
    err = capsys.readouterr().err
    assert "cannot tell a format from 'r.txt'" in err and not (tmp_path / "r.txt").exists()
    # --format still decides when given (the control)
    assert (
        main(["sql", str(sample_trace), QUERY, "--format", "csv", "-o", str(tmp_path / "r.txt")])
        == 0
    )
    assert (tmp_path / "r.txt").read_text().splitlines()[0] == '"step","n"'


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_a_reader_that_goes_away_is_not_a_verdict(sample_trace: Path, fmt: str) -> None:
    """`mgtrace sql ... | head -1`: rich once exited 1 on the broken pipe, which a script
    reads as "corruption found". Control: the whole output, read to the end, exits 0 too."""
    import subprocess
    import sys

    from tests.conftest import REPO

    argv = [sys.executable, "-m", "mgtrace", "sql", str(sample_trace), "--format", fmt]
    argv += ["--max-rows", "100000", "SELECT * FROM batch_rows, range(4)"]  # past a pipe's buffer
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0 and "Traceback" not in err, err
    whole = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120)
    assert whole.returncode == 0 and len(whole.stdout) > 1 << 17


WRITES = [
    "COPY (SELECT 1 AS x) TO '{part}' (FORMAT parquet)",
    "CREATE TABLE t AS SELECT 1",
    "DROP VIEW steps",
    "ATTACH '{trace}/x.duckdb' AS x",
    "INSTALL httpfs",
    "SELECT 1; COPY (SELECT 1 AS x) TO '{part}' (FORMAT parquet)",
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{part}' (FORMAT parquet)",
    "WITH a AS (SELECT 1) INSERT INTO steps SELECT * FROM steps",
    # DuckDB types a statement around a PIVOT as MULTI, as it types a PIVOT query
    "COPY (PIVOT (SELECT 1 AS a, 'x' AS b) ON b USING count(*)) TO '{part}' (FORMAT parquet)",
    "WITH p AS (PIVOT (SELECT 1 AS a, 'x' AS b) ON b USING count(*)) INSERT INTO t FROM p",
]


@pytest.mark.parametrize(
    "query",
    WRITES,
    ids=[
        "copy",
        "create",
        "drop",
        "attach",
        "install",
        "two",
        "explain",
        "with-insert",
        "copy-pivot",
        "with-pivot-insert",
    ],
)
def test_sql_refuses_statements_that_could_change_the_trace(
    fresh_trace: Path, query: str, capsys
) -> None:
    """A COPY onto a step part once destroyed the trace: only one read-only query runs, the
    rest is one sentence and exit 2, and the trace's files stay as they were. Control: a
    plain SELECT (and SHOW, a query too) still runs, from the CLI and from Trace.sql."""
    from mgtrace.api import Trace
    from mgtrace.errors import UsageError

    part = sorted((fresh_trace / "steps").glob("*.parquet"))[0]
    before = {p: p.read_bytes() for p in fresh_trace.rglob("*") if p.is_file()}
    text = query.format(part=part, trace=fresh_trace)
    assert main(["sql", str(fresh_trace), text]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mgtrace: error: ") and len(err.splitlines()) == 1, err
    if query != WRITES[5]:  # a second statement is named by its count
        # the word the user typed, not DuckDB's statement type (INSTALL was named LOAD);
        # past a WITH, what the statement does (it was named WITH)
        word = "INSERT" if query.startswith("WITH") else query.split()[0]
        assert err.endswith(f"not {word}"), err
    with pytest.raises(UsageError):
        Trace(fresh_trace).sql(text)
    assert {p: p.read_bytes() for p in fresh_trace.rglob("*") if p.is_file()} == before
    assert main(["sql", str(fresh_trace), "SELECT count(*) AS n FROM steps;"]) == 0
    assert main(["sql", str(fresh_trace), "SHOW TABLES", "--format", "csv"]) == 0
    assert "batch_rows" in capsys.readouterr().out
    assert Trace(fresh_trace).sql("SELECT count(*) FROM steps").fetchall() == [(60,)]
    # a PIVOT, which DuckDB runs as several statements, is a query too
    pivot = "PIVOT (SELECT rank, step % 2 AS odd FROM steps) ON odd USING count(*)"
    assert Trace(fresh_trace).sql(pivot).fetchall() == [(0, 30, 30)]
    for nested in (
        f"WITH t AS (SELECT 1) {pivot}",
        f"SELECT * FROM ({pivot})",
        f"WITH t AS ({pivot}) FROM t",
        f"/* a */ ({pivot}) -- b",
    ):
        assert Trace(fresh_trace).sql(nested).fetchall() == [(0, 30, 30)]


@pytest.mark.parametrize("tail", [";", "; -- a note", "; /* a note */", ";;\n-- a note\n"])
def test_a_semicolon_and_a_comment_after_the_query_are_no_syntax_error(
    sample_trace: Path, tail: str, capsys
) -> None:
    """The table format takes the first rows through a LIMIT around the query, where
    `SELECT ...; -- note` was a syntax error (exit 2) while --format csv ran it. Control:
    the same query without the tail."""
    query = "SELECT step FROM steps ORDER BY step LIMIT 3"
    for text in (query, query + tail):
        assert main(["sql", str(sample_trace), text, "--max-rows", "2"]) == 0, text
        out = capsys.readouterr().out
        assert "2 of 3 rows shown" in out, out
    assert main(["sql", str(sample_trace), "SELECT ';' AS s; -- x", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ['"s"', '";"']


def test_canned_findings_queries_read_the_as_recorded_replay_only(
    fresh_trace: Path, capsys
) -> None:
    """A counterfactual or windowed replay saved beside the as-recorded one once added its
    findings to the cross-tab (36 requests flagged on a run with none): the canned queries
    read the whole-trace replay as recorded only. Control: its own findings are counted."""
    from mgtrace.api import Trace
    from mgtrace.replayer.cli import replay_id_for
    from mgtrace.replayer.findings import Finding, save_findings
    from mgtrace.replayer.rules import RuleSet

    decoding = [
        r[0]
        for r in Trace(fresh_trace)
        .sql("SELECT DISTINCT req_id FROM batch_rows WHERE num_draft > 0 ORDER BY 1")
        .fetchall()
    ]
    assert len(decoding) >= 3

    def found(req: str, step: int) -> Finding:
        return Finding("stale_read", "m", 0, step, req, 0, f"{req} read stale state")

    recorded = RuleSet()
    save_findings(
        fresh_trace,
        [found(decoding[0], 5)],
        replay_id=replay_id_for(recorded),
        rules=recorded.canonical(),
    )
    other = RuleSet.parse("reorder_threshold=1+k")
    save_findings(
        fresh_trace,
        [found(decoding[1], 7)],
        replay_id=replay_id_for(other),
        rules=other.canonical(),
    )
    save_findings(
        fresh_trace,
        [found(decoding[2], 9)],
        replay_id=replay_id_for(recorded, 8, 10),
        rules=recorded.canonical(),
    )
    assert main(["sql", str(fresh_trace), "@findings-over-time", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"step": 5, "kind": "stale_read", "requests": 1}]
    assert (
        main(["sql", str(fresh_trace), "@first-decode-in-prefill-split", "--format", "json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert sum(r["flagged_by_replay"] for r in rows) == 1
    assert main(["sql", str(fresh_trace), "--list"]) == 0
    assert "replay as recorded" in capsys.readouterr().out


def test_cells_and_headers_that_look_like_markup_are_shown_as_they_are(
    sample_trace: Path, capsys
) -> None:
    """Rich read a cell or header as console markup: '[/]' crashed the table (exit 70) and
    '[red]x' showed as x. Control: a plain value beside them prints as before."""
    query = """SELECT '[/]' AS a, '[red]x' AS "[bold]h", 'plain' AS c"""
    assert main(["sql", str(sample_trace), query]) == 0
    out = capsys.readouterr().out
    assert "[/]" in out and "[red]x" in out and "[bold]h" in out and "plain" in out


def test_history_cells_that_look_like_markup_are_shown_as_they_are() -> None:
    import io

    import pyarrow as pa
    from rich.console import Console

    from mgtrace.render import render_history

    console = Console(file=io.StringIO(), width=200)
    lines = pa.table({"step": [1], "scheduler": ["[/]"], "findings": ["[red]x (with [b]r)"]})
    render_history(lines, console, max_rows=10)
    out = console.file.getvalue()
    assert "[/]" in out and "[red]x (with [b]r)" in out and "scheduler" in out


def test_findings_by_kind_lists_the_kind_that_starts_the_corruption_first() -> None:
    """The table was sorted by kind name, so a kind that follows from the first one could
    head it. Now by first step, then by requests (most first)."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from mgtrace.render import render_replay
    from mgtrace.replayer.findings import Finding
    from mgtrace.replayer.rules import RuleSet

    def found(kind: str, step: int, req: str) -> Finding:
        return Finding(kind, "m", 0, step, req, 0, "d")

    findings = [
        found("b_late", 9, "r1"),
        found("z_first", 3, "r1"),
        found("a_same_step_fewer", 5, "r2"),
        found("c_same_step_more", 5, "r3"),
        found("c_same_step_more", 6, "r4"),
    ]
    result = SimpleNamespace(
        rules=RuleSet(),
        clean=False,
        findings=findings,
        first_step=3,
        steps=10,
        ranks=[0],
        repeats=0,
    )
    console = Console(file=io.StringIO(), width=200)
    render_replay(result, console, trace="t", replay_id=None)
    out = console.file.getvalue()
    order = ["z_first", "c_same_step_more", "a_same_step_fewer", "b_late"]
    table = out.split("findings by kind")[1]
    assert sorted(order, key=table.index) == order, table


def test_the_rows_note_says_the_total_where_it_is_known() -> None:
    """With the total known the note says "20 of 1,343 rows shown"; without it, as before."""
    import io

    import pyarrow as pa
    from rich.console import Console

    from mgtrace.render import render_arrow

    shown = pa.table({"x": list(range(20))})
    for total, note in ((1343, "20 of 1,343 rows shown"), (None, "20 rows shown; more not")):
        console = Console(file=io.StringIO(), width=200)
        render_arrow(shown, console, more=True, total=total)
        assert console.file.getvalue().rstrip().splitlines()[-1].startswith(note)


def test_an_output_no_file_can_be_made_at_is_refused_before_any_work(
    sample_trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """report -o FILE/r.html once replayed and bisected the whole trace, then failed "Not a
    directory": only the parent's existence was checked. A parent that is a file, or a
    folder no file can be created in (/proc: permission bits let root pass), is refused
    first. Control: a writable folder gets the report."""
    from mgtrace import report

    made: list[Path] = []
    monkeypatch.setattr(report, "write_report", lambda trace, out, **kw: made.append(out))
    (tmp_path / "afile").write_text("x")
    cases = [(tmp_path / "afile", f"{tmp_path / 'afile'} is not a directory")]
    if Path("/proc/self").is_dir():
        cases.append((Path("/proc"), "no file can be created in /proc"))
    for folder, words in cases:
        for argv, name in (
            (["report", str(sample_trace)], "r.html"),
            (["sql", str(sample_trace), QUERY], "r.csv"),
        ):
            out = folder / name
            assert main([*argv, "-o", str(out)]) == 2
            err = capsys.readouterr().err
            assert err == f"mgtrace: error: cannot write {out}: {words}\n", err
    assert made == []
    assert main(["report", str(sample_trace), "-o", str(tmp_path / "r.html")]) == 0
    assert made == [tmp_path / "r.html"]
    assert not list(tmp_path.glob(".mgtrace-probe-*"))  # the probe file is gone again


@pytest.mark.parametrize("command", [["sql", QUERY], ["history", "req-0"]])
def test_a_max_rows_too_large_to_use_is_a_usage_error(
    sample_trace: Path, command: list[str], capsys
) -> None:
    """--max-rows past int64 was an internal error (exit 70) in history, and "the query
    failed: Conversion Error" in sql (the LIMIT takes one more row). Both are refused as
    usage errors. Control: the largest allowed value shows every row."""
    trace, *rest = [str(sample_trace), *command[1:]]
    for huge in (str(2**63 - 1), "10000000000000000000"):
        assert main([command[0], trace, *rest, "--max-rows", huge]) == 2
        assert "--max-rows" in capsys.readouterr().err
    assert main([command[0], trace, *rest, "--max-rows", str(2**62)]) == 0


def test_the_accepted_distribution_counts_each_row_once_on_two_ranks(
    tmp_path: Path, capsys
) -> None:
    """Every rank of a pipeline-parallel engine records the same batch rows; the canned
    distribution counts them on one rank, not once per rank."""
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "pp2"
    simulate(SimConfig(steps=60, seed=4, runner="v2", pp=2, output=out))
    spec = "FROM batch_rows WHERE accepted IS NOT NULL AND num_draft > 0"
    assert (
        main(["sql", str(out), f"SELECT rank, count(*) AS n {spec} GROUP BY 1", "--format", "json"])
        == 0
    )
    per_rank = {r["rank"]: r["n"] for r in json.loads(capsys.readouterr().out)}
    assert sorted(per_rank) == [0, 1] and per_rank[0] == per_rank[1] > 0  # the two ranks agree
    assert main(["sql", str(out), "@accepted-distribution", "--format", "json"]) == 0
    assert sum(r["rows"] for r in json.loads(capsys.readouterr().out)) == per_rank[0]


def test_the_canned_batch_queries_read_the_lowest_rank_there_is(tmp_path: Path, capsys) -> None:
    """A recording whose rank 0 could not be reached has no rank-0 rows: the canned batch
    queries read the lowest rank that recorded, not an empty rank 0."""
    import numpy as np

    from mgtrace.schemas.sample import SAMPLE_RUN, sample_step
    from mgtrace.schemas.writer import TraceWriter

    out = tmp_path / "rank1"
    rng = np.random.default_rng(0)
    with TraceWriter(out, run=SAMPLE_RUN, source={"kind": "sample"}) as w:
        for step in range(5):
            w.write_step(1, step, sample_step(step, 8, rng))
    assert main(["sql", str(out), "@batch-composition", "--format", "json"]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in steps] == list(range(5))
    assert all(
        r["decode"] + r["short_extend"] + r["long_extend"] + r["prefill"] == 8 for r in steps
    )
    query = "SELECT count(*) AS n FROM batch_rows WHERE accepted IS NOT NULL AND num_draft > 0"
    assert main(["sql", str(out), query, "--format", "json"]) == 0
    spec_rows = json.loads(capsys.readouterr().out)[0]["n"]
    assert main(["sql", str(out), "@accepted-distribution", "--format", "json"]) == 0
    assert sum(r["rows"] for r in json.loads(capsys.readouterr().out)) == spec_rows > 0


def test_the_client_labels_cross_tab_is_a_canned_query(tmp_path: Path, capsys) -> None:
    """An imported load-generator log's labels against the Mamba prefill region, by name from
    the command line and from Python, at the window of the field reproducer (k unknown: 4);
    import-probe points at it. Control: the cross-tab at another window differs."""
    from mgtrace.api import Trace
    from mgtrace.query.canned import crosstab_sql
    from tests.test_recorder_unit import _probe_logs

    probe, burst, _ = _probe_logs(tmp_path)
    out = tmp_path / "imp"
    assert main(["import-probe", str(probe), str(burst), "-o", str(out)]) == 0
    assert f"next: mgtrace sql {out} @client-labels" in capsys.readouterr().out
    assert main(["sql", str(out), "@client-labels", "--format", "json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    trace = Trace(out)
    rows = [list(r) for r in trace.sql(crosstab_sql(4)).fetchall()]
    assert [list(r.values()) for r in by_name] == rows and sum(r["n"] for r in by_name) > 0
    assert [list(r) for r in trace.sql("@client-labels").fetchall()] == rows
    assert [list(r) for r in trace.sql(crosstab_sql(1)).fetchall()] != rows


def test_an_output_that_is_a_link_or_a_fifo_is_written_through(
    sample_trace: Path, tmp_path: Path, capsys
) -> None:
    """-o over a symbolic link replaced the link with a file, and over a FIFO or a device
    (as root, /dev/null) replaced the device. A link's target is now replaced, the link
    kept; a FIFO or device is written in place, with no --force (it holds nothing to lose).
    Control: a regular file still needs --force."""
    import os
    import stat
    import threading

    target = tmp_path / "target.csv"
    target.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target.name)
    assert main(["sql", str(sample_trace), "SELECT 7 AS n", "-o", str(link)]) == 2
    assert main(["sql", str(sample_trace), "SELECT 7 AS n", "-o", str(link), "--force"]) == 0
    assert link.is_symlink() and target.read_text().splitlines() == ['"n"', "7"]
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert (
        main(["sql", str(sample_trace), "SELECT 8 AS n", "-o", str(fifo), "--format", "csv"]) == 0
    )
    reader.join(30)
    assert got == [b'"n"\n8\n'] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    capsys.readouterr()


def test_a_canned_findings_query_says_when_no_replay_is_saved(tmp_path: Path, capsys) -> None:
    """Before any replay the canned queries over findings read as if the replay had found
    nothing ("flagged_by_replay 0" on a buggy run). They now say none is saved, and how to
    save it. Control: once the replay is saved, and for a query not over findings, no note."""
    import mgtrace

    trace = tmp_path / "run.trace"
    mgtrace.simulate(trace, bugs=["reorder-threshold-mismatch"], steps=300, seed=0)
    note = "note: no replay of this trace as recorded is saved, so its findings columns are"
    for name in ("@findings-over-time", "@first-decode-in-prefill-split"):
        assert main(["sql", str(trace), name, "--format", "csv"]) == 0
        out, err = capsys.readouterr()
        assert err.startswith(note) and err.rstrip().endswith(f"run: mgtrace replay {trace}")
        assert "note" not in out  # the CSV stays as it is
    assert main(["sql", str(trace), "@batch-composition", "--format", "csv"]) == 0
    assert "note" not in capsys.readouterr().err
    assert main(["replay", str(trace)]) == 1
    capsys.readouterr()
    assert main(["sql", str(trace), "@findings-over-time", "--format", "csv"]) == 0
    out, err = capsys.readouterr()
    assert "note" not in err and len(out.splitlines()) > 1


def test_a_regular_file_under_dev_is_a_file_and_stdout_is_not_truncated(
    sample_trace: Path, tmp_path: Path
) -> None:
    """Every path under /dev or /proc was taken for a stream: a file in /dev/shm was
    overwritten without --force, and written in place, not atomically. And -o /dev/stdout
    truncated a file the shell had opened for appending. Control: /dev/stdout is written."""
    import subprocess
    import sys

    from tests.conftest import REPO

    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        mine = shm / f"mgtrace-test-{os.getpid()}.csv"
        mine.write_text("precious\n")
        try:
            assert main(["sql", str(sample_trace), "SELECT 1 AS n", "-o", str(mine)]) == 2
            assert mine.read_text() == "precious\n"
        finally:
            mine.unlink()
    kept = tmp_path / "kept.csv"
    kept.write_text("before\n")
    argv = [sys.executable, "-m", "mgtrace", "sql", str(sample_trace), "SELECT 5 AS n"]
    with kept.open("a") as out:
        proc = subprocess.run(
            [*argv, "--format", "csv", "-o", "/dev/stdout"], stdout=out, cwd=REPO, timeout=120
        )
    assert proc.returncode == 0
    assert kept.read_text() == 'before\n"n"\n5\n'


def test_an_error_met_only_while_counting_the_rows_is_a_usage_error(
    sample_trace: Path, capsys
) -> None:
    """The table format counts the rows when it leaves some out: an error DuckDB meets only
    past the rows shown was an internal error (exit 70). Control: the same query failing
    in its first rows, exit 2 already."""
    late = (
        "SELECT range FROM range(1000000) "
        "WHERE CASE WHEN range < 500000 THEN true ELSE error('late failure') END"
    )
    early = late.replace("500000", "0")
    for query in (early, late):
        assert main(["sql", str(sample_trace), query, "--max-rows", "3"]) == 2, query
        err = capsys.readouterr().err.strip()
        assert err == "mgtrace: error: the query failed: Invalid Input Error: late failure", err
    # in a column rather than the WHERE clause: counting the rows alone skipped computing
    # it, so the table showed "3 of 100 rows" and exited 0 where csv exited 2
    in_column = "SELECT CASE WHEN range > 60 THEN error('late failure') END AS x FROM range(100)"
    assert main(["sql", str(sample_trace), in_column, "--max-rows", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "mgtrace: error: the query failed: Invalid Input Error: late failure", err
    fine = "SELECT CASE WHEN range > 600 THEN error('late failure') END AS x FROM range(100)"
    assert main(["sql", str(sample_trace), fine, "--max-rows", "3"]) == 0  # the control


@pytest.mark.parametrize(
    "value",
    [
        "make_timestamp_ns(1704067200123456789)",
        "'infinity'::TIMESTAMP",
        "'infinity'::DATE",
        "DATE '-4000-01-01'",
    ],
)
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_value_python_cannot_hold_is_one_sentence(
    sample_trace: Path, value: str, fmt: str
) -> None:
    """Such values were an internal error (exit 70): Python has no datetime for them (in
    a process without pandas, as the command runs). Control: an ordinary timestamp."""
    proc = run_cli("sql", str(sample_trace), f"SELECT {value} AS t", "--format", fmt)
    err = assert_one_sentence_error(proc, 2)
    assert err.startswith("mgtrace: error: a value of the result cannot be shown as"), err
    assert err.endswith("CAST that column to VARCHAR in the query")
    query = "SELECT TIMESTAMP '2024-01-01 10:00:00' AS t"
    proc = run_cli("sql", str(sample_trace), query, "--format", fmt)
    assert proc.returncode == 0 and "2024-01-01" in proc.stdout, proc.stderr


def test_json_is_written_a_chunk_of_rows_at_a_time(monkeypatch, tmp_path: Path) -> None:
    """A long result is turned into Python values a chunk at a time (the whole result at
    once held millions of dicts and the text twice over), and the text is the same as one
    ``json.dumps(rows, indent=1)`` of every row."""
    import io

    import pyarrow as pa

    from mgtrace.query import export

    table = pa.table(
        {
            "step": list(range(10)),
            "ids": [[[i, 0], []] for i in range(10)],
            "name": [f"r\n{i}" for i in range(10)],
            "x": [float("nan") if i == 3 else i / 2 for i in range(10)],
        }
    )
    expected = json.dumps(export._json_value(table.to_pylist()), indent=1) + "\n"
    sizes: list[int] = []
    whole = export.python_rows

    def counted(part: pa.Table, shown_as: str) -> list[dict]:
        sizes.append(part.num_rows)
        return whole(part, shown_as)

    monkeypatch.setattr(export, "python_rows", counted)
    monkeypatch.setattr(export, "JSON_CHUNK_ROWS", 4)
    buf = io.BytesIO()
    export._write_json(table, buf)
    assert buf.getvalue().decode() == expected
    assert sizes == [4, 4, 2]
    empty = io.BytesIO()
    export._write_json(table.slice(0, 0), empty)
    assert empty.getvalue() == b"[]\n"
