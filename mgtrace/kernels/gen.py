"""Random align-kernel cases: a pool, its block tables and one launch, from one seed.

Cases are small (the Triton interpreter runs a few hundred programs a second) but cover
what differs between backends: both conv layouts, odd element and state sizes, pages whose
size is not a multiple of 8 (so source and destination alignments differ), several groups,
padded rows, both row rules, bias 0..k, the in-place post-process (src == dst), the
same-block conv shift, the null block 0 and, now and then, malformed rows that validation
must keep away from the kernels.

Block ids are distinct across the rows of a table, so no two rows of a launch touch the
same block: the outcome of a launch is then defined on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.pool import BlockTables, StatePool, StateSpec

KERNEL_CHOICES = ("precopy", "postprocess", "aligned_indices")
DTYPES = ("uint8", "bfloat16", "int16", "float32", "float64")


@dataclass
class Case:
    seed: int
    pool: StatePool
    tables: BlockTables
    launch: AlignLaunch
    tiles: int
    chunk: int
    has_idx_mapping: bool

    def describe(self) -> str:
        layout = self.pool.conv_layout
        return (
            f"{self.launch.kernel}/{self.launch.mode or '-'} rows={self.launch.num_rows} "
            f"states={len(self.pool.specs)} groups={len(self.tables)} conv={layout} "
            f"rule={self.launch.row_rule} idx_mapping={self.has_idx_mapping} tiles={self.tiles}"
        )


def random_specs(rng: np.random.Generator, k: int, layout: str, max_states: int) -> list[StateSpec]:
    groups = int(rng.integers(1, 3))
    specs: list[StateSpec] = []
    while len(specs) < max_states:
        g = int(rng.integers(0, groups)) if specs else 0
        kind = "conv" if rng.random() < 0.5 else "temporal"
        dtype = str(rng.choice(DTYPES))
        if kind == "conv":
            width = int(rng.integers(1, 4)) + k  # conv_kernel - 1 + k
            dim = int(rng.integers(1, 6))
            shape = (width, dim) if layout == "SD" else (dim, width)
            specs.append(StateSpec(g, "conv", shape, dtype, layout))
        else:
            shape = tuple(int(x) for x in rng.integers(1, 6, size=int(rng.integers(1, 3))))
            if rng.random() < 0.2:
                shape = (int(rng.integers(60, 300)),)  # several u64 chunks for the tiles
            specs.append(StateSpec(g, "temporal", shape, dtype))
        if rng.random() < 0.3:
            break
    # Every group index below the largest must own a table; renumber densely.
    used = sorted({s.group for s in specs})
    return [StateSpec(used.index(s.group), s.kind, s.shape, s.dtype, s.conv_layout) for s in specs]


def random_case(
    seed: int,
    *,
    max_rows: int = 5,
    max_states: int = 4,
    malformed: float = 0.1,
    layout: str | None = None,
    kernel: str | None = None,
    row_rule: str | None = None,
) -> Case:
    """One case from ``seed``; ``layout``, ``kernel`` and ``row_rule`` pin a choice (the
    random draws stay the same, so the rest of the case does not change with them)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    block_size = int(rng.choice([k + 1, 4, 5, 8]))
    block_size = max(block_size, k + 1)
    drawn_layout = "SD" if rng.random() < 0.5 else "DS"
    layout = layout or drawn_layout
    specs = random_specs(rng, k, layout, max_states)
    groups = 1 + max(s.group for s in specs)

    n = int(rng.integers(1, max_rows + 1))
    num_slots = n + int(rng.integers(0, 4))
    cols = 4 + k + int(rng.integers(0, 4))
    drawn_kernel = str(rng.choice(KERNEL_CHOICES, p=[0.4, 0.45, 0.15]))
    kernel = kernel or drawn_kernel
    v2 = rng.random() < 0.5
    if v2:
        slots = rng.permutation(num_slots)[:n].astype(np.int32)
        slots[rng.random(n) < 0.2] = -1
    else:
        slots = np.arange(n, dtype=np.int32)
    drawn_rule = "req_slot" if rng.random() < 0.8 else "batch_row"
    row_rule = row_rule or drawn_rule
    has_idx_mapping = bool(v2 or rng.random() < 0.3)

    # Distinct block ids per group table, so rows never share blocks; block 0 is the null block.
    num_blocks = num_slots * cols + 1 + int(rng.integers(0, 5))
    tables = [
        rng.permutation(np.arange(1, num_blocks))[: num_slots * cols]
        .reshape(num_slots, cols)
        .astype(np.int32)
        for _ in range(groups)
    ]
    table_row = slots.copy() if row_rule == "req_slot" else np.arange(n, dtype=np.int32)

    launch = _random_launch(rng, kernel, n, slots, row_rule, k, block_size, cols, malformed)
    src = launch.src_col if kernel == "precopy" else launch.state_idx
    # Same block at the source and destination columns: the conv shift turns into a memmove.
    if kernel == "precopy" and rng.random() < 0.3:
        i = int(rng.integers(0, n))
        r, s, d = int(table_row[i]), int(src[i]), int(launch.state_idx[i])
        if r >= 0 and 0 <= s < cols and 0 <= d < cols:
            for t in tables:
                t[r, d] = t[r, s]
    # The null block in a column one row uses.
    if rng.random() < 0.2:
        i = int(rng.integers(0, n))
        if table_row[i] >= 0:
            tables[int(rng.integers(0, groups))][table_row[i], int(rng.integers(0, cols))] = 0
    if rng.random() < malformed:
        t = tables[int(rng.integers(0, groups))]
        t[int(rng.integers(0, num_slots)), int(rng.integers(0, cols))] = num_blocks + int(
            rng.integers(0, 3)
        )

    page = sum(s.nbytes for s in specs) + int(rng.integers(0, 14))
    pool = StatePool(specs, num_blocks, page_bytes=page)
    fill = rng.integers(0, 256, size=pool.buffer.numel(), dtype=np.uint8)
    pool.buffer.copy_(torch.from_numpy(fill))
    tiles = int(rng.integers(1, 3))
    chunk = int(rng.choice([8, 64, 1024]))
    return Case(seed, pool, BlockTables(tables), launch, tiles, chunk, has_idx_mapping)


def _random_launch(
    rng: np.random.Generator,
    kernel: str,
    n: int,
    slots: np.ndarray,
    row_rule: str,
    k: int,
    block: int,
    cols: int,
    malformed: float,
) -> AlignLaunch:
    common = {
        "batch_row": np.arange(n, dtype=np.int32),
        "req_slot": slots,
        "row_rule": row_rule,
        "block_size": block,
        "num_speculative_tokens": k,
    }
    top = cols - 1 - k  # highest running column whose speculative columns fit the table
    if kernel == "aligned_indices":
        seq = rng.integers(0, (top + 1) * block + 1, size=n)
        if rng.random() < malformed:
            seq[int(rng.integers(0, n))] = (cols + 1) * block
        return AlignLaunch("aligned_indices", seq_len=seq, **common)
    if kernel == "precopy":
        dst = rng.integers(1, top + 1, size=n)
        src = np.where(rng.random(n) < 0.15, -1, np.maximum(dst - rng.integers(0, 2, size=n), 0))
        bias = rng.integers(0, k + 1, size=n)
        if rng.random() < malformed:
            i = int(rng.integers(0, n))
            if rng.random() < 0.5:
                bias[i] = -1
            else:
                dst[i] = cols + int(rng.integers(0, 3))
        return AlignLaunch("precopy", state_idx=dst, src_col=src, token_bias=bias, **common)
    mode = "decision" if rng.random() < 0.5 else "precomputed"
    computed = rng.integers(0, max(1, (top - 1) * block), size=n)
    decode = rng.random(n) < 0.75
    draft = np.where(decode, k, 0)
    scheduled = np.where(decode, 1 + k, rng.integers(1, 2 * block + 1, size=n))
    accepted = np.where(decode, rng.integers(1, k + 2, size=n), 1)
    end = computed + scheduled
    state_idx = np.maximum(-(-end // block) - 1, 0)
    drift = rng.random(n) < 0.1
    state_idx = np.where(drift, rng.integers(0, top + 1, size=n), state_idx)
    running = computed + scheduled - draft
    if rng.random() < malformed:
        state_idx[int(rng.integers(0, n))] = cols + 2
    if mode == "precomputed":
        return AlignLaunch(
            "postprocess",
            mode=mode,
            num_accepted=accepted,
            state_idx=state_idx,
            num_computed=running + accepted - 1,
            **common,
        )
    return AlignLaunch(
        "postprocess",
        mode=mode,
        num_accepted=accepted,
        state_idx=state_idx,
        num_computed=computed,
        num_scheduled=scheduled,
        num_draft=draft,
        **common,
    )
