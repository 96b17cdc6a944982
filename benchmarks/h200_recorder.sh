#!/bin/bash
# The recorder on a GPU machine: its GPU tests, the engine-thread floor against mgtrace's
# hooks (CUDA and host tensors), and the whole recorder against a JSON logger. Everything
# lands in $OUT. Run from the repository root with the dependencies importable (see
# h200_stop.sh for wheels brought along).
set -u
source "$(dirname "$0")/gpu_run.sh"
run recorder-gpu-tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_recorder_gpu.py \
    tests/test_recorder_floor.py
tail -1 "$OUT/recorder-gpu-tests.log"
run floor-cuda 180 $PY benchmarks/recorder_floor.py --device cuda --rounds 30 --per-hook \
    --out "$OUT/recorder-floor-cuda.json"
run floor-cpu 90 $PY benchmarks/recorder_floor.py --device cpu --rounds 30 \
    --out "$OUT/recorder-floor-host-cpu.json"
run recorder 120 $PY benchmarks/bench_recorder.py --device cuda --steps 1500 --repeats 3 \
    --out "$OUT/recorder-cuda.json"
uptime >> "$OUT/machine.txt"
