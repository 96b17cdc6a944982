"""The simulator's bulk hand-over to the writer records exactly what step-by-step writes do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pytest

from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import TraceWriter
from mgtrace.sim import SimConfig, simulate
from mgtrace.sim.columns import GroupIds, ReqIds
from mgtrace.sim.runner_common import Nullable
from mgtrace.sim.trace_buffer import StepBuffer

pytestmark = pytest.mark.unit

PER_STEP = [name for name, spec in TABLES.items() if spec.per_step]


def _rows(trace: Path) -> dict[str, Any]:
    """Every table's rows in (rank, step) order, rows of a step in the order written."""
    r = TraceReader(trace)
    out: dict[str, Any] = {}
    for name in [*PER_STEP, "requests"]:
        if not r.rows(name):
            continue
        t = r.table(name)
        if name in PER_STEP:
            # a stable sort: parts may split differently, the order within a step may not
            t = t.take(pc.sort_indices(t, [("rank", "ascending"), ("step", "ascending")]))
        out[name] = t.to_pylist()
    out["ground_truth"] = r.manifest.ground_truth
    out["drops"] = r.manifest.drops.total_steps
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(scenario="pairs", bugs=("async-accepted-race", "stale-condense-row")),
        dict(scenario="mixed", bugs=("reorder-threshold-mismatch",), async_scheduling=False),
        dict(scenario="pairs", runner="v2", pp=2, bugs=("batch-row-block-table",)),
        dict(scenario="steady", runner="v2", k=2),
    ],
    ids=["v1-race-stale", "v1-reorder-sync", "v2-pp2-batch-row", "v2-steady"],
)
def test_bulk_trace_equals_step_by_step_trace(tmp_path: Path, kw: dict[str, Any]) -> None:
    def run(name: str, steps_per_write: int) -> dict[str, Any]:
        cfg = SimConfig(steps=300, seed=2, length_scale=0.2, output=tmp_path / name, **kw)
        assert simulate(cfg, steps_per_write=steps_per_write).complete
        return _rows(tmp_path / name)

    single = run("single", 0)
    assert single["batch_rows"] and single["launches"] and single["sched"]
    # 7 does not divide 300: the last, partial buffer is flushed at the end
    for spw in (1, 7, 64):
        assert run(f"bulk{spw}", spw) == single, spw


def test_interrupted_bulk_trace_keeps_the_buffered_steps(tmp_path: Path) -> None:
    class Stop(Exception):
        pass

    def stop_at(step: int, _view: object) -> None:
        if step == 100:
            raise Stop

    def run(name: str, steps_per_write: int) -> dict[str, Any]:
        cfg = SimConfig(scenario="pairs", steps=300, length_scale=0.2, output=tmp_path / name)
        with pytest.raises(Stop):
            simulate(cfg, observe=stop_at, steps_per_write=steps_per_write)
        return _rows(tmp_path / name)

    single, bulk = run("single", 0), run("bulk", 64)
    assert bulk == single
    assert max(r["step"] for r in bulk["steps"]) == 100  # steps 64..100 were still buffered
    reader = TraceReader(tmp_path / "bulk")
    assert reader.manifest.source["interrupted_at_step"] == 100
    # the requests it had, as many as the manifest counts (once none were kept)
    assert reader.rows("requests") == reader.manifest.source["num_requests"] > 0


def test_buffer_joins_every_column_form(tmp_path: Path) -> None:
    """Arrays, Nullable, masked arrays, lists with None, scalars, None, category codes and
    strings, over chunks that give different columns: the same rows as write_step."""
    chunks = [
        {
            "kernel": "precopy",
            "batch_row": np.arange(3, dtype=np.int32),
            "batch_step": 0,
            "row_rule": np.array([0, 1, 0], np.int8),
            "bt_table": "v1",
            "num_accepted": Nullable(np.array([1, 2, 3], np.int32), np.array([0, 1, 0], bool)),
            "src_col": [4, None, 6],
        },
        {
            "kernel": "postprocess",
            "batch_row": np.arange(2, dtype=np.int32),
            "batch_step": None,
            "row_rule": ["batch_row", None],
            "mode": "decision",
            "num_accepted": np.ma.MaskedArray(np.array([7, 8], np.int32), [True, False]),
            "num_scheduled": np.array([4, 4]),
        },
        {
            "kernel": np.array([2], np.int8),
            "batch_row": np.array([9], np.int32),
            "batch_step": 1,
            "bt_table": "input",
            "seq_len": 1,
        },
    ]
    steps = {"num_reqs": 3, "accepted_landed": None}
    with TraceWriter(tmp_path / "single") as w:
        for s, chunk in enumerate(chunks):
            plain = {k: v.masked() if type(v) is Nullable else v for k, v in chunk.items()}
            w.write_step(
                0, s // 2, {"launches": plain, "steps": steps} if s != 1 else {"launches": plain}
            )
    with TraceWriter(tmp_path / "bulk") as w:
        buf = StepBuffer(w, steps_per_write=10)
        for s, chunk in enumerate(chunks):
            buf.add(0, s // 2, "launches", chunk)
            if s != 1:
                buf.add(0, s // 2, "steps", steps)
        buf.flush()
    single, bulk = TraceReader(tmp_path / "single"), TraceReader(tmp_path / "bulk")
    for name in ("launches", "steps"):
        assert single.table(name).to_pylist() == bulk.table(name).to_pylist(), name
    rows = bulk.table("launches").to_pylist()
    assert [r["num_accepted"] for r in rows] == [1, None, 3, None, 8, None]
    assert [r["row_rule"] for r in rows] == [
        "req_slot",
        "batch_row",
        "req_slot",
        "batch_row",
        None,
        None,
    ]
    assert [r["kernel"] for r in rows][-1] == "aligned_indices"


def test_buffer_joins_compact_columns(tmp_path: Path) -> None:
    """Request numbers and sparse block ids: the same rows as their plain lists through
    write_step, including a chunk without rows (an empty batch) last in the flush, a
    chunk without the block-id column, and a flush of empty chunks only."""
    names = np.array([f"req-{i}" for i in range(6)], dtype=object)
    grown = np.concatenate((names, np.array(["req-6", "req-7"], dtype=object)))
    chunks = [
        {
            "req_id": ReqIds(np.array([4, 2]), names),
            "kind": np.array([1, 1], np.int8),
            "new_block_ids": GroupIds(2, {1: [7, 8]}),
        },
        {
            "req_id": ReqIds(np.array([2, 7, 5]), grown),
            "kind": np.array([0, 1, 1], np.int8),
            "new_block_ids": GroupIds(3, {0: [9]}),
        },
        {"req_id": ReqIds(np.array([3]), grown), "kind": np.array([3], np.int8)},
        {
            "req_id": ReqIds(np.zeros(0, np.int64), np.empty(0, dtype=object)),
            "kind": np.zeros(0, np.int8),
            "new_block_ids": GroupIds(0, {}),
        },
    ]
    with TraceWriter(tmp_path / "single") as w:
        for s, chunk in enumerate(chunks):
            w.write_step(
                0, s, {"sched": {k: v.tolist() if k != "kind" else v for k, v in chunk.items()}}
            )
    with TraceWriter(tmp_path / "bulk") as w:
        buf = StepBuffer(w, steps_per_write=10)
        for s, chunk in enumerate(chunks):
            buf.add(0, s, "sched", chunk)
        buf.flush()
        buf.add(0, 4, "sched", chunks[-1])  # a flush of an empty batch only
        buf.flush()
    single, bulk = TraceReader(tmp_path / "single"), TraceReader(tmp_path / "bulk")
    assert single.table("sched").to_pylist() == bulk.table("sched").to_pylist()
    rows = bulk.table("sched").to_pylist()
    assert [r["req_id"] for r in rows] == ["req-4", "req-2", "req-2", "req-7", "req-5", "req-3"]
    assert [r["new_block_ids"] for r in rows] == [[[]], [[7, 8]], [[9]], [[]], [[]], None]


def test_buffer_joins_arrays_nullable_and_absent_columns(tmp_path: Path) -> None:
    """Numeric columns given as arrays, as ``Nullable`` and not at all (null rows) are joined
    in whole-buffer steps: the same rows as write_step, nulls where a mask or a missing
    column puts them (the control: a join that dropped the masks would give their values)."""
    chunks = [
        {"req_id": ["a", "b"], "kind": "cached", "num_prompt": np.array([5, 6], np.int32)},
        {
            "req_id": ["c", "d", "e"],
            "kind": "new",
            "num_prompt": Nullable(np.array([7, 8, 9], np.int32), np.array([0, 1, 0], bool)),
        },
        {"req_id": ["f"], "kind": "finished"},
        {"req_id": ["g"], "kind": "new", "num_prompt": np.array([10], np.int64)},
    ]
    with TraceWriter(tmp_path / "single") as w:
        for s, chunk in enumerate(chunks):
            plain = {k: v.masked() if type(v) is Nullable else v for k, v in chunk.items()}
            w.write_step(0, s, {"sched": plain})
    with TraceWriter(tmp_path / "bulk") as w:
        buf = StepBuffer(w, steps_per_write=10)
        for s, chunk in enumerate(chunks):
            buf.add(0, s, "sched", chunk)
        buf.flush()
    single, bulk = TraceReader(tmp_path / "single"), TraceReader(tmp_path / "bulk")
    assert single.table("sched").to_pylist() == bulk.table("sched").to_pylist()
    prompts = bulk.table("sched").column("num_prompt").to_pylist()
    assert prompts == [5, 6, 7, None, 9, None, 10]


def _single_and_bulk(tmp_path: Path, table: str, chunks: list[dict[str, Any]]) -> list[Any]:
    """The rows of ``chunks`` written step by step and through the buffer; asserts they are
    equal and returns the buffered ones."""
    with TraceWriter(tmp_path / "single") as w:
        for s, chunk in enumerate(chunks):
            w.write_step(0, s, {table: chunk})
    with TraceWriter(tmp_path / "bulk") as w:
        buf = StepBuffer(w, steps_per_write=10)
        for s, chunk in enumerate(chunks):
            buf.add(0, s, table, chunk)
        buf.flush()
    single = TraceReader(tmp_path / "single").table(table).to_pylist()
    bulk = TraceReader(tmp_path / "bulk").table(table).to_pylist()
    assert single == bulk
    return bulk


def test_buffer_keeps_a_scalar_category_outside_the_categories(tmp_path: Path) -> None:
    """One category string per chunk is coded in one pass; a value outside the categories
    sends the column over as strings, as write_step does (the control: coding it as an
    unknown code would read back as null)."""
    chunks = [
        {"kernel": "precopy", "batch_row": np.arange(2, dtype=np.int32), "mode": None},
        {"kernel": "not-a-kernel", "batch_row": np.arange(1, dtype=np.int32), "mode": "decision"},
    ]
    rows = _single_and_bulk(tmp_path, "launches", chunks)
    assert [r["kernel"] for r in rows] == ["precopy", "precopy", "not-a-kernel"]
    assert [r["mode"] for r in rows] == [None, None, "decision"]


@pytest.mark.parametrize("second", ["req-1", "req-2"])
def test_buffer_joins_scalar_strings(tmp_path: Path, second: str) -> None:
    """A string column given as one str per chunk: equal over the flush it stays one str,
    else one value per row; both read back as write_step wrote them."""
    chunks = [
        {"seq": np.arange(2, dtype=np.int32), "op": "swap", "req_id": "req-1"},
        {"seq": np.arange(1, dtype=np.int32), "op": "swap", "req_id": second},
    ]
    rows = _single_and_bulk(tmp_path, "row_moves", chunks)
    assert [r["req_id"] for r in rows] == ["req-1", "req-1", second]
