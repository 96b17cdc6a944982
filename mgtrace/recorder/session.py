"""One recording in one process: the trace writer, the capture ring and the recorder thread.

The engine thread only touches ``begin_step``, ``rec`` (a dict the hooks fill with array
copies and object references) and ``grab``. Everything else, assembling rows, waiting for
captures to land and handing steps to the writer, happens on the ``mgtrace-recorder``
thread, which never holds up the engine: it polls events, it never waits on them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.recorder import assemble as asm
from mgtrace.recorder.capture import CaptureRing
from mgtrace.recorder.step_tables import StepTables
from mgtrace.schemas.manifest import RunMetadata
from mgtrace.schemas.writer import TraceWriter

log = logging.getLogger("mgtrace.recorder")

YIELD_EVERY_S = 0.0005
BATCH_STEPS = 64  # steps per hand-over to the writer
BATCH_S = 0.5  # or this old, whichever comes first
IDLE_POLL_S = 0.01  # few wake-ups: each one takes the GIL from the engine
I32 = np.int32


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
    ) -> None:
        self.out = Path(out)
        self.rank = rank
        self.kind = kind
        self.block_size = mamba_block_size
        self.writer = writer or TraceWriter(self.out, run=run, source=source)
        self.max_steps = max_steps
        self.deadline = None if duration_s is None else time.monotonic() + duration_s
        self.ring: CaptureRing | None = None
        self.live = True
        self.stop_requested = False
        self.step = -1
        self.steps_recorded = 0
        self.rec: dict[str, Any] | None = None
        self.deferred_batch_step: int | None = None  # V2 PP: batch step of a deferred postprocess
        self.pp_origin: dict[int, int] = {}  # id(PendingRecv) -> step that pushed it
        self.on_limit: Any = None  # called once, on the engine thread, when a limit stops it
        self.rows = 0
        self.hook_errors = 0
        self._logged: set[str] = set()
        self._records: deque[dict[str, Any]] = deque()
        self._by_step: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        self._launches: dict[int, list[dict[str, Any]]] = {}  # launch rows wait for their step
        self._batch: list[tuple[int, dict[str, Any]]] = []  # assembled steps not yet handed over
        self._batch_started = time.monotonic()
        self._tables = StepTables(kind, mamba_block_size)
        self._closing = threading.Event()
        self._last_yield = 0.0
        self._force = False  # set on close when the device never finished: stop waiting
        self._thread = threading.Thread(target=self._loop, name="mgtrace-recorder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    def begin_step(self, scheduler_output: Any) -> bool:
        """Close the previous step and open the next; False once a limit says stop."""
        if self.rec is not None:
            self._records.append(self.rec)
            self.steps_recorded += 1
            self.rec = None
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
        self.rec = {
            "step": self.step,
            "wall_ns": time.monotonic_ns(),
            "so": scheduler_output,
            "moves": [],
        }
        return True

    def end_step(self) -> None:
        """Close the open step without opening another (a batch that is not a step)."""
        if self.rec is not None:
            self._records.append(self.rec)
            self.steps_recorded += 1
            self.rec = None

    def grab(self, tensors: list[Any], lengths: list[int], tag: dict[str, Any]) -> None:
        ring = self.ring
        if ring is None:
            ring = self.ring = CaptureRing(tensors[0].device)
        if not ring.grab(tensors, lengths, tag):
            self.count_error("capture_ring_full", "a launch found no free capture slot")

    def hook_failed(self, name: str, exc: BaseException) -> None:
        """Count a hook's exception; log the first of each hook. Never raises."""
        self.hook_errors += 1
        try:
            self.count_error(f"hook:{name}", f"{exc.__class__.__name__}: {exc}")
            if name not in self._logged:
                self._logged.add(name)
                log.warning(
                    "mgtrace: hook %s failed (%s: %s); recording continues, the "
                    "failure is counted in the manifest",
                    name,
                    exc.__class__.__name__,
                    exc,
                )
        except Exception:
            pass

    def count_error(self, kind: str, message: str) -> None:
        with contextlib.suppress(Exception):
            self.writer.count_error(kind, message)

    # ------------------------------------------------------------ any thread
    def status(self) -> dict[str, Any]:
        st = self.writer.stats()
        ring = self.ring
        return {
            "steps": self.steps_recorded,
            "rows": self.rows,
            "bytes": st.bytes_written,
            "drops": st.steps_dropped + (ring.dropped if ring else 0),
            "hook_errors": self.hook_errors,
            "writer_failed": st.failed,
            "out": str(self.out),
        }

    def close(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Flush: the open step, captures still in flight, the writer. Not the engine thread."""
        self.live = False
        if self.rec is not None:
            self._records.append(self.rec)
            self.steps_recorded += 1
            self.rec = None
        self._closing.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._force = True
            self._thread.join(2.0)
        if self.ring is not None and self.ring.pending:
            self.count_error("capture_unfinished", f"{self.ring.pending} captures never landed")
        manifest = self.writer.close()
        return {"complete": manifest.complete, **self.status()}

    # ------------------------------------------------------------ recorder thread
    def _loop(self) -> None:
        while True:
            busy = self._drain()
            if (
                self._closing.is_set()
                and not self._records
                and not (self.ring and self.ring.pending and not self._force)
            ):
                self._guard("orphans", self._flush_orphans)
                self._guard("flush", self._flush_batch)
                return
            if self._batch and time.monotonic() - self._batch_started > BATCH_S:
                self._guard("flush", self._flush_batch)
            if not busy:
                time.sleep(IDLE_POLL_S)

    def _flush_orphans(self) -> None:
        """Launch rows of a step whose bookkeeping never closed (stopped mid-step)."""
        for step, parts in sorted(self._launches.items()):
            self.writer.write_step(self.rank, step, {"launches": asm.merge_columns(parts)})
        self._launches.clear()

    def _drain(self) -> bool:
        busy = False
        if self.ring is not None:
            for arrays, tag in self.ring.reap():
                busy = True
                self._guard("launch", self._on_capture, arrays, tag)
        while self._records:
            rec = self._records[0]
            oldest = self.ring.oldest_pending_tag() if self.ring is not None else None
            if oldest is not None and oldest["step"] <= rec["step"] and not self._force:
                break
            self._records.popleft()
            busy = True
            self._guard("step", self._on_step, rec)
            now = time.perf_counter()
            if now - self._last_yield > YIELD_EVERY_S:
                # hand the GIL back well before the interpreter's 5 ms switch interval
                time.sleep(0)
                self._last_yield = time.perf_counter()
        return busy

    def _guard(self, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self.hook_failed(f"assemble_{what}", exc)

    def _on_capture(self, arrays: list[np.ndarray], tag: dict[str, Any]) -> None:
        got = dict(zip(tag["names"], arrays, strict=True))
        kernel = tag["kernel"]
        n = tag["n"]
        slots = got.get("idx_mapping")
        batch_row = np.arange(n, dtype=I32)
        if slots is not None:
            slots = slots[:n].astype(np.int64)
            cols = {k: asm.gather_slots(v, slots) for k, v in got.items() if k != "idx_mapping"}
            req_slot = slots.astype(I32)
        else:
            cols = {k: v[:n] for k, v in got.items()}
            req_slot = batch_row
        per_step = self._by_step.setdefault(tag["batch_step"], {})
        per_step[kernel] = cols
        if kernel not in asm.KERNEL_CODE:
            return  # a snapshot that feeds batch_rows only
        self._write_launch(tag, cols, batch_row, req_slot)

    def _write_launch(
        self,
        tag: dict[str, Any],
        cols: dict[str, np.ndarray],
        batch_row: np.ndarray,
        req_slot: np.ndarray,
    ) -> None:
        n = len(batch_row)
        rule = tag["row_rule"]
        out: dict[str, Any] = {
            "kernel": np.full(n, asm.KERNEL_CODE[tag["kernel"]], I32),
            "batch_row": batch_row,
            "batch_step": tag["batch_step"],
            "req_slot": req_slot,
            "row_rule": np.full(n, asm.RULE_CODE[rule], I32),
            "bt_row": req_slot if rule == "req_slot" else batch_row,
            "bt_table": np.full(n, asm.TABLE_CODE[tag["bt_table"]], I32),
            "bt_step": tag["bt_step"],
            "mode": np.full(n, asm.MODE_CODE[tag["mode"]] if tag.get("mode") else -1, I32),
        }
        for name, values in cols.items():
            out[name] = values.astype(I32)
        if tag["kernel"] == "precopy" and "token_bias" in cols:
            out["num_accepted"] = (cols["token_bias"] + 1).astype(I32)
        cpu = dict(tag.get("cpu") or {})
        if tag["kernel"] == "precopy" and "token_bias" in cpu:
            cpu["num_accepted"] = cpu["token_bias"] + 1  # the CPU's view of what it read
        for name, held in cpu.items():
            kernel_values = out.get(name)
            if kernel_values is None or len(held) != n:
                continue
            if name == "num_accepted":
                diff = asm.masked_where_equal(held.astype(I32), kernel_values)
                if diff is not None:
                    out["num_accepted_cpu"] = diff
            elif (held != kernel_values).any():
                rows = np.nonzero(held != kernel_values)[0][:4].tolist()
                self.count_error(
                    "launch_cpu_mismatch",
                    f"step {tag['step']} {tag['kernel']}: {name} the kernel read differs from "
                    f"the CPU-staged value at batch rows {rows}",
                )
        self._launches.setdefault(tag["step"], []).append(out)

    def _on_step(self, rec: dict[str, Any]) -> None:
        captured = self._by_step.pop(rec["step"], {})
        for stale in [s for s in self._by_step if s < rec["step"] - 64]:
            del self._by_step[stale]  # deferred (PP) captures that no step will claim
        tables = self._tables.build(rec, captured)
        launches = self._launches.pop(rec["step"], None) or []
        rows = tables.get("batch_rows")
        if rows is not None:
            self.rows += len(rows["req_id"])
        if self._batch and self._batch[-1][0] + 1 != rec["step"]:
            self._flush_batch()
        self._batch.append((rec["step"], tables))
        # each launch stays its own chunk: merged here, its partly-null columns would turn
        # into Python lists; kept apart, every chunk is plain arrays
        self._batch += [(rec["step"], {"launches": part}) for part in launches]
        if len(self._batch) >= BATCH_STEPS:
            self._flush_batch()

    def _flush_batch(self) -> None:
        """Hand the buffered steps to the writer as one chunk per table: far less work per
        step for the writer thread, which shares the engine's GIL."""
        batch, self._batch = self._batch, []
        self._batch_started = time.monotonic()
        if batch:
            self.writer.write_steps(self.rank, batch[0][0], batch[-1][0], asm.merge_steps(batch))
