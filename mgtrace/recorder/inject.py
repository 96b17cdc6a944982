"""Start the agent's control socket in a running Python process that did not load the plugin.

Two ways, tried in order: ``sys.remote_exec`` (PEP 768, Python 3.14+), then gdb. The gdb
path does not run Python at the point where the process was stopped (which may be inside
the allocator or the garbage collector): it only queues a pending call with
``Py_AddPendingCall``, which the interpreter's main thread runs at its next safe point with
the GIL held, and detaches (how, and why not with gdb's own ``call``: ``gdb_queue.py``).
The queued code only imports this package and opens the socket; all control then goes
through the socket's fixed command set.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mgtrace
from mgtrace.errors import MgtraceError

# gdb reads the symbols of every library the target maps (an engine maps gigabytes of CUDA
# libraries), and a busy host slows it further: one attach took over 30 s under load.
GDB_TIMEOUT_S = 120.0
GDB_END_WAIT_S = 15.0  # for gdb to detach once signalled


class InjectError(MgtraceError):
    """The agent could not be started in the target process."""


def payload() -> str:
    """Python run in the target: make this mgtrace importable there, open the socket."""
    root = str(Path(mgtrace.__file__).resolve().parents[1])
    if any(c in root for c in "'\"\\\n"):
        raise InjectError(f"mgtrace's install path {root!r} cannot be passed to the target")
    return (
        "import sys\n"
        f"sys.path.append('{root}') if '{root}' not in sys.path else None\n"
        "import mgtrace.recorder.plugin as _mgtrace_plugin\n"
        "_mgtrace_plugin.serve_control()\n"
    )


def ptrace_permitted(pid: int) -> tuple[bool, str]:
    """Whether this process may attach a debugger to ``pid``, and why not."""
    if shutil.which("gdb") is None:
        return False, "gdb is not installed"
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        scope = 0
    if os.geteuid() == 0:
        return (scope < 3, "ptrace is disabled (kernel.yama.ptrace_scope=3)")
    if scope >= 2:
        return False, f"kernel.yama.ptrace_scope={scope} allows ptrace to root only"
    if scope == 1:
        # only descendants may be traced without CAP_SYS_PTRACE
        ppid = pid
        while ppid > 1:
            try:
                stat = Path(f"/proc/{ppid}/stat").read_text()
            except OSError:
                break
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == os.getpid():
                return True, ""
        return False, "kernel.yama.ptrace_scope=1 allows ptrace of your own children only"
    return True, ""


def via_remote_exec(pid: int) -> Path | None:
    """PEP 768: the payload file the target will run at its next safe point (the caller
    removes it once the agent answers), or None where this Python has no
    ``sys.remote_exec``. It also needs the target to run the same Python version, which
    only the call itself tells: a refusal raises ``InjectError``, and the caller tries gdb."""
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        return None
    fd, name = tempfile.mkstemp(prefix="mgtrace-attach-", suffix=".py")
    with os.fdopen(fd, "w") as fh:
        fh.write(payload())
    os.chmod(name, 0o644)  # the target reads it; it holds no secret
    try:
        remote_exec(pid, name)
    except Exception as exc:
        os.unlink(name)
        raise InjectError(f"sys.remote_exec into {pid} failed ({exc})") from None
    return Path(name)


GDB_SCRIPT = Path(__file__).with_name("gdb_queue.py")  # runs in gdb's Python, see there
BUSY_RETRIES = 40  # attaches while no thread of the target sits in a system call
BUSY_WAIT_S = 0.025


def _run_gdb(pid: int, source: str, script: Path | None = None) -> str:
    """One attach: gdb runs ``script`` in ``pid`` with ``source`` to queue; its verdict
    (``queued``, ``busy`` or ``failed REASON``)."""
    argv = ["gdb", "-batch", "-nx", "-p", str(pid), "-x", str(script or GDB_SCRIPT)]
    env = {**os.environ, "MGTRACE_PAYLOAD": source}
    # its own session: a terminal's Ctrl-C must not reach gdb while it holds the target
    gdb = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = gdb.communicate(timeout=GDB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_gdb(gdb, interrupted=False)
        raise InjectError(
            f"gdb did not finish attaching to {pid} in {GDB_TIMEOUT_S:.0f} s"
        ) from None
    except BaseException:  # Ctrl-C, SIGTERM: let gdb put the target back first
        _end_gdb(gdb, interrupted=True)
        raise
    for line in stdout.splitlines():
        if line.startswith("mgtrace-gdb: "):
            return line.removeprefix("mgtrace-gdb: ").strip()
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return f"failed gdb said: {lines[-1] if lines else 'nothing'}"


def _end_gdb(gdb: subprocess.Popen[str], *, interrupted: bool) -> None:
    """Bring a gdb run to an end without killing it: a gdb killed while attached leaves the
    target with rewritten registers or a planted breakpoint, and the target crashes. An
    interrupted run is let finish (the queue takes seconds); a run that will not finish
    gets SIGINT, which ends the script's call (it restores the registers and detaches),
    then SIGTERM (gdb detaches as it quits)."""
    waits = ((None, GDB_TIMEOUT_S if interrupted else 0.0), (signal.SIGINT, GDB_END_WAIT_S))
    for signum, wait_s in (*waits, (signal.SIGTERM, GDB_END_WAIT_S)):
        if signum is not None and gdb.poll() is None:
            gdb.send_signal(signum)
        try:
            gdb.communicate(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # asked again: stop waiting, go on to the signals
            continue
    # still attached after all that: left running rather than killed mid-call


def _queue(pid: int, source: str, script: Path | None = None) -> None:
    for _ in range(BUSY_RETRIES):
        verdict = _run_gdb(pid, source, script)
        if verdict not in ("busy", "starting"):
            break
        # every thread was running, or Python was still starting: attach again shortly
        time.sleep(BUSY_WAIT_S)
    if verdict == "busy":
        raise InjectError(
            f"no thread of process {pid} was waiting in a system call in "
            f"{BUSY_RETRIES} attaches, the only place gdb may safely make the call"
        )
    if verdict == "starting":
        raise InjectError(
            f"process {pid} had not finished starting Python after {BUSY_RETRIES} attaches"
        )
    if verdict != "queued":
        reason = verdict.removeprefix("failed ").rstrip(".")
        raise InjectError(f"gdb could not queue the agent in {pid}: {reason}")


# The throwaway process waits as an engine's threads do: in a system call made from code
# gdb can neither name nor unwind (an engine's, in the stripped GPU driver), here a page of
# x86-64 code issuing nanosleep. Where no executable page can be made, it sleeps in Python.
PROBE = """
import platform, time
wait = lambda: time.sleep(0.05)
try:
    import ctypes, mmap
    assert platform.machine() == "x86_64"
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(bytes.fromhex("48c7c023000000" "0f05" "c3"))  # mov rax, 35; syscall; ret
    nanosleep = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)(
        ctypes.addressof(ctypes.c_char.from_buffer(page))
    )
    pause = (ctypes.c_long * 2)(0, 50_000_000)
    wait = lambda: nanosleep(ctypes.addressof(pause), None)
except Exception:
    pass
while True:
    wait()
"""


@functools.cache
def gdb_injection_works(script: Path | None = None) -> tuple[bool, str]:
    """Whether gdb can queue code in a process on this machine, tried end to end on a
    throwaway Python, so that an engine is never the first process to meet a kernel or a
    gdb that cannot (``script``: another gdb script than mgtrace's, for tests)."""
    with tempfile.TemporaryDirectory(prefix="mgtrace-probe-") as tmp:
        marker = Path(tmp) / "ran"
        probe = subprocess.Popen(
            [sys.executable, "-c", PROBE],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.2)  # into its loop
            _queue(probe.pid, f"open({str(marker)!r}, 'w').close()\n", script)
            deadline = time.monotonic() + 5.0
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if probe.poll() is not None:
                return False, "a test process did not survive gdb's attach"
            if not marker.exists():
                return False, "the code gdb queued in a test process never ran"
            return True, ""
        except InjectError as exc:
            return False, f"on a test process: {exc}"
        finally:
            probe.kill()
            probe.wait()


def via_gdb(pid: int) -> None:
    _queue(pid, payload())
