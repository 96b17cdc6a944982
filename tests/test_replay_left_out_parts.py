"""A part that --skip-bad-parts leaves out makes its steps gaps for the replay, not steps with
no launches, block tables or batch rows, which the oracle would read as corruption."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mgtrace.replayer.steps import REPLAY_TABLES, complete_steps
from mgtrace.schemas.manifest import MANIFEST_NAME
from mgtrace.schemas.reader import SkippedPart, TraceReader
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.slow


def _damage(trace: Path, table: str, rank: int) -> str:
    parts = json.loads((trace / MANIFEST_NAME).read_text())["parts"]
    rel = next(p["path"] for p in parts if p["table"] == table and p["rank"] == rank)
    (trace / rel).write_bytes(b"PAR1 garbage")
    return rel


@pytest.fixture(scope="module")
def buggy_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("left-out") / "buggy"
    proc = run_cli(
        "simulate", "--steps", "60", "--bug", "reorder-threshold-mismatch", "-o", str(path)
    )
    assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture(scope="module")
def pp_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("left-out") / "pp2"
    proc = run_cli(
        "simulate", "--steps", "60", "--runner", "v2", "--pp", "2", "--seed", "3", "-o", str(path)
    )
    assert proc.returncode == 0, proc.stderr
    return path


def test_whole_trace_is_the_control(buggy_trace: Path) -> None:
    proc = run_cli("replay", str(buggy_trace), "--no-save")
    assert proc.returncode == 1, proc.stderr
    assert "first at step" in proc.stdout


@pytest.mark.parametrize("table", ["launches", "block_tables", "batch_rows", "sched"])
def test_a_left_out_part_makes_the_replay_inconclusive(
    buggy_trace: Path, tmp_path: Path, table: str
) -> None:
    trace = tmp_path / "t"
    shutil.copytree(buggy_trace, trace)
    _damage(trace, table, 0)
    proc = run_cli("replay", str(trace), "--skip-bad-parts", "--no-save")
    err = assert_one_sentence_error(proc, 125)
    assert "lacks rows of step 0" in err and "left out" in err
    proc = run_cli("replay", str(trace), "--skip-bad-parts", "--no-save", "--jobs", "2")
    assert "lacks rows of step 0" in assert_one_sentence_error(proc, 125)
    # across the gap nothing is left to replay: no verdict, rather than "clean" or findings
    proc = run_cli("replay", str(trace), "--skip-bad-parts", "--allow-gaps", "--no-save")
    assert "no step of" in assert_one_sentence_error(proc, 125)
    proc = run_cli("bisect", str(trace), "--skip-bad-parts")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "left-out steps" in proc.stdout
    # it replayed no step: not a clean replay with a caveat
    assert "no step could be replayed" in proc.stdout and "clean" not in proc.stdout


def test_a_left_out_steps_part_is_no_clean_verdict(buggy_trace: Path, tmp_path: Path) -> None:
    """Without its steps part no step of the trace is known: replay and bisect once called
    that clean (exit 0). Control: the whole trace is found bad (test above)."""
    trace = tmp_path / "t"
    shutil.copytree(buggy_trace, trace)
    _damage(trace, "steps", 0)
    proc = run_cli("replay", str(trace), "--skip-bad-parts", "--no-save")
    assert "no step of" in assert_one_sentence_error(proc, 125)
    proc = run_cli("bisect", str(trace), "--skip-bad-parts")
    assert proc.returncode == 125 and "left-out steps" in proc.stdout, proc.stdout


def test_a_clean_replay_of_an_unfinished_recording_is_inconclusive(
    pp_trace: Path, tmp_path: Path
) -> None:
    """As bisect says: corruption may lie in the steps never recorded. Control: the same
    trace, finished, is clean."""
    proc = run_cli("replay", str(pp_trace), "--no-save")
    assert proc.returncode == 0 and "inconclusive" not in proc.stdout, proc.stdout
    trace = tmp_path / "t"
    shutil.copytree(pp_trace, trace)
    path = trace / MANIFEST_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "complete": False}))
    proc = run_cli("replay", str(trace), "--no-save")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    assert "clean" in proc.stdout and "did not finish" in proc.stdout
    proc = run_cli("replay", str(trace), "--no-save", "--json")
    assert proc.returncode == 125 and "did not finish" in json.loads(proc.stdout)["inconclusive"]


def test_only_what_a_replay_reads_can_make_it_inconclusive(pp_trace: Path, tmp_path: Path) -> None:
    """--allow-gaps on a whole trace, and a left-out part of a table the replay never
    reads (row moves), leave a clean replay clean. Control: a left-out launches part does
    not (the test above)."""
    proc = run_cli("replay", str(pp_trace), "--no-save", "--allow-gaps")
    assert proc.returncode == 0 and "inconclusive" not in proc.stdout, proc.stdout
    trace = tmp_path / "t"
    shutil.copytree(pp_trace, trace)
    parts = json.loads((trace / MANIFEST_NAME).read_text())["parts"]
    moves = [p["path"] for p in parts if p["table"] == "row_moves"]
    if not moves:
        pytest.skip("this run moved no rows")
    (trace / moves[0]).write_bytes(b"PAR1 garbage")
    proc = run_cli("replay", str(trace), "--no-save", "--skip-bad-parts")
    assert proc.returncode == 0 and "inconclusive" not in proc.stdout, proc.stdout


def test_a_replay_says_what_it_does_not_model(pp_trace: Path, tmp_path: Path) -> None:
    """A recording whose prefills stored checkpoints (vLLM 0.33's Mamba2) gets a caveat with
    its verdict. Control: the same trace without the flag gets none."""
    trace = tmp_path / "t"
    shutil.copytree(pp_trace, trace)
    path = trace / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["run"]["prefill_checkpoint_blocks"] = 1
    path.write_text(json.dumps(data))
    proc = run_cli("replay", str(trace), "--no-save")
    assert proc.returncode == 0 and "caveat: this engine's Mamba prefills" in proc.stdout
    proc = run_cli("replay", str(trace), "--no-save", "--json")
    assert "prefill checkpoints" in json.loads(proc.stdout)["caveat"]
    proc = run_cli("replay", str(pp_trace), "--no-save", "--json")
    assert proc.returncode == 0 and "caveat" not in json.loads(proc.stdout)


def test_a_v2_replay_says_how_it_reads_the_reorder_rule(pp_trace: Path) -> None:
    """V2 never reorders by a threshold, so the rule re-sorts and re-splits: the verdict says so.
    Control: the same trace replayed as recorded gets no note."""
    proc = run_cli("replay", str(pp_trace), "--no-save", "--reorder-threshold=1+k")
    assert proc.returncode == 0 and "note: the V2 runner never reorders" in proc.stdout
    proc = run_cli("replay", str(pp_trace), "--no-save", "--json", "--reorder-threshold=1")
    assert "sorts the batch again" in json.loads(proc.stdout)["note"]
    proc = run_cli("replay", str(pp_trace), "--no-save", "--json")
    assert proc.returncode == 0 and "note" not in json.loads(proc.stdout)


def test_a_gdn_replay_says_the_reorder_rule_keeps_the_mask(
    buggy_trace: Path, tmp_path: Path
) -> None:
    """A GDN model's split is its mask: the reorder rule's verdict says the rule only
    reorders. Control: the same V1 trace without a GDN builder gets no note."""
    proc = run_cli("replay", str(buggy_trace), "--no-save", "--json", "--reorder-threshold=1+k")
    assert "note" not in json.loads(proc.stdout)
    trace = tmp_path / "t"
    shutil.copytree(buggy_trace, trace)
    path = trace / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["run"]["builder_reorder_thresholds"] = {"GDNAttentionMetadataBuilder": 4}
    path.write_text(json.dumps(data))
    proc = run_cli("replay", str(trace), "--no-save", "--json", "--reorder-threshold=1+k")
    assert "marks its spec-decode rows by their draft counts" in json.loads(proc.stdout)["note"]


def test_a_left_out_part_of_one_rank_leaves_the_other_rank(pp_trace: Path, tmp_path: Path) -> None:
    trace = tmp_path / "t"
    shutil.copytree(pp_trace, trace)
    _damage(trace, "launches", 1)
    err = assert_one_sentence_error(run_cli("replay", str(trace), "--skip-bad-parts"), 125)
    assert "rank 1 of the trace lacks rows of step 0" in err
    proc = run_cli("replay", str(trace), "--skip-bad-parts", "--allow-gaps", "--json", "--no-save")
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 60 and summary["clean"]  # rank 0's steps, all of them
    # clean where it could look, but rank 1's launches are missing: no clean verdict
    assert proc.returncode == 125 and "left-out steps" in summary["inconclusive"]
    assert summary["inconclusive"].startswith("the replay is clean, but")  # it replayed some
    # bisect said "no step could be replayed" beside "60 steps replayed": rank 0's were
    proc = run_cli("bisect", str(trace), "--skip-bad-parts")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert "rank 1 has a gap at step 0" in text and "before any finding" in text, text
    assert "no step could be replayed" not in text


def test_a_pp_summary_counts_steps_per_rank(pp_trace: Path, buggy_trace: Path) -> None:
    proc = run_cli("replay", str(pp_trace), "--no-save")
    assert proc.returncode == 0, proc.stderr
    assert "clean: 120 rank-steps (2 ranks) replayed" in proc.stdout  # 60 steps on each rank
    one = run_cli("replay", str(buggy_trace), "--no-save")  # the control: one rank
    assert "findings over 60 steps" in one.stdout and "rank-steps" not in one.stdout


class _Reader:
    """Just what ``complete_steps`` asks of a reader."""

    def __init__(self, skipped: list[SkippedPart]) -> None:
        self.skipped = skipped

    steps_left_out = TraceReader.steps_left_out


def test_left_out_ranges_by_rank_and_table() -> None:
    steps = np.arange(10)
    reader = _Reader(
        [
            SkippedPart("launches/r000-000001.parquet", "x", "launches", 0, 3, 5),
            SkippedPart("row_moves/r000-000002.parquet", "x", "row_moves", 0, 7, 8),  # not read
            SkippedPart("sched/r001-000000.parquet", "x", "sched", 1, None, None),
        ]
    )
    assert "row_moves" not in REPLAY_TABLES
    kept = complete_steps(reader, 0, steps)  # type: ignore[arg-type]
    assert steps[~kept].tolist() == [3, 4, 5]
    assert not complete_steps(reader, 1, steps).any()  # type: ignore[arg-type]
    assert complete_steps(reader, 2, steps).all()  # type: ignore[arg-type]
    no_skips = _Reader([])
    assert complete_steps(no_skips, 0, steps).all()  # type: ignore[arg-type]


def test_bisect_prints_commands_that_read_the_trace_as_it_did(buggy_trace: Path) -> None:
    """Bisect with --skip-bad-parts printed replay commands without it, which a damaged
    part then stopped (exit 3). Control: without the flag, the commands go without it."""
    import shlex

    from mgtrace.replayer.bisect import bisect

    skipping = bisect(buggy_trace, skip_bad_parts=True)
    assert skipping.status == "bad"
    for side, code in (("bad", 1), ("good", 0)):
        argv = shlex.split(skipping.commands[side])[1:]
        assert "--skip-bad-parts" in argv and run_cli(*argv).returncode == code
    plain = bisect(buggy_trace)
    assert all("--skip-bad-parts" not in c for c in plain.commands.values())
