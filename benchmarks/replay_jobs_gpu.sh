#!/bin/bash
# The Triton replay in segments on a GPU machine: its GPU tests, then a 20,000-step trace
# replayed end to end on 1 to 16 processes with the Triton backend on the GPU, and with the
# reference backend on the same host for scale. Everything lands in $OUT. Run from the
# repository root with the dependencies importable (see h200_stop.sh).
set -u
source "$(dirname "$0")/gpu_run.sh"
run replay-gpu-tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_replay_gpu.py
tail -1 "$OUT/replay-gpu-tests.log"
run jobs-triton 250 $PY benchmarks/bench_replay_jobs.py --steps 20000 --jobs 4 8 16 \
    --repeat 1 --backend triton --device cuda --out "$OUT/replay-jobs-triton-cuda.json"
run jobs-reference 100 $PY benchmarks/bench_replay_jobs.py --steps 20000 --jobs 16 \
    --repeat 1 --out "$OUT/replay-jobs-reference-host.json"
uptime >> "$OUT/machine.txt"
