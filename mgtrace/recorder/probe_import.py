"""Import the field reproducer's probe log and load-generator output as a trace.

The probe log is JSON lines, one event each, every event stamped with ``t`` and ``pid``:
``start`` (async flag, cache mode, the runner's and each builder's reorder threshold),
``reorderfix`` (the runner threshold forced from ``before`` to ``after``), ``swap`` (a step's
InputBatch swaps ``[i1, i2, req1, req2, acc1, acc2]`` and whether the accepted-count copy had
landed, ``early``), ``prefill`` (the Mamba2 prefill region of a step: ``[req, computed,
scheduled]`` per row, the region being the last rows of the batch) and ``tick`` (running
counts of steps that had an event and of early landings). Other events are counted.

The load generator writes one JSON object per request: client index ``i``, the API id
``req_id`` (the engine id minus its last ``-suffix``), token counts, ``finish``, the text and
its own ``garbage`` flag. Corruption follows the field re-analysis: word salad (``garbage``) or
"thousands of tokens that render to nothing" (over 200 tokens, under 2 % of them words).

Probe steps count from 1; trace steps from 0 (``step = probe step - 1``). One rank per
process id, in order of first appearance, and one step per (process id, step): its
``prefill`` rows are taken from that process's first ``prefill`` event of the step (several
builders log the same step). A string no UTF-8 column holds (a JSON lone surrogate escape)
makes its line malformed.

Two differences from the field re-analysis script are deliberate. It keeps the first
``prefill`` event per step number across all processes; that agrees with this for
tensor-parallel logs (every process logs the same steps) but not for processes with
different batches (an engine restart appending to the log, data-parallel ranks), whose steps
are all kept here. And it counts every row of the load generator's file, where a request id
that repeats keeps its first row here and counts the others as malformed
(``duplicate_request``).
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.errors import OutputError, UsageError
from mgtrace.outputs import (
    refuse_a_trace_inside_a_trace,
    refuse_overwriting_inputs,
    require_output_folder,
)
from mgtrace.query.canned import crosstab_sql
from mgtrace.schemas.manifest import Drops, RunMetadata
from mgtrace.schemas.tables import MAMBA_SPLITS, ROW_MOVE_OPS
from mgtrace.schemas.writer import TraceWriter

PREFILL = MAMBA_SPLITS.index("prefill")
SWAP = ROW_MOVE_OPS.index("swap")
WORDS = re.compile(r"[A-Za-z]{2,}")
EMPTY_MIN_TOKENS = 200
EMPTY_WORD_RATE = 0.02
QUEUE_HIGH = 4096
# Run fields a probe log does not carry (manifest source ``run_unknown``).
PROBE_RUN_UNKNOWN = ("num_speculative_tokens", "mamba_block_size")


@dataclass
class ImportReport:
    probe_lines: int = 0
    burst_lines: int = 0
    malformed: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    batch_rows: int = 0
    row_moves: int = 0
    requests: int = 0
    matched_requests: int = 0
    ranks: int = 0

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())


@dataclass
class _Step:
    wall_ns: int | None = None
    num_reqs: int | None = None
    threshold: int | None = None
    landed: bool | None = None
    prefill: list[list[Any]] | None = None
    prefill_num_reqs: int | None = None
    swaps: list[list[Any]] = field(default_factory=list)


class _Malformed(ValueError):
    pass


INT_LIMIT = 2**31  # every count, row, step and threshold of a trace is an int32


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise _Malformed(f"{what} is not an integer")
    if not -INT_LIMIT <= value < INT_LIMIT:
        raise _Malformed(f"{what} {value} is out of range")
    return value


# What a malformed line can raise while it is read and checked: counted, never fatal.
# (json.loads meets RecursionError in deeply nested input; Infinity parses as a float.)
_BAD_LINE = (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError)
WALL_NS_LIMIT = 2**63


def _wall_ns(t: Any) -> int | None:
    """A probe's wall time in seconds as int64 nanoseconds; None when it is not one."""
    if type(t) not in (int, float) or not 0 <= t * 1e9 < WALL_NS_LIMIT:  # also nan, inf
        return None
    return int(t * 1e9)


# JSON can escape a lone surrogate ("\udc80"): Python parses it into a str that no UTF-8
# column holds, so the writer would refuse the whole step or table. Only such an escape
# makes one, so a line without it is not encoded a second time.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _text_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """Numbered lines of a log, as text; None for a line that is not valid UTF-8 (a
    malformed line: replacing its bytes would merge distinct ids into one)."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, None


def _check_unicode(line: str, obj: Any) -> None:
    """Refuse a parsed line whose strings (keys or values) are not valid Unicode."""
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _Malformed("a string holds a lone surrogate escape (not valid Unicode)") from None


def _opt_int(value: Any) -> int | None:
    """An optional integer; anything else (or one no trace column holds) is absent."""
    return value if type(value) is int and -INT_LIMIT <= value < INT_LIMIT else None


def _opt_threshold(value: Any) -> int | None:
    """An optional reorder threshold (a query length: never negative); anything else is
    absent, so that the manifest's run section stays one mgtrace can read back."""
    value = _opt_int(value)
    return value if value is not None and value >= 0 else None


def _strict_json(value: Any) -> Any:
    """``value`` where strict JSON holds it; None where it holds NaN or an infinity, which
    the JSON reader accepts but which would make the manifest (and ``info --json``)
    non-standard JSON."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return None
    return value


def corruption(row: dict[str, Any]) -> tuple[bool, str | None]:
    """(corrupt, marker) by the field re-analysis: salad, or many tokens and almost no words."""
    text = row.get("text") or ""
    tokens = row.get("completion_tokens") or 0
    salad = bool(row.get("garbage"))
    empty = tokens > EMPTY_MIN_TOKENS and len(WORDS.findall(text)) < EMPTY_WORD_RATE * tokens
    parts = ["salad"] if salad else ["empty"] if empty else []
    foreign = row.get("foreign_markers") or []
    if isinstance(foreign, list) and foreign:
        parts.append("foreign:" + ",".join(str(x) for x in foreign))
    return salad or empty, ";".join(parts) or None


class ProbeImporter:
    def __init__(self) -> None:
        self.report = ImportReport()
        self.first_error: dict[str, str] = {}
        self.ranks: dict[Any, int] = {}
        self.steps: dict[tuple[int, int], _Step] = {}
        self.threshold: int | None = None
        self.start: dict[str, Any] | None = None
        self.mamba_threshold: int | None = None
        self.last_tick: dict[str, Any] | None = None
        self.engine_ids: dict[str, str] = {}  # API id -> engine id
        self.req_steps: dict[str, list[int]] = {}

    def malformed(self, kind: str, where: str, why: str) -> None:
        self.report.malformed[kind] = self.report.malformed.get(kind, 0) + 1
        self.first_error.setdefault(kind, f"{where}: {why}")

    # ------------------------------------------------------------ probe log
    def _json_lines(self, path: Path, kind: str) -> Iterator[tuple[str, Any]]:
        """Each non-blank line of ``path`` (counted in the report's ``{kind}s``) parsed as
        JSON that holds valid Unicode, with where it is; one that is not is counted
        malformed as ``kind``."""
        lines = f"{kind}s"
        for lineno, line in _text_lines(path):
            setattr(self.report, lines, getattr(self.report, lines) + 1)
            where = f"{path.name}:{lineno}"
            if line is None:
                self.malformed(kind, where, "not valid UTF-8")
            elif line.strip():
                try:
                    obj = json.loads(line)
                    _check_unicode(line, obj)
                except _BAD_LINE as exc:
                    self.malformed(kind, where, str(exc) or "bad JSON")
                else:
                    yield where, obj

    def read_probe(self, path: Path) -> None:
        for where, ev in self._json_lines(path, "probe_line"):
            try:
                if not isinstance(ev, dict) or not isinstance(ev.get("event"), str):
                    raise _Malformed("not an event object")
                self._event(ev)
                # counted once taken: a malformed line is counted as such, not as an event
                self.report.events[ev["event"]] = self.report.events.get(ev["event"], 0) + 1
            except _BAD_LINE as exc:
                self.malformed("probe_line", where, str(exc) or "bad JSON")

    def _rank(self, ev: dict[str, Any]) -> int:
        pid = ev.get("pid")
        if pid not in self.ranks:
            self.ranks[pid] = len(self.ranks)
        return self.ranks[pid]

    def _step(self, ev: dict[str, Any]) -> _Step:
        step = _int(ev.get("step"), "step") - 1
        if step < 0:
            raise _Malformed("step must be 1 or more")
        rec = self.steps.setdefault((self._rank(ev), step), _Step())
        if rec.wall_ns is None:
            rec.wall_ns = _wall_ns(ev.get("t"))
        rec.threshold = self.threshold
        return rec

    def _event(self, ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "start":
            self.start = ev
            thr = ev.get("runner_reorder_batch_threshold")
            self.threshold = _opt_threshold(thr)
            builders = ev.get("builder_thresholds") or {}
            if isinstance(builders, dict):
                mamba = [
                    v
                    for k, v in builders.items()
                    if "Mamba" in str(k) and _opt_threshold(v) is not None
                ]
                self.mamba_threshold = max(mamba) if mamba else None
        elif kind == "reorderfix":
            self.threshold = _opt_threshold(ev.get("after"))
        elif kind == "tick":
            self.last_tick = {
                k: _strict_json(ev.get(k)) for k in ("step", "steps_with_event", "early_steps")
            }
        elif kind == "swap":
            swaps = ev.get("swaps")
            if not isinstance(swaps, list):
                raise _Malformed("swap event without a swaps list")
            checked = []
            for s in swaps:
                if not isinstance(s, list) or len(s) != 6:
                    raise _Malformed("a swap is [i1, i2, req1, req2, acc1, acc2]")
                checked.append(
                    [_int(s[0], "i1"), _int(s[1], "i2"), s[2], s[3], _opt_int(s[4]), _opt_int(s[5])]
                )
            rec = self._step(ev)
            rec.swaps.extend(checked)
            early = ev.get("early")
            rec.landed = early if isinstance(early, bool) else rec.landed
            rec.num_reqs = _opt_int(ev.get("num_reqs")) or rec.num_reqs
            step = _int(ev["step"], "step") - 1
            for s in checked:
                for rid in (s[2], s[3]):
                    if isinstance(rid, str):
                        self.req_steps.setdefault(rid, []).append(step)
        elif kind == "prefill":
            rows = ev.get("rows")
            if not isinstance(rows, list):
                raise _Malformed("prefill event without a rows list")
            checked = []
            for r in rows:
                if not isinstance(r, list) or len(r) != 3:
                    raise _Malformed("a prefill row is [req, computed, scheduled]")
                checked.append([r[0], _int(r[1], "computed"), _int(r[2], "scheduled")])
            num_reqs = _int(ev.get("num_reqs"), "num_reqs")
            if len(checked) > num_reqs:
                raise _Malformed("more prefill rows than rows in the batch")
            rec = self._step(ev)
            if rec.prefill is None:  # the process's first event of the step wins
                rec.prefill = checked
                rec.prefill_num_reqs = num_reqs
                rec.num_reqs = num_reqs
                step = _int(ev["step"], "step") - 1
                for rid, _c, _n in checked:
                    if isinstance(rid, str):
                        self.req_steps.setdefault(rid, []).append(step)
                        self.engine_ids.setdefault(rid.rsplit("-", 1)[0], rid)
        elif kind.endswith("_failed"):
            self.malformed("probe_reported_failure", kind, str(ev.get("error")))

    # ------------------------------------------------------------ output
    def write_steps(self, writer: TraceWriter) -> None:
        for (rank, step), rec in sorted(self.steps.items()):
            tables: dict[str, Any] = {
                "steps": {
                    "wall_ns": rec.wall_ns,
                    "num_reqs": rec.num_reqs,
                    "reorder_threshold": rec.threshold,
                    "mamba_threshold": self.mamba_threshold,
                    "num_mamba_decodes": None
                    if rec.prefill is None
                    else rec.prefill_num_reqs - len(rec.prefill),
                    "accepted_landed": rec.landed,
                }
            }
            if rec.prefill:
                rows = [r for r in rec.prefill if isinstance(r[0], str)]
                if len(rows) < len(rec.prefill):
                    self.malformed(
                        "prefill_row_without_request",
                        f"step {step + 1}",
                        "the probe logged no request id for a prefill row",
                    )
                first = rec.prefill_num_reqs - len(rec.prefill)
                batch_row = [first + i for i, r in enumerate(rec.prefill) if isinstance(r[0], str)]
                if rows:
                    tables["batch_rows"] = {
                        "batch_row": np.asarray(batch_row, np.int32),
                        "req_id": [r[0] for r in rows],
                        "num_computed": np.asarray([r[1] for r in rows], np.int32),
                        "num_scheduled": np.asarray([r[2] for r in rows], np.int32),
                        "mamba_split": np.full(len(rows), PREFILL, np.int32),
                    }
                    self.report.batch_rows += len(rows)
            if rec.swaps:
                n = len(rec.swaps)
                tables["row_moves"] = {
                    "seq": np.arange(n, dtype=np.int32),
                    "op": np.full(n, SWAP, np.int32),
                    "row_a": np.asarray([s[0] for s in rec.swaps], np.int32),
                    "row_b": np.asarray([s[1] for s in rec.swaps], np.int32),
                    "req_id": [s[2] if isinstance(s[2], str) else None for s in rec.swaps],
                    "req_id_b": [s[3] if isinstance(s[3], str) else None for s in rec.swaps],
                    "accepted_a": [s[4] for s in rec.swaps],
                    "accepted_b": [s[5] for s in rec.swaps],
                    "d2h_landed": rec.landed,
                }
                self.report.row_moves += n
            while writer.stats().queue_depth > QUEUE_HIGH:
                time.sleep(0.005)
            writer.write_step(rank, step, tables)
            self.report.steps += 1

    def read_burst(self, path: Path) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = defaultdict(list)
        rows = []
        for where, row in self._json_lines(path, "burst_line"):
            try:
                if not isinstance(row, dict) or _opt_int(row.get("i")) is None:
                    raise _Malformed("not a request object with an integer i")
                if "text" in row and not isinstance(row["text"], str):
                    raise _Malformed("text is not a string")
                tokens = row.get("completion_tokens")
                if tokens is not None and _opt_int(tokens) is None:
                    raise _Malformed("completion_tokens is not an integer")
                rows.append(row)
            except _BAD_LINE as exc:
                self.malformed("burst_line", where, str(exc) or "bad JSON")
        starts = [r["t_start"] for r in rows if isinstance(r.get("t_start"), (int, float))]
        t0 = min(starts) if starts else 0.0
        seen: set[str] = set()
        for row in rows:
            api_id = row.get("req_id")
            engine_id = self.engine_ids.get(api_id) if isinstance(api_id, str) else None
            req_id = engine_id or (api_id if isinstance(api_id, str) else f"client-{row['i']}")
            if req_id in seen:
                self.malformed("duplicate_request", f"{path.name} i={row['i']}", req_id)
                continue
            seen.add(req_id)
            if engine_id is not None:  # a duplicate dropped above is not counted as matched
                self.report.matched_requests += 1
            has_text = "text" in row
            corrupt, marker = corruption(row) if has_text else (None, None)
            steps = self.req_steps.get(engine_id or "", [])
            t_start = row.get("t_start")
            cols["req_id"].append(req_id)
            cols["arrival_s"].append(t_start - t0 if isinstance(t_start, (int, float)) else None)
            cols["first_step"].append(min(steps) if steps else None)
            cols["last_step"].append(max(steps) if steps else None)
            cols["prompt_len"].append(_opt_int(row.get("prompt_tokens")))
            cols["output_len"].append(_opt_int(row.get("completion_tokens")))
            finish = row.get("finish") if has_text else "abort"
            cols["finish_reason"].append(finish if isinstance(finish, str) else None)
            cols["corrupt"].append(corrupt)
            cols["corruption_marker"].append(marker)
            cols["client_id"].append(str(row["i"]))
        self.report.requests = len(cols.get("req_id", ()))  # [] would insert the key
        return dict(cols)


def import_probe(
    probe: str | Path, burst: str | Path | None, out: str | Path, *, force: bool = False
) -> ImportReport:
    """Convert ``probe`` (and ``burst`` when given) into a trace directory at ``out``."""
    probe = Path(probe)
    burst_path = Path(burst) if burst is not None else None
    for p in (probe, burst_path):
        if p is not None and not p.is_file():
            raise UsageError(f"{p} does not exist or is not a file")
    refuse_overwriting_inputs(Path(out), probe, burst_path)
    require_output_folder(Path(out), str(out))  # before a long log is read
    refuse_a_trace_inside_a_trace(Path(out))
    imp = ProbeImporter()
    try:
        imp.read_probe(probe)
        requests = imp.read_burst(burst_path) if burst_path is not None else None
    except OSError as exc:
        raise UsageError(f"cannot read the probe logs: {exc.strerror or exc}") from None
    if not imp.steps and not imp.report.requests:
        bad = imp.report.malformed_total
        also = "" if burst_path is None else f" and {burst_path} no requests"
        raise UsageError(
            f"{probe} holds no probe events{also} mgtrace can import "
            f"({bad} malformed line{'' if bad == 1 else 's'})"
        )
    start = imp.start or {}
    run = RunMetadata(
        runner="v1",
        mamba_cache_mode=str(start.get("mamba_cache_mode") or "align"),
        async_scheduling=bool(start.get("async")),
        runner_reorder_threshold=_opt_threshold(start.get("runner_reorder_batch_threshold")),
        builder_reorder_thresholds={
            str(k): _opt_threshold(v) for k, v in (start.get("builder_thresholds") or {}).items()
        }
        if isinstance(start.get("builder_thresholds"), dict)
        else {},
    )
    source = {
        "kind": "probe-import",
        "probe": str(probe),
        "burst": None if burst_path is None else str(burst_path),
        "probe_mode": _strict_json(start.get("mode")),
        "step_offset": -1,
        # the probe log carries neither: the manifest's values are RunMetadata's defaults,
        # and info and report show these fields as unknown
        "run_unknown": list(PROBE_RUN_UNKNOWN),
        "events": imp.report.events,
        "last_tick": imp.last_tick,
        "crosstab_sql": crosstab_sql(),
    }
    writer = TraceWriter(out, run=run, source=source, overwrite=force)
    try:
        imp.write_steps(writer)
        if requests:
            writer.write_rows("requests", requests)
        imp.report.ranks = len(imp.ranks)
        for kind, count in imp.report.malformed.items():
            first = imp.first_error[kind]
            for _ in range(count):
                writer.count_error(f"import:{kind}", first)
        writer.update_source(malformed=dict(imp.report.malformed))
        manifest = writer.close(install=False)  # judged before it replaces an old trace
        failed = writer.stats().failed or _refused(manifest.errors, manifest.drops)
    except BaseException:
        writer.discard()
        raise
    if failed is not None:  # never leave a trace that holds less than was imported
        writer.discard()
        left = f"the old trace at {out} was kept" if writer.kept_old else "no trace was left"
        raise OutputError(f"cannot write {out}: {failed}; {left}")
    writer.install()
    return imp.report


def _refused(errors: dict[str, Any], drops: Drops) -> str | None:
    """What the writer left out of the rows the importer handed it, in words; None when
    nothing. The importer counts every line it cannot import before the writer sees it, so
    a refusal here is a value it let through: the trace would hold less than it reports."""
    steps = drops.steps + drops.malformed_steps
    tables = errors.get("malformed_rows", {}).get("count", 0)
    if not steps and not tables:
        return None
    first = errors.get("malformed_step", errors.get("malformed_rows", {})).get("first")
    parts = [f"{steps} step{'' if steps == 1 else 's'}"] if steps else []
    parts += [f"{tables} batch{'' if tables == 1 else 'es'} of request rows"] if tables else []
    return f"the trace writer refused {' and '.join(parts)} ({first or 'no reason given'})"
