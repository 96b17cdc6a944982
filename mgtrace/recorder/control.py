"""The agent's control socket: one Unix socket per process, same user only, three commands.

The socket lives in a private directory (mode 0700, owned by the user) under the user's
runtime directory, named after the process id. Each connection carries one JSON request
line and gets one JSON reply line. The peer's uid comes from the kernel (SO_PEERCRED) and
must equal ours. Requests name one of a fixed set of commands whose arguments are checked
for name, type and range; nothing received is ever evaluated or imported.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mgtrace.errors import MgtraceError

log = logging.getLogger("mgtrace.recorder")

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0  # for a whole request line: connections are served one at a time
ACCEPT_RETRY_S = 0.1  # after a failed accept (out of file descriptors): try again
MAX_PATH_CHARS = 4096
MAX_NOT_RECORDED = 16
MAX_SENTENCE_CHARS = 200  # 16 of them and the longest path fit in MAX_REQUEST_BYTES
COMMANDS = ("start", "stop", "status")
_ARGS: dict[str, dict[str, type]] = {
    # not_recorded: the processes of the engine that the recorder could not reach, one
    # sentence each, for the trace's manifest
    "start": {"out": str, "max_steps": int, "duration_s": float, "not_recorded": list},
    "stop": {},
    "status": {},
}


class ControlError(MgtraceError):
    """The control socket could not be reached or answered badly."""


def runtime_dir(uid: int | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The private directory holding the sockets, created 0700 when missing; ``environ``:
    the environment whose runtime directory counts (this process's by default)."""
    uid = os.geteuid() if uid is None else uid
    base = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base):
        base = f"/run/user/{uid}" if os.path.isdir(f"/run/user/{uid}") else "/tmp"
    # a directory other users may write (/tmp, however spelled, /dev/shm, /var/tmp, or one
    # XDG_RUNTIME_DIR names): the name carries the uid, so users never share (squat) one
    try:
        st = os.stat(base)
        shared = st.st_uid != uid or bool(st.st_mode & 0o022)
    except OSError:
        shared = True
    path = Path(base) / (f"mgtrace-{uid}" if shared else "mgtrace")
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ControlError(f"cannot create the control directory {path}: {exc.strerror}") from None
    st = path.lstat()
    if st.st_uid != uid:
        # in a sticky /tmp this user cannot remove another's: say what does help
        raise ControlError(
            f"{path} belongs to uid {st.st_uid}, not to you: start the engine with "
            "XDG_RUNTIME_DIR set to a private directory of yours (mgtrace record follows "
            "the engine's), or have its owner remove it"
        )
    if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o077:
        raise ControlError(
            f"{path} is not a private directory of this user (it must be a 0700 directory "
            "owned by you); remove it and retry"
        )
    return path


def socket_path(pid: int, uid: int | None = None) -> Path:
    return runtime_dir(uid) / f"{pid}.sock"


def engine_socket_path(pid: int) -> Path:
    """Where process ``pid``'s agent listens: under the runtime directory of ``pid``'s own
    environment (a shell with another XDG_RUNTIME_DIR than the engine's would look in the
    wrong place), or of this process's where that environment cannot be read."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            # another user's process (root can read its environment): its directories are
            # not ours to create, and its agent would not answer us anyway
            return socket_path(pid)
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return socket_path(pid)
    env = dict(
        item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item
    )
    return runtime_dir(environ=env) / f"{pid}.sock"


def listening(path: Path) -> bool:
    """Whether an agent listens at ``path``: a socket file left by a process that died
    (killed, its pid since reused by another process) is not one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:  # missing, refused (stale), not a socket
            return False
        try:  # a whole request, and its reply read: the agent sees an ordinary client
            sock.sendall(b'{"cmd": "status"}\n')
            sock.recv(1)
        except OSError:  # busy with another client: it still listens
            pass
    return True


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    return uid


def peer_allowed(uid: int, own_uid: int | None = None) -> bool:
    """Only the user the agent runs as may drive it."""
    return uid == (os.geteuid() if own_uid is None else own_uid)


def validate(request: Any) -> tuple[str, dict[str, Any]]:
    """(command, arguments) of a well-formed request; ValueError with the reason otherwise."""
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    extra = set(request) - {"cmd", "args"}
    if extra:
        raise ValueError(f"unknown request field {sorted(extra)[0]!r}")
    cmd = request.get("cmd")
    if cmd not in COMMANDS:
        raise ValueError(f"unknown command {cmd!r}; the commands are {', '.join(COMMANDS)}")
    args = request.get("args", {})
    if not isinstance(args, dict):
        raise ValueError("args must be a JSON object")
    allowed = _ARGS[cmd]
    clean: dict[str, Any] = {}
    for name, value in args.items():
        want = allowed.get(name)
        if want is None:
            raise ValueError(f"{cmd} takes no argument {name!r}")
        if value is None:
            continue
        if want is int and (type(value) is not int or value < 1):
            raise ValueError(f"{name} must be a positive integer")
        if want is float:
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds")
            value = float(value)
        if want is list and (
            type(value) is not list
            or len(value) > MAX_NOT_RECORDED
            or any(type(v) is not str or len(v) > MAX_SENTENCE_CHARS for v in value)
        ):
            raise ValueError(f"{name} must be a list of at most {MAX_NOT_RECORDED} sentences")
        if want is str and (
            type(value) is not str
            or not value.startswith("/")
            or "\x00" in value
            or len(value) > MAX_PATH_CHARS
        ):
            raise ValueError(f"{name} must be an absolute path")
        clean[name] = value
    if cmd == "start" and "out" not in clean:
        raise ValueError("start needs out, the trace directory")
    return cmd, clean


def sweep_stale(directory: Path) -> None:
    """Remove sockets left by processes that died without closing them. A pid missing from
    /proc is not enough: a process of another pid namespace (a container sharing the
    directory) is missing here too, and its socket still listens; only one that refuses a
    connection is stale."""
    for sock in directory.glob("*.sock"):
        if sock.stem.isdigit() and not Path(f"/proc/{sock.stem}").exists() and _refuses(sock):
            with contextlib.suppress(OSError):
                sock.unlink()


def _refuses(path: Path) -> bool:
    """Whether nothing listens on ``path`` (a connection that is made is closed at once,
    which its agent answers without waiting)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:  # a full backlog (EAGAIN), or not a socket: left alone
            return False
    return False


class ControlServer:
    """Accepts connections on a daemon thread and dispatches to the agent."""

    def __init__(self, agent: Any, path: Path | None = None) -> None:
        self.agent = agent
        self.path = path or socket_path(os.getpid())
        self.refused = 0
        self.pid = os.getpid()  # the process that made the socket file; only it removes it
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Path:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sweep_stale(self.path.parent)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bind and listen under a temporary name, then rename: a client that sees the path
        # always finds a listening socket
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        old = os.umask(0o177)  # the socket file itself: owner read/write only
        try:
            sock.bind(str(tmp))
        finally:
            os.umask(old)
        sock.listen(8)
        os.replace(tmp, self.path)
        self.pid = os.getpid()
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="mgtrace-control", daemon=True)
        self._thread.start()
        return self.path

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if os.getpid() != self.pid:  # a forked child's exit: the file is its parent's
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _serve(self) -> None:
        while self._sock is not None:
            sock = self._sock
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._sock is not sock or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed
                # out of file descriptors (EMFILE, ENFILE), memory, an aborted connection:
                # passing conditions of the engine, which must not end the agent for good
                log.debug("mgtrace control: accept failed: %s", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            with conn:
                try:
                    self._handle(conn)
                except Exception as exc:  # a bad client never takes the agent down
                    log.debug("mgtrace control: %s", exc)

    def _handle(self, conn: socket.socket) -> None:
        allowed = peer_allowed(peer_uid(conn))
        # read the request line in any case (bounded in size and in time: a client that
        # trickles bytes must not hold the only control thread), so that a refused client
        # gets the refusal rather than a reset connection; its content is not looked at
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        data = b""
        while not data.endswith(b"\n") and len(data) <= MAX_REQUEST_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole request in time")
            conn.settimeout(left)
            chunk = conn.recv(1024)
            if not chunk:
                break
            data += chunk
        conn.settimeout(5.0)  # for the reply, however long the request took
        if not allowed:
            self.refused += 1
            _reply(conn, {"ok": False, "error": "refused: the agent accepts only its own user"})
            return
        if len(data) > MAX_REQUEST_BYTES:
            _reply(conn, {"ok": False, "error": "request too long"})
            return
        try:
            cmd, args = validate(json.loads(data.decode("utf-8")))
        except (ValueError, UnicodeDecodeError) as exc:
            _reply(conn, {"ok": False, "error": str(exc)})
            return
        except RecursionError:  # json's parser on deeply nested input
            _reply(conn, {"ok": False, "error": "a request is a flat JSON object"})
            return
        if cmd == "start":
            try:
                result = self.agent.start(**args)
            except ValueError as exc:  # busy: already recording elsewhere
                _reply(conn, {"ok": False, "error": str(exc)})
                return
        elif cmd == "stop":
            result = self.agent.stop()
        else:
            result = self.agent.status()
        _reply(conn, {"ok": True, "result": result})


def _reply(conn: socket.socket, payload: dict[str, Any]) -> None:
    # MSG_NOSIGNAL: a client gone before its reply is an EPIPE here, never a SIGPIPE, which
    # kills an engine whose SIGPIPE is not ignored (an embedded interpreter, a library's
    # signal(SIGPIPE, SIG_DFL))
    conn.sendall(json.dumps(payload, default=str).encode() + b"\n", socket.MSG_NOSIGNAL)


def send(
    path: Path, cmd: str, args: dict[str, Any] | None = None, timeout_s: float = 40.0
) -> dict[str, Any]:
    """One request to an agent socket; raises ControlError on anything but a reply."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            sock.sendall(json.dumps({"cmd": cmd, "args": args or {}}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise ControlError(f"cannot talk to the agent at {path}: {exc.strerror or exc}") from None
    try:
        reply = json.loads(data.decode())
    except ValueError:
        raise ControlError(f"the agent at {path} sent an unreadable reply") from None
    if not reply.get("ok"):
        raise ControlError(f"the agent at {path} refused: {reply.get('error')}")
    return reply["result"]
