"""Replay wall time in segments on several processes against one process, same run.

A long simulated trace (96 sequences) is replayed end to end, as ``mgtrace replay --jobs N``
does it (trace loading, worker start-up and the merge included), for each N given; runs are
interleaved over the repeats, and every run's findings must equal the one-process run's.
Reported per N: median wall seconds, steps/s, the speed-up over N=1 from the same run, and
how many checks met a placeholder and were judged in the parent, where the slowest
worker's time went (loading the trace, the bookkeeping pass, the warm-up, its segment), where
the parent's went (loading the trace, starting the workers, waiting for them, building the
checker of their logged reads, merging) and what the run spent outside all that.

With ``--backend triton --device cuda`` every process runs the Triton kernels on a device
copy of its tag pool, in its own context on the GPU.

Usage: python benchmarks/bench_replay_jobs.py [--steps N] [--scenario steady|mixed|pairs]
                                              [--bug NAME] [--jobs 1 2 4 ...] [--repeat R]
                                              [--backend reference|triton] [--device D]
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

from mgtrace.replayer import parallel
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate


def _phases(outcomes: list) -> dict:
    """Of the segmented runs: checks judged in the parent, the slowest worker's seconds per
    phase and the merge's (medians over runs)."""
    if not outcomes:
        return {}
    slowest = {}
    for phase in ("load", "skip", "warmup", "segment"):
        # a trace too short to split runs in one process and has no workers
        per_run = [
            max((w.get(phase, 0.0) for w in o.worker_seconds), default=0.0) for o in outcomes
        ]
        slowest[phase] = round(statistics.median(per_run), 2)
    parent = {
        phase: round(statistics.median(o.parent_seconds.get(phase, 0.0) for o in outcomes), 2)
        for phase in ("load", "start", "wait", "checker", "merge")
    }
    return {
        "checks_judged_in_parent": statistics.median(o.checked_here for o in outcomes),
        "slowest_worker_s": slowest,
        "merge_s": round(statistics.median(o.merge_s for o in outcomes), 2),
        "parent_s": parent,
    }


def _outside(walls: list[float], outcomes: list) -> dict:
    """The median of what a run spent outside the segmented replay of its rank (opening the
    trace, finding its steps, the mid-run check, the summary)."""
    if len(outcomes) != len(walls):  # one process: no segments
        return {}
    spent = [w - sum(o.parent_seconds.values()) for w, o in zip(walls, outcomes, strict=True)]
    return {"outside_segmented_replay_s": round(statistics.median(spent), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--scenario", default="steady")
    ap.add_argument("--bug", default=None)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--backend", default="reference", choices=("reference", "triton"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    jobs = sorted(set([1, *args.jobs]))
    outcomes: dict[int, list] = {j: [] for j in jobs}
    original = parallel.replay_rank_in_segments

    def observed(*a, **k):  # what each segmented replay reports of itself
        outcome = original(*a, **k)
        outcomes[current[0]].append(outcome)
        return outcome

    current = [1]
    parallel.replay_rank_in_segments = observed
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace"
        t0 = time.perf_counter()
        simulate(
            SimConfig(
                scenario=args.scenario,
                steps=args.steps,
                seed=0,
                max_num_seqs=96,
                bugs=(args.bug,) if args.bug else (),
                output=trace,
            ).validate()
        )
        sim_s = time.perf_counter() - t0
        walls: dict[int, list[float]] = {j: [] for j in jobs}
        reference = None
        for _ in range(args.repeat):
            for j in jobs:
                current[0] = j
                t0 = time.perf_counter()
                result = replay_trace(
                    TraceReader(trace), RuleSet(), backend=args.backend, device=args.device, jobs=j
                )
                walls[j].append(time.perf_counter() - t0)
                summary = (result.findings, result.repeats, result.steps)
                if reference is None:
                    reference = summary
                elif summary != reference:
                    raise SystemExit(f"--jobs {j} found something else than --jobs 1")
    one = statistics.median(walls[1])
    runs = {
        str(j): {
            "wall_s": [round(w, 2) for w in walls[j]],
            "median_wall_s": round(statistics.median(walls[j]), 2),
            "steps_per_s": round(args.steps / statistics.median(walls[j]), 1),
            "speedup_over_one_process": round(one / statistics.median(walls[j]), 2),
            **_phases(outcomes[j]),
            **_outside(walls[j], outcomes[j]),
        }
        for j in jobs
    }
    result = {
        "benchmark": "replay end to end in segments on N processes, against one process",
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "cpus": len(os.sched_getaffinity(0)),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        },
        "trace": {
            "scenario": args.scenario,
            "bug": args.bug,
            "steps": args.steps,
            "max_num_seqs": 96,
            "simulated_in_s": round(sim_s, 1),
            "findings": len(reference[0]),
        },
        "backend": args.backend,
        "device": args.device,
        "identical_findings_in_every_run": True,
        "runs": runs,
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
