"""The region IR: one linear recurrence h_t = a_t * h_{t-1} + b_t and what is fused around it.

Everything is a frozen, hashable dataclass, and `str(region)` prints readable Python.

Iteration space: the state axes ``i0, i1, ...`` (the state's shape per step) and time ``t``.
A `Load` reads one element of a region input; its `index` says, for each dim of that input
tensor, which iteration variable indexes it: an axis name (``"i1"``), ``"t"``, or an int
(a constant index; 0 for size-1 dims). Strides come from the actual tensors at run time, so
any layout ((b, l, d), (b, d, l), transposed, expanded) is one Load with a different index.

`decay` (a_t) and `drive` (b_t) are expressions free of the state. A region may also carry a
`Mix`: a non-diagonal transition along its last state axis, h_t[.., i] = a_t[.., i] h[.., i] +
sum_j m_t[.., i, j] h[.., j] + b_t[.., i], with m_t an expression over the state axes and the
column axis ``"j"`` (block-sparse A, rotations, complex decays as real 2x2 blocks). Each output is an
expression of `State()` (the new state h_t) and loads, with `Reduce` for contractions over
state axes (the readout sum_n h*C); `index` places it in the output tensor.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Union

import torch

Index = tuple[Union[str, int], ...]


@dataclasses.dataclass(frozen=True)
class Load:
    input: int
    index: Index

    def __str__(self):
        return f"in{self.input}[{', '.join(map(str, self.index))}]"


@dataclasses.dataclass(frozen=True)
class Const:
    value: float

    def __str__(self):
        return repr(self.value)


@dataclasses.dataclass(frozen=True)
class State:
    def __str__(self):
        return "h[i]"


class _Node:
    """Expressions are DAGs (a subexpression used twice is one object). Nodes are hash-consed:
    building an expression equal to an existing one returns that object, so equality and
    hashing cost O(1) per node; printing names shared subexpressions. Nothing is exponential
    in the depth of a DAG."""

    _pool: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __new__(cls, *args, **kwargs):
        fields = list(cls.__dataclass_fields__.values())
        vals = list(args) + [kwargs[f.name] if f.name in kwargs else f.default for f in fields[len(args):]]
        key = (cls, *vals)
        try:
            node = _Node._pool.get(key)
        except TypeError:               # an unhashable field: no sharing
            return super().__new__(cls)
        if node is None:
            node = super().__new__(cls)
            _Node._pool[key] = node
        return node

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((type(self).__name__,) + tuple(
            getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self):
        return self._hash

    def __str__(self):
        lets, text = format_expr(self)
        return "; ".join([*(f"{n} = {v}" for n, v in lets), text])


@dataclasses.dataclass(frozen=True, eq=True)
class Op(_Node):
    name: str
    args: tuple
    attrs: tuple = ()   # sorted (key, value) pairs, e.g. (("dtype", "bfloat16"),)
    __hash__ = _Node.__hash__
    __str__ = __repr__ = _Node.__str__

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)


@dataclasses.dataclass(frozen=True, eq=True)
class Reduce(_Node):
    arg: "Expr"
    axes: tuple[str, ...]
    op: str = "sum"
    __hash__ = _Node.__hash__
    __str__ = __repr__ = _Node.__str__


def format_expr(e, names: dict | None = None) -> tuple[list, str]:
    """(let bindings, text): readable Python for an expression DAG. Subexpressions used more
    than once (and not trivially small) are printed once as ``v0 = ...`` and named after."""
    names = {} if names is None else names
    order = walk(e)
    uses: dict = {}
    for n in order:
        for c in children(n):
            uses[c] = uses.get(c, 0) + 1
    text: dict = {}
    lets = []
    for n in order:
        if isinstance(n, Op):
            sym = _INFIX.get(n.name)
            args = [text[a] for a in n.args]
            if sym and len(args) == 2 and not n.attrs:
                t = f"({args[0]} {sym} {args[1]})"
            else:
                extra = "".join(f", {k}={v!r}" for k, v in n.attrs)
                t = f"{n.name}({', '.join(args)}{extra})"
        elif isinstance(n, Reduce):
            t = f"{n.op}({text[n.arg]}, over={list(n.axes)})"
        else:
            t = str(n)
        if n in names:
            t = names[n]
        elif uses.get(n, 0) > 1 and isinstance(n, (Op, Reduce)) and len(t) > 24:
            names[n] = f"v{len(names)}"
            lets.append((names[n], t))
            t = names[n]
        text[n] = t
    return lets, text[e]


Expr = Union[Load, Const, State, Op, Reduce]
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**", "gt": ">", "lt": "<",
          "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}


def walk(e: Expr):
    """Every node of an expression DAG once, children before parents."""
    seen, order = set(), []

    def go(x):
        if x in seen:
            return
        seen.add(x)
        for c in children(x):
            go(c)
        order.append(x)
    go(e)
    return order


def children(e: Expr) -> tuple:
    if isinstance(e, Op):
        return e.args
    if isinstance(e, Reduce):
        return (e.arg,)
    return ()


def axes_of(e: Expr, state_axes: tuple[str, ...]) -> frozenset[str]:
    """Iteration variables (state axes and "t") an expression varies along."""
    if isinstance(e, Load):
        return frozenset(i for i in e.index if isinstance(i, str))
    if isinstance(e, State):
        return frozenset(state_axes)
    if isinstance(e, Reduce):
        return axes_of(e.arg, state_axes) - frozenset(e.axes)
    if isinstance(e, Op):
        out = frozenset()
        for a in e.args:
            out |= axes_of(a, state_axes)
        return out
    return frozenset()


def map_loads(e: Expr, fn, memo: dict | None = None, axes: dict | None = None) -> Expr:
    """`e` with every Load replaced by ``fn(load)`` (the DAG's sharing kept); `axes`: a renaming
    of the axes reductions sum over, to go with one that `fn` makes of the loads' axes."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    if isinstance(e, Load):
        out = fn(e)
    elif isinstance(e, Op):
        out = Op(e.name, tuple(map_loads(a, fn, memo, axes) for a in e.args), e.attrs)
    elif isinstance(e, Reduce):
        out = Reduce(map_loads(e.arg, fn, memo, axes), tuple((axes or {}).get(a, a) for a in e.axes), e.op)
    else:
        out = e
    memo[e] = out
    return out


def loads(e: Expr) -> list[Load]:
    return [x for x in walk(e) if isinstance(x, Load)]


def uses_state(e: Expr) -> bool:
    return any(isinstance(x, State) for x in walk(e))


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str          # the graph value it came from (for reading the IR)
    ndim: int
    dtype: str         # torch dtype name at capture time, e.g. "bfloat16"


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    kind: str          # "steps": one value per time step, stacked; "final": after the last step
    expr: Expr
    index: Index       # per output dim: an axis name, "t", or 1 (a size-1 dim)
    dtype: str

    def __str__(self):
        return f"out[{', '.join(map(str, self.index))}] = {self.expr}   # {self.kind}, {self.dtype}"


MIX_COL = "j"        # the column axis of a Mix's matrix expression


@dataclasses.dataclass(frozen=True)
class Mix:
    """The non-diagonal part of the transition, along the region's last state axis (or
    `axis`): h_t[.., i, ..] += sum_j expr[.., i, .., j] * h_{t-1}[.., j, ..]. `expr` indexes its
    loads with the state axes and MIX_COL (the rows on the mixed axis, the columns on MIX_COL).
    Regions mixed along another axis than the last run as the same region with that axis moved
    last (`Region.mixed_last`). The block fields are filled by the block_sparse pass from the values the
    inputs had at compile time (for the strategy and the report); kernels recompute the block
    pattern from the actual inputs at every call, so a mask that changes is never stale."""
    expr: Expr
    block: int = 0                            # block size (0: not analysed)
    blocks: tuple[tuple[int, int], ...] = ()  # nonzero (row, col) blocks at compile time
    nblocks: int = 0                          # blocks per row (n // block)
    axis: str | None = None                   # the state axis it acts along (None: the last)

    @property
    def density(self) -> float:
        return len(self.blocks) / self.nblocks ** 2 if self.nblocks else 1.0

    def mask_text(self) -> str:
        """The block mask as rows of '#' (nonzero) and '.'."""
        nz = set(self.blocks)
        return "\n".join("".join("#" if (r, c) in nz else "." for c in range(self.nblocks))
                         for r in range(self.nblocks))


@dataclasses.dataclass(frozen=True)
class Region:
    """h_t = decay * h_{t-1} + drive over the state axes; outputs computed from h_t."""
    name: str
    axes: tuple[str, ...]                     # state axes, in the state's dim order
    axis_size: tuple[tuple[int, int], ...]    # per axis: (input, dim) whose size it is
    length: tuple[int, int]                   # (input, dim) whose size is the number of steps
    inputs: tuple[InputSpec, ...]
    decay: Expr
    drive: Expr
    outputs: tuple[OutputSpec, ...]
    init: int | None = None                   # input holding h_0 (laid out as the state); None: zeros
    state_dtype: str = "float32"
    reverse: bool = False
    mix: Mix | None = None                    # non-diagonal transition (block-sparse A)
    unit_axes: tuple[str, ...] = ()           # state axes of size 1 when compiled (Dynamo specialises 1)

    # -- derived properties the strategies and targets look at -------------------------------
    def decay_axes(self) -> frozenset[str]:
        return axes_of(self.decay, self.axes)

    @property
    def decay_kind(self) -> str:
        """"per-element" (Mamba-1), "shared" (constant over some state axis: Mamba-2),
        or "lti" (constant in time, S4D); "matrix" with a non-diagonal transition."""
        if self.mix is not None:
            return "matrix"
        ax = self.decay_axes()
        if "t" not in ax:
            return "lti"
        return "per-element" if set(self.axes) <= ax else "shared"

    @property
    def mix_axis(self) -> str | None:
        """The state axis the non-diagonal transition acts along (None: no mix)."""
        if self.mix is None:
            return None
        return self.mix.axis or self.axes[-1]

    def mixed_last(self) -> tuple["Region", tuple[int, ...]]:
        """The same region with the mixed axis moved last among the axes (executors that mix
        along the last axis run it), and the permutation of the state dims: the initial state
        must be given as ``h0.permute(perm)``."""
        k = self.axes.index(self.mix_axis)
        perm = tuple(d for d in range(len(self.axes)) if d != k) + (k,)
        if perm == tuple(range(len(self.axes))):
            return dataclasses.replace(self, mix=dataclasses.replace(self.mix, axis=None)), perm
        sizes = tuple((i, perm.index(d)) if i == self.init else (i, d) for i, d in self.axis_size)
        return dataclasses.replace(self, axes=tuple(self.axes[p] for p in perm),
                                   axis_size=tuple(sizes[p] for p in perm),
                                   mix=dataclasses.replace(self.mix, axis=None)), perm

    def without_unit_sums(self) -> "Region":
        """The region with its outputs' sums over size-1 state axes dropped (a sum of one
        element is that element): such an output then varies along an axis it does not index,
        at that axis's single index. How `ssmc.assemble` writes a size-1 dim squeezed away."""
        outs = []
        for o in self.outputs:
            e = o.expr
            if isinstance(e, Reduce) and e.op == "sum" and set(e.axes) & set(self.unit_axes):
                rest = tuple(a for a in e.axes if a not in self.unit_axes)
                e = Reduce(e.arg, rest, e.op) if rest else e.arg
            outs.append(dataclasses.replace(o, expr=e))
        return dataclasses.replace(self, outputs=tuple(outs))

    def key(self) -> str:
        import hashlib
        scalars = (self.name, self.axes, self.axis_size, self.length, self.inputs, self.init,
                   self.state_dtype, self.reverse, tuple((o.kind, o.index, o.dtype) for o in self.outputs),
                   (self.mix.block, self.mix.blocks) if self.mix else None, self.unit_axes)
        return hashlib.sha256((repr(scalars) + "\n" + str(self)).encode()).hexdigest()[:16]

    def __str__(self):
        mixed = " + M_t h_(t-1)" if self.mix is not None else ""
        lines = [f"# region {self.name}: h_t = a_t * h_(t-1){mixed} + b_t over axes {list(self.axes)}"
                 f"{' (reverse time)' if self.reverse else ''}"]
        for i, s in enumerate(self.inputs):
            lines.append(f"in{i}: {s.dtype}[{s.ndim}d]  # {s.name}")
        sizes = ", ".join(f"{a}=in{i}.shape[{d}]" for a, (i, d) in zip(self.axes, self.axis_size))
        lines.append(f"# sizes: {sizes}, t in range(in{self.length[0]}.shape[{self.length[1]}])")
        lines.append(f"h[i] = {'in%d[i]' % self.init if self.init is not None else 0}   "
                     f"# initial state; state {self.state_dtype}" +
                     (" (float64 where an input is)" if self.state_dtype == "float32" else ""))
        names: dict = {}

        def show(e):
            lets, text = format_expr(e, names)
            lines.extend(f"{n} = {v}" for n, v in lets)
            return text
        lines.append(f"a = {show(self.decay)}   # decay: {self.decay_kind}")
        lines.append(f"b = {show(self.drive)}")
        if self.mix is None:
            lines.append("h[i] = a * h[i] + b")
        else:
            last = self.mix_axis
            lines.append(f"m[{last}, {MIX_COL}] = {show(self.mix.expr)}   # transition along {last}"
                         + (f", {self.mix.block}x{self.mix.block} blocks, {len(self.mix.blocks)}/"
                            f"{self.mix.nblocks ** 2} nonzero" if self.mix.block else ""))
            lines.append(f"h[i] = a * h[i] + sum_{MIX_COL}(m[{last}, {MIX_COL}] * h[..., {MIX_COL}]) + b")
        for o in self.outputs:
            text = show(o.expr)
            lines.append(f"out[{', '.join(map(str, o.index))}] = {text}   # {o.kind}, {o.dtype}")
        return "\n".join(lines)


# -- products and sums of expressions -----------------------------------------------------------------

def factors(e) -> list:
    """The factors of a product tree: mul and neg are flattened, anything else is one factor."""
    if isinstance(e, Op) and not e.attrs and e.name == "mul":
        return factors(e.args[0]) + factors(e.args[1])
    if isinstance(e, Op) and not e.attrs and e.name == "neg":
        return [Const(-1.0)] + factors(e.args[0])
    return [e]


def summands(e, sign: int = 1) -> list:
    """(sign, term) of a sum tree (add and sub flattened)."""
    if isinstance(e, Op) and not e.attrs and e.name in ("add", "sub"):
        return summands(e.args[0], sign) + summands(e.args[1], sign if e.name == "add" else -sign)
    return [(sign, e)]


def product(fs: list):
    """The product of factors (Const(1.0) for none); constants are multiplied out."""
    c = math.prod(f.value for f in fs if isinstance(f, Const))
    rest = [f for f in fs if not isinstance(f, Const)]
    out = None
    for f in rest:
        out = f if out is None else Op("mul", (out, f))
    if out is None:
        return Const(c)
    return out if c == 1.0 else Op("mul", (out, Const(c)))


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def to_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
