"""A recording that attached to a running engine: the requests then in flight, and prefix
hits on blocks written before it, read state whose writer no replay can know. Such reads
are left unchecked (and the summary says so); everything the trace saw written is judged
as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.replayer.coverage import mid_run_caveat
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.minimize import MemoryTrace, load_memory, write_trace
from mgtrace.replayer.steps import in_flight_at_start
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import SCHED_KINDS, TABLES
from mgtrace.sim.config import BUG_ASYNC_RACE, BUG_STALE_ROW, SimConfig
from mgtrace.sim.engine import simulate

STEP_COLUMNS = ("step", "batch_step", "bt_step", "postprocess_step")


def attached_at(src: Path, out: Path, first: int) -> Path:
    """``src`` as a recording attached at step ``first`` holds it: the steps from there on,
    numbered from 0, with every block-table row in full at the first step (a recorder
    writes a row it has not seen yet); the state pool before it is unknown."""
    mem = load_memory(TraceReader(src))
    bt = mem.tables_["block_tables"]
    rows: dict[tuple, dict] = {}
    for r in bt.filter(pc.less_equal(bt.column("step"), first)).to_pylist():
        rows[(r["rank"], r["group"], r["table"], r["row"])] = dict(r, step=first)
    tables = {}
    for name, tab in mem.tables_.items():
        if TABLES[name].per_step and tab.num_rows:
            if name == "block_tables":
                known = pa.Table.from_pylist(
                    [r for r in rows.values() if r["block_ids"]], tab.schema
                )
                later = tab.filter(pc.greater(tab.column("step"), first))
                tab = pa.concat_tables([known, later]).sort_by(
                    [(c, "ascending") for c in ("rank", "step", "group", "table", "row")]
                )
            tab = tab.filter(pc.greater_equal(tab.column("step"), first))
            for col in STEP_COLUMNS:
                if col in tab.column_names:
                    i = tab.column_names.index(col)
                    tab = tab.set_column(
                        i, tab.schema.field(i), pc.subtract(tab.column(col), first)
                    )
        tables[name] = tab
    write_trace(MemoryTrace(mem.manifest, tables), out, mem.manifest)
    return out


def _simulated(tmp: Path, name: str, **cfg: object) -> Path:
    out = tmp / name
    simulate(SimConfig(steps=400, seed=3, output=out, **cfg).validate())  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(
    "engine", [{}, {"runner": "v2"}, {"runner": "v2", "pp": 2}], ids=["v1", "v2", "v2-pp2"]
)
def test_a_clean_engine_recorded_mid_run_replays_clean(tmp_path: Path, engine: dict) -> None:
    """Every request in flight at the attach read "state no request has written" and was
    reported (wrong_tokens, exit 1) on a clean engine. Control: the whole run is clean."""
    whole = _simulated(tmp_path, "whole", **engine)
    assert replay_trace(TraceReader(whole)).clean and mid_run_caveat(TraceReader(whole)) is None
    cut = TraceReader(attached_at(whole, tmp_path / "cut", 120))
    result = replay_trace(cut)
    assert result.clean, result.findings[:3]
    caveat = mid_run_caveat(cut)
    assert caveat is not None and "began mid-run" in caveat


@pytest.mark.parametrize(
    ("bug", "first", "req_id"),
    [(BUG_STALE_ROW, 165, "req-000028"), (BUG_ASYNC_RACE, 116, "req-000020")],
)
def test_a_bug_after_the_attach_is_found_at_its_step(
    tmp_path: Path, bug: str, first: int, req_id: str
) -> None:
    """What the trace saw written is still judged: each bug's first corrupt step and request,
    shifted by the attach."""
    whole = tmp_path / "whole"
    simulate(SimConfig(scenario="pairs", steps=400, seed=0, bugs=(bug,), output=whole).validate())
    full = replay_trace(TraceReader(whole))
    assert full.first_step == first
    cut = replay_trace(TraceReader(attached_at(whole, tmp_path / "cut", 60)))
    assert cut.first_step == first - 60
    assert req_id in {f.req_id for f in cut.findings if f.step == cut.first_step}


def test_in_flight_at_start_counts_requests_whose_first_row_is_not_new() -> None:
    new, cached, finished = (SCHED_KINDS.index(k) for k in ("new", "cached", "finished"))
    ids = np.array([1, 2, 1, 3, 2])
    assert in_flight_at_start(ids, np.array([new, new, cached, new, finished])) == 0
    assert in_flight_at_start(ids, np.array([cached, new, cached, finished, new])) == 2
    assert in_flight_at_start(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0


@pytest.mark.parametrize(("bug", "attach"), [(BUG_STALE_ROW, 60), (BUG_STALE_ROW, 300)])
def test_writes_onto_blocks_of_requests_in_flight_at_the_attach_are_found(
    tmp_path: Path, bug: str, attach: int
) -> None:
    """A request already running at the attach had its blocks at columns 0, 1, ... of a row
    the replay knew nothing of, and align mode's frees released them at once: a padded row
    writing onto its running block went unreported (1 and 4 of the whole run's
    foreign_block_write findings after these attaches). Its row now comes from its own
    block-table row. And nothing is reported that the whole run does not report, at that
    step or before. Control: the whole run's findings."""
    whole = tmp_path / "whole"
    cfg = SimConfig(scenario="pairs", steps=1200, seed=0, bugs=(bug,), output=whole)
    simulate(cfg.validate())
    full = replay_trace(TraceReader(whole))
    cut = replay_trace(TraceReader(attached_at(whole, tmp_path / "cut", attach)))
    first_seen: dict[tuple, int] = {}
    for f in full.findings:
        key = (f.rank, f.req_id, f.signature)
        first_seen[key] = min(first_seen.get(key, f.step), f.step)
    writes = {
        (f.rank, f.req_id, f.signature)
        for f in full.findings
        if f.step >= attach and f.kind == "foreign_block_write"
    }
    assert writes, "the control: the whole run has such writes after the attach"
    assert writes <= {(f.rank, f.req_id, f.signature) for f in cut.findings}
    for f in cut.findings:  # no finding the whole run has not made by then
        assert first_seen.get((f.rank, f.req_id, f.signature), 1 << 30) <= f.step + attach, f
