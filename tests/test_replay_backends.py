"""The reference and Triton backends give identical findings on the same traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate

pytestmark = pytest.mark.interp

# Small enough for the interpreter; short requests so that rows are vacated and padded.
SMALL = {"max_num_seqs": 8, "steps": 80, "scenario": "pairs", "length_scale": 0.02}
CASES = [
    ("reorder-threshold-mismatch", {"runner": "v1"}),
    ("stale-condense-row", {"runner": "v1"}),
    ("stale-condense-row", {"runner": "v1", "mixer": "gdn"}),  # spec decodes run first
    ("batch-row-block-table", {"runner": "v2", "pp": 2, "length_scale": 0.05}),
    (None, {"runner": "v2"}),
]


def _signature(findings) -> list[tuple]:
    return [(f.step, f.rank, f.req_id, f.kind, f.signature, f.block_id) for f in findings]


@pytest.mark.parametrize(("bug", "engine"), CASES)
def test_backends_agree(tmp_path: Path, bug: str | None, engine: dict) -> None:
    out = tmp_path / "t"
    cfg = SimConfig(seed=0, bugs=(bug,) if bug else (), output=out, **{**SMALL, **engine})
    simulate(cfg.validate())
    reader = TraceReader(out)
    for rules in (RuleSet(), RuleSet.parse("bt_row_is_req=true,reorder_threshold=1+k")):
        ref = replay_trace(reader, rules, backend="reference")
        # tags on a host pool, the kernels on a copy verified against it; tags moved by the
        # kernels themselves
        for mirror in (True, False):
            tri = replay_trace(reader, rules, backend="triton", device="cpu", mirror=mirror)
            assert _signature(ref.findings) == _signature(tri.findings)
            assert ref.steps == tri.steps
        if bug and rules == RuleSet():
            assert ref.findings, "control: the injected bug must give the backends work"
