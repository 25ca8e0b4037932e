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
    I = torch.eye(n, dtype=x.dtype)
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
