"""The backward of a chunked-SSD region's per-step epilogue, as one generated Triton kernel.

A region's per-step outputs are expressions of its readout (sum_n h * c, which the core kernels
of ssd_core.py compute as y, times the plan's y_scale) and of inputs read outside it (Mamba-2's
D skip and z gate, the casts). Training needs, at every element of (t, program axes, p), the
gradient of y (what the core's backward reads) and the gradients of the inputs the epilogue
reads. With y standing in for the readout, `ssmc.autodiff.backprop` gives all of them as
expressions of y, the inputs and the outputs' gradients; `render` prints them (TritonPrinter)
into one kernel over tiles of BLOCK_T steps and all of p, one program per tile and index of the
program axes. Before this kernel those expressions ran as torch ops under autograd, each a pass
over (batch, L, heads, p) in fp32 (at b8 L4096 h24 p64 on the H200: more time than the core's
forward and backward together).

Each input's gradient is summed over the axes the input does not vary along: inside a tile with
sums over its rows (t) and columns (p), across programs through slots (one per block of time
and index of a program axis the input lacks: D's gradient has L / BLOCK_T x batch slots), which
torch sums afterwards; deterministic, no atomics. An input broadcast at run time (a size-1 dim
along an axis it is read along) gets a buffer of the axis's size, summed down the same way.

`make_epilogue(region, plan) -> Epilogue | reason`: a per-step output not laid out along all of
(t, program axes, p), an op the printer lacks, or the state read outside the readout give a
reason, and ssd_autograd.py runs the epilogue under torch autograd instead.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ssmc import ir
from ssmc.autodiff import add, backprop, grad_output, mul
from ssmc.ir import InputSpec, Load, Op, Reduce, Region, State

from . import triton as T
from .triton_printer import Frame, TritonPrinter, unsupported

TEMPLATE = "triton/ssd_epilogue_bwd.py.j2"
TILE = 2048                     # elements of a (BLOCK_T, BLOCK_P) tile
NUM_WARPS = 4


def _replace(e, old, new, memo=None):
    """`e` with the node `old` replaced by `new`."""
    memo = {} if memo is None else memo
    if e is old or e == old:
        return new
    if e in memo:
        return memo[e]
    if isinstance(e, Op):
        out = Op(e.name, tuple(_replace(a, old, new, memo) for a in e.args), e.attrs)
    elif isinstance(e, Reduce):
        out = Reduce(_replace(e.arg, old, new, memo), e.axes)
    else:
        out = e
    memo[e] = out
    return out


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """The epilogue's adjoint: `region` is the SSD region with the outputs' gradients and y as
    extra inputs (y last, laid out (*program axes, t, p)); `grads` pairs each Load of an input
    (y's included: the core's dy) with its adjoint expression; `seeds` the per-step outputs."""
    region: Region
    y: Load
    grads: tuple               # ((Load, adjoint expr), ...)
    seeds: tuple               # indices of the per-step outputs
    programs: tuple
    p: str


def make_epilogue(r: Region, plan, needs: tuple | None = None) -> Epilogue | str:
    """The epilogue's adjoint, with the gradients of the inputs `needs` asks for (all float
    inputs by default), or why the kernel does not compute it."""
    if plan.readout is None:
        return "no readout"
    progs, p = tuple(plan.programs), plan.p
    tile = {"t", *progs, p}
    n_in, n_out = len(r.inputs), len(r.outputs)
    ext = dataclasses.replace(r, inputs=r.inputs + tuple(
        InputSpec(f"grad of output {k}", len(o.index), o.dtype) for k, o in enumerate(r.outputs))
        + (InputSpec("core readout y", len(progs) + 2, "float32"),))
    y = Load(n_in + n_out, (*progs, "t", p))
    ys = y if plan.y_scale is None else mul(y, plan.y_scale)
    adj, seeds = {}, []
    for k, o in enumerate(r.outputs):
        if o.kind != "steps":
            continue
        if {ix for ix in o.index if ix != 1} != tile:
            return (f"per-step output {k} is laid out along {list(o.index)}, not along all of "
                    f"{sorted(tile)} (the kernel's tiles)")
        e = _replace(o.expr, plan.readout, ys)
        if ir.uses_state(e):
            return f"per-step output {k} reads the state outside the readout"
        seeds.append(k)
        for leaf, g in backprop(e, grad_output(r, k), [ix for ix in o.index if isinstance(ix, str)]).items():
            adj[leaf] = add(adj.get(leaf), g)
    grads = []
    for leaf, g in adj.items():
        if isinstance(leaf, State):
            return "the state outside the readout"
        if leaf.input < n_in and (not _is_float(r.inputs[leaf.input])
                                  or (needs is not None and not needs[leaf.input])):
            continue
        for x in ir.walk(g):
            why = unsupported(x)
            if why:
                return why
            if isinstance(x, Load) and not set(ix for ix in x.index if isinstance(ix, str)) <= tile:
                return f"the epilogue reads {x} along an axis outside {sorted(tile)}"
        grads.append((leaf, g))
    if y not in adj:
        return "the per-step outputs do not depend on the readout"
    return Epilogue(ext, y, tuple(grads), tuple(seeds), progs, p)


def _is_float(spec: InputSpec) -> bool:
    return spec.dtype != "bool" and ir.to_dtype(spec.dtype).is_floating_point


# -- printing --------------------------------------------------------------------------------------

def render(ep: Epilogue) -> str:
    r = ep.region
    progs = {a: (f"idx_{a}", None) for a in ep.programs}
    pm = TritonPrinter(r, "tl.float32", "v")
    pm.set_prelude_frame(Frame({**progs, ep.p: ("op_", "mp_")}, None, None, None))
    lines = pm.block(Frame({**progs, "t": ("tv", "mv"), ep.p: ("op_", "mp_")}, None, None, None))
    stores = []
    for j, (ld, g) in enumerate(ep.grads):
        code = pm.expr(g)
        ax = ir.axes_of(ld, r.axes)
        v = f"gv{j}"
        stores.append(f"{v} = tl.where(full_, {code} + zero_, 0.0)")
        if "t" not in ax and ep.p not in ax:           # a scalar per program: a scalar store
            stores.append(f"{v} = _sum(_sum({v}, 1), 0)")
        else:
            for k, a in ((0, "t"), (1, ep.p)):
                if a not in ax:
                    stores.append(f"{v} = tl.expand_dims(_sum({v}, {k}), {k})")
        off, masks = [], []
        for d, ix in enumerate(ld.index):
            if isinstance(ix, int):
                if ix:
                    off.append(f"{ix} * g{j}_s{d}")
                continue
            code_ix, m = {**progs, "t": ("tv", "mv"), ep.p: ("op_", "mp_")}[ix]
            off.append(f"{code_ix} * g{j}_s{d}")
            if m and m not in masks:
                masks.append(m)
        if "t" not in ax:
            off.append("tb * g{j}_ot".format(j=j))
        off += [f"idx_{a} * g{j}_o{i}" for i, a in enumerate(ep.programs) if a not in ax]
        mask = f", mask={' & '.join(masks)}" if masks else ""
        stores.append(f"tl.store(g{j}_ptr + ({' + '.join(off) or '0'}), "
                      f"{v}.to(g{j}_ptr.dtype.element_ty){mask})")
    return T._env().get_template(TEMPLATE).render(
        region_name=r.name, kname=T.kernel_name(r) + "_epi_bwd", args=T.arg_lines(_args(ep)),
        programs=ep.programs, prelude=pm.prelude, lines=lines, stores=stores)


def _inputs_read(ep: Epilogue) -> list[int]:
    return sorted({ld.input for _, g in ep.grads for ld in ir.loads(g)})


def _args(ep: Epilogue) -> list[str]:
    r = ep.region
    ins = _inputs_read(ep)
    names = [f"in{i}_ptr" for i in ins] + [f"g{j}_ptr" for j in range(len(ep.grads))]
    names += [f"in{i}_s{d}" for i in ins for d in range(r.inputs[i].ndim)]
    for j, (ld, _) in enumerate(ep.grads):
        names += [f"g{j}_s{d}" for d in range(len(ld.index))]
        names += [f"g{j}_ot"] + [f"g{j}_o{i}" for i in range(len(ep.programs))]
    return names + [f"size_{a}" for a in ep.programs] + ["L", "SIZE_P"]


@functools.lru_cache(maxsize=64)
def _module(ep: Epilogue, cache_dir: str | None, interpreting: bool):
    from ssmc.options import default_cache_dir
    from ssmc.runtime.cache import cache_key, get_cache
    src = render(ep)
    key = cache_key("triton-ssd-epilogue-bwd", src, T._TRITON_VERSION)
    return T.import_source(src, key, get_cache(cache_dir or default_cache_dir()))[0]


# -- running ---------------------------------------------------------------------------------------

def _strides(t: torch.Tensor) -> list:
    return [s if d != 1 else 0 for s, d in zip(t.stride(), t.shape)]


def backward(ep: Epilogue, inputs: list, y: torch.Tensor, grads: list, sizes: dict,
             cache_dir: str | None = None):
    """(dy laid out like y, {input index: its gradient from the epilogue (the input's shape)}).
    ``y``: the core's readout (*program sizes, L, p) fp32; ``grads``: the outputs' gradients
    (None where there is none: zeros are read); ``sizes``: every axis's size and "t"'s."""
    r = ep.region
    L, P = sizes["t"], math.prod(sizes[a] for a in ep.programs)
    dev = y.device
    tensors = list(inputs)
    for k, o in enumerate(r.outputs):
        g = grads[k]
        if g is None:
            g = torch.zeros([1] * len(o.index), device=dev, dtype=torch.float32)
        tensors.append(g)
    tensors.append(y)
    BP = max(2, T._pow2(sizes[ep.p]))
    BT = max(2, min(T._pow2(L), TILE // BP))
    NTB = -(-L // BT)
    dy = torch.empty_like(y)
    bufs, finish = [], []
    for ld, _ in ep.grads:
        i = ld.input
        if i == ep.y.input:
            bufs.append(dy)
            finish.append(None)
            continue
        x = inputs[i]
        ax = ir.axes_of(ld, r.axes)
        own = [sizes[ix] if isinstance(ix, str) else x.shape[d] for d, ix in enumerate(ld.index)]
        slots = ([NTB] if "t" not in ax else []) + [sizes[a] for a in ep.programs if a not in ax]
        partial = bool(slots) or any(isinstance(ix, int) and x.shape[d] > 1 for d, ix in enumerate(ld.index))
        dtype = torch.float32 if (partial or own != list(x.shape)) else x.dtype
        buf = (torch.zeros if partial else torch.empty)(slots + own, device=dev, dtype=dtype)
        bufs.append(buf)
        finish.append((i, len(slots), [d for d, (o, s) in enumerate(zip(own, x.shape)) if o != s]))
    args = [tensors[i] for i in _inputs_read(ep)] + bufs
    args += [s for i in _inputs_read(ep) for s in _strides(tensors[i])]
    for (ld, _), buf, fin in zip(ep.grads, bufs, finish):
        nslot = 0 if fin is None else fin[1]
        own_strides = _strides(buf)[nslot:] if fin is not None else _strides(buf)
        args += own_strides
        ax = ir.axes_of(ld, r.axes)
        slot_strides = list(buf.stride()[:nslot])
        it = iter(slot_strides)
        args.append(next(it) if "t" not in ax else 0)
        args += [next(it) if a not in ax else 0 for a in ep.programs]
    args += [sizes[a] for a in ep.programs] + [L, sizes[ep.p]]
    mod = _module(ep, cache_dir, T.interpreting())
    kw = {"num_warps": NUM_WARPS} if dev.type == "cuda" else {}
    getattr(mod, T.kernel_name(r) + "_epi_bwd")[(NTB, P)](*args, BLOCK_T=BT, BLOCK_P=BP, **kw)
    out = {}
    for buf, fin in zip(bufs, finish):
        if fin is None:
            continue
        i, nslot, down = fin
        g = buf.sum(list(range(nslot))) if nslot else buf
        if down:
            g = g.sum(down, keepdim=True)
        out[i] = g if i not in out else out[i] + g
    return dy, out
