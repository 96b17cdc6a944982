"""The traces a command has opened.

DuckDB and pyarrow read a trace's parts by path, so a trace that another process replaces
(``simulate --force``) or removes while a command reads it fails with their words, or gives
answers that mix two traces. The command line notes every trace a command opens, and where
the command fails, asks whether one of them was replaced meanwhile to say that instead.
This module is imported by every command: it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mgtrace.errors import TraceError
    from mgtrace.schemas.reader import TraceReader

# one list per command running in this process (nested in tests that call main() inside
# main()); empty outside the command line, so that the Python API keeps no readers alive
_noting: list[list[TraceReader]] = []


def note_opened(reader: TraceReader) -> None:
    for opened in _noting:
        opened.append(reader)


@contextlib.contextmanager
def noting_opened_traces(opened: list[TraceReader]) -> Iterator[None]:
    """Append to ``opened`` every trace opened inside the block."""
    _noting.append(opened)
    try:
        yield
    finally:
        _noting.remove(opened)


def replaced_among(opened: list[TraceReader], during: str) -> TraceError | None:
    """One sentence for the first trace in ``opened`` that another process replaced or
    removed since it was opened; None where none was."""
    if not opened:
        return None
    from mgtrace.schemas.reader import replaced_error

    for reader in opened:
        replaced = replaced_error(reader, during)
        if replaced is not None:
            return replaced
    return None


def refuse_if_replaced(readers: Iterable[TraceReader], during: str) -> None:
    """Raise where one of ``readers``' traces was replaced or removed since it was opened:
    for a command about to show or write what it made of them."""
    replaced = replaced_among(list(readers), during)
    if replaced is not None:
        raise replaced


def refuse_if_any_replaced(during: str) -> None:
    """As ``refuse_if_replaced``, for every trace the running command opened."""
    for opened in _noting:
        refuse_if_replaced(opened, during)
