"""vLLM general-plugin entry point: load the agent, inert, in every vLLM process.

``register`` opens the control socket and does nothing else, unless the environment arms
recording from the start (``mgtrace record -o DIR -- vllm serve ...`` sets it):
``MGTRACE_RECORD_DIR`` (absolute trace directory), optional ``MGTRACE_MAX_STEPS`` and
``MGTRACE_DURATION_S``. ``MGTRACE_AGENT=0`` keeps the plugin from doing anything at all.

With ``MGTRACE_RECORD_PER_ENGINE=1`` (what ``mgtrace record -- ...`` sets) each engine records
into ``DIR/engine-PID`` instead: a command may start several engines, which must never share
a folder. PID is the engine's first process that loaded the plugin (the API server); it puts
it in ``MGTRACE_ENGINE`` for the processes it starts (EngineCore, workers) to inherit. Workers
of a torch.distributed world that no such process started (torchrun's) share their parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

ENV_DIR = "MGTRACE_RECORD_DIR"
ENV_MAX_STEPS = "MGTRACE_MAX_STEPS"
ENV_DURATION = "MGTRACE_DURATION_S"
ENV_DISABLE = "MGTRACE_AGENT"
ENV_PER_ENGINE = "MGTRACE_RECORD_PER_ENGINE"
ENV_ENGINE = "MGTRACE_ENGINE"

log = logging.getLogger("mgtrace.recorder")
_SERVER: Any = None
_LOCK = threading.Lock()


def serve_control() -> str | None:
    """Start this process's control socket once; returns its path (None on failure)."""
    global _SERVER
    with _LOCK:
        try:
            from mgtrace.recorder.agent import get_agent
            from mgtrace.recorder.control import ControlServer, socket_path

            if _SERVER is not None and _SERVER.pid == os.getpid():
                # still reachable: its file is there, where clients look for it
                if _SERVER.path == socket_path(os.getpid()) and _SERVER.path.is_socket():
                    return str(_SERVER.path)
                _SERVER.close()  # its file was removed (or moved): bind a new one
            server = ControlServer(get_agent())
            server.start()
            server.pid = os.getpid()
            _SERVER = server
            atexit.register(server.close)
            return str(server.path)
        except Exception as exc:  # the engine must start even when the agent cannot
            log.warning("mgtrace: agent control socket unavailable: %s", exc)
            return None


def _armed_from_env() -> dict[str, Any] | None:
    out = os.environ.get(ENV_DIR)
    if not out:
        return None
    out = os.path.abspath(out)
    if os.environ.get(ENV_PER_ENGINE) == "1":
        out = os.path.join(out, f"engine-{_engine_id()}")
    try:
        steps = os.environ.get(ENV_MAX_STEPS)
        duration = os.environ.get(ENV_DURATION)
        return {
            "out": out,
            "max_steps": int(steps) if steps else None,
            "duration_s": float(duration) if duration else None,
        }
    except ValueError:
        log.warning("mgtrace: ignoring malformed %s / %s", ENV_MAX_STEPS, ENV_DURATION)
        return None


def _engine_id() -> str:
    """The engine this process belongs to: inherited from the process that started it, or,
    in the engine's first process, this one's pid, set for the processes it starts."""
    engine = os.environ.get(ENV_ENGINE, "")
    if not engine.isdigit():
        engine = os.environ[ENV_ENGINE] = str(os.getpid())
    return engine


def shared_engine_folder(out: Path) -> Path:
    """The folder of a worker in a torch.distributed world of several ranks, given the one
    armed from the environment. A worker that found no engine id to inherit (nothing above
    it loaded the plugin, as under torchrun) named the engine after itself: its world's
    workers share one parent, which names it instead."""
    me = str(os.getpid())
    if out.name == f"engine-{me}" and os.environ.get(ENV_ENGINE) == me:
        return out.with_name(f"engine-{os.getppid()}")
    return out


def _after_fork_in_child() -> None:
    """A forked engine process gets its own agent and socket; the parent's threads are gone,
    and the parent's agent, copied here, is taken out (its patches, its import finder) so
    that it never arms or records beside the child's own."""
    global _SERVER, _LOCK
    _SERVER = None
    _LOCK = threading.Lock()
    from mgtrace.recorder import agent

    inherited, agent._AGENT = agent._AGENT, None
    agent._AGENT_LOCK = threading.Lock()  # a parent thread may have held it at the fork
    if inherited is not None:
        try:
            inherited.abandon_after_fork()
        except Exception as exc:  # the child engine must start regardless
            log.warning("mgtrace: could not retire the parent's agent after fork: %s", exc)
    _activate()


_FORK_HOOKED = False


def register() -> None:
    """The ``vllm.general_plugins`` hook; safe to call many times and in every process."""
    global _FORK_HOOKED
    if os.environ.get(ENV_DISABLE) == "0":
        return
    if not _FORK_HOOKED:
        _FORK_HOOKED = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
    _activate()


def _activate() -> None:
    serve_control()
    armed = _armed_from_env()
    if armed is not None:
        from mgtrace.recorder.agent import AgentBusy, get_agent

        with contextlib.suppress(AgentBusy):  # armed by an earlier call already
            get_agent().start(**armed)
