"""Loading one rank of a long trace for a replay: seconds and memory, each load in a fresh
process (as a replay's worker loads it).

A simulated steady trace (96 sequences, reorder-threshold-mismatch) is made once unless
``--trace`` names one; then each repeat starts a Python process that builds the replayer's
``RankTrace`` of rank 0 and reports the seconds it took, the process's peak resident memory,
and the resident memory it keeps once loaded (what a replay then holds through its run).

    python benchmarks/bench_trace_load.py [--steps 20000] [--trace DIR] [--repeat 5] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import command_line, emit

# Run in the child: the import of mgtrace is not timed, the load is.
CHILD = r"""
import json, resource, sys, time
from mgtrace.pandas_probe import skip_pandas_probe
skip_pandas_probe()
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader

def resident_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20

start = time.perf_counter()
trace = RankTrace(TraceReader(sys.argv[1]), 0, RequestIds())
seconds = time.perf_counter() - start
print(json.dumps({
    "load_s": seconds,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "kept_rss_mb": resident_mb(),
    "steps": len(trace),
}))
"""


def _simulate(steps: int, out: Path) -> None:
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    simulate(
        SimConfig(
            scenario="steady",
            steps=steps,
            max_num_seqs=96,
            seed=0,
            bugs=("reorder-threshold-mismatch",),
            output=out,
        ).validate()
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--trace", type=Path, help="A trace to load instead of a simulated one.")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mgtrace-bench-load-") as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "trace"
            _simulate(args.steps, trace)
        runs = []
        for _ in range(args.repeat):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(trace)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(done.stdout.splitlines()[-1]))
    result = {
        "benchmark": "one rank of a trace loaded for a replay, in a fresh process each time",
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "trace": str(args.trace) if args.trace else f"simulated steady, {args.steps} steps",
        "steps": runs[0]["steps"],
        "load_runs": [{k: round(v, 3) for k, v in r.items()} for r in runs],
        "median": {
            key: round(statistics.median(r[key] for r in runs), 3)
            for key in ("load_s", "peak_rss_mb", "kept_rss_mb")
        },
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
