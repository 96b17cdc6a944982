"""SIGTERM and SIGHUP end a command the way Ctrl-C does, and all three end a DuckDB query.

Left to their default action SIGTERM and SIGHUP kill the process at once: an output being
written stays behind half-made (a hidden temporary file, a trace holding no steps), and
nothing is said. Raised as an interruption instead, every cleanup that Ctrl-C runs runs for
them too, and ``mgtrace.cli.main`` names the signal and exits 128 + its number, as a shell
reports a process killed by it. A query DuckDB is running is interrupted through its
connection: an exception raised from a handler inside DuckDB can be swallowed there.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


class Terminated(KeyboardInterrupt):
    """An interruption by a signal other than SIGINT (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_received: list[int] = []  # the stop signals received inside ``stop_signals_interrupt``
# DuckDB connections a signal interrupts: an exception raised from the handler while DuckDB
# runs can be swallowed there, and the query would run to its end
_connections: weakref.WeakSet[Any] = weakref.WeakSet()


def interrupt_on_stop(con: Any) -> Any:
    """Have Ctrl-C, SIGTERM and SIGHUP interrupt what ``con`` (a DuckDB connection) runs;
    returns it."""
    with contextlib.suppress(TypeError):  # a connection type without weak references
        _connections.add(con)
    return con


def _interrupt_queries() -> None:
    for con in list(_connections):
        with contextlib.suppress(Exception):
            con.interrupt()


def terminated_by(exc: BaseException | None) -> Terminated | None:
    """The ``Terminated`` that ``exc`` is or was raised from (click re-raises an
    interruption as its own ``Abort``), or else the one a stop signal raised where it was
    caught and replaced (DuckDB ends an interrupted query with an error of its own)."""
    while exc is not None:
        if isinstance(exc, Terminated):
            return exc
        exc = exc.__cause__ or exc.__context__
    return Terminated(_received[0]) if _received else None


def is_query_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is DuckDB's end of a query that a signal interrupted: its
    ``InterruptException``, or the bare ``RuntimeError`` some versions raise instead."""
    import duckdb

    if isinstance(exc, duckdb.InterruptException):
        return True
    return type(exc) is RuntimeError and str(exc).strip() == "Query interrupted"


def raise_if_stopped() -> None:
    """Raise the interruption again where the handler's own raise may have been swallowed
    (inside DuckDB), before more work starts."""
    if _stopping:
        raise Terminated(_received[0]) if _received else KeyboardInterrupt


_stopping = False  # a signal came inside ``stop_signals_interrupt``


def _raise(signum: int, _frame: object) -> None:
    global _stopping
    if _stopping and signum != signal.SIGINT:
        # a second SIGTERM (a service manager's) must not cut the cleanup of the first
        # short; a second Ctrl-C still interrupts, as Python's own handler does
        return
    _stopping = True
    _interrupt_queries()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    _received.append(signum)
    raise Terminated(signum)


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """For the block, SIGTERM and SIGHUP raise ``Terminated`` in the main thread (a signal
    handler can be installed there only), and they and Ctrl-C interrupt the DuckDB queries
    running; the previous handlers come back after. A signal the process ignores
    (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _stopping
    _received.clear()
    _stopping = False
    previous = {}
    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            previous[s] = signal.signal(s, _raise)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Ctrl-C as Python does
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        _stopping = False  # queries run after it (the Python API in the same process) run
