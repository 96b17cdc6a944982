"""`mgtrace report` on a trace with a damaged part says what to type, as every other verb."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.unit


def test_report_of_a_trace_with_a_missing_rank_part_names_the_command_line_flag(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "pp2.trace"
    cfg = SimConfig(steps=60, runner="v2", pp=2, seed=0, output=trace)
    simulate(cfg.validate())
    parts = json.loads((trace / "manifest.json").read_text())["parts"]
    rel = next(p["path"] for p in parts if p["table"] == "launches" and p.get("rank") == 1)
    (trace / rel).unlink()
    # the control: the other verbs name the flag
    info = assert_one_sentence_error(run_cli("info", str(trace)), 3)
    assert "pass --skip-bad-parts to read the rest" in info
    out = tmp_path / "r.html"
    err = assert_one_sentence_error(run_cli("report", str(trace), "-o", str(out)), 3)
    assert rel in err
    assert "--skip-bad-parts" in err and "skip_bad_parts=True" not in err, err
    assert not out.exists()
