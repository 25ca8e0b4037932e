"""The Triton kernel of strategy "block_sparse": a recurrence whose transition is a matrix along
the last state axis, of which only the nonzero blocks are multiplied (templates/triton/
block_sparse_fwd.py.j2).

`make_bsp_plan` reads the region: the mixed axis (the last state axis) is held whole per row
and summed by the readout; the other state axes are parallel (a channel axis blocked by BLOCK_D
rows, one program per index of the rest), as in the selective-scan kernel. The transition's
matrix m is split into factors: those free of the row and column (a step size per channel)
form a row scale, the rest a matrix W shared by all rows, so each block is one small matmul
(tl.dot for blocks of 16 and more, multiply-and-sum below); an m that mixes both is printed as
a (rows, BS, BS) tile. Two paths in one kernel: the compiled mask unrolled (`render_static`:
state tiles in registers, loop-invariant blocks loaded once), and a block-CSR loop over the
pattern of the actual inputs (state blocks through an L1-resident scratch buffer). The pattern
is recomputed from the inputs on the device (ssmc.sparsity) and a flag picks the unrolled path
only when the compiled mask covers it, so the kernel is right for any mask, dense included.

Backward: `ssmc.targets.mix_adjoint`, the adjoint in chunks, its scans (a chunk's states; lam in
reverse time with the transposed mask) on kernels of this class, the gradients by torch ops.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ssmc import ir
from ssmc.ir import Const, Load, Reduce, Region, State, factors, product
from ssmc.sparsity import BLOCK_SIZES, PatternCache, block_csr, uncovered

from . import triton as T
from .triton_printer import Frame, TritonPrinter, unsupported
from .triton_ssd import _Printer as _NamedPrinter
from .triton_ssd import _table

TEMPLATE = "triton/block_sparse_fwd.py.j2"
CONFIGS = "triton/block_sparse_fwd.configs.json"
MAX_STATIC_BLOCKS = 64      # the compiled mask is unrolled into the kernel up to this many blocks


@dataclasses.dataclass(frozen=True)
class BSPlan:
    reg: str                        # the mixed state axis (held whole, summed by the readout)
    block: str | None               # parallel axis blocked by BLOCK_D rows
    scalars: tuple[str, ...]        # other parallel axes: one program per index
    inputs: tuple[int, ...]
    bs: int                         # block size
    mode: str                       # "dot" | "fma2" | "fma3"
    scale: ir.Expr | None           # row factor of m (fma2/dot)
    matrix: ir.Expr | None          # shared factor of m (fma2/dot)


def mixed_layout(r: Region, drive_sums: bool = False):
    """(channel axis, the other parallel axes, inputs read) of a kernel holding the region's last
    state axis (the mixed one) whole per row and the rest parallel as the selective-scan kernel
    does; or why the transition or the outputs do not fit that. `drive_sums`: as `make_plan`'s."""
    base = T.make_plan(dataclasses.replace(r, mix=None), drive_sums)
    if isinstance(base, str):
        return base
    last = r.axes[-1]
    if base.reg not in (None, last):
        return f"the readout sums over {base.reg}, not over the mixed axis {last}"
    names = set(r.axes) | {"t", ir.MIX_COL}
    for x in ir.walk(r.mix.expr):
        why = unsupported(x)
        if why:
            return why
        if isinstance(x, (Reduce, State)):
            return "a reduction or the state inside the transition"
        if isinstance(x, Load):
            if len(x.index) != r.inputs[x.input].ndim:
                return f"load {x} does not match input {x.input}'s rank"
            if any(isinstance(ix, str) and ix not in names for ix in x.index):
                return f"load {x} indexes an unknown axis"
    parallel = [a for a in r.axes if a != last]
    block = base.block if base.block in parallel else (parallel[-1] if parallel else None)
    scalars = tuple(a for a in parallel if a != block)
    used = set(base.inputs) | {ld.input for ld in ir.loads(r.mix.expr)}
    return block, scalars, tuple(sorted(used))


def make_bsp_plan(r: Region) -> BSPlan | str:
    if r.mix is None:
        return "no non-diagonal transition"
    if r.mix_axis != r.axes[-1]:
        return f"the transition acts along {r.mix_axis}, not the last state axis"
    got = mixed_layout(r)
    if isinstance(got, str):
        return got
    block, scalars, used = got
    last = r.axes[-1]
    parallel = [a for a in r.axes if a != last]
    bs = r.mix.block
    if not bs:
        return "the block_sparse pass did not run (no block size)"
    if bs & (bs - 1):
        return f"block size {bs} is not a power of two"
    rowcol = {last, ir.MIX_COL}
    fs = factors(r.mix.expr)
    scale = [f for f in fs if not ir.axes_of(f, r.axes) & rowcol]
    mat = [f for f in fs if f not in scale]
    shared = all(not ir.axes_of(f, r.axes) & set(parallel) for f in mat) and mat
    if shared:
        mode = "dot" if bs >= 16 else "fma2"
        return BSPlan(last, block, scalars, used, bs, mode, product(scale), product(mat))
    return BSPlan(last, block, scalars, used, bs, "fma3", None, None)


class _Printer(TritonPrinter):
    """Prints inside the block loops: nothing is hoisted (values depend on the block)."""

    def hoistable(self, e) -> bool:
        return False


def _contrib(plan: BSPlan, cdt: str, hj: str, m: str, scale: str | None) -> str:
    if plan.mode == "fma3":
        return f"_sum(({m}) * tl.expand_dims({hj}, 1), 2)"
    if plan.mode == "dot":
        prec = ', input_precision="tf32x3"' if cdt == "tl.float32" else ""
        prod = f"tl.dot({hj}, tl.trans({m}){prec})"
    else:
        prod = f"_sum(tl.expand_dims({m}, 0) * tl.expand_dims({hj}, 1), 2)"
    return prod if scale is None or scale == "1.0" else f"{scale} * {prod}"


def render_static(r: Region, plan: BSPlan, cdt: str, codes: dict, codes3: dict) -> list[str] | None:
    """The kernel body for the mask known at compile time, unrolled: the state is NB tiles
    h_I of (BLOCK_D, BS) in registers, each step multiplies exactly the compiled nonzero blocks,
    loop-invariant blocks of W are loaded once before the time loop; readouts over the mixed
    axis are summed block by block. None when the region does not fit this form."""
    m = r.mix
    nb, blocks = m.nblocks, m.blocks
    if not blocks or len(blocks) > MAX_STATIC_BLOCKS or nb > 32:
        return None
    reg = plan.reg
    pre, body, post, final = [], [], [], []
    idx = [f"sb{i} = {i} * BS + offs_b[None, :]" for i in range(nb)]
    idx += [f"sr{i} = {i} * BS + offs_b[:, None]" for i in range(nb)]
    if plan.mode == "fma3":
        idx += [f"s3r{i} = {i} * BS + offs_b[None, :, None]" for i in range(nb)]
        idx += [f"s3c{i} = {i} * BS + offs_b[None, None, :]" for i in range(nb)]
    printers = []
    shared = _NamedPrinter(r, cdt, "c_", "c_p")        # values the same for every block row
    shared_frame = Frame({**codes, "t": ("t", None)}, None, None, None)
    shared.set_prelude_frame(shared_frame)
    shared.block(shared_frame)
    shared.switch(body)
    printers.append(shared)

    def printer(prefix, frame, share=True):
        p = _BlockPrinter(r, cdt, prefix, prefix + "p", shared if share else None, reg)
        p.set_prelude_frame(frame)
        p.block(frame)
        printers.append(p)
        return p
    rows = []
    for i in range(nb):
        p = printer(f"r{i}_", Frame({**codes, reg: (f"sb{i}", None), "t": ("t", None)}, None, None, None))
        rows.append(p)
        init = f" + {p.expr(Load(r.init, tuple(r.axes)))}" if r.init is not None else ""
        pre.append(f"h{i} = tl.full((BLOCK_D, BS), 0.0, {cdt}){init}")
        p.switch(body)
        terms = [f"tl.full((BLOCK_D, BS), 0.0, {cdt})"]
        if not (isinstance(r.decay, Const) and r.decay.value == 0):
            terms.append(f"{p.expr(r.decay)} * h{i}")
        if not (isinstance(r.drive, Const) and r.drive.value == 0):
            terms.append(p.expr(r.drive))
        body.append(f"n{i} = " + " + ".join(terms))
    for i, j in blocks:
        scale = rows[i].expr(plan.scale) if plan.scale is not None else None
        if plan.mode == "fma3":
            f = Frame({**codes3, reg: (f"s3r{i}", None), ir.MIX_COL: (f"s3c{j}", None), "t": ("t", None)},
                      None, None, None)
            e = r.mix.expr
        else:
            f = Frame({reg: (f"sr{i}", None), ir.MIX_COL: (f"sb{j}", None), "t": ("t", None)}, None, None, None)
            e = plan.matrix
        p = printer(f"m{i}_{j}_", f, share=plan.mode != "fma3")     # fma3 tiles are 3-d
        p.switch(body)
        code = p.expr(e)
        if plan.mode != "fma3":
            (pre if code.startswith(f"m{i}_{j}_p") else body).append(f"w{i}_{j} = {code} + zbs")
            code = f"w{i}_{j}"
        body.append(f"n{i} += {_contrib(plan, cdt, f'h{j}', code, scale)}")
    body.append(", ".join(f"h{i}" for i in range(nb)) + " = " + ", ".join(f"n{i}" for i in range(nb)))
    for kind, lines, tcode in (("steps", post, "t"), ("final", final, "t_last")):
        for k, o in enumerate(r.outputs):
            if o.kind != kind:
                continue
            if reg in o.index:          # stored block by block
                for i in range(nb):
                    p = printer(f"o{k}_{i}_", Frame({**codes, reg: (f"sb{i}", None), "t": (tcode, None)},
                                                    f"h{i}", 1, None), share=False)
                    p.switch(lines)
                    lines.append(T._store(p, k, o, p.expr(o.expr)))
                continue
            reduces = [x for x in ir.walk(o.expr) if isinstance(x, Reduce)]
            if any(reg not in ir.axes_of(x.arg, r.axes) for x in reduces) or _state_outside(o.expr):
                return None
            whole = printer(f"o{k}_", Frame({**codes, "t": (tcode, None)}, None, None, None), share=False)
            for q, red in enumerate(reduces):
                parts = []
                for i in range(nb):
                    p = printer(f"o{k}_{q}_{i}_", Frame({**codes, reg: (f"sb{i}", None), "t": (tcode, None)},
                                                        f"h{i}", 1, None), share=False)
                    p.switch(lines)
                    parts.append(f"tl.expand_dims(_sum({p.expr(red.arg)}, 1), 1)")
                lines.append(f"red{k}_{q} = " + " + ".join(parts))
                whole.bind(red, f"red{k}_{q}")
            whole.switch(lines)
            lines.append(T._store(whole, k, o, whole.expr(o.expr)))
    prelude = [line for p in printers for line in p.prelude]
    out = idx + prelude + pre
    out.append("for t in range(0, L):")
    out += ["    " + l for l in body + post]
    return out + final


class _BlockPrinter(_NamedPrinter):
    """Prints for one block; what does not vary along the mixed axis or the column (a step
    size, an input per channel) goes to the printer shared by all blocks, printed once."""

    def __init__(self, region, cdt, prefix, hoist_prefix, shared, axis):
        super().__init__(region, cdt, prefix, hoist_prefix)
        self.shared, self.axis = shared, axis

    def expr(self, e):
        if self.shared is not None and not isinstance(e, (Const, State)) and not ir.uses_state(e) \
                and not self.axes(e) & {self.axis, ir.MIX_COL}:
            return self.shared.expr(e)
        return super().expr(e)


def _state_outside(e) -> bool:
    """The state appears in `e` other than under a Reduce."""
    if isinstance(e, State):
        return True
    if isinstance(e, Reduce):
        return False
    return any(_state_outside(c) for c in ir.children(e))


def render_bsp(r: Region, plan: BSPlan, cdt: str) -> str:
    codes = {a: (f"idx_{a}", None) for a in plan.scalars}
    if plan.block:
        codes[plan.block] = ("od", "md")
    out = TritonPrinter(r, cdt, "v")
    pre = Frame({**codes, plan.reg: ("on", "mn")}, None, 1, "mn")
    out.set_prelude_frame(pre)
    out.block(pre)
    init = out.expr(Load(r.init, tuple(r.axes))) if r.init is not None else None
    blk = _Printer(r, cdt, "w")
    row = blk.block(Frame({**codes, plan.reg: ("oi", None), "t": ("t", None)}, None, None, None))
    row.append("hi = tl.load(src + od * BLOCK_N + oi)")
    diag = [f"tl.full((BLOCK_D, BS), 0.0, {cdt})"]
    if not (isinstance(r.decay, Const) and r.decay.value == 0):
        diag.append(f"{blk.expr(r.decay)} * hi")
    if not (isinstance(r.drive, Const) and r.drive.value == 0):
        diag.append(blk.expr(r.drive))
    scale = blk.expr(plan.scale) if plan.scale is not None else None
    codes3 = {a: (f"idx_{a}", None) for a in plan.scalars}
    if plan.block:
        codes3[plan.block] = ("od3", "md3")
    mat = []
    if plan.mode == "fma3":
        blk.block(Frame({**codes3, plan.reg: ("oi3", None), ir.MIX_COL: ("oj3", None), "t": ("t", None)},
                        None, None, None))
        blk.switch(mat)
        contrib = _contrib(plan, cdt, "hj", blk.expr(r.mix.expr), None)
    else:
        blk.block(Frame({plan.reg: ("oi2", None), ir.MIX_COL: ("oj2", None), "t": ("t", None)}, None, None, None))
        blk.switch(mat)
        mat.append(f"wij = {blk.expr(plan.matrix)} + zbs")
        contrib = _contrib(plan, cdt, "hj", "wij", scale)
    post = out.block(Frame({**codes, plan.reg: ("on", "mn"), "t": ("t", None)}, "h", 1, "mn"))
    for k, o in enumerate(r.outputs):
        if o.kind == "steps":
            post.append(T._store(out, k, o, out.expr(o.expr)))
    final = out.block(Frame({**codes, plan.reg: ("on", "mn"), "t": ("t_last", None)}, "h", 1, "mn"))
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            final.append(T._store(out, k, o, out.expr(o.expr)))
    static = render_static(r, plan, cdt, codes, codes3)
    base = T.Plan(plan.reg, plan.block, plan.scalars, plan.inputs)
    return T._env().get_template(TEMPLATE).render(static=static,
        region_name=r.name, region_key=r.key(), region_text=str(r), cdt=cdt, kname=T.kernel_name(r),
        mode=plan.mode, plan=base, args=T.arg_lines(T.kernel_args(r, base)), prelude=list(out.prelude), init=init,
        row=row, diag=" + ".join(diag), mat=mat, contrib=contrib, post=post, final=final)


DOT_BLOCK = 16     # the least block tl.dot takes


def coarsened(r: Region, plan: BSPlan) -> tuple[Region, BSPlan, str] | None:
    """Blocks below 16 of a matrix shared by all rows, re-blocked to 16x16 tiles for tl.dot (a
    tile is nonzero when any of its blocks is), with why; None when that does not apply.
    Measured on the H200 (benchmarks/results/h200_block_sparse.json, d_state 64, b32 L4096, 256
    channels): 16 nonzero 8x8 blocks multiplied and summed took 73.7 ms, 16 tiles of 16x16 on
    tl.dot (the dense matrix) 12.0 ms; a tile on tl.dot costs a sixth of an 8x8 block done with
    multiplies, and the coarse mask never has more tiles than the fine one has blocks."""
    m = r.mix
    n = m.block * m.nblocks
    if plan.mode != "fma2" or m.block >= DOT_BLOCK or not m.nblocks or n % DOT_BLOCK:
        return None
    k = DOT_BLOCK // m.block
    blocks = tuple(sorted({(i // k, j // k) for i, j in m.blocks}))
    coarse = dataclasses.replace(r, mix=dataclasses.replace(m, block=DOT_BLOCK, nblocks=n // DOT_BLOCK, blocks=blocks))
    cplan = make_bsp_plan(coarse)
    if isinstance(cplan, str) or cplan.mode != "dot":
        return None
    why = (f"{m.block}x{m.block} blocks ({len(m.blocks)} nonzero) run as {DOT_BLOCK}x{DOT_BLOCK} tiles on tl.dot "
           f"({len(blocks)} nonzero): a tile on tensor cores costs less than a small block multiplied and summed")
    return coarse, cplan, why


class BlockSparseKernel(T.MixedLast, T.TritonKernel):
    """Forward of a block-sparse recurrence; the block pattern from the inputs at each call.
    Blocks below 16 of a transition shared by all rows run as 16x16 tiles on tl.dot
    (`coarsened`); ``coarsened_from`` says so, and the plan text in the kernel source."""
    kind = "block-sparse recurrence"
    template = TEMPLATE
    configs_file = CONFIGS
    make_plan = staticmethod(make_bsp_plan)

    def __init__(self, region, strategy, plan, *args, **kwargs):
        self._compiled_bp: dict = {}
        self.coarsened_from = None
        self.given, self.perm = region, None     # a region mixed along another axis than the last:
        if _moves(region):                       # held with that axis last, the initial state permuted
            region, self.perm = region.mixed_last()
        if _moves(self.given) or region.unit_axes or _pow2_blocks(region) is not region:
            region = _pow2_blocks(region.without_unit_sums())  # e.g. a (n, 1) column, read out squeezed
            plan = make_bsp_plan(region)
            if isinstance(plan, str):
                raise ValueError(f"triton target cannot compile region {region.name}: {plan}")
        got = coarsened(region, plan) if isinstance(plan, BSPlan) else None
        if got is not None:
            region, plan, self.coarsened_from = got
        super().__init__(region, strategy, plan, *args, **kwargs)
        self._struct = PatternCache(self.region)

    def table(self) -> dict:
        return _table(CONFIGS)

    def _render(self, cdt: str) -> str:
        return render_bsp(self.region, self.plan, cdt)

    def plan_text(self) -> str:
        p = self.plan
        return (f"mixed axis {p.reg} in {p.bs}x{p.bs} blocks ({p.mode}), channel axis {p.block}, "
                f"one program per index of {list(p.scalars)}"
                + (f" (moved last from the caller's layout, permutation {list(self.perm)})" if self.perm else "")
                + (f"; {self.coarsened_from}" if self.coarsened_from else ""))

    def forward(self, inputs):
        return super().forward(self.moved(inputs))

    def forward_train(self, inputs):
        if self.perm is None:
            return super().forward_train(inputs)
        return self.forward(inputs), []          # nothing kept: the backward runs its own scans

    def bucket(self, inputs) -> tuple:
        sizes, L = self.sizes(inputs)
        p = self.plan
        return (tuple(str(x.dtype).replace("torch.", "") for x in inputs), sizes[p.reg],
                min(T._pow2(sizes[p.block]), 4096) if p.block else 1,
                min(T._pow2(math.prod(sizes[a] for a in p.scalars)), 1 << 16))

    def candidates(self, inputs, arch) -> list[dict]:
        sizes, _ = self.sizes(inputs)
        lo = 16 if self.plan.mode == "dot" else 1
        bd = max(lo, T._pow2(sizes[self.plan.block]) if self.plan.block else 1)
        out = []
        for c in self.table()[T.arch_key(arch)]:
            c = {**c, "BLOCK_D": max(lo, min(int(c["BLOCK_D"]), bd))}
            if c not in out:
                out.append(c)
        return out

    def constexprs(self, inputs, config) -> dict:
        sizes, _ = self.sizes(inputs)
        return {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": T._pow2(sizes[self.plan.reg]), "BS": self.plan.bs}

    def launch(self, inputs, config, outs=None) -> list[torch.Tensor]:
        outs = self.outputs(inputs) if outs is None else outs
        sizes, _ = self.sizes(inputs)
        n, bs = sizes[self.plan.reg], self.plan.bs
        cols, cnt, flag = self._structure(inputs, n, bs)
        grid = self.grid(inputs, config)
        cdt = self._cdt(inputs)
        scratch = torch.empty(grid[0] * 2 * config["BLOCK_D"] * T._pow2(n), device=inputs[0].device,
                              dtype=torch.float64 if cdt == "tl.float64" else torch.float32)
        fn = self._fn(self._module(cdt), config["variant"])
        extra = T.launch_options(config, inputs[0].device)
        fn[grid](*self.launch_args(inputs, outs), cols, cnt, scratch, flag, n // bs,
                 **self.constexprs(inputs, config), **extra)
        return outs

    def _structure(self, inputs, n: int, bs: int):
        """(block CSR columns, counts, flag) of the inputs' block pattern (`PatternCache`:
        reused while the tensors it reads are unchanged); the flag is 0 when the compiled mask
        covers the pattern (the unrolled path runs), 1 otherwise (the block-CSR path)."""
        return self._struct.get(inputs, n, bs, lambda bp: (*block_csr(bp), uncovered(bp, self.region.mix, bs,
                                                                                     self._compiled_bp)))

    def signature(self, config: dict, block_n: int = 16, dtypes: dict | None = None):
        fn, sig, _ = super().signature({**config, "CHUNK": 1}, block_n, dtypes)
        del sig["CHUNK"]
        sig.update({"cols_ptr": "*i32", "cnt_ptr": "*i32", "scratch_ptr": "*fp32", "flag_ptr": "*i32", "NB": "i32"})
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": block_n, "BS": self.plan.bs}
        sig.update({k: "constexpr" for k in cx})
        return fn, sig, cx

    def _why_not(self, inputs, sizes: dict, L: int) -> str | None:
        n = sizes[self.plan.reg]
        if n % self.plan.bs:
            return f"the mixed axis has {n} elements, not a multiple of the block size {self.plan.bs}"
        return super()._why_not(inputs, sizes, L)

    def backward_note(self) -> str:
        return self.scans.note("Triton block-sparse")

    @functools.cached_property
    def scans(self):
        """The backward's derived regions (`ssmc.autodiff.chunk_scans`) on kernels like this one."""
        from .mix_adjoint import Scans

        def make(r):
            plan = make_bsp_plan(r)
            if isinstance(plan, str):
                raise ValueError(plan)
            return BlockSparseKernel(r, self.strategy, plan, self.options, self.arch)
        return Scans(make)


def _moves(region: Region) -> bool:
    return region.mix is not None and region.mix_axis != region.axes[-1]


def plan_for(region: Region) -> BSPlan | str:
    """`make_bsp_plan` of the region as the kernel holds it (its mixed axis last, no sums over
    size-1 axes, an odd-sized transition in 1x1 blocks)."""
    return make_bsp_plan(_pow2_blocks((region.mixed_last()[0] if _moves(region) else region).without_unit_sums()))


MAX_ONE_BLOCK = 16      # a transition of up to this many rows held as one block of odd size runs in 1x1 blocks


def _pow2_blocks(r: Region) -> Region:
    """A transition held as one block whose size is not a power of two (an odd-sized state: 3, 5,
    7 ... elements; tl.arange takes powers of two): the same transition in 1x1 blocks, every entry
    nonzero in the compiled mask (the pattern of the actual inputs is read at each call, as
    always). Other regions as they are."""
    m = r.mix
    if m is None or not m.block or not m.block & (m.block - 1) or m.nblocks != 1 or m.block > MAX_ONE_BLOCK:
        return r
    n = m.block
    return dataclasses.replace(r, mix=dataclasses.replace(
        m, block=1, nblocks=n, blocks=tuple((i, j) for i in range(n) for j in range(n)) if m.blocks else ()))


def block_size_for(n: int) -> int | None:
    return next((b for b in BLOCK_SIZES if n % b == 0), None)
