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
    # the manifest names a flush's parts once all are written: the first flush's six
    assert len(reader.parts) == 6
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


def _written_steps(trace: Path) -> dict[str, list[int]]:
    """Per per-step table, the distinct steps the trace holds."""
    reader = TraceReader(trace)
    return {
        t: sorted(set(reader.table(t).column("step").to_pylist()))
        for t in ("steps", "batch_rows", "launches")
    }


def _ranges(manifest) -> set[int]:
    return {s for _, lo, hi in manifest.drops.step_ranges for s in range(lo, hi + 1)}


def _bulk(batch: list[tuple[int, dict]]) -> dict[str, dict]:
    """Many steps' tables as one chunk per table with a step column, every column a list."""
    out: dict[str, dict] = {}
    for step, tables in batch:
        for name, columns in tables.items():
            n = max((len(v) for v in columns.values() if not np.isscalar(v)), default=1)
            merged = out.setdefault(name, {"step": []})
            merged["step"] += [step] * n
            for col, v in columns.items():
                merged.setdefault(col, []).extend([v] * n if np.isscalar(v) else list(v))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize("odd", [None, 12345, "ok"])
def test_a_bad_value_costs_its_own_step_only(tmp_path: Path, bulk: bool, odd: object) -> None:
    """A request id that is None (the column allows no nulls) or not a string cannot go
    into a part: that step is refused and counted, in every table, and the rest is
    written, whether it came alone or in a batch of steps. Control: ``"ok"``, a string,
    loses nothing."""
    rng = np.random.default_rng(1)
    steps = [sample_step(s, 8, rng) for s in range(20)]
    steps[5]["batch_rows"]["req_id"] = [*steps[5]["batch_rows"]["req_id"][:7], odd]
    with TraceWriter(tmp_path / "t") as writer:
        if bulk:
            for first in (0, 10):
                batch = [(s, steps[s]) for s in range(first, first + 10)]
                assert writer.write_steps(0, first, first + 9, _bulk(batch))
        else:
            assert all(writer.write_step(0, s, t) for s, t in enumerate(steps))
    manifest = writer.manifest
    assert manifest.complete and "writer" not in manifest.errors
    bad = [] if odd == "ok" else [5]
    want = [s for s in range(20) if s not in bad]
    assert _written_steps(tmp_path / "t") == {t: want for t in ("steps", "batch_rows", "launches")}
    assert manifest.drops.malformed_steps == len(bad) and _ranges(manifest) == set(bad)
    assert writer.stats().steps_written == len(want)


class FailingWriter(TraceWriter):
    """A writer flushed by hand, whose disk refuses the ``fail_at``-th part of ``table``."""

    def __init__(self, *args, table: str, fail_at: int, **kwargs) -> None:
        self.table, self.fail_at, self.seen = table, fail_at, 0
        super().__init__(*args, **kwargs)

    def _run(self) -> None:  # the test drains and flushes
        self._closing.wait()

    def flush_now(self) -> None:
        self._drain()
        self._flush()

    def _write_part(self, rel_path, table):
        if rel_path.startswith(self.table + "/"):
            self.seen += 1
            if self.seen == self.fail_at:
                raise OSError(28, "No space left on device")
        return super()._write_part(rel_path, table)


@pytest.mark.unit
@pytest.mark.parametrize("fail_at", [2, 99])
def test_a_part_that_fails_loses_its_flush_counted_and_whole(tmp_path: Path, fail_at: int) -> None:
    """When the disk refuses the second flush's launches part, the steps of that flush
    are counted as dropped, and the part of batch_rows written before it in that flush is
    removed: every table holds the same steps. The steps after it are dropped and counted
    as well. Control (``fail_at=99``): nothing fails, nothing is dropped."""
    rng = np.random.default_rng(1)
    writer = FailingWriter(tmp_path / "t", table="launches", fail_at=fail_at)
    for first in (0, 10, 20):
        for s in range(first, first + 10):
            assert writer.write_step(0, s, sample_step(s, 8, rng)) is (first < 20 or fail_at > 2)
        writer.flush_now()
    manifest = writer.close()
    written = _written_steps(tmp_path / "t")
    listed = {p.path for p in manifest.parts}
    on_disk = {str(p.relative_to(tmp_path / "t")) for p in (tmp_path / "t").rglob("*.parquet")}
    assert on_disk == listed
    if fail_at == 2:
        assert not manifest.complete and "writer" in manifest.errors
        assert written == {t: list(range(10)) for t in written}
        assert manifest.drops.steps == 20 and _ranges(manifest) == set(range(10, 30))
    else:
        assert manifest.complete and manifest.drops.steps == 0
        assert written == {t: list(range(30)) for t in written}


@pytest.mark.unit
@pytest.mark.parametrize("cause", ["disk", "queue"])
def test_info_names_why_a_trace_is_incomplete_and_its_steps_dropped(
    tmp_path: Path, cause: str
) -> None:
    """A writer that failed, then closed, is neither 'did not close' nor 'queue full':
    ``info`` says writing stopped, and why. Control: steps a full queue dropped are told
    as such, in a trace that is complete."""
    rng = np.random.default_rng(1)
    fail_at = 2 if cause == "disk" else 99
    writer = FailingWriter(tmp_path / "t", table="launches", fail_at=fail_at, max_queue_steps=10)
    for first in (0, 10, 20):
        for s in range(first, first + 12):  # two more than the queue holds
            writer.write_step(0, s, sample_step(s, 8, rng))
        writer.flush_now()
    writer.close()
    proc = run_cli("info", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # the table wraps long cells
    assert "did not close" not in out
    if cause == "disk":
        assert "incomplete (writing stopped: writing launches/r000-000001.parquet failed:" in out
        assert "steps (writing failed)" in out and "queue full" not in out
    else:
        assert "complete" in out and "incomplete" not in out
        assert "drops │ 6 steps (queue full) │" in out
