"""The region's backward derived on the IR (ssmc.autodiff) equals autograd of the forward."""
import pytest
import torch

import fuzz_programs as FP
import programs as P
from conftest import ssmc_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ssmc.runtime.op import lookup
from ssmc.targets.reference import ReferenceKernel, adjoint_run


def region_and_inputs(fn, ins):
    """The region ssmc built for fn, and its own inputs captured at the op call."""
    seen = {}
    import ssmc.runtime.op as op
    orig = op.check_inputs

    def spy(entry, inputs):
        seen["inputs"] = [x.detach().clone() for x in inputs]
        return orig(entry, inputs)
    op.check_inputs = spy
    try:
        _, rep = ssmc_run(fn, ins)
    finally:
        op.check_inputs = orig
    return rep.regions[0].ir, seen["inputs"]


def compare(region, xs, chunk=4):
    xs = [x.double() if x.is_floating_point() else x for x in xs]
    k = ReferenceKernel(region, chunk)
    outs = k.forward(xs)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    got = adjoint_run(region, xs, grads, needs, chunk)
    ref = k.backward_autograd(xs, grads, needs)
    for i, (a, b) in enumerate(zip(got, ref)):
        if b is None:
            continue
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10), f"input {i} ({region.inputs[i].name})"


CASES = {
    "mamba1": (P.mamba1("stack"), lambda: P.mamba1_inputs(seed=61)),
    "mamba1_final": (P.mamba1("final"), lambda: P.mamba1_inputs(seed=62)),
    "mamba1_precomputed": (P.mamba1_precomputed(), lambda: P.mamba1_inputs(seed=63)),
    "mamba2_h0": (P.mamba2("final"), lambda: P.mamba2_inputs(seed=64, with_h0=True)),
    "s4d": (P.s4d(), lambda: P.s4d_inputs(seed=65)),
    "gated": (P.gated(), lambda: P.gated_inputs(seed=66)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_adjoint_equals_autograd(case):
    fn, make = CASES[case]
    region, xs = region_and_inputs(fn, make())
    compare(region, xs)


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(FP.programs(linear=True), st.integers(0, 1000))
def test_adjoint_on_random_programs(prog, seed):
    region, xs = region_and_inputs(prog.fn(), prog.make(seed))
    compare(region, xs, chunk=3)


def test_time_chunk_by_state_size(monkeypatch):
    """Chunk 0 (the default) sizes the executor's time chunks by the state: a small state runs
    its steps in few chunks, a large one in chunks of 64; a given chunk is kept. The outputs and
    gradients do not depend on the chunking."""
    import ssmc.targets.reference as R
    from ssmc.options import Options
    assert Options().chunk == 0
    assert R.time_chunk(5, 10, 100) == 5
    assert R.time_chunk(0, 10, 100) == 100
    assert R.time_chunk(0, 10, 3) == 64
    assert R.time_chunk(0, R.CHUNK_ELEMENTS // 256, 10_000) == 256
    assert R.time_chunk(0, R.CHUNK_ELEMENTS, 10_000) == 64
    region, xs = region_and_inputs(P.mamba1("stack"), P.mamba1_inputs(L=150, seed=68))
    xs = [x.double() if x.is_floating_point() else x for x in xs]
    monkeypatch.setattr(R, "CHUNK_ELEMENTS", 2 * 4 * 3 * 70)   # this state: 70 steps a chunk
    assert R.time_chunk(0, 2 * 4 * 3, 150) == 70
    want = R.ReferenceKernel(region, 150).forward(xs)
    for chunk in (0, 3):
        got = R.ReferenceKernel(region, chunk).forward(xs)
        assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, want))
    compare(region, xs, chunk=0)
