"""A Mamba-1 selective scan whose recurrence is a parallel scan written out in torch ops
(tests/test_written_scan.py: `sweep` is the in-place up/down sweep on views that mamba.py's
pscan uses, `doubling_cat` and `doubling_pad` scans by doubling): ssmc against the same function
in eager PyTorch and under Inductor, in one run. Writes JSON.

    python -m benchmarks.bench_written_scan --out ws.json [--shape b,L,d,n] [--scans sweep,...]
        [--dtype bfloat16] [--no-inductor]

Each (shape, scan) is first checked against the plain loop in float64 at L 256 (fresh inputs:
the compiled function against it, and the eager one), then timed with triton.testing.do_bench
(median): forward, and forward + backward (gradients of all six inputs). Without a GPU it runs
on the CPU (perf_counter medians; use a tiny --shape).
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import ssmc  # noqa: E402
from test_written_scan import SCANS, inputs, loop_mixer, mixer  # noqa: E402
from benchmarks.bench_block_sparse import timer  # noqa: E402
from benchmarks.bench_parallel_form import ratios, record  # noqa: E402
from benchmarks.bench_gpu import env_info  # noqa: E402


def _err(got, want) -> float:
    return float((got.detach().double() - want).abs().max() / want.abs().max())


def _compiled(fn, report=None):
    torch._dynamo.reset()
    if report is None:
        return torch.compile(fn)
    return torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=report))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", action="append", help="b,L,d,n (repeatable)")
    ap.add_argument("--scans", default=",".join(SCANS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-inductor", action="store_true")
    a = ap.parse_args(argv)
    shapes = [tuple(map(int, s.split(","))) for s in (a.shape or ["8,2048,1536,16"])]
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    bench = timer(torch.device(dev))
    dtype = getattr(torch, a.dtype)
    res = {"env": env_info() if gpu else {"device": "cpu", "torch": torch.__version__}, "rows": []}
    for b, L, d, n in shapes:
        for name in a.scans.split(","):
            row = {"shape": dict(b=b, L=L, d=d, n=n), "scan": name, "dtype": a.dtype}
            fn = mixer(SCANS[name])
            try:
                # correctness first, at L 256 (the eager loop in float64 is the reference)
                chk = [t.to(dev, dtype) for t in inputs(b=b, L=min(L, 256), d=d, n=n, seed=L + 1, dtype=torch.float32)]
                want = loop_mixer(*[t.double() for t in chk])
                report = ssmc.Report()
                row["rel_err"] = _err(_compiled(fn, report)(*chk), want)
                row["eager_rel_err"] = _err(fn(*chk), want)
                row["regions"] = len(report.regions)
                row["strategies"] = [r.strategy for r in report.regions]
                row["targets"] = [r.target for r in report.regions]
                del chk, want
                ins = [t.to(dev, dtype).requires_grad_() for t in inputs(b=b, L=L, d=d, n=n, seed=L, dtype=torch.float32)]
                ours = _compiled(fn, ssmc.Report())
                y = ours(*ins)
                gy = torch.randn_like(y)

                def train(f):
                    return lambda: torch.autograd.grad(f(*ins), ins, gy)
                row["ms_fwd"] = {"ssmc": bench(lambda: ours(*ins)), "eager": bench(lambda: fn(*ins))}
                row["ms_fwd_bwd"] = {"ssmc": bench(train(ours)), "eager": bench(train(fn))}
                if not a.no_inductor:
                    ind = _compiled(fn)
                    row["ms_fwd"]["inductor"] = bench(lambda: ind(*ins))
                    row["ms_fwd_bwd"]["inductor"] = bench(train(ind))
                ratios(row)
            except Exception as e:      # noqa: BLE001 - recorded, the next row goes on
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc()[-2000:]
            record(row, res, a.out, gpu)


if __name__ == "__main__":
    main()
