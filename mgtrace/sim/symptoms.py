"""Symptom detectors that read only a trace: the observable signature of each bug class.

They do not look at the ground truth, so a trace of a toggle-off run must show none of them
and a trace of a toggle-on run must show its own. Each detector returns (step, req_id) pairs.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.replayer.ownership import freed_below, processed_tokens, steps_in_flight
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import SCHED_KINDS
from mgtrace.sim.config import BUG_ASYNC_RACE, BUG_BATCH_ROW, BUG_REORDER, BUG_STALE_ROW

Hits = list[tuple[int, str]]


def _cols(reader: TraceReader, table: str, rank: int | None = 0) -> dict[str, np.ndarray]:
    t = reader.table(table)
    data = {name: np.asarray(t.column(name).to_pylist(), dtype=object) for name in t.column_names}
    if rank is not None and "rank" in data and len(data["rank"]):
        keep = data["rank"] == rank
        data = {k: v[keep] for k, v in data.items()}
    return data


def _int(a: np.ndarray, fill: int = 0) -> np.ndarray:
    return np.array([fill if v is None else v for v in a.tolist()], dtype=np.int64)


def misplaced_decodes(reader: TraceReader) -> Hits:
    """Spec-decode rows the Mamba builder put in its prefill split."""
    br = _cols(reader, "batch_rows")
    steps = _cols(reader, "steps")
    thr = dict(zip(steps["step"].tolist(), steps["mamba_threshold"].tolist(), strict=True))
    hits: Hits = []
    for s, r, n, d, pre, split in zip(
        br["step"],
        br["req_id"],
        br["num_scheduled"],
        br["num_draft"],
        br["is_prefilling"],
        br["mamba_split"],
        strict=True,
    ):
        # a null threshold: GDN's spec mask, which takes every row scheduling drafts + 1
        limit = thr[s] if thr[s] is not None else d + 1
        if d and not pre and n <= limit and split == "prefill":
            hits.append((int(s), str(r)))
    return hits


def wrong_accepted(reader: TraceReader) -> Hits:
    """V1 rows whose consumed accepted count is not the one their previous step produced."""
    if reader.run.runner != "v1":
        return []
    B = reader.run.mamba_block_size
    br = _cols(reader, "batch_rows")
    order = np.lexsort((_int(br["batch_row"]), _int(br["step"])))
    br = {k: v[order] for k, v in br.items()}
    step = _int(br["step"])
    nc, n, d = _int(br["num_computed"]), _int(br["num_scheduled"]), _int(br["num_draft"])
    acc = _int(br["accepted"], fill=1)
    col = _int(br["state_col"])
    R = nc + n - d
    N = R + acc - 1
    aligned = (N // B) * B
    produced = np.where((aligned >= R) & (aligned // B - 1 == col), 1, acc)
    last: dict[str, tuple[int, int]] = {}
    prev_col = _int(br["prev_state_col"])
    hits: Hits = []
    for i, rid in enumerate(br["req_id"].tolist()):
        s = int(step[i])
        seen = last.get(rid)
        expected = seen[1] if seen is not None and seen[0] == s - 1 else 1
        consumed = int(br["accepted_prev"][i])
        precopy = prev_col[i] != -1 and prev_col[i] != col[i]
        if consumed != expected and (precopy or br["mamba_split"][i] == "decode"):
            hits.append((s, rid))
        last[rid] = (s, int(produced[i]))
    return hits


class _Tables:
    """Block-table contents replayed from the trace's change rows, step by step."""

    def __init__(self, reader: TraceReader, rank: int) -> None:
        bt = _cols(reader, "block_tables", rank)
        order = np.argsort(_int(bt["step"]), kind="stable")
        self.rows = [
            (int(bt["step"][i]), str(bt["table"][i]), int(bt["row"][i]), list(bt["block_ids"][i]))
            for i in order.tolist()
        ]
        self.pos = 0
        self.content: dict[tuple[str, int], list[int]] = {}

    def advance(self, upto_step: int) -> None:
        while self.pos < len(self.rows) and self.rows[self.pos][0] <= upto_step:
            _, table, row, ids = self.rows[self.pos]
            self.content[(table, row)] = ids
            self.pos += 1

    def get(self, table: str, row: int) -> list[int]:
        return self.content.get((table, row), [])


def _held_from(reader: TraceReader) -> dict[tuple[int, str], int]:
    """Per (step, scheduled request), the first block-table column the request still holds:
    align mode frees the columns below ``cdiv(processed, B) - 1`` (processed: the computed
    count less the tokens of steps still in flight) without a scheduler delta, so the
    runner's row keeps listing those blocks after they have gone back to the pool."""
    sc = _cols(reader, "sched")
    if not len(sc["step"]):
        return {}
    req_ids = sc["req_id"].tolist()
    uid = {r: i for i, r in enumerate(dict.fromkeys(req_ids))}
    processed = processed_tokens(
        np.array([uid[r] for r in req_ids], dtype=np.int64),
        _int(sc["step"]),
        np.array([SCHED_KINDS.index(k) for k in sc["kind"].tolist()], dtype=np.int64),
        _int(sc["num_scheduled"]),
        _int(sc["num_computed"]),
        steps_in_flight(reader.run),
    )
    below = freed_below(processed, reader.run.mamba_block_size)
    return {
        (s, r): max(int(b), 0) for s, r, b in zip(sc["step"].tolist(), req_ids, below, strict=True)
    }


def stale_row_writes(reader: TraceReader) -> Hits:
    """Padded rows whose gathered state indices name a block a live row of the step holds."""
    la = _cols(reader, "launches")
    pad = [
        i
        for i, (k, s) in enumerate(zip(la["kernel"], la["req_slot"], strict=True))
        if k == "aligned_indices" and s == -1
    ]
    if not pad:
        return []
    k = reader.run.num_speculative_tokens
    br = _cols(reader, "batch_rows")
    live: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for s, row, rid in zip(
        br["step"].tolist(), br["batch_row"].tolist(), br["req_id"].tolist(), strict=True
    ):
        live[s].append((row, rid))
    held_from = _held_from(reader)
    tables = _Tables(reader, 0)
    hits: Hits = []
    for i in sorted(pad, key=lambda j: la["step"][j]):
        s, row = int(la["step"][i]), int(la["bt_row"][i])
        tables.advance(int(la["bt_step"][i]))
        cols = [b for b in tables.get("v1", row)[: 1 + k] if b]
        for b in cols:
            for lrow, rid in live[s]:
                if b in tables.get("v1", lrow)[held_from.get((s, rid), 0) :]:
                    hits.append((s, rid))
    return hits


def cross_request_copies(reader: TraceReader) -> Hits:
    """Late (pipeline-deferred) post-process rows whose block-table row is not their own."""
    B = reader.run.mamba_block_size
    hits: Hits = []
    for rank in range(reader.run.pp_size):
        la = _cols(reader, "launches", rank)
        late = [
            i
            for i, (kern, s, bs) in enumerate(
                zip(la["kernel"], la["step"], la["batch_step"], strict=True)
            )
            if kern == "postprocess" and bs is not None and bs < s
        ]
        if not late:
            continue
        br = _cols(reader, "batch_rows", rank)
        who = {
            (int(s), int(b)): str(r)
            for s, b, r in zip(br["step"], br["batch_row"], br["req_id"], strict=True)
        }
        tables = _Tables(reader, rank)
        for i in sorted(late, key=lambda j: la["step"][j]):
            slot = la["req_slot"][i]
            if slot is None or slot < 0:
                continue
            tables.advance(int(la["bt_step"][i]))
            n, N, src = (
                int(la["num_accepted"][i]),
                int(la["num_computed"][i]),
                int(la["state_idx"][i]),
            )
            R = N - n + 1
            aligned = (N // B) * B
            bias, dst = aligned - R, aligned // B - 1
            if aligned < R or (src == dst and bias == 0):
                continue
            used = tables.get(str(la["bt_table"][i]), int(la["bt_row"][i]))
            own = tables.get("source", int(slot))

            def at(row: list[int], c: int) -> Any:
                return row[c] if 0 <= c < len(row) else None

            if any(at(used, c) != at(own, c) for c in (dst, src, src + bias)):
                hits.append(
                    (int(la["step"][i]), who[(int(la["batch_step"][i]), int(la["batch_row"][i]))])
                )
    return hits


DETECTORS = {
    BUG_REORDER: misplaced_decodes,
    BUG_ASYNC_RACE: wrong_accepted,
    BUG_STALE_ROW: stale_row_writes,
    BUG_BATCH_ROW: cross_request_copies,
}


def detect(trace: str | Path) -> dict[str, Hits]:
    """Every detector on one trace: bug name -> (step, req_id) hits, in step order."""
    reader = TraceReader(trace)
    return {name: sorted(set(fn(reader))) for name, fn in DETECTORS.items()}
