"""Whether vLLM's compiled align kernels fault on states off their element alignment.

For the first random kernel cases from ``--seed`` whose pool puts a DS conv state off its
element alignment (``vllm_peer.alignment_problem``; the cases' odd page sizes do that), each
case runs twice through vLLM's own kernel, each run in a fresh process (a fault poisons
the CUDA context): as generated, with mgtrace's refusal of such layouts lifted, and with the
same states re-laid at 8-byte offsets in pages of a multiple of 8 bytes, compared byte for
byte with the reference backend. JSON on stdout.

Usage: python benchmarks/vllm_gpu_alignment.py [--seed S] [--cases N] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import torch

from mgtrace.kernels.pool import StatePool


def _relaid(pool: StatePool) -> StatePool:
    """The same states at 8-byte offsets, in pages of a multiple of 8 bytes, random bytes."""

    offsets, at = [], 0
    for spec in pool.specs:
        offsets.append(at)
        at = -(-(at + spec.nbytes) // 8) * 8
    out = StatePool(pool.specs, pool.num_blocks, page_bytes=at, offsets=offsets)
    fill = np.random.default_rng(0).integers(0, 256, out.buffer.numel(), dtype=np.uint8)
    out.buffer.copy_(torch.from_numpy(fill))
    return out


def child(seed: int, aligned: bool, device: str) -> dict[str, object]:
    """Run one case through vLLM's kernel on ``device``; bytes compared with the reference."""
    from dataclasses import replace

    import mgtrace.kernels.vllm_peer as peer
    from mgtrace.kernels import run_reference
    from mgtrace.kernels.gen import random_case
    from mgtrace.kernels.validate import validate_launch

    case = random_case(seed)
    if aligned:
        case = replace(case, pool=_relaid(case.pool))
    else:
        peer.alignment_problem = lambda pool: None  # the experiment: run what is refused
    mod = peer.load_vllm_kernels(device)
    v = validate_launch(case.launch, case.pool, case.tables)
    safe = v.sanitized(case.launch)
    has_idx = case.has_idx_mapping or bool(v.bad.any())
    ref_pool = case.pool.clone("cpu")
    run_reference(case.launch, ref_pool, case.tables, validation=v)
    vllm_pool = case.pool.clone(device)
    peer.run_vllm(mod, safe, vllm_pool, case.tables, has_idx_mapping=has_idx)
    if device == "cuda":
        torch.cuda.synchronize()
    same = bool(np.array_equal(ref_pool.numpy(), vllm_pool.buffer.cpu().numpy()))
    return {"page_bytes": case.pool.page_bytes, "equal_to_reference": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=34000)
    ap.add_argument("--cases", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--aligned", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.aligned, args.device)))
        return 0

    from mgtrace.kernels.gen import random_case
    from mgtrace.kernels.validate import validate_launch
    from mgtrace.kernels.vllm_peer import alignment_problem, comparable

    runs = []
    seed = args.seed
    while len(runs) < args.cases and seed < args.seed + 1000:
        case = random_case(seed)
        v = validate_launch(case.launch, case.pool, case.tables)
        has_idx = case.has_idx_mapping or bool(v.bad.any())
        problem = alignment_problem(case.pool)
        if problem and not comparable(v.sanitized(case.launch), has_idx) and v.ok:
            run = {"seed": seed, "case": case.describe(), "problem": problem}
            for aligned in (False, True):
                cmd = [sys.executable, __file__, "--child", str(seed), "--device", args.device]
                done = subprocess.run(
                    cmd + (["--aligned"] if aligned else []),
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                out = done.stdout.strip().splitlines()
                run["aligned" if aligned else "as_generated"] = {
                    "rc": done.returncode,
                    "result": json.loads(out[-1]) if done.returncode == 0 and out else None,
                    "misaligned_address": "misaligned address" in done.stderr,
                }
            runs.append(run)
        seed += 1
    print(
        json.dumps({"device": args.device, "command": " ".join(sys.argv), "runs": runs}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
