"""`mgtrace replay`: a thin layer over ``replay_trace`` and the findings writer."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mgtrace.console import stderr_console, stdout_console
from mgtrace.errors import (
    EXIT_CLEAN,
    EXIT_CORRUPTION,
    EXIT_INCONCLUSIVE,
    InconclusiveError,
    MgtraceError,
    OutputError,
    UsageError,
    reason,
)
from mgtrace.params import PATH
from mgtrace.replayer.rules import AS_RECORDED, RULES, RuleSet
from mgtrace.shell import shell_path

if TYPE_CHECKING:
    from mgtrace.schemas.reader import TraceReader


@contextmanager
def status_line(start: str) -> Iterator[Callable[[str], None] | None]:
    """A spinner line on standard error, rewritten by the function yielded, where standard
    error is a terminal; None elsewhere (a log or a pipe gets no redrawn lines). Each new
    text is drawn at once, not at the spinner's next frame: a short stage is shown too."""
    from rich.live import Live
    from rich.spinner import Spinner

    err = stderr_console()
    if not err.is_terminal:
        yield None
        return
    spinner = Spinner("dots", text=start)
    with Live(spinner, console=err, transient=True, refresh_per_second=12.5) as live:

        def say(text: str) -> None:
            spinner.update(text=text)
            live.refresh()

        yield say


def _is_stdout(path: Path) -> bool:
    """Whether ``path`` names this process's standard output (``/dev/stdout``, ``/dev/fd/1``,
    or the file or pipe it is)."""
    import os

    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except (OSError, ValueError):
        return False


def replay_id_for(
    rules: RuleSet,
    from_step: int | None = None,
    to_step: int | None = None,
    last_step: int | None = None,
    ranks: Sequence[int] | None = None,
) -> str:
    """Findings of one rule set replace those of an earlier replay with the same rules over
    the same steps and ranks; a replay of a window, or of some ranks (``ranks``: None for
    every one), never replaces the whole trace's, nor the reverse. A window that covers the
    whole trace (from step 0, to its ``last_step`` or past it) is the whole trace."""
    if from_step == 0:
        from_step = None
    if to_step is not None and last_step is not None and to_step >= last_step:
        to_step = None
    key = rules.canonical()
    if from_step is not None or to_step is not None:
        key += f"|steps {from_step}..{to_step}"
    if ranks is not None:
        key += f"|ranks {','.join(map(str, sorted(set(ranks))))}"
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def check_replay_window(
    reader: TraceReader, trace: Path, from_step: object, to_step: object
) -> int | None:
    """Refuse a step window no replay of ``trace`` can report on (the command line's and
    the API's alike); returns the trace's last step."""
    from mgtrace.cli import check_step_window

    for name, value in (("--from-step", from_step), ("--to-step", to_step)):
        if value is not None and (type(value) is not int or value < 0):
            raise UsageError(f"{name} must be a step number (0 or more), not {value!r:.40}")
    check_step_window(from_step, to_step)  # type: ignore[arg-type]
    last = last_step_of(reader)
    if from_step is not None and last is not None and from_step > last:  # type: ignore[operator]
        raise UsageError(f"--from-step {from_step} is past the last step of {trace} ({last})")
    return last


def last_step_of(reader: TraceReader) -> int | None:
    """The trace's last step, from its manifest (None for a trace without steps)."""
    return max(
        (p.max_step for p in reader.parts if p.table == "steps" and p.max_step is not None),
        default=None,
    )


def rules_from_options(values: dict[str, str | None], rules_text: str | None) -> RuleSet:
    """--rules with the rule flags on top; a flag that names a rule --rules sets, to another
    value, is a usage error (neither may silently win)."""
    base = RuleSet.parse(rules_text) if rules_text else RuleSet()
    chosen = {name: v for name, v in values.items() if v is not None}
    if not chosen:
        return base
    flags = RuleSet().with_(**chosen)  # each flag's value checked and made canonical
    named = {
        item.partition("=")[0].replace("-", "_")
        for item in re.split(r"[,\s]+", rules_text or "")
        if "=" in item
    }
    for name in sorted(named & chosen.keys()):
        if base[name] != flags[name]:
            raise UsageError(
                f"--rules sets {name}={base[name]} but {RULES[name].flag} sets {flags[name]}; "
                "give one of them"
            )
    return base.with_(**chosen)


def _rule_options(func):
    for rule in reversed(list(RULES.values())):
        choices = " | ".join((*rule.values, "as-recorded"))
        func = click.option(
            rule.flag,
            rule.name,
            default=None,
            metavar="VALUE",
            help=f"{rule.summary} [{choices}]",
        )(func)
    return func


def rules_json() -> list[dict[str, object]]:
    """The rules as --list-rules --json prints them ("N": any positive integer)."""
    return [
        {
            "name": rule.name,
            "flag": rule.flag,
            "values": [*rule.values, AS_RECORDED],
            "summary": rule.summary,
            "undoes": rule.undoes,
        }
        for rule in RULES.values()
    ]


def list_rules(console: Console) -> None:
    from rich.table import Table

    t = Table(title="replay rules (default: as-recorded)", title_justify="left")
    t.add_column("flag")
    t.add_column("values")
    t.add_column("what it changes")
    t.add_column("rules in or out")
    for rule in RULES.values():
        t.add_row(rule.flag, " | ".join((*rule.values, "as-recorded")), rule.summary, rule.undoes)
    console.print(t)


def rank_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--rank N`` (repeatable), into ``ranks``."""
    return click.option(
        "--rank", "ranks", type=click.IntRange(min=0), multiple=True, metavar="N", help=help
    )


RANK_OPTION = rank_option(
    "Replay this rank only (repeatable): one worker of each pipeline stage, say, where "
    "its tensor-parallel siblings ran the same batches. Default: every rank."
)
DEVICE_OPTION = click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the state pool lives and the kernels run (cuda: with --backend triton).",
)


@click.command("replay")
@click.argument("trace", type=PATH, required=False)
@_rule_options
@click.option("--rules", "rules_text", metavar="R=V,...", help="Rules in canonical form.")
@click.option(
    "--backend",
    type=click.Choice(["reference", "triton"]),
    default="reference",
    show_default=True,
    help="Kernel backend: numpy reference, or Triton (the kernels themselves; on compact tags "
    "checked byte for byte against the reference, which takes two to four times as long).",
)
@DEVICE_OPTION
@click.option(
    "--layout",
    type=click.Choice(["compact", "full"]),
    default="compact",
    show_default=True,
    help="State pool: tag-size states or the recorded shapes.",
)
@click.option(
    "--from-step",
    type=click.IntRange(min=0),
    default=None,
    help="Report findings from this step on: each request's first finding in the window, "
    "whatever came before it. The summary counts the window's steps.",
)
@click.option("--to-step", type=click.IntRange(min=0), default=None, help="Stop after this step.")
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Cache a checkpoint every N steps (TRACE/.replay-cache) for --from-step.",
)
@click.option("--allow-gaps", is_flag=True, help="Replay across dropped steps (may mislead).")
@RANK_OPTION
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Replay each rank in segments on N processes, with the same findings (compact "
    "layout); 0: one per core. Default, for a replay of at least 1,024 steps a rank (a "
    "--from-step window counts every step before it, unless cached checkpoints start it): "
    "one per core, at most 8 with triton (each holds a context on the GPU); else 1.",
)
@click.option("--no-save", is_flag=True, help="Do not add the findings to the trace.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--list-rules", "show_rules", is_flag=True, help="List the rules and exit.")
@click.option("--skip-bad-parts", is_flag=True, help="Read the valid parts of a damaged trace.")
def replay(
    trace: Path | None,
    rules_text: str | None,
    backend: str,
    device: str,
    layout: str,
    from_step: int | None,
    to_step: int | None,
    checkpoint_every: int | None,
    allow_gaps: bool,
    ranks: tuple[int, ...],
    jobs: int | None,
    no_save: bool,
    as_json: bool,
    show_rules: bool,
    skip_bad_parts: bool,
    **rule_values: str | None,
) -> int:
    """Re-run the align kernels of TRACE on provenance-tagged shadow state and report the
    first step at which a request reads state that is not its own. Each rank's replay
    stops before the first step the trace lacks (unless --allow-gaps): what it found before
    stands, and it says where it stopped.

    Exit codes: 0 clean, 1 corruption found, 2 usage error, 3 unreadable trace,
    125 inconclusive (nothing found before a gap, or a clean replay of a trace that lacks
    steps).
    """

    out = stdout_console()
    if show_rules:
        if as_json:
            click.echo(json.dumps(rules_json(), indent=1))
        else:
            list_rules(out)
        return EXIT_CLEAN
    if trace is None:
        raise UsageError("give a TRACE to replay (or --list-rules)")
    from mgtrace.cli import check_step_window
    from mgtrace.render import render_replay

    check_step_window(from_step, to_step)
    from mgtrace.query.rank_steps import step_offsets_caveat
    from mgtrace.replayer.coverage import (
        crossed_caveat,
        mid_run_caveat,
        rule_note,
        stopped_caveat,
        unmodelled_writes,
        unseen_reason,
    )
    from mgtrace.replayer.findings import save_findings
    from mgtrace.replayer.loop import replay_trace
    from mgtrace.replayer.parallel import auto_jobs, default_jobs
    from mgtrace.replayer.steps import ranks_of, some_ranks
    from mgtrace.schemas.reader import TraceReader, replaced_error

    rules = rules_from_options(rule_values, rules_text)
    reader = TraceReader(trace, skip_bad_parts=skip_bad_parts)
    last = check_replay_window(reader, trace, from_step, to_step)
    chosen = some_ranks(reader, ranks, trace)
    if jobs is None:
        jobs = auto_jobs(
            reader,
            chosen,
            backend=backend,
            layout=layout,
            rules=rules.canonical(),
            from_step=from_step,
            to_step=to_step,
            checkpoint_every=checkpoint_every,
        )
    err = stderr_console()
    steps_parts = [p for p in reader.parts if p.table == "steps"]
    if chosen is not None:
        steps_parts = [p for p in steps_parts if p.rank is None or p.rank in chosen]
    total = sum(p.rows for p in steps_parts)
    if to_step is not None:
        total = min(total, (to_step + 1) * max(1, len({p.rank for p in steps_parts})))
    columns = (TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("steps", total=total)
            result = replay_trace(
                reader,
                rules,
                backend=backend,
                device=device,
                layout=layout,
                from_step=from_step,
                to_step=to_step,
                allow_gaps=allow_gaps,
                checkpoint_every=checkpoint_every,
                progress=lambda n: bar.advance(task, n),
                jobs=jobs or default_jobs(),
                ranks=chosen,
            )
        replaced = replaced_error(reader, "the replay")
        if replaced is not None:  # its verdict may be of neither trace: none is given
            raise replaced
        if result.steps == 0:
            raise InconclusiveError(
                f"no step of {trace} could be replayed (all in left-out parts, or outside "
                "--to-step), so nothing can be said about them"
            )
    except OSError:
        replaced = replaced_error(reader, "the replay")
        if replaced is None:
            raise
        raise replaced from None  # a part gone with the trace another process replaced
    except InconclusiveError as exc:
        if as_json:  # a verdict, like a clean or a corrupt one: scripts read it as JSON
            no_verdict = {"rules": rules.canonical(), "clean": None, "inconclusive": exc.message}
            click.echo(json.dumps({**no_verdict, "argv": sys.argv[1:]}, indent=1))
        raise
    # gaps a replay crosses with --allow-gaps are dropped or left-out steps, which the
    # manifest and the reader say
    unseen = None if result.findings or result.window_whole else unseen_reason(reader)
    replay_id = replay_id_for(rules, from_step, to_step, last, chosen)
    saved = False
    if not no_save:
        try:
            save_findings(
                trace,
                result.findings,
                replay_id=replay_id,
                rules=rules.canonical(),
                stopped_at_gap=result.stopped_at_gap,
                crossed_gaps=result.crossed_gaps,
                read_from=reader.manifest,
            )
            saved = True
        except (OSError, OutputError) as exc:
            err.print(
                f"mgtrace: could not add the findings to {trace}: {reason(exc)}",
                soft_wrap=True,
                markup=False,
            )
    caveats = [
        stopped_caveat(result.stopped_at_gap),
        crossed_caveat(result.crossed_gaps, result.first_step),
        unmodelled_writes(reader.manifest.run),
        mid_run_caveat(reader),
        step_offsets_caveat(reader),
    ]
    caveat = "; ".join(c for c in caveats if c) or None
    note = rule_note(reader.manifest.run, rules)
    if as_json:
        summary = summary_json(result, replay_id, saved)
        if result.stopped_at_gap:  # rank -> the missing step the replay stopped before
            summary["stopped_at_gap"] = {str(r): g for r, g in result.stopped_at_gap.items()}
        if unseen is not None:
            summary["inconclusive"] = unseen
        if caveat is not None:
            summary["caveat"] = caveat
        if note is not None:
            summary["note"] = note
        click.echo(json.dumps(summary, indent=1, default=str))
    else:
        render_replay(
            result,
            out,
            trace=trace,
            replay_id=replay_id if saved else None,
            of_ranks=None if chosen is None else len(ranks_of(reader)),
        )
        if unseen is not None:
            out.print(f"[yellow]inconclusive[/]: {escape(unseen)}")
        if caveat is not None:
            out.print(f"[yellow]caveat[/]: {escape(caveat)}", highlight=False)
        if note is not None:
            out.print(f"note: {note}", markup=False, highlight=False)
    if result.findings:
        return EXIT_CORRUPTION
    return EXIT_CLEAN if unseen is None else EXIT_INCONCLUSIVE


def summary_json(result, replay_id: str, saved: bool) -> dict:
    first = [f for f in result.findings if f.step == result.first_step]
    return {
        "rules": result.rules.canonical(),
        "replay_id": replay_id if saved else None,
        "steps": result.steps,
        "ranks": result.ranks,
        "clean": result.clean,
        "first_step": result.first_step,
        "first_requests": sorted({f.req_id for f in first}),
        "first_findings": [
            {
                "kind": f.kind,
                "signature": f.signature,
                "req_id": f.req_id,
                "writer_req_id": f.writer_req_id,
                "detail": f.detail,
            }
            for f in first
        ],
        "counts": _counts(result.findings),
        "findings": len(result.findings),
        "repeats_suppressed": result.repeats,
        "argv": sys.argv[1:],
    }


def _counts(findings) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in findings:
        out[f.kind] = out.get(f.kind, 0) + 1
    return out


@click.command("bisect")
@click.argument("trace", type=PATH, required=False)
@_rule_options
@click.option("--rules", "rules_text", metavar="R=V,...", help="Base rules (default: as recorded).")
@click.option(
    "--horizon",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Steps past the first bad step a fix must keep clean.",
)
@click.option(
    "--backend", type=click.Choice(["reference", "triton"]), default="reference", show_default=True
)
@DEVICE_OPTION
@click.option(
    "--log",
    "log_path",
    type=PATH,
    help="Write the bisect log here (default: TRACE/bisect.json); never over a file that "
    "is not a bisect log, nor elsewhere inside a trace.",
)
@click.option(
    "--replay",
    "replay_log",
    type=PATH,
    help="Re-check a bisect log: run it again and compare.",
)
@RANK_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
@click.option("--skip-bad-parts", is_flag=True, help="Read the valid parts of a damaged trace.")
def bisect_cmd(
    trace: Path | None,
    rules_text: str | None,
    horizon: int,
    backend: str,
    device: str,
    log_path: Path | None,
    replay_log: Path | None,
    ranks: tuple[int, ...],
    as_json: bool,
    skip_bad_parts: bool,
    **rule_values: str | None,
) -> int:
    """Find the first step at which TRACE goes bad, its requests, and the single rule change
    that makes that step good; print the commands that reproduce both sides.

    Exit codes: 0 clean, 1 corruption found (verdict given), 2 usage error, 3 unreadable
    trace, 125 inconclusive (dropped steps, incomplete recording).
    """
    from mgtrace.opened_traces import refuse_if_any_replaced
    from mgtrace.render import render_verdict
    from mgtrace.replayer.bisect import bisect, check_log_path, recheck_log, save_log

    out = stdout_console()
    if replay_log is not None:
        # a re-check runs the log's own trace, horizon, rules and ranks, and writes no log
        source = click.get_current_context().get_parameter_source
        given = [
            flag
            for name, flag in (
                ("horizon", "--horizon"),
                ("log_path", "--log"),
                ("rules_text", "--rules"),
                ("ranks", "--rank"),
                *((r.name, r.flag) for r in RULES.values()),
            )
            if source(name) not in (None, click.core.ParameterSource.DEFAULT)
        ]
        if trace is not None:
            given.insert(0, "TRACE")
        if given:
            raise UsageError(
                "--replay re-checks the trace, horizon, rules and ranks its log names; drop "
                + ", ".join(given)
            )
        same, old, new = recheck_log(
            replay_log, backend=backend, device=device, skip_bad_parts=skip_bad_parts
        )
        if as_json:
            click.echo(
                json.dumps(
                    {"holds": same, "logged": old.sentence(), "now": new.sentence()}, indent=1
                )
            )
        else:
            out.print(f"logged: {old.sentence()}", markup=False, highlight=False)
            out.print(f"now:    {new.sentence()}", markup=False, highlight=False)
            out.print("[green]the verdict holds[/]" if same else "[red]the verdict changed[/]")
        return new.exit_code if same else 125
    if trace is None:
        raise UsageError("give a TRACE to bisect (or --replay LOG)")
    base = rules_from_options(rule_values, rules_text)
    if log_path is not None:  # refused before the replays, not after them
        from mgtrace.schemas.reader import open_manifest

        # an unreadable TRACE is said as such (exit 3) before the log is judged by it: a
        # folder that is no trace, or none at all, does not hold the log
        open_manifest(Path(trace))
        check_log_path(log_path, trace)
        if _is_stdout(log_path):
            # the log alone on stdout, so that the file it is redirected to re-checks
            if as_json:
                raise UsageError(
                    "--json and --log to standard output would write two documents there; "
                    "give the log a file, or leave out --json"
                )
            out = stderr_console()
    with status_line("bisecting") as say:
        verdict = bisect(
            trace,
            base=base,
            horizon=horizon,
            backend=backend,
            device=device,
            skip_bad_parts=skip_bad_parts,
            ranks=ranks or None,
            progress=None if say is None else lambda what: say(f"bisect: {what}"),
        )
    log = log_path or Path(trace) / "bisect.json"
    refuse_if_any_replaced("mgtrace bisect")  # no verdict, nor its log in another trace's folder
    try:
        save_log(verdict, log, skip_bad_parts=skip_bad_parts)
    except (OSError, MgtraceError) as exc:
        # an MgtraceError names the log already; one line, unwrapped, on stderr
        said = exc.message if isinstance(exc, MgtraceError) else reason(exc)
        if not said.startswith("cannot write"):
            said = f"could not write the bisect log {log}: {said}"
        click.echo(f"mgtrace: {said}", err=True)
        log = None
    if as_json:
        click.echo(json.dumps(verdict.to_json(), indent=1, default=str))
    else:
        render_verdict(verdict, out, log=log)
        from mgtrace.query.rank_steps import step_offsets_caveat
        from mgtrace.schemas.reader import TraceReader

        caveat = step_offsets_caveat(TraceReader(trace, skip_bad_parts=skip_bad_parts))
        if caveat is not None:
            out.print(f"[yellow]caveat[/]: {escape(caveat)}", highlight=False)
    return verdict.exit_code


@click.command("diff")
@click.argument("trace_a", type=PATH)
@click.argument("trace_b", type=PATH, required=False)
@click.option(
    "--rules-a",
    default=None,
    metavar="R=V,...",
    help="Rule set of the first replay (one trace)  [default: as-recorded]",
)
@click.option(
    "--rules-b", default=None, metavar="R=V,...", help="Rule set of the second replay (one trace)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--skip-bad-parts",
    is_flag=True,
    help="Read the valid parts of a damaged trace (compared up to the first step they lack).",
)
def diff_cmd(
    trace_a: Path,
    trace_b: Path | None,
    rules_a: str | None,
    rules_b: str | None,
    as_json: bool,
    skip_bad_parts: bool,
) -> int:
    """The first step where TRACE_A and TRACE_B differ, or where two rule sets on TRACE_A
    lead to different shadow state (--rules-a / --rules-b). Two traces are also compared on
    what a replay starts from: the run metadata a replay reads, and a minimized
    repro's start state. Timing columns (steps.wall_ns) are not compared. Two rule sets are
    replayed up to the first gap (dropped or left-out steps) and no further.

    Exit codes: 0 no divergence, 1 divergence found, 2 usage error, 3 unreadable trace,
    125 inconclusive (no divergence before a gap, or an incomplete recording).
    """
    from dataclasses import asdict

    from mgtrace.opened_traces import refuse_if_replaced
    from mgtrace.replayer.diff import diff_rules, diff_traces
    from mgtrace.schemas.reader import TraceReader

    out = stdout_console()
    if trace_b is not None:
        if rules_a is not None or rules_b is not None:
            raise UsageError("compare two traces or two rule sets, not both")
        readers = [TraceReader(t, skip_bad_parts=skip_bad_parts) for t in (trace_a, trace_b)]
        result = diff_traces(*readers)
        sentence = result.sentence(str(trace_a), str(trace_b))
    else:
        if rules_b is None:
            raise UsageError("give a second trace, or --rules-b to compare two rule sets")
        a, b = RuleSet.parse(rules_a or AS_RECORDED), RuleSet.parse(rules_b)
        readers = [TraceReader(trace_a, skip_bad_parts=skip_bad_parts)]
        result = diff_rules(readers[0], a, b)
        sentence = result.sentence(a, b)
    # a trace that another process replaced while it was read may differ only by that
    refuse_if_replaced(readers, "mgtrace diff")
    if as_json:
        fields = {"sentence": sentence, **asdict(result), "inconclusive": result.inconclusive}
        click.echo(json.dumps(fields, indent=1, default=str))
    else:
        out.print(sentence, markup=False, highlight=False)
        for side in ("a", "b"):
            for f in getattr(result, f"findings_{side}", [])[:3]:
                out.print(f"  {side}: {f['kind']}: {f['detail']}", markup=False, highlight=False)
    if result.first_step is not None or getattr(result, "setup", None):
        return EXIT_CORRUPTION
    return EXIT_INCONCLUSIVE if result.inconclusive is not None else EXIT_CLEAN


@click.command("minimize")
@click.argument("trace", type=PATH)
@click.option(
    "-o",
    "--output",
    type=PATH,
    required=True,
    help="The minimized trace; test_<name>.py is written beside it.",
)
@_rule_options
@click.option("--rules", "rules_text", metavar="R=V,...", help="Rules to replay under.")
@click.option(
    "--signature",
    help="Pin this signature, one of the findings at the first corrupt step (default: the "
    "first finding's).",
)
@click.option(
    "-f",
    "--force",
    is_flag=True,
    help="Replace an existing output that is an mgtrace trace, and the repro test mgtrace "
    "wrote beside it (never another folder or file).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--skip-bad-parts",
    is_flag=True,
    help="Read the valid parts of a damaged trace (up to the first step a bad part held).",
)
@rank_option(
    "Minimize a finding of this rank (repeatable); the other ranks, and any gap in them, "
    "are left out. Default: every rank."
)
def minimize_cmd(
    trace: Path,
    output: Path,
    rules_text: str | None,
    signature: str | None,
    force: bool,
    as_json: bool,
    skip_bad_parts: bool,
    ranks: tuple[int, ...],
    **rule_values: str | None,
) -> int:
    """Delta-debug TRACE down to the fewest requests and steps that still show the same
    finding (pinned by its signature); write it with a standalone pytest file.

    Exit codes: 0 minimized, 2 usage error, 3 unreadable trace, 125 nothing to minimize
    (a clean replay, or a gap before the first finding).
    """
    from dataclasses import asdict

    from mgtrace.render import counted
    from mgtrace.replayer.minimize import FIRST_REPLAY, minimize

    rules = rules_from_options(rule_values, rules_text)
    with status_line("minimizing") as say:

        def progress(phase: str, queries: int, size: int) -> None:
            if say is None:
                return
            if phase == FIRST_REPLAY:
                say(f"minimizing: replaying up to the first finding, {size:,} steps loaded")
            else:
                say(f"minimizing {phase}: {size} left, {queries} replays")

        result = minimize(
            trace,
            output,
            rules=rules,
            signature=signature,
            force=force,
            progress=progress,
            skip_bad_parts=skip_bad_parts,
            ranks=ranks or None,
        )
    if as_json:
        click.echo(json.dumps(asdict(result), indent=1))
        return EXIT_CLEAN
    out = stdout_console()
    out.print(
        f"minimized {trace}: {counted(result.original_steps, 'step')} and "
        # the requests in its batches: `info` also counts those that never got scheduled
        f"{counted(result.original_requests, 'request')} in batches -> "
        f"{counted(result.steps, 'step')} and "
        f"{counted(len(result.requests), 'request')} ({', '.join(result.requests)}), "
        f"{counted(result.table_updates, 'block-table change')}"
        + (
            f"; the finding also names {', '.join(result.start_state_requests)}, whose state "
            "the repro's start state holds"
            if result.start_state_requests
            else ""
        ),
        markup=False,
        highlight=False,
    )
    kept_rank = next((h["rank"] for h in result.history if h["pass"] == "ranks"), None)
    on_rank = "" if kept_rank is None else f", on rank {kept_rank}, the one rank it keeps"
    out.print(
        f"pinned finding: {result.signature} at step {result.first_step} of the repro "
        f"(step {result.original_first_step} of {trace}{on_rank}; the repro's steps start "
        "at 0)",
        markup=False,
        highlight=False,
    )
    out.print(f"{result.queries} replays in {result.wall_s:.1f} s", style="dim")
    out.print(f"wrote {result.output} and {result.test_file}", markup=False, highlight=False)
    out.print(
        f"next: python -m pytest {shell_path(result.test_file)}", markup=False, highlight=False
    )
    return EXIT_CLEAN
