"""Injected-bug ground truth: which step each toggle first corrupts, and whom.

The runners report one event per (step, request) a toggle corrupts, with what the buggy engine
consumed (``recorded``) and what a correct engine would have used (``correct``). This module
folds them into the manifest's ``ground_truth``.
"""

from __future__ import annotations

from typing import Any

from mgtrace.sim.config import (
    BUG_ASYNC_RACE,
    BUG_BATCH_ROW,
    BUG_REORDER,
    BUG_STALE_ROW,
    SimConfig,
)

MECHANISMS = {
    BUG_REORDER: (
        "vllm#55894: a drafter attention backend reports reorder threshold 1, the runner takes "
        "the minimum, and spec-decode rows behind a chunked-prefill continuation land in the "
        "Mamba builder's prefill split (state read from column 0, drafts folded in)"
    ),
    BUG_BATCH_ROW: (
        "vllm#55506/#55951: with PP the align post-process of non-last ranks runs pp_size steps "
        "late with that step's idx_mapping but indexes the gathered batch-ordered block table "
        "by batch row, which by then holds another step's requests"
    ),
    BUG_ASYNC_RACE: (
        "vllm#51571: the accepted-count device-to-host copy targets the row-indexed InputBatch "
        "buffer; when it lands before the row moves, the prev_positions remap reads moved rows"
    ),
    BUG_STALE_ROW: (
        "vllm#49757: condense leaves the vacated block-table row with live block ids; padded "
        "rows of a CUDA-graph batch gather their state indices from it and write there"
    ),
}

MAX_EVENTS = 2000  # per toggle in the manifest; the count is always exact


class GroundTruth:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.per_bug: dict[str, dict[str, Any]] = {
            b: {
                "mechanism": MECHANISMS[b],
                "first_step": None,
                "first_requests": [],
                "affected_requests": set(),
                "num_events": 0,
                "events": [],
            }
            for b in cfg.bugs
        }

    def add(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            entry = self.per_bug.get(ev["bug"])
            if entry is None:
                continue
            step = ev["step"]
            if entry["first_step"] is None or step < entry["first_step"]:
                entry["first_step"] = step
                entry["first_requests"] = []
            # corrupted by the event: the request that consumed the wrong inputs, and the one
            # whose state block it wrote over (a misdirected post-process)
            corrupted = [ev["req_id"]] + ([ev["victim"]] if ev.get("victim") else [])
            first = entry["first_requests"]
            if step == entry["first_step"]:
                first += [r for r in corrupted if r not in first]
            entry["affected_requests"].update(corrupted)
            entry["num_events"] += 1
            if len(entry["events"]) < MAX_EVENTS:
                entry["events"].append({k: v for k, v in ev.items() if k != "bug"})

    def first_step(self, bug: str) -> int | None:
        return self.per_bug[bug]["first_step"]

    def to_dict(self) -> dict[str, Any]:
        bugs = {}
        for name, e in self.per_bug.items():
            bugs[name] = {
                "mechanism": e["mechanism"],
                "first_step": e["first_step"],
                "first_requests": sorted(e["first_requests"]),
                "affected_requests": sorted(e["affected_requests"]),
                "num_events": e["num_events"],
                "events_truncated": e["num_events"] > len(e["events"]),
                "events": e["events"],
            }
        return {
            "injected": list(self.cfg.bugs),
            "first_step": min(
                (e["first_step"] for e in self.per_bug.values() if e["first_step"] is not None),
                default=None,
            ),
            "bugs": bugs,
        }
