"""Attaching to targets off the common path, with real processes: a thread waiting in a
system call made from code gdb cannot unwind (a JIT page, as a stripped driver library is);
a Python started through the dynamic loader (its executable is the loader); and, where a
Python 3.14 is at hand, PEP 768's ``sys.remote_exec`` between two 3.14 processes.

A Python 3.14 is looked for in ``MGTRACE_PYTHON314`` (a command, which may be a wrapper
script) and then as ``python3.14`` on the PATH; without one those tests are skipped.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mgtrace.recorder import attach, control, proctree
from tests.attach_targets import gdb_script_with, python_target, queue_and_wait
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


# A thread sleeps in nanosleep issued from an anonymous executable page: to gdb the
# innermost frame is code without symbols or unwind information. Either the main thread
# sleeps so, 100 times; or a helper thread does, while the main thread computes for a few
# seconds (never in a system call: gdb takes the helper, as an engine's driver thread).
# Then "done".
RAW_SLEEP = """
import ctypes, mmap, threading, time
code = bytes.fromhex("48c7c023000000" "0f05" "c3")  # mov rax, 35 (nanosleep); syscall; ret
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
raw_sleep = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)(address)
pause = (ctypes.c_long * 2)(0, 20_000_000)
"""
JIT_SLEEPERS = {
    "main-thread-waits": RAW_SLEEP
    + """
print("up", flush=True)
for _ in range(100):
    raw_sleep(ctypes.addressof(pause), None)
print("done", flush=True)
""",
    "helper-thread-waits": RAW_SLEEP
    + """
def helper():
    while True:
        raw_sleep(ctypes.addressof(pause), None)
threading.Thread(target=helper, daemon=True).start()
print("up", flush=True)
end = time.monotonic() + 3
while time.monotonic() < end:
    sum(range(1000))
print("done", flush=True)
""",
}
QUEUED = "print('queued code ran', flush=True)\n"
FRAME_SELECTION = "    gdb.newest_frame().select()\n"


def _jit_sleeper(tmp_path: Path, shape: str) -> subprocess.Popen[str]:
    return python_target(tmp_path, "jit_sleeper", JIT_SLEEPERS[shape])


needs_x86_gdb = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("gdb") is None,
    reason="gdb injection is x86-64 only and needs gdb",
)


@needs_x86_gdb
@pytest.mark.parametrize("shape", list(JIT_SLEEPERS))
def test_gdb_queues_code_where_the_thread_waits_in_code_without_unwind_info(
    shape: str, tmp_path: Path
) -> None:
    """An engine's threads wait inside the GPU driver, a stripped library. gdb identifies
    frames by the stack and code addresses it unwinds, and after any write it selects again
    the frame that matches the one selected before; in code it cannot unwind that was an
    outer frame, so the registers written next went to slots on the stack, and the target
    crashed. The code runs (on the main thread), and the target finishes."""
    target = _jit_sleeper(tmp_path, shape)
    attach.inject._queue(target.pid, QUEUED)
    out, err = target.communicate(timeout=60)
    assert target.returncode == 0, err[-1000:]
    assert out.split() == ["queued", "code", "ran", "done"], out


@needs_x86_gdb
def test_gdb_without_selecting_the_innermost_frame_crashes_that_target(tmp_path: Path) -> None:
    """Failing control for the test above: the gdb script with its register reads and
    writes left to whatever frame gdb selects. (With a helper thread the control is not
    certain to fire: the main thread, which gdb tries first, may be waiting for the GIL in
    the C library just then, where gdb unwinds well.)"""
    broken = gdb_script_with(tmp_path, FRAME_SELECTION, "", count=2)
    target = _jit_sleeper(tmp_path, "main-thread-waits")
    returncode, out = queue_and_wait(target, QUEUED, broken, 30)
    assert returncode != 0 and "done" not in out


@needs_x86_gdb
def test_the_throwaway_check_catches_a_script_that_crashes_such_a_thread(tmp_path: Path) -> None:
    """Before it attaches to an engine, mgtrace tries gdb on a throwaway Python that waits as
    an engine's threads do, in code gdb cannot unwind; the script without the frame
    selection fails there (a throwaway that slept in Python, as before, let it pass)."""
    ok, why = attach.inject.gdb_injection_works()
    if not ok:
        pytest.skip(why)
    broken = gdb_script_with(tmp_path, FRAME_SELECTION, "", count=2)
    ok, why = attach.inject.gdb_injection_works(broken)
    assert not ok and "test process" in why, why


def _static_python() -> str | None:
    """A system Python with libpython linked into its executable (Debian's and Ubuntu's
    are): through the loader, gdb reads none of its symbols unless told where it lies."""
    if shutil.which("ldd") is None:
        return None
    for name in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(name)
        if path.exists() and b"libpython" not in _libraries(path):
            return name
    return None


def _libraries(path: Path) -> bytes:
    """``ldd``'s list of the shared libraries the program at ``path`` loads."""
    return subprocess.run(["ldd", str(path)], capture_output=True, timeout=30).stdout


STATIC_PYTHON = _static_python()
INTERPRETERS = [PY] + ([STATIC_PYTHON] if STATIC_PYTHON else [])


@pytest.mark.skipif(not LOADER.exists(), reason=f"no dynamic loader at {LOADER}")
@pytest.mark.parametrize(
    "python", INTERPRETERS, ids=["this-python", "static-libpython"][: len(INTERPRETERS)]
)
def test_a_python_started_through_the_loader_is_attached_with_gdb(
    python: str, tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """``ld-linux PYTHON script``: the process's executable is the loader, so the name of
    ``/proc/PID/exe`` does not say Python (the old rule, checked here, refused it); its
    mapped interpreter does. Control: a program that is not Python, started the same way,
    is still refused."""
    target = _start([str(LOADER), python], tmp_path)
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


@pytest.mark.skipif(
    not LOADER.exists() or STATIC_PYTHON is None, reason="no loader, or no static-libpython Python"
)
def test_without_the_mapped_interpreter_gdb_finds_no_python_symbols(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """Control for the static-libpython case above: the gdb script without reading the
    mapped interpreter's symbols finds no CPython function in that process."""
    assert STATIC_PYTHON is not None
    reading = "            if attempt or not load_mapped_interpreter():\n"
    broken = gdb_script_with(tmp_path, reading, "            if True:\n")
    target = _start([str(LOADER), STATIC_PYTHON], tmp_path)
    started.append(target)
    _ptrace_or_skip(target.pid)
    with pytest.raises(attach.inject.InjectError, match="no symbol Py_IsInitialized"):
        attach.inject._queue(target.pid, QUEUED, script=broken)
    assert target.poll() is None  # refused, and left as it was


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


@needs_314
def test_gdb_starts_the_agent_in_a_python_314_process(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """This mgtrace (no ``sys.remote_exec`` before 3.14) attaches to a 3.14 process with
    gdb: the pending-call route works on 3.14's interpreter too."""
    if sys.version_info >= (3, 14):
        pytest.skip("this Python would use sys.remote_exec")
    assert PY314 is not None
    target = _start(PY314, tmp_path)
    started.append(target)
    _ptrace_or_skip(target.pid)
    proc = proctree.read_proc(target.pid)
    assert proc is not None
    t = attach.connect(proc)
    assert t.how == "gdb" and control.send(t.socket, "status")["pid"] == target.pid
    assert target.poll() is None


@needs_314
def test_a_314_target_that_disables_remote_debugging_gets_the_agent_through_gdb(
    tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    """mgtrace on 3.14 and a 3.14 target started with PYTHON_DISABLE_REMOTE_DEBUG: PEP 768
    refuses, and gdb starts the agent instead (mgtrace's throwaway gdb check runs on the
    same interpreter: a wrapper given as MGTRACE_PYTHON314 must be its sys.executable)."""
    assert PY314 is not None
    script = tmp_path / "target.py"
    script.write_text(TARGET)
    target = subprocess.Popen(
        [*PY314, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHON_DISABLE_REMOTE_DEBUG": "1"},
    )
    started.append(target)
    assert target.stdout is not None and target.stdout.readline().strip() == "up"
    _ptrace_or_skip(target.pid)
    got = _run_314(ATTACH, target.pid)
    assert got["how"] == "gdb" and got["pid"] == target.pid, got
