"""cProfile of the replay step loop (top functions by own time), for one backend/device.

Usage: python benchmarks/profile_replay.py [--steps N] [--backend B] [--device D] [--out F]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import make_trace

from mgtrace.replayer.loop import RankReplay, load_backend
from mgtrace.replayer.requests import RequestIds
from mgtrace.replayer.rules import RuleSet
from mgtrace.replayer.steps import RankTrace
from mgtrace.schemas.reader import TraceReader


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = make_trace(Path(tmp) / "clean", args.steps, None)
        backend = load_backend(args.backend, args.device)
        warm = RankReplay(
            RankTrace(TraceReader(trace), 0, RequestIds()), RuleSet(), backend, device=args.device
        )
        warm.run(until=20)  # compile the kernels outside the profile
        rep = RankReplay(
            RankTrace(TraceReader(trace), 0, RequestIds()), RuleSet(), backend, device=args.device
        )
        prof = cProfile.Profile()
        prof.enable()
        rep.run()
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())
    if args.out:
        args.out.write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
