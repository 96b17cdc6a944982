"""``mgtrace simulate``: write a trace of a simulated engine run, optionally with injected bugs."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mgtrace.console import stderr_console
from mgtrace.errors import UsageError
from mgtrace.outputs import refuse_a_trace_inside_a_trace, require_output_folder
from mgtrace.params import PATH
from mgtrace.render import counted
from mgtrace.shell import shell_path
from mgtrace.sim.config import BUGS, SimConfig
from mgtrace.sim.engine import simulate as run_simulation


@click.option(
    "--scenario", default="pairs", show_default=True, help="Workload: pairs | mixed | steady."
)
@click.option(
    "--steps", default=2000, show_default=True, type=int, help="Engine steps to simulate."
)
@click.option(
    "--runner",
    default="v1",
    show_default=True,
    help="Model runner: v1 | v2 (vLLM 0.34 has only V2; 0.33 has both).",
)
@click.option(
    "--mixer",
    default="mamba2",
    show_default=True,
    help="Linear-attention layers: mamba2 (split by position, prefills run first) | gdn "
    "(spec-decode rows by mask, run first).",
)
@click.option(
    "--k",
    "k",
    default=3,
    show_default=True,
    type=int,
    help="Draft tokens per decode step (num_speculative_tokens).",
)
@click.option("--pp", default=1, show_default=True, type=int, help="Pipeline-parallel size.")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
@click.option(
    "--bug",
    "bugs",
    multiple=True,
    metavar="NAME",
    help=f"Inject a bug (repeatable): {', '.join(BUGS)}.",
)
@click.option("--max-num-seqs", default=96, show_default=True, type=int)
@click.option("--max-num-batched-tokens", default=8192, show_default=True, type=int)
@click.option(
    "--block-size", default=256, show_default=True, type=int, help="Mamba block size in tokens."
)
@click.option(
    "--num-blocks",
    default=None,
    type=int,
    help="State pool size, null block included (default: sized to fit).",
)
@click.option(
    "--sync",
    is_flag=True,
    help="Synchronous scheduling (default: async; a V2 pipeline then decodes each request "
    "every pp steps on optimistic counts).",
)
@click.option(
    "--prefill-checkpoints",
    is_flag=True,
    help="Model vLLM 0.33's Mamba prefill checkpoints (the prefill stores the state at the "
    "prompt's last block boundary itself) instead of ending chunks on cached boundaries.",
)
@click.option(
    "-o",
    "--output",
    type=PATH,
    default=None,
    help="Trace directory to write (required).",
)
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing trace.")
def _simulate(
    scenario: str,
    steps: int,
    runner: str,
    mixer: str,
    k: int,
    pp: int,
    seed: int,
    bugs: tuple[str, ...],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    num_blocks: int | None,
    sync: bool,
    prefill_checkpoints: bool,
    output: Path | None,
    force: bool,
) -> None:
    """Simulate an engine run (scheduler + runner bookkeeping) and write it as a trace.

    Bug toggles (off by default; repeat --bug): reorder-threshold-mismatch,
    batch-row-block-table (needs --runner v2 --pp 2+ --k 1+), async-accepted-race,
    stale-condense-row. The manifest's ground_truth says which step each one first corrupts.

    Exit codes: 0 written, 2 usage error (bad option, output exists or cannot be written),
    130 interrupted (the steps written so far are kept, in a trace marked incomplete; with
    --force over an old trace, the old trace is kept instead).
    """
    if output is None:
        raise UsageError("missing the output trace path; pass -o TRACE")
    require_output_folder(output, str(output))
    refuse_a_trace_inside_a_trace(output)
    cfg = SimConfig(
        scenario=scenario,
        steps=steps,
        runner=runner,
        mixer=mixer,
        k=k,
        pp=pp,
        seed=seed,
        bugs=tuple(bugs),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        mamba_block_size=block_size,
        num_blocks=num_blocks,
        async_scheduling=not sync,
        prefill_checkpoints=prefill_checkpoints,
        output=output,
        overwrite=force,
    ).validate()
    err = stderr_console()
    columns = (TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("steps", total=cfg.steps)
        manifest = run_simulation(
            cfg, progress=lambda n: bar.advance(task, n), argv=["mgtrace", *sys.argv[1:]]
        )
    truth = manifest.ground_truth or {}
    err.print(
        f"wrote {output} ({counted(cfg.steps, 'step')}, "
        f"{counted(manifest.source.get('num_requests') or 0, 'request')})",
        markup=False,  # the path is printed as it is, brackets included
        highlight=False,
    )
    for name, entry in truth.get("bugs", {}).items():
        first = entry["first_step"]
        where = f"first corrupts step {first}" if first is not None else "corrupted nothing"
        n = len(entry["affected_requests"])
        err.print(f"  {name}: {where}, {n} request{'s' if n != 1 else ''} affected")
    err.print(f"next: mgtrace info {shell_path(output)}", markup=False, highlight=False)


simulate = click.command("simulate")(_simulate)
