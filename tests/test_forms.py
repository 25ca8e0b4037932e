"""Every capture form, every recurrence family: one region, equal to float64 eager."""
import pytest
import torch

import programs as P
from conftest import TOL, as_tuple, reference, rel_err, ssmc_run


def check(fn, inputs, n_regions=1, tol=None, **options):
    out, report = ssmc_run(fn, inputs, **options)
    assert len(report.regions) == n_regions, str(report)
    out = as_tuple(out)
    ref = reference(fn, inputs)
    dt = inputs[0].dtype
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        err = rel_err(o, r)
        assert err <= (tol or TOL[dt]), f"rel err {err:.3g}\n{report}"
    return report


@pytest.mark.parametrize("form", ["stack", "cat", "setitem", "unbind", "final"])
def test_mamba1_forms(form):
    check(P.mamba1(form), P.mamba1_inputs(seed=hash(form) % 1000))


@pytest.mark.parametrize("readout", ["sum", "einsum", "matmul"])
def test_mamba1_readouts(readout):
    check(P.mamba1("stack", readout), P.mamba1_inputs(seed=3))


def test_mamba1_bdl_layout():
    rep = check(P.mamba1_bdl(), P.mamba1_inputs(layout="bdl", seed=4))
    assert "t]" in rep.regions[0].region        # time is the last index of the inputs


def test_mamba1_initial_state_and_final_state():
    x, dt, A, B, C, *_ = P.mamba1_inputs(seed=5)
    h0 = torch.randn(x.shape[0], x.shape[2], A.shape[1])
    check(P.mamba1_h0(), (x, dt.abs(), A, B, C, h0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba1_casts(dtype):
    check(P.mamba1_cast(), P.mamba1_inputs(dtype=dtype, seed=6))


def test_mamba1_precomputed_discretization_is_fused():
    rep = check(P.mamba1_precomputed(), P.mamba1_inputs(seed=7))
    text = rep.regions[0].region
    # dA and dBx (b, L, d, n) are pulled into the kernel: the region loads dt, A, B, x, not dA
    assert "exp(" in text and "softplus(" in text, text


def test_scan_hop():
    rep = check(P.mamba1_scan(), P.mamba1_inputs(seed=8))
    assert "scan" in rep.regions[0].loop


@pytest.mark.parametrize("form", ["stack", "final"])
@pytest.mark.parametrize("h0", [False, True])
def test_mamba2(form, h0):
    rep = check(P.mamba2(form), P.mamba2_inputs(seed=9, with_h0=h0))
    assert rep.regions[0].strategy in ("chunked_ssd", "chunked_scan")
    assert "shared" in rep.regions[0].region


def test_s4d_lti():
    rep = check(P.s4d(), P.s4d_inputs(seed=10))
    assert "decay: lti" in rep.regions[0].region


def test_gated_recurrence():
    check(P.gated(), P.gated_inputs(seed=11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba1_dtypes(dtype):
    check(P.mamba1("stack"), P.mamba1_inputs(dtype=dtype, seed=12))


@pytest.mark.parametrize("kind", ["tanh", "square", "gate_from_h"])
def test_not_associative_falls_back(kind):
    fn = P.nonlinear(kind)
    ins = P.nonlinear_inputs(seed=13)
    out, report = ssmc_run(fn, ins)
    assert not report.regions
    reasons = " ".join(r for _, r in report.fallbacks)
    assert "detect_recurrence" in reasons, reasons
    assert torch.equal(out, fn(*ins))        # runs unchanged


def _assoc_scan_graph(combine):
    """A graph as Dynamo captures torch.associative_scan(combine, (a, b), dim=0) (pointwise mode
    needs CUDA to trace, so the CPU test builds the same graph by hand)."""
    import operator
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    root = torch.nn.Module()
    root.comb = fx.symbolic_trace(combine)
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    fn = g.get_attr("comb")
    n = g.call_function(torch.ops.higher_order.associative_scan, (fn, [a, b], []))
    out = g.call_function(operator.getitem, (n, 1))
    g.output((out,))
    gm = fx.GraphModule(root, g)
    xa, xb = torch.rand(7, 2, 3), torch.randn(7, 2, 3)
    a.meta["example_value"], b.meta["example_value"] = mode.from_tensor(xa), mode.from_tensor(xb)
    return gm, (xa, xb)


def test_associative_scan_hop():
    import ssmc
    gm, (xa, xb) = _assoc_scan_graph(lambda a1, b1, a2, b2: (a1 * a2, a2 * b1 + b2))
    rep = ssmc.Report()
    fn = ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert len(rep.regions) == 1 and "associative_scan" in rep.regions[0].loop
    (y,) = fn(xa, xb)
    h, ref = torch.zeros(2, 3), []
    for t in range(7):
        h = xa[t] * h + xb[t]
        ref.append(h)
    assert torch.allclose(y, torch.stack(ref), atol=1e-6)


def test_associative_scan_other_combine_is_left_alone():
    import ssmc
    gm, (xa, xb) = _assoc_scan_graph(lambda a1, b1, a2, b2: (a1 + a2, b1 + b2))
    rep = ssmc.Report()
    ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert not rep.regions
    assert any("not (a1*a2, a2*b1 + b2)" in why for _, why in rep.fallbacks)


def test_peeled_first_step_and_initial_value_in_the_stack():
    """The output buffer made in the first step, the initial state stacked before the steps:
    the irregular first step stays as written, the rest becomes the region."""
    def fn(x, a):
        h = x[:, 0] * 0
        hs = [h]
        out = None
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            if out is None:
                out = torch.empty(x.shape[0], x.shape[1], x.shape[2])
            out[:, t] = h * 2
            hs.append(h)
        return out, torch.stack(hs, 1)
    ins = (torch.randn(2, 7, 3), torch.rand(2, 7, 3))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1
    for o, r in zip(out, reference(fn, ins)):
        assert rel_err(o, r) < 1e-6


def test_setitem_into_a_buffer_passed_in():
    def fn(x, a, out):
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t] = h
        return out
    x, a = torch.randn(2, 6, 3), torch.rand(2, 6, 3)
    buf = torch.full((2, 6, 3), float("nan"))
    out, rep = ssmc_run(fn, (x, a, buf))
    assert len(rep.regions) == 1
    ref = fn(x.double(), a.double(), torch.empty(2, 6, 3, dtype=torch.float64))
    assert rel_err(buf, ref) < 1e-6 and out.data_ptr() == buf.data_ptr()
