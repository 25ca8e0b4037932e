"""A Mamba-1 mixer written around torch's associative_scan, as HF transformers' Mamba writes it
when compiled on a GPU (tests/test_forms.py `_mixer_scan`): discretise for the whole sequence,
`_, states = associative_scan(combine, (dA, dBx), dim=2, combine_mode="pointwise")`, read
out with a matmul, return the last state.

Rows, same run, same inputs: ssmc; ssmc without `sink_consumers` (the states (b, d, L, n) are
written and the matmul reads them after the region); Inductor (torch's own pointwise scan).
Each is checked against a float64 sequential loop at a small shape first (fresh inputs), then
timed at the full shape with triton.testing.do_bench (median).

    python -m benchmarks.bench_scan_mixer --out results.json [--shape b,d,n,L]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import ssmc  # noqa: E402
from benchmarks.bench_gpu import bench, env_info, rel  # noqa: E402
from test_forms import _mixer_scan  # noqa: E402


def inputs(b, d, n, L, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)    # noqa: E731
    return (r(b, d, L), torch.rand(b, d, L, device="cuda", generator=g) * 0.1, -torch.exp(r(d, n) * 0.5),
            r(b, n, L), r(b, n, L))


def loop64(x, dt, A, B, C):
    x, dt, A, B, C = (v.double() for v in (x, dt, A, B, C))
    h = torch.zeros(x.shape[0], x.shape[1], A.shape[1], dtype=torch.float64, device=x.device)
    ys = []
    for t in range(x.shape[2]):
        h = torch.exp(A * dt[:, :, t, None]) * h + dt[:, :, t, None] * B[:, None, :, t] * x[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1), h


def compiled(kind):
    fn = _mixer_scan("pointwise")
    torch._dynamo.reset()
    if kind == "inductor":
        return torch.compile(fn), None
    rep = ssmc.Report()
    opts = {} if kind == "ssmc" else {"disable_passes": ["sink_consumers"]}
    return torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, options=opts, _report=rep)), rep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8,1536,16,2048")
    ap.add_argument("--rows", default="ssmc,ssmc_no_sink,inductor")
    args = ap.parse_args()
    b, d, n, L = map(int, args.shape.split(","))
    res = {"env": env_info(), "shape": {"b": b, "d": d, "n": n, "L": L, "dtype": "float32"}, "rows": {}}
    small = inputs(2, 64, 16, 256, seed=1)
    want = loop64(*small)
    full = inputs(b, d, n, L, seed=2)
    for kind in args.rows.split(","):
        row = res["rows"][kind] = {}
        try:
            f, rep = compiled(kind)         # each shape its own compile (no dynamic shapes)
            got = f(*small)
            row["rel_err_small"] = [rel(o, w) for o, w in zip(got, want)]
            f, rep = compiled(kind)
            f(*full)
            if rep is not None:
                row["regions"] = len(rep.regions)
                row["region_outputs"] = [str(o.index) for r in rep.regions for o in r.ir.outputs]
            torch.cuda.synchronize()
            row["ms"] = bench(lambda: f(*full))
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        except Exception as e:          # one row failing leaves the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(kind, row, flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
