"""The align-mode frees the replay's block ownership derives from a trace, against those the
simulator's allocator made while writing it: random engine shapes, every free compared
(request, step, block). The ownership rule is the one ``mgtrace history`` shows in its
``frees`` column and the replay uses to drop writes onto freed blocks.

    python -m tests.frees_sweep --runs 40 --seed 7 [--jobs N] [--pipeline async] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from mgtrace.api import Trace
from mgtrace.errors import MgtraceError
from mgtrace.sim.block_pool import AlignAllocator
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from mgtrace.sim.scheduler import Scheduler


@contextmanager
def allocator_frees() -> Iterator[set[tuple[str, int, int]]]:
    """While open, the (request, step, block) of every block the simulator's allocator frees
    behind a running request, taken from the allocator itself."""
    frees: set[tuple[str, int, int]] = set()
    now = {"step": -1}
    schedule, retire = Scheduler.schedule, AlignAllocator.retire

    def timed_schedule(self, step):
        now["step"] = step
        return schedule(self, step)

    def noted_retire(self, req, processed_tokens):
        blocks = retire(self, req, processed_tokens)
        frees.update((req, now["step"], block) for block in blocks)
        return blocks

    Scheduler.schedule, AlignAllocator.retire = timed_schedule, noted_retire
    try:
        yield frees
    finally:
        Scheduler.schedule, AlignAllocator.retire = schedule, retire


def history_frees(path: Path) -> set[tuple[str, int, int]]:
    """The (request, step, block) of every free that ``mgtrace history`` shows."""
    trace = Trace(path)
    found = set()
    for (req,) in trace.sql("SELECT DISTINCT req_id FROM sched ORDER BY 1").fetchall():
        for line in trace.history(req).to_pylist():
            for block in re.findall(r"block (\d+)", line["freed"] or ""):
                found.add((req, line["step"], int(block)))
    return found


def random_engine(rng: random.Random) -> dict:
    engine: dict = {"runner": rng.choice(["v1", "v2"])}
    if engine["runner"] == "v2":
        engine["pp"] = rng.choice([1, 2, 3])
    engine.update(
        scenario=rng.choice(["pairs", "mixed", "steady"]),
        k=rng.choice([1, 2, 3]),
        mamba_block_size=rng.choice([16, 64]),
        prefix_hit_prob=rng.choice([0.0, 0.5, 1.0]),
        length_scale=rng.choice([0.05, 0.2]),
        max_num_seqs=rng.choice([16, 48, 96]),
        num_blocks=rng.choice([None, None, 120, 200]),  # small pools preempt
    )
    return engine


def check(job: tuple[int, int, dict, Path]) -> dict:
    """One run: the frees of both sides compared (None: a shape the simulator refuses)."""
    i, seed, engine, tmp = job
    if engine.get("pp", 1) > 1 and "async_scheduling" not in engine:
        # a V2 pipeline is async (vLLM's decode cadence) or synchronous, taken from the seed
        # so that the shapes of a sweep seed stay the ones earlier sweeps drew
        engine = {**engine, "async_scheduling": (seed // 4) % 2 == 0}
    cfg = SimConfig(steps=300, seed=seed, output=tmp / f"run-{i}", overwrite=True, **engine)
    try:
        cfg.validate()
    except MgtraceError:
        return {"run": i, "seed": seed, "engine": engine, "frees": None}
    with allocator_frees() as frees:
        simulate(cfg)
    shown = history_frees(cfg.output)
    return {
        "run": i,
        "seed": seed,
        "engine": engine,
        "frees": len(frees),
        "only_simulator": sorted(frees - shown)[:5],
        "only_history": sorted(shown - frees)[:5],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument(
        "--pipeline",
        choices=["drawn", "async", "sync"],
        default="drawn",
        help="drawn: the shapes as drawn; async / sync: every run a V2 pipeline of that kind.",
    )
    ap.add_argument("--out", type=Path, help="Write the sweep's summary here as JSON.")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    drawn = [(rng.randrange(10**6), random_engine(rng)) for _ in range(args.runs)]
    if args.pipeline != "drawn":
        # every run a V2 pipeline of the one kind, the other draws kept
        drawn = [
            (
                seed,
                {
                    **e,
                    "runner": "v2",
                    "pp": 2 + seed % 3,
                    "async_scheduling": args.pipeline == "async",
                },
            )
            for seed, e in drawn
        ]
    with tempfile.TemporaryDirectory(prefix="mgtrace-frees-") as tmp:
        jobs = [(i, seed, engine, Path(tmp)) for i, (seed, engine) in enumerate(drawn)]
        with ProcessPoolExecutor(max(args.jobs, 1)) as pool:
            records = list(pool.map(check, jobs))
    checked = [r for r in records if r["frees"] is not None]
    differ = [r for r in checked if r["only_simulator"] or r["only_history"]]
    for r in records:
        print(json.dumps(r))
    print(
        f"{len(differ)} of {len(checked)} runs differ; {sum(r['frees'] for r in checked)} "
        f"frees compared ({len(records) - len(checked)} shapes refused by the simulator)",
        file=sys.stderr,
    )
    if args.out is not None:
        summary = {
            "check": "align-mode frees: replay ownership rule vs the simulator's allocator "
            "(tests/frees_sweep.py)",
            "command": " ".join(["python -m tests.frees_sweep", *sys.argv[1:]]),
            "runs": len(records),
            "checked": len(checked),
            "frees_compared": sum(r["frees"] for r in checked),
            "runs_that_differ": differ,
        }
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
