"""Where the time of one decode step goes (H200): the compiled step and mamba-ssm's
`selective_state_update`, each timed three ways in one process:

  call   do_bench median of a Python call (what benchmarks.run reports: CPU dispatch included
         when it is longer than the kernel)
  cpu    host time per call, 200 calls enqueued back to back (synchronized at the end only)
  graph  do_bench median of one replay of a CUDA graph holding the call (the kernel alone)

Batches run in the order given, the first one twice, so a clock ramp or first-call effect shows.

    python -m benchmarks.probe_decode --out decode.json --batches 256,64,64,256
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.bench_gpu import bench, env_info, rel
from benchmarks.run import decode_inputs, decode_loop, lowered, nbytes, selective_state_update_call

CFG = dict(h=24, p=64, n=128)


def cpu_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def graph_ms(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def three(fn):
    return {"call_ms": bench(fn), "cpu_us_per_call": cpu_us(fn), "graph_ms": graph_ms(fn)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="256,64,64,256")
    ap.add_argument("--targets", default="triton")
    args = ap.parse_args()
    res = {"env": env_info(), "shape": CFG, "rows": []}
    small = decode_inputs({**CFG, "batch": 2}, torch.bfloat16, "cuda", steps=2)
    graphs = {t: lowered(decode_loop, small, target=t)["gm"] for t in args.targets.split(",")}
    try:
        from benchmarks import baselines as B
        ssu = B.import_mamba_triton()[1]
    except Exception as e:
        ssu, res["mamba_ssm_error"] = None, f"{type(e).__name__}: {e}"[:300]
    for batch in map(int, args.batches.split(",")):
        ins = decode_inputs({**CFG, "batch": batch}, torch.bfloat16, "cuda", seed=batch)
        ref = decode_loop(*[x.double() for x in ins])
        state_bytes = 2 * nbytes([ins[6]])
        for t, gm in graphs.items():
            y, hN = gm(*ins)
            row = {"batch": batch, "variant": f"ssmc[{t}]", "rel_err": max(rel(y, ref[0]), rel(hN, ref[1]))}
            row.update(three(lambda: gm(*ins)))
            from ssmc.runtime.op import _REGISTRY
            row["configs"] = {k: getattr(e.kernel, "config", None) for k, e in _REGISTRY.items() if "step" in k}
            row["GB_per_s_graph"] = state_bytes / row["graph_ms"] / 1e6
            res["rows"].append(row)
            print(row, flush=True)
        if ssu is not None:
            f, state = selective_state_update_call(ssu, ins)
            y = f()
            row = {"batch": batch, "variant": "mamba-ssm selective_state_update",
                   "rel_err": max(rel(y, ref[0][:, 0]), rel(state, ref[1]))}
            row.update(three(f))
            row["GB_per_s_graph"] = state_bytes / row["graph_ms"] / 1e6
            res["rows"].append(row)
            print(row, flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
