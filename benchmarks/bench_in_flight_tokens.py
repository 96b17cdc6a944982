"""The tokens still in flight per scheduler row, as loading a rank computes them: the
shifted comparisons of rows sorted by request (``processed_tokens``) against the binary
search per row it keeps for rows out of step order (the baseline), same inputs, same run.

The inputs are those a replay's load hands over, taken from one load of rank 0 of a
simulated steady trace (96 sequences, reorder-threshold-mismatch) unless ``--trace`` names
one; both ways must give the same counts.

    python benchmarks/bench_in_flight_tokens.py [--steps 20000] [--trace DIR] [--repeat 5]
                                                [--out FILE]
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
from typing import Any

import numpy as np
from bench_trace_load import _simulate
from results_io import command_line, emit

from mgtrace.pandas_probe import skip_pandas_probe
from mgtrace.replayer import ownership, steps
from mgtrace.replayer.requests import RequestIds
from mgtrace.schemas.reader import TraceReader


def _load_inputs(trace: Path) -> tuple[Any, ...]:
    """The arguments one load of rank 0 passes to ``processed_tokens``."""
    seen: list[tuple[Any, ...]] = []
    real = steps.processed_tokens

    def keep(*args: Any) -> np.ndarray:
        seen.append(args)
        return real(*args)

    steps.processed_tokens = keep  # type: ignore[assignment]
    try:
        steps.RankTrace(TraceReader(trace), 0, RequestIds())
    finally:
        steps.processed_tokens = real  # type: ignore[assignment]
    return seen[0][:5]


def _by_search(uid: Any, step: Any, kind: Any, scheduled: Any, computed: Any, n: int) -> Any:
    mask = np.isin(kind, [ownership.SCHED_KINDS.index(k) for k in ("new", "cached", "resumed")])
    taken = ownership._in_flight_by_search(uid, step, mask, scheduled, n)
    return computed.astype(np.int64) - taken


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    skip_pandas_probe()
    with tempfile.TemporaryDirectory() as tmp:
        trace = a.trace or Path(tmp) / "trace"
        if a.trace is None:
            _simulate(a.steps, trace)
        inputs = _load_inputs(trace)
    ways = {"shifted": ownership.processed_tokens, "search": _by_search}
    result: dict[str, Any] = {}
    for in_flight in (1, 2):
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        outputs = {}
        for _ in range(a.repeat):  # interleaved: a busy moment lands on both
            for name, fn in ways.items():
                start = time.perf_counter()
                outputs[name] = fn(*inputs, in_flight)
                seconds[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(v) for name, v in seconds.items()}
        result[f"in_flight_{in_flight}"] = {
            "ms": {name: [round(s * 1e3, 1) for s in v] for name, v in seconds.items()},
            "median_ms": {name: round(m * 1e3, 1) for name, m in medians.items()},
            "shifted_over_search": round(medians["shifted"] / medians["search"], 3),
            "same_counts": bool(np.array_equal(outputs["shifted"], outputs["search"])),
        }
    emit(
        {
            "benchmark": "tokens in flight per scheduler row while loading a rank",
            "command": command_line(),
            "machine": {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
            "rows": len(inputs[0]),
            "trace": str(a.trace) if a.trace else f"simulated steady, {a.steps} steps",
            "results": result,
        },
        a.out,
    )
    return 0 if all(r["same_counts"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
