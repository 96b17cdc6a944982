"""Turn one step's raw record (what the hooks copied) and its landed captures into the
columns of the trace tables. Runs in the assembler process (or on the recorder thread with
the in-process fallback, sharing the engine's GIL): everything per row is numpy or a C-level
``map``."""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np

from mgtrace.recorder import assemble as asm
from mgtrace.recorder.v2_tables import V2BlockTables

I32 = np.int32


class StepTables:
    """Per-recording state the tables need across steps (block-table contents so far)."""

    def __init__(self, kind: str, block_size: int) -> None:
        self.kind = kind
        self.block_size = block_size
        self._bt = asm.BlockTableDiff()
        self.v2_bt = V2BlockTables()

    def build(self, rec: dict[str, Any], captured: dict[str, Any]) -> dict[str, Any]:
        tables = (self._v1_tables if self.kind == "v1" else self._v2_tables)(rec, captured)
        so = rec.get("so")
        if so is not None:
            sched = asm.sched_columns(so)
            if sched is not None:
                tables["sched"] = sched
        return tables

    def _v1_tables(self, rec: dict[str, Any], captured: dict[str, Any]) -> dict[str, Any]:
        req_ids: list[str] = rec.get("req_ids") or []
        n = len(req_ids)
        so = rec["so"]
        steps = _step_columns(rec, n)
        steps["reorder_threshold"] = rec.get("threshold")
        steps["accepted_landed"] = rec.get("landed")
        tables: dict[str, Any] = {"steps": steps}
        moves = self._moves(rec)
        if moves:
            tables["row_moves"] = moves
        if n == 0:
            return tables
        nst = so.num_scheduled_tokens
        drafts = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        scheduled = np.fromiter(map(nst.get, req_ids, repeat(0)), I32, n)
        num_draft = np.fromiter(map(len, map(drafts.get, req_ids, repeat(()))), I32, n)
        computed_reorder = rec["computed"]
        computed = rec.get("computed_pre", computed_reorder)
        prompt = rec["prompt"]
        rows: dict[str, Any] = {
            "batch_row": np.arange(n, dtype=I32),
            "req_id": req_ids,
            "req_slot": np.arange(n, dtype=I32),
            "num_scheduled": scheduled,
            "num_computed": computed.astype(I32),
            "num_prompt": prompt.astype(I32),
            "num_draft": num_draft,
            "is_prefilling": computed < prompt,
        }
        if "acc_prev" in rec:
            rows["accepted_prev"] = rec["acc_prev"].astype(I32)
        post = captured.get("postprocess")
        if post is not None and "num_accepted" in post and len(post["num_accepted"]) == n:
            acc = post["num_accepted"]
            rows["accepted"] = asm.positive_or_null(acc)
        before, after = rec.get("sidx_before"), rec.get("sidx_after")
        if after is not None:
            rows["state_col"] = np.fromiter(map(after.get, req_ids, repeat(-1)), I32, n)
        if before is not None:
            rows["prev_state_col"] = self._prev_cols(so, req_ids, before, computed)
        regions = asm.reorder_regions(scheduled, computed_reorder, prompt, rec.get("threshold"))
        if regions is not None:
            rows["reorder_region"] = regions
        split = asm.mamba_split(n, rec.get("mamba"))
        if split is not None:
            rows["mamba_split"] = split
        rows.update(asm.prefill_checkpoints(n, rec.get("ckpt")))
        tables["batch_rows"] = rows
        bt = self._block_tables(rec, "v1", n)
        if bt:
            tables["block_tables"] = bt
        return tables

    def _prev_cols(
        self, so: Any, req_ids: list[str], before: dict[str, int], computed: np.ndarray
    ) -> np.ndarray:
        """The running column each row's precopy started from: the runner's remembered
        column, or for a new request the one its computed tokens end in. ``before`` is the
        runner's dict as ``preprocess_mamba`` received it, before its
        ``cleanup_mamba_state_idx`` forgot the finished, preempted and resumed requests (a
        request aborted and resubmitted under the same id is finished and scheduled in one
        step): those start fresh too."""
        missing = np.iinfo(np.int64).min
        prev = np.fromiter(map(before.get, req_ids, repeat(missing)), np.int64, len(req_ids))
        forgotten = (
            set(so.finished_req_ids or ())
            | set(getattr(so, "preempted_req_ids", None) or ())
            | set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        )
        if forgotten:
            for i, r in enumerate(req_ids):
                if r in forgotten:
                    prev[i] = missing
        fresh = prev == missing
        prev[fresh] = (computed[fresh].astype(np.int64) - 1) // self.block_size
        return prev.astype(I32)

    def _block_tables(self, rec: dict[str, Any], table: str, n: int) -> dict[str, Any] | None:
        parts = []
        code = asm.TABLE_CODE[table]
        for group, rows, counts in rec.get("bt", ()):
            part = self._bt.changed(code, group, rows, counts)
            if part:
                parts.append(part)
        return asm.merge_columns(parts)

    def _moves(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        ops: list[int] = []
        a_rows: list[int | None] = []
        b_rows: list[int | None] = []
        a_ids: list[str | None] = []
        b_ids: list[str | None] = []
        a_acc: list[int | None] = []
        b_acc: list[int | None] = []
        for m in rec["moves"]:
            if m[0] == "condense":
                _, before, after, acc = m
                if before == after:
                    continue
                where = {r: i for i, r in enumerate(before) if r is not None}
                for j, r in enumerate(after):
                    i = where.get(r)
                    if r is None or i is None or i == j:
                        continue
                    ops.append(asm.OP_CODE["move"])
                    a_rows.append(i)
                    b_rows.append(j)
                    a_ids.append(r)
                    b_ids.append(before[j] if j < len(before) else None)
                    a_acc.append(int(acc[i]) if i < len(acc) else None)
                    b_acc.append(int(acc[j]) if j < len(acc) else None)
                continue
            op, ra, rb, ia, ib, aa, ab = m
            ops.append(asm.OP_CODE[op])
            a_rows.append(ra)
            b_rows.append(rb)
            a_ids.append(ia)
            b_ids.append(ib)
            a_acc.append(aa)
            b_acc.append(ab)
        if not ops:
            return None
        return {
            "seq": np.arange(len(ops), dtype=I32),
            "op": np.asarray(ops, dtype=I32),
            "row_a": a_rows,
            "row_b": b_rows,
            "req_id": a_ids,
            "req_id_b": b_ids,
            "accepted_a": a_acc,
            "accepted_b": b_acc,
            "d2h_landed": rec.get("landed"),
        }

    def _v2_tables(self, rec: dict[str, Any], captured: dict[str, Any]) -> dict[str, Any]:
        req_ids: list[str] = rec.get("req_ids") or []
        n = len(req_ids)
        tables: dict[str, Any] = {"steps": _step_columns(rec, n)}
        bt = self._v2_block_tables(rec)
        if bt:
            tables["block_tables"] = bt
        if n == 0:
            return tables
        computed = rec["computed"][:n]
        prompt = rec["prompt"][:n]
        draft = rec.get("draft")
        rows: dict[str, Any] = {
            "batch_row": np.arange(n, dtype=I32),
            "req_id": req_ids,
            "req_slot": rec["idx"][:n].astype(I32),
            "num_scheduled": rec["scheduled"][:n].astype(I32),
            "num_computed": computed.astype(I32),
            "num_prompt": prompt.astype(I32),
            "num_draft": None if draft is None else draft[:n].astype(I32),
            "is_prefilling": rec["prefilling"][:n].astype(bool),
        }
        pre = captured.get("v2_pre")
        if pre is not None:
            rows["accepted_prev"] = pre["num_accepted"].astype(I32)
            rows["prev_state_col"] = pre["state_idx"].astype(I32)
            if "num_computed" in pre:
                # the count the kernels read: the CPU mirror is optimistic under async
                rows["num_computed"] = pre["num_computed"].astype(I32)
        precopy = captured.get("precopy")
        if precopy is not None:
            rows["state_col"] = precopy["state_idx"].astype(I32)
        post = captured.get("postprocess")
        if post is not None and len(post.get("num_accepted", ())) == n:
            acc = post["num_accepted"]
            rows["accepted"] = asm.positive_or_null(acc)
        split = asm.mamba_split(n, rec.get("mamba"))
        if split is not None:
            rows["mamba_split"] = split
        rows.update(asm.prefill_checkpoints(n, rec.get("ckpt")))
        tables["batch_rows"] = rows
        return tables

    def _v2_block_tables(self, rec: dict[str, Any]) -> dict[str, Any] | None:
        """The step's writes into the source tables, then its gather into the input tables
        (the runner's order: both precede every launch of the step)."""
        model = self.v2_bt
        model.apply_writes(rec.get("bt_writes") or [])
        counts = rec.get("bt_counts")
        if counts is not None:
            model.seed_counts(counts)
        gather = rec.get("gather")
        idx = rec.get("idx")
        if gather is not None and idx is not None:
            model.apply_gather(idx, gather)
        return model.changed_rows()


def _step_columns(rec: dict[str, Any], n: int) -> dict[str, Any]:
    """The ``steps`` columns both runners record the same way."""
    mamba = rec.get("mamba")  # (decodes, threshold, mask) from the builder's split
    copies = getattr(rec["so"], "kv_cache_block_copies", None)
    return {
        # one row: a list holding the step's one list value
        "block_copy_src": [[c[0] for c in copies]] if copies else None,
        "block_copy_dst": [[c[1] for c in copies]] if copies else None,
        "wall_ns": rec["wall_ns"],
        "num_reqs": n,
        "num_scheduled_tokens": getattr(rec["so"], "total_num_scheduled_tokens", None),
        "mamba_threshold": mamba[1] if mamba else None,
        "num_mamba_decodes": mamba[0] if mamba else None,
        "postprocess_step": rec.get("post_step"),
    }
