"""GPU tier: capture around a real Triton launch is byte-exact and adds no synchronization.

A Triton kernel with the align post-process's read-then-normalise pattern reads int32
vectors and rewrites one of them in place; the capture ring queues its copies on the launch
stream right before the launch. What the ring returns must equal the inputs as they were
when the kernel read them (a clone taken before the launch, compared after a final
synchronize in the test), and nothing the recorder does on the engine thread may wait for
the device. Skipped without CUDA.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def normalise(acc_ptr, state_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(acc_ptr + offs, mask=mask)
        state = tl.load(state_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, acc * 1000 + state, mask=mask)
        # in place, like the post-process resetting accepted counts to 1
        tl.store(acc_ptr + offs, tl.where(state % 2 == 0, 1, acc), mask=mask)

    return normalise


class Counter:
    """Counts synchronizing calls made on the calling thread."""

    NAMES = ("item", "cpu", "tolist", "numpy")

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.count = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str) -> None:
        orig = getattr(owner, name)
        me = self

        def counted(*a: Any, **k: Any) -> Any:
            if threading.current_thread() is me.thread:
                me.count += 1
            return orig(*a, **k)

        self.saved.append((owner, name, orig))
        setattr(owner, name, counted)

    def __enter__(self) -> Counter:
        for name in self.NAMES:
            self._wrap(torch.Tensor, name)
        self._wrap(torch.cuda, "synchronize")
        self._wrap(torch.cuda.Event, "synchronize")
        self._wrap(torch.cuda.Stream, "synchronize")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)


def test_capture_around_a_triton_launch_is_exact_and_sync_free() -> None:
    from mgtrace.recorder.capture import CaptureRing

    kernel = _kernel()
    dev = torch.device("cuda")
    n, steps = 96, 20
    ring = CaptureRing(dev, slots=64)
    acc = torch.zeros(128, dtype=torch.int32, device=dev)
    state = torch.zeros(128, dtype=torch.int32, device=dev)
    out = torch.zeros(128, dtype=torch.int32, device=dev)
    big = torch.randn(2048, 2048, device=dev)
    expected = []
    torch.cuda.synchronize()
    with Counter() as counter:
        for step in range(steps):
            # inputs produced on the device, then a long matmul so that the launch (and the
            # capture) sit in the stream well behind the host
            acc.copy_(torch.randint(1, 5, (128,), dtype=torch.int32, device=dev))
            state.copy_(torch.randint(0, 50, (128,), dtype=torch.int32, device=dev))
            for _ in range(3):
                big = big @ big
                big /= big.norm()
            expected.append((acc[:n].clone(), state[:n].clone()))
            assert ring.grab([acc, state], [n, n], {"step": step})
            kernel[(1,)](acc, state, out, n, BLOCK=128)
    assert counter.count == 0
    torch.cuda.synchronize()
    got = []
    deadline = time.monotonic() + 30
    while len(got) < steps and time.monotonic() < deadline:
        got += ring.reap()
    assert [tag["step"] for _, tag in got] == list(range(steps))
    for (arrays, _), (want_acc, want_state) in zip(got, expected, strict=True):
        # the ring may copy whole vectors; the launch read the first n rows
        assert arrays[0][:n].tobytes() == want_acc.cpu().numpy().tobytes()
        assert arrays[1][:n].tobytes() == want_state.cpu().numpy().tobytes()
    # failing control: the normalised values (after the kernel) differ from the capture
    assert not all((acc[:n].cpu().numpy() == got[-1][0][0][:n]).tolist())


def _small_ring_round_trip(steps: int = 40) -> tuple[list[list[int]], list[list[int]]]:
    """Captures through a 5-slot ring, reaped every third step: slots are reused many times
    over and reaps span the wrap. Returns (reaped, expected) vectors in launch order."""
    from mgtrace.recorder.capture import CaptureRing

    dev = torch.device("cuda")
    ring = CaptureRing(dev, slots=5, slot_elems=64)
    src = torch.zeros(16, dtype=torch.int32, device=dev)
    got, want = [], []
    for step in range(steps):
        src.copy_(torch.arange(16, dtype=torch.int32, device=dev) * (step + 1))
        want.append([i * (step + 1) for i in range(16)])
        while not ring.grab([src], [16], {"step": step}):
            got += ring.reap()  # a full ring: reap until a slot is free
        if step % 3 == 0:
            got += ring.reap()
    deadline = time.monotonic() + 30
    while len(got) < steps and time.monotonic() < deadline:
        got += ring.reap()
    assert [tag["step"] for _, tag in got] == list(range(steps))
    return [arrays[0][:16].tolist() for arrays, _ in got], want


def test_a_small_ring_wraps_and_stays_exact() -> None:
    got, want = _small_ring_round_trip()
    assert got == want


def test_the_ring_check_sees_a_slot_whose_host_copy_was_skipped(monkeypatch: Any) -> None:
    """Control: copies that leave out the last slot of each run read stale host bytes."""
    from mgtrace.recorder import capture

    real = capture.consecutive_runs
    monkeypatch.setattr(
        capture, "consecutive_runs", lambda slots: [(a, b - 1) for a, b in real(slots) if b - a > 1]
    )
    got, want = _small_ring_round_trip()
    assert got != want


def test_the_counter_sees_a_synchronizing_call() -> None:
    x = torch.ones(4, device="cuda")
    with Counter() as counter:
        x.sum().item()
        torch.cuda.synchronize()
    assert counter.count == 2


def test_session_records_what_the_launch_read_on_the_device(tmp_path: Any) -> None:
    import pyarrow.parquet as pq

    from mgtrace.recorder.hooks_common import _postprocess
    from mgtrace.recorder.session import Session
    from mgtrace.schemas.manifest import RunMetadata

    dev = torch.device("cuda")
    n = 8

    def buf(values: list[int]) -> Any:
        cpu = torch.tensor(values, dtype=torch.int32)
        return type("Buf", (), {"np": cpu.numpy(), "gpu": cpu.to(dev)})()

    ctx = type("Ctx", (), {})()
    ctx.is_initialized = True
    ctx.mamba_state_idx_buf = buf(list(range(n)))
    ctx.num_scheduled_tokens_buf = buf([4] * n)
    ctx.num_computed_tokens_buf = buf(list(range(100, 100 + n)))
    ctx.num_draft_tokens_buf = buf([3] * n)
    acc = torch.arange(1, n + 1, dtype=torch.int32, device=dev) % 4 + 1
    sess = Session(tmp_path / "t", rank=0, kind="v1", run=RunMetadata())
    sess.begin_step(None)
    with Counter() as counter:
        _postprocess(
            sess,
            (
                ctx,
                n,
                acc,
                ctx.mamba_state_idx_buf.gpu,
                ctx.num_scheduled_tokens_buf.gpu,
                ctx.num_computed_tokens_buf.gpu,
                ctx.num_draft_tokens_buf.gpu,
            ),
            {},
        )
        want = acc.clone()
        acc.fill_(1)  # the kernel's in-place normalisation
    assert counter.count == 0
    sess.rec = None
    assert sess.close()["complete"]
    rows = pq.read_table(next((tmp_path / "t" / "launches").glob("*.parquet"))).to_pylist()
    assert [r["num_accepted"] for r in rows] == want.cpu().tolist()
    assert [r["num_computed"] for r in rows] == list(range(100, 100 + n))


def test_a_failed_device_capture_gives_its_slot_back() -> None:
    """On the device a capture is a cat into the staging slot and an event; when the cat
    fails (here a vector of another dtype), the slot goes back and the next capture takes
    it. Control: a ring that is really full refuses and counts it."""
    from mgtrace.recorder.capture import CaptureRing

    ring = CaptureRing(torch.device("cuda"), slots=2, slot_elems=16)
    good = torch.arange(4, dtype=torch.int32, device="cuda")
    bad = torch.arange(4, dtype=torch.float64, device="cuda")
    for _ in range(4):
        with pytest.raises((RuntimeError, TypeError)):  # what the hook's guard counts
            ring.grab([good, bad], [4, 4], {"step": 0})
    assert ring.grab([good], [4], {"step": 1}) and ring.grab([good], [4], {"step": 2})
    torch.cuda.synchronize()
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        got += ring.reap()
    assert [tag["step"] for _, tag in got] == [1, 2]
    assert all(arrays[0].tolist() == [0, 1, 2, 3] for arrays, _ in got)
    assert ring.grab([good], [4], {}) and ring.grab([good], [4], {})
    assert not ring.grab([good], [4], {}) and ring.dropped == 1


_SECOND_GPU = """
import json, threading, torch
from mgtrace.recorder.capture import CaptureRing
torch.cuda.set_device(1)  # the engine thread of a rank on GPU 1
ring = CaptureRing(torch.device("cuda", 1), slots=4, slot_elems=64)
v = torch.arange(8, dtype=torch.int32, device="cuda:1")
assert ring.grab([v], [8], {"step": 0})
got = []
def reap():
    while not got:
        got.extend(ring.reap())
t = threading.Thread(target=reap)  # a new thread starts on device 0
t.start(); t.join(60)
assert got and got[0][0][0].tolist() == list(range(8)), got
held = [torch._C._cuda_hasPrimaryContext(d) for d in (0, 1)]
torch.zeros(1, device="cuda:0")  # the control: now a context on GPU 0 must be seen
held.append(torch._C._cuda_hasPrimaryContext(0))
print(json.dumps(held), flush=True)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_rank_on_another_gpu_opens_no_context_on_gpu_0() -> None:
    """The recorder thread copies captures on its ring's device. A new thread's current
    device is 0, and a stream switch there may open a context on GPU 0 from every rank
    (hundreds of MB each, on the GPU the first rank fills), so the thread moves to the ring's
    device first. The driver is asked, without creating one, which devices hold this
    process's primary context (nvidia-smi's process ids are the host's, not a container's).
    Controls: the context on GPU 1 is seen, and one opened on GPU 0 on purpose afterwards."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-c", _SECOND_GPU], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    on_gpu0, on_gpu1, on_gpu0_after_control = json.loads(proc.stdout.strip().splitlines()[-1])
    assert on_gpu1 and on_gpu0_after_control  # the controls
    assert not on_gpu0


def test_an_int64_vector_is_captured_as_its_words_and_read_back_exact(monkeypatch: Any) -> None:
    """V2's launches pass their int64 idx_mapping first: the ring joins its int32 words, so
    no capture's ``torch.cat`` converts dtypes, and the reaped capture holds the values as
    int32, exact. Control: a strided int64 vector cannot be viewed as words; it goes through
    a converting cat (the probe sees int64 there) and is exact too."""
    from mgtrace.recorder.capture import CaptureRing

    dev = torch.device("cuda")
    ring = CaptureRing(dev, slots=8, slot_elems=256)
    joined: list[set[Any]] = []
    real_cat = torch.cat

    def probe(parts: Any, *, out: Any) -> Any:
        joined.append({p.dtype for p in parts})
        return real_cat(parts, out=out)

    monkeypatch.setattr(torch, "cat", probe)
    idx = torch.tensor([5, 3, 70000, 0], dtype=torch.int64, device=dev)
    acc = torch.arange(16, dtype=torch.int32, device=dev)
    strided = torch.arange(8, dtype=torch.int64, device=dev)[::2]
    with Counter() as counter:
        assert ring.grab((idx, acc), (4, 16), {"step": 0})
        assert ring.grab((strided, acc), (4, 16), {"step": 1})
    assert counter.count == 0
    monkeypatch.undo()
    torch.cuda.synchronize()
    got: list[Any] = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += ring.reap()
    assert [a[0].tolist() for a, _ in got] == [[5, 3, 70000, 0], [0, 2, 4, 6]]
    assert all(a[1].tolist() == list(range(16)) for a, _ in got)
    assert all(a[0].dtype == np.int32 for a, _ in got)
    assert joined == [{torch.int32}, {torch.int64, torch.int32}]
