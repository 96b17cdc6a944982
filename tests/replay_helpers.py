"""Simulated traces with known ground truth, shared by the replay, bisect and diff tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from mgtrace.replayer.findings import FOREIGN_BLOCK_WRITE
from mgtrace.replayer.minimize import MemoryTrace, load_memory, write_trace
from mgtrace.replayer.requests import is_request
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import (
    BUG_ASYNC_RACE,
    BUG_BATCH_ROW,
    BUG_REORDER,
    BUG_STALE_ROW,
    SimConfig,
)
from mgtrace.sim.engine import simulate

# Per toggle: the engine it needs, a scenario that triggers it early, and the rule undoing it.
TOGGLES = {
    BUG_REORDER: ({"runner": "v1", "scenario": "pairs"}, "reorder_threshold=1+k"),
    BUG_ASYNC_RACE: ({"runner": "v1", "scenario": "pairs"}, "accepted_source=cpu"),
    BUG_STALE_ROW: ({"runner": "v1", "scenario": "pairs"}, "clear_vacated_rows=true"),
    BUG_BATCH_ROW: ({"runner": "v2", "pp": 2, "scenario": "pairs"}, "bt_row_is_req=true"),
}

_ROOT: list[Path] = []


def set_root(path: Path) -> None:
    _ROOT[:] = [path]


@cache
def sim_trace(bug: str | None, seed: int, steps: int = 1500, **engine: object) -> Path:
    """A simulated trace, made once per test session for each distinct configuration."""
    tags = "-".join(f"{k}{v}" for k, v in sorted(engine.items()))
    name = f"{bug or 'clean'}-{seed}-{steps}-{tags}"
    out = _ROOT[0] / name
    cfg = SimConfig(steps=steps, seed=seed, bugs=(bug,) if bug else (), output=out, **engine)
    simulate(cfg.validate())
    return out


def toggle_trace(bug: str, seed: int, steps: int = 1500) -> Path:
    engine, _ = TOGGLES[bug]
    return sim_trace(bug, seed, steps, **engine)


# A V2 + PP2 run (small blocks, k=4) whose first misdirected post-process only loses the
# block-boundary state of its first requests, at step 13; with that check off, the loss
# shows only at step 49. The seed and length go with the engine.
BOUNDARY_ONLY_BUG = "batch-row-block-table"
BOUNDARY_ONLY_SEED, BOUNDARY_ONLY_STEPS = 1029, 60
BOUNDARY_ONLY = {
    "runner": "v2",
    "pp": 2,
    "k": 4,
    "max_num_seqs": 16,
    "mamba_block_size": 16,
    "acceptance_rate": 0.95,
    "prefix_hit_prob": 1.0,
}


def involved(findings, step: int) -> set[str]:
    """Requests named by the findings of one step: readers, and writers of foreign writes."""
    out = set()
    for f in findings:
        if f.step == step:
            out.add(f.req_id)
            if f.kind == FOREIGN_BLOCK_WRITE and is_request(f.writer_req_id):
                out.add(f.writer_req_id)  # a request, not a stand-in such as a padded row
    return out


class RewritingReader:
    """A trace reader that hands out some tables rewritten (``rewrite``), the rest as the
    trace holds them: damaged or reordered traces without writing one."""

    def __init__(self, reader: TraceReader) -> None:
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)

    def table(self, name: str, *args: Any, **kwargs: Any) -> pa.Table:
        return self.rewrite(name, self._reader.table(name, *args, **kwargs))

    def rewrite(self, name: str, table: pa.Table) -> pa.Table:
        return table


def with_steps_removed(src: Path, dst: Path, drop: set[int], *, complete: bool = True) -> Path:
    """A copy of the trace at ``src`` without the rows of the ``drop`` steps (a gap, as a
    recording that lost them has), marked complete or not."""
    mem = load_memory(TraceReader(src))
    tables = {}
    for name, t in mem.tables_.items():
        if "step" in t.column_names and name != "findings" and t.num_rows:
            dropped = pa.array(sorted(drop), type=t.schema.field("step").type)
            keep = pc.invert(pc.is_in(t.column("step"), value_set=dropped))
            t = t.filter(keep)
        tables[name] = t
    manifest = mem.manifest
    manifest.complete = complete
    write_trace(MemoryTrace(manifest, tables), dst, manifest)
    return dst
