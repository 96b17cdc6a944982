"""`mgtrace minimize`: delta debugging down to the smallest trace that shows the same finding.

The finding is pinned by its signature (``kind:mechanism``) at the first bad step, so a
reduction can never drift to another bug: a candidate counts only when its replay's first
findings still include that signature and nothing else goes bad earlier.

Reductions only delete recorded rows, they never rewrite them:
1. steps after the first bad step;
2. requests (ddmin): every row of a request, in every table;
3. steps that no longer hold anything, renumbered so the trace stays contiguous (their
   block-table changes move to the next step kept);
4. block-table row changes to rows that no kept request or kernel row indexes.
5. history long before the finding, replaced by the replay state it leaves (a start state).

Passes 2-5 repeat until a round removes nothing, so minimizing the result again changes
nothing.

The result is written as a trace plus a standalone pytest file that replays it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mgtrace.atomic import atomic_write, clear_stale_siblings, hidden_sibling, replacing_directory
from mgtrace.errors import InconclusiveError, OutputError, UsageError
from mgtrace.kernels.reference import run_reference
from mgtrace.opened_traces import refuse_if_replaced
from mgtrace.outputs import (
    refuse_a_trace_inside_a_trace,
    refuse_overwriting_inputs,
    require_output_folder,
)
from mgtrace.replayer import checkpoint as ckpt
from mgtrace.replayer.checkpoint import START_STATE_DIR, StartState
from mgtrace.replayer.loop import Checkpoint, RankReplay, replay_trace
from mgtrace.replayer.ownership import steps_in_flight
from mgtrace.replayer.requests import NO_REQUEST
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import (
    FIRST_LOAD,
    LOAD_GROWTH,
    REPLAY_TABLES,
    RankTrace,
    dims_after,
    first_gap,
    load_bound,
    ranks_of,
    require_replayable,
    some_ranks,
)
from mgtrace.schemas.manifest import Manifest, is_trace_directory, save_manifest
from mgtrace.schemas.ranks import MISSING_RANKS
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import write_part_file

STEP_COLUMNS = ("step", "batch_step", "bt_step", "postprocess_step", "first_step", "last_step")
# The phase ``minimize`` reports while it loads steps and replays them for the first finding.
FIRST_REPLAY = "first replay"
# Steps of history a repro keeps before its finding; older history becomes a start state.
PREFIX_WINDOW = 16
# Rounds of the reductions at most; each ends when a round removes nothing.
MAX_ROUNDS = 8


class MemoryTrace:
    """A trace held as Arrow tables: what the replayer reads, without touching the disk."""

    def __init__(
        self,
        manifest: Manifest,
        tables: dict[str, pa.Table],
        start_state: StartState | None = None,
    ) -> None:
        self.manifest = manifest
        self.tables_ = tables
        self.start_state = start_state
        # rank -> what ``RankTrace.table_dims`` reads of rows a bounded load left out (a
        # trace made from this one by a reduction has its own rows only: none)
        self.later_dims: dict[int, dict[str, int]] = {}

    def table(
        self,
        name: str,
        *,
        columns: list[str] | None = None,
        codes: bool = False,
        to_step: int | None = None,
    ) -> pa.Table:
        """One table as held (``codes`` asks for nothing: strings held decoded stay so),
        with ``to_step`` its rows of steps up to it, as ``TraceReader.table`` hands them."""
        t = self.tables_[name]
        if to_step is not None:
            t = t.filter(pc.less_equal(t.column("step"), to_step))
        return t.select(columns) if columns else t

    def column_max(
        self, name: str, column: str, *, rank: int, after_step: int, lengths: bool = False
    ) -> int | None:
        """As ``TraceReader.column_max``, of the table held."""
        t = self.tables_[name]
        keep = pc.and_(pc.equal(t.column("rank"), rank), pc.greater(t.column("step"), after_step))
        values = t.column(column).filter(keep)
        return pc.max(pc.list_value_length(values) if lengths else values).as_py()

    def rows(self, name: str) -> int:
        return self.tables_[name].num_rows


def load_memory(reader: TraceReader, to_step: int | None = None) -> MemoryTrace:
    """The trace's tables in memory (with ``to_step``, the rows of steps up to it), and its
    start state when it has one (a repro)."""
    tables = {
        name: reader.table(name, to_step=to_step if TABLES[name].per_step else None)
        for name in TABLES
        if name != "findings"
    }
    tables["findings"] = TABLES["findings"].schema.empty_table()
    return MemoryTrace(reader.manifest, tables, ckpt.start_state(reader))


@dataclass
class Outcome:
    first_step: int | None
    signatures: set[str]
    lead: str | None = None  # the first finding as replay lists it (step, rank, batch row)
    rank_of: dict[str, int] = field(default_factory=dict)  # signature -> lowest rank showing it
    # signature -> the requests its findings name, readers and writers
    named: dict[str, set[str]] = field(default_factory=dict)


def outcome(trace: MemoryTrace, rules: RuleSet) -> Outcome:
    # only the first bad step counts: nothing after it is replayed (a long recording whose
    # bug shows early is not replayed whole)
    result = replay_trace(trace, rules, stop_on_finding=True)  # type: ignore[arg-type]
    first = [f for f in result.findings if f.step == result.first_step]
    rank_of: dict[str, int] = {}
    named: dict[str, set[str]] = {}
    for f in first:  # in (step, rank, batch row) order: the lowest rank comes first
        rank_of.setdefault(f.signature, f.rank)
        named.setdefault(f.signature, set()).update(
            r for r in (f.req_id, f.writer_req_id) if r and not r.startswith("<")
        )
    lead = first[0].signature if first else None
    return Outcome(result.first_step, set(rank_of), lead, rank_of, named)


# ------------------------------------------------------------------ reductions
def only_rank(trace: MemoryTrace, rank: int) -> MemoryTrace:
    """One rank's rows and start state. Each rank replays on its own, so the other ranks'
    rows take no part in a finding on this one."""
    return only_ranks(trace, [rank])


def only_ranks(trace: MemoryTrace, ranks: Sequence[int]) -> MemoryTrace:
    """The rows and start state of ``ranks``."""
    kept_ranks = pa.array(ranks, pa.int32())
    out = {
        name: t.filter(pc.is_in(t.column("rank"), kept_ranks))
        if TABLES[name].per_step and t.num_rows
        else t
        for name, t in trace.tables_.items()
    }
    start = trace.start_state
    if start is not None:
        kept = {r: cp for r, cp in start.checkpoints.items() if r in ranks}
        start = replace(start, checkpoints=kept)
    return MemoryTrace(trace.manifest, out, start)


def truncate(trace: MemoryTrace, last_step: int) -> MemoryTrace:
    """The steps up to ``last_step``, and only the requests that appear in them."""
    out = {}
    for name, t in trace.tables_.items():
        if TABLES[name].per_step and t.num_rows:
            t = t.filter(pc.less_equal(t.column("step"), last_step))
        out[name] = t
    seen = pc.unique(
        pa.chunked_array(
            [*out["batch_rows"].column("req_id").chunks, *out["sched"].column("req_id").chunks],
            pa.string(),
        )
    )
    requests = out["requests"]
    out["requests"] = requests.filter(pc.is_in(requests.column("req_id"), value_set=seen))
    return MemoryTrace(trace.manifest, out, trace.start_state)


def without_requests(trace: MemoryTrace, drop: set[str]) -> MemoryTrace:
    """Delete every row of the requests in ``drop``."""
    if not drop:
        return trace
    t = trace.tables_
    dropped = pa.array(sorted(drop))
    br = t["batch_rows"]
    gone = br.filter(pc.is_in(br.column("req_id"), value_set=dropped))
    out = dict(t)
    out["batch_rows"] = br.filter(pc.invert(pc.is_in(br.column("req_id"), value_set=dropped)))
    out["sched"] = t["sched"].filter(
        pc.invert(pc.is_in(t["sched"].column("req_id"), value_set=dropped))
    )
    out["requests"] = t["requests"].filter(
        pc.invert(pc.is_in(t["requests"].column("req_id"), value_set=dropped))
    )
    moves = t["row_moves"]
    if moves.num_rows:
        hit = pc.or_kleene(
            pc.is_in(moves.column("req_id"), value_set=dropped),
            pc.is_in(moves.column("req_id_b"), value_set=dropped),
        )
        out["row_moves"] = moves.filter(pc.invert(pc.fill_null(hit, False)))
    launches = t["launches"]
    if launches.num_rows and gone.num_rows:
        # launch rows of a dropped request: same rank, batch step and batch row
        def key(rank: pa.Array, step: pa.Array, row: pa.Array) -> np.ndarray:
            return (
                np.asarray(rank, np.int64) * (1 << 50)
                + np.asarray(step, np.int64) * (1 << 20)
                + np.asarray(row, np.int64)
            )

        gone_keys = key(gone.column("rank"), gone.column("step"), gone.column("batch_row"))
        lk = key(
            launches.column("rank"),
            pc.fill_null(launches.column("batch_step"), -1),
            launches.column("batch_row"),
        )
        # A kernel's programs are numbered 0..n-1, so a dropped request's rows stay as padded
        # rows (slot -1, which every align kernel skips); its gather rows simply go.
        hit = np.isin(lk, gone_keys)
        gather = np.asarray(pc.equal(launches.column("kernel"), "aligned_indices"))
        launches = launches.filter(pa.array(~(hit & gather)))
        hit = hit[~(hit & gather)]
        slot = np.asarray(pc.fill_null(launches.column("req_slot"), -1)).copy()
        slot[hit] = -1
        idx = launches.column_names.index("req_slot")
        out["launches"] = launches.set_column(
            idx, launches.schema.field(idx), pa.array(slot, pa.int32())
        )
    return MemoryTrace(trace.manifest, out, trace.start_state)


def without_table_updates(trace: MemoryTrace, drop: np.ndarray) -> MemoryTrace:
    """Delete the block-table changes at the given row positions of ``block_tables``."""
    t = trace.tables_["block_tables"]
    keep = np.ones(t.num_rows, dtype=bool)
    keep[drop] = False
    return MemoryTrace(
        trace.manifest,
        {**trace.tables_, "block_tables": t.filter(pa.array(keep))},
        trace.start_state,
    )


def _unreferenced_table_rows(trace: MemoryTrace) -> np.ndarray:
    """Positions of block-table changes to rows no kept request or kernel row indexes."""
    t = trace.tables_
    bt = t["block_tables"]
    if not bt.num_rows:
        return np.zeros(0, dtype=np.int64)
    used = set(t["batch_rows"].column("req_slot").drop_null().to_pylist())
    launches = t["launches"]
    if launches.num_rows:
        live = launches.filter(pc.greater_equal(pc.fill_null(launches.column("req_slot"), -1), 0))
        used |= set(live.column("bt_row").drop_null().to_pylist())
        gather = launches.filter(pc.equal(launches.column("kernel"), "aligned_indices"))
        used |= set(gather.column("bt_row").drop_null().to_pylist())
    rows = np.asarray(bt.column("row"))
    return np.flatnonzero(~np.isin(rows, list(used)))


def _without_unused_rows(trace: MemoryTrace, bad: Callable[[MemoryTrace], bool]) -> MemoryTrace:
    """``trace`` without the block-table changes nothing indexes, if it stays bad so."""
    unused = _unreferenced_table_rows(trace)
    if len(unused):
        trimmed = without_table_updates(trace, unused)
        if bad(trimmed):
            return trimmed
    return trace


def compact_steps(trace: MemoryTrace) -> MemoryTrace:
    """Drop steps that hold no batch rows, launches or scheduler rows; renumber the rest.
    Rows at negative steps (batches a repro's start state still owes a deferred post-process)
    stay as they are."""
    t = trace.tables_
    used: set[tuple[int, int]] = set()
    launches = t["launches"]
    live = launches.filter(pc.greater_equal(pc.fill_null(launches.column("req_slot"), -1), 0))
    for tab in (t["batch_rows"], live, t["sched"]):
        used |= {
            (r, s)
            for r, s in zip(
                tab.column("rank").to_pylist(), tab.column("step").to_pylist(), strict=True
            )
            if s >= 0
        }
    ranks = sorted({r for r, _ in used}) or [0]
    mapping: dict[int, dict[int, int]] = {}
    for rank in ranks:
        kept = sorted(s for r, s in used if r == rank)
        mapping[rank] = {s: i for i, s in enumerate(kept)}
    out = {}
    for name, tab in t.items():
        spec = TABLES[name]
        if not tab.num_rows or name == "findings":
            out[name] = tab
            continue
        if name == "block_tables":
            out[name] = _carry_forward(tab, mapping)
            continue
        if spec.per_step:
            ranks_col = tab.column("rank").to_pylist()
            steps_col = tab.column("step").to_pylist()
            keep = np.array(
                [
                    s < 0 or s in mapping.get(r, {})
                    for r, s in zip(ranks_col, steps_col, strict=True)
                ],
                dtype=bool,
            )
            tab = tab.filter(pa.array(keep))
            out[name] = _renumber(tab, mapping)
        else:
            out[name] = tab
    return MemoryTrace(trace.manifest, out, trace.start_state)


def _map_steps(ranks: list[int], values: list[int | None], mapping, *, forward: bool) -> list:
    res = []
    for r, v in zip(ranks, values, strict=True):
        if v is None or v < 0:  # before the start state: never renumbered
            res.append(v)
            continue
        m = mapping.get(r, {})
        if v in m:
            res.append(m[v])
        else:
            # a step that no longer exists: the nearest kept step (next one when carrying)
            ks = sorted(m)
            idx = np.searchsorted(ks, v)
            idx = min(idx, len(ks) - 1) if forward else max(idx - 1, 0)
            res.append(m[ks[idx]] if ks else None)
    return res


def _renumber(tab: pa.Table, mapping: dict[int, dict[int, int]]) -> pa.Table:
    ranks = tab.column("rank").to_pylist()
    for col in STEP_COLUMNS:
        if col in tab.column_names:
            new = _map_steps(ranks, tab.column(col).to_pylist(), mapping, forward=False)
            idx = tab.column_names.index(col)
            tab = tab.set_column(idx, tab.schema.field(idx), pa.array(new, pa.int64()))
    return tab


def _carry_forward(tab: pa.Table, mapping: dict[int, dict[int, int]]) -> pa.Table:
    """Block-table changes of dropped steps move to the next step kept, in order."""
    ranks = tab.column("rank").to_pylist()
    new = _map_steps(ranks, tab.column("step").to_pylist(), mapping, forward=True)
    keep = np.array([v is not None for v in new], dtype=bool)
    idx = tab.column_names.index("step")
    tab = tab.set_column(idx, tab.schema.field(idx), pa.array(new, pa.int64()))
    # the sort in the replayer is stable within a step, so a later change of a row still wins
    return tab.filter(pa.array(keep))


def trim_prefix(trace: MemoryTrace, first: int, rules: RuleSet) -> MemoryTrace:
    """The trace from step ``first`` on, renumbered from 0, starting from the replay state
    the earlier steps left (a checkpoint per rank). A post-process that pipeline parallelism
    deferred past the cut still needs its batch: those batches' rows stay, at negative steps
    (the state before step 0 holds their views, and a restore rebuilds them from the rows).
    So do the scheduler rows of the steps still in flight at the cut: align mode's frees in
    the repro's first steps count the tokens those steps have not folded in yet."""
    launches = trace.tables_["launches"]
    oldest = first
    if launches.num_rows:
        late = launches.filter(pc.greater_equal(launches.column("step"), first))
        batch_steps = pc.drop_null(late.column("batch_step"))
        if len(batch_steps):
            oldest = min(oldest, pc.min(batch_steps).as_py())
    in_flight_from = first - steps_in_flight(trace.manifest.run)
    ids, seed = ckpt.request_ids_for(trace)
    states: dict[int, Path | Checkpoint] = {}
    for rank in ranks_of(trace):  # type: ignore[arg-type]
        rep = RankReplay(RankTrace(trace, rank, ids), rules, run_reference)  # type: ignore[arg-type]
        rep.run(start=ckpt.start_from(rep, seed), until=first - 1)
        # what the state remembers of steps before the cut, renumbered as the steps are:
        # a finding in the repro names its writer's step in the repro's numbering
        rep.pool.shift_steps(-first)
        cp = rep.checkpoint(-1)
        cp.findings = 0
        owner, since, held, retired = cp.ownership
        cp.ownership = (owner, np.where(owner != NO_REQUEST, since - first, since), held, retired)
        cp.views = {
            s - first: replace(view, step=s - first)
            for s, view in cp.views.items()
            if oldest <= s < first
        }
        states[rank] = cp
    out = {}
    for name, tab in trace.tables_.items():
        if TABLES[name].per_step and tab.num_rows:
            keep_from = {"batch_rows": oldest, "sched": in_flight_from}.get(name, first)
            tab = tab.filter(pc.greater_equal(tab.column("step"), keep_from))
            for col in ("step", "batch_step", "bt_step", "postprocess_step"):
                if col in tab.column_names:
                    idx = tab.column_names.index(col)
                    tab = tab.set_column(
                        idx, tab.schema.field(idx), pc.subtract(tab.column(col), first)
                    )
        out[name] = tab
    return MemoryTrace(trace.manifest, out, StartState(ids.names, states))


def ddmin(
    items: list[Any],
    still_bad: Callable[[list[Any]], bool],
    on_query: Callable[[int], None] | None = None,
) -> list[Any]:
    """Zeller's ddmin: a 1-minimal subset of ``items`` for which ``still_bad`` holds."""
    n = 2
    current = list(items)
    while len(current) >= 2:
        chunk = max(1, len(current) // n)
        subsets = [current[i : i + chunk] for i in range(0, len(current), chunk)]
        reduced = False
        for sub in subsets:
            if on_query:
                on_query(len(current))
            if still_bad(sub):
                current, n, reduced = sub, 2, True
                break
        if not reduced:
            for sub in subsets:
                complement = [x for x in current if x not in set(sub)]
                if on_query:
                    on_query(len(current))
                if complement and still_bad(complement):
                    current, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current


@dataclass
class MinimizeResult:
    signature: str
    first_step: int  # in the repro, whose steps are renumbered from 0
    original_first_step: int  # the same finding's step in the trace minimized
    original_steps: int
    original_requests: int
    steps: int
    requests: list[str]
    # requests the pinned finding names that no step of the repro schedules: their state
    # comes from the repro's start state (a block they held before its first step)
    start_state_requests: list[str]
    table_updates: int
    queries: int
    wall_s: float
    output: str
    test_file: str
    history: list[dict[str, Any]] = field(default_factory=list)


def _refuse_existing_output(output: Path, force: bool) -> Path:
    """The test file beside ``output``; refuses, before any replay, an output this command
    must not write: one that exists (without ``force``), that is not an mgtrace trace (with
    it), that is or holds the current directory, or whose directory cannot be written."""
    output = Path(output)
    test_file = output.parent / f"test_{_module_name(output.name)}.py"
    clear_stale_siblings(output)  # a killed run's leftovers; an old trace it moved goes back
    here = Path.cwd().resolve()
    out = output.resolve()
    if out == here or out in here.parents:
        raise UsageError(
            f"{output} is (or holds) the current directory; write the output elsewhere"
        )
    taken = output.exists() or output.is_symlink()
    empty = output.is_dir() and not output.is_symlink() and not any(output.iterdir())
    # what --force would not replace is said first, so the advice is not to pass it
    if taken and not empty and not is_trace_directory(output):
        raise OutputError(
            f"{output} exists and is not an mgtrace trace; choose another path (--force "
            "replaces only a trace)"
        )
    if test_file.exists() and not _written_by_minimize(test_file):
        raise OutputError(
            f"{test_file} exists and is not a repro test mgtrace wrote; choose another "
            "output name (--force replaces only mgtrace's own)"
        )
    if (taken or test_file.exists()) and not force:
        raise OutputError(f"{output} (or {test_file.name}) already exists; pass --force")
    require_output_folder(output, str(output))  # as every -o but record's: no folder made
    refuse_a_trace_inside_a_trace(output)
    return test_file


def _written_by_minimize(path: Path) -> bool:
    """Whether ``path`` is a file that starts as the tests this command writes do."""
    head = TEST_TEMPLATE.split("{", 1)[0].encode()
    try:
        with path.open("rb") as fh:
            return path.is_file() and fh.read(len(head)) == head
    except OSError:
        return False


def minimize(
    trace_path: Path,
    output: Path,
    *,
    rules: RuleSet | None = None,
    signature: str | None = None,
    force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    skip_bad_parts: bool = False,
    ranks: Sequence[int] | None = None,
) -> MinimizeResult:
    """``ranks``: minimize a finding of these ranks only, whatever the others hold (a gap
    on another rank stops nothing)."""
    rules = rules or RuleSet()
    refuse_overwriting_inputs(output, trace_path)
    _refuse_existing_output(Path(output), force)  # before the replays, not after them
    t0 = time.perf_counter()
    reader = TraceReader(trace_path, skip_bad_parts=skip_bad_parts)
    require_replayable(reader)
    chosen = some_ranks(reader, ranks, trace_path)
    full, gap, base, bound = _first_outcome(reader, chosen, rules, trace_path, progress)
    if base.first_step is None and gap is not None:
        raise _untrusted(trace_path, gap)
    if base.first_step is None:
        # --rank N: that rank is clean, whatever the others hold
        on = "" if chosen is None else f" on rank{'s' * (len(chosen) > 1)} "
        on += ", ".join(map(str, chosen or ()))
        raise InconclusiveError(
            f"{trace_path} replays clean{on} under {rules.canonical()}; there is nothing to "
            "minimize"
        )
    # a repro keeps the finding it was made for; any other trace pins its first finding
    own = (reader.manifest.source or {}).get("signature")
    pin = signature or (own if own in base.signatures else base.lead)
    if pin not in base.signatures:
        known = ", ".join(sorted(base.signatures))
        # a --signature the trace does not show is a wrong argument, not an open question
        error = UsageError if signature is not None else InconclusiveError
        raise error(f"signature {pin!r} is not among the first findings ({known})")
    queries = 0

    def bad(candidate: MemoryTrace) -> bool:
        nonlocal queries
        queries += 1
        got = outcome(candidate, rules)
        return got.first_step is not None and pin in got.signatures

    history = []
    current = truncate(full, base.first_step)
    if not bad(current):
        raise InconclusiveError("the finding does not survive cutting the steps after it")
    history.append({"pass": "truncate", "steps": base.first_step + 1})
    rank = base.rank_of[pin]
    if len(set(current.tables_["steps"].column("rank").to_pylist())) > 1:
        alone = only_rank(current, rank)
        if bad(alone):  # always, as each rank replays on its own; checked all the same
            current = alone
            history.append({"pass": "ranks", "rank": rank})
    elif chosen is not None:  # --rank N of several: the one rank it keeps, as above
        history.append({"pass": "ranks", "rank": rank})
    # The prefix trim can leave requests and steps the earlier passes had to keep (their
    # history mattered then), so the passes repeat until none removes anything.
    for _ in range(MAX_ROUNDS):
        size = _size(current)
        current = _reduce_once(current, bad, rules, history, progress, lambda: queries)
        if _size(current) == size:
            break
    final = outcome(current, rules)
    test_file = write_minimized(
        current,
        output,
        full.manifest,
        trace_path,
        pin,
        final.first_step,
        rules,
        force=force,
        original_step=base.first_step,
    )
    original_steps, original_requests = (
        _size(full)[:2] if bound is None else _whole_size(reader, chosen)
    )
    kept = sorted(set(current.tables_["batch_rows"].column("req_id").to_pylist()))
    return MinimizeResult(
        signature=pin,
        first_step=int(final.first_step),
        original_first_step=int(base.first_step),
        original_steps=original_steps,
        original_requests=original_requests,
        steps=_num_steps(current),
        requests=kept,
        start_state_requests=sorted(final.named.get(pin, set()) - set(kept)),
        table_updates=current.tables_["block_tables"].num_rows,
        queries=queries,
        wall_s=time.perf_counter() - t0,
        output=str(output),
        test_file=str(test_file),
        history=history,
    )


def _first_outcome(
    reader: TraceReader,
    chosen: Sequence[int] | None,
    rules: RuleSet,
    trace_path: Path,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[MemoryTrace, tuple[int, int] | None, Outcome, int | None]:
    """The trace's first steps in memory, through its first finding under ``rules``: the
    trace held, its first gap, the outcome and the last step loaded (None: all of them).

    Only the steps up to the first finding are kept, so only those are loaded: the first
    ``FIRST_LOAD`` steps, and eight times as many each time the replay gets through them
    clean (a replay of the larger load starts over: it is one of the many replays that
    minimizing takes). As bisect does, the replay stops at the first gap: the steps after
    the first finding are cut anyway, so only a gap before it leaves nothing to trust."""
    steps = reader.table("steps", columns=["rank", "step"])
    numbers = _step_numbers(steps, chosen)
    # A whole load replays up to the trace's first gap, with block tables as wide as the
    # rows before it need: a smaller load's are made as wide, so that an index falls
    # outside them exactly where it does there.
    whole_gap = _first_gap(reader, MemoryTrace(reader.manifest, {"steps": steps}), chosen)
    through = None if whole_gap is None else whole_gap[1] - 1
    count = FIRST_LOAD
    while True:
        bound = load_bound(numbers, count)
        if progress is not None:  # (phase, replays so far, steps loaded)
            loaded = len(numbers) if bound is None else np.searchsorted(numbers, bound, "right")
            progress(FIRST_REPLAY, 0, int(loaded))
        full = load_memory(reader, to_step=bound)
        refuse_if_replaced([reader], "the minimization")  # what it loaded may mix two traces
        if chosen is not None:
            full = only_ranks(full, chosen)
        gap = _first_gap(reader, full, chosen)
        if gap is not None and gap[1] <= 0:  # no step before it to replay
            raise _untrusted(trace_path, gap)
        held = full if gap is None else truncate(full, gap[1] - 1)
        if bound is not None and (through is None or through > bound):
            ranks = ranks_of(held)  # type: ignore[arg-type]
            held.later_dims = {r: dims_after(reader, r, bound, through) for r in ranks}
        base = outcome(held, rules)
        past = bound is None or (gap is not None and gap[1] <= bound)
        if base.first_step is not None or past:
            return full, gap, base, bound
        count *= LOAD_GROWTH


def _step_numbers(steps: pa.Table, chosen: Sequence[int] | None) -> np.ndarray:
    """The step numbers of a steps table (of ``chosen`` ranks), sorted, each once."""
    t = steps
    if chosen is not None:
        t = t.filter(pc.is_in(t.column("rank"), pa.array(chosen, pa.int32())))
    return np.unique(t.column("step").to_numpy(zero_copy_only=False))


def _whole_size(reader: TraceReader, chosen: Sequence[int] | None) -> tuple[int, int]:
    """Steps and requests in batches of the whole trace (of ``chosen`` ranks), as
    ``_size`` counts them, one column at a time."""
    rows = reader.table("batch_rows", columns=["rank", "req_id"], codes=True)
    if chosen is not None:
        rows = rows.filter(pc.is_in(rows.column("rank"), pa.array(chosen, pa.int32())))
    names: set[str] = set()
    for chunk in rows.column("req_id").chunks:
        if pa.types.is_dictionary(chunk.type):  # each distinct code made a string once
            chunk = chunk.dictionary.take(pc.unique(chunk.indices))
        names.update(chunk.to_pylist())
    names.discard(None)
    steps = reader.table("steps", columns=["rank", "step"])
    return len(_step_numbers(steps, chosen)), len(names)


def _untrusted(trace_path: Path, gap: tuple[int, int]) -> InconclusiveError:
    return InconclusiveError(
        f"rank {gap[0]} of {trace_path} has a gap at step {gap[1]} (dropped, unrecorded or "
        "left-out steps) before any finding; the shadow state after it cannot be trusted"
    )


def _first_gap(
    reader: TraceReader, trace: MemoryTrace, chosen: Sequence[int] | None = None
) -> tuple[int, int] | None:
    """The earliest (rank, step) missing from a rank's steps (of ``chosen`` ranks, default
    every rank), or whose rows a part ``--skip-bad-parts`` left out held; None when every
    rank's steps are whole."""
    steps = trace.tables_["steps"]
    found: list[tuple[int, int]] = []
    ranks = set(steps.column("rank").to_pylist())
    # a rank whose steps rows were all left out has no row to be named by
    left_out = [s for s in reader.skipped if s.table in REPLAY_TABLES]
    ranks |= {s.rank for s in left_out if s.rank is not None}
    if left_out and not ranks:
        ranks = {0}
    if chosen is not None:
        ranks &= set(chosen)
    for rank in sorted(ranks):
        mine = steps.filter(pc.equal(steps.column("rank"), rank)).column("step")
        gaps = [first_gap(np.sort(np.asarray(mine, np.int64)))]
        gaps += [max(first, 0) for first, _ in reader.steps_left_out(rank, REPLAY_TABLES)]
        known = [g for g in gaps if g is not None]
        if known:
            found.append((min(known), rank))
    return (min(found)[1], min(found)[0]) if found else None


def _size(trace: MemoryTrace) -> tuple[int, int, int]:
    return (
        _num_steps(trace),
        len(set(trace.tables_["batch_rows"].column("req_id").to_pylist())),
        trace.tables_["block_tables"].num_rows,
    )


def _reduce_once(
    current: MemoryTrace,
    bad: Callable[[MemoryTrace], bool],
    rules: RuleSet,
    history: list[dict[str, Any]],
    progress: Callable[[str, int, int], None] | None,
    queries: Callable[[], int],
) -> MemoryTrace:
    """One round of the reductions: requests, empty steps, unused block-table rows, and the
    history before the finding's window."""
    requests = sorted(set(current.tables_["batch_rows"].column("req_id").to_pylist()))

    def keep_requests(keep: list[str]) -> bool:
        return bad(without_requests(current, set(requests) - set(keep)))

    kept = ddmin(
        requests, keep_requests, on_query=lambda n: progress and progress("requests", queries(), n)
    )
    current = without_requests(current, set(requests) - set(kept))
    history.append({"pass": "requests", "requests": len(kept)})
    compacted = compact_steps(current)
    if bad(compacted):
        current = compacted
    history.append({"pass": "steps", "steps": _num_steps(current)})
    current = _without_unused_rows(current, bad)
    history.append({"pass": "rows", "table_updates": current.tables_["block_tables"].num_rows})
    # Start shortly before the finding, from the replay state the earlier steps leave.
    first = outcome(current, rules).first_step
    if first is not None and first > PREFIX_WINDOW:
        trimmed = trim_prefix(current, first - PREFIX_WINDOW, rules)
        if bad(trimmed):
            current = trimmed
            history.append({"pass": "prefix", "starts_after_step": first - PREFIX_WINDOW - 1})
            # the launches cut with the prefix indexed rows the rest does not
            current = _without_unused_rows(current, bad)
            history.append(
                {"pass": "rows", "table_updates": current.tables_["block_tables"].num_rows}
            )
    return current


def _num_steps(trace: MemoryTrace) -> int:
    return len(set(trace.tables_["steps"].column("step").to_pylist()))


TEST_TEMPLATE = '''"""Standalone repro, minimized by mgtrace from {source}.

Replaying the trace beside this file under {rules} must report {signature!r}
at its first corrupt step, step {step}. Run with: python -m pytest {name}
"""

from pathlib import Path

from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader

TRACE = Path(__file__).resolve().parent / {trace_dir!r}


def test_minimized_repro() -> None:
    result = replay_trace(TraceReader(TRACE), RuleSet.parse({rules!r}))
    first = {{f.signature for f in result.findings if f.step == result.first_step}}
    assert result.first_step == {step}, result.findings[:3]
    assert {signature!r} in first, sorted(first)
'''


def write_trace(trace: MemoryTrace, output: Path, manifest: Manifest) -> None:
    """Write an in-memory trace as a trace directory, all or nothing: it is built under a
    temporary name and renamed into place; on any failure the temporary directory goes and
    an existing ``output`` stays as it was."""
    output = Path(output)
    _swap_in(_build_trace(trace, output, manifest), output)


def _build_trace(trace: MemoryTrace, output: Path, manifest: Manifest) -> Path:
    """The trace written in a hidden directory beside ``output``; removed on failure."""
    tmp = hidden_sibling(output, "new")
    try:
        tmp.mkdir(parents=True)
        m = replace(manifest, parts=[])
        for name, tab in trace.tables_.items():
            if tab.num_rows:
                rel = f"{name}/all-000000.parquet"
                m.parts.append(write_part_file(tmp, rel, tab.cast(TABLES[name].schema)))
        if trace.start_state is not None:
            for rank, cp in trace.start_state.checkpoints.items():
                if isinstance(cp, Checkpoint):
                    ckpt.save(tmp / START_STATE_DIR, rank, cp)
                else:  # the start state of the trace this one was cut from, as it was
                    (tmp / START_STATE_DIR).mkdir(exist_ok=True)
                    shutil.copyfile(cp, tmp / START_STATE_DIR / Path(cp).name)
            m.source = {
                **m.source,
                "start_state": {
                    "dir": START_STATE_DIR,
                    "request_ids": trace.start_state.request_ids,
                },
            }
        save_manifest(tmp, m)
    except BaseException as exc:  # Ctrl-C included: no half-written directory stays
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {output}: {exc.strerror or exc}") from None
        if isinstance(exc, OutputError):  # a file's own error names the hidden folder
            raise OutputError(exc.message.replace(str(tmp), str(output))) from None
        raise
    return tmp


def _swap_in(
    tmp: Path, output: Path, test_tmp: Path | None = None, test_file: Path | None = None
) -> None:
    """Swap the built trace ``tmp`` (and the test file ``test_tmp``) into place. Either the
    new files are in place or the old ones are, untouched; ``tmp`` and ``test_tmp`` never
    remain."""
    try:
        with replacing_directory(tmp, output):
            if test_tmp is not None and test_file is not None:
                os.replace(test_tmp, test_file)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if test_tmp is not None:
            with contextlib.suppress(OSError):
                test_tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {output}: {exc.strerror or exc}") from None
        raise


def _module_name(name: str) -> str:
    """``name`` as a Python identifier: pytest imports the test file by its stem."""
    return re.sub(r"\W", "_", name)


def _with_request_steps(trace: MemoryTrace) -> MemoryTrace:
    """The requests table's first_step and last_step in the repro's own step numbers (the
    steps are renumbered from 0; the requests table has no rank or step column of its own,
    so ``compact_steps`` leaves it as the trace minimized had it)."""
    t = trace.tables_
    requests = t["requests"]
    if not requests.num_rows:
        return trace
    seen: dict[str, list[int]] = {}
    for name in ("batch_rows", "sched"):
        tab = t[name]
        for req, step in zip(
            tab.column("req_id").to_pylist(), tab.column("step").to_pylist(), strict=True
        ):
            if step is not None and step >= 0:
                seen.setdefault(req, []).append(step)
    ids = requests.column("req_id").to_pylist()
    first = [min(seen[r]) if r in seen else None for r in ids]
    last = [max(seen[r]) if r in seen else None for r in ids]
    for col, values in (("first_step", first), ("last_step", last)):
        idx = requests.column_names.index(col)
        requests = requests.set_column(
            idx, requests.schema.field(idx), pa.array(values, requests.schema.field(idx).type)
        )
    return MemoryTrace(trace.manifest, {**t, "requests": requests}, trace.start_state)


def write_minimized(
    trace: MemoryTrace,
    output: Path,
    manifest: Manifest,
    source: Path,
    signature: str,
    first_step: int,
    rules: RuleSet,
    *,
    force: bool,
    original_step: int | None = None,
) -> Path:
    """Write the trace directory and ``test_<name>.py`` beside it; all or nothing."""
    output = Path(output)
    test_file = _refuse_existing_output(output, force)
    # the repro is whole by construction: it keeps the finding's rank, not the ranks the
    # recording lacked
    errors = {k: v for k, v in manifest.errors.items() if k != MISSING_RANKS}
    m = replace(manifest, complete=True, ground_truth=None, errors=errors)
    m.source = {
        "kind": "minimized",
        "from": str(source),
        "signature": signature,
        "first_step": first_step,
        # steps are renumbered from 0: where the finding was in the trace minimized
        "original_first_step": original_step,
        "rules": rules.canonical(),
    }
    text = TEST_TEMPLATE.format(
        source=source,
        rules=rules.canonical(),
        signature=signature,
        step=first_step,
        name=test_file.name,
        trace_dir=output.name,
    )
    tmp = _build_trace(_with_request_steps(trace), output, m)
    # the test file is written in full under a temporary name before anything is replaced
    test_tmp = test_file.with_name(f".{test_file.name}.tmp")
    try:
        atomic_write(test_tmp, lambda fh: fh.write(text.encode()))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_in(tmp, output, test_tmp, test_file)
    return test_file
