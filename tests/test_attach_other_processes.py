"""`record --engine-pid` leaves alone what is not its user's engine: another user's process
under the engine (no injection, no directory made where its environment points), and a
process that took the pid of a dead agent whose socket file is left."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from mgtrace.errors import UsageError
from mgtrace.recorder import attach, control, proctree

pytestmark = pytest.mark.unit

SHELL, TOOL = 9_000_100, 9_000_101  # pids no process has


def test_the_engine_tree_leaves_out_processes_of_another_user(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    me = os.geteuid()
    procs = [
        proctree.Proc(4242, 1, me, "python3", "supervisor"),
        proctree.Proc(4243, 4242, me + 1, "python3", "python3 -m vllm serve"),
        proctree.Proc(4244, 4242, me, "python3", "python3 -m vllm serve"),
    ]
    monkeypatch.setattr(proctree, "tree", lambda pid: procs)
    assert [p.pid for p in attach.engine_tree(4242)] == [4242, 4244]


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another user")
def test_root_follows_no_environment_of_another_users_process(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"  # where the other user's environment points
    theirs.mkdir()
    child = subprocess.Popen(
        ["sleep", "60"], user=65534, group=65534, env={"XDG_RUNTIME_DIR": str(theirs)}
    )
    try:
        path = control.engine_socket_path(child.pid)
        assert not (theirs / "mgtrace").exists()
        assert path.parent == control.runtime_dir()
        assert child.pid not in {p.pid for p in attach.engine_tree(os.getpid())}
    finally:
        child.kill()
        child.wait()


def test_a_stale_socket_file_does_not_make_a_process_the_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = os.geteuid()
    procs = [
        proctree.Proc(SHELL, 1, me, "bash", "bash run.sh"),
        proctree.Proc(TOOL, SHELL, me, "python3", "python3 tool.py"),  # no vLLM
    ]
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # its agent was killed
    stale.bind(str(tmp_path / f"{TOOL}.sock"))
    stale.close()
    monkeypatch.setattr(attach, "engine_tree", lambda pid: procs)
    monkeypatch.setattr(control, "engine_socket_path", lambda pid: tmp_path / f"{pid}.sock")
    reached: list[int] = []

    def connect(p: proctree.Proc, allow_inject: bool = True) -> attach.Target:
        reached.append(p.pid)  # where gdb would inject
        raise attach.AttachError("not reached in this test")

    monkeypatch.setattr(attach, "connect", connect)
    with pytest.raises(UsageError, match="is not a vLLM engine"):
        attach.record_pid(SHELL, tmp_path / "t", duration_s=None, max_steps=None)
    assert reached == []
