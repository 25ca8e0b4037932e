"""Complex state -> real pairs: an LRU-style loop over complex numbers as a real recurrence with
one 2x2 rotation-scale block per complex channel.

A loop that carries a complex state h (shape S, complex64/complex128), e.g.

    lam = torch.exp(-torch.exp(nu_log) + 1j * torch.exp(theta_log))
    h = lam * h + gamma * (x[:, t] @ B_re.T + 1j * (x[:, t] @ B_im.T))
    ys.append((h * C).real)

is rewritten, step body and all, into one that carries the real tensor view_as_real(h) of shape
(*S, 2). Multiplying the state by lam = lr + i li becomes

    h2 = lr[..., None] * h2 + li[..., None] * (h2 @ J.T)      J = [[0, -1], [1, 0]]

that is the 2x2 block [[lr, -li], [li, lr]] acting on (re, im) of each channel: detect_recurrence
then proves it linear with a non-diagonal transition (`Mix`) along the pair axis, and the
block-sparse machinery (torch reference, Triton block-sparse kernel) runs it. Every other
complex value of the step is carried as its real and imaginary parts (two real nodes, or None
for an exact zero): + - * /, exp, abs, angle, conj, .real/.imag, torch.complex, torch.polar,
view_as_real/view_as_complex, where, views, sums and matrix products split exactly into real
arithmetic. Readouts read the new state's parts as (h2 * [1, 0]).sum(-1) and
(h2 * [0, 1]).sum(-1), which fuse into the region like any readout.

On the way from the previous to the new state only complex-linear steps are allowed (sums,
products and quotients with state-free values, conj, casts); anything else, and any complex op
not listed above, declines the loop with the op named (the loop then runs as written).

The loop's complex results come back as view_as_complex of real (..., 2) outputs (lowering),
and a complex initial state is passed in as view_as_real of it; complex inputs of the step are
split with torch.real/torch.imag before the region (where the small constant matrices are also
made, on the device). Gradients are those of the real region: autograd carries them through
these views to the original (real or complex) parameters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator

import torch
import torch.fx as fx

from .capture import _fake_mode
from .ops import canonical, dtype, shape, value

_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}
# constant real tensors the split step reads (made on the device, see complex_constant)
CONSTS = {
    "re": [1.0, 0.0],                     # (h2 * re).sum(-1) = Re h; re[...] * Re z builds a pair
    "im": [0.0, 1.0],
    "rot": [[0.0, 1.0], [-1.0, 0.0]],     # J.T: (h2 @ J.T)[.., p] = sum_q J[p, q] h2[.., q]: i*h as pairs
    "conj": [[1.0, 0.0], [0.0, -1.0]],    # h2 @ conj: conj(h) as pairs
}


def complex_constant(key: str, dt: torch.dtype, device) -> torch.Tensor:
    """CONSTS[key] built by factory ops on the device: no host-to-device copy (no sync) when the
    step's state-free part runs before the region at every call."""
    e = torch.eye(2, dtype=dt, device=device)
    if key == "re":
        return e[0]
    if key == "im":
        return e[1]
    if key == "rot":
        return torch.outer(e[0], e[1]) - torch.outer(e[1], e[0])
    return torch.diag(e[0] - e[1])


class ComplexError(Exception):
    """The complex loop cannot be split into real pairs; the message says why."""


def is_complex_loop(loop) -> bool:
    return loop.n_carry == 1 and dtype(loop.carry_nodes()[0]) is not None and \
        dtype(loop.carry_nodes()[0]).is_complex


def _describe(n: fx.Node) -> str:
    t = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    if n.op == "call_function" and n.target is getattr:
        t = f".{n.args[1]}"
    return f"`{t}` (node {n.name})"


@dataclasses.dataclass
class _Cx:
    """A complex value of the step: its parts (a real node, a python number, or None: zero) and,
    for values on the state's path, the real (..., 2) node standing for it."""
    re: object = None
    im: object = None
    shape: tuple = ()
    pair: fx.Node | None = None
    split: bool = True            # re/im are known (False: only `pair`, parts made on demand)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _zero(x) -> bool:
    return x is None or (_num(x) and x == 0)


_CONJ = {torch.conj, torch.conj_physical, torch.resolve_conj, torch.resolve_neg}
_CONJ_METHODS = {"conj", "conj_physical", "resolve_conj", "resolve_neg"}
_ABS = {torch.abs, torch.absolute, operator.abs}
_PARTS_KEEP = ("identity", "view")      # canonical kinds applied to each part alike


class _Splitter:
    def __init__(self, loop, outer_mode):
        self.loop = loop
        self.old = loop.body.graph
        self.g = fx.Graph()
        self.mode = _fake_mode(self.old) or outer_mode
        self.prev = loop.carry_nodes()[0]
        self.cdt = dtype(self.prev)
        if self.cdt not in _REAL_OF:
            raise ComplexError(f"the state is {self.cdt}; complex64 and complex128 states are split into real pairs")
        self.rdt = _REAL_OF[self.cdt]
        self.dev = value(self.prev).device
        self.env: dict = {}
        self.consts: dict = {}
        new = loop.carry_outputs()[0]
        if not isinstance(new, fx.Node) or dtype(new) != self.cdt or shape(new) != shape(self.prev):
            raise ComplexError("the new state is not a complex tensor of the state's shape and dtype")
        self.new = new
        dep = {self.prev}
        for n in self.old.nodes:
            if n.op != "output" and any(a in dep for a in n.all_input_nodes):
                dep.add(n)
        anc = {new}
        for n in reversed(list(self.old.nodes)):
            if n in anc:
                anc.update(a for a in n.all_input_nodes if a in dep)
        self.path = anc & dep if new in dep else set()

    # -- building nodes with fake values ------------------------------------------------------
    def _meta(self, n: fx.Node):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: value(a))
        if n.op == "call_method":
            fn = lambda: getattr(args[0], n.target)(*args[1:], **kwargs)     # noqa: E731
        else:
            fn = lambda: n.target(*args, **kwargs)                              # noqa: E731
        if self.mode is not None:
            with self.mode:
                n.meta["example_value"] = fn()
        else:
            n.meta["example_value"] = fn()
        return n

    def call(self, target, *args, **kwargs) -> fx.Node:
        return self._meta(self.g.call_function(target, args, kwargs))

    def method(self, name, *args, **kwargs) -> fx.Node:
        return self._meta(self.g.call_method(name, args, kwargs))

    def redo(self, n: fx.Node, arg) -> fx.Node:
        """n again in the new graph, its node arguments mapped by `arg`."""
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), arg)
        if n.op == "call_method":
            return self.method(n.target, *args, **kwargs)
        if n.op == "call_function":
            return self.call(n.target, *args, **kwargs)
        raise ComplexError(f"{_describe(n)} on a complex value")

    def const(self, key: str) -> fx.Node:
        """A node of the step for constant CONSTS[key] (state-free: computed before the region)."""
        if key not in self.consts:
            self.consts[key] = self.call(complex_constant, key, self.rdt, self.dev)
        return self.consts[key]

    def full(self, x, shp: tuple) -> fx.Node:
        """A real node of exactly shape `shp` for part x (broadcast, zeros, or a constant)."""
        if isinstance(x, fx.Node) and shape(x) == tuple(shp):
            return x
        if any(isinstance(s, torch.SymInt) for s in shp):
            raise ComplexError("a part of a complex value would need a size known only at run time")
        if isinstance(x, fx.Node):
            return self.call(torch.broadcast_to, x, tuple(shp))
        if x is None:
            return self.call(torch.zeros, tuple(shp), dtype=self.rdt, device=self.dev)
        return self.call(torch.full, tuple(shp), float(x), dtype=self.rdt, device=self.dev)

    # -- real arithmetic on parts (None: an exact zero) -----------------------------------------
    def mul(self, x, y):
        if _zero(x) or _zero(y):
            return None
        if _num(x) and _num(y):
            return x * y
        if _num(x):
            x, y = y, x
        if _num(y) and y == 1:
            return x
        if _num(y) and y == -1:
            return self.neg(x)
        return self.call(operator.mul, x, y)

    def add(self, x, y):
        if _zero(x):
            return y
        if _zero(y):
            return x
        if _num(x) and _num(y):
            return x + y
        return self.call(operator.add, x, y)

    def neg(self, x):
        if _zero(x):
            return None
        return -x if _num(x) else self.call(operator.neg, x)

    def sub(self, x, y):
        if _zero(y):
            return x
        if _zero(x):
            return self.neg(y)
        if _num(x) and _num(y):
            return x - y
        return self.call(operator.sub, x, y)

    def div(self, x, y):
        if _zero(x):
            return None
        if _num(x) and _num(y):
            return x / y
        if _num(y) and y == 1:
            return x
        return self.call(operator.truediv, x, y)

    def unary(self, fn, x):
        if _num(x):
            return float(fn(torch.tensor(float(x), dtype=torch.float64)))
        return self.call(fn, x)

    # -- complex values -----------------------------------------------------------------------
    def parts(self, v):
        """(re, im) of an operand: a _Cx, a real node, or a python number."""
        if isinstance(v, _Cx):
            if not v.split:
                e0, e1 = self.const("re"), self.const("im")
                v.re = self.method("sum", self.call(operator.mul, v.pair, e0), -1)
                v.im = self.method("sum", self.call(operator.mul, v.pair, e1), -1)
                v.split = True
            return v.re, v.im
        if isinstance(v, complex):
            return v.real, v.imag
        if isinstance(v, bool):
            return float(v), None
        if _num(v) or isinstance(v, fx.Node):
            return v, None
        raise ComplexError(f"an operand {v!r} of type {type(v).__name__} in complex arithmetic")

    def pair_of(self, v, shp: tuple | None = None):
        """The real (..., 2) node for v (None: zero); exactly (*shp, 2) when shp is given."""
        if isinstance(v, _Cx) and v.pair is not None:
            p = v.pair
        else:
            re, im = self.parts(v)
            p = None
            for part, key in ((re, "re"), (im, "im")):
                if _zero(part):
                    continue
                e = self.const(key)
                term = self.mul(part, e) if _num(part) else self.call(operator.mul, self.method("unsqueeze", part, -1), e)
                p = self.add(p, term)
            if isinstance(v, _Cx) and p is not None and shape(p) == (*v.shape, 2):
                v.pair = p
        if shp is not None:
            p = self.full(p, (*shp, 2))
        return p

    def cmul(self, a, b):
        (ar, ai), (br, bi) = self.parts(a), self.parts(b)
        return self.sub(self.mul(ar, br), self.mul(ai, bi)), self.add(self.mul(ar, bi), self.mul(ai, br))

    def crecip(self, b):
        br, bi = self.parts(b)
        if _zero(bi):
            return self.div(1.0, br) if not _num(br) else 1.0 / br, None
        den = self.add(self.mul(br, br), self.mul(bi, bi))
        return self.div(br, den), self.neg(self.div(bi, den))

    def cexp(self, a):
        re, im = self.parts(a)
        if _zero(im):
            return self.unary(torch.exp, re if re is not None else 0.0), None
        c, s = self.unary(torch.cos, im), self.unary(torch.sin, im)
        if _zero(re):
            return c, s
        e = self.unary(torch.exp, re)
        return self.mul(e, c), self.mul(e, s)

    def cabs(self, a):
        re, im = self.parts(a)
        if _zero(im):
            return self.unary(torch.abs, re) if re is not None else None
        if _zero(re):
            return self.unary(torch.abs, im)
        return self.unary(torch.sqrt, self.add(self.mul(re, re), self.mul(im, im)))

    # -- the step ------------------------------------------------------------------------------
    def arg(self, a):
        """An argument in the new graph: real nodes mapped, complex values as _Cx."""
        return self.env[a] if isinstance(a, fx.Node) else a

    def run(self):
        phs = [n for n in self.old.nodes if n.op == "placeholder"]
        for n in phs:
            ph = self.g.placeholder(n.name)
            ph.meta = dict(n.meta)
            if n is self.prev:
                with self.mode if self.mode is not None else contextlib.nullcontext():
                    ph.meta["example_value"] = torch.view_as_real(value(n))
                self.env[n] = _Cx(shape=shape(n), pair=ph, split=False)
            else:
                self.env[n] = ph
        for n in phs:           # complex inputs of the step: split once, before anything else
            if n is not self.prev and dtype(n) is not None and dtype(n).is_complex and n.users:
                ph = self.env[n]
                self.env[n] = _Cx(self.call(torch.real, ph), self.call(torch.imag, ph), shape(n))
        out = None
        for n in self.old.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = n
                continue
            self.env[n] = self.step(n)
        carry, *results = out.args[0]
        complex_results = []
        vals = [self.pair_of(self.env[carry], shape(carry))]
        for k, r in enumerate(results):
            v = self.arg(r)
            if isinstance(v, _Cx):
                v = self.pair_of(v, shape(r))
                complex_results.append(k)
            elif isinstance(r, fx.Node) and isinstance(v, fx.Node):
                v = self.full(v, shape(r))
            vals.append(v)
        self.g.output(tuple(vals))
        self.g.eliminate_dead_code()
        return fx.GraphModule(self.loop.body, self.g), complex_results

    def step(self, n: fx.Node):
        ins = [self.arg(a) for a in n.all_input_nodes]
        cplx_in = any(isinstance(v, _Cx) for v in ins) or any(isinstance(a, complex) for a in _flat((n.args, n.kwargs)))
        cplx_out = dtype(n) is not None and dtype(n).is_complex
        if not cplx_in and not cplx_out:
            if n.op == "get_attr":
                return self.g.node_copy(n)
            return self.g.node_copy(n, lambda a: self.env[a])
        if n in self.path:
            return self.on_path(n)
        return self.split_node(n)

    # -- the state's path: stays a (..., 2) real node, linear in the previous state ------------
    def on_path(self, n: fx.Node):
        why = ("only sums, products and quotients with state-free values, conj and casts keep "
               "h = lam * h + u linear")
        if not (dtype(n) is not None and dtype(n).is_complex):
            raise ComplexError(f"the update takes a real value of the complex state through {_describe(n)}; {why}")
        shp = shape(n)
        if n.op == "call_function" and n.target in _CONJ or n.op == "call_method" and n.target in _CONJ_METHODS:
            p = self.on_path_arg(n.args[0])
            if n.target in ("conj", "conj_physical") or n.target in (torch.conj, torch.conj_physical):
                # a matrix product, not a product with [1, -1]: that vector would scale the
                # columns of a later rotation and the rows of the decay at once
                p = self.call(operator.matmul, p, self.const("conj"))
            return _Cx(shape=shp, pair=p, split=False)
        c = canonical(n)
        if c is None:
            raise ComplexError(f"the complex state goes through {_describe(n)}; {why}")
        if c.kind == "identity" or c.kind == "view" and not c.params["consts"] and shape(c.args[0]) == shp:
            return _Cx(shape=shp, pair=self.on_path_arg(c.args[0]), split=False)
        if c.kind != "ew":
            raise ComplexError(f"the complex state goes through {_describe(n)} ({c.kind}); {why}")
        if c.op == "cast":
            p = self.on_path_arg(c.args[0])
            dt = c.params["dtype"]
            if dt not in _REAL_OF:
                raise ComplexError(f"{_describe(n)} casts the complex state to {dt}; {why}")
            return _Cx(shape=shp, pair=self.method("to", p, _REAL_OF[dt]), split=False)
        if c.op in ("add", "sub"):
            x = self.on_path_arg(c.args[0])
            y = self.on_path_arg(c.args[1])
            alpha = c.params.get("alpha", 1)
            if alpha != 1:
                y = self.scale_pair(y, alpha)
            p = (self.add if c.op == "add" else self.sub)(x, y)
            return _Cx(shape=shp, pair=p, split=False)
        if c.op == "neg":
            return _Cx(shape=shp, pair=self.neg(self.on_path_arg(c.args[0])), split=False)
        if c.op in ("mul", "div"):
            onp = [a for a in c.args if isinstance(a, fx.Node) and a in self.path]
            if len(onp) != 1 or c.args[0] is c.args[1]:
                raise ComplexError(f"{_describe(n)} multiplies the complex state by itself")
            if c.op == "div" and c.args[1] in self.path:
                raise ComplexError(f"{_describe(n)} divides by the complex state")
            x = onp[0]
            w = self.arg(c.args[1] if c.args[0] is x else c.args[0])
            if c.op == "div":
                w = _Cx(*self.crecip(w), shape(c.args[1]) if isinstance(c.args[1], fx.Node) else ())
            return _Cx(shape=shp, pair=self.scale_pair(self.on_path_arg(x), w), split=False)
        raise ComplexError(f"the complex state goes through {_describe(n)}; {why}")

    def on_path_arg(self, a):
        if isinstance(a, fx.Node) and a in self.path:
            v = self.env[a]
            return v.pair
        return self.pair_of(self.arg(a))

    def scale_pair(self, p, w):
        """w * p for p a (..., 2) node (linear in the state) and w state-free: the real part scales,
        the imaginary part rotates: wr * p + wi * (p @ J.T)."""
        if p is None:
            return None
        wr, wi = self.parts(w)
        out = None
        if not _zero(wr):
            out = self.mul(p, wr) if _num(wr) else self.call(operator.mul, self.method("unsqueeze", wr, -1), p)
        if not _zero(wi):
            rot = self.call(operator.matmul, p, self.const("rot"))
            out = self.add(out, self.mul(rot, wi) if _num(wi) else
                           self.call(operator.mul, self.method("unsqueeze", wi, -1), rot))
        if out is None:       # times zero: still a node of the state's shape
            out = self.call(operator.mul, p, 0.0)
        return out

    # -- everything else: real and imaginary parts ---------------------------------------------
    def split_node(self, n: fx.Node):
        shp = shape(n)
        t = n.target
        a0 = self.arg(n.args[0]) if n.args else None
        if n.op == "call_function" and t is getattr and n.args[1] in ("real", "imag") or \
                n.op == "call_function" and t in (torch.real, torch.imag):
            which = n.args[1] if t is getattr else t.__name__
            re, im = self.parts(a0)
            return self.full(re if which == "real" else im, shp)
        if n.op == "call_function" and t in _CONJ or n.op == "call_method" and t in _CONJ_METHODS:
            re, im = self.parts(a0)
            flip = t in (torch.conj, torch.conj_physical, "conj", "conj_physical")
            return _Cx(re, self.neg(im) if flip else im, shp)
        if n.op == "call_function" and t in _ABS or n.op == "call_method" and t in ("abs", "absolute"):
            return self.full(self.cabs(a0), shp)
        if n.op == "call_function" and t is torch.angle or n.op == "call_method" and t == "angle":
            re, im = self.parts(a0)
            return self.call(torch.atan2, self.full(im, shp), self.full(re, shp))
        if n.op == "call_function" and t is torch.view_as_real:
            return self.pair_of(a0, shape(n.args[0]))
        if n.op == "call_function" and t is torch.view_as_complex:
            x = self.full(a0, shape(n.args[0]))
            return _Cx(self.call(torch.select, x, -1, 0), self.call(torch.select, x, -1, 1), shp)
        if n.op == "call_function" and t is torch.complex:
            return _Cx(self.arg(n.args[0]), self.arg(n.args[1]), shp)
        if n.op == "call_function" and t is torch.polar:
            r, th = self.arg(n.args[0]), self.arg(n.args[1])
            return _Cx(self.mul(r, self.unary(torch.cos, th)), self.mul(r, self.unary(torch.sin, th)), shp)
        if n.op == "call_function" and t in (torch.stack, torch.cat):
            return self.stack(n)
        if n.op == "call_function" and t is getattr and n.args[1] in ("T", "mT", "H", "mH"):
            v = self.per_part(n)            # transposes; .H and .mH conjugate too
            return _Cx(v.re, self.neg(v.im), v.shape) if n.args[1] in ("H", "mH") else v
        c = canonical(n)
        how = ("ssmc splits complex values into real and imaginary parts through + - * /, exp, abs, "
               "angle, conj, .real/.imag, torch.complex/polar, view_as_real/view_as_complex, where, "
               "views, sums and matrix products")
        if c is None:
            raise ComplexError(f"{_describe(n)} on a complex value: {how}")
        if c.kind in _PARTS_KEEP or c.kind == "reduce" and c.op in ("sum", "mean"):
            return self.per_part(n)
        if c.kind == "contract":
            return self.contract(n, c)
        if c.kind != "ew":
            raise ComplexError(f"{_describe(n)} on a complex value: {how}")
        args = [self.arg(a) for a in c.args]
        if c.op == "cast":
            dt = c.params["dtype"]
            re, im = self.parts(args[0])
            rdt = _REAL_OF.get(dt, dt)
            if not (rdt.is_floating_point):
                raise ComplexError(f"{_describe(n)} casts a complex value to {dt}")
            re = re if not isinstance(re, fx.Node) else self.method("to", re, rdt)
            im = im if not isinstance(im, fx.Node) else self.method("to", im, rdt)
            return _Cx(re, im, shp) if dt.is_complex else self.full(re, shp)
        if c.op in ("add", "sub"):
            (xr, xi), (yr, yi) = self.parts(args[0]), self.parts(args[1])
            alpha = c.params.get("alpha", 1)
            if alpha != 1:
                yr, yi = self.cmul(alpha, _Cx(yr, yi))
            f = self.add if c.op == "add" else self.sub
            return _Cx(f(xr, yr), f(xi, yi), shp)
        if c.op == "neg":
            re, im = self.parts(args[0])
            return _Cx(self.neg(re), self.neg(im), shp)
        if c.op == "mul":
            return _Cx(*self.cmul(args[0], args[1]), shp)
        if c.op == "div":
            return _Cx(*self.cmul(args[0], _Cx(*self.crecip(args[1]))), shp)
        if c.op == "reciprocal":
            return _Cx(*self.crecip(args[0]), shp)
        if c.op == "exp":
            return _Cx(*self.cexp(args[0]), shp)
        if c.op == "where":
            cond = args[0]
            (xr, xi), (yr, yi) = self.parts(args[1]), self.parts(args[2])
            pick = lambda x, y: None if _zero(x) and _zero(y) else self.call(      # noqa: E731
                torch.where, cond, self.full(x, shp), self.full(y, shp))
            return _Cx(pick(xr, yr), pick(xi, yi), shp)
        raise ComplexError(f"`{c.op}` of a complex value ({_describe(n)}): {how}, not {c.op}")

    def per_part(self, n):
        """Views, sums and means act on the real and imaginary parts alike."""
        if len([a for a in n.all_input_nodes if isinstance(self.env[a], _Cx)]) != 1:
            raise ComplexError(f"{_describe(n)} mixes several complex values")
        src = next(a for a in n.all_input_nodes if isinstance(self.env[a], _Cx))
        re, im = self.parts(self.env[src])
        out = []
        for part in (re, im):
            if part is None:
                out.append(None)
                continue
            part = self.full(part, shape(src))
            out.append(self.redo(n, lambda a: part if a is src else self.env[a]))
        return _Cx(out[0], out[1], shape(n))

    def contract(self, n, c):
        """A matrix product (einsum) is bilinear: (ar + i ai)(br + i bi) term by term."""
        ops = [a for a in c.args]
        if len(ops) != 2 or n.op not in ("call_function", "call_method"):
            raise ComplexError(f"{_describe(n)} contracts {len(ops)} complex operands; ssmc splits two")
        if not all(isinstance(a, fx.Node) for a in ops):
            raise ComplexError(f"{_describe(n)} contracts a complex value with a constant")
        pa = [self.parts(self.arg(a)) for a in ops]
        pa = [tuple(None if _zero(x) else self.full(x, shape(a)) for x in p) for p, a in zip(pa, ops)]

        def term(x, y):
            if x is None or y is None:
                return None
            given = iter((x, y))        # by position: the two operands may be one node (z @ z)
            return self.redo(n, lambda a: next(given) if a in ops else self.env[a])
        (ar, ai), (br, bi) = pa
        return _Cx(self.sub(term(ar, br), term(ai, bi)), self.add(term(ar, bi), term(ai, br)), shape(n))

    def stack(self, n):
        seq = n.args[0] if n.args else n.kwargs["tensors"]
        rest = n.args[1:]
        kwargs = {k: v for k, v in n.kwargs.items() if k != "tensors"}
        re, im = [], []
        for a in seq:
            r, i = self.parts(self.arg(a))
            re.append(self.full(r, shape(a)))
            im.append(self.full(i, shape(a)))
        return _Cx(self.call(n.target, re, *rest, **kwargs), self.call(n.target, im, *rest, **kwargs), shape(n))


def _flat(x) -> list:
    out = []
    fx.node.map_aggregate(x, lambda a: out.append(a))
    return out


def split_complex(gm: fx.GraphModule, loop, outer_mode=None):
    """The loop with its complex state carried as real pairs (see the module docstring), and a
    note for the report. Raises ComplexError with the reason when it cannot."""
    sp = _Splitter(loop, outer_mode)
    old_shape, cdt = shape(loop.carry_nodes()[0]), sp.cdt
    body, complex_results = sp.run()
    init, made = loop.carry_init[0], list(loop.made)
    if isinstance(init, fx.Node):
        with gm.graph.inserting_after(init):     # unused (and dropped) if the loop declines later
            real_init = gm.graph.call_function(torch.view_as_real, (init,))
        mode = getattr(value(init), "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            real_init.meta["example_value"] = torch.view_as_real(value(init))
        init = real_init
        made.append(real_init)                  # kept until this loop is lowered
    elif init not in (None, 0, 0.0, 0j):
        raise ComplexError(f"initial state {init!r} is a non-zero constant")
    else:
        init = None
    new = dataclasses.replace(loop, body=body, carry_init=[init], made=made,
                              complex_results=frozenset(complex_results))
    note = (f"complex state {str(cdt).replace('torch.', '')}{list(old_shape)} carried as real pairs "
            f"{str(sp.rdt).replace('torch.', '')}{[*old_shape, 2]}: h = lam * h + u is one 2x2 rotation-scale "
            f"block [[re lam, -im lam], [im lam, re lam]] per complex channel, a block-diagonal "
            f"transition along the pair axis")
    return new, note
