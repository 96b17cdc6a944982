"""Rows from raw step records: the work that runs off the engine thread.

The recorder's in-process side forwards, in order, the captures it reaped and the step
records the hooks filled; an ``Assembler`` turns them into trace rows and hands them to a
``TraceWriter``. It runs in the assembler process (``outproc``) or, as the explicit
fallback, on the in-process recorder thread. Either way it sees the same messages in the
same order, so the trace is the same.

Messages (tuples), in the wire form of ``wire.Packer``: ``("cap", raw, lengths, tag)`` a
landed capture (int32 bytes of its vectors end to end), ``("step", rec)`` a closed step
record, ``("err", kind, message)`` an error counted in the engine process,
``("drop", step)`` a step the engine process dropped.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mgtrace.recorder import assemble as asm
from mgtrace.recorder import wire
from mgtrace.recorder.failures import count_failure
from mgtrace.recorder.step_tables import StepTables
from mgtrace.schemas.writer import TraceWriter

BATCH_STEPS = 64  # steps per hand-over to the writer
BATCH_S = 0.5  # or this old, whichever comes first
I32 = np.int32


def split_flat(flat: np.ndarray, lengths: tuple[int, ...]) -> list[np.ndarray]:
    arrays, start = [], 0
    for n in lengths:
        arrays.append(flat[start : start + n])
        start += n
    return arrays


class Assembler:
    """Per-recording assembly state: captures waiting for their step, the writer batch."""

    def __init__(self, writer: TraceWriter, *, rank: int, kind: str, block_size: int) -> None:
        self.writer = writer
        self.rank = rank
        self.rows = 0
        self.ended = False  # the engine side closed the recording (the "end" mark)
        self.errors = 0  # assembly failures (counted in the manifest as hook:assemble_*)
        self._logged: set[str] = set()
        self._by_step: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        self._launches: dict[int, list[dict[str, Any]]] = {}  # launch rows wait for their step
        self._batch: list[tuple[int, dict[str, Any]]] = []  # assembled steps not yet handed over
        self._batch_started = time.monotonic()
        self._tables = StepTables(kind, block_size)
        self._wire = wire.Unpacker()
        self._bound_table: str | None = None  # V2: the table the copy kernels were bound to
        self._dropped: set[int] = set()  # steps the engine process dropped

    # ------------------------------------------------------------ input
    def apply(self, message: tuple[Any, ...]) -> None:
        what = message[0]
        if what == "cap":
            self._guard("launch", self._on_wire_capture, *message[1:])
        elif what == "step":
            rec = message[1]
            if not self._guard("step", lambda: self._on_step(self._wire.record(rec))):
                # a step that cannot be assembled is dropped and counted, its launches too
                step = rec.get("step") if isinstance(rec, dict) else None
                if isinstance(step, int):
                    self.drop_step(step)
        elif what == "err":
            self.writer.count_error(message[1], message[2])
        elif what == "drop":
            self.drop_step(message[1])
        elif what == "end":
            self.ended = True

    def drop_step(self, step: int) -> None:
        """A step the engine process could not forward: counted with the writer's drops, and
        none of its launches written, whether they came before this notice or come after."""
        self.writer.count_dropped_step(self.rank, step)
        self._dropped.add(step)
        self._launches.pop(step, None)

    def tick(self) -> None:
        """Hand over a batch that has waited long enough."""
        if self._batch and time.monotonic() - self._batch_started > BATCH_S:
            self._flush_batch()

    def finish(self) -> None:
        self._guard("orphans", self._flush_orphans)
        self._flush_batch()

    # ------------------------------------------------------------ assembly
    def _guard(self, what: str, fn: Any, *args: Any) -> bool:
        """Run ``fn``; False when it raised (counted, the first of each kind logged)."""
        try:
            fn(*args)
        except Exception as exc:
            self.errors += 1
            count_failure(self.writer.count_error, self._logged, f"assemble_{what}", exc)
            return False
        return True

    def _flush_orphans(self) -> None:
        """Launch rows of a step whose bookkeeping never closed (stopped mid-step)."""
        for step, parts in sorted(self._launches.items()):
            self.writer.write_step(self.rank, step, {"launches": asm.merge_columns(parts)})
        self._launches.clear()

    def _on_wire_capture(self, raw: bytes, lengths: tuple[int, ...], tag: dict[str, Any]) -> None:
        flat = np.frombuffer(bytearray(raw), dtype=I32)
        self._on_capture(split_flat(flat, lengths), self._wire.tag(tag))

    def _on_capture(self, arrays: list[np.ndarray], tag: dict[str, Any]) -> None:
        if tag["kernel"] == asm.BOUND_PTRS:
            self._name_bound_table(arrays[0], tag["tables"], tag["step"])
            return
        if tag["step"] in self._dropped:
            return
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

    def _name_bound_table(self, words: np.ndarray, tables: dict[str, list[int]], step: int) -> None:
        """Which table set the align context's pointers point at; launches then name it
        instead of the one the context's class implies."""
        ptrs = np.ascontiguousarray(words, dtype=I32).view(np.int64).tolist()
        for name, known in tables.items():
            if known and ptrs[: len(known)] == known:
                self._bound_table = name
                return
        self.writer.count_error(
            "bound_table_unmatched",
            f"step {step}: the align context's block-table pointers match neither the source "
            "nor the input tables; launches name the table its class implies",
        )

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
            "bt_table": np.full(n, asm.TABLE_CODE[self._bound_table or tag["bt_table"]], I32),
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
                self.writer.count_error(
                    "launch_cpu_mismatch",
                    f"step {tag['step']} {tag['kernel']}: {name} the kernel read differs from "
                    f"the CPU-staged value at batch rows {rows}",
                )
        self._launches.setdefault(tag["step"], []).append(out)

    def _write_scalar_precopy(self, rec: dict[str, Any]) -> None:
        """V1 without an align context: the step's single state copies, as one precopy."""
        req_ids = rec.get("req_ids") or []
        if not req_ids:
            return
        cols = asm.scalar_precopy_columns(
            req_ids, rec.get("sidx_after") or {}, rec["scalar_copies"]
        )
        tag = {
            "step": rec["step"],
            "kernel": "precopy",
            "batch_step": rec["step"],
            "bt_step": rec["step"],
            "row_rule": "req_slot",
            "bt_table": "v1",
            "mode": None,
        }
        rows = np.arange(len(req_ids), dtype=I32)
        self._write_launch(tag, cols, rows, rows)

    def _on_step(self, rec: dict[str, Any]) -> None:
        if len(self._dropped) > 4096:  # a capture comes at most a few steps after its drop
            self._dropped = {s for s in self._dropped if s >= rec["step"] - 64}
        captured = self._by_step.pop(rec["step"], {})
        for stale in [s for s in self._by_step if s < rec["step"] - 64]:
            del self._by_step[stale]  # deferred (PP) captures that no step will claim
        tables = self._tables.build(rec, captured)
        if "scalar_copies" in rec:
            self._write_scalar_precopy(rec)
        for group, slot in self._tables.v2_bt.take_unseen():
            self.writer.count_error(
                "block_table_unseen_columns",
                f"step {rec['step']}: Mamba group {group} slot {slot} holds block ids "
                "written before recording began; those columns read as -1",
            )
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
        """Hand the buffered steps to the writer as one chunk per table."""
        batch, self._batch = self._batch, []
        self._batch_started = time.monotonic()
        if batch and not self._guard("flush", self._hand_over, batch):
            for step in sorted({step for step, _ in batch}):  # none written, all counted
                self.writer.count_dropped_step(self.rank, step)

    def _hand_over(self, batch: list[tuple[int, dict[str, Any]]]) -> None:
        self.writer.write_steps(self.rank, batch[0][0], batch[-1][0], asm.merge_steps(batch))
