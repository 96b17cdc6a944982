"""Oracle findings: the record type, its stable signature, and writing them to the trace."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mgtrace.schemas.manifest import Manifest
from mgtrace.schemas.tables import FINDINGS
from mgtrace.schemas.writer import append_table

FOREIGN_STATE = "foreign_state"
WRONG_TOKENS = "wrong_tokens"
FOREIGN_BLOCK_WRITE = "foreign_block_write"
BLOCK_COLLISION = "block_collision"
MALFORMED = "malformed"
# a saved replay's part: its name's prefix (the replay id follows), and the footer entry
# that says what its rows cannot
REPLAY_PART_PREFIX = "replay-"
REPLAY_KEY = b"mgtrace.replay"


@dataclass(frozen=True)
class Finding:
    """One thing the oracle saw go wrong, at one step, for one request."""

    kind: str
    mechanism: str  # what went wrong, without ids or numbers: the stable part of a signature
    rank: int
    step: int
    req_id: str
    batch_row: int | None
    detail: str
    group: int | None = None
    block_id: int | None = None
    writer_req_id: str | None = None
    writer_step: int | None = None

    @property
    def signature(self) -> str:
        return f"{self.kind}:{self.mechanism}"


def findings_table(findings: list[Finding], *, replay_id: str, rules: str) -> pa.Table:
    """One row per finding, built a column at a time (a replay of a long buggy trace finds
    a hundred thousand; ``dataclasses.asdict`` took seconds over them)."""
    n = len(findings)
    given = {
        "replay_id": [replay_id] * n,
        "rules": [rules] * n,
        "signature": [f.signature for f in findings],
    }
    columns = {
        field.name: pa.array(
            given[field.name]
            if field.name in given
            else list(map(attrgetter(field.name), findings)),
            field.type,
        )
        for field in FINDINGS.schema
    }
    return pa.table(columns, schema=FINDINGS.schema)


def save_findings(
    trace: Path,
    findings: list[Finding],
    *,
    replay_id: str,
    rules: str,
    stopped_at_gap: dict[int, int] | None = None,
    crossed_gaps: dict[int, int] | None = None,
    read_from: Manifest | None = None,
) -> None:
    """Add this replay's findings to the trace (replacing an earlier replay of the same id),
    with its rules (a clean replay has no row to hold them) and how far it went: per rank,
    the gap it stopped before or the first it crossed (``--allow-gaps``), so that whoever
    reads the findings later can say so. ``read_from``: the manifest of the trace as the
    replay read it; OutputError where another trace has replaced it since."""
    table = findings_table(findings, replay_id=replay_id, rules=rules)
    note = {
        "rules": rules,
        "stopped_at_gap": {str(r): g for r, g in (stopped_at_gap or {}).items()},
        "crossed_gaps": {str(r): g for r, g in (crossed_gaps or {}).items()},
    }
    append_table(
        trace,
        "findings",
        table,
        tag=f"{REPLAY_PART_PREFIX}{replay_id}",
        metadata={REPLAY_KEY: json.dumps(note).encode()},
        read_from=read_from,
    )


@dataclass(frozen=True)
class SavedReplay:
    """What a saved replay's part says of it beyond its rows: its rules (None where the part
    does not say) and how far it went on each rank (empty: to the end of its window)."""

    rules: str | None
    stopped_at_gap: dict[int, int]
    crossed_gaps: dict[int, int]


def saved_replay(part: Path) -> SavedReplay:
    """What a saved replay's part says of it; nothing for a part saved before this was
    kept, or whose note cannot be read (the findings themselves stand)."""
    try:
        raw = (pq.read_schema(part).metadata or {}).get(REPLAY_KEY)
        said = json.loads(raw) if raw else {}
        rules = said.get("rules")
        return SavedReplay(
            rules if isinstance(rules, str) else None,
            *(
                {int(r): int(g) for r, g in said.get(key, {}).items()}
                for key in ("stopped_at_gap", "crossed_gaps")
            ),
        )
    except (OSError, ValueError, TypeError, AttributeError, RecursionError, pa.ArrowException):
        return SavedReplay(None, {}, {})


def summarize(findings: list[Finding]) -> dict[str, int]:
    return dict(Counter(f.kind for f in findings))
