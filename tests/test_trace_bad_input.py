"""Each bad input gets one sentence and its exit code from the real CLI, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mgtrace.schemas.manifest import MANIFEST_NAME, RUN_LIMITS
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.slow


def _first_part(trace: Path, table: str = "batch_rows") -> Path:
    manifest = json.loads((trace / MANIFEST_NAME).read_text())
    rel = next(p["path"] for p in manifest["parts"] if p["table"] == table)
    return trace / rel


def test_good_trace_is_the_control(fresh_trace: Path) -> None:
    proc = run_cli("info", str(fresh_trace))
    assert proc.returncode == 0, proc.stderr
    assert "complete" in proc.stdout


def test_missing_directory(tmp_path: Path) -> None:
    err = assert_one_sentence_error(run_cli("info", str(tmp_path / "missing")), 3)
    assert "does not exist" in err


def test_path_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in assert_one_sentence_error(run_cli("info", str(f)), 3)


def test_missing_manifest(tmp_path: Path) -> None:
    assert "no manifest.json" in assert_one_sentence_error(run_cli("info", str(tmp_path)), 3)


def test_a_manifest_that_is_a_folder_is_damage_not_absence(fresh_trace: Path) -> None:
    """It read "has no manifest.json; it is not an mgtrace trace" of a trace whose manifest
    had become a folder. Control: a folder with no manifest at all is no trace."""
    (fresh_trace / MANIFEST_NAME).unlink()
    (fresh_trace / MANIFEST_NAME).mkdir()
    err = assert_one_sentence_error(run_cli("info", str(fresh_trace)), 3)
    assert err.endswith(
        f"{fresh_trace / MANIFEST_NAME} is not a file; the trace's manifest is damaged"
    )


def test_corrupt_manifest(fresh_trace: Path) -> None:
    (fresh_trace / MANIFEST_NAME).write_text('{"format": "mgtrace-trace", "schema_')
    err = assert_one_sentence_error(run_cli("info", str(fresh_trace)), 3)
    assert "is not valid JSON" in err and "Decode" not in err and " at at " not in err
    assert "line 1, column" in err


@pytest.mark.parametrize("version", [99, True, 1.0, "1"])
def test_unknown_schema_version(fresh_trace: Path, version: object) -> None:
    """Only the integer itself is a schema version: true and 1.0 equal 1 in Python."""
    path = fresh_trace / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["schema_version"] = version
    path.write_text(json.dumps(data))
    err = assert_one_sentence_error(run_cli("sql", str(fresh_trace), "SELECT 1"), 3)
    assert f"schema version {version!r}" in err
    # a version that is no number is not told it is the wrong number (it read '1' vs 1)
    assert ("not a whole number" in err) == (type(version) is not int), err


def _edit_manifest(trace: Path, edit) -> None:
    path = trace / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            lambda m: m["run"].update(num_speculative_tokens="three"),
            "run.num_speculative_tokens must be an integer, not 'three'",
        ),
        (
            lambda m: m["run"].update(async_scheduling=1),
            "run.async_scheduling must be true or false",
        ),
        (lambda m: m["run"].update(num_blocks=[4]), "run.num_blocks must be an integer or null"),
        (lambda m: m["run"].update(mamba_block_size=0), "run.mamba_block_size must be at least 1"),
        (lambda m: m["run"].update(runner="v3"), "run.runner must be v1 or v2"),
        (lambda m: m["run"].update(row_rule="weird"), "run.row_rule must be req_slot, batch_row"),
        (lambda m: m["parts"].append(m["parts"][0]), "twice"),
        (
            lambda m: m["drops"].update(step_ranges=[[20, 25]]),
            "drops.step_ranges[0] must be [rank, first step, last step]",
        ),
        (
            lambda m: m["drops"].update(step_ranges=[[0, 9, 9], [0, 30, 20]]),
            "drops.step_ranges[1] must be [rank, first step, last step] with first <= last",
        ),
        # values past any engine's: a replay sized arrays by them and failed inside numpy
        (lambda m: m["run"].update(num_blocks=10**30), "run.num_blocks must be at most 2147483648"),
        (lambda m: m["run"].update(num_blocks=10**12), "not 1000000000000"),
        (
            lambda m: m["run"].update(num_speculative_tokens=10**30),
            "run.num_speculative_tokens must be at most 1024",
        ),
        (lambda m: m["run"].update(max_num_seqs=10**9), "run.max_num_seqs must be at most"),
        (lambda m: m["run"].update(mamba_block_size=10**30), "run.mamba_block_size must be at"),
        (lambda m: m["run"].update(pp_size=10**30), "run.pp_size must be at most 1024"),
        (
            lambda m: m["run"].update(prefill_checkpoint_blocks=10**30),
            "run.prefill_checkpoint_blocks must be at most 2147483648",
        ),
        (
            lambda m: m["run"].update(prefill_checkpoint_blocks=-1),
            "run.prefill_checkpoint_blocks must be at least 0",
        ),
        (
            lambda m: m["run"].update(runner_reorder_threshold=10**30),
            "run.runner_reorder_threshold must be at most 2147483648",
        ),
        (
            lambda m: m["run"].update(runner_reorder_threshold=-4),
            "run.runner_reorder_threshold must be at least 0",
        ),
        (
            lambda m: m["run"].update(builder_reorder_thresholds={"mamba2": 10**30}),
            "run.builder_reorder_thresholds['mamba2'] must be at most 2147483648",
        ),
        (
            lambda m: m["run"].update(builder_reorder_thresholds={"mamba2": -1}),
            "run.builder_reorder_thresholds['mamba2'] must be at least 0",
        ),
        (
            lambda m: m["run"].update(max_num_batched_tokens=10**30),
            "run.max_num_batched_tokens must be at most 2147483648",
        ),
        (lambda m: m["run"]["states"][0].update(shape=[]), "run.states[0].shape must list one"),
        (lambda m: m["run"]["states"][1].update(shape=[10**30, 4, 8]), "run.states[1].shape"),
        (lambda m: m["run"]["states"][1].update(shape=[2, 0, 8]), "dimensions of 1 to 2**31"),
        (lambda m: m["run"]["states"][1].update(shape=[2**20] * 3), "at most 2**40 elements"),
        (lambda m: m["run"]["states"][0].update(group=-1), "run.states[0].group and layer"),
        (lambda m: m["run"]["states"][0].update(kind="ssm"), "kind must be conv or temporal"),
        (lambda m: m["run"]["states"][0].update(conv_layout="XY"), "conv_layout must be SD or DS"),
        (lambda m: m["run"].update(states=[["conv"]]), "run.states[0] must be an object"),
        (
            lambda m: m["run"]["states"][0].update(shape="6x64"),
            "run.states[0].shape must be a list",
        ),
        (lambda m: m.update(run=[]), "run must be an object"),
        (lambda m: m["parts"][0].update(rows="12"), "parts[0].rows must be an integer"),
        (
            lambda m: m["drops"].update(step_ranges=[[0, "a", 2]]),
            "drops.step_ranges must be a list",
        ),
        (lambda m: m.update(created_unix="yesterday"), "created_unix must be a number"),
        (lambda m: m.update(source=[1, 2]), "source must be an object"),
        (lambda m: m.update(complete="no"), "complete must be true or false"),
        (lambda m: m["parts"][0].pop("sha256"), "parts[0] lacks sha256"),
        (lambda m: m["parts"][0].update(extra=1), "parts[0] has unknown entries extra"),
        (lambda m: m.update(errors={"a": 5}), "errors.a must be an object"),
        (
            lambda m: m.update(errors={"a": {"count": "x", "first": "y"}}),
            "errors.a must hold an integer count and a message",
        ),
        (
            lambda m: m.update(ground_truth={"injected": 5}),
            "ground_truth.injected must be a list of bug names",
        ),
        (
            lambda m: m.update(ground_truth={"first_step": "3"}),
            "ground_truth.first_step must be a step number or null",
        ),
    ],
)
def test_manifest_entry_of_the_wrong_type(fresh_trace: Path, edit, said: str) -> None:
    """Read commands refuse such a manifest in one sentence naming the entry; replay used to
    fail deep inside with an internal error (exit 70)."""
    _edit_manifest(fresh_trace, edit)
    for command in ("info", "replay"):
        err = assert_one_sentence_error(run_cli(command, str(fresh_trace)), 3)
        assert said in err, err


def test_manifest_entries_of_the_right_type_are_read(fresh_trace: Path) -> None:
    """The control: the same entries with values of their types pass the checks."""

    def edit(m: dict) -> None:
        m["run"].update(num_speculative_tokens=2, async_scheduling=True, num_blocks=None)
        limits = {k: v for k, v in RUN_LIMITS.items() if k != "num_blocks"}
        limits["builder_reorder_thresholds"] = {"mamba2": limits["builder_reorder_thresholds"]}
        m["run"].update(limits)
        m["run"]["states"][0].update(shape=[4, 2**31], conv_layout="DS")
        m["drops"].update(step_ranges=[])
        m.update(errors={"a": {"count": 2, "first": "why"}})
        m.update(ground_truth={"injected": ["x"], "first_step": 3, "bugs": {}})

    _edit_manifest(fresh_trace, edit)
    proc = run_cli("info", str(fresh_trace))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("shape", [[6], [2, 3, 4]])
def test_a_conv_state_of_other_dimensions_is_read_but_not_replayed(
    fresh_trace: Path, shape: list[int]
) -> None:
    """An engine whose conv state is not (state_len, dim) per block still has a trace to
    query; only a replay, which models that window, refuses it (the first of these used to
    stop in an IndexError, exit 70)."""
    _edit_manifest(fresh_trace, lambda m: m["run"]["states"][0].update(shape=shape))
    assert run_cli("info", str(fresh_trace)).returncode == 0
    err = assert_one_sentence_error(run_cli("replay", str(fresh_trace), "--no-save"), 2)
    assert "conv state has shape" in err, err


def test_truncated_part(fresh_trace: Path) -> None:
    part = _first_part(fresh_trace)
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    err = assert_one_sentence_error(run_cli("info", str(fresh_trace)), 3)
    assert "truncated" in err and part.name in err


def test_corrupt_part_same_size(fresh_trace: Path) -> None:
    part = _first_part(fresh_trace)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    err = assert_one_sentence_error(run_cli("info", str(fresh_trace)), 3)
    assert "checksum" in err


def test_missing_part(fresh_trace: Path) -> None:
    _first_part(fresh_trace).unlink()
    assert "missing" in assert_one_sentence_error(run_cli("info", str(fresh_trace)), 3)


def test_skip_bad_parts_reads_the_rest(fresh_trace: Path) -> None:
    part = _first_part(fresh_trace, "batch_rows")
    part.write_bytes(b"PAR1 garbage")
    proc = run_cli(
        "sql",
        str(fresh_trace),
        "--skip-bad-parts",
        "--format",
        "csv",
        "SELECT count(*) AS n FROM steps",
    )
    assert proc.returncode == 0, proc.stderr
    assert "skipped part" in proc.stderr and part.name in proc.stderr
    assert proc.stdout.strip().splitlines() == ['"n"', "60"]
    proc = run_cli(
        "sql",
        str(fresh_trace),
        "--skip-bad-parts",
        "--format",
        "csv",
        "SELECT count(*) AS n FROM batch_rows",
    )
    assert proc.stdout.strip().splitlines() == ['"n"', "0"]


def test_bad_sql_is_a_usage_error(fresh_trace: Path) -> None:
    err = assert_one_sentence_error(run_cli("sql", str(fresh_trace), "SELECT nope FROM steps"), 2)
    assert "the query failed" in err


def test_sql_without_query(fresh_trace: Path) -> None:
    assert_one_sentence_error(run_cli("sql", str(fresh_trace)), 2)


def test_output_is_never_overwritten_without_force(fresh_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    out.write_text("keep")
    proc = run_cli("sql", str(fresh_trace), "SELECT 1 AS x", "--format", "csv", "-o", str(out))
    assert "already exists" in assert_one_sentence_error(proc, 2)
    assert out.read_text() == "keep"
    proc = run_cli(
        "sql", str(fresh_trace), "SELECT 1 AS x", "--format", "csv", "-o", str(out), "-f"
    )
    assert proc.returncode == 0 and out.read_text().splitlines() == ['"x"', "1"]
    # a directory is no file to write, --force or not (it was once told to pass --force)
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    for force in ([], ["-f"]):
        proc = run_cli("sql", str(fresh_trace), "SELECT 1 AS x", "-o", str(folder), *force)
        assert "is a directory; give a file name" in assert_one_sentence_error(proc, 2)


def test_failed_query_leaves_no_output_file(fresh_trace: Path, tmp_path: Path) -> None:
    outdir = tmp_path / "results"
    outdir.mkdir()
    out = outdir / "out.parquet"
    proc = run_cli("sql", str(fresh_trace), "SELECT nope", "--format", "parquet", "-o", str(out))
    assert_one_sentence_error(proc, 2)
    assert list(outdir.iterdir()) == []


def test_replay_window_that_ends_before_it_starts(fresh_trace: Path) -> None:
    proc = run_cli("replay", str(fresh_trace), "--from-step", "50", "--to-step", "10")
    assert "--from-step 50 comes after --to-step 10" in assert_one_sentence_error(proc, 2)
    proc = run_cli("replay", str(fresh_trace), "--from-step", "10", "--to-step", "50")
    assert proc.returncode in (0, 1), proc.stderr  # the control: a window in order replays


def test_sql_that_fails_while_running_is_a_usage_error(fresh_trace: Path) -> None:
    """DuckDB meets some errors only while running a query (a failed cast, error()); they
    are the query's fault too. Control: the same query with a good value runs."""
    proc = run_cli("sql", str(fresh_trace), "SELECT CAST('a' AS INTEGER) AS x")
    assert "the query failed: Conversion Error" in assert_one_sentence_error(proc, 2)
    proc = run_cli("sql", str(fresh_trace), "--format", "csv", "SELECT CAST('7' AS INTEGER) AS x")
    assert proc.returncode == 0 and proc.stdout.splitlines() == ['"x"', "7"]


def test_an_output_never_replaces_the_trace_it_reads(fresh_trace: Path, tmp_path: Path) -> None:
    """--force overwrites an old output, never the input (a slip once turned a trace into
    a CSV file). Control: the same command with another output path writes it."""
    before = sorted(p.name for p in fresh_trace.iterdir())
    for args in (
        ("sql", str(fresh_trace), "SELECT 1 AS x", "--format", "csv", "-o", str(fresh_trace)),
        ("report", str(fresh_trace), "--no-bisect", "-o", str(fresh_trace)),
        ("minimize", str(fresh_trace), "-o", str(fresh_trace)),
        ("minimize", str(fresh_trace), "-o", str(fresh_trace.parent)),
    ):
        err = assert_one_sentence_error(run_cli(*args, "--force"), 2)
        assert "is (or holds) the input" in err, err
    inside = fresh_trace / "manifest.json"
    for args in (
        ("sql", str(fresh_trace), "SELECT 1 AS x", "--format", "csv", "-o", str(inside)),
        ("report", str(fresh_trace), "--no-bisect", "-o", str(inside)),
    ):
        err = assert_one_sentence_error(run_cli(*args, "--force"), 2)
        assert "lies inside the input" in err, err
    assert sorted(p.name for p in fresh_trace.iterdir()) == before
    assert run_cli("info", str(fresh_trace)).returncode == 0
    out = tmp_path / "x.csv"
    args = ("sql", str(fresh_trace), "SELECT 1 AS x", "--format", "csv", "-o", str(out))
    assert run_cli(*args, "--force").returncode == 0 and out.is_file()


def test_replay_from_a_step_past_the_end(fresh_trace: Path) -> None:
    """Once a clean verdict on a window holding no step at all. Control: the last step."""
    proc = run_cli("replay", str(fresh_trace), "--no-save", "--from-step", "5000")
    assert "past the last step" in assert_one_sentence_error(proc, 2)
    proc = run_cli("replay", str(fresh_trace), "--no-save", "--from-step", "59")
    assert proc.returncode in (0, 1), proc.stderr


def test_history_rules_are_checked(fresh_trace: Path) -> None:
    """A misspelt rule set once showed an empty findings column. Control: a good one."""
    req = "req-0"
    for rules, said in (
        ("garbage", "rule assignments look like name=value"),
        ("reorder_threshold=banana", "takes 1+k | N | as-recorded, not 'banana'"),
    ):
        proc = run_cli("history", str(fresh_trace), req, "--rules", rules)
        assert said in assert_one_sentence_error(proc, 2)
    proc = run_cli("history", str(fresh_trace), req, "--rules", "reorder-threshold=1+k")
    assert proc.returncode == 0, proc.stderr
    assert "under reorder_threshold=1+k" in proc.stdout  # named as replay names it


def test_a_full_disk_leaves_no_simulated_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A simulated trace the disk refused is removed, not left half written; the user gets
    one sentence. Control: with room, the same command writes the trace."""
    from mgtrace.cli import main
    from mgtrace.schemas.writer import TraceWriter

    def disk_full(self: TraceWriter, rel: str, table: object) -> object:
        raise OSError(28, "No space left on device")

    out = tmp_path / "sim.trace"
    args = ["simulate", "--steps", "200", "-o", str(out)]
    with monkeypatch.context() as m:
        m.setattr(TraceWriter, "_write_part", disk_full)
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mgtrace: error: cannot write") and "No space left" in err
    assert not out.exists()
    assert main(args) == 0 and (out / MANIFEST_NAME).is_file()


def test_a_replay_of_a_trace_still_being_written_says_its_findings_were_not_added(
    tmp_path: Path,
) -> None:
    """The open writer rewrites the manifest from its own copy, so findings saved meanwhile
    went unlisted although the replay said they were added. The replay still runs and
    reports; one line says the findings were not added. Control: once closed, they are."""
    import time

    import numpy as np

    from mgtrace.schemas.reader import TraceReader
    from mgtrace.schemas.sample import SAMPLE_RUN, sample_step
    from mgtrace.schemas.writer import TraceWriter

    trace, rng = tmp_path / "live", np.random.default_rng(0)
    with TraceWriter(trace, run=SAMPLE_RUN, source={"kind": "sample"}, flush_seconds=0) as w:
        for step in range(60):
            w.write_step(0, step, sample_step(step, 8, rng))
        deadline = time.monotonic() + 60
        while TraceReader(trace).rows("steps") != 60:
            assert time.monotonic() < deadline, "the writer never wrote the steps"
            time.sleep(0.01)
        proc = run_cli("replay", str(trace), "--json")
        assert proc.returncode in (0, 1), proc.stderr
        assert json.loads(proc.stdout)["replay_id"] is None
        assert proc.stderr.strip() == (
            f"mgtrace: could not add the findings to {trace}: the trace is still being written"
        )
    assert not any(p.table == "findings" for p in TraceReader(trace).parts)
    saved = run_cli("replay", str(trace), "--json")
    assert json.loads(saved.stdout)["replay_id"] is not None, saved.stderr
    assert any(p.table == "findings" for p in TraceReader(trace).parts)


def test_a_pool_too_large_to_allocate_is_one_sentence(fresh_trace: Path) -> None:
    """A pool within the manifest's limits can still be more than this machine holds: numpy's
    MemoryError (or "maximum dimension exceeded") was an internal error, exit 70. Now the
    replay names the size it needed. Control: the recorded pool replays."""
    replay = ("replay", str(fresh_trace), "--no-save", "--layout", "full")
    assert run_cli(*replay).returncode in (0, 1)
    # pages of the recorded state sizes: 2**31 blocks of 2**38 bytes is past any memory
    _edit_manifest(fresh_trace, lambda m: m["run"].update(num_blocks=2**31))
    _edit_manifest(fresh_trace, lambda m: m["run"]["states"][1].update(shape=[2**12] * 3))
    err = assert_one_sentence_error(run_cli(*replay), 2)
    assert "the state pool of 2147483648 blocks" in err and "cannot be allocated" in err, err


def test_block_tables_too_large_to_allocate_are_one_sentence() -> None:
    from mgtrace.errors import UsageError
    from mgtrace.replayer.tables import TableStore

    with pytest.raises(UsageError, match=r"the block tables .* cannot be allocated here"):
        TableStore(("v1",), 1, 2**40, 2**30)
    assert TableStore(("v1",), 1, 4, 8).rows == 4  # the control


def test_a_trace_of_no_step_is_said_to_hold_none(tmp_path: Path) -> None:
    """A recording that ended before its first step was written replayed as "the trace
    holds no align-kernel launches", as if it were a probe import. Control: a trace with
    steps replays."""
    from mgtrace.schemas.manifest import RunMetadata
    from mgtrace.schemas.writer import TraceWriter

    TraceWriter(tmp_path / "empty", run=RunMetadata(num_blocks=64)).close()
    err = assert_one_sentence_error(run_cli("replay", str(tmp_path / "empty")), 2)
    assert "the trace holds no step" in err, err
    assert run_cli("simulate", "--steps", "20", "-o", str(tmp_path / "t")).returncode == 0
    assert run_cli("replay", str(tmp_path / "t")).returncode == 0
