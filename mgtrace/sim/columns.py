"""Compact column forms the simulator hands to its trace buffer.

The buffer joins each into one Arrow array per flush from numpy offsets and codes, without
a Python object per row; ``tolist`` gives the plain values the per-step writer path takes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class GroupIds:
    """A ``new_block_ids`` column (one list of ids per Mamba group and row, here one group)
    kept as the scheduler's sparse {row: ids}: most rows get no block in a step."""

    __slots__ = ("ids", "rows")

    def __init__(self, rows: int, ids: dict[int, list[int]]) -> None:
        self.rows = rows
        self.ids = ids  # row -> the group's new block ids (rows absent: none)

    def __len__(self) -> int:
        return self.rows

    def tolist(self) -> list[list[list[int]]]:
        return [[self.ids.get(r, [])] for r in range(self.rows)]


class ReqIds:
    """A ``req_id`` column as request numbers into the run's array of request ids.

    ``names`` only grows, by replacement with a longer copy, so an array referenced here
    keeps every id its codes point at, and a later one holds them too.
    """

    __slots__ = ("codes", "names")

    def __init__(self, codes: np.ndarray, names: np.ndarray) -> None:
        self.codes = codes
        self.names = names

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, row: int) -> str:
        return self.names[self.codes[row]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tolist())

    def tolist(self) -> list[str]:
        return self.names[self.codes].tolist()


COMPACT_COLUMNS = (GroupIds, ReqIds)  # the forms above; ``tolist`` gives their plain values
