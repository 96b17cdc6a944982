"""bisect --log is judged only once TRACE is known to be a trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_one_sentence_error, run_cli


@pytest.mark.parametrize(
    ("trace", "log", "said"),
    [
        ("nope", "nope/x.json", "trace nope does not exist"),
        ("notrace", "notrace/x.json", "notrace has no manifest.json"),
        ("notrace", "new.json", "notrace has no manifest.json"),
        (".", "new.json", ". has no manifest.json"),
        ("afile.txt", "new.json", "trace afile.txt is not a directory"),
    ],
)
def test_an_unreadable_trace_is_said_before_the_log_path(
    tmp_path: Path, trace: str, log: str, said: str
) -> None:
    """A folder that is no trace (or nothing at all) was taken for the trace that holds the
    log: 'x.json lies inside the trace ...', exit 2. It is an unreadable trace, exit 3, and
    no log is left behind."""
    (tmp_path / "notrace").mkdir()
    (tmp_path / "notrace" / "f").write_text("x")
    (tmp_path / "afile.txt").write_text("hi")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = run_cli("bisect", trace, "--log", log, cwd=tmp_path)
    err = assert_one_sentence_error(proc, 3)
    assert said in err, err
    assert "lies inside the trace" not in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_log_inside_a_real_trace_is_still_refused(fresh_trace: Path, tmp_path: Path) -> None:
    """Control: inside a trace, only TRACE/bisect.json is the log's place."""
    proc = run_cli("bisect", str(fresh_trace), "--log", str(fresh_trace / "steps" / "x.json"))
    err = assert_one_sentence_error(proc, 2)
    assert "lies inside the trace" in err, err
