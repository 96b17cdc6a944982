"""The Mamba state block pool and the align-mode allocation of vLLM's MambaManager.

Block 0 is the null block: it fills skipped columns and is never handed out. Free blocks
are taken from the head of the free queue. As in vLLM's BlockPool.free_blocks, the blocks one
call frees go back to its head (reused next) when they hold no cached prefix state, in the
order given, and to its tail (evicted last) when they do. As in vLLM, a cached block is
evicted lazily: it stays cached in the free queue, and loses its cached state only when the
queue hands it out again (``get_new_blocks``); a prefix hit takes it back out (``touch``).

Align mode keeps per request one scheduler-side block row of ``cdiv(num_tokens, B) + S``
columns (S = speculative blocks): column ``cdiv(num_tokens, B) - 1`` is the running state,
the S columns after it hold the per-draft states, and the columns before it are null except
the previous running block (held until the runner has copied it forward) and prefix-cache
boundary blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolExhausted(Exception):
    """Not enough free blocks for an allocation; the scheduler preempts or waits."""


class BlockPool:
    """Free queue plus reference counts; the prefix cache holds no reference of its own."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self.ref = [0] * num_blocks
        # blocks holding a cached prefix state (vLLM: a block hash): shared read-only, live
        # or free, until the free queue hands them out afresh
        self.shared: set[int] = set()
        # told of each cached block handed out afresh (vLLM's _maybe_evict_cached_block)
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise PoolExhausted(n)
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
            if b in self.shared:
                self.shared.remove(b)
                if self.on_evict is not None:
                    self.on_evict(b)
        return out

    def touch(self, block: int) -> None:
        """One more reference to a cached block (a prefix hit); an unreferenced one leaves
        the free queue, as vLLM's BlockPool.touch."""
        if self.ref[block] == 0:
            self.free.remove(block)
        self.ref[block] += 1

    def release_all(self, blocks: list[int]) -> None:
        """Drop one reference to each block; those left unreferenced go back to the free
        queue as one vLLM ``free_blocks`` call puts them: uncached ones at the head in the
        given order, cached ones at the tail."""
        first: list[int] = []
        last: list[int] = []
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (last if block in self.shared else first).append(block)
        self.free.extendleft(reversed(first))
        self.free.extend(last)


class PrefixCache:
    """One cached boundary state per prompt family: (tokens covered, block id). An entry
    lasts until the pool hands its block out afresh, never while a request holds it."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.entries: dict[int, tuple[int, int]] = {}
        self._family_of: dict[int, int] = {}  # block -> family
        pool.on_evict = self._evicted

    def lookup(self, family: int) -> tuple[int, int] | None:
        return self.entries.get(family)

    def insert(self, family: int, tokens: int, block: int) -> None:
        """Cache ``block``, held by the request that wrote it, for ``family``."""
        if family in self.entries or block == NULL_BLOCK or block in self.pool.shared:
            return
        self.pool.shared.add(block)
        self.entries[family] = (tokens, block)
        self._family_of[block] = family

    def _evicted(self, block: int) -> None:
        del self.entries[self._family_of.pop(block)]

    def pinned(self) -> set[int]:
        return {b for _, b in self.entries.values()}


class AlignAllocator:
    """MambaManager in align mode, for one Mamba KV-cache group."""

    def __init__(self, pool: BlockPool, block_size: int, spec_blocks: int) -> None:
        self.pool = pool
        self.B = block_size
        self.S = spec_blocks
        self.rows: dict[str, list[int]] = {}
        self.allocated: set[str] = set()
        # per request, ascending, the columns behind its running one that still hold a
        # block: previous running blocks, a prefix hit's block, prefill checkpoint blocks
        self.behind: dict[str, list[int]] = {}

    def row(self, req: str) -> list[int]:
        return self.rows.setdefault(req, [])

    def hit_row(self, hit_tokens: int, block: int) -> list[int]:
        """A prefix hit's row: null columns, then the cached boundary block."""
        return [NULL_BLOCK] * (hit_tokens // self.B - 1) + [block]

    def blocks_needed(
        self,
        req: str,
        num_tokens: int,
        checkpoint: bool = False,
        hit: tuple[int, int] | None = None,
    ) -> int:
        """Free-queue blocks ``allocate`` would take (a dry run of its column arithmetic).
        ``hit``: the (tokens, block) a new request starts from; its block counts when it
        waits in the free queue, since touching it takes it out (vLLM's evictable
        computed blocks)."""
        row = self.hit_row(*hit) if hit is not None else self.rows.get(req, [])
        evictable = int(hit is not None and self.pool.ref[hit[1]] == 0)
        prev_len = len(row)
        required = cdiv(num_tokens, self.B) + self.S
        if required <= prev_len and not checkpoint:
            return evictable
        # the column behind the running one keeps a block for a prefill checkpoint
        skipped = required - self.S - 1 - int(checkpoint)
        length = max(prev_len, skipped)
        if req in self.allocated:
            # the spec columns prev_len - S .. prev_len - 1 below ``skipped`` (relocated)
            length += max(min(prev_len, skipped) - (prev_len - self.S), 0)
        return max(required - length, 0) + evictable

    def allocate(
        self,
        req: str,
        num_tokens: int,
        need: int | None = None,
        checkpoint: bool = False,
        hit: tuple[int, int] | None = None,
    ) -> list[int]:
        """Grow the row to cover ``num_tokens``; return the appended tail (the new block ids
        a SchedulerOutput carries, nulls and relocated spec blocks included). ``need`` is
        ``blocks_needed(req, num_tokens, checkpoint, hit)`` where the caller has it already.
        ``checkpoint``: the prefill exports a checkpoint into the column behind the running
        one, so that column gets a block instead of a null (a spec block already there
        stays), as MambaManager reserves it. ``hit``: a new request's prefix hit (tokens,
        block); its block is touched only once the allocation is sure to succeed, as
        vLLM's allocate_slots returns None before it touches anything."""
        if need is None:
            need = self.blocks_needed(req, num_tokens, checkpoint, hit)
        if need > self.pool.num_free:
            raise PoolExhausted(need)
        if hit is not None:
            self.pool.touch(hit[1])
            self.rows[req] = self.hit_row(*hit)
        row = self.rows.setdefault(req, [])
        required = cdiv(num_tokens, self.B) + self.S
        if required <= len(row) and not checkpoint:
            self.allocated.add(req)
            return []
        prev_len = len(row)
        first = req not in self.allocated
        if not first:
            self._hold_behind(req, prev_len - 1 - self.S)  # the running block until now
        elif prev_len > 0:
            self._hold_behind(req, prev_len - 1)  # the prefix-hit boundary block
        skipped = required - self.S - 1 - int(checkpoint)
        if prev_len < skipped:
            row.extend([NULL_BLOCK] * (skipped - prev_len))
        if not first:
            for i in range(prev_len - self.S, prev_len):
                if i >= skipped:
                    break
                row.append(row[i])
                row[i] = NULL_BLOCK
        n_new = max(required - len(row), 0)
        assert n_new <= (1 + self.S if first else 1) + int(checkpoint), (req, n_new)
        row.extend(self.pool.take(n_new))
        self.allocated.add(req)
        if checkpoint and row[skipped] != NULL_BLOCK:
            self._hold_behind(req, skipped)
        return row[prev_len:]

    def _hold_behind(self, req: str, col: int) -> None:
        cols = self.behind.setdefault(req, [])
        if not cols or cols[-1] < col:
            cols.append(col)

    def wants_checkpoint_block(self, req: str, col: int) -> bool:
        """Whether a checkpoint into ``col`` needs a block reserved: the column is past the
        row, null, or one of the spec columns the allocation would move away
        (``_needs_internal_checkpoint``)."""
        row = self.rows.get(req, [])
        return (
            col >= len(row)
            or row[col] == NULL_BLOCK
            or (req in self.allocated and col >= len(row) - self.S)
        )

    def retire(self, req: str, processed_tokens: int) -> list[int]:
        """Free every block at the columns the request's processed tokens have passed, all
        but the last column they reach (vLLM's skipped-block rule, ``cdiv(processed, B) - 1``):
        its previous running blocks once the runner has copied past them, a prefix hit's
        block, prefill checkpoint blocks (one the prefix cache holds stays in the pool for
        it). Returns the blocks released."""
        cols = self.behind.get(req)
        due = cdiv(processed_tokens, self.B) - 1
        if not cols or cols[0] >= due:
            return []
        row = self.rows[req]
        freed = []
        n = 0
        while n < len(cols) and cols[n] < due:
            col = cols[n]
            n += 1
            if col < len(row) and row[col] != NULL_BLOCK:
                freed.append(row[col])
                row[col] = NULL_BLOCK
        del cols[:n]
        # MambaManager frees the retired range from its last column down, in one call
        self.pool.release_all(freed[::-1])
        return freed

    def first_held_col(self, req: str) -> int | None:
        """The lowest column ``retire`` will free; None when the request holds none."""
        cols = self.behind.get(req)
        return cols[0] if cols else None

    def free(self, req: str) -> list[int]:
        """Release every block of a finished or preempted request."""
        row = self.rows.pop(req, [])
        self.allocated.discard(req)
        self.behind.pop(req, None)
        # one call, tail first, as MambaManager.free does
        self.pool.release_all(list(dict.fromkeys(b for b in reversed(row) if b != NULL_BLOCK)))
        return [b for b in row if b != NULL_BLOCK]

    def running_col(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.B) - 1
