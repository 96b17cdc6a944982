"""The recorder's way out of the engine process: the wire form of step records, the
assembler process, and what happens when it falls behind or dies."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mgtrace.recorder import outproc, wire
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata

pytestmark = pytest.mark.unit


def _so(ids: list[str], computed: int, step: int = 0) -> SimpleNamespace:
    """A scheduler output; some steps admit a request (by prompt tokens or by prompt
    length), resume, finish or preempt one."""
    new = []
    if step % 4 == 1:
        new.append(
            SimpleNamespace(
                req_id=f"n{step}",
                prompt_token_ids=[1] * step,
                num_computed_tokens=0,
                block_ids=([step, step + 1],),
            )
        )
    if step % 6 == 3:
        new.append(
            SimpleNamespace(
                req_id=f"m{step}", prompt_len=step + 2, num_computed_tokens=1, block_ids=([],)
            )
        )
    return SimpleNamespace(
        total_num_scheduled_tokens=4 * len(ids),
        num_scheduled_tokens=dict.fromkeys(ids, 4),
        scheduled_spec_decode_tokens={r: [7, 8, 9] for r in ids},
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(ids),
            resumed_req_ids={ids[2]} if step % 4 == 2 else set(),
            new_block_ids=[None] * len(ids),
            num_computed_tokens=[computed] * len(ids),
        ),
        finished_req_ids={ids[0]} if step % 5 == 0 else set(),
        preempted_req_ids={ids[3]} if step % 5 == 3 else set(),
    )


def _new_requests(so: Any) -> list[tuple[Any, ...]]:
    out = []
    for r in so.scheduled_new_reqs:
        plen = getattr(r, "prompt_len", None)
        if plen is None:
            plen = len(r.prompt_token_ids)
        out.append((r.req_id, plen, r.num_computed_tokens, r.block_ids))
    return out


def _records(steps: int) -> list[dict[str, Any]]:
    """Step records shaped like the V1 hooks' (arrays, id lists, state-column dicts, a
    scheduler output), some values repeating from step to step and some not."""
    recs = []
    for step in range(steps):
        ids = [f"{'r' if step < 4 else 'q'}{i}" for i in range(6)]
        if step % 3 == 2:
            ids[1], ids[4] = ids[4], ids[1]  # a reorder: the order differs
        cols = {r: 2 + (i + step // 4) % 3 for i, r in enumerate(ids)}
        recs.append(
            {
                "step": step,
                "wall_ns": 1000 + step,
                "so": _so(ids, 10 + step, step),
                "moves": [("swap", 1, 4, ids[1], ids[4], 1, 2)],
                "req_ids": ids,
                "computed": np.arange(6, dtype=np.int32) + step,
                "prefilling": np.arange(6) % 2 == 0,
                "bt": [(0, np.arange(12, dtype=np.int32).reshape(6, 2), np.full(6, 2, np.int32))],
                "sidx_before": dict(cols),
                "sidx_after": {r: c + (step % 2) for r, c in cols.items()},
                "staged": {"state_idx": np.arange(6, dtype=np.int32) * step},
            }
        )
    return recs


def _same_record(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    bad = []
    for key, value in want.items():
        mine = got.get(key)
        if key == "so":
            drafts = {r: len(v) for r, v in value.scheduled_spec_decode_tokens.items()}
            if {r: len(v) for r, v in mine.scheduled_spec_decode_tokens.items()} != drafts:
                bad.append("so.drafts")
            for name in ("num_scheduled_tokens", "total_num_scheduled_tokens"):
                if getattr(mine, name) != getattr(value, name):
                    bad.append(f"so.{name}")
            for name in ("req_ids", "num_computed_tokens", "new_block_ids", "resumed_req_ids"):
                a = getattr(mine.scheduled_cached_reqs, name)
                if a != getattr(value.scheduled_cached_reqs, name):
                    bad.append(f"so.cached.{name}")
            for name in ("finished_req_ids", "preempted_req_ids"):
                if getattr(mine, name) != getattr(value, name):
                    bad.append(f"so.{name}")
            if _new_requests(mine) != _new_requests(value):
                bad.append("so.new")
        elif key == "bt":
            for (g1, r1, c1), (g2, r2, c2) in zip(mine, value, strict=True):
                if g1 != g2 or not np.array_equal(r1, r2) or not np.array_equal(c1, c2):
                    bad.append("bt")
        elif key == "staged":  # engine-side only: the post-process launch's tag carries it
            if mine is not None:
                bad.append("staged")
        elif isinstance(value, np.ndarray):
            if mine.dtype != value.dtype or not np.array_equal(mine, value):
                bad.append(key)
        elif mine != value:
            bad.append(key)
    return bad


def _through(frames: list[bytes]) -> list[dict[str, Any]]:
    unpacker = wire.Unpacker()
    return [
        unpacker.record(m[1])
        for f in frames
        for messages in wire.take_frames(bytearray(f))
        for m in messages
        if m[0] == "step"
    ]


def test_a_long_frame_goes_as_several_pickles() -> None:
    """A frame of many steps is several pickles of at most ``MESSAGES_PER_PICKLE`` messages
    each (one pickle call holds the GIL throughout), which read back as the same records in
    the same order. Control: with no limit it is one pickle."""
    recs = _records(150)
    packer = wire.Packer()
    data = wire.encode([("step", packer.record(r)) for r in recs])
    pickles = wire.take_frames(bytearray(data))
    assert len(pickles) == -(-150 // wire.MESSAGES_PER_PICKLE) > 1
    assert max(len(p) for p in pickles) <= wire.MESSAGES_PER_PICKLE
    got = _through([data])
    assert [_same_record(g, w) for g, w in zip(got, _records(150), strict=True)] == [[]] * 150


def test_records_cross_the_wire_unchanged() -> None:
    recs = _records(12)
    packer = wire.Packer()
    frames = [wire.encode([("step", packer.record(r)) for r in recs[i : i + 4]]) for i in (0, 4, 8)]
    got = _through(frames)
    assert [_same_record(g, w) for g, w in zip(got, _records(12), strict=True)] == [[]] * 12
    # the repeats did travel as references to the last value: an assembler that missed a
    # frame resolves them to stale values (failing control)
    stale = _through(frames[:1] + frames[2:])
    want = _records(12)[:4] + _records(12)[8:]
    assert any(_same_record(g, w) for g, w in zip(stale, want, strict=True))


def test_a_dropped_frame_resets_the_repeats() -> None:
    recs = _records(9)

    def run(reset: bool) -> list[list[str]]:
        packer = wire.Packer()
        kept = [wire.encode([("step", packer.record(r)) for r in recs[0:3]])]
        wire.encode([("step", packer.record(r)) for r in recs[3:6]])  # never delivered
        if reset:
            packer.reset()
        kept.append(wire.encode([("step", packer.record(r)) for r in recs[6:9]]))
        want = _records(9)[0:3] + _records(9)[6:9]
        return [_same_record(g, w) for g, w in zip(_through(kept), want, strict=True)]

    assert run(reset=True) == [[]] * 6
    assert run(reset=False) != [[]] * 6  # failing control: without the reset it goes stale


def _record_steps(sess: Session, steps: int) -> None:
    for rec in _records(steps):
        sess.begin_step(rec["so"])
        assert sess.rec is not None
        sess.rec.update({k: v for k, v in rec.items() if k not in ("step", "so", "moves")})
        sess.rec["moves"] += rec["moves"]
        sess.rec["prompt"] = np.full(6, 5, np.int32)
    sess.end_step()


def _tables(path: Path) -> dict[str, list[dict[str, Any]]]:
    import pyarrow.parquet as pq

    out = {}
    for table in sorted(p.name for p in path.iterdir() if p.is_dir()):
        rows = []
        for part in sorted((path / table).glob("*.parquet")):
            rows += pq.read_table(part).to_pylist()
        out[table] = [{k: v for k, v in r.items() if k != "wall_ns"} for r in rows]
    return out


def test_process_and_thread_assembly_write_the_same_trace(tmp_path: Path) -> None:
    traces = {}
    for mode in ("process", "thread"):
        sess = Session(tmp_path / mode, rank=0, kind="v1", run=RunMetadata(), assembler=mode)
        _record_steps(sess, 20)
        result = sess.close()
        assert result["complete"] and result["assembler"] == mode and result["rows"] == 120
        manifest = json.loads((tmp_path / mode / "manifest.json").read_text())
        assert manifest["source"]["assembler"] == mode
        traces[mode] = _tables(tmp_path / mode)
    assert traces["process"]["batch_rows"] and traces["process"]["row_moves"]
    assert traces["process"] == traces["thread"]


def test_an_assembler_that_falls_behind_costs_counted_steps_never_a_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outproc, "MAX_BACKLOG", 1 << 16)
    monkeypatch.setattr(outproc, "PIPE_BYTES", 1 << 12)

    def record(stall: bool) -> tuple[dict[str, Any], dict[str, Any], int]:
        out = tmp_path / ("stalled" if stall else "running")
        sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="process")
        assert sess.wait_ready(60.0)
        proc = sess.sink.proc  # type: ignore[union-attr]
        if stall:
            os.kill(proc.pid, signal.SIGSTOP)  # reads nothing: the pipe fills up
        try:
            for _ in range(48):  # ~110 kB of frames in all, ~2 kB at a time
                _record_steps(sess, 5)
                _drain_until_idle(sess, written=not stall)
            backlog = sess.status()["backlog_bytes"]  # what `mgtrace record` shows
        finally:
            if stall:
                os.kill(proc.pid, signal.SIGCONT)
        result = sess.close(30.0)
        return result, json.loads((out / "manifest.json").read_text()), backlog

    result, manifest, backlog = record(stall=True)
    assert result["complete"] and result["drops"] > 0
    assert manifest["drops"]["steps"] == result["drops"] and manifest["drops"]["step_ranges"]
    assert backlog > 0 and result["backlog_bytes"] == 0  # queued while stalled, then written
    # failing control: an assembler that keeps up drops nothing and has nothing queued
    result, manifest, backlog = record(stall=False)
    assert result["complete"] and result["drops"] == 0 and not manifest["drops"]["step_ranges"]
    assert backlog == 0


def _drain_until_idle(sess: Session, *, written: bool) -> None:
    """Until the recorder thread has forwarded every step (and, if ``written``, the pipe
    has taken every frame)."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        sess._records or (written and sess.sink._backlog)  # type: ignore[union-attr]
    ):
        time.sleep(0.005)


def test_status_is_readable_before_the_assembler_reports(tmp_path: Path) -> None:
    sess = Session(tmp_path / "t", rank=0, kind="v1", run=RunMetadata(), assembler="process")
    proc = sess.sink.proc  # type: ignore[union-attr]
    os.kill(proc.pid, signal.SIGSTOP)  # it cannot have reported anything yet
    try:
        status = sess.status()
        assert status["rows"] == 0 and status["writer_failed"] is None
        assert status["assembler"] == "process"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert sess.close()["complete"]


@pytest.mark.parametrize("sched", ["nice", "idle"])
def test_the_assembler_process_yields_the_cpu_as_chosen(
    sched: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each case is the other's control: the two policies are told apart
    monkeypatch.setenv(outproc.SCHED_ENV, sched)
    sess = Session(tmp_path / "t", rank=0, kind="v1", run=RunMetadata(), assembler="process")
    try:
        assert sess.wait_ready(60.0)
        pid = sess.sink.proc.pid  # type: ignore[union-attr]
        if sched == "idle":
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        else:
            assert os.sched_getscheduler(pid) == os.SCHED_OTHER
            ours = os.getpriority(os.PRIO_PROCESS, 0)
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + outproc.CHILD_NICE)
    finally:
        assert sess.close()["complete"]


def test_an_unknown_scheduling_choice_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(outproc.SCHED_ENV, "fast")
    with pytest.raises(ValueError, match="'nice' or 'idle'"):
        Session(tmp_path / "t", rank=0, kind="v1", run=RunMetadata(), assembler="process")
    assert not (tmp_path / "t").exists()


_KILLED_ENGINE = """
import os, sys
from pathlib import Path
from tests.test_recorder_outproc import _drain_until_idle, _record_steps
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata
sess = Session(Path(sys.argv[1]), rank=0, kind="v1", run=RunMetadata(), assembler="process")
assert sess.wait_ready(60.0)
_record_steps(sess, 5)
_drain_until_idle(sess, written=True)
print(sess.sink.proc.pid, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), 9)
sess.close()
"""


@pytest.mark.parametrize("end", ["kill", "close"])
def test_an_engine_that_dies_leaves_a_trace_that_says_so(tmp_path: Path, end: str) -> None:
    """The assembler reads end of input either way; only a recording the engine closed is
    complete. Control: the same steps, closed, are complete with no such error."""
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    out = tmp_path / "t"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_ENGINE, str(out), end],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assembler = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 60
    while Path(f"/proc/{assembler}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    manifest = json.loads((out / "manifest.json").read_text())
    if end == "kill":
        assert proc.returncode == -signal.SIGKILL
        assert manifest["complete"] is False and "engine_exited" in manifest["errors"]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert manifest["complete"] is True and "engine_exited" not in manifest["errors"]


def test_a_step_whose_capture_never_landed_is_dropped_not_written_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When close gives up waiting for the device, a step with a capture still in flight
    would replay as if its launch never ran: it is dropped and counted. Control: the steps
    around it, whose captures did not hang, are written."""
    import torch

    from mgtrace.recorder.capture import CaptureRing
    from mgtrace.schemas.reader import TraceReader

    monkeypatch.setattr(CaptureRing, "reap_raw", lambda self: [])  # nothing ever lands
    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="thread")
    hung = None
    for rec in _records(3):
        sess.begin_step(rec["so"])
        assert sess.rec is not None
        sess.rec.update({k: v for k, v in rec.items() if k not in ("step", "so", "moves")})
        sess.rec["moves"] += rec["moves"]
        sess.rec["prompt"] = np.full(6, 5, np.int32)
        if rec["step"] == 1:
            hung = sess.rec["step"]
            sess.grab([torch.zeros(4, dtype=torch.int32)], [4], {"step": hung, "kernel": "x"})
    sess.end_step()
    result = sess.close(timeout_s=0.5)
    steps = TraceReader(out).connect().execute("SELECT step FROM steps ORDER BY step").fetchall()
    assert [s for (s,) in steps] == [hung - 1, hung + 1]
    assert result["drops"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert "capture_unfinished" in manifest["errors"] and manifest["drops"]["steps"] == 1


def _written(out: Path) -> list[int]:
    """The steps the trace's manifest names parts for."""
    from mgtrace.schemas.reader import TraceReader

    reader = TraceReader(out)
    if not any(p.table == "steps" for p in reader.parts):
        return []
    return sorted(set(reader.table("steps").column("step").to_pylist()))


def _dropped(manifest: dict[str, Any]) -> set[int]:
    return {s for _, lo, hi in manifest["drops"]["step_ranges"] for s in range(lo, hi + 1)}


@pytest.mark.parametrize("fault", ["kill", "stop", None])
def test_steps_a_dead_assembler_had_taken_are_counted(tmp_path: Path, fault: str | None) -> None:
    """An assembler killed (or stopped, then killed by the close) after the pipe took the
    steps loses them before any part holds them: every step neither written nor counted
    yet is counted as dropped, so the written steps and the drops add up to the steps
    recorded. Control (None): an assembler that lives writes them all, drops nothing."""
    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="process")
    assert sess.wait_ready(60.0)
    proc = sess.sink.proc  # type: ignore[union-attr]
    if fault == "stop":
        os.kill(proc.pid, signal.SIGSTOP)
    _record_steps(sess, 12)
    _drain_until_idle(sess, written=True)  # the pipe took every step
    if fault == "kill":
        os.kill(proc.pid, signal.SIGKILL)
    result = sess.close(2.0 if fault == "stop" else 30.0)
    manifest = json.loads((out / "manifest.json").read_text())
    written = _written(out)
    lost = set(range(12)) - set(written)
    assert _dropped(manifest) == lost and manifest["drops"]["steps"] == len(lost)
    assert result["drops"] == len(lost)
    if fault is None:
        assert result["complete"] and written == list(range(12))
    else:
        assert not result["complete"] and lost  # the assembler wrote no part in time


@pytest.mark.parametrize("fail", [True, False])
def test_a_writer_that_fails_in_the_assembler_stops_the_recording(
    tmp_path: Path, fail: bool
) -> None:
    """The assembler's writer cannot write the steps part (a file where its folder goes):
    the failure reaches the engine process, and the recording stops at the next step
    boundary, its steps counted as dropped. Control: a writer that writes its first parts
    leaves the recording running."""
    import time

    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="process")
    assert sess.wait_ready(60.0)
    if fail:
        (out / "steps").write_text("not a folder")
    _record_steps(sess, 5)
    deadline = time.monotonic() + 60
    while not sess.stop_requested and not sess.status()["bytes"]:
        assert time.monotonic() < deadline, "the assembler neither wrote nor failed"
        time.sleep(0.02)
    assert sess.stop_requested is fail
    assert sess.begin_step(_so([f"r{i}" for i in range(6)], 0)) is not fail
    result = sess.close(30.0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert result["complete"] is not fail and "engine_exited" not in manifest["errors"]
    if fail:
        assert "writer" in manifest["errors"] and _written(out) == []
        assert _dropped(manifest) == set(range(5)) and result["drops"] == 5


@pytest.mark.parametrize("kill", [True, False])
def test_a_dead_assembler_leaves_the_recorder_thread_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: bool
) -> None:
    """Drop notices a dead assembler refuses are not work done: the recorder thread's
    drain says it is idle (and sleeps) instead of resending them forever. Control: an
    assembler alive takes them, and the drain says so once."""
    import time

    monkeypatch.setattr(Session, "_loop", lambda self: None)  # its _drain, driven by hand
    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="process")
    sink = sess.sink
    deadline = time.monotonic() + 60
    while not sink._stats:  # type: ignore[union-attr]  # until it has opened the trace
        assert time.monotonic() < deadline, "the assembler never reported"
        sink.tick()
        time.sleep(0.01)
    if kill:
        os.kill(sink.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        sink.proc.wait()  # type: ignore[union-attr]
        sink.tick()
        assert sink.failed is not None
    sess._lost_steps.append(0)  # a step dropped here: the assembler is to be told
    assert sess._drain() is not kill
    assert [sess._drain() for _ in range(3)] == [False] * 3
    sess._closing.set()
    result = sess.close(10.0)
    assert result["complete"] is not kill
    manifest = json.loads((out / "manifest.json").read_text())
    assert 0 in _dropped(manifest)


def test_the_close_of_a_failed_recording_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the disk refuses even the manifest that says the recording failed, the engine
    process logs one line and goes on. Control: the same manifest, writable, is updated."""
    from mgtrace.errors import OutputError
    from mgtrace.schemas.writer import TraceWriter

    out = tmp_path / "t"
    TraceWriter(out).close()
    assert outproc.mark_failed(out, "gone", {}, [], 0, 3) == 3  # control

    def full(*args: Any) -> None:
        raise OutputError(f"cannot write {out}/manifest.json: No space left on device")

    monkeypatch.setattr(outproc, "save_manifest", full)
    assert outproc.mark_failed(out, "gone", {}, [], 0, 5) is None
    assert [r.message for r in caplog.records] == [
        f"mgtrace: cannot record the failure in {out}/manifest.json: cannot write "
        f"{out}/manifest.json: No space left on device"
    ]


def test_an_assembler_that_cannot_close_the_trace_says_so_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The assembler process cannot write the manifest at the close (here a folder stands
    where it goes; a full disk does the same): one line into the engine's stderr, no
    traceback, and the engine process's close does not raise."""
    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="process")
    assert sess.wait_ready(60.0)
    _record_steps(sess, 3)
    _drain_until_idle(sess, written=True)
    (out / "manifest.json").unlink()
    (out / "manifest.json").mkdir()
    result = sess.close(30.0)
    assert not result["complete"]
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert "mgtrace: the assembler process could not close the trace: cannot write" in err
