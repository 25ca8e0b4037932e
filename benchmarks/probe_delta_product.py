"""DeltaProduct (two Householder updates a step) compiled with ssmc against the same loop eager,
and fla's chunked `chunk_gated_delta_product` where flash-linear-attention is installed.

The loop is tests/test_delta_rule.py's `_delta_product` (q, g read at t; k, v, beta at 2t and
2t + 1). Checked against float64 at a short length first, then forward medians of do_bench.

    python -m benchmarks.probe_delta_product --out dp.json [--shape B,T,H,K,V]
    (on the device: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_delta_rule import _delta_product  # noqa: E402


def inputs(B, T, H, K, V, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, K, generator=g)
    k = F.normalize(torch.randn(B, H, 2 * T, K, generator=g), dim=-1)
    v = torch.randn(B, H, 2 * T, V, generator=g)
    beta = torch.rand(B, H, 2 * T, generator=g)
    gate = F.logsigmoid(torch.randn(B, H, T, generator=g))
    return [x.to(dev) for x in (q, k, v, beta, gate)]


def main(argv=None):
    import triton.testing
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="1,1024,8,128,128", help="B,T,H,K,V (T steps, 2T updates)")
    ap.add_argument("--profile", action="store_true", help="also the top CUDA kernels of one ssmc call")
    args = ap.parse_args(argv)
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    dev = torch.device("cuda")
    res = {"env": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__},
           "shape": dict(B=B, T=T, H=H, K=K, V=V)}
    from benchmarks.bench_gpu import lowered_graph
    fn, rep = lowered_graph(_delta_product, inputs(B, 8, H, K, V, dev, 0))   # captured short, run at any T
    res["regions"] = [(r.strategy, r.target) for r in rep.regions]
    small = inputs(B, min(T, 64), H, K, V, dev, 1)
    got = fn(*small)
    want = _delta_product(*[x.double() for x in small])
    res["rel_err_vs_float64"] = max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want))
    print(res, flush=True)
    full = inputs(B, T, H, K, V, dev, 2)
    fn(*full)
    res["ssmc_ms"] = triton.testing.do_bench(lambda: fn(*full), warmup=5, rep=50, return_mode="median")
    res["eager_ms"] = triton.testing.do_bench(lambda: _delta_product(*full), warmup=1, rep=20, return_mode="median")
    res["speedup"] = res["eager_ms"] / res["ssmc_ms"]
    print(res, flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*full)
            torch.cuda.synchronize()
        res["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
        print(res["profile"], flush=True)
    try:        # fla's hand-written chunked kernel, where the package is installed (a baseline only)
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        q, k, v, beta, gate = (x.transpose(1, 2).contiguous() for x in full)      # fla's (B, T, H, ...)
        run = lambda: chunk_gated_delta_product(q, k, v, gate, beta, num_householder=2, scale=1.0)  # noqa: E731
        got = run()[0].transpose(1, 2)
        want = _delta_product(*[x.double() for x in full])[0]
        res["fla_chunk_rel_err_vs_float64"] = ((got.double() - want).norm() / want.norm()).item()
        res["fla_chunk_ms"] = triton.testing.do_bench(run, warmup=5, rep=50, return_mode="median")
        res["ssmc_vs_fla_chunk"] = res["fla_chunk_ms"] / res["ssmc_ms"]
    except Exception as e:  # noqa: BLE001 - the baseline is optional
        res["fla_chunk"] = f"not run: {type(e).__name__}: {e}"
    print(res, flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
