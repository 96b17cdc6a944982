"""Reads checked in bulk (as on a GPU) give the findings, in the order, of reads checked at
once; and the streamed Triton backend's check of its kernels' accepted counts can fire."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from mgtrace.replayer.loop import RankReplay, replay_trace
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate

CASES = [
    ("reorder-threshold-mismatch", {"runner": "v1", "scenario": "steady"}),
    ("async-accepted-race", {"runner": "v1", "scenario": "pairs"}),
    ("batch-row-block-table", {"runner": "v2", "pp": 2, "scenario": "mixed"}),
]


def _trace(tmp_path: Path, bug: str, engine: dict, steps: int = 300, seed: int = 1) -> TraceReader:
    out = tmp_path / "t"
    cfg = SimConfig(
        seed=seed,
        steps=steps,
        max_num_seqs=32,
        length_scale=0.3,
        bugs=(bug,),
        output=out,
        **engine,
    )
    simulate(cfg.validate())
    return TraceReader(out)


@pytest.mark.unit
@pytest.mark.parametrize(("bug", "engine"), CASES)
def test_deferred_reads_find_the_same(tmp_path: Path, bug: str, engine: dict) -> None:
    reader = _trace(tmp_path, bug, engine)
    now = replay_trace(reader, RuleSet(), defer_reads=False)
    later = replay_trace(reader, RuleSet(), defer_reads=True)
    assert now.findings, "control: the injected bug gives the oracle something to find"
    assert [asdict(f) for f in later.findings] == [asdict(f) for f in now.findings]
    assert later.repeats == now.repeats


@pytest.mark.unit
def test_deferred_reads_keep_report_order(tmp_path: Path) -> None:
    """Within one step, read findings checked at a later flush go back to where an
    immediate check would have put them among the write findings."""
    engine = {"runner": "v2", "pp": 2, "scenario": "mixed"}
    reader = _trace(tmp_path, "batch-row-block-table", engine, steps=400, seed=12)
    reps = []
    for defer in (False, True):
        rep = RankReplay(
            RankTrace(reader, 0, RequestIds()), RuleSet(), _reference(), defer_reads=defer
        )
        rep.flush_every = 1000  # one flush at the end: every read is deferred across steps
        rep.run()
        reps.append(rep)
    now, later = reps
    kinds = [f.kind for f in now.oracle.findings]
    reads = [i for i, k in enumerate(kinds) if k in ("foreign_state", "wrong_tokens")]
    # Control: a write finding comes after a read finding, so reporting deferred reads at
    # the end (without putting them back in place) would change the order.
    assert reads and any(k not in ("foreign_state", "wrong_tokens") for k in kinds[reads[0] :])
    assert later.oracle.findings == now.oracle.findings
    assert later.oracle.repeats == now.oracle.repeats


@pytest.mark.unit
def test_pool_through_torch_finds_the_same(tmp_path: Path) -> None:
    """The GPU's way to the tags (writes batched into one scatter, reads gathered into a
    log), run on the CPU: same findings as numpy indexing."""
    engine = {"runner": "v2", "pp": 2, "scenario": "mixed"}
    reader = _trace(tmp_path, "batch-row-block-table", engine, steps=400, seed=12)
    reps = []
    for torch_words in (False, True):
        rep = RankReplay(RankTrace(reader, 0, RequestIds()), RuleSet(), _reference())
        if torch_words:
            rep.pool.through_torch()
            rep.oracle.defer_reads = True
        rep.run()
        reps.append(rep)
    now, later = reps
    assert now.oracle.findings, "control: the injected bug gives the oracle something to find"
    assert later.oracle.findings == now.oracle.findings
    assert np.array_equal(later.pool.snapshot(), now.pool.snapshot())


@pytest.mark.unit
def test_batched_writes_keep_the_last_of_each_word() -> None:
    from mgtrace.kernels.pool import StatePool, StateSpec
    from mgtrace.replayer.tags import _IntView

    pool = StatePool([StateSpec(0, "temporal", (4,), "int32")], 4)
    words = _IntView(None, pool)
    words[np.array([1, 2, 1])] = np.array([10, 20, 30])
    words[np.array([2, 5])] = np.array([40, 50])
    assert pool.numpy().view(np.int32)[[1, 2, 5]].tolist() == [0, 0, 0]  # still waiting
    words.settle()
    assert pool.numpy().view(np.int32)[[1, 2, 5]].tolist() == [30, 40, 50]


def _reference():
    from mgtrace.kernels.reference import run_reference

    return run_reference


@pytest.mark.interp
def test_streamed_backend_checks_its_kernels(tmp_path: Path) -> None:
    from mgtrace.kernels.streamed import KernelDisagreement
    from mgtrace.replayer.loop import load_backend

    reader = _trace(
        tmp_path, "reorder-threshold-mismatch", {"runner": "v1", "scenario": "pairs"}, 60
    )
    backend = load_backend("triton", "cpu")
    rep = RankReplay(RankTrace(reader, 0, RequestIds()), RuleSet(), backend)
    rep.run(until=40)  # verified on the way: the kernels agree with the host decisions
    assert backend.launches > 0
    for step in range(41, 60):
        rep._step(step)
        if backend._host_counts:
            break
    assert backend._host_counts, "control: a post-process launch left counts to verify"
    backend._host_counts[-1] = np.asarray(backend._host_counts[-1]) + 1  # a wrong decision
    with pytest.raises(KernelDisagreement):
        backend.verify()


@pytest.mark.interp
def test_mirrored_pool_is_checked_against_the_kernels(tmp_path: Path) -> None:
    """The device copy that the Triton kernels move is compared with the host pool at every
    flush: a byte the kernels got wrong stops the replay, naming its block."""
    from mgtrace.kernels.streamed import KernelDisagreement
    from mgtrace.replayer.loop import load_backend

    reader = _trace(
        tmp_path, "reorder-threshold-mismatch", {"runner": "v1", "scenario": "pairs"}, 60
    )
    backend = load_backend("triton", "cpu")
    rep = RankReplay(RankTrace(reader, 0, RequestIds()), RuleSet(), backend)
    assert rep.mirror and rep.pool.device_pool is not None
    rep.run(until=40)  # flushed, so verified, on the way
    assert backend.launches > 0, "control: the kernels ran on the device copy"
    assert np.array_equal(rep.pool.device_pool.buffer.numpy(), rep.pool.snapshot())
    page = rep.pool.pool.page_bytes
    rep.pool.device_pool.buffer[7 * page + 1] += 1  # as if a kernel wrote a wrong byte
    with pytest.raises(KernelDisagreement, match="block 7 \\(byte 1 of its page\\)"):
        rep.flush()


@pytest.mark.unit
def test_mirror_needs_a_device_backend(tmp_path: Path) -> None:
    from mgtrace.errors import UsageError

    reader = _trace(tmp_path, "reorder-threshold-mismatch", {"runner": "v1"}, 20)
    with pytest.raises(UsageError, match="device backend"):
        RankReplay(RankTrace(reader, 0, RequestIds()), RuleSet(), _reference(), mirror=True)
