"""Where the simulator's time goes, per step, pinned to one core as ``bench_sim.py`` runs it:
the engine, the trace buffer (chunks added, joined every 64 steps), the writer thread's
conversion to Arrow and its Parquet encoding; and the engine alone, without a trace.

Each part is timed with the CPU clock of the thread that runs it (the engine loop and the
writer share the core, so their sum is about the wall time).

    python benchmarks/profile_sim.py [--steps 3000] [--repeat 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from results_io import command_line, emit

import mgtrace.schemas.writer as writer_module
import mgtrace.sim.engine as engine_module
import mgtrace.sim.trace_buffer as buffer_module
from mgtrace.pandas_probe import skip_pandas_probe

PARTS: tuple[tuple[Any, str, str], ...] = (
    (engine_module.Engine, "step", "engine_step"),
    (engine_module, "sched_rows", "sched_rows"),
    (buffer_module.StepBuffer, "add", "buffer_add"),
    (buffer_module.StepBuffer, "flush", "buffer_joins"),
    (writer_module._Pending, "to_table", "writer_to_arrow"),
    (pq, "write_table", "parquet_encoding"),
)


def _timed(fn: Callable[..., Any], key: str, spent: dict[str, float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.thread_time() - start

    return timed


def _config(steps: int, output: Path | None) -> engine_module.SimConfig:
    return engine_module.SimConfig(
        scenario="steady", steps=steps, runner="v1", k=3, max_num_seqs=96, seed=0,
        output=output, overwrite=True,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip_pandas_probe()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    spent: dict[str, float] = {}
    for owner, name, key in PARTS:
        setattr(owner, name, _timed(getattr(owner, name), key, spent))
    n = args.steps
    runs = []
    with tempfile.TemporaryDirectory(prefix="mgtrace-profile-sim-") as tmp:
        for i in range(args.repeat):
            spent.clear()
            start = time.perf_counter()
            engine_module.simulate(_config(n, Path(tmp) / f"t{i}"))
            run = {"wall_with_trace_us": (time.perf_counter() - start) / n * 1e6}
            run.update({f"{k}_us": v / n * 1e6 for k, v in spent.items()})
            spent.clear()
            start = time.perf_counter()
            engine_module.run_engine(_config(n, None), lambda step, view: None)
            run["wall_engine_alone_us"] = (time.perf_counter() - start) / n * 1e6
            runs.append({k: round(v, 1) for k, v in run.items()})
    result = {
        "benchmark": "simulator time per step by part (steady, 96 sequences, k=3, V1)",
        "command": command_line(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, pinned to one",
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "median": {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]},
        "runs": runs,
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
