"""Click parameter types shared by the commands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click


class NonEmptyPath(click.Path):
    """A path that names something: click reads an empty string as the current directory,
    so ``-o ""`` (an unset shell variable) would write into it, or be refused in words about
    a directory the user never named."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("an empty path names no file or directory", param, ctx)
        if isinstance(value, str) and (long := _too_long(value)):
            self.fail(long, param, ctx)
        return super().convert(value, param, ctx)


def _too_long(path: str) -> str | None:
    """Why the system would refuse ``path`` by its length (its own words, ENAMETOOLONG,
    would echo the whole name and name no option); None when it is short enough."""
    size = len(os.fsencode(path))
    if size >= os.pathconf("/", "PC_PATH_MAX"):
        return f"the path is {size:,} bytes long, more than the system takes"
    longest = max(len(os.fsencode(name)) for name in path.split("/"))
    if longest > os.pathconf("/", "PC_NAME_MAX"):
        return f"a name in the path is {longest:,} bytes long, more than the system takes"
    return None


PATH = NonEmptyPath(path_type=Path)
