"""Host cost of one stream-ordered capture of an align launch's inputs, by how it is issued.

A capture copies the launch's small int32 vectors (five of 128 values, as V1's post-process
reads) into a slot of a device staging ring and records an event, on the current stream,
without waiting for the device. Issued as:

- ``cat``: one ``torch.cat`` into the slot, then the event (the recorder's eager path);
- ``graph``: one CUDA-graph replay that joins the vectors into a fixed row and copies that row
  into the slot a device-side counter names, then advances the counter; then the event.

Also the pieces alone: the event, the replay, and reading the current stream's handle; and
V2's pre-copy capture, whose ``idx_mapping`` is int64: joined with the int32 vectors by a
converting ``torch.cat``, or as its int32 words (a view, then a plain ``torch.cat``).
Each is timed over many calls on the engine thread (wall and thread CPU time per call, median
of rounds), with the device left to run behind. A check after the timing replays the graph
over changing inputs and compares every slot with what it must hold, byte for byte.

Usage: python benchmarks/capture_ops_gpu.py [--calls 4000] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from results_io import command_line, emit

SLOTS = 512
SLOT_ELEMS = 1024
VECTORS = 5
LENGTH = 128


def _graph(
    parts: list[torch.Tensor], staging: torch.Tensor, counter: torch.Tensor
) -> torch.cuda.CUDAGraph:
    """Capture, without synchronizing, the join of ``parts`` into the slot ``counter``
    names, and the counter's advance."""
    total = sum(p.shape[0] for p in parts)
    row = torch.empty(total, dtype=torch.int32, device=staging.device)
    target = staging[:, :total]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            torch.cat(parts, out=row)
            target.index_copy_(0, counter, row.view(1, total))
            counter.add_(1).remainder_(staging.shape[0])
        finally:
            graph.capture_end()
    graph.keep = (row, target, side)  # type: ignore[attr-defined]
    return graph


def _time(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """(wall µs, thread CPU µs) per call."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (
        (time.perf_counter() - w0) / calls * 1e6,
        (time.thread_time() - c0) / calls * 1e6,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("capture_ops_gpu.py needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    parts = [torch.arange(LENGTH, dtype=torch.int32, device=dev) + 1000 * v for v in range(VECTORS)]
    staging = torch.zeros((SLOTS, SLOT_ELEMS), dtype=torch.int32, device=dev)
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    events = [torch.Event(device=dev) for _ in range(SLOTS)]
    total = VECTORS * LENGTH
    views = [staging[i, :total] for i in range(SLOTS)]
    t0 = time.perf_counter()
    graph = _graph(parts, staging, counter)
    capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # a second graph, as a recording's second launch makes one
    _graph(parts[:3], staging, counter)
    second_capture_s = time.perf_counter() - t0
    device_index = dev.index or torch.cuda.current_device()
    state = {"i": 0}

    def next_slot() -> int:
        i = state["i"]
        state["i"] = (i + 1) % SLOTS
        return i

    def joining(vectors: Callable[[], list[torch.Tensor]], rows: list[torch.Tensor]) -> Any:
        """One eager capture: ``vectors()`` joined into the next slot's row, then its event."""

        def issue() -> None:
            i = next_slot()
            torch.cat(vectors(), out=rows[i])
            events[i].record()

        return issue

    def replay() -> None:
        i = next_slot()
        graph.replay()
        events[i].record()

    def replay_only() -> None:
        graph.replay()

    def event_only() -> None:
        events[next_slot()].record()

    # V2's pre-copy: an int64 idx_mapping among int32 slot vectors, joined converting, or
    # its words joined as they are (an int32 view, twice as long)
    idx = torch.arange(LENGTH, dtype=torch.int64, device=dev)
    mixed = [idx, *parts[:3]]
    cat = joining(lambda: parts, views)
    cat_converting = joining(lambda: mixed, [staging[i, : 4 * LENGTH] for i in range(SLOTS)])
    cat_words = joining(
        lambda: [idx.view(torch.int32), *parts[:3]],
        [staging[i, : 5 * LENGTH] for i in range(SLOTS)],
    )

    def stream_handle() -> None:
        torch._C._cuda_getCurrentRawStream(device_index)

    kinds = {
        "cat_and_event": cat,
        "graph_replay_and_event": replay,
        "graph_replay": replay_only,
        "event_record": event_only,
        "current_stream_handle": stream_handle,
        "v2_cat_int64_converting_and_event": cat_converting,
        "v2_cat_int64_as_words_and_event": cat_words,
    }
    for fn in kinds.values():  # warm every path
        _time(fn, 200)
    torch.cuda.synchronize()
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(a.rounds):
        for name, fn in kinds.items():
            runs[name].append(_time(fn, a.calls))
            torch.cuda.synchronize()  # between timings only: each starts with an idle queue

    # the check: replays over inputs that change between them land in the slots in order
    torch.cuda.synchronize()
    counter.zero_()
    staging.zero_()
    n = SLOTS + 37  # wraps the ring
    for step in range(n):
        for v, p in enumerate(parts):
            p.fill_(step * 16 + v)  # a device op on the stream, as a kernel rewriting inputs
        graph.replay()
    torch.cuda.synchronize()
    expect = torch.zeros_like(staging)
    for step in range(n):
        slot = step % SLOTS
        for v in range(VECTORS):
            expect[slot, v * LENGTH : (v + 1) * LENGTH] = step * 16 + v
    exact = bool(torch.equal(staging, expect)) and int(counter.item()) == n % SLOTS

    med = {
        name: {
            "wall_us": round(statistics.median(r[0] for r in rs), 2),
            "thread_cpu_us": round(statistics.median(r[1] for r in rs), 2),
        }
        for name, rs in runs.items()
    }
    result = {
        "benchmark": "host cost of one stream-ordered capture of five 128-value int32 vectors",
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(dev),
        },
        "calls_per_round": a.calls,
        "rounds": a.rounds,
        "median_per_call": med,
        "graph_over_cat_thread_cpu": round(
            med["graph_replay_and_event"]["thread_cpu_us"] / med["cat_and_event"]["thread_cpu_us"],
            3,
        ),
        "graph_capture_s": {"first": round(capture_s, 4), "second": round(second_capture_s, 4)},
        "graph_slots_byte_exact": exact,
        "all": {k: [[round(w, 2), round(c, 2)] for w, c in v] for k, v in runs.items()},
    }
    emit(result, a.out)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
