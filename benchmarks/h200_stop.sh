#!/bin/bash
# The GPU tier and the headline throughput numbers on a GPU machine, in one go; everything
# lands in $OUT. Run from the repository root with the dependencies importable, e.g. on a
# machine without registry access, from wheels brought along in .whl/:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -u
source "$(dirname "$0")/gpu_run.sh"
run gpu-tier-tests 170 $PY -m pytest -q -p no:cacheprovider tests/test_replay_gpu.py \
    tests/test_kernels_gpu.py tests/test_recorder_gpu.py tests/test_block_copies.py \
    tests/test_prefill_checkpoints.py tests/test_gdn_split.py tests/test_forward_order.py \
    -k "gpu or cuda or Gpu or GPU or test_replay_gpu or kernels_gpu or recorder_gpu"
tail -1 "$OUT/gpu-tier-tests.log"
run replay-triton 140 $PY benchmarks/bench_replay.py --steps 3000 --repeat 3 --backend triton \
    --device cuda --no-bisect --breakdown --out "$OUT/replay-h200-triton-compact.json"
run replay-reference 80 $PY benchmarks/bench_replay.py --steps 3000 --repeat 3 --no-bisect \
    --out "$OUT/replay-h200host-reference.json"
run sim 80 $PY benchmarks/bench_sim.py --steps 3000 --repeat 3 --out "$OUT/sim-h200host.json"
run recorder 110 $PY benchmarks/bench_recorder.py --device cuda --steps 1500 --repeats 3 \
    --out "$OUT/recorder-h200.json"
