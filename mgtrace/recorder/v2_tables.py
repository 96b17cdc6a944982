"""The V2 runner's Mamba block tables, rebuilt in the assembler from the writes the hooks saw.

vLLM's V2 ``BlockTables`` holds two table sets per KV-cache group, both zero-initialised
device memory: ``block_tables[g]``, indexed by request slot (``source``), written by
``append_block_ids(req_index, ids, overwrite)`` from column ``start`` on, and
``input_block_tables[g]``, refilled in batch order every step by ``gather_block_tables``
(``input``). The hooks keep only the CPU arguments of those calls; this module replays them
on a CPU model of the memory, exactly as the device holds it:

- a write changes columns ``[start, start + len(ids))`` of its row and nothing past them, so
  a slot reused with fewer blocks keeps its previous request's ids past its ``num_blocks``;
- ``_gather_block_tables_kernel`` copies ``num_blocks`` entries of source row
  ``idx_mapping[b]`` into input row ``b`` and leaves the entries past them as an earlier
  gather (or a dummy run's clear) left them; rows from ``num_reqs`` up to
  ``max(num_reqs_padded, rows dirtied by the last gather)`` are zeroed whole.

A trace row carries the row's memory with its trailing zeros left out (the replayer refills
the rest of a row with zeros). Rows filled before recording began (recording attached to a
running engine) are found from the engine's ``num_blocks`` at the first gather and from
writes that start past column 0; the columns written unseen hold -1, never taken for the
null block: a replayed kernel launch that uses one is reported as malformed, the forward
model leaves a read of one unchecked, and the manifest counts such rows
(``block_table_unseen_columns``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mgtrace.recorder import assemble as asm

I32 = np.int32
UNKNOWN = -1  # a block id this recording never saw written

Write = tuple[int, int, list[int]]  # (local Mamba group, start column, block ids)


@dataclass(frozen=True)
class Gather:
    """One ``gather_block_tables`` into the input tables, as its arguments decide it."""

    num_reqs: int
    num_rows: int  # rows the kernel runs over: max(num_reqs_padded, dirty rows)
    cleared: int  # rows a dummy run zeroed since the previous gather


def _grown(mem: np.ndarray, rows: int, width: int) -> np.ndarray:
    """``mem`` enlarged (zero-filled, like vLLM's fresh tables) to hold rows x width."""
    if mem.shape[0] >= rows and mem.shape[1] >= width:
        return mem
    out = np.zeros((max(rows, mem.shape[0], 8), max(width, mem.shape[1], 8)), dtype=I32)
    out[: mem.shape[0], : mem.shape[1]] = mem
    return out


def row_content(row: np.ndarray) -> list[int]:
    """A memory row as a trace row: trailing zeros dropped (the replayer zero-fills)."""
    nonzero = np.flatnonzero(row)
    return row[: nonzero[-1] + 1].tolist() if len(nonzero) else []


class GroupTables:
    """One Mamba group's source and input tables, and the source rows' ``num_blocks``."""

    def __init__(self) -> None:
        self.source = np.zeros((8, 8), dtype=I32)
        self.input = np.zeros((8, 8), dtype=I32)
        self.num_blocks = np.zeros(8, dtype=np.int64)
        self.seen = np.zeros(8, dtype=bool)  # slot written from column 0 in this recording

    def _fit_slot(self, slot: int, width: int) -> None:
        self.source = _grown(self.source, slot + 1, width)
        if len(self.num_blocks) <= slot:
            extra = max(slot + 1, 2 * len(self.num_blocks)) - len(self.num_blocks)
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(extra, np.int64)])
            self.seen = np.concatenate([self.seen, np.zeros(extra, bool)])

    def write(self, slot: int, start: int, ids: list[int]) -> bool:
        """``append_block_ids`` for this group; True when a column nobody saw is now known
        to hold ids written before the recording began."""
        end = start + len(ids)
        self._fit_slot(slot, end)
        unseen = start > 0 and not self.seen[slot]
        if unseen:
            self.source[slot, :start] = UNKNOWN
        self.source[slot, start:end] = ids
        self.num_blocks[slot] = end
        self.seen[slot] = True
        return unseen

    def seed_counts(self, counts: np.ndarray) -> list[int]:
        """The engine's ``num_blocks`` per slot at the first gather: slots holding blocks this
        recording never saw written read -1 over them. Returns those slots."""
        found = np.flatnonzero(counts > 0)
        found = [int(s) for s in found.tolist() if s >= len(self.seen) or not self.seen[s]]
        for slot in found:
            self._fit_slot(slot, int(counts[slot]))
            self.source[slot, : counts[slot]] = UNKNOWN
            self.num_blocks[slot] = counts[slot]
            self.seen[slot] = True
        return found

    def gather(self, idx_mapping: np.ndarray, g: Gather) -> None:
        """``_gather_block_tables_kernel`` for this group (no sliding-window mask: Mamba
        groups have no window)."""
        n = g.num_reqs
        slots = idx_mapping[:n].astype(np.int64)
        width = self.source.shape[1]
        self.input = _grown(self.input, max(g.num_rows, g.cleared, n), width)
        self.source = _grown(self.source, 1, self.input.shape[1])
        width = self.input.shape[1]
        self.input[: g.cleared] = 0
        if n:
            self._fit_slot(int(slots.max()), width)
            counts = self.num_blocks[slots]
            fresh = np.arange(width)[None, :] < counts[:, None]
            self.input[:n] = np.where(fresh, self.source[slots, :width], self.input[:n])
        self.input[n : g.num_rows] = 0


class V2BlockTables:
    """Per-recording model of every Mamba group's V2 tables, and the rows last emitted."""

    def __init__(self) -> None:
        self.groups: dict[int, GroupTables] = {}
        # what the trace has said so far, per (table, group); zeros, as the replay starts
        self._emitted: dict[tuple[str, int], np.ndarray] = {}
        self.unseen: list[tuple[int, int]] = []  # (group, slot) holding ids written unseen

    def group(self, local: int) -> GroupTables:
        found = self.groups.get(local)
        if found is None:
            found = self.groups[local] = GroupTables()
        return found

    def apply_writes(self, writes: list[tuple[int, bool, list[Write]]]) -> None:
        for slot, _overwrite, per_group in writes:
            for local, start, ids in per_group:
                if self.group(local).write(slot, start, ids):
                    self.unseen.append((local, slot))

    def seed_counts(self, counts: np.ndarray) -> None:
        """``counts[local group, slot]``: the engine's ``num_blocks`` at the first gather."""
        for local, per_slot in enumerate(counts):
            self.unseen += [(local, slot) for slot in self.group(local).seed_counts(per_slot)]

    def take_unseen(self) -> list[tuple[int, int]]:
        """Rows found since the last call holding ids written before the recording began."""
        found, self.unseen = self.unseen, []
        return found

    def apply_gather(self, idx_mapping: np.ndarray, gather: Gather) -> None:
        for tables in self.groups.values():
            tables.gather(idx_mapping, gather)

    def changed_rows(self) -> dict[str, Any] | None:
        """``block_tables`` rows (source, then input) whose memory changed since last time."""
        parts = []
        for local, tables in sorted(self.groups.items()):
            for kind, mem in (("source", tables.source), ("input", tables.input)):
                parts.append(self._changed(kind, local, mem))
        return asm.merge_columns([p for p in parts if p])

    def _changed(self, kind: str, local: int, mem: np.ndarray) -> dict[str, Any] | None:
        # every column counts, not only the first num_blocks: the kernels can read past them
        rows, width = mem.shape
        last = _grown(self._emitted.get((kind, local), np.zeros((0, 0), I32)), rows, width)
        self._emitted[(kind, local)] = last
        changed = np.flatnonzero((mem != last[:rows, :width]).any(axis=1))
        if not len(changed):
            return None
        last[changed, :width] = mem[changed]
        return {
            "group": np.full(len(changed), local, dtype=I32),
            "table": np.full(len(changed), asm.TABLE_CODE[kind], dtype=I32),
            "row": changed.astype(I32),
            "block_ids": [row_content(mem[r]) for r in changed.tolist()],
        }
