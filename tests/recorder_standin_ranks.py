"""Two stand-in workers in one gloo world of 2 under a parent process, as vLLM's
EngineCore holds its tensor-parallel workers: ``python -m tests.recorder_standin_ranks PORT
[stand-in arguments]``. Each worker prints ``READY <pid>``."""

from __future__ import annotations

import subprocess
import sys


def worker(rank: int, port: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    from tests import recorder_standin

    sys.argv = [sys.argv[0], *sys.argv[4:], "--name", f"Worker_TP{rank}"]
    return recorder_standin.main()


def main() -> int:
    if sys.argv[1] == "--worker":
        return worker(int(sys.argv[2]), sys.argv[3])
    port, rest = sys.argv[1], sys.argv[2:]
    me = [sys.executable, "-m", "tests.recorder_standin_ranks", "--worker"]
    kids = [subprocess.Popen([*me, str(r), port, *rest]) for r in range(2)]
    return max(k.wait() for k in kids)


if __name__ == "__main__":
    sys.exit(main())
