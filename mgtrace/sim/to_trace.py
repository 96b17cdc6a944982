"""How a simulated run becomes a trace: run metadata, scheduler rows, request rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from mgtrace import __version__
from mgtrace.schemas.manifest import RunMetadata, StateLayout
from mgtrace.sim.config import BUG_BATCH_ROW, SimConfig
from mgtrace.sim.scheduler import KIND_CACHED, KIND_NAMES, Request, SchedOut

SIM_MODEL = "sim/hybrid-mamba2-mtp"
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
        model=SIM_MODEL,
        num_speculative_tokens=cfg.k,
        mamba_block_size=cfg.mamba_block_size,
        mamba_cache_mode="align",
        async_scheduling=cfg.async_scheduling and cfg.pp == 1,
        tp_size=1,
        pp_size=cfg.pp,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_blocks=cfg.pool_blocks,
        num_mamba_groups=1,
        runner_reorder_threshold=runner_threshold,
        builder_reorder_thresholds=dict(builder_thresholds),
        row_rule=row_rule,
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
        },
        "notes": (
            "Padded rows of a CUDA-graph uniform decode batch are recorded as aligned_indices "
            "launches with req_slot -1 and seq_len 1: the state indices such a row gathers "
            "from its block-table row are where the dummy decode writes."
        ),
    }


_NO_NEW_IDS: list[list[int]] = [[]]


def sched_rows(so: SchedOut) -> dict[str, Any] | None:
    """The step's SchedulerOutput as rows of the ``sched`` table."""
    ended = [(r, "finished") for r in so.finished] + [(r, "preempted") for r in so.preempted]
    m = len(so)
    if not m and not ended:
        return None
    kinds = KIND_NAMES[so.kind].tolist()
    # one shared, never-mutated [[]] for rows that got no blocks: no per-row containers
    new_ids = [_NO_NEW_IDS] * m
    for p, ids in so.new_block_ids.items():
        new_ids[p] = [ids]
    if not ended:
        prompts = [r.prompt_len for r in so.reqs] if (so.kind != KIND_CACHED).any() else None
        return {
            "req_id": so.req_ids,
            "kind": kinds,
            "num_scheduled": so.num_scheduled.astype(np.int32),
            "num_computed": so.num_computed.astype(np.int32),
            "num_spec": so.num_draft.astype(np.int32),
            "num_prompt": None
            if prompts is None
            else [p if k != "cached" else None for p, k in zip(prompts, kinds, strict=True)],
            "new_block_ids": new_ids,
        }
    pad: list[None] = [None] * len(ended)
    return {
        "req_id": so.req_ids + [r.req_id for r, _ in ended],
        "kind": kinds + [k for _, k in ended],
        "num_scheduled": so.num_scheduled.tolist() + pad,
        "num_computed": so.num_computed.tolist() + pad,
        "num_spec": so.num_draft.tolist() + pad,
        "num_prompt": [
            r.prompt_len if k != "cached" else None for r, k in zip(so.reqs, kinds, strict=True)
        ]
        + pad,
        "new_block_ids": new_ids + pad,
    }


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
