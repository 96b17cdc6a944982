"""The recorder on the real vLLM objects, on the CPU (0.33.0; its V2 tests on 0.34.0 too).

A stand-in V1 engine (tests/recorder_standin.py) drives the real InputBatch, reorder
function, preprocess/staging functions, ``_update_states_after_model_execute`` and the
``MambaSpecDecodeGPUContext`` launchers running vLLM's Triton kernels interpreted. The
recorder is activated the way it is in production (agent.start arms ``execute_model``, the
first step installs the hooks) and every recorded value is compared with what the real
objects held at the same point, read independently by the test.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.peer

vllm = pytest.importorskip("vllm")

from mgtrace.recorder import agent as agent_mod  # noqa: E402
from mgtrace.recorder import features  # noqa: E402
from mgtrace.recorder.patches import original_of  # noqa: E402
from tests import recorder_standin as standin  # noqa: E402
from tests.conftest import skip_without_v1_runner  # noqa: E402

STEPS = 9


@pytest.fixture(scope="module")
def v() -> Any:
    """The V1 runner's modules; vLLM 0.34 removed that runner, and its tests skip there."""
    skip_without_v1_runner()
    return standin.vllm_modules()


@pytest.fixture
def agent() -> Any:
    a = agent_mod.Agent()
    yield a
    if a.state != "idle":
        a.stop()


def _read(trace: Path, table: str) -> list[dict[str, Any]]:
    parts = sorted((trace / table).glob("*.parquet"))
    rows: list[dict[str, Any]] = []
    for p in parts:
        rows += pq.read_table(p).to_pylist()
    return rows


def _truth(eng: standin.StandinEngine, result: dict[str, Any]) -> dict[str, Any]:
    """What the real objects hold at the end of a step, read without the recorder."""
    ib = eng.runner.input_batch
    n = ib.num_reqs
    ctx = eng.ctx
    bt = ib.block_table[0]
    return {
        "req_ids": list(ib.req_ids),
        "num_prompt": ib.num_prompt_tokens[:n].tolist(),
        "state_col": [eng.runner.mamba_state_idx[r] for r in ib.req_ids],
        "accepted": result["accepted"].tolist(),
        "post": {
            "state_idx": ctx.mamba_state_idx_buf.gpu[:n].tolist(),
            "num_scheduled": ctx.num_scheduled_tokens_buf.gpu[:n].tolist(),
            "num_computed": ctx.num_computed_tokens_buf.gpu[:n].tolist(),
            "num_draft": ctx.num_draft_tokens_buf.gpu[:n].tolist(),
        },
        "pre": {
            "src_col": ctx.precopy_src_col_buf.gpu[:n].tolist(),
            "token_bias": ctx.precopy_token_bias_buf.gpu[:n].tolist(),
        },
        "bt": [bt.block_table.np[i, : bt.num_blocks_per_row[i]].tolist() for i in range(n)],
    }


def _run(
    v: Any,
    agent: Any,
    out: Path,
    steps: int = STEPS,
    spy: list[tuple[int, int, int]] | None = None,
    condensed: list[tuple[int, int, int]] | None = None,
) -> list[dict[str, Any]]:
    """Run the stand-in engine recorded; ``spy`` collects the real swaps (step, row a, row
    b) and ``condensed`` the real condense moves (step, from row, to row)."""
    truths = []
    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v)
        cls = v.gib.InputBatch
        orig_swap, orig_condense = cls.swap_states, cls.condense
        if spy is not None:

            def swap(self: Any, i1: int, i2: int) -> None:
                spy.append((eng.sched.step - 1, i1, i2))
                orig_swap(self, i1, i2)

            cls.swap_states = swap
        if condensed is not None:

            def condense(self: Any) -> None:
                before = list(self._req_ids)
                orig_condense(self)
                rows = {r: i for i, r in enumerate(before) if r is not None}
                step = eng.sched.step - 1
                condensed.extend(
                    (step, rows[r], j)
                    for j, r in enumerate(self._req_ids)
                    if r is not None and rows[r] != j
                )

            cls.condense = condense
        try:
            agent.start(str(out))
            for _ in range(steps):
                truths.append(_truth(eng, eng.step()))
            agent.stop()
        finally:
            cls.swap_states, cls.condense = orig_swap, orig_condense
    return truths


def mismatches(trace: Path, truths: list[dict[str, Any]]) -> list[str]:
    """Every difference between the trace and what the objects held (empty: all equal)."""
    bad: list[str] = []
    rows = _read(trace, "batch_rows")
    launches = _read(trace, "launches")
    tables = _read(trace, "block_tables")
    latest: dict[int, list[int]] = {}
    for step, truth in enumerate(truths):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["batch_row"])
        for name in ("req_ids", "num_prompt", "state_col", "accepted"):
            col = {"req_ids": "req_id"}.get(name, name)
            got = [r[col] for r in mine]
            if got != truth[name]:
                bad.append(f"step {step} batch_rows.{col}: {got} != {truth[name]}")
        for kernel, cols in (("postprocess", truth["post"]), ("precopy", truth["pre"])):
            ls = sorted(
                (r for r in launches if r["step"] == step and r["kernel"] == kernel),
                key=lambda r: r["batch_row"],
            )
            for name, want in cols.items():
                got = [r[name] for r in ls]
                if got != want:
                    bad.append(f"step {step} {kernel}.{name}: {got} != {want}")
            if kernel == "postprocess":
                got = [r["num_accepted"] for r in ls]
                if got != truth["accepted"]:
                    bad.append(f"step {step} postprocess.num_accepted {got}")
        for r in tables:
            if r["step"] == step:
                latest[r["row"]] = r["block_ids"]
        for i, want in enumerate(truth["bt"]):
            if latest.get(i) != want:
                bad.append(f"step {step} block table row {i}: {latest.get(i)} != {want}")
    return bad


def test_recorded_rows_equal_the_real_objects(v: Any, agent: Any, tmp_path: Path) -> None:
    spy: list[tuple[int, int, int]] = []
    condensed: list[tuple[int, int, int]] = []
    truths = _run(v, agent, tmp_path / "t", spy=spy, condensed=condensed)
    trace = tmp_path / "t"
    assert mismatches(trace, truths) == []
    # the reorder really swapped rows (threshold 1 < 1+k) and every swap is in the trace
    moves = _read(trace, "row_moves")
    swaps = [(r["step"], r["row_a"], r["row_b"]) for r in moves if r["op"] == "swap"]
    assert spy and sorted(swaps) == sorted(spy)
    # finished requests left holes that condense really filled, and every such move is in
    # the trace, although the hook skips the steps without holes
    moved = [(r["step"], r["row_a"], r["row_b"]) for r in moves if r["op"] == "move"]
    assert condensed and sorted(moved) == sorted(condensed)
    steps = _read(trace, "steps")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["reorder_threshold"] == 1 and s["postprocess_step"] == s["step"] for s in steps)
    import json

    manifest = json.loads((trace / "manifest.json").read_text())
    assert manifest["complete"] and manifest["errors"] == {}
    assert manifest["run"]["runner"] == "v1" and manifest["run"]["num_speculative_tokens"] == 2

    # failing control: the same comparison flags a truth that differs in one value
    truths[3]["state_col"][0] += 1
    truths[4]["post"]["num_computed"][1] += 1
    assert len(mismatches(trace, truths)) == 2


def test_postprocess_step_is_null_where_no_post_process_launched(
    v: Any, agent: Any, tmp_path: Path
) -> None:
    """vLLM calls ``_update_states_after_model_execute`` every step; a step where it returns
    before the align post-process (here: the model is not hybrid for that step) launched
    none, and its ``steps.postprocess_step`` must say so (null)."""
    skip = 3
    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v)
        agent.start(str(tmp_path / "t"))
        for i in range(5):
            eng.runner.model_config.is_hybrid = i != skip
            eng.step()
        agent.stop()
    trace = tmp_path / "t"
    launched = {r["step"] for r in _read(trace, "launches") if r["kernel"] == "postprocess"}
    assert launched == {0, 1, 2, 4}  # control: the skipped step really launched none
    steps = sorted((s["step"], s["postprocess_step"]) for s in _read(trace, "steps"))
    assert steps == [(0, 0), (1, 1), (2, 2), (3, None), (4, 4)]


def _patched_attrs(v: Any) -> dict[str, Any]:
    ctx = v.mu.MambaSpecDecodeGPUContext
    ib = v.gib.InputBatch
    return {
        "execute_model": vars(v.gmr.GPUModelRunner)["execute_model"],
        "_update_states": vars(v.gmr.GPUModelRunner)["_update_states"],
        "reorder": v.gmr.reorder_batch_to_split_decodes_and_prefills,
        "swap": vars(ib)["swap_states"],
        "condense": vars(ib)["condense"],
        "add": vars(ib)["add_request"],
        "remove": vars(ib)["remove_request"],
        "pre": v.mu.preprocess_mamba,
        "stage": v.mu.stage_postprocess_inputs_to_gpu,
        "precopy": vars(ctx)["run_fused_precopy"],
        "post": vars(ctx)["run_fused_postprocess"],
    }


def test_uninstall_restores_the_originals(v: Any, agent: Any, tmp_path: Path) -> None:
    with standin.StandinRunnerMethods(v.gmr):
        before = _patched_attrs(v)
        eng = standin.StandinEngine(v)
        agent.start(str(tmp_path / "t"))
        eng.step()
        during = _patched_attrs(v)
        assert all(during[k] is not before[k] for k in before)
        assert all(original_of(during[k]) is before[k] for k in before if k != "execute_model")
        agent.stop()
        after = _patched_attrs(v)
    assert after == before
    # failing control: a leftover patch is seen by the same comparison
    v.gib.InputBatch.swap_states = during["swap"]
    try:
        assert _patched_attrs(v) != before
    finally:
        v.gib.InputBatch.swap_states = before["swap"]


SYNC_NAMES = ("item", "cpu", "tolist", "numpy")


class SyncCounter:
    """Counts synchronizing calls made on one thread: device waits, reads of device tensors."""

    def __init__(self, torch: Any, thread: threading.Thread) -> None:
        self.torch, self.thread, self.count, self.saved = torch, thread, 0, []

    def _wrap(self, owner: Any, name: str, device_only: bool = False) -> None:
        orig = getattr(owner, name)
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            # reading a host tensor waits for nothing; reading a device tensor does
            on_device = not device_only or args[0].device.type != "cpu"
            if threading.current_thread() is counter.thread and on_device:
                counter.count += 1
            return orig(*args, **kwargs)

        self.saved.append((owner, name, orig))
        setattr(owner, name, counted)

    def __enter__(self) -> SyncCounter:
        t = self.torch
        for name in SYNC_NAMES:
            self._wrap(t.Tensor, name, device_only=True)
        self._wrap(t.cuda, "synchronize")
        self._wrap(t.cuda.Event, "synchronize")
        # torch.Event is a C type that cannot be patched; the hooks never receive one
        # except the runner's accepted-count event, of which they only call query()
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)


def _count_syncs(v: Any, agent: Any | None, out: Path, steps: int = 4, k: int = standin.K) -> int:
    import torch

    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v, k=k)
        if agent is not None:
            agent.start(str(out))
        with SyncCounter(torch, threading.current_thread()) as counter:
            for _ in range(steps):
                eng.step()
        if agent is not None:
            agent.stop()
    return counter.count


@pytest.mark.parametrize(
    ("k", "module", "hook_name"),
    [
        (standin.K, "hooks_common", "_postprocess"),
        # without a speculative config the hooks read host values only
        (0, "hooks_v1", "_scalar_copy"),
    ],
)
def test_hooks_add_no_synchronizing_call(
    v: Any, agent: Any, tmp_path: Path, k: int, module: str, hook_name: str
) -> None:
    unhooked = _count_syncs(v, None, tmp_path / "a", steps=8, k=k)
    hooked = _count_syncs(v, agent, tmp_path / "b", steps=8, k=k)
    assert hooked == unhooked
    # failing control: a hook that waits for the device is counted
    import importlib

    import torch

    mod = importlib.import_module(f"mgtrace.recorder.{module}")
    real = getattr(mod, hook_name)

    def waits(sess: Any, args: Any, kwargs: Any) -> None:
        torch.cuda.synchronize()  # counted, then fails on a CPU build: the guard catches it
        real(sess, args, kwargs)

    setattr(mod, hook_name, waits)
    try:
        bad = _count_syncs(v, agent_mod.Agent(), tmp_path / "c", steps=8, k=k)
    finally:
        setattr(mod, hook_name, real)
    assert bad > unhooked


def _outcome(v: Any, agent: Any, out: Path | None, on_step: Any = None) -> list[Any]:
    """What the engine computed over six steps, recording into ``out`` (None: not)."""
    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v)
        if out is not None:
            agent.start(str(out))
        results = []
        for i in range(6):
            r = eng.step()
            if on_step is not None:
                on_step(i)
            results.append(
                (
                    r["req_ids"],
                    r["accepted"].tolist(),
                    dict(eng.runner.mamba_state_idx),
                    eng.temporal.sum().item(),
                )
            )
        if out is not None:
            agent.stop()
    return results


def test_crashing_writer_and_hooks_do_not_disturb_the_engine(
    v: Any, agent: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the writer runs in this process only with the in-thread fallback, chosen explicitly
    monkeypatch.setenv("MGTRACE_RECORDER_ASSEMBLER", "thread")

    def outcome(record: str | None) -> list[Any]:
        with standin.StandinRunnerMethods(v.gmr):
            eng = standin.StandinEngine(v)
            if record is not None:
                agent.start(str(tmp_path / record))
            out = []
            for _ in range(6):
                r = eng.step()
                out.append(
                    (
                        r["req_ids"],
                        r["accepted"].tolist(),
                        dict(eng.runner.mamba_state_idx),
                        eng.temporal.sum().item(),
                    )
                )
            if record is not None:
                agent.stop()
        return out

    clean = outcome(None)
    from mgtrace.recorder import hooks_v1
    from mgtrace.schemas.writer import TraceWriter

    def disk_full(self: Any, rel: str, table: Any) -> Any:
        raise OSError(28, "No space left on device")

    def broken(sess: Any, *args: Any) -> None:
        raise RuntimeError("hook bug")

    import json

    # a writer that fails: the recording ends itself (nothing more can be written), the
    # engine goes on as if never recorded
    with monkeypatch.context() as m:
        m.setattr(TraceWriter, "_write_part", disk_full)
        assert outcome("crash") == clean
    manifest = json.loads((tmp_path / "crash" / "manifest.json").read_text())
    assert not manifest["complete"]
    assert "writer" in manifest["errors"]
    # hooks that fail: counted, the engine untouched
    monkeypatch.setattr(hooks_v1, "_swap", broken)
    assert outcome("hooks") == clean
    assert agent.last_result["hook_errors"] > 0
    # failing control: the comparison does see an engine whose results changed
    assert outcome(None)[1:] != clean[:-1]


def test_dying_assembler_process_does_not_disturb_the_engine(
    v: Any, agent: Any, tmp_path: Path
) -> None:
    import json
    import signal

    clean = _outcome(v, agent_mod.Agent(), None)
    killed: list[int] = []

    def kill_child(i: int) -> None:
        if i == 2:
            proc = agent.session.sink.proc
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append(proc.returncode)

    assert _outcome(v, agent, tmp_path / "dead", kill_child) == clean
    assert killed and killed[0] != 0
    manifest = json.loads((tmp_path / "dead" / "manifest.json").read_text())
    assert manifest["source"]["assembler"] == "process"
    assert not manifest["complete"]
    assert "assembler process" in manifest["errors"]["writer"]["first"]
    assert agent.last_result["writer_failed"] and not agent.last_result["complete"]
    # failing control: with the child left alone the same run is complete
    assert _outcome(v, agent, tmp_path / "alive") == clean
    manifest = json.loads((tmp_path / "alive" / "manifest.json").read_text())
    assert manifest["complete"] and "writer" not in manifest["errors"]
    assert agent.last_result["rows"] > 0 and agent.last_result["writer_failed"] is None


def test_feature_detection_refuses_naming_what_is_missing(
    v: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v)
        kind, owners = features.check_runner(eng.runner)
        assert kind == "v1" and len(owners) == len(features.V1_TARGETS)
        launcher = vars(v.mu.MambaSpecDecodeGPUContext)["run_fused_postprocess"]
        monkeypatch.delattr(v.mu.MambaSpecDecodeGPUContext, "run_fused_postprocess")
        with pytest.raises(features.RecorderRefusal, match=r"run_fused_postprocess(?!_align)"):
            features.check_runner(eng.runner)
        # the stand-in keeps stepping through the launcher bound on its own context, which
        # the detection (it looks at the class) does not see
        eng.ctx.run_fused_postprocess = launcher.__get__(eng.ctx)
        # refused at activation: nothing patched, the engine keeps stepping, status says why
        a = agent_mod.Agent()
        a.start("/tmp/mgtrace-refused-never-written")
        before = vars(v.gib.InputBatch)["swap_states"]
        eng.step()
        assert a.state == "refused" and "run_fused_postprocess" in a.status()["refusal"]
        assert vars(v.gib.InputBatch)["swap_states"] is before
        assert vars(v.gmr.GPUModelRunner)["execute_model"] is standin.standin_execute_model


def _scalar_copies_implied(trace: Path, eng: standin.StandinEngine) -> dict[int, list[tuple]]:
    """Per step, the (source, destination, bytes) copies the trace's precopy rows name, as
    vLLM's copy functions would address them in the engine's two state tensors."""
    conv, temporal = eng.conv, eng.temporal
    tables = sorted(_read(trace, "block_tables"), key=lambda r: r["step"])
    launches = _read(trace, "launches")
    latest: dict[int, list[int]] = {}
    out: dict[int, list[tuple]] = {}
    for step in sorted({r["step"] for r in launches}):
        for r in tables:
            if r["step"] == step:
                latest[r["row"]] = r["block_ids"]
        copies = []
        for r in launches:
            if r["step"] != step or r["kernel"] != "precopy" or r["src_col"] < 0:
                continue
            blocks, bias = latest[r["batch_row"]], r["token_bias"]
            dst = blocks[r["state_idx"]]
            conv_src = conv[blocks[r["src_col"]], bias:]
            copies.append((conv_src.data_ptr(), conv[dst].data_ptr(), conv_src.numel() * 4))
            t_src = temporal[blocks[r["src_col"] + bias]]
            copies.append((t_src.data_ptr(), temporal[dst].data_ptr(), t_src.numel() * 4))
        out[step] = sorted(copies)
    return out


def _rewrite_part(trace: Path, table: str, edit: Any) -> None:
    """Replace one table's single part by ``edit(part)``, keeping the manifest true."""
    import hashlib
    import json

    (path,) = (trace / table).glob("*.parquet")
    pq.write_table(edit(pq.read_table(path)), path)
    manifest = json.loads((trace / "manifest.json").read_text())
    for part in manifest["parts"]:
        if part["path"] == f"{table}/{path.name}":
            data = path.read_bytes()
            part["bytes"], part["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (trace / "manifest.json").write_text(json.dumps(manifest))


def test_v1_without_speculative_config_records_the_scalar_copies(
    v: Any, agent: Any, tmp_path: Path
) -> None:
    """Without a speculative config vLLM's V1 runner builds no align context, and
    ``preprocess_mamba`` hands each state copy to ``collect_mamba_copy_meta`` and runs them
    with one ``batch_memcpy``. The trace holds them as the step's precopy launch: every copy
    the launch rows name is, byte for byte, a copy vLLM queued (pointers and sizes read from
    its real copy buffers), and the replay finds the run clean."""
    import pyarrow as pa

    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.schemas.reader import TraceReader

    queued: dict[int, list[tuple]] = {}
    real_do = v.mu.do_mamba_copy_block

    def spy(bufs: Any) -> None:
        n = bufs.offset
        ptrs = zip(bufs.src_ptrs.np[:n], bufs.dst_ptrs.np[:n], bufs.sizes.np[:n], strict=True)
        queued[eng.sched.step - 1] = sorted((int(a), int(b), int(c)) for a, b, c in ptrs)
        real_do(bufs)

    out = tmp_path / "k0"
    steps = 14
    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v, k=0)
        assert features.check_runner(eng.runner)[0] == "v1"
        v.mu.do_mamba_copy_block = spy
        try:
            agent.start(str(out))
            state_cols = []
            for _ in range(steps):
                eng.step()
                ib = eng.runner.input_batch
                state_cols.append([eng.runner.mamba_state_idx[r] for r in ib.req_ids])
            agent.stop()
        finally:
            v.mu.do_mamba_copy_block = real_do
    reader = TraceReader(out)
    assert reader.complete and reader.manifest.errors == {}
    assert reader.manifest.run.num_speculative_tokens == 0
    launches = _read(out, "launches")
    assert {r["kernel"] for r in launches} == {"precopy"}  # no post-process at k = 0
    implied = _scalar_copies_implied(out, eng)
    assert sum(map(len, queued.values())) >= 8, "the run must cross block boundaries"
    assert {s: c for s, c in implied.items() if c} == {s: c for s, c in queued.items() if c}
    for step, want in enumerate(state_cols):
        rows = sorted((r for r in launches if r["step"] == step), key=lambda r: r["batch_row"])
        assert [r["state_idx"] for r in rows] == want
    assert replay_trace(TraceReader(out), RuleSet()).findings == []

    # failing controls: a copy vLLM queued that the trace lacks is seen by both checks
    first = min(i for i, r in enumerate(launches) if r["src_col"] >= 0)

    def drop_first_copy(part: pa.Table) -> pa.Table:
        col = part.column("src_col").to_pylist()
        assert col[first] >= 0  # the only part, in the order it was read
        col[first] = -1
        at = part.schema.get_field_index("src_col")
        return part.set_column(at, part.schema.field(at), pa.array(col, part.schema.field(at).type))

    _rewrite_part(out, "launches", drop_first_copy)
    assert _scalar_copies_implied(out, eng) != {s: c for s, c in queued.items()}
    assert replay_trace(TraceReader(out), RuleSet()).findings


def test_v1_scalar_path_without_its_copy_function_is_refused(
    v: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM whose scalar path lacks ``collect_mamba_copy_meta`` copies states where no
    hook sees them: a V1 runner without a speculative config is refused, naming it."""
    with standin.StandinRunnerMethods(v.gmr):
        eng = standin.StandinEngine(v, k=0)
        monkeypatch.delattr(v.mu, "collect_mamba_copy_meta")
        with pytest.raises(features.RecorderRefusal, match="collect_mamba_copy_meta"):
            features.check_runner(eng.runner)
        eng.runner.speculative_config = object()  # the fused path needs no such function
        assert features.check_runner(eng.runner)[0] == "v1"


def test_v2_state_hooks_record_what_the_slot_indexed_kernels_read(tmp_path: Path) -> None:
    """The V2 align path on real objects: MambaHybridModelState's preprocess/postprocess run
    vLLM's kernels (advance + precopy, scatter + post-process) through idx_mapping; the
    launches must hold the slot values those kernels read, gathered per batch row, and a
    post-process deferred by the PP handler must carry the step that pushed it."""
    from collections import deque
    from types import SimpleNamespace

    import torch
    import vllm.v1.worker.gpu.model_states.mamba_hybrid as mh

    from mgtrace.recorder import hooks_v2
    from mgtrace.recorder.patches import PatchSet
    from mgtrace.recorder.session import Session
    from mgtrace.schemas.manifest import RunMetadata

    owners, missing = features.resolve_all(features.V2_TARGETS)
    assert missing == []
    memory = standin.AlignMemory.create()  # the state and block-table memory ctx points at
    ctx = memory.ctx
    slots = torch.tensor([5, 1, 3], dtype=torch.int32)  # batch row -> request slot
    n, size = 3, standin.MAX_REQS
    state = object.__new__(mh.MambaHybridModelState)
    state._align_mode, state.recoverssm = True, None
    state._use_flashinfer_replayssm = False  # vLLM 0.34's postprocess asks
    state._mamba_ctx, state._mamba_group_ids = ctx, [0]
    state._mamba_spec = SimpleNamespace(block_size=standin.B)
    state.num_accepted_tokens_gpu = torch.tensor([1, 2, 1, 3, 1, 2, 1, 1], dtype=torch.int32)
    state._mamba_state_idx_gpu = torch.tensor([0, 1, 0, 2, 0, -1, 0, 0], dtype=torch.int32)
    state._mamba_src_col_gpu = torch.full((size,), -1, dtype=torch.int32)
    state._mamba_src_off_gpu = torch.zeros(size, dtype=torch.int32)
    computed = torch.tensor([0, 6, 0, 9, 0, 0, 0, 0], dtype=torch.int32)
    ib = SimpleNamespace(
        num_reqs=n,
        idx_mapping=slots,
        query_start_loc=torch.tensor([0, 5, 8, 11], dtype=torch.int32),
    )
    acc_before = state.num_accepted_tokens_gpu.clone()
    sidx_before = state._mamba_state_idx_gpu.clone()

    sess = Session(tmp_path / "v2", rank=0, kind="v2", run=RunMetadata(runner="v2"))
    patches = PatchSet()
    patches.install(hooks_v2.v2_patches(sess, owners))
    try:
        handler = SimpleNamespace(queue=deque([None, None]))  # a PP handler, pp_size 2
        pp = hooks_v2._PPHooks()

        def get_prev() -> None:
            pp.prev_before(sess, (handler,), {})
            handler.queue.popleft()
            handler.queue.append(None)

        def receive(entry: object) -> None:
            handler.queue[-1] = entry
            pp.receive_after(sess, None, None, (handler, ib), {})

        sess.begin_step(None)  # step 0: precopy, then its samples are received
        get_prev()
        # prepare_inputs' batch: its computed counts are the scheduler's, optimistic under
        # async scheduling (two drafts of the last step counted that were rejected)
        batch = SimpleNamespace(
            num_reqs=n,
            req_ids=["a", "b", "c"],
            idx_mapping_np=slots.numpy(),
            num_computed_tokens_np=computed.numpy()[slots.numpy()] + 2,
            num_scheduled_tokens=np.array([5, 3, 3], dtype=np.int32),
            num_draft_tokens_per_req=np.array([0, 2, 2], dtype=np.int32),
            is_prefilling_np=np.array([True, False, False]),
            prefill_len_np=np.array([20, 4, 4], dtype=np.int32),
        )
        hooks_v2._inputs_after(sess, None, batch, (), {})
        state.preprocess_state(ib, (), None, computed)
        after_pre = (
            state._mamba_state_idx_gpu.clone(),
            state._mamba_src_col_gpu.clone(),
            state._mamba_src_off_gpu.clone(),
            state.num_accepted_tokens_gpu.clone(),
        )
        receive(object())
        sess.begin_step(None)  # step 1
        get_prev()
        receive(None)
        sess.begin_step(None)  # step 2: step 0's deferred post-process runs now
        get_prev()
        new_computed = computed + torch.tensor([0, 4, 0, 3, 0, 5, 0, 0], dtype=torch.int32)
        sampled = torch.tensor([2, 4, 1], dtype=torch.int32)
        state.postprocess_state(slots, sampled, new_computed)
    finally:
        patches.remove()
    sess.rec = None
    assert sess.close()["complete"]
    launches = _read(tmp_path / "v2", "launches")
    pre = sorted((r for r in launches if r["kernel"] == "precopy"), key=lambda r: r["batch_row"])
    post = sorted(
        (r for r in launches if r["kernel"] == "postprocess"), key=lambda r: r["batch_row"]
    )
    idx = slots.tolist()
    assert [r["req_slot"] for r in pre] == idx == [r["req_slot"] for r in post]
    assert [r["state_idx"] for r in pre] == [after_pre[0][i].item() for i in idx]
    assert [r["src_col"] for r in pre] == [sidx_before[i].item() for i in idx]
    assert [r["token_bias"] for r in pre] == [max(acc_before[i].item() - 1, 0) for i in idx]
    assert [r["token_bias"] for r in pre] == [after_pre[2][i].item() for i in idx]
    # the post-process read the scattered counts max(sampled, 1) (its snapshot), whatever
    # it normalised them to afterwards
    assert [r["num_accepted"] for r in post] == [max(s, 1) for s in sampled.tolist()]
    assert [r["num_computed"] for r in post] == [new_computed[i].item() for i in idx]
    assert all(
        r["mode"] == "precomputed" and r["row_rule"] == "req_slot" and r["bt_table"] == "source"
        for r in post
    )
    assert {(r["step"], r["batch_step"]) for r in post} == {(2, 0)}
    assert {(r["step"], r["batch_step"]) for r in pre} == {(0, 0)}
    # failing control: read after the launch instead of before it, the precopy's bias is
    # gone (the advance kernel reset the counts of rows that crossed a block)
    late = [max(after_pre[3][i].item() - 1, 0) for i in idx]
    assert late != [r["token_bias"] for r in pre]
    # the batch rows hold the computed counts the advance kernel read (the device's, per
    # slot), not the batch's optimistic CPU mirror (the control: it differs on every row)
    rows = sorted(_read(tmp_path / "v2", "batch_rows"), key=lambda r: r["batch_row"])
    assert [r["num_computed"] for r in rows] == [computed[i].item() for i in idx]
    assert [r["num_computed"] for r in rows] != batch.num_computed_tokens_np.tolist()


def test_v2_pp_receives_queued_before_recording_keep_their_steps(tmp_path: Path) -> None:
    """Recording starts on a running non-last PP rank (pp_size 2) whose FIFO already holds
    the receives of the two steps before it. Their deferred post-processes, run by the real
    ``MambaHybridModelState.postprocess_state`` in steps 0 and 1, processed batches of steps
    -2 and -1, which the replay must run before the step's forward, not after it."""
    from collections import deque
    from types import SimpleNamespace

    import torch
    import vllm.v1.worker.gpu.model_states.mamba_hybrid as mh

    from mgtrace.recorder import hooks_v2
    from mgtrace.recorder.patches import PatchSet
    from mgtrace.recorder.session import Session
    from mgtrace.schemas.manifest import RunMetadata

    owners, missing = features.resolve_all(features.V2_TARGETS)
    assert missing == []
    memory = standin.AlignMemory.create()
    slots = torch.tensor([5, 1, 3], dtype=torch.int32)
    state = object.__new__(mh.MambaHybridModelState)
    state._align_mode, state.recoverssm = True, None
    state._use_flashinfer_replayssm = False  # vLLM 0.34's postprocess asks
    state._mamba_ctx, state._mamba_group_ids = memory.ctx, [0]
    state._mamba_spec = SimpleNamespace(block_size=standin.B)
    state.num_accepted_tokens_gpu = torch.ones(standin.MAX_REQS, dtype=torch.int32)
    state._mamba_state_idx_gpu = torch.tensor([0, 1, 0, 2, 0, 1, 0, 0], dtype=torch.int32)
    computed = torch.tensor([0, 6, 0, 9, 0, 5, 0, 0], dtype=torch.int32)
    out = tmp_path / "pp"
    sess = Session(out, rank=0, kind="v2", run=RunMetadata(runner="v2"))
    patches = PatchSet()
    patches.install(hooks_v2.v2_patches(sess, owners))
    handler = SimpleNamespace(queue=deque([object(), object()]))  # pushed by steps -2, -1
    pp = hooks_v2._PPHooks()
    try:
        for _ in range(3):
            sess.begin_step(None)
            pp.prev_before(sess, (handler,), {})  # execute_model: update_pp_decode_requests
            handler.queue.popleft()
            handler.queue.append(None)
            sampled = torch.tensor([2, 2, 2], dtype=torch.int32)
            state.postprocess_state(slots, sampled, computed + 3)
            handler.queue[-1] = object()  # sample_tokens: this step's receive
            pp.receive_after(sess, None, None, (handler, None), {})
            state.postprocess_state(slots, 0)  # non-final prefill chunks: launches nothing
            sess.step_done()
    finally:
        patches.remove()
    sess.end_step()
    assert sess.close()["complete"]
    post = {(r["step"], r["batch_step"]) for r in _read(out, "launches")}
    assert post == {(0, -2), (1, -1), (2, 0)}
    # the neutral postprocess_state(idx_mapping, 0) after the receive launches nothing and
    # leaves the step's postprocess_step as the deferred launch set it
    steps = [(s["step"], s["postprocess_step"]) for s in _read(out, "steps")]
    assert steps == [(0, -2), (1, -1), (2, 0)]


@pytest.mark.parametrize("how", ["finished", "preempted", "resumed"])
def test_prev_state_col_follows_vllms_cleanup_of_forgotten_requests(how: str) -> None:
    """``preprocess_mamba`` first forgets the running column of finished, preempted and
    resumed requests (``cleanup_mamba_state_idx``); a request aborted and resubmitted under
    the same id is finished and scheduled in one step, and starts from the column its
    computed tokens end in. The hook keeps the dict from before that cleanup."""
    skip_without_v1_runner()  # the cleanup is the V1 runner's
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.worker.mamba_utils import cleanup_mamba_state_idx

    from mgtrace.recorder.step_tables import StepTables

    cached = CachedRequestData(
        req_ids=[],
        resumed_req_ids={"x"} if how == "resumed" else set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[],
        num_computed_tokens=[],
        num_output_tokens=[],
    )
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"x": 8, "y": 1},
        total_num_scheduled_tokens=9,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids={"x"} if how == "finished" else set(),
        free_encoder_mm_hashes=[],
        preempted_req_ids={"x"} if how == "preempted" else None,
    )
    state_idx = {"x": 5, "y": 3}
    before = dict(state_idx)  # what the preprocess_mamba hook keeps
    cleanup_mamba_state_idx(so, state_idx)  # what preprocess_mamba does first
    computed = np.array([0, 13], dtype=np.int32)
    B = standin.B
    truth = [state_idx.get(r, (int(c) - 1) // B) for r, c in zip("xy", computed, strict=True)]
    assert truth == [-1, 3]  # control: vLLM forgot x's column 5, kept y's
    got = StepTables("v1", B)._prev_cols(so, ["x", "y"], before, computed)
    assert got.tolist() == truth


def test_a_replayssm_engine_is_refused() -> None:
    """``--use-replayssm`` (vLLM 0.34) keeps a Mamba2 decode's recent inputs in a ring and
    stores the whole state only on a flush, which the replay does not model: the recorder
    refuses such an engine, naming the flag. The same runner without it is accepted."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.req_states = runner.model_state = None
    runner.cache_config = SimpleNamespace(use_replayssm=True)
    with pytest.raises(features.RecorderRefusal, match="--use-replayssm"):
        features.check_runner(runner)
    runner.cache_config.use_replayssm = False  # failing control: nothing else refuses it
    assert features.check_runner(runner)[0] == "v2"


def test_a_target_whose_parameters_moved_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM whose hooked method takes its arguments in another order would hand the hook
    the wrong one: ``BlockTables.append_block_ids`` with its first two parameters swapped
    is refused, naming both orders, and nothing else is. Control: the real one (0.33 and
    0.34 alike) passes."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    owners, missing = features.resolve_all(features.V2_TARGETS)
    assert missing == [] and len(owners) == len(features.V2_TARGETS)

    def moved(self: Any, new_block_ids: Any, req_index: int, overwrite: bool) -> None:
        pass

    monkeypatch.setattr(BlockTables, "append_block_ids", moved)
    owners, missing = features.resolve_all(features.V2_TARGETS)
    assert missing == [
        "vllm.v1.worker.gpu.block_table:BlockTables.append_block_ids takes (new_block_ids, "
        "req_index, overwrite), where the hook reads (req_index, new_block_ids, overwrite)"
    ]
    assert len(owners) == len(features.V2_TARGETS) - 1


def test_the_v2_batch_fields_the_recorder_reads_are_vllms() -> None:
    """``prepare_inputs`` returns vLLM's V2 ``InputBatch``, and its hook reads fields of it
    by name: each name it reads, noted by driving the hook with an object that records
    every attribute asked of it, must be a field of the installed vLLM's dataclass (0.33
    and 0.34 alike). Control: the noting object does see the reads the trace needs."""
    import dataclasses
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.input_batch import InputBatch

    from mgtrace.recorder import hooks_v2

    read: list[str] = []

    class Noting:
        def __getattr__(self, name: str) -> Any:
            read.append(name)
            if name == "num_reqs":
                return 2
            return ["a", "b"] if name == "req_ids" else np.zeros(2, dtype=np.int32)

    sess = SimpleNamespace(rec={})
    hooks_v2._inputs_after(sess, None, Noting(), (), {})
    assert {"idx_mapping_np", "num_computed_tokens_np", "num_scheduled_tokens"} <= set(read)
    fields = {f.name for f in dataclasses.fields(InputBatch)}
    assert sorted(set(read) - fields) == []
