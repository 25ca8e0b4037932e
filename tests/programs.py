"""Naive recurrent programs, written the ways people write them, for the tests.

Each builder returns (fn, make_inputs) where make_inputs(dtype, seed) gives fresh random
inputs. All use torch ops only, so the same fn runs eagerly in float64 as the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


# -- Mamba-1: per-element decay, state (b, d, n) ------------------------------------------------

def mamba1_inputs(b=2, L=8, d=4, n=3, dtype=torch.float32, seed=0, layout="bld"):
    g = _gen(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    x, z = r(b, L, d), r(b, L, d)
    dt = r(b, L, d) * 0.5
    A = -torch.rand(d, n, generator=g) * 2 - 0.1
    B, C = r(b, L, n), r(b, L, n)
    D, bias = r(d), r(d) * 0.1
    if layout == "bdl":
        x, z, dt = x.transpose(1, 2).contiguous(), z.transpose(1, 2).contiguous(), dt.transpose(1, 2).contiguous()
        B, C = B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous()
    ins = (x, dt, A, B, C, D, z, bias)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in ins)


def mamba1(form: str = "stack", readout: str = "sum"):
    """Selective scan with softplus(dt + bias), D skip and z gate, in capture form `form`."""

    def readout_fn(h, C_t):
        if readout == "sum":
            return (h * C_t.unsqueeze(1)).sum(-1)
        if readout == "einsum":
            return torch.einsum("bdn,bn->bd", h, C_t)
        if readout == "matmul":
            return (h @ C_t.unsqueeze(-1)).squeeze(-1)
        raise ValueError(readout)

    def step(h, x_t, dt_t, B_t, C_t, z_t, A, D, bias):
        delta = F.softplus(dt_t + bias)
        dA = torch.exp(delta.unsqueeze(-1) * A)
        h = dA * h + (delta * x_t).unsqueeze(-1) * B_t.unsqueeze(1)
        y = readout_fn(h, C_t) + D * x_t
        return h, y * F.silu(z_t)

    def fn(x, dt, A, B, C, D, z, bias):
        b, L, d = x.shape
        h = torch.zeros(b, d, A.shape[1], dtype=torch.float32, device=x.device)
        if form == "stack":
            ys = []
            for t in range(L):
                h, y = step(h, x[:, t], dt[:, t], B[:, t], C[:, t], z[:, t], A, D, bias)
                ys.append(y)
            return torch.stack(ys, dim=1)
        if form == "cat":
            ys = []
            for t in range(L):
                h, y = step(h, x[:, t], dt[:, t], B[:, t], C[:, t], z[:, t], A, D, bias)
                ys.append(y.unsqueeze(1))
            return torch.cat(ys, dim=1)
        if form == "setitem":
            out = torch.empty(b, L, d, dtype=torch.float32, device=x.device)
            for t in range(L):
                h, y = step(h, x[:, t], dt[:, t], B[:, t], C[:, t], z[:, t], A, D, bias)
                out[:, t] = y
            return out
        if form == "unbind":
            ys = []
            for x_t, dt_t, B_t, C_t, z_t in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1), z.unbind(1)):
                h, y = step(h, x_t, dt_t, B_t, C_t, z_t, A, D, bias)
                ys.append(y)
            return torch.stack(ys, 1)
        if form == "final":
            ys = []
            for t in range(L):
                h, y = step(h, x[:, t], dt[:, t], B[:, t], C[:, t], z[:, t], A, D, bias)
                ys.append(y)
            return torch.stack(ys, 1), h
        raise ValueError(form)
    return fn


def mamba1_bdl():
    """(b, d, l) layout, time along the last dim, output stacked along it too."""
    def fn(x, dt, A, B, C, D, z, bias):
        b, d, L = x.shape
        h = x.new_zeros(b, d, A.shape[1], dtype=torch.float32)
        ys = []
        for t in range(L):
            delta = F.softplus(dt[:, :, t] + bias)
            h = torch.exp(delta[..., None] * A) * h + (delta * x[:, :, t])[..., None] * B[:, None, :, t]
            ys.append((h * C[:, None, :, t]).sum(-1) + D * x[:, :, t])
        return torch.stack(ys, dim=-1)
    return fn


def mamba1_h0():
    """Initial state passed in, final state returned."""
    def fn(x, dt, A, B, C, h0):
        ys = []
        h = h0
        for t in range(x.shape[1]):
            h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
        return torch.stack(ys, 1), h
    return fn


def mamba1_cast():
    """bf16 storage, fp32 math: .float() around every input, output cast back."""
    def fn(x, dt, A, B, C, D, z, bias):
        b, L, d = x.shape
        h = torch.zeros(b, d, A.shape[1], device=x.device)
        ys = []
        for t in range(L):
            delta = F.softplus(dt[:, t].float() + bias.float())
            h = torch.exp(delta.unsqueeze(-1) * A.float()) * h + \
                (delta * x[:, t].float()).unsqueeze(-1) * B[:, t].float().unsqueeze(1)
            y = (h * C[:, t].float().unsqueeze(1)).sum(-1) + D.float() * x[:, t].float()
            ys.append((y * F.silu(z[:, t].float())).to(x.dtype))
        return torch.stack(ys, 1)
    return fn


def mamba1_precomputed():
    """Discretization done for the whole sequence before the loop: dA, dBx of size (b, L, d, n)."""
    def fn(x, dt, A, B, C, D, z, bias):
        delta = F.softplus(dt + bias)
        dA = torch.exp(delta.unsqueeze(-1) * A)
        dBx = (delta * x).unsqueeze(-1) * B.unsqueeze(2)
        h = torch.zeros_like(dA[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dBx[:, t]
            ys.append((h * C[:, t, None, :]).sum(-1))
        y = torch.stack(ys, 1) + D * x
        return y * F.silu(z)
    return fn


def mamba1_scan():
    """The same recurrence through torch's scan higher-order op (captured as one node)."""
    def fn(x, dt, A, B, C, D, z, bias):
        delta = F.softplus(dt + bias)

        def combine(h, xs):
            x_t, d_t, B_t, C_t = xs
            h = torch.exp(d_t.unsqueeze(-1) * A) * h + (d_t * x_t).unsqueeze(-1) * B_t.unsqueeze(1)
            return h, (h * C_t.unsqueeze(1)).sum(-1)
        h0 = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype, device=x.device)
        hT, ys = scan(combine, h0, (x, delta, B, C), dim=1)
        if ys.shape[1] != x.shape[1]:       # torch < 2.13 stacks the outputs along dim 0
            ys = ys.movedim(0, 1)
        return ys + D * x, hT
    return fn


def mamba1_scan_as_loop():
    """What mamba1_scan computes, as a plain loop: an oracle independent of torch's scan."""
    def fn(x, dt, A, B, C, D, z, bias):
        delta = F.softplus(dt + bias)
        h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype, device=x.device)
        ys = []
        for t in range(x.shape[1]):
            h = torch.exp(delta[:, t].unsqueeze(-1) * A) * h + (delta[:, t] * x[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(1)
            ys.append((h * C[:, t].unsqueeze(1)).sum(-1))
        return torch.stack(ys, 1) + D * x, h
    return fn


# -- Mamba-2: decay shared per head, state (b, h, p, n) ------------------------------------------

def mamba1_expert(x, dt, A, B, C, D, bias):
    """One mixture-of-experts expert: Mamba-1's selective scan as the naive loop, fp32 state
    (fp64 for fp64 inputs). x, dt: (b, L, d); A: (d, n); B, C: (b, L, n)."""
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=sdt, device=x.device)
    ys = []
    for t in range(x.shape[1]):
        delta = F.softplus(dt[:, t] + bias)
        h = torch.exp(delta[..., None] * A) * h + (delta * x[:, t])[..., None] * B[:, t, None]
        ys.append((h * C[:, t, None]).sum(-1))
    return (torch.stack(ys, 1) + D * x).to(x.dtype)


def mamba2_inputs(b=2, L=8, H=2, P=4, N=3, dtype=torch.float32, seed=0, with_h0=False):
    g = _gen(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    x = r(b, L, H, P)
    dt = F.softplus(r(b, L, H))
    A = -torch.rand(H, generator=g) - 0.2
    B, C = r(b, L, N), r(b, L, N)
    D = r(H)
    ins = [x, dt, A, B, C, D]
    if with_h0:
        ins.append(r(b, H, P, N))
    return tuple(t.to(dtype) for t in ins)


def mamba2(form: str = "stack"):
    def fn(x, dt, A, B, C, D, *h0):
        b, L, H, P = x.shape
        h = h0[0] if h0 else x.new_zeros(b, H, P, B.shape[-1])
        ys = []
        for t in range(L):
            dA = torch.exp(dt[:, t] * A)                                   # (b, H): scalar per head
            h = dA[:, :, None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]
            y = torch.einsum("bhpn,bn->bhp", h, C[:, t]) + D[:, None] * x[:, t]
            ys.append(y)
        if form == "final":
            return torch.stack(ys, 1), h
        return torch.stack(ys, 1)
    return fn


# -- S4D: time-invariant decay --------------------------------------------------------------------

def s4d_inputs(b=2, L=8, d=4, n=3, dtype=torch.float32, seed=0):
    g = _gen(seed)
    x = torch.randn(b, L, d, generator=g)
    log_dt = torch.rand(d, generator=g) * -3
    A = -torch.rand(d, n, generator=g) - 0.1
    Bm, Cm = torch.randn(d, n, generator=g), torch.randn(d, n, generator=g)
    return tuple(t.to(dtype) for t in (x, log_dt, A, Bm, Cm))


def s4d():
    def fn(x, log_dt, A, Bm, Cm):
        dt = torch.exp(log_dt).unsqueeze(-1)
        dA = torch.exp(dt * A)                  # (d, n), the same at every step
        dB = (dA - 1) / A * Bm
        h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = dA * h + dB * x[:, t, :, None]
            ys.append(2 * (h * Cm).sum(-1))
        return torch.stack(ys, 1)
    return fn


# -- a gated linear recurrence of our own --------------------------------------------------------

def gated_inputs(b=2, L=8, d=5, dtype=torch.float32, seed=0):
    g = _gen(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in ((b, L, d), (b, L, d), (b, L, d), (d,)))


def gated():
    """minGRU-like: h = f*h + (1-f)*tanh(x), f = sigmoid(g + w); y = h * silu(z) / (1 + |h|)? no: linear readout."""
    def fn(x, gate, z, w):
        h = torch.zeros_like(x[:, 0])
        out = torch.empty_like(x)
        for t in range(x.shape[1]):
            f = torch.sigmoid(gate[:, t] + w)
            h = f * h + (1 - f) * torch.tanh(x[:, t])
            out[:, t] = h * F.silu(z[:, t]) + 0.5 * h
        return out
    return fn


# -- reverse-time loops and outputs read before the update ----------------------------------------

def reversed_loop(form: str):
    """A Mamba-1 step run from the last token to the first (the backward half of a bidirectional
    block), its outputs collected in several ways."""
    def fn(x, dt, A, B, C, D, z):
        b, L, d = x.shape
        h = torch.zeros(b, d, A.shape[1], dtype=x.dtype)
        ys = [None] * L
        out = torch.empty_like(x)
        order = []
        steps = reversed(range(L)) if form in ("append", "append_flip") else range(L - 1, -1, -1)
        for t in steps:
            dA = torch.exp(dt[:, t, :, None] * A)
            h = dA * h + dt[:, t, :, None] * B[:, t, None] * x[:, t, :, None]
            y = (h * C[:, t, None]).sum(-1)
            if form == "list":
                ys[t] = y
            elif form == "setitem":
                out[:, t] = y
            else:
                order.append(y)
        if form == "list":
            y = torch.stack(ys, 1)
        elif form == "setitem":
            y = out
        elif form == "append":                 # kept in loop order: last token first
            y = torch.stack(order, 1)
        else:
            y = torch.stack(order[::-1], 1)
        if form == "setitem":
            return y * F.silu(z) + D * x, h
        return y * F.silu(z) + D * x
    return fn


def output_before_update(form: str):
    """The textbook state-space form: y_k = C h_k + D u_k, then h_{k+1} = A h_k + B u_k; the
    output reads the state before the step's update."""
    def fn(x, A, B, C, D, h0):
        h = h0
        ys = []
        out = torch.empty_like(x)
        for t in range(x.shape[1]):
            if form == "einsum_setitem":
                out[:, t] = torch.einsum("bdn,bn->bd", h, C[:, t]) + D * x[:, t]
            else:
                ys.append((h * C[:, t, None]).sum(-1) + D * x[:, t])
            h = torch.exp(A) * h + B[:, t, None] * x[:, t, :, None]
        return (out if form == "einsum_setitem" else torch.stack(ys, 1)), h
    return fn


def output_before_update_inputs(b=2, L=7, d=3, n=4, seed=0):
    g = _gen(seed)
    return (torch.randn(b, L, d, generator=g), -torch.rand(d, n, generator=g),
            torch.randn(b, L, n, generator=g), torch.randn(b, L, n, generator=g),
            torch.randn(d, generator=g), torch.randn(b, d, n, generator=g))


# -- loops that are not linear recurrences --------------------------------------------------------

def nonlinear(kind: str):
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            if kind == "tanh":
                h = torch.tanh(a[:, t] * h + x[:, t])
            elif kind == "square":
                h = 0.5 * h * h + x[:, t]
            elif kind == "gate_from_h":
                h = torch.sigmoid(h) * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    return fn


def nonlinear_inputs(b=2, L=8, d=3, dtype=torch.float32, seed=0):
    g = _gen(seed)
    return (torch.randn(b, L, d, generator=g).to(dtype), torch.rand(b, L, d, generator=g).to(dtype))


def covariance(k, a, q):
    """h = a h + k k^T (mesa-net's h_kk): one input read along two state axes, read out by q."""
    h = torch.zeros(k.shape[0], k.shape[2], k.shape[2], device=k.device)
    ys = []
    for t in range(k.shape[1]):
        h = a[:, t, None, None] * h + k[:, t, :, None] * k[:, t, None, :]
        ys.append((h * q[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def ema(x, decay):
    """An exponential moving average with the decay a Python number (symbolic once it changes
    between calls)."""
    h, ys = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = decay * h + (1 - decay) * x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)
