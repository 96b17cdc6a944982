#!/bin/bash
# mgtrace's align kernels (reference and Triton) against vLLM's own Triton kernels, all
# compiled for the GPU, on the same random cases: one run per vLLM release. JSON into $OUT.
#
# The GPU machine has no registry, so vLLM's Python sources (no compiled ops: the align
# kernels are Triton) and the pure-Python packages its import needs travel as archives in
# .whl/, built for the machine's Python:
#   .whl/deps312.tar.xz    the import's dependencies (cp312 wheels, unpacked)
#   .whl/vllm033.tar.xz    vllm 0.33.0 without its CUDA libraries and C++ sources
#   .whl/vllm034.tar.xz    vllm 0.34.0, the same
# Run from the repository root: OUT=... bash benchmarks/h200_vllm_kernels.sh [CASES]
set -u
PY=${PY:-python3}
CASES=${1:-2000}
mkdir -p /tmp/deps /tmp/v33 /tmp/v34
tar xJf .whl/deps312.tar.xz -C /tmp/deps
tar xJf .whl/vllm033.tar.xz -C /tmp/v33
tar xJf .whl/vllm034.tar.xz -C /tmp/v34
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} > "$OUT/machine.txt" 2>&1
for v in 33 34; do
  export PYTHONPATH=/tmp/v$v:/tmp/deps:$PWD
  MGTRACE_DEBUG=1 timeout 140 $PY -m mgtrace check-kernels --against vllm --device cuda \
      --cases "$CASES" --seed "${v}000" --json \
      > "$OUT/kernels-vs-vllm-0.$v-h200.json" 2> "$OUT/kernels-vs-vllm-0.$v-h200.log"
  echo "vllm 0.$v rc=$?"
  tail -3 "$OUT/kernels-vs-vllm-0.$v-h200.log"
  # The layouts check-kernels keeps from vLLM on a GPU: run as generated, then element-aligned.
  timeout 110 $PY benchmarks/vllm_gpu_alignment.py --seed "${v}000" --cases 3 \
      > "$OUT/alignment-0.$v-h200.json" 2>&1
  echo "alignment 0.$v rc=$?"
done
# The GPU tier's kernel tests, with vLLM importable (its campaign then compares vLLM too).
export PYTHONPATH=/tmp/v34:/tmp/deps:$PWD
timeout 90 $PY -m pytest -q -p no:cacheprovider \
    tests/test_kernels_gpu.py > "$OUT/kernels-gpu-tests-vllm034.log" 2>&1
echo "gpu kernel tests rc=$?"
tail -2 "$OUT/kernels-gpu-tests-vllm034.log"
