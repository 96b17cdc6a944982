"""GPU tier: the same differential with compiled kernels, plus a CUDA-graph replay.

Run it in its own process (``pytest -m gpu``): Triton decides per process whether kernels
are interpreted, and the interp tier asks for interpretation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mgtrace.errors import UsageError
from mgtrace.kernels import run_reference
from mgtrace.kernels.check import run_check
from mgtrace.kernels.gen import random_case
from mgtrace.kernels.validate import validate_launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def kernels():
    from mgtrace.kernels.runtime import load_triton_kernels

    try:
        return load_triton_kernels("cuda")
    except UsageError as exc:
        pytest.skip(str(exc))


def test_campaign_on_the_gpu(kernels) -> None:
    report = run_check(150, 4242, False, "cuda")
    assert report.ok, report.mismatches
    assert report.compared["triton"] == 150


def test_postprocess_replayed_from_a_cuda_graph(kernels) -> None:
    for seed in range(40):
        case = random_case(seed, kernel="postprocess")
        v = validate_launch(case.launch, case.pool, case.tables)
        if v.ok and v.copies.rows.size:
            break
    launch = v.sanitized(case.launch)
    ref = case.pool.clone()
    expected = run_reference(launch, ref, case.tables)
    pool = case.pool.clone("cuda")
    layout = kernels.DeviceLayout.build(pool, case.tables)

    def dev(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(launch.column(name))).cuda()

    args = [dev(c) for c in ("req_slot", "num_accepted", "state_idx")]
    computed = dev("num_computed")
    decision = launch.mode == "decision"
    extra = [
        dev("num_scheduled") if decision else computed,
        computed,
        dev("num_draft") if decision else computed,
    ]
    out = args[1].clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Compile outside the capture; the warm-up copies are undone below.
        kernels.launch_postprocess(
            layout,
            len(pool.specs),
            *args,
            *extra,
            out,
            block_size=launch.block_size,
            precomputed=not decision,
            row_is_slot=launch.row_rule == "req_slot",
        )
    torch.cuda.synchronize()
    pool.buffer.copy_(case.pool.buffer.cuda())
    with torch.cuda.graph(graph, stream=stream):
        kernels.launch_postprocess(
            layout,
            len(pool.specs),
            *args,
            *extra,
            out,
            block_size=launch.block_size,
            precomputed=not decision,
            row_is_slot=launch.row_rule == "req_slot",
        )
    graph.replay()
    torch.cuda.synchronize()
    assert np.array_equal(pool.buffer.cpu().numpy(), ref.buffer.numpy())
    assert out.cpu().numpy().tolist() == expected.accepted_out.tolist()


def test_streamed_counts_of_a_refused_in_place_row_match_the_host_on_the_gpu() -> None:
    """The compiled streamed backend on a row refused for its block id: the row never runs,
    yet its in-place count is reset to 1 as on the host (the kernel's counts are checked
    against the host's decision by ``verify``)."""
    from mgtrace.kernels import BlockTables, StatePool, StateSpec
    from mgtrace.kernels.streamed import StreamedTriton
    from tests.kernel_builders import postprocess

    specs = [StateSpec(0, "conv", (4, 2), "uint8", "SD"), StateSpec(0, "temporal", (3,), "uint8")]
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    table[0, 1] = 25  # row 0's in-place column, past the pool
    launch = postprocess([0, 1], [3, 3], [1, 1], [8, 8], mode="precomputed")
    backend = StreamedTriton(tiles=1)
    result = backend(launch, StatePool(specs, 20, device="cuda"), BlockTables([table]))
    assert [(p.batch_row, p.what) for p in result.validation.problems] == [(0, "block_id")]
    assert result.accepted_out.tolist() == [1, 1]
    backend.verify()  # raises KernelDisagreement on any difference


def test_vllms_kernels_compiled_agree(kernels) -> None:
    """vLLM's own align kernels, compiled, on the same cases; skipped, and said so, where the
    GPU machine cannot import vLLM (benchmarks/h200_vllm_kernels.sh brings it along). Last in
    this file: a launch that faults poisons the process's CUDA context for the tests after it."""
    from mgtrace.kernels.vllm_peer import load_vllm_kernels

    try:
        load_vllm_kernels("cuda")
    except UsageError as exc:
        pytest.skip(str(exc))
    report = run_check(150, 4242, True, "cuda")
    assert report.ok, report.mismatches
    assert report.compared["vllm"] >= 100, report.skipped
