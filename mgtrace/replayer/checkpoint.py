"""On-disk replay checkpoints, so that a replay can start mid-trace.

A checkpoint holds what a replay carries from one step to the next: the tag pool, the block
tables, block ownership and the oracle's memory. The last few batches the post-process may
still need are rebuilt from the trace on restore. Checkpoints are a cache keyed by the
trace's parts, the rules and the layout: a stale or foreign file is never used, and deleting
the cache changes nothing but speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mgtrace import __version__
from mgtrace.atomic import atomic_write
from mgtrace.replayer.loop import Checkpoint, RankReplay
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.steps import spec_decodes_run_first
from mgtrace.replayer.view import row_view
from mgtrace.schemas.reader import TraceReader

CACHE_DIR = ".replay-cache"
log = logging.getLogger("mgtrace")


# Tables a replay writes and never reads: saving findings must not make the cache stale.
NOT_REPLAYED = frozenset({"findings"})


def cache_key(reader: TraceReader, rules: str, layout: str) -> str:
    h = hashlib.sha256()
    for part in sorted(reader.parts, key=lambda p: p.path):
        if part.table not in NOT_REPLAYED:
            h.update(part.sha256.encode())
    h.update(f"{rules}|{layout}|{__version__}".encode())
    return h.hexdigest()[:16]


def cache_dir(reader: TraceReader, rules: str, layout: str) -> Path:
    return reader.path / CACHE_DIR / cache_key(reader, rules, layout)


def save(directory: Path, rank: int, cp: Checkpoint) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    owner, since, held, retired = cp.ownership
    arrays = {
        "pool": cp.pool,
        "owner": owner,
        "since": since,
        "retired": retired,
        "wrote": cp.wrote,
        "meta": np.array(
            json.dumps(
                {
                    "step": cp.step,
                    "findings": cp.findings,
                    "held": {str(k): v for k, v in held.items()},
                    "repeats": [[u, sig, n] for (u, sig), n in cp.repeats.items()],
                    "tables": {kind: len(ts) for kind, ts in cp.tables.items()},
                }
            )
        ),
    }
    for kind, tables in cp.tables.items():
        for g, t in enumerate(tables):
            arrays[f"table_{kind}_{g}"] = t
    target = directory / f"rank{rank:03d}-step{cp.step:09d}.npz"
    atomic_write(target, lambda fh: np.savez_compressed(fh, **arrays))
    return target


def _cached(directory: Path, rank: int, step: int) -> list[tuple[int, Path]]:
    """Checkpoints of ``rank`` taken after a step earlier than ``step``, newest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob(f"rank{rank:03d}-step*.npz"):
        try:
            s = int(path.stem.rsplit("step", 1)[1])
        except ValueError:
            continue  # not a name this cache gives
        if s < step:
            found.append((s, path))
    return sorted(found, reverse=True)


def cached_before(directory: Path, rank: int, step: int) -> bool:
    """Whether ``directory`` names a checkpoint of ``rank`` taken before ``step``."""
    return bool(_cached(directory, rank, step))


def restore_cached(rep: RankReplay, directory: Path, rank: int, step: int) -> int | None:
    """Restore the newest readable cached checkpoint before ``step``; return its last step,
    or None when there is none. A damaged file is a cache miss: it is removed (where the
    cache can be written) and the next older one tried."""
    for _, path in _cached(directory, rank, step):
        try:
            cp = load(path)
        except Exception as exc:  # truncated, foreign or from another layout
            try:
                path.unlink(missing_ok=True)
                done = "was removed"
            except OSError:  # a cache this user cannot write: a miss all the same
                done = "was skipped (it cannot be removed)"
            # the first sentence of the reader's reason: numpy goes on to advise loading
            # pickles unsafely, which is no advice for a cache file mgtrace wrote
            why = str(exc).split(". ")[0].rstrip(".")
            log.warning("mgtrace: a damaged replay checkpoint %s (%s: %s)", done, path, why)
            continue
        return _restore_loaded(rep, cp)
    return None


@dataclass
class StartState:
    """A trace that begins mid-run (a minimized repro) carries the replay state before its
    first step: one checkpoint per rank, and the request-id order its tags were written in."""

    request_ids: list[str]
    checkpoints: dict[int, Path | Checkpoint]


START_STATE_DIR = "start-state"


def start_state(reader: object) -> StartState | None:
    held = getattr(reader, "start_state", None)
    if held is not None:
        return held
    source = getattr(reader, "manifest", None) and reader.manifest.source  # type: ignore[attr-defined]
    info = (source or {}).get("start_state")
    path = getattr(reader, "path", None)
    if not info or path is None:
        return None
    directory = Path(path) / info["dir"]
    checkpoints: dict[int, Path | Checkpoint] = {}
    for file in sorted(directory.glob("rank*-step*.npz")):
        checkpoints[int(file.name[4:7])] = file
    return StartState(list(info["request_ids"]), checkpoints)


def request_ids_for(reader: object) -> tuple[RequestIds, StartState | None]:
    """Request uids for the ranks of ``reader``, numbered as its start state's tags were
    written (when the trace carries one), and that start state."""
    ids = RequestIds()
    seed = start_state(reader)
    if seed is not None:
        ids.preload(seed.request_ids)
    return ids, seed


def start_from(rep: RankReplay, seed: StartState | None) -> int:
    """Put a fresh replay at the start state its trace carries (a minimized repro starts
    mid-run); return the first step to replay (0 either way)."""
    rank = rep.trace.rank
    if seed is not None and rank in seed.checkpoints:
        rep.oracle.unwritten_unknown = False  # the start state holds what came before
        return restore(rep, seed.checkpoints[rank]) + 1
    return 0


def restore(rep: RankReplay, path: Path | Checkpoint) -> int:
    """Load a checkpoint (a file, or one held in memory) into ``rep``; return its last step."""
    if isinstance(path, Checkpoint):
        rep.restore(path)
        return path.step
    return _restore_loaded(rep, load(path))


def _restore_loaded(rep: RankReplay, cp: Checkpoint) -> int:
    """Restore a checkpoint read from a file, rebuilding the row views it does not hold."""
    rep.oracle.findings.clear()
    rep.restore(cp)
    trace = rep.trace
    for s in range(cp.step - rep.keep_views + 1, cp.step + 1):
        batch = trace.batch(s)
        # a repro's start state may leave deferred batches before step 0 (at negative steps)
        if s >= 0 or batch.num_rows:
            rep.views[s] = row_view(
                batch,
                rep.rules,
                recorded_threshold=trace.step_value("reorder_threshold", s),
                k=rep.k,
                runner=rep.runner,
                builder_threshold=trace.step_value("mamba_threshold", s),
                gdn=spec_decodes_run_first(trace.run),
                persistent_order=lambda threshold, s=s: trace.persistent_order(s, threshold),
            )
    return cp.step


def load(path: Path) -> Checkpoint:
    """A checkpoint file as a Checkpoint without views (``restore`` rebuilds them)."""
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        tables = {
            kind: [data[f"table_{kind}_{g}"] for g in range(n)]
            for kind, n in meta["tables"].items()
        }
        cp = Checkpoint(
            step=meta["step"],
            pool=data["pool"],
            tables=tables,
            ownership=(
                data["owner"],
                data["since"],
                {int(k): v for k, v in meta["held"].items()},
                # older files: every column not yet freed (the next retire frees what is due)
                data["retired"] if "retired" in data.files else np.zeros(1, dtype=np.int64),
            ),
            wrote=data["wrote"],
            repeats={(u, sig): n for u, sig, n in meta["repeats"]},
            findings=0,
            views={},
        )
    return cp
