"""One rank replayed in segments on several processes, with the findings of one process.

Only the oracle looks at tag contents. The forward model writes tags computed from the batch
alone and the kernels move tag bytes verbatim, both as the launches and block tables say.
So a segment can run before the state it starts from is known:

1. Its exact part (block tables, block ownership, which requests have a state of their own,
   the recent row views) comes from a pass over the earlier steps that runs no kernel and
   checks nothing (``RankReplay.skip_to``).
2. The tag pool starts as placeholders: word ``i`` holds ``PLACEHOLDER_BASE + i``, a value
   no tag takes. The ``warmup`` steps before the segment are replayed, findings thrown away.
   From then on every word holds either a tag or the placeholder of the word whose value at
   the start it carries.

A segment's checks that meet no placeholder judge exactly what the sequential replay judges.
A check that meets one is logged unchecked, with the words it gathered, and so is every
finding, in order. Each segment also hands back its pool where the next segment's warm-up
starts, in placeholders; here, in step order, substituting one into the other gives the
exact pool every segment's placeholders name (one gather each), the logged checks run on
the words their placeholders stand for, and the findings, first occurrence per (request,
signature), are merged as one oracle would have reported them.

Segments run on a compact tag pool: placeholders must stay whole int32 words, in host
memory. The Triton backend runs there on a device copy of that pool (``mirror.py``), which
gets the same placeholders; each worker then holds its own context on the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc

from mgtrace.errors import MgtraceError, UsageError
from mgtrace.replayer.findings import Finding
from mgtrace.replayer.loop import RankReplay, load_backend
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace, complete_steps, first_left_out
from mgtrace.replayer.tags import TagPool
from mgtrace.schemas.reader import TraceReader
from mgtrace.termination import Terminated

PLACEHOLDER_BASE = -(2**31)  # word i of a segment's start pool: PLACEHOLDER_BASE + i
PLACEHOLDER_BELOW = -(2**30)  # no uid, token count, position or step is this negative
DEFAULT_WARMUP = 64  # steps replayed before a segment, findings discarded
MIN_SEGMENT = 512  # shorter segments spend more on start-up and warm-up than they save
# A step of the bookkeeping pass a worker makes up to its segment, against a replayed step
# (~27 against ~550 us on a 2-core VM, clean traces)
SKIP_COST = 0.05
# Processes a Triton replay takes when not told: each holds its own context on the one GPU,
# and more than 8 add nothing (on an H200 host 8 replayed 20,000 steps 2.8 times as fast as
# one process, 16 only 2.6 times: benchmarks/results/h200-1e31c16/; on H100 hosts the
# segments of 8 and of 16 took as long, and 4 and 8 ran 2.67 and 2.91 times as fast as one:
# benchmarks/results/h100-1cc2b8f/, h100-d40ccaf-sharing/)
DEVICE_JOBS = 8


def default_jobs() -> int:
    """One process per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def auto_jobs(
    reader: TraceReader,
    ranks: list[int] | None,
    *,
    backend: str,
    layout: str,
    rules: str,
    from_step: int | None,
    to_step: int | None,
    checkpoint_every: int | None,
) -> int:
    """How many processes a replay that was not told ``--jobs`` uses: one per core where
    segments can replay it and it is long enough to split (two segments), at most
    ``DEVICE_JOBS`` with the Triton backend; else one.

    A window (``from_step``) that a checkpoint cached under ``rules`` starts close to stays
    in one process; one without such a checkpoint replays every step before it anyway, so
    it is split as the trace up to its end would be. A checkpointed replay stays in one
    process, and so do a trace that starts mid-run (its start state is one process's) and
    one held only in memory."""
    from mgtrace.replayer.checkpoint import start_state

    if (
        layout != "compact"
        or checkpoint_every
        or getattr(reader, "path", None) is None
        or start_state(reader) is not None
        or (from_step and _window_has_checkpoints(reader, ranks, rules, layout, from_step))
    ):
        return 1
    steps = longest_rank_steps(reader, ranks)
    if to_step is not None:
        steps = min(steps, to_step + 1)
    if steps < 2 * MIN_SEGMENT:
        return 1
    if backend != "reference":  # each process holds a context on the one device
        return min(default_jobs(), DEVICE_JOBS)
    return default_jobs()


def _window_has_checkpoints(
    reader: TraceReader, ranks: list[int] | None, rules: str, layout: str, from_step: int
) -> bool:
    """Whether the replay cache holds, for every rank replayed, a checkpoint taken before
    ``from_step`` under these rules and layout (by name only: none is read)."""
    from mgtrace.replayer.checkpoint import cache_dir, cached_before
    from mgtrace.replayer.steps import ranks_of

    directory = cache_dir(reader, rules, layout)
    chosen = ranks_of(reader) if ranks is None else ranks
    return all(cached_before(directory, rank, from_step) for rank in chosen)


def longest_rank_steps(reader: TraceReader, ranks: list[int] | None) -> int:
    """Rows of the ``steps`` table of the longest rank among ``ranks`` (all: None), from the
    parts' row counts (nothing is read)."""
    per_rank: Counter[int | None] = Counter()
    for part in reader.parts:
        if part.table == "steps" and (ranks is None or part.rank is None or part.rank in ranks):
            per_rank[part.rank] += part.rows
    return max(per_rank.values(), default=0)


@dataclass
class SegmentResult:
    first: int
    last: int  # the last step replayed
    events: list[tuple]  # the oracle's log: ("report", key, finding) | ("check", ...)
    counts: dict[Hashable, int]  # report attempts per key, the first one included
    handoff: np.ndarray | None  # the pool where the next warm-up starts, in placeholders
    base: int | None  # the placeholders name the pool after this step (None: exact)
    seconds: dict[str, float]  # where the worker's time went: load, skip, warmup, segment


@dataclass
class RankOutcome:
    findings: list[Finding]
    repeats: int
    steps: int
    segments: int
    checked_here: int  # reads that met a placeholder, checked once their words were known
    worker_seconds: list[dict[str, float]] = field(default_factory=list)
    merge_s: float = 0.0
    # where this process's time went: loading the trace, starting the workers, waiting for
    # their results (the wait the load overlaps where workers do not fork), building the
    # checker of their logged reads, and merging
    parent_seconds: dict[str, float] = field(default_factory=dict)


def segment_bounds(
    steps: list[int], jobs: int, min_segment: int = MIN_SEGMENT, skip_cost: float = SKIP_COST
) -> list[tuple[int, int]]:
    """Split ``steps`` into at most ``jobs`` runs of at least ``min_segment`` steps (the
    first and last step of each), so that every worker ends about together: a worker first
    passes over the steps before its run at ``skip_cost`` of a replayed step each, so each
    run is shorter than the one before by that share of its start (lengths T, T(1-c),
    T(1-c)^2, ...)."""
    if not steps:
        return []
    count = max(1, min(jobs, len(steps) // max(min_segment, 1)))
    while True:
        shares = (1.0 - skip_cost) ** np.arange(count)
        cuts = np.rint(np.concatenate([[0.0], np.cumsum(shares)]) / shares.sum() * len(steps))
        cuts = cuts.astype(int)
        if count == 1 or np.diff(cuts).min() >= min_segment:
            break
        count -= 1
    return [(steps[a], steps[b - 1]) for a, b in itertools.pairwise(cuts.tolist()) if b > a]


def resolve(words: np.ndarray, base: np.ndarray | None) -> np.ndarray:
    """``words`` (int32, or pool bytes) with every placeholder replaced by the word it names
    in ``base`` (pool bytes); a copy."""
    out = words.copy()
    if base is None:
        return out
    ints = out.view(np.int32)
    named = ints < PLACEHOLDER_BELOW
    ints[named] = base.view(np.int32)[ints[named].astype(np.int64) - PLACEHOLDER_BASE]
    return out


def _rank_trace(reader: TraceReader, rank: int, to_step: int | None = None) -> RankTrace:
    # A fresh RequestIds per rank, and one bound for every process: each numbers this rank's
    # requests alike, so the placeholders' words and the logged reads mean the same
    # everywhere; findings name requests, never uids.
    return RankTrace(reader, rank, RequestIds(), to_step=to_step)


def _rank_replay(
    trace: RankTrace, rules: RuleSet, layout: str, backend: str = "reference", device: str = "cpu"
) -> RankReplay:
    return RankReplay(trace, rules, load_backend(backend, device), layout, device)


# The rank trace a forked worker inherits from the parent, instead of loading it again (the
# parent loads it anyway, for the checks it judges itself).
_INHERITED: dict[tuple[str, int], RankTrace] = {}


# What a fork server imports once for every worker it forks, where this process has
# imported torch: importing them is most of a spawned worker's start (seconds, and sixteen
# at once contend). Only imports: a process that has touched the GPU cannot fork a worker
# that uses it.
FORKSERVER_PRELOAD = ["numpy", "pyarrow", "torch", "triton", "mgtrace.replayer.loop"]


def _pool_context() -> multiprocessing.context.BaseContext:
    """fork, so that workers inherit the loaded trace, where this process has not imported
    torch (whose thread pools and CUDA state do not survive a fork); else a fork server
    that has imported the heavy modules, or spawn where there is none."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and "torch" not in sys.modules:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


def _named_key(rep: RankReplay, key: tuple[int, str]) -> Hashable:
    uid, signature = key
    return (uid if uid <= 0 else rep.trace.ids.name(uid), signature)


def _finish(
    rep: RankReplay,
    first: int,
    last: int,
    handoff_after: int | None,
    base: int | None,
    seconds: dict[str, float],
    report_from: int | None = None,
) -> SegmentResult:
    t0 = time.perf_counter()
    handoff = None
    done = first - 1
    if handoff_after is not None:
        done = rep.run(start=first, until=handoff_after, report_from=report_from)
        handoff = rep.pool.snapshot()
    if done < last:
        done = rep.run(start=done + 1, until=last, report_from=report_from)
    o = rep.oracle
    events = [("report", _named_key(rep, e[1]), e[2]) if e[0] == "report" else e for e in o.events]
    counts = {_named_key(rep, k): n for k, n in o.repeats.items()}
    seconds["segment"] = time.perf_counter() - t0
    return SegmentResult(first, done, events, counts, handoff, base, seconds)


@dataclass(frozen=True)
class _Job:
    """What a worker process needs to open the trace and replay under the rules."""

    path: str
    skip_bad_parts: bool
    rank: int
    rules: str
    layout: str
    backend: str = "reference"
    device: str = "cpu"
    to_step: int | None = None  # the last step any segment replays: no later row is loaded

    def replay(self) -> RankReplay:
        trace = _INHERITED.get((self.path, self.rank))
        if trace is None:
            reader = TraceReader(self.path, skip_bad_parts=self.skip_bad_parts)
            trace = _rank_trace(reader, self.rank, self.to_step)
        return _rank_replay(
            trace, RuleSet.parse(self.rules), self.layout, self.backend, self.device
        )


def speculate(
    job: _Job,
    first: int,
    last: int,
    warmup: int,
    handoff_after: int | None,
    report_from: int | None = None,
) -> SegmentResult:
    """In a worker: steps ``first..last`` from a placeholder start ``warmup`` steps earlier
    (exactly from step 0 when that reaches it), handing back the pool after
    ``handoff_after``; what it logged before step ``report_from`` is forgotten there."""
    clock = [time.perf_counter()]
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        now = time.perf_counter()
        seconds[name] = now - clock[0]
        clock[0] = now

    rep = job.replay()
    lap("load")
    base = None
    if first > 0:
        start = max(first - warmup, 0)
        if start > 0:
            rep.skip_to(start - 1)
            rep.pool.name_words(PLACEHOLDER_BASE)
            base = start - 1
        lap("skip")
        rep.run(start=start, until=first - 1)
        lap("warmup")
    rep.oracle.start_log(PLACEHOLDER_BELOW if base is not None else None)
    return _finish(rep, first, last, handoff_after, base, seconds, report_from)


def replay_rank_in_segments(
    reader: TraceReader,
    rank: int,
    rules: RuleSet,
    *,
    jobs: int,
    layout: str = "compact",
    backend: str = "reference",
    device: str = "cpu",
    until: int | None = None,
    report_from: int | None = None,
    warmup: int = DEFAULT_WARMUP,
    min_segment: int = MIN_SEGMENT,
    progress: Callable[[int], None] | None = None,
    verify: bool = True,
) -> RankOutcome:
    """Replay one rank on up to ``jobs`` processes, reporting from step ``report_from`` on
    as ``RankReplay.run`` does. ``verify=False`` takes a logged check's placeholders for tags
    as they are: only for showing that the substitution matters."""
    path = getattr(reader, "path", None)
    if path is None:
        raise UsageError("a replay in segments needs a trace on disk")
    if layout != "compact":
        raise UsageError("a replay in segments runs on the compact tag layout")
    steps = [s for s in sorted(set(step_numbers(reader, rank)[0])) if until is None or s <= until]
    if not steps:
        return RankOutcome([], 0, 0, 0, 0)
    bounds = segment_bounds(steps, jobs, min_segment)
    reported = sum(1 for s in steps if report_from is None or s >= report_from)
    # a hand-off point must lie inside the segment before
    warmup = min(warmup, *(steps.index(b) - steps.index(a) for a, b in bounds))
    job = _Job(
        str(path),
        bool(getattr(reader, "skipped", None)),
        rank,
        rules.canonical(),
        layout,
        backend,
        device,
        until,
    )
    firsts = [a for a, _ in bounds]
    handoffs = [max(a - warmup, 0) - 1 for a in firsts[1:]] + [None]
    if len(TagPool(reader.manifest.run, layout=layout).pool.view(np.int32)) > (
        PLACEHOLDER_BELOW - PLACEHOLDER_BASE
    ):
        raise UsageError("the tag pool has more words than placeholders; drop --jobs")
    if len(bounds) == 1:  # too short to split: no process to start
        trace = _rank_trace(reader, rank, until)
        _INHERITED[(job.path, rank)] = trace
        try:
            results = [speculate(job, *bounds[0], warmup, None, report_from)]
        finally:
            _INHERITED.clear()
        if progress is not None:
            progress(len(steps))
        return _merge(_rank_replay(trace, rules, layout), results, reported, verify, report_from)
    context = _pool_context()
    pool = ProcessPoolExecutor(
        max_workers=len(bounds),
        mp_context=context,
        initializer=_worker_start,
        initargs=(os.getpid(),),
    )
    parent: dict[str, float] = {}
    with _stopped_by_signals() as stop:
        results, trace = _run_pool(
            parent,
            pool,
            job,
            lambda: _rank_trace(reader, rank, until),
            context.get_start_method() == "fork",
            bounds,
            handoffs,
            warmup,
            report_from,
            steps,
            progress,
            stop,
        )
    t0 = time.perf_counter()
    checker = _rank_replay(trace, rules, layout)  # judges the reads the workers logged
    t1 = time.perf_counter()
    outcome = _merge(checker, results, reported, verify, report_from)
    outcome.merge_s = time.perf_counter() - t1
    outcome.worker_seconds = [r.seconds for r in results]
    outcome.parent_seconds = {**parent, "checker": t1 - t0, "merge": outcome.merge_s}
    return outcome


def _run_pool(
    seconds: dict[str, float],
    pool: ProcessPoolExecutor,
    job: _Job,
    load: Callable[[], RankTrace],
    inherit: bool,
    bounds: list[tuple[int, int]],
    handoffs: list[int | None],
    warmup: int,
    report_from: int | None,
    steps: list[int],
    progress: Callable[[int], None] | None,
    stop: _SignalStop,
) -> tuple[list[SegmentResult], RankTrace]:
    """Every segment on the pool's workers, in order, and the rank's trace from ``load``:
    before the workers start where they ``inherit`` it (fork), else while they run. The
    pool ends with it, whatever happens. ``seconds`` gets the time spent loading, starting
    the workers and waiting for them."""
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[phase] = seconds.get(phase, 0.0) + now - clock
        clock = now

    try:
        trace = load() if inherit else None
        lap("load")
        if trace is not None:
            _INHERITED[(job.path, job.rank)] = trace  # the workers fork on the first submit
        try:
            with stop.held(), warnings.catch_warnings():
                # a fork of this process, which has threads: the workers run numpy and Python
                warnings.simplefilter("ignore", DeprecationWarning)
                futures = [
                    pool.submit(speculate, job, a, b, warmup, h, report_from)
                    for (a, b), h in zip(bounds, handoffs, strict=True)
                ]
        finally:
            _INHERITED.clear()
        lap("start")
        if trace is None:
            trace = load()
            lap("load")
        results = []
        for future in futures:
            results.append(future.result())
            if progress is not None:
                res = results[-1]
                progress(sum(1 for s in steps if res.first <= s <= res.last))
        pool.shutdown()
        lap("wait")
    except BrokenProcessPool as exc:
        _stop_workers(pool)
        raise MgtraceError(
            "a replay worker was killed (out of memory?); retry with fewer --jobs"
        ) from exc
    except BaseException:
        _stop_workers(pool)  # Ctrl-C, SIGTERM or a failed segment: the others' work is moot
        raise
    return results, trace


# Signals that end a replay the way Ctrl-C does, when the pool's processes exist.
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _SignalStop:
    """While the workers run, SIGTERM and SIGHUP raise ``Terminated`` in this process (the
    main thread's handlers only), so that the workers are stopped before it exits, with 128
    + the signal's number as a shell reports a process killed by it. Inside ``held()`` (the
    pool starting its threads) a signal only waits: raised inside ``Thread.start`` it would
    leave the threading module's bookkeeping half done, and a traceback at exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.holding = False

    def handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:  # a second signal must not cut the stopping short
            return
        self.signum = signum
        if not self.holding:
            self.raise_it()

    def raise_it(self) -> None:
        assert self.signum is not None
        raise Terminated(self.signum)  # said and exited as any command stopped by it

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.signum is not None:
            self.raise_it()


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[_SignalStop]:
    """Install a ``_SignalStop`` for the block; the previous handlers come back after."""
    stop = _SignalStop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handle) for s in _STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _worker_start(parent: int) -> None:
    """In a worker, first: take SIGTERM and SIGHUP as a plain process does (a fork inherits
    the parent's handlers, which are for the parent), and on Linux die with the parent, which
    cannot stop its workers when it is SIGKILLed. A fork server's worker dies with the fork
    server, which exits when the replay does. The handlers go last: once they are the
    defaults again (``SigCgt`` in /proc), the worker dies with its parent."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        direct = os.getppid()
        if direct != parent:  # a fork server's worker, or the parent died before the request
            if _parent_of(direct) != parent:
                os._exit(1)
            _let_the_fork_server_go()
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


def _let_the_fork_server_go() -> None:
    """Close a fork server's worker's copy of the pipe whose end tells the fork server that
    its clients are gone: held here, the fork server would outlive a killed replay, waiting
    for this worker, which waits for the fork server to die."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            return int(fh.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the pool now: a shutdown waits for every running segment to finish. SIGKILL, not
    SIGTERM: a forked worker inherits its parent's signal handlers, and a SIGTERM handler
    there (a host program's) would keep it running; a worker holds nothing to clean up. The
    executor keeps its processes private; 3.14 adds ``kill_workers`` for this."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        proc.kill()
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    if manager is not None and manager.ident is not None:  # started
        # It notices the killed workers and closes its wake-up pipe; left running, it races
        # the interpreter's exit hook that writes to that pipe (a traceback at exit).
        manager.join(timeout=30)


def step_numbers(reader: TraceReader, rank: int) -> tuple[list[int], int | None]:
    """The rank's replayable steps, from the steps table alone (a rank trace loads every
    table), and the first step a left-out part held rows of (None: none)."""
    steps = reader.table("steps")
    mine = steps.filter(pc.equal(steps.column("rank"), rank)).column("step")
    numbers = mine.to_numpy(zero_copy_only=False).astype(np.int64)
    whole = complete_steps(reader, rank, numbers)
    return sorted(numbers[whole].tolist()), first_left_out(numbers, whole)


def _merge(
    checker: RankReplay,
    results: list[SegmentResult],
    steps: int,
    verify: bool,
    report_from: int | None = None,
) -> RankOutcome:
    """The segments' logs in step order: logged checks run on known words, the first
    report attempt of each key kept. A segment that ends before ``report_from`` reports
    nothing (the one holding that step forgot its earlier log there)."""
    oracle = checker.oracle
    oracle.start_log(None)
    findings: list[Finding] = []
    counts: Counter[Hashable] = Counter()
    checked = 0
    exact_base: np.ndarray | None = None  # the exact pool the placeholders of results[i] name

    def keep_first(key: Hashable, finding: Finding) -> None:
        if key not in counts:
            findings.append(finding)
            counts[key] = 0

    for i, res in enumerate(results):
        if i and res.base is not None:
            exact_base = resolve(results[i - 1].handoff, exact_base)
        else:
            exact_base = None
        if report_from is not None and res.last < report_from:
            continue  # its handoff still serves the next segment
        for event in res.events:
            if event[0] == "report":
                keep_first(event[1], event[2])
                continue
            _, step, read, tags, inside = event
            checked += 1
            oracle.events = []
            oracle.check_logged(step, read, resolve(tags, exact_base) if verify else tags, inside)
            for _, key, f in oracle.events:
                keep_first(_named_key(checker, key), f)
        counts.update(res.counts)
    counts.update({_named_key(checker, k): n for k, n in oracle.repeats.items()})
    repeats = sum(counts.values()) - len(counts)
    return RankOutcome(findings, repeats, steps, len(results), checked)
