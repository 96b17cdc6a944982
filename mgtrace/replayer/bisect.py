"""`mgtrace bisect`: the first bad step, the rule change that makes it good, and the commands.

1. The recorded replay runs with checkpoints and stops at its first finding: step F. It
   loads the trace's first steps only, and more (eight times as many each time) as it gets
   past them clean, going on from where it stopped: a bug early in a long trace is found
   without reading the rest of it.
2. Every single rule change from the registry is a candidate. A rule changes nothing before
   the first step where its inputs differ from the recorded ones (``first_divergence``), so
   its replay starts from the recorded checkpoint just before that step, not from step 0,
   and runs to F plus a horizon. The rule "fixes" F when that stretch is clean.
3. When no single rule fixes F, pairs of the rules that had an effect are tried and ranked.

A verdict is given only when the trace supports one: a gap (dropped steps) before F, or a
clean replay of a trace with drops or an incomplete recording, is inconclusive (exit 125).
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.atomic import is_a_stream
from mgtrace.errors import (
    EXIT_CLEAN,
    EXIT_CORRUPTION,
    EXIT_INCONCLUSIVE,
    MgtraceError,
    UsageError,
)
from mgtrace.opened_traces import refuse_if_replaced
from mgtrace.outputs import require_output_folder
from mgtrace.replayer import checkpoint as ckpt
from mgtrace.replayer.coverage import unseen_reason
from mgtrace.replayer.divergence import first_divergence
from mgtrace.replayer.findings import FOREIGN_BLOCK_WRITE, FOREIGN_STATE, Finding
from mgtrace.replayer.loop import Checkpoint, RankReplay, load_backend, resumed
from mgtrace.replayer.requests import is_request, named_writer
from mgtrace.replayer.rules import RuleSet, single_changes
from mgtrace.replayer.steps import (
    FIRST_LOAD,
    LOAD_GROWTH,
    RankTrace,
    load_bound,
    rank_step_numbers,
    ranks_of,
    require_replayable,
    some_ranks,
)
from mgtrace.schemas.manifest import MANIFEST_NAME
from mgtrace.schemas.ranks import rank_directories
from mgtrace.schemas.reader import TraceReader
from mgtrace.shell import path_arg

LOG_FORMAT = "mgtrace-bisect"
DEFAULT_HORIZON = 32
CHECKPOINT_EVERY = 128
PROGRESS_EVERY = 256  # replayed steps between two progress reports


@dataclass
class Probe:
    """One replay bisect ran: which rules, which steps, what it found first."""

    rules: str
    rank: int
    from_step: int
    to_step: int
    first_finding_step: int | None
    clean: bool
    note: str = ""
    steps: int = 0  # steps this probe replayed (0 when the rule changes nothing before F)


@dataclass
class Verdict:
    status: str  # bad | clean | inconclusive
    trace: str
    base_rules: str
    reason: str = ""
    first_step: int | None = None
    rank: int | None = None
    ranks: list[int] | None = None  # the ranks bisected, when not every one
    requests: list[str] = field(default_factory=list)
    first_findings: list[dict[str, Any]] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)  # single rule changes that make F clean
    explanations: list[str] = field(default_factory=list)  # multi-rule, ranked
    commands: dict[str, str] = field(default_factory=dict)
    horizon: int = DEFAULT_HORIZON
    # the last step the rule changes were replayed through: a rule clean there may still
    # meet another bug later (a trace with several)
    checked_through: int | None = None
    probes: list[Probe] = field(default_factory=list)
    steps_replayed: int = 0
    wall_s: float = 0.0

    @property
    def exit_code(self) -> int:
        return {"bad": EXIT_CORRUPTION, "clean": EXIT_CLEAN}.get(self.status, EXIT_INCONCLUSIVE)

    def sentence(self) -> str:
        if self.status == "inconclusive":
            return f"inconclusive: {self.reason}"
        if self.status == "clean":
            # of a run's ranks only those asked for (--rank) were replayed: the verdict says
            # so, as the replay's does, since the others may well be corrupt
            on = ""
            if self.ranks:
                listed = ", ".join(map(str, self.ranks))
                on = f" on rank{'s' if len(self.ranks) > 1 else ''} {listed}"
            return f"clean: no request reads state that is not its own{on} under {self.base_rules}"
        lead = self.first_findings[0] if self.first_findings else {}
        what = _describe(lead)
        through = (
            f" through step {self.checked_through}" if self.checked_through is not None else ""
        )
        fix = (
            f"clean under {' '.join(RuleSet.parse(self.fixes[0]).as_flags())}{through}"
            if self.fixes
            else "no single rule change makes it clean"
        )
        if not self.fixes and self.explanations:
            merged = " ".join(RuleSet.parse(self.explanations[0]).as_flags())
            fix += f"; clean under {merged}{through}"
        return f"corruption starts at step {self.first_step}: {what}; {fix}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = LOG_FORMAT
        data["verdict"] = self.sentence()
        return data


def _describe(f: dict[str, Any]) -> str:
    if not f:
        return "a finding"
    if f["kind"] == FOREIGN_STATE and f.get("writer_req_id"):
        at = f" at step {f['writer_step']}" if f.get("writer_step") is not None else ""
        writer = named_writer(f["writer_req_id"])
        return f"request {f['req_id']} reads state written by {writer}{at}"
    if f["kind"] == FOREIGN_BLOCK_WRITE:
        return f"{named_writer(f['writer_req_id'])} writes a block of request {f['req_id']}"
    return f["detail"]


def _finding_dict(f: Finding) -> dict[str, Any]:
    return {
        "kind": f.kind,
        "signature": f.signature,
        "req_id": f.req_id,
        "writer_req_id": f.writer_req_id,
        "writer_step": f.writer_step,
        "batch_row": f.batch_row,
        "detail": f.detail,
    }


class Bisector:
    def __init__(
        self,
        trace_path: Path,
        *,
        base: RuleSet | None = None,
        backend: str = "reference",
        device: str = "cpu",
        horizon: int = DEFAULT_HORIZON,
        every: int = CHECKPOINT_EVERY,
        skip_bad_parts: bool = False,
        ranks: Sequence[int] | None = None,
        first_load: int = FIRST_LOAD,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """``progress`` is told, in a few words, what the bisection does now: loading,
        replaying (every ``PROGRESS_EVERY`` steps), trying a rule."""
        self.path = Path(trace_path)
        self.progress = progress
        self.reader = TraceReader(self.path, skip_bad_parts=skip_bad_parts)
        self.skip_bad_parts = skip_bad_parts
        require_replayable(self.reader)
        self.ranks = some_ranks(self.reader, ranks, self.path)
        all_ranks = ranks_of(self.reader)
        self.several_ranks = len(all_ranks) > 1
        self.base = base or RuleSet()
        self.backend_name = backend
        self.device = device
        self.backend = load_backend(backend, device)
        self.horizon = horizon
        self.every = every
        self.first_load = first_load
        # a minimized repro starts from the replay state its earlier steps left
        self.ids, self.start = ckpt.request_ids_for(self.reader)
        chosen = self.ranks if self.ranks is not None else all_ranks
        self.step_numbers = {r: rank_step_numbers(self.reader, r) for r in chosen}
        self.traces = {r: self._load(r, first_load) for r in chosen}

    def _say(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what)

    def _on_rank(self, rank: int) -> str:
        return f" rank {rank}" if self.several_ranks else ""

    def _load(self, rank: int, steps: int) -> RankTrace:
        """Rank ``rank`` loaded through its first ``steps`` recorded steps (``load_bound``),
        at least four horizons."""
        numbers = self.step_numbers[rank]
        bound = load_bound(numbers, max(steps, 4 * self.horizon))
        held = len(numbers) if bound is None else int(np.searchsorted(numbers, bound, "right"))
        self._say(f"loading{self._on_rank(rank)}: {held:,} of {len(numbers):,} steps")
        trace = RankTrace(self.reader, rank, self.ids, to_step=bound)
        # the steps are in memory from here on: refused if they may mix two traces
        refuse_if_replaced([self.reader], "the bisection")
        return trace

    def _replay(self, trace: RankTrace, rules: RuleSet) -> tuple[RankReplay, int]:
        """A replay of one rank under ``rules``, at the trace's start, and its first step."""
        rep = RankReplay(trace, rules, self.backend, device=self.device)
        return rep, ckpt.start_from(rep, self.start)

    def run(self) -> Verdict:
        t0 = time.perf_counter()
        v = Verdict(
            status="clean",
            trace=str(self.path),
            base_rules=self.base.canonical(),
            horizon=self.horizon,
            ranks=self.ranks,
        )
        gaps = {r: t.hole for r, t in self.traces.items()}
        checkpoints: dict[int, dict[int, Checkpoint]] = {}
        firsts: dict[int, int] = {}
        replays: dict[int, RankReplay] = {}
        for rank in list(self.traces):
            # A later rank only matters if it goes bad before the earliest finding so far;
            # no rank's replay crosses its first gap (a finding past it would be the gap's)
            ends = [min(firsts.values()) - 1] if firsts else []
            if gaps[rank] is not None:
                ends.append(gaps[rank] - 1)
            until = min(ends) if ends else None
            if until is not None and until < 0:
                continue  # the rank's first step is missing: nothing of it can be replayed
            rep, last, done, cps = self._recorded_replay(rank, until)
            v.steps_replayed += done
            first = rep.oracle.findings[0].step if rep.oracle.findings else None
            v.probes.append(
                Probe(
                    self.base.canonical(),
                    rank,
                    0,
                    last,
                    first,
                    first is None,
                    "recorded rules",
                    steps=done,
                )
            )
            checkpoints[rank], replays[rank] = cps, rep
            if first is not None:
                firsts[rank] = first
        first = min(firsts.values()) if firsts else None
        # a rank whose gap comes first may have gone bad in what the trace lacks
        gapped = [
            (g, r) for r, g in gaps.items() if g is not None and (first is None or g <= first)
        ]
        if gapped:
            gap, gap_rank = min(gapped)
            before = f"the first finding at step {first}" if first is not None else "any finding"
            v.status = "inconclusive"
            what = (
                f"rank {gap_rank} has a gap at step {gap} (dropped, unrecorded or left-out steps)"
            )
            v.reason = (
                f"{what} before {before}; the shadow state cannot be rebuilt across it, and "
                "corruption may lie in what is missing"
                if gap or v.steps_replayed  # another rank's steps were replayed
                else f"{what}: no step could be replayed, so nothing can be said about the run"
            )
            v.wall_s = time.perf_counter() - t0
            return v
        if first is None:
            reason = unseen_reason(self.reader)
            if reason is not None:
                v.status, v.reason = "inconclusive", reason
            v.wall_s = time.perf_counter() - t0
            return v
        rank = min(r for r, f in firsts.items() if f == first)
        gap = gaps[rank]
        v.status, v.first_step, v.rank = "bad", first, rank
        lead = [f for f in replays[rank].oracle.findings if f.step == first]
        # in the order replay and minimize list them (step, rank, batch row), not the
        # oracle's, so all three name the same first finding
        lead.sort(key=lambda f: f.batch_row if f.batch_row is not None else -1)
        v.first_findings = [_finding_dict(f) for f in lead]
        v.requests = sorted(
            {f.req_id for f in lead}
            | {
                f.writer_req_id
                for f in lead
                if f.kind == FOREIGN_BLOCK_WRITE and is_request(f.writer_req_id)
            }
        )
        trace = self.traces[rank]
        # a horizon past the trace's end would name a --to-step the trace does not have, and
        # one across a gap would judge the rules by what the gap did
        end = min(first + self.horizon, int(trace.step_numbers.max()))
        if gap is not None:
            end = min(end, gap - 1)
        v.checked_through = end
        delays: dict[str, int] = {}
        candidates = list(single_changes(self.base, trace.run.num_speculative_tokens))
        for i, cand in enumerate(candidates, 1):
            self._say(f"trying {' '.join(cand.as_flags())} ({i} of {len(candidates)})")
            probe = self._probe(trace, checkpoints[rank], cand, end, first)
            v.probes.append(probe)
            v.steps_replayed += probe.steps
            if probe.clean:
                v.fixes.append(cand.canonical())
            elif probe.note != "no effect":
                delays[cand.canonical()] = probe.first_finding_step or first
        if not v.fixes and len(delays) >= 2:
            ranked = sorted(delays, key=lambda c: -delays[c])
            for a, b in itertools.combinations(ranked, 2):
                merged = RuleSet.parse(a).with_(**RuleSet.parse(b).changed())
                self._say(f"trying {' '.join(merged.as_flags())}")
                probe = self._probe(trace, checkpoints[rank], merged, end, first)
                v.probes.append(probe)
                v.steps_replayed += probe.steps
                if probe.clean:
                    v.explanations.append(merged.canonical())
        v.commands = self._commands(v, end)
        v.wall_s = time.perf_counter() - t0
        return v

    def _recorded_replay(
        self, rank: int, until: int | None
    ) -> tuple[RankReplay, int, int, dict[int, Checkpoint]]:
        """The replay of ``rank`` under the base rules through ``until``, stopped after its
        first finding: the replay, its last step, the steps it replayed and its checkpoints.

        While a load does not hold the rank's last step, the replay stops a horizon before
        the load's last (a finding there has the steps its probes replay loaded); clean to
        there, it loads more and goes on from where it stopped, in a replay of the larger
        load that starts from the state the smaller one left (both number requests with
        ``self.ids``, so the state means the same in either)."""
        trace = self.traces[rank]
        rep, start = self._replay(trace, self.base)
        cps: dict[int, Checkpoint] = {}
        # each load is LOAD_GROWTH times the one before, which holds at least four horizons
        done, steps = 0, max(self.first_load, 4 * self.horizon)
        total, shown = len(self.step_numbers[rank]), [0]

        def replayed(n: int) -> None:
            shown[0] += n
            if shown[0] % PROGRESS_EVERY == 0:
                self._say(f"replaying{self._on_rank(rank)}: {shown[0]:,} of {total:,} steps")

        while True:
            stop = until
            if trace.to_step is not None:
                inside = trace.to_step - self.horizon
                stop = inside if stop is None else min(stop, inside)
            last = rep.run(
                start=start,
                until=stop,
                stop_on_finding=True,
                checkpoints=cps,
                every=self.every,
                progress=None if self.progress is None else replayed,
            )
            numbers = trace.step_numbers
            done += int(np.count_nonzero((numbers >= start) & (numbers <= last)))
            if rep.oracle.findings or trace.to_step is None or stop == until:
                return rep, last, done, cps
            state, unknown = rep.checkpoint(last), rep.oracle.unwritten_unknown
            del rep, trace, self.traces[rank]  # their rows go before the larger load comes in
            steps *= LOAD_GROWTH
            trace = self.traces[rank] = self._load(rank, steps)
            rep = resumed(trace, self.base, self.backend, self.device, state, unknown)
            start = last + 1
            cps[start] = state  # a checkpoint is the state before the step it is keyed by

    def _probe(
        self, trace: RankTrace, cps: dict[int, Checkpoint], rules: RuleSet, end: int, first: int
    ) -> Probe:
        start = first_divergence(trace, rules, until=first)
        if start is None:
            return Probe(rules.canonical(), trace.rank, first, first, first, False, "no effect")
        rep, begin = self._replay(trace, rules)
        usable = [s for s in cps if s <= start]
        if usable:
            begin = max(usable)
            rep.restore(cps[begin])
        last = rep.run(start=begin, until=end, stop_on_finding=True)
        found = rep.oracle.findings[0].step if rep.oracle.findings else None
        return Probe(
            rules.canonical(),
            trace.rank,
            begin,
            last,
            found,
            found is None,
            f"diverges at step {start}",
            steps=max(0, last - begin + 1),
        )

    def _commands(self, v: Verdict, end: int) -> dict[str, str]:
        """The exact replays that show the bad side and, when there is one, the good side."""

        def cmd(rules: RuleSet, to_step: int) -> str:
            # of several ranks, the one that goes bad first shows it alone
            rank = [f"--rank={v.rank}"] if self.several_ranks else []
            # --no-save: running them to look must not add their findings to the trace a
            # second time (the saved findings would then hold duplicates)
            parts = [
                "mgtrace",
                "replay",
                path_arg(self.path),
                "--no-save",
                *rank,
                *rules.as_flags(),
                f"--to-step={to_step}",
                # the trace is read as bisect read it: without, a damaged part stops it
                *(["--skip-bad-parts"] if self.skip_bad_parts else []),
            ]
            if self.backend_name != "reference":
                parts += [f"--backend={self.backend_name}", f"--device={self.device}"]
            return " ".join(shlex.quote(p) for p in parts)

        out = {"bad": cmd(self.base, end)}
        good = v.fixes[0] if v.fixes else (v.explanations[0] if v.explanations else None)
        if good is not None:
            out["good"] = cmd(self.base.with_(**RuleSet.parse(good).changed()), end)
        return out


def bisect(trace: Path, **kwargs: Any) -> Verdict:
    return Bisector(trace, **kwargs).run()


def check_log_path(path: Path, trace: Path) -> None:
    """Refuse a log path that would overwrite what is not a bisect log: inside a trace (the
    one bisected or any other) only ``TRACE/bisect.json`` is the log's place, and an
    existing file must be a bisect log. A device, a FIFO or ``/dev/stdout`` takes it as
    it comes."""
    if is_a_stream(Path(path)):
        return
    log = Path(path).resolve()
    holders = [p for p in log.parents if p == Path(trace).resolve() or _is_trace(p)]
    if holders:
        outer = holders[-1]  # a rank directory's trace is the folder that holds it
        if log != outer / "bisect.json":
            raise UsageError(
                f"{path} lies inside the trace {outer}; a bisect log there is "
                f"{outer / 'bisect.json'}, or write it outside"
            )
    if log.is_dir():
        raise UsageError(f"{path} is a directory; give the bisect log a file name")
    if log.exists() and not _is_bisect_log(log):
        raise UsageError(f"{path} exists and is not a bisect log; refusing to overwrite it")
    # as sql, report and history -o: a folder that cannot hold it is refused, none is made
    require_output_folder(log, f"the bisect log {path}")


def _is_trace(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file() or bool(rank_directories(path))


def _is_bisect_log(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == LOG_FORMAT


def save_log(v: Verdict, path: Path, *, skip_bad_parts: bool = False) -> None:
    from mgtrace.schemas.manifest import write_json_atomic

    check_log_path(path, Path(v.trace))
    data = v.to_json()
    data["skip_bad_parts"] = skip_bad_parts  # the re-check reads the trace the same way
    # the trace as seen from the log, so the log re-checks from any directory, and after
    # the trace and its log (it sits inside by default) move together; a log written to a
    # stream lands wherever that leads, so it names the trace's absolute path
    where = Path(v.trace).resolve()
    if not is_a_stream(Path(path)):
        where = Path(os.path.relpath(where, Path(path).resolve().parent))
    data["trace_from_log"] = str(where)
    write_json_atomic(path, data)


def _logged_trace(log: Path, data: dict[str, Any]) -> Path:
    """The trace a log names: beside the log as recorded there, else as given when run."""
    relative = data.get("trace_from_log")
    if isinstance(relative, str):
        beside = Path(log).resolve().parent / relative
        # a trace, not merely a directory: a log copied out of its trace names "."
        if (beside / MANIFEST_NAME).is_file() or rank_directories(beside):
            return beside
    return Path(data["trace"])


def _check_types(v: Verdict) -> None:
    """The fields a re-check uses, of the types a log holds them in (TypeError if not)."""

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    ok = (
        isinstance(v.status, str)
        and isinstance(v.trace, str)
        and isinstance(v.base_rules, str)
        and is_int(v.horizon)
        and v.horizon >= 1
        and (v.first_step is None or is_int(v.first_step))
        and isinstance(v.requests, list)
        and isinstance(v.fixes, list)
        and isinstance(v.explanations, list)
        and isinstance(v.first_findings, list)
        and all(isinstance(f, dict) for f in v.first_findings)
        and (v.ranks is None or (isinstance(v.ranks, list) and all(map(is_int, v.ranks))))
    )
    if not ok:
        raise TypeError("a field holds a value of the wrong type")


MAX_LOG_BYTES = 64 << 20  # a bisect log holds a verdict and its probes: kilobytes


def recheck_log(path: Path, **kwargs: Any) -> tuple[bool, Verdict, Verdict]:
    """Run the bisect again on the trace a log names; True when the verdict still holds."""
    try:
        # read no more than a log can hold: /dev/zero or a huge file is no log, and reading
        # it whole would exhaust memory (an internal error, MemoryError)
        with open(path, "rb") as fh:
            raw = fh.read(MAX_LOG_BYTES + 1)
    except OSError as exc:
        raise MgtraceError(f"cannot read the bisect log {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_LOG_BYTES:
        raise MgtraceError(
            f"{path} is not an mgtrace bisect log (more than {MAX_LOG_BYTES >> 20} MiB)"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        # RecursionError: JSON nested deeper than Python's decoder goes
        raise MgtraceError(f"{path} is not an mgtrace bisect log (not JSON)") from None
    if not isinstance(data, dict) or data.get("format") != LOG_FORMAT:
        raise MgtraceError(f"{path} is not an mgtrace bisect log")
    try:
        old = Verdict(**{k: data[k] for k in Verdict.__dataclass_fields__ if k in data})
        old.probes = [Probe(**p) for p in data.get("probes", [])]
        _check_types(old)
        trace = _logged_trace(Path(path), data)
        base = RuleSet.parse(old.base_rules)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise MgtraceError(
            f"{path} is a damaged bisect log ({exc.__class__.__name__}: {exc})"
        ) from None
    kwargs["skip_bad_parts"] = kwargs.get("skip_bad_parts") or bool(data.get("skip_bad_parts"))
    new = bisect(trace, base=base, horizon=old.horizon, ranks=old.ranks, **kwargs)
    same = (
        new.status == old.status
        and new.first_step == old.first_step
        and new.requests == old.requests
        and new.fixes == old.fixes
    )
    return same, old, new
