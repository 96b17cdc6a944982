"""Whole-block copies the scheduler queues (vLLM 0.33's copy-on-write of partially hit prefix
blocks, ``SchedulerOutput.kv_cache_block_copies``): recorded in ``steps`` and replayed before
the step's kernels, so a request that starts on the private copy reads the cached state."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from mgtrace.recorder.step_tables import _step_columns
from mgtrace.recorder.wire import Packer, Unpacker
from mgtrace.replayer.loop import RankReplay, load_backend, replay_trace
from mgtrace.replayer.minimize import MemoryTrace, load_memory, write_trace
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.manifest import Manifest
from mgtrace.schemas.reader import TraceReader
from tests.replay_helpers import set_root, sim_trace


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("copies"))


def _scheduler_output(copies: list | None) -> SimpleNamespace:
    return SimpleNamespace(
        total_num_scheduled_tokens=4,
        num_scheduled_tokens={"a": 4},
        scheduled_spec_decode_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["a"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[8]
        ),
        finished_req_ids=set(),
        preempted_req_ids=set(),
        kv_cache_block_copies=copies,
    )


def test_copies_travel_to_the_steps_table() -> None:
    from collections import namedtuple

    copy = namedtuple("KVCacheBlockCopy", "src_block_id dst_block_id")
    packer, unpacker = Packer(), Unpacker()
    for copies, expected in (
        ([copy(7, 12), copy(3, 40)], ([[7, 3]], [[12, 40]])),
        (None, (None, None)),
        ([], (None, None)),
    ):
        so = unpacker.record(packer.record({"so": _scheduler_output(copies)}))["so"]
        cols = _step_columns({"so": so, "wall_ns": 0}, 1)
        assert (cols["block_copy_src"], cols["block_copy_dst"]) == expected


def _with_private_copy(reader: TraceReader, *, queue_copy: bool) -> MemoryTrace:
    """The trace with one prefix-hit request moved onto a private copy of the cached block
    it starts from (a block added to the pool), as a partial hit's copy-on-write does;
    ``queue_copy``: whether the step also carries the copy. Write it with ``_grown``."""
    trace = load_memory(reader)
    t = trace.tables_
    block = reader.manifest.run.mamba_block_size
    req = next(r for r in t["requests"].to_pylist() if (r["prefix_hit_tokens"] or 0) >= block)
    rid, col = req["req_id"], req["prefix_hit_tokens"] // block - 1
    private = reader.manifest.run.num_blocks  # one more block than the engine had
    slots = {
        (r["step"], r["req_slot"])
        for r in t["batch_rows"].select(["step", "req_id", "req_slot"]).to_pylist()
        if r["req_id"] == rid
    }
    first = min(s for s, _ in slots)
    rows = t["block_tables"].to_pylist()
    cached = None
    for r in rows:
        if (r["step"], r["row"]) in slots and len(r["block_ids"]) > col:
            cached = cached or r["block_ids"][col]
            if r["block_ids"][col] == cached:
                r["block_ids"][col] = private
    assert cached and cached != private
    t["block_tables"] = pa.Table.from_pylist(rows, schema=t["block_tables"].schema)
    sched = t["sched"].to_pylist()
    for r in sched:
        if r["req_id"] == rid and r["kind"] == "new":
            r["new_block_ids"] = [
                [private if b == cached else b for b in g] for g in r["new_block_ids"]
            ]
    t["sched"] = pa.Table.from_pylist(sched, schema=t["sched"].schema)
    if queue_copy:
        steps = t["steps"].to_pylist()
        for r in steps:
            if r["step"] == first:
                r["block_copy_src"], r["block_copy_dst"] = [cached], [private]
        t["steps"] = pa.Table.from_pylist(steps, schema=t["steps"].schema)
    trace.first_step_of_request = first  # type: ignore[attr-defined]
    trace.request = rid  # type: ignore[attr-defined]
    return trace


def _grown(manifest: Manifest) -> Manifest:
    return replace(manifest, run=replace(manifest.run, num_blocks=manifest.run.num_blocks + 1))


def test_a_private_copy_of_a_cached_block_replays_clean(tmp_path: Path) -> None:
    reader = TraceReader(sim_trace(None, 3, 600, scenario="pairs", length_scale=0.05))
    assert replay_trace(reader, RuleSet()).clean
    copied = _with_private_copy(reader, queue_copy=True)
    write_trace(copied, tmp_path / "copied", _grown(reader.manifest))
    result = replay_trace(TraceReader(tmp_path / "copied"), RuleSet())
    assert result.clean, [f.detail for f in result.findings[:3]]
    # control: the same move without the copy reads a block nobody wrote
    bare = _with_private_copy(reader, queue_copy=False)
    write_trace(bare, tmp_path / "bare", _grown(reader.manifest))
    blind = replay_trace(TraceReader(tmp_path / "bare"), RuleSet())
    assert blind.first_step == bare.first_step_of_request  # type: ignore[attr-defined]
    assert {f.req_id for f in blind.findings if f.step == blind.first_step} == {bare.request}  # type: ignore[attr-defined]


def test_a_copy_naming_no_block_is_malformed(tmp_path: Path) -> None:
    reader = TraceReader(sim_trace(None, 3, 600, scenario="pairs", length_scale=0.05))
    trace = load_memory(reader)
    steps = trace.tables_["steps"].to_pylist()
    steps[5]["block_copy_src"], steps[5]["block_copy_dst"] = (
        [0, 2],
        [reader.manifest.run.num_blocks],
    )
    trace.tables_["steps"] = pa.Table.from_pylist(steps, schema=trace.tables_["steps"].schema)
    write_trace(trace, tmp_path / "bad", reader.manifest)
    result = replay_trace(TraceReader(tmp_path / "bad"), RuleSet())
    assert [f.signature for f in result.findings if f.step == steps[5]["step"]] == [
        "malformed:block-copy:bad-pair"
    ]
    assert np.all([f.step >= steps[5]["step"] for f in result.findings])


@pytest.mark.gpu
@pytest.mark.parametrize("mirror", [True, False])
def test_block_copies_on_the_gpu(tmp_path: Path, mirror: bool) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reader = TraceReader(sim_trace(None, 3, 600, scenario="pairs", length_scale=0.05))
    for queue_copy, name in ((True, "copied"), (False, "bare")):
        trace = _with_private_copy(reader, queue_copy=queue_copy)
        write_trace(trace, tmp_path / name, _grown(reader.manifest))
    on_gpu = {"backend": "triton", "device": "cuda", "mirror": mirror}
    assert replay_trace(TraceReader(tmp_path / "copied"), RuleSet(), **on_gpu).clean
    bare = TraceReader(tmp_path / "bare")
    cpu, gpu = replay_trace(bare, RuleSet()), replay_trace(bare, RuleSet(), **on_gpu)
    assert gpu.findings and [f.signature for f in gpu.findings] == [
        f.signature for f in cpu.findings
    ]


def _held_block(reader: TraceReader) -> tuple[int, str, int]:
    """(step, request, block): a block a live request has held for more than ten steps, taken
    from the replay's own ownership at that step."""
    rep = RankReplay(
        RankTrace(reader, 0, RequestIds()), RuleSet(), load_backend("reference", "cpu")
    )
    step = 100
    rep.run(until=step - 1)
    owner, since = rep.ownership.owner[0, : rep.ownership.num_blocks], rep.ownership.since[0]
    block = int(np.flatnonzero((owner > 0) & (since >= 0) & (since < step - 10))[0])
    return step, rep.trace.ids.name(int(owner[block])), block


def test_a_copy_onto_a_held_block_is_a_foreign_write(tmp_path: Path) -> None:
    reader = TraceReader(sim_trace(None, 3, 600, scenario="pairs", length_scale=0.05))
    step, victim, block = _held_block(reader)
    trace = load_memory(reader)
    steps = trace.tables_["steps"].to_pylist()
    at = next(r for r in steps if r["step"] == step)
    at["block_copy_src"], at["block_copy_dst"] = [reader.manifest.run.num_blocks - 1], [block]
    trace.tables_["steps"] = pa.Table.from_pylist(steps, schema=trace.tables_["steps"].schema)
    write_trace(trace, tmp_path / "onto-held", reader.manifest)
    result = replay_trace(TraceReader(tmp_path / "onto-held"), RuleSet())
    first = [f for f in result.findings if f.step == result.first_step]
    assert result.first_step == step
    # the copy is reported as it happens; the victim's next read of the overwritten state follows
    assert (first[0].signature, first[0].req_id, first[0].block_id) == (
        "foreign_block_write:block-copy",
        victim,
        block,
    )
    assert {f.req_id for f in first} == {victim}
    assert first[0].writer_req_id == "<scheduler>"
    # control: a copy onto the block the request is given in that step is its own
    copied = _with_private_copy(reader, queue_copy=True)
    write_trace(copied, tmp_path / "own", _grown(reader.manifest))
    assert replay_trace(TraceReader(tmp_path / "own"), RuleSet()).clean
