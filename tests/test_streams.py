"""Kernels run on their inputs' device and current stream (GPU)."""
import pytest
import torch

import programs as P
from conftest import reference, rel_err


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["triton", "cuda", "torch"])
def test_kernels_follow_the_current_stream(target):
    import ssmc
    fn = P.mamba1("stack")
    ins = [x.cuda() for x in P.mamba1_inputs(b=4, L=64, d=256, n=16, seed=71)]
    torch._dynamo.reset()
    f = torch.compile(fn, backend="ssmc", options={"target": target})
    f(*ins)
    assert ssmc.backend.LAST_REPORT.regions[0].target.startswith(target) or target == "torch"
    s = torch.cuda.Stream()
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        # slow work on s that the inputs depend on: a kernel launched on another stream would
        # read x before it is written
        for _ in range(8):
            big = big @ big / 64
        x = ins[0] + 0 * big[0, 0]
        out = f(x, *ins[1:])
    s.synchronize()
    ref = reference(fn, [t.cpu() for t in ins])[0]
    assert rel_err(out.cpu(), ref) < 1e-4
