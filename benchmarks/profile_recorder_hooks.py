"""Where the recorder's engine-thread time goes, hook by hook, on the stand-in V1 step of
``bench_recorder.py`` (96 rows, CPU).

In one process, blocks of steps rotate between: no hooks, every hook, and every hook but
one. A hook's share is what the step saves without it (percentiles over the rounds, so
that a busy moment of the machine does not land on one configuration only). The recorder
thread here discards what it would send, so only the engine thread's own work counts:
its GIL time and the assembler's CPU are what ``bench_recorder.py`` adds on top.

Usage: python benchmarks/profile_recorder_hooks.py [--rounds 60] [--steps 100]
                                                   [--builder mamba2|gdn] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_recorder import ROWS, K, build_runner, scheduler_output
from results_io import command_line, emit

from mgtrace.recorder import hooks_v1
from mgtrace.recorder.patches import PatchSet
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata

# Hooks every other hook relies on (step open/close, the launch the others stage for):
# without them the rest records nothing, so their share is not measured alone.
_ALWAYS = ("execute_model", "sample_tokens", "add_request", "remove_request")


def _discard(self: Session) -> bool:
    """The recorder thread's drain, reduced to freeing what the hooks queued."""
    if self.ring is not None:
        self.ring.reap_raw()
    self._records.clear()
    return False


def _time_steps(runner: Any, so: Any, out: torch.Tensor, steps: int) -> float:
    """Engine-thread CPU µs per step of ``steps`` steps, after ten unmeasured ones."""
    cls = type(runner)
    for _ in range(10):
        cls.execute_model(runner, so)
        cls.sample_tokens(runner, out)
    start = time.thread_time_ns()
    for _ in range(steps):
        cls.execute_model(runner, so)
        cls.sample_tokens(runner, out)
    return (time.thread_time_ns() - start) / steps / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    ap.add_argument("--builder", choices=("mamba2", "gdn"), default="mamba2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    Session._drain = _discard  # type: ignore[method-assign]
    runner, owners = build_runner(torch.device("cpu"), args.builder)
    so = scheduler_output()
    out = torch.zeros((ROWS, 1 + K), dtype=torch.int64)
    with tempfile.TemporaryDirectory() as tmp:
        sess = Session(Path(tmp) / "t", rank=0, kind="v1", run=RunMetadata(), assembler="thread")
        patches = hooks_v1.v1_patches(sess, owners, [0])
        configs: dict[str, list[Any]] = {"none": [], "all": patches}
        for p in patches:
            if p.name not in _ALWAYS:
                configs[f"-{p.name}"] = [q for q in patches if q is not p]
        costs: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                patch_set = PatchSet()
                if configs[name]:
                    patch_set.install(configs[name])
                try:
                    costs[name].append(_time_steps(runner, so, out, args.steps))
                finally:
                    if configs[name]:
                        patch_set.remove()
        status = sess.status()
        sess.close(10.0)

    def at(q: float) -> dict[str, float]:
        return {name: float(np.percentile(v, q)) for name, v in costs.items()}

    summary = {}
    for q in (10, 25, 50):
        v = at(q)
        summary[f"p{q}"] = {
            "unhooked_us": round(v["none"], 1),
            "added_by_all_hooks_us": round(v["all"] - v["none"], 1),
            "share_of_each_hook_us": {name[1:]: round(v["all"] - v[name], 1) for name in names[2:]},
        }
    emit(
        {
            "benchmark": "recorder engine-thread cost per hook (stand-in V1 step, CPU)",
            "command": command_line(),
            "rows": ROWS,
            "builder": args.builder,
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "not_measured_alone": list(_ALWAYS),
            "hook_errors": status.get("hook_errors"),
            "drops": status.get("drops"),
            **summary,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
