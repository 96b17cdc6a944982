#!/bin/bash
# Wall time of `mgtrace replay` on one trace as a user runs it (interpreter start and imports
# included), without --jobs (one process per core on a long trace) and with --jobs 1, rounds
# interleaved; the JSON summaries of the two must be the same but for the command line.
# REPLAY_ARGS adds options to both (e.g. "--backend triton --device cuda").
#   bash benchmarks/replay_cli_jobs.sh TRACE [ROUNDS]
set -u
seconds() { printf "%d.%06d" $(($1 / 1000000000)) $(($1 / 1000 % 1000000)); }  # from ns
TRACE=$1; ROUNDS=${2:-3}; PY=${PY:-python}
read -r -a EXTRA <<< "${REPLAY_ARGS:-}"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
echo "cores: $(nproc)  trace: $TRACE  rounds: $ROUNDS  options: ${EXTRA[*]}"
for i in $(seq "$ROUNDS"); do
  for jobs in default 1; do
    args=(); [ "$jobs" = default ] || args=(--jobs "$jobs")
    start=$(date +%s%N)
    "$PY" -m mgtrace replay "$TRACE" --no-save --json "${EXTRA[@]}" "${args[@]}" > "$TMP/$jobs.json"
    rc=$?
    end=$(date +%s%N)
    echo "round $i jobs=$jobs rc=$rc wall_s=$(seconds $((end - start)))"
  done
done
"$PY" - "$TMP/default.json" "$TMP/1.json" <<'PYEOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
a.pop("argv", None), b.pop("argv", None)
print("summaries equal" if a == b else "SUMMARIES DIFFER")
PYEOF
