"""V2 with a pipeline and async scheduling (vLLM's decode cadence): a request decodes every
pp steps on optimistic counts while its previous result is in flight, results return pp
steps later. The synchronous pipeline (``async_scheduling=False``) is the control: there a
request waits for its sampled token. Under both, prefill chunks go on at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import BUG_BATCH_ROW, SimConfig
from mgtrace.sim.engine import simulate

SHAPE = dict(scenario="pairs", runner="v2", k=2, mamba_block_size=16, length_scale=0.2)


def _run(tmp: Path, name: str, pp: int, sync: bool, steps: int = 300, **extra) -> TraceReader:
    out = tmp / name
    cfg = SimConfig(steps=steps, seed=4, pp=pp, async_scheduling=not sync, output=out)
    for key, value in {**SHAPE, **extra}.items():
        setattr(cfg, key, value)
    simulate(cfg)
    return TraceReader(out)


def _one(reader: TraceReader, sql: str) -> int:
    return int(reader.connect().execute(sql).fetchone()[0])


# rows the scheduler counted optimistically: more computed tokens than the runner's
# exact count (which has the rejected drafts taken off)
OPTIMISTIC = """
SELECT count(*) FROM sched s JOIN batch_rows b USING (rank, step, req_id)
WHERE s.rank = 0 AND s.num_computed > b.num_computed
"""
# a request's decodes closer together than pp steps
CLOSE_DECODES = """
WITH d AS (
  SELECT req_id, step, lag(step) OVER (PARTITION BY req_id ORDER BY step) AS prev
  FROM batch_rows WHERE rank = 0 AND num_computed >= num_prompt)
SELECT count(*) FROM d WHERE step - prev < {pp}
"""
# a non-final prefill chunk followed by the request's next chunk in the very next step
BACK_TO_BACK_CHUNKS = """
WITH c AS (
  SELECT req_id, step, num_computed + num_scheduled < num_prompt AS partial,
         lead(step) OVER (PARTITION BY req_id ORDER BY step) AS next
  FROM batch_rows WHERE rank = 0)
SELECT count(*) FROM c WHERE partial AND next = step + 1
"""


@pytest.mark.parametrize("pp", [2, 3])
def test_the_async_pipeline_schedules_on_optimistic_counts_at_vllms_cadence(
    tmp_path: Path, pp: int
) -> None:
    asyn = _run(tmp_path, "async", pp, sync=False)
    sync = _run(tmp_path, "sync", pp, sync=True)
    assert asyn.manifest.run.async_scheduling is True
    assert sync.manifest.run.async_scheduling is False
    # optimistic counts: only while a result is still in flight when the request is
    # scheduled again; the synchronous pipeline waits for it (the control)
    assert _one(asyn, OPTIMISTIC) > 0
    assert _one(sync, OPTIMISTIC) == 0
    # both keep a request's decodes pp steps apart
    assert _one(asyn, CLOSE_DECODES.format(pp=pp)) == 0
    assert _one(sync, CLOSE_DECODES.format(pp=pp)) == 0
    # both run a request's prefill chunks back to back: vLLM advances the computed count
    # when it schedules a chunk, and a chunk samples nothing to wait for
    assert _one(asyn, BACK_TO_BACK_CHUNKS) > 0
    assert _one(sync, BACK_TO_BACK_CHUNKS) > 0


@pytest.mark.parametrize("pp", [2, 3])
def test_toggle_off_async_pipeline_runs_replay_clean(tmp_path: Path, pp: int) -> None:
    reader = _run(tmp_path, "clean", pp, sync=False)
    result = replay_trace(reader, RuleSet())
    assert result.findings == [] and result.first_step is None


def test_the_batch_row_toggle_under_the_async_pipeline_is_found_and_undone(
    tmp_path: Path,
) -> None:
    reader = _run(tmp_path, "bug", 3, sync=False, bugs=(BUG_BATCH_ROW,))
    truth = reader.manifest.ground_truth["bugs"][BUG_BATCH_ROW]
    assert truth["first_step"] is not None
    found = replay_trace(reader, RuleSet())
    assert found.first_step == truth["first_step"]
    assert set(truth["first_requests"]) == {
        f.req_id for f in found.findings if f.step == found.first_step
    }
    assert replay_trace(reader, RuleSet.parse("bt_row_is_req=true")).findings == []


def test_a_late_postprocess_into_a_block_its_request_just_retired_is_no_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool small enough to hand a retired block out again within pp steps: under the
    synchronous pipeline the scheduler learns a result, and retires the block behind it,
    before the non-last rank's late post-process writes that block; under async the result
    comes pp steps later, after that write. The late write lands at the start of the step,
    before any use of the block by its new owner, so neither run has a finding. Control:
    judged against the owners after the step's scheduling, the synchronous run reports
    that write as foreign, and the async run still has nothing to report."""
    from mgtrace.replayer.oracle import Oracle

    small = dict(scenario="mixed", max_num_seqs=48, num_blocks=24, length_scale=1.0, k=3)
    asyn = _run(tmp_path, "async", 2, sync=False, steps=200, **small)
    sync = _run(tmp_path, "sync", 2, sync=True, steps=200, **small)
    assert replay_trace(asyn, RuleSet()).findings == []
    assert replay_trace(sync, RuleSet()).findings == []

    check_writes = Oracle.check_writes

    def after_scheduling(self, step, what, group, blocks, uid, rows, owned_until_now=None):
        return check_writes(self, step, what, group, blocks, uid, rows)

    monkeypatch.setattr(Oracle, "check_writes", after_scheduling)
    assert replay_trace(asyn, RuleSet()).findings == []
    found = replay_trace(sync, RuleSet()).findings
    assert found and {(f.kind, f.mechanism, f.rank) for f in found} == {
        ("foreign_block_write", "postprocess-copy", 0)
    }


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("sync", [False, True])
def test_the_recorded_run_tells_the_replay_the_simulators_steps_in_flight(
    runner: str, pp: int, sync: bool
) -> None:
    """The simulator's result lag and the count the replay derives from the trace's run
    metadata are written apart (the simulator models the engine, the replay reads a
    recording): they must agree on every shape."""
    from mgtrace.replayer.ownership import steps_in_flight
    from mgtrace.sim.to_trace import run_metadata

    cfg = SimConfig(runner=runner, pp=pp, k=0 if runner == "v1" else 2, async_scheduling=not sync)
    run = run_metadata(cfg.validate(), {}, None)
    assert steps_in_flight(run) == cfg.steps_in_flight


# rows of a late (deferred) post-process by whether their batch row sampled then
LATE_ROWS = """
SELECT count(*) FILTER (WHERE l.req_slot >= 0 AND {partial}) AS kept_partial,
       count(*) FILTER (WHERE l.req_slot < 0 AND {partial}) AS left_out_partial,
       count(*) FILTER (WHERE l.req_slot >= 0 AND NOT {partial}) AS kept_sampling
FROM launches l JOIN batch_rows b
  ON b.rank = l.rank AND b.step = l.batch_step AND b.batch_row = l.batch_row
WHERE l.kernel = 'postprocess' AND l.batch_step < l.step
""".format(partial="b.num_computed + b.num_scheduled < b.num_prompt")


@pytest.mark.parametrize("sync", [False, True])
def test_a_late_post_process_leaves_out_rows_that_did_not_sample(
    tmp_path: Path, sync: bool
) -> None:
    """vLLM's non-last ranks defer the post-process of the rows that sampled only
    (need_sampled_mask): a non-final prefill chunk's row goes as slot -1, and a batch where
    no row samples owes no launch. Control: the late launches keep their sampling rows."""
    reader = _run(tmp_path, "late", pp=2, sync=sync, steps=400)
    kept_partial, left_out, kept_sampling = reader.connect().execute(LATE_ROWS).fetchone()
    assert kept_partial == 0 and left_out > 0 and kept_sampling > 0
    assert replay_trace(reader, RuleSet()).clean
