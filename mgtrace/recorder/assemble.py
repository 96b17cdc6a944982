"""Turn the raw snapshots hooks took on the engine thread into trace table columns.

Runs in the assembler process (or, with the in-process fallback, on the recorder thread):
everything that costs a Python loop per row (request ids, scheduler output, region and split
classification, block-table diffs) happens here, so the engine thread only ever pays for a
few array copies per step.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np
import pyarrow as pa

from mgtrace.schemas.tables import (
    BLOCK_TABLE_KINDS,
    KERNELS,
    MAMBA_SPLITS,
    POSTPROCESS_MODES,
    ROW_MOVE_OPS,
    ROW_RULES,
    SCHED_KINDS,
    TABLES,
    categories_of,
)

KERNEL_CODE = {k: i for i, k in enumerate(KERNELS)}
RULE_CODE = {k: i for i, k in enumerate(ROW_RULES)}
MODE_CODE = {k: i for i, k in enumerate(POSTPROCESS_MODES)}
TABLE_CODE = {k: i for i, k in enumerate(BLOCK_TABLE_KINDS)}
OP_CODE = {k: i for i, k in enumerate(ROW_MOVE_OPS)}
SPLIT_DECODE, SPLIT_PREFILL = MAMBA_SPLITS.index("decode"), MAMBA_SPLITS.index("prefill")
BOUND_PTRS = "bound_table_ptrs"  # capture kind of an align context's block-table pointers

I32 = np.int32


def reorder_regions(
    scheduled: np.ndarray, computed: np.ndarray, prompt: np.ndarray, threshold: int | None
) -> np.ndarray | None:
    """Region code per row (decode, short_extend, long_extend, prefill), or None when the
    runner did not reorder. The four-way classification is vLLM's reorder rule."""
    if threshold is None:
        return None
    has_context = computed > 0
    below = scheduled <= threshold
    done = computed >= prompt
    regions = np.full(len(scheduled), 2, dtype=I32)  # long_extend
    regions[has_context & below & done] = 0
    regions[has_context & below & ~done] = 1
    regions[~has_context] = 3
    return regions


def mamba_split(
    num_rows: int, split: tuple[int, int | None, np.ndarray | None] | None
) -> np.ndarray | None:
    """Per row, decode or prefill: from the builder's decode mask where it has one (GDN),
    else rows before its split index decode and every row after is a prefill."""
    if split is None:
        return None
    num_decodes, _threshold, mask = split
    out = np.full(num_rows, SPLIT_PREFILL, dtype=I32)
    if mask is not None:
        if len(mask) < num_rows:
            return None
        out[mask[:num_rows]] = SPLIT_DECODE
    else:
        out[: max(0, min(num_decodes, num_rows))] = SPLIT_DECODE
    return out


def prefill_checkpoints(
    num_rows: int, stored: list[tuple[int, int, int]] | None
) -> dict[str, list[int | None]]:
    """batch_rows' checkpoint columns from the hook's (batch row, tokens, column) triples;
    nothing when no row of the step stored a checkpoint."""
    if not stored:
        return {}
    tokens: list[int | None] = [None] * num_rows
    cols: list[int | None] = [None] * num_rows
    for row, covered, col in stored:
        if 0 <= row < num_rows:
            tokens[row], cols[row] = covered, col
    return {"checkpoint_tokens": tokens, "checkpoint_col": cols}


class Nullable:
    """Values with a null mask, kept apart until many steps are joined: building a numpy
    masked array costs more than the step it describes."""

    __slots__ = ("data", "mask")

    def __init__(self, data: np.ndarray, mask: np.ndarray) -> None:
        self.data, self.mask = data, mask

    def __len__(self) -> int:
        return len(self.data)


def sched_columns(so: Any) -> dict[str, Any] | None:
    """The scheduler output of one step, one row per request (finished/preempted too).

    Built with C-level ``map`` over the scheduler's own lists: a 96-request step costs a few
    microseconds of Python, which matters because this thread shares the engine's GIL."""
    code = {k: i for i, k in enumerate(SCHED_KINDS)}
    nst = so.num_scheduled_tokens
    drafts = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    new = so.scheduled_new_reqs
    cached = so.scheduled_cached_reqs
    new_ids = [r.req_id for r in new]
    cached_ids = list(cached.req_ids)
    ended = [
        ("finished", sorted(so.finished_req_ids)),
        ("preempted", sorted(getattr(so, "preempted_req_ids", None) or ())),
    ]
    n_new, n_cached = len(new_ids), len(cached_ids)
    n_end = sum(len(ids) for _, ids in ended)
    if n_new + n_cached + n_end == 0:
        return None
    req_ids = new_ids + cached_ids
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    kinds = np.full(n_new + n_cached + n_end, code["cached"], dtype=I32)
    kinds[:n_new] = code["new"]
    if resumed:
        for i, rid in enumerate(cached_ids):
            if rid in resumed:
                kinds[n_new + i] = code["resumed"]
    pos = n_new + n_cached
    for kind, ids in ended:
        kinds[pos : pos + len(ids)] = code[kind]
        pos += len(ids)
        req_ids += ids
    prompts = []
    for r in new:
        plen = getattr(r, "prompt_len", None)
        if plen is None and r.prompt_token_ids is not None:
            plen = len(r.prompt_token_ids)
        prompts.append(-1 if plen is None else plen)
    live = new_ids + cached_ids
    n_live = len(live)
    new_blocks = list(cached.new_block_ids)
    total = n_live + n_end

    def padded(head: np.ndarray) -> np.ndarray | Nullable:
        """Live rows' values; finished/preempted rows (and negative values) are null."""
        if n_end == 0 and (head >= 0).all():
            return head
        data = np.full(total, -1, I32)
        data[:n_live] = head
        return Nullable(data, data < 0)

    computed = [r.num_computed_tokens for r in new] + list(cached.num_computed_tokens)
    prompt = np.full(n_live, -1, I32)
    prompt[:n_new] = prompts
    return {
        "req_id": req_ids,
        "kind": kinds,
        "num_scheduled": padded(np.fromiter(map(nst.get, live, repeat(-1)), I32, n_live)),
        "num_computed": padded(np.asarray(computed, dtype=I32)),
        "num_spec": padded(np.fromiter(map(len, map(drafts.get, live, repeat(()))), I32, n_live)),
        "num_prompt": padded(prompt),
        "new_block_ids": [r.block_ids for r in new]
        + new_blocks
        + [None] * (n_cached - len(new_blocks) + n_end),
    }


def positive_or_null(values: np.ndarray) -> np.ndarray | list[int | None]:
    """int32 values, with nulls where a value is not positive (a row that sampled nothing)."""
    out = values.astype(I32)
    if (out > 0).all():
        return out
    return [v if v > 0 else None for v in out.tolist()]


def masked_where_equal(cpu: np.ndarray | None, kernel: np.ndarray) -> list[int | None] | None:
    """The CPU value only where it differs from the kernel's (null elsewhere)."""
    if cpu is None:
        return None
    diff = cpu != kernel
    if not diff.any():
        return None
    return [int(c) if d else None for c, d in zip(cpu.tolist(), diff.tolist(), strict=True)]


def scalar_precopy_columns(
    req_ids: list[str], state_after: dict[str, int], copies: list[tuple[str, int, int, int]]
) -> dict[str, np.ndarray]:
    """The precopy launch a V1 step without an align context ran as single copies: each
    ``collect_mamba_copy_meta`` call (request, source column, destination column, token
    bias) is its row's copy, and the rows it was not called for keep their column, as the
    fused precopy's rows with source -1 do. The destination is the column the copy wrote;
    the other rows' state column is the runner's, after ``preprocess_mamba``."""
    n = len(req_ids)
    state_idx = np.fromiter(map(state_after.get, req_ids, repeat(-1)), I32, n)
    src_col = np.full(n, -1, I32)
    token_bias = np.zeros(n, I32)
    row_of = {r: i for i, r in enumerate(req_ids)}
    for req_id, src, dst, bias in copies:
        i = row_of.get(req_id)
        if i is None:
            raise ValueError(f"a state copy for {req_id!r}, which is not in the batch")
        src_col[i], state_idx[i], token_bias[i] = src, dst, bias
    return {"state_idx": state_idx, "src_col": src_col, "token_bias": token_bias}


def gather_slots(values: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """values[slot] per batch row; -1 for padded/filtered rows (slot < 0)."""
    ok = (slots >= 0) & (slots < len(values))
    out = np.full(len(slots), -1, dtype=np.int64)
    out[ok] = values[slots[ok]]
    return out


class BlockTableDiff:
    """Remembers each table row's last content and reports only rows that changed.

    The comparison is one vectorised pass over the step's rows; only changed rows (a few per
    step: appends, adds, moves) are turned into Python lists."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def changed(
        self, table_code: int, group: int, rows: np.ndarray, counts: np.ndarray
    ) -> dict[str, Any] | None:
        n, width = rows.shape
        last = self._last.get((table_code, group))
        if last is None or last[0].shape[0] < n or last[0].shape[1] < width:
            grown_rows = np.full((max(n, 8), max(width, 8)), -1, dtype=np.int64)
            grown_counts = np.full(max(n, 8), -1, dtype=np.int64)
            if last is not None:
                r, w = last[0].shape
                grown_rows[:r, :w] = last[0]
                grown_counts[:r] = last[1]
            last = (grown_rows, grown_counts)
            self._last[(table_code, group)] = last
        last_rows, last_counts = last
        valid = np.arange(width) < counts[:, None]
        content = np.where(valid, rows, -1)
        old = last_rows[:n, :width]
        diff = (counts != last_counts[:n]) | (content != old).any(axis=1)
        last_counts[n:] = -1  # rows past the batch are re-emitted when they come back
        changed = np.nonzero(diff)[0]
        if not len(changed):
            return None
        old[changed] = content[changed]
        last_rows[changed, width:] = -1
        last_counts[changed] = counts[changed]
        ids = [rows[r, : counts[r]].tolist() for r in changed.tolist()]
        return {
            "group": np.full(len(changed), group, dtype=I32),
            "table": np.full(len(changed), table_code, dtype=I32),
            "row": changed.astype(I32),
            "block_ids": ids,
        }


_SIZED = (np.ndarray, list, tuple, Nullable)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def merge_columns(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Concatenate same-table column dicts (as lists) into one."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    names = set().union(*parts)
    sizes = [max(_length(v) for v in p.values()) for p in parts]
    out: dict[str, Any] = {}
    for name in names:
        got = [p.get(name) for p in parts]
        if all(isinstance(v, np.ndarray) for v in got):
            out[name] = np.concatenate(got)
            continue
        values: list[Any] = []
        for v, n in zip(got, sizes, strict=True):
            if isinstance(v, np.ndarray):
                values.extend(v.tolist())
            elif isinstance(v, (list, tuple)):
                values.extend(v)
            else:  # a scalar (or None) that stands for every row of its part
                values.extend([v] * n)
        out[name] = values
    return out


NUMPY_TYPES = {
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.bool_(): np.bool_,
    pa.float64(): np.float64,
}
SCALARS = (int, float, bool, np.int32, np.int64, np.float64, np.bool_)
_NONE = type(None)
_ARRAYS = {np.ndarray}
_ARRAYS_OR_NONE = {np.ndarray, _NONE}
_SCALAR_KINDS = {*SCALARS, _NONE}


def _rows_in(columns: dict[str, Any]) -> int:
    return max(map(_length, columns.values()), default=0) or 1


def _concat(values: list[Any], counts: list[int], field: pa.Field) -> Any:
    """One column over many steps, in the cheapest form the writer converts without a
    Python loop: a plain array, a masked array where some steps have nulls, integer codes
    for categorical columns, or (strings, nested lists) one flat list."""
    kinds = set(map(type, values))  # one C-level pass instead of a test per value
    if kinds == _ARRAYS:
        return np.concatenate(values)
    type_ = field.type
    if categories_of(field):
        return np.concatenate(
            [
                v.astype(I32) if type(v) is np.ndarray else np.full(n, -1, I32)
                for v, n in zip(values, counts, strict=True)
            ]
        )
    np_type = NUMPY_TYPES.get(type_)
    if np_type is not None:
        if kinds <= _SCALAR_KINDS and _NONE not in kinds:  # the common case: no nulls
            return np.repeat(np.asarray(values, dtype=np_type), counts)
        if kinds <= _ARRAYS_OR_NONE:  # arrays, some steps without the column
            masked = _masked_arrays(values, counts, np_type)
            if masked is not None:
                return masked
        if kinds <= _SCALAR_KINDS:
            # per-step scalars (the steps table, launch-wide columns): one array, repeated
            present = np.fromiter((v is not None for v in values), bool, len(values))
            data = np.asarray([0 if v is None else v for v in values], dtype=np_type)
            if present.all():
                return np.repeat(data, counts)
            return np.ma.MaskedArray(np.repeat(data, counts), mask=np.repeat(~present, counts))
        data, mask = [], []
        for v, n in zip(values, counts, strict=True):
            if v is None:
                data.append(np.zeros(n, np_type))
                mask.append(np.ones(n, bool))
            elif type(v) is np.ndarray:
                data.append(v.astype(np_type, copy=False))
                mask.append(np.zeros(n, bool))
            elif type(v) is Nullable:
                data.append(v.data.astype(np_type, copy=False))
                mask.append(v.mask)
            elif isinstance(v, np.ma.MaskedArray):
                data.append(np.ma.getdata(v).astype(np_type, copy=False))
                mask.append(np.ma.getmaskarray(v))
            elif isinstance(v, (list, tuple)):
                data.append(np.asarray([0 if x is None else x for x in v], dtype=np_type))
                mask.append(np.fromiter((x is None for x in v), bool, len(v)))
            else:
                data.append(np.full(n, v, np_type))
                mask.append(np.zeros(n, bool))
        return np.ma.MaskedArray(np.concatenate(data), mask=np.concatenate(mask))
    flat: list[Any] = []
    for v, n in zip(values, counts, strict=True):
        if isinstance(v, np.ndarray):
            flat.extend(v.tolist())
        elif isinstance(v, (list, tuple)):
            flat.extend(v)
        else:
            flat.extend([v] * n)
    return flat


def _masked_arrays(values: list[Any], counts: list[int], np_type: Any) -> Any:
    """Arrays and None (a step without the column) as one masked array, filled in place:
    two slice copies per array and none per None, where a zero and a mask array per value
    and two joins cost several times that. None where an array is not one flat numeric
    vector of its step's rows (the general path then decides)."""
    data = np.zeros(sum(counts), np_type)
    mask = np.ones(len(data), bool)
    start = 0
    for v, n in zip(values, counts, strict=True):
        if v is not None:
            if v.ndim != 1 or len(v) != n or v.dtype == object:
                return None
            data[start : start + n] = v
            mask[start : start + n] = False
        start += n
    return np.ma.MaskedArray(data, mask=mask)


def merge_steps(batch: list[tuple[int, dict[str, dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Many steps' tables as one chunk per table with a ``step`` column (``write_steps``)."""
    by_table: dict[str, list[tuple[int, dict[str, Any], int]]] = {}
    for step, tables in batch:
        for name, columns in tables.items():
            by_table.setdefault(name, []).append((step, columns, _rows_in(columns)))
    out: dict[str, dict[str, Any]] = {}
    for name, chunks in by_table.items():
        spec = TABLES[name]
        counts = [n for _, _, n in chunks]
        merged: dict[str, Any] = {
            "step": np.repeat(np.asarray([s for s, _, _ in chunks], np.int64), counts)
        }
        for col in set().union(*(c for _, c, _ in chunks)):
            merged[col] = _concat([c.get(col) for _, c, _ in chunks], counts, spec.field(col))
        out[name] = merged
    return out
