"""Unit tests of the simulator's parts: allocation arithmetic, reorder, boundary, workload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgtrace.errors import UsageError
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim import SimConfig, simulate
from mgtrace.sim.block_pool import (
    NULL_BLOCK,
    AlignAllocator,
    BlockPool,
    PoolExhausted,
    PrefixCache,
)
from mgtrace.sim.engine import StepView, run_engine
from mgtrace.sim.reorder import (
    apply_swaps,
    mamba_split,
    regions,
    reorder_swaps,
    v2_order,
    v2_sort,
)
from mgtrace.sim.runner_common import capture_size, copy_boundary
from mgtrace.sim.scheduler import KIND_RESUMED, Scheduler
from mgtrace.sim.workload import Arrival, Client

pytestmark = pytest.mark.unit


def test_first_allocation_puts_running_and_spec_blocks_after_nulls() -> None:
    # B=4, k=2: prompt [A,B,C] + drafts d1,d2 -> block 0 [A,B,C,d1], running state in block 1
    alloc = AlignAllocator(BlockPool(16), block_size=4, spec_blocks=2)
    row = alloc.allocate("r", 5)
    assert row == alloc.rows["r"] and len(row) == 4
    assert row[0] == NULL_BLOCK and NULL_BLOCK not in row[1:]
    assert alloc.running_col(5) == 1


def test_decode_crossing_reuses_spec_blocks_and_retires_the_old_state() -> None:
    pool = BlockPool(32)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=2)
    alloc.allocate("r", 3)  # cols: 0 running, 1-2 spec
    first = list(alloc.rows["r"])
    tail = alloc.allocate("r", 3 + 3)  # 6 tokens: running column 1
    row = alloc.rows["r"]
    assert row[1] == first[1] and row[2] == first[2]  # spec block 1 becomes the running one
    assert len(tail) == 1 and tail[0] == row[3] and row[3] not in first
    assert alloc.first_held_col("r") == 0
    assert alloc.retire("r", 4) == []  # not copied past yet
    freed = alloc.retire("r", 9)
    assert freed == [first[0]] and row[0] == NULL_BLOCK and first[0] in pool.free


def test_two_growths_before_a_retire_free_both_earlier_running_blocks() -> None:
    # async scheduling: the second chunk allocates before the first one's tokens are
    # processed; vLLM's skipped-block rule still frees both earlier running blocks
    pool = BlockPool(32)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=1)
    alloc.allocate("r", 4)
    a = alloc.rows["r"][0]
    alloc.allocate("r", 8)
    b = alloc.rows["r"][1]
    alloc.allocate("r", 12)
    assert alloc.behind["r"] == [0, 1]
    assert sorted(alloc.retire("r", 12)) == sorted([a, b])
    assert a in pool.free and b in pool.free and alloc.first_held_col("r") is None


def test_long_chunk_relocates_all_spec_blocks_behind_null_columns() -> None:
    alloc = AlignAllocator(BlockPool(32), block_size=4, spec_blocks=3)
    alloc.allocate("r", 4)
    spec = alloc.rows["r"][1:4]
    alloc.allocate("r", 40)  # running column 9
    row = alloc.rows["r"]
    assert row[9:12] == spec and row[1:4] == [NULL_BLOCK] * 3 and len(row) == 13
    assert alloc.blocks_needed("r", 41) == 1


def test_a_checkpoint_keeps_the_spec_block_in_its_column_and_is_freed_behind() -> None:
    # B=4, k=1: chunk 0..4 runs at column 0 with its spec block at column 1; the next
    # chunk 4..12 checkpoints at 8 tokens into column 1 (cdiv(12, 4) - 2), as vLLM reserves
    pool = BlockPool(32)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=1)
    alloc.allocate("r", 4)
    spec = alloc.rows["r"][1]
    assert alloc.wants_checkpoint_block("r", 1)
    need = alloc.blocks_needed("r", 12, checkpoint=True)
    tail = alloc.allocate("r", 12, need, checkpoint=True)
    row = alloc.rows["r"]
    assert row[1] == spec and row[2] not in (NULL_BLOCK, spec) and len(tail) == need == 2
    assert len(set(row) - {NULL_BLOCK}) == 4  # running 0 (previous), checkpoint, running, spec
    assert alloc.behind["r"] == [0, 1] and alloc.first_held_col("r") == 0
    alloc.retire("r", 8)  # past column 0, not yet past column 1
    assert row[0] == NULL_BLOCK and row[1] == spec and alloc.first_held_col("r") == 1
    alloc.retire("r", 13)
    assert row[1] == NULL_BLOCK and spec in pool.free and alloc.first_held_col("r") is None
    # control: the same chunk without a checkpoint moves the spec block to the running column
    plain = AlignAllocator(BlockPool(32), block_size=4, spec_blocks=1)
    plain.allocate("r", 4)
    moved = plain.rows["r"][1]
    plain.allocate("r", 12)
    assert plain.rows["r"][1] == NULL_BLOCK and plain.rows["r"][2] == moved


def test_a_cached_checkpoint_block_outlives_its_request_s_retire() -> None:
    pool = BlockPool(32)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=1)
    cache = PrefixCache(pool)
    alloc.allocate("r", 4)
    alloc.allocate("r", 12, checkpoint=True)
    block = alloc.rows["r"][1]
    cache.insert(0, 8, block)
    alloc.retire("r", 13)
    # freed to the free queue's tail, still cached until the queue hands it out
    assert alloc.rows["r"][1] == NULL_BLOCK and pool.free[-1] == block
    assert cache.lookup(0) == (8, block)


def test_freed_uncached_blocks_are_reused_next_tail_first_and_cached_ones_last() -> None:
    """vLLM's free_blocks puts a freed block without a cached prefix state at the head of
    the free queue and a cached one at the tail; MambaManager.free frees a row tail first in
    one call, so the next allocation takes the row's last block first."""
    pool = BlockPool(16)
    cache = PrefixCache(pool)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=2)
    row = alloc.allocate("r", 5)  # [null, running, spec, spec]
    cache.insert(family=1, tokens=4, block=row[1])
    alloc.free("r")
    assert pool.take(2) == [row[3], row[2]]
    assert list(pool.free)[-1] == row[1] and cache.lookup(1) == (4, row[1])


def test_pool_exhaustion_is_reported_before_any_change() -> None:
    pool = BlockPool(4)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=2)
    alloc.allocate("a", 4)
    with pytest.raises(PoolExhausted):
        alloc.allocate("b", 4)
    assert "b" not in alloc.rows or alloc.rows["b"] == []


@pytest.mark.parametrize(
    ("R", "N", "B", "need", "bias", "dst"),
    [
        (6, 8, 4, True, 2, 1),  # the block just completed gets the state from spec col +2
        (5, 6, 4, False, -1, 0),
        (8, 8, 4, True, 0, 1),  # a prefill chunk ending on a boundary: dst == src, no bias
        (7, 9, 4, True, 1, 1),
    ],
)
def test_copy_boundary(R: int, N: int, B: int, need: bool, bias: int, dst: int) -> None:
    n, b, d = copy_boundary(np.array([R]), np.array([N]), B)
    assert bool(n[0]) is need and int(b[0]) == bias and int(d[0]) == dst


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40))
def test_reorder_swaps_sort_regions_like_the_engine(region: list[int]) -> None:
    reg = np.asarray(region, np.int8)
    out = apply_swaps(list(range(len(reg))), reorder_swaps(reg))
    assert [region[i] for i in out] == sorted(region)
    target = np.sort(reg)
    wrong = np.flatnonzero(reg != target)
    stable_sources = wrong[np.argsort(reg[wrong], kind="stable")]
    # rows already in place stay; misplaced rows fill the misplaced slots in stable order
    assert [out[p] for p in wrong] == stable_sources.tolist()
    assert all(out[p] == p for p in range(len(reg)) if p not in set(wrong.tolist()))


def test_regions_and_split_put_decodes_behind_a_continuation_into_prefill() -> None:
    # threshold 1 (lowered by a drafter backend): 4-token spec decodes become long extends
    sched = np.array([4, 2048, 4, 4])
    computed = np.array([900, 512, 700, 650])
    prompt = np.array([800, 4000, 600, 600])
    assert regions(sched, computed, prompt, 1).tolist() == [2, 2, 2, 2]
    assert mamba_split(sched, computed, prompt, 4) == 1
    assert regions(sched, computed, prompt, 4).tolist() == [0, 2, 0, 0]


def test_one_token_prompt_chunk_with_state_is_a_decode() -> None:
    assert mamba_split(np.array([1, 4]), np.array([10, 20]), np.array([11, 5]), 4) == 2
    assert mamba_split(np.array([2, 4]), np.array([10, 20]), np.array([12, 5]), 4) == 0


def test_v2_sort_orders_drafts_then_uniform_then_by_length() -> None:
    ids = ["a", "b", "c", "d", "e"]
    order = v2_sort(ids, [7, 4, 4, 2, 4], [False, True, False, True, True], 4)
    assert [ids[i] for i in order] == ["b", "e", "d", "c", "a"]


def test_capture_sizes() -> None:
    assert [capture_size(n, 96) for n in (0, 1, 3, 5, 8, 9, 17, 95)] == [0, 1, 4, 8, 8, 16, 24, 96]


def test_workload_is_seeded() -> None:
    def arrivals(seed: int) -> list[tuple[float, int, int]]:
        c = Client(SimConfig(scenario="pairs", seed=seed))
        out = [(a.arrival_s, a.prompt_len, a.output_len) for a in c.poll(0.0)]
        out += [(a.arrival_s, a.prompt_len, a.output_len) for a in c.poll(5.0)]
        return out

    assert arrivals(1) == arrivals(1) != arrivals(2)
    first = arrivals(1)
    assert len(first) == 60 and sum(p > 50000 for _, p, _ in first) == 30


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"scenario": "burst"}, "unknown scenario"),
        ({"runner": "v3"}, "unknown runner"),
        ({"steps": 0}, "--steps"),
        ({"steps": 10**20}, "at most"),  # once ran until interrupted, past int64's steps
        ({"bugs": ("nope",)}, "unknown bug"),
        ({"bugs": ("batch-row-block-table",)}, "needs --runner v2"),
        # once accepted, and inert: without drafts the late post-process copies nothing
        ({"bugs": ("batch-row-block-table",), "runner": "v2", "pp": 2, "k": 0}, "--k 1"),
        ({"runner": "v1", "pp": 2}, "V1 runner does not support"),
        ({"mamba_block_size": 3}, "must exceed --k"),
        ({"bugs": ("async-accepted-race",), "async_scheduling": False}, "async"),
    ],
)
def test_bad_config_is_one_usage_error(kwargs: dict, words: str) -> None:
    with pytest.raises(UsageError, match=words) as info:
        SimConfig(**kwargs).validate()
    assert "\n" not in info.value.message


def test_same_seed_same_trace(tmp_path: Path) -> None:
    def run(name: str) -> dict:
        m = simulate(
            SimConfig(
                scenario="mixed",
                steps=150,
                seed=5,
                length_scale=0.2,
                bugs=("reorder-threshold-mismatch",),
                output=tmp_path / name,
            )
        )
        r = TraceReader(tmp_path / name)
        return {
            "truth": m.ground_truth,
            **{t: r.table(t).to_pydict() for t in ("batch_rows", "launches", "sched")},
        }

    assert run("a") == run("b")


def test_trace_has_every_recorded_table(tmp_path: Path) -> None:
    m = simulate(
        SimConfig(
            scenario="steady", steps=120, length_scale=0.2, runner="v2", pp=2, output=tmp_path / "t"
        )
    )
    assert m.complete and m.drops.total_steps == 0 and not m.errors
    r = TraceReader(tmp_path / "t")
    for table in (
        "steps",
        "batch_rows",
        "launches",
        "block_tables",
        "row_moves",
        "sched",
        "requests",
    ):
        assert r.rows(table) > 0, table
    steps = r.table("steps").to_pydict()
    assert sorted(set(steps["rank"])) == [0, 1] and len(steps["step"]) == 240


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.booleans()), max_size=30))
def test_v2_order_matches_the_sort_rule(rows: list[tuple[int, bool]]) -> None:
    n = np.array([r[0] for r in rows], np.int64)
    d = np.array([r[1] for r in rows], bool)
    ids = [f"r{i}" for i in range(len(rows))]
    assert v2_order(n, d, 4).tolist() == v2_sort(ids, n.tolist(), d.tolist(), 4)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_new_requests_join_the_batch_before_resumed_ones(tmp_path: Path, runner: str) -> None:
    """vLLM adds a step's new requests before the resumed ones (V1's _update_states collects
    scheduled_new_reqs first; V2's scheduler output lists new then resumed), so they take the
    lower rows or the first free slots. Control: the runs hold steps where both join."""
    both = 0
    for seed in (3, 4):
        out = tmp_path / f"{runner}-{seed}"
        cfg = SimConfig(
            scenario="steady",
            steps=1500,
            seed=seed,
            runner=runner,
            num_blocks=60,
            max_num_seqs=16,
            output=out,
        )
        simulate(cfg.validate())
        con = TraceReader(out).connect()
        rows = con.execute(
            """
            SELECT m.step, s.kind, m.seq FROM row_moves m
            JOIN sched s ON s.step = m.step AND s.req_id = m.req_id
            WHERE m.op = 'add' AND s.kind IN ('new', 'resumed')
            ORDER BY m.step, m.seq
            """
        ).fetchall()
        by_step: dict[int, list[str]] = {}
        for step, kind, _ in rows:
            by_step.setdefault(step, []).append(kind)
        for kinds in by_step.values():
            if {"new", "resumed"} <= set(kinds):
                both += 1
                assert kinds == sorted(kinds, key=lambda k: k != "new"), kinds
    assert both >= 2


def test_v2_frees_request_slots_sorted_by_request_id() -> None:
    """V2's finish_requests frees ``sorted(finished | preempted)`` so every TP rank frees
    slots in the same order; with a LIFO free list that order picks the slots the next
    requests get. Control: the run holds steps where the scheduler lists them unsorted."""
    cfg = SimConfig(
        scenario="steady",
        steps=400,
        runner="v2",
        k=3,
        seed=14,  # a run with steps that preempt two requests
        max_num_seqs=24,
        mamba_block_size=16,
        length_scale=0.2,
        num_blocks=40,
    )
    unsorted = 0
    holding: set[str] = set()  # requests with a slot (one finished while preempted has none)

    def observe(step: int, view: StepView) -> None:
        nonlocal unsorted
        so = view.so
        listed = [r.req_id for r in so.finished] + [r.req_id for r in so.preempted]
        unsorted += listed != sorted(listed)
        moves = view.results[-1].tables.get("row_moves", {"op": [], "req_id": []})
        freed = sorted(set(listed) & holding)
        removed = [r for op, r in zip(moves["op"], moves["req_id"], strict=True) if op == "remove"]
        assert removed[: len(freed)] == freed, step
        for op, r in zip(moves["op"], moves["req_id"], strict=True):
            if op == "add":
                holding.add(r)
            elif op == "remove":
                holding.discard(r)

    run_engine(cfg, observe)
    assert unsorted >= 1


def test_v2_resumed_request_prefills_all_its_tokens() -> None:
    """V2 re-adds a resumed request with all its tokens as the prefill (prefill_len =
    len(all_token_ids)), so its recorded prompt length and is_prefilling count the output it
    replays. Control: a resumed request had output before its preemption."""
    cfg = SimConfig(
        scenario="mixed",
        steps=800,
        runner="v2",
        k=3,
        seed=2,
        max_num_seqs=32,
        mamba_block_size=16,
        num_blocks=40,
        length_scale=0.3,
        max_num_batched_tokens=64,
    )
    prefill_len: dict[str, int] = {}
    replayed = 0

    def observe(step: int, view: StepView) -> None:
        nonlocal replayed
        so = view.so
        for p in (so.kind == KIND_RESUMED).nonzero()[0].tolist():
            req = so.reqs[p]
            prefill_len[req.req_id] = req.prompt_len + req.num_output  # no result lands yet
            replayed += req.num_output > 0
        rows = view.results[-1].tables["batch_rows"]
        for rid, prompt, nc, pref in zip(
            rows["req_id"],
            rows["num_prompt"].tolist(),
            rows["num_computed"].tolist(),
            np.asarray(rows["is_prefilling"], bool).tolist(),
            strict=True,
        ):
            want = prefill_len.get(rid, prompt)
            assert (prompt, pref) == (want, nc < want), (step, rid)

    run_engine(cfg, observe)
    assert replayed >= 1


def _preempting(runner: str, pp: int) -> SimConfig:
    """A small pool that preempts often, with short outputs so that requests also finish."""
    return SimConfig(
        scenario="steady",
        steps=600,
        runner=runner,
        pp=pp,
        k=3,
        seed=2,
        max_num_seqs=24,
        mamba_block_size=16,
        length_scale=0.2,
        num_blocks=40,
    )


@pytest.mark.parametrize(("runner", "pp"), [("v1", 1), ("v2", 1), ("v2", 2)])
def test_preempted_request_keeps_the_tokens_its_in_flight_step_sampled(
    runner: str, pp: int
) -> None:
    """vLLM's _preempt_request marks a request's in-flight output stale rather than dropping
    it: update_from_output still appends the tokens it sampled, and the request resumes only
    once they are in, so its replayed prefill is the prompt plus every token ever sampled for
    it. Control: some preemptions hit a request with a sampling step in flight."""
    cfg = _preempting(runner, pp)
    lag = cfg.steps_in_flight
    sampled: dict[str, int] = {}  # tokens sampled for each request so far
    last_sample: dict[str, int] = {}  # the last step that sampled for each request
    replay: dict[str, list[int]] = {}  # resumed request -> [tokens it must replay, left]
    hit = 0

    def observe(step: int, view: StepView) -> None:
        nonlocal hit
        so = view.so
        for req in so.preempted:
            hit += last_sample.get(req.req_id, -1) > step - 1 - lag
        for p, req in enumerate(so.reqs):
            rid = req.req_id
            if so.kind[p] == KIND_RESUMED:
                # a prefix hit on resume spares the replay its cached tokens
                replay[rid] = [req.prompt_len + sampled.get(rid, 0) - so.num_computed[p], 0]
            if rid in replay:
                replay[rid][1] += int(so.num_scheduled[p])
                if so.samples[p]:
                    want, got = replay.pop(rid)
                    assert got == want, (step, rid)
            if so.samples[p]:
                sampled[rid] = sampled.get(rid, 0) + int(view.accepted[p])
                last_sample[rid] = step

    run_engine(cfg, observe)
    assert hit >= 1


@pytest.mark.parametrize(("runner", "pp"), [("v1", 1), ("v2", 2)])
def test_resumed_request_starts_from_its_familys_cached_state(runner: str, pp: int) -> None:
    """vLLM resets a preempted request's num_computed_tokens to 0, and the scheduler's
    waiting loop looks the prefix cache up for every request at 0 (get_computed_blocks, at
    most num_tokens - 1 tokens): a resumed request of a family whose boundary state is
    cached starts from it, like a new one. Its resumed row then carries the hit as
    num_computed and its block row as nulls up to the cached block; the request's
    prefix_hit_tokens stays that of its first admission (vLLM's prefill stats)."""
    cfg = _preempting(runner, pp)
    B = cfg.mamba_block_size
    # every entry the cache held as a schedule found it, per family (a hit whose allocation
    # must wait touches nothing, and is looked up again at the next try)
    cached: dict[int, set[tuple[int, int]]] = {}
    first_hit: dict[str, int] = {}  # prefix_hit_tokens once first scheduled
    hits = 0

    def observe(step: int, view: StepView) -> None:
        nonlocal hits
        so = view.so
        for p, req in enumerate(so.reqs):
            first_hit.setdefault(req.req_id, req.prefix_hit_tokens)
            nc = int(so.num_computed[p])
            if so.kind[p] != KIND_RESUMED or nc == 0:
                continue
            hits += 1
            col = nc // B - 1
            ids = so.ids_at(p)
            assert req.wants_hit and nc % B == 0, (step, req.req_id)
            assert ids[:col] == [NULL_BLOCK] * col, (step, req.req_id)
            assert (nc, ids[col]) in cached.get(req.family, ()), (step, req.req_id)
            assert nc < req.prompt_len + req.num_output, (step, req.req_id)
            assert req.prefix_hit_tokens == first_hit[req.req_id], (step, req.req_id)
        for family, entry in view.scheduler.cache.entries.items():
            cached.setdefault(family, set()).add(entry)

    run_engine(cfg, observe)
    assert hits >= 1


def test_stale_output_is_delivered_after_preemption_and_can_finish_the_request() -> None:
    """Under async scheduling a step's result lands after the next step is scheduled. ``c``
    is preempted at step 2 with its step-1 token in flight: the token is still delivered, so
    it resumes at step 4 replaying 15 + 2 tokens (a first chunk up to the last cacheable
    block boundary, 16, then the last token). ``d`` is preempted at step 5 with the step
    that samples its last token in flight: that result finishes it while it waits, and the
    next step reports it finished."""
    cfg = SimConfig(
        k=0, mamba_block_size=16, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64
    )
    sched = Scheduler(cfg.validate())

    def arrival(prompt: int, output: int) -> Arrival:
        return Arrival("c", 0.0, prompt, output, output, -1, 0, False, 0)

    for rid, prompt, output in (("a", 15, 40), ("b", 15, 40), ("c", 15, 40), ("d", 14, 3)):
        sched.new_request(rid, arrival(prompt, output))
    steps = []
    for step in range(7):
        steps.append(sched.schedule(step))
        if step:  # the previous step's result arrives once this one is scheduled
            done = steps[step - 1]
            sched.apply_results(done, np.ones(len(done), np.int64))
    pre = {step: [r.req_id for r in so.preempted] for step, so in enumerate(steps)}
    assert pre[2] == ["d", "c"] and pre[5] == ["d"]
    resumed = {
        rid: int(n)
        for rid, k, n in zip(steps[4].req_ids, steps[4].kind, steps[4].num_scheduled, strict=True)
        if k == KIND_RESUMED
    }
    assert resumed == {"c": 16, "d": 16}
    c5 = steps[5].req_ids.index("c")
    assert (int(steps[5].num_computed[c5]), int(steps[5].num_scheduled[c5])) == (16, 1)
    d = next(r for r in steps[0].reqs if r.req_id == "d")
    assert [r.req_id for r in steps[6].finished] == ["d"]
    assert (d.status, d.num_output) == ("finished", 3)
    assert d not in sched.waiting and "d" not in steps[6].req_ids


def test_a_cached_block_is_evicted_only_when_the_free_queue_hands_it_out() -> None:
    """vLLM evicts lazily: a freed cached block waits at the free queue's tail, still a hit,
    and loses its cached state only when get_new_blocks hands it out; a block a request
    holds is not in the queue, so no allocation evicts it."""
    pool = BlockPool(6)
    cache = PrefixCache(pool)
    alloc = AlignAllocator(pool, block_size=4, spec_blocks=0)
    alloc.allocate("r", 8)  # [null, running]
    block = alloc.rows["r"][1]
    cache.insert(family=7, tokens=8, block=block)
    others = pool.take(pool.num_free)  # a short pool: the held cached block stays
    assert cache.lookup(7) == (8, block) and block not in others
    pool.release_all(others)
    alloc.free("r")
    assert pool.free[-1] == block and cache.lookup(7) == (8, block)
    assert block not in pool.take(pool.num_free - 1) and cache.lookup(7) == (8, block)
    assert pool.take(1) == [block] and cache.lookup(7) is None and block not in pool.shared


def test_a_prefix_hit_that_must_wait_touches_nothing_and_is_looked_up_again() -> None:
    """vLLM's allocate_slots refuses a request before it touches its hit block: ``a``'s
    cached boundary block stays in the free queue while ``b`` waits for room, ``f1``'s next
    block evicts it, and ``b`` is then scheduled from scratch (no hit), nobody preempted."""
    cfg = SimConfig(k=0, mamba_block_size=16, num_blocks=5, max_num_batched_tokens=256)
    sched = Scheduler(cfg.validate())
    sched.new_request("a", Arrival("c", 0.0, 40, 1, 1, 0, 32, True, 0))
    steps = []
    for step in range(7):
        if step == 2:  # three requests take every free block but a's cached one
            for rid, prompt in (("f1", 15), ("f2", 2), ("f3", 2)):
                sched.new_request(rid, Arrival("c", 0.0, prompt, 4, 4, -1, 0, False, 0))
            b = sched.new_request("b", Arrival("c", 0.0, 40, 4, 4, 0, 32, True, 0))
        steps.append(sched.schedule(step))
        sched.apply_results(steps[-1], np.ones(len(steps[-1]), np.int64))
        if step == 2:
            block = steps[0].ids_at(0)[1]
            assert sched.cache.lookup(0) == (32, block)
            assert list(sched.pool.free) == [block] and sched.pool.ref[block] == 0
            assert b.status == "waiting" and b.num_computed == 0 and "b" not in sched.alloc.rows
    assert not any(so.preempted for so in steps)
    assert steps[4].ids_at(steps[4].req_ids.index("f1")) == [block]  # handed out: evicted
    p = steps[5].req_ids.index("b")
    assert (steps[5].num_computed[p], steps[5].num_scheduled[p]) == (0, 32)
    assert b.prefix_hit_tokens == 0


def test_a_preempted_request_resumes_from_the_state_it_cached() -> None:
    """``a`` stores its family's boundary state in its first chunk and is preempted for the
    next one (the pool is short). Its boundary block is still cached (vLLM evicts a cached
    block only when the free queue hands it out), so the resumed request starts from it."""
    cfg = SimConfig(
        k=0, mamba_block_size=16, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64
    )
    sched = Scheduler(cfg.validate())
    for rid in "bcd":  # one block each, decoding on for three tokens
        sched.new_request(rid, Arrival("c", 0.0, 8, 3, 3, -1, 0, False, 0))
    sched.new_request("a", Arrival("c", 0.0, 40, 4, 4, 0, 32, True, 1))
    steps = []
    for step in range(4):
        steps.append(sched.schedule(step))
        sched.apply_results(steps[-1], np.ones(len(steps[-1]), np.int64))
    a0 = steps[0].req_ids.index("a")
    block = steps[0].ids_at(a0)[1]  # [null, the boundary state's block]
    assert [r.req_id for r in steps[1].preempted] == ["a"]
    assert sched.cache.lookup(0) == (32, block)
    resumed = [
        (step, p)
        for step, so in enumerate(steps)
        for p, rid in enumerate(so.req_ids)
        if rid == "a" and so.kind[p] == KIND_RESUMED
    ]
    assert resumed, "a never resumed"
    step, p = resumed[0]
    assert int(steps[step].num_computed[p]) == 32
    assert steps[step].ids_at(p)[:2] == [NULL_BLOCK, block]


@pytest.mark.parametrize("k, hit", [(0, 32), (3, 16)])
def test_a_family_hit_leaves_out_the_block_mtp_drops(k: int, hit: int) -> None:
    """Under MTP vLLM drops the last block of a full-attention prefix hit (EAGLE's block
    drop), so a sibling sharing a 40-token prefix resumes one block below its last full
    block, and the first member caches its state there."""
    cfg = SimConfig(k=k, mamba_block_size=16, max_num_batched_tokens=256)
    sched = Scheduler(cfg.validate())
    sched.new_request("a", Arrival("c", 0.0, 60, 4, 4, 0, 40, True, 0))
    for step in range(3):
        if step == 2:
            sched.new_request("b", Arrival("c", 0.0, 60, 4, 4, 0, 40, True, 1))
        so = sched.schedule(step)
        sched.apply_results(so, np.ones(len(so), np.int64))
    assert sched.cache.lookup(0)[0] == hit
    b = next(r for r in sched.store.reqs[: sched.store.n] if r.req_id == "b")
    assert b.prefix_hit_tokens == hit
