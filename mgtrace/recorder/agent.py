"""The in-engine agent: one per process, inert until asked to record.

States: ``idle`` → ``armed`` (a one-shot hook waits for the runner's next step) →
``recording`` → back to ``idle`` (or ``refused`` when the running vLLM lacks a hook target).
Activation and the limit-triggered stop both happen on the engine thread inside
``execute_model``, i.e. between two steps, so a trace never holds half a step. A stop from
the control socket asks for the same at the next step boundary; when none comes within a
short wait it closes itself: at once when the engine is idle (its last step is whole), else
once the running step ends, or, when that takes too long, dropping that step, counted.
States ``stopping`` (a close runs) and ``abandoned`` (a parent's agent in a forked child)
are passed through on the way.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mgtrace.recorder import features
from mgtrace.recorder.patches import Patch, PatchSet

log = logging.getLogger("mgtrace.recorder")

WATCH_POLL_S = 0.25
STOP_WAIT_S = 2.0
STEP_WAIT_S = 20.0  # within the 60 s a stop request may take
CLOSE_WAIT_S = 30.0  # a close flushes the assembler: seconds on a loaded host


BUSY = ("armed", "recording", "waiting", "stopping")


class AgentBusy(ValueError):
    """``start`` while a recording is armed, running or closing."""


class Agent:
    def __init__(self) -> None:
        self.state = "idle"
        self.kind: str | None = None
        self.rank: int | None = None
        self.refusal: str | None = None
        self.session: Any = None
        self.last_result: dict[str, Any] | None = None
        self._config: dict[str, Any] = {}
        self._arm = PatchSet()
        self._hooks = PatchSet()
        self._lock = threading.RLock()
        self._watcher: threading.Thread | None = None
        self._closer: threading.Thread | None = None
        self._atexit = False

    # ------------------------------------------------------------ commands
    def start(
        self,
        out: str,
        max_steps: int | None = None,
        duration_s: float | None = None,
        not_recorded: list[str] | None = None,
    ) -> dict[str, Any]:
        """Arm a recording into ``out``. ``not_recorded``: the processes of the engine the
        recorder could not reach, named in the trace's manifest (its part is missing)."""
        self._await_close()
        with self._lock:
            # "stopping": the close of the previous recording still runs; arming now would
            # let that close reset the state under the new arm hook. A second recorder never
            # joins a running one: each must stop what it started
            if self.state in BUSY:
                raise AgentBusy(f"already recording into {self._config.get('out')}")
            self._config = {
                "out": out,
                "max_steps": max_steps,
                "duration_s": duration_s,
                "not_recorded": list(not_recorded or []),
            }
            self.refusal = None
            self.last_result = None
            if not self._arm_now():
                self.state = "waiting"
                self._start_watcher()
            return self.status()

    def stop(self) -> dict[str, Any]:
        with self._lock:
            if self.state in ("armed", "waiting"):
                self._arm.remove()
                self.state = "idle"
                return self.status()
            sess = self.session
            if sess is not None:
                sess.stop_requested = True
        if sess is None:  # nothing recording; a close the engine thread began may still run
            self._await_close()
            return self.status()
        deadline = time.monotonic() + STOP_WAIT_S
        while sess.live and time.monotonic() < deadline:
            time.sleep(0.01)
        # no step boundary yet: an idle engine (its last step is whole) or a long step,
        # which gets a while to finish; one still running then is dropped, counted
        deadline = time.monotonic() + STEP_WAIT_S
        while sess.live and sess.in_step and time.monotonic() < deadline:
            time.sleep(0.01)
        self._finish(sess, inline=True)
        self._await_close()
        return self.status()

    def shutdown(self) -> None:
        """At interpreter exit: close an open recording so the trace ends complete. SIGINT
        is ignored meanwhile: a second Ctrl-C (a terminal's reaches the whole process group,
        the launcher's may follow) must not cut the trace short."""
        with _sigint_ignored():
            sess = self.session
            if sess is not None:
                self._finish(sess, inline=False)
            closer = self._closer
            if closer is None or closer is threading.current_thread():
                return
            while closer.is_alive():  # the close bounds its own waits
                with contextlib.suppress(KeyboardInterrupt):
                    closer.join()

    def abandon_after_fork(self) -> None:
        """In a forked child, where this (the parent's) agent has no threads: take its
        patches and its import finder out, so that only the child's own agent records.
        Takes no lock: one held by a parent thread at the fork stays held here."""
        sess, self.session = self.session, None
        if sess is not None:
            sess.abandon_after_fork()
        self._hooks.remove()
        self._arm.remove()
        self.state = "abandoned"
        sys.meta_path[:] = [
            f for f in sys.meta_path if not (isinstance(f, _ArmOnImport) and f.agent is self)
        ]

    def _await_close(self) -> None:
        """Wait (never on the engine thread's own close) for a close in progress."""
        closer = self._closer
        if closer is not None and closer is not threading.current_thread():
            closer.join(CLOSE_WAIT_S)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "state": self.state,
            "runner": self.kind,
            "rank": self.rank,
            "runner_modules": [m for m in features.RUNNER_MODULES if m in sys.modules],
            # before a recording: which folder its trace would go to (rank-NNN or none)
            "dist": _dist_rank_world(),
        }
        if self.refusal:
            out["refusal"] = self.refusal
        if self.state in BUSY:
            out["out"] = self._config.get("out")  # the session's, once there is one
        sess = self.session
        if sess is not None:
            out.update(sess.status())
        elif self.last_result is not None:
            out.update(self.last_result)
        return out

    # ------------------------------------------------------------ arming
    def _runner_classes(self) -> list[Any]:
        classes = []
        for name in features.RUNNER_MODULES:
            mod = sys.modules.get(name)
            cls = getattr(mod, "GPUModelRunner", None) if mod is not None else None
            if cls is not None and callable(getattr(cls, "execute_model", None)):
                classes.append(cls)
        return classes

    def _arm_now(self) -> bool:
        classes = self._runner_classes()
        if not classes:
            return False
        self._arm.install([Patch(cls, "execute_model", self._arming(cls)) for cls in classes])
        self.state = "armed"
        return True

    def _start_watcher(self) -> None:
        # arm the moment a runner module finishes importing, so that a process armed at
        # start records from its very first step; the poll below covers a module imported
        # in a way the finder does not see
        if not any(isinstance(f, _ArmOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _ArmOnImport(self))

        def watch() -> None:
            while self.state == "waiting":
                with self._lock:
                    if self.state == "waiting" and self._arm_now():
                        return
                time.sleep(WATCH_POLL_S)

        self._watcher = threading.Thread(target=watch, name="mgtrace-arm", daemon=True)
        self._watcher.start()

    def _arming(self, owner: Any) -> Any:
        agent = self

        def make(orig: Any) -> Any:
            def execute_model(runner: Any, *args: Any, **kwargs: Any) -> Any:
                agent._activate(runner)
                # the step goes through the hook just installed, when there is one; never
                # through whatever the class attribute holds now, which may be this very
                # wrapper (not activated) or a patch stacked on it
                step = agent._hooks.wrapper_for(owner, "execute_model") or orig
                return step(runner, *args, **kwargs)

            execute_model.__wrapped__ = orig  # type: ignore[attr-defined]
            return execute_model

        return make

    # ------------------------------------------------------------ engine thread
    def _activate(self, runner: Any) -> None:
        """Install the full hook set; runs inside execute_model, before the step."""
        with self._lock:
            if self.state != "armed":
                return
            covered = self._arm.remove()
            if covered:
                # another tool wrapped the arm hook: hooks installed now would wrap that
                # tool's wrapper, which calls the arm hook again; start nothing instead
                self.state = "refused"
                self.refusal = (
                    f"{', '.join(covered)} was patched over by another tool while mgtrace "
                    "waited for the next step; recording did not start"
                )
                log.warning("mgtrace: %s", self.refusal)
                return
            try:
                self._install(runner)
            except Exception as exc:
                self.state = "refused"
                self.refusal = (
                    str(exc)
                    if isinstance(exc, features.RecorderRefusal)
                    else (f"recording could not start: {exc.__class__.__name__}: {exc}")
                )
                log.warning("mgtrace: %s", self.refusal)

    def _install(self, runner: Any) -> None:
        from mgtrace.recorder import runinfo
        from mgtrace.recorder.hooks_common import binding
        from mgtrace.recorder.hooks_v1 import v1_patches
        from mgtrace.recorder.hooks_v2 import v2_patches
        from mgtrace.recorder.plugin import shared_engine_folder
        from mgtrace.recorder.session import Session

        kind, owners = features.check_runner(runner)
        rank, world = runinfo.rank_and_world()
        groups = runinfo.mamba_group_ids(runner)
        ctx_cls = features.owner_of(owners, "MambaSpecDecodeGPUContext", "run_fused_precopy")
        rule, _table = binding(ctx_cls, kind)
        run = runinfo.run_metadata(runner, kind, groups, rule)
        run.prefill_checkpoints_recorded = (
            features.owner_of(owners, "MambaPrefillCheckpointBuilder", "build") is not None
        )
        cfg = self._config
        out = Path(cfg["out"])
        if world > 1:
            out = shared_engine_folder(out)
        out, rank = runinfo.engine_folder(out, rank, world, run)
        not_recorded = cfg.get("not_recorded") or []
        source = {
            "kind": "vllm",
            "recorder": "mgtrace agent",
            "pid": os.getpid(),
            "hooks": [t.label for t in owners],
        }
        if not_recorded:
            source["not_recorded"] = not_recorded
        sess = Session(
            out,
            rank=rank,
            kind=kind,
            run=run,
            source=source,
            max_steps=cfg["max_steps"],
            duration_s=cfg["duration_s"],
            mamba_block_size=run.mamba_block_size,
        )
        for sentence in not_recorded:  # counted where `info` shows them: a partial recording
            sess.count_error("process_not_recorded", sentence)
        patches = (
            v1_patches(sess, owners, groups) if kind == "v1" else v2_patches(sess, owners, groups)
        )
        try:
            self._hooks.install(patches)
        except BaseException:
            sess.close()
            raise
        sess.on_limit = lambda: self._finish(sess, inline=False)
        self.session, self.kind, self.rank, self.state = sess, kind, rank, "recording"
        if not self._atexit:
            self._atexit = True
            atexit.register(self.shutdown)

    def _finish(self, sess: Any, *, inline: bool) -> None:
        """Unpatch and close once; on the engine thread the close goes to another thread,
        started before the lock is released, so a ``stop`` or ``start`` that finds the state
        "stopping" finds the thread to wait for."""
        with self._lock:
            if self.session is not sess:
                return
            sess.live = False
            covered = self._hooks.remove()
            if covered:
                message = (
                    f"{', '.join(covered)} patched over by another tool while recording; "
                    "its hooks stay in place as pass-throughs"
                )
                sess.count_error("patched_over", message)
                log.warning("mgtrace: %s", message)
            self.session = None
            self.state = "stopping"
            if not inline:
                self._closer = threading.Thread(
                    target=self._close, args=(sess,), name="mgtrace-close", daemon=True
                )
                self._closer.start()
                return
        self._close(sess)

    def _close(self, sess: Any) -> None:
        try:
            result = sess.close()
        except Exception as exc:
            result = {"error": f"{exc.__class__.__name__}: {exc}"}
        with self._lock:
            self.last_result = result
            if self.state == "stopping" and self.session is None:
                self.state = "idle"


def _dist_rank_world() -> list[int] | None:
    """[rank, world size] of torch.distributed where this process has initialised it (as
    vLLM's workers have); never imports it."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return [int(dist.get_rank()), int(dist.get_world_size())]
    except Exception:
        pass
    return None


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile (main thread only: elsewhere signals cannot be set)."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


class _ArmOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of vLLM's runner modules to arm a waiting agent right after the
    module body ran; every other import passes through untouched."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._busy = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in features.RUNNER_MODULES or self._busy:
            return None
        self._busy = True  # find the real spec with the rest of the finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        agent, run_body = self.agent, loader.exec_module

        def exec_module(module: Any) -> None:
            run_body(module)
            with contextlib.suppress(Exception), agent._lock:
                if agent.state == "waiting":
                    agent._arm_now()

        loader.exec_module = exec_module
        return spec


_AGENT: Agent | None = None
_AGENT_LOCK = threading.Lock()


def get_agent() -> Agent:
    """The process's agent (created on first use)."""
    global _AGENT
    with _AGENT_LOCK:
        if _AGENT is None:
            _AGENT = Agent()
        return _AGENT
