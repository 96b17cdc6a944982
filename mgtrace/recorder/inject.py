"""Start the agent's control socket in a running Python process that did not load the plugin.

Two ways, tried in order: ``sys.remote_exec`` (PEP 768, Python 3.14+), then gdb. The gdb
path does not run Python at the point where the process was stopped (which may be inside
the allocator or the garbage collector): it only queues a pending call with
``Py_AddPendingCall``, which the interpreter's main thread runs at its next safe point with
the GIL held, and detaches. The queued code only imports this package and opens the socket;
all control then goes through the socket's fixed command set.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mgtrace
from mgtrace.errors import MgtraceError

GDB_TIMEOUT_S = 30.0


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


# The registers an inferior call may leave changed when it fails half-way. On some kernels
# gdb cannot write the x86 extended register state ("Couldn't write extended state
# status"): the call is refused after gdb has already set orig_rax to -1, and a thread
# stopped inside a system call then returns the kernel's internal restart code to its
# caller (time.sleep raising "OSError: [Errno 514]"), which would crash the engine.
# Writing the saved general-purpose registers back (ptrace's plain register set, which
# does work there) lets the kernel restart the call; after a call that worked it changes
# nothing, since gdb has already restored the same values.
_SAVED_REGISTERS = (
    "rip", "rsp", "rbp", "rax", "rbx", "rcx", "rdx", "rsi", "rdi",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "eflags", "orig_rax",
)  # fmt: skip


def _gdb_argv(pid: int, calls: list[str]) -> list[str]:
    """gdb in batch mode: save the registers, make ``calls``, put the registers back, detach."""
    commands = [
        "set confirm off",
        "set pagination off",
        *(f"set $mgtrace_{r} = ${r}" for r in _SAVED_REGISTERS),
        *calls,
        *(f"set ${r} = $mgtrace_{r}" for r in _SAVED_REGISTERS),
        "detach",
    ]
    argv = ["gdb", "-batch", "-nx", "-p", str(pid)]
    for c in commands:
        argv += ["-ex", c]
    return argv


def _run_gdb(pid: int, calls: list[str]) -> str:
    """gdb's output (stdout, then stderr) for ``calls`` made in ``pid``."""
    try:
        proc = subprocess.run(
            _gdb_argv(pid, calls), capture_output=True, text=True, timeout=GDB_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise InjectError(
            f"gdb did not finish attaching to {pid} in {GDB_TIMEOUT_S:.0f} s"
        ) from None
    return proc.stdout + "\n" + proc.stderr


def _gdb_error(out: str) -> str:
    """The first thing gdb refused (later errors follow from it), or its last line."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Couldn't", "Cannot", "Could not", "No symbol", "ptrace:")):
            return ln
    return lines[-1] if lines else "no output"


@functools.cache
def gdb_calls_work() -> tuple[bool, str]:
    """Whether gdb can call a function in a process on this machine, tried on a throwaway
    Python sleeping in a system call (where an engine's threads usually are), so that an
    engine is never the first process to meet a kernel that refuses it."""
    probe = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)  # into its sleep
        out = _run_gdb(probe.pid, ["call (int)getpid()"])
        if f"$1 = {probe.pid}" in out and probe.poll() is None:
            return True, ""
        return False, f"its function calls fail on this machine: {_gdb_error(out)}"
    except InjectError as exc:
        return False, str(exc)
    finally:
        probe.kill()
        probe.wait()


def via_gdb(pid: int) -> None:
    code = payload().replace("\n", "\\n")
    size = len(code) + 64
    out = _run_gdb(
        pid,
        [
            f"call (char*)malloc({size})",
            f'call (void)strcpy($1, "{code}")',
            "call (int)Py_AddPendingCall((int(*)(void*))PyRun_SimpleString, $1)",
        ],
    )
    if "$2 = 0" not in out:
        raise InjectError(f"gdb could not queue the agent in {pid}: {_gdb_error(out)}")
