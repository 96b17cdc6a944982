"""Every failure a user can cause is an MgtraceError carrying its exit code.

The CLI catches MgtraceError in exactly one place (``mgtrace.cli.main``) and prints the
message as one sentence; no traceback reaches the user for bad input.

Exit codes follow git bisect's contract so scripts can drive mgtrace:
0 clean, 1 corruption found, 2 usage error, 3 unreadable trace, 125 inconclusive.
"""

from __future__ import annotations

EXIT_CLEAN = 0
EXIT_CORRUPTION = 1
EXIT_USAGE = 2
EXIT_UNREADABLE = 3
EXIT_INCONCLUSIVE = 125
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class MgtraceError(Exception):
    """A failure explained in one sentence, with the exit code the CLI returns."""

    exit_code: int = EXIT_USAGE

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class UsageError(MgtraceError):
    """The command line or an argument value is wrong."""

    exit_code = EXIT_USAGE


class TraceError(MgtraceError):
    """A trace cannot be read as asked."""

    exit_code = EXIT_UNREADABLE


class TraceReplacedError(TraceError):
    """The trace an open ``Trace`` reads was removed or replaced by another process."""


class TraceNotFoundError(TraceError):
    """The trace directory does not exist or is not a directory."""


class ManifestError(TraceError):
    """manifest.json is missing, unparsable or inconsistent."""


class SchemaVersionError(TraceError):
    """The trace was written with a schema version this mgtrace does not know."""


class PartError(TraceError):
    """A Parquet part is missing, truncated, corrupt or fails its checksum."""


class OutputError(MgtraceError):
    """An output file cannot be written as asked."""

    exit_code = EXIT_USAGE


class InconclusiveError(MgtraceError):
    """The question cannot be answered from this trace (gaps, drops, incomplete run)."""

    exit_code = EXIT_INCONCLUSIVE


def reason(exc: BaseException) -> str:
    """An error's own words: an MgtraceError's sentence, an OSError's strerror."""
    if isinstance(exc, MgtraceError):
        return exc.message
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
