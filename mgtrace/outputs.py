"""Where a command may write: never over, or above, one of its own inputs."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from mgtrace.errors import OutputError, UsageError


def refuse_overwriting_inputs(output: Path, *inputs: Path | None) -> None:
    """Refuse an output that is, holds, or lies inside one of the command's inputs, --force
    or not: a slip of the keyboard must not destroy the trace or log being studied."""
    out = Path(output).resolve()
    for given in inputs:
        if given is None:
            continue
        src = Path(given).resolve()
        if out == src or out in src.parents:
            raise UsageError(
                f"{output} is (or holds) the input {given}; write the output elsewhere"
            )
        if src in out.parents:
            raise UsageError(f"{output} lies inside the input {given}; write the output elsewhere")


def require_writable_parent(output: Path, what: str) -> None:
    """Refuse, before any work, an ``output`` whose nearest existing folder above it is not a
    directory this user can write (``what``: how the sentence names the output).

    Writable is tried, not inferred: a file is created there and removed again, since
    permission bits say nothing for root, a read-only mount or /proc."""
    above = Path(os.path.abspath(output)).parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"cannot write {what}: {above} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mgtrace-probe-", dir=above)
    except OSError as exc:  # ENOENT: a file system that makes no files (/proc) says only that
        why = "" if exc.errno == errno.ENOENT else f" ({exc.strerror or exc})"
        raise OutputError(f"cannot write {what}: no file can be created in {above}{why}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def require_output_folder(output: Path, what: str) -> None:
    """``require_writable_parent``, and the folder ``output`` goes in exists: a command
    writes its output into a folder the user made and makes none (a typo in a folder's name
    must not leave a new tree of folders behind)."""
    require_writable_parent(output, what)
    if not Path(os.path.abspath(output)).parent.is_dir():
        raise OutputError(f"the directory {Path(output).parent} does not exist")


def refuse_a_trace_inside_a_trace(output: Path) -> None:
    """Refuse to write a trace into another trace's folder: the outer trace's readers never
    see it, and replacing the outer one (--force) would remove it without a word."""
    above = trace_holding(output)
    if above is not None:
        raise UsageError(f"{output} lies inside the trace {above}; write the new trace elsewhere")


def trace_holding(path: Path) -> Path | None:
    """The trace whose folder ``path`` lies in, if any: what is written there is none of
    the trace's files, and ``--force`` there could overwrite one of them."""
    from mgtrace.schemas.manifest import is_trace_directory

    return next((p for p in Path(os.path.abspath(path)).parents if is_trace_directory(p)), None)
