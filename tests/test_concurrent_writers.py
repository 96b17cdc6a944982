"""Two writers aimed at one trace path at once: the second is refused in one sentence,
and the first one's trace stays whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mgtrace.schemas.writer as writer_module
from mgtrace.errors import OutputError
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.sample import SAMPLE_RUN, sample_step, write_sample_trace
from mgtrace.schemas.writer import TraceWriter

pytestmark = pytest.mark.unit


def _write(w: TraceWriter, steps: range, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for step in steps:
        assert w.write_step(0, step, sample_step(step, 8, rng))


@pytest.mark.parametrize("force", [False, True])
def test_a_second_writer_of_one_new_trace_is_refused(tmp_path: Path, force: bool) -> None:
    """Two `simulate -o NEW` (with or without --force) that both found no trace at NEW
    both wrote into it, each over the other's parts and manifest: both exited 0 and left a
    trace whose manifest named parts of other sizes (exit 3). With --force the second one
    even swapped the first one's folder out while it wrote, so the first one's later parts
    landed in the second one's trace. Now the second writer is refused."""
    path = tmp_path / "t"
    first = TraceWriter(path, run=SAMPLE_RUN)
    _write(first, range(0, 20), seed=1)
    with pytest.raises(OutputError, match="another process is writing a trace at"):
        TraceWriter(path, run=SAMPLE_RUN, overwrite=force)
    _write(first, range(20, 40), seed=1)
    first.close()
    reader = TraceReader(path)  # the first trace is whole, and only its own
    assert reader.complete and reader.rows("steps") == 40
    assert reader.unlisted_parts() == [] and reader.open_parts_left() == []
    # control: once the first writer closed, --force replaces its trace
    with TraceWriter(path, run=SAMPLE_RUN, overwrite=True) as again:
        _write(again, range(0, 5), seed=2)
    assert TraceReader(path).rows("steps") == 5


def test_a_writer_that_found_no_trace_refuses_one_written_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that found the folder empty, and whose rival wrote a whole trace there before
    it took the writing lock, wrote its own over that trace without --force (the old parts
    it did not overwrite stayed behind, unlisted). Now it is refused and the trace kept."""
    path = tmp_path / "t"
    write_sample_trace(path, steps=30, rows=8)
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    # as if its check ran before the rival's trace existed
    monkeypatch.setattr(writer_module, "refuse_unless_replaceable", lambda *a: False)
    with pytest.raises(OutputError, match=r"wrote a trace at .* meanwhile"):
        TraceWriter(path, run=SAMPLE_RUN)
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
    assert TraceReader(path).rows("steps") == 30
