"""The two consoles every command prints through: one for results on standard output, one
for progress, notes and errors on standard error. Light to import (no pyarrow), so that a
command's start stays quick."""

from __future__ import annotations

from rich.console import Console


class _PipedConsole(Console):
    def on_broken_pipe(self) -> None:
        # rich exits with status 1 here, which a replay means as "corrupt". The reader going
        # away (`| head`) ends the output, not the command: it goes quiet and runs on to its
        # verdict, so that `mgtrace replay T | head` still exits 1 on a corrupt trace.
        import os
        import sys

        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def stdout_console() -> Console:
    """Piped output gets room for wide tables instead of rich's 80-column default."""
    import sys

    return _PipedConsole(soft_wrap=False, width=None if sys.stdout.isatty() else 200)


def stderr_console() -> Console:
    """Standard error's console: a message or a command stays on one line in a pipe or a
    log, where rich would break it at 80 columns (a command broken there does not paste)."""
    return Console(stderr=True, soft_wrap=True)
