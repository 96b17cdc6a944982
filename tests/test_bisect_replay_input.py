"""bisect --replay refuses what is no log in one sentence, whatever it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mgtrace.errors import MgtraceError
from mgtrace.replayer import bisect as bisect_mod
from tests.conftest import REPO, assert_one_sentence_error, run_cli


def test_a_deeply_nested_json_file_is_no_log(tmp_path: Path) -> None:
    """'[' * 200000 raised RecursionError in json.loads: exit 70, an internal error."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    proc = run_cli("bisect", "--replay", str(deep))
    err = assert_one_sentence_error(proc, 2)
    assert "is not an mgtrace bisect log" in err, err


def test_an_endless_device_is_no_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/zero (or /dev/full) was read whole: MemoryError, exit 70, once the memory ran
    out. Read here with a small cap so the test itself stays small."""
    monkeypatch.setattr(bisect_mod, "MAX_LOG_BYTES", 1 << 20)
    with pytest.raises(MgtraceError) as info:
        bisect_mod.recheck_log(Path("/dev/zero"))
    assert "is not an mgtrace bisect log" in info.value.message
    assert info.value.exit_code == 2


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_through_the_cli_is_one_sentence() -> None:
    """Under a 3 GiB address-space cap (so that the bug, were it back, fails the test with
    MemoryError instead of taking the machine's memory)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mgtrace", "bisect", "--replay", "/dev/zero"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        preexec_fn=_limit_memory,
    )
    err = assert_one_sentence_error(proc, 2)
    assert "/dev/zero is not an mgtrace bisect log" in err, err
