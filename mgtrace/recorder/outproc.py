"""Where assembly and writing run: the assembler process, or the in-process fallback.

``ProcessSink`` starts ``python -m mgtrace.recorder.outproc`` (fork+exec, as the spawn
start method does; nothing is forked with CUDA state and no ``__main__`` is re-imported)
and writes frames of raw messages (``wire``) into a pipe. The child assembles rows, converts
them to Arrow and writes Parquet with its own GIL, and reports its counters back on a
second pipe as JSON lines. Only the in-process recorder thread touches a sink.

``ThreadSink`` runs the same ``Assembler`` on the recorder thread and the writer on a
thread of this process: the fallback for platforms without a usable child process, chosen
explicitly (``MGTRACE_RECORDER_ASSEMBLER=thread``) and named in the manifest's source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from mgtrace.recorder import wire
from mgtrace.recorder.assembler import Assembler
from mgtrace.schemas.manifest import MANIFEST_NAME, RunMetadata, read_manifest_file, save_manifest
from mgtrace.schemas.writer import TraceWriter

MODE_ENV = "MGTRACE_RECORDER_ASSEMBLER"
SCHED_ENV = "MGTRACE_RECORDER_ASSEMBLER_SCHED"  # nice (default) | idle
STATS_EVERY_S = 0.2
PIPE_BYTES = 1 << 20  # room for many steps while the child catches up
MAX_BACKLOG = 64 << 20  # frames held here while the pipe is full; more are dropped
CHILD_NICE = 10  # the child yields the CPU to the engine on a loaded host

log = logging.getLogger("mgtrace.recorder")


def chosen_sched() -> str:
    """How the assembler process yields the CPU: ``nice`` (nice 10, the default) or
    ``idle`` (SCHED_IDLE). ``idle`` keeps a pinned engine's slowest steps faster when the
    engine thread sleeps through its device waits, but starves the assembler, and so drops
    steps, wherever every core it may use stays busy, e.g. an engine pinned to one core
    that spin-waits on the device; see docs/recording.md."""
    sched = os.environ.get(SCHED_ENV) or "nice"
    if sched not in ("nice", "idle"):
        raise ValueError(f"{SCHED_ENV} must be 'nice' or 'idle', not {sched!r}")
    return sched


def chosen_mode(explicit: str | None = None) -> str:
    mode = explicit or os.environ.get(MODE_ENV) or "process"
    if mode not in ("process", "thread"):
        raise ValueError(f"{MODE_ENV} must be 'process' or 'thread', not {mode!r}")
    return mode


class ThreadSink:
    """Assembly on the calling (recorder) thread, writing on the writer's thread."""

    mode = "thread"

    def __init__(self, writer: TraceWriter, *, rank: int, kind: str, block_size: int) -> None:
        self.writer = writer
        self.assembler = Assembler(writer, rank=rank, kind=kind, block_size=block_size)

    @property
    def failed(self) -> str | None:
        return self.writer.stats().failed

    def abandon(self) -> None:
        """In a forked child: the writer's thread stayed in the parent; nothing to release."""

    def send(self, messages: list[tuple[Any, ...]], *, essential: bool = False) -> bool:
        for m in messages:
            self.assembler.apply(m)
        return True

    def tick(self) -> None:
        self.assembler.tick()

    def stats(self) -> dict[str, Any]:
        st = self.writer.stats()
        return {
            "rows": self.assembler.rows,
            "bytes": st.bytes_written,
            "steps_dropped": st.steps_dropped + st.malformed_steps,
            "assemble_errors": self.assembler.errors,
            "failed": st.failed,
        }

    def wait_ready(self, timeout_s: float) -> bool:
        return True

    def backlog_bytes(self) -> int:
        return 0  # nothing waits: the recorder thread assembles as it forwards

    def close(self, timeout_s: float) -> bool:
        self.assembler.finish()
        return self.writer.close().complete


class ProcessSink:
    """The assembler process and the two pipes to it."""

    mode = "process"

    def __init__(
        self,
        out: Path,
        *,
        run: RunMetadata,
        source: dict[str, Any],
        rank: int,
        kind: str,
        block_size: int,
    ) -> None:
        sched = chosen_sched()  # refused before anything is opened
        self.out = out
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            # the same refusal the writer gives, before a child is started
            TraceWriter(out, run=run, source=source).close()
        # failed: nothing more reaches the trace (the child is gone, or its writer failed);
        # _dead: the child or its pipe is gone, so nothing more is written to it either
        self.failed: str | None = None
        self._dead: str | None = None
        self._stats: dict[str, Any] = {}
        self._partial = b""
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        with contextlib.suppress(Exception):  # Linux only; a small pipe still works
            import fcntl

            fcntl.fcntl(self._to_child, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
        os.set_blocking(self._from_child, False)
        os.set_blocking(self._to_child, False)
        self._out: deque[memoryview] = deque()  # frames (or their tails) not yet written
        self._backlog = 0
        config = {
            "out": str(out),
            "run": dataclasses.asdict(run),
            "source": source,
            "rank": rank,
            "kind": kind,
            "block_size": block_size,
            "sched": sched,
            "in_fd": to_child_r,
            "out_fd": from_child_w,
        }
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mgtrace.recorder.outproc", json.dumps(config, default=str)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            for fd in (self._to_child, self._from_child):
                os.close(fd)
            raise RuntimeError(
                f"cannot start the assembler process ({exc}); set {MODE_ENV}=thread to "
                "assemble in this process instead"
            ) from None
        finally:
            os.close(to_child_r)
            os.close(from_child_w)

    # ------------------------------------------------------------ recorder thread
    def send(self, messages: list[tuple[Any, ...]], *, essential: bool = False) -> bool:
        """Queue one frame and write what the pipe takes now; never blocks. False when the
        frame was not queued (the child is gone, or, unless ``essential``, behind by more
        than ``MAX_BACKLOG`` bytes): the caller counts its steps as dropped."""
        if self.failed is not None or (self._backlog > MAX_BACKLOG and not essential):
            self._flush()
            return False
        frame = wire.encode(messages)
        self._out.append(memoryview(frame))
        self._backlog += len(frame)
        self._flush()
        return True

    def _flush(self) -> None:
        while self._out and self._dead is None:
            view = self._out[0]
            try:
                n = os.write(self._to_child, view)
            except BlockingIOError:
                return
            except OSError as exc:
                self._died(f"the assembler process stopped reading ({exc.__class__.__name__})")
                return
            self._backlog -= n
            if n == len(view):
                self._out.popleft()
            else:
                self._out[0] = view[n:]

    def abandon(self) -> None:
        """In a forked child: let go of the parent's pipes to its assembler (held open here,
        they would keep that assembler from ever seeing the end of its input)."""
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.failed = self._dead = "abandoned in a forked process"

    def tick(self) -> None:
        self._flush()
        self._read_stats()
        if self._dead is None and self.proc.poll() is not None:
            self._died(f"the assembler process exited with code {self.proc.returncode}")

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the child has reported once (it has imported and opened the trace);
        polls what the recorder thread reads. Not for the engine thread."""
        deadline = time.monotonic() + timeout_s
        while not self._stats and self.failed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(self._stats)

    def backlog_bytes(self) -> int:
        """Frames the pipe has not taken yet: above zero, the assembler is behind by more
        than the pipe holds, and at ``MAX_BACKLOG`` steps start to drop."""
        return self._backlog

    def stats(self) -> dict[str, Any]:
        st = dict(self._stats)
        st.setdefault("rows", 0)
        st.setdefault("bytes", 0)
        st.setdefault("steps_dropped", 0)
        st.setdefault("assemble_errors", 0)
        st.setdefault("failed", None)
        if self.failed is not None:
            st["failed"] = self.failed
        return st

    def close(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._out and self._dead is None and time.monotonic() < deadline:
            self._flush()
            if self._out:
                self._read_stats()  # keep the child's reports flowing while it catches up
                if self.proc.poll() is not None:
                    self._died(f"the assembler process exited with code {self.proc.returncode}")
                time.sleep(0.002)
        if self._out and self._dead is None:
            self._died(f"the assembler process did not catch up within {timeout_s:.0f} s")
        if self._dead is None:
            # the end mark: the child tells a closed recording from an engine that died
            end = wire.encode([("end",)])
            self._out.append(memoryview(end))
            self._backlog += len(end)
            until = max(deadline, time.monotonic() + 1.0)  # a few bytes, into a drained pipe
            while self._out and self._dead is None and time.monotonic() < until:
                self._flush()
                if self._out:
                    time.sleep(0.002)
        with contextlib.suppress(OSError):
            os.close(self._to_child)  # end of input: the child flushes and exits
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._died(f"the assembler process did not finish within {timeout_s:.0f} s")
        self._read_stats()
        with contextlib.suppress(OSError):
            os.close(self._from_child)
        if self.proc.returncode != 0 and self._dead is None:
            self._died(f"the assembler process exited with code {self.proc.returncode}")
        return bool(self._stats.get("complete")) and self.failed is None

    # ------------------------------------------------------------ helpers
    def _read_stats(self) -> None:
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._partial += chunk
        *lines, self._partial = self._partial.split(b"\n")
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                self._stats = json.loads(line)
                break
        if self.failed is None and self._stats.get("failed"):
            # the child's writer failed: it drops every step from now on, so the
            # recording stops as for a dead child
            self.failed = str(self._stats["failed"])

    def _died(self, why: str) -> None:
        self._dead = why
        if self.failed is None:
            self.failed = why


def mark_failed(
    out: Path,
    why: str,
    errors: dict[str, dict[str, Any]],
    drops: list[int],
    rank: int,
    steps: int,
) -> int | None:
    """The engine process's account of a failed assembler: the manifest says so, and
    counts as dropped every one of the ``steps`` opened (0..steps-1) and ``drops`` that no
    written part holds and no drop counts yet: the ones the assembler had taken and lost.
    Returns the steps the manifest counts as dropped; None when it could not be updated."""
    path = out / MANIFEST_NAME
    try:
        manifest = read_manifest_file(path)
    except Exception:
        return None
    manifest.complete = False
    manifest.errors.setdefault("writer", {"count": 1, "first": why})
    for kind, entry in errors.items():
        manifest.errors.setdefault(kind, dict(entry))
    accounted = np.zeros(max([steps, *(s + 1 for s in drops)]), bool)
    held = [
        (p.min_step, p.max_step)
        for p in manifest.parts
        if p.table == "steps" and p.rank in (rank, None) and p.min_step is not None
    ]
    counted = [(first, last) for r, first, last in manifest.drops.step_ranges if r == rank]
    for first, last in held + counted:
        accounted[max(first, 0) : last + 1] = True
    for step in np.flatnonzero(~accounted).tolist():
        manifest.drops.steps += 1
        manifest.drops.add_step(rank, step)
    if manifest.closed_unix is None:
        manifest.closed_unix = time.time()
    try:
        save_manifest(out, manifest)
    except Exception as exc:  # e.g. the disk is full: the trace stays as the child left it
        log.warning("mgtrace: cannot record the failure in %s: %s", path, exc)
        return None
    return manifest.drops.total_steps


# ---------------------------------------------------------------- the child
def _yield_to_engine(sched: str) -> None:
    """Lower this process's claim on the CPU, as ``chosen_sched`` chose. A child that falls
    behind fills the pipe, and steps are then dropped and counted, never waited for."""
    if sched == "idle":
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICE)


def _child(config: dict[str, Any]) -> int:
    import select

    from mgtrace.pandas_probe import skip_pandas_probe

    in_fd, out_fd = config["in_fd"], config["out_fd"]
    _yield_to_engine(config["sched"])
    skip_pandas_probe()  # a faster start: steps wait in the pipe until the writer runs
    writer = TraceWriter(
        config["out"], run=RunMetadata.from_dict(config["run"]), source=config["source"]
    )
    asm = Assembler(
        writer, rank=config["rank"], kind=config["kind"], block_size=config["block_size"]
    )

    def report(complete: bool | None = None) -> None:
        st = writer.stats()
        line = {
            "rows": asm.rows,
            "bytes": st.bytes_written,
            "steps_written": st.steps_written,
            "steps_dropped": st.steps_dropped + st.malformed_steps,
            "assemble_errors": asm.errors,
            "failed": st.failed,
            "complete": complete,
            "cpu_s": time.process_time(),
        }
        with contextlib.suppress(OSError):
            os.write(out_fd, (json.dumps(line) + "\n").encode())

    buf = bytearray()
    last = 0.0
    while True:
        if select.select([in_fd], [], [], STATS_EVERY_S)[0]:
            chunk = os.read(in_fd, PIPE_BYTES)
            if not chunk:
                break  # end of input: the engine closed the pipe
            buf += chunk
            for messages in wire.take_frames(buf):
                for message in messages:
                    asm.apply(message)
        asm.tick()
        now = time.monotonic()
        if now - last >= STATS_EVERY_S:
            report()
            last = now
    if not asm.ended:
        writer.count_error(
            "engine_exited",
            "the engine process ended without stopping the recording (it exited or was "
            "killed): the steps it had not yet handed over are missing",
        )
    asm.finish()
    try:
        manifest = writer.close(complete=asm.ended)
    except Exception as exc:  # e.g. the disk is full: the engine process says the rest
        print(f"mgtrace: the assembler process could not close the trace: {exc}", file=sys.stderr)
        report(False)
        return 1
    report(manifest.complete)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_child(json.loads(sys.argv[1])))
    except Exception as exc:  # one line into the engine's stderr, never a traceback
        print(
            f"mgtrace: the assembler process failed: {exc.__class__.__name__}: {exc}",
            file=sys.stderr,
        )
        sys.exit(1)
