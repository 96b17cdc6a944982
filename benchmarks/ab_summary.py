"""One result from the runs of ``ab_trees.sh``: per measure, every run's value on each
tree, their medians and the new tree's median over the base tree's.

    python benchmarks/ab_summary.py OUT_DIR --base COMMIT --new COMMIT --ab-command "..."
                                    [--out FILE]

Measures read from each run's JSON: ``bench_replay.py``'s loop and end-to-end steps/s and
load seconds of every repeat; ``bench_trace_load.py``'s load seconds and peak and kept
resident memory of every load; ``bench_replay_jobs.py``'s wall seconds per job count;
``bench_sim.py``'s steps/s of every repeat, with the trace and without; ``bench_capture.py``'s
µs per launch capture by method and per hook body; ``recorder_floor.py``'s
µs a step each configuration adds and mgtrace's over the floor's; ``bench_recorder.py``'s
engine-thread CPU and wall µs a step the recorder adds, its wall over the JSON logger's, and
the 99th percentile and the longest of a recorded run's steps, per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from results_io import command_line, emit

HIGHER_IS_BETTER = ("steps_per_s",)


def _measures(run: dict[str, Any]) -> dict[str, list[float]]:
    """The values one run of a benchmark reports, by measure."""
    if "replay_runs" in run:
        reps = run["replay_runs"]
        return {
            "loop_steps_per_s": [r["loop_steps_per_s"] for r in reps],
            "end_to_end_steps_per_s": [r["end_to_end_steps_per_s"] for r in reps],
            "load_s": [r["load_s"] for r in reps],
        }
    if "load_runs" in run:
        keys = ("load_s", "peak_rss_mb", "kept_rss_mb")
        return {k: [r[k] for r in run["load_runs"]] for k in keys}
    if "runs" in run and "trace" in run:
        return {f"jobs_{j}_wall_s": r["wall_s"] for j, r in run["runs"].items()}
    if "all_with_trace" in run:
        return {
            "with_trace_steps_per_s": run["all_with_trace"],
            "engine_only_steps_per_s": run["all_engine_only"],
        }
    if "mgtrace_over_floor" in run:
        added = {f"{k}_added_us": [v] for k, v in run["added_us_per_step"].items()}
        return {**added, "mgtrace_over_floor": [run["mgtrace_over_floor"]]}
    if "capture_us_per_launch" in run:
        out = {f"capture_{k}_us": [v] for k, v in run["capture_us_per_launch"].items()}
        out.update({f"hook {k}_us": [v] for k, v in run["hook_body_us_per_step"].items()})
        v2 = run.get("v2_hook_body_us_per_step", {})
        out.update({f"v2 hook {k}_us": [v] for k, v in v2.items()})
        return out
    if "scenarios" in run:
        out: dict[str, list[float]] = {}
        for name, sc in run["scenarios"].items():
            o = sc["overhead_us_per_step"]
            out[f"{name}_engine_thread_cpu_added_us"] = [o["recorder_engine_thread_cpu"]]
            out[f"{name}_wall_added_us"] = [o["recorder_wall"]]
            out[f"{name}_wall_over_json_logger"] = [sc["recorder_vs_json_wall"]]
            hooked = sc["step_wall_percentiles_us"]["hooked"]
            out[f"{name}_hooked_step_p99_us"] = [hooked["p99"]]
            out[f"{name}_hooked_step_max_us"] = [hooked["max"]]
        return out
    raise SystemExit(
        "not a result of bench_replay.py, bench_trace_load.py, bench_replay_jobs.py, "
        "bench_sim.py, recorder_floor.py, bench_recorder.py or bench_capture.py"
    )


def summarize(directory: Path) -> dict[str, Any]:
    values: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    for side in values:
        files = sorted(directory.glob(f"{side}_*.json"))
        if not files:
            raise SystemExit(f"no {side}_*.json in {directory}")
        for path in files:
            for name, got in _measures(json.loads(path.read_text())).items():
                values[side].setdefault(name, []).extend(got)
    out: dict[str, Any] = {}
    for name in values["base"]:
        base = statistics.median(values["base"][name])
        new = statistics.median(values["new"][name])
        out[name] = {
            "base": [round(v, 3) for v in values["base"][name]],
            "new": [round(v, 3) for v in values["new"][name]],
            "base_median": round(base, 3),
            "new_median": round(new, 3),
            "new_over_base_median": round(new / base, 3) if base else None,
            "better": "higher" if name.endswith(HIGHER_IS_BETTER) else "lower",
        }
    return out


def _runs_machine(directory: Path) -> dict[str, Any] | None:
    """The ``machine`` a benchmark's run recorded, if it did."""
    first = sorted(directory.glob("base_*.json"))
    return json.loads(first[0].read_text()).get("machine") if first else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--base", required=True, help="The base tree's commit.")
    ap.add_argument("--new", required=True, help="The new tree's commit.")
    ap.add_argument("--ab-command", required=True, help="The ab_trees.sh command that ran.")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {
        "benchmark": "A/B of two trees, runs interleaved on one machine",
        "command": args.ab_command,
        "summarized_by": command_line(),
        "base": args.base,
        "new": args.new,
        # where the runs ran, as the first of them says (the summary may be made elsewhere)
        "machine": _runs_machine(args.directory)
        or {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "measures": summarize(args.directory),
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
