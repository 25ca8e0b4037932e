"""CUDA C for one region: the plan of the chunked selective-scan kernel and the expression printer.

`plan(region)` decides how the region's iteration space maps onto the kernel, or raises
`Unsupported` with the reason ``supports()`` reports:

- *inner* axes are the state axes the outputs sum over (the readout ``sum_n h*C``); one thread
  walks them sequentially, so the readout is a sum in registers. *outer* axes are the others;
  one combination of them is a *row* (Mamba-1: (batch, channel); Mamba-2: (batch, head, p)).
- every expression node gets a *level* by what it varies along, and is computed once per level
  instead of once per (time, state element):

  ======  ===================  ============================================  ==================
  level   varies along          e.g. (Mamba-1)                                computed
  ======  ===================  ============================================  ==================
  block   neither t nor inner   ``bias[d]``, ``D[d]``                         once per thread
  time    t, not inner          ``softplus(dt + bias)``, ``delta * x``, z     per chunk, per item
  state   inner, not t          ``A[d, n] * log2(e)``                         per state element
  st      t and inner           ``exp2(delta * A2)``, ``B[t, n]``             per element, per item
  ======  ===================  ============================================  ==================

  Expressions of the new state h (not under a sum) are evaluated in the sequential *replay*
  over a thread's items; sums over inner axes accumulate there into per-item registers.
- ``exp(x)`` is rewritten ``exp2(x * log2 e)``, and when x is a product the constant is folded
  into the factor of the cheapest level: ``exp(delta * A) -> exp2(delta * (A * log2 e))``, one
  multiply per state element instead of one per (time, element).

`emit(plan)` prints the kernel's code sections (lists of CUDA C statements) that the template
``templates/cuda/selective_scan_fwd.cu.j2`` places into its loops. Every op of
``ssmc.ops.ELEMENTWISE`` prints; all arithmetic is in ``ssmc_t`` (fp32, or fp64 when an input
is fp64, as the torch reference does), booleans as 0/1.
"""
from __future__ import annotations

import dataclasses
import math

from ssmc import ir
from ssmc.ir import Const, Load, Op, Reduce, Region, State
from ssmc.ops import ELEMENTWISE

LOG2E = 1.4426950408889634

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "float64": "double",
          "bool": "bool"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "bool": 1}

_UNARY_FN = {"expm1": "ssmc_expm1", "log": "ssmc_log", "log1p": "ssmc_log1p", "sqrt": "ssmc_sqrt",
             "rsqrt": "ssmc_rsqrt", "tanh": "ssmc_tanh", "sigmoid": "ssmc_sigmoid",
             "logsigmoid": "ssmc_logsigmoid", "silu": "ssmc_silu", "relu": "ssmc_relu",
             "abs": "ssmc_abs", "sin": "ssmc_sin", "cos": "ssmc_cos"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_CMP = {"gt": ">", "lt": "<", "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}
PRINTABLE = set(_UNARY_FN) | set(_INFIX) | set(_CMP) | {
    "pow", "maximum", "minimum", "where", "neg", "exp", "exp2", "softplus", "reciprocal", "cast"}
assert set(ELEMENTWISE) <= PRINTABLE, f"printer misses {set(ELEMENTWISE) - PRINTABLE}"

BLOCK, TIME, STATE, ST = "block", "time", "state", "st"
_RANK = {BLOCK: 0, STATE: 1, TIME: 2, ST: 3}     # how often a level is evaluated, least first


class Unsupported(Exception):
    """The cuda kernel does not cover this region; the message is the reason."""


@dataclasses.dataclass(frozen=True)
class OutputPlan:
    k: int
    spec: ir.OutputSpec
    expr: ir.Expr            # after the exp -> exp2 rewrite
    where: str               # "row" (after the state loop) | "inner" (in the replay) | "final"


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    decl: str                # CUDA C declaration
    kind: str                # "ptr" | "i64" | "i32"
    source: tuple            # ("in", k) ("in_stride", k, d) ("out", k) ("out_stride", k, d)
                             # ("size", axis) ("L",) ("rows",) ("N",)


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    region: Region
    inner: tuple[str, ...]
    outer: tuple[str, ...]
    decay: ir.Expr
    drive: ir.Expr
    outputs: tuple[OutputPlan, ...]
    reduces: tuple[Reduce, ...]
    compute: str             # "float" | "double"
    params: tuple[Param, ...]

    def axis_var(self, a: str) -> str:
        return f"ax{self.region.axes.index(a)}"


# -- planning ------------------------------------------------------------------------------------

def _check_expr(e, where: str, allow_state: bool, allow_reduce: bool):
    for x in ir.walk(e):
        if isinstance(x, Op):
            if x.name not in PRINTABLE:
                raise Unsupported(f"{where}: op {x.name!r} has no CUDA printing")
            if x.name == "cast" and x.attr("dtype") not in (*CTYPES, "int8", "int16", "int32", "int64",
                                                            "uint8"):
                raise Unsupported(f"{where}: cast to {x.attr('dtype')}")
        elif isinstance(x, State) and not allow_state:
            raise Unsupported(f"{where} reads the state")
        elif isinstance(x, Reduce):
            if not allow_reduce:
                raise Unsupported(f"{where} holds a sum over state axes")
            if x.op != "sum":
                raise Unsupported(f"{where}: reduction {x.op!r} (only sums)")
            if any(isinstance(y, Reduce) for y in ir.walk(x.arg)):
                raise Unsupported(f"{where}: nested sums over state axes")
        elif isinstance(x, Load):
            named = [i for i in x.index if isinstance(i, str)]
            if len(set(named)) != len(named):
                raise Unsupported(f"{where}: load {x} indexes one axis twice")


def _live_state(e) -> bool:
    """Reads h outside any sum over state axes."""
    if isinstance(e, State):
        return True
    if isinstance(e, Op):
        return any(_live_state(a) for a in e.args)
    return False


def plan(region: Region) -> ScanPlan:
    r = region
    if r.reverse:
        raise Unsupported("reverse-time regions are not covered by the cuda kernel yet")
    if r.mix is not None:
        raise Unsupported("a non-diagonal transition (block-sparse A): the block-sparse kernel's (cuda_block_sparse.py)")
    if r.state_dtype not in ("float32", "float64"):
        raise Unsupported(f"state dtype {r.state_dtype} (fp32 or fp64 state only)")
    for i, s in enumerate(r.inputs):
        if s.dtype not in CTYPES:
            raise Unsupported(f"input {i} ({s.name}) has dtype {s.dtype}")
    for o in r.outputs:
        if o.dtype not in CTYPES:
            raise Unsupported(f"an output has dtype {o.dtype}")
    _check_expr(r.decay, "the decay", False, False)
    _check_expr(r.drive, "the drive", False, False)
    reduces: list[Reduce] = []
    for j, o in enumerate(r.outputs):
        _check_expr(o.expr, f"output {j}", True, True)
        reduces += [x for x in ir.walk(o.expr) if isinstance(x, Reduce) and x not in reduces]
    axsets = {frozenset(x.axes) for x in reduces}
    if len(axsets) > 1:
        raise Unsupported(f"outputs sum over different state axes {sorted(sorted(s) for s in axsets)}")
    inner_set = next(iter(axsets)) if axsets else frozenset()
    if not inner_set <= set(r.axes):
        raise Unsupported(f"a sum over {sorted(inner_set)}, not all of them state axes")
    inner = tuple(a for a in r.axes if a in inner_set)
    outer = tuple(a for a in r.axes if a not in inner_set)
    rw = _Exp2Rewrite(r, inner)
    decay, drive = rw(r.decay), rw(r.drive)
    outs = []
    for j, o in enumerate(r.outputs):
        e = rw(o.expr)
        has_red = any(isinstance(x, Reduce) for x in ir.walk(e))
        if o.kind == "final":
            if "t" in o.index:
                raise Unsupported(f"final output {j} is indexed by time")
            if has_red:
                raise Unsupported(f"final output {j} sums over state axes")
            where = "final"
        elif o.kind == "steps":
            if "t" not in o.index:
                raise Unsupported(f"per-step output {j} has no time dim")
            if any(a in inner_set for a in o.index if isinstance(a, str)) or _live_state(e):
                if has_red:
                    raise Unsupported(f"output {j} mixes a sum over {list(inner)} with values along them")
                where = "inner"
            else:
                where = "row"
        else:
            raise Unsupported(f"output kind {o.kind!r}")
        for ix in o.index:
            if not (ix == "t" or ix == 1 or ix in r.axes):
                raise Unsupported(f"output {j} index {ix!r}")
        outs.append(OutputPlan(j, o, e, where))
    compute = "double" if any(s.dtype == "float64" for s in r.inputs) or r.state_dtype == "float64" \
        else "float"
    reduces = tuple(dict.fromkeys(x for o in outs for x in ir.walk(o.expr) if isinstance(x, Reduce)))
    return ScanPlan(r, inner, outer, decay, drive, tuple(outs), reduces, compute, _params(r, outer, inner))


def _params(r: Region, outer, inner) -> tuple[Param, ...]:
    ps = []
    for k, s in enumerate(r.inputs):
        ps.append(Param(f"in{k}", f"const {CTYPES[s.dtype]}* __restrict__ in{k}", "ptr", ("in", k)))
    for k, o in enumerate(r.outputs):
        ps.append(Param(f"out{k}", f"{CTYPES[o.dtype]}* __restrict__ out{k}", "ptr", ("out", k)))
    for k, s in enumerate(r.inputs):
        for d in range(s.ndim):
            ps.append(Param(f"s{k}_{d}", f"const long long s{k}_{d}", "i64", ("in_stride", k, d)))
    for k, o in enumerate(r.outputs):
        for d in range(len(o.index)):
            ps.append(Param(f"os{k}_{d}", f"const long long os{k}_{d}", "i64", ("out_stride", k, d)))
    for a in (*outer, *inner):
        j = r.axes.index(a)
        ps.append(Param(f"size{j}", f"const long long size{j}", "i64", ("size", a)))
    ps.append(Param("L", "const int L", "i32", ("L",)))
    ps.append(Param("rows", "const long long rows", "i64", ("rows",)))
    ps.append(Param("N", "const int N", "i32", ("N",)))
    return tuple(ps)


class _Exp2Rewrite:
    """``exp(x) -> exp2(x * log2 e)``, folding log2(e) into the cheapest factor of a product."""

    def __init__(self, region: Region, inner):
        self.region, self.inner, self.memo = region, inner, {}

    def __call__(self, e):
        if e in self.memo:
            return self.memo[e]
        if isinstance(e, Op):
            args = tuple(self(a) for a in e.args)
            if e.name == "exp":
                out = Op("exp2", (self._scaled(args[0]),))
            else:
                out = Op(e.name, args, e.attrs)
        elif isinstance(e, Reduce):
            out = Reduce(self(e.arg), e.axes, e.op)
        else:
            out = e
        self.memo[e] = out
        return out

    def _scaled(self, x):
        if isinstance(x, Const):
            return Const(x.value * LOG2E)
        if isinstance(x, Op) and x.name == "mul" and not _live_state(x):
            p, q = x.args
            lp, lq = (_RANK[level(y, self.region, self.inner)] for y in (p, q))
            if isinstance(p, Const) or isinstance(q, Const):
                c, o = (p, q) if isinstance(p, Const) else (q, p)
                return Op("mul", (o, Const(c.value * LOG2E)))
            c, o = (p, q) if lp <= lq else (q, p)
            return Op("mul", (o, Op("mul", (c, Const(LOG2E)))))
        if isinstance(x, Op) and x.name == "neg":
            return Op("mul", (x.args[0], Const(-LOG2E)))
        return Op("mul", (x, Const(LOG2E)))


def level(e, region: Region, inner) -> str:
    ax = ir.axes_of(e, region.axes)
    has_t = "t" in ax or ir.uses_state(e)      # the state changes every step (ir.axes_of omits t)
    has_in = bool(ax & set(inner))
    return ST if (has_t and has_in) else TIME if has_t else STATE if has_in else BLOCK


# -- printing ------------------------------------------------------------------------------------

def const(v: float) -> str:
    if math.isnan(v):
        return "ssmc_t(SSMC_NAN)"
    if math.isinf(v):
        return "ssmc_t(SSMC_INF)" if v > 0 else "ssmc_t(-SSMC_INF)"
    return f"ssmc_t({v!r})"


def op_expr(e: Op, a: list[str], item: bool) -> str:
    """One op applied to printed arguments. `item`: inside a loop over a thread's items (i)."""
    n = e.name
    if n in _INFIX:
        return f"({a[0]} {_INFIX[n]} {a[1]})"
    if n in _CMP:
        return f"ssmc_t({a[0]} {_CMP[n]} {a[1]})"
    if n in _UNARY_FN:
        return f"{_UNARY_FN[n]}({a[0]})"
    if n == "neg":
        return f"(-{a[0]})"
    if n == "reciprocal":
        return f"(ssmc_t(1) / {a[0]})"
    if n == "exp2":
        return f"ssmc_exp2_it<POLY>({a[0]}, i)" if item else f"ssmc_exp2({a[0]})"
    if n == "exp":
        return f"ssmc_exp({a[0]})"
    if n == "pow":
        y = e.args[1]
        if isinstance(y, Const):
            if y.value == 1.0:
                return a[0]
            if y.value == 2.0:
                return f"({a[0]} * {a[0]})"
            if y.value == 3.0:
                return f"({a[0]} * {a[0]} * {a[0]})"
            if y.value == 0.5:
                return f"ssmc_sqrt({a[0]})"
            if y.value == -1.0:
                return f"(ssmc_t(1) / {a[0]})"
        return f"ssmc_pow({a[0]}, {a[1]})"
    if n == "maximum":
        return f"ssmc_max({a[0]}, {a[1]})"
    if n == "minimum":
        return f"ssmc_min({a[0]}, {a[1]})"
    if n == "where":
        return f"(({a[0]}) != ssmc_t(0) ? {a[1]} : {a[2]})"
    if n == "softplus":
        return f"ssmc_softplus({a[0]}, {const(float(e.attr('beta', 1.0)))}, {const(float(e.attr('threshold', 20.0)))})"
    if n == "cast":
        dt = e.attr("dtype")
        if dt == "bool":
            return f"ssmc_t({a[0]} != ssmc_t(0))"
        if dt in ("float32", "float64", "float16", "bfloat16"):
            return a[0]
        return f"ssmc_trunc({a[0]})"
    raise Unsupported(f"op {n!r} has no CUDA printing")


@dataclasses.dataclass
class Code:
    """Statements for each place in the kernel (see the template)."""
    block: list = dataclasses.field(default_factory=list)    # per thread, before the time loop
    time: list = dataclasses.field(default_factory=list)     # per chunk, before the state loop
    state: list = dataclasses.field(default_factory=list)    # per state element
    st: list = dataclasses.field(default_factory=list)       # per state element, item arrays
    replay: list = dataclasses.field(default_factory=list)   # per item, after h is updated
    epi: list = dataclasses.field(default_factory=list)      # per chunk, after the state loop
    final: list = dataclasses.field(default_factory=list)    # per state element, after the time loop
    init_stmts: list = dataclasses.field(default_factory=list)   # per state element, before the time loop
    gdecl: list = dataclasses.field(default_factory=list)    # per group: the [GE] / [GE][ITEMS] arrays of the
                                                             # state and st sections (one slot per state element
                                                             # in flight)
    decay: str = ""
    decay_kind: str = "chain"   # how a thread's product of decays is formed: "chain" (a product of its items'
                                # decays, per state element), "time" (the decay does not vary along the state
                                # axes: one product per chunk, shared), "factor" (decay = exp2(x_t * y_n): the
                                # product is exp2(y_n * sum of x over the items), one exp2 per state element)
    fact_x: str = ""            # "factor": x_t (a time-level item array reference, with [i])
    fact_y: str = ""            # "factor": y_n (a state-level reference)
    vec_ok: str = "true"        # every time run contiguous and aligned (whole chunks then load vectors: MODE 2)
    drive: str = ""
    init: str = ""
    accs: list = dataclasses.field(default_factory=list)     # accumulator names, one per sum
    time_shared: list = dataclasses.field(default_factory=list)  # time-level arrays the state loop reads
    time_epi: list = dataclasses.field(default_factory=list)     # time-level arrays the epilogue reads
                                                                 # (the sequential kernel computes time-level
                                                                 # values for its share of the items only)
    staged: list = dataclasses.field(default_factory=list)   # per-(state, step) loads the sequential kernel
                                                             # stages in shared memory (see `stage_plan`):
                                                             # dicts of input k, ctype, time dim td, offset
    stage_vec_ok: str = "true"  # every staged load's runs contiguous and aligned (async vector copies)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Loads of the state loop indexed by time and the state axes but by none of the row axes
    that vary inside a block of consecutive rows (Mamba's B and C: (batch, n, t), the same for
    every channel of a batch): the sequential kernel reads them once per block into shared
    memory instead of once per row. They may use the first `prefix` outer axes; those are the
    same for a block's rows when the outer sizes after them multiply to a multiple of the block's
    rows (`block_uniform`)."""
    loads: tuple            # ir.Load nodes, in first-use order
    prefix: int             # how many leading outer axes the loads use (0: none)

    def block_uniform(self, sizes: dict, outer, rows_per_block: int) -> bool:
        after = 1
        for a in outer[self.prefix:]:
            after *= int(sizes[a])
        return bool(self.loads) and (self.prefix == 0 or after % rows_per_block == 0)


def stage_plan(p: ScanPlan) -> StagePlan:
    loads, prefix = [], 0
    for ld in _all_loads(p):
        if ld in loads or "t" not in ld.index or level(ld, p.region, p.inner) != ST:
            continue
        used = [p.outer.index(a) for a in ld.index if isinstance(a, str) and a in p.outer]
        if p.outer and len(p.outer) - 1 in used:      # the fastest row axis: differs between rows of a block
            continue
        loads.append(ld)
        prefix = max([prefix, *(u + 1 for u in used)])
    return StagePlan(tuple(loads), prefix)


_ARRAY_SECTIONS = (TIME, ST, "epi")
_VISIBLE = {"nloop": (BLOCK, TIME, STATE, ST, "replay"), "epi": (BLOCK, TIME, "epi"),
            "final": (BLOCK, "final"), "init": (BLOCK, "init")}


class Emitter:
    """Prints each expression node once, as a variable in the section of its level; a node is
    referenced as ``v7[i]`` (an item array) or ``v7`` (a scalar)."""

    def __init__(self, p: ScanPlan):
        self.p, self.code, self.memo, self.count = p, Code(), {}, 0
        self.arrays: set[str] = set()      # item arrays [ITEMS]
        self.garrays: set[str] = set()     # per state element in flight and item [GE][ITEMS]
        self.gscalars: set[str] = set()    # per state element in flight [GE]
        self.acc = {red: f"acc{j}" for j, red in enumerate(p.reduces)}
        self.code.accs = list(self.acc.values())
        self.init_lines: list = []
        self.use_sec: str | None = None    # the section of the statement being printed (None: the template's)
        self.stage = stage_plan(p)
        self.code.staged = [dict(k=ld.input, ctype=CTYPES[p.region.inputs[ld.input].dtype], td=ld.index.index("t"),
                                 off=self.offset(ld.index, f"s{ld.input}", None)) for ld in self.stage.loads]

    # where a node lives, given what is being printed
    def home(self, e, phase: str) -> str:
        if phase in ("final", "init"):
            return BLOCK if (not ir.uses_state(e) and self.level(e) == BLOCK) else phase
        if _live_state(e):
            if phase != "nloop":
                raise Unsupported("the state is read after the state loop")
            return "replay"
        lv = self.level(e)
        if phase == "nloop":
            return lv
        if lv in (STATE, ST):
            raise Unsupported("a per-step output varies along the summed state axes")
        return BLOCK if lv == BLOCK else "epi"

    def level(self, e) -> str:
        return level(e, self.p.region, self.p.inner)

    def ref(self, e, phase: str, item: bool) -> str:
        if isinstance(e, Const):
            return const(e.value)
        if isinstance(e, State):
            if phase == "nloop":
                return "h[g]"
            if phase == "final":
                return "hfin"
            raise Unsupported("the state is read where it is not defined")
        if isinstance(e, Reduce):
            if phase != "epi":
                raise Unsupported("a sum over state axes is read before it is complete")
            return f"{self.acc[e]}[i]"
        if phase == "epi" and isinstance(e, Load) and self.level(e) == TIME:
            # a per-step input read again after the state loop instead of held in registers through it
            name = self.memo.get(("epi", e))
            if name is None:
                name = self._emit(e, "epi", phase)
                self.memo[("epi", e)] = name
            return self._use(name, item)
        for sec in _VISIBLE[phase]:
            name = self.memo.get((sec, e))
            if name is not None:
                return self._use(self._note(sec, name, phase), item)
        sec = self.home(e, phase)
        name = self._emit(e, sec, phase)
        self.memo[(sec, e)] = name
        return self._use(self._note(sec, name, phase), item)

    def _note(self, sec: str, name: str, phase: str) -> str:
        """Records a time-level array read from outside the time section (by the state loop or
        the epilogue)."""
        if sec == TIME and self.use_sec != TIME:
            used = self.code.time_shared if phase == "nloop" else self.code.time_epi if phase == "epi" else None
            if used is not None and name not in used:
                used.append(name)
        return name

    def _use(self, name: str, item: bool) -> str:
        if name in self.garrays:
            assert item, f"array {name} used outside an item loop"
            return f"{name}[g][i]"
        if name in self.gscalars:
            return f"{name}[g]"
        if name in self.arrays:
            assert item, f"array {name} used outside an item loop"
            return f"{name}[i]"
        return name

    def _emit(self, e, sec: str, phase: str) -> str:
        name = f"v{self.count}"
        self.count += 1
        array = sec in _ARRAY_SECTIONS
        grouped = sec in (STATE, ST)           # one slot per state element in flight: name[g]...
        out = self._section(sec)
        item = array or sec == "replay"
        comment = f"  // {_short(e)}"
        if grouped:
            self.code.gdecl.append(f"ssmc_t {name}[GE][ITEMS];" if array else f"ssmc_t {name}[GE];")
        if isinstance(e, Load):
            out.append(self._load(e, name, array, phase, grouped) + comment)
        else:
            outer, self.use_sec = self.use_sec, sec
            try:
                args = [self.ref(a, phase, item) for a in e.args]
            finally:
                self.use_sec = outer
            rhs = op_expr(e, args, item)
            if grouped and array:
                out.append(f"SSMC_ITEMS(i) {name}[g][i] = {rhs};" + comment)
            elif grouped:
                out.append(f"{name}[g] = {rhs};" + comment)
            elif array:
                out.append(f"ssmc_t {name}[ITEMS]; SSMC_ITEMS(i) {name}[i] = {rhs};" + comment)
            else:
                out.append(f"const ssmc_t {name} = {rhs};" + comment)
        if grouped:
            (self.garrays if array else self.gscalars).add(name)
        elif array:
            self.arrays.add(name)
        return name

    def _section(self, sec: str) -> list:
        return self.init_lines if sec == "init" else getattr(self.code, sec)

    def offset(self, index, strides: str, at_t: str | None) -> str:
        terms = []
        for d, ix in enumerate(index):
            if ix == "t":
                if at_t is not None:
                    terms.append(f"(long long)({at_t}) * {strides}_{d}")
            elif isinstance(ix, str):
                terms.append(f"{self.p.axis_var(ix)} * {strides}_{d}")
            elif ix:
                terms.append(f"{int(ix)}LL * {strides}_{d}")
        return " + ".join(terms) or "0"

    def _load(self, e: Load, name: str, array: bool, phase: str, grouped: bool = False) -> str:
        k = e.input
        if "t" in e.index:
            td = e.index.index("t")
            if array:
                off = self.offset(e.index, f"s{k}", None)
                dst = f"{name}[g]" if grouped else name
                decl = "" if grouped else f"ssmc_t {name}[ITEMS]; "
                ptr = f"ssmc_fresh<SSMC_FRESH>(in{k})" if phase == "epi" else f"in{k}"
                load = f"ssmc_load_run<ITEMS, MODE>({ptr} + ({off}), s{k}_{td}, t_begin, L, {dst});"
                if grouped and phase == "nloop" and e in self.stage.loads:
                    j = self.stage.loads.index(e)
                    # the sequential kernel reads it from the block's stage, the others from memory
                    return (f"if constexpr (SSMC_STAGED) ssmc_stage_get<ITEMS>(ssmc_stage_row({j}, g), {dst}, "
                            f"ssmc_swz); else {load}")
                return decl + load
            if phase == "final":
                return f"const ssmc_t {name} = ssmc_cvt(in{k}[{self.offset(e.index, f's{k}', 'L - 1')}]);"
            raise Unsupported(f"load {e} of a time step outside the time loop")
        if grouped:
            return f"{name}[g] = ssmc_cvt(in{k}[{self.offset(e.index, f's{k}', None)}]);"
        return f"const ssmc_t {name} = ssmc_cvt(in{k}[{self.offset(e.index, f's{k}', None)}]);"


def _short(e, limit: int = 80) -> str:
    """The expression as ir prints it, cut at `limit` characters; stops early, so deep
    expressions cost no more than the cut (ir's own __str__ is exponential in depth)."""
    out: list[str] = []
    room = [limit + 1]

    def put(t: str):
        if room[0] > 0:
            out.append(t[:room[0]])
            room[0] -= len(t)

    def go(x):
        if room[0] <= 0:
            return
        if isinstance(x, Op):
            sym = ir._INFIX.get(x.name)
            if sym and len(x.args) == 2 and not x.attrs:
                put("(")
                go(x.args[0])
                put(f" {sym} ")
                go(x.args[1])
                put(")")
                return
            put(f"{x.name}(")
            for j, a in enumerate(x.args):
                put(", " if j else "")
                go(a)
            put("".join(f", {k}={v!r}" for k, v in x.attrs) + ")")
        elif isinstance(x, Reduce):
            put(f"{x.op}(")
            go(x.arg)
            put(f", over={list(x.axes)})")
        else:
            put(str(x))
    go(e)
    text = "".join(out)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _all_loads(p: ScanPlan) -> list:
    out = ir.loads(p.decay) + ir.loads(p.drive)
    for o in p.outputs:
        out += ir.loads(o.expr)
    return out


def _run_conds(ptr: str, strides: str, index) -> list[str]:
    """The run-time conditions for a tensor's runs of ITEMS steps to be read or written as
    aligned vectors: contiguous in time, the base aligned, every other stride a multiple."""
    td = index.index("t")
    return [f"ssmc_vec_base<ITEMS>({ptr}, {strides}_{td})",
            *(f"ssmc_vec_stride<ITEMS>({ptr}, {strides}_{d})" for d in range(len(index)) if d != td)]


def emit(p: ScanPlan) -> Code:
    em = Emitter(p)
    c = em.code
    # the recurrence and everything that needs h: the state loop
    c.decay = em.ref(p.decay, "nloop", True)
    c.drive = em.ref(p.drive, "nloop", True)
    c.decay_kind = "chain"
    lv = em.level(p.decay)
    if lv in (BLOCK, TIME):
        c.decay_kind = "time"
    elif isinstance(p.decay, Op) and p.decay.name == "exp2" and isinstance(p.decay.args[0], Op) \
            and p.decay.args[0].name == "mul" and not ir.uses_state(p.decay):
        x, y = p.decay.args[0].args
        if em.level(x) == STATE and em.level(y) == TIME:
            x, y = y, x
        if em.level(x) == TIME and em.level(y) in (STATE, BLOCK):
            c.decay_kind = "factor"
            c.fact_x = em.ref(x, "nloop", True)
            c.fact_y = em.ref(y, "nloop", False)
    for red in p.reduces:
        c.replay.append(f"{em.acc[red]}[i] += {em.ref(red.arg, 'nloop', True)};")
    for o in p.outputs:
        if o.where != "inner":
            continue
        v = em.ref(o.expr, "nloop", True)
        ct = CTYPES[o.spec.dtype]
        off = em.offset(o.spec.index, f"os{o.k}", "t_begin + i")
        c.replay.append(f"if (row_ok && t_begin + i < L) out{o.k}[{off}] = ssmc_from<{ct}>({v});"
                        f"  // output {o.k}")
    # per-step outputs of each row, after the state loop
    for o in p.outputs:
        if o.where != "row":
            continue
        v = em.ref(o.expr, "epi", True)
        if not v.endswith("[i]"):          # a scalar or a constant along time: make it an array
            name = f"v{em.count}"
            em.count += 1
            c.epi.append(f"ssmc_t {name}[ITEMS]; SSMC_ITEMS(i) {name}[i] = {v};")
            v = name + "[i]"
        td = o.spec.index.index("t")
        off = em.offset(o.spec.index, f"os{o.k}", None)
        c.epi.append(f"ssmc_store_run<ITEMS, MODE>(out{o.k} + ({off}), os{o.k}_{td}, t_begin, row_out ? L : 0, "
                     f"{v[:-3]});  // output {o.k}")
    # when the whole chunk may use unchecked vector loads and stores (uniform over the grid)
    time_loads = list(dict.fromkeys(ld for ld in _all_loads(p) if "t" in ld.index))
    conds = [x for ld in time_loads for x in _run_conds(f"in{ld.input}", f"s{ld.input}", ld.index)]
    for o in p.outputs:
        if o.where == "row":
            conds += _run_conds(f"out{o.k}", f"os{o.k}", o.spec.index)
    c.vec_ok = " && ".join(dict.fromkeys(conds)) or "true"
    sconds = [x for ld in em.stage.loads for x in _run_conds(f"in{ld.input}", f"s{ld.input}", ld.index)]
    c.stage_vec_ok = " && ".join(dict.fromkeys(sconds)) or "true"
    # final outputs from the last state
    for o in p.outputs:
        if o.where != "final":
            continue
        v = em.ref(o.expr, "final", False)
        ct = CTYPES[o.spec.dtype]
        c.final.append(f"out{o.k}[{em.offset(o.spec.index, f'os{o.k}', None)}] = ssmc_from<{ct}>({v});"
                       f"  // output {o.k}")
    # the initial state element
    r = p.region
    if r.init is not None:
        c.init = em.ref(Load(r.init, tuple(r.axes)), "init", False)
    else:
        c.init = "ssmc_t(0)"
    c.init_stmts = em.init_lines
    return c
