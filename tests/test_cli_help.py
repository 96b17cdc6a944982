"""Every command's --help says what its exit codes mean, and only codes the README lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from mgtrace.cli import cli

pytestmark = pytest.mark.unit

# a number standing alone: not part of a name, a version or a duration
CODE = re.compile(r"(?<![\w.-])(\d{1,3})(?![\w.-]|\s*(?:s|steps)\b)")
README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_codes() -> set[int]:
    table = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(c) for c in re.findall(r"^\| ([\d, ]+) \|", table, re.M) for c in c.split(",")}


def _help(name: str) -> str:
    result = CliRunner().invoke(cli, [name, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize("name", sorted(cli.list_commands(None)))  # type: ignore[arg-type]
def test_every_command_help_names_its_exit_codes(name: str) -> None:
    text = _help(name)
    said = re.search(r"Exit (?:codes: )?(.*?)(?:Options:|$)", text)
    assert said, f"mgtrace {name} --help says nothing of its exit codes"
    codes = {int(c) for c in re.findall(CODE, said.group(1))}
    assert codes, said.group(1)
    assert codes <= _readme_codes(), f"{name}: {sorted(codes - _readme_codes())} not in README"


def test_the_readme_table_is_read() -> None:
    # the control: the parser above finds every code of the README's table
    assert _readme_codes() == {0, 1, 2, 3, 70, 125, 129, 130, 143}


def test_the_interrupted_row_says_what_is_kept() -> None:
    """The 130 row said "nothing half-written is left" of every command, but simulate keeps
    the steps it wrote as a trace marked incomplete (test_sim_cli checks that it does), and
    record keeps its trace. The row, and simulate's --help, say so."""
    table = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in table.splitlines() if line.startswith("| 130 |"))
    assert "simulate" in row and "incomplete" in row and "record" in row, row
    assert "nothing half-written is left" not in row, row
    said = _help("simulate").split("Exit codes:", 1)[1]
    assert "130 interrupted" in said and "incomplete" in said, said


def test_the_top_level_help_names_every_exit_code() -> None:
    """mgtrace --help listed 0-3, 125 and 70 only; Ctrl-C (130) and SIGTERM/SIGHUP
    (143/129) were missing although every long command exits with them."""
    result = CliRunner().invoke(cli, ["--help"], terminal_width=200)
    said = " ".join(result.output.split()).split("Exit codes:", 1)[1].split("Options:", 1)[0]
    assert {int(c) for c in re.findall(CODE, said)} == _readme_codes(), said


def test_simulate_help_says_the_output_is_required() -> None:
    assert "Trace directory to write (required)." in _help("simulate")
