#!/bin/bash
# Interleaved A/B of this tree against BASE_TREE on one machine, for the three hot paths a
# change may move: the CPU reference replay (bench_replay.py), the simulator with its trace
# (bench_sim.py) and the recorder's engine-thread cost (bench_recorder.py on DEVICE). Each
# measure's summary (every run, the medians, new over base) lands in $OUT/ab-*.json. Run from
# the repository root with the dependencies importable:
#
#   OUT=... [ROUNDS=3] [DEVICE=cuda|cpu] [MEASURES="replay-reference sim recorder"] \
#       bash benchmarks/ab_host.sh BASE_TREE BASE_COMMIT NEW_COMMIT
set -u
base=$1 base_commit=$2 new_commit=$3
rounds=${ROUNDS:-3}
device=${DEVICE:-cpu}
source "$(dirname "$0")/gpu_run.sh"
runs=$(mktemp -d)  # the runs' own files: only a few files come back from a GPU machine
ab() {  # NAME SECONDS COMMAND...: one interleaved A/B and its summary
  local name=$1 limit=$2; shift 2
  run "ab-$name" "$limit" bash benchmarks/ab_trees.sh "$base" . "$runs/$name" "$rounds" -- "$@"
  $PY benchmarks/ab_summary.py "$runs/$name" --base "$base_commit" --new "$new_commit" \
      --ab-command "bash benchmarks/ab_trees.sh BASE . OUT $rounds -- $*" \
      --out "$OUT/ab-$name.json" > /dev/null
}
for measure in ${MEASURES:-replay-reference sim recorder}; do
  case $measure in
    replay-reference)
      ab "$measure" 300 $PY benchmarks/bench_replay.py --steps 3000 --repeat 1 --no-bisect ;;
    sim) ab "$measure" 200 $PY benchmarks/bench_sim.py --steps 3000 --repeat 1 ;;
    recorder)
      ab "$measure" 400 $PY benchmarks/bench_recorder.py --device "$device" --steps 1500 \
          --repeats 1 ;;
    *) echo "unknown measure $measure" ;;
  esac
done
uptime >> "$OUT/machine.txt"
