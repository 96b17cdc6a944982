"""What ``--reorder-threshold=N`` pays on a V1 trace to rebuild the persistent rows, against
the replay it serves, in one process.

A simulated steady trace (96 sequences, V1, k = 3) is made once unless ``--trace`` names
one. Each repeat loads rank 0, times ``RankTrace.persistent_order`` building every step's
rows at threshold 1 (what a replay under ``--reorder-threshold=1`` does once), then replays
the trace under that rule in this process (``jobs=1``), and reports the rebuild's share of
that replay.

    python benchmarks/bench_rebuilt_rows.py [--steps 20000] [--trace DIR] [--repeat 3]
                                            [--out F]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from results_io import command_line, emit

from mgtrace.pandas_probe import skip_pandas_probe
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate

THRESHOLD = 1


def _one(trace: Path) -> dict[str, float]:
    rank = RankTrace(TraceReader(trace), 0, RequestIds())
    last = int(rank.step_numbers[-1])
    start = time.perf_counter()
    if rank.persistent_order(last, THRESHOLD) is None:
        raise SystemExit(f"{trace} has no recorded row moves (a V1 trace is needed)")
    rebuild = time.perf_counter() - start
    start = time.perf_counter()
    result = replay_trace(TraceReader(trace), RuleSet({"reorder_threshold": str(THRESHOLD)}))
    replay = time.perf_counter() - start
    return {
        "rebuild_s": rebuild,
        "replay_under_rule_s": replay,
        "rebuild_share_of_replay": rebuild / replay,
        "rebuild_us_per_step": rebuild / len(rank) * 1e6,
        "findings": len(result.findings),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    skip_pandas_probe()
    with tempfile.TemporaryDirectory(prefix="mgtrace-rebuilt-rows-") as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "steady.trace"
            simulate(SimConfig(scenario="steady", steps=args.steps, seed=3, output=trace))
        runs = [_one(trace) for _ in range(args.repeat)]
    result = {
        "benchmark": "rebuilding V1's persistent rows for --reorder-threshold=1, against the "
        "replay under that rule (one process)",
        "command": command_line(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "steps": args.steps if args.trace is None else None,
        "median": {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]},
        "runs": runs,
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
