"""The region IR: one linear recurrence h_t = a_t * h_{t-1} + b_t and what is fused around it.

Everything is a frozen, hashable dataclass, and `str(region)` prints readable Python.

Iteration space: the state axes ``i0, i1, ...`` (the state's shape per step) and time ``t``.
A `Load` reads one element of a region input; its `index` says, for each dim of that input
tensor, which iteration variable indexes it: an axis name (``"i1"``), ``"t"``, or an int
(a constant index; 0 for size-1 dims). Strides come from the actual tensors at run time, so
any layout ((b, l, d), (b, d, l), transposed, expanded) is one Load with a different index.

`decay` (a_t) and `drive` (b_t) are expressions free of the state. Each output is an
expression of `State()` (the new state h_t) and loads, with `Reduce` for contractions over
state axes (the readout sum_n h*C); `index` places it in the output tensor.
"""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    args: tuple
    attrs: tuple = ()   # sorted (key, value) pairs, e.g. (("dtype", "bfloat16"),)

    def attr(self, key, default=None):
        return dict(self.attrs).get(key, default)

    def __str__(self):
        sym = _INFIX.get(self.name)
        if sym and len(self.args) == 2 and not self.attrs:
            return f"({self.args[0]} {sym} {self.args[1]})"
        inner = ", ".join(str(a) for a in self.args)
        extra = "".join(f", {k}={v!r}" for k, v in self.attrs)
        return f"{self.name}({inner}{extra})"


@dataclasses.dataclass(frozen=True)
class Reduce:
    arg: "Expr"
    axes: tuple[str, ...]
    op: str = "sum"

    def __str__(self):
        return f"{self.op}({self.arg}, over={list(self.axes)})"


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

    # -- derived properties the strategies and targets look at -------------------------------
    def decay_axes(self) -> frozenset[str]:
        return axes_of(self.decay, self.axes)

    @property
    def decay_kind(self) -> str:
        """"per-element" (Mamba-1), "shared" (constant over some state axis: Mamba-2),
        or "lti" (constant in time, S4D)."""
        ax = self.decay_axes()
        if "t" not in ax:
            return "lti"
        return "per-element" if set(self.axes) <= ax else "shared"

    def key(self) -> str:
        import hashlib
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def __str__(self):
        lines = [f"# region {self.name}: h_t = a_t * h_(t-1) + b_t over axes {list(self.axes)}"
                 f"{' (reverse time)' if self.reverse else ''}"]
        for i, s in enumerate(self.inputs):
            lines.append(f"in{i}: {s.dtype}[{s.ndim}d]  # {s.name}")
        sizes = ", ".join(f"{a}=in{i}.shape[{d}]" for a, (i, d) in zip(self.axes, self.axis_size))
        lines.append(f"# sizes: {sizes}, t in range(in{self.length[0]}.shape[{self.length[1]}])")
        lines.append(f"h[i] = {'in%d[i]' % self.init if self.init is not None else 0}   "
                     f"# initial state, {self.state_dtype}")
        lines.append(f"a = {self.decay}   # decay: {self.decay_kind}")
        lines.append(f"b = {self.drive}")
        lines.append("h[i] = a * h[i] + b")
        lines.extend(str(o) for o in self.outputs)
        return "\n".join(lines)


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def to_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
