"""The agent's control socket under hostile or unlucky conditions: a failed accept, a client
that hangs up or trickles, a runtime directory other users write, a stale-socket sweep
that meets another pid namespace's agent."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mgtrace.recorder import control

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
ABSENT = 999_999_990  # above any pid_max: no process of this namespace has it


class _Agent:
    def status(self) -> dict:
        return {"state": "idle"}


def test_a_failed_accept_does_not_end_the_control_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class OutOfFds(socket.socket):
        fails = 1

        def accept(self):  # type: ignore[no-untyped-def]
            if OutOfFds.fails:
                OutOfFds.fails -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return super().accept()

    monkeypatch.setattr(control.socket, "socket", OutOfFds)
    server = control.ControlServer(_Agent(), tmp_path / "1.sock")
    server.start()
    try:
        assert control.send(server.path, "status", timeout_s=5)["state"] == "idle"
        assert server._thread is not None and server._thread.is_alive()
    finally:
        server.close()


def test_a_client_gone_before_its_reply_does_not_kill_the_engine(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import signal, sys, time
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as an embedding program may leave it
        from mgtrace.recorder import control

        class Agent:
            def status(self):
                time.sleep(0.2)  # the client is gone by the time the reply goes out
                return {"state": "idle"}

        control.ControlServer(Agent(), control.Path(sys.argv[1])).start()
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    path = tmp_path / "1.sock"
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_RUNTIME_DIR=str(tmp_path))
    engine = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"
        for _ in range(3):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(path))
                sock.sendall(b'{"cmd": "status"}\n')
            time.sleep(0.4)
            assert engine.poll() is None, f"the engine died: {engine.returncode}"
    finally:
        engine.kill()
        engine.wait()


def test_a_trickling_client_is_cut_off_and_others_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "REQUEST_TIMEOUT_S", 1.0, raising=False)
    server = control.ControlServer(_Agent(), tmp_path / "1.sock")
    server.start()
    done = threading.Event()

    def trickle() -> None:  # one byte every 0.3 s (each recv alone returns in time)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(server.path))
            while not done.is_set():
                try:
                    sock.send(b" ")
                except OSError:
                    return
                time.sleep(0.3)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        assert control.send(server.path, "status", timeout_s=4)["state"] == "idle"
    finally:
        done.set()
        thread.join()
        server.close()


@pytest.mark.parametrize("spelling", ["{}", "{}/", "{}/."])
def test_a_world_writable_runtime_dir_gets_a_name_per_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    shared = tmp_path / "shared"  # as /tmp, /tmp/ or /dev/shm
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", spelling.format(shared))
    assert control.runtime_dir() == shared / f"mgtrace-{os.geteuid()}"


def test_a_private_runtime_dir_keeps_its_plain_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert control.runtime_dir() == tmp_path / "mgtrace"


def test_the_sweep_keeps_a_listening_socket_whose_pid_is_not_ours(tmp_path: Path) -> None:
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # another namespace's agent
    live.bind(str(tmp_path / f"{ABSENT}.sock"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a crashed agent's file
    dead.bind(str(tmp_path / f"{ABSENT + 1}.sock"))
    dead.close()
    try:
        control.sweep_stale(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"{ABSENT}.sock"]
    finally:
        live.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a directory owned by another user")
def test_a_directory_squatted_by_another_user_is_named_with_what_helps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"  # as /tmp
    shared.mkdir()
    shared.chmod(0o1777)
    squatted = shared / f"mgtrace-{os.geteuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    with pytest.raises(control.ControlError, match=r"belongs to uid 65534.*XDG_RUNTIME_DIR"):
        control.runtime_dir()
