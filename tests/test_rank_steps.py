"""Ranks that began recording at different engine steps: found from their scheduler rows,
and said by `info` and by the replay."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.query.rank_steps import rank_step_offsets
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import TraceWriter
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.conftest import run_cli

pytestmark = pytest.mark.unit

STEP_COLUMNS = ("step", "batch_step", "bt_step")


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean two-rank (V2, PP 2) simulated trace, both ranks written from step 0."""
    path = tmp_path_factory.mktemp("ranks") / "whole.trace"
    cfg = SimConfig(
        scenario="steady", steps=120, runner="v2", pp=2, seed=3, output=path, overwrite=True
    )
    simulate(cfg.validate())
    return path


def record_per_rank(
    whole: Path,
    out: Path,
    *,
    late: dict[int, int] | None = None,
    skew: tuple[int, int | None] | None = None,
) -> Path:
    """Each rank's rows of ``whole`` as the trace its worker records (``out/rank-NNN``). A
    rank in ``late`` began recording that many engine steps after step 0: its earlier steps
    are missing and its steps count from its first. ``skew``: (rank, step) whose scheduler
    rows differ from the other rank's (computed counts off by one), at every step for None."""
    reader = TraceReader(whole)
    late = late or {}
    for rank in (0, 1):
        path = out / f"rank-{rank:03d}"
        with TraceWriter(path, run=reader.run, source={"kind": "test", "rank": rank}) as w:
            for name, spec in TABLES.items():
                table = reader.table(name)
                if not spec.per_step:
                    if rank == 0 and name != "findings" and table.num_rows:
                        w.write_rows(name, _columns(table))
                    continue
                table = table.filter(pc.equal(table["rank"], rank)).drop(["rank"])
                shift = late.get(rank, 0)
                table = table.filter(pc.greater_equal(table["step"], shift))
                for column in STEP_COLUMNS:
                    if column in table.column_names:
                        at = table.column_names.index(column)
                        table = table.set_column(at, column, pc.subtract(table[column], shift))
                if name == "sched" and skew is not None and rank == skew[0]:
                    at = table.column_names.index("num_computed")
                    off = pa.scalar(1, pa.int32())
                    if skew[1] is not None:
                        here = pc.equal(table["step"], skew[1])
                        off = pc.if_else(here, off, pa.scalar(0, pa.int32()))
                    moved = pc.add(table["num_computed"], off)
                    table = table.set_column(at, "num_computed", moved)
                if table.num_rows:
                    steps = table["step"]
                    first, last = pc.min(steps).as_py(), pc.max(steps).as_py()
                    w.write_steps(rank, first, last, {name: _columns(table)})
    return out


def _columns(table: pa.Table) -> dict[str, list]:
    return {c: table[c].to_pylist() for c in table.column_names}


def offsets_of(trace: Path) -> dict[int, int | None]:
    return rank_step_offsets(TraceReader(trace).connect())


def test_ranks_recorded_from_one_step_agree(whole: Path, tmp_path: Path) -> None:
    assert offsets_of(whole) == {0: 0, 1: 0}
    trace = record_per_rank(whole, tmp_path / "rec")
    assert offsets_of(trace) == {0: 0, 1: 0}
    info = json.loads(run_cli("info", str(trace), "--json").stdout)
    assert info["rank_step_offsets"] == {"0": 0, "1": 0}
    text = run_cli("info", str(trace)).stdout
    assert "rank steps" in text and "the same engine step on every rank" in text


def test_a_rank_that_began_later_is_offset(whole: Path, tmp_path: Path) -> None:
    trace = record_per_rank(whole, tmp_path / "rec", late={1: 3})
    assert offsets_of(trace) == {0: 0, 1: 3}
    earlier = record_per_rank(whole, tmp_path / "rec0", late={0: 2})
    assert offsets_of(earlier) == {0: 0, 1: -2}
    text = run_cli("info", str(trace)).stdout
    assert "rank 1's step s is rank 0's step s+3" in " ".join(text.split())
    # (the late rank's block tables lack the rows filled before its first step, which a real
    # recording marks unseen: what the replay finds here is not the point, what it says is)
    out = run_cli("replay", str(trace), "--no-save")
    assert out.returncode in (0, 1), out.stderr
    said = " ".join(out.stdout.split())
    assert "began recording at different engine steps" in said
    assert "rank 1's step s is rank 0's step s+3" in said
    page = tmp_path / "report.html"
    run_cli("report", str(trace), "-o", str(page), "--no-bisect")
    assert "rank 1's step s is rank 0's step s+3" in html.unescape(page.read_text())
    log = str(tmp_path / "bisect.json")
    for verb in (("bisect", str(trace), "--log", log), ("history", str(trace), "req-000004")):
        said = " ".join(run_cli(*verb).stdout.split())
        assert "rank 1's step s is rank 0's step s+3" in said, verb
    assert (
        "different engine steps"
        not in run_cli("history", str(trace), "req-000004", "--rank", "1").stdout
    )  # one rank's lines: nothing to align
    aligned = record_per_rank(whole, tmp_path / "al")
    for verb in (
        ("replay", str(aligned), "--no-save"),
        ("bisect", str(aligned), "--log", log),
        ("history", str(aligned), "req-000004"),
    ):  # control: ranks that agree say nothing
        assert "different engine steps" not in run_cli(*verb).stdout, verb


def test_ranks_whose_scheduler_rows_differ_are_not_matched(whole: Path, tmp_path: Path) -> None:
    trace = record_per_rank(whole, tmp_path / "rec", skew=(1, None))
    assert offsets_of(trace) == {0: 0, 1: None}
    text = " ".join(run_cli("info", str(trace)).stdout.split())
    assert "rank 1's scheduler outputs do not line up with rank 0's" in text
    assert "began recording at different engine steps" not in text  # not known here
    # one step that differs where every other step agrees: no offset is claimed either
    once = record_per_rank(whole, tmp_path / "once", late={1: 2}, skew=(1, 40))
    assert offsets_of(once) == {0: 0, 1: None}


def test_one_rank_has_no_offsets(whole: Path, tmp_path: Path) -> None:
    path = tmp_path / "one.trace"
    simulate(SimConfig(steps=40, seed=1, output=path, overwrite=True).validate())
    assert offsets_of(path) == {}
    assert "rank steps" not in run_cli("info", str(path)).stdout
