"""Who owns each state block, rebuilt from the scheduler's block-id deltas alone.

New and resumed requests get their block lists replaced, cached requests get ids appended,
finished and preempted requests let theirs go. The latest assignment of a block wins.

Align mode also frees blocks without a delta (the worker's rows are append-only, so the ids
stay in the row): once a scheduled request's processed tokens (its computed count less the
tokens still in flight) reach column ``c + 1``'s end, every block at columns up to ``c`` is
freed: its previous running block, a prefix hit's boundary block, prefill checkpoint blocks
(the base class's skipped-block rule in vLLM's MambaManager, ``remove_skipped_blocks``). A
spec block the scheduler moved to a later column stays in use there. ``retire`` mirrors the
rule, so a stray write onto a block nobody holds any longer is not taken for an attack on its
former owner.
Block 0 is the null block and belongs to nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mgtrace.replayer.requests import NO_REQUEST
from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.tables import SCHED_KINDS

NULL_BLOCK = 0
# Block lists up to this long are walked in Python: a step adds a few ids per request, and
# for those, element-wise updates cost less than building and masking numpy arrays.
SHORT_LIST = 32


# owner, since, the rows held, the first column not yet freed
OwnershipSnapshot = tuple[np.ndarray, np.ndarray, dict[int, list[list[int]]], np.ndarray]


def steps_in_flight(run: RunMetadata) -> int:
    """Steps whose results the scheduler has not folded in when it schedules the next one:
    vLLM's ``max_concurrent_batches`` less one. That is the pipeline's depth, plus one under
    async scheduling on the V2 runner (V1 does not overlap a pipeline), less one; without a
    pipeline, one under async scheduling, else none."""
    if run.pp_size > 1:
        return run.pp_size - 1 + int(run.async_scheduling and run.runner == "v2")
    return 1 if run.async_scheduling else 0


def processed_tokens(
    uid: np.ndarray,
    step: np.ndarray,
    kind: np.ndarray,
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    in_flight: int,
) -> np.ndarray:
    """Per ``sched`` row, the computed count less the tokens the same request was scheduled
    in the ``in_flight`` steps before (their results are still pending): what vLLM's align
    mode compares with the previous state column before freeing it."""
    processed = num_computed.astype(np.int64)
    scheduled = np.isin(kind, [SCHED_KINDS.index(k) for k in ("new", "cached", "resumed")])
    if not in_flight or not np.count_nonzero(scheduled):
        return processed
    steps = step.astype(np.int64)
    if len(steps) > 1 and np.any(steps[1:] < steps[:-1]):
        order = np.lexsort((steps, uid))
    else:  # rows in step order, as a trace holds them: sorting by request keeps that order
        order = np.argsort(uid, kind="stable")
    uids, steps = uid[order], steps[order]
    if np.any((uids[1:] == uids[:-1]) & (steps[1:] == steps[:-1])):
        # a request with two rows in one step: the first scheduled one counts
        return processed - _in_flight_by_search(uid, step, scheduled, num_scheduled, in_flight)
    tokens = np.where(scheduled, num_scheduled, 0)[order].astype(np.int64)
    processed[order] -= _in_flight_by_shift(uids, steps, tokens, in_flight)
    return processed


def _in_flight_by_shift(
    uids: np.ndarray, steps: np.ndarray, tokens: np.ndarray, in_flight: int
) -> np.ndarray:
    """Rows sorted by (request, step), one per (request, step): per row, the tokens of its
    request's rows 1 to ``in_flight`` steps before. With a row per step at most, those lie
    at most ``in_flight`` rows up, so a few shifted comparisons find them all, with no
    search (a search per row took most of this function's time, a tenth of a trace load)."""
    taken = np.zeros(len(uids), dtype=np.int64)
    for lag in range(1, min(in_flight, len(uids) - 1) + 1):
        counted = (uids[lag:] == uids[:-lag]) & (steps[lag:] - steps[:-lag] <= in_flight)
        taken[lag:] += np.where(counted, tokens[:-lag], 0)
    return taken


def _in_flight_by_search(
    uid: np.ndarray,
    step: np.ndarray,
    scheduled: np.ndarray,
    num_scheduled: np.ndarray,
    in_flight: int,
) -> np.ndarray:
    """``_in_flight_by_shift`` for any rows, in their own order: per row, the tokens of the
    first scheduled row of its request at each of the ``in_flight`` steps before, found by
    binary search."""
    # one sortable key per (request, step), the steps of a request contiguous
    span = int(step.max() - step.min()) + in_flight + 2
    key = uid.astype(np.int64) * span + (step - step.min() + in_flight + 1)
    keys, tokens = key[scheduled], num_scheduled[scheduled].astype(np.int64)
    order = np.argsort(keys, kind="stable")
    keys, tokens = keys[order], tokens[order]
    taken = np.zeros(len(key), dtype=np.int64)
    for back in range(1, in_flight + 1):
        at = np.minimum(np.searchsorted(keys, key - back), len(keys) - 1)
        taken += np.where(keys[at] == key - back, tokens[at], 0)
    return taken


def freed_below(processed: np.ndarray, block_size: int) -> np.ndarray:
    """The column below which align mode has freed a request's state blocks once it has
    processed ``processed`` tokens: ``cdiv(processed, B) - 1``."""
    block = max(block_size, 1)
    return (processed + block - 1) // block - 1


@dataclass
class Assignment:
    uid: int
    step: int


class BlockOwnership:
    def __init__(
        self,
        num_groups: int,
        num_blocks: int,
        block_size: int = 16,
        spec_blocks: int = 0,
        num_uids: int = 64,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spec_blocks = spec_blocks
        # uid -> the first column of its row ``retire`` has not freed yet
        self._retired = np.zeros(num_uids, dtype=np.int64)
        # uid, 0 = free; one column past the pool, never owned, for ids outside it.
        self.owner = np.zeros((num_groups, num_blocks + 1), dtype=np.int32)
        self._group_base = np.arange(num_groups, dtype=np.int64) * (num_blocks + 1)
        self.since = np.full((num_groups, num_blocks), -1, dtype=np.int64)  # step assigned
        self._held: dict[int, list[list[int]]] = {}  # uid -> per group block ids

    def _release(self, uid: int) -> list[tuple[int, int, int]]:
        """Free every block ``uid`` owns; returns (uid, group, block) of each."""
        num_blocks = self.num_blocks
        freed: list[tuple[int, int, int]] = []
        for group, blocks in enumerate(self._held.pop(uid, [])):
            owner, since = self.owner[group], self.since[group]
            if len(blocks) <= SHORT_LIST:
                for b in blocks:
                    if NULL_BLOCK < b < num_blocks and owner[b] == uid:
                        owner[b] = NO_REQUEST
                        since[b] = -1
                        freed.append((uid, group, b))
                continue
            ids = np.asarray(blocks, dtype=np.int64)
            ids = ids[(ids > NULL_BLOCK) & (ids < num_blocks)]
            mine = ids[owner[ids] == uid]
            owner[mine] = NO_REQUEST
            since[mine] = -1
            freed.extend((uid, group, b) for b in mine.tolist())
        return freed

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

    def _grow(self, uid: int) -> None:
        if uid >= len(self._retired):
            grown = np.zeros(max(2 * len(self._retired), uid + 1), dtype=np.int64)
            grown[: len(self._retired)] = self._retired
            self._retired = grown

    def apply(
        self,
        step: int,
        uids: Sequence[int],
        kinds: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
    ) -> list[tuple[int, int, int]]:
        """One step's ``sched`` rows. The blocks of finished and preempted requests are free
        before the others are handed out (the scheduler frees them first, and may give them
        to a request of the same step). Returns (uid, group, block) of each block a
        finished, preempted or re-added request let go."""
        freed: list[tuple[int, int, int]] = []
        for uid, kind in zip(uids, kinds, strict=True):
            if kind in ("finished", "preempted"):
                freed += self._release(uid)
        for uid, kind, blocks in zip(uids, kinds, new_block_ids, strict=True):
            if kind in ("new", "resumed"):
                freed += self._release(uid)
                self._acquire(uid, step, blocks or [])
                self._grow(uid)
                self._retired[uid] = 0  # a new row: nothing of it freed yet
            elif blocks and any(blocks):
                self._acquire(uid, step, blocks)
        return freed

    def seed(self, uid: int, step: int, rows: Sequence[Sequence[int]], freed_below: int) -> None:
        """Give ``uid``, a request already running when the trace began, the block ``rows``
        (per group) it held then, and the blocks at its columns from ``freed_below`` on
        that nobody else is known to own. Below that column align mode has freed its blocks:
        a runner's row keeps their ids, which another request may have been given since."""
        self._held[uid] = [list(r) for r in rows[: self.owner.shape[0]]]
        self._grow(uid)
        self._retired[uid] = max(0, freed_below)
        for group, row in enumerate(self._held[uid]):
            owner, since = self.owner[group], self.since[group]
            for block in row[max(0, freed_below) :]:
                if NULL_BLOCK < block < self.num_blocks and owner[block] == NO_REQUEST:
                    owner[block] = uid
                    since[block] = step

    def adopt(self, uid: int, snapshot: OwnershipSnapshot, saved_uid: int) -> bool:
        """Take over, as ``uid``, the block rows, the blocks still owned and the retired
        column that a saved ``snapshot`` (a trace's start state) holds for ``saved_uid``;
        False when it holds none."""
        owner, since, held, retired = snapshot
        rows = held.get(saved_uid)
        if rows is None:
            return False
        self._held[uid] = [list(r) for r in rows[: self.owner.shape[0]]]
        self._grow(uid)
        self._retired[uid] = int(retired[saved_uid]) if saved_uid < len(retired) else 0
        known = min(self.num_blocks, owner.shape[1])
        for group, row in enumerate(self._held[uid]):
            for block in row:
                if NULL_BLOCK < block < known and owner[group, block] == saved_uid:
                    self.owner[group, block] = uid
                    self.since[group, block] = since[group, block]
        return True

    def retire(self, uids: np.ndarray, freed_below: np.ndarray) -> list[tuple[int, int, int, int]]:
        """Free, for each scheduled running request, the blocks at the columns its processed
        tokens passed: the scheduler frees every column below ``cdiv(processed, B) - 1``.
        Returns (uid, group, column, block) of each block freed."""
        if len(uids) and int(np.max(uids)) >= len(self._retired):
            self._grow(int(np.max(uids)))
        due = self._retired[uids] < freed_below
        if not np.count_nonzero(due):
            return []
        freed = []
        owner, since, num_blocks = self.owner, self.since, self.num_blocks
        for uid, below in zip(uids[due].tolist(), freed_below[due].tolist(), strict=True):
            start = int(self._retired[uid])
            rows = self._held.get(uid, ())
            end = min(below, max((len(r) for r in rows), default=0))
            self._retired[uid] = max(start, end)
            for group, row in enumerate(rows):
                for col in range(start, min(end, len(row))):
                    block = row[col]
                    # a spec block the row relocated sits at a later column too: in use
                    if not NULL_BLOCK < block < num_blocks or block in row[col + 1 :]:
                        continue
                    if owner[group, block] == uid:
                        owner[group, block] = NO_REQUEST
                        since[group, block] = -1
                        freed.append((uid, group, col, block))
        return freed

    def column_behind(self, uid: int, group: int, block: int) -> tuple[int, int] | None:
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
                running = len(row) - 1 - self.spec_blocks
                return (col, running) if col < running else None
        return None

    def rows_of(self, uid: int) -> list[list[int]] | None:
        """The scheduler's block row of ``uid`` per group, as its sched rows built it; None
        for a request that holds no blocks (finished, preempted, never scheduled)."""
        return self._held.get(uid)

    def holds(self, uid: int, group: int, block: int) -> bool:
        """Whether the scheduler's block row of ``uid`` (as its sched rows built it) names
        ``block`` in ``group``; the null block is no block a request holds."""
        rows = self._held.get(uid)
        return (
            block > NULL_BLOCK and rows is not None and group < len(rows) and block in rows[group]
        )

    def owner_or_free(self, group: int, blocks: np.ndarray) -> np.ndarray:
        """Owner uid of each block id in ``0..num_blocks`` (num_blocks stands for any id
        outside the pool: free, like the null block)."""
        return self.owner[group][blocks]

    def owners(self, blocks: np.ndarray) -> np.ndarray:
        """``owner_or_free`` of a [group, ...] array of ids in ``0..num_blocks``, every group
        at once (one gather from the flat table: a fraction of a broadcast 2-D index)."""
        base = self._group_base[: blocks.shape[0]].reshape((-1,) + (1,) * (blocks.ndim - 1))
        return self.owner.reshape(-1)[blocks + base]

    def owner_of(self, group: int, block: int) -> Assignment | None:
        if not NULL_BLOCK < block < self.num_blocks:
            return None
        uid = int(self.owner[group, block])
        return None if uid == NO_REQUEST else Assignment(uid, int(self.since[group, block]))

    def snapshot(self) -> OwnershipSnapshot:
        return (
            self.owner[:, : self.num_blocks].copy(),
            self.since.copy(),
            {u: [list(g) for g in groups] for u, groups in self._held.items()},
            self._retired.copy(),
        )

    def restore(self, snap: OwnershipSnapshot) -> None:
        owner, since, held, retired = snap
        self.owner = np.zeros((owner.shape[0], self.num_blocks + 1), dtype=np.int32)
        self.owner[:, : self.num_blocks] = owner
        self.since = since.copy()
        self._held = {u: [list(g) for g in groups] for u, groups in held.items()}
        self._retired = retired.copy()
