"""The V2 block tables in a recording, against vLLM's real ``BlockTables`` on the CPU (0.33, 0.34).

The real class is built with its UVA buffers on plain CPU memory (pinned memory needs an
accelerator), and driven as the V2 runner drives it: ``append_block_ids`` for new and
growing requests, ``apply_staged_writes`` (vLLM's write kernel), ``gather_block_tables``
(``_gather_block_tables_kernel``), both interpreted by Triton, and a dummy run's
``get_dummy_block_tables`` between steps. The recorder's hooks see only the calls' CPU
arguments; the ``source`` and ``input`` rows it writes must rebuild, step by step, exactly
the memory the real object holds, read independently by the test.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.peer

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from mgtrace.recorder import features, hooks_v2  # noqa: E402
from mgtrace.recorder.patches import PatchSet  # noqa: E402
from mgtrace.recorder.session import Session  # noqa: E402
from mgtrace.schemas.manifest import RunMetadata, StateLayout  # noqa: E402
from mgtrace.schemas.reader import TraceReader  # noqa: E402

MAMBA_GROUPS = [0, 2]  # KV-cache groups 0 and 2 are Mamba; group 1 (attention) is not recorded
NUM_GROUPS = 3
SLOTS = 8
WIDTH = 12


@dataclass
class Step:
    """One engine step: block writes (slot, ids per KV-cache group, overwrite), the batch
    in order (request slots), the padded request count, and a dummy run before it."""

    writes: list[tuple[int, tuple[list[int], ...], bool]]
    batch: list[int]
    padded: int
    dummy_before: int | None = None


def _ids(g0: list[int], g2: list[int]) -> tuple[list[int], ...]:
    return (g0, [900 + b for b in g0], g2)  # group 1's ids must never reach the trace


# Slot reuse with fewer blocks (a stale tail in the source row), a batch that shrinks (padded
# rows zeroed, input rows keeping a longer row's tail) and a dummy run that zeroes rows.
STEPS = [
    Step([(7, _ids([11, 12, 13], [21, 22]), True), (6, _ids([14], [23, 24, 25]), True)], [7, 6], 4),
    Step([(7, _ids([15], [26]), False), (5, _ids([16, 17], [27]), True)], [7, 6, 5], 3),
    Step([(6, _ids([30], [31]), True)], [5, 6], 2),
    Step([(5, _ids([18], []), False)], [6, 5], 2, dummy_before=1),
    Step([(4, _ids([40, 41], [42]), True)], [4], 1),
]


@pytest.fixture
def block_tables(monkeypatch: pytest.MonkeyPatch) -> Any:
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.v1.worker.gpu.block_table import BlockTables

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    return BlockTables([16] * NUM_GROUPS, SLOTS, 64, [WIDTH] * NUM_GROUPS, torch.device("cpu"))


def _input_batch(batch: list[int]) -> SimpleNamespace:
    """What the prepare_inputs hook reads of an InputBatch (one decode token per row)."""
    n = len(batch)
    return SimpleNamespace(
        num_reqs=n,
        req_ids=[f"req-{s}" for s in batch],
        idx_mapping_np=np.asarray(batch, dtype=np.intp),
        num_computed_tokens_np=np.full(n, 40, np.int32),
        num_scheduled_tokens=np.ones(n, np.int32),
        num_draft_tokens_per_req=None,
        is_prefilling_np=np.zeros(n, bool),
        prefill_len_np=np.full(n, 8, np.int32),
    )


def _snapshot(bt: Any) -> dict[str, Any]:
    """The real object's memory after the step's gather, read by the test."""
    return {
        "source": [bt.block_tables[g].gpu.numpy().copy() for g in range(NUM_GROUPS)],
        "input": [bt.input_block_tables[g].numpy().copy() for g in range(NUM_GROUPS)],
        "num_blocks": bt.num_blocks.np.copy(),
    }


def record(
    bt: Any,
    out: Path,
    steps: list[Step] = STEPS,
    run: RunMetadata | None = None,
    launch: Any = None,
    assembler: str | None = None,
) -> list[dict[str, Any]]:
    """Drive the real object through ``steps`` with the V2 hooks installed; the truth of
    every step as the object held it."""
    owners, missing = features.resolve_all(features.V2_TARGETS)
    assert missing == []
    sess = Session(out, rank=0, kind="v2", run=run or RunMetadata(runner="v2"), assembler=assembler)
    patches = PatchSet()
    patches.install(hooks_v2.v2_patches(sess, owners, MAMBA_GROUPS))
    truths = []
    try:
        for step in steps:
            if step.dummy_before is not None:
                sess.end_step()  # a dummy run is not a step
                bt.get_dummy_block_tables(step.dummy_before)
            sess.begin_step(None)
            for slot, ids, overwrite in step.writes:
                bt.append_block_ids(slot, ids, overwrite=overwrite)
            bt.apply_staged_writes()
            hooks_v2._inputs_after(sess, None, _input_batch(step.batch), (), {})
            idx = torch.tensor(step.batch, dtype=torch.int64)
            bt.gather_block_tables(idx, num_reqs_padded=step.padded)
            if launch is not None:
                launch(sess, step)
            truths.append(_snapshot(bt))
            sess.step_done()  # where the runner's sample_tokens ends the step
    finally:
        patches.remove()
    assert sess.close()["complete"]
    return truths


def recorded_tables(trace: Path, steps: int) -> list[dict[str, list[np.ndarray]]]:
    """Per step, the tables the trace's rows rebuild: a row's ids, zeros after them."""
    rows = []
    for part in sorted((trace / "block_tables").glob("*.parquet")):
        rows += pq.read_table(part).to_pylist()
    tables = {
        k: [np.zeros((SLOTS, WIDTH), np.int32) for _ in MAMBA_GROUPS] for k in ("source", "input")
    }
    out = []
    for step in range(steps):
        for r in (r for r in rows if r["step"] == step):
            row = tables[r["table"]][r["group"]][r["row"]]
            row[:] = 0
            row[: len(r["block_ids"])] = r["block_ids"]
        out.append({k: [t.copy() for t in ts] for k, ts in tables.items()})
    return out


def mismatches(
    recorded: list[dict[str, list[np.ndarray]]],
    truths: list[dict[str, Any]],
    kind: str,
    groups: list[int] = MAMBA_GROUPS,
) -> list[str]:
    """Every (step, group, row) where the recorded table differs from the real memory."""
    bad = []
    for step, (mine, truth) in enumerate(zip(recorded, truths, strict=True)):
        for local, gid in enumerate(groups):
            diff = np.flatnonzero((mine[kind][local] != truth[kind][gid]).any(axis=1))
            bad += [f"step {step} {kind} group {local} row {r}" for r in diff.tolist()]
    return bad


def gather_by_spec(
    source: np.ndarray,
    num_blocks: np.ndarray,
    idx_mapping: list[int],
    previous: np.ndarray,
    num_rows: int,
) -> np.ndarray:
    """``_gather_block_tables_kernel`` as its source reads, row by row: num_blocks entries of
    source row idx_mapping[b] into row b, the rest of row b as it was; rows from num_reqs to
    num_rows zeroed."""
    out = previous.copy()
    for b, slot in enumerate(idx_mapping):
        count = int(num_blocks[slot])
        out[b, :count] = source[slot, :count]
    out[len(idx_mapping) : num_rows] = 0
    return out


@pytest.fixture
def recording(block_tables: Any, tmp_path: Path) -> tuple[list[dict[str, Any]], list[Any]]:
    truths = record(block_tables, tmp_path / "v2")
    return truths, recorded_tables(tmp_path / "v2", len(STEPS))


def test_source_rows_rebuild_the_real_per_slot_tables(recording: Any, tmp_path: Path) -> None:
    truths, recorded = recording
    assert mismatches(recorded, truths, "source") == []
    assert "block_table_unseen_columns" not in TraceReader(tmp_path / "v2").manifest.errors
    # the scenario is not trivial: a reused slot keeps its earlier request's ids past its
    # new num_blocks, and the tables change from step to step
    assert truths[2]["num_blocks"][0, 6] == 1 and truths[2]["source"][0][6, 1] == 0
    assert truths[2]["source"][2][6, :3].tolist() == [31, 24, 25]
    assert mismatches(recorded[1:], truths[:-1], "source") != []
    # failing control: the wrong KV-cache groups (the attention group 1 in place of 2)
    assert mismatches(recorded, truths, "source", groups=[0, 1]) != []


def test_thread_assembly_records_the_same_tables(recording: Any, tmp_path: Path) -> None:
    """The in-process fallback assembles the same rows as the assembler process."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    # a fresh object (the fixture's was driven already); its buffers stay on the CPU
    fresh = BlockTables([16] * NUM_GROUPS, SLOTS, 64, [WIDTH] * NUM_GROUPS, torch.device("cpu"))
    truths = record(fresh, tmp_path / "thread", assembler="thread")
    in_thread = recorded_tables(tmp_path / "thread", len(STEPS))
    assert mismatches(in_thread, truths, "source") == []
    assert mismatches(in_thread, truths, "input") == []
    in_process = recording[1]
    assert all(
        (mine == theirs).all()
        for step_a, step_b in zip(in_thread, in_process, strict=True)
        for kind in ("source", "input")
        for mine, theirs in zip(step_a[kind], step_b[kind], strict=True)
    )


def test_input_rows_equal_the_real_gather_kernel_and_the_spec(recording: Any) -> None:
    truths, recorded = recording
    assert mismatches(recorded, truths, "input") == []  # the real Triton kernel's output
    previous = [np.zeros((SLOTS, WIDTH), np.int32) for _ in MAMBA_GROUPS]
    dirty = 0
    wrong_ok = []
    for step, (spec, mine, truth) in enumerate(zip(STEPS, recorded, truths, strict=True)):
        for local, gid in enumerate(MAMBA_GROUPS):
            if spec.dummy_before is not None:  # get_dummy_block_tables zeroes these rows
                previous[local][: max(spec.dummy_before, dirty)] = 0
            num_rows = max(spec.padded, dirty if spec.dummy_before is None else spec.dummy_before)
            counts = truth["num_blocks"][gid]
            want = gather_by_spec(
                mine["source"][local], counts, spec.batch, previous[local], num_rows
            )
            assert (mine["input"][local] == want).all(), (step, local)
            wrong = gather_by_spec(
                mine["source"][local], counts, spec.batch[::-1], previous[local], num_rows
            )
            wrong_ok.append((mine["input"][local] == wrong).all())
            previous[local] = mine["input"][local].copy()
        dirty = len(spec.batch)
    # failing control: a deliberately wrong idx_mapping (the batch reversed) must disagree
    assert not all(wrong_ok)
    # the kernel leaves a longer row's tail past num_blocks: step 2's row 0 (slot 5, two
    # blocks) still holds slot 7's third block from step 1
    assert truths[2]["input"][0][0, :3].tolist() == [16, 17, 13]
    # padded rows of a shrinking batch are zeroed, and so are the rows a dummy run cleared
    assert not truths[2]["input"][0][2:].any() and truths[3]["input"][0][0, 2] == 0


def _as_real(table: np.ndarray) -> np.ndarray:
    """A replayed table in the real table's shape (the replay sizes its own to the trace);
    what it holds past that shape must be zeros."""
    out = np.zeros((SLOTS, WIDTH), np.int32)
    rows, width = min(table.shape[0], SLOTS), min(table.shape[1], WIDTH)
    out[:rows, :width] = table[:rows, :width]
    assert not table[SLOTS:].any() and not table[:, WIDTH:].any()
    return out


RUN = RunMetadata(
    runner="v2",
    num_speculative_tokens=1,
    max_num_seqs=SLOTS,
    num_blocks=64,
    num_mamba_groups=len(MAMBA_GROUPS),
    states=[
        StateLayout(group, 0, kind, shape, "float32")
        for group in range(len(MAMBA_GROUPS))
        for kind, shape in (("conv", [3, 4]), ("temporal", [2, 2]))
    ],
)


def test_the_replay_loop_rebuilds_the_real_tables(block_tables: Any, tmp_path: Path) -> None:
    """A replay of the recorded steps, through the replay loop itself, holds at every step
    the tables the real object held: the rows need nothing the replayer does not read."""
    from mgtrace.kernels.reference import run_reference
    from mgtrace.replayer.loop import RankReplay
    from mgtrace.replayer.requests import RequestIds
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.replayer.steps import RankTrace
    from mgtrace.schemas.reader import TraceReader

    truths = record(block_tables, tmp_path / "v2", run=RUN)
    trace = RankTrace(TraceReader(tmp_path / "v2"), 0, RequestIds())
    replay = RankReplay(trace, RuleSet(), run_reference)
    replayed = []
    for step in range(len(STEPS)):
        replay.step(step)
        replayed.append({k: [_as_real(t) for t in ts] for k, ts in replay.tables.tables.items()})
    assert replay.oracle.findings == []
    assert mismatches(replayed, truths, "source") == []
    assert mismatches(replayed, truths, "input") == []
    # failing control: a replay that kept its first step's tables
    assert mismatches(replayed[:1] * len(STEPS), truths, "input") != []


def test_launches_name_the_table_their_pointers_point_at(block_tables: Any, tmp_path: Path) -> None:
    """The bound table comes from the context's block-table pointers compared with the
    tables' data_ptrs, not from the context's class: a two-table context bound to the
    gathered input tables (an older runner's binding) is recorded as reading ``input``."""
    steps = [Step([(5, _ids([30, 31], [32, 33]), True)], [5], 1)]
    launch = _precopy_from_col(0, _ptrs(block_tables, "input"))
    record(block_tables, tmp_path / "input", steps, launch=launch)
    assert _launch_tables(tmp_path / "input") == {(5, "input", "req_slot")}
    assert "bound_table_unmatched" not in TraceReader(tmp_path / "input").manifest.errors
    # failing control: pointers that match neither table set are counted, and the launch
    # keeps what the class implies
    steps = [Step([(5, _ids([30, 31], [32, 33]), True)], [5], 1)]
    launch = _precopy_from_col(0, [1, 2])
    record(block_tables, tmp_path / "neither", steps, launch=launch)
    assert _launch_tables(tmp_path / "neither") == {(5, "source", "req_slot")}
    assert TraceReader(tmp_path / "neither").manifest.errors["bound_table_unmatched"]["count"] == 1


def test_columns_written_before_recording_began_read_as_unknown(
    block_tables: Any, tmp_path: Path
) -> None:
    """Recording attached to a running engine: a slot that grows (its write starts past
    column 0) or that only runs (no write at all) holds -1 where ids were written unseen,
    and the manifest counts each such row."""
    from mgtrace.schemas.reader import TraceReader

    block_tables.append_block_ids(3, _ids([60, 61, 62], [63]), overwrite=True)  # not recorded
    block_tables.append_block_ids(2, _ids([70, 71], [72]), overwrite=True)  # not recorded
    block_tables.apply_staged_writes()
    steps = [Step([(3, _ids([64], [65]), False)], [3, 2], 2)]
    truths = record(block_tables, tmp_path / "v2", steps)
    recorded = recorded_tables(tmp_path / "v2", 1)[0]
    assert recorded["source"][0][3, :5].tolist() == [-1, -1, -1, 64, 0]
    assert recorded["source"][1][3, :3].tolist() == [-1, 65, 0]
    assert recorded["source"][0][2, :3].tolist() == [-1, -1, 0]
    assert recorded["input"][1][:2, :3].tolist() == [[-1, 65, 0], [-1, 0, 0]]
    errors = TraceReader(tmp_path / "v2").manifest.errors
    assert errors["block_table_unseen_columns"]["count"] == 4  # 2 slots x 2 groups
    # the real memory holds the unseen ids there: exactly those rows differ
    assert sorted(mismatches([recorded], truths, "source")) == [
        f"step 0 source group {g} row {r}" for g in (0, 1) for r in (2, 3)
    ]


def _precopy_from_col(src_col: int, bound: list[int] | None = None) -> Any:
    """A V2 precopy launch, recorded through the launcher hook, that copies every batch
    row's state from column ``src_col`` to the next column of its block-table row; its
    context has the class shape of a two-table (source-bound) context and, given
    ``bound``, those block-table pointers."""
    from mgtrace.recorder import hooks_common

    ctx = SimpleNamespace(is_initialized=True, aligned_index_block_table_ptrs=None)
    if bound is not None:
        ctx.block_table_ptrs = torch.tensor(bound, dtype=torch.int64)

    def launch(sess: Session, step: Step) -> None:
        slots = torch.zeros(SLOTS, dtype=torch.int32)
        idx = torch.tensor(step.batch, dtype=torch.int32)
        args = (ctx, len(step.batch), slots + src_col + 1, slots + src_col, slots, idx)
        hooks_common._precopy(sess, args, {})

    return launch


def _ptrs(bt: Any, kind: str) -> list[int]:
    tables = bt.block_tables if kind == "source" else bt.input_block_tables
    return [
        (t.gpu if kind == "source" else t).data_ptr() for t in (tables[g] for g in MAMBA_GROUPS)
    ]


def _launch_tables(trace: Path) -> set[tuple[int, str, str]]:
    launches = pq.read_table(trace / "launches").to_pylist()
    return {(r["req_slot"], r["bt_table"], r["row_rule"]) for r in launches}


def _malformed_reads(trace: Path) -> list[str]:
    """The replay's findings of block ids read out of range, by step and request (the
    launches here copy between fixed columns, whatever the batch rows' counts say: that they
    are not the rows' own columns is a finding of its own, not one of these)."""
    from mgtrace.replayer.findings import MALFORMED
    from mgtrace.replayer.loop import replay_trace

    found = replay_trace(TraceReader(trace), backend="reference").findings
    return [
        f"{f.step} {f.req_id} {f.mechanism}"
        for f in found
        if f.kind == MALFORMED and f.mechanism.endswith(":block_id")
    ]


def test_the_replay_copies_through_the_recorded_source_rows(
    block_tables: Any, tmp_path: Path
) -> None:
    """A recorded precopy bound to the source tables reads its blocks, in the replay, from
    the rows the trace recorded: columns written before recording began (-1) are reported
    as malformed reads; the same launch over rows the recording saw whole is clean."""
    block_tables.append_block_ids(2, _ids([50, 51], [52]), overwrite=True)  # not recorded
    block_tables.apply_staged_writes()
    steps = [Step([(5, _ids([30, 31], [32, 33]), True)], [5, 2], 2)]
    launch = _precopy_from_col(0, _ptrs(block_tables, "source"))
    record(block_tables, tmp_path / "v2", steps, run=RUN, launch=launch)
    assert _launch_tables(tmp_path / "v2") == {(5, "source", "req_slot"), (2, "source", "req_slot")}
    assert _malformed_reads(tmp_path / "v2") == ["0 req-2 precopy:block_id"]
    # control: the same launch, recorded anew, where every column it reads was written
    # while recording (slot 4 in place of slot 2)
    writes = [(5, _ids([30, 31], [32, 33]), True), (4, _ids([34, 35], [36, 37]), True)]
    clean = [Step(writes, [5, 4], 2)]
    launch = _precopy_from_col(0, _ptrs(block_tables, "source"))
    record(block_tables, tmp_path / "clean", clean, run=RUN, launch=launch)
    assert _malformed_reads(tmp_path / "clean") == []


def test_a_vllm_without_append_block_ids_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.worker.gpu.block_table import BlockTables

    label = "vllm.v1.worker.gpu.block_table:BlockTables.append_block_ids"
    assert label not in features.resolve_all(features.V2_TARGETS)[1]
    monkeypatch.delattr(BlockTables, "append_block_ids")
    assert label in features.resolve_all(features.V2_TARGETS)[1]
