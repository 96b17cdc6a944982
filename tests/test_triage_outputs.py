"""What the triage commands say: counts that agree with each other, commands that paste,
findings said once, a repro's request steps in its own numbering."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mgtrace

pytestmark = pytest.mark.unit


def test_info_counts_a_clean_saved_replay(tmp_path) -> None:
    t = mgtrace.simulate(tmp_path / "clean.trace", steps=120, seed=0)
    assert t.replay(save=True).clean
    info = t.reload().info()
    assert len(info["saved_replays"]) == 1
    assert info["replays"] == len(info["saved_replays"])


def test_reproducing_commands_on_stderr_are_not_wrapped(tmp_path) -> None:
    deep = tmp_path / "some" / "deeper" / "folder" / "for" / "traces"
    deep.mkdir(parents=True)
    trace = deep / "field-run-2026-12-07-node17.trace"
    mgtrace.simulate(trace, steps=300, seed=12, bugs=["async-accepted-race"])
    run = subprocess.run(
        [sys.executable, "-m", "mgtrace", "bisect", str(trace), "--log", "/dev/stdout"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    bad = [ln for ln in lines if ln.lstrip().startswith("bad:")]
    good = [ln for ln in lines if ln.lstrip().startswith("good:")]
    assert bad and good, run.stderr
    for ln in bad + good:
        assert str(trace) in ln and "--to-step=" in ln, run.stderr


def test_each_first_finding_is_said_once_with_its_ranks(tmp_path) -> None:
    trace = tmp_path / "pp4.trace"
    mgtrace.simulate(
        trace, steps=60, runner="v2", pp=4, scenario="mixed", bugs=["batch-row-block-table"]
    )
    run = subprocess.run(
        [sys.executable, "-m", "mgtrace", "replay", str(trace), "--no-save"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1, run.stderr
    head = []
    for line in run.stdout.splitlines()[1:]:
        if not line.startswith("  "):
            break
        head.append(line)
    assert head and len(head) == len(set(head)), run.stdout
    assert all("(rank" in line for line in head), run.stdout


def test_repro_requests_steps_lie_inside_the_repro(tmp_path) -> None:
    t = mgtrace.simulate(tmp_path / "s.trace", steps=400, seed=0, bugs=["stale-condense-row"])
    t.minimize(tmp_path / "repro")
    repro = mgtrace.open(tmp_path / "repro")
    rows = repro.sql(
        "SELECT r.req_id, r.first_step, r.last_step, min(b.step), max(b.step), "
        "(SELECT max(step) FROM steps) FROM requests r JOIN batch_rows b USING (req_id) "
        "GROUP BY ALL"
    ).fetchall()
    assert rows
    for req, first, last, lo, hi, end in rows:
        assert first == lo and last == hi <= end, (req, first, last, lo, hi, end)


def test_simulates_next_command_stays_on_one_line(tmp_path) -> None:
    deep = tmp_path / "some" / "deeper" / "folder" / "for" / "traces" / "of" / "this" / "run"
    deep.mkdir(parents=True)
    trace = deep / "field-run-2026-12-07-node17.trace"
    run = subprocess.run(
        [sys.executable, "-m", "mgtrace", "simulate", "--steps", "20", "-o", str(trace)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    (line,) = [ln for ln in run.stderr.splitlines() if ln.startswith("next:")]
    assert line.endswith(str(trace)), run.stderr


def test_a_repro_names_the_requests_its_start_state_brings(tmp_path) -> None:
    trace = mgtrace.simulate(
        tmp_path / "pp.trace", steps=300, runner="v2", pp=2, bugs=["batch-row-block-table"]
    )
    result = trace.minimize(tmp_path / "repro")
    assert result.start_state_requests, result
    assert not set(result.start_state_requests) & set(result.requests)
    repro = mgtrace.open(tmp_path / "repro")
    named = {f.req_id for f in repro.replay().findings} | {
        f.writer_req_id for f in repro.replay().findings if f.writer_req_id
    }
    assert set(result.start_state_requests) <= named
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgtrace",
            "history",
            str(tmp_path / "repro"),
            *result.start_state_requests[:1],
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2, run.stderr
    assert "start state only" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_rule_bisect_calls_clean_says_how_far_it_was_checked(tmp_path) -> None:
    # three bugs: the rule that undoes the first leaves the others, past the horizon
    trace = mgtrace.simulate(
        tmp_path / "combo.trace",
        steps=400,
        bugs=["reorder-threshold-mismatch", "async-accepted-race", "stale-condense-row"],
    )
    verdict = trace.bisect()
    assert verdict.fixes and verdict.checked_through == verdict.first_step + verdict.horizon
    assert verdict.sentence().endswith(f"through step {verdict.checked_through}")
    later = trace.replay(verdict.fixes[0])
    assert not later.clean and later.first_step > verdict.checked_through


def test_diff_of_two_traces_names_the_columns_that_differ(tmp_path) -> None:
    clean = mgtrace.simulate(tmp_path / "clean.trace", steps=200)
    raced = mgtrace.simulate(tmp_path / "raced.trace", steps=200, bugs=["async-accepted-race"])
    got = clean.diff(raced.path)
    assert got.first_step == 116 and got.tables == ["batch_rows", "launches", "row_moves"]
    assert got.columns["batch_rows"] == ["accepted_prev", "accepted_prev_cpu"]
    assert "batch_rows (accepted_prev, accepted_prev_cpu)" in got.sentence("a", "b")
    # the control: a trace against itself differs in nothing
    assert clean.diff(clean.path).columns == {}
