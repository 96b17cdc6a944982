"""The least the engine thread can pay to record a step, against what mgtrace's hooks pay.

On the stand-in V1 step of ``bench_recorder.py`` (96 rows), in one process, blocks of steps
rotate between five configurations:

- ``unhooked``: the step alone.
- ``floor``: wrappers on the same functions mgtrace hooks that copy what a trace of the step
  needs, and do nothing else: the batch's request ids, computed and prompt counts, the block
  table, the row moves, the accepted and computed counts and running columns around the
  pre-process, the staged post-process inputs, and each align launch's inputs (on a GPU one
  ``torch.cat`` into a device staging row and one event, the cheapest stream-ordered copy;
  on the CPU one ``tobytes`` per vector) with their CPU-side values. No error handling, no
  step bookkeeping, no limits; the copies are kept in a list that is cleared between blocks,
  outside the timing.
- ``floor_handover``: ``floor``, plus a thread that every 10 ms pickles what the hooks kept,
  all but the scheduler output (less than an in-process thread must do to get a step out of
  the engine's process); its share of the GIL shows in the engine thread's time.
- ``mgtrace``: mgtrace's hooks (``hooks_v1``) on a live session whose recorder thread only
  frees what they queued, so that, like ``floor``, only the engine thread's own work counts.
- ``mgtrace_parked``: ``mgtrace`` with the recorder thread kept from the ring and the queue
  during the block (it still wakes, and does nothing); the engine thread frees what the hooks
  queued between blocks, outside the timing. ``mgtrace - mgtrace_parked`` is what the
  recorder thread's reaping costs the engine thread (its calls into CUDA and the GIL they
  hand back and forth), apart from the hooks' own work.

Reported: the engine thread's CPU time per step, median over the rounds, and what each
configuration adds to ``unhooked``. ``floor`` is a lower bound for any recorder written in
Python that keeps the same fields, not a recorder: ``mgtrace - floor`` is the cost of doing
it safely (never raising into the engine, counting drops, stopping between steps). With
``--per-hook``, also each hook body's own time per step in ``floor`` and in ``mgtrace``
(wall clock around the body, which adds about 0.1 µs to each; blocks alternate between the
two), to show where the gap to the floor is.

Usage: python benchmarks/recorder_floor.py [--device cpu|cuda] [--rounds 40] [--steps 200]
                                           [--per-hook] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import pickle
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_recorder import ROWS, K, build_runner, scheduler_output
from results_io import command_line, emit

from mgtrace.recorder import hooks_common, hooks_v1
from mgtrace.recorder.patches import Patch, PatchSet
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata

TARGET_US = 25.0
# mgtrace's hook names that differ from the function they wrap (the floor's names)
HOOKED_FUNCTION = {
    "reorder": "reorder_batch_to_split_decodes_and_prefills",
    "mamba_split": "_compute_common_metadata",
    "prefill_checkpoints": "build",
}
HANDOVER_S = 0.01  # as the recorder thread's poll


class Floor:
    """The floor hooks' state: the records they keep, and the launch capture's buffers."""

    def __init__(self, device: torch.device, slots: int = 512, slot_elems: int = 1024) -> None:
        self.records: list[list[Any]] = []
        self.rec: list[Any] = []
        self.cuda = device.type == "cuda"
        self.slot = 0
        self.slots = slots
        self.staging = torch.empty((slots, slot_elems), dtype=torch.int32, device=device)
        self.events = [torch.Event(device=device) for _ in range(slots)] if self.cuda else []
        self._rows: dict[tuple[int, int], torch.Tensor] = {}
        self._views: dict[int, np.ndarray] = {}

    def capture(self, tensors: tuple[torch.Tensor, ...], n: int) -> Any:
        """A launch's input vectors: on a GPU whole, into a staging row on the stream, with an
        event; on the CPU the first ``n`` values of each, as bytes."""
        if not self.cuda:
            views = self._views
            out = []
            for t in tensors:
                v = views.get(id(t))
                if v is None:
                    v = views[id(t)] = t.numpy()
                out.append(v[:n].tobytes())
            return out
        i = self.slot
        self.slot = (i + 1) % self.slots
        total = sum(t.shape[0] for t in tensors)
        row = self._rows.get((i, total))
        if row is None:
            row = self._rows[(i, total)] = self.staging[i, :total]
        torch.cat(tensors, out=row)
        self.events[i].record()
        return i

    def hooks(self) -> dict[str, tuple[Callable[..., Any] | None, Callable[..., Any] | None]]:
        """Per hooked function: (before, after)."""

        def opened(a: tuple[Any, ...], k: dict[str, Any]) -> None:
            self.rec = [a[1]]  # the scheduler output, by reference
            self.records.append(self.rec)

        def landed(a: tuple[Any, ...], k: dict[str, Any]) -> None:
            self.rec.append(a[0].num_accepted_tokens_event.query())

        def batch(a: tuple[Any, ...], k: dict[str, Any], r: Any, t: Any = None) -> None:
            ib = a[0].input_batch
            n = len(ib.req_id_to_index)
            bt = ib.block_table[0]
            counts = bt.num_blocks_per_row[:n]
            width = int(counts[counts.argmax()])
            self.rec += (
                ib._req_ids[:n],
                ib.num_computed_tokens_cpu[:n].tobytes(),
                ib.num_prompt_tokens[:n].tobytes(),
                bt.block_table.np[:n, :width].tobytes(),
                counts.tobytes(),
            )

        def threshold(a: tuple[Any, ...], k: dict[str, Any]) -> None:
            self.rec.append(k.get("decode_threshold"))

        def swap(a: tuple[Any, ...], k: dict[str, Any]) -> None:
            ib, i1, i2 = a
            acc = ib.num_accepted_tokens_cpu
            ids = ib._req_ids
            self.rec.append((i1, i2, ids[i1], ids[i2], int(acc[i1]), int(acc[i2])))

        def holes(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
            ib = a[0]
            tail = ib._req_ids[len(ib.req_id_to_index) :]
            return tail.count(None) != len(tail)  # a hole below the last row: rows move

        def nothing(*_: Any) -> None:
            pass

        def pre(a: tuple[Any, ...], k: dict[str, Any]) -> Any:
            ib, state_idx = a[4], a[3]
            n = len(ib._req_ids)
            self.rec += (
                ib.num_accepted_tokens_cpu[:n].tobytes(),
                ib.num_computed_tokens_cpu[:n].tobytes(),
                state_idx.copy(),
            )
            return state_idx

        def pre_after(a: tuple[Any, ...], k: dict[str, Any], r: Any, state_idx: Any) -> None:
            self.rec.append(state_idx.copy())

        def staged(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> None:
            ctx, n = a[0], a[3]
            self.rec += (
                ctx.mamba_state_idx_buf.np[:n].tobytes(),
                ctx.num_scheduled_tokens_buf.np[:n].tobytes(),
                ctx.num_computed_tokens_buf.np[:n].tobytes(),
                ctx.num_draft_tokens_buf.np[:n].tobytes(),
            )

        def precopy(a: tuple[Any, ...], k: dict[str, Any]) -> None:
            ctx, n = a[0], a[1]
            self.rec += (
                self.capture(a[2:5], n),
                ctx.mamba_state_idx_buf.np[:n].tobytes(),
                ctx.precopy_src_col_buf.np[:n].tobytes(),
                ctx.precopy_token_bias_buf.np[:n].tobytes(),
            )

        def postprocess(a: tuple[Any, ...], k: dict[str, Any]) -> None:
            self.rec.append(self.capture(a[2:7], a[1]))

        def split(a: tuple[Any, ...], k: dict[str, Any], r: Any) -> None:
            self.rec.append(int(r.num_decodes))

        return {
            "execute_model": (opened, None),
            "_update_states": (landed, batch),
            "reorder_batch_to_split_decodes_and_prefills": (threshold, None),
            "swap_states": (swap, None),
            "condense": (holes, nothing),
            "add_request": (None, nothing),
            "remove_request": (None, nothing),
            "preprocess_mamba": (pre, pre_after),
            "stage_postprocess_inputs_to_gpu": (None, staged),
            "run_fused_precopy": (precopy, None),
            "run_fused_postprocess": (postprocess, None),
            "_compute_common_metadata": (None, split),
            "build": (None, nothing),
            "sample_tokens": (None, nothing),
        }


def _wrapper(before: Callable[..., Any] | None, after: Callable[..., Any] | None) -> Any:
    """A ``Patch.make``: the plainest wrapper for the pair."""

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        if after is None:

            def wrapper(*a: Any, **k: Any) -> Any:
                before(a, k)  # type: ignore[misc]
                return orig(*a, **k)

        elif before is None:

            def wrapper(*a: Any, **k: Any) -> Any:
                r = orig(*a, **k)
                after(a, k, r)
                return r

        else:

            def wrapper(*a: Any, **k: Any) -> Any:
                t = before(a, k)
                r = orig(*a, **k)
                after(a, k, r, t)
                return r

        return functools.update_wrapper(wrapper, orig)

    return make


class HandOver:
    """A thread that, every ``HANDOVER_S``, takes what the floor hooks kept and pickles it."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.stop = threading.Event()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(HANDOVER_S):
            taken, self.floor.records = self.floor.records, []
            self.bytes += len(pickle.dumps([r[1:] for r in taken], protocol=5))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


PARKED = threading.Event()  # set: the recorder thread leaves the ring and the queue alone
_REAPING = threading.Lock()  # held while the recorder thread reaps: one reaper at a time


def _discard(self: Session) -> bool:
    """The recorder thread's drain, reduced to freeing what the hooks queued."""
    with _REAPING:
        if PARKED.is_set():
            return False
        if self.ring is not None:
            self.ring.reap_raw()
        self._records.clear()
    return False


def _free_all(sess: Session, device: torch.device) -> None:
    """On the engine thread, the recorder thread parked: free everything the hooks queued,
    waiting for the device (every capture's host copy issued, landed and taken)."""
    if sess.ring is not None:
        for _ in range(3):  # issue the host copies, let them land, take them
            if device.type == "cuda":
                torch.cuda.synchronize()
            sess.ring.reap_raw()
    sess._records.clear()


@contextlib.contextmanager
def parked(sess: Session, device: torch.device) -> Iterator[None]:
    """The recorder thread kept from the ring and the queue (set under the reaping lock, so
    no reap of its is under way); the ring and queue are emptied on this thread before and
    after, outside any timing."""
    with _REAPING:
        PARKED.set()
    try:
        _free_all(sess, device)
        yield
        _free_all(sess, device)
    finally:
        PARKED.clear()


def per_hook_bodies(device: torch.device, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Each hook body's time per step (µs, summed over its calls), in ``floor`` and in
    ``mgtrace``: the two hook sets installed in turn on one stand-in runner, timed by a
    wrapper around each ``before`` and ``after``."""
    spent: dict[str, collections.Counter[str]] = {
        "floor": collections.Counter(),
        "mgtrace": collections.Counter(),
        "mgtrace_parked": collections.Counter(),
    }
    label = ["mgtrace"]  # the hook set being built
    clock = time.perf_counter_ns  # the thread CPU clock is a system call: it would dominate

    def timed(config: str, name: str, body: Callable[..., Any] | None) -> Any:
        if body is None:
            return None
        counter = spent[config]

        def run(*args: Any) -> Any:
            t = clock()
            try:
                return body(*args)
            finally:
                counter[name] += clock() - t

        return run

    real_hook, real_execute = hooks_common.hook, hooks_common._execute_hook

    def timing_hook(
        sess: Any, name: str, before: Any = None, after: Any = None, *, required: bool = True
    ) -> Any:
        target = HOOKED_FUNCTION.get(name, name)
        return real_hook(
            sess,
            name,
            timed(label[0], f"{target} (before)", before),
            timed(label[0], f"{target} (after)", after),
            required=required,
        )

    def timing_execute(sess: Any, begin: Any) -> Any:
        return real_execute(sess, timed(label[0], "execute_model (before)", begin))

    runner, owners = build_runner(device)
    so = scheduler_output()
    out = torch.zeros((ROWS, 1 + K), dtype=torch.int64, device=device)
    cls = type(runner)
    floor = Floor(device)
    with tempfile.TemporaryDirectory() as tmp:
        sess = Session(Path(tmp) / "t", rank=0, kind="v1", run=RunMetadata(), assembler="thread")
        hooks_common.hook = hooks_v1.hook = timing_hook  # type: ignore[assignment]
        hooks_common._execute_hook = timing_execute  # type: ignore[assignment]
        try:
            ours = hooks_v1.v1_patches(sess, owners, [0])
            label[0] = "mgtrace_parked"
            ours_parked = hooks_v1.v1_patches(sess, owners, [0])
        finally:
            hooks_common.hook = hooks_v1.hook = real_hook  # type: ignore[assignment]
            hooks_common._execute_hook = real_execute  # type: ignore[assignment]
        pairs = {
            name: (timed("floor", f"{name} (before)", b), timed("floor", f"{name} (after)", a))
            for name, (b, a) in floor.hooks().items()
        }
        minimal = [Patch(p.owner, p.name, _wrapper(*pairs[p.name])) for p in ours]
        for r in range(rounds + 1):
            hook_sets = (("floor", minimal), ("mgtrace", ours), ("mgtrace_parked", ours_parked))
            for config, patch_list in hook_sets:
                patches = PatchSet()
                patches.install(patch_list)
                quiet = config == "mgtrace_parked"
                try:
                    with parked(sess, device) if quiet else contextlib.nullcontext():
                        for _ in range(steps):
                            cls.execute_model(runner, so)
                            cls.sample_tokens(runner, out)
                    if r == 0:  # a warm-up round, not counted
                        spent[config].clear()
                finally:
                    patches.remove()
                floor.records.clear()
        drops = sess.status()["drops"]
        sess.close(10.0)
    if drops:
        raise SystemExit(f"recorder_floor: mgtrace dropped {drops} steps in the per-hook run")
    total = rounds * steps
    table = {}
    for config, counter in spent.items():
        table[config] = {k: round(v / total / 1e3, 2) for k, v in sorted(counter.items())}
        table[config]["all hooks"] = round(sum(counter.values()) / total / 1e3, 2)
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=200, help="steps per block")
    ap.add_argument("--per-hook", action="store_true", help="also time each hook body")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    Session._drain = _discard  # type: ignore[method-assign]
    runner, owners = build_runner(device)
    so = scheduler_output()
    out = torch.zeros((ROWS, 1 + K), dtype=torch.int64, device=device)
    cls = type(runner)
    floor = Floor(device)

    def block(clear: Callable[[], None]) -> float:
        for _ in range(10):
            cls.execute_model(runner, so)
            cls.sample_tokens(runner, out)
        start = time.thread_time_ns()
        for _ in range(args.steps):
            cls.execute_model(runner, so)
            cls.sample_tokens(runner, out)
        spent = time.thread_time_ns() - start
        if device.type == "cuda":
            torch.cuda.synchronize()
        clear()
        return spent / args.steps / 1e3

    with tempfile.TemporaryDirectory() as tmp:
        sess = Session(Path(tmp) / "t", rank=0, kind="v1", run=RunMetadata(), assembler="thread")
        ours = hooks_v1.v1_patches(sess, owners, [0])
        pairs = floor.hooks()
        minimal = [Patch(p.owner, p.name, _wrapper(*pairs[p.name])) for p in ours]
        configs = {
            "unhooked": [],
            "floor": minimal,
            "floor_handover": minimal,
            "mgtrace": ours,
            "mgtrace_parked": ours,
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        handed = 0
        for r in range(args.rounds):
            names = list(configs) if r % 2 == 0 else list(configs)[::-1]
            for name in names:
                patches = PatchSet()
                if configs[name]:
                    patches.install(configs[name])
                mover = HandOver(floor) if name == "floor_handover" else None
                quiet = name == "mgtrace_parked"
                try:
                    with parked(sess, device) if quiet else contextlib.nullcontext():
                        times[name].append(block(floor.records.clear))
                finally:
                    if mover is not None:
                        mover.close()
                        handed += mover.bytes
                    if configs[name]:
                        patches.remove()
        status = sess.status()
        sess.close(10.0)

    median = {name: statistics.median(v) for name, v in times.items()}
    added = {name: median[name] - median["unhooked"] for name in configs if name != "unhooked"}
    emit(
        {
            "benchmark": "recorder engine-thread floor per 96-row V1 step (stand-in step)",
            "command": command_line(),
            "machine": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "device": args.device,
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                "cpus": os.cpu_count(),
            },
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "median_engine_thread_cpu_us_per_step": {k: round(v, 2) for k, v in median.items()},
            "added_us_per_step": {k: round(v, 2) for k, v in added.items()},
            "mgtrace_over_floor": round(added["mgtrace"] / added["floor"], 3),
            "recorder_thread_share_us": round(added["mgtrace"] - added["mgtrace_parked"], 2),
            "target_us_per_step": TARGET_US,
            "floor_within_target": added["floor"] <= TARGET_US,
            "floor_handover_within_target": added["floor_handover"] <= TARGET_US,
            "handed_over_bytes": handed,
            "mgtrace_hook_errors": status["hook_errors"],
            "mgtrace_drops": status["drops"],
            "hook_body_us_per_step": (
                per_hook_bodies(device, args.rounds // 2 or 1, args.steps)
                if args.per_hook
                else None
            ),
        },
        args.out,
    )
    if status["drops"]:
        # a dropped step skips the hooks' work: the mgtrace rows would undercount
        print(f"recorder_floor: mgtrace dropped {status['drops']} steps", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
