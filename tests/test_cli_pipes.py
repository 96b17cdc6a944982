"""A reader that goes away (`| head`, a closed pipe) ends the output, not the verdict."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mgtrace.sim.config import BUG_REORDER, SimConfig
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


def _mgtrace(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI of this checkout, run in ``cwd`` as a user would there."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "mgtrace", *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _printed(text: str, label: str) -> list[str]:
    """The command printed after ``label``, split as a shell splits it."""
    line = next(ln for ln in text.splitlines() if label in ln)
    words = shlex.split(line.split(label, 1)[1].rstrip(")"))
    return words[1:] if words[0] == "mgtrace" else words


@pytest.mark.parametrize("name", ["my runs/b 1", "-x"])
def test_printed_commands_run_as_printed(tmp_path: Path, name: str) -> None:
    """The "next:", "bad:", "re-check with:" and "run:" commands once printed paths bare: one
    with a space split into two words, and a relative one starting with '-' (whose './'
    pathlib drops) read as an option. Each printed command, pasted into a shell, runs."""
    (tmp_path / "my runs").mkdir()
    trace = f"./{name}"
    sim = _mgtrace(tmp_path, "simulate", "--steps", "100", "--bug", BUG_REORDER, "-o", trace)
    assert sim.returncode == 0, sim.stderr
    info = _mgtrace(tmp_path, *_printed(sim.stderr, "next:"))
    assert info.returncode == 0 and "100" in info.stdout, info.stdout + info.stderr
    replay = _mgtrace(tmp_path, "replay", trace)
    assert replay.returncode == 1, replay.stderr
    sql = _mgtrace(tmp_path, *_printed(replay.stdout, "next:"))
    assert sql.returncode == 0 and "wrong_tokens" in sql.stdout, sql.stdout + sql.stderr
    bisect = _mgtrace(tmp_path, "bisect", trace)
    assert bisect.returncode == 1, bisect.stderr
    for label in ("bad:", "re-check with:"):
        again = _mgtrace(tmp_path, *_printed(bisect.stdout, label))
        assert again.returncode == 1, (label, again.stdout + again.stderr)
    history = _mgtrace(tmp_path, "history", trace, "000002", "--rules", "reorder_threshold=1+k")
    fixed = _mgtrace(tmp_path, *_printed(history.stdout, "run:"))
    assert fixed.returncode == 0 and "clean" in fixed.stdout, fixed.stdout + fixed.stderr
    mini = _mgtrace(tmp_path, "minimize", trace, "-o", f"./{name}-repro")
    assert mini.returncode == 0, mini.stderr
    words = _printed(mini.stdout, "next:")
    assert words[:3] == ["python", "-m", "pytest"] and (tmp_path / words[3]).is_file(), words
