"""Step-indexed access to one rank of a trace, as numpy arrays.

Each table is read once, sorted by step and cut into per-step slices, so that the replay
loop costs a few array views per step instead of a query.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mgtrace.errors import TraceError, UsageError
from mgtrace.kernels.launch import REQUIRED_COLUMNS, ROW_COLUMNS, AlignLaunch, frozen_masked
from mgtrace.kernels.plan import RowPlan, plan_rows
from mgtrace.replayer.ownership import freed_below, processed_tokens, steps_in_flight
from mgtrace.replayer.requests import RequestIds
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import (
    BLOCK_TABLE_KINDS,
    KERNELS,
    MAMBA_SPLITS,
    POSTPROCESS_MODES,
    ROW_RULES,
    SCHED_KINDS,
)
from mgtrace.shell import path_arg
from mgtrace.sim.input_rows import InputRows
from mgtrace.sim.reorder import builder_split, regions, reorder_swaps


def spec_decodes_run_first(run: Any) -> bool:
    """Whether the model's linear-attention layers are GDN's, which run their spec-decode
    rows first and the rest after; Mamba2's run the prefill split first."""
    return any("GDN" in name for name in run.builder_reorder_thresholds)


def _numpy(col: pa.ChunkedArray, fill: int = -1) -> np.ndarray:
    """An integer column as int64 numpy, nulls replaced by ``fill``."""
    if pa.types.is_boolean(col.type):
        col = pc.cast(col, pa.int8())
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy(zero_copy_only=False)


def _valid(col: pa.ChunkedArray, uniform: dict[bool, np.ndarray]) -> np.ndarray:
    """Where a column holds a value, read-only; columns with no null, or no value at all
    (most of them), share one such array from ``uniform``."""
    if col.null_count in (0, len(col)):
        value = not col.null_count
        if value not in uniform:
            uniform[value] = np.full(len(col), value)
            uniform[value].setflags(write=False)
        return uniform[value]
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    valid.setflags(write=False)
    return valid


class _Sliced:
    """One table's rows of one rank, sorted by (step, *order), with per-step slices.

    Callers need a step's rows together and, within it, rows equal in their first keys
    together, in the order of the last key; a string key listed in ``categories`` is ranked
    by its position there rather than alphabetically. Where every key holds known values,
    the order is checked and made with numpy on integer keys, and a table already in order
    (as writers write it) is not copied: sorting it by its strings took most of the
    loading time of a long trace.
    """

    def __init__(
        self,
        table: pa.Table,
        order: list[str],
        categories: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        # codes of the categorical keys, and the integer keys without nulls as ``_numpy``
        # makes them, in the sorted order: callers need them too
        self.codes: dict[str, np.ndarray] = {}
        self.columns: dict[str, np.ndarray] = {}
        keys = _integer_keys(table, ["step", *order], categories or {}, self.codes, self.columns)
        if keys is None:
            self.codes, self.columns = {}, {}  # of the rows as they came, not as sorted here
            sort_keys = [("step", "ascending"), *((o, "ascending") for o in order)]
            at = pc.sort_indices(_decoded_keys(table, ["step", *order]), sort_keys=sort_keys)
            at = at.to_numpy()
            if np.count_nonzero(at != np.arange(len(at))):
                table = table.take(at)
        elif (at := _sorting_permutation(keys)) is not None:
            table = table.take(at)
            self.codes = {name: codes[at] for name, codes in self.codes.items()}
            self.columns = {name: values[at] for name, values in self.columns.items()}
        self.table: pa.Table | None = table
        self.steps = self.columns.get("step")
        if self.steps is None:
            self.steps = table.column("step").to_numpy(zero_copy_only=False)
        first = np.ones(len(self.steps), dtype=bool)
        first[1:] = self.steps[1:] != self.steps[:-1]
        self.starts = np.flatnonzero(first)
        self.unique = self.steps[self.starts]
        self.ends = np.append(self.starts[1:], len(self.steps))
        self._index = {int(s): i for i, s in enumerate(self.unique.tolist())}

    def bounds(self, step: int) -> tuple[int, int]:
        i = self._index.get(step)
        if i is None:
            return 0, 0
        return int(self.starts[i]), int(self.ends[i])

    def numpy_columns(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """``names`` as ``_numpy`` makes them, in the sorted order; sort keys made while
        sorting are reused, not made again."""
        assert self.table is not None, "the table was dropped once its columns were made"
        made, table = self.columns, self.table
        return {c: made[c] if c in made else _numpy(table.column(c)) for c in names}


def _decoded_keys(table: pa.Table, names: list[str]) -> pa.Table:
    """The key columns, strings read as dictionary codes decoded (Arrow sorts no codes)."""
    columns = [table.column(n) for n in names]
    return pa.table(
        [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in columns],
        names=names,
    )


def _integer_keys(
    table: pa.Table,
    names: list[str],
    categories: dict[str, tuple[str, ...]],
    codes_out: dict[str, np.ndarray],
    plain_out: dict[str, np.ndarray],
) -> list[np.ndarray] | None:
    """The key columns as integer arrays, nulls ranked last as Arrow ranks them; None where
    a key is a string column with no categories, or holds a string not among them (the
    caller then sorts as Arrow does). A categorical key's codes go to ``codes_out``, an
    integer key without nulls (kept in its own type: no int64 copy) to ``plain_out``."""
    keys = []
    for name in names:
        col = table.column(name)
        if name in categories:
            codes = codes_out[name] = category_codes(col, categories[name])
            if np.count_nonzero(codes < 0) > col.null_count:
                return None
            key = codes.astype(np.int64)
            key[codes < 0] = len(categories[name])
            keys.append(key)
        elif pa.types.is_integer(col.type) and not col.null_count:
            keys.append(plain_out.setdefault(name, _numpy(col)))
        elif pa.types.is_integer(col.type):
            last = np.iinfo(np.int64).max
            keys.append(_numpy(col, fill=last).astype(np.int64, copy=False))
        else:
            return None
    return keys


def _sorting_permutation(keys: list[np.ndarray]) -> np.ndarray | None:
    """The stable permutation that sorts rows by ``keys`` (most significant first), or None
    when they are in order already: a pair of neighbours is out of order where the first
    key in which they differ decreases. The check reuses its buffers: on a long trace each
    new array costs more to touch than to compute."""
    n = len(keys[0])
    if n < 2:
        return None
    undecided = np.ones(n - 1, dtype=bool)
    flag = np.empty(n - 1, dtype=bool)
    for key in keys:  # compared, not subtracted: a null ranked last is the largest int64
        np.less(key[1:], key[:-1], out=flag)
        flag &= undecided
        if np.count_nonzero(flag):
            return np.lexsort(keys[::-1])
        np.equal(key[1:], key[:-1], out=flag)
        undecided &= flag
    return None


PRECHECK_BLOCK = 1024  # launches checked and planned together (a few hundred steps)


@dataclass
class _Prechecked:
    """One block of launches checked and planned together (``RankTrace._precheck``)."""

    offset: int  # the block's first launch row
    valid: list[bool]  # per launch: built from what follows, not checked as it is built
    flags: list[tuple[bool, bool, bool]]  # per launch: all_live, rows_in_order, consistent
    plan: RowPlan  # of every row of the block


@dataclass
class StepBatch:
    """One step's batch rows (batch order) as arrays; request ids also as uids."""

    step: int
    uid: np.ndarray
    cols: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.uid)


BATCH_INT_COLUMNS = (
    "batch_row",
    "req_slot",
    "num_scheduled",
    "num_computed",
    "num_prompt",
    "num_draft",
    "accepted_prev",
    "accepted_prev_cpu",
    "accepted",
    "prev_state_col",
    "state_col",
    "checkpoint_tokens",
    "checkpoint_col",
)


class RankTrace:
    """Everything the replayer needs of one rank, loaded once.

    With ``to_step``, only the rows of steps up to it are loaded (a replay that ends there
    needs no later one), and everything up to it is as a whole load has it: the steps where
    a replay must stop (``recorded_steps``, ``hole``) and the block tables' shape are still
    the whole rank's."""

    def __init__(
        self, reader: TraceReader, rank: int, ids: RequestIds, *, to_step: int | None = None
    ) -> None:
        self.rank = rank
        self.ids = ids
        self.run = reader.manifest.run
        self.to_step = to_step
        self._read(reader, rank, ids)
        # The rows live on as numpy columns: the Arrow tables, most of what a long trace
        # holds in memory, are not kept (the small block_tables one is), and the memory
        # they held goes back to the system (once ``_read``'s locals are gone), not to a
        # pool that worker processes started beside this one cannot use.
        for sliced in (self._batch, self._launch, self._sched):
            sliced.table = None
        pa.default_memory_pool().release_unused()

    def _read(self, reader: TraceReader, rank: int, ids: RequestIds) -> None:
        """Every column and index the replay needs, from the rank's tables."""

        bound = {} if self.to_step is None else {"to_step": self.to_step}

        def load(name: str, codes: bool = True) -> pa.Table:
            t = reader.table(name, codes=codes, **bound)
            ranks = pc.min_max(t.column("rank")).as_py()
            if ranks["min"] == ranks["max"] == rank:  # a single-rank trace: nothing to drop
                return t
            return t.filter(pc.equal(t.column("rank"), rank))

        steps = load("steps").sort_by("step")
        numbers = steps.column("step").to_numpy(zero_copy_only=False)
        whole = complete_steps(reader, rank, numbers)
        every, every_whole = numbers, whole
        if self.to_step is not None:  # a gap or the end past the bound still tells a replay
            every = rank_step_numbers(reader, rank)
            every_whole = complete_steps(reader, rank, every)
        # the first step whose rows a left-out part held: a gap, not a step with no rows
        self.first_left_out = first_left_out(every, every_whole)
        # the rank's replayable steps, past ``to_step`` too: how far a replay may go
        self.recorded_steps = every[every_whole].astype(np.int64)
        self.hole = first_hole(self.recorded_steps, self.first_left_out)
        if not whole.all():
            steps = steps.filter(pa.array(whole))
        self.step_numbers = steps.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
        # a bounded load in memory (minimize's first load) brings the shape it lacks along
        self._later_dims = (
            dims_after(reader, rank, self.to_step)
            if self.to_step is not None
            else dict(getattr(reader, "later_dims", {}).get(rank, {}))
        )
        copies = ("block_copy_src", "block_copy_dst")
        self.step_info = {
            name: _numpy(steps.column(name))
            for name in steps.column_names
            if name != "rank" and name not in copies
        }
        # the few steps with whole-block copies: step -> (sources, destinations)
        self._block_copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        has = pc.is_valid(steps.column("block_copy_src"))
        if pc.any(has).as_py():
            some = steps.filter(has)
            for s, src, dst in zip(
                some.column("step").to_pylist(),
                some.column("block_copy_src").to_pylist(),
                some.column("block_copy_dst").to_pylist(),
                strict=True,
            ):
                if src or dst:  # the replay reports sources and destinations that differ
                    self._block_copies[int(s)] = (
                        np.asarray(src or [], dtype=np.int64),
                        np.asarray(dst or [], dtype=np.int64),
                    )
        # Row of each step in step_info (its first row, should a step repeat): a dict lookup
        # per step instead of a binary search.
        self._step_index: dict[int, int] = {}
        for i, s in enumerate(self.step_numbers.tolist()):
            self._step_index.setdefault(s, i)
        self._batch = _Sliced(load("batch_rows"), ["batch_row"])
        self._launch = _Sliced(
            load("launches"), ["kernel", "batch_step", "batch_row"], {"kernel": KERNELS}
        )
        lt = self._launch.table
        self._launch_cols = self._launch.numpy_columns(
            (*ROW_COLUMNS, "step", "batch_step", "bt_step")
        )
        uniform: dict[bool, np.ndarray] = {}
        self._launch_has = {c: _valid(lt.column(c), uniform) for c in ROW_COLUMNS}
        self._launch_kernel = self._launch.codes.get("kernel")
        if self._launch_kernel is None:
            self._launch_kernel = category_codes(lt.column("kernel"), KERNELS)
        self._launch_rule = category_codes(lt.column("row_rule"), ROW_RULES)
        self._launch_mode = category_codes(lt.column("mode"), POSTPROCESS_MODES)
        self._launch_table = category_codes(lt.column("bt_table"), BLOCK_TABLE_KINDS)
        for name in ROW_COLUMNS:  # int32 once here (as written: no copy), so launches are views
            self._launch_cols[name] = np.asarray(self._launch_cols[name], dtype=np.int32)
            self._launch_cols[name].setflags(write=False)  # launches share these views
        self._require_known_kernels()
        self._index_launch_groups()
        self._tables = _Sliced(load("block_tables", codes=False), ["group", "table", "row"])
        tt = self._tables.table
        self._table_rows = list(
            zip(
                tt.column("group").to_pylist(),
                tt.column("table").to_pylist(),
                tt.column("row").to_pylist(),
                tt.column("block_ids").to_pylist(),
                strict=True,
            )
        )
        self._sched = _Sliced(load("sched"), [])
        st = self._sched.table
        self._sched_uid = ids.uids_of_column(st.column("req_id"))
        self._sched_kind = category_codes(st.column("kind"), SCHED_KINDS)
        adds = pc.fill_null(
            pc.greater(pc.list_value_length(pc.list_flatten(st.column("new_block_ids"))), 0), False
        )
        grouped = pc.list_parent_indices(st.column("new_block_ids")) if st.num_rows else None
        has_ids = np.zeros(st.num_rows, dtype=bool)
        if grouped is not None and len(grouped):
            has_ids[np.asarray(grouped)[np.asarray(adds)]] = True
        self._sched_matters = has_ids | (self._sched_kind != SCHED_KINDS.index("cached"))
        # Block lists of the rows that change ownership, read once (few rows; most add none).
        matters = np.flatnonzero(self._sched_matters)
        self._sched_pos = np.full(st.num_rows, -1, dtype=np.int64)
        self._sched_pos[matters] = np.arange(len(matters))
        self._sched_blocks = (
            st.column("new_block_ids").take(pa.array(matters)).to_pylist() if len(matters) else []
        )
        self._sched_computed = _numpy(st.column("num_computed"), fill=0)
        self._sched_running = self._sched_kind == SCHED_KINDS.index("cached")
        self.began_mid_run = (
            in_flight_at_start(
                self._sched_uid,
                self._sched_kind,
                self._sched.steps,
                self.hole,
            )
            > 0
        )
        processed = processed_tokens(
            self._sched_uid,
            self._sched.steps.astype(np.int64),
            self._sched_kind,
            _numpy(st.column("num_scheduled"), fill=0),
            self._sched_computed,
            steps_in_flight(self.run),
        )
        self._sched_freed_below = freed_below(processed, self.run.mamba_block_size)
        self._batch_cols = self._batch.numpy_columns(BATCH_INT_COLUMNS)
        bt = self._batch.table
        self._batch_uid = ids.uids_of_column(bt.column("req_id"))
        # V1's persistent-batch membership changes, in the order the runner made them: a
        # rule that reorders at another threshold rebuilds the row order from them
        self._row_ops = _membership_ops(load("row_moves"), ids) if self.run.runner == "v1" else {}
        self._orders: dict[int, dict[int, np.ndarray]] = {}
        self.in_flight_rows = self._in_flight_rows(st) if self.began_mid_run else {}
        # The builder's split where it was recorded; where not, a row still prefilling its
        # prompt runs the prefill kernels and the others decode (never every row a decode:
        # a fresh prefill would read a window it has not got), and a GDN model's split is
        # derived as its builder makes it
        split = bt.column("mamba_split")
        self._batch_split_recorded = split.is_valid().to_numpy(zero_copy_only=False)
        self._batch_is_prefilling = pc.fill_null(bt.column("is_prefilling"), False).to_numpy(
            zero_copy_only=False
        )
        self._batch_prefill = np.where(
            self._batch_split_recorded,
            category_codes(split, MAMBA_SPLITS) == MAMBA_SPLITS.index("prefill"),
            self._batch_is_prefilling,
        )
        if split.null_count and spec_decodes_run_first(self.run):
            self._derive_gdn_split(pc.is_null(split).to_numpy(zero_copy_only=False))

    def _in_flight_rows(self, st: pa.Table) -> dict[int, list[tuple[int, list[list[int]], int]]]:
        """Per step, the requests the trace first sees running at it (a recording attached
        mid-run): each one's uid, per Mamba group the block row it had before that step's
        new blocks (its own block-table row, ``req_slot``'s, as recorded up to the step,
        less those blocks at its end), and the column below which align mode has freed its
        blocks. Their block ids otherwise land at columns 0, 1, ... of a row the replay
        knows nothing of, and align mode's frees release them at once."""
        if not st.num_rows:
            return {}
        uids, first = np.unique(self._sched_uid, return_index=True)
        cached = SCHED_KINDS.index("cached")
        hole = self.hole
        own_table = "v1" if self.run.runner == "v1" else "source"
        rows_by_key: dict[tuple[int, int], list[tuple[int, list[int]]]] = {}
        for step, (group, table, row, ids) in zip(
            self._tables.steps.tolist(), self._table_rows, strict=True
        ):
            if table == own_table:
                rows_by_key.setdefault((int(row), int(group)), []).append((step, ids or []))
        groups = max(1, self.run.num_mamba_groups)
        out: dict[int, list[tuple[int, list[list[int]], int]]] = {}
        for uid, i in zip(uids.tolist(), first.tolist(), strict=True):
            step = int(self._sched.steps[i])
            if self._sched_kind[i] != cached or (hole is not None and step >= hole > 0):
                continue
            lo, hi = self._batch.bounds(step)
            mine = np.flatnonzero(self._batch_uid[lo:hi] == uid)
            if not len(mine):
                continue
            slot = int(self._batch_cols["req_slot"][lo + mine[0]])
            pos = self._sched_pos[i]
            new = self._sched_blocks[pos] if pos >= 0 else None
            held = []
            for g in range(groups):
                recorded = [ids for s, ids in rows_by_key.get((slot, g), []) if s <= step]
                row = list(recorded[-1]) if recorded else []
                added = list((new[g] if new is not None and g < len(new) else None) or [])
                if added and row[-len(added) :] == added:
                    row = row[: -len(added)]
                held.append(row)
            out.setdefault(step, []).append((uid, held, int(self._sched_freed_below[i])))
        return out

    def _derive_gdn_split(self, unrecorded: np.ndarray) -> None:
        """GDN's split of the steps whose split was not recorded (an older recording, or a
        builder whose mask was not on the host), from the rows' counts: the rows scheduling
        their drafts + 1 or one-token decodes past the prompt run the spec-decode kernels;
        a step without one is split by position at 1, and gets threshold 1 (one call)."""
        k = self.run.num_speculative_tokens
        c = self._batch_cols
        threshold = self.step_info.get("mamba_threshold")
        if threshold is not None:
            threshold = self.step_info["mamba_threshold"] = threshold.copy()
        for step in np.unique(self._batch.steps[unrecorded]).tolist():
            lo, hi = self._batch.bounds(step)
            rows = slice(lo, hi)
            got = builder_split(
                "gdn",
                c["num_scheduled"][rows],
                c["num_computed"][rows],
                c["num_prompt"][rows],
                np.maximum(c["num_draft"][rows], 0),
                k,
            )
            self._batch_prefill[rows] = ~got.decode
            i = self._step_index.get(step)
            if threshold is not None and i is not None and got.threshold is not None:
                threshold[i] = got.threshold  # a step without a recorded split

    # --------------------------------------------------------------------- steps
    def __iter__(self) -> Iterator[int]:
        return iter(self.step_numbers.tolist())

    def __len__(self) -> int:
        return len(self.step_numbers)

    # Read-only views for analyses over the whole rank (divergence of rules, table sizes).
    @property
    def launch_columns(self) -> dict[str, np.ndarray]:
        return self._launch_cols

    @property
    def launch_has(self) -> dict[str, np.ndarray]:
        """Per launch row and column: whether the value was recorded (not null)."""
        return self._launch_has

    def _require_known_kernels(self) -> None:
        """Refuse, in one sentence, a launch of a kernel that is not an align kernel."""
        unknown = np.flatnonzero(self._launch_kernel < 0)
        if len(unknown):
            i = int(unknown[0])
            name = self._launch.table.column("kernel")[i].as_py()
            raise TraceError(
                f"a launches row of rank {self.rank} at step {self._launch_cols['step'][i]} "
                f"names kernel {name!r}, which is none of {', '.join(KERNELS)}; the trace is "
                "damaged"
            )

    def require_known_tables(self, groups: int, kinds: tuple[str, ...]) -> None:
        """Refuse, in one sentence, block-table rows of a group or table kind the run does not
        have: nothing can replay them."""
        tt = self._tables.table
        group = pc.fill_null(tt.column("group"), -1).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(
            (group < 0) | (group >= groups) | (category_codes(tt.column("table"), kinds) < 0)
        )
        if len(bad):
            _, kind, row, _ = self._table_rows[int(bad[0])]
            raise TraceError(
                f"a block_tables row of rank {self.rank} (row {row}) names group "
                f"{tt.column('group')[int(bad[0])].as_py()} of the {kind!r} table, but the run "
                f"has {groups} Mamba group(s) and the {'/'.join(kinds)} table(s); the trace "
                "is damaged"
            )

    @property
    def launch_kernel_codes(self) -> np.ndarray:
        return self._launch_kernel

    @property
    def launch_table_codes(self) -> np.ndarray:
        return self._launch_table

    @property
    def batch_steps(self) -> np.ndarray:
        return self._batch.steps

    @property
    def batch_columns(self) -> dict[str, np.ndarray]:
        return self._batch_cols

    def table_dims(self, k: int) -> tuple[int, int]:
        """Rows and columns the replayed block tables need to hold every recorded index."""
        rows = [self.run.max_num_seqs or 0, 1]
        width = [k + 2]
        if self._table_rows:
            rows.append(max(r for _, _, r, _ in self._table_rows) + 1)
            width.append(max(len(ids) for *_, ids in self._table_rows))
        if len(self._launch_cols["bt_row"]):
            rows.append(int(np.max(self._launch_cols["bt_row"])) + 1)
        cols = self._batch_cols["state_col"]
        if len(cols):
            width.append(int(np.max(cols)) + k + 2)
        later = self._later_dims
        if "table_row" in later:
            rows.append(later["table_row"] + 1)
        if "table_width" in later:
            width.append(later["table_width"])
        if "bt_row" in later:
            rows.append(later["bt_row"] + 1)
        if "state_col" in later:
            width.append(later["state_col"] + k + 2)
        return max(rows), max(width)

    def steps_from(self, start: int) -> list[int]:
        return self.step_numbers[np.searchsorted(self.step_numbers, start) :].tolist()

    def step_value(self, name: str, step: int) -> int | None:
        i = self._step_index.get(step)
        if i is None:
            return None
        v = int(self.step_info[name][i])
        return None if v == -1 else v

    def recorded_split(self, step: int) -> tuple[int, np.ndarray] | None:
        """The builder's decode count as the step recorded it, and its rows' split in batch
        order (True where a row ran the prefill kernels), where the step recorded both for
        each of its rows; None where it did not, or lacks rows (a minimized trace)."""
        if "num_mamba_decodes" not in self.step_info:
            return None
        decodes = self.step_value("num_mamba_decodes", step)
        if decodes is None:
            return None
        lo, hi = self._batch.bounds(step)
        if hi - lo != self.step_value("num_reqs", step):
            return None
        if np.count_nonzero(self._batch_split_recorded[lo:hi]) < hi - lo:
            return None
        return decodes, self._batch_prefill[lo:hi]

    def block_copies(self, step: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The whole-block copies (sources, destinations) run before the step's forward."""
        return self._block_copies.get(step)

    def batch(self, step: int) -> StepBatch:
        lo, hi = self._batch.bounds(step)
        cols = {c: a[lo:hi] for c, a in self._batch_cols.items()}
        cols["is_prefill_split"] = self._batch_prefill[lo:hi]
        cols["is_prefilling"] = self._batch_is_prefilling[lo:hi]
        return StepBatch(step, self._batch_uid[lo:hi], cols)

    def persistent_order(self, step: int, threshold: int) -> np.ndarray | None:
        """V1: the step's batch positions in the order its persistent rows would have had
        had the runner reordered every step at ``threshold``; None without recorded row
        moves (V2, which sorts instead).

        The rows are rebuilt from the start of the trace: each step removes the requests
        that left, adds the joining ones in the recorded order (smallest freed row first),
        condenses and reorders. The order a reorder leaves depends on the order it starts
        from, which every earlier step's reorder shaped, so the recorded (already reordered)
        order of the step is no stand-in for it.
        """
        if not self._row_ops:
            return None
        orders = self._orders.get(threshold)
        if orders is None:
            orders = self._orders[threshold] = self._reordered_rows(threshold)
        return orders.get(step)

    def _reordered_rows(self, threshold: int) -> dict[int, np.ndarray]:
        batches = [self.batch(s) for s in self.step_numbers.tolist()]
        rows = InputRows(max((b.num_rows for b in batches), default=0) + 1)
        out: dict[int, np.ndarray] = {}
        for n, batch in enumerate(batches):
            uids = batch.uid.tolist()
            pos_of = {u: i for i, u in enumerate(uids)}
            # a trace that starts mid-run: its first rows start in their recorded order
            ops = () if n == 0 and self.began_mid_run else self._row_ops.get(batch.step, ())
            rows.begin_step()
            for is_add, uid in ops:
                if not is_add and uid in rows.req_row:
                    rows.remove(uid)
            for uid in [u for u in rows.req_row if u not in pos_of]:
                rows.remove(uid)  # left without a recorded remove
            for is_add, uid in ops:
                if is_add and uid in pos_of and uid not in rows.req_row:
                    rows.add(uid, 0, 0, [])
            for uid in uids:
                if uid not in rows.req_row:
                    rows.add(uid, 0, 0, [])  # joined without a recorded add
            rows.condense()
            order = np.fromiter((pos_of[u] for u in rows.req_ids()), np.int64, len(uids))
            c = batch.cols
            reg = regions(
                c["num_scheduled"][order],
                c["num_computed"][order],
                c["num_prompt"][order],
                threshold,
            )
            for a, b in reorder_swaps(reg):
                rows.swap(a, b)
            out[batch.step] = np.fromiter((pos_of[u] for u in rows.req_ids()), np.int64, len(uids))
        return out

    def launches(self, step: int) -> list[AlignLaunch]:
        """The step's launches, in the order the engine ran them.

        A post-process of an earlier batch (pipeline-parallel deferral) runs first, at the
        start of the step; then the precopy, the padded-row gather and the post-process.
        """
        return [self._make_launch(g) for g in self._launch_groups.get(step, ())]

    def _index_launch_groups(self) -> None:
        """Rows sorted by (step, kernel, batch_step, batch_row): each launch is a slice."""
        c = self._launch_cols
        n = len(self._launch_kernel)
        if n == 0:
            self._launch_groups: dict[int, list[int]] = {}
            self._group_bounds = np.zeros((0, 2), dtype=np.int64)
            return
        change = np.ones(n, dtype=bool)
        change[1:] = (
            (np.diff(c["step"]) != 0)
            | (np.diff(self._launch_kernel) != 0)
            | (np.diff(c["batch_step"]) != 0)
        )
        starts = np.flatnonzero(change)
        ends = np.append(starts[1:], n)
        self._group_bounds = np.stack([starts, ends], axis=1)
        self._group_kernel = self._launch_kernel[starts].tolist()
        self._group_batch_step = c["batch_step"][starts].tolist()
        self._group_has = {
            name: np.maximum.reduceat(has.astype(np.int8), starts).astype(bool)
            for name, has in self._launch_has.items()
        }
        # A precopy whose rows all keep their column copies nothing and reads no index (the
        # kernel returns before touching a table), whatever the rules: skip building it.
        moves = (
            (self._launch_kernel == KERNELS.index("precopy"))
            & (c["req_slot"] >= 0)
            & (c["src_col"] >= 0)
            & (c["src_col"] != c["state_idx"])
        )
        idle_precopy = (np.asarray(self._group_kernel) == KERNELS.index("precopy")) & ~(
            np.maximum.reduceat(moves.astype(np.int8), starts).astype(bool)
        )
        # Per launch, as Python values: building a launch then reads no numpy scalars.
        self._group_rows = list(zip(starts.tolist(), ends.tolist(), strict=True))
        # the columns each launch recorded, one tuple per pattern of them (a few patterns
        # over tens of thousands of launches)
        given = [name for name in ROW_COLUMNS if name != "num_accepted_cpu"]
        pattern = np.zeros(len(starts), dtype=np.int64)
        for bit, name in enumerate(given):
            pattern |= self._group_has[name].astype(np.int64) << bit
        names = {
            p: tuple(name for bit, name in enumerate(given) if p >> bit & 1)
            for p in np.unique(pattern).tolist()
        }
        self._group_columns = [names[p] for p in pattern.tolist()]
        self._group_cpu_counts = self._group_has["num_accepted_cpu"].tolist()
        self._group_scalars = list(
            zip(
                c["step"][starts].tolist(),
                c["bt_step"][starts].tolist(),
                self._launch_mode[starts].tolist(),
                self._launch_table[starts].tolist(),
                self._launch_rule[starts].tolist(),
                strict=True,
            )
        )
        self._launch_groups = {}
        for g, st in enumerate(c["step"][starts].tolist()):
            if not idle_precopy[g]:
                self._launch_groups.setdefault(st, []).append(g)
        # Each step's groups in the order ``launches`` hands them out, sorted once here.
        for st, groups in self._launch_groups.items():
            groups.sort(
                key=lambda g, st=st: (
                    self._group_batch_step[g] >= st,
                    _KERNEL_ORDER[self._group_kernel[g]],
                    self._group_batch_step[g],
                )
            )
        self._prechecked: dict[int, _Prechecked] = {}  # the latest blocks of launches

    def _precheck(self, block: int) -> _Prechecked:
        """The row-level checks and the plan of the launches of one block of
        ``PRECHECK_BLOCK`` launches, over all their rows at once: a launch built one at a time
        spends more on them than its replay spends copying. Blocks are made as the replay
        reaches them (a window or a segment makes only its own) and the latest two kept.
        Launches with an invalid rule, mode or block size, or without an input their kernel
        reads, are left to be checked as they are built (and refused or reported there)."""
        done = self._prechecked.get(block)
        if done is not None:
            return done
        first = block * PRECHECK_BLOCK
        groups = slice(first, first + PRECHECK_BLOCK)
        bounds = self._group_bounds[groups]
        lo, hi = int(bounds[0, 0]), int(bounds[-1, 1])
        starts, lengths = bounds[:, 0] - lo, bounds[:, 1] - bounds[:, 0]
        c = {name: col[lo:hi] for name, col in self._launch_cols.items()}
        has = {name: flags[groups] for name, flags in self._group_has.items()}
        rule = self._launch_rule[lo:hi][starts]
        mode = self._launch_mode[lo:hi][starts]
        kernel = np.asarray(self._group_kernel[groups])
        post = kernel == KERNELS.index("postprocess")
        valid = (rule >= 0) & np.where(post, mode >= 0, mode < 0)
        valid &= has["batch_row"] & has["req_slot"]
        for (name, mode_name), required in REQUIRED_COLUMNS.items():
            of_kind = kernel == KERNELS.index(name)
            if mode_name is not None:
                of_kind &= mode == POSTPROCESS_MODES.index(mode_name)
            for column in required:
                valid &= ~of_kind | has[column]
        if self.run.mamba_block_size <= 0:
            valid[:] = False
        by_batch_row = np.repeat(rule == ROW_RULES.index("batch_row"), lengths)
        precomputed = np.repeat(mode == POSTPROCESS_MODES.index("precomputed"), lengths)

        def any_row(flags: np.ndarray) -> np.ndarray:
            return np.maximum.reduceat(flags.astype(np.int8), starts).astype(bool)

        row_in_launch = np.arange(hi - lo) - np.repeat(starts, lengths)
        expected_bt_row = np.where(by_batch_row, c["batch_row"], c["req_slot"])
        inconsistent = any_row(c["bt_row"] != expected_bt_row) & has["bt_row"]
        cpu_counts = has["num_accepted_cpu"]
        plan = plan_rows(
            np.repeat(kernel, lengths), by_batch_row, precomputed, c, self.run.mamba_block_size
        )
        for array in vars(plan).values():
            array.setflags(write=False)  # launches share slices of these
        done = _Prechecked(
            offset=lo,
            valid=valid.tolist(),
            flags=list(
                zip(
                    (~any_row(c["req_slot"] < 0) & ~cpu_counts).tolist(),
                    (~any_row(c["batch_row"] != row_in_launch)).tolist(),
                    (~inconsistent).tolist(),
                    strict=True,
                )
            ),
            plan=plan,
        )
        if len(self._prechecked) >= 2:
            del self._prechecked[min(self._prechecked)]
        self._prechecked[block] = done
        return done

    def _make_launch(self, g: int) -> AlignLaunch:
        c = self._launch_cols
        lo, hi = self._group_rows[g]
        values: dict[str, Any] = dict.fromkeys(ROW_COLUMNS)
        for name in self._group_columns[g]:
            values[name] = c[name][lo:hi]
        if self._group_cpu_counts[g]:
            has = self._launch_has["num_accepted_cpu"][lo:hi]
            values["num_accepted_cpu"] = frozen_masked(  # a launch never changes once built
                np.where(has, c["num_accepted_cpu"][lo:hi], 0).astype(np.int32), ~has
            )
        step, bt_step, mode, table, rule = self._group_scalars[g]
        kernel = KERNELS[self._group_kernel[g]]
        values.update(
            kernel=kernel,
            row_rule=ROW_RULES[rule],
            mode=None if mode < 0 else POSTPROCESS_MODES[mode],
            bt_table=None if table < 0 else BLOCK_TABLE_KINDS[table],
            rank=self.rank,
            step=step,
            batch_step=self._group_batch_step[g],
            bt_step=bt_step,
            block_size=self.run.mamba_block_size,
            num_speculative_tokens=self.run.num_speculative_tokens,
        )
        block = self._precheck(g // PRECHECK_BLOCK)
        if not block.valid[g % PRECHECK_BLOCK]:
            return AlignLaunch(**values)
        all_live, in_order, consistent = block.flags[g % PRECHECK_BLOCK]
        p, lo, hi = block.plan, lo - block.offset, hi - block.offset
        return AlignLaunch.prechecked(
            values,
            all_live=all_live,
            rows_in_order=in_order,
            bt_row_consistent=consistent,
            planned=RowPlan(
                live=p.live[lo:hi],
                copies=p.copies[lo:hi],
                bt_row=p.bt_row[lo:hi],
                src_col=p.src_col[lo:hi],
                dst_col=p.dst_col[lo:hi],
                bias=p.bias[lo:hi],
                accepted_out=p.accepted_out[lo:hi].copy() if kernel == "postprocess" else None,
            ),
        )

    def table_updates(self, step: int) -> list[tuple[int, str, int, list[int]]]:
        lo, hi = self._tables.bounds(step)
        return self._table_rows[lo:hi]

    def last_table_updates(self, steps: list[int]) -> list[tuple[int, str, int, list[int]]]:
        """The block-table rows as the updates of ``steps`` leave them: an update rewrites a
        whole row, so only each row's last one counts."""
        last: dict[tuple[int, str, int], tuple[int, str, int, list[int]]] = {}
        for step in steps:
            for update in self.table_updates(step):
                last[update[:3]] = update
        return list(last.values())

    def written_through(self, steps: list[int]) -> np.ndarray:
        """uids of the requests that have a state of their own once ``steps`` have run: a
        live row in one of them, and no re-add after a preemption later than that row (a
        re-add lets go of every block; its step's own row comes after it)."""
        mine = np.isin(self._batch.steps, steps)
        mine &= (self._batch_cols["req_slot"] >= 0) & (self._batch_uid >= 0)
        uid, at = self._batch_uid[mine], self._batch.steps[mine].astype(np.int64)
        if not len(uid):
            return uid
        size = int(uid.max()) + 1
        last_live = np.full(size, -1, dtype=np.int64)
        np.maximum.at(last_live, uid, at)
        resumed = np.isin(self._sched.steps, steps) & (
            self._sched_kind == SCHED_KINDS.index("resumed")
        )
        ruid = self._sched_uid[resumed]
        inside = (ruid >= 0) & (ruid < size)
        last_resume = np.full(size, -1, dtype=np.int64)
        np.maximum.at(
            last_resume, ruid[inside], self._sched.steps[resumed][inside].astype(np.int64)
        )
        return np.flatnonzero((last_live >= 0) & (last_live >= last_resume))

    def sched(self, step: int) -> dict[str, Any]:
        """The scheduler rows that change block ownership (cached rows adding nothing do not)."""
        lo, hi = self._sched.bounds(step)
        sel = self._sched_matters[lo:hi].nonzero()[0] + lo
        if not len(sel):
            return {"uid": [], "kind": [], "new_block_ids": [], "num_computed": []}
        return {
            "uid": self._sched_uid[sel].tolist(),
            "kind": [SCHED_KINDS[k] for k in self._sched_kind[sel].tolist()],
            "new_block_ids": [self._sched_blocks[i] for i in self._sched_pos[sel].tolist()],
            "num_computed": self._sched_computed[sel].tolist(),
        }

    def sched_uids(self, step: int) -> np.ndarray:
        """uids of ``sched(step)``'s rows, without building the rest."""
        lo, hi = self._sched.bounds(step)
        return self._sched_uid[lo:hi][self._sched_matters[lo:hi]]

    def moved_uids(self, step: int) -> np.ndarray:
        """uids of ``step``'s new, resumed, finished and preempted rows (all but cached)."""
        lo, hi = self._sched.bounds(step)
        return self._sched_uid[lo:hi][~self._sched_running[lo:hi]]

    def running(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """uids of the running requests scheduled in ``step``, and per request the column
        below which align mode has freed its state blocks: ``cdiv(processed, B) - 1``."""
        lo, hi = self._sched.bounds(step)
        sel = self._sched_running[lo:hi].nonzero()[0] + lo
        return self._sched_uid[sel], self._sched_freed_below[sel]


# What ``RankTrace.table_dims`` reads of rows a bounded load leaves out: (table, column,
# whether the column's list lengths count)
TABLE_DIM_COLUMNS = {
    "table_row": ("block_tables", "row", False),
    "table_width": ("block_tables", "block_ids", True),
    "bt_row": ("launches", "bt_row", False),
    "state_col": ("batch_rows", "state_col", False),
}


def dims_after(
    reader: TraceReader, rank: int, after: int, through: int | None = None
) -> dict[str, int]:
    """What ``RankTrace.table_dims`` reads of ``rank``'s rows of steps after ``after``
    (through ``through``; None: to the end), which a bounded load leaves out: a bound on the
    rows must not move where an index falls outside the tables (a finding names their
    shape)."""
    out = {}
    for key, (name, column, lengths) in TABLE_DIM_COLUMNS.items():
        if through is None:  # one part and one column at a time
            got = reader.column_max(name, column, rank=rank, after_step=after, lengths=lengths)
        else:
            t = reader.table(name, columns=["rank", "step", column], to_step=through)
            keep = pc.and_(pc.equal(t.column("rank"), rank), pc.greater(t.column("step"), after))
            values = t.column(column).filter(keep)
            got = pc.max(pc.list_value_length(values) if lengths else values).as_py()
        if got is not None:
            out[key] = int(got)
    return out


_KERNEL_ORDER = {
    KERNELS.index(k): i for i, k in enumerate(("precopy", "aligned_indices", "postprocess"))
}


def in_flight_at_start(
    req_ids: np.ndarray,
    kinds: np.ndarray,
    steps: np.ndarray | None = None,
    hole: int | None = None,
) -> int:
    """How many requests were already running when the trace began: those whose first
    scheduler row (rows in step order) is not ``new``. A trace of an engine that started with
    it has none; a recording attached to a busy engine has every request then in flight.
    With ``hole``, the first step the trace lacks: a request first seen after it may have
    arrived in it, and does not count (``steps``: each row's step; a hole at or before the
    first of them is a late start, not a gap)."""
    if not len(req_ids):
        return 0
    _, first = np.unique(req_ids, return_index=True)
    running = kinds[first] != SCHED_KINDS.index("new")
    if hole is not None and steps is not None and hole > steps.min():
        running &= steps[first] < hole
    return int(np.count_nonzero(running))


def category_codes(col: pa.ChunkedArray, categories: tuple[str, ...]) -> np.ndarray:
    """A categorical column as int8 codes into ``categories`` (-1 for null or unknown),
    strings or dictionary codes (``TraceReader.table(codes=True)``): a dictionary is looked
    up once, not row by row."""
    value_set = pa.array(list(categories), pa.string())

    def codes_of(values: pa.Array) -> np.ndarray:
        idx = pc.index_in(values, value_set=value_set)
        return pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int8)

    return dictionary_lookup(col, codes_of, np.int8(-1))


def dictionary_lookup(
    col: pa.ChunkedArray, lookup: Callable[[pa.Array], np.ndarray], null: np.generic
) -> np.ndarray:
    """``lookup`` (a numpy value per string) over a string column, applied to each
    dictionary chunk's values once and taken by its indices; ``null`` where a row is null
    (``lookup`` maps null strings itself)."""
    parts = []
    for chunk in col.chunks:
        if not pa.types.is_dictionary(chunk.type):
            parts.append(lookup(chunk))
            continue
        indices = chunk.indices
        if not len(chunk.dictionary):  # every row null
            parts.append(np.full(len(chunk), null))
            continue
        values = lookup(chunk.dictionary)
        at = pc.fill_null(indices, 0).to_numpy(zero_copy_only=False)
        got = values[at]
        if indices.null_count:
            got[~indices.is_valid().to_numpy(zero_copy_only=False)] = null
        parts.append(got)
    return np.concatenate(parts) if parts else np.full(0, null)


# The tables a replay reads; a step missing rows of any of them cannot be replayed.
REPLAY_TABLES = ("steps", "batch_rows", "launches", "block_tables", "sched")


def complete_steps(reader: TraceReader, rank: int, steps: np.ndarray) -> np.ndarray:
    """Which of ``steps`` (of ``rank``) have all their replayed rows: not those of a part
    ``--skip-bad-parts`` left out."""
    keep = np.ones(len(steps), dtype=bool)
    left_out = getattr(reader, "steps_left_out", None)
    for first, last in left_out(rank, REPLAY_TABLES) if left_out else ():
        keep &= (steps < first) | (steps > last)
    return keep


# A replay that stops at its first finding (bisect, minimize) loads a long trace's first
# steps, and eight times as many each time it gets past them clean.
FIRST_LOAD = 2048
LOAD_GROWTH = 8


def load_bound(steps: np.ndarray, count: int) -> int | None:
    """The last step of a load holding the first ``count`` of sorted ``steps``; None (load
    everything) when that is half of them or more, since a larger load reads every step
    before its bound again."""
    return None if 2 * count >= len(steps) else int(steps[max(count, 1) - 1])


def rank_step_numbers(reader: TraceReader, rank: int) -> np.ndarray:
    """Every step of ``rank`` in the steps table, sorted (one column: cheap on any trace)."""
    t = reader.table("steps", columns=["rank", "step"])
    steps = t.filter(pc.equal(t.column("rank"), rank)).column("step")
    return np.sort(steps.to_numpy(zero_copy_only=False).astype(np.int64))


def first_left_out(steps: np.ndarray, whole: np.ndarray) -> int | None:
    """The first of ``steps`` that ``complete_steps`` found incomplete (None: none)."""
    return None if whole.all() else int(steps[~whole].min())


def first_gap(steps: np.ndarray) -> int | None:
    """The first step missing from sorted ``steps``, which should run 0, 1, 2, ...; None
    when none is (an empty list misses nothing)."""
    if not len(steps):
        return None
    if steps[0] != 0:
        return 0
    jumps = np.flatnonzero(np.diff(steps) != 1)
    return int(steps[jumps[0]]) + 1 if len(jumps) else None


def first_hole(steps: np.ndarray, left_out: int | None) -> int | None:
    """The first step a replay cannot rebuild the state across: missing from sorted
    ``steps``, or ``left_out`` (one a skipped part held rows of); None when there is none."""
    found = (first_gap(steps), left_out)
    return min((s for s in found if s is not None), default=None)


def require_replayable(reader: TraceReader) -> None:
    """Refuse, in one sentence, a trace that holds nothing a replay can run: no align-kernel
    launch (a probe import, say), or no pool size to hold the states in."""
    imported = (reader.manifest.source or {}).get("kind") == "probe-import"
    origin = " (it was imported from a probe log)" if imported else ""
    skipped = {s.table for s in getattr(reader, "skipped", ())}
    if not reader.rows("steps") and "steps" not in skipped and not imported:
        raise UsageError(
            "the trace holds no step (its recording ended before the first one was "
            "written), so there is nothing to replay"
        )
    left_out = "launches" in skipped
    if not reader.rows("launches") and not left_out:  # a left-out part is a gap, said later
        raise UsageError(
            f"the trace holds no align-kernel launches{origin}, so there is nothing to "
            "replay; query it with mgtrace sql or mgtrace history"
        )
    if reader.manifest.run.num_blocks is None:
        raise UsageError(
            f"the trace does not say how many state blocks the pool has{origin}, so it "
            "cannot be replayed; query it with mgtrace sql or mgtrace history"
        )
    if not reader.manifest.run.states:
        raise UsageError(
            f"the trace's manifest names no state tensors (run.states){origin}, so no state "
            "pool can be laid out and it cannot be replayed; query it with mgtrace sql"
        )


def ranks_of(reader: TraceReader) -> list[int]:
    t = reader.table("steps", columns=["rank"])
    return sorted(set(t.column("rank").to_pylist()))


def check_ranks(reader: TraceReader, ranks: Iterable[int], trace: str | Path) -> list[int]:
    """``ranks``, sorted, once each; one sentence when ``trace`` lacks one of them."""
    return _checked(ranks_of(reader), ranks, trace)


def some_ranks(
    reader: TraceReader, ranks: Iterable[int] | None, trace: str | Path
) -> list[int] | None:
    """The ranks a replay was asked for, checked; None for every rank (none asked for, or
    all of them): the whole trace's replay."""
    if not ranks:
        return None
    have = ranks_of(reader)
    chosen = _checked(have, ranks, trace)
    return None if chosen == have else chosen


def _checked(have: list[int], ranks: Iterable[int], trace: str | Path) -> list[int]:
    given = [ranks] if isinstance(ranks, (str, bytes)) else list(ranks)
    odd = [r for r in given if type(r) is not int]
    if odd:  # "0" is no rank 0 (and would be told the trace has none while listing it)
        raise UsageError(f"a rank is a whole number, not {odd[0]!r:.40}")
    wanted = sorted(set(given))
    missing = [r for r in wanted if r not in have]
    if missing:
        listed = ", ".join(map(str, have)) or "none"
        raise UsageError(f"{path_arg(trace)} has no rank {missing[0]}; its ranks: {listed}")
    return wanted


def _membership_ops(moves: pa.Table, ids: RequestIds) -> dict[int, list[tuple[bool, int]]]:
    """step -> the (is_add, uid) of its recorded adds and removes, in the order they ran."""
    if not moves.num_rows:
        return {}
    op = moves.column("op")
    if pa.types.is_dictionary(op.type):
        op = op.cast(pa.string())
    keep = pc.is_in(op, pa.array(["add", "remove"]))
    moves = moves.filter(keep).sort_by([("step", "ascending"), ("seq", "ascending")])
    out: dict[int, list[tuple[bool, int]]] = {}
    uids = ids.uids_of_column(moves.column("req_id")).tolist()
    adds = moves.column("op").cast(pa.string()).to_pylist()
    for step, is_add, uid in zip(moves.column("step").to_pylist(), adds, uids, strict=True):
        out.setdefault(step, []).append((is_add == "add", uid))
    return out
