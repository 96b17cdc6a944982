"""Attaching to interpreters that are not a plain ``python`` executable, with real processes:
one started through the dynamic loader (its executable is the loader), and, where a Python
3.14 is at hand, PEP 768's ``sys.remote_exec`` between two 3.14 processes.

A Python 3.14 is looked for in ``MGTRACE_PYTHON314`` (a command, which may be a wrapper
script) and then as ``python3.14`` on the PATH; without one those tests are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mgtrace.recorder import attach, control, proctree
from tests.conftest import REPO

pytestmark = pytest.mark.slow

PY = sys.executable
LOADER = Path("/lib64/ld-linux-x86-64.so.2")
TARGET = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.02)\n"
# what the mgtrace side runs (under a 3.14 interpreter): attach, ask the agent, report
ATTACH = (
    "import json, sys\n"
    "from mgtrace.recorder import attach, control, proctree\n"
    "t = attach.connect(proctree.read_proc(int(sys.argv[1])))\n"
    "status = control.send(t.socket, 'status')\n"
    "print(json.dumps({'how': t.how, 'pid': status['pid'], 'python': sys.version}))\n"
)


def _python314() -> list[str] | None:
    given = os.environ.get("MGTRACE_PYTHON314")
    found = given if given else shutil.which("python3.14")
    if not found:
        return None
    probe = subprocess.run(
        [found, "-c", "import sys; print(sys.version_info >= (3, 14))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return [found] if probe.stdout.strip() == "True" else None


PY314 = _python314()
needs_314 = pytest.mark.skipif(PY314 is None, reason="no Python 3.14 (set MGTRACE_PYTHON314)")


def _start(argv: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    script = tmp_path / "target.py"
    script.write_text(TARGET)
    target = subprocess.Popen([*argv, str(script)], stdout=subprocess.PIPE, text=True)
    assert target.stdout is not None and target.stdout.readline().strip() == "up"
    return target


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _ptrace_or_skip(pid: int) -> None:
    ok, why = attach.inject.ptrace_permitted(pid)
    if ok:
        ok, why = attach.inject.gdb_injection_works()
    if not ok:
        pytest.skip(why)


@pytest.mark.skipif(not LOADER.exists(), reason=f"no dynamic loader at {LOADER}")
def test_a_python_started_through_the_loader_is_attached_with_gdb(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """``ld-linux PYTHON script``: the process's executable is the loader, so the name of
    ``/proc/PID/exe`` does not say Python (the old rule, checked here, refused it); its
    mapped interpreter does. Control: a program that is not Python, started the same way,
    is still refused."""
    target = _start([str(LOADER), PY], tmp_path)
    started.append(target)
    exe = Path(os.readlink(f"/proc/{target.pid}/exe")).name
    assert "python" not in exe  # what the old rule read
    proc = proctree.read_proc(target.pid)
    assert proc is not None and proc.is_python
    _ptrace_or_skip(target.pid)
    t = attach.connect(proc)
    assert t.how == "gdb" and control.send(t.socket, "status")["pid"] == target.pid

    sleeper = subprocess.Popen([str(LOADER), shutil.which("sleep") or "/bin/sleep", "60"])
    try:
        other = proctree.read_proc(sleeper.pid)
        assert other is not None and not other.is_python
        with pytest.raises(attach.AttachError, match="has no mgtrace agent"):
            attach.connect(other)
    finally:
        sleeper.kill()
        sleeper.wait()


def _run_314(code: str, pid: int) -> dict[str, object]:
    """``code`` run by the 3.14 interpreter with this mgtrace importable; its JSON line."""
    assert PY314 is not None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*PY314, "-c", code, str(pid)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_314
def test_remote_exec_starts_the_agent_in_a_python_314_process(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """mgtrace on Python 3.14 attaches to a 3.14 process with ``sys.remote_exec``, no gdb;
    the agent answers and the payload file it ran is gone."""
    assert PY314 is not None
    target = _start(PY314, tmp_path)
    started.append(target)
    payloads = Path(tempfile.gettempdir())
    before = set(payloads.glob("mgtrace-attach-*.py"))
    got = _run_314(ATTACH, target.pid)
    assert got["how"] == "remote_exec" and got["pid"] == target.pid, got
    assert str(got["python"]).startswith("3.14")
    # the payload file was removed once the agent answered
    assert set(payloads.glob("mgtrace-attach-*.py")) <= before


# the control's mgtrace side: only the PEP 768 step, without the gdb fallback after it
REMOTE_EXEC_ONLY = (
    "import glob, json, os, sys, tempfile\n"
    "from mgtrace.recorder import inject\n"
    "pattern = os.path.join(tempfile.gettempdir(), 'mgtrace-attach-*.py')\n"
    "before = set(glob.glob(pattern))\n"
    "try:\n"
    "    inject.via_remote_exec(int(sys.argv[1]))\n"
    "    out = {'refused': None}\n"
    "except inject.InjectError as exc:\n"
    "    out = {'refused': exc.message}\n"
    "out['left'] = sorted(set(glob.glob(pattern)) - before)\n"
    "print(json.dumps(out))\n"
)


@needs_314
def test_a_target_on_another_python_refuses_remote_exec(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """Control for the test above: the same 3.14 mgtrace against a target running this
    (older) Python. PEP 768 refuses another version; mgtrace says so (the caller then tries
    gdb, tested with a stand-in refusal in test_recorder_attach.py) and leaves no payload
    file behind."""
    if sys.version_info >= (3, 14):
        pytest.skip("this Python is 3.14 as well")
    target = _start([PY], tmp_path)
    started.append(target)
    got = _run_314(REMOTE_EXEC_ONLY, target.pid)
    assert got["refused"] and f"sys.remote_exec into {target.pid} failed" in str(got["refused"])
    assert got["left"] == []
