"""Backward of chunked-SSD regions. On a GPU (and under the interpreter when asked) with an
epilogue kernel (ssd_epilogue.py), `_kernel_backward`: kernels end to end, torch autograd only
through the factor expressions. Otherwise the region's factors and epilogue under torch
autograd, the chunked core between them as the Triton kernels of ssd_core.py or in torch
matmuls (CPU, fp64), as below.

The selective-scan backward (triton_bwd.py) treats every state element as its own recurrence;
for a Mamba-2 head (a p x n state of 64 x 128) that is 8192 scans per program and no tensor
cores. Here the region's `SSDPlan` (triton_ssd.py: log decay u, drive w * x(p) * g(n),
readout sum_n h * c) is evaluated over the whole sequence with the torch target's `Evaluator`,
and the outputs are recomputed in the SSD's matmul form, chunk of Q steps by chunk (the torch
form; ssd_core.py computes the same map in kernels, with its own backward):

    a      = cumsum of u inside the chunk                               (P, chunks, Q)
    y_in   = ((c g^T) * exp(a_t - a_s) [s <= t] * w_s) x               intra-chunk, (Q, Q) matmuls
    S      = (x * w * exp(a_end - a))^T g                               each chunk's own state (p, n)
    h_c    = exp(a_end of chunk c-1) * h_(c-1) + S_(c-1)                chunk-start states, sequential
    y      = y_in + exp(a_t) * (c h_c^T)                                the carried state's share

(P: every index of the program axes, flattened). The region's per-step outputs are then
evaluated with the readout replaced by y times its factors free of n, the final outputs on the
state after the last chunk, and `torch.autograd.grad` gives every input's gradient. Nothing
of size (batch, heads, p, n, L) exists: the largest tensors are the (P, chunks, Q, Q) masks.
Time is padded to whole chunks with u = 0 and w = 0 (the state passes through unchanged).
The matmuls take 16-bit operands (fp32 accumulation) when every input they read is that 16-bit
type, as the forward kernel's tl.dot does; fp32 otherwise (fp64 for fp64 inputs).
"""
from __future__ import annotations

import math

import torch

from ssmc import ir

from . import triton as T
from .reference import Evaluator, _to_output, autograd_inside_op, compute_dtype, grads_by_autograd

CHUNK = 64
DECAY_N_CHUNK = 16      # a decay along n: the scores' (Q, Q, n) product costs Q n a step, the state's p n
TORCH_SSD_ELEMENTS = 1 << 26    # the torch target's matmul form: its largest tensors together, at most


def _small(v: torch.Tensor, names: list, progs: tuple, last) -> torch.Tensor:
    """An Evaluator value laid out (t, *axes) -> (*progs, t, `last` or 1), each axis at its own
    size or 1 where the value does not vary along it (nothing expanded)."""
    if v.dim() < len(names):
        v = v.reshape([1] * len(names))
    order = [names.index(a) for a in progs] + [0] + ([names.index(last)] if last else [])
    rest = [i for i in range(len(names)) if i not in order]
    if any(v.shape[i] != 1 for i in rest):
        raise ValueError(f"a factor varies along {[names[i] for i in rest if v.shape[i] != 1]}, "
                         f"which the SSD plan said it does not")
    v = v.permute(order + rest)
    return v.reshape(list(v.shape[:len(order)]) + ([] if last else [1]))


def _flat(v: torch.Tensor, S: tuple, L: int, k: int) -> torch.Tensor:
    """(*S or 1, L or 1, k or 1) -> (P, L, k), expanded."""
    return v.expand(*S, L, k).reshape(math.prod(S), L, k)


def _unlay(v: torch.Tensor, names: list, progs: tuple, last, sizes: dict) -> torch.Tensor:
    """(P, T, size of `last`) or (*program sizes, T, ...) -> laid out (T, *axes) as the Evaluator
    keeps values."""
    T = v.shape[-2] if last else v.shape[-1]
    axes = list(progs) + ["t"] + ([last] if last else [])
    v = v.reshape([sizes[a] for a in progs] + [T] + ([sizes[last]] if last else []))
    v = v.permute([axes.index(n) for n in names if n in axes])
    present = [n for n in names if n in axes]
    for i, n in enumerate(names):
        if n not in present:
            v = v.unsqueeze(i)
    return v


def _torch_core(u, w, x, g, c, h0, Q: int, mm):
    """(y (P, L, p) or None without c, the final state (P, p, n)) in torch matmuls; (P, L, .)
    inputs, time padded to whole chunks inside. u is (P, L, 1), or (P, L, n) for a decay along
    n (GLA's per-key decay: the intra-chunk scores then sum a (Q, Q, n) product over n)."""
    P, L = u.shape[0], u.shape[1]
    nc = -(-L // Q)
    pad = nc * Q - L

    def chunks(v):
        if pad:
            v = torch.cat([v, v.new_zeros(v.shape[0], pad, v.shape[2])], 1)
        return v.reshape(P, nc, Q, v.shape[-1])
    u, w, x, g = chunks(u), chunks(w)[..., 0], chunks(x), chunks(g)
    # Sums of u over ranges of steps are summed, never taken as differences of prefix sums: with
    # strong decays a difference of two large prefix sums loses the small one's digits, and its
    # gradient is two large terms that cancel (the gradient of A came out ~1e-6 off whatever its size).
    a = u.cumsum(-2)                                                  # (P, nc, Q, 1 or n): steps <= t
    after = u.flip(-2).cumsum(-2).flip(-2)                            # steps >= s ...
    after = torch.cat([after[..., 1:, :], torch.zeros_like(after[..., :1, :])], -2)   # ... > s, to the chunk's end
    to_end = torch.exp(after) * w[..., None]
    S = mm(x.transpose(-1, -2), g * to_end)                           # (P, nc, p, n)
    total = torch.exp(a[..., -1, :])                                  # (P, nc, 1 or n)
    starts, h = [], h0
    # unbind once: indexing S[:, k] in the loop would make each step's backward zero-fill and
    # add a gradient of S's full size (nc times S's bytes; 25 ms of 41 at b8 L4096 h24 on the H200)
    for tot_k, S_k in zip(total.unbind(1), S.unbind(1)):
        starts.append(h)
        h = tot_k[:, None, :] * h + S_k
    if c is None:
        return None, h
    c = chunks(c)
    causal = torch.ones(Q, Q, dtype=torch.bool, device=u.device).tril()
    strict = causal.tril(-1)
    if u.shape[-1] == 1:
        # seg[t, s] = u_(s+1) + ... + u_t: u_t placed at (t, s) for s < t, summed down the rows
        seg = torch.where(strict, u.expand(*u.shape[:-1], Q), 0.0).cumsum(-2)      # (P, nc, Q, Q)
        scores = mm(c, g.transpose(-1, -2)) * torch.exp(seg.masked_fill(~causal, float("-inf")))
    else:
        seg = torch.where(strict[..., None], u[..., :, None, :].expand(*u.shape[:-1], Q, u.shape[-1]), 0.0)
        seg = seg.cumsum(-3)                                                        # (P, nc, Q, Q, n)
        decay = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
        scores = torch.einsum("pctn,pcsn,pctsn->pcts", c, g, decay)
    y = mm(scores * w[..., None, :], x)                                          # intra-chunk
    H = torch.stack(starts, 1)                                                   # (P, nc, p, n)
    y = y + mm(c * torch.exp(a), H.transpose(-1, -2))                            # carried state
    return y.reshape(P, nc * Q, -1)[:, :L], h


def use_kernels(region: ir.Region, plan, inputs) -> str | None:
    """Why the Triton core (ssd_core.py) does not run this call, or None when it does."""
    if plan.readout is None:
        return "no readout (the kernels compute y)"
    if not inputs[0].is_cuda and not T.interpreting():
        return "inputs not on a GPU"
    if T.triton is None:
        return f"triton {T._TRITON_VERSION}"
    if compute_dtype(region, inputs) != torch.float32:
        return f"compute dtype {compute_dtype(region, inputs)} (the kernels run fp32)"
    sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(region.axes, region.axis_size)}
    P = math.prod(sizes[a] for a in plan.programs)
    if P > 65535:
        return f"{P} program indices (grid axis 1 holds at most 65535)"
    return None


def operand_dtypes(plan, inputs) -> set:
    """The dtypes of the float inputs x, g and c read (they pick the core's dot operands)."""
    used = {ld.input for e in (plan.x, plan.g, plan.c) if e is not None for ld in ir.loads(e)}
    return {inputs[i].dtype for i in used if inputs[i].is_floating_point()}


def kernel_chunk(plan, inputs) -> int:
    """The chunk of the core's kernels for these inputs (ssd_core's config for their operands)."""
    from .ssd_core import config, opd_of
    return config("core", opd_of(operand_dtypes(plan, inputs)))["CHUNK"]


class _Factors:
    """The region's factors laid out for the core: u, w (*S or 1, L or 1, 1), x (..., p or 1),
    g, c (..., n or 1), h0 (*S, p, n) or None; the Evaluator, the axis sizes (with "t"), the
    program sizes S and the dtypes x, g and c are read from."""

    def __init__(self, region: ir.Region, plan, inputs, kernels: bool):
        r = region
        self.cdt = cdt = compute_dtype(r, inputs)
        sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(r.axes, r.axis_size)}
        L = inputs[r.length[0]].shape[r.length[1]]
        names = ["t", *r.axes]
        progs, p, n = tuple(plan.programs), plan.p, plan.n
        self.S = tuple(sizes[a] for a in progs)
        self.ev = ev = Evaluator(r, inputs, 0, L, cdt)
        self.sizes = {**sizes, "t": L}
        small = lambda e, last: _small(ev.eval(e).to(cdt), names, progs, last)   # noqa: E731

        def factor(e, last):
            # on the kernels' path a factor that is one input read as is keeps its dtype (no fp32 copy)
            if kernels and isinstance(e, ir.Load) and inputs[e.input].is_floating_point():
                return _small(ev.view_of(inputs[e.input], e), names, progs, last)
            return small(e, last)
        self.u, self.w = small(plan.log_decay, n if plan.decay_n else None), factor(plan.w, None)
        self.x, self.g = factor(plan.x, p), factor(plan.g, n)
        self.c = factor(plan.c, n) if plan.readout is not None else None
        self.kinds = operand_dtypes(plan, inputs)
        self.h0 = (inputs[r.init].to(cdt).permute([r.axes.index(ax) for ax in (*progs, p, n)])
                   if r.init is not None else None)

    def spec(self, plan, chunk: int | None, deterministic: bool, cache_dir: str | None):
        """The core kernels' Spec for these factors (chunk None: ssd_core's config's)."""
        from .ssd_core import Spec, opd_of
        return Spec(self.S, self.sizes["t"], self.sizes[plan.p], self.sizes[plan.n],
                    chunk, opd_of(self.kinds), deterministic, cache_dir)


def _core(region: ir.Region, plan, inputs, chunk: int | None, kernels: bool, deterministic: bool,
          cache_dir: str | None):
    """The factors under autograd and the core map: (y (*program sizes, L, p) or None without a
    readout, the state after the last step (P, p, n), the Evaluator, the axis sizes)."""
    f = _Factors(region, plan, inputs, kernels)
    S, sizes, cdt = f.S, f.sizes, f.cdt
    L, p, n = sizes["t"], sizes[plan.p], sizes[plan.n]
    if kernels:
        from .ssd_core import core as run_core
        y, h = run_core(f.spec(plan, chunk, deterministic, cache_dir), f.u, f.w, f.x, f.g, f.c, f.h0)
    else:
        kinds = set(f.kinds)
        lo = kinds.pop() if len(kinds) == 1 and kinds <= {torch.bfloat16, torch.float16} else None

        def mm(a, b):
            return a @ b if lo is None else (a.to(lo) @ b.to(lo)).to(cdt)
        P = math.prod(S)
        fl = lambda v, k: _flat(v, S, L, k)                          # noqa: E731
        hz = (f.h0.reshape(P, p, n) if f.h0 is not None
              else torch.zeros(P, p, n, dtype=cdt, device=inputs[0].device))
        y, h = _torch_core(fl(f.u, n if plan.decay_n else 1), fl(f.w, 1), fl(f.x, p), fl(f.g, n),
                           None if f.c is None else fl(f.c, n), hz, max(1, min(chunk or CHUNK, L)), mm)
    if y is not None:
        y = y.to(cdt).reshape(*S, L, p)                              # (P, L, p) -> (*S, L, p): a view
    return y, h, f.ev, sizes


def _final_outputs(region: ir.Region, plan, inputs, h, sizes: dict) -> dict:
    """{output index: value} of the final outputs, evaluated on the last state h (P, p, n)."""
    r = region
    L = sizes["t"]
    names = ["t", *r.axes]
    progs = (*plan.programs, plan.p, plan.n)
    outs = {}
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            evf = Evaluator(r, inputs, L - 1, L, compute_dtype(r, inputs))
            hl = h.reshape([sizes[a] for a in progs])
            evf.state = hl.permute([progs.index(ax) for ax in r.axes]).unsqueeze(0)
            v = evf.eval(o.expr)
            outs[k] = _to_output(v, names, o.index, {**sizes, "t": 1}).to(ir.to_dtype(o.dtype))
    return outs


def ssd_outputs(region: ir.Region, plan, inputs, chunk: int | None = None, core: str = "auto",
                deterministic: bool = False, cache_dir: str | None = None) -> list[torch.Tensor]:
    """The region's outputs computed in the chunked SSD's matmul form (differentiable).
    ``core``: "triton" runs the map from the factors to (y, final state) as the kernels of
    ssd_core.py (under the interpreter too), "torch" in torch matmuls, "auto" the kernels where
    `use_kernels` says they run."""
    r = region
    kernels = core == "triton" or (core == "auto" and use_kernels(r, plan, inputs) is None)
    y, h, ev, sizes = _core(r, plan, inputs, chunk, kernels, deterministic, cache_dir)
    names, progs, p = ["t", *r.axes], tuple(plan.programs), plan.p
    if y is not None:
        if plan.y_scale is not None:
            y = y * _small(ev.eval(plan.y_scale).to(y.dtype), names, progs, p)
        ev.memo[plan.readout] = _unlay(y, names, progs, p, sizes)
    finals = _final_outputs(r, plan, inputs, h, sizes)
    return [_to_output(ev.eval(o.expr), names, o.index, sizes).to(ir.to_dtype(o.dtype))
            if o.kind == "steps" else finals[k] for k, o in enumerate(r.outputs)]


def ssd_backward(region: ir.Region, plan, inputs, grads, needs, chunk: int | None = None,
                 core: str = "auto", deterministic: bool = False, cache_dir: str | None = None,
                 epilogue=None) -> list:
    """Every input's gradient (None where not needed). With the core's kernels and an
    ``epilogue`` (ssd_epilogue.make_epilogue's, for these `needs`), `_kernel_backward`;
    otherwise autograd through all of `ssd_outputs`."""
    kernels = core == "triton" or (core == "auto" and use_kernels(region, plan, inputs) is None)
    kw = dict(core=core, deterministic=deterministic, cache_dir=cache_dir)
    if not kernels or epilogue is None or isinstance(epilogue, str):
        return grads_by_autograd(lambda xs: ssd_outputs(region, plan, xs, chunk, **kw), inputs, grads, needs)
    return _kernel_backward(region, plan, inputs, grads, needs, chunk, deterministic, cache_dir, epilogue)


def _kernel_backward(region, plan, inputs, grads, needs, chunk, deterministic, cache_dir, epilogue):
    """The backward as kernels end to end, torch autograd only through the factor expressions
    and the final outputs:

        factors (autograd records them) -> the core's forward (y, the chunk states; no graph)
        -> the epilogue's kernel (dy, and its inputs' gradients) -> the core's backward kernels
        (du, dw, dx, dg, dc, dh0; dx added into the epilogue's gradient of the same input
        where x is that input read as is) -> autograd from the factors to the inputs.

    y is held in the dots' operand type (what the core's backward reads of dy anyway) and freed
    before the core's backward, so the largest buffers alive at once are the two chunk-state
    buffers, dy and the inputs' gradients."""
    from . import ssd_core
    from .ssd_epilogue import backward as epilogue_backward
    r = region
    xs = [x.detach().requires_grad_(bool(n) and x.is_floating_point()) for x, n in zip(inputs, needs)]
    with autograd_inside_op(), torch.enable_grad():
        f = _Factors(r, plan, xs, True)
    sp = f.spec(plan, chunk, deterministic, cache_dir)
    sizes, L = f.sizes, f.sizes["t"]
    with torch.no_grad():
        y, hl, H, A = ssd_core._forward(sp, f.u, f.w, f.x, f.g, f.c, f.h0, y_dtype=sp.state_dtype)
    wrt_i = [i for i, x in enumerate(xs) if x.requires_grad]
    wrt = [xs[i] for i in wrt_i]
    total = {}                                         # input index -> gradient so far

    def add(i, g):
        if g is not None:
            if i in total:
                dt = torch.promote_types(total[i].dtype, g.dtype)
                g = total[i].to(dt) + g.to(dt)
            total[i] = g
    # the final outputs: their gradients reach the last state (dhl) and the inputs they read
    dhl = None
    want = [k for k, o in enumerate(r.outputs) if o.kind == "final" and grads[k] is not None
            and grads[k].numel()]
    if want:
        hd = hl.detach().requires_grad_(True)
        with autograd_inside_op(), torch.enable_grad():
            finals = _final_outputs(r, plan, xs, hd, sizes)
        pairs = [(finals[k], grads[k]) for k in want if finals[k].requires_grad]
        if pairs:
            got = torch.autograd.grad([o for o, _ in pairs], [hd, *wrt],
                                      [g.to(o.dtype) for o, g in pairs], allow_unused=True)
            dhl = got[0]
            for i, g in zip(wrt_i, got[1:]):
                add(i, g)
    dy, extra = epilogue_backward(epilogue, inputs, y.reshape(*f.S, L, -1), grads, sizes, cache_dir)
    del y
    # dx into the epilogue's gradient of x's input when x is that input as is (Mamba-2's D skip)
    dx_out, xi = None, plan.x.input if isinstance(plan.x, ir.Load) else None
    if xi is not None and xi in extra and extra[xi].shape == inputs[xi].shape \
            and not ssd_core._aliased(f.x, (*f.S, L, sizes[plan.p])):
        dx_out = _small(f.ev.view_of(extra[xi], plan.x), ["t", *r.axes], tuple(plan.programs), plan.p)
    with torch.no_grad():
        (du, dw, dx, dg, dc), dh0 = ssd_core._backward(sp, f.u, f.w, f.x, f.g, f.c, H, A, dy, dhl,
                                                        dx_out=dx_out)
    del H, A, dy
    for i, e in extra.items():
        add(i, e)                                      # dx_out's input: dx included
    roots = [(f.u, du), (f.w, dw), (f.g, dg), (f.c, dc)]
    if dx_out is None:
        roots.append((f.x, dx))
    if f.h0 is not None:
        roots.append((f.h0, dh0.reshape(f.h0.shape)))
    roots = [(o, g) for o, g in roots if o is not None and o.requires_grad]
    if roots and wrt:
        got = torch.autograd.grad([o for o, _ in roots], wrt, [g.to(o.dtype) for o, g in roots],
                                  allow_unused=True)
        for i, g in zip(wrt_i, got):
            add(i, g)
    return [None if not xx.requires_grad else
            (total[i].to(x.dtype) if i in total else torch.zeros_like(x))
            for i, (x, xx) in enumerate(zip(inputs, xs))]


class TorchSSDKernel:
    """The torch target's kernel for a region with an SSD plan (chunked_ssd, and chunked_scan
    with a decay along n too): `ssd_outputs` with the core in torch matmuls (chunks of `chunk`
    steps, default CHUNK, DECAY_N_CHUNK for a decay along n), backward by autograd through it.
    Per chunk a few matmuls instead of a (steps, *state) tensor a chunk: on a CPU, fla's simple
    GLA, linear attention and GLA loops run faster than as written (benchmarks/NOTES.md), where
    the state scan ran slower. Only fp32 and fp64 inputs: the matmul form would take 16-bit
    inputs into 16-bit matmuls (`_core`), which the reference computes in fp32. A call of no
    steps, or one whose tensors would be too large (`_declines`), runs the reference."""

    def __init__(self, region: ir.Region, plan, chunk: int):
        self.region, self.plan, self.chunk = region, plan, chunk

    @classmethod
    def make(cls, region: ir.Region, chunk: int = 0):
        """The kernel, or None where the region has no SSD plan (a decay along the readout's
        axis allowed) or takes 16-bit inputs."""
        if any(s.dtype in ("bfloat16", "float16") for s in region.inputs):
            return None
        try:
            from .triton_ssd import make_ssd_plan
        except ImportError:     # the planner lives beside the Triton kernels; the reference runs
            return None
        plan = make_ssd_plan(region, float64=True, decay_along_n=True)
        if isinstance(plan, str):
            return None
        return cls(region, plan, int(chunk) if chunk > 0 else DECAY_N_CHUNK if plan.decay_n else CHUNK)

    last: str | None = None          # why the last call ran the reference scan (None: the matmul form)

    def _declines(self, inputs) -> str | None:
        """Why this call runs the reference scan instead: no steps, or the matmul form's largest
        tensors (the chunks' states, the intra-chunk scores) over TORCH_SSD_ELEMENTS together
        (the reference keeps a chunk of states near 4M elements)."""
        r, plan, Q = self.region, self.plan, self.chunk
        sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(r.axes, r.axis_size)}
        L = inputs[r.length[0]].shape[r.length[1]]
        if not L:
            return "no steps"
        P = math.prod(sizes[a] for a in plan.programs)
        nc = -(-L // min(Q, L))
        big = P * nc * (sizes[plan.p] * sizes[plan.n] + Q * Q * (sizes[plan.n] if plan.decay_n else 1))
        if big > TORCH_SSD_ELEMENTS:
            return f"the matmul form's tensors would hold {big} elements (more than {TORCH_SSD_ELEMENTS})"
        return None

    def forward(self, inputs):
        from .reference import run
        self.last = self._declines(inputs)
        with torch.no_grad():
            if self.last:
                return run(self.region, inputs)
            return ssd_outputs(self.region, self.plan, inputs, self.chunk, core="torch")

    def backward(self, inputs, grads, needs):
        if self._declines(inputs):
            from .reference import adjoint_run
            return adjoint_run(self.region, inputs, grads, needs)
        return ssd_backward(self.region, self.plan, inputs, grads, needs, self.chunk, core="torch")

    def describe(self) -> str:
        msg = (f"torch target: the chunked SSD's matmul form, chunks of {self.chunk} steps "
               f"(ssmc/targets/ssd_autograd.py)")
        return msg + (f"; the last call ran the reference scan: {self.last}" if self.last else "")
