"""What `mgtrace info` reports about a trace, as plain data (rendering lives elsewhere)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mgtrace.query.rank_steps import rank_step_offsets
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import TABLES


def trace_info(reader: TraceReader) -> dict[str, Any]:
    """Run metadata, sizes, completeness and drops of a trace, JSON-serialisable."""
    con = reader.connect()
    steps, ranks, first_step, last_step = con.execute(
        "SELECT count(DISTINCT step), count(DISTINCT rank), min(step), max(step) FROM steps"
    ).fetchone()
    requests = reader.rows("requests")
    if not requests:
        requests = con.execute("SELECT count(DISTINCT req_id) FROM batch_rows").fetchone()[0]
    replays = con.execute("SELECT count(DISTINCT replay_id) FROM findings").fetchone()[0]
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
        "replays": int(replays),
        "skipped_parts": [asdict(s) for s in reader.skipped],
        "open_parts_left": reader.open_parts_left(),
        "unlisted_parts": reader.unlisted_parts(),
    }
