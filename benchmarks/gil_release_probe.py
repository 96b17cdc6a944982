"""Which of the calls the recorder makes give up the GIL, and what that costs the caller when
another thread wants it.

A call that releases the GIL lets a waiting thread run; getting the GIL back then takes that
thread's next release, at worst a whole switch interval (5 ms by default). The recorder's two
threads both make such calls: the engine thread (a launch hook's ``torch.cat`` and event
record) and the recorder thread (event queries, device-to-host copies, pipe writes). Each op
below runs ``--calls`` times in a row, alone and then beside a thread that spins in pure
Python, and the wall time per call is reported for both (the median over five batches of
the calls). A call that keeps the GIL costs about the same beside the spinner (the spinner
only runs at forced switches); a call that releases it costs up to a switch interval more.

Controls: ``time.sleep(0)`` releases the GIL and ``sum(range(8))`` does not; the probe is
only read when the first shows the jump and the second does not.

    python benchmarks/gil_release_probe.py [--device cpu|cuda] [--calls 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from results_io import command_line, emit

Op = Callable[[], object]


def _spinning() -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    time.sleep(0.02)  # running, and asking for the GIL
    return stop, thread


def _per_call_us(op: Op, calls: int, batches: int = 5) -> float:
    """The median over ``batches`` of the mean wall time per call in a batch: a forced
    switch to the spinner (one per switch interval) lands in one batch, not in all."""
    op()  # warm
    means = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls // batches or 1):
            op()
        means.append((time.perf_counter() - start) / (calls // batches or 1) * 1e6)
    return statistics.median(means)


def probe(op: Op, calls: int) -> dict[str, float]:
    alone = _per_call_us(op, calls)
    stop, thread = _spinning()
    try:
        beside = _per_call_us(op, calls)
    finally:
        stop.set()
        thread.join()
    return {
        "alone_us": round(alone, 2),
        "beside_spinner_us": round(beside, 2),
        "ratio": round(beside / alone, 1),
    }


def cpu_ops() -> dict[str, Op]:
    vec = np.arange(96, dtype=np.int32)
    rows = [(i, vec, {"step": i}) for i in range(64)]
    read, write = os.pipe()

    def pipe_write() -> None:
        os.write(write, b"x" * 256)
        os.read(read, 4096)  # the 256 bytes just written: never waits

    return {
        "control_sleep0_releases": lambda: time.sleep(0),
        "control_pure_python_keeps": lambda: sum(range(8)),
        "numpy_tobytes": vec.tobytes,
        "pickle_64_records": lambda: pickle.dumps(rows, protocol=5),
        "pipe_write_and_read": pipe_write,
    }


def cuda_ops(device: torch.device) -> dict[str, Op]:
    parts = [torch.arange(96, dtype=torch.int32, device=device) for _ in range(5)]
    staging = torch.empty((4, 1024), dtype=torch.int32, device=device)
    host = torch.empty((4, 1024), dtype=torch.int32, pin_memory=True)
    row = staging[0, : 5 * 96]
    event = torch.Event(device=device)
    cuda_event = torch.cuda.Event()
    copy_stream = torch.cuda.Stream(device=device)
    event.record()
    cuda_event.record()
    torch.cuda.synchronize()

    def d2h_on_copy_stream() -> None:
        with torch.cuda.stream(copy_stream):
            host[0].copy_(staging[0], non_blocking=True)

    return {
        "torch_cat_out": lambda: torch.cat(parts, out=row),
        "torch_Event_record": event.record,
        "torch_Event_query_done": event.query,
        "torch_cuda_Event_record": cuda_event.record,
        "torch_cuda_Event_query_done": cuda_event.query,
        "stream_wait_event": lambda: copy_stream.wait_event(cuda_event),
        "d2h_copy_on_copy_stream": d2h_on_copy_stream,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ops = cpu_ops()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device here", file=sys.stderr)
            return 2
        ops |= cuda_ops(torch.device("cuda"))
    results = {name: probe(op, args.calls) for name, op in ops.items()}
    if args.device == "cuda":
        torch.cuda.synchronize()
    controls_hold = (
        results["control_sleep0_releases"]["ratio"] >= 10
        and results["control_pure_python_keeps"]["ratio"] < 3
    )
    emit(
        {
            "command": command_line(),
            "machine": platform.processor() or platform.machine(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "switch_interval_s": sys.getswitchinterval(),
            "calls": args.calls,
            "controls_hold": controls_hold,
            "per_op": results,
        },
        args.out,
    )
    return 0 if controls_hold else 1


if __name__ == "__main__":
    raise SystemExit(main())
