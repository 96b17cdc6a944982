#!/bin/bash
# Interleaved A/B of one mgtrace command's wall time (interpreter start and imports included)
# on two trees of this repository, ROUNDS times over; prints each run and the medians.
#
#   bash benchmarks/ab_cli.sh BASE_TREE NEW_TREE ROUNDS -- replay TRACE --no-save --jobs 1
#
# The trees are directories (e.g. `git worktree add /tmp/base <commit>`), each run with its
# own tree first on PYTHONPATH; PY names the interpreter (default: python).
set -euo pipefail
seconds() { printf "%d.%06d" $(($1 / 1000000000)) $(($1 / 1000 % 1000000)); }  # from ns
base=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=$3
shift 3
[ "$1" = "--" ] && shift
PY=$(command -v "${PY:-python}") || { echo "ab_cli.sh: no interpreter ${PY:-python}" >&2; exit 2; }
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # the runs start in the trees
runs=$(mktemp); trap 'rm -f "$runs"' EXIT
for ((i = 1; i <= rounds; i++)); do
  for side in base new; do
    tree=$base; [ "$side" = new ] && tree=$new
    start=$(date +%s%N)
    rc=0
    (cd "$tree" && PYTHONPATH="$tree" "$PY" -m mgtrace "$@" > /dev/null) || rc=$?
    # 0 clean, 1 corruption found: anything else is not a run to time
    if [ "$rc" -gt 1 ]; then echo "ab_cli.sh: the $side run exited $rc" >&2; exit "$rc"; fi
    end=$(date +%s%N)
    echo "$side $(seconds $((end - start)))" | tee -a "$runs"
  done
done
"$PY" - "$runs" <<'PYEOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    side, seconds = line.split()
    runs.setdefault(side, []).append(float(seconds))
base, new = (statistics.median(runs[s]) for s in ("base", "new"))
print(f"median wall s: base {base:.3f}, new {new:.3f}, new/base {new / base:.3f}")
PYEOF
