"""Commands that read a trace say in one sentence (exit 3) that another process replaced it
(`simulate --force` in another shell) while they read it. DuckDB and pyarrow read a trace's
parts by path: such a command failed in their words as an internal error (exit 70), or
showed what it had read of two traces as if of one."""

from __future__ import annotations

from pathlib import Path

import pytest

import mgtrace
import mgtrace.query.history
import mgtrace.query.info
import mgtrace.replayer.diff
import mgtrace.report
from mgtrace.cli import main
from mgtrace.errors import PartError
from mgtrace.schemas.reader import TraceReader
from tests.conftest import replace_after_call

pytestmark = pytest.mark.unit

REPLACED = "mgtrace: error: another process replaced or removed the trace at"


@pytest.fixture
def replayed(tmp_path: Path) -> Path:
    """A buggy trace with a replay's findings saved: a part the clean trace that replaces
    it does not have."""
    path = tmp_path / "t.trace"
    mgtrace.simulate(path, steps=120, bugs=["reorder-threshold-mismatch"]).replay(save=True)
    return path


def _command(name: str, trace: Path) -> list[str]:
    report = trace.parent / "report.html"
    return {
        "info": ["info", str(trace)],
        "info --json": ["info", str(trace), "--json"],
        "history": ["history", str(trace), "req-000001"],
        "history --format csv": ["history", str(trace), "req-000001", "--format", "csv"],
        "report": ["report", str(trace), "-o", str(report), "--no-bisect"],
    }[name]


READERS = ["info", "info --json", "history", "history --format csv", "report"]


def _assert_refused(capsys: pytest.CaptureFixture[str], trace: Path) -> str:
    out, err = capsys.readouterr()
    assert err.startswith(REPLACED) and len(err.splitlines()) == 1, err
    assert out == "", out
    assert not (trace.parent / "report.html").exists()
    return err


@pytest.mark.parametrize("name", READERS)
def test_a_part_gone_mid_read_is_said_as_the_trace_replaced(
    replayed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Replaced once the command has opened its DuckDB views: the findings part they
    name is gone (it was "internal error: IOException: No files found ...", exit 70)."""
    replace_after_call(monkeypatch, TraceReader, "connect", replayed, steps=150)
    assert main(_command(name, replayed)) == 3
    assert f"during mgtrace {name.split()[0]}, " in _assert_refused(capsys, replayed)
    monkeypatch.undo()  # the control: the trace as it stands now is read
    assert main(_command(name, replayed)) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("name", "module", "function"),
    [
        ("info", mgtrace.query.info, "trace_info"),
        ("info --json", mgtrace.query.info, "trace_info"),
        ("history", mgtrace.query.history, "reach_note"),
        ("history --format csv", mgtrace.query.history, "request_history"),
        ("report", mgtrace.report, "build_report"),
    ],
)
def test_what_was_read_of_a_trace_replaced_meanwhile_is_not_shown(
    replayed: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    module: object,
    function: str,
) -> None:
    """Replaced after the command's last read of it: it read one trace whole, but what it
    would show may be of the one it opened or mix both, and nothing says which."""
    replace_after_call(monkeypatch, module, function, replayed, steps=150)
    assert main(_command(name, replayed)) == 3
    _assert_refused(capsys, replayed)


@pytest.mark.parametrize("two_traces", [False, True])
def test_diff_shows_no_divergence_of_a_trace_replaced_meanwhile(
    replayed: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    two_traces: bool,
) -> None:
    if two_traces:
        other = replayed.parent / "o.trace"
        mgtrace.simulate(other, steps=120)
        args = ["diff", str(replayed), str(other)]
        function = "diff_traces"
    else:
        args = ["diff", str(replayed), "--rules-b", "reorder_threshold=1+k"]
        function = "diff_rules"
    assert main(args) == 1  # the control: the two differ
    assert "first di" in capsys.readouterr().out  # "diverge", "differ"
    replace_after_call(monkeypatch, mgtrace.replayer.diff, function, replayed, steps=150)
    assert main(args) == 3
    _assert_refused(capsys, replayed)


@pytest.mark.parametrize(
    "failure", [RuntimeError("boom"), FileNotFoundError(2, "No such file"), PartError("bad")]
)
@pytest.mark.parametrize("replaced", [False, True])
def test_a_failure_is_said_as_the_trace_replaced_only_where_it_was(
    replayed: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: Exception,
    replaced: bool,
) -> None:
    """Each way a read can fail (DuckDB's or pyarrow's own error, the file system's, a part
    that no longer matches the manifest) names the replacement where there was one, and
    stays as it was where there was none."""

    def fail(*args, **kwargs):
        if replaced:
            mgtrace.simulate(replayed, steps=150, seed=7, force=True)
        raise failure

    monkeypatch.setattr(mgtrace.query.info, "trace_info", fail)
    code = main(["info", str(replayed)])
    err = capsys.readouterr().err
    if replaced:
        assert code == 3 and err.startswith(REPLACED), err
    else:
        expected = {RuntimeError: 70, FileNotFoundError: 2, PartError: 3}[type(failure)]
        assert code == expected and "replaced" not in err, err


@pytest.mark.parametrize(
    ("name", "function"),
    [("while it loads the steps", "RankTrace"), ("while it replays them", "bisect")],
)
def test_bisect_gives_no_verdict_of_a_trace_replaced_meanwhile(
    replayed: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    function: str,
) -> None:
    """Nor writes its log into the folder of the trace that replaced it."""
    import mgtrace.replayer.bisect as bisect

    args = ["bisect", str(replayed)]
    replace_after_call(monkeypatch, bisect, function, replayed, steps=150)
    assert main(args) == 3, name
    err = capsys.readouterr().err
    said = {"RankTrace": "during the bisection", "bisect": "during mgtrace bisect"}[function]
    assert err.startswith(REPLACED) and said in err, err
    assert not (replayed / "bisect.json").exists()
    monkeypatch.undo()  # the control: the trace as it stands is bisected, its log written
    assert main(args) == 0
    assert (replayed / "bisect.json").exists()


def test_minimize_makes_no_repro_of_a_trace_replaced_while_it_loaded(
    replayed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import mgtrace.replayer.minimize as minimize

    out = replayed.parent / "repro.trace"
    replace_after_call(monkeypatch, minimize, "load_memory", replayed, steps=150)
    assert main(["minimize", str(replayed), "-o", str(out)]) == 3
    err = capsys.readouterr().err
    assert err.startswith(REPLACED) and "during the minimization" in err, err
    assert not out.exists()


def test_the_api_bisects_no_trace_replaced_while_it_loaded(
    replayed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mgtrace.replayer.bisect as bisect
    from mgtrace.errors import TraceReplacedError

    trace = mgtrace.open(replayed)
    assert trace.bisect().status == "bad"  # the control
    replace_after_call(monkeypatch, bisect, "RankTrace", replayed, steps=150)
    with pytest.raises(TraceReplacedError, match="during the bisection"):
        trace.bisect()


def test_a_trace_the_command_removes_itself_is_not_said_as_another_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo removes its temporary trace when it ends, a failure included: a full disk
    while it saved the bisect log was said as another process having replaced or removed
    that trace (exit 3); it is the file system's own words (exit 2). Only the traces a
    command line names are asked about."""
    import errno

    import mgtrace.replayer.bisect

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "bisect.json")

    monkeypatch.setattr(mgtrace.replayer.bisect, "save_log", full)
    code = main(["demo", "--steps", "100"])
    err = capsys.readouterr().err
    assert "another process" not in err, err
    assert code == 2 and "mgtrace: error: No space left on device (bisect.json)" in err, err
