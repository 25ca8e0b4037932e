"""From a re-rolled step body to a `Region` plus what runs around it (a `Plan`).

Shared by detect_recurrence (no fusion), fuse_prologue and fuse_epilogue (which switch fusion
on): each calls `assemble` and the printed region after each pass shows what it changed.

1. Dim labels. Every dim of every body value is a variable; elementwise broadcasting, views,
   reductions and einsum letters say which dims are the same index (union-find). Classes that
   meet a dim of the state become state axes ``i0, i1, ...``. A value can live inside the
   kernel only if each of its dims of size > 1 has a label.
2. Expressions. Starting from a_t, b_t and the outputs, fused nodes become `Op`/`Reduce`
   expressions; the rest become `Load`s of region inputs: outer tensors (read at step t along
   their time dim), loop invariants, or values computed before the region for all steps at
   once (`torch.func.vmap` of the step's state-free part: "pre").
3. Outputs. Values derived from the state that cannot be fused are computed after the region
   from its stacked outputs, again by vmap over time ("post").
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from . import ir
from .ir import Const, InputSpec, Load, Op, OutputSpec, Reduce, Region, State
from .ops import Canon, canonical, dtype, is_tensor, shape


class AssembleError(Exception):
    """The loop cannot be expressed as a region; the message says why."""


@dataclasses.dataclass
class Recurrence:
    """What detect_recurrence proved: new = a * prev + b, a and b free of the state."""
    prev: fx.Node            # body placeholder of the carried state
    new: fx.Node             # body node of the new state
    a: Any                   # body node or python number
    b: Any
    state_nodes: set         # body nodes that depend on the state (path + epilogue)
    epilogue: set            # body nodes computed from the new state
    m: Any = None            # body node: non-diagonal transition (*state, j), or None
    m_dim: int | None = None # the state dim m acts along (None: the last)


@dataclasses.dataclass
class Plan:
    region: Region
    sources: list            # per region input: ("outer", node, time_dim, start) | ("pre", body node) | ("init",)
    results: list            # per loop result: ("out", k, flatten_dim | None) | ("post", body node, k_last | None)
    boundary: dict           # body node -> region output (stacked over t at dim 0), for post
    fused: set               # body nodes inside the kernel


class Labels:
    """Union-find over (node, dim)."""

    def __init__(self, split=frozenset()):
        self.parent: dict = {}
        self.axis: dict = {}         # root -> axis name
        self.conflict: str | None = None
        self.split = split           # views of loop inputs labelled apart from what they view

    def find(self, x):
        p = self.parent.setdefault(x, x)
        if p != x:
            p = self.parent[x] = self.find(p)
        return p

    def union(self, x, y):
        rx, ry = self.find(x), self.find(y)
        if rx == ry:
            return
        ax, ay = self.axis.get(rx), self.axis.get(ry)
        if ax and ay and ax != ay and self.conflict is None:
            self.conflict = f"state axes {ax} and {ay} are mixed by {x[0].name}/{y[0].name}"
        self.parent[ry] = rx
        if ay and not ax:
            self.axis[rx] = ay

    def label(self, node, d) -> str | None:
        return self.axis.get(self.find((node, d)))


def _labels(body: fx.Graph, rec: Recurrence, split=frozenset()) -> Labels:
    lab = Labels(split)
    for d in range(len(shape(rec.prev))):
        lab.union((rec.prev, d), (rec.new, d))
        lab.axis[lab.find((rec.prev, d))] = f"i{d}"
    if rec.m is not None:        # M[.., i, j]: leading dims are the state's, the last is the column
        ms, ss = shape(rec.m), shape(rec.prev)
        lab.axis[lab.find((rec.m, len(ms) - 1))] = ir.MIX_COL
        for r in range(1, len(ms)):
            if ms[-1 - r] != 1 and r <= len(ss):
                lab.union((rec.prev, len(ss) - r), (rec.m, len(ms) - 1 - r))
    ss = shape(rec.prev)
    for v in (rec.a, rec.b) if rec.m is None else (rec.b,):   # laid out as the state (broadcast)
        if isinstance(v, fx.Node) and is_tensor(v) and len(shape(v)) <= len(ss):
            off = len(ss) - len(shape(v))
            for j, s in enumerate(shape(v)):
                if s != 1 and s == ss[j + off]:
                    lab.union((v, j), (rec.prev, j + off))
    for n in body.nodes:
        if n.op not in ("call_function", "call_method") or not is_tensor(n):
            continue
        c = canonical(n)
        if c is None:
            _label_moves(lab, n)
            continue
        if c.kind == "contract" and n in rec.state_nodes and n not in rec.epilogue:
            continue     # the state's matrix product: its row and column are different axes
        out = shape(n)
        if c.kind in ("ew", "identity"):
            for a in c.tensor_args():
                ia = shape(a)
                off = len(out) - len(ia)
                for j, s in enumerate(ia):
                    if s != 1 and s == out[j + off]:
                        lab.union((n, j + off), (a, j))
        elif c.kind == "view" and n not in split:
            for i, src in enumerate(c.params["src"]):
                if src is not None and out[i] != 1:
                    lab.union((n, i), (c.args[0], src))
        elif c.kind == "reduce":
            kept = [j for j in range(len(shape(c.args[0]))) if j not in c.params["dims"]]
            if c.params["keepdim"]:
                for j in kept:
                    lab.union((n, j), (c.args[0], j))
            else:
                for i, j in enumerate(kept):
                    lab.union((n, i), (c.args[0], j))
        elif c.kind == "contract":
            first: dict[str, tuple] = {}
            for a, sub in zip(c.args, c.params["subs"]):
                for j, ch in enumerate(sub):
                    if shape(a)[j] == 1:
                        continue
                    if ch in first:
                        lab.union(first[ch], (a, j))
                    else:
                        first[ch] = (a, j)
            for i, ch in enumerate(c.params["out"]):
                if ch in first and out[i] != 1:
                    lab.union(first[ch], (n, i))
    return lab


def _label_moves(lab: Labels, n: fx.Node) -> None:
    """``torch.cat``, ``torch.roll`` and ``F.pad`` (slices of a state moved along one dim, see
    detect_recurrence's `segments`): every other dim is the same axis in the inputs and the
    output."""
    name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
    out = shape(n)
    if name in ("cat", "concat"):
        parts, d = (n.args[0] if n.args else ()), (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
        if not isinstance(d, int) or not isinstance(parts, (list, tuple)):
            return
        keep = [j for j in range(len(out)) if j != d % len(out)]
    elif name in ("roll", "pad") and n.args and isinstance(n.args[0], fx.Node):
        parts, a = [n.args[0]], shape(n.args[0])
        keep = [j for j in range(len(out)) if len(a) == len(out) and a[j] == out[j]]
    else:
        return
    for p in parts:
        if isinstance(p, fx.Node) and is_tensor(p) and len(shape(p)) == len(out):
            for j in keep:
                if out[j] != 1 and shape(p)[j] == out[j]:
                    lab.union((n, j), (p, j))


def _input_views(body: fx.Graph, loop) -> frozenset:
    """View nodes of the body whose tensor is a per-step read or a loop invariant, directly or
    through other such views (``kt = k[:, t, :, None]; kt @ kt.transpose(-1, -2)``)."""
    leaves = set(loop.read_nodes()) | set(loop.invariant_nodes())
    out = set()
    for n in body.nodes:
        if n.op in ("call_function", "call_method") and is_tensor(n):
            c = canonical(n)
            if c is not None and c.kind == "view" and not c.params["consts"] and (c.args[0] in leaves
                                                                                  or c.args[0] in out):
                out.add(n)
    return frozenset(out)


def _dims_labeled(lab: Labels, n) -> bool:
    if not isinstance(n, fx.Node):
        return True
    return all(s == 1 or lab.label(n, d) for d, s in enumerate(shape(n)))


def _float(dt) -> bool:
    return dt is not None and dt.is_floating_point


def fusable(n: fx.Node, lab: Labels) -> Canon | None:
    """The node's canonical form when it can be computed inside a kernel, else None."""
    if n.op not in ("call_function", "call_method") or not is_tensor(n):
        return None
    c = canonical(n)
    if c is None or c.kind not in ("ew", "identity", "view", "reduce", "contract"):
        return None
    if c.kind == "ew" and c.op == "cast" and not (_float(c.params["dtype"]) or c.params["dtype"] == torch.bool):
        return None
    if c.kind == "view" and c.params["consts"]:
        return None
    if not _dims_labeled(lab, n) or not (n in lab.split or all(_dims_labeled(lab, a) for a in c.tensor_args())):
        return None
    for a in c.tensor_args():
        if not _float(dtype(a)) and dtype(a) != torch.bool:
            return None
    return c


class _Builder:
    def __init__(self, loop, rec: Recurrence, lab: Labels, fuse: set, expand_outer: bool):
        self.loop, self.rec, self.lab, self.fuse = loop, rec, lab, fuse
        self.expand_outer = expand_outer
        self.sources: list = []
        self.src_index: dict = {}
        self.memo: dict = {}
        self.kind = {}
        for i, p in enumerate(loop.carry_nodes()):
            self.kind[p] = ("carry", i)
        for i, p in enumerate(loop.read_nodes()):
            self.kind[p] = ("read", i)
        for i, p in enumerate(loop.invariant_nodes()):
            self.kind[p] = ("inv", i)
        self.time_dep = _time_dependent(loop)

    def source(self, key) -> int:
        if key not in self.src_index:
            self.src_index[key] = len(self.sources)
            self.sources.append(key)
        return self.src_index[key]

    def index(self, n, extra_t_at: int | None) -> tuple:
        idx = []
        for d, s in enumerate(shape(n)):
            lbl = self.lab.label(n, d)
            if lbl is None:
                if s != 1:
                    raise AssembleError(f"{n.name} has a dim of size {s} that is not a state axis")
                lbl = 0
            elif lbl in idx:
                # one value with two dims on one axis would be read along its diagonal: a matrix
                # that is also used elsewhere with its rows on the axis of its columns here
                raise AssembleError(f"{n.name} has two dims on state axis {lbl}")
            idx.append(lbl)
        if extra_t_at is not None:
            idx.insert(extra_t_at, "t")
        return tuple(idx)

    def leaf(self, n, own: tuple | None = None) -> ir.Expr:
        """A load of `n`, indexed by its labels or by `own` (its index through a view of it
        labelled apart: `_view_load`)."""
        def at(t_at):
            if own is None:
                return self.index(n, t_at)
            return own if t_at is None else (*own[:t_at], "t", *own[t_at:])
        k = self.kind.get(n)
        if k and k[0] == "read":
            r = self.loop.reads[k[1]]
            return self.outer(r.source, at(r.dim), r.dim, r.start)
        if k and k[0] == "inv":
            inv = self.loop.invariants[k[1]]
            return self.outer(inv, at(None), None, 0)
        if k and k[0] == "carry":
            raise AssembleError("the previous state is read outside the recurrence")
        if n in self.rec.state_nodes:
            raise AssembleError(f"{n.name} depends on the state but cannot be fused")
        return Load(self.source(("pre", n)), self.index(n, 0 if n in self.time_dep else None))

    def outer(self, node, index, tdim, start) -> ir.Expr:
        """A load of an outer-graph tensor; with fuse_prologue, elementwise work done on whole
        sequences before the loop (``dA = exp(dt[..., None] * A)``) is pulled into the kernel so
        the big tensor is never materialised."""
        c = _outer_fusable(node) if self.expand_outer and tdim is not None else None
        if c is not None and node in self.loop.foreign:
            c = None          # work on another loop's result: that loop may pull it as its epilogue
        if c is None:
            return Load(self.source(("outer", node, tdim, start)), index)
        out = shape(node)

        def child(a):
            if not isinstance(a, fx.Node):
                return self.build(a)
            if c.kind == "view":
                idx = _through_view(c, index, len(shape(a)))
            else:
                off = len(out) - len(shape(a))
                idx = [index[j + off] if s != 1 else 0 for j, s in enumerate(shape(a))]
            td = idx.index("t") if "t" in idx else None
            return self.outer(a, tuple(idx), td, start)
        if c.kind in ("identity", "view"):
            return child(c.args[0])
        return _ew_expr(c, [child(a) for a in c.args], self.build)

    def _view_load(self, n, c: Canon) -> ir.Expr:
        """A view of a loop input labelled apart from it (`Labels.split`): a load of that input
        indexed through the view, so one input read along two state axes (k k^T) is two loads."""
        a = c.args[0]
        idx = _through_view(c, self.index(n, None), len(shape(a)))
        while a in self.lab.split:           # a view of a view: through each to the input
            c = canonical(a)
            a = c.args[0]
            idx = _through_view(c, idx, len(shape(a)))
        return self.leaf(a, tuple(idx))

    def build(self, n) -> ir.Expr:
        if not isinstance(n, fx.Node):
            if isinstance(n, bool):
                return Const(float(n))
            if isinstance(n, (int, float)):
                return Const(float(n))
            raise AssembleError(f"constant {n!r} of type {type(n).__name__}")
        if n in self.memo:
            return self.memo[n]
        if n is self.rec.new:
            e = State()
        elif n in self.fuse:
            e = self._op(n, canonical(n))
        else:
            e = self.leaf(n)
        self.memo[n] = e
        return e

    def _op(self, n, c: Canon) -> ir.Expr:
        b = self.build
        if c.kind == "identity":
            return b(c.args[0])
        if c.kind == "view":
            return self._view_load(n, c) if n in self.lab.split else b(c.args[0])
        if c.kind == "reduce":
            x = c.args[0]
            axes = tuple(self.lab.label(x, d) for d in c.params["dims"] if shape(x)[d] != 1)
            e = Reduce(b(x), axes) if axes else b(x)
            if c.op == "mean":
                count = 1
                for d in c.params["dims"]:
                    count *= shape(x)[d]
                e = Op("div", (e, Const(float(count))))
            return e
        if c.kind == "contract":
            prod = None
            for a in c.args:
                prod = b(a) if prod is None else Op("mul", (prod, b(a)))
            red = []
            for a, sub in zip(c.args, c.params["subs"]):
                for j, ch in enumerate(sub):
                    if ch not in c.params["out"] and shape(a)[j] != 1:
                        lbl = self.lab.label(a, j)
                        if lbl not in red:
                            red.append(lbl)
            return Reduce(prod, tuple(red)) if red else prod
        return _ew_expr(c, [b(a) for a in c.args], b)


def _through_view(c: Canon, index, ndim: int) -> list:
    """The index of a view's tensor (`ndim` dims) that the view's own `index` reads: each view
    dim's entry at the dim it comes from, 0 at dims the view drops (size 1)."""
    idx = [0] * ndim
    for i, src in enumerate(c.params["src"]):
        if src is not None:
            idx[src] = index[i]
    return idx


def _ew_expr(c: Canon, args: list, build) -> ir.Expr:
    p = c.params
    if c.op == "cast":
        src, dst = dtype(c.args[0]), p["dtype"]
        if _float(src) and _float(dst):
            return args[0]
        return Op("cast", (args[0],), (("dtype", ir.dtype_name(dst)),))
    if c.op in ("add", "sub") and p.get("alpha", 1) != 1:
        return Op(c.op, (args[0], Op("mul", (args[1], Const(float(p["alpha"]))))))
    if c.op == "softplus":
        return Op("softplus", (args[0],), (("beta", float(p["beta"])), ("threshold", float(p["threshold"]))))
    if c.op == "addcmul":
        return Op("add", (args[0], Op("mul", (Const(float(p["value"])), Op("mul", (args[1], args[2]))))))
    if c.op == "clamp":
        e = args[0]
        if p["min"] is not None:
            e = Op("maximum", (e, build(p["min"])))
        if p["max"] is not None:
            e = Op("minimum", (e, build(p["max"])))
        return e
    return Op(c.op, tuple(args))


def _outer_fusable(node) -> Canon | None:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or not is_tensor(node):
        return None
    c = canonical(node)
    if c is None or c.kind not in ("ew", "identity", "view"):
        return None
    if c.kind == "view" and c.params["consts"]:
        return None
    if c.kind == "ew" and c.op == "cast" and not _float(c.params["dtype"]):
        return None
    if not all(_float(dtype(a)) for a in c.tensor_args()):
        return None
    return c


def elementwise_closure(nodes) -> set:
    """`nodes` and every node computed from them by elementwise or view work alone: what a
    loop whose results are `nodes` may pull into its region as epilogue."""
    seen, stack = set(nodes), list(nodes)
    while stack:
        for u in stack.pop().users:
            if u not in seen and _outer_fusable(u) is not None:
                seen.add(u)
                stack.append(u)
    return seen


_RANDOM = {"rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
           "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
           "native_dropout", "multinomial", "normal", "poisson", "rrelu", "uniform_", "normal_",
           "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_"}


def is_random(n: fx.Node) -> bool:
    """Whether the op draws random numbers (each step draws its own)."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return n.op in ("call_function", "call_method") and name in _RANDOM


def _time_dependent(loop) -> set:
    """Body nodes whose value changes from step to step (depend on a read or the carry)."""
    dep = set(loop.read_nodes()) | set(loop.carry_nodes())
    for n in loop.body.graph.nodes:
        if n.op in ("call_function", "call_method") and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
        elif is_random(n):
            raise AssembleError(f"`{n.target if isinstance(n.target, str) else n.target.__name__}` "
                                f"(node {n.name}) draws random numbers from no per-step input; "
                                "computed once for all steps, they would repeat")
    return dep


def assemble(loop, rec: Recurrence, fuse_prologue: bool, fuse_epilogue: bool) -> Plan:
    body = loop.body.graph
    lab = _labels(body, rec)
    if lab.conflict:
        # one loop input read along two state axes (k[:, :, None] * k[:, None, :]): its views
        # are labelled apart from it and each becomes a load of it with its own index
        split = _input_views(body, loop)
        retry = _labels(body, rec, split) if split else None
        if retry is None or retry.conflict:
            raise AssembleError(lab.conflict)
        lab = retry
    fuse: set = set()
    for n in body.nodes:
        if n is rec.new or n in rec.state_nodes and n not in rec.epilogue:
            continue
        if n in rec.epilogue and not fuse_epilogue:
            continue
        if n not in rec.epilogue and not fuse_prologue:
            continue
        if fusable(n, lab) is None:
            continue
        if n in rec.epilogue and not all(a in fuse or a is rec.new or a not in rec.state_nodes
                                         for a in n.all_input_nodes):
            continue
        fuse.add(n)
    bld = _Builder(loop, rec, lab, fuse, fuse_prologue)
    state_shape = shape(rec.prev)
    axes = tuple(f"i{d}" for d in range(len(state_shape)))
    decay, drive = bld.build(rec.a), bld.build(rec.b)
    mix = ir.Mix(bld.build(rec.m), axis=None if rec.m_dim is None else axes[rec.m_dim]) if rec.m is not None else None

    outputs: list[OutputSpec] = []
    results: list = []
    boundary: dict = {}

    def out_index(v, t_at):
        idx = list(bld.index(v, None)) if v is not rec.new else list(axes)
        idx = [1 if i == 0 and s == 1 else i for i, s in zip(idx, shape(v))] if v is not rec.new else idx
        if t_at is not None:
            idx.insert(t_at, "t")
        return tuple(idx)

    def add_out(kind, v, t_at, dt=None):
        spec = OutputSpec(kind, bld.build(v), out_index(v, t_at), ir.dtype_name(dt or dtype(v)))
        if spec not in outputs:
            outputs.append(spec)
        return outputs.index(spec)

    def region_value(v) -> bool:
        return v is rec.new or v in fuse

    res_vals = loop.result_values()
    for r, v in zip(loop.results, res_vals):
        if isinstance(v, fx.Node) and v in rec.state_nodes and not region_value(v):
            # computed after the region from stacked boundary values
            for u in _post_inputs(v, rec, fuse):
                if u not in boundary:
                    boundary[u] = add_out("steps", u, 0)
            results.append(("post", v))
            continue
        if not isinstance(v, fx.Node) or v not in rec.state_nodes:
            results.append(("post", v))      # no state involved: vmap of the step alone
            continue
        if r.kind == "last":
            results.append(("out", add_out("final", v, None), None))
            continue
        t_at = r.dim
        flat = None
        if r.sink == "cat":
            if shape(v)[r.dim] != 1:
                flat = r.dim
            else:
                # cat of size-1 pieces == stack with that dim replaced by time
                k = add_out("steps", v, r.dim)
                o = outputs[k]
                idx = list(o.index)
                del idx[r.dim + 1]
                outputs[k] = dataclasses.replace(o, index=tuple(idx))
                results.append(("out", k, None))
                continue
        buf = dtype(r.buffer) if r.sink == "setitem" else None      # written as the buffer holds it
        results.append(("out", add_out("steps", v, t_at, buf if buf is not None and buf.is_floating_point
                                        else None), flat))

    if fuse_epilogue:
        before = _nodes_before(loop.anchor)
        for i, (r, how) in enumerate(zip(loop.results, results)):
            if how[0] == "out" and how[2] is None and r.kind == "steps" and r.sink in ("stack", "cat") \
                    and len(r.replace) == 1 and not r.reverse and not (r.prefix or r.suffix or r.drop_last):
                # (steps peeled off the loop, stacked around its result: the work after the
                # stack covers them too, so it stays after the stack)
                spec, chain = _pull_epilogue(bld, outputs[how[1]], r.replace[0], before)
                if chain:
                    outputs.append(spec)
                    results[i] = ("out", len(outputs) - 1, None, chain)

    # drop outputs that no result reads any more (replaced by a pulled epilogue)
    used = sorted({h[1] for h in results if h[0] == "out"} | set(boundary.values()))
    remap = {k: i for i, k in enumerate(used)}
    outputs = [outputs[k] for k in used]
    results = [(h[0], remap[h[1]], *h[2:]) if h[0] == "out" else h for h in results]
    boundary = {n: remap[k] for n, k in boundary.items()}

    outputs = [_name_unit_dims(o, axes, state_shape) for o in outputs]
    inputs, axis_size, length = [], [None] * len(axes), None
    init = None
    unit_dims = []          # (input, dim) of every size-1 input dim: where a size-1 axis reads its size
    # a number given at run time (a symbolic float: a hyperparameter Dynamo did not specialise)
    # goes in as a 0-d tensor of the state's dtype (float32 at least)
    # An integer tensor the recurrence reads (a token id as the drive, an int h0) is promoted by
    # eager's arithmetic with the float state; it goes in cast to that float dtype (lowering casts).
    num = "float64" if dtype(rec.new) == torch.float64 else "float32"

    def read_as(t):
        return num if t is None or _is_int_dtype(t) else ir.dtype_name(t)
    for src in bld.sources:
        node = _source_node(loop, src)
        extra = 1 if src[0] == "pre" and node in bld.time_dep else 0
        unit_dims += [(len(inputs), d + extra) for d, s in enumerate(shape(node)) if _is_one(s)]
        inputs.append(InputSpec(_source_name(loop, src), len(shape(node)) + extra, read_as(dtype(node))))
    exprs = [decay, drive] + [o.expr for o in outputs] + ([mix.expr] if mix else [])
    ints = {k for k, src in enumerate(bld.sources) if _is_int_dtype(dtype(_source_node(loop, src)))}
    bad = _integer_arithmetic(exprs, ints) or next(
        (f"`{n.name}`, a step value computed before the region," for k, src in enumerate(bld.sources)
         if k in ints and src[0] == "pre" for n in [_int_arithmetic_before(src[1])] if n is not None), None)
    if bad is not None:
        raise AssembleError(f"{bad} computes on integer input(s) in their own type (eager wraps around "
                            "or truncates there; the region would compute in floating point)")
    if loop.reads and not any(ix == "t" for e in exprs for ld in ir.loads(e) for ix in ld.index):
        # no per-step input drives the state (a step counter, RetNet's normaliser): the loop's
        # first read, never loaded, carries the region's length
        r = loop.reads[0]
        src = ("outer", r.source, r.dim, r.start)
        length = (bld.source(src), r.dim)
        inputs.append(InputSpec(_source_name(loop, src), len(shape(r.source)),
                                ir.dtype_name(dtype(r.source)) if dtype(r.source) else "float32"))
    if isinstance(loop.carry_init[0], fx.Node):
        init = bld.source(("init",))
        inputs.append(InputSpec(loop.carry_init[0].name, len(state_shape), read_as(dtype(loop.carry_init[0]))))
    elif loop.carry_init[0] not in (None, 0, 0.0):
        raise AssembleError(f"initial state {loop.carry_init[0]!r} is a non-zero constant")
    for e in exprs:
        for ld in ir.loads(e):
            for d, ix in enumerate(ld.index):
                if ix == "t" and length is None:
                    length = (ld.input, d)
                elif isinstance(ix, str) and ix not in ("t", ir.MIX_COL):
                    k = axes.index(ix)
                    if axis_size[k] is None:
                        axis_size[k] = (ld.input, d)
    init_shape = shape(loop.carry_init[0]) if init is not None else None
    if init_shape is not None:          # an initial state of fewer dims is broadcast from the left
        init_shape = (1,) * (len(state_shape) - len(init_shape)) + tuple(init_shape)
    for k in range(len(axes)):
        if axis_size[k] is None:
            if init is not None and (init_shape[k] != 1 or _is_one(state_shape[k])):
                axis_size[k] = (init, k)
            elif _is_one(state_shape[k]) and unit_dims:
                # batch 1: no input is read along the axis (a size-1 dim is indexed 0), but
                # the graph is specialised to size 1 and so is every size-1 input dim
                axis_size[k] = unit_dims[0]
            else:
                raise AssembleError(f"the size of state axis i{k} is not read from any input")
    if length is None:
        raise AssembleError("no input changes from step to step")
    for what, e in (("the decay", decay), ("the drive", drive), *(("an output", o.expr) for o in outputs)):
        if any(ir.MIX_COL in ld.index for ld in ir.loads(e)):
            # a matrix of the transition also read in another role (its columns as an output's
            # axis): one load cannot carry both labels
            raise AssembleError(f"{what} reads a value the transition reads along its columns, in "
                                "another role (a matrix used twice)")
    region = Region(loop.name, axes, tuple(axis_size), length, tuple(inputs), decay, drive,
                    tuple(outputs), init, mix=mix,
                    unit_axes=tuple(a for a, s in zip(axes, state_shape) if _is_one(s)))
    return Plan(region, bld.sources, results, boundary, fuse)


def _is_one(s) -> bool:
    """A size that is 1 at compile time (Dynamo specialises 1; a symbolic size is never 1)."""
    return isinstance(s, int) and s == 1


def _name_unit_dims(o: OutputSpec, axes: tuple, state_shape) -> OutputSpec:
    """Size-1 dims are not labelled with a state axis (a (1, d) value reads like a broadcast
    one), so with batch 1 a per-step output is indexed (1, t, i1) while it varies along the
    state's i0 of size 1. Name its size-1 dims after the size-1 state axes it varies along but
    does not index, in order: every pairing reads the same single element. A size-1 axis left
    over (a sum over d_state 1 is traced as no sum at all) is summed over: a sum of one element.
    The output then varies only along the axes it indexes, as at larger sizes."""
    missing = [a for a, s in zip(axes, state_shape)
               if _is_one(s) and a not in o.index and a in ir.axes_of(o.expr, axes)]
    if not missing:
        return o
    idx = list(o.index)
    for k, ix in enumerate(idx):
        if ix == 1 and missing:
            idx[k] = missing.pop(0)
    expr = o.expr
    if missing:
        if isinstance(expr, ir.Reduce) and expr.op == "sum":
            expr = ir.Reduce(expr.arg, tuple(a for a in axes if a in expr.axes or a in missing))
        else:
            expr = ir.Reduce(expr, tuple(missing))
    return dataclasses.replace(o, expr=expr, index=tuple(idx))


def _nodes_before(anchor) -> set:
    out, n = set(), anchor.prev
    while n.op != "root":
        out.add(n)
        n = n.prev
    return out


class _Stop(Exception):
    pass


def _pull_epilogue(bld: _Builder, spec: OutputSpec, sink: fx.Node, before: set):
    """Elementwise work done on the stacked output after the loop (``y = stack(ys) + D * x``,
    ``y * silu(z)``) joins the output expression; its operands must be computable from values
    that exist before the loop. Returns the new output spec and the outer nodes it replaces."""
    chain, expr, cur, dt = [], spec.expr, sink, spec.dtype
    while len(cur.users) == 1:
        u = next(iter(cur.users))
        c = _outer_fusable(u)
        if c is None or c.kind != "ew" or shape(u) != shape(cur) or cur not in c.args:
            break
        try:
            args = [expr if a is cur else _epi_operand(bld, a, spec.index, shape(u), before)
                    for a in c.args]
        except (_Stop, AssembleError):
            break
        expr = _ew_expr(c, args, bld.build)
        chain.append(u)
        cur, dt = u, ir.dtype_name(dtype(u))
    return OutputSpec(spec.kind, expr, spec.index, dt), chain


def _epi_operand(bld: _Builder, a, out_index, out_shape, before) -> ir.Expr:
    if not isinstance(a, fx.Node):
        return bld.build(a)
    off = len(out_shape) - len(shape(a))
    if off < 0:
        raise _Stop()
    idx = tuple(out_index[j + off] if s != 1 else 0 for j, s in enumerate(shape(a)))
    idx = tuple(0 if i == 1 else i for i in idx)
    if a in before:
        td = idx.index("t") if "t" in idx else None
        return bld.outer(a, idx, td, 0)
    c = _outer_fusable(a)
    if c is None or c.kind == "view":
        raise _Stop()
    if c.kind == "identity":
        return _epi_operand(bld, c.args[0], idx, shape(a), before)
    return _ew_expr(c, [_epi_operand(bld, x, idx, shape(a), before) for x in c.args], bld.build)


def _post_inputs(v, rec, fuse) -> list:
    """Region values (new state or fused) that the unfused computation of v reads."""
    out, seen, stack = [], set(), [v]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if n is not v and (n is rec.new or n in fuse):
            out.append(n)
            continue
        if n is rec.new:
            out.append(n)
            continue
        for a in n.all_input_nodes:
            if a in rec.state_nodes or a is rec.new:
                stack.append(a)
    return out


def _source_node(loop, src):
    if src[0] in ("outer", "pre"):
        return src[1]
    return loop.carry_init[0]


def _is_int_dtype(t) -> bool:
    return t is not None and not (t.is_floating_point or t.is_complex or t == torch.bool)


_INT_KEEPING = {"add", "sub", "mul", "neg", "abs", "pow", "maximum", "minimum"}


def _int_arithmetic_before(node):
    """The first node computing `node` (a step value made before the region) by arithmetic in an
    integer type (``(-v) + v`` of uint8: the region's drive, regrouped, would not wrap as eager's
    ``a * h + (-v) + v`` does), or None where it is reads and views of integer inputs alone."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        c = canonical(n)
        if c is not None and c.kind == "ew" and c.op != "cast" and _is_int_dtype(dtype(n)):
            return n
        todo.extend(n.all_input_nodes)
    return None


def _integer_arithmetic(exprs, ints: set):
    """An op of the region that eager computes in an integer type (every operand an integer input
    or an integer constant: ``-v``, ``v + v`` of uint8 wrap around there), or None. Integer inputs
    are read cast to the state's float type, which is exact where eager promotes them first."""
    if not ints:
        return None
    memo = {}

    def is_int(e):
        if e in memo:
            return memo[e]
        if isinstance(e, ir.Load):
            r = e.input in ints
        elif isinstance(e, ir.Const):
            r = isinstance(e.value, int) and not isinstance(e.value, bool)
        elif isinstance(e, ir.Op) and e.name == "cast":
            r = _is_int_dtype(ir.to_dtype(e.attr("dtype"))) if e.attr("dtype") else False
        elif isinstance(e, ir.Op) and e.name in _INT_KEEPING:
            r = all(is_int(a) for a in e.args)
        elif isinstance(e, ir.Op) and e.name == "where":
            r = is_int(e.args[1]) and is_int(e.args[2])
        else:
            r = False
        memo[e] = r
        return r
    for e in exprs:
        for x in ir.walk(e):
            if isinstance(x, ir.Op) and x.name in _INT_KEEPING | {"where"} and is_int(x) \
                    and any(ld.input in ints for ld in ir.loads(x)):
                return f"`{x.name}` ({x})"
    return None


def _source_name(loop, src) -> str:
    if src[0] == "outer":
        return src[1].name + (f" (time along dim {src[2]})" if src[2] is not None else "")
    if src[0] == "pre":
        return f"{src[1].name} (step value, computed for all steps before the region)"
    return "initial state"
