"""``python -m mgtrace.sim [OPTIONS]``: the simulate command on its own, same error contract."""

import sys

import click

from mgtrace.errors import MgtraceError
from mgtrace.sim.cli import simulate


def main(argv: list[str] | None = None) -> int:
    try:
        simulate.main(args=argv, prog_name="python -m mgtrace.sim", standalone_mode=False)
    except MgtraceError as exc:
        click.echo(f"mgtrace: error: {exc.message}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("mgtrace: interrupted", err=True)
        return 130
    return 0


sys.exit(main())
