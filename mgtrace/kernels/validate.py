"""Bounds checks that run before any align kernel touches memory.

Neither a GPU nor Triton's interpreter checks bounds: a block-table row, column or block id
out of range reads or writes someone else's memory without a sound. So every index a launch
would use is checked here first, against the block-table shapes and the pool size, in the
order the device code would use it (row, then column, then the block id read there). A row
that fails is reported as a :class:`MalformedMetadata` problem and is never launched: the
backends receive it as a padded row. Rows that would not index anything (padding, rows with
nothing to copy) are not checked, because the kernel does not read their indices either;
the exception is the aligned-indices gather, which vLLM runs over CUDA-graph padding too.

Column sums are checked in int64: the device adds a column and a bias to the row pointer one
at a time, so a sum that wraps int32 back into range is still out of range there.

The same pass resolves the block ids of the rows that copy, which is all the reference
backend needs besides the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mgtrace.errors import UsageError
from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.plan import RowPlan, plan_launch
from mgtrace.kernels.pool import BlockTables, StatePool


@dataclass(frozen=True)
class MalformedMetadata:
    """One out-of-range or missing input of one batch row."""

    batch_row: int
    what: str  # the input at fault: bt_row, src_col, temporal_src_col, dst_col, block_id, ...
    value: int | None
    bound: int | None  # the exclusive upper bound it broke (or the expected value)
    group: int | None = None

    def sentence(self) -> str:
        where = f" of group {self.group}" if self.group is not None else ""
        if self.value is None:
            return f"batch row {self.batch_row}: {self.what}{where} is missing"
        if self.bound is None:
            return f"batch row {self.batch_row}: {self.what}{where} = {self.value} is invalid"
        return (
            f"batch row {self.batch_row}: {self.what}{where} = {self.value} "
            f"is outside [0, {self.bound})"
        )


@dataclass
class ResolvedCopies:
    """Block ids of the rows that copy and passed validation; groups in local order."""

    rows: np.ndarray  # [A]: batch rows
    bias: np.ndarray  # [A]
    # int32 [G, 3, A]: blocks at the destination, conv source and temporal source columns
    # (unspecified where the group has no state of that kind).
    blocks: np.ndarray

    @property
    def dst(self) -> np.ndarray:
        return self.blocks[:, 0]

    @property
    def conv_src(self) -> np.ndarray:
        return self.blocks[:, 1]

    @property
    def temporal_src(self) -> np.ndarray:
        return self.blocks[:, 2]


@dataclass
class Validation:
    problems: list[MalformedMetadata]
    bad: np.ndarray  # bool [n]: rows that are never launched
    plan: RowPlan
    copies: ResolvedCopies
    # bool [n]: bad rows whose decision inputs are themselves unusable (null, missing, out
    # of order, slot out of range); the other bad rows fail only on table or block indices.
    undecided: np.ndarray | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def accepted_out(self, launch: AlignLaunch) -> np.ndarray | None:
        """Post-process accepted counts after the launch. The device resets a count before
        it reads any table, so a row refused for a table or block index is still reset;
        only rows whose decision inputs are unusable keep their recorded count."""
        accepted = launch.column_or_none("num_accepted")
        if self.plan.accepted_out is None or accepted is None:
            return None
        if self.undecided is None or not np.count_nonzero(self.undecided):
            return self.plan.accepted_out
        return np.where(self.undecided, accepted, self.plan.accepted_out).astype(np.int32)

    def sanitized(self, launch: AlignLaunch) -> AlignLaunch:
        """The launch with every bad row turned into a padded row (req_slot -1)."""
        if not self.bad.any():
            return launch
        slot = np.asarray(np.ma.getdata(launch.req_slot), dtype=np.int32).copy()
        slot[self.bad] = -1
        values = {}
        for name in launch.required_columns:
            col = getattr(launch, name)
            if col is not None:  # null entries of bad rows are never read
                values[name] = np.asarray(np.ma.getdata(col), dtype=np.int32)
        return replace(
            launch,
            req_slot=slot,
            batch_row=np.arange(launch.num_rows, dtype=np.int32),
            bt_row=None,
            **values,
        )


def check_layout(pool: StatePool, tables: BlockTables) -> None:
    """Launch-level consistency: every state's group has a block table."""
    top = pool.max_group
    if top >= len(tables):
        raise UsageError(
            f"the pool has states of group {top} but only {len(tables)} block table(s) were given"
        )


class _Report:
    """Collects problems and the rows they rule out."""

    def __init__(self, n: int) -> None:
        self.problems: list[MalformedMetadata] = []
        self.n = n
        self._bad: np.ndarray | None = None  # allocated on the first problem

    @property
    def bad(self) -> np.ndarray:
        if self._bad is None:
            self._bad = np.zeros(self.n, dtype=bool)
        return self._bad

    def add(
        self,
        rows: np.ndarray,
        what: str,
        values: np.ndarray | None,
        bound: int | None,
        group: int | None = None,
    ) -> None:
        for i, r in enumerate(rows.tolist()):
            value = None if values is None else int(values[i])
            self.problems.append(MalformedMetadata(int(r), what, value, bound, group))
        self.bad[rows] = True


def validate_launch(
    launch: AlignLaunch,
    pool: StatePool,
    tables: BlockTables,
    *,
    max_slots: int | None = None,
) -> Validation:
    """Check every index the launch would use; report problems, never index out of range."""
    check_layout(pool, tables)
    n = launch.num_rows
    rep = _Report(n)
    undecided = None
    if not launch.well_formed or max_slots is not None:
        undecided = _check_rows(launch, rep, max_slots)
    if launch.planned is not None:
        plan = launch.planned
    else:
        plan = _empty_plan(launch) if launch.lacks_required else plan_launch(launch)
    active = plan.copies & ~rep.bad if rep.problems else plan.copies
    # count_nonzero and nonzero: a fraction of the cost of .any() and flatnonzero here.
    if launch.kernel == "precopy" and np.count_nonzero(plan.bias[active] < 0):
        rows = np.nonzero(active & (plan.bias < 0))[0]
        # A negative shift would start the conv window before the block.
        rep.add(rows, "token_bias", plan.bias[rows], None)
        active = active & ~rep.bad
    if launch.kernel == "postprocess" and np.count_nonzero(plan.bias[active] < 0):
        active = _check_wrapped_bias(pool, plan, active, rep)
    checked = plan
    if launch.kernel == "aligned_indices" and not launch.all_live:
        checked, active = _with_padded_gathers(launch, plan, active, rep)
    idx = active.nonzero()[0]
    copies = _fast_resolve(launch, checked, pool, tables, idx)
    if copies is None:
        kinds = pool.group_kinds(len(tables))
        col_sets = _column_sets(launch, checked, kinds)
        _check_indices(launch, checked, pool, tables, idx, col_sets, rep)
        good = idx[~rep.bad[idx]]
        copies = _resolve(checked, tables, good, *kinds, launch.kernel)
    if len(rep.problems) > 1:
        rep.problems.sort(key=lambda p: (p.batch_row, p.what))
    bad = rep.bad if rep.problems else _no_bad_rows(n)
    return Validation(problems=rep.problems, bad=bad, plan=plan, copies=copies, undecided=undecided)


def _check_wrapped_bias(
    pool: StatePool, plan: RowPlan, active: np.ndarray, rep: _Report
) -> np.ndarray:
    """A post-process bias is negative only when its int32 subtraction wrapped. The device
    then slides each conv window by ``width - bias`` tokens, in int32 as well: where that
    wraps too, it copies nothing; where it still fits, the window would run past the state.
    Those rows are refused; the rest keep no conv token (the reference does the same)."""
    widths = [s.width for s in pool.specs if s.kind == "conv"]
    if not widths:
        return active
    # width - bias <= int32 max, for the narrowest window (the first not to wrap).
    fits = plan.bias.astype(np.int64) >= min(widths) - np.iinfo(np.int32).max
    rows = np.nonzero(active & (plan.bias < 0) & fits)[0]
    if not rows.size:
        return active
    rep.add(rows, "token_bias", plan.bias[rows], None)
    return active & ~rep.bad


def _with_padded_gathers(
    launch: AlignLaunch, plan: RowPlan, active: np.ndarray, rep: _Report
) -> tuple[RowPlan, np.ndarray]:
    """vLLM's aligned-indices gather reads every row below its row count, CUDA-graph padding
    included: a padded row is checked at the block-table row it records (a negative or null
    one names no row: there is nothing to read)."""
    recorded = launch.column("bt_row")
    named = ~plan.live & (recorded >= 0)
    if launch.has_nulls:
        named &= ~np.ma.getmaskarray(launch.bt_row) & ~np.ma.getmaskarray(launch.req_slot)
    if rep.problems:
        named &= ~rep.bad
    if not np.count_nonzero(named):
        return plan, active
    return replace(plan, bt_row=np.where(named, recorded, plan.bt_row)), active | named


_NO_BAD: dict[int, np.ndarray] = {}


def _no_bad_rows(n: int) -> np.ndarray:
    """A shared, read-only all-False mask: most launches have no bad row."""
    mask = _NO_BAD.get(n)
    if mask is None:
        mask = np.zeros(n, dtype=bool)
        mask.setflags(write=False)
        _NO_BAD[n] = mask
    return mask


def _check_rows(launch: AlignLaunch, rep: _Report, max_slots: int | None) -> np.ndarray:
    """Row-level checks that need no table: structure, nulls, slot bounds. Returns the rows
    whose decision inputs are unusable (every bad row but those with only a wrong bt_row)."""
    n = launch.num_rows
    batch_row = launch.column("batch_row")
    if not launch.rows_in_order:
        wrong = np.nonzero(batch_row != np.arange(n))[0]
        rep.add(wrong, "batch_row", batch_row[wrong], None)
    slot = launch.column("req_slot")
    live = slot >= 0
    if launch.has_nulls:
        slot_mask = np.ma.getmaskarray(launch.req_slot)
        if slot_mask.any():
            rep.add(np.nonzero(slot_mask)[0], "req_slot", None, None)
        live = live & ~slot_mask
    for name in launch.required_columns:
        col = getattr(launch, name)
        if col is None:
            missing = np.ones(n, dtype=bool)
        elif isinstance(col, np.ma.MaskedArray):
            missing = np.ma.getmaskarray(col)
        else:
            continue
        rows = np.nonzero(missing & live)[0]  # every missing input of a row is named
        if rows.size:
            rep.add(rows, name, None, None)
    if max_slots is not None and (slot >= max_slots).any():
        rows = np.nonzero(live & (slot >= max_slots) & ~rep.bad)[0]
        rep.add(rows, "req_slot", slot[rows], max_slots)
    undecided = rep.bad.copy()
    if not launch.bt_row_consistent:
        recorded = launch.column("bt_row")
        expected = launch.column("batch_row") if launch.row_rule == "batch_row" else slot
        # The kernel indexes by its compiled rule; a record that disagrees is inconsistent.
        rows = np.nonzero((recorded != expected) & live & ~rep.bad)[0]
        if rows.size:
            rep.add(rows, "bt_row", recorded[rows], None)
    return undecided


def _column_sets(
    launch: AlignLaunch, plan: RowPlan, kinds: tuple[np.ndarray, np.ndarray]
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, columns, groups that index them) in the order the device code reads them."""
    every = kinds[0] | kinds[1]
    if launch.kernel == "aligned_indices":
        return [
            ("state_col", plan.dst_col + s, every) for s in range(launch.num_speculative_tokens + 1)
        ]
    return [
        ("dst_col", plan.dst_col, every),
        ("src_col", plan.src_col, kinds[0]),
        ("temporal_src_col", plan.src_col.astype(np.int64) + plan.bias, kinds[1]),
    ]


def _fast_resolve(
    launch: AlignLaunch,
    plan: RowPlan,
    pool: StatePool,
    tables: BlockTables,
    idx: np.ndarray,
) -> ResolvedCopies | None:
    """Resolve every block at once when all indices are in range; None sends the launch
    through the group-by-group checks that name each problem."""
    shape = tables.common_shape
    if shape is None or tables.total_size >= 2**31:
        return None
    rows, cols = shape
    if launch.kernel == "aligned_indices":
        r = plan.bt_row[idx]
        if r.size and r.view(np.uint32).max() >= rows:
            return None
        c = plan.dst_col[idx][None, :] + np.arange(launch.num_speculative_tokens + 1)[:, None]
        if c.size and c.astype(np.uint32).max() >= cols:
            return None
        return ResolvedCopies(idx[:0], plan.bias[:0], np.zeros((len(tables), 3, 0), np.int32))
    if not idx.size:  # nothing copies (a common case): no index to check or resolve
        return ResolvedCopies(idx, plan.bias[idx], np.zeros((len(tables), 3, 0), np.int32))
    # One [4, A] matrix (row, dst, conv src, temporal src) so that a single compaction and a
    # single reduction check every index; unsigned views make each check one-sided.
    m = np.empty((4, plan.bt_row.size), dtype=np.int32)
    m[0] = plan.bt_row
    m[1] = plan.dst_col
    m[2] = plan.src_col
    np.add(plan.src_col, plan.bias, out=m[3])
    # A sum that wrapped int32 (both addends' signs differ from it) is out of range on the
    # device however small its wrapped value: the slow path checks it in int64.
    if np.count_nonzero(((plan.src_col ^ m[3]) & (plan.bias ^ m[3])) < 0):
        return None
    every_row = idx.size == plan.bt_row.size
    if not every_row:
        m = m[:, idx]
    if idx.size and np.count_nonzero(m.view(np.uint32) >= tables.bounds):
        return None
    r, c = m[0], m[1:]
    # Offsets into all tables end to end; int32 suffices while the tables fit in 2**31 ids.
    flat = r * tables.cols32 + c
    if len(tables) > 1:
        flat = tables.flat_offsets + flat
    blocks = tables.flat[flat]
    if blocks.size:
        if pool.all_kinds_used(len(tables)):
            checked = blocks
        else:  # ids at columns of a kind the group lacks are never read: leave them out
            checked = np.where(pool.group_kind_mask(len(tables))[:, :, None], blocks, 0)
        if np.count_nonzero(checked.view(np.uint32) >= pool.num_blocks):
            return None
    if blocks.ndim == 2:
        blocks = blocks[None]
    return ResolvedCopies(rows=idx, bias=plan.bias if every_row else plan.bias[idx], blocks=blocks)


def _check_indices(
    launch: AlignLaunch,
    plan: RowPlan,
    pool: StatePool,
    tables: BlockTables,
    idx: np.ndarray,
    col_sets: list[tuple[str, np.ndarray, np.ndarray]],
    rep: _Report,
) -> None:
    """Row by row, group by group: row, then each column, then the block id read there."""
    for g in range(len(tables)):
        table = tables[g]
        rows_g, cols_g = table.shape
        cur = idx[~rep.bad[idx]]
        r = plan.bt_row[cur]
        out = (r < 0) | (r >= rows_g)
        if out.any():
            rep.add(cur[out], "bt_row", r[out], rows_g, g)
            cur = cur[~out]
        for what, cols, groups in col_sets:
            if not groups[g]:
                continue
            c = cols[cur]
            out = (c < 0) | (c >= cols_g)
            if out.any():
                rep.add(cur[out], what, c[out], cols_g, g)
                cur = cur[~out]
            if launch.kernel == "aligned_indices":
                continue  # the gathered ids are data here, not addresses
            blocks = table[plan.bt_row[cur], cols[cur]]
            out = (blocks < 0) | (blocks >= pool.num_blocks)
            if out.any():
                rep.add(cur[out], "block_id", blocks[out], pool.num_blocks, g)
                cur = cur[~out]


def _empty_plan(launch: AlignLaunch) -> RowPlan:
    n = launch.num_rows
    zeros = np.zeros(n, dtype=np.int64)
    return RowPlan(
        live=np.zeros(n, dtype=bool),
        copies=np.zeros(n, dtype=bool),
        bt_row=zeros,
        src_col=zeros,
        dst_col=zeros,
        bias=zeros,
        accepted_out=(np.zeros(n, dtype=np.int32) if launch.kernel == "postprocess" else None),
    )


def _resolve(
    plan: RowPlan,
    tables: BlockTables,
    rows: np.ndarray,
    has_conv: np.ndarray,
    has_temporal: np.ndarray,
    kernel: str,
) -> ResolvedCopies:
    if kernel == "aligned_indices":
        rows = rows[:0]  # a gather: nothing is copied
    blocks = np.zeros((len(tables), 3, rows.size), dtype=np.int32)
    if rows.size:
        r = plan.bt_row[rows]
        src = plan.src_col[rows].astype(np.int64)
        for g in range(len(tables)):
            t = tables[g]
            blocks[g, 0] = t[r, plan.dst_col[rows]]
            if has_conv[g]:
                blocks[g, 1] = t[r, src]
            if has_temporal[g]:
                blocks[g, 2] = t[r, src + plan.bias[rows]]
    return ResolvedCopies(rows=rows, bias=plan.bias[rows], blocks=blocks)


@dataclass(frozen=True)
class Hazard:
    """Two rows of one launch touching the same block of one group; one of them writes it."""

    batch_row: int  # the writer
    other_row: int
    group: int
    block_id: int
    kind: str  # write_write | write_read


def find_hazards(validation: Validation, pool: StatePool) -> list[Hazard]:
    """Cross-row overlaps, whose outcome depends on the order the programs run in.

    Inside one row everything is defined (the same-block conv shift is a memmove). Across
    rows it is not: on a GPU the programs race. The reference backend reads every source
    before writing any destination; the Triton interpreter runs rows in order. A launch
    without hazards gives the same bytes everywhere.
    """
    c = validation.copies
    hazards: list[Hazard] = []
    has_conv, has_temporal = pool.group_kinds(c.dst.shape[0])
    for g in range(c.dst.shape[0]):
        writers: dict[int, int] = {}
        for row, block in zip(c.rows.tolist(), c.dst[g].tolist(), strict=True):
            if block in writers and writers[block] != row:
                hazards.append(Hazard(row, writers[block], g, block, "write_write"))
            writers.setdefault(block, row)
        sources = []
        if has_conv[g]:
            sources.append(c.conv_src[g])
        if has_temporal[g]:
            sources.append(c.temporal_src[g])
        for src in sources:
            for row, block in zip(c.rows.tolist(), src.tolist(), strict=True):
                writer = writers.get(block)
                if writer is not None and writer != row:
                    hazards.append(Hazard(writer, row, g, block, "write_read"))
    return hazards
