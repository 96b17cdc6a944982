"""Atomic install and removal of a set of attribute patches on modules and classes.

Every target is resolved before anything is replaced, so a missing target refuses the whole
set and leaves vLLM untouched; removal restores exactly what was there, including "nothing"
for an attribute that was inherited rather than defined on the patched class. Removal only
touches an attribute that still holds this set's wrapper: one patched over since (by another
tool, or another agent) keeps the patch on top, and the wrapper it calls stays in place as a
pass-through (a hook of a stopped session does nothing but call its original).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """Replace ``owner.name`` with ``make(original)``."""

    owner: Any
    name: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__name__', type(self.owner).__name__)}.{self.name}"


@contextmanager
def no_thread_switch() -> Iterator[None]:
    """Keep the GIL on this thread for the duration: the engine thread never observes a
    half-installed set. Nothing inside may block, or every other thread stalls with it."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class PatchSet:
    """A group of patches that is either fully installed or fully absent."""

    def __init__(self) -> None:
        self._applied: list[tuple[Any, str, Any, Any]] = []  # owner, name, own value, wrapper

    @property
    def installed(self) -> bool:
        return bool(self._applied)

    @property
    def labels(self) -> list[str]:
        return [f"{getattr(o, '__name__', '?')}.{n}" for o, n, _, _ in self._applied]

    def install(self, patches: list[Patch]) -> None:
        if self._applied:
            raise RuntimeError("patch set already installed")
        resolved = []
        for p in patches:
            current = getattr(p.owner, p.name, _MISSING)
            if current is _MISSING or not callable(current):
                raise AttributeError(f"{p.label} is missing")
            own = vars(p.owner).get(p.name, _MISSING) if hasattr(p.owner, "__dict__") else current
            wrapper = p.make(current)
            wrapper.__mgtrace_original__ = current  # type: ignore[attr-defined]
            resolved.append((p.owner, p.name, own, wrapper))
        with no_thread_switch():
            done: list[tuple[Any, str, Any, Any]] = []
            try:
                for owner, name, own, wrapper in resolved:
                    setattr(owner, name, wrapper)
                    done.append((owner, name, own, wrapper))
            except BaseException:
                _restore(done)
                raise
            self._applied = done

    def wrapper_for(self, owner: Any, name: str) -> Any:
        """The wrapper this set installed as ``owner.name``, or None."""
        for o, n, _own, wrapper in self._applied:
            if o is owner and n == name:
                return wrapper
        return None

    def remove(self) -> list[str]:
        """Restore every attribute still holding this set's wrapper; the labels of those
        patched over since, left as they are."""
        with no_thread_switch():
            applied, self._applied = self._applied, []
            return _restore(applied)


def _restore(applied: list[tuple[Any, str, Any, Any]]) -> list[str]:
    covered = []
    for owner, name, own, wrapper in reversed(applied):
        if hasattr(owner, "__dict__"):
            current = vars(owner).get(name, _MISSING)
        else:
            current = getattr(owner, name, _MISSING)
        if current is not wrapper:
            covered.append(f"{getattr(owner, '__name__', '?')}.{name}")
            continue
        if own is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, own)
    return covered


def original_of(fn: Any) -> Any:
    """The function a wrapper replaced, or ``fn`` itself when it is not a wrapper."""
    return getattr(fn, "__mgtrace_original__", fn)
