"""Where the recorder's engine-thread time goes: per capture method, and per hook.

Part 1 times one launch capture (the align launch's int32 input vectors, copied so that
the trace holds what the kernel read) by method, on the engine thread, against doing
nothing: the capture ring as shipped (also with V2's inputs, a new int64 ``idx_mapping``
first each time), and the alternatives it was chosen over (the previous device-to-host
copy on the engine thread, a ``clone`` per vector, one ``_foreach_copy_``).

Part 2 runs ``bench_recorder``'s 96-row V1 stand-in step, then the V2 one
(``standin_v2.py``), with the real hooks installed and times each hook's own body (the
``before``/``after`` functions, not the engine code they wrap), with the recorder thread
forwarding nothing, so that only engine-thread work is counted (wall time: nothing else
runs meanwhile). A timing wrapper adds about 0.1 µs to each body.

Usage: python benchmarks/bench_capture.py [--device cpu|cuda] [--steps N] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import functools
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_recorder as stand_in
from results_io import command_line, emit
from standin_v2 import build_runner_v2

from mgtrace.recorder import hooks_common, hooks_v1, hooks_v2
from mgtrace.recorder.capture import CaptureRing
from mgtrace.recorder.patches import PatchSet
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata

VECTORS = 5  # a post-process launch's inputs
LENGTH = 128  # max_num_reqs: whole vectors fit a slot
ROWS = 96


def _median_us(fn: Any, calls: int, repeats: int = 5) -> float:
    """Median over runs of the per-call thread CPU time: the engine thread's own cost."""
    fn()
    runs = []
    for _ in range(repeats):
        t = time.thread_time_ns()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time_ns() - t) / calls / 1e3)
    return float(np.median(runs))


def _ring_grab_us(
    device: torch.device, groups: Sequence[Sequence[Any]], lengths: Sequence[int], calls: int
) -> float:
    """Median over runs of the engine thread's CPU time per ``CaptureRing.grab`` of the
    tensor groups in turn; the reaping (the recorder thread's work) happens between timed
    batches, outside the timing."""
    runs = []
    lengths = tuple(lengths)
    for _ in range(5):
        ring = CaptureRing(device, slots=64)
        spent = done = 0
        while done < calls:
            batch = [groups[(done + j) % len(groups)] for j in range(min(48, calls - done))]
            t = time.thread_time_ns()
            for tensors in batch:
                ring.grab(tensors, lengths, None)
            spent += time.thread_time_ns() - t
            done += len(batch)
            while ring.pending:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # untimed: frees the slots for the next batch
                ring.reap_raw()
        if ring.dropped:
            raise RuntimeError("the ring dropped a capture: the timing would be wrong")
        runs.append(spent / calls / 1e3)
    return float(np.median(runs))


def _v2_groups(device: torch.device, calls: int) -> list[tuple[Any, ...]]:
    """V2's launch captures: each step's new int64 ``idx_mapping`` first, then the same
    three slot-indexed int32 vectors."""
    slots = [torch.full((LENGTH,), v, dtype=torch.int32, device=device) for v in (2, 7, 100)]
    order = torch.arange(ROWS, dtype=torch.int64).flip(0)
    return [(order.to(device, copy=True), *slots) for _ in range(min(calls, 1024))]


def capture_methods(device: torch.device, calls: int) -> dict[str, float]:
    tensors = [torch.arange(LENGTH, dtype=torch.int32, device=device) + i for i in range(VECTORS)]
    lengths = [ROWS] * VECTORS
    out: dict[str, float] = {"nothing": _median_us(lambda: None, calls)}

    out["ring_grab"] = _ring_grab_us(device, [tensors], lengths, calls)
    # V2: a new first tensor every capture, the same others
    out["ring_grab_v2_new_idx_mapping"] = _ring_grab_us(
        device, _v2_groups(device, calls), [ROWS, LENGTH, LENGTH, LENGTH], calls
    )
    if device.type != "cuda":
        return out

    staging = torch.empty(VECTORS * LENGTH, dtype=torch.int32, device=device)
    host = torch.empty(VECTORS * LENGTH, dtype=torch.int32, pin_memory=True)
    make = getattr(torch, "Event", None)
    event = make(device=device) if make is not None else torch.cuda.Event()

    def cat_copy_event() -> None:  # the previous engine-thread path
        torch.cat(tensors, out=staging)
        host.copy_(staging, non_blocking=True)
        event.record()

    def cat_event() -> None:  # the shipped engine-thread path (the copy is the reaper's)
        torch.cat(tensors, out=staging)
        event.record()

    views = list(staging.split(LENGTH))

    def foreach_event() -> None:
        torch._foreach_copy_(views, tensors)
        event.record()

    def clones_event() -> None:
        [t.clone() for t in tensors]
        event.record()

    out["cat_copy_event"] = _median_us(cat_copy_event, calls)
    out["cat_event"] = _median_us(cat_event, calls)
    out["foreach_copy_event"] = _median_us(foreach_event, calls)
    out["clone_each_event"] = _median_us(clones_event, calls)
    out["event_only"] = _median_us(event.record, calls)
    torch.cuda.synchronize()
    return out


def per_hook(device: torch.device, steps: int, runner_kind: str = "v1") -> dict[str, float]:
    """Each hook body's µs a step on the V1 stand-in step, or on the V2 one
    (``standin_v2.py``)."""
    spent: collections.Counter[str] = collections.Counter()
    clock = time.perf_counter_ns  # the thread CPU clock is a system call: it would dominate

    def timed(name: str, body: Any) -> Any:
        if body is None:
            return None

        def run(*args: Any) -> Any:
            t = clock()
            try:
                return body(*args)
            finally:
                spent[name] += clock() - t

        return run

    real_hook = hooks_common.hook

    def timing_hook(
        sess: Any, name: str, before: Any = None, after: Any = None, *, required: bool = True
    ) -> Any:
        return real_hook(
            sess,
            name,
            timed(name + " (before)", before),
            timed(name + " (after)", after),
            required=required,
        )

    v2 = runner_kind == "v2"
    hooks, make_patches = (hooks_v2, hooks_v2.v2_patches) if v2 else (hooks_v1, hooks_v1.v1_patches)
    runner, owners = build_runner_v2(device) if v2 else stand_in.build_runner(device)
    cls = type(runner)
    so = stand_in.scheduler_output()
    out = torch.zeros((ROWS, 1 + stand_in.K), dtype=torch.int64, device=device)
    # what ends a step: V2's sample_tokens; the V1 stand-in's post-step update
    end_step = (
        functools.partial(cls.sample_tokens, runner, out)
        if v2
        else functools.partial(runner._update_states_after_model_execute, out, so)
    )
    with tempfile.TemporaryDirectory(prefix="mgtrace-bench-") as tmp:
        sess = Session(
            Path(tmp) / "t", rank=0, kind=runner_kind, run=RunMetadata(), assembler="thread"
        )

        def forward_nothing() -> bool:  # engine-thread work only: records are discarded
            sess._records.clear()
            if sess.ring is not None:
                sess.ring.reap_raw()
            return False

        sess._drain = forward_nothing  # type: ignore[method-assign]
        patches = PatchSet()
        hooks_common.hook, hooks.hook = timing_hook, timing_hook  # type: ignore[assignment]
        try:
            patches.install(make_patches(sess, owners, [0]))
        finally:
            hooks_common.hook, hooks.hook = real_hook, real_hook  # type: ignore[assignment]
        for i in range(steps + 200):
            if i == 200:
                spent.clear()
            cls.execute_model(runner, so)
            end_step()
        patches.remove()
        sess.close()
    table = {k: v / steps / 1e3 for k, v in spent.most_common()}
    table["all hooks"] = sum(table.values())
    return table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    device = torch.device(a.device)
    report = {
        "benchmark": "engine-thread µs per launch capture, by method; per hook body, per step",
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        },
        "capture_us_per_launch": capture_methods(device, a.calls),
        "hook_body_us_per_step": per_hook(device, a.steps),
        "v2_hook_body_us_per_step": per_hook(device, a.steps, "v2"),
    }
    emit(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
