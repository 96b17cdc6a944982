"""The ``record`` and ``import-probe`` verbs: argument checks and display only."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mgtrace.atomic import clear_stale_siblings, hidden_sibling, remove_tree
from mgtrace.errors import MgtraceError, OutputError, UsageError
from mgtrace.outputs import require_writable_parent
from mgtrace.params import PATH
from mgtrace.schemas.manifest import MANIFEST_NAME, is_trace_directory
from mgtrace.schemas.ranks import ENGINE_DIR, engine_directories
from mgtrace.shell import shell_path

if TYPE_CHECKING:
    from mgtrace.recorder.proctree import Proc


def _check_output(out: Path, force: bool) -> bool:
    """Whether ``out`` holds a trace to replace. An empty or new ``out`` is used as it is.
    With --force, a trace, or a folder that holds only traces (one per recorded process), is
    replaced (by ``_OldTrace``, once recording is sure to start); anything else is left
    alone."""
    # a killed mgtrace's old trace, moved aside: back in place, or gone where a recording is
    clear_stale_siblings(out)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    if not out.is_dir() or not _holds_only_traces(out):  # said first: --force would not help
        raise OutputError(
            f"{out} exists and is neither an mgtrace trace nor a folder of traces; choose "
            "another path (--force replaces only those)"
        )
    if not force:
        raise OutputError(f"{out} already exists; pass --force to overwrite it")
    return True


class _OldTrace:
    """The trace that --force replaces: moved aside (under a hidden name beside it) once
    recording is sure to start, deleted once the new recording holds a step, and put back
    when it holds none, so that a recording of nothing never costs the old trace."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.aside: Path | None = None

    def move_aside(self) -> None:
        aside = hidden_sibling(self.out, "old")
        os.rename(self.out, aside)
        self.aside = aside

    def settle(self) -> None:
        aside, self.aside = self.aside, None
        if aside is None:
            return
        if _holds_a_step(self.out):
            remove_tree(aside)
            return
        try:
            if self.out.exists():
                remove_tree(self.out)  # what is there holds no step
            os.rename(aside, self.out)
        except OSError as exc:
            click.echo(
                f"mgtrace: nothing was recorded, and the old trace could not be put back at "
                f"{self.out} ({exc.strerror or exc}); it is at {aside}",
                err=True,
            )
            return
        click.echo(f"mgtrace: nothing was recorded; the old trace at {self.out} was kept", err=True)


def _holds_only_traces(out: Path) -> bool:
    """A trace, or a folder of traces: one per rank (rank-NNN), or one per engine
    (engine-PID, which may hold rank-NNN traces in turn)."""
    return is_trace_directory(out) or all(
        is_trace_directory(p)
        or (ENGINE_DIR.fullmatch(p.name) is not None and p.is_dir() and _holds_only_traces(p))
        for p in out.iterdir()
    )


def _status_table(targets: list) -> object:
    from rich.table import Table

    table = Table(title="mgtrace record (Ctrl-C stops)", title_justify="left")
    # "queued MB": frames waiting for the assembler process; drops start at 64 MB
    columns = ("pid", "process", "state", "steps", "rows", "MB", "queued MB", "drops", "errors")
    for name in columns:
        table.add_column(name, justify="right" if name not in ("process", "state") else "left")
    for t in targets:
        s = t.status
        table.add_row(
            str(t.proc.pid),
            t.proc.role,
            str(s.get("state", "?")),
            str(s.get("steps", 0)),
            str(s.get("rows", 0)),
            f"{(s.get('bytes') or 0) / 1e6:.1f}",
            f"{(s.get('backlog_bytes') or 0) / 1e6:.1f}",
            str(s.get("drops", 0)),
            str(s.get("hook_errors", 0)),
        )
    return table


PLAIN_EVERY_S = 5.0


class _PlainCounters:
    """Where the output is not a terminal (``| tee log``) the live table shows only at the
    end: a plain line of counters every PLAIN_EVERY_S seconds shows the progress."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.last = -math.inf

    def __call__(self, targets: list) -> None:
        now = time.monotonic()
        if self.console.is_terminal or now - self.last < PLAIN_EVERY_S:
            return
        self.last = now
        line = "; ".join(
            f"pid {t.proc.pid} {t.status.get('state', '?')}: {t.status.get('steps', 0)} "
            f"steps, {t.status.get('rows', 0)} rows, {(t.status.get('bytes') or 0) / 1e6:.1f} "
            f"MB, {t.status.get('drops', 0)} dropped, {t.status.get('hook_errors', 0)} errors"
            for t in targets
        )
        self.console.print(f"mgtrace: {line}", highlight=False, markup=False)


def _named(proc: Proc) -> str:
    """``process PID``, with vLLM's role for it where the name or command line tells."""
    return f"process {proc.pid}" + (f" ({proc.role})" if proc.role != "other" else "")


def _summary(targets: list, not_recorded: list[str], duration: float | None = None) -> int:
    """What each process recorded, on stdout; on stderr, each process of the engine that
    could not be reached (the trace lacks its part, as its manifest says too)."""
    for sentence in not_recorded:
        click.echo(f"mgtrace: {sentence}", err=True)
    for t in targets:
        if t.status.get("state") == "gone" and t.status.get("out"):
            # the last poll is stale: an engine that ended normally closed its trace after it
            polled = t.status.get("steps") or 0
            complete, steps = _trace_state(t.status["out"], polled)
            t.status = {**t.status, "steps": steps, "polled": polled, "closed_complete": complete}
    written = [t for t in targets if t.status.get("out") and t.status.get("steps")]
    problems = []
    for t in written:
        s = t.status
        if s.get("state") == "gone":
            steps = s["steps"]
            if s["closed_complete"]:
                click.echo(
                    f"pid {t.proc.pid}: exited; its trace holds {steps} steps -> {s['out']} "
                    "(complete)"
                )
                continue
            problems.append(
                f"process {t.proc.pid} went away after {steps} steps; the trace in "
                f"{s['out']} is incomplete"
            )
        elif s.get("writer_failed"):
            problems.append(
                f"the trace of process {t.proc.pid} in {s['out']} could not be written "
                f"({s['writer_failed']}); it is incomplete"
            )
        else:
            click.echo(
                f"pid {t.proc.pid}: {s.get('steps', 0)} steps, {s.get('rows', 0)} rows, "
                f"{s.get('drops', 0)} dropped, {s.get('hook_errors', 0)} hook errors -> "
                f"{s['out']}" + ("" if s.get("complete", True) else " (incomplete)")
            )
    # a process that refused leaves the trace without its part: named, and not a success
    problems += [
        f"process {t.proc.pid} did not record: {t.status['refusal']}"
        for t in targets
        if t.status.get("refusal")
    ]
    gone = [t for t in targets if t.status.get("state") == "gone"]
    if problems:
        raise MgtraceError("; ".join(problems))
    if not written and gone:
        t = max(gone, key=lambda t: t.status.get("polled") or 0)
        if t.status.get("polled"):
            # a killed process takes the steps its writer had not flushed yet with it
            raise MgtraceError(
                f"process {t.proc.pid} went away after recording {t.status['polled']} steps, "
                f"before any of them reached the trace in {t.status['out']}"
            )
        raise MgtraceError(f"process {t.proc.pid} went away before a step was recorded")
    if not written:
        raise MgtraceError(
            f"no step was recorded{_within(duration)} (was the engine serving requests?)"
        )
    return 0


def _trace_state(out: str, polled_steps: int) -> tuple[bool, int]:
    """(complete, steps) of the trace in ``out`` by its manifest; (False, the last polled
    count) where it cannot be read."""
    from mgtrace.schemas.reader import TraceReader

    try:
        reader = TraceReader(out)
        return reader.complete, reader.rows("steps")
    except (MgtraceError, OSError, ValueError):
        return False, polled_steps


def _check_writable(out: Path, replace: bool) -> None:
    """The trace's directory can be written (an empty one kept) or made (the nearest
    existing folder above it is a writable directory); checked before any engine process
    is touched."""
    if out.is_dir() and not replace:
        if not os.access(out, os.W_OK | os.X_OK):
            raise OutputError(f"cannot write the trace to {out}: it is not writable")
        return
    require_writable_parent(out, f"the trace to {out}")


def _stop_command(engine_pid: int) -> int:
    """``--stop``: end the recording of every agent under ``engine_pid``."""
    from mgtrace.recorder import attach

    if engine_pid <= 0 or engine_pid == os.getpid():
        raise UsageError(f"{engine_pid} is not a vLLM engine process id")
    with attach.signals_as_interrupt() as received:
        stopped = attach.stop_pid(engine_pid)
    if not stopped:
        click.echo(f"no process under {engine_pid} is recording")
    for t in stopped:
        s = t.status
        state = (
            "gone"
            if s.get("state") == "gone"
            else ("complete" if s.get("complete", True) else "incomplete")
        )
        click.echo(
            f"pid {t.proc.pid}: stopped after {s.get('steps', 0)} steps -> {s.get('out')} ({state})"
        )
    return 128 + received[0] if received else 0


def record_command(
    engine_pid: int | None,
    output: Path | None,
    duration: float | None,
    max_steps: int | None,
    force: bool,
    command: tuple[str, ...],
    stop: bool = False,
) -> int:
    """Record a running vLLM engine (--engine-pid PID), or start one with recording armed
    (-- vllm serve ...; mgtrace's options go before it, everything from its first word on is
    the engine's). With --stop, end the recording of every process of the engine that
    records (one whose mgtrace was killed before it could stop it).

    Exit codes: 0 recorded (or stopped), 2 refused (bad option, no engine, nothing
    recorded), 130 Ctrl-C, 143/129 SIGTERM/SIGHUP; with an engine command, the engine's own
    exit status (2 when it recorded nothing; a signal that ended it, as a shell reports
    one)."""
    from mgtrace.recorder import attach

    if stop:
        if engine_pid is None or command:
            raise UsageError("--stop takes --engine-pid PID and no engine command")
        if output is not None or duration is not None or max_steps is not None or force:
            raise UsageError("--stop takes no -o, --duration, --max-steps or --force")
        return _stop_command(engine_pid)
    if command and command[0].startswith("-"):  # no program is named so
        raise UsageError(
            f"no such option: {command[0]} (mgtrace's options go before the engine command, "
            "and no engine command starts with '-')"
        )
    if (engine_pid is None) == (not command):
        raise UsageError("give either --engine-pid PID or the engine command after --")
    if duration is not None and not (0 < duration < math.inf):  # also refuses nan
        raise UsageError("--duration must be a positive, finite number of seconds")
    if max_steps is not None and max_steps < 1:
        raise UsageError("--max-steps must be at least 1")
    if output is None:
        if engine_pid is None:
            raise UsageError("give the trace directory with -o DIR")
        output = Path(f"mgtrace-{engine_pid}")
    if engine_pid is not None:
        if engine_pid <= 0 or engine_pid == os.getpid():
            raise UsageError(f"{engine_pid} is not a vLLM engine process id")
        attach.engine_tree(engine_pid)  # a missing or foreign process: refused up front
    replace = _check_output(output, force)
    _check_writable(output, replace)
    old = _OldTrace(output) if replace else None
    made = not output.resolve().exists()  # the agents write where a link leads
    try:
        return _record(engine_pid, output, duration, max_steps, command, old)
    finally:
        if old is not None:
            old.settle()
        elif not _holds_a_step(output):
            # a recording of nothing (however it ended) leaves nothing: the folder as it
            # was, absent or empty, so that the next run needs no --force
            _discard_traces_of_no_step(output.resolve(), made=made)


def _holds_a_step(out: Path) -> bool:
    return any(out.glob("**/steps/*.parquet"))


def _discard_traces_of_no_step(out: Path, *, made: bool) -> None:
    """Remove the traces of no step the recording left at ``out`` (the folder itself, or its
    engine and rank traces), each only once no writer holds it open, and only their own
    files; then ``out`` itself where the recording made it and nothing else is in it."""
    from mgtrace.schemas.ranks import rank_directories
    from mgtrace.schemas.tables import TABLES
    from mgtrace.schemas.writer import WRITING_LOCK, writer_is_open

    def traces(folder: Path) -> list[Path]:
        if is_trace_directory(folder):
            return [folder]
        nested = [*engine_directories(folder), *rank_directories(folder).values()]
        return [t for f in nested for t in traces(f)]

    for trace in traces(out):
        if writer_is_open(trace) or _holds_a_step(trace):
            continue
        for name in TABLES:
            if (trace / name).is_dir() and not (trace / name).is_symlink():
                remove_tree(trace / name)
        for name in (WRITING_LOCK, MANIFEST_NAME):
            with contextlib.suppress(OSError):
                (trace / name).unlink()
        if trace != out:
            with contextlib.suppress(OSError):  # not empty: something else is in it
                trace.rmdir()
                if trace.parent != out:  # an engine's folder that held rank traces
                    trace.parent.rmdir()
    if made:
        with contextlib.suppress(OSError):
            out.rmdir()


def _within(duration: float | None) -> str:
    return "" if duration is None else f" in the {duration:g} s of --duration"


def _record(
    engine_pid: int | None,
    output: Path,
    duration: float | None,
    max_steps: int | None,
    command: tuple[str, ...],
    old: _OldTrace | None,
) -> int:
    """``record_command`` once its arguments and output are checked."""
    from rich.live import Live

    from mgtrace.recorder import attach

    if engine_pid is not None:
        not_recorded: list[str] = []
        with attach.signals_as_interrupt() as received:
            try:
                with Live(refresh_per_second=2, transient=False) as live:
                    plain = _PlainCounters(live.console)

                    def on_status(ts: list) -> None:
                        live.update(_status_table(ts))
                        plain(ts)

                    targets = attach.record_pid(
                        engine_pid,
                        output,
                        duration_s=duration,
                        max_steps=max_steps,
                        on_status=on_status,
                        # the old trace goes only once every check passed
                        before_start=old.move_aside if old is not None else None,
                        on_connect=lambda t: live.console.print(
                            f"{_named(t.proc)}: agent via {t.how}", highlight=False
                        ),
                        on_missing=not_recorded.append,
                        on_engines=lambda folders: live.console.print(
                            f"process {engine_pid} runs {len(folders)} engines; each records "
                            f"into a trace of its own: {', '.join(map(str, folders))}",
                            highlight=False,
                            markup=False,
                            soft_wrap=True,  # paths stay whole in a log
                        ),
                    )
                    live.update(_status_table(targets))
                if not live.console.is_terminal:  # the table ends without one
                    live.console.line()
            except KeyboardInterrupt:
                if not received:
                    raise
                click.echo(f"mgtrace: stopped by {_signal_name(received[0])}", err=True)
                return 128 + received[0]
        if not received:
            return _summary(targets, not_recorded, duration)
        # stopped by Ctrl-C, SIGTERM or SIGHUP: what was recorded is reported, the exit
        # says why
        click.echo(f"mgtrace: stopped by {_signal_name(received[0])}", err=True)
        try:
            _summary(targets, not_recorded)
        except MgtraceError as exc:
            click.echo(f"mgtrace: error: {exc.message}", err=True)
        return 128 + received[0]
    if old is not None:
        old.move_aside()
    ends_early = max_steps is not None or duration is not None
    refusals: dict[int, str] = {}
    rc = attach.launch(
        list(command),
        output,
        duration_s=duration,
        max_steps=max_steps,
        on_poll=_EndNotice() if ends_early else None,
        refusals=refusals,
    )
    click.echo(_launch_outcome(output, rc, refusals, duration))
    # a signal's death is reported as a shell does: 128 + its number
    return 128 - rc if rc < 0 else rc


class _EndNotice:
    """Launch mode: one line once every agent has ended its recording (``--max-steps``,
    ``--duration``) while the engine goes on serving, so that mgtrace's wait for the
    command does not look like a hang. Returns False, to stop the polls, once said."""

    def __call__(self, targets: list) -> bool:
        if not targets or any(t.status.get("state") != "idle" for t in targets):
            return True
        steps = max(int(t.status.get("steps") or 0) for t in targets)
        click.echo(
            f"mgtrace: the recording ended after {steps} steps; the engine goes on, and "
            "mgtrace waits for it to exit (Ctrl-C ends it)",
            err=True,
        )
        return False


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _ended(rc: int) -> str:
    """How a process with exit status ``rc`` (Popen's: -N for signal N) ended, in words."""
    return f"was killed by {_signal_name(-rc)}" if rc < 0 else f"exited with status {rc}"


def _lift_single_engine(out: Path) -> list[Path]:
    """The traces a launched command left in ``out``. Each engine recorded into
    ``out/engine-PID`` (two engines of one command must not share a folder); the trace of a
    lone engine that nothing writes any more moves up to ``out`` itself, the layout of one
    engine. Until then, and for good when mgtrace is killed first, it is a whole trace at
    ``out/engine-PID``, which ``mgtrace info out`` names. The move goes through a hidden
    sibling of ``out`` that ``clear_stale_siblings`` puts back should it be cut short."""
    from mgtrace.schemas.writer import writer_is_open

    engines = engine_directories(out)
    if not engines:
        return [out]  # an engine whose mgtrace predates per-engine folders wrote out itself
    if len(engines) > 1 or len(list(out.iterdir())) > 1:
        return engines
    engine = engines[0]
    if any(writer_is_open(m.parent) for m in engine.glob("**/manifest.json")):
        return engines  # a process of the engine still writes it: it stays where it is
    aside = hidden_sibling(out, "lift")
    try:
        os.rename(out, aside)
    except OSError:
        return engines
    try:
        os.rename(aside / engine.name, out)
    except OSError:
        with contextlib.suppress(OSError):
            os.rename(aside, out)
        return engines
    with contextlib.suppress(OSError):
        aside.rmdir()
    return [out]


def _launch_outcome(
    output: Path,
    rc: int,
    refusals: dict[int, str] | None = None,
    duration: float | None = None,
) -> str:
    """What a launched command left in ``output``, in words; refuses when it left nothing
    or traces of no step, naming an agent's refusal where one refused."""
    if not output.exists() or not any(output.iterdir()):
        why = (
            "no vLLM engine step ran, or its Python environment lacks mgtrace (the vLLM "
            "plugin that records is part of it)"
        )
        if refusals:
            pid, reason = min(refusals.items())
            why = f"mgtrace's agent in process {pid} refused to record: {reason.rstrip('.')}"
        raise MgtraceError(
            f"the engine {_ended(rc)} and recorded nothing into {output}: {why}",
            # a signal's death keeps its status: it says more than a usage error's 2
            exit_code=128 - rc if rc < 0 else None,
        )
    traces = _lift_single_engine(output)
    still_written = len(traces) == 1 and traces != [output]
    if not still_written and not _holds_a_step(output):
        raise MgtraceError(
            f"the engine {_ended(rc)} and recorded no step{_within(duration)} into {output}",
            exit_code=128 - rc if rc < 0 else None,
        )
    traces = _each_trace(traces)  # an engine of several DP ranks: a trace per rank
    if len(traces) > 1:
        return f"the command {_ended(rc)}; it ran {len(traces)} engines, each with a trace of " + (
            "its own:\n" + "\n".join(f"  {_recorded(t)}" for t in traces)
        )
    if still_written:
        return (
            f"engine {_ended(rc)}; {_recorded(traces[0])}; it stays in {traces[0].name} "
            "because a process of the engine still writes it"
        )
    return f"engine {_ended(rc)}; {_recorded(traces[0])}"


def _each_trace(folders: list[Path]) -> list[Path]:
    """The traces in ``folders``: each, or the engines' traces it holds."""
    return [t for f in folders for t in (_each_trace(engine_directories(f)) or [f])]


def _recorded(output: Path) -> str:
    """What the trace at ``output`` holds, in words."""
    from mgtrace.schemas.reader import TraceReader

    try:
        reader = TraceReader(output)
    except MgtraceError as exc:
        return f"the trace under {output} is unreadable: {exc}"
    parts = [p for p in reader.parts if p.table == "steps" and p.min_step is not None]
    span = (
        f"steps {min(p.min_step for p in parts)}..{max(p.max_step for p in parts)}"
        if parts
        else "no step"
    )
    ranks = len({p.rank for p in parts})
    state = "complete" if reader.complete else "incomplete"
    return (
        f"recorded {span} on {ranks} rank(s) into {output} "
        f"({state}; mgtrace info {shell_path(output)} says more)"
    )


def import_probe_command(probe: Path, burst: Path | None, output: Path, force: bool) -> int:
    """Convert the field probe log (and load-generator output) into a trace.

    Malformed lines are counted and reported, not fatal. Exit codes: 0 written, 2 usage
    error (unreadable log, nothing to import, output exists, or a row the trace writer
    refused: no new trace is left then, an old one it was to replace stays, and the counts
    printed are always the trace's)."""
    from mgtrace.recorder.probe_import import import_probe

    report = import_probe(probe, burst, output, force=force)
    click.echo(
        f"imported {report.steps} steps, {report.batch_rows} prefill-region rows, "
        f"{report.row_moves} swaps, {report.requests} requests "
        f"({report.matched_requests} matched to engine ids) from {report.ranks} process(es) "
        f"into {output}"
    )
    if report.malformed_total:
        detail = ", ".join(f"{k}={v}" for k, v in sorted(report.malformed.items()))
        click.echo(
            f"skipped {report.malformed_total} malformed entries ({detail}); "
            "counted in the manifest's errors",
            err=True,
        )
    if report.requests and not report.matched_requests:
        click.echo(
            "warning: no load-generator request id matches an engine request of the probe "
            "log, so the re-analysis has no step to place them by (every one would read as "
            "clean); check that the two files come from the same run",
            err=True,
        )
    if report.requests:  # the load generator's labels: the field re-analysis is one query
        click.echo(f"next: mgtrace sql {shell_path(output)} @client-labels")
    return 0


record = click.command(
    "record",
    # Everything from the engine command's first word on is the engine's: its options are
    # not taken for mgtrace's. An unknown option before it lands there too, and is refused.
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)(
    click.option("--engine-pid", type=int, help="Process id of a running vLLM engine.")(
        click.option(
            "-o",
            "--output",
            type=PATH,
            help="Trace directory (per rank: DIR/rank-NNN when there are several; per "
            "engine: DIR/engine-PID when --engine-pid is above several engines, or the "
            "command starts several); "
            "default with --engine-pid: mgtrace-PID in the current directory.",
        )(
            click.option("--duration", type=float, help="Stop after this many seconds.")(
                click.option("--max-steps", type=int, help="Stop after this many steps.")(
                    click.option(
                        "-f", "--force", is_flag=True, help="Overwrite an existing trace."
                    )(
                        click.option(
                            "--stop",
                            is_flag=True,
                            help="Only stop: end the recording of every process of "
                            "--engine-pid that records (one whose mgtrace was killed).",
                        )(
                            click.argument("command", nargs=-1, type=click.UNPROCESSED)(
                                record_command
                            )
                        )
                    )
                )
            )
        )
    )
)

import_probe = click.command("import-probe")(
    click.argument("probe", type=PATH)(
        click.argument("burst", required=False, type=PATH)(
            click.option(
                "-o",
                "--output",
                required=True,
                type=PATH,
                help="Trace directory to write.",
            )(
                click.option("-f", "--force", is_flag=True, help="Overwrite an existing trace.")(
                    import_probe_command
                )
            )
        )
    )
)
