"""Gradients through a region equal eager autograd of the naive loop (float64 reference)."""
import pytest
import torch

import programs as P
from conftest import as_tuple, rel_err, ssmc_run


def grads_of(fn, inputs, cots, compiled: bool):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    if compiled:
        out, report = ssmc_run(fn, xs)
        assert len(report.regions) == 1, str(report)
    else:
        out = fn(*xs)
    loss = sum((o.double() * c).sum() for o, c in zip(as_tuple(out), cots))
    return torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True)


CASES = {
    "mamba1": (P.mamba1("stack"), lambda: P.mamba1_inputs(seed=21)),
    "mamba1_final_state": (P.mamba1("final"), lambda: P.mamba1_inputs(seed=22)),
    "mamba1_h0": (P.mamba1_h0(), lambda: (*P.mamba1_inputs(seed=23)[:5], torch.randn(2, 4, 3))),
    "mamba1_precomputed": (P.mamba1_precomputed(), lambda: P.mamba1_inputs(seed=24)),
    "mamba2_h0": (P.mamba2("final"), lambda: P.mamba2_inputs(seed=25, with_h0=True)),
    "s4d": (P.s4d(), lambda: P.s4d_inputs(seed=26)),
    "gated": (P.gated(), lambda: P.gated_inputs(seed=27)),
    "scan": (P.mamba1_scan(), lambda: P.mamba1_inputs(seed=28)),
    "reverse_time": (P.reversed_loop("setitem"), lambda: P.mamba1_inputs(seed=29)[:7]),
    "output_before_update": (P.output_before_update("stack"), lambda: P.output_before_update_inputs(seed=30)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_eager(case):
    fn, make = CASES[case]
    inputs = make()
    if case in ("mamba1_h0", "reverse_time"):
        inputs = (inputs[0], inputs[1].abs(), *inputs[2:])
    outs = as_tuple(fn(*inputs))
    g = torch.Generator().manual_seed(99)
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    got = grads_of(fn, inputs, cots, compiled=True)
    oracle = P.mamba1_scan_as_loop() if case == "scan" else fn     # not torch's own scan autograd
    ref = grads_of(oracle, [x.double() for x in inputs], cots, compiled=False)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if b is None:
            assert a is None or a.abs().max() == 0
            continue
        assert a is not None, f"input {i} got no gradient"
        assert rel_err(a, b) < 1e-4, f"input {i}: rel err {rel_err(a, b):.3g}"


def _one_region_values_and_grads(fn, ins):
    """fn through ssmc: one region, values and every input's gradient equal float64 eager's."""
    xs = [x.clone().requires_grad_() for x in ins]
    out, rep = ssmc_run(fn, xs)
    assert len(rep.regions) == 1, str(rep)
    x64 = [x.double().requires_grad_() for x in ins]
    ref = fn(*x64)
    assert rel_err(out, ref) < 1e-6
    got = torch.autograd.grad(out.sum(), xs)
    want = torch.autograd.grad(ref.sum(), x64)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(got, want)), [rel_err(a, b) for a, b in zip(got, want)]
    return rep


def _drive_with_a_sum(x, k):
    """The drive sums inputs over the state's dim and uses the sum at every element of it
    (k_i * sum_j k_j x_j): each element's use is a copy, so the sum's adjoint is summed over i."""
    h = x.new_zeros(x.shape[0], x.shape[2])
    ys = []
    for t in range(x.shape[1]):
        h = 0.9 * h + k[:, t] * (k[:, t] * x[:, t]).sum(-1, keepdim=True)
        ys.append((h * x[:, t]).sum(-1))
    return torch.stack(ys, 1)


def test_a_sum_of_inputs_inside_the_drive():
    g = torch.Generator().manual_seed(3)
    rep = _one_region_values_and_grads(_drive_with_a_sum, [torch.randn(2, 5, 4, generator=g) for _ in range(2)])
    assert any("sum(" in line and "b = " in line for line in str(rep.regions[0].ir).splitlines()), str(rep)


def _input_inside_and_outside_the_readout(x, u):
    """u (b, L, 1) broadcast along the state: read inside the readout's sum and outside it; the
    use outside is one per output element, not one per state element."""
    h = x.new_zeros(x.shape[0], 3)
    ys = []
    for t in range(x.shape[1]):
        h = torch.sigmoid(x[:, t]) * h + torch.sqrt(1.0 + u[:, t] * u[:, t])
        ys.append(h)
    hs = torch.stack(ys, 1)
    return (hs * u).sum(-1, keepdim=True) + u


def test_an_input_read_inside_and_outside_a_sum():
    g = torch.Generator().manual_seed(4)
    _one_region_values_and_grads(_input_inside_and_outside_the_readout,
                                 [torch.randn(2, 5, 1, generator=g) for _ in range(2)])


def test_outputs_free_of_the_trained_inputs_need_no_gradient():
    """Only the readout C trains: the final state depends on no input that needs a gradient, so
    it comes back without one, as eager's; carried into the next segment without `.detach()`
    (eager needs none), the next backward ran into the first segment's freed graph."""
    def f(x, dt, A, B, C, h0):
        h, ys = h0, []
        for t in range(x.shape[1]):
            h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None] * x[:, t, :, None]
            ys.append((h * C[:, t, None]).sum(-1))
        return torch.stack(ys, 1), h
    g = torch.Generator().manual_seed(0)
    b, L, d, n = 2, 5, 3, 2
    dt, A, B = torch.rand(b, L, d, generator=g), -torch.rand(d, n, generator=g) - 0.1, torch.randn(b, L, n, generator=g)
    segs = [torch.randn(b, L, d, generator=g) for _ in range(3)]
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(f, backend="ssmc") if compiled else f
        C = torch.randn(b, L, n, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = torch.zeros(b, d, n)
        for x in segs:
            y, h = fn(x, dt, A, B, C, h)
            assert y.requires_grad and not h.requires_grad
            y.pow(2).sum().backward()
        grads.append(C.grad)
    assert rel_err(grads[1], grads[0]) < 1e-5
