"""The V2 model runner's bookkeeping: request slots, idx_mapping, two block-table sets, PP.

Per-request data lives in slot-indexed arrays; a slot comes from a LIFO free list (the first
request gets the highest slot). Each step sorts the batch (drafts first, then rows of exactly
the decode length, then by token count), maps batch rows to slots (``idx_mapping``) and gathers
the per-slot source block tables into batch-ordered input tables.

With pipeline parallelism the last rank post-processes a step right away, while every other
rank does it pp_size steps later, at the start of the step that schedules those requests
again, with that old step's idx_mapping. The input tables then hold the previous step's
gather, so a kernel that indexes them by batch row (``batch-row-block-table``) reads another
request's block ids; indexing the source tables by slot is what keeps it right.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mgtrace.sim.config import BUG_BATCH_ROW, SimConfig
from mgtrace.sim.reorder import BuilderSplit, builder_split, regions, v2_order
from mgtrace.sim.runner_common import (
    StepResult,
    checkpoint_columns,
    copy_boundary,
    row_moves_table,
    running_cols,
    where_valid,
)
from mgtrace.sim.scheduler import KIND_NEW, KIND_RESUMED, SchedOut


@dataclass
class _Deferred:
    """A post-process a non-last rank owes: the old step's batch as it was then."""

    step: int
    req_ids: list[str]
    slots: np.ndarray
    gens: np.ndarray
    accepted: np.ndarray  # max(num_sampled, 1), before normalisation
    new_computed: np.ndarray
    state_idx: np.ndarray
    samples: np.ndarray  # the rows that sample (vLLM's need_sampled_mask)


class RunnerV2:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.B = cfg.mamba_block_size
        self.k = cfg.k
        n = cfg.max_num_seqs
        self.free = list(range(n))
        self.gen = np.zeros(n, np.int64)
        self.slot_of: dict[str, int] = {}
        self.source: list[list[int]] = [[] for _ in range(n)]
        self.version = np.zeros(n, np.int64)
        self.input: list[list[int]] = [[] for _ in range(n)]
        self.input_key: list[tuple[int, int]] = [(-1, -1)] * n
        self.state_idx = np.full(n, -1, np.int64)
        self.acc = np.ones(n, np.int64)  # num_accepted_tokens_gpu, slot-indexed
        self.nc = np.zeros(n, np.int64)  # req_states.num_computed_tokens, slot-indexed
        self.prompt = np.zeros(n, np.int64)
        self.deferred: deque[_Deferred] = deque()
        self.bug = cfg.has(BUG_BATCH_ROW)
        # blocks a misdirected post-process wrote while no live request held them: a later
        # prefix hit on one starts from that state (block -> (step, writer request)), until
        # the pool hands the block out afresh
        self.poisoned: dict[int, tuple[int, str]] = {}
        self.builder_thresholds: dict[str, int | None] = {
            cfg.builder_name: cfg.mamba_threshold,
            "attention(TRITON_ATTN)": None,
        }
        self.reorder_threshold = None  # V2 sorts instead of reordering in place

    # ------------------------------------------------------------------ one step
    def execute(
        self,
        so: SchedOut,
        accepted: np.ndarray,
        landed_early: bool,
        live_owner: Callable[[], dict[int, str]],
    ) -> list[StepResult]:
        cfg = self.cfg
        step = so.step
        B = self.B
        pp = cfg.pp
        moves: list[tuple] = []
        dirty_source: set[int] = set()
        dirty_input: set[int] = set()

        # non-last ranks: the post-process owed from pp steps ago, against the live tables
        late_launch: dict[str, Any] | None = None
        late_events: list[dict[str, Any]] = []
        late_step: int | None = None
        if pp > 1 and self.deferred and self.deferred[0].step <= step - pp:
            d = self.deferred.popleft()
            late_step = d.step
            late_launch, late_events = self._late_postprocess(step, d, live_owner)

        # finish / free / add / update
        ids = so.req_ids
        # vLLM frees finished and preempted requests sorted by id (every TP rank frees slots
        # in the same order); the ids sort as their arrival numbers (zero-padded)
        gone = sorted({r.req_id for r in so.finished} | {r.req_id for r in so.preempted})
        gone += [
            ids[p]
            for p in (so.kind == KIND_RESUMED).nonzero()[0].tolist()
            if ids[p] in self.slot_of
        ]
        for rid in gone:
            slot = self.slot_of.pop(rid, None)
            if slot is None:
                continue
            moves.append(("remove", slot, None, rid, None, int(self.acc[slot]), None, None))
            self.free.append(slot)
            self.gen[slot] += 1
        pos_slots = np.fromiter((self.slot_of.get(r, -1) for r in ids), np.int64, len(ids))
        # Slots are taken in the order the scheduler lists the requests to add: V2's output
        # puts the new ones before the resumed ones.
        joining = (pos_slots < 0).nonzero()[0].tolist()
        hits: list[tuple[int, int]] = []  # (position, block) of the prefix hits read now
        for p in sorted(joining, key=lambda p: so.kind[p] != KIND_NEW):
            rid = ids[p]
            slot = self.free.pop()
            pos_slots[p] = slot
            self.slot_of[rid] = slot
            moves.append(("add", slot, None, rid, None, int(self.acc[slot]), None, None))
            computed = int(so.num_computed[p])
            self.source[slot] = list(so.ids_at(p))
            if computed and self.poisoned:
                hits.append((p, self.source[slot][(computed - 1) // B]))
            self.acc[slot] = 1
            self.nc[slot] = computed
            # V2 (re)adds a request with all its tokens as the prefill (prefill_len =
            # len(all_token_ids)): a resumed one replays its output as prompt too
            req = so.reqs[p]
            self.prompt[slot] = req.prompt_len + req.num_output
            self.state_idx[slot] = (computed - 1) // B
            self.version[slot] += 1
            dirty_source.add(slot)
        for p, new_ids in so.new_block_ids.items():
            slot = int(pos_slots[p])
            if slot not in dirty_source:
                self.source[slot] = self.source[slot] + new_ids
                self.version[slot] += 1
                dirty_source.add(slot)

        # batch order, idx_mapping, gather of the input tables
        perm = v2_order(so.num_scheduled, so.num_draft > 0, 1 + self.k)
        n = len(perm)
        req_ids = [ids[p] for p in perm.tolist()]
        if self.poisoned:
            late_events += self._poisoned_hits(step, so, perm, hits)
        slots = pos_slots[perm]
        version = self.version[slots].tolist()
        for b, slot in enumerate(slots.tolist()):
            key = (slot, version[b])
            if self.input_key[b] != key:
                self.input_key[b] = key
                self.input[b] = self.source[slot]
                dirty_input.add(b)
        sched_n = so.num_scheduled[perm]
        draft = so.num_draft[perm]
        samples = so.samples[perm]
        nc = self.nc[slots]
        prompt = self.prompt[slots]

        # preprocess_state: advance the running column, precopy with the accepted bias
        src_col = self.state_idx[slots].copy()
        acc_prev = self.acc[slots].copy()
        new_col = running_cols(nc, sched_n, B)
        moved = (src_col >= 0) & (src_col != new_col)
        self.state_idx[slots] = new_col
        self.acc[slots[moved]] = 1
        bias = np.maximum(acc_prev - 1, 0)

        split = builder_split(cfg.mixer, sched_n, nc, prompt, draft, cfg.k)
        region = regions(sched_n, nc, prompt, cfg.mamba_threshold)

        # sampling, post_update, postprocess_state on the last rank
        num_sampled = np.where(samples, accepted[perm], 0)
        acc_now = np.maximum(num_sampled, 1)
        rejected = np.where(samples, draft + 1 - acc_now, 0)
        new_computed = nc + sched_n - rejected
        R = new_computed - acc_now + 1
        need, _b, dst = copy_boundary(R, new_computed, B)
        self.acc[slots] = np.where(need & (dst == new_col), 1, acc_now)
        self.nc[slots] = new_computed
        # a batch where no row samples owes nothing (vLLM's receive leaves its slot empty)
        if pp > 1 and np.count_nonzero(samples):
            self.deferred.append(
                _Deferred(
                    step,
                    req_ids,
                    slots.copy(),
                    self.gen[slots].copy(),
                    acc_now.copy(),
                    new_computed.copy(),
                    new_col.copy(),
                    samples.copy(),
                )
            )

        common = self._common_tables(
            step,
            n,
            req_ids,
            slots,
            sched_n,
            nc,
            prompt,
            draft,
            acc_prev,
            num_sampled,
            samples,
            src_col,
            new_col,
            region,
            split,
            moves,
            dirty_source,
            dirty_input,
            so.total_tokens,
        )
        pre = self._precopy(step, n, slots, acc_prev, new_col, src_col, bias)
        post = self._postprocess(
            step,
            step,
            np.arange(n, dtype=np.int32),
            slots,
            acc_now,
            new_col,
            new_computed,
            bt_step=step,
        )
        results = []
        for rank in range(pp):
            last = rank == pp - 1
            tables = dict(common)
            steps = dict(common["steps"])
            steps["postprocess_step"] = (step if n else None) if last else late_step
            tables["steps"] = steps
            launches = [pre] if n else []
            if last and n:
                launches.append(post)
            if not last and late_launch is not None:
                launches.append(late_launch)
            events = [dict(e, rank=rank) for e in late_events] if not last else []
            results.append(StepResult(tables=tables, launches=launches, events=events))
        return results

    # ------------------------------------------------------------------ kernels
    def _rule(self, rows: np.ndarray, slots: np.ndarray) -> tuple[str, np.ndarray, str]:
        if self.bug:
            return "batch_row", rows.astype(np.int32), "input"
        return "req_slot", slots.astype(np.int32), "source"

    def _precopy(
        self,
        step: int,
        n: int,
        slots: np.ndarray,
        acc_prev: np.ndarray,
        new_col: np.ndarray,
        src_col: np.ndarray,
        bias: np.ndarray,
    ) -> dict[str, Any]:
        rows = np.arange(n, dtype=np.int32)
        rule, bt_row, table = self._rule(rows, slots)
        return {
            "kernel": "precopy",
            "batch_row": rows,
            "batch_step": step,
            "req_slot": slots.astype(np.int32),
            "row_rule": rule,
            "bt_row": bt_row,
            "bt_table": table,
            "bt_step": step,
            "num_accepted": acc_prev.astype(np.int32),
            "state_idx": new_col.astype(np.int32),
            "src_col": src_col.astype(np.int32),
            "token_bias": bias.astype(np.int32),
        }

    def _postprocess(
        self,
        step: int,
        batch_step: int,
        rows: np.ndarray,
        slots: np.ndarray,
        acc: np.ndarray,
        state_idx: np.ndarray,
        new_computed: np.ndarray,
        bt_step: int,
    ) -> dict[str, Any]:
        rule, bt_row, table = self._rule(rows, slots)
        return {
            "kernel": "postprocess",
            "batch_row": rows,
            "batch_step": batch_step,
            "req_slot": slots.astype(np.int32),
            "row_rule": rule,
            "bt_row": bt_row,
            "bt_table": table,
            "bt_step": bt_step,
            "mode": "precomputed",
            "num_accepted": acc.astype(np.int32),
            "state_idx": state_idx.astype(np.int32),
            "num_computed": new_computed.astype(np.int32),
        }

    def _late_postprocess(
        self,
        step: int,
        d: _Deferred,
        live_owner: Callable[[], dict[int, str]],
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The post-process owed for ``d``'s batch, with the rows vLLM leaves out (freed
        since, or not sampling: a non-final prefill chunk) at slot -1; none when no row is
        left."""
        n = len(d.req_ids)
        rows = np.arange(n, dtype=np.int32)
        valid = (self.gen[d.slots] == d.gens) & d.samples
        if not np.count_nonzero(valid):
            return None, []
        slots = np.where(valid, d.slots, -1)
        launch = self._postprocess(
            step, d.step, rows, slots, d.accepted, d.state_idx, d.new_computed, bt_step=step - 1
        )
        events: list[dict[str, Any]] = []
        if not self.bug:
            return launch, events
        R = d.new_computed - d.accepted + 1
        need, bias, dst = copy_boundary(R, d.new_computed, self.B)
        copies = valid & need & ~((dst == d.state_idx) & (bias == 0))
        owners: dict[int, str] | None = None
        for b in copies.nonzero()[0].tolist():
            slot = int(d.slots[b])
            cols = {
                "dst": int(dst[b]),
                "conv_src": int(d.state_idx[b]),
                "temporal_src": int(d.state_idx[b] + bias[b]),
            }
            right = self.source[slot]
            wrong = self.input[b]
            rec = {k: (wrong[c] if 0 <= c < len(wrong) else None) for k, c in cols.items()}
            cor = {k: (right[c] if 0 <= c < len(right) else None) for k, c in cols.items()}
            if rec == cor:
                continue
            owners = owners if owners is not None else live_owner()
            victim = owners.get(rec["dst"]) if rec["dst"] else None
            if rec["dst"] and rec["dst"] != cor["dst"] and victim is None:
                # written where no live request reads it: a block the prefix cache may hold
                self.poisoned[rec["dst"]] = (step, d.req_ids[b])
            events.append(
                {
                    "bug": BUG_BATCH_ROW,
                    "step": step,
                    "req_id": d.req_ids[b],
                    "batch_row": b,
                    "batch_step": d.step,
                    "recorded": {"bt_row": b, "bt_table": "input", "blocks": rec},
                    "correct": {"bt_row": slot, "bt_table": "source", "blocks": cor},
                    "victim": victim if victim != d.req_ids[b] else None,
                }
            )
        return launch, events

    def _poisoned_hits(
        self, step: int, so: SchedOut, perm: np.ndarray, hits: list[tuple[int, int]]
    ) -> list[dict[str, Any]]:
        """Events for the requests whose prefix hit starts from a poisoned block; every
        other block handed out this step is fresh, and no longer poisoned."""
        events = []
        row_of = {int(p): b for b, p in enumerate(perm.tolist())}
        for p, block in hits:
            if block in self.poisoned:
                since, writer = self.poisoned[block]
                events.append(
                    {
                        "bug": BUG_BATCH_ROW,
                        "step": step,
                        "req_id": so.req_ids[p],
                        "batch_row": row_of[p],
                        "recorded": {"prefix_hit_block": block, "written_by": writer},
                        "correct": {"prefix_hit_block": block, "written_by": None},
                        "poisoned_at_step": since,
                    }
                )
        read = {block for _, block in hits}
        for new_ids in so.new_block_ids.values():
            for block in new_ids:
                if block not in read:
                    self.poisoned.pop(block, None)
        return events

    # ------------------------------------------------------------------ recording
    def _common_tables(
        self,
        step: int,
        n: int,
        req_ids: list[str],
        slots: np.ndarray,
        sched_n: np.ndarray,
        nc: np.ndarray,
        prompt: np.ndarray,
        draft: np.ndarray,
        acc_prev: np.ndarray,
        num_sampled: np.ndarray,
        samples: np.ndarray,
        src_col: np.ndarray,
        new_col: np.ndarray,
        region: np.ndarray,
        split: BuilderSplit,
        moves: list,
        dirty_source: set[int],
        dirty_input: set[int],
        total_tokens: int,
    ) -> dict[str, Any]:
        rows = np.arange(n, dtype=np.int32)
        is_dec = split.decode
        tables: dict[str, Any] = {
            "steps": {
                "num_reqs": n,
                "num_scheduled_tokens": int(total_tokens),
                "reorder_threshold": None,
                "mamba_threshold": split.threshold,
                "num_mamba_decodes": split.num_decodes,
                "postprocess_step": None,
                "accepted_landed": None,
            },
            "batch_rows": {
                "batch_row": rows,
                "req_id": req_ids,
                "req_slot": slots.astype(np.int32),
                "num_scheduled": sched_n.astype(np.int32),
                "num_computed": nc.astype(np.int32),
                "num_prompt": prompt.astype(np.int32),
                "num_draft": draft.astype(np.int32),
                "accepted_prev": acc_prev.astype(np.int32),
                "accepted": where_valid(num_sampled, samples),
                "prev_state_col": src_col.astype(np.int32),
                "state_col": new_col.astype(np.int32),
                "is_prefilling": nc < prompt,
                # categorical columns as int8 codes into their categories: the writer's
                # cheap form
                "reorder_region": region,
                "mamba_split": (~is_dec).view(np.int8),
            },
        }
        if self.cfg.prefill_checkpoints:
            tables["batch_rows"].update(
                checkpoint_columns(nc, sched_n, ~is_dec, self.cfg.mamba_block_size, self.cfg.k > 0)
            )
        if moves:
            tables["row_moves"] = row_moves_table(moves)
        if dirty_source or dirty_input:
            src = sorted(dirty_source)
            inp = sorted(dirty_input)
            tables["block_tables"] = {
                "group": 0,
                "table": ["source"] * len(src) + ["input"] * len(inp),
                "row": np.asarray(src + inp, np.int32),
                "block_ids": [self.source[r] for r in src] + [self.input[r] for r in inp],
            }
        return tables
