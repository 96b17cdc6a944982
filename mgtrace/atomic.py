"""Whole files or nothing: write under a temporary name in the same directory, then rename.

A directory (a trace) that replaces another is built under a hidden sibling name and swapped
in only once it is complete, so that a failed or interrupted write leaves the old one as it
was."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import itertools
import logging
import os
import re
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from mgtrace.errors import OutputError

_RENAME_EXCHANGE = 2  # renameat2 flag: swap two existing paths in one step
_AT_FDCWD = -100
_sibling_seq = itertools.count()
log = logging.getLogger("mgtrace")


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a new temporary file beside ``path`` and rename it over ``path``.

    The temporary name is unique per process and thread and opened exclusively; the file gets
    the usual permissions (the umask applies), unlike a mkstemp file. A symbolic link is
    written through (its target is replaced, the link stays), and a device, a FIFO or one of
    this process's open files (``/dev/stdout``) is written in place: renaming a file over it
    would replace the device, or the file a shell opened.
    """
    path = Path(path)
    if is_a_stream(path):
        _write_in_place(path, write)
        return
    if path.is_symlink():
        path = Path(os.path.realpath(path))
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


_STANDARD_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}


def _own_descriptor(path: Path) -> int | None:
    """The descriptor ``path`` names when it is one of this process's open files
    (``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N``), else None."""
    name = os.path.abspath(path)  # not resolved: /dev/stdout leads to /proc/self/fd/1
    if name in _STANDARD_STREAMS:
        return _STANDARD_STREAMS[name]
    found = re.fullmatch(rf"/dev/fd/(\d+)|/proc/(?:self|thread-self|{os.getpid()})/fd/(\d+)", name)
    return None if found is None else int(found.group(1) or found.group(2))


def is_a_stream(path: Path) -> bool:
    """A device, a FIFO, or a name for one of this process's open files (``/dev/stdout``,
    which may lead to a regular file the shell opened): written in place, never replaced. A
    regular file elsewhere under /dev or /proc (``/dev/shm``) is a file like any other."""
    if _own_descriptor(path) is not None:
        return True
    return path.exists() and not path.is_file() and not path.is_dir()


def _write_in_place(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write into the device or FIFO, or through the open descriptor, without truncating
    it (a shell's ``>> file`` keeps what the file held)."""
    fd = _own_descriptor(path)
    try:
        if fd is not None:
            with contextlib.suppress(Exception):  # what Python buffered goes first
                sys.stdout.flush()
                sys.stderr.flush()
            with os.fdopen(os.dup(fd), "wb") as fh:
                write(fh)
        else:
            with open(path, "wb") as fh:
                write(fh)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None


def hidden_sibling(path: Path, role: str) -> Path:
    """``.NAME.PID-N@HOST.ROLE`` beside ``path``: unique to this process, so that what a
    killed run left under such a name never stands in the way of the next run. The host
    says where PID means something: a folder on a shared file system is seen from several."""
    path = _named(path)
    stem = _sibling_stem(path.name)
    return path.with_name(f".{stem}.{os.getpid()}-{next(_sibling_seq)}@{_host()}.{role}")


SIBLING_STEM_BYTES = 120  # leaves room for ".PID-N@HOST.ROLE" within a 255-byte file name


def _sibling_stem(name: str) -> str:
    """``name`` as its hidden siblings carry it: whole when short, else cut and told apart
    by a digest of the whole (a sibling's name has to fit where ``name`` just fits)."""
    raw = name.encode(errors="surrogateescape")
    if len(raw) <= SIBLING_STEM_BYTES:
        return name
    cut = raw[: SIBLING_STEM_BYTES - 11].decode(errors="ignore")
    return f"{cut}~{hashlib.sha1(raw).hexdigest()[:10]}"


def _named(path: Path) -> Path:
    """``path`` as one whose last part names it: ``.``, ``..`` or ``x/..`` (a name the kernel
    renames nothing onto, and ``.`` none at all) made absolute, so that its siblings lie
    beside the directory it stands for."""
    path = Path(path)
    if path.name in ("", ".."):
        return Path(os.path.abspath(path))
    return path


@functools.cache
def _host() -> str:
    """This machine's name as a file name part: no dots (the role follows one)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "unknown-host"


def clear_stale_siblings(path: Path) -> list[Path]:
    """Tidy what a killed run left beside ``path``: an old directory it had moved aside
    (``.old``) goes back to ``path`` when nothing is there, so the user keeps it; other
    leftovers (a partial new one, an old one already replaced) are removed. A ``.lift``
    (``path`` itself, moved aside while a trace inside it moves up to ``path``) goes back
    too, and is removed only when empty (the move was done). Siblings of a process that
    still runs are left alone, and so are those of another host, whose pid cannot be
    checked from here: they are named in one sentence, and returned. A name without a host
    (an older mgtrace's) is judged by its pid."""
    path = _named(path)
    pattern = re.compile(
        rf"\.{re.escape(_sibling_stem(path.name))}\.(\d+)-\d+(?:@([A-Za-z0-9_-]+))?\.(new|old|lift)"
    )
    foreign: list[Path] = []
    try:
        # a new recording cut short in its lift (it holds steps) goes back before an old one
        order = {"lift": 0, "old": 1}
        entries = sorted(path.parent.iterdir(), key=lambda p: order.get(p.suffix[1:], 2))
    except OSError:
        return foreign  # the command says so when it writes there
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None:
            continue
        if found.group(2) not in (None, _host()):
            foreign.append(entry)
            continue
        if _is_running(int(found.group(1))):
            continue
        with contextlib.suppress(OSError):
            if found.group(3) != "new" and not (path.exists() or path.is_symlink()):
                os.rename(entry, path)
            elif found.group(3) == "lift":
                entry.rmdir()  # only an empty one: what it holds may be the only trace
            else:
                remove_tree(entry)
    if foreign:
        log.warning(
            "mgtrace: left alone beside %s what a run on another host left (its process cannot "
            "be checked from here; remove it once that run is over): %s",
            path,
            ", ".join(e.name for e in foreign),
        )
    return foreign


def remove_tree(path: Path) -> None:
    """Remove a directory, or the link that stands for one (not what it points to)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def replacing_directory(new: Path, dest: Path) -> Iterator[None]:
    """Put the complete directory ``new`` at ``dest``, run the body, then remove what was at
    ``dest`` before. When the body (or the swap) raises, the old directory is back at
    ``dest`` as it was and the new one at ``new``, for the caller to remove.

    Where the kernel can swap two paths in one step (Linux renameat2), ``dest`` always
    names one of them; elsewhere the old one is renamed aside first, and a run killed
    between the two renames leaves it under a ``.old`` name that ``clear_stale_siblings``
    puts back."""
    new, dest = Path(new), _named(dest)
    old: Path | None = None  # where the old directory is while the body runs
    if dest.exists() or dest.is_symlink():
        if _exchange(new, dest):
            old = new
        else:
            old = hidden_sibling(dest, "old")
            os.rename(dest, old)
            try:
                os.rename(new, dest)
            except BaseException:
                os.rename(old, dest)
                raise
    else:
        os.rename(new, dest)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if old is None:
                os.rename(dest, new)
            elif old == new:
                _exchange(new, dest)
            else:
                os.rename(dest, new)
                os.rename(old, dest)
        raise
    if old is not None:
        remove_tree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the system or file system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library older than glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _is_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        return True
    return True
