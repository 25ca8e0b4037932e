#!/usr/bin/env bash
# One call on the GPU machine: install from the working tree, GPU tests, then the benchmarks.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".carry"])
# Everything lands under $OUT (pytest log, benchmark JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ssmc_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARNING | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
STEPS=${SSMC_GPU_STEPS:-tests,bench}
if [[ $STEPS == *tests* ]]; then
  timeout ${SSMC_TEST_TIMEOUT:-300} python -m pytest -m gpu -q -x -p no:cacheprovider ${SSMC_TEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
fi
if [[ $STEPS == *bench* ]]; then
  python -m benchmarks.bench_gpu --out "$OUT/bench_gpu.json" --workloads "${SSMC_WORKLOADS:-mamba1,block,compile}" \
    --lengths "${SSMC_LENGTHS:-2048,4096}" --targets "${SSMC_TARGETS:-triton,cuda,torch}" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
