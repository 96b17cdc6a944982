"""Keep pyarrow from importing pandas in processes that never hand it a pandas object.

The first time pyarrow converts any Python value (``pa.array([1])``, a numpy array) it
imports pandas, only to ask whether the value is a pandas object: 0.3-0.5 s at the start of
every command where pandas is installed. pyarrow asks that first question without insisting
(a failed import means "no pandas objects here") and imports pandas again whenever it needs
it for real (``to_pandas``), so answering the first question with a blocked import costs
nothing later. (Its C++ side imports pandas as well when it infers the type of a Python
list's values, as its Parquet dataset reader does: the commands that replay a trace still
load pandas.) Only for processes mgtrace owns (the command line, the assembler process): a
notebook that passes pandas objects to pyarrow keeps the usual behaviour.
"""

from __future__ import annotations

import sys


def skip_pandas_probe() -> None:
    """Make pyarrow's first pandas check find no pandas, unless pandas is already loaded."""
    if "pandas" in sys.modules:
        return
    import numpy as np
    import pyarrow as pa

    sys.modules["pandas"] = None  # type: ignore[assignment]  # `import pandas` now fails
    try:
        pa.array(np.zeros(1, np.int8))  # a numpy conversion runs the check, and only it
    except Exception:  # a pyarrow that converts differently: nothing gained, nothing lost
        pass
    finally:
        del sys.modules["pandas"]
