"""``python -m mgtrace.sim [OPTIONS]``: the simulate command on its own, same error contract."""

import sys

from mgtrace.cli import main
from mgtrace.sim.cli import simulate

sys.exit(main(command=simulate, prog_name="python -m mgtrace.sim"))
