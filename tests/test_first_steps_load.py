"""bisect, minimize and diff --rules-b load a trace's first steps, and more only as their
first replay gets past them clean: the verdict, the repro and the divergence are the ones a
whole load gives, and an early bug is found without reading the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from mgtrace.errors import TraceError
from mgtrace.replayer import bisect as bisect_module
from mgtrace.replayer import diff as diff_module
from mgtrace.replayer import minimize as minimize_module
from mgtrace.replayer.bisect import Bisector
from mgtrace.replayer.diff import RulesDiff, diff_rules
from mgtrace.replayer.loop import RankReplay
from mgtrace.replayer.minimize import MemoryTrace, load_memory, minimize, write_trace
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.sim.config import BUG_BATCH_ROW, BUG_REORDER, BUG_STALE_ROW
from tests.replay_helpers import set_root, sim_trace, toggle_trace

pytestmark = pytest.mark.slow

HORIZON = 8
SMALL_LOAD = 40  # steps in a first load: growth to 320, then the whole trace


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("sim"))


def _verdict(trace: Path, first_load: int) -> tuple[dict[str, Any], Bisector]:
    b = Bisector(trace, horizon=HORIZON, first_load=first_load)
    data = b.run().to_json()
    # which steps each probe replayed depends on where checkpoints were kept: not a verdict
    for key in ("wall_s", "probes", "steps_replayed"):
        data.pop(key)
    return data, b


def _whole(trace: Path) -> dict[str, Any]:
    data, b = _verdict(trace, first_load=10**9)
    assert all(t.to_step is None for t in b.traces.values())
    return data


def _first_step(trace: Path, bug: str) -> int:
    return TraceReader(trace).manifest.ground_truth["bugs"][bug]["first_step"]


def test_a_finding_past_the_first_load_is_found_as_a_whole_load_finds_it() -> None:
    trace = toggle_trace(BUG_STALE_ROW, 1)
    first = _first_step(trace, BUG_STALE_ROW)
    assert first > SMALL_LOAD  # the replay must go on into a second load to find it
    grown, b = _verdict(trace, SMALL_LOAD)
    assert grown["first_step"] == first
    assert grown == _whole(trace)
    (loaded,) = b.traces.values()
    assert loaded.to_step is not None and loaded.to_step >= first + HORIZON


@pytest.mark.parametrize(
    ("bug", "engine"),
    [
        (None, {"runner": "v1", "scenario": "pairs"}),
        (None, {"runner": "v2", "pp": 2, "scenario": "pairs"}),
        (BUG_BATCH_ROW, {"runner": "v2", "pp": 2, "scenario": "pairs"}),
    ],
)
def test_the_verdict_is_a_whole_loads(bug: str | None, engine: dict[str, Any]) -> None:
    trace = sim_trace(bug, 3, 700, **engine)
    grown, _ = _verdict(trace, SMALL_LOAD)
    assert grown == _whole(trace)
    assert grown["status"] == ("bad" if bug else "clean")


def test_an_early_bug_is_found_without_loading_the_rest() -> None:
    trace = toggle_trace(BUG_REORDER, 0)
    first = _first_step(trace, BUG_REORDER)
    assert first + HORIZON < SMALL_LOAD
    grown, b = _verdict(trace, SMALL_LOAD)
    assert grown["first_step"] == first
    (loaded,) = b.traces.values()
    assert loaded.to_step is not None and loaded.step_numbers.max() <= loaded.to_step
    assert len(loaded.step_numbers) == SMALL_LOAD
    assert loaded.recorded_steps.max() >= 1000  # the trace goes on well past what was loaded
    assert grown == _whole(trace)


def test_a_short_trace_is_loaded_whole() -> None:
    trace = toggle_trace(BUG_REORDER, 0)
    _, b = _verdict(trace, bisect_module.FIRST_LOAD)
    assert all(t.to_step is None for t in b.traces.values())


def test_each_load_is_larger_than_the_one_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load holds at least four horizons: the next ones grow from that, not from the
    first load asked for, or a long horizon reads the same steps again for nothing."""
    trace = sim_trace(None, 2, 1500, runner="v1", scenario="pairs")
    bounds: list[int | None] = []
    original = Bisector._load

    def spy(self: Bisector, rank: int, steps: int) -> Any:
        trace = original(self, rank, steps)
        bounds.append(trace.to_step)
        return trace

    monkeypatch.setattr(Bisector, "_load", spy)
    assert Bisector(trace, horizon=150, first_load=10).run().status == "clean"
    assert bounds == [599, None]  # four horizons, then 4,800 steps: the whole trace


def test_a_continuation_without_the_state_before_it_gives_another_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: the replay of a larger load must start from the state the smaller one
    left; started afresh instead, the comparison above sees the difference."""
    trace = toggle_trace(BUG_STALE_ROW, 1)
    whole = _whole(trace)
    original = RankReplay.restore
    continuing: list[bool] = []

    def restore(self: RankReplay, cp: Any) -> None:
        if not continuing:  # only the first restore: the continuation into the second load
            continuing.append(True)
            return
        original(self, cp)

    monkeypatch.setattr(RankReplay, "restore", restore)
    grown, _ = _verdict(trace, SMALL_LOAD)
    assert continuing
    assert grown != whole


# ---------------------------------------------------------------- minimize
LOAD_MEMORY = minimize_module.load_memory


def _minimized(
    trace: Path, out: Path, first_load: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], list[int | None]]:
    """minimize's result (less what differs run to run) and the bounds it loaded."""
    bounds: list[int | None] = []

    def spy(reader: Any, to_step: int | None = None) -> Any:
        bounds.append(to_step)
        return LOAD_MEMORY(reader, to_step)

    monkeypatch.setattr(minimize_module, "FIRST_LOAD", first_load)
    monkeypatch.setattr(minimize_module, "load_memory", spy)
    data = vars(minimize(trace, out)).copy()
    for key in ("wall_s", "output", "test_file"):
        data.pop(key)
    return data, bounds


def _tables(trace: Path) -> dict[str, Any]:
    return {
        name: pq.read_table(trace / name).to_pylist() for name in TABLES if (trace / name).exists()
    }


@pytest.mark.parametrize(("bug", "seed", "loads"), [(BUG_STALE_ROW, 1, 2), (BUG_REORDER, 0, 1)])
def test_minimize_loads_through_the_first_finding_and_makes_the_same_repro(
    bug: str, seed: int, loads: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = toggle_trace(bug, seed)
    first = _first_step(trace, bug)
    grown, bounds = _minimized(trace, tmp_path / "grown", SMALL_LOAD, monkeypatch)
    whole, whole_bounds = _minimized(trace, tmp_path / "whole", 10**9, monkeypatch)
    assert whole_bounds == [None]
    # 40 steps, then 320 when the first 40 are clean: only the last load holds the finding
    assert len(bounds) == loads and None not in bounds
    assert bounds[-1] >= first and all(b < first for b in bounds[:-1])
    assert grown["original_first_step"] == first
    assert grown["original_steps"] == 1500  # the whole trace's steps, and its requests
    assert grown == whole
    assert _tables(tmp_path / "grown") == _tables(tmp_path / "whole")


def _with_a_wide_row_past(src: Path, out: Path) -> tuple[int, int]:
    """``src`` (a stale-row trace) with its first padded row's gather reaching one column
    past the block tables its first steps need, and, two steps later and before the first
    finding, a block-table row that nothing indexes, wide enough to hold that column.
    Returns the last step of a load that stops just after the padded row, and the first
    finding's step."""
    reader = TraceReader(src)
    first = _first_step(src, BUG_STALE_ROW)
    run = reader.manifest.run
    k, block = run.num_speculative_tokens, run.mamba_block_size
    mem = load_memory(reader)
    tables = dict(mem.tables_)
    launches = tables["launches"]
    padded = np.asarray(pc.less(pc.fill_null(launches.column("req_slot"), 0), 0))
    at = int(np.flatnonzero(padded)[0])
    bound = int(launches.column("step")[at].as_py()) + 1
    assert bound + 2 < first
    width = RankTrace(load_memory(reader, to_step=bound), 0, RequestIds()).table_dims(k)[1]
    seq = launches.column("seq_len").to_pylist()
    seq[at] = (width - k) * block + 1  # gathers columns width-k .. width: the last outside
    i = launches.column_names.index("seq_len")
    field = launches.schema.field(i)
    tables["launches"] = launches.set_column(i, field, pa.array(seq, field.type))
    bt = tables["block_tables"]
    unused = max(pc.max(bt.column("row")).as_py(), pc.max(launches.column("bt_row")).as_py()) + 1
    wide = pa.table(
        {
            "rank": pa.array([0], pa.int32()),
            "step": pa.array([bound + 2], pa.int64()),
            "group": pa.array([0], pa.int32()),
            "table": pa.array(["v1"]).dictionary_encode().cast(bt.schema.field("table").type),
            "row": pa.array([unused], pa.int32()),
            "block_ids": pa.array([[0] * (width + 4)], pa.list_(pa.int32())),
        },
        schema=bt.schema,
    )
    tables["block_tables"] = pa.concat_tables([bt, wide]).sort_by(
        [("rank", "ascending"), ("step", "ascending")]
    )
    write_trace(MemoryTrace(mem.manifest, tables), out, mem.manifest)
    return bound, first


def test_minimize_sees_the_block_tables_as_wide_as_a_whole_load_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first load's tables are as wide as the rows it left out make a whole load's: an
    index outside the loaded rows' tables but inside the whole trace's is no finding."""
    trace = tmp_path / "wide"
    bound, first = _with_a_wide_row_past(toggle_trace(BUG_STALE_ROW, 1), trace)
    whole, _ = _minimized(trace, tmp_path / "whole", 10**9, monkeypatch)
    assert whole["original_first_step"] == first
    assert Bisector(trace, horizon=HORIZON, first_load=bound + 1).run().first_step == first
    grown, bounds = _minimized(trace, tmp_path / "grown", bound + 1, monkeypatch)
    assert bounds[0] == bound
    assert grown == whole


# ---------------------------------------------------------------- diff --rules
RESUMED = diff_module.resumed


def _rules_diff(
    trace: Path, a: str, b: str, first_load: int, monkeypatch: pytest.MonkeyPatch
) -> RulesDiff:
    monkeypatch.setattr(diff_module, "FIRST_LOAD", first_load)
    return diff_rules(TraceReader(trace), RuleSet.parse(a), RuleSet.parse(b))


@pytest.mark.parametrize(
    ("bug", "engine", "a", "b"),
    [
        # diverges at the stale row's first write, past the first load
        (BUG_STALE_ROW, {"runner": "v1", "scenario": "pairs"}, "", "clear_vacated_rows=true"),
        # never diverges: every step of both ranks, over three loads
        (None, {"runner": "v2", "pp": 2, "scenario": "pairs"}, "", "accepted_source=cpu"),
        (BUG_BATCH_ROW, {"runner": "v2", "pp": 2, "scenario": "pairs"}, "", "bt_row_is_req=true"),
    ],
)
def test_diff_rules_goes_on_into_larger_loads_as_a_whole_load_replays(
    bug: str | None, engine: dict[str, Any], a: str, b: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = sim_trace(bug, 1, 700, **engine)
    grown = _rules_diff(trace, a, b, SMALL_LOAD, monkeypatch)
    whole = _rules_diff(trace, a, b, 10**9, monkeypatch)
    assert grown == whole
    assert (whole.first_step is None) == (bug is None)


def test_diff_rules_resumed_without_one_sides_state_diverges_at_the_load_boundary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: each side's replay of the larger load must start from the state that
    side's replay left; one started afresh instead, the comparison above sees it."""
    trace = sim_trace(None, 1, 700, runner="v1", scenario="pairs")
    a, b = "", "accepted_source=cpu"
    assert _rules_diff(trace, a, b, 10**9, monkeypatch).first_step is None
    calls: list[int] = []

    def first_afresh(trace: Any, rules: Any, backend: Any, device: str, *state: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            return RankReplay(trace, rules, backend, device=device)
        return RESUMED(trace, rules, backend, device, *state)

    monkeypatch.setattr(diff_module, "resumed", first_afresh)
    grown = _rules_diff(trace, a, b, SMALL_LOAD, monkeypatch)
    assert grown.first_step == SMALL_LOAD  # the first step of the second load


# ---------------------------------------------------------------- damage
def test_rows_past_what_is_read_are_not_checked_as_with_to_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load checks its own rows only. Damage past the steps a bisection or a diff reads
    does not stop them, as it does not stop ``replay --to-step``; a whole load refuses it."""
    src = sim_trace(BUG_BATCH_ROW, 3, 400, runner="v2", pp=2, scenario="pairs")
    mem = load_memory(TraceReader(src))
    launches = mem.tables_["launches"]
    kernels = launches.column("kernel").to_pylist()
    kernels[int(np.flatnonzero(np.asarray(launches.column("step")) >= 300)[0])] = "bogus"
    i = launches.column_names.index("kernel")
    field = launches.schema.field(i)
    tables = dict(mem.tables_)
    tables["launches"] = launches.set_column(i, field, pa.array(kernels).cast(field.type))
    trace = tmp_path / "damaged"
    write_trace(MemoryTrace(mem.manifest, tables), trace, mem.manifest)
    with pytest.raises(TraceError, match=r"kernel 'bogus'.*the trace is damaged"):
        Bisector(trace, horizon=HORIZON, first_load=10**9)
    # a first load of 100 steps holds the finding at step 33 and its horizon
    verdict = Bisector(trace, horizon=HORIZON, first_load=100).run()
    assert verdict.status == "bad" and verdict.first_step == 33
    b = "bt_row_is_req=true"
    assert _rules_diff(trace, "", b, SMALL_LOAD, monkeypatch).first_step == 33
    with pytest.raises(TraceError, match=r"kernel 'bogus'"):
        _rules_diff(trace, "", b, 10**9, monkeypatch)


# ---------------------------------------------------------------- progress
def test_bisect_says_what_it_loads_replays_and_tries() -> None:
    said: list[str] = []
    clean = sim_trace(None, 3, 700, runner="v1", scenario="pairs")
    Bisector(clean, horizon=HORIZON, first_load=SMALL_LOAD, progress=said.append).run()
    assert said == [
        "loading: 40 of 700 steps",
        "loading: 320 of 700 steps",
        "replaying: 256 of 700 steps",
        "loading: 700 of 700 steps",  # from step 312, a horizon before the end of the load
        "replaying: 512 of 700 steps",
    ]
    said.clear()
    buggy = toggle_trace(BUG_STALE_ROW, 1)
    Bisector(buggy, horizon=HORIZON, first_load=SMALL_LOAD, progress=said.append).run()
    assert said[:2] == ["loading: 40 of 1,500 steps", "loading: 320 of 1,500 steps"]
    assert said[2:] and all(s.startswith("trying --") for s in said[2:])
    assert said[2].endswith(f"(1 of {sum(s.endswith(')') for s in said)})")


def test_bisect_shows_its_progress_on_a_terminal_and_only_there() -> None:
    trace = toggle_trace(BUG_REORDER, 0)
    runs = {}
    for terminal in (True, False):
        env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
        if terminal:
            env["FORCE_COLOR"] = "1"  # rich takes standard error for a terminal
        runs[terminal] = subprocess.run(
            [sys.executable, "-m", "mgtrace", "bisect", str(trace), "--json"],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
    for proc in runs.values():
        assert proc.returncode == 1, proc.stderr
        assert json.loads(proc.stdout)["first_step"] == _first_step(trace, BUG_REORDER)
    # each stage is drawn as it starts, however short
    assert "bisect: loading: 1,500 of 1,500 steps" in runs[True].stderr
    assert "bisect: trying --reorder-threshold=1+k" in runs[True].stderr
    assert "bisect:" not in runs[False].stderr


def test_minimize_says_how_many_steps_it_loads_for_its_first_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = toggle_trace(BUG_STALE_ROW, 1)
    said: list[tuple[str, int, int]] = []
    monkeypatch.setattr(minimize_module, "FIRST_LOAD", SMALL_LOAD)
    minimize(trace, tmp_path / "repro", progress=lambda *a: said.append(a))
    first = [a for a in said if a[0] == minimize_module.FIRST_REPLAY]
    assert first == [(minimize_module.FIRST_REPLAY, 0, 40), (minimize_module.FIRST_REPLAY, 0, 320)]
    assert said[: len(first)] == first  # before any reduction
    assert len(said) > len(first)
    env = dict(os.environ, FORCE_COLOR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mgtrace", "minimize", str(trace), "-o", str(tmp_path / "cli")],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "minimizing: replaying up to the first finding, 1,500 steps loaded" in proc.stderr
