"""What `mgtrace info` reports about a trace, as plain data (rendering lives elsewhere)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import duckdb

from mgtrace.query.history import whole_replay_id
from mgtrace.query.rank_steps import rank_step_offsets
from mgtrace.replayer.findings import REPLAY_PART_PREFIX, saved_replay
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES
from mgtrace.schemas.writer import PART_SUFFIX


def trace_info(reader: TraceReader) -> dict[str, Any]:
    """Run metadata, sizes, completeness and drops of a trace, JSON-serialisable."""
    con = reader.connect()
    steps, ranks, first_step, last_step = con.execute(
        "SELECT count(DISTINCT step), count(DISTINCT rank), min(step), max(step) FROM steps"
    ).fetchone()
    requests = reader.rows("requests")
    if not requests:
        requests = con.execute("SELECT count(DISTINCT req_id) FROM batch_rows").fetchone()[0]
    saved = saved_replays(reader, con)
    m = reader.manifest
    return {
        "path": str(reader.path),
        "schema_version": m.schema_version,
        "mgtrace_version": m.mgtrace_version,
        "complete": m.complete,
        "created_unix": m.created_unix,
        "closed_unix": m.closed_unix,
        "source": m.source,
        "run": asdict(m.run),
        "steps": int(steps),
        "first_step": first_step,
        "last_step": last_step,
        "ranks": int(ranks),
        # per rank, how its step numbers sit against the lowest rank's (see rank_steps)
        "rank_step_offsets": rank_step_offsets(con),
        "requests": int(requests),
        "rows": {name: reader.rows(name) for name in TABLES},
        "parts": len(reader.parts),
        "bytes_on_disk": reader.size_on_disk(),
        "drops": asdict(m.drops),
        "errors": m.errors,
        "ground_truth": m.ground_truth,
        # every saved replay, clean ones (a findings part without rows) included
        "replays": len(saved),
        "saved_replays": saved,
        "skipped_parts": [asdict(s) for s in reader.skipped],
        "open_parts_left": reader.open_parts_left(),
        "unlisted_parts": reader.unlisted_parts(),
    }


def saved_replays(reader: TraceReader, con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Each replay saved in the trace, clean ones included: its id, rules, whether it covers
    the whole trace (not a window or some ranks), its findings and first step, and the gaps
    it stopped before or crossed, per rank."""
    counted = {
        rid: (rules, int(n), first)
        for rid, rules, n, first in con.execute(
            "SELECT replay_id, any_value(rules), count(*), min(step) FROM findings GROUP BY ALL"
        ).fetchall()
    }
    out = []
    for part in reader.part_files("findings"):
        if not (part.name.startswith(REPLAY_PART_PREFIX) and part.name.endswith(PART_SUFFIX)):
            continue
        replay_id = part.name[len(REPLAY_PART_PREFIX) : -len(PART_SUFFIX)]
        said = saved_replay(part)
        rules_of_rows, findings, first = counted.get(replay_id, (None, 0, None))
        rules = said.rules or rules_of_rows
        out.append(
            {
                "replay_id": replay_id,
                "rules": rules,
                "whole": None if rules is None else whole_replay_id(rules) == replay_id,
                "findings": findings,
                "first_step": first,
                "stopped_at_gap": {str(r): g for r, g in said.stopped_at_gap.items()},
                "crossed_gaps": {str(r): g for r, g in said.crossed_gaps.items()},
            }
        )
    return out
