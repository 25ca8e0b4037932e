"""Static SASS of the block-sparse CUDA kernel, without a GPU: the benchmark's region
(bench_block_sparse FULL's mask, captured on the CPU), one instance rendered, NVRTC's PTX for
compute_90 assembled by the ptxas and read by the nvdisasm that Triton ships; per loop of the
kernel: instructions, HMMA, and the longest chain of HMMA feeding each other's accumulator.

    python -m benchmarks.sass_bsp --instance '(1, "m2")' [--dense]
"""
from __future__ import annotations

import argparse
import ast
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def region(dense: bool):
    from benchmarks.bench_block_sparse import make_inputs, make_mask
    from block_sparse_programs import euler_matmul
    from conftest import ssmc_run
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(64, 64) if dense else make_mask(64, 8, 0.25, gen)
    _, rep = ssmc_run(euler_matmul, make_inputs(b=2, L=8, d=16, n=64, mask=mask, dev=torch.device("cpu"), gen=gen,
                                                seq_dtype=torch.bfloat16), target="torch")
    assert len(rep.regions) == 1, str(rep)
    return rep.regions[0].ir


def loops(sass: str) -> list[dict]:
    """Each backward branch's loop body: counts by opcode and the longest HMMA chain."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", l))}
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        body = [s.split("*/", 1)[1].strip().rstrip(" ;") for s in lines[labels[m.group(1)]:i + 1]
                if "*/" in s and re.search(r"\*/\s+\S", s)]
        ops, writer, longest = collections.Counter(), {}, 0
        for ins in body:
            mm = re.match(r"(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)\s*(R\d+)?", ins)
            if not mm:
                continue
            ops[mm.group(2).split(".")[0]] += 1
            if mm.group(2).startswith("HMMA"):
                regs = re.findall(r"R\d+", ins)
                writer[regs[0]] = writer.get(regs[-1], 0) + 1
                longest = max(longest, writer[regs[0]])
            elif mm.group(3):
                writer.pop(mm.group(3), None)
        out.append({"instructions": sum(ops.values()), "HMMA": ops["HMMA"], "longest_HMMA_chain": longest,
                    "top": ops.most_common(8), "spill": ops["LDL"] + ops["STL"]})
    return out


def main(argv=None):
    import triton
    from ssmc.runtime.cache import get_cache
    from ssmc.targets import cuda
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instance", default='(1, "m2")', help="(warps, variant[, vector loads, shared rows])")
    ap.add_argument("--dense", action="store_true", help="the all-ones mask (the benchmark's dense row)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    r = region(args.dense)
    key = ast.literal_eval(args.instance)
    key = tuple(key) + (True, True)[len(key) - 2:]
    rend = CudaBlockSparseKernel(r, bsp_plan(r), get_cache(str(tmp / "cache"))).rendered(key)
    ptx, fmt, _, _ = cuda.nvrtc_compile(rend.source, 91, "k.cu")        # an arch NVRTC lacks: compute_90 PTX
    assert fmt == "ptx", fmt
    ptx = re.sub(r"\.version \d+\.\d+", ".version 8.8", bytes(ptx).decode().rstrip("\x00"))
    (tmp / "k.ptx").write_text(ptx)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    log = subprocess.run([str(tools / "ptxas"), "-arch=sm_90", "-v", "-o", str(tmp / "k.cubin"), str(tmp / "k.ptx")],
                         capture_output=True, text=True, check=True).stderr
    print(rend.kname, *[l.strip() for l in log.splitlines() if "registers" in l or "spill" in l])
    sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(tmp / "k.cubin")], capture_output=True, text=True,
                          check=True).stdout
    for lp in loops(sass):
        print(lp)


if __name__ == "__main__":
    main()
