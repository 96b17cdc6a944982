"""The recorder on a stand-in V2 engine of vLLM's real V2 objects, on the CPU, against the
installed vLLM (0.33 or 0.34; ``make test`` runs both).

``tests/recorder_standin_v2.py`` drives the real ``BlockTables``, ``MambaHybridModelState``
(vLLM's advance, precopy, scatter and post-process kernels, interpreted), the batch sort and
``InputBatch``. The recorder is activated as in production (``Agent.start`` arms
``execute_model``, the first step installs the hooks); every recorded value is compared
with what the objects held, read by the engine itself, and the trace replays clean.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.peer

vllm = pytest.importorskip("vllm")

from mgtrace.recorder import agent as agent_mod  # noqa: E402
from mgtrace.replayer.loop import replay_trace  # noqa: E402
from mgtrace.replayer.rules import RuleSet  # noqa: E402
from mgtrace.schemas.reader import TraceReader  # noqa: E402
from tests.recorder_standin_v2 import StandinV2Methods, V2Engine  # noqa: E402

STEPS = 14


def _read(trace: Path, table: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for part in sorted((trace / table).glob("*.parquet")):
        rows += pq.read_table(part).to_pylist()
    return rows


def _record(
    out: Path, steps: int = STEPS, misaddress_at: int | None = None
) -> list[dict[str, Any]]:
    agent = agent_mod.Agent()
    with StandinV2Methods():
        eng = V2Engine(misaddress_at=misaddress_at)
        agent.start(str(out))
        truths = [eng.step() for _ in range(steps)]
        agent.stop()
    return truths


def mismatches(trace: Path, truths: list[dict[str, Any]]) -> list[str]:
    """Every difference between the trace and what the objects held (empty: all equal)."""
    bad: list[str] = []
    rows, launches, tables = (_read(trace, t) for t in ("batch_rows", "launches", "block_tables"))
    source: dict[int, list[int]] = {}
    for step, truth in enumerate(truths):
        mine = sorted((r for r in rows if r["step"] == step), key=lambda r: r["batch_row"])
        for col, want in (
            ("req_id", truth["req_ids"]),
            ("req_slot", truth["idx_mapping"]),
            ("num_computed", truth["computed"]),
            ("state_col", truth["state_idx"]),
        ):
            got = [r[col] for r in mine]
            if got != want:
                bad.append(f"step {step} batch_rows.{col}: {got} != {want}")
        for kernel, cols in (
            ("precopy", {"src_col": truth["src_col"], "token_bias": truth["token_bias"]}),
            (
                "postprocess",
                {
                    "num_accepted": [max(a, 1) for a in truth["sampled"]],
                    "num_computed": truth["computed_after"],
                },
            ),
        ):
            ls = sorted(
                (r for r in launches if r["step"] == step and r["kernel"] == kernel),
                key=lambda r: r["batch_row"],
            )
            if [r["req_slot"] for r in ls] != truth["idx_mapping"]:
                bad.append(f"step {step} {kernel}.req_slot: {[r['req_slot'] for r in ls]}")
            for name, want in cols.items():
                got = [r[name] for r in ls]
                if got != want:
                    bad.append(f"step {step} {kernel}.{name}: {got} != {want}")
        for r in tables:
            if r["step"] == step and r["table"] == "source":
                source[r["row"]] = r["block_ids"]
        for slot in truth["idx_mapping"]:
            want = truth["source"][slot].tolist()[: len(source.get(slot, []))]
            if source.get(slot) != want or not want:
                bad.append(f"step {step} source row {slot}: {source.get(slot)} != {want}")
    return bad


def test_a_v2_recording_holds_what_the_real_objects_held(tmp_path: Path) -> None:
    trace = tmp_path / "t"
    truths = _record(trace)
    manifest = json.loads((trace / "manifest.json").read_text())
    assert manifest["complete"] and manifest["errors"] == {}
    run = manifest["run"]
    assert run["runner"] == "v2" and run["num_speculative_tokens"] == 2
    assert run["vllm_version"] == vllm.__version__
    assert mismatches(trace, truths) == []
    assert [s["step"] for s in _read(trace, "steps")] == list(range(STEPS))
    # the engine crossed blocks (copies ran) and reordered its batch (rows not in slot order)
    assert any(c >= 0 for t in truths for c in t["src_col"])
    assert any(t["idx_mapping"] != sorted(t["idx_mapping"]) for t in truths)
    assert replay_trace(TraceReader(trace), RuleSet()).findings == []
    # failing control: the same comparison flags a truth that differs in one value
    truths[3]["state_idx"][0] += 1
    truths[5]["computed_after"][1] += 1
    assert len(mismatches(trace, truths)) == 2


def test_a_v2_post_process_that_addressed_the_wrong_slots_is_found(tmp_path: Path) -> None:
    """The failing control of the clean replay above: at step 6 the engine hands the
    post-process its first two rows' slots swapped (each row's state saved into the other
    request's blocks). The recording holds what the kernel was given, and the replay names
    that step."""
    trace = tmp_path / "bad"
    _record(trace, misaddress_at=6)
    findings = replay_trace(TraceReader(trace), RuleSet()).findings
    assert findings and min(f.step for f in findings) == 6
