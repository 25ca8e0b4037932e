"""Where the CUDA block-sparse kernel's time goes (H200): the benchmark's shape (bench_block_sparse
FULL) through the cuda target, one call between cudaProfilerStart/Stop for ncu (its source page
has the instructions executed and the stall samples per SASS line: `gpu_check.sh` step bspprobe).

    python -m benchmarks.probe_bsp --out bsp_probe.json
    ncu --profile-from-start off --set full -k regex:ssmc_bsp -c 1 -o /tmp/bsp \\
        python -m benchmarks.probe_bsp --out /dev/null --groups 4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.bench_block_sparse import FULL, make_inputs, make_mask  # noqa: E402
from benchmarks.bench_gpu import lowered_graph  # noqa: E402
from block_sparse_programs import euler_matmul  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", default=None, help="force this choice: warps, or warps,variant (e.g. 4,m2)")
    ap.add_argument("--dense", action="store_true", help="the all-ones mask (the benchmark's dense row)")
    args = ap.parse_args(argv)
    cfg = FULL
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    b, L, d, n, bs = cfg["b"], cfg["L"], cfg["d"], cfg["n"], cfg["bs"]
    mask = torch.ones(n, n) if args.dense else make_mask(n, bs, cfg["density"], gen)
    fn, report = lowered_graph(euler_matmul, make_inputs(b=b, L=16, d=d, n=n, mask=mask, dev=dev, gen=gen,
                                                         seq_dtype=torch.bfloat16), target="cuda")
    from ssmc.runtime.op import lookup
    kern = lookup(report.regions[0].key).kernel
    if args.groups:
        w, *v = args.groups.split(",")
        kern.force_groups = (int(w), v[0] if v and v[0].startswith("m") else v == ["s"]) if v else int(w)
    ins = make_inputs(b=b, L=L, d=d, n=n, mask=mask, dev=dev, gen=gen, seq_dtype=torch.bfloat16)
    fn(*ins)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn(*ins)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    arch = torch.cuda.get_device_capability()
    arch = arch[0] * 10 + arch[1]
    res = {"launch": kern.last_launch, "describe": kern.describe(), "arch": arch}
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
