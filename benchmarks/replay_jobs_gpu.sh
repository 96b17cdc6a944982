#!/bin/bash
# The Triton replay in segments on a GPU machine: the replay's GPU tests, then a 20,000-step
# buggy trace replayed by `mgtrace replay` as a user runs it, without --jobs (segments on
# several processes) against --jobs 1, with the Triton backend on the GPU and with the
# reference backend on the same host for scale. Everything lands in $OUT. Run from the
# repository root with the dependencies importable (see h200_stop.sh).
set -u
source "$(dirname "$0")/gpu_run.sh"
run replay-gpu-tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_replay_gpu.py
tail -1 "$OUT/replay-gpu-tests.log"
TRACE=$(mktemp -d)/trace
run simulate 60 $PY -m mgtrace simulate --scenario steady --steps 20000 --seed 0 \
    --bug reorder-threshold-mismatch -o "$TRACE"
REPLAY_ARGS="--backend triton --device cuda" PY=$PY \
    run replay-cli-triton 250 bash benchmarks/replay_cli_jobs.sh "$TRACE" 2
cat "$OUT/replay-cli-triton.log"
PY=$PY run replay-cli-reference 100 bash benchmarks/replay_cli_jobs.sh "$TRACE" 1
cat "$OUT/replay-cli-reference.log"
uptime >> "$OUT/machine.txt"
