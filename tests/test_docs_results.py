"""Every result file docs/performance.md names exists: a number there is only as good as
the file that records how it was measured."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RESULT_NAME = re.compile(r"`([^`\s]+(?:\.json|\.txt|\.md|/))`")


def missing_results(text: str) -> list[str]:
    """The result files and folders ``text`` names in backticks (``*`` allowed) that match
    nothing: relative to benchmarks/results, or to the repository when they start there."""
    missing = []
    for name in sorted(set(RESULT_NAME.findall(text))):
        base = ROOT if name.startswith("benchmarks/") else RESULTS
        if not any(base.glob(name.rstrip("/"))):
            missing.append(name)
    return missing


def test_the_performance_doc_names_only_results_that_exist() -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    assert len(RESULT_NAME.findall(text)) > 20  # it does name its files this way
    assert missing_results(text) == []


def test_a_result_that_is_not_there_is_named() -> None:
    text = "measured in `h100-8640eea/` and `sim-vm-never-run.json`, see `benchmarks/none.sh/`"
    assert missing_results(text) == ["benchmarks/none.sh/", "sim-vm-never-run.json"]
