"""The command line on the CPU never imports torch or triton (seconds at every start), and
the commands that only write or query a trace never import pandas (pyarrow would, 0.3 s).

Each probe runs real commands in a fresh interpreter, in process, and reports which heavy
modules they left in ``sys.modules``; the controls import them on purpose and must be seen.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HEAVY = ("torch", "triton", "pandas")

PROBE = """
import contextlib, io, json, sys
from mgtrace.cli import main
if sys.argv[1] == "control":
    import torch  # noqa: F401
    import pandas  # noqa: F401
for command in json.loads(sys.argv[2]):
    sys.argv = ["mgtrace", *command]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main()
        except SystemExit as exc:
            code = exc.code
    if code not in (0, 1):
        raise SystemExit(f"{command[0]} exited {code}")
print(json.dumps([m for m in {heavy} if m in sys.modules]))
""".replace("{heavy}", repr(HEAVY))


def _heavy_modules_after(commands: list[list[str]], *, control: bool = False) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "control" if control else "plain", json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def buggy_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("startup") / "t"
    from mgtrace.sim import SimConfig, simulate

    simulate(
        SimConfig(
            scenario="pairs", steps=160, seed=1, bugs=("reorder-threshold-mismatch",), output=out
        )
    )
    return out


def test_cpu_commands_never_import_torch_or_triton(buggy_trace: Path, tmp_path: Path) -> None:
    trace = str(buggy_trace)
    commands = [
        ["--help"],
        ["simulate", "--steps", "40", "-o", str(tmp_path / "s")],
        ["info", trace],
        ["replay", trace],
        ["replay", trace, "--reorder-threshold=1+k"],
        ["bisect", trace],
        ["diff", trace, "--rules-b", "reorder_threshold=1+k"],
        ["sql", trace, "SELECT count(*) FROM findings"],
    ]
    assert _heavy_modules_after(commands) == []


def test_writing_querying_and_replaying_commands_never_import_pandas(
    buggy_trace: Path, tmp_path: Path
):
    trace = str(buggy_trace)
    commands = [
        ["simulate", "--steps", "40", "-o", str(tmp_path / "s")],
        ["info", trace],
        ["sql", trace, "SELECT count(*) FROM batch_rows"],
        ["history", trace, "req-000002"],
        ["replay", trace, "--no-save"],
        ["bisect", trace],
        ["minimize", trace, "-o", str(tmp_path / "m")],
    ]
    assert _heavy_modules_after(commands) == []


def test_pyarrow_still_loads_pandas_when_asked_after_the_command_line_ran(tmp_path: Path):
    script = (
        "import sys; from mgtrace.cli import main; import pyarrow as pa\n"
        "main(['--version'])\n"
        "assert 'pandas' not in sys.modules\n"
        "print(type(pa.table({'a': [1, 2]}).to_pandas()).__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "DataFrame"


def test_the_probe_sees_torch_when_it_is_imported(buggy_trace: Path) -> None:
    # control: the same probe, the same command, torch imported on purpose
    seen = _heavy_modules_after([["info", str(buggy_trace)]], control=True)
    assert "torch" in seen and "pandas" in seen


def test_ctrl_c_while_the_command_line_starts_is_an_interruption(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in the first moments of any command (while the pandas probe is set up) gave a
    traceback instead of exit 130."""
    from mgtrace import cli, pandas_probe

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pandas_probe, "skip_pandas_probe", interrupted)
    try:
        code = cli.main(["--help"])
    except KeyboardInterrupt:
        pytest.fail("the interruption escaped main as a traceback")
    assert code == 130
    assert capsys.readouterr().err == "mgtrace: interrupted\n"
