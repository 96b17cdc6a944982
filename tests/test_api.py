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
