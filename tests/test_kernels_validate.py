"""Validation before any launch: every index a row would use is checked; bad rows never run.

Each check has its control: the same launch with the value just inside its bound passes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mgtrace.kernels import (
    AlignLaunch,
    BlockTables,
    StatePool,
    StateSpec,
    run_reference,
    validate_launch,
)
from mgtrace.kernels.validate import MalformedMetadata, find_hazards
from tests.kernel_builders import distinct_tables, postprocess, precopy, two_state_pool

pytestmark = pytest.mark.unit

ROWS, COLS, BLOCKS = 4, 8, 64


@pytest.fixture
def pool():
    return two_state_pool(num_blocks=BLOCKS)


@pytest.fixture
def tables() -> BlockTables:
    return distinct_tables(ROWS, COLS, BLOCKS)


def base_precopy(**changes) -> AlignLaunch:
    values = {"slots": [0, 1, 2], "dst": [3, 3, 4], "src": [2, 2, 3], "bias": [0, 1, 2]}
    values.update(changes)
    return precopy(values["slots"], values["dst"], values["src"], values["bias"])


def with_cell(tables: BlockTables, row: int, col: int, value: int) -> BlockTables:
    edited = [t.copy() for t in tables.tables]
    edited[0][row, col] = value
    return BlockTables(edited)


def test_well_formed_launch_has_no_problem(pool, tables) -> None:
    v = validate_launch(base_precopy(), pool, tables)
    assert v.ok and not v.bad.any()
    assert v.copies.rows.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("changes", "expected", "control"),
    [
        (
            {"slots": [0, ROWS, 2]},
            MalformedMetadata(1, "bt_row", ROWS, ROWS, 0),
            {"slots": [0, ROWS - 1, 2]},
        ),
        ({"slots": [0, 1, -7]}, None, {"slots": [0, 1, -1]}),  # any negative slot is padding
        (
            {"dst": [3, COLS, 4]},
            MalformedMetadata(1, "dst_col", COLS, COLS, 0),
            {"dst": [3, COLS - 1, 4]},
        ),
        (
            {"src": [COLS, 2, 3], "bias": [0, 1, 2]},
            MalformedMetadata(0, "src_col", COLS, COLS, 0),
            {"src": [COLS - 1, 2, 3]},
        ),
        (
            {"src": [2, 2, 6], "bias": [0, 1, 2]},
            MalformedMetadata(2, "temporal_src_col", COLS, COLS, 0),
            {"src": [2, 2, 5]},
        ),
        ({"bias": [0, -1, 2]}, MalformedMetadata(1, "token_bias", -1, None), {"bias": [0, 0, 2]}),
    ],
)
def test_out_of_range_inputs_are_reported_and_never_run(
    pool, tables, changes, expected, control
) -> None:
    bad = base_precopy(**changes)
    v = validate_launch(bad, pool, tables)
    if expected is None:
        assert v.ok
    else:
        assert v.problems == [expected]
        assert v.bad.tolist() == [i == expected.batch_row for i in range(3)]
        assert expected.batch_row not in v.copies.rows.tolist()
    assert validate_launch(base_precopy(**control), pool, tables).ok


@pytest.mark.parametrize("value", [BLOCKS, -1, 10**9])
def test_block_ids_outside_the_pool_are_reported_and_never_indexed(pool, tables, value) -> None:
    launch = base_precopy()
    r, c = 1, 3  # row 1's destination column
    bad_tables = with_cell(tables, r, c, value)
    before = pool.numpy().copy()
    result = run_reference(launch, pool, bad_tables)
    assert result.validation.problems == [MalformedMetadata(1, "block_id", value, BLOCKS, 0)]
    after = pool.numpy()
    page = pool.page_bytes
    # -1 would have wrapped to the last block had it been used as an index.
    assert np.array_equal(after[(BLOCKS - 1) * page :], before[(BLOCKS - 1) * page :])
    # The good rows still ran.
    dst0 = int(tables[0][0, 3])
    assert not np.array_equal(
        after[dst0 * page : (dst0 + 1) * page], before[dst0 * page : (dst0 + 1) * page]
    )
    # Control: the largest valid id passes.
    assert validate_launch(launch, pool, with_cell(tables, r, c, BLOCKS - 1)).ok


def test_null_block_zero_is_a_valid_block(pool, tables) -> None:
    v = validate_launch(base_precopy(), pool, with_cell(tables, 0, 3, 0))
    assert v.ok
    assert v.copies.dst[0].tolist()[0] == 0


def test_row_structure_problems(pool, tables) -> None:
    launch = base_precopy()
    shuffled = replace(launch, batch_row=np.array([0, 2, 1]), bt_row=None)
    v = validate_launch(shuffled, pool, tables)
    assert [(p.batch_row, p.what) for p in v.problems] == [(1, "batch_row"), (2, "batch_row")]
    wrong_rows = replace(launch, bt_row=np.array([0, 1, 3]))
    v = validate_launch(wrong_rows, pool, tables)
    assert v.problems == [MalformedMetadata(2, "bt_row", 3, None)]
    v = validate_launch(launch, pool, tables, max_slots=2)
    assert v.problems == [MalformedMetadata(2, "req_slot", 2, 2)]
    # Controls.
    assert validate_launch(launch, pool, tables, max_slots=3).ok
    assert validate_launch(replace(launch, bt_row=None), pool, tables).ok


def test_missing_inputs_are_reported(pool, tables) -> None:
    accepted = np.ma.MaskedArray([1, 2, 1], mask=[False, True, False])
    launch = postprocess([0, 1, 2], accepted, [1, 1, 1], [4, 4, 4], [3, 3, 3], [2, 2, 2])
    v = validate_launch(launch, pool, tables)
    assert v.problems == [MalformedMetadata(1, "num_accepted", None, None)]
    no_column = postprocess([0], [1], [1], [4], None, None)
    v = validate_launch(no_column, pool, tables)
    assert {p.what for p in v.problems} == {"num_scheduled", "num_draft"}
    assert not v.copies.rows.size
    # Control: a padded row may lack anything.
    padded = postprocess(
        [0, -1], np.ma.MaskedArray([1, 0], mask=[False, True]), [1, 1], [4, 4], [3, 3], [2, 2]
    )
    assert validate_launch(padded, pool, tables).ok


def test_postprocess_destination_before_the_table(pool, tables) -> None:
    # R = 0 (all scheduled tokens drafts): the boundary arithmetic lands on column -1.
    bad = postprocess([0, 1], [1, 1], [0, 1], [0, 3], [1, 3], [1, 2])
    v = validate_launch(bad, pool, tables)
    assert v.problems == [MalformedMetadata(0, "dst_col", -1, COLS, 0)]
    assert validate_launch(postprocess([1], [1], [1], [3], [3], [2]), pool, tables).ok


def test_aligned_indices_columns(pool, tables) -> None:
    def indices(seq):
        return AlignLaunch(
            "aligned_indices",
            batch_row=np.arange(len(seq)),
            req_slot=np.arange(len(seq)),
            seq_len=seq,
            block_size=4,
            num_speculative_tokens=2,
        )

    # first = (seq - 1) // 4; columns first..first+2 must exist.
    v = validate_launch(indices([1, 4 * (COLS - 2) + 1]), pool, tables)
    assert v.problems == [MalformedMetadata(1, "state_col", COLS, COLS, 0)]
    assert validate_launch(indices([1, 4 * (COLS - 3) + 1]), pool, tables).ok


def test_hazards_name_rows_sharing_a_block(pool, tables) -> None:
    launch = base_precopy()
    v = validate_launch(launch, pool, tables)
    assert find_hazards(v, pool) == []
    # Row 1 writes the block row 0 writes.
    shared = with_cell(tables, 1, 3, int(tables[0][0, 3]))
    v = validate_launch(launch, pool, shared)
    kinds = {(h.batch_row, h.other_row, h.kind) for h in find_hazards(v, pool)}
    assert (1, 0, "write_write") in kinds


def _temporal_only_launch(state_idx: int, accepted: int) -> tuple:
    """A linear-attention group (temporal state only) and a precomputed post-process whose
    destination is column 0: ``accepted`` sets the bias (16 - running)."""
    pool = StatePool([StateSpec(0, "temporal", (4,), "uint8")], 20)
    tables = BlockTables([np.arange(1, 17, dtype=np.int32).reshape(2, COLS)])
    launch = postprocess([0], [accepted], [state_idx], [16], mode="precomputed", block=16)
    return pool, tables, launch


def test_temporal_source_column_is_checked_without_int32_wrap() -> None:
    # accepted 1 - 2**31 wraps the bias to -2**31; with state_idx 3 - 2**31 the int32 sum
    # wraps back to column 3, but the device adds the two to the row pointer one at a time.
    pool, tables, launch = _temporal_only_launch(3 - 2**31, 1 - 2**31)
    before = pool.numpy().copy()
    result = run_reference(launch, pool, tables)
    assert result.validation.problems == [
        MalformedMetadata(0, "temporal_src_col", 3 - 2**32, COLS, 0)
    ]
    assert not result.validation.copies.rows.size
    assert np.array_equal(pool.numpy(), before)
    # Control: a source column that is really in range (bias 1, column 2 + 1).
    pool, tables, launch = _temporal_only_launch(2, 2)
    assert validate_launch(launch, pool, tables).ok


def test_a_wrapped_bias_whose_conv_window_still_fits_int32_is_refused(tables) -> None:
    # Block size 2**30: the boundary 2**30 minus a running count wrapped to -2**31 leaves a
    # bias of -2**30, and 4 - bias fits int32: the device would slide 2**30 + 4 tokens.
    # (A conv-only group: no temporal source column to refuse the row first.)
    conv_only = StatePool([StateSpec(0, "conv", (4, 2), "uint8", "SD")], BLOCKS)
    launch = postprocess([0], [1 - 2**30], [1], [2**30], mode="precomputed", block=2**30)
    v = validate_launch(launch, conv_only, tables)
    assert v.problems == [MalformedMetadata(0, "token_bias", -(2**30), None)]
    assert not v.copies.rows.size
    # Control: at -2**31 the window length wraps as well, and nothing is copied.
    launch = postprocess([0], [1 - 2**31], [1], [16], mode="precomputed", block=16)
    v = validate_launch(launch, conv_only, tables)
    assert v.ok and v.copies.bias.tolist() == [-(2**31)]


def test_a_row_refused_for_an_index_still_resets_its_accepted_count(tables) -> None:
    # In place (state_idx 1 == destination column 1, bias 2) with the destination block past
    # the pool: the device resets the count before it reads any table.
    pool = two_state_pool(num_blocks=BLOCKS)
    launch = postprocess([0], [3], [1], [8], mode="precomputed")
    bad_tables = with_cell(tables, 0, 1, BLOCKS)
    result = run_reference(launch, pool, bad_tables)
    assert [p.what for p in result.validation.problems] == ["block_id"]
    assert result.accepted_out.tolist() == [1]
    # Control: a row whose decision inputs are unusable keeps its recorded count.
    undecided = postprocess([0], [3], [1], [8], mode="precomputed")
    result = run_reference(undecided, pool, bad_tables, max_slots=0)
    assert [p.what for p in result.validation.problems] == ["req_slot"]
    assert result.accepted_out.tolist() == [3]


def test_padded_rows_of_the_aligned_indices_gather_are_checked(pool, tables) -> None:
    def indices(seq, slots, rule):
        return AlignLaunch(
            "aligned_indices",
            batch_row=np.arange(len(seq)),
            req_slot=slots,
            row_rule=rule,
            seq_len=seq,
            block_size=4,
            num_speculative_tokens=2,
        )

    # vLLM's gather reads padded rows too: row 1's columns run far past the table.
    launch = indices([5, 10**6], [0, -1], "batch_row")
    v = validate_launch(launch, pool, tables)
    assert v.problems == [MalformedMetadata(1, "state_col", (10**6 - 1) // 4, COLS, 0)]
    assert run_reference(launch, pool, tables).aligned_indices[0, 1].tolist() == [-1, -1, -1]
    # A padded row's recorded table row is checked too.
    rows = replace(indices([5, 5], [0, -1], "req_slot"), bt_row=np.array([0, ROWS]))
    assert validate_launch(rows, pool, tables).problems == [
        MalformedMetadata(1, "bt_row", ROWS, ROWS, 0)
    ]
    # Controls: in range, or a padded row that names no table row (slot rule, slot -1).
    assert validate_launch(indices([5, 4 * (COLS - 3) + 1], [0, -1], "batch_row"), pool, tables).ok
    assert validate_launch(indices([5, 10**6], [0, -1], "req_slot"), pool, tables).ok
