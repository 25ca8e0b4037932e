#!/usr/bin/env bash
# One call on the GPU machine: install from the working tree, GPU tests, then the benchmarks.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".carry"])        (.carry: mamba-ssm's sdist)
# SSMC_GPU_STEPS picks steps (default: all of tests,region,moe,bsp; "fuzz", "ssdseg", "m1tune", "scanmixer", "batch1",
# "ncu", "m1counters", "decode", "bspprobe", "ssdcore", "zoo", "pform", "demo" and "train" only when named; SSMC_BSP_FLAGS=--backward:
# bsp also times forward+backward); each step has a time limit and writes under $OUT, at most 8 files come back: logs go to
# one file, results to JSON.
#   run(command="SSMC_GPU_STEPS=fuzz bash benchmarks/gpu_check.sh")   random programs, tally in
#   $OUT/fuzz_gpu.json (SSMC_FUZZ_* as in tests/fuzz_harness.py; defaults below fit one call)
#   run(command="SSMC_GPU_STEPS=ssdseg bash benchmarks/gpu_check.sh", carry=[".carry"])   the SSD
#   kernel at b4 L16384: time split auto against one segment against mamba-ssm, per table config
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/gpu_check.log"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$LOG"
STEPS=${SSMC_GPU_STEPS:-tests,region,moe,bsp}
if [[ $STEPS == *tests* ]]; then      # one file at a time: a fault in one cannot hide the others' results
  for f in ${SSMC_TEST_FILES:-tests/test_ssd.py tests/test_streams.py tests/test_triton_bwd.py tests/test_moe.py \
           tests/test_block_sparse.py tests/test_cuda_codegen.py tests/test_robustness.py tests/test_split_states.py \
           tests/test_zoo.py}; do
    echo "== $f" >> "$LOG"
    timeout ${SSMC_TEST_TIMEOUT:-120} python -m pytest -m gpu -q -p no:cacheprovider -rf "$f" 2>&1 | tail -15 >> "$LOG"
  done
  # test_triton.py compiles every candidate config per shape (~8 min in one process): three at once
  # SSMC_TEST_TRITON_K: ';'-separated -k expressions, one process each (empty: none)
  IFS=';' read -ra KS <<< "${SSMC_TEST_TRITON_K-mamba1;mamba2;gated or end_to_end}"
  for k in "${KS[@]}"; do
    [[ -n ${k// } ]] || continue
    ( timeout ${SSMC_TEST_TIMEOUT_TRITON:-280} python -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_triton.py \
        -k "$k" > "$OUT/test_triton_$(echo "${k%% *}" | tr -cd 'A-Za-z0-9_').txt" 2>&1 ) &
  done
  wait
  for f in "$OUT"/test_triton_*.txt; do [[ -f $f ]] || continue; echo "== $f" >> "$LOG"; tail -5 "$f" >> "$LOG"; rm -f "$f"; done
fi
if [[ $STEPS == *region* ]]; then     # mamba-ssm baselines in the same run; no eager at these lengths
  timeout ${SSMC_BENCH_TIMEOUT:-240} python -m benchmarks.run --preset h200 --workloads "${SSMC_WORKLOADS:-mamba1,mamba2,decode}" \
    --lengths "${SSMC_LENGTHS:-4096}" --targets "${SSMC_TARGETS:-triton,cuda,auto}" --eager-max-len 0 ${SSMC_BENCH_FLAGS:-} \
    --out /tmp/ssmc_run --name h200_regions >> "$LOG" 2>&1
  cp /tmp/ssmc_run/h200_regions.json "$OUT/" 2>/dev/null
fi
if [[ $STEPS == *m1tune* ]]; then    # Mamba-1 region per kernel config, b8 d1536 n16 bf16, mamba-ssm and associative_scan in the run
  TAG=${SSMC_TUNE_TAG:-m1}            # SSMC_TUNE_BASELINE= (empty): no baselines; SSMC_TUNE_BLD=0: no (b, L, d) run;
                                      # SSMC_TUNE_KERNELS=sq32n4x32b,tm32x16r4: only those cuda instances
  timeout -s ABRT ${SSMC_TUNE_TIMEOUT:-400} python -m benchmarks.tune_mamba1 --out "$OUT/h200_tune_$TAG.json" \
    --lengths "${SSMC_LENGTHS:-4096,2048}" --only "${SSMC_TUNE_ONLY:-triton,cuda}" --layouts bdl \
    --batch "${SSMC_BATCH:-8}" --kernels "${SSMC_TUNE_KERNELS:-}" ${SSMC_TUNE_BASELINE---baseline} >> "$LOG" 2>&1
  if [[ ${SSMC_TUNE_BLD:-1} == 1 ]]; then
    timeout ${SSMC_TUNE_BLD_TIMEOUT:-150} python -m benchmarks.tune_mamba1 --out "$OUT/h200_tune_${TAG}_bld.json" \
      --lengths 4096 --only cuda --layouts bld >> "$LOG" 2>&1
  fi
fi
if [[ $STEPS == *ssdseg* ]]; then    # per table config, each count in its own process
  timeout ${SSMC_SEG_TIMEOUT:-540} python -m benchmarks.tune_ssd --out "$OUT/h200_ssd_segments.json" --configs "${SSMC_SEG_CONFIGS:-table}" \
    --shape '{"b": 4, "h": 24, "p": 64, "n": 128, "L": 16384}' --segments "${SSMC_SEGMENTS:-auto,1,2,3,4}" \
    --baseline >> "$LOG" 2>&1
fi
if [[ $STEPS == *train* ]]; then     # mamba-ssm's backward builds (CPU) while the GPU tests run; SSMC_TRAIN_CONFIGS= (empty): no per-config backward timing
  BUILD=
  if [[ ${SSMC_TRAIN_WORKLOADS:-mamba1} == *mamba1* ]]; then   # Mamba-2's baseline is Triton: no build
    python -c "from benchmarks import baselines as B; B.build_selective_scan_fwd(backward=('bf16_real', 'fp32_real'))" \
      > "$OUT/mamba_ssm_build.log" 2>&1 & BUILD=$!
  fi
  echo "== tests/test_triton_bwd.py" >> "$LOG"
  timeout ${SSMC_TEST_TIMEOUT:-200} python -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_triton_bwd.py \
    -k "${SSMC_TRAIN_K:-gpu}" 2>&1 | tail -15 >> "$LOG"
  if [[ -n $BUILD ]]; then wait $BUILD; tail -3 "$OUT/mamba_ssm_build.log" >> "$LOG"; fi
  timeout ${SSMC_TRAIN_TIMEOUT:-300} python -m benchmarks.bench_train --out "$OUT/h200_train.json" --baseline ${SSMC_TRAIN_CONFIGS---configs} \
    --workloads "${SSMC_TRAIN_WORKLOADS:-mamba1,mamba2}" --targets "${SSMC_TRAIN_TARGETS:-triton,auto}" ${SSMC_TRAIN_FLAGS:-} >> "$LOG" 2>&1
fi
if [[ $STEPS == *pform* ]]; then     # a chunked SSD written without a loop (HF Mamba2's torch path): ssmc, eager, Inductor
  echo "== tests/test_parallel_form.py" >> "$LOG"
  timeout ${SSMC_TEST_TIMEOUT:-120} python -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_parallel_form.py 2>&1 | tail -15 >> "$LOG"
  timeout ${SSMC_PFORM_TIMEOUT:-300} python -m benchmarks.bench_parallel_form --out "$OUT/pform_gpu.json" ${SSMC_PFORM_FLAGS:-} >> "$LOG" 2>&1
fi
if [[ $STEPS == *ssdcore* ]]; then   # the chunked SSD core's training kernels alone, per tile config
  timeout ${SSMC_SSDCORE_TIMEOUT:-240} python -m benchmarks.probe_ssd_core --out "$OUT/h200_ssd_core.json" >> "$LOG" 2>&1
fi
if [[ $STEPS == *ncu* ]]; then      # hardware counters of the Mamba-1 region's default pick per target, L4096
  for t in ${SSMC_NCU_TARGETS:-cuda triton}; do
    timeout ${SSMC_NCU_TIMEOUT:-200} ncu --clock-control none --profile-from-start off --set full \
      --import-source no -f -o /tmp/ncu_$t python -m benchmarks.tune_mamba1 --out /dev/null \
      --profile-once $t --lengths 4096 >> "$LOG" 2>&1
    ncu -i /tmp/ncu_$t.ncu-rep --page details > "$OUT/ncu_$t.txt" 2>&1
    ncu -i /tmp/ncu_$t.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_${t}_sass.csv" 2>&1
  done
fi
if [[ $STEPS == *m1counters* ]]; then  # hardware counters of one Mamba-1 training step (Triton target), b8 d1536 n16 L2048
  timeout ${SSMC_NCU_TIMEOUT:-240} ncu --clock-control none --profile-from-start off --set full \
    --import-source no -f -o /tmp/ncu_m1bwd python -m benchmarks.bench_train --out /dev/null \
    --workloads mamba1 --targets triton --ncu-once >> "$LOG" 2>&1
  ncu -i /tmp/ncu_m1bwd.ncu-rep --page details > "$OUT/ncu_m1bwd.txt" 2>&1
  ncu -i /tmp/ncu_m1bwd.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_m1bwd_sass.csv" 2>&1
fi
if [[ $STEPS == *decode* ]]; then   # the decode step: Python call, host time, CUDA graph replay
  timeout ${SSMC_DECODE_TIMEOUT:-150} python -m benchmarks.probe_decode --out "$OUT/h200_decode_probe.json" >> "$LOG" 2>&1
fi
if [[ $STEPS == *moe* ]]; then
  # SSMC_MOE_FLAGS: e.g. "--variant seq4,seq2,seq8 --eager-L 0" (the grouped configs autotune
  # first, then the per-expert kernels per state size: the 210 s of 9699673 were too few)
  timeout ${SSMC_MOE_TIMEOUT:-450} python -m benchmarks.bench_moe --out "$OUT/h200_moe.json" ${SSMC_MOE_FLAGS:-} >> "$LOG" 2>&1
fi
if [[ $STEPS == *bsp,* || $STEPS == *bsp ]]; then
  timeout ${SSMC_BSP_TIMEOUT:-300} python -m benchmarks.bench_block_sparse --out "$OUT/h200_block_sparse.json" \
    --targets "${SSMC_BSP_TARGETS:-cuda,triton}" ${SSMC_BSP_FLAGS:-} >> "$LOG" 2>&1
fi
if [[ $STEPS == *bspprobe* ]]; then  # the CUDA block-sparse kernel: its pick, then ncu of one call (details, SASS page)
  timeout ${SSMC_BSP_TIMEOUT:-300} python -m benchmarks.probe_bsp --out "$OUT/h200_bsp_probe.json" >> "$LOG" 2>&1
  timeout ${SSMC_NCU_TIMEOUT:-200} ncu --clock-control none --profile-from-start off --set full -k regex:ssmc_bsp -c 1 \
    --import-source no -f -o /tmp/ncu_bsp python -m benchmarks.probe_bsp --out /dev/null ${SSMC_BSP_GROUPS:+--groups $SSMC_BSP_GROUPS} >> "$LOG" 2>&1
  ncu -i /tmp/ncu_bsp.ncu-rep --page details > "$OUT/ncu_bsp.txt" 2>&1
  ncu -i /tmp/ncu_bsp.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_bsp_sass.csv" 2>&1
fi
if [[ $STEPS == *batch1* ]]; then     # batch 1 (inference): the Mamba-1/-2 regions and the gated delta rule
  # SSMC_B1_NAME: the result files' stem; SSMC_B1_DELTA_ROWS: bench_delta_rule's rows (fla_recurrent: the wheel on PYTHONPATH)
  timeout ${SSMC_B1_TIMEOUT:-200} python -m benchmarks.run --workloads mamba1,mamba2 --batch 1 --lengths 4096 \
    --targets "${SSMC_TARGETS:-triton,cuda,auto}" --eager-max-len 0 --no-ablations --out /tmp/ssmc_run \
    --name "${SSMC_B1_NAME:-batch1}" >> "$LOG" 2>&1
  cp "/tmp/ssmc_run/${SSMC_B1_NAME:-batch1}.json" "$OUT/" 2>/dev/null
  timeout ${SSMC_B1_DELTA_TIMEOUT:-150} python -m benchmarks.bench_delta_rule --shape 1,4096,16,128,128 \
    --rows "${SSMC_B1_DELTA_ROWS:-ssmc,ssmc_torch}" --out "$OUT/${SSMC_B1_NAME:-batch1}_delta.json" >> "$LOG" 2>&1
fi
if [[ $STEPS == *scanmixer* ]]; then  # a mixer around torch's associative_scan: ssmc, ssmc without sink_consumers, Inductor
  timeout ${SSMC_MIXER_TIMEOUT:-300} python -m benchmarks.bench_scan_mixer --out "$OUT/scan_mixer.json" >> "$LOG" 2>&1
fi
if [[ $STEPS == *zoo* ]]; then       # tests/test_zoo.py's programs: ssmc against the eager loop, b8 L1024 d256 n16
  timeout ${SSMC_ZOO_TIMEOUT:-240} python -m benchmarks.bench_zoo --out "$OUT/zoo.json" >> "$LOG" 2>&1
fi
if [[ $STEPS == *demo* ]]; then      # the README's first command's script
  echo "== examples/naive_mamba.py" >> "$LOG"
  timeout ${SSMC_DEMO_TIMEOUT:-240} python examples/naive_mamba.py >> "$LOG" 2>&1
fi
if [[ $STEPS == *fuzz* ]]; then      # workers share the GPU: compiling (Dynamo, Triton, NVRTC) is CPU-bound
  echo "== fuzz" >> "$LOG"
  SSMC_FUZZ_DEVICE=cuda SSMC_FUZZ_TARGETS=${SSMC_FUZZ_TARGETS:-triton,cuda,auto} \
  SSMC_FUZZ_EXAMPLES=${SSMC_FUZZ_EXAMPLES:-2000} SSMC_FUZZ_SECONDS=${SSMC_FUZZ_SECONDS:-220} \
  SSMC_FUZZ_WORKERS=${SSMC_FUZZ_WORKERS:-$(( $(nproc) > 4 ? $(nproc) - 4 : 1 ))} \
  SSMC_FUZZ_OUT="$OUT/fuzz_gpu.json" \
    timeout ${SSMC_FUZZ_TIMEOUT:-330} python -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_fuzz.py \
      -k gpu_programs 2>&1 | tail -30 >> "$LOG"
fi
tail -40 "$LOG"
