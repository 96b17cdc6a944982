"""Single-value mutations of clean simulated traces that a correct engine would turn into
corruption, of four kinds a mutation sweep once found the oracle missed. Each builds a small
clean trace, rewrites one recorded value with the trace writer's own part writer, and
replays: the finding must come at the mutated step, from the check that covers the kind.
The clean traces they start from, replayed clean, are the controls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mgtrace
from mgtrace.schemas.writer import write_part_file

pytestmark = pytest.mark.unit

SMALL = dict(steps=300, seed=1, mamba_block_size=16, length_scale=0.03, max_num_seqs=24)


def _clean(tmp_path: Path, **cfg) -> Path:
    path = tmp_path / "clean.trace"
    assert mgtrace.simulate(path, **SMALL, **cfg).replay().clean
    return path


def _mutate(clean: Path, table: str, where, changes: dict) -> Path:
    """Copy ``clean``; in the one row of ``table`` where ``where(row)``, set each column of
    ``changes`` to ``changes[col](old)``; rewrite that part as the writer does."""
    dst = clean.parent / "mutant.trace"
    shutil.copytree(clean, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for part in [p for p in manifest["parts"] if p["table"] == table]:
        tab = pq.read_table(dst / part["path"])
        hits = [i for i, r in enumerate(tab.to_pylist()) if where(r)]
        if not hits:
            continue
        (i,) = hits
        for name, change in changes.items():
            j = tab.schema.get_field_index(name)
            values = tab.column(j).to_pylist()
            values[i] = change(values[i])
            tab = tab.set_column(j, tab.schema.field(j), pa.array(values, tab.schema.field(j).type))
        info = write_part_file(dst, part["path"], tab)
        part.update(
            rows=info.rows,
            bytes=info.bytes,
            sha256=info.sha256,
            min_step=info.min_step,
            max_step=info.max_step,
        )
        (dst / "manifest.json").write_text(json.dumps(manifest))
        return dst
    raise AssertionError("no row matched")


def _slot(trace: Path, step: int, req: str) -> int:
    return (
        mgtrace.open(trace)
        .sql(f"select req_slot from batch_rows where step={step} and req_id='{req}'")
        .fetchall()[0][0]
    )


def test_prefix_share_from_a_block_the_scheduler_never_gave(tmp_path: Path) -> None:
    # req-000128 hits its family's 64-token prefix (block 3); its row names block 33, which
    # holds another prompt's 64-token state: not a prefix share
    clean = _clean(tmp_path, runner="v1", k=0, scenario="mixed")
    slot = _slot(clean, 260, "req-000128")
    mutant = _mutate(
        clean,
        "block_tables",
        lambda r: r["step"] == 260 and r["row"] == slot and r["table"] == "v1",
        {"block_ids": lambda ids: [*ids[:3], 33, *ids[4:]]},
    )
    r = mgtrace.open(mutant).replay()
    assert r.first_step == 260
    assert {(f.signature, f.req_id) for f in r.findings if f.step == 260} == {
        ("foreign_state:precopy-read:not-held", "req-000128"),
        ("malformed:block-table:not-scheduled", "req-000128"),
    }


def test_running_state_in_the_null_block(tmp_path: Path) -> None:
    clean = _clean(tmp_path, runner="v1", k=3, scenario="mixed", async_scheduling=False)
    mutant = _mutate(
        clean,
        "block_tables",
        lambda r: r["step"] == 30 and r["row"] == 12 and r["table"] == "v1",
        {"block_ids": lambda ids: [*ids[:9], 0, *ids[10:]]},
    )
    r = mgtrace.open(mutant).replay()
    assert r.first_step == 30
    assert {(f.signature, f.req_id) for f in r.findings if f.step == 30} == {
        ("foreign_state:forward-read:null-block", "req-000012"),
        ("foreign_state:postprocess-read:null-block", "req-000012"),
        ("malformed:block-table:not-scheduled", "req-000012"),
    }


def test_live_post_process_row_recorded_as_padding_loses_its_boundary_copy(
    tmp_path: Path,
) -> None:
    clean = _clean(tmp_path, runner="v2", k=3, pp=2, scenario="mixed")
    mutant = _mutate(
        clean,
        "launches",
        lambda r: (
            r["rank"] == 0
            and r["step"] == 113
            and r["kernel"] == "postprocess"
            and r["batch_step"] == 111
            and r["batch_row"] == 2
        ),
        {"req_slot": lambda v: -1, "bt_row": lambda v: -1},
    )
    r = mgtrace.open(mutant).replay()
    assert r.first_step == 113
    assert {f.signature for f in r.findings if f.step == 113} == {
        "wrong_tokens:cached-state:conv:behind",
        "wrong_tokens:cached-state:temporal:behind",
    }


def test_precopy_onto_a_column_that_is_not_the_running_one(tmp_path: Path) -> None:
    clean = _clean(tmp_path, runner="v2", k=0, scenario="steady")
    mutant = _mutate(
        clean,
        "launches",
        lambda r: r["step"] == 148 and r["kernel"] == "precopy" and r["batch_row"] == 0,
        {"state_idx": lambda v: v - 1},
    )
    r = mgtrace.open(mutant).replay()
    assert r.first_step == 148
    assert {f.signature for f in r.findings if f.step == 148} == {
        "malformed:precopy:columns-not-batch-row"
    }


@pytest.mark.parametrize("name", ["v1k3", "v2k3pp2", "v2k0"])
def test_clean_traces_stay_clean(tmp_path: Path, name: str) -> None:
    cfg = {
        "v1k3": dict(runner="v1", k=3, scenario="mixed"),
        "v2k3pp2": dict(runner="v2", k=3, pp=2, scenario="mixed"),
        "v2k0": dict(runner="v2", k=0, scenario="steady"),
    }[name]
    _clean(tmp_path, **cfg)
