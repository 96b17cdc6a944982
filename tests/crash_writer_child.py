"""Child process for the crash test: writes steps until killed.

With a marker path it hangs while the N-th part is still under its temporary name, so the
parent can kill it with a part provably open.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from mgtrace.schemas.sample import SAMPLE_RUN, sample_step
from mgtrace.schemas.writer import TraceWriter


def main() -> None:
    out = Path(sys.argv[1])
    marker = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    hang_at_part = 9  # the third of the second flush's six parts (one per table)
    real_replace = os.replace
    parts_seen = 0

    def replace_then_maybe_hang(src: str, dst: str) -> None:
        nonlocal parts_seen
        if marker is not None and ".parquet." in str(src) and str(src).endswith(".tmp"):
            parts_seen += 1
            if parts_seen == hang_at_part:
                marker.write_text("a part is open")
                time.sleep(120)
        real_replace(src, dst)

    os.replace = replace_then_maybe_hang
    rng = np.random.default_rng(0)
    writer = TraceWriter(out, run=SAMPLE_RUN, source={"kind": "crash-test"}, flush_seconds=0.02)
    step = 0
    while True:
        writer.write_step(0, step, sample_step(step, 8, rng))
        step += 1
        time.sleep(0.0005)


if __name__ == "__main__":
    main()
