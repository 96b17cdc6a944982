#!/bin/bash
# Interleaved A/B of two trees of this repository: each benchmark command runs on the base
# tree, then on the new one, ROUNDS times over, on the same machine in the same session.
#
#   bash benchmarks/ab_trees.sh BASE_TREE NEW_TREE OUT_DIR ROUNDS -- python benchmarks/bench_replay.py --steps 3000 --no-bisect
#
# Each run writes OUT_DIR/<base|new>_<round>.json (the benchmark's --out); the trees are
# directories (e.g. `git worktree add /tmp/base <commit>`), each run with its own tree first
# on PYTHONPATH.
set -euo pipefail
base=$(cd "$1" && pwd); new=$(cd "$2" && pwd); out=$3; rounds=$4
shift 4
[ "$1" = "--" ] && shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
for ((i = 1; i <= rounds; i++)); do
  for side in base new; do
    tree=$base; [ "$side" = new ] && tree=$new
    (cd "$tree" && PYTHONPATH="$tree" "$@" --out "$out/${side}_$i.json" > /dev/null)
  done
done
