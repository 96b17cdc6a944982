"""Activation with real processes: a stand-in engine that loads the plugin like vLLM, the
control socket, a client of another uid, gdb injection, and the ``record`` command."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mgtrace.errors import ManifestError
from mgtrace.recorder import attach, control, proctree
from mgtrace.recorder.agent import Agent
from mgtrace.recorder.features import V1_RUNNER_MODULE, V2_RUNNER_MODULE
from mgtrace.schemas.reader import TraceReader
from tests.attach_targets import gdb_script_with, python_target, queue_and_wait
from tests.conftest import REPO, skip_without_v1_runner
from tests.recorder_standin import has_v1_runner

pytestmark = [pytest.mark.slow, pytest.mark.peer]
pytest.importorskip("vllm")

PY = sys.executable
RECORD = (
    "import sys\n"
    "from mgtrace.errors import MgtraceError\n"
    "from mgtrace.recorder.cli import record\n"
    "try:\n"
    "    rv = record.main(sys.argv[1:], prog_name='mgtrace record', standalone_mode=False)\n"
    "except MgtraceError as e:\n"
    "    print('mgtrace: error: ' + e.message, file=sys.stderr); sys.exit(e.exit_code)\n"
    "sys.exit(rv or 0)\n"
)
STANDIN = [PY, "-m", "tests.recorder_standin"]
# The stand-in engine runs the V1 runner where this vLLM has it (0.33), else V2 (0.34).
STANDIN_RUNNER = "v1" if has_v1_runner() else "v2"
RUNNER_MODULE = V1_RUNNER_MODULE if STANDIN_RUNNER == "v1" else V2_RUNNER_MODULE


def _wait(predicate: Any, timeout: float = 90.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _stand_in_engines(
    argv: list[str], count: int
) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """``argv`` started as the parent of ``count`` stand-in engines that each announce
    themselves with a READY line; yields it and their pids once every agent socket is up,
    and kills them all afterwards (those announced so far, if the start fails)."""
    parent = _spawn(argv)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        for _ in range(count):
            line = parent.stdout.readline()
            assert line.startswith("READY"), line
            pids.append(int(line.split()[1]))
        for pid in pids:
            _wait(lambda pid=pid: control.socket_path(pid).exists(), what="the agent socket")
        yield parent, pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(30)


def _spawn(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[subprocess.Popen[str]]:
    proc = _spawn([*STANDIN, "--sleep", "0.02"])
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    _wait(lambda: control.socket_path(proc.pid).exists(), what="the agent socket")
    yield proc
    proc.terminate()
    proc.wait(30)


def _record_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", RECORD, *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )


def test_activation_through_the_socket(engine: subprocess.Popen[str], tmp_path: Path) -> None:
    sock = control.socket_path(engine.pid)
    assert control.send(sock, "status")["state"] == "idle"  # inert until asked
    out = tmp_path / "t"
    control.send(sock, "start", {"out": str(out)})
    _wait(lambda: control.send(sock, "status").get("steps", 0) >= 4, what="recorded steps")
    result = control.send(sock, "stop")
    assert result["state"] == "idle" and result["complete"] and result["hook_errors"] == 0
    reader = TraceReader(out)
    assert reader.complete and reader.manifest.run.runner == STANDIN_RUNNER
    con = reader.connect()
    n_steps = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    assert n_steps == result["steps"] >= 4
    assert con.execute("SELECT count(*) FROM launches").fetchone()[0] > 0
    assert engine.poll() is None  # the engine kept running through start and stop
    # failing control: a request outside the fixed command set is refused, nothing starts
    with pytest.raises(control.ControlError, match="unknown command"):
        control.send(sock, "exec", {"code": "print(1)"})
    with pytest.raises(control.ControlError, match="absolute path"):
        control.send(sock, "start", {"out": "relative/dir"})
    assert control.send(sock, "status")["state"] == "idle"


def test_record_command_on_a_running_engine(engine: subprocess.Popen[str], tmp_path: Path) -> None:
    out = tmp_path / "cli"
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert "3 steps" in proc.stdout
    assert f"process {engine.pid}: agent via plugin" in proc.stdout
    reader = TraceReader(out)
    assert reader.complete and reader.rows("steps") == 3
    # failing control: a second run into the same directory is refused in one sentence
    again = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "3")
    assert again.returncode == 2 and "already exists" in again.stderr
    assert "Traceback" not in again.stderr


def _client_as(uid: int | None, path: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from pathlib import Path; from mgtrace.recorder import control\n"
        "try:\n    print(control.send(Path(sys.argv[1]), 'status')['pid'])\n"
        "except control.ControlError as e:\n    print(e.message); sys.exit(3)\n"
    )
    prefix = (
        [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    )
    return subprocess.run(
        [*prefix, PY, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run a client as another user",
)
def test_another_uid_is_refused(engine: subprocess.Popen[str], tmp_path: Path) -> None:
    # the agent's own socket sits in a 0700 directory: another user cannot even connect
    other = _client_as(65534, control.socket_path(engine.pid))
    assert other.returncode == 3 and "Permission denied" in other.stdout
    # with the directory open, the kernel-reported peer uid is still refused
    # (pytest's own temporary directories are private to root, so use one under /tmp)
    open_dir = Path(tempfile.mkdtemp(prefix="mgtrace-open-", dir="/tmp"))
    open_dir.chmod(0o777)
    server = control.ControlServer(Agent(), path=open_dir / "agent.sock")
    server.start()
    try:
        server.path.chmod(0o666)
        refused = _client_as(65534, server.path)
        assert refused.returncode == 3 and "accepts only its own user" in refused.stdout, refused
        assert server.refused == 1
        # failing control: the same client as the agent's own user is answered
        same = _client_as(None, server.path)
        assert same.returncode == 0 and same.stdout.strip() == str(os.getpid())
    finally:
        server.close()
        shutil.rmtree(open_dir, ignore_errors=True)


def test_a_second_record_is_refused_and_leaves_the_first_alone(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    """An engine that records already is not joined by a second ``record`` (whose stop
    would end the first one's trace): it is refused in one sentence, and the first goes on."""
    sock = control.socket_path(engine.pid)
    first, second = tmp_path / "first", tmp_path / "second"
    control.send(sock, "start", {"out": str(first)})
    try:
        _wait(lambda: control.send(sock, "status")["state"] == "recording", what="recording")
        proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(second), "--max-steps", "2")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip() == (
            f"mgtrace: error: process {engine.pid} is already recording into {first}; "
            "stop that recording first"
        )
        assert control.send(sock, "status")["state"] == "recording"
        assert not second.exists()
        with pytest.raises(control.ControlError, match=f"already recording into {first}"):
            control.send(sock, "start", {"out": str(second)})
    finally:
        result = control.send(sock, "stop", timeout_s=60.0)
    assert result["complete"] and TraceReader(first).complete


def test_an_output_that_cannot_be_written_is_refused_before_anything_starts(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "trace"
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"mgtrace: error: cannot write the trace to {out}: {tmp_path / 'file'} is not a directory"
    )
    assert control.send(control.socket_path(engine.pid), "status")["state"] == "idle"


def _record_bg(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-c", RECORD, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_to_record_stops_the_engine_recording(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    """SIGTERM (or SIGHUP) ends a recording as Ctrl-C does: the agent is stopped, the trace
    finished, and the exit status says which signal; the engine does not go on recording
    with nobody left to stop it."""
    sock = control.socket_path(engine.pid)
    out = tmp_path / "term"
    rec = _record_bg("--engine-pid", str(engine.pid), "-o", str(out))
    try:

        def recording() -> bool:  # this run's (an earlier one's counts linger while idle)
            status = control.send(sock, "status")
            return status["state"] == "recording" and status["out"] == str(out)

        _wait(recording, what="recording")
        rec.send_signal(signal.SIGTERM)
        stdout, stderr = rec.communicate(timeout=120)
        assert rec.returncode == 128 + signal.SIGTERM, stderr
        assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
        assert control.send(sock, "status")["state"] == "idle"
        assert TraceReader(out).complete and f"-> {out}" in stdout
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        control.send(sock, "stop", timeout_s=60.0)


def test_ctrl_c_to_record_reports_the_trace_and_exits_130(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    """One Ctrl-C stops the recording, reports it, and exits 130 as --help says (was 0)."""
    sock = control.socket_path(engine.pid)
    out = tmp_path / "int"
    rec = _record_bg("--engine-pid", str(engine.pid), "-o", str(out))
    try:
        _wait(lambda: control.send(sock, "status").get("out") == str(out), what="recording")
        _wait(lambda: control.send(sock, "status").get("steps"), what="a recorded step")
        rec.send_signal(signal.SIGINT)
        stdout, stderr = rec.communicate(timeout=120)
        assert rec.returncode == 130, stdout + stderr
        assert "stopped by SIGINT" in stderr and "Traceback" not in stderr
        assert TraceReader(out).complete and f"-> {out}" in stdout
        assert control.send(sock, "status")["state"] == "idle"
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        control.send(sock, "stop", timeout_s=60.0)


@pytest.fixture
def bare_python(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A running Python process without the plugin."""
    script = tmp_path / "target.py"
    script.write_text("import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.02)\n")
    target = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "up"
        yield target
    finally:
        target.kill()
        target.wait()


def _ptraceable(pid: int) -> proctree.Proc:
    """``pid`` as a ``Proc``; the test is skipped where this process may not ptrace it, or
    where gdb cannot queue code in a throwaway process either."""
    ok, why = attach.inject.ptrace_permitted(pid)
    if ok:
        ok, why = attach.inject.gdb_injection_works()
    if not ok:
        pytest.skip(why)
    proc = proctree.read_proc(pid)
    assert proc is not None
    return proc


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_gdb_injection_starts_the_agent(bare_python: subprocess.Popen[str]) -> None:
    target = bare_python
    proc = proctree.read_proc(target.pid)
    assert proc is not None and proc.is_python
    # failing control: without injection there is no agent, and the message says how
    with pytest.raises(attach.AttachError, match="install mgtrace"):
        attach.connect(proc, allow_inject=False)
    t = attach.connect(_ptraceable(target.pid))
    assert t.how == "gdb"
    status = control.send(t.socket, "status")
    assert status["pid"] == target.pid and status["runner_modules"] == []
    assert target.poll() is None


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_remote_exec_runs_the_payload_file_and_removes_it(
    bare_python: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEP 768 needs Python 3.14 on both sides. Its contract (run this file in that process
    at a safe point) is stood in for by gdb running the file's text, so that what mgtrace
    does around the call is exercised on any Python."""
    calls: list[tuple[int, str, str]] = []

    def remote_exec(pid: int, path: str) -> None:
        text = Path(path).read_text()
        calls.append((pid, path, text))
        assert text == attach.inject.payload()
        attach.inject.via_gdb(pid)  # runs payload(): the same text as the file

    monkeypatch.setattr(sys, "remote_exec", remote_exec, raising=False)
    t = attach.connect(_ptraceable(bare_python.pid))
    assert t.how == "remote_exec" and [c[0] for c in calls] == [bare_python.pid]
    assert control.send(t.socket, "status")["pid"] == bare_python.pid
    assert not Path(calls[0][1]).exists()  # the agent answered: its script is gone


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_a_refused_remote_exec_falls_back_to_gdb(
    bare_python: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3.14 mgtrace attaching to an engine on another Python version: the target
    refuses the remote execution, and gdb starts the agent instead."""
    files: list[str] = []

    def remote_exec(pid: int, path: str) -> None:
        files.append(path)
        raise RuntimeError("the target is not running a compatible Python version")

    monkeypatch.setattr(sys, "remote_exec", remote_exec, raising=False)
    t = attach.connect(_ptraceable(bare_python.pid))
    assert t.how == "gdb" and len(files) == 1 and not Path(files[0]).exists()
    assert control.send(t.socket, "status")["pid"] == bare_python.pid


def _script_target(tmp_path: Path, name: str, body: str) -> subprocess.Popen[str]:
    """A Python process running ``body`` after printing 'up'; skipped where gdb may not
    attach to it."""
    return python_target(tmp_path, name, "import threading, time\nprint('up', flush=True)\n" + body)


SLEEPS = "for _ in range(100):\n    time.sleep(0.02)\nprint('done', flush=True)\n"
QUEUED = "print('queued code ran', flush=True)\n"


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_gdb_queues_code_and_the_interrupted_sleep_goes_on(tmp_path: Path) -> None:
    """The target is stopped inside ``time.sleep``; after the queued call it runs the code
    at its next safe point and finishes its loop as if nothing had happened."""
    target = _script_target(tmp_path, "sleeper", SLEEPS)
    attach.inject._queue(target.pid, QUEUED)
    out, err = target.communicate(timeout=30)
    assert target.returncode == 0, err
    assert out.split() == ["queued", "code", "ran", "done"], out


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_every_one_of_several_targets_survives_the_queue_and_runs_the_code(
    tmp_path: Path,
) -> None:
    """Fresh targets, each stopped at a different address (ASLR): when the program counter
    was restored first, gdb then refused the stack pointer in about half of them, and the
    target crashed (SIGSEGV) after reporting the code queued."""
    for i in range(6):
        target = _script_target(tmp_path, f"sleeper{i}", SLEEPS)
        attach.inject._queue(target.pid, QUEUED)
        out, err = target.communicate(timeout=30)
        assert target.returncode == 0, (i, target.returncode, err[-500:])
        assert out.split() == ["queued", "code", "ran", "done"], (i, out)


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_gdb_without_the_register_restore_breaks_the_target(tmp_path: Path) -> None:
    """Failing control for the test above: the same script with the saved registers not
    written back leaves the target on the program's entry point; it does not finish."""
    broken = gdb_script_with(tmp_path, "        restore(thread, saved)\n", "        pass\n")
    target = _script_target(tmp_path, "sleeper", SLEEPS)
    returncode, out = queue_and_wait(target, QUEUED, broken, 10)
    assert returncode != 0 and "done" not in out


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_ctrl_c_while_gdb_holds_the_target_lets_gdb_restore_it(tmp_path: Path) -> None:
    """Ctrl-C arrives while gdb has the target's registers rewritten for the call: mgtrace
    lets gdb finish (restore, detach) before it gives up; a gdb killed there left the
    target running from the middle of the call, and it crashed."""
    marker = tmp_path / "in-call"
    text = attach.inject.GDB_SCRIPT.read_text()
    step = '    set_reg("pc", function)\n'
    assert text.count(step) == 1
    slow = tmp_path / "gdb_queue_slow.py"
    hold = f"    open({str(marker)!r}, 'w').close()\n    import time\n    time.sleep(2)\n"
    slow.write_text(text.replace(step, step + hold))
    target = _script_target(tmp_path, "sleeper", SLEEPS)

    def interrupt() -> None:
        _wait(marker.exists, what="gdb inside the call")
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            attach.inject._queue(target.pid, QUEUED, script=slow)
            time.sleep(60)  # the interrupt lands here where gdb finished first
        out, err = target.communicate(timeout=30)
    finally:
        thread.join()
        if target.poll() is None:
            target.kill()
            target.wait()
    assert target.returncode == 0, err[-500:]
    assert "done" in out.split(), out


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_gdb_calls_on_a_thread_in_a_system_call_not_on_a_busy_one(tmp_path: Path) -> None:
    """The main thread computes (live registers), a second thread sleeps: the call is made
    on the sleeping thread and the main thread's result is exact."""
    busy = (
        "threading.Thread(target=lambda: [time.sleep(0.01) for _ in range(400)]).start()\n"
        "total, t0 = 0.0, time.monotonic()\n"
        "while time.monotonic() - t0 < 4:\n"
        "    for i in range(1000):\n"
        "        total += 0.5\n"
        "print('exact', total == 0.5 * 1000 * (total // 500.0), flush=True)\n"
    )
    target = _script_target(tmp_path, "busy", busy)
    attach.inject._queue(target.pid, QUEUED)
    out, err = target.communicate(timeout=30)
    assert target.returncode == 0, err
    assert "queued code ran" in out and "exact True" in out, out


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_gdb_refuses_when_no_thread_waits_in_a_system_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread, always computing: no safe place for the call. The refusal is one
    sentence and the target is untouched (the test above, with a sleeping second thread,
    is the control where the same computation does get the call)."""
    monkeypatch.setattr(attach.inject, "BUSY_RETRIES", 3)
    busy = (
        "total, t0 = 0, time.monotonic()\n"
        "while time.monotonic() - t0 < 4:\n"
        "    total += 1\n"
        "print('done', total > 0, flush=True)\n"
    )
    target = _script_target(tmp_path, "busy1", busy)
    with pytest.raises(attach.inject.InjectError, match="waiting in a system call") as err:
        attach.inject._queue(target.pid, QUEUED)
    assert "\n" not in str(err.value)
    out, errout = target.communicate(timeout=30)
    assert target.returncode == 0 and out.split() == ["done", "True"], errout


def test_gdb_is_not_tried_on_the_engine_where_the_probe_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The throwaway probe's verdict decides: a refusal names its reason in one sentence
    and the engine is never attached."""
    attached: list[int] = []
    monkeypatch.setattr(attach.inject, "via_remote_exec", lambda pid: None)
    monkeypatch.setattr(attach.inject, "ptrace_permitted", lambda pid: (True, ""))
    monkeypatch.setattr(attach.inject, "via_gdb", attached.append)
    monkeypatch.setattr(
        attach.inject, "gdb_injection_works", lambda: (False, "on a test process: X")
    )
    with pytest.raises(attach.AttachError) as err:
        attach._inject(12345)
    assert "on a test process: X" in str(err.value) and "\n" not in str(err.value)
    assert attached == []
    # failing control: where the probe works, gdb goes on to the engine
    monkeypatch.setattr(attach.inject, "gdb_injection_works", lambda: (True, ""))
    assert attach._inject(12345) == ("gdb", None) and attached == [12345]


def test_both_refusals_are_named_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the fallback: when gdb may not attach either, the error says why for
    both ways, and nothing is left behind."""
    files: list[str] = []

    def remote_exec(pid: int, path: str) -> None:
        files.append(path)
        raise RuntimeError("the target is not running a compatible Python version")

    monkeypatch.setattr(sys, "remote_exec", remote_exec, raising=False)
    monkeypatch.setattr(attach.inject, "ptrace_permitted", lambda pid: (False, "no ptrace here"))
    target = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    try:
        proc = proctree.read_proc(target.pid)
        assert proc is not None
        with pytest.raises(attach.AttachError) as err:
            attach.connect(proc)
    finally:
        target.kill()
        target.wait()
    message = str(err.value)
    assert "compatible Python version" in message and "no ptrace here" in message
    assert "\n" not in message and not Path(files[0]).exists()


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_record_attaches_with_gdb_when_the_plugin_is_not_loaded(tmp_path: Path) -> None:
    engine = _spawn([*STANDIN, "--no-plugin", "--sleep", "0.02", "--name", "vllm-standin"])
    try:
        assert engine.stdout is not None and engine.stdout.readline().startswith("READY")
        assert not control.socket_path(engine.pid).exists()
        _ptraceable(engine.pid)
        out = tmp_path / "gdb"
        proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "3")
        assert proc.returncode == 0, proc.stderr
        assert f"process {engine.pid} (api-server): agent via gdb" in proc.stdout
        reader = TraceReader(out)
        assert reader.complete and reader.rows("steps") == 3
        assert engine.poll() is None
    finally:
        engine.terminate()
        engine.wait(30)


def test_record_refuses_a_process_that_is_not_an_engine(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        proc = _record_cli("--engine-pid", str(sleeper.pid), "-o", str(tmp_path / "x"))
        assert proc.returncode == 2
        assert proc.stderr.strip() == (
            f"mgtrace: error: process {sleeper.pid} is not a vLLM engine "
            "(no vLLM process in its tree)"
        )
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_engine_that_dies_while_recording_is_named_with_its_steps(tmp_path: Path) -> None:
    """An engine killed mid-recording: its steps so far are reported, with the process gone
    and the trace incomplete (was: "no step was recorded")."""
    engine = _spawn([*STANDIN, "--sleep", "0.02"])
    try:
        assert engine.stdout is not None and engine.stdout.readline().startswith("READY")
        sock = control.socket_path(engine.pid)
        _wait(sock.exists, what="the agent socket")
        out = tmp_path / "killed"
        rec = _record_bg("--engine-pid", str(engine.pid), "-o", str(out))
        # steps on disk: those a killed process had not flushed die with it
        _wait(
            lambda: (s := control.send(sock, "status")).get("steps", 0) >= 3 and s["bytes"] > 0,
            what="recording",
        )
        engine.kill()
        engine.wait()
        _, stderr = rec.communicate(timeout=120)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert rec.returncode == 2, stderr
    line = stderr.strip()
    assert line.startswith(f"mgtrace: error: process {engine.pid} went away after "), line
    assert line.endswith(f" steps; the trace in {out} is incomplete"), line


def test_force_keeps_the_old_trace_when_the_pid_is_refused(tmp_path: Path) -> None:
    """--force replaces the old trace only once recording can start: a pid that is not an
    engine leaves it in place."""
    out = tmp_path / "old"
    out.mkdir()
    (out / "manifest.json").write_text('{"format": "mgtrace-trace"}')
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        proc = _record_cli("--engine-pid", str(sleeper.pid), "-o", str(out), "--force")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 2 and "is not a vLLM engine" in proc.stderr
    assert (out / "manifest.json").is_file()


def test_a_recording_of_no_step_leaves_no_trace(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    """A --duration that ran out before the engine's next step began said "no step was
    recorded" (exit 2) yet left a trace of no step, which the next run refused without
    --force; in launch mode it even exited 0. Now nothing is left (an empty folder stays
    empty), the message names the duration, and the next run into the same path records.
    Control: that next run."""
    out = tmp_path / "none"
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--duration", "1e-9")
    assert proc.returncode == 2 and "no step was recorded in the 1e-09 s of --duration" in (
        proc.stderr
    ), proc.stderr
    assert not out.exists()
    out.mkdir()
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--duration", "1e-9")
    assert proc.returncode == 2 and out.is_dir() and not any(out.iterdir()), proc.stderr
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "2")
    assert proc.returncode == 0 and TraceReader(out).rows("steps") == 2, proc.stderr
    # a link to a folder still to be made: the link stays, and so does nothing where it leads
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(link), "--duration", "1e-9")
    assert proc.returncode == 2 and link.is_symlink() and not link.exists(), proc.stderr
    launched = tmp_path / "launched"
    proc = _record_cli("-o", str(launched), "--duration", "1e-9", "--", *STANDIN, "--steps", "5")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"recorded no step in the 1e-09 s of --duration into {launched}" in proc.stderr
    assert not launched.exists()


def _old_trace(out: Path) -> dict[str, bytes]:
    """A small simulated trace at ``out``; returns its files' bytes."""
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    simulate(SimConfig(steps=12, output=out).validate())
    return {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()}


def test_force_keeps_the_old_trace_when_nothing_is_recorded(tmp_path: Path) -> None:
    """--force deleted the old trace as soon as recording started, so a recording of nothing
    (an engine that ran no step) cost the user both. Control: a recording that holds steps
    replaces it, and nothing is left beside it under a hidden name."""
    out = tmp_path / "t"
    before = _old_trace(out)
    proc = _record_cli("-o", str(out), "--force", "--", PY, "-c", "pass")
    assert proc.returncode == 2, proc.stderr
    assert f"the old trace at {out} was kept" in proc.stderr, proc.stderr
    assert {str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file()} == (
        before
    )
    assert [p.name for p in tmp_path.iterdir()] == ["t"]
    # control: a recording with steps takes the old trace's place
    proc = _record_cli(
        "-o", str(out), "--force", "--max-steps", "3", "--", *STANDIN, "--steps", "5"
    )
    assert proc.returncode == 0, proc.stderr
    assert TraceReader(out).rows("steps") == 3 and "was kept" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["t"]
    # what a killed mgtrace left aside (its pid is gone) is cleared before the next one
    # moves the trace aside, and so never stands in the engine's way
    _old_trace(tmp_path / ".t.999999999-0.old")
    proc = _record_cli(
        "-o", str(out), "--force", "--max-steps", "2", "--", *STANDIN, "--steps", "5"
    )
    assert proc.returncode == 0, proc.stderr
    assert TraceReader(out).rows("steps") == 2
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_launch_mode_records_from_the_first_step(tmp_path: Path) -> None:
    out = tmp_path / "launch"
    proc = _record_cli("-o", str(out), "--max-steps", "3", "--", *STANDIN, "--steps", "5")
    assert proc.returncode == 0, proc.stderr
    reader = TraceReader(out)
    assert reader.complete
    steps = reader.connect().execute("SELECT min(step), max(step) FROM steps").fetchone()
    assert steps == (0, 2)
    assert f"recorded steps 0..2 on 1 rank(s) into {out} (complete" in proc.stdout


def test_launch_mode_records_an_engine_without_speculative_decoding(tmp_path: Path) -> None:
    """A V1 engine without a speculative config (its states copied by preprocess_mamba
    itself) records from the command line like any other, and its trace replays clean."""
    skip_without_v1_runner()
    out = tmp_path / "k0"
    proc = _record_cli(
        "-o", str(out), "--max-steps", "8", "--", *STANDIN, "--steps", "10", "--no-spec"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reader = TraceReader(out)
    assert reader.complete and reader.rows("steps") == 8 and reader.manifest.errors == {}
    kernels = reader.connect().execute("SELECT DISTINCT kernel::VARCHAR FROM launches").fetchall()
    assert kernels == [("precopy",)]
    replay = subprocess.run(
        [PY, "-m", "mgtrace", "replay", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert replay.returncode == 0 and replay.stdout.startswith("clean: 8 steps"), replay.stdout


def test_engines_a_launched_command_starts_record_into_traces_of_their_own(
    tmp_path: Path,
) -> None:
    """``record -- sh -c "vllm serve A & vllm serve B"``: both engines took their folder
    from the environment and wrote one trace. Each now records into DIR/engine-PID (PID:
    its first process with the plugin), and the end names every trace."""
    code = (
        "import subprocess, sys\n"
        "kids = [subprocess.Popen([sys.executable, '-m', 'tests.recorder_standin', "
        "'--steps', '5']) for _ in range(2)]\n"
        "sys.exit(max(k.wait() for k in kids))\n"
    )
    out = tmp_path / "two"
    proc = _record_cli("-o", str(out), "--max-steps", "3", "--", PY, "-c", code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = sorted(int(line.split()[1]) for line in proc.stdout.splitlines() if "READY" in line)
    folders = [out / f"engine-{pid}" for pid in pids]
    assert len(folders) == 2 and sorted(out.iterdir()) == folders
    assert "the command exited with status 0; it ran 2 engines, each with a trace" in proc.stdout
    for pid, folder in zip(pids, folders, strict=True):
        reader = TraceReader(folder)
        assert reader.complete and reader.rows("steps") == 3
        assert reader.manifest.source["pid"] == pid
        assert f"recorded steps 0..2 on 1 rank(s) into {folder} (complete" in proc.stdout


def test_a_killed_launcher_leaves_the_engines_trace_readable(tmp_path: Path) -> None:
    """mgtrace killed while its engine records: the engine goes on, and its trace is a whole
    one at DIR/engine-PID, which DIR names (its move up to DIR is mgtrace's, at the end)."""
    out = tmp_path / "killed"
    rec = _record_bg("-o", str(out), "--", *STANDIN, "--steps", "40", "--sleep", "0.02")
    try:
        child = _launched_engine(rec)
        rec.kill()
        rec.wait()
        assert rec.stdout is not None  # the engine's too: it prints DONE as it ends
        _wait(lambda: "DONE" in rec.stdout.readline(), what="the engine's end")
        folder = out / f"engine-{child}"
        _wait(lambda: TraceReader(folder).complete, what="the trace's close")
        assert TraceReader(folder).rows("steps") == 40
        with pytest.raises(ManifestError, match=rf"holds one trace per engine \(engine-{child}\)"):
            TraceReader(out)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()


def test_sigterm_in_launch_mode_goes_to_the_engine_and_is_waited_for(tmp_path: Path) -> None:
    """mgtrace passes SIGTERM on to the engine it started and waits for it (it is not left
    running on its own); the engine's death by the signal is exit 128+15, named."""
    out = tmp_path / "launched"
    rec = _record_bg("-o", str(out), "--", *STANDIN, "--sleep", "0.02")
    try:
        child = _launched_engine(rec)
        rec.send_signal(signal.SIGTERM)
        stdout, stderr = rec.communicate(timeout=120)
        assert rec.returncode == 128 + signal.SIGTERM, stdout + stderr
        assert "engine was killed by SIGTERM" in stdout + stderr
        assert not Path(f"/proc/{child}").exists()
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()


def test_launch_mode_says_when_the_recording_ended_before_the_engine(tmp_path: Path) -> None:
    """At --max-steps the recording ends and the engine goes on serving, with mgtrace
    waiting for it: one line says so (the wait looked like a hang), and SIGTERM still ends
    both. Control: a launch without a limit says nothing of the kind while it records."""
    out = tmp_path / "limited"
    rec = _record_bg("-o", str(out), "--max-steps", "3", "--", *STANDIN, "--sleep", "0.02")
    try:
        # stderr holds the engine's lines too; read in a thread, so that a notice that
        # never comes fails the wait instead of blocking a read
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(rec.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        line = _wait(
            lambda: next((x for x in list(lines) if x.startswith("mgtrace:")), None),
            timeout=60,
            what="mgtrace's notice",
        )
        assert line.startswith("mgtrace: the recording ended after 3 steps; the engine goes on")
        assert rec.poll() is None  # still waiting for the engine
        rec.send_signal(signal.SIGTERM)
        rec.wait(timeout=120)
        reader.join(timeout=10)
        assert rec.stdout is not None
        stdout = rec.stdout.read()
        assert rec.returncode == 128 + signal.SIGTERM
        assert TraceReader(out).rows("steps") == 3 and "recorded steps 0..2" in stdout
    finally:
        _kill_with_its_engine(rec)
    unlimited = _record_bg("-o", str(tmp_path / "all"), "--", *STANDIN, "--sleep", "0.02")
    try:
        _launched_engine(unlimited)
        time.sleep(2)  # several polls
        unlimited.send_signal(signal.SIGTERM)
        _, stderr = unlimited.communicate(timeout=120)
        assert "the recording ended" not in stderr
    finally:
        _kill_with_its_engine(unlimited)


def _kill_with_its_engine(rec: subprocess.Popen[str]) -> None:
    """A launcher a failed check left running, and the engine it started (which, an engine
    that never ends on its own, would outlive it)."""
    if rec.poll() is not None:
        return
    kids = [p.pid for p in proctree.tree(rec.pid)[1:]]
    rec.kill()
    rec.wait()
    for pid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _launched_engine(rec: subprocess.Popen[str]) -> int:
    """The pid of the stand-in engine that ``mgtrace record -- ...`` started, once it steps
    with its agent recording."""

    def engine_pid() -> int | None:
        kids = [p for p in proctree.tree(rec.pid)[1:] if "recorder_standin" in p.cmdline]
        return kids[0].pid if kids else None

    child = _wait(engine_pid, what="the engine process")
    _wait(lambda: control.socket_path(child).exists(), what="the engine's agent")
    _wait(lambda: control.send(control.socket_path(child), "status").get("steps"))
    return child


def test_a_second_ctrl_c_in_launch_mode_does_not_cut_the_stop_short(tmp_path: Path) -> None:
    """Ctrl-C, and another one while mgtrace stops the engine's recording (which waits for
    the step boundary, 2 s away): the second one ended mgtrace in the middle of the stop,
    leaving the engine running and recording with nobody to stop it. Now the stop goes on
    to the end (the engine stopped, then ended), and the exit is the first Ctrl-C's."""
    out = tmp_path / "launched"
    rec = _record_bg("-o", str(out), "--", *STANDIN, "--sleep", "2.0")
    child = None
    try:
        child = _launched_engine(rec)
        sock = control.socket_path(child)
        # just after a step boundary, so that the stop waits about 2 s for the next one
        steps = control.send(sock, "status")["steps"]
        _wait(lambda: control.send(sock, "status")["steps"] > steps, what="the next step")
        rec.send_signal(signal.SIGINT)
        time.sleep(0.3)
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=120)
        left_running = proctree.read_proc(child) is not None
        if left_running:  # it holds mgtrace's output pipes open
            os.kill(child, signal.SIGKILL)
        stdout, stderr = rec.communicate(timeout=60)
        assert not left_running, stdout + stderr
        assert rec.returncode == 130, stdout + stderr
        assert stderr.count("stopping, please wait") == 1, stderr
        # (the stand-in engine's own traceback of its KeyboardInterrupt shares stderr)
        assert "/mgtrace/" not in stderr and "interrupted" not in stderr, stderr
        assert "engine was killed by SIGINT; recorded steps 0.." in stdout, stdout + stderr
        assert TraceReader(out).complete
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
        if child is not None and proctree.read_proc(child) is not None:
            os.kill(child, signal.SIGKILL)


def test_launch_mode_says_when_the_engine_recorded_nothing(tmp_path: Path) -> None:
    """A command that runs no vLLM engine step leaves no trace: one sentence and exit 2, not
    a claim that traces are there."""
    out = tmp_path / "nothing"
    proc = _record_cli("-o", str(out), "--", PY, "-c", "raise SystemExit(3)")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "exited with status 3 and recorded nothing" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_mode_names_the_agents_refusal(tmp_path: Path) -> None:
    """An engine whose vLLM lacks a hook target records nothing: the one sentence names the
    refusal, not a missing plugin. Control: the same command without the refusal is told
    apart by its message."""
    skip_without_v1_runner()  # --missing-launcher takes V1's launcher away
    refused = _record_cli(
        "-o",
        str(tmp_path / "r"),
        "--",
        *STANDIN,
        "--steps",
        "40",
        "--sleep",
        "0.05",
        "--missing-launcher",
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert "agent in process" in last and "refused to record" in last, refused.stderr
    assert "run_fused_postprocess" in last and "lacks mgtrace" not in last
    plain = _record_cli("-o", str(tmp_path / "p"), "--", PY, "-c", "pass")
    assert plain.returncode == 2 and "refused" not in plain.stderr


def test_armed_plugin_arms_when_the_runner_module_is_imported(tmp_path: Path) -> None:
    """vLLM loads plugins before a worker imports its runner: an agent armed from the
    environment must be waiting on the hooks the moment that import completes."""
    code = (
        "from tests import recorder_standin as s\n"
        "s.load_plugin_like_vllm()\n"
        "from mgtrace.recorder.agent import get_agent\n"
        "a = get_agent()\n"
        "print(a.state)\n"
        f"import {RUNNER_MODULE} as g\n"
        "print(a.state, g.GPUModelRunner.execute_model.__qualname__.split('.')[0])\n"
    )
    env = dict(os.environ, MGTRACE_RECORD_DIR=str(tmp_path / "armed"))
    proc = subprocess.run(
        [PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.stdout.split() == ["waiting", "armed", "Agent"], proc.stderr[-2000:]
    # failing control: without the environment the plugin stays inert (and imports nothing)
    env.pop("MGTRACE_RECORD_DIR")
    inert = code.split("import vllm")[0] + "import sys; print('vllm' in sys.modules)\n"
    proc = subprocess.run(
        [PY, "-c", inert], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.stdout.split() == ["idle", "False"], proc.stderr[-2000:]


def test_only_the_engines_processes_are_attached() -> None:
    """Given a shell above the engine (or pid 1), every Python process under it was a target,
    gdb injection included. Python's and torch's helper processes under the engine were
    named as not recorded on every run. Control: the rest of the tree under an engine
    process stays, and a helper with an agent is a target."""
    from mgtrace.recorder.proctree import Proc, engine_processes

    def proc(pid: int, ppid: int, name: str, cmd: str) -> Proc:
        return Proc(pid=pid, ppid=ppid, uid=0, name=name, cmdline=cmd)

    tree = [
        proc(1, 0, "bash", "bash"),
        proc(2, 1, "python3", "python3 notebook.py"),  # somebody else's Python
        proc(3, 1, "vllm", "python3 -m vllm.entrypoints.openai.api_server"),
        proc(4, 3, "VLLM::EngineCore", "python3 -c from multiprocessing.spawn import x"),
        proc(5, 4, "python3", "python3 -c from multiprocessing.resource_tracker import y"),
        proc(6, 1, "python3", "python3 agent_loaded.py"),
        proc(7, 4, "python3", "python3 -c from multiprocessing.spawn import z"),  # a worker
        proc(8, 4, "python3", "python3 /x/torch/_inductor/compile_worker/__main__.py"),
        proc(9, 8, "python3", "python3 -c from multiprocessing.spawn import w"),  # its pool
    ]
    kept = engine_processes(tree, lambda p: p.pid == 6)
    assert [p.pid for p in kept] == [3, 4, 6, 7]
    assert [p.pid for p in engine_processes(tree[2:5], lambda p: False)] == [3, 4]
    assert [p.pid for p in engine_processes(tree[2:5], lambda p: p.pid == 5)] == [3, 4, 5]


def test_the_engines_own_runtime_directory_is_where_its_agent_is_looked_for(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    """A shell whose XDG_RUNTIME_DIR differs from the engine's looked in the wrong place and
    went on to inject an agent into a process that had one. Control: the engine's socket is
    not under the shell's directory."""
    other = tmp_path / "other-runtime"
    other.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(other))
    out = tmp_path / "t"
    argv = [PY, "-c", RECORD, "--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "3"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"process {engine.pid}: agent via plugin" in proc.stdout
    assert TraceReader(out).rows("steps") == 3
    assert not (other / "mgtrace" / f"{engine.pid}.sock").exists()


def test_the_assembler_processes_of_a_recording_are_not_part_of_the_engine() -> None:
    """A recording's assembler process (a worker's child, with "vllm" in its command line)
    was taken for an API server and got gdb's injection. Control: the worker stays."""
    from mgtrace.recorder.proctree import Proc, engine_processes

    def proc(pid: int, ppid: int, name: str, cmd: str) -> Proc:
        return Proc(pid=pid, ppid=ppid, uid=0, name=name, cmdline=cmd)

    tree = [
        proc(3, 1, "VLLM::Worker_TP0", "python3 -c from multiprocessing.spawn import x"),
        proc(4, 3, "python3", "python3 -m mgtrace.recorder.outproc /x/vllm-run/rank-000 7"),
        proc(5, 4, "python3", "python3 -c from multiprocessing.resource_tracker import y"),
    ]
    assert tree[1].role == "mgtrace-assembler"
    assert [p.pid for p in engine_processes(tree, lambda p: False)] == [3]


def test_a_recording_engine_is_refused_before_anything_is_injected(
    engine: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that records already: its plugin says so before a process without an
    agent (listed first, as an API server is) gets code injected."""
    sock = control.socket_path(engine.pid)
    first = tmp_path / "first"
    control.send(sock, "start", {"out": str(first)})
    try:
        _wait(lambda: control.send(sock, "status")["state"] == "recording", what="recording")
        server = proctree.Proc(
            pid=2**22 + 1, ppid=1, uid=os.geteuid(), name="python3", cmdline="python3 -m vllm"
        )
        me = proctree.read_proc(engine.pid)
        assert me is not None
        monkeypatch.setattr(attach, "engine_tree", lambda pid: [server, me])
        injected: list[int] = []

        def inject(pid: int) -> tuple[str, Path | None]:
            injected.append(pid)
            raise attach.AttachError("not here")

        monkeypatch.setattr(attach, "_inject", inject)
        with pytest.raises(attach.AttachError, match="already recording"):
            attach.record_pid(engine.pid, tmp_path / "second", duration_s=1.0, max_steps=None)
        assert injected == []
    finally:
        control.send(sock, "stop", timeout_s=60.0)


def test_an_engine_that_ends_normally_while_recording_leaves_a_complete_trace(
    tmp_path: Path,
) -> None:
    """An engine that finishes its work closes its trace at exit: that is reported with the
    trace's own step count and exit 0 (was: "went away after N-1 steps ... incomplete",
    exit 2, from the last poll)."""
    engine = _spawn([*STANDIN, "--steps", "60", "--sleep", "0.05"])
    out = tmp_path / "ended"
    rec = None
    try:
        assert engine.stdout is not None and engine.stdout.readline().startswith("READY")
        sock = control.socket_path(engine.pid)
        _wait(sock.exists, what="the agent socket")
        rec = _record_bg("--engine-pid", str(engine.pid), "-o", str(out))
        _wait(lambda: control.send(sock, "status").get("out") == str(out), what="recording")
        assert engine.wait(300) == 0
        stdout, stderr = rec.communicate(timeout=120)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        if rec is not None and rec.poll() is None:
            rec.kill()
            rec.wait()
    reader = TraceReader(out)
    assert reader.complete
    assert rec.returncode == 0, stdout + stderr
    assert (
        f"pid {engine.pid}: exited; its trace holds {reader.rows('steps')} steps -> {out} "
        "(complete)"
    ) in stdout


def test_a_process_that_refuses_is_named_and_the_exit_says_so(tmp_path: Path) -> None:
    """Of two engine processes under one parent, one refuses (a vLLM without a launcher the
    hooks need): the summary named only the one that recorded, and the exit was 0."""
    skip_without_v1_runner()  # --missing-launcher takes V1's launcher away
    code = (
        "import subprocess, sys\n"
        "kids = [subprocess.Popen([sys.executable, '-m', 'tests.recorder_standin', "
        "'--sleep', '0.05', *extra]) for extra in ([], ['--missing-launcher'])]\n"
        "sys.exit(max(k.wait() for k in kids))\n"
    )
    with _stand_in_engines([PY, "-c", code], 2) as (parent, pids):
        good, bad = (p for p in proctree.tree(parent.pid)[1:] if p.pid in pids)
        if "--missing-launcher" in good.cmdline:
            good, bad = bad, good
        out = tmp_path / "mixed"
        proc = _record_cli("--engine-pid", str(parent.pid), "-o", str(out), "--max-steps", "3")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"pid {good.pid}: 3 steps" in proc.stdout
    assert f"process {bad.pid} did not record: this vLLM's V1 runner lacks" in proc.stderr
    assert "Traceback" not in proc.stderr
    # two engines under one parent: each has a folder of its own
    assert TraceReader(out / f"engine-{good.pid}").rows("steps") == 3, proc.stdout + proc.stderr


def test_two_engines_under_one_parent_record_into_traces_of_their_own(tmp_path: Path) -> None:
    """Two single-rank engines under one parent (two ``vllm serve`` started by one shell)
    both wrote rank 0 into one folder, and one of them failed. Each now records into
    DIR/engine-PID, said at the start; each is a whole trace, DIR itself names them, and
    --force replaces such a folder."""
    code = (
        "import subprocess, sys\n"
        "kids = [subprocess.Popen([sys.executable, '-m', 'tests.recorder_standin', "
        "'--sleep', '0.05']) for _ in range(2)]\n"
        "sys.exit(max(k.wait() for k in kids))\n"
    )
    out = tmp_path / "two"
    with _stand_in_engines([PY, "-c", code], 2) as (parent, pids):
        pids = sorted(pids)
        proc = _record_cli("--engine-pid", str(parent.pid), "-o", str(out), "--max-steps", "3")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        folders = [out / f"engine-{pid}" for pid in pids]
        assert (
            f"process {parent.pid} runs 2 engines; each records into a trace of its own: "
            f"{folders[0]}, {folders[1]}"
        ) in proc.stdout
        assert sorted(out.iterdir()) == folders
        for pid, folder in zip(pids, folders, strict=True):
            assert f"pid {pid}: 3 steps, " in proc.stdout and f"-> {folder}" in proc.stdout
            reader = TraceReader(folder)
            assert reader.complete and reader.rows("steps") == 3
            assert reader.manifest.source["pid"] == pid
        with pytest.raises(ManifestError, match=r"holds one trace per engine \(engine-"):
            TraceReader(out)
        again = _record_cli(
            "--engine-pid", str(parent.pid), "-o", str(out), "--max-steps", "2", "--force"
        )
    assert again.returncode == 0, again.stdout + again.stderr
    assert [TraceReader(f).rows("steps") for f in folders] == [2, 2]


def test_a_process_that_cannot_be_reached_is_named_and_in_the_manifest(tmp_path: Path) -> None:
    """Of two engine processes under one parent, one has no agent and none can be injected
    (no gdb): it was named only when nothing at all was recorded, so the other's trace
    looked whole. Now it is named on stderr and in the manifest of what was recorded."""
    code = (
        "import subprocess, sys\n"
        "rec = subprocess.Popen([sys.executable, '-m', 'tests.recorder_standin', '--sleep',"
        " '0.05'])\n"
        # a vLLM process without an agent (named so that this parent is not one); it ends
        # with its parent (its stdin closes)
        "bare = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()',"
        " 'v' + 'llm-helper'], stdin=subprocess.PIPE)\n"
        "sys.exit(rec.wait())\n"
    )
    with _stand_in_engines([PY, "-c", code], 1) as (parent, (good,)):
        bare = _wait(
            lambda: next((p for p in proctree.tree(parent.pid) if "vllm-helper" in p.cmdline), 0),
            what="the process without an agent",
        )
        out = tmp_path / "partial"
        argv = [PY, "-c", RECORD, "--engine-pid", str(parent.pid), "-o", str(out)]
        env = dict(os.environ, PATH=str(tmp_path))  # no gdb: nothing can be injected
        proc = subprocess.run(
            [*argv, "--max-steps", "3"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"pid {good}: 3 steps" in proc.stdout
    sentence = (
        f"pid {bare.pid} (api-server) was not recorded: process {bare.pid} has no mgtrace "
        "agent; gdb cannot attach (gdb is not installed)"
    )
    lines = [line for line in proc.stderr.splitlines() if "was not recorded" in line]
    assert len(lines) == 1 and lines[0].startswith(f"mgtrace: {sentence}; "), proc.stderr
    manifest = TraceReader(out).manifest
    assert manifest.source["not_recorded"] == [sentence]
    assert manifest.errors["process_not_recorded"] == {"count": 1, "first": sentence}
    assert TraceReader(out).rows("steps") == 3


def test_record_into_a_pipe_prints_plain_counters_and_ends_the_table(
    engine: subprocess.Popen[str], tmp_path: Path
) -> None:
    """With stdout not a terminal (``| tee log``) the live table shows only at the end: a
    plain counters line shows progress, and the summary starts on a line of its own (it
    ran on after the table's last line)."""
    out = tmp_path / "piped"
    proc = _record_cli("--engine-pid", str(engine.pid), "-o", str(out), "--max-steps", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(
        line.startswith(f"mgtrace: pid {engine.pid} ") and " steps, " in line for line in lines
    ), proc.stdout
    summary = f"pid {engine.pid}: 3 steps, "
    assert any(line.startswith(summary) for line in lines), proc.stdout
