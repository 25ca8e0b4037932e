"""Generated Triton backward kernels for the chunked selective scan, derived from the region IR.

The expressions come from `ssmc.autodiff.region_adjoint`; the kernel runs what
`ssmc.targets.reference.adjoint_run` runs, with the forward's parallel decomposition
(`triton.make_plan`: the register axis whole in registers, a block of the channel axis per
program, one program per index of the other parallel axes) and its printer (`TritonPrinter`,
every value at its own rank, loop invariants hoisted). templates/triton/selective_scan_bwd.py.j2
holds the kernel; this module decides:

- `make_bwd_plan` reads the adjoint: per differentiable input, the one index it is read at and
  the adjoint terms of the per-step and final outputs, the decay and the drive. An input read
  at two index patterns, a final output reading a per-step input, a term constant in time, an
  op the printer lacks: a reason string, and the region's backward runs the torch reference
  (``bwd_fallback`` on the forward kernel says why).
- each input's gradient is either *owned* (it varies along every parallel axis: each element
  belongs to one program, written directly) or *shared* (broadcast over a parallel axis, e.g.
  A over batch, B and C over channels): a program writes its partial sum into its own slot
  (``Options.deterministic``; torch sums the slots afterwards) or adds it with
  ``tl.atomic_add``; gradients of inputs without a time axis are summed over time in registers
  and written once per program into slots (small: slots x the input's size), deterministic in
  both modes. Within a program, a term is summed over the axes it varies along and the input
  does not (n with ``_sum`` over the register axis, the channel block, time), as the reference
  does.
- buffers: an owned gradient is written once, in its input's dtype; partial sums are kept in
  the compute dtype (fp32, fp64 for fp64 inputs) and cast at the end; an input broadcast at run
  time (a size-1 dim along an axis it is read along) gets a dense buffer summed down afterwards.
  The only scratch along time is one state tile per program and chunk (the chunk-start states,
  L / CHUNK of them), never (batch, channels, state, time).

`backward(kernel, inputs, grads, needs)` is what `TritonKernel.backward` calls.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import re
import logging
import math
import threading

import torch

from ssmc import ir
from ssmc.autodiff import GRAD_A, GRAD_B, Adjoint, mul, region_adjoint
from ssmc.ir import InputSpec, Load, Reduce, Region

from . import triton as T
from .triton_printer import TritonPrinter, unsupported

log = logging.getLogger("ssmc")

TEMPLATE = "triton/selective_scan_bwd.py.j2"
CONFIGS = "triton/selective_scan_bwd.configs.json"
_SEEDS = {GRAD_A: "gA", GRAD_B: "gB"}


# -- plan ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Grad:
    """The gradient of one input: where it is read, and the adjoint terms summed into it."""
    input: int
    index: ir.Index
    steps: tuple            # adjoint terms at each step
    final: tuple            # adjoint terms of the final outputs (at the last step)
    missing: tuple          # parallel axes the input does not vary along: shared across programs

    @property
    def timed(self) -> bool:
        return "t" in self.index

    @property
    def shared(self) -> bool:
        return bool(self.missing)


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    fwd: T.Plan
    adj: Adjoint
    grads: tuple[Grad, ...]
    init_grad: bool          # the initial state is an input and gets dL/dh_(-1)

    # the forward plan's fields, so the forward kernel's launch geometry applies unchanged
    reg = property(lambda self: self.fwd.reg)
    block = property(lambda self: self.fwd.block)
    scalars = property(lambda self: self.fwd.scalars)
    inputs = property(lambda self: self.fwd.inputs)

    def grad_inputs(self, r: Region) -> list[int]:
        return [g.input for g in self.grads] + ([r.init] if self.init_grad else [])


def _is_float(spec: InputSpec) -> bool:
    return spec.dtype != "bool" and ir.to_dtype(spec.dtype).is_floating_point


def _has_seed(e) -> bool:
    return any(isinstance(x, Load) and x.input < 0 for x in ir.walk(e))


def value_axes(e, r: Region) -> frozenset:
    """The iteration variables an adjoint value varies along (its printed tile's axes): the
    seeds da_t and db_t vary along every state axis and time."""
    ax = ir.axes_of(e, r.axes)
    return ax | frozenset(r.axes) | {"t"} if _has_seed(e) else ax


def adjoint_caveat(r: Region) -> str | None:
    """Where `ssmc.autodiff`'s adjoint is not the derivative: a sum over an axis its argument is
    constant along is size * value forward, but its adjoint passes the seed unchanged (the
    factor is lost). Such a region's backward re-runs the forward under autograd instead."""
    for o in r.outputs:
        for x in ir.walk(o.expr):
            if isinstance(x, Reduce) and not set(x.axes) <= ir.axes_of(x.arg, r.axes):
                return (f"a sum over {list(x.axes)} of a value constant along it ({x.arg}): the "
                        "IR adjoint misses the size factor")
    return None


def make_bwd_plan(r: Region) -> BwdPlan | str:
    """The backward kernel's plan for `r`, or why it cannot compute the gradients."""
    fwd = T.make_plan(r)
    if isinstance(fwd, str):
        return fwd
    why = adjoint_caveat(r)
    if why:
        return why
    try:
        adj = region_adjoint(r)
    except NotImplementedError as e:
        return str(e)
    n_in = len(r.inputs)
    exprs = [e for e in (adj.state_steps, adj.state_final) if e is not None]
    exprs += [e for _, e in adj.loads_steps + adj.loads_final + adj.loads_decay + adj.loads_drive]
    for e in exprs:
        for x in ir.walk(e):
            why = unsupported(x)
            if why:
                return f"adjoint: {why}"
            if isinstance(x, Load) and x.input >= 0 and x.input >= n_in + len(r.outputs):
                return f"adjoint reads {x}, which is neither an input nor an output's gradient"
    steps: dict[int, list] = {}
    final: dict[int, list] = {}
    index: dict[int, ir.Index] = {}
    pairs = [(ld, e, steps) for ld, e in adj.loads_steps + adj.loads_decay + adj.loads_drive]
    pairs += [(ld, e, final) for ld, e in adj.loads_final]
    for ld, e, into in pairs:
        if not _is_float(r.inputs[ld.input]):
            continue                      # no gradient (integer or bool inputs)
        if ld.input == r.init:
            return f"the initial state in{ld.input} is also read by the expressions"
        named = [ix for ix in ld.index if isinstance(ix, str)]
        if len(set(named)) != len(named):
            return f"load {ld} indexes one axis twice"
        if index.setdefault(ld.input, ld.index) != ld.index:
            return (f"input {ld.input} is read at two index patterns ({index[ld.input]} and "
                    f"{ld.index}); its gradient would need a scatter-add")
        if into is final and "t" in ld.index:
            return f"a final output reads {ld} at a time step"
        if into is steps and "t" not in value_axes(e, r):
            return f"the adjoint of {ld} is constant in time ({e})"
        into.setdefault(ld.input, []).append(e)
    grads = []
    for i in sorted(index):
        named = set(ix for ix in index[i] if isinstance(ix, str))
        missing = tuple(a for a in fwd.scalars if a not in named)
        if fwd.block and fwd.block not in named:
            missing += (fwd.block,)
        grads.append(Grad(i, index[i], tuple(steps.get(i, ())), tuple(final.get(i, ())), missing))
    init_grad = r.init is not None and _is_float(r.inputs[r.init])
    return BwdPlan(fwd, adj, tuple(grads), init_grad)


# -- rendering -------------------------------------------------------------------------------------

class AdjointPrinter(TritonPrinter):
    """The forward's printer; the seeds da_t and db_t print as the kernel's tiles gA and gB."""

    def _code(self, e):
        if isinstance(e, Load) and e.input < 0:
            return _SEEDS[e]
        return super()._code(e)


def with_grad_inputs(r: Region) -> Region:
    """`r` with each output's gradient as one more input (``ssmc.autodiff.grad_output`` reads
    output k's gradient as input len(inputs) + k, indexed like the output)."""
    extra = tuple(InputSpec(f"grad of output {k}", len(o.index), o.dtype) for k, o in enumerate(r.outputs))
    return dataclasses.replace(r, inputs=r.inputs + extra)


_AXIS_DIM = {"block": (0, "md3"), "reg": (1, "mn3"), "t": (2, "mt")}


class _Emitter:
    """Writes the reduce-and-store code of the gradients around the printed adjoint values."""

    def __init__(self, r: Region, bp: BwdPlan, p: AdjointPrinter):
        self.r, self.bp, self.p = r, bp, p
        self.dims = {bp.block: _AXIS_DIM["block"], bp.reg: _AXIS_DIM["reg"], "t": _AXIS_DIM["t"]}
        self.dims.pop(None, None)
        self._n = 0

    def reduced(self, e, keep, lines: list[str], drop_t: bool = False) -> str:
        """The value of term `e` summed over the tile axes it varies along and `keep` lacks
        (masked lanes are zeroed first)."""
        ax = value_axes(e, self.r) - ({"t"} if drop_t else set())
        return self.summed(self.p.expr(e), ax, keep, lines)

    def summed(self, v: str, ax, keep, lines: list[str], dims: dict | None = None) -> str:
        """Code `v`, varying along the axes `ax`, summed over those of them that `keep` lacks
        and `dims` (axis -> (tile dim, mask); default the scan layout's) has, into a temporary."""
        dims = self.dims if dims is None else dims
        sums = [dims[a] for a in (self.bp.block, self.bp.reg, "t") if a in dims and a in ax and a not in keep]
        if not sums:
            return v
        x = f"tl.where({' & '.join(m for _, m in sums)}, {v}, 0.0)"
        for k, _ in sums:
            x = f"tl.expand_dims(_sum({x}, {k}), {k})"
        return self.temp(x, lines)

    def temp(self, code: str, lines: list[str]) -> str:
        """A new temporary holding `code`."""
        self._n += 1
        name = f"r{self._n}"
        lines.append(f"{name} = {code}")
        return name

    def total(self, g: Grad, terms, lines: list[str], drop_t: bool = False) -> str | None:
        keep = set(ix for ix in g.index if isinstance(ix, str))
        vals = [self.reduced(e, keep, lines, drop_t) for e in terms]
        return " + ".join(vals) if vals else None

    def offsets(self, name: str, index, codes: dict) -> tuple[str, list[str]]:
        """(offset code, masks) of gradient buffer `name` at `index` in a frame's `codes`."""
        parts, masks = [], []
        for d, ix in enumerate(index):
            if isinstance(ix, int):
                if ix:
                    parts.append(f"{ix} * {name}_s{d}")
                continue
            code, mask = codes[ix]
            parts.append(f"{code} * {name}_s{d}")
            if mask and mask not in masks:
                masks.append(mask)
        return " + ".join(parts + ["zo3"]), masks

    def write(self, g: Grad, value: str, codes: dict, atomic_ok: bool) -> list[str]:
        """Lines writing `value` into input g.input's gradient (under its NEED flag)."""
        i = g.input
        off, masks = self.offsets(f"g{i}", g.index, codes)
        ptr = f"g{i}_ptr + slot{i} + ({off})" if g.shared else f"g{i}_ptr + ({off})"
        m = f", mask={' & '.join(masks)}" if masks else ""
        if g.shared and atomic_ok:
            return [f"if NEED_{i}:",
                    f"    if DETERMINISTIC:",
                    f"        tl.store({ptr}, {value}{m})",
                    f"    else:",
                    f"        tl.atomic_add({ptr}, {value}{m}, sem=\"relaxed\")"]
        return [f"if NEED_{i}:", f"    tl.store({ptr}, ({value}).to(g{i}_ptr.dtype.element_ty){m})"]


def _slot_line(i: int, missing, block) -> str:
    """The linear index of this program among those sharing input i's elements, times the
    slot stride (0 when every program adds into one buffer)."""
    idx = [("pid_d", "nblk") if a == block else (f"idx_{a}", f"size_{a}") for a in missing]
    s = idx[0][0]
    for code, size in idx[1:]:
        s = f"({s}) * {size} + {code}"
    return f"slot{i} = ({s}).to(tl.int64) * g{i}_slot"


def kernel_args(r: Region, bp: BwdPlan) -> list[str]:
    """The runtime arguments of the backward kernel, in order (the constexprs follow)."""
    n = len(r.inputs)
    gi = bp.grad_inputs(r)
    args = [f"in{i}_ptr" for i in bp.inputs] + [f"in{n + k}_ptr" for k in range(len(r.outputs))]
    args += ["ck_ptr", "sk_ptr"] + [f"g{i}_ptr" for i in gi]
    args += [f"in{i}_s{d}" for i in bp.inputs for d in range(r.inputs[i].ndim)]
    args += [f"in{n + k}_s{d}" for k, o in enumerate(r.outputs) for d in range(len(o.index))]
    args += [f"g{i}_s{d}" for i in gi for d in range(r.inputs[i].ndim)]
    args += [f"g{g.input}_slot" for g in bp.grads if g.shared]
    args += [f"size_{a}" for a in bp.scalars] + ["SIZE_D", "SIZE_N", "L"]
    return args


def render_bwd(r: Region, bp: BwdPlan, cdt: str = "tl.float32") -> str:
    return T._env().get_template(TEMPLATE).render(**bwd_pieces(r, bp, cdt))


def bwd_pieces(r: Region, bp: BwdPlan, cdt: str = "tl.float32") -> dict:
    """What the kernel bodies (bwd_bodies.py.j2) read: the printed adjoint of both layouts, the
    arguments, names; the single-region and the grouped templates render them alike."""
    p = AdjointPrinter(with_grad_inputs(r), cdt)
    em = _Emitter(r, bp, p)
    pre_f, body_f, final_f = T._frames(bp.fwd, True)
    p.set_prelude_frame(pre_f)
    p.block(pre_f)
    init = p.expr(Load(r.init, tuple(r.axes))) if r.init is not None else None
    # pass 1: the forward recurrence
    fwd_pre = p.block(body_f)
    fwd_a, fwd_b = p.expr(r.decay), p.expr(r.drive)
    # after the last step: the final outputs' adjoints
    acc_init, end = [], []
    for g in bp.grads:
        if not g.timed:
            shape = ", ".join(["BLOCK_D" if bp.block in g.index else "1",
                               "BLOCK_N" if bp.reg and bp.reg in g.index else "1", "1"])
            acc_init.append(f"acc{g.input} = tl.full(({shape}), 0.0, {cdt})")
    final = p.block(final_f)
    mu_final = p.expr(bp.adj.state_final) if bp.adj.state_final is not None else None
    for g in bp.grads:
        if g.final:
            v = em.total(g, g.final, final, drop_t=True)
            final += [f"if NEED_{g.input}:", f"    acc{g.input} += {v}"]
    # pass 2: chunks in reverse time
    pre = p.block(body_f)
    a, b = p.expr(r.decay), p.expr(r.drive)
    mid: list[str] = []
    p.switch(mid, state="H")
    direct = p.expr(bp.adj.state_steps) if bp.adj.state_steps is not None else "0.0"
    post: list[str] = []
    p.switch(post)
    for g in bp.grads:
        if not g.steps:
            continue
        post.append(f"# d/d in{g.input}[{', '.join(map(str, g.index))}]")
        v = em.total(g, g.steps, post)
        if g.timed:
            post += em.write(g, v, body_f.codes, atomic_ok=True)
        else:
            post += [f"if NEED_{g.input}:", f"    acc{g.input} += {v}"]
    # before the first step: the initial state's gradient, the sums over time
    if bp.init_grad:
        off, masks = em.offsets(f"g{r.init}", tuple(r.axes), pre_f.codes)
        m = f", mask={' & '.join(masks)}" if masks else ""
        end += [f"if NEED_{r.init}:", f"    tl.store(g{r.init}_ptr + ({off}), mu.to(g{r.init}_ptr.dtype.element_ty){m})"]
    for g in bp.grads:
        if not g.timed:
            end += em.write(g, f"acc{g.input}", pre_f.codes, atomic_ok=False)
    slots = [_slot_line(g.input, g.missing, bp.block) for g in bp.grads if g.shared]
    needs = [f"NEED_{i}: tl.constexpr" for i in bp.grad_inputs(r)]
    return dict(
        region_name=r.name, region_key=r.key(), region_text=str(r), cdt=cdt, kname=T.kernel_name(r),
        plan=bp.fwd, args=T.arg_lines(kernel_args(r, bp)), needs=needs, slots=slots,
        prelude=list(p.prelude), init=init, fwd_pre=fwd_pre, fwd_a=fwd_a, fwd_b=fwd_b,
        acc_init=acc_init, final=final, mu_final=mu_final, pre=pre, a=a, b=b, mid=mid,
        direct=direct, post=post, end=end, seq=render_bwd_seq(r, bp, cdt), seq_states=T.SEQ_STATES)


# -- the seq backward: the forward's seq layout (ssmc.targets.triton._print_seq) ---------------------

class SeqAdjointPrinter(AdjointPrinter):
    """The adjoint printer for the seq layout: the seeds vary along every state axis and time
    (each copy of the per-index code has its own), so nothing holding one is printed outside
    a copy."""

    def axes(self, e) -> frozenset:
        return value_axes(e, self.r)


def _reduces(e) -> list:
    return [x for x in ir.walk(e) if isinstance(x, Reduce)]


def _term_kind(e, g: Grad, r: Region, reg: str) -> str:
    """Where a gradient term is summed in the seq backward: "copy" (per copy of the per-index
    code, the gradient is indexed by the register axis), "sum" (per copy, accumulated across
    copies and then over the row's lanes) or "after" (once a chunk after the copies: free of
    the register axis, or reading a sum over it that all copies accumulate first); "no: why"."""
    keep = set(ix for ix in g.index if isinstance(ix, str))
    ax = value_axes(e, r)
    if _reduces(e):
        if reg in ax or reg in keep:
            return f"no: a term of in{g.input}'s gradient reads a sum over {reg} and varies along it"
        return "after"
    if reg in keep:
        return "copy"
    return "sum" if reg in ax else "after"


def split_free(e, r: Region, axis: str):
    """`e` as (the product of its factors that vary along `axis`, the product of those that do
    not, or None): a sum over `axis` of e is the first's sum times the second, one product an
    element fewer per free factor, and terms differing only in free factors share one sum."""
    factors: list = []

    def flat(x):
        if isinstance(x, ir.Op) and x.name == "mul":
            for y in x.args:
                flat(y)
        else:
            factors.append(x)
    flat(e)
    dep = [f for f in factors if axis in value_axes(f, r)]
    free = [f for f in factors if axis not in value_axes(f, r)]
    if not dep or not free:
        return e, None
    return functools.reduce(mul, dep), functools.reduce(mul, free)


def seq_bwd_declines(r: Region, bp: BwdPlan) -> str | None:
    """Why the seq backward cannot compute `r`'s gradients (None: it can)."""
    why = T.seq_declines(r, bp.fwd)
    if why:
        return why
    reg = bp.reg
    for name, e in (("decay", r.decay), ("drive", r.drive), ("state adjoint", bp.adj.state_steps),
                    ("final state adjoint", bp.adj.state_final)):
        if e is not None and _reduces(e):
            return f"the {name} sums over an axis"
    for g in bp.grads:
        if g.final:
            return f"in{g.input}'s gradient has terms from a final output"
        for e in g.steps:
            kind = _term_kind(e, g, r, reg)
            if kind.startswith("no"):
                return kind[4:]
            for x in _reduces(e):                 # the copies accumulate sums over the register axis only
                if tuple(x.axes) != (reg,):
                    return f"a sum over {list(x.axes)} in in{g.input}'s gradient"
    return None


def render_bwd_seq(r: Region, bp: BwdPlan, cdt: str = "tl.float32") -> dict | None:
    """The pieces of the ``_bwd_seq<S>`` kernels (None when `seq_bwd_declines`). Names holding
    ``@s`` are per copy of the per-index code; the template writes the copy's number there."""
    if seq_bwd_declines(r, bp):
        return None
    reg, blk = bp.reg, bp.block
    p = SeqAdjointPrinter(with_grad_inputs(r), cdt)
    p.columns = False
    p.copy_prelude = []
    em = _Emitter(r, bp, p)
    codes = {a: (f"idx_{a}", None) for a in bp.scalars}
    if blk:
        codes[blk] = ("od3", "md3")
    pre_f = T.Frame({**codes, reg: ("on3", "mn3")}, None, 1, "mn3")
    outer_f = T.Frame({**codes, "t": ("tt2", "mt2")}, None, None, None)
    inner_f = T.Frame({**codes, "t": ("tt3", "mt3"), reg: ("on3", "mn3")}, None, None, None)
    final_f = T.Frame({**codes, reg: ("on3", "mn3"), "t": ("t_last", None)}, "hc", None, None)
    copy_dims = {a: d for a, d in ((blk, (0, "md3")), ("t", (2, "mt3"))) if a}
    after_dims = {a: d for a, d in ((blk, (0, "md3")), ("t", (2, "mt2"))) if a}
    p.set_prelude_frame(pre_f)
    init = None
    if r.init is not None:
        init = p.block(pre_f)
        p.split(reg, [], pre_f)
        init.append(f"h0 = {p.expr(Load(r.init, tuple(r.axes)))}")
    # pass 1: the forward recurrence
    fwd_outer: list[str] = []
    fwd_pre = p.block(inner_f)
    p.split(reg, fwd_outer, outer_f)
    fwd_a, fwd_b = p.expr(r.decay), p.expr(r.drive)
    # after the last step: the final state's adjoint, per copy
    final_outer: list[str] = []
    final = p.block(final_f)
    p.split(reg, final_outer, T.Frame({**codes, "t": ("t_last", None)}, None, None, None))
    mu_final = p.expr(bp.adj.state_final) if bp.adj.state_final is not None else None
    acc_init = []
    for g in bp.grads:
        if not g.timed:
            per_copy = reg in g.index
            shape = ", ".join(["BLOCK_D" if blk in g.index else "1", "NQ" if per_copy else "1", "1"])
            acc_init.append((per_copy, f"acc{g.input}{'@s' if per_copy else ''} = tl.full(({shape}), 0.0, {cdt})"))
    # pass 2: chunks in reverse time, per copy
    outer: list[str] = []
    pre = p.block(inner_f)
    p.split(reg, outer, outer_f)
    a, b = p.expr(r.decay), p.expr(r.drive)
    mid: list[str] = []
    p.switch(mid, state="H")
    direct = p.expr(bp.adj.state_steps) if bp.adj.state_steps is not None else "0.0"
    post: list[str] = []
    first_only: set[int] = set()              # post lines the first copy turns into assignments
    p.switch(post)
    sums: dict = {}                           # ("sum", term) or ("red", Reduce) -> accumulator
    plan_after: list = []                     # (g, terms summed across copies, terms after)
    free_code: dict = {}                      # factor free of the register axis -> its code

    def accumulate(key, value: str, mask: str):
        if key in sums:                       # one term of several gradients: summed once
            return
        sums[key] = f"sr{len(sums)}"
        first_only.add(len(post))
        post.append(f"{sums[key]} += tl.where({mask}, {value}, 0.0)")

    for g in bp.grads:
        keep = set(ix for ix in g.index if isinstance(ix, str))
        kinds = {e: _term_kind(e, g, r, reg) for e in g.steps}
        copy = [e for e in g.steps if kinds[e] == "copy"]
        if copy:
            post.append(f"# d/d in{g.input}[{', '.join(map(str, g.index))}]")
            vals = [em.summed(p.expr(e), value_axes(e, r), keep, post, copy_dims) for e in copy]
            v = " + ".join(vals)
            if g.timed:          # time read as (1, 1, CHUNK): one address per element of a sum over rows
                post.extend(em.write(g, v, {**inner_f.codes, "t": ("tt2", "mt2")}, atomic_ok=True))
            else:
                post.extend([f"if NEED_{g.input}:", f"    acc{g.input}@s += {v}"])
        summed = [e for e in g.steps if kinds[e] == "sum"]
        for e in summed:                      # the factors free of the register axis multiply the sum
            inner, free = split_free(e, r, reg)
            if ("sum", inner) not in sums:
                accumulate(("sum", inner), p.expr(inner), "mn3")
            if free is not None and free not in free_code:
                free_code[free] = p.expr(free)    # printed before the copies, once a chunk
        after = [e for e in g.steps if kinds[e] == "after"]
        for e in after:
            for x in _reduces(e):
                if ("red", x) not in sums:
                    accumulate(("red", x), p.expr(x.arg), "mn3")
        if summed or after:
            plan_after.append((g, keep, summed, after))
    # once a chunk after the copies: what the copies' sums feed
    outer_post = p.after_split(outer_f)
    for (kind, x), name in sums.items():
        if kind == "red":
            p.memoize(x, f"tl.expand_dims(_sum({name}, 1), 1)")
    lane_sums: dict = {}                      # (copies' sum, free factor) -> its sum over the row's lanes
    for g, keep, summed, after in plan_after:
        outer_post.append(f"# d/d in{g.input}[{', '.join(map(str, g.index))}]")
        vals = []
        for e in summed:
            inner, free = split_free(e, r, reg)
            # masked when summed; the free factor multiplies the copies' sum before the lanes'
            # (so it keeps the layout the copies' values had: a product of the lanes' sum
            # recomputed the factor in the sum's layout, 4x the exps at seq4 BLOCK_D 8 CHUNK 4)
            key = (sums[("sum", inner)], None if free is None else free_code[free])
            if key not in lane_sums:
                x = key[0] if free is None else f"{key[0]} * {key[1]}"
                lane_sums[key] = em.temp(f"tl.expand_dims(_sum({x}, 1), 1)", outer_post)
            lanes = lane_sums[key]
            vals.append(em.summed(lanes, value_axes(e, r) - {reg}, keep, outer_post, after_dims))
        for e in after:
            vals.append(em.summed(p.expr(e), value_axes(e, r), keep, outer_post, after_dims))
        v = " + ".join(vals)
        if g.timed:
            outer_post.extend(em.write(g, v, outer_f.codes, atomic_ok=True))
        else:
            outer_post.extend([f"if NEED_{g.input}:", f"    acc{g.input} += {v}"])
    post_first = [line.replace(" += ", " = ", 1) if k in first_only else line for k, line in enumerate(post)]
    # before the first step: per copy, the initial state's gradient and the per-index sums
    end_copy, end = [], []
    if bp.init_grad:
        off, masks = em.offsets(f"g{r.init}", tuple(r.axes), pre_f.codes)
        m = f", mask={' & '.join(masks)}" if masks else ""
        end_copy += [f"if NEED_{r.init}:",
                     f"    tl.store(g{r.init}_ptr + ({off}), mu@s.to(g{r.init}_ptr.dtype.element_ty){m})"]
    for g in bp.grads:
        if not g.timed:
            if reg in g.index:
                end_copy += em.write(g, f"acc{g.input}@s", pre_f.codes, atomic_ok=False)
            else:
                end += em.write(g, f"acc{g.input}", pre_f.codes, atomic_ok=False)
    return dict(prelude=list(p.prelude), pre_copy=list(p.copy_prelude), init=init, fwd_outer=fwd_outer, fwd_pre=fwd_pre, fwd_a=fwd_a,
                fwd_b=fwd_b, final_outer=final_outer, final=final, mu_final=mu_final,
                final_state=any(re.search(r"\bhc\b", x) for x in [mu_final or "", *final_outer, *final]),
                acc_init=[x for c, x in acc_init if not c], acc_init_copy=[x for c, x in acc_init if c],
                outer=outer, pre=pre, a=a, b=b, mid=mid, direct=direct, post=post, post_first=post_first,
                outer_post=outer_post, accs=list(sums.values()), end_copy=end_copy, end=end)


@functools.lru_cache(maxsize=None)
def load_configs() -> dict:
    return json.loads((importlib.resources.files("ssmc.templates") / CONFIGS).read_text())


# -- the kernel ----------------------------------------------------------------------------------------

class _Call(list):
    """A backward call as the forward kernel's tuning machinery sees it: the region inputs (a
    list), with the output gradients, the needs and the forward's residual (its checkpoint
    buffer and flag, TritonKernel.residual_specs; [] when there is none) along."""

    def __init__(self, inputs, grads, needs, residual=()):
        super().__init__(inputs)
        self.grads, self.needs = list(grads), [bool(n) for n in needs]
        self.residual = list(residual)


@dataclasses.dataclass
class _Buffers:
    ck: torch.Tensor
    sk: torch.Tensor            # the seq variant's per-segment chunk-start states (SEG > 1)
    grads: list                 # per kernel gradient input: (input index, buffer, slots)


class BackwardKernel(T.TritonKernel):
    """The backward kernel of one region (its forward kernel's `backward` calls `run`).

    ``config``: the config of the last launch; ``given``: whether it read the training
    forward's checkpoints (else it ran the forward recurrence itself first); ``fallback``: why
    the last call ran the torch reference instead. Tuning and caching are the forward kernel's
    (per shape bucket, on disk)."""
    given = False
    kind = "selective scan backward"
    template = TEMPLATE
    configs_file = CONFIGS

    def __init__(self, region: Region, strategy: str, plan: BwdPlan, options, arch):
        self.deterministic = bool(getattr(options, "deterministic", False))
        super().__init__(region, strategy, plan, options, arch)

    def _render(self, cdt: str) -> str:
        return render_bwd(self.region, self.plan, cdt)

    def _fn(self, mod, variant: str = "scan"):
        S = T._seq_states({"variant": variant})
        return getattr(mod, f"{T.kernel_name(self.region)}_bwd" + (f"_seq{S}" if S else ""))

    def table(self) -> dict:
        return load_configs()

    def plan_text(self) -> str:
        p = self.plan
        shared = [f"in{g.input}" + (" (atomics)" if g.timed and not self.deterministic else "")
                  for g in p.grads if g.shared]
        return (f"register axis {p.reg}, channel axis {p.block}, one program per index of "
                f"{list(p.scalars)}; gradients shared across programs: {shared or 'none'}")

    # -- shapes and configs --------------------------------------------------------------------
    def bucket(self, call) -> tuple:
        grads = tuple("none" if g is None or not g.numel() else ir.dtype_name(g.dtype) for g in call.grads)
        return super().bucket(call) + (grads, tuple(call.needs), self.deterministic, bool(call.residual))

    def candidates(self, call, arch) -> list[dict]:
        table = load_configs()
        sizes, L = self.sizes(call)
        bn = T._pow2(sizes[self.plan.reg]) if self.plan.reg else 1
        bd_max = T._pow2(sizes[self.plan.block]) if self.plan.block else 1
        budget = int(table.get("max_tile_per_thread", 16)) * 32
        seq = self.seq_declines() is None
        fits, tiles, seen = [], [], set()
        for c in table[T.arch_key(arch)]:
            c = dict(c)
            S = T._seq_states(c)
            if S and (not seq or bn % S):              # n = s * NQ + q: S must divide BLOCK_N
                continue
            c["BLOCK_D"] = max(1, min(int(c["BLOCK_D"]), bd_max))
            c["CHUNK"] = max(1, min(int(c["CHUNK"]), T._pow2(L)))
            sig = tuple(sorted(c.items()))
            if sig in seen:
                continue
            seen.add(sig)
            tile = c["BLOCK_D"] * (bn // S if S else bn) * c["CHUNK"]
            tiles.append((tile / c["num_warps"], c))
            if tile <= budget * c["num_warps"]:
                fits.append(c)
        return fits or [min(tiles, key=lambda x: x[0])[1]]

    def seq_declines(self) -> str | None:
        """Why the seq variant is not offered for this region (None: it is)."""
        if not hasattr(self, "_seq_why"):
            self._seq_why = seq_bwd_declines(self.region, self.plan)
        return self._seq_why

    def constexprs(self, call, config) -> dict:
        sizes, L = self.sizes(call)
        bn = T._pow2(sizes[self.plan.reg]) if self.plan.reg else 1
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": bn,
              "CHUNK": config["CHUNK"], "DETERMINISTIC": self.deterministic}
        if T._seq_states(config):
            cx["EVEN_N"] = bn == sizes[self.plan.reg]
            cx["EVEN_L"] = L % config["CHUNK"] == 0
            cx["EVEN_D"] = (sizes[self.plan.block] if self.plan.block else 1) % config["BLOCK_D"] == 0
            cx["SEG"] = _seg(config)
        for i in self.plan.grad_inputs(self.region):
            cx[f"NEED_{i}"] = bool(call.needs[i])
        return cx

    # -- buffers and launching -------------------------------------------------------------------
    def _dense_shape(self, x: torch.Tensor, index, sizes: dict, L: int) -> list[int]:
        """The gradient buffer's shape: an input of size 1 along an axis it is read along
        (broadcast at run time) gets that axis' full size, summed down afterwards."""
        full = {**sizes, "t": L}
        return [full[ix] if isinstance(ix, str) and x.shape[d] == 1 else int(x.shape[d])
                for d, ix in enumerate(index)]

    def _covered(self, shape, index, sizes: dict, L: int) -> bool:
        """Every element of a buffer of `shape` is written (else it starts at zero)."""
        full = {**sizes, "t": L}
        return all((shape[d] == 1) if isinstance(ix, int) else shape[d] == full[ix]
                   for d, ix in enumerate(index))

    def _given(self, call, config) -> bool:
        """Whether this config reads the forward's checkpoints (a seq config whose interval,
        CHUNK * SEG, is theirs) instead of writing its own."""
        return bool(call.residual) and bool(T._seq_states(config)) and \
            config["CHUNK"] * _seg(config) == T.CKPT_EVERY

    def _scratch(self, call, config) -> tuple[int, int, torch.dtype]:
        """Elements of the checkpoints (the state every SEG chunks: a tile a program, or for
        the seq variant macros.checkpoints' layout; 1 when the forward's are read) and of the
        segment scratch (SEG tiles a program, when SEG > 1) a launch of config takes, and their
        dtype."""
        sizes, L = self.sizes(call)
        cdt = torch.float64 if self._cdt(call) == "tl.float64" else torch.float32
        bn = T._pow2(sizes[self.plan.reg]) if self.plan.reg else 1
        tile = self.grid(call, config)[0] * config["BLOCK_D"] * bn
        seg = _seg(config)
        nck = triton_cdiv(triton_cdiv(L, config["CHUNK"]), seg)
        if self._given(call, config):
            ck = 1
        elif T._seq_states(config):
            bp = self.plan
            ck = nck * math.prod(sizes[a] for a in bp.scalars) * (sizes[bp.block] if bp.block else 1) * bn
        else:
            ck = nck * tile
        return ck, seg * tile if seg > 1 else 1, cdt

    def scratch_bytes(self, call, config) -> int:
        """Bytes of the checkpoints and the segment scratch: what sets a training step's peak
        memory apart between configs."""
        ck, sk, cdt = self._scratch(call, config)
        return (ck + sk) * cdt.itemsize

    def _pick(self, times: dict, bucket, call) -> dict:
        """The fastest config, unless another within the table's ``memory_slack`` of its time
        keeps less in checkpoints and scratch: then the one that keeps least (a training step's
        peak memory is mostly the backward's checkpoints). `picked` says so for explain."""
        best = min(times, key=times.get)
        slack = float(self.table().get("memory_slack", 1.0))
        if slack <= 1.0:
            return json.loads(best)
        mem = {k: self.scratch_bytes(call, json.loads(k)) for k in times if times[k] <= slack * times[best]}
        pick = min(mem, key=lambda k: (mem[k], times[k]))
        if pick != best:
            self.picked[bucket] = (f"{pick}: {times[pick]:.3f} ms and {mem[pick] / 2**20:.1f} MB of checkpoints, "
                                   f"against the fastest {best}: {times[best]:.3f} ms and "
                                   f"{mem[best] / 2**20:.1f} MB "
                                   f"(memory_slack {slack:g})")
            log.info("ssmc triton: %s backward: picked %s", self.region.name, self.picked[bucket])
        return json.loads(pick)

    def buffers(self, call, config) -> _Buffers:
        return self.allocate_buffers(self.buffer_specs(call, config), call[0].device)

    @staticmethod
    def allocate_buffers(specs, dev) -> _Buffers:
        (n_ck, n_sk, cdt), grads = specs
        return _Buffers(torch.empty(n_ck, dtype=cdt, device=dev), torch.empty(n_sk, dtype=cdt, device=dev),
                        [(i, (torch.zeros if zero else torch.empty)(shape, dtype=dt, device=dev), slots)
                         for i, shape, dt, zero, slots in grads])

    def buffer_specs(self, call, config) -> tuple:
        """What `buffers` allocates: the scratch ((elements of ck, of sk, dtype)) and per
        gradient input (input index, shape, dtype, zero-filled, slots)."""
        r, bp = self.region, self.plan
        sizes, L = self.sizes(call)
        n_ck, n_sk, cdt = self._scratch(call, config)
        nblk = triton_cdiv(sizes[bp.block], config["BLOCK_D"]) if bp.block else 1
        out = []
        items = [(g.input, g.index, g) for g in bp.grads]
        if bp.init_grad:
            items.append((r.init, tuple(r.axes), None))
        for i, index, g in items:
            if not call.needs[i]:
                out.append((i, (1,), cdt, True, 1))
                continue
            shape = self._dense_shape(call[i], index, sizes, L)
            slots = 1
            if g is not None and g.shared and (self.deterministic or not g.timed):
                slots = math.prod(sizes[a] if a != bp.block else nblk for a in g.missing)
            atomic = g is not None and g.shared and g.timed and not self.deterministic
            zero = atomic or not self._covered(shape, index, sizes, L)
            # owned elements are written once, in the input's dtype; partial sums in cdt
            direct = (g is None or not g.shared) and list(shape) == list(call[i].shape)
            dt = call[i].dtype if direct else cdt
            out.append((i, (slots, *shape), dt, zero, slots))
        return (n_ck, n_sk, cdt), out

    def launch(self, call, config, outs=None) -> list:
        """Run one config; returns the gradient of every input (None where not needed)."""
        bufs = outs if isinstance(outs, _Buffers) else self.buffers(call, config)
        fn, args, kw = self._launch_parts(call, config, bufs)
        fn[self.grid(call, config)](*args, **kw)
        return self._finish(call, bufs)

    def _launch_parts(self, call, config, bufs: _Buffers):
        """(jit function, runtime arguments, constexprs and launch options) of one launch."""
        dev = call[0].device
        args = self.launch_args(call, config, bufs)
        self.given = self._given(call, config)
        if T._seq_states(config):                 # set: ck holds the forward's checkpoints
            args.append(call.residual[1] if self.given else _zero_flag(dev))
        fn = self._fn(self._module(self._cdt(call)), config.get("variant", "scan"))
        return fn, args, {**self.constexprs(call, config), **T.launch_options(config, dev)}

    def _prepare(self, call, config):
        """The launch of this call with what depends only on the shapes, strides, dtypes,
        needs and config bound once (as the forward's `_replay`): the buffers' specs, the
        integer arguments, where each tensor argument comes from, the compiled kernel's
        launcher once the first launch through the JIT has compiled it. A training step's
        backward is one call; the Python between the op and the launch otherwise costs about
        as much as a short kernel."""
        dev = call[0].device
        specs = self.buffer_specs(call, config)
        bufs = self.allocate_buffers(specs, dev)
        fn, args, kw = self._launch_parts(call, config, bufs)
        ext = list(call) + list(call.grads) + list(call.residual)      # what each call brings
        own = [("ck", bufs.ck), ("sk", bufs.sk)] + [(k, b) for k, (_, b, _) in enumerate(bufs.grads)]
        slots = {}                                 # argument position -> ("ext" | "ck" | "sk" | k, index)
        for p, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                e = next((j for j, x in enumerate(ext) if x is a), None)
                hit = ("ext", e) if e is not None else next(((name, None) for name, b in own if b is a), None)
                if hit is not None:                # else a constant (a zero read in place of a gradient)
                    slots[p] = hit
        template = [None if p in slots else a for p, a in enumerate(args)]
        grid = self.grid(call, config)
        kern = fn[grid]
        direct = T.Direct(fn, grid, len(args), kw, sorted({e for kind, e in slots.values() if kind == "ext"}))
        given = self.given

        def replay(c: _Call) -> list:
            b = self.allocate_buffers(specs, dev)
            xs = list(c) + list(c.grads) + list(c.residual)
            mine = {"ck": b.ck, "sk": b.sk}
            a = list(template)
            for p, (kind, e) in slots.items():
                a[p] = xs[e] if kind == "ext" else mine[kind] if kind in mine else b.grads[kind][1]
            if not direct(a, xs):
                direct.keep(kern(*a, **kw), xs)
            self.given = given
            return self._finish(c, b)
        replay.direct = direct
        return replay

    def launch_args(self, call, config, bufs: _Buffers) -> list:
        """The kernel's runtime arguments of `kernel_args`, in its order (tensors, then ints;
        the seq kernels' flag_ptr not among them)."""
        r, bp = self.region, self.plan
        sizes, L = self.sizes(call)
        dev = call[0].device
        grads = []
        for o, g in zip(r.outputs, call.grads):
            if g is None or not g.numel():        # not needed: a zero read through stride 0
                g = torch.zeros((1,) * len(o.index), dtype=ir.to_dtype(o.dtype), device=dev)
            grads.append(g)
        ck = call.residual[0] if self._given(call, config) else bufs.ck
        args = [call[i] for i in bp.inputs] + grads + [ck, bufs.sk] + [b for _, b, _ in bufs.grads]
        for i in bp.inputs:
            x = call[i]
            args += [0 if x.shape[d] == 1 else x.stride(d) for d in range(x.dim())]
        for g in grads:
            args += [0 if g.shape[d] == 1 else g.stride(d) for d in range(g.dim())]
        for i, b, _ in bufs.grads:
            nd = r.inputs[i].ndim
            if b.dim() == 1:                      # not needed: never written
                args += [0] * nd
            else:
                args += [0 if b.shape[d + 1] == 1 else b.stride(d + 1) for d in range(nd)]
        slot_of = {i: (b.stride(0) if s > 1 else 0) for i, b, s in bufs.grads}
        args += [slot_of[g.input] for g in bp.grads if g.shared]
        args += [sizes[a] for a in bp.scalars]
        args += [sizes[bp.block] if bp.block else 1, sizes[bp.reg] if bp.reg else 1, L]
        return args

    def _finish(self, call, bufs: _Buffers) -> list:
        out = [None] * len(call)
        for i, b, slots in bufs.grads:
            if not call.needs[i]:
                continue
            g = b.sum(0) if slots > 1 else b[0]
            x = call[i]
            dims = [d for d in range(x.dim()) if x.shape[d] == 1 and g.shape[d] != 1]
            if dims:
                g = g.sum(dim=dims, keepdim=True)
            out[i] = g.to(x.dtype)
        for i, x in enumerate(call):
            if call.needs[i] and out[i] is None and x.is_floating_point():
                out[i] = torch.zeros_like(x)      # read only where it has no derivative
        return out

    def signature(self, config: dict, block_n: int = 16, dtypes: dict | None = None, even: bool = True):
        """(jit function, signature, constexprs) for a compile-only ``triton.compile``; every
        gradient needed; `even`: every chunk and channel block whole (the seq variant's masks
        along time and channels constant)."""
        r, bp = self.region, self.plan
        dts = [ir.to_dtype(s.dtype) for s in r.inputs]
        for i, dt in (dtypes or {}).items():
            dts[i] = dt
        cdt = "tl.float64" if torch.float64 in dts else "tl.float32"
        acc = "fp64" if cdt == "tl.float64" else "fp32"
        n = len(r.inputs)
        owned = {g.input for g in bp.grads if not g.shared} | ({r.init} if bp.init_grad else set())
        sig = {}
        for name in kernel_args(r, bp):
            if name.endswith("_ptr") and name.startswith("in"):
                k = int(name[2:-4])
                dt = dts[k] if k < n else ir.to_dtype(r.outputs[k - n].dtype)
                sig[name] = "*" + T._TL_PTR[dt]
            elif name.startswith("g") and name.endswith("_ptr") and int(name[1:-4]) in owned:
                sig[name] = "*" + T._TL_PTR[dts[int(name[1:-4])]]
            elif name.endswith("_ptr"):
                sig[name] = "*" + acc
            else:
                sig[name] = "i32"
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": block_n if bp.reg else 1, "CHUNK": config["CHUNK"],
              "DETERMINISTIC": self.deterministic}
        if T._seq_states(config):
            sig["flag_ptr"] = "*i32"
            cx["EVEN_N"] = True
            cx["EVEN_L"] = cx["EVEN_D"] = even
            cx["SEG"] = _seg(config)
        cx.update({f"NEED_{i}": True for i in bp.grad_inputs(r)})
        sig.update({k: "constexpr" for k in cx})
        return self._fn(self._module(cdt), config.get("variant", "scan")), sig, cx

    def _why_not(self, call, sizes: dict, L: int) -> str | None:
        why = super()._why_not(call, sizes, L)
        if why:
            return why
        for g in call.grads:
            if g is not None and g.numel() and g.dtype not in T._TL_PTR:
                return f"output gradient dtype {g.dtype}"
            if g is not None and g.numel() > T._INT32_MAX:
                return "an output gradient of more than 2**31 elements (32-bit offsets)"
        return None

    def run(self, inputs, grads, needs, residual=()) -> list | None:
        """The gradients, or None when this call must run the reference (``fallback`` says why)."""
        call = _Call(inputs, grads, needs, residual)
        sizes, L = self.sizes(call)
        why = self._why_not(call, sizes, L)
        if why is not None:
            self.fallback = why
            return None
        key = _call_key(call)
        replay = self._replays.get(key)
        if replay is not None:                  # this exact call was prepared before
            self.config, self.fallback = replay.config, None
            return replay(call)
        arch = T._arch(call[0].device) if call[0].device.type == "cuda" else None
        config = self._config(call, arch)
        if config is None:
            return None
        self.config = config
        self.fallback = None
        replay = self._replays[key] = self._prepare(call, config)
        replay.config = config
        return replay(call)


def _call_key(call: _Call) -> tuple:
    """What a backward launch depends on besides the data (the forward's call_signature of
    every tensor, the needs)."""
    def sig(ts):
        return T.call_signature([t for t in ts if t is not None]) + tuple(t is None for t in ts)
    return sig(list(call)), sig(call.grads), tuple(call.needs), sig(call.residual)


_ZERO_FLAGS: dict = {}


def _zero_flag(dev) -> torch.Tensor:
    """A checkpoint flag that says none were given (never written by a kernel), one a device."""
    got = _ZERO_FLAGS.get(dev)
    if got is None:
        got = _ZERO_FLAGS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return got


def _seg(config: dict) -> int:
    """Chunks per checkpoint of the seq variant (SEG, default 1: every chunk's start state)."""
    return max(1, int(config.get("SEG", 1))) if T._seq_states(config) else 1


def triton_cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# -- the hook TritonKernel.backward calls ----------------------------------------------------------

_LOCK = threading.Lock()


def backward_kernel(kernel) -> BackwardKernel | str:
    """The backward kernel of a forward kernel (made once), or why there is none."""
    got = getattr(kernel, "bwd", None)
    if got is not None:
        return got
    with _LOCK:
        got = getattr(kernel, "bwd", None)
        if got is None:
            plan = make_bwd_plan(kernel.region)
            if isinstance(plan, str):
                got = plan
            else:
                from ssmc.options import make_options
                options = getattr(kernel, "options", None) or make_options(cache_dir=kernel.cache.root)
                try:
                    got = BackwardKernel(kernel.region, kernel.strategy, plan, options, kernel.arch)
                except Exception as e:      # a render or import failure: the reference runs
                    got = f"backward kernel failed to build: {type(e).__name__}: {e}"
                    log.warning("ssmc: region %s: %s", kernel.region.name, got)
            kernel.bwd = got
    return got


def backward(kernel, inputs, grads, needs, residual=()) -> list:
    """Gradients of every input of `kernel`'s region: the generated kernel when it computes the
    region and these shapes, else the torch reference, with the reason in
    ``kernel.bwd_fallback``. `residual`: what the training forward kept (forward_train)."""
    bk = backward_kernel(kernel)
    if isinstance(bk, BackwardKernel):
        try:
            got = bk.run(inputs, grads, needs, residual)
        except Exception as e:
            bk.fallback = (f"Triton backward kernel {bk.path} with config {bk.config} failed: "
                           f"{type(e).__name__}: {e}")
            log.warning("ssmc: region %s: %s; the torch reference runs instead", kernel.region.name, bk.fallback)
            got = None
        if got is not None:
            kernel.bwd_fallback = None
            return got
        kernel.bwd_fallback = bk.fallback
    else:
        kernel.bwd_fallback = bk
    ref = kernel._reference()
    if adjoint_caveat(kernel.region):
        return ref.backward_autograd(inputs, grads, needs)
    return ref.backward(inputs, grads, needs)
