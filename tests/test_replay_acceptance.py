"""Replay against the simulator's ground truth: every toggle found exactly, undone by its rule,
and no finding at all on runs without a toggle."""

from __future__ import annotations

import re

import pytest

from mgtrace.replayer.findings import WRONG_TOKENS
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from tests.replay_helpers import (
    BOUNDARY_ONLY,
    BOUNDARY_ONLY_BUG,
    BOUNDARY_ONLY_SEED,
    BOUNDARY_ONLY_STEPS,
    TOGGLES,
    involved,
    set_root,
    sim_trace,
    toggle_trace,
)

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("sim"))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("bug", list(TOGGLES))
def test_toggle_found_exactly_and_undone(bug: str, seed: int) -> None:
    trace = toggle_trace(bug, seed)
    reader = TraceReader(trace)
    truth = reader.manifest.ground_truth["bugs"][bug]
    if truth["first_step"] is None:
        pytest.skip(f"{bug} did not fire with seed {seed} in this run")
    recorded = replay_trace(reader, RuleSet())
    assert recorded.first_step == truth["first_step"]
    assert set(truth["first_requests"]) == involved(recorded.findings, recorded.first_step)
    undone = replay_trace(reader, RuleSet.parse(TOGGLES[bug][1]))
    assert undone.clean, undone.findings[:3]


@pytest.mark.parametrize("bug", list(TOGGLES))
def test_toggle_found_exactly_with_prefill_checkpoints(bug: str) -> None:
    engine, undo = TOGGLES[bug]
    reader = TraceReader(sim_trace(bug, 0, 1500, prefill_checkpoints=True, **engine))
    truth = reader.manifest.ground_truth["bugs"][bug]
    assert truth["first_step"] is not None
    recorded = replay_trace(reader, RuleSet())
    assert recorded.first_step == truth["first_step"]
    assert set(truth["first_requests"]) == involved(recorded.findings, recorded.first_step)
    assert replay_trace(reader, RuleSet.parse(undo)).clean


def test_every_toggle_fires_for_some_seed() -> None:
    """Control for the skip above: each toggle must actually inject corruption."""
    for bug in TOGGLES:
        steps = [
            TraceReader(toggle_trace(bug, s)).manifest.ground_truth["bugs"][bug]["first_step"]
            for s in SEEDS
        ]
        assert any(s is not None for s in steps), bug


# Clean runs: V1 and V2 (with and without PP), every scenario, several seeds;
# 12 runs x 10,000 steps = 120,000 simulated steps replayed without a finding.
CLEAN_RUNS = [
    ("pairs", {"runner": "v1"}, 0),
    ("pairs", {"runner": "v1"}, 1),
    ("mixed", {"runner": "v1"}, 2),
    ("steady", {"runner": "v1"}, 3),
    ("pairs", {"runner": "v1", "k": 1}, 4),
    ("pairs", {"runner": "v2"}, 5),
    ("mixed", {"runner": "v2"}, 6),
    ("pairs", {"runner": "v2", "pp": 2}, 7),
    ("steady", {"runner": "v2", "pp": 2}, 8),
    ("mixed", {"runner": "v2", "pp": 3}, 9),
    # vLLM 0.33's prefill checkpoints: prefix hits read blocks the prefill stored itself
    ("pairs", {"runner": "v1", "prefill_checkpoints": True}, 10),
    ("mixed", {"runner": "v2", "pp": 2, "prefill_checkpoints": True}, 11),
]


@pytest.mark.parametrize(("scenario", "engine", "seed"), CLEAN_RUNS)
def test_no_false_positives(scenario: str, engine: dict, seed: int) -> None:
    trace = sim_trace(None, seed, 10_000, scenario=scenario, **engine)
    reader = TraceReader(trace)
    result = replay_trace(reader, RuleSet())
    assert result.steps == 10_000 * len(result.ranks)
    assert result.clean, [f.detail for f in result.findings[:3]]


def test_field_reanalysis_first_decode_in_prefill_split() -> None:
    """The field re-analysis cross-tab: a request whose first decode step ran in the Mamba
    prefill split is flagged; a request none of whose decode steps did is not."""
    reader = TraceReader(toggle_trace("reorder-threshold-mismatch", 0))
    con = reader.connect()
    rows = con.execute(
        """
        WITH dec AS (
          SELECT req_id, step, mamba_split FROM batch_rows WHERE num_draft > 0
        ), first AS (
          SELECT req_id, arg_min(mamba_split, step) AS first_split,
                 bool_or(mamba_split = 'prefill') AS ever_prefill
          FROM dec GROUP BY req_id
        )
        SELECT req_id, first_split, ever_prefill FROM first
        """
    ).fetchall()
    # Requests corrupted in their own state (a request that never ran through the prefill
    # split can still read a boundary state another corrupted request left for a prefix hit).
    flagged = {f.req_id for f in replay_trace(reader, RuleSet()).findings if f.kind == WRONG_TOKENS}
    first_in_prefill = {r for r, split, _ in rows if split == "prefill"}
    never = {r for r, _, ever in rows if not ever}
    assert first_in_prefill, "control: the trace must have such requests"
    assert first_in_prefill <= flagged
    assert never, "control: the trace must have requests that never hit the prefill split"
    assert not (never & flagged)


def _boundary_only_trace() -> TraceReader:
    return TraceReader(
        sim_trace(BOUNDARY_ONLY_BUG, BOUNDARY_ONLY_SEED, BOUNDARY_ONLY_STEPS, **BOUNDARY_ONLY)
    )


def test_a_lost_boundary_state_is_found_where_it_is_lost() -> None:
    reader = _boundary_only_trace()
    truth = reader.manifest.ground_truth["bugs"][BOUNDARY_ONLY_BUG]
    result = replay_trace(reader, RuleSet())
    assert result.first_step == truth["first_step"]
    first = [f for f in result.findings if f.step == result.first_step]
    assert {f.req_id for f in first} == set(truth["first_requests"])
    assert all(f.mechanism.startswith("cached-state:") for f in first)
    assert replay_trace(reader, RuleSet.parse("bt_row_is_req=true")).clean


def test_control_without_the_boundary_check_the_loss_shows_only_later(monkeypatch) -> None:
    from mgtrace.replayer.loop import RankReplay

    reader = _boundary_only_trace()
    truth = reader.manifest.ground_truth["bugs"][BOUNDARY_ONLY_BUG]
    monkeypatch.setattr(RankReplay, "_check_cached_state", lambda *args: None)
    assert replay_trace(reader, RuleSet()).first_step > truth["first_step"]


# V1 runs in which padded rows gather, through vacated block-table rows, blocks whose owners
# have moved past them: align mode freed those blocks without a scheduler delta. The replay
# retires them by the same rule, so a write onto one that nobody was given again is no
# finding. Freed blocks are reused next, so such a write is rare: the first run that has one
# is searched for.
RETIRED = {
    "runner": "v1",
    "scenario": "pairs",
    "k": 1,
    "max_num_seqs": 128,
    "mamba_block_size": 64,
    "acceptance_rate": 0.3,
    "prefix_hit_prob": 0.0,
    "length_scale": 1.0,
}
RETIRED_BUGS = ("stale-condense-row",)


def test_writes_onto_retired_blocks_are_no_finding(tmp_path) -> None:
    from mgtrace.replayer.ownership import BlockOwnership
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    for seed in range(32):
        out = tmp_path / f"retired-{seed}"
        simulate(SimConfig(steps=400, seed=seed, bugs=RETIRED_BUGS, output=out, **RETIRED))
        events = TraceReader(out).manifest.ground_truth["bugs"]["stale-condense-row"]["events"]
        # the sim's padded-row writes onto blocks a live request holds
        live = {(e["step"], e["block_id"]) for e in events}
        # ownership that never retires names the blocks' former owners, and says where the
        # blocks sit in their rows
        with pytest.MonkeyPatch.context() as m:
            m.setattr(BlockOwnership, "retire", lambda self, uids, freed_below: [])
            blind = replay_trace(TraceReader(out)).findings
        retired = [
            f for f in blind if f.kind == "foreign_block_write" and (f.step, f.block_id) not in live
        ]
        if retired:
            break
    assert retired, "no run with a padded-row write onto a retired block"
    assert all(
        re.search(r"\(its column \d+; it now runs at column \d+\)", f.detail) for f in retired
    )
    # the replay: every block write it reports is one onto a live request's block
    found = replay_trace(TraceReader(out)).findings
    assert {(f.step, f.block_id) for f in found if f.kind == "foreign_block_write"} <= live
    # the control: a padded row's write onto the block a live request runs at has no note
    stale = replay_trace(TraceReader(toggle_trace("stale-condense-row", 0)))
    first = [f for f in stale.findings if f.step == stale.first_step]
    assert any(f.kind == "foreign_block_write" for f in first)
    assert not any("now runs at column" in f.detail for f in first)
