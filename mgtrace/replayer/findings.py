"""Oracle findings: the record type, its stable signature, and writing them to the trace."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
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
    rows = []
    for f in findings:
        row = asdict(f)
        row.pop("mechanism")
        row.update(replay_id=replay_id, rules=rules, signature=f.signature)
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=FINDINGS.schema)


def save_findings(trace: Path, findings: list[Finding], *, replay_id: str, rules: str) -> None:
    """Add this replay's findings to the trace (replacing an earlier replay of the same id)."""
    table = findings_table(findings, replay_id=replay_id, rules=rules)
    append_table(trace, "findings", table, tag=f"replay-{replay_id}")


def summarize(findings: list[Finding]) -> dict[str, int]:
    return dict(Counter(f.kind for f in findings))
