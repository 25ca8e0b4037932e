"""The gradients of a non-diagonal transition m = f_rows * f_mat over a chunk of the backward
(mix_adjoint.py `_mix_grads`), as one generated Triton kernel that reads lam and the states once.

With f_rows along time and the rows (Euler's dt) and f_mat along the matrix's axes (A, the
mask), the two sums the backward needs are
    G[i, j] = sum over steps and rows of f_rows lam_i h_j     (the f_mat inputs' gradient)
    rs      = sum over i, j of lam_i f_mat[i, j] h_j           (the f_rows inputs', per step and row)
In torch ops they are five passes over the chunk's (steps, rows, n) fp32 state and two writes of
it (f_rows lam, then a matrix product; f_mat h, then a product summed), about half of the
backward's kernel time at the block-sparse benchmark's shape (H100 profile at 748af80). Here a
program loads a block of rows of lam and h, adds (f_rows lam)^T h into its own G (a tensor-core
dot, tf32x3 for fp32) and stores lam . (h f_mat^T) for those rows; torch sums the programs' G.

``gram_and_rows(lam, h, fr, fm)``: lam, h (K, n) contiguous fp32; fr (K,) or None; fm (n, n) or
None; returns (G or None, rs or None). `usable` says whether the kernel runs them (CUDA, or any
device while ``FORCE`` is set: tests under TRITON_INTERPRET); otherwise torch computes the same,
as it does from then on if the kernel fails to compile or launch (`FAILED` keeps why; logged once
and named in the backward's note).
"""
from __future__ import annotations

import functools
import logging

import torch

from . import triton as T

TEMPLATE = "triton/transition_grads.py.j2"
KNAME = "ssmc_transition_grads"
MAX_N = 128             # the state's last axis: one (BLOCK_N, BLOCK_N) tile
FORCE = False
FAILED: str | None = None   # the kernel's first compile or launch failure: torch ops from then on
log = logging.getLogger("ssmc")
# H100 at f73e543 (`benchmarks.probe_transition_grads --split`, one 512-step chunk of the
# block-sparse benchmark, n 64): both outputs 1.87 ms with this config, 2.5-7.5 ms with the other
# eight timed; the torch ops it replaces 5.06 ms
CONFIG = {"BLOCK_K": 64, "num_warps": 4, "programs_per_sm": 2, "num_stages": 2}


def render(prec: str) -> str:
    return T._env().get_template(TEMPLATE).render(
        kname=KNAME, prec=prec, prec_kw=f', input_precision="{prec}"' if prec else "")


@functools.lru_cache(maxsize=8)
def _module(prec: str, cache_dir: str, interpreting: bool):
    from ssmc.runtime.cache import cache_key, get_cache
    src = render(prec)
    return T.import_source(src, cache_key("triton-transition-grads", src, T._TRITON_VERSION), get_cache(cache_dir))[0]


def usable(lam: torch.Tensor) -> bool:
    if FAILED is not None or lam.dtype != torch.float32 or lam.dim() != 2 or lam.shape[1] > MAX_N:
        return False
    return FORCE or (lam.is_cuda and T._TRITON_VERSION[0].isdigit())


def gram_and_rows(lam, h, fr=None, fm=None, config: dict | None = None):
    """(G, rs): see the module docstring; by the kernel where `usable`, else by torch. `config`
    overrides entries of `CONFIG` (benchmarks.probe_transition_grads times them)."""
    K, n = lam.shape
    if fr is None and fm is None:
        return None, None
    if not usable(lam) or K == 0:
        return _by_torch(lam, h, fr, fm)
    lam, h = lam.contiguous(), h.to(lam.dtype).contiguous()
    dev = lam.device
    cfg = {**CONFIG, **(config or {})}
    bn = max(16, T._pow2(n))
    nblocks = -(-K // cfg["BLOCK_K"])
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    nprog = max(1, min(nblocks, cfg["programs_per_sm"] * sms))
    dummy = torch.empty(1, dtype=lam.dtype, device=dev)
    frv = fr.to(lam.dtype).contiguous() if fr is not None else dummy
    fmv = fm.to(lam.dtype).contiguous() if fm is not None else dummy
    Gp = torch.empty((nprog, n, n), dtype=torch.float32, device=dev) if fr is not None else dummy
    rs = torch.empty(K, dtype=torch.float32, device=dev) if fm is not None else dummy
    from ssmc.options import default_cache_dir
    prec = "tf32x3" if dev.type == "cuda" else ""
    kw = {}
    if dev.type == "cuda":
        kw["num_warps"] = cfg["num_warps"]
        if cfg["num_stages"]:
            kw["num_stages"] = cfg["num_stages"]
    try:
        mod = _module(prec, default_cache_dir(), T.interpreting())
        getattr(mod, KNAME)[(nprog,)](lam, h, frv, fmv, Gp, rs, K, n, nprog, BLOCK_K=cfg["BLOCK_K"], BLOCK_N=bn,
                                       WANT_G=fr is not None, WANT_RS=fm is not None, **kw)
    except Exception as e:
        global FAILED
        FAILED = f"{type(e).__name__}: {e}"
        log.warning("ssmc: the transition_grads kernel failed (%s); the transition's gradients run as "
                    "torch ops from now on", FAILED)
        return _by_torch(lam, h, fr, fm)
    return (Gp.sum(0) if fr is not None else None), (rs if fm is not None else None)


def _by_torch(lam, h, fr, fm):
    G = (lam * fr[:, None]).T @ h if fr is not None else None
    rs = (lam * (h @ fm.T)).sum(1) if fm is not None else None
    return G, rs
