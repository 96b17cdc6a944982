"""SIGTERM and SIGHUP end any command as Ctrl-C does: its cleanup runs, the signal is named
in one line and the exit code is 128 + its number. Killed outright, a command once left a
trace of no steps or a hidden half-written export behind, and said nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgtrace.schemas.reader import TraceReader
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _default_signals() -> None:
    """In the child: SIGHUP and SIGTERM as a shell's command has them, whatever this test
    run inherited (under ``nohup`` SIGHUP is ignored, and mgtrace keeps it so)."""
    for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)


def _stopped(
    args: list[str], cwd: Path, after_s: float, signum: int, times: int = 1
) -> tuple[int, str, float]:
    """Run ``mgtrace ARGS``, send ``signum`` after ``after_s`` (``times`` times, 10 ms
    apart); (exit code, stderr, seconds from the first signal to the exit)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mgtrace", *args],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        preexec_fn=_default_signals,
    )
    time.sleep(after_s)
    assert proc.poll() is None, "the control: the command was still running"
    sent = time.monotonic()
    for _ in range(times):
        proc.send_signal(signum)
        time.sleep(0.01)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, time.monotonic() - sent


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_a_stopped_simulation_keeps_its_steps_as_ctrl_c_does(tmp_path: Path, signum: int) -> None:
    code, err, _ = _stopped(["simulate", "--steps", "200000", "-o", "s.trace"], tmp_path, 6, signum)
    assert code == 128 + signum, err
    assert err.strip() == f"mgtrace: stopped by {signal.Signals(signum).name}", err
    reader = TraceReader(tmp_path / "s.trace")
    assert not reader.complete and reader.rows("steps") > 0


def test_a_stopped_export_leaves_nothing_behind(tmp_path: Path) -> None:
    import mgtrace

    mgtrace.simulate(tmp_path / "t.trace", steps=400, seed=0)
    query = "SELECT l.* FROM launches l, range(2000)"
    code, err, _ = _stopped(["sql", "t.trace", query, "-o", "big.csv"], tmp_path, 5, signal.SIGTERM)
    assert code == 143 and err.strip() == "mgtrace: stopped by SIGTERM", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.trace"]


@pytest.mark.parametrize(
    ("signum", "said"),
    [(signal.SIGINT, "mgtrace: interrupted"), (signal.SIGTERM, "mgtrace: stopped by SIGTERM")],
    ids=["INT", "TERM"],
)
def test_a_signal_ends_a_running_query_at_once(tmp_path: Path, signum: int, said: str) -> None:
    """DuckDB ends an interrupted query with an error of its own, which was reported as an
    internal error (exit 70, "please report it")."""
    import mgtrace

    mgtrace.simulate(tmp_path / "t.trace", steps=40, seed=0)
    query = "SELECT sum(range) FROM range(100000000000)"  # minutes of work
    code, err, took = _stopped(["sql", "t.trace", query], tmp_path, 4, signum)
    assert code == 128 + signum and err.strip() == said, err
    assert took < 30


def test_after_a_stopped_command_the_python_api_still_queries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In one process (a notebook that ran a command), a command stopped by SIGTERM must
    not leave every later query interrupted. Control: the command itself says the signal."""
    import mgtrace
    from mgtrace import cli
    from mgtrace.query import views

    trace = mgtrace.simulate(tmp_path / "t.trace", steps=40, seed=0)
    query = views.run_query

    def stopped(con: object, text: str) -> object:
        signal.raise_signal(signal.SIGTERM)
        return query(con, text)

    with monkeypatch.context() as m:
        m.setattr(views, "run_query", stopped)
        assert cli.main(["sql", str(trace.path), "SELECT 1"]) == 143
    assert capsys.readouterr().err.strip() == "mgtrace: stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler went with it
    assert mgtrace.open(trace.path).sql("SELECT count(*) FROM steps").fetchall() == [(40,)]


def test_a_hangup_that_took_stderr_still_exits_129(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Closing the terminal sends SIGHUP and takes stderr: saying "stopped by SIGHUP" raised
    EIO, and the command ended in a traceback with exit 1. Control: with stderr there, the
    line is said."""
    import click

    from mgtrace import cli, pandas_probe
    from mgtrace.termination import Terminated

    def hung_up() -> None:
        raise Terminated(signal.SIGHUP)

    monkeypatch.setattr(pandas_probe, "skip_pandas_probe", hung_up)
    assert cli.main(["--help"]) == 129
    assert capsys.readouterr().err.strip() == "mgtrace: stopped by SIGHUP"

    def gone(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(click, "echo", gone)
    assert cli.main(["--help"]) == 129


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    """A service manager's second SIGTERM, moments after the first, interrupted the
    simulator's cleanup: its trace said "writer did not close". Control: one signal."""
    args = ["simulate", "--steps", "200000", "-o", "s.trace"]
    code, err, _ = _stopped(args, tmp_path, 6, signal.SIGTERM, times=5)  # a burst
    assert code == 143 and err.strip() == "mgtrace: stopped by SIGTERM", err
    reader = TraceReader(tmp_path / "s.trace")
    assert reader.rows("steps") > 0 and "interrupted" in str(reader.manifest.errors), reader
