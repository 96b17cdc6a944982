"""Whether a replay speaks for the whole run: a clean one not when steps are missing from the
trace (dropped, left out with a damaged part) or the recording never finished; none fully
where the engine wrote state the forward model does not write."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import AS_RECORDED, RuleSet
from mgtrace.replayer.steps import (
    REPLAY_TABLES,
    category_codes,
    complete_steps,
    first_gap,
    in_flight_at_start,
    spec_decodes_run_first,
)
from mgtrace.schemas.ranks import MISSING_RANKS
from mgtrace.schemas.tables import SCHED_KINDS


def missing_from(reader: Any, gaps: bool = False) -> list[str]:
    """What ``reader``'s trace lacks of the run, each as a clause: dropped or left-out steps
    (of the tables a replay reads; ``gaps``: steps found missing), an unfinished recording."""
    problems = []
    left_out = any(s.table in REPLAY_TABLES for s in getattr(reader, "skipped", ()))
    if gaps or left_out or reader.manifest.drops.total_steps:
        problems.append("the trace has dropped or left-out steps")
    missing_ranks = reader.manifest.errors.get(MISSING_RANKS)
    if missing_ranks is not None:
        problems.append(missing_ranks["first"])
    elif not reader.manifest.complete:
        problems.append("the recording did not finish (complete=false)")
    return problems


def unseen_reason(reader: Any, gaps: bool = False) -> str | None:
    """Why a clean replay of ``reader``'s trace is inconclusive, or None when it is not.
    ``gaps``: the replay met steps missing from the trace. Only the tables a replay reads
    count: a left-out part of another one hides nothing from it. A replay that met no step
    it could replay is not called clean."""
    problems = missing_from(reader, gaps)
    if not problems:
        return None
    if not _any_step_replayable(reader):
        return (
            f"no step could be replayed: {' and '.join(problems)}, so nothing can be said "
            "about the run"
        )
    return (
        f"the replay is clean, but {' and '.join(problems)}, so corruption may lie in what "
        "is missing"
    )


def _any_step_replayable(reader: Any) -> bool:
    """Whether some rank has a step whose replayed rows are all in the trace."""
    table = reader.table("steps", columns=["rank", "step"])
    ranks = table.column("rank").to_numpy(zero_copy_only=False)
    steps = table.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
    return any(
        bool(complete_steps(reader, int(r), steps[ranks == r]).any()) for r in np.unique(ranks)
    )


def unmodelled_writes(run: Any) -> str | None:
    """What the engine wrote that the replay's forward model does not, when the run says
    so; None otherwise."""
    if run.prefill_checkpoint_blocks and not run.prefill_checkpoints_recorded:
        return (
            "this engine's Mamba prefills also stored block-boundary states themselves "
            "(prefill checkpoints), and the recording did not say where (this vLLM has no "
            "MambaPrefillCheckpointBuilder.build to hook): a later prefix-cache hit on such a "
            "block can be reported as foreign_state or wrong_tokens where the engine was "
            "right, and a wrong checkpoint write goes unseen"
        )
    return None


def mid_run_caveat(reader: Any) -> str | None:
    """What a replay cannot judge in a recording that attached to a running engine (a
    repro's start state holds what came before: nothing then)."""
    from mgtrace.replayer.checkpoint import start_state

    if start_state(reader) is not None or not reader.rows("sched"):
        return None
    # integer codes throughout: a long trace has millions of scheduler rows
    sched = reader.table("sched", columns=["rank", "step", "req_id", "kind"], codes=True)
    ranks = np.asarray(sched.column("rank").to_numpy(zero_copy_only=False))
    steps = np.asarray(sched.column("step").to_numpy(zero_copy_only=False))
    uids = RequestIds().uids_of_column(sched.column("req_id"))
    kinds = category_codes(sched.column("kind"), SCHED_KINDS)
    if np.any(steps[1:] < steps[:-1]):  # parts are read in step order: mostly sorted
        order = np.argsort(steps, kind="stable")
        ranks, uids, kinds, steps = ranks[order], uids[order], kinds[order], steps[order]
    all_steps = reader.table("steps", columns=["rank", "step"])
    step_ranks = all_steps.column("rank").to_numpy(zero_copy_only=False)
    step_numbers = all_steps.column("step").to_numpy(zero_copy_only=False).astype(np.int64)

    def in_flight(r: int) -> int:
        # a request first seen after the rank's first gap may have arrived in it
        hole = first_gap(np.sort(step_numbers[step_ranks == r]))
        mine = ranks == r
        return in_flight_at_start(uids[mine], kinds[mine], steps[mine], hole)

    n = max(in_flight(int(r)) for r in np.unique(ranks))
    if not n:
        return None
    return (
        f"the recording began mid-run, with {n} request(s) in flight: state written before "
        "it has no writer the replay can know, so a read of a block the trace never saw "
        "written is left unchecked"
    )


def rule_note(run: Any, rules: RuleSet) -> str | None:
    """How a rule reads on this run where that differs from its one-line description."""
    if rules["reorder_threshold"] == AS_RECORDED:
        return None
    notes = []
    if run.runner == "v2":
        notes.append(
            "the V2 runner never reorders its batch by a threshold (it sorts by drafts and "
            "query length): reorder_threshold here sorts the batch again by that rule and "
            "re-splits it for the Mamba builder at that threshold"
        )
    if spec_decodes_run_first(run):
        notes.append(
            "this model's GDN builder marks its spec-decode rows by their draft counts, not "
            "by position: reorder_threshold reorders the rows, and the split changes only in "
            "steps without a spec-decode row (split by position at 1)"
        )
    return "; ".join(notes) or None


def gaps_in_words(gaps: Mapping[Any, int], word: str) -> str:
    """Per rank, the step of a gap: "rank 0 before step 200, rank 1 before step 210" (``word``:
    before or at); ranks given as numbers or as the digits JSON keeps them in."""
    by_rank = sorted(gaps.items(), key=lambda rank_gap: int(rank_gap[0]))
    return ", ".join(f"rank {r} {word} step {g}" for r, g in by_rank)


def stopped_caveat(stopped: dict[int, int]) -> str | None:
    """The ranks a replay ended before a gap, in words (None: none did)."""
    if not stopped:
        return None
    where = gaps_in_words(stopped, "before")
    return (
        f"the replay stopped where the trace lacks steps ({where}): the shadow state cannot "
        "be rebuilt across them, so nothing after them was replayed"
    )


def crossed_caveat(crossed: dict[int, int], first_step: int | None) -> str | None:
    """The gaps a replay crossed (--allow-gaps), in words (None: it crossed none)."""
    if not crossed:
        return None
    where = gaps_in_words(crossed, "at")
    before = (
        f" (its first finding, at step {first_step}, lies before them)"
        if first_step is not None and first_step < min(crossed.values())
        else ""
    )
    return (
        f"the replay crossed steps the trace lacks ({where}): the shadow state was not "
        "rebuilt across them, so what it found from there on may come from the missing "
        f"steps rather than from the run{before}"
    )
