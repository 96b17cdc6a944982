"""The step loop: client -> scheduler -> runner(s) -> trace, with async and PP result timing.

Results of a step reach the scheduler after a lag: at once with synchronous scheduling, one
step later with async scheduling (the next step is scheduled on optimistic counts), and
pp_size - 1 steps later with pipeline parallelism, where a request waits for its result
before it is scheduled again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mgtrace.errors import UsageError
from mgtrace.schemas.manifest import Manifest
from mgtrace.schemas.writer import TraceWriter
from mgtrace.sim.bugs import GroundTruth
from mgtrace.sim.config import SimConfig
from mgtrace.sim.runner_v1 import RunnerV1
from mgtrace.sim.runner_v2 import RunnerV2
from mgtrace.sim.scheduler import Request, SchedOut, Scheduler
from mgtrace.sim.to_trace import request_rows, run_metadata, sched_rows, source_info
from mgtrace.sim.workload import Client, step_seconds

ProgressFn = Callable[[int], None]
QUEUE_HIGH_WATER = 2048  # steps queued in the writer before the loop waits for it


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
        self.rng_timing = np.random.default_rng([cfg.seed, 0xD2D])
        self.now = 0.0
        if cfg.pp > 1:
            self.lag = cfg.pp - 1
        else:
            self.lag = 1 if cfg.async_scheduling else 0
        self.in_flight: deque[tuple[int, SchedOut, np.ndarray]] = deque()

    def _accept(self, so: SchedOut) -> np.ndarray:
        """Accepted tokens per scheduled position: 1 + the run of accepted drafts for rows
        that sample, 1 for the rest (what the kernels read for a non-final chunk)."""
        acc = np.ones(len(so), np.int64)
        rows = np.flatnonzero(so.samples)
        if not len(rows):
            return acc
        k = max(self.cfg.k, 1)
        ok = self.rng_accept.random((len(rows), k)) < self.cfg.acceptance_rate
        run = np.cumprod(ok, axis=1)
        run[np.arange(k)[None, :] >= so.num_draft[rows][:, None]] = 0
        acc[rows] = 1 + run.sum(axis=1)
        return acc

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
            results = [results]
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


def _write_step(writer: TraceWriter, step: int, view: StepView) -> None:
    sched = sched_rows(view.so)
    for rank, res in enumerate(view.results):
        tables = dict(res.tables)
        if sched is not None:
            tables["sched"] = sched
        writer.write_step(rank, step, tables)
        for chunk in res.launches:
            writer.write_step(rank, step, {"launches": chunk})


def _wait_for_writer(writer: TraceWriter) -> None:
    while writer.stats().queue_depth > QUEUE_HIGH_WATER:
        time.sleep(0.002)


def simulate(
    cfg: SimConfig,
    *,
    progress: ProgressFn | None = None,
    observe: Callable[[int, StepView], None] | None = None,
    argv: list[str] | None = None,
) -> Manifest:
    """Run the simulator for ``cfg.steps`` steps and write the trace to ``cfg.output``."""
    cfg.validate()
    if cfg.output is None:
        raise UsageError("the simulator needs an output trace path (-o TRACE)")
    engine = Engine(cfg)
    run = run_metadata(cfg, engine.runner.builder_thresholds, engine.runner.reorder_threshold)
    writer = TraceWriter(
        Path(cfg.output), run=run, source=source_info(cfg, argv), overwrite=cfg.overwrite
    )
    step = 0
    try:
        for step in range(cfg.steps):
            view = engine.step(step)
            _write_step(writer, step, view)
            if observe is not None:
                observe(step, view)
            if step % 64 == 63:
                _wait_for_writer(writer)
                if progress is not None:
                    progress(64)
        if progress is not None and cfg.steps % 64:
            progress(cfg.steps % 64)
        writer.write_rows("requests", request_rows(engine.requests))
        writer.set_ground_truth(engine.truth.to_dict())
        writer.update_source(
            num_requests=len(engine.requests),
            requests_finished=sum(r.status == "finished" for r in engine.requests),
        )
    except BaseException:
        # an interrupted run keeps the steps it wrote and says where it stopped
        writer.update_source(interrupted_at_step=step, num_requests=len(engine.requests))
        writer.count_error("interrupted", f"the simulation stopped at step {step} of {cfg.steps}")
        writer.set_ground_truth(engine.truth.to_dict())
        writer.close()
        raise
    manifest = writer.close()
    return manifest


def run_engine(cfg: SimConfig, observe: Callable[[int, StepView], None]) -> Engine:
    """Run without writing a trace (tests): ``observe`` sees every step."""
    cfg.validate()
    engine = Engine(cfg)
    for step in range(cfg.steps):
        observe(step, engine.step(step))
    return engine
