"""Every benchmark script runs to the end on a tiny configuration and emits its JSON result.

Nothing here is timed: the numbers are the benchmarks' business. This only keeps the scripts
working as the code under them changes (a stand-in that lacks a newly hooked target, a
renamed argument), so a committed result can always be produced again by its command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# script, tiny arguments, a key its result must carry
CASES = [
    ("bench_sim.py", ["--steps", "60", "--repeat", "1"], "steps_per_s_with_trace"),
    ("bench_writer.py", ["--steps", "200", "--repeats", "1"], "command"),
    ("bench_capture.py", ["--device", "cpu", "--calls", "50", "--steps", "50"], "command"),
    (
        "bench_kernels.py",
        ["--part", "cpu", "--launches", "20", "--repeat", "1"],
        "command",
    ),
    (
        "bench_replay.py",
        ["--steps", "120", "--repeat", "1", "--no-bisect"],
        "replay_best",
    ),
    (
        "bench_replay_jobs.py",
        ["--steps", "300", "--jobs", "1", "2", "--repeat", "1"],
        "command",
    ),
    ("bench_trace_load.py", ["--steps", "60", "--repeat", "1"], "median"),
    ("bench_rebuilt_rows.py", ["--steps", "120", "--repeat", "1"], "median"),
    ("bench_in_flight_tokens.py", ["--steps", "60", "--repeat", "1"], "results"),
    (
        "bench_recorder.py",
        ["--device", "cpu", "--steps", "40", "--repeats", "1"],
        "scenarios",
    ),
    (
        "bench_recorder.py",
        ["--device", "cpu", "--steps", "40", "--repeats", "1", "--builder", "gdn"],
        "scenarios",
    ),
    (
        "recorder_floor.py",
        ["--device", "cpu", "--rounds", "2", "--steps", "5"],
        "added_us_per_step",
    ),
    # exits 1 unless its controls hold: sleep(0) gives the GIL away, pure Python keeps it
    ("gil_release_probe.py", ["--calls", "50"], "per_op"),
    ("profile_replay.py", ["--steps", "60", "--top", "5"], None),
    ("profile_sim.py", ["--steps", "60", "--repeat", "1"], "median"),
]


def _run_benchmark(tmp_path: Path, script: str, args: list[str], out: Path) -> None:
    """Run a benchmark script with ``--out out`` from ``tmp_path``; it must exit 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent), str(BENCHMARKS)])}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_v2_stand_in_step_is_recorded_whole(tmp_path: Path) -> None:
    """``bench_recorder.py --runner v2`` times the V2 hooks on a step they record in full:
    every step, its 96 batch rows, no hook error. Control: the V1 step's result says V1."""
    out = tmp_path / "v2.json"
    args = ["--device", "cpu", "--steps", "40", "--repeats", "1", "--runner", "v2"]
    _run_benchmark(tmp_path, "bench_recorder.py", args, out)
    result = json.loads(out.read_text())
    assert result["runner"] == "v2" and "96-row V2 step" in result["benchmark"]
    for scenario in result["scenarios"].values():
        got = scenario["recorded_last_run"]
        assert got["hook_errors"] == 0 and got["recorded_steps"] > 0
        # the sink's row count: 96 batch rows a step
        assert got["rows"] >= 96 * got["recorded_steps"]
        assert "json_post_only" not in scenario["median_us_per_step"]
    out = tmp_path / "v1.json"
    _run_benchmark(tmp_path, "bench_recorder.py", args[:-2], out)
    assert json.loads(out.read_text())["runner"] == "v1"


def test_recorder_floor_times_the_same_hooks_in_both_configurations(tmp_path: Path) -> None:
    """``recorder_floor.py --per-hook`` times every hook body of both hook sets, under the
    names of the functions they wrap. Control: timing wrappers that never reach the
    counters report nothing (an all-zero table)."""
    out = tmp_path / "floor.json"
    args = ["--device", "cpu", "--rounds", "2", "--steps", "5", "--per-hook"]
    _run_benchmark(tmp_path, "recorder_floor.py", args, out)
    result = json.loads(out.read_text())
    table = result["hook_body_us_per_step"]
    floor, ours, parked = table["floor"], table["mgtrace"], table["mgtrace_parked"]
    for name in ("run_fused_precopy (before)", "_update_states (after)", "build (after)"):
        assert floor[name] > 0 and ours[name] > 0 and parked[name] > 0, name
    assert floor["all hooks"] > 0 and ours["all hooks"] > 0
    # the parked recorder thread left the queue to the blocks' ends: nothing was dropped
    assert result["mgtrace_drops"] == 0 and result["mgtrace_hook_errors"] == 0
    assert "mgtrace_parked" in result["added_us_per_step"]


@pytest.mark.parametrize(
    ("script", "args", "key"), CASES, ids=[f"{c[0]}{'-gdn' * ('gdn' in c[1])}" for c in CASES]
)
def test_benchmark_runs(tmp_path: Path, script: str, args: list[str], key: str | None) -> None:
    out = tmp_path / "result.json"
    _run_benchmark(tmp_path, script, args, out)
    assert out.exists() and out.stat().st_size > 0
    if key is not None:  # profile_replay writes a text profile, the others JSON
        assert key in json.loads(out.read_text())


def test_ab_of_two_trees_is_summarized(tmp_path: Path) -> None:
    """``ab_trees.sh`` runs a benchmark on two trees in turn (here this tree twice) and
    ``ab_summary.py`` makes one result of the runs, with the ratio of the medians."""
    root = BENCHMARKS.parent
    runs = tmp_path / "runs"
    ab = [
        "bash",
        str(BENCHMARKS / "ab_trees.sh"),
        str(root),
        str(root),
        str(runs),
        "1",
        "--",
        sys.executable,
        "benchmarks/bench_replay.py",
        "--steps",
        "120",
        "--repeat",
        "1",
        "--no-bisect",
    ]
    proc = subprocess.run(ab, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in runs.iterdir()) == ["base_1.json", "new_1.json"]
    out = tmp_path / "ab.json"
    summary = [
        sys.executable,
        str(BENCHMARKS / "ab_summary.py"),
        str(runs),
        "--base",
        "x",
        "--new",
        "x",
        "--ab-command",
        " ".join(ab),
        "--out",
        str(out),
    ]
    proc = subprocess.run(summary, capture_output=True, text=True, timeout=120, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loop = json.loads(out.read_text())["measures"]["loop_steps_per_s"]
    assert len(loop["base"]) == len(loop["new"]) == 1
    assert loop["new_over_base_median"] == round(loop["new_median"] / loop["base_median"], 3)
    # control: a directory without the runs is refused
    proc = subprocess.run(
        [*summary[:2], str(tmp_path), *summary[3:-2]], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "no base_*.json" in proc.stderr


def test_cli_jobs_script_compares_the_summaries(tmp_path: Path) -> None:
    """``replay_cli_jobs.sh`` times the CLI both ways and says whether the summaries agree;
    control: a summary that differs is said to."""
    from mgtrace.sim import SimConfig, simulate

    trace = tmp_path / "trace"
    simulate(SimConfig(steps=40, seed=2, output=trace).validate())
    script = [
        "bash",
        str(BENCHMARKS / "replay_cli_jobs.sh"),
        str(trace),
        "1",
    ]
    env = {**os.environ, "PY": sys.executable}
    proc = subprocess.run(
        script, capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("round")] == [
        "jobs=default",
        "jobs=1",
    ]
    assert all("rc=0" in line for line in lines if line.startswith("round"))
    assert lines[-1] == "summaries equal"
    # control: a replay under another rule (a wrapper adds it to the --jobs 1 run) differs
    wrapper = tmp_path / "py"
    wrapper.write_text(
        f'#!/bin/bash\nif [[ " $* " == *" --jobs 1"* ]]; then set -- "$@" '
        f'--reorder-threshold=1; fi\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    proc = subprocess.run(
        script,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS.parent,
        env={**env, "PY": str(wrapper)},
    )
    assert proc.stdout.splitlines()[-1] == "SUMMARIES DIFFER", proc.stdout + proc.stderr[-2000:]


def test_ab_of_a_command_on_two_trees(tmp_path: Path) -> None:
    """``ab_cli.sh`` times one command on two trees (here this tree twice) in turn and
    prints the medians; control: a command that fails (exit 3, no such trace) stops it,
    nothing timed."""
    root = BENCHMARKS.parent
    script = ["bash", str(BENCHMARKS / "ab_cli.sh"), str(root), str(root), "2", "--"]
    env = {**os.environ, "PY": sys.executable}
    proc = subprocess.run(
        [*script, "info", "--help"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["base", "new"] * 2
    assert lines[-1].startswith("median wall s: base ") and "new/base" in lines[-1]
    proc = subprocess.run(
        [*script, "info", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 3 and "the base run exited 3" in proc.stderr
    assert "median" not in proc.stdout


@pytest.mark.parametrize(
    ("script", "args", "measure"),
    [
        ("bench_sim.py", ["--steps", "30", "--repeat", "1"], "with_trace_steps_per_s"),
        ("bench_trace_load.py", ["--steps", "30", "--repeat", "1"], "kept_rss_mb"),
        ("recorder_floor.py", ["--rounds", "1", "--steps", "3"], "mgtrace_over_floor"),
        (
            "bench_capture.py",
            ["--device", "cpu", "--calls", "50", "--steps", "50"],
            "capture_ring_grab_v2_new_idx_mapping_us",
        ),
        (
            "bench_recorder.py",
            ["--device", "cpu", "--steps", "20", "--repeats", "1"],
            "busy_host_loop_hooked_step_max_us",
        ),
    ],
)
def test_ab_summary_reads_each_benchmark(
    tmp_path: Path, script: str, args: list[str], measure: str
) -> None:
    """``ab_summary.py`` takes the results of the simulator and recorder benchmarks too: a
    real run of each, as base and as new, gives its measure with a ratio."""
    runs = tmp_path / "runs"
    runs.mkdir()
    _run_benchmark(tmp_path, script, args, runs / "base_1.json")
    (runs / "new_1.json").write_text((runs / "base_1.json").read_text())
    out = tmp_path / "ab.json"
    summary = [sys.executable, str(BENCHMARKS / "ab_summary.py"), str(runs)]
    summary += ["--base", "x", "--new", "x", "--ab-command", "-", "--out", str(out)]
    proc = subprocess.run(summary, capture_output=True, text=True, timeout=120, cwd=BENCHMARKS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())["measures"][measure]
    assert got["new_over_base_median"] == 1.0 and len(got["base"]) >= 1
