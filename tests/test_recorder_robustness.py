"""The recorder's contract with the engine it lives in, at its edges: a start that meets a
close, a fork, a stacked patch, a capture that fails, a frame the assembler never gets, a
dead assembler and a stop in the middle of a long step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mgtrace.recorder import agent as agent_mod
from mgtrace.recorder import features
from mgtrace.recorder.capture import CaptureRing
from mgtrace.recorder.hooks_common import _tag, runner_step_patches
from mgtrace.recorder.patches import Patch, PatchSet
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata

pytestmark = pytest.mark.unit


class _Runner:
    def execute_model(self, so: Any) -> Any:
        return ("ran", so)


@pytest.fixture
def runner_module(monkeypatch: pytest.MonkeyPatch) -> type[_Runner]:
    """A V1 runner module as the agent finds it in ``sys.modules`` (not a real vLLM runner:
    activation refuses it, and the step runs unrecorded)."""

    class GPUModelRunner(_Runner):
        pass

    mod = types.ModuleType(features.V1_RUNNER_MODULE)
    mod.GPUModelRunner = GPUModelRunner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, features.V1_RUNNER_MODULE, mod)
    return GPUModelRunner


class _SlowClose:
    """A session whose close flushes for a while, as on a loaded host."""

    live = True
    stop_requested = False
    in_step = False

    def close(self) -> dict[str, Any]:
        time.sleep(0.4)
        return {"complete": True}

    def status(self) -> dict[str, Any]:
        return {}

    def count_error(self, kind: str, message: str) -> None:
        pass


def test_a_start_during_a_close_waits_for_it_and_the_step_runs_once(
    runner_module: type[_Runner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limit stops a recording on the engine thread (its close runs on a thread); a start
    arriving meanwhile waits for that close, then arms; the next step runs the engine's own
    method once. Control: without the wait the start is refused while the close runs."""
    agent = agent_mod.Agent()
    sess = _SlowClose()
    agent.session, agent.state = sess, "recording"
    agent._finish(sess, inline=False)
    assert agent.state == "stopping"
    assert agent.start("/tmp/mgtrace-never-written")["state"] == "armed"
    time.sleep(0.1)
    assert agent.state == "armed"  # the close that ended did not reset it
    assert runner_module().execute_model(1) == ("ran", 1)
    assert agent.state == "refused"  # not a real vLLM runner: nothing was patched
    assert "execute_model" not in vars(runner_module)

    monkeypatch.setattr(agent_mod.Agent, "_await_close", lambda self: None)
    other = agent_mod.Agent()
    sess = _SlowClose()
    other.session, other.state = sess, "recording"
    other._finish(sess, inline=False)
    with pytest.raises(agent_mod.AgentBusy, match="already recording"):
        other.start("/tmp/mgtrace-never-written")
    other._closer.join(5)  # type: ignore[union-attr]


class _InterruptedClose(_SlowClose):
    """A close during which a second Ctrl-C reaches the process (its terminal's Ctrl-C goes
    to the whole process group, and the launcher's SIGINT may follow)."""

    def close(self) -> dict[str, Any]:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.4)
        return {"complete": True}


def test_the_close_at_exit_is_not_cut_short_by_ctrl_c() -> None:
    agent = agent_mod.Agent()
    sess = _InterruptedClose()
    agent.session, agent.state = sess, "recording"
    agent.shutdown()  # raises KeyboardInterrupt where the close is interrupted
    assert agent.state == "idle" and agent.last_result == {"complete": True}


def test_an_arm_hook_left_behind_calls_the_original_not_itself(
    runner_module: type[_Runner],
) -> None:
    """The arm hook runs the step through the hook set it installed, else the original it
    wrapped; never through the class attribute, which may be the arm hook itself (the state
    a close used to leave: armed patch, agent idle). Control: armed as meant, it activates."""
    agent = agent_mod.Agent()
    assert agent._arm_now()
    agent.state = "idle"
    assert runner_module().execute_model(2) == ("ran", 2)  # was a RecursionError
    agent.stop()
    agent._arm.remove()
    assert "execute_model" not in vars(runner_module)
    agent.state = "idle"
    agent.start("/tmp/mgtrace-never-written")
    assert agent.state == "armed"
    assert runner_module().execute_model(3) == ("ran", 3)
    assert agent.state == "refused"


def test_an_arm_hook_patched_over_starts_nothing_and_the_step_runs_once(
    runner_module: type[_Runner],
) -> None:
    """Another tool wraps execute_model while the agent waits armed: hooks installed then
    would wrap that tool's wrapper, which calls the arm hook again (a RecursionError in the
    engine). The agent refuses, saying why, and every step runs the engine's method once.
    Control: armed and left alone, activation goes on to the runner check."""
    calls: list[int] = []
    original = runner_module.execute_model

    def counted(self: Any, so: Any) -> Any:
        calls.append(so)
        return original(self, so)

    runner_module.execute_model = counted  # type: ignore[method-assign]
    agent = agent_mod.Agent()
    assert agent._arm_now()
    arm = vars(runner_module)["execute_model"]
    runner_module.execute_model = lambda self, so: arm(self, so)  # type: ignore[method-assign]
    assert runner_module().execute_model(1) == ("ran", 1) and calls == [1]
    assert agent.state == "refused" and "patched over by another tool" in agent.refusal
    assert runner_module().execute_model(2) == ("ran", 2) and calls == [1, 2]
    runner_module.execute_model = counted  # type: ignore[method-assign]
    alone = agent_mod.Agent()
    alone.start("/tmp/mgtrace-never-written")
    assert runner_module().execute_model(3) == ("ran", 3) and calls == [1, 2, 3]
    assert alone.state == "refused" and "neither vLLM's V1 nor V2" in alone.refusal


class _Target:
    def own(self) -> str:
        return "own"


def test_removal_leaves_a_patch_stacked_on_top_in_place() -> None:
    own = _Target.__dict__["own"]
    ps = PatchSet()
    ps.install([Patch(_Target, "own", lambda orig: lambda self: orig(self) + "+")])
    ours = _Target.__dict__["own"]
    _Target.own = lambda self: ours(self) + "!"  # type: ignore[method-assign]
    try:
        assert ps.remove() == ["_Target.own"]
        assert _Target().own() == "own+!"  # theirs still calls ours, ours the original
    finally:
        _Target.own = own  # type: ignore[method-assign]
    # control: not stacked on, the original comes back and nothing is reported
    ps.install([Patch(_Target, "own", lambda orig: lambda self: orig(self) + "+")])
    assert ps.remove() == [] and _Target.__dict__["own"] is own


FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, types
    from mgtrace.recorder import agent as agent_mod, features, plugin
    from mgtrace.recorder.patches import Patch

    features.RUNNER_MODULES = ("fake_runner_module",)
    seen = []

    def install(self, runner):  # the agent's hook set, reduced to one marked wrapper
        def make(orig):
            def execute_model(r, *a, **k):
                seen.append(id(self))
                return orig(r, *a, **k)
            return execute_model
        self._hooks.install([Patch(type(runner), "execute_model", make)])
        self.state = "recording"

    agent_mod.Agent._install = install
    plugin.register()  # armed from the environment, no runner module yet: waiting
    parent = agent_mod.get_agent()
    pid = os.fork()
    if pid == 0:
        child = agent_mod.get_agent()
        mod = types.ModuleType("fake_runner_module")
        class GPUModelRunner:
            def execute_model(self, so):
                return so
        mod.GPUModelRunner = GPUModelRunner
        sys.modules["fake_runner_module"] = mod
        deadline = time.monotonic() + 10
        while child.state != "armed" and time.monotonic() < deadline:
            time.sleep(0.05)
        results = [GPUModelRunner().execute_model(i) for i in range(3)]
        child._hooks.remove()
        results.append(GPUModelRunner().execute_model(9))
        print("RESULT", results, parent.state, child.state,
              sorted(set(seen)) == [id(child)], len(seen))
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    """
)


def test_a_forked_engine_records_with_its_own_agent_only(tmp_path: Path) -> None:
    """vLLM forks its engine processes: the parent's agent, copied into the child, is
    retired there, so only the child's agent arms, its hook sees every step, and removing it
    gives the engine back its own method (it once restored the orphan's arm hook, which
    called itself). Control: the script's own check compares hook owners, and a second
    agent hooking the same steps would make that comparison fail."""
    env = {
        **os.environ,
        "MGTRACE_RECORD_DIR": str(tmp_path / "rec"),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    (tmp_path / "run").mkdir(mode=0o700)
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, done.stdout + done.stderr
    assert line == "RESULT [0, 1, 2, 9] abandoned recording True 3"


def test_a_lost_socket_file_is_bound_again_and_a_forked_child_leaves_it(
    tmp_path: Path,
) -> None:
    """The agent's socket file removed from under it is bound again at the next
    ``serve_control`` (an attach calls it), and a forked child's normal exit does not
    remove its parent's socket file (the close registered at exit is inherited)."""
    code = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        from mgtrace.recorder import control, plugin
        path = plugin.serve_control()
        os.unlink(path)
        again = plugin.serve_control()
        print(again == path, os.path.exists(path))
        child = os.fork()
        if child == 0:
            sys.exit(0)
        os.waitpid(child, 0)
        print(os.path.exists(path), control.send(Path(path), "status")["pid"] == os.getpid())
        """
    )
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.stdout.split() == ["True", "True", "True", "True"], proc.stderr[-2000:]


def test_deeply_nested_json_gets_an_error_reply(tmp_path: Path) -> None:
    import socket

    from mgtrace.recorder.control import ControlServer

    server = ControlServer(agent_mod.Agent(), tmp_path / "t.sock")
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(server.path))
            sock.sendall(b"[" * 5000 + b"\n")
            reply = sock.makefile("rb").readline()
    finally:
        server.close()
    assert json.loads(reply) == {"ok": False, "error": "a request is a flat JSON object"}


def test_a_failed_capture_gives_its_slot_back() -> None:
    import torch

    ring = CaptureRing(torch.device("cpu"), slots=2, slot_elems=16)
    good = torch.arange(4, dtype=torch.int32)
    for _ in range(5):
        with pytest.raises(AttributeError):  # what the hook's guard would catch and count
            ring.grab([good, "not a tensor"], [4, 4], {"step": 0})  # type: ignore[list-item]
    assert ring.grab([good], [4], {"step": 1}) and ring.grab([good], [4], {"step": 2})
    assert [tag["step"] for _, tag in ring.reap()] == [1, 2]
    # control: a ring that really is full refuses and counts it
    assert ring.grab([good], [4], {}) and ring.grab([good], [4], {})
    assert not ring.grab([good], [4], {}) and ring.dropped == 1


def _hand_driven_session(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Session, SimpleNamespace, Any, list[str]]:
    """A thread-assembler session whose recorder thread does nothing (its ``_drain`` is
    driven by hand), a launch context, a capture vector and the precopy's vector names."""
    import torch

    monkeypatch.setattr(Session, "_loop", lambda self: None)
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="thread")
    return (
        sess,
        SimpleNamespace(),
        torch.arange(4, dtype=torch.int32),
        [
            "state_idx",
            "src_col",
            "token_bias",
        ],
    )


def _so() -> SimpleNamespace:
    return SimpleNamespace(
        total_num_scheduled_tokens=0,
        num_scheduled_tokens={},
        scheduled_spec_decode_tokens={},
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        finished_req_ids=set(),
        preempted_req_ids=set(),
    )


def _steps_and_launches(out: Path) -> tuple[list[int], list[int]]:
    import pyarrow.parquet as pq

    steps = sorted(set(pq.read_table(out / "steps").column("step").to_pylist()))
    launches = sorted(set(pq.read_table(out / "launches").column("step").to_pylist()))
    return steps, launches


def _close_whole(sess: Session, out: Path) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """Close the recording; its result, its manifest and the steps written, after checking
    that every step written has its launches (none written in part)."""
    result = sess.close(5.0)
    manifest = json.loads((out / "manifest.json").read_text())
    steps, launches = _steps_and_launches(out)
    assert steps == launches
    return result, manifest, steps


@pytest.mark.parametrize("refuse", [1, 0])
def test_captures_in_a_refused_frame_drop_their_step_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: int
) -> None:
    """The recorder thread forwards a step's captures before its record; when the sink
    refuses that frame, the step is dropped and counted when its record comes up, never
    written without its launches. Control (``refuse=0``): every step, every launch."""
    import torch

    monkeypatch.setattr(Session, "_loop", lambda self: None)  # its _drain, driven by hand
    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="thread")
    real_send = sess.sink.send
    left = {"n": refuse}

    def send(messages: list[Any], *, essential: bool = False) -> bool:
        if not essential and left["n"]:
            left["n"] -= 1
            return False
        return real_send(messages, essential=essential)

    sess.sink.send = send  # type: ignore[method-assign]
    ctx = SimpleNamespace()
    vec = torch.arange(4, dtype=torch.int32)
    for _ in range(4):
        sess.begin_step(_so())
        names = ["state_idx", "src_col", "token_bias"]
        sess.grab([vec] * 3, [4] * 3, _tag(sess, ctx, "precopy", 4, names))
        sess._drain()  # while the step is still open
    sess.end_step()
    sess._drain()
    result, manifest, steps = _close_whole(sess, out)
    if refuse:
        assert steps == [1, 2, 3] and result["drops"] == 1
        assert manifest["drops"]["steps"] == 1 and "captures_dropped" in manifest["errors"]
    else:
        assert steps == [0, 1, 2, 3] and result["drops"] == 0


@pytest.mark.parametrize("slots", [2, 8])
def test_a_capture_without_a_ring_slot_drops_its_step_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slots: int
) -> None:
    """A launch whose capture finds the ring full (the recorder thread fell behind) would
    leave its step replayed without that launch: the step is dropped and counted, never
    written in part, and the steps whose captures found room stay whole. Control
    (``slots=8``): room for every capture, every step written."""
    import torch

    monkeypatch.setattr(Session, "_loop", lambda self: None)  # its _drain, driven by hand
    out = tmp_path / "t"
    sess = Session(out, rank=0, kind="v1", run=RunMetadata(), assembler="thread")
    sess.ring = CaptureRing(torch.device("cpu"), slots=slots)
    ctx = SimpleNamespace()
    vec = torch.arange(4, dtype=torch.int32)
    names = ["state_idx", "src_col", "token_bias"]
    for step in range(4):
        sess.begin_step(_so())
        for _ in range(2):  # two launches a step; nothing is reaped until step 2
            sess.grab([vec] * 3, [4] * 3, _tag(sess, ctx, "precopy", 4, names))
        if step == 2:
            sess._drain()
    sess.end_step()
    sess._drain()
    result, manifest, steps = _close_whole(sess, out)
    if slots == 2:  # step 0 took both slots; steps 1 and 2 found none, step 3 found room
        assert steps == [0, 3] and result["drops"] == 2
        assert manifest["drops"]["steps"] == 2 and "capture_ring_full" in manifest["errors"]
    else:
        assert steps == [0, 1, 2, 3] and result["drops"] == 0


@pytest.mark.parametrize("required", [True, False])
def test_a_failing_required_hook_drops_its_step_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, required: bool
) -> None:
    """A required hook that raises in one step leaves that step without what it records
    (a launch, a row move): the step is dropped and counted, the others stay whole. An
    optional hook (a builder's split) only leaves its column empty: nothing is dropped,
    the control."""

    from mgtrace.recorder.hooks_common import hook

    out = tmp_path / "t"
    sess, ctx, vec, names = _hand_driven_session(out, monkeypatch)

    def before(s: Session, args: Any, kwargs: Any) -> None:
        if s.step == 1:
            raise RuntimeError("a vLLM the hook did not expect")

    launch = hook(sess, "launch", before=before, required=required)(lambda: None)
    for _ in range(3):
        sess.begin_step(_so())
        sess.grab([vec] * 3, [4] * 3, _tag(sess, ctx, "precopy", 4, names))
        launch()
    sess.end_step()
    sess._drain()
    result, _, steps = _close_whole(sess, out)
    assert result["hook_errors"] == 1
    if required:
        assert steps == [0, 2] and result["drops"] == 1
    else:
        assert steps == [0, 1, 2] and result["drops"] == 0


def test_a_dead_assembler_stops_the_recording_at_the_next_step(tmp_path: Path) -> None:
    """Nothing can reach the trace once the assembler process is gone: the recording stops
    at the next step boundary instead of hooking and dropping every step. Control: with
    the assembler alive, the same wait changes nothing."""
    for kill in (True, False):
        sess = Session(tmp_path / str(kill), rank=0, kind="v1", run=RunMetadata())
        assert sess.wait_ready(60.0)
        assert sess.begin_step(_so())
        if kill:
            sess.sink.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        deadline = time.monotonic() + (10.0 if kill else 0.5)
        while not sess.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sess.begin_step(_so()) is not kill and sess.live is not kill
        result = sess.close(10.0)
        assert result["complete"] is not kill


def test_a_stop_waits_for_a_long_step_and_never_writes_half_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that meets no step boundary waits for the running step to end (the runner's
    sample_tokens) and closes with it whole; a step still running when that wait runs out is
    dropped and counted. Control: an idle engine's last step is whole and is kept."""
    monkeypatch.setattr(agent_mod, "STOP_WAIT_S", 0.05)

    class Runner:
        def execute_model(self, so: Any) -> None:
            return None  # sample_tokens ends the step

        def sample_tokens(self, grammar: Any) -> Any:
            return grammar

    def recording(name: str) -> tuple[agent_mod.Agent, Session, PatchSet]:
        sess = Session(tmp_path / name, rank=0, kind="v1", run=RunMetadata(), assembler="thread")
        hooks = PatchSet()
        hooks.install(runner_step_patches(sess, Runner, lambda s, a, k: s.begin_step(a[1])))
        agent = agent_mod.Agent()
        agent.session, agent.state, agent._hooks = sess, "recording", hooks
        return agent, sess, hooks

    def dropped(name: str) -> int:
        return json.loads((tmp_path / name / "manifest.json").read_text())["drops"]["steps"]

    # a long step: it ends while the stop waits
    agent, sess, _ = recording("long")
    Runner().execute_model(_so())
    assert sess.in_step
    ender = threading.Timer(0.3, Runner().sample_tokens, args=(None,))
    ender.start()
    agent.stop()
    ender.join()
    assert dropped("long") == 0 and _written_steps(tmp_path / "long") == [0]

    # a step that outlasts the wait: dropped, counted, its launch captures not written
    monkeypatch.setattr(agent_mod, "STEP_WAIT_S", 0.1)
    agent, sess, _ = recording("cut")
    Runner().execute_model(_so())
    _capture(sess)
    agent.stop()
    manifest = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert manifest["drops"]["steps"] == 1 and "stopped_mid_step" in manifest["errors"]
    assert _written_steps(tmp_path / "cut") is None
    assert not (tmp_path / "cut" / "launches").exists()

    # control: an idle engine, its last step ended long ago, is written with its launches
    agent, sess, _ = recording("idle")
    Runner().execute_model(_so())
    _capture(sess)
    Runner().sample_tokens(None)
    agent.stop()
    assert dropped("idle") == 0 and _written_steps(tmp_path / "idle") == [0]
    assert _steps_and_launches(tmp_path / "idle") == ([0], [0])


def _capture(sess: Session) -> None:
    import torch

    vec = torch.arange(4, dtype=torch.int32)
    names = ["state_idx", "src_col", "token_bias"]
    sess.grab([vec] * 3, [4] * 3, _tag(sess, SimpleNamespace(), "precopy", 4, names))


def _written_steps(out: Path) -> list[int] | None:
    import pyarrow.parquet as pq

    if not (out / "steps").exists():
        return None
    return sorted(set(pq.read_table(out / "steps").column("step").to_pylist()))


def test_step_end_hooks_mark_only_real_ends() -> None:
    """execute_model returning an output ends the step; None (sample_tokens follows) and a
    pipeline stage's IntermediateTensors do not; an execute_model that raises does (no step
    runs on). Control: a session whose hooks see no step ends never counts one as running."""
    sess = Session.__new__(Session)
    sess.live, sess.step_ends_observed, sess.in_step = True, False, False

    class IntermediateTensors:
        pass

    class Runner:
        def execute_model(self, so: Any) -> Any:
            if so == "boom":
                raise ValueError(so)
            return so

    opened = lambda s, a, k: setattr(s, "in_step", True)  # noqa: E731
    patches = runner_step_patches(sess, Runner, opened)
    assert sess.step_ends_observed and len(patches) == 1  # no sample_tokens on this runner
    ps = PatchSet()
    ps.install(patches)
    try:
        for result, running in ((None, True), (IntermediateTensors(), True), (np.ones(1), False)):
            Runner().execute_model(result)
            assert sess.in_step is running
        with pytest.raises(ValueError):
            Runner().execute_model("boom")
        assert not sess.in_step
    finally:
        ps.remove()
    plain = Session.__new__(Session)
    plain.step_ends_observed, plain.step, plain.rec = False, -1, None
    plain.stop_requested, plain.max_steps, plain.deadline = False, None, None
    assert plain.begin_step(None) and not plain.in_step


@pytest.mark.parametrize("fails", ["step", "hand-over", None])
def test_a_step_the_assembler_cannot_assemble_is_dropped_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str | None
) -> None:
    """A step whose record does not assemble (e.g. a row count its arrays disagree with)
    is dropped and counted, and its launches are not written without it; a batch the
    assembler cannot hand to the writer drops its steps, counted. Control (None): every
    step and launch written."""

    from mgtrace.recorder import assemble
    from mgtrace.recorder.step_tables import StepTables

    build, merge = StepTables.build, assemble.merge_steps

    def bad_build(self: StepTables, rec: dict[str, Any], captured: Any) -> Any:
        if fails == "step" and rec["step"] == 1:
            raise ValueError("operands could not be broadcast together")
        return build(self, rec, captured)

    def bad_merge(batch: list[Any]) -> Any:
        if fails == "hand-over":
            raise ValueError("a batch that does not merge")
        return merge(batch)

    monkeypatch.setattr(StepTables, "build", bad_build)
    monkeypatch.setattr(assemble, "merge_steps", bad_merge)
    out = tmp_path / "t"
    sess, ctx, vec, names = _hand_driven_session(out, monkeypatch)
    for _ in range(3):
        sess.begin_step(_so())
        sess.grab([vec] * 3, [4] * 3, _tag(sess, ctx, "precopy", 4, names))
    sess.end_step()
    sess._drain()
    if fails == "hand-over":
        result = sess.close(5.0)
        manifest = json.loads((out / "manifest.json").read_text())
        assert not (out / "steps").exists() and not (out / "launches").exists()
        assert result["drops"] == 3 and manifest["drops"]["step_ranges"] == [[0, 0, 2]]
        return
    result, manifest, steps = _close_whole(sess, out)
    if fails == "step":
        assert steps == [0, 2] and result["drops"] == 1 and result["hook_errors"] == 1
        assert manifest["drops"]["step_ranges"] == [[0, 1, 1]]
        assert "hook:assemble_step" in manifest["errors"]
    else:
        assert steps == [0, 1, 2] and result["drops"] == 0
