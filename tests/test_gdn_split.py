"""GDN's split, recorded from its metadata builder: the spec-decode mask, not a position,
says which rows run the decode kernels."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from mgtrace.recorder.wire import Packer, Unpacker
from tests.hook_helpers import optional_hook


def _gdn_hooked(result: object) -> dict:
    """The GDN split hook around a builder returning ``result``; the step record it left,
    through the wire."""

    class GDNAttentionMetadataBuilder:
        def build(self, common_prefix_len: int, m: object, **kwargs: object) -> object:
            return result

    with optional_hook("GDNAttentionMetadataBuilder", GDNAttentionMetadataBuilder) as sess:
        assert GDNAttentionMetadataBuilder().build(0, None) is result
    return Unpacker().record(Packer().record(sess.rec))  # as the assembler reads it


def test_gdn_split_follows_the_spec_decode_mask_not_the_position() -> None:
    import torch

    from mgtrace.recorder.assemble import SPLIT_DECODE, SPLIT_PREFILL, mamba_split

    mask = torch.tensor([True, False, True, False])
    rec = _gdn_hooked(SimpleNamespace(spec_sequence_masks_cpu=mask, num_decodes=0))
    mask[:] = False  # the builder reusing its buffer changes nothing recorded
    split = mamba_split(4, rec["mamba"])
    assert split.tolist() == [SPLIT_DECODE, SPLIT_PREFILL, SPLIT_DECODE, SPLIT_PREFILL]
    assert rec["mamba"][0] == 2 and rec["mamba"][1] is None
    # without spec decode rows, the first num_decodes rows decode
    rec = _gdn_hooked(SimpleNamespace(spec_sequence_masks_cpu=None, num_decodes=1))
    assert mamba_split(3, rec["mamba"]).tolist() == [SPLIT_DECODE, SPLIT_PREFILL, SPLIT_PREFILL]
    # control: a mask shorter than the batch is not guessed at
    assert mamba_split(5, (2, None, np.array([True, False, True, False]))) is None
    # a mask off the host is left alone (reading it would wait for the device): no split
    # recorded and no hook failure (``optional_hook`` asserts none)
    off_host = torch.ones(4, dtype=torch.bool, device="meta")
    rec = _gdn_hooked(SimpleNamespace(spec_sequence_masks_cpu=off_host, num_decodes=0))
    assert "mamba" not in rec


@pytest.mark.peer
def test_gdn_builder_has_what_the_hook_reads() -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import dataclasses
    import inspect

    gdn = pytest.importorskip("vllm.v1.attention.backends.gdn_attn")
    from mgtrace.recorder import features

    target = next(t for t in features.V1_TARGETS if t.owner == "GDNAttentionMetadataBuilder")
    assert features.resolve(target) is gdn.GDNAttentionMetadataBuilder
    assert (
        "num_decode_draft_tokens_cpu"
        in inspect.signature(gdn.GDNAttentionMetadataBuilder.build).parameters
    )
    fields = {f.name for f in dataclasses.fields(gdn.GDNAttentionMetadata)}
    assert {"spec_sequence_masks_cpu", "num_decodes"} <= fields
