from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mgtrace.schemas.sample import write_sample_trace


def _cpu_only_environment() -> None:
    """Without a GPU, every Triton kernel in this process (ours and vLLM's) is interpreted.

    Triton fixes the mode when a kernel module is first imported, so it is set once here,
    before any test imports one; otherwise test order would decide and vLLM's kernels,
    imported compiled by one test, would fail interpreted in the next.
    """
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


_cpu_only_environment()

REPO = Path(__file__).resolve().parents[1]


def skip_without_v1_runner() -> None:
    """Skip the calling test (or module, at import) where the installed vLLM has no V1
    runner: 0.34 removed it, and the V1 stand-in engine (tests/recorder_standin.py) is one."""
    from mgtrace.recorder.features import V1_RUNNER_MODULE
    from tests.recorder_standin import has_v1_runner

    if not has_v1_runner():
        pytest.skip(f"this vLLM has no V1 runner ({V1_RUNNER_MODULE})", allow_module_level=True)


@pytest.fixture(scope="session")
def sample_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only sample trace shared by tests that do not modify it."""
    path = tmp_path_factory.mktemp("sample") / "trace"
    write_sample_trace(path, steps=120, rows=16)
    return path


@pytest.fixture
def fresh_trace(tmp_path: Path) -> Path:
    """A sample trace of the test's own, free to damage."""
    path = tmp_path / "trace"
    write_sample_trace(path, steps=60, rows=8)
    return path


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess, as a user would."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "mgtrace", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=env,
        timeout=120,
    )


def assert_one_sentence_error(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert err.startswith("mgtrace: error: "), err
    assert len(err.splitlines()) == 1, err
    return err


def replace_after_call(
    monkeypatch: pytest.MonkeyPatch, module: object, name: str, path: Path, steps: int
) -> None:
    """Make each call of ``module.name`` be followed by a clean trace of ``steps`` steps
    replacing the one at ``path``, as `simulate --force` in another shell."""
    import mgtrace

    real = getattr(module, name)

    def then_replace(*args, **kwargs):
        result = real(*args, **kwargs)
        mgtrace.simulate(path, steps=steps, seed=7, force=True)
        return result

    monkeypatch.setattr(module, name, then_replace)
