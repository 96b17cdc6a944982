"""The Python API's edge: what a notebook user gets wrong is one mgtrace error, as on the
command line, never a raw pyarrow, DuckDB or TypeError traceback, and never a clean verdict on
a window that holds no step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import mgtrace
from mgtrace.api import Trace
from mgtrace.errors import UsageError


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    out = tmp_path_factory.mktemp("api") / "run.trace"
    # one bug name as a string (it was once taken letter by letter: "unknown bug 'r'")
    return mgtrace.simulate(out, bugs="reorder-threshold-mismatch", steps=300)


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda t: t.replay(from_step=50, to_step=10), "comes after"),
        (lambda t: t.replay(from_step=5000), "past the last step"),
        (lambda t: t.replay(to_step=-3), "must be a step number"),
        (lambda t: t.replay(from_step="10"), "must be a step number"),
        (lambda t: t.replay(5), "rules must be a RuleSet or a string"),
        (lambda t: t.replay(ranks="0"), "a rank is a whole number"),
        (lambda t: t.table("steps", columns=["nope"]), "has no column nope"),
        (lambda t: t.history(2), "named by its id"),
        (lambda t: t.history("req-000002", from_step="x"), "from_step must be a step number"),
        (lambda t: t.history("req-000002", rules="banana"), "name=value"),
        (lambda t: t.sql(123), "a query is a string"),
        (lambda t: t.diff(), "give another trace, or rules_b"),
        (lambda t: mgtrace.open(123), "opened by its path"),
    ],
)
def test_misuse_is_one_usage_error(trace: Trace, call: Any, said: str) -> None:
    with pytest.raises(UsageError, match=said):
        call(trace)


def test_the_controls_of_the_misuse_work(trace: Trace) -> None:
    """The same calls, given right, answer (the refusals above are not of everything)."""
    assert not trace.replay().clean  # the bug fires in 300 steps
    assert trace.replay(from_step=10, to_step=299).steps == 290
    assert trace.replay(ranks=[0]).first_step == trace.replay().first_step
    assert trace.table("steps", columns="step").column_names == ["step"]
    assert trace.sql("SELECT count(*) FROM steps").fetchall() == [(300,)]
    lines = trace.history("req-000002", to_step=20, rules="any")  # the CLI's spelling
    assert lines.num_rows and "findings" in lines.column_names
    assert "300 steps, complete" in repr(trace)


def test_repr_counts_a_pipeline_step_once(tmp_path: Path) -> None:
    """The steps table holds a row per step and rank: a PP=2 trace of 40 steps once said
    "80 steps"."""
    pp = mgtrace.simulate(tmp_path / "pp.trace", runner="v2", pp=2, steps=40)
    assert "80 step rows on 2 ranks" in repr(pp) and pp.info()["steps"] == 40


def test_minimize_over_an_existing_output_names_the_python_argument(
    trace: Trace, tmp_path: Path
) -> None:
    """From Python, "pass --force" named a command-line flag. Control: force=True replaces."""
    from mgtrace.errors import OutputError

    trace.minimize(tmp_path / "repro")
    with pytest.raises(OutputError, match=r"already exists; pass force=True"):
        trace.minimize(tmp_path / "repro")
    assert trace.minimize(tmp_path / "repro", force=True).steps > 0


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda t: t.bisect(horizon=-1), "horizon must be a whole number"),
        (lambda t: t.bisect(horizon=0), "horizon must be a whole number"),
        (lambda t: t.bisect(horizon="5"), "horizon must be a whole number"),
        (lambda t: t.replay(save="no"), "save must be True or False"),
        (lambda t: t.replay(allow_gaps="no"), "allow_gaps must be True or False"),
        (lambda t: t.replay(ranks=0), r"ranks is a list of rank numbers such as \[0\]"),
        (lambda t: t.replay(ranks=1), r"ranks is a list of rank numbers such as \[1\]"),
        (lambda t: t.table("steps", columns=5), "columns is a list of column names"),
        (lambda t: t.history("req-000002", from_step=-1), "from_step must be a step number"),
        (lambda t: t.diff(5), "the other trace is a path"),
        (lambda t: t.diff(rules_b=5), "rules_b must be a string"),
        (lambda t: t.diff(t, rules_b="reorder_threshold=1+k"), "not both"),
        (lambda t: t.minimize(None), "the minimized trace is a path"),
        (lambda t: t.minimize(t.path.parent / "m", force="no"), "force must be True or False"),
        (lambda t: mgtrace.open(t.path, skip_bad_parts="yes"), "skip_bad_parts must be True"),
    ],
)
def test_more_misuse_is_one_usage_error(trace: Trace, call: Any, said: str) -> None:
    """Each was a bare TypeError/AttributeError, or silently taken: bisect(horizon=-1) named
    rules that fix nothing (its "good" replay ended before the first bad step) and printed
    --to-step=-33; replay(save="no") saved; replay(ranks=0) replayed every rank."""
    before = trace.reload().info()["replays"]
    with pytest.raises(UsageError, match=said):
        call(trace)
    assert trace.reload().info()["replays"] == before  # nothing was saved on the way


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"bugs": 5}, "bugs is a list of bug names"),
        ({"bugs": None}, "bugs is a list of bug names"),
        ({"steps": "20"}, "steps must be a whole number"),
        ({"steps": 20.5}, "steps must be a whole number"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"k": "3"}, "k must be a whole number"),
        ({"acceptance_rate": "x"}, "acceptance_rate must be a number"),
        ({"nope": 1}, "simulate has no option 'nope'"),
        ({"overwrite": True}, "simulate has no option 'overwrite'"),
        ({"force": "no"}, "force must be True or False"),
    ],
)
def test_simulate_misuse_is_one_usage_error(
    tmp_path: Path, options: dict[str, Any], said: str
) -> None:
    with pytest.raises(UsageError, match=said):
        mgtrace.simulate(tmp_path / "s.trace", **{"steps": 20, **options})
    assert not (tmp_path / "s.trace").exists()


def test_simulate_writes_no_folders_and_names_force(trace: Trace, tmp_path: Path) -> None:
    """As `mgtrace simulate -o`: a mistyped folder leaves no tree of folders behind (the
    API made them); an existing output names force=True, not --force."""
    from mgtrace.errors import OutputError

    with pytest.raises(OutputError, match="does not exist"):
        mgtrace.simulate(tmp_path / "typo" / "sub" / "s.trace", steps=20)
    assert not (tmp_path / "typo").exists()
    with pytest.raises(OutputError, match="pass force=True"):
        mgtrace.simulate(trace.path, steps=20)


def test_minimize_reads_a_damaged_trace_as_it_was_opened(tmp_path: Path) -> None:
    """mgtrace.open(..., skip_bad_parts=True).minimize() read the trace again without it:
    PartError "pass --skip-bad-parts", where `mgtrace minimize --skip-bad-parts` answers."""
    from mgtrace.errors import InconclusiveError

    path = tmp_path / "pp.trace"
    mgtrace.simulate(path, runner="v2", pp=2, steps=60, bugs="batch-row-block-table")
    part = next((path / "batch_rows").glob("r001-*.parquet"))
    part.write_bytes(part.read_bytes()[:1000])
    t = mgtrace.open(path, skip_bad_parts=True)
    with pytest.raises(InconclusiveError, match="gap"):  # as the command line: exit 125
        t.minimize(tmp_path / "repro")


def test_a_trace_removed_or_replaced_since_it_was_opened_is_said_so(tmp_path: Path) -> None:
    """A Trace whose folder was removed raised pyarrow's FileNotFoundError or DuckDB's
    IOException; one that ``simulate(force=True)`` replaced answered with a mix of both runs
    (the new steps, the old ground truth). Now each is one sentence; a replay saved from the
    command line is read at once, with no reload(). Control: reload() reads the new trace."""
    import shutil
    import subprocess
    import sys

    from mgtrace.errors import TraceError

    path = tmp_path / "t.trace"
    t = mgtrace.simulate(path, steps=100, bugs=["reorder-threshold-mismatch"])
    assert t.sql("SELECT count(*) FROM findings").fetchall() == [(0,)]
    subprocess.run([sys.executable, "-m", "mgtrace", "replay", str(path)], check=False)
    assert t.sql("SELECT count(*) FROM findings").fetchall()[0][0] > 0  # read at once
    mgtrace.simulate(path, steps=150, force=True)
    for call in (t.info, lambda: t.table("steps"), lambda: t.history("req-000002")):
        with pytest.raises(TraceError, match="was replaced by another since it was opened"):
            call()
    assert t.reload().info()["steps"] == 150  # the control
    shutil.rmtree(path)
    gone = (t.info, t.replay, lambda: t.sql("SELECT 1"), lambda: t.diff(rules_b="x=1"))
    for call in gone:
        with pytest.raises(TraceError, match="was removed since it was opened"):
            call()
    assert "removed or replaced since it was opened" in repr(t)


def test_the_shared_checks_speak_python(trace: Trace, tmp_path: Path) -> None:
    """Checks the API shares with the command line named its flags ("--from-step 9 comes
    after --to-step 3", "pass --skip-bad-parts"). Control: the command line keeps them."""
    from mgtrace.errors import PartError
    from tests.conftest import run_cli

    with pytest.raises(UsageError, match="from_step 9 comes after to_step 3"):
        trace.replay(from_step=9, to_step=3)
    with pytest.raises(UsageError, match="from_step 9 comes after to_step 3"):
        trace.history("req-000002", from_step=9, to_step=3)
    import shutil

    damaged = tmp_path / "d.trace"
    shutil.copytree(trace.path, damaged)
    part = next((damaged / "steps").glob("*.parquet"))
    part.write_bytes(b"PAR1 garbage")
    with pytest.raises(PartError, match="pass skip_bad_parts=True") as err:
        mgtrace.open(damaged)
    assert "--" not in err.value.message
    proc = run_cli("replay", str(trace.path), "--from-step", "9", "--to-step", "3")
    assert "--from-step 9 comes after --to-step 3" in proc.stderr  # the control
