"""The chunked SSD's core map as Triton kernels, forward and backward, for training.

    h_t = e^(u_t) h_(t-1) + w_t x_t g_t^T,   y_t = h_t c_t,   h_L           (a (p, n) state)

for every index of the program axes. ssd_autograd.py evaluates the region's factors (u, w, x, g,
c from its `SSDPlan`) in torch and calls `core` here (autograd then carries du ... dc back through
the factor expressions to the region's inputs), or `_forward` and `_backward` directly when the
whole backward runs as kernels. The kernels (templates/triton/ssd_core.py.j2):
each chunk's own end state (all chunks at once), the chunk-start states (an elementwise walk over
chunks), the outputs per chunk; backward, the end-state gradients the same two ways in reverse,
then dx per chunk and block of p, and dg, dc, du, dw per chunk and block of n. Memory:
two (P, chunks / KEEP, p, n) state buffers in the dots' operand type (a state kept every KEEP
chunks, the others recomputed by the kernels that read them), nothing of size (P, L, p, n).

A factor is passed in its own shape, (program axes or 1, L or 1, p / n or 1), and read through
stride 0 where it is broadcast (Mamba-2's B and C are shared by the heads); its gradient is then
stored at the full shape and summed by torch (faster on the H200 than atomic adds, whose adds from
the heads of one chunk collide; deterministic too). Only du and dw add up atomically, over blocks
of n, and deterministic mode writes one slot per block of n instead, summed by torch.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch

from . import triton as T

TEMPLATE = "triton/ssd_core.py.j2"
LOG2E = 1.4426950408889634
# tile sizes and warps per kernel (p, n rounded up to powers of two, at least 16: tl.dot's minimum)
# core: the chunk of training's core (ssd_autograd.py) and KEEP, the chunks per kept state: the
# state buffers (the start states H and their gradients, the largest tensors of the backward)
# hold one state every KEEP chunks, and the chunk kernels recompute the others from them.
# KEEP 1: with KEEP 2 (half the state memory), Triton 3.6 miscompiles ssd_bwd_dbc on sm_90 where
# its recompute (a tl.dot under a run-time branch) meets some specializations: on an H100, bf16,
# p 64, per-head B and C (no heads looped: HEADS == 1) it read shared memory out of range (an
# illegal address), and with 8 warps or unspecialized strides its dB and du were wrong (errors
# 0.2-0.55), with no fault; with KEEP 1 all of these matched float64 (benchmarks/NOTES.md,
# session of 2026-12-07, third)
CONFIG = {"core": {"CHUNK": 64, "KEEP": 1},
          "chunk_state": {"BLOCK_P": 64, "BLOCK_N": 128, "num_warps": 4},
          "pass": {"BLOCK": 256, "num_warps": 2},
          "chunk_fwd": {"BLOCK_P": 64, "num_warps": 4},
          "bwd_dx": {"BLOCK_P": 64, "num_warps": 4},
          # heads: how the program indices that share g and c (Mamba-2's heads) sum dg and dc:
          # "loop" (a program loops over them, summing in registers), "atomic" (atomic adds;
          # "loop" in deterministic mode) or "store" (per index, summed by torch: buffers of
          # (P, L, n) fp32)
          "bwd_dbc": {"BLOCK_P": 64, "BLOCK_N": 32, "num_warps": 4, "heads": "loop"}}

# fp32 operands (tf32x3 dots) take about twice the shared memory: ssd_bwd_dbc at BLOCK_N 128 or
# CHUNK 128 would need more than an H200 has (228 KiB); these override CONFIG for them
FP32 = {"core": {"CHUNK": 64, "KEEP": 1}, "bwd_dbc": {"BLOCK_N": 32}}


def config(kernel: str, opd: str) -> dict:
    """CONFIG[kernel] for dots with `opd` operands."""
    return {**CONFIG[kernel], **(FP32.get(kernel, {}) if opd == "tl.float32" else {})}


@contextlib.contextmanager
def overridden(overrides: dict):
    """CONFIG with `overrides` ({kernel: {key: value}}) merged in, restored on exit (benchmarks)."""
    unknown = set(overrides) - set(CONFIG)
    if unknown:
        raise KeyError(f"ssd_core CONFIG has no kernel {sorted(unknown)}; kernels: {sorted(CONFIG)}")
    saved = copy.deepcopy(CONFIG)
    try:
        for k, v in overrides.items():
            CONFIG[k].update(v)
        yield CONFIG
    finally:
        CONFIG.clear()
        CONFIG.update(saved)


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
    return _module_for(opd, nprog, cache_dir, T.interpreting())


@functools.lru_cache(maxsize=None)
def _module_for(opd: str, nprog: int, cache_dir: str | None, interpreting: bool):
    # rendered once per process and mode (the interpreter decorates the module differently)
    from ssmc.options import default_cache_dir
    from ssmc.runtime.cache import cache_key, get_cache
    src = render(opd, nprog)
    key = cache_key("triton-ssd-core", src, T._TRITON_VERSION)
    return T.import_source(src, key, get_cache(cache_dir or default_cache_dir()))[0]


def _p2(n: int, lo: int = 16, hi: int | None = None) -> int:
    b = max(lo, T._pow2(n))
    return min(b, hi) if hi else b


def _args(t: torch.Tensor) -> list:
    """A tensor and its strides, 0 along axes of size 1 (read broadcast)."""
    return [t, *(s if d != 1 else 0 for s, d in zip(t.stride(), t.shape))]


def _aliased(t: torch.Tensor, full: tuple) -> bool:
    return any(d == 1 and f > 1 for d, f in zip(t.shape, full))


class Spec:
    """Shapes of one call: program axis sizes S, length L, p, n; chunk, operand type; keep: chunks
    per kept state (chunk, keep None: the config's for the operand type)."""

    def __init__(self, S: tuple, L: int, p: int, n: int, chunk: int | None, opd: str, deterministic: bool,
                 cache_dir: str | None = None, keep: int | None = None):
        chunk = chunk or config("core", opd)["CHUNK"]
        self.S, self.L, self.p, self.n, self.chunk = tuple(S), L, p, n, chunk
        self.P = math.prod(self.S)
        self.NC = -(-L // chunk)
        keep = keep or config("core", opd)["KEEP"]
        if keep < 1 or keep & (keep - 1):          # the state kernels' chunk is CHUNK * keep
            raise ValueError(f"ssd_core: KEEP (chunks per kept state) must be a power of two, not {keep}")
        while keep > 1 and keep > self.NC:          # no group longer than the sequence
            keep //= 2
        self.keep = keep
        self.NS = -(-self.NC // self.keep)          # kept states: one per group of `keep` chunks
        self.opd, self.deterministic = opd, deterministic
        # the chunk states between the kernels: the dots' operand type (they read them as that)
        self.state_dtype = {"tl.bfloat16": torch.bfloat16, "tl.float16": torch.float16}.get(opd, torch.float32)
        self.mod = _module(opd, len(self.S), cache_dir)

    def launch_kw(self, device, warps: int, dots: bool = True) -> dict:
        """Warps on a GPU; for a kernel with dots, DOT_UP (16-bit operands under the interpreter)."""
        kw = {"num_warps": warps} if device.type == "cuda" else {}
        if dots:
            kw["DOT_UP"] = device.type != "cuda" and self.opd != "tl.float32"
        return kw


def _none_args(sp: Spec, like: torch.Tensor) -> list:
    return [like, *([0] * (len(sp.S) + 2))]


def _pass(sp: Spec, buf, A, init, reverse: bool):
    """ssd_pass over buf's kept states in place; returns the last carried value (P, p, n) fp32."""
    out = torch.empty(sp.P, sp.p, sp.n, device=buf.device, dtype=torch.float32)
    cf = config("pass", sp.opd)
    BLOCK = min(cf["BLOCK"], _p2(sp.p * sp.n))
    sp.mod.ssd_pass[(sp.P, -(-(sp.p * sp.n) // BLOCK))](
        buf, A, *(_args(init) if init is not None else _none_args(sp, buf)), out, *sp.S, sp.NS, sp.p,
        sp.n, HAS_H0=init is not None, REVERSE=reverse, BLOCK=BLOCK,
        **sp.launch_kw(buf.device, cf["num_warps"], dots=False))
    return out


def _forward(sp: Spec, u, w, x, g, c, h0, y_dtype=torch.float32):
    dev = x.device
    # each group of `keep` chunks' own end state, then the states at the groups' starts
    H = torch.empty(sp.P, sp.NS, sp.p, sp.n, device=dev, dtype=sp.state_dtype)
    A = torch.empty(sp.P, sp.NS, device=dev, dtype=torch.float32)
    cf = config("chunk_state", sp.opd)
    BP, BN = _p2(sp.p, hi=cf["BLOCK_P"]), _p2(sp.n, hi=cf["BLOCK_N"])
    sp.mod.ssd_chunk_state[(sp.NS, sp.P, -(-sp.p // BP) * -(-sp.n // BN))](
        *_args(u), *_args(w), *_args(x), *_args(g), H, A, *sp.S, sp.L, sp.NS, sp.p, sp.n,
        CHUNK=sp.chunk * sp.keep, BLOCK_P=BP, BLOCK_N=BN, **sp.launch_kw(dev, cf["num_warps"]))
    hl = _pass(sp, H, A, h0, False)
    # y in x's memory order where x is whole (a permuted input): the torch ops that combine them
    # afterwards then run over dense, like-ordered memory
    full = (*sp.S, sp.L, sp.p)
    y = (torch.empty_like(x, dtype=y_dtype) if tuple(x.shape) == full and not _aliased(x, full)
         else torch.empty(full, device=dev, dtype=y_dtype))
    cf = config("chunk_fwd", sp.opd)
    BP = _p2(sp.p, hi=cf["BLOCK_P"])
    sp.mod.ssd_chunk_fwd[(sp.NC, sp.P, -(-sp.p // BP))](
        *_args(u), *_args(w), *_args(x), *_args(g), *_args(c), H, *_args(y), *sp.S, sp.L, sp.NC, sp.p, sp.n,
        CHUNK=sp.chunk, KEEP=sp.keep, BLOCK_P=BP, BLOCK_N=_p2(sp.n), **sp.launch_kw(dev, cf["num_warps"]))
    return y, hl, H, A


def _grad_buffer(t: torch.Tensor, full: tuple, deterministic: bool, partial: bool = False, blocks: int = 1):
    """(buffer the kernel writes, atomic?, how to turn the buffer into t's gradient, the stride
    between slots or 0). A factor broadcast along some axis gets a buffer of the full shape,
    summed by torch afterwards; ``partial``: several programs add shares to one element (blocks
    of n, or indices sharing the factor): atomically, or in deterministic mode into one slot per
    block of n (``blocks`` of them; the kernel is handed the first, the others at the stride)."""
    if partial and not deterministic:
        return torch.zeros(t.shape, device=t.device, dtype=torch.float32), True, lambda b: b, 0
    dims = [i for i, (d, f) in enumerate(zip(t.shape, full)) if d == 1 and f > 1]
    if partial:
        slots = torch.empty(blocks, *full, device=t.device, dtype=torch.float32)
        down = [d + 1 for d in dims]

        def finish(_):
            return (slots.sum(down, keepdim=True) if down else slots).sum(0)
        return slots[0], False, finish, slots.stride(0)
    if not _aliased(t, full):
        return torch.empty(t.shape, device=t.device, dtype=torch.float32), False, lambda b: b, 0
    buf = torch.empty(full, device=t.device, dtype=torch.float32)
    return buf, False, lambda b: b.sum(dims, keepdim=True), 0


def _backward(sp: Spec, u, w, x, g, c, H, A, dy, dhl, dx_out=None):
    """((du, dw, dx, dg, dc), dh0 (P, p, n)). ``dx_out``: a tensor of x's shape (any float
    type) that dx is added into, and returned as dx."""
    dev = x.device
    kw = lambda cf: sp.launch_kw(dev, cf["num_warps"])               # noqa: E731
    dy = dy.reshape(*sp.S, sp.L, sp.p)              # a view: dy comes shaped so (the kernels read any float type)
    if dhl is not None:
        dhl = dhl.to(torch.float32).reshape(*sp.S, sp.p, sp.n)
    dE = torch.empty_like(H)
    cf = config("chunk_state", sp.opd)
    BP, BN = _p2(sp.p, hi=cf["BLOCK_P"]), _p2(sp.n, hi=cf["BLOCK_N"])
    sp.mod.ssd_chunk_dstate[(sp.NS, sp.P, -(-sp.p // BP) * -(-sp.n // BN))](
        *_args(u), *_args(dy), *_args(c), dE, *sp.S, sp.L, sp.NS, sp.p, sp.n,
        CHUNK=sp.chunk * sp.keep, BLOCK_P=BP, BLOCK_N=BN, **kw(cf))
    dh0 = _pass(sp, dE, A, dhl, True)
    # program axes along which g and c are both shared (see CONFIG's "heads"): looped inside
    # ssd_bwd_dbc or added atomically; either way no per-index buffers
    cf = config("bwd_dbc", sp.opd)
    mode = "loop" if sp.deterministic and cf["heads"] == "atomic" else cf["heads"]
    common = [mode != "store" and sp.S[k] > 1 and g.shape[k] == 1 and c.shape[k] == 1
              for k in range(len(sp.S))]
    inner = common if mode == "loop" else [False] * len(sp.S)
    shared = tuple(1 if i else d for i, d in zip(common, sp.S))
    fulls = {"u": (*sp.S, sp.L, 1), "w": (*sp.S, sp.L, 1), "x": (*sp.S, sp.L, sp.p),
             "g": (*shared, sp.L, sp.n), "c": (*shared, sp.L, sp.n)}
    BN = _p2(sp.n, hi=cf["BLOCK_N"])
    NB = -(-sp.n // BN)
    atomic_gc = mode == "atomic" and any(common)
    # du and dw: shares from the NB blocks of n (atomic adds, or slots in deterministic mode);
    # dg and dc: from the indices sharing them when they add atomically (never deterministic)
    bufs = {k: _grad_buffer(t, fulls[k], sp.deterministic,
                            partial=(NB > 1 and k in "uw") or (atomic_gc and k in "gc"), blocks=NB)
            for k, t in zip(fulls, (u, w, x, g, c)) if not (k == "x" and dx_out is not None)}
    if dx_out is not None:
        bufs["x"] = (dx_out, False, lambda b: b, 0)
    cx = config("bwd_dx", sp.opd)
    BPx = _p2(sp.p, hi=cx["BLOCK_P"])
    sp.mod.ssd_bwd_dx[(sp.NC, sp.P, -(-sp.p // BPx))](
        *_args(u), *_args(w), *_args(g), *_args(c), *_args(dy), dE, *_args(bufs["x"][0]),
        *sp.S, sp.L, sp.NC, sp.p, sp.n, CHUNK=sp.chunk, KEEP=sp.keep, BLOCK_P=BPx,
        BLOCK_N=_p2(sp.n), ACC=dx_out is not None, **kw(cx))
    BP = _p2(sp.p, hi=cf["BLOCK_P"])
    heads = math.prod(d for i, d in zip(inner, sp.S) if i)
    split = [a for k, d in enumerate(sp.S) for a in ((1, d) if inner[k] else (d, 1))]
    sp.mod.ssd_bwd_dbc[(sp.NC, sp.P // heads, NB)](
        *_args(u), *_args(w), *_args(x), *_args(g), *_args(c), *_args(dy), H, dE,
        *(a for k in "uwgc" for a in _args(bufs[k][0])), *split, heads,
        sp.L, sp.NC, sp.p, sp.n, bufs["u"][3], bufs["w"][3],
        ATOMIC_U=bufs["u"][1], ATOMIC_W=bufs["w"][1], ATOMIC_GC=atomic_gc,
        CHUNK=sp.chunk, KEEP=sp.keep, BLOCK_P=BP, BLOCK_N=BN, NPB=-(-sp.p // BP), **kw(cf))
    grads = [bufs[k][2](bufs[k][0]) for k in fulls]
    return grads, dh0


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sp: Spec, u, w, x, g, c, h0):
        y, hl, H, A = _forward(sp, u, w, x, g, c, h0)
        ctx.sp, ctx.has_h0 = sp, h0 is not None
        ctx.save_for_backward(u, w, x, g, c, H, A)
        return y, hl

    @staticmethod
    def backward(ctx, dy, dhl):
        u, w, x, g, c, H, A = ctx.saved_tensors
        sp = ctx.sp
        if dy is None:
            dy = torch.zeros(*sp.S, sp.L, sp.p, device=x.device, dtype=torch.float32)
        (du, dw, dx, dg, dc), dh0 = _backward(sp, u, w, x, g, c, H, A, dy, dhl)
        dh0 = dh0.reshape(*sp.S, sp.p, sp.n) if ctx.has_h0 else None
        return None, du, dw, dx, dg, dc, dh0


def core(sp: Spec, u, w, x, g, c, h0):
    """(y (*S, L, p), h_L (P, p, n)) in fp32, P the program axes flattened (the last fastest).
    u, w: (*S or 1, L or 1, 1); x: (..., p or 1); g, c: (..., n or 1); h0: (*S, p, n) or None."""
    return _Core.apply(sp, u, w, x, g, c, h0)
