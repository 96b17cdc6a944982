"""Replay in segments on several processes: the findings of one process, exactly.

Segments start from placeholders after a pass that rebuilds only the bookkeeping; the
controls show that both halves matter: the pass must equal a real replay's bookkeeping, and
a check that met a placeholder must be judged on the words it stands for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from click.testing import CliRunner

import mgtrace.replayer.loop as loop_module
import mgtrace.replayer.parallel as parallel_module
from mgtrace.cli import cli
from mgtrace.errors import UsageError
from mgtrace.replayer.loop import RankReplay, ReplayResult, load_backend, replay_trace
from mgtrace.replayer.parallel import (
    DEVICE_JOBS,
    PLACEHOLDER_BASE,
    _parent_of,
    auto_jobs,
    replay_rank_in_segments,
    resolve,
    segment_bounds,
)
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace, ranks_of
from mgtrace.schemas.reader import TraceReader
from mgtrace.schemas.tables import SCHED_KINDS
from mgtrace.sim.config import BUG_ASYNC_RACE, BUG_BATCH_ROW, BUG_REORDER, BUG_STALE_ROW
from tests.conftest import assert_one_sentence_error, run_cli
from tests.replay_helpers import RewritingReader, set_root, sim_trace, toggle_trace

pytestmark = pytest.mark.slow

SEGMENTS = {"jobs": 4, "min_segment": 200, "warmup": 16}


@pytest.fixture(scope="module", autouse=True)
def _trace_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    set_root(tmp_path_factory.mktemp("sim"))


def _sequential(
    trace: Path, rank: int, rules: RuleSet, report_from: int | None = None
) -> tuple[list, int]:
    rep = RankReplay(
        RankTrace(TraceReader(trace), rank, RequestIds()), rules, load_backend("reference", "cpu")
    )
    rep.run(report_from=report_from)
    return rep.oracle.findings, sum(v - 1 for v in rep.oracle.repeats.values())


@pytest.mark.parametrize(
    ("bug", "rules"),
    [
        (BUG_REORDER, "as-recorded"),
        (BUG_REORDER, "reorder_threshold=1+k"),
        (BUG_ASYNC_RACE, "as-recorded"),
        (BUG_STALE_ROW, "as-recorded"),
        (BUG_BATCH_ROW, "as-recorded"),
    ],
)
def test_segments_report_what_one_process_reports(bug: str, rules: str) -> None:
    trace = toggle_trace(bug, seed=1, steps=1000)
    rule_set = RuleSet.parse(rules)
    for rank in ranks_of(TraceReader(trace)):
        want, want_repeats = _sequential(trace, rank, rule_set)
        got = replay_rank_in_segments(TraceReader(trace), rank, rule_set, **SEGMENTS)
        assert got.segments == 4
        assert got.findings == want
        assert got.repeats == want_repeats
        # the parent accounts for its time phase by phase, as the workers do
        assert set(got.parent_seconds) == {"load", "start", "wait", "checker", "merge"}
        assert min(got.parent_seconds.values()) >= 0 and got.parent_seconds["wait"] > 0


@pytest.mark.interp
@pytest.mark.parametrize(
    ("bug", "engine"),
    [
        (BUG_STALE_ROW, {"runner": "v1"}),
        (BUG_BATCH_ROW, {"runner": "v2", "pp": 2, "length_scale": 0.05}),
    ],
)
def test_triton_segments_report_what_one_reference_process_reports(bug: str, engine: dict) -> None:
    # Small enough for the interpreter (as test_replay_backends): each worker runs the
    # Triton kernels on a copy of its placeholder pool, verified against it at every flush.
    small = {"max_num_seqs": 8, "scenario": "pairs", "length_scale": 0.02, **engine}
    trace = sim_trace(bug, 0, 120, **small)
    found = 0
    for rank in ranks_of(TraceReader(trace)):
        want, want_repeats = _sequential(trace, rank, RuleSet())
        found += len(want)
        got = replay_rank_in_segments(
            TraceReader(trace), rank, RuleSet(), backend="triton", device="cpu",
            jobs=2, min_segment=40, warmup=8,
        )  # fmt: skip
        assert got.segments == 2
        assert got.checked_here, "control: the later segment met placeholders"
        assert (got.findings, got.repeats) == (want, want_repeats)
    assert found, "control: the injected bug gives the segments something to find"


def _keys(result) -> list[tuple]:
    return [(f.step, f.req_id, f.signature) for f in result.findings]


def test_a_window_reports_the_first_finding_of_each_request_inside_it(tmp_path: Path) -> None:
    """A window's requests that read foreign state are reported even where the whole replay
    first saw them earlier; with --jobs and from a cached checkpoint alike, over the same
    step count."""
    import shutil

    trace = tmp_path / "t"  # the cache goes into the trace: a copy of the shared one
    shutil.copytree(toggle_trace(BUG_STALE_ROW, seed=0, steps=1200), trace)
    full = replay_trace(TraceReader(trace), RuleSet(), checkpoint_every=100)
    a, b = 168, 206
    assert full.first_step < a and not [f for f in full.findings if a <= f.step <= b]
    window = replay_trace(TraceReader(trace), RuleSet(), from_step=a, to_step=b)
    assert window.findings and window.first_step >= a and window.steps == b - a + 1
    keys = [(f.req_id, f.signature) for f in window.findings]
    assert len(keys) == len(set(keys)) and window.repeats > 0
    # past the first segment's end: the merge forgets what came before the window too
    late = 700
    ran: list[int] = []
    cached = replay_trace(TraceReader(trace), RuleSet(), from_step=late, progress=ran.append)
    assert sum(ran) == 1200 - 700  # control: it started after the checkpoint of step 699
    want = _sequential(trace, 0, RuleSet(), report_from=late)
    assert cached.findings == ReplayResult.of(RuleSet(), want[0], 0, [0], 0).findings
    assert cached.repeats == want[1] and cached.steps == 1200 - late
    for first in (a, late):
        got = replay_rank_in_segments(
            TraceReader(trace), 0, RuleSet(), report_from=first, **SEGMENTS
        )
        assert got.segments == 4
        want = _sequential(trace, 0, RuleSet(), report_from=first)
        assert (got.findings, got.repeats, got.steps) == (*want, 1200 - first)
    jobs = replay_trace(TraceReader(trace), RuleSet(), from_step=late, jobs=2)
    assert (_keys(jobs), jobs.repeats, jobs.steps) == (_keys(cached), cached.repeats, 500)


def test_prefix_hits_are_checked_on_the_words_they_stand_for() -> None:
    # mixed: a shared system prompt, whose cached state is read long after it was written
    trace = sim_trace(None, seed=2, steps=1000, scenario="mixed")
    want, _ = _sequential(trace, 0, RuleSet())
    got = replay_rank_in_segments(TraceReader(trace), 0, RuleSet(), **SEGMENTS)
    assert got.checked_here > 0  # reads met placeholders: the substitution was needed
    assert got.findings == want == []
    # control: the same logged checks judged on the placeholders themselves
    wrong = replay_rank_in_segments(TraceReader(trace), 0, RuleSet(), verify=False, **SEGMENTS)
    assert wrong.findings, "placeholders taken for tags must look like foreign state"


def _preempting_trace(runner: str) -> Path:
    """A block pool too small for the batch: requests are preempted and re-added."""
    engine = {"scenario": "mixed", "runner": runner, "k": 3, "max_num_seqs": 32}
    return sim_trace(None, 2, 800, mamba_block_size=16, num_blocks=40, **engine)


def _padded(wrote: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[: len(wrote)] = wrote
    return out


class _GoneAfterReAdd(RewritingReader):
    """A reader whose batch rows lack one re-added request from its re-add on: the replay
    takes back the state the request had written and sees it write none again."""

    def __init__(self, reader: TraceReader) -> None:
        super().__init__(reader)
        sched = reader.table("sched").to_pylist()
        first = next(r for r in sched if r["kind"] == "resumed" and r["step"] < 350)
        self.gone = (first["req_id"], first["step"])

    def rewrite(self, name: str, t: pa.Table) -> pa.Table:
        if name != "batch_rows":
            return t
        req, step = self.gone
        return t.filter(
            pc.invert(
                pc.and_(pc.equal(t.column("req_id"), req), pc.greater_equal(t.column("step"), step))
            )
        )


@pytest.mark.parametrize(
    "trace_of", ["stale-row", "preempting-v1", "preempting-v2", "gone-after-re-add"]
)
def test_skip_to_rebuilds_the_bookkeeping_of_a_real_replay(trace_of: str) -> None:
    if trace_of == "stale-row":
        reader = TraceReader(toggle_trace(BUG_STALE_ROW, seed=0, steps=600))
    elif trace_of == "gone-after-re-add":
        reader = _GoneAfterReAdd(TraceReader(_preempting_trace("v1")))
    else:
        reader = TraceReader(_preempting_trace(trace_of.split("-")[1]))
    rank_trace = RankTrace(reader, 0, RequestIds())
    resumed = np.count_nonzero(rank_trace._sched_kind == SCHED_KINDS.index("resumed"))
    assert trace_of == "stale-row" or resumed, "control: requests are re-added"

    def fresh() -> RankReplay:
        return RankReplay(rank_trace, RuleSet(), load_backend("reference", "cpu"))

    for until in (399, 577):
        real, skipped = fresh(), fresh()
        real.run(until=until)
        assert skipped.skip_to(until) == until
        a, b = real.checkpoint(until), skipped.checkpoint(until)
        assert all(np.array_equal(x, y) for x, y in zip(a.ownership, b.ownership, strict=True))
        for kind in a.tables:
            assert all(
                np.array_equal(x, y) for x, y in zip(a.tables[kind], b.tables[kind], strict=True)
            )
        n = max(len(a.wrote), len(b.wrote))
        assert np.array_equal(_padded(a.wrote, n), _padded(b.wrote, n))
        assert np.count_nonzero(a.wrote), "control: requests have states of their own"
        if trace_of == "gone-after-re-add":  # control: the re-add took its state back
            gone = rank_trace.ids.uid(reader.gone[0])
            assert not _padded(a.wrote, max(n, gone + 1))[gone]
        assert sorted(a.views) == sorted(b.views)
        # control: the tags are what skip_to leaves alone, so they do differ
        assert not np.array_equal(a.pool, b.pool)


def test_resolve_replaces_placeholders_only() -> None:
    base = np.arange(100, 116, dtype=np.int32).view(np.uint8)
    words = np.array([7, PLACEHOLDER_BASE + 3, -1, PLACEHOLDER_BASE + 15], dtype=np.int32)
    assert resolve(words, base).tolist() == [7, 103, -1, 115]
    assert resolve(words, None).tolist() == words.tolist()


def test_segment_bounds_cover_every_step_once() -> None:
    steps = list(range(1000))
    bounds = segment_bounds(steps, jobs=3, min_segment=100)
    covered = [s for a, b in bounds for s in range(a, b + 1)]
    assert covered == steps and len(bounds) == 3
    assert segment_bounds(steps, jobs=8, min_segment=400) == [(0, 512), (513, 999)]
    assert segment_bounds(steps, jobs=3, min_segment=100, skip_cost=0.0) == [
        (0, 332),
        (333, 666),
        (667, 999),
    ]


def test_later_segments_are_shorter_by_their_bookkeeping_pass() -> None:
    """Each worker passes over the steps before its segment first; with that pass at a
    fraction of a replayed step, the workers' total work comes out about equal, where equal
    segments leave the last worker the most."""
    steps, cost = list(range(30000)), 0.07

    def work(bounds: list[tuple[int, int]]) -> list[float]:
        return [cost * a + (b - a + 1) for a, b in bounds]

    balanced = work(segment_bounds(steps, jobs=16, min_segment=512, skip_cost=cost))
    equal = work(segment_bounds(steps, jobs=16, min_segment=512, skip_cost=0.0))
    assert len(balanced) == len(equal) == 16
    assert max(balanced) - min(balanced) < 2
    assert max(equal) > 1.25 * max(balanced)  # control: equal segments are unbalanced
    # a segment never gets shorter than the minimum: fewer of them instead
    short = segment_bounds(list(range(2000)), jobs=16, min_segment=500, skip_cost=0.3)
    assert all(b - a + 1 >= 500 for a, b in short) and len(short) == 2


def test_cli_jobs_prints_the_same_summary(tmp_path: Path) -> None:
    trace = toggle_trace(BUG_REORDER, seed=0, steps=1200)
    one = run_cli("replay", str(trace), "--json", "--no-save", "--jobs", "1")
    many = run_cli("replay", str(trace), "--json", "--no-save", "--jobs", "2")
    default = run_cli("replay", str(trace), "--json", "--no-save")  # one job per core
    assert one.returncode == many.returncode == default.returncode == 1, many.stderr
    drop = ("argv",)
    a, b, c = (json.loads(p.stdout) for p in (one, many, default))
    assert (
        {k: v for k, v in a.items() if k not in drop}
        == {k: v for k, v in b.items() if k not in drop}
        == {k: v for k, v in c.items() if k not in drop}
    )


class _Told(Exception):
    """Raised by a stand-in replay with the jobs it was given."""


def _jobs_the_cli_passes(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    def told(*_a: object, jobs: int, **_k: object) -> None:
        raise _Told(jobs)

    monkeypatch.setattr(loop_module, "replay_trace", told)
    result = CliRunner().invoke(cli, ["replay", *args, "--no-save"])
    assert isinstance(result.exception, _Told), result.output
    return result.exception.args[0]


@pytest.fixture
def three_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this machine has, a replay not told --jobs sees three cores."""
    monkeypatch.setattr(parallel_module, "default_jobs", lambda: 3)


def test_a_triton_replay_not_told_jobs_takes_at_most_a_few_contexts_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(parallel_module, "default_jobs", lambda: 64)
    long = toggle_trace(BUG_REORDER, 0, 1200)
    given = {"layout": "compact", "from_step": None, "to_step": None, "checkpoint_every": None}
    given["rules"] = RuleSet().canonical()
    assert auto_jobs(TraceReader(long), None, backend="reference", **given) == 64
    assert auto_jobs(TraceReader(long), None, backend="triton", **given) == DEVICE_JOBS


def test_a_replay_not_told_jobs_takes_a_core_each_for_a_long_whole_trace(three_cores) -> None:
    long, short = toggle_trace(BUG_REORDER, 0, 1200), toggle_trace(BUG_REORDER, 1, 1000)

    def auto(trace: Path, **options: object) -> int:
        given = {"backend": "reference", "layout": "compact", "from_step": None}
        given |= {"to_step": None, "checkpoint_every": None, "rules": RuleSet().canonical()}
        given |= options
        return auto_jobs(TraceReader(trace), None, **given)  # type: ignore[arg-type]

    assert auto(long) == 3 and auto(long, to_step=1100) == 3
    assert auto(long, backend="triton") == 3
    # too short for two segments of MIN_SEGMENT steps, whole or cut by --to-step
    assert auto(short) == 1 and auto(long, to_step=1000) == 1
    # what segments cannot replay, or a replay that caches checkpoints
    assert auto(long, layout="full") == 1 and auto(long, checkpoint_every=256) == 1
    # a trace that starts mid-run (a minimized repro's start state) or is not on disk
    for other in (_StartsMidRun, _InMemory, RewritingReader):
        got = auto_jobs(
            other(TraceReader(long)),
            None,
            backend="reference",
            layout="compact",
            rules=RuleSet().canonical(),
            from_step=None,
            to_step=None,
            checkpoint_every=None,
        )
        assert got == (3 if other is RewritingReader else 1), other


def test_a_window_splits_unless_a_cached_checkpoint_starts_it_close_by(
    tmp_path: Path, three_cores
) -> None:
    long = tmp_path / "long.trace"
    shutil.copytree(toggle_trace(BUG_REORDER, 0, 1200), long)

    def auto(rules: RuleSet, **options: object) -> int:
        given = {"backend": "reference", "layout": "compact", "to_step": None}
        given |= {"checkpoint_every": None, "rules": rules.canonical(), **options}
        return auto_jobs(TraceReader(long), None, **given)  # type: ignore[arg-type]

    # nothing cached: every step before the window is replayed anyway, in segments
    assert auto(RuleSet(), from_step=900) == 3
    assert auto(RuleSet(), from_step=900, to_step=1000) == 1  # too short to split
    replay_trace(TraceReader(long), RuleSet(), to_step=700, checkpoint_every=256)
    assert auto(RuleSet(), from_step=900) == 1  # the checkpoint of step 511 starts it
    assert auto(RuleSet(), from_step=400) == 1  # that of step 255
    assert auto(RuleSet(), from_step=200) == 3  # none is before it
    # checkpoints of other rules start no replay under these
    assert auto(RuleSet().with_(reorder_threshold="1+k"), from_step=900) == 3
    # and the whole CLI reports the same window either way
    window = ("replay", str(long), "--from-step", "100", "--no-save", "--json")
    split, alone = run_cli(*window), run_cli(*window, "--jobs", "1")
    assert split.returncode == alone.returncode == 1
    assert _summary(split.stdout) == _summary(alone.stdout)


def _summary(stdout: str) -> dict:
    summary = json.loads(stdout)
    summary.pop("argv", None)
    return summary


class _StartsMidRun(RewritingReader):
    start_state = "the state a minimized repro starts from"


class _InMemory(RewritingReader):
    path = None


def test_the_cli_asks_for_the_automatic_jobs_only_when_not_told(
    monkeypatch: pytest.MonkeyPatch, three_cores
) -> None:
    long, short = toggle_trace(BUG_REORDER, 0, 1200), toggle_trace(BUG_REORDER, 1, 1000)
    assert _jobs_the_cli_passes(monkeypatch, str(long)) == 3
    assert _jobs_the_cli_passes(monkeypatch, str(short)) == 1
    assert _jobs_the_cli_passes(monkeypatch, str(long), "--backend", "triton") == 3
    assert _jobs_the_cli_passes(monkeypatch, str(long), "--jobs", "1") == 1
    assert _jobs_the_cli_passes(monkeypatch, str(short), "--jobs", "2") == 2
    assert _jobs_the_cli_passes(monkeypatch, str(short), "--jobs", "0") == 3


def test_jobs_refuse_tags_they_cannot_split() -> None:
    trace = toggle_trace(BUG_REORDER, seed=0, steps=1200)
    # tags moved on the device only: no host pool to hold placeholders
    with pytest.raises(UsageError, match="on the host"):
        replay_trace(TraceReader(trace), RuleSet(), backend="triton", jobs=2, mirror=False)
    proc = run_cli("replay", str(trace), "--jobs", "2", "--backend", "triton", "--layout", "full")
    assert "compact tag layout" in assert_one_sentence_error(proc, 2)
    # the reference backend on a GPU: refused as it is without --jobs, not run on the CPU
    for jobs in ("1", "2"):
        proc = run_cli("replay", str(trace), "--no-save", "--jobs", jobs, "--device", "cuda")
        assert "runs on the CPU" in assert_one_sentence_error(proc, 2)


def test_a_trace_too_short_to_split_replays_in_this_process() -> None:
    trace = toggle_trace(BUG_REORDER, seed=1, steps=1000)
    want, want_repeats = _sequential(trace, 0, RuleSet())
    got = replay_rank_in_segments(TraceReader(trace), 0, RuleSet(), jobs=4, min_segment=5000)
    assert got.segments == 1 and not got.worker_seconds  # no worker was started
    assert (got.findings, got.repeats) == (want, want_repeats)


def _sleep_long() -> None:
    import time

    time.sleep(120)


def _pool_with_a_busy_worker():
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
    pool.submit(_sleep_long)
    procs = list(pool._processes.values())
    assert procs and all(p.is_alive() for p in procs)
    return pool, procs


def _runs(pid: int) -> bool:
    """Whether the process still runs: it exists and is not a zombie. Asked of the system,
    not of ``Process.is_alive``: the executor's own thread may reap a killed worker first,
    and the ``Process`` object then never learns its exit code."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _ended(procs: list, timeout_s: float) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while any(_runs(p.pid) for p in procs):
        if time.monotonic() > deadline:
            return False
        for p in procs:
            p.join(0.1)
    return True


def test_an_interrupted_replay_ends_its_workers_without_waiting_for_them() -> None:
    import signal

    from mgtrace.replayer.parallel import _stop_workers

    # a host program's SIGTERM handler, which forked workers inherit (a SIGTERM kept them
    # alive, as a full test run showed)
    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    try:
        pool, procs = _pool_with_a_busy_worker()
    finally:
        signal.signal(signal.SIGTERM, previous)
    _stop_workers(pool)
    # the worker sleeps 120 s: ended within 60, it was killed, not left to finish (a loaded
    # machine once took more than 10 s to reap it)
    assert _ended(procs, 60), [(p.pid, p.exitcode) for p in procs]


def test_control_a_plain_shutdown_leaves_the_worker_running() -> None:
    pool, procs = _pool_with_a_busy_worker()
    pool.shutdown(wait=False, cancel_futures=True)  # what the pool offers without terminating
    assert not _ended(procs, 1)
    assert all(_runs(p.pid) for p in procs)
    for p in procs:  # clean up
        p.terminate()
        p.join(10)


def _children(pid: int) -> list[int]:
    procs = (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
    return [p for p in procs if _parent_of(p) == pid]


def _sigterm_is_default(pid: int) -> bool:
    """Whether the process no longer catches SIGTERM (its SigCgt mask in /proc)."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return not caught & (1 << (signal.SIGTERM - 1))


def _workers(pid: int, backend: str) -> list[int]:
    """A replay's workers: its children where it forks them; with the Triton backend (torch
    imported) the children of its fork server."""
    kids = _children(pid)
    if backend == "reference":
        return kids
    # forked from the server, they share its command line; others (a program an import runs
    # at the server's start) do not
    return [g for k in kids for g in _children(k) if _cmdline(g) == _cmdline(k)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pipes(pid: int) -> set[str]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                out.add(os.readlink(fd))
    return out


def _started(worker: int, backend: str) -> bool:
    """Whether a worker has asked to die with its parent. A forked worker's SIGTERM handler
    is the default again once it has (it comes last); a fork server's worker has the
    default from the start, and has let go of the fork server's liveness pipe once it has:
    the pipe whose read end the fork server was started with (its second argument)."""
    if not _runs(worker) or not _sigterm_is_default(worker):
        return False
    if backend == "reference":
        return True
    server = _parent_of(worker)
    try:
        alive_fd = re.search(r"main\(\d+, (\d+)", _cmdline(server).decode()).group(1)
        alive = os.readlink(f"/proc/{server}/fd/{alive_fd}")
        return alive not in _pipes(worker) and _runs(worker)  # not gone in between
    except (OSError, AttributeError):
        return False


@pytest.fixture(params=["reference", "triton"])
def replay_with_stopped_workers(request):
    """A real `mgtrace replay --jobs 2` whose two workers have started and are held
    (SIGSTOP), so that none can finish before the test acts; every process it started is
    killed at the end. Its workers are forked by the replay (reference backend) or by a fork
    server (Triton, interpreted on the CPU)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    trace = toggle_trace(BUG_REORDER, seed=0, steps=1200)
    cmd = [sys.executable, "-m", "mgtrace", "replay", str(trace), "--no-save", "--jobs", "2"]
    cmd += ["--backend", request.param]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        # a worker stopped before its start-up asked to die with its parent would outlive
        # it: wait until both have (and a short-lived process an import started is gone)
        while len(kids) < 2:
            assert proc.poll() is None, "the replay ended before both workers started"
            assert time.monotonic() < deadline, "the workers did not start up"
            kids = [k for k in _workers(proc.pid, request.param) if _started(k, request.param)]
            time.sleep(0.01)
        for kid in kids:
            os.kill(kid, signal.SIGSTOP)
        yield proc, kids
    finally:
        for pid in (proc.pid, *_children(proc.pid), *kids):
            if _runs(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _gone(pids: list[int]) -> bool:
    import time

    deadline = time.monotonic() + 60  # only a bound on waiting for the kernel to reap them
    while any(_runs(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_runs(p) for p in pids)


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_terminated_replay_stops_its_workers(replay_with_stopped_workers, name, code) -> None:
    """The workers end with the replay, which does not leave them holding its stdout (a
    reader of the pipe would wait for ever), and it exits as a process killed by the signal."""
    import signal
    import subprocess

    proc, kids = replay_with_stopped_workers
    proc.send_signal(getattr(signal, name))
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the replay's output stayed open: its workers hold it")
    assert proc.returncode == code and "Traceback" not in err, err
    assert err.strip() == f"mgtrace: stopped by {name}", err  # as any command says it
    assert _gone(kids)


def test_a_killed_replay_takes_its_workers_with_it(replay_with_stopped_workers) -> None:
    import signal

    proc, kids = replay_with_stopped_workers
    proc.kill()
    proc.wait(60)
    assert proc.returncode == -signal.SIGKILL
    assert _gone(kids), "the workers outlived their parent"


def test_a_worker_killed_from_outside_is_one_sentence(replay_with_stopped_workers) -> None:
    import os
    import signal
    import subprocess

    proc, kids = replay_with_stopped_workers
    os.kill(kids[0], signal.SIGKILL)  # what the OOM killer does
    out, err = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert "a replay worker was killed" in assert_one_sentence_error(done, 2)
    assert _gone(kids)


_SIGNAL_WHILE_A_THREAD_STARTS = """
import os, signal, sys, threading
from mgtrace.cli import main
real = threading._start_new_thread
def start_then_signal(*args, **kwargs):
    ident = real(*args, **kwargs)
    if threading.current_thread() is threading.main_thread():
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
    return ident
threading._start_new_thread = start_then_signal
sys.exit(main(["replay", sys.argv[1], "--no-save", "--jobs", "2"]))
"""


def test_a_signal_while_the_pool_starts_a_thread_is_one_sentence() -> None:
    """The pool starts a thread as it takes the first segment. A SIGTERM handled inside
    ``Thread.start``, just after the thread began, raised there: the threading module then
    dropped the thread from its books, and the thread's own bookkeeping failed with a
    traceback (KeyError) at exit. The signal now waits until the pool has started."""
    import subprocess
    import sys

    from tests.conftest import REPO

    trace = toggle_trace(BUG_REORDER, seed=0, steps=1200)
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_A_THREAD_STARTS, str(trace)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "mgtrace: stopped by SIGTERM", proc.stderr
