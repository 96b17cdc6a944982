"""A prefix hit on a state block that the misdirected post-process of
``batch-row-block-table`` wrote over while no live request held it corrupts the request that
starts from it: the ground truth counts that request, as the replay names it."""

from __future__ import annotations

from pathlib import Path

import pytest

import mgtrace

pytestmark = pytest.mark.unit

BUG = "batch-row-block-table"


def _run(tmp_path: Path, scenario: str, seed: int, steps: int) -> tuple[set[str], dict]:
    trace = mgtrace.simulate(
        tmp_path / f"{scenario}-{seed}.trace",
        scenario=scenario,
        steps=steps,
        runner="v2",
        pp=2,
        seed=seed,
        bugs=[BUG],
    )
    found = {f.req_id for f in trace.replay().findings}
    return found, trace.manifest.ground_truth["bugs"][BUG]


def test_requests_starting_from_a_corrupted_prefix_block_are_affected(tmp_path: Path) -> None:
    found, truth = _run(tmp_path, "steady", seed=2, steps=200)
    hits = [e for e in truth["events"] if "prefix_hit_block" in e["recorded"]]
    assert hits, "the run must hit a corrupted prefix block for this test to mean anything"
    assert all(e["recorded"]["written_by"] for e in hits)
    hit_readers = {e["req_id"] for e in hits}
    # readers the misdirected writes never touched themselves
    assert hit_readers - {e["req_id"] for e in truth["events"] if e not in hits}
    assert set(truth["affected_requests"]) == found


def test_the_ground_truth_never_names_a_request_the_replay_does_not(tmp_path: Path) -> None:
    # A block written over while a live request held it is not followed into the prefix
    # cache: such a write sometimes lands a state equal to the prefix's own (a family
    # member's), which the replay's tags accept and the simulator cannot tell apart. The
    # replay may name more requests here; the ground truth never names one it does not.
    found, truth = _run(tmp_path, "steady", seed=0, steps=300)
    assert set(truth["affected_requests"]) <= found
