"""Replay throughput on a 96-sequence simulated trace, and bisect cost against a full replay.

Measures, in one run:
- replay steps/s of the step loop (trace loading timed separately), per backend/device;
- bisect wall time as a ratio of one full replay of the same buggy trace.

Usage: python benchmarks/bench_replay.py [--steps N] [--backend reference|triton]
                                         [--device cpu|cuda] [--layout compact|full] [--out F]
                                         [--baseline-sync] [--breakdown] [--full-layers N]
                                         [--tiles N]

It keeps to the lowest core it may use (one core, as the targets say): copies run side by
side each need a core of their own (``taskset -c N``), or they share that one.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from results_io import command_line, emit

from mgtrace.replayer.bisect import bisect
from mgtrace.replayer.loop import RankReplay, load_backend
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate


def make_trace(
    path: Path, steps: int, bug: str | None, seed: int = 0, mixer: str = "mamba2"
) -> Path:
    cfg = SimConfig(
        scenario="steady",
        mixer=mixer,
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
    """Wraps a backend: host time spent in launches (for the streamed backend, the time to
    validate and enqueue; on a mirrored tag pool, the device side only) and the state bytes
    the copying rows read and write."""

    def __init__(self, run) -> None:
        self.run = run
        self.seconds = 0.0
        self.bytes = 0
        self.launches = 0

    def __getattr__(self, name: str):
        if name == "run":
            raise AttributeError(name)
        return getattr(self.run, name)  # verify() and the like, where the backend has them

    def __call__(self, launch, pool, tables, **kwargs):
        t0 = time.perf_counter()
        result = self.run(launch, pool, tables, **kwargs)
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


TILES: int | None = None  # --tiles: programs per temporal state (None: the backend's choice)


def make_backend(backend: str, device: str, sync: bool = False):
    """The replay's backend; ``sync``: the per-launch ``run_triton`` that waits for every
    launch (the baseline the streamed backend is measured against)."""
    if sync:
        from mgtrace.kernels.runtime import load_triton_kernels

        return load_triton_kernels(device).run_triton
    run = load_backend(backend, device)
    if TILES is not None and backend == "triton":
        from mgtrace.kernels.streamed import StreamedTriton

        run = StreamedTriton(tiles=TILES)
    return run


def device_profile(trace: Path, backend: str, layout: str, layers: int = 0) -> dict:
    """Device time by kernel (CUPTI, through torch.profiler) of one warm replay on the GPU:
    per step, and the align kernels' bandwidth (state bytes they move / their time)."""
    from torch.profiler import ProfilerActivity, profile

    rt = RankTrace(TraceReader(trace), 0, RequestIds())
    if layers:
        nemotron_like(rt.run, layers)
    timed = TimedBackend(make_backend(backend, "cuda"))
    rep = RankReplay(rt, RuleSet(), timed, layout, "cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        last = rep.run()
    steps = last + 1
    by_name: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            by_name[event.key] = by_name.get(event.key, 0.0) + us
    align_s = sum(us for name, us in by_name.items() if name.startswith("align_")) / 1e6
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "steps": steps,
        "device_us_per_step_total": sum(by_name.values()) / steps,
        "device_us_per_step_by_name": {name: us / steps for name, us in top},
        "align_kernel_seconds": align_s,
        "state_bytes_moved": timed.bytes,
        "align_kernel_tb_per_s": timed.bytes / align_s / 1e12 if align_s else 0,
    }


def time_replay(
    trace: Path,
    backend: str,
    device: str,
    layout: str,
    layers: int = 0,
    *,
    sync: bool = False,
    mirror: bool | None = None,
) -> dict:
    reader = TraceReader(trace)
    t0 = time.perf_counter()
    rt = RankTrace(reader, 0, RequestIds())
    if layers:
        nemotron_like(rt.run, layers)
    t1 = time.perf_counter()
    timed = TimedBackend(make_backend(backend, device, sync))
    # The baseline checks every read at once, as the replay did before reads were deferred.
    rep = RankReplay(
        rt, RuleSet(), timed, layout, device, defer_reads=False if sync else None, mirror=mirror
    )
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
        "mirrored_tag_pool": rep.mirror,
        "launches": timed.launches,
        "launch_seconds": timed.seconds,
        "launch_seconds_are": "host wall time (validate, enqueue; run_triton: and wait)",
        "state_bytes_moved": timed.bytes,
        "launch_bandwidth_tb_per_s": timed.bytes / timed.seconds / 1e12 if timed.seconds else 0,
    }


def breakdown(trace: Path, backend: str, device: str, layout: str) -> dict:
    """Host wall time per phase of the step loop, in microseconds per step (phases nest:
    ``forward`` includes its reads and tag writes; ``flush`` includes waiting for the
    device), and on a GPU the number of host-device synchronisations per step."""
    reader = TraceReader(trace)
    rt = RankTrace(reader, 0, RequestIds())
    rep = RankReplay(rt, RuleSet(), make_backend(backend, device), layout, device)
    spent: dict[str, float] = {}

    def wrap(obj, attr: str, label: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

        if hasattr(inner, "verify"):
            timed.verify = inner.verify  # the replay's flush still checks the kernels
        setattr(obj, attr, timed)

    wrap(rt, "launches", "build launches (trace -> AlignLaunch)")
    wrap(rep.tables, "apply", "block-table updates")
    wrap(rep.ownership, "apply", "ownership updates")
    wrap(rep, "backend", "validate + launch kernels")
    wrap(rep, "_forward", "forward model (reads, writes, checks)")
    wrap(rep, "_padded_rows", "padded-row writes")
    wrap(rep, "_check_next_state", "next-state reads")
    wrap(rep.oracle, "check_reads", "tag reads (index, gather or enqueue)")
    wrap(rep.oracle, "check_writes", "write checks (ownership, collisions)")
    wrap(rep.pool, "write_temporal", "tag writes: temporal")
    wrap(rep.pool, "write_conv", "tag writes: conv")
    wrap(rep, "flush", "flush (deferred checks, device sync)")
    syncs = 0
    t0 = time.perf_counter()
    if device == "cuda":
        import warnings

        import torch

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                last = rep.run()
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        last = rep.run()
    total = time.perf_counter() - t0
    steps = last + 1
    out = {k: v / steps * 1e6 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    return {
        "steps": steps,
        "us_per_step_total": total / steps * 1e6,
        "us_per_step": out,
        "device_syncs_per_step": syncs / steps if device == "cuda" else None,
        "device": device_profile(trace, backend, layout) if device == "cuda" else None,
        "note": "with timers around each phase (their overhead included), phases nest",
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
    ap.add_argument("--mixer", default="mamba2", help="The simulated model's layers: mamba2 | gdn.")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--full-layers",
        type=int,
        default=0,
        help="Also replay with full-size Nemotron-like states of this many layers.",
    )
    ap.add_argument("--no-bisect", action="store_true")
    ap.add_argument(
        "--baseline-sync",
        action="store_true",
        help="Also replay with run_triton per launch and reads checked at once (the old path).",
    )
    ap.add_argument(
        "--compare-unmirrored",
        action="store_true",
        help="Triton on compact tags: also replay with the tags on the device only (no host "
        "pool), interleaved with the default runs.",
    )
    ap.add_argument("--breakdown", action="store_true", help="Also time the loop's phases.")
    ap.add_argument(
        "--tiles", type=int, help="Triton: programs per temporal state (default: by state size)"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    global TILES
    TILES = args.tiles
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        clean = make_trace(Path(tmp) / "clean", args.steps, None, mixer=args.mixer)
        runs, unmirrored_runs = [], []
        for _ in range(args.repeat):
            runs.append(time_replay(clean, args.backend, args.device, args.layout))
            if args.compare_unmirrored:
                unmirrored_runs.append(
                    time_replay(clean, args.backend, args.device, args.layout, mirror=False)
                )
        best = max(runs, key=lambda r: r["loop_steps_per_s"])
        unmirrored = None
        if unmirrored_runs:
            best_unmirrored = max(unmirrored_runs, key=lambda r: r["loop_steps_per_s"])
            unmirrored = {
                "best": best_unmirrored,
                "runs": unmirrored_runs,
                "speedup_of_best": best["loop_steps_per_s"] / best_unmirrored["loop_steps_per_s"],
                "same_findings": best_unmirrored["findings"] == best["findings"],
            }
        baseline = None
        if args.baseline_sync:
            baseline = time_replay(clean, args.backend, args.device, args.layout, sync=True)
            baseline["speedup_of_best"] = best["loop_steps_per_s"] / baseline["loop_steps_per_s"]
            baseline["same_findings"] = baseline["findings"] == best["findings"]
        phases = (
            breakdown(clean, args.backend, args.device, args.layout) if args.breakdown else None
        )
        full_states = None
        if args.full_layers:
            full_states = time_replay(clean, args.backend, args.device, "full", args.full_layers)
            full_states["layers"] = args.full_layers
            copy_bw = torch_copy_bandwidth(args.device)
            full_states["torch_copy_tb_per_s"] = copy_bw
            if copy_bw:
                # Kernels timed on the device (a second, warm replay under the profiler).
                prof = device_profile(clean, args.backend, "full", args.full_layers)
                full_states["device_profile"] = prof
                full_states["fraction_of_copy_bandwidth"] = prof["align_kernel_tb_per_s"] / copy_bw
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
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "load_avg": os.getloadavg()[0],
            "cores_used": 1,
        },
        "backend": args.backend,
        "device": args.device,
        "layout": args.layout,
        "mixer": args.mixer,
        "tiles": args.tiles,
        "replay_best": best,
        "replay_runs": runs,
        "baseline_sync_path": baseline,
        "unmirrored_tag_pool": unmirrored,
        "breakdown": phases,
        "full_size_states": full_states,
        "bisect": bisect_result,
        "targets": {
            "cpu_reference_steps_per_s": ">= 2000",
            "h200_triton_compact_steps_per_s": ">= 20000",
            "bisect_ratio": "<= 0.5",
        },
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
