"""Unit tests of the replayer's parts: rules, ownership, provenance tags, table store."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mgtrace.errors import UsageError
from mgtrace.replayer.ownership import BlockOwnership
from mgtrace.replayer.rules import AS_RECORDED, RULES, RuleSet, single_changes
from mgtrace.replayer.tables import TableStore
from mgtrace.replayer.tags import TagPool
from mgtrace.schemas.manifest import RunMetadata, StateLayout

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- rules
def test_rule_set_parse_and_canonical_round_trip() -> None:
    rules = RuleSet.parse("reorder_threshold=1+k, bt_row_is_req=TRUE")
    assert rules.canonical() == "bt_row_is_req=true,reorder_threshold=1+k"
    assert RuleSet.parse(rules.canonical()) == rules
    assert rules.as_flags() == ["--bt-row-is-req=true", "--reorder-threshold=1+k"]
    assert RuleSet().canonical() == AS_RECORDED
    assert RuleSet.parse("reorder-threshold=7")["reorder_threshold"] == "7"
    # the same value twice says one thing: no refusal (control for the repeats refused below)
    assert RuleSet.parse("bt_row_is_req=true,bt-row-is-req=TRUE") == RuleSet.parse(
        "bt_row_is_req=true"
    )


@pytest.mark.parametrize(
    "text",
    [
        "nope=1",
        "bt_row_is_req=maybe",
        "reorder_threshold=0",
        "reorder_threshold=\u00b2",  # a Unicode digit: isdigit() says yes, int() says no
        "accepted_source",
        "x",
        # one rule twice, with two values (once the last one won without a word)
        "reorder_threshold=1+k,reorder_threshold=4",
        "reorder-threshold=1+k reorder_threshold=4",
    ],
)
def test_bad_rules_are_refused(text: str) -> None:
    with pytest.raises(UsageError):
        RuleSet.parse(text)


def test_list_rules_names_every_rule_as_text_and_as_json() -> None:
    """--list-rules once printed its table whatever --json said. Control: without --json
    the table, which is no JSON."""
    from tests.conftest import run_cli

    said = json.loads(run_cli("replay", "--list-rules", "--json").stdout)
    assert [r["name"] for r in said] == list(RULES)
    assert all(AS_RECORDED in r["values"] and r["flag"].startswith("--") for r in said)
    table = run_cli("replay", "--list-rules")
    assert table.returncode == 0 and all(r.flag in table.stdout for r in RULES.values())
    with pytest.raises(json.JSONDecodeError):
        json.loads(table.stdout)


def test_single_changes_cover_every_rule_once() -> None:
    changes = list(single_changes(RuleSet(), k=3))
    assert all(len(c.changed()) == 1 for c in changes)
    assert {next(iter(c.changed())) for c in changes} == set(RULES)
    assert RuleSet.parse("accepted_source=kernel") not in changes  # same as recorded
    assert not any(
        c.changed() == {"reorder_threshold": "1+k"} for c in single_changes(RuleSet(), k=0)
    )


# ---------------------------------------------------------------- ownership
def test_ownership_follows_scheduler_deltas() -> None:
    own = BlockOwnership(num_groups=1, num_blocks=32)
    own.apply(0, [1, 2], ["new", "new"], [[[3, 4, 0]], [[5]]])
    assert own.owner_of(0, 4).uid == 1 and own.owner_of(0, 5).uid == 2
    assert own.owner_of(0, 0) is None  # the null block belongs to nobody
    own.apply(1, [1], ["cached"], [[[6]]])
    assert own.owner_of(0, 6).uid == 1 and own.owner_of(0, 6).step == 1
    # the scheduler frees block 3 silently and hands it to request 2: the latest holder wins
    own.apply(2, [2], ["cached"], [[[3]]])
    assert own.owner_of(0, 3).uid == 2
    own.apply(3, [1], ["finished"], [None])
    assert own.owner_of(0, 4) is None and own.owner_of(0, 3).uid == 2
    own.apply(4, [2], ["resumed"], [[[7]]])  # resumed: the block list is replaced
    assert own.owner_of(0, 5) is None and own.owner_of(0, 7).uid == 2


def test_ownership_says_which_blocks_lie_behind_the_running_column() -> None:
    """The worker's row ends at the running column and k spec columns: with k=2, a row of
    [A, B, S1, S2] runs at column 1; appending [0, S1, S2, N] moves it to column 5."""
    own = BlockOwnership(num_groups=1, num_blocks=32, spec_blocks=2)
    own.apply(0, [1], ["new"], [[[3, 4, 8, 9]]])
    assert own.column_behind(1, 0, 3) == (0, 1)
    assert own.column_behind(1, 0, 4) is None  # the running column itself
    assert own.column_behind(1, 0, 9) is None  # a spec column
    own.apply(1, [1], ["cached"], [[[0, 8, 9, 10]]])
    assert own.column_behind(1, 0, 4) == (1, 5)  # moved past
    assert own.column_behind(1, 0, 8) is None  # reused: its later column
    assert own.column_behind(1, 0, 10) is None
    assert own.column_behind(2, 0, 3) is None  # not its block


def test_ownership_retires_the_previous_state_block_as_align_mode_does() -> None:
    """B=4, k=2: a row [3, 8, 9] runs at column 0; growing by [10] it runs at column 1 (the
    reused spec block 8) and column 0 becomes its previous state column, freed once the
    processed tokens pass it: 0 < cdiv(processed, 4) - 1, the column ``retire`` is given."""
    own = BlockOwnership(num_groups=1, num_blocks=32, block_size=4, spec_blocks=2)
    own.apply(0, [1], ["new"], [[[3, 8, 9]]])
    own.retire(np.array([1]), np.array([0]))  # nothing behind column 0 yet
    assert own.owner_of(0, 3).uid == 1
    own.apply(1, [1], ["cached"], [[[10]]])
    own.retire(np.array([1]), np.array([0]))  # processed 4: 0 < cdiv(4, 4) - 1 fails
    assert own.owner_of(0, 3).uid == 1
    own.retire(np.array([1]), np.array([1]))  # processed 5
    assert own.owner_of(0, 3) is None
    assert all(own.owner_of(0, b).uid == 1 for b in (8, 9, 10))
    assert own.column_behind(1, 0, 3) == (0, 1)  # still in the worker's row
    own.apply(2, [2], ["cached"], [[[3]]])  # handed to another request: its block now
    own.retire(np.array([1]), np.array([12]))  # retired once only
    assert own.owner_of(0, 3).uid == 2
    own.retire(np.array([1, 500]), np.array([12, 12]))  # a uid past the table it starts with


def test_ownership_retires_a_prefix_hit_block_and_keeps_a_block_still_in_the_row() -> None:
    own = BlockOwnership(num_groups=1, num_blocks=32, block_size=4, spec_blocks=1)
    # a hit of 8 tokens: null column, boundary block 5 at column 1, then its new blocks
    own.apply(0, [1], ["new"], [[[0, 5, 6, 7]]])
    own.retire(np.array([1]), np.array([1]))
    assert own.owner_of(0, 5).uid == 1
    own.retire(np.array([1]), np.array([2]))
    assert own.owner_of(0, 5) is None
    # a block that appears again later in the row is still in use: never freed
    own.apply(1, [2], ["new"], [[[11, 12]]])
    own.apply(2, [2], ["cached"], [[[11, 13]]])  # column 0 holds 11, so does column 2
    own.retire(np.array([2]), np.array([1]))
    assert own.owner_of(0, 11).uid == 2
    own.apply(3, [2], ["finished"], [None])
    own.retire(np.array([2]), np.array([24]))  # a finished request holds nothing
    assert own.owner_of(0, 11) is None


def test_ownership_frees_a_checkpoint_block_behind_the_previous_state() -> None:
    """B=4, k=1: [3, 4] runs at column 0; a chunk to 12 tokens keeps spec block 4 at column
    1 as its prefill checkpoint and appends [8, 9] (running 8 at column 2). Every column the
    processed tokens pass is freed, the checkpoint's too, as vLLM's skipped-block rule does."""
    own = BlockOwnership(num_groups=1, num_blocks=32, block_size=4, spec_blocks=1)
    own.apply(0, [1], ["new"], [[[3, 4]]])
    own.apply(1, [1], ["cached"], [[[8, 9]]])
    assert [b for *_, b in own.retire(np.array([1]), np.array([1]))] == [3]
    assert own.owner_of(0, 4).uid == 1
    assert [b for *_, b in own.retire(np.array([1]), np.array([2]))] == [4]
    assert all(own.owner_of(0, b).uid == 1 for b in (8, 9))


@pytest.mark.parametrize(
    ("runner", "pp", "async_scheduling", "in_flight"),
    [
        ("v1", 1, False, 0),
        ("v1", 1, True, 1),
        ("v2", 1, True, 1),
        ("v2", 2, False, 1),
        ("v1", 2, True, 1),  # V1 does not overlap a pipeline
        ("v2", 2, True, 2),  # V2: pp_size + 1 concurrent batches
        ("v2", 4, True, 4),
    ],
)
def test_steps_in_flight_is_vllms_concurrent_batches_less_one(
    runner: str, pp: int, async_scheduling: bool, in_flight: int
) -> None:
    from mgtrace.replayer.ownership import steps_in_flight
    from mgtrace.schemas.manifest import RunMetadata

    run = RunMetadata(runner=runner, pp_size=pp, async_scheduling=async_scheduling)
    assert steps_in_flight(run) == in_flight


def test_processed_tokens_take_off_the_steps_still_in_flight() -> None:
    from mgtrace.replayer.ownership import processed_tokens
    from mgtrace.schemas.tables import SCHED_KINDS

    kind = np.array([SCHED_KINDS.index(k) for k in ("new", "cached", "cached", "new")])
    args = (
        np.array([1, 1, 1, 2]),  # uid
        np.array([0, 1, 2, 1]),  # step
        kind,
        np.array([10, 4, 4, 7]),  # num_scheduled
        np.array([0, 10, 14, 0]),  # num_computed
    )
    assert processed_tokens(*args, 0).tolist() == [0, 10, 14, 0]
    assert processed_tokens(*args, 1).tolist() == [0, 0, 10, 0]
    assert processed_tokens(*args, 2).tolist() == [0, 0, 0, 0]


def _processed_by_definition(
    uid: np.ndarray,
    step: np.ndarray,
    kind: np.ndarray,
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    in_flight: int,
) -> list[int]:
    """The definition, row by row: less the first scheduled row of the same request at each
    of the ``in_flight`` steps before."""
    from mgtrace.schemas.tables import SCHED_KINDS

    scheduled = {SCHED_KINDS.index(k) for k in ("new", "cached", "resumed")}
    first: dict[tuple[int, int], int] = {}
    for u, s, k, n in zip(
        uid.tolist(), step.tolist(), kind.tolist(), num_scheduled.tolist(), strict=True
    ):
        if k in scheduled:
            first.setdefault((u, s), n)
    return [
        c - sum(first.get((u, s - back), 0) for back in range(1, in_flight + 1))
        for u, s, c in zip(uid.tolist(), step.tolist(), num_computed.tolist(), strict=True)
    ]


@pytest.mark.parametrize("layout", ["in_step_order", "shuffled", "twice_in_a_step"])
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_processed_tokens_match_their_definition_on_random_rows(
    layout: str, in_flight: int
) -> None:
    """Rows in step order take the shifted comparison, rows out of order or a request twice
    in one step the search; both give the definition's counts, finished and preempted rows
    included. Controls: a shift that counts only the steps before the last in flight
    (``<`` for ``<=``) fails the first layout, a search that takes the last row of a
    request's step the third."""
    from mgtrace.replayer.ownership import processed_tokens

    rng = np.random.default_rng(in_flight)
    rows = []
    for s in range(60):  # each request at most once a step, some steps skipped
        for u in rng.choice(12, size=rng.integers(0, 9), replace=False).tolist():
            rows.append((u, s, int(rng.integers(0, 5)), int(rng.integers(1, 9))))
    uid, step, kind, sched = (np.array(c) for c in zip(*rows, strict=True))
    if layout == "shuffled":
        perm = rng.permutation(len(uid))
        uid, step, kind, sched = uid[perm], step[perm], kind[perm], sched[perm]
    elif layout == "twice_in_a_step":
        # five rows again, later and with other counts: the first of each pair counts
        uid, step, kind = (np.concatenate([a, a[:5]]) for a in (uid, step, kind))
        sched = np.concatenate([sched, sched[:5] + 10])
    computed = rng.integers(0, 500, size=len(uid))
    args = (uid.astype(np.int32), step.astype(np.int64), kind.astype(np.int8), sched, computed)
    got = processed_tokens(*args, in_flight).tolist()
    assert got == _processed_by_definition(*args, in_flight)


# ---------------------------------------------------------------- tags
def _run(conv_layout: str = "SD") -> RunMetadata:
    shape = [5, 64] if conv_layout == "SD" else [64, 5]
    return RunMetadata(
        num_speculative_tokens=2,
        num_blocks=16,
        states=[
            StateLayout(0, 0, "conv", shape, "bfloat16", conv_layout),
            StateLayout(0, 0, "temporal", [4, 8, 16], "float32"),
        ],
    )


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_tags_round_trip(layout: str) -> None:
    pool = TagPool(_run(layout))
    blocks = np.array([3, 7])
    pool.write_temporal(0, blocks, np.array([11, 12]), np.array([100, 200]), 9, np.array([0, 1]))
    pool.write_conv(0, blocks, np.array([11, 12]), np.array([99, 199]))
    tags = pool.read_temporal(0, blocks)
    assert tags.tolist() == [[11, 100, 9, 0], [12, 200, 9, 1]]
    uids, pos = pool.read_conv(0, blocks)
    assert uids.tolist() == [[11] * 5, [12] * 5]
    assert pos.tolist() == [list(range(95, 100)), list(range(195, 200))]
    untouched = pool.read_temporal(0, np.array([4]))
    assert untouched.tolist() == [[0, 0, 0, 0]]


def test_tags_move_with_the_kernels_byte_copies() -> None:
    """A precopy with bias 2 shifts the conv rows by two tokens and takes the temporal state
    from column src+2, so the tags say exactly what the moved state holds."""
    from mgtrace.kernels.launch import AlignLaunch
    from mgtrace.kernels.reference import run_reference

    pool = TagPool(_run())
    store = TableStore(["v1"], 1, rows=2, width=8)
    store.apply([(0, "v1", 0, [0, 2, 3, 4, 5, 6])])
    uid = np.array([5])
    pool.write_conv(0, np.array([2]), uid, np.array([40]))
    for j, block in enumerate((2, 3, 4)):
        pool.write_temporal(0, np.array([block]), uid, np.array([36 + j]), 1, np.array([0]))
    launch = AlignLaunch(
        kernel="precopy",
        batch_row=[0],
        req_slot=[0],
        state_idx=[5],
        src_col=[1],
        token_bias=[2],
        block_size=16,
        num_speculative_tokens=2,
    )
    run_reference(launch, pool.pool, store.block_tables("v1"))
    assert pool.read_temporal(0, np.array([6]))[0, :2].tolist() == [5, 38]  # from column 3
    uids, pos = pool.read_conv(0, np.array([6]))
    assert pos[0, :3].tolist() == [38, 39, 40]  # rows shifted left by the bias
    assert uids[0, :3].tolist() == [5, 5, 5]


def test_table_store_gather_never_raises() -> None:
    store = TableStore(["v1"], 1, rows=2, width=3)
    store.apply([(0, "v1", 1, [7, 8, 9, 10]), (0, "v1", 9, [1])])  # too long; bad row ignored
    got = store.gather("v1", 0, np.array([1, 1, 5, -1]), np.array([0, 2, 0, 0]))
    assert got.tolist() == [7, 9, -1, -1]


def test_table_store_keeps_block_ids_past_the_pool_out_and_says_where() -> None:
    store = TableStore(["v1"], 1, rows=2, width=4, num_blocks=10)
    outside = store.apply([(0, "v1", 0, [3, 12, 4]), (0, "v1", 1, [9, 8])])
    assert [(o.row, o.block_id) for o in outside] == [(0, 12)]
    assert store.tables["v1"][0][0].tolist() == [3, -1, 4, 0]  # read as no block
    assert store.tables["v1"][0][1].tolist() == [9, 8, 0, 0]  # the control: in range, kept
    unbounded = TableStore(["v1"], 1, rows=1, width=2)  # pool size unknown: ids as given
    assert unbounded.apply([(0, "v1", 0, [12])]) == []


def _rewritten(reader, out, mutate=None):
    """A copy of ``reader``'s trace with ``mutate(table name, rows)`` applied to its rows."""
    import pyarrow as pa

    from mgtrace.schemas.reader import TraceReader
    from mgtrace.schemas.tables import TABLES
    from mgtrace.schemas.writer import TraceWriter

    with TraceWriter(out, run=reader.run, source={"kind": "test"}) as w:
        for name, spec in TABLES.items():
            table = reader.table(name)
            if not table.num_rows or not spec.per_step:
                continue
            rows = table.to_pylist()
            if mutate is not None:
                mutate(name, rows)
            table = pa.Table.from_pylist(rows, schema=table.schema).drop(["rank"])
            cols = {c: table[c].to_pylist() for c in table.column_names}
            w.write_steps(0, min(cols["step"]), max(cols["step"]), {name: cols})
    return TraceReader(out)


def _small_clean_trace(tmp_path):
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    src = tmp_path / "src"
    simulate(SimConfig(scenario="steady", steps=100, seed=2, output=src).validate())
    return TraceReader(src)


@pytest.mark.parametrize("bad_id", ["past", "negative"])
def test_a_block_id_past_the_pool_is_a_finding_not_a_crash(tmp_path, bad_id: str) -> None:
    """A block-table row naming a block the pool does not have (past its end, or negative:
    once read as "no block" and passed clean) is reported as malformed at the step that
    wrote it; the same trace without it replays clean."""
    from mgtrace.replayer.findings import MALFORMED
    from mgtrace.replayer.loop import replay_trace

    reader = _small_clean_trace(tmp_path)
    poisoned_id = reader.run.num_blocks + 7 if bad_id == "past" else -9  # -1: "unseen"

    def poison(name, rows):
        if name == "block_tables":
            first = next(r for r in rows if r["step"] >= 50 and r["block_ids"])
            first["block_ids"] = [poisoned_id] * len(first["block_ids"])

    assert replay_trace(_rewritten(reader, tmp_path / "same")).clean
    findings = replay_trace(_rewritten(reader, tmp_path / "poisoned", poison)).findings
    first = findings[0]
    assert (first.kind, first.mechanism) == (MALFORMED, "block-table:block-id-out-of-pool")
    assert first.step >= 50 and first.block_id == poisoned_id


@pytest.mark.parametrize(
    "table, column, value, message",
    [
        ("block_tables", "group", 5, "names group 5 of the 'v1' table, but the run has 1"),
        ("block_tables", "group", -1, "names group -1"),
        ("block_tables", "table", "input", "names group 0 of the 'input' table"),
        ("launches", "kernel", "bogus", "names kernel 'bogus', which is none of"),
    ],
)
def test_a_group_table_or_kernel_the_run_lacks_is_one_sentence(
    tmp_path, table: str, column: str, value, message: str
) -> None:
    """Once an IndexError or KeyError (exit 70), and group -1 silently replayed as the last
    group: now exit 3 and one sentence naming the damage. Control: the copy unchanged."""
    from tests.conftest import assert_one_sentence_error, run_cli

    reader = _small_clean_trace(tmp_path)

    def damage(name, rows):
        if name == table:
            rows[len(rows) // 2][column] = value

    _rewritten(reader, tmp_path / "same")
    assert run_cli("replay", str(tmp_path / "same"), "--no-save").returncode == 0
    _rewritten(reader, tmp_path / "bad", damage)
    err = assert_one_sentence_error(run_cli("replay", str(tmp_path / "bad"), "--no-save"), 3)
    assert message in err and "the trace is damaged" in err, err


def test_a_trace_without_the_mamba_split_decodes_only_rows_past_their_prompt(
    tmp_path,
) -> None:
    """A GDN model's builder has no position split for the recorder to hook: its rows come
    without one. A row still prefilling then runs the prefill kernels, the others decode,
    and a clean run replays clean. Control: every row taken for a decode, as once, reads
    windows the prefills never had."""
    import pyarrow as pa

    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.minimize import load_memory, write_trace
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    src = tmp_path / "src"
    simulate(SimConfig(scenario="mixed", steps=300, seed=1, output=src).validate())

    def with_split(out, value: str | None) -> TraceReader:
        mem = load_memory(TraceReader(src))
        rows = mem.tables_["batch_rows"]
        i = rows.schema.get_field_index("mamba_split")
        field = rows.schema.field(i)
        column = pa.nulls(rows.num_rows, field.type)
        if value is not None:
            column = pa.array([value] * rows.num_rows, field.type)
        mem.tables_["batch_rows"] = rows.set_column(i, field, column)
        write_trace(mem, out, mem.manifest)
        return TraceReader(out)

    assert replay_trace(TraceReader(src)).clean
    assert replay_trace(with_split(tmp_path / "unrecorded", None)).clean
    assert not replay_trace(with_split(tmp_path / "all-decode", "decode")).clean


def test_checkpoints_let_a_replay_start_mid_trace(tmp_path) -> None:
    """A replay resumed from a cached checkpoint reports what a replay from step 0 reports."""
    import shutil

    from mgtrace.replayer.checkpoint import cache_dir
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    simulate(
        SimConfig(
            steps=400, seed=1, bugs=("reorder-threshold-mismatch",), output=out, max_num_seqs=16
        ).validate()
    )
    reader = TraceReader(out)
    full = replay_trace(reader, RuleSet(), checkpoint_every=64)
    cached = sorted(cache_dir(reader, "as-recorded", "compact").glob("*.npz"))
    assert len(cached) == 6  # steps 64, 128, ..., 384
    ran: list[int] = []
    resumed = replay_trace(reader, RuleSet(), from_step=300, progress=ran.append)
    assert sum(ran) == 400 - 256  # resumed after the checkpoint taken after step 255
    shutil.rmtree(out / ".replay-cache")
    uncached = replay_trace(TraceReader(out), RuleSet(), from_step=300)
    # the same report either way, over the window's steps
    assert resumed.steps == uncached.steps == 100
    assert (resumed.findings, resumed.repeats) == (uncached.findings, uncached.repeats)
    # a request's first finding in the whole replay is its first in the window too
    late = {(f.step, f.req_id, f.signature) for f in full.findings if f.step >= 300}
    assert late and late <= {(f.step, f.req_id, f.signature) for f in resumed.findings}


def test_the_checkpoint_cache_outlives_saved_findings_and_damage(tmp_path) -> None:
    """Findings saved into the trace leave the cache valid (the key covers what a replay
    reads); a damaged checkpoint file is a miss, removed, and the next older one serves; a
    window's findings never replace the whole replay's. Controls: the cache is hit before
    any of this, and the resumed findings equal the full replay's."""
    from mgtrace.replayer.checkpoint import cache_dir
    from tests.conftest import run_cli

    out = tmp_path / "t"
    simulate_small(out)
    base = ("replay", str(out), "--json")
    assert run_cli(*base, "--checkpoint-every", "64").returncode == 1  # saves its findings
    whole = _findings_by_replay(out)
    assert len(whole) == 1
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.schemas.reader import TraceReader

    def replayed_from_300() -> int:
        ran: list[int] = []
        replay_trace(TraceReader(out), RuleSet(), from_step=300, progress=ran.append)
        return sum(ran)

    assert replayed_from_300() == 400 - 256  # a hit, findings saved or not
    cached = sorted(cache_dir(TraceReader(out), "as-recorded", "compact").glob("*.npz"))
    damaged = next(f for f in cached if f.stem.endswith("step000000255"))  # the one it used
    damaged.write_bytes(damaged.read_bytes()[:100])
    resumed = run_cli(*base, "--from-step", "300", "--no-save")
    assert resumed.returncode == 1, resumed.stderr
    assert json.loads(resumed.stdout)["steps"] == 100  # the window's, whatever the cache held
    assert not damaged.exists()
    assert replayed_from_300() == 400 - 192  # the next older one
    # a file that is no archive: said in the reader's first sentence, without numpy's advice
    # to load pickles unsafely
    older = next(f for f in cached if f.stem.endswith("step000000191"))
    older.write_bytes(b"\x80\x04 not a checkpoint")
    resumed = run_cli(*base, "--from-step", "300", "--no-save")
    assert "damaged replay checkpoint was removed" in resumed.stderr, resumed.stderr
    assert "allow_pickle" not in resumed.stderr and not older.exists()
    # a window saves under its own id: the whole replay's findings stay as they were
    assert run_cli(*base, "--from-step", "300").returncode == 1
    after = _findings_by_replay(out)
    assert len(after) == 2 and set(whole.items()) <= set(after.items())


def test_a_damaged_checkpoint_that_cannot_be_removed_is_a_miss(tmp_path, monkeypatch, caplog):
    """In a cache this user cannot write, a damaged checkpoint is skipped, not removed (nor
    said to be), and the replay goes on from the next older one."""
    import logging
    import pathlib

    from mgtrace.replayer.checkpoint import cache_dir
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.schemas.reader import TraceReader

    out = tmp_path / "t"
    simulate_small(out)
    replay_trace(TraceReader(out), RuleSet(), checkpoint_every=64)
    cached = sorted(cache_dir(TraceReader(out), "as-recorded", "compact").glob("*.npz"))
    damaged = next(f for f in cached if f.stem.endswith("step000000255"))
    damaged.write_bytes(damaged.read_bytes()[:100])
    unlink = pathlib.Path.unlink

    def refuse(self, missing_ok=False):
        if self == damaged:  # what a read-only directory says (root is never told so)
            raise PermissionError(13, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    ran: list[int] = []
    with caplog.at_level(logging.WARNING, logger="mgtrace"):
        result = replay_trace(TraceReader(out), RuleSet(), from_step=300, progress=ran.append)
    assert sum(ran) == 400 - 192 and not result.clean  # the next older one served
    assert damaged.exists()
    assert "skipped" in caplog.text and "removed" not in caplog.text.replace(
        "cannot be removed", ""
    )


def test_a_window_over_the_whole_trace_saves_as_the_whole_trace(tmp_path) -> None:
    """--from-step 0 and a --to-step at or past the last step replace the whole replay's
    findings instead of adding a second copy; a real window still saves apart."""
    from mgtrace.replayer.cli import replay_id_for
    from tests.conftest import run_cli

    whole = replay_id_for(RuleSet())
    assert replay_id_for(RuleSet(), 0, None) == whole
    assert replay_id_for(RuleSet(), 0, 399, last_step=399) == whole
    assert replay_id_for(RuleSet(), None, 5000, last_step=399) == whole
    assert replay_id_for(RuleSet(), 1, None, last_step=399) != whole
    assert replay_id_for(RuleSet(), 0, 398, last_step=399) != whole
    out = tmp_path / "t"
    simulate_small(out)
    assert run_cli("replay", str(out)).returncode == 1
    saved = _findings_by_replay(out)
    for window in (("--from-step", "0"), ("--to-step", "399"), ("--to-step", "900")):
        assert run_cli("replay", str(out), *window).returncode == 1
        assert _findings_by_replay(out) == saved, window
    assert run_cli("replay", str(out), "--to-step", "398").returncode == 1
    assert len(_findings_by_replay(out)) == 2  # control: a window saves under its own id


def test_rules_and_a_flag_that_disagree_are_a_usage_error(tmp_path) -> None:
    from mgtrace.replayer.cli import rules_from_options
    from tests.conftest import assert_one_sentence_error, run_cli

    with pytest.raises(UsageError, match=r"reorder_threshold=1\+k .* --reorder-threshold sets 2"):
        rules_from_options({"reorder_threshold": "2"}, "reorder_threshold=1+k")
    # the same value twice, or a flag for a rule --rules leaves out, is fine
    same = rules_from_options({"reorder_threshold": "1+K"}, "reorder-threshold=1+k")
    assert same == RuleSet.parse("reorder_threshold=1+k")
    both = rules_from_options({"bt_row_is_req": "true"}, "reorder_threshold=1+k")
    assert both == RuleSet.parse("bt_row_is_req=true,reorder_threshold=1+k")
    args = ("--rules", "reorder_threshold=1+k", "--reorder-threshold=2")
    proc = run_cli("replay", str(tmp_path / "nope"), *args)
    assert "--reorder-threshold sets 2" in assert_one_sentence_error(proc, 2)


def simulate_small(out) -> None:
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    simulate(
        SimConfig(
            steps=400, seed=1, bugs=("reorder-threshold-mismatch",), output=out, max_num_seqs=16
        ).validate()
    )


def _findings_by_replay(trace) -> dict[str, tuple[int, int]]:
    """replay id -> (findings, first step)."""
    from mgtrace.schemas.reader import TraceReader

    con = TraceReader(trace).connect()
    rows = con.execute(
        "SELECT replay_id, count(*), min(step) FROM findings GROUP BY replay_id"
    ).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def _batch(
    num_scheduled: list[int],
    num_computed: list[int],
    num_prompt: list[int],
    num_draft: list[int] | None = None,
):
    from mgtrace.replayer.steps import StepBatch

    cols = {
        "num_scheduled": np.array(num_scheduled, dtype=np.int32),
        "num_computed": np.array(num_computed, dtype=np.int32),
        "num_prompt": np.array(num_prompt, dtype=np.int32),
        "num_draft": np.array(num_draft or [0] * len(num_scheduled), dtype=np.int32),
    }
    return StepBatch(0, np.arange(1, len(num_scheduled) + 1, dtype=np.int32), cols)


@pytest.mark.unit
def test_v2_rule_splits_the_sorted_batch_at_its_threshold() -> None:
    from mgtrace.replayer.view import split_under_threshold

    # V2's order: two spec decodes (1+k = 4 tokens), two plain decodes, a prefill chunk
    batch = _batch([4, 4, 1, 1, 700], [90, 80, 50, 40, 0], [10, 10, 10, 10, 2000], [3, 3, 0, 0, 0])
    assert split_under_threshold(batch, 4, 3, runner="v2").tolist() == [0, 0, 0, 0, 1]
    # at threshold 1 the builder's split stops at the first row: everything is a prefill
    assert split_under_threshold(batch, 1, 3, runner="v2").tolist() == [1, 1, 1, 1, 1]
    # control: V1 reorders at 1 (plain decodes to the front) and splits at 1+k: all decode
    assert split_under_threshold(batch, 1, 3, runner="v1").tolist() == [0, 0, 0, 0, 1]


@pytest.mark.unit
def test_v1_rule_splits_at_the_recorded_builder_threshold() -> None:
    from mgtrace.replayer.view import split_under_threshold

    # k = 3 with a builder that takes 1+2k = 7 tokens per decode (parallel drafting)
    batch = _batch([7, 7, 1, 700], [90, 80, 50, 0], [10, 10, 10, 2000])
    assert split_under_threshold(batch, 7, 3, builder_threshold=7).tolist() == [0, 0, 0, 1]
    # control: without the recorded builder threshold the split falls back to 1+k = 4
    assert split_under_threshold(batch, 7, 3).tolist() == [1, 1, 1, 1]


@pytest.mark.unit
def test_v1_rule_at_the_recorded_threshold_keeps_the_recorded_rows() -> None:
    from mgtrace.replayer.view import row_view

    # a chunk continuation ahead of a spec decode: what a runner at threshold 1 can leave
    batch = _batch([700, 4], [900, 90], [2000, 10], [0, 3])
    batch.cols["is_prefill_split"] = np.array([1, 1], dtype=np.int8)
    for name in ("batch_row", "req_slot", "state_col", "prev_state_col", "accepted_prev"):
        batch.cols[name] = np.array([0, 1], dtype=np.int32)
    for name in ("accepted", "checkpoint_tokens", "checkpoint_col"):
        batch.cols[name] = np.array([1, 1], dtype=np.int32)
    asked: list[int] = []

    def rebuilt(threshold: int) -> np.ndarray:
        asked.append(threshold)
        return np.array([1, 0])  # the rebuilt rows put the decode first

    def view(rule: str) -> list[int]:
        rules = RuleSet({"reorder_threshold": rule})
        got = row_view(batch, rules, recorded_threshold=1, k=3, persistent_order=rebuilt)
        return got.prefill_split.astype(int).tolist()

    assert view("1") == [1, 1] and asked == []  # the recorded order, as recorded
    assert view("1+k") == [1, 0] and asked == [4]  # control: another threshold rebuilds


def _reorder_pair(tmp_path):
    """The same run with the runner's reorder at 1+k (clean) and at 1 (the drafter's
    backend lowers it): one schedule, two row orders."""
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    shape = dict(steps=400, seed=1, max_num_seqs=16)
    clean, low = tmp_path / "clean", tmp_path / "low"
    simulate(SimConfig(output=clean, **shape).validate())  # type: ignore[arg-type]
    truth = simulate(
        SimConfig(output=low, bugs=("reorder-threshold-mismatch",), **shape).validate()  # type: ignore[arg-type]
    ).ground_truth["bugs"]["reorder-threshold-mismatch"]
    return TraceReader(clean), TraceReader(low), truth


def test_v1_rebuilt_rows_at_the_recorded_threshold_are_the_recorded_order(tmp_path) -> None:
    from mgtrace.replayer.requests import RequestIds
    from mgtrace.replayer.steps import RankTrace

    clean, low, _ = _reorder_pair(tmp_path)
    for reader, threshold in ((clean, 4), (low, 1)):
        trace = RankTrace(reader, 0, RequestIds())
        for step in trace.step_numbers.tolist():
            order = trace.persistent_order(step, threshold)
            assert order is not None
            assert order.tolist() == list(range(len(order))), (threshold, step)


def test_v1_rule_below_the_recorded_threshold_finds_what_that_engine_corrupts(tmp_path) -> None:
    """A V1 reorder starts from the persistent rows every earlier reorder left. Reordering
    a batch recorded at 1+k again at 1 keeps its spec decodes ahead of the chunked prefills
    (both are long extends at 1), so the clean run replayed clean under threshold 1, while
    the same run with the runner at 1 sends decodes into the Mamba prefill split."""
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.rules import RuleSet

    clean, low, truth = _reorder_pair(tmp_path)
    assert truth["first_step"] is not None
    lowered = replay_trace(clean, RuleSet({"reorder_threshold": "1"})).findings
    assert lowered, "the lowered threshold corrupted nothing"
    first = min(f.step for f in lowered)
    assert first == truth["first_step"]
    corrupted = {f.req_id for f in lowered if f.step == first}
    assert corrupted == set(truth["first_requests"])
    # control: the recorded run at threshold 1 finds the same first step
    assert min(f.step for f in replay_trace(low).findings) == first


@pytest.mark.unit
def test_v2_rule_sorts_an_older_order_again() -> None:
    """Older vLLMs sorted a V2 batch by token count alone, which can put a short prefill
    chunk ahead of a spec decode; the rule sorts by today's key (drafts first) first."""
    from mgtrace.replayer.view import split_under_threshold

    # by count: a plain decode, a 3-token prefill chunk, a spec decode (k = 3)
    batch = _batch([1, 3, 4], [50, 6, 90], [10, 100, 10], [0, 0, 3])
    assert split_under_threshold(batch, 4, 3, runner="v2").tolist() == [0, 1, 0]
    # control: split where the rows stand, the spec decode behind the chunk is a prefill
    assert batch.cols["num_scheduled"].tolist() == [1, 3, 4]
    from mgtrace.sim.reorder import mamba_split

    c = batch.cols
    assert mamba_split(c["num_scheduled"], c["num_computed"], c["num_prompt"], 4) == 1


def test_the_python_api_saves_a_whole_trace_window_as_the_whole_trace(tmp_path) -> None:
    """`Trace.replay(to_step=<past the end>, save=True)` added a second copy of the whole
    replay's findings. Control: a real window still saves apart."""
    from mgtrace.api import Trace

    out = tmp_path / "t"
    simulate_small(out)
    Trace(out).replay(save=True)
    saved = _findings_by_replay(out)
    Trace(out).replay(to_step=900, save=True)
    assert _findings_by_replay(out) == saved
    Trace(out).replay(to_step=398, save=True)
    assert len(_findings_by_replay(out)) == 2


# ---------------------------------------------------------------- inputs that lose a state
def _sim(tmp_path, name: str, **engine):
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / name
    simulate(SimConfig(output=out, **engine).validate())
    return TraceReader(out)


def test_a_post_process_that_skips_a_boundary_copy_is_found_where_it_skips_it(tmp_path) -> None:
    """A post-process row whose own num_computed is one too many no longer sees the block
    boundary its batch row crosses, so the kernel skips the copy the prefix cache keeps.
    The replay once checked the boundary only where the kernel copied, and passed it."""
    from mgtrace.replayer.loop import replay_trace

    block = 16
    reader = _sim(tmp_path, "src", scenario="mixed", steps=120, seed=3, k=3, mamba_block_size=block)
    brows = {(r["step"], r["batch_row"]): r for r in reader.table("batch_rows").to_pylist()}

    def crosses_at_its_running_state(launch) -> bool:
        # The running state itself sits on the boundary (no bias), in a column before the
        # running one: one more computed token and the kernel sees no boundary at all.
        if launch["kernel"] != "postprocess" or launch["req_slot"] < 0:
            return False
        r = brows[(launch["step"], launch["batch_row"])]
        running = r["num_computed"] + r["num_scheduled"] - r["num_draft"]
        return (
            r["accepted"] is not None
            and r["num_draft"] > 0
            and running % block == 0
            and (running + r["accepted"] - 1) // block == running // block
        )

    target = next(
        x for x in reader.table("launches").to_pylist() if crosses_at_its_running_state(x)
    )

    def skip_the_copy(name, rows):
        if name == "launches":
            hit = next(r for r in rows if r == target)
            hit["num_computed"] += 1

    assert replay_trace(_rewritten(reader, tmp_path / "same")).clean
    findings = replay_trace(_rewritten(reader, tmp_path / "lost", skip_the_copy)).findings
    assert findings, "the lost copy went unreported"
    first = findings[0]
    assert first.step == target["step"] and first.batch_row == target["batch_row"]
    assert first.mechanism.startswith("cached-state:")


def test_a_v2_input_block_table_that_is_not_its_source_row_is_malformed(tmp_path) -> None:
    """V2's forward takes its state indices from the gathered input tables: an input row
    whose running column names another block than its request's source row was never
    compared (the replay follows the source rows) and replayed clean."""
    from mgtrace.replayer.findings import MALFORMED
    from mgtrace.replayer.loop import replay_trace

    reader = _sim(tmp_path, "src", runner="v2", scenario="mixed", steps=80, seed=3)
    brows = {(r["step"], r["batch_row"]): r for r in reader.table("batch_rows").to_pylist()}
    tables = reader.table("block_tables").to_pylist()
    target = next(t for t in tables if t["table"] == "input" and t["step"] >= 40 and t["block_ids"])
    col = brows[(target["step"], target["row"])]["state_col"]
    other = next(
        t["block_ids"][col]
        for t in tables
        if t["table"] == "input"
        and len(t["block_ids"]) > col
        and t["block_ids"][col] not in (0, target["block_ids"][col])
    )

    def point_elsewhere(name, rows):
        if name == "block_tables":
            hit = next(r for r in rows if r == target)
            hit["block_ids"][col] = other

    assert replay_trace(_rewritten(reader, tmp_path / "same")).clean
    findings = replay_trace(_rewritten(reader, tmp_path / "bad", point_elsewhere)).findings
    assert findings, "the input row was not compared with its source row"
    first = findings[0]
    assert (first.kind, first.mechanism) == (MALFORMED, "block-table:input-not-source")
    assert (first.step, first.batch_row, first.block_id) == (target["step"], target["row"], other)


@pytest.mark.unit
def test_a_deferred_boundary_copy_into_a_block_its_request_just_freed_is_its_own(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V2 with pipeline parallelism runs step T's post-process at the start of step T+pp.
    When T's accepted tokens cross a block boundary, that post-process saves the state into
    the boundary block; the scheduling of T+pp has freed that block (the request moved past
    it) and may hand it to another request, whose use comes after, in T+pp's forward. The
    replay called this a foreign write on a clean simulation. Control: judged against the
    owners after the step's scheduling, the same trace gives that finding, and only for such
    copies: each written block was the writer's and went to its new owner at that step."""
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.oracle import Oracle
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        runner="v2", scenario="mixed", k=3, seed=1, steps=1000, mamba_block_size=64, pp=3,
        async_scheduling=False, max_num_seqs=16, num_blocks=40, output=out,
    )  # fmt: skip
    simulate(cfg.validate())
    assert replay_trace(TraceReader(out), RuleSet()).findings == []

    check_writes = Oracle.check_writes

    def after_scheduling(self, step, what, group, blocks, uid, rows, owned_until_now=None):
        return check_writes(self, step, what, group, blocks, uid, rows)

    monkeypatch.setattr(Oracle, "check_writes", after_scheduling)
    found = replay_trace(TraceReader(out), RuleSet()).findings
    assert found and {(f.kind, f.mechanism) for f in found} == {
        ("foreign_block_write", "postprocess-copy")
    }
    # freed uncached blocks are reused next, so such hand-overs happen at several steps
    given: dict[tuple[str, int], list[int]] = {}
    for row in TraceReader(out).table("sched").to_pylist():
        for block in (row["new_block_ids"] or [[]])[0]:
            given.setdefault((row["req_id"], block), []).append(row["step"])
    for f in found:
        assert f.writer_step == f.step and f.step in given[(f.req_id, f.block_id)], f.detail
        assert min(given[(f.writer_req_id, f.block_id)]) < f.step, f.detail


@pytest.mark.unit
def test_a_deferred_post_process_of_a_request_finished_at_its_step_writes_its_own_block(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deferred post-process of step T still runs for a request whose T result finished
    it (vLLM's worker frees its slot only after it), while the scheduler has already freed
    the request's blocks and may hand one to a running request of T+pp as a fresh block,
    which that request writes before it reads. The replay took the finished request's
    release after the sched row that took the block, so it called the write a foreign one.
    Control: without the blocks a finished request let go, each finding is such a write."""
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        runner="v2", scenario="pairs", k=2, seed=4, steps=400, mamba_block_size=16, pp=2,
        length_scale=0.2, async_scheduling=False, output=out,
    )  # fmt: skip
    simulate(cfg.validate())
    assert replay_trace(TraceReader(out), RuleSet()).findings == []

    apply = BlockOwnership.apply

    def let_go_of_nothing(self, *args) -> list:
        apply(self, *args)
        return []

    monkeypatch.setattr(BlockOwnership, "apply", let_go_of_nothing)
    found = replay_trace(TraceReader(out), RuleSet()).findings
    assert found and {(f.kind, f.mechanism) for f in found} == {
        ("foreign_block_write", "postprocess-copy")
    }
    given: dict[tuple[str, int], set[int]] = {}
    finished: set[tuple[str, int]] = set()
    for row in TraceReader(out).table("sched").to_pylist():
        if row["kind"] == "finished":
            finished.add((row["req_id"], row["step"]))
        for block in (row["new_block_ids"] or [[]])[0]:
            given.setdefault((row["req_id"], block), set()).add(row["step"])
    for f in found:
        assert (f.writer_req_id, f.step) in finished, f.detail
        assert min(given[(f.writer_req_id, f.block_id)]) < f.step, f.detail
        assert f.step in given[(f.req_id, f.block_id)], f.detail


@pytest.mark.parametrize(("runner", "pp"), [("v1", 1), ("v2", 2)])
def test_a_resumed_request_may_start_from_another_requests_cached_state(
    tmp_path, monkeypatch: pytest.MonkeyPatch, runner: str, pp: int
) -> None:
    """A preempted request lets go of every block, and on resume vLLM looks the prefix cache
    up for it like a new one: it may start from a boundary state another request of its
    family wrote. The replay took a prefix share as legal only before a request's first
    write, so it called that read a foreign one. Control: without the start-over on a
    resumed row, each finding is such a read."""
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.oracle import Oracle
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        scenario="steady", runner=runner, pp=pp, k=3, seed=2, steps=600, max_num_seqs=24,
        mamba_block_size=16, length_scale=0.2, num_blocks=40, output=out,
    )  # fmt: skip
    simulate(cfg.validate())
    assert replay_trace(TraceReader(out), RuleSet()).findings == []

    monkeypatch.setattr(Oracle, "start_over", lambda self, uids: None)
    found = replay_trace(TraceReader(out), RuleSet()).findings
    hits = {
        (r["req_id"], r["step"])
        for r in TraceReader(out).table("sched").to_pylist()
        if r["kind"] == "resumed" and r["num_computed"]
    }
    assert found and {(f.kind, f.mechanism.split(":")[0]) for f in found} == {
        ("foreign_state", "prefill-read")
    }
    for f in found:
        assert (f.req_id, f.step) in hits and f.writer_req_id != f.req_id, f.detail


@pytest.mark.parametrize(
    "runner, mixer", [("v1", "mamba2"), ("v2", "mamba2"), ("v1", "gdn"), ("v2", "gdn")]
)
def test_a_decode_count_its_rows_do_not_mark_is_malformed(
    tmp_path, runner: str, mixer: str
) -> None:
    """steps.num_mamba_decodes was never compared with the rows' split: a step whose builder
    counts one decode fewer than its rows mark (the engine's metadata disagreeing with
    itself) replayed clean. Control: a count past the rows of an all-decode step is padded
    rows, and the copy unchanged replays clean."""
    from mgtrace.replayer.findings import MALFORMED
    from mgtrace.replayer.loop import replay_trace

    reader = _sim(tmp_path, "src", runner=runner, mixer=mixer, scenario="mixed", steps=120, seed=3)
    splits: dict[int, list[str]] = {}
    for r in reader.table("batch_rows").to_pylist():
        splits.setdefault(r["step"], []).append(r["mamba_split"])
    mixed = min(s for s, rows in splits.items() if s >= 40 and {"decode", "prefill"} <= set(rows))
    padded = [s for s, rows in splits.items() if set(rows) == {"decode"}]

    def recount(name, rows):
        if name == "steps":
            for r in rows:
                if r["step"] == mixed:
                    r["num_mamba_decodes"] -= 1
                elif padded and r["step"] == padded[0]:
                    r["num_mamba_decodes"] += 1

    assert replay_trace(_rewritten(reader, tmp_path / "same")).clean
    findings = replay_trace(_rewritten(reader, tmp_path / "bad", recount)).findings
    assert findings, "the decode count was never compared with the rows' split"
    assert {(f.step, f.kind, f.mechanism) for f in findings} == {
        (mixed, MALFORMED, "steps:num-decodes-mismatch")
    }


def test_a_padded_row_whose_gather_leaves_the_table_is_malformed(tmp_path) -> None:
    """A padded row of a CUDA-graph batch gathers its state indices like any row: a
    sequence length whose columns lie past the block table was read as "no block" and
    passed clean."""
    from mgtrace.replayer.findings import MALFORMED
    from mgtrace.replayer.loop import replay_trace

    reader = _sim(tmp_path, "src", scenario="pairs", steps=200, seed=2)
    target = next(
        x for x in reader.table("launches").to_pylist() if x["kernel"] == "aligned_indices"
    )

    def far_past_the_table(name, rows):
        if name == "launches":
            hit = next(r for r in rows if r == target)
            hit["seq_len"] = 10**6

    assert replay_trace(_rewritten(reader, tmp_path / "same")).clean
    findings = replay_trace(_rewritten(reader, tmp_path / "bad", far_past_the_table)).findings
    assert findings, "the padded row's gather went unchecked"
    first = findings[0]
    assert (first.kind, first.mechanism) == (MALFORMED, "aligned_indices:state_col")
    assert (first.step, first.batch_row) == (target["step"], target["batch_row"])


# ---------------------------------------------------------------- repeated findings
@pytest.mark.parametrize("bug", ["stale-condense-row", "reorder-threshold-mismatch"])
def test_repeats_counted_before_their_wording_match_the_full_report(
    tmp_path, monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    """The oracle counts a repeat of a finding it already reported before wording it; the
    findings and repeat counts are those of wording every occurrence and letting the report
    drop the repeats."""
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.oracle import Oracle
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    simulate(SimConfig(scenario="pairs", steps=300, seed=0, bugs=(bug,), output=out).validate())
    reader = TraceReader(out)
    fast = replay_trace(reader)
    assert fast.repeats > 0, "control: the bug repeats its findings"
    monkeypatch.setattr(Oracle, "_repeated", lambda self, uid, signature: False)
    full = replay_trace(reader)
    assert fast.findings == full.findings
    assert fast.repeats == full.repeats


def test_a_bad_rows_finding_code_is_the_first_that_holds_and_names_its_mechanism() -> None:
    from mgtrace.replayer.oracle import _CONV_FINDINGS, _TEMPORAL_FINDINGS, _finding_codes

    unwritten = np.array([True, False, False, False])
    foreign = np.array([True, True, False, False])
    ahead = np.array([True, True, True, False])
    assert _finding_codes(unwritten, foreign, ahead, np.arange(4)) == [0, 1, 2, 3]
    assert _finding_codes(unwritten, foreign, ahead, np.array([3, 0])) == [3, 0]
    decode = 0  # READ_KINDS[0]
    assert [m for _, m, _ in _TEMPORAL_FINDINGS[decode]] == [
        "decode-read:temporal:unwritten",
        "decode-read:temporal",
        "decode-read:temporal:ahead",
        "decode-read:temporal:behind",
    ]
    assert _CONV_FINDINGS[3][1] == (
        "foreign_state",
        "cached-state:conv",
        "foreign_state:cached-state:conv",
    )
    assert [k for k, _, _ in _CONV_FINDINGS[1]] == [
        "wrong_tokens",
        "foreign_state",
        "wrong_tokens",
        "wrong_tokens",
    ]


def test_in_flight_at_start_leaves_out_arrivals_in_a_gap() -> None:
    """A request first seen running after a gap may have arrived in it: it is no sign that
    the recording began mid-run. A hole at the first step is a late start, which is one.
    Control: without a hole both running requests count."""
    from mgtrace.replayer.steps import in_flight_at_start
    from mgtrace.schemas.tables import SCHED_KINDS

    new, cached = SCHED_KINDS.index("new"), SCHED_KINDS.index("cached")
    uids, kinds = np.array([1, 2, 3]), np.array([cached, new, cached])
    steps = np.array([5, 5, 9])
    assert in_flight_at_start(uids, kinds) == 2
    assert in_flight_at_start(uids, kinds, steps, hole=7) == 1  # request 3 came after it
    assert in_flight_at_start(uids, kinds, steps, hole=5) == 2  # no step before it: a late start


def test_a_verdict_names_a_stand_in_writer_as_the_replay_does() -> None:
    """A foreign read whose writer was a padded row made the verdict say "written by request
    <padded row>" (the replay says "a padded row"). Control: a request writer is named as a
    request, and a foreign write keeps its wording."""
    from mgtrace.replayer.bisect import _describe
    from mgtrace.replayer.findings import FOREIGN_BLOCK_WRITE, FOREIGN_STATE
    from mgtrace.replayer.requests import PADDED_ROW, SCHEDULER

    read = {"kind": FOREIGN_STATE, "req_id": "req-7", "writer_step": 115}
    said = _describe({**read, "writer_req_id": PADDED_ROW})
    assert said == "request req-7 reads state written by a padded row at step 115"
    said = _describe({**read, "writer_req_id": "req-3"})
    assert said == "request req-7 reads state written by request req-3 at step 115"
    write = {"kind": FOREIGN_BLOCK_WRITE, "req_id": "req-7"}
    assert _describe({**write, "writer_req_id": SCHEDULER}) == (
        "the scheduler writes a block of request req-7"
    )
    assert _describe({**write, "writer_req_id": PADDED_ROW}) == (
        "a padded row writes a block of request req-7"
    )
