"""The simulator's GDN model: its builder marks spec-decode rows by their draft counts, not by
position, so a lowered runner threshold corrupts nothing there, while the other bug classes
still do, and the replay reads the traces as it reads a GDN recording."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import spec_decodes_run_first
from mgtrace.schemas.manifest import MANIFEST_NAME
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim import SimConfig, simulate
from mgtrace.sim.config import BUG_ASYNC_RACE, BUG_BATCH_ROW, BUG_REORDER, BUG_STALE_ROW
from mgtrace.sim.reorder import builder_split
from mgtrace.sim.symptoms import misplaced_decodes
from tests.replay_helpers import TOGGLES

pytestmark = pytest.mark.unit

K = 3


def _split(mixer: str, sched: list[int], computed: list[int], prompt: list[int], draft: list[int]):
    return builder_split(
        mixer, *(np.asarray(v, np.int64) for v in (sched, computed, prompt, draft)), K
    )


def test_gdn_marks_spec_rows_wherever_they_sit() -> None:
    # a spec decode, a chunked-prefill continuation, a spec decode behind it, a zero-draft
    # one-token decode past its prompt, a one-token prompt chunk
    rows = ([4, 512, 4, 1, 1], [300, 512, 900, 700, 40], [200, 4096, 800, 600, 90], [3, 0, 3, 0, 0])
    gdn = _split("gdn", *rows)
    assert gdn.decode.tolist() == [True, False, True, True, False]
    assert (gdn.num_decodes, gdn.threshold) == (3, None)
    # control: Mamba2 splits by position, so the decode behind the prefill runs as a prefill
    mamba2 = _split("mamba2", *rows)
    assert mamba2.decode.tolist() == [True, False, False, False, False]
    assert (mamba2.num_decodes, mamba2.threshold) == (1, 1 + K)


def test_gdn_without_a_spec_row_splits_by_position_at_one() -> None:
    # two prefill chunks with context, a fresh prefill: no row is marked
    gdn = _split("gdn", [1, 256, 512], [300, 512, 0], [400, 4096, 2000], [0, 0, 0])
    assert not gdn.decode[1:].any() and gdn.threshold == 1
    # a one-token chunk with context leads: GDN's threshold-1 split makes it a decode
    assert gdn.decode.tolist() == [True, False, False]
    # without spec decode at all, the same rule
    plain = builder_split(
        "gdn", *(np.asarray(v) for v in ([1, 1, 64], [50, 60, 0], [10, 10, 64], [0, 0, 0])), 0
    )
    assert plain.decode.tolist() == [True, True, False] and plain.threshold == 1


def _sim(tmp_path: Path, name: str, bugs: tuple[str, ...], **shape: object) -> TraceReader:
    cfg = SimConfig(steps=500, seed=0, bugs=bugs, output=tmp_path / name, **shape)  # type: ignore[arg-type]
    simulate(cfg)
    return TraceReader(tmp_path / name)


def test_a_gdn_trace_records_the_mask_split_and_runs_spec_decodes_first(tmp_path: Path) -> None:
    reader = _sim(tmp_path, "gdn", (BUG_REORDER,), mixer="gdn", scenario="mixed")
    run = reader.run
    assert run.model == "sim/hybrid-gdn-mtp"
    assert run.builder_reorder_thresholds["GDNAttentionMetadataBuilder"] == 1 + K
    assert spec_decodes_run_first(run)
    br = reader.table("batch_rows")
    col = {c: np.asarray(br.column(c).to_pylist()) for c in ("num_scheduled", "num_draft")}
    is_decode = np.asarray(pc.equal(br.column("mamba_split"), "decode").to_pylist())
    spec = (col["num_draft"] > 0) & (col["num_scheduled"] == col["num_draft"] + 1)
    assert (is_decode[spec]).all(), "every row scheduling its drafts + 1 runs as a spec decode"
    # under the lowered runner threshold some of those rows sit behind a prefill-split row:
    # the mask, not the order, keeps them decodes
    steps = np.asarray(br.column("step").to_pylist())
    behind = [
        s
        for s in np.unique(steps)
        if (rows := is_decode[steps == s]).any()
        and (~rows).any()
        and rows.nonzero()[0].max() > (~rows).nonzero()[0].min()
    ]
    assert behind, "the reorder toggle must leave spec decodes behind prefills in some step"
    st = reader.table("steps")
    thresholds = set(st.column("mamba_threshold").to_pylist())
    assert None in thresholds  # steps with a spec mask
    truth = reader.manifest.ground_truth["bugs"][BUG_REORDER]
    assert truth["first_step"] is None and truth["num_events"] == 0
    assert misplaced_decodes(reader) == []
    assert replay_trace(reader, RuleSet()).clean


def test_control_the_same_run_under_mamba2_is_corrupted(tmp_path: Path) -> None:
    reader = _sim(tmp_path, "mamba2", (BUG_REORDER,), mixer="mamba2", scenario="mixed")
    truth = reader.manifest.ground_truth["bugs"][BUG_REORDER]
    assert truth["first_step"] is not None
    assert misplaced_decodes(reader)
    assert replay_trace(reader, RuleSet()).first_step == truth["first_step"]


@pytest.mark.parametrize("bug", [BUG_ASYNC_RACE, BUG_STALE_ROW, BUG_BATCH_ROW])
def test_the_other_bug_classes_corrupt_gdn_runs_and_are_found(tmp_path: Path, bug: str) -> None:
    engine, undo = TOGGLES[bug]
    reader = _sim(tmp_path, "bug", (bug,), mixer="gdn", **engine)
    truth = reader.manifest.ground_truth["bugs"][bug]
    assert truth["first_step"] is not None
    found = replay_trace(reader, RuleSet())
    assert found.first_step == truth["first_step"]
    assert replay_trace(reader, RuleSet.parse(undo)).clean


@pytest.mark.parametrize(
    "shape", [{"runner": "v1"}, {"runner": "v2"}, {"runner": "v2", "pp": 2}, {"k": 0}]
)
def test_toggle_off_gdn_runs_replay_clean(tmp_path: Path, shape: dict) -> None:
    reader = _sim(tmp_path, "clean", (), mixer="gdn", scenario="mixed", **shape)
    result = replay_trace(reader, RuleSet())
    assert result.clean, result.findings[:3]


def test_an_unknown_mixer_is_one_sentence() -> None:
    from mgtrace.errors import UsageError

    with pytest.raises(UsageError, match="unknown mixer 'rwkv'; choose mamba2 or gdn"):
        SimConfig(mixer="rwkv").validate()


def test_the_reorder_rule_keeps_gdns_mask_split() -> None:
    from mgtrace.replayer.steps import StepBatch
    from mgtrace.replayer.view import split_under_threshold

    # a spec decode, a chunked-prefill continuation, a spec decode behind it (k = 3)
    cols = {
        "num_scheduled": np.array([4, 512, 4], np.int32),
        "num_computed": np.array([300, 512, 900], np.int32),
        "num_prompt": np.array([200, 4096, 800], np.int32),
        "num_draft": np.array([3, 0, 3], np.int32),
    }
    batch = StepBatch(0, np.arange(1, 4, dtype=np.int32), cols)
    for threshold in (1, 4):
        for runner in ("v1", "v2"):
            got = split_under_threshold(batch, threshold, K, runner=runner, gdn=True)
            assert got.tolist() == [False, True, False]
    # control: Mamba2's positional split at threshold 1 leaves the decode behind the chunk
    # in the prefill split
    assert split_under_threshold(batch, 1, K).tolist() == [False, True, True]
    # a GDN step without a spec-decode row splits by position at 1
    cols = {**cols, "num_draft": np.zeros(3, np.int32), "num_scheduled": np.array([1, 512, 1])}
    cols["num_computed"] = np.array([300, 512, 700], np.int32)
    batch = StepBatch(0, np.arange(1, 4, dtype=np.int32), cols)
    assert split_under_threshold(batch, 4, K, gdn=True).tolist() == [False, True, True]


def test_a_lowered_threshold_keeps_gdns_spec_decodes(tmp_path: Path) -> None:
    """The counterfactual the reorder toggle asks about, on a GDN run whose order has spec
    decodes behind prefill rows: reorder_threshold=1 leaves them spec decodes (clean). Control:
    the same trace with its builder named Mamba2 is re-split by position, and corrupts."""
    lowered = RuleSet.parse("reorder_threshold=1")
    gdn = _sim(tmp_path, "gdn", (BUG_REORDER,), mixer="gdn", scenario="mixed")
    result = replay_trace(gdn, lowered)
    assert result.clean, result.findings[:3]
    as_mamba2 = tmp_path / "as-mamba2"
    shutil.copytree(tmp_path / "gdn", as_mamba2)
    manifest = as_mamba2 / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["run"]["builder_reorder_thresholds"] = {"mamba2": 1 + K}
    manifest.write_text(json.dumps(data))
    assert not replay_trace(TraceReader(as_mamba2), lowered).clean


def _without_split(reader: TraceReader, builders: dict | None = None):
    """The trace as a recording that could not read the builder's split: mamba_split and
    mamba_threshold null, as where GDN's mask was not on the host."""
    from dataclasses import replace

    import pyarrow as pa

    from mgtrace.replayer.minimize import load_memory

    mem = load_memory(reader)
    t = mem.tables_
    for table, name in (("batch_rows", "mamba_split"), ("steps", "mamba_threshold")):
        tab = t[table]
        i = tab.schema.get_field_index(name)
        t[table] = tab.set_column(i, tab.field(i), pa.nulls(tab.num_rows, tab.field(i).type))
    if builders is not None:
        mem.manifest = replace(
            mem.manifest, run=replace(mem.manifest.run, builder_reorder_thresholds=builders)
        )
    return mem


def test_a_gdn_split_left_unrecorded_is_derived_as_the_builder_makes_it(tmp_path: Path) -> None:
    from mgtrace.replayer.requests import RequestIds
    from mgtrace.replayer.steps import RankTrace

    reader = _sim(tmp_path, "gdn", (BUG_STALE_ROW,), mixer="gdn", scenario="pairs")
    recorded = RankTrace(reader, 0, RequestIds())
    derived = RankTrace(_without_split(reader), 0, RequestIds())  # type: ignore[arg-type]
    one_call = 0
    for step in recorded:
        want = recorded.batch(step).cols["is_prefill_split"]
        assert derived.batch(step).cols["is_prefill_split"].tolist() == want.tolist(), step
        threshold = recorded.step_value("mamba_threshold", step)
        assert derived.step_value("mamba_threshold", step) == threshold, step
        one_call += threshold == 1
    assert one_call, "some steps have no spec-decode row: GDN runs them in one call"
    found = replay_trace(reader, RuleSet())
    again = replay_trace(_without_split(reader), RuleSet())  # type: ignore[arg-type]
    assert found.findings and [f.signature for f in again.findings] == [
        f.signature for f in found.findings
    ]
    # control: the same trace of a model without a GDN builder is not derived (no threshold)
    plain = RankTrace(_without_split(reader, {"mamba2": 1 + K}), 0, RequestIds())  # type: ignore[arg-type]
    assert all(plain.step_value("mamba_threshold", s) is None for s in recorded)
