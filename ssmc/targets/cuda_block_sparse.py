"""The ``cuda`` target's kernel for strategy "block_sparse": a recurrence whose transition is a
matrix along the last state axis (h_t = a h + sum_k s_k,t * (W_k h) + b, each W_k shared by
every row), of which only the nonzero blocks are multiplied (templates/cuda/block_sparse_fwd.cu.j2).

Why a kernel of its own: with blocks below 16 the Triton kernel either multiplies and sums
small tiles across lanes (shuffles and layout conversions every step) or pads them to 16x16
tiles for tl.dot (the dense work again when the blocks are scattered). Here a row (one index of
the parallel state axes, e.g. (batch, channel)) is one lane, 32 rows a block, and the state is
split over the block's G warps by block rows of the mask (`groups`: largest first onto the least
loaded warp). Every warp runs the same code: for each of its block rows (work lists in
constant memory, `tables`, read into registers before the time loop) its nonzero column
blocks, as many guarded copies of the block product as the compiled mask's densest row has
(the every-block path: a loop), chains of FMAs with W and the state read from shared memory as
float4 (W at the same address across the warp: a broadcast), then the per-element update. The
state is exchanged through shared memory (double-buffered, one barrier a step; a warp's own
part also stays in registers); readout sums go through shared memory and are finished by the
warps in turn, one step late; the next step's inputs are loaded ahead, a block row's run of a
load along the state (B, C) by one pointer, as vector loads where the runs are contiguous and
aligned (`runs_vectorizable`, checked at every launch; else an instance with scalar loads).
Where the state is fp32 and the mixed axis a multiple of 8, the tensor-core instances of
`cuda_bsp_mma` (16 rows a warp, mma.sync on the nonzero 8x8 tiles) are timed with these and
usually win.

The compiled mask only steers the code: the pattern of the actual inputs is recomputed at every
call (`ssmc.sparsity.PatternCache`) and a device-side flag selects the second work list (every
block) when the compiled mask does not cover it, so the kernel is right for any mask.

What it covers (else `Unsupported`, and the Triton kernel runs): each W_k free of time and of
the parallel axes (a learned A times a mask, I + dt A), the state at most MAX_N along the mixed
axis, outputs that are the state itself or sums of it over the mixed axis, forward time.
Measured on the H200 in benchmarks/NOTES.md. Backward: `ssmc.targets.mix_adjoint`, the adjoint
in chunks with its scans (a chunk's states; lam in reverse time, transposed mask) on kernels of
this class, the gradients by torch ops (as the Triton block-sparse kernel, on Triton's).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch

from ssmc import ir
from ssmc.ir import Const, Load, Op, Reduce, Region, State, factors, product, summands
from ssmc.sparsity import PatternCache, uncovered

from .cuda_printer import CTYPES, Unsupported, _check_expr, const, op_expr
from .triton_block_sparse import _state_outside

log = logging.getLogger("ssmc")

TEMPLATE = "cuda/block_sparse_fwd.cu.j2"
KERNEL_VERSION = "1"
MAX_N = 64              # the state along the mixed axis: W (N*N) and the exchange (2*N*32) in shared memory
SMEM_BUDGET = 44 * 1024   # static shared memory for the matrices and the exchange (48 KB less the sums)
SMEM_STATIC = 48 * 1024   # all the kernel's static shared memory
GROUPS = (2, 4, 8)      # warps per block, each owning some block rows of the mask; timed on first use
SPLIT_GROUPS = (8,)     # ... and with blocks of the heaviest rows moved to the least loaded warps
MAX_PARTS = 8           # blocks moved at most (their partial sums: MAX_PARTS * BS * 32 in shared memory)


@dataclasses.dataclass(frozen=True)
class CudaBSPlan:
    reg: str                     # the mixed axis (last state axis)
    rows: tuple[str, ...]        # parallel axes, flattened into rows (the last one fastest)
    n: int
    bs: int
    blocks: tuple                # compiled nonzero (row block, column block)
    terms: tuple                 # (s, W) pairs: m = sum of s_t (a row factor: no mixed axis, no
                                 # column) times W[i, j] (mixed axis and column only), s distinct
    compute: str                 # "float" | "double"


def bsp_plan(r: Region) -> CudaBSPlan:
    m = r.mix
    if m is None:
        raise Unsupported("no non-diagonal transition")
    if r.reverse:
        raise Unsupported("reverse-time regions are not covered by the cuda kernel yet")
    if r.mix_axis != r.axes[-1]:
        raise Unsupported(f"the transition acts along {r.mix_axis}, not the last state axis")
    if not m.block or not m.nblocks:
        raise Unsupported("the block_sparse pass did not run (no block mask)")
    reg, n = r.axes[-1], m.block * m.nblocks
    if n > MAX_N:
        raise Unsupported(f"the mixed axis has {n} elements, more than {MAX_N} (W and the state exchange "
                          "live in shared memory)")
    rows = tuple(r.axes[:-1])
    rowcol = {reg, ir.MIX_COL}
    if any(isinstance(x, (State, Reduce)) for x in ir.walk(m.expr)):
        raise Unsupported("a reduction or the state inside the transition")
    by_scale: dict = {}
    for sign, term in summands(m.expr):
        fs = factors(term) + ([Const(-1.0)] if sign < 0 else [])
        scale = product([f for f in fs if not ir.axes_of(f, r.axes) & rowcol])
        mat = product([f for f in fs if ir.axes_of(f, r.axes) & rowcol])
        if ir.axes_of(mat, r.axes) & (set(rows) | {"t"}):
            raise Unsupported("the transition's matrix varies along time or a parallel axis (not one W for every row)")
        by_scale[scale] = Op("add", (by_scale[scale], mat)) if scale in by_scale else mat
    compute = "double" if any(s.dtype == "float64" for s in r.inputs) or r.state_dtype == "float64" else "float"
    esize = 8 if compute == "double" else 4
    if (len(by_scale) * n * n + 2 * n * 32) * esize > SMEM_BUDGET:
        raise Unsupported(f"{len(by_scale)} matrices of {n}x{n} do not fit the shared memory")
    for scale, mat in by_scale.items():
        _check_expr(mat, "the transition's matrix", False, False)
        _check_expr(scale, "the transition's row scale", False, False)
    _check_expr(r.decay, "the decay", False, False)
    _check_expr(r.drive, "the drive", False, False)
    for k, o in enumerate(r.outputs):
        _check_expr(o.expr, f"output {k}", True, True)
        if reg in o.index:
            if any(isinstance(x, Reduce) for x in ir.walk(o.expr)):
                raise Unsupported(f"output {k} is per state element and holds a sum")
        else:
            if _state_outside(o.expr):
                raise Unsupported(f"output {k} reads the state outside a sum over {reg}")
            for x in ir.walk(o.expr):
                if isinstance(x, Reduce) and tuple(x.axes) != (reg,):
                    raise Unsupported(f"output {k} sums over {list(x.axes)}, not the mixed axis alone")
            if ir.axes_of(_outside(o.expr), r.axes) & {reg}:
                raise Unsupported(f"output {k} varies along {reg} outside its sum")
        if o.kind == "final" and "t" in ir.axes_of(_outside(o.expr), r.axes):
            raise Unsupported(f"final output {k} reads a per-step input")
    for s in r.inputs:
        if s.dtype not in CTYPES:
            raise Unsupported(f"input {s.name} has dtype {s.dtype}")
    return CudaBSPlan(reg, rows, n, m.block, tuple(m.blocks), tuple(by_scale.items()), compute)


def _outside(e):
    """`e` with each sum replaced by a constant (what varies outside the sums)."""
    if isinstance(e, Reduce):
        return Const(0.0)
    if isinstance(e, Op):
        return Op(e.name, tuple(_outside(a) for a in e.args), e.attrs)
    return e


def groups(plan: CudaBSPlan, blocks, g: int) -> list[list[int]]:
    """Block rows per warp: largest first onto the least loaded warp (cost: nonzero blocks of
    the row, plus one for its own elements), each warp's rows in order."""
    nb = plan.n // plan.bs
    cost = {i: 1 + sum(1 for (r, _) in blocks if r == i) for i in range(nb)}
    bins: list[list[int]] = [[] for _ in range(min(g, nb))]
    load = [0] * len(bins)
    for i in sorted(range(nb), key=lambda i: (-cost[i], i)):
        w = min(range(len(bins)), key=lambda w: (load[w], w))
        bins[w].append(i)
        load[w] += cost[i]
    return [sorted(b) for b in bins]


# -- printing --------------------------------------------------------------------------------------

class _Printer:
    """Expressions as CUDA C statements. `env` maps each axis (and MIX_COL, "t") to C code; a
    subexpression is printed once per distinct value of what it depends on: those free of the
    state and of time go to `pre` (before the time loop), the rest to the section in use.
    Loads at time "t" in the step are loaded one step ahead (`fetch` / `swap`)."""

    def __init__(self, r: Region, prefix: str, bs: int = 0, vec: bool = False):
        self.r, self.prefix, self.bs, self.vec = r, prefix, bs, vec
        self.pre: list[str] = []
        self.lines: list[str] = []
        self.memo: dict = {}
        self.count = 0
        self.fetch: list[tuple] = []               # (v, elements, C type): values loaded one step ahead (r<v>, p<v>, d<v>)
        self.runs: dict = {}                       # (input, index, slot) -> v: a block row's run of a load
        self.run_loads: list = []                  # (input, dim of the mixed axis) of those runs
        self.global_names: set = set()             # declared before the time loop: visible everywhere
        self.outer: list | None = None             # the step's own section, while printing per element

    def section(self, lines: list) -> list:
        """Print into `lines` from now on; values printed in another section are out of scope."""
        self.lines = lines
        self.memo = {k: v for k, v in self.memo.items() if v in self.global_names}
        return lines

    def name(self) -> str:
        self.count += 1
        return f"{self.prefix}{self.count}"

    def _key(self, e, env):
        ax = ir.axes_of(e, self.r.axes) | ({"t"} if "t" in _idx(e) else set())
        return (e, tuple(sorted((a, env[a]) for a in ax if a in env)), env.get("@state") if ir.uses_state(e) else None,
                tuple(sorted((id(k), v) for k, v in env.get("@bind", {}).items())) if _has_reduce(e) else None)

    def expr(self, e, env: dict) -> str:
        if isinstance(e, Const):
            return const(float(e.value))
        if isinstance(e, State):
            return env["@state"]
        if isinstance(e, Reduce):
            return env["@bind"][e]
        key = self._key(e, env)
        if key in self.memo:
            return self.memo[key]
        timed = "t" in _idx(e) or ir.uses_state(e) or _has_reduce(e)
        if isinstance(e, Load):
            code = self._load(e, env)
            if "t" in e.index and env.get("t") == "t" and env.get("@fetch"):
                use = self._fetch(e, env, code)
                self.global_names.add(use)
                self.memo[key] = use
                return use
            code = f"ssmc_cvt({code.replace('{t}', env.get('t', '0'))})"
        else:
            code = op_expr(e, [self.expr(a, env) for a in e.args], False)
        v = self.name()
        where = self.lines if timed else self.pre
        if timed and self.outer is not None and not ir.uses_state(e) \
                and self.r.axes[-1] not in ir.axes_of(e, self.r.axes) and not _has_reduce(e):
            where = self.outer          # free of the mixed axis: once per step, not per element
        where.append(f"const ssmc_t {v} = {code};")
        if not timed:
            self.global_names.add(v)
        self.memo[key] = v
        return v

    def _fetch(self, e: Load, env, code: str) -> str:
        """A load at time t in the step, loaded one step ahead, raw (converted where used, so
        the wait for the load falls in the next step); its pointer walks time by the time
        stride. A load along the mixed axis at a block row's element (env "@elem": slot, element)
        is fetched once for the whole run of BS elements of that block row: one pointer, and a
        vector load where the instance has them (`vec`: the run contiguous and aligned)."""
        ty = CTYPES[self.r.inputs[e.input].dtype]
        st = f"is{e.input}_{e.index.index('t')}"
        reg, el = self.r.axes[-1], env.get("@elem")
        if el is not None and reg in e.index and self.bs:
            q, a = el
            rk = (e.input, e.index, q)
            v = self.runs.get(rk)
            if v is None:
                v = self.runs[rk] = self.name()
                dim = e.index.index(reg)
                se = f"is{e.input}_{dim}"
                at = self._load(e, {**env, reg: f"bq{q} * {self.bs}"})
                self.pre += [f"__align__(16) {ty} r{v}[{self.bs}];",
                             f"ssmc_bsp_fetch<{self.bs}, {int(self.vec)}>(r{v}, &{at.replace('{t}', 't0')}, {se});",
                             f"const {ty}* p{v} = &{at.replace('{t}', 't1')};",
                             f"const long long d{v} = {st}, s{v} = {se};"]
                self.fetch.append((v, self.bs, ty))
                if (e.input, dim) not in self.run_loads:
                    self.run_loads.append((e.input, dim))
            return f"ssmc_bsp_elem(r{v}, {a})"
        v = self.name()
        self.pre += [f"{ty} r{v} = {code.replace('{t}', 't0')};",
                     f"const {ty}* p{v} = &{code.replace('{t}', 't1')};",
                     f"const long long d{v} = {st};"]
        self.fetch.append((v, 0, ty))
        return f"ssmc_cvt(r{v})"

    def _load(self, e: Load, env) -> str:
        terms = []
        for d, ix in enumerate(e.index):
            if ix == 0:
                continue
            at = "{t}" if ix == "t" else env[ix] if isinstance(ix, str) else str(ix)
            terms.append(f"(long long)({at}) * is{e.input}_{d}")
        return f"in{e.input}[{' + '.join(terms) or '0'}]"


def _idx(e) -> set:
    return {ix for ld in ir.loads(e) for ix in ld.index if isinstance(ix, str)}


def _has_reduce(e) -> bool:
    return any(isinstance(x, Reduce) for x in ir.walk(e))


def _reduces(e) -> list:
    out = []
    for x in ir.walk(e):
        if isinstance(x, Reduce) and x not in out:
            out.append(x)
    return out


def _store(r: Region, k: int, o: ir.OutputSpec, env: dict, value: str) -> str:
    terms = []
    for d, ix in enumerate(o.index):
        if ix == 1:
            continue
        at = env["t"] if ix == "t" else env[ix]
        terms.append(f"(long long)({at}) * os{k}_{d}")
    return f"if (live) out{k}[{' + '.join(terms) or '0'}] = ssmc_from<{CTYPES[o.dtype]}>({value});"


def tables(p: CudaBSPlan, ngroups: int, split: bool = False) -> dict:
    """The work lists the kernel reads from constant memory, per path (0: the compiled mask; 1,
    unless that is dense: every block): each warp's block rows (``rows[path][warp][slot]``, -1
    for none), and per block row its column blocks (``cols[path][start[path][i]:start[path][i
    + 1]]``). With `split`, column blocks move from the most to the least loaded warp while the
    loads differ by two or more: the receiving warp multiplies that block (``help[path][warp]
    [h]`` = (row, column, partial slot)) into shared memory before a second barrier, and the
    row's owner adds it (``parts[path][row]``); ``moved`` counts them."""
    nb = p.n // p.bs
    dense = tuple((i, j) for i in range(nb) for j in range(nb))
    paths = [tuple(p.blocks)] + ([dense] if set(p.blocks) != set(dense) else [])
    per = [groups(p, blocks, ngroups) for blocks in paths]
    slots = max(len(g) for rows in per for g in rows)
    rows_t, start_t, cols_t, help_t, parts_t, moved = [], [], [], [], [], []
    for blocks, rows in zip(paths, per):
        rows_t.append([g + [-1] * (slots - len(g)) for g in rows] + [[-1] * slots] * (ngroups - len(rows)))
        row_cols = {i: sorted(j for (r, j) in blocks if r == i) for i in range(nb)}
        helps: list = [[] for _ in range(ngroups)]
        parts: dict = {i: [] for i in range(nb)}
        n_moved = 0
        if split:
            owner_rows = [rows[w] if w < len(rows) else [] for w in range(ngroups)]
            load = [sum(len(row_cols[i]) for i in owner_rows[w]) for w in range(ngroups)]
            while n_moved < MAX_PARTS:
                hi = max(range(ngroups), key=lambda w: (load[w], -w))
                lo = min(range(ngroups), key=lambda w: (load[w], w))
                if load[hi] - load[lo] < 2:
                    break
                i = max(owner_rows[hi], key=lambda i: (len(row_cols[i]), -i))
                j = row_cols[i].pop()
                helps[lo].append((i, j, n_moved))
                parts[i].append(n_moved)
                load[hi] -= 1
                load[lo] += 1
                n_moved += 1
        starts, cols = [0], []
        for i in range(nb):
            cols += row_cols[i]
            starts.append(len(cols))
        start_t.append(starts)
        cols_t.append(cols or [0])
        help_t.append(helps)
        parts_t.append(parts)
        moved.append(n_moved)
    width = max(len(c) for c in cols_t)
    cols_t = [c + [0] * (width - len(c)) for c in cols_t]
    hslots = max([len(h) for helps in help_t for h in helps] + [0])
    pslots = max([len(v) for parts in parts_t for v in parts.values()] + [0])
    help_t = [[h + [(-1, 0, 0)] * (hslots - len(h)) for h in helps] for helps in help_t]
    parts_t = [[parts[i] + [-1] * (pslots - len(parts[i])) for i in range(nb)] for parts in parts_t]
    return {"rows": rows_t, "start": start_t, "cols": cols_t, "slots": slots, "paths": len(paths),
            "help": help_t, "parts": parts_t, "hslots": hslots, "pslots": pslots, "moved": moved,
            "npart": max(moved)}


def f4_state(p: CudaBSPlan) -> bool:
    """Whether W and the exchanged state are read as float4 (hs laid out [N/4][32 lanes][4]: a
    lane's four consecutive elements in one 16-byte word)."""
    return p.compute == "float" and p.n % 4 == 0 and p.bs % 4 == 0


def hs_at(p: CudaBSPlan, buf: str, e: str) -> str:
    """The exchange buffer's slot of state element `e` (C code) for this block's lane."""
    return f"hs[{buf}][({e}) >> 2][lane][({e}) & 3]" if f4_state(p) else f"hs[{buf}][{e}][lane]"


def render_body(r: Region, p: CudaBSPlan, ngroups: int, tab: dict, vec: bool = False) -> tuple[list, list, list, list]:
    """(before the time loop, the step, after it, the run loads): the same code for every
    warp; a warp's block rows and their column blocks come from the tables (`tab`). A
    step: each warp's products (and, with moved blocks, the partial products it does for other
    warps, then a barrier), then its elements' updates. `vec`: the runs of a block row's
    elements along the mixed axis are read with vector loads (the caller checks that they are
    contiguous and aligned); the run loads are (input, dim of the mixed axis)."""
    bs, reg, slots = p.bs, p.reg, tab["slots"]
    nt = len(p.terms)
    pr = _Printer(r, "v", bs, vec)
    st0 = tab["start"][0]
    maxc = max(st0[i + 1] - st0[i] for i in range(len(st0) - 1))   # column blocks of a row in the compiled mask, at most
    base = {a: f"ax_{a}" for a in p.rows}
    head = []
    for q in range(slots):
        head.append(f"const int bi{q} = bsp_rows[P][warp][{q}], bq{q} = bi{q} < 0 ? 0 : bi{q};")
        head += [f"const int e{q}_{a} = bq{q} * {bs} + {a};" for a in range(bs)]
        # the block row's column blocks in the compiled mask, read from the tables once: no
        # constant-memory load (and its latency before the shared-memory loads) in the time loop
        head.append(f"const int zs{q} = bi{q} < 0 ? 0 : bsp_start[P][bi{q}], "
                    f"nc{q} = bi{q} < 0 ? 0 : bsp_start[P][bi{q} + 1] - zs{q};")
        head += [f"const int bj{q}_{i} = nc{q} > {i} ? bsp_cols[P][zs{q} + {i}] : 0;" for i in range(maxc)]
    head += [f"const int pp{q}_{pk} = bi{q} < 0 ? -1 : bsp_parts[P][bi{q}][{pk}];"
             for q in range(slots) for pk in range(tab["pslots"])]
    for h in range(tab["hslots"]):
        head.append(f"const int hb{h} = bsp_help[P][warp][{h}][0], hj{h} = bsp_help[P][warp][{h}][1], "
                    f"hp{h} = bsp_help[P][warp][{h}][2];")
    init = []
    for q in range(slots):
        init.append(f"if (bi{q} >= 0) {{")
        for a in range(bs):
            e = f"e{q}_{a}"
            v = pr.expr(Load(r.init, tuple(r.axes)), {**base, reg: e}) if r.init is not None else "ssmc_t(0)"
            init.append(f"  hq{q}_{a} = {v}; {hs_at(p, '0', e)} = hq{q}_{a};")
        init.append("}")
    init[:0] = [f"ssmc_t {', '.join(f'hq{q}_{a} = ssmc_t(0)' for a in range(bs))};" for q in range(slots)]
    init.append("__syncthreads();")
    # the step
    env0 = {**base, "t": "t", "@fetch": True}
    body = pr.section([])
    scales = [pr.expr(sc, env0) for sc, _ in p.terms]
    nsum = step_sums(r)
    body += [f"ssmc_t ps{k} = ssmc_t(0);" for k in range(nsum)]
    f4 = f4_state(p)
    fma = "fmaf" if p.compute == "float" else "fma"

    def block_products(row: str, col: str, acc, indent: str) -> list[str]:
        """acc(k, a) += W_k[row * BS + a, col * BS + c] * h[col * BS + c], c < BS: a chain of
        FMAs per output (W and h as float4 where the layout has them)."""
        if f4:
            out = [f"{indent}const float4 g{c4} = *reinterpret_cast<const float4*>(&hs[cur][{col} * {bs // 4} + {c4}][lane][0]);"
                   for c4 in range(bs // 4)]
            h = [f"g{c // 4}.{'xyzw'[c % 4]}" for c in range(bs)]
        else:
            out = [f"{indent}const ssmc_t g{c} = {hs_at(p, 'cur', f'{col} * {bs} + {c}')};" for c in range(bs)]
            h = [f"g{c}" for c in range(bs)]
        for k in range(nt):
            for a in range(bs):
                at = f"{k * p.n * p.n} + ({row} * {bs} + {a}) * {p.n} + {col} * {bs}"
                if f4:
                    out.append(f"{indent}{{ const float4* w = reinterpret_cast<const float4*>(Ws + {at});")
                    w = []
                    for c4 in range(bs // 4):
                        out.append(f"{indent}  const float4 w{c4} = w[{c4}];")
                        w += [f"w{c4}.{'xyzw'[c]}" for c in range(4)]
                    chain = acc(k, a)
                    for c in range(bs):
                        chain = f"{fma}({w[c]}, {h[c]}, {chain})"
                    out.append(f"{indent}  {acc(k, a)} = {chain}; }}")
                else:
                    chain = acc(k, a)
                    for c in range(bs):
                        chain = f"{fma}(Ws[{at} + {c}], {h[c]}, {chain})"
                    out.append(f"{indent}{acc(k, a)} = {chain};")
        return out
    products, helpers, slot_code = [], [], []
    for q in range(slots):
        products.append(f"ssmc_t {', '.join(f'a{q}_{k}_{a} = ssmc_t(0)' for k in range(nt) for a in range(bs))};")
        acc = lambda k, a, q=q: f"a{q}_{k}_{a}"
        if tab["paths"] > 1:
            products.append("if (P == 0) {")
        for i in range(maxc):
            products.append(f"  if (nc{q} > {i}) {{")
            products += block_products(f"bq{q}", f"bj{q}_{i}", acc, "    ")
            products.append("  }")
        if tab["paths"] > 1:        # every block (the inputs' pattern is not covered): a loop
            products.append("} else {")
            products.append(f"  for (int z = zs{q}; z < zs{q} + nc{q}; ++z) {{")
            products.append("    const int bj = bsp_cols[P][z];")
            products += block_products(f"bq{q}", "bj", acc, "    ")
            products += ["  }", "}"]
    for h in range(tab["hslots"]):          # blocks moved here from a more loaded warp
        helpers.append(f"if (hb{h} >= 0) {{")
        helpers += [f"  ssmc_t {', '.join(f'm{k}_{a} = ssmc_t(0)' for k in range(nt) for a in range(bs))};"]
        helpers += block_products(f"hb{h}", f"hj{h}", lambda k, a: f"m{k}_{a}", "  ")
        helpers += [f"  pacc[hp{h}][{k}][{a}][lane] = m{k}_{a};" for k in range(nt) for a in range(bs)]
        helpers.append("}")
    if tab["npart"]:
        helpers.append("__syncthreads();    // the moved blocks' partial products are in pacc")
    for q in range(slots):
        lines = [f"if (bi{q} >= 0) {{"]
        for pk in range(tab["pslots"]):
            lines.append(f"  if (pp{q}_{pk} >= 0) {{ " + " ".join(f"a{q}_{k}_{a} += pacc[pp{q}_{pk}][{k}][{a}][lane];"
                                                           for k in range(nt) for a in range(bs)) + " }")
        inner = []
        pr.lines, pr.outer = inner, body
        for a in range(bs):
            e = f"e{q}_{a}"
            env = {**env0, reg: e, "@elem": (q, a)}
            inner.append(f"const ssmc_t o{a} = hq{q}_{a};       // the warp's own state stays in registers")
            terms = []
            if not (isinstance(r.decay, Const) and r.decay.value == 0):
                terms.append(f"{pr.expr(r.decay, env)} * o{a}")
            if not (isinstance(r.drive, Const) and r.drive.value == 0):
                terms.append(pr.expr(r.drive, env))
            for k, sc in enumerate(scales):
                terms.append(f"a{q}_{k}_{a}" if sc == const(1.0) else f"{sc} * a{q}_{k}_{a}")
            inner.append(f"const ssmc_t n{a} = {' + '.join(terms) or 'ssmc_t(0)'};")
            inner.append(f"hq{q}_{a} = n{a};")
            if not f4:
                inner.append(f"{hs_at(p, 'cur ^ 1', e)} = n{a};")
            elif a % 4 == 3:        # four elements at once
                inner.append(f"*reinterpret_cast<float4*>(&hs[cur ^ 1][bq{q} * {bs // 4} + {a // 4}][lane][0]) = "
                             f"make_float4({', '.join(f'n{a - 3 + i}' for i in range(4))});")
            senv = {**env, "@state": f"n{a}"}
            k_sum = 0
            for k, o in enumerate(r.outputs):
                if o.kind != "steps":
                    continue
                if reg in o.index:
                    inner.append(_store(r, k, o, senv, pr.expr(o.expr, senv)))
                    continue
                for red in _reduces(o.expr):
                    inner.append(f"ps{k_sum} += {pr.expr(red.arg, senv)};")
                    k_sum += 1
        pr.outer = None             # (each element's values have keys of their own: no false reuse)
        lines += ["  " + x for x in inner] + ["}"]
        pr.lines = body
        slot_code += lines
    fin = pr.section([])
    finish = _finish_steps(r, p, pr, base, ngroups, "to")
    pr.section(body)
    fetch, swap = [], []
    for v, run, ty in pr.fetch:
        if run:
            fetch.append(f"__align__(16) {ty} x{v}[{run}]; ssmc_bsp_fetch<{run}, {int(vec)}>(x{v}, p{v}, s{v});")
            swap += [f"r{v}[{a}] = x{v}[{a}];" for a in range(run)]
        else:
            fetch.append(f"const auto x{v} = *p{v};")
            swap.append(f"r{v} = x{v};")
    fetch += [f"if (s + 2 < L) {{ {' '.join(f'p{v} += d{v};' for v, _, _ in pr.fetch)} }}"] if pr.fetch else []
    step = (fetch + [f"if (s > 0 && (s - 1) % {ngroups} == warp) {{", "  const int to = s - 1;",
                     "  const int pb = cur ^ 1;"] + ["  " + x for x in fin + finish] + ["}"]
            + body + products + helpers + slot_code + [f"red[{k}][cur][warp][lane] = ps{k};" for k in range(nsum)]
            + swap)
    # after the loop: the last step's outputs, then the final ones (warp 0, the whole state)
    post = [f"if (L > 0 && (L - 1) % {ngroups} == warp) {{", "  const int to = L - 1;",
            "  const int pb = (L - 1) & 1;"]
    last = pr.section([])
    post += ["  " + x for x in last + _finish_steps(r, p, pr, base, ngroups, "to")] + ["}"]
    finals = [o for o in r.outputs if o.kind == "final"]
    if finals:
        fl = pr.section([])
        fl += [f"const ssmc_t hf{e} = {hs_at(p, 'L & 1', str(e))};" for e in range(p.n)]
        fenv = {**base, "t": "0"}
        for k, o in enumerate(r.outputs):
            if o.kind != "final":
                continue
            if reg in o.index:
                for e in range(p.n):
                    env = {**fenv, reg: str(e), "@state": f"hf{e}"}
                    fl.append(_store(r, k, o, env, pr.expr(o.expr, env)))
                continue
            bind = {}
            for red in _reduces(o.expr):
                parts = [pr.expr(red.arg, {**fenv, reg: str(e), "@state": f"hf{e}"}) for e in range(p.n)]
                bind[red] = "(" + " + ".join(parts) + ")"
            env = {**fenv, "@bind": bind}
            fl.append(_store(r, k, o, env, pr.expr(o.expr, env)))
        post += ["if (warp == 0) {"] + ["  " + x for x in fl] + ["}"]
    return head + pr.pre + init, step, post, pr.run_loads


def _finish_steps(r: Region, p: CudaBSPlan, pr: _Printer, base: dict, ngroups: int, tvar: str) -> list[str]:
    """Statements that finish the per-step outputs summed over the mixed axis, for the step
    at time `tvar`, from the warps' partial sums in red[.][pb]."""
    out, q = [], 0
    env = {**base, "t": tvar}
    for k, o in enumerate(r.outputs):
        if o.kind != "steps" or p.reg in o.index:
            continue
        bind = {}
        for red in _reduces(o.expr):
            bind[red] = "(" + " + ".join(f"red[{q}][pb][{w}][lane]" for w in range(ngroups)) + ")"
            q += 1
        e = {**env, "@bind": bind}
        out.append(_store(r, k, o, e, pr.expr(o.expr, e)))
    return out


def step_sums(r: Region) -> int:
    """How many sums over the mixed axis the per-step outputs hold (the red buffers)."""
    reg = r.axes[-1]
    return sum(len(_reduces(o.expr)) for o in r.outputs if o.kind == "steps" and reg not in o.index)


@dataclasses.dataclass(frozen=True)
class Rendered:
    groups: int
    kname: str
    source: str
    params: tuple        # (kind, source) per kernel parameter, in order
    run_loads: tuple = ()   # (input, dim of the mixed axis): loads read as a block row's run


def kernel_params(r: Region, p: CudaBSPlan) -> tuple[list[str], list[tuple]]:
    """(C declarations, (kind, source) per parameter): the inputs and outputs with their strides,
    the sizes of the parallel axes, L, the row count and the coverage flag (every instance)."""
    params, decls = [], []
    for k, s in enumerate(r.inputs):
        decls.append(f"const {CTYPES[s.dtype]}* __restrict__ in{k}")
        params.append(("ptr", ("in", k)))
        for d in range(s.ndim):
            decls.append(f"long long is{k}_{d}")
            params.append(("i64", ("in_stride", k, d)))
    for k, o in enumerate(r.outputs):
        decls.append(f"{CTYPES[o.dtype]}* __restrict__ out{k}")
        params.append(("ptr", ("out", k)))
        for d in range(len(o.index)):
            decls.append(f"long long os{k}_{d}")
            params.append(("i64", ("out_stride", k, d)))
    for a in p.rows:
        decls.append(f"long long sz_{a}")
        params.append(("i64", ("size", a)))
    decls += ["int L", "long long rows", "const int* __restrict__ flag"]
    params += [("i32", ("L",)), ("i64", ("rows",)), ("ptr", ("flag",))]
    return decls, params


def render(r: Region, p: CudaBSPlan, ngroups: int, split: bool = False, vec: bool = False) -> Rendered:
    from .cuda import jinja_env
    kname = ("ssmc_bsp_" + "".join(ch if ch.isalnum() else "_" for ch in r.name)
             + f"_g{ngroups}{'s' if split else ''}{'v' if vec else ''}")
    tab = tables(p, ngroups, split)
    pre, step, post, run_loads = render_body(r, p, ngroups, tab, vec)
    fill = _Printer(r, "w")
    wv = [fill.expr(mat, {p.reg: "fi", ir.MIX_COL: "fc"}) for _, mat in p.terms]
    nred = step_sums(r)
    decls, params = kernel_params(r, p)
    decomp = []
    for a in reversed(p.rows):
        decomp.append(f"const long long ax_{a} = rr % sz_{a}; rr /= sz_{a};")
    src = jinja_env().get_template(TEMPLATE).render(
        region_name=r.name, region_text=str(r), compute=p.compute, n=p.n, groups=ngroups,
        params=decls, args=[d.split()[-1] for d in decls], decomp=decomp,
        fill_pre=fill.pre + fill.lines, fill_value=wv, nred=nred, nblocks=len(p.blocks), bs=p.bs,
        kname=kname, tab=tab, pre=pre, step=step, post=post, nterms=len(p.terms), f4=f4_state(p),
        min_blocks=2 if ngroups >= 8 else 1)    # 8 warps: 128 registers, so two blocks fit an SM
    return Rendered(ngroups, kname, src, tuple(params), tuple(run_loads))


# -- the kernel ------------------------------------------------------------------------------------

class CudaBlockSparseKernel:
    """The CUDA block-sparse forward of one region; the first call per shape times each choice and
    keeps the fastest. A choice is (warps, variant): variant False, a lane per row (GROUPS warps,
    the state split over them), True, the same with blocks moved off the heaviest rows
    (SPLIT_GROUPS), or "m<D>", tensor cores (cuda_bsp_mma: 16 rows a warp, loads D steps ahead;
    where `mma_unsupported` allows, on sm_80 and later). `force_groups` fixes one (an int: warps,
    variant False). An instance adds what the inputs decide at each call: (warps, variant, vector
    loads, rows sharing loads). ``last_launch`` says which ran (its "split" is the variant);
    whether the compiled mask covered the inputs is decided on the device."""
    kind = "block-sparse recurrence (CUDA)"

    def __init__(self, region: Region, p: CudaBSPlan, cache, extra_flags=()):
        from ssmc.targets.reference import ReferenceKernel
        self.region, self.plan, self.cache, self.extra_flags = region, p, cache, tuple(extra_flags)
        self.poison = False
        self.force_groups: int | tuple | None = None
        self.last_launch: dict | None = None
        self.timings: dict = {}
        self._reference = ReferenceKernel(region)
        self._rendered: dict = {}
        self._functions: dict = {}
        self._streams: dict = {}
        self._picked: dict = {}
        self._pattern = PatternCache(region)
        self._compiled_bp: dict = {}
        self._choices: list | None = None
        self.arch: int | None = None          # the device's sm_XX once known (tensor cores: 80 and later)
        from .cuda_bsp_mma import mma_unsupported
        self.mma_why = mma_unsupported(region, p)

    def choices(self) -> list[tuple[int, bool | str]]:
        """(warps, variant) keys, computed once: split only where a block moves and its partial
        sums fit the shared memory; the tensor-core ones where they cover the plan and the device."""
        from .cuda_bsp_mma import DEPTHS, PIPES, SPLITS, WARPS, _variant, pipe_fits, split_fits
        if self._choices is None:
            p, nb = self.plan, self.plan.n // self.plan.bs
            out = [(g, False) for g in sorted({min(g, nb) for g in GROUPS})]
            for g in sorted({min(g, nb) for g in SPLIT_GROUPS}):
                tab = tables(p, g, True)
                esize = 8 if p.compute == "double" else 4
                smem = (len(p.terms) * p.n * p.n + 2 * p.n * 32 + step_sums(self.region) * 2 * g * 32
                        + tab["npart"] * len(p.terms) * p.bs * 32) * esize
                if tab["moved"][0] and smem <= SMEM_STATIC:
                    out.append((g, True))
            if self.mma_why is None:
                out += [(w, f"m{d}") for w in WARPS for d in DEPTHS]
                out += [c for c in SPLITS if split_fits(self.region, p, _variant(c[1])[1])]
                out += [c for c in PIPES if pipe_fits(self.region, p, c[1])]
            self._choices = out
        return [c for c in self._choices if not _is_mma(c) or self.arch is None or self.arch >= 80]

    def instance(self, c, inputs=None) -> tuple:
        """The full key of choice `c` for these inputs (None: contiguous, rows sharing loads)."""
        g, variant = _choice(c)[:2]
        mma = _is_mma(c)
        if inputs is None:
            return (g, variant, True, mma and bool(self.plan.rows))
        vec = runs_vectorizable(inputs, self.rendered((g, variant)).run_loads, 2 if mma else self.plan.bs)
        shared = False
        if mma and self.plan.rows:
            ax, d = dict(zip(self.region.axes, self.region.axis_size))[self.plan.rows[-1]]
            shared = int(inputs[ax].shape[d]) % 16 == 0
        return (g, variant, vec, shared)

    def rendered(self, key) -> Rendered:
        """The source of an instance: (warps, variant[, vector loads[, rows sharing loads]])."""
        key = _choice(key)
        if key not in self._rendered:
            g, variant, vec, shared = key
            if _is_mma(key):
                from .cuda_bsp_mma import _variant, render_mma
                depth, split, page = _variant(variant)
                self._rendered[key] = render_mma(self.region, self.plan, g, depth, vec, shared, split, page)
            else:
                self._rendered[key] = render(self.region, self.plan, g, variant, vec)
        return self._rendered[key]

    @property
    def source(self) -> str:
        last = self.last_launch
        g = last["key"] if last else self.choices()[0]
        return self.rendered(g).source

    def describe(self) -> str:
        p = self.plan
        text = (f"mixed axis {p.reg} in {p.bs}x{p.bs} blocks, {len(p.blocks)}/{(p.n // p.bs) ** 2} compiled "
                f"nonzero, rows over {list(p.rows)}: a lane each, 32 a block, the state split over warps by block rows; "
                + ("or 16 a warp on tensor cores (tf32 x3)" if self.mma_why is None else f"no tensor cores: {self.mma_why}"))
        if self.mma_why is None:
            from .cuda_bsp_mma import pipeline
            stages = pipeline(p)
            text += (f"; as a two-warp pipeline, 8-column state tiles {stages[0]} upstream of {stages[1]}" if stages
                     else "; no pipeline (no split of the 8-column tiles with one part reading nothing of the other)")
        if self.timings:
            text += "; warps per block timed (s: blocks moved between warps): " + ", ".join(
                f"{_label(c)}: {ms:.3f} ms" for c, ms in sorted(self.timings.items(), key=str))
        return text

    def built(self, g, arch: int) -> bytes:
        from ssmc import __version__
        from ssmc.runtime.cache import cache_key
        from .cuda import CudaCompileError, _CompileFailed, _write_text, include_dirs, nvrtc_compile, nvrtc_version
        rend = self.rendered(g)
        key = cache_key("ssmc-cuda-bsp", KERNEL_VERSION, rend.source, arch, nvrtc_version(), __version__,
                        " ".join(self.extra_flags), " ".join(include_dirs()))
        for fmt in ("cubin", "ptx"):
            data = self.cache.get(key, f"kernel.{fmt}")
            if data is not None:
                return data
        path = _write_text(self.cache.path_of(key, "kernel.cu"), rend.source)
        t0 = time.perf_counter()
        try:
            binary, fmt, _, _ = nvrtc_compile(rend.source, arch, f"{rend.kname}.cu", self.extra_flags)
        except _CompileFailed as e:
            raise CudaCompileError(f"NVRTC {nvrtc_version()} ({e.status}) failed to compile {rend.kname} for "
                                   f"sm_{arch}\n  source: {path}\n  options: {' '.join(e.opts)}\n"
                                   f"  log:\n{e.log[:6000]}") from None
        self.cache.put(key, f"kernel.{fmt}", binary)
        log.info("ssmc: NVRTC compiled %s for sm_%d in %.2f s (%s)", rend.kname, arch, time.perf_counter() - t0, path)
        return binary

    # -- running ----------------------------------------------------------------------------------
    walks_back = True           # forward(..., backwards=) runs time backwards without copies (`run`)

    def forward(self, inputs, backwards=None, out=None):
        from .cuda import device_arch
        idx, arch = device_arch(inputs)
        self.arch = arch
        return self.run(inputs, functools.partial(self._launch, idx, arch), timer=_cuda_timer,
                        prebuild=functools.partial(self._prebuild, arch), backwards=backwards, out=out)

    def _prebuild(self, arch: int, choices):
        """NVRTC builds of every warp count at once (seconds each; NVRTC runs in parallel)."""
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(choices)) as pool:
            list(pool.map(lambda g: self.built(g, arch), choices))

    def backward(self, inputs, grads, needs):
        from .mix_adjoint import backward
        return backward(self.region, inputs, grads, needs, self.scans)

    def backward_note(self) -> str:
        return self.scans.note("CUDA block-sparse")

    @functools.cached_property
    def scans(self):
        """The backward's derived regions (`ssmc.autodiff.chunk_scans`) on kernels like this one."""
        from .mix_adjoint import Scans
        return Scans(lambda r: CudaBlockSparseKernel(r, bsp_plan(r), self.cache, self.extra_flags))

    def run(self, inputs, launch, timer=None, prebuild=None, backwards=None, out=None):
        """Outputs, the coverage flag and the arguments; ``launch(groups, grid, block, args)``
        with args as (kind, value), kind "ptr" | "i64" | "i32". `timer(fn) -> ms` times each warp
        count on the first call of a shape (without one: the first choice).

        ``backwards`` ({input: its time dim}): the recurrence runs from the last step to the
        first, as on inputs flipped in time, with no copy: those inputs and the per-step outputs
        are passed as pointers to their last step with the time stride negated, so step s reads
        and writes index L-1-s. ``out``: tensors the outputs are written into (each of the
        output's shape and dtype) instead of new ones."""
        r, p = self.region, self.plan
        for i, (x, s) in enumerate(zip(inputs, r.inputs)):
            if ir.dtype_name(x.dtype) != s.dtype:
                raise TypeError(f"input {i} ({s.name}) is {x.dtype}; the kernel was generated for {s.dtype}")
        sizes = {a: int(inputs[i].shape[d]) for a, (i, d) in zip(r.axes, r.axis_size)}
        if sizes[p.reg] != p.n:
            raise ValueError(f"the mixed axis {p.reg} has {sizes[p.reg]} elements; the kernel was compiled for {p.n}")
        L = int(inputs[r.length[0]].shape[r.length[1]])
        if L == 0:
            got = self._reference.forward(inputs)
            return got if out is None else [o.copy_(g) for o, g in zip(out, got)]
        if L >= 2**31 - 1:
            raise ValueError(f"sequence length {L} beyond the kernel's int32 time index")
        dev = inputs[0].device
        outs = []
        for k, o in enumerate(r.outputs):
            shape = tuple(L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index)
            dt = ir.to_dtype(o.dtype)
            if out is not None:
                if tuple(out[k].shape) != shape or out[k].dtype != dt:
                    raise ValueError(f"out[{k}] is {tuple(out[k].shape)} {out[k].dtype}; output {k} of "
                                     f"region {r.name} is {shape} {dt}")
                outs.append(out[k].fill_(float("nan")) if self.poison else out[k])
                continue
            outs.append(torch.full(shape, float("nan"), dtype=dt, device=dev) if self.poison
                        else torch.empty(shape, dtype=dt, device=dev))
        back_in = dict(backwards or {})
        back_out = {k: o.index.index("t") for k, o in enumerate(r.outputs) if backwards and "t" in o.index}
        for k, d in back_in.items():
            if inputs[k].shape[d] != L:
                raise ValueError(f"backwards: input {k} ({r.inputs[k].name}) has {inputs[k].shape[d]} steps "
                                 f"along dim {d}, the region runs {L}")

        def last_step(x, d):        # the address of x's last step along d (its first when walking back)
            return x.data_ptr() + (x.shape[d] - 1) * x.stride(d) * x.element_size()
        rows = 1
        for a in p.rows:
            rows *= sizes[a]
        if rows == 0:
            return outs
        flag = self._pattern.get(inputs, p.n, p.bs, lambda bp: uncovered(bp, r.mix, p.bs, self._compiled_bp))
        args = []
        for kind, src in self.rendered(self.choices()[0]).params:     # the same in every instance
            if src[0] == "in":
                k = src[1]
                v = last_step(inputs[k], back_in[k]) if k in back_in else inputs[k].data_ptr()
            elif src[0] == "in_stride":
                v = inputs[src[1]].stride(src[2]) * (-1 if back_in.get(src[1], -1) == src[2] else 1)
            elif src[0] == "out":
                k = src[1]
                v = last_step(outs[k], back_out[k]) if k in back_out else outs[k].data_ptr()
            elif src[0] == "out_stride":
                v = outs[src[1]].stride(src[2]) * (-1 if back_out.get(src[1], -1) == src[2] else 1)
            elif src[0] == "size":
                v = sizes[src[1]]
            elif src[0] == "flag":
                v = flag.data_ptr()
            else:
                v = {"L": L, "rows": rows}[src[0]]
            args.append((kind, int(v)))
        inst = {c: self.instance(c, inputs) for c in self.choices()}
        grid = lambda c: -(-(-(-rows // 16)) // _tiles_a_block(c)) if _is_mma(c) else -(-rows // 32)
        bucket = (rows, 1 << L.bit_length(), tuple(str(x.dtype) for x in inputs), tuple(inst.values()))
        g = _choice(self.force_groups)[:2] if self.force_groups else self._picked.get(bucket)
        if g is None:
            g = self.choices()[0]
            if timer is not None and len(self.choices()) > 1:
                if prebuild is not None:
                    prebuild(list(inst.values()))
                for c in self.choices():
                    self.timings[c] = timer(lambda c=c: launch(inst[c], grid(c), 32 * c[0], args))
                g = min(self.timings, key=self.timings.get)
                log.info("ssmc: region %s: block-sparse kernel, choices timed %s; %s kept", r.name,
                         ", ".join(f"{_label(c)}: {ms:.3f} ms" for c, ms in sorted(self.timings.items(), key=str)),
                         _label(g))
            self._picked[bucket] = g
        key = inst.get(g) or self.instance(g, inputs)
        launch(key, grid(g), 32 * g[0], args)
        self.last_launch = {"groups": g[0], "split": g[1], "vec": key[2], "shared_rows": key[3], "key": key,
                            "grid": grid(g), "block": 32 * g[0], "rows": rows}
        return outs

    def _launch(self, idx: int, arch: int, g, grid: int, block: int, args):
        import cupy
        from .cuda import _ARG_TYPES
        conv = _ARG_TYPES()
        values = tuple(conv[k](v) for k, v in args)
        stream_ptr = torch.cuda.current_stream(idx).cuda_stream
        with cupy.cuda.Device(idx):
            fn = self._functions.get((idx, g))
            if fn is None:
                mod = cupy.cuda.function.Module()
                mod.load(self.built(g, arch))
                fn = self._functions[(idx, g)] = mod.get_function(self.rendered(g).kname)   # keeps mod alive
            s = self._streams.get((idx, stream_ptr))
            if s is None:
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    s = self._streams[(idx, stream_ptr)] = cupy.cuda.ExternalStream(stream_ptr, idx)
            fn((grid, 1, 1), (block, 1, 1), values, stream=s)


def _choice(key) -> tuple:
    """(warps, variant, vector loads, rows sharing loads) of a key: an int (warps), or a tuple of
    its first two, three or four; the lane-per-row instances never share rows."""
    key = (key,) if isinstance(key, int) else tuple(key)
    key = key + (False,) * (4 - len(key))
    return key if _is_mma(key) else key[:3] + (False,)


def _tiles_a_block(key) -> int:
    """16-row tiles a block of a tensor-core instance: its warps over the warps a tile."""
    from .cuda_bsp_mma import _variant
    return key[0] // _variant(key[1])[1]


def _is_mma(key) -> bool:
    return not isinstance(key, int) and len(key) > 1 and isinstance(key[1], str)


def _label(key) -> str:
    g, variant, vec, shared = _choice(key)
    mode = variant if isinstance(variant, str) else "s" if variant else ""
    return f"{g}{mode}{'v' if vec else ''}{'r' if shared else ''}"


def vec_bytes(bs: int, esize: int) -> int:
    """The vector a block row's run of `bs` elements is read with (ssmc_vec_bytes in the prelude)."""
    b = bs * esize
    return 16 if b % 16 == 0 else 8 if b % 8 == 0 else 4 if b == 4 else 0


def runs_vectorizable(inputs, run_loads, bs: int) -> bool:
    """Whether every run load can be a vector load for any row, step and block row: stride 1 along
    the mixed axis, the base pointer and every other stride of more than one element aligned."""
    for k, dim in run_loads:
        x = inputs[k]
        vb = vec_bytes(bs, x.element_size())
        if vb == 0:
            continue
        if x.stride(dim) != 1 or x.data_ptr() % vb:
            return False
        if any(x.size(d) > 1 and (x.stride(d) * x.element_size()) % vb for d in range(x.dim()) if d != dim):
            return False
    return True


def _cuda_timer(fn, reps: int = 3) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
