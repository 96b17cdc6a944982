"""V1 without speculative decoding (k = 0): vLLM builds no align context, ``preprocess_mamba``
copies each running state itself, and nothing runs after the forward. The simulator writes
what the recorder writes for such a run (tests/test_recorder_peer.py checks that against
vLLM's own copies): one precopy launch per step, no post-process, no accepted counts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.errors import UsageError
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.minimize import load_memory
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim import SimConfig
from mgtrace.sim.bugs import BUG_STALE_ROW
from tests.replay_helpers import set_root, sim_trace


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("k0"))


@pytest.mark.parametrize("scenario", ["pairs", "mixed", "steady"])
def test_a_run_without_drafts_has_only_precopies_and_replays_clean(scenario: str) -> None:
    reader = TraceReader(sim_trace(None, 5, 1500, scenario=scenario, k=0))
    launches = reader.table("launches", columns=["kernel", "src_col"])
    assert set(launches.column("kernel").to_pylist()) == {"precopy"}
    assert pc.sum(pc.greater_equal(launches.column("src_col"), 0)).as_py() > 0
    rows = reader.table("batch_rows", columns=["accepted"])
    steps = reader.table("steps", columns=["postprocess_step", "accepted_landed"])
    assert rows.column("accepted").null_count == rows.num_rows
    assert steps.column("postprocess_step").null_count == steps.num_rows
    assert steps.column("accepted_landed").null_count == steps.num_rows
    assert replay_trace(reader, RuleSet()).findings == []


def test_a_copy_the_trace_lacks_is_found() -> None:
    """The control: the same clean run with one row's state copy left out of its precopy
    (as a recorder that missed one would write it) reads a state that is not whole."""
    trace = load_memory(TraceReader(sim_trace(None, 5, 1500, scenario="pairs", k=0)))
    launches = trace.tables_["launches"]
    src = pc.fill_null(launches.column("src_col"), -1).to_numpy().copy()
    first = int(np.flatnonzero(src >= 0)[0])
    step = launches.column("step")[first].as_py()
    src[first] = -1
    at = launches.column_names.index("src_col")
    field = launches.schema.field(at)
    trace.tables_["launches"] = launches.set_column(at, field, pa.array(src, field.type))
    found = replay_trace(trace, RuleSet()).findings  # type: ignore[arg-type]
    assert found and min(f.step for f in found) >= step


def test_stale_condense_rows_need_drafts() -> None:
    """Without drafts the Mamba builder pads with the null block and gathers nothing, so
    the stale-row bug has no path to a read: the toggle is refused in one sentence."""
    with pytest.raises(UsageError, match="speculative decoding"):
        SimConfig(k=0, bugs=(BUG_STALE_ROW,)).validate()
    SimConfig(k=1, bugs=(BUG_STALE_ROW,)).validate()


@pytest.mark.parametrize("pp", [2, 4])
def test_every_pipeline_stage_of_v1_records_the_same_batch(pp: int) -> None:
    """A V1 run under PP said PP N in its run and held one rank: each worker records, and
    every stage runs the same batch, so the trace holds a line per rank and step, the same
    on every rank. Control: the PP 1 trace has rank 0 alone."""
    one = TraceReader(sim_trace(None, 5, 300, runner="v1", k=0))
    assert one.table("steps", columns=["rank"]).column("rank").unique().to_pylist() == [0]
    reader = TraceReader(sim_trace(None, 5, 300, runner="v1", k=0, pp=pp))
    rows = reader.table("batch_rows").sort_by([("rank", "ascending"), ("step", "ascending")])
    by_rank = [rows.filter(pc.equal(rows.column("rank"), r)).drop(["rank"]) for r in range(pp)]
    assert by_rank[0].num_rows > 0
    assert all(t.equals(by_rank[0]) for t in by_rank[1:])
    result = replay_trace(reader, RuleSet())
    assert result.findings == [] and sorted(result.ranks) == list(range(pp))


def test_diff_names_the_rank_only_one_trace_has() -> None:
    """A one-rank trace against a PP 2 one of the same engine: "only A has steps" read as
    if the other trace had none; it is rank 1's steps that only one of them has."""
    from mgtrace.replayer.diff import diff_traces

    one = TraceReader(sim_trace(None, 5, 300, runner="v1", k=0))
    two = TraceReader(sim_trace(None, 5, 300, runner="v1", k=0, pp=2))
    result = diff_traces(two, one)
    assert (result.first_step, result.rank, result.only_in) == (0, 1, "a")
    assert result.sentence("A", "B").endswith("only A has steps of rank 1")
