#!/usr/bin/env bash
# DDP scaling on nvidia-h200-x2: the naive Mamba LM compiled with ssmc, one GPU against two, same
# global batch, per model size.   run(command="bash benchmarks/ddp_check.sh", kind="nvidia-h200-x2")
# SSMC_DDP_CONFIGS: ';'-separated name[:worlds]=args (worlds: e.g. 1 or 12, default 12). Writes $OUT/h200x2_ddp_<name>_<world>gpu.json, a
# profiler table of one steady one-GPU step ($OUT/ddp_<name>_profile.txt) and $OUT/ddp_check.log.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/ddp_check.log"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee -a "$LOG"
CONFIGS=${SSMC_DDP_CONFIGS:-"d64=--global-batch 256 --length 128;d512=--d-model 512 --global-batch 256 --length 128 --lr 1e-3;d512eager:1=--d-model 512 --global-batch 256 --length 128 --lr 1e-3 --backend eager"}
IFS=';' read -ra CFG <<< "$CONFIGS"
for c in "${CFG[@]}"; do
  name=${c%%=*}; args=${c#*=}; worlds=12
  [[ $name == *:* ]] && worlds=${name#*:} && name=${name%%:*}
  for world in $(echo "$worlds" | grep -o .); do
    echo "== $name world $world: $args" | tee -a "$LOG"
    prof=""; [[ $world == 1 ]] && prof="--profile $OUT/ddp_${name}_profile.txt"
    start=$SECONDS
    # shellcheck disable=SC2086
    timeout ${SSMC_DDP_TIMEOUT:-200} torchrun --standalone --nproc_per_node=$world examples/ddp_train.py \
      --steps ${SSMC_DDP_STEPS:-50} $args $prof --json "$OUT/h200x2_ddp_${name}_${world}gpu.json" >> "$LOG" 2>&1
    echo "rc $? after $((SECONDS - start)) s" | tee -a "$LOG"
  done
done
tail -30 "$LOG"
