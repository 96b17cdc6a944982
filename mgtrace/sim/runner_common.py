"""Pieces both runner models share: the align arithmetic and per-step row containers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgtrace.sim.checkpoints import checkpoints_of


def running_cols(num_computed: np.ndarray, num_scheduled: np.ndarray, B: int) -> np.ndarray:
    """Running-state column after the step's tokens: cdiv(computed + scheduled, B) - 1
    (computed as (computed + scheduled - 1) // B, the same for every integer)."""
    return (num_computed + num_scheduled - 1) // B


def seed_cols(num_computed: np.ndarray, B: int) -> np.ndarray:
    """Column a request without a recorded state index starts from: (computed - 1) // B."""
    return (num_computed - 1) // B


def copy_boundary(R: np.ndarray, N: np.ndarray, B: int) -> tuple[np.ndarray, ...]:
    """The post-process decision: does the completed block need the boundary state?

    R tokens are covered by the running state, N are truly computed after acceptance.
    Returns (needs_copy, accept_token_bias, dest_block_col).
    """
    aligned = (N // B) * B
    return aligned >= R, aligned - R, aligned // B - 1


def capture_size(n: int, max_size: int) -> int:
    """CUDA-graph capture size a uniform decode batch of n rows is padded to."""
    if n <= 0:
        return 0
    if n <= 8:
        size = 1
        while size < n:
            size *= 2
    else:
        size = -(-n // 8) * 8
    return min(size, max(max_size, n))


@dataclass
class StepResult:
    """What one rank recorded in one step, and the bug events it produced."""

    tables: dict[str, Any]
    launches: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


class Nullable:
    """A recorded numeric column with nulls: values and a null mask, as two arrays.

    A numpy MaskedArray costs ~10 us to build, per column and step; the trace buffer joins
    these into one MaskedArray per many steps (``masked`` makes one for a single step).
    """

    __slots__ = ("data", "mask")

    def __init__(self, data: np.ndarray, mask: np.ndarray) -> None:
        self.data = data
        self.mask = mask  # True: null

    def __len__(self) -> int:
        return len(self.data)

    def masked(self) -> np.ma.MaskedArray:
        return np.ma.MaskedArray(self.data, mask=self.mask)

    def tolist(self) -> list[Any]:
        return self.masked().tolist()


def sparse(values: np.ndarray, differs: np.ndarray) -> Nullable | None:
    """An int32 column that holds a value only where ``differs``; None when it never does."""
    if not np.count_nonzero(differs):
        return None
    return Nullable(values.astype(np.int32), ~differs)


def where_valid(values: np.ndarray, valid: np.ndarray) -> np.ndarray | Nullable:
    """An int32 column that is null where not ``valid`` (a plain array when all are)."""
    out = values.astype(np.int32)
    if np.count_nonzero(valid) == len(valid):
        return out
    return Nullable(out, ~valid)


def checkpoint_columns(
    computed: np.ndarray,
    scheduled: np.ndarray,
    prefill: np.ndarray,
    block_size: int,
    drop: bool = False,
) -> dict[str, np.ndarray | Nullable]:
    """batch_rows' prefill checkpoint columns: the builder gives one to each prefill-split
    row whose query crosses a reusable boundary (mgtrace.sim.checkpoints); nothing when no
    row of the step has one; ``drop``: EAGLE's block drop, under MTP)."""
    tokens, cols = checkpoints_of(computed, scheduled, block_size, drop)
    has = prefill & (cols >= 0)
    if not np.count_nonzero(has):
        return {}
    return {
        "checkpoint_tokens": where_valid(tokens, has),
        "checkpoint_col": where_valid(cols, has),
    }


class PerRequest:
    """Runner-side per-request values in arrays indexed by request number, grown on demand."""

    def __init__(self, **fields: tuple[np.dtype | type, object]) -> None:
        self._fields = fields
        self.cap = 0
        for name, (dtype, fill) in fields.items():
            setattr(self, name, np.full(0, fill, dtype=dtype))
        self.ensure(1024)

    def ensure(self, cap: int) -> None:
        if cap <= self.cap:
            return
        new_cap = max(cap, 2 * self.cap)
        for name, (dtype, fill) in self._fields.items():
            old = getattr(self, name)
            arr = np.full(new_cap, fill, dtype=dtype)
            arr[: len(old)] = old
            setattr(self, name, arr)
        self.cap = new_cap


def row_moves_table(moves: list[tuple[Any, ...]], d2h_landed: bool | None = None) -> dict[str, Any]:
    """The ``row_moves`` rows of a step from (op, row_a, row_b, req_a, req_b, acc_a, acc_b, ...)
    tuples, in the order the moves happened."""
    op, a, b, ra, rb, xa, xb = (list(c) for c in list(zip(*moves, strict=True))[:7])
    table: dict[str, Any] = {
        "seq": np.arange(len(moves), dtype=np.int32),
        "op": op,
        "row_a": a,
        "row_b": b,
        "req_id": ra,
        "req_id_b": rb,
        "accepted_a": xa,
        "accepted_b": xb,
    }
    if d2h_landed is not None:
        table["d2h_landed"] = d2h_landed
    return table
