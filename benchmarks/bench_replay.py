"""Replay throughput on a 96-sequence simulated trace, and bisect cost against a full replay.

Measures, in one run:
- replay steps/s of the step loop (trace loading timed separately), per backend/device;
- bisect wall time as a ratio of one full replay of the same buggy trace.

Usage: python benchmarks/bench_replay.py [--steps N] [--backend reference|triton]
                                         [--device cpu|cuda] [--layout compact|full] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

from mgtrace.replayer.bisect import bisect
from mgtrace.replayer.loop import RankReplay, load_backend
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate


def make_trace(path: Path, steps: int, bug: str | None, seed: int = 0) -> Path:
    cfg = SimConfig(
        scenario="steady",
        steps=steps,
        seed=seed,
        max_num_seqs=96,
        bugs=(bug,) if bug else (),
        output=path,
        overwrite=True,
    )
    simulate(cfg.validate())
    return path


class TimedBackend:
    """Wraps a backend: time spent in launches (the Triton backend synchronises at its end)
    and the state bytes the copying rows read and write."""

    def __init__(self, run) -> None:
        self.run = run
        self.seconds = 0.0
        self.bytes = 0
        self.launches = 0

    def __call__(self, launch, pool, tables):
        t0 = time.perf_counter()
        result = self.run(launch, pool, tables)
        self.seconds += time.perf_counter() - t0
        self.launches += 1
        per_row = sum(spec.nbytes for spec in pool.specs)
        self.bytes += 2 * per_row * int(result.validation.copies.rows.size)
        return result


def nemotron_like(run, layers: int) -> None:
    """Full-size states: per layer a conv (6, 10240) bf16 and a temporal (128, 64, 128) fp32."""
    from mgtrace.schemas.manifest import StateLayout

    run.states = []
    for layer in range(layers):
        run.states.append(StateLayout(0, layer, "conv", [6, 10240], "bfloat16", "SD"))
        run.states.append(StateLayout(0, layer, "temporal", [128, 64, 128], "float32"))


def time_replay(trace: Path, backend: str, device: str, layout: str, layers: int = 0) -> dict:
    reader = TraceReader(trace)
    t0 = time.perf_counter()
    rt = RankTrace(reader, 0, RequestIds())
    if layers:
        nemotron_like(rt.run, layers)
    t1 = time.perf_counter()
    timed = TimedBackend(load_backend(backend, device))
    rep = RankReplay(rt, RuleSet(), timed, layout, device)
    t2 = time.perf_counter()
    last = rep.run()
    t3 = time.perf_counter()
    rows = reader.rows("batch_rows") / max(1, reader.rows("steps"))
    return {
        "steps": last + 1,
        "rows_per_step": rows,
        "load_s": t1 - t0,
        "setup_s": t2 - t1,
        "loop_s": t3 - t2,
        "loop_steps_per_s": (last + 1) / (t3 - t2),
        "end_to_end_steps_per_s": (last + 1) / (t3 - t0),
        "findings": len(rep.oracle.findings),
        "launches": timed.launches,
        "launch_seconds": timed.seconds,
        "state_bytes_moved": timed.bytes,
        "launch_bandwidth_tb_per_s": timed.bytes / timed.seconds / 1e12 if timed.seconds else 0,
    }


def torch_copy_bandwidth(device: str, nbytes: int = 1 << 31) -> float | None:
    """Device-to-device copy_ bandwidth (read + write) in TB/s, measured here and now."""
    if device != "cuda":
        return None
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 5 / (time.perf_counter() - t0) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layout", default="compact")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--full-layers",
        type=int,
        default=0,
        help="Also replay with full-size Nemotron-like states of this many layers.",
    )
    ap.add_argument("--no-bisect", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        clean = make_trace(Path(tmp) / "clean", args.steps, None)
        runs = [
            time_replay(clean, args.backend, args.device, args.layout) for _ in range(args.repeat)
        ]
        best = max(runs, key=lambda r: r["loop_steps_per_s"])
        full_states = None
        if args.full_layers:
            full_states = time_replay(clean, args.backend, args.device, "full", args.full_layers)
            full_states["layers"] = args.full_layers
            copy_bw = torch_copy_bandwidth(args.device)
            full_states["torch_copy_tb_per_s"] = copy_bw
            if copy_bw:
                full_states["fraction_of_copy_bandwidth"] = (
                    full_states["launch_bandwidth_tb_per_s"] / copy_bw
                )
        bisect_result = None
        if not args.no_bisect:
            buggy = make_trace(Path(tmp) / "buggy", args.steps, "reorder-threshold-mismatch", 1)
            full = time_replay(buggy, args.backend, args.device, args.layout)
            full_s = full["load_s"] + full["setup_s"] + full["loop_s"]
            t0 = time.perf_counter()
            verdict = bisect(buggy, backend=args.backend, device=args.device)
            bisect_s = time.perf_counter() - t0
            bisect_result = {
                "verdict": verdict.sentence(),
                "bisect_wall_s": bisect_s,
                "full_replay_wall_s": full_s,
                "ratio_bisect_over_full_replay": bisect_s / full_s,
                "steps_replayed_by_bisect": verdict.steps_replayed,
            }
    result = {
        "benchmark": "replay throughput and bisect cost",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "machine": {
            "python": platform.python_version(),
            "load_avg": os.getloadavg()[0],
            "cores_used": 1,
        },
        "backend": args.backend,
        "device": args.device,
        "layout": args.layout,
        "replay_best": best,
        "replay_runs": runs,
        "full_size_states": full_states,
        "bisect": bisect_result,
        "targets": {"cpu_reference_steps_per_s": ">= 2000", "bisect_ratio": "<= 0.5"},
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
