#!/bin/bash
# Every GPU measurement of the replay, in one call on the device machine; JSON into $OUT.
#   python3 -m pip install ... .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD  (see README)
set -u
PY=${PY:-python3}
B=benchmarks/bench_replay.py
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
# The streamed Triton backend (compact tag states) against the per-launch synchronous path,
# with a per-phase breakdown and the synchronisations per step.
$PY $B --steps 3000 --repeat 3 --backend triton --device cuda --no-bisect --baseline-sync \
    --breakdown --out "$OUT/replay-h200-triton-compact.json" > "$OUT/compact.log" 2>&1
echo "compact rc=$?"
# Full-size states (4 Nemotron-like layers): device time of the launches vs torch copy_.
$PY $B --steps 1000 --repeat 1 --backend triton --device cuda --full-layers 4 --no-bisect \
    --out "$OUT/replay-h200-triton.json" > "$OUT/full.log" 2>&1
echo "full rc=$?"
# The same, per number of programs per temporal state (the default picks it by state size).
for t in ${TILES_SWEEP:-4 16 64 256}; do
  $PY $B --steps 500 --repeat 1 --backend triton --device cuda --full-layers 4 --no-bisect \
      --tiles "$t" --out "$OUT/replay-h200-triton-tiles$t.json" > "$OUT/tiles$t.log" 2>&1
  echo "tiles $t rc=$?"
done
# The CPU reference on this host's CPU, for scale.
$PY $B --steps 3000 --repeat 3 --no-bisect --out "$OUT/replay-h200host-reference.json" \
    > "$OUT/host.log" 2>&1
echo "host rc=$?"
$PY -m pytest -q -m gpu tests/test_replay_gpu.py tests/test_kernels_gpu.py \
    > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"
tail -3 "$OUT/gpu-tests.log"
# Where the host time goes on the GPU path (cProfile, 1000 steps).
$PY benchmarks/profile_replay.py --steps 1000 --backend triton --device cuda \
    --out "$OUT/profile-h200-triton.txt" > /dev/null 2>&1
echo "profile rc=$?"
