"""The reference backend against hand-computed align semantics (no Triton involved)."""

from __future__ import annotations

import numpy as np
import pytest

from mgtrace.kernels import BlockTables, StatePool, StateSpec, run_reference
from mgtrace.kernels import reference as reference_mod
from mgtrace.kernels.gen import random_case
from mgtrace.kernels.plan import plan_launch, trunc_div
from mgtrace.kernels.validate import validate_launch
from tests.kernel_builders import filled_pool, postprocess, precopy

pytestmark = pytest.mark.unit


def test_truncating_division_matches_gpu_integer_division() -> None:
    x = np.array([-9, -8, -5, -4, -1, 0, 3, 4, 9], dtype=np.int32)
    assert trunc_div(x, 4).tolist() == [-2, -2, -1, -1, 0, 0, 0, 1, 2]
    # Control: floor division differs on the negatives.
    assert (x // 4).tolist() != trunc_div(x, 4).tolist()


def test_postprocess_decisions_by_hand() -> None:
    # B=4, k=2. Rows: (computed, scheduled, draft, accepted, state_idx)
    # 0: all drafts accepted and the sequence ends on a boundary: in place, bias 2, reset.
    # 1: one draft accepted, crossing: dst = src - 1, bias 1, count kept.
    # 2: no boundary reached: nothing.
    # 3: prefill chunk ending on a boundary: in place, bias 0: no copy, reset.
    launch = postprocess(
        [0, 1, 2, 3],
        accepted=[3, 2, 1, 1],
        state_idx=[1, 2, 2, 1],
        computed=[5, 6, 8, 0],
        scheduled=[3, 3, 3, 8],
        draft=[2, 2, 2, 0],
    )
    plan = plan_launch(launch)
    assert plan.copies.tolist() == [True, True, False, False]
    assert plan.dst_col[:2].tolist() == [1, 1]
    assert plan.bias[:2].tolist() == [2, 1]
    assert plan.accepted_out.tolist() == [1, 2, 1, 1]
    # The same rows in precomputed mode (new computed = R + accepted - 1) decide the same.
    running = np.array([6, 7, 9, 8])
    pre = postprocess(
        [0, 1, 2, 3],
        [3, 2, 1, 1],
        [1, 2, 2, 1],
        running + np.array([2, 1, 0, 0]),
        mode="precomputed",
    )
    other = plan_launch(pre)
    assert other.copies.tolist() == plan.copies.tolist()
    assert other.accepted_out.tolist() == plan.accepted_out.tolist()


def _conv_pool(layout: str, width: int = 5, dim: int = 2) -> StatePool:
    shape = (width, dim) if layout == "SD" else (dim, width)
    specs = [StateSpec(0, "conv", shape, "uint8", layout), StateSpec(0, "temporal", (3,), "uint8")]
    pool = StatePool(specs, 8)
    pool.numpy()[:] = np.arange(pool.numpy().size) % 251
    return pool


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_same_block_conv_shift_is_a_memmove(layout: str) -> None:
    pool = _conv_pool(layout)
    tables = BlockTables([np.array([[1, 2, 2, 4, 5]], dtype=np.int32)])
    before = pool.state_view(0, 2).copy()
    # Columns 1 and 2 hold the same block: a left shift by 2 tokens inside block 2.
    run_reference(precopy([0], [2], [1], [2]), pool, tables)
    window = before.reshape((5, 2) if layout == "SD" else (2, 5))
    expected = window.copy()
    if layout == "SD":
        expected[:3] = window[2:]
    else:
        expected[:, :3] = window[:, 2:]
    assert pool.state_view(0, 2).tolist() == expected.ravel().tolist()


def test_temporal_copy_takes_the_speculative_column_and_natural_size() -> None:
    specs = [StateSpec(0, "temporal", (5,), "uint8")]
    pool = filled_pool(specs, 8, page_bytes=8)
    tables = BlockTables([np.array([[1, 2, 3, 4, 5]], dtype=np.int32)])
    before = pool.numpy().copy()
    run_reference(precopy([0], [1], [2], [2]), pool, tables)  # src col 2 + bias 2 -> col 4
    after = pool.numpy()
    assert after[2 * 8 : 2 * 8 + 5].tolist() == before[5 * 8 : 5 * 8 + 5].tolist()
    # Page padding beyond the natural size is not copied.
    assert after[2 * 8 + 5 : 3 * 8].tolist() == before[2 * 8 + 5 : 3 * 8].tolist()


def test_padded_rows_and_fresh_requests_do_nothing() -> None:
    pool = _conv_pool("SD")
    tables = BlockTables([np.array([[1, 2, 3, 4, 5], [6, 7, 0, 3, 1]], dtype=np.int32)])
    before = pool.numpy().copy()
    run_reference(precopy([-1, 1], [3, 3], [1, -1], [0, 0]), pool, tables)
    assert np.array_equal(pool.numpy(), before)


@pytest.mark.parametrize("seed", range(40))
def test_slice_path_matches_the_byte_plan(seed: int, monkeypatch) -> None:
    case = random_case(seed)
    a, b = case.pool.clone(), case.pool.clone()
    v = validate_launch(case.launch, case.pool, case.tables)
    run_reference(case.launch, a, case.tables, validation=v)
    monkeypatch.setattr(reference_mod, "PLAN_LIMIT", 0)
    run_reference(case.launch, b, case.tables, validation=v)
    assert np.array_equal(a.numpy(), b.numpy())


def test_pages_past_two_gib_are_addressed_in_64_bits() -> None:
    page = 2**31 + 24
    specs = [StateSpec(0, "conv", (4, 2), "int16", "SD"), StateSpec(0, "temporal", (3,), "int32")]
    pool = StatePool.sparse(specs, 3, page_bytes=page)
    data = pool.numpy()
    data[page : page + 28] = np.arange(1, 29, dtype=np.uint8)
    tables = BlockTables([np.array([[1, 2, 1]], dtype=np.int32)])
    run_reference(precopy([0], [1], [0], [0]), pool, tables)  # block 1 -> block 2
    assert data[2 * page : 2 * page + 28].tolist() == list(range(1, 29))
    # In 32 bits, 2 * page wraps to 48: nothing was written there.
    wrapped = (2 * page) % 2**32
    assert wrapped == 48
    assert not data[wrapped : wrapped + 28].any()


@pytest.mark.parametrize("slices", [False, True])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_a_wrapped_negative_bias_keeps_no_conv_token(
    slices: bool, layout: str, monkeypatch
) -> None:
    """A post-process bias that wrapped int32 to -2**31 slides the conv window by
    ``width - bias`` tokens, which wraps too: the device copies nothing."""
    if slices:
        monkeypatch.setattr(reference_mod, "PLAN_LIMIT", 0)
    shape = (5, 2) if layout == "SD" else (2, 5)
    pool = filled_pool([StateSpec(0, "conv", shape, "uint8", layout)], 8)  # conv only
    tables = BlockTables([np.array([[1, 2, 3, 4, 5]], dtype=np.int32)])
    # new_computed 16, accepted 1 - 2**31: running 2**31 + 16 wraps, bias 2**31 wraps.
    launch = postprocess([0], [1 - 2**31], [1], [16], mode="precomputed", block=16)
    before = pool.numpy().copy()
    result = run_reference(launch, pool, tables)
    assert result.validation.ok and result.validation.copies.bias.tolist() == [-(2**31)]
    assert np.array_equal(pool.numpy(), before)
    assert result.accepted_out.tolist() == [1 - 2**31]
    # Control: bias 2 (running 14) shifts the window from column 1 into column 0.
    run_reference(postprocess([0], [3], [1], [16], mode="precomputed", block=16), pool, tables)
    assert not np.array_equal(pool.numpy(), before)
