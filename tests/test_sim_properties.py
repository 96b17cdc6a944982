"""Invariants of the simulator, checked on every step of long seeded runs.

Each check returns its violations; the control tests feed it a deliberately broken step to
prove it can fire.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mgtrace.schemas.tables import MAMBA_SPLITS
from mgtrace.sim.block_pool import NULL_BLOCK, cdiv
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import StepView, run_engine
from mgtrace.sim.reorder import REORDER_REGIONS, gdn_spec_rows

pytestmark = pytest.mark.unit
REGION_CODE = {name: i for i, name in enumerate(REORDER_REGIONS)}


def names(column: object, categories: tuple[str, ...]) -> list[str]:
    """A categorical column as strings: the runners record integer codes into its categories."""
    if isinstance(column, np.ndarray) and column.dtype.kind in "iu":
        return [categories[c] for c in column.tolist()]
    return list(column)  # type: ignore[call-overload]


# --------------------------------------------------------------------------- the checks
def check_ownership(
    rows: dict[str, list[int]], ref: list[int], free: list[int], pinned: set[int], shared: set[int]
) -> list[str]:
    """No block held by two live requests unless it is a shared prefix-cache state; the
    cache holds no reference: a cached block (``pinned``) is live or waits in the free queue
    (vLLM evicts it only when the queue hands it out)."""
    bad = []
    count: Counter[int] = Counter()
    for row in rows.values():
        count.update(b for b in row if b != NULL_BLOCK)
    free_set = set(free)
    for b, c in count.items():
        if ref[b] != c:
            bad.append(f"block {b}: in {c} live rows but ref {ref[b]}")
        if c > 1 and b not in shared:
            bad.append(f"block {b} is owned by {c} live requests")
        if b in free_set:
            bad.append(f"block {b} is live and free")
    for b in pinned:
        if b not in shared or (b not in count and b not in free_set):
            bad.append(f"cached block {b} is neither live nor free, or not marked shared")
    return bad


def check_running_columns(view: StepView, B: int, S: int) -> list[str]:
    """Scheduler rows carry a real running block at cdiv(computed+scheduled, B)-1 and S spec
    blocks after it; the runner's state column follows the same formula."""
    bad = []
    rows = view.scheduler.alloc.rows
    for s in view.so.scheduled:
        row = rows.get(s.req.req_id)
        if row is None:
            continue  # preempted later in the same step
        col = cdiv(s.num_computed + s.num_scheduled, B) - 1
        window = row[col : col + 1 + S]
        if len(window) != 1 + S or NULL_BLOCK in window or len(set(window)) != 1 + S:
            bad.append(f"{s.req.req_id}: running window {window} at column {col}")
    br = view.results[0].tables["batch_rows"]
    expect = -(-(br["num_computed"].astype(np.int64) + br["num_scheduled"]) // B) - 1
    for i in np.flatnonzero(expect != br["state_col"]).tolist():
        bad.append(f"{br['req_id'][i]}: state_col {br['state_col'][i]} != {expect[i]}")
    return bad


def check_accepted(view: StepView, k: int) -> list[str]:
    so = view.so
    bad = (view.accepted < 1) | (view.accepted > so.num_draft + 1) | (view.accepted > k + 1)
    return [
        f"{so.req_ids[p]}: accepted {view.accepted[p]} with {so.num_draft[p]} drafts"
        for p in np.flatnonzero(bad).tolist()
    ]


def check_regions(view: StepView, runner: str, mixer: str = "mamba2") -> list[str]:
    """V1's reorder regions in order; the builder's split a prefix of decodes, except GDN's
    under a spec mask (null threshold), which is exactly its spec-decode rows."""
    bad = []
    for res in view.results:
        br = res.tables["batch_rows"]
        split = names(br["mamba_split"], MAMBA_SPLITS)
        steps = res.tables["steps"]
        n_dec = steps["num_mamba_decodes"]
        if mixer == "gdn" and steps["mamba_threshold"] is None:
            spec = gdn_spec_rows(
                br["num_scheduled"], br["num_computed"], br["num_prompt"], br["num_draft"]
            )
            if split != ["decode" if m else "prefill" for m in spec.tolist()] or not spec.any():
                bad.append(f"GDN split is not its spec-decode rows: {split}")
        elif split != ["decode"] * n_dec + ["prefill"] * (len(split) - n_dec):
            bad.append(f"mamba split not a prefix of decodes: {split}")
        if runner == "v1":
            region = names(br["reorder_region"], REORDER_REGIONS)
            codes = [REGION_CODE[r] for r in region]
            if codes != sorted(codes):
                bad.append(f"reorder regions out of order: {region}")
    return bad


@dataclass
class Monotone:
    """Runner-side computed counts never go back, except across a preemption."""

    last: dict[str, int] = field(default_factory=dict)

    def check(self, view: StepView) -> list[str]:
        bad = []
        for r in view.so.preempted:
            self.last.pop(r.req_id, None)
        br = view.results[0].tables["batch_rows"]
        for rid, nc in zip(br["req_id"], br["num_computed"].tolist(), strict=True):
            prev = self.last.get(rid)
            if prev is not None and nc < prev:
                bad.append(f"{rid}: num_computed {prev} -> {nc} without preemption")
            self.last[rid] = nc
        return bad


# --------------------------------------------------------------------------- runs
@dataclass
class Tally:
    violations: list[str] = field(default_factory=list)
    preemptions: int = 0
    prefix_hits: int = 0
    resumed: int = 0
    steps: int = 0


def run_checked(cfg: SimConfig) -> Tally:
    tally = Tally()
    mono = Monotone()
    S = cfg.spec_blocks

    def observe(step: int, view: StepView) -> None:
        sch = view.scheduler
        tally.steps += 1
        tally.preemptions += len(view.so.preempted)
        tally.resumed += sum(s.kind == "resumed" for s in view.so.scheduled)
        tally.prefix_hits += sum(
            s.kind == "new" and s.req.prefix_hit_tokens > 0 for s in view.so.scheduled
        )
        v = tally.violations
        v += check_ownership(
            sch.alloc.rows, sch.pool.ref, list(sch.pool.free), sch.cache.pinned(), sch.pool.shared
        )
        v += check_running_columns(view, cfg.mamba_block_size, S)
        v += check_accepted(view, cfg.k)
        v += check_regions(view, cfg.runner, cfg.mixer)
        v += mono.check(view)
        if v:
            raise AssertionError(f"step {step}: {v[:5]}")

    run_engine(cfg, observe)
    return tally


SHAPES = st.sampled_from([("v1", 1), ("v2", 1), ("v2", 2), ("v2", 3)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    scenario=st.sampled_from(["pairs", "mixed", "steady"]),
    shape=SHAPES,
    k=st.integers(0, 4),
    tight=st.booleans(),
    sync=st.booleans(),
    checkpoints=st.booleans(),
    mixer=st.sampled_from(["mamba2", "gdn"]),
)
def test_invariants_hold_on_every_step(
    seed: int,
    scenario: str,
    shape: tuple[str, int],
    k: int,
    tight: bool,
    sync: bool,
    checkpoints: bool,
    mixer: str,
) -> None:
    runner, pp = shape
    cfg = SimConfig(
        scenario=scenario,
        steps=500,
        runner=runner,
        pp=pp,
        k=k,
        seed=seed,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        mamba_block_size=64,
        length_scale=0.05,
        async_scheduling=not sync,
        num_blocks=32 * (k + 2) // 2 if tight else None,
        prefill_checkpoints=checkpoints,
        mixer=mixer,
    )
    tally = run_checked(cfg)
    assert tally.steps == 500 and not tally.violations


def test_long_tight_run_preempts_resumes_and_hits_the_prefix_cache() -> None:
    cfg = SimConfig(
        scenario="steady",
        steps=1500,
        seed=7,
        max_num_seqs=48,
        max_num_batched_tokens=4096,
        mamba_block_size=64,
        length_scale=0.3,
        num_blocks=48 * 5 // 2,
    )
    tally = run_checked(cfg)
    assert tally.preemptions > 0 and tally.resumed > 0 and tally.prefix_hits > 0


def test_default_pairs_run_is_clean_for_2000_steps() -> None:
    tally = run_checked(SimConfig(scenario="pairs", steps=2000, seed=3))
    assert tally.prefix_hits > 0


# --------------------------------------------------------------------------- controls
def _one_view(runner: str = "v1") -> tuple[SimConfig, StepView]:
    cfg = SimConfig(
        scenario="steady", steps=40, runner=runner, seed=1, length_scale=0.2, mamba_block_size=64
    )
    views: list[StepView] = []
    run_engine(cfg, lambda step, view: views.append(copy.deepcopy(view)))
    return cfg, views[-1]


def test_control_ownership_check_fires() -> None:
    _, view = _one_view()
    sch = view.scheduler
    rows = {r: list(b) for r, b in sch.alloc.rows.items()}
    a, b = list(rows)[:2]
    rows[b] = rows[b] + [next(x for x in rows[a] if x)]  # one block in two rows
    args = (sch.pool.ref, list(sch.pool.free), sch.cache.pinned(), sch.pool.shared)
    assert check_ownership(rows, *args)
    assert not check_ownership(sch.alloc.rows, *args)


def test_control_running_column_check_fires() -> None:
    cfg, view = _one_view()
    assert not check_running_columns(view, cfg.mamba_block_size, cfg.spec_blocks)
    br = view.results[0].tables["batch_rows"]
    br["state_col"] = br["state_col"] + 1
    assert check_running_columns(view, cfg.mamba_block_size, cfg.spec_blocks)


def test_control_accepted_check_fires() -> None:
    cfg, view = _one_view()
    assert not check_accepted(view, cfg.k)
    view.accepted[0] = cfg.k + 2
    assert check_accepted(view, cfg.k)


def test_control_region_check_fires() -> None:
    _, view = _one_view()
    assert not check_regions(view, "v1")
    br = view.results[0].tables["batch_rows"]
    n = len(br["reorder_region"])
    br["reorder_region"] = ["prefill", *["decode"] * (n - 1)]
    assert check_regions(view, "v1")
    br["reorder_region"] = ["decode"] * n
    br["mamba_split"] = ["prefill", "decode", *names(br["mamba_split"], MAMBA_SPLITS)[2:]]
    assert check_regions(view, "v1")


def test_control_gdn_split_check_fires() -> None:
    views: list[StepView] = []
    cfg = SimConfig(
        scenario="mixed", steps=60, seed=3, max_num_seqs=16, length_scale=0.05, mixer="gdn"
    ).validate()
    run_engine(cfg, lambda step, view: views.append(copy.deepcopy(view)))
    masked = [v for v in views if v.results[0].tables["steps"]["mamba_threshold"] is None]
    assert masked, "some steps have spec-decode rows"
    view = masked[-1]
    assert not check_regions(view, "v1", "gdn")
    br = view.results[0].tables["batch_rows"]
    split = names(br["mamba_split"], MAMBA_SPLITS)
    i = split.index("decode")
    br["mamba_split"] = [*split[:i], "prefill", *split[i + 1 :]]  # a spec row run as prefill
    assert check_regions(view, "v1", "gdn")


def test_control_monotone_check_fires() -> None:
    _, view = _one_view()
    mono = Monotone()
    assert not mono.check(view)
    br = view.results[0].tables["batch_rows"]
    br["num_computed"] = br["num_computed"] - 1
    assert mono.check(view)
