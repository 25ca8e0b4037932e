"""Naive loops with non-diagonal transitions, as users write them (tests and the benchmark)."""
import torch


def euler_matmul(x, dt, A, mask, B, C):
    """x, dt: (b, L, d); A, mask: (n, n); B, C: (b, L, n). h = h + dt * (h @ (A*mask).T) + B x."""
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[0])
    W = (A * mask).T
    ys = []
    for t in range(x.shape[1]):
        h = h + dt[:, t, :, None] * (h @ W) + B[:, t, None] * x[:, t, :, None]
        ys.append((h * C[:, t, None]).sum(-1))
    return torch.stack(ys, 1)


def lti_matmul(x, A, mask, B, C):
    """Time-invariant: h = h @ (A * mask).T * 0.5 + B x, mask applied inside the loop."""
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = h @ (A * mask).T * 0.5 + B[:, t, None] * x[:, t, :, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]))
    return torch.stack(ys, 1)


def euler_einsum(x, dt, A, mask, B, C):
    """x, dt: (b, L); state (b, n); Abar = I + dt_t * (A * mask) per step; einsum("bij,bj->bi", Abar, h)."""
    n = A.shape[0]
    I = torch.eye(n, dtype=x.dtype, device=x.device)
    h = x.new_zeros(x.shape[0], n)
    ys = []
    for t in range(x.shape[1]):
        Abar = I + dt[:, t, None, None] * (A * mask)
        h = torch.einsum("bij,bj->bi", Abar, h) + B[:, t] * x[:, t, None]
        ys.append((h * C[:, t]).sum(-1))
    return torch.stack(ys, 1), h


def given_abar(x, Abar, B, C):
    """A given per-step transition Abar: (b, L, n, n); x: (b, L); state (b, n)."""
    h = x.new_zeros(x.shape[0], Abar.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        h = torch.einsum("bij,bj->bi", Abar[:, t], h) + B[:, t] * x[:, t, None]
        ys.append((h * C[:, t]).sum(-1))
    return torch.stack(ys, 1)


def rotary(x, theta, decay, B, C):
    """Mamba-3 style rotary state: pairs of state channels rotated by a data-dependent angle.
    x: (b, L, d); theta, decay: (b, L, d, m); B, C: (b, L, m); state (b, d, m, 2)."""
    b, L, d = x.shape
    m = theta.shape[-1]
    h = x.new_zeros(b, d, m, 2)
    ys = []
    for t in range(L):
        c, s = torch.cos(theta[:, t]), torch.sin(theta[:, t])
        R = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)   # (b, d, m, 2, 2)
        u = (B[:, t, None, :] * x[:, t, :, None])[..., None]                    # (b, d, m, 1)
        h = decay[:, t, ..., None] * torch.einsum("bdmij,bdmj->bdmi", R, h) + u
        ys.append((h.sum(-1) * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1)


def block_mask(nb: int, bs: int, density: float, gen) -> torch.Tensor:
    """A 0/1 mask of nb x nb blocks of bs x bs with round(density * nb^2) nonzero blocks."""
    k = max(1, round(density * nb * nb))
    blocks = torch.zeros(nb * nb)
    blocks[torch.randperm(nb * nb, generator=gen)[:k]] = 1
    return blocks.reshape(nb, nb).repeat_interleave(bs, 0).repeat_interleave(bs, 1)


def euler_inputs(b, L, d, n, mask, gen, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=gen)
    A = r(n, n) / n ** 0.5
    dt = torch.rand(b, L, d, generator=gen) * 0.2
    return tuple(t.to(dtype) for t in (r(b, L, d), dt, A, mask, r(b, L, n), r(b, L, n)))


# -- complex diagonal decays (LRU-style): the state is complex; ssmc carries it as real pairs -----

def lru(x, nu_log, theta_log, gamma, B_re, B_im, C):
    """The LRU recurrence as written with complex tensors: a time-invariant complex decay
    lam = exp(-exp(nu_log) + i exp(theta_log)) per channel; x: (b, L, n); B_re, B_im: (d, n);
    C: (d,) complex. Returns the per-channel readout Re(h * C) and the final complex state."""
    lam = torch.exp(-torch.exp(nu_log) + 1j * torch.exp(theta_log))
    h = torch.zeros(x.shape[0], nu_log.shape[0], dtype=lam.dtype, device=x.device)
    ys = []
    for t in range(x.shape[1]):
        h = lam * h + gamma * (x[:, t] @ B_re.T + 1j * (x[:, t] @ B_im.T))
        ys.append((h * C).real)
    return torch.stack(ys, 1), h


def lru_input_dependent(x, dt, nu_log, theta, B, C):
    """A per-step, input-dependent complex decay lam_t = exp(dt_t * (-exp(nu_log) + i theta)),
    normalised drive; x, dt: (b, L); B, C: (d,) complex; readout summed over channels."""
    h = torch.zeros(x.shape[0], nu_log.shape[0], dtype=B.dtype, device=x.device)
    ys = []
    for t in range(x.shape[1]):
        lam = torch.exp(dt[:, t, None] * (-torch.exp(nu_log) + 1j * theta))
        h = lam * h + torch.sqrt(1 - lam.abs() ** 2) * (B * x[:, t, None])
        ys.append(torch.real(h * C).sum(-1))
    return torch.stack(ys, 1)


def lru_given_lambda(x, lam, B, h0):
    """A given complex decay per step lam: (b, L, d) complex, an initial state h0 (b, d)
    complex; the states themselves are the output (complex)."""
    h = h0
    ys = []
    for t in range(x.shape[1]):
        h = h * lam[:, t] + B * x[:, t, None]
        ys.append(h)
    return torch.stack(ys, 1)


def lru_readouts(x, lam, B, C, Cm):
    """Readouts of a complex state: matrix products (h @ Cm.T).real and torch.real(h @ C),
    .abs(), .imag and angle, torch.view_as_real; lam (d,), B, C (d,) complex, Cm (k, d) complex."""
    h = torch.zeros(x.shape[0], lam.shape[0], dtype=lam.dtype, device=x.device)
    y1, y2, y3, y4, y5 = [], [], [], [], []
    for t in range(x.shape[1]):
        h = lam * h + torch.complex(x[:, t, None] * B.real, x[:, t, None] * B.imag)
        y1.append((h @ Cm.T).real)
        y2.append(h.abs() * C.real)
        y3.append(h.imag - 0.5 * torch.angle(h * C))
        y4.append(torch.view_as_real(h))
        y5.append(torch.real(h @ C))
    return torch.stack(y1, 1), torch.stack(y2, 1), torch.stack(y3, 1), torch.stack(y4, 1), torch.stack(y5, 1)


def lru_conj(x, r, theta, B):
    """The state conjugated in the update and a division by the decay: still linear over the
    reals. lam = polar(r, theta)."""
    lam = torch.polar(r, theta)
    h = torch.zeros(x.shape[0], r.shape[0], dtype=torch.complex64, device=x.device)
    ys = []
    for t in range(x.shape[1]):
        h = lam * h.conj() - B * x[:, t, None] / lam
        ys.append(h.imag)
    return torch.stack(ys, 1)


def complex_nonlinear(kind):
    """Complex recurrences that are not linear in the state: ssmc must decline them."""
    def fn(x, lam, B):
        h = torch.zeros(x.shape[0], lam.shape[0], dtype=lam.dtype, device=x.device)
        ys = []
        for t in range(x.shape[1]):
            u = B * x[:, t, None]
            if kind == "tanh":
                h = lam * torch.tanh(h) + u
            elif kind == "abs":
                h = lam * h * h.abs() + u
            elif kind == "square":
                h = lam * h * h + u
            else:                                   # "real": the real part fed back
                h = lam * h + 0.1 * h.real + u
            ys.append(h.real)
        return torch.stack(ys, 1)
    fn.__name__ = f"complex_{kind}"
    return fn


def lru_inputs(b, L, d, n, gen, dtype=torch.complex64):
    r = lambda *s: torch.randn(*s, generator=gen)
    real = torch.float64 if dtype == torch.complex128 else torch.float32
    nu_log = torch.log(-0.5 * torch.log(torch.rand(d, generator=gen) * 0.5 + 0.45))   # |lam| in (0.45, 0.95)
    theta_log = torch.log(torch.rand(d, generator=gen) * 3.0 + 0.05)
    gamma = torch.sqrt(1 - torch.exp(-2 * torch.exp(nu_log)))
    return (r(b, L, n).to(real), nu_log.to(real), theta_log.to(real), gamma.to(real),
            (r(d, n) / n ** 0.5).to(real), (r(d, n) / n ** 0.5).to(real), torch.randn(d, generator=gen, dtype=dtype))
