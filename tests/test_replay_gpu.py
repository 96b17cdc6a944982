"""On a GPU: the compiled Triton backend replays with the same findings as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    ("bug", "engine"),
    [
        ("reorder-threshold-mismatch", {"runner": "v1"}),
        ("batch-row-block-table", {"runner": "v2", "pp": 2}),
        ("stale-condense-row", {"runner": "v1", "length_scale": 0.02}),
    ],
)
def test_cuda_backend_matches_reference(tmp_path: Path, bug: str, engine: dict) -> None:
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(**{"scenario": "pairs", "steps": 300, "seed": 0, "max_num_seqs": 16,
                       "bugs": (bug,), "output": out, **engine})
    simulate(cfg.validate())
    reader = TraceReader(out)
    ref = replay_trace(reader, RuleSet())
    gpu = replay_trace(reader, RuleSet(), backend="triton", device="cuda")
    key = [(f.step, f.rank, f.req_id, f.signature, f.block_id) for f in ref.findings]
    assert key == [(f.step, f.rank, f.req_id, f.signature, f.block_id) for f in gpu.findings]
    assert ref.findings, "control: the injected bug gives the backends something to find"
