"""Random engine shapes against the simulator's ground truth (``tests/acceptance_fuzz.py``):
a fixed, seeded sample here; longer sweeps from the command line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mgtrace.replayer.loop import RankReplay
from mgtrace.replayer.steps import RankTrace
from mgtrace.sim.config import BUG_BATCH_ROW, BUG_REORDER
from tests.acceptance_fuzz import Case, check, random_case
from tests.replay_helpers import (
    BOUNDARY_ONLY,
    BOUNDARY_ONLY_BUG,
    BOUNDARY_ONLY_SEED,
    BOUNDARY_ONLY_STEPS,
    TOGGLES,
)

pytestmark = pytest.mark.slow

CASES = [random_case(random.Random(9000 + i)) for i in range(10)]
# GDN models: their builder splits by a mask, and runs spec decodes first
CASES += [random_case(random.Random(9100 + i), "gdn") for i in range(3)]


def _label(case: Case) -> str:
    gdn = "-gdn" if case.engine.get("mixer") == "gdn" else ""
    return ("+".join(case.bugs) or f"clean-{case.engine['runner']}") + gdn


@pytest.mark.parametrize("case", CASES, ids=[_label(c) for c in CASES])
def test_random_engine_shapes_agree_with_the_ground_truth(case: Case, tmp_path: Path) -> None:
    assert check(case, tmp_path / "trace") == []


def test_the_sample_has_clean_single_and_combined_toggles() -> None:
    sizes = {min(len(c.bugs), 2) for c in CASES}
    assert sizes == {0, 1, 2}
    assert {c.engine["prefill_checkpoints"] for c in CASES} == {False, True}
    assert {c.engine.get("mixer", "mamba2") for c in CASES} == {"mamba2", "gdn"}


def test_control_a_check_turned_off_is_caught_as_a_late_first_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    case = Case(
        bugs=(BOUNDARY_ONLY_BUG,),
        seed=BOUNDARY_ONLY_SEED,
        steps=BOUNDARY_ONLY_STEPS,
        engine=BOUNDARY_ONLY,
    )
    assert check(case, tmp_path / "on") == []
    monkeypatch.setattr(RankReplay, "_check_cached_state", lambda *args: None)
    problems = check(case, tmp_path / "off")
    assert problems and "injected at 13" in problems[0]


@pytest.mark.parametrize("bug", [BUG_REORDER, BUG_BATCH_ROW])
def test_a_clean_twin_under_the_bugs_rule_finds_what_the_bug_injected(
    bug: str, tmp_path: Path
) -> None:
    case = Case(bugs=(bug,), seed=0, steps=600, engine=dict(TOGGLES[bug][0]))
    assert check(case, tmp_path / "trace") == []
    assert (tmp_path / "trace-twin").is_dir()  # the twin was simulated and replayed


def test_control_reordering_the_recorded_rows_again_misses_what_the_twin_must_find(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """V1's rows rebuilt from the trace's adds and removes are what make the twin find the
    bug; reordering each recorded (already reordered) batch again instead is caught."""
    case = Case(bugs=(BUG_REORDER,), seed=0, steps=600, engine=dict(TOGGLES[BUG_REORDER][0]))
    monkeypatch.setattr(RankTrace, "persistent_order", lambda self, step, threshold: None)
    problems = check(case, tmp_path / "trace")
    assert problems and problems[0].startswith("the clean twin under reorder_threshold=1")
