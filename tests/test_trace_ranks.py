"""A multi-worker recording (``DIR/rank-NNN``, one trace per rank) reads as one trace."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from mgtrace.api import Trace
from mgtrace.errors import ManifestError, PartError, UsageError
from mgtrace.query.canned import as_recorded_replay_id
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.steps import ranks_of
from mgtrace.schemas.manifest import MANIFEST_NAME
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import TraceWriter
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-rank (V2, PP 2) simulated trace with the batch-row bug, written as one trace."""
    path = tmp_path_factory.mktemp("ranks") / "whole.trace"
    cfg = SimConfig(
        scenario="pairs",
        steps=160,
        runner="v2",
        pp=2,
        seed=1,
        bugs=("batch-row-block-table",),
        output=path,
        overwrite=True,
    )
    simulate(cfg.validate())
    return path


def split_by_rank(whole: Path, out: Path) -> dict[int, Path]:
    """Write each rank's rows of ``whole`` as its own trace under ``out/rank-NNN``, the way
    one worker process per rank records."""
    reader = TraceReader(whole)
    dirs = {}
    for rank in (0, 1):
        path = out / f"rank-{rank:03d}"
        with TraceWriter(path, run=reader.run, source={"kind": "test", "rank": rank}) as w:
            for name, spec in TABLES.items():
                table = reader.table(name)
                if spec.per_step:
                    table = table.filter(pa.compute.equal(table["rank"], rank)).drop(["rank"])
                    steps = table["step"].to_pylist()
                    if steps:
                        w.write_steps(rank, min(steps), max(steps), {name: _columns(table)})
                elif rank == 0 and name != "findings" and table.num_rows:
                    w.write_rows(name, _columns(table))  # per-run tables: written once
        dirs[rank] = path
    return dirs


def _columns(table: pa.Table) -> dict[str, list]:
    return {c: table[c].to_pylist() for c in table.column_names}


def _sorted(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: json.dumps(r, sort_keys=True, default=str))


def test_rank_directories_read_as_one_trace(whole: Path, tmp_path: Path) -> None:
    split_by_rank(whole, tmp_path / "rec")
    merged, original = TraceReader(tmp_path / "rec"), TraceReader(whole)
    assert merged.manifest.complete
    assert sorted(merged.manifest.source["ranks"]) == ["rank-000", "rank-001"]
    for name in ("steps", "batch_rows", "launches", "block_tables", "sched", "requests"):
        assert _sorted(merged.table(name)) == _sorted(original.table(name)), name
    assert {p.rank for p in merged.parts if p.table == "batch_rows"} == {0, 1}


def test_replay_of_rank_directories_finds_what_the_whole_trace_shows(
    whole: Path, tmp_path: Path
) -> None:
    split_by_rank(whole, tmp_path / "rec")

    def summary(path: Path) -> list[tuple]:
        result = replay_trace(TraceReader(path))
        return [(f.rank, f.step, f.req_id, f.signature) for f in result.findings]

    expected = summary(whole)
    assert expected, "the control: the whole trace has findings"
    assert summary(tmp_path / "rec") == expected


def test_findings_are_added_beside_the_ranks_and_the_union_stays_fresh(
    whole: Path, tmp_path: Path
) -> None:
    rec = tmp_path / "rec"
    split_by_rank(whole, rec)
    proc = run_cli("replay", str(rec))
    assert proc.returncode == 1, proc.stderr
    assert (rec / MANIFEST_NAME).is_file()  # the merged directory's own parts
    own = json.loads((rec / MANIFEST_NAME).read_text())["parts"]
    assert own and {p["table"] for p in own} == {"findings"}  # no rank part copied up
    reader = TraceReader(rec)
    assert reader.rows("findings") > 0
    assert reader.rows("batch_rows") == TraceReader(whole).rows("batch_rows")  # not doubled
    # A rank trace that changes later is seen on the next open, not a stale copy of it.
    manifest = json.loads((rec / "rank-001" / MANIFEST_NAME).read_text())
    manifest["errors"] = {"hook:late": {"count": 1, "first": "late"}}
    (rec / "rank-001" / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "rank-001: hook:late" in TraceReader(rec).manifest.errors
    sql = run_cli("sql", str(rec), "SELECT count(DISTINCT rank) AS ranks FROM batch_rows")
    assert sql.returncode == 0 and "2" in sql.stdout, sql.stdout


def test_ranks_of_different_runs_are_refused(whole: Path, tmp_path: Path) -> None:
    dirs = split_by_rank(whole, tmp_path / "rec")
    manifest = json.loads((dirs[1] / MANIFEST_NAME).read_text())
    manifest["run"]["num_speculative_tokens"] += 1
    (dirs[1] / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="disagree on num_speculative_tokens"):
        TraceReader(tmp_path / "rec")
    err = assert_one_sentence_error(run_cli("info", str(tmp_path / "rec")), 3)
    assert "rank-001" in err


def test_a_damaged_rank_part_is_named_with_its_rank(whole: Path, tmp_path: Path) -> None:
    split_by_rank(whole, tmp_path / "rec")
    part = sorted((tmp_path / "rec" / "rank-001" / "batch_rows").glob("*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(PartError, match="rank-001/batch_rows/"):
        TraceReader(tmp_path / "rec")
    reader = TraceReader(tmp_path / "rec", skip_bad_parts=True)
    assert [s.path for s in reader.skipped] == [str(part.relative_to(tmp_path / "rec"))]


def test_an_open_part_inside_a_rank_is_reported(whole: Path, tmp_path: Path) -> None:
    split_by_rank(whole, tmp_path / "rec")
    left = tmp_path / "rec" / "rank-000" / "batch_rows" / "part-9.parquet.tmp"
    left.write_bytes(b"partial")
    assert TraceReader(tmp_path / "rec").open_parts_left() == [
        "rank-000/batch_rows/part-9.parquet.tmp"
    ]


def test_a_directory_without_any_trace_is_still_refused(tmp_path: Path) -> None:
    (tmp_path / "rank-000").mkdir()  # no manifest inside: not a rank trace
    with pytest.raises(ManifestError, match="not an mgtrace trace"):
        TraceReader(tmp_path)


def test_info_counts_engine_steps_not_step_rows_of_every_rank(whole: Path) -> None:
    from mgtrace.query.info import trace_info

    info = trace_info(TraceReader(whole))
    assert info["ranks"] == 2 and (info["first_step"], info["last_step"]) == (0, 159)
    assert info["steps"] == 160 and info["rows"]["steps"] == 320  # one row per rank and step


def test_data_parallel_ranks_are_engines_of_their_own(whole: Path, tmp_path: Path) -> None:
    """vLLM offsets torch.distributed's rank by the DP rank, so a DP=2 recording wrote
    rank-000 and rank-001 and every verb read them as two ranks of one engine, though each
    has a scheduler, steps and requests of its own. The recorder now writes dp-NNN, which
    DIR names as one engine each, and two ranks of different DP ranks are refused as ranks
    of one run. Control: each DP rank's trace reads on its own and says which it is."""
    from dataclasses import replace

    run = TraceReader(whole).run
    rec = tmp_path / "dp"
    for dp_rank in (0, 1):
        TraceWriter(rec / f"dp-{dp_rank:03d}", run=replace(run, dp_size=2, dp_rank=dp_rank)).close()
    with pytest.raises(ManifestError, match=r"holds one trace per engine \(dp-000, dp-001\)"):
        TraceReader(rec)
    err = assert_one_sentence_error(run_cli("replay", str(rec)), 3)
    assert f"{rec / 'dp-000'}" in err
    assert TraceReader(rec / "dp-001").run.dp_rank == 1
    info = run_cli("info", str(rec / "dp-001"))
    assert info.returncode == 0 and "rank 1 of 2 (an engine of its own)" in info.stdout
    # ranks of two DP ranks in one folder (as recorded before): refused, not merged
    dirs = split_by_rank(whole, tmp_path / "mixed")
    for rank, path in dirs.items():
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        manifest["run"].update(dp_size=2, dp_rank=rank)
        (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="disagree on dp_rank"):
        TraceReader(tmp_path / "mixed")


def test_replay_of_some_ranks_finds_what_the_whole_replay_finds_on_them(
    whole: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "whole.trace"
    shutil.copytree(whole, trace)
    every = replay_trace(TraceReader(trace)).findings
    # the control: the deferred post-process of rank 0 (not the last stage) goes wrong
    assert {f.rank for f in every} == {0}
    for rank in (0, 1):
        mine = [(f.step, f.req_id, f.signature, f.detail) for f in every if f.rank == rank]
        for jobs in ("1", "2"):
            proc = run_cli("replay", str(trace), "--rank", str(rank), "-j", jobs, "--json")
            assert proc.returncode == (1 if mine else 0), proc.stderr
            summary = json.loads(proc.stdout)
            assert summary["ranks"] == [rank]
            got = (
                Trace(trace)
                .sql(
                    "SELECT step, req_id, signature, detail, rank FROM findings "
                    f"WHERE replay_id = '{summary['replay_id']}'"
                )
                .fetchall()
            )
            assert {r[-1] for r in got} <= {rank}
            rows = [r[:-1] for r in got]
            assert sorted(rows) == sorted(mine), (rank, jobs)
        api = Trace(trace).replay(ranks=[rank])
        assert [(f.step, f.req_id, f.signature, f.detail) for f in api.findings] == mine
    # some ranks are saved apart from the whole trace's replay; all of them are that replay
    some = json.loads(run_cli("replay", str(trace), "--rank", "0", "--json").stdout)
    both = run_cli("replay", str(trace), "--rank", "1", "--rank", "0", "--json").stdout
    assert some["replay_id"] != as_recorded_replay_id() == json.loads(both)["replay_id"]
    text = run_cli("replay", str(trace), "--rank", "1", "--no-save").stdout
    assert "rank-steps" not in text and "(rank 1, of 2)" in text
    assert_one_sentence_error(run_cli("replay", str(trace), "--rank", "5"), 2)
    with pytest.raises(UsageError, match="has no rank 5; its ranks: 0, 1"):
        Trace(trace).replay(ranks=[5])


def test_bisect_of_some_ranks_and_its_commands_name_the_bad_rank(
    whole: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "whole.trace"
    shutil.copytree(whole, trace)
    log = tmp_path / "bisect.json"
    verdict = json.loads(run_cli("bisect", str(trace), "--json", "--log", str(log)).stdout)
    assert verdict["status"] == "bad" and verdict["rank"] == 0 and verdict["ranks"] is None
    bad = verdict["commands"]["bad"]
    assert "--no-save --rank=0 --to-step=" in bad, bad
    shown = run_cli(*shlex.split(bad)[1:], "--json")
    assert json.loads(shown.stdout)["first_step"] == verdict["first_step"]
    assert json.loads(shown.stdout)["ranks"] == [0]
    # rank 1 alone never goes bad; its log keeps the rank and re-checks the same way
    one = run_cli("bisect", str(trace), "--rank", "1", "--json", "--log", str(log))
    assert one.returncode == 0 and json.loads(one.stdout)["ranks"] == [1], one.stderr
    assert json.loads(log.read_text())["ranks"] == [1]
    again = run_cli("bisect", "--replay", str(log))
    assert again.returncode == 0 and "the verdict holds" in again.stdout, again.stdout
    assert_one_sentence_error(run_cli("bisect", str(trace), "--rank", "7"), 2)


def test_bisect_commands_of_a_one_rank_trace_name_no_rank(tmp_path: Path) -> None:
    path = tmp_path / "one.trace"
    cfg = SimConfig(steps=80, seed=2, bugs=("reorder-threshold-mismatch",), output=path)
    simulate(cfg.validate())
    verdict = json.loads(run_cli("bisect", str(path), "--json").stdout)
    assert verdict["status"] == "bad" and "--rank" not in verdict["commands"]["bad"]


def test_minimize_keeps_the_rank_of_its_finding(whole: Path, tmp_path: Path) -> None:
    out = tmp_path / "one-rank.min"
    proc = run_cli("minimize", str(whole), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "on rank 0, the one rank it keeps" in " ".join(proc.stdout.split())
    assert ranks_of(TraceReader(out)) == [0]


def test_a_recording_missing_a_rank_is_incomplete_and_no_clean_verdict_speaks_for_it(
    whole: Path, tmp_path: Path
) -> None:
    """Rank 0 holds every finding of this trace: with its directory gone, the replay of rank
    1 alone was called clean (exit 0) and `info` said complete."""
    rec = tmp_path / "rec"
    split_by_rank(whole, rec)
    assert TraceReader(rec).manifest.complete  # the control: both ranks
    assert run_cli("replay", str(rec), "--no-save").returncode == 1
    shutil.rmtree(rec / "rank-000")
    reader = TraceReader(rec)
    assert not reader.manifest.complete
    info = run_cli("info", str(rec))
    assert info.returncode == 0 and "lacks rank-000 of the 2 workers" in info.stdout, info.stdout
    replay = run_cli("replay", str(rec), "--no-save")
    assert replay.returncode == 125, replay.stdout + replay.stderr
    assert "lacks rank-000" in replay.stdout + replay.stderr
    bisect = run_cli("bisect", str(rec))
    assert bisect.returncode == 125 and "lacks rank-000" in bisect.stdout, bisect.stdout


def test_minimize_of_one_rank_passes_over_a_gap_in_another(whole: Path, tmp_path: Path) -> None:
    """Rank 1's launches part gone: with --skip-bad-parts, minimize stopped at rank 1's gap
    (exit 125) though the finding is on rank 0, whole, and the repro keeps rank 0 only."""
    damaged = tmp_path / "damaged.trace"
    shutil.copytree(whole, damaged)
    part = next(p for p in TraceReader(whole).parts if p.table == "launches" and p.rank == 1)
    (damaged / part.path).unlink()
    cut = run_cli("minimize", str(damaged), "-o", str(tmp_path / "a"), "--skip-bad-parts")
    assert cut.returncode == 125 and "rank 1" in cut.stderr, cut.stderr  # the control
    out = tmp_path / "rank0.min"
    args = ("minimize", str(damaged), "-o", str(out), "--skip-bad-parts", "--rank", "0")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "on rank 0, the one rank it keeps" in " ".join(proc.stdout.split())
    assert ranks_of(TraceReader(out)) == [0]
    assert run_cli("replay", str(out), "--no-save").returncode == 1
    absent = run_cli("minimize", str(whole), "-o", str(tmp_path / "b"), "--rank", "7")
    assert "has no rank 7; its ranks: 0, 1" in assert_one_sentence_error(absent, 2)


def test_diff_compares_the_ranks_a_left_out_part_is_not_of(whole: Path, tmp_path: Path) -> None:
    """Rank 1's launches part gone from one of two traces: diff compared no rank ("share no
    step to compare"), though rank 0 is whole in both; it now compares rank 0 and finds
    where it differs. Control: the same traces whole differ at the same step."""
    other = tmp_path / "other.trace"
    cfg = SimConfig(scenario="pairs", steps=160, runner="v2", pp=2, seed=1, output=other)
    simulate(cfg.validate())  # the same run without the bug: rank 0's launches differ
    damaged = tmp_path / "damaged.trace"
    shutil.copytree(whole, damaged)
    part = next(p for p in TraceReader(whole).parts if p.table == "launches" and p.rank == 1)
    (damaged / part.path).unlink()
    full = run_cli("diff", str(whole), str(other), "--json")
    assert full.returncode == 1, full.stdout + full.stderr
    expected = json.loads(full.stdout)
    assert expected["rank"] == 0
    proc = run_cli("diff", str(damaged), str(other), "--skip-bad-parts", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = json.loads(proc.stdout)
    assert (said["rank"], said["first_step"]) == (expected["rank"], expected["first_step"])
    same = run_cli("diff", str(damaged), str(whole), "--skip-bad-parts")
    assert same.returncode == 125, same.stdout + same.stderr
    assert "rank 1's rows from step 0 on are in a left-out part" in " ".join(same.stdout.split())


def test_a_rank_that_recorded_no_step_is_missing_and_counted(whole: Path, tmp_path: Path) -> None:
    """A worker whose writer opened but recorded nothing leaves rank-NNN with a manifest and
    no part: the recording lacks that rank's steps as much as a removed folder does, and the
    count of missing ranks is a count of ranks."""
    rec = tmp_path / "rec"
    split_by_rank(whole, rec)
    shutil.rmtree(rec / "rank-000")
    with TraceWriter(rec / "rank-000", run=TraceReader(whole).run, source={"kind": "test"}):
        pass  # opened and closed: a complete trace of no step
    reader = TraceReader(rec)
    assert not reader.manifest.complete
    assert reader.manifest.errors["missing_ranks"]["count"] == 1
    info = run_cli("info", str(rec))
    assert info.returncode == 0 and "lacks rank-000 of the 2 workers" in info.stdout, info.stdout
    replay = run_cli("replay", str(rec), "--no-save")
    assert replay.returncode == 125, replay.stdout + replay.stderr
    # control: both ranks recorded, nothing missing
    whole_rec = tmp_path / "both"
    split_by_rank(whole, whole_rec)
    assert "missing_ranks" not in TraceReader(whole_rec).manifest.errors


def test_a_repro_of_a_recording_missing_a_rank_replays_clean_under_its_fix(
    whole: Path, tmp_path: Path
) -> None:
    """Rank 1's folder gone, the finding on rank 0: the repro keeps rank 0 only and is whole,
    so its replay under the rule that fixes it is clean (0), not inconclusive over the rank
    its source lacked."""
    rec = tmp_path / "rec"
    split_by_rank(whole, rec)
    shutil.rmtree(rec / "rank-001")
    out = tmp_path / "repro"
    assert run_cli("minimize", str(rec), "-o", str(out)).returncode == 0
    assert run_cli("replay", str(out), "--no-save").returncode == 1
    fixed = run_cli("replay", str(out), "--no-save", "--bt-row-is-req", "true")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "missing_ranks" not in TraceReader(out).manifest.errors
    # control: the recording itself stays inconclusive under that rule
    source = run_cli("replay", str(rec), "--no-save", "--bt-row-is-req", "true")
    assert source.returncode == 125, source.stdout + source.stderr


def _with_changed_rows(whole: Path, out: Path, changes: dict[tuple[str, int, int], str]) -> None:
    """``whole`` rewritten with one row changed per (table, rank, step): ``column`` + 1 in
    the step's first row where it is set."""
    reader = TraceReader(whole)
    with TraceWriter(out, run=reader.run, source=dict(reader.manifest.source)) as w:
        for name, spec in TABLES.items():
            table = reader.table(name)
            if name == "findings" or not table.num_rows:
                continue
            if not spec.per_step:
                w.write_rows(name, _columns(table))
                continue
            for rank in (0, 1):
                rows = table.filter(pa.compute.equal(table["rank"], rank)).drop(["rank"])
                rows = rows.to_pylist()
                for (t, r, step), column in changes.items():
                    if (t, r) == (name, rank):
                        row = next(x for x in rows if x["step"] == step and x[column] is not None)
                        row[column] += 1
                steps = [x["step"] for x in rows]
                cols = {c: [x[c] for x in rows] for c in rows[0]}
                w.write_steps(rank, min(steps), max(steps), {name: cols})


def test_diff_names_a_rank_left_out_before_the_difference_it_found(
    whole: Path, tmp_path: Path
) -> None:
    """Rank 1's launches part gone from one trace: the difference found on rank 0 at step 100
    is the first only of the steps compared, as rank 1's rows from step 0 on were not, and
    there the traces differ at step 5."""
    other = tmp_path / "other.trace"
    changes = {("launches", 1, 5): "state_idx", ("batch_rows", 0, 100): "num_computed"}
    _with_changed_rows(whole, other, changes)
    full = run_cli("diff", str(whole), str(other), "--json")
    assert full.returncode == 1, full.stdout + full.stderr
    said = json.loads(full.stdout)
    assert (said["first_step"], said["rank"]) == (5, 1)  # the control: rank 1 differs first
    assert said["left_out_from"] is None
    damaged = tmp_path / "damaged.trace"
    shutil.copytree(whole, damaged)
    part = next(p for p in TraceReader(whole).parts if p.table == "launches" and p.rank == 1)
    (damaged / part.path).unlink()
    proc = run_cli("diff", str(damaged), str(other), "--skip-bad-parts", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = json.loads(proc.stdout)
    assert (said["first_step"], said["rank"]) == (100, 0)
    assert (said["left_out_rank"], said["left_out_from"]) == (1, 0)
    sentence = " ".join(said["sentence"].split())
    assert "rank 1's rows from step 0 on are in a left-out part (not compared)" in sentence


def test_minimize_of_a_clean_rank_names_the_rank_not_the_trace(whole: Path, tmp_path: Path) -> None:
    """Every finding is on rank 0: `--rank 1` finds nothing to minimize, and says rank 1 is
    clean, not the trace, which replays corrupt."""
    proc = run_cli("minimize", str(whole), "-o", str(tmp_path / "r1"), "--rank", "1")
    err = assert_one_sentence_error(proc, 125)
    assert f"{whole} replays clean on rank 1 under as-recorded" in err, err
    assert run_cli("replay", str(whole), "--no-save").returncode == 1  # the trace is not clean


def test_diff_names_every_rank_a_left_out_part_is_of(tmp_path: Path) -> None:
    """Two ranks' launches parts gone: the sentence named only the first of them, as if
    the other's rows had been compared."""
    whole = tmp_path / "pp4.trace"
    simulate(SimConfig(steps=60, runner="v2", pp=4, seed=0, output=whole).validate())
    damaged = tmp_path / "damaged.trace"
    shutil.copytree(whole, damaged)
    for part in TraceReader(whole).parts:
        if part.table == "launches" and part.rank in (1, 2):
            (damaged / part.path).unlink()
    proc = run_cli("diff", str(damaged), str(whole), "--skip-bad-parts", "--json")
    assert proc.returncode == 125, proc.stdout + proc.stderr
    said = json.loads(proc.stdout)
    sentence = " ".join(said["sentence"].split())
    both = "rank 1's rows from step 0 on and rank 2's rows from step 0 on are in left-out parts"
    assert both in sentence and both in said["inconclusive"], said
