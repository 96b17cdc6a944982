"""``mgtrace simulate``: writes a trace, reports the injected bugs, refuses bad values."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mgtrace.errors import MgtraceError, UsageError
from mgtrace.sim.cli import simulate
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.unit


def _invoke(*args: str):
    return CliRunner().invoke(simulate, list(args), standalone_mode=False, catch_exceptions=True)


def test_simulate_writes_a_trace_with_ground_truth(tmp_path: Path) -> None:
    out = tmp_path / "t"
    res = _invoke(
        "--scenario",
        "mixed",
        "--steps",
        "120",
        "--seed",
        "2",
        "--bug",
        "reorder-threshold-mismatch",
        "-o",
        str(out),
    )
    assert res.exception is None, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["source"]["config"]["seed"] == 2
    truth = manifest["ground_truth"]["bugs"]["reorder-threshold-mismatch"]
    assert truth["first_step"] is not None and truth["affected_requests"]
    n = len(truth["affected_requests"])
    said = res.output + (res.stderr if hasattr(res, "stderr") else "")
    assert f"first corrupts step {truth['first_step']}, {n} request" in said
    assert f", {n} requests affected" in said if n != 1 else ", 1 request affected" in said


@pytest.mark.parametrize(
    "args",
    [
        ("--scenario", "bursty"),
        ("--runner", "v9"),
        ("--bug", "no-such-bug"),
        ("--bug", "batch-row-block-table", "--runner", "v2"),
        ("--steps", "0"),
        ("--k", "-1"),
        ("--pp", "2"),
        ("--seed", "-1"),
        ("--num-blocks", "99999999999"),
        # more than a manifest may hold: the trace was written, then unreadable
        ("--block-size", "2000000", "--max-num-batched-tokens", "2000000"),
        ("--max-num-batched-tokens", "3000000000"),
    ],
)
def test_bad_values_are_one_usage_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    res = _invoke(*args, "-o", str(tmp_path / "t"))
    assert isinstance(res.exception, UsageError), res.exception
    assert "\n" not in res.exception.message
    assert not (tmp_path / "t").exists()


def test_an_output_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    """No directories are made, or left behind, for an output. Control: its parent made."""
    out = tmp_path / "no" / "such" / "t"
    res = _invoke("--steps", "5", "-o", str(out))
    assert isinstance(res.exception, MgtraceError) and res.exception.exit_code == 2
    assert res.exception.message == f"the directory {out.parent} does not exist"
    assert not (tmp_path / "no").exists()
    out.parent.mkdir(parents=True)
    assert _invoke("--steps", "5", "-o", str(out)).exception is None


def test_an_output_no_file_can_be_created_in_is_refused_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent that is a file read as "the directory does not exist"; /proc, whose bits let
    root pass, failed only after the whole simulation."""
    import mgtrace.sim.cli as mod

    ran: list[object] = []
    monkeypatch.setattr(mod, "run_simulation", lambda cfg, **kw: ran.append(cfg))
    (tmp_path / "afile").write_text("x")
    cases = [(tmp_path / "afile" / "t", "is not a directory")]
    if Path("/proc/self").is_dir():
        cases.append((Path("/proc/t"), "no file can be created in /proc"))
    for out, words in cases:
        res = _invoke("--steps", "5", "-o", str(out))
        assert isinstance(res.exception, MgtraceError), res.exception
        assert words in res.exception.message and res.exception.exit_code == 2
    assert ran == []


def test_python_m_mgtrace_sim_keeps_the_error_contract(tmp_path: Path) -> None:
    """An error of the output path (a name too long) was a traceback there; `mgtrace
    simulate` said it in one sentence. Control: the same commands through mgtrace."""
    import subprocess
    import sys

    from tests.conftest import REPO, assert_one_sentence_error

    def module(out: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mgtrace.sim", "--steps", "5", "-o", out],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )

    # a name longer than the system takes: refused by its option, as click refuses a value
    too_long = str(tmp_path / ("a" * 300))
    for proc in (module(too_long), run_cli("simulate", "--steps", "5", "-o", too_long)):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "invalid value for '-o' / '--output'" in proc.stderr, proc.stderr
        assert "300 bytes long" in proc.stderr, proc.stderr
    # a folder no file can be made in: one sentence from mgtrace's own error path
    unwritable = "/proc/mgtrace-no-such/t"
    assert "cannot write" in assert_one_sentence_error(module(unwritable), 2)
    assert "cannot write" in assert_one_sentence_error(
        run_cli("simulate", "--steps", "5", "-o", unwritable), 2
    )


def test_missing_output_and_existing_output(tmp_path: Path) -> None:
    res = _invoke("--steps", "5")
    assert isinstance(res.exception, UsageError)
    out = tmp_path / "t"
    assert _invoke("--steps", "5", "--scenario", "steady", "-o", str(out)).exception is None
    again = _invoke("--steps", "5", "-o", str(out))
    assert isinstance(again.exception, MgtraceError) and "--force" in again.exception.message
    assert _invoke("--steps", "5", "-o", str(out), "--force").exception is None


def test_command_is_a_click_command() -> None:
    assert isinstance(simulate, click.Command) and simulate.name == "simulate"


def test_interrupted_run_leaves_a_readable_trace_that_says_so(tmp_path: Path) -> None:
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim import SimConfig
    from mgtrace.sim.engine import simulate as run_simulation

    def stop(step: int, view: object) -> None:
        if step == 30:
            raise KeyboardInterrupt

    out = tmp_path / "t"
    with pytest.raises(KeyboardInterrupt):
        run_simulation(SimConfig(scenario="steady", steps=100, output=out), observe=stop)
    reader = TraceReader(out)
    assert reader.rows("steps") == 31
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["interrupted_at_step"] == 30 and "interrupted" in manifest["errors"]
    # an interrupted run is not whole: the replay calls it inconclusive, never clean
    assert manifest["complete"] is False and not reader.complete
    assert run_cli("replay", str(out)).returncode == 125


def test_a_too_small_pool_names_the_option_and_its_minimum(tmp_path: Path) -> None:
    """The sentence once named the internal field (num_blocks) and no minimum. Control: the
    minimum it names runs."""
    res = _invoke("--steps", "5", "--k", "3", "--num-blocks", "2", "-o", str(tmp_path / "t"))
    assert isinstance(res.exception, UsageError)
    msg = res.exception.message
    assert "--num-blocks (2)" in msg and "at least 11" in msg, msg
    ok = _invoke("--steps", "5", "--k", "3", "--num-blocks", "11", "-o", str(tmp_path / "t"))
    assert ok.exception is None
    res = _invoke("--steps", "5", "--max-num-seqs", "0", "-o", str(tmp_path / "u"))
    assert isinstance(res.exception, UsageError) and "--max-num-seqs" in res.exception.message


def test_force_has_a_short_form(tmp_path: Path) -> None:
    out = tmp_path / "t"
    assert _invoke("--steps", "5", "-o", str(out)).exception is None
    assert _invoke("--steps", "5", "-o", str(out), "-f").exception is None


def test_demo_refuses_an_existing_output_before_printing_anything(tmp_path: Path) -> None:
    """The demo printed its first banner and engine line, then refused. Control: with -f the
    same output is replaced (the refusal is the only difference)."""
    from mgtrace.demo import demo

    out = tmp_path / "d"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    res = CliRunner().invoke(demo, ["-o", str(out), "--steps", "100"], standalone_mode=False)
    assert isinstance(res.exception, MgtraceError) and "--force" in res.exception.message
    assert res.output == ""
    res = CliRunner().invoke(demo, ["-o", str(out), "--steps", "100", "-f"], standalone_mode=False)
    assert (
        isinstance(res.exception, MgtraceError) and "not an mgtrace trace" in res.exception.message
    )
    assert res.output == "" and (out / "notes.txt").read_text() == "mine"


def test_demo_makes_no_folder_for_its_output(tmp_path: Path) -> None:
    """`demo -o a/b/trace` made the missing folders a and b, where simulate (and every -o
    but record's) refuses. Control: the folder made, the demo writes its trace."""
    from mgtrace.demo import demo

    out = tmp_path / "no" / "such" / "d"
    res = CliRunner().invoke(demo, ["-o", str(out), "--steps", "100"], standalone_mode=False)
    assert isinstance(res.exception, MgtraceError) and res.exception.exit_code == 2
    assert res.exception.message == f"the directory {out.parent} does not exist"
    assert res.output == "" and not (tmp_path / "no").exists()
    out.parent.mkdir(parents=True)
    res = CliRunner().invoke(demo, ["-o", str(out), "--steps", "100"], standalone_mode=False)
    assert res.exception is None and (out / "manifest.json").is_file()


def test_simulate_prints_a_path_with_brackets_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "wrote" line went through rich markup: "s[bold]x" was printed as "sx". A
    relative path keeps the line short enough not to wrap."""
    monkeypatch.chdir(tmp_path)
    res = _invoke("--steps", "5", "-o", "s[bold]x")
    assert res.exception is None, res.output
    assert "wrote s[bold]x (5 steps" in res.output + getattr(res, "stderr", "")


def test_demo_prints_a_path_with_brackets_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "wrote" line went through rich markup: "d[bold]x" was printed as "dx"."""
    from mgtrace.demo import demo

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(demo, ["-o", "d[bold]x", "--steps", "100"], standalone_mode=False)
    assert res.exception is None, res.output
    assert "wrote d[bold]x: 100 steps" in res.output


def _listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones included) with a file's bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def test_force_keeps_the_old_trace_when_the_new_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-f once removed the old trace before the first step: a run that was then interrupted,
    or met a full disk, left the user neither trace. Now the old one stays as it was and
    nothing else is left. Control: a run that ends replaces it."""
    from mgtrace.errors import OutputError
    from mgtrace.schemas import writer as writer_module
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim import SimConfig
    from mgtrace.sim.engine import simulate as run_simulation

    out = tmp_path / "t"
    assert _invoke("--steps", "40", "--scenario", "steady", "-o", str(out)).exception is None
    before = _listing(tmp_path)

    def stop(step: int, view: object) -> None:
        if step == 30:
            raise KeyboardInterrupt

    cfg = SimConfig(scenario="steady", steps=100, seed=1, output=out, overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        run_simulation(cfg, observe=stop)
    assert _listing(tmp_path) == before

    def full_disk(self: object, rel: str, table: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer_module.TraceWriter, "_write_part", full_disk)
        res = _invoke("--steps", "100", "--seed", "1", "-o", str(out), "-f")
    assert isinstance(res.exception, OutputError), res.output
    assert f"the old trace at {out} was kept" in res.exception.message
    assert _listing(tmp_path) == before
    assert TraceReader(out).rows("steps") == 40 and TraceReader(out).complete

    assert _invoke("--steps", "50", "-o", str(out), "-f").exception is None  # control
    assert TraceReader(out).rows("steps") == 50
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_a_full_disk_is_said_once_by_the_trace_s_name_and_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk that refused a part was said twice (the writer thread's line, then the error),
    by the hidden folder a replacement was built in, and the simulation ran on to its last
    step for nothing. Now one error names the part under the trace's own path, and the run
    stops at its next look at the writer."""
    import logging

    from mgtrace.errors import OutputError
    from mgtrace.schemas import writer as writer_module
    from mgtrace.sim import SimConfig
    from mgtrace.sim import engine as engine_module

    out = tmp_path / "t"
    assert _invoke("--steps", "40", "--scenario", "steady", "-o", str(out)).exception is None
    real_write = writer_module.atomic_write

    def full_disk(path: Path, write: object) -> None:
        def refuse(fh: object) -> None:
            raise OSError(28, "No space left on device")

        real_write(path, refuse if str(path).endswith(".parquet") else write)

    class PromptWriter(writer_module.TraceWriter):  # writes a part within milliseconds
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, flush_seconds=0.01, **kwargs)  # type: ignore[arg-type]

    seen: list[int] = []
    cfg = SimConfig(scenario="steady", steps=6000, seed=1, output=out, overwrite=True)
    with monkeypatch.context() as m, caplog.at_level(logging.ERROR):
        m.setattr(writer_module, "atomic_write", full_disk)
        m.setattr(engine_module, "TraceWriter", PromptWriter)
        with pytest.raises(OutputError) as err:
            engine_module.simulate(cfg, observe=lambda step, view: seen.append(step))
    assert err.value.message.startswith(f"cannot write {out}/"), err.value.message
    assert err.value.message.endswith(f"the old trace at {out} was kept"), err.value.message
    assert not [r for r in caplog.records if r.name == "mgtrace.writer"], caplog.records
    assert len(seen) < cfg.steps  # stopped early
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_a_killed_forced_run_leaves_the_old_trace_and_the_next_run_works(
    tmp_path: Path,
) -> None:
    """A process killed part-way through -f left a partial new trace where the old one had
    been. Now the old one is there, whole; the next -f run is not disturbed by what the
    killed one left, and tidies it."""
    import subprocess
    import sys

    from mgtrace.schemas.reader import TraceReader
    from tests.conftest import REPO

    out = tmp_path / "t"
    assert _invoke("--steps", "40", "--scenario", "steady", "-o", str(out)).exception is None
    script = (
        "import os, sys\n"
        "from mgtrace.sim import SimConfig\n"
        "from mgtrace.sim.engine import simulate\n"
        "def die(step, view):\n"
        "    if step == 200:\n"
        "        os._exit(9)\n"
        "simulate(SimConfig(steps=400, output=sys.argv[1], overwrite=True), observe=die,"
        " steps_per_write=0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=REPO, timeout=300)
    assert proc.returncode == 9
    reader = TraceReader(out)
    assert reader.rows("steps") == 40 and reader.complete
    assert any(p.name.startswith(".t.") for p in tmp_path.iterdir())  # what it left
    assert _invoke("--steps", "50", "-o", str(out), "-f").exception is None
    assert TraceReader(out).rows("steps") == 50
    assert [p.name for p in tmp_path.iterdir()] == ["t"]


def test_demo_force_keeps_the_old_trace_when_the_simulation_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """demo -f writes its trace as simulate -f does: a simulation that fails part-way
    leaves the old trace as it was."""
    from mgtrace.demo import demo
    from mgtrace.sim import engine as engine_module

    out = tmp_path / "d"
    assert _invoke("--steps", "40", "--scenario", "steady", "-o", str(out)).exception is None
    before = _listing(tmp_path)
    real_step = engine_module.Engine.step

    def failing(self: object, step: int) -> object:
        if step == 50:
            raise RuntimeError("a simulator bug")
        return real_step(self, step)

    monkeypatch.setattr(engine_module.Engine, "step", failing)
    res = CliRunner().invoke(demo, ["-o", str(out), "--steps", "100", "-f"], standalone_mode=False)
    assert isinstance(res.exception, RuntimeError)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("inside", [".", "steps/.."])
def test_force_over_the_trace_named_by_dot_or_dotdot_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inside: str
) -> None:
    """`-o . --force` from inside a trace was an internal error (exit 70: "PosixPath('.')
    has an empty name"), and `-o TRACE/steps/.. --force` was refused with "Device or
    resource busy": both name an existing trace, which --force replaces."""
    trace = tmp_path / "t"
    assert _invoke("--steps", "20", "-o", str(trace)).exception is None
    monkeypatch.chdir(trace)
    res = _invoke("--steps", "30", "--seed", "1", "-o", inside, "--force")
    assert res.exception is None, repr(res.exception)
    manifest = json.loads((trace / "manifest.json").read_text())
    assert manifest["complete"] and manifest["source"]["config"]["steps"] == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no sibling left behind


def test_force_replaces_a_trace_whose_name_just_fits(tmp_path: Path) -> None:
    """A 250-byte trace name is a valid name, but its hidden sibling (.NAME.PID-N@HOST.new)
    was not: --force failed with "File name too long" and named that sibling. Now a long
    name's siblings carry a cut of it. Control: a second run over the same name works, and
    nothing is left beside it."""
    trace = tmp_path / ("y" * 250)
    assert _invoke("--steps", "20", "-o", str(trace)).exception is None
    res = _invoke("--steps", "30", "--seed", "1", "-o", str(trace), "--force")
    assert res.exception is None, repr(res.exception)
    manifest = json.loads((trace / "manifest.json").read_text())
    assert manifest["complete"] and manifest["source"]["config"]["steps"] == 30
    assert [p.name for p in tmp_path.iterdir()] == [trace.name]


@pytest.mark.parametrize("inside", ["inner", "steps/x.parquet"])
def test_a_trace_inside_another_trace_is_refused(tmp_path: Path, inside: str) -> None:
    """`-o TRACE/inner` wrote a whole trace into another one's folders, which the outer
    trace's readers never see and replacing it (--force) removed without a word. Control:
    the trace itself, with --force, is replaced as before."""
    trace = tmp_path / "t"
    assert _invoke("--steps", "20", "-o", str(trace)).exception is None
    before = sorted(p.relative_to(trace) for p in trace.rglob("*"))
    proc = run_cli("simulate", "--steps", "20", "-o", str(trace / inside))
    err = assert_one_sentence_error(proc, 2)
    assert f"lies inside the trace {trace}" in err, err
    assert sorted(p.relative_to(trace) for p in trace.rglob("*")) == before
    assert _invoke("--steps", "30", "-o", str(trace), "--force").exception is None
