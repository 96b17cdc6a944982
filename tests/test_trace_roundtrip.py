"""Every table survives writer → Parquet → reader unchanged; manifests are validated."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mgtrace.errors import ManifestError, PartError, SchemaVersionError, TraceNotFoundError
from mgtrace.schemas.manifest import MANIFEST_NAME, load_manifest, save_manifest
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.sample import SAMPLE_RUN, sample_step
from mgtrace.schemas.tables import SCHEMA_VERSION, TABLES
from mgtrace.schemas.writer import (
    BULK_CHUNK_ROWS,
    PLAIN_COLUMNS,
    TraceWriter,
    _column,
    append_table,
)

pytestmark = pytest.mark.unit


def _expected_rows(table: str, rank: int, step: int, columns: dict) -> list[dict]:
    """What the reader must return for one step of one table, column by column."""
    spec = TABLES[table]
    n = max((len(v) for v in columns.values() if isinstance(v, (list, np.ndarray))), default=1)
    rows = []
    for i in range(n):
        row = {}
        for field in spec.schema:
            if spec.per_step and field.name == "rank":
                row["rank"] = rank
            elif spec.per_step and field.name == "step":
                row["step"] = step
            elif field.name not in columns:
                row[field.name] = None
            else:
                v = columns[field.name]
                v = v[i] if isinstance(v, (list, np.ndarray)) else v
                row[field.name] = v.item() if isinstance(v, np.generic) else v
        rows.append(row)
    return rows


def test_every_table_round_trips(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    expected: dict[str, list[dict]] = {name: [] for name in TABLES}
    with TraceWriter(tmp_path / "t", run=SAMPLE_RUN, source={"kind": "test"}) as w:
        for rank in (0, 1):
            for step in range(5):
                tables = sample_step(step, 6, rng)
                assert w.write_step(rank, step, tables)
                for name, cols in tables.items():
                    expected[name] += _expected_rows(name, rank, step, cols)
        requests = {"req_id": ["a", "b"], "arrival_s": [0.5, 1.5], "corrupt": [None, True]}
        findings = {
            "replay_id": "x",
            "kind": "malformed",
            "signature": "s",
            "step": 3,
            "req_id": "a",
        }
        w.write_rows("requests", requests)
        w.write_rows("findings", findings)
        expected["requests"] = _expected_rows("requests", 0, 0, requests)
        expected["findings"] = _expected_rows("findings", 0, 0, findings)
    reader = TraceReader(tmp_path / "t")
    assert reader.complete
    for name in TABLES:
        got = reader.table(name).to_pylist()
        keys = [k for k in TABLES[name].keys if k in TABLES[name].schema.names]

        def order(row: dict, keys: list[str] = keys) -> tuple[str, ...]:
            return tuple(str(row[k]) for k in keys)

        assert sorted(got, key=order) == sorted(expected[name], key=order), name
        assert (
            reader.table(name)
            .schema.remove_metadata()
            .equals(TABLES[name].schema.remove_metadata())
        )
    # one set of parts per rank for per-step tables
    ranks = {p.rank for p in reader.parts if p.table == "batch_rows"}
    assert ranks == {0, 1}


def test_duckdb_views_match_arrow(sample_trace: Path) -> None:
    reader = TraceReader(sample_trace)
    con = reader.connect()
    for name in TABLES:
        n = con.execute(f"SELECT count(*) FROM {name}").fetchone()[0]
        assert n == reader.table(name).num_rows == reader.rows(name)
    # empty tables are views with the right columns too
    cols = [r[0] for r in con.execute("DESCRIBE launches").fetchall()]
    assert cols == list(TABLES["launches"].schema.names)


def test_append_table_adds_findings_part(fresh_trace: Path) -> None:
    before = TraceReader(fresh_trace).rows("findings")
    full = pa.Table.from_pylist(
        [{"replay_id": "r2", "kind": "foreign_state", "signature": "sig", "step": 4}],
        schema=TABLES["findings"].schema,
    )
    append_table(fresh_trace, "findings", full, tag="replay-r2")
    reader = TraceReader(fresh_trace)
    assert reader.rows("findings") == before + 1
    assert reader.complete


@pytest.mark.parametrize(
    "failure", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["full", "ctrl-c"]
)
def test_a_replaced_part_whose_manifest_fails_to_save_keeps_the_old_one(
    fresh_trace: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """A replay saved again over its findings part (new findings after an upgrade) wrote the
    new part, then failed to save the manifest (a full disk, Ctrl-C): the old manifest beside
    the new part made every command refuse the whole trace. Control: a save that works
    replaces the part."""
    from mgtrace.schemas import writer

    append_table(fresh_trace, "findings", _finding("r2"), tag="replay-r2")
    part = fresh_trace / "findings" / "replay-r2.parquet"
    old = part.read_bytes()
    two = pa.concat_tables([_finding("r2"), _finding("r2")])

    def fails(*args: object, **kwargs: object) -> None:
        raise failure

    with monkeypatch.context() as m:
        m.setattr(writer, "save_manifest", fails)
        with pytest.raises(type(failure)):
            append_table(fresh_trace, "findings", two, tag="replay-r2")
    assert part.read_bytes() == old
    assert TraceReader(fresh_trace).table("findings").num_rows >= 1  # readable, as it was
    assert not [p for p in part.parent.iterdir() if p.name.startswith(".")]
    append_table(fresh_trace, "findings", two, tag="replay-r2")
    assert part.read_bytes() != old
    assert not [p for p in part.parent.iterdir() if p.name.startswith(".")]


def test_a_part_is_replaced_where_it_cannot_be_linked_or_is_gone(
    fresh_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keeping the old bytes by a hard link failed the whole save where the file system
    has none, and where the part was gone already (a damaged trace read with
    --skip-bad-parts), which the save used to repair. Control: the part is replaced."""
    from mgtrace.schemas import writer

    append_table(fresh_trace, "findings", _finding("r2"), tag="replay-r2")
    part = fresh_trace / "findings" / "replay-r2.parquet"
    two = pa.concat_tables([_finding("r2"), _finding("r2")])

    def no_links(src: object, dst: object) -> None:
        raise OSError(1, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(writer.os, "link", no_links)
        append_table(fresh_trace, "findings", two, tag="replay-r2")
    assert pq.read_table(part).num_rows == 2
    part.unlink()
    append_table(fresh_trace, "findings", _finding("r2"), tag="replay-r2")
    assert TraceReader(fresh_trace).table("findings").num_rows >= 1  # readable again
    assert not [p for p in part.parent.iterdir() if p.name.startswith(".")]


def test_append_table_leaves_no_lock_file(fresh_trace: Path) -> None:
    """The append lock is a file of its own; a finished trace holds only the trace's files."""
    append_table(fresh_trace, "findings", _finding("r2"), tag="replay-r2")
    assert not list(fresh_trace.glob(".*.lock"))


def test_an_appender_whose_lock_file_was_removed_locks_anew(
    fresh_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An appender that waited on the lock of a file its holder then removed holds a lock no
    later appender sees; it must lock the file at the path instead."""
    from mgtrace.schemas import writer

    real_flock = writer.fcntl.flock
    locked: list[int] = []

    def flock_as_the_holder_finishes(fd: int, op: int) -> None:
        real_flock(fd, op)
        if op == writer.fcntl.LOCK_EX:
            locked.append(os.fstat(fd).st_ino)
            if len(locked) == 1:  # the previous holder removes the file as we get its lock
                (fresh_trace / writer.APPEND_LOCK).unlink()

    monkeypatch.setattr(writer.fcntl, "flock", flock_as_the_holder_finishes)
    append_table(fresh_trace, "findings", _finding("r3"), tag="replay-r3")
    assert len(locked) == 2
    assert "findings/replay-r3.parquet" in {p.path for p in TraceReader(fresh_trace).parts}
    assert not list(fresh_trace.glob(".*.lock"))


def _finding(replay_id: str) -> pa.Table:
    return pa.Table.from_pylist(
        [{"replay_id": replay_id, "kind": "foreign_state", "signature": "sig", "step": 4}],
        schema=TABLES["findings"].schema,
    )


# Each child adds one findings part; its part write waits (at most a while) until every
# child is writing, so that without a lock all of them add to the manifest they read first.
_APPEND_CHILD = """
import sys, time
from pathlib import Path
import pyarrow as pa
from mgtrace.schemas import writer
from mgtrace.schemas.tables import TABLES

trace, meet, me, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
real_write = writer.write_part_file

def write_when_all_write(*args):
    (meet / f"writing-{me}").touch()
    deadline = time.monotonic() + 0.5
    while len(list(meet.glob("writing-*"))) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return real_write(*args)

writer.write_part_file = write_when_all_write
(meet / f"ready-{me}").touch()
while len(list(meet.glob("ready-*"))) < n:  # start together
    time.sleep(0.005)
table = pa.Table.from_pylist(
    [{"replay_id": me, "kind": "foreign_state", "signature": "sig", "step": 4}],
    schema=TABLES["findings"].schema,
)
writer.append_table(trace, "findings", table, tag=f"replay-{me}")
"""


def test_appends_from_processes_at_once_all_stay_listed(fresh_trace: Path, tmp_path: Path) -> None:
    """Replays that save into one trace at the same time each read, extend and rewrite its
    manifest: without a lock between them, each part but the last one saved went unlisted."""
    import subprocess
    import sys

    from tests.conftest import REPO

    meet, n = tmp_path / "meet", 4
    meet.mkdir()
    before = {p.path for p in TraceReader(fresh_trace).parts}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _APPEND_CHILD, str(fresh_trace), str(meet), f"c{i}", str(n)],
            cwd=REPO,
        )
        for i in range(n)
    ]
    assert [c.wait(timeout=120) for c in children] == [0] * n
    listed = {p.path for p in TraceReader(fresh_trace).parts}
    assert listed == before | {f"findings/replay-c{i}.parquet" for i in range(n)}
    assert not list(fresh_trace.glob(".*.lock"))  # removed by whichever appender was last


def test_a_trace_still_being_written_refuses_appends(tmp_path: Path) -> None:
    """The open writer rewrites the manifest from its own copy after every part and on
    close: a part added meanwhile went unlisted although the append had succeeded."""
    from mgtrace.errors import OutputError

    trace = tmp_path / "t"
    rng = np.random.default_rng(0)
    w = TraceWriter(trace, run=SAMPLE_RUN, source={"kind": "test"})
    w.write_step(0, 0, sample_step(0, 4, rng))
    with pytest.raises(OutputError, match="the trace is still being written"):
        append_table(trace, "findings", _finding("early"), tag="replay-early")
    w.close()
    append_table(trace, "findings", _finding("late"), tag="replay-late")  # closed: added
    reader = TraceReader(trace)
    assert [p.path for p in reader.parts if p.path.startswith("findings/replay-")] == [
        "findings/replay-late.parquet"
    ]
    assert reader.complete and not reader.open_parts_left()


_KILLED_WRITER_WITH_A_CHILD = """
import os, sys, time
from mgtrace.schemas.sample import SAMPLE_RUN
from mgtrace.schemas.writer import TraceWriter
w = TraceWriter(sys.argv[1], run=SAMPLE_RUN, source={"kind": "test"})
child = os.fork()
if child == 0:  # a child forked without exec outlives the writer's process
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1), os.dup2(null, 2)  # the parent's pipes close when the parent exits
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
os._exit(0)  # the writer's process dies without closing, as a killed one does
"""


def test_a_forked_child_does_not_keep_a_killed_writers_trace_locked(tmp_path: Path) -> None:
    """A child forked while a writer was open held a copy of its lock: after the writer's
    process died, appends were refused as "still being written" for as long as the child
    lived. Control: the same process alive and writing is seen as open."""
    import os
    import signal
    import subprocess
    import sys

    from mgtrace.schemas.writer import writer_is_open

    trace = tmp_path / "t"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER_WITH_A_CHILD, str(trace)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip().isdigit(), proc.stderr[-2000:]
    try:
        assert not writer_is_open(trace)  # the child sleeps on
    finally:
        os.kill(int(proc.stdout), signal.SIGKILL)
    live = TraceWriter(tmp_path / "u", run=SAMPLE_RUN, source={"kind": "test"})
    try:
        assert writer_is_open(tmp_path / "u")
    finally:
        live.close()


def _unlisted_files(trace: Path) -> list[str]:
    """Files in the table folders that the manifest does not list (temporary ones too)."""
    listed = {p.path for p in TraceReader(trace).parts}
    files = (p.relative_to(trace).as_posix() for p in trace.glob("*/*") if p.is_file())
    return sorted(f for f in files if f not in listed)


def test_a_failed_append_leaves_nothing_behind(
    fresh_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part write that fails left its temporary file (an "open part" beside a complete
    trace), and a manifest save that fails left the new part unlisted."""
    import os

    from mgtrace.errors import OutputError
    from mgtrace.schemas import writer

    assert _unlisted_files(fresh_trace) == []  # the control
    real_replace = os.replace

    def disk_full_on_parts(src: str, dst: str) -> None:
        if str(dst).endswith(".parquet"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", disk_full_on_parts)
        with pytest.raises((OSError, OutputError), match="No space left"):
            append_table(fresh_trace, "findings", _finding("a"), tag="replay-a")
    assert _unlisted_files(fresh_trace) == []

    def manifest_refused(*args: object) -> None:
        raise OutputError("cannot write manifest.json: No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer, "save_manifest", manifest_refused)
        with pytest.raises(OutputError, match="No space left"):
            append_table(fresh_trace, "findings", _finding("b"), tag="replay-b")
    assert _unlisted_files(fresh_trace) == []
    before = TraceReader(fresh_trace).rows("findings")
    append_table(fresh_trace, "findings", _finding("c"), tag="replay-c")  # with room: added
    assert TraceReader(fresh_trace).rows("findings") == before + 1


def test_unknown_schema_version_is_refused(fresh_trace: Path) -> None:
    path = fresh_trace / MANIFEST_NAME
    data = json.loads(path.read_text())
    TraceReader(fresh_trace)  # control: the untouched trace reads
    data["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match="schema version"):
        TraceReader(fresh_trace)


def test_manifest_errors(tmp_path: Path, fresh_trace: Path) -> None:
    with pytest.raises(TraceNotFoundError):
        TraceReader(tmp_path / "nope")
    with pytest.raises(ManifestError, match=r"no manifest\.json"):
        TraceReader(tmp_path)
    (fresh_trace / MANIFEST_NAME).write_text("{ not json")
    with pytest.raises(ManifestError, match="is not valid JSON"):
        load_manifest(fresh_trace)
    (fresh_trace / MANIFEST_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ManifestError, match="not an mgtrace manifest"):
        load_manifest(fresh_trace)


def test_a_manifest_without_its_run_section_is_refused(fresh_trace: Path) -> None:
    """Without ``run`` the defaults (v1, k 0, block size 16) would pass for what ran."""
    path = fresh_trace / MANIFEST_NAME
    data = json.loads(path.read_text())
    load_manifest(fresh_trace)  # control: the untouched manifest reads
    del data["run"]
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="has no run section"):
        load_manifest(fresh_trace)


def test_malformed_steps_are_refused_and_counted(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t") as w:
        assert w.write_step(0, 0, {"steps": {"num_reqs": 1}})
        # unequal column lengths, an unknown column, a missing key column: each refused
        w.write_step(0, 1, {"batch_rows": {"batch_row": [0, 1], "req_id": ["a"]}})
        w.write_step(0, 2, {"steps": {"bogus": 1}})
        w.write_step(0, 3, {"batch_rows": {"batch_row": [0]}})
        assert w.write_step(0, 4, {"steps": {"num_reqs": 2}})
    m = TraceReader(tmp_path / "t").manifest
    assert m.drops.malformed_steps == 3
    assert m.drops.step_ranges == [[0, 1, 3]]
    assert m.errors["malformed_step"]["count"] == 3
    steps = TraceReader(tmp_path / "t").table("steps").column("step").to_pylist()
    assert steps == [0, 4]


def test_writer_refuses_to_overwrite(fresh_trace: Path, tmp_path: Path) -> None:
    from mgtrace.errors import OutputError

    with pytest.raises(OutputError, match="already exists"):
        TraceWriter(fresh_trace)
    other = tmp_path / "not-a-trace"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(OutputError, match="not an mgtrace trace"):
        TraceWriter(other, overwrite=True)
    assert (other / "precious.txt").exists()
    # another program's manifest.json does not make a trace, nor does a plain file
    (other / "manifest.json").write_text('{"name": "my-web-app"}')
    with pytest.raises(OutputError, match="not an mgtrace trace"):
        TraceWriter(other, overwrite=True)
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me too")
    with pytest.raises(OutputError, match="not an mgtrace trace"):
        TraceWriter(plain, overwrite=True)
    assert (other / "precious.txt").exists() and plain.read_text() == "keep me too"
    # without --force the advice is not to pass it, since it would not help
    for path in (other, plain):
        with pytest.raises(OutputError, match="not an mgtrace trace; choose another path"):
            TraceWriter(path)
    TraceWriter(fresh_trace, overwrite=True).close()  # control: a trace may be replaced
    assert TraceReader(fresh_trace).rows("steps") == 0


def test_categorical_columns_accept_codes(tmp_path: Path) -> None:
    """Hot-path producers may write codes into a column's categories; strings come back."""
    with TraceWriter(tmp_path / "t") as w:
        w.write_step(
            0,
            0,
            {
                "batch_rows": {
                    "batch_row": np.arange(4, dtype=np.int32),
                    "req_id": ["a", "b", "c", "d"],
                    "reorder_region": np.array([0, 1, 3, 9], np.int8),  # 9: out of range
                    "mamba_split": ["decode", "prefill", None, "decode"],
                }
            },
        )
        w.write_step(
            0,
            1,
            {
                "batch_rows": {
                    "batch_row": np.arange(1, dtype=np.int32),
                    "req_id": ["a"],
                    "reorder_region": ["long_extend"],  # strings and codes may mix
                    "mamba_split": np.array([1], np.int8),
                }
            },
        )
    t = TraceReader(tmp_path / "t").table("batch_rows")
    assert t.column("reorder_region").to_pylist() == [
        "decode",
        "short_extend",
        "prefill",
        None,
        "long_extend",
    ]
    assert t.column("mamba_split").to_pylist() == ["decode", "prefill", None, "decode", "prefill"]


def test_bulk_steps_equal_single_steps(tmp_path: Path) -> None:
    """write_steps (many steps, a step column) produces the same rows as write_step."""
    rng = np.random.default_rng(5)
    steps = [sample_step(s, 4, rng) for s in range(6)]
    with TraceWriter(tmp_path / "single") as w:
        for s, tables in enumerate(steps):
            w.write_step(0, s, {"batch_rows": tables["batch_rows"], "steps": tables["steps"]})
    bulk_rows = {
        k: np.concatenate([np.asarray(t["batch_rows"][k], dtype=object) for t in steps])
        for k in steps[0]["batch_rows"]
        if isinstance(steps[0]["batch_rows"][k], (list, np.ndarray))
    }
    bulk_rows = {k: v.tolist() for k, v in bulk_rows.items()}
    bulk_rows["step"] = np.repeat(np.arange(6), 4)
    bulk_steps = {k: [t["steps"][k] for t in steps] for k in steps[0]["steps"]}
    bulk_steps["step"] = np.arange(6)
    with TraceWriter(tmp_path / "bulk") as w:
        assert w.write_steps(0, 0, 5, {"batch_rows": bulk_rows, "steps": bulk_steps})
        w.write_steps(0, 6, 6, {"steps": {"num_reqs": 1}})  # malformed: no step column
    single, bulk = TraceReader(tmp_path / "single"), TraceReader(tmp_path / "bulk")
    for name in ("batch_rows", "steps"):
        assert single.table(name).to_pylist() == bulk.table(name).to_pylist()
    assert bulk.manifest.drops.malformed_steps == 1
    assert bulk.manifest.drops.step_ranges == [[0, 6, 6]]


def test_masked_arrays_keep_their_nulls(tmp_path: Path) -> None:
    """A masked array is null where masked, alone or next to plain arrays and scalars (the
    plain-number fast path must not concatenate it: that drops the mask)."""
    masked = np.ma.MaskedArray(np.array([1, 2, 3], np.int32), mask=[False, True, False])
    with TraceWriter(tmp_path / "t") as w:
        w.write_steps(
            0,
            0,
            1,
            {
                "batch_rows": {
                    "step": np.array([0, 0, 0]),
                    "batch_row": np.arange(3, dtype=np.int32),
                    "req_id": ["a", "b", "c"],
                    "accepted": masked,
                },
                "steps": {
                    "step": np.array([0, 1]),
                    "accepted_landed": np.ma.MaskedArray(np.array([True, False]), [True, False]),
                },
            },
        )
        w.write_step(
            0,
            2,
            {
                "batch_rows": {
                    "batch_row": np.arange(2, dtype=np.int32),
                    "req_id": ["a", "b"],
                    "accepted": np.array([4, 5], np.int32),
                }
            },
        )
    r = TraceReader(tmp_path / "t")
    assert r.table("batch_rows").column("accepted").to_pylist() == [1, None, 3, 4, 5]
    assert r.table("steps").column("accepted_landed").to_pylist() == [None, False]


def test_string_columns_are_written_as_dictionaries_and_read_as_strings(tmp_path: Path) -> None:
    """Categorical codes and repeated strings reach Parquet as dictionary codes; the reader
    and DuckDB still see plain strings, and a part whose column is of another type is
    still refused (the control)."""
    with TraceWriter(tmp_path / "t") as w:
        w.write_step(
            0,
            0,
            {
                "launches": {
                    "kernel": "precopy",
                    "batch_row": np.arange(3, dtype=np.int32),
                    "req_slot": np.arange(3, dtype=np.int32),
                    "row_rule": "req_slot",
                },
                "batch_rows": {
                    "batch_row": np.arange(2, dtype=np.int32),
                    "req_id": ["a", "b"],
                    "mamba_split": np.array([0, 1], np.int8),
                },
            },
        )
    part = next((tmp_path / "t" / "launches").glob("*.parquet"))
    stored = pq.read_schema(part)
    assert pa.types.is_dictionary(stored.field("kernel").type)
    reader = TraceReader(tmp_path / "t")
    kernel = reader.table("launches").column("kernel")
    assert kernel.type == pa.string() and kernel.to_pylist() == ["precopy"] * 3
    # what pyarrow's dataset reader gives with the table's schema, whole and in part
    for name, some in (("launches", ["req_slot", "kernel"]), ("batch_rows", ["req_id"])):
        path, schema = next((tmp_path / "t" / name).glob("*.parquet")), TABLES[name].schema
        for columns in (None, some):
            want = pq.read_table(path, columns=columns, schema=schema)
            assert reader.table(name, columns=columns).equals(want, check_metadata=True)
    con = reader.connect()
    assert con.execute("SELECT mamba_split FROM batch_rows").fetchall() == [
        ("decode",),
        ("prefill",),
    ]
    # control: the same part with an integer where the schema has a string is refused
    table = pq.read_table(part)
    bad = table.set_column(
        table.schema.get_field_index("kernel"), "kernel", pa.array([1, 2, 3], pa.int32())
    )
    pq.write_table(bad, part)
    manifest = load_manifest(tmp_path / "t")
    info = next(p for p in manifest.parts if p.table == "launches")
    info.bytes = part.stat().st_size
    info.sha256 = hashlib.sha256(part.read_bytes()).hexdigest()
    save_manifest(tmp_path / "t", manifest)
    with pytest.raises(PartError, match="columns do not match the launches schema"):
        TraceReader(tmp_path / "t")


def test_arrow_arrays_are_taken_as_they_are(tmp_path: Path) -> None:
    """A producer may hand a column as an Arrow array of its type (nested lists built from
    offsets) or as a dictionary of its values (each chunk with its own dictionary); bulk
    and single-step rows read back alike, as plain values."""
    ids = pa.array([[[3, 4]], [[]], None], pa.list_(pa.list_(pa.int32())))

    def names(codes: list[int], values: list[str]) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(values))

    with TraceWriter(tmp_path / "t") as w:
        w.write_step(
            0,
            0,
            {
                "sched": {
                    "req_id": names([1, 0, 1], ["a", "b"]),
                    "kind": "new",
                    "new_block_ids": ids,
                }
            },
        )
        w.write_steps(
            0,
            1,
            1,
            {
                "sched": {
                    "step": np.ones(3, np.int64),
                    "req_id": names([0, 2, 1], ["c", "a", "d"]),
                    "kind": "cached",
                    "new_block_ids": ids,
                }
            },
        )
    sched = TraceReader(tmp_path / "t").table("sched")
    assert sched.column("new_block_ids").to_pylist() == [[[3, 4]], [[]], None] * 2
    assert sched.column("req_id").type == pa.string()
    assert sched.column("req_id").to_pylist() == ["b", "a", "b", "c", "d", "a"]


def test_bulk_numeric_columns_become_arrow_chunks_with_their_values(tmp_path: Path) -> None:
    """Bulk chunks of many rows reach the part as Arrow chunks of their own arrays (no
    joined copy), with plain, masked and absent (null) columns read back as given; chunks
    of a few rows are joined into one array (the control: the path does depend on size)."""
    n = BULK_CHUNK_ROWS
    computed = [np.arange(n, dtype=np.int32) + 7 * i for i in range(3)]
    accepted = np.ma.MaskedArray(np.ones(n, np.int32), mask=np.arange(n) % 3 == 0)
    chunks = [
        {"step": np.full(n, s, np.int64), "batch_row": np.arange(n, dtype=np.int32)}
        | {"req_id": "r", "num_computed": computed[s]}
        | ({"accepted": accepted} if s != 1 else {})
        for s in range(3)
    ]
    with TraceWriter(tmp_path / "t") as w:
        for s, chunk in enumerate(chunks):
            w.write_steps(0, s, s, {"batch_rows": chunk})
    t = TraceReader(tmp_path / "t").table("batch_rows")
    assert t.column("num_computed").to_pylist() == np.concatenate(computed).tolist()
    assert t.column("step").to_pylist() == [0] * n + [1] * n + [2] * n
    expected = accepted.tolist()
    assert t.column("accepted").to_pylist() == expected + [None] * n + expected

    field = TABLES["batch_rows"].schema.field("num_computed")
    big = _column(computed, [n] * 3, field)
    assert isinstance(big, pa.ChunkedArray) and big.num_chunks == 3
    assert big.chunk(0).buffers()[1].address == computed[0].ctypes.data  # not copied
    small = _column([c[:4] for c in computed], [4] * 3, field)
    assert isinstance(small, pa.Array) and small.to_pylist() == [
        v for c in computed for v in c[:4].tolist()
    ]


def test_dictionary_pages_only_for_columns_where_they_pay(tmp_path: Path) -> None:
    """Row positions are written plain; counts, steps and strings through a dictionary page
    (the control: a column outside ``PLAIN_COLUMNS`` does get one)."""
    assert "batch_row" in PLAIN_COLUMNS and "num_computed" not in PLAIN_COLUMNS
    with TraceWriter(tmp_path / "t") as w:
        w.write_step(
            0,
            0,
            {
                "batch_rows": {
                    "batch_row": np.arange(4, dtype=np.int32),
                    "req_id": ["a", "b", "c", "d"],
                    "num_computed": np.array([5, 9, 5, 9], np.int32),
                }
            },
        )
    part = next((tmp_path / "t" / "batch_rows").glob("*.parquet"))
    meta = pq.ParquetFile(part).metadata.row_group(0)
    names = pq.read_schema(part).names
    has_dictionary = {
        name: meta.column(names.index(name)).has_dictionary_page
        for name in ("batch_row", "num_computed", "req_id", "step")
    }
    assert has_dictionary == {
        "batch_row": False,
        "num_computed": True,
        "req_id": True,
        "step": True,
    }
    rows = TraceReader(tmp_path / "t").table("batch_rows").to_pylist()
    assert [r["num_computed"] for r in rows] == [5, 9, 5, 9]


def test_drop_ranges_counted_out_of_order_are_saved_sorted_and_joined(tmp_path: Path) -> None:
    """The writer, the recorder and a failed assembler each count drops; their ranges came
    out as [[0, 594, 1319], [0, 1540, 1561], [0, 1320, 1539]]."""
    from mgtrace.schemas.manifest import Drops, Manifest

    m = Manifest(drops=Drops(steps=4, step_ranges=[[0, 9, 9], [1, 2, 2], [0, 3, 5], [0, 6, 7]]))
    save_manifest(tmp_path, m)
    saved = load_manifest(tmp_path).drops.step_ranges
    assert saved == [[0, 3, 7], [0, 9, 9], [1, 2, 2]]  # rank 1's stays apart; 8 was kept
    assert m.drops.step_ranges[0] == [0, 9, 9]  # saving leaves the counting object alone


def _listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones included) with a file's bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def _step(step: int) -> dict:
    return sample_step(step, 4, np.random.default_rng(step))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_overwrite_keeps_the_old_trace_until_the_new_one_is_whole(
    fresh_trace: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    """--force once removed the old trace as the writer opened: a write that then failed
    left neither trace. Now the old one stays, byte for byte, while the new one is written
    and when it ends incomplete, is discarded or meets a full disk; a whole one replaces it
    and nothing hidden stays beside it. Also where the two cannot be swapped in one step."""
    from mgtrace import atomic
    from mgtrace.schemas import writer as writer_module

    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    root = fresh_trace.parent
    before = _listing(root)

    w = TraceWriter(fresh_trace, overwrite=True)
    w.write_step(0, 0, _step(0))
    assert TraceReader(fresh_trace).rows("steps") == 60  # the old one, while the new is open
    w.close(complete=False)  # interrupted: the old one stays
    assert _listing(root) == before

    w = TraceWriter(fresh_trace, overwrite=True)
    w.write_step(0, 0, _step(0))
    w.discard()
    assert _listing(root) == before

    def full_disk(self: TraceWriter, rel: str, table: pa.Table) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer_module.TraceWriter, "_write_part", full_disk)
        w = TraceWriter(fresh_trace, overwrite=True)
        w.write_step(0, 0, _step(0))
        assert not w.close().complete
    assert _listing(root) == before and TraceReader(fresh_trace).complete

    with pytest.raises(RuntimeError), TraceWriter(fresh_trace, overwrite=True) as w:
        w.write_step(0, 0, _step(0))
        raise RuntimeError("the producer failed part-way")
    assert _listing(root) == before

    w = TraceWriter(fresh_trace, overwrite=True)  # control: a whole trace replaces it
    w.write_step(0, 7, _step(7))
    w.close()
    assert TraceReader(fresh_trace).table("steps").column("step").to_pylist() == [7]
    assert [p.name for p in root.iterdir()] == [fresh_trace.name]


def test_what_a_killed_overwrite_left_does_not_break_the_next_run(fresh_trace: Path) -> None:
    """A run killed while it wrote leaves its hidden new trace; one killed between moving
    the old trace aside and renaming the new one in leaves the old one aside, and nothing at
    the path. The next writer puts the old trace back (so it refuses to overwrite it
    without --force) and removes the rest; one with --force then replaces it."""
    from mgtrace.errors import OutputError

    dead = 2**31 - 2  # no process has this id
    root = fresh_trace.parent
    steps_before = TraceReader(fresh_trace).rows("steps")
    fresh_trace.rename(root / f".{fresh_trace.name}.{dead}-1.old")
    partial = root / f".{fresh_trace.name}.{dead}-0.new"
    partial.mkdir()
    (partial / "manifest.json").write_text("{")
    with pytest.raises(OutputError, match="already exists"):
        TraceWriter(fresh_trace)
    assert TraceReader(fresh_trace).rows("steps") == steps_before
    assert [p.name for p in root.iterdir()] == [fresh_trace.name]
    TraceWriter(fresh_trace, overwrite=True).close()
    assert TraceReader(fresh_trace).rows("steps") == 0
    assert [p.name for p in root.iterdir()] == [fresh_trace.name]
