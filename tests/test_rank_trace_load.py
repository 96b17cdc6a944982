"""Loading a rank trace: the same steps whatever order the parts hold their rows in (writers
write in step order, and loading sorts only a table that is not), and launches checked and
planned over all rows at once equal launches built one at a time with every check."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.kernels.plan import RowPlan, plan_launch
from mgtrace.replayer import steps as steps_module
from mgtrace.replayer.loop import RankReplay, load_backend
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.replay_helpers import RewritingReader

# sched is sorted by step alone: its rows keep their order within a step
SHUFFLED = ("batch_rows", "launches", "block_tables")


class _ShuffledReader(RewritingReader):
    """A trace reader whose tables come with their rows in a seeded random order."""

    def __init__(self, reader: TraceReader, seed: int) -> None:
        super().__init__(reader)
        self._rng = np.random.default_rng(seed)

    def rewrite(self, name: str, t: pa.Table) -> pa.Table:
        if name not in SHUFFLED:
            return t
        return t.take(pa.array(self._rng.permutation(t.num_rows)))


@pytest.fixture(scope="module")
def deferred_trace(tmp_path_factory: pytest.TempPathFactory) -> TraceReader:
    """V2 with a two-stage pipeline: post-processes deferred to a later step sit beside the
    step's own launches, and the injected bug gives the replay findings to compare."""
    out = tmp_path_factory.mktemp("order") / "t"
    simulate(
        SimConfig(
            runner="v2",
            pp=2,
            scenario="mixed",
            seed=3,
            steps=250,
            max_num_seqs=24,
            length_scale=0.3,
            bugs=("batch-row-block-table",),
            output=out,
        ).validate()
    )
    return TraceReader(out)


def _launch_fields(launch: AlignLaunch) -> list[Any]:
    out: list[Any] = []
    for f in fields(AlignLaunch):
        value = getattr(launch, f.name)
        if isinstance(value, np.ma.MaskedArray):
            out.append((value.data.tolist(), np.ma.getmaskarray(value).tolist()))
        elif isinstance(value, np.ndarray):
            out.append(value.tolist())
        else:
            out.append(value)
    return out


def _per_step(trace: RankTrace) -> list[Any]:
    seen = []
    for step in trace:
        batch = trace.batch(step)
        seen.append(
            (
                step,
                [_launch_fields(launch) for launch in trace.launches(step)],
                batch.uid.tolist(),
                {name: col.tolist() for name, col in sorted(batch.cols.items())},
                trace.table_updates(step),
                trace.sched(step),
            )
        )
    return seen


def _findings(trace: RankTrace) -> list[dict[str, Any]]:
    rep = RankReplay(trace, RuleSet(), load_backend("reference", "cpu"), device="cpu")
    rep.run()
    return [asdict(f) for f in rep.oracle.findings]


@pytest.mark.unit
def test_rows_in_any_order_read_as_the_steps_written(deferred_trace: TraceReader) -> None:
    written = RankTrace(deferred_trace, 0, RequestIds())
    deferred = [x for s in written for x in written.launches(s) if x.batch_step < s]
    assert deferred, "control: post-processes deferred to a later step are among the launches"
    shuffled = RankTrace(_ShuffledReader(deferred_trace, seed=7), 0, RequestIds())
    assert _per_step(shuffled) == _per_step(written)
    found = _findings(written)
    assert found, "control: the injected bug gives the oracle something to find"
    assert _findings(shuffled) == found


@pytest.mark.unit
def test_a_table_in_order_is_not_copied(
    deferred_trace: TraceReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writers' order needs no sort: loading permutes only the tables that are out of
    order (those a string key without categories sorts are handed to Arrow)."""
    permuted: list[int] = []
    real = steps_module._sorting_permutation

    def counted(keys: list[np.ndarray]) -> np.ndarray | None:
        at = real(keys)
        if at is not None:
            permuted.append(len(at))
        return at

    monkeypatch.setattr(steps_module, "_sorting_permutation", counted)
    RankTrace(deferred_trace, 0, RequestIds())
    assert permuted == []
    RankTrace(_ShuffledReader(deferred_trace, seed=11), 0, RequestIds())
    assert len(permuted) == 2  # batch_rows and launches (block_tables goes to Arrow)


@pytest.mark.unit
def test_sorting_permutation_names_rows_out_of_order() -> None:
    step = np.array([0, 0, 1, 1, 1])
    row = np.array([0, 1, 0, 2, 1])
    at = steps_module._sorting_permutation([step, row])
    assert at is not None and at.tolist() == [0, 1, 2, 4, 3]
    assert steps_module._sorting_permutation([step, np.array([0, 1, 0, 1, 2])]) is None
    # a later key may fall where an earlier one rises
    assert steps_module._sorting_permutation([step, np.array([5, 6, 0, 1, 2])]) is None
    # a null ranked last (the largest int64) before a negative value: out of order, though
    # their difference wraps to a positive number
    last = np.iinfo(np.int64).max
    at = steps_module._sorting_permutation([np.zeros(2, np.int64), np.array([last, -2])])
    assert at is not None and at.tolist() == [1, 0]


class _DamagedReader(_ShuffledReader):
    """Launch rows with seeded damage: negative and huge counts, padded rows, rows out of
    order, block-table rows that disagree with the rule and CPU-held accepted counts."""

    def rewrite(self, name: str, t: pa.Table) -> pa.Table:
        if name != "launches":
            return t
        rng = self._rng
        for column, values in (
            ("num_computed", rng.integers(-40, 0, t.num_rows)),
            ("num_accepted", rng.integers(2**31 - 9, 2**31 - 1, t.num_rows)),
            ("req_slot", np.full(t.num_rows, -1)),
            ("batch_row", rng.integers(0, 50, t.num_rows)),
            ("bt_row", rng.integers(0, 50, t.num_rows)),
            ("num_accepted_cpu", rng.integers(0, 5, t.num_rows)),
        ):
            hit = rng.random(t.num_rows) < 0.03
            col = t.column(column)
            # a row hit holds a value, recorded or not; the others keep their nulls
            null = col.is_null().to_numpy(zero_copy_only=False) & ~hit
            old = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
            new = np.where(hit, values, old).astype(np.int32)
            i = t.schema.get_field_index(column)
            field = t.schema.field(i)
            t = t.set_column(i, field, pa.array(new, field.type, mask=null))
        return t


def _flags(launch: AlignLaunch) -> tuple:
    return (
        launch.has_nulls,
        launch.lacks_required,
        launch.all_live,
        launch.rows_in_order,
        launch.bt_row_consistent,
        launch.well_formed,
        launch.block32,
    )


def _plan_fields(plan: RowPlan) -> list[Any]:
    return [
        None if v is None else (v.dtype.str, v.tolist())
        for v in (getattr(plan, f.name) for f in fields(RowPlan))
    ]


@pytest.mark.unit
@pytest.mark.parametrize("damaged", [False, True])
@pytest.mark.parametrize(
    ("bug", "engine"),
    [
        ("async-accepted-race", {"runner": "v1", "scenario": "pairs"}),
        ("batch-row-block-table", {"runner": "v2", "pp": 2, "scenario": "mixed"}),
        (None, {"runner": "v1", "scenario": "steady", "k": 0}),
    ],
)
def test_launches_checked_at_once_equal_launches_checked_one_by_one(
    tmp_path: Path, bug: str | None, engine: dict, damaged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steps_module, "PRECHECK_BLOCK", 7)  # many blocks, launches across ends
    out = tmp_path / "t"
    simulate(
        SimConfig(
            seed=5,
            steps=200,
            max_num_seqs=24,
            length_scale=0.3,
            bugs=(bug,) if bug else (),
            output=out,
            **engine,
        ).validate()
    )
    reader: Any = TraceReader(out)
    if damaged:
        reader = _DamagedReader(reader, seed=2)
    trace = RankTrace(reader, 0, RequestIds())
    prechecked = flagged = masked = 0
    for step in trace:
        for launch in trace.launches(step):
            if launch.num_accepted_cpu is not None:  # frozen like every column
                masked += 1
                with pytest.raises(ValueError):
                    launch.num_accepted_cpu[0] = 9
            values = {f.name: getattr(launch, f.name) for f in fields(AlignLaunch)}
            one_by_one = AlignLaunch(**values)
            assert _launch_fields(launch) == _launch_fields(one_by_one)
            assert _flags(launch) == _flags(one_by_one)
            if launch.planned is None:
                continue
            prechecked += 1
            flagged += not launch.well_formed or not launch.all_live
            assert _plan_fields(launch.planned) == _plan_fields(plan_launch(one_by_one))
    assert prechecked, "control: launches are built from the rows checked at once"
    if damaged:
        assert flagged, "control: the damage reaches the checks"
        assert masked, "control: launches carry CPU-held counts, a masked column"


class _DecodingReader(RewritingReader):
    """A trace reader that decodes every string column, whatever the caller asks."""

    def table(self, name: str, *args: Any, **kwargs: Any) -> pa.Table:
        kwargs["codes"] = False
        return self._reader.table(name, *args, **kwargs)


@pytest.fixture(scope="module")
def v1_trace(tmp_path_factory: pytest.TempPathFactory) -> TraceReader:
    """V1, whose batch rows name their requests by dictionary codes (V2's by strings)."""
    out = tmp_path_factory.mktemp("codes") / "t"
    simulate(
        SimConfig(
            scenario="mixed",
            seed=5,
            steps=250,
            max_num_seqs=24,
            length_scale=0.3,
            bugs=("reorder-threshold-mismatch", "async-accepted-race"),
            output=out,
        ).validate()
    )
    return TraceReader(out)


@pytest.mark.unit
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_strings_kept_as_codes_load_as_decoded_strings_do(
    runner: str, v1_trace: TraceReader, deferred_trace: TraceReader
) -> None:
    """Request ids and categories read as the writer's dictionary codes give the steps,
    launches and findings that the decoded strings give; the big Arrow tables are not kept."""
    trace = v1_trace if runner == "v1" else deferred_trace

    def coded(codes: bool) -> list[str]:
        return [
            f"{name}.{field.name}"
            for name in ("batch_rows", "launches", "sched")
            for field in trace.table(name, codes=codes).schema
            if pa.types.is_dictionary(field.type)
        ]

    assert coded(True), "control: some strings are read as codes"
    assert coded(False) == []
    from_codes = RankTrace(trace, 0, RequestIds())
    from_strings = RankTrace(_DecodingReader(trace), 0, RequestIds())
    assert _per_step(from_codes) == _per_step(from_strings)
    found = _findings(from_codes)
    assert found, "control: the injected bug gives the oracle something to find"
    assert _findings(from_strings) == found
    assert from_codes._launch.table is None and from_codes._batch.table is None


@pytest.mark.unit
def test_codes_of_dictionary_chunks_equal_codes_of_their_strings() -> None:
    """Per chunk: a dictionary's values looked up once, nulls and unknown values -1, a
    dictionary with no values (every row null), and plain strings beside them."""
    chunks = [
        pa.DictionaryArray.from_arrays(
            pa.array([2, 0, None, 1, 2], pa.int32()), pa.array(["prefill", "bogus", "cached"])
        ),
        pa.DictionaryArray.from_arrays(
            pa.array([None, None], pa.int32()), pa.array([], pa.string())
        ),
        pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.int32()), pa.array(["new"])),
    ]
    strings = pa.chunked_array([c.cast(pa.string()) for c in chunks])
    want = steps_module.category_codes(strings, ("new", "cached", "prefill"))
    assert want.tolist() == [1, 2, -1, -1, 1, -1, -1, 0, 0]
    for mixed in (
        pa.chunked_array(chunks),
        pa.chunked_array(chunks[:2]),  # chunks of one dictionary type, and strings after
    ):
        got = steps_module.category_codes(mixed, ("new", "cached", "prefill"))
        assert got.dtype == np.int8
        assert got.tolist() == want[: len(got)].tolist()
    tail = steps_module.category_codes(pa.chunked_array([chunks[2].cast(pa.string())]), ("new",))
    assert tail.tolist() == [0, 0]


@pytest.mark.unit
def test_uids_of_dictionary_codes_follow_appearance_not_dictionary_order() -> None:
    """The writer's dictionary lists ids in its own order, some not in the chunk at all:
    uids still go to ids in the order rows name them, as for strings."""
    coded = pa.chunked_array(
        [
            pa.DictionaryArray.from_arrays(
                pa.array([2, 2, 0, 2], pa.int32()), pa.array(["a", "unused", "c"])
            ),
            pa.DictionaryArray.from_arrays(pa.array([1, 0], pa.int32()), pa.array(["c", "d"])),
        ]
    )
    strings = pa.chunked_array([c.cast(pa.string()) for c in coded.chunks])
    from_strings, from_codes = RequestIds(), RequestIds()
    want = from_strings.uids_of_column(strings)
    assert want.tolist() == [1, 1, 2, 1, 3, 1]
    assert from_codes.uids_of_column(coded).tolist() == want.tolist()
    assert from_codes.names == from_strings.names == ["c", "a", "d"]


@pytest.mark.unit
def test_parts_with_codes_and_strings_in_one_column_concatenate_decoded() -> None:
    """A writer may store a column as codes in one part and as strings in another: read with
    codes, such a column is decoded in every part (the others stay codes)."""
    from mgtrace.schemas.reader import _same_types
    from mgtrace.schemas.tables import table_spec

    schema = table_spec("sched").schema
    names = pa.array(["r1", "r2"]).dictionary_encode()
    coded = pa.table({"req_id": names, "kind": pa.array(["new", "new"]).dictionary_encode()})
    plain = pa.table({"req_id": pa.array(["r3"]), "kind": pa.array(["cached"]).dictionary_encode()})
    with pytest.raises(pa.ArrowInvalid):  # control: as read, they do not concatenate
        pa.concat_tables([coded, plain])
    joined = pa.concat_tables(_same_types([coded, plain], schema))
    assert joined.column("req_id").type == pa.string()
    assert pa.types.is_dictionary(joined.column("kind").type)
    assert joined.column("req_id").to_pylist() == ["r1", "r2", "r3"]
    assert joined.column("kind").to_pylist() == ["new", "new", "cached"]
