"""``mgtrace record`` on an engine of two ranks (two workers under one parent, as vLLM's
EngineCore holds them): signals during the stop, and ``--stop``."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mgtrace.recorder import control
from mgtrace.schemas.reader import TraceReader
from tests.test_recorder_attach import PY, _record_bg, _record_cli, _stand_in_engines, _wait

pytestmark = [pytest.mark.slow, pytest.mark.peer]
pytest.importorskip("vllm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks() -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """The parent and its two workers' pids; a step takes 2 s, so that stopping each
    worker (at its next step boundary) takes a while."""
    argv = [PY, "-m", "tests.recorder_standin_ranks", str(_free_port()), "--sleep", "2.0"]
    with _stand_in_engines(argv, 2) as (parent, workers):
        yield parent, workers


def _states(workers: list[int]) -> list[str]:
    return [control.send(control.socket_path(w), "status")["state"] for w in workers]


def _recording_into(workers: list[int], out: Path) -> bool:
    statuses = [control.send(control.socket_path(w), "status") for w in workers]
    return all(
        s["state"] == "recording" and str(s.get("out", "")).startswith(str(out)) and s.get("steps")
        for s in statuses
    )


def _stop_everything(workers: list[int]) -> None:
    for w in workers:
        control.send(control.socket_path(w), "stop", timeout_s=60.0)


def test_a_second_signal_during_the_stop_leaves_no_rank_recording(
    ranks: tuple[subprocess.Popen[str], list[int]], tmp_path: Path
) -> None:
    """SIGTERM, then Ctrl-C while the first rank is being stopped: the Ctrl-C cut the stop
    short and left the second rank recording, with no mgtrace left to stop it. It now waits
    until every rank is stopped; the exit is the first signal's."""
    parent, workers = ranks
    out = tmp_path / "twice"
    rec = _record_bg("--engine-pid", str(parent.pid), "-o", str(out))
    try:
        _wait(lambda: _recording_into(workers, out), what="both ranks recording")
        rec.send_signal(signal.SIGTERM)
        # the first rank's stop waits for its step to end (up to 2 s): Ctrl-C comes meanwhile
        time.sleep(0.3)
        rec.send_signal(signal.SIGINT)
        stdout, stderr = rec.communicate(timeout=120)
        assert _states(workers) == ["idle", "idle"], stdout + stderr
        assert rec.returncode == 128 + signal.SIGTERM, stderr
        assert "Traceback" not in stderr
        assert stderr.count("stopping, please wait") == 1, stderr  # the wait is said once
        for rank in (0, 1):
            assert TraceReader(out / f"rank-{rank:03d}").complete
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        _stop_everything(workers)


def test_stop_ends_a_recording_whose_mgtrace_was_killed(
    ranks: tuple[subprocess.Popen[str], list[int]], tmp_path: Path
) -> None:
    """A recording whose ``mgtrace record`` died by SIGKILL could not be stopped by any
    mgtrace command (a new ``record`` is refused as busy); ``--stop`` ends it."""
    parent, workers = ranks
    out = tmp_path / "orphan"
    rec = _record_bg("--engine-pid", str(parent.pid), "-o", str(out))
    try:
        _wait(lambda: _recording_into(workers, out), what="both ranks recording")
        rec.kill()
        rec.wait()
        assert _states(workers) == ["recording", "recording"]
        proc = _record_cli("--engine-pid", str(parent.pid), "--stop")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert _states(workers) == ["idle", "idle"]
        for rank, w in enumerate(workers):
            where = out / f"rank-{rank:03d}"
            assert f"pid {w}: stopped after " in proc.stdout and f"-> {where} (complete)" in (
                proc.stdout
            ), proc.stdout
            assert TraceReader(where).complete
        # failing control: nothing left to stop is said so, and is not an error
        again = _record_cli("--engine-pid", str(parent.pid), "--stop")
        assert again.returncode == 0 and "is recording" in again.stdout
    finally:
        _stop_everything(workers)


def test_a_launched_engines_ranks_record_into_one_trace(tmp_path: Path) -> None:
    """Launch mode gives each engine a folder of its own, named by its first process with
    the plugin. Two workers of one world that nothing above loaded the plugin into (as
    torchrun starts them) each named an engine after itself; they share their parent's
    folder, rank-NNN each, and one engine's trace ends up at DIR as before."""
    out = tmp_path / "ranks"
    argv = [PY, "-m", "tests.recorder_standin_ranks", str(_free_port()), "--steps", "5"]
    proc = _record_cli("-o", str(out), "--max-steps", "3", "--", *argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rank-000", "rank-001"]
    reader = TraceReader(out)
    assert reader.complete and reader.rows("steps") == 6
    assert f"recorded steps 0..2 on 2 rank(s) into {out} (complete" in proc.stdout
