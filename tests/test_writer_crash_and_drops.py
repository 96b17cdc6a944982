"""A killed writer leaves a readable trace; a slow sink makes drops, counted, never blocking."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.sample import sample_step
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import TraceWriter, append_table
from tests.conftest import REPO, run_cli

CHILD = [sys.executable, "-m", "tests.crash_writer_child"]


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the child never reached the expected state")
        time.sleep(0.01)


def _check_killed_trace(trace: Path) -> TraceReader:
    reader = TraceReader(trace)
    assert not reader.complete
    con = reader.connect()
    steps = con.execute("SELECT count(*), count(DISTINCT step) FROM steps").fetchone()
    assert steps[0] == steps[1] == reader.rows("steps")
    # every step that made it is whole: its batch rows are all there
    per_step = con.execute(
        "SELECT count(*) FROM (SELECT step, count(*) n FROM batch_rows GROUP BY step) WHERE n <> 8"
    ).fetchone()[0]
    assert per_step == 0
    return reader


@pytest.mark.slow
def test_kill_with_a_part_open_leaves_readable_trace(tmp_path: Path) -> None:
    trace, marker = tmp_path / "trace", tmp_path / "marker"
    child = subprocess.Popen([*CHILD, str(trace), str(marker)], cwd=REPO)
    try:
        _wait_for(marker.exists)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    reader = _check_killed_trace(trace)
    assert reader.open_parts_left(), "the open part should be left under its temporary name"
    assert len(reader.parts) == 3
    proc = run_cli("info", str(trace))
    assert proc.returncode == 0 and "incomplete" in proc.stdout and "open part left" in proc.stdout
    # a killed writer holds the trace no more: findings can still be added to it
    findings = pa.Table.from_pylist(
        [{"replay_id": "r", "kind": "foreign_state", "signature": "sig", "step": 1}],
        schema=TABLES["findings"].schema,
    )
    append_table(trace, "findings", findings, tag="replay-r")
    assert TraceReader(trace).rows("findings") == 1


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 0.7, 1.1])
def test_kill_at_arbitrary_times(tmp_path: Path, delay: float) -> None:
    trace = tmp_path / "trace"
    child = subprocess.Popen([*CHILD, str(trace)], cwd=REPO)
    try:
        _wait_for(lambda: (trace / "manifest.json").exists())
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    _check_killed_trace(trace)


class GatedWriter(TraceWriter):
    """A writer whose disk is stuck until the test opens the gate."""

    def __init__(self, *args, gate: threading.Event, **kwargs) -> None:
        self.gate = gate
        super().__init__(*args, **kwargs)

    def _write_part(self, rel_path, table):
        self.gate.wait()
        return super()._write_part(rel_path, table)


@pytest.mark.unit
def test_slow_sink_drops_are_counted_and_caller_never_blocks(tmp_path: Path) -> None:
    gate = threading.Event()
    writer = GatedWriter(tmp_path / "t", gate=gate, max_queue_steps=16, rows_per_part=64)
    rng = np.random.default_rng(1)
    steps = [sample_step(s, 8, rng) for s in range(1000)]
    accepted: list[bool] = []

    def produce() -> None:
        accepted.extend(writer.write_step(0, s, tables) for s, tables in enumerate(steps))

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(timeout=60)
    # The gate is still shut, so a blocking write_step could not have finished.
    assert not producer.is_alive(), "write_step blocked behind a stuck sink"
    assert not gate.is_set()
    dropped = [s for s, ok in enumerate(accepted) if not ok]
    assert len(accepted) == 1000 and len(dropped) > 900
    assert writer.stats().steps_dropped == len(dropped)
    gate.set()
    manifest = writer.close()
    assert manifest.drops.steps == len(dropped)
    assert manifest.drops.rows == len(dropped) * sum(
        len(next(iter(c.values()))) if not np.isscalar(next(iter(c.values()))) else 1
        for c in steps[0].values()
    )
    covered = {s for _, lo, hi in manifest.drops.step_ranges for s in range(lo, hi + 1)}
    assert covered == set(dropped)
    written = TraceReader(tmp_path / "t").table("steps").column("step").to_pylist()
    assert sorted(written) == [s for s, ok in enumerate(accepted) if ok]


@pytest.mark.unit
def test_no_drops_without_pressure(tmp_path: Path) -> None:
    """Control for the drop test: the same steps into a free writer lose nothing."""
    rng = np.random.default_rng(1)
    with TraceWriter(tmp_path / "t", max_queue_steps=2000) as writer:
        ok = [writer.write_step(0, s, sample_step(s, 8, rng)) for s in range(1000)]
    assert all(ok) and writer.manifest.drops.steps == 0
    assert TraceReader(tmp_path / "t").rows("steps") == 1000


def _idle_rounds(tmp_path: Path, name: str, idle_s: float) -> tuple[int, TraceWriter]:
    """Writer-thread loop rounds while nothing is queued, for ``idle_s`` seconds."""
    w = TraceWriter(tmp_path / name, flush_seconds=0.05)
    rounds = [0]
    drain = w._drain

    def counted() -> int:
        rounds[0] += 1
        return drain()

    w._drain = counted  # the loop looks the method up on every round
    time.sleep(idle_s)
    return rounds[0], w


def test_idle_writer_sleeps_until_a_step_arrives(tmp_path: Path, monkeypatch) -> None:
    """An idle writer thread does not poll (it would take the core from a producer that
    shares it); a step queued while it sleeps still reaches a part."""
    import mgtrace.schemas.writer as writer_module

    idle_s = 0.5
    rounds, w = _idle_rounds(tmp_path, "quiet", idle_s)
    assert rounds <= idle_s / writer_module.IDLE_WAKE_S + 3
    assert w.write_step(0, 0, sample_step(0, 4, np.random.default_rng(1)))
    _wait_for(lambda: w.stats().parts > 0, timeout=30)
    w.close()
    assert TraceReader(tmp_path / "quiet").rows("batch_rows") == 4
    # control: a writer that wakes every 2 ms (polling) fails the same bound
    monkeypatch.setattr(writer_module, "IDLE_WAKE_S", 0.002)
    rounds, w = _idle_rounds(tmp_path, "polling", idle_s)
    w.close()
    assert rounds > idle_s / 0.25 + 3
