"""Vectorised numpy backend: the same bytes as the Triton kernels, fast on the CPU.

The byte movement of one launch is a gather followed by a scatter over a flat view of the
pool. Per state, the bytes a row copies depend only on the token bias, so the pool gets a
precomputed "byte plan" per bias value: for every grain of every state, where it comes from
(conv source block, temporal source block, or itself when the shifted window does not cover
it) and at which offset. A launch then costs a handful of numpy calls over [rows, grains].

Defined behaviour: inside one row everything matches the device code, including the
same-block conv left shift (all reads happen before any write, which is a memmove). Across
rows, a launch whose rows touch a common block (see ``validate.find_hazards``) races on a
GPU; here every source is read before any destination is written and, for two writes of
one byte, the later batch row wins. Hazard-free launches, the only ones vLLM can rely on,
give the same bytes on every backend.

Pools too large for a byte plan (full-size states) fall back to per-row slice copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.pool import BlockTables, StatePool
from mgtrace.kernels.validate import ResolvedCopies, Validation, validate_launch

# Launches up to this many copying rows use per-row precomputed selectors.
ROW_SELECTOR_ROWS = 256
# Grains per row beyond which the byte plan would cost more memory than it saves time.
PLAN_LIMIT = 1 << 16

_GRAIN_TYPES = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


@dataclass
class LaunchResult:
    """What a launch produced besides the pool bytes."""

    validation: Validation
    accepted_out: np.ndarray | None = None  # post-process: per batch row
    aligned_indices: np.ndarray | None = None  # aligned indices: [groups, rows, 1 + k]


class BytePlan:
    """Per-bias gather pattern of one pool layout, in grains of the largest common size."""

    def __init__(self, pool: StatePool, num_groups: int) -> None:
        specs = pool.specs
        sizes = [pool.page_bytes, *pool.offsets]
        for s in specs:
            sizes += [s.nbytes, s.unit_bytes or s.nbytes, s.row_bytes]
        common = int(np.gcd.reduce(np.array(sizes, dtype=np.int64)))
        self.grain = next(g for g in (8, 4, 2, 1) if common % g == 0)
        self.max_bias = max([s.width for s in specs] + [0])
        self.max_bias32 = np.int32(self.max_bias)
        g = self.grain
        G = num_groups
        src_rel, sel, dst_rel, dst_sel = [], [], [], []
        for spec, off in zip(specs, pool.offsets, strict=True):
            j = np.arange(0, spec.nbytes, g, dtype=np.int64)
            here = (off + j) // g
            dst_rel.append(here)
            dst_sel.append(np.full(j.size, spec.group, dtype=np.int64))
            per_bias_rel, per_bias_sel = [], []
            for b in range(self.max_bias + 1):
                if spec.kind == "temporal":
                    per_bias_rel.append(here)
                    per_bias_sel.append(np.full(j.size, 2 * G + spec.group, dtype=np.int64))
                    continue
                if spec.layout == "SD":
                    token = j // spec.unit_bytes
                else:
                    token = (j % spec.row_bytes) // spec.elem_size
                covered = token < spec.width - b
                per_bias_rel.append(np.where(covered, (off + j + b * spec.unit_bytes) // g, here))
                per_bias_sel.append(np.where(covered, G + spec.group, spec.group))
            src_rel.append(np.stack(per_bias_rel))
            sel.append(np.stack(per_bias_sel))
        # [bias, 2, P]: which of the row's blocks each grain comes from, and its offset;
        # one gather by bias fetches both.
        self.source = np.stack(
            (np.concatenate(sel, axis=1), np.concatenate(src_rel, axis=1)), axis=1
        )
        self.dst_rel = np.concatenate(dst_rel)  # [P]
        self.dst_sel = np.concatenate(dst_sel)  # [P]
        self.one_group = num_groups == 1
        self.width = 3 * G
        self.page_grains = np.int64(pool.page_bytes // g)
        self._row_base = np.zeros((0, 1), dtype=np.int64)
        self._row_selectors: np.ndarray | None = None
        self.dst_picks: np.ndarray | None = None  # [row, P] destinations, with the selectors
        self.row_index = np.arange(ROW_SELECTOR_ROWS, dtype=np.intp)

    def row_selectors(self, rows: int) -> np.ndarray | None:
        """[row, bias, P] selectors into the flattened per-row block lists, for launches of
        up to ROW_SELECTOR_ROWS rows; None where that table would be too large."""
        if rows > ROW_SELECTOR_ROWS or self.source.shape[0] * self.source.shape[2] > 8192:
            return None
        if self._row_selectors is None:
            offsets = np.arange(ROW_SELECTOR_ROWS, dtype=np.int64) * self.width
            self._row_selectors = self.source[None, :, 0, :] + offsets[:, None, None]
            self.dst_picks = self.dst_sel[None, :] + offsets[:, None]
        return self._row_selectors

    def row_base(self, rows: int) -> np.ndarray:
        """[rows, 1] start of each row's block list in the flattened per-row blocks."""
        if self._row_base.shape[0] < rows:
            self._row_base = (np.arange(max(rows, 256), dtype=np.int64) * self.width)[:, None]
        return self._row_base[:rows]

    @classmethod
    def for_pool(cls, pool: StatePool, num_groups: int) -> BytePlan:
        # Cached on the pool: its layout never changes, and a lookup keyed by the layout
        # would cost a hash of every spec on every launch.
        plans = pool.__dict__.setdefault("_byte_plans", {})
        plan = plans.get(num_groups)
        if plan is None:
            plan = plans[num_groups] = cls(pool, num_groups)
        return plan


def run_reference(
    launch: AlignLaunch,
    pool: StatePool,
    tables: BlockTables,
    *,
    validation: Validation | None = None,
    max_slots: int | None = None,
) -> LaunchResult:
    """Validate (unless done already), then apply the launch to the CPU pool in place."""
    if validation is None:
        validation = validate_launch(launch, pool, tables, max_slots=max_slots)
    result = LaunchResult(validation=validation)
    if launch.kernel == "aligned_indices":
        result.aligned_indices = _aligned_indices(launch, tables, validation)
        return result
    if launch.kernel == "postprocess":
        result.accepted_out = validation.accepted_out(launch)
    copies = validation.copies
    if copies.rows.size == 0:
        return result
    if pool.state_bytes > PLAN_LIMIT:
        _copy_by_slices(pool, copies)
    else:
        _copy_by_plan(pool, len(tables), copies)
    return result


def _copy_by_plan(pool: StatePool, num_groups: int, copies: ResolvedCopies) -> None:
    plan = BytePlan.for_pool(pool, num_groups)
    flat = pool.view(_GRAIN_TYPES[plan.grain])
    # Per row, the grain offsets of its 3G blocks (kind-major, as the plan's selectors).
    blocks = copies.blocks  # [G, 3, A]
    a = blocks.shape[2]
    # An int64 factor widens the int32 block ids before the multiply can wrap.
    base = np.multiply(blocks.transpose(2, 1, 0), plan.page_grains, order="C").reshape(a, -1)
    # A negative bias (a post-process subtraction that wrapped int32) keeps no conv token on
    # the device: as unsigned it clamps to the widest window, which keeps none either.
    bias = np.minimum(copies.bias.astype(np.int32, copy=False).view(np.uint32), plan.max_bias)
    picks = plan.row_selectors(a)
    if picks is not None:
        # Selectors already offset by each row's position: one gather fewer per launch.
        src = base.ravel()[picks[plan.row_index[:a], bias]] + plan.source[bias, 1]
    else:
        source = plan.source[bias]  # [A, 2, P]: block selector and offset of every grain
        src = base.ravel()[source[:, 0] + plan.row_base(a)] + source[:, 1]
    # Destination blocks come first in each row's list, one per group (with one group,
    # every grain lands in the row's first block).
    if plan.one_group:
        dst = base[:, :1] + plan.dst_rel
    elif picks is not None:
        dst = base.ravel()[plan.dst_picks[:a]] + plan.dst_rel
    else:
        dst = base[:, plan.dst_sel] + plan.dst_rel
    flat[dst] = flat[src]


def _copy_by_slices(pool: StatePool, copies: ResolvedCopies) -> None:
    data = pool.numpy()
    page = pool.page_bytes
    for i, _row in enumerate(copies.rows.tolist()):
        bias = int(copies.bias[i])
        for spec, off in zip(pool.specs, pool.offsets, strict=True):
            g = spec.group
            dst = int(copies.dst[g, i]) * page + off
            if spec.kind == "temporal":
                src = int(copies.temporal_src[g, i]) * page + off
                data[dst : dst + spec.nbytes] = data[src : src + spec.nbytes]
                continue
            keep = spec.width - bias
            if keep <= 0 or bias < 0:  # a wrapped negative bias keeps no token (see above)
                continue
            src = int(copies.conv_src[g, i]) * page + off
            span = keep * spec.unit_bytes
            shift = bias * spec.unit_bytes
            for r in range(spec.rows):
                at = r * spec.row_bytes
                # numpy copies overlapping slices as a memmove.
                data[dst + at : dst + at + span] = data[src + at + shift : src + at + shift + span]


def _aligned_indices(
    launch: AlignLaunch, tables: BlockTables, validation: Validation
) -> np.ndarray:
    k = launch.num_speculative_tokens
    out = np.full((len(tables), launch.num_rows, k + 1), -1, dtype=np.int32)
    rows = np.nonzero(validation.plan.copies & ~validation.bad)[0]
    if rows.size:
        r = validation.plan.bt_row[rows]
        cols = validation.plan.dst_col[rows][:, None] + np.arange(k + 1)
        for g in range(len(tables)):
            out[g, rows] = tables[g][r[:, None], cols]
    return out
