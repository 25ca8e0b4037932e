"""Per-config timings of ssmc's Mamba-1 kernels on the GPU (b8 d1536 n16, bf16), to tune the
per-arch tables next to the templates. Writes JSON; `--ncu` adds an Nsight Compute summary of
the fastest CUDA config (run under `ncu`, see gpu notes).

    python -m benchmarks.tune_mamba1 --out tune.json [--lengths 4096]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gpu import bench, env_info, lowered_graph, mamba1_inputs, mamba1_naive, rel  # noqa: E402
from ssmc.runtime.op import lookup  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--only", default="cuda,triton")
    ap.add_argument("--profile-once", default="", help="target: run its default pick once (under ncu)")
    args = ap.parse_args()
    if args.profile_once:
        b, d, n = 8, 1536, 16
        gm, _ = lowered_graph(mamba1_naive, mamba1_inputs(b, d, n, 16, torch.bfloat16, 0), target=args.profile_once)
        ins = mamba1_inputs(b, d, n, int(args.lengths), torch.bfloat16, 1)
        for _ in range(3):
            gm(*ins)
        torch.cuda.synchronize()
        return
    res = {"env": env_info()}
    b, d, n = 8, 1536, 16
    small = mamba1_inputs(b, d, n, 16, torch.bfloat16, 0)
    gm64, _ = lowered_graph(mamba1_naive, [x.double() if x.is_floating_point() else x for x in small], target="torch")
    for target in args.only.split(","):
        gm, rep = lowered_graph(mamba1_naive, small, target=target)
        entry = lookup(rep.regions[0].key)
        k = entry.kernel
        for L in map(int, args.lengths.split(",")):
            ins = mamba1_inputs(b, d, n, L, torch.bfloat16, L)
            ref = gm64(*[x.double() for x in ins])[0]
            out = {}
            if target == "cuda":
                for cfg in k.rendered(90).configs:
                    k.force_kernel = cfg["kernel"]
                    try:
                        y = gm(*ins)[0]
                        out[cfg["kernel"]] = {"ms": bench(lambda: gm(*ins)), "rel_err": rel(y, ref),
                                              "cfg": {kk: str(v) for kk, v in cfg.items()}}
                    except Exception as e:
                        out[cfg["kernel"]] = {"error": f"{type(e).__name__}: {e}"[:300]}
                k.force_kernel = None
                gm(*ins)
                out["auto_pick"] = k.last_launch and {kk: str(v) for kk, v in k.last_launch.items()}
            else:
                y = gm(*ins)[0]
                out["rel_err"] = rel(y, ref)
                out["chosen"] = k.config
                out["timings"] = {str(bk): v for bk, v in k.timings.items()}
                out["failed"] = {str(bk): v for bk, v in k.failed_configs.items()}
                out["ms"] = bench(lambda: gm(*ins))
            res[f"{target}_L{L}"] = out
            best = sorted((v["ms"], kk) for kk, v in out.items() if isinstance(v, dict) and v.get("ms"))
            print(target, L, best[:4] if best else out.get("ms"), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
