"""Keep pyarrow from importing pandas in processes that never hand it a pandas object.

The first time pyarrow converts any Python value (``pa.array([1])``, a numpy array) it
imports pandas, only to ask whether the value is a pandas object: 0.3-0.5 s at the start of
every command where pandas is installed. pyarrow asks that first question without insisting
(a failed import means "no pandas objects here") and imports pandas again whenever it needs
it for real (``to_pandas``), so answering the first question with a blocked import costs
nothing later. Its C++ side asks too, the first time it converts an Arrow array to numpy
(``to_numpy``, which the replaying commands call on every table they load) or infers the type
of a Python list's values: that question, answered "no pandas", is asked again only by
conversions that need pandas for real, which import it then. Only for processes mgtrace owns
(the command line, the assembler process): a notebook that passes pandas objects to pyarrow
keeps the usual behaviour.
"""

from __future__ import annotations

import contextlib
import sys


def skip_pandas_probe() -> None:
    """Make pyarrow's first pandas check find no pandas, unless pandas is already loaded."""
    if "pandas" in sys.modules:
        return
    import numpy as np
    import pyarrow as pa

    sys.modules["pandas"] = None  # type: ignore[assignment]  # `import pandas` now fails
    try:
        # A numpy conversion runs the Python side's check (and fails in it: pyarrow then
        # remembers there is no pandas); one back to numpy runs the C++ side's. A pyarrow
        # that converts differently: nothing gained, nothing lost.
        with contextlib.suppress(Exception):
            pa.array(np.zeros(1, np.int8))
        with contextlib.suppress(Exception):
            pa.array([0], pa.int8()).to_numpy(zero_copy_only=False)
    finally:
        del sys.modules["pandas"]
