"""The V1 model runner's bookkeeping: InputBatch rows, reorder, align pre/post-process.

The persistent batch is the row order: a new request takes the smallest row freed this step
(else the next row), ``condense`` moves the highest live row into the lowest hole, and the
reorder swaps rows. Block-table rows and the pinned accepted-count buffer move with the rows.
Under async scheduling the previous step's accepted counts are copied device-to-host into that
buffer while this step's row moves run; the runner then reads it through the previous step's
row positions. The copy may land before the moves (then the remap reads moved rows) or after
them (then it is consistent): that is the race of ``async-accepted-race``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mgtrace.sim.columns import ReqIds
from mgtrace.sim.config import BUG_ASYNC_RACE, BUG_REORDER, BUG_STALE_ROW, SimConfig
from mgtrace.sim.input_rows import InputRows
from mgtrace.sim.reorder import (
    REGION_DECODE,
    REGION_NAMES,
    BuilderSplit,
    builder_split,
    regions,
    reorder_swaps,
)
from mgtrace.sim.runner_common import (
    PerRequest,
    StepResult,
    capture_size,
    checkpoint_columns,
    row_moves_table,
    sparse,
    where_valid,
)
from mgtrace.sim.scheduler import KIND_CACHED, KIND_NEW, KIND_RESUMED, SchedOut


class _Cols(NamedTuple):
    """A step's recorded int32 columns, shared by the tables and launches that record them."""

    rows: np.ndarray
    sched_n: np.ndarray
    nc: np.ndarray
    draft: np.ndarray
    prev_col: np.ndarray
    curr: np.ndarray
    acc: np.ndarray  # this step's accepted counts
    differs: np.ndarray | None  # correct accepted counts where they differ from the consumed


class RunnerV1:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.B = cfg.mamba_block_size
        self.k = cfg.k
        self.max_rows = cfg.max_num_seqs
        self.rows = InputRows(cfg.max_num_seqs, clear_vacated=not cfg.has(BUG_STALE_ROW))
        self.req = PerRequest(
            state_idx=(np.int64, 0),  # mamba_state_idx
            has_state=(bool, False),
            true_nc=(np.int64, 0),  # runner's corrected num_computed
            true_acc=(np.int32, 1),  # normalised accepted count of its last step
            prev_row=(np.int64, -1),  # prev_req_id_to_index
            last_seen=(np.int64, -10),
            pos=(np.int64, -1),  # position in this step's SchedulerOutput
            row=(np.int64, -1),  # InputBatch row while in the batch
        )
        self._last_idx = np.zeros(0, np.int64)
        # 0..n-1 as slices of one array each (a slice costs less than an arange per step);
        # the int32 one is recorded, so it is read-only
        self._positions = np.arange(cfg.max_num_seqs)
        self._rows32 = np.arange(cfg.max_num_seqs, dtype=np.int32)
        self._rows32.flags.writeable = False
        self._race = cfg.has(BUG_ASYNC_RACE)
        self._reorder_bug = cfg.has(BUG_REORDER)
        self._stale_bug = cfg.has(BUG_STALE_ROW)
        self.pending: np.ndarray | None = None  # the in-flight device-to-host copy
        self._kept: dict[str, list[int]] = {}  # block rows of requests out of the batch
        self.builder_thresholds: dict[str, int | None] = {
            cfg.builder_name: cfg.mamba_threshold,
            "attention(TRITON_ATTN)": None,
        }
        if cfg.has(BUG_REORDER):
            # the drafter's attention picked FlashInfer, which asks for threshold 1
            self.builder_thresholds["drafter_attention(FLASHINFER)"] = 1
        else:
            self.builder_thresholds["drafter_attention(TRITON_ATTN)"] = None
        values = [t for t in self.builder_thresholds.values() if t is not None]
        self.reorder_threshold = min(values) if values else None

    # ------------------------------------------------------------------ one step
    def execute(
        self,
        so: SchedOut,
        accepted: np.ndarray,
        landed_early: bool,
        live_owner: Callable[[], dict[int, str]],
    ) -> StepResult:
        cfg = self.cfg
        step = so.step
        B = self.B
        race = self._race
        ib = self.rows
        pr = self.req
        kinds = so.kind
        # new and resumed rows; only a new row can bring a request number not seen before
        fresh = (kinds != KIND_CACHED).nonzero()[0]
        if len(fresh):
            pr.ensure(int(so.idx[fresh].max()) + 1)
        ib.begin_step()
        m = len(so)
        n_prev = ib.num_reqs
        # where each request sits in this step's SchedulerOutput (-1: not scheduled)
        pr.pos[self._last_idx] = -1
        pr.pos[so.idx] = self._positions[:m]
        self._last_idx = so.idx
        # without drafts vLLM copies no accepted counts back: nothing can be in flight
        has_pending = self.pending is not None and cfg.async_scheduling and self.k > 0
        landed = bool(landed_early) if has_pending else True
        if race and has_pending and landed:
            ib.acc[:n_prev] = self.pending

        # _update_states: finished, preempted, unscheduled and resumed rows leave
        live_pos = pr.pos[ib.key[:n_prev]]
        leave = live_pos < 0
        if len(fresh) and np.count_nonzero(kinds[fresh] == KIND_RESUMED):
            leave[~leave] = kinds[live_pos[~leave]] == KIND_RESUMED
        for row in leave.nonzero()[0].tolist():
            req = ib.row_req[row]
            self._kept[req] = ib.bt[row]
            pr.row[ib.key[row]] = -1
            ib.remove(req)
        for r in (*so.finished, *so.preempted):
            self._kept.pop(r.req_id, None)
            pr.has_state[r.idx] = False
        if len(fresh):
            fi = so.idx[fresh]
            pr.has_state[fi] = False
            pr.true_nc[fi] = so.num_computed[fresh]
            pr.last_seen[fi] = -10
        at = pr.row[so.idx]
        # Rows not in the batch, in the order the runner adds them: new requests first,
        # then the cached ones (running, then resumed), as _update_states collects them.
        joining = sorted((at < 0).nonzero()[0].tolist(), key=lambda p: kinds[p] != KIND_NEW)
        if joining:
            inb = at >= 0
            ib.nc[at[inb]] = so.num_computed[inb]
        else:
            ib.nc[at] = so.num_computed
        for p, new_ids in so.new_block_ids.items():
            if at[p] >= 0:
                ib.append_blocks(so.id_at(p), new_ids)
        for p in joining:
            rid = so.id_at(p)
            kept = self._kept.pop(rid, [])
            new_ids = so.ids_at(p)
            # a request back after a step out of the batch keeps the runner's block row
            row_ids = kept + new_ids if kinds[p] == KIND_CACHED else new_ids
            prompt_len = so.req_at(p).prompt_len
            ib.add(rid, int(so.num_computed[p]), prompt_len, row_ids, key=int(so.idx[p]))
        ib.condense()
        n = ib.num_reqs

        # _may_reorder_batch at the runner's threshold
        T_run = self.reorder_threshold
        perm = pr.pos[ib.key[:n]]
        sched_n = so.num_scheduled[perm]
        if T_run is None or not n:
            run_region = np.zeros(n, np.int8)
        else:
            run_region = regions(sched_n, ib.nc[:n], ib.prompt[:n], T_run)
            swaps = reorder_swaps(run_region)
            for a, b in swaps:
                ib.swap(a, b)
            if swaps:
                # the swaps sort the regions, stably: the reordered batch's regions are sorted
                run_region.sort()
                perm = pr.pos[ib.key[:n]]
                sched_n = so.num_scheduled[perm]
        rows64 = self._positions[:n]
        pr.row[ib.key[:n]] = rows64
        if race and has_pending and not landed:
            ib.acc[:n_prev] = self.pending

        ridx = so.idx[perm]
        nc_sched = ib.nc[:n]  # views: the rows do not change for the rest of the step
        nc = pr.true_nc[ridx]
        prompt = ib.prompt[:n]
        draft = so.num_draft[perm]
        samples = so.samples[perm]

        # _prepare_inputs: accepted counts through the previous step's row positions
        seen = pr.last_seen[ridx] == step - 1
        correct = pr.true_acc[ridx]  # int32, a fancy-indexed copy
        if np.count_nonzero(seen) < n:  # most steps: every row ran in the previous one
            correct[~seen] = 1
        if race and has_pending:
            prev_pos = np.where(seen, pr.prev_row[ridx], -1)
            consumed = np.where(seen, ib.acc[np.maximum(prev_pos, 0)], 1).astype(np.int32)
        else:
            consumed = correct
        ib.acc[:n] = consumed

        # preprocess_mamba: advance the running column, copy the state forward
        prev_col = pr.state_idx[ridx]  # a fancy-indexed copy
        has_state = pr.has_state[ridx]
        if np.count_nonzero(has_state) < n:  # new and resumed rows: none recorded yet
            seed = ~has_state
            prev_col[seed] = (nc[seed] - 1) // B  # seed_cols
        end = nc + sched_n  # tokens covered after the step, drafts included
        curr = (end - 1) // B  # running_cols(nc, sched_n, B)
        precopy = (prev_col != -1) & (prev_col != curr)
        pr.state_idx[ridx] = curr
        pr.has_state[ridx] = True
        ib.acc[:n][precopy] = 1

        # the Mamba builder's split, on the reordered batch
        if n and T_run == self.cfg.mamba_threshold:
            # the same rule on the same rows, now reordered: the sorted runner regions
            region = run_region
        else:
            region = regions(sched_n, nc_sched, prompt, self.cfg.mamba_threshold)
        if T_run is None:
            run_region = region
        prefilling = nc < prompt
        split = builder_split(cfg.mixer, sched_n, nc, prompt, draft, self.k, prefilling)

        # sampling and the align post-process
        acc_now = accepted[perm]
        # truly computed after acceptance: the tokens covered by the running state (end -
        # draft) plus the accepted drafts
        computed = end - draft + acc_now - 1
        # copy_boundary's decision with destination column curr: computed // B - 1 == curr; the
        # copy is then needed as well, since (curr + 1) * B >= end >= end - draft
        normalised = acc_now.astype(np.int32)
        normalised[computed // B == curr + 1] = 1
        self.pending = normalised
        pr.true_acc[ridx] = normalised
        if np.count_nonzero(samples) == n:  # every row sampled: all rejected drafts count
            pr.true_nc[ridx] = computed
        else:
            pr.true_nc[ridx] = end - np.where(samples, draft + 1 - acc_now, 0)
        pr.prev_row[ridx] = rows64
        pr.last_seen[ridx] = step

        events: list[dict[str, Any]] = []
        # the rows' request ids, for the bug events only
        req_ids = ib.req_ids() if self._reorder_bug or (race and has_pending) else []
        if self._reorder_bug:
            # GDN marks its spec decodes wherever they sit: none is ever left out
            bad = (region == REGION_DECODE) & ~split.decode
            for i in bad.nonzero()[0].tolist():
                events.append(
                    {
                        "bug": BUG_REORDER,
                        "step": step,
                        "req_id": req_ids[i],
                        "batch_row": i,
                        "recorded": {
                            "mamba_split": "prefill",
                            "reorder_region": REGION_NAMES[run_region[i]],
                        },
                        "correct": {"mamba_split": "decode", "reorder_region": "decode"},
                    }
                )
        if race and has_pending:
            matters = (consumed != correct) & (precopy | split.decode)
            for i in matters.nonzero()[0].tolist():
                events.append(
                    {
                        "bug": BUG_ASYNC_RACE,
                        "step": step,
                        "req_id": req_ids[i],
                        "batch_row": i,
                        "recorded": {"accepted_prev": int(consumed[i])},
                        "correct": {"accepted_prev": int(correct[i])},
                        "d2h_landed_before_moves": landed,
                    }
                )

        # padded rows of a uniform decode batch gather state indices from rows past the batch
        pad_rows: list[int] = []
        if (
            cfg.cudagraph_padding
            and self.k > 0  # the gather is the align context's, which k = 0 lacks
            and n
            and split.num_decodes == n
            and np.count_nonzero(sched_n == 1 + self.k) == n
        ):
            pad_rows = list(range(n, capture_size(n, self.max_rows)))
        owners: dict[int, str] | None = None
        for row in pad_rows:
            cols = ib.bt[row][: 1 + self.k]
            if not any(cols):
                continue
            owners = owners if owners is not None else live_owner()
            hit = [(b, owners[b]) for b in cols if b and b in owners]
            if hit and self._stale_bug:
                for b, owner in hit:
                    events.append(
                        {
                            "bug": BUG_STALE_ROW,
                            "step": step,
                            "req_id": owner,
                            "batch_row": row,
                            "block_id": b,
                            "stale_from": ib.stale.get(row),
                            "recorded": {"state_indices": cols},
                            "correct": {"state_indices": [0] * (1 + self.k)},
                        }
                    )

        # the recorded int32 columns, built once and shared by the tables and launches that
        # record them (never mutated afterwards)
        cols = _Cols(
            rows=self._rows32[:n],
            sched_n=sched_n.astype(np.int32),
            nc=nc.astype(np.int32),
            draft=draft.astype(np.int32),
            prev_col=prev_col.astype(np.int32),
            curr=curr.astype(np.int32),
            acc=acc_now.astype(np.int32),
            differs=None if consumed is correct else sparse(correct, consumed != correct),
        )
        tables = self._tables(
            step,
            n,
            ridx,
            so.names,
            cols,
            prompt,
            consumed,
            samples,
            prefilling,
            run_region,
            split,
            landed,
            has_pending,
            so.total_tokens,
        )
        launches = self._launches(step, n, cols, consumed, pad_rows)
        return StepResult(tables=tables, launches=launches, events=events)

    # ------------------------------------------------------------------ recording
    def _tables(
        self,
        step: int,
        n: int,
        ridx: np.ndarray,
        names: np.ndarray,
        cols: _Cols,
        prompt: np.ndarray,
        consumed: np.ndarray,
        samples: np.ndarray,
        prefilling: np.ndarray,
        run_region: np.ndarray,
        split: BuilderSplit,
        landed: bool,
        has_pending: bool,
        total_tokens: int,
    ) -> dict[str, Any]:
        moves = self.rows.moves
        rows = cols.rows
        split_col = (~split.decode).view(np.int8)  # 1: the builder's prefill split
        batch_rows: dict[str, Any] = {
            "batch_row": rows,
            "req_id": ReqIds(ridx, names),
            "req_slot": rows,
            "num_scheduled": cols.sched_n,
            "num_computed": cols.nc,
            "num_prompt": prompt.astype(np.int32),
            "num_draft": cols.draft,
            "accepted_prev": consumed,
            # at k = 0 no post-process reports accepted counts (the recorder has none)
            "accepted": where_valid(cols.acc, samples) if self.k else None,
            "prev_state_col": cols.prev_col,
            "state_col": cols.curr,
            "is_prefilling": prefilling,
            # categorical columns as int8 codes into their categories: the writer's cheap form
            "reorder_region": run_region,
            "mamba_split": split_col,
        }
        if cols.differs is not None:
            batch_rows["accepted_prev_cpu"] = cols.differs
        if self.cfg.prefill_checkpoints:
            batch_rows.update(
                checkpoint_columns(
                    cols.nc,
                    cols.sched_n,
                    split_col.view(bool),
                    self.cfg.mamba_block_size,
                    self.cfg.k > 0,
                )
            )
        tables: dict[str, Any] = {
            "steps": {
                "num_reqs": n,
                "num_scheduled_tokens": int(total_tokens),
                "reorder_threshold": self.reorder_threshold,
                "mamba_threshold": split.threshold,
                "num_mamba_decodes": split.num_decodes,
                "postprocess_step": step if n and self.k else None,
                "accepted_landed": landed if has_pending else None,
            },
            "batch_rows": batch_rows,
        }
        if moves:
            tables["row_moves"] = row_moves_table(moves, landed if has_pending else None)
        if self.rows.dirty:
            dirty = sorted(self.rows.dirty)
            tables["block_tables"] = {
                "group": 0,
                "table": "v1",
                "row": np.asarray(dirty, np.int32),
                "block_ids": [self.rows.bt[r] for r in dirty],
            }
        return tables

    def _launches(
        self,
        step: int,
        n: int,
        cols: _Cols,
        consumed: np.ndarray,
        pad_rows: list[int],
    ) -> list[dict[str, Any]]:
        if n == 0:
            return []
        rows = cols.rows
        common = {
            "batch_row": rows,
            "batch_step": step,
            "req_slot": rows,
            "row_rule": "req_slot",
            "bt_row": rows,
            "bt_table": "v1",
            "bt_step": step,
        }
        pre = dict(
            common,
            kernel="precopy",
            num_accepted=consumed,
            state_idx=cols.curr,
            src_col=cols.prev_col,
            token_bias=consumed - 1,  # int32, as consumed
        )
        if cols.differs is not None:
            pre["num_accepted_cpu"] = cols.differs
        post = dict(
            common,
            kernel="postprocess",
            mode="decision",
            num_accepted=cols.acc,
            state_idx=cols.curr,
            num_scheduled=cols.sched_n,
            num_computed=cols.nc,
            num_draft=cols.draft,
        )
        if self.k == 0:
            # vLLM builds no align context without drafts: preprocess_mamba copies each state
            # itself (the recorder writes those copies as this precopy) and nothing runs after
            return [pre]
        out = [pre, post]
        if pad_rows:
            pr = np.asarray(pad_rows, np.int32)
            out.append(
                {
                    "kernel": "aligned_indices",
                    "batch_row": pr,
                    "batch_step": step,
                    "req_slot": -1,
                    "row_rule": "req_slot",
                    "bt_row": pr,
                    "bt_table": "v1",
                    "bt_step": step,
                    "seq_len": 1,
                }
            )
        return out
