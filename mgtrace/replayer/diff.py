"""`mgtrace diff`: the first step where two traces, or two rule sets on one trace, diverge.

Two traces are compared on their recorded inputs: per table, an order-independent hash of
each (rank, step)'s rows; the first step whose hashes differ, and in which tables.

Two rule sets on one trace are compared on their effects: both replays run in lockstep and
the first step after which their shadow states differ, or their oracles disagree, is reported,
with the blocks that differ and what each side's oracle said at that step. A rule can change
only what a request reads (the accepted count a decode picks its window column by) and leave
every block as the other side has it: the oracles tell those apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgtrace.replayer import checkpoint as ckpt
from mgtrace.replayer.loop import RankReplay, load_backend
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace, ranks_of, require_replayable
from mgtrace.schemas.reader import TraceReader

INPUT_TABLES = ("steps", "batch_rows", "launches", "block_tables", "sched", "row_moves")


@dataclass
class TraceDiff:
    first_step: int | None
    rank: int | None
    tables: list[str] = field(default_factory=list)  # tables that differ at that step
    only_in: str | None = None  # "a" or "b" when one trace simply has more steps

    def sentence(self, a: str, b: str) -> str:
        if self.first_step is None:
            return f"{a} and {b} record the same inputs at every step"
        if self.only_in is not None:
            side = a if self.only_in == "a" else b
            if self.first_step == 0:
                return f"only {side} has steps"
            return f"the traces agree up to step {self.first_step - 1}; only {side} goes on"
        return (
            f"the traces first differ at step {self.first_step} (rank {self.rank}) in "
            f"{', '.join(self.tables)}"
        )


def diff_traces(a: TraceReader, b: TraceReader) -> TraceDiff:
    per_table: dict[str, tuple[int, int]] = {}
    best: tuple[int, int] | None = None
    for name in INPUT_TABLES:
        ha, hb = _step_hashes(a, name), _step_hashes(b, name)
        keys = set(ha) | set(hb)
        diff = [k for k in keys if ha.get(k) != hb.get(k)]
        if diff:
            first = min(diff, key=lambda k: (k[1], k[0]))
            per_table[name] = first
            if best is None or (first[1], first[0]) < (best[1], best[0]):
                best = first
    if best is None:
        return TraceDiff(None, None)
    rank, step = best
    tables = [t for t, first in per_table.items() if first == best]
    steps_a, steps_b = _steps(a, rank), _steps(b, rank)
    only = None
    if step not in steps_a and step in steps_b:
        only = "b"
    elif step in steps_a and step not in steps_b:
        only = "a"
    return TraceDiff(step, rank, tables, only)


def _steps(reader: TraceReader, rank: int) -> set[int]:
    con = reader.connect()
    return {r[0] for r in con.execute("SELECT step FROM steps WHERE rank = ?", [rank]).fetchall()}


def _step_hashes(reader: TraceReader, table: str) -> dict[tuple[int, int], int]:
    con = reader.connect()
    rows = con.execute(
        f"SELECT rank, step, bit_xor(hash(*COLUMNS(* EXCLUDE (rank, step)))) "
        f"FROM {table} GROUP BY rank, step"
    ).fetchall()
    return {(int(r), int(s)): int(h) for r, s, h in rows}


@dataclass
class RulesDiff:
    first_step: int | None
    rank: int | None
    blocks: list[int] = field(default_factory=list)  # blocks whose tags differ (first few)
    findings_a: list[dict[str, Any]] = field(default_factory=list)
    findings_b: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0  # rank-steps replayed under each rule set
    ranks: int = 1

    def sentence(self, a: RuleSet, b: RuleSet) -> str:
        if self.first_step is None:
            steps = (
                f"{self.steps} steps"
                if self.ranks == 1
                else f"{self.steps} rank-steps ({self.ranks} ranks)"
            )
            return (
                f"{a.canonical()} and {b.canonical()} leave identical shadow state at every "
                f"one of {steps}"
            )
        where = f"{a.canonical()} and {b.canonical()} first diverge at step {self.first_step} "
        if not self.blocks:
            return where + f"(rank {self.rank}): the same state, read differently"
        shown = ", ".join(str(x) for x in self.blocks[:8])
        return where + f"(rank {self.rank}): blocks {shown} hold different state"


def diff_rules(
    reader: TraceReader, a: RuleSet, b: RuleSet, *, backend: str = "reference", device: str = "cpu"
) -> RulesDiff:
    require_replayable(reader)
    run = load_backend(backend, device)
    ids, seed = ckpt.request_ids_for(reader)
    ranks = ranks_of(reader)
    out = RulesDiff(None, None, ranks=len(ranks))
    for rank in ranks:
        trace = RankTrace(reader, rank, ids)
        ra = RankReplay(trace, a, run, device=device)
        rb = RankReplay(trace, b, run, device=device)
        ckpt.start_from(ra, seed)
        ckpt.start_from(rb, seed)
        for step in trace:
            if out.first_step is not None and step >= out.first_step:
                break
            seen_a, seen_b = len(ra.oracle.findings), len(rb.oracle.findings)
            ra.step(step)
            rb.step(step)
            out.steps += 1
            said_a = [_brief(f) for f in ra.oracle.findings[seen_a:]]
            said_b = [_brief(f) for f in rb.oracle.findings[seen_b:]]
            pa, pb = ra.pool.snapshot(), rb.pool.snapshot()
            same_state = np.array_equal(pa, pb)
            if same_state and _said(said_a) == _said(said_b):
                continue
            out.first_step, out.rank = step, rank
            if not same_state:
                page = ra.pool.pool.page_bytes
                size = ra.pool.pool.num_blocks * page
                differs = (pa[:size] != pb[:size]).reshape(-1, page).any(axis=1)
                out.blocks = np.flatnonzero(differs).tolist()
            out.findings_a, out.findings_b = said_a, said_b
            break
    return out


def _brief(f: Any) -> dict[str, Any]:
    return {"kind": f.kind, "req_id": f.req_id, "detail": f.detail, "signature": f.signature}


def _said(findings: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """What an oracle said at a step, as comparable facts: which request, which signature."""
    return {(f["req_id"], f["signature"]) for f in findings}
