"""One trace from several ranks: the per-rank directories a multi-worker recording writes.

A recording with more than one worker writes one trace per rank, ``DIR/rank-NNN``, each with
its own manifest, because every worker process writes its own parts. Readers see ``DIR`` as one
trace: its manifest is the union of the rank manifests, rebuilt on every open so that it never
goes stale. Parts added later to the whole trace (replay findings) are kept in a manifest at
``DIR`` itself that marks the directory as merged; the rank parts are never copied into it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mgtrace.errors import ManifestError
from mgtrace.schemas.manifest import (
    MANIFEST_NAME,
    Drops,
    Manifest,
    PartInfo,
    RunMetadata,
    StateLayout,
)

RANK_DIR = re.compile(r"rank-(\d{3,})")
# one engine's trace among several recorded side by side: two engines under one shell
# (engine-PID), or the data-parallel ranks of one, each an engine of its own (dp-NNN)
ENGINE_DIR = re.compile(r"engine-\d+|dp-\d{3,}")
MERGED_KIND = "merged-ranks"
MISSING_RANKS = "missing_ranks"  # the errors entry of a merged trace some ranks are absent from
# Run fields every rank of one engine shares; a mismatch means directories of different runs.
SHARED_RUN_FIELDS = (
    "runner",
    "num_speculative_tokens",
    "mamba_block_size",
    "mamba_cache_mode",
    "async_scheduling",
    "tp_size",
    "pp_size",
    # ranks of two DP ranks are two engines' ranks: separate schedulers, steps and requests
    "dp_size",
    "dp_rank",
)


def rank_directories(trace_dir: Path) -> dict[int, Path]:
    """``rank-NNN`` subdirectories holding a manifest, by rank."""
    found: dict[int, Path] = {}
    if not trace_dir.is_dir():
        return found
    for child in sorted(trace_dir.iterdir()):
        m = RANK_DIR.fullmatch(child.name)
        if m and (child / MANIFEST_NAME).is_file():
            found[int(m.group(1))] = child
    return found


def engine_directories(trace_dir: Path) -> list[Path]:
    """``engine-PID`` and ``dp-NNN`` subdirectories: the traces of engines recorded side by
    side."""
    if not trace_dir.is_dir():
        return []
    return sorted(c for c in trace_dir.iterdir() if ENGINE_DIR.fullmatch(c.name) and c.is_dir())


def is_merged(manifest: Manifest) -> bool:
    return manifest.source.get("kind") == MERGED_KIND


def merge_ranks(
    trace_dir: Path,
    ranks: dict[int, Path],
    read: Callable[[Path], Manifest],
    own: Manifest | None = None,
) -> Manifest:
    """The union of the rank manifests under ``trace_dir``; ``own`` holds the parts that were
    added to the whole trace. ``read`` loads one manifest file (kept injectable so that this
    module does not import the loader that calls it)."""
    if not ranks:
        raise ManifestError(
            f"{trace_dir} is marked as a merged multi-rank trace but holds no rank-NNN trace"
        )
    children = {rank: read(path) for rank, path in ranks.items()}
    first_rank = min(children)
    first = children[first_rank]
    for rank, child in children.items():
        for name in SHARED_RUN_FIELDS:
            a, b = getattr(first.run, name), getattr(child.run, name)
            if a != b:
                raise ManifestError(
                    f"{ranks[rank].name} and {ranks[first_rank].name} of {trace_dir} disagree "
                    f"on {name} ({b!r} vs {a!r}); they are not ranks of one run"
                )
    missing, missing_count = _missing_ranks(first.run, children)
    merged = Manifest(
        run=_merged_run([c.run for c in children.values()]),
        source={
            "kind": MERGED_KIND,
            "ranks": {ranks[r].name: c.source for r, c in sorted(children.items())},
        },
        drops=_merged_drops([c.drops for c in children.values()]),
        complete=not missing and all(c.complete for c in children.values()),
        created_unix=min(c.created_unix for c in children.values()),
        closed_unix=None
        if any(c.closed_unix is None for c in children.values())
        else max(c.closed_unix for c in children.values()),
        mgtrace_version=first.mgtrace_version,
    )
    for rank, child in sorted(children.items()):
        name = ranks[rank].name
        merged.parts += [
            replace(p, path=f"{name}/{p.path}", rank=rank if p.rank is None else p.rank)
            for p in child.parts
        ]
        merged.errors.update({f"{name}: {key}": value for key, value in child.errors.items()})
    if missing:
        merged.errors[MISSING_RANKS] = {"count": missing_count, "first": missing}
    if own is not None:
        merged.parts += own_parts(own.parts)
    return merged


def _missing_ranks(run: RunMetadata, children: dict[int, Manifest]) -> tuple[str | None, int]:
    """Which of the engine's TP x PP workers left no trace, said as a clause, and how many:
    a replay of the others cannot speak for the steps of those. A worker whose trace was
    closed with no step while another's holds some (its writer opened, nothing recorded)
    counts as missing; one still open may not have written its first part yet."""
    workers = run.tp_size * run.pp_size
    recorded = {
        r
        for r, c in children.items()
        if c.closed_unix is None or any(p.table == "steps" for p in c.parts)
    }
    have = recorded or set(children)  # none recorded a step yet: every trace counts
    present = sum(1 for r in have if r < workers)
    if present == workers:
        return None, 0
    absent: list[int] = []
    rank = 0
    while len(absent) < 8 and rank < workers:  # at most len(children) + 8 turns
        if rank not in have:
            absent.append(rank)
        rank += 1
    more = workers - present - len(absent)
    names = ", ".join(f"rank-{r:03d}" for r in absent) + (f" and {more} more" if more else "")
    return (
        f"the recording lacks {names} of the {workers} workers of its run "
        f"(TP {run.tp_size} x PP {run.pp_size})",
        workers - present,
    )


def own_parts(parts: list[PartInfo]) -> list[PartInfo]:
    """The parts added to the whole trace: none of a ``rank-NNN`` directory."""
    return [p for p in parts if not RANK_DIR.fullmatch(p.path.split("/", 1)[0])]


def _merged_run(runs: list[RunMetadata]) -> RunMetadata:
    """The first rank's run, with the pool and the layers of all ranks (pipeline stages hold
    different layers)."""
    run = replace(runs[0])
    sizes = [r.num_blocks for r in runs if r.num_blocks is not None]
    run.num_blocks = max(sizes) if sizes else None
    run.num_mamba_groups = max(r.num_mamba_groups for r in runs)
    seen: dict[tuple[int, int, str], StateLayout] = {}
    for r in runs:
        for s in r.states:
            seen.setdefault((s.group, s.layer, s.kind), s)
    run.states = [seen[key] for key in sorted(seen)]
    return run


def _merged_drops(all_drops: list[Drops]) -> Drops:
    return Drops(
        steps=sum(d.steps for d in all_drops),
        malformed_steps=sum(d.malformed_steps for d in all_drops),
        rows=sum(d.rows for d in all_drops),
        step_ranges=sorted(r for d in all_drops for r in d.step_ranges),
    )
