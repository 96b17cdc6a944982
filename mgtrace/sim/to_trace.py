"""How a simulated run becomes a trace: run metadata, scheduler rows, request rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from mgtrace import __version__
from mgtrace.schemas.manifest import RunMetadata, StateLayout
from mgtrace.schemas.tables import SCHED_KINDS
from mgtrace.sim.columns import GroupIds, ReqIds
from mgtrace.sim.config import BUG_BATCH_ROW, SimConfig
from mgtrace.sim.runner_common import Nullable
from mgtrace.sim.scheduler import KIND_CACHED, KIND_NAMES, Request, SchedOut

CONV_DIM = 64  # a small state page, enough for a replayer to move tags around
HEADS, HEAD_DIM, STATE = 4, 8, 16


def run_metadata(
    cfg: SimConfig, builder_thresholds: dict[str, int | None], runner_threshold: int | None
) -> RunMetadata:
    row_rule = "batch_row" if cfg.has(BUG_BATCH_ROW) else "req_slot"
    states = [
        StateLayout(
            group=0,
            layer=0,
            kind="conv",
            shape=[3 + cfg.k, CONV_DIM],
            dtype="bfloat16",
            conv_layout="SD",
        ),
        StateLayout(
            group=0, layer=0, kind="temporal", shape=[HEADS, HEAD_DIM, STATE], dtype="float32"
        ),
    ]
    return RunMetadata(
        runner=cfg.runner,
        vllm_version=None,
        model=f"sim/hybrid-{cfg.mixer}-mtp",
        num_speculative_tokens=cfg.k,
        mamba_block_size=cfg.mamba_block_size,
        mamba_cache_mode="align",
        async_scheduling=cfg.async_scheduling and (cfg.pp == 1 or cfg.async_pipeline),
        tp_size=1,
        pp_size=cfg.pp,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_blocks=cfg.pool_blocks,
        num_mamba_groups=1,
        runner_reorder_threshold=runner_threshold,
        builder_reorder_thresholds=dict(builder_thresholds),
        row_rule=row_rule,
        prefill_checkpoint_blocks=int(cfg.prefill_checkpoints),
        prefill_checkpoints_recorded=cfg.prefill_checkpoints,
        states=states,
    )


def source_info(cfg: SimConfig, argv: list[str] | None) -> dict[str, Any]:
    return {
        "kind": "sim",
        "mgtrace_version": __version__,
        "command": argv,
        "config": {
            "scenario": cfg.scenario,
            "steps": cfg.steps,
            "runner": cfg.runner,
            "mixer": cfg.mixer,
            "k": cfg.k,
            "pp": cfg.pp,
            "seed": cfg.seed,
            "bugs": list(cfg.bugs),
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "mamba_block_size": cfg.mamba_block_size,
            "num_blocks": cfg.pool_blocks,
            "async_scheduling": cfg.async_scheduling,
            "acceptance_rate": cfg.acceptance_rate,
            "prefix_hit_prob": cfg.prefix_hit_prob,
            "d2h_early_prob": cfg.d2h_early_prob,
            "length_scale": cfg.length_scale,
            "cudagraph_padding": cfg.cudagraph_padding,
            "prefill_checkpoints": cfg.prefill_checkpoints,
        },
        "notes": (
            "Padded rows of a CUDA-graph uniform decode batch are recorded as aligned_indices "
            "launches with req_slot -1 and seq_len 1: the state indices such a row gathers "
            "from its block-table row are where the dummy decode writes."
        ),
    }


# the scheduler's kind numbers as codes into the sched table's categories (the writer's cheap
# form for a categorical column), and the codes of the rows of requests that left
_KIND_CODES = np.array([SCHED_KINDS.index(k) for k in KIND_NAMES], np.int8)
# the scheduler's numbers are the codes themselves (its int8 array is then recorded as is)
_KINDS_ARE_CODES = _KIND_CODES.tolist() == list(range(len(KIND_NAMES)))
_FINISHED, _PREEMPTED = SCHED_KINDS.index("finished"), SCHED_KINDS.index("preempted")


def sched_rows(so: SchedOut) -> list[dict[str, Any]]:
    """The step's SchedulerOutput as chunks of ``sched`` rows: the scheduled requests, then
    the finished and preempted ones (whose count columns are null, as the writer records a
    column a chunk does not give)."""
    chunks: list[dict[str, Any]] = []
    m = len(so)
    if m:
        rows: dict[str, Any] = {
            "req_id": ReqIds(so.idx, so.names),
            "kind": so.kind if _KINDS_ARE_CODES else _KIND_CODES[so.kind],
            "num_scheduled": so.num_scheduled.astype(np.int32),
            "num_computed": so.num_computed.astype(np.int32),
            "num_spec": so.num_draft.astype(np.int32),
            "new_block_ids": GroupIds(m, so.new_block_ids),
        }
        # the prompt length of new and resumed rows, null for cached ones
        fresh = so.kind != KIND_CACHED
        if np.count_nonzero(fresh):
            data = np.zeros(m, np.int32)
            data[fresh] = [so.req_at(p).prompt_len for p in fresh.nonzero()[0].tolist()]
            rows["num_prompt"] = Nullable(data, ~fresh)
        chunks.append(rows)
    n_fin, n_pre = len(so.finished), len(so.preempted)
    if n_fin or n_pre:
        kinds = np.empty(n_fin + n_pre, np.int8)
        kinds[:n_fin] = _FINISHED
        kinds[n_fin:] = _PREEMPTED
        chunks.append(
            {
                "req_id": ReqIds(
                    np.array([r.idx for r in (*so.finished, *so.preempted)], np.int64),
                    so.names,
                ),
                "kind": kinds,
            }
        )
    return chunks


def request_rows(reqs: list[Request]) -> dict[str, Any]:
    return {
        "req_id": [r.req_id for r in reqs],
        "arrival_s": np.array([r.arrival.arrival_s for r in reqs], np.float64),
        "first_step": [r.first_step if r.first_step >= 0 else None for r in reqs],
        "last_step": [r.last_step if r.last_step >= 0 else None for r in reqs],
        "prompt_len": np.array([r.prompt_len for r in reqs], np.int32),
        "output_len": np.array([r.num_output for r in reqs], np.int32),
        "prefix_hit_tokens": np.array([r.prefix_hit_tokens for r in reqs], np.int32),
        "finish_reason": [r.finish_reason for r in reqs],
        "client_id": [r.arrival.client_id for r in reqs],
    }
