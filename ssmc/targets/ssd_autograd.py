"""Backward of chunked-SSD regions: the chunked SSD written in torch matmuls, differentiated by autograd.

The selective-scan backward (triton_bwd.py) treats every state element as its own recurrence;
for a Mamba-2 head (a p x n state of 64 x 128) that is 8192 scans per program and no tensor
cores. Here the region's `SSDPlan` (triton_ssd.py: log decay u, drive w * x(p) * g(n),
readout sum_n h * c) is evaluated over the whole sequence with the torch target's `Evaluator`,
and the outputs are recomputed in the SSD's matmul form, chunk of Q steps by chunk:

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

import torch

from ssmc import ir

from .reference import Evaluator, _to_output, compute_dtype, grads_by_autograd

CHUNK = 64


def _lay(v: torch.Tensor, names: list, progs: tuple, last, sizes: dict, L: int) -> torch.Tensor:
    """An Evaluator value laid out (t, *axes) -> (P, L, size of `last` or 1)."""
    order = [names.index(a) for a in progs] + [0] + ([names.index(last)] if last else [])
    rest = [i for i in range(len(names)) if i not in order]
    if any(v.shape[i] != 1 for i in rest):
        raise ValueError(f"a factor varies along {[names[i] for i in rest if v.shape[i] != 1]}, "
                         f"which the SSD plan said it does not")
    v = v.permute(order + rest)
    shape = [sizes[a] for a in progs] + [L] + ([sizes[last]] if last else []) + [1] * len(rest)
    v = v.expand(shape)
    P = 1
    for a in progs:
        P *= sizes[a]
    return v.reshape(P, L, -1)


def _unlay(v: torch.Tensor, names: list, progs: tuple, last, sizes: dict) -> torch.Tensor:
    """(P, T, size of `last`) -> laid out (T, *axes) as the Evaluator keeps values."""
    T = v.shape[1]
    axes = list(progs) + ["t"] + ([last] if last else [])
    v = v.reshape([sizes[a] for a in progs] + [T] + ([sizes[last]] if last else []))
    v = v.permute([axes.index(n) for n in names if n in axes])
    present = [n for n in names if n in axes]
    for i, n in enumerate(names):
        if n not in present:
            v = v.unsqueeze(i)
    return v


def ssd_outputs(region: ir.Region, plan, inputs, chunk: int = CHUNK) -> list[torch.Tensor]:
    """The region's outputs computed in the chunked SSD's matmul form (differentiable)."""
    r = region
    cdt = compute_dtype(r, inputs)
    dev = inputs[0].device
    sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(r.axes, r.axis_size)}
    L = inputs[r.length[0]].shape[r.length[1]]
    names = ["t", *r.axes]
    progs, p, n = tuple(plan.programs), plan.p, plan.n
    ev = Evaluator(r, inputs, 0, L, cdt)
    lay = lambda e, last: _lay(ev.eval(e).to(cdt), names, progs, last, sizes, L)   # noqa: E731
    u, w, x, g = lay(plan.log_decay, None), lay(plan.w, None), lay(plan.x, p), lay(plan.g, n)
    c = lay(plan.c, n) if plan.readout is not None else None
    used = {ld.input for e in (plan.x, plan.g, plan.c) if e is not None for ld in ir.loads(e)}
    kinds = {inputs[i].dtype for i in used if inputs[i].is_floating_point()}
    lo = kinds.pop() if len(kinds) == 1 and kinds <= {torch.bfloat16, torch.float16} else None

    def mm(a, b):
        return a @ b if lo is None else (a.to(lo) @ b.to(lo)).to(cdt)
    P, Q = u.shape[0], max(1, min(chunk, L))
    nc = -(-L // Q)
    pad = nc * Q - L

    def chunks(v):
        if pad:
            v = torch.cat([v, v.new_zeros(v.shape[0], pad, v.shape[2])], 1)
        return v.reshape(P, nc, Q, v.shape[-1])
    u, w, x, g = chunks(u)[..., 0], chunks(w)[..., 0], chunks(x), chunks(g)
    a = u.cumsum(-1)                                                  # (P, nc, Q)
    to_end = torch.exp(a[..., -1:] - a) * w
    S = mm((x * to_end[..., None]).transpose(-1, -2), g)              # (P, nc, p, n)
    total = torch.exp(a[..., -1])                                     # (P, nc)
    if r.init is not None:
        h0 = inputs[r.init].to(cdt)
        h0 = h0.permute([r.axes.index(ax) for ax in (*progs, p, n)]).reshape(P, sizes[p], sizes[n])
    else:
        h0 = torch.zeros(P, sizes[p], sizes[n], dtype=cdt, device=dev)
    starts, h = [], h0
    # unbind once: indexing S[:, k] in the loop would make each step's backward zero-fill and
    # add a gradient of S's full size (nc times S's bytes; 25 ms of 41 at b8 L4096 h24 on the H200)
    for tot_k, S_k in zip(total.unbind(1), S.unbind(1)):
        starts.append(h)
        h = tot_k[:, None, None] * h + S_k
    outs_steps = {}
    if c is not None:
        c = chunks(c)
        seg = a[..., :, None] - a[..., None, :]                       # (P, nc, Q, Q): a_t - a_s
        causal = torch.ones(Q, Q, dtype=torch.bool, device=dev).tril()
        decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
        y = mm(mm(c, g.transpose(-1, -2)) * decay * w[..., None, :], x)          # intra-chunk
        H = torch.stack(starts, 1)                                               # (P, nc, p, n)
        y = y + torch.exp(a)[..., None] * mm(c, H.transpose(-1, -2))            # carried state
        y = y.reshape(P, nc * Q, sizes[p])[:, :L]
        if plan.y_scale is not None:
            y = y * lay(plan.y_scale, p)
        outs_steps[plan.readout] = _unlay(y, names, progs, p, sizes)
    outs = []
    for o in r.outputs:
        if o.kind == "steps":
            ev.memo.update(outs_steps)
            v = ev.eval(o.expr)
            outs.append(_to_output(v, names, o.index, {**sizes, "t": L}).to(ir.to_dtype(o.dtype)))
        else:
            evf = Evaluator(r, inputs, L - 1, L, cdt)
            hl = h.reshape([sizes[a] for a in (*progs, p, n)])
            evf.state = hl.permute([(*progs, p, n).index(ax) for ax in r.axes]).unsqueeze(0)
            v = evf.eval(o.expr)
            outs.append(_to_output(v, names, o.index, {**sizes, "t": 1}).to(ir.to_dtype(o.dtype)))
    return outs


def ssd_backward(region: ir.Region, plan, inputs, grads, needs, chunk: int = CHUNK) -> list:
    """Every input's gradient (None where not needed) by autograd through `ssd_outputs`."""
    return grads_by_autograd(lambda xs: ssd_outputs(region, plan, xs, chunk), inputs, grads, needs)
