"""Small hand-made pools, tables and launches shared by the align-kernel tests."""

from __future__ import annotations

import numpy as np
import torch

from mgtrace.kernels import AlignLaunch, BlockTables, StatePool, StateSpec

BLOCK = 4
K = 2


def filled_pool(
    specs: list[StateSpec], num_blocks: int, *, page_bytes: int | None = None, seed: int = 0
) -> StatePool:
    pool = StatePool(specs, num_blocks, page_bytes=page_bytes)
    fill = np.random.default_rng(seed).integers(0, 256, pool.buffer.numel(), dtype=np.uint8)
    pool.buffer.copy_(torch.from_numpy(fill))
    return pool


def two_state_pool(
    layout: str = "SD", *, page_pad: int = 0, num_blocks: int = 64, seed: int = 0
) -> StatePool:
    """One conv state (window 4, 3 channels of int16) and one odd-sized temporal state."""
    conv_shape = (4, 3) if layout == "SD" else (3, 4)
    specs = [
        StateSpec(0, "conv", conv_shape, "int16", layout),
        StateSpec(0, "temporal", (5, 3), "uint8"),
    ]
    page = sum(s.nbytes for s in specs) + page_pad
    return filled_pool(specs, num_blocks, page_bytes=page, seed=seed)


def distinct_tables(
    rows: int, cols: int, num_blocks: int, groups: int = 1, seed: int = 0
) -> BlockTables:
    """Tables whose block ids never repeat within a group (so rows never share blocks)."""
    rng = np.random.default_rng(seed)
    return BlockTables(
        [
            rng.permutation(np.arange(1, num_blocks))[: rows * cols].reshape(rows, cols)
            for _ in range(groups)
        ]
    )


def precopy(slots, dst, src, bias, *, rule: str = "req_slot") -> AlignLaunch:
    n = len(slots)
    return AlignLaunch(
        "precopy",
        batch_row=np.arange(n),
        req_slot=slots,
        row_rule=rule,
        state_idx=dst,
        src_col=src,
        token_bias=bias,
        block_size=BLOCK,
        num_speculative_tokens=K,
    )


def postprocess(
    slots,
    accepted,
    state_idx,
    computed,
    scheduled=None,
    draft=None,
    *,
    mode: str = "decision",
    block: int = BLOCK,
    rule: str = "req_slot",
) -> AlignLaunch:
    n = len(slots)
    return AlignLaunch(
        "postprocess",
        batch_row=np.arange(n),
        req_slot=slots,
        row_rule=rule,
        mode=mode,
        num_accepted=accepted,
        state_idx=state_idx,
        num_computed=computed,
        num_scheduled=scheduled,
        num_draft=draft,
        block_size=block,
        num_speculative_tokens=K,
    )


def block_bytes(pool: StatePool, block: int, state: int) -> bytes:
    return bytes(pool.state_view(state, block))
