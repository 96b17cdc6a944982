"""`mgtrace demo`: the whole pipeline on a laptop, with no GPU and no model.

Simulates the field reproducer's workload (long prompts followed closely by short ones, MTP
with k=3) on an engine whose drafter attention lowers the batch-reorder threshold, replays
the trace on tagged shadow state, bisects it, and prints the verdict.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import click

from mgtrace.console import stdout_console
from mgtrace.errors import EXIT_CORRUPTION
from mgtrace.params import PATH
from mgtrace.render import render_replay, render_verdict
from mgtrace.shell import shell_path
from mgtrace.sim.config import MAX_STEPS


@click.command("demo")
@click.option(
    "-o",
    "--output",
    type=PATH,
    help="Keep the demo trace here (default: a temporary directory, removed).",
)
@click.option(
    "--steps", type=click.IntRange(min=100, max=MAX_STEPS), default=3000, show_default=True
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output trace.")
def demo(output: Path | None, steps: int, seed: int, force: bool) -> int:
    """Simulate a buggy engine, replay its trace, bisect it and print the verdict.

    Exit codes: 0 when bisect finds the injected first step, 1 when it does not, 2 usage
    error."""
    from mgtrace.outputs import refuse_a_trace_inside_a_trace, require_output_folder
    from mgtrace.replayer.bisect import bisect, save_log
    from mgtrace.replayer.cli import replay_id_for
    from mgtrace.replayer.findings import save_findings
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.rules import AS_RECORDED, RuleSet
    from mgtrace.schemas.reader import TraceReader
    from mgtrace.schemas.writer import refuse_unless_replaceable
    from mgtrace.sim.config import BUG_REORDER, SimConfig
    from mgtrace.sim.engine import simulate

    out = stdout_console()
    scratch = None
    if output is None:
        scratch = Path(tempfile.mkdtemp(prefix="mgtrace-demo-"))
        output = scratch / "trace"
    try:
        t0 = time.perf_counter()
        cfg = SimConfig(
            scenario="pairs",
            steps=steps,
            runner="v1",
            k=3,
            seed=seed,
            bugs=(BUG_REORDER,),
            output=output,
            overwrite=force,
        ).validate()
        if scratch is None:  # as `mgtrace simulate -o`: no folder made
            require_output_folder(output, str(output))
            refuse_a_trace_inside_a_trace(output)
        refuse_unless_replaceable(output, force)  # before the first line of the demo
        out.rule("1. simulate")
        out.print(
            f"engine: V1 runner, MTP k=3, --mamba-cache-mode align, async scheduling; the "
            f"drafter's attention reports reorder threshold 1 ({BUG_REORDER})"
        )
        manifest = simulate(cfg)
        truth = (manifest.ground_truth or {}).get("bugs", {}).get(BUG_REORDER, {})
        out.print(
            f"wrote {output}: {steps} steps, {manifest.source.get('num_requests')} requests; "
            f"the simulator injected the bug first at step {truth.get('first_step')}",
            markup=False,  # the path is printed as it is, brackets included
        )
        out.rule("2. replay (as recorded)")
        reader = TraceReader(output)
        result = replay_trace(reader, RuleSet())
        # under the id `mgtrace replay` gives a whole replay as recorded, which the canned
        # queries read
        replay_id = replay_id_for(RuleSet())
        save_findings(output, result.findings, replay_id=replay_id, rules=AS_RECORDED)
        # a temporary trace is gone when the demo ends: no commands that query it later
        kept = scratch is None
        render_replay(result, out, trace=output, replay_id=replay_id if kept else None)
        out.rule("3. bisect")
        verdict = bisect(output)
        save_log(verdict, output / "bisect.json")
        render_verdict(verdict, out, log=output / "bisect.json" if kept else None)
        out.rule("done")
        found_ok = verdict.first_step == truth.get("first_step")
        out.print(
            f"bisect {'matches' if found_ok else 'does NOT match'} the injected first step; "
            f"total {time.perf_counter() - t0:.1f} s"
        )
        if kept:
            out.print(f"next: mgtrace sql {shell_path(output)} --list", markup=False)
        else:
            out.print(
                "the trace was temporary and is now removed; `mgtrace demo -o DIR` keeps it, "
                "so that the commands above can be run on it"
            )
        return 0 if found_ok else EXIT_CORRUPTION
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
