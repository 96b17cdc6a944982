"""mgtrace: record vLLM hybrid-model align-mode bookkeeping, replay it offline, find the first
corrupt step.

Python API (the CLI is a thin layer over the same functions)::

    import mgtrace
    t = mgtrace.open("run.trace")          # or mgtrace.simulate("run.trace", bugs=[...])
    t.info(); t.sql("SELECT ..."); t.replay(); t.bisect(); t.minimize("repro")
    t.history("req-000002")                 # one request, a line per step
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mgtrace.api import Trace


def open(path: Any, *, skip_bad_parts: bool = False) -> Trace:
    """Open a trace directory (validated; raises an MgtraceError with one sentence if bad)."""
    from mgtrace.api import open_trace

    return open_trace(path, skip_bad_parts=skip_bad_parts)


def simulate(output: Any, **options: Any) -> Trace:
    """Run the engine simulator into ``output`` and open the trace (see mgtrace.api.simulate)."""
    from mgtrace.api import simulate as run

    return run(output, **options)


__all__ = ["__version__", "open", "simulate"]
