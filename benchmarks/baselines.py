"""Baselines to measure against, in the same run: mamba-ssm's kernels (built or imported from
its PyPI sdist, carried to the GPU machine under .carry/; used only to measure against, none
of its code is part of ssmc) and PyTorch's own associative_scan compiled by Inductor."""
from __future__ import annotations

import glob
import os
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def mamba_ssm_src() -> Path | None:
    env = os.environ.get("MAMBA_SSM_SRC")
    if env:
        return Path(env)
    found = sorted(glob.glob(str(ROOT / ".carry" / "mamba_ssm-*")))
    return Path(found[-1]) if found else None


# Our own stub: mamba-ssm's binding references the backward; we build only the forward files,
# so the backward entry points are defined here to fail loudly if ever called.
_BWD_STUB = r"""
#include <torch/extension.h>
#include "selective_scan.h"
template<typename input_t, typename weight_t>
void selective_scan_bwd_cuda(SSMParamsBwd &params, cudaStream_t stream) {
    TORCH_CHECK(false, "backward not built in this benchmark build");
}
template void selective_scan_bwd_cuda<float, float>(SSMParamsBwd &, cudaStream_t);
template void selective_scan_bwd_cuda<float, c10::complex<float>>(SSMParamsBwd &, cudaStream_t);
template void selective_scan_bwd_cuda<at::Half, float>(SSMParamsBwd &, cudaStream_t);
template void selective_scan_bwd_cuda<at::Half, c10::complex<float>>(SSMParamsBwd &, cudaStream_t);
template void selective_scan_bwd_cuda<at::BFloat16, float>(SSMParamsBwd &, cudaStream_t);
template void selective_scan_bwd_cuda<at::BFloat16, c10::complex<float>>(SSMParamsBwd &, cudaStream_t);
"""


def build_selective_scan_fwd(build_dir: str = "/tmp/ssmc_mamba_build", backward: bool = False):
    """mamba-ssm's hand-written CUDA selective_scan, forward files only (plus backward when
    asked), compiled for this GPU with torch's cpp_extension."""
    from torch.utils.cpp_extension import load
    src = mamba_ssm_src()
    if src is None:
        raise RuntimeError("mamba-ssm sdist not found (.carry/mamba_ssm-*)")
    cs = src / "csrc" / "selective_scan"
    os.makedirs(build_dir, exist_ok=True)
    sources = [str(cs / "selective_scan.cpp")] + [str(cs / f"selective_scan_fwd_{t}.cu") for t in ("fp32", "fp16", "bf16")]
    if backward:
        sources += [str(cs / f"selective_scan_bwd_{t}_{k}.cu") for t in ("fp32", "fp16", "bf16") for k in ("real", "complex")]
    else:
        stub = Path(build_dir) / "bwd_stub.cu"
        stub.write_text(_BWD_STUB)
        sources.append(str(stub))
    major, minor = torch.cuda.get_device_capability()
    flags = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
             "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
             f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    return load(name="selective_scan_cuda_bench" + ("_bwd" if backward else ""), sources=sources,
                extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=flags,
                extra_include_paths=[str(cs)], build_directory=build_dir, verbose=False)


def import_mamba_triton():
    """mamba-ssm's Triton kernels (mamba_chunk_scan_combined, selective_state_update), imported
    from the sdist without running its package __init__ (which needs the CUDA extensions)."""
    src = mamba_ssm_src()
    if src is None:
        raise RuntimeError("mamba-ssm sdist not found (.carry/mamba_ssm-*)")
    pkg = src / "mamba_ssm"
    for name, sub in (("mamba_ssm", ""), ("mamba_ssm.ops", "ops"), ("mamba_ssm.ops.triton", "ops/triton"),
                      ("mamba_ssm.utils", "utils")):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [str(pkg / sub)]
            sys.modules[name] = m
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    return mamba_chunk_scan_combined, selective_state_update


def assoc_scan_mamba1(u, delta, A, B, C, D, z, delta_bias):
    """Mamba-1 through torch's associative_scan (pointwise combine); compile with Inductor.
    Layout as mamba-ssm: u, delta, z (b, d, L); B, C (b, n, L)."""
    from torch._higher_order_ops.associative_scan import associative_scan
    dt = F.softplus(delta.float() + delta_bias[None, :, None])                 # (b, d, L)
    dA = torch.exp(dt[:, :, None, :] * A[None, :, :, None])                   # (b, d, n, L)
    dBu = (dt * u.float())[:, :, None, :] * B.float()[:, None, :, :]
    def combine(l, r):
        return l[0] * r[0], r[0] * l[1] + r[1]
    _, h = associative_scan(combine, (dA, dBu), dim=3)
    y = (h * C.float()[:, None, :, :]).sum(2) + D[None, :, None] * u.float()
    return (y * F.silu(z.float())).to(u.dtype)
