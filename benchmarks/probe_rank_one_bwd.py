"""Where the time of a rank-one region's backward goes on the GPU (the gated delta rule, or KDA
with --form kda): the loop captured at a few steps (the lowered graph runs any length), checked
against float64 at a small shape (values and gradients), timed forward and forward+backward with
do_bench, then one forward+backward under torch.profiler: the kernels by total CUDA time.

    python -m benchmarks.probe_rank_one_bwd --out probe.json [--shape B,T,H,K,V] [--form kda]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_delta_rule import FORMS, grads, inputs  # noqa: E402
from benchmarks.bench_gpu import bench, env_info, lowered_graph, rel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4,1024,16,128,128", help="B,T,H,K,V")
    ap.add_argument("--form", choices=sorted(FORMS), default="gated")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    loop = FORMS[args.form]
    res = {"env": env_info() if dev == "cuda" else {}, "form": args.form,
           "shape": dict(B=B, T=T, H=H, K=K, V=V, dtype="float32")}
    out = Path(args.out)

    def write():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))

    # the check: its own capture at the small shape, run at a longer T than captured
    small = inputs(2, 64, 4, 32, 48, seed=1, dev=dev, form=args.form)
    f, rep = lowered_graph(loop, inputs(2, 8, 4, 32, 48, seed=3, dev=dev, form=args.form))
    res["regions"] = [(r.strategy, r.target) for r in rep.regions]
    d = [x.double() for x in small]
    res["rel_err"] = [rel(a, b) for a, b in zip(f(*small), loop(*d))]
    res["grad_rel_err"] = [rel(a, b) for a, b in zip(grads(f, small), grads(loop, d))]
    print("check", res["regions"], res["rel_err"], res["grad_rel_err"], flush=True)
    write()

    f, rep = lowered_graph(loop, inputs(B, 8, H, K, V, seed=3, dev=dev, form=args.form))
    full = inputs(B, T, H, K, V, seed=2, dev=dev, form=args.form)
    xs = [x.detach().requires_grad_() for x in full]
    grads(f, xs)
    from ssmc.runtime.op import lookup
    res["describe"] = [getattr(lookup(r.key).kernel, "describe", lambda: "")() for r in rep.regions]
    if dev == "cuda":
        torch.cuda.synchronize()
        res["fwd_ms"] = bench(lambda: f(*full))
        res["fwd_bwd_ms"] = bench(lambda: grads(f, xs))
        print("fwd", res["fwd_ms"], "fwd+bwd", res["fwd_bwd_ms"], flush=True)
        write()
        # host time of one call, and whether the allocator synced
        import cProfile
        import io
        import pstats
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        prof = cProfile.Profile()
        prof.enable()
        grads(f, xs)
        prof.disable()
        torch.cuda.synchronize()
        res["alloc_retries_one_call"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - before
        res["peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        res["host_profile"] = buf.getvalue()
        print("alloc retries", res["alloc_retries_one_call"], "peak GB", res["peak_gb"], flush=True)
        print(buf.getvalue()[:6000], flush=True)
        write()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        grads(f, xs)
        if dev == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
    ev = prof.key_averages()
    rows = []
    for e in ev:
        t = getattr(e, "device_time_total", None) if dev == "cuda" else e.cpu_time_total
        if t is None:
            t = getattr(e, key, 0)
        rows.append((t, e.key, e.count))
    rows.sort(reverse=True)
    res["profile_us"] = [dict(us=round(t, 1), name=n[:160], count=c) for t, n, c in rows[:args.top]]
    table = ev.table(sort_by=("device_time_total" if dev == "cuda" else "cpu_time_total"), row_limit=args.top)
    print(table, flush=True)
    res["profile_table"] = table
    write()


if __name__ == "__main__":
    main()
