"""The oracle's conv-window findings: whose rows a reader finds, and how their positions are
said."""

from __future__ import annotations

import numpy as np
import pytest

from mgtrace.replayer.findings import FOREIGN_STATE, Finding
from mgtrace.replayer.oracle import READ_KINDS, Oracle, StateRead
from mgtrace.replayer.requests import RequestIds

pytestmark = pytest.mark.unit


def _conv_findings(
    reader: str, found_uid_of: str, positions: list[int], needs: int, *, new: bool
) -> list[Finding]:
    """What the oracle finds when ``reader`` (a new request, which may share a prefix, or a
    running one), needing the window before ``needs`` tokens, finds rows of ``found_uid_of``
    at ``positions``."""
    ids = RequestIds()
    me, them = ids.uid(reader), ids.uid(found_uid_of)
    oracle = Oracle(rank=0, ids=ids, pool=None, ownership=None, conv_keep=3)  # type: ignore[arg-type]
    read = StateRead(
        what=np.array([READ_KINDS.index("prefill-read" if new else "decode-read")]),
        rows=np.array([22]),
        uid=np.array([me], dtype=np.int32),
        expected_tokens=np.array([needs]),
        temporal_blocks=np.array([[39]]),
        conv_blocks=np.array([[39]]),
        conv_offset=np.array([0]),
        may_share=np.array([new]),  # a new request: a prefix hit may share state
    )
    oracle._check_conv(
        100, read, 0, np.full((1, 3), them, np.int32), np.array([positions]), np.ones((1, 3), bool)
    )
    return oracle.findings


def test_a_shared_window_at_the_wrong_positions_names_its_writer() -> None:
    (f,) = _conv_findings("req-000146", "req-000076", [3334, 3335, 3336], 1792, new=True)
    assert f.writer_req_id == "req-000076", f.detail
    assert f.kind == FOREIGN_STATE, f.detail


def test_a_shared_window_at_the_right_positions_is_a_prefix_hit() -> None:
    assert _conv_findings("req-000146", "req-000076", [1789, 1790, 1791], 1792, new=True) == []


def test_a_mixed_window_is_not_said_as_a_range() -> None:
    (f,) = _conv_findings("req-000032", "req-000032", [3309, 3307, 3308], 3309, new=False)
    assert "3309..3308" not in f.detail, f.detail
    assert "3309, 3307, 3308" in f.detail and "3306..3308" in f.detail, f.detail
