"""`mgtrace diff` of two traces compares what a replay starts from, not only the steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import mgtrace
from mgtrace.cli import main


@pytest.fixture(scope="module")
def repro(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A buggy trace and its minimized repro, which starts from a stored state."""
    root = tmp_path_factory.mktemp("diff")
    trace = mgtrace.simulate(root / "race.trace", bugs=["async-accepted-race"], steps=300, seed=12)
    trace.minimize(root / "repro")
    assert list((root / "repro" / "start-state").glob("*.npz")), "the control: a start state"
    return root / "race.trace", root / "repro"


def _diff(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_repros_with_the_same_steps_and_different_start_states_differ(
    repro: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two repros of one trace that kept the same steps but start from different states
    replay differently; diff said they "record the same inputs" (exit 0). Control: an
    untouched copy is the same."""
    _, first = repro
    same = shutil.copytree(first, tmp_path / "same")
    assert _diff(first, same, capsys)[0] == 0
    other = shutil.copytree(first, tmp_path / "other")
    (state,) = (other / "start-state").glob("*.npz")
    with np.load(state) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["pool"] = arrays["pool"].copy()
    arrays["pool"][0] ^= 1
    np.savez(state, **arrays)
    code, said = _diff(first, other, capsys)
    assert code == 1 and said["first_step"] is None
    assert said["setup"] == ["start states of rank 0"], said
    assert "their steps record the same inputs" in said["sentence"]


def test_a_trace_and_its_repro_differ_in_the_start_state_too(
    repro: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    trace, first = repro
    code, said = _diff(trace, first, capsys)
    assert code == 1 and "start states (only the second trace carries one)" in said["setup"]


def test_run_metadata_a_replay_uses_is_compared_and_names_are_not(
    repro: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A copy whose manifest says another Mamba block size replays differently (a malformed
    finding early on); diff said "same inputs". Control: the model's name alone changes
    nothing a replay does."""
    trace, _ = repro

    def copy_with(name: str, **run: object) -> Path:
        out = shutil.copytree(trace, tmp_path / name)
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["run"].update(run)
        (out / "manifest.json").write_text(json.dumps(manifest))
        return out

    size = mgtrace.open(trace).run.mamba_block_size
    code, said = _diff(trace, copy_with("block", mamba_block_size=size * 2), capsys)
    assert code == 1
    assert said["setup"] == [f"run metadata (mamba_block_size {size} vs {size * 2})"], said
    code, said = _diff(trace, copy_with("named", model="another/name"), capsys)
    assert code == 0 and said["setup"] == [], said


def test_run_metadata_is_compared_as_a_replay_reads_it(
    repro: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A conv layout left out (read as SD) and fields a replay does not read (an older
    writer's manifest lacks some) made two traces "differ"; a state tensor's shape that
    differed was shown as two identical truncated reprs. Control: the shape, named."""
    trace, _ = repro

    def copy_with(name: str, edit: object) -> Path:
        out = shutil.copytree(trace, tmp_path / name)
        manifest = json.loads((out / "manifest.json").read_text())
        edit(manifest["run"])  # type: ignore[operator]
        (out / "manifest.json").write_text(json.dumps(manifest))
        return out

    def older(run: dict) -> None:
        for state in run["states"]:
            state.pop("conv_layout", None)
        run.pop("row_rule", None)
        run.pop("max_num_batched_tokens", None)

    code, said = _diff(trace, copy_with("older", older), capsys)
    assert code == 0 and said["setup"] == [], said

    def wider(run: dict) -> None:
        run["states"][0]["shape"][0] += 1

    code, said = _diff(trace, copy_with("wider", wider), capsys)
    shape = mgtrace.open(trace).run.states[0].shape
    wide = [shape[0] + 1, *shape[1:]]
    assert code == 1 and said["setup"] == [f"run metadata (states[0].shape {shape} vs {wide})"]
