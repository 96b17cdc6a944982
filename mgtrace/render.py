"""Terminal rendering with rich: takes plain data, never touches click or the trace."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mgtrace.query.rank_steps import offsets_summary
from mgtrace.schemas.ranks import MISSING_RANKS
from mgtrace.shell import shell_path

_RUN_FIELDS = (
    ("runner", "runner"),
    ("vllm_version", "vLLM"),
    ("model", "model"),
    ("num_speculative_tokens", "k (spec tokens)"),
    ("mamba_block_size", "mamba block size"),
    ("mamba_cache_mode", "mamba cache mode"),
    ("async_scheduling", "async scheduling"),
    ("tp_size", "TP"),
    ("pp_size", "PP"),
    ("runner_reorder_threshold", "runner reorder threshold"),
    ("row_rule", "kernel row rule"),
)


def run_unknown(source: dict[str, Any]) -> set[str]:
    """Run fields the trace's source did not carry (a probe import's k and block size):
    the manifest holds RunMetadata's defaults there, which are no facts."""
    names = source.get("run_unknown")
    return {str(n) for n in names} if isinstance(names, list) else set()


def _text(value: Any, null: str = "") -> Text:
    """A cell or header from data, as plain text: a value such as '[/]' or '[red]x' is
    what the trace holds, not console markup (rich would fail on one and eat the other)."""
    return Text(null if value is None else str(value))


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


# errors (manifest kinds) that drop the steps they happen in, and how `info` names them
_DROP_CAUSES = {
    "writer": "writing failed",
    "stopped_mid_step": "stopped mid-step",
    "capture_ring_full": "capture ring full",
    "capture_too_large": "capture too large",
    "captures_dropped": "captures dropped",
    "capture_unfinished": "captures never landed",
}


def _drop_causes(errors: dict[str, Any]) -> str:
    """What the manifest's errors say dropped steps; steps that no error accounts for
    were dropped by a full queue or backlog (nothing else drops a step uncounted)."""
    causes = []
    for kind in errors:
        cause = _DROP_CAUSES.get(kind) or ("a hook failed" if kind.startswith("hook:") else None)
        if cause is not None and cause not in causes:
            causes.append(cause)
    return ", ".join(causes) if causes else "queue full"


def _incomplete_why(info: dict[str, Any]) -> str:
    """Why a trace is not complete, from its manifest."""
    errors = info["errors"]
    if MISSING_RANKS in errors:
        return errors[MISSING_RANKS]["first"]
    if "writer" in errors:
        return f"writing stopped: {errors['writer']['first']}"
    if "engine_exited" in errors:
        return "the engine exited without stopping the recording"
    if "interrupted" in errors:
        return "interrupted"
    if info.get("closed_unix") is None:
        return "writer did not close"
    return "closed before its end"


def render_info(info: dict[str, Any], console: Console) -> None:
    t = Table(title=_text(f"trace {info['path']}"), show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    if info["complete"]:
        t.add_row("status", "[green]complete[/]")
    else:
        t.add_row("status", Text.assemble(("incomplete", "red"), f" ({_incomplete_why(info)})"))
    source = info["source"]
    kind = str(source.get("kind", "unknown"))
    if "ranks" in source and isinstance(source["ranks"], dict):
        kind += f" ({', '.join(sorted(source['ranks']))})"  # one trace per worker, read as one
    t.add_row("source", _text(kind))
    run = info["run"]
    unknown = run_unknown(source)
    for key, label in _RUN_FIELDS:
        if key in unknown:
            t.add_row(label, "unknown (not in the source)")
        elif run.get(key) is not None:
            t.add_row(label, _text(run[key]))
    if (run.get("dp_size") or 1) > 1:
        t.add_row("DP", f"rank {run['dp_rank']} of {run['dp_size']} (an engine of its own)")
    if run.get("builder_reorder_thresholds"):
        t.add_row("builder thresholds", _text(run["builder_reorder_thresholds"]))
    if run.get("states"):
        t.add_row("state tensors", str(len(run["states"])))
    span = "" if info["first_step"] is None else f" ({info['first_step']}..{info['last_step']})"
    t.add_row("steps", f"{info['steps']}{span}")
    t.add_row("requests", str(info["requests"]))
    t.add_row("ranks", str(info["ranks"]))
    rank_steps = offsets_summary(info["rank_step_offsets"])
    if rank_steps is not None:
        t.add_row("rank steps", _text(rank_steps))
    t.add_row("size on disk", f"{human_bytes(info['bytes_on_disk'])} in {info['parts']} parts")
    drops = info["drops"]
    dropped = drops["steps"] + drops["malformed_steps"]
    told = []
    if drops["steps"]:
        told.append(f"{drops['steps']} steps ({_drop_causes(info['errors'])})")
    if drops["malformed_steps"]:
        told.append(f"{drops['malformed_steps']} malformed")
    t.add_row("drops", Text(", ".join(told), style="red") if dropped else "none")
    for kind, entry in info["errors"].items():
        t.add_row(_text(f"errors: {kind}"), _text(f"{entry['count']} (first: {entry['first']})"))
    truth = info["ground_truth"]
    if truth:
        injected = truth.get("injected") or []
        first = truth.get("first_step")
        text = ", ".join(injected) if injected else "none"
        if first is not None:
            text += f" (first corrupt step {first})"
        t.add_row("injected bugs", _text(text))
    for replay in info["saved_replays"]:
        t.add_row("saved replay", _text(saved_replay_line(replay)))
    for s in info["skipped_parts"]:
        t.add_row("[yellow]skipped part[/]", _text(f"{s['path']}: {s['reason']}"))
    for p in info["open_parts_left"]:
        t.add_row("[yellow]open part left[/]", _text(p))
    if info["unlisted_parts"]:
        unlisted = info["unlisted_parts"]
        more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
        t.add_row(
            "[yellow]unlisted parts[/]", _text(f"{unlisted[0]}{more} (not counted, never read)")
        )
    console.print(t)
    rows = Table(title="rows per table", title_justify="left")
    rows.add_column("table")
    rows.add_column("rows", justify="right")
    for name, n in info["rows"].items():
        rows.add_row(name, f"{n:,}")
    console.print(rows)


def saved_replay_line(replay: dict[str, Any]) -> str:
    """One saved replay, as `info` lists it: rules, findings, and how far it went."""
    from mgtrace.replayer.coverage import gaps_in_words

    rules = replay["rules"] or f"rules unknown (id {replay['replay_id']})"
    if replay["whole"] is False:
        rules += " (a window or some ranks)"
    n = replay["findings"]
    text = f"{rules}: " + (
        f"{counted(n, 'finding')} from step {replay['first_step']}" if n else "clean"
    )
    for key, word, verb in (
        ("stopped_at_gap", "before", "stopped"),
        ("crossed_gaps", "at", "crossed"),
    ):
        gaps = replay[key]
        if gaps:
            text += f"; {verb} where the trace lacks steps ({gaps_in_words(gaps, word)})"
    return text


def render_arrow(
    table: pa.Table, console: Console, *, more: bool, total: int | None = None
) -> None:
    """``table``, the rows shown; ``more``: the result has more rows, ``total`` of them in
    all where the caller knows (counting them runs the query again)."""
    from mgtrace.query.export import intervals_as_text, python_rows, with_iso_intervals

    table = intervals_as_text(table)
    rows = python_rows(table, "a table")
    t = Table(show_lines=False)
    for name in table.column_names:
        t.add_column(_text(name), overflow="fold")
    for row in rows:
        t.add_row(*(_text(with_iso_intervals(v), "NULL") for v in row.values()))
    console.print(t)
    note = counted(table.num_rows, "row")
    if more and total is not None:
        note = f"{table.num_rows:,} of {total:,} rows shown (raise --max-rows, or use --format csv)"
    elif more:
        note += " shown; more not shown (raise --max-rows, or use --format csv)"
    console.print(note, style="dim")


def render_canned(queries: list[tuple[str, str]], console: Console) -> None:
    t = Table(title="canned queries (mgtrace sql TRACE @NAME)", title_justify="left")
    t.add_column("query")
    t.add_column("answers", overflow="fold")
    for name, doc in queries:
        t.add_row(name, doc)
    console.print(t)


# Short headers for `mgtrace history`'s terminal table (the exported columns keep the views'
# names).
_HISTORY_HEADERS = {
    "batch_row": "row",
    "req_slot": "slot",
    "num_computed": "computed",
    "num_scheduled": "sched",
    "num_draft": "drafts",
    "accepted_prev": "acc prev",
    "accepted": "acc",
    "state_col": "col",
    "mamba_split": "split",
    "reorder_region": "region",
    "row_moves": "row moves",
}


def render_history(lines: pa.Table, console: Console, *, max_rows: int) -> None:
    """One request's lines; empty cells for what a step did not have, and no column that
    no line has (the rank only when there are several)."""
    from mgtrace.query.history import shown_history

    shown = shown_history(lines.slice(0, max_rows))
    names = [
        n
        for n in shown.column_names
        if shown[n].null_count < shown.num_rows
        and (n != "rank" or len(set(shown["rank"].to_pylist())) > 1)
    ]
    t = Table(show_lines=False)
    for n in names:
        t.add_column(_text(_HISTORY_HEADERS.get(n, n)), overflow="fold")
    for row in shown.select(names).to_pylist():
        t.add_row(*(_text(v) for v in row.values()))
    console.print(t)
    total = lines.num_rows
    note = counted(total, "step line")
    if total > max_rows:
        note = f"{max_rows:,} of {note} shown (raise --max-rows, or use --format csv)"
    console.print(note, style="dim")


def render_views(views: list[tuple[str, str, str, str]], console: Console) -> None:
    t = Table(title="trace views", title_justify="left")
    for name in ("view", "column", "type", "meaning"):
        t.add_column(name, overflow="fold")
    last = None
    for view, column, type_, doc in views:
        # the meanings say idx_mapping[batch_row]: text, not console markup
        t.add_row(view if view != last else "", column, type_, escape(doc))
        last = view
    console.print(t)


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1 (thousands separated)."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _replayed(result: Any, of_ranks: int | None = None) -> str:
    """Steps replayed, counted per rank: a PP trace's steps run on every rank. ``of_ranks``:
    the trace's rank count, when the replay ran only some of them."""
    ranks = len(result.ranks)
    steps = f"{result.steps:,} rank-steps" if ranks > 1 else counted(result.steps, "step")
    if of_ranks is not None:
        listed = ", ".join(map(str, result.ranks))
        return f"{steps} (rank{'s' if ranks > 1 else ''} {listed}, of {of_ranks})"
    return f"{steps} ({ranks} ranks)" if ranks > 1 else steps


def findings_by_kind(findings: list[Any]) -> list[tuple[str, int, int]]:
    """(kind, requests, first step) per finding kind, the kind that starts the corruption
    first: by first step, then by requests (most first), then by name."""
    reqs: dict[str, set[str]] = {}
    first: dict[str, int] = {}
    for f in findings:
        reqs.setdefault(f.kind, set()).add(f.req_id)
        first[f.kind] = min(first.get(f.kind, f.step), f.step)
    rows = [(kind, len(reqs[kind]), first[kind]) for kind in reqs]
    return sorted(rows, key=lambda r: (r[2], -r[1], r[0]))


def render_replay(
    result: Any,
    console: Console,
    *,
    trace: Any,
    replay_id: str | None,
    of_ranks: int | None = None,
) -> None:
    """The replay summary: the first corrupt step, its requests, and the finding kinds
    (``of_ranks``: the trace's rank count, when only some of its ranks were replayed)."""
    rules = result.rules.canonical()
    if result.clean:
        console.print(
            f"[green]clean[/]: {_replayed(result, of_ranks)} replayed under {rules}; no request "
            "read state that is not its own"
        )
        return
    first = [f for f in result.findings if f.step == result.first_step]
    requests = sorted({f.req_id for f in first})
    console.print(
        f"[red]corruption[/] under {rules}: first at step {result.first_step}, "
        f"request{'s' if len(requests) > 1 else ''} {escape(', '.join(requests))}"
    )
    # the ranks of a pipeline run the same batch and often find the same thing: each finding
    # once, with the ranks that found it where there are several
    said: dict[tuple[str, str], list[int]] = {}
    for f in first:
        said.setdefault((f.kind, f.detail), []).append(f.rank)
    several = len({f.rank for f in first}) > 1
    for (kind, detail), ranks in said.items():
        where = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        console.print(_text(f"  {kind}{where if several else ''}: {detail}"), highlight=False)
    t = Table(title="findings by kind", title_justify="left")
    t.add_column("kind")
    t.add_column("requests", justify="right")
    t.add_column("first step", justify="right")
    for kind, requests_of_kind, step in findings_by_kind(result.findings):
        t.add_row(_text(kind), str(requests_of_kind), str(step))
    console.print(t)
    repeats = (
        f" ({counted(result.repeats, 'repeat')} of the same finding for the same request not "
        "listed)"
        if result.repeats
        else ""
    )
    console.print(
        f"{counted(len(result.findings), 'finding')} over {_replayed(result, of_ranks)}{repeats}",
        style="dim",
    )
    if replay_id is not None:
        console.print(
            _text(
                f"next: mgtrace sql {shell_path(trace)} "
                f'"SELECT step, req_id, kind, detail FROM findings '
                f"WHERE replay_id = '{replay_id}' ORDER BY step LIMIT 20\""
            ),
            highlight=False,
        )


def render_verdict(v: Any, console: Console, *, log: Any) -> None:
    style = {"bad": "red", "clean": "green"}.get(v.status, "yellow")
    console.print(Text(v.sentence(), style=style), highlight=False)
    if v.status == "bad":
        for f in v.first_findings[:4]:
            console.print(_text(f"  {f['kind']}: {f['detail']}"), highlight=False)
        if v.explanations:
            console.print(_text("  multi-rule explanations: " + "; ".join(v.explanations)))
        console.print("reproduce:")
        for side in ("bad", "good"):
            if side in v.commands:
                console.print(_text(f"  {side + ':':6}{v.commands[side]}"), highlight=False)
    console.print(
        f"{counted(v.steps_replayed, 'step')} replayed in {v.wall_s:.2f} s over "
        f"{counted(len(v.probes), 'probe')}",
        style="dim",
    )
    if log is not None:
        from mgtrace.atomic import is_a_stream

        # a stream's log lands wherever it leads: only the user knows the file to re-check
        recheck = (
            ""
            if is_a_stream(log)
            else f" (re-check with: mgtrace bisect --replay {shell_path(log)})"
        )
        console.print(_text(f"log: {log}{recheck}"), style="dim")
