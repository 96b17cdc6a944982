# Sourced by the GPU-machine scripts: the machine's description in $OUT/machine.txt, and
# run NAME SECONDS COMMAND..., which runs one measurement into $OUT/NAME.log and prints its
# exit status. $PY is the Python that holds torch and triton (python3 by default).
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
  nproc; uptime
} > "$OUT/machine.txt" 2>&1
run() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
