"""Where a command may write: never over, or above, one of its own inputs."""

from __future__ import annotations

from pathlib import Path

from mgtrace.errors import UsageError


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
