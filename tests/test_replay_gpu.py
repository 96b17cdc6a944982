"""On a GPU: the compiled Triton backend replays with the same findings as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.replay_helpers import (
    BOUNDARY_ONLY,
    BOUNDARY_ONLY_BUG,
    BOUNDARY_ONLY_SEED,
    BOUNDARY_ONLY_STEPS,
)

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
        ("async-accepted-race", {"runner": "v1", "mixer": "gdn"}),  # spec decodes run first
        ("stale-condense-row", {"runner": "v1", "length_scale": 0.02, "mixer": "gdn"}),
        (  # a run whose first finding is a lost block-boundary state (cached-state)
            BOUNDARY_ONLY_BUG,
            {**BOUNDARY_ONLY, "seed": BOUNDARY_ONLY_SEED, "steps": BOUNDARY_ONLY_STEPS},
        ),
    ],
)
def test_cuda_backend_matches_reference(tmp_path: Path, bug: str, engine: dict) -> None:
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        **{
            "scenario": "pairs",
            "steps": 300,
            "seed": 0,
            "max_num_seqs": 16,
            "bugs": (bug,),
            "output": out,
            **engine,
        }
    )
    simulate(cfg.validate())
    reader = TraceReader(out)
    ref = replay_trace(reader, RuleSet())
    key = [(f.step, f.rank, f.req_id, f.signature, f.block_id) for f in ref.findings]
    for mirror in (True, False):  # tags on the host, checked against the device; device only
        gpu = replay_trace(reader, RuleSet(), backend="triton", device="cuda", mirror=mirror)
        assert key == [(f.step, f.rank, f.req_id, f.signature, f.block_id) for f in gpu.findings]
    assert ref.findings, "control: the injected bug gives the backends something to find"


def test_pinned_uploads_survive_the_ring_running_out() -> None:
    import numpy as np

    from mgtrace.kernels.staging import Uploads

    uploads = Uploads(torch.device("cuda"), nbytes=4096)
    arrays = [np.arange(i, i + 300, dtype=np.int64) for i in range(40)]  # 2400 bytes each
    on_device = [uploads.upload(a) for a in arrays]
    assert uploads.waits > 0, "control: the ring ran out and had to wait for the device"
    for a, d in zip(arrays, on_device, strict=True):
        assert np.array_equal(d.cpu().numpy(), a)


def test_streamed_backend_with_tiles_matches_reference(tmp_path: Path) -> None:
    """Temporal states split over several programs (as for full-size states) move the
    same tags: same findings as the reference backend."""
    from mgtrace.kernels.runtime import load_triton_kernels
    from mgtrace.kernels.streamed import StreamedTriton
    from mgtrace.replayer.loop import RankReplay
    from mgtrace.replayer.requests import RequestIds
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.replayer.steps import RankTrace
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        scenario="pairs",
        steps=300,
        seed=0,
        max_num_seqs=16,
        bugs=("reorder-threshold-mismatch",),
        output=out,
    )
    simulate(cfg.validate())
    reader = TraceReader(out)
    load_triton_kernels("cuda")
    found = []
    for backend, device in ((None, "cpu"), (StreamedTriton(tiles=4), "cuda")):
        from mgtrace.kernels.reference import run_reference

        rep = RankReplay(
            RankTrace(reader, 0, RequestIds()), RuleSet(), backend or run_reference, device=device
        )
        rep.run()
        found.append([(f.step, f.req_id, f.signature, f.block_id) for f in rep.oracle.findings])
    assert found[0], "control: the injected bug gives the backends something to find"
    assert found[1] == found[0]


def test_triton_segments_on_the_gpu_report_what_one_reference_process_reports(
    tmp_path: Path,
) -> None:
    from mgtrace.replayer.loop import RankReplay, load_backend
    from mgtrace.replayer.parallel import replay_rank_in_segments
    from mgtrace.replayer.requests import RequestIds
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.replayer.steps import RankTrace
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        scenario="pairs", steps=600, seed=0, max_num_seqs=16, length_scale=0.05,
        bugs=("stale-condense-row",), output=out,
    )  # fmt: skip
    simulate(cfg.validate())
    one = RankReplay(
        RankTrace(TraceReader(out), 0, RequestIds()), RuleSet(), load_backend("reference", "cpu")
    )
    one.run()
    got = replay_rank_in_segments(
        TraceReader(out), 0, RuleSet(), backend="triton", device="cuda",
        jobs=3, min_segment=150, warmup=16,
    )  # fmt: skip
    assert got.segments == 3
    assert got.findings == one.oracle.findings
    assert one.oracle.findings, "control: the injected bug gives the segments something to find"


def test_cuda_bisect_and_diff_go_on_into_larger_loads_as_a_whole_load_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay on the device restored from a smaller load's checkpoint, in a replay of a
    larger one, gives the verdict a whole load gives (the reference backend's too)."""
    from mgtrace.replayer import diff as diff_module
    from mgtrace.replayer.bisect import Bisector
    from mgtrace.replayer.diff import diff_rules
    from mgtrace.replayer.rules import RuleSet
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.sim.config import SimConfig
    from mgtrace.sim.engine import simulate

    out = tmp_path / "t"
    cfg = SimConfig(
        scenario="pairs", steps=400, seed=1, runner="v1", bugs=("stale-condense-row",),
        output=out,
    )  # fmt: skip
    simulate(cfg.validate())

    def verdict(first_load: int, backend: str, device: str) -> dict:
        v = Bisector(out, horizon=8, first_load=first_load, backend=backend, device=device)
        data = v.run().to_json()
        for key in ("wall_s", "probes", "steps_replayed", "commands"):
            data.pop(key)
        return data

    whole = verdict(10**9, "reference", "cpu")
    assert whole["status"] == "bad" and whole["first_step"] > 40
    assert verdict(40, "triton", "cuda") == whole

    a, b = RuleSet(), RuleSet.parse("clear_vacated_rows=true")
    reference = diff_rules(TraceReader(out), a, b)
    monkeypatch.setattr(diff_module, "FIRST_LOAD", 40)
    on_device = diff_rules(TraceReader(out), a, b, backend="triton", device="cuda")
    assert reference.first_step is not None and reference.first_step > 40
    assert on_device == reference
