"""The step loop: client -> scheduler -> runner(s) -> trace, with async and PP result timing.

Results of a step reach the scheduler after a lag: at once with synchronous scheduling, one
step later with async scheduling (the next step is scheduled on optimistic counts), pp_size - 1
steps later with a synchronous pipeline, where a request waits for its result before it is
scheduled again, and pp_size steps later with V2's async pipeline, where a request decodes
every pp_size steps on optimistic counts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from mgtrace.errors import OutputError, UsageError, reason
from mgtrace.schemas.manifest import Manifest
from mgtrace.schemas.writer import TraceWriter
from mgtrace.sim.bugs import GroundTruth
from mgtrace.sim.columns import COMPACT_COLUMNS
from mgtrace.sim.config import SimConfig
from mgtrace.sim.runner_common import Nullable
from mgtrace.sim.runner_v1 import RunnerV1
from mgtrace.sim.runner_v2 import RunnerV2
from mgtrace.sim.scheduler import Request, SchedOut, Scheduler
from mgtrace.sim.to_trace import request_rows, run_metadata, sched_rows, source_info
from mgtrace.sim.trace_buffer import StepBuffer
from mgtrace.sim.workload import Client, step_seconds

ProgressFn = Callable[[int], None]
QUEUE_HIGH_WATER = 2048  # steps queued in the writer before the loop waits for it
STEPS_PER_WRITE = 64  # steps buffered per rank and table before one bulk hand-over
RUNS_AHEAD = 4096  # sampling rows whose accepted-draft runs are drawn at once


@dataclass
class StepView:
    """What tests and benchmarks may observe of a step while the run goes on."""

    so: SchedOut
    accepted: np.ndarray  # per scheduled position
    results: list  # StepResult per rank
    scheduler: Scheduler
    runner: RunnerV1 | RunnerV2


@dataclass
class Engine:
    cfg: SimConfig
    scheduler: Scheduler = field(init=False)
    runner: RunnerV1 | RunnerV2 = field(init=False)
    client: Client = field(init=False)
    truth: GroundTruth = field(init=False)
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.scheduler = Scheduler(cfg)
        self.runner = RunnerV1(cfg) if cfg.runner == "v1" else RunnerV2(cfg)
        self.client = Client(cfg)
        self.truth = GroundTruth(cfg)
        self.rng_accept = np.random.default_rng([cfg.seed, 0xACC])
        self._runs = np.zeros(0, np.int64)  # accepted-draft runs drawn ahead (_accepted_run)
        self._runs_at = 0
        self.rng_timing = np.random.default_rng([cfg.seed, 0xD2D])
        self.now = 0.0
        self.lag = cfg.steps_in_flight
        self.in_flight: deque[tuple[int, SchedOut, np.ndarray]] = deque()

    def _accept(self, so: SchedOut) -> np.ndarray:
        """Accepted tokens per scheduled position: 1 + the run of accepted drafts for rows
        that sample, 1 for the rest (what the kernels read for a non-final chunk)."""
        m = len(so)
        if m and np.count_nonzero(so.samples) == m:  # the common step: every row samples
            return np.minimum(self._accepted_run(m), so.num_draft) + 1
        acc = np.ones(m, np.int64)
        rows = so.samples.nonzero()[0]
        if len(rows):
            acc[rows] = 1 + np.minimum(self._accepted_run(len(rows)), so.num_draft[rows])
        return acc

    def _accepted_run(self, rows: int) -> np.ndarray:
        """Per sampling row, the run of accepted drafts from the first (before the cut at the
        row's draft count): the first rejected draft, found as the first False of the
        acceptance draws with a False column appended (k when all k are accepted).

        Each row takes the next k draws of the acceptance stream, so the runs of many rows
        are drawn ahead in one go (the same draws as a call per step, fewer numpy calls)."""
        start = self._runs_at
        if start + rows > len(self._runs):
            self._runs = np.concatenate((self._runs[start:], self._draw_runs(rows)))
            start = 0
        self._runs_at = start + rows
        return self._runs[start : start + rows]

    def _draw_runs(self, rows: int) -> np.ndarray:
        """The accepted-draft runs of the next ``max(rows, RUNS_AHEAD)`` sampling rows."""
        rows = max(rows, RUNS_AHEAD)
        k = max(self.cfg.k, 1)
        ok = np.zeros((rows, k + 1), bool)
        np.less(self.rng_accept.random((rows, k)), self.cfg.acceptance_rate, out=ok[:, :k])
        return ok.argmin(axis=1)

    def _owners(self) -> dict[int, str]:
        owners: dict[int, str] = {}
        for req, row in self.scheduler.alloc.rows.items():
            for b in row:
                if b:
                    owners.setdefault(b, req)
        return owners

    def step(self, step: int) -> StepView:
        cfg = self.cfg
        for a in self.client.poll(self.now):
            self.requests.append(self.scheduler.new_request(f"req-{len(self.requests):06d}", a))
        so = self.scheduler.schedule(step)
        accepted = self._accept(so)
        landed_early = bool(self.rng_timing.random() < cfg.d2h_early_prob)
        results = self.runner.execute(so, accepted, landed_early, self._owners)
        if not isinstance(results, list):
            self.truth.add(results.events)
            # V1's pipeline stages run each batch on one per-slot state, with no post-process
            # to defer (no drafts under PP): every rank records the same rows
            results = [results] * cfg.pp
        else:
            for res in results:
                self.truth.add(res.events)
        self.in_flight.append((step, so, accepted))
        while self.in_flight and self.in_flight[0][0] <= step - self.lag:
            _, done, acc = self.in_flight.popleft()
            for req in self.scheduler.apply_results(done, acc):
                self.client.finished(req.group)
        self.now += step_seconds(so.total_tokens, len(so))
        return StepView(
            so=so,
            accepted=accepted,
            results=results,
            scheduler=self.scheduler,
            runner=self.runner,
        )


def _for_writer(columns: dict[str, Any]) -> dict[str, Any]:
    """A chunk in the writer's forms: a Nullable column as a masked array, the compact
    columns as lists."""
    return {
        k: v.masked() if type(v) is Nullable else v.tolist() if type(v) in COMPACT_COLUMNS else v
        for k, v in columns.items()
    }


def _write_step(writer: TraceWriter, step: int, view: StepView) -> None:
    """Hand one step to the writer as it is (the reference for the bulk path)."""
    sched = sched_rows(view.so)
    for rank, res in enumerate(view.results):
        tables = {name: _for_writer(cols) for name, cols in res.tables.items()}
        if sched:
            tables["sched"] = _for_writer(sched[0])
        writer.write_step(rank, step, tables)
        for chunk in sched[1:]:
            writer.write_step(rank, step, {"sched": _for_writer(chunk)})
        for chunk in res.launches:
            writer.write_step(rank, step, {"launches": _for_writer(chunk)})


def _buffer_step(buf: StepBuffer, step: int, view: StepView) -> None:
    """The chunks ``_write_step`` would write, in the same order, into the bulk buffer."""
    sched = sched_rows(view.so)
    for rank, res in enumerate(view.results):
        for name, columns in res.tables.items():
            buf.add(rank, step, name, columns)
        for chunk in sched:
            buf.add(rank, step, "sched", chunk)
        for chunk in res.launches:
            buf.add(rank, step, "launches", chunk)
    buf.end_step()


def _wait_for_writer(writer: TraceWriter, high_water: int) -> None:
    while writer.stats().queue_depth > high_water:
        time.sleep(0.002)


def simulate(
    cfg: SimConfig,
    *,
    progress: ProgressFn | None = None,
    observe: Callable[[int, StepView], None] | None = None,
    argv: list[str] | None = None,
    steps_per_write: int = STEPS_PER_WRITE,
) -> Manifest:
    """Run the simulator for ``cfg.steps`` steps and write the trace to ``cfg.output``.

    Steps go to the writer in bulk, ``steps_per_write`` at a time per rank; 0 hands them over
    one by one (``write_step``), the reference the bulk path is tested against.
    """
    cfg.validate()
    if cfg.output is None:
        raise UsageError("the simulator needs an output trace path (-o TRACE)")
    engine = Engine(cfg)
    run = run_metadata(cfg, engine.runner.builder_thresholds, engine.runner.reorder_threshold)
    writer = TraceWriter(
        Path(cfg.output),
        run=run,
        source=source_info(cfg, argv),
        overwrite=cfg.overwrite,
        announce_failure=False,  # said once, by the error that ends the run
    )
    buf = StepBuffer(writer, steps_per_write) if steps_per_write > 0 else None
    # a bulk queue item holds steps_per_write steps: bound the steps queued, not the items
    high_water = max(1, QUEUE_HIGH_WATER // steps_per_write) if buf else QUEUE_HIGH_WATER
    step = 0
    try:
        for step in range(cfg.steps):
            view = engine.step(step)
            if buf is not None:
                _buffer_step(buf, step, view)
            else:
                _write_step(writer, step, view)
            if observe is not None:
                observe(step, view)
            if step % 64 == 63:
                _wait_for_writer(writer, high_water)
                if writer.failure is not None:  # the disk said no: simulating on is waste
                    break
                if progress is not None:
                    progress(64)
        if progress is not None and cfg.steps % 64:
            progress(cfg.steps % 64)
        if buf is not None:
            buf.flush()
        writer.write_rows("requests", request_rows(engine.requests))
        writer.set_ground_truth(engine.truth.to_dict())
        writer.update_source(
            num_requests=len(engine.requests),
            requests_finished=sum(r.status == "finished" for r in engine.requests),
        )
    except (OSError, OutputError) as exc:
        _discard(writer, cfg, exc)
    except BaseException:
        # an interrupted run keeps the steps it wrote, the requests it had (the manifest
        # counts them) and says where it stopped
        if buf is not None:
            buf.flush()
        writer.write_rows("requests", request_rows(engine.requests))
        writer.update_source(interrupted_at_step=step, num_requests=len(engine.requests))
        writer.count_error("interrupted", f"the simulation stopped at step {step} of {cfg.steps}")
        writer.set_ground_truth(engine.truth.to_dict())
        writer.close(complete=False)  # a replay must call it inconclusive, never clean
        raise
    try:
        manifest = writer.close()
    except (OSError, OutputError) as exc:
        _discard(writer, cfg, exc)
    if writer.failure is not None:  # the writer's thread met the disk's refusal
        _discard(writer, cfg, writer.failure)
    return manifest


def _discard(writer: TraceWriter, cfg: SimConfig, why: Exception | str) -> NoReturn:
    """The disk said no: a simulated trace is made again at will, and part of one is of no
    use, so none is left behind (an old trace it was to replace stays)."""
    building = str(writer.path)  # a hidden sibling while an old trace is being replaced
    writer.discard()
    old = f"the old trace at {cfg.output} was kept" if writer.kept_old else None
    if isinstance(why, OutputError):
        said = why.message.replace(building, str(cfg.output))  # gone now: named where it went
        if said.endswith(" was kept"):  # the writer said so itself
            raise OutputError(said) from None
        raise OutputError(f"{said}; {old or f'nothing of {cfg.output} was kept'}") from None
    if isinstance(why, Exception):
        why = reason(why)
    raise OutputError(f"cannot write {cfg.output}: {why}; {old or 'nothing was kept'}") from None


def run_engine(cfg: SimConfig, observe: Callable[[int, StepView], None]) -> Engine:
    """Run without writing a trace (tests): ``observe`` sees every step."""
    cfg.validate()
    engine = Engine(cfg)
    for step in range(cfg.steps):
        observe(step, engine.step(step))
    return engine
