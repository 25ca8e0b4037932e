"""CPU benchmarks for step 1 (the spine), results to benchmarks/results/cpu_spine.json.

1. The naive Mamba-1 loop (b2 d64 n16, L1024): eager loop vs the same code compiled with ssmc
   (its region runs on the torch reference executor), median wall time; accuracy against float64,
   also for large |dt*A| (decays underflowing to 0).
2. Compile cost at L2048: Dynamo's capture time vs ssmc's own work (everything after Dynamo
   hands over the graph), from the same compile.

    python -m benchmarks.cpu_bench            # ~5 minutes on a 2-core machine, mostly Dynamo
"""
from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path

import torch

import ssmc


def mamba1(x, dt, A, B, C, D):
    b, L, d = x.shape
    h = torch.zeros(b, d, A.shape[1], dtype=x.dtype)
    ys = []
    for t in range(L):
        dA = torch.exp(dt[:, t].unsqueeze(-1) * A)
        h = dA * h + (dt[:, t].unsqueeze(-1) * B[:, t].unsqueeze(1)) * x[:, t].unsqueeze(-1)
        ys.append((h * C[:, t].unsqueeze(1)).sum(-1))
    return torch.stack(ys, 1) + D * x


def inputs(b, L, d, n, dt_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, L, d, generator=g), torch.rand(b, L, d, generator=g) * dt_scale,
            -torch.rand(d, n, generator=g) * 2 - 0.5, torch.randn(b, L, n, generator=g),
            torch.randn(b, L, n, generator=g), torch.randn(d, generator=g))


def median_time(fn, reps=7):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def compile_with_report(fn, args):
    report = ssmc.Report()

    def backend(gm, ex):
        return ssmc.ssmc_backend(gm, ex, _report=report)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = torch.compile(fn, backend=backend)
    out = compiled(*args)
    total = time.perf_counter() - t0
    return compiled, out, report, total


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    torch.manual_seed(0)
    res = {"machine": platform.processor() or platform.machine(), "cpus": torch.get_num_threads(),
           "torch": torch.__version__, "ssmc": ssmc.__version__,
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()}
    b, d, n, L = 2, 64, 16, 1024
    args = inputs(b, L, d, n)
    compiled, out, report, total = compile_with_report(mamba1, args)
    assert len(report.regions) == 1, str(report)
    t_eager = median_time(lambda: mamba1(*args), reps=5)
    t_ssmc = median_time(lambda: compiled(*args), reps=7)
    ref = mamba1(*[a.double() for a in args])
    res["mamba1_b2_d64_n16_L1024"] = {
        "eager_ms": t_eager * 1e3, "ssmc_torch_reference_ms": t_ssmc * 1e3,
        "speedup": t_eager / t_ssmc, "rel_err_vs_float64": rel(out, ref),
        "rel_err_eager_fp32_vs_float64": rel(mamba1(*args), ref),
        "compile_total_s": total, "ssmc_compile_ms": report.graphs[0].compile_ms,
    }
    print(json.dumps(res["mamba1_b2_d64_n16_L1024"], indent=1), flush=True)
    # large |dt * A|: decays of exp(-100) and below underflow; nothing may become NaN/Inf
    big = inputs(b, L, d, n, dt_scale=60.0, seed=1)
    out_big = compiled(*big)
    ref_big = mamba1(*[a.double() for a in big])
    res["mamba1_large_dtA"] = {"max_abs_dtA": float((big[1].abs().max() * big[2].abs().max())),
                               "finite": bool(torch.isfinite(out_big).all()),
                               "rel_err_vs_float64": rel(out_big, ref_big)}
    print(json.dumps(res["mamba1_large_dtA"], indent=1), flush=True)
    # compile cost at L2048
    L2 = 2048
    args2 = inputs(b, L2, d, n)
    _, _, report2, total2 = compile_with_report(mamba1, args2)
    g = report2.graphs[0]
    ssmc_s = g.compile_ms / 1e3
    res["compile_L2048"] = {"fx_nodes": g.nodes_in, "first_call_total_s": total2,
                            "ssmc_s": ssmc_s, "dynamo_s": total2 - ssmc_s,
                            "ssmc_fraction_of_dynamo": ssmc_s / (total2 - ssmc_s),
                            "regions": len(g.regions),
                            "passes_ms": {p.name: p.ms for p in g.passes}}
    print(json.dumps(res["compile_L2048"], indent=1), flush=True)
    out_path = Path(__file__).parent / "results" / "cpu_spine.json"
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
