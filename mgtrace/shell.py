"""Commands printed for the user to run: each path one shell word, never read as an option."""

from __future__ import annotations

import os
import shlex


def path_arg(path: str | os.PathLike[str]) -> str:
    """``path`` as an argument a command reads as a path: a relative one starting with '-'
    gets './' (pathlib drops the one it was given, and a parser would take it for an option)."""
    text = os.fspath(path)
    return f"./{text}" if text.startswith("-") else text


def shell_path(path: str | os.PathLike[str]) -> str:
    """``path`` as one shell word (quoted where needed), safe to paste after a command."""
    return shlex.quote(path_arg(path))
