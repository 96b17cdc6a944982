"""Python processes for the attach tests to inject code into."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from mgtrace.recorder import inject


def python_target(tmp_path: Path, name: str, script: str) -> subprocess.Popen[str]:
    """This Python running ``script``, which prints 'up' once it is ready; skipped where
    this process may not ptrace it."""
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    target = subprocess.Popen(
        [sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert target.stdout is not None and target.stdout.readline().strip() == "up"
    ok, why = inject.ptrace_permitted(target.pid)
    if not ok:
        target.kill()
        target.wait()
        pytest.skip(why)
    return target


def gdb_script_with(tmp_path: Path, old: str, new: str, count: int = 1) -> Path:
    """mgtrace's gdb script with ``old`` (found ``count`` times) replaced by ``new``: a
    broken copy for a failing control."""
    text = inject.GDB_SCRIPT.read_text()
    assert text.count(old) == count
    broken = tmp_path / "gdb_queue_broken.py"
    broken.write_text(text.replace(old, new))
    return broken


def queue_and_wait(
    target: subprocess.Popen[str], source: str, script: Path, timeout: float
) -> tuple[int, str]:
    """Queue ``source`` in ``target`` with the gdb ``script`` (a refusal included), then
    wait for the target to end: its return code and what it printed."""
    with contextlib.suppress(inject.InjectError):
        inject._queue(target.pid, source, script=script)
    try:
        out, _ = target.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        target.kill()
        out, _ = target.communicate()
    return target.returncode, out
