"""The block-sparse forward on tensor cores (templates/cuda/block_sparse_mma_fwd.cu.j2): the
instances of ``CudaBlockSparseKernel`` whose variant is "m<D>" (D: how many steps ahead the loads
are issued).

The transition's products sum_k s_k (W_k h) are, for 16 rows at once, a [16 x n] by [n x n]
matrix product with the same W_k for every row: mma.m16n8k8 in tf32, one per nonzero 8x8 tile of
W_k, three per tile for fp32 accuracy (3xTF32: the small cross terms first). A warp holds 16 rows
by the whole state in registers, in the accumulator layout, which (the columns of each tile
permuted, W's fragments alike) is also the A-operand layout, so a step moves nothing between lanes
or warps: no shared-memory exchange, no barrier. Blocks of any size are covered by the 8x8 tiles
they touch (a 16x16 block is four tiles, a 4x4 block shares a tile with its neighbours).

What it covers, beyond `bsp_plan` (else `mma_unsupported` says why and only the lane-per-row
instances are timed): fp32 state, the mixed axis a multiple of 8 up to 64, W's fragments of every
tile of every term in shared memory (the every-tile path needs them), sm_80 or later.
"""
from __future__ import annotations

from ssmc import ir
from ssmc.ir import Const, Load

from .cuda_block_sparse import CudaBSPlan, Rendered, _Printer, _reduces, kernel_params
from .cuda_printer import CTYPES, const

TEMPLATE = "cuda/block_sparse_mma_fwd.cu.j2"
WARPS = (1, 4)            # warps a block (16 rows each): the choices timed on first use
DEPTHS = (2, 4)           # steps ahead the loads are issued
SMEM_W = 40 * 1024        # W's fragments: terms * tiles * 32 lanes * 16 bytes
HOIST_TILES = 16          # up to this many tiles, W's fragments may stay in registers across steps
PREFETCH = 8             # steps ahead of the L2 prefetch hints
U = "@U@"                 # the unrolled step's slot in the load rings, replaced per copy


def mma_unsupported(r: ir.Region, p: CudaBSPlan) -> str | None:
    """Why the tensor-core instances do not cover a plan (None: they do)."""
    if p.compute != "float":
        return "the state is float64 (tf32 tensor cores hold fp32 accuracy only)"
    if p.n % 8 or p.n > 64:
        return f"the mixed axis has {p.n} elements (8x8 tiles, up to 64)"
    nb = p.n // 8
    if len(p.terms) * nb * nb * 32 * 16 > SMEM_W:
        return f"{len(p.terms)} matrices of {p.n}x{p.n} do not fit the shared memory as fragments"
    return None


def tiles_of(p: CudaBSPlan, blocks) -> list[tuple[int, int]]:
    """The 8x8 tiles (row, column) that the blocks touch, in order."""
    out = set()
    for bi, bj in blocks:
        for a in range(bi * p.bs // 8, ((bi + 1) * p.bs - 1) // 8 + 1):
            for c in range(bj * p.bs // 8, ((bj + 1) * p.bs - 1) // 8 + 1):
                out.add((a, c))
    return sorted(out)


class _MmaPrinter(_Printer):
    """Loads at time t are issued D steps ahead into rings r<v>[D] (slot U of the unrolled step);
    a load along the mixed axis is fetched for the lane's 2 * NB columns at once (one pointer at
    column 2q)."""

    def __init__(self, r, nb: int, vec: bool):
        super().__init__(r, "v", 0, vec)
        self.nb = nb

    def _fetch(self, e: Load, env, code: str) -> str:
        ty = CTYPES[self.r.inputs[e.input].dtype]
        st = f"is{e.input}_{e.index.index('t')}"
        reg, el = self.r.axes[-1], env.get("@elem")
        if el is not None and reg in e.index:
            j, c = el
            others = tuple(env[ix] for ix in e.index if isinstance(ix, str) and ix not in (reg, "t"))
            rk = (e.input, e.index, others)
            v = self.runs.get(rk)
            if v is None:
                v = self.runs[rk] = self.name()
                dim = e.index.index(reg)
                at = self._load(e, {**env, reg: "cq"}).replace("{t}", "0")
                self.pre += [f"__align__(16) {ty} r{v}[SSMC_D][{2 * self.nb}];",
                             f"const {ty}* p{v} = &{at};", f"const long long d{v} = {st}, s{v} = is{e.input}_{dim};"]
                self.fetch.append((v, 2 * self.nb, ty))
                if (e.input, dim) not in self.run_loads:
                    self.run_loads.append((e.input, dim))
            return f"ssmc_bsp_elem(r{v}[{U}], {2 * j + c})"
        v = self.name()
        self.pre += [f"{ty} r{v}[SSMC_D];", f"const {ty}* p{v} = &{code.replace('{t}', '0')};",
                     f"const long long d{v} = {st};"]
        self.fetch.append((v, 0, ty))
        return f"ssmc_cvt(r{v}[{U}])"


def _store(r, k: int, o, env: dict, value: str, cond: str) -> str:
    terms = []
    for d, ix in enumerate(o.index):
        if ix == 1:
            continue
        at = env["t"] if ix == "t" else env[ix]
        terms.append(f"(long long)({at}) * os{k}_{d}")
    return f"if ({cond}) out{k}[{' + '.join(terms) or '0'}] = ssmc_from<{CTYPES[o.dtype]}>({value});"


def _tree(terms: list[str]) -> str:
    """A sum as chains of four (each contracted to FMAs where the terms are products) added
    pairwise: a short dependency chain."""
    parts = ["(" + " + ".join(terms[i:i + 4]) + ")" for i in range(0, len(terms), 4)]
    while len(parts) > 1:
        parts = [f"({parts[i]} + {parts[i + 1]})" if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0] if parts else "ssmc_t(0)"


def _elems(nb: int):
    """(tile j, column e, row slot m, accumulator index) of a lane's 4 * nb state elements."""
    return [(j, e, m, 2 * m + e) for j in range(nb) for m in (0, 1) for e in (0, 1)]


def render_mma(r: ir.Region, p: CudaBSPlan, warps: int, depth: int, vec: bool = False,
               shared: bool = False) -> Rendered:
    """The instance: `vec` the pairs along the mixed axis read as one load each (the caller checks
    contiguity and alignment), `shared` the two rows of a lane differ only in the last parallel axis
    (its size a multiple of 16: loads free of that axis are shared between them)."""
    from .cuda import jinja_env
    nb = p.n // 8
    reg = p.reg
    kname = ("ssmc_bspm_" + "".join(ch if ch.isalnum() else "_" for ch in r.name)
             + f"_w{warps}d{depth}{'v' if vec else ''}{'s' if shared else ''}")
    pr = _MmaPrinter(r, nb, vec)
    last = p.rows[-1] if p.rows else None
    slot_env = []
    for m in (0, 1):
        env = {a: (f"ax_{a}_0" if shared and a != last else f"ax_{a}_{m}") for a in p.rows}
        slot_env.append({**env, "t": "t", "@fetch": True})
    decomp = []
    for m in (0, 1):
        for a in reversed(p.rows):
            if shared and m == 1 and a != last:
                continue
            decomp.append(f"const long long ax_{a}_{m} = rr{m} % sz_{a}; rr{m} /= sz_{a};")

    def elem_env(j, e, m, extra=None):
        return {**slot_env[m], reg: f"(cq + {8 * j + e})", "@elem": (j, e), **(extra or {})}

    # initial state
    init = [f"ssmc_t h[{nb}][4];"]
    for j, e, m, c in _elems(nb):
        if r.init is not None:
            env = {**elem_env(j, e, m), "t": "0", "@fetch": False}
            init.append(f"h[{j}][{c}] = {pr.expr(Load(r.init, tuple(r.axes)), env)};")
        else:
            init.append(f"h[{j}][{c}] = ssmc_t(0);")
    # the step, once; copied per slot U of the ring
    body = pr.section([])
    scales = [[pr.expr(sc, slot_env[m]) for m in (0, 1)] for sc, _ in p.terms]
    acc = [f"ssmc_t acc[{nb}][4];"]
    pr.lines, pr.outer = acc, body
    for j, e, m, c in _elems(nb):
        env = {**elem_env(j, e, m), "@state": f"h[{j}][{c}]"}
        terms = []
        if not (isinstance(r.decay, Const) and r.decay.value == 0):
            d = pr.expr(r.decay, env)
            terms.append(f"h[{j}][{c}]" if d == const(1.0) else f"{d} * h[{j}][{c}]")
        if not (isinstance(r.drive, Const) and r.drive.value == 0):
            terms.append(pr.expr(r.drive, env))
        acc.append(f"acc[{j}][{c}] = {' + '.join(terms) or 'ssmc_t(0)'};")
    pr.outer = None
    pr.lines = body

    def products(tiles, hoist: bool) -> list[str]:
        """The tiles' mma in groups, each group's three passes (lo(A') hi(W), hi(A') lo(W),
        hi(A') hi(W)) one after another over its tiles, so that consecutive mma accumulate into
        different tiles j (a chain of dependent mma waits out each one's latency). Hoisted W: one
        group, the tiles taken round-robin over j; else a group per column block k (its W
        fragments loaded once, its A'_k split there)."""
        out, done = [], set()
        by_row = {}
        for j, c in tiles:
            by_row.setdefault(j, []).append((j, c))
        if hoist:
            order = [row[i] for i in range(max(len(r) for r in by_row.values())) for row in by_row.values()
                     if i < len(row)]
            grouped = [order]
        else:
            grouped = [[t for t in tiles if t[1] == kk] for kk in sorted({c for _, c in tiles})]
        for k, (sc, _) in enumerate(p.terms):
            s0, s1 = scales[k]
            one = s0 == const(1.0) and s1 == const(1.0)
            for group in grouped:
                for _, kk in group:      # A' fragment of tile kk: a0 (row g, col 2q), a1 (g + 8, 2q), a2 (g, 2q + 1), a3 (g + 8, 2q + 1)
                    if (k, kk) in done:
                        continue
                    done.add((k, kk))
                    vals = [f"h[{kk}][0]", f"h[{kk}][2]", f"h[{kk}][1]", f"h[{kk}][3]"]
                    if not one:
                        vals = [f"{s} * {v}" for s, v in zip((s0, s1, s0, s1), vals)]
                    out.append(f"unsigned ah{k}_{kk}[4], al{k}_{kk}[4];")
                    out += [f"ssmc_split_tf32({v}, ah{k}_{kk}[{i}], al{k}_{kk}[{i}]);" for i, v in enumerate(vals)]
                out.append("{")
                for j, c in group:
                    out.append(f"  const float4 w{j}_{c} = ssmc_wfrag<{str(hoist).lower()}>(&Wf[{k}][{j * nb + c}][lane]);")
                for a, wp in (("al", "x, {w}.y"), ("ah", "z, {w}.w"), ("ah", "x, {w}.y")):
                    for j, c in group:
                        w = f"w{j}_{c}"
                        f = f"{a}{k}_{c}"
                        out.append(f"  ssmc_mma_tf32(acc[{j}], {f}[0], {f}[1], {f}[2], {f}[3], {w}.{wp.format(w=w)});")
                out.append("}")
        return out
    # after the products: h = acc, the step's outputs (the same scope as the step's other lines)
    tail: list[str] = []
    tail += [f"h[{j}][{c}] = acc[{j}][{c}];" for j in range(nb) for c in range(4)]
    pr.lines, pr.outer = [], tail
    sums = []
    for k, o in enumerate(r.outputs):
        if o.kind != "steps":
            continue
        if reg in o.index:
            for j, e, m, c in _elems(nb):
                env = {**elem_env(j, e, m), "@state": f"h[{j}][{c}]"}
                pr.lines = tail
                tail.append(_store(r, k, o, env, pr.expr(o.expr, env), f"live{m}"))
            continue
        for red in _reduces(o.expr):
            i = len(sums)
            sums.append(red)
            parts = []
            for m in (0, 1):
                pr.lines = tail
                terms = [pr.expr(red.arg, {**elem_env(j, e, m), "@state": f"h[{j}][{c}]"})
                         for j, e, mm, c in _elems(nb) if mm == m]
                parts.append(f"ssmc_t ps{i}_{m} = {_tree(terms)};")
            tail += parts
            tail += [f"ps{i}_{m} += __shfl_xor_sync(0xffffffffu, ps{i}_{m}, {x});" for x in (1, 2) for m in (0, 1)]
        for m in (0, 1):
            bind = {red: f"ps{sums.index(red)}_{m}" for red in _reduces(o.expr)}
            env = {**slot_env[m], "@bind": bind}
            pr.lines = tail
            tail.append(_store(r, k, o, env, pr.expr(o.expr, env), f"live{m} && q == {m}"))
    pr.outer = None
    # the ring: refill slot U with step t + D, then every pointer walks one step
    refill, prologue = [], []
    for v, run, ty in pr.fetch:
        if run:
            refill.append(f"ssmc_mma_fetch<{nb}, {int(vec)}>(r{v}[{U}], p{v}, s{v});")
        else:
            refill.append(f"r{v}[{U}] = *p{v};")
    walk = [f"p{v} += d{v};" for v, _, _ in pr.fetch]
    # L2 prefetch PREFETCH steps ahead: a run's lanes cover its pairs (lane g: tile g % NB)
    hint = [f"ssmc_prefetch_l2(p{v} + po{v});" for v, _, _ in pr.fetch]
    offsets = [f"const long long po{v} = {PREFETCH} * d{v}"
               + (f" + (long long)(8 * ((lane >> 2) % {nb})) * s{v};" if run else ";") for v, run, _ in pr.fetch]
    for u in range(depth):
        prologue.append(f"if ({u} < L) {{ " + " ".join(x.replace(U, str(u)) for x in refill) + " }")
        prologue += walk

    def loop(tiles) -> list[str]:
        """D steps an iteration: while every step and refill is in range, one block of straight-line
        code (the scheduler interleaves one step's readout with the next step's products); then
        the rest, checked step by step."""
        step = body + acc + products(tiles, len(tiles) <= HOIST_TILES) + tail
        out = ["int s0 = 0;", f"for (; s0 + {2 * depth} <= L; s0 += {depth}) {{"]
        for u in range(depth):
            out.append(f"  {{ const int t = s0 + {u};")
            out += ["    " + x.replace(U, str(u)) for x in step + refill]
            if hint:
                out.append(f"    if (t + {PREFETCH} < L) {{ " + " ".join(hint) + " }")
            out += ["    " + x for x in walk]
            out.append("  }")
        out += ["}", f"for (; s0 < L; s0 += {depth}) {{"]
        for u in range(depth):
            out.append(f"  {{ const int t = s0 + {u};")
            out.append("    if (t >= L) break;")
            out += ["    " + x.replace(U, str(u)) for x in step]
            if refill:
                out.append(f"    if (t + {depth} < L) {{ " + " ".join(x.replace(U, str(u)) for x in refill) + " }")
            out += ["    " + x for x in walk]
            out.append("  }")
        out.append("}")
        return out
    compiled = tiles_of(p, p.blocks)
    every = [(a, c) for a in range(nb) for c in range(nb)]
    loop0, loop1 = loop(compiled), loop(every)
    # after the loop: the final outputs from the whole state
    post = []
    finals = [k for k, o in enumerate(r.outputs) if o.kind == "final"]
    if finals:
        fl = pr.section([])
        for k in finals:
            o = r.outputs[k]
            fenv = [{**slot_env[m], "t": "0", "@fetch": False} for m in (0, 1)]
            if reg in o.index:
                for j, e, m, c in _elems(nb):
                    env = {**fenv[m], reg: f"(cq + {8 * j + e})", "@state": f"h[{j}][{c}]"}
                    fl.append(_store(r, k, o, env, pr.expr(o.expr, env), f"live{m}"))
                continue
            bind = [{}, {}]
            for red in _reduces(o.expr):
                i = len(sums)
                sums.append(red)
                for m in (0, 1):
                    terms = [pr.expr(red.arg, {**fenv[m], reg: f"(cq + {8 * j + e})", "@state": f"h[{j}][{c}]"})
                             for j, e, mm, c in _elems(nb) if mm == m]
                    fl.append(f"ssmc_t ps{i}_{m} = {' + '.join(terms)};")
                    fl += [f"ps{i}_{m} += __shfl_xor_sync(0xffffffffu, ps{i}_{m}, {x});" for x in (1, 2)]
                    bind[m][red] = f"ps{i}_{m}"
            for m in (0, 1):
                env = {**fenv[m], "@bind": bind[m]}
                fl.append(_store(r, k, o, env, pr.expr(o.expr, env), f"live{m} && q == {m}"))
        post = fl
    fill = _Printer(r, "w")
    wv = [fill.expr(mat, {p.reg: "fi", ir.MIX_COL: "fc"}) for _, mat in p.terms]
    decls, params = kernel_params(r, p)
    src = jinja_env().get_template(TEMPLATE).render(
        region_name=r.name, region_text=str(r), n=p.n, nb=nb, warps=warps, depth=depth, kname=kname,
        params=decls, args=[d.split()[-1] for d in decls], decomp=decomp, fill_pre=fill.pre + fill.lines,
        fill_value=wv, nterms=len(p.terms), ntiles=len(compiled),
        pre=pr.pre + offsets + init + prologue, loop0=loop0, loop1=loop1, post=post)
    return Rendered(warps, kname, src, tuple(params), tuple(pr.run_loads))

