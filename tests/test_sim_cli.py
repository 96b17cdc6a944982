"""``mgtrace simulate``: writes a trace, reports the injected bugs, refuses bad values."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mgtrace.errors import MgtraceError, UsageError
from mgtrace.sim.cli import simulate
from tests.conftest import run_cli

pytestmark = pytest.mark.unit


def _invoke(*args: str):
    return CliRunner().invoke(simulate, list(args), standalone_mode=False, catch_exceptions=True)


def test_simulate_writes_a_trace_with_ground_truth(tmp_path: Path) -> None:
    out = tmp_path / "t"
    res = _invoke(
        "--scenario",
        "mixed",
        "--steps",
        "120",
        "--seed",
        "2",
        "--bug",
        "reorder-threshold-mismatch",
        "-o",
        str(out),
    )
    assert res.exception is None, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["source"]["config"]["seed"] == 2
    truth = manifest["ground_truth"]["bugs"]["reorder-threshold-mismatch"]
    assert truth["first_step"] is not None and truth["affected_requests"]
    n = len(truth["affected_requests"])
    said = res.output + (res.stderr if hasattr(res, "stderr") else "")
    assert f"first corrupts step {truth['first_step']}, {n} request" in said
    assert f", {n} requests affected" in said if n != 1 else ", 1 request affected" in said


@pytest.mark.parametrize(
    "args",
    [
        ("--scenario", "bursty"),
        ("--runner", "v9"),
        ("--bug", "no-such-bug"),
        ("--bug", "batch-row-block-table", "--runner", "v2"),
        ("--steps", "0"),
        ("--k", "-1"),
        ("--pp", "2"),
    ],
)
def test_bad_values_are_one_usage_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    res = _invoke(*args, "-o", str(tmp_path / "t"))
    assert isinstance(res.exception, UsageError), res.exception
    assert "\n" not in res.exception.message
    assert not (tmp_path / "t").exists()


def test_missing_output_and_existing_output(tmp_path: Path) -> None:
    res = _invoke("--steps", "5")
    assert isinstance(res.exception, UsageError)
    out = tmp_path / "t"
    assert _invoke("--steps", "5", "--scenario", "steady", "-o", str(out)).exception is None
    again = _invoke("--steps", "5", "-o", str(out))
    assert isinstance(again.exception, MgtraceError) and "--force" in again.exception.message
    assert _invoke("--steps", "5", "-o", str(out), "--force").exception is None


def test_command_is_a_click_command() -> None:
    assert isinstance(simulate, click.Command) and simulate.name == "simulate"


def test_interrupted_run_leaves_a_readable_trace_that_says_so(tmp_path: Path) -> None:
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim import SimConfig
    from mgtrace.sim.engine import simulate as run_simulation

    def stop(step: int, view: object) -> None:
        if step == 30:
            raise KeyboardInterrupt

    out = tmp_path / "t"
    with pytest.raises(KeyboardInterrupt):
        run_simulation(SimConfig(scenario="steady", steps=100, output=out), observe=stop)
    reader = TraceReader(out)
    assert reader.rows("steps") == 31
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["interrupted_at_step"] == 30 and "interrupted" in manifest["errors"]
    # an interrupted run is not whole: the replay calls it inconclusive, never clean
    assert manifest["complete"] is False and not reader.complete
    assert run_cli("replay", str(out)).returncode == 125
