"""The launch description: one set of names with the trace's launches table, Arrow round trip."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from mgtrace.errors import TraceError, UsageError
from mgtrace.kernels.launch import (
    ROW_COLUMNS,
    SCALAR_COLUMNS,
    AlignLaunch,
    column_names,
    launch_from_arrow,
    launch_to_arrow,
)
from mgtrace.schemas.tables import LAUNCHES
from tests.kernel_builders import postprocess, precopy

pytestmark = pytest.mark.unit


def _name_drift(fields: tuple[str, ...], schema: tuple[str, ...]) -> set[str]:
    return set(fields) ^ set(schema)


def test_launch_fields_are_exactly_the_launches_columns() -> None:
    assert _name_drift(column_names(), LAUNCHES.column_names) == set()
    assert sorted(SCALAR_COLUMNS + ROW_COLUMNS) == sorted(LAUNCHES.column_names)
    # Control: a renamed field is caught by the same comparison.
    renamed = tuple("accepted" if n == "num_accepted" else n for n in column_names())
    assert _name_drift(renamed, LAUNCHES.column_names) == {"accepted", "num_accepted"}


def test_arrow_round_trip_keeps_values_nulls_and_scalars() -> None:
    cpu = np.ma.MaskedArray([0, 3, 0], mask=[True, False, True])
    launch = postprocess([5, 1, -1], [2, 1, 3], [4, 2, 7], [9, 3, 0], [3, 1, 1], [2, 0, 2])
    launch = AlignLaunch(
        **{
            **_fields(launch),
            "num_accepted_cpu": cpu,
            "rank": 1,
            "step": 7,
            "batch_step": 6,
            "bt_table": "source",
            "bt_step": 7,
        }
    )
    table = launch_to_arrow(launch)
    assert table.schema.equals(LAUNCHES.schema)
    assert table.column("num_accepted_cpu").to_pylist() == [None, 3, None]
    assert table.column("src_col").null_count == 3
    # Rows arrive in any order from a trace.
    shuffled = table.take(pa.array([2, 0, 1]))
    back = launch_from_arrow(shuffled, block_size=launch.block_size, num_speculative_tokens=2)
    for name in ROW_COLUMNS:
        a, b = getattr(launch, name), getattr(back, name)
        if a is None:
            assert b is None, name
            continue
        assert np.array_equal(np.ma.getdata(a), np.ma.getdata(b)), name
        assert np.array_equal(np.ma.getmaskarray(a), np.ma.getmaskarray(b)), name
    for name in SCALAR_COLUMNS:
        assert getattr(back, name) == getattr(launch, name), name


def test_rows_of_two_launches_are_refused() -> None:
    a = launch_to_arrow(precopy([0, 1], [2, 2], [1, 1], [0, 1]))
    b = launch_to_arrow(postprocess([0], [1], [1], [4], [1], [0]))
    with pytest.raises(TraceError, match="kernel"):
        launch_from_arrow(pa.concat_tables([a, b]), block_size=4)
    # Control: each alone is fine.
    assert launch_from_arrow(a, block_size=4).kernel == "precopy"


def test_launch_record_is_frozen_and_rule_change_recomputes_rows() -> None:
    launch = precopy([3, -1, 0], [2, 2, 2], [1, 1, 1], [0, 0, 0])
    with pytest.raises(ValueError):
        launch.state_idx[0] = 9
    assert launch.bt_row.tolist() == [3, -1, 0]
    by_row = launch.with_row_rule("batch_row")
    assert by_row.bt_row.tolist() == [0, 1, 2]
    assert by_row.bt_row_consistent and launch.bt_row_consistent


def test_a_masked_column_is_frozen_too() -> None:
    """A column with null rows is a masked array; its values and its mask are frozen like
    any column (freezing ``.data`` and ``.mask`` would freeze views of them only)."""
    given = np.ma.MaskedArray(np.array([4, 5, 6], np.int32), mask=[False, True, False])
    launch = precopy([3, 1, 0], [2, 2, 2], [1, 1, 1], [0, 0, 0])
    launch = AlignLaunch(**{**_fields(launch), "num_accepted_cpu": given})
    cpu = launch.num_accepted_cpu
    for write in (
        lambda: cpu.__setitem__(0, 9),
        lambda: np.ma.getdata(cpu).__setitem__(0, 9),
        lambda: np.ma.getmaskarray(cpu).__setitem__(0, True),
    ):
        with pytest.raises(ValueError):
            write()
    given[0] = 7  # control: the caller's own array stays theirs
    assert cpu.tolist() == [4, None, 6]


def test_bad_launch_parameters_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="kernel"):
        AlignLaunch("copy", batch_row=[0], req_slot=[0])
    with pytest.raises(UsageError, match="mode"):
        AlignLaunch("postprocess", batch_row=[0], req_slot=[0])
    with pytest.raises(UsageError, match="rows"):
        AlignLaunch("precopy", batch_row=[0, 1], req_slot=[0, 1], state_idx=[1])


def _fields(launch: AlignLaunch) -> dict:
    from dataclasses import fields

    return {f.name: getattr(launch, f.name) for f in fields(launch)}


def test_pool_from_run_metadata() -> None:
    from mgtrace.kernels import StatePool
    from mgtrace.schemas.manifest import RunMetadata, StateLayout

    run = RunMetadata(
        num_blocks=5,
        states=[
            StateLayout(0, 0, "conv", [4, 3], "bfloat16", "DS"),
            StateLayout(0, 0, "temporal", [2, 3, 5], "float32"),
        ],
    )
    pool = StatePool.from_run(run)
    assert [s.layout for s in pool.specs] == ["DS", "-"]
    assert pool.page_bytes == 4 * 3 * 2 + 30 * 4
    assert pool.specs[0].width == 3 and pool.specs[0].rows == 4
    with pytest.raises(UsageError):
        StatePool.from_run(RunMetadata())
