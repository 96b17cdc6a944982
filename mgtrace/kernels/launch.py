"""One align-kernel launch: the single description every backend and the trace share.

An :class:`AlignLaunch` holds the rows of one ``(rank, step, kernel)`` group of the trace's
``launches`` table. Its field names are exactly the table's column names (a test keeps the
two in step), so a launch read from a trace, one built by the simulator and one handed to a
backend are the same object. Columns that hold one value for the whole launch (the kernel,
the row rule compiled in, the mode) are scalars here; per-row columns are numpy arrays,
``None`` when the kernel does not read them, and ``numpy.ma`` masked arrays where only some
rows carry a value (``num_accepted_cpu`` is recorded only where it differs).

Launch-level parameters that are not columns (mamba block size, k) sit beside the columns;
the state layout lives on :class:`mgtrace.kernels.pool.StatePool`.

Arrow is imported lazily so that the kernels run where only torch, triton and numpy exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from mgtrace.errors import TraceError, UsageError

if TYPE_CHECKING:
    import pyarrow as pa

KERNELS = ("precopy", "postprocess", "aligned_indices")
ROW_RULES = ("req_slot", "batch_row")
MODES = ("decision", "precomputed")
BT_TABLES = ("v1", "source", "input")

# Columns holding one value per launch, written to every row of the table.
SCALAR_COLUMNS = ("rank", "step", "kernel", "batch_step", "row_rule", "bt_table", "bt_step", "mode")
# Columns holding one value per batch row.
ROW_COLUMNS = (
    "batch_row",
    "req_slot",
    "bt_row",
    "num_accepted",
    "num_accepted_cpu",
    "state_idx",
    "num_scheduled",
    "num_computed",
    "num_draft",
    "src_col",
    "token_bias",
    "seq_len",
)

# What each kernel (and post-process mode) reads, besides batch_row and req_slot.
REQUIRED_COLUMNS: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("precopy", None): ("state_idx", "src_col", "token_bias"),
    ("postprocess", "decision"): (
        "num_accepted",
        "state_idx",
        "num_scheduled",
        "num_computed",
        "num_draft",
    ),
    ("postprocess", "precomputed"): ("num_accepted", "state_idx", "num_computed"),
    ("aligned_indices", None): ("seq_len",),
}

RowArray = np.ndarray  # int32, or a numpy.ma.MaskedArray where some rows are null


@dataclass(eq=False)
class AlignLaunch:
    """The rows of one align-kernel launch, as the kernel read them, in batch order."""

    kernel: str
    batch_row: RowArray
    req_slot: RowArray
    row_rule: str = "req_slot"
    bt_row: RowArray | None = None  # derived from row_rule when left out
    mode: str | None = None
    num_accepted: RowArray | None = None
    num_accepted_cpu: RowArray | None = None
    state_idx: RowArray | None = None
    num_scheduled: RowArray | None = None
    num_computed: RowArray | None = None
    num_draft: RowArray | None = None
    src_col: RowArray | None = None
    token_bias: RowArray | None = None
    seq_len: RowArray | None = None
    rank: int = 0
    step: int = 0
    batch_step: int | None = None
    bt_table: str | None = None
    bt_step: int | None = None
    # Launch parameters that are not table columns.
    block_size: int = field(default=16, metadata={"column": False})
    num_speculative_tokens: int = field(default=0, metadata={"column": False})

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise UsageError(f"unknown align kernel {self.kernel!r}; expected one of {KERNELS}")
        if self.row_rule not in ROW_RULES:
            raise UsageError(f"unknown row rule {self.row_rule!r}; expected one of {ROW_RULES}")
        if self.kernel == "postprocess":
            if self.mode not in MODES:
                raise UsageError(f"a post-process launch needs mode in {MODES}, got {self.mode!r}")
        elif self.mode is not None:
            raise UsageError(f"a {self.kernel} launch has no post-process mode")
        if self.block_size <= 0:
            raise UsageError(f"mamba block size must be positive, got {self.block_size}")
        fields_ = self.__dict__  # one dict walk: a replay builds thousands of launches
        batch_row = fields_["batch_row"] = _as_rows(self.batch_row)
        req_slot = fields_["req_slot"] = _as_rows(self.req_slot)
        n = len(batch_row)
        if len(req_slot) != n:
            raise UsageError("req_slot and batch_row must have one entry per row")
        if self.bt_row is None:
            self.bt_row = self.expected_bt_row()
        for name in ROW_COLUMNS:
            value = fields_[name]
            if value is None:
                continue
            if name != "batch_row" and name != "req_slot":  # those two are converted above
                value = fields_[name] = _as_rows(value)
            if len(value) != n:
                raise UsageError(f"column {name} has {len(value)} rows, the launch {n}")
        plain = self._take_plain_columns()
        self.block32 = np.int32(self.block_size)
        self.lacks_required = any(name not in plain for name in self.required_columns)
        # Each check counts the rows that break it: count_nonzero costs a fraction of the
        # .all() reduction on launch-sized arrays, and a replay builds thousands of launches.
        self.all_live = not self.has_nulls and not np.count_nonzero(plain["req_slot"] < 0)
        self.rows_in_order = not np.count_nonzero(plain["batch_row"] != _row_numbers(n))
        by = "req_slot" if self.row_rule == "req_slot" else "batch_row"
        self.bt_row_consistent = not np.count_nonzero(plain["bt_row"] != plain[by])
        # Nothing for the row-level checks to find: no nulls, rows in order, bt_row agrees.
        self.well_formed = (
            not self.has_nulls
            and not self.lacks_required
            and self.rows_in_order
            and self.bt_row_consistent
        )
        self.planned: Any = None  # a RowPlan made beforehand, with its launch's flags

    @classmethod
    def prechecked(
        cls,
        values: dict[str, Any],
        *,
        all_live: bool,
        rows_in_order: bool,
        bt_row_consistent: bool,
        planned: Any,
    ) -> AlignLaunch:
        """A launch whose checks and plan were made beforehand, over many launches at once
        (a trace's rows): ``values`` holds every field, the row columns as read-only int32
        arrays (``num_accepted_cpu`` masked), none of them missing a required input, and
        the kernel, rule and mode valid; ``planned`` is what ``plan_launch`` returns for it.
        Building a launch the checking way costs more than its replay's copy."""
        launch = cls.__new__(cls)
        launch.__dict__.update(values)
        if launch.bt_row is None:
            launch.bt_row = launch.expected_bt_row()
        launch._take_plain_columns()
        launch.block32 = np.int32(launch.block_size)
        launch.lacks_required = False
        launch.all_live = all_live
        launch.rows_in_order = rows_in_order
        launch.bt_row_consistent = bt_row_consistent
        launch.well_formed = not launch.has_nulls and rows_in_order and bt_row_consistent
        launch.planned = planned
        return launch

    def _take_plain_columns(self) -> dict[str, np.ndarray]:
        """Plain int32 views of every column, and whether any row is null: the hot path of a
        replay reads these instead of unwrapping masked arrays on every launch."""
        fields_ = self.__dict__
        self._plain = plain = {}
        self.has_nulls = False
        for name in ROW_COLUMNS:
            value = fields_[name]
            if isinstance(value, np.ma.MaskedArray):
                plain[name] = value.data
                self.has_nulls = True
            elif value is not None:
                plain[name] = value
        return plain

    @property
    def num_rows(self) -> int:
        return len(self.batch_row)

    @property
    def required_columns(self) -> tuple[str, ...]:
        return REQUIRED_COLUMNS[(self.kernel, self.mode)]

    def expected_bt_row(self) -> np.ndarray:
        """The block-table row each program indexes under the launch's row rule."""
        rows = self.req_slot if self.row_rule == "req_slot" else self.batch_row
        return np.array(np.ma.getdata(rows), dtype=np.int32)

    def with_row_rule(self, rule: str) -> AlignLaunch:
        """The same launch compiled with another block-table row rule (a counterfactual)."""
        return replace(self, row_rule=rule, bt_row=None)

    def column_or_none(self, name: str) -> np.ndarray | None:
        return self._plain.get(name)

    def column(self, name: str) -> np.ndarray:
        """A per-row column as plain int32 (null rows read 0); callers validate nulls first."""
        value = self._plain.get(name)
        if value is None:
            raise UsageError(f"the {self.kernel} launch has no {name} column")
        return value


def column_names() -> tuple[str, ...]:
    """The launch fields that are table columns, in the dataclass's order."""
    return tuple(f.name for f in fields(AlignLaunch) if f.metadata.get("column", True))


_ROW_NUMBERS = np.arange(0, dtype=np.int32)


def _row_numbers(n: int) -> np.ndarray:
    """0..n-1, sliced from one growing read-only array."""
    global _ROW_NUMBERS
    if len(_ROW_NUMBERS) < n:
        _ROW_NUMBERS = np.arange(max(n, 2 * len(_ROW_NUMBERS), 1024), dtype=np.int32)
        _ROW_NUMBERS.setflags(write=False)
    return _ROW_NUMBERS[:n]


def frozen_masked(data: np.ndarray, mask: np.ndarray) -> np.ma.MaskedArray:
    """A masked array over ``data`` and ``mask`` (kept, not copied) that nothing can write:
    the buffers are frozen first (``MaskedArray.data`` and ``.mask`` hand out views, so
    freezing those leaves the buffers writable)."""
    data.setflags(write=False)
    mask.setflags(write=False)
    return np.ma.MaskedArray(data, mask=mask)


def _as_rows(value: Any) -> np.ndarray:
    """A private, read-only int32 copy: a launch record never changes once built. An int32
    array that nothing can write (a read-only array, or a read-only view of one) is kept as
    it is: sharing it is as safe as a copy, and a replay builds thousands of launches from
    such views."""
    if type(value) is np.ndarray and value.dtype == np.int32 and not value.flags.writeable:
        base = value.base
        if base is None or (
            type(base) is np.ndarray and not base.flags.writeable and base.base is None
        ):
            return value
    if isinstance(value, np.ma.MaskedArray):
        return frozen_masked(
            np.array(np.ma.getdata(value), dtype=np.int32),
            np.array(np.ma.getmaskarray(value), dtype=bool),
        )
    out = np.array(value, dtype=np.int32)
    out.setflags(write=False)
    return out


def launch_to_arrow(launch: AlignLaunch) -> pa.Table:
    """The launch as rows of the ``launches`` table (schema from ``mgtrace.schemas``)."""
    import pyarrow as pa

    from mgtrace.schemas.tables import LAUNCHES

    n = launch.num_rows
    columns: dict[str, pa.Array] = {}
    for f in LAUNCHES.schema:
        value = getattr(launch, f.name)
        if f.name in SCALAR_COLUMNS:
            columns[f.name] = pa.array([value] * n, type=f.type)
        elif value is None:
            columns[f.name] = pa.nulls(n, type=f.type)
        else:
            data = np.asarray(np.ma.getdata(value))
            mask = np.ma.getmaskarray(value) if isinstance(value, np.ma.MaskedArray) else None
            columns[f.name] = pa.array(data, type=f.type, mask=mask)
    return pa.table(columns, schema=LAUNCHES.schema)


def launch_from_arrow(
    table: pa.Table, *, block_size: int, num_speculative_tokens: int = 0
) -> AlignLaunch:
    """One launch from the ``launches`` rows of a single (rank, step, kernel), any row order."""
    from mgtrace.schemas.tables import LAUNCHES

    missing = [name for name in LAUNCHES.column_names if name not in table.column_names]
    if missing:
        raise TraceError(f"the launches rows lack column(s) {', '.join(missing)}")
    if table.num_rows == 0:
        raise TraceError("an align launch needs at least one row")
    table = table.sort_by("batch_row")
    values: dict[str, Any] = {}
    for name in SCALAR_COLUMNS:
        distinct = table.column(name).unique().to_pylist()
        if len(distinct) != 1:
            raise TraceError(
                f"the launches rows mix several values of {name} ({distinct}); "
                "select the rows of one (rank, step, kernel)"
            )
        values[name] = distinct[0]
    for name in ROW_COLUMNS:
        col = table.column(name)
        if col.null_count == len(col):
            values[name] = None
            continue
        data = col.to_numpy(zero_copy_only=False)
        if col.null_count:
            mask = col.is_null().to_numpy(zero_copy_only=False)
            values[name] = np.ma.MaskedArray(np.where(mask, 0, data).astype(np.int32), mask=mask)
        else:
            values[name] = data.astype(np.int32)
    if values["req_slot"] is None or values["batch_row"] is None:
        raise TraceError("the launches rows have no req_slot values")
    return AlignLaunch(
        **values, block_size=block_size, num_speculative_tokens=num_speculative_tokens
    )
