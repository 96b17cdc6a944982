"""A bad command line is said as every other error: one line, `mgtrace: error: ...`, exit
2, naming where the options are listed. click's own four lines (usage, hint, a blank line,
`Error: ...`) said it in another form than the errors mgtrace finds itself."""

from __future__ import annotations

import pytest

from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["replay", "t", "--zzz"],
            "no such option '--zzz' (see mgtrace replay --help)",
        ),
        (["replay", "t", "--no-sav"], "no such option '--no-sav'. Did you mean '--no-save'?"),
        (
            ["replay", "t", "--rank", "-1"],
            "invalid value for '--rank': -1 is not in the range x>=0",
        ),
        (["replay", "t", "--backend", "gpu"], "'gpu' is not one of 'reference', 'triton'"),
        (["history"], "missing argument 'TRACE' (see mgtrace history --help)"),
        (["simulate", "--steps", "many"], "'many' is not a valid integer"),
        (["replay", "t", "--jobs"], "option '--jobs' requires an argument"),
        (["simulat"], "no such command 'simulat' (see mgtrace --help)"),
    ],
)
def test_a_bad_command_line_is_one_sentence(argv: list[str], said: str) -> None:
    assert said in assert_one_sentence_error(run_cli(*argv), 2)


def test_help_is_still_shown_where_asked_for() -> None:
    """The control: no arguments, and -h, print the help as before."""
    bare = run_cli()
    assert bare.stderr.startswith("Usage: mgtrace [OPTIONS] COMMAND") and "Commands:" in bare.stderr
    asked = run_cli("replay", "-h")
    assert asked.returncode == 0 and asked.stdout.startswith("Usage: mgtrace replay")


def test_python_m_mgtrace_sim_names_its_own_help() -> None:
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "mgtrace.sim", "--pp", "x"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    err = assert_one_sentence_error(proc, 2)
    assert "(see python -m mgtrace.sim --help)" in err, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["replay", "t", "--jobs"],
            "option '--jobs' requires an argument (see mgtrace replay --help)",
        ),
        (
            ["info", "t", "--json=yes"],
            "option '--json' does not take a value (see mgtrace info --help)",
        ),
    ],
)
def test_an_options_missing_or_extra_value_names_the_commands_help(
    argv: list[str], said: str
) -> None:
    """click gives these errors no command: the line still names where the options are
    listed, as every other bad command line does."""
    assert said in assert_one_sentence_error(run_cli(*argv), 2)
