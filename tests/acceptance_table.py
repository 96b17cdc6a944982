"""The acceptance table: per toggle, scenario and seed, the step and requests the simulator
injected against what the replay as recorded finds first, and whether the undoing rule replays
clean; per runner shape, toggle-off runs and their findings (there should be none).

    python -m tests.acceptance_table [--steps 2000] [--seeds 5] [--clean-steps 5000]
        [--prefill-checkpoints] [--mixer mamba2|gdn]
        [--out benchmarks/results/acceptance-table.json]

Prints a Markdown table; with ``--out`` also writes every row as JSON with the command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from mgtrace.replayer.loop import replay_trace
from mgtrace.replayer.rules import RuleSet
from mgtrace.schemas.reader import TraceReader
from mgtrace.sim.config import SimConfig
from mgtrace.sim.engine import simulate
from tests.replay_helpers import TOGGLES, involved

SCENARIOS = ("pairs", "mixed")
CLEAN_SHAPES = (
    {"runner": "v1"},
    {"runner": "v2"},
    {"runner": "v2", "pp": 2},
    {"runner": "v2", "pp": 2, "async_scheduling": False},
)


def _shape(engine: dict) -> str:
    pp = f" + PP{engine['pp']}" if engine.get("pp", 1) > 1 else ""
    mixer = f" ({engine['mixer']})" if engine.get("mixer", "mamba2") != "mamba2" else ""
    sync = " sync" if pp and not engine.get("async_scheduling", True) else ""
    return engine["runner"] + pp + sync + mixer


def toggle_row(
    bug: str,
    scenario: str,
    seed: int,
    steps: int,
    out: Path,
    checkpoints: bool = False,
    mixer: str = "mamba2",
) -> dict:
    engine = {k: v for k, v in TOGGLES[bug][0].items() if k != "scenario"}
    engine["prefill_checkpoints"] = checkpoints
    engine["mixer"] = mixer
    cfg = SimConfig(
        steps=steps, seed=seed, bugs=(bug,), scenario=scenario, output=out, overwrite=True, **engine
    )
    simulate(cfg)
    reader = TraceReader(out)
    truth = reader.manifest.ground_truth["bugs"][bug]
    recorded = replay_trace(reader, RuleSet())
    undo = RuleSet.parse(TOGGLES[bug][1])
    undone = replay_trace(reader, undo)
    injected = truth["first_step"]
    wanted = set(truth["first_requests"] or ())
    named = (
        involved(recorded.findings, recorded.first_step)
        if recorded.first_step is not None
        else set()
    )
    agree = (
        recorded.first_step == injected and wanted == named and undone.clean
        if injected is not None
        else recorded.clean
    )
    return {
        "toggle": bug,
        "runner": _shape(engine),
        "scenario": scenario,
        "seed": seed,
        "steps": steps,
        "injected_step": injected,
        "injected_requests": sorted(wanted),
        "found_step": recorded.first_step,
        "found_requests": sorted(named),
        # the first step's findings name exactly the requests injected, no more, no fewer
        "found_names_injected": wanted == named if injected is not None else None,
        "first_kinds": sorted({f.kind for f in recorded.findings if f.step == recorded.first_step}),
        "undo_rule": undo.canonical(),
        "undone_clean": undone.clean,
        "agrees": agree,
    }


def clean_row(
    engine: dict,
    scenario: str,
    seed: int,
    steps: int,
    out: Path,
    checkpoints: bool = False,
    mixer: str = "mamba2",
) -> dict:
    engine = {**engine, "mixer": mixer}
    cfg = SimConfig(
        steps=steps,
        seed=seed,
        scenario=scenario,
        output=out,
        overwrite=True,
        prefill_checkpoints=checkpoints,
        **engine,
    )
    simulate(cfg)
    result = replay_trace(TraceReader(out), RuleSet())
    return {
        "toggle": None,
        "runner": _shape(engine),
        "scenario": scenario,
        "seed": seed,
        "steps": steps,
        "replayed_steps": result.steps,
        "findings": len(result.findings),
        "agrees": result.clean,
    }


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else "yes" if flag else "no"


def _markdown(rows: list[dict]) -> str:
    lines = [
        "| toggle | runner | scenario | seed | injected step | found step | names injected "
        "| first kinds | undone by | clean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["toggle"] is None:
            continue
        lines.append(
            f"| {r['toggle']} | {r['runner']} | {r['scenario']} | {r['seed']} | "
            f"{r['injected_step']} | {r['found_step']} | {_yes(r['found_names_injected'])} "
            f"| {', '.join(r['first_kinds'])} | {r['undo_rule']} | {_yes(r['undone_clean'])} |"
        )
    lines += [
        "",
        "| toggle-off runner | scenario | seed | steps replayed | findings |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["toggle"] is None:
            lines.append(
                f"| {r['runner']} | {r['scenario']} | {r['seed']} | {r['replayed_steps']} | "
                f"{r['findings']} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--clean-steps", type=int, default=5000)
    ap.add_argument(
        "--prefill-checkpoints", action="store_true", help="Simulate vLLM 0.33's checkpoints."
    )
    ap.add_argument(
        "--mixer", choices=("mamba2", "gdn"), default="mamba2", help="The simulated model's layers."
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ck = args.prefill_checkpoints
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mgtrace-acceptance-") as tmp:
        out = Path(tmp) / "trace"
        for bug in TOGGLES:
            for scenario in SCENARIOS:
                for seed in range(args.seeds):
                    rows.append(toggle_row(bug, scenario, seed, args.steps, out, ck, args.mixer))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        for engine in CLEAN_SHAPES:
            for i, scenario in enumerate(SCENARIOS):
                rows.append(
                    clean_row(engine, scenario, 100 + i, args.clean_steps, out, ck, args.mixer)
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        shutil.rmtree(out, ignore_errors=True)
    print(_markdown(rows))
    disagree = sum(not r["agrees"] for r in rows)
    print(f"\n{disagree} of {len(rows)} runs disagree with the ground truth")
    if args.out is not None:
        report = {
            "command": " ".join(["python -m tests.acceptance_table", *sys.argv[1:]]),
            "wall_s": round(time.time() - t0, 1),
            "disagreements": disagree,
            "rows": rows,
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
