"""``mgtrace check-kernels``: exit codes, JSON, reproducers and one-sentence errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from mgtrace.errors import UsageError
from mgtrace.kernels import check as check_mod
from mgtrace.kernels.cli import check_kernels
from tests.conftest import assert_one_sentence_error, run_cli

pytestmark = pytest.mark.interp


def _invoke(args: list[str]):
    return CliRunner().invoke(check_kernels, args, standalone_mode=False, catch_exceptions=False)


def test_clean_run_exits_zero_with_json() -> None:
    result = _invoke(["--cases", "8", "--seed", "5", "--json"])
    assert result.return_value == 0
    report = json.loads(result.output)
    assert report["ok"] and report["done"] == 8 and report["compared"]["triton"] == 8


def test_the_summary_keeps_each_sentence_on_its_line() -> None:
    """Rich wrapped the summary at 80 columns mid-sentence, after a dangling "; "."""
    lines = _invoke(["--cases", "3", "--seed", "5"]).output.splitlines()
    assert lines[1] == "compared with the reference: triton in 3 case(s)", lines
    assert lines[0].endswith("kept out of every kernel") and lines[-1] == "no mismatch"


def test_a_mismatch_exits_one_with_a_reproducer(monkeypatch) -> None:
    real = check_mod.run_reference

    def off_by_one_byte(launch, pool, tables, **kw):
        result = real(launch, pool, tables, **kw)
        if result.validation.copies.rows.size:
            pool.numpy()[int(result.validation.copies.dst[0, 0]) * pool.page_bytes] ^= 1
        return result

    monkeypatch.setattr(check_mod, "run_reference", off_by_one_byte)
    result = _invoke(["--cases", "6", "--seed", "11"])
    assert result.return_value == 1
    assert "MISMATCH" in result.output
    assert "reproduce: mgtrace check-kernels --seed 1" in result.output
    # Control: without the fault the same cases agree.
    monkeypatch.setattr(check_mod, "run_reference", real)
    assert _invoke(["--cases", "6", "--seed", "11"]).return_value == 0


def test_missing_vllm_is_one_sentence(monkeypatch) -> None:
    from mgtrace.kernels import vllm_peer

    monkeypatch.setattr(vllm_peer, "VLLM_MODULE", "vllm_is_not_here")
    with pytest.raises(UsageError, match="cannot be imported"):
        _invoke(["--cases", "1", "--against", "vllm"])


def test_cuda_without_a_gpu_is_a_usage_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli("check-kernels", "--device", "cuda", "--cases", "1")
    assert_one_sentence_error(proc, 2)


def test_report_points_at_the_first_bad_byte() -> None:
    case = check_mod.random_case(3)
    got = case.pool.clone()
    got.numpy()[case.pool.page_bytes * 2 + case.pool.offsets[0]] ^= 0xFF
    seen = []
    check_mod._compare(case.pool, case.pool.numpy(), got, "x", lambda *a: seen.append(a))
    assert seen and "block 2, state 0 byte 0" in seen[0][2]
    assert np.array_equal(case.pool.numpy(), case.pool.clone().numpy())


def _interrupted_at(
    monkeypatch, call: int, *, corrupt: bool = False, by: BaseException | None = None
) -> None:
    """The reference raises KeyboardInterrupt (or ``by``) at its ``call``-th case (as Ctrl-C
    would), and with ``corrupt`` flips one byte of each earlier case's pool."""
    real = check_mod.run_reference
    calls = {"n": 0}

    def run(launch, pool, tables, **kw):
        calls["n"] += 1
        if calls["n"] == call:
            raise by or KeyboardInterrupt
        result = real(launch, pool, tables, **kw)
        if corrupt and result.validation.copies.rows.size:
            pool.numpy()[int(result.validation.copies.dst[0, 0]) * pool.page_bytes] ^= 1
        return result

    monkeypatch.setattr(check_mod, "run_reference", run)


def test_ctrl_c_before_the_last_case_exits_130(monkeypatch) -> None:
    """An interrupted check said 125 (inconclusive); Ctrl-C is 130 everywhere else. A
    mismatch found before the interruption still exits 1."""
    _interrupted_at(monkeypatch, 3)
    result = _invoke(["--cases", "6", "--seed", "11"])
    assert result.return_value == 130
    assert "interrupted before the last case" in result.output


def test_sigterm_before_the_last_case_exits_143_and_says_so(monkeypatch) -> None:
    """It exited 130 and said "interrupted", as for Ctrl-C; every other command says the
    signal and exits 128 + its number."""
    import signal

    from mgtrace.termination import Terminated

    _interrupted_at(monkeypatch, 3, by=Terminated(signal.SIGTERM))
    result = _invoke(["--cases", "6", "--seed", "11"])
    assert result.return_value == 143
    assert "stopped by SIGTERM before the last case" in result.output


def test_ctrl_c_after_a_mismatch_still_exits_one(monkeypatch) -> None:
    _interrupted_at(monkeypatch, 6, corrupt=True)
    result = _invoke(["--cases", "6", "--seed", "11"])
    assert "MISMATCH" in result.output and result.return_value == 1
    assert "interrupted before the last case" in result.output
