"""Whole files or nothing: write under a temporary name in the same directory, then rename."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from mgtrace.errors import OutputError


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a new temporary file beside ``path`` and rename it over ``path``.

    The temporary name is unique per process and thread and opened exclusively; the file gets
    the usual permissions (the umask applies), unlike a mkstemp file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "xb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # named by the file asked for, not the temporary one
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise
