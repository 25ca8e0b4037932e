"""Per-config check and timing of the chunked SSD kernel on the GPU (Mamba-2 region, b8 L4096
h24 p64 n128 bf16 by default), each config in its own process: a config that faults the GPU
(an illegal address kills the CUDA context) is reported and cannot poison the others. Used to
choose the per-arch table templates/triton/ssd_fwd.configs.json.

    python -m benchmarks.tune_ssd --out ssd_configs.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def one(cfg: dict, shape: dict) -> dict:
    import triton.testing
    import ssmc
    from benchmarks.run import lowered, mamba2_inputs, mamba2_loop, rel
    from ssmc.runtime.op import lookup
    from test_triton import region_inputs, region_of
    from ssmc.targets import triton as T
    L = shape.pop("L")
    small = mamba2_inputs(shape, 8, torch.bfloat16, "cuda")
    region = region_of(mamba2_loop, [x.cpu() for x in small])
    kern = T.TritonTarget().compile(region, "chunked_ssd", ssmc.make_options())
    ins = mamba2_inputs(shape, L, torch.bfloat16, "cuda", seed=L)
    oracle = lowered(mamba2_loop, [x.double() for x in small], target="torch")["gm"]
    ref = oracle(*[x.double() for x in ins])[0]
    rin = region_inputs(region, mamba2_loop, ins)
    out = kern.launch(rin, cfg)
    torch.cuda.synchronize()
    got = out[0]
    ms = triton.testing.do_bench(lambda: kern.launch(rin, cfg), warmup=10, rep=50, return_mode="median")
    return {"rel_err": rel(got, ref), "ms": ms}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default='{"b": 8, "h": 24, "p": 64, "n": 128, "L": 4096}')
    args = ap.parse_args()
    shape = json.loads(args.shape)
    if args.one:
        print("RESULT " + json.dumps(one(json.loads(args.one), shape)), flush=True)
        return
    rows = []
    for chunk, bp, warps, stages in itertools.product([64, 128], [32, 64], [4, 8], [2]):
        cfg = {"variant": "ssd", "CHUNK": chunk, "BLOCK_P": bp, "num_warps": warps, "num_stages": stages}
        try:
            p = subprocess.run([sys.executable, "-m", "benchmarks.tune_ssd", "--out", "-", "--one", json.dumps(cfg),
                                "--shape", args.shape], capture_output=True, text=True, timeout=90, cwd=ROOT)
            got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(got[0][7:]) if got else {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
        except subprocess.TimeoutExpired:
            res = {"error": "timeout"}
        rows.append({"config": cfg, **res})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"shape": shape, "gpu": torch.cuda.get_device_name(),
                                          "triton": __import__("triton").__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
