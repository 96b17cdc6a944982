"""A saved replay keeps how far it went, and `history` says so where it did not replay all of a
request's steps: a replay that stopped before a gap once made `history` say that it "found
nothing" for a request it never reached, and one saved with --allow-gaps showed what it found
past the gap with no word of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mgtrace.api import Trace
from mgtrace.query.history import saved_replay_part
from mgtrace.replayer.findings import SavedReplay, saved_replay
from mgtrace.schemas.reader import TraceReader
from tests.conftest import run_cli
from tests.replay_helpers import set_root, toggle_trace, with_steps_removed

pytestmark = pytest.mark.slow

BUG = "reorder-threshold-mismatch"
GAP = (200, 205)  # steps 200..204 missing: after the first finding (step 15 for seed 0)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the buggy trace whole, the same trace without the steps of GAP)."""
    root = tmp_path_factory.mktemp("reach")
    set_root(root)
    buggy = toggle_trace(BUG, 0)
    whole = root / "whole.trace"
    shutil.copytree(buggy, whole)
    gapped = with_steps_removed(buggy, root / "gap.trace", set(range(*GAP)))
    return whole, gapped


def _history(trace: Path, request: str) -> str:
    proc = run_cli("history", str(trace), request, "--max-rows", "1")
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())


def _late_request(trace: Path) -> str:
    """A request first scheduled after the gap that the crossing replay found corrupt."""
    query = (
        "SELECT req_id FROM findings WHERE req_id IN (SELECT req_id FROM sched GROUP BY req_id "
        f"HAVING min(step) > {GAP[1]}) ORDER BY step LIMIT 1"
    )
    rows = Trace(trace).sql(query).fetchall()
    assert rows, "the crossing replay found nothing after the gap"
    return str(rows[0][0])


def test_history_says_where_the_saved_replay_stopped_or_crossed(
    traces: tuple[Path, Path],
) -> None:
    whole, gapped = traces
    early = TraceReader(whole).manifest.ground_truth["bugs"][BUG]["first_requests"][0]

    assert run_cli("replay", str(gapped), "--allow-gaps").returncode == 1
    late = _late_request(gapped)
    crossed = f"crossed steps the trace lacks (rank 0 at step {GAP[0]})"
    assert crossed in _history(gapped, late)
    assert crossed in _history(gapped, early)

    assert run_cli("replay", str(gapped)).returncode == 1  # stops before the gap
    said = _history(gapped, late)
    assert f"stopped where the trace lacks steps (rank 0 before step {GAP[0]})" in said
    assert "before this request's first step" in said and "found nothing" not in said
    said = _history(gapped, early)
    assert "first finding at step" in said and "were not replayed" in said
    assert "crossed" not in said

    # control: the same requests in the whole trace, replayed to its end
    assert run_cli("replay", str(whole)).returncode == 1
    for request in (early, late):
        said = _history(whole, request)
        assert "first finding at step" in said, said
        assert "lacks steps" not in said and "crossed" not in said


def test_the_rules_and_reach_are_kept_in_the_saved_part(traces: tuple[Path, Path]) -> None:
    _, gapped = traces
    trace = Trace(gapped)
    trace.replay(allow_gaps=True, save=True)
    part = saved_replay_part(trace.reader, "as-recorded")
    assert part is not None
    assert saved_replay(part) == SavedReplay("as-recorded", {}, {0: GAP[0]})
    trace.replay(save=True)
    assert saved_replay(part) == SavedReplay("as-recorded", {0: GAP[0]}, {})
    # a part without the note (saved before it was kept, or no part at all) says nothing
    assert saved_replay(part.with_name("none.parquet")) == SavedReplay(None, {}, {})


def test_info_lists_every_saved_replay_with_its_reach(traces: tuple[Path, Path]) -> None:
    """`info` counted the replays that found something; a clean one, a window, and a replay
    that crossed a gap looked alike or were not there. Control: the whole trace's replay
    went to its end, and says nothing of gaps."""
    whole, gapped = traces
    assert run_cli("replay", str(gapped), "--allow-gaps").returncode == 1
    assert run_cli("replay", str(gapped), "--to-step", "14").returncode == 0  # before step 15
    listed = json.loads(run_cli("info", str(gapped), "--json").stdout)["saved_replays"]
    by_whole = {r["whole"]: r for r in listed if r["rules"] == "as-recorded"}
    assert by_whole[True]["crossed_gaps"] == {"0": GAP[0]} and by_whole[True]["findings"] > 0
    assert by_whole[False]["findings"] == 0 and not by_whole[False]["crossed_gaps"]
    shown = " ".join(run_cli("info", str(gapped)).stdout.split())
    assert f"crossed where the trace lacks steps (rank 0 at step {GAP[0]})" in shown
    assert "as-recorded (a window or some ranks): clean" in shown

    assert run_cli("replay", str(whole)).returncode == 1
    (replay,) = json.loads(run_cli("info", str(whole), "--json").stdout)["saved_replays"]
    assert replay["whole"] and replay["first_step"] == 15
    assert not replay["stopped_at_gap"] and not replay["crossed_gaps"]
    assert "lacks steps" not in run_cli("info", str(whole)).stdout
