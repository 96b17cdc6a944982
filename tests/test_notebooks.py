"""The triage notebooks run top to bottom on the simulator's default trace; stored clean."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra is not installed")

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _text_outputs(nb) -> str:
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            out.append(o.get("text", ""))
            out.append(str(o.get("data", {}).get("text/plain", "")))
    return "\n".join(out)


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        (
            "triage.ipynb",
            [
                "as recorded: first corrupt step",
                "--reorder-threshold=1+k: clean",
                "history of req-",
            ],
        ),
        (
            "bisect.ipynb",
            ["corruption starts at step", "clean under --reorder-threshold=1+k", "1 passed"],
        ),
    ],
)
def test_notebook_runs(name: str, expect: list[str], tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_before = os.environ.pop("MGTRACE_TRACE", None)
    try:
        nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
        ).execute()
    finally:
        if env_before is not None:
            os.environ["MGTRACE_TRACE"] = env_before
    text = _text_outputs(nb)
    for needle in expect:
        assert needle in text, needle
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    if name == "triage.ipynb":
        assert images >= 4


def _run_triage_on(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "triage.ipynb"
) -> str:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    monkeypatch.setenv("MGTRACE_TRACE", str(trace))
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    return _text_outputs(nb)


def test_triage_of_a_trace_that_replays_clean(tmp_path: Path, monkeypatch) -> None:
    """The "One request" cell indexed the first corrupt step's requests, of which a clean
    replay has none (IndexError). Now it says clean and skips the request cells."""
    import mgtrace

    mgtrace.simulate(tmp_path / "clean.trace", steps=150, seed=0)
    text = _run_triage_on(tmp_path / "clean.trace", tmp_path, monkeypatch)
    assert "as recorded: clean" in text and "no corrupted request to follow: clean" in text
    assert "history of" not in text


def test_triage_of_another_mechanism_says_the_threshold_is_not_it(
    tmp_path: Path, monkeypatch
) -> None:
    """On a trace of another bug the Replay cell printed a bare "still corrupt", which read
    as the fix having failed. Now it says the threshold is not the mechanism and where the
    rule that undoes it is found."""
    import mgtrace

    trace = tmp_path / "race.trace"
    mgtrace.simulate(trace, steps=300, seed=12, bugs=["async-accepted-race"])
    text = _run_triage_on(trace, tmp_path, monkeypatch)
    assert "--reorder-threshold=1+k: still corrupt, so not the threshold mismatch" in text


def test_bisect_notebook_on_a_trace_that_replays_clean(tmp_path: Path, monkeypatch) -> None:
    """The minimize cell raised on a clean recording (nothing to minimize) and the pytest
    cell then failed on its missing result. Now both say there is nothing to minimize."""
    import mgtrace

    mgtrace.simulate(tmp_path / "clean.trace", steps=150, seed=0)
    text = _run_triage_on(tmp_path / "clean.trace", tmp_path, monkeypatch, "bisect.ipynb")
    assert "nothing to minimize: the bisect verdict is clean" in text
    assert "passed" not in text


def test_triage_of_an_imported_probe_log(tmp_path: Path, monkeypatch) -> None:
    """A probe import holds no kernel launches: the Replay cell stopped at the replay's
    refusal (UsageError). Now it says why there is no replay and shows the client labels'
    cross-tab, as `mgtrace report` does."""
    from mgtrace.recorder.probe_import import import_probe
    from tests.test_recorder_unit import _probe_logs

    probe, burst, _ = _probe_logs(tmp_path)
    import_probe(probe, burst, tmp_path / "imp")
    text = _run_triage_on(tmp_path / "imp", tmp_path, monkeypatch)
    assert "no replay: the trace holds no align-kernel launches" in text
    assert "FIRST decode step in Mamba prefill" in text
    assert "no corrupted request to follow: no replay" in text


@pytest.mark.unit
def test_notebooks_are_stored_without_outputs() -> None:
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name
