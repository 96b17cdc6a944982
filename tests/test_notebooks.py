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


@pytest.mark.unit
def test_notebooks_are_stored_without_outputs() -> None:
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name
