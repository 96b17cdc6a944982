"""Who owns each state block, rebuilt from the scheduler's block-id deltas alone.

New and resumed requests get their block lists replaced, cached requests get ids appended,
finished and preempted requests let theirs go. The latest assignment of a block wins: the
scheduler frees a request's previous state block without saying so (the worker's rows are
append-only), so when that block is handed to another request the new holder takes it over.
Block 0 is the null block and belongs to nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mgtrace.replayer.requests import NO_REQUEST

NULL_BLOCK = 0
# Block lists up to this long are walked in Python: a step adds a few ids per request, and
# for those, element-wise updates cost less than building and masking numpy arrays.
SHORT_LIST = 32


@dataclass
class Assignment:
    uid: int
    step: int


class BlockOwnership:
    def __init__(self, num_groups: int, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # uid, 0 = free; one column past the pool, never owned, for ids outside it.
        self.owner = np.zeros((num_groups, num_blocks + 1), dtype=np.int32)
        self.since = np.full((num_groups, num_blocks), -1, dtype=np.int64)  # step assigned
        self._held: dict[int, list[list[int]]] = {}  # uid -> per group block ids

    def _release(self, uid: int) -> None:
        num_blocks = self.num_blocks
        for group, blocks in enumerate(self._held.pop(uid, [])):
            owner, since = self.owner[group], self.since[group]
            if len(blocks) <= SHORT_LIST:
                for b in blocks:
                    if NULL_BLOCK < b < num_blocks and owner[b] == uid:
                        owner[b] = NO_REQUEST
                        since[b] = -1
                continue
            ids = np.asarray(blocks, dtype=np.int64)
            ids = ids[(ids > NULL_BLOCK) & (ids < num_blocks)]
            mine = ids[owner[ids] == uid]
            owner[mine] = NO_REQUEST
            since[mine] = -1

    def _acquire(self, uid: int, step: int, per_group: Sequence[Sequence[int] | None]) -> None:
        held = self._held.setdefault(uid, [[] for _ in range(self.owner.shape[0])])
        num_blocks = self.num_blocks
        for group, blocks in enumerate(per_group):
            if not blocks or group >= self.owner.shape[0]:
                continue
            held[group].extend(blocks)
            owner, since = self.owner[group], self.since[group]
            if len(blocks) <= SHORT_LIST:
                for b in blocks:
                    if NULL_BLOCK < b < num_blocks:
                        owner[b] = uid
                        since[b] = step
                continue
            ids = np.asarray(blocks, dtype=np.int64)
            ids = ids[(ids > NULL_BLOCK) & (ids < num_blocks)]
            owner[ids] = uid
            since[ids] = step

    def apply(
        self,
        step: int,
        uids: Sequence[int],
        kinds: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
    ) -> None:
        """One step's ``sched`` rows, in the order the scheduler emitted them."""
        for uid, kind, blocks in zip(uids, kinds, new_block_ids, strict=True):
            if kind in ("finished", "preempted"):
                self._release(uid)
            elif kind in ("new", "resumed"):
                self._release(uid)
                self._acquire(uid, step, blocks or [])
            elif blocks and any(blocks):
                self._acquire(uid, step, blocks)

    def column_behind(
        self, uid: int, group: int, block: int, spec_blocks: int
    ) -> tuple[int, int] | None:
        """(column, running column) when ``block`` sits in ``uid``'s row at a column behind its
        running column, else None. The worker's row is the scheduler's rows appended, and in
        align mode it ends at the running column and the ``spec_blocks`` columns after it; a
        block that appears twice (a reused spec block) is at its later column."""
        groups = self._held.get(uid)
        if not groups or group >= len(groups):
            return None
        row = groups[group]
        for col in range(len(row) - 1, -1, -1):
            if row[col] == block:
                running = len(row) - 1 - spec_blocks
                return (col, running) if col < running else None
        return None

    def owner_or_free(self, group: int, blocks: np.ndarray) -> np.ndarray:
        """Owner uid of each block id in ``0..num_blocks`` (num_blocks stands for any id
        outside the pool: free, like the null block)."""
        return self.owner[group][blocks]

    def owner_of(self, group: int, block: int) -> Assignment | None:
        if not NULL_BLOCK < block < self.num_blocks:
            return None
        uid = int(self.owner[group, block])
        return None if uid == NO_REQUEST else Assignment(uid, int(self.since[group, block]))

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, dict[int, list[list[int]]]]:
        return (
            self.owner[:, : self.num_blocks].copy(),
            self.since.copy(),
            {u: [list(g) for g in groups] for u, groups in self._held.items()},
        )

    def restore(self, snap: tuple[np.ndarray, np.ndarray, dict[int, list[list[int]]]]) -> None:
        owner, since, held = snap
        self.owner = np.zeros((owner.shape[0], self.num_blocks + 1), dtype=np.int32)
        self.owner[:, : self.num_blocks] = owner
        self.since = since.copy()
        self._held = {u: [list(g) for g in groups] for u, groups in held.items()}
