"""Interp tier: mgtrace's Triton kernels (``TRITON_INTERPRET=1``) against the reference.

Grids stay small (a few rows and states, one or two tiles): the interpreter runs a few
hundred programs a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from mgtrace.kernels import AlignLaunch, BlockTables, StatePool, StateSpec, run_reference
from mgtrace.kernels.check import run_check
from mgtrace.kernels.runtime import load_triton_kernels
from mgtrace.kernels.validate import find_hazards, validate_launch
from tests.kernel_builders import postprocess, precopy

pytestmark = pytest.mark.interp

DTYPES = ("uint8", "int16", "bfloat16", "float32", "float64")


@pytest.fixture(scope="module")
def kernels():
    return load_triton_kernels("cpu")


@dataclass
class Drawn:
    pool: StatePool
    tables: BlockTables
    launch: AlignLaunch
    tiles: int
    chunk: int


@st.composite
def launches(draw) -> Drawn:
    """A small pool, distinct-id block tables and one launch with the edge cases mixed in."""
    k = draw(st.integers(1, 3))
    block = draw(st.integers(k + 1, 8))
    layout = draw(st.sampled_from(["SD", "DS"]))
    groups = draw(st.integers(1, 2))
    specs = []
    for i in range(draw(st.integers(1, 3))):
        g = i % groups
        dtype = draw(st.sampled_from(DTYPES))
        if draw(st.booleans()):
            width, dim = draw(st.integers(k + 1, k + 3)), draw(st.integers(1, 5))
            specs.append(
                StateSpec(
                    g, "conv", (width, dim) if layout == "SD" else (dim, width), dtype, layout
                )
            )
        else:
            specs.append(StateSpec(g, "temporal", (draw(st.integers(1, 70)),), dtype))
    groups = 1 + max(s.group for s in specs)
    # Odd gaps between states and an odd page make source and destination alignments differ.
    offsets, pos = [], 0
    for s in specs:
        pos += draw(st.integers(0, 5))
        offsets.append(pos)
        pos += s.nbytes
    page = pos + draw(st.integers(0, 9))
    n = draw(st.integers(1, 4))
    slots_n = n + 2
    cols = k + 6
    num_blocks = slots_n * cols + 2
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    tables = [
        rng.permutation(np.arange(1, num_blocks))[: slots_n * cols].reshape(slots_n, cols)
        for _ in range(groups)
    ]
    slots = rng.permutation(slots_n)[:n]
    slots = np.where([draw(st.booleans()) and draw(st.booleans()) for _ in range(n)], -1, slots)
    rule = draw(st.sampled_from(["req_slot", "batch_row"]))
    rows = slots if rule == "req_slot" else np.arange(n)
    if draw(st.sampled_from(["precopy", "postprocess"])) == "precopy":
        dst = np.array([draw(st.integers(1, cols - k - 1)) for _ in range(n)])
        src = np.array([draw(st.sampled_from([-1, d, d - 1, max(d - 2, 0)])) for d in dst])
        bias = np.array([draw(st.integers(0, k)) for _ in range(n)])
        if draw(st.booleans()):  # same block under two columns: the conv memmove path
            i = draw(st.integers(0, n - 1))
            if rows[i] >= 0 and src[i] >= 0:
                for t in tables:
                    t[rows[i], dst[i]] = t[rows[i], src[i]]
        launch = precopy(slots, dst, src, bias, rule=rule)
    else:
        computed = np.array([draw(st.integers(0, 3 * block)) for _ in range(n)])
        accepted = np.array([draw(st.integers(1, k + 1)) for _ in range(n)])
        running = computed + 1
        state = -(-(running + k) // block) - 1
        mode = draw(st.sampled_from(["decision", "precomputed"]))
        launch = AlignLaunch(
            "postprocess",
            batch_row=np.arange(n),
            req_slot=slots,
            row_rule=rule,
            mode=mode,
            num_accepted=accepted,
            state_idx=state,
            num_computed=computed if mode == "decision" else running + accepted - 1,
            num_scheduled=np.full(n, 1 + k),
            num_draft=np.full(n, k),
            block_size=block,
            num_speculative_tokens=k,
        )
    if draw(st.booleans()):  # the null block where one row writes or reads
        i = draw(st.integers(0, n - 1))
        if rows[i] >= 0:
            tables[0][rows[i], draw(st.integers(0, cols - 1))] = 0
    pool = StatePool(specs, num_blocks, page_bytes=page, offsets=offsets)
    pool.buffer.copy_(torch.from_numpy(rng.integers(0, 256, pool.buffer.numel(), dtype=np.uint8)))
    return Drawn(
        pool, BlockTables(tables), launch, draw(st.integers(1, 2)), draw(st.sampled_from([8, 1024]))
    )


def _both(kernels, drawn: Drawn):
    ref_pool, tri_pool = drawn.pool.clone(), drawn.pool.clone()
    v = validate_launch(drawn.launch, drawn.pool, drawn.tables)
    ref = run_reference(drawn.launch, ref_pool, drawn.tables, validation=v)
    tri = kernels.run_triton(
        drawn.launch, tri_pool, drawn.tables, validation=v, tiles=drawn.tiles, chunk=drawn.chunk
    )
    return ref_pool, tri_pool, ref, tri, v


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(launches())
def test_triton_matches_reference(kernels, drawn: Drawn) -> None:
    ref_pool, tri_pool, ref, tri, v = _both(kernels, drawn)
    assert find_hazards(v, drawn.pool) == []
    assert np.array_equal(ref_pool.numpy(), tri_pool.numpy())
    if ref.accepted_out is not None:
        assert ref.accepted_out.tolist() == tri.accepted_out.tolist()


def test_the_comparison_has_teeth(kernels) -> None:
    """Control: Triton compiled with the other row rule disagrees with the reference."""

    def differs(drawn: Drawn) -> bool:
        flipped = drawn.launch.with_row_rule(
            "batch_row" if drawn.launch.row_rule == "req_slot" else "req_slot"
        )
        ref, tri = drawn.pool.clone(), drawn.pool.clone()
        v = validate_launch(drawn.launch, drawn.pool, drawn.tables)
        w = validate_launch(flipped, drawn.pool, drawn.tables)
        if not (v.ok and w.ok):
            return False
        run_reference(drawn.launch, ref, drawn.tables, validation=v)
        kernels.run_triton(flipped, tri, drawn.tables, validation=w)
        return not np.array_equal(ref.numpy(), tri.numpy())

    # Finding one is the point; shrinking it would only cost time.
    found = find(
        launches(),
        differs,
        settings=settings(
            max_examples=300,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
        ),
    )
    assert found is not None


def _conv_case(layout: str, elem: str = "uint8", dim: int = 3, width: int = 5):
    shape = (width, dim) if layout == "SD" else (dim, width)
    specs = [StateSpec(0, "conv", shape, elem, layout), StateSpec(0, "temporal", (11,), "uint8")]
    pool = StatePool(specs, 8, page_bytes=sum(s.nbytes for s in specs) + 3)
    pool.numpy()[:] = np.arange(pool.numpy().size) % 253
    return pool


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("bias", [1, 2, 4])
def test_same_block_shift_in_triton(kernels, layout: str, bias: int) -> None:
    pool = _conv_case(layout, "int16")
    tables = BlockTables([np.array([[1, 3, 3, 4, 5, 6, 7]], dtype=np.int32)])
    launch = precopy([0], [2], [1], [bias])
    ref, tri = pool.clone(), pool.clone()
    run_reference(launch, ref, tables)
    kernels.run_triton(launch, tri, tables)
    assert np.array_equal(ref.numpy(), tri.numpy())
    assert not np.array_equal(tri.numpy(), pool.numpy())


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("mode", ["decision", "precomputed"])
def test_in_place_postprocess_resets_and_shifts(kernels, layout: str, mode: str) -> None:
    from tests.kernel_builders import postprocess

    pool = _conv_case(layout, "float32")
    tables = BlockTables([np.array([[1, 2, 3, 4, 5, 6, 7]], dtype=np.int32)])
    # B=4, k=2: all drafts accepted, ending on a boundary: src == dst == 1, bias 2.
    if mode == "decision":
        launch = postprocess([0], [3], [1], [5], [3], [2])
    else:
        launch = postprocess([0], [3], [1], [8], mode="precomputed")
    ref, tri = pool.clone(), pool.clone()
    r1 = run_reference(launch, ref, tables)
    r2 = kernels.run_triton(launch, tri, tables, tiles=2)
    assert r1.accepted_out.tolist() == r2.accepted_out.tolist() == [1]
    assert np.array_equal(ref.numpy(), tri.numpy())
    assert bytes(tri.state_view(1, 2)) == bytes(pool.state_view(1, 4))  # temporal from col 3
    assert bytes(tri.state_view(0, 2)) != bytes(pool.state_view(0, 2))  # window shifted


def test_head_body_tail_and_tiles(kernels) -> None:
    # Offset 3 and 301 bytes: a 5-byte head, u64 words split over two tiles, a tail.
    specs = [StateSpec(0, "temporal", (301,), "uint8")]
    for page in (312, 309):  # same sub-8 alignment for every block, then a mismatched one
        pool = StatePool(specs, 4, page_bytes=page, offsets=[3])
        pool.numpy()[:] = np.arange(pool.numpy().size) % 241
        tables = BlockTables([np.array([[1, 2, 3]], dtype=np.int32)])
        launch = precopy([0], [1], [0], [2])  # block 3 -> block 2
        ref, tri = pool.clone(), pool.clone()
        run_reference(launch, ref, tables)
        kernels.run_triton(launch, tri, tables, tiles=2, chunk=8)
        assert np.array_equal(ref.numpy(), tri.numpy())
        assert bytes(tri.state_view(0, 2)) == bytes(pool.state_view(0, 3))


def test_pages_past_two_gib_in_triton(kernels) -> None:
    page = 2**31 + 40
    specs = [StateSpec(0, "conv", (4, 2), "int16", "SD"), StateSpec(0, "temporal", (5,), "int32")]
    pool = StatePool.sparse(specs, 3, page_bytes=page)
    data = pool.numpy()
    data[page : page + 36] = np.arange(1, 37, dtype=np.uint8)
    tables = BlockTables([np.array([[1, 2, 1]], dtype=np.int32)])
    kernels.run_triton(precopy([0], [1], [0], [0]), pool, tables)  # block 1 -> block 2
    assert data[2 * page : 2 * page + 36].tolist() == list(range(1, 37))
    assert not data[48 : 48 + 36].any()  # where a 32-bit offset would have landed


def test_padded_rows_null_block_and_malformed_rows(kernels) -> None:
    pool = _conv_case("SD")
    # Row 0 is padding; row 1 writes the null block 0; row 2 points far outside the pool.
    tables = BlockTables([np.array([[1, 2, 3, 4], [5, 6, 0, 7], [10**9, 1, 2, 3]], dtype=np.int32)])
    launch = precopy([-1, 1, 2], [2, 2, 0], [1, 1, 1], [1, 0, 0])
    ref, tri = pool.clone(), pool.clone()
    r1 = run_reference(launch, ref, tables)
    r2 = kernels.run_triton(launch, tri, tables)
    assert [(p.batch_row, p.what) for p in r2.validation.problems] == [(2, "block_id")]
    assert r1.validation.problems == r2.validation.problems
    assert np.array_equal(ref.numpy(), tri.numpy())
    assert bytes(tri.state_view(0, 0)) != bytes(pool.state_view(0, 0))  # null block written


def test_rows_missing_inputs_never_run(kernels) -> None:
    from tests.kernel_builders import postprocess

    pool = _conv_case("SD")
    tables = BlockTables([np.arange(1, 8, dtype=np.int32).reshape(1, 7)])
    no_drafts = postprocess([0], [2], [2], [9], [3], None)
    for run in (run_reference, kernels.run_triton):
        target = pool.clone()
        result = run(no_drafts, target, tables)
        assert [p.what for p in result.validation.problems] == ["num_draft"]
        assert np.array_equal(target.numpy(), pool.numpy())
        assert result.accepted_out.tolist() == [2]


def test_aligned_indices(kernels) -> None:
    tables = BlockTables(
        [
            np.arange(40, dtype=np.int32).reshape(4, 10),
            np.arange(100, 140, dtype=np.int32).reshape(4, 10),
        ]
    )
    pool = _conv_case("SD")
    specs = [*pool.specs, StateSpec(1, "temporal", (2,), "uint8")]
    pool2 = StatePool(specs, 8)
    launch = AlignLaunch(
        "aligned_indices",
        batch_row=np.arange(3),
        req_slot=[2, -1, 0],
        seq_len=[1, 9, 13],
        block_size=4,
        num_speculative_tokens=2,
    )
    ref = run_reference(launch, pool2, tables)
    tri = kernels.run_triton(launch, pool2, tables)
    assert np.array_equal(ref.aligned_indices, tri.aligned_indices)
    assert tri.aligned_indices[0, 0].tolist() == [20, 21, 22]
    assert tri.aligned_indices[1, 2].tolist() == [103, 104, 105]
    assert (tri.aligned_indices[:, 1] == -1).all()


def test_campaign_without_vllm_is_clean(kernels) -> None:
    report = run_check(40, 1234, False, "cpu")
    assert report.ok, report.mismatches
    assert report.compared["triton"] == 40


@pytest.mark.parametrize(
    ("specs", "state_idx", "accepted", "cell", "problems", "accepted_out"),
    [
        # The temporal source column wraps int32 back into range: refused, never launched.
        ([("temporal", (4,))], 3 - 2**31, 1 - 2**31, None, ["temporal_src_col"], 1 - 2**31),
        # A bias wrapped to -2**31 with a conv state: the window wraps too, nothing is copied.
        ([("conv", (4, 2))], 1, 1 - 2**31, None, [], 1 - 2**31),
        # In place, destination block past the pool: refused, the count reset all the same.
        ([("conv", (4, 2)), ("temporal", (3,))], 1, 3, (0, 1), ["block_id"], 1),
    ],
)
def test_wrapped_biases_and_refused_rows_agree(
    kernels, specs, state_idx, accepted, cell, problems, accepted_out
) -> None:
    pool = StatePool([StateSpec(0, kind, shape, "uint8") for kind, shape in specs], 20)
    pool.numpy()[:] = np.arange(pool.numpy().size) % 251
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    if cell is not None:
        table[cell] = 25
    tables = BlockTables([table])
    block = 4 if cell is not None else 16
    computed = 8 if cell is not None else 16
    launch = postprocess([0], [accepted], [state_idx], [computed], mode="precomputed", block=block)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = run_reference(launch, ref_pool, tables)
    tri = kernels.run_triton(launch, tri_pool, tables)
    assert [p.what for p in tri.validation.problems] == problems
    assert np.array_equal(ref_pool.numpy(), pool.numpy())
    assert np.array_equal(tri_pool.numpy(), pool.numpy())
    assert ref.accepted_out.tolist() == tri.accepted_out.tolist() == [accepted_out]


def test_streamed_counts_of_a_refused_in_place_row_match_the_host(kernels) -> None:
    """The streamed backend checks the kernel's accepted counts against the host decision:
    a refused row never runs, yet the host resets its count (in place, no index needed)."""
    from mgtrace.kernels.streamed import StreamedTriton

    specs = [StateSpec(0, "conv", (4, 2), "uint8", "SD"), StateSpec(0, "temporal", (3,), "uint8")]
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    table[0, 1] = 25  # row 0's in-place column, past the pool
    launch = postprocess([0, 1], [3, 3], [1, 1], [8, 8], mode="precomputed")
    backend = StreamedTriton(tiles=1)
    result = backend(launch, StatePool(specs, 20), BlockTables([table]))
    assert [(p.batch_row, p.what) for p in result.validation.problems] == [(0, "block_id")]
    assert result.accepted_out.tolist() == [1, 1]
    backend.verify()  # raises KernelDisagreement on any difference
