"""Counting a recording failure without ever raising: count it, log only the first of each."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("mgtrace.recorder")


def count_failure(
    count: Callable[[str, str], None], logged: set[str], name: str, exc: BaseException
) -> None:
    """``count(kind, message)`` the failure of ``name``; warn once per name. Never raises:
    it runs inside the engine's process, where a recording problem must not become one."""
    try:
        count(f"hook:{name}", f"{exc.__class__.__name__}: {exc}")
        if name not in logged:
            logged.add(name)
            log.warning(
                "mgtrace: %s failed (%s: %s); recording continues, the failure is counted "
                "in the manifest",
                name,
                exc.__class__.__name__,
                exc,
            )
    except Exception:
        pass
