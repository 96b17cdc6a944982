"""bisect, minimize, diff, demo and the replay CLI, on simulated traces with known truth."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mgtrace.errors import OutputError, TraceError
from mgtrace.replayer.bisect import bisect, recheck_log, save_log
from mgtrace.replayer.diff import diff_rules, diff_traces
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.minimize import (
    MemoryTrace,
    load_memory,
    minimize,
    write_minimized,
    write_trace,
)
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from tests.conftest import REPO, assert_one_sentence_error, run_cli
from tests.replay_helpers import TOGGLES, set_root, sim_trace, toggle_trace, with_steps_removed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("sim"))


def _truth(trace: Path, bug: str) -> dict:
    return TraceReader(trace).manifest.ground_truth["bugs"][bug]


# ---------------------------------------------------------------- bisect
@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize("bug", list(TOGGLES))
def test_bisect_names_first_step_and_undoing_rule(bug: str, seed: int) -> None:
    trace = toggle_trace(bug, seed)
    truth = _truth(trace, bug)
    if truth["first_step"] is None:
        pytest.skip("the toggle did not fire for this seed")
    v = bisect(trace)
    assert v.status == "bad" and v.exit_code == 1
    assert v.first_step == truth["first_step"]
    assert set(truth["first_requests"]) == set(v.requests)
    assert TOGGLES[bug][1] in v.fixes
    assert (
        "good" in v.commands
        and TOGGLES[bug][1].split("=")[0].replace("_", "-") in v.commands["good"]
    )
    # running the commands to look adds no findings to the trace a second time
    assert all(" --no-save " in c for c in v.commands.values()), v.commands


def test_bisect_clean_trace_and_log_recheck(tmp_path: Path) -> None:
    clean = sim_trace(None, 0, 600, scenario="pairs", runner="v1")
    v = bisect(clean)
    assert v.status == "clean" and v.exit_code == 0 and not v.fixes
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    log = tmp_path / "bisect.json"
    verdict = bisect(buggy)
    save_log(verdict, log)
    same, old, new = recheck_log(log)
    assert same and old.first_step == new.first_step
    # control: a log whose verdict no longer matches the trace is caught
    data = json.loads(log.read_text())
    data["first_step"] += 1
    log.write_text(json.dumps(data))
    same, _, _ = recheck_log(log)
    assert not same


def test_a_log_inside_its_trace_rechecks_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default log sits in the trace; a log written from one directory re-checks from
    another, and after the trace (with its log) moved. Control: a log naming only the path
    the bisect was given, from elsewhere, finds no trace."""

    trace = tmp_path / "run" / "t.trace"
    shutil.copytree(toggle_trace("reorder-threshold-mismatch", 0), trace)
    monkeypatch.chdir(tmp_path / "run")
    save_log(bisect(Path("t.trace")), Path("t.trace") / "bisect.json")
    moved = tmp_path / "shared" / "repro.trace"
    moved.parent.mkdir()
    shutil.move(trace, moved)
    monkeypatch.chdir(tmp_path)
    same, _, new = recheck_log(moved / "bisect.json")
    assert same and new.status == "bad"
    log = moved / "bisect.json"
    data = json.loads(log.read_text())
    del data["trace_from_log"]
    log.write_text(json.dumps(data))
    with pytest.raises(TraceError, match="does not exist"):
        recheck_log(log)


def test_a_copied_damaged_or_skipping_log_rechecks_as_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log copied out of its trace finds the trace it names, not the directory it now
    sits in; a damaged log is one sentence, not an internal error; a verdict made with
    --skip-bad-parts is re-checked the same way. Control: each re-check holds."""

    trace = tmp_path / "t.trace"
    shutil.copytree(toggle_trace("reorder-threshold-mismatch", 0), trace)
    monkeypatch.chdir(tmp_path)
    save_log(bisect(trace), trace / "bisect.json")
    copy = tmp_path / "copy.json"
    shutil.copy(trace / "bisect.json", copy)
    same, _, new = recheck_log(copy)
    assert same and new.status == "bad"
    logged = json.loads(copy.read_text())
    for damaged in ({"format": "mgtrace-bisect"}, {**logged, "probes": [{"x": 1}]}):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(damaged))
        err = assert_one_sentence_error(run_cli("bisect", "--replay", str(bad)), 2)
        assert "is a damaged bisect log" in err, err
    # a damaged part: the verdict is made with --skip-bad-parts, and re-checked with it
    part = next((trace / "row_moves").glob("*.parquet"))
    part.write_bytes(b"PAR1 garbage")
    made = run_cli("bisect", str(trace), "--skip-bad-parts")
    assert made.returncode in (1, 125), made.stderr
    again = run_cli("bisect", "--replay", str(trace / "bisect.json"))
    assert again.returncode == made.returncode, again.stderr
    assert "the verdict holds" in again.stdout


def test_bisect_is_inconclusive_on_gaps_and_incomplete_traces(tmp_path: Path) -> None:
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(buggy, "reorder-threshold-mismatch")["first_step"]
    gapped = with_steps_removed(buggy, tmp_path / "gap", {first - 2})
    v = bisect(gapped)
    assert v.status == "inconclusive" and v.exit_code == 125 and "gap" in v.reason
    clean = sim_trace(None, 1, 600, scenario="pairs", runner="v1")
    cut = with_steps_removed(clean, tmp_path / "cut", set(), complete=False)
    v = bisect(cut)
    assert v.status == "inconclusive" and "did not finish" in v.reason
    # control: the same trace, complete, is clean
    assert bisect(with_steps_removed(clean, tmp_path / "whole", set())).status == "clean"
    proc = run_cli("bisect", str(gapped))
    assert proc.returncode == 125 and "inconclusive" in proc.stdout


def test_bisect_leaves_ordinary_runs_unchanged() -> None:
    trace = toggle_trace("async-accepted-race", 0)
    before = [f.signature for f in replay_trace(TraceReader(trace), RuleSet()).findings]
    bisect(trace)
    after = [f.signature for f in replay_trace(TraceReader(trace), RuleSet()).findings]
    assert before == after


def test_bisect_costs_less_than_a_full_replay() -> None:
    """Not a timing assertion: a count of replayed steps, which is what costs time."""
    trace = toggle_trace("reorder-threshold-mismatch", 0)
    v = bisect(trace)
    assert v.steps_replayed < 0.5 * TraceReader(trace).rows("steps")


# ---------------------------------------------------------------- minimize
def _renumbered(findings: list, step: int, signature: str, shift: int) -> set[tuple]:
    """The findings of ``signature`` at ``step`` as comparable facts, with every step they
    name moved back by ``shift`` (a repro's steps are the original's less the cut)."""

    def moved(m: re.Match[str]) -> str:
        return f"{m[1]} step {int(m[2]) - shift}"

    return {
        (
            f.req_id,
            f.writer_req_id,
            None if f.writer_step is None else f.writer_step - shift,
            re.sub(r"(since|at) step (-?\d+)", moved, f.detail),
        )
        for f in findings
        if f.step == step and f.signature == signature
    }


@pytest.mark.parametrize(
    ("bug", "seed", "engine"),
    [
        ("reorder-threshold-mismatch", 0, {"runner": "v1"}),
        ("async-accepted-race", 1, {"runner": "v1"}),  # a long-lived request: start state used
        ("stale-condense-row", 0, {"runner": "v1"}),
        ("batch-row-block-table", 0, {"runner": "v2", "pp": 2}),
    ],
)
def test_minimize_long_trace_to_a_small_repro(
    tmp_path: Path, bug: str, seed: int, engine: dict
) -> None:
    trace = sim_trace(bug, seed, 5000, scenario="pairs", **engine)
    first = replay_trace(TraceReader(trace), RuleSet())
    pinned = first.findings[0].signature  # the first finding, as replay lists it
    out = tmp_path / "repro-1.min"  # not a module name: the test file's name must be one
    result = minimize(trace, out)
    assert Path(result.test_file).name == "test_repro_1_min.py"
    assert result.signature == pinned and result.original_first_step == first.first_step
    assert result.steps <= 50 and len(result.requests) <= 4
    again = replay_trace(TraceReader(out), RuleSet())
    assert pinned in {f.signature for f in again.findings if f.step == again.first_step}
    # the steps its findings name before the cut (a writer's, an owner's since when) are
    # in the repro's numbering: they said the original trace's
    shift = result.original_first_step - result.first_step
    said = _renumbered(again.findings, again.first_step, pinned, 0)
    assert said and said <= _renumbered(first.findings, first.first_step, pinned, shift), said
    kept = TraceReader(out).table("requests").column("req_id").to_pylist()
    assert sorted(kept) == result.requests  # no request the repro does not hold
    if bug == "batch-row-block-table":  # the deferred post-process no longer holds the cut
        assert any(h["pass"] == "prefix" for h in result.history), result.history
        # of the two ranks, the repro keeps the one its finding is on
        assert {"pass": "ranks", "rank": first.findings[0].rank} in result.history
        assert sorted(set(TraceReader(out).table("steps")["rank"].to_pylist())) == [
            first.findings[0].rank
        ]
    # bisect and diff start the repro from its start state, as replay does: the same first
    # step, undone by the same rule (they used to replay it from nothing: step 0, no fix)
    verdict = bisect(out)
    assert verdict.first_step == again.first_step and TOGGLES[bug][1] in verdict.fixes
    # the reproducing commands stop at a step the repro has (the horizon ends with it)
    last = max(TraceReader(out).table("steps").column("step").to_pylist())
    assert verdict.commands["bad"].endswith(f"--to-step={last}"), verdict.commands
    d = diff_rules(TraceReader(out), RuleSet(), RuleSet.parse(TOGGLES[bug][1]))
    assert d.first_step == again.first_step
    # a repro minimizes to itself: its start state is read, and written again
    twice = minimize(out, tmp_path / "twice")
    assert (twice.signature, twice.first_step) == (pinned, result.first_step)
    assert (twice.steps, twice.requests) == (result.steps, result.requests)  # a fixed point
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", result.test_file],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the repro is read by people: no unused import or undefined name in it
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F", result.test_file],
        capture_output=True,
        text=True,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_minimize_replays_no_step_past_the_first_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first bad step counts, so no replay of minimize goes past it: a long
    recording whose bug shows early was replayed whole before the reductions began."""
    from mgtrace.replayer.loop import RankReplay

    trace = sim_trace("reorder-threshold-mismatch", 0, 600, scenario="pairs", runner="v1")
    first = replay_trace(TraceReader(trace), RuleSet()).first_step
    assert first is not None and first < 500
    replayed: list[int] = []
    step = RankReplay._step

    def counted(self: RankReplay, s: int) -> None:
        replayed.append(s)
        step(self, s)

    monkeypatch.setattr(RankReplay, "_step", counted)
    result = minimize(trace, tmp_path / "m")
    assert result.original_first_step == first
    assert max(replayed) == first


def test_minimize_refuses_a_clean_trace(tmp_path: Path) -> None:
    clean = sim_trace(None, 0, 600, scenario="pairs", runner="v1")
    proc = run_cli("minimize", str(clean), "-o", str(tmp_path / "m"))
    assert "nothing to minimize" in assert_one_sentence_error(proc, 125)
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------- diff
def test_diff_rules_finds_the_injected_step() -> None:
    trace = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(trace, "reorder-threshold-mismatch")["first_step"]
    d = diff_rules(TraceReader(trace), RuleSet(), RuleSet.parse("reorder_threshold=1+k"))
    assert d.first_step == first and d.blocks
    same = diff_rules(TraceReader(trace), RuleSet(), RuleSet.parse("bt_row_is_req=true"))
    assert same.first_step is None  # V1: slot and batch row are the same row


def test_diff_rules_names_a_step_where_only_a_read_differs() -> None:
    """The accepted count a decode reads its window column by changes what it reads, not any
    block: the oracles disagree at the injected step while the states stay equal."""
    bug = "async-accepted-race"
    trace = next(
        t for t in (toggle_trace(bug, s) for s in (0, 1, 2)) if _truth(t, bug)["first_step"]
    )
    d = diff_rules(TraceReader(trace), RuleSet(), RuleSet.parse("accepted_source=cpu"))
    assert d.first_step == _truth(trace, bug)["first_step"]
    assert d.blocks == [] and d.findings_a and not d.findings_b
    assert "read differently" in d.sentence(RuleSet(), RuleSet.parse("accepted_source=cpu"))


def test_diff_traces() -> None:
    a = sim_trace(None, 0, 600, scenario="pairs", runner="v1")
    b = sim_trace(None, 1, 600, scenario="pairs", runner="v1")
    assert diff_traces(TraceReader(a), TraceReader(a)).first_step is None
    d = diff_traces(TraceReader(a), TraceReader(b))
    assert d.first_step is not None and d.tables
    # a rule set given with two traces is refused, not silently ignored
    err = assert_one_sentence_error(
        run_cli("diff", str(a), str(a), "--rules-a", "reorder_threshold=1+k"), 2
    )
    assert "not both" in err


def test_diff_rules_counts_rank_steps_as_rank_steps() -> None:
    """Two ranks of 300 steps are 600 rank-steps, said so as replay says it. Control: one
    rank's count stays in steps."""
    pp = sim_trace(None, 0, 300, scenario="pairs", runner="v2", pp=2)
    d = diff_rules(TraceReader(pp), RuleSet(), RuleSet.parse("accepted_source=cpu"))
    assert d.first_step is None and d.ranks == 2
    assert d.sentence(RuleSet(), RuleSet()).endswith("every one of 600 rank-steps (2 ranks)")
    one = sim_trace(None, 0, 300, scenario="pairs", runner="v1")
    d = diff_rules(TraceReader(one), RuleSet(), RuleSet.parse("accepted_source=cpu"))
    assert d.sentence(RuleSet(), RuleSet()).endswith("every one of 300 steps")


def test_diff_sentence_counts_the_blocks_it_names() -> None:
    """One block is said in the singular; past eight, the sentence says how many differ."""
    from mgtrace.replayer.diff import RulesDiff

    a, b = RuleSet(), RuleSet.parse("bt_row_is_req=true")
    one = RulesDiff(first_step=3, rank=0, blocks=[125]).sentence(a, b)
    assert one.endswith("(rank 0): block 125 holds different state")
    many = RulesDiff(first_step=3, rank=0, blocks=list(range(1, 11))).sentence(a, b)
    assert many.endswith("blocks 1, 2, 3, 4, 5, 6, 7, 8, ... (10 in all) hold different state")


# ---------------------------------------------------------------- CLI
def test_replay_cli_exit_codes_and_saved_findings() -> None:
    buggy = toggle_trace("stale-condense-row", 0)
    proc = run_cli("replay", str(buggy))
    assert proc.returncode == 1 and "first at step" in proc.stdout
    proc = run_cli("replay", str(buggy), "--clear-vacated-rows=true", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["clean"] is True
    proc = run_cli(
        "sql", str(buggy), "--format", "csv", "SELECT count(DISTINCT rules) AS n FROM findings"
    )
    assert proc.stdout.splitlines()[1] == "1"  # the clean replay saved no rows
    err = assert_one_sentence_error(run_cli("replay", str(buggy), "--rules", "nope=1"), 2)
    assert "unknown rule" in err


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_makes_the_folder_its_output_goes_in(tmp_path: Path) -> None:
    """`demo -o` makes no missing folders, as no -o but record's does; `make demo` writes
    into out/demo, which a fresh clone lacks: its recipe makes the folder first."""
    target = tmp_path / "a" / "b" / "demo"
    proc = subprocess.run(
        ["make", "-n", "demo", f"DEMO_DIR={target}"], cwd=REPO, capture_output=True, text=True
    )
    lines = proc.stdout.splitlines()
    demo = next(i for i, line in enumerate(lines) if f"demo -o {target}" in line)
    assert f"mkdir -p {target.parent}/" in lines[:demo], proc.stdout


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mgtrace", "demo", "--steps", "800", "-o", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bisect matches the injected first step" in proc.stdout
    assert "clean under --reorder-threshold=1+k" in proc.stdout
    assert "--replay" in proc.stdout and "now removed" not in proc.stdout
    # the canned queries read the demo's findings, saved as `mgtrace replay` saves them
    flagged = run_cli("sql", str(tmp_path / "d"), "@findings-over-time", "--format", "csv")
    assert flagged.returncode == 0 and len(flagged.stdout.splitlines()) > 1, flagged.stdout
    # without -o the trace is temporary: no re-check command for a path about to vanish
    proc = subprocess.run(
        [sys.executable, "-m", "mgtrace", "demo", "--steps", "800"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--replay" not in proc.stdout and "is now removed" in proc.stdout


class _Replayed(Exception):
    """A minimize got as far as its first replay."""


def _no_replay(monkeypatch: pytest.MonkeyPatch) -> type[_Replayed]:
    """Make minimize's replays raise: what a test expects refused must be refused first."""
    from mgtrace.replayer import minimize as mod

    def no_replay(*args, **kwargs):
        raise _Replayed

    monkeypatch.setattr(mod, "outcome", no_replay)
    return _Replayed


def test_minimize_refuses_an_existing_output_before_any_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once refused only after every replay of a large trace. Control: a new output path
    goes on to the first replay."""
    from mgtrace.replayer import minimize as mod

    Replayed = _no_replay(monkeypatch)
    trace = toggle_trace("reorder-threshold-mismatch", 0)
    taken = tmp_path / "r1"
    taken.mkdir()
    with pytest.raises(OutputError, match="already exists"):
        mod.minimize(trace, taken)
    (tmp_path / "test_r2.py").write_text(mod.TEST_TEMPLATE.split("{")[0] + "x.\n")
    with pytest.raises(OutputError, match="already exists"):
        mod.minimize(trace, tmp_path / "r2")
    # /proc takes no new file, though its permission bits let root pass
    if Path("/proc/self").is_dir():
        with pytest.raises(OutputError, match="no file can be created in /proc"):
            mod.minimize(trace, Path("/proc/r4"))
    # a folder that is not there was made, as no other -o does
    missing = tmp_path / "no" / "such" / "r5"
    with pytest.raises(OutputError, match=f"the directory {missing.parent} does not exist"):
        mod.minimize(trace, missing)
    assert not (tmp_path / "no").exists()
    with pytest.raises(Replayed):
        mod.minimize(trace, tmp_path / "r3")


def test_minimize_force_replaces_only_a_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--force once deleted any directory given as -o, the current one included. Now a
    folder that is not a trace, the current directory, and a place that cannot hold a
    directory are refused before any replay, and left as they were. Control: an existing
    trace is replaced."""
    from mgtrace.errors import UsageError
    from mgtrace.replayer import minimize as mod

    Replayed = _no_replay(monkeypatch)
    trace = toggle_trace("reorder-threshold-mismatch", 0)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    with pytest.raises(UsageError, match="current directory"):
        mod.minimize(trace, Path("."), force=True)
    with pytest.raises(UsageError, match="current directory"):
        mod.minimize(trace, tmp_path, force=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("x")
    with pytest.raises(OutputError, match="not an mgtrace trace"):
        mod.minimize(trace, other, force=True)
    with pytest.raises(OutputError, match="not a directory"):
        mod.minimize(trace, work / "notes.txt" / "repro", force=True)
    # a test file of the user's where the repro test would go: --force once replaced it
    (tmp_path / "test_mine.py").write_text("# my own test\n")
    for force in (True, False):
        with pytest.raises(OutputError, match="not a repro test mgtrace wrote; choose another"):
            mod.minimize(trace, tmp_path / "mine", force=force)
    assert (tmp_path / "test_mine.py").read_text() == "# my own test\n"
    assert (work / "notes.txt").read_text() == "mine" and (other / "data.csv").exists()
    proc = run_cli("minimize", str(trace), "-o", ".", "--force", cwd=work)
    assert "current directory" in assert_one_sentence_error(proc, 2)
    assert (work / "notes.txt").read_text() == "mine"
    # control: a trace (and an empty folder) may be replaced with --force
    old = tmp_path / "old.trace"
    shutil.copytree(trace, old)
    with pytest.raises(Replayed):
        mod.minimize(trace, old, force=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Replayed):
        mod.minimize(trace, tmp_path / "empty", force=True)
    # and a repro test mgtrace wrote, with -f as with --force
    (tmp_path / "test_mine.py").write_text(mod.TEST_TEMPLATE.split("{")[0] + "x.\n")
    with pytest.raises(Replayed):
        mod.minimize(trace, tmp_path / "mine", force=True)
    proc = run_cli("minimize", str(trace), "-o", str(other), "-f")
    assert "not an mgtrace trace" in assert_one_sentence_error(proc, 2)


def _listing(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def test_minimize_writes_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt while the repro is written, or a test file that cannot be put in place,
    once left a half-written .NAME.tmp beside an output --force had already deleted. Now the
    old trace and test file stay as they were and nothing else remains. Control: without a
    failure the output is replaced."""
    from mgtrace.replayer import minimize as mod

    trace = toggle_trace("reorder-threshold-mismatch", 0)
    mem = load_memory(TraceReader(trace))
    out = tmp_path / "repro"

    def write(sig: str) -> None:
        mod.write_minimized(mem, out, mem.manifest, trace, sig, 1, RuleSet(), force=True)

    write("first:one")
    before = _listing(tmp_path)
    real_part, real_replace = mod.write_part_file, os.replace
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_part(*args, **kwargs)

    monkeypatch.setattr(mod, "write_part_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write("second:two")
    assert _listing(tmp_path) == before
    monkeypatch.setattr(mod, "write_part_file", real_part)

    def no_test_file(src, dst, *args, **kwargs):
        if Path(dst).name == "test_repro.py":
            raise PermissionError(13, "Permission denied")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", no_test_file)
    with pytest.raises(OutputError, match="cannot write"):
        write("second:two")
    assert _listing(tmp_path) == before
    monkeypatch.setattr(os, "replace", real_replace)
    write("second:two")
    assert "second:two" in (tmp_path / "test_repro.py").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repro", "test_repro.py"]


_KILLED_WHILE_SWAPPING = """
import os, sys
from pathlib import Path
from mgtrace import atomic
from mgtrace.replayer import minimize as mod
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader

trace, out = Path(sys.argv[1]), Path(sys.argv[2])
if sys.argv[3] == "rename-aside":
    atomic._exchange = lambda a, b: False  # a file system that cannot swap two paths
real_rename = os.rename


def rename(src, dst, *args, **kwargs):
    if Path(dst) == out and Path(src).name.startswith(f".{out.name}."):
        os._exit(9)  # killed as the new repro is renamed in
    return real_rename(src, dst, *args, **kwargs)


os.rename = rename
mem = mod.load_memory(TraceReader(trace))
mod.write_minimized(mem, out, mem.manifest, trace, "second:two", 1, RuleSet(), force=True)
"""


@pytest.mark.parametrize("how", ["exchange", "rename-aside"])
def test_minimize_killed_while_replacing_leaves_a_trace_at_the_output(
    tmp_path: Path, how: str
) -> None:
    """--force moved the old repro aside and then renamed the new one in: a process killed
    between the two left nothing at the output, and the old repro under a hidden name that
    no later run looked at. Now the two are swapped in one step where the system can; where
    it cannot, the next run puts the old repro back (and so refuses to overwrite it without
    --force) before anything else."""
    trace = toggle_trace("reorder-threshold-mismatch", 0)
    mem = load_memory(TraceReader(trace))
    out = tmp_path / "repro"
    write_minimized(mem, out, mem.manifest, trace, "first:one", 1, RuleSet(), force=True)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WHILE_SWAPPING, str(trace), str(out), how],
        cwd=REPO,
        timeout=300,
    )
    if how == "exchange":  # nothing to kill it between: the new repro is in place
        assert proc.returncode == 0
        assert TraceReader(out).manifest.source["signature"] == "second:two"
    else:
        assert proc.returncode == 9
        with pytest.raises(OutputError, match="already exists"):
            write_minimized(mem, out, mem.manifest, trace, "third:3", 1, RuleSet(), force=False)
        assert TraceReader(out).manifest.source["signature"] == "first:one"
    write_minimized(mem, out, mem.manifest, trace, "third:3", 1, RuleSet(), force=True)
    assert TraceReader(out).manifest.source["signature"] == "third:3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repro", "test_repro.py"]


def test_bisect_log_never_overwrites_what_is_not_a_bisect_log(tmp_path: Path) -> None:
    """--log once wrote anywhere, over TRACE/manifest.json too. Now a path inside a trace
    other than TRACE/bisect.json, or an existing file that is not a bisect log, is refused
    before the bisect runs, and left as it was. Control: the default log, a new file and an
    older bisect log are written."""
    trace = tmp_path / "t.trace"
    shutil.copytree(toggle_trace("reorder-threshold-mismatch", 0), trace)
    manifest = (trace / "manifest.json").read_bytes()
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    for path, words in (
        (trace / "manifest.json", "lies inside the trace"),
        (trace / "steps" / "log.json", "lies inside the trace"),
        (notes, "is not a bisect log"),
        (tmp_path, "is a directory"),
    ):
        proc = run_cli("bisect", str(trace), "--log", str(path))
        assert words in assert_one_sentence_error(proc, 2)
    # a folder that cannot hold the log was found out only after the whole bisect
    (tmp_path / "afile").write_text("x")
    for path, words in (
        (tmp_path / "nodir" / "v.json", "does not exist"),
        (tmp_path / "afile" / "v.json", "is not a directory"),
        *(
            [(Path("/proc/v.json"), "no file can be created")]
            if Path("/proc/self").is_dir()
            else []
        ),
    ):
        proc = run_cli("bisect", str(trace), "--log", str(path))
        assert words in assert_one_sentence_error(proc, 2)
        assert not proc.stdout, proc.stdout  # no verdict: refused before the bisect ran
    assert not (tmp_path / "nodir").exists()
    assert (trace / "manifest.json").read_bytes() == manifest
    assert notes.read_text() == '{"mine": 1}' and not (trace / "steps" / "log.json").exists()
    verdict = bisect(trace)
    for path in (trace / "bisect.json", tmp_path / "new.json", tmp_path / "new.json"):
        save_log(verdict, path)
        assert json.loads(path.read_text())["format"] == "mgtrace-bisect"


def test_a_bisect_log_goes_to_a_stream_and_rechecks_from_where_it_lands(tmp_path: Path) -> None:
    """``--log /dev/stdout`` (and a FIFO, ``/dev/null``) was refused as "a file that is not
    a bisect log". Now the log is written to the stream, names the trace by its absolute
    path, and is alone on stdout (the verdict goes to stderr), so the file stdout was
    redirected to rechecks, from another directory; with --json the two would share stdout,
    and that is refused."""
    trace = tmp_path / "t.trace"
    shutil.copytree(toggle_trace("reorder-threshold-mismatch", 0), trace)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with open(elsewhere / "log.json", "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "mgtrace", "bisect", "t.trace", "--log", "/dev/stdout"],
            stdout=out, stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "corruption starts at step" in proc.stderr and "re-check with" not in proc.stderr
    logged = json.loads((elsewhere / "log.json").read_text())  # the log alone
    assert logged["trace_from_log"] == str(trace.resolve())
    proc = run_cli("bisect", "--replay", "log.json", cwd=elsewhere)
    assert "the verdict holds" in proc.stdout, (proc.stdout, proc.stderr)
    proc = run_cli("bisect", str(trace), "--log", "/dev/null")
    assert proc.returncode == 1 and "log: /dev/null" in proc.stdout, proc.stderr
    err = assert_one_sentence_error(
        run_cli("bisect", str(trace), "--log", "/dev/stdout", "--json"), 2
    )
    assert "two documents" in err


def test_replay_stops_before_a_gap_and_keeps_what_it_found(tmp_path: Path) -> None:
    """A gap anywhere once refused every replay of the trace, a --to-step window well before
    it included, so the commands bisect printed for such a trace did not reproduce. Now a
    replay stops before the first gap: what it found stands (exit 1, the stop said), a
    window that ends before the gap is judged on its own, and only a replay that found
    nothing before the gap is inconclusive. Control: a gap before the first finding is 125."""
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(buggy, "reorder-threshold-mismatch")["first_step"]
    gap = first + 40
    gapped = with_steps_removed(buggy, tmp_path / "gap.trace", set(range(gap, gap + 5)))
    manifest = gapped / "manifest.json"  # counted, as a recording counts what it drops
    data = json.loads(manifest.read_text())
    data["drops"] = {"steps": 5, "malformed_steps": 0, "rows": 0}
    data["drops"]["step_ranges"] = [[0, gap, gap + 4]]
    manifest.write_text(json.dumps(data))
    for jobs in ("1", "2"):
        proc = run_cli("replay", str(gapped), "--no-save", "--json", "--jobs", jobs)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        summary = json.loads(proc.stdout)
        assert summary["first_step"] == first and summary["stopped_at_gap"] == {"0": gap}
        assert f"rank 0 before step {gap}" in summary["caveat"] and "inconclusive" not in summary
    proc = run_cli("replay", str(gapped), "--no-save", f"--to-step={first - 1}", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["clean"], proc.stdout + proc.stderr
    # the report says where its replay stopped, as replay does
    html = tmp_path / "gap.html"
    assert run_cli("report", str(gapped), "-o", str(html), "--no-bisect").returncode == 0
    assert f"The replay stopped where the trace lacks steps (rank 0 before step {gap})" in (
        html.read_text()
    )
    v = bisect(gapped)
    assert v.status == "bad" and v.first_step == first
    for side, code in (("bad", 1), ("good", 0)):  # bisect's own commands reproduce
        argv = shlex.split(v.commands[side])[1:]
        assert run_cli(*argv).returncode == code, v.commands[side]
    clean_before = with_steps_removed(buggy, tmp_path / "before.trace", {first - 2})
    err = assert_one_sentence_error(run_cli("replay", str(clean_before), "--no-save"), 125)
    assert f"gap at step {first - 2}" in err and "found nothing before it" in err, err


def test_bisect_judges_the_rules_before_a_gap_within_its_horizon(tmp_path: Path) -> None:
    """The candidate rules' replays ran across a gap within the horizon, so the findings the
    gap made told bisect that no rule fixes the step, and its good command (to a step past
    the gap) did not reproduce. Now every replay of bisect stops before the gap. Control: a
    gap before the first finding is still inconclusive, and says so."""
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(buggy, "reorder-threshold-mismatch")["first_step"]
    gapped = with_steps_removed(buggy, tmp_path / "gap.trace", set(range(first + 15, first + 18)))
    v = bisect(gapped)
    assert v.status == "bad" and v.first_step == first
    assert "reorder_threshold=1+k" in v.fixes, v.fixes
    for side, code in (("bad", 1), ("good", 0)):
        assert f"--to-step={first + 14}" in v.commands[side]
        argv = shlex.split(v.commands[side])[1:]
        assert run_cli(*argv).returncode == code, v.commands[side]
    early = bisect(with_steps_removed(buggy, tmp_path / "early.trace", {first - 5}))
    assert early.status == "inconclusive" and f"gap at step {first - 5}" in early.reason
    assert "before any finding" in early.reason, early.reason


def test_a_request_that_arrives_in_a_gap_is_not_taken_for_a_mid_run_start(
    tmp_path: Path,
) -> None:
    """A request first seen after a gap (it arrived in it) made the whole rank look as if
    the recording had begun mid-run: reads of state no step wrote went unchecked and
    findings before the gap were lost. Control: the same steps of the trace without the
    gap give the same findings."""
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(buggy, "reorder-threshold-mismatch")["first_step"]
    sched = TraceReader(buggy).table("sched", columns=["step", "kind"])
    kinds = sched.column("kind").cast(pa.string()).to_pylist()
    arrival = next(
        s
        for s, k in zip(sched.column("step").to_pylist(), kinds, strict=True)
        if k == "new" and s > first + 20
    )
    gapped = with_steps_removed(buggy, tmp_path / "gap.trace", set(range(arrival - 1, arrival + 3)))
    said = json.loads(run_cli("replay", str(gapped), "--no-save", "--json").stdout)
    whole = json.loads(
        run_cli("replay", str(buggy), "--no-save", "--json", f"--to-step={arrival - 2}").stdout
    )
    assert said["findings"] == whole["findings"] and said["counts"] == whole["counts"]
    assert "mid-run" not in said["caveat"] and said["stopped_at_gap"] == {"0": arrival - 1}


def test_a_clean_window_is_judged_by_the_steps_it_covers(tmp_path: Path) -> None:
    """A clean replay whose window ends before a gap is clean, --allow-gaps or not; one that
    stops at the gap having found nothing is inconclusive, and so is a window that crosses
    the gap (the trace lacks steps it covered) or reaches the trace's end (the manifest's
    drops may lie there)."""
    from mgtrace.replayer.loop import Reach

    clean = sim_trace(None, 1, 300, scenario="pairs", runner="v1")
    gapped = with_steps_removed(clean, tmp_path / "gap.trace", set(range(150, 155)))
    for args, code in (
        (["--to-step", "100"], 0),
        (["--allow-gaps", "--to-step", "100"], 0),
        ([], 125),
    ):
        proc = run_cli("replay", str(gapped), "--no-save", *args)
        assert proc.returncode == code, (args, proc.stdout + proc.stderr)
    # --json says an inconclusive replay as JSON too (stdout was empty), the sentence aside
    proc = run_cli("replay", str(gapped), "--no-save", "--json")
    said = json.loads(proc.stdout)
    assert proc.returncode == 125 and said["clean"] is None, proc.stdout
    assert "found nothing before it" in said["inconclusive"]
    assert "found nothing before it" in assert_one_sentence_error(proc, 125)
    steps = np.array([*range(150), *range(155, 300)])
    for to_step, stop, until, whole in (
        (100, True, 100, True),
        (100, False, 100, True),
        (200, True, 149, False),
        (200, False, 200, False),  # --allow-gaps across the gap: not a whole window
        (None, True, 149, False),
    ):
        reach = Reach(to_step)
        assert reach.until(0, steps, None, stop=stop) == until, (to_step, stop)
        assert reach.whole is whole and bool(reach.stopped) is (stop and until == 149)
    reach = Reach(299)  # to the end: what the manifest says is missing may lie past it
    assert reach.until(0, np.arange(300), None) == 299 and not reach.whole


def test_a_replay_across_a_gap_says_so(tmp_path: Path) -> None:
    """``--allow-gaps`` replayed across missing steps and reported what it found there
    (a clean run's requests, read against state the missing steps would have written) with
    no caveat, in text or JSON. Now the caveat names the gap it crossed. Control: a window
    that ends before the gap crosses none, and says nothing of it."""
    clean = sim_trace(None, 1, 300, scenario="pairs", runner="v1")
    gapped = with_steps_removed(clean, tmp_path / "gap.trace", set(range(150, 155)))
    said = "crossed steps the trace lacks (rank 0 at step 150)"
    proc = run_cli("replay", str(gapped), "--no-save", "--allow-gaps", "--json")
    assert said in (json.loads(proc.stdout).get("caveat") or ""), proc.stdout
    proc = run_cli("replay", str(gapped), "--no-save", "--allow-gaps", "--jobs", "2")
    assert said in " ".join(proc.stdout.split()), proc.stdout
    proc = run_cli("replay", str(gapped), "--no-save", "--allow-gaps", "--to-step", "100")
    assert proc.returncode == 0 and "crossed" not in proc.stdout, proc.stdout


def test_minimize_replays_up_to_the_first_gap(tmp_path: Path) -> None:
    """A gap after the first finding once refused the whole trace (its baseline replay ran
    across it), though bisect gives a verdict on it. Now only a gap before the first
    finding is refused; a damaged trace is read with --skip-bad-parts, as by replay and
    bisect. Control: the gap before the finding is still inconclusive."""
    from mgtrace.errors import InconclusiveError

    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(buggy, "reorder-threshold-mismatch")["first_step"]
    after = with_steps_removed(buggy, tmp_path / "after.trace", {first + 5})
    result = minimize(after, tmp_path / "repro")
    assert result.original_first_step == first
    before = with_steps_removed(buggy, tmp_path / "before.trace", {first - 2})
    with pytest.raises(InconclusiveError, match="gap at step"):
        minimize(before, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    damaged = tmp_path / "damaged.trace"
    shutil.copytree(buggy, damaged)
    next((damaged / "row_moves").glob("*.parquet")).write_bytes(b"PAR1 garbage")
    assert run_cli("minimize", str(damaged), "-o", str(tmp_path / "d1")).returncode == 3
    proc = run_cli("minimize", str(damaged), "-o", str(tmp_path / "d2"), "--skip-bad-parts")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("table", ["launches", "batch_rows", "sched", "steps"])
def test_minimize_names_a_gap_at_step_0(tmp_path: Path, table: str) -> None:
    """A left-out part holding step 0 once left an empty trace to replay: "the trace holds
    no align-kernel launches" (exit 2), or, with the steps part gone, "replays clean" though
    nothing was replayed. Both are the gap at step 0, inconclusive (exit 125)."""
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    damaged = _with_half_a_part(buggy, tmp_path / "damaged.trace", table)
    if table == "steps":  # the part gone, not only cut: no step row is left at all
        next((damaged / "steps").glob("*.parquet")).unlink()
    proc = run_cli("minimize", str(damaged), "-o", str(tmp_path / "m"), "--skip-bad-parts")
    err = assert_one_sentence_error(proc, 125)
    assert "has a gap at step 0" in err and "before any finding" in err, err
    assert not (tmp_path / "m").exists()


def test_minimize_reaches_a_fixed_point(tmp_path: Path) -> None:
    """The prefix trim once ran last, after the requests and steps were reduced, so a repro
    minimized again lost more requests and steps. Now the passes repeat until none removes
    anything: minimizing the repro again changes nothing."""
    trace = sim_trace("reorder-threshold-mismatch", 1, 500, runner="v1")
    once = minimize(trace, tmp_path / "once")
    twice = minimize(tmp_path / "once", tmp_path / "twice")
    assert (twice.steps, twice.requests, twice.table_updates) == (
        once.steps,
        once.requests,
        once.table_updates,
    ), (once.history, twice.history)
    assert twice.first_step == once.first_step and twice.signature == once.signature


def _with_wall_clock(src: Path, dst: Path, offset: int) -> Path:
    mem = load_memory(TraceReader(src))
    steps = mem.tables_["steps"]
    i = steps.column_names.index("wall_ns")
    clock = pa.array([offset + 20_000_000 * n for n in range(steps.num_rows)], pa.int64())
    tables = {**mem.tables_, "steps": steps.set_column(i, steps.schema.field(i), clock)}
    write_trace(MemoryTrace(mem.manifest, tables), dst, mem.manifest)
    return dst


def test_diff_traces_ignores_timing_and_names_missing_steps(tmp_path: Path) -> None:
    """Two recordings of the same inputs once "first differed at step 0 in steps" (their
    clocks), and a step missing inside one trace read as "only A goes on". Control: a
    trace that ends early still reads so, and a real input difference is still found."""
    src = sim_trace(None, 0, 300, scenario="pairs", runner="v1")
    a = _with_wall_clock(src, tmp_path / "a.trace", 0)
    b = _with_wall_clock(src, tmp_path / "b.trace", 7_000_000_000)
    assert diff_traces(TraceReader(a), TraceReader(b)).first_step is None
    gapped = with_steps_removed(a, tmp_path / "gap.trace", {40, 41})
    d = diff_traces(TraceReader(a), TraceReader(gapped))
    said = d.sentence("A", "B")
    assert d.first_step == 40 and "B lacks steps 40-41 of rank 0, which A has" in said, said
    ended = with_steps_removed(a, tmp_path / "end.trace", set(range(250, 300)))
    said = diff_traces(TraceReader(a), TraceReader(ended)).sentence("A", "B")
    assert said.endswith("only A goes on"), said
    other = sim_trace(None, 1, 300, scenario="pairs", runner="v1")
    assert diff_traces(TraceReader(a), TraceReader(other)).first_step is not None


def test_diff_traces_of_an_unfinished_recording_is_inconclusive(tmp_path: Path) -> None:
    """Two traces with the same inputs, one of a recording that did not finish, were "the
    same at every step", exit 0, though the run may go on where the recording stopped:
    exit 125, as replay and bisect say of such a trace. Control: both finished, exit 0."""
    clean = sim_trace(None, 1, 300, scenario="pairs", runner="v1")
    whole = with_steps_removed(clean, tmp_path / "whole.trace", set())
    cut = with_steps_removed(clean, tmp_path / "cut.trace", set(), complete=False)
    proc = run_cli("diff", str(whole), str(cut))
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "did not finish" in proc.stdout, proc.stdout
    said = json.loads(run_cli("diff", str(cut), str(whole), "--json").stdout)
    assert "the first trace: the recording did not finish" in said["inconclusive"], said
    assert run_cli("diff", str(whole), str(clean)).returncode == 0


def _with_half_a_part(src: Path, dst: Path, table: str) -> Path:
    """A copy of SRC whose first part of TABLE is cut in half, as a full disk leaves it."""
    shutil.copytree(src, dst)
    part = sorted((dst / table).glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    return dst


def test_diff_traces_before_a_left_out_step_0_is_inconclusive(tmp_path: Path) -> None:
    """Two traces that differ at step 0, one with a left-out part from step 0 on, were
    "the same at every step before step 0", exit 0. Nothing was compared: exit 125, and
    it says so. Control: the whole traces differ at step 0, exit 1."""
    a = sim_trace(None, 0, 300, scenario="pairs", runner="v1")
    b = sim_trace(None, 1, 300, scenario="pairs", runner="v1")
    cut = _with_half_a_part(a, tmp_path / "cut.trace", "launches")
    proc = run_cli("diff", str(cut), str(b), "--skip-bad-parts")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "share no step to compare" in proc.stdout, proc.stdout
    said = json.loads(run_cli("diff", str(cut), str(b), "--skip-bad-parts", "--json").stdout)
    assert said["left_out_from"] == 0 and said["inconclusive"], said
    proc = run_cli("diff", str(a), str(b))
    assert proc.returncode == 1 and "first differ at step 0" in proc.stdout, proc.stdout


def test_diff_rules_stops_at_a_gap(tmp_path: Path) -> None:
    """Two rule sets were replayed across a gap, and on an incomplete trace, with a
    confident answer. Now the replays stop at the first gap and say so, and no divergence
    before it (or on an incomplete recording) is inconclusive, exit 125. Control: the
    same trace without the gap diverges at the injected step."""
    buggy = toggle_trace("reorder-threshold-mismatch", 0)
    first = _truth(buggy, "reorder-threshold-mismatch")["first_step"]
    gapped = with_steps_removed(buggy, tmp_path / "gap.trace", {first - 2})
    rules = RuleSet.parse("reorder_threshold=1+k")
    d = diff_rules(TraceReader(gapped), RuleSet(), rules)
    assert d.first_step is None and d.gap == (0, first - 2) and d.inconclusive
    said = d.sentence(RuleSet(), rules)
    assert f"gap at step {first - 2}" in said and "inconclusive" in said, said
    proc = run_cli("diff", str(gapped), "--rules-b", "reorder_threshold=1+k")
    assert proc.returncode == 125 and "gap at step" in proc.stdout, proc.stdout + proc.stderr
    clean = sim_trace(None, 1, 300, scenario="pairs", runner="v1")
    cut = with_steps_removed(clean, tmp_path / "cut.trace", set(), complete=False)
    d = diff_rules(TraceReader(cut), RuleSet(), RuleSet.parse("accepted_source=cpu"))
    assert d.first_step is None and "did not finish" in (d.inconclusive or "")
    assert diff_rules(TraceReader(buggy), RuleSet(), rules).first_step == first


def test_bisect_replay_refuses_what_it_would_ignore(tmp_path: Path) -> None:
    """--replay re-checks the log's own trace, horizon and rules: a TRACE, --horizon, a
    rule or --log given with it was silently ignored; now each is a usage error. A log
    with a field of the wrong type was an internal error (exit 70); now it is a damaged
    log, in one sentence."""
    trace = tmp_path / "t.trace"
    shutil.copytree(toggle_trace("reorder-threshold-mismatch", 0), trace)
    log = trace / "bisect.json"
    save_log(bisect(trace), log)
    for extra in (
        [str(trace)],
        ["--horizon", "5"],
        ["--reorder-threshold=1+k"],
        ["--rules", "accepted_source=cpu"],
        ["--log", str(tmp_path / "other.json")],
        ["--rank", "0"],  # the log's own ranks are re-checked: --rank was silently ignored
    ):
        err = assert_one_sentence_error(run_cli("bisect", *extra, "--replay", str(log)), 2)
        assert "--replay re-checks" in err and "drop" in err, err
    assert not (tmp_path / "other.json").exists()
    logged = json.loads(log.read_text())
    for field, value in (("horizon", "x"), ("first_step", "7"), ("requests", 3)):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**logged, field: value}))
        err = assert_one_sentence_error(run_cli("bisect", "--replay", str(bad)), 2)
        assert "is a damaged bisect log" in err, err


def test_bisect_and_minimize_name_replays_first_finding(tmp_path: Path) -> None:
    """bisect listed a step's findings in the oracle's order, replay and minimize in (step,
    rank, batch row) order, so they named different first findings (this trace's first
    step has several). A --signature the trace does not show was 'inconclusive' (125);
    it is a usage error."""
    trace = sim_trace("stale-condense-row", 0, 500, runner="v1")
    lead = replay_trace(TraceReader(trace), RuleSet()).findings[0]
    v = bisect(trace)
    assert (v.first_findings[0]["req_id"], v.first_findings[0]["batch_row"]) == (
        lead.req_id,
        lead.batch_row,
    )
    proc = run_cli("minimize", str(trace), "-o", str(tmp_path / "m"), "--signature", "bogus")
    assert "not among the first findings" in assert_one_sentence_error(proc, 2)
    # the damaged-trace message names --skip-bad-parts: diff has it too (minimize: above)
    damaged = tmp_path / "damaged.trace"
    shutil.copytree(trace, damaged)
    next((damaged / "row_moves").glob("*.parquet")).write_bytes(b"PAR1 garbage")
    rules = ("--rules-b", "clear_vacated_rows=true")
    assert "--skip-bad-parts" in run_cli("diff", str(damaged), *rules).stderr
    proc = run_cli("diff", str(damaged), *rules, "--skip-bad-parts")
    assert proc.returncode == 1 and "first diverge" in proc.stdout, proc.stdout + proc.stderr


def test_diff_prints_paths_with_brackets_as_they_are(tmp_path: Path) -> None:
    """diff's sentence names both traces and went through rich markup: "a[bold]x" printed
    as "ax". Relative paths keep the sentence short enough not to wrap."""
    src = sim_trace(None, 0, 300, scenario="pairs", runner="v1")
    shutil.copytree(src, tmp_path / "a[bold]x")
    shutil.copytree(src, tmp_path / "b[bold]x")
    proc = run_cli("diff", "a[bold]x", "b[bold]x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "a[bold]x and b[bold]x record the same inputs" in proc.stdout, proc.stdout


def test_a_bisect_log_that_cannot_be_written_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log the disk refused once the bisect had run was said twice over ("could not write
    the bisect log X: cannot write the bisect log X: ...") across three wrapped lines.
    Control: the verdict is still printed, and the log is said to be missing."""
    from mgtrace.cli import main
    from mgtrace.errors import OutputError
    from mgtrace.schemas import manifest

    trace = tmp_path / "t.trace"
    shutil.copytree(toggle_trace("reorder-threshold-mismatch", 0), trace)
    log = tmp_path / ("a-long-folder-name-" * 4) / "bisect.json"
    log.parent.mkdir()

    def full(path: Path, data: object) -> None:
        raise OutputError(f"cannot write the bisect log {path}: No space left on device")

    monkeypatch.setattr(manifest, "write_json_atomic", full)
    assert main(["bisect", str(trace), "--log", str(log)]) == 1
    out, err = capsys.readouterr()
    assert err == f"mgtrace: cannot write the bisect log {log}: No space left on device\n"
    assert "corruption starts at step" in out


def test_a_repro_part_the_disk_refuses_is_named_where_it_was_going(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error named the hidden folder the repro is built in ("out/.m.trace.23466-0@vm.new/
    steps/..."), a path the user never gave and that is gone once the error is read."""
    from mgtrace.errors import OutputError
    from mgtrace.replayer import minimize as mod

    def refused(folder: Path, rel: str, table: object) -> None:
        raise OutputError(f"cannot write {folder / rel}: File too large")

    monkeypatch.setattr(mod, "write_part_file", refused)
    out = tmp_path / "m.trace"
    with pytest.raises(OutputError) as caught:
        mod.minimize(toggle_trace("reorder-threshold-mismatch", 0), out)
    assert caught.value.message.startswith(f"cannot write {out}/"), caught.value.message
    assert ".new" not in caught.value.message and not out.exists()


def test_a_clean_verdict_of_chosen_ranks_names_them(tmp_path: Path) -> None:
    """bisect --rank 1 on a pipeline trace whose rank 0 is corrupt said "clean: no request
    reads state that is not its own under as-recorded" (exit 0), as if the whole run were
    clean; the replay says "(rank 1, of 2)". Control: every rank bisected names none."""
    trace = toggle_trace("batch-row-block-table", 0)
    only = bisect(trace, ranks=[1])
    assert only.status == "clean" and "on rank 1 " in only.sentence(), only.sentence()
    assert bisect(trace, ranks=[0]).status == "bad"
    from mgtrace.replayer.bisect import Verdict

    whole = Verdict(status="clean", trace=str(trace), base_rules="as-recorded")
    assert "on rank" not in whole.sentence()
