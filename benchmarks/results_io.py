"""What every benchmark does with its result: name the command that produced it, print it,
and write it where asked."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any


def command_line() -> str:
    """This process's command, quoted so that it can be run again as written."""
    return " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])


def emit(result: dict[str, Any], out: Path | None) -> None:
    """Print the result as JSON and, when ``out`` is given, write it there too."""
    text = json.dumps(result, indent=1)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
