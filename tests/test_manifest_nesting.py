"""A manifest.json nested too deeply is an unreadable trace, not an internal error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_one_sentence_error, run_cli


@pytest.mark.parametrize("verb", [["info"], ["sql", "--list"], ["replay", "--no-save"]])
def test_a_deeply_nested_manifest_is_exit_3(fresh_trace: Path, verb: list[str]) -> None:
    """'[' * 200000 as manifest.json raised RecursionError in json.loads: exit 70."""
    (fresh_trace / "manifest.json").write_text("[" * 200_000)
    proc = run_cli(verb[0], str(fresh_trace), *verb[1:])
    err = assert_one_sentence_error(proc, 3)
    assert "manifest.json" in err, err
