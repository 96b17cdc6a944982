"""One request's life in a trace, a line per rank and step: what the scheduler said of it,
where it sat in the batch, the counts its kernels consumed, where align mode freed its
previous state blocks, the row moves that carried it and what replays found about it, as
reader and as the request whose state was involved.

The question after "which requests came back as word salad": what happened to this one.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa

from mgtrace.errors import UsageError
from mgtrace.replayer.coverage import gaps_in_words
from mgtrace.replayer.findings import REPLAY_PART_PREFIX, saved_replay
from mgtrace.replayer.ownership import (
    BlockOwnership,
    freed_below,
    processed_tokens,
    steps_in_flight,
)
from mgtrace.replayer.rules import AS_RECORDED, RuleSet
from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.tables import SCHED_KINDS
from mgtrace.schemas.writer import PART_SUFFIX
from mgtrace.shell import path_arg

if TYPE_CHECKING:
    from mgtrace.replayer.checkpoint import StartState
    from mgtrace.schemas.reader import TraceReader

# A scheduler row, a batch row, a row move, a freed state block or a finding of the request
# makes a line. Parameters: $1 the request id, $2..$3 the step range, $4 the replay id of the
# whole-trace replay whose findings show (null: every saved replay),
# $5 the block table that holds a request's own row (v1: InputBatch rows; V2: per-slot source
# tables), $6 one rank (null: every rank). ``history_frees`` (rank, step, freed) is registered
# beside the trace's views.
HISTORY_SQL = """
WITH
sched_r AS (
  SELECT rank, step,
         -- new block ids, null columns left out; a cached request with none is most
         -- steps: left blank
         string_agg(CASE
             WHEN len(coalesce([b FOR b IN flatten(new_block_ids) IF b <> 0], [])) = 0
             THEN nullif(kind, 'cached')
             ELSE kind || ' +blocks '
                  || array_to_string([b FOR b IN flatten(new_block_ids) IF b <> 0], ',')
             END, '; ') AS scheduler
  FROM sched WHERE req_id = $1 GROUP BY rank, step
),
rows_r AS (
  SELECT rank, step, batch_row, req_slot, num_computed, num_scheduled, num_draft,
         accepted_prev, accepted_prev_cpu, accepted, prev_state_col, state_col,
         mamba_split || CASE WHEN checkpoint_col IS NULL THEN ''
                             ELSE ', checkpoint ' || checkpoint_tokens || ' tokens at col '
                                  || checkpoint_col END AS mamba_split,
         reorder_region
  FROM batch_rows WHERE req_id = $1
),
-- the block at the running column (first Mamba group): the request's own table row as it
-- stood at the step, i.e. its latest recorded content
own_rows AS (
  SELECT rank, step, "row", block_ids FROM block_tables
  WHERE "table" = $5 AND "group" = 0
),
rows_b AS (
  SELECT r.*, t.block_ids[r.state_col + 1] AS block
  FROM rows_r r ASOF LEFT JOIN own_rows t
    ON r.rank = t.rank AND r.req_slot = t."row" AND r.step >= t.step
),
moves_r AS (
  SELECT rank, step,
         string_agg(CASE op
             WHEN 'swap' THEN 'swap ' || row_a || '<->' || row_b
             WHEN 'move' THEN 'move ' || row_a || '->' || row_b
             ELSE op || ' ' || row_a END
           || CASE WHEN req_id = $1 AND accepted_a IS NOT NULL
                   THEN ' (carried accepted ' || accepted_a || ')'
                   WHEN req_id_b = $1 AND accepted_b IS NOT NULL
                   THEN ' (carried accepted ' || accepted_b || ')'
                   ELSE '' END, '; ' ORDER BY seq) AS row_moves
  FROM row_moves WHERE req_id = $1 OR req_id_b = $1 GROUP BY rank, step
),
found AS (
  SELECT DISTINCT rank, step, rules, signature, req_id, writer_req_id, batch_row, block_id
  FROM findings WHERE (req_id = $1 OR writer_req_id = $1) AND ($4 IS NULL OR replay_id = $4)
),
found_r AS (
  -- one text per finding, joined in a fixed order (a line reads the same on every run)
  SELECT rank, step, string_agg(DISTINCT text, '; ' ORDER BY text) AS findings
  FROM (
    SELECT rank, step, signature || CASE
             WHEN req_id <> $1 THEN ' (with ' || req_id || ')'
             WHEN writer_req_id IS NOT NULL AND writer_req_id <> $1
             THEN ' (with ' || writer_req_id || ')'
             ELSE '' END AS text
    FROM found
  ) GROUP BY rank, step
),
lines AS (
  SELECT rank, step FROM sched_r UNION SELECT rank, step FROM rows_b
  UNION SELECT rank, step FROM moves_r UNION SELECT rank, step FROM found_r
  UNION SELECT rank, step FROM history_frees
)
SELECT l.rank, l.step, s.scheduler, r.batch_row, r.req_slot, r.num_computed,
       r.num_scheduled, r.num_draft, r.accepted_prev, r.accepted_prev_cpu, r.accepted,
       r.prev_state_col, r.state_col, r.block,
       a.freed, r.mamba_split, r.reorder_region, m.row_moves, f.findings
FROM lines l
LEFT JOIN sched_r s USING (rank, step)
LEFT JOIN rows_b r USING (rank, step)
LEFT JOIN history_frees a USING (rank, step)
LEFT JOIN moves_r m USING (rank, step)
LEFT JOIN found_r f USING (rank, step)
WHERE l.step BETWEEN $2 AND $3 AND ($6 IS NULL OR l.rank = $6)
ORDER BY l.step, l.rank
"""

NO_STEP_LIMIT = 2**62
HISTORY_FREES = pa.schema([("rank", pa.int32()), ("step", pa.int64()), ("freed", pa.string())])


def resolve_request(
    con: duckdb.DuckDBPyConnection, wanted: str, start: StartState | None = None
) -> str:
    """The trace's request id for ``wanted``: itself, or the one id that contains it (a
    load generator's log often holds only the number). One clear sentence otherwise, which
    names a request of the trace's start state (a repro's) that no step schedules."""
    ids = [
        r[0]
        for r in con.execute(
            "SELECT DISTINCT req_id FROM (SELECT req_id FROM batch_rows "
            "UNION ALL SELECT req_id FROM sched) WHERE contains(req_id, $1) ORDER BY req_id",
            [wanted],
        ).fetchall()
    ]
    if wanted in ids:
        return wanted
    if len(ids) == 1:
        return ids[0]
    if not ids:
        waiting = [
            r[0]
            for r in con.execute(
                "SELECT DISTINCT req_id FROM requests WHERE contains(req_id, $1) ORDER BY 1",
                [wanted],
            ).fetchall()
        ]
        if wanted in waiting or len(waiting) == 1:
            name = wanted if wanted in waiting else waiting[0]
            raise UsageError(
                f"request {name} arrived but was never scheduled in the trace, so it has no "
                "history (the requests view of `mgtrace sql` has its row)"
            )
        held = [r for r in (start.request_ids if start else ()) if wanted in r]
        if wanted in held or len(held) == 1:
            name = wanted if wanted in held else held[0]
            raise UsageError(
                f"request {name} is in the trace's start state only: it held state from "
                "before the trace's first step, and no step of the trace schedules it, so it "
                "has no history here (the trace it was cut from has)"
            )
        raise UsageError(
            f"no request id in the trace contains {wanted!r} (the requests view of "
            "`mgtrace sql` lists them)"
        )
    shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
    raise UsageError(f"{wanted!r} matches {len(ids)} requests ({shown}); give the whole id")


def align_frees(
    con: duckdb.DuckDBPyConnection,
    req_id: str,
    run: RunMetadata,
    start: StartState | None = None,
) -> pa.Table:
    """(rank, step, freed): where align mode frees the blocks ``req_id`` moved past (first
    Mamba group: its previous running block, a prefix hit's or a checkpoint's block), by the
    rule the replay's block ownership applies; the scheduler's deltas
    never say so. From that step on a write onto the block no longer harms the request.
    A request the trace first sees running starts from what ``start`` (a repro's start
    state) holds of it; without one its frees are left out until it is scheduled anew."""
    rows = con.execute(
        "SELECT rank, step, kind, num_scheduled, num_computed, "
        "coalesce(new_block_ids[1], []) FROM sched WHERE req_id = $1 ORDER BY rank, step",
        [req_id],
    ).fetchall()
    # one text per (rank, step): a line of the history is one step, however many blocks
    # it frees (a prefix hit's block and the previous running one can go together)
    freed: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rank, step) -> (col, block)
    for rank in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == rank]
        steps = np.array([r[1] for r in mine], dtype=np.int64)
        kinds = np.array([SCHED_KINDS.index(r[2]) for r in mine], dtype=np.int64)
        below = freed_below(
            processed_tokens(
                np.ones(len(mine), dtype=np.int64),
                steps,
                kinds,
                np.array([r[3] or 0 for r in mine], dtype=np.int64),
                np.array([r[4] or 0 for r in mine], dtype=np.int64),
                steps_in_flight(run),
            ),
            run.mamba_block_size,
        )
        largest = max((b for r in mine for b in r[5]), default=0)
        own = BlockOwnership(
            num_groups=1,
            num_blocks=max(run.num_blocks or 0, largest + 1),
            block_size=run.mamba_block_size,
            spec_blocks=run.num_speculative_tokens,
        )
        one = np.ones(1, dtype=np.int64)
        # a request the trace first sees running (a recording attached mid-run, a repro cut
        # from a longer trace) got its earlier blocks before it: which column a block of
        # the deltas fills is known from a start state, or once a new or resumed row gives
        # the whole row
        known = _adopt_saved(own, start, rank, req_id)
        for i, (_, step, kind, _, _, blocks) in enumerate(mine):
            if step < 0:  # a repro's steps in flight at its cut: counted above, done before
                continue
            known = known or kind in ("new", "resumed")
            if kind == "cached" and known:  # as the replay: frees first, then the blocks
                for _, _, col, block in own.retire(one, below[i : i + 1]):
                    freed.setdefault((rank, step), []).append((col, block))
            own.apply(step, [1], [kind], [[blocks]])
    return pa.table(
        {
            "rank": [rank for rank, _ in freed],
            "step": [step for _, step in freed],
            "freed": [
                ", ".join(f"col {col} (block {block})" for col, block in sorted(blocks))
                for blocks in freed.values()
            ],
        },
        schema=HISTORY_FREES,
    )


def _adopt_saved(own: BlockOwnership, start: StartState | None, rank: int, req_id: str) -> bool:
    """Give uid 1 of ``own`` what ``start`` holds of ``req_id`` on ``rank``."""
    from mgtrace.replayer import checkpoint as ckpt

    if start is None or rank not in start.checkpoints or req_id not in start.request_ids:
        return False
    saved = start.checkpoints[rank]
    snapshot = (saved if isinstance(saved, ckpt.Checkpoint) else ckpt.load(saved)).ownership
    # a start state numbers its requests 1, 2, ... in the order of its request ids
    return own.adopt(1, snapshot, start.request_ids.index(req_id) + 1)


def request_history(
    con: duckdb.DuckDBPyConnection,
    req_id: str,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    rules: str | None = AS_RECORDED,
    run: RunMetadata,
    rank: int | None = None,
    start: StartState | None = None,
) -> pa.Table:
    """The lines of ``req_id`` (an exact id; see ``resolve_request``), findings of replays
    under ``rules`` only (None: every saved replay), of ``rank`` only (None: every rank);
    ``start``: the trace's start state (``checkpoint.start_state``), where it has one."""
    params: list[object] = [
        req_id,
        0 if from_step is None else from_step,  # a repro's earlier steps are its context
        NO_STEP_LIMIT if to_step is None else to_step,
        whole_replay_id(rules),
        "v1" if run.runner == "v1" else "source",
        rank,
    ]
    con.register("history_frees", align_frees(con, req_id, run, start))
    try:
        return con.sql(HISTORY_SQL, params=params).to_arrow_table()
    finally:
        con.unregister("history_frees")


def shown_history(lines: pa.Table) -> pa.Table:
    """``request_history``'s lines as a person reads them: the CPU-held accepted count
    beside the consumed one where it differs ("1 (cpu 3)"), the running column's move
    where the precopy moved it ("4->5"). CSV and JSON keep the numbers in their columns."""
    if "accepted_prev_cpu" not in lines.column_names:  # already shown, or lines of a test
        return lines
    acc, cpu = lines.column("accepted_prev").to_pylist(), lines.column("accepted_prev_cpu")
    prev, col = lines.column("prev_state_col").to_pylist(), lines.column("state_col")
    accepted = [
        None if a is None else f"{a}" if c is None else f"{a} (cpu {c})"
        for a, c in zip(acc, cpu.to_pylist(), strict=True)
    ]
    running = [
        None if c is None else f"{c}" if p is None or p == c else f"{p}->{c}"
        for p, c in zip(prev, col.to_pylist(), strict=True)
    ]
    out = lines.drop_columns(["accepted_prev_cpu", "prev_state_col"])
    for name, values in (("accepted_prev", accepted), ("state_col", running)):
        i = out.column_names.index(name)
        out = out.set_column(i, name, pa.array(values, pa.string()))
    return out


def check_rank(reader: TraceReader, rank: int, trace: str | Path) -> None:
    """One sentence when ``trace`` has no rank ``rank``."""
    from mgtrace.replayer.steps import check_ranks

    check_ranks(reader, [rank], trace)


def first_finding(
    con: duckdb.DuckDBPyConnection,
    req_id: str,
    *,
    rules: str | None = AS_RECORDED,
    rank: int | None = None,
) -> tuple[int, int, str] | None:
    """(step, rank, sentence) of the earliest finding that involves ``req_id`` (on ``rank``
    only, unless None) saved by the whole-trace replay under ``rules`` (None: any replay)."""
    row = con.execute(
        "SELECT step, rank, detail FROM findings WHERE (req_id = $1 OR writer_req_id = $1) "
        "AND ($2 IS NULL OR replay_id = $2) AND ($3 IS NULL OR rank = $3) "
        "ORDER BY step, rank, req_id <> $1 LIMIT 1",
        [req_id, whole_replay_id(rules), rank],
    ).fetchall()
    return (int(row[0][0]), int(row[0][1]), str(row[0][2])) if row else None


def whole_replay_id(rules: str | None) -> str | None:
    """The replay id of the whole-trace replay under ``rules`` (canonical), as ``replay``
    saves it: a replay of a window or of some ranks is saved under another id, and its
    findings (each request's first in the window) are not what the run did. None: None."""
    if rules is None:
        return None
    from mgtrace.replayer.cli import replay_id_for

    return replay_id_for(RuleSet.parse(rules))


def saved_rules(reader: TraceReader, con: duckdb.DuckDBPyConnection) -> list[str]:
    """The rule sets of the whole-trace replays saved in the trace, clean ones included (a
    replay that found nothing saves a part without rows)."""
    from mgtrace.query.info import saved_replays  # info reads replay ids through this module

    return sorted({r["rules"] for r in saved_replays(reader, con) if r["whole"]})


def saved_replay_part(reader: TraceReader, rules: str) -> Path | None:
    """The findings part of the whole-trace replay under ``rules``, clean ones included:
    every saved replay is a findings part named after its replay id, rows or none."""
    name = f"{REPLAY_PART_PREFIX}{whole_replay_id(rules)}{PART_SUFFIX}"
    return next((p for p in reader.part_files("findings") if p.name == name), None)


def replay_saved(reader: TraceReader, rules: str) -> bool:
    """Whether the whole-trace replay under ``rules`` is saved, clean ones included."""
    return saved_replay_part(reader, rules) is not None


def _reach_within(
    reader: TraceReader, rules: str, last_step: int, rank: int | None
) -> tuple[dict[int, int], dict[int, int]]:
    """The gaps the saved replay under ``rules`` stopped before and crossed, per rank, at
    or before ``last_step`` (on ``rank`` only, unless None)."""
    part = saved_replay_part(reader, rules)
    if part is None:
        return {}, {}
    reach = saved_replay(part)
    return tuple(  # type: ignore[return-value]
        {r: g for r, g in gaps.items() if g <= last_step and rank in (None, r)}
        for gaps in (reach.stopped_at_gap, reach.crossed_gaps)
    )


def findings_note(
    reader: TraceReader,
    con: duckdb.DuckDBPyConnection,
    req_id: str,
    rules: str | None,
    trace: str | Path,
    *,
    rank: int | None = None,
) -> str | None:
    """The line ``mgtrace history`` ends with when the replay under ``rules`` (canonical; None:
    any replay) found nothing about ``req_id``: that the saved replay found nothing (before
    the gap it stopped at, where it stopped within the request's steps), or that none is
    saved and the command, rule flags included, that saves it. None when there is nothing
    to say (a finding, no rules asked for, or a trace without kernel launches, which no
    replay reads)."""
    if rules is None or not reader.rows("launches"):
        return None
    if first_finding(con, req_id, rules=rules) is not None:
        return None
    saved = saved_rules(reader, con)
    if rules in saved or replay_saved(reader, rules):
        first, last = request_span(con, req_id)
        stopped, _ = _reach_within(reader, rules, last, rank)
        if not stopped:
            return f"the saved replay under {rules} found nothing for this request"
        said = (
            "before this request's first step: it says nothing about this request"
            if min(stopped.values()) <= first
            else "and found nothing for this request before then"
        )
        return (
            f"the saved replay under {rules} stopped where the trace lacks steps "
            f"({gaps_in_words(stopped, 'before')}), {said}; --allow-gaps replays past them"
        )
    hint = f"saved replays: {', '.join(saved)}" if saved else "no replay is saved yet"
    command = shlex.join(["mgtrace", "replay", path_arg(trace), *RuleSet.parse(rules).as_flags()])
    return f"no findings of a replay under {rules} ({hint}); run: {command}"


def reach_note(
    reader: TraceReader,
    con: duckdb.DuckDBPyConnection,
    req_id: str,
    rules: str | None,
    *,
    rank: int | None = None,
) -> str | None:
    """The line ``mgtrace history`` adds when the saved replay under ``rules`` did not
    replay all of ``req_id``'s steps as recorded: it stopped before a gap (nothing after it
    was replayed; said by ``findings_note`` where it found nothing about the request) or
    crossed one (``--allow-gaps``: what it found, or did not, after it may come from the
    missing steps). None when it replayed them all."""
    if rules is None:
        return None
    _, last = request_span(con, req_id)
    stopped, crossed = _reach_within(reader, rules, last, rank)
    said = []
    if stopped and first_finding(con, req_id, rules=rules) is not None:
        said.append(
            f"the saved replay under {rules} stopped where the trace lacks steps "
            f"({gaps_in_words(stopped, 'before')}): this request's steps from there on were not "
            "replayed"
        )
    if crossed:
        said.append(
            f"the saved replay under {rules} crossed steps the trace lacks "
            f"({gaps_in_words(crossed, 'at')}): what it found for this request from there on, or "
            "did not, may come from the missing steps rather than from the run"
        )
    return "; ".join(said) or None


def gaps_note(con: duckdb.DuckDBPyConnection, lines: pa.Table) -> str | None:
    """The line ``mgtrace history`` adds when steps inside the span of its ``lines`` are
    missing from the trace on their ranks (dropped by the recorder, or in a part left out):
    a request can look unscheduled there when nothing is known. None when none is."""
    if not lines.num_rows:
        return None
    ranks = sorted(set(lines.column("rank").to_pylist()))
    steps = lines.column("step").to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    present = con.execute(
        "SELECT rank, step FROM steps WHERE list_contains($1, rank)", [ranks]
    ).fetchnumpy()
    spans: list[str] = []
    for rank in ranks:
        have = np.unique(present["step"][present["rank"] == rank])
        if not len(have):
            continue
        # inside the steps the rank recorded: a repro's deferred batches sit at negative
        # steps before its first one, and are no gap
        within = np.arange(max(lo, int(have[0])), min(hi, int(have[-1])) + 1)
        missing = np.setdiff1d(within, have)
        if not len(missing):
            continue
        breaks = np.flatnonzero(np.diff(missing) != 1)
        starts = missing[np.r_[0, breaks + 1]].tolist()
        ends = missing[np.r_[breaks, len(missing) - 1]].tolist()
        where = ", ".join(
            f"{a}" if a == b else f"{a}..{b}" for a, b in zip(starts, ends, strict=True)
        )
        spans.append(where if len(ranks) == 1 else f"{where} on rank {rank}")
    if not spans:
        return None
    return (
        f"the trace has no record of steps {'; '.join(spans)}: what happened to this "
        "request there is not known"
    )


def request_span(con: duckdb.DuckDBPyConnection, req_id: str) -> tuple[int, int]:
    """First and last step at which the trace mentions ``req_id``."""
    ((lo, hi),) = con.execute(
        "SELECT min(step), max(step) FROM (SELECT step FROM batch_rows WHERE req_id = $1 "
        "UNION ALL SELECT step FROM sched WHERE req_id = $1)",
        [req_id],
    ).fetchall()
    return int(lo), int(hi)


def request_summary(con: duckdb.DuckDBPyConnection, req_id: str) -> str:
    """What the requests table says of ``req_id``, in one line ("" when nothing): its
    lengths, prefix hit and finish, and the client's corruption label where one was given."""
    row = con.execute(
        "SELECT prompt_len, output_len, prefix_hit_tokens, finish_reason, corrupt, "
        "corruption_marker, client_id FROM requests WHERE req_id = $1 LIMIT 1",
        [req_id],
    ).fetchall()
    if not row:
        return ""
    prompt, output, hit, finish, corrupt, marker, client = row[0]
    parts = []
    if prompt is not None:
        parts.append(f"prompt {prompt} tokens" + (f" ({hit} from the prefix cache)" if hit else ""))
    if output is not None:
        parts.append(f"output {output} tokens")
    if finish is not None:
        parts.append(f"finished: {finish}")
    if corrupt is not None:
        label = "corrupt" if corrupt else "clean"
        parts.append(f"client saw it {label}" + (f" ({marker})" if marker else ""))
    if client is not None:
        parts.append(f"client id {client}")
    return "; ".join(parts)
