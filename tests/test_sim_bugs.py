"""Each bug toggle produces its symptom in the trace, and the toggle-off run produces none.

The symptoms are read from the trace alone (``mgtrace.sim.symptoms``), independent of the
injected ground truth; the toggle-on run is the control that proves each detector fires.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mgtrace.schemas.reader import TraceReader
from mgtrace.sim import SimConfig, simulate
from mgtrace.sim.config import (
    BUG_ASYNC_RACE,
    BUG_BATCH_ROW,
    BUG_REORDER,
    BUG_STALE_ROW,
)
from mgtrace.sim.symptoms import detect

pytestmark = pytest.mark.unit

CASES = {
    BUG_REORDER: dict(scenario="mixed", runner="v1", pp=1),
    BUG_ASYNC_RACE: dict(scenario="steady", runner="v1", pp=1),
    BUG_STALE_ROW: dict(scenario="pairs", runner="v1", pp=1),
    BUG_BATCH_ROW: dict(scenario="mixed", runner="v2", pp=2),
}


def _run(tmp_path: Path, name: str, bugs: tuple[str, ...], **shape: object):
    cfg = SimConfig(steps=400, seed=0, length_scale=0.2, bugs=bugs, output=tmp_path / name, **shape)  # type: ignore[arg-type]
    manifest = simulate(cfg)
    return manifest, detect(tmp_path / name)


@pytest.mark.parametrize("bug", list(CASES))
def test_toggle_on_shows_its_symptom_and_toggle_off_none(tmp_path: Path, bug: str) -> None:
    shape = CASES[bug]
    on, hits_on = _run(tmp_path, "on", (bug,), **shape)
    truth = on.ground_truth["bugs"][bug]
    assert truth["first_step"] is not None and truth["num_events"] > 0
    assert hits_on[bug], "the detector must fire on the buggy run"
    first_step, first_req = hits_on[bug][0]
    assert first_step == truth["first_step"]
    assert first_req in truth["first_requests"]
    recorded = {(e["step"], e["req_id"]) for e in truth["events"]}
    if not truth["events_truncated"]:
        assert recorded == set(hits_on[bug])
    off, hits_off = _run(tmp_path, "off", (), **shape)
    assert off.ground_truth == {"injected": [], "first_step": None, "bugs": {}}
    assert all(not h for h in hits_off.values()), {k: v[:3] for k, v in hits_off.items()}


def test_a_block_a_live_row_has_retired_is_no_stale_row_hit(tmp_path: Path) -> None:
    """Align mode frees a request's passed columns without a scheduler delta, so the runner's
    row keeps listing those blocks, and the pool hands the one freed last to the next
    request. A padded row that writes it harms only its new holder: the detector must not
    name the request whose row merely still lists it."""
    from mgtrace.sim.symptoms import _cols, _Tables

    _, hits = _run(tmp_path, "on", (BUG_STALE_ROW,), **CASES[BUG_STALE_ROW])
    reader = TraceReader(tmp_path / "on")
    events = reader.manifest.ground_truth["bugs"][BUG_STALE_ROW]["events"]
    holder = {(e["step"], e["block_id"]): e["req_id"] for e in events}
    named = {(e["step"], e["req_id"]) for e in events}
    br = _cols(reader, "batch_rows")
    order = sorted(range(len(br["step"])), key=lambda i: br["step"][i])
    tables = _Tables(reader, 0)
    listed_only = set()  # (step, request) whose row lists a block another request holds
    for i in order:
        s, rid = int(br["step"][i]), str(br["req_id"][i])
        tables.advance(s)
        for b in tables.get("v1", int(br["batch_row"][i])):
            if holder.get((s, b), rid) != rid and (s, rid) not in named:
                listed_only.add((s, rid))
    assert listed_only, "the run must have a padded-row write onto a block a row still lists"
    assert not listed_only & set(hits[BUG_STALE_ROW]), sorted(listed_only)[:3]


def test_all_v1_toggles_together_each_fire(tmp_path: Path) -> None:
    bugs = (BUG_REORDER, BUG_ASYNC_RACE, BUG_STALE_ROW)
    manifest, hits = _run(tmp_path, "all", bugs, scenario="pairs", runner="v1")
    for bug in bugs:
        assert hits[bug] and manifest.ground_truth["bugs"][bug]["first_step"] is not None
    assert manifest.ground_truth["first_step"] == min(
        manifest.ground_truth["bugs"][b]["first_step"] for b in bugs
    )


def test_buggy_trace_records_what_the_engine_consumed(tmp_path: Path) -> None:
    manifest, _ = _run(tmp_path, "v2", (BUG_BATCH_ROW,), scenario="mixed", runner="v2", pp=2)
    assert manifest.run.row_rule == "batch_row"
    reader = TraceReader(tmp_path / "v2")
    la = reader.table("launches").to_pydict()
    late = [
        i
        for i, (k, s, b) in enumerate(zip(la["kernel"], la["step"], la["batch_step"], strict=True))
        if k == "postprocess" and b is not None and b < s
    ]
    assert late and all(la["rank"][i] == 0 for i in late)
    assert all(
        la["bt_table"][i] == "input"
        and la["bt_row"][i] == la["batch_row"][i]
        and la["bt_step"][i] == la["step"][i] - 1
        for i in late
    )
    assert {"source", "input"} <= set(reader.table("block_tables").column("table").to_pylist())


def test_reorder_toggle_lowers_the_runner_threshold(tmp_path: Path) -> None:
    manifest, _ = _run(tmp_path, "r", (BUG_REORDER,), scenario="mixed", runner="v1")
    assert manifest.run.runner_reorder_threshold == 1
    assert manifest.run.builder_reorder_thresholds["mamba2"] == 4
    steps = TraceReader(tmp_path / "r").table("steps").to_pydict()
    assert set(steps["reorder_threshold"]) == {1} and set(steps["mamba_threshold"]) == {4}


def test_async_race_records_both_counts_where_they_differ(tmp_path: Path) -> None:
    _, hits = _run(tmp_path, "a", (BUG_ASYNC_RACE,), scenario="steady", runner="v1")
    br = TraceReader(tmp_path / "a").table("batch_rows").to_pydict()
    differs = [
        (s, r)
        for s, r, c in zip(br["step"], br["req_id"], br["accepted_prev_cpu"], strict=True)
        if c is not None
    ]
    assert set(hits[BUG_ASYNC_RACE]) <= set(differs)
    steps = TraceReader(tmp_path / "a").table("steps").to_pydict()
    assert set(steps["accepted_landed"][1:]) == {True, False}


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    scenario=st.sampled_from(["pairs", "mixed", "steady"]),
    shape=st.sampled_from([("v1", 1), ("v2", 1), ("v2", 2), ("v2", 4)]),
    sync=st.booleans(),
)
def test_toggle_off_runs_never_show_a_symptom(
    tmp_path: Path, seed: int, scenario: str, shape: tuple[str, int], sync: bool
) -> None:
    runner, pp = shape
    out = tmp_path / f"clean-{seed}-{scenario}-{runner}{pp}{sync}"
    manifest = simulate(
        SimConfig(
            scenario=scenario,
            steps=300,
            seed=seed,
            runner=runner,
            pp=pp,
            length_scale=0.1,
            mamba_block_size=64,
            async_scheduling=not sync,
            output=out,
            overwrite=True,
        )
    )
    assert manifest.ground_truth["first_step"] is None
    hits = detect(out)
    assert all(not h for h in hits.values()), {k: v[:3] for k, v in hits.items()}


FIXED_RUNS = {
    # id: (toggle, extra shape, first corrupted step, the request that consumed the wrong
    # inputs first, the requests whose state block it wrote over) for
    # `--scenario pairs --steps 2000 --seed 0` (docs/simulator.md quotes these)
    "reorder": (BUG_REORDER, {}, 15, "req-000002", ()),
    "async-race": (BUG_ASYNC_RACE, {}, 116, "req-000020", ()),
    "stale-row": (BUG_STALE_ROW, {}, 165, "req-000028", ()),
    "batch-row-async-pp2": (
        BUG_BATCH_ROW,
        {"runner": "v2", "pp": 2},
        25,
        "req-000001",
        ("req-000000",),
    ),
    "batch-row-sync-pp2": (
        BUG_BATCH_ROW,
        {"runner": "v2", "pp": 2, "async_scheduling": False},
        25,
        "req-000001",
        ("req-000000",),
    ),
}


@pytest.mark.parametrize("run", list(FIXED_RUNS))
def test_fixed_seed_first_corrupt_step(tmp_path: Path, run: str) -> None:
    bug, shape, step, req, overwritten = FIXED_RUNS[run]
    out = tmp_path / "fixed"
    manifest = simulate(
        SimConfig(scenario="pairs", steps=step + 1, seed=0, bugs=(bug,), output=out, **shape)
    )
    truth = manifest.ground_truth["bugs"][bug]
    assert truth["first_step"] == step
    assert truth["first_requests"] == sorted([req, *overwritten])
    assert set(overwritten) <= set(truth["affected_requests"])
    assert detect(out)[bug][0] == (step, req)
