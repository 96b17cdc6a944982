"""One recording in one engine process: the capture ring, the recorder thread and a sink.

The engine thread only touches ``begin_step``, ``rec`` (a dict the hooks fill with array
copies and object references) and ``grab``. The ``mgtrace-recorder`` thread polls capture
events (it never waits on them), and forwards, in order, the landed captures and the
closed step records to the sink (``outproc``): by default the assembler process, which does
all row assembly, Arrow conversion and Parquet writing under its own GIL. This thread's
share of the engine's GIL is one pickle per few steps and a pipe write that releases it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mgtrace.recorder import outproc, wire
from mgtrace.recorder.assemble import BOUND_PTRS
from mgtrace.recorder.capture import CaptureRing, slot_elems_for
from mgtrace.recorder.failures import count_failure
from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.writer import TraceWriter

log = logging.getLogger("mgtrace.recorder")

MAX_FRAME_STEPS = 256  # steps per frame (each frame is pickled in slices of
# ``wire.MESSAGES_PER_PICKLE`` messages, between which the engine can take the GIL back)
# Everything ready goes in one frame, and then the thread sleeps. Smaller frames (a quarter
# of the waiting steps, at least one), to shorten each hold, measured worse: between them
# the thread keeps asking for the GIL, and an engine running Python gives it up only at a
# forced switch (a stand-in engine with device waits: p99 step overhead about +1,900 µs in
# two of three runs, against +390-600; results/recorder-cpu-frame-size-ab.json).
IDLE_POLL_S = 0.01  # few wake-ups: each one takes the GIL from the engine; the ring
# holds 256 steps of captures, so this (plus a switch interval) loses none
TICK_S = 0.05  # how often the sink's counters are read and the child is checked
MAX_PENDING_STEPS = 4096  # step records waiting for the recorder thread; more are dropped


class Session:
    """State of one recording. ``live`` is the only flag the hooks read on the hot path."""

    def __init__(
        self,
        out: str | Path,
        *,
        rank: int,
        kind: str,
        run: RunMetadata,
        source: dict[str, Any] | None = None,
        max_steps: int | None = None,
        duration_s: float | None = None,
        mamba_block_size: int = 16,
        writer: TraceWriter | None = None,
        assembler: str | None = None,
    ) -> None:
        self.out = Path(out)
        self.rank = rank
        self.kind = kind
        self.block_size = mamba_block_size
        self.max_num_seqs = run.max_num_seqs  # sizes the capture slots
        # an in-process writer object can only be fed in-process
        mode = "thread" if writer is not None else outproc.chosen_mode(assembler)
        source = {**(source or {}), "assembler": mode}
        self.sink: outproc.ThreadSink | outproc.ProcessSink
        if mode == "thread":
            self.sink = outproc.ThreadSink(
                writer or TraceWriter(self.out, run=run, source=source),
                rank=rank,
                kind=kind,
                block_size=mamba_block_size,
            )
        else:
            self.sink = outproc.ProcessSink(
                self.out,
                run=run,
                source=source,
                rank=rank,
                kind=kind,
                block_size=mamba_block_size,
            )
        self.max_steps = max_steps
        self.deadline = None if duration_s is None else time.monotonic() + duration_s
        self.ring: CaptureRing | None = None
        self.live = True
        self.stop_requested = False
        self.step = -1
        self.steps_recorded = 0
        self.rec: dict[str, Any] | None = None
        # between a step's execute_model and its end (step_done), where hooks see that end
        self.step_ends_observed = False
        self.in_step = False
        self.deferred_batch_step: int | None = None  # V2 PP: batch step of a deferred postprocess
        self.pp_origin: dict[int, int] = {}  # id(PendingRecv) -> step that pushed it
        # V2: data_ptrs of the Mamba groups' source and input tables, and the align contexts
        # whose bound table pointers were captured (once each) to compare with them
        self.table_ptrs: dict[str, list[int]] | None = None
        self.ptrs_grabbed: set[int] = set()
        self.on_limit: Any = None  # called once, on the engine thread, when a limit stops it
        self.hook_errors = 0
        self._logged: set[str] = set()
        self._records: deque[dict[str, Any]] = deque()
        self._errors: deque[tuple[str, str]] = deque()  # counted here, forwarded in order
        self._lost_sent = 0  # how many of _lost_steps the assembler has been told of
        self._error_totals: dict[str, dict[str, Any]] = {}  # for a manifest the child missed
        self._lost_steps: list[int] = []  # dropped here: queue full or sink gone
        # steps with a capture that went out in a frame the sink refused, or found no ring
        # slot: dropped when their record comes up, never written without their launches
        self._doomed: set[int] = set()
        self._packer = wire.Packer()  # recorder thread only
        self._closing = threading.Event()
        self._force = False  # set on close when the device never finished: stop waiting
        self._thread = threading.Thread(target=self._loop, name="mgtrace-recorder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def _close_rec(self) -> None:
        rec, self.rec = self.rec, None
        if rec is None:
            return
        if len(self._records) >= MAX_PENDING_STEPS:
            self._lost_steps.append(rec["step"])  # never wait: counted, in the manifest
            self._doomed.discard(rec["step"])  # counted once
            return
        self._records.append(rec)
        self.steps_recorded += 1

    def begin_step(self, scheduler_output: Any) -> bool:
        """Close the previous step and open the next; False once a limit says stop."""
        if self.rec is not None:
            self._close_rec()
        if (
            self.stop_requested
            or (self.max_steps is not None and self.steps_recorded >= self.max_steps)
            or (self.deadline is not None and time.monotonic() >= self.deadline)
        ):
            self.live = False
            callback, self.on_limit = self.on_limit, None
            if callback is not None:
                try:
                    callback()
                except Exception as exc:
                    self.hook_failed("stop", exc)
            return False
        self.step += 1
        self.in_step = self.step_ends_observed
        self.rec = {
            "step": self.step,
            "wall_ns": time.monotonic_ns(),
            "so": scheduler_output,
            "moves": [],
        }
        return True

    def step_done(self) -> None:
        """The runner finished the open step: a stop may close it from now on."""
        self.in_step = False

    def end_step(self) -> None:
        """Close the open step without opening another (a batch that is not a step)."""
        self._close_rec()

    def abandon_after_fork(self) -> None:
        """In a forked child (the recorder thread stayed in the parent): go inert and let go
        of the sink's pipes."""
        self.live = False
        self.sink.abandon()

    def grab(self, tensors: Sequence[Any], lengths: Sequence[int], tag: dict[str, Any]) -> None:
        ring = self.ring
        if ring is None:
            ring = self.ring = CaptureRing(
                tensors[0].device, slot_elems=slot_elems_for(self.max_num_seqs)
            )
        if not ring.grab(tensors, lengths, tag):
            # a step without one of its launches would replay as if that launch never ran:
            # the whole step is dropped and counted when its record comes up
            self._doomed.add(tag["step"])
            if tag.get("kernel") == BOUND_PTRS:
                self.ptrs_grabbed.clear()  # captured once per context: capture them again
            if ring.refusal == "full":
                self.count_error(
                    "capture_ring_full",
                    "a launch found no free capture slot: its step is dropped",
                )
            else:
                self.count_error(
                    "capture_too_large",
                    f"a launch's inputs ({ring.refusal}) do not fit a capture slot: its step "
                    "is dropped",
                )

    def hook_failed(self, name: str, exc: BaseException, *, drop_step: bool = False) -> None:
        """Count a hook's exception; log the first of each hook. Never raises.
        ``drop_step``: the open step lacks what the hook records, so it is dropped and
        counted when its record comes up, never written in part."""
        self.hook_errors += 1
        rec = self.rec
        if drop_step and rec is not None:
            self._doomed.add(rec["step"])
        count_failure(self.count_error, self._logged, name, exc)

    def count_error(self, kind: str, message: str) -> None:
        """Any thread; the recorder thread forwards it to the manifest."""
        with contextlib.suppress(Exception):
            entry = self._error_totals.setdefault(kind, {"count": 0, "first": message})
            entry["count"] += 1
            self._errors.append((kind, message))

    # ------------------------------------------------------------ any thread
    def status(self) -> dict[str, Any]:
        st = self.sink.stats()
        return {
            "steps": self.steps_recorded,
            "rows": st["rows"],
            "bytes": st["bytes"],
            # dropped steps: a capture lost drops its step (``_doomed`` until its record
            # comes up), so captures are not counted apart
            "drops": st["steps_dropped"]
            + len(self._lost_steps)
            - self._lost_sent  # those the assembler counts already
            + len(self._doomed),
            "hook_errors": self.hook_errors + st["assemble_errors"],
            "writer_failed": st["failed"],
            "backlog_bytes": self.sink.backlog_bytes(),
            "assembler": self.sink.mode,
            "out": str(self.out),
        }

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Block (not the engine thread) until the sink runs: the assembler process starts
        in about a second, during which steps queue up in the pipe."""
        return self.sink.wait_ready(timeout_s)

    def close(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Flush: the open step, captures still in flight, the sink. Not the engine thread.
        A step the runner has not finished is dropped and counted, never written in half."""
        self.live = False
        if self.in_step and self.rec is not None:
            rec, self.rec = self.rec, None
            self._lost_steps.append(rec["step"])
            self._doomed.discard(rec["step"])  # counted once
            self.count_error(
                "stopped_mid_step", f"step {rec['step']} was still running at the stop"
            )
        self._close_rec()
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._force = True
            self._thread.join(2.0)
        if self.ring is not None and self.ring.pending:
            self.count_error("capture_unfinished", f"{self.ring.pending} captures never landed")
        notices, lost = self._notices()
        if self._send(notices, essential=True):
            self._lost_sent = max(self._lost_sent, lost)
        complete = self.sink.close(timeout_s)
        result = self.status()
        failed = self.sink.failed
        if failed is not None and isinstance(self.sink, outproc.ProcessSink):
            self._log_once("sink", "mgtrace: %s; the trace is incomplete", failed)
            dropped = outproc.mark_failed(
                self.out, failed, self._error_totals, self._lost_steps, self.rank, self.step + 1
            )
            if dropped is not None:  # the steps the assembler took and lost count too
                result["drops"] = dropped
            complete = False
        return {"complete": complete, **result}

    # ------------------------------------------------------------ recorder thread
    def _loop(self) -> None:
        last_tick = 0.0
        while True:
            try:
                busy = self._drain()
                now = time.monotonic()
                if now - last_tick >= TICK_S or self._closing.is_set():
                    last_tick = now
                    self.sink.tick()
            except Exception as exc:  # never let the thread die silently
                self.hook_failed("recorder", exc)
                busy = False
            if self.sink.failed is not None and not self.stop_requested:
                # nothing more can reach the trace: stop at the next step boundary rather
                # than hook, copy and drop every step until somebody notices
                self.stop_requested = True
                self._log_once("sink", "mgtrace: %s; recording stops", self.sink.failed)
            if (
                self._closing.is_set()
                and not self._records
                and not (self.ring and self.ring.pending and not self._force)
            ):
                return
            if not busy:
                time.sleep(IDLE_POLL_S)

    def _log_once(self, key: str, fmt: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(fmt, *args)

    def _notices(self) -> tuple[list[tuple[Any, ...]], int]:
        """Errors and dropped steps the assembler has not been told of yet."""
        out: list[tuple[Any, ...]] = []
        while self._errors:  # an error in a frame that is dropped is lost with it
            kind, message = self._errors.popleft()
            out.append(("err", kind, message))
        lost = len(self._lost_steps)
        out += [("drop", step) for step in self._lost_steps[self._lost_sent : lost]]
        return out, lost

    def _drain(self) -> bool:
        """Forward what is ready, in the order the assembler needs (a step goes after every
        capture of its own or an earlier step), as one frame: the pipe write releases the
        GIL, and while the engine runs Python, getting it back costs a switch interval."""
        notices, lost = self._notices()
        sent = bool(notices) and self._send(notices, essential=True)
        if sent:
            self._lost_sent = max(self._lost_sent, lost)
        messages: list[tuple[Any, ...]] = []
        steps = 0
        if self.ring is not None:  # tags hold raw arrays already: they travel as they are
            messages += [("cap", raw, lengths, tag) for raw, lengths, tag in self.ring.reap_raw()]
        unlanded: set[int] | None = None  # forced: steps whose captures never landed
        while self._records and steps < MAX_FRAME_STEPS:
            rec = self._records[0]
            oldest = self.ring.oldest_pending_tag() if self.ring is not None else None
            if oldest is not None and oldest["step"] <= rec["step"]:
                if not self._force:
                    break
                if unlanded is None:
                    unlanded = self.ring.pending_steps()  # type: ignore[union-attr]
                if rec["step"] in unlanded:
                    # written without its launches it would replay as if they never ran
                    self._doomed.add(rec["step"])
            self._records.popleft()
            if rec["step"] in self._doomed:
                self._doomed.discard(rec["step"])
                self._lost_steps.append(rec["step"])
                continue
            steps += 1
            try:
                messages.append(("step", self._packer.record(rec)))
            except Exception as exc:  # counted, and the step is counted as dropped
                self.hook_failed("forward", exc)
                self._lost_steps.append(rec["step"])
        self._send(messages)
        # notices a failed sink refused are not work done: they wait for the close (which
        # writes them into the manifest), and the thread sleeps instead of resending them
        return bool(messages) or sent

    def _send(self, messages: list[tuple[Any, ...]], *, essential: bool = False) -> bool:
        """Hand a frame to the sink; ``essential`` frames (errors, drop notices: small)
        are queued however far behind the assembler is."""
        if not messages:
            return True
        try:
            sent = self.sink.send(messages, essential=essential)
        except Exception as exc:  # e.g. an unpicklable value in a record
            self.hook_failed("forward", exc)
            sent = False
        if not sent:
            lost = [m[1]["step"] for m in messages if m[0] == "step"]
            self._lost_steps += lost
            self._packer.reset()  # the assembler never saw these values: resend in full
            captured = {m[3]["step"] for m in messages if m[0] == "cap"}
            if captured - set(lost):
                self._doomed |= captured - set(lost)
                self.count_error(
                    "captures_dropped",
                    "launch captures went out with a dropped frame: their steps are dropped",
                )
            if any(m[3].get("kernel") == BOUND_PTRS for m in messages if m[0] == "cap"):
                self.ptrs_grabbed.clear()  # captured once per context: capture them again
        return sent
