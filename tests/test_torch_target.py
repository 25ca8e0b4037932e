"""The torch target's kernels (the CPU's, and `target="torch"` anywhere): a region with an SSD
plan (the state a (p, n) matrix per program, the readout a sum over n: linear attention, simple
GLA, Mamba-2) runs the chunked SSD's matmul form of ssd_autograd.py, a decay along n too (GLA's
per-key decay); the rest, and 16-bit inputs, the reference executor's scan. Values and gradients
against float64 eager, chunks that do not divide the length, an initial state."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import as_tuple, grads_match, reference, rel_err, ssmc_run
from ssmc.explain import refresh

MATMUL_FORM = "chunked SSD's matmul form"


def _simple_gla(q, k, v, g):                      # (b, h, L, d); g (b, h, L): a log decay per head
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None] + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2), S


def _gla(q, k, v, g):                             # g (b, h, L, dk): a log decay per key channel
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp() + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(out, 2), S


def _gla_from(S, q, k, v, g):                     # the same from a given state
    out = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp() + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 2), S


def _inputs(seed, per_key: bool, b=2, h=2, L=11, dk=4, dv=5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)          # noqa: E731
    g = F.logsigmoid(r(b, h, L, dk) if per_key else r(b, h, L))
    return r(b, h, L, dk), r(b, h, L, dk), r(b, h, L, dv), g


def _check(fn, ins, **options):
    out, rep = ssmc_run(fn, ins, target="torch", **options)
    refresh(rep)                                            # the kernels' notes, after the run
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    assert any(MATMUL_FORM in n for n in rep.regions[0].notes), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5
    return rep


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("fn,per_key", [(_simple_gla, False), (_gla, True)], ids=["simple_gla", "gla"])
def test_matrix_states_run_the_matmul_form(fn, per_key, chunk):
    """chunk 4 over 11 steps: two whole chunks and a padded one."""
    ins = _inputs(5, per_key)
    rep = _check(fn, ins, chunk=chunk)
    assert f"chunks of {chunk or (16 if per_key else 64)} steps" in " ".join(rep.regions[0].notes)
    grads_match(fn, ins)


def test_an_initial_state_and_a_decay_per_key():
    q, k, v, g = _inputs(6, True)
    S0 = torch.randn(q.shape[0], q.shape[1], q.shape[3], v.shape[3], generator=torch.Generator().manual_seed(7))
    ins = (S0, q, k, v, g)
    _check(_gla_from, ins, chunk=3)
    grads_match(_gla_from, ins)


def test_a_decay_along_n_equal_to_a_shared_one_gives_the_same_core():
    """_torch_core's per-n path (scores summed over a (Q, Q, n) product) against its shared-decay
    path (one matmul) on the same numbers: u (P, L, 1) and the same u expanded to (P, L, n)."""
    from ssmc.targets.ssd_autograd import _torch_core
    gen = torch.Generator().manual_seed(8)
    P, L, p, n = 3, 10, 4, 6
    u = F.logsigmoid(torch.randn(P, L, 1, generator=gen))
    w, x = torch.rand(P, L, 1, generator=gen), torch.randn(P, L, p, generator=gen)
    g, c, h0 = torch.randn(P, L, n, generator=gen), torch.randn(P, L, n, generator=gen), torch.randn(P, p, n, generator=gen)
    mm = torch.matmul
    y1, h1 = _torch_core(u, w, x, g, c, h0, 4, mm)
    y2, h2 = _torch_core(u.expand(P, L, n), w, x, g, c, h0, 4, mm)
    assert rel_err(y2, y1) < 1e-6 and rel_err(h2, h1) < 1e-6
    # and both against the recurrence itself
    h, ys = h0, []
    for t in range(L):
        h = u[:, t].exp()[..., None] * h + w[:, t, :, None] * x[:, t, :, None] * g[:, t, None, :]
        ys.append((h * c[:, t, None, :]).sum(-1))
    assert rel_err(y1, torch.stack(ys, 1)) < 1e-5 and rel_err(h1, h) < 1e-5


def test_16_bit_inputs_stay_on_the_reference_scan():
    """The matmul form would multiply 16-bit operands in 16 bits; the reference computes in fp32."""
    ins = tuple(x.to(torch.bfloat16) for x in _inputs(9, False))
    out, rep = ssmc_run(_simple_gla, ins, target="torch")
    refresh(rep)
    assert len(rep.regions) == 1 and not any(MATMUL_FORM in n for n in rep.regions[0].notes), str(rep)
    for o, r in zip(as_tuple(out), reference(_simple_gla, ins)):
        assert rel_err(o, r) < 2e-2


def test_a_call_too_large_for_the_matmul_form_runs_the_reference_scan(monkeypatch):
    """The matmul form holds every chunk's state and scores at once; past TORCH_SSD_ELEMENTS a
    call runs the reference scan (bounded chunks), with the reason in the kernel's note."""
    from ssmc.targets import ssd_autograd
    monkeypatch.setattr(ssd_autograd, "TORCH_SSD_ELEMENTS", 100)
    ins = _inputs(10, True)
    out, rep = ssmc_run(_gla, ins, target="torch")
    refresh(rep)
    assert "ran the reference scan: the matmul form's tensors" in " ".join(rep.regions[0].notes), str(rep)
    for o, r in zip(as_tuple(out), reference(_gla, ins)):
        assert rel_err(o, r) < 1e-5
    grads_match(_gla, ins)
