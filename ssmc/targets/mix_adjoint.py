"""The backward of a region with a non-diagonal transition (`Region.mix`: block-sparse A, rotary
pairs, complex decays as 2x2 blocks), in chunks of steps.

The sequential work is three forward regions derived from the region
(`ssmc.autodiff.chunk_scans`), run by ``scan(region, inputs) -> outputs``: the forward kernels
of the target that runs the region (a block-sparse kernel multiplying only the nonzero blocks,
of the transposed mask for the adjoint; `Scans`), or the torch reference. A first pass keeps the
state at each chunk start; then, chunk by chunk in reverse: the chunk's states from its start
(written after it into one buffer, so the states after and before each step are both views),
dL/dh_t from the outputs, lam over the chunk backwards in time (`walk`: through negated
strides where the kernel can, else on flipped copies), and the gradients of the inputs by torch
ops on the whole chunk (`Evaluator`; on a GPU a sum of products as passes of the `mul_sum`
kernel, each the largest value times one other, `reference.contract`): the
decay's and the drive's as in the diagonal case, and the transition's from dm_t[.., i, j] =
lam_t[.., i] h_(t-1)[.., j]. That outer product is never formed where the matrix's adjoint is
a product of a part along time and the rows and a part along (i, j) (m = s_t W: dW = sum over
time and rows of s lam h_prev^T; ds = lam . (W h_prev); both from one read of lam and h_prev,
`transition_grads` on a GPU); otherwise it is formed a few steps at a time.

Memory: a chunk holds about ten (steps, *state) tensors of at most `STEP_ELEMENTS` elements
each (on a GPU, `GPU_STEP_ELEMENTS` where a twentieth of its free memory holds one: fewer,
larger chunks, each a fixed number of kernel calls and torch ops), never (L, *state).
"""
from __future__ import annotations

import itertools
import logging
import math

import torch

from ssmc import ir
from ssmc.autodiff import GRAD_A, GRAD_B, GRAD_M, chunk_scans, mix_loads, region_adjoint
from ssmc.ir import Region, factors, product, summands

from .reference import MIX_CHUNK_ELEMENTS, Evaluator, Grads, Product, ReferenceKernel, contract, grads_by_autograd, run
from .transition_grads import gram_and_rows

log = logging.getLogger("ssmc")

STEP_ELEMENTS = 1 << 25       # elements of one (steps, *state) tensor of a chunk
# ... on a GPU with the memory for it. Fewer chunks, less host work: the block-sparse benchmark's
# training step (b32 L4096, 256 channels, d_state 64) waited on the host with 2^27 (H100 at
# 753cd9f: 104-109 ms on the host, 67 ms of kernels) and not with 2^28 (72 ms, 65 ms of kernels).
GPU_STEP_ELEMENTS = 1 << 28


def step_elements(device: torch.device, esize: int) -> int:
    """Elements of a chunk tensor on `device` (`esize` bytes each): see the module docstring."""
    if device.type != "cuda":
        return STEP_ELEMENTS
    free, _ = torch.cuda.mem_get_info(device)
    big = GPU_STEP_ELEMENTS
    while big > STEP_ELEMENTS and 20 * big * esize > free:
        big //= 2
    return max(big, STEP_ELEMENTS)


def chunk_steps(state_numel: int, L: int, steps: int | None = None, elements: int | None = None) -> int:
    """Steps per chunk: as many as `elements` (default `STEP_ELEMENTS`) allows, at most
    ``steps`` (when given) and L."""
    T = max(1, (elements or STEP_ELEMENTS) // max(1, state_numel))
    return max(1, min(T, steps or T, L))


def backward(region: Region, inputs, grads, needs, scan=None, steps: int | None = None) -> list:
    """Every input's gradient (None where not needed); ``scan(region, inputs)`` runs a derived
    forward region (default: the torch reference)."""
    r = region
    g = Grads(r, inputs, grads, needs)
    cdt, L, state_shape = g.cdt, g.L, g.state_shape
    scans = chunk_scans(r, ir.dtype_name(cdt))
    if isinstance(scans, str):          # inputs that cannot be cut along time: autograd on the reference
        log.info("ssmc: region %s: backward by autograd of the reference forward (%s)", r.name, scans)
        return grads_by_autograd(lambda xs: run(r, xs), inputs, grads, needs)
    final, states, adjoint = scans
    scan = scan or (lambda reg, xs: run(reg, xs))
    adj = region_adjoint(r)
    fac, dense = split_mix_grads(r, [(ld, e) for ld, e in mix_loads(r)
                                     if ld.input < len(g.acc) and g.acc[ld.input] is not None])
    esize = torch.empty((), dtype=cdt).element_size()
    T = chunk_steps(math.prod(state_shape), L, steps, step_elements(inputs[0].device, esize))
    bounds = [(t0, min(L, t0 + T)) for t0 in range(0, L, T)]
    with torch.no_grad():
        h = g.h0(r, inputs)
        starts = []
        for t0, t1 in bounds:
            starts.append(h)
            h = scan(final.region, final.inputs(inputs, t0, t1, [h]))[0].to(cdt)
        lam_next = g.seed_final(r, adj, h)          # dL/dh_(t1-1) from the steps after the chunk
        for (t0, t1), h0 in reversed(list(zip(bounds, starts))):
            T = t1 - t0
            # the chunk's states one step into a buffer of T+1 steps, h0 first: the state after
            # each step (H) and before it (H_prev) are views, nothing concatenated
            seq = torch.empty((T + 1, *state_shape), dtype=cdt, device=h0.device)
            seq[0].copy_(h0)
            run_into(scan, states.region, states.inputs(inputs, t0, t1, [h0]), [seq[1:]])
            H, H_prev = seq[1:], seq[:-1]
            ev = Evaluator(r, g.allin, t0, t1, cdt)
            ev.state = H
            # the adjoint's drive at chunk index u is g_(t0+u-1) (0 at u = 0): g, the direct
            # gradients, written one step into a buffer of T+1 steps; its states land one step
            # early in another, after which that buffer's last step holds lam_(t1-1): lam and
            # the carry to the chunk before are views, nothing is reversed or copied
            drive = torch.empty((T + 1, *state_shape), dtype=cdt, device=H.device)
            drive[0].zero_()
            if adj.state_steps is not None:
                ev.eval_into(adj.state_steps, drive[1:])
            else:
                drive[1:].zero_()
            g.put(ev, adj.loads_steps)
            last = drive[T] + lam_next
            states_of_lam = torch.empty_like(drive)
            walk(scan, adjoint, adjoint.inputs(inputs, t0, t1, [drive[:T], last]), [states_of_lam[:T]])
            states_of_lam[T] = last
            lam = states_of_lam[1:]
            lam_next = states_of_lam[0]             # a_t0 lam_t0 + m_t0^T lam_t0
            ev.memo[GRAD_B] = lam
            g.put(ev, adj.loads_drive)
            # what reads the state before each step
            if adj.loads_decay:
                ev.memo[GRAD_A] = Product((lam, H_prev))
                g.put(ev, adj.loads_decay)
            _mix_grads(r, g, t0, t1, lam, H_prev, fac, dense)
    return g.result(r, inputs, lam_next)


def run_into(scan, region: Region, xs, out) -> None:
    """Run a derived region with its outputs written into `out`: by the kernel itself where
    `scan` is `Scans` (its kernels take ``out``, else they copy), else copied."""
    if isinstance(scan, Scans):
        scan(region, xs, None, out)
    else:
        for o, v in zip(out, scan(region, xs)):
            o.copy_(v)


def walk(scan, cs, xs, out) -> None:
    """Run the derived region of `cs` (a `ChunkScan`) on `xs`, its outputs written into `out`;
    backwards in time where ``cs.backwards``: by the kernel where it walks time backwards
    (`Scans`, `walks_back`), else on inputs flipped in time, the outputs flipped back."""
    dims = cs.time_dims()
    if isinstance(scan, Scans):
        scan(cs.region, xs, dims, out)
    else:
        _flipped(lambda ys: scan(cs.region, ys), cs.region, xs, dims, out)


def _flipped(forward, region: Region, xs, dims, out) -> list:
    """``forward(xs)`` run backwards in time over the dims `dims` ({input: time dim}; None:
    forwards), into `out` (or new tensors when None): copies of the time-indexed inputs flipped,
    and of the per-step outputs flipped back, each written once."""
    if dims:
        xs = [x.flip(dims[k]) if k in dims else x for k, x in enumerate(xs)]
    got = forward(xs)
    res = []
    for k, (o, spec) in enumerate(zip(got, region.outputs)):
        dst = out[k] if out is not None else None
        if dims and "t" in spec.index:
            d = spec.index.index("t")
            rev = torch.arange(o.shape[d] - 1, -1, -1, device=o.device)
            o = torch.index_select(o.to(dst.dtype) if dst is not None else o, d, rev,
                                   **({"out": dst} if dst is not None else {}))
        elif dst is not None:
            o = dst.copy_(o)
        res.append(o)
    return res


def factored(e, r: Region) -> list | None:
    """[(sign, f_rows, f_mat)] with e = sum of sign * GRAD_M * f_rows * f_mat, f_rows free of the
    matrix's axes (the state's last axis and the column) and f_mat free of time and the other
    state axes; None where e is not of that form."""
    rowcol = {r.axes[-1], ir.MIX_COL}
    rows_t = set(r.axes[:-1]) | {"t"}
    out = []
    for sign, term in summands(e):
        fs = factors(term)
        if fs.count(GRAD_M) != 1 or any(GRAD_M in ir.walk(f) for f in fs if f != GRAD_M):
            return None
        rest = [f for f in fs if f != GRAD_M]
        ax = [ir.axes_of(f, r.axes) for f in rest]
        f_mat = [f for f, a in zip(rest, ax) if a & rowcol]
        if any(a & rowcol and a & rows_t for a in ax):
            return None
        out.append((sign, product([f for f, a in zip(rest, ax) if not a & rowcol]), product(f_mat)))
    return out


def split_mix_grads(r: Region, pairs) -> tuple[list, list]:
    """The transition's (Load, adjoint) pairs as ([(load, `factored` terms)], [(load, adjoint)]):
    the first need no outer product (the load varies along the matrix's axes only, or along
    none of them, and its adjoint factors); the second do."""
    rowcol = {r.axes[-1], ir.MIX_COL}
    rows_t = set(r.axes[:-1]) | {"t"}
    fac, dense = [], []
    for ld, e in pairs:
        la = ir.axes_of(ld, r.axes)
        terms = factored(e, r)
        if terms is None or (la & rowcol and la & rows_t):
            dense.append((ld, e))
        else:
            fac.append((ld, terms))
    return fac, dense


def _mix_grads(r: Region, g: Grads, t0: int, t1: int, lam, H_prev, fac, dense):
    """The transition's gradients over [t0, t1) into the accumulators of its inputs (``fac``,
    ``dense``: `split_mix_grads`)."""
    ev = Evaluator(r, g.allin, t0, t1, g.cdt, matrix=True)
    n = lam.shape[-1]
    rows = lam.shape[:-1]                                     # (steps, the state's other axes)
    along_mat, along_rows = [], []
    for ld, terms in fac:
        for sign, f_rows, f_mat in terms:
            fr, fm = ev.eval(f_rows), ev.eval(f_mat)
            fr = fr if sign > 0 else -fr
            # along the matrix's axes: G = (f_rows lam)^T h_prev summed over time and rows, then
            # times f_mat; along time and rows: rs = lam . (f_mat h_prev), then times f_rows
            mat = bool(ir.axes_of(ld, r.axes) & {r.axes[-1], ir.MIX_COL})
            (along_mat if mat else along_rows).append((ld, fr, fm))
    lam2, h2 = lam.reshape(-1, n), H_prev.reshape(-1, n)
    for a, b in itertools.zip_longest(along_mat, along_rows):   # one pass over lam and h_prev a pair
        G, rs = gram_and_rows(lam2, h2, a[1][..., 0, 0].expand(rows).reshape(-1) if a else None,
                              b[2].expand(*b[2].shape[:-2], n, n).reshape(n, n) if b else None)
        if a:
            ld, _, fm = a
            ev.accumulate(g.acc[ld.input], ld, [G.reshape([1] * (len(ev.names) - 2) + [n, n]), fm])
        if b:
            ld, fr, _ = b
            ev.accumulate(g.acc[ld.input], ld, [rs.reshape(*rows, 1, 1), fr])
    rest = []
    for ld, e in dense:         # factors each free of the rows or of the columns: no outer product
        vals = _rank_one_grads(r, ev, lam, H_prev, ld, e)
        if vals is None:
            rest.append((ld, e))
        for v in vals or ():
            ev.accumulate(g.acc[ld.input], ld, v)
    if rest:
        _outer_product_grads(r, g, t0, t1, lam, H_prev, rest)


def _outer_product_grads(r: Region, g: Grads, t0: int, t1: int, lam, H_prev, dense):
    """What no factored form covers: the outer product itself, dm = lam_i h_j (steps x state x
    n elements), a few steps at a time."""
    n = lam.shape[-1]
    lam_i, h_j = lam.unsqueeze(-1), H_prev.unsqueeze(-2)
    k = max(1, MIX_CHUNK_ELEMENTS // max(1, lam[0].numel() * n))
    for s0 in range(t0, t1, k):
        s1 = min(t1, s0 + k)
        evd = Evaluator(r, g.allin, s0, s1, g.cdt, matrix=True)
        evd.memo[GRAD_M] = lam_i[s0 - t0:s1 - t0] * h_j[s0 - t0:s1 - t0]
        g.put(evd, dense)


def _rank_one_grads(r: Region, ev, lam, H_prev, ld, e) -> list | None:
    """The adjoint e = sum of sign * GRAD_M * f of a load `ld` that does not vary along the
    columns j (or the rows i: the state's last axis), with dm = lam_i h_j and f a product of
    factors each free of i or of j, as lists of factors laid out like ev's names (time, the
    state, j), one a summand, whose product holds its sum over j (over i): lam_i f_i (sum_j h_j
    f_j), or (sum_i lam_i f_i) h_j f_j (the delta rule's u w^T: its k on both sides; KDA's w_j =
    -beta k_j exp(g_j), whose g needs both). `Evaluator.accumulate` sums each list's product
    by `contract` (on a GPU, passes of `mul_sum` that write nothing of the state's size). None
    where a factor varies along both or the load does."""
    nd = len(ev.names)
    i_ax = r.axes[-1]
    la = ir.axes_of(ld, r.axes)
    if ir.MIX_COL in la and i_ax in la:
        return None
    L, Hj = lam.unsqueeze(-1), H_prev.unsqueeze(-2)          # (t, ..., i, 1), (t, ..., 1, j)

    def value(fs):              # None for no factor: nothing to multiply a state-sized value by
        if not fs:
            return None
        v = torch.as_tensor(ev.eval(product(fs)), dtype=lam.dtype, device=lam.device)
        return v.reshape((1,) * (nd - v.dim()) + tuple(v.shape))

    def summed(dim, x, *fs):    # sum over dim of x times the factors there are (one pass on a GPU)
        vals = [x] + [f for f in fs if f is not None]
        shape = list(torch.broadcast_shapes(*(v.shape for v in vals)))
        shape[dim] = 1
        return contract(vals, shape)
    out = []
    for sign, term in summands(e):
        fs = factors(term)
        if fs.count(GRAD_M) != 1 or any(GRAD_M in ir.walk(f) for f in fs if f != GRAD_M):
            return None
        side = {"i": [], "j": [], "0": []}
        for f in (x for x in fs if x != GRAD_M):
            ax = ir.axes_of(f, r.axes)
            if i_ax in ax and ir.MIX_COL in ax:
                return None
            side["i" if i_ax in ax else "j" if ir.MIX_COL in ax else "0"].append(f)
        fi, fj, f0 = value(side["i"]), value(side["j"]), value(side["0"])
        if ir.MIX_COL not in la:        # lam_i f_i f_0 (sum_j h_j f_j)
            s = summed(-1, Hj, fj)
            vals = [L, fi, f0]
        else:                           # (sum_i lam_i f_i) h_j f_j f_0
            s = summed(-2, L, fi)
            vals = [Hj, fj, f0]
        out.append([v for v in vals if v is not None] + [s if sign > 0 else -s])
    return out


class Scans:
    """Runs the derived regions of a kernel's backward on kernels of the same target,
    ``make(region)`` compiling one on first use; a derived region the target cannot compile or
    run goes to the torch reference, the reason kept in ``declined`` (and logged once)."""

    def __init__(self, make):
        self.make = make
        self.kernels: dict = {}
        self.declined: dict = {}

    def __call__(self, region: Region, inputs, backwards: dict | None = None, out=None):
        """The region's outputs on `inputs`; ``backwards`` and ``out`` as in `_flipped` (by the
        kernel itself where it walks time backwards, `walks_back`)."""
        key = region.key()
        k = self.kernels.get(key)
        if k is None:
            try:
                k = self.make(region)
            except Exception as e:
                k = self._decline(region, f"compile: {type(e).__name__}: {e}")
            self.kernels[key] = k
        try:
            return self._run(k, region, inputs, backwards, out)
        except Exception as e:
            if isinstance(k, ReferenceKernel):
                raise
            self.kernels[key] = self._decline(region, f"run: {type(e).__name__}: {e}")
            return self._run(self.kernels[key], region, inputs, backwards, out)

    @staticmethod
    def _run(k, region, inputs, backwards, out):
        if backwards is None and out is None:
            return k.forward(inputs)
        if getattr(k, "walks_back", False):
            return k.forward(inputs, backwards=backwards, out=out)
        return _flipped(k.forward, region, inputs, backwards, out)

    def _decline(self, region, why: str):
        self.declined[region.name] = why
        log.warning("ssmc: backward scan %s runs on the torch reference (%s)", region.name, why)
        return ReferenceKernel(region)

    def note(self, target: str) -> str:
        text = (f"backward: the adjoint in chunks, its scans (states, and lam with the transposed transition) "
                f"on {target} kernels, the gradients by torch ops and, on a GPU, the mul_sum "
                f"and transition_grads Triton kernels (ssmc/targets/mix_adjoint.py)")
        if self.declined:
            text += "; on the torch reference: " + "; ".join(f"{n} ({w})" for n, w in self.declined.items())
        from . import mul_sum, transition_grads
        for mod in (mul_sum, transition_grads):
            if mod.FAILED is not None:
                text += f"; {mod.__name__.rsplit('.', 1)[1]} by torch ops (the kernel failed: {mod.FAILED})"
        return text
