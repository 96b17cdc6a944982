"""Click parameter types shared by the commands."""

from __future__ import annotations

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
        return super().convert(value, param, ctx)


PATH = NonEmptyPath(path_type=Path)
