"""The block tables as the engine held them, rebuilt step by step from the trace's row changes.

The trace records a block-table row only when it changes (its full new content), per group
and per table kind: ``v1`` (InputBatch rows), ``source`` (V2 per request slot) and ``input``
(V2, gathered in batch order each step). Rows never written hold zeros: vLLM's tables start
zeroed, and 0 is the null block.

A block id outside the state pool cannot be replayed (the engine would index past its pool):
it is stored as -1, which every reader treats as "no block" (kernel validation reports the
launches that use it), and ``apply`` returns where it was so the step can report it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from mgtrace.errors import UsageError
from mgtrace.kernels.pool import BlockTables

Update = tuple[int, str, int, list[int]]
UNSEEN = -1  # a recorded block id the recording never saw written (recorder.v2_tables)


@dataclass(frozen=True)
class OutOfPool:
    """A block-table entry naming a block the pool does not have."""

    group: int
    kind: str
    row: int
    block_id: int


class TableStore:
    def __init__(
        self,
        kinds: Iterable[str],
        num_groups: int,
        rows: int,
        width: int,
        num_blocks: int | None = None,
    ) -> None:
        self.rows = rows
        self.width = width
        self.num_blocks = num_blocks  # pool size; None: unknown, every id is taken as is
        self._flat: dict[str, list[np.ndarray]] = {}
        self.tables: dict[str, list[np.ndarray]] = {}
        self._snapshots: dict[str, BlockTables] = {}
        kinds = tuple(kinds)
        try:
            for kind in kinds:
                tables = [np.zeros((rows, width), dtype=np.int32) for _ in range(num_groups)]
                self._set(kind, tables)
        except (MemoryError, ValueError):  # ValueError: more than numpy can index
            need = len(kinds) * num_groups * rows * width * 4 * 2  # each table, and its flat copy
            raise UsageError(
                f"the block tables ({len(kinds) * num_groups} of {rows} rows by {width} blocks, "
                f"{need / 2**30:.1f} GiB) cannot be allocated here"
            ) from None

    def _set(self, kind: str, tables: list[np.ndarray]) -> None:
        """Each table is a view into a flat buffer with one extra -1 at the end, so a gather
        can send every out-of-range index there instead of masking twice."""
        flats, views = [], []
        for t in tables:
            flat = np.empty(self.rows * self.width + 1, dtype=np.int32)
            flat[:-1] = t.ravel()
            flat[-1] = -1
            flats.append(flat)
            views.append(flat[:-1].reshape(self.rows, self.width))
        self._flat[kind] = flats
        self.tables[kind] = views
        self._snapshots.pop(kind, None)

    def apply(self, updates: Iterable[Update]) -> list[OutOfPool]:
        """Write the rows; return the entries that name a block outside the pool."""
        outside: list[OutOfPool] = []
        for group, kind, row, block_ids in updates:
            self._snapshots.pop(kind, None)
            table = self.tables[kind][group]
            if not 0 <= row < self.rows:
                continue  # a malformed row id: the launch that indexes it is reported instead
            n = min(len(block_ids), self.width)
            table[row, :n] = block_ids[:n]
            table[row, n:] = 0
            # min()/max() of the short id list: cheaper than numpy reductions over the row.
            # A block id is never negative (the null block is 0); -1 is a recording's "never
            # seen written" (a launch that reads it is reported then), and any other negative
            # id is as malformed as one past the pool.
            if (
                self.num_blocks is not None
                and n
                and (max(block_ids[:n]) >= self.num_blocks or min(block_ids[:n]) < UNSEEN)
            ):
                entries = table[row, :n]
                bad = (entries >= self.num_blocks) | (entries < UNSEEN)
                outside.append(OutOfPool(group, kind, row, int(entries[bad][0])))
                entries[bad] = -1
        return outside

    def block_tables(self, kind: str) -> BlockTables:
        """The kernels' read-only snapshot of one table kind, rebuilt only after a change."""
        snap = self._snapshots.get(kind)
        if snap is None:
            snap = self._snapshots[kind] = BlockTables(self.tables[kind])
        return snap

    def _index(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        cols = np.asarray(cols, dtype=np.int64)
        index = rows * self.width + cols
        # As unsigned, a negative index is out of range too: one compare per operand.
        bad = (rows.view(np.uint64) >= self.rows) | (cols.view(np.uint64) >= self.width)
        index[bad] = self.rows * self.width  # the sentinel slot past the table, holding -1
        return index

    def gather(self, kind: str, group: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """table[rows, cols] with -1 where the index is out of range (never an exception)."""
        return self._flat[kind][group][self._index(rows, cols)]

    def gather_groups(self, kind: str, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``gather`` for every group at once: [groups, *shape]."""
        index = self._index(rows, cols)
        flats = self._flat[kind]
        if len(flats) == 1:
            return flats[0][index][None]
        return np.stack([flat[index] for flat in flats])

    def snapshot(self) -> dict[str, list[np.ndarray]]:
        return {k: [t.copy() for t in ts] for k, ts in self.tables.items()}

    def restore(self, snap: dict[str, list[np.ndarray]]) -> None:
        """Take the snapshot's tables. A snapshot of the same engine taken over another
        trace (a repro's start state, cut from the whole run) can be larger than this trace
        needs: every table grows to hold both, zero-filled."""
        shapes = [t.shape for ts in snap.values() for t in ts]
        rows = max([self.rows, *(r for r, _ in shapes)])
        width = max([self.width, *(w for _, w in shapes)])
        if (rows, width) != (self.rows, self.width):
            self.rows, self.width = rows, width
            for kind, tables in list(self.tables.items()):
                self._set(kind, [_padded(t, rows, width) for t in tables])
        for kind, tables in snap.items():
            self._set(kind, [_padded(t, rows, width) for t in tables])


def _padded(table: np.ndarray, rows: int, width: int) -> np.ndarray:
    if table.shape == (rows, width):
        return table
    out = np.zeros((rows, width), dtype=np.int32)
    out[: table.shape[0], : table.shape[1]] = table
    return out
