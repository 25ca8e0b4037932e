"""Reverse-mode differentiation of region expressions, on the IR itself.

`backprop(root, seed)` returns, for every leaf of an expression (each `Load` and `State`), the
expression of d(seed-weighted root)/d(leaf) evaluated at the same iteration point. Broadcasting
needs no rule of its own: every expression is evaluated at the full iteration point, so the
adjoint of a `Reduce` is its seed, summed over the reduced axes where its use is evaluated along
them (one copy a point), and a leaf's adjoint is summed over the axes the leaf does not vary
along by whoever accumulates it into an input's gradient. The backward of a region
(`region_adjoint`) is built from these: the adjoint of the state runs the same linear
recurrence in reverse time,
    lam_t = dy_t/dh_t + a_{t+1} lam_{t+1},  da_t = lam_t h_{t-1},  db_t = lam_t,
and the gradients of the inputs follow through the decay, drive and output expressions. With a
non-diagonal transition m (`Region.mix`), lam_t also gets m_{t+1}^T lam_{t+1}, and
dm_t[.., i, j] = lam_t[.., i] h_{t-1}[.., j] flows into the matrix expression (`mix_loads`).
"""
from __future__ import annotations

import dataclasses
import math

from .ir import MIX_COL, Const, Expr, InputSpec, Load, Mix, Op, OutputSpec, Reduce, Region, State, loads, map_loads

ONE, ZERO = Const(1.0), Const(0.0)


def add(x, y):
    if x is None:
        return y
    if y is None:
        return x
    return Op("add", (x, y))


def mul(x, y):
    if x is None or y is None:
        return None
    if x == ONE:
        return y
    if y == ONE:
        return x
    return Op("mul", (x, y))


def _where(c, x, y):
    return Op("where", (c, x, y))


def chain(g, d):
    """g * d, a selecting derivative (``where(c, 1, 0)``: relu, where, maximum) taken as the
    selection of g, as torch's backward does: a gradient of inf (sqrt's at 0) through a branch
    not taken is 0, not inf * 0 = nan."""
    if isinstance(d, Op) and d.name == "where":
        x, y = chain(g, d.args[1]), chain(g, d.args[2])
        return _where(d.args[0], ZERO if x is None else x, ZERO if y is None else y)
    if d == ZERO:
        return None
    return mul(g, d)


def derivative(e: Op, j: int):
    """d e / d e.args[j] as an expression of e's arguments and e itself; None for zero."""
    a = e.args
    x = a[j]
    n = e.name
    if n == "add":
        return ONE
    if n == "sub":
        return ONE if j == 0 else Const(-1.0)
    if n == "mul":
        return a[1 - j]
    if n == "div":
        return Op("reciprocal", (a[1],)) if j == 0 else Op("neg", (Op("div", (e, a[1])),))
    if n == "neg":
        return Const(-1.0)
    if n == "exp":
        return e
    if n == "exp2":
        return Op("mul", (e, Const(math.log(2.0))))
    if n == "expm1":
        return Op("add", (e, ONE))
    if n == "log":
        return Op("reciprocal", (x,))
    if n == "log1p":
        return Op("reciprocal", (Op("add", (x, ONE)),))
    if n == "sqrt":
        return Op("div", (Const(0.5), e))
    if n == "rsqrt":
        return Op("mul", (Const(-0.5), Op("mul", (e, Op("mul", (e, e))))))
    if n == "tanh":
        return Op("sub", (ONE, Op("mul", (e, e))))
    if n == "sigmoid":
        return Op("mul", (e, Op("sub", (ONE, e))))
    if n == "logsigmoid":
        return Op("sigmoid", (Op("neg", (x,)),))
    if n == "softplus":
        beta, th = e.attr("beta", 1.0), e.attr("threshold", 20.0)
        bx = Op("mul", (x, Const(beta)))
        return _where(Op("gt", (bx, Const(th))), ONE, Op("sigmoid", (bx,)))
    if n == "silu":
        s = Op("sigmoid", (x,))
        return Op("mul", (s, Op("add", (ONE, Op("mul", (x, Op("sub", (ONE, s))))))))
    if n == "relu":
        return _where(Op("gt", (x, ZERO)), ONE, ZERO)
    if n == "abs":
        return _where(Op("gt", (x, ZERO)), ONE, _where(Op("lt", (x, ZERO)), Const(-1.0), ZERO))
    if n == "reciprocal":
        return Op("neg", (Op("mul", (e, e)),))
    if n == "sin":
        return Op("cos", (x,))
    if n == "cos":
        return Op("neg", (Op("sin", (x,)),))
    if n == "pow":
        if j == 0:
            return Op("mul", (a[1], Op("pow", (a[0], Op("sub", (a[1], ONE))))))
        return Op("mul", (e, Op("log", (a[0],))))
    if n in ("maximum", "minimum"):          # ties split the gradient, as torch does
        y = a[1 - j]
        win = Op("gt", (x, y)) if n == "maximum" else Op("lt", (x, y))
        return _where(win, ONE, _where(Op("eq", (x, y)), Const(0.5), ZERO))
    if n == "where":
        if j == 0:
            return None
        return _where(a[0], ONE, ZERO) if j == 1 else _where(a[0], ZERO, ONE)
    if n == "cast":
        return ONE if e.attr("dtype") in ("float32", "float64", "float16", "bfloat16") else None
    if n in ("gt", "lt", "ge", "le", "eq", "ne"):
        return None
    raise NotImplementedError(f"no derivative for op {n}")


def backprop(root: Expr, seed: Expr, point=()) -> dict:
    """{leaf: adjoint expression} for every Load and State leaf reachable from root.

    `point`: the axes root is evaluated at, one value each (a drive: the state axes; an output:
    its named index). A node is differentiated once per set of axes it is evaluated at (inside
    a `Reduce` also along the reduced axes), so a value used both inside and outside a sum gets
    each use's adjoint. A `Reduce` is constant along its axes; where it is used at every point
    along one of them (the drive k_i * sum_i'(k_i' x_i')), each point's use is a copy, and its
    argument's adjoint is the seed summed over those axes; along axes the use is not evaluated
    at (a readout's sum over the state) there is one copy: the seed as it is. A load whose uses
    sit at different points has each use's adjoint summed over the axes of its point the load
    does not vary along (the caller sums a leaf's adjoint over those axes, which would count a
    use at fewer axes once per element of the others)."""
    start = (root, frozenset(point))
    order, seen = [], set()

    def visit(key):                              # (node, point) pairs, children after parents
        stack = [(key, False)]
        while stack:
            k, done = stack.pop()
            if done:
                order.append(k)
                continue
            if k in seen:
                continue
            seen.add(k)
            stack.append((k, True))
            node, p = k
            if isinstance(node, Op):
                kids = [(a, p) for a in node.args if not isinstance(a, Const)]
            elif isinstance(node, Reduce):
                kids = [(node.arg, p | frozenset(node.axes))]
            else:
                kids = []
            stack.extend((c, False) for c in kids if c not in seen)
    visit(start)
    adj = {start: seed}
    for key in reversed(order):
        g = adj.get(key)
        if g is None:
            continue
        node, p = key
        if isinstance(node, Op):
            for j, arg in enumerate(node.args):
                if isinstance(arg, Const):
                    continue
                d = derivative(node, j)
                if d is not None:
                    adj[(arg, p)] = add(adj.get((arg, p)), chain(g, d))
        elif isinstance(node, Reduce):
            copies = tuple(a for a in node.axes if a in p)
            k = (node.arg, p | frozenset(node.axes))
            adj[k] = add(adj.get(k), Reduce(g, copies) if copies else g)
    uses: dict = {}
    for (node, p), g in adj.items():
        if isinstance(node, (Load, State)) and g is not None:
            uses.setdefault(node, []).append((p, g))
    out = {}
    for leaf, gs in uses.items():
        own = frozenset(ix for ix in leaf.index if isinstance(ix, str)) | {"t"} if isinstance(leaf, Load) \
            else None                                # time: summed by the caller
        split = own is not None and len({p - own for p, _ in gs}) > 1
        for p, g in gs:
            over = tuple(sorted(p - own)) if split else ()
            out[leaf] = add(out.get(leaf), Reduce(g, over) if over else g)
    return out


# sentinel leaves the backward seeds with values it already has
GRAD_A = Load(-1, ("t",))        # dL/da_t
GRAD_B = Load(-2, ("t",))        # dL/db_t
GRAD_M = Load(-3, ("t",))        # dL/dm_t[.., i, j] of a region's Mix (lam_t[.., i] h_{t-1}[.., j])


def grad_output(region: Region, k: int) -> Load:
    """The gradient of output k, read like the output is written (a size-1 dim, written 1 in
    an output's index, is read at index 0)."""
    return Load(len(region.inputs) + k, tuple(0 if ix == 1 else ix for ix in region.outputs[k].index))


@dataclasses.dataclass(frozen=True)
class Adjoint:
    """The backward of a region, as expressions:
    state_steps: dL/dh_t from the per-step outputs (in terms of State = h_t and the output grads)
    state_final: dL/dh_{L-1} from the final outputs
    loads_steps / loads_final: (Load, adjoint) pairs for inputs read by the outputs
    loads_decay / loads_drive: (Load, adjoint in terms of GRAD_A / GRAD_B) for a_t and b_t."""
    state_steps: Expr | None
    state_final: Expr | None
    loads_steps: tuple
    loads_final: tuple
    loads_decay: tuple
    loads_drive: tuple


def mix_loads(region: Region) -> tuple:
    """(Load, adjoint in terms of GRAD_M) for the loads of the region's transition matrix."""
    if region.mix is None:
        return ()
    point = (*region.axes, MIX_COL)
    return tuple((l, e) for l, e in backprop(region.mix.expr, GRAD_M, point).items() if isinstance(l, Load))


def region_adjoint(region: Region) -> Adjoint:
    steps, final = None, None
    ls, lf = [], []
    for k, o in enumerate(region.outputs):
        g = backprop(o.expr, grad_output(region, k), [ix for ix in o.index if isinstance(ix, str)])
        for leaf, e in g.items():
            if isinstance(leaf, State):
                if o.kind == "steps":
                    steps = add(steps, e)
                else:
                    final = add(final, e)
            else:
                (ls if o.kind == "steps" else lf).append((leaf, e))
    da = [(l, e) for l, e in backprop(region.decay, GRAD_A, region.axes).items() if isinstance(l, Load)]
    db = [(l, e) for l, e in backprop(region.drive, GRAD_B, region.axes).items() if isinstance(l, Load)]
    return Adjoint(steps, final, tuple(ls), tuple(lf), tuple(da), tuple(db))


# -- the chunked backward of a region with a non-diagonal transition --------------------------------

@dataclasses.dataclass(frozen=True)
class ChunkScan:
    """A forward region derived from another for one chunk of its steps, and how to feed it:
    its input k is the original input ``reads[k]`` (the chunk's steps of it along dim ``tdim[k]``,
    in time order; an input without a time dim, None, whole), then one tensor per name in
    ``extra`` (time along dim ``extra_tdim[j]``, or None). ``backwards``: the region runs from the
    chunk's last step to its first, step s reading every time-indexed input at index T-1-s and
    writing its per-step outputs there (`time_dims` names them for the kernel)."""
    region: Region
    reads: tuple[int, ...]
    tdim: tuple
    extra: tuple[str, ...]
    backwards: bool = False
    extra_tdim: tuple = ()

    def inputs(self, inputs, t0: int, t1: int, extra) -> list:
        out = []
        for i, d in zip(self.reads, self.tdim):
            x = inputs[i]
            out.append(x.narrow(d, t0, t1 - t0) if d is not None else x)
        return out + list(extra)

    def time_dims(self) -> dict | None:
        """{input of the region: its time dim} when it runs backwards, else None."""
        if not self.backwards:
            return None
        dims = list(self.tdim) + list(self.extra_tdim) + [None] * (len(self.extra) - len(self.extra_tdim))
        return {k: d for k, d in enumerate(dims) if d is not None}


def time_dims(r: Region, exprs) -> dict | str:
    """{input: the dim it is read along time} for the inputs the expressions read, or why they
    cannot be cut into chunks of steps (an input read along time at two dims, or at a fixed step
    of its time dim)."""
    tdim: dict = {}
    for ld in (x for e in exprs for x in loads(e)):
        if "t" in ld.index:
            d = ld.index.index("t")
            if tdim.setdefault(ld.input, d) != d:
                return f"input {ld.input} ({r.inputs[ld.input].name}) is read along time at two dims"
    for ld in (x for e in exprs for x in loads(e)):
        d = tdim.get(ld.input)
        if d is not None and ld.index[d] != "t":
            return f"input {ld.input} ({r.inputs[ld.input].name}) is read at a fixed step as well as along time"
    return tdim


def chunk_scans(r: Region, cdt: str) -> tuple[ChunkScan, ChunkScan, ChunkScan] | str:
    """The three recurrences the chunked backward of a region with a `Mix` runs over a chunk of
    steps [t0, t1), each an ordinary forward region (so a target's forward kernel runs it):

    final    the state after the chunk from the state before it (extra input h0): checkpoints;
    states   every state of the chunk from h0 (outputs laid out (t, *state axes));
    adjoint  lam, backwards in time: lam_t = a_(t+1) lam_(t+1) + m_(t+1)^T lam_(t+1) + g_t,
             with g_t = dL/dh_t from the outputs. It runs from the chunk's last step to its first
             (`ChunkScan.backwards`): step s, at index u = T-1-s of the chunk, reads the
             transition at t0+u and the drive at u, which the caller fills with g_(t0+u-1) (0 at
             u = 0); the initial state is lam_(t1-1). The state it writes at u is lam_(t0+u-1),
             and at u = 0 a_t0 lam_t0 + m_t0^T lam_t0: dL/dh before the chunk. The transposed
             matrix is the matrix expression with the state's last axis and the column axis
             swapped; its block mask is the transpose.

    A reason string where the inputs cannot be cut into chunks (`time_dims`)."""
    m = r.mix
    if m is None:
        raise ValueError(f"region {r.name} has no non-diagonal transition")
    fwd_exprs = (r.decay, r.drive, m.expr)
    tdim = time_dims(r, fwd_exprs)
    if isinstance(tdim, str):
        return tdim
    axes, reg = tuple(r.axes), r.axes[-1]
    tdim.setdefault(r.length[0], r.length[1])
    state_in = InputSpec("state", len(axes), cdt)
    steps_out = OutputSpec("steps", State(), ("t", *axes), cdt)

    def reads_of(*exprs, also=()):
        return tuple(sorted({ld.input for e in exprs for ld in loads(e)} | set(also)))

    def renumbered(reads):
        at = {i: k for k, i in enumerate(reads)}
        return lambda ld: Load(at[ld.input], ld.index)

    def scan(name, reads, extra, init, extra_names, backwards=False, extra_tdim=(), **fields):
        """The region reading `reads`, then the extra inputs; its initial state the init-th extra."""
        n = len(reads)
        reg_ = Region(name=f"{r.name}_{name}", axes=axes, axis_size=tuple((n + init, k) for k in range(len(axes))),
                      inputs=tuple(r.inputs[i] for i in reads) + extra, init=n + init,
                      state_dtype=r.state_dtype, **fields)
        return ChunkScan(reg_, reads, tuple(tdim.get(i) for i in reads), extra_names, backwards, extra_tdim)

    reads = reads_of(*fwd_exprs, also=(r.length[0],))
    mp = renumbered(reads)
    fwd = dict(length=(reads.index(r.length[0]), r.length[1]), decay=map_loads(r.decay, mp),
               drive=map_loads(r.drive, mp), mix=dataclasses.replace(m, expr=map_loads(m.expr, mp)))
    states = scan("states", reads, (state_in,), 0, ("h0",), outputs=(steps_out,), **fwd)
    final = scan("final", reads, (state_in,), 0, ("h0",), outputs=(OutputSpec("final", State(), axes, cdt),), **fwd)

    reads = reads_of(r.decay, m.expr)
    mp = renumbered(reads)
    swap = {reg: MIX_COL, MIX_COL: reg}
    mt = map_loads(m.expr, lambda ld: mp(Load(ld.input, tuple(swap.get(ix, ix) for ix in ld.index))), axes=swap)
    n = len(reads)
    adjoint = scan("adjoint", reads, (InputSpec("grad_state", 1 + len(axes), cdt), state_in), 1, ("g", "lam0"),
                   backwards=True, extra_tdim=(0, None), outputs=(steps_out,), length=(n, 0),
                   decay=map_loads(r.decay, mp),
                   drive=Load(n, ("t", *axes)),
                   mix=Mix(mt, m.block, tuple(sorted((c, b) for b, c in m.blocks)), m.nblocks, m.axis))
    return final, states, adjoint
