"""Batch ordering rules: V1's four-region reorder, the builders' split, V2's sort.

V1 reorders the persistent batch in place with row swaps into decode -> short_extend ->
long_extend -> prefill, judged against the runner's threshold. The Mamba builder then splits
the reordered batch at its own threshold (1 + k) and, with short extends not treated as
decodes, counts every row from the first prefill-like row on as a prefill. When the runner's
threshold is lower than the builder's, spec-decode rows sit in long_extend among chunked
prefill continuations and the ones behind a continuation go through the prefill kernels.

A GDN builder does not split by position: with spec decode it marks its spec-decode rows by
their draft counts wherever they sit, so a lowered runner threshold leaves them alone.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mgtrace.schemas.tables import REORDER_REGIONS

REGION_DECODE, REGION_SHORT, REGION_LONG, REGION_PREFILL = range(4)
REGION_NAMES = np.array(REORDER_REGIONS, dtype=object)


def regions(
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    num_prompt: np.ndarray,
    threshold: int,
) -> np.ndarray:
    """Region id per row (0 decode, 1 short_extend, 2 long_extend, 3 prefill)."""
    # below the threshold: decode (0), or short_extend (1) while still in the prompt
    out = (num_computed < num_prompt).view(np.int8)  # a fresh array: set in place
    out[num_scheduled > threshold] = REGION_LONG
    out[num_computed <= 0] = REGION_PREFILL  # no context yet
    return out


def reorder_swaps(region: np.ndarray) -> list[tuple[int, int]]:
    """Row swaps that bring the batch into region order, in the order the engine makes them.

    Rows already in the right region stay. The misplaced rows, stably sorted by region, fill
    the misplaced positions in ascending order; each permutation cycle is then walked from
    its first source, swapping the held row into its destination until the cycle closes.
    """
    n = len(region)
    if n < 2 or np.count_nonzero(region[1:] >= region[:-1]) == n - 1:
        return []  # already in region order
    target = region.copy()  # each row's region in the reordered batch
    target.sort()
    wrong = (region != target).nonzero()[0]
    if len(wrong) == 0:
        return []
    sources = wrong[region[wrong].argsort(kind="stable")]
    dest = dict(zip(sources.tolist(), wrong.tolist(), strict=True))
    swaps: list[tuple[int, int]] = []
    for start in sources.tolist():
        hold = start
        to = dest[hold]
        while to != hold:
            swaps.append((hold, to))
            nxt = dest[to]
            dest[to] = to
            to = nxt
        dest[hold] = hold
    return swaps


def mamba_split(
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    num_prompt: np.ndarray,
    threshold: int,
    in_prompt: np.ndarray | None = None,
) -> int:
    """Number of leading rows the Mamba builder treats as decodes.

    A row still in its prompt counts as a prefill, except a one-token chunk with prior state,
    which the builder promotes to a decode (it can replay a decode graph). ``in_prompt``:
    ``num_computed < num_prompt`` where the caller has it.
    """
    n = len(num_scheduled)
    if n == 0 or num_scheduled[0] > threshold:
        return 0  # decode_count's answer whatever the rows
    if in_prompt is None:
        in_prompt = num_computed < num_prompt
    is_prefill = num_scheduled > threshold
    if np.count_nonzero(in_prompt):  # most steps: no row in its prompt
        is_prefill |= in_prompt & ((num_computed <= 0) | (num_scheduled != 1))
    return _first_or_len(is_prefill)


def _first_or_len(mask: np.ndarray) -> int:
    """The first True row of a non-empty mask, or its length when there is none."""
    i = int(mask.argmax())
    return i if mask[i] else len(mask)


def _leading(n: int, count: int) -> np.ndarray:
    """A mask of ``n`` rows, True for the first ``count``."""
    out = np.zeros(n, bool)
    out[:count] = True
    return out


class BuilderSplit(NamedTuple):
    """How the model's linear-attention builder splits a batch, as a recording keeps it."""

    decode: np.ndarray  # per row: runs the decode (GDN: spec-decode) kernels
    num_decodes: int
    threshold: int | None  # the recorded builder threshold; GDN: 1 without a spec mask, None with


def builder_split(
    mixer: str,
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    num_prompt: np.ndarray,
    num_draft: np.ndarray,
    k: int,
    in_prompt: np.ndarray | None = None,
) -> BuilderSplit:
    """The Mamba2 builder's positional split at 1 + k, or the GDN builder's.

    GDN with spec decode marks a row when it schedules exactly its drafts plus one, or is a
    one-token decode past its prompt (a spec row with zero drafts); with no marked row, and
    without spec decode, it splits by position at threshold 1, where a row with no prior
    state is a prefill. ``in_prompt``: ``num_computed < num_prompt`` where the caller has it.
    """
    n = len(num_scheduled)
    if mixer == "mamba2":
        split = mamba_split(num_scheduled, num_computed, num_prompt, 1 + k, in_prompt)
        return BuilderSplit(_leading(n, split), split, 1 + k)
    if k > 0:
        spec = gdn_spec_rows(num_scheduled, num_computed, num_prompt, num_draft)
        marked = int(np.count_nonzero(spec))
        if marked:
            return BuilderSplit(spec, marked, None)
    # GDN's positional split at 1 counts a row without prior state as a prefill; at that
    # threshold this is the Mamba2 rule
    split = mamba_split(num_scheduled, num_computed, num_prompt, 1, in_prompt)
    return BuilderSplit(_leading(n, split), split, 1)


def gdn_spec_rows(
    num_scheduled: np.ndarray,
    num_computed: np.ndarray,
    num_prompt: np.ndarray,
    num_draft: np.ndarray,
) -> np.ndarray:
    """The rows a GDN builder with spec decode marks (``num_decode_draft_tokens >= 0``):
    those scheduling exactly their drafts plus one, and one-token decodes past the prompt."""
    return ((num_draft > 0) & (num_scheduled == num_draft + 1)) | (
        (num_computed >= num_prompt) & (num_scheduled == 1)
    )


def decode_count(num_scheduled: np.ndarray, is_prefilling: np.ndarray, threshold: int) -> int:
    """Split of a reordered batch with short extends counted as prefills.

    A row is prefill-like when it schedules more than ``threshold`` tokens or is prefilling;
    every row from the first prefill-like one on counts as a prefill.
    """
    if len(num_scheduled) == 0 or num_scheduled[0] > threshold:
        return 0
    return _first_or_len((num_scheduled > threshold) | is_prefilling)


def v2_sort(
    req_ids: list[str], num_scheduled: list[int], has_drafts: list[bool], decode_query_len: int
) -> list[int]:
    """V2 batch order: rows with drafts, then rows of exactly the decode length, then the
    rest by token count; ties keep the scheduler's order. Returns positions into the input."""
    keys = [
        (not d, n != decode_query_len, n, i)
        for i, (n, d) in enumerate(zip(num_scheduled, has_drafts, strict=True))
    ]
    return [k[3] for k in sorted(keys)]


def v2_order(
    num_scheduled: np.ndarray,
    has_drafts: np.ndarray,
    decode_query_len: int,
) -> np.ndarray:
    """``v2_sort`` on arrays: the same order, as positions into the scheduler's order."""
    n = len(num_scheduled)
    return np.lexsort((np.arange(n), num_scheduled, num_scheduled != decode_query_len, ~has_drafts))


def apply_swaps(order: list[int], swaps: list[tuple[int, int]]) -> list[int]:
    """Apply swaps to a list of row contents (used to check a swap sequence)."""
    out = list(order)
    for a, b in swaps:
        out[a], out[b] = out[b], out[a]
    return out
