"""Replays of recordings attached mid-run against the whole run they were cut from.

Each configuration is simulated whole, then cut as a recording attached at a later step
would hold it (``attached_at``). Per cut, one line: the whole run's findings from the attach
on, the cut's, ``extra`` (a finding of the cut whose request and signature the whole run
had not reported by that step: a false positive of the attach) and ``missed`` (a request
and signature of the whole run after the attach that the cut never reports, by kind; reads
of state written before the attach are left unchecked, so some are expected).

    python -m tests.mid_run_sweep [SEED ...]
"""

from __future__ import annotations

import collections
import itertools
import sys
import tempfile
from pathlib import Path

from mgtrace.replayer.loop import replay_trace
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.test_replay_mid_run import attached_at

CONFIGS: list[tuple[str | None, dict[str, object]]] = [
    (None, {"runner": "v1", "scenario": "pairs"}),
    (None, {"runner": "v2", "pp": 2, "scenario": "mixed"}),
    (None, {"runner": "v2", "scenario": "steady"}),
    ("stale-condense-row", {"runner": "v1", "scenario": "pairs"}),
    ("reorder-threshold-mismatch", {"runner": "v1", "scenario": "pairs"}),
    ("async-accepted-race", {"runner": "v1", "scenario": "pairs"}),
    ("batch-row-block-table", {"runner": "v2", "pp": 2, "scenario": "pairs"}),
]
ATTACHES = (60, 300)
STEPS = 1200


def main(seeds: list[int]) -> int:
    root = Path(tempfile.mkdtemp(prefix="mid-run-sweep-"))
    false_positives = 0
    for (bug, engine), seed in itertools.product(CONFIGS, seeds):
        name = f"{bug or 'clean'}-{seed}-" + "-".join(f"{k}{v}" for k, v in engine.items())
        whole = root / name
        bugs = (bug,) if bug else ()
        simulate(SimConfig(steps=STEPS, seed=seed, bugs=bugs, output=whole, **engine).validate())
        full = replay_trace(TraceReader(whole)).findings
        first_seen: dict[tuple, int] = {}
        for f in full:
            key = (f.rank, f.req_id, f.signature)
            first_seen[key] = min(first_seen.get(key, f.step), f.step)
        for attach in ATTACHES:
            cut = replay_trace(TraceReader(attached_at(whole, root / f"{name}-{attach}", attach)))
            got = {(f.rank, f.req_id, f.signature): f.step + attach for f in cut.findings}
            after = {(f.rank, f.req_id, f.signature) for f in full if f.step >= attach}
            extra = [k for k, step in got.items() if first_seen.get(k, 1 << 30) > step]
            missed = collections.Counter(k[2].split(":")[0] for k in after if k not in got)
            false_positives += len(extra)
            print(
                f"{name} attach={attach}: whole {len(after)}, attached {len(got)}, "
                f"extra {len(extra)}, missed {dict(missed)}",
                flush=True,
            )
    print(f"false positives: {false_positives}")
    return 1 if false_positives else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [0, 1]))
