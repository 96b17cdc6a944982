"""Recorder parts that need neither vLLM nor a device: patches, hooks' guard, the control
protocol, the capture ring on the CPU, launch rows, and the field probe-log importer."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import threading
import time
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from mgtrace.errors import OutputError, UsageError
from mgtrace.recorder import agent as agent_mod
from mgtrace.recorder import control
from mgtrace.recorder.capture import CaptureRing
from mgtrace.recorder.hooks_common import _precopy, hook
from mgtrace.recorder.patches import Patch, PatchSet, original_of
from mgtrace.recorder.probe_import import crosstab_sql, import_probe
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.reader import TraceReader

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------- patches
class Base:
    def inherited(self) -> str:
        return "base"


class Target(Base):
    def own(self) -> str:
        return "own"


def _suffix(tag: str) -> Any:
    def make(orig: Any) -> Any:
        return lambda self: orig(self) + tag

    return make


def test_patch_set_installs_all_or_nothing_and_restores_exactly() -> None:
    own, t = Target.__dict__["own"], Target()
    ps = PatchSet()
    ps.install([Patch(Target, "own", _suffix("+")), Patch(Target, "inherited", _suffix("+"))])
    assert (t.own(), t.inherited()) == ("own+", "base+")
    assert original_of(Target.__dict__["own"]) is own
    ps.remove()
    assert Target.__dict__["own"] is own and "inherited" not in Target.__dict__
    assert (t.own(), t.inherited()) == ("own", "base")
    with pytest.raises(AttributeError, match="missing"):
        PatchSet().install([Patch(Target, "own", _suffix("+")), Patch(Target, "nope", _suffix(""))])
    assert Target.__dict__["own"] is own  # the present target was not touched
    # failing control: a set left installed is visible to the same check
    ps.install([Patch(Target, "own", _suffix("+"))])
    assert Target.__dict__["own"] is not own
    ps.remove()


class FakeSession:
    def __init__(self) -> None:
        self.live = True
        self.failures: list[str] = []

    def hook_failed(self, name: str, exc: BaseException, *, drop_step: bool = False) -> None:
        self.failures.append(f"{name}: {exc}")


def test_hook_never_raises_into_the_caller_and_calls_the_original_once() -> None:
    calls = []

    def orig(x: int) -> int:
        calls.append(x)
        return x * 2

    def bad_before(sess: Any, args: Any, kwargs: Any) -> None:
        raise ValueError("before broke")

    def bad_after(sess: Any, token: Any, result: Any, args: Any, kwargs: Any) -> None:
        raise KeyError("after broke")

    sess = FakeSession()
    wrapped = hook(sess, "h", before=bad_before)(orig)  # type: ignore[arg-type]
    assert wrapped(3) == 6 and calls == [3]
    wrapped = hook(sess, "h2", after=bad_after)(orig)  # type: ignore[arg-type]
    assert wrapped(4) == 8 and calls == [3, 4]
    assert [f.split(":")[0] for f in sess.failures] == ["h", "h2"]
    sess.live = False
    assert wrapped(5) == 10 and len(sess.failures) == 2  # pass-through when not live
    # failing control: the original's own exception still reaches the caller
    with pytest.raises(ZeroDivisionError):
        hook(sess, "h3", before=bad_before)(lambda: 1 / 0)()  # type: ignore[arg-type]


# ----------------------------------------------------------------- control protocol
@pytest.mark.parametrize(
    "request_, error",
    [
        ({"cmd": "status"}, None),
        ({"cmd": "start", "args": {"out": "/tmp/t", "max_steps": 5, "duration_s": 2}}, None),
        ({"cmd": "exec", "args": {}}, "unknown command"),
        ({"cmd": "start", "args": {"out": "relative"}}, "absolute path"),
        ({"cmd": "start", "args": {"out": "/t", "max_steps": 0}}, "positive integer"),
        ({"cmd": "start", "args": {"out": "/t", "max_steps": True}}, "positive integer"),
        ({"cmd": "start", "args": {"out": "/t", "duration_s": float("nan")}}, "seconds"),
        ({"cmd": "start", "args": {"out": "/t", "code": "import os"}}, "takes no argument"),
        ({"cmd": "start", "args": {"out": "/t", "not_recorded": ["pid 5 was not"]}}, None),
        ({"cmd": "start", "args": {"out": "/t", "not_recorded": "pid 5"}}, "list of at most"),
        ({"cmd": "start", "args": {"out": "/t", "not_recorded": [5]}}, "list of at most"),
        ({"cmd": "start", "args": {"out": "/t", "not_recorded": ["x" * 201]}}, "list of at"),
        ({"cmd": "stop", "args": {"out": "/t"}}, "takes no argument"),
        ({"cmd": "status", "extra": 1}, "unknown request field"),
        (["status"], "JSON object"),
    ],
)
def test_control_requests_are_validated(request_: Any, error: str | None) -> None:
    if error is None:
        cmd, _args = control.validate(request_)
        assert cmd == request_["cmd"]
    else:
        with pytest.raises(ValueError, match=error):
            control.validate(request_)


def test_peer_check_accepts_only_the_same_uid() -> None:
    me = os.geteuid()
    assert control.peer_allowed(me)
    assert not control.peer_allowed(me + 1)
    assert not control.peer_allowed(65534, own_uid=0)


def test_runtime_dir_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = control.runtime_dir()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o755)
    with pytest.raises(control.ControlError, match="private directory"):
        control.runtime_dir()


# ----------------------------------------------------------------- capture and launch rows
def test_capture_ring_on_the_cpu_is_exact_and_counts_drops() -> None:
    import torch

    ring = CaptureRing(torch.device("cpu"), slots=2, slot_elems=16)
    a = torch.tensor([3, -1, 7], dtype=torch.int32)
    b = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    assert ring.grab([a, b], [3, 2], {"k": 1})
    a[0] = 99  # what happens after the capture must not change it
    assert ring.grab([b], [4], {"k": 2})
    assert not ring.grab([b], [4], {"k": 3}) and ring.dropped == 1
    (arrays1, tag1), (arrays2, tag2) = ring.reap()
    assert arrays1[0].tolist() == [3, -1, 7] and arrays1[1].tolist() == [1, 2]
    assert arrays2[0].tolist() == [1, 2, 3, 4] and (tag1, tag2) == ({"k": 1}, {"k": 2})
    assert not ring.grab([a, b], [9, 9], {}) and ring.dropped == 2  # too large for a slot
    assert ring.refusal == "18 values, over the 16 of a slot"


def test_a_host_capture_holds_its_step_back_until_reaped() -> None:
    """A capture of host tensors is complete when taken, but until the recorder thread has
    reaped it, it counts as pending: its step's record must not go out before it, and a
    close must not end the thread with it still queued. Control: a ring that counts only
    device captures as pending lets the step go first."""
    import torch

    ring = CaptureRing(torch.device("cpu"), slots=4, slot_elems=16)
    assert ring.pending == 0 and ring.oldest_pending_tag() is None
    ring.grab([torch.arange(3, dtype=torch.int32)], [3], {"step": 5})
    ring.grab([torch.arange(2, dtype=torch.int32)], [2], {"step": 6})
    assert ring.pending == 2 and ring.oldest_pending_tag() == {"step": 5}
    assert ring.pending_steps() == {5, 6}
    assert [tag["step"] for _, _, tag in ring.reap_raw()] == [5, 6]
    assert ring.pending == 0 and ring.oldest_pending_tag() is None


@pytest.mark.parametrize(
    "array",
    [
        np.array([3, -1, 7], dtype=np.int32),
        np.array([3, -1, 7], dtype=">i4"),
        np.array([[1, 2], [3, 4]], dtype=np.int32),
        np.array([True, False, True]),
        np.array([2**40, -5], dtype=np.int64),
    ],
    ids=["int32", "int32-byte-swapped", "int32-2d", "bool", "int64"],
)
def test_a_raw_array_comes_back_with_its_values_shape_and_kind(array: np.ndarray) -> None:
    """What the hooks store raw reads back as the same values, shape and kind, in native
    byte order. Control: carrying the dtype's one-letter code loses the byte order, and a
    byte-swapped vector comes back as other numbers."""
    from mgtrace.recorder.wire import _array, raw

    back = _array(raw(array))
    assert back.tolist() == array.tolist() and back.shape == array.shape
    assert back.dtype.kind == array.dtype.kind and back.dtype.isnative


def test_raw_arrays_of_one_kind_in_either_byte_order_keep_their_own() -> None:
    """``raw`` names each dtype once and keeps the name: arrays of one kind and size in
    both byte orders, one after another, each read back as their own values. Control: a
    name kept by kind and size (the dtype's ``char``) reads the second order's bytes as the
    first's, and the numbers come back swapped."""
    from mgtrace.recorder.wire import _array, raw

    for order in ("<i8", ">i8", "<i8", ">i8"):
        array = np.array([3, 2**40], dtype=order)
        assert _array(raw(array)).tolist() == [3, 2**40], order


def test_each_align_context_gets_its_own_binding_however_lookups_interleave() -> None:
    """A V2 context with a table set of its own for the aligned indices binds the per-slot
    source tables (rows are request slots); one without binds the gathered input tables
    (rows are batch rows). The binding is looked up per launch and kept per context:
    alternating lookups of two contexts, in either order, give each its own. Control: a
    kept binding checked by kind alone gives the second context the first one's."""
    from types import SimpleNamespace

    from mgtrace.recorder.hooks_common import _binding_of

    two = SimpleNamespace(aligned_index_block_table_ptrs=None)
    one = SimpleNamespace()
    got = [_binding_of(ctx, "v2") for ctx in (two, one, one, two, two, one)]
    source, gathered = ("req_slot", "source"), ("batch_row", "input")
    assert got == [source, gathered, gathered, source, source, gathered]
    assert _binding_of(one, "v1") == ("req_slot", "v1")


def test_host_captures_follow_the_values_and_the_tensors_they_are_given() -> None:
    """The ring caches numpy views per group of host tensors: a later capture of the same
    tensors copies their current values, one of other tensors (or other lengths) copies
    those, and a tensor of another dtype is stored as int32 like the device path stores
    it, also where only the first tensor is new (V2's ``idx_mapping``). Control: a cache
    that returned the first views for any tensors would capture ``a`` again in place of
    ``c``; one that checked only the first tensor, ``b`` in place of ``a``; one that kept
    a new first tensor's int64 words, other numbers."""
    import torch

    ring = CaptureRing(torch.device("cpu"), slots=8, slot_elems=16)
    a = torch.tensor([1, 2, 3], dtype=torch.int32)
    b = torch.tensor([4, 5, 6], dtype=torch.int32)
    ring.grab((a, b), (3, 2), 0)
    a[0] = 10
    ring.grab((a, b), (3, 2), 1)
    c = torch.tensor([7, 8, 9], dtype=torch.int32)
    ring.grab((c, b), (3, 2), 2)
    ring.grab((c, b), (2, 3), 3)
    ring.grab((c, a), (2, 3), 4)  # the same first tensor and lengths, another second
    ring.grab((torch.tensor([11, 12], dtype=torch.int64),), (2,), 5)
    # V2's launches: a fresh int64 idx_mapping first each step, the same vectors after it
    ring.grab((torch.tensor([13, 14], dtype=torch.int64), b), (2, 3), 6)
    ring.grab((torch.tensor([15, 16], dtype=torch.int64), b), (2, 3), 7)
    got = [([x.tolist() for x in arrays], tag) for arrays, tag in ring.reap()]
    assert got == [
        ([[1, 2, 3], [4, 5]], 0),
        ([[10, 2, 3], [4, 5]], 1),
        ([[7, 8, 9], [4, 5]], 2),
        ([[7, 8], [4, 5, 6]], 3),
        ([[7, 8], [10, 2, 3]], 4),
        ([[11, 12]], 5),
        ([[13, 14], [4, 5, 6]], 6),
        ([[15, 16], [4, 5, 6]], 7),
    ]


def test_staged_inputs_follow_a_replaced_buffer() -> None:
    """The launch hooks cache views of an align context's CPU buffers per context and row
    count. A context whose buffer is replaced is read from the new buffer, and a buffer
    the context lacks is left out. Control: a cache keyed on the context alone would return
    the old buffer's values, and one keyed on the row count alone would miss a buffer
    only the other context has."""
    from mgtrace.recorder.hooks_common import staged_inputs

    def buf(values: list[int]) -> SimpleNamespace:
        return SimpleNamespace(np=np.array(values, dtype=np.int32))

    ctx = SimpleNamespace(
        mamba_state_idx_buf=buf([1, 2, 3]),
        num_scheduled_tokens_buf=buf([4, 4, 4]),
        num_computed_tokens_buf=buf([9, 9, 9]),
        num_draft_tokens_buf=None,
    )

    def ints(staged: dict[str, Any]) -> dict[str, list[int]]:
        return {k: np.frombuffer(v, dtype=np.int32).tolist() for k, v in staged.items()}

    assert ints(staged_inputs(ctx, 2)) == {
        "state_idx": [1, 2],
        "num_scheduled": [4, 4],
        "num_computed": [9, 9],
    }
    ctx.mamba_state_idx_buf.np[0] = 7  # the same buffer, new values
    ctx.num_computed_tokens_buf = buf([5, 6, 7])  # a new buffer
    assert ints(staged_inputs(ctx, 2)) == {
        "state_idx": [7, 2],
        "num_scheduled": [4, 4],
        "num_computed": [5, 6],
    }
    assert ints(staged_inputs(ctx, 3))["num_computed"] == [5, 6, 7]
    # another context with the same buffers and one this one lacks, then this one again
    other = SimpleNamespace(**{**vars(ctx), "num_draft_tokens_buf": buf([3, 3, 3])})
    assert ints(staged_inputs(other, 3))["num_draft"] == [3, 3, 3]
    assert "num_draft" not in staged_inputs(ctx, 3)


@pytest.mark.parametrize("max_num_seqs", [None, 1700])
def test_capture_slots_fit_the_engines_widest_launch(tmp_path: Path, max_num_seqs: Any) -> None:
    """A fused post-process of 1700 running requests reads 5 x 1700 values: the slots are
    sized from max_num_seqs, and a capture that still does not fit is named for what it
    is, not a full ring. Control: without max_num_seqs the default slot refuses it."""
    import torch

    sess = Session(
        tmp_path / "t",
        rank=0,
        kind="v1",
        run=RunMetadata(max_num_seqs=max_num_seqs),
        assembler="thread",
    )
    try:
        vec = torch.zeros(1700, dtype=torch.int32)
        sess.grab([vec] * 5, [1700] * 5, {"step": 0, "kernel": "postprocess"})
        errors = dict(sess._error_totals)
        if max_num_seqs:
            assert not errors and not sess._doomed
        else:
            assert list(errors) == ["capture_too_large"] and sess._doomed == {0}
            assert "8500 values, over the 8192 of a slot" in errors["capture_too_large"]["first"]
    finally:
        sess.close()


def test_ring_slots_are_copied_in_runs_of_consecutive_slots() -> None:
    from mgtrace.recorder.capture import consecutive_runs

    assert consecutive_runs([5, 6, 7]) == [(5, 8)]
    assert consecutive_runs([510, 511, 0, 1]) == [(510, 512), (0, 2)]  # the ring's wrap
    assert consecutive_runs([3]) == [(3, 4)] and consecutive_runs([]) == []
    # control: a gap is never bridged (that copy would carry a slot still being staged)
    assert consecutive_runs([1, 3]) == [(1, 2), (3, 4)]


class _CountedEvent:
    """A device event stand-in that says whether it completed and counts the asking."""

    def __init__(self, done: bool) -> None:
        self.done, self.asked = done, 0

    def query(self) -> bool:
        self.asked += 1
        return self.done


def _issued_ring(copies: list[_CountedEvent]) -> CaptureRing:
    """A device ring (without a device) whose slots 0.. have their host copies issued, slot
    i under ``copies[i]``: what ``reap_raw`` takes from once the copies land."""
    ring = object.__new__(CaptureRing)
    ring.cuda = True
    ring._host_np = np.arange(len(copies) * 4, dtype=np.int32).reshape(len(copies), 4)
    ring._pending = deque([i, (4,), {"step": i}, copy] for i, copy in enumerate(copies))
    ring._issued = len(copies)
    ring._free = deque()
    return ring


def test_slots_issued_together_ask_their_copy_event_once() -> None:
    """The slots whose host copies were issued together share one copy event: the reap asks
    it once, however many slots it covers, and takes them all in order. Control: slots
    issued apart are asked apart, and a copy not landed holds back its slot and those after
    it."""
    together = _CountedEvent(done=True)
    ring = _issued_ring([together] * 5)
    got = ring.reap_raw()
    assert [tag["step"] for _, _, tag in got] == [0, 1, 2, 3, 4]
    assert got[2][0] == np.arange(8, 12, dtype=np.int32).tobytes()
    assert together.asked == 1 and list(ring._free) == [0, 1, 2, 3, 4]
    first, second, late = _CountedEvent(True), _CountedEvent(True), _CountedEvent(False)
    ring = _issued_ring([first, first, second, late, late])
    assert [tag["step"] for _, _, tag in ring.reap_raw()] == [0, 1, 2]
    assert (first.asked, second.asked, late.asked) == (1, 1, 1)
    assert len(ring._pending) == 2 and ring._issued == 2


def _buf(values: list[int]) -> Any:
    import torch

    t = torch.tensor(values + [0] * 4, dtype=torch.int32)
    return SimpleNamespace(np=t.numpy().copy(), gpu=t)


def test_precopy_launch_rows_keep_both_values_where_they_differ(tmp_path: Path) -> None:
    sess = Session(tmp_path / "t", rank=0, kind="v1", run=RunMetadata())
    sess.begin_step(None)
    state, src, bias = _buf([2, 3, 1]), _buf([1, -1, 0]), _buf([1, 0, 2])
    bias.np[2] = 0  # the CPU staged 0, the kernel reads 2 (a racing copy)
    ctx = SimpleNamespace(
        is_initialized=True,
        mamba_state_idx_buf=state,
        precopy_src_col_buf=src,
        precopy_token_bias_buf=bias,
    )
    _precopy(sess, (ctx, 3, state.gpu, src.gpu, bias.gpu, None), {})  # type: ignore[arg-type]
    sess.rec = None
    result = sess.close()
    assert result["complete"]
    reader = TraceReader(tmp_path / "t")
    rows = (
        reader.connect()
        .execute(
            "SELECT batch_row, state_idx, src_col, token_bias, num_accepted, num_accepted_cpu, "
            "kernel, row_rule, bt_table FROM launches ORDER BY batch_row"
        )
        .fetchall()
    )
    assert rows == [
        (0, 2, 1, 1, 2, None, "precopy", "req_slot", "v1"),
        (1, 3, -1, 0, 1, None, "precopy", "req_slot", "v1"),
        (2, 1, 0, 2, 3, 1, "precopy", "req_slot", "v1"),
    ]
    errors = reader.manifest.errors
    assert errors["launch_cpu_mismatch"]["count"] == 1
    assert "token_bias" in errors["launch_cpu_mismatch"]["first"]


# ----------------------------------------------------------------- probe importer
def _probe_logs(tmp: Path, seed: int = 7) -> tuple[Path, Path, dict[str, Any]]:
    """Probe and burst logs in the field reproducer's formats, with a known re-analysis outcome."""
    rnd = random.Random(seed)
    probe, burst = [], []
    pid = 4242
    probe.append({"event": "patched", "module": "x"})
    probe.append(
        {
            "event": "start",
            "mode": "log,geom",
            "async": True,
            "mamba_cache_mode": "align",
            "runner_reorder_batch_threshold": 1,
            "builder_thresholds": {
                "Mamba2AttentionMetadataBuilder": 4,
                "FlashInferMetadataBuilder": 1,
            },
        }
    )
    step = 1
    truth = {}
    for i in range(40):
        api = f"chatcmpl-{i:04d}"
        eng = f"{api}-{rnd.randrange(16**8):08x}"
        p = rnd.choice([30, 200, 6000])
        kind = rnd.choice(["first", "later", "both", "clean", "clean"])
        rows_for = []
        # its own prefill chunk: computed 0, scheduled p (never a decode-like row)
        rows_for.append([eng, 0, p])
        if kind in ("first", "both"):
            rows_for.append([eng, p + rnd.randint(0, 4), 4])
        if kind in ("later", "both"):
            rows_for.append([eng, p + 5 + rnd.randint(0, 50), rnd.randint(1, 4)])
        if kind == "clean":
            rows_for.append([eng, p + 2, 9])  # in the region, but not a decode-sized chunk
        for r in rows_for:
            lead = ["chatcmpl-lead-1", 100, 512]
            probe.append(
                {
                    "event": "prefill",
                    "step": step,
                    "num_reqs": 5,
                    "num_decode_tokens": 3,
                    "rows": [lead, r],
                    "t": 1000.0 + step,
                    "pid": pid,
                }
            )
            # a second builder logs the same step: the importer keeps the first only
            probe.append(
                {
                    "event": "prefill",
                    "step": step,
                    "num_reqs": 5,
                    "num_decode_tokens": 3,
                    "rows": [[eng, 0, 1]],
                    "pid": pid,
                }
            )
            step += 1
        if i % 5 == 0:
            probe.append(
                {
                    "event": "swap",
                    "step": step,
                    "early": bool(i % 2),
                    "num_reqs": 4,
                    "swaps": [[0, 3, eng, "chatcmpl-lead-1", 2, 1]],
                    "pid": pid,
                }
            )
        tokens = rnd.choice([120, 900, 3000])
        salad = rnd.random() < 0.3
        empty = not salad and rnd.random() < 0.3 and tokens > 200
        text = ("word " * (tokens // 2)) if not empty else ("\u200b" * tokens)
        burst.append(
            {
                "i": i,
                "req_id": api,
                "marker": "m",
                "kind": "long",
                "finish": "length",
                "completion_tokens": tokens,
                "prompt_tokens": p,
                "t_start": 5.0 + i,
                "t_end": 9.0 + i,
                "text": text,
                "garbage": salad,
                "foreign_markers": [3] if i == 11 else [],
            }
        )
        truth[api] = (kind, "salad" if salad else "empty" if empty else "")
    probe.append({"event": "tick", "step": 1000, "steps_with_event": 900, "early_steps": 12})
    burst.append({"i": 99, "error": "timeout", "t_start": 3.0})
    pp, bp = tmp / "probe.jsonl", tmp / "burst.jsonl"
    lines = [json.dumps(e) for e in probe]
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"event": "prefill", "step": "x", "rows": []}))
    lines.insert(12, json.dumps({"event": "swap", "step": 3, "swaps": [[1, 2]]}))
    pp.write_text("\n".join(lines) + "\n")
    bp.write_text("\n".join(json.dumps(r) for r in burst) + "\nnot json either\n")
    return pp, bp, truth


def _expected_crosstab(truth: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for kind, label in truth.values():
        key = (
            "FIRST decode step in Mamba prefill region"
            if kind in ("first", "both")
            else "first decode step clean"
        )
        if kind in ("later", "both"):
            key += " | later decode steps in prefill region"
        out[key][0] += 1
        out[key][1] += label == "salad"
        out[key][2] += label == "empty"
    return {k: tuple(v) for k, v in out.items()}  # type: ignore[misc]


def test_import_probe_reproduces_the_reanalysis_crosstab(tmp_path: Path) -> None:
    pp, bp, truth = _probe_logs(tmp_path)
    report = import_probe(pp, bp, tmp_path / "trace")
    assert report.malformed == {"probe_line": 3, "burst_line": 1}
    assert report.requests == 41 and report.matched_requests == 40
    reader = TraceReader(tmp_path / "trace")
    assert reader.complete
    errors = reader.manifest.errors
    assert errors["import:probe_line"]["count"] == 3
    con = reader.connect()
    got = {r[0]: tuple(r[1:]) for r in con.execute(crosstab_sql(4)).fetchall()}
    assert got == _expected_crosstab(truth)
    # the duplicate prefill event of each step was not imported; steps count from 0
    dup = con.execute(
        "SELECT count(*) FROM batch_rows WHERE num_scheduled = 1 AND num_computed = 0"
    ).fetchone()
    assert dup == (0,)
    assert con.execute("SELECT min(step) FROM steps").fetchone() == (0,)
    row = con.execute(
        "SELECT mamba_threshold, reorder_threshold, num_mamba_decodes FROM steps WHERE step = 0"
    ).fetchone()
    assert row == (4, 1, 3)
    assert con.execute("SELECT count(*) FROM row_moves WHERE op = 'swap'").fetchone() == (8,)
    marker = con.execute("SELECT corruption_marker FROM requests WHERE client_id = '11'")
    assert "foreign:3" in (marker.fetchone()[0] or "")
    # failing control: flip one request's label and the same query no longer matches
    api = next(a for a, (k, lab) in truth.items() if lab == "" and k == "first")
    truth[api] = (truth[api][0], "salad")
    assert got != _expected_crosstab(truth)


def test_import_probe_shows_k_and_block_size_as_unknown(tmp_path: Path) -> None:
    """A probe log carries neither the speculative token count nor the Mamba block size:
    ``info`` and ``report`` must not present the manifest's defaults (0, 16) as facts."""
    from rich.console import Console

    from mgtrace.query.info import trace_info
    from mgtrace.render import render_info
    from mgtrace.report import _run_section

    pp, bp, _ = _probe_logs(tmp_path)
    import_probe(pp, bp, tmp_path / "trace")
    info = trace_info(TraceReader(tmp_path / "trace"))

    def shown(info: dict[str, Any]) -> tuple[str, str]:
        console = Console(record=True, width=200)
        render_info(info, console)
        return console.export_text(), "".join(_run_section(info))

    for text in shown(info):
        assert re.search(r"(k \(spec tokens\)|<td>k)(\W|td)+unknown", text), text
        assert re.search(r"mamba block size(\W|td)+unknown", text), text
    # control: a source that carries them shows the values
    info["source"].pop("run_unknown")
    for text in shown(info):
        assert "unknown" not in text
        assert re.search(r"mamba block size(\W|td)+16", text), text


def test_import_probe_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        import_probe(tmp_path / "nope.jsonl", None, tmp_path / "t")
    junk = tmp_path / "junk.jsonl"
    junk.write_text("garbage\n{}\n")
    with pytest.raises(UsageError, match="no probe events"):
        import_probe(junk, None, tmp_path / "t2")
    assert not (tmp_path / "t2").exists()
    # an empty log with an empty burst file, or the two swapped, write no empty trace
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    pp, bp, _ = _probe_logs(tmp_path)
    for probe, burst in ((empty, empty), (bp, pp)):
        with pytest.raises(UsageError, match=r"no probe events and .* no requests"):
            import_probe(probe, burst, tmp_path / "t3")
        assert not (tmp_path / "t3").exists()
    # a folder that is not there is refused before the logs are read, and none is made
    missing = tmp_path / "no" / "such" / "t4"
    with pytest.raises(OutputError, match=f"the directory {missing.parent} does not exist"):
        import_probe(pp, bp, missing)
    assert not (tmp_path / "no").exists()
    import_probe(pp, bp, tmp_path / "t4")  # control: into a folder that is there


def test_import_probe_counts_values_no_trace_column_holds(tmp_path: Path) -> None:
    """A row number past int32 or a token count that is a word is a malformed entry, counted;
    it once ended the import with an internal error and a trace of no parts marked
    complete. Control: the same logs without them import every entry."""
    pp, bp, _ = _probe_logs(tmp_path)
    clean = import_probe(pp, bp, tmp_path / "clean")
    bad_pp, bad_bp = tmp_path / "bad_probe.jsonl", tmp_path / "bad_burst.jsonl"
    swap = {"event": "swap", "pid": 1, "t": 0.2, "step": 2, "early": False}
    swap["swaps"] = [[4_000_000_000, 1, "req-a-1", "req-b-2", 1, 2]]
    bad_pp.write_text(pp.read_text() + json.dumps(swap) + "\n")
    row = {"i": 10_000, "req_id": "r", "completion_tokens": "many", "text": "hi", "t_start": 1}
    bad_bp.write_text(bp.read_text() + json.dumps(row) + "\n")
    report = import_probe(bad_pp, bad_bp, tmp_path / "bad")
    assert report.malformed_total == clean.malformed_total + 2
    assert (report.steps, report.requests) == (clean.steps, clean.requests)
    assert TraceReader(tmp_path / "bad").manifest.complete
    # an output that is the input is refused whatever --force says, and the log survives
    with pytest.raises(UsageError, match="is \\(or holds\\) the input"):
        import_probe(pp, None, pp, force=True)
    assert pp.is_file()


def test_import_probe_survives_lines_that_break_the_json_reader_or_int64(tmp_path: Path) -> None:
    """Deep nesting (RecursionError), Infinity and huge times or thresholds once ended the
    import with an internal error; now a line is counted as malformed, or the value that
    fits no column is left out. Control: the clean logs import with no such count."""
    pp, _, _ = _probe_logs(tmp_path)
    clean = import_probe(pp, None, tmp_path / "clean")
    lines = pp.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "start")
    start = json.loads(lines[at])
    start["builder_thresholds"] = {"MambaB": 99_999_999_999, "Attn": 1}
    lines[at] = json.dumps(start)
    swap = {"event": "swap", "pid": 1, "step": 2, "early": False, "swaps": []}
    odd = [
        "[" * 100_000,  # deeper than the JSON reader recurses
        json.dumps({**swap, "t": 1e11}),
        '{"event": "swap", "pid": 1, "step": 3, "early": false, "swaps": [], "t": Infinity}',
    ]
    bad = tmp_path / "odd.jsonl"
    bad.write_text("\n".join([*lines, *odd]) + "\n")
    report = import_probe(bad, None, tmp_path / "odd")
    assert report.malformed_total == clean.malformed_total + 1
    assert report.steps == clean.steps + 2  # each odd swap opens a step of process 1
    reader = TraceReader(tmp_path / "odd")
    assert reader.complete and reader.manifest.run.builder_reorder_thresholds["MambaB"] is None


def test_import_probe_leaves_a_trace_mgtrace_reads_back_in_strict_json(tmp_path: Path) -> None:
    """A negative reorder threshold in the probe's start event was copied into the manifest's
    run section, which the reader then refused (the import exited 0, and every verb exited 3
    on its trace); a NaN or an infinity in a tick or the start's mode (the JSON reader
    accepts them) made manifest.json, and ``info --json``, non-standard JSON. Now a
    threshold below 0 is absent, like one out of range, and such a value is null. Control:
    the clean logs import with their thresholds."""
    pp, _, _ = _probe_logs(tmp_path)
    clean = tmp_path / "clean"
    import_probe(pp, None, clean)
    assert TraceReader(clean).manifest.run.runner_reorder_threshold == 1
    lines = pp.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"event": "start"' in line)
    start = json.loads(lines[at])
    start["runner_reorder_batch_threshold"] = -5
    start["builder_thresholds"] = {"Mamba2AttentionMetadataBuilder": -1, "Attn": 1}
    lines[at] = json.dumps(start)[:-1] + ', "mode": NaN}'
    lines.append('{"event": "tick", "step": NaN, "steps_with_event": Infinity, "early_steps": 3}')
    odd = tmp_path / "odd.jsonl"
    odd.write_text("\n".join(lines) + "\n")
    import_probe(odd, None, tmp_path / "odd")
    reader = TraceReader(tmp_path / "odd")  # raised ManifestError: must be at least 0
    run = reader.manifest.run
    assert run.runner_reorder_threshold is None
    assert run.builder_reorder_thresholds == {"Mamba2AttentionMetadataBuilder": None, "Attn": 1}

    def refuse(constant: str) -> None:
        raise AssertionError(f"manifest.json holds {constant}")

    manifest = json.loads((tmp_path / "odd" / "manifest.json").read_text(), parse_constant=refuse)
    assert manifest["source"]["probe_mode"] is None
    assert manifest["source"]["last_tick"] == {
        "step": None,
        "steps_with_event": None,
        "early_steps": 3,
    }


def test_import_probe_counts_lone_surrogates_as_malformed_lines(tmp_path: Path) -> None:
    """JSON may escape a lone surrogate ("\\udc80"), which no UTF-8 column holds: one such
    request id once cost the whole requests table (or a step) while the import reported
    success. Now the line is malformed, counted, and the other rows are kept; what the
    report counts is what the trace holds. Control: the clean logs."""
    pp, bp, _ = _probe_logs(tmp_path)
    clean = import_probe(pp, bp, tmp_path / "clean")
    bad_pp, bad_bp = tmp_path / "bad_probe.jsonl", tmp_path / "bad_burst.jsonl"
    odd = [
        {"event": "prefill", "pid": 1, "step": 900, "num_reqs": 1, "rows": [["x\udc80-1", 5, 1]]},
        {"event": "swap", "pid": 1, "step": 901, "swaps": [[0, 1, "a-1", "b\ud800-2", 1, 1]]},
    ]
    bad_pp.write_text(pp.read_text() + "".join(json.dumps(e) + "\n" for e in odd))
    row = {"i": 10_000, "req_id": "x\udc80", "text": "hi", "completion_tokens": 3}
    pair = {"i": 10_001, "req_id": "smile\U0001f600", "text": "hi", "completion_tokens": 1}
    bad_bp.write_text(bp.read_text() + json.dumps(row) + "\n" + json.dumps(pair) + "\n")
    report = import_probe(bad_pp, bad_bp, tmp_path / "bad")
    assert report.malformed["probe_line"] == clean.malformed["probe_line"] + 2
    assert report.malformed["burst_line"] == clean.malformed["burst_line"] + 1
    assert (report.steps, report.requests) == (clean.steps, clean.requests + 1)  # + the pair
    reader = TraceReader(tmp_path / "bad")
    assert "malformed_rows" not in reader.manifest.errors
    con = reader.connect()
    assert con.execute("SELECT count(*) FROM requests").fetchone() == (report.requests,)
    assert con.execute("SELECT count(*) FROM steps").fetchone() == (report.steps,)


def test_import_probe_counts_lines_of_invalid_utf8_as_malformed(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 were once replaced by U+FFFD, so two ids differing only in
    them became one request, and the import said nothing. Now each such line is malformed,
    and an event is counted only once it was taken. Control: the clean logs."""
    pp, bp, _ = _probe_logs(tmp_path)
    clean = import_probe(pp, bp, tmp_path / "clean")
    bad_pp, bad_bp = tmp_path / "bad_probe.jsonl", tmp_path / "bad_burst.jsonl"
    prefill = (
        b'{"event": "prefill", "pid": 1, "step": 900, "num_reqs": 1, "rows": [["req-%s", 5, 1]]}\n'
    )
    bad_pp.write_bytes(pp.read_bytes() + prefill % b"\xff\xfe" + prefill % b"\xfe\xff")
    ids = (b"\xff-a", b"\xfe-a")
    bad_bp.write_bytes(
        bp.read_bytes()
        + b"".join(
            b'{"i": %d, "req_id": "x%s", "text": "hi"}\n' % (10_000 + n, i)
            for n, i in enumerate(ids)
        )
    )
    report = import_probe(bad_pp, bad_bp, tmp_path / "bad")
    assert report.malformed["probe_line"] == clean.malformed["probe_line"] + 2
    assert report.malformed["burst_line"] == clean.malformed["burst_line"] + 2
    assert (report.steps, report.requests) == (clean.steps, clean.requests)
    assert report.events == clean.events  # the refused lines are not counted as events
    # a line that parses but is refused is no event either
    refused = b'{"event": "prefill", "pid": 1, "step": 0, "num_reqs": 1, "rows": []}\n'
    (tmp_path / "refused.jsonl").write_bytes(pp.read_bytes() + refused)
    report = import_probe(tmp_path / "refused.jsonl", bp, tmp_path / "refused")
    assert report.malformed["probe_line"] == clean.malformed["probe_line"] + 1
    assert report.events == clean.events


def test_import_probe_leaves_no_trace_the_writer_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a value the importer let through be refused by the writer, the trace would
    hold less than the import reports: it is an error that says so, and no trace is left."""
    from mgtrace.errors import OutputError
    from mgtrace.recorder import probe_import
    from mgtrace.recorder.cli import import_probe as command

    pp, bp, _ = _probe_logs(tmp_path)
    monkeypatch.setattr(probe_import, "corruption", lambda row: (True, "salad\udc80"))
    with pytest.raises(OutputError, match="refused 1 batch of request rows"):
        import_probe(pp, bp, tmp_path / "t")
    assert not (tmp_path / "t").exists()
    code, text = _invoke(command, [str(pp), str(bp), "-o", str(tmp_path / "t")])
    assert code == 2 and "refused 1 batch of request rows" in text
    assert not (tmp_path / "t").exists()
    monkeypatch.undo()  # control: the same logs import
    assert import_probe(pp, bp, tmp_path / "t").requests == 41


def test_import_probe_counts_a_dropped_duplicate_as_unmatched(tmp_path: Path) -> None:
    """A request id the burst file repeats keeps its first row; the repeat, counted as
    malformed, once also counted as matched to an engine id."""
    pp, bp, _ = _probe_logs(tmp_path)
    lines = bp.read_text().splitlines()
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join([*lines, lines[0]]) + "\n")  # the first request, matched, again
    report = import_probe(pp, dup, tmp_path / "t")
    assert report.malformed["duplicate_request"] == 1
    assert (report.requests, report.matched_requests) == (41, 40)


def test_engine_id_maps_to_the_client_id_like_the_reanalysis() -> None:
    # the re-analysis joins on the engine id minus its last "-suffix"
    assert re.sub(r"-[^-]*$", "", "chatcmpl-abc-123-deadbeef") == "chatcmpl-abc-123"


# ----------------------------------------------------------------- command line
def _invoke(cmd: Any, args: list[str]) -> tuple[int, str]:
    from mgtrace.errors import MgtraceError

    try:
        rv = cmd.main(args, prog_name="mgtrace", standalone_mode=False)
    except MgtraceError as exc:
        return exc.exit_code, exc.message
    return int(rv or 0), ""


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "either --engine-pid PID or the engine command"),
        (["--engine-pid", "1", "--", "vllm", "serve"], "either --engine-pid PID or"),
        (["--engine-pid", "1", "--duration", "-3"], "--duration must be a positive"),
        (["--engine-pid", "1", "--duration", "nan"], "--duration must be a positive, finite"),
        (["--engine-pid", "1", "--duration", "inf"], "--duration must be a positive, finite"),
        (["--engine-pid", "1", "--max-steps", "0"], "--max-steps must be at least 1"),
        (["--", "vllm", "serve"], "give the trace directory with -o DIR"),
        (["--engine-pid", "999999999", "-o", "/tmp/mgtrace-never"], "there is no process"),
        (["--engine-pdi", "3"], "no such option: --engine-pdi"),
        (["--engine-pid", "1", "--duraton", "10"], "no such option: --duraton"),
        (["-o", "/tmp/mgtrace-never", "--max-step", "5", "--", "true"], "no such option"),
    ],
)
def test_record_rejects_bad_arguments_in_one_sentence(args: list[str], message: str) -> None:
    from mgtrace.recorder.cli import record

    code, text = _invoke(record, args)
    assert code == 2 and message in text and "\n" not in text


def test_record_leaves_the_engine_commands_options_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Options after the engine command's first word are the engine's, even where mgtrace
    has one of that name. Control: before the command they are mgtrace's."""
    from mgtrace.recorder import cli

    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "_record", lambda *a: seen.append(a) or 0)
    out = tmp_path / "t"
    engine = ["echo", "hello", "--duration", "5", "--output", "x"]
    assert _invoke(cli.record, ["-o", str(out), *engine]) == (0, "")
    assert _invoke(cli.record, ["-o", str(out), "--duration", "5", "--", "echo"]) == (0, "")
    (_, output, duration, _, command, _), (_, _, control_duration, _, control_command, _) = seen
    assert output == out and duration is None and command == tuple(engine)
    assert control_duration == 5.0 and control_command == ("echo",)


def test_record_force_replaces_only_traces(tmp_path: Path) -> None:
    """--force replaces a trace or a folder of traces, and only after the engine process
    checks out. Control: a folder of traces alone is replaced: moved aside, and put back
    when the recording holds no step."""
    from mgtrace.recorder.cli import _check_output, _OldTrace, record

    project = tmp_path / "project"
    (project / "old-trace").mkdir(parents=True)
    (project / "old-trace" / "manifest.json").write_text('{"format": "mgtrace-trace"}')
    (project / "NOTES.md").write_text("mine")
    code, text = _invoke(record, ["--engine-pid", "999999999", "-o", str(project), "-f"])
    assert code == 2 and "there is no process" in text
    assert (project / "NOTES.md").read_text() == "mine"  # a bad pid touches nothing
    for force in (True, False):  # without --force too: passing it would not help
        with pytest.raises(Exception, match="nor a folder of traces; choose another path"):
            _check_output(project, force=force)
    assert (project / "NOTES.md").is_file() and (project / "old-trace").is_dir()
    (project / "NOTES.md").unlink()
    assert _check_output(project, force=True)
    old = _OldTrace(project)
    old.move_aside()
    assert not project.exists()
    old.settle()
    assert (project / "old-trace" / "manifest.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["project"]


def test_record_refuses_another_users_engine_even_as_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent answers its own uid only, root included: recording another user's engine
    is refused up front, not after a 30 s wait for a socket that cannot answer."""
    from mgtrace.recorder import attach, proctree

    me = os.geteuid()
    monkeypatch.setattr(
        proctree, "tree", lambda pid: [proctree.Proc(pid, 1, me + 1, "python3", "vllm serve")]
    )
    for euid in (me, 0):
        monkeypatch.setattr(os, "geteuid", lambda euid=euid: euid)
        with pytest.raises(UsageError, match=f"belongs to uid {me + 1}; record as that user"):
            attach.engine_tree(4242)
    # control: the engine's own user passes
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    assert attach.engine_tree(4242)[0].pid == 4242


FAKE_PID = 9_000_000  # above any pid_max: no real process answers to these


class _FakeAgents:
    """Control messages to stand-in agents: the first process holds a runner module, the
    others only wait for one; ``fail_start`` makes that process's start fail."""

    def __init__(self, n: int, fail_start: int | None = None) -> None:
        self.sent: list[tuple[int, str]] = []
        self.n, self.fail_start = n, fail_start

    def send(self, path: Path, cmd: str, args: Any = None, timeout_s: float = 0) -> dict:
        pid = int(path.stem)
        self.sent.append((pid, cmd))
        if cmd == "start":
            if pid == self.fail_start:
                raise control.ControlError("Connection refused")
            return {
                "state": "armed" if pid == FAKE_PID else "waiting",
                "runner_modules": ["gpu_model_runner"] if pid == FAKE_PID else [],
            }
        return {"state": "idle", "steps": 3}

    def stopped(self) -> set[int]:
        return {pid for pid, cmd in self.sent if cmd == "stop"}


def _fake_tree(monkeypatch: pytest.MonkeyPatch, agents: _FakeAgents) -> None:
    from mgtrace.recorder import attach, proctree

    procs = [
        proctree.Proc(FAKE_PID + i, 1, os.geteuid(), "python3", "python3 -m vllm serve")
        for i in range(agents.n)
    ]
    monkeypatch.setattr(attach, "engine_tree", lambda pid: procs)
    monkeypatch.setattr(
        attach,
        "connect",
        lambda p, allow_inject=True: attach.Target(p, Path(f"/x/{p.pid}.sock"), "plugin"),
    )
    monkeypatch.setattr(control, "send", agents.send)


def test_record_stops_every_agent_it_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process that was started but still waits for a runner module gets stop too, else
    it arms later with nobody to stop it; a failed start stops the ones started before it."""
    from mgtrace.recorder import attach

    agents = _FakeAgents(3)
    _fake_tree(monkeypatch, agents)
    done = attach.record_pid(1, tmp_path / "t", duration_s=None, max_steps=None)
    assert [t.proc.pid for t in done] == [FAKE_PID]
    assert agents.stopped() == {FAKE_PID, FAKE_PID + 1, FAKE_PID + 2}
    agents = _FakeAgents(3, fail_start=FAKE_PID + 2)
    _fake_tree(monkeypatch, agents)
    with pytest.raises(control.ControlError):
        attach.record_pid(1, tmp_path / "t", duration_s=None, max_steps=None)
    assert agents.stopped() == {FAKE_PID, FAKE_PID + 1}


def test_unreached_processes_fit_the_start_request_and_an_older_agent_starts_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many unreachable processes with long reasons still make a start request the agent
    accepts; an agent of an older mgtrace, which refuses the argument, is started without
    it (control: another refusal is not retried)."""
    import json

    from mgtrace.recorder import attach, proctree

    procs = [proctree.Proc(FAKE_PID + i, 1, 0, "python3", "python3 vllm") for i in range(40)]
    reason = f"process X has no mgtrace agent; gdb cannot attach ({'é' * 300}); "
    sentences = attach._for_manifest([(p, reason + attach.ENABLE_HINT) for p in procs])
    request = {"cmd": "start", "args": {"out": "/" + "d" * 4000, "not_recorded": sentences}}
    assert len(json.dumps(request)) + 1 <= control.MAX_REQUEST_BYTES
    assert control.validate(request)[1]["not_recorded"] == sentences
    assert sentences[0].startswith(f"pid {FAKE_PID} (api-server) was not recorded: process X")
    assert sentences[-1] == "25 more processes were not recorded"

    sent: list[dict[str, Any]] = []

    def older(path: Path, cmd: str, args: Any = None, timeout_s: float = 0) -> dict:
        sent.append(dict(args))
        try:
            control.validate({"cmd": cmd, "args": {k: v for k, v in args.items() if k != "x"}})
            if "not_recorded" in args:
                raise ValueError("start takes no argument 'not_recorded'")
        except ValueError as exc:
            raise control.ControlError(f"the agent at {path} refused: {exc}") from None
        return {"state": "armed"}

    monkeypatch.setattr(control, "send", older)
    target = attach.Target(procs[0], Path("/x/1.sock"), "plugin")
    assert attach._start(target, {"out": "/t", "not_recorded": ["pid 1"]}) == {"state": "armed"}
    assert sent == [{"out": "/t", "not_recorded": ["pid 1"]}, {"out": "/t"}]
    with pytest.raises(control.ControlError, match="absolute path"):
        attach._start(target, {"out": "t", "not_recorded": ["pid 1"]})


def test_engines_get_folders_of_their_own_only_where_their_traces_would_collide() -> None:
    """Two single-rank engines under a shell would write one folder: each gets its own.
    Controls: the ranks of one world under a parent that is not vLLM's, and an EngineCore
    (runner module, no world) above its single-rank worker, keep the folder as it was."""
    from mgtrace.recorder import attach, proctree

    def target(pid: int, ppid: int, dist: list[int] | None, runner: bool = True) -> Any:
        proc = proctree.Proc(pid, ppid, 0, "python3", "python3 -m vllm")
        status = {"runner_modules": ["gpu_model_runner"] if runner else [], "dist": dist}
        return attach.Target(proc, Path(f"/x/{pid}.sock"), "plugin", status)

    out = Path("/t/out")

    def folders(*targets: Any) -> dict[int, Path]:
        return attach._folders([t.proc for t in targets], list(targets), out)

    # two engines (api server 10 and 20, each with its single-rank EngineCore) under pid 1
    shell = [target(10, 1, None, False), target(11, 10, [0, 1]), target(20, 1, None, False)]
    split = folders(*shell, target(21, 20, None))
    assert split == {pid: out / f"engine-{pid // 10 * 10}" for pid in (10, 11, 20, 21)}
    # two ranks of one world under a parent that is no engine process
    assert set(folders(target(31, 1, [0, 2]), target(32, 1, [1, 2])).values()) == {out}
    # an EngineCore whose single worker holds the world
    assert set(folders(target(40, 1, None), target(41, 40, [0, 1])).values()) == {out}
    # two engines of two ranks each: rank 0 and rank 1 would be written twice
    two = [target(50, 1, None), target(51, 50, [0, 2]), target(52, 50, [1, 2])]
    two += [target(60, 1, None), target(61, 60, [0, 2]), target(62, 60, [1, 2])]
    assert set(folders(*two).values()) == {out / "engine-50", out / "engine-60"}


def test_import_probe_command_reports_counts(tmp_path: Path, capsys: Any) -> None:
    from mgtrace.recorder.cli import import_probe as command

    pp, bp, _ = _probe_logs(tmp_path)
    code, _ = _invoke(command, [str(pp), str(bp), "-o", str(tmp_path / "t")])
    captured = capsys.readouterr()
    assert code == 0
    assert "40 matched to engine ids" in captured.out
    assert "skipped 4 malformed entries" in captured.err
    assert "no load-generator request id matches" not in captured.err  # control for below
    empty = tmp_path / "empty_probe.jsonl"  # nothing to link the requests to steps
    empty.write_text(json.dumps({"event": "start", "pid": 1}) + "\n")
    code, _ = _invoke(command, [str(empty), str(bp), "-o", str(tmp_path / "unlinked")])
    captured = capsys.readouterr()
    assert code == 0 and "0 matched to engine ids" in captured.out
    assert "warning: no load-generator request id matches" in captured.err
    code, text = _invoke(command, [str(pp), "-o", str(tmp_path / "t")])
    assert code == 2 and "already exists" in text


def test_run_metadata_carries_the_state_layout() -> None:
    """A recorded trace names its state tensors, so a replay can size its pool from it."""
    from types import SimpleNamespace

    import torch

    from mgtrace.recorder.runinfo import state_layout
    from mgtrace.replayer.tags import TagPool
    from mgtrace.schemas.manifest import RunMetadata

    mamba = SimpleNamespace(
        kv_cache_spec=SimpleNamespace(
            shapes=((6, 1024), (8, 64, 128)),
            dtypes=(torch.bfloat16, torch.float32),
            mamba_type=SimpleNamespace(name="MAMBA2"),
        ),
        layer_names=["model.layers.0.mixer", "model.layers.2.mixer"],
    )
    attention = SimpleNamespace(kv_cache_spec=SimpleNamespace(), layer_names=["attn"])
    runner = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[attention, mamba]))
    states = state_layout(runner, [1])
    assert [(s.group, s.layer, s.kind, s.shape, s.dtype) for s in states] == [
        (0, 0, "conv", [6, 1024], "bfloat16"),
        (0, 0, "temporal", [8, 64, 128], "float32"),
        (0, 1, "conv", [6, 1024], "bfloat16"),
        (0, 1, "temporal", [8, 64, 128], "float32"),
    ]
    pool = TagPool(RunMetadata(num_speculative_tokens=3, num_blocks=8, states=states))
    assert pool.groups[0].width == 6  # the conv window the replay shifts by
    assert state_layout(SimpleNamespace(), [0]) == []  # control: nothing to read, nothing made


class _SlowStartThread(threading.Thread):
    """A thread that takes a while to start, as on a loaded host."""

    def start(self) -> None:
        time.sleep(0.3)
        super().start()


class _FakeSession:
    def __init__(self) -> None:
        self.live = True
        self.stop_requested = False

    def close(self) -> dict[str, Any]:
        return {"complete": True}

    def status(self) -> dict[str, Any]:
        return {}


def test_stop_waits_for_a_close_the_engine_thread_began(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop that meets the engine thread's own close (a limit reached, or the stop flag
    seen at the step boundary) waits for that close, however slowly its thread starts.
    Control: with the close thread published before it is started, the stop joined a
    thread not yet started (RuntimeError) or returned while still "stopping"."""
    monkeypatch.setattr(agent_mod.threading, "Thread", _SlowStartThread)
    agent = agent_mod.Agent()
    sess = _FakeSession()
    agent.session, agent.state = sess, "recording"

    def engine_step_boundary() -> None:
        while not sess.stop_requested:
            time.sleep(0.001)
        agent._finish(sess, inline=False)

    engine = threading.Thread(target=engine_step_boundary)
    engine.start()
    result = agent.stop()
    engine.join(10)
    assert result["state"] == "idle" and result["complete"] is True


def test_run_metadata_says_whether_prefills_store_checkpoints() -> None:
    """vLLM 0.33's Mamba2 spec keeps a block per request for the boundary state the prefill
    forward stores itself; the manifest says so, for the replay to warn. Control: a spec
    without the field (older vLLM) says nothing, one with 0 says none."""
    from mgtrace.recorder.runinfo import prefill_checkpoint_blocks

    def runner(*specs: Any) -> Any:
        groups = [SimpleNamespace(kv_cache_spec=spec) for spec in specs]
        return SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups))

    with_field = SimpleNamespace(num_prefill_checkpoint_blocks=1)
    zero = SimpleNamespace(num_prefill_checkpoint_blocks=0)
    assert prefill_checkpoint_blocks(runner(zero, with_field), [0, 1]) == 1
    assert prefill_checkpoint_blocks(runner(zero), [0]) == 0
    assert prefill_checkpoint_blocks(runner(SimpleNamespace()), [0]) is None


def test_recorded_run_metadata_is_always_readable() -> None:
    """Whatever odd values an engine's config holds, the manifest the recorder writes passes
    its own reader's checks: unknowns become null, a path-like model name a string."""
    from dataclasses import asdict
    from pathlib import PurePosixPath
    from types import SimpleNamespace

    import pytest

    from mgtrace.errors import ManifestError
    from mgtrace.recorder.runinfo import run_metadata
    from mgtrace.schemas.manifest import Manifest, RunMetadata

    runner = SimpleNamespace(
        model_config=SimpleNamespace(model=PurePosixPath("/models/hybrid")),
        vllm_config=SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=0, max_num_batched_tokens="8k")
        ),
        kv_cache_config=SimpleNamespace(num_blocks=0, kv_cache_groups=[]),
        reorder_batch_threshold=True,
    )

    def read_back(run: RunMetadata) -> RunMetadata:
        return Manifest.from_dict(asdict(Manifest(run=run))).run

    run = read_back(run_metadata(runner, "v1", [0], None))
    assert run.model == "/models/hybrid"
    assert (run.max_num_seqs, run.max_num_batched_tokens, run.num_blocks) == (None, None, None)
    assert run.runner_reorder_threshold is None
    with pytest.raises(ManifestError, match="num_blocks must be at least 1"):
        read_back(RunMetadata(num_blocks=0))  # the control: the raw value is refused


def test_record_refuses_an_output_no_file_can_be_created_in(tmp_path: Path) -> None:
    """As root, permission bits let /proc pass: the engine ran, and was then blamed for
    recording nothing. The folder is now tried before the engine starts. Control: a
    file for a parent is refused the same way."""
    from tests.conftest import assert_one_sentence_error, run_cli

    (tmp_path / "afile").write_text("x")
    outs = [(tmp_path / "afile" / "t", f"{tmp_path / 'afile'} is not a directory")]
    if Path("/proc/self").is_dir():
        outs.append((Path("/proc/t"), "no file can be created in /proc"))
    marker = tmp_path / "engine-ran"
    for out, words in outs:
        proc = run_cli("record", "-o", str(out), "--", "touch", str(marker))
        err = assert_one_sentence_error(proc, 2)
        assert err == f"mgtrace: error: cannot write the trace to {out}: {words}", err
    assert not marker.exists()


def test_import_probe_force_keeps_the_old_trace_when_the_import_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-f once removed the old trace before the import wrote a row: a row the writer then
    refused, or an interrupt, left the user neither trace. Now the old one stays as it was
    and nothing else is left. Control: an import that succeeds replaces it."""
    from mgtrace.errors import OutputError
    from mgtrace.recorder import probe_import

    (tmp_path / "logs").mkdir()
    pp, bp, _ = _probe_logs(tmp_path / "logs")
    out = tmp_path / "out" / "t"
    out.parent.mkdir()
    import_probe(pp, None, out)
    before = {
        str(p.relative_to(out.parent)): p.read_bytes() if p.is_file() else None
        for p in sorted(out.parent.rglob("*"))
    }
    with monkeypatch.context() as m:
        m.setattr(probe_import, "corruption", lambda row: (True, "salad\udc80"))
        with pytest.raises(OutputError, match=f"the old trace at {out} was kept"):
            import_probe(pp, bp, out, force=True)
    with monkeypatch.context() as m:
        m.setattr(probe_import.ProbeImporter, "write_steps", _interrupt)
        with pytest.raises(KeyboardInterrupt):
            import_probe(pp, bp, out, force=True)
    after = {
        str(p.relative_to(out.parent)): p.read_bytes() if p.is_file() else None
        for p in sorted(out.parent.rglob("*"))
    }
    assert after == before and TraceReader(out).complete
    assert import_probe(pp, bp, out, force=True).requests == 41  # control
    assert TraceReader(out).rows("requests") == 41
    assert [p.name for p in out.parent.iterdir()] == ["t"]


def _interrupt(self: Any, writer: Any) -> None:
    writer.write_step(0, 0, {})
    raise KeyboardInterrupt


# ----------------------------------------------------------------- launch-mode folders
def test_every_process_of_a_launched_engine_records_into_that_engines_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``record -- CMD`` armed every process with the same folder, so two engines the
    command started wrote one trace. Each engine now gets ``DIR/engine-PID`` from its first
    process with the plugin, and the processes it starts (EngineCore, workers) inherit it.
    Control: without the launcher's switch the folder is ``DIR`` as before."""
    import subprocess
    import sys

    from mgtrace.recorder import plugin

    monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path / "t"))
    monkeypatch.setenv(plugin.ENV_PER_ENGINE, "1")
    monkeypatch.delenv(plugin.ENV_ENGINE, raising=False)
    armed = plugin._armed_from_env()
    assert armed is not None and armed["out"] == str(tmp_path / "t" / f"engine-{os.getpid()}")
    worker = subprocess.run(
        [sys.executable, "-c", "from mgtrace.recorder import plugin as p; "
         "print(p._armed_from_env()['out'])"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert worker.stdout.strip() == armed["out"]
    monkeypatch.delenv(plugin.ENV_PER_ENGINE)
    assert plugin._armed_from_env() == {**armed, "out": str(tmp_path / "t")}


def test_a_lift_cut_short_is_put_back(tmp_path: Path) -> None:
    """A killed mgtrace may leave its launch's folder moved aside while one engine's trace
    moves up to it: the folder goes back, and an empty leftover (the move was done) goes;
    one that holds something next to a folder in place is left alone."""
    from mgtrace.atomic import clear_stale_siblings

    dead = 2**31 - 2  # no process has this id
    out = tmp_path / "t"
    aside = tmp_path / f".t.{dead}-0.lift"
    (aside / "engine-7").mkdir(parents=True)
    (aside / "engine-7" / "manifest.json").write_text("{}")
    clear_stale_siblings(out)
    assert [p.name for p in tmp_path.iterdir()] == ["t"]
    assert (out / "engine-7" / "manifest.json").is_file()
    aside.mkdir()  # done: the trace is at out, the leftover empty
    clear_stale_siblings(out)
    assert [p.name for p in tmp_path.iterdir()] == ["t"]
    (aside / "x").mkdir(parents=True)
    clear_stale_siblings(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name, "t"]


def test_each_data_parallel_rank_records_as_an_engine_of_its_own() -> None:
    """With DP, vLLM's torch.distributed rank is dp_rank * TP * PP + the rank in the engine,
    and its world spans every DP rank: DP=2 TP=1 wrote rank-000 and rank-001 as if one
    engine's. Each DP rank now records into dp-NNN, ranked within its engine, and the run
    says which DP rank it is. Control: without DP the layout is rank-NNN as before."""
    from mgtrace.recorder.runinfo import engine_folder, run_metadata

    def run(tp: int, dp: int, dp_rank: Any = 0) -> RunMetadata:
        parallel = SimpleNamespace(
            tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_rank=dp_rank
        )
        return run_metadata(SimpleNamespace(vllm_config=SimpleNamespace(
            parallel_config=parallel)), "v1", [0], None)  # fmt: skip

    out = Path("/t")
    dp2 = run(1, 2)
    assert engine_folder(out, 1, 2, dp2) == (out / "dp-001", 0)
    assert (dp2.dp_size, dp2.dp_rank) == (2, 1)
    assert engine_folder(out, 3, 4, run(2, 2)) == (out / "dp-001" / "rank-001", 1)
    # a world of the engine's own (no offset): the configured DP rank names the folder
    assert engine_folder(out, 1, 2, run(2, 2, 1)) == (out / "dp-001" / "rank-001", 1)
    assert run(1, 2, 5).dp_rank == 0  # a value no engine has: the manifest stays readable
    assert engine_folder(out, 1, 2, run(2, 1)) == (out / "rank-001", 1)
    assert engine_folder(out, 0, 1, run(1, 1)) == (out, 0)


def test_leftovers_of_another_host_are_named_and_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A trace folder on a shared file system is seen from several hosts, and a leftover's
    pid was checked here whatever host it came from: another host's running overwrite was
    taken for a killed one (its old trace moved back, its new one removed). Leftovers now
    carry their host; another host's are left alone and named in one sentence. Control:
    this host's, and those named the old way (no host), are judged by pid as before."""
    import socket

    from mgtrace.atomic import clear_stale_siblings, hidden_sibling

    dead = 2**31 - 2  # no process here has this id
    out = tmp_path / "t"
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
    assert hidden_sibling(out, "new").name.endswith(f"@{host}.new")
    other = "other-host" if host != "other-host" else "another-host"
    theirs = [tmp_path / f".t.{dead}-0@{other}.old", tmp_path / f".t.{dead}-1@{other}.new"]
    mine = [tmp_path / f".t.{dead}-2@{host}.new", tmp_path / f".t.{dead}-3.new"]
    for p in theirs + mine:
        p.mkdir()
    with caplog.at_level("WARNING", logger="mgtrace"):
        assert sorted(clear_stale_siblings(out)) == theirs
    assert sorted(tmp_path.iterdir()) == theirs  # no trace moved back to t, none removed
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"mgtrace: left alone beside {out} what a run on another host left")
    assert line.endswith(f": {theirs[0].name}, {theirs[1].name}")
    (tmp_path / f".t.{dead}-4.old").mkdir()  # an older mgtrace's: put back, as before
    clear_stale_siblings(out)
    assert sorted(tmp_path.iterdir()) == sorted([*theirs, out])


def test_a_killed_engine_whose_steps_never_reached_the_trace_is_named_with_them(
    tmp_path: Path,
) -> None:
    """An engine killed before its writer flushed a part: the steps its agent reported are
    named as lost with it (was: "went away before a step was recorded")."""
    from mgtrace.errors import MgtraceError
    from mgtrace.recorder.cli import _summary
    from mgtrace.schemas.writer import TraceWriter

    out = tmp_path / "trace"
    TraceWriter(out, run=RunMetadata()).close(complete=False)
    assert TraceReader(out).rows("steps") == 0

    def gone(polled: int) -> SimpleNamespace:
        status = {"state": "gone", "out": str(out), "steps": polled}
        return SimpleNamespace(proc=SimpleNamespace(pid=4321, role="other"), status=status)

    with pytest.raises(MgtraceError) as lost:
        _summary([gone(7)], [])
    assert str(lost.value) == (
        f"process 4321 went away after recording 7 steps, before any of them reached the "
        f"trace in {out}"
    )
    with pytest.raises(MgtraceError) as none:  # the control: no step was ever recorded
        _summary([gone(0)], [])
    assert str(none.value) == "process 4321 went away before a step was recorded"


def _groups(*builders: tuple[str, int | None]) -> list[Any]:
    """Attention groups whose metadata builders are classes of the given names."""
    return [
        SimpleNamespace(
            get_metadata_builder=lambda n=name, t=threshold: (
                type(n, (), {})() if t is None else type(n, (), {"reorder_batch_threshold": t})()
            )
        )
        for name, threshold in builders
    ]


def test_builder_thresholds_come_from_either_runner() -> None:
    """V1 iterates its attention groups itself; V2 keeps one list per KV-cache group and its
    drafter lists of its own, whose threshold (a drafter backend's 1, vLLM #55894) is the
    one that matters most. A runner with neither yields nothing (the control)."""
    from mgtrace.recorder.runinfo import builder_thresholds

    v1 = SimpleNamespace(_attn_group_iterator=lambda: iter(_groups(("Mamba2B", 4), ("AttnB", 8))))
    assert builder_thresholds(v1) == {"Mamba2B": 4, "AttnB": 8}
    v2 = SimpleNamespace(
        attn_groups=[_groups(("Mamba2B", 4)), _groups(("AttnB", None))],
        speculator=SimpleNamespace(attn_groups=[_groups(("DrafterB", 1))]),
    )
    assert builder_thresholds(v2) == {"Mamba2B": 4, "AttnB": None, "DrafterB": 1}
    assert builder_thresholds(SimpleNamespace(speculator=None)) == {}


def _positional_reads(module: Any) -> list[tuple[str, int, str]]:
    """Every ``arg(args, kwargs, N, "name")`` in a hook module: (function, N, name)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    reads = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for call in ast.walk(fn):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name)
                and call.func.id == "arg"
                and len(call.args) >= 4
                and isinstance(call.args[2], ast.Constant)
            ):
                reads.append((fn.name, call.args[2].value, call.args[3].value))
    return reads


def test_every_argument_a_hook_reads_by_position_is_declared_on_its_target() -> None:
    """The recorder refuses a vLLM whose hooked callables do not begin with the parameters
    their targets declare; that check protects only the reads the declarations cover. Each
    positional read in the hook modules must sit at its declared place (counting ``self``
    for a method), in the targets of one runner or the other."""
    from mgtrace.recorder import features, hooks_common, hooks_v1, hooks_v2

    declared = set()
    for t in (*features.V1_TARGETS, *features.V2_TARGETS):
        first = 1 if t.owner is not None else 0
        declared |= {(first + i, name) for i, name in enumerate(t.params)}
    reads = [r for m in (hooks_common, hooks_v1, hooks_v2) for r in _positional_reads(m)]
    assert len(reads) >= 20  # the scan sees the hooks' reads
    undeclared = [r for r in reads if (r[1], r[2]) not in declared]
    assert undeclared == []
    # failing control: a read one place off is caught
    assert (4, "mamba_state_idx") not in declared and (3, "mamba_state_idx") in declared


def test_an_injected_agent_that_never_starts_is_not_blamed_on_ptrace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """When the injection went in but the agent did not answer in time, the advice is not
    to allow ptrace (it was allowed); the user learns the agent may still start. Control:
    a process with no agent that may not be injected gets the enabling hint."""
    from mgtrace.recorder import attach, control, proctree

    monkeypatch.setattr(control, "engine_socket_path", lambda pid: tmp_path / "absent.sock")
    monkeypatch.setattr(attach, "_inject", lambda pid: ("gdb", None))
    monkeypatch.setattr(attach, "_wait_socket", lambda path, timeout_s: False)
    proc = proctree.Proc(999999999, 1, os.geteuid(), "python3", "python3 -m vllm serve")
    with pytest.raises(attach.AttachError) as caught:
        attach.connect(proc)
    assert "may still start there later" in caught.value.message
    assert "ptrace" not in caught.value.message
    with pytest.raises(attach.AttachError, match="ptrace_scope"):
        attach.connect(proc, allow_inject=False)


def test_a_recording_of_no_step_removes_only_its_own_closed_traces(tmp_path: Path) -> None:
    """The tidy after a recording of no step once emptied the whole output folder (a file
    another program put there went too) and removed traces still open for writing. Now it
    removes only the files of traces of no step whose writer has closed. Control: a closed
    trace of no step goes, and an output the recording made goes with it."""
    from mgtrace.recorder.cli import _discard_traces_of_no_step
    from mgtrace.schemas.manifest import RunMetadata
    from mgtrace.schemas.writer import TraceWriter

    out = tmp_path / "out"
    out.mkdir()
    TraceWriter(out / "engine-11", run=RunMetadata()).close()
    still = TraceWriter(out / "engine-12", run=RunMetadata())  # an engine still writing
    (out / "notes.txt").write_text("mine")
    try:
        _discard_traces_of_no_step(out, made=True)
        assert sorted(p.name for p in out.iterdir()) == ["engine-12", "notes.txt"]
        assert (out / "engine-12" / "manifest.json").is_file()
    finally:
        still.close()
    (out / "notes.txt").unlink()
    _discard_traces_of_no_step(out, made=True)
    assert not out.exists()


def test_a_long_name_s_leftover_is_put_back_too(tmp_path: Path) -> None:
    """A long trace name's hidden siblings carry a cut of it (the whole name left no room
    for the rest of theirs): what a killed run left under such a name is still found and
    put back. Control: a short name's siblings carry it whole."""
    from mgtrace.atomic import clear_stale_siblings, hidden_sibling

    dead = 2**31 - 2  # no process has this id
    out = tmp_path / ("y" * 250)
    sibling = hidden_sibling(out, "old")
    assert len(sibling.name.encode()) < 255 and out.name not in sibling.name
    left = sibling.with_name(re.sub(r"\.\d+-\d+@", f".{dead}-0@", sibling.name))
    left.mkdir()
    clear_stale_siblings(out)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    assert hidden_sibling(tmp_path / "t", "new").name.startswith(".t.")


def test_a_slot_holding_int64_words_is_read_back_as_int32_values() -> None:
    """A vector the device path stored as its int64 words (a negated length) comes back as
    int32 values, beside the int32 vectors around it. Control: a slot without one reads its
    bytes as they are."""
    from mgtrace.recorder.capture import _from_words

    idx = np.array([5, 70000, 0], np.int64)
    acc = np.array([1, 2], np.int32)
    slot = np.zeros(16, np.int32)
    slot[:2] = acc
    slot[2:8] = idx.view(np.int32)
    raw, lengths = _from_words(slot, (2, -3))
    assert lengths == (2, 3)
    assert np.frombuffer(raw, np.int32).tolist() == [1, 2, 5, 70000, 0]
    raw, lengths = _from_words(slot, (2, 6))
    assert lengths == (2, 6) and np.frombuffer(raw, np.int32).tolist() == slot[:8].tolist()
