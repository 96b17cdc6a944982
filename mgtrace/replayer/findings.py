"""Oracle findings: the record type, its stable signature, and writing them to the trace."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import pyarrow as pa

from mgtrace.schemas.tables import FINDINGS
from mgtrace.schemas.writer import append_table

FOREIGN_STATE = "foreign_state"
WRONG_TOKENS = "wrong_tokens"
FOREIGN_BLOCK_WRITE = "foreign_block_write"
BLOCK_COLLISION = "block_collision"
MALFORMED = "malformed"


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


def save_findings(trace: Path, findings: list[Finding], *, replay_id: str, rules: str) -> None:
    """Add this replay's findings to the trace (replacing an earlier replay of the same id)."""
    table = findings_table(findings, replay_id=replay_id, rules=rules)
    append_table(trace, "findings", table, tag=f"replay-{replay_id}")


def summarize(findings: list[Finding]) -> dict[str, int]:
    return dict(Counter(f.kind for f in findings))
