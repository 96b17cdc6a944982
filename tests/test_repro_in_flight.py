"""A repro cut from a run with steps in flight (async scheduling, a pipeline) starts where
the original stood: in its first steps align mode frees exactly the blocks the original's
replay freed at the same steps, which needs the tokens its requests had in flight at the
cut."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mgtrace.kernels.reference import run_reference
from mgtrace.replayer import checkpoint as ckpt
from mgtrace.replayer.loop import RankReplay
from mgtrace.replayer.minimize import MemoryTrace, load_memory, trim_prefix, write_trace
from mgtrace.replayer.ownership import steps_in_flight
from mgtrace.replayer.requests import NO_REQUEST
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate

ENGINES = {
    "v1-async": dict(runner="v1", async_scheduling=True),
    "v2-pp2-async": dict(runner="v2", pp=2, async_scheduling=True),
    "v2-pp3-async": dict(runner="v2", pp=3, async_scheduling=True),
}


def _owners_by_step(trace: MemoryTrace, until: int) -> dict[int, np.ndarray]:
    """Rank 0's block owners after each step up to ``until``."""
    ids, seed = ckpt.request_ids_for(trace)
    rep = RankReplay(RankTrace(trace, 0, ids), RuleSet(), run_reference)  # type: ignore[arg-type]
    start = ckpt.start_from(rep, seed)
    out = {}
    for step in range(start, until + 1):
        rep.run(start=step, until=step)
        out[step] = rep.ownership.snapshot()[0].copy()
    return out


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_repro_frees_what_the_original_freed_in_its_first_steps(
    tmp_path: Path, engine: str
) -> None:
    cfg = SimConfig(
        steps=160,
        seed=3,
        scenario="pairs",
        k=2,
        mamba_block_size=16,
        length_scale=0.2,
        output=tmp_path / "run",
    )
    for key, value in ENGINES[engine].items():
        setattr(cfg, key, value)
    simulate(cfg)
    whole = load_memory(TraceReader(tmp_path / "run"))
    assert steps_in_flight(whole.manifest.run) > 0
    checked = 0
    for first in (40, 90):
        original = _owners_by_step(whole, first + 3)
        cut = trim_prefix(whole, first, RuleSet())
        write_trace(cut, tmp_path / f"repro-{first}", whole.manifest)  # as minimize saves it
        repro = _owners_by_step(load_memory(TraceReader(tmp_path / f"repro-{first}")), 3)
        for step in range(4):
            assert np.array_equal(repro[step], original[first + step]), (first, step)
            checked += int(np.count_nonzero(original[first + step] != NO_REQUEST))
    assert checked  # the steps compared hold owned blocks


def test_a_repro_s_history_frees_what_the_original_s_does(tmp_path: Path) -> None:
    """``history``'s ``freed`` column of a repro cut from an async run: the same frees, at
    the same steps renumbered, as the original's, for every request running across the
    cut (the scheduler rows kept from before the cut are counted, not replayed again)."""
    import mgtrace

    trace = mgtrace.simulate(
        tmp_path / "run", runner="v1", async_scheduling=True, steps=160, seed=3,
        scenario="pairs", k=2,
    )  # fmt: skip
    first = 60
    write_trace(
        trim_prefix(load_memory(TraceReader(tmp_path / "run")), first, RuleSet()),
        tmp_path / "repro",
        trace.reader.manifest,
    )
    repro = mgtrace.open(tmp_path / "repro")
    across = [
        r for (r,) in repro.sql(
            "SELECT DISTINCT req_id FROM sched WHERE step = 0 AND kind = 'cached'"
        ).fetchall()
    ]  # fmt: skip

    def frees(t: mgtrace.Trace, req: str, shift: int) -> dict[int, str]:
        lines = t.history(req).to_pylist()
        return {v["step"] - shift: v["freed"] for v in lines if v["freed"] and v["step"] >= shift}

    compared = 0
    for req in across:
        # the scheduler rows kept from before the cut are context, not lines of the repro
        assert min(v["step"] for v in repro.history(req).to_pylist()) == 0, req
        cut = frees(repro, req, 0)
        assert cut == frees(trace, req, first), req
        compared += len(cut)
    assert compared  # the control: requests across the cut have blocks freed in the repro
