"""`mgtrace diff`: the first step where two traces, or two rule sets on one trace, diverge.

Two traces are compared on their recorded inputs: per table, an order-independent hash of
each (rank, step)'s rows; the first step whose hashes differ, and in which tables. What a
replay starts from is compared too: the run metadata it sizes and rules its pool by, and the
start state a minimized repro carries (two repros of one trace can hold the same steps).

Two rule sets on one trace are compared on their effects: both replays run in lockstep and
the first step after which their shadow states differ, or their oracles disagree, is reported,
with the blocks that differ and what each side's oracle said at that step. A rule can change
only what a request reads (the accepted count a decode picks its window column by) and leave
every block as the other side has it: the oracles tell those apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.replayer import checkpoint as ckpt
from mgtrace.replayer.coverage import missing_from, unseen_reason
from mgtrace.replayer.loop import RankReplay, load_backend, resumed
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import (
    FIRST_LOAD,
    LOAD_GROWTH,
    RankTrace,
    load_bound,
    rank_step_numbers,
    ranks_of,
    require_replayable,
    spec_decodes_run_first,
)
from mgtrace.schemas.reader import TraceReader

INPUT_TABLES = ("steps", "batch_rows", "launches", "block_tables", "sched", "row_moves")
# Columns that say when, not what: two recordings of the same inputs never share them.
TIMING_COLUMNS = {"steps": ("wall_ns",)}
# The run metadata a replay sizes its pool and takes its rules from (the rest names or
# describes the engine); a model whose builders run spec decodes first (GDN) is read from
# the builders' names.
REPLAY_RUN_FIELDS = (
    "runner",
    "num_speculative_tokens",
    "mamba_block_size",
    "mamba_cache_mode",
    "num_blocks",
    "num_mamba_groups",
    "pp_size",
    "async_scheduling",
    "prefill_checkpoint_blocks",
    "prefill_checkpoints_recorded",
)


@dataclass
class TraceDiff:
    first_step: int | None
    rank: int | None
    tables: list[str] = field(default_factory=list)  # tables that differ at that step
    # per table that differs there, its columns whose values differ at that step
    columns: dict[str, list[str]] = field(default_factory=dict)
    only_in: str | None = None  # "a" or "b" when only one trace has the step
    # the last step of the run the other trace lacks, when it has later steps (a gap)
    missing_to: int | None = None
    left_out_from: int | None = None  # steps from here on were not compared (left-out parts)
    left_out_rank: int | None = None  # ... of this rank only; None: of every rank
    # the other ranks whose rows from some step on were not compared: (rank, step)
    left_out_others: list[tuple[int, int]] = field(default_factory=list)
    # what each trace lacks of its run (dropped steps, an unfinished recording), when they
    # record the same inputs: the run may differ where it is missing
    missing_a: list[str] = field(default_factory=list)
    missing_b: list[str] = field(default_factory=list)
    # what differs before the first step: run metadata fields, start states
    setup: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return self.first_step is not None or bool(self.setup)

    @property
    def inconclusive(self) -> str | None:
        """Why "the same inputs" cannot speak for the whole run: steps left uncompared."""
        if self.differs:
            return None
        if self.left_out_rank is not None:
            return self._left_out_clause()
        if self.left_out_from is not None:
            return f"steps from {self.left_out_from} on are in a left-out part (not compared)"
        if self.missing_a or self.missing_b:
            return self._missing("the first trace", "the second trace")
        return None

    def _missing(self, a: str, b: str) -> str:
        said = [f"{a}: {p}" for p in self.missing_a] + [f"{b}: {p}" for p in self.missing_b]
        return "; ".join(said) + ", so the runs may differ in what is missing"

    def sentence(self, a: str, b: str) -> str:
        steps = self._steps_sentence(a, b)
        if not self.setup:
            return steps
        setup = f"{a} and {b} start from different {' and '.join(self.setup)}"
        if self.first_step is None:
            return f"{setup}; their steps record the same inputs"
        return f"{setup}; {steps}"

    def _with_columns(self, table: str) -> str:
        names = self.columns.get(table)
        if not names:
            return table
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"{table} ({', '.join(names[:3])}{more})"

    def _left_out_clause(self) -> str:
        """Which ranks' rows were not compared, from which step on."""
        cuts = [(self.left_out_rank, self.left_out_from), *self.left_out_others]
        said = " and ".join(f"rank {r}'s rows from step {s} on" for r, s in cuts)
        parts = "left-out parts" if len(cuts) > 1 else "a left-out part"
        return f"{said} are in {parts} (not compared)"

    def _steps_sentence(self, a: str, b: str) -> str:
        if self.first_step is None and self.left_out_from == 0 and self.left_out_rank is None:
            return f"{a} and {b} share no step to compare: a left-out part holds rows of step 0"
        if self.first_step is None and self.left_out_from is not None:
            if self.left_out_rank is not None:  # the other ranks' steps were compared
                return (
                    f"{a} and {b} record the same inputs at every step compared; "
                    + self._left_out_clause()
                )
            return (
                f"{a} and {b} record the same inputs at every step before step "
                f"{self.left_out_from}, where rows of a left-out part begin (not compared)"
            )
        if self.first_step is None and (self.missing_a or self.missing_b):
            return (
                f"{a} and {b} record the same inputs at every step; inconclusive: "
                + self._missing(a, b)
            )
        if self.first_step is None:
            return f"{a} and {b} record the same inputs at every step"
        if self.only_in is not None:
            side, other = (a, b) if self.only_in == "a" else (b, a)
            agree = (
                f"the traces agree up to step {self.first_step - 1}; "
                if self.first_step > 0
                else ""
            )
            if self.missing_to is not None:
                steps = (
                    f"step {self.first_step}"
                    if self.missing_to == self.first_step
                    else f"steps {self.first_step}-{self.missing_to}"
                )
                return f"{agree}{other} lacks {steps} of rank {self.rank}, which {side} has"
            if self.first_step == 0:  # of this rank: the other may hold other ranks' steps
                return f"only {side} has steps of rank {self.rank}"
            return f"{agree}only {side} goes on"
        said = (
            f"the traces first differ at step {self.first_step} (rank {self.rank}) in "
            f"{', '.join(self._with_columns(t) for t in self.tables)}"
        )
        if self.left_out_rank is not None:  # another rank's earlier steps were not compared
            said += (
                f" of the steps compared; {self._left_out_clause()}, where they may differ earlier"
            )
        return said


def diff_traces(a: TraceReader, b: TraceReader) -> TraceDiff:
    per_table: dict[str, tuple[int, int]] = {}
    best: tuple[int, int] | None = None
    # rows a part --skip-bad-parts left out would read as differences: compare before them,
    # on the ranks they are of
    cuts = _left_out_from(a, b)
    compared, ranks = False, set()
    for name in INPUT_TABLES:
        ha, hb = _step_hashes(a, name), _step_hashes(b, name)
        ranks |= {k[0] for k in set(ha) | set(hb)}
        keys = {k for k in set(ha) | set(hb) if k[1] < _cut(cuts, k[0])}
        compared = compared or bool(keys)
        diff = [k for k in keys if ha.get(k) != hb.get(k)]
        if diff:
            first = min(diff, key=lambda k: (k[1], k[0]))
            per_table[name] = first
            if best is None or (first[1], first[0]) < (best[1], best[0]):
                best = first
    setup = setup_differences(a, b)
    if best is None:
        # the earliest cut, a whole trace's before one rank's at the same step
        cut = min(cuts.items(), key=lambda c: (c[1], c[0] is not None), default=(None, None))
        by_rank = cut[0] is not None and compared and len(ranks) > 1
        others = sorted((r, s) for r, s in cuts.items() if r is not None and r != cut[0])
        return TraceDiff(
            None,
            None,
            left_out_from=cut[1],
            # one rank's cut, where other ranks' steps were compared
            left_out_rank=cut[0] if by_rank else None,
            left_out_others=others if by_rank else [],
            missing_a=missing_from(a),
            missing_b=missing_from(b),
            setup=setup,
        )
    rank, step = best
    tables = [t for t, first in per_table.items() if first == best]
    columns = {t: _differing_columns(a, b, t, rank, step) for t in tables}
    steps_a, steps_b = _steps(a, rank), _steps(b, rank)
    only = None
    if step not in steps_a and step in steps_b:
        only = "b"
    elif step in steps_a and step not in steps_b:
        only = "a"
    missing_to = None
    if only is not None:  # a gap in the other trace, not its end, when it goes on later
        later = [s for s in (steps_b if only == "a" else steps_a) if s > step]
        missing_to = min(later) - 1 if later else None
    # a rank cut before this step may differ earlier, in rows not compared
    earlier = sorted((c, r) for r, c in cuts.items() if r is not None and r != rank and c < step)
    return TraceDiff(
        step,
        rank,
        tables,
        columns if only is None else {},
        only,
        missing_to,
        left_out_from=earlier[0][0] if earlier else None,
        left_out_rank=earlier[0][1] if earlier else None,
        left_out_others=sorted((r, c) for c, r in earlier[1:]),
        setup=setup,
    )


def setup_differences(a: TraceReader, b: TraceReader) -> list[str]:
    """What two traces' replays start from differently, in words: the run metadata a replay
    uses that differs (values shown), and the start states (one trace has one, or they
    differ). Values that mean the same (a conv layout left out is SD) are the same."""
    out: list[str] = []
    run_a, run_b = _replayed_run(a.manifest.run), _replayed_run(b.manifest.run)
    changed = [
        f"{k} {_brief_value(run_a[k])} vs {_brief_value(run_b[k])}"
        for k in run_a
        if k != "states" and run_a[k] != run_b[k]
    ]
    changed += _state_differences(run_a["states"], run_b["states"])
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        out.append(f"run metadata ({', '.join(changed[:3])}{more})")
    start_a, start_b = ckpt.start_state(a), ckpt.start_state(b)
    if (start_a is None) != (start_b is None):
        has = "the first" if start_a is not None else "the second"
        out.append(f"start states (only {has} trace carries one)")
    elif start_a is not None and start_b is not None:
        ranks = sorted(set(start_a.checkpoints) | set(start_b.checkpoints))
        differ = [
            r
            for r in ranks
            if r not in start_a.checkpoints
            or r not in start_b.checkpoints
            or not _same_checkpoint(start_a.checkpoints[r], start_b.checkpoints[r])
        ]
        if start_a.request_ids != start_b.request_ids or differ:
            where = f" of rank {', '.join(map(str, differ))}" if differ else ""
            out.append(f"start states{where}")
    return out


def _replayed_run(run: Any) -> dict[str, Any]:
    """The run metadata a replay depends on, as it reads it."""
    values = {k: getattr(run, k) for k in REPLAY_RUN_FIELDS}
    values["spec_decodes_first"] = spec_decodes_run_first(run)
    values["states"] = [
        {
            "group": st.group,
            "layer": st.layer,
            "kind": st.kind,
            "shape": list(st.shape),
            "dtype": st.dtype,
            "conv_layout": (st.conv_layout or "SD") if st.kind == "conv" else None,
        }
        for st in run.states
    ]
    return values


def _state_differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """The first field in which two lists of state tensors differ, named, or their count."""
    if len(a) != len(b):
        return [f"state tensors {len(a)} vs {len(b)}"]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for field_name in x:
            if x[field_name] != y[field_name]:
                return [f"states[{i}].{field_name} {x[field_name]!r} vs {y[field_name]!r}"]
    return []


def _brief_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same_checkpoint(a: Path | ckpt.Checkpoint, b: Path | ckpt.Checkpoint) -> bool:
    """Whether two stored checkpoints hold the same arrays (a file's bytes could differ in
    ways its contents do not)."""
    if not isinstance(a, Path) or not isinstance(b, Path):
        return a is b
    with np.load(a) as da, np.load(b) as db:
        if sorted(da.files) != sorted(db.files):
            return False
        return all(np.array_equal(da[k], db[k]) for k in da.files)


def _left_out_from(*readers: TraceReader) -> dict[int | None, int]:
    """Per rank (None: every rank), the first step whose rows of an input table a skipped
    part held, in any trace."""
    cuts: dict[int | None, int] = {}
    for reader in readers:
        for s in reader.skipped:
            if s.table in INPUT_TABLES:
                first = max(s.min_step if s.min_step is not None else 0, 0)
                cuts[s.rank] = min(cuts.get(s.rank, first), first)
    return cuts


def _cut(cuts: dict[int | None, int], rank: int) -> float:
    """The step from which ``rank``'s rows are not compared (inf: none left out)."""
    return min(cuts.get(None, math.inf), cuts.get(rank, math.inf))


def _steps(reader: TraceReader, rank: int) -> set[int]:
    con = reader.connect()
    return {r[0] for r in con.execute("SELECT step FROM steps WHERE rank = ?", [rank]).fetchall()}


def _differing_columns(
    a: TraceReader, b: TraceReader, table: str, rank: int, step: int
) -> list[str]:
    """The columns of ``table`` whose values at (``rank``, ``step``) differ between the
    traces, in schema order: each column's values compared as a multiset, as the step's
    hash compares its rows (their order within the step does not count)."""
    skip = {"rank", "step", *TIMING_COLUMNS.get(table, ())}
    query = f"SELECT * FROM {table} WHERE rank = ? AND step = ?"
    rows_a = a.connect().sql(query, params=[rank, step]).to_arrow_table()
    rows_b = b.connect().sql(query, params=[rank, step]).to_arrow_table()
    out = []
    for name in rows_a.column_names:
        if name in skip:
            continue
        if name not in rows_b.column_names:
            out.append(name)
            continue
        values_a = sorted(map(repr, rows_a.column(name).to_pylist()))
        values_b = sorted(map(repr, rows_b.column(name).to_pylist()))
        if values_a != values_b:
            out.append(name)
    return out


def _step_hashes(reader: TraceReader, table: str) -> dict[tuple[int, int], int]:
    con = reader.connect()
    skip = ", ".join(("rank", "step", *TIMING_COLUMNS.get(table, ())))
    rows = con.execute(
        f"SELECT rank, step, bit_xor(hash(*COLUMNS(* EXCLUDE ({skip})))) "
        f"FROM {table} GROUP BY rank, step"
    ).fetchall()
    return {(int(r), int(s)): int(h) for r, s, h in rows}


@dataclass
class RulesDiff:
    first_step: int | None
    rank: int | None
    blocks: list[int] = field(default_factory=list)  # blocks whose tags differ
    findings_a: list[dict[str, Any]] = field(default_factory=list)
    findings_b: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0  # rank-steps replayed under each rule set
    ranks: int = 1
    gap: tuple[int, int] | None = None  # (rank, step): the first gap, where the replays stop
    inconclusive: str | None = None  # why "identical" cannot speak for the whole run

    def sentence(self, a: RuleSet, b: RuleSet) -> str:
        if self.first_step is None:
            steps = (
                f"{self.steps} steps"
                if self.ranks == 1
                else f"{self.steps} rank-steps ({self.ranks} ranks)"
            )
            said = (
                f"{a.canonical()} and {b.canonical()} leave identical shadow state at every "
                f"one of {steps}"
            )
            if self.gap is not None:
                said += (
                    f", up to rank {self.gap[0]}'s gap at step {self.gap[1]} (dropped, "
                    "unrecorded or left-out steps), where the replays stop"
                )
            if self.inconclusive is not None:
                said += f"; inconclusive: {self.inconclusive}"
            return said
        where = f"{a.canonical()} and {b.canonical()} first diverge at step {self.first_step} "
        if not self.blocks:
            return where + f"(rank {self.rank}): the same state, read differently"
        shown = ", ".join(str(x) for x in self.blocks[:8])
        if len(self.blocks) > 8:
            shown += f", ... ({len(self.blocks)} in all)"
        if len(self.blocks) == 1:
            return where + f"(rank {self.rank}): block {shown} holds different state"
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
        # As bisect does, a rank is loaded a first part at a time (``load_bound``): the
        # replays stop at the first divergence, often long before the trace's end.
        numbers, count = rank_step_numbers(reader, rank), FIRST_LOAD
        trace = RankTrace(reader, rank, ids, to_step=load_bound(numbers, count))
        # the shadow state cannot be rebuilt across a gap: both replays stop before it
        gap = trace.hole
        if gap is not None and (out.gap is None or (gap, rank) < (out.gap[1], out.gap[0])):
            out.gap = (rank, gap)
        ra = RankReplay(trace, a, run, device=device)
        rb = RankReplay(trace, b, run, device=device)
        ckpt.start_from(ra, seed)
        ckpt.start_from(rb, seed)
        steps = list(trace)
        while True:
            if _diverged(out, ra, rb, steps, gap, rank):
                break
            if trace.to_step is None:
                break
            # both replays agree through the load: a larger one, going on from their states
            last = int(trace.step_numbers[-1]) if len(trace) else trace.to_step
            states = [(r.checkpoint(last), r.oracle.unwritten_unknown) for r in (ra, rb)]
            del ra, rb, trace  # their rows go before the larger load comes in
            count *= LOAD_GROWTH
            trace = RankTrace(reader, rank, ids, to_step=load_bound(numbers, count))
            ra, rb = (
                resumed(trace, rules, run, device, *state)
                for rules, state in zip((a, b), states, strict=True)
            )
            steps = trace.steps_from(last + 1)
    if out.first_step is not None and out.gap is not None and out.gap[1] <= out.first_step:
        out.gap = None  # not reached: a divergence on another rank came first
    if out.first_step is None:
        out.inconclusive = unseen_reason(reader, out.gap is not None)
    return out


def _diverged(
    out: RulesDiff, ra: RankReplay, rb: RankReplay, steps: list[int], gap: int | None, rank: int
) -> bool:
    """Replay ``steps`` in lockstep until the two sides differ (recorded in ``out``), a gap,
    or the step another rank already diverged at; whether they stopped there."""
    for step in steps:
        if out.first_step is not None and step >= out.first_step:
            return True
        if gap is not None and step >= gap:
            return True
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
        return True
    return False


def _brief(f: Any) -> dict[str, Any]:
    return {"kind": f.kind, "req_id": f.req_id, "detail": f.detail, "signature": f.signature}


def _said(findings: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """What an oracle said at a step, as comparable facts: which request, which signature."""
    return {(f["req_id"], f["signature"]) for f in findings}
