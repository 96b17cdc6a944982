"""The replay step loop: rules -> precopy -> forward model -> post-process -> oracle.

One ``RankReplay`` holds one rank's shadow state: the tag pool, the block tables, block
ownership and the oracle. Per step, in the engine's order:

1. the scheduler's block-id deltas update ownership;
2. a post-process deferred from an earlier batch (pipeline parallelism) runs first, on the
   tables as the previous step left them;
3. the step's block-table changes are applied;
4. the precopy runs, then the forward model reads (checked) and writes the tags of every
   batch row, padded rows write where their stale indices point;
5. the post-process runs, and the oracle checks the state each row will read next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mgtrace.errors import InconclusiveError, OutputError, UsageError
from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.plan import RowPlan
from mgtrace.kernels.reference import LaunchResult, run_reference
from mgtrace.kernels.validate import MalformedMetadata, Validation
from mgtrace.replayer.findings import MALFORMED, Finding
from mgtrace.replayer.mirror import MirroredKernels
from mgtrace.replayer.oracle import READ_KINDS, Oracle, StateRead
from mgtrace.replayer.ownership import BlockOwnership
from mgtrace.replayer.requests import BUILDER, DUMMY_REQUEST, PADDED_ROW, SCHEDULER
from mgtrace.replayer.rules import AS_RECORDED, RuleSet
from mgtrace.replayer.steps import (
    RankTrace,
    check_ranks,
    first_hole,
    ranks_of,
    require_replayable,
    spec_decodes_run_first,
)
from mgtrace.replayer.tables import OutOfPool, TableStore
from mgtrace.replayer.tags import DRAFTS_FOLDED, DUMMY, SPECULATIVE, TagPool
from mgtrace.replayer.view import RowView, launch_under_rules, row_view
from mgtrace.schemas.reader import TraceReader

Backend = Callable[..., LaunchResult]
DECODE_READ, PREFILL_READ, NEXT_STATE, CACHED_STATE = (
    READ_KINDS.index(k) for k in ("decode-read", "prefill-read", "next-state", "cached-state")
)
BACKENDS = ("reference", "triton")

log = logging.getLogger("mgtrace")


def load_backend(name: str, device: str) -> Backend:
    if name == "reference":
        if device != "cpu":
            raise UsageError("the reference backend runs on the CPU; use --backend triton")
        return run_reference
    if name == "triton":
        from mgtrace.kernels.runtime import load_triton_kernels

        load_triton_kernels(device)  # compiled or interpreted, before the module is used
        from mgtrace.kernels.streamed import StreamedTriton

        return StreamedTriton()
    raise UsageError(f"unknown backend {name!r}; choose reference or triton")


@dataclass
class Checkpoint:
    step: int  # the last step applied
    pool: np.ndarray
    tables: dict[str, list[np.ndarray]]
    ownership: tuple
    wrote: np.ndarray
    repeats: dict[tuple[int, str], int]
    findings: int
    views: dict[int, RowView]


@dataclass
class _ForwardWrites:
    """The forward model's writes of one step, in the engine's kernel-group order:
    temporal states per token (``*_a``) and conv windows per request (``*_c``); ``first_*``
    marks those of the kernel group that runs first."""

    blocks_a: np.ndarray  # [group, write]
    uids_a: np.ndarray
    tokens: np.ndarray
    flags: np.ndarray
    brow_a: np.ndarray
    first_a: np.ndarray
    blocks_c: np.ndarray  # [group, request]
    uid_c: np.ndarray
    last: np.ndarray
    first_c: np.ndarray


@dataclass
class _Checkpoints:
    """Prefill checkpoints one step stores: blocks per group, and per row its request,
    batch row and the tokens the state covers."""

    blocks: np.ndarray
    uids: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray  # the rows' positions in the step's view
    cols: np.ndarray


@dataclass
class RankReplay:
    trace: RankTrace
    rules: RuleSet
    backend: Backend
    layout: str = "compact"
    device: str = "cpu"
    # Check reads in bulk every ``flush_every`` steps instead of at once; the default defers
    # on a GPU, where an immediate check waits for the device on every read.
    defer_reads: bool | None = None
    flush_every: int = 64
    # A device backend on compact tags runs on a device copy of a host pool (see mirror.py);
    # False keeps the tags on the device only (how the full layout always runs).
    mirror: bool | None = None
    oracle: Oracle = field(init=False)

    def __post_init__(self) -> None:
        run = self.trace.run
        self.k = run.num_speculative_tokens
        self.block_size = run.mamba_block_size
        self.runner = run.runner
        on_device_pool = getattr(self.backend, "runs_on_device_pool", False)
        if self.mirror is None:
            self.mirror = on_device_pool and self.layout == "compact"
        elif self.mirror and not on_device_pool:
            raise UsageError("only a device backend (triton) runs on a mirrored tag pool")
        if self.mirror:
            self.pool = TagPool(run, layout=self.layout, device="cpu", mirror=self.device)
            self.backend = MirroredKernels(self.backend, self.pool)
        else:
            self.pool = TagPool(run, layout=self.layout, device=self.device)
        groups = len(self.pool.groups)
        # [group, conv|temporal]: the kinds of state each group has (ids at another are unread)
        self._has_conv_temporal = np.array(
            [[gs.conv is not None, gs.temporal is not None] for gs in self.pool.groups], bool
        ).reshape(groups, 2)
        kinds = ("v1",) if self.runner == "v1" else ("source", "input")
        self.own_kind = kinds[0]
        self.trace.require_known_tables(groups, kinds)
        rows, width = self.trace.table_dims(self.k)
        self.tables = TableStore(kinds, groups, rows, width, run.num_blocks)
        self.ownership = BlockOwnership(
            groups,
            run.num_blocks or 1,
            block_size=self.block_size,
            spec_blocks=self.k,
            num_uids=len(self.trace.ids.names) + 1,
        )
        # (group, block) -> uid: the blocks this step's scheduler freed as their request
        # moved past them, finished or was preempted (see ``_run_copy`` for a deferred
        # post-process)
        self._freed_now: dict[tuple[int, int], int] = {}
        width0 = self.pool.groups[0].width if self.pool.groups else 0
        conv_keep = width0 - self.k if width0 > self.k else width0
        self._conv_lead = width0 - 1 - conv_keep  # a conv window's last row, past its state
        self._decodes_run_first = spec_decodes_run_first(run)
        # Without MTP a GDN layer runs every row in one call: no order between its rows.
        self._one_kernel_group = self._decodes_run_first and self.k == 0
        # With MTP it does too in a step without a spec-decode row (GDN's builder has no
        # spec mask then, and the recorder keeps its threshold, 1; with a mask, none).
        self._gdn_one_call_steps = (
            self._decodes_run_first
            and not self._one_kernel_group
            and "mamba_threshold" in self.trace.step_info
        )
        self._written_mark = np.zeros((run.num_blocks or 1) + 2, dtype=bool)
        self.oracle = Oracle(
            rank=self.trace.rank,
            ids=self.trace.ids,
            pool=self.pool,
            ownership=self.ownership,
            conv_keep=conv_keep,
            # state written before a recording that attached mid-run: no replay can see it
            unwritten_unknown=self.trace.began_mid_run,
            defer_reads=(
                self.device != "cpu" and not self.mirror
                if self.defer_reads is None
                else self.defer_reads
            ),
        )
        self.views: dict[int, RowView] = {}
        self.keep_views = max(run.pp_size, 1) + 2
        self._touched_after_forward: list[np.ndarray] = []
        self._window = np.arange(self.k + 1)[None, :]  # a decode's window columns

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self, step: int) -> Checkpoint:
        """Everything the replay carries from one step to the next, after ``step``."""
        self.flush()
        o = self.oracle
        return Checkpoint(
            step=step,
            pool=self.pool.snapshot(),
            tables=self.tables.snapshot(),
            ownership=self.ownership.snapshot(),
            wrote=o.wrote.copy(),
            repeats=dict(o.repeats),
            findings=len(o.findings),
            views=dict(self.views),
        )

    def restore(self, cp: Checkpoint) -> None:
        o = self.oracle
        o.discard_pending()
        self.pool.restore(cp.pool)
        self.tables.restore(cp.tables)
        self.ownership.restore(cp.ownership)
        o.wrote = cp.wrote.copy()
        o.repeats = dict(cp.repeats)
        del o.findings[cp.findings :]
        self.views = dict(cp.views)

    def run(
        self,
        *,
        start: int = 0,
        until: int | None = None,
        stop_on_finding: bool = False,
        checkpoints: dict[int, Checkpoint] | None = None,
        every: int = 256,
        progress: Callable[[int], None] | None = None,
        on_checkpoint: Callable[[Checkpoint], None] | None = None,
        report_from: int | None = None,
    ) -> int:
        """Replay steps ``start..until``; return the last step replayed (start-1 if none).

        With ``stop_on_finding`` it stops after the first step that produced a finding; with
        ``checkpoints`` it keeps a checkpoint every ``every`` steps (before step s, keyed s).
        With ``report_from`` the oracle forgets what it reported before it replays that step
        (the first step of a window): inside the window, each request's first occurrence of
        a finding is reported, whatever happened before it.
        """
        last = start - 1
        for step in self.trace.steps_from(start):
            if until is not None and step > until:
                break
            if step % every == 0 and step > start:
                if checkpoints is not None:
                    checkpoints[step] = self.checkpoint(step - 1)
                if on_checkpoint is not None:
                    on_checkpoint(self.checkpoint(step - 1))
            elif checkpoints is not None and step == 0:
                checkpoints[0] = self.checkpoint(-1)
            if report_from is not None and last < report_from <= step:
                # after the checkpoints; what a restored one remembered is forgotten too
                self.flush()
                self.oracle.forget_reports()
            before = len(self.oracle.findings)
            self._step(step)
            last = step
            if progress is not None:
                progress(1)
            if stop_on_finding or step % self.flush_every == 0:
                self.flush()
            if stop_on_finding and len(self.oracle.findings) > before:
                break
        self.flush()
        return last

    def flush(self) -> None:
        """Check what was left for later: deferred reads, the kernels' own results."""
        self.oracle.flush()
        verify = getattr(self.backend, "verify", None)
        if verify is not None:
            verify()

    # ----------------------------------------------------------------- the step
    def step(self, step: int) -> None:
        """Replay one step; its findings are in ``oracle.findings`` on return."""
        self._step(step)
        self.flush()

    def skip_to(self, until: int) -> int:
        """Apply steps ``0..until`` without kernels or checks: the block tables, block
        ownership, which requests have a state of their own and the recent row views come
        out as a replay leaves them; the tags and the findings stay as they were. Returns the
        last step applied (-1 if none). This is the exact part of a segment's start state
        (see ``parallel``). Only ownership needs every step in turn: the tables take each
        row's last update, and the requests with a state of their own come from the rows."""
        views_from = until - self.keep_views  # older views are dropped before they are used
        steps = [s for s in self.trace.steps_from(0) if s <= until]
        for step in steps:
            if step > views_from:
                self._enter(step)
            else:
                self._own(step)  # a re-add here clears what the request had written
        if not steps:
            return -1
        self.tables.apply(self.trace.last_table_updates(steps))
        self.oracle.mark_written(self.trace.written_through(steps))
        return steps[-1]

    def _enter(self, step: int) -> RowView:
        """A step's row view under the rules and its scheduler's block-id changes: what its
        kernels and checks depend on, and no tag does."""
        trace = self.trace
        # The recorded threshold matters only to a rule that re-runs the reorder.
        rethreshold = self.rules["reorder_threshold"] != AS_RECORDED
        view = row_view(
            trace.batch(step),
            self.rules,
            recorded_threshold=trace.step_value("reorder_threshold", step) if rethreshold else None,
            k=self.k,
            runner=self.runner,
            builder_threshold=trace.step_value("mamba_threshold", step) if rethreshold else None,
            gdn=self._decodes_run_first,
            persistent_order=lambda threshold: trace.persistent_order(step, threshold),
        )
        self.views[step] = view
        self.views.pop(step - self.keep_views, None)
        self._own(step)
        return view

    def _own(self, step: int) -> None:
        if self.oracle.unwritten_unknown:  # no start state says what came before the trace
            for uid, rows, freed_below in self.trace.in_flight_rows.get(step, ()):
                self.ownership.seed(uid, step, rows, freed_below)  # running before it
        # align mode frees the blocks a request moved past as it schedules, before it allocates
        freed = self.ownership.retire(*self.trace.running(step))
        self._freed_now = {(group, block): uid for uid, group, _, block in freed}
        sched = self.trace.sched(step)
        if sched["uid"]:
            # a request that finishes or is preempted lets go of its whole row
            let_go = self.ownership.apply(step, sched["uid"], sched["kind"], sched["new_block_ids"])
            self._freed_now.update(((group, block), uid) for uid, group, block in let_go)
            kinds = sched["kind"]
            resumed = [u for u, k in zip(sched["uid"], kinds, strict=True) if k == "resumed"]
            if resumed:
                self.oracle.start_over(np.array(resumed, np.int64))

    def _step(self, step: int) -> None:
        trace = self.trace
        view = self._enter(step)
        self._check_decode_count(step)
        self._copy_blocks(step)
        launches = [
            launch_under_rules(launch, self.rules, runner=self.runner)
            for launch in trace.launches(step)
        ]
        for launch in launches:
            if launch.batch_step is not None and launch.batch_step < step:
                self._run_copy(step, launch)
        updates = trace.table_updates(step)
        for entry in self.tables.apply(updates):
            self._report_out_of_pool(step, entry, view)
        self._check_scheduled_rows(step, view, updates)
        current = [x for x in launches if x.batch_step is None or x.batch_step >= step]
        for launch in current:
            if launch.kernel == "precopy":
                self._run_copy(step, launch)
        self._forward(step, view)
        for launch in current:
            if launch.kernel == "aligned_indices":
                self._padded_rows(step, launch, view)
        for launch in current:
            if launch.kernel == "postprocess":
                self._run_copy(step, launch)

    def _check_decode_count(self, step: int) -> None:
        """The Mamba builder's recorded decode count must agree with its rows' recorded split
        (rules aside: this is the recording's own metadata). A positional split runs its
        first ``num_decodes`` rows as decodes (a count past the rows: padded rows); a GDN
        spec mask (a step without a builder threshold) marks rows anywhere, and both the
        count and the rows' split are read from it, so the rows never mark more."""
        got = self.trace.recorded_split(step)
        if got is None:
            return
        recorded, prefill = got
        decode = ~prefill
        marked = int(np.count_nonzero(decode))
        who: tuple[int, str] = (DUMMY_REQUEST, BUILDER)
        row: int | None = None
        masked = (
            self._decodes_run_first
            and self.k > 0
            and self.trace.step_value("mamba_threshold", step) is None
        )
        if masked:
            if recorded >= marked:
                return
        else:
            wrong = np.flatnonzero(decode != (np.arange(len(decode)) < recorded))
            if not len(wrong):
                return
            batch = self.trace.batch(step)
            row = int(batch.cols["batch_row"][wrong[0]])
            uid = int(batch.uid[wrong[0]])
            who = (uid, self.trace.ids.name(uid))
        self._malformed(
            step,
            "steps:num-decodes-mismatch",
            who,
            row,
            f"the Mamba builder recorded {recorded} decode row(s), but the step's rows mark "
            f"{marked} of {len(decode)} as decodes"
            + (f" (row {row} first disagrees)" if row is not None else ""),
        )

    def _copy_blocks(self, step: int) -> None:
        """The scheduler's whole-block copies (copy-on-write of partially hit prefix blocks),
        which the engine runs before the step's kernels. A pair naming no block of the pool,
        or lists of different lengths, is malformed and not copied."""
        copies = self.trace.block_copies(step)
        if copies is None:
            return
        src, dst = copies
        n = min(len(src), len(dst))
        num_blocks = self.ownership.num_blocks
        ok = (src[:n] > 0) & (src[:n] < num_blocks) & (dst[:n] > 0) & (dst[:n] < num_blocks)
        if n < max(len(src), len(dst)) or np.count_nonzero(ok) < n:
            self._malformed(
                step,
                "block-copy:bad-pair",
                (DUMMY_REQUEST, SCHEDULER),
                None,
                f"the step's block copies ({len(src)} sources, {len(dst)} destinations) name "
                f"blocks outside 1..{num_blocks - 1} or do not pair up; those are not copied",
            )
        src, dst = src[:n][ok], dst[:n][ok]
        self.oracle.check_copy_destinations(step, src, dst)
        self.pool.copy_blocks(src, dst)

    # ----------------------------------------------------------------- kernels
    def _run_copy(self, step: int, launch: AlignLaunch) -> None:
        kind = launch.bt_table or self.own_kind
        if kind not in self.tables.tables:
            kind = self.own_kind
        self.pool.settle()  # the kernels read the tags written so far
        result = self.backend(launch, self.pool.pool, self.tables.block_tables(kind))
        view = self.views.get(launch.batch_step if launch.batch_step is not None else step)
        self._report_problems(step, launch, result.validation, view)
        copies = result.validation.copies
        if copies.rows.size and view is not None:
            rows = launch.column("batch_row")[copies.rows]
            uid = view.uid_at(view.positions(rows))
            # A post-process deferred from an earlier step (V2 pipeline parallelism) runs at
            # the start of this one, before the forward: a boundary copy into a block its own
            # request's scheduling freed at this step lands before any new owner uses it.
            deferred = launch.batch_step is not None and launch.batch_step < step
            own_until_now = self._freed_now if deferred else None
            # The state a copy moves must come from the request's own blocks: a source the
            # scheduler never gave it (another prompt's block that merely holds a state of
            # the right count, the null block) is no prefix share, whatever its tags say.
            groups = len(self.pool.groups)
            self.oracle.check_sources(
                step,
                f"{launch.kernel}-read",
                copies.blocks[:groups, 1:],  # conv, temporal sources
                self._has_conv_temporal,
                uid,
                rows,
                own_until_now,
                into=copies.dst[:groups],
            )
            if launch.kernel == "precopy" and view.step == step:
                self._check_precopy_columns(step, result.validation.plan, launch, copies.rows, view)
            for g in range(len(self.pool.groups)):
                self.oracle.check_writes(
                    step, f"{launch.kernel}-copy", g, copies.dst[g], uid, rows, own_until_now
                )
        if launch.kernel == "postprocess" and view is not None:
            if copies.rows.size:
                self._touched_after_forward.append(copies.dst.ravel())
            self._check_next_state(step, launch, result, view)

    def _check_scheduled_rows(
        self, step: int, view: RowView, updates: list[tuple[int, str, int, list[int]]]
    ) -> None:
        """The worker's block-table row of a request is its scheduler rows appended (replaced
        on a resume): at the columns this step's kernels and forward use (the previous
        running column through the last speculative one), a block id other than the one
        the scheduler handed out makes the request read or write a block that is not its
        state, however its tags look. Checked where a row or its scheduler row changed."""
        if not view.num_rows:
            return
        changed_uids = set(self.trace.sched_uids(step).tolist())
        changed_rows = {row for _, kind, row, _ in updates if kind == self.own_kind}
        if not changed_uids and not changed_rows:
            return
        table = self.tables.tables[self.own_kind]
        # A few rows change a step: find them with one comparison per change.
        changed = np.zeros(view.num_rows, dtype=bool)
        for uid in changed_uids:
            changed |= view.uid == uid
        for slot in changed_rows:
            changed |= view.slot == slot
        for p in np.flatnonzero(changed & (view.slot >= 0)).tolist():
            slot, uid = int(view.slot[p]), int(view.uid[p])
            held = self.ownership.rows_of(uid)
            if held is None:
                continue
            sc, prev = int(view.state_col[p]), int(view.prev_state_col[p])
            lo = max(prev if 0 <= prev < sc else sc, 0)
            for g, row in enumerate(held[: len(table)]):
                if slot >= table[g].shape[0]:
                    continue
                hi = min(sc + self.k + 1, len(row))
                # Columns past the table's width read as -1 (no block): nothing to compare.
                got = table[g][slot, lo:hi].tolist()
                if got == row[lo : lo + len(got)]:
                    continue
                col = next((lo + i for i, b in enumerate(got) if b >= 0 and b != row[lo + i]), None)
                if col is None:
                    continue
                self._malformed(
                    step,
                    "block-table:not-scheduled",
                    (uid, self.trace.ids.name(uid)),
                    int(view.batch_row[p]),
                    f"column {col} of the block-table row of request "
                    f"{self.trace.ids.name(uid)} (group {g}) holds block {got[col - lo]}, but "
                    f"the scheduler gave it block {row[col]} there",
                    group=g,
                    block_id=got[col - lo],
                )

    def _held_throughout(self, uid: int, since: int, step: int) -> bool:
        """Whether ``uid`` holds its blocks now and kept them from step ``since`` to
        ``step``: no preemption, finish or resume of it in between."""
        if self.ownership.rows_of(uid) is None:
            return False
        moved = self.trace.moved_uids
        return not any(np.count_nonzero(moved(s) == uid) for s in range(since + 1, step + 1))

    def _check_precopy_columns(
        self, step: int, plan: RowPlan, launch: AlignLaunch, rows: np.ndarray, view: RowView
    ) -> None:
        """A precopy moves the running state from the batch row's previous column into its
        running column, the one the forward reads: a copy between other columns writes a
        block nothing reads next (a saved boundary state, say) and leaves the running
        column as it was."""
        pos = view.positions(launch.column("batch_row")[rows])
        at = np.maximum(pos, 0)
        dst, src = plan.dst_col[rows], plan.src_col[rows]
        bad = (dst != view.state_col[at]) | (src != view.prev_state_col[at])
        if not np.count_nonzero(bad):
            return
        bad &= pos >= 0
        for i in np.flatnonzero(bad).tolist():
            p = int(pos[i])
            uid = int(view.uid[p])
            self._malformed(
                step,
                "precopy:columns-not-batch-row",
                (uid, self.trace.ids.name(uid)),
                int(view.batch_row[p]),
                f"the precopy copies column {int(src[i])} to column {int(dst[i])}, but the "
                f"batch row moves from column {int(view.prev_state_col[p])} to its running "
                f"column {int(view.state_col[p])}",
            )

    def _report_problems(
        self, step: int, launch: AlignLaunch, validation: Validation, view: RowView | None
    ) -> None:
        for p in validation.problems:
            self._malformed(
                step,
                f"{launch.kernel}:{p.what}",
                self._row_owner(view, p.batch_row),
                p.batch_row,
                p.sentence(),
                group=p.group,
            )

    def _report_out_of_pool(self, step: int, entry: OutOfPool, view: RowView) -> None:
        """A block-table row names a block outside the pool: the replay reads it as no
        block."""
        batch_row: int | None = entry.row
        if entry.kind == "source":  # V2 source tables are indexed by request slot
            hit = np.flatnonzero(view.slot == entry.row)
            batch_row = int(view.batch_row[hit[0]]) if len(hit) else None
        who = (
            self._row_owner(view, batch_row)
            if batch_row is not None
            else (DUMMY_REQUEST, f"<slot {entry.row}>")
        )
        self._malformed(
            step,
            "block-table:block-id-out-of-pool",
            who,
            batch_row,
            f"row {entry.row} of the {entry.kind} block table (group {entry.group}) holds "
            f"block id {entry.block_id}, outside the pool of {self.tables.num_blocks} "
            "blocks; it is replayed as no block",
            group=entry.group,
            block_id=entry.block_id,
        )

    def _malformed(
        self,
        step: int,
        mechanism: str,
        who: tuple[int, str],
        batch_row: int | None,
        detail: str,
        **where: int | None,
    ) -> None:
        """Report malformed input at ``step``; ``who`` is the (uid, name) it is filed under."""
        uid, name = who
        self.oracle._report(
            uid,
            Finding(
                kind=MALFORMED,
                mechanism=mechanism,
                rank=self.trace.rank,
                step=step,
                req_id=name,
                batch_row=batch_row,
                detail=detail,
                **where,
            ),
        )

    def _row_owner(self, view: RowView | None, batch_row: int) -> tuple[int, str]:
        pos = -1 if view is None else int(view.positions(np.array([batch_row]))[0])
        if pos < 0:
            return DUMMY_REQUEST, PADDED_ROW
        uid = int(view.uid[pos])
        return uid, self.trace.ids.name(uid)

    def _check_next_state(
        self, step: int, launch: AlignLaunch, result: LaunchResult, view: RowView
    ) -> None:
        """After the post-process: the state each row will read next must be its own, whole."""
        b = view.positions(launch.column("batch_row"))
        keep = (launch.column("req_slot") >= 0) & (b >= 0)
        if result.validation.problems:
            keep &= ~result.validation.bad
        # A row launched as padding copies nothing; where its batch row is a live request
        # that sampled and has held its blocks ever since, the boundary copy it owed is
        # lost all the same (a masked row of a request finished or preempted since, even
        # one resumed by now, owes none).
        checked = keep
        padded = (launch.column("req_slot") < 0) & (b >= 0)
        if np.count_nonzero(padded):
            owed = padded & (view.accepted64[np.maximum(b, 0)] >= 1)
            for i in np.flatnonzero(owed).tolist():
                owed[i] = self._held_throughout(int(view.uid[b[i]]), view.step, step)
            checked = keep | owed
        self._check_cached_state(step, result.validation.plan, view, b, checked)
        # count_nonzero: a fraction of the cost of .all()/.any() on arrays this small.
        kept = np.count_nonzero(keep)
        if kept < len(keep):
            if not kept:
                return
            b = b[keep]
            acc_out = result.accepted_out[keep].astype(np.int64)
        else:
            acc_out = result.accepted_out.astype(np.int64)
        acc, n = view.accepted64[b], view.scheduled64[b]
        offset = np.maximum(acc_out - 1, 0)
        if view.step == step:
            # A decode-split row's next state is the column the forward model just wrote for
            # it, unless something wrote there since (a padded row, a copy) or the counts do
            # not line up; only those rows, and prefill-split rows, need the read.
            must = view.prefill_split[b] | (acc_out != np.maximum(acc, 1)) | (acc_out > n)
            touched = self._touched_after_forward
            if touched:
                mark = np.zeros(self.ownership.num_blocks + 1, dtype=bool)
                hit = np.concatenate(touched)
                mark[hit[(hit >= 0) & (hit < len(mark))]] = True
                col = view.state_col64[b]
                cols = np.empty((2, len(b)), dtype=np.int64)  # the columns read next, and now
                np.add(col, offset, out=cols[0])
                cols[1] = col
                blocks = self.tables.gather_groups(self.own_kind, view.slot64[b], cols)
                inside = (blocks >= 0) & (blocks < len(mark))
                must |= (inside & mark[np.where(inside, blocks, 0)]).any(axis=(0, 1))
            reads = np.count_nonzero(must)
            if not reads:  # often: every row's next state is the one just written
                return
            if reads < len(must):
                b, acc, n, offset = b[must], acc[must], n[must], offset[must]
        # Expected tokens only for the rows that read.
        c = view.computed64[b]
        expected = np.where(acc >= 1, c + n - view.draft64[b] + acc - 1, c + n)
        self._read(step, np.full(len(b), NEXT_STATE), view, b, expected, offset, offset)

    def _check_cached_state(
        self, step: int, plan: RowPlan, view: RowView, b: np.ndarray, keep: np.ndarray
    ) -> None:
        """After a post-process: a row that crossed a block boundary saved the state at the
        boundary into the boundary block's column; when that is not its running column, the
        request's own block there must hold its state at the boundary, whatever block the
        kernel wrote. (With the running column, ``_check_next_state`` reads it anyway.)

        Which rows crossed a boundary is decided twice: by the kernel's own inputs (the
        column it copied into) and by the batch rows' counts, as the forward model knows
        them. A kernel fed a wrong count skips a copy the request needed; the second
        decision still reads that column, so the lost copy is named at this step."""
        saved = keep & plan.copies & (plan.src_col != plan.dst_col)
        at, want = self._boundary_rows(view, b, keep)
        if len(at):  # the rows the kernel saved into the same column are read below anyway
            lost = ~(saved[at] & (plan.dst_col[at] == want))
            at, want = at[lost], want[lost]
        if len(at):  # never in a consistent trace: the two decisions agree
            rows = np.concatenate([b[saved], b[at]])
            dst = np.concatenate([plan.dst_col[saved].astype(np.int64), want])
        elif np.count_nonzero(saved):
            rows, dst = b[saved], plan.dst_col[saved].astype(np.int64)
        else:
            return
        blocks = self.tables.gather_groups(self.own_kind, view.slot64[rows], dst)
        # a null column: the engine keeps no state there (in any group: groups share columns)
        kept = (blocks > 0).all(axis=0)
        if not np.count_nonzero(kept):
            return
        rows, dst = rows[kept], dst[kept]
        rel = dst - view.state_col64[rows]
        boundary = (dst + 1) * self.block_size
        zero = np.zeros(len(rows), dtype=np.int64)
        self._read(step, np.full(len(rows), CACHED_STATE), view, rows, boundary, rel, zero, rel)

    def _boundary_rows(
        self, view: RowView, b: np.ndarray, keep: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The post-process rows (indices into ``b``, view positions, among ``keep``) whose
        batch row's counts cross a block boundary in a column other than the running one,
        and that column. The counts are the ones ``_check_next_state`` expects the state to
        cover: ``R = computed + scheduled - draft`` in the running state, ``R + accepted - 1``
        after acceptance. A row that sampled nothing (accepted -1) ends in its running
        column, whose state the next-state check reads."""
        none = np.zeros(0, dtype=np.int64)
        if not view.num_rows:
            return none, none
        # positions of -1 (rows the view lacks) index its last row: ``keep`` drops them
        acc = view.accepted64[b]
        running = view.computed64[b] + view.scheduled64[b] - view.draft64[b]
        # A boundary lies in (R-1, R+accepted-1] exactly when mod B + accepted >= B
        # (which an accepted count below 1 never reaches).
        cross = ((running - 1) % self.block_size + acc >= self.block_size) & keep
        at = cross.nonzero()[0]
        if not len(at):
            return none, none
        col = (running[at] + acc[at] - 1) // self.block_size - 1
        other = (col >= 0) & (col != view.state_col64[b[at]])
        return at[other], col[other]

    # ----------------------------------------------------------------- forward model
    def _read(
        self,
        step: int,
        what: np.ndarray,
        view: RowView,
        rows: np.ndarray,
        expected: np.ndarray,
        temporal_col: np.ndarray,
        conv_offset: np.ndarray,
        conv_col: np.ndarray | None = None,
    ) -> None:
        """Check the state ``rows`` read: temporal from ``temporal_col`` and conv from
        ``conv_col`` (both relative to the row's running column; conv from the running
        column itself by default), conv rows from ``conv_offset`` on."""
        if not len(rows):
            return
        blocks = self._read_blocks(view, rows, temporal_col, conv_col)
        self._check_reads(step, what, view, rows, expected, blocks, conv_offset)

    def _read_blocks(
        self,
        view: RowView,
        rows: np.ndarray,
        temporal_col: np.ndarray,
        conv_col: np.ndarray | None,
    ) -> np.ndarray:
        """[group, temporal|conv, row] block ids ``rows`` read (see ``_read``)."""
        col = view.state_col64[rows]
        # Temporal and conv columns as one [2, rows] gather (the slots broadcast over both).
        cols = np.empty((2, len(rows)), dtype=np.int64)
        np.add(col, temporal_col, out=cols[0])
        if conv_col is None:
            cols[1] = col
        else:
            np.add(col, conv_col, out=cols[1])
        return self.tables.gather_groups(self.own_kind, view.slot64[rows], cols)

    def _check_reads(
        self,
        step: int,
        what: np.ndarray,
        view: RowView,
        rows: np.ndarray,
        expected: np.ndarray,
        blocks: np.ndarray,
        conv_offset: np.ndarray,
    ) -> None:
        if not len(rows):
            return
        # The counts arrive as int64 already (the view's columns); asarray keeps them as they
        # are instead of copying. Nothing writes into a StateRead's arrays.
        self.oracle.check_reads(
            step,
            StateRead(
                what=what,
                rows=view.batch_row[rows],
                uid=view.uid64[rows],
                expected_tokens=np.asarray(expected, dtype=np.int64),
                temporal_blocks=blocks[:, 0],
                conv_blocks=blocks[:, 1],
                conv_offset=np.asarray(conv_offset, dtype=np.int64),
            ),
        )

    def _forward(self, step: int, view: RowView) -> None:
        """The model's Mamba layers on this step's rows. The engine runs two kernel groups
        one after the other, each reading its rows' states and then writing them: Mamba2 its
        prefill split first, GDN its spec decodes first (without MTP, GDN runs all rows in one
        call: every read comes before the writes). A row of the second group that reads a
        block the first group wrote sees that write; when no row does (nearly always), all
        reads are checked at once, before any write, with the same result."""
        self._touched_after_forward = []
        if not view.num_rows:
            return
        live = view.slot >= 0
        all_live = np.count_nonzero(live) == len(live)  # cheaper than live.all()
        prefill = view.prefill_split
        first = ~prefill if self._decodes_run_first else prefill
        c, n, d = view.computed64, view.scheduled64, view.draft64
        # Reads: decodes from window column accepted-1, prefills from column 0 (with context).
        rows = (live & (~prefill | (c > 0))).nonzero()[0]
        pre_r = prefill[rows]
        col = np.where(pre_r | view.moved[rows], 0, view.accepted_prev64[rows] - 1)
        read_blocks = self._read_blocks(view, rows, col, None)
        what = np.where(pre_r, PREFILL_READ, DECODE_READ)
        groups = len(self.pool.groups)
        self.oracle.check_sources(
            step,
            "forward-read",
            read_blocks[:groups],
            self._has_conv_temporal[:, ::-1],  # the forward reads temporal, conv
            view.uid64[rows],
            view.batch_row[rows],
        )
        # Writes: decodes write 1+d states (one per token), prefills fold all and write one;
        # in the engine's group order (where two rows write one block, the later one wins).
        order = view.group_order(first, None if all_live else live)
        first_o, pre_o = first[order], prefill[order]
        rows_o, j = (self._window < np.where(pre_o, 1, n[order])[:, None]).nonzero()
        rows_a = order[rows_o]
        pre_a = pre_o[rows_o]
        # Temporal (per token) and conv (per request) blocks in one gather.
        blocks = self.tables.gather_groups(
            self.own_kind,
            np.concatenate([view.slot64[rows_a], view.slot64[order]]),
            np.concatenate([view.state_col64[rows_a] + j, view.state_col64[order]]),
        )
        if self.runner == "v2":
            self._check_input_table(
                step,
                view,
                np.concatenate([rows, rows_a]),
                np.concatenate([view.state_col64[rows] + col, view.state_col64[rows_a] + j]),
                np.concatenate([read_blocks[:, 0], blocks[:, : len(rows_a)]], axis=1),
            )
        writes = _ForwardWrites(
            blocks_a=blocks[:, : len(rows_a)],
            uids_a=view.uid64[rows_a],
            tokens=c[rows_a] + np.where(pre_a, n[rows_a], j + 1),
            flags=np.where(
                pre_a, np.where(d[rows_a] > 0, DRAFTS_FOLDED, 0), np.where(j > 0, SPECULATIVE, 0)
            ),
            brow_a=view.batch_row[rows_a],
            first_a=first_o[rows_o],
            # Conv: one window per request, in its running column; row i holds position
            # R-K+1+i where R is what the running state covers (a prefill folds its drafts in
            # as well).
            blocks_c=blocks[:, len(rows_a) :],
            uid_c=view.uid64[order],
            last=(c + n - np.where(prefill, 0, d) + self._conv_lead)[order],
            first_c=first_o,
        )
        for g in range(len(self.pool.groups)):  # ownership and collisions: all of the step's
            ok = writes.blocks_a[g] >= 0
            kept = slice(None) if np.count_nonzero(ok) == len(ok) else ok
            self.oracle.check_writes(
                step,
                "forward-write",
                g,
                writes.blocks_a[g][kept],
                writes.uids_a[kept],
                writes.brow_a[kept],
            )
        ckpt = self._prefill_checkpoints(view, live & prefill)
        if ckpt is not None and self.runner == "v2":
            self._check_input_table(step, view, ckpt.positions, ckpt.cols, ckpt.blocks)
        # Mamba2's prefill kernels store the checkpoints, before its decodes run.
        ckpt_first = ckpt is not None and not self._decodes_run_first
        first_r = first[rows]
        one_group = self._one_kernel_group or (
            self._gdn_one_call_steps and self.trace.step_value("mamba_threshold", step) == 1
        )
        if not one_group and self._second_reads_first_writes(
            writes, read_blocks, first_r, ckpt if ckpt_first else None
        ):
            second = ~first_r
            r1, r2 = rows[first_r], rows[second]
            self._check_reads(
                step, what[first_r], view, r1, c[r1], read_blocks[:, :, first_r], col[first_r]
            )
            self._write_states(step, writes, True)
            if ckpt_first:
                self._write_checkpoints(step, ckpt)
            self._check_reads(
                step, what[second], view, r2, c[r2], read_blocks[:, :, second], col[second]
            )
            self._write_states(step, writes, False)
        else:
            self._check_reads(step, what, view, rows, c[rows], read_blocks, col)
            if ckpt_first:
                self._write_states(step, writes, True)
                self._write_checkpoints(step, ckpt)
                self._write_states(step, writes, False)
            else:
                self._write_states(step, writes, None)
        if ckpt is not None and not ckpt_first:
            self._write_checkpoints(step, ckpt)
        self.oracle.mark_written(writes.uid_c)  # the step's live rows' requests

    def _second_reads_first_writes(
        self,
        writes: _ForwardWrites,
        read_blocks: np.ndarray,
        first_r: np.ndarray,
        ckpt: _Checkpoints | None,
    ) -> bool:
        """Whether a row of the second kernel group reads a block the first group writes
        (any group of layers: a false alarm only costs the exact, slower path)."""
        second = ~first_r
        if not np.count_nonzero(second) or not np.count_nonzero(writes.first_c):
            return False
        mark = self._written_mark  # all False between calls
        end = len(mark) - 1  # where ids outside the pool land
        mark[_clamped(writes.blocks_a[:, writes.first_a], end)] = True
        mark[_clamped(writes.blocks_c[:, writes.first_c], end)] = True
        if ckpt is not None:
            mark[_clamped(ckpt.blocks, end)] = True
        mark[0] = mark[end] = False  # the null block, no block: no state to see
        hit = np.count_nonzero(mark[_clamped(read_blocks[:, :, second], end)])
        mark.fill(False)
        return bool(hit)

    def _check_input_table(
        self,
        step: int,
        view: RowView,
        positions: np.ndarray,
        cols: np.ndarray,
        own: np.ndarray,
    ) -> None:
        """V2: the forward takes its state indices from the gathered, batch-ordered input
        tables, while the replay follows each request's source row (``own``: [group, n], the
        blocks at view ``positions`` and absolute ``cols``). The gather copies the source row
        of ``idx_mapping[b]`` into input row ``b``, so every column the forward touches must
        agree; an entry either side does not hold (-1: out of the pool, never seen written)
        is left out. The first column that differs is reported, per row."""
        if not len(positions):
            return
        brow = view.batch_row[positions]
        given = self.tables.gather_groups("input", brow, cols)
        differs = (given != own) & (given >= 0) & (own >= 0)
        if not np.count_nonzero(differs):
            return
        hit = differs.any(axis=0)
        seen: set[int] = set()
        for i in hit.nonzero()[0].tolist():
            p = int(positions[i])
            if p in seen:
                continue
            seen.add(p)
            g = int(differs[:, i].nonzero()[0][0])
            uid = int(view.uid[p])
            self._malformed(
                step,
                "block-table:input-not-source",
                (uid, self.trace.ids.name(uid)),
                int(brow[i]),
                f"row {int(brow[i])} of the input block table (group {g}) holds block "
                f"{int(given[g, i])} at column {int(cols[i])}, which the forward reads, but "
                f"the source row of its request slot {int(view.slot[p])} holds block "
                f"{int(own[g, i])} there; the replay follows the source row",
                group=g,
                block_id=int(given[g, i]),
            )

    def _write_states(self, step: int, w: _ForwardWrites, part: bool | None) -> None:
        """Write the forward model's tags: every row's (``part`` None), or only the first
        kernel group's (True) or the second's (False)."""
        if part is None:
            sel_a: slice | np.ndarray = slice(None)
            sel_c: slice | np.ndarray = slice(None)
        else:
            sel_a = w.first_a if part else ~w.first_a
            sel_c = w.first_c if part else ~w.first_c
        uids, tokens, flags = w.uids_a[sel_a], w.tokens[sel_a], w.flags[sel_a]
        uid_c, last = w.uid_c[sel_c], w.last[sel_c]
        for g in range(len(self.pool.groups)):
            blocks = w.blocks_a[g][sel_a]
            ok = blocks >= 0
            if np.count_nonzero(ok) == len(ok):
                self.pool.write_temporal(g, blocks, uids, tokens, step, flags)
            else:
                self.pool.write_temporal(g, blocks[ok], uids[ok], tokens[ok], step, flags[ok])
            cblocks = w.blocks_c[g][sel_c]
            okc = cblocks >= 0
            if np.count_nonzero(okc) == len(okc):
                self.pool.write_conv(g, cblocks, uid_c, last)
            else:
                self.pool.write_conv(g, cblocks[okc], uid_c[okc], last[okc])

    def _prefill_checkpoints(self, view: RowView, prefill: np.ndarray) -> _Checkpoints | None:
        """A prefill that also stored its state mid-query (vLLM's prefill checkpoint) wrote
        it into its block at the recorded column: temporal state and conv window, covering
        ``checkpoint_tokens``."""
        rows = (prefill & (view.checkpoint_col >= 0)).nonzero()[0]
        if not len(rows):
            return None
        cols = view.checkpoint_col[rows].astype(np.int64)
        return _Checkpoints(
            blocks=self.tables.gather_groups(self.own_kind, view.slot64[rows], cols),
            uids=view.uid64[rows],
            rows=view.batch_row[rows],
            tokens=view.checkpoint_tokens[rows].astype(np.int64),
            positions=rows,
            cols=cols,
        )

    def _write_checkpoints(self, step: int, ckpt: _Checkpoints) -> None:
        # A null column takes the write nowhere the engine keeps state.
        for g in range(len(self.pool.groups)):
            ok = ckpt.blocks[g] > 0
            if not np.count_nonzero(ok):
                continue
            blocks, uid, covered = ckpt.blocks[g][ok], ckpt.uids[ok], ckpt.tokens[ok]
            self._touched_after_forward.append(blocks)
            self.oracle.check_writes(step, "checkpoint-write", g, blocks, uid, ckpt.rows[ok])
            flags = np.zeros(len(blocks), np.int64)
            self.pool.write_temporal(g, blocks, uid, covered, step, flags)
            self.pool.write_conv(g, blocks, uid, covered + self._conv_lead)

    def _padded_rows(self, step: int, launch: AlignLaunch, view: RowView) -> None:
        """Padded rows of a CUDA-graph batch run the decode kernel on the state indices their
        (stale) block-table row gives: they write wherever those point. The gather reads
        those rows like any other: a row or column outside the table is malformed, and the
        row is left out."""
        slots = np.asarray(np.ma.getdata(launch.req_slot))
        pad = np.flatnonzero(slots < 0)
        if not len(pad) or launch.seq_len is None:
            return
        kind = launch.bt_table if launch.bt_table in self.tables.tables else self.own_kind
        rows = np.asarray(np.ma.getdata(launch.bt_row), dtype=np.int64)[pad]
        seq = np.asarray(launch.column("seq_len"), dtype=np.int64)[pad]
        first = np.maximum((seq - 1) // self.block_size, 0)
        cols = first[:, None] + np.arange(self.k + 1)[None, :]
        inside = self._check_padded_gather(step, launch, view, pad, rows, cols)
        if self.rules["clear_vacated_rows"] == "true":
            num_reqs = self.trace.step_value("num_reqs", step) or view.num_rows
            inside &= rows < num_reqs  # rows past the batch read as cleared
        if np.count_nonzero(inside) < len(pad):
            pad, rows, cols = pad[inside], rows[inside], cols[inside]
            if not len(pad):
                return
        for g in range(len(self.pool.groups)):
            blocks = self.tables.gather(kind, g, rows[:, None], cols)
            flat = blocks.ravel()
            ok = flat > 0
            if not ok.any():
                continue
            dummy = np.full(int(ok.sum()), DUMMY_REQUEST, dtype=np.int64)
            self._touched_after_forward.append(flat[ok])
            brow = np.repeat(launch.batch_row[pad], self.k + 1)[ok]
            self.oracle.check_writes(step, "padded-row-write", g, flat[ok], dummy, brow)
            self.pool.write_temporal(
                g, flat[ok], dummy, np.zeros_like(dummy), step, np.full_like(dummy, DUMMY)
            )

    def _check_padded_gather(
        self,
        step: int,
        launch: AlignLaunch,
        view: RowView,
        pad: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
    ) -> np.ndarray:
        """The padded rows whose gather stays inside the tables (every group's table has the
        same shape); each other one is reported as the kernel validation would, group 0
        first. A negative row names no table row: nothing is read, nothing reported."""
        height, width = self.tables.rows, self.tables.width
        named = rows >= 0
        bad_row = named & (rows >= height)
        off = (cols < 0) | (cols >= width)
        bad_col = named & ~bad_row & off.any(axis=1)
        for i in np.flatnonzero(bad_row | bad_col).tolist():
            batch_row = int(launch.batch_row[pad[i]])
            if bad_row[i]:
                problem = MalformedMetadata(batch_row, "bt_row", int(rows[i]), height, 0)
            else:
                col = int(cols[i][off[i]][0])
                problem = MalformedMetadata(batch_row, "state_col", col, width, 0)
            self._malformed(
                step,
                f"{launch.kernel}:{problem.what}",
                self._row_owner(view, batch_row),
                batch_row,
                problem.sentence(),
                group=problem.group,
            )
        return named & ~bad_row & ~bad_col


def resumed(
    trace: RankTrace,
    rules: RuleSet,
    backend: Backend,
    device: str,
    state: Checkpoint,
    unwritten_unknown: bool,
) -> RankReplay:
    """A replay of ``trace``, a larger load of a rank, in the ``state`` a replay of a smaller
    load of it reached (with its oracle's ``unwritten_unknown``: a start state's replay knows
    its past). Both loads number requests with one ``RequestIds``, so the state means the same
    in either; ``backend`` is the one both were made with, not a replay's (a mirrored replay
    wraps its own)."""
    rep = RankReplay(trace, rules, backend, device=device)
    rep.restore(state)
    rep.oracle.unwritten_unknown = unwritten_unknown
    return rep


def _clamped(block_ids: np.ndarray, end: int) -> np.ndarray:
    """Block ids (int32, as the tables hold them) with every id past ``end``, and every
    negative one (as unsigned), at ``end``: np.clip costs several times more."""
    return np.minimum(block_ids.astype(np.int32, copy=False).view(np.uint32), end)


@dataclass
class ReplayResult:
    rules: RuleSet
    findings: list[Finding]
    steps: int  # the steps of the window reported (from_step..to_step), summed over ranks
    ranks: list[int]
    first_step: int | None
    repeats: int  # findings suppressed because the same request already had them
    # rank -> the step missing from the trace that its replay stopped before (findings
    # before it were found; nothing after it was replayed)
    stopped_at_gap: dict[int, int] = field(default_factory=dict)
    # --to-step ended the replay inside the recorded steps of every rank, before any of
    # them is missing: what the trace lacks later says nothing about the window
    window_whole: bool = False
    # rank -> the first step missing from the trace that the replay crossed (--allow-gaps):
    # the shadow state was not rebuilt across it
    crossed_gaps: dict[int, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.findings

    @classmethod
    def of(
        cls,
        rules: RuleSet,
        findings: list[Finding],
        steps: int,
        ranks: list[int],
        repeats: int,
        reach: Reach | None = None,
    ) -> ReplayResult:
        """The result of every rank's findings, put in (step, rank, batch row) order.
        Refuses, as inconclusive, a replay that stopped at a gap having found nothing."""
        reach = reach or Reach(None)
        if reach.stopped and not findings:
            raise InconclusiveError(reach.refusal())
        findings.sort(
            key=lambda f: (f.step, f.rank, f.batch_row if f.batch_row is not None else -1)
        )
        return cls(
            rules=rules,
            findings=findings,
            steps=steps,
            ranks=ranks,
            first_step=findings[0].step if findings else None,
            repeats=repeats,
            stopped_at_gap={r: g for r, (g, _) in reach.stopped.items()},
            window_whole=reach.whole,
            crossed_gaps=dict(reach.crossed),
        )


class Reach:
    """How far each rank's replay may go: to ``--to-step``, or to just before the first step
    the trace lacks (dropped, never recorded, or in a left-out part), across which the
    shadow state cannot be rebuilt. Findings before such a gap stand; a replay that found
    none is inconclusive."""

    def __init__(self, to_step: int | None) -> None:
        self.to_step = to_step
        self.stopped: dict[int, tuple[int, bool]] = {}  # rank -> (gap, whether left out)
        self.crossed: dict[int, int] = {}  # rank -> the first gap --allow-gaps crossed
        self.whole = to_step is not None

    def until(
        self, rank: int, steps: np.ndarray, left_out: int | None, *, stop: bool = True
    ) -> int | None:
        """The last step ``rank`` replays to (None: its end; -1: none at all); with
        ``stop`` False (--allow-gaps) the window, across any gap."""
        gap = first_hole(steps, left_out)
        reaches_end = not len(steps) or self.to_step is None or self.to_step >= steps.max()
        if gap is None or (self.to_step is not None and self.to_step < gap):
            self.whole = self.whole and not reaches_end
            return self.to_step
        self.whole = False
        if not stop:
            self.crossed[rank] = gap
            return self.to_step
        self.stopped[rank] = (gap, gap == left_out)
        return gap - 1

    def refusal(self) -> str:
        rank, (gap, left_out) = min(self.stopped.items(), key=lambda kv: (kv[1][0], kv[0]))
        if left_out:
            why = (
                f"rank {rank} of the trace lacks rows of step {gap} (a part --skip-bad-parts "
                "left out held them)"
            )
        else:
            why = (
                f"rank {rank} of the trace has a gap at step {gap} (dropped or never "
                "recorded steps)"
            )
        found = "the replay found nothing before it" if gap else "no step before it is recorded"
        return f"{why}; the shadow state cannot be rebuilt across it, and {found}"


_UNWRITABLE_CACHES: set[Path] = set()  # checkpoint directories a save failed in


def replay_trace(
    reader: TraceReader,
    rules: RuleSet | None = None,
    *,
    backend: str = "reference",
    device: str = "cpu",
    layout: str = "compact",
    from_step: int | None = None,
    to_step: int | None = None,
    progress: Callable[[int], None] | None = None,
    allow_gaps: bool = False,
    checkpoint_every: int | None = None,
    defer_reads: bool | None = None,
    mirror: bool | None = None,
    jobs: int = 1,
    ranks: Sequence[int] | None = None,
    stop_on_finding: bool = False,
) -> ReplayResult:
    """Replay every rank of a trace under ``rules``, reporting the window
    ``from_step..to_step``: findings before ``from_step`` are dropped, and inside the window
    each request's first occurrence of a finding is reported (and its repeats counted), as if
    nothing had been reported before the window. ``steps`` counts the window's steps.

    With ``from_step`` a checkpoint cached by an earlier replay under the same rules starts
    the replay close to that step; ``checkpoint_every`` caches new ones on the way. With
    ``jobs`` > 1 each rank is replayed in segments on that many processes (``parallel``),
    with the same findings. ``ranks``: only those ranks (all by default). With
    ``stop_on_finding`` each rank stops after its first step with a finding: the first
    step and its findings are those of a whole replay, nothing after it is replayed.
    """
    from mgtrace.replayer import checkpoint as ckpt

    rules = rules or RuleSet()
    require_replayable(reader)
    chosen = ranks_of(reader) if ranks is None else check_ranks(reader, ranks, reader.path)
    ids, seed = ckpt.request_ids_for(reader)
    if jobs > 1:
        if stop_on_finding:
            raise UsageError("a replay that stops at its first finding runs on one process")
        if checkpoint_every or seed is not None or mirror is False:
            raise UsageError(
                "--jobs replays without checkpoints a trace that starts at step 0, its tags "
                "on the host; drop --jobs for this replay"
            )
        load_backend(backend, device)  # refuses what a replay without --jobs refuses
        return _replay_in_segments(
            reader,
            rules,
            jobs,
            layout,
            from_step,
            to_step,
            allow_gaps,
            progress,
            chosen,
            backend=backend,
            device=device,
        )
    run_backend = load_backend(backend, device)
    findings: list[Finding] = []
    repeats = 0
    steps_done = 0
    reach = Reach(to_step)
    # No row past the window is loaded, unless the replay reads or writes cached checkpoints:
    # their tags hold request numbers, which a load numbers in the order it meets requests,
    # and a bounded load meets fewer (a cache is shared by every replay under these rules).
    bound = to_step if not from_step and not checkpoint_every else None
    for rank in chosen:
        trace = RankTrace(reader, rank, ids, to_step=bound)
        until = reach.until(rank, trace.recorded_steps, trace.first_left_out, stop=not allow_gaps)
        if until is not None and until < 0:
            continue  # the rank's first step is missing: nothing of it can be replayed
        rep = RankReplay(
            trace, rules, run_backend, layout, device, defer_reads=defer_reads, mirror=mirror
        )
        start = ckpt.start_from(rep, seed)
        cache = None
        if (from_step or checkpoint_every) and hasattr(reader, "path"):
            cache = ckpt.cache_dir(reader, rules.canonical(), layout)
        if from_step and cache is not None:
            restored = ckpt.restore_cached(rep, cache, rank, from_step)
            if restored is not None:
                start = restored + 1
        save = None
        if checkpoint_every and cache is not None:

            def save(cp: Checkpoint, rank: int = rank, cache: Path = cache) -> None:
                if cache in _UNWRITABLE_CACHES:
                    return
                try:
                    ckpt.save(cache, rank, cp)
                except (OSError, OutputError) as exc:  # a cache: the replay goes on without
                    _UNWRITABLE_CACHES.add(cache)
                    log.warning("mgtrace: checkpoints are not cached (%s)", exc)

        last = rep.run(
            start=start,
            until=until,
            progress=progress,
            every=checkpoint_every or 256,
            on_checkpoint=save,
            report_from=from_step,
            stop_on_finding=stop_on_finding,
        )
        # the window's steps, wherever the replay started (a cached checkpoint or step 0)
        first = max(start, from_step or 0)
        steps_done += int(
            np.count_nonzero((trace.step_numbers <= last) & (trace.step_numbers >= first))
        )
        findings += [f for f in rep.oracle.findings if from_step is None or f.step >= from_step]
        repeats += sum(v - 1 for v in rep.oracle.repeats.values())
    return ReplayResult.of(rules, findings, steps_done, chosen, repeats, reach)


def _replay_in_segments(
    reader: TraceReader,
    rules: RuleSet,
    jobs: int,
    layout: str,
    from_step: int | None,
    to_step: int | None,
    allow_gaps: bool,
    progress: Callable[[int], None] | None,
    ranks: list[int],
    *,
    backend: str,
    device: str,
) -> ReplayResult:
    from mgtrace.replayer.parallel import replay_rank_in_segments, step_numbers

    findings: list[Finding] = []
    repeats = steps = 0
    reach = Reach(to_step)
    for rank in ranks:
        numbers, left_out = step_numbers(reader, rank)
        steps_of_rank = np.array(numbers, dtype=np.int64)
        until = reach.until(rank, steps_of_rank, left_out, stop=not allow_gaps)
        if until is not None and until < 0:
            continue  # the rank's first step is missing: nothing of it can be replayed
        outcome = replay_rank_in_segments(
            reader,
            rank,
            rules,
            jobs=jobs,
            layout=layout,
            backend=backend,
            device=device,
            until=until,
            report_from=from_step,
            progress=progress,
        )
        findings += [f for f in outcome.findings if from_step is None or f.step >= from_step]
        repeats += outcome.repeats
        steps += outcome.steps
    return ReplayResult.of(rules, findings, steps, ranks, repeats, reach)


__all__ = ["AS_RECORDED", "BACKENDS", "ReplayResult", "replay_trace"]
