"""The oracle's conv-window findings: whose rows a reader finds, and how their positions are
said."""

from __future__ import annotations

import numpy as np
import pytest

from mgtrace.replayer.findings import FOREIGN_STATE
from mgtrace.replayer.oracle import READ_KINDS, Oracle, StateRead
from mgtrace.replayer.requests import RequestIds

pytestmark = pytest.mark.unit


def _read(reader: int, expected: int) -> StateRead:
    return StateRead(
        what=np.array([READ_KINDS.index("prefill-read")]),
        rows=np.array([22]),
        uid=np.array([reader], dtype=np.int32),
        expected_tokens=np.array([expected]),
        temporal_blocks=np.array([[39]]),
        conv_blocks=np.array([[39]]),
        conv_offset=np.array([0]),
        may_share=np.array([True]),  # a new request: a prefix hit may share state
    )


def _oracle(ids: RequestIds) -> Oracle:
    return Oracle(rank=0, ids=ids, pool=None, ownership=None, conv_keep=3)  # type: ignore[arg-type]


def test_a_shared_window_at_the_wrong_positions_names_its_writer() -> None:
    ids = RequestIds()
    reader, writer = ids.uid("req-000146"), ids.uid("req-000076")
    oracle = _oracle(ids)
    oracle._check_conv(
        1916,
        _read(reader, 1792),
        0,
        np.full((1, 3), writer, dtype=np.int32),
        np.array([[3334, 3335, 3336]]),
        np.ones((1, 3), dtype=bool),
    )
    (f,) = oracle.findings
    assert f.writer_req_id == "req-000076", f.detail
    assert f.kind == FOREIGN_STATE, f.detail


def test_a_shared_window_at_the_right_positions_is_a_prefix_hit() -> None:
    ids = RequestIds()
    reader, writer = ids.uid("req-000146"), ids.uid("req-000076")
    oracle = _oracle(ids)
    oracle._check_conv(
        1916,
        _read(reader, 1792),
        0,
        np.full((1, 3), writer, dtype=np.int32),
        np.array([[1789, 1790, 1791]]),
        np.ones((1, 3), dtype=bool),
    )
    assert oracle.findings == []


def test_a_mixed_window_is_not_said_as_a_range() -> None:
    ids = RequestIds()
    me = ids.uid("req-000032")
    oracle = Oracle(rank=0, ids=ids, pool=None, ownership=None, conv_keep=3)  # type: ignore[arg-type]
    read = StateRead(
        what=np.array([READ_KINDS.index("decode-read")]),
        rows=np.array([3]),
        uid=np.array([me], dtype=np.int32),
        expected_tokens=np.array([3309]),
        temporal_blocks=np.array([[41]]),
        conv_blocks=np.array([[41]]),
        conv_offset=np.array([0]),
        may_share=np.array([False]),
    )
    oracle._check_conv(
        1488, read, 0, np.full((1, 3), me, np.int32), np.array([[3309, 3307, 3308]]),
        np.ones((1, 3), dtype=bool),
    )  # fmt: skip
    (f,) = oracle.findings
    assert "3309..3308" not in f.detail, f.detail
    assert "3309, 3307, 3308" in f.detail and "3306..3308" in f.detail, f.detail
