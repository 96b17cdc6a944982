#!/bin/bash
# The whole `mgtrace replay --backend triton --device cuda` on a 20,000-step buggy trace as a
# user runs it (interpreter start, loading and every worker included), without CUDA MPS and
# through one MPS server (default --jobs, then 12 and 16), in turn, two rounds. Run from the
# repository root on a GPU machine that has nvidia-cuda-mps-control, with the duckdb wheel in
# .gpuwhl/:
#
#   bash benchmarks/replay_mps_gpu.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .gpuwhl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD; PY=python3
T=$(mktemp -d)/trace
$PY -m mgtrace simulate --scenario steady --steps 20000 --seed 0 --bug reorder-threshold-mismatch -o $T > /dev/null
R=$(mktemp -d)
export CUDA_MPS_PIPE_DIRECTORY=$R/pipe CUDA_MPS_LOG_DIRECTORY=$R/log; mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
timed() {  # label args...
  local label=$1; shift
  local s=$(date +%s%N)
  $PY -m mgtrace replay $T --no-save --json --backend triton --device cuda "$@" > $R/$label.json 2> $R/$label.err
  local rc=$? e=$(date +%s%N)
  echo "$label rc=$rc wall_s=$(( (e - s) / 1000000 ))e-3 findings=$($PY -c "import json,sys; d=json.load(open('$R/$label.json')); print(d.get('findings', d.get('total_findings', '?')))" 2>&1 | tail -1)"
}
for r in 1 2; do
  timed "round$r-no-mps-default"
  nvidia-cuda-mps-control -d && {
    timed "round$r-mps-default"
    timed "round$r-mps-jobs12" --jobs 12
    timed "round$r-mps-jobs16" --jobs 16
    echo quit | nvidia-cuda-mps-control; sleep 2; }
done
head -c 600 $R/round1-mps-default.json; echo; tail -3 $R/round1-mps-default.err
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uptime
