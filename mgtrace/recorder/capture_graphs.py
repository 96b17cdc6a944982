"""A capture issued as one CUDA-graph replay instead of eager torch ops.

An eager capture is a ``torch.cat`` into the staging slot the host picked, which costs the
engine thread a torch op (about 15-20 µs on a GPU host); a graph replay costs a few µs. A
graph reads fixed addresses and writes a fixed place, so the slot comes from the device: a
counter that the graph itself advances. Its graph joins the launch's vectors into a row of
its own, copies that row into the slot the counter names, and advances the counter modulo
the ring's slots. The host knows which slot a replay fills because the ring hands slots
out in ring order; where an eager capture came between, the counter is set first (one
fill, in stream order).

A launch passes the same persistent device buffers step after step (vLLM's V1 align
launchers do), so a graph is made the second time the same tensors are captured, and only
used while they are the same objects over the same memory and lengths. Graphs replay on
one stream: the counter's advances must be ordered, so a capture on another stream is
issued eagerly. Making a graph never waits for the device: the capture runs on a side
stream in thread-local mode, which leaves the engine's other threads free to use CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SEEN_BEFORE_GRAPH = 2  # the capture of a tensor set that makes its graph
MAX_GRAPHS = 8  # tensor sets tracked at once (a launcher passes the same few)


class LaunchGraph:
    """One tensor set's graph, or (``graph`` None) the count of times it was seen."""

    __slots__ = ("graph", "keep", "lengths", "ptrs", "seen", "tensors")

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.tensors = tuple(tensors)  # held: their ids cannot be reused while tracked
        self.ptrs = [t.data_ptr() for t in tensors]
        self.lengths = tuple(map(len, tensors))
        self.seen = 1
        self.graph: Any = None
        self.keep: tuple[Any, ...] = ()

    def same(self, tensors: Sequence[Any]) -> bool:
        """The same tensor objects, over the same memory and lengths."""
        mine = self.tensors
        if len(tensors) != len(mine):
            return False
        for a, b in zip(tensors, mine, strict=True):
            if a is not b:
                return False
        return [t.data_ptr() for t in tensors] == self.ptrs and tuple(map(len, tensors)) == (
            self.lengths
        )


def graphable(tensors: Sequence[Any], device: Any, slot_elems: int) -> bool:
    """Whether a graph can read these tensors whole: 1-D int32 on the ring's device,
    fitting one slot."""
    import torch

    total = 0
    for t in tensors:
        if t.dim() != 1 or t.dtype != torch.int32 or t.device != device:
            return False
        total += t.shape[0]
    return 0 < total <= slot_elems


def make_graph(entry: LaunchGraph, staging: Any, counter: Any, side_stream: Any) -> None:
    """Capture ``entry``'s graph (see the module's docstring); raises where the driver or
    torch refuses, leaving ``entry`` without one."""
    import torch

    total = sum(entry.lengths)
    row = torch.empty(total, dtype=torch.int32, device=staging.device)
    target = staging[:, :total]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side_stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            torch.cat(entry.tensors, out=row)
            target.index_copy_(0, counter, row.view(1, total))
            counter.add_(1).remainder_(staging.shape[0])
        finally:
            graph.capture_end()
    entry.graph = graph
    entry.keep = (row, target)
