"""Randomized differential campaign: mgtrace's Triton kernels, the reference, and vLLM's.

Every case (``mgtrace.kernels.gen``) starts all backends from the same pool bytes and the
same validated launch, then compares the whole pool, the accepted counts and the aligned
indices. Case ``i`` of a run with seed ``S`` is generated from seed ``S + i``, so a mismatch
is reproduced on its own with ``--seed S+i --cases 1``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mgtrace.kernels.gen import Case, random_case
from mgtrace.kernels.pool import StatePool
from mgtrace.kernels.reference import run_reference
from mgtrace.kernels.runtime import load_triton_kernels
from mgtrace.kernels.validate import find_hazards, validate_launch
from mgtrace.termination import terminated_by


@dataclass
class Mismatch:
    case: int
    seed: int
    backends: str  # e.g. "triton != reference"
    what: str  # pool bytes | accepted counts | aligned indices
    detail: str
    launch: str
    reproduce: str


@dataclass
class CheckReport:
    cases: int
    seed: int
    device: str
    against_vllm: bool
    vllm_version: str | None = None
    done: int = 0
    compared: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    malformed_rows: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    interrupted: bool = False
    stopped_by: str | None = None  # the signal that interrupted it, other than Ctrl-C
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def run_check(
    cases: int,
    seed: int,
    against_vllm: bool,
    device: str,
    *,
    progress: Callable[[int], None] | None = None,
) -> CheckReport:
    """Run ``cases`` random cases through every backend; mismatches carry a reproducer."""
    kernels = load_triton_kernels(device)
    vllm_mod = None
    report = CheckReport(cases=cases, seed=seed, device=device, against_vllm=against_vllm)
    if against_vllm:
        from mgtrace.kernels.vllm_peer import load_vllm_kernels, vllm_version

        vllm_mod = load_vllm_kernels(device)
        report.vllm_version = vllm_version()
    compared: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    start = time.perf_counter()
    try:
        for i in range(cases):
            case = random_case(seed + i)
            _run_case(i, seed, case, device, kernels, vllm_mod, report, compared, skipped)
            report.done = i + 1
            if progress is not None:
                progress(i + 1)
    except KeyboardInterrupt as exc:
        report.interrupted = True
        by = terminated_by(exc)
        report.stopped_by = None if by is None else by.name
    report.compared = dict(compared)
    report.skipped = dict(skipped)
    report.elapsed_s = round(time.perf_counter() - start, 3)
    return report


def _reproduce(case_seed: int, device: str, against_vllm: bool) -> str:
    cmd = f"mgtrace check-kernels --seed {case_seed} --cases 1 --device {device}"
    return cmd + (" --against vllm" if against_vllm else "")


def _run_case(
    i: int,
    seed: int,
    case: Case,
    device: str,
    kernels: Any,
    vllm_mod: Any,
    report: CheckReport,
    compared: Counter[str],
    skipped: Counter[str],
) -> None:
    launch, tables = case.launch, case.tables
    validation = validate_launch(launch, case.pool, tables)
    report.malformed_rows += int(validation.bad.sum())
    if find_hazards(validation, case.pool):
        # Cross-row overlaps have no single right answer; the generator avoids them.
        skipped["rows share a block"] += 1
        return

    def mismatch(backends: str, what: str, detail: str) -> None:
        report.mismatches.append(
            Mismatch(
                case=i,
                seed=case.seed,
                backends=backends,
                what=what,
                detail=detail,
                launch=case.describe(),
                reproduce=_reproduce(case.seed, device, vllm_mod is not None),
            )
        )

    ref_pool = case.pool.clone("cpu")
    ref = run_reference(launch, ref_pool, tables, validation=validation)
    expected_bytes = ref_pool.buffer.numpy()

    tri_pool = case.pool.clone(device)
    tiles, chunk = case.tiles, case.chunk
    if device == "cuda":
        # Compiled kernels: the launch shapes vLLM uses, so that few variants get compiled.
        tiles, chunk = (16 if tiles > 1 else 1), kernels.COPY_CHUNK
    tri = kernels.run_triton(
        launch, tri_pool, tables, validation=validation, tiles=tiles, chunk=chunk
    )
    compared["triton"] += 1
    _compare(ref_pool, expected_bytes, tri_pool, "triton != reference", mismatch)
    _compare_arrays(
        ref.accepted_out, tri.accepted_out, "triton != reference", "accepted counts", mismatch
    )
    _compare_arrays(
        ref.aligned_indices, tri.aligned_indices, "triton != reference", "aligned indices", mismatch
    )

    if vllm_mod is None:
        return
    from mgtrace.kernels.vllm_peer import alignment_problem, comparable, run_vllm

    safe = validation.sanitized(launch)
    has_idx = case.has_idx_mapping or bool(validation.bad.any())
    reason = comparable(safe, has_idx)
    if reason is None and device == "cuda" and alignment_problem(case.pool):
        # the cases' odd page sizes test mgtrace's kernels; vLLM's would fault on them
        reason = "vLLM's DS conv copy needs element-aligned states (compiled)"
    if reason:
        skipped[reason] += 1
        return
    vllm_pool = case.pool.clone(device)
    out = run_vllm(vllm_mod, safe, vllm_pool, tables, has_idx_mapping=has_idx, tiles=tiles)
    compared["vllm"] += 1
    _compare(ref_pool, expected_bytes, vllm_pool, "vllm != reference", mismatch)
    if launch.kernel == "postprocess":
        # vLLM ran the sanitized launch: rows refused by validation never ran there, while
        # their counts here are the host decision (a reset, where no index was needed).
        ran = ~validation.bad
        expected = ref.accepted_out[ran] if ref.accepted_out is not None else None
        got = out[ran] if out is not None else None
        _compare_arrays(expected, got, "vllm != reference", "accepted counts", mismatch)
    elif launch.kernel == "aligned_indices":
        _compare_arrays(ref.aligned_indices, out, "vllm != reference", "aligned indices", mismatch)


def _compare(
    ref_pool: StatePool,
    expected: np.ndarray,
    other: StatePool,
    backends: str,
    mismatch: Callable[[str, str, str], None],
) -> None:
    got = other.buffer.cpu().numpy()
    diff = np.nonzero(got != expected)[0]
    if diff.size == 0:
        return
    first = int(diff[0])
    block, at = divmod(first, ref_pool.page_bytes)
    state = next(
        (s for s, off in enumerate(ref_pool.offsets) if off <= at < off + ref_pool.specs[s].nbytes),
        None,
    )
    where = f"state {state} byte {at - ref_pool.offsets[state]}" if state is not None else "padding"
    mismatch(backends, "pool bytes", f"{diff.size} byte(s) differ; first in block {block}, {where}")


def _compare_arrays(
    expected: np.ndarray | None,
    got: np.ndarray | None,
    backends: str,
    what: str,
    mismatch: Callable[[str, str, str], None],
) -> None:
    if expected is None and got is None:
        return
    if expected is None or got is None or not np.array_equal(expected, got):
        mismatch(backends, what, f"expected {_short(expected)}, got {_short(got)}")


def _short(a: np.ndarray | None) -> str:
    if a is None:
        return "nothing"
    return np.array2string(np.asarray(a).ravel()[:16], separator=",")
