"""A reader that goes away (`| head`, a closed pipe) ends the output, not the verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.conftest import REPO


@pytest.fixture(scope="module")
def corrupt_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipes") / "run.trace"
    cfg = SimConfig(
        scenario="pairs", steps=40, seed=0, bugs=("reorder-threshold-mismatch",), output=path
    )
    simulate(cfg.validate())
    return path


def _exit_with_closed_stdout(*args: str) -> tuple[int, str]:
    """Run the CLI with its stdout a pipe nobody reads: the first write fails."""
    argv = [sys.executable, "-m", "mgtrace", *args]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command prints anything
    err = proc.stderr.read().decode()
    return proc.wait(120), err


@pytest.mark.parametrize("command", ["replay", "bisect"])
def test_a_corrupt_verdict_survives_a_closed_pipe(corrupt_trace: Path, command: str) -> None:
    """Exit 1 (corruption) once became 0 when the reader went away. Control: the same
    command read to the end exits 1."""
    extra = (
        ["--no-save"] if command == "replay" else ["--log", str(corrupt_trace.parent / "b.json")]
    )
    code, err = _exit_with_closed_stdout(command, str(corrupt_trace), *extra)
    assert code == 1 and "Traceback" not in err, (code, err)
    whole = subprocess.run(
        [sys.executable, "-m", "mgtrace", command, str(corrupt_trace), *extra],
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert whole.returncode == 1
