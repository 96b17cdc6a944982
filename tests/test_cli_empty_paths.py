"""A path no file can have is refused by name: an empty one (an unset shell variable), which
click reads as the current directory, so `-o ""` was refused in words about "." or, for
`demo`, would write there; and one longer than the system takes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from mgtrace.cli import cli
from mgtrace.params import NonEmptyPath
from tests.conftest import run_cli

pytestmark = pytest.mark.unit

SAID = "an empty path names no file or directory"


def _path_params() -> Iterator[tuple[str, click.Parameter]]:
    for name in sorted(cli.list_commands(None)):  # type: ignore[arg-type]
        command = cli.get_command(None, name)  # type: ignore[arg-type]
        assert command is not None
        for param in command.params:
            if isinstance(param.type, click.Path):
                yield f"{name} {param.name}", param


def test_every_path_a_command_takes_refuses_an_empty_one() -> None:
    params = list(_path_params())
    assert len(params) >= 15, [n for n, _ in params]  # the walk finds the commands' paths
    plain = [name for name, param in params if not isinstance(param.type, NonEmptyPath)]
    assert not plain, f"paths that take '' for the current directory: {plain}"


def test_the_type_refuses_only_the_empty_string() -> None:
    path = NonEmptyPath(path_type=Path)
    assert path.convert(" ", None, None) == Path(" ")  # a strange name, but a name
    assert path.convert("run.trace", None, None) == Path("run.trace")
    with pytest.raises(click.BadParameter, match=SAID):
        path.convert("", None, None)
    # control: click's own type reads it as the current directory
    assert click.Path(path_type=Path).convert("", None, None) == Path(".")


@pytest.mark.parametrize(
    "args",
    [
        ("sql", "", "SELECT 1"),
        ("simulate", "--steps", "10", "-o", ""),
        ("demo", "--steps", "100", "-o", ""),
        ("report", "", "-o", "x.html"),
    ],
)
def test_an_empty_path_is_one_sentence(args: tuple[str, ...], tmp_path: Path) -> None:
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2 and SAID in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "option", "said"),
    [
        (["info", "x" * 300], "'TRACE'", "a name in the path is 300 bytes long"),
        (["simulate", "-o", "d/" + "y" * 256], "'-o' / '--output'", "is 256 bytes long"),
        (["sql", "t", "SELECT 1", "-o", "a/" * 2100], "'-o' / '--output'", "4,200 bytes"),
    ],
)
def test_a_path_the_system_would_refuse_by_length_is_refused_by_name(
    argv: list[str], option: str, said: str
) -> None:
    """The system's own words (File name too long) echoed the whole name, named no option,
    and said a trace named so was a usage error in one command and unreadable in another."""
    proc = run_cli(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"invalid value for {option}" in proc.stderr and said in proc.stderr, proc.stderr
    assert "File name too long" not in proc.stderr


def test_names_up_to_the_limit_pass() -> None:
    path = NonEmptyPath(path_type=Path)
    assert path.convert("z" * 255, None, None) == Path("z" * 255)  # the control
