"""The recurrences of tests/test_zoo.py (written as others write them) on the GPU: ssmc against
the same loop in eager PyTorch, in one run. Writes JSON as it goes.

    python -m benchmarks.bench_zoo --out zoo.json [--shape b,L,d,n] [--only rg_lru,qrnn]

Without a GPU it runs on the CPU (perf_counter medians; a smoke run at a tiny --shape).

Each program is first checked against float64 eager at a small shape (b2 L64, fresh inputs,
outputs compared), then timed at the full shape (fp32 inputs; default b8 L1024 d256 n16) with
triton.testing.do_bench (median): the compiled function (target auto, forward) and the eager
loop. Declined programs (they run as written) are timed too: their ratio shows the cost of
running them through ssmc. A row that fails is recorded with its error.
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import ssmc  # noqa: E402
import test_zoo as Z  # noqa: E402
from benchmarks.bench_block_sparse import timer  # noqa: E402
from benchmarks.bench_gpu import env_info, rel  # noqa: E402


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8,1024,256,16", help="b,L,d,n")
    ap.add_argument("--only", default="", help="comma-separated program names (default: all)")
    a = ap.parse_args(argv)
    b, L, d, n = map(int, a.shape.split(","))
    full, small = dict(b=b, L=L, d=d, n=n), dict(b=2, L=64, d=min(d, 32), n=min(n, 8))
    names = [x for x in a.only.split(",") if x] or sorted(Z.ZOO)
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    bench = timer(torch.device(dev))      # do_bench medians on a GPU, perf_counter medians on the CPU
    res = {"env": env_info() if gpu else {"device": "cpu", "torch": torch.__version__},
           "shape": full, "check_shape": small, "rows": []}
    for name in names:
        fn, expect = Z.ZOO[name]
        row = {"program": name, "expected": list(expect) if isinstance(expect, tuple) else f"declined: {expect}"}
        try:
            torch._dynamo.reset()
            report = ssmc.Report()
            compiled = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=report))
            ins = [x.to(dev) for x in Z._inputs(name, small, torch.Generator().manual_seed(11))]
            ref = _first(fn(*[x.double() if x.is_floating_point() else x for x in ins]))
            row["rel_err_vs_float64"] = rel(_first(compiled(*ins)), ref)
            row["regions"] = [f"{r.strategy}/{r.target}" for r in report.regions]
            row["fallbacks"] = [w for _, w in report.fallbacks]
            ins = [x.to(dev) for x in Z._inputs(name, full, torch.Generator().manual_seed(12))]
            compiled(*ins)
            row["ssmc_ms"] = bench(lambda: compiled(*ins))
            row["eager_ms"] = bench(lambda: fn(*ins))
            row["speedup"] = row["eager_ms"] / row["ssmc_ms"]
            print(f"{name:18s} ssmc {row['ssmc_ms']:8.3f} ms  eager {row['eager_ms']:9.2f} ms  "
                  f"{row['speedup']:7.1f}x  err {row['rel_err_vs_float64']:.2e}  {row['regions']}", flush=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        res["rows"].append(row)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
