"""A chunked SSD written without a loop (tests/test_parallel_form.py's `chunked_ssd`, the form
of HF transformers' Mamba2 torch path) on the GPU: ssmc against the same function in eager
PyTorch and under Inductor, in one run. Writes JSON.

    python -m benchmarks.bench_parallel_form --out pform.json [--shape b,L,h,p,n,chunk]
        [--dtype bfloat16] [--profile]

Each shape is first checked against the float64 function (fresh inputs; outputs and final
states compared), then timed with triton.testing.do_bench (median): forward, and forward + backward.
Without a GPU it runs on the CPU (perf_counter medians; use a tiny --shape). --dtype gives
the inputs' dtype (errors against float64 of the same rounded inputs); --profile adds one
ssmc forward+backward under torch.profiler to each row (wall time, then its top ops).
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
from test_parallel_form import chunked_ssd, inputs  # noqa: E402
from benchmarks.bench_block_sparse import profiled, timer  # noqa: E402
from benchmarks.bench_gpu import env_info  # noqa: E402


def _err(got, want) -> float:
    return float((got.detach().double() - want).abs().max() / want.abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", action="append", help="b,L,h,p,n,chunk (repeatable)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--profile", action="store_true", help="one ssmc forward+backward under torch.profiler")
    a = ap.parse_args(argv)
    shapes = [tuple(map(int, s.split(","))) for s in (a.shape or ["4,2048,24,64,128,256", "2,4096,32,64,128,256"])]
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    bench = timer(torch.device(dev))
    res = {"env": env_info() if gpu else {"device": "cpu", "torch": torch.__version__}, "rows": []}
    for b, L, h, p, n, cs in shapes:
        row = {"shape": dict(b=b, L=L, h=h, p=p, n=n, chunk=cs), "dtype": a.dtype}
        dtype = getattr(torch, a.dtype)
        fn = lambda x, a, B, C, cs=cs: chunked_ssd(x, a, B, C, cs, final=True)     # noqa: E731
        try:
            torch._dynamo.reset()
            report = ssmc.Report()
            ours = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=report))
            ins = [t.to(dev, dtype).requires_grad_() for t in inputs(b=b, L=L, h=h, p=p, n=n, seed=L)]
            ins64 = [t.detach().double() for t in ins]          # the reference sees the rounded inputs
            want_y, want_h = fn(*ins64)
            y, hT = ours(*ins)
            row["regions"] = len(report.regions)
            row["strategies"] = [r.strategy for r in report.regions]
            row["rel_err_y"], row["rel_err_state"] = _err(y, want_y), _err(hT, want_h)
            eager_y, _ = fn(*ins)
            row["eager_rel_err_y"] = _err(eager_y, want_y)
            del want_y, want_h, eager_y
            row["ms_fwd"] = {"ssmc": bench(lambda: ours(*ins)), "eager": bench(lambda: fn(*ins))}
            gy, gh = torch.randn_like(y), torch.randn_like(hT)

            def train(f):
                return lambda: torch.autograd.grad([*f(*ins)], ins, [gy, gh])

            row["ms_fwd_bwd"] = {"ssmc": bench(train(ours)), "eager": bench(train(fn))}
            if a.profile:
                row["profile_fwd_bwd"] = profiled(train(ours), torch.device(dev))
            if not a.no_inductor:
                torch._dynamo.reset()
                ind = torch.compile(fn)
                yi, _ = ind(*ins)
                row["inductor_rel_err_y"] = _err(yi, fn(*ins64)[0])
                row["ms_fwd"]["inductor"] = bench(lambda: ind(*ins))
                row["ms_fwd_bwd"]["inductor"] = bench(train(ind))
            ratios(row)
        except Exception as e:      # noqa: BLE001 - recorded, the next shape goes on
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        record(row, res, a.out, gpu)


def ratios(row: dict) -> None:
    """Each baseline's time over ssmc's, forward and forward + backward."""
    for k in ("ms_fwd", "ms_fwd_bwd"):
        t = row[k]
        row[k + "_ratio"] = {o: t[o] / t["ssmc"] for o in t if o != "ssmc"}


def record(row: dict, res: dict, out: str, gpu: bool) -> None:
    """Print the row, add it to the results and write them all (a later failure loses nothing)."""
    print(json.dumps(row), flush=True)
    res["rows"].append(row)
    Path(out).write_text(json.dumps(res, indent=1))
    if gpu:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
