"""Prints region IR expressions as Triton code, each subexpression once and at its own rank.

A kernel body is a few blocks of straight-line code (before the time loop, inside it, after
it). A `Frame` says how each iteration variable reads in one block: a scalar (``idx_i0``,
``t``) or a broadcast vector (``od`` = ``offs_d[:, None]``) with its mask. Loads become
``tl.load(ptr + offsets, mask)`` whose shape is exactly the axes the load varies along, so
every Op is evaluated at the rank of its operands: ``softplus(dt + bias)`` is a (BLOCK_D, 1)
value per step, ``exp(delta * A)`` the full (BLOCK_D, BLOCK_N) tile, a decay shared per head
a scalar per program. Subexpressions free of time and of the state are hoisted into the
prelude before the time loop (they are shared by every block).

Numerics follow the torch reference (ssmc.targets.reference): casts to a float type keep the
compute dtype, softplus honours beta/threshold, exps are exp2 with log2(e) folded into the
loop-invariant factor of ``exp(u * v)`` when there is one. Transcendentals Triton's core lacks
(log1p, expm1, tanh, pow, and sum without Triton's own @jit wrapper) are small @jit helpers from templates/triton/macros.py.j2, written
with core ops only so the same source runs under TRITON_INTERPRET=1 and on sm_80 / sm_90.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ssmc import ir
from ssmc.ir import Const, Load, Op, Reduce, State

LOG2E = 1.4426950408889634

# op -> format string over the printed operands {0}, {1}, {2}. {cdt}: the compute dtype; {nl2e}:
# the constant -log2(e) in it.
_FORMAT = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "gt": "({0} > {1})", "lt": "({0} < {1})", "ge": "({0} >= {1})", "le": "({0} <= {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})",
    "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "where": "tl.where({0}, {1}, {2})",
    "neg": "(-{0})", "exp2": "tl.exp2({0})", "expm1": "_expm1({0})", "log": "tl.log({0})",
    "log1p": "_log1p({0})", "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})",
    "tanh": "_tanh({0})", "sigmoid": "(1.0 / (1.0 + tl.exp2({0} * {nl2e})))",
    "logsigmoid": "(tl.minimum({0}, 0.0) - _log1p(tl.exp2(tl.abs({0}) * {nl2e})))",
    "silu": "({0} / (1.0 + tl.exp2({0} * {nl2e})))", "relu": "tl.where({0} < 0.0, 0.0, {0})",
    "abs": "tl.abs({0})", "reciprocal": "(1.0 / {0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
}
# ops printed by code below rather than by a format string
_SPECIAL = {"exp", "pow", "softplus", "cast"}
SUPPORTED_OPS = frozenset(_FORMAT) | _SPECIAL
_ATTRS = {"softplus": {"beta", "threshold"}, "cast": {"dtype"}}
_TL_INT = {"int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32", "int64": "tl.int64",
           "uint8": "tl.uint8"}
_INFIX_BINARY = {"add", "sub", "mul", "div", "gt", "lt", "ge", "le", "eq", "ne"}


def literal(v: float, cdt: str = "tl.float32") -> str:
    """A constant Triton accepts (inf and nan included). Triton types a Python float literal as
    fp32, so in fp64 code a value that fp32 cannot hold exactly (0.9, log2 e) is made an fp64
    scalar instead; otherwise fp64 kernels would be off by fp32's rounding (seen by the GPU fuzzer)."""
    v = float(v)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '(-float("inf"))'
    if cdt == "tl.float64" and torch.tensor(v, dtype=torch.float32).item() != v:
        return f"tl.full((), {v!r}, tl.float64)"
    return repr(v)


def unsupported(e: ir.Expr) -> str | None:
    """Why this printer cannot print `e` (one node), or None."""
    if isinstance(e, Op):
        if e.name not in SUPPORTED_OPS:
            return f"op {e.name!r} has no Triton printing"
        extra = {k for k, _ in e.attrs} - _ATTRS.get(e.name, set())
        if extra:
            return f"op {e.name} with attributes {sorted(extra)}"
        if e.name == "cast":
            dt = e.attr("dtype")
            if not (dt in _TL_INT or dt == "bool" or ir.to_dtype(dt).is_floating_point):
                return f"cast to {dt}"
    if isinstance(e, Reduce) and e.op != "sum":
        return f"reduction {e.op!r}"
    return None


@dataclasses.dataclass
class Frame:
    """How iteration variables read in one block of code.

    codes: axis name or "t" -> (code, mask or None); scalars have no mask.
    state: the code of h in this block ("h", "H", "h[:, :, None]"), None before the update.
    reg_dim: the position of the register (reduced) axis in the tile, for the sum.
    """
    codes: dict
    state: str | None
    reg_dim: int | None
    reg_mask: str | None


@dataclasses.dataclass
class TimeLoad:
    """A load indexed by time, printed while the printer double-buffers such loads
    (`TritonPrinter.double_buffer`; the rows variant's loads once per chunk): `str` gives the
    plain line ``name = tl.load(...)``; `at` holds the same load at other positions (position ->
    its code there: "next", the next chunk's; "first", the first chunk's, before the time loop),
    which a kernel loads ahead into `ahead` and hands on as `raw`, in the input's dtype."""
    name: str
    code: str                        # tl.load(...) here, in the input's dtype
    conv: str                        # ".to(<compute dtype>)" for float inputs, else ""
    at: dict

    def __str__(self) -> str:
        return f"{self.name} = {self.code}{self.conv}"

    @property
    def raw(self) -> str:
        """This step's value, loaded by the step before (or before the loop)."""
        return f"{self.name}_r"

    @property
    def ahead(self) -> str:
        """The next step's value, loaded by this one."""
        return f"{self.name}_q"

    def fetched(self, cond: str) -> str:
        """The line that reads the value loaded ahead where the constexpr `cond` holds, and
        loads it here otherwise."""
        return f"{self.name} = ({self.raw} if {cond} else {self.code}){self.conv}"


class TritonPrinter:
    """Prints expressions into named temporaries, once each (a DAG, not a tree).

    ``prelude`` collects loop-invariant lines (no "t", no state); `block()` starts a new
    block whose lines and temporaries are private to it (a loop body, the final epilogue).

    `split(axis, lines, frame)` adds a level between the two, for kernels that loop over a state
    axis inside each chunk of time (the ``rows`` variant): values free of that axis and of the
    state go to ``lines`` (printed once per chunk, before the loop over the axis), the rest to
    the current block (the loop's body). Values free of time and of the state that vary along
    the axis (Mamba's A[d, n]) are hoisted as tiles over it, and the loop's body reads its
    index's column of them: one load before the time loop instead of one per chunk and index
    (and, measured with ptxas for sm_90, 143 registers a thread instead of 180).

    ``columns = False`` (the ``seq`` variant) prints such values in the loop's body instead, at
    the rank of the axis's code there.

    `double_buffer(axis, at)` prints every load indexed by time and free of `axis` as a
    `TimeLoad` (a line object, not a string) with its code at the positions `at` names (frame
    codes that replace the current ones there), so a kernel can issue a later chunk's loads
    early; ``time_loads`` lists them in printing order.
    """

    def __init__(self, region: ir.Region, cdt: str = "tl.float32", prefix: str = "v"):
        self.r = region
        self.cdt = cdt
        self.prefix = prefix
        self.prelude: list[str] = []
        self._pre_memo: dict = {}
        self._pre_frame: Frame | None = None
        self._n = 0
        self.frame: Frame | None = None
        self.lines: list[str] | None = None
        self._memo: dict = {}
        self._split: str | None = None           # the axis looped over inside a chunk
        self._outer: tuple | None = None         # (lines, memo, frame) of the per-chunk level
        self._ahead: tuple | None = None         # (axis, positions) of double_buffer
        self.time_loads: list[TimeLoad] = []
        self.columns = True                      # hoist values along the split axis as tiles (rows)
        # the seq layouts: values free of time and state but along the split axis, printed once
        # per copy of the per-index code before the time loop (names with "@s", the template
        # writes the copy's number there); None: printed where they are read
        self.copy_prelude: list[str] | None = None
        self._copy_memo: dict = {}

    # -- blocks --------------------------------------------------------------------------------
    def lit(self, v: float) -> str:
        return literal(v, self.cdt)

    def set_prelude_frame(self, frame: Frame):
        """How axes read before the time loop (where hoisted values are printed)."""
        self._pre_frame = frame

    def block(self, frame: Frame) -> list[str]:
        """Start a block; returns its line list (printing appends to it)."""
        self.frame, self.lines, self._memo = frame, [], {}
        return self.lines

    def switch(self, lines: list[str], state: str | None = None):
        """Continue the current block's temporaries into another line list (pre -> post)."""
        self.lines = lines
        if state is not None:
            self.frame = dataclasses.replace(self.frame, state=state)

    def split(self, axis: str | None, lines: list[str] | None = None, frame: Frame | None = None):
        """Print values free of `axis` (and of the state) into `lines` with `frame` from now on;
        ``split(None)`` ends it."""
        self._split = axis
        self._outer = None if axis is None else (lines, {}, frame)

    def inherit(self) -> None:
        """Continue the per-chunk level in the current block: ends the split, and what the
        level printed reads by its names here (values computed before the loop over the axis
        are reused after it; new ones are printed here, where they are needed)."""
        outer = self._outer
        self.split(None)
        if outer is not None:
            self._memo.update(outer[1])

    def after_split(self, frame: Frame) -> list[str]:
        """Start a block after the loop over the split axis (the seq backward's per-chunk
        epilogue): it reads what the per-chunk level printed by its names, and is that level
        from now on (the split axis stays split, so nothing along it is hoisted)."""
        lines, memo, _ = self._outer
        self.frame, self.lines, self._memo = frame, [], dict(memo)
        self._outer = (self.lines, self._memo, frame)
        return self.lines

    def _tile(self, e) -> str:
        """`e` (free of time and state) printed before the time loop over the whole split axis."""
        saved, self._split = self._split, None
        try:
            return self.expr(e)
        finally:
            self._split = saved

    def _column(self, key, tile: str) -> str:
        """The loop's current index of a hoisted tile, once per block."""
        if key not in self._memo:
            on = self._pre_frame.codes[self._split][0]
            k = self._pre_frame.reg_dim
            idx = self.frame.codes[self._split][0]
            name = self._name(False)
            self.lines.append(f"{name} = tl.expand_dims(_sum(tl.where({on} == {idx}, {tile}, 0.0), {k}), {k})")
            self._memo[key] = name
        return self._memo[key]

    def _columnar(self, e) -> bool:
        """Hoisted as a tile over the split axis, read by column in the loop over it."""
        return (self.columns and self._split is not None and self._split in self.axes(e)
                and self._steady(e) and not isinstance(e, Const))

    def double_buffer(self, axis: str | None, at: dict | None = None):
        """From now on print loads indexed by time and free of `axis` as `TimeLoad`s, with
        their code at the positions of `at` (position -> {axis name or "t": (code, mask)}, which
        replace the frame's codes there). ``double_buffer(None)`` ends it."""
        self._ahead = None if axis is None else (axis, at or {})

    def _time_load(self, e: Load, level: str) -> str:
        lines, memo, frame = self._where(level)
        saved = self.frame
        try:
            self.frame = frame
            code, conv = self._load_parts(e)
            at = {}
            for pos, over in self._ahead[1].items():
                self.frame = dataclasses.replace(frame, codes={**frame.codes, **over})
                at[pos] = self._load_parts(e)[0]
        finally:
            self.frame = saved
        name = self._name(False)
        ld = TimeLoad(name, code, conv, at)
        lines.append(ld)
        memo[e] = name
        self.time_loads.append(ld)
        return name

    def memoize(self, e, name: str):
        """`e` reads as `name` in the current block (an accumulator the kernel keeps)."""
        self._memo[e] = name

    # -- helpers -------------------------------------------------------------------------------
    def axes(self, e) -> frozenset:
        return ir.axes_of(e, self.r.axes)

    def hoistable(self, e) -> bool:
        ax = self.axes(e)
        return ("t" not in ax and not ir.uses_state(e) and not isinstance(e, Const)
                and (self._split is None or self._split not in ax))

    def _level(self, e) -> str:
        """Where `e` is printed: "pre" (before the time loop), "copy" (before the time loop,
        once per copy: `copy_prelude`), "outer" (per chunk, outside the split axis's loop) or
        "cur" (the current block)."""
        if self.hoistable(e):
            return "pre"
        if (self.copy_prelude is not None and self._split is not None and "t" not in self.axes(e)
                and not ir.uses_state(e) and not isinstance(e, Const)):
            return "copy"
        if self._split is not None and self._split not in self.axes(e) and not ir.uses_state(e):
            return "outer"
        return "cur"

    def _name(self, hoisted: bool) -> str:
        self._n += 1
        return f"{'p' if hoisted else self.prefix}{self._n}"

    def _where(self, level: str):
        """(lines, memo, frame) of a level."""
        if level == "pre":
            return self.prelude, self._pre_memo, self._pre_frame
        if level == "copy":
            return self.copy_prelude, self._copy_memo, self._pre_frame
        if level == "outer":
            return self._outer
        return self.lines, self._memo, self.frame

    def _emit(self, e, code: str, level: str) -> str:
        lines, memo, _ = self._where(level)
        name = self._name(level in ("pre", "copy")) + ("@s" if level == "copy" else "")
        lines.append(f"{name} = {code}")
        memo[e] = name
        return name

    # -- printing ------------------------------------------------------------------------------
    def expr(self, e: ir.Expr) -> str:
        """The code (a temporary's name or a literal) of `e` in the current block."""
        if isinstance(e, Const):
            return self.lit(e.value)
        if e in self._memo:                      # the current block's own names come first
            return self._memo[e]
        if self._columnar(e):
            return self._column(("col", e), self._tile(e))
        level = self._level(e)
        _, memo, frame = self._where(level)
        if e in memo:
            return memo[e]
        folded = self._fold(e)
        if folded is not None:
            return folded
        if (self._ahead is not None and isinstance(e, Load) and level != "pre"
                and "t" in self.axes(e) and self._ahead[0] not in self.axes(e)):
            return self._time_load(e, level)
        saved, self.frame = self.frame, frame
        try:
            code = self._code(e)
        finally:
            self.frame = saved
        if isinstance(e, State):
            return code
        return self._emit(e, code, level)

    def _fold(self, e) -> str | None:
        """An Op of constants only is evaluated here (float results only)."""
        if not isinstance(e, Op) or not e.args or not all(isinstance(a, Const) for a in e.args):
            return None
        from ssmc.targets.reference import _op
        try:
            v = _op(e, [torch.tensor(a.value, dtype=torch.float64) for a in e.args], torch.float64)
        except Exception:
            return None
        if not v.is_floating_point():
            return None
        return self.lit(v.item())

    def _code(self, e) -> str:
        if isinstance(e, Load):
            return self.load(e)
        if isinstance(e, State):
            if self.frame.state is None:
                raise ValueError("the state is read before the update")
            return self.frame.state
        if isinstance(e, Reduce):
            k, mask = self.frame.reg_dim, self.frame.reg_mask
            x = self.expr(e.arg)
            if not set(e.axes) <= self.axes(e.arg):   # constant along the axis: size * value
                return f"({x} * SIZE_N)"
            inner = f"tl.where({mask}, {x}, 0.0)" if mask else x
            return f"tl.expand_dims(_sum({inner}, {k}), {k})"
        if isinstance(e, Op):
            return self.op(e)
        raise TypeError(f"cannot print {e!r}")

    def load(self, ld: Load) -> str:
        code, conv = self._load_parts(ld)
        return code + conv

    def _load_parts(self, ld: Load) -> tuple[str, str]:
        """(``tl.load(...)`` in the input's dtype, the conversion to the compute dtype) in the
        current frame."""
        scal, vec, masks = [], [], []
        for d, ix in enumerate(ld.index):
            s = f"in{ld.input}_s{d}"
            if isinstance(ix, int):
                if ix:
                    scal.append(f"{ix} * {s}")
                continue
            code, mask = self.frame.codes[ix]
            (vec if mask else scal).append(f"{code} * {s}")
            if mask and mask not in masks:
                masks.append(mask)
        off = " + ".join(scal + vec) or "0"
        spec = self.r.inputs[ld.input]
        is_float = spec.dtype not in ("bool",) and ir.to_dtype(spec.dtype).is_floating_point
        other = "0.0" if is_float else "0"
        m = f", mask={' & '.join(masks)}, other={other}" if masks else ""
        conv = f".to({self.cdt})" if is_float else ""
        return f"tl.load(in{ld.input}_ptr + ({off}){m})", conv

    def _arg(self, a, other: str) -> str:
        """An operand of a @jit helper: a constant becomes a tensor shaped like `other`."""
        if isinstance(a, Const):
            c = self.lit(a.value)
            return f"tl.where({other} == {other}, {c}, {c})"
        return self.expr(a)

    def op(self, e: Op) -> str:
        n = e.name
        if n == "exp":
            return self.exp(e.args[0])
        if n == "pow":
            return self.pow(*e.args)
        if n == "softplus":
            x = self.expr(e.args[0])
            beta, thr = float(e.attr("beta", 1.0)), float(e.attr("threshold", 20.0))
            bx = x if beta == 1.0 else f"({x} * {self.lit(beta)})"
            soft = f"_log1p(tl.exp2({bx} * {self.lit(LOG2E)}))"
            if beta != 1.0:
                soft = f"({soft} / {self.lit(beta)})"
            return f"tl.where({bx} > {self.lit(thr)}, {x}, {soft})"
        if n == "cast":
            x = self.expr(e.args[0])
            dt = e.attr("dtype")
            if dt == "bool":
                return f"({x} != 0)"
            if dt in _TL_INT:
                return f"{x}.to({_TL_INT[dt]})"
            return f"{x}.to({self.cdt})"
        args = [self.expr(a) for a in e.args]
        return _FORMAT[n].format(*args, cdt=self.cdt, nl2e=self.lit(-LOG2E))

    def exp(self, u) -> str:
        """exp(u) as exp2; log2(e) is folded into a loop-invariant factor of u = p * q."""
        if isinstance(u, Op) and u.name == "mul" and not u.attrs:
            p, q = u.args
            for inv, var in ((q, p), (p, q)):
                if isinstance(inv, Const):
                    return f"tl.exp2({self.expr(var)} * {self.lit(inv.value * LOG2E)})"
                if self._columnar(inv) and not self._steady(var):
                    key = ("log2e", inv)
                    if key not in self._pre_memo:
                        self._emit(key, f"{self._tile(inv)} * {self.lit(LOG2E)}", "pre")
                    return f"tl.exp2({self.expr(var)} * {self._column(key, self._pre_memo[key])})"
                if self._steady(inv) and not self._steady(var):
                    key, level = ("log2e", inv), self._level(inv)
                    memo = self._where(level)[1]
                    if key not in memo:
                        self._emit(key, f"{self.expr(inv)} * {self.lit(LOG2E)}", level)
                    return f"tl.exp2({self.expr(var)} * {memo[key]})"
        return f"tl.exp2({self.expr(u)} * {self.lit(LOG2E)})"

    def _steady(self, e) -> bool:
        """Free of time and of the state: the same at every step (hoisted, or printed once per
        chunk and state index in the rows variant)."""
        return "t" not in self.axes(e) and not ir.uses_state(e) and not isinstance(e, Const)

    def pow(self, x, y) -> str:
        if isinstance(y, Const):
            c = float(y.value)
            px = self.expr(x)
            small = {1.0: "{0}", 2.0: "({0} * {0})", 3.0: "({0} * {0} * {0})", 0.5: "tl.sqrt({0})",
                     -0.5: "tl.rsqrt({0})", -1.0: "(1.0 / {0})", -2.0: "(1.0 / ({0} * {0}))",
                     0.0: "tl.where({0} == {0}, 1.0, 1.0)"}
            if c in small:
                return small[c].format(px)
            return f"_pow({px}, {self.lit(c)})"
        py = self.expr(y)
        if isinstance(x, Const):
            if x.value > 0:
                return f"tl.exp2({py} * {self.lit(math.log2(x.value))})"
            return f"_pow({self._arg(x, py)}, {py})"
        return f"_pow({self.expr(x)}, {py})"
