"""detect_recurrence: prove the carried value follows h_t = a_t * h_{t-1} + b_t.

Expects a candidate with a step body (reroll). Walks from the carried state to the new state:
every node on the way must be linear in the state (a product with a state-free factor, sums
and differences of state terms and state-free terms, division by a state-free value,
negation, float casts, identity views, ``torch.where`` on a state-free condition). Builds a_t (sum over paths of the products of the
multipliers) and b_t (the new state with the state set to zero) as new, state-free nodes of
the step body. Everything else is declined with the op that broke linearity: h inside a
nonlinearity, a gate computed from h, h*h. Leaves `rec` on the candidate and a first,
unfused region (`plan`).

Matrix-valued coefficients: a contraction of the state along its last dim with a state-free
matrix (``h @ W``, ``torch.einsum("bij,bj->bi", Abar, h)``) makes the transition non-diagonal:
h_t = a_t * h_{t-1} + M_t h_{t-1} + b_t, still linear, and associative (composition is a
matrix product). M_t is built as one body node laid out (*state, j): M[.., i, j] multiplies
h[.., j] into h[.., i]; matrix products in sequence (``h @ W1 @ W2``) compose into it. A
product along another dim than the state's last declines.

Complex states (LRU-style, h = lam * h + u over complex64/complex128): the step is first
rewritten to carry view_as_real(h), with each complex channel's multiplication by lam a 2x2
rotation-scale block along the pair axis (`ssmc.complex_state`); the proof then runs on that
real step and finds the block-diagonal transition as above.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ssmc.assemble import AssembleError, Recurrence, assemble
from ssmc.capture import _Builder, _fake_mode, one_dim_index
from ssmc.complex_state import ComplexError, is_complex_loop, split_complex
from ssmc.ops import canonical, dtype, same_shape, shape

from .base import Decline, Pass


class DetectRecurrence(Pass):
    """Expects: candidates with a step body. Leaves: `rec` (a, b as body nodes) and an unfused
    region plan on each linear candidate; every other candidate declined with the reason."""
    name = "detect_recurrence"
    after = "reroll"
    required = True

    def run(self, ctx) -> bool:
        changed = False
        for cand in ctx.live():
            try:
                if is_complex_loop(cand.loop):
                    cand.loop, note = split_complex(ctx.gm, cand.loop, _fake_mode_outer(cand.loop))
                    cand.notes.append(note)
                cand.rec, cand.plan = _detect_and_assemble(cand.loop)
                changed = True
            except ComplexError as e:
                cand.decline(self.name, f"complex state not split into real pairs: {e}")
            except (Decline, AssembleError) as e:
                cand.decline(self.name, str(e))
        return changed


def _detect_and_assemble(loop):
    """`detect`, then `assemble` the unfused plan. Where a value the drive multiplies by a matrix
    is also read as the state's elements (a Runge-Kutta step: ``u`` in ``k1 = h @ A.T + u`` and,
    through ``k2 = (h + dt/2 k1) @ A.T + u``, in ``u @ A.T``), its dim would be both a row and a
    column of the transition: detect again with the drive's matrix products computed before the
    region (`apply_matrix`), the first attempt's nodes taken out of the body."""
    body = loop.body.graph
    before = set(body.nodes)
    rec = detect(loop)
    try:
        return rec, assemble(loop, rec, False, False)
    except AssembleError as e:
        if "are mixed by" not in str(e) or rec.m is None:
            raise
    for n in reversed(list(body.nodes)):
        if n not in before and not n.users:
            body.erase_node(n)
    rec = detect(loop, apart=True)
    return rec, assemble(loop, rec, False, False)


def _describe(n: fx.Node) -> str:
    t = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return f"`{t}` (node {n.name})"


def _carried_value(loop):
    """The new state, looked through identities of the same shape and dtype (minGRU's
    ``h = out[:, -1:]`` of a size-1 dim, a ``.contiguous()``): the value they pass on is carried
    instead, so that what reads it (the readout of ``out``) reads the new state."""
    body = loop.body.graph
    out = next(n for n in body.nodes if n.op == "output")
    new, changed = loop.carry_outputs()[0], False
    while isinstance(new, fx.Node):
        c = canonical(new)
        src = c.args[0] if c is not None and c.kind == "identity" and c.args else None
        if not isinstance(src, fx.Node) or not same_shape(shape(src), shape(new)) or dtype(src) != dtype(new):
            break
        new, changed = src, True
    if changed:
        vals = list(out.args[0])
        vals[0] = new
        out.args = (tuple(vals),)
        loop.body.recompile()
    return new


def detect(loop, apart: bool = False) -> Recurrence:
    """The recurrence h = a*h + b (+ M h) of a loop's step, or Decline. `apart`: the drive's matrix
    products are `apply_matrix` nodes (computed before the region), not contractions the
    assembler ties to the state's axes."""
    if loop.n_carry == 0:
        raise Decline("no value passes from one step to the next (a map over the steps, not a recurrence)")
    if loop.n_carry != 1:
        names = ", ".join(str(v) for v in loop.carry_outputs())
        raise Decline(f"the loop carries {loop.n_carry} values ({names}); ssmc handles one state")
    body = loop.body.graph
    prev = loop.carry_nodes()[0]
    new = _carried_value(loop)
    if not isinstance(new, fx.Node):
        raise Decline("the new state is not a tensor computed in the step")
    sshape = shape(prev)
    if shape(new) != sshape:
        raise Decline(f"the state changes shape within a step: {sshape} -> {shape(new)}")
    if dtype(prev) is not None and dtype(prev).is_complex:
        raise Decline(f"the state is complex ({dtype(prev)}) and was not split into real pairs")
    if not dtype(prev) or not dtype(prev).is_floating_point:
        raise Decline(f"the state has dtype {dtype(prev)}; ssmc handles floating-point states")
    dep = {prev}
    for n in body.nodes:
        if any(a in dep for a in n.all_input_nodes) and n.op != "output":
            dep.add(n)
    if new not in dep:
        raise Decline("the new state does not depend on the previous one")
    # nodes on a path prev -> new
    anc = {new}
    for n in reversed(list(body.nodes)):
        if n in anc:
            anc.update(a for a in n.all_input_nodes if a in dep)
    path = anc & dep
    after_new = {new}
    for n in body.nodes:
        if n is not new and any(a in after_new for a in n.all_input_nodes) and n.op != "output":
            after_new.add(n)
    epilogue = after_new - {new}
    for n in dep - path - after_new:
        if n.op != "output" and n.users:
            raise Decline(f"{_describe(n)} reads the previous state outside the update h = a*h + b")
    for v in loop.result_values():
        if isinstance(v, fx.Node) and v in path and v is not new:
            raise Decline(f"{_describe(v)}, a result of the step, is computed from the state before "
                          "its update")
    for n in epilogue:
        bad = [a for a in n.all_input_nodes if a in path and a is not new]
        if bad:
            raise Decline(f"{_describe(n)} reads both the previous and the new state")
    b = _Builder(body, _fake_mode(loop.body.graph) or _fake_mode_outer(loop))
    lin = _Linear(b, prev, path, sshape, apart)
    a_val, b_val = lin.of(new)
    m, mdim = None, None
    if isinstance(a_val, _Red):
        raise Decline(f"the new state {_describe(new)} is a sum of the state over one of its dims")
    if isinstance(a_val, _Mat):
        a_val, m, mdim = a_val.d, a_val.m, a_val.dim
    return Recurrence(prev, new, 0.0 if a_val is None else a_val, 0.0 if b_val is None else b_val,
                      dep - {prev}, epilogue, m, None if mdim in (None, len(sshape) - 1) else mdim)


def _fake_mode_outer(loop):
    for x in [*loop.invariants, *(r.source for r in loop.reads)]:
        mode = getattr(x.meta.get("example_value"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def compose(w, m):
    """W' applied after an earlier matrix M of the step (``h @ W1 @ W2``, ``lam * conj(h)``).
    A function of its own, outside ssmc's op vocabulary: the product is computed before the
    region, and the assembler never ties the dims of its factors to each other's axes (a factor
    may also be a term of the transition on its own, its rows on the state's last axis, while
    here its rows are summed over)."""
    return torch.matmul(w, m)


def apply_matrix(w, v):
    """W' (laid out (*state, k)) applied to v along the state's last dim. Outside ssmc's op
    vocabulary like `compose`: computed before the region (for every step at once where v changes
    from step to step), so the assembler does not tie v's dims to the transition's columns."""
    return torch.matmul(w, v.unsqueeze(-1)).squeeze(-1)


def compose_along(w, m, dim):
    """`compose` for matrices acting along a state dim other than the last (rows there, columns
    last, as `_Mat` lays them out; `dim` < -2 counts from the end, the columns included): W'
    after M. Computed before the region, like `compose`."""
    return torch.movedim(torch.matmul(torch.movedim(w, dim, -2), torch.movedim(m, dim, -2)), -2, dim)


def columns(w, dim):
    """w's `dim` moved to a new last dim, a size-1 dim left in its place: the columns of a
    rank-1 transition u w^T along `dim`, laid out (*state, j). Outside ssmc's op vocabulary like
    `compose`: computed before the region, so the assembler does not tie w's dims to the column
    axis (the delta rule's k is both the rows and the columns of I - beta k k^T)."""
    return torch.movedim(w, dim, -1).unsqueeze(dim)


def column_sums(m, dim):
    """The column sums of a transition m laid out (*state, j) acting along `dim`, laid out as the
    state (j at `dim`). Outside ssmc's op vocabulary like `compose`: computed before the region."""
    return torch.movedim(m.sum(dim), -1, dim)


def placement(rows: int, cols: int, pairs, d: int, nd: int, dtype, device):
    """The 0/1 matrix (rows x cols) with ones at (i0 + k, j0 + k) for each (i0, j0, length) in
    pairs, laid out for a transition along state dim d of nd dims (rows at d, columns last): how
    ``torch.cat``, ``torch.roll`` and ``F.pad`` move slices of the state along d (a shift
    register). A constant: computed before the region, like `compose`."""
    m = torch.zeros(rows, cols, dtype=dtype, device=device)
    for i0, j0, ln in pairs:
        m[i0:i0 + ln, j0:j0 + ln] += torch.eye(ln, dtype=dtype, device=device)
    return m.reshape(rows, *([1] * (nd - 1 - d)), cols)


def kept(n: int, pairs, d: int, nd: int, dtype, device):
    """The 0/1 vector (n) with ones at j0 .. j0 + length - 1 for each (j0, j0, length) in pairs,
    laid out along state dim d of nd dims: slices of the state that stay in place (a slot
    overwritten, the rest kept), an elementwise coefficient. A constant, like `placement`."""
    v = torch.zeros(n, dtype=dtype, device=device)
    for _, j0, ln in pairs:
        v[j0:j0 + ln] = 1
    return v.reshape(n, *([1] * (nd - 1 - d)))


def _slice_along(n, nd: int):
    """(x, d, start, stop) for ``x[..., start:stop, ...]`` (one unit-step slice of dim d, every
    other dim whole) or ``x.narrow(d, start, length)``; None otherwise."""
    if getattr(n.target, "__name__", n.target) == "narrow" and n.op in ("call_function", "call_method") \
            and len(n.args) == 4 and all(isinstance(a, int) for a in n.args[1:]):
        x, d, start, length = n.args
        size = shape(x)[d]
        start = start % size if isinstance(size, int) else None
        return (x, d % nd, start, start + length) if start is not None and length > 0 else None
    if n.op != "call_function" or n.target is not operator.getitem or not isinstance(n.args[1], (tuple, slice)):
        return None
    got = one_dim_index(n.args[1], nd, ints=False)
    if got is None or got[1].step not in (None, 1):
        return None
    d, size = got[0], shape(n.args[0])[got[0]]
    start, stop, _ = got[1].indices(size) if isinstance(size, int) else (None, None, None)
    return (n.args[0], d, start, stop) if start is not None and stop > start else None


class _Applied:
    """A slice of state-shaped value x (on the path) put through elementwise ops with state-free
    operands that are the same at every index of the moved dim (``h[..., 1:] * 0.5``): ops is
    [(op, operand, state first)], applied in order."""

    def __init__(self, x, ops):
        self.x, self.ops = x, ops


class _Unsqueezed:
    """A state-free value put into the state along dim d where it has no dim (``select_scatter``)."""

    def __init__(self, v, d):
        self.v, self.d = v, d


class _Mat:
    """A non-diagonal coefficient: diag(d) + m, with m a body node laid out (*state, j) (or
    broadcastable to it); d as an elementwise coefficient (None: zero)."""

    def __init__(self, d, m, dim=None, terms=None):
        self.d, self.m, self.dim = d, m, dim      # dim: the state dim m acts along (None: last)
        self.terms = terms      # m as a sum of products u w^T where known: [(u, w)], both laid out
                                # as the state (w's j along dim), for `_Linear.folded`


class _Red:
    """A state term summed over one state dim: node[..] = sum_j w[.., j, ..] * h[.., j, ..], j
    along `dim`; w is laid out as the state (broadcastable, all its dims); `keep`: the summed
    dim stays, with size 1. Broadcast back along that dim times a vector u, it is the rank-1
    matrix u w^T along `dim` (the delta rule's k (k^T S))."""

    def __init__(self, dim, w, keep):
        self.dim, self.w, self.keep = dim, w, keep


LINEAR_EW = ("add", "sub", "neg", "mul", "div", "addcmul", "where")   # the elementwise ops of `_Linear`'s
                                                                    # rules (the state in one operand)


class _Linear:
    """(a, b) with node == a * prev + b; None stands for zero. `a` is an elementwise
    coefficient, or a `_Mat` once the state went through a matrix product."""

    def __init__(self, builder, prev, path, sshape, apart=False):
        self.b, self.prev, self.path, self.sshape, self.apart = builder, prev, path, sshape, apart
        self.memo = {}
        self.stack = []

    def of(self, n):
        if n is self.prev:
            return 1.0, None
        if not isinstance(n, fx.Node) or n not in self.path:
            return None, n
        if n in self.memo:
            return self.memo[n]
        if (n.target is torch.zeros_like or n.target == "new_zeros" or n.target == "zero_") \
                and shape(n) == self.sshape:
            return None, None             # zeros made from the state (a reset): 0 * h + 0
        c = canonical(n)
        segs = self.segments(n) if c is None else None
        if c is None and segs is None:
            raise Decline(f"the state goes through {_describe(n)}, which ssmc does not know to be linear")
        self.stack.append(n)
        try:
            r = self._rule(n, c) if segs is None else self._placed(*segs)
        finally:
            self.stack.pop()
        want = self.red_shape(r[0]) if isinstance(r[0], _Red) else self.sshape
        if shape(n) != want and not self.rows_changed(r[0], shape(n)):
            raise Decline(f"{_describe(n)} changes the state's shape to {shape(n)}")
        self.memo[n] = r
        return r

    def rows_changed(self, a, s) -> bool:
        """Whether a value of shape s is the state mapped by a matrix to another number of rows
        along the dim the matrix acts on, nothing else changed (``H @ x`` of a Kalman filter, a
        feedback gain ``K @ x``): a transition with m rows, the state's n columns, which a later
        matrix product takes back to n rows (`compose`)."""
        nd = len(self.sshape)
        if not isinstance(a, _Mat) or a.d is not None or a.m is None or len(s) != nd:
            return False
        d = nd - 1 if a.dim is None else a.dim % nd
        return all(x == y for i, (x, y) in enumerate(zip(s, self.sshape)) if i != d)

    def red_shape(self, a: "_Red") -> tuple:
        s = list(self.sshape)
        if a.keep:
            s[a.dim] = 1
        else:
            del s[a.dim]
        return tuple(s)

    # small algebra on None (zero), python numbers and nodes -------------------------------
    def _mk(self, op, x, y):
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            return op(x, y)
        return self.b.call(self.stack[-1], op, (x, y))

    def mul(self, x, y):
        if x is None or y is None:
            return None
        if isinstance(x, (int, float)) and x == 1:
            return y
        if isinstance(y, (int, float)) and y == 1:
            return x
        return self._mk(operator.mul, x, y)

    def add(self, x, y):
        if x is None:
            return y
        if y is None:
            return x
        return self._mk(operator.add, x, y)

    def neg(self, x):
        if x is None:
            return None
        return -x if isinstance(x, (int, float)) else self.b.call(self.stack[-1], operator.neg, (x,))

    def div(self, x, y):
        if x is None:
            return None
        return self._mk(operator.truediv, x, y)

    # coefficients that may be matrices ---------------------------------------------------
    def _call(self, target, *args):
        try:
            return self.b.call(self.stack[-1], target, args)
        except Exception as e:     # shapes that do not combine: not a transition ssmc can write
            raise Decline(f"the transition through {_describe(self.stack[-1])} cannot be formed "
                          f"as a matrix: {type(e).__name__}: {e}") from None

    def scale(self, a, y):
        """a * y, y a state-free value broadcast over the state (scales rows of a matrix)."""
        if isinstance(a, _Red):
            return _Red(a.dim, self.mul(a.w, self.unreduce(a, y)), a.keep)
        if not isinstance(a, _Mat):
            return self.mul(a, y)
        yr = y if isinstance(y, (int, float)) else self._call(torch.unsqueeze, y, -1)
        terms = None if a.terms is None else [(self.mul(u, y), w) for u, w in a.terms]
        return _Mat(self.mul(a.d, y), self.mul(a.m, yr), a.dim, terms)

    def divide(self, a, y):
        if isinstance(a, _Red):
            return _Red(a.dim, self.div(a.w, self.unreduce(a, y)), a.keep)
        if not isinstance(a, _Mat):
            return self.div(a, y)
        yr = y if isinstance(y, (int, float)) else self._call(torch.unsqueeze, y, -1)
        terms = None if a.terms is None else [(self.div(u, y), w) for u, w in a.terms]
        return _Mat(self.div(a.d, y), self.div(a.m, yr), a.dim, terms)

    def plus(self, a1, a2):
        if isinstance(a1, _Red) or isinstance(a2, _Red):
            if a1 is None or a2 is None:
                return a1 if a2 is None else a2
            if isinstance(a1, _Red) and isinstance(a2, _Red) and (a1.dim, a1.keep) == (a2.dim, a2.keep):
                return _Red(a1.dim, self.add(a1.w, a2.w), a1.keep)
            a1, a2 = (self.as_mat(x) if isinstance(x, _Red) else x for x in (a1, a2))
        if not isinstance(a1, _Mat) and not isinstance(a2, _Mat):
            return self.add(a1, a2)
        a1, a2 = (x if isinstance(x, _Mat) else _Mat(x, None) for x in (a1, a2))
        dims = {x.dim for x in (a1, a2) if x.m is not None}
        if len(dims) > 1:
            raise Decline(f"{_describe(self.stack[-1])} adds transitions along two different dims of the state")
        terms = None if any(x.m is not None and x.terms is None for x in (a1, a2)) else \
            [*(a1.terms or []), *(a2.terms or [])]
        return _Mat(self.add(a1.d, a2.d), self.add(a1.m, a2.m), dims.pop() if dims else None, terms)

    def negate(self, a):
        if isinstance(a, _Red):
            return _Red(a.dim, self.neg(a.w), a.keep)
        if not isinstance(a, _Mat):
            return self.neg(a)
        terms = None if a.terms is None else [(self.neg(u), w) for u, w in a.terms]
        return _Mat(self.neg(a.d), self.neg(a.m), a.dim, terms)

    # sums over a state dim (`_Red`) --------------------------------------------------------
    def unreduce(self, a: _Red, y):
        """y, broadcast against a summed value, laid out as the state: a size-1 dim put back
        where the sum took one away (right-aligned broadcasting)."""
        if isinstance(y, (int, float)) or a.keep:
            return y
        nd, m = len(self.sshape), len(shape(y))
        pos = a.dim - (nd - 1 - m)
        return self._call(torch.unsqueeze, y, pos) if pos >= 0 else y

    def row(self, a: _Red):
        """w as the columns of a transition laid out (*state, j): w moved from its dim to a new
        last one, a size-1 dim left where it was."""
        w, nd, n = a.w, len(self.sshape), self.sshape[a.dim]
        if isinstance(w, (int, float)) or not isinstance(w, fx.Node):
            raise Decline(f"{_describe(self.stack[-1])} sums the state over a dim with no weight to "
                          "form a transition from")
        ws = shape(w)
        if len(ws) < nd:
            w = self._call(torch.reshape, w, (1,) * (nd - len(ws)) + tuple(ws))
        if shape(w)[a.dim] != n:
            full = list(shape(w))
            full[a.dim] = n
            w = self._call(torch.broadcast_to, w, tuple(full))
        return self._call(columns, w, a.dim)

    def as_mat(self, a: _Red) -> _Mat:
        """A kept-dim sum broadcast along its dim: the rank-1 transition 1 w^T."""
        if not a.keep:
            raise Decline(f"{_describe(self.stack[-1])} mixes a sum over a state dim with the state")
        return _Mat(None, self.row(a), a.dim, [(1.0, a.w)])

    def _summed(self, n, c, x):
        """A contraction that sums the state over one of its dims against a state-free operand
        and keeps the others in order (``einsum("bhk,bhkv->bhv", k, S)``, ``k[..., None, :] @ S``,
        its summed dim then kept with size 1): as `_reduce` of S times that operand. None when
        the contraction is not of that form (a matrix product along the last dim is
        `_contract`'s)."""
        if len(c.args) != 2:
            return None
        k = c.args.index(x)
        w, sx, sw, so = c.args[1 - k], c.params["subs"][k], c.params["subs"][1 - k], c.params["out"]
        nd = len(self.sshape)
        gone = [ch for ch in sx if ch not in so]
        if not isinstance(w, fx.Node) or w in self.path or len(sx) != nd or len(set(sx)) != nd or len(gone) != 1:
            return None
        d = sx.index(gone[0])
        rest = sx[:d] + sx[d + 1:]
        sizes = dict(zip(so, shape(n)))
        kept = [ch for ch in so if ch not in sx]
        if [ch for ch in so if ch in sx] != list(rest) or any(sizes[ch] != 1 for ch in kept) \
                or not set(sw) <= set(sx) | set(kept) or gone[0] not in sw:
            return None
        keep = len(kept) == 1 and so.index(kept[0]) == d
        if kept and not keep:
            return None
        present = "".join(ch for ch in sx if ch in sw)
        wt = self._call(torch.einsum, f"{sw}->{present}", w)     # w over the state's letters
        for pos, ch in enumerate(sx):
            if ch not in sw:
                wt = self._call(torch.unsqueeze, wt, pos)
        a1, b1 = self.of(x)
        if isinstance(a1, _Red):
            raise Decline(f"{_describe(n)} sums a sum of the state over a dim")
        if isinstance(a1, _Mat):
            a1 = self.folded(self.scale(a1, wt), d)
        else:
            a1 = self.mul(a1, wt)
        return (None if a1 is None else _Red(d, a1, keep)), self.sum_over(self.mul(b1, wt), d, keep)

    def folded(self, a: _Mat, d: int):
        """The weights w with sum_i (a h)[.., i, ..] = sum_j w[.., j, ..] h[.., j, ..], i and j
        along state dim d, a's matrix acting along d: its diagonal plus the matrix's column sums
        (w^T = 1^T (diag + M)), laid out as the state. A second update of the step reading the
        first one's result through a sum (DeltaProduct's k_2^T (S - beta_1 k_1 (k_1^T S)))."""
        nd = len(self.sshape)
        md = nd - 1 if a.dim is None else a.dim % nd
        if a.m is None:
            return a.d
        if md != d % nd:
            raise Decline(f"{_describe(self.stack[-1])} sums over dim {d % nd} a transition that acts "
                          f"along dim {md}")
        if a.terms is not None:       # sum_i u_i w_j = (sum_i u_i) w_j: no matrix formed
            cols = None
            for u, w in a.terms:
                su = self.sum_along(u, md)
                cols = self.add(cols, self.mul(su, w))
            return self.add(a.d, cols)
        if len(shape(a.m)) != nd + 1:
            raise Decline(f"{_describe(self.stack[-1])} sums a transition laid out as {shape(a.m)}")
        return self.add(a.d, self._call(column_sums, a.m, md))

    def _reduce(self, n, c):
        x = c.args[0]
        dims = c.params["dims"]
        if len(dims) != 1 or c.op not in ("sum", "mean"):
            raise Decline(f"{_describe(n)} sums the state over {len(dims)} dims")
        a1, b1 = self.of(x)
        if isinstance(a1, _Red):
            raise Decline(f"{_describe(n)} sums a sum of the state over a dim")
        d, keep = dims[0], c.params["keepdim"]
        if isinstance(a1, _Mat):
            a1 = self.folded(a1, d)
        if a1 is None:
            a = None
        else:
            w = a1 if c.op == "sum" else self.div(a1, self.sshape[d])
            a = _Red(d, w, keep)
        return a, self.sum_over(b1, d, keep, torch.sum if c.op == "sum" else torch.mean)

    def sum_along(self, u, d: int):
        """sum over state dim d of u broadcast to the state, its dim d kept with size 1; u is
        broadcast along d only (n * u where u has size 1 there), not over the other dims."""
        n, nd = self.sshape[d], len(self.sshape)
        if isinstance(u, (int, float)):
            return u * n
        us = shape(u)
        if len(us) < nd:
            u = self._call(torch.reshape, u, (1,) * (nd - len(us)) + tuple(us))
        return self.mul(u, n) if shape(u)[d] == 1 else self._call(torch.sum, u, d, True)

    def sum_over(self, b, d: int, keep: bool, fn=torch.sum):
        """A state-free value (None: zero) broadcast to the state's shape, summed (or averaged)
        over state dim d."""
        if b is None:
            return None
        full = b if shape(b) == self.sshape else self._call(torch.broadcast_to, b, self.sshape)
        return self._call(fn, full, d, keep)

    def _contract(self, n, c, x):
        """y = contraction of x (on the state's path) with one state-free operand along one
        state dim d: y[.., i, ..] = sum_k W'[.., i, .., k] x[.., k, ..], i and k at d (the last
        dim: ``h @ W.T``; another: ``A @ h`` for a column state h of shape (n, 1)). Returns (W'
        laid out (*state, k) as a body node, d)."""
        if len(c.args) != 2:
            raise Decline(f"{_describe(n)} contracts the state with {len(c.args) - 1} operands")
        k = c.args.index(x)
        w, sx, sw = c.args[1 - k], c.params["subs"][k], c.params["subs"][1 - k]
        so = c.params["out"]
        if not isinstance(w, fx.Node) or w in self.path or w is self.prev:
            raise Decline(f"{_describe(n)} multiplies the state by itself")
        nd = len(self.sshape)
        diff = [i for i in range(min(len(sx), len(so))) if sx[i] != so[i]]
        d = diff[0] if len(diff) == 1 else nd - 1
        if len(sx) != nd or len(so) != nd or len(diff) != 1 or len(set(sx)) != nd or len(set(so)) != nd \
                or len(set(sw)) != len(sw) or sx[d] not in sw or so[d] not in sw \
                or not set(sw) <= set(so) | {sx[d]} or sx[d] in so or so[d] in sx:
            raise Decline(f"{_describe(n)} is not a matrix product along one state dim "
                          f"({','.join(c.params['subs'])}->{so})")
        target = so + sx[d]
        present = "".join(ch for ch in target if ch in sw)
        wt = self._call(torch.einsum, f"{sw}->{present}", w)
        for pos, ch in enumerate(target):
            if ch not in sw:
                wt = self._call(torch.unsqueeze, wt, pos)
        return wt, d

    def _contract_along(self, n, d: int, wt, a1, b1):
        """A matrix product along state dim d, not the last (``A @ h`` for h of shape (n, 1)),
        of a state that went through elementwise ops only: the transition W' diag(a1) along d,
        the drive W' b1."""
        nd = len(self.sshape)
        if isinstance(a1, _Red) or isinstance(a1, _Mat) and (nd - 1 if a1.dim is None else a1.dim % nd) != d:
            raise Decline(f"{_describe(n)} multiplies the state by a matrix along dim {d} after another "
                          "transition along another dim")

        def along(v):            # v laid out as the state (broadcastable): its dim d as the columns
            vs = shape(v)
            if len(vs) < nd:
                v = self._call(torch.reshape, v, (1,) * (nd - len(vs)) + tuple(vs))
            return self._call(columns, v, d)
        d1, m1 = (a1.d, a1.m) if isinstance(a1, _Mat) else (a1, None)
        if d1 is None:
            m = None
        elif isinstance(d1, (int, float)) or not shape(d1):
            m = self.mul(wt, d1)
        else:
            m = self.mul(wt, along(d1))
        if m1 is not None:       # a second matrix product along d: W' composed with it
            m = self.add(m, self._call(compose_along, wt, m1, d - nd - 1))
        if b1 is None:
            bm = None
        elif isinstance(b1, (int, float)) or not shape(b1):       # the same in every element
            bm = self.mul(self._call(torch.sum, wt, -1), b1)
        else:
            bm = self._call(torch.sum, self.mul(wt, along(b1)), -1)
        return (_Mat(None, m, d) if m is not None else None), bm

    # slices of the state moved along one dim (cat, roll, pad: a shift register) -------------
    def segments(self, n):
        """(d, [(out_start, length, source, src_start)]) where n (state-shaped, on the path) is
        made of slices of state-shaped values along dim d (source on the path) and state-free
        pieces (src_start None) and zeros (source None), in order; None when it is not. A source
        that is itself such a move along d (``torch.roll`` then ``torch.cat``) is looked through."""
        got = self._segments(n)
        if got is None:
            return None
        d, segs = got
        out = []
        for pos, ln, src, s0 in segs:
            inner = self._segments(src) if isinstance(src, fx.Node) and s0 is not None and src is not self.prev \
                else None
            if inner is None or inner[0] != d:
                out.append((pos, ln, src, s0))
                continue
            for ip, il, isrc, is0 in inner[1]:          # the part of src's pieces in [s0, s0 + ln)
                lo, hi = max(ip, s0), min(ip + il, s0 + ln)
                if lo < hi:
                    out.append((pos + lo - s0, hi - lo, isrc, None if is0 is None and isrc is not None
                                else (is0 + lo - ip if is0 is not None else None)))
        if any(src is not None and s0 is None and not isinstance(src, _Unsqueezed) and ln != shape(src)[d]
               for pos, ln, src, s0 in out):
            return None                 # part of a state-free piece: not taken apart here
        return d, out

    def _segments(self, n):
        nd = len(self.sshape)
        if n.op != "call_function" or shape(n) != self.sshape:
            return None
        name = getattr(n.target, "__name__", "")
        if n.target in (torch.cat, torch.concat) or name in ("cat", "concat"):
            parts = n.args[0] if n.args else n.kwargs.get("tensors")
            d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if not isinstance(parts, (list, tuple)) or not isinstance(d, int):
                return None
            d %= nd
            out, pos = [], 0
            for p in parts:
                got = self._piece(p, d, nd)
                if got is None:
                    return None
                for ln, src, s0 in got:
                    out.append((pos, ln, src, s0))
                    pos += ln
            return (d, out) if pos == self.sshape[d] else None
        if name in ("select_scatter", "slice_scatter") and len(n.args) >= 3:
            x, v = n.args[0], n.args[1]       # x with a slice along d replaced by v
            d = n.args[2] % nd
            N = self.sshape[d]
            if name == "select_scatter":
                k = n.args[3] % N
                lo, hi = k, k + 1
                if not isinstance(v, fx.Node) or v in self.path or v is self.prev:
                    return None
                piece = [(1, _Unsqueezed(v, d), None)]
            else:
                lo, hi = (n.args[3] if len(n.args) > 3 else 0), (n.args[4] if len(n.args) > 4 else N)
                if not isinstance(lo, int) or not isinstance(hi, int):
                    return None
                lo, hi, _ = slice(lo, hi).indices(N)
                piece = self._piece(v, d, nd)
                if piece is None or sum(p[0] for p in piece) != hi - lo:
                    return None
            if x not in self.path and x is not self.prev:
                return None
            out = ([(0, lo, x, 0)] if lo else []) + [(lo + sum(q[0] for q in piece[:j]), ln, src, s0)
                                                     for j, (ln, src, s0) in enumerate(piece)]
            return d, out + ([(hi, N - hi, x, hi)] if hi < N else [])
        if name == "roll" and n.args:
            x = n.args[0]
            sh = n.args[1] if len(n.args) > 1 else n.kwargs.get("shifts")
            d = n.args[2] if len(n.args) > 2 else n.kwargs.get("dims")
            sh, d = (sh[0] if isinstance(sh, (list, tuple)) and len(sh) == 1 else sh,
                     d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d)
            if not isinstance(sh, int) or not isinstance(d, int) or x not in self.path and x is not self.prev:
                return None
            d %= nd
            N, k = self.sshape[d], sh % self.sshape[d]
            return d, [(0, k, x, N - k), (k, N - k, x, 0)] if k else [(0, N, x, 0)]
        if name == "pad":
            got = self._piece(n, None, nd)
            if got is None:
                return None
            d, segs = got
            out, pos = [], 0
            for ln, src, s0 in segs:
                out.append((pos, ln, src, s0))
                pos += ln
            return d, [s for s in out if s[0] < self.sshape[d]]
        return None

    def _piece(self, p, d, nd):
        """[(length, source, src_start)] of one piece along d (None: unknown; d None: a pad
        finds it, then returns (d, pieces))."""
        sl = _slice_along(p, nd) if isinstance(p, fx.Node) else None
        if getattr(p, "op", None) == "call_function" and getattr(p.target, "__name__", "") == "pad" \
                and p in self.path:
            x, pad = p.args[0], p.args[1] if len(p.args) > 1 else p.kwargs.get("pad")
            mode = p.args[2] if len(p.args) > 2 else p.kwargs.get("mode", "constant")
            value = p.args[3] if len(p.args) > 3 else p.kwargs.get("value", None)
            pad = list(pad) if isinstance(pad, (list, tuple)) else None
            if mode != "constant" or value not in (None, 0, 0.0) or not pad or len(pad) % 2 \
                    or not all(isinstance(v, int) and v >= 0 for v in pad):
                return None
            dims = [nd - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]]
            if len(dims) != 1 or (d is not None and dims[0] != d):
                return None
            k = nd - 1 - dims[0]
            inner = self._piece(x, dims[0], nd)
            if inner is None:
                return None
            lo, hi = pad[2 * k], pad[2 * k + 1]
            got = [(lo, None, None)] * bool(lo) + inner + [(hi, None, None)] * bool(hi)
            return got if d is not None else (dims[0], got)
        if d is None:
            return None
        if isinstance(p, fx.Node) and p in self.path and len(shape(p)) == nd and isinstance(shape(p)[d], int) \
                and (p.target in (torch.zeros_like,) or p.target in ("new_zeros", "zero_")):
            return [(shape(p)[d], None, None)]        # zeros shaped like a slice of the state
        c = canonical(p) if isinstance(p, fx.Node) and p in self.path and shape(p) != self.sshape else None
        if c is not None and c.kind == "ew" and c.op in ("mul", "div", "add", "sub", "neg") \
                and c.params.get("alpha", 1) == 1:
            on = [k for k, a in enumerate(c.args) if isinstance(a, fx.Node) and (a in self.path or a is self.prev)]
            rest = [a for k, a in enumerate(c.args) if k not in on]
            flat = all(isinstance(a, (int, float)) or (isinstance(a, fx.Node) and (len(shape(a)) < nd - d
                       or shape(a)[d - nd] == 1)) for a in rest)
            inner = self._piece(c.args[on[0]], d, nd) if len(on) == 1 and flat and (c.op != "div" or on[0] == 0) \
                else None
            if inner is None or len(inner) != 1 or inner[0][1] is None or inner[0][2] is None:
                return None
            ln, src, s0 = inner[0]
            x, ops = (src.x, list(src.ops)) if isinstance(src, _Applied) else (src, [])
            return [(ln, _Applied(x, ops + [(c.op, rest[0] if rest else None, on[0] == 0)]), s0)]
        if sl is not None and (sl[0] in self.path or sl[0] is self.prev) and sl[1] == d \
                and shape(sl[0]) == self.sshape:
            return [(sl[3] - sl[2], sl[0], sl[2])]
        if isinstance(p, fx.Node) and (p in self.path or p is self.prev):
            return [(self.sshape[d], p, 0)] if shape(p) == self.sshape else None
        if isinstance(p, fx.Node) and len(shape(p)) == nd and isinstance(shape(p)[d], int):
            return [(shape(p)[d], p, None)]          # state-free
        return None

    def _placed(self, d, segs):
        """The state-shaped value made of the segments: each source's slices as a constant
        0/1 matrix along d times that source's (a, b), state-free pieces placed into the drive."""
        nd, N = len(self.sshape), self.sshape[d]
        ev = self.prev.meta.get("example_value")
        like = dict(dtype=getattr(ev, "dtype", torch.float32), device=getattr(ev, "device", "cpu"))
        srcs: dict = {}
        a, b = None, None
        for pos, ln, src, s0 in segs:
            if src is None:
                continue
            if s0 is None:           # a state-free piece: placed by a (N x ln) matrix
                if isinstance(src, _Unsqueezed):
                    src = self._call(torch.unsqueeze, src.v, src.d)
                q = self._call(placement, N, ln, ((pos, 0, ln),), d, nd, like["dtype"], like["device"])
                b = self.add(b, self._apply(q, d, src))
                continue
            srcs.setdefault(src, []).append((pos, s0, ln))
        for src, pairs in srcs.items():
            a1, b1 = self.of(src.x if isinstance(src, _Applied) else src)
            for op, y, first in (src.ops if isinstance(src, _Applied) else ()):
                if op == "mul":
                    a1, b1 = self.scale(a1, y), self.mul(b1, y)
                elif op == "div":
                    a1, b1 = self.divide(a1, y), self.div(b1, y)
                elif op == "neg":
                    a1, b1 = self.negate(a1), self.neg(b1)
                elif op == "add" or first:
                    b1 = self.add(b1, y if op == "add" else self.neg(y))
                else:                                  # y - x
                    a1, b1 = self.negate(a1), self.add(self.neg(b1), y)
            if isinstance(a1, (_Mat, _Red)):
                raise Decline(f"{_describe(self.stack[-1])} moves slices of a state that went through a "
                              "matrix product or a sum")
            if all(i0 == j0 for i0, j0, _ in pairs):       # nothing moves: a diagonal 0/1 factor
                v = self._call(kept, N, tuple(pairs), d, nd, like["dtype"], like["device"])
                a, b = self.plus(a, self.mul(a1, v)), self.add(b, self.mul(b1, v))
                continue
            p = self._call(placement, N, N, tuple(pairs), d, nd, like["dtype"], like["device"])
            if a1 is not None:
                m = self.mul(p, a1 if isinstance(a1, (int, float)) or not shape(a1) else self._cols(a1, d))
                a = self.plus(a, _Mat(None, m, d))
            if b1 is not None:
                b = self.add(b, self._apply(p, d, b1))
        return a, b

    def _cols(self, v, d: int):
        """v laid out as the state (broadcastable), its dim d as the columns of a (*state, j) matrix."""
        nd, vs = len(self.sshape), shape(v)
        if len(vs) < nd:
            v = self._call(torch.reshape, v, (1,) * (nd - len(vs)) + tuple(vs))
        return self._call(columns, v, d)

    def _apply(self, w, d: int, v):
        """sum_k w[.., i, .., k] v[.., k, ..]: a (*state, k) matrix along dim d applied to v."""
        if isinstance(v, (int, float)) or not shape(v):
            return self.mul(self._call(torch.sum, w, -1), v)
        return self._call(torch.sum, self.mul(w, self._cols(v, d)), -1)

    def _rule(self, n, c):
        args = c.args
        state = [a for a in args if isinstance(a, fx.Node) and (a in self.path or a is self.prev)]
        if c.kind == "reduce":
            return self._reduce(n, c)
        if c.kind == "view" and not c.params["consts"] and shape(args[0]) != shape(n):
            a1, b1 = self.of(args[0])          # a sum given its dim back (x.unsqueeze(d), x[..., None, :])
            if isinstance(a1, _Red):           # or its kept dim dropped (matmul's (1, n) row squeezed)
                keep = shape(n) == self.red_shape(_Red(a1.dim, None, True))
                if keep != a1.keep and shape(n) == self.red_shape(_Red(a1.dim, None, keep)):
                    b = None if b1 is None else self._call(torch.reshape, b1, shape(n))
                    return _Red(a1.dim, a1.w, keep), b
            raise Decline(f"the state goes through the view {_describe(n)}")
        if c.kind in ("identity", "view") or (c.kind == "ew" and c.op == "cast"):
            if c.kind == "view" and (c.params["consts"] or shape(args[0]) != shape(n)):
                raise Decline(f"the state goes through the view {_describe(n)}")
            if c.kind == "ew" and not c.params["dtype"].is_floating_point:
                raise Decline(f"the state is cast to {c.params['dtype']} by {_describe(n)}")
            return self.of(args[0])
        if c.kind == "contract" and len(state) == 1 and list(c.args).count(state[0]) == 1:
            red = self._summed(n, c, state[0])
            if red is not None:
                return red
            wt, d = self._contract(n, c, state[0])
            a1, b1 = self.of(state[0])
            if d != len(self.sshape) - 1:
                return self._contract_along(n, d, wt, a1, b1)
            if isinstance(a1, _Red) or (isinstance(a1, _Mat) and a1.dim not in (None, len(self.sshape) - 1)):
                raise Decline(f"{_describe(n)} multiplies a transition along another dim by a matrix")
            d1, m1 = (a1.d, a1.m) if isinstance(a1, _Mat) else (a1, None)
            if d1 is None:
                m = None
            elif isinstance(d1, (int, float)) or not shape(d1):
                m = self.mul(wt, d1)
            else:      # scale the columns: W'[.., i, k] * d1[.., k]
                m = self.mul(wt, self._call(torch.unsqueeze, d1, -2))
            if m1 is not None:     # a second matrix product in the step: W' composed with it
                m = self.add(m, self._call(compose, wt, m1))
            if b1 is None:
                bm = None
            elif self.apart:
                bm = self._call(apply_matrix, wt, b1)
            else:
                bm = self._call(torch.squeeze, self._call(torch.matmul, wt, self._call(torch.unsqueeze, b1, -1)), -1)
            return (_Mat(None, m, len(self.sshape) - 1) if m is not None else None), bm
        if c.kind != "ew":
            raise Decline(f"the state goes through {_describe(n)} ({c.kind}), which is not elementwise-linear")
        alpha = c.params.get("alpha", 1)
        if c.op in ("add", "sub"):
            (a1, b1), (a2, b2) = self.of(args[0]), self.of(args[1])
            if alpha != 1:
                a2, b2 = self.scale(a2, alpha), self.mul(b2, alpha)
            if c.op == "sub":
                a2, b2 = self.negate(a2), self.neg(b2)
            return self.plus(a1, a2), self.add(b1, b2)
        if c.op == "neg":
            a1, b1 = self.of(args[0])
            return self.negate(a1), self.neg(b1)
        if c.op == "mul":
            if len(state) == 2 or (len(state) == 1 and args[0] is args[1]):
                raise Decline(f"{_describe(n)} multiplies the state by itself")
            x, y = (args[0], args[1]) if args[0] in state else (args[1], args[0])
            a1, b1 = self.of(x)
            if isinstance(a1, _Red) and shape(n) != shape(x):
                if not a1.keep or shape(n) != self.sshape or isinstance(y, (int, float)):
                    raise Decline(f"{_describe(n)} broadcasts a sum of the state into another shape")
                # u * (sum_j w_j h_j) along the kept dim: the rank-1 transition u w^T
                m = self.mul(self._call(torch.unsqueeze, y, -1), self.row(a1))
                return _Mat(None, m, a1.dim, [(y, a1.w)]), self.mul(b1, y)
            return self.scale(a1, y), self.mul(b1, y)
        if c.op == "div":
            if args[1] in state:
                raise Decline(f"{_describe(n)} divides by the state")
            a1, b1 = self.of(args[0])
            return self.divide(a1, args[1]), self.div(b1, args[1])
        if c.op == "addcmul":
            x, t1, t2 = args
            if t1 in state and t2 in state:
                raise Decline(f"{_describe(n)} multiplies the state by itself")
            ax, bx = self.of(x)
            s, f = (t1, t2) if t1 in state else (t2, t1)
            a1, b1 = self.of(s)
            f = self.mul(f, c.params["value"])
            return self.plus(ax, self.scale(a1, f)), self.add(bx, self.mul(b1, f))
        if c.op == "where":      # where(m, a1 h + b1, a2 h + b2): a padding mask, a reset
            cond, x, y = args
            if cond in state:
                raise Decline(f"{_describe(n)} selects by a condition computed from the state")
            (a1, b1), (a2, b2) = self.of(x), self.of(y)
            if isinstance(a1, (_Mat, _Red)) or isinstance(a2, (_Mat, _Red)):
                raise Decline(f"{_describe(n)} selects between matrix transitions")
            return self.select(cond, a1, a2), self.select(cond, b1, b2)
        raise Decline(f"the state goes through {_describe(n)}, which is not linear")

    def select(self, cond, x, y):
        """where(cond, x, y) of two coefficients (None: zero)."""
        if x is None and y is None:
            return None
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x == y:
            return x
        return self.b.call(self.stack[-1], torch.where, (cond, 0.0 if x is None else x, 0.0 if y is None else y))
