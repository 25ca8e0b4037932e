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


# Our own stub: mamba-ssm's binding references every backward instantiation; those we do not
# build are defined here to fail loudly if ever called.
_CTYPE = {"fp32": "float", "fp16": "at::Half", "bf16": "at::BFloat16", "real": "float",
          "complex": "c10::complex<float>"}
_BWD_ALL = [f"{t}_{k}" for t in ("fp32", "fp16", "bf16") for k in ("real", "complex")]


def _bwd_stub(built) -> str:
    lines = ['#include <torch/extension.h>', '#include "selective_scan.h"',
             "template<typename input_t, typename weight_t>",
             "void selective_scan_bwd_cuda(SSMParamsBwd &params, cudaStream_t stream) {",
             '    TORCH_CHECK(false, "this backward is not built in this benchmark build");', "}"]
    for name in _BWD_ALL:
        if name not in built:
            t, k = name.split("_")
            lines.append(f"template void selective_scan_bwd_cuda<{_CTYPE[t]}, {_CTYPE[k]}>(SSMParamsBwd &, cudaStream_t);")
    return "\n".join(lines) + "\n"


def build_selective_scan_fwd(build_dir: str = "/tmp/ssmc_mamba_build", backward=()):
    """mamba-ssm's hand-written CUDA selective_scan, forward files only, plus the backward files
    named in `backward` ("bf16_real", ...; True: all six), compiled for this GPU with torch's
    cpp_extension (2-3 minutes a run: the build, 27 MB, is over what comes back from the device)."""
    from torch.utils.cpp_extension import load
    src = mamba_ssm_src()
    if src is None:
        raise RuntimeError("mamba-ssm sdist not found (.carry/mamba_ssm-*)")
    cs = src / "csrc" / "selective_scan"
    os.makedirs(build_dir, exist_ok=True)
    sources = [str(cs / "selective_scan.cpp")] + [str(cs / f"selective_scan_fwd_{t}.cu") for t in ("fp32", "fp16", "bf16")]
    built = tuple(_BWD_ALL) if backward is True else tuple(backward or ())
    sources += [str(cs / f"selective_scan_bwd_{name}.cu") for name in built]
    if len(built) < len(_BWD_ALL):
        stub = Path(build_dir) / f"bwd_stub_{'_'.join(built) or 'none'}.cu"
        stub.write_text(_bwd_stub(built))
        sources.append(str(stub))
    major, minor = torch.cuda.get_device_capability()
    flags = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
             "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
             f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    return load(name="selective_scan_cuda_bench" + "".join(f"_{n}" for n in built), sources=sources,
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
