"""``mgtrace check-kernels``: is replay faithful to the align kernels this machine runs?"""

from __future__ import annotations

import json
import signal
import sys
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mgtrace.console import stderr_console, stdout_console
from mgtrace.errors import EXIT_CLEAN, EXIT_CORRUPTION, EXIT_INTERRUPTED

# a bound like --steps's: far past any run one waits for, and within an int64
MAX_CASES = 10**9

if TYPE_CHECKING:
    from mgtrace.kernels.check import CheckReport


@click.option(
    "--against",
    type=click.Choice(["vllm"]),
    default=None,
    help="Also run vLLM's own kernels (the installed vllm package) on every case.",
)
@click.option(
    "--cases",
    default=200,
    show_default=True,
    type=click.IntRange(min=1, max=MAX_CASES),
    help="Random cases.",
)
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Seed of case 0; case i uses seed+i.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="cpu runs the Triton kernels interpreted; cuda compiles them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def _check_kernels(against: str | None, cases: int, seed: int, device: str, as_json: bool) -> int:
    """Differential check of the align kernels: mgtrace's Triton kernels, the reference
    backend and (with --against vllm) vLLM's kernels on identical random inputs.

    Exit 0 when every backend produced the same bytes, 1 on any mismatch (each with the
    command that reproduces it), 2 on a usage error (no GPU for --device cuda, no vLLM
    for --against vllm), 130 when interrupted (Ctrl-C) before the end with no mismatch
    found so far (143/129 stopped by SIGTERM/SIGHUP).
    """
    err = stderr_console()
    with Progress(
        TextColumn("checking align kernels"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    ) as progress:
        task = progress.add_task("cases", total=cases)
        from mgtrace.kernels.check import run_check  # torch and triton: only when run

        report = run_check(
            cases,
            seed,
            against == "vllm",
            device,
            progress=lambda done: progress.update(task, completed=done),
        )
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
    else:
        _print_report(report, stdout_console())
    if report.mismatches:
        return EXIT_CORRUPTION
    if report.interrupted:  # as any command: 130 for Ctrl-C, 128 + n for SIGTERM or SIGHUP
        return 128 + signal.Signals[report.stopped_by] if report.stopped_by else EXIT_INTERRUPTED
    return EXIT_CLEAN


def _print_report(report: CheckReport, out: Console) -> None:
    peers = (
        ", ".join(f"{name} in {n} case(s)" for name, n in sorted(report.compared.items()))
        or "nothing"
    )
    vllm = f" (vLLM {report.vllm_version})" if report.vllm_version else ""
    out.print(
        f"{report.done}/{report.cases} cases from seed {report.seed} on {report.device}{vllm} "
        f"in {report.elapsed_s:.1f} s; {report.malformed_rows} malformed row(s) kept out of "
        "every kernel",
        highlight=False,
    )
    out.print(f"compared with the reference: {peers}", highlight=False)
    for reason, n in sorted(report.skipped.items()):
        out.print(f"  not compared with vLLM in {n} case(s): {reason}")
    if report.interrupted:
        how = f"stopped by {report.stopped_by}" if report.stopped_by else "interrupted"
        out.print(f"[yellow]{how} before the last case[/]")
    for m in report.mismatches:
        out.print(
            f"[red]MISMATCH[/] case {m.case} ({m.launch}): {m.backends}, {m.what}: {m.detail}\n"
            f"  reproduce: {m.reproduce}"
        )
    if not report.mismatches:
        out.print("[green]no mismatch[/]")
    sys.stdout.flush()


check_kernels = click.command("check-kernels")(_check_kernels)
