"""The block-sparse forward on tensor cores (templates/cuda/block_sparse_mma_fwd.cu.j2): the
instances of ``CudaBlockSparseKernel`` whose variant is "m<D>" (D: how many steps ahead the loads
are issued), "m<D>x<S>" (S warps share one 16-row tile: each owns n/S of the state's columns,
and the columns the others' products read, with the partial readout sums, go through shared
memory, one named barrier a step; SPLITS lists those timed) or "m<D>p<G>[x<S>]" (S warps a tile,
2 by default, as a pipeline: where the mask's column tiles split into stages none of which reads
a later one (`pipeline`), each stage runs ahead of its readers, handing them the split fragments
of the state their products read, and its partial readout sums to the last stage, through a ring
of D steps in pages of G (`Pipe`: a barrier pair a writer and page instead of a barrier a step);
PIPES lists those timed). Measured (H100, benchmarks/NOTES.md): the two-stage pipeline gains where
the grid leaves schedulers idle (small batches) and nothing where each holds a tile's warp.

The transition's products sum_k s_k (W_k h) are, for 16 rows at once, a [16 x n] by [n x n]
matrix product with the same W_k for every row: mma.m16n8k8 in tf32, one per nonzero 8x8 tile of
W_k, three per tile for fp32 accuracy (3xTF32: the small cross terms first). A warp holds 16 rows
by the whole state in registers, in the accumulator layout, which (the columns of each tile
permuted, W's fragments alike) is also the A-operand layout, so a step moves nothing between lanes
(nor, unsplit, between warps: no shared-memory exchange, no barrier). The hi/lo split rounds hi to
nearest, so lo (either sign) loses nothing on average to the tensor core's truncation. Blocks of
any size are covered by the 8x8 tiles they touch (a 16x16 block is four tiles, a 4x4 block shares
a tile with its neighbours).

What it covers, beyond `bsp_plan` (else `mma_unsupported` says why and only the lane-per-row
instances are timed): fp32 state, the mixed axis a multiple of 8 up to 64, W's fragments of every
tile of every term in shared memory (the every-tile path needs them), sm_80 or later.
"""
from __future__ import annotations

import dataclasses
import re

from ssmc import ir
from ssmc.ir import Const, Load

from .cuda_block_sparse import CudaBSPlan, Rendered, _Printer, _reduces, kernel_params
from .cuda_printer import CTYPES, const

TEMPLATE = "cuda/block_sparse_mma_fwd.cu.j2"
WARPS = (1, 4)            # warps a block (16 rows each): the choices timed on first use
DEPTHS = (2, 3, 4)         # steps ahead the loads are issued (3: -3% sparse and dense on the H100 at 2d4d96a)
SPLITS = ((2, "m2x2"), (2, "m4x2"))     # and those with 2 warps a tile (one tile a block; "m2x4": 4 warps,
                                        # spills at the 128 registers of 4 blocks an SM: not timed)
PIPES = ((2, "m2p1"), (2, "m4p2"))   # and the pipelines (one tile a block); deeper rings (m3p1, m4p1)
                          # and three or four stages (m3p1x3, m4p2x3, m2p1x4) measured no faster on the H100
                          # at b4, b8 and b32 (benchmarks/NOTES.md): not timed
PIPE_COST = (6, 1, 1, 2)  # a step's cost, in units of about an mma tile's: a state tile (its element updates,
                          # readout, split), an mma tile, a tile sent, a tile received (load and split)
SMEM_STATIC = 48 * 1024   # a block's static shared memory
SMEM_W = 40 * 1024        # W's fragments: terms * tiles * 32 lanes * 16 bytes
HOIST_TILES = 16          # up to this many tiles, W's fragments may stay in registers across steps
PREFETCH = 8             # steps ahead of the L2 prefetch hints (0: none)
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


def split_fits(r: ir.Region, p: CudaBSPlan, split: int) -> bool:
    """Whether `split` warps a tile divide the state's tiles and the exchange buffers fit beside W."""
    nb = p.n // 8
    sums = _row_sums(r, p)
    smem = len(p.terms) * nb * nb * 32 * 16 + 2 * nb * 32 * 16 + 2 * max(sums, 1) * split * 16 * 4
    return nb % split == 0 and smem <= SMEM_STATIC


def _row_sums(r: ir.Region, p: CudaBSPlan) -> int:
    """The sums over the state that per-row outputs (per step or final) read: the partial sums the
    warps of a tile exchange."""
    return sum(len(_reduces(o.expr)) for o in r.outputs if p.reg not in o.index)


def pipe_fits(r: ir.Region, p: CudaBSPlan, variant: str) -> bool:
    """Whether the pipeline `variant` exists for the plan, its barriers number at most 15 and its
    rings fit beside W and the every-tile path's exchange buffers."""
    depth, stages, page = _variant(variant)
    parts = pipeline(p, stages)
    if parts is None or depth % page:
        return False
    pipe = make_pipe(p, parts, depth, page)
    if pipe.fin() > 15:
        return False
    nb = p.n // 8
    sums = max(_row_sums(r, p), 1)
    ring, per_sum = pipe_smem(p, pipe)
    smem = (len(p.terms) * nb * nb * 32 * 16 + max(2 * nb, ring) * 32 * 16 + 2 * sums * stages * 16 * 4
            + sums * per_sum)
    return smem <= SMEM_STATIC


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


def _walking_store(r, k: int, o, env: dict, m: int) -> tuple[str, str, str] | None:
    """A per-step output's row pointer, walked a step at a time instead of its address computed at
    every store: (declaration before the loop, the step's walk, the pointer); None where the output
    has no time axis."""
    if "t" not in o.index:
        return None
    terms = [f"(long long)({env[ix]}) * os{k}_{d}" for d, ix in enumerate(o.index) if ix not in (1, "t")]
    ptr = f"ob{k}_{m}"
    return (f"{CTYPES[o.dtype]}* {ptr} = out{k} + ({' + '.join(terms) or '0'});",
            f"{ptr} += os{k}_{o.index.index('t')};", ptr)


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


def partition(p: CudaBSPlan, split: int) -> list[list[int]]:
    """The state's 8-column tiles j (the products' output tiles) over `split` warps: nb / split
    each, the compiled tiles (mma) evened out, heaviest rows first."""
    nb = p.n // 8
    count = [0] * nb
    for j, _ in tiles_of(p, p.blocks):
        count[j] += 1
    parts, load = [[] for _ in range(split)], [0] * split
    for j in sorted(range(nb), key=lambda j: (-count[j], j)):
        w = min((w for w in range(split) if len(parts[w]) < nb // split), key=lambda w: (load[w], w))
        parts[w].append(j)
        load[w] += count[j]
    return [sorted(x) for x in parts]


def _variant(variant: str) -> tuple[int, int, int]:
    """(load depth D, warps a 16-row tile S, steps a page G: 0 unless a pipeline) of "m<D>",
    "m<D>x<S>", "m<D>p<G>" (a pipeline of two warps) or "m<D>p<G>x<S>" (of S)."""
    m = re.fullmatch(r"m(\d+)(?:p(\d+))?(?:x(\d+))?", variant)
    if m is None:
        raise ValueError(f"tensor-core variant {variant!r} is not m<D>, m<D>x<S>, m<D>p<G> or m<D>p<G>x<S>")
    d, g, s = m.groups()
    return int(d), int(s or (2 if g else 1)), int(g or 0)


@dataclasses.dataclass(frozen=True)
class Pipe:
    """A pipeline of the warps of a 16-row tile: stage s owns the state's 8-column tiles parts[s]
    and reads only its own and earlier stages' (no cycle between stages). Each stage but the last
    writes a ring (Rh<s>: the A' fragments of its tiles `sent[s]` that later stages read; Rs<s>:
    its partial sums over the state) of D steps in pages of `page`; `readers[s]` (the stages
    reading its tiles, and the last, which adds the sums and stores the per-row outputs) wait for
    a page filled (barrier `full(s, pg)`) and the writer for it emptied (`empty(s, pg)`)."""
    parts: tuple
    sent: tuple
    readers: tuple
    page: int
    pages: int
    tiles: tuple               # the compiled tiles (row j, column c)

    def full(self, s: int, pg: int) -> int:
        return 1 + 2 * self.pages * s + pg

    def empty(self, s: int, pg: int) -> int:
        return 1 + 2 * self.pages * s + self.pages + pg

    def fin(self) -> int:
        return 1 + 2 * self.pages * (len(self.parts) - 1)

    def ring_slots(self, s: int, terms: int) -> int:
        """float4 slots a lane of stage s's fragment ring takes: D steps, its tiles sent, each
        term's hi and lo."""
        return self.pages * self.page * max(len(self.sent[s]), 1) * terms * 2

    def count(self, s: int) -> int:
        """Threads at stage s's barriers: the writer and its readers."""
        return 32 * (1 + len(self.readers[s]))

    def given(self, s: int, terms: int) -> dict:
        """(term, tile) -> the ring slot that stage s reads the tile's fragments from."""
        mine = {c for j, c in self.tiles if j in self.parts[s]}
        return {(k, c): f"Rh{w}[@PG@][@SL@][{x}][{k}]" for w in range(s) for x, c in enumerate(self.sent[w])
                if c in mine for k in range(terms)}


def pipeline(p: CudaBSPlan, stages: int = 2) -> list[list[int]] | None:
    """The state's 8-column tiles j over `stages` warps in order, no tile's products reading a
    column of a later stage (the compiled tiles (j, c): c's stage at most j's), the largest stage's
    step cost (PIPE_COST: its state tiles, mma, tiles sent and received) smallest, then the fewest
    tiles sent; None where there is no such split (a cycle through every tile, as dense A has).
    Assigned over the mask's strongly connected tile groups in topological order, pruned by cost."""
    import networkx as nx
    nb = p.n // 8
    g = nx.DiGraph()
    g.add_nodes_from(range(nb))
    reads = {j: set() for j in range(nb)}
    for j, c in tiles_of(p, p.blocks):
        reads[j].add(c)
        g.add_edge(c, j)
    cond = nx.condensation(g)
    order = list(nx.topological_sort(cond))
    if len(order) < stages:
        return None
    members = {u: sorted(cond.nodes[u]["members"]) for u in order}
    st, mm, tx, rx = PIPE_COST
    base = {u: sum(st + mm * len(reads[j]) for j in members[u]) for u in order}
    best = [None]

    def cost(stage_of):
        load = [0] * stages
        sent = [set() for _ in range(stages)]
        for u in order:
            load[stage_of[u]] += base[u]
        for j in range(nb):
            for c in reads[j]:
                sj, sc = stage_of[cond.graph["mapping"][j]], stage_of[cond.graph["mapping"][c]]
                if sc < sj:
                    sent[sc].add(c)
                    load[sj] += rx
        for w in range(stages):
            load[w] += tx * len(sent[w])
        return max(load), sum(len(x) for x in sent)

    def assign(i, stage_of, load):
        if best[0] is not None and max(load) > best[0][0][0]:
            return
        if i == len(order):
            if min(load) > 0:
                c = cost(stage_of)
                if best[0] is None or c < best[0][0]:
                    best[0] = (c, dict(stage_of))
            return
        u = order[i]
        lo = max((stage_of[v] for v in cond.predecessors(u)), default=0)
        for w in range(lo, stages):
            stage_of[u] = w
            load[w] += base[u]
            assign(i + 1, stage_of, load)
            load[w] -= base[u]
        stage_of.pop(u, None)
    assign(0, {}, [0] * stages)
    if best[0] is None:
        return None
    stage_of = best[0][1]
    return [sorted(j for u in order if stage_of[u] == w for j in members[u]) for w in range(stages)]


def make_pipe(p: CudaBSPlan, parts, depth: int, page: int) -> Pipe:
    """The rings and barriers of a pipeline over `parts` (`pipeline`'s)."""
    tiles = tuple(tiles_of(p, p.blocks))
    stage = {j: w for w, part in enumerate(parts) for j in part}
    last = len(parts) - 1
    sent = tuple(tuple(sorted({c for j, c in tiles if stage[c] == w and stage[j] > w})) for w in range(len(parts)))
    readers = tuple(tuple(sorted({stage[j] for j, c in tiles if stage[c] == w and stage[j] > w} | {last}))
                    if w < last else () for w in range(len(parts)))
    return Pipe(tuple(tuple(x) for x in parts), sent, readers, page, depth // page, tiles)


def pipe_smem(p: CudaBSPlan, pipe: Pipe) -> tuple[int, int]:
    """(float4 slots a lane of the fragment rings takes (they share Xs's memory), bytes of the
    sums' rings per sum)."""
    return (sum(pipe.ring_slots(w, len(p.terms)) for w in range(len(pipe.parts) - 1)),
            (len(pipe.parts) - 1) * pipe.page * pipe.pages * 16 * 4)


def render_mma(r: ir.Region, p: CudaBSPlan, warps: int, depth: int, vec: bool = False,
               shared: bool = False, split: int = 1, page: int = 0) -> Rendered:
    """The instance: `vec` the pairs along the mixed axis read as one load each (the caller checks
    contiguity and alignment), `shared` the two rows of a lane differ only in the last parallel axis
    (its size a multiple of 16: loads free of that axis are shared between them), `split` warps a
    16-row tile (each owns nb / split of the state's tiles; the tiles another warp's products read
    are exchanged through shared memory, one barrier of the tile's warps a step); `page` > 0: the
    `split` warps of a tile as a pipeline (`pipeline`'s stages, rings of `depth` steps in pages of
    `page`; one tile a block), the exchange a step where the inputs' pattern is not covered."""
    from .cuda import jinja_env
    nb = p.n // 8
    pipe = None
    if page:
        owners = pipeline(p, split)
        if owners is None or warps != split or depth % page:
            raise ValueError(f"no pipeline of {split} warps, pages of {page} in {depth} steps: "
                             + ("no such stages" if owners is None else "one tile a block, pages dividing D"))
        pipe = make_pipe(p, owners, depth, page)
    elif split < 1 or nb % split or warps % split or (split > 1 and depth % 2):
        raise ValueError(f"{split} warps a tile: the {nb} tiles or the {warps} warps do not divide"
                         + (f", or {depth} steps an iteration is odd (the exchange's double buffer)" if split > 1 else ""))
    else:
        owners = partition(p, split) if split > 1 else [list(range(nb))]
    kname = ("ssmc_bspm_" + "".join(ch if ch.isalnum() else "_" for ch in r.name)
             + f"_w{warps}d{depth}{f'p{page}' if page else ''}{f'x{split}' if split > 1 else ''}"
             + f"{'v' if vec else ''}{'s' if shared else ''}")
    roles = [_role(r, p, depth, vec, shared, owners, w) for w in range(split)]
    pipes = [_role(r, p, depth, vec, shared, owners, w, pipe) for w in range(split)] if pipe else []
    fill = _Printer(r, "w")
    wv = [fill.expr(mat, {p.reg: "fi", ir.MIX_COL: "fc"}) for _, mat in p.terms]
    decls, params = kernel_params(r, p)
    run_loads = []
    for ro in roles:
        run_loads += [x for x in ro["run_loads"] if x not in run_loads]
    src = jinja_env().get_template(TEMPLATE).render(
        region_name=r.name, region_text=str(r), n=p.n, nb=nb, warps=warps, depth=depth, kname=kname,
        params=decls, args=[d.split()[-1] for d in decls], decomp=_decomp(p, shared), fill_pre=fill.pre + fill.lines,
        fill_value=wv, nterms=len(p.terms), ntiles=len(tiles_of(p, p.blocks)), split=split, owners=owners,
        nsums=max(ro["nsums"] for ro in roles), roles=roles, pipes=pipes, page=page, pages=depth // max(page, 1),
        rings=_rings(p, pipe, max(ro["nsums"] for ro in roles)) if pipe else [],
        xs_tiles=max(nb, -(-pipe_smem(p, pipe)[0] // 2)) if pipe else nb)
    return Rendered(warps, kname, src, tuple(params), tuple(run_loads))


def _rings(p: CudaBSPlan, pipe: Pipe, nsums: int) -> list[str]:
    """Declarations of a pipeline's rings: each writing stage's fragments (uint4 [page][step][tile
    sent][term][hi, lo][lane], in Xs's memory) and partial sums ([page][step][sum][row])."""
    out, off = [], 0
    shape = f"[{pipe.page}]"
    for w, sent in enumerate(pipe.sent[:-1]):
        dims = f"{shape}[{max(len(sent), 1)}][{len(p.terms)}][2][32]"
        out += [f"uint4 (*Rh{w}){dims} = reinterpret_cast<uint4 (*){dims}>(&Xs[0][0][0][0] + {off});",
                f"__shared__ float Rs{w}[{pipe.pages}]{shape}[{max(nsums, 1)}][16];"]
        off += pipe.ring_slots(w, len(p.terms)) * 32
    return out


def _decomp(p: CudaBSPlan, shared: bool) -> list[str]:
    """The two rows of a lane as indices along the parallel axes."""
    out = []
    for m in (0, 1):
        for a in reversed(p.rows):
            if shared and m == 1 and a != p.rows[-1]:
                continue
            out.append(f"const long long ax_{a}_{m} = rr{m} % sz_{a}; rr{m} /= sz_{a};")
    return out


def _role(r: ir.Region, p: CudaBSPlan, depth: int, vec: bool, shared: bool, owners, role: int,
          pipe: Pipe | None = None) -> dict:
    """The code of one warp of a tile (the only one when `owners` has one part): its tiles' element
    updates, products, outputs and loads; with several parts, the exchange after each step (into
    Xs / Ps of the tile's half @B@ of the double buffer, then the barrier of the tile's warps).
    With `pipe`, stage `role` of a pipeline: it reads the fragments of earlier stages' tiles from
    their rings' page @PG@, slot @SL@, writes its own that later stages read into its ring after
    its products, and its partial sums after its readout (the last stage adds them and stores the
    per-row outputs); a page begins with the waits (its ring emptied, the rings it reads filled)
    and ends with the arrivals."""
    nb, reg, split = p.n // 8, p.reg, len(owners)
    page = pipe.page if pipe else 0
    lastst = split - 1
    writes = bool(pipe) and role < lastst          # a pipeline stage with a ring of its own
    own = owners[role]
    pr = _MmaPrinter(r, nb, vec)
    last = p.rows[-1] if p.rows else None
    slot_env = []
    for m in (0, 1):
        env = {a: (f"ax_{a}_0" if shared and a != last else f"ax_{a}_{m}") for a in p.rows}
        slot_env.append({**env, "t": "t", "@fetch": True})
    mine = [x for x in _elems(nb) if x[0] in own]
    stores = ([0, 1] if role == lastst else []) if pipe else [m for m in (0, 1) if m % split == role]
    # (the row slots whose per-row outputs this warp stores)

    def elem_env(j, e, m, extra=None):
        return {**slot_env[m], reg: f"(cq + {8 * j + e})", "@elem": (j, e), **(extra or {})}

    # initial state: every tile (the others' tiles too: their first products need them)
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
    for j, e, m, c in mine:
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

    def a_frag(k: int, kk: int) -> list[str]:
        """The A' fragment of term k's tile kk, split: a0 (row g, col 2q), a1 (g + 8, 2q), a2 (g, 2q + 1),
        a3 (g + 8, 2q + 1)."""
        s0, s1 = scales[k]
        vals = [f"h[{kk}][0]", f"h[{kk}][2]", f"h[{kk}][1]", f"h[{kk}][3]"]
        if not (s0 == const(1.0) and s1 == const(1.0)):
            vals = [f"{sc} * {v}" for sc, v in zip((s0, s1, s0, s1), vals)]
        return ([f"unsigned ah{k}_{kk}[4], al{k}_{kk}[4];"]
                + [f"ssmc_split_tf32({v}, ah{k}_{kk}[{i}], al{k}_{kk}[{i}]);" for i, v in enumerate(vals)])
    ring = ({(k, c): f"Rh{role}[@PG@][@SL@][{x}][{k}]" for x, c in enumerate(pipe.sent[role])
             for k in range(len(p.terms))} if writes else {})
    given = pipe.given(role, len(p.terms)) if pipe else {}

    def products(tiles, hoist: bool) -> list[str]:
        """The tiles' mma in groups, each group's three passes (lo(A') hi(W), hi(A') lo(W),
        hi(A') hi(W)) one after another over its tiles, so that consecutive mma accumulate into
        different tiles j (a chain of dependent mma waits out each one's latency). Hoisted W: one
        group, the tiles taken round-robin over j (the warp's own columns k first: the others'
        arrive through shared memory); else a group per column block k (its W fragments loaded
        once, its A'_k split there). A pipeline's downstream warp reads the fragments of the tiles
        it receives, split, from the ring; its upstream warp writes them there after its products
        (splitting those its own products do not read)."""
        out, done = [], set()
        if hoist:
            grouped = []
            for part in ([t for t in tiles if t[1] in own], [t for t in tiles if t[1] not in own]):
                by_row = {}
                for t in part:
                    by_row.setdefault(t[0], []).append(t)
                if by_row:
                    grouped.append([row[i] for i in range(max(len(x) for x in by_row.values()))
                                    for row in by_row.values() if i < len(row)])
        else:
            ks = sorted({c for _, c in tiles}, key=lambda c: (c not in own, c))
            grouped = [[t for t in tiles if t[1] == kk] for kk in ks]
        for k in range(len(p.terms)):
            for group in grouped:
                for _, kk in group:
                    if (k, kk) in done:
                        continue
                    done.add((k, kk))
                    if (k, kk) in given:
                        out += [f"unsigned ah{k}_{kk}[4], al{k}_{kk}[4];",
                                f"{{ const uint4 a = {given[k, kk]}[0][lane], b = {given[k, kk]}[1][lane]; "
                                + " ".join(f"ah{k}_{kk}[{i}] = a.{e}; al{k}_{kk}[{i}] = b.{e};" for i, e in enumerate("xyzw"))
                                + " }"]
                    else:
                        out += a_frag(k, kk)
                out.append("{")
                for j, c in group:
                    out.append(f"  const float4 w{j}_{c} = ssmc_wfrag<{str(hoist).lower()}>(&Wf[{k}][{j * nb + c}][lane]);")
                for a, wp in (("al", "x, {w}.y"), ("ah", "z, {w}.w"), ("ah", "x, {w}.y")):
                    for j, c in group:
                        w = f"w{j}_{c}"
                        f = f"{a}{k}_{c}"
                        out.append(f"  ssmc_mma_tf32(acc[{j}], {f}[0], {f}[1], {f}[2], {f}[3], {w}.{wp.format(w=w)});")
                out.append("}")
        if writes:
            for (k, c), at in ring.items():
                out += a_frag(k, c) if (k, c) not in done else []
                out += [f"{at}[{i}][lane] = make_uint4({a}{k}_{c}[0], {a}{k}_{c}[1], {a}{k}_{c}[2], {a}{k}_{c}[3]);"
                        for i, a in enumerate(("ah", "al"))]
        return out
    # after the products: h = acc, the step's outputs (the same scope as the step's other lines)
    tail: list[str] = []
    tail += [f"h[{j}][{c}] = acc[{j}][{c}];" for j in own for c in range(4)]
    pr.lines, pr.outer = [], tail
    sums, row_outs = [], []
    for k, o in enumerate(r.outputs):
        if o.kind != "steps":
            continue
        if reg in o.index:
            for j, e, m, c in mine:
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
                         for j, e, mm, c in mine if mm == m]
                parts.append(f"ssmc_t ps{i}_{m} = {_tree(terms)};")
            tail += parts
            tail += [f"ps{i}_{m} += __shfl_xor_sync(0xffffffffu, ps{i}_{m}, {x});" for x in (1, 2) for m in (0, 1)]
        row_outs.append((k, o))
    # the others' partial sums and tiles (several warps a tile): through shared memory
    xchg: list[str] = []
    if pipe:
        xchg += [f"if (q == 0) Rs{role}[@PG@][@SL@][{i}][{8 * m} + (lane >> 2)] = ps{i}_{m};"
                 for i in range(len(sums)) for m in (0, 1)] if writes else []
    elif split > 1:
        xchg += [f"if (q == 0) Ps[tg][@B@][{i}][{role}][{8 * m} + (lane >> 2)] = ps{i}_{m};"
                 for i in range(len(sums)) for m in (0, 1)]
    after: list[str] = []
    owalk, odecl = [], []
    for k, o in row_outs:
        for m in stores:
            bind = {}
            for red in _reduces(o.expr):
                i = sums.index(red)
                if split > 1:
                    others = ([f"Rs{w}[@PG@][@SL@][{i}][{8 * m} + (lane >> 2)]" for w in range(lastst)] if pipe else
                              [f"Ps[tg][@B@][{i}][{w}][{8 * m} + (lane >> 2)]" for w in range(split) if w != role])
                    after.append(f"const ssmc_t pt{i}_{m} = ps{i}_{m} + {' + '.join(others)};")
                    bind[red] = f"pt{i}_{m}"
                else:
                    bind[red] = f"ps{i}_{m}"
            env = {**slot_env[m], "@bind": bind}
            pr.lines = after
            pr.outer = after
            value, cond = pr.expr(o.expr, env), f"live{m} && q == {m if split == 1 else 0}"
            walking = _walking_store(r, k, o, env, m)
            if walking:
                odecl.append(walking[0])
                owalk.append(walking[1])
                after.append(f"if ({cond}) *{walking[2]} = ssmc_from<{CTYPES[o.dtype]}>({value});")
            else:
                after.append(_store(r, k, o, env, value, cond))
    pr.outer = None

    def exchange(tiles) -> tuple[list[str], list[str]]:
        """(before the barrier, after it): the warp's tiles that another's products read, out;
        the others' tiles that its own read, in."""
        if split == 1:
            return [], []
        if page:         # the tiles go with the products (the fragments); the sums after them
            return [], xchg
        used = {c for j, c in tiles if j in own}
        wanted = {c for j, c in tiles if j not in own}
        out = [f"Xs[tg][@B@][{c}][lane] = make_float4(h[{c}][0], h[{c}][1], h[{c}][2], h[{c}][3]);"
               for c in sorted(wanted & set(own))]
        back = []
        for c in sorted(used - set(own)):
            back += [f"{{ const float4 x = Xs[tg][@B@][{c}][lane]; "
                     f"h[{c}][0] = x.x; h[{c}][1] = x.y; h[{c}][2] = x.z; h[{c}][3] = x.w; }}"]
        return out + xchg + [f"ssmc_bar(1 + tg, {32 * split});"], back
    # the ring: refill slot U with step t + D, then every pointer walks one step
    mask = sum(1 << j for j in own)
    refill, prologue = [], []
    for v, run, ty in pr.fetch:
        if run:
            refill.append(f"ssmc_mma_fetch<{nb}, {int(vec)}, {mask:#x}>(r{v}[{U}], p{v}, s{v});")
        else:
            refill.append(f"r{v}[{U}] = *p{v};")
    walk = [f"p{v} += d{v};" for v, _, _ in pr.fetch]
    # L2 prefetch PREFETCH steps ahead: a run's lanes cover the warp's pairs (lane g: its tile g % tiles)
    hint = [f"ssmc_prefetch_l2(p{v} + po{v});" for v, _, _ in pr.fetch] if PREFETCH else []
    nibbles = sum(j << (4 * i) for i, j in enumerate(own))
    offsets = [f"const long long po{v} = {PREFETCH} * d{v}"
               + (f" + (long long)(8 * (({nibbles:#x}u >> (4 * ((lane >> 2) % {len(own)}))) & 15u)) * s{v};"
                  if run else ";") for v, run, _ in pr.fetch] if PREFETCH else []
    for u in range(depth):
        prologue.append(f"if ({u} < L) {{ " + " ".join(x.replace(U, str(u)) for x in refill) + " }")
        prologue += walk

    def loop(tiles) -> list[str]:
        """D steps an iteration: while every step and refill is in range, one block of straight-line
        code (the scheduler interleaves one step's readout with the next step's products); then
        the rest, checked step by step. The exchange's double buffer half is t % 2 (the split instances: D even)."""
        mine_t = [t for t in tiles if t[0] in own]
        send, recv = exchange(tiles)
        if page:
            step = body + acc + products(mine_t, len(mine_t) <= HOIST_TILES) + tail + recv + after
        else:
            step = body + acc + products(mine_t, len(mine_t) <= HOIST_TILES) + tail + send + recv + after

        def copy(u):
            return ["    " + x.replace(U, str(u)).replace("@B@", str(u % 2)).replace("@PG@", str(u // max(page, 1)))
                    .replace("@SL@", str(u % max(page, 1))) for x in step]

        def gate(u, start: bool) -> list[str]:
            """A pipeline's barriers at the start of a page (the waits) or its end (the arrivals)."""
            if not pipe or u % page != (0 if start else page - 1):
                return []
            pg = u // page
            read = [w for w in range(role) if role in pipe.readers[w]]
            if start:
                return ([f"    ssmc_bar({pipe.full(w, pg)}, {pipe.count(w)});" for w in read]
                        + ([f"    ssmc_bar({pipe.empty(role, pg)}, {pipe.count(role)});"] if writes else []))
            return ([f"    ssmc_bar_arrive({pipe.full(role, pg)}, {pipe.count(role)});"] if writes else []) + [
                f"    ssmc_bar_arrive({pipe.empty(w, pg)}, {pipe.count(w)});" for w in read]
        out = ["int s0 = 0;", f"for (; s0 + {2 * depth} <= L; s0 += {depth}) {{"]
        for u in range(depth):
            out.append(f"  {{ const int t = s0 + {u};")
            out += gate(u, True)
            out += copy(u)
            out += ["    " + x.replace(U, str(u)) for x in refill]
            if hint:
                out.append(f"    if (t + {PREFETCH} < L) {{ " + " ".join(hint) + " }")
            out += ["    " + x for x in walk + owalk]
            out += gate(u, False)
            out.append("  }")
        out += ["}", f"for (; s0 < L; s0 += {depth}) {{"]
        for u in range(depth):
            out.append(f"  {{ const int t = s0 + {u};")
            out += gate(u, True)
            # (a pipeline passes every page's barriers, past the end too: both warps' counts match)
            out.append("    if (t < L) {" if page else "    if (t >= L) break;")
            out += copy(u)
            if refill:
                out.append(f"    if (t + {depth} < L) {{ " + " ".join(x.replace(U, str(u)) for x in refill) + " }")
            out += ["    " + x for x in walk + owalk]
            if page:
                out.append("    }")
            out += gate(u, False)
            out.append("  }")
        out.append("}")
        return out
    compiled = tiles_of(p, p.blocks)
    every = [(a, c) for a in range(nb) for c in range(nb)]
    loop0, loop1 = loop(compiled), loop(every)
    # after the loop: the final outputs from the whole state (the other warps' partial sums in the
    # half of the buffer no warp reads after the last step's barrier: L % 2)
    post = []
    if writes:        # the readers' last arrivals (they arrived once ahead, below)
        post += [f"ssmc_bar({pipe.empty(role, pg)}, {pipe.count(role)});" for pg in range(pipe.pages)]
    if pipe:
        prologue += [f"ssmc_bar_arrive({pipe.empty(w, pg)}, {pipe.count(w)});" for w in range(role)
                     if role in pipe.readers[w] for pg in range(pipe.pages)]
    finals = [k for k, o in enumerate(r.outputs) if o.kind == "final"]
    if finals:
        fl = pr.section(post)
        fenv = [{**slot_env[m], "t": "0", "@fetch": False} for m in (0, 1)]
        binds, fsums = [{}, {}], []
        for k in finals:
            o = r.outputs[k]
            if reg in o.index:
                for j, e, m, c in mine:
                    env = {**fenv[m], reg: f"(cq + {8 * j + e})", "@state": f"h[{j}][{c}]"}
                    fl.append(_store(r, k, o, env, pr.expr(o.expr, env), f"live{m}"))
                continue
            for red in _reduces(o.expr):
                i = len(sums)
                sums.append(red)
                fsums.append(i)
                for m in (0, 1):
                    terms = [pr.expr(red.arg, {**fenv[m], reg: f"(cq + {8 * j + e})", "@state": f"h[{j}][{c}]"})
                             for j, e, mm, c in mine if mm == m]
                    fl.append(f"ssmc_t ps{i}_{m} = {' + '.join(terms)};")
                    fl += [f"ps{i}_{m} += __shfl_xor_sync(0xffffffffu, ps{i}_{m}, {x});" for x in (1, 2)]
                    binds[m][red] = f"ps{i}_{m}"
        if split > 1 and fsums:
            fl += [f"if (q == 0) Ps[tg][L & 1][{i}][{role}][{8 * m} + (lane >> 2)] = ps{i}_{m};"
                   for i in fsums for m in (0, 1)]
            fl.append(f"ssmc_bar({pipe.fin() if pipe else '1 + tg'}, {32 * split});")
            for i in fsums:
                for m in stores:
                    others = [f"Ps[tg][L & 1][{i}][{w}][{8 * m} + (lane >> 2)]" for w in range(split) if w != role]
                    fl.append(f"ps{i}_{m} += {' + '.join(others)};")
        for k in finals:
            o = r.outputs[k]
            if reg in o.index:
                continue
            for m in stores:
                env = {**fenv[m], "@bind": binds[m]}
                fl.append(_store(r, k, o, env, pr.expr(o.expr, env), f"live{m} && q == {m if split == 1 else 0}"))
        post = fl
    return dict(pre=pr.pre + offsets + odecl + init + prologue, loop0=loop0, loop1=loop1, post=post,
                run_loads=pr.run_loads, nsums=len(sums))
