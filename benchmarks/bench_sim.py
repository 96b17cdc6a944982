"""Simulated engine steps per second, trace writing included, pinned to one CPU core.

    python benchmarks/bench_sim.py [--steps N] [--scenario steady] [--runner v1] [--repeat 3]
                                   [--out FILE | --no-save]

Prints one JSON object and writes it to FILE (default benchmarks/results/sim.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mgtrace import __version__
from mgtrace.pandas_probe import skip_pandas_probe
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim import SimConfig, simulate
from mgtrace.sim.engine import run_engine

RESULTS = Path(__file__).resolve().parent / "results" / "sim.json"
TARGET_STEPS_PER_S = 5000


def _config(args: argparse.Namespace, output: Path | None) -> SimConfig:
    return SimConfig(
        scenario=args.scenario,
        steps=args.steps,
        runner=args.runner,
        pp=args.pp,
        k=args.k,
        seed=args.seed,
        bugs=tuple(args.bug),
        max_num_seqs=args.max_num_seqs,
        output=output,
        overwrite=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--scenario", default="steady")
    ap.add_argument("--runner", default="v1")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bug", action="append", default=[])
    ap.add_argument("--max-num-seqs", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS, help="Where to write the result.")
    ap.add_argument("--no-save", action="store_true", help="Print only; write no file.")
    args = ap.parse_args()
    skip_pandas_probe()  # as `mgtrace simulate` does: the run is timed, not a pandas import
    load = os.getloadavg()[0]  # other work on this machine skews the numbers; say how much
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})  # the engine loop and the writer thread share a core

    engine_only, with_trace = [], []
    rows = size = 0
    tmp = Path(tempfile.mkdtemp(prefix="mgtrace-bench-"))
    try:
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            run_engine(_config(args, None), lambda step, view: None)
            engine_only.append(args.steps / (time.perf_counter() - t0))
            out = tmp / "trace"
            t0 = time.perf_counter()
            manifest = simulate(_config(args, out))
            with_trace.append(args.steps / (time.perf_counter() - t0))
            assert manifest.complete and manifest.drops.total_steps == 0
            reader = TraceReader(out)
            rows = sum(reader.rows(t) for t in ("batch_rows", "launches", "sched"))
            size = reader.size_on_disk()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "sim_steps_per_second",
        "command": " ".join(["python", "benchmarks/bench_sim.py", *sys.argv[1:]]),
        "config": {
            "scenario": args.scenario,
            "steps": args.steps,
            "runner": args.runner,
            "pp": args.pp,
            "k": args.k,
            "seed": args.seed,
            "bugs": args.bug,
            "max_num_seqs": args.max_num_seqs,
        },
        "cores": 1,
        "repeat": args.repeat,
        "steps_per_s_with_trace": round(statistics.median(with_trace), 1),
        "steps_per_s_engine_only": round(statistics.median(engine_only), 1),
        "all_with_trace": [round(x, 1) for x in with_trace],
        "all_engine_only": [round(x, 1) for x in engine_only],
        "rows_per_step": round(rows / args.steps, 1),
        "trace_bytes": size,
        "target_steps_per_s": TARGET_STEPS_PER_S,
        "meets_target": statistics.median(with_trace) >= TARGET_STEPS_PER_S,
        "mgtrace_version": __version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, pinned to one",
        "load_avg_1m_at_start": round(load, 2),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if not args.no_save:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
