# Sourced by the scripts that run on the device machine (gpu_check.sh, ddp_check.sh): the repo
# root as working directory, $OUT, NVLink multicast off in NCCL, PyTorch and NVSHMEM (the device
# notes: a program using it can take the host's shared GPUs out of service), and the project
# installed from the working tree without touching the machine's own torch.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/ssmc_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARNING | tail -2
