"""The sum of a product of two tensors over one dim, as one generated Triton kernel that reads
each operand once and writes only the sums.

The chunked backward of a region with a non-diagonal transition (mix_adjoint.py) sums products
such as dC[t, b, n] = sum_d dy[t, b, d] h[t, b, d, n] and dx[t, b, d] = sum_n lam[t, b, d, n]
B[t, b, n] over whole chunks (`reference.contract`). As einsums these are batched
matrix-vector products, which cuBLAS runs at a fraction of the memory bandwidth (the H200
profile of the block-sparse backward at 345de05: ~37 ms of its 88); as a multiply and a sum
they write and read back a product of the operands' full size. Here a program reads a tile of
each operand through its strides (0 where it is broadcast), multiplies, and sums in fp32.

``mul_sum(a, b, dim)``: a, b of one rank, broadcastable; the result has the broadcast shape
with size 1 at `dim` (`mul_sum_dims`: over several consecutive dims the strides let it merge).
`usable(a, b)` says whether the kernel runs them (CUDA tensors of a float dtype Triton sums in
fp32, large enough to pay for a launch; or any device while ``FORCE`` is set, as the CPU tests
do under TRITON_INTERPRET). If the kernel fails to compile
or launch, the sums run as torch ops from then on: `FAILED` keeps why (logged once, and named
in the backward's note), since the torch reference's own backward sums through here too.
"""
from __future__ import annotations

import functools
import logging
import math

import torch

from . import triton as T

TEMPLATE = "triton/mul_sum.py.j2"
TILE = 4096                 # elements of a (BLOCK_I, BLOCK_R) tile
MIN_ELEMENTS = 1 << 16      # below this, torch
MAX_OUTER = 4               # outer output dims the kernel indexes (more: torch)
MAX_INNER = 1 << 20         # the innermost output dim's blocks are the grid's second axis
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORCE = False               # run the kernel on any device (tests, under TRITON_INTERPRET)
FAILED: str | None = None   # the kernel's first compile or launch failure: torch ops from then on

log = logging.getLogger("ssmc")


def kname(outer: int) -> str:
    return f"ssmc_mul_sum_{outer}"


def render(outer: int) -> str:
    return T._env().get_template(TEMPLATE).render(kname=kname(outer), outer=outer)


@functools.lru_cache(maxsize=16)
def _module(outer: int, cache_dir: str, interpreting: bool):
    from ssmc.runtime.cache import cache_key, get_cache
    src = render(outer)
    return T.import_source(src, cache_key("triton-mul-sum", src, T._TRITON_VERSION), get_cache(cache_dir))[0]


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    if FAILED is not None or a.dim() != b.dim() or a.dtype not in DTYPES or b.dtype not in DTYPES:
        return False
    if not FORCE and not (a.is_cuda and b.is_cuda and T._TRITON_VERSION[0].isdigit()):
        return False
    return FORCE or max(a.numel(), b.numel()) >= MIN_ELEMENTS


def _strides(t: torch.Tensor, shape) -> list:
    return list(t.expand(shape).stride())


def mul_sum_dims(a: torch.Tensor, b: torch.Tensor, dims) -> torch.Tensor | None:
    """sum over the consecutive `dims` (keepdim) of a * b by one `mul_sum`: the dims merged into
    one, which both operands' strides (as broadcast) must allow; None where they do not or the
    kernel cannot run them."""
    dims = sorted(d % a.dim() for d in dims) if a.dim() else []
    if not dims or dims != list(range(dims[0], dims[0] + len(dims))) or not usable(a, b):
        return None
    shape = list(torch.broadcast_shapes(a.shape, b.shape))
    d0, d1 = dims[0], dims[-1]
    views = []
    for x in (a, b):
        st = _strides(x, shape)
        if any(st[d] != st[d + 1] * shape[d + 1] for d in range(d0, d1)):
            return None
        views.append(x.expand(shape).as_strided(shape[:d0] + [math.prod(shape[d0:d1 + 1])] + shape[d1 + 1:],
                                                st[:d0] + [st[d1]] + st[d1 + 1:]))
    got = mul_sum(views[0], views[1], d0)
    return got.reshape(shape[:d0] + [1] * len(dims) + shape[d1 + 1:])


def mul_sum(a: torch.Tensor, b: torch.Tensor, dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum over `dim` (keepdim) of a * b, in torch.promote_types(a.dtype, b.dtype), written into
    `out` when given (that shape and dtype); torch where the kernel cannot run them (`usable`,
    or more than MAX_OUTER other dims of size > 1)."""
    shape = list(torch.broadcast_shapes(a.shape, b.shape))
    nd = len(shape)
    dim = dim % nd if nd else 0
    dtype = torch.promote_types(a.dtype, b.dtype)
    others = [d for d in range(nd) if d != dim and shape[d] != 1]
    out_shape = shape[:dim] + [1] + shape[dim + 1:]
    if out is not None and (list(out.shape) != out_shape or out.dtype != dtype):
        raise ValueError(f"mul_sum: out is {tuple(out.shape)} {out.dtype}, the sum is {tuple(out_shape)} {dtype}")
    if not usable(a, b) or len(others) > MAX_OUTER + 1 or 0 in shape or shape[others[-1] if others else dim] > MAX_INNER:
        value = (a.to(dtype) * b.to(dtype)).sum(dim, keepdim=True)
        return value if out is None else out.copy_(value)
    if out is None:
        out = torch.empty(out_shape, dtype=dtype, device=a.device)
    sa, sb, so = _strides(a, shape), _strides(b, shape), list(out.stride())
    inner = others[-1] if others else None
    outer = others[:-1]
    size_i = shape[inner] if inner is not None else 1
    pick = lambda s, d: s[d] if d is not None else 0
    R = shape[dim]
    big = sa if a.numel() >= b.numel() else sb
    r_fast = abs(big[dim]) <= abs(pick(big, inner)) if inner is not None else True
    block_i = min(T._pow2(size_i), 64 if not r_fast else max(1, TILE // min(T._pow2(R), 128)))
    block_r = max(1, min(T._pow2(R), TILE // block_i))
    args = [a, b, out]
    for d in outer:
        args += [shape[d], sa[d], sb[d], so[d]]
    args += [size_i, pick(sa, inner), pick(sb, inner), pick(so, inner), R, sa[dim], sb[dim]]
    from ssmc.options import default_cache_dir
    grid = (math.prod(shape[d] for d in outer), -(-size_i // block_i))
    kw = {"num_warps": 4} if a.is_cuda else {}
    try:
        mod = _module(len(outer), default_cache_dir(), T.interpreting())
        getattr(mod, kname(len(outer)))[grid](*args, BLOCK_I=block_i, BLOCK_R=block_r, R_FAST=r_fast, **kw)
    except Exception as e:
        global FAILED
        FAILED = f"{type(e).__name__}: {e}"
        log.warning("ssmc: the mul_sum kernel failed (%s); the backward's sums run as torch ops from now on", FAILED)
        return out.copy_((a.to(dtype) * b.to(dtype)).sum(dim, keepdim=True))
    return out
