"""The chunked SSD's core map as Triton kernels, forward and backward, for training.

    h_t = e^(u_t) h_(t-1) + w_t x_t g_t^T,   y_t = h_t c_t,   h_L           (a (p, n) state)

for every index of the program axes. ssd_autograd.py evaluates the region's factors (u, w, x, g,
c from its `SSDPlan`) in torch and calls `core` here; autograd then carries du ... dc back through
the factor expressions to the region's inputs. The kernels (templates/triton/ssd_core.py.j2):
the chunk-start states (sequential over chunks, parallel over (p, n) blocks), the outputs per
chunk, the end-state gradients (the same walk in reverse) and every gradient per chunk. Memory:
two fp32 (P, chunks, p, n) state buffers, nothing of size (P, L, p, n).

A factor is passed in its own shape, (program axes or 1, L or 1, p / n or 1), and read through
stride 0 where it is broadcast (Mamba-2's B and C are shared by the heads); its gradient is then
added atomically, or in deterministic mode stored at the full shape and summed by torch.
"""
from __future__ import annotations

import math

import torch

from . import triton as T

TEMPLATE = "triton/ssd_core.py.j2"
LOG2E = 1.4426950408889634
# tile sizes and warps per kernel (p, n rounded up to powers of two, at least 16: tl.dot's minimum)
CONFIG = {"states": {"BLOCK_P": 32, "BLOCK_N": 32, "num_warps": 4},
          "chunk_fwd": {"BLOCK_P": 64, "num_warps": 4},
          "chunk_bwd": {"BLOCK_P": 32, "num_warps": 8}}


def opd_of(dtypes) -> str:
    """The dots' operand type: the inputs' 16-bit type when x, g and c all come from one, else fp32."""
    kinds = set(dtypes)
    if len(kinds) == 1 and kinds <= {torch.bfloat16, torch.float16}:
        return "tl.bfloat16" if kinds == {torch.bfloat16} else "tl.float16"
    return "tl.float32"


def render(opd: str, nprog: int) -> str:
    prec = {"tl.float32": "tf32x3"}.get(opd, "")
    return T._env().get_template(TEMPLATE).render(
        opd=opd, nprog=nprog, prec=prec, prec_kw=f', input_precision="{prec}"' if prec else "",
        log2e=repr(LOG2E))


def _module(opd: str, nprog: int, cache_dir: str | None):
    from ssmc.options import default_cache_dir
    from ssmc.runtime.cache import cache_key, get_cache
    src = render(opd, nprog)
    key = cache_key("triton-ssd-core", src, T._TRITON_VERSION)
    return T.import_source(src, key, get_cache(cache_dir or default_cache_dir()))[0]


def _p2(n: int, lo: int = 16, hi: int | None = None) -> int:
    b = max(lo, 1 << max(0, int(n) - 1).bit_length())
    return min(b, hi) if hi else b


def _args(t: torch.Tensor) -> list:
    """A tensor and its strides, 0 along axes of size 1 (read broadcast)."""
    return [t, *(s if d != 1 else 0 for s, d in zip(t.stride(), t.shape))]


def _aliased(t: torch.Tensor, full: tuple) -> bool:
    return any(d == 1 and f > 1 for d, f in zip(t.shape, full))


class Spec:
    """Shapes of one call: program axis sizes S, length L, p, n; chunk, operand type."""

    def __init__(self, S: tuple, L: int, p: int, n: int, chunk: int, opd: str, deterministic: bool,
                 cache_dir: str | None = None):
        self.S, self.L, self.p, self.n, self.chunk = tuple(S), L, p, n, chunk
        self.P = math.prod(self.S)
        self.NC = -(-L // chunk)
        self.opd, self.deterministic = opd, deterministic
        self.mod = _module(opd, len(self.S), cache_dir)

    def launch_kw(self, device, warps: int, dot_up: bool) -> dict:
        kw = {"DOT_UP": dot_up}
        if device.type == "cuda":
            kw["num_warps"] = warps
        return kw


def _forward(sp: Spec, u, w, x, g, c, h0):
    dev = x.device
    dot_up = dev.type != "cuda" and sp.opd != "tl.float32"
    H = torch.empty(sp.P, sp.NC, sp.p, sp.n, device=dev, dtype=torch.float32)
    hl = torch.empty(sp.P, sp.p, sp.n, device=dev, dtype=torch.float32)
    cf = CONFIG["states"]
    BP, BN = _p2(sp.p, hi=cf["BLOCK_P"]), _p2(sp.n, hi=cf["BLOCK_N"])
    grid = (sp.P, -(-sp.p // BP), -(-sp.n // BN))
    h0a = _args(h0) if h0 is not None else [H, *([0] * (len(sp.S) + 2))]
    sp.mod.ssd_states[grid](*_args(u), *_args(w), *_args(x), *_args(g), *h0a, H, hl, *sp.S, sp.L,
                            sp.NC, sp.p, sp.n, HAS_H0=h0 is not None, CHUNK=sp.chunk, BLOCK_P=BP,
                            BLOCK_N=BN, **sp.launch_kw(dev, cf["num_warps"], dot_up))
    y = torch.empty(sp.P, sp.L, sp.p, device=dev, dtype=torch.float32)
    cf = CONFIG["chunk_fwd"]
    BP = _p2(sp.p, hi=cf["BLOCK_P"])
    sp.mod.ssd_chunk_fwd[(sp.P, sp.NC, -(-sp.p // BP))](
        *_args(u), *_args(w), *_args(x), *_args(g), *_args(c), H, y, *sp.S, sp.L, sp.NC, sp.p, sp.n,
        CHUNK=sp.chunk, BLOCK_P=BP, BLOCK_N=_p2(sp.n), **sp.launch_kw(dev, cf["num_warps"], dot_up))
    return y, hl, H


def _grad_buffer(t: torch.Tensor, full: tuple, deterministic: bool):
    """(buffer the kernel writes, atomic?, how to turn the buffer into t's gradient)."""
    if not _aliased(t, full):
        return torch.empty(t.shape, device=t.device, dtype=torch.float32), False, lambda b: b
    if not deterministic:
        return torch.zeros(t.shape, device=t.device, dtype=torch.float32), True, lambda b: b
    dims = [i for i, (d, f) in enumerate(zip(t.shape, full)) if d == 1 and f > 1]
    buf = torch.empty(full, device=t.device, dtype=torch.float32)
    return buf, False, lambda b: b.sum(dims, keepdim=True)


def _backward(sp: Spec, u, w, x, g, c, H, dy, dhl):
    dev = x.device
    dot_up = dev.type != "cuda" and sp.opd != "tl.float32"
    dy = dy.to(torch.float32).reshape(*sp.S, sp.L, sp.p)
    dE = torch.empty_like(H)
    dh0 = torch.empty(sp.P, sp.p, sp.n, device=dev, dtype=torch.float32)
    cf = CONFIG["states"]
    BP, BN = _p2(sp.p, hi=cf["BLOCK_P"]), _p2(sp.n, hi=cf["BLOCK_N"])
    dhla = [H, *([0] * (len(sp.S) + 2))]
    if dhl is not None:
        dhl = dhl.to(torch.float32).reshape(*sp.S, sp.p, sp.n)
        dhla = _args(dhl)
    sp.mod.ssd_dstates[(sp.P, -(-sp.p // BP), -(-sp.n // BN))](
        *_args(u), *_args(dy), *_args(c), *dhla, dE, dh0, *sp.S, sp.L, sp.NC, sp.p, sp.n,
        HAS_DHL=dhl is not None, CHUNK=sp.chunk, BLOCK_P=BP, BLOCK_N=BN,
        **sp.launch_kw(dev, cf["num_warps"], dot_up))
    fulls = {"u": (*sp.S, sp.L, 1), "w": (*sp.S, sp.L, 1), "x": (*sp.S, sp.L, sp.p),
             "g": (*sp.S, sp.L, sp.n), "c": (*sp.S, sp.L, sp.n)}
    bufs = {k: _grad_buffer(t, fulls[k], sp.deterministic)
            for k, t in zip(fulls, (u, w, x, g, c))}
    cf = CONFIG["chunk_bwd"]
    BP = _p2(sp.p, hi=cf["BLOCK_P"])
    sp.mod.ssd_chunk_bwd[(sp.P, sp.NC)](
        *_args(u), *_args(w), *_args(x), *_args(g), *_args(c), *_args(dy), H, dE,
        *(a for k in fulls for a in _args(bufs[k][0])), *sp.S, sp.L, sp.NC, sp.p, sp.n,
        **{f"ATOMIC_{k.upper()}": bufs[k][1] for k in fulls},
        CHUNK=sp.chunk, BLOCK_P=BP, BLOCK_N=_p2(sp.n), NPB=-(-sp.p // BP),
        **sp.launch_kw(dev, cf["num_warps"], dot_up))
    grads = [bufs[k][2](bufs[k][0]) for k in fulls]
    return grads, dh0


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sp: Spec, u, w, x, g, c, h0):
        y, hl, H = _forward(sp, u, w, x, g, c, h0)
        ctx.sp, ctx.has_h0 = sp, h0 is not None
        ctx.save_for_backward(u, w, x, g, c, H)
        return y, hl

    @staticmethod
    def backward(ctx, dy, dhl):
        u, w, x, g, c, H = ctx.saved_tensors
        sp = ctx.sp
        if dy is None:
            dy = torch.zeros(sp.P, sp.L, sp.p, device=x.device, dtype=torch.float32)
        (du, dw, dx, dg, dc), dh0 = _backward(sp, u, w, x, g, c, H, dy, dhl)
        dh0 = dh0.reshape(*sp.S, sp.p, sp.n) if ctx.has_h0 else None
        return None, du, dw, dx, dg, dc, dh0


def core(sp: Spec, u, w, x, g, c, h0):
    """(y (P, L, p), h_L (P, p, n)) in fp32, P the program axes flattened (the last fastest).
    u, w: (*S or 1, L or 1, 1); x: (..., p or 1); g, c: (..., n or 1); h0: (*S, p, n) or None."""
    return _Core.apply(sp, u, w, x, g, c, h0)
