"""What each row of a launch will do, computed from the launch's own numbers only.

This is the decision half of the align kernels (no table or pool is touched), shared by the
validator, the reference backend and the oracle. The arithmetic is int32 with C-style
(truncating) division, exactly as the device code does it, so that even absurd recorded
values (negative counts) lead to the same decision on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgtrace.kernels.launch import KERNELS, AlignLaunch

# numpy scalars cost about a microsecond to create, a sizeable share of a launch; make them once.
ONE = np.int32(1)


def trunc_div(x: np.ndarray, d: int | np.int32) -> np.ndarray:
    """Integer division rounding toward zero, as GPU integer division does."""
    x = np.asarray(x, dtype=np.int32)
    d = np.int32(d) if not isinstance(d, np.int32) else d
    if x.size == 0 or x.min() >= 0:
        return x // d  # floor and truncation agree; the common case, one call
    return (x - np.fmod(x, d)) // d


@dataclass
class RowPlan:
    """Per-row decisions of one launch (int32 arrays of the launch's length)."""

    live: np.ndarray  # bool: the row is not padding (req_slot >= 0)
    copies: np.ndarray  # bool: the row moves state bytes (copy kernels) or gathers (indices)
    bt_row: np.ndarray  # block-table row the row indexes under the launch's rule
    src_col: np.ndarray  # conv source column; the temporal source is src_col + bias
    dst_col: np.ndarray  # destination column (copy kernels) or first column (indices)
    bias: np.ndarray  # accepted-token bias of the copy
    accepted_out: np.ndarray | None = None  # post-process accepted counts after the launch


def plan_launch(launch: AlignLaunch) -> RowPlan:
    slot = launch.column("req_slot")
    live = slot >= 0
    bt_row = launch.column("batch_row") if launch.row_rule == "batch_row" else slot
    if launch.kernel == "precopy":
        src = launch.column("src_col")
        dst = launch.column("state_idx")
        return RowPlan(
            live=live,
            copies=live & (src >= 0) & (src != dst),
            bt_row=bt_row,
            src_col=src,
            dst_col=dst,
            bias=launch.column("token_bias"),
        )
    if launch.kernel == "aligned_indices":
        first = np.maximum(trunc_div(launch.column("seq_len") - ONE, launch.block32), 0)
        return RowPlan(
            live=live,
            copies=live,
            bt_row=bt_row,
            src_col=first,
            dst_col=first,
            bias=np.zeros(launch.num_rows, dtype=np.int32),
        )
    accepted = launch.column("num_accepted")
    src = launch.column("state_idx")
    block = launch.block32
    # int32 array arithmetic wraps silently, as it does on the device.
    if launch.mode == "precomputed":
        new_computed = launch.column("num_computed")
        running = new_computed - accepted + ONE
    else:
        running = (launch.column("num_computed") + launch.column("num_scheduled")) - launch.column(
            "num_draft"
        )
        new_computed = running + accepted - ONE
    # Floor and truncating division agree unless a count is negative (malformed input).
    non_negative = not np.count_nonzero(new_computed < 0)  # cheaper than a min() reduction
    blocks = new_computed // block if non_negative else trunc_div(new_computed, block)
    aligned = blocks * block
    need = aligned >= running
    if not launch.all_live:
        need &= live
    bias = aligned - running
    dst = blocks - ONE
    moved = src - dst
    reset = need & (moved == 0)
    # In place with no shift is a no-op copy; the accepted count is still reset.
    copies = np.logical_and(need, moved | bias)
    accepted_out = accepted.copy()
    accepted_out[reset] = 1
    return RowPlan(
        live=live,
        copies=copies,
        bt_row=bt_row,
        src_col=src,
        dst_col=dst,
        bias=bias,
        accepted_out=accepted_out,
    )


def plan_rows(
    kernel: np.ndarray,
    by_batch_row: np.ndarray,
    precomputed: np.ndarray,
    columns: dict[str, np.ndarray],
    block_size: int,
) -> RowPlan:
    """``plan_launch`` for the rows of many launches at once, as a trace holds them: per row
    its kernel (a code into ``KERNELS``), whether its launch indexes block tables by batch
    row and whether its post-process runs in precomputed mode; ``columns`` holds every row
    column as int32. A launch's plan is the slice of its rows (rows of a launch that lacks
    an input its kernel reads are meaningless: its plan is the empty one). The arithmetic is
    the per-launch one, row by row: truncating division is exact for every sign, so
    launches with and without negative counts agree."""
    block = np.int32(block_size)
    slot = columns["req_slot"]
    live = slot >= 0
    bt_row = np.where(by_batch_row, columns["batch_row"], slot)
    precopy = kernel == KERNEL_CODES["precopy"]
    gather = kernel == KERNEL_CODES["aligned_indices"]
    # post-process rows
    accepted = columns["num_accepted"]
    computed = columns["num_computed"]
    decided = (computed + columns["num_scheduled"]) - columns["num_draft"]
    new_computed = np.where(precomputed, computed, decided + accepted - ONE)
    running = np.where(precomputed, computed - accepted + ONE, decided)
    blocks = _truncated(new_computed, block)
    aligned = blocks * block
    need = (aligned >= running) & live
    post_bias = aligned - running
    post_dst = blocks - ONE
    moved = columns["state_idx"] - post_dst
    accepted_out = np.where(need & (moved == 0), ONE, accepted).astype(np.int32)
    post_copies = need & ((moved | post_bias) != 0)
    # pre-copy and aligned-indices rows
    first = np.maximum(_truncated(columns["seq_len"] - ONE, block), 0).astype(np.int32)
    src = columns["src_col"]
    dst = columns["state_idx"]
    pre_copies = live & (src >= 0) & (src != dst)
    return RowPlan(
        live=live,
        copies=np.where(precopy, pre_copies, np.where(gather, live, post_copies)),
        bt_row=bt_row,
        src_col=np.where(precopy, src, np.where(gather, first, dst)),
        dst_col=np.where(precopy, dst, np.where(gather, first, post_dst)),
        bias=np.where(precopy, columns["token_bias"], np.where(gather, 0, post_bias)).astype(
            np.int32
        ),
        accepted_out=accepted_out,
    )


KERNEL_CODES = {name: i for i, name in enumerate(KERNELS)}


def _truncated(x: np.ndarray, d: np.int32) -> np.ndarray:
    """``x / d`` rounded toward zero, element by element, in int32."""
    return (x - np.fmod(x, d)) // d
