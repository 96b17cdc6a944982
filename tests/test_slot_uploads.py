"""Slot uploads: the replay's few small uploads a step, one copy call each.

The ring works the same with a CPU "device" (a plain copy), which is what these tests use;
on a GPU the same code queues non-blocking copies from pinned memory (``test_replay_gpu``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mgtrace.kernels import streamed
from mgtrace.kernels.staging import SlotUploads, layout_bytes, parts, rows_for
from mgtrace.replayer import tags
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate


def test_a_slot_holds_its_parts_aligned_and_lands_on_the_device_copy() -> None:
    layout = parts((np.int64, (3,)), (np.int32, (2, 5)))
    assert layout_bytes(layout) == 32 + 40  # the second part starts on a 16-byte boundary
    slots = SlotUploads("cpu", slot_bytes=1024, slots=2)
    slot = slots.take(layout)
    assert slot is not None
    at, values = slot.host
    at[:] = [7, -1, 1 << 40]
    values[:] = np.arange(10, dtype=np.int32).reshape(2, 5)
    slots.send(slot)
    assert slot.dev[0].tolist() == [7, -1, 1 << 40]
    assert slot.dev[1].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_slots_run_out_until_reset_and_then_serve_the_same_views() -> None:
    layout = parts((np.int32, (128,)))
    slots = SlotUploads("cpu", slot_bytes=1024, slots=2)
    first, second = slots.take(layout), slots.take(layout)
    assert first is not None and second is not None and first.index != second.index
    assert slots.take(layout) is None, "control: a third take while two are in flight"
    assert slots.exhausted == 1
    slots.reset()
    again = slots.take(layout)
    assert again is first  # cut once, cached: no view is made again
    assert not slots.fits(parts((np.int32, (257,))))


def test_rows_are_padded_to_a_few_widths() -> None:
    assert [rows_for(n) for n in (1, 96, 128, 129, 1000)] == [128, 128, 128, 256, 1024]


@pytest.mark.interp
@pytest.mark.parametrize(
    "vector_slot_bytes",
    [4096, 2048],  # every launch fits a slot (seven vectors of 128 rows); none does
)
def test_a_mirrored_replay_through_tiny_rings_matches_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vector_slot_bytes: int
) -> None:
    """Rings of two small slots: launch inputs and tag writes that do not fit a slot take the
    one-off upload, and the rest wait for the device and reuse the slots many times over;
    the device copy is verified at each flush and the findings are the reference's."""
    monkeypatch.setattr(streamed, "VECTOR_SLOTS", 2)
    monkeypatch.setattr(streamed, "VECTOR_SLOT_BYTES", vector_slot_bytes)
    monkeypatch.setattr(tags, "WRITE_SLOTS", 2)
    monkeypatch.setattr(tags, "WRITE_SLOT_BYTES", 2048)  # up to 128 writes a settle
    made: list[SlotUploads] = []
    real_init = SlotUploads.__init__

    def spy(self: SlotUploads, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(SlotUploads, "__init__", spy)
    out = tmp_path / "t"
    cfg = SimConfig(
        seed=0,
        bugs=("stale-condense-row",),
        output=out,
        max_num_seqs=8,
        steps=80,
        scenario="pairs",
        length_scale=0.02,
    )
    simulate(cfg.validate())
    reader = TraceReader(out)
    ref = replay_trace(reader, RuleSet(), backend="reference")
    tri = replay_trace(reader, RuleSet(), backend="triton", device="cpu", mirror=True)
    key = [(f.step, f.req_id, f.kind, f.signature, f.block_id) for f in ref.findings]
    assert key == [(f.step, f.req_id, f.kind, f.signature, f.block_id) for f in tri.findings]
    assert ref.findings, "control: the injected bug gives the replay findings"
    writes, vectors = made  # the tag pool's ring comes with the pool, before any launch
    assert vectors.slot_bytes == vector_slot_bytes
    assert writes.exhausted > 0, "the tag writes' ring ran out and was reused"
    # the launches' ring ran out and was reused, or was never used
    assert (vectors.exhausted > 0) == (vector_slot_bytes == 4096)
