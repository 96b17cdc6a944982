"""A small synthetic trace that fills every table: for format tests and benchmarks.

It is not a model of an engine (``mgtrace simulate`` is); it only produces well-formed values
of every column so that round trips, readers and views can be exercised.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.schemas.manifest import Manifest, RunMetadata, StateLayout
from mgtrace.schemas.tables import KERNELS, REORDER_REGIONS
from mgtrace.schemas.writer import TraceWriter

SAMPLE_RUN = RunMetadata(
    runner="v1",
    model="synthetic",
    num_speculative_tokens=3,
    mamba_block_size=16,
    async_scheduling=True,
    max_num_seqs=96,
    num_blocks=1024,
    runner_reorder_threshold=4,
    builder_reorder_thresholds={"mamba2": 4, "flash_attn": None},
    row_rule="req_slot",
    states=[
        StateLayout(
            group=0, layer=0, kind="conv", shape=[6, 8], dtype="bfloat16", conv_layout="SD"
        ),
        StateLayout(group=0, layer=0, kind="temporal", shape=[2, 4, 8], dtype="float32"),
    ],
)


def sample_step(step: int, rows: int, rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    """One step's tables with ``rows`` batch rows and plausible values."""
    r = np.arange(rows, dtype=np.int32)
    req_ids = [f"req-{(step // 50) * rows + i}" for i in range(rows)]
    computed = (rng.integers(0, 4000, rows)).astype(np.int32)
    scheduled = np.where(r < rows * 3 // 4, 4, 512).astype(np.int32)
    accepted = rng.integers(1, 5, rows).astype(np.int32)
    state_col = ((computed + scheduled + 15) // 16 - 1).astype(np.int32)
    regions = [REORDER_REGIONS[0] if s <= 4 else REORDER_REGIONS[2] for s in scheduled]
    n_launch = rows
    return {
        "steps": {
            "wall_ns": step * 2_000_000,
            "num_reqs": rows,
            "num_scheduled_tokens": int(scheduled.sum()),
            "reorder_threshold": 4,
            "mamba_threshold": 4,
            "num_mamba_decodes": int((scheduled <= 4).sum()),
            "postprocess_step": step,
            "accepted_landed": bool(step % 7),
        },
        "batch_rows": {
            "batch_row": r,
            "req_id": req_ids,
            "req_slot": r,
            "num_scheduled": scheduled,
            "num_computed": computed,
            "num_prompt": np.full(rows, 2048, np.int32),
            "num_draft": np.where(scheduled == 4, 3, 0).astype(np.int32),
            "accepted_prev": accepted,
            "accepted_prev_cpu": [None] * rows,
            "accepted": accepted,
            "prev_state_col": state_col - 1,
            "state_col": state_col,
            "is_prefilling": scheduled > 4,
            "reorder_region": regions,
            "mamba_split": ["decode" if s <= 4 else "prefill" for s in scheduled],
        },
        "launches": {
            "kernel": KERNELS[1],
            "batch_row": r[:n_launch],
            "batch_step": step,
            "req_slot": r[:n_launch],
            "row_rule": "req_slot",
            "bt_row": r[:n_launch],
            "bt_table": "v1",
            "bt_step": step,
            "mode": "decision",
            "num_accepted": accepted,
            "state_idx": state_col,
            "num_scheduled": scheduled,
            "num_computed": computed,
            "num_draft": np.where(scheduled == 4, 3, 0).astype(np.int32),
        },
        "block_tables": {
            "group": 0,
            "table": "v1",
            "row": r[:2],
            "block_ids": [[0, 0, int(step % 1000) + 1], []],
        },
        "row_moves": {
            "seq": np.arange(2, dtype=np.int32),
            "op": ["swap", "add"],
            "row_a": np.array([0, rows - 1], np.int32),
            "row_b": [1, None],
            "req_id": [req_ids[0], req_ids[-1]],
            "req_id_b": [req_ids[1], None],
            "accepted_a": np.array([2, 1], np.int32),
            "accepted_b": [3, None],
            "d2h_landed": [True, False],
        },
        "sched": {
            "req_id": req_ids[:3],
            "kind": ["new", "cached", "finished"],
            "num_scheduled": np.array([512, 4, 0], np.int32),
            "num_computed": np.array([0, 100, 200], np.int32),
            "num_spec": np.array([0, 3, 0], np.int32),
            "num_prompt": [2048, None, None],
            "new_block_ids": [[[5, 6, 7, 8]], [[9]], [[]]],
        },
    }


def write_sample_trace(
    path: str | Path, *, steps: int = 200, rows: int = 96, seed: int = 0, overwrite: bool = False
) -> Manifest:
    rng = np.random.default_rng(seed)
    with TraceWriter(path, run=SAMPLE_RUN, source={"kind": "sample"}, overwrite=overwrite) as w:
        for step in range(steps):
            w.write_step(0, step, sample_step(step, rows, rng))
        n_req = (steps // 50 + 1) * rows
        w.write_rows(
            "requests",
            {
                "req_id": [f"req-{i}" for i in range(n_req)],
                "arrival_s": np.arange(n_req, dtype=np.float64) * 0.01,
                "prompt_len": np.full(n_req, 2048, np.int32),
                "output_len": np.full(n_req, 300, np.int32),
                "finish_reason": "stop",
                "corrupt": [i % 97 == 5 for i in range(n_req)],
            },
        )
        w.write_rows(
            "findings",
            {
                "replay_id": "sample",
                "rules": "as-recorded",
                "rank": 0,
                "step": 7,
                "req_id": "req-5",
                "batch_row": 5,
                "kind": "foreign_state",
                "signature": "foreign_state:sample",
                "detail": "synthetic finding for format tests",
            },
        )
    return w.manifest


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "out/sample"
    m = write_sample_trace(out, overwrite=True)
    print(f"wrote {out}: {sum(p.rows for p in m.parts)} rows in {len(m.parts)} parts")
