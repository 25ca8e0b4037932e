"""pytest-benchmark suite for what runs on CPU: capture and pass times against L, and the torch
reference executor. Part of the CI run, so compile-time regressions show in its output.

    python -m pytest benchmarks/test_bench_cpu.py --benchmark-only
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import programs as P  # noqa: E402
import ssmc  # noqa: E402
from ssmc.passes.base import PassContext  # noqa: E402
from ssmc.passes.pipeline import run_pipeline  # noqa: E402

_GRAPHS = {}


def captured_graph(L):
    """Dynamo's graph of the naive Mamba-1 loop at length L (captured once per L)."""
    if L not in _GRAPHS:
        holder = {}

        def grab(gm, ex):
            holder["gm"], holder["ex"] = gm, ex
            return gm.forward
        torch._dynamo.reset()
        torch.compile(P.mamba1("stack"), backend=grab)(*P.mamba1_inputs(L=L))
        _GRAPHS[L] = holder
    return _GRAPHS[L]


@pytest.mark.parametrize("L", [32, 64, 128])
def test_passes_time_vs_length(benchmark, L):
    g = captured_graph(L)
    opts = ssmc.make_options()

    def passes():
        ctx = PassContext(g["gm"], g["ex"], opts)
        run_pipeline(ctx)
        return ctx
    ctx = benchmark.pedantic(passes, rounds=3, iterations=1)
    assert len(ctx.live()) == 1
    benchmark.extra_info["fx_nodes"] = len(g["gm"].graph.nodes)


def test_capture_time_L64(benchmark):
    def capture():
        _GRAPHS.pop(64, None)
        return captured_graph(64)
    g = benchmark.pedantic(capture, rounds=1, iterations=1)
    assert len(g["gm"].graph.nodes) > 64


@pytest.mark.parametrize("L", [256, 1024])
def test_reference_executor(benchmark, L):
    from ssmc.targets.reference import ReferenceKernel
    _, rep = __import__("conftest").ssmc_run(P.mamba1("stack"), P.mamba1_inputs(L=8, d=64, n=16))
    region = rep.regions[0].ir
    ins = P.mamba1_inputs(L=L, d=64, n=16)
    by_name = dict(zip(["l_x_", "l_dt_", "l_a_", "l_b_", "l_c_", "l_d_", "l_z_", "l_bias_"], ins))
    xs = [by_name.get(s.name.split(" ")[0], torch.zeros(2, 64, 16)) for s in region.inputs]
    k = ReferenceKernel(region)
    out = benchmark(lambda: k.forward(xs))
    assert out[0].shape == (2, L, 64)
