"""TraceWriter cost for 96-row steps, against a JSON-lines logger of the same fields.

Measures, in one run:
- caller cost: host time per ``write_step`` call on the caller's thread, and per step of the
  baseline that ``json.dumps`` the same fields to a file (the ad-hoc probe approach);
- sustained throughput: steps/s from the first call until ``close()`` has flushed everything,
  with the process pinned to one core;
- bytes on disk per (step, row).

Usage: python benchmarks/bench_writer.py [--steps N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from results_io import command_line, emit

from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.tables import MAMBA_SPLITS as SPLIT_NAMES
from mgtrace.schemas.tables import REORDER_REGIONS as REGION_NAMES
from mgtrace.schemas.writer import TraceWriter

ROWS = 96


def make_steps(n: int, seed: int = 0) -> list[dict]:
    """Realistic per-step payloads: every batch_rows column plus the steps row."""
    rng = np.random.default_rng(seed)
    req_ids = [f"cmpl-{i:08x}-0" for i in range(4 * ROWS)]
    out = []
    for s in range(n):
        base = (s // 40) % (3 * ROWS)
        scheduled = rng.choice(np.array([4, 4, 4, 512], np.int32), ROWS)
        computed = rng.integers(0, 60000, ROWS).astype(np.int32)
        region_idx = np.where(scheduled <= 4, 0, 2)
        out.append(
            {
                "steps": {
                    "wall_ns": s * 3_000_000,
                    "num_reqs": ROWS,
                    "num_scheduled_tokens": int(scheduled.sum()),
                    "reorder_threshold": 4,
                    "mamba_threshold": 4,
                    "num_mamba_decodes": int((scheduled <= 4).sum()),
                    "postprocess_step": s,
                },
                "batch_rows": {
                    "batch_row": np.arange(ROWS, dtype=np.int32),
                    "req_id": req_ids[base : base + ROWS],
                    "req_slot": rng.permutation(ROWS).astype(np.int32),
                    "num_scheduled": scheduled,
                    "num_computed": computed,
                    "num_prompt": np.full(ROWS, 24000, np.int32),
                    "num_draft": np.where(scheduled == 4, 3, 0).astype(np.int32),
                    "accepted_prev": rng.integers(1, 5, ROWS).astype(np.int32),
                    "accepted": rng.integers(1, 5, ROWS).astype(np.int32),
                    "prev_state_col": (computed // 1152).astype(np.int32),
                    "state_col": ((computed + scheduled) // 1152).astype(np.int32),
                    "is_prefilling": scheduled > 4,
                    # categorical columns as codes, the way a hot-path producer writes them
                    "reorder_region": region_idx.astype(np.int8),
                    "mamba_split": (scheduled > 4).astype(np.int8),
                },
            }
        )
    return out


def _jsonable(tables: dict) -> dict:
    """The probe's way: plain lists, categorical columns spelled out as strings."""
    out = {}
    for t, cols in tables.items():
        row = {}
        for k, v in cols.items():
            if k == "reorder_region":
                v = [REGION_NAMES[c] for c in v.tolist()]
            elif k == "mamba_split":
                v = [SPLIT_NAMES[c] for c in v.tolist()]
            row[k] = v.tolist() if isinstance(v, np.ndarray) else v
        out[t] = row
    return out


def bench_json_baseline(steps: list[dict], path: Path) -> float:
    with open(path, "w") as fh:
        t0 = time.perf_counter()
        for s, tables in enumerate(steps):
            fh.write(json.dumps({"step": s, **_jsonable(tables)}) + "\n")
        t1 = time.perf_counter()
    return (t1 - t0) / len(steps)


def bench_writer(steps: list[dict], path: Path) -> dict:
    writer = TraceWriter(path, run=RunMetadata(), max_queue_steps=len(steps) + 1)
    call_times = np.empty(len(steps))
    t0 = time.perf_counter()
    for s, tables in enumerate(steps):
        c0 = time.perf_counter()
        writer.write_step(0, s, tables)
        call_times[s] = time.perf_counter() - c0
    t_calls = time.perf_counter()
    manifest = writer.close()
    t_done = time.perf_counter()
    assert manifest.drops.steps == 0, "the benchmark queue must not drop"
    parquet_bytes = sum(p.bytes for p in manifest.parts)
    return {
        "caller_us_per_step_mean": float(call_times.mean() * 1e6),
        "caller_us_per_step_p50": float(np.percentile(call_times, 50) * 1e6),
        "caller_us_per_step_p99": float(np.percentile(call_times, 99) * 1e6),
        "calls_wall_s": t_calls - t0,
        "sustained_steps_per_s": len(steps) / (t_done - t0),
        "bytes_per_step_row": parquet_bytes / (len(steps) * ROWS),
        "parquet_bytes": parquet_bytes,
        "parts": len(manifest.parts),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    steps = make_steps(args.steps)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            json_s = bench_json_baseline(steps, Path(tmp) / f"probe{r}.jsonl")
            w = bench_writer(steps, Path(tmp) / f"trace{r}")
            w["json_baseline_us_per_step"] = json_s * 1e6
            w["caller_cost_ratio_vs_json"] = w["caller_us_per_step_mean"] / (json_s * 1e6)
            runs.append(w)
    best = min(runs, key=lambda r: r["caller_cost_ratio_vs_json"])
    med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    result = {
        "benchmark": "trace writer, 96-row steps",
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor(),
            "cores_used": 1,
        },
        "steps": args.steps,
        "rows_per_step": ROWS,
        "median_of_runs": med,
        "best_run": best,
        "targets": {
            "caller_cost_ratio_vs_json": "<= 0.1",
            "sustained_steps_per_s": ">= 20000",
            "bytes_per_step_row": "<= 64",
        },
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
