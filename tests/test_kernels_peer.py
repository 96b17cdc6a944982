"""Peer tier: byte-identical to vLLM's own align kernels on the same pools and inputs.

vLLM's ``postprocess_mamba_fused_kernel``, ``precopy_mamba_align_fused_kernel`` and
``get_aligned_state_indices_multi_group_kernel`` run unmodified (interpreted on the CPU),
on the very bytes the reference backend reads.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import replace

import numpy as np
import pytest

from mgtrace.errors import UsageError
from mgtrace.kernels import BlockTables, StatePool, StateSpec, run_reference
from mgtrace.kernels.check import run_check
from mgtrace.kernels.gen import random_case
from mgtrace.kernels.validate import validate_launch
from tests.kernel_builders import filled_pool, postprocess, precopy, two_state_pool

pytestmark = pytest.mark.peer


@pytest.fixture(scope="module")
def vllm():
    from mgtrace.kernels.runtime import load_triton_kernels
    from mgtrace.kernels.vllm_peer import load_vllm_kernels

    load_triton_kernels("cpu")
    try:
        return load_vllm_kernels("cpu")
    except UsageError as exc:
        pytest.skip(f"{exc} (the peer tier needs vLLM installed with --no-deps: make peer)")


def installed_vllm() -> str:
    """The installed vLLM's version, from its package metadata (the report reads the module)."""
    return importlib.metadata.version("vllm")


def _against_vllm(vllm, case, launch=None, *, run_launch=None):
    """Reference on ``launch`` vs vLLM on ``run_launch`` (default: the same launch)."""
    from mgtrace.kernels.vllm_peer import comparable, run_vllm

    launch = launch or case.launch
    v = validate_launch(launch, case.pool, case.tables)
    safe = v.sanitized(launch)
    has_idx = case.has_idx_mapping or bool(v.bad.any())
    target = run_launch or safe
    if comparable(target, has_idx):
        return None
    ref_pool, vllm_pool = case.pool.clone(), case.pool.clone()
    ref = run_reference(launch, ref_pool, case.tables, validation=v)
    out = run_vllm(vllm, target, vllm_pool, case.tables, has_idx_mapping=has_idx, tiles=case.tiles)
    expected = ref.accepted_out if launch.kernel == "postprocess" else ref.aligned_indices
    same_out = (expected is None and out is None) or np.array_equal(expected, out)
    return np.array_equal(ref_pool.numpy(), vllm_pool.numpy()) and same_out


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("kernel", ["precopy", "postprocess"])
def test_copy_kernels_are_byte_identical(vllm, layout: str, kernel: str) -> None:
    compared = 0
    for seed in range(25):
        case = random_case(seed, layout=layout, kernel=kernel, row_rule="req_slot")
        same = _against_vllm(vllm, case)
        if same is None:
            continue
        assert same, f"seed {seed}: {case.describe()}"
        compared += 1
    assert compared >= 20


def test_aligned_indices_are_identical(vllm) -> None:
    compared = 0
    for seed in range(20):
        case = random_case(seed, kernel="aligned_indices", row_rule="batch_row")
        same = _against_vllm(vllm, case)
        if same is None:
            continue
        assert same, f"seed {seed}: {case.describe()}"
        compared += 1
    assert compared >= 10


def test_wrong_block_size_mismatches(vllm) -> None:
    """Control: vLLM run with a block size one larger than the reference's must differ."""
    case = random_case(0, kernel="postprocess", row_rule="req_slot")
    pool = two_state_pool("SD", num_blocks=40)
    tables = BlockTables([np.arange(1, 33, dtype=np.int32).reshape(4, 8)])
    launch = postprocess([0, 1, 2], [3, 2, 1], [1, 2, 1], [5, 6, 0], [3, 3, 8], [2, 2, 0])
    case = replace(case, pool=pool, tables=tables, launch=launch, has_idx_mapping=True)
    assert _against_vllm(vllm, case) is True
    wrong = replace(launch, block_size=launch.block_size + 1)
    assert _against_vllm(vllm, case, run_launch=wrong) is False


def test_pages_past_two_gib_match_vllm(vllm) -> None:
    from mgtrace.kernels.vllm_peer import run_vllm

    page = 2**31 + 56
    specs = [
        StateSpec(0, "conv", (5, 2), "bfloat16", "SD"),
        StateSpec(0, "temporal", (7,), "int32"),
    ]
    tables = BlockTables([np.array([[1, 2, 1, 2]], dtype=np.int32)])
    for run in ("reference", "vllm"):
        pool = StatePool.sparse(specs, 3, page_bytes=page)
        pool.numpy()[page : page + 48] = np.arange(1, 49, dtype=np.uint8)
        launch = precopy([0], [1], [0], [1])  # block 1 -> block 2, shifted by one token
        if run == "reference":
            run_reference(launch, pool, tables)
            expected = pool.numpy()[2 * page : 2 * page + 48].copy()
        else:
            run_vllm(vllm, launch, pool, tables)
            assert pool.numpy()[2 * page : 2 * page + 48].tolist() == expected.tolist()
            assert not pool.numpy()[112:160].any()  # where a 32-bit offset would land


def test_check_campaign_against_vllm_is_clean(vllm) -> None:
    report = run_check(60, 20261130, True, "cpu")
    assert report.ok, report.mismatches
    assert report.vllm_version == installed_vllm()
    assert report.compared.get("vllm", 0) >= 40


def test_check_kernels_cli_against_vllm(vllm) -> None:
    """The command users run to learn whether replay is faithful to their vLLM."""
    from tests.conftest import run_cli

    proc = run_cli("check-kernels", "--against", "vllm", "--cases", "20", "--seed", "11", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["mismatches"] == [] and report["against_vllm"]
    assert report["vllm_version"] == installed_vllm() and report["compared"]


def test_wrapped_bias_and_a_refused_in_place_row_match_vllm(vllm) -> None:
    """Decisions on int32 counts that wrapped, and the count reset of an in-place row whose
    block lies past the pool, as vLLM's kernel makes them."""
    from mgtrace.kernels.vllm_peer import run_vllm

    # A bias wrapped to -2**31 with a conv state: vLLM's window wraps as well, copies nothing.
    pool = StatePool([StateSpec(0, "conv", (4, 2), "uint8", "SD")], 20)
    pool.numpy()[:] = np.arange(pool.numpy().size) % 251
    tables = BlockTables([np.array([[1, 2, 3, 4, 5, 0, 0, 0]], dtype=np.int32)])
    launch = postprocess([0], [1 - 2**31], [1], [16], mode="precomputed", block=16)
    ref_pool, vllm_pool = pool.clone(), pool.clone()
    ref = run_reference(launch, ref_pool, tables)
    out = run_vllm(vllm, launch, vllm_pool, tables)
    assert ref.accepted_out.tolist() == out.tolist() == [1 - 2**31]
    assert np.array_equal(ref_pool.numpy(), vllm_pool.numpy())
    assert np.array_equal(ref_pool.numpy(), pool.numpy())
    # In place (column 1, bias 2) through block 25: outside a 20-block pool the row is
    # refused; vLLM, given a pool that holds block 25, resets the count before any copy.
    specs = [StateSpec(0, "conv", (4, 2), "uint8", "SD"), StateSpec(0, "temporal", (3,), "uint8")]
    tables = BlockTables([np.array([[1, 2, 3, 25, 5, 6, 7, 8]], dtype=np.int32)])
    launch = postprocess([0], [3], [1], [8], mode="precomputed")
    ref = run_reference(launch, StatePool(specs, 20), tables)
    assert [p.what for p in ref.validation.problems] == ["block_id"]
    assert (
        ref.accepted_out.tolist() == run_vllm(vllm, launch, StatePool(specs, 30), tables).tolist()
    )


def test_layouts_vllms_compiled_ds_copy_would_fault_on_are_named(vllm) -> None:
    """vLLM's DS conv copy loads whole elements: compiled, a state off its element alignment
    faults the GPU (seen on an H200), so such pools are kept from vLLM there and named. The
    interpreter copes, and there the same launch on that layout still equals the reference,
    as it does once the pages are element-aligned."""
    from mgtrace.kernels.vllm_peer import alignment_problem

    case = random_case(4242)  # a DS bfloat16 conv state in 25-byte pages
    problem = alignment_problem(case.pool)
    assert problem is not None and "2-byte elements" in problem and "25-byte pages" in problem
    assert _against_vllm(vllm, case) is True
    aligned = filled_pool(list(case.pool.specs), case.pool.num_blocks, page_bytes=26, seed=1)
    assert alignment_problem(aligned) is None  # control: the same state in even pages
    assert _against_vllm(vllm, replace(case, pool=aligned)) is True
    sd = two_state_pool("SD", page_pad=2)  # 41-byte pages; SD goes through a byte-safe copy
    assert alignment_problem(sd) is None
    assert alignment_problem(two_state_pool("DS", page_pad=2)) is not None
