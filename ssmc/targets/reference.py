"""The ``torch`` target: the region IR executed with torch ops. Runs anywhere; the oracle.

Forward: time in chunks; in each chunk decay and drive are evaluated as broadcast tensors
(time, *state axes) and the linear recurrence is solved by `chunk_scan`, a two-level parallel
scan (only products of decays, no division by cumulative products, so decays near 0 underflow
to exact zeros and decays near 1 lose nothing); the carry passes between chunks. Outputs are
evaluated per chunk, so no (L, *state) tensor exists beyond one chunk.
Backward: the adjoint recurrence (ssmc.autodiff). Regions with a non-diagonal transition
(`Region.mix`) run their steps sequentially in each chunk, h = a*h + M h + b; their backward
is `ssmc.targets.mix_adjoint` (its scans run by this module's `run`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ssmc import ir
from ssmc.ir import Const, Load, Op, Reduce, Region, State

from . import mul_sum

_UNARY = {
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
    "log": torch.log, "log1p": torch.log1p, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "logsigmoid": F.logsigmoid, "silu": F.silu,
    "relu": torch.relu, "abs": torch.abs, "reciprocal": torch.reciprocal, "sin": torch.sin,
    "cos": torch.cos,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "maximum": torch.maximum, "minimum": torch.minimum, "gt": torch.gt, "lt": torch.lt,
    "ge": torch.ge, "le": torch.le, "eq": torch.eq, "ne": torch.ne,
}


class TorchTarget:
    name = "torch"
    version = "1"

    def supports(self, region: Region, strategy: str, arch, device_type: str):
        return True

    def compile(self, region: Region, strategy: str, options):
        if strategy in ("chunked_ssd", "chunked_scan"):     # the SSD's matmul form where it has a plan
            from .ssd_autograd import TorchSSDKernel
            kernel = TorchSSDKernel.make(region, options.chunk)
            if kernel is not None:
                return kernel
        return ReferenceKernel(region, options.chunk)

    def source(self, kernel) -> str | None:
        return None


CHUNK_ELEMENTS = 1 << 22


def time_chunk(chunk: int, state_elements: int, L: int) -> int:
    """The executor's steps per chunk: `chunk` when given (> 0); else (0) as many as keep one
    (steps, *state) tensor near CHUNK_ELEMENTS, at least 64: a small state runs in few chunks
    (each chunk costs some fifty torch calls), a large one in chunks of bounded memory."""
    if chunk > 0:
        return chunk
    return max(64, min(max(L, 1), CHUNK_ELEMENTS // max(1, state_elements)))


class ReferenceKernel:
    def __init__(self, region: Region, chunk: int = 0):
        self.region, self.chunk = region, max(0, int(chunk))

    def forward(self, inputs):
        with torch.no_grad():
            return run(self.region, inputs, self.chunk)

    def backward(self, inputs, grads, needs):
        return adjoint_run(self.region, inputs, grads, needs, self.chunk)

    def backward_autograd(self, inputs, grads, needs):
        """The same gradients by re-running the forward under autograd (a cross-check)."""
        return grads_by_autograd(lambda xs: run(self.region, xs, self.chunk), inputs, grads, needs)


def grads_by_autograd(forward, inputs, grads, needs) -> list:
    """Every input's gradient (None where not needed) by re-running ``forward(inputs) ->
    outputs`` under autograd, inside the custom op's backward."""
    xs = [x.detach().requires_grad_(bool(n) and x.is_floating_point()) for x, n in zip(inputs, needs)]
    with autograd_inside_op(), torch.enable_grad():
        outs = forward(xs)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and g.numel() and o.requires_grad]
    wrt = [x for x in xs if x.requires_grad]
    got = [None] * len(wrt)
    if pairs and wrt:
        with autograd_inside_op():
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g.to(o.dtype) for o, g in pairs],
                                      allow_unused=True)
    it = iter(got)
    res = []
    for x, xx in zip(inputs, xs):
        if xx.requires_grad:
            g = next(it)
            res.append(torch.zeros_like(x) if g is None else g.to(x.dtype))
        else:
            res.append(None)
    return res


def autograd_inside_op():
    """Custom-op kernels run below the autograd dispatch key; the reference backward re-runs
    the forward under autograd, so it switches autograd dispatch back on locally."""
    ex = torch._C._dispatch_tls_local_exclude_set()
    for k in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        key = getattr(torch._C.DispatchKey, k, None)
        if key is not None:
            ex = ex.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), ex)


def compute_dtype(region: Region, inputs) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in inputs) else torch.float32


class Product(tuple):
    """A value in `Evaluator.memo` kept as its factors (tensors): `Evaluator.factor_values`
    hands them to `contract` as they are (a gradient sum over them writes nothing of their
    full size); `Evaluator.eval` multiplies them where an expression needs the value itself."""


class Evaluator:
    """Evaluates expressions over [t0, t1) as tensors laid out (time, *state axes)."""

    def __init__(self, region: Region, inputs, t0: int, t1: int, cdt, matrix: bool = False):
        self.r, self.inputs, self.t0, self.t1, self.cdt = region, inputs, t0, t1, cdt
        self.sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(region.axes, region.axis_size)}
        self.names = ["t", *region.axes]
        if matrix:      # the transition's matrix: one more axis, its column
            self.names.append(ir.MIX_COL)
            self.sizes[ir.MIX_COL] = self.sizes[region.axes[-1]]
        self.memo = {}
        self.state = None

    def load(self, ld: Load) -> torch.Tensor:
        v = self.inputs[ld.input]
        consts = [(d, ix) for d, ix in enumerate(ld.index) if isinstance(ix, int)]
        for d, ix in sorted(consts, reverse=True):
            v = v.select(d, ix)
        names = [ix for ix in ld.index if not isinstance(ix, int)]
        if len(set(names)) != len(names):
            raise NotImplementedError(f"load {ld} indexes one axis twice")
        v = self._steps(v, names)
        order = sorted(range(len(names)), key=lambda i: self.names.index(names[i]))
        v = v.permute(order)
        present = [names[i] for i in order]
        v = _unsqueeze_to(v, present, self.names)
        return v.to(self.cdt) if v.is_floating_point() else v

    def _steps(self, v: torch.Tensor, names: list) -> torch.Tensor:
        """v restricted to the steps [t0, t1): v itself when that is all of them (a narrow's
        backward would zero-fill and copy a gradient of v's size)."""
        if "t" not in names:
            return v
        d = names.index("t")
        if self.t0 == 0 and self.t1 == v.shape[d]:
            return v
        return v.narrow(d, self.t0, self.t1 - self.t0)

    def view_of(self, x: torch.Tensor, ld: Load) -> torch.Tensor:
        """The same view `load` takes, of another tensor laid out like input ld.input."""
        v = x
        for d, ix in sorted(((d, ix) for d, ix in enumerate(ld.index) if isinstance(ix, int)), reverse=True):
            v = v.select(d, ix)
        names = [ix for ix in ld.index if not isinstance(ix, int)]
        v = self._steps(v, names)
        order = sorted(range(len(names)), key=lambda i: self.names.index(names[i]))
        return _unsqueeze_to(v.permute(order), [names[i] for i in order], self.names)

    def accumulate(self, grad: torch.Tensor, ld: Load, value):
        """grad[ld's elements] += value, summed over the axes the load does not vary along. A
        list of values is their product, summed by one einsum (`contract`): the full-size
        product is never formed."""
        view = self.view_of(grad, ld)
        if isinstance(value, list):
            value = contract(value, view.shape)
        dims = [d for d, (vs, xs) in enumerate(zip(view.shape, value.shape)) if vs == 1 and xs != 1]
        if dims:
            value = value.sum(dim=dims, keepdim=True)
        view.add_(value.expand(view.shape).to(view.dtype))

    def factor_values(self, e) -> list:
        """The values of the factors of a product (`ir.factors`), or [value of e]; a `Product`
        in the memo as its own factors."""
        out = []
        for f in ir.factors(e):
            v = self.memo.get(f)
            out.extend(v) if isinstance(v, Product) else out.append(self.eval(f))
        return out

    def eval_into(self, e, out: torch.Tensor) -> torch.Tensor:
        """e's value (broadcast to `out`'s shape) written into `out`: by its last op itself where
        that is an arithmetic op of two values of out's dtype that broadcast to out's shape (no
        intermediate of out's size), else copied."""
        if isinstance(e, Op) and e.name in ("add", "sub", "mul", "div") and e not in self.memo:
            args = [self.eval(a) for a in e.args]
            if (all(a.dtype == out.dtype for a in args)
                    and tuple(torch.broadcast_shapes(*(a.shape for a in args))) == tuple(out.shape)):
                return _BINARY[e.name](*args, out=out)
        return out.copy_(self.eval(e))

    def eval(self, e) -> torch.Tensor:
        if e in self.memo:
            v = self.memo[e]
            if isinstance(v, Product):
                v = self.memo[e] = functools.reduce(torch.mul, v)
            return v
        if isinstance(e, Load):
            v = self.load(e)
        elif isinstance(e, Const):
            v = torch.full([1] * len(self.names), e.value, dtype=self.cdt, device=self.inputs[0].device)
        elif isinstance(e, State):
            v = self.state
        elif isinstance(e, Reduce):
            dims = [self.names.index(a) for a in e.axes]
            v = self.eval(e.arg)
            # a value constant along a reduced axis still sums over all of that axis
            full = [self.sizes[self.names[d]] if d in dims else s for d, s in enumerate(v.shape)]
            v = v.expand(full).sum(dim=dims, keepdim=True)
        elif isinstance(e, Op):
            args = [self.eval(a) for a in e.args]
            v = _op(e, args, self.cdt)
        else:
            raise TypeError(f"unknown expression {e!r}")
        self.memo[e] = v
        return v


def contract(values: list, shape) -> torch.Tensor:
    """The product of broadcastable tensors (one rank, size 1 where constant) summed over every
    dim where `shape` is 1; a dim only some values vary along is not broadcast out. The result
    has size 1 where no value varies.

    The largest value is taken last: the others are contracted first by torch.einsum (a matrix
    product where one of them is a matrix), then multiplied into it. Where both sides of that
    last product vary along the same dims, it is an elementwise product and a sum: as an einsum
    it would be a batched dot product, which cuBLAS runs as one small launch per 65535 dots (32
    launches for 2^21 rows of 64, at a tenth of the memory bandwidth, in the block-sparse
    backward's gradient of dt). Where that last product is summed over one dim and `mul_sum`
    can run it (CUDA tensors), one Triton kernel multiplies and sums, reading each side once."""
    nd = len(shape)
    full = [max(v.shape[d] for v in values) for d in range(nd)]
    dtype = functools.reduce(torch.promote_types, [v.dtype for v in values])
    values = [v.to(dtype) for v in values]
    keep = {d for d in range(nd) if shape[d] != 1 and full[d] != 1}
    values = _paired_sums(values, keep)
    if len(values) == 1:
        dims = [d for d in range(nd) if d not in keep and values[0].shape[d] != 1]
        return values[0].sum(dim=dims, keepdim=True) if dims else values[0]
    if len(values) > 2:
        big = max(range(len(values)), key=lambda i: values[i].numel())
        rest = sorted(values[:big] + values[big + 1:], key=lambda v: v.numel())   # small ones first
        along = {d for d in range(nd) if values[big].shape[d] != 1} | keep
        values = [values[big], _einsum(rest, along)]
    if len(values) == 2:
        a, b = values
        both = [max(x, y) for x, y in zip(a.shape, b.shape)]
        summed = [d for d in range(nd) if d not in keep and both[d] != 1]
        if len(summed) == 1 and mul_sum.usable(a, b):      # one pass over each, on the GPU
            return mul_sum.mul_sum(a, b, summed[0])
        if a.shape == b.shape:
            prod = a * b
            dims = [d for d in range(nd) if d not in keep and prod.shape[d] != 1]
            return prod.sum(dim=dims, keepdim=True) if dims else prod
    return _einsum(values, keep)


def _paired_sums(values: list, keep) -> list:
    """Where `mul_sum` runs them (CUDA tensors): the largest value times one other, summed over
    the dims that no third value varies along, by one pass over each (`mul_sum.mul_sum_dims`),
    again until no pair is left. What this takes first is the largest sum, so a product such as
    sum_ij lam_ij v_i k_j becomes sum_i v_i (sum_j lam_ij k_j): no (i, j) outer product of the
    small values is formed, and nothing of the large one's size is written."""
    values = list(values)
    nd = values[0].dim()
    while len(values) > 1:
        big = max(range(len(values)), key=lambda i: values[i].numel())
        tries = []
        for i in range(len(values)):
            if i == big:
                continue
            rest = [v for j, v in enumerate(values) if j not in (i, big)]
            dims = [d for d in range(nd) if d not in keep and values[big].shape[d] != 1
                    and all(v.shape[d] == 1 for v in rest)]
            for run in _runs(dims):
                tries.append((math.prod(values[big].shape[d] for d in run), i, run))
        got = None
        for _, i, run in sorted(tries, key=lambda x: -x[0]):
            got = mul_sum.mul_sum_dims(values[big], values[i], run)
            if got is not None:
                values = [got] + [v for j, v in enumerate(values) if j not in (i, big)]
                break
        if got is None:
            break
    return values


def _runs(dims: list) -> list:
    """The runs of consecutive dims in the sorted list `dims`."""
    runs = []
    for d in dims:
        if runs and runs[-1][-1] == d - 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def _einsum(values: list, keep) -> torch.Tensor:
    """The product of broadcastable tensors summed over every dim not in `keep`, by one einsum;
    size 1 where no value varies or the dim is summed."""
    nd = values[0].dim()
    full = [max(v.shape[d] for v in values) for d in range(nd)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    ops, subs = [], []
    for v in values:
        ones = tuple(d for d in range(nd) if v.shape[d] == 1)
        ops.append(v.squeeze(ones) if ones else v)
        subs.append("".join(letters[d] for d in range(nd) if d not in ones))
    out_dims = [d for d in range(nd) if d in keep and full[d] != 1]
    out = torch.einsum(",".join(subs) + "->" + "".join(letters[d] for d in out_dims), *ops)
    return out.reshape([full[d] if d in out_dims else 1 for d in range(nd)])


def _unsqueeze_to(v, present, names):
    for i, n in enumerate(names):
        if n not in present:
            v = v.unsqueeze(i)
    return v


def _op(e: Op, args, cdt):
    n = e.name
    if n in _UNARY:
        return _UNARY[n](args[0])
    if n in _BINARY:
        return _BINARY[n](*args)
    if n == "where":
        return torch.where(args[0], args[1], args[2])
    if n == "softplus":
        return F.softplus(args[0], beta=e.attr("beta", 1.0), threshold=e.attr("threshold", 20.0))
    if n == "cast":
        dt = ir.to_dtype(e.attr("dtype"))
        return args[0].to(cdt if dt.is_floating_point else dt)
    raise NotImplementedError(f"torch target: op {n}")


def chunk_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, steps: int = 1) -> torch.Tensor:
    """All h_t = a_t h_{t-1} + b_t for one chunk (time at dim 0), from h_{-1} = h0.

    Two-level parallel scan: the chunk is cut into m blocks of s steps; all blocks run their s
    steps at once from a zero state, keeping the running product of decays; a short sequential
    pass carries the state from block to block; a last elementwise pass adds each block's carry
    times its running product. Work O(T), depth O(s + m); only products of decays, never a
    division, so decays near 0 and near 1 are as exact as in the plain loop."""
    T = max(a.shape[0], b.shape[0], steps)      # steps: a and b may be constant in time
    full = torch.broadcast_shapes(a.shape, b.shape, (1, *h0.shape))
    a = a.expand(T, *a.shape[1:])
    b = b.expand(T, *full[1:])
    s = max(1, int(math.isqrt(T)))
    m = -(-T // s)
    pad = m * s - T
    if pad:
        a = torch.cat([a, a.new_ones((pad, *a.shape[1:]))])
        b = torch.cat([b, b.new_zeros((pad, *b.shape[1:]))])
    a = a.reshape(m, s, *a.shape[1:])
    b = b.reshape(m, s, *b.shape[1:])
    P, Q = [a[:, 0]], [b[:, 0]]                # running decay product and zero-start state
    for j in range(1, s):
        P.append(a[:, j] * P[-1])
        Q.append(torch.addcmul(b[:, j], a[:, j], Q[-1]))
    P, Q = torch.stack(P, 1), torch.stack(Q, 1)  # (m, s, ...)
    carry = [h0]
    for i in range(m - 1):
        carry.append(torch.addcmul(Q[i, -1], P[i, -1], carry[-1]))
    C = torch.stack(carry).unsqueeze(1)          # (m, 1, *state)
    H = torch.addcmul(Q, P, C)
    return H.reshape(m * s, *H.shape[2:])[:T]


MIX_CHUNK_ELEMENTS = 1 << 24
RANK_CHUNK_ELEMENTS = 1 << 20    # a rank-one region's chunk (the executor steps it in Python anyway; 32
                                 # steps instead of 128 for fla's DeltaProduct at B2 T128 H4 K=V=64 on a
                                 # 2-core CPU: forward 41-46 ms against 79-81, benchmarks/NOTES.md)


def mix_scan(a, M, b, h0, steps: int = 1):
    """h_t = a_t * h_{t-1} + M_t h_{t-1} + b_t step by step (time at dim 0; M_t laid out
    (*state, j), multiplying along the state's last dim)."""
    T = max(a.shape[0], b.shape[0], M.shape[0], steps)
    a = a.expand(T, *h0.shape)
    b = b.expand(T, *h0.shape)
    M = M.expand(T, *h0.shape, h0.shape[-1])
    hs, h = [], h0
    for t in range(T):
        h = a[t] * h + (M[t] @ h.unsqueeze(-1)).squeeze(-1) + b[t]
        hs.append(h)
    return torch.stack(hs)


def rank_one(mix_expr, row_axis: str):
    """(u, w) when the transition is one product u * w with u free of the column axis and w
    free of the rows' (the delta rule's k_i * (-beta k)_j, however its factors are grouped or
    negated): M h is then u (w . h), a dot product a row instead of a matrix product. None
    otherwise (a factor along both axes, a sum, the state inside). A sum of inputs in a factor
    (Longhorn's beta / (1 + beta k . k)) is a factor like any other."""
    if any(isinstance(x, State) for x in ir.walk(mix_expr)):
        return None
    us, ws = [], []
    for f in ir.factors(mix_expr):
        ax = ir.axes_of(f, ())
        if ir.MIX_COL in ax and row_axis in ax:
            return None
        (ws if ir.MIX_COL in ax else us).append(f)
    if not ws:
        return None
    return ir.product(us), ir.product(ws)


def low_rank(mix_expr, row_axis: str):
    """[(u, w)] when the transition is a sum of a few products u * w, each as in `rank_one`
    (DeltaProduct's two Householder updates a step: M = u_1 w_1^T + u_2 w_2^T); None otherwise."""
    terms = []
    for sign, term in ir.summands(mix_expr):
        one = rank_one(term, row_axis)
        if one is None:
            return None
        terms.append((one[0] if sign > 0 else ir.Op("neg", (one[0],)), one[1]))
    return terms if len(terms) <= MAX_RANK else None


MAX_RANK = 8     # product terms a transition may have and still run as dot products (else the matrix)


def rank_one_scan(a, terms, out, h0):
    """mix_scan with M_t = sum_r u_rt w_rt^T (u (t, *state), w (t, *state, j) with size 1 on the
    rows): h_t = a_t h_{t-1} + sum_r u_rt (w_rt . h_{t-1}) + b_t, where ``out`` (T, *state)
    holds every b_t on entry and the states on return.

    Two or three torch calls a step, in place in the result: a_t h added to b_t, w . h as a
    batched mat-vec where w is one vector for all the state's other axes, u (w . h) added (the
    loop as users write it takes about ten calls a step; the executor's former stack of new
    tensors a step was slower than that loop on a CPU). Not differentiable: `rank_one_graph`."""
    T = out.shape[0]
    steps = lambda x: x.expand(T, *x.shape[1:]).unbind(0)      # noqa: E731 - each step's view
    ws = []
    for u, w in terms:
        w = w.squeeze(-2)
        mat = w.dim() >= 3 and h0.dim() >= 2 and w.shape[-2] == 1
        ws.append((steps(u), steps(w.transpose(-1, -2) if mat else w), mat))
    h = h0
    for t, (o, a_t) in enumerate(zip(out.unbind(0), steps(a))):
        o.addcmul_(a_t, h)
        for u, w, mat in ws:
            o.addcmul_(u[t], torch.matmul(h, w[t]) if mat else (w[t] * h).sum(-1, keepdim=True))
        h = o
    return out


def _differentiated(*xs) -> bool:
    """Whether autograd records ops on xs now (in-place writes into a buffer would break it)."""
    return torch.is_grad_enabled() and any(torch.is_tensor(x) and x.requires_grad for x in xs)


def rank_one_graph(a, terms, b, h0, steps: int = 1):
    """rank_one_scan out of place, each step a new tensor: what autograd can differentiate
    (`grads_by_autograd` through `run`)."""
    T = max(a.shape[0], b.shape[0], steps, *(x.shape[0] for uw in terms for x in uw))
    a, b = (x.expand(T, *x.shape[1:]) for x in (a, b))
    terms = [(u.expand(T, *u.shape[1:]), w.squeeze(-2).expand(T, *w.shape[1:-2], w.shape[-1])) for u, w in terms]
    hs, h = [], h0
    for t in range(T):
        new = a[t] * h + b[t]
        for u, w in terms:
            new = new + u[t] * (w[t] * h).sum(-1, keepdim=True)
        h = new
        hs.append(h)
    return torch.stack(hs)


def _to_output(v: torch.Tensor, names, index, sizes):
    keep = [ix for ix in index if ix != 1]
    rest = [n for n in names if n not in keep]
    v = v.permute([names.index(n) for n in keep + rest])
    v = v.reshape(v.shape[: len(keep)]) if rest else v
    v = v.expand([sizes[n] for n in keep])
    for i, ix in enumerate(index):
        if ix == 1:
            v = v.unsqueeze(i)
    return v


def _moved_last(r: Region, inputs):
    """`Region.mixed_last` of r, the inputs with the initial state permuted to match, and the
    permutation."""
    r2, perm = r.mixed_last()
    ins = list(inputs)
    if r.init is not None:
        ins[r.init] = ins[r.init].permute(perm)
    return r2, ins, perm


def run(region: Region, inputs, chunk: int = 0):
    r = region
    if r.mix is not None and r.mix_axis != r.axes[-1]:     # mixed along another axis: moved last
        r2, ins, _ = _moved_last(r, inputs)
        return [o.contiguous() for o in run(r2, ins, chunk)]     # as the op's fake kernel says
    cdt = compute_dtype(r, inputs)
    dev = inputs[0].device
    sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(r.axes, r.axis_size)}
    L = inputs[r.length[0]].shape[r.length[1]]
    state_shape = tuple(sizes[a] for a in r.axes)
    given, chunk = chunk, time_chunk(chunk, math.prod(state_shape), L)
    h = inputs[r.init].to(cdt) if r.init is not None else torch.zeros(state_shape, dtype=cdt, device=dev)
    if tuple(h.shape) != state_shape:        # an initial state broadcast along a dim the steps fill
        h = h.expand(state_shape)
    steps = {i: [] for i, o in enumerate(r.outputs) if o.kind == "steps"}
    names = ["t", *r.axes]
    ones = low_rank(r.mix.expr, r.axes[-1]) if r.mix is not None else None
    if r.mix is not None and ones is None:   # a chunk's transition matrices: at most MIX_CHUNK_ELEMENTS
        chunk = max(1, min(chunk, MIX_CHUNK_ELEMENTS // max(1, math.prod(state_shape) * state_shape[-1])))
    if ones is not None and given == 0:      # stepped one step at a time anyway: chunks that stay in cache
        chunk = max(16, min(chunk, RANK_CHUNK_ELEMENTS // max(1, math.prod(state_shape))))
    for t0 in range(0, L, chunk):
        t1 = min(L, t0 + chunk)
        ev = Evaluator(r, inputs, t0, t1, cdt)
        if r.mix is None:
            H = chunk_scan(ev.eval(r.decay).to(cdt), ev.eval(r.drive).to(cdt), h, t1 - t0)
        elif ones is not None:
            mev = Evaluator(r, inputs, t0, t1, cdt, matrix=True)
            us = [(mev.eval(u).to(cdt)[..., 0], mev.eval(w).to(cdt)) for u, w in ones]
            if _differentiated(*inputs):     # under autograd: no writes into a buffer
                H = rank_one_graph(ev.eval(r.decay).to(cdt), us, ev.eval(r.drive).to(cdt), h, t1 - t0)
            else:                            # the drive straight into the states' buffer
                H = ev.eval_into(r.drive, torch.empty((t1 - t0, *state_shape), dtype=cdt, device=dev))
                H = rank_one_scan(ev.eval(r.decay).to(cdt), us, H, h)
        else:
            M = Evaluator(r, inputs, t0, t1, cdt, matrix=True).eval(r.mix.expr).to(cdt)
            H = mix_scan(ev.eval(r.decay).to(cdt), M, ev.eval(r.drive).to(cdt), h, t1 - t0)
        ev.state = H
        for i in steps:
            o = r.outputs[i]
            v = ev.eval(o.expr)
            steps[i].append(_to_output(v, names, o.index, {**sizes, "t": t1 - t0}).to(ir.to_dtype(o.dtype)))
        h = H[-1]
    outs = []
    for i, o in enumerate(r.outputs):
        if o.kind == "steps":
            if steps[i]:
                outs.append(torch.cat(steps[i], dim=o.index.index("t")))
            else:
                shp = [0 if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index]
                outs.append(torch.empty(shp, dtype=ir.to_dtype(o.dtype), device=dev))
        else:
            ev = Evaluator(r, inputs, max(L - 1, 0), max(L, 1) if L else 0, cdt)
            ev.state = h.unsqueeze(0)
            v = ev.eval(o.expr)
            outs.append(_to_output(v, names, o.index, {**sizes, "t": 1}).to(ir.to_dtype(o.dtype)))
    return outs


class Grads:
    """What every adjoint pass starts from: the output gradients appended to the inputs (an
    output without one gets zeros), an accumulator per input that needs a gradient, and
    ``put(ev, pairs)``: each (Load, adjoint expression) pair evaluated by `ev` and summed into
    its input's accumulator."""

    def __init__(self, r: Region, inputs, grads, needs):
        self.cdt = compute_dtype(r, inputs)
        dev = inputs[0].device
        self.sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(r.axes, r.axis_size)}
        self.L = inputs[r.length[0]].shape[r.length[1]]
        self.state_shape = tuple(self.sizes[a] for a in r.axes)
        gin = []
        for o, g in zip(r.outputs, grads):
            shp = [self.L if ix == "t" else 1 if ix == 1 else self.sizes[ix] for ix in o.index]
            gin.append(g if g.numel() else torch.zeros(shp, dtype=ir.to_dtype(o.dtype), device=dev))
        self.allin = list(inputs) + gin
        self.acc = [torch.zeros(x.shape, dtype=self.cdt, device=dev) if n else None for x, n in zip(inputs, needs)]

    def put(self, ev, pairs):
        for ld, e in pairs:
            if ld.input < len(self.acc) and self.acc[ld.input] is not None:
                ev.accumulate(self.acc[ld.input], ld, ev.factor_values(e))

    def h0(self, r: Region, inputs):
        if r.init is not None:       # (broadcast along a dim the steps fill, as the forward does)
            return inputs[r.init].to(self.cdt).expand(self.state_shape)
        return torch.zeros(self.state_shape, dtype=self.cdt, device=inputs[0].device)

    def seed_final(self, r: Region, adj, h):
        """dL/dh_(L-1) from the final outputs (h: the last state), their loads' gradients put."""
        lam = torch.zeros(self.state_shape, dtype=self.cdt, device=h.device)
        if adj.state_final is not None or adj.loads_final:
            ev = Evaluator(r, self.allin, max(self.L - 1, 0), max(self.L, 1) if self.L else 0, self.cdt)
            ev.state = h.unsqueeze(0)
            if adj.state_final is not None:
                lam = lam + ev.eval(adj.state_final).expand(1, *self.state_shape)[0]
            self.put(ev, adj.loads_final)
        return lam

    def result(self, r: Region, inputs, lam_init):
        """The gradients in the inputs' dtypes; lam_init = dL/dh_(-1) goes to the initial state."""
        if r.init is not None and self.acc[r.init] is not None:
            self.acc[r.init] += lam_init.expand(self.state_shape).to(self.cdt).sum_to_size(self.acc[r.init].shape)
        return [g.to(x.dtype) if g is not None else None for g, x in zip(self.acc, inputs)]


def adjoint_run(region: Region, inputs, grads, needs, chunk: int = 0):
    """Gradients of every input from the region's adjoint (ssmc.autodiff): a forward pass keeps
    the state at each chunk start, then chunks run in reverse: the forward states of the chunk
    are recomputed, the adjoint state lam runs the recurrence backwards in time, and the
    gradients of the decay, drive and output expressions are accumulated into the inputs.
    A region with a non-diagonal transition: `ssmc.targets.mix_adjoint`."""
    from ssmc.autodiff import GRAD_A, GRAD_B, region_adjoint
    r = region
    if r.mix is not None and r.mix_axis != r.axes[-1]:     # mixed along another axis: moved last
        r2, ins, perm = _moved_last(r, inputs)
        out = adjoint_run(r2, ins, grads, needs, chunk)
        if r.init is not None and out[r.init] is not None:
            out[r.init] = out[r.init].permute(tuple(perm.index(d) for d in range(len(perm)))).contiguous()
        return out
    if r.mix is not None:
        from .mix_adjoint import backward
        state = math.prod(inputs[i].shape[d] for i, d in r.axis_size)
        L = inputs[r.length[0]].shape[r.length[1]]
        return backward(r, inputs, grads, needs, steps=time_chunk(chunk, state, L))
    adj = region_adjoint(r)
    g = Grads(r, inputs, grads, needs)
    cdt, L, state_shape = g.cdt, g.L, g.state_shape
    chunk = time_chunk(chunk, math.prod(state_shape), L)
    with torch.no_grad():
        h = g.h0(r, inputs)
        starts = []
        for t0 in range(0, L, chunk):
            starts.append(h)
            t1 = min(L, t0 + chunk)
            ev = Evaluator(r, g.allin, t0, t1, cdt)
            h = chunk_scan(ev.eval(r.decay).to(cdt), ev.eval(r.drive).to(cdt), h, t1 - t0)[-1]
        lam_next = g.seed_final(r, adj, h)     # a_{t1} * lam_{t1}
        for c in reversed(range(len(starts))):
            t0, t1 = c * chunk, min(L, (c + 1) * chunk)
            ev = Evaluator(r, g.allin, t0, t1, cdt)
            a = ev.eval(r.decay).to(cdt).expand(t1 - t0, *([-1] * len(state_shape)))
            H = chunk_scan(a, ev.eval(r.drive).to(cdt), starts[c])
            ev.state = H
            direct = ev.eval(adj.state_steps).expand(t1 - t0, *state_shape) if adj.state_steps is not None \
                else torch.zeros((t1 - t0, *state_shape), dtype=cdt, device=h.device)
            g.put(ev, adj.loads_steps)
            H_prev = torch.cat([starts[c].unsqueeze(0), H[:-1]])
            # lam_t = direct_t + a_{t+1} lam_{t+1}, reversed in time as a forward scan
            alpha = torch.cat([torch.ones_like(a[:1]), a.flip(0)[:-1]])
            lam = chunk_scan(alpha, direct.flip(0), lam_next).flip(0)
            lam_next = a[0] * lam[0]                             # dL/dh before this chunk
            ev.memo[GRAD_A] = lam * H_prev
            ev.memo[GRAD_B] = lam
            g.put(ev, adj.loads_decay)
            g.put(ev, adj.loads_drive)
    return g.result(r, inputs, lam_next)
