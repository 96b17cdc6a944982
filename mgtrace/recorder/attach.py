"""``mgtrace record``: activate the agent in every process of an engine, watch, stop.

For each process of the tree: talk to its control socket if the plugin opened one; else
start the socket by ``sys.remote_exec`` (Python 3.14+) or gdb; else say how to enable
recording. Processes that hold no model runner (the API server, an EngineCore whose workers
are separate processes) answer ``idle`` with no runner module and are left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mgtrace.errors import MgtraceError, UsageError
from mgtrace.recorder import control, inject, proctree
from mgtrace.recorder.agent import BUSY
from mgtrace.recorder.plugin import (
    ENV_DIR,
    ENV_DURATION,
    ENV_ENGINE,
    ENV_MAX_STEPS,
    ENV_PER_ENGINE,
)

SOCKET_WAIT_S = 30.0  # the main thread runs the queued call at its next bytecode
POLL_S = 0.5
ENABLE_HINT = (
    "install mgtrace in the engine's Python environment so vLLM loads its plugin "
    "(then restart the engine), or allow ptrace (kernel.yama.ptrace_scope=0; an engine "
    "that runs as root may be recorded by root at any scope below 3) so mgtrace can attach "
    "with gdb"
)


class AttachError(MgtraceError):
    """No process of the engine could be made to record."""


@dataclass
class Target:
    proc: proctree.Proc
    socket: Path
    how: str  # plugin | remote_exec | gdb
    status: dict[str, Any] = field(default_factory=dict)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
SIGINT_GRACE_S = 10.0  # for a child that got the terminal's Ctrl-C itself
_stopping = False  # set while _stop_all runs: a signal then waits until every agent stopped


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[list[int]]:
    """SIGTERM and SIGHUP end a recording the way Ctrl-C does (every agent is stopped, the
    trace finished) rather than killing mgtrace with the engine left recording. Yields the
    signals received, SIGINT included; only the first raises ``KeyboardInterrupt``, and not
    while the agents are being stopped, so that a repeated one (a second Ctrl-C) does not
    cut the stop short and leave an engine recording with nobody to stop it."""
    received: list[int] = []
    waited = False  # the user was told once that the stop goes on

    def handler(signum: int, _frame: object) -> None:
        nonlocal waited
        received.append(signum)
        if len(received) == 1 and not _stopping:
            raise KeyboardInterrupt
        if not waited:  # os.write: print could re-enter a write the signal interrupted
            waited = True
            os.write(2, b"mgtrace: stopping, please wait\n")

    with _handlers(handler, (*STOP_SIGNALS, signal.SIGINT)):
        yield received


@contextlib.contextmanager
def _handlers(
    handler: Callable[[int, object], None], signals: tuple[int, ...] = STOP_SIGNALS
) -> Iterator[bool]:
    """``handler`` on ``signals`` meanwhile; nothing where this is not the main thread."""
    try:
        old = {s: signal.signal(s, handler) for s in signals}
    except ValueError:  # not the main thread: signals stay as they are
        yield False
        return
    try:
        yield True
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _wait_socket(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            try:
                control.send(path, "status", timeout_s=5.0)
                return True
            except control.ControlError:
                pass
        time.sleep(0.1)
    return False


def connect(proc: proctree.Proc, *, allow_inject: bool = True) -> Target:
    """A control connection to ``proc``, injecting the agent when it is not loaded."""
    path = control.engine_socket_path(proc.pid)
    if path.exists():
        try:
            return Target(proc, path, "plugin", control.send(path, "status", timeout_s=5.0))
        except control.ControlError:
            pass
    if not allow_inject or not proc.is_python:
        raise AttachError(f"process {proc.pid} has no mgtrace agent; {ENABLE_HINT}")
    how, script = _inject(proc.pid)
    if not _wait_socket(path, SOCKET_WAIT_S):
        # The injection itself worked, so ptrace is no help here; the queued call stays
        # queued and may start the agent (inert, listening only) later.
        raise AttachError(
            f"the agent queued in {proc.pid} by {how} did not start within "
            f"{SOCKET_WAIT_S:.0f} s, because the process's main thread ran no Python "
            "meanwhile (a long blocking call?); it may still start there later, inert until "
            "asked to record, so try again once the engine serves requests, or install "
            "mgtrace in the engine's Python environment so vLLM loads its plugin"
        )
    if script is not None:  # the target has run it: the agent answers
        script.unlink(missing_ok=True)
    return Target(proc, path, how)


def _inject(pid: int) -> tuple[str, Path | None]:
    """Queue the agent in ``pid``: ``sys.remote_exec`` where this Python has it, else (or
    when the target refuses it, e.g. another Python version) gdb."""
    remote_failed = ""
    try:
        script = inject.via_remote_exec(pid)
        if script is not None:
            return "remote_exec", script
    except inject.InjectError as exc:
        remote_failed = f"{exc}, and "
    ok, why = inject.ptrace_permitted(pid)
    if ok:
        # tried on a throwaway process first: an engine never meets a gdb that fails
        ok, why = inject.gdb_injection_works()
    if not ok:
        raise AttachError(
            f"process {pid} has no mgtrace agent; {remote_failed}gdb cannot attach ({why}); "
            f"{ENABLE_HINT}"
        )
    inject.via_gdb(pid)
    return "gdb", None


def engine_tree(pid: int) -> list[proctree.Proc]:
    procs = proctree.tree(pid)
    if not procs:
        raise UsageError(f"there is no process {pid}")
    # The agent's socket lives in its user's runtime directory and answers that uid only,
    # root included.
    if procs[0].uid != os.geteuid():
        raise UsageError(
            f"process {pid} belongs to uid {procs[0].uid}; record as that user "
            f"(e.g. sudo -u '#{procs[0].uid}' mgtrace record ...)"
        )
    # a process under it that runs as another user (su, sudo, a supervisor's drop of
    # privileges) is never attached to, nor its environment followed: its agent could not
    # answer us, and root would inject code into another user's process
    return [p for p in procs if p.uid == procs[0].uid]


def record_pid(
    pid: int,
    out: Path,
    *,
    duration_s: float | None,
    max_steps: int | None,
    on_status: Callable[[list[Target]], None] | None = None,
    allow_inject: bool = True,
    before_start: Callable[[], None] | None = None,
    on_connect: Callable[[Target], None] | None = None,
    on_missing: Callable[[str], None] | None = None,
    on_engines: Callable[[list[Path]], None] | None = None,
) -> list[Target]:
    """Activate every process of the tree, poll until the limits or Ctrl-C, stop all.
    ``before_start`` runs once every process answers and none records already (the CLI
    replaces an old trace there, not before the checks); ``on_connect`` hears of each
    process as its agent answers (an injection can take seconds); ``on_missing`` gets a
    sentence for each process that could not be reached, whose part the trace then lacks
    (the recording goes on with the others, and their manifests name it too);
    ``on_engines`` gets the folders, when the tree holds engines whose traces would share
    one and each gets its own (``_folders``)."""
    # an agent that answers, not a file: a stale one would make any process that took its
    # pid count as the engine's, and get code injected
    procs = proctree.engine_processes(
        engine_tree(pid), lambda p: control.listening(control.engine_socket_path(p.pid))
    )
    if not procs:
        raise UsageError(f"process {pid} is not a vLLM engine (no vLLM process in its tree)")
    targets: list[Target] = []
    errors: list[str] = []
    missing: list[tuple[proctree.Proc, str]] = []
    # processes whose plugin answers first: one that records already refuses the run before
    # any other process gets code injected
    has_socket = {p.pid for p in procs if control.listening(control.engine_socket_path(p.pid))}
    for p in sorted(procs, key=lambda p: p.pid not in has_socket):
        if not p.is_python:
            continue
        try:
            target = connect(p, allow_inject=allow_inject)
        except (AttachError, inject.InjectError) as exc:
            errors.append(exc.message)
            missing.append((p, exc.message))
            continue
        if target.status.get("state") in BUSY:  # a plugin's status, asked by connect
            raise AttachError(_busy(p.pid, target.status.get("out")))
        targets.append(target)
        if on_connect is not None:
            on_connect(target)
    if not targets:
        raise AttachError(errors[0] if errors else f"no Python process under {pid}")
    for t in targets:
        t.status = control.send(t.socket, "status", timeout_s=10.0)
        if t.status.get("state") in BUSY:
            raise AttachError(_busy(t.proc.pid, t.status.get("out")))
    if on_missing is not None:
        for p, reason in missing:
            on_missing(not_recorded(p, reason))
    if before_start is not None:
        before_start()
    args: dict[str, Any] = {
        "out": str(out.resolve()),
        "max_steps": max_steps,
        "duration_s": duration_s,
    }
    if missing:
        args["not_recorded"] = _for_manifest(missing)
    folders = _folders(procs, targets, out.resolve())
    if on_engines is not None and len(set(folders.values())) > 1:
        on_engines(sorted(set(folders.values())))
    for i, t in enumerate(targets):
        try:
            t.status = _start(t, {**args, "out": str(folders[t.proc.pid])})
        except BaseException as exc:
            _stop_all(targets[:i])  # none is left armed with nobody to stop it
            if isinstance(exc, control.ControlError) and "already recording" in exc.message:
                where = exc.message.rpartition(" into ")[2]
                raise AttachError(_busy(t.proc.pid, where)) from None
            raise
    recorders = [t for t in targets if t.status.get("runner_modules")]
    if not recorders:
        _stop_all(targets)
        raise AttachError(f"no process under {pid} holds a vLLM model runner to record")
    deadline = None if duration_s is None else time.monotonic() + duration_s + 5.0
    started: set[int] = set()
    try:
        while True:
            for t in recorders:
                try:
                    t.status = control.send(t.socket, "status", timeout_s=10.0)
                except control.ControlError as exc:
                    # what it recorded stays known: out, steps
                    t.status = {**t.status, "state": "gone", "error": exc.message}
            if on_status is not None:
                on_status(recorders)
            states = {t.status.get("state") for t in recorders}
            started |= {t.proc.pid for t in recorders if t.status.get("steps")}
            # processes that import the runner module but never step (an EngineCore whose
            # workers run elsewhere) stay armed; the recording ends with the ones that step
            if states <= {"idle", "refused", "gone"} or (
                started and not states & {"recording", "stopping"}
            ):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        pass
    # every started agent, also one still waiting for a runner module: else it would arm
    # later, with nobody left to stop it
    _stop_all(targets)
    return recorders


def _folders(procs: list[proctree.Proc], targets: list[Target], out: Path) -> dict[int, Path]:
    """The folder each target records into. A process writes ``out`` itself, or
    ``out/rank-NNN`` in a torch.distributed world of several ranks: where processes of
    different engines would write one of those (two single-rank engines under one shell,
    both rank 0), every engine gets its own, ``out/engine-PID`` (PID: its topmost process
    in the tree), instead of one losing its trace to the other. Otherwise the layout is
    the single engine's. A process with a runner module but no world yet (an EngineCore
    whose workers hold the ranks) counts as a single-rank writer."""
    parent = {p.pid: p.ppid for p in procs}

    def engine(pid: int) -> int:
        while parent[pid] in parent:
            pid = parent[pid]
        return pid

    writers: dict[str, set[int]] = {}
    for t in targets:
        if not t.status.get("runner_modules"):
            continue  # holds no runner: writes nothing
        dist = t.status.get("dist")
        ranked = isinstance(dist, list) and len(dist) == 2 and dist[1] > 1
        writers.setdefault(f"rank-{dist[0]:03d}" if ranked else "", set()).add(engine(t.proc.pid))
    if all(len(engines) == 1 for engines in writers.values()):
        return {t.proc.pid: out for t in targets}
    return {t.proc.pid: out / f"engine-{engine(t.proc.pid)}" for t in targets}


def not_recorded(proc: proctree.Proc, reason: str) -> str:
    """The sentence that names a process the recording lacks."""
    role = f" ({proc.role})" if proc.role != "other" else ""
    return f"pid {proc.pid}{role} was not recorded: {reason}"


def _for_manifest(missing: list[tuple[proctree.Proc, str]]) -> list[str]:
    """``not_recorded`` sentences within the control request's bounds: short (the hint
    on enabling recording is for the terminal), ASCII (JSON escapes the rest 6-fold)."""
    sentences = [
        not_recorded(p, reason.replace(f"; {ENABLE_HINT}", "")).encode("ascii", "replace").decode()
        for p, reason in missing
    ]
    limit = control.MAX_NOT_RECORDED
    if len(sentences) > limit:
        sentences[limit - 1 :] = [f"{len(sentences) - limit + 1} more processes were not recorded"]
    cut = control.MAX_SENTENCE_CHARS
    return [s if len(s) <= cut else s[: cut - 3] + "..." for s in sentences]


def _start(t: Target, args: dict[str, Any]) -> dict[str, Any]:
    """``start`` with ``args``; an agent of an older mgtrace, which knows no
    ``not_recorded``, records without it (the terminal still names those processes)."""
    try:
        return control.send(t.socket, "start", args)
    except control.ControlError as exc:
        if "not_recorded" not in args or "takes no argument 'not_recorded'" not in exc.message:
            raise
    return control.send(t.socket, "start", {k: v for k, v in args.items() if k != "not_recorded"})


def stop_pid(pid: int) -> list[Target]:
    """Stop every agent in ``pid``'s tree that is recording (or armed, or closing): for a
    recording whose ``mgtrace record`` was killed before it could stop it. Injects nothing:
    a process without an agent records nothing."""
    targets = []
    for p in engine_tree(pid):
        path = control.engine_socket_path(p.pid)
        if not path.exists():
            continue
        try:
            status = control.send(path, "status", timeout_s=10.0)
        except control.ControlError:
            continue
        if status.get("state") in BUSY:
            targets.append(Target(p, path, "plugin", status))
    _stop_all(targets)
    return targets


def _busy(pid: int, out: object) -> str:
    return f"process {pid} is already recording into {out}; stop that recording first"


def _stop_all(targets: list[Target]) -> None:
    global _stopping
    was, _stopping = _stopping, True
    try:
        for t in targets:
            try:
                t.status = control.send(t.socket, "stop", timeout_s=60.0)
            except control.ControlError as exc:
                t.status = {**t.status, "state": "gone", "error": exc.message}
    finally:
        _stopping = was


def launch(
    command: list[str],
    out: Path,
    *,
    duration_s: float | None,
    max_steps: int | None,
    on_poll: Callable[[list[Target]], bool] | None = None,
    refusals: dict[int, str] | None = None,
) -> int:
    """Run ``command`` with recording armed from its first step; returns its exit code.
    ``on_poll`` gets the recording processes every poll until it returns False;
    ``refusals`` collects, by process id, why an agent refused to record (the engine's
    own log says it too, but among the engine's lines)."""
    if not command:
        raise UsageError("give the engine command after --, e.g. -- vllm serve MODEL")
    env = dict(os.environ)
    env[ENV_DIR] = str(out.resolve())
    # each engine the command starts records into out/engine-PID (``lift_single_engine``)
    env[ENV_PER_ENGINE] = "1"
    env.pop(ENV_ENGINE, None)  # an engine id of our own environment is none of its engines
    if max_steps is not None:
        env[ENV_MAX_STEPS] = str(max_steps)
    if duration_s is not None:
        env[ENV_DURATION] = str(duration_s)
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise UsageError(f"cannot start {command[0]}: {exc.strerror or exc}") from None

    def forward(signum: int, _frame: object) -> None:
        # the engine decides how to end (it closes its trace at exit); mgtrace waits for it
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    interrupts = 0

    def interrupt(_signum: int, _frame: object) -> None:
        # only the first Ctrl-C stops: a repeated one would cut short the stop and the wait
        # for the engine's exit, leaving it recording with nobody to stop it
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            raise KeyboardInterrupt
        if interrupts == 2:  # os.write: print could re-enter a write the signal interrupted
            os.write(2, b"mgtrace: stopping, please wait\n")

    with _handlers(forward), _handlers(interrupt, (signal.SIGINT,)):
        try:
            while child.poll() is None:
                if on_poll is not None or refusals is not None:
                    targets = _live_targets(child.pid)
                    if refusals is not None:
                        refusals.update(_refusals(targets))
                    if on_poll is not None and not on_poll(targets):
                        on_poll = None
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            # bounded without the engine: a gone agent fails its stop at once, a dead
            # engine ends the wait
            targets = _live_targets(child.pid)
            _stop_all([t for t in targets if t.status.get("state") == "recording"])
            _interrupt(child)
    return child.returncode if child.returncode is not None else 0


def _interrupt(child: subprocess.Popen[bytes]) -> None:
    """End the engine after Ctrl-C. A terminal's Ctrl-C reached the engine too (it is in
    mgtrace's foreground process group): a second SIGINT now would interrupt its exit, the
    close of its trace included, so it gets a while to end on its own first."""
    if not _shares_terminal_sigint(child.pid):
        child.send_signal(signal.SIGINT)
    else:
        try:
            child.wait(SIGINT_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGINT)
    try:
        child.wait(60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _shares_terminal_sigint(pid: int) -> bool:
    """Whether ``pid`` is in this process's group and that group is its terminal's
    foreground group, which is where a terminal sends Ctrl-C."""
    try:
        if os.getpgid(pid) != os.getpgrp():
            return False
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _refusals(targets: list[Target]) -> dict[int, str]:
    return {
        t.proc.pid: str(t.status.get("refusal") or "it refused to record")
        for t in targets
        if t.status.get("state") == "refused"
    }


def _live_targets(pid: int) -> list[Target]:
    out = []
    for p in proctree.tree(pid):
        if p.uid != os.geteuid():  # another user's (see engine_tree)
            continue
        path = control.engine_socket_path(p.pid)
        if path.exists():
            with contextlib.suppress(control.ControlError):
                out.append(Target(p, path, "plugin", control.send(path, "status", timeout_s=2)))
    return [t for t in out if t.status.get("state") not in (None, "idle") or t.status.get("steps")]
