"""Whether the ranks of a trace number the same engine steps alike.

Every rank of an engine runs the scheduler's output of each step, yet each worker numbers
the steps it records from its own first one. A recording that attaches to a running engine
arms every worker on its own, at that worker's next step; pipeline stages begin a step at
different times, so one rank's recording may begin a step or more after another's. The
scheduler rows of a step (requests, kinds, token counts) are the same on every rank, and the
computed counts make them differ from one step to the next: matching them gives each rank's
offset from the lowest rank.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

# A rank's first steps matched against the lowest rank's first steps: offsets up to this
# many steps are found (activating the workers takes well under a second).
MATCHED_STEPS = 512

# filtered before grouping: a long recording's later steps are never aggregated
FINGERPRINTS = f"""
WITH firsts AS (SELECT rank, min(step) AS first FROM sched GROUP BY rank)
SELECT s.rank, s.step,
       hash(string_agg(concat_ws(':', s.req_id, s.kind, s.num_scheduled, s.num_computed), ','
                       ORDER BY s.req_id, s.kind, s.num_scheduled, s.num_computed))
FROM sched s JOIN firsts f ON s.rank = f.rank
WHERE s.step < f.first + {MATCHED_STEPS}
GROUP BY s.rank, s.step
"""


def rank_step_offsets(con: Any) -> dict[int, int | None]:
    """Per rank: the ``d`` for which its step ``s`` is the lowest rank's step ``s + d`` (0
    where they agree, and for the lowest rank itself), or None when its first steps'
    scheduler rows match none of the lowest rank's first steps, or disagree somewhere under
    the best offset. Empty for a trace of one rank."""
    by_rank: dict[int, dict[int, int]] = {}
    for rank, step, fingerprint in con.execute(FINGERPRINTS).fetchall():
        by_rank.setdefault(int(rank), {})[int(step)] = fingerprint
    if len(by_rank) < 2:
        return {}
    lowest = min(by_rank)
    steps_of: dict[int, list[int]] = {}
    for step, fingerprint in by_rank[lowest].items():
        steps_of.setdefault(fingerprint, []).append(step)
    offsets: dict[int, int | None] = {lowest: 0}
    for rank, fingerprints in sorted(by_rank.items()):
        if rank == lowest:
            continue
        votes = Counter(
            other - step
            for step, fingerprint in fingerprints.items()
            for other in steps_of.get(fingerprint, ())
        )
        offsets[rank] = _agreeing_offset(votes, fingerprints, by_rank[lowest])
    return offsets


def _agreeing_offset(
    votes: Counter[int], fingerprints: dict[int, int], lowest: dict[int, int]
) -> int | None:
    """The offset most steps vote for, when every step the two ranks share under it has the
    same scheduler rows on both."""
    if not votes:
        return None
    offset, matched = votes.most_common(1)[0]
    shared = sum(1 for step in fingerprints if step + offset in lowest)
    return offset if matched == shared else None


def step_offsets_caveat(reader: Any) -> str | None:
    """``offsets_sentence`` for an open trace."""
    ranks = {p.rank for p in reader.parts if p.table == "sched"}
    if len(ranks) < 2 and None not in ranks:  # a part of no one rank may hold several
        return None  # one rank (or none): nothing to match, no query to run
    return offsets_sentence(rank_step_offsets(reader.connect()))


def offset_notes(offsets: dict[int, int | None]) -> list[str]:
    """A note per rank whose step numbers are not the lowest rank's."""
    lowest = min(offsets, default=0)
    notes = []
    for rank, offset in sorted(offsets.items()):
        if offset is None:
            notes.append(
                f"rank {rank}'s scheduler outputs do not line up with rank {lowest}'s over their "
                f"first {MATCHED_STEPS} steps, so its step numbers cannot be matched to them"
            )
        elif offset:
            sign = "+" if offset > 0 else "-"
            notes.append(f"rank {rank}'s step s is rank {lowest}'s step s{sign}{abs(offset)}")
    return notes


def offsets_summary(offsets: dict[int, int | None]) -> str | None:
    """The ``rank steps`` line of a trace's info; None for a trace of one rank."""
    if len(offsets) < 2:
        return None
    notes = offset_notes(offsets)
    if not notes:
        return "a step is the same engine step on every rank"
    if any(offsets.values()):  # a number other than 0
        notes.append("the ranks began recording at different engine steps")
    return "; ".join(notes)


def offsets_sentence(offsets: dict[int, int | None]) -> str | None:
    """One sentence on the ranks whose step numbers are not the lowest rank's; None when
    every rank's agree (or the trace has one rank)."""
    notes = offset_notes(offsets)
    if not notes:
        return None
    if not any(offsets.values()):  # no number other than 0: only ranks that do not line up
        return "; ".join(notes)
    return (
        "the ranks began recording at different engine steps and number steps from their "
        f"own first one: {'; '.join(notes)}"
    )
