"""Align-kernel benchmarks: the CPU reference's launch rate, and on a GPU the post-process
bandwidth (full-size states) and per-launch latency (tag-size states, CUDA graph).

    python benchmarks/bench_kernels.py [--part cpu|gpu|all] [--out FILE]

Needs only torch, triton and numpy (no pyarrow, no duckdb). Prints one JSON object and
writes it to --out (default: benchmarks/results/kernels-<part>.json).

CPU: launches/s of the reference backend, validation included (every launch is validated
before it moves a byte), and of its byte movement alone, for 96 rows x 4 tag-size states:
the replayer's compact layout (two Mamba groups, each one conv window of (k+3, 2) int32
tags and one temporal state of 4 int32 tags), and the same four states in one group.
Target >= 20,000 launches/s.

GPU: post-process bandwidth on Nemotron-H-like states (96 requests x 23 layers, conv window
(k+3, 10240) bf16 and SSM state (128, 64, 128) fp32 per layer, every request crossing a
block boundary) as a fraction of torch's device-to-device copy_ of the same bytes in the same
run (target >= 0.85); latency of one tag-size post-process launch replayed from a CUDA graph
(target <= 10 us).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mgtrace.kernels.launch import AlignLaunch  # noqa: E402
from mgtrace.kernels.pool import BlockTables, StatePool, StateSpec  # noqa: E402
from mgtrace.kernels.reference import run_reference  # noqa: E402
from mgtrace.kernels.validate import validate_launch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ROWS = 96
K = 3
BLOCK = 16


def tag_specs(groups: int = 2) -> list[StateSpec]:
    specs = []
    for g in range(groups):
        specs.append(StateSpec(g, "conv", (K + 3, 2), "int32", "SD"))
        specs.append(StateSpec(g, "temporal", (4,), "int32"))
    return specs


def tables_for(rows: int, cols: int, groups: int, num_blocks: int, seed: int) -> BlockTables:
    """Distinct block ids per group: no two rows touch the same block."""
    rng = np.random.default_rng(seed)
    return BlockTables(
        [
            rng.permutation(np.arange(1, num_blocks))[: rows * cols].reshape(rows, cols)
            for _ in range(groups)
        ]
    )


def postprocess_launch(rows: int, cols: int, *, cross: float, seed: int) -> AlignLaunch:
    """Decode rows (k drafts); a ``cross`` share of them crosses a block boundary."""
    rng = np.random.default_rng(seed)
    crossing = rng.random(rows) < cross
    base = rng.integers(2, cols - K - 2, size=rows) * BLOCK  # a block boundary
    # A crossing row's running state sits j tokens short of the boundary and accepts more
    # than j tokens (bias j); the others sit just past a boundary and cannot reach the next.
    short = rng.integers(0, K + 1, size=rows)
    running = np.where(crossing, base - short, base + 1)
    accepted = np.where(crossing, rng.integers(short + 1, K + 2), rng.integers(1, K + 2, rows))
    computed = running - 1  # decode: k drafts after one verified token
    state_idx = -(-(running + K) // BLOCK) - 1
    return AlignLaunch(
        "postprocess",
        batch_row=np.arange(rows),
        req_slot=np.arange(rows),
        mode="decision",
        num_accepted=accepted,
        state_idx=state_idx,
        num_computed=computed,
        num_scheduled=np.full(rows, 1 + K),
        num_draft=np.full(rows, K),
        block_size=BLOCK,
        num_speculative_tokens=K,
    )


def precopy_launch(rows: int, cols: int, *, seed: int) -> AlignLaunch:
    rng = np.random.default_rng(seed)
    dst = rng.integers(1, cols - K - 1, size=rows)
    return AlignLaunch(
        "precopy",
        batch_row=np.arange(rows),
        req_slot=np.arange(rows),
        state_idx=dst,
        src_col=dst - 1,
        token_bias=rng.integers(0, K + 1, size=rows),
        block_size=BLOCK,
        num_speculative_tokens=K,
    )


def _rate(fn, launches: int, repeat: int) -> dict:
    """Wall-clock rate, and the rate per second of this process's own CPU time: on a
    shared machine the second one is the single-core throughput, the first one is not."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(launches):
            fn()
        wall.append((time.perf_counter() - t0) / launches)
        cpu.append((time.process_time() - c0) / launches)
    return {
        "launches_per_s_median": round(1 / statistics.median(wall)),
        "launches_per_s_best": round(1 / min(wall)),
        "launches_per_cpu_s_median": round(1 / statistics.median(cpu)),
        "us_per_launch_median": round(statistics.median(wall) * 1e6, 2),
    }


def bench_cpu(args: argparse.Namespace) -> dict:
    cols = 40
    out: dict = {
        "rows": ROWS,
        "states": 4,
        "state_bytes": {"conv": (K + 3) * 2 * 4, "temporal": 16},
        "target_launches_per_s": 20000,
        "cases": {},
    }
    for groups in (2, 1):
        specs = tag_specs(groups) if groups == 2 else tag_specs(1) * 2
        if groups == 1:
            specs = [StateSpec(0, s.kind, s.shape, s.dtype, s.conv_layout) for s in specs]
        num_blocks = ROWS * cols + 1
        pool = StatePool(specs, num_blocks)
        tables = tables_for(ROWS, cols, groups, num_blocks, seed=1)
        launches = {
            "postprocess_all_rows_copy": postprocess_launch(ROWS, cols, cross=1.0, seed=2),
            "postprocess_quarter_rows_copy": postprocess_launch(ROWS, cols, cross=0.25, seed=3),
            "precopy_all_rows_copy": precopy_launch(ROWS, cols, seed=4),
        }
        for name, launch in launches.items():
            v = validate_launch(launch, pool, tables)
            assert v.ok, v.problems
            entry = _rate(
                lambda launch=launch, pool=pool, tables=tables: run_reference(launch, pool, tables),
                args.launches,
                args.repeat,
            )
            entry["copying_rows"] = int(v.copies.rows.size)
            entry["validation_included"] = True
            # The byte movement alone, validation done beforehand (the replayer's floor).
            moves = _rate(
                lambda launch=launch, pool=pool, tables=tables, v=v: run_reference(
                    launch, pool, tables, validation=v
                ),
                args.launches,
                args.repeat,
            )
            entry["move_only_launches_per_s_median"] = moves["launches_per_s_median"]
            entry["move_only_launches_per_cpu_s_median"] = moves["launches_per_cpu_s_median"]
            out["cases"][f"{groups}_groups/{name}"] = entry
    head = out["cases"]["2_groups/postprocess_all_rows_copy"]
    out["headline"] = "2_groups/postprocess_all_rows_copy, validation included"
    out["headline_launches_per_s"] = head["launches_per_s_median"]
    out["headline_launches_per_cpu_s"] = head["launches_per_cpu_s_median"]
    out["meets_target"] = head["launches_per_cpu_s_median"] >= out["target_launches_per_s"]
    return out


# ----------------------------------------------------------------------------- GPU


def _cuda_time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _torch_copy_seconds(nbytes: int, repeat: int) -> float:
    """Device-to-device copy_ of ``nbytes`` contiguous bytes: the bandwidth yardstick."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return min(_cuda_time(lambda: dst.copy_(src), 3) for _ in range(repeat))


def _device_args(kernels, pool: StatePool, tables: BlockTables, launch: AlignLaunch):
    layout = kernels.DeviceLayout.build(pool, tables)

    def dev(name: str) -> torch.Tensor:
        # Precomputed mode reads no scheduled/draft counts: any int32 vector will do.
        values = launch.column_or_none(name)
        values = launch.column("num_computed") if values is None else values
        return torch.from_numpy(np.array(values)).cuda()

    args = [
        dev(c)
        for c in (
            "req_slot",
            "num_accepted",
            "state_idx",
            "num_scheduled",
            "num_computed",
            "num_draft",
        )
    ]
    out = args[1].clone()
    return layout, args, out


def bench_gpu(args: argparse.Namespace) -> dict:
    os.environ.pop("TRITON_INTERPRET", None)
    from mgtrace.kernels import triton_align as kernels

    torch.cuda.init()
    dev_name = torch.cuda.get_device_name()
    result: dict = {"device": dev_name}

    # --- bandwidth: full-size states, every request crossing a boundary (bias 1..k).
    layers, conv_dim, heads, head_dim, ssm = args.layers, 10240, 128, 64, 128
    specs = []
    for layer in range(layers):
        specs.append(StateSpec(0, "conv", (K + 3, conv_dim), "bfloat16", "SD"))
        specs.append(StateSpec(0, "temporal", (heads, head_dim, ssm), args.ssm_dtype))
        _ = layer
    cols = 8
    num_blocks = ROWS * 3 + 1
    rows_np = np.arange(ROWS)
    # Row r: running column 4 in block 3r+1, speculative columns 5.. in 3r+2, dst col 3 in 3r+3.
    table = np.zeros((ROWS, cols), dtype=np.int32)
    table[:, 3] = 3 * rows_np + 3
    table[:, 4] = 3 * rows_np + 1
    table[:, 5:] = (3 * rows_np + 2)[:, None]
    tables = BlockTables([table])
    pool = StatePool(specs, num_blocks, device="cuda")
    launch = AlignLaunch(
        "postprocess",
        batch_row=rows_np,
        req_slot=rows_np,
        mode="precomputed",
        num_accepted=np.full(ROWS, 2),
        state_idx=np.full(ROWS, 4),
        num_computed=np.full(ROWS, 4 * BLOCK),
        block_size=BLOCK,
        num_speculative_tokens=K,
    )
    # R = 4B - 1, N = 4B: boundary at 4B, bias 1, dst column 3, temporal from column 5.
    v = validate_launch(launch, pool, tables)
    assert v.ok and v.copies.rows.size == ROWS, v.problems
    moved = ROWS * sum(
        (s.width - 1) * s.unit_bytes if s.kind == "conv" else s.nbytes for s in specs
    )
    layout, dargs, out = _device_args(kernels, pool, tables, launch)
    copy_s = _torch_copy_seconds(moved, args.repeat)
    torch.cuda.empty_cache()
    tiles_results = {}
    for tiles in args.tiles:

        def run(tiles=tiles):
            kernels.launch_postprocess(
                layout,
                len(specs),
                *dargs,
                out,
                block_size=BLOCK,
                precomputed=True,
                row_is_slot=True,
                tiles=tiles,
            )

        run()
        torch.cuda.synchronize()
        t = min(_cuda_time(run, 3) for _ in range(args.repeat))
        tiles_results[str(tiles)] = {
            "seconds": t,
            "tb_per_s_read_plus_write": round(2 * moved / t / 1e12, 3),
            "fraction_of_copy": round(copy_s / t, 3),
        }
    best = max(tiles_results.values(), key=lambda r: r["fraction_of_copy"])
    pool = layout = None
    torch.cuda.empty_cache()
    result["bandwidth"] = {
        "requests": ROWS,
        "layers": layers,
        "conv_state": [K + 3, conv_dim, "bfloat16"],
        "temporal_state": [heads, head_dim, ssm, args.ssm_dtype],
        "bytes_moved": moved,
        "torch_copy_seconds": copy_s,
        "torch_copy_tb_per_s_read_plus_write": round(2 * moved / copy_s / 1e12, 3),
        "by_temporal_tiles": tiles_results,
        "best_fraction_of_copy": best["fraction_of_copy"],
        "target_fraction": 0.85,
    }

    # --- latency: tag-size states, one launch per graph replay.
    cols = 40
    num_blocks = ROWS * cols + 1
    pool = StatePool(tag_specs(2), num_blocks, device="cuda")
    tables = tables_for(ROWS, cols, 2, num_blocks, seed=1)
    launch = postprocess_launch(ROWS, cols, cross=1.0, seed=2)
    layout, dargs, out = _device_args(kernels, pool, tables, launch)

    def one() -> None:
        kernels.launch_postprocess(
            layout, 4, *dargs, out, block_size=BLOCK, precomputed=False, row_is_slot=True, tiles=1
        )

    one()
    torch.cuda.synchronize()
    eager = min(_cuda_time(one, args.latency_iters) for _ in range(args.repeat))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        one()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        one()
    replay = min(_cuda_time(graph.replay, args.latency_iters) for _ in range(args.repeat))
    batch = torch.cuda.CUDAGraph()
    with torch.cuda.graph(batch, stream=stream):
        for _ in range(100):
            one()
    in_graph = min(_cuda_time(batch.replay, 20) for _ in range(args.repeat)) / 100
    result["latency"] = {
        "rows": ROWS,
        "states": 4,
        "us_per_launch_graph_replay": round(replay * 1e6, 2),
        "us_per_launch_100_in_one_graph": round(in_graph * 1e6, 2),
        "us_per_launch_eager_python": round(eager * 1e6, 2),
        "target_us": 10,
    }
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["cpu", "gpu", "all"], default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--launches", type=int, default=2000, help="CPU: launches per timing.")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=23, help="GPU: Mamba layers per request.")
    ap.add_argument("--ssm-dtype", default="float32")
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--latency-iters", type=int, default=2000)
    args = ap.parse_args()
    report: dict = {
        "command": " ".join(["python", "benchmarks/bench_kernels.py", *sys.argv[1:]]),
        "when_unix": round(time.time()),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            # Other work on a shared machine slows the CPU numbers; say how busy it was.
            "load_average_1m_at_start": round(os.getloadavg()[0], 2),
            "numpy": np.__version__,
            "torch": torch.__version__,
        },
    }
    if args.part in ("cpu", "all"):
        report["cpu"] = bench_cpu(args)
    if args.part in ("gpu", "all"):
        if not torch.cuda.is_available():
            print("no CUDA device: the GPU part needs one", file=sys.stderr)
            return 2
        import triton

        report["machine"]["triton"] = triton.__version__
        report["gpu"] = bench_gpu(args)
    text = json.dumps(report, indent=1)
    print(text)
    out = args.out or RESULTS / f"kernels-{args.part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
