"""`mgtrace report`: one self-contained HTML file (embedded PNG plots, tables) per trace.

It shows the run metadata, the batch-composition timeline, the accepted-count distribution,
the corruption onset, the findings, the field re-analysis cross-tab, the bisect verdict and
the history of the first bad requests around the first bad step.
Rendering takes data and figures; it never touches click.
"""

from __future__ import annotations

import base64
import html
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mgtrace import __version__
from mgtrace.api import Trace
from mgtrace.atomic import atomic_write
from mgtrace.errors import InconclusiveError
from mgtrace.query import canned, plots
from mgtrace.query.rank_steps import offsets_summary
from mgtrace.render import run_unknown
from mgtrace.replayer.coverage import stopped_caveat, unseen_reason
from mgtrace.replayer.requests import is_request
from mgtrace.shell import path_arg

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.verdict { padding: 0.8em 1em; border-radius: 6px; margin: 1em 0; font-size: 1.05em; }
.bad { background: #fde8e8; border: 1px solid #e0a0a0; }
.clean { background: #e8f6e8; border: 1px solid #a0d0a0; }
.inconclusive { background: #fff6dc; border: 1px solid #e0c870; }
.warn { background: #fff6dc; padding: 0.4em 0.8em; }
code { background: #f4f4f4; padding: 1px 4px; }
img { max-width: 100%; }
"""


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape('' if v is None else str(v))}</td>" for v in r)
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(fig: Any, alt: str) -> str:
    data = base64.b64encode(plots.to_png(fig)).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


HISTORY_BEFORE, HISTORY_AFTER = 8, 2  # steps of each history shown around the first bad one


def _connection(trace: Trace, findings: list) -> Any:
    """The trace's views, with this report's findings as ``findings`` (the report's replay
    is not saved in the trace)."""
    from mgtrace.replayer.findings import findings_table
    from mgtrace.replayer.rules import AS_RECORDED

    con = trace.reader.connect()
    con.register("report_findings", findings_table(findings, replay_id="report", rules=AS_RECORDED))
    con.sql("CREATE OR REPLACE VIEW findings AS SELECT * FROM report_findings")
    return con


def _query_table(con: Any, sql: str) -> str:
    rel = con.sql(sql)
    return _table(rel.columns, rel.fetchall())


def _histories(con: Any, trace: Trace, requests: list[str], first_bad: int, rank: int) -> list[str]:
    """``mgtrace history`` of each request around the first bad step, on the rank of the
    first finding (every rank of an engine runs the same batch)."""
    from mgtrace.query.history import request_history, shown_history
    from mgtrace.replayer.checkpoint import start_state

    out = []
    for req in requests:
        lines = shown_history(
            request_history(
                con,
                req,
                from_step=max(0, first_bad - HISTORY_BEFORE),
                to_step=first_bad + HISTORY_AFTER,
                rules=None,  # the view holds the report's own replay only
                run=trace.run,
                rank=rank,
                start=start_state(trace.reader),
            )
        )
        names = [n for n in lines.column_names if lines[n].null_count < lines.num_rows]
        rows = [list(r.values()) for r in lines.select(names).to_pylist()]
        out += [f"<h3><code>{html.escape(req)}</code></h3>", _table(names, rows)]
    return out


def _run_section(info: dict[str, Any]) -> list[str]:
    run = info["run"]
    unknown = run_unknown(info["source"])

    def known(key: str) -> Any:
        return "unknown (not in the source)" if key in unknown else run[key]

    meta = [
        ("status", "complete" if info["complete"] else "incomplete"),
        ("source", info["source"].get("kind")),
        ("runner", run["runner"]),
        ("vLLM", run["vllm_version"]),
        ("model", run["model"]),
        ("k", known("num_speculative_tokens")),
        ("mamba block size", known("mamba_block_size")),
        ("async scheduling", run["async_scheduling"]),
        ("TP / PP", f"{run['tp_size']} / {run['pp_size']}"),
        ("runner reorder threshold", run["runner_reorder_threshold"]),
        ("builder thresholds", run["builder_reorder_thresholds"] or None),
        ("steps", info["steps"]),
        ("requests", info["requests"]),
        ("ranks", info["ranks"]),
        ("dropped steps", info["drops"]["steps"] + info["drops"]["malformed_steps"]),
    ]
    # as `mgtrace info`: a field the run does not have (a V2 runner's reorder threshold, a
    # simulated run's vLLM version) is left out, not shown blank
    meta = [(field, value) for field, value in meta if value is not None]
    for part in info.get("skipped_parts", []):  # --skip-bad-parts: what the report lacks
        meta.append(("left-out part", f"{part['path']}: {part['reason']}"))
    rank_steps = offsets_summary(info["rank_step_offsets"])
    if rank_steps is not None:
        meta.insert(meta.index(("ranks", info["ranks"])) + 1, ("rank steps", rank_steps))
    return ["<h2>Run</h2>", _table(["field", "value"], meta)]


def _findings_section(
    con: Any, trace: Trace, result: Any, crossed: bool, max_findings: int
) -> list[str]:
    parts = ["<h2>Findings (replay as recorded)</h2>"]
    if not result.steps:  # "no findings" would read as a clean run
        parts.append("<p>No step could be replayed, so there are no findings to show.</p>")
        return parts
    if crossed:
        parts.append(
            "<p class='warn'>The trace has dropped or left-out steps; this replay crossed "
            "them, and what it found after the first gap may mislead.</p>"
        )
    stopped = stopped_caveat(result.stopped_at_gap)
    if stopped is not None:  # as `mgtrace replay` says it
        parts.append(f"<p class='warn'>{html.escape(stopped[0].upper() + stopped[1:])}.</p>")
    if not result.findings:
        parts.append(
            "<p>No findings: the replay found no request reading state that is not its own.</p>"
        )
        return parts
    counts: dict[str, set[str]] = {}
    for f in result.findings:
        counts.setdefault(f.kind, set()).add(f.req_id)
    parts.append(_table(["kind", "requests"], [(k, len(v)) for k, v in sorted(counts.items())]))
    first_seen: dict[tuple[str, str], int] = {}
    for f in result.findings:
        first_seen.setdefault((f.kind, f.req_id), f.step)
    onset = [(kind, req, step) for (kind, req), step in first_seen.items()]
    parts.append(_img(plots.corruption_onset(onset), "corruption onset"))
    parts.append(
        _table(
            ["step", "rank", "request", "kind", "detail"],
            [(f.step, f.rank, f.req_id, f.kind, f.detail) for f in result.findings[:max_findings]],
        )
    )
    if len(result.findings) > max_findings:
        parts.append(_more_findings(trace, result, crossed, max_findings))
    first_bad = result.first_step
    first = [f for f in result.findings if f.step == first_bad]
    chosen = sorted(
        {f.req_id for f in first} | {f.writer_req_id for f in first if is_request(f.writer_req_id)}
    )[:4]
    rank = min(f.rank for f in first)
    on_rank = f" (rank {rank})" if len(result.ranks) > 1 else ""
    parts += [
        "<h2>Block ownership of the first requests</h2>",
        _img(plots.block_ownership(trace, chosen), "block ownership"),
        f"<h2>History of the first requests{on_rank}</h2>",
        *_histories(con, trace, chosen, first_bad, rank),
    ]
    return parts


def _more_findings(trace: Trace, result: Any, crossed: bool, shown: int) -> str:
    """The line under a cut findings list: the command that lists them all, after the replay
    that saves them where the trace holds none (the report's own replay saves nothing)."""
    from mgtrace.query.history import replay_saved
    from mgtrace.replayer.cli import replay_id_for

    total = len(result.findings)
    # a damaged trace is read as the report read it, and crossed as its replay crossed it
    skip = ["--skip-bad-parts"] if trace.reader.skipped else []
    sql = (
        shlex.join(["mgtrace", "sql", path_arg(trace.path), *skip, "--format", "csv"])
        + ' "SELECT step, rank, req_id, kind, detail FROM findings '
        f"WHERE replay_id = '{replay_id_for(result.rules)}' "
        'ORDER BY step, rank, batch_row NULLS FIRST"'
    )
    line = f"<p>{total - shown} more findings not shown"
    if replay_saved(trace.reader, result.rules.canonical()):
        return line + f"; all {total}: <code>{html.escape(sql)}</code></p>"
    gaps = ["--allow-gaps"] if crossed else []
    save = shlex.join(
        ["mgtrace", "replay", path_arg(trace.path), *result.rules.as_flags(), *gaps, *skip]
    )
    return (
        line + f". The report saves none: save them with <code>{html.escape(save)}</code>, "
        f"then list all {total} with <code>{html.escape(sql)}</code></p>"
    )


def _without_drafts(trace: Trace, unknown: set[str]) -> str | None:
    """Why no row of the trace drafted tokens, where the trace says so (k = 0, or the rows
    are in a part left out); None where it does not (k unknown, or no row drafted though
    the run could have)."""
    if any(part.table == "batch_rows" for part in getattr(trace.reader, "skipped", ())):
        return "rows of the batch lie in a part that --skip-bad-parts left out"
    if "num_speculative_tokens" in unknown or trace.run.num_speculative_tokens != 0:
        return None
    return "no speculative decoding in this run (k = 0)"


def _accepted_section(con: Any, trace: Trace, unknown: set[str]) -> list[str]:
    parts = ["<h2>Accepted counts</h2>"]
    if not con.sql(canned.ACCEPTED_DISTRIBUTION).limit(1).fetchall():  # an empty plot says nothing
        why = _without_drafts(trace, unknown) or "no spec-decode row recorded an accepted count"
        return [*parts, f"<p>No accepted counts to plot: {why}.</p>"]
    return [*parts, _img(plots.accepted_distribution(trace), "accepted-count distribution")]


def _reanalysis_section(con: Any, trace: Trace, replayed: bool, unknown: set[str]) -> list[str]:
    """The field re-analysis: first spec-decode step in the Mamba prefill split against the
    replay's findings and, where the load generator labelled requests, against what the
    client saw."""
    parts = ["<h2>Field re-analysis</h2>"]
    if replayed:
        split = con.sql(canned.FIRST_DECODE_IN_PREFILL_SPLIT.format(where=""))
        rows = split.fetchall()
        if rows:
            parts.append(_table(split.columns, rows))
        else:  # no request drafted, so none has a first spec-decode step
            why = _without_drafts(trace, unknown) or "no request ran a spec-decode step"
            parts.append(f"<p>No first spec-decode steps to cross with the findings: {why}.</p>")
    ((labelled,),) = con.sql("SELECT count(*) FROM requests WHERE corrupt IS NOT NULL").fetchall()
    if labelled:
        window = canned.label_window(trace.run.num_speculative_tokens)
        parts += [
            f"<p>Client labels against the Mamba prefill region (window {window}):</p>",
            _query_table(con, canned.crosstab_sql(window)),
        ]
    elif not replayed:
        parts.append("<p>Nothing to cross: no replay and no client labels.</p>")
    return parts


def build_report(trace: Trace, *, bisect: bool = True, max_findings: int = 50) -> str:
    """The report's HTML. Replays the trace as recorded (without saving) for its findings;
    a trace that cannot be replayed (a probe import) gets the sections that apply."""
    from mgtrace.errors import UsageError
    from mgtrace.replayer.steps import require_replayable

    info = trace.info()
    unknown = run_unknown(info["source"])
    try:
        require_replayable(trace.reader)
        unreplayable = None
    except UsageError as exc:
        unreplayable = exc.message
    result, crossed, verdict = None, False, None
    if unreplayable is None:
        try:
            result = trace.replay()
        except InconclusiveError:  # gaps: the findings still show, under a warning
            result, crossed = trace.replay(allow_gaps=True), True
        verdict = trace.bisect() if bisect else None
    con = _connection(trace, result.findings if result is not None else [])
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>mgtrace report: {html.escape(str(trace.path))}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>mgtrace report: <code>{html.escape(str(trace.path))}</code></h1>",
    ]
    if verdict is not None:
        parts.append(
            f"<div class='verdict {verdict.status}' id='verdict'>"
            f"{html.escape(verdict.sentence())}</div>"
        )
        if verdict.commands:
            parts.append(_table(["side", "command"], sorted(verdict.commands.items())))
    elif result is not None and result.clean:
        unseen = unseen_reason(trace.reader, crossed)
        if unseen is None:
            parts.append(
                "<div class='verdict clean' id='verdict'>clean: the replay found nothing</div>"
            )
        else:  # as replay says it: no clean verdict on what was never seen
            parts.append(
                f"<div class='verdict inconclusive' id='verdict'>inconclusive: "
                f"{html.escape(unseen)}</div>"
            )
    elif unreplayable is not None:
        parts.append(
            f"<div class='verdict inconclusive' id='verdict'>no replay: "
            f"{html.escape(unreplayable)}</div>"
        )
    parts += _run_section(info)
    first_bad = result.first_step if result is not None else None
    parts += [
        "<h2>Timeline</h2>",
        _img(plots.batch_composition(trace, first_bad=first_bad), "batch composition"),
    ]
    parts += _accepted_section(con, trace, unknown)
    if result is not None:
        parts += _findings_section(con, trace, result, crossed, max_findings)
    parts += _reanalysis_section(con, trace, result is not None, unknown)
    parts.append(
        f"<p style='color:#888'>mgtrace {__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p></body></html>"
    )
    return "\n".join(parts)


def write_report(trace: Trace, output: Path, *, bisect: bool = True) -> Path:
    text = build_report(trace, bisect=bisect)
    trace._fresh()  # nothing written of a trace another process replaced while it was read
    atomic_write(output, lambda fh: fh.write(text.encode()))
    return output


__all__ = ["build_report", "write_report"]
