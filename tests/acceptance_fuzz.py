"""Randomised acceptance: simulated runs of random engine shapes, replayed and checked against
the simulator's ground truth.

Per run: one toggle, two or three V1 toggles together, or none; a random scenario, k, batch
size, block size, acceptance rate, prefix-hit rate and length scale. The replay as recorded
must report the earliest injected step first, naming the injected requests when one toggle
runs; the rules that undo the toggles must replay clean; a run without toggles must replay
clean. A run of one toggle that a rule can bring in (the reorder threshold, the batch-row
block table) has a clean twin, the same seed without the toggle: replayed under that rule,
it must report the injected first step and requests. The tests run a few seeded cases;
longer sweeps run from the command line:

    python -m tests.acceptance_fuzz --runs 400 --seed 1 [--jobs N] [--keep DIR] [--out FILE]
        [--mixer mamba2|gdn|both]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mgtrace.errors import MgtraceError
from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import BUG_BATCH_ROW, BUG_REORDER, SimConfig
from mgtrace.sim.engine import simulate
from tests.replay_helpers import TOGGLES, involved

V1_TOGGLES = [b for b, (engine, _) in TOGGLES.items() if engine["runner"] == "v1"]
# Rules that bring a toggle's mechanism into a run without it: the run's clean twin (the
# same seed, so the same schedule) replayed under the rule must find what the toggle injected
INTRODUCED_BY = {BUG_REORDER: "reorder_threshold=1", BUG_BATCH_ROW: "bt_row_is_req=false"}


@dataclass
class Case:
    bugs: tuple[str, ...]
    seed: int
    steps: int
    engine: dict = field(default_factory=dict)


def random_case(
    rng: random.Random, mixer: str = "mamba2", k: int | None = None, clean: str | None = None
) -> Case:
    """``mixer``: the simulated model's layers; ``both``: GDN for one seed in two (taken from
    the seed, like the checkpoints, so the Mamba2 cases of a sweep seed stay the same).
    ``k``: every case's draft count instead of a drawn one (drawn all the same, so the rest
    of each case is the one the seed gives; a toggle that needs drafts is then refused).
    ``clean``: a runner (v1 or v2) that every case runs without a bug, pipeline-parallel
    size 1, for a sweep of false positives alone."""
    shape = rng.choice(["clean", "one", "one", "several"])
    bugs: tuple[str, ...] = ()
    engine: dict = {"runner": rng.choice(["v1", "v2"])}
    if shape == "one":
        bug = rng.choice(list(TOGGLES))
        bugs = (bug,)
        engine = {k: v for k, v in TOGGLES[bug][0].items() if k != "scenario"}
    elif shape == "several":
        bugs = tuple(rng.sample(V1_TOGGLES, rng.choice([2, 3])))
        engine = {"runner": "v1"}
    elif engine["runner"] == "v2":
        engine["pp"] = rng.choice([1, 2, 3])
    engine.update(
        scenario=rng.choice(["pairs", "mixed", "steady"]),
        k=rng.choice([1, 2, 3, 4]),
        max_num_seqs=rng.choice([16, 48, 96, 128]),
        mamba_block_size=rng.choice([16, 64, 256]),
        acceptance_rate=rng.choice([0.3, 0.7, 0.95]),
        prefix_hit_prob=rng.choice([0.0, 0.5, 1.0]),
        length_scale=rng.choice([0.05, 0.2, 1.0]),
    )
    if k is not None:
        engine["k"] = k
    if clean is not None:
        bugs = ()
        engine = {key: v for key, v in engine.items() if key != "pp"}
        engine["runner"] = clean
    seed = rng.randrange(10**6)
    # half the runs model vLLM 0.33's prefill checkpoints; taken from the seed, not drawn, so
    # that the cases of a sweep seed stay the ones earlier sweeps ran
    engine["prefill_checkpoints"] = seed % 2 == 1
    if engine["runner"] == "v2" and engine.get("pp", 1) > 1:
        # a pipeline is async (V2's decode cadence) or synchronous, also from the seed
        engine["async_scheduling"] = (seed // 4) % 2 == 0
    if mixer != "mamba2":
        engine["mixer"] = "gdn" if mixer == "gdn" or (seed // 2) % 2 == 1 else "mamba2"
    return Case(bugs=bugs, seed=seed, steps=rng.choice([400, 800]), engine=engine)


def _sync(engine: dict) -> str:
    return "-sync" if not engine.get("async_scheduling", True) else ""


def check(case: Case, out: Path) -> list[str] | None:
    """Simulate ``case`` into ``out`` and replay it; what disagrees with the ground truth
    (None: the simulator refuses the shape, so nothing was checked)."""
    cfg = SimConfig(
        steps=case.steps, seed=case.seed, bugs=case.bugs, output=out, overwrite=True, **case.engine
    )
    try:
        cfg.validate()
    except MgtraceError:
        return None
    simulate(cfg)
    reader = TraceReader(out)
    recorded = replay_trace(reader, RuleSet())
    if not case.bugs:
        return [f"clean run: {f.detail}" for f in recorded.findings[:3]]
    truth = reader.manifest.ground_truth["bugs"]
    fired = {b: truth[b] for b in case.bugs if truth[b]["first_step"] is not None}
    if not fired:
        return [f"no toggle fired, yet: {f.detail}" for f in recorded.findings[:3]]
    problems = []
    first = min(t["first_step"] for t in fired.values())
    if recorded.first_step != first:
        problems.append(f"first finding at step {recorded.first_step}, injected at {first}")
    elif len(case.bugs) == 1:
        wanted = set(fired[case.bugs[0]]["first_requests"])
        named = involved(recorded.findings, first)
        if named != wanted:
            problems.append(f"step {first} names {sorted(named)}, injected {sorted(wanted)}")
    undo = RuleSet.parse(",".join(TOGGLES[b][1] for b in case.bugs))
    undone = replay_trace(reader, undo)
    problems += [f"under {undo.canonical()}: {f.detail}" for f in undone.findings[:3]]
    if len(case.bugs) == 1 and case.bugs[0] in INTRODUCED_BY:
        problems += _check_introduced(case, twin_of(out), first, fired[case.bugs[0]])
    return problems


def twin_of(out: Path) -> Path:
    """Where ``check`` simulates a toggled run's clean twin."""
    return out.with_name(out.name + "-twin")


def _check_introduced(case: Case, out: Path, first: int, fired: dict) -> list[str]:
    """The clean twin of a one-toggle run, replayed under the rule that brings the toggle's
    mechanism in: the same first step and requests as injected."""
    cfg = SimConfig(steps=case.steps, seed=case.seed, output=out, overwrite=True, **case.engine)
    simulate(cfg.validate())
    rules = RuleSet.parse(INTRODUCED_BY[case.bugs[0]])
    got = replay_trace(TraceReader(out), rules)
    shown = f"the clean twin under {rules.canonical()}"
    if got.first_step != first:
        return [f"{shown}: first finding at step {got.first_step}, injected at {first}"]
    named, wanted = involved(got.findings, first), set(fired["first_requests"])
    if named != wanted:
        return [f"{shown}: step {first} names {sorted(named)}, injected {sorted(wanted)}"]
    return []


def summary(records: list[dict], command: str) -> dict:
    """The sweep in one object: runs, disagreements, simulated steps, shapes drawn."""
    shapes: Counter[str] = Counter()
    for r in records:
        case = r["case"]
        engine = case["engine"]
        shapes[
            "+".join(case["bugs"])
            or f"clean-{engine['runner']}-pp{engine.get('pp', 1)}{_sync(engine)}"
        ] += 1
    return {
        "check": "randomised acceptance against the simulator's ground truth "
        "(tests/acceptance_fuzz.py)",
        "command": command,
        "runs": len(records),
        "disagree": sum(bool(r["problems"]) for r in records),
        "refused_by_simulator": sum(r["problems"] is None for r in records),
        "steps_total": sum(r["case"]["steps"] for r in records if r["problems"] is not None),
        "runs_with_prefill_checkpoints": sum(
            bool(r["case"]["engine"].get("prefill_checkpoints")) for r in records
        ),
        "runs_with_gdn": sum(r["case"]["engine"].get("mixer") == "gdn" for r in records),
        "shapes": dict(shapes.most_common()),
        "disagreements": [r for r in records if r["problems"]],
    }


def _check_run(job: tuple[int, Case, Path, Path | None]) -> dict:
    """One run, in a worker process: its record; a failing run's trace kept if asked."""
    i, case, tmp, keep = job
    out = tmp / f"run-{i}"
    problems = check(case, out)
    if problems and keep is not None:
        shutil.copytree(out, keep / f"run-{i}", dirs_exist_ok=True)
        if twin_of(out).exists():
            shutil.copytree(twin_of(out), keep / f"run-{i}-twin", dirs_exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(twin_of(out), ignore_errors=True)
    return {"run": i, "case": asdict(case), "problems": problems}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="Check runs on this many processes.")
    ap.add_argument("--keep", type=Path, help="Keep the traces of failing runs here.")
    ap.add_argument("--out", type=Path, help="Write the sweep's summary here as JSON.")
    ap.add_argument(
        "--mixer",
        choices=("mamba2", "gdn", "both"),
        default="mamba2",
        help="The simulated model's layers (both: GDN for one seed in two).",
    )
    ap.add_argument(
        "--k", type=int, help="Draft tokens of every run (e.g. 0: engines without MTP)."
    )
    ap.add_argument(
        "--clean", choices=("v1", "v2"), help="Every run without a bug, on this runner."
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # drawn in order: jobs change nothing
    cases = [random_case(rng, args.mixer, args.k, args.clean) for _ in range(args.runs)]
    keep = args.keep / f"seed-{args.seed}" if args.keep is not None else None
    records = []
    with tempfile.TemporaryDirectory(prefix="mgtrace-fuzz-") as tmp:
        jobs = [(i, case, Path(tmp), keep) for i, case in enumerate(cases)]
        with ProcessPoolExecutor(max(args.jobs, 1)) as pool:
            for record in pool.map(_check_run, jobs):
                records.append(record)
                print(json.dumps(record), flush=True)
    failed = sum(bool(r["problems"]) for r in records)
    refused = sum(r["problems"] is None for r in records)
    print(
        f"{failed} of {args.runs} runs disagree with the ground truth "
        f"({refused} shapes refused by the simulator, not checked)",
        file=sys.stderr,
    )
    if args.out is not None:
        command = " ".join(["python -m tests.acceptance_fuzz", *sys.argv[1:]])
        args.out.write_text(json.dumps(summary(records, command), indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
