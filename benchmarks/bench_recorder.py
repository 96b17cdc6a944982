"""Engine-thread cost of the recorder per 96-row step, against no recording and against a
synchronous JSON logger of the same fields (the ad-hoc probe approach).

The step is a stand-in with vLLM's V1 call structure and names (``execute_model``,
``_update_states`` with a reorder that swaps rows and a condense, ``preprocess_mamba``,
the post-process staging, the two align launchers, ``sample_tokens`` calling
``_update_states_after_model_execute``, and the Mamba builder's split), built from plain
numpy arrays and torch tensors so that it runs where vLLM is not installed. The recorder's
real hook functions are installed on it through the same patch machinery as on vLLM; the
capture ring, the recorder thread and the assembler process (row assembly, Arrow, Parquet)
all run; the run starts timing once the assembler process has started (a one-off second,
reported as ``assembler_startup_s``).
On a CUDA machine the launch inputs live on the GPU and each
"launch" is a small device op; the JSON logger then has to read them back (``tolist``),
which synchronizes, exactly as a host-side logger would. Two JSON loggers run: ``json``
logs the fields the recorder keeps (the target's baseline), ``json_post_only`` the ten
post-process fields a row that results before 2026-12 used as the baseline.

Reported per configuration: wall time per step on the engine thread (median of runs), the
50th and 99th percentiles and the maximum of single steps' wall time, and the engine
thread's CPU time per step; for the recorder, apart, the CPU time of its thread in
the engine process (it shares the engine's GIL) and of the assembler process (it does not),
and any dropped step or capture. No duckdb import on this path.

With ``--runner v2`` the step is a stand-in V2 step instead (``standin_v2.py``: request
slots, a new ``idx_mapping`` each step, the V2 hooks), against a JSON logger of the V2
recorder's fields; the narrower post-process logger is V1's only.

Usage: python benchmarks/bench_recorder.py [--steps N] [--repeats R] [--pin-core C]
       [--runner v1|v2] [--compare-idle] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import torch
from results_io import command_line, emit

from mgtrace.recorder import features, hooks_v1, hooks_v2, outproc
from mgtrace.recorder.patches import PatchSet
from mgtrace.recorder.session import Session
from mgtrace.schemas.manifest import RunMetadata

ROWS = 96
K = 3
B = 16
MAX_REQS = 128
MAX_BLOCKS = 64


class Buf:
    """A pinned-host / device pair like vLLM's CpuGpuBuffer."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.cpu = torch.zeros(n, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(n, dtype=torch.int32, device=device)

    def copy_to_gpu(self, n: int) -> None:
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class BlockTable:
    def __init__(self) -> None:
        self.block_table = SimpleNamespace(np=np.zeros((MAX_REQS, MAX_BLOCKS), np.int32))
        self.num_blocks_per_row = np.zeros(MAX_REQS, np.int32)


class InputBatch:
    def __init__(self) -> None:
        self._req_ids: list[str | None] = [f"cmpl-{i:08x}-0" for i in range(ROWS)]
        self.req_id_to_index = {r: i for i, r in enumerate(self._req_ids)}
        self.num_computed_tokens_cpu = np.arange(ROWS, dtype=np.int32) * 7 + 100
        self.num_prompt_tokens = np.full(MAX_REQS, 90, np.int32)
        self.num_accepted_tokens_cpu = np.ones(MAX_REQS, np.int32)
        bt = BlockTable()
        bt.num_blocks_per_row[:ROWS] = 12
        bt.block_table.np[:ROWS, :12] = np.arange(ROWS * 12).reshape(ROWS, 12)
        self.block_table = [bt]

    @property
    def req_ids(self) -> list[str | None]:
        return self._req_ids

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def swap_states(self, i1: int, i2: int) -> None:
        ids = self._req_ids
        ids[i1], ids[i2] = ids[i2], ids[i1]
        self.req_id_to_index[ids[i1]] = i1  # type: ignore[index]
        self.req_id_to_index[ids[i2]] = i2  # type: ignore[index]
        a = self.num_accepted_tokens_cpu
        a[i1], a[i2] = a[i2], a[i1]

    def condense(self) -> None:
        pass

    def add_request(self, request: Any) -> None:
        pass

    def remove_request(self, req_id: str) -> int | None:
        return None


class Ctx:
    def __init__(self, device: torch.device) -> None:
        self.is_initialized = True
        for name in (
            "mamba_state_idx_buf",
            "num_scheduled_tokens_buf",
            "num_computed_tokens_buf",
            "num_draft_tokens_buf",
            "precopy_src_col_buf",
            "precopy_token_bias_buf",
        ):
            setattr(self, name, Buf(MAX_REQS, device))

    def run_fused_precopy(
        self,
        num_reqs: int,
        state_idx_gpu: Any,
        src_col_gpu: Any,
        token_bias_gpu: Any,
        idx_mapping: Any,
    ) -> None:
        state_idx_gpu[:num_reqs].add_(0)  # stands in for the kernel launch

    def run_fused_postprocess(
        self,
        num_reqs: int,
        num_accepted_tokens_gpu: Any,
        mamba_state_idx_gpu: Any,
        num_scheduled_tokens_gpu: Any,
        num_computed_tokens_gpu: Any,
        num_draft_tokens_gpu: Any,
    ) -> None:
        num_accepted_tokens_gpu[:num_reqs].clamp_(max=K + 1)  # in place, like the kernel

    def run_fused_postprocess_align(self, *args: Any) -> None:
        pass


class Builder:
    reorder_batch_threshold = 1 + K

    def _compute_common_metadata(
        self, cm: Any, *, num_accepted_tokens: Any = None, num_decode_draft_tokens_cpu: Any = None
    ) -> Any:
        return SimpleNamespace(num_decodes=ROWS - 4)


class GDNBuilder:
    """A GDN model's builder: spec-decode rows by a host mask it reuses from step to step."""

    reorder_batch_threshold = 1 + K

    def __init__(self) -> None:
        self.mask = torch.ones(ROWS, dtype=torch.bool)
        self.mask[-4:] = False

    def build(self, common_prefix_len: int, m: Any, fast_build: bool = False) -> Any:
        return SimpleNamespace(num_decodes=0, spec_sequence_masks_cpu=self.mask)


class CheckpointBuilder:
    """vLLM 0.33's prefill checkpoint builder: a decode step has no checkpoint to store."""

    def build(self, m: Any, request_rows: Any) -> Any:
        return SimpleNamespace(offsets=None)


def build_module(device: torch.device) -> tuple[ModuleType, ModuleType, Any]:
    """The stand-in "runner module" and "mamba_utils" with vLLM's names."""
    runner_mod = ModuleType("bench_runner")
    mu = ModuleType("bench_mamba_utils")
    ctx = Ctx(device)

    def reorder_batch_to_split_decodes_and_prefills(
        ib: Any, so: Any, decode_threshold: int = 1
    ) -> bool:
        ib.swap_states(3, ROWS - 2)
        ib.swap_states(5, ROWS - 1)
        return True

    def preprocess_mamba(
        so: Any,
        kv: Any,
        cache: Any,
        msi: dict[str, int],
        ib: Any,
        requests: Any,
        fwd: Any,
        funcs: Any,
        bufs: Any,
        align_ctx: Any = None,
    ) -> None:
        n = ib.num_reqs
        for i, r in enumerate(ib.req_ids):
            msi[r] = 7 + (i & 1)
        align_ctx.mamba_state_idx_buf.np[:n] = 7
        align_ctx.precopy_src_col_buf.np[:n] = 6
        align_ctx.precopy_token_bias_buf.np[:n] = ib.num_accepted_tokens_cpu[:n] - 1
        for b in (
            align_ctx.mamba_state_idx_buf,
            align_ctx.precopy_src_col_buf,
            align_ctx.precopy_token_bias_buf,
        ):
            b.copy_to_gpu(n)
        align_ctx.run_fused_precopy(
            n,
            align_ctx.mamba_state_idx_buf.gpu,
            align_ctx.precopy_src_col_buf.gpu,
            align_ctx.precopy_token_bias_buf.gpu,
            None,
        )
        ib.num_accepted_tokens_cpu[:n] = 1

    def stage_postprocess_inputs_to_gpu(
        ctx_: Any, so: Any, req_ids: Any, n: int, requests: Any, msi: Any
    ) -> None:
        ctx_.num_scheduled_tokens_buf.np[:n] = 1 + K
        ctx_.num_computed_tokens_buf.np[:n] = 100
        ctx_.num_draft_tokens_buf.np[:n] = K
        for b in (
            ctx_.mamba_state_idx_buf,
            ctx_.num_scheduled_tokens_buf,
            ctx_.num_computed_tokens_buf,
            ctx_.num_draft_tokens_buf,
        ):
            b.copy_to_gpu(n)

    runner_mod.reorder_batch_to_split_decodes_and_prefills = (  # type: ignore[attr-defined]
        reorder_batch_to_split_decodes_and_prefills
    )
    mu.preprocess_mamba = preprocess_mamba  # type: ignore[attr-defined]
    mu.stage_postprocess_inputs_to_gpu = stage_postprocess_inputs_to_gpu  # type: ignore[attr-defined]
    return runner_mod, mu, ctx


def build_runner(
    device: torch.device, builder: str = "mamba2"
) -> tuple[Any, dict[features.Target, Any]]:
    """The stand-in runner; ``builder``: whose split the step runs, Mamba2's or GDN's."""
    runner_mod, mu, ctx = build_module(device)
    checkpoints = CheckpointBuilder()
    accepted = torch.full((MAX_REQS,), 2, dtype=torch.int32, device=device)

    class Runner:
        def __init__(self) -> None:
            self.input_batch = InputBatch()
            self.reorder_batch_threshold = 1
            self.mamba_state_idx: dict[str, int] = {}
            self.num_accepted_tokens_event = SimpleNamespace(query=lambda: True)
            self.builder = Builder()
            self.gdn = GDNBuilder()
            self.ctx = ctx
            self.accepted = accepted
            self.moves = [["swap", 3, ROWS - 2], ["swap", 5, ROWS - 1]]  # the reorder's swaps
            self.num_decodes = 0

        def _update_states(self, so: Any) -> None:
            ib = self.input_batch
            ib.condense()
            runner_mod.reorder_batch_to_split_decodes_and_prefills(
                ib, so, decode_threshold=self.reorder_batch_threshold
            )

        def execute_model(self, so: Any) -> None:
            self._update_states(so)
            ib = self.input_batch
            mu.preprocess_mamba(
                so, None, None, self.mamba_state_idx, ib, None, None, None, None, align_ctx=ctx
            )
            mu.stage_postprocess_inputs_to_gpu(
                ctx, so, ib.req_ids, ib.num_reqs, None, self.mamba_state_idx
            )
            if builder == "gdn":
                split = self.gdn.build(0, None)
                self.num_decodes = int(split.spec_sequence_masks_cpu.sum())
            else:
                split = self.builder._compute_common_metadata(None, num_accepted_tokens=accepted)
                self.num_decodes = split.num_decodes
            checkpoints.build(None, None)

        def sample_tokens(self, grammar_output: Any) -> Any:
            self._update_states_after_model_execute(None, None)
            return grammar_output

        def _update_states_after_model_execute(self, out: Any, so: Any) -> None:
            n = self.input_batch.num_reqs
            ctx.run_fused_postprocess(
                n,
                accepted,
                ctx.mamba_state_idx_buf.gpu,
                ctx.num_scheduled_tokens_buf.gpu,
                ctx.num_computed_tokens_buf.gpu,
                ctx.num_draft_tokens_buf.gpu,
            )

    owner_of = {
        ("GPUModelRunner", None): Runner,
        (None, "reorder"): runner_mod,
        ("InputBatch", None): InputBatch,
        (None, "mu"): mu,
        ("MambaSpecDecodeGPUContext", None): Ctx,
        ("BaseMambaAttentionMetadataBuilder", None): Builder,
        ("GDNAttentionMetadataBuilder", None): GDNBuilder,
        ("MambaPrefillCheckpointBuilder", None): CheckpointBuilder,
    }
    owners = {}
    for t in features.V1_TARGETS:
        if t.owner is not None:
            owner = owner_of[(t.owner, None)]
        elif t.attr.startswith("reorder"):
            owner = runner_mod
        else:
            owner = mu
        if callable(getattr(owner, t.attr, None)):  # as features.resolve finds them
            owners[t] = owner
    return Runner(), owners


def scheduler_output() -> Any:
    ids = [f"cmpl-{i:08x}-0" for i in range(ROWS)]
    return SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(ids, 1 + K),
        scheduled_spec_decode_tokens={r: [0] * K for r in ids},
        total_num_scheduled_tokens=ROWS * (1 + K),
        scheduled_new_reqs=[],
        finished_req_ids=set(),
        preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=ids,
            resumed_req_ids=set(),
            new_block_ids=[None] * ROWS,
            num_computed_tokens=[100] * ROWS,
        ),
    )


def json_log_post_only(fh: Any, runner: Any, so: Any, step: int) -> None:
    """The narrow probe-style logger earlier results used: ten per-row fields, about the
    post-process only, serialised synchronously every step."""
    ib, ctx = runner.input_batch, runner.ctx
    n = ib.num_reqs
    rows = []
    post = [
        ctx.mamba_state_idx_buf.gpu[:n].tolist(),
        ctx.num_scheduled_tokens_buf.gpu[:n].tolist(),
        ctx.num_computed_tokens_buf.gpu[:n].tolist(),
        ctx.num_draft_tokens_buf.gpu[:n].tolist(),
    ]
    acc = ib.num_accepted_tokens_cpu[:n].tolist()
    computed = ib.num_computed_tokens_cpu[:n].tolist()
    for i, r in enumerate(ib.req_ids):
        rows.append(
            {
                "batch_row": i,
                "req_id": r,
                "num_scheduled": so.num_scheduled_tokens[r],
                "num_computed": computed[i],
                "accepted_prev": acc[i],
                "state_col": runner.mamba_state_idx.get(r),
                "state_idx": post[0][i],
                "sched": post[1][i],
                "comp": post[2][i],
                "draft": post[3][i],
            }
        )
    fh.write(json.dumps({"step": step, "t": time.time(), "rows": rows}) + "\n")


# (field, align-context buffer): each is logged as the CPU staged it and as the device holds it
ALIGN_BUFFERS = (
    ("state_idx", "mamba_state_idx_buf"),
    ("src_col", "precopy_src_col_buf"),
    ("token_bias", "precopy_token_bias_buf"),
    ("num_scheduled", "num_scheduled_tokens_buf"),
    ("num_computed", "num_computed_tokens_buf"),
    ("num_draft", "num_draft_tokens_buf"),
)


def sched_fields(so: Any) -> dict[str, Any]:
    """The scheduler output's per-request counts and lists, as the JSON loggers write them."""
    cached = so.scheduled_cached_reqs
    return {
        "num_scheduled": so.num_scheduled_tokens,
        "num_draft": {r: len(d) for r, d in so.scheduled_spec_decode_tokens.items()},
        "total": so.total_num_scheduled_tokens,
        "new": [[r.req_id, r.num_computed_tokens, r.block_ids] for r in so.scheduled_new_reqs],
        "cached": cached.req_ids,
        "resumed": sorted(cached.resumed_req_ids),
        "new_block_ids": cached.new_block_ids,
        "cached_computed": cached.num_computed_tokens,
        "finished": sorted(so.finished_req_ids),
        "preempted": sorted(so.preempted_req_ids),
    }


def json_log(fh: Any, runner: Any, so: Any, step: int) -> None:
    """A probe-style logger of the fields the recorder keeps, serialised synchronously
    every step: per row the batch order, computed and prompt counts, accepted counts, the
    state column, the block-table row, the CPU-staged align inputs and what the kernels
    read on the device (read back, which synchronizes); per step the scheduler's
    per-request counts and lists, the row moves, the thresholds and the Mamba split.

    It reads everything once, at the end of the step, which is cheaper than a logger
    that reads each value where the hooks do: this baseline errs in its own favour."""
    ib, ctx, acc_dev = runner.input_batch, runner.ctx, runner.accepted
    n = ib.num_reqs
    bt = ib.block_table[0]
    widths = bt.num_blocks_per_row[:n].tolist()
    table = bt.block_table.np[:n, : max(widths, default=0)].tolist()
    columns: dict[str, list[int]] = {}
    for name, attr in ALIGN_BUFFERS:
        buf = getattr(ctx, attr)
        columns[f"{name}_cpu"] = buf.np[:n].tolist()
        columns[f"{name}_dev"] = buf.gpu[:n].tolist()
    columns["accepted_dev"] = acc_dev[:n].tolist()
    columns["num_computed"] = ib.num_computed_tokens_cpu[:n].tolist()
    columns["num_prompt"] = ib.num_prompt_tokens[:n].tolist()
    columns["accepted_prev"] = ib.num_accepted_tokens_cpu[:n].tolist()
    cols = runner.mamba_state_idx
    rows = []
    for i, r in enumerate(ib.req_ids):
        row = {name: values[i] for name, values in columns.items()}
        row.update(
            batch_row=i,
            req_id=r,
            state_col=cols.get(r),
            num_blocks=widths[i],
            block_table=table[i][: widths[i]],
        )
        rows.append(row)
    record = {
        "step": step,
        "t": time.time(),
        "sched": sched_fields(so),
        "moves": runner.moves,
        "reorder_threshold": runner.reorder_batch_threshold,
        "mamba_split": [runner.num_decodes, runner.builder.reorder_batch_threshold],
        "rows": rows,
    }
    fh.write(json.dumps(record) + "\n")


JSON_LOGGERS = {"json": json_log, "json_post_only": json_log_post_only}


def _session(out: Path, assembler: str | None, sched: str, kind: str = "v1") -> Session:
    """A recording session whose assembler process yields the CPU as ``sched`` says."""
    saved = os.environ.get(outproc.SCHED_ENV)
    os.environ[outproc.SCHED_ENV] = sched
    try:
        return Session(
            out, rank=0, kind=kind, run=RunMetadata(), mamba_block_size=B, assembler=assembler
        )
    finally:
        if saved is None:
            del os.environ[outproc.SCHED_ENV]
        else:
            os.environ[outproc.SCHED_ENV] = saved


def _thread_clock(thread: Any) -> int | None:
    """The CPU-time clock of another thread of this process (Linux), or None."""
    try:
        return time.pthread_getcpuclockid(thread.ident)
    except (AttributeError, OSError, TypeError):
        return None


def _clock_ns(clock: int | None) -> int:
    return 0 if clock is None else time.clock_gettime_ns(clock)


def run(
    mode: str,
    steps: int,
    device: torch.device,
    tmp: Path,
    device_wait_s: float = 0.0,
    assembler: str | None = None,
    builder: str = "mamba2",
    runner_kind: str = "v1",
) -> dict[str, float]:
    if runner_kind == "v2":
        from standin_v2 import build_runner_v2, json_log_v2

        runner, owners = build_runner_v2(device)
        loggers = {"json": json_log_v2}
    else:
        runner, owners = build_runner(device, builder)
        loggers = JSON_LOGGERS
    so = scheduler_output()
    out = torch.zeros((ROWS, 1 + K), dtype=torch.int64, device=device)
    patches = PatchSet()
    sess = None
    fh = None
    if mode in ("hooked", "hooked_idle"):
        sched = "idle" if mode == "hooked_idle" else "nice"
        sess = _session(tmp / f"trace-{time.monotonic_ns()}", assembler, sched, runner_kind)
        t_start = time.perf_counter()
        # a one-off start-up (the assembler process imports numpy and pyarrow), not a
        # per-step cost: measured and reported apart
        ready = sess.wait_ready(60.0)
        startup_s = time.perf_counter() - t_start
        child_cpu0 = sess.sink.stats().get("cpu_s")
        if runner_kind == "v2":
            patches.install(hooks_v2.v2_patches(sess, owners, [0]))
        else:
            patches.install(hooks_v1.v1_patches(sess, owners, [0]))
    log_step = loggers.get(mode)
    if log_step is not None:
        fh = open(tmp / f"log-{time.monotonic_ns()}.jsonl", "w")  # noqa: SIM115
    cls = type(runner)
    for warm in range(50):  # the ring, the writer and the caches warm up
        cls.execute_model(runner, so)
        cls.sample_tokens(runner, out)
        if fh is not None:
            log_step(fh, runner, so, warm)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rec_thread = _thread_clock(sess._thread) if sess is not None else None
    rec_cpu0 = _clock_ns(rec_thread)
    step_ns = np.zeros(steps, dtype=np.int64)
    clock = time.perf_counter_ns
    t_cpu = time.thread_time_ns()
    t0 = last = clock()
    for step in range(steps):
        cls.execute_model(runner, so)
        if device_wait_s:
            time.sleep(device_wait_s)  # the forward on the device: the GIL is free meanwhile
        cls.sample_tokens(runner, out)
        if fh is not None:
            log_step(fh, runner, so, step)
        now = clock()
        step_ns[step] = now - last
        last = now
    wall = time.perf_counter_ns() - t0
    cpu = time.thread_time_ns() - t_cpu
    rec_cpu = _clock_ns(rec_thread) - rec_cpu0
    if device.type == "cuda":
        torch.cuda.synchronize()
    result = {
        "wall_us_per_step": wall / steps / 1e3,
        "cpu_us_per_step": cpu / steps / 1e3,
        # the tail: a recorder thread holding the GIL, or a child process on the engine's
        # core, shows here first
        "p50_us": float(np.percentile(step_ns, 50)) / 1e3,
        "p99_us": float(np.percentile(step_ns, 99)) / 1e3,
        "max_us": float(step_ns.max()) / 1e3,
    }
    if sess is not None:
        patches.remove()
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        status = sess.close()
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # the recorder thread shares the engine's GIL; the assembler process does not
        result["recorder_thread_cpu_us_per_step"] = rec_cpu / steps / 1e3
        result["assembler_process_cpu_us_per_step"] = (
            (children1.ru_utime + children1.ru_stime - children0.ru_utime - children0.ru_stime)
            * 1e6
            / (steps + 50)
        )
        child_cpu1 = sess.sink.stats().get("cpu_s")
        if child_cpu0 is not None and child_cpu1 is not None:
            # the assembler process's own account, from ready to exit: per recorded step
            result["assembler_process_cpu_after_startup_us_per_step"] = (
                (child_cpu1 - child_cpu0) * 1e6 / (steps + 50)
            )
        result["assembler"] = status["assembler"]
        result["assembler_ready"] = ready
        result["assembler_startup_s"] = startup_s
        result["rows"] = status["rows"]
        result["recorded_steps"] = status["steps"]
        result["drops"] = status["drops"]
        result["hook_errors"] = status["hook_errors"]
    if fh is not None:
        fh.close()
    return result


def summarize(runs: dict[str, list[dict[str, float]]], wait_s: float, steps: int) -> dict[str, Any]:
    def med(mode: str, key: str) -> float:
        return float(np.median([r[key] for r in runs[mode]]))

    base_wall, base_cpu = med("unhooked", "wall_us_per_step"), med("unhooked", "cpu_us_per_step")
    over_wall = med("hooked", "wall_us_per_step") - base_wall
    over_cpu = med("hooked", "cpu_us_per_step") - base_cpu
    json_wall = med("json", "wall_us_per_step") - base_wall
    json_cpu = med("json", "cpu_us_per_step") - base_cpu
    narrow = "json_post_only" in runs  # the V1 step's narrower logger only
    narrow_wall = med("json_post_only", "wall_us_per_step") - base_wall if narrow else 0.0
    narrow_cpu = med("json_post_only", "cpu_us_per_step") - base_cpu if narrow else 0.0
    ratio = over_wall / json_wall if json_wall > 0 else None
    return {
        "device_wait_us": wait_s * 1e6,
        "steps_per_run": steps,
        "median_us_per_step": {
            m: {"wall": med(m, "wall_us_per_step"), "engine_thread_cpu": med(m, "cpu_us_per_step")}
            for m in runs
        },
        "step_wall_percentiles_us": {
            m: {q: med(m, f"{q}_us") for q in ("p50", "p99", "max")} for m in runs
        },
        "p99_overhead_us": med("hooked", "p99_us") - med("unhooked", "p99_us"),
        # the assembler process under SCHED_IDLE instead of at nice 10 (the default)
        "sched_idle_overhead_us": (
            {
                "wall": med("hooked_idle", "wall_us_per_step") - base_wall,
                "p99": med("hooked_idle", "p99_us") - med("unhooked", "p99_us"),
            }
            if "hooked_idle" in runs
            else None
        ),
        "overhead_us_per_step": {
            "recorder_wall": over_wall,
            "recorder_engine_thread_cpu": over_cpu,
            "json_logger_wall": json_wall,
            "json_logger_engine_thread_cpu": json_cpu,
            "json_post_only_logger_wall": narrow_wall if narrow else None,
            "json_post_only_logger_engine_thread_cpu": narrow_cpu if narrow else None,
        },
        "recorder_vs_json_wall": ratio,
        "recorder_vs_json_engine_thread_cpu": over_cpu / json_cpu if json_cpu > 0 else None,
        # against the narrower logger of earlier results (ten post-process fields a row)
        "recorder_vs_json_post_only_wall": (
            over_wall / narrow_wall if narrow and narrow_wall > 0 else None
        ),
        "recorder_vs_json_post_only_engine_thread_cpu": (
            over_cpu / narrow_cpu if narrow and narrow_cpu > 0 else None
        ),
        "recorded_last_run": {
            k: runs["hooked"][-1][k]
            for k in ("assembler", "recorded_steps", "rows", "drops", "hook_errors")
        },
        "off_engine_thread_cpu_us_per_step": {
            "recorder_thread_in_engine_process": med("hooked", "recorder_thread_cpu_us_per_step"),
            "assembler_process_incl_warmup_steps_and_startup": med(
                "hooked", "assembler_process_cpu_us_per_step"
            ),
        },
        "assembler_startup_s": med("hooked", "assembler_startup_s"),
        "assembler_process_cpu_after_startup_us_per_step": (
            med("hooked", "assembler_process_cpu_after_startup_us_per_step")
            if all("assembler_process_cpu_after_startup_us_per_step" in r for r in runs["hooked"])
            else None
        ),
        "meets_targets": {
            "engine_thread_cpu_le_25us": over_cpu <= 25.0,
            "wall_le_25us": over_wall <= 25.0,
            "wall_le_tenth_of_json": ratio is not None and ratio <= 0.1,
            "nothing_dropped": all(r["drops"] == 0 for r in runs["hooked"]),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--assembler",
        choices=("process", "thread"),
        default=None,
        help="where rows are assembled (default: the recorder's default, the process)",
    )
    ap.add_argument(
        "--device-wait-us",
        type=float,
        default=1500.0,
        help="second scenario: a GIL-free wait per step standing in for the forward",
    )
    ap.add_argument(
        "--pin-core",
        type=int,
        default=None,
        help="run on this one core (the assembler process inherits it), as a pinned engine does",
    )
    ap.add_argument(
        "--builder",
        choices=("mamba2", "gdn"),
        default="mamba2",
        help="the split the V1 stand-in step runs: Mamba2's builder or GDN's (its hook copies "
        "a mask)",
    )
    ap.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="the stand-in step's runner: V1's (InputBatch rows) or V2's (request slots, "
        "idx_mapping; benchmarks/standin_v2.py)",
    )
    ap.add_argument(
        "--compare-idle",
        action="store_true",
        help="also run the recorder with its assembler process under SCHED_IDLE",
    )
    a = ap.parse_args()
    if a.pin_core is not None:
        os.sched_setaffinity(0, {a.pin_core})
    device = torch.device(a.device)
    scenarios = {"busy_host_loop": 0.0, "with_device_wait": a.device_wait_us / 1e6}
    report: dict[str, Any] = {
        "benchmark": f"recorder engine-thread overhead, 96-row {a.runner.upper()} step, "
        "hooks + capture on",
        "command": command_line(),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": a.device,
            "cpus": os.cpu_count(),
            "pinned_to_core": a.pin_core,
            "compare_idle": a.compare_idle,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        },
        "steps_per_run": a.steps,
        "repeats": a.repeats,
        "rows_per_step": ROWS,
        "builder": a.builder,
        "runner": a.runner,
        "targets": {"recorder_us_per_step": 25.0, "recorder_vs_json": 0.1},
        "scenarios": {},
        "loadavg_start": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="mgtrace-bench-") as tmp:
        for name, wait in scenarios.items():
            # a step that waits is 10x longer; half as many of them keep the run short, and
            # enough that the scheduler noise of single waits averages out
            steps = a.steps if not wait else max(200, a.steps // 2)
            modes = [
                "unhooked",
                "hooked",
                *(["hooked_idle"] * a.compare_idle),
                "json",
                *(["json_post_only"] * (a.runner == "v1")),
            ]
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for _ in range(a.repeats):
                for mode in runs:  # interleaved, so that machine noise hits every mode alike
                    runs[mode].append(
                        run(mode, steps, device, Path(tmp), wait, a.assembler, a.builder, a.runner)
                    )
            report["scenarios"][name] = summarize(runs, wait, steps)
    report["loadavg_end"] = list(os.getloadavg())
    emit(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
