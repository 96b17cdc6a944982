"""A replay saves its findings only into the trace it replayed: where another process
replaced the trace meanwhile (``simulate --force``), the findings are not added to the new
one, which they do not describe."""

from __future__ import annotations

from pathlib import Path

import pytest

import mgtrace
import mgtrace.replayer.loop as loop
from mgtrace.cli import main
from mgtrace.errors import OutputError
from mgtrace.replayer.findings import save_findings
from mgtrace.schemas.reader import TraceReader
from tests.conftest import replace_after_call

pytestmark = pytest.mark.unit

BUG = ["reorder-threshold-mismatch"]


def _replaced_while_replaying(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """The next replay's trace replaced by a clean one of the same shape (its parts have
    the same names) just as the replay ends."""
    replace_after_call(monkeypatch, loop, "replay_trace", path, steps=120)


def test_the_command_line_keeps_findings_out_of_a_trace_replaced_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mgtrace replay T` while `simulate -o T --force` replaced T saved the old trace's
    findings into the new, clean one: `info T` then said "as-recorded: N findings" of steps
    the new trace did not even have (and its verdict, read partly from each trace, could
    call a clean trace corrupt). Now the replay gives no verdict and saves nothing."""
    path = tmp_path / "t.trace"
    mgtrace.simulate(path, steps=120, bugs=BUG)
    _replaced_while_replaying(monkeypatch, path)
    assert main(["replay", str(path), "--jobs", "1"]) == 3
    err = capsys.readouterr().err
    assert "replaced or removed the trace at" in err and "during the replay" in err, err
    new = TraceReader(path)
    assert new.manifest.ground_truth["injected"] == []  # the clean trace that replaced it
    assert new.rows("findings") == 0 and new.unlisted_parts() == []
    # control: a replay of the trace as it stands saves its (no) findings
    monkeypatch.undo()
    assert main(["replay", str(path), "--jobs", "1"]) == 0
    assert len(TraceReader(path).part_files("findings")) == 1


def test_the_api_keeps_findings_out_of_a_trace_replaced_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.trace"
    t = mgtrace.simulate(path, steps=120, bugs=BUG)
    _replaced_while_replaying(monkeypatch, path)
    with pytest.raises(OutputError, match="replaced the trace"):
        t.replay(save=True)
    assert TraceReader(path).rows("findings") == 0


def test_save_findings_checks_the_trace_it_was_read_from(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    t = mgtrace.simulate(path, steps=120, bugs=BUG)
    read = TraceReader(path).manifest
    found = t.replay().findings
    assert found
    other = tmp_path / "o.trace"  # control: the same trace, with another replay's part added
    mgtrace.simulate(other, steps=120, bugs=BUG)
    first = TraceReader(other).manifest
    save_findings(other, found, replay_id="a", rules="as-recorded", read_from=first)
    save_findings(other, found, replay_id="b", rules="as-recorded", read_from=first)
    assert TraceReader(other).rows("findings") == 2 * len(found)
    mgtrace.simulate(path, steps=120, seed=7, force=True)
    with pytest.raises(OutputError, match="replaced the trace"):
        save_findings(path, found, replay_id="a", rules="as-recorded", read_from=read)
    assert TraceReader(path).rows("findings") == 0


def test_sql_shows_no_rows_read_while_the_trace_was_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """DuckDB reads the parts by path: a query that ran while `simulate --force` replaced
    the trace printed counts of neither trace, exit 0. Now it prints none, exit 3."""
    import mgtrace.query.views as views

    path = tmp_path / "t.trace"
    mgtrace.simulate(path, steps=120, bugs=BUG)
    replace_after_call(monkeypatch, views, "fetch_arrow", path, steps=150)
    query = "SELECT count(*) AS n FROM steps"
    for fmt in ("table", "csv"):
        assert main(["sql", str(path), query, "--format", fmt]) == 3
        out, err = capsys.readouterr()
        assert "during the query" in err and "120" not in out and "150" not in out, out + err
    monkeypatch.undo()  # the control: the trace as it stands is queried
    assert main(["sql", str(path), query, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "150"
