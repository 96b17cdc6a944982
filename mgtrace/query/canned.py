"""Canned triage queries: the questions asked of every trace, as SQL over the trace views.

Each returns SQL text, so a notebook can show it, edit it and run it with ``Trace.sql``.
"""

from __future__ import annotations

from mgtrace.errors import UsageError

# The lowest rank that recorded rows: every rank of an engine (tensor or pipeline parallel)
# records the same batch, so one rank's rows are the batch, and rank 0 may be missing (a
# process the recorder could not reach).
LOWEST_RANK = "(SELECT min(rank) FROM batch_rows)"

BATCH_COMPOSITION = """
SELECT step,
       count(*) FILTER (WHERE reorder_region = 'decode')       AS decode,
       count(*) FILTER (WHERE reorder_region = 'short_extend') AS short_extend,
       count(*) FILTER (WHERE reorder_region = 'long_extend')  AS long_extend,
       count(*) FILTER (WHERE reorder_region = 'prefill')      AS prefill,
       count(*) FILTER (WHERE num_draft > 0 AND mamba_split = 'prefill') AS drafts_in_prefill_split
FROM batch_rows WHERE rank = {rank}
GROUP BY step ORDER BY step
"""

# One rank's rows (see LOWEST_RANK): counting every rank's would count each row once per rank.
ACCEPTED_DISTRIBUTION = f"""
SELECT accepted, count(*) AS rows
FROM batch_rows
WHERE accepted IS NOT NULL AND num_draft > 0 AND rank = {LOWEST_RANK}
GROUP BY accepted ORDER BY accepted
"""

FINDINGS_OVER_TIME = """
SELECT step, kind, count(DISTINCT req_id) AS requests
FROM findings {where}
GROUP BY step, kind ORDER BY step
"""

FIRST_DECODE_IN_PREFILL_SPLIT = """
-- The field re-analysis: was a request's first spec-decode step run through the Mamba
-- prefill kernels, and did replay find its state corrupted?
WITH decode AS (
  SELECT req_id, step, mamba_split FROM batch_rows WHERE num_draft > 0
), first_decode AS (
  SELECT req_id, arg_min(mamba_split, step) = 'prefill' AS first_decode_in_prefill_split
  FROM decode GROUP BY req_id
), corrupted AS (
  SELECT DISTINCT req_id FROM findings {where}
)
SELECT f.first_decode_in_prefill_split,
       count(*) AS requests,
       count(c.req_id) AS flagged_by_replay
FROM first_decode f LEFT JOIN corrupted c USING (req_id)
GROUP BY ALL ORDER BY ALL
"""

REQUEST_BLOCKS = """
SELECT step, req_id, kind, unnest(new_block_ids[1]) AS block_id
FROM sched WHERE req_id IN ({requests}) AND new_block_ids IS NOT NULL
ORDER BY step
"""


# The field re-analysis cross-tab against the client's labels (``@client-labels``): a
# request's first decode step sat in the Mamba prefill region when a prefill-region row of it
# had computed between prompt_len and prompt_len + W tokens and W or fewer scheduled
# (W = 1 + k).
CROSSTAB_SQL = """\
WITH hits AS (
  SELECT r.req_id,
         bool_or(coalesce(b.num_computed BETWEEN r.prompt_len AND r.prompt_len + {window}
                          AND b.num_scheduled <= {window}, false)) AS first_in_prefill,
         bool_or(coalesce(b.num_computed > r.prompt_len + {window}
                          AND b.num_scheduled <= {window}, false)) AS later_in_prefill
  FROM requests r
  LEFT JOIN batch_rows b ON b.req_id = r.req_id AND b.mamba_split = 'prefill'
  WHERE r.corrupt IS NOT NULL
  GROUP BY r.req_id
)
SELECT CASE WHEN h.first_in_prefill THEN 'FIRST decode step in Mamba prefill region'
            ELSE 'first decode step clean' END
       || CASE WHEN h.later_in_prefill THEN ' | later decode steps in prefill region'
               ELSE '' END AS region,
       count(*) AS n,
       count(*) FILTER (WHERE r.corruption_marker LIKE 'salad%') AS salad,
       count(*) FILTER (WHERE r.corruption_marker LIKE 'empty%') AS empty
FROM hits h JOIN requests r USING (req_id)
GROUP BY region ORDER BY region"""


DEFAULT_LABEL_WINDOW = 4  # 1 + k of the field reproducer's MTP (k = 3), where k is unknown


def crosstab_sql(window: int = DEFAULT_LABEL_WINDOW) -> str:
    return CROSSTAB_SQL.format(window=int(window))


def label_window(k: int | None) -> int:
    """The cross-tab's window, 1 + k; the field default where k is not known (an imported
    probe log does not carry it)."""
    return 1 + k if k else DEFAULT_LABEL_WINDOW


def findings_filter(replay_id: str | None) -> str:
    if replay_id is None:
        return ""
    return "WHERE replay_id = '" + replay_id.replace("'", "''") + "'"


def as_recorded_replay_id() -> str:
    """The replay id of ``mgtrace replay TRACE`` (no rule flags, no step window): the one
    saved replay that says what the trace did. Counterfactual and windowed replays are saved
    under other ids; counting them too flags requests the run never corrupted."""
    from mgtrace.replayer.cli import replay_id_for
    from mgtrace.replayer.rules import RuleSet

    return replay_id_for(RuleSet())


# What the canned queries over findings read, said in their descriptions.
AS_RECORDED_SOURCE = "the saved whole-trace replay as recorded (`mgtrace replay TRACE`)"


def quoted(values: list[str]) -> str:
    return ", ".join("'" + v.replace("'", "''") + "'" for v in values) or "''"


CLIENT_LABELS = "client-labels"

# The canned queries by name, as ``mgtrace sql TRACE @NAME`` runs them: (SQL, what it answers;
# ``named`` fits the client-label cross-tab's window to the trace).
NAMED: dict[str, tuple[str, str]] = {
    "batch-composition": (
        BATCH_COMPOSITION.format(rank=LOWEST_RANK),
        "per step of the lowest rank: rows per reorder region, and drafts in the Mamba prefill "
        "split",
    ),
    "accepted-distribution": (
        ACCEPTED_DISTRIBUTION,
        "how many rows accepted how many tokens, over the spec-decode rows of the lowest rank "
        "(an engine's ranks run the same batch)",
    ),
    "findings-over-time": (
        FINDINGS_OVER_TIME.format(where=findings_filter(as_recorded_replay_id())),
        f"per step and kind, the requests found by {AS_RECORDED_SOURCE}",
    ),
    CLIENT_LABELS: (
        crosstab_sql(),
        "the field re-analysis of client labels (an imported load-generator log): requests "
        "by whether their first decode step sat in the Mamba prefill region, window 1+k "
        f"({DEFAULT_LABEL_WINDOW} where k is unknown), and how many the client saw as word "
        "salad or empty",
    ),
    "first-decode-in-prefill-split": (
        FIRST_DECODE_IN_PREFILL_SPLIT.format(where=findings_filter(as_recorded_replay_id())),
        "the field re-analysis: first spec-decode step in the Mamba prefill split vs findings "
        f"of {AS_RECORDED_SOURCE}",
    ),
}


def named(query: str, k: int | None = None) -> str:
    """``query`` itself, or the canned query it names as ``@NAME`` (``k``: the trace's
    speculative token count, which the client-label cross-tab's window depends on)."""
    if not query.startswith("@"):
        return query
    if query[1:] == CLIENT_LABELS:
        return crosstab_sql(label_window(k))
    found = NAMED.get(query[1:])
    if found is None:
        raise UsageError(
            f"no canned query {query!r}; there are: " + ", ".join("@" + n for n in NAMED)
        )
    return found[0]


# The canned queries that read what the as-recorded replay saved.
READ_FINDINGS = frozenset(("findings-over-time", "first-decode-in-prefill-split"))


def unsaved_replay_note(query: str, saved: bool, trace: str) -> str | None:
    """The line ``mgtrace sql`` adds when ``query`` is a canned query over the findings of
    the as-recorded replay and that replay is not ``saved``: its columns read as if the
    replay found nothing. None otherwise."""
    if saved or query[1:] not in READ_FINDINGS or not query.startswith("@"):
        return None
    return (
        f"no replay of this trace as recorded is saved, so its findings columns are empty; "
        f"run: mgtrace replay {trace}"
    )
