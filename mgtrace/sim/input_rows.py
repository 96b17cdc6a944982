"""V1 InputBatch row bookkeeping: add, remove, condense, swap, with a log of every move.

A new request takes the smallest row freed this step, else the row after the live ones.
``condense`` then moves the highest live row into the lowest hole until no hole sits below a
live row. Per-row state (computed and prompt counts, the pinned accepted-count buffer, the
Mamba block-table row) moves with the row. Whether the vacated row of a move is cleared is
the ``stale-condense-row`` switch: left as is, it keeps the moved request's block ids.
"""

from __future__ import annotations

import numpy as np

# (op, row_a, row_b, req_a, req_b, accepted_a, accepted_b)
Move = tuple[str, int, int | None, str | None, str | None, int, int | None]


class InputRows:
    def __init__(self, max_rows: int, *, clear_vacated: bool = True) -> None:
        self.max_rows = max_rows
        self.clear_vacated = clear_vacated
        self.row_req: list[str | None] = [None] * max_rows
        self.req_row: dict[str, int] = {}
        self.nc = np.zeros(max_rows, np.int64)
        self.prompt = np.zeros(max_rows, np.int64)
        self.acc = np.ones(max_rows, np.int32)
        self.key = np.full(max_rows, -1, np.int64)  # caller's request number per row
        self.bt: list[list[int]] = [[] for _ in range(max_rows)]
        self.stale: dict[int, str] = {}  # vacated row -> request whose ids it still lists
        self.removed: list[int] = []
        self.dirty: set[int] = set()
        self.moves: list[Move] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_row)

    def begin_step(self) -> None:
        self.dirty = set()
        self.moves = []
        self.removed = []

    def remove(self, req: str) -> int:
        row = self.req_row.pop(req)
        self.row_req[row] = None
        self.moves.append(("remove", row, None, req, None, int(self.acc[row]), None))
        self.key[row] = -1
        self.bt[row] = []
        self.dirty.add(row)
        self.stale.pop(row, None)
        self.removed.append(row)
        return row

    def add(
        self, req: str, num_computed: int, prompt: int, block_ids: list[int], key: int = -1
    ) -> int:
        if self.removed:
            self.removed.sort()
            row = self.removed.pop(0)
        else:
            row = self.num_reqs
        self.row_req[row] = req
        self.req_row[req] = row
        self.key[row] = key
        self.nc[row] = num_computed
        self.prompt[row] = prompt
        self.moves.append(("add", row, None, req, None, int(self.acc[row]), None))
        self.acc[row] = 1
        self.bt[row] = list(block_ids)
        self.dirty.add(row)
        self.stale.pop(row, None)
        return row

    def append_blocks(self, req: str, block_ids: list[int]) -> None:
        if block_ids:
            row = self.req_row[req]
            self.bt[row] = self.bt[row] + block_ids
            self.dirty.add(row)

    def condense(self) -> None:
        holes = sorted(self.removed)
        self.removed = []
        last = self.num_reqs + len(holes) - 1
        while holes:
            while last in holes:
                last -= 1
            if holes[0] >= last:
                break
            self._move(last, holes.pop(0))
            last -= 1

    def _move(self, src: int, dst: int) -> None:
        req = self.row_req[src]
        assert req is not None
        self.moves.append(("move", src, dst, req, None, int(self.acc[src]), int(self.acc[dst])))
        self.row_req[dst], self.row_req[src] = req, None
        self.req_row[req] = dst
        self.nc[dst] = self.nc[src]
        self.prompt[dst] = self.prompt[src]
        self.acc[dst] = self.acc[src]
        self.key[dst], self.key[src] = self.key[src], -1
        self.bt[dst] = self.bt[src]
        self.dirty.add(dst)
        self.stale.pop(dst, None)
        if self.clear_vacated:
            self.bt[src] = []
            self.dirty.add(src)
        else:
            # unchanged content, so no block-table row is written for it
            self.bt[src] = list(self.bt[dst])
            self.stale[src] = req

    def swap(self, a: int, b: int) -> None:
        ra, rb = self.row_req[a], self.row_req[b]
        self.moves.append(("swap", a, b, ra, rb, int(self.acc[a]), int(self.acc[b])))
        self.row_req[a], self.row_req[b] = rb, ra
        if ra is not None:
            self.req_row[ra] = b
        if rb is not None:
            self.req_row[rb] = a
        for arr in (self.nc, self.prompt, self.acc, self.key):
            arr[a], arr[b] = arr[b], arr[a]
        self.bt[a], self.bt[b] = self.bt[b], self.bt[a]
        self.dirty.update((a, b))

    def req_ids(self) -> list[str]:
        n = self.num_reqs
        out = self.row_req[:n]
        assert None not in out, "rows are not condensed"
        return out  # type: ignore[return-value]
