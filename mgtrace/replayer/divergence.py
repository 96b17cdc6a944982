"""The first step at which a rule set changes what the replay executes.

Up to that step a replay under the rules is the recorded replay, byte for byte, so a bisect
can start it from a checkpoint of the recorded replay instead of from step 0. Each rule's
effect is a pure function of the recorded inputs, so the step is found without replaying.
"""

from __future__ import annotations

import numpy as np

from mgtrace.replayer.rules import AS_RECORDED, RuleSet, resolve_threshold
from mgtrace.replayer.steps import RankTrace, spec_decodes_run_first
from mgtrace.replayer.view import split_under_threshold
from mgtrace.schemas.tables import BLOCK_TABLE_KINDS, KERNELS

_GATHER = KERNELS.index("aligned_indices")
_SOURCE, _INPUT = BLOCK_TABLE_KINDS.index("source"), BLOCK_TABLE_KINDS.index("input")


def _first(steps: np.ndarray, mask: np.ndarray) -> int | None:
    hit = np.flatnonzero(mask)
    return int(steps[hit].min()) if len(hit) else None


def first_divergence(trace: RankTrace, rules: RuleSet, *, until: int | None = None) -> int | None:
    """The earliest step whose executed inputs differ under ``rules``; None if none does."""
    candidates: list[int] = []
    lc = trace.launch_columns
    steps = lc["step"]
    kernel = trace.launch_kernel_codes
    bt_rule = rules["bt_row_is_req"]
    if bt_rule != AS_RECORDED and len(steps):
        copies = kernel != _GATHER
        want = lc["req_slot"] if bt_rule == "true" else lc["batch_row"]
        differs = copies & (lc["bt_row"] != want)
        if trace.run.runner == "v2":
            table = trace.launch_table_codes
            differs |= copies & (table != (_SOURCE if bt_rule == "true" else _INPUT))
        if (step := _first(steps, differs)) is not None:
            candidates.append(step)
    if rules["accepted_source"] == "cpu":
        for step in (
            _first(steps, trace.launch_has["num_accepted_cpu"]),
            _first(trace.batch_steps, trace.batch_columns["accepted_prev_cpu"] >= 0),
        ):
            if step is not None:
                candidates.append(step)
    if rules["clear_vacated_rows"] == "true" and len(steps):
        padded = (kernel == _GATHER) & (lc["req_slot"] < 0)
        if (step := _first(steps, padded)) is not None:
            candidates.append(step)
    if rules["reorder_threshold"] != AS_RECORDED:
        step = _threshold_divergence(trace, rules, until)
        if step is not None:
            candidates.append(step)
    return min(candidates) if candidates else None


def _threshold_divergence(trace: RankTrace, rules: RuleSet, until: int | None) -> int | None:
    k = trace.run.num_speculative_tokens
    recorded = trace.step_info.get("reorder_threshold")
    builder = trace.step_info.get("mamba_threshold")
    gdn = spec_decodes_run_first(trace.run)
    for i, step in enumerate(trace.step_numbers.tolist()):
        if until is not None and step > until:
            return None
        rec = None if recorded is None or recorded[i] < 0 else int(recorded[i])
        threshold = resolve_threshold(rules["reorder_threshold"], rec, k)
        if threshold is None or threshold == rec:
            continue
        batch = trace.batch(step)
        if not batch.num_rows:
            continue
        split = split_under_threshold(
            batch,
            threshold,
            k,
            runner=trace.run.runner,
            builder_threshold=None if builder is None or builder[i] < 0 else int(builder[i]),
            gdn=gdn,
            order=trace.persistent_order(step, threshold),
        )
        if np.any(split != batch.cols["is_prefill_split"].astype(bool)):
            return step
    return None
