#!/bin/bash
# What several replay processes on one GPU machine cost each other: one process alone, then
# N at once, each on a core of its own (independent one-process replays of 3,000 steps,
# bench_replay.py), for the Triton backend (each its own CUDA context on the one GPU) and for
# the reference backend (the CPU only), and, where the machine has CUDA MPS, the Triton
# processes again through one MPS server (their work then shares one context). Prints, and
# writes to $OUT/replay-sharing.txt, each process's loop rate. Run from the repository root
# with the dependencies importable (see h200_stop.sh):
#
#   OUT=... [N=8] bash benchmarks/replay_sharing_gpu.sh
set -u
n=${N:-8}
source "$(dirname "$0")/gpu_run.sh"
runs=$(mktemp -d)
rates() {  # label count backend device
  local label=$1 count=$2 backend=$3 device=$4
  # bench_replay.py keeps to the lowest core it may use: each process gets a core of its own
  # (more processes than cores share them in turn)
  for i in $(seq "$count"); do
    taskset -c $(((i - 1) % $(nproc))) $PY benchmarks/bench_replay.py --steps 3000 --repeat 1 \
        --no-bisect --backend "$backend" --device "$device" --out "$runs/$label-$i.json" \
        > "$runs/$label-$i.log" 2>&1 &
  done
  wait
  $PY - "$label" "$runs" "$count" <<'EOF' | tee -a "$OUT/replay-sharing.txt"
import json, sys
label, runs, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
rates = []
for i in range(1, count + 1):
    try:
        rates.append(json.load(open(f"{runs}/{label}-{i}.json"))["replay_best"]["loop_steps_per_s"])
    except (OSError, KeyError, ValueError):
        rates.append(float("nan"))
each = ", ".join(f"{r:.0f}" for r in rates)
print(f"{label}: {count} at once, loop steps/s per process {each}; together {sum(rates):.0f}")
EOF
}
rates triton-alone 1 triton cuda
rates triton-shared "$n" triton cuda
rates reference-alone 1 reference cpu
rates reference-shared "$n" reference cpu
if command -v nvidia-cuda-mps-control > /dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=$runs/mps-pipe CUDA_MPS_LOG_DIRECTORY=$runs/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    rates triton-shared-mps "$n" triton cuda
    echo quit | nvidia-cuda-mps-control
  fi
else
  echo "no CUDA MPS on this machine" | tee -a "$OUT/replay-sharing.txt"
fi
uptime >> "$OUT/machine.txt"
