"""Per-config timings of ssmc's Mamba-1 kernels on the GPU (b8 d1536 n16, bf16), to tune the
per-arch tables next to the templates. Writes JSON; `--ncu` adds an Nsight Compute summary of
the fastest CUDA config (run under `ncu`, see gpu notes).

    python -m benchmarks.tune_mamba1 --out tune.json [--lengths 4096] [--layouts bdl,bld] [--baseline]

--layouts: "bdl" times the (b, d, L) tensors mamba-ssm takes (time contiguous); "bld" the same
values stored (b, L, d) / (b, L, n) and viewed as (b, d, L), the layout a naive block's
projections produce (lanes along rows). --baseline adds mamba-ssm's CUDA selective_scan forward
(built from the sdist under .carry/) and torch's associative_scan compiled by Inductor on the
same inputs, in the same run.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gpu import bench, env_info, lowered_graph, mamba1_inputs, mamba1_naive, rel  # noqa: E402
from ssmc.runtime.op import lookup  # noqa: E402


def _lower_untuned(small, target, autotune="all"):
    """The graph lowered on the L16 inputs without autotuning the Triton kernel there: CHUNK is
    clamped to the length, so those are other kernels than the ones timed (72 s of compiling on
    the H200 host for nothing)."""
    from ssmc.targets import triton as T
    orig = T.TritonKernel._autotune
    T.TritonKernel._autotune = lambda self, inputs, arch, bucket: self.candidates(inputs, arch)[0]
    try:
        return lowered_graph(mamba1_naive, small, target=target, autotune=autotune)
    finally:
        T.TritonKernel._autotune = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--only", default="cuda,triton")
    ap.add_argument("--profile-once", default="", help="target: run its default pick, then once more between cudaProfilerStart/Stop (ncu --profile-from-start off)")
    ap.add_argument("--layouts", default="bdl")
    ap.add_argument("--baseline", action="store_true", help="mamba-ssm's CUDA selective_scan forward too")
    ap.add_argument("--batch", type=int, default=8, help="batch size (d1536 n16)")
    ap.add_argument("--kernels", default="", help="cuda: only the instances whose names contain one of "
                                                  "these comma-separated parts (every instance compiles: ~3 s each)")
    ap.add_argument("--autotune", default="all", choices=("all", "prune"),
                    help="triton: time every config (default) or prune as a user's first call does")
    args = ap.parse_args()
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING)
    logging.getLogger("ssmc").setLevel(logging.INFO)     # the autotuner's progress, config by config
    if args.profile_once:
        b, d, n = 8, 1536, 16
        gm, _ = lowered_graph(mamba1_naive, mamba1_inputs(b, d, n, 16, torch.bfloat16, 0), target=args.profile_once)
        ins = mamba1_inputs(b, d, n, int(args.lengths), torch.bfloat16, 1)
        gm(*ins)                           # autotunes (Triton) outside the profiled range
        torch.cuda.synchronize()
        torch.cuda.profiler.start()        # ncu --profile-from-start off profiles this call only
        gm(*ins)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    res = {"env": env_info(), "shape": {"b": args.batch, "d": 1536, "n": 16, "dtype": "bfloat16"}}
    b, d, n = args.batch, 1536, 16
    small = mamba1_inputs(b, d, n, 16, torch.bfloat16, 0)
    gm64, _ = lowered_graph(mamba1_naive, [x.double() if x.is_floating_point() else x for x in small], target="torch")
    if args.baseline:
        try:
            from benchmarks import baselines as BL
            ext = BL.build_selective_scan_fwd()
            for L in map(int, args.lengths.split(",")):
                ins = mamba1_inputs(b, d, n, L, torch.bfloat16, L)
                ref = gm64(*[x.double() for x in ins])[0]
                f = lambda: ext.fwd(ins[0], ins[1], ins[2], ins[3].unsqueeze(1), ins[4].unsqueeze(1),
                                    ins[5], ins[6], ins[7], True)[2]
                res[f"mamba_ssm_L{L}"] = {"ms": bench(f), "rel_err": rel(f(), ref)}
                print("mamba-ssm", L, res[f"mamba_ssm_L{L}"], flush=True)
                assoc = torch.compile(BL.assoc_scan_mamba1)
                res[f"assoc_scan_inductor_L{L}"] = {"ms": bench(lambda: assoc(*ins)), "rel_err": rel(assoc(*ins), ref)}
                print("associative_scan+inductor", L, res[f"assoc_scan_inductor_L{L}"], flush=True)
        except Exception as e:
            res["mamba_ssm_error"] = f"{type(e).__name__}: {e}"[:500]
            print(res["mamba_ssm_error"], flush=True)
    for target, layout in [(t, lay) for t in args.only.split(",") for lay in args.layouts.split(",")]:
        gm, rep = _lower_untuned(small, target, args.autotune)
        entry = lookup(rep.regions[0].key)
        k = entry.kernel
        for L in map(int, args.lengths.split(",")):
            ins = mamba1_inputs(b, d, n, L, torch.bfloat16, L)
            if layout == "bld":      # same values, stored time-major-outside: (b, L, d) viewed as (b, d, L)
                ins = [x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() == 3 else x for x in ins]
            ref = gm64(*[x.double() for x in ins])[0]
            out = res[f"{target}_{layout}_L{L}"] = {}     # written after every instance: a cut run keeps them
            save = lambda: Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
            if target == "cuda":
                parts = [x for x in args.kernels.split(",") if x]
                for cfg in k.rendered(90).configs:
                    if parts and not any(x in cfg["kernel"] for x in parts):
                        continue
                    k.force_kernel = cfg["kernel"]
                    try:
                        y = gm(*ins)[0]
                        out[cfg["kernel"]] = {"ms": bench(lambda: gm(*ins)), "rel_err": rel(y, ref),
                                              "cfg": {kk: str(v) for kk, v in cfg.items()}}
                    except Exception as e:
                        out[cfg["kernel"]] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    save()
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
            best = sorted((v["ms"], kk) for kk, v in out.items() if isinstance(v, dict) and v.get("ms"))
            print(target, layout, L, best[:6] if best else out.get("ms"), flush=True)
            save()
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
