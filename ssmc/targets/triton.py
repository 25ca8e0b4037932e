"""The ``triton`` target: fused selective-scan kernels rendered with Jinja from the region IR.

Python decides, the template holds the kernel (templates/triton/selective_scan_fwd.py.j2):
- `make_plan` reads the region: which state axis is held whole in registers and summed by the
  readout (the *register* axis, e.g. n), which parallel axis is blocked across a program (the
  *channel* axis, e.g. d), and which parallel axes get one program per index (batch, heads).
  A region that does not fit (a sum over two axes, over a parallel axis, an op the printer
  lacks, reverse time) gets a reason string, and select_strategy falls back to ``torch``.
- `render` prints decay, drive and outputs with `TritonPrinter` into the kernel variants
  (``_loop``: sequential steps; ``_scan``: tl.associative_scan over chunks of steps; ``_rows``:
  time along the lanes, a loop over the register axis; ``_seq2/4/8``: a thread's steps of a
  chunk in its registers, the register axis over lanes and unrolled copies), where the
  region fits them (`rows_declines`, `seq_declines`).
- `TritonKernel` writes the source to the kernel cache (runtime/cache.py; Triton's @jit needs a
  real file), imports it, autotunes over the per-arch configs next to the template
  (selective_scan_fwd.configs.json) on the first call per (source, shape bucket, arch) and
  stores the winner in the cache, so a second process or a new length in the same bucket
  skips the search.

Strategies "chunked_ssd" and "step" have dedicated kernels (ssmc/targets/triton_ssd.py:
Mamba-2's chunked SSD on tensor cores, and the decode step); `TritonTarget.compile` picks one
by strategy, and a region the dedicated kernel declines runs on the selective-scan kernels
here, with the reason in the kernel source header (``ssmc.explain``).

Backward: `TritonKernel.backward` runs the generated backward kernels (triton_bwd.py, derived
from the region through ssmc.autodiff); a region or call they decline runs the torch reference,
with the reason in ``bwd_fallback``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import json
import re
import logging
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ssmc import ir
from ssmc.ir import Const, Load, Reduce, Region, State

from .triton_printer import Frame, TimeLoad, TritonPrinter, unsupported

try:
    import triton
    _TRITON_VERSION = triton.__version__
except Exception as _e:  # pragma: no cover - triton missing on this platform
    triton = None
    _TRITON_VERSION = f"unavailable ({type(_e).__name__})"

log = logging.getLogger("ssmc")

TEMPLATE = "triton/selective_scan_fwd.py.j2"
CONFIGS = "triton/selective_scan_fwd.configs.json"
STRATEGIES = ("chunked_scan", "chunked_ssd", "step", "block_sparse", "rank_one")
MAX_BLOCK_N = 1024          # the register axis must fit in registers
# Steps between the training checkpoints the forward's seq kernels write for the backward: the
# state every CKPT_EVERY steps (b8 d1536 n16 L2048 fp32: 25 MB). The seq backward configs whose
# CHUNK * SEG equals it read them instead of re-running the forward recurrence (its pass 1).
# 0: no checkpoints (training calls keep nothing but the inputs; benchmarks compare).
CKPT_EVERY = 64
_INT32_MAX = 2 ** 31 - 1


def interpreting() -> bool:
    """Triton's CPU interpreter is on (read where Triton reads it: at @jit decoration)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run ssmc's kernels in this environment, or None. Every
    ssmc kernel loops over an int argument (the length); a one-line kernel doing that runs once.
    (Triton 3.6's interpreter with NumPy 2.4 fails there: `int()` of a one-element array.)"""
    import numpy as np
    import triton.language as tl

    @triton.jit
    def _loop_over_an_int(out_ptr, n):
        acc = 0
        for i in range(0, n):
            acc += i
        tl.store(out_ptr, acc)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _loop_over_an_int[(1,)](out, 4)
    except Exception as e:
        return (f"Triton {_TRITON_VERSION}'s interpreter cannot run a loop over an int argument with NumPy "
                f"{np.__version__} ({type(e).__name__}: {str(e)[:120]}); a newer Triton or an older NumPy runs it")
    if int(out.item()) != 6:
        return f"Triton {_TRITON_VERSION}'s interpreter gave {int(out.item())} for 0+1+2+3 in a test kernel"
    return None


# -- plan ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    reg: str | None                 # state axis held whole in registers and summed over
    block: str | None               # parallel axis blocked by BLOCK_D per program
    scalars: tuple[str, ...]        # other parallel axes: one program per index
    inputs: tuple[int, ...]         # region inputs the kernel reads


def _all_exprs(r: Region):
    yield r.decay
    yield r.drive
    for o in r.outputs:
        yield o.expr


def make_plan(r: Region, drive_sums: bool = False) -> Plan | str:
    """The kernel's plan for `r`, or why the kernel cannot compute it. `drive_sums`: the decay
    and drive may sum inputs along the state axis held in registers (the rank-one kernel, whose
    register axis is the whole mixed axis; not the tiled kernels)."""
    if r.reverse:
        return "reverse-time recurrences are not generated yet"
    if r.mix is not None:
        return "a non-diagonal transition: only the block-sparse kernel (strategy block_sparse) runs it"
    if not r.axes:
        return "a scalar state (no state axes)"
    names = set(r.axes) | {"t"}
    loads = []
    for e in _all_exprs(r):
        for x in ir.walk(e):
            why = unsupported(x)
            if why:
                return why
            if isinstance(x, Load):
                loads.append(x)
    for ld in loads:
        if ld.input >= len(r.inputs) or len(ld.index) != r.inputs[ld.input].ndim:
            return f"load {ld} does not match input {ld.input}'s rank"
        for ix in ld.index:
            if isinstance(ix, int):
                if ix < 0:
                    return f"load {ld} with a negative index"
            elif ix not in names:
                return f"load {ld} indexes by unknown axis {ix!r}"
    reduced = set()
    for e in (r.decay, r.drive):
        for x in ir.walk(e):
            if isinstance(x, State):
                return "the state inside the decay/drive"
            if isinstance(x, Reduce):     # a sum of inputs along one state axis (DeltaProduct's
                # k_2 . (beta_1 k_1 v_1^T)): over the axis held in registers, as the outputs' sums
                if not drive_sums or len(x.axes) != 1 or x.axes[0] not in r.axes or x.op != "sum" \
                        or any(isinstance(y, (Reduce, State)) for y in ir.walk(x.arg)):
                    return f"a reduction over {list(x.axes)} inside the decay/drive"
                reduced |= set(x.axes)
    for o in r.outputs:
        for x in ir.walk(o.expr):
            if isinstance(x, Reduce):
                if not x.axes or any(a not in r.axes for a in x.axes):
                    return f"reduction over {list(x.axes)}: not all state axes"
                if any(isinstance(y, Reduce) for y in ir.walk(x.arg)):
                    return "a reduction nested in a reduction"
                reduced |= set(x.axes)
    if len(reduced) > 1:
        return (f"outputs reduce over {sorted(reduced)}; the kernel holds one state axis in "
                "registers and sums over it")
    reg = next(iter(reduced)) if reduced else None
    for o in r.outputs:
        if isinstance(o.expr, Const):
            return "an output that is a constant"
        idx = [ix for ix in o.index if ix != 1]
        if len(set(idx)) != len(idx) or any(ix not in names for ix in idx):
            return f"output index {o.index}"
        if o.kind == "steps" and "t" not in idx:
            return "a per-step output without a time dim"
        if o.kind == "final" and "t" in idx:
            return "a final output with a time dim"
        if o.kind not in ("steps", "final"):
            return f"output kind {o.kind!r}"
        extra = ir.axes_of(o.expr, r.axes) - set(idx) - ({"t"} if o.kind == "final" else set()) - set(r.unit_axes)
        if extra:
            return f"output {o.index} varies along {sorted(extra)}, which it does not index"
    if r.init is not None and r.inputs[r.init].ndim != len(r.axes):
        return "an initial state not laid out as the state"
    parallel = [a for a in r.axes if a != reg]
    block = _channel_axis(r, parallel, loads)
    scalars = tuple(a for a in parallel if a != block)
    used = {ld.input for ld in loads} | ({r.init} if r.init is not None else set())
    return Plan(reg, block, scalars, tuple(sorted(used)))


def _channel_axis(r: Region, parallel, loads) -> str | None:
    """The parallel axis most often innermost in time-indexed loads and outputs (coalesced
    loads across a program's block); ties go to the last parallel axis in state order."""
    if not parallel:
        return None
    votes = {a: 0 for a in parallel}
    idxs = [ld.index for ld in loads if "t" in ld.index] + [o.index for o in r.outputs]
    for index in idxs:
        named = [ix for ix in index if isinstance(ix, str)]
        if named and named[-1] in votes:
            votes[named[-1]] += 1
    best = max(votes.values())
    return [a for a in parallel if votes[a] == best][-1]


# -- rendering -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Variant:
    prelude: list
    init: str | None
    pre: list
    a: str
    b: str
    post: list
    final: list
    also: tuple = ()                # the codes of `_print_variant`'s `also`, printed after a and b


def _frames(plan: Plan, three_d: bool):
    """(prelude, body, final) frames: how each axis reads in each block of one variant (a
    transition's columns, MIX_COL, read as the register axis: rank_one's w . h)."""
    sfx, mt = ("3", "mt") if three_d else ("", None)
    codes = {a: (f"idx_{a}", None) for a in plan.scalars}
    if plan.block:
        codes[plan.block] = (f"od{sfx}", f"md{sfx}")
    if plan.reg:
        codes[plan.reg] = codes[ir.MIX_COL] = (f"on{sfx}", f"mn{sfx}")
    reg_mask = f"mn{sfx}" if plan.reg else None
    pre = Frame(dict(codes), None, 1, reg_mask)
    body = Frame({**codes, "t": ("tt", mt) if three_d else ("t", None)}, None, 1, reg_mask)
    final = Frame({**codes, "t": ("t_last", None)}, "h", 1, reg_mask)
    return pre, body, final


def _store(printer: TritonPrinter, k: int, o: ir.OutputSpec, value: str) -> str:
    scal, vec, masks = [], [], []
    for d, ix in enumerate(o.index):
        if ix == 1:
            continue
        code, mask = printer.frame.codes[ix]
        (vec if mask else scal).append(f"{code} * out{k}_s{d}")
        if mask and mask not in masks:
            masks.append(mask)
    off = " + ".join(scal + vec) or "0"
    m = f", mask={' & '.join(masks)}" if masks else ""
    return f"tl.store(out{k}_ptr + ({off}), {value}.to(out{k}_ptr.dtype.element_ty){m})"


def _print_variant(r: Region, plan: Plan, cdt: str, three_d: bool, also=()) -> Variant:
    """The variant's code; `also`: more expressions of the step, printed after the decay and the
    drive (rank_one's u and w)."""
    p = TritonPrinter(r, cdt)
    pre_f, body_f, final_f = _frames(plan, three_d)
    p.set_prelude_frame(pre_f)
    p.block(pre_f)
    init = p.expr(Load(r.init, tuple(r.axes))) if r.init is not None else None
    pre = p.block(body_f)
    a, b = p.expr(r.decay), p.expr(r.drive)
    more = tuple(p.expr(e) for e in also)
    post = []
    p.switch(post, state="H" if three_d else "h")
    for k, o in enumerate(r.outputs):
        if o.kind == "steps":
            post.append(_store(p, k, o, p.expr(o.expr)))
    final = p.block(final_f)
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            final.append(_store(p, k, o, p.expr(o.expr)))
    return Variant(list(p.prelude), init, pre, a, b, post, final, more)


@dataclasses.dataclass
class RowsVariant:
    """The ``_rows`` kernel's blocks: per chunk of time, `outer` (values free of the register
    axis), then a loop over the register axis whose body is `pre`, the scan of `a`, `b`
    and `post` (accumulations into `accs`, stores of outputs indexed by that axis), then
    `outer_post` (outputs that sum over the axis, read from the accumulators).

    Loads indexed by time and free of the register axis (once per chunk) are `TimeLoad` line
    objects in `outer` and `outer_post`, also listed in `loads` (the plain line as a string; the
    template's ``fetched`` filter prints the double-buffered form), each with its code for the
    next chunk ("next") and the first one ("first"), for the PREFETCH constexpr."""
    prelude: list
    init: str | None
    outer: list
    accs: list
    pre: list
    a: str
    b: str
    post: list
    outer_post: list
    final: list
    loads: list = dataclasses.field(default_factory=list)


def _accumulate(p: TritonPrinter, r: Region, mask: str) -> dict:
    """Print into the current block one line ``acc<k> += tl.where(mask, <arg>, 0.0)`` per sum
    over the register axis in the per-step outputs (the rows and seq variants accumulate them
    across their loop over that axis); returns each Reduce's accumulator name."""
    accs = {}
    for o in r.outputs:
        if o.kind == "steps":
            for x in ir.walk(o.expr):
                if isinstance(x, Reduce) and x not in accs:
                    accs[x] = f"acc{len(accs)}"
                    p.lines.append(f"{accs[x]} += tl.where({mask}, {p.expr(x.arg)}, 0.0)")
    return accs


def rows_declines(r: Region, plan: Plan) -> str | None:
    """Why the rows variant cannot compute `r` (None: it can)."""
    if plan.reg is None:
        return "no register axis to loop over"
    for o in r.outputs:
        if o.kind == "steps" and plan.reg in o.index and any(isinstance(x, Reduce) for x in ir.walk(o.expr)):
            return f"output {o.index} both indexes and sums over the register axis"
    return None


def _print_rows(r: Region, plan: Plan, cdt: str) -> RowsVariant | None:
    """The rows variant: a (BLOCK_D, CHUNK) tile per chunk, time along the tile's lanes, one
    tl.associative_scan per index of the register axis (a static loop over it), the readout
    summed over that axis by accumulating across the loop. None when `rows_declines`."""
    if rows_declines(r, plan):
        return None
    p = TritonPrinter(r, cdt)
    pre_f, _, final_f = _frames(plan, False)
    codes = {a: (f"idx_{a}", None) for a in plan.scalars}
    if plan.block:
        codes[plan.block] = ("od", "md")
    codes["t"] = ("tt", "mt")
    outer_f = Frame(dict(codes), None, None, None)
    inner_f = Frame({**codes, plan.reg: ("n", "nm")}, None, None, None)
    p.set_prelude_frame(pre_f)
    p.block(pre_f)
    init = p.expr(Load(r.init, tuple(r.axes))) if r.init is not None else None
    # loads once per chunk, also printed at the next chunk (tt_next: tt + CHUNK) and the first
    # (before the time loop), for double buffering; their masks say which of those exist
    p.double_buffer(plan.reg, {"next": {"t": ("tt_next", "mt_next")}, "first": {"t": ("tt_first", "mt_first")}})
    outer = []
    pre = p.block(inner_f)
    p.split(plan.reg, outer, outer_f)
    a, b = p.expr(r.decay), p.expr(r.drive)
    post = []
    p.switch(post, state="H")
    accs = _accumulate(p, r, "nm")
    for k, o in enumerate(r.outputs):
        if o.kind == "steps" and plan.reg in o.index and not any(isinstance(x, Reduce) for x in ir.walk(o.expr)):
            post.append(_store(p, k, o, p.expr(o.expr)))
    outer_post = p.block(outer_f)
    p.inherit()              # what is only needed after the loop is computed there (registers)
    for x, name in accs.items():
        p.memoize(x, name)
    for k, o in enumerate(r.outputs):
        if o.kind == "steps" and plan.reg not in o.index:
            outer_post.append(_store(p, k, o, p.expr(o.expr)))
    p.double_buffer(None)
    final = p.block(dataclasses.replace(final_f, state="hc"))
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            final.append(_store(p, k, o, p.expr(o.expr)))
    return RowsVariant(list(p.prelude), init, outer, list(accs.values()), pre, a, b, post, outer_post, final,
                       list(p.time_loads))


SEQ_STATES = (2, 4, 8)       # the seq variant's state elements a lane: one kernel function each


@dataclasses.dataclass
class SeqVariant:
    """The ``_seq<S>`` kernels' blocks. The register axis is split as n = s * NQ + q: q over the
    NQ = BLOCK_N / S lanes of a row (``on3`` = s * NQ + q, a (1, NQ, 1) tile), s over the S
    copies of the per-index code the template unrolls (each with its own carry ``hc<s>``).
    Per chunk of time: `outer` (values free of the register axis, on (BLOCK_D, 1, CHUNK) tiles,
    which Triton spreads over the lanes and converts once into the state loop's layout), then
    per s `pre` (every time-indexed load shaped (BLOCK_D, NQ, CHUNK), so that the loop's tiles
    all get the load's layout: CHUNK steps in one thread's registers), the scan of `a`, `b`
    along that thread-local time axis (the carry folded into the first step) and `post`
    (accumulations into `accs`, which the first copy's `post_first` sets), then `outer_post`
    (outputs that sum over the axis, from the accumulators summed over the NQ lanes; (BLOCK_D,
    1, CHUNK) tiles). `init`: per s, the lines that set ``h0`` (None: zeros);
    `final_outer` once and `final` per s after the last step."""
    prelude: list
    init: list | None
    outer: list
    accs: list
    pre: list
    a: str
    b: str
    post: list
    outer_post: list
    final_outer: list
    final: list
    post_first: list                 # `post` of the first copy: it sets the accumulators
    pre_copy: list = dataclasses.field(default_factory=list)   # per copy, before the time loop


def seq_declines(r: Region, plan: Plan) -> str | None:
    """Why the seq variant cannot compute `r` (None: it can)."""
    why = rows_declines(r, plan)
    if why:
        return why
    for o in r.outputs:
        if o.kind == "steps" and plan.reg in o.index:
            return f"output {o.index} indexes the register axis at every step"
        if o.kind == "final" and any(isinstance(x, Reduce) for x in ir.walk(o.expr)):
            return f"final output {o.index} sums over the register axis"
    return None


def _print_seq(r: Region, plan: Plan, cdt: str) -> SeqVariant | None:
    """The seq variant (see `SeqVariant`); None when `seq_declines`."""
    if seq_declines(r, plan):
        return None
    p = TritonPrinter(r, cdt)
    p.columns = False
    p.copy_prelude = []
    codes = {a: (f"idx_{a}", None) for a in plan.scalars}
    if plan.block:
        codes[plan.block] = ("od3", "md3")
    pre_f = Frame({**codes, plan.reg: ("on3", "mn3")}, None, 1, "mn3")
    outer_f = Frame({**codes, "t": ("tt2", "mt2")}, None, None, None)
    inner_f = Frame({**codes, "t": ("tt3", "mt3"), plan.reg: ("on3", "mn3")}, None, None, None)
    p.set_prelude_frame(pre_f)
    init = None
    if r.init is not None:
        init = p.block(pre_f)
        p.split(plan.reg, [], pre_f)                 # h0 is indexed by the axis: printed per s
        init.append(f"h0 = {p.expr(Load(r.init, tuple(r.axes)))}")
    outer = []
    pre = p.block(inner_f)
    p.split(plan.reg, outer, outer_f)
    a, b = p.expr(r.decay), p.expr(r.drive)
    post = []
    p.switch(post, state="H")
    accs = _accumulate(p, r, "mn3")
    post_first = [line.replace(" += ", " = ", 1) if line.split(" ", 1)[0] in accs.values() else line
                  for line in post]   # the first copy sets the accumulators (no adds of 0.0)
    p.split(None)
    outer_post = p.block(outer_f)
    for x, name in accs.items():
        p.memoize(x, f"tl.expand_dims(_sum({name}, 1), 1)")
    for k, o in enumerate(r.outputs):
        if o.kind == "steps":
            outer_post.append(_store(p, k, o, p.expr(o.expr)))
    final_outer = []
    final = p.block(Frame({**codes, plan.reg: ("on3", "mn3"), "t": ("t_last", None)}, "hc", 1, "mn3"))
    p.split(plan.reg, final_outer, Frame({**codes, "t": ("t_last", None)}, None, None, None))
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            final.append(_store(p, k, o, p.expr(o.expr)))
    p.split(None)
    return SeqVariant(list(p.prelude), init, outer, list(accs.values()), pre, a, b, post, outer_post,
                      final_outer, final, post_first, list(p.copy_prelude))


def kernel_args(r: Region, plan: Plan) -> list[str]:
    """The runtime arguments of both kernels, in order (the constexprs follow)."""
    args = [f"in{i}_ptr" for i in plan.inputs] + [f"out{k}_ptr" for k in range(len(r.outputs))]
    args += [f"in{i}_s{d}" for i in plan.inputs for d in range(r.inputs[i].ndim)]
    args += [f"out{k}_s{d}" for k, o in enumerate(r.outputs) for d in range(len(o.index))]
    args += [f"size_{a}" for a in plan.scalars] + ["SIZE_D", "SIZE_N", "L"]
    return args


def arg_lines(names: list[str]) -> list[str]:
    """Kernel arguments one group a line: pointers, each tensor's strides (``in0_s*``,
    ``out1_s*``, ``g2_s*``), slot strides, sizes."""
    def group(n):
        if n.endswith("_ptr"):
            return "ptr"
        if n.endswith("_slot"):
            return "slot"
        m = re.fullmatch(r"([a-z]+\d+)_s\d+", n)
        return m.group(1) if m else "sizes"
    lines, last = [], None
    for n in names:
        g = group(n)
        if g != last:
            lines.append([])
            last = g
        lines[-1].append(n)
    return [", ".join(g) + "," for g in lines]


def _lines(items, indent: int, sep: str = "") -> str:
    pad = " " * indent
    return (sep + "\n").join(pad + str(s) for s in items)


def _fetched(items, cond: str | None) -> list:
    """Lines with each `TimeLoad` read from its value loaded ahead where the constexpr `cond`
    holds (None: the plain lines)."""
    if cond is None:
        return list(items)
    return [x.fetched(cond) if isinstance(x, TimeLoad) else x for x in items]


def _buffers(loads, what: str) -> list[str]:
    """The double buffers' assignments: "first" loads the first chunk's values, "ahead" the
    next chunk's, "carry" hands those on to the next iteration."""
    if what == "first":
        return [f"{x.raw} = {x.at['first']}" for x in loads]
    if what == "ahead":
        return [f"{x.ahead} = {x.at['next']}" for x in loads]
    return [f"{x.raw} = {x.ahead}" for x in loads]


def tensor_args(tensors) -> list:
    """Kernel arguments for these tensors: the tensors, then each one's strides (0 along a
    size-1 dim, so a broadcast dim never moves the pointer)."""
    return list(tensors) + [0 if x.shape[d] == 1 else x.stride(d) for x in tensors for d in range(x.dim())]


class Direct:
    """A Triton kernel launched through its compiled launcher, without the JIT: the arguments
    in the kernel's parameter order (constexprs included, as the launcher takes them), the grid
    fixed. `keep` takes the compiled kernel of a JIT launch; until then, and for calls whose
    inputs' 16-byte alignment differs from that launch's (the JIT specializes pointers on it),
    `__call__` returns False and the caller launches through the JIT. `launches` counts the
    direct launches (tests)."""

    def __init__(self, fn, grid, n_args: int, kw: dict, inputs: list[int]):
        grid = tuple(grid)
        self.grid = grid + (1,) * (3 - len(grid))   # the compiled kernel's runner reads three axes
        self.inputs, self.runner, self.launches = inputs, None, 0
        self.tail = None
        params = getattr(fn, "params", None)
        if params is None or interpreting():
            return
        tail = []
        for p in params[n_args:]:
            if p.name in kw:
                tail.append(kw[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        self.tail = tail

    @staticmethod
    def _aligned(xs, inputs) -> tuple:
        return tuple(xs[i].data_ptr() % 16 == 0 for i in inputs)

    def keep(self, compiled, xs) -> None:
        if hasattr(compiled, "result"):          # an asynchronous compile's future
            compiled = compiled.result()
        if self.tail is None or self.runner is not None or not hasattr(compiled, "packed_metadata"):
            return
        self.aligned, self.device = self._aligned(xs, self.inputs), torch.cuda.current_device()
        self.runner = compiled[self.grid]

    def __call__(self, call, xs) -> bool:
        if self.runner is None or self._aligned(xs, self.inputs) != self.aligned \
                or torch.cuda.current_device() != self.device:
            return False
        self.runner(*call, *self.tail)
        self.launches += 1
        return True


def call_signature(inputs) -> tuple:
    """What a launch depends on besides the data: shapes, strides, dtypes, devices, and whether
    Triton interprets (tests switch it per test)."""
    return (interpreting(),) + tuple((x.shape, x.stride(), x.dtype, x.device) for x in inputs)


@functools.lru_cache(maxsize=None)
def _env():
    import jinja2

    root = importlib.resources.files("ssmc.templates")

    def load(name):
        return (root / name).read_text()
    env = jinja2.Environment(loader=jinja2.FunctionLoader(load), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["lines"] = _lines
    env.filters["fetched"] = _fetched
    env.filters["buffers"] = _buffers
    env.filters["copy"] = lambda items, s: [str(x).replace("@s", f"_{s}") for x in items]   # per-copy names
    env.filters["comment"] = lambda s: "\n".join("# " + l for l in str(s).splitlines())
    return env


def kernel_name(r: Region) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in r.name)
    return f"ssmc_{safe}_{r.key()[:8]}"


def render(r: Region, plan: Plan, cdt: str = "tl.float32") -> str:
    env = _env()
    return env.get_template(TEMPLATE).render(
        region_name=r.name, region_key=r.key(), region_text=str(r), cdt=cdt, kname=kernel_name(r),
        plan=plan, args=arg_lines(kernel_args(r, plan)),
        loop=_print_variant(r, plan, cdt, False), scan=_print_variant(r, plan, cdt, True),
        rows=_print_rows(r, plan, cdt), seq=_print_seq(r, plan, cdt), seq_states=SEQ_STATES)


@functools.lru_cache(maxsize=None)
def load_configs() -> dict:
    return json.loads((importlib.resources.files("ssmc.templates") / CONFIGS).read_text())


def arch_key(arch) -> str:
    if arch is None:
        return "interpreter"
    return "sm_90" if arch >= 90 else "sm_80"


# -- module loading ----------------------------------------------------------------------------------

_MODULES: dict[tuple[str, bool], object] = {}
_LOCK = threading.Lock()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


@functools.lru_cache(maxsize=None)
def _temp_dir() -> Path:
    """One directory a process for the modules of an unwritable cache."""
    return Path(tempfile.mkdtemp(prefix="ssmc_triton_"))


def import_source(source: str, key: str, cache) -> tuple[object, Path]:
    """Import rendered source from a real file (Triton's @jit reads it back with inspect).

    The file lives next to the cache entries (``<cache>/triton/<key>.py``), or in a temp dir
    when the cache is not writable; it is rewritten when it does not hold `source`."""
    interp = interpreting()
    with _LOCK:
        hit = _MODULES.get((key, interp))
        if hit is not None:
            return hit, Path(hit.__file__)
        path = Path(cache.root) / "triton" / f"{key}.py"
        try:
            if not path.is_file() or path.read_bytes() != source.encode():    # bytes: a corrupt file is
                _write_atomic(path, source)                                  # rewritten, not decoded
        except OSError:
            path = _temp_dir() / f"{key}.py"
            path.write_text(source, encoding="utf-8")
        name = f"ssmc_triton_{key[:24]}_{'interp' if interp else 'jit'}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception:
            sys.modules.pop(name, None)
            raise
        _MODULES[(key, interp)] = mod
        return mod, path


# -- the kernel ----------------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def launch_options(config: dict, device) -> dict:
    """Triton's compile options of a config: warps, stages and, where a config caps them, the
    registers per thread (``maxnreg``: ptxas then schedules for that occupancy)."""
    if device.type == "cpu":
        return {}
    opts = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    if config.get("maxnreg"):
        opts["maxnreg"] = config["maxnreg"]
    return opts


def _seq_states(config: dict) -> int:
    """S of a ``seq<S>`` config (state elements a lane), 0 for the other variants."""
    v = config.get("variant", "")
    return int(v[3:]) if v.startswith("seq") else 0


def _rows_constexprs(config: dict, block_n: int, size_n: int) -> dict:
    """The rows kernel's own constexprs: no masks on the register axis when it fills BLOCK_N,
    how many of its indices are unrolled per iteration (all by default), whether the loads once
    per chunk are double-buffered in registers (PREFETCH: 0 or 1, default 0) and the software
    pipeliner's stages of the whole-chunk loop (NUM_STAGES: the config's num_stages; 1: none)."""
    return {"EVEN_N": block_n == size_n, "UNROLL_N": min(int(config.get("UNROLL", block_n)), block_n),
            "PREFETCH": int(config.get("PREFETCH", 0)), "NUM_STAGES": int(config.get("num_stages", 1))}


def _layout(inputs) -> tuple:
    """Per input, the dim with the smallest stride among those longer than 1 (-1: none): the
    same shapes stored (b, d, L) or (b, L, d) want different configs."""
    def inner(x):
        dims = [d for d in range(x.dim()) if x.shape[d] > 1]
        return min(dims, key=lambda d: (abs(x.stride(d)), -d)) if dims else -1
    return tuple(inner(x) for x in inputs)


class MixedLast:
    """For a kernel of a non-diagonal transition that holds its region with the mixed axis last
    (`Region.mixed_last`): ``given`` is the caller's region, ``perm`` the permutation of the
    state dims that takes the caller's initial state to the kernel's (None: nothing moved).
    Its backward is the adjoint's (`mix_adjoint`), the scans on ``self.scans``."""
    given = None
    perm = None

    def moved(self, inputs) -> list:
        """The caller's inputs with the initial state permuted as the kernel's region has it (a view)."""
        ins = list(inputs)
        if self.perm is not None and self.given.init is not None:
            ins[self.given.init] = ins[self.given.init].permute(self.perm)
        return ins

    def backward(self, inputs, grads, needs, residual=()):
        from .mix_adjoint import backward
        out = backward(self.region, self.moved(inputs), grads, needs, self.scans)
        i = self.given.init
        if self.perm is not None and i is not None and out[i] is not None:    # the caller's layout
            out[i] = out[i].permute(tuple(self.perm.index(d) for d in range(len(self.perm)))).contiguous()
        return out


class TritonKernel:
    """The forward kernel of one region: rendered source, per-bucket autotuned configs.

    ``cache_status``: "hit" when the rendered source was already in the kernel cache.
    ``config``: the config of the last launch; ``chosen``: bucket -> config.
    ``fallback``: set when a call had to run the torch reference instead, and why.
    ``note``: why a dedicated kernel for the strategy declined the region (this one runs it).
    Subclasses (triton_ssd.py) replace the template, the configs and the launch geometry.
    """
    kind = "selective scan"
    template = TEMPLATE
    configs_file = CONFIGS

    def __init__(self, region: Region, strategy: str, plan: Plan, options, arch):
        from ssmc import __version__
        from ssmc.runtime.cache import cache_key, get_cache
        self.region, self.strategy, self.plan = region, strategy, plan
        self.arch = arch                   # sm number of the device at compile time, None on CPU
        self.cache = get_cache(options.cache_dir)
        self._version = __version__
        self._cache_key = cache_key
        self.chosen: dict = {}
        self.config: dict | None = None
        self.fallback: str | None = None
        self.timings: dict = {}            # bucket -> {config json: ms} of the last search
        self.failed_configs: dict = {}     # bucket -> ["config: error"] of configs that failed
        self.pruned: dict = {}             # bucket -> ["family: why"] of families the search skipped
        self.picked: dict = {}             # bucket -> why the pick is not the fastest config
        self._ref = None
        self._lock = threading.Lock()
        self._replays: dict = {}           # call_signature -> prepared launch (forward)
        self._train_replays: dict = {}     # the same for forward_train (checkpoints written)
        self.note: str | None = None
        self.options = options
        self._sources: dict[str, tuple[str, str, str]] = {}      # cdt -> (source, key, status)
        cdt = self._flavor([ir.to_dtype(s.dtype) for s in region.inputs])
        self.cdt = cdt
        self.source, self.key, self.cache_status = self._source(cdt)
        self.module, self.path = import_source(self.source, self.key, self.cache)

    # -- source and cache ------------------------------------------------------------------------
    def _render(self, cdt: str) -> str:
        return render(self.region, self.plan, cdt)

    def _source(self, cdt: str):
        if cdt not in self._sources:
            src = self._render(cdt)
            key = self._cache_key("triton-source", src, arch_key(self.arch), TritonTarget.name,
                                  TritonTarget.version, _TRITON_VERSION, self._version)
            got = self.cache.get(key, "kernel.py")
            status = "hit" if got is not None and got.decode() == src else "miss"
            if status == "miss":
                self.cache.put(key, "kernel.py", src.encode())
            self._sources[cdt] = (src, key, status)
        return self._sources[cdt]

    def _module(self, cdt: str):
        """The imported module for this compute dtype, decorated for the interpreter or the
        GPU as TRITON_INTERPRET is now (Triton decides at @jit decoration)."""
        src, key, _ = self._source(cdt)
        return import_source(src, key, self.cache)[0]

    def _fn(self, mod, variant: str):
        return getattr(mod, f"{kernel_name(self.region)}_{variant}")

    # -- shapes ------------------------------------------------------------------------------------
    def sizes(self, inputs) -> tuple[dict, int]:
        r = self.region
        sizes = {a: int(inputs[i].shape[d]) for a, (i, d) in zip(r.axes, r.axis_size)}
        return sizes, int(inputs[r.length[0]].shape[r.length[1]])

    def bucket(self, inputs) -> tuple:
        sizes, L = self.sizes(inputs)
        p = self.plan
        others = math.prod(sizes[a] for a in p.scalars)
        return (tuple(str(x.dtype).replace("torch.", "") for x in inputs), _layout(inputs),
                _pow2(sizes[p.reg]) if p.reg else 1,
                min(_pow2(sizes[p.block]), 4096) if p.block else 1,
                min(_pow2(others), 1 << 16), min(_pow2(L), 1 << 14))

    def candidates(self, inputs, arch) -> list[dict]:
        """The configs of this arch that fit these shapes: BLOCK_D clamped to the channel
        count, CHUNK to the length's bucket, tiles too big for the registers dropped (the smallest
        one is kept when all are; a rows config with PREFETCH counts its double buffers, one
        (BLOCK_D, CHUNK) tile per load once per chunk), duplicates removed (PREFETCH is dropped
        where the kernel has no load to double-buffer)."""
        table = load_configs()
        sizes, L = self.sizes(inputs)
        bn = _pow2(sizes[self.plan.reg]) if self.plan.reg else 1
        bd_max = _pow2(sizes[self.plan.block]) if self.plan.block else 1
        budget = int(table.get("max_tile_per_thread", 64)) * 32
        rows = rows_declines(self.region, self.plan) is None and bn <= int(table.get("max_rows_unroll", 32))
        seq = seq_declines(self.region, self.plan) is None
        fits, tiles, seen = [], [], set()
        for c in table[arch_key(arch)]:
            c = dict(c)
            if c["variant"] == "rows" and not rows:
                continue
            S = _seq_states(c)
            if S and (not seq or bn % S):                  # n = s * NQ + q: S must divide BLOCK_N
                continue
            c["BLOCK_D"] = max(1, min(int(c["BLOCK_D"]), bd_max))
            c["CHUNK"] = max(1, min(int(c["CHUNK"]), _pow2(L)))     # the same across a bucket
            if int(c.get("UNROLL", bn)) >= bn:                         # all of the axis: the default
                c.pop("UNROLL", None)
            if c["variant"] != "rows" or not int(c.get("PREFETCH", 0)) or not self.rows_buffers():
                c.pop("PREFETCH", None)                                 # nothing to double-buffer
            if not S or int(c.get("NEST", 0)) % c["CHUNK"] or int(c.get("NEST", 0)) >= _pow2(L):
                c.pop("NEST", None)                   # seq only, whole chunks an interval, > 1 interval
            sig = tuple(sorted(c.items()))
            if sig in seen:
                continue
            seen.add(sig)
            tile = c["BLOCK_D"] * (bn // S * c["CHUNK"] if S else
                                   {"loop": bn, "scan": bn * c["CHUNK"], "rows": c["CHUNK"]}[c["variant"]])
            if c.get("PREFETCH"):
                tile += c["BLOCK_D"] * c["CHUNK"] * self.rows_buffers()
            tiles.append((tile / c["num_warps"], c))
            if tile <= budget * c["num_warps"]:
                fits.append(c)
        if not tiles:
            raise ValueError(f"no {arch_key(arch)} config in {CONFIGS} runs this region "
                             f"(rows configs need a register axis of <= {table.get('max_rows_unroll', 32)})")
        return fits or [min(tiles, key=lambda x: x[0])[1]]

    def rows_buffers(self) -> int:
        """How many loads the rows kernel double-buffers with PREFETCH (its loads once per
        chunk; 0 where it declines the region)."""
        if not hasattr(self, "_rows_buffers"):
            rows = _print_rows(self.region, self.plan, self.cdt) if self.plan.reg else None
            self._rows_buffers = len(rows.loads) if rows is not None else 0
        return self._rows_buffers

    # -- launching -----------------------------------------------------------------------------------
    def output_specs(self, inputs) -> list[tuple]:
        """(shape, dtype) of each output of a call on `inputs`."""
        sizes, L = self.sizes(inputs)
        return [(tuple(L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index), ir.to_dtype(o.dtype))
                for o in self.region.outputs]

    def outputs(self, inputs) -> list[torch.Tensor]:
        return self.allocate(self.output_specs(inputs), inputs[0].device)

    @staticmethod
    def allocate(specs, dev) -> list[torch.Tensor]:
        """Fresh output tensors, one per (shape, dtype): every launch's outputs, replays' too."""
        return [torch.empty(s, dtype=d, device=dev) for s, d in specs]

    def _checkpointing(self, config) -> bool:
        """Whether this config's kernel takes the checkpoint arguments (the seq variants of the
        selective-scan template)."""
        return bool(_seq_states(config)) and self.template == TEMPLATE

    def call_args(self, inputs, outs, config, residual=None) -> tuple[list, dict]:
        """(arguments, constexprs) of a launch; `residual` (training): the checkpoint buffer
        and flag the seq kernels fill (`residual_specs`), else a placeholder pointer and CKPT 0."""
        args = self.launch_args(inputs, outs)
        cx = self.constexprs(inputs, config)
        if self._checkpointing(config):
            args += list(residual) if residual else [outs[0], outs[0]]
            cx["CKPT"] = CKPT_EVERY if residual else 0
            cx["NEST"] = CKPT_EVERY if residual else int(config.get("NEST", 0))
        return args, cx

    def residual_specs(self, inputs) -> list[tuple]:
        """What a training forward keeps for the backward besides the inputs: [(shape, dtype)]
        of the checkpoint buffer (the state every CKPT_EVERY steps, macros.checkpoints' layout)
        and of its flag (int32, set by a kernel that wrote them); [] where no seq backward could
        read them (another template, a region the seq kernels decline). Shapes only: the same
        whichever config then runs, so a traced graph's fake outputs hold."""
        if self.template != TEMPLATE or not CKPT_EVERY or not self._reads_checkpoints():
            return []
        sizes, L = self.sizes(inputs)
        p = self.plan
        d = sizes[p.block] if p.block else 1
        cdt = torch.float64 if self._cdt(inputs) == "tl.float64" else torch.float32
        n = -(-L // CKPT_EVERY) * math.prod(sizes[a] for a in p.scalars) * d * _pow2(sizes[p.reg])
        return [((n,), cdt), ((1,), torch.int32)]

    def _reads_checkpoints(self) -> bool:
        if not hasattr(self, "_reads_ck"):
            from .triton_bwd import BackwardKernel, backward_kernel
            ok = self.plan.reg is not None and seq_declines(self.region, self.plan) is None
            if ok:
                bk = backward_kernel(self)
                ok = isinstance(bk, BackwardKernel) and bk.seq_declines() is None
            self._reads_ck = ok
        return self._reads_ck

    def forward_train(self, inputs) -> tuple[list, list]:
        """The forward of a call whose backward will run: (outputs, residual). A seq config
        writes the checkpoints and sets the flag; any other config, or the reference, leaves the
        flag 0 and the backward runs its own forward pass."""
        sig = call_signature(inputs) + (CKPT_EVERY,)
        replay = self._train_replays.get(sig)
        if replay is not None:                 # this exact call was prepared before
            self.wrote_checkpoints = True
            return replay(inputs)
        specs = self.residual_specs(inputs)
        if not specs:
            return self.forward(inputs), []
        dev = inputs[0].device
        res = [torch.empty(specs[0][0], dtype=specs[0][1], device=dev), torch.zeros(1, dtype=torch.int32, device=dev)]
        self.wrote_checkpoints = False
        sizes, L = self.sizes(inputs)
        if self._why_not(inputs, sizes, L) is None:
            arch = _arch(dev) if dev.type == "cuda" else None
            config = self._config(inputs, arch)
            if config is not None and self._checkpointing(config) and CKPT_EVERY % config["CHUNK"] == 0:
                self.config = config
                try:
                    outs = self.launch(inputs, config, residual=res)
                    self.wrote_checkpoints = True
                    if self._replayable(inputs, config):
                        self._train_replays[sig] = self._replay(inputs, config, outs, res)
                    return outs, res
                except Exception as e:
                    raise RuntimeError(f"Triton kernel {self.path} with config {config} failed: "
                                       f"{type(e).__name__}: {e}") from e
        return self.forward(inputs), res

    def launch_args(self, inputs, outs) -> list:
        p = self.plan
        sizes, L = self.sizes(inputs)
        args = tensor_args([inputs[i] for i in p.inputs] + list(outs))
        args += [sizes[a] for a in p.scalars]
        args += [sizes[p.block] if p.block else 1, sizes[p.reg] if p.reg else 1, L]
        return args

    def constexprs(self, inputs, config) -> dict:
        sizes, _ = self.sizes(inputs)
        bn = _pow2(sizes[self.plan.reg]) if self.plan.reg else 1
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": bn, "CHUNK": config["CHUNK"]}
        if config["variant"] == "rows":
            cx.update(_rows_constexprs(config, bn, sizes[self.plan.reg]))
        if _seq_states(config):
            cx["EVEN_N"] = bn == sizes[self.plan.reg]
        return cx

    def grid(self, inputs, config) -> tuple[int]:
        sizes, _ = self.sizes(inputs)
        d = sizes[self.plan.block] if self.plan.block else 1
        return (math.prod(sizes[a] for a in self.plan.scalars) * triton.cdiv(d, config["BLOCK_D"]),)

    def signature(self, config: dict, block_n: int = 16, dtypes: dict | None = None):
        """(jit function, signature, constexprs) for a compile-only
        ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget(...))``:
        pointers typed by the region's input/output dtypes (`dtypes`: input index -> torch
        dtype overrides), every stride and size a 32-bit int."""
        r, p = self.region, self.plan
        dts = [ir.to_dtype(s.dtype) for s in r.inputs]
        for i, dt in (dtypes or {}).items():
            dts[i] = dt
        sig = {}
        for n in kernel_args(r, p):
            if n.endswith("_ptr"):
                k = int(n[2:-4]) if n.startswith("in") else None
                dt = dts[k] if k is not None else ir.to_dtype(r.outputs[int(n[3:-4])].dtype)
                sig[n] = "*" + _TL_PTR[dt]
            else:
                sig[n] = "i32"
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": block_n if p.reg else 1, "CHUNK": config["CHUNK"]}
        if config["variant"] == "rows":
            cx.update(_rows_constexprs(config, cx["BLOCK_N"], cx["BLOCK_N"]))
        cdt = "tl.float64" if torch.float64 in dts else "tl.float32"
        if _seq_states(config):
            cx["EVEN_N"] = True
        if self._checkpointing(config):     # compiled as a training forward: with its checkpoints
            sig["ck_ptr"], sig["flag_ptr"] = "*fp64" if cdt == "tl.float64" else "*fp32", "*i32"
            cx["CKPT"] = cx["NEST"] = CKPT_EVERY
        sig.update({k: "constexpr" for k in cx})
        return self._fn(self._module(cdt), config["variant"]), sig, cx

    def _flavor(self, dtypes) -> str:
        """Which rendering of the source runs inputs of these dtypes (here: the compute dtype)."""
        return "tl.float64" if torch.float64 in dtypes else "tl.float32"

    def _cdt(self, inputs) -> str:
        return self._flavor([x.dtype for x in inputs])

    def table(self) -> dict:
        """This kernel's per-arch config table (the json next to its template)."""
        return load_configs()

    def plan_text(self) -> str:
        p = self.plan
        return (f"register axis {p.reg}, channel axis {p.block}, "
                f"one program per index of {list(p.scalars)}")

    def launch_text(self) -> str | None:
        """A line for the kernel source header about how calls are launched (None: nothing to add)."""
        return None

    def launch(self, inputs, config, outs=None, residual=None) -> list[torch.Tensor]:
        """Run one config (tests use this to check every variant); `residual`: as in call_args."""
        outs = self.outputs(inputs) if outs is None else outs
        fn = self._fn(self._module(self._cdt(inputs)), config["variant"])
        extra = launch_options(config, inputs[0].device)
        args, cx = self.call_args(inputs, outs, config, residual)
        fn[self.grid(inputs, config)](*args, **cx, **extra)
        return outs

    def _why_not(self, inputs, sizes: dict, L: int) -> str | None:
        """Why this call runs the torch reference instead (None: the kernel runs)."""
        dev = inputs[0].device
        if L == 0:
            return "zero steps"
        if dev.type == "cpu" and not interpreting():
            return "CPU tensors without TRITON_INTERPRET=1"
        if dev.type not in ("cpu", "cuda"):
            return f"device {dev.type}"
        if self.plan.reg and _pow2(sizes[self.plan.reg]) > MAX_BLOCK_N:
            return f"register axis of {sizes[self.plan.reg]} > {MAX_BLOCK_N} elements"
        for x in inputs:
            if x.dtype not in _TL_PTR:
                return f"input dtype {x.dtype}"
            if x.numel() > _INT32_MAX:
                return "an input of more than 2**31 elements (32-bit offsets)"
        for o in self.region.outputs:
            if math.prod(L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index) > _INT32_MAX:
                return "an output of more than 2**31 elements (32-bit offsets)"
        return None

    def _reference(self):
        if self._ref is None:
            from .reference import ReferenceKernel
            self._ref = ReferenceKernel(self.region)
        return self._ref

    def forward(self, inputs):
        sig = call_signature(inputs)
        replay = self._replays.get(sig)
        if replay is not None:                 # this exact call was prepared before
            return replay(inputs)
        sizes, L = self.sizes(inputs)
        why = self._why_not(inputs, sizes, L)
        if why is not None:
            self.fallback = why
            return self._reference().forward(inputs)
        arch = _arch(inputs[0].device) if inputs[0].device.type == "cuda" else None
        config = self._config(inputs, arch)
        if config is None:
            return self._reference().forward(inputs)
        self.config = config
        try:
            outs = self.launch(inputs, config)
        except Exception as e:   # ssmc.runtime.op falls back to the reference and reports this
            raise RuntimeError(f"Triton kernel {self.path} with config {config} failed: "
                               f"{type(e).__name__}: {e}") from e
        if self._replayable(inputs, config):
            self._replays[sig] = self._replay(inputs, config, outs)
        return outs

    def _replayable(self, inputs, config) -> bool:
        """Whether this call's launch is the one kernel launch that `_replay` prepares (a
        subclass's own launch is not replayed unless it says so)."""
        return type(self).launch is TritonKernel.launch

    def _replay(self, inputs, config, outs, residual=None):
        """The launch of this call with everything that depends only on the inputs' shapes,
        strides, dtypes and device bound once: the kernel, grid, integer arguments, constexprs
        and the output shapes. A decode step is a few microseconds of GPU work, so the Python
        between the custom op and the launch is most of its time. The first replay launches
        through Triton's JIT and keeps the compiled kernel it returns; later ones call that
        kernel's launcher directly (`Direct`), skipping the JIT's argument binding and cache
        lookup, as long as the inputs keep the 16-byte alignment the kernel was specialized on."""
        fn = self._fn(self._module(self._cdt(inputs)), config["variant"])
        extra = launch_options(config, inputs[0].device)
        args, cx = self.call_args(inputs, outs, config, residual)
        res = list(residual or [])
        slots = {}                                  # argument position -> ("out" | "res" | "in", index)
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                for kind, ts in (("out", outs), ("res", res), ("in", inputs)):
                    j = next((j for j, t in enumerate(ts) if t is a), None)
                    if j is not None:
                        slots[k] = (kind, j)
                        break
        template = [None if k in slots else a for k, a in enumerate(args)]   # holds no tensor
        grid = self.grid(inputs, config)
        kern = fn[grid]
        kw = {**cx, **extra}
        shapes = [(tuple(o.shape), o.dtype) for o in outs]
        res_shapes = [(tuple(r.shape), r.dtype) for r in res]     # the flag too: the kernel sets it
        dev = inputs[0].device
        direct = Direct(fn, grid, len(args), kw, [i for k, (kind, i) in slots.items() if kind == "in"])

        def replay(xs):
            got = {"out": self.allocate(shapes, dev), "res": self.allocate(res_shapes, dev), "in": xs}
            call = list(template)
            for k, (kind, i) in slots.items():
                call[k] = got[kind][i]
            if not direct(call, xs):
                direct.keep(kern(*call, **kw), xs)
            return (got["out"], got["res"]) if residual is not None else got["out"]
        replay.direct = direct
        return replay

    def _config(self, inputs, arch) -> dict | None:
        bucket = (arch_key(arch), self.bucket(inputs))
        if bucket in self.chosen:
            return self.chosen[bucket]
        with self._lock:
            if bucket in self.chosen:
                return self.chosen[bucket]
            src_key = self._source(self._cdt(inputs))[1]
            tkey = self._cache_key("triton-autotune", src_key, repr(bucket),   # a full search is its own entry
                                   *(("all",) if self.options.autotune == "all" else ()))
            got = self.cache.get(tkey, "config.json")
            if got is not None:
                try:
                    cfg = json.loads(got)
                    if cfg in self.candidates(inputs, arch):
                        self.chosen[bucket] = cfg
                        return cfg
                except ValueError:
                    pass
            cfg = self._autotune(inputs, arch, bucket)
            if cfg is not None:
                self.cache.put(tkey, "config.json", json.dumps(cfg, sort_keys=True).encode())
                self.chosen[bucket] = cfg
            return cfg

    def _autotune(self, inputs, arch, bucket) -> dict | None:
        """Time the candidates (a failing one, e.g. out of registers, is skipped). With
        ``autotune="prune"`` (the default) the first config of each variant family is timed
        first, and the rest of a family only where that first one is within the table's
        ``prune_ratio`` of the best first one; ``autotune="all"`` times every candidate."""
        cands = self.candidates(inputs, arch)
        if len(cands) == 1:                    # nothing to choose between
            self.timings[bucket] = {json.dumps(cands[0], sort_keys=True): None}
            return cands[0]
        times, errors = {}, []
        cuda = inputs[0].device.type == "cuda"
        ratio = float(self.table().get("prune_ratio", 0)) if self.options.autotune == "prune" else 0
        families: dict[str, list] = {}
        for c in cands:
            families.setdefault(_family(c), []).append(c)
        prune = ratio > 0 and len(families) > 1
        log.info("ssmc triton: %s: autotuning over %d %s configs (each compiles first%s)",
                 self.region.name, len(cands), arch_key(arch),
                 f"; the rest of a family whose first config is over {ratio}x the best first is skipped"
                 if prune else "")
        first = [f[0] for f in families.values()] if prune else cands
        done = 0

        def run(group):
            nonlocal done
            for c in group:
                done += 1
                start = time.perf_counter()
                try:
                    times[json.dumps(c, sort_keys=True)] = ms = self._time_config(inputs, c, cuda)
                    log.info("ssmc triton: config %d/%d %s: %.3f ms (compiled and timed in %.1f s)", done,
                             len(cands), c, ms, time.perf_counter() - start)
                except Exception as e:
                    errors.append(f"{c}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    log.info("ssmc triton: config %d/%d %s failed after %.1f s: %s", done, len(cands), c,
                             time.perf_counter() - start, errors[-1])
                    log.debug("ssmc triton: config %s failed", c, exc_info=True)

        run(first)
        if prune:
            lead = {f: times.get(json.dumps(cs[0], sort_keys=True)) for f, cs in families.items()}
            best = min((ms for ms in lead.values() if ms is not None), default=None)
            rest = []
            for f, cs in families.items():
                if best is None or (lead[f] is not None and lead[f] <= ratio * best):
                    rest += cs[1:]
                elif len(cs) > 1:
                    why = (f"{lead[f]:.3f} ms, {lead[f] / best:.2f}x the best first config" if lead[f] is not None
                           else "failed")
                    self.pruned.setdefault(bucket, []).append(
                        f"{len(cs) - 1} more {f} config(s): the first {f} config {why} (prune_ratio {ratio}; "
                        "autotune='all' times them)")
                    log.info("ssmc triton: %s: skipped %s", self.region.name, self.pruned[bucket][-1])
            run(rest)
        self.timings[bucket] = times
        if errors:
            self.failed_configs[bucket] = errors
        if not times:
            self.fallback = (f"every Triton config failed (kernel source {self.path}); "
                             f"the torch reference ran instead: " + "; ".join(errors))
            log.warning("ssmc: %s", self.fallback)
            return None
        return self._pick(times, bucket, inputs)

    def _pick(self, times: dict, bucket, inputs) -> dict:
        """The config to keep from the timed ones (json key -> ms): the fastest."""
        return json.loads(min(times, key=times.get))

    def _time_config(self, inputs, c, cuda: bool) -> float:
        """Milliseconds a launch of config c takes: the mean of 10 after one that compiles it
        (CUDA events); in the interpreter, the wall time of one."""
        if not cuda:                                   # the interpreter: nothing to compile
            s = time.perf_counter()
            self.launch(inputs, c)
            return (time.perf_counter() - s) * 1e3
        outs = self.launch(inputs, c)                  # compiles
        torch.cuda.synchronize()
        reps = 10
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            self.launch(inputs, c, outs)
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) / reps

    def backward(self, inputs, grads, needs, residual=()):
        """The generated backward kernel (triton_bwd.py); the torch reference for what it
        declines (``bwd_fallback`` says why). `residual`: forward_train's."""
        from .triton_bwd import backward
        return backward(self, inputs, grads, needs, residual)

    def backward_note(self) -> str | None:
        """Which backward ran (None before the first one)."""
        if not hasattr(self, "bwd_fallback"):
            return None
        if self.bwd_fallback is None:
            why = "".join(f"; picked {w}" for w in self.bwd.picked.values())
            ck = (f"; read the forward's checkpoints (every {CKPT_EVERY} steps)"
                  if self.bwd.given and getattr(self, "wrote_checkpoints", False)
                  else "; ran the forward recurrence for its checkpoints")
            return f"backward: generated Triton kernel {self.bwd.path}{ck}{why}"
        return f"backward: torch reference ({self.bwd_fallback})"


def _family(config: dict) -> str:
    """The variant family a config belongs to, for the autotuner's pruning: seq2/4/8 are one."""
    return "seq" if _seq_states(config) else str(config.get("variant", "scan"))   # a backward config: scan


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def _arch(device: torch.device) -> int:
    return _device_arch(device.index if device.index is not None else torch.cuda.current_device())


_TL_PTR = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.float64: "fp64", torch.bool: "i1"}


# -- the target ----------------------------------------------------------------------------------------

class TritonTarget:
    name = "triton"
    version = f"1+triton-{_TRITON_VERSION}"

    def supports(self, region: Region, strategy: str, arch, device_type: str):
        if triton is None:
            return f"triton is not installed ({_TRITON_VERSION})"
        if device_type == "cuda":
            if arch is None or arch < 80:
                return f"needs sm_80 or newer (this device is sm_{arch})"
        elif device_type == "cpu":
            if not interpreting():
                return "Triton kernels run on CUDA GPUs; on CPU only under TRITON_INTERPRET=1"
            broken = interpreter_problem()
            if broken:
                return broken
        else:
            return f"no Triton kernels for device {device_type!r}"
        if strategy not in STRATEGIES:
            return f"strategy {strategy!r} has no Triton kernel"
        if strategy == "block_sparse":
            from .triton_block_sparse import plan_for
            plan = plan_for(region)
        elif strategy == "rank_one":
            from .triton_rank_one import make_rank_one_plan
            plan = make_rank_one_plan(region.mixed_last()[0]) if region.mix is not None else "no transition"
        else:
            plan = make_plan(region)
        return plan if isinstance(plan, str) else True

    def compile(self, region: Region, strategy: str, options) -> TritonKernel:
        if triton is None:
            raise RuntimeError(f"triton is not installed ({_TRITON_VERSION})")
        arch = None
        if not interpreting() and torch.cuda.is_available():
            arch = _arch(torch.device("cuda"))
        if strategy == "rank_one":
            from .triton_rank_one import RankOneKernel
            return RankOneKernel(region, strategy, options, arch)
        if strategy == "block_sparse":           # no other Triton kernel runs a matrix transition
            from .triton_block_sparse import BlockSparseKernel, plan_for
            got = plan_for(region)
            if isinstance(got, str):
                raise ValueError(f"triton target cannot compile region {region.name}: {got}")
            return BlockSparseKernel(region, strategy, got, options, arch)
        plan = make_plan(region)
        if isinstance(plan, str):
            raise ValueError(f"triton target cannot compile region {region.name}: {plan}")
        arch = None
        if not interpreting() and torch.cuda.is_available():
            arch = _arch(torch.device("cuda"))
        from .triton_ssd import DEDICATED
        note = None
        dedicated = DEDICATED.get(strategy)
        if dedicated is not None:
            got = dedicated.make_plan(region)
            if not isinstance(got, str):
                return dedicated(region, strategy, got, options, arch)
            note = (f"the {dedicated.kind} kernel declined this region ({got}); "
                    f"the {TritonKernel.kind} kernel runs it")
            log.info("ssmc triton: region %s: %s", region.name, note)
        kernel = TritonKernel(region, strategy, plan, options, arch)
        kernel.note = note
        return kernel

    def source(self, kernel: TritonKernel) -> str:
        head = [f"# triton target {self.version}: kernel cache {kernel.cache_status}, source file {kernel.path}",
                f"# kernel: {kernel.kind} ({kernel.template}) for strategy {kernel.strategy}",
                f"# plan: {kernel.plan_text()}"]
        if kernel.note:
            head.append(f"# {kernel.note}")
        if kernel.chosen:
            for (arch, bucket), cfg in kernel.chosen.items():
                head.append(f"# config for {arch}, bucket {bucket}: {json.dumps(cfg, sort_keys=True)}")
        else:
            cands = kernel.table()[arch_key(kernel.arch)]
            head.append(f"# config: autotuned on the first call over {len(cands)} {arch_key(kernel.arch)} "
                        f"configs ({kernel.configs_file})")
        for (arch, bucket), errors in kernel.failed_configs.items():
            head.extend(f"# config failed for {arch}: {e}" for e in errors)
        for (arch, bucket), why in kernel.pruned.items():
            head.extend(f"# autotune for {arch} skipped {w}" for w in why)
        for (arch, bucket), why in kernel.picked.items():
            head.append(f"# autotune for {arch} picked {why}")
        launch = kernel.launch_text()
        if launch:
            head.append(f"# launch: {launch}")
        if kernel.fallback:
            head.append(f"# fallback: {kernel.fallback}")
        return "\n".join(head) + "\n" + kernel.source
