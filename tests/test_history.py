"""`mgtrace history`: one request's life, on simulated traces whose corruption is known."""

from __future__ import annotations

import csv as csv_module
import io
import json
import shutil
from pathlib import Path

import pytest

from mgtrace.api import Trace
from mgtrace.schemas.reader import TraceReader
from tests.conftest import assert_one_sentence_error, run_cli
from tests.replay_helpers import set_root, toggle_trace


@pytest.fixture(scope="module")
def race(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """An async-race trace, replayed (findings saved): its path, first step and request."""
    set_root(tmp_path_factory.mktemp("sim"))
    src = toggle_trace("async-accepted-race", 12, 300)
    path = tmp_path_factory.mktemp("history") / "race"
    shutil.copytree(src, path)
    truth = TraceReader(path).manifest.ground_truth["bugs"]["async-accepted-race"]
    assert truth["first_step"] is not None, "the control: the toggle fired"
    assert run_cli("replay", str(path)).returncode == 1
    return path, truth["first_step"], truth["first_requests"][0]


def _own_row(path: Path, rank: int, table: str, row: int, step: int) -> list[int]:
    """Group 0's block ids of ``row`` of ``table`` as the latest change up to ``step`` left it."""
    bt = TraceReader(path).table("block_tables").to_pylist()
    changes = [
        r
        for r in bt
        if (r["rank"], r["table"], r["row"], r["group"]) == (rank, table, row, 0)
        and r["step"] <= step
    ]
    return max(changes, key=lambda r: r["step"])["block_ids"]


def _rows(path: Path, *args: str) -> list[dict]:
    proc = run_cli("history", str(path), *args, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _lines(path: Path, *args: str) -> dict[int, dict]:
    """Lines by step, of a one-rank trace."""
    return {row["step"]: row for row in _rows(path, *args)}


def test_the_injected_request_shows_the_move_the_stale_count_and_the_finding(
    race: tuple[Path, int, str],
) -> None:
    path, first, req = race
    lines = _lines(path, req)
    bad = lines[first]
    # the row move that overtook the accepted-count copy, and both counts
    assert bad["row_moves"] and "carried accepted" in bad["row_moves"]
    assert bad["accepted_prev_cpu"] is not None and bad["accepted_prev_cpu"] != bad["accepted_prev"]
    assert bad["findings"] and "wrong_tokens" in bad["findings"]
    # before the bug, the request's lines carry no finding and one accepted count each
    before = [v for s, v in lines.items() if s < first and v["batch_row"] is not None]
    assert before and all(v["findings"] is None for v in before)
    # the block column: the slot's latest recorded row at each step, read at the running
    # column (worked out here row by row, apart from the query's as-of join)
    for v in before:
        own = _own_row(path, 0, "v1", v["req_slot"], v["step"])
        assert v["block"] == own[v["state_col"]] > 0
    assert all(v["accepted_prev_cpu"] is None for v in before)
    assert Trace(path).history(req).to_pylist() == _rows(path, req)  # the API's lines
    # its first line is its arrival, with its blocks; the scheduler says little after that
    arrival = lines[min(lines)]
    assert arrival["scheduler"].startswith("new +blocks ")
    assert sum(v["scheduler"] is not None for v in before) < len(before) / 2


def test_table_output_step_range_and_first_finding(race: tuple[Path, int, str]) -> None:
    path, first, req = race
    proc = run_cli("history", str(path), req, "--from-step", str(first - 2))
    assert proc.returncode == 0, proc.stderr
    assert f"history of {req}" in proc.stdout and "carried accepted" in proc.stdout
    assert f"first finding at step {first} (rank 0): request {req}" in proc.stdout
    # the table shows both accepted counts in one cell, as the CSV does in two columns
    csv = run_cli("history", str(path), req, "--format", "csv", "--from-step", str(first))
    cells = next(csv_module.DictReader(io.StringIO(csv.stdout)))
    assert int(cells["accepted_prev"]) != int(cells["accepted_prev_cpu"])  # numbers, not text
    shown_in_table = f"{cells['accepted_prev']} (cpu {cells['accepted_prev_cpu']})"
    assert shown_in_table in proc.stdout
    shown = _lines(path, req, "--from-step", str(first - 2), "--to-step", str(first))
    assert sorted(shown) == [first - 2, first - 1, first]
    # findings of replays under other rules are not mixed in: none was saved under this one
    other = run_cli("history", str(path), req, "--rules", "accepted_source=cpu")
    assert "first finding" not in other.stdout
    assert "no findings of a replay under accepted_source=cpu" in other.stdout
    assert any(v["findings"] for v in _lines(path, req, "--rules", "any").values())


def test_a_part_of_the_id_is_enough_when_it_is_unique(race: tuple[Path, int, str]) -> None:
    path, _, req = race
    number = req.rsplit("-", 1)[1]
    assert _lines(path, number) == _lines(path, req)
    err = assert_one_sentence_error(run_cli("history", str(path), "req-0000"), 2)
    assert "matches" in err and "give the whole id" in err
    err = assert_one_sentence_error(run_cli("history", str(path), "nobody"), 2)
    assert "no request id in the trace contains 'nobody'" in err
    err = assert_one_sentence_error(
        run_cli("history", str(path), req, "--from-step", "9", "--to-step", "3"), 2
    )
    assert "after --to-step" in err
    gone = run_cli("history", str(path), req, "--to-step", "0")
    assert gone.returncode == 0 and "none of them is in the range asked" in gone.stdout


def test_a_block_owner_sees_who_wrote_onto_its_block(tmp_path: Path) -> None:
    set_root(tmp_path)
    src = toggle_trace("batch-row-block-table", 0, 300)
    path = tmp_path / "pp"
    shutil.copytree(src, path)
    assert run_cli("replay", str(path)).returncode == 1
    con = TraceReader(path).connect()
    owner, writer, step, block = con.execute(  # the finding names the owner, hit by the writer
        "SELECT req_id, writer_req_id, step, block_id FROM findings "
        "WHERE kind = 'foreign_block_write' ORDER BY step, rank, batch_row, block_id LIMIT 1"
    ).fetchone()
    assert writer != owner
    rows = _rows(path, owner)
    on_owner = [v["findings"] for v in rows if v["step"] == step and v["findings"]]
    assert any("foreign_block_write" in f and f"(with {writer})" in f for f in on_owner)
    on_writer = [v["findings"] for v in _rows(path, writer) if v["step"] == step]
    assert any(f and f"(with {owner})" in f for f in on_writer)  # and the writer sees it too
    slot = [v["req_slot"] for v in rows if v["step"] <= step and v["req_slot"] is not None][-1]
    assert block in _own_row(path, 0, "source", slot, step)  # a block of the owner's row
    api = Trace(path).history(owner).to_pylist()
    assert api == rows and any(v["block"] for v in api)  # the API reads V2's own tables too
    # both ranks' lines are there, and the table names the rank
    assert {v["rank"] for v in rows} == {0, 1}
    header = next(
        line
        for line in run_cli("history", str(path), owner).stdout.splitlines()
        if line.startswith("┃")
    )
    assert "rank" in header.split("┃")[1]


def test_an_imported_probe_log_shows_the_client_label(tmp_path: Path) -> None:
    from mgtrace.recorder.probe_import import import_probe
    from tests.test_recorder_unit import _probe_logs

    probe, burst, _ = _probe_logs(tmp_path)
    import_probe(probe, burst, tmp_path / "imp")
    con = TraceReader(tmp_path / "imp").connect()
    labels = dict(con.execute("SELECT req_id, corrupt FROM requests").fetchall())
    bad = next(r for r, c in labels.items() if c)
    good = next(r for r, c in labels.items() if c is False)  # the control
    for req, word in ((bad, "corrupt"), (good, "clean")):
        proc = run_cli("history", str(tmp_path / "imp"), req)
        assert proc.returncode == 0, proc.stderr
        assert f"client saw it {word}" in proc.stdout
        # a probe log holds no kernel launch: no replay to suggest
        assert "mgtrace replay" not in proc.stdout


@pytest.mark.parametrize(
    "engine",
    [
        {"runner": "v1"},
        {"runner": "v2", "pp": 3},
        {"runner": "v2", "pp": 3, "async_scheduling": False},
    ],
    ids=["v1-async", "v2-pp3-async", "v2-pp3-sync"],
)
def test_history_frees_are_the_simulators(tmp_path, monkeypatch, engine: dict) -> None:
    """The history names the steps at which align mode frees a request's previous state
    block, as the simulator's allocator does, with the tokens of the steps still in flight
    taken off: one step under async scheduling, pp under V2's async pipeline, none in a
    synchronous pipeline, where a request waits for its result before it is scheduled
    again."""
    from mgtrace.query import history
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate
    from tests.frees_sweep import allocator_frees, history_frees

    out = tmp_path / "frees"
    shape = dict(scenario="pairs", k=1, mamba_block_size=16, prefix_hit_prob=0.5, **engine)
    with allocator_frees() as frees:
        simulate(SimConfig(steps=120, seed=3, length_scale=0.2, output=out, **shape))
    assert len(frees) > 20
    assert history_frees(out) == frees
    # a line per step: a step that frees several blocks names them all on its one line
    trace = Trace(out)
    several = 0
    for (req,) in trace.sql("SELECT DISTINCT req_id FROM sched").fetchall():
        lines = trace.history(req).to_pylist()
        steps = [(line["rank"], line["step"]) for line in lines]
        assert len(steps) == len(set(steps)), f"{req}: a step on two lines"
        several += sum(1 for line in lines if (line["freed"] or "").count("block") > 1)
    if engine["runner"] == "v2":  # the check's teeth: such steps are there
        assert several > 0
    if engine.get("async_scheduling", True):
        # the failing control: one step fewer in flight frees some blocks a step early
        in_flight = history.steps_in_flight
        monkeypatch.setattr(history, "steps_in_flight", lambda run: in_flight(run) - 1)
        assert history_frees(out) != frees


def test_a_clean_saved_replay_is_told_apart_from_a_missing_one(fresh_trace: Path) -> None:
    """A replay that finds nothing saves a part without rows, which the findings view never
    shows: history said no replay under the rules was saved and suggested `mgtrace replay
    TRACE` without the rule flag, which saved the as-recorded replay instead (a loop). Now
    the saved clean replay is named, and a missing one's command carries its flags."""
    from mgtrace.query.history import findings_note, saved_rules
    from mgtrace.replayer.cli import replay_id_for
    from mgtrace.replayer.findings import save_findings
    from mgtrace.replayer.rules import RuleSet

    fixed = RuleSet.parse("reorder_threshold=1+k")
    save_findings(fresh_trace, [], replay_id=replay_id_for(fixed), rules=fixed.canonical())
    reader = TraceReader(fresh_trace)
    con = reader.connect()
    req = con.execute("SELECT min(req_id) FROM batch_rows").fetchone()[0]
    assert saved_rules(reader, con) == [fixed.canonical()]  # a part without rows, named
    note = findings_note(reader, con, req, fixed.canonical(), fresh_trace)
    assert note == f"the saved replay under {fixed.canonical()} found nothing for this request"
    other = RuleSet.parse("bt_row_is_req=false")
    note = findings_note(reader, con, req, other.canonical(), fresh_trace)
    assert note is not None and note.startswith(
        f"no findings of a replay under {other.canonical()} (saved replays: {fixed.canonical()})"
    )
    assert note.endswith(f"run: mgtrace replay {fresh_trace} {other.as_flags()[0]}")
    # the control: no note when the rules are not asked for
    assert findings_note(reader, con, req, None, fresh_trace) is None


def test_the_max_rows_note_says_how_many_lines_there_are() -> None:
    """The note said "1343 step lines, 20 shown"; now "20 of 1,343 step lines shown".
    Control: all lines shown, the count alone."""
    import io

    import pyarrow as pa
    from rich.console import Console

    from mgtrace.render import render_history

    lines = pa.table({"step": list(range(1343)), "scheduler": ["new"] * 1343})
    for max_rows, note in ((20, "20 of 1,343 step lines shown"), (2000, "1,343 step lines")):
        console = Console(file=io.StringIO(), width=200)
        render_history(lines, console, max_rows=max_rows)
        assert console.file.getvalue().rstrip().splitlines()[-1].startswith(note)


def test_one_rank_of_a_pipeline_parallel_trace(tmp_path: Path) -> None:
    """--rank keeps that rank's lines, exactly as the whole history has them; a rank the
    trace lacks is one sentence."""
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "pp2"
    simulate(SimConfig(steps=80, seed=2, runner="v2", pp=2, scenario="pairs", output=out))
    req = Trace(out).sql("SELECT min(req_id) FROM batch_rows").fetchall()[0][0]
    every = _rows(out, req)
    assert {line["rank"] for line in every} == {0, 1}  # the control: both ranks are there
    for rank in (0, 1):
        assert _rows(out, req, "--rank", str(rank)) == [r for r in every if r["rank"] == rank]
    err = assert_one_sentence_error(run_cli("history", str(out), req, "--rank", "5"), 2)
    assert "has no rank 5; its ranks: 0, 1" in err
    assert Trace(out).history(req, rank=1).to_pylist() == [r for r in every if r["rank"] == 1]


def test_steps_missing_from_the_trace_are_named(
    race: tuple[Path, int, str], tmp_path: Path
) -> None:
    """A step the recording lost left no line, as if the request had not been scheduled
    there. The history now names the missing steps inside the request's span. Control: the
    trace they were cut from has no such line."""
    from tests.replay_helpers import with_steps_removed

    path, first, req = race
    whole = run_cli("history", str(path), req, "--from-step", str(first - 6))
    assert whole.returncode == 0 and "no record of steps" not in whole.stdout
    drop = {first - 3, first - 2, first + 1}
    gapped = with_steps_removed(path, tmp_path / "gap", drop, complete=False)
    proc = run_cli("history", str(gapped), req, "--from-step", str(first - 6))
    assert proc.returncode == 0, proc.stderr
    said = f"the trace has no record of steps {first - 3}..{first - 2}, {first + 1}:"
    assert said in " ".join(proc.stdout.split()), proc.stdout
    # the lines skip them: nothing else would tell a reader
    shown = _lines(gapped, req)
    assert first - 3 not in shown and min(shown) < first - 3


def test_a_repro_frees_its_requests_blocks_at_the_columns_the_original_did(
    tmp_path: Path,
) -> None:
    """A repro's request began before its first step; its ``freed`` column was rebuilt from
    the repro's deltas alone, as if its first new block sat at column 0 ("col 28 (block 7)"
    where the original freed col 210 of block 7). It now starts from the start state's
    block rows. Control: the same request's frees in the trace it was cut from."""
    import re

    import mgtrace

    trace = mgtrace.simulate(
        tmp_path / "bt.trace", bugs=["batch-row-block-table"], runner="v2", pp=2,
        steps=1000, seed=1,
    )  # fmt: skip
    trace.minimize(tmp_path / "repro")
    repro = mgtrace.open(tmp_path / "repro")
    rank = repro.sql("SELECT min(rank) FROM steps").fetchall()[0][0]
    (req,) = [
        r
        for (r,) in repro.sql("SELECT DISTINCT req_id FROM sched WHERE step = 0").fetchall()
        if repro.sql(f"SELECT min(kind::VARCHAR) FROM sched WHERE req_id = '{r}'").fetchall()
        == [("cached",)]
    ][:1]

    def frees(t: mgtrace.Trace) -> set[tuple[int, int]]:
        lines = t.history(req, rank=rank).to_pylist()
        said = " ".join(line["freed"] or "" for line in lines)
        return {(int(c), int(b)) for c, b in re.findall(r"col (\d+) \(block (\d+)\)", said)}

    cut = frees(repro)
    assert cut, "the control: the repro's request has blocks freed"
    assert cut <= frees(trace), (cut, frees(trace))
    # without a start state (a recording attached mid-run) its columns are unknown: no
    # frees are shown rather than wrong ones
    bare = shutil.copytree(tmp_path / "repro", tmp_path / "bare")
    shutil.rmtree(bare / "start-state")
    manifest = json.loads((bare / "manifest.json").read_text())
    del manifest["source"]["start_state"]
    (bare / "manifest.json").write_text(json.dumps(manifest))
    assert frees(mgtrace.open(bare)) == set()


def test_a_request_never_scheduled_is_said_to_be_so(tmp_path: Path) -> None:
    """A request that arrived but never ran (its requests row has no first step) was "no
    request id in the trace contains" it, though the requests view lists it. Control: an id
    the trace does not hold at all is still said so."""
    import mgtrace

    trace = mgtrace.simulate(tmp_path / "w.trace", steps=200, seed=0, scenario="mixed",
                             num_blocks=60)  # fmt: skip
    waiting = trace.sql("SELECT req_id FROM requests WHERE first_step IS NULL").fetchall()
    assert waiting, "the control: a request that never ran"
    name = waiting[0][0]
    for asked in (name, name.rsplit("-", 1)[1]):
        err = assert_one_sentence_error(run_cli("history", str(trace.path), asked), 2)
        assert f"request {name} arrived but was never scheduled in the trace" in err, err
    err = assert_one_sentence_error(run_cli("history", str(trace.path), "nobody"), 2)
    assert "no request id in the trace contains 'nobody'" in err


def test_a_windowed_replay_is_not_the_whole_traces(tmp_path: Path) -> None:
    """A replay of a window (`--from-step`) is saved under its own replay id, with the same
    rules; its findings are each request's first in the window, not what the run did.
    history read every saved replay with the rules: with only a window saved that starts
    after a request's first bad step (and finds other requests), it said the saved replay
    under as-recorded found nothing for that request."""
    path = tmp_path / "race"
    sim = ["simulate", "--steps", "600", "--seed", "0", "--bug", "async-accepted-race"]
    assert run_cli(*sim, "-o", str(path)).returncode == 0
    truth = TraceReader(path).manifest.ground_truth["bugs"]["async-accepted-race"]
    first, req = truth["first_step"], truth["first_requests"][0]
    proc = run_cli("replay", str(path), "--from-step", str(first + 1), "--json")
    assert proc.returncode == 1, proc.stderr  # the window finds later requests
    assert req not in json.loads(proc.stdout)["first_requests"]
    proc = run_cli("history", str(path), req)
    assert proc.returncode == 0, proc.stderr
    assert "found nothing for this request" not in proc.stdout
    assert f"run: mgtrace replay {path}" in proc.stdout
    # the control: once the whole trace's replay is saved, history reads it
    assert run_cli("replay", str(path)).returncode == 1
    assert _lines(path, req)[first]["findings"]
    proc = run_cli("history", str(path), req)
    assert f"first finding at step {first} (rank 0)" in proc.stdout
