#!/bin/bash
# The Triton replay on a GPU machine, this tree against BASE_TREE (a directory holding another
# commit's mgtrace/ and benchmarks/): the GPU tests of the kernels and the replay on this
# tree, an interleaved A/B of one process replaying 3,000 steps (bench_replay.py) and the
# same over 20,000 steps as `mgtrace replay` runs them by default (several processes), and a
# profile of this tree's step. Everything lands in $OUT. Run from the repository root with
# the dependencies importable (see h200_stop.sh):
#
#   OUT=... [ONE_PROCESS_ROUNDS=2] bash benchmarks/replay_triton_ab_gpu.sh BASE_TREE BASE_COMMIT NEW_COMMIT
#
# ONE_PROCESS_ROUNDS=0 leaves out the one-process A/B; then this tree's replay of the same
# 20,000 steps in segments (bench_replay_jobs.py, 1 and 8 processes, or the counts in JOBS)
# says where its workers' time goes.
set -u
base=$1 base_commit=$2 new_commit=$3
rounds=${ONE_PROCESS_ROUNDS:-2}
source "$(dirname "$0")/gpu_run.sh"
# (the interpreter's tests are CI's: this machine's Triton interpreter fails on its numpy)
run gpu-tests 200 $PY -m pytest -q -p no:cacheprovider -m "not interp" tests/test_replay_gpu.py \
    tests/test_kernels_gpu.py tests/test_block_copies.py tests/test_prefill_checkpoints.py \
    tests/test_slot_uploads.py
tail -1 "$OUT/gpu-tests.log"
runs=$(mktemp -d)  # the runs' own files: only a few files come back from a GPU machine
cmd="$PY benchmarks/bench_replay.py --steps 3000 --repeat 3 --backend triton --device cuda --no-bisect"
if [ "$rounds" -gt 0 ]; then
  run ab-one-process 240 bash benchmarks/ab_trees.sh "$base" . "$runs/ab-one-process" "$rounds" \
      -- $cmd
  $PY benchmarks/ab_summary.py "$runs/ab-one-process" --base "$base_commit" --new "$new_commit" \
      --ab-command "bash benchmarks/ab_trees.sh BASE . OUT $rounds -- $cmd" \
      --out "$OUT/replay-triton-ab-one-process.json" > /dev/null
fi
TRACE=$(mktemp -d)/trace
run simulate 60 $PY -m mgtrace simulate --scenario steady --steps 20000 --seed 0 \
    --bug reorder-threshold-mismatch -o "$TRACE"
for round in 1 2; do
  for side in base new; do
    tree=$base; [ "$side" = new ] && tree=$PWD
    start=$(date +%s.%N)
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 200 \
        $PY -m mgtrace replay "$TRACE" --backend triton --device cuda) \
        > "$runs/cli-$side-$round.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    echo "$side round $round: rc=$rc, $(awk "BEGIN { printf \"%.1f\", $end - $start }") s" \
        | tee -a "$OUT/replay-cli-ab.txt"
  done
done
tail -3 "$runs/cli-new-1.log" >> "$OUT/replay-cli-ab.txt"
if [ "$rounds" -gt 0 ]; then
  run profile 100 $PY benchmarks/profile_replay.py --steps 1000 --backend triton --device cuda \
      --out "$OUT/profile-triton.txt"
else
  run jobs 300 $PY benchmarks/bench_replay_jobs.py --steps 20000 --bug reorder-threshold-mismatch \
      --jobs ${JOBS:-1 8} --repeat 1 --backend triton --device cuda --out "$OUT/replay-jobs-triton.json"
fi
uptime >> "$OUT/machine.txt"
