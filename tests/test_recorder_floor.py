"""The floor benchmark's hooks copy what mgtrace's hooks record, so that the two compare."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_recorder import ROWS, K, build_runner, scheduler_output  # noqa: E402
from recorder_floor import Floor, _wrapper  # noqa: E402

from mgtrace.recorder import hooks_v1  # noqa: E402
from mgtrace.recorder.patches import Patch, PatchSet  # noqa: E402
from mgtrace.recorder.session import Session  # noqa: E402
from mgtrace.schemas.manifest import RunMetadata  # noqa: E402

pytestmark = pytest.mark.unit


def _one_step(runner: Any, inner: list[Patch], outer: list[Patch]) -> None:
    """One step with both sets of hooks on the same functions (``outer`` around ``inner``),
    so that both see the same values."""
    first, second = PatchSet(), PatchSet()
    first.install(inner)
    try:
        second.install(outer)
        try:
            out = torch.zeros((ROWS, 1 + K), dtype=torch.int64)
            type(runner).execute_model(runner, scheduler_output())
            type(runner).sample_tokens(runner, out)
        finally:
            second.remove()
    finally:
        first.remove()


def test_floor_hooks_copy_the_values_mgtrace_records(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(Session, "_drain", lambda self: False)  # keep what the hooks queued
    runner, owners = build_runner(torch.device("cpu"))
    sess = Session(tmp_path / "t", rank=0, kind="v1", run=RunMetadata(), assembler="thread")
    floor = Floor(torch.device("cpu"))
    pairs = floor.hooks()
    try:
        ours = hooks_v1.v1_patches(sess, owners, [0])
        minimal = [Patch(p.owner, p.name, _wrapper(*pairs[p.name])) for p in ours]
        _one_step(runner, ours, minimal)  # a first step fills the running columns
        _one_step(runner, ours, minimal)
        sess.end_step()
        rec = sess._records[1]
        captures = {tag["kernel"]: raw for raw, _, tag in sess.ring.reap_raw() if tag["step"] == 1}
    finally:
        sess.close(5.0)
    kept = floor.records[1]

    def data(raw: Any) -> bytes:  # a raw array: its bytes, alone or with dtype and shape
        return raw if isinstance(raw, bytes) else raw[0]

    n = ROWS
    as_bytes = [v for v in kept if isinstance(v, bytes)]
    # the batch after _update_states: computed and prompt counts, the block table
    for name in ("computed", "prompt"):
        assert data(rec[name]) in as_bytes, name
    assert data(rec["bt"][0][1]) in as_bytes
    # around the pre-process: accepted and computed counts, the running columns
    assert data(rec["acc_prev"]) in as_bytes and data(rec["computed_pre"]) in as_bytes
    dicts = [v for v in kept if isinstance(v, dict)]
    assert rec["sidx_before"] in dicts and rec["sidx_after"] in dicts
    # the staged post-process inputs, and each launch's inputs on the device side
    for raw in rec["staged"].values():
        assert data(raw) in as_bytes
    launches = [v for v in kept if isinstance(v, list) and isinstance(v[0], bytes)]
    assert b"".join(launches[0]) == captures["precopy"]
    assert b"".join(launches[1]) == captures["postprocess"]
    assert rec["req_ids"] in [v for v in kept if isinstance(v, list) and isinstance(v[0], str)]
    assert np.frombuffer(captures["precopy"], np.int32).size == 3 * n
