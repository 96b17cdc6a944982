"""A replay that ends at a step (``--to-step``) loads only the rows of steps up to it: the
parts the manifest places wholly after it are not opened, and what it finds, where it stops
and the block tables' shape are those of a replay that loaded every row."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.errors import InconclusiveError
from mgtrace.replayer import parallel
from mgtrace.replayer.loop import ReplayResult, replay_trace
from mgtrace.replayer.minimize import MemoryTrace, load_memory
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas import reader as reader_module
from mgtrace.schemas.manifest import MANIFEST_NAME, save_manifest
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import write_part_file
from mgtrace.sim.config import BUG_ASYNC_RACE, BUG_BATCH_ROW, BUG_REORDER, BUG_STALE_ROW, SimConfig
from mgtrace.sim.engine import simulate
from tests.replay_helpers import RewritingReader
from tests.test_replay_mid_run import attached_at

STEPS_PER_PART = 40


class _EveryRowReader(RewritingReader):
    """A reader that hands out every row whatever bound it is given, and says nothing of
    the rows past it: a rank trace then loads the whole rank, as before bounds."""

    def table(self, name: str, *args: Any, **kwargs: Any) -> pa.Table:
        kwargs.pop("to_step", None)
        return self._reader.table(name, *args, **kwargs)

    def column_max(self, *args: Any, **kwargs: Any) -> None:
        return None


def in_parts(mem: MemoryTrace, out: Path, every: int = STEPS_PER_PART) -> Path:
    """``mem`` written with each per-step table cut into parts of ``every`` steps (the
    ranks of a step share its part), as a long recording's writer leaves them."""
    out.mkdir(parents=True)
    manifest = mem.manifest
    manifest.parts = []
    for name, t in mem.tables_.items():
        if not t.num_rows:
            continue
        t = t.cast(TABLES[name].schema)
        if "step" not in t.column_names:
            manifest.parts.append(write_part_file(out, f"{name}/all-000000.parquet", t))
            continue
        window = pc.floor(pc.divide(pc.cast(t.column("step"), pa.float64()), every))
        window = window.to_numpy(zero_copy_only=False).astype(np.int64)
        for w in np.unique(window).tolist():
            part = t.filter(pa.array(window == w))
            rel = f"{name}/part-{w - window.min():06d}.parquet"
            manifest.parts.append(write_part_file(out, rel, part))
    save_manifest(out, manifest)
    return out


def _simulated(tmp: Path, **cfg: Any) -> Path:
    whole = tmp / "whole"
    simulate(SimConfig(steps=300, output=whole, **cfg))
    return in_parts(load_memory(TraceReader(whole)), tmp / "parts")


MIXED = dict(scenario="mixed", max_num_seqs=24, length_scale=0.3)
ENGINES = {
    "v1": dict(MIXED, seed=5, bugs=(BUG_REORDER, BUG_ASYNC_RACE)),
    "v1-stale-row": dict(scenario="pairs", seed=0, length_scale=0.2, bugs=(BUG_STALE_ROW,)),
    "v2-pp2": dict(MIXED, runner="v2", pp=2, seed=3, bugs=(BUG_BATCH_ROW,)),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def trace(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _simulated(tmp_path_factory.mktemp(request.param), **ENGINES[request.param])


def _outcome(result: ReplayResult) -> dict[str, Any]:
    return {
        "findings": [asdict(f) for f in result.findings],
        "steps": result.steps,
        "first_step": result.first_step,
        "repeats": result.repeats,
        "stopped_at_gap": result.stopped_at_gap,
        "window_whole": result.window_whole,
        "crossed_gaps": result.crossed_gaps,
    }


def _replay(reader: Any, to_step: int | None, **kwargs: Any) -> dict[str, Any] | str:
    """What a replay to ``to_step`` reports: its outcome, or why it is inconclusive."""
    try:
        return _outcome(replay_trace(reader, RuleSet(), to_step=to_step, **kwargs))
    except InconclusiveError as exc:
        return exc.message


def _ends(path: Path) -> list[int]:
    """Steps to end at: before the first finding, at it, at later findings, at either side
    of a part's end, and short of the last step."""
    whole = replay_trace(TraceReader(path), RuleSet())
    assert whole.findings, "control: the injected bug gives findings to compare"
    found = sorted({f.step for f in whole.findings})
    assert found[-1] > STEPS_PER_PART, "control: findings past the first part"
    middle = found[len(found) // 2]
    return sorted({found[0] - 1, found[0], middle, 2 * STEPS_PER_PART - 1, 2 * STEPS_PER_PART})


def _opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The parts the reader opens from here on, as paths relative to their trace."""
    opened: list[str] = []
    read = reader_module._read_part

    def spy(path: Path, *args: Any, **kwargs: Any) -> pa.Table:
        opened.append(f"{path.parent.name}/{path.name}")
        return read(path, *args, **kwargs)

    monkeypatch.setattr(reader_module, "_read_part", spy)
    return opened


def test_a_bounded_replay_reports_what_a_whole_load_reports(trace: Path) -> None:
    reader = TraceReader(trace)
    for end in _ends(trace):
        bounded = _replay(reader, end)
        assert bounded == _replay(_EveryRowReader(reader), end), f"--to-step {end}"
        assert (isinstance(bounded, dict) and bounded["findings"]) or end < min(
            f.step for f in replay_trace(reader, RuleSet()).findings
        )


def test_a_bounded_replay_opens_no_part_past_its_end(
    trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = TraceReader(trace)
    end = STEPS_PER_PART + 5
    opened = _opened(monkeypatch)
    replay_trace(reader, RuleSet(), to_step=end)
    # the steps table is read whole, one or two columns of it: which steps the rank has
    later = {
        p.path
        for p in reader.parts
        if p.table != "steps" and p.min_step is not None and p.min_step > end
    }
    assert later, "control: the trace has parts past the end"
    assert opened, "control: the spy sees the parts read"
    assert not later & set(opened)


def test_a_replay_that_uses_cached_checkpoints_loads_every_row(
    trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cached checkpoints hold request numbers, which a bounded load may give otherwise: a
    replay that reads or writes them loads every row, whatever its end."""
    import mgtrace.replayer.loop as loop_module

    bounds: list[int | None] = []

    class Spy(RankTrace):
        def __init__(self, *args: Any, to_step: int | None = None) -> None:
            bounds.append(to_step)
            super().__init__(*args, to_step=to_step)

    monkeypatch.setattr(loop_module, "RankTrace", Spy)
    end = STEPS_PER_PART + 5
    replay_trace(TraceReader(trace), RuleSet(), to_step=end)
    assert bounds and set(bounds) == {end}  # control: a plain bounded replay is bounded
    bounds.clear()
    replay_trace(TraceReader(trace), RuleSet(), to_step=end, checkpoint_every=16)
    replay_trace(TraceReader(trace), RuleSet(), from_step=20, to_step=end)
    assert bounds and set(bounds) == {None}


def test_a_bounded_rank_trace_holds_no_row_past_its_end(trace: Path) -> None:
    reader = TraceReader(trace)
    end = STEPS_PER_PART + 5
    for rank in sorted(set(reader.table("steps", columns=["rank"]).column("rank").to_pylist())):
        whole = RankTrace(reader, rank, RequestIds())
        bounded = RankTrace(reader, rank, RequestIds(), to_step=end)
        assert whole.batch_steps.max() > end, "control: the rank has rows past the end"
        assert bounded.batch_steps.max() <= end
        assert len(bounded.batch_steps) == np.count_nonzero(whole.batch_steps <= end)
        n = np.count_nonzero(whole.launch_columns["step"] <= end)
        assert len(bounded.launch_columns["step"]) == n
        assert bounded.step_numbers.tolist() == [s for s in whole.step_numbers if s <= end]
        # where a replay must stop, and the tables' shape, are the whole rank's
        assert bounded.recorded_steps.tolist() == whole.recorded_steps.tolist()
        assert bounded.hole == whole.hole
        k = reader.manifest.run.num_speculative_tokens
        assert bounded.table_dims(k) == whole.table_dims(k)
        assert bounded.began_mid_run == whole.began_mid_run
        # requests keep their numbers: tags and checkpoints hold uids
        seen = bounded.ids.names
        assert whole.ids.names[: len(seen)] == seen


def test_the_tables_shape_counts_the_rows_past_the_end(tmp_path: Path) -> None:
    """A block-table row, a launch and a batch row past the end that reach further than any
    before it still size the tables: an index outside them is a finding naming their
    shape, and a bound must not move it."""
    src = tmp_path / "src"
    simulate(SimConfig(runner="v2", pp=2, steps=120, seed=3, output=src))
    mem = load_memory(TraceReader(src))
    end = 60
    wide = 4 * int(pc.max(pc.list_value_length(mem.tables_["block_tables"]["block_ids"])).as_py())

    def widened(name: str, column: str, value: Any) -> None:
        t = mem.tables_[name]
        at = int(np.flatnonzero(t.column("step").to_numpy() > end)[0])
        col = t.column(column).to_pylist()
        col[at] = value
        i = t.column_names.index(column)
        mem.tables_[name] = t.set_column(
            i, t.schema.field(i), pa.array(col, t.schema.field(i).type)
        )

    widened("block_tables", "block_ids", list(range(1, wide + 1)))
    widened("block_tables", "row", 500)
    widened("launches", "bt_row", 700)
    widened("batch_rows", "state_col", 3 * wide)
    reader = TraceReader(in_parts(mem, tmp_path / "parts"))
    k = reader.manifest.run.num_speculative_tokens
    whole = RankTrace(reader, 0, RequestIds()).table_dims(k)
    assert RankTrace(reader, 0, RequestIds(), to_step=end).table_dims(k) == whole
    rows_to_end = RankTrace(_EveryRowReader(reader), 0, RequestIds(), to_step=end)
    assert whole == (701, 3 * wide + k + 2)
    assert rows_to_end.table_dims(k) == whole, "control: a whole load"


def _steps_removed(src: Path, out: Path, drop: set[int]) -> Path:
    mem = load_memory(TraceReader(src))
    for name, t in mem.tables_.items():
        if "step" in t.column_names and t.num_rows:
            dropped = pa.array(sorted(drop), type=t.schema.field("step").type)
            mem.tables_[name] = t.filter(pc.invert(pc.is_in(t.column("step"), value_set=dropped)))
    return in_parts(mem, out)


@pytest.mark.parametrize(
    ("gap", "end"),
    [(150, 100), (101, 100), (100, 100), (60, 100), (0, 100)],
    ids=["after", "right-after", "at-the-end", "before", "first-step"],
)
def test_a_gap_past_the_end_changes_nothing_and_one_before_it_stops_the_replay(
    tmp_path: Path, gap: int, end: int
) -> None:
    src = tmp_path / "src"
    simulate(SimConfig(runner="v2", pp=2, steps=200, seed=3, bugs=(BUG_BATCH_ROW,), output=src))
    reader = TraceReader(_steps_removed(src, tmp_path / "gap", {gap}))
    bounded = _replay(reader, end)
    assert bounded == _replay(_EveryRowReader(reader), end)
    stops = isinstance(bounded, str) or bool(bounded["stopped_at_gap"])
    assert stops == (gap <= end)
    if gap > end:
        assert isinstance(bounded, dict) and bounded["window_whole"]


@pytest.mark.parametrize("first", [120, 40], ids=["after", "before"])
def test_a_left_out_part_is_a_gap_only_up_to_the_end(tmp_path: Path, first: int) -> None:
    src = tmp_path / "src"
    simulate(SimConfig(runner="v2", pp=2, steps=200, seed=3, bugs=(BUG_BATCH_ROW,), output=src))
    trace = in_parts(load_memory(TraceReader(src)), tmp_path / "parts")
    parts = json.loads((trace / MANIFEST_NAME).read_text())["parts"]
    rel = next(p["path"] for p in parts if p["table"] == "launches" and p["min_step"] == first)
    (trace / rel).write_bytes(b"PAR1 garbage")
    reader = TraceReader(trace, skip_bad_parts=True)
    end = 100
    bounded = _replay(reader, end)
    assert bounded == _replay(_EveryRowReader(reader), end)
    assert isinstance(bounded, dict)
    assert bool(bounded["stopped_at_gap"]) == (first <= end)
    assert bounded["window_whole"] == (first > end)


def test_a_recording_attached_mid_run_replays_to_an_end_as_a_whole_load(tmp_path: Path) -> None:
    src = tmp_path / "src"
    simulate(SimConfig(runner="v2", pp=2, steps=240, seed=4, bugs=(BUG_BATCH_ROW,), output=src))
    attached = attached_at(src, tmp_path / "attached", 60)
    reader = TraceReader(in_parts(load_memory(TraceReader(attached)), tmp_path / "parts"))
    bounded = RankTrace(reader, 0, RequestIds(), to_step=50)
    assert bounded.began_mid_run, "control: requests in flight at the first step"
    for end in (10, 50, 100):
        assert _replay(reader, end) == _replay(_EveryRowReader(reader), end), f"--to-step {end}"


def test_segments_load_only_the_steps_they_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    simulate(SimConfig(runner="v2", pp=2, steps=300, seed=3, bugs=(BUG_BATCH_ROW,), output=src))
    reader = TraceReader(in_parts(load_memory(TraceReader(src)), tmp_path / "parts"))
    bounds: list[int | None] = []
    load = parallel._rank_trace

    def spy(reader: TraceReader, rank: int, to_step: int | None = None) -> RankTrace:
        bounds.append(to_step)
        return load(reader, rank, to_step)

    monkeypatch.setattr(parallel, "_rank_trace", spy)
    end = 200
    split = parallel.replay_rank_in_segments(
        reader, 0, RuleSet(), jobs=2, until=end, min_segment=40, warmup=16
    )
    assert split.segments == 2, "control: the rank is replayed in two segments"
    assert bounds and set(bounds) == {end}
    one = replay_trace(reader, RuleSet(), to_step=end)
    in_order = sorted(
        split.findings, key=lambda f: (f.step, f.rank, -1 if f.batch_row is None else f.batch_row)
    )
    assert [asdict(f) for f in in_order] == [asdict(f) for f in one.findings]
    assert split.findings, "control: findings to compare"


def test_a_bound_reads_only_the_rows_it_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    simulate(SimConfig(runner="v2", pp=2, steps=100, seed=3, output=src))
    reader = TraceReader(in_parts(load_memory(TraceReader(src)), tmp_path / "parts"))
    for end in (-1, 0, 39, 40, 55, 1000):
        t = reader.table("sched", columns=["rank", "req_id"], to_step=end)
        whole = reader.table("sched")
        assert t.column_names == ["rank", "req_id"]
        assert t.num_rows == np.count_nonzero(whole["step"].to_numpy() <= end)
    with pytest.raises(ValueError, match="no step column"):
        reader.table("requests", to_step=5)
    for rank in (0, 1):
        launches = reader.table("launches")
        mine = launches.filter(
            pc.and_(pc.equal(launches["rank"], rank), pc.greater(launches["step"], 55))
        )
        got = reader.column_max("launches", "batch_row", rank=rank, after_step=55)
        assert got == pc.max(mine["batch_row"]).as_py()
    assert reader.column_max("launches", "batch_row", rank=0, after_step=1000) is None
