"""The mgtrace command line: one thin function per verb; the work happens in the packages.

``main`` is the only place where errors become messages: an MgtraceError prints one
sentence and returns its exit code; no traceback reaches the user for bad input.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from mgtrace import __version__
from mgtrace.console import stderr_console, stdout_console
from mgtrace.errors import (
    EXIT_UNREADABLE,
    EXIT_USAGE,
    MgtraceError,
    TraceError,
    TraceReplacedError,
)
from mgtrace.opened_traces import noting_opened_traces, refuse_if_replaced, replaced_among
from mgtrace.params import PATH
from mgtrace.termination import is_query_interrupt, stop_signals_interrupt, terminated_by

if TYPE_CHECKING:
    from mgtrace.schemas.reader import TraceReader

EXIT_INTERNAL = 70  # sysexits EX_SOFTWARE: a bug in mgtrace, not in the input

TRACE = PATH
# More rows than any terminal shows, and few enough that a SQL LIMIT (an int64) takes one more.
MAX_ROWS_SHOWN = 2**62
SKIP_BAD_PARTS = click.option(
    "--skip-bad-parts", is_flag=True, help="Read the valid parts and say which were skipped."
)


def tabular_output(max_rows: int, noun: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--format, -o, --max-rows and --force, for a command that prints a table or writes it."""
    options = [
        click.option(
            "--format",
            "fmt",
            type=click.Choice(["table", "csv", "json", "parquet"]),
            default="table",
            show_default=True,
        ),
        click.option(
            "-o",
            "--output",
            type=PATH,
            help=f"Write the {noun.lower()} here (format from .csv, .json, .parquet).",
        ),
        click.option(
            "--max-rows",
            type=click.IntRange(min=1, max=MAX_ROWS_SHOWN),
            default=max_rows,
            show_default=True,
            help=f"{noun} shown by --format table.",
        ),
        click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file."),
    ]

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


OUTPUT_FORMATS = {".csv": "csv", ".json": "json", ".parquet": "parquet"}


def _output_format(fmt: str, output: Path | None, force: bool, trace: Path) -> str:
    """The format to write: as given, or, for -o without --format, the file's suffix. A file
    is written only where asked, or over an old one with --force, never over the trace."""
    from mgtrace.errors import UsageError
    from mgtrace.outputs import refuse_overwriting_inputs
    from mgtrace.query.export import check_output_path

    if output is None:
        return fmt
    refuse_overwriting_inputs(output, trace)
    if fmt == "table":
        fmt = OUTPUT_FORMATS.get(output.suffix.lower(), "table")
        if fmt == "table":
            raise UsageError(
                f"cannot tell a format from {output.name!r}; name a .csv, .json or .parquet "
                "file, or pass --format"
            )
    check_output_path(output, force=force)
    return fmt


def check_step_window(from_step: int | None, to_step: int | None) -> None:
    """--from-step and --to-step, when both are given, in order."""
    from mgtrace.errors import UsageError

    if from_step is not None and to_step is not None and from_step > to_step:
        raise UsageError(f"--from-step {from_step} comes after --to-step {to_step}")


def _stdout() -> Console:
    return stdout_console()


def _stderr() -> Console:
    return stderr_console()


def _open(trace: Path, skip_bad_parts: bool):
    from mgtrace.schemas.reader import TraceReader

    reader = TraceReader(trace, skip_bad_parts=skip_bad_parts)
    for s in reader.skipped:
        _stderr().print(f"mgtrace: skipped part {s.path}: {s.reason}", style="yellow")
    return reader


# Verbs that live in their own packages: imported only when used, so that `mgtrace info`
# does not pay for torch and triton.
PLUGIN_COMMANDS = {
    "simulate": "mgtrace.sim.cli:simulate",
    "check-kernels": "mgtrace.kernels.cli:check_kernels",
    "replay": "mgtrace.replayer.cli:replay",
    "bisect": "mgtrace.replayer.cli:bisect_cmd",
    "diff": "mgtrace.replayer.cli:diff_cmd",
    "minimize": "mgtrace.replayer.cli:minimize_cmd",
    "record": "mgtrace.recorder.cli:record",
    "import-probe": "mgtrace.recorder.cli:import_probe",
    "demo": "mgtrace.demo:demo",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *PLUGIN_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = PLUGIN_COMMANDS.get(name)
        if target is None:
            return super().get_command(ctx, name)
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mgtrace")
def cli() -> None:
    """Record vLLM hybrid-model align bookkeeping, replay it offline, find the first corrupt step.

    Exit codes: 0 clean, 1 corruption found, 2 usage error, 3 unreadable trace,
    125 inconclusive, 70 internal error (a bug in mgtrace), 130 interrupted (Ctrl-C),
    143/129 stopped by SIGTERM/SIGHUP.
    """


@cli.command()
@click.argument("trace", type=TRACE)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@SKIP_BAD_PARTS
def info(trace: Path, as_json: bool, skip_bad_parts: bool) -> None:
    """Run metadata, steps, requests, ranks, size, completeness and drops of TRACE.

    Exit codes: 0 shown, 2 usage error, 3 unreadable trace."""
    from mgtrace.query.info import trace_info
    from mgtrace.render import render_info

    reader = _open(trace, skip_bad_parts)
    data = trace_info(reader)
    # DuckDB and pyarrow read the parts by path: what was read while another process
    # replaced the trace may mix two traces, and none of it is shown (so in every reader)
    refuse_if_replaced([reader], "mgtrace info")
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
    else:
        render_info(data, _stdout())


@cli.command()
@click.argument("trace", type=TRACE)
@click.argument("query", required=False)
@click.option("--list", "list_views", is_flag=True, help="List the views and their columns.")
@tabular_output(max_rows=50, noun="Rows")
@SKIP_BAD_PARTS
def sql(
    trace: Path,
    query: str | None,
    list_views: bool,
    fmt: str,
    output: Path | None,
    max_rows: int,
    force: bool,
    skip_bad_parts: bool,
) -> None:
    """Run one read-only DuckDB QUERY over the views of TRACE (steps, batch_rows,
    launches, ...); statements that write (COPY, CREATE, ATTACH, ...) are refused.

    QUERY may name a canned triage query as @NAME; --list lists them with the views.

    Exit codes: 0 shown, 2 usage error (bad query or option), 3 unreadable trace."""
    from mgtrace.errors import UsageError
    from mgtrace.query.canned import NAMED, named, unsaved_replay_note
    from mgtrace.query.export import export_table
    from mgtrace.query.history import replay_saved
    from mgtrace.query.views import fetch_arrow, run_query
    from mgtrace.query.views import list_views as views_of
    from mgtrace.render import render_arrow, render_canned, render_views
    from mgtrace.replayer.rules import AS_RECORDED
    from mgtrace.shell import path_arg

    if not list_views and not query:
        raise UsageError('give a QUERY, e.g. "SELECT * FROM steps LIMIT 5", or --list')
    if list_views and (query or output is not None or fmt != "table"):
        raise UsageError(
            "--list prints the views to the terminal; it takes no QUERY, -o or --format"
        )
    fmt = _output_format(fmt, output, force, trace)
    reader = _open(trace, skip_bad_parts)
    con = reader.connect()
    if list_views:
        render_views(views_of(con), _stdout())
        render_canned([(f"@{name}", doc) for name, (_, doc) in NAMED.items()], _stdout())
        return
    rel = run_query(con, named(query, reader.manifest.run.num_speculative_tokens))
    note = unsaved_replay_note(query, replay_saved(reader, AS_RECORDED), path_arg(trace))
    if note is not None:  # stderr: a CSV or JSON on stdout stays as it is
        click.echo(f"note: {note}", err=True)
    if fmt == "table":
        shown = fetch_arrow(rel, max_rows + 1)
        more = shown.num_rows > max_rows
        # the total only where rows are left out: counting runs the query a second time
        # an error met only past the rows shown (a failed cast, error()) is a usage error
        # too; count(COLUMNS(*)) computes every column there, which count(*) alone skips
        counted = "count(*), count(COLUMNS(*))"
        total = fetch_arrow(rel.aggregate(counted)).column(0)[0].as_py() if more else None
        refuse_if_replaced([reader], "the query")
        render_arrow(shown.slice(0, max_rows), _stdout(), more=more, total=total)
        return
    rows = fetch_arrow(rel)
    refuse_if_replaced([reader], "the query")
    export_table(rows, fmt, output)
    if output is not None:
        _stderr().print(f"wrote {output}", markup=False, highlight=False)


@cli.command()
@click.argument("trace", type=TRACE)
@click.argument("request")
@click.option("--from-step", type=click.IntRange(min=0), help="First step shown.")
@click.option("--to-step", type=click.IntRange(min=0), help="Last step shown.")
@click.option(
    "--rules",
    default="as-recorded",
    show_default=True,
    help="Findings of the saved replays under these rules (as `replay` names them), or 'any'.",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    help="Only this rank's lines (every rank of an engine runs the same batch).",
)
@tabular_output(max_rows=200, noun="Lines")
@SKIP_BAD_PARTS
def history(
    trace: Path,
    request: str,
    from_step: int | None,
    to_step: int | None,
    rules: str,
    rank: int | None,
    fmt: str,
    output: Path | None,
    max_rows: int,
    force: bool,
    skip_bad_parts: bool,
) -> None:
    """One REQUEST's life in TRACE, a line per step: scheduler events and new blocks, batch
    row and slot, the counts its kernels consumed (the CPU-held accepted count where it
    differs), its running column, where align mode frees its previous state block, the Mamba
    split, the row moves that carried it, and what saved replays found about it. REQUEST may
    be any unique part of the id.

    Exit codes: 0 shown, 2 usage error (no such request, or more than one), 3 unreadable
    trace."""
    from rich.text import Text

    from mgtrace.query.export import export_table
    from mgtrace.query.history import (
        check_rank,
        findings_note,
        first_finding,
        gaps_note,
        reach_note,
        request_history,
        request_span,
        request_summary,
        resolve_request,
    )
    from mgtrace.render import render_history
    from mgtrace.replayer.checkpoint import start_state
    from mgtrace.replayer.rules import RuleSet

    check_step_window(from_step, to_step)
    fmt = _output_format(fmt, output, force, trace)
    reader = _open(trace, skip_bad_parts)
    if rank is not None:
        check_rank(reader, rank, trace)
    con = reader.connect()
    req_id = resolve_request(con, request, start_state(reader))
    # named as replay names them (a typo is an error, not a silently empty column)
    wanted = None if rules == "any" else RuleSet.parse(rules).canonical()
    lines = request_history(
        con,
        req_id,
        from_step=from_step,
        to_step=to_step,
        rules=wanted,
        run=reader.manifest.run,
        rank=rank,
        start=start_state(reader),
    )
    if fmt != "table":
        refuse_if_replaced([reader], "mgtrace history")
        export_table(lines, fmt, output)
        if output is not None:
            _stderr().print(f"wrote {output}", markup=False, highlight=False)
        return
    # every line is made before any is printed, so that none is shown of a trace that
    # another process replaced while they were read
    if not lines.num_rows:
        lo, hi = request_span(con, req_id)
        refuse_if_replaced([reader], "mgtrace history")
        span = f"{req_id} is in steps {lo}..{hi} only; none of them is in the range asked"
        _stdout().print(Text(span))
        return
    about = request_summary(con, req_id)
    after: list[Text] = []  # what is printed below the lines
    gaps = gaps_note(con, lines)
    if gaps is not None:
        after.append(Text(gaps, style="yellow"))
    if rank is None:
        from mgtrace.query.rank_steps import step_offsets_caveat

        caveat = step_offsets_caveat(reader)
        if caveat is not None:
            after.append(Text(f"{caveat} (--rank N shows one rank's lines)", style="yellow"))
    first = first_finding(con, req_id, rules=wanted, rank=rank)
    if first is not None:
        step, found_on, sentence = first
        after.append(Text(f"first finding at step {step} (rank {found_on}): {sentence}"))
    elif rank is not None:
        elsewhere = first_finding(con, req_id, rules=wanted)
        if elsewhere is not None:
            step, found_on, _ = elsewhere
            after.append(
                Text(
                    f"no finding on rank {rank}; the first is on rank {found_on}, at step {step}",
                    style="dim",
                )
            )
    note = findings_note(reader, con, req_id, wanted, trace, rank=rank)
    if note is not None:
        after.append(Text(note, style="dim"))
    reach = reach_note(reader, con, req_id, wanted, rank=rank)
    if reach is not None:
        after.append(Text(reach, style="yellow"))
    refuse_if_replaced([reader], "mgtrace history")
    out = _stdout()
    out.print(Text(f"history of {req_id} in {trace}"))
    if about:
        out.print(Text(about))
    render_history(lines, out, max_rows=max_rows)
    for text in after:
        out.print(text)


@cli.command()
@click.argument("trace", type=TRACE)
@click.option("-o", "--output", type=PATH, required=True, help="The HTML file to write.")
@click.option("--no-bisect", is_flag=True, help="Leave the bisect verdict out (faster).")
@click.option("-f", "--force", is_flag=True, help="Overwrite an existing output file.")
@SKIP_BAD_PARTS
def report(trace: Path, output: Path, no_bisect: bool, force: bool, skip_bad_parts: bool) -> None:
    """Write one self-contained HTML report of TRACE: run, timeline, findings, verdict.

    Exit codes: 0 written, 2 usage error (output exists or cannot be written), 3 unreadable
    trace."""
    from mgtrace.api import Trace
    from mgtrace.outputs import refuse_overwriting_inputs
    from mgtrace.query.export import check_output_path
    from mgtrace.report import write_report

    refuse_overwriting_inputs(output, trace)
    check_output_path(output, force=force)
    # opened here rather than by Trace(), which words its errors for Python callers
    opened = Trace._over(_open(trace, skip_bad_parts), skip_bad_parts=skip_bad_parts)
    try:
        write_report(opened, output, bisect=not no_bisect)
    except TraceReplacedError:  # its advice (reload()) is for Python callers
        from mgtrace.schemas.reader import replaced_error

        said = replaced_error(opened.reader, "mgtrace report")
        raise said or TraceReplacedError(f"the trace at {trace} was replaced") from None
    _stderr().print(f"wrote {output}", markup=False, highlight=False)


def _interrupted(exc: BaseException) -> int:
    """Ctrl-C (130), or SIGTERM / SIGHUP (128 + the signal's number), said in one line."""
    by = terminated_by(exc)
    # a hangup may have taken the terminal, and stderr with it: the exit code still says it
    with contextlib.suppress(OSError):
        click.echo(
            "mgtrace: interrupted" if by is None else f"mgtrace: stopped by {by.name}", err=True
        )
    return 130 if by is None else by.exit_code


def _usage_sentence(exc: click.UsageError, command_path: str) -> str:
    """click's message for a bad command line ("Invalid value for '--rank': -1 is not in the
    range x>=0."), as one line in mgtrace's manner, with where the options are listed: the
    command's, or ``command_path`` where click gave no context (an option's missing value)."""
    said = " ".join(exc.format_message().split()).removesuffix(".")
    if said[:1].isupper() and said[1:2].islower():
        said = said[0].lower() + said[1:]
    said += f" (see {exc.ctx.command_path if exc.ctx is not None else command_path} --help)"
    return said


def _command_path(argv: list[str] | None, prog_name: str, alone: bool) -> str:
    """The command a command line runs, as its --help is asked for: the command line's
    verb, or ``prog_name`` for a command run on its own (``python -m mgtrace.sim``)."""
    args = sys.argv[1:] if argv is None else argv
    verb = next((a for a in args if a in cli.commands or a in PLUGIN_COMMANDS), None)
    return prog_name if alone or verb is None else f"{prog_name} {verb}"


def _replaced_during(
    opened: list[TraceReader], argv: list[str] | None, prog_name: str, alone: bool
) -> TraceError | None:
    """Where a command failed reading a trace that another process replaced or removed
    meanwhile, that is the sentence to give. Only the traces its command line names count:
    an output or a temporary trace of its own it may have moved or removed itself."""
    args = sys.argv[1:] if argv is None else argv
    named = {os.path.abspath(a) for arg in args for a in (arg, arg.split("=", 1)[-1]) if a}
    given = [r for r in opened if os.path.abspath(r.path) in named]
    with contextlib.suppress(Exception):  # the failure it was asked about stays the answer
        return replaced_among(given, _command_path(argv, prog_name, alone))
    return None


def main(
    argv: list[str] | None = None,
    *,
    command: click.Command | None = None,
    prog_name: str = "mgtrace",
) -> int:
    """Console entry point: run the CLI (or one of its commands on its own), turn every
    MgtraceError into one sentence."""
    opened: list[TraceReader] = []
    try:
        from mgtrace.pandas_probe import skip_pandas_probe

        skip_pandas_probe()  # inside: a Ctrl-C this early is an interruption like any other
        with stop_signals_interrupt(), noting_opened_traces(opened):
            rv = (command or cli).main(args=argv, prog_name=prog_name, standalone_mode=False)
    except MgtraceError as exc:
        if exc.exit_code == EXIT_UNREADABLE and not isinstance(exc, TraceReplacedError):
            # a part gone or changed: the trace was replaced meanwhile
            exc = _replaced_during(opened, argv, prog_name, command is not None) or exc
        click.echo(f"mgtrace: error: {exc.message}", err=True)
        return exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        return _interrupted(exc)
    except click.exceptions.NoArgsIsHelpError as exc:  # the help, as asked
        exc.show()
        return exc.exit_code
    except click.UsageError as exc:  # a bad command line, said as every other error
        path = _command_path(argv, prog_name, command is not None)
        click.echo(f"mgtrace: error: {_usage_sentence(exc, path)}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except BrokenPipeError:
        # The reader of our stdout went away (e.g. `| head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:  # the file system said no (read-only, full, permissions)
        if terminated_by(exc) is not None:  # or a hangup took stderr while stopping
            return _interrupted(exc)
        if (replaced := _replaced_during(opened, argv, prog_name, command is not None)) is not None:
            click.echo(f"mgtrace: error: {replaced.message}", err=True)
            return replaced.exit_code
        where = f" ({exc.filename})" if exc.filename else ""
        click.echo(f"mgtrace: error: {exc.strerror or exc}{where}", err=True)
        return EXIT_USAGE
    except Exception as exc:
        if is_query_interrupt(exc):  # a signal ended a DuckDB query mid-way
            return _interrupted(exc)
        if os.environ.get("MGTRACE_DEBUG"):
            raise
        # DuckDB's or pyarrow's words for a part that another process replaced or removed
        if (replaced := _replaced_during(opened, argv, prog_name, command is not None)) is not None:
            click.echo(f"mgtrace: error: {replaced.message}", err=True)
            return replaced.exit_code
        click.echo(
            f"mgtrace: internal error: {exc.__class__.__name__}: {exc} "
            "(set MGTRACE_DEBUG=1 to see the traceback, and please report it)",
            err=True,
        )
        return EXIT_INTERNAL
    return rv if isinstance(rv, int) else 0
