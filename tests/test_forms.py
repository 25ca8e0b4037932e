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
