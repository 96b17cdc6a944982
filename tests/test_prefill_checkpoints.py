"""Prefill checkpoints (vLLM >= 0.33): recorded where the engine stores them, simulated, and
written by the replay's forward model.

A Mamba prefill whose query crosses a reusable boundary also exports its state there, into
the column behind the running one. A later prefix-cache hit reads that block; a replay that
does not write it reports the hit as a read of unwritten state. Each check has a control.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.recorder.assemble import prefill_checkpoints
from mgtrace.replayer.coverage import unmodelled_writes
from mgtrace.replayer.loop import RankReplay, replay_trace
from mgtrace.replayer.minimize import load_memory, write_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.checkpoints import checkpoints_of
from tests.hook_helpers import optional_hook
from tests.replay_helpers import set_root, sim_trace

B = 16


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("ckpt"))


def _trace(runner: str) -> Path:
    engine = {"runner": runner, "pp": 2} if runner == "v2" else {"runner": runner}
    return sim_trace(None, 5, 1500, scenario="pairs", prefill_checkpoints=True, **engine)


# ----------------------------------------------------------------------------- the rule
def _random_queries(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    start = rng.integers(0, 12, n) * B + rng.choice([0, 0, 0, 3], n)
    return start, rng.integers(1, 6 * B, n)


def test_the_rule_marks_only_a_boundary_inside_the_query() -> None:
    start, scheduled = _random_queries(2000, 1)
    tokens, cols = checkpoints_of(start, scheduled, B)
    has = cols >= 0
    assert has.any() and (~has).any()
    end = start + scheduled
    assert np.all(tokens[has] % B == 0)
    assert np.all((start[has] < tokens[has]) & (tokens[has] < end[has]))
    # the checkpoint's column holds the state after (col + 1) * B tokens
    assert np.all((cols[has] + 1) * B == tokens[has])
    assert np.all(cols[has] == -(-end[has] // B) - 2)


@pytest.mark.peer
@pytest.mark.parametrize("drop", [False, True], ids=["k0", "mtp-block-drop"])
def test_the_rule_equals_vllms(drop: bool) -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    checkpoint = pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")
    start, scheduled = _random_queries(3000, 2)
    end = start + scheduled
    offsets, cols = checkpoint.compute_mamba_prefill_checkpoints(
        end.tolist(), scheduled.tolist(), B, B, 1, drop, B
    )
    theirs_tokens = np.where(np.array(offsets) > 0, start + np.array(offsets), -1)
    tokens, ours_cols = checkpoints_of(start, scheduled, B, drop)
    assert (np.array(offsets) > 0).any()
    assert np.array_equal(tokens, theirs_tokens)
    assert np.array_equal(ours_cols, np.array(cols))
    # control: the running column instead of the one behind it differs from vLLM's
    wrong = np.where(ours_cols >= 0, ours_cols + 1, -1)
    assert not np.array_equal(wrong, np.array(cols))
    # control: the block drop moves checkpoints
    assert np.array_equal(tokens, checkpoints_of(start, scheduled, B)[0]) is not drop


# ----------------------------------------------------------------------------- recording
@pytest.mark.peer
def test_the_hook_records_what_the_real_builder_returns() -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    checkpoint = pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")
    from vllm.v1.kv_cache_interface import MambaSpec

    from mgtrace.recorder import features

    cls = checkpoint.MambaPrefillCheckpointBuilder
    target = next(t for t in features.V1_TARGETS if t.owner == cls.__name__)
    assert features.resolve(target) is cls
    spec = MambaSpec(
        block_size=B,
        shapes=((4, 8), (2, 4)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )
    config = SimpleNamespace(
        speculative_config=None,
        num_hash_lookahead_tokens=0,
        cache_config=SimpleNamespace(
            mamba_cache_mode="align", hash_block_size=B, cache_hit_alignment_tokens=B
        ),
    )
    builder = cls(config, spec)
    # batch rows 0-1 decode, 2-4 prefill: row 2 crosses a boundary from an aligned start,
    # row 3 starts mid-block (none), row 4 crosses two boundaries from 0
    computed = [40, 7, 2 * B, 5, 0]
    query = [4, 4, 2 * B + 3, 2 * B, 3 * B + 1]
    seq = torch.tensor([c + q for c, q in zip(computed, query, strict=True)], dtype=torch.int32)
    starts = np.concatenate([[0], np.cumsum(query)])
    meta = SimpleNamespace(
        seq_lens_cpu_upper_bound=seq,
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        query_start_loc=torch.zeros(6, dtype=torch.int32),
        block_table_tensor=torch.arange(5 * 8, dtype=torch.int32).reshape(5, 8) + 1,
    )
    with optional_hook(cls.__name__, cls) as sess:
        result = builder.build(meta, [2, 3, 4])
    truth = [
        (row, int(seq[row]) - query[row] + off, int(col))
        for row, off, col in zip([2, 3, 4], result.offsets, result.block_cols.tolist(), strict=True)
        if off > 0
    ]
    assert len(truth) == 2 and sess.rec["ckpt"] == truth
    columns = prefill_checkpoints(5, sess.rec["ckpt"])
    assert columns["checkpoint_tokens"] == [None, None, 4 * B, None, 3 * B]
    assert columns["checkpoint_col"] == [None, None, 3, None, 2]
    # control: a step without prefill checkpoints records nothing
    assert prefill_checkpoints(5, None) == {}


def test_replay_warns_only_where_checkpoints_went_unrecorded() -> None:
    assert unmodelled_writes(RunMetadata(prefill_checkpoint_blocks=1))
    assert unmodelled_writes(RunMetadata(prefill_checkpoint_blocks=0)) is None
    recorded = RunMetadata(prefill_checkpoint_blocks=1, prefill_checkpoints_recorded=True)
    assert unmodelled_writes(recorded) is None


# ----------------------------------------------------------------------------- replay
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_prefix_hits_on_checkpoint_blocks_replay_clean(runner: str, monkeypatch) -> None:
    reader = TraceReader(_trace(runner))
    assert reader.manifest.run.prefill_checkpoints_recorded
    con = reader.connect()
    stored = con.execute("SELECT count(checkpoint_col) FROM batch_rows").fetchone()[0]
    hits = con.execute("SELECT count(*) FROM requests WHERE prefix_hit_tokens > 0").fetchone()[0]
    assert stored and hits
    result = replay_trace(reader, RuleSet())
    assert result.clean, [f.detail for f in result.findings[:3]]
    # control: without the checkpoint writes, the hits read a state their checkpoint should
    # have replaced: nobody's, or (a freed block is reused next) an older running state
    hit_reqs = {
        r
        for (r,) in con.execute(
            "SELECT req_id FROM requests WHERE prefix_hit_tokens > 0"
        ).fetchall()
    }
    monkeypatch.setattr(RankReplay, "_prefill_checkpoints", lambda *args: None)
    blind = replay_trace(reader, RuleSet())
    assert blind.findings
    assert all(
        f.mechanism.startswith("prefill-read:") and f.req_id in hit_reqs for f in blind.findings
    ), [(f.mechanism, f.req_id) for f in blind.findings[:3]]


def test_a_checkpoint_written_into_the_running_column_is_found(tmp_path: Path) -> None:
    """A checkpoint exported one column too far overwrites the prefill's running state with
    an older one: the request's next read folds too few tokens."""
    reader = TraceReader(_trace("v1"))
    trace = load_memory(reader)
    rows = trace.tables_["batch_rows"]
    has = np.asarray(pc.is_valid(rows.column("checkpoint_col")))
    # the last chunk of a prompt: it writes the checkpoint into a real block
    running = np.asarray(pc.fill_null(rows.column("state_col"), -1))
    computed = np.asarray(rows.column("num_computed")) + np.asarray(rows.column("num_scheduled"))
    last = has & (computed == np.asarray(rows.column("num_prompt")))
    i = int(np.flatnonzero(last)[0])
    cols = np.asarray(pc.fill_null(rows.column("checkpoint_col"), -1)).copy()
    cols[i] = running[i]
    at = rows.column_names.index("checkpoint_col")
    mask = pa.array(cols < 0)
    trace.tables_["batch_rows"] = rows.set_column(
        at, rows.schema.field(at), pa.array(cols, pa.int32(), mask=np.asarray(mask))
    )
    bad = tmp_path / "bad"
    write_trace(trace, bad, reader.manifest)
    step = int(rows.column("step")[i].as_py())
    req = rows.column("req_id")[i].as_py()
    result = replay_trace(TraceReader(bad), RuleSet())
    assert result.first_step is not None and step <= result.first_step <= step + 1
    assert req in {f.req_id for f in result.findings if f.step == result.first_step}


@pytest.mark.gpu
@pytest.mark.parametrize("mirror", [True, False])
def test_prefill_checkpoints_on_the_gpu(mirror: bool) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reader = TraceReader(_trace("v2"))
    on_gpu = {"backend": "triton", "device": "cuda", "mirror": mirror}
    assert replay_trace(reader, RuleSet(), **on_gpu).clean
