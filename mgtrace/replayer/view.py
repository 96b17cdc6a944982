"""A step's batch and launches after the counterfactual rules: what the replay executes.

Each rule is a small pure function of the recorded values, so a test can state exactly what
it changes: ``reorder_threshold`` re-runs the reorder and the Mamba split,
``accepted_source`` swaps the accepted counts the kernels read for the ones the CPU held,
``bt_row_is_req`` recompiles the copy kernels with the other block-table row rule, and
``clear_vacated_rows`` makes padded rows gather from cleared rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from mgtrace.kernels.launch import AlignLaunch
from mgtrace.replayer.requests import DUMMY_REQUEST
from mgtrace.replayer.rules import AS_RECORDED, RuleSet, resolve_threshold
from mgtrace.replayer.steps import StepBatch
from mgtrace.sim.reorder import (
    apply_swaps,
    gdn_spec_rows,
    mamba_split,
    regions,
    reorder_swaps,
    v2_order,
)


@dataclass
class RowView:
    """One batch in batch order, with the values the replay uses (rules applied)."""

    step: int
    uid: np.ndarray
    batch_row: np.ndarray  # recorded batch row of each position (a minimized trace has holes)
    slot: np.ndarray
    computed: np.ndarray
    scheduled: np.ndarray
    draft: np.ndarray
    prompt: np.ndarray
    state_col: np.ndarray
    prev_state_col: np.ndarray
    accepted_prev: np.ndarray  # as this step consumed it, after accepted_source
    accepted: np.ndarray  # produced this step, -1 when the row sampled nothing
    prefill_split: np.ndarray  # bool: the Mamba builder ran the row through prefill kernels
    # a prefill's mid-query state (vLLM's prefill checkpoint): tokens it covers and its
    # absolute block-table column; -1 where the row stored none
    checkpoint_tokens: np.ndarray
    checkpoint_col: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.uid)

    def positions(self, batch_rows: np.ndarray) -> np.ndarray:
        """Positions in this view of recorded batch rows; -1 for rows it does not hold."""
        index = self._row_index
        rows = np.asarray(batch_rows, dtype=np.int64)
        # Out-of-range rows (negative ones included, as unsigned) read the trailing -1.
        return index[np.minimum(rows.view(np.uint64), len(index) - 1).view(np.int64)]

    def __post_init__(self) -> None:
        # int64 copies of the columns the forward model does arithmetic on, and the position
        # of each recorded batch row (-1 where none; the last entry stays -1): made once per
        # view, used several times per step.
        self.computed64 = self.computed.astype(np.int64)
        self.scheduled64 = self.scheduled.astype(np.int64)
        self.draft64 = self.draft.astype(np.int64)
        self.accepted64 = self.accepted.astype(np.int64)
        self.uid64 = self.uid.astype(np.int64)
        self.slot64 = self.slot.astype(np.int64)  # block-table indices: int64 for gathers
        self.state_col64 = self.state_col.astype(np.int64)
        # Accepted count a decode reads its window column by (column accepted-1).
        self.accepted_prev64 = np.maximum(self.accepted_prev, 1).astype(np.int64)
        index = np.full(int(self.batch_row.max()) + 2 if self.num_rows else 1, -1, np.int64)
        index[self.batch_row] = np.arange(self.num_rows)
        self._row_index = index

    def uid_at(self, positions: np.ndarray) -> np.ndarray:
        """uids at view positions; the padded-row uid where a position is -1."""
        uid = self.uid64
        if not self.num_rows:
            return np.full(len(positions), DUMMY_REQUEST, dtype=np.int64)
        return np.where(positions >= 0, uid[positions], DUMMY_REQUEST)

    def group_order(self, first: np.ndarray, live: np.ndarray | None) -> np.ndarray:
        """Positions of the ``live`` rows (all where None), those marked ``first`` before
        the others, each part in batch order."""
        if live is None:
            return np.concatenate([first.nonzero()[0], (~first).nonzero()[0]])
        return np.concatenate([(first & live).nonzero()[0], (~first & live).nonzero()[0]])

    @property
    def moved(self) -> np.ndarray:
        """Rows whose running column changed: the precopy moved their state, accepted := 1."""
        return (self.prev_state_col >= 0) & (self.prev_state_col != self.state_col)


def split_under_threshold(
    batch: StepBatch,
    threshold: int,
    k: int,
    *,
    runner: str = "v1",
    builder_threshold: int | None = None,
    gdn: bool = False,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """Which rows the Mamba builder treats as prefills with the batch reordered at
    ``threshold``. V1 reorders its persistent rows at the runner's threshold and the builder
    then splits at its own (``builder_threshold``, as recorded; 1+k where not recorded).
    ``order``: V1's rows in that reorder's order, as positions into the batch
    (``RankTrace.persistent_order``); without it the recorded order is reordered again,
    which starts from rows an earlier reorder at the recorded threshold placed. V2
    never reorders by a threshold: it sorts (rows with drafts, then rows of the decode length
    1+k, then by token count; older vLLMs sorted by count alone), so there the batch is
    sorted again by that rule and the builder splits it at ``threshold`` itself.

    A GDN builder (``gdn``) with spec decode marks its spec-decode rows by their draft
    counts, wherever the order puts them; only a step without a marked row (and a run
    without spec decode) is split by position, at 1."""
    c = batch.cols
    n, comp, prompt = c["num_scheduled"], c["num_computed"], c["num_prompt"]
    if gdn and k > 0:
        spec = gdn_spec_rows(n, comp, prompt, np.maximum(c["num_draft"], 0))
        if np.count_nonzero(spec):
            return ~spec
    if runner == "v2":
        order, split_at = v2_order(n, c["num_draft"] > 0, 1 + k), threshold
    else:
        if order is None:
            swaps = reorder_swaps(regions(n, comp, prompt, threshold))
            order = np.asarray(apply_swaps(list(range(batch.num_rows)), swaps), dtype=np.int64)
        split_at = builder_threshold if builder_threshold is not None else 1 + k
    if not len(order):
        return np.zeros(0, dtype=bool)
    if gdn:
        split_at = 1
    num_decodes = mamba_split(n[order], comp[order], prompt[order], split_at)
    prefill = np.ones(batch.num_rows, dtype=bool)
    prefill[order[:num_decodes]] = False
    return prefill


def row_view(
    batch: StepBatch,
    rules: RuleSet,
    *,
    recorded_threshold: int | None,
    k: int,
    runner: str = "v1",
    builder_threshold: int | None = None,
    gdn: bool = False,
    persistent_order: Callable[[int], np.ndarray | None] | None = None,
) -> RowView:
    """``recorded_threshold``, ``builder_threshold``: the step's recorded reorder and Mamba
    builder thresholds, needed only under a ``reorder_threshold`` rule; ``gdn``: the builder
    splits as GDN's does; ``persistent_order``: V1's row order after a reorder at a given
    threshold (``RankTrace.persistent_order`` of the step)."""
    c = batch.cols
    prefill = c["is_prefill_split"].astype(bool)
    if rules["reorder_threshold"] != AS_RECORDED:
        threshold = resolve_threshold(rules["reorder_threshold"], recorded_threshold, k)
        if threshold is not None:
            prefill = split_under_threshold(
                batch,
                threshold,
                k,
                runner=runner,
                builder_threshold=builder_threshold,
                gdn=gdn,
                # at the recorded threshold the recorded rows are that reorder's own order
                order=None
                if persistent_order is None or threshold == recorded_threshold
                else persistent_order(threshold),
            )
    accepted_prev = c["accepted_prev"].copy()
    if rules["accepted_source"] == "cpu":
        cpu = c["accepted_prev_cpu"]
        accepted_prev = np.where(cpu >= 0, cpu, accepted_prev)
    return RowView(
        step=batch.step,
        uid=batch.uid,
        batch_row=c["batch_row"].astype(np.int64),
        slot=c["req_slot"],
        computed=c["num_computed"],
        scheduled=c["num_scheduled"],
        draft=np.maximum(c["num_draft"], 0),
        prompt=c["num_prompt"],
        state_col=c["state_col"],
        prev_state_col=c["prev_state_col"],
        accepted_prev=accepted_prev,
        accepted=c["accepted"],
        prefill_split=prefill,
        checkpoint_tokens=c["checkpoint_tokens"],
        checkpoint_col=c["checkpoint_col"],
    )


def launch_under_rules(launch: AlignLaunch, rules: RuleSet, *, runner: str) -> AlignLaunch:
    """The launch the replay runs: recompiled row rule, accepted counts from their source."""
    changes: dict[str, object] = {}
    rule = rules["bt_row_is_req"]
    if rule != AS_RECORDED and launch.kernel != "aligned_indices":
        by_slot = rule == "true"
        changes["row_rule"] = "req_slot" if by_slot else "batch_row"
        changes["bt_row"] = None
        if runner == "v2":
            # Slot-indexed rows live in the per-slot source tables, batch rows in the gather.
            changes["bt_table"] = "source" if by_slot else "input"
    if rules["accepted_source"] == "cpu" and launch.num_accepted_cpu is not None:
        cpu = launch.num_accepted_cpu
        has = ~np.ma.getmaskarray(cpu)
        data = np.ma.getdata(cpu)
        if launch.num_accepted is not None:
            changes["num_accepted"] = np.where(has, data, launch.num_accepted).astype(np.int32)
        if launch.kernel == "precopy" and launch.token_bias is not None:
            bias = np.maximum(data - 1, 0)
            changes["token_bias"] = np.where(has, bias, launch.token_bias).astype(np.int32)
    return replace(launch, **changes) if changes else launch
