"""vLLM's prefill checkpoints: a Mamba prefill that also stores its state mid-query.

Since vLLM 0.33 a Mamba group's spec may ask for a prefill checkpoint block: the metadata
builder gives every prefill row whose query crosses a reusable boundary the offset of that
boundary, and the prefill forward exports the state there into the column behind the
running one, so that the prefix cache can serve it without the scheduler splitting the
prefill at the boundary. Under dense retention (vLLM's default) the scheduler reserves a
block for that column on every chunk that has one, keeping a spec block already there in
place; the block is freed like any column the request has moved past, unless the prefix
cache holds it. (Under sparse retention only the prompt's last chunk gets one.)

Modelled here with the hash block equal to the Mamba block, a checkpoint alignment of one
token and no hash lookahead tokens (Mamba2's settings); under MTP (k > 0) the builder and
MambaManager apply EAGLE's block drop (``drop``): the position backs off one more block, as
full attention drops the last block of a prefix hit. ``get_mamba_prefill_checkpoint_position``
and ``is_mamba_prefill_checkpoint_valid`` in vllm/v1/kv_cache_interface.py,
``compute_mamba_prefill_checkpoints`` in vllm/model_executor/layers/mamba/checkpoint.py.

``chunk_tokens`` is the scheduler's ``_mamba_block_aligned_split`` for the same settings.
"""

from __future__ import annotations

import numpy as np

NONE = -1
Ints = int | np.ndarray  # one query or one per row


def cache_position(num_tokens: int, block_size: int, drop: bool) -> int:
    """The last position of ``num_tokens`` whose state can be cached: the last boundary
    that leaves a token to recompute the logits from, or under the block drop one block
    below the last boundary (``get_mamba_prefill_checkpoint_position``)."""
    return max(_position(num_tokens, block_size, drop), 0)


def _position(num_tokens: Ints, block_size: int, drop: bool) -> Ints:
    """``cache_position`` before its floor at 0, for ints and arrays alike."""
    b = block_size
    return num_tokens // b * b - b if drop else (num_tokens - 1) // b * b


def _valid(start: Ints, end: Ints, position: Ints, block_size: int) -> bool | np.ndarray:
    """``is_mamba_prefill_checkpoint_valid`` (alignment 1, hash block = B) of queries
    ``start .. end`` with the checkpoint at ``position``, for ints and arrays alike."""
    b = block_size
    return (
        (start % b == 0)
        & (-(-end // b) - 2 > (start - 1) // b)  # past the column the prefill starts from
        & (start + b <= position)
        & (start < position)
        & (position < end)
    )


def checkpoint_of(
    computed: int, scheduled: int, block_size: int, drop: bool = False
) -> tuple[int, int]:
    """(tokens the checkpoint covers, its block-table column) of one prefill row, or
    (-1, -1) when the builder gives it none."""
    tokens, cols = checkpoints_of(np.array([computed]), np.array([scheduled]), block_size, drop)
    return int(tokens[0]), int(cols[0])


def checkpoints_of(
    computed: np.ndarray, scheduled: np.ndarray, block_size: int, drop: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Per prefill row (query ``computed`` .. ``computed + scheduled``): the tokens its
    checkpoint covers and the column it goes to, -1 where it has none."""
    b = block_size
    start = computed.astype(np.int64)
    end = start + scheduled.astype(np.int64)
    position = np.maximum(_position(end, b, drop), 0)  # cache_position of each row's end
    col = -(-end // b) - 2  # the column behind the running one: cdiv(end, B) - 2
    valid = _valid(start, end, position, b)
    return np.where(valid, position, NONE), np.where(valid, col, NONE)


def chunk_tokens(
    start: int,
    n: int,
    prompt: int,
    num_tokens: int,
    block_size: int,
    drop: bool,
    checkpoints: bool,
) -> int:
    """How many of ``n`` tokens a prefill chunk from ``start`` takes (vLLM's
    ``_mamba_block_aligned_split`` with the Mamba block as hash block, no partial hits, no
    shared-prefix junction and a budget of at least a block): a non-final chunk ends on a
    block boundary, and no chunk runs past the last cacheable boundary of the request's
    ``num_tokens`` (so that its state can be cached) unless the final chunk's prefill
    checkpoint stores the prefill's. Prompt families' boundaries are the scheduler's."""
    b = block_size
    # a resumed request replays its output as prefill, all but the last token
    prefill_end = max(prompt, num_tokens - 1)
    if start >= prefill_end:
        return n
    end = start + n
    internal = (
        checkpoints
        and end >= prefill_end
        and _valid(start, end, cache_position(prefill_end, b, drop), b)
    )
    if end < prefill_end:
        end = end // b * b
    stops = (
        (start // b + 1) * b if start % b and not internal else 0,
        0 if internal else cache_position(num_tokens, b, drop),
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
