"""A file output (`sql -o`, `history -o`, `report -o`) is refused inside a trace's folder,
any trace's, not only the one read: it is none of that trace's files, and with --force it
could overwrite one (`-o other.trace/manifest.json -f` left that trace unreadable)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "argv",
    [
        ["sql", "{read}", "SELECT 1", "-o", "{other}/manifest.json", "-f"],
        ["sql", "{read}", "SELECT 1", "-o", "{other}/steps/x.csv"],
        ["history", "{read}", "000002", "-o", "{other}/notes.csv"],
        ["report", "{read}", "--no-bisect", "-o", "{other}/r.html", "-f"],
    ],
)
def test_a_file_output_inside_another_trace_is_refused(
    fresh_trace: Path, tmp_path: Path, argv: list[str]
) -> None:
    other = tmp_path / "other.trace"
    shutil.copytree(fresh_trace, other)
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    args = [a.format(read=fresh_trace, other=other) for a in argv]
    err = assert_one_sentence_error(run_cli(*args), 2)
    assert f"lies inside the trace {other}" in err, err
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before


def test_a_file_output_beside_a_trace_is_written(fresh_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "beside.csv"  # the control: the trace's parent folder is no trace
    proc = run_cli("sql", str(fresh_trace), "SELECT 1 AS x", "-o", str(out), "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines()[-1] == "1"
