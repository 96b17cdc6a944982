"""The forward model runs a step's two kernel groups in the engine's order.

vLLM's Mamba2 layer runs its prefill split first and its decodes after (each reads its rows'
states, then writes them); GDN runs its spec decodes first. A decode whose block table points
at the block a prefill of the same step writes reads that write under Mamba2, and the state
from before under GDN. The trace below is a clean simulated run with one decode row of one
step pointed at a prefill's running block: it reads and writes there.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from mgtrace.replayer.findings import FOREIGN_STATE
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.minimize import MemoryTrace, load_memory
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import spec_decodes_run_first
from mgtrace.schemas.reader import TraceReader
from tests.replay_helpers import set_root, sim_trace


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("order"))


def _column(rows: pa.Table, name: str) -> np.ndarray:
    return pc.fill_null(rows.column(name), -1).to_numpy().copy()  # writable


def _decode_on_a_prefill_block(k: int = 3) -> tuple[MemoryTrace, int, str, str]:
    """The clean trace with one decode row reading, at its window column, the block a prefill
    row of its step writes: (trace, step, decode's request, prefill's request)."""
    reader = TraceReader(sim_trace(None, 3, 400, scenario="pairs", k=k))
    trace = load_memory(reader)
    rows = trace.tables_["batch_rows"]
    step, split = _column(rows, "step"), np.asarray(rows.column("mamba_split").cast(pa.string()))
    computed, prev = _column(rows, "num_computed"), _column(rows, "prev_state_col")
    col = _column(rows, "state_col")
    prefill = split == "prefill"
    # a decode that does not move column, in a step that also runs a prefill with context
    decode = (split == "decode") & (prev == col) & (col >= 0)
    steps = np.intersect1d(step[decode], step[prefill & (computed > 0)])
    assert len(steps), "the run has no step with a prefill beside a decode"
    s = int(steps[0])
    p = int(np.flatnonzero(prefill & (computed > 0) & (step == s))[0])
    d = int(np.flatnonzero(decode & (step == s))[0])
    changed = {
        "req_slot": _column(rows, "req_slot"),
        "state_col": col.copy(),
        "prev_state_col": prev.copy(),
        "accepted_prev": _column(rows, "accepted_prev"),
    }
    changed["req_slot"][d] = changed["req_slot"][p]
    changed["state_col"][d] = changed["prev_state_col"][d] = col[p]
    changed["accepted_prev"][d] = 1  # the window column is the running column itself
    for name, values in changed.items():
        at = rows.column_names.index(name)
        rows = rows.set_column(at, rows.schema.field(at), pa.array(values, pa.int32()))
    trace.tables_["batch_rows"] = rows
    names = rows.column("req_id")
    return trace, s, names[d].as_py(), names[p].as_py()


def _findings(trace: MemoryTrace, step: int) -> list:
    result = replay_trace(trace, RuleSet())  # type: ignore[arg-type]
    return [f for f in result.findings if f.step == step]


def _of(found: list, req: str, what: str) -> list:
    return [f for f in found if f.req_id == req and f.mechanism.startswith(what)]


def test_a_mamba2_decode_reads_what_a_prefill_of_its_step_wrote() -> None:
    trace, step, decode, prefill = _decode_on_a_prefill_block()
    assert not spec_decodes_run_first(trace.manifest.run)
    found = _findings(trace, step)
    reads = _of(found, decode, "decode-read")
    assert any(
        f.kind == FOREIGN_STATE and f.writer_req_id == prefill and f.writer_step == step
        for f in reads
    ), [f.detail for f in reads]
    # the prefill read before the decode wrote onto its block; the decode's write came last
    assert not _of(found, prefill, "prefill-read"), [f.detail for f in found]
    after = _of(found, prefill, "next-state")
    assert any(f.writer_req_id == decode and f.writer_step == step for f in after)


def _as_gdn(trace: MemoryTrace) -> None:
    run = replace(
        trace.manifest.run,
        builder_reorder_thresholds={"GDNAttentionMetadataBuilder": 4},
    )
    trace.manifest = replace(trace.manifest, run=run)
    assert spec_decodes_run_first(run)


def test_a_gdn_spec_decode_reads_before_the_prefills_write() -> None:
    """The control: the same rows under GDN's order read the block as the step found it."""
    trace, step, decode, prefill = _decode_on_a_prefill_block()
    _as_gdn(trace)
    found = _findings(trace, step)
    reads = _of(found, decode, "decode-read")
    assert reads, "the decode reads a block that is not its own: some finding"
    assert not any(f.writer_step == step for f in reads), [f.detail for f in reads]
    # and the prefill, second, reads what the decode just wrote onto its block
    reads = _of(found, prefill, "prefill-read")
    assert any(f.writer_req_id == decode and f.writer_step == step for f in reads)


def test_gdn_without_mtp_runs_every_row_in_one_call() -> None:
    """Without drafts GDN has no spec-decode group: prefills and decodes share one call, so
    neither row sees the other's write of the step."""
    trace, step, decode, prefill = _decode_on_a_prefill_block(k=0)
    _as_gdn(trace)
    found = _findings(trace, step)
    reads = _of(found, decode, "decode-read")
    assert reads and not any(f.writer_step == step for f in reads), [f.detail for f in reads]
    assert not _of(found, prefill, "prefill-read"), [f.detail for f in found]
    # control: the same rows under Mamba2 (two groups even without MTP) do see the write
    trace, step, decode, prefill = _decode_on_a_prefill_block(k=0)
    reads = _of(_findings(trace, step), decode, "decode-read")
    assert any(f.writer_req_id == prefill and f.writer_step == step for f in reads)


def test_a_gdn_step_without_drafts_runs_every_row_in_one_call() -> None:
    """With MTP, a step without a spec-decode row has no spec mask either: GDN's builder
    then runs one call, and the recorder keeps its threshold (1) for that step."""
    trace, step, decode, prefill = _decode_on_a_prefill_block()
    _as_gdn(trace)
    steps = trace.tables_["steps"]
    at = steps.column_names.index("mamba_threshold")
    values = pc.fill_null(steps.column(at), -1).to_numpy().copy()
    values[pc.equal(steps.column("step"), step).to_numpy(zero_copy_only=False)] = 1
    mask = pa.array(values < 0)
    trace.tables_["steps"] = steps.set_column(
        at, steps.schema.field(at), pa.array(values, pa.int32(), mask=np.asarray(mask))
    )
    found = _findings(trace, step)
    assert not _of(found, prefill, "prefill-read"), [f.detail for f in found]
    reads = _of(found, decode, "decode-read")
    assert reads and not any(f.writer_step == step for f in reads), [f.detail for f in reads]
    # the control is test_a_gdn_spec_decode_reads_before_the_prefills_write: the same rows
    # at the recorded threshold (1+k) run spec decodes first, and the prefill reads the
    # decode's write
