"""Counts past any run one waits for are refused by their option, in one sentence, before
anything runs (as ``simulate --steps`` is)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "option", "bound"),
    [
        (["demo", "--steps", str(10**30)], "--steps", "100<=x<=1000000000"),
        (["demo", "--steps", "99"], "--steps", "100<=x<=1000000000"),
        (["check-kernels", "--cases", str(10**30)], "--cases", "1<=x<=1000000000"),
    ],
)
def test_a_count_out_of_range_is_refused_by_name(argv: list[str], option: str, bound: str) -> None:
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"invalid value for '{option}'" in proc.stderr and bound in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
