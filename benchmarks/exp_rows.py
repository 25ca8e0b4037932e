"""Prototype of a Triton selective-scan layout before it goes into the generator: a program owns
BLOCK_D rows and a chunk of CHUNK steps as a (BLOCK_D, CHUNK) tile (time along lanes), the
state axis n is a loop inside the chunk (unrolled; the dynamic-loop form timed in
results/h200_exp_rows_fc1616f.json is this file as of commit b5efc97), one tl.associative_scan
per (chunk, n), the readout accumulated over n in registers. Mamba-1 forward, b8 d1536 n16, bf16, against float64 and
mamba-ssm's CUDA forward in the same run.

    python -m benchmarks.exp_rows --out F [--lengths 2048,4096]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gpu import bench, mamba1_inputs, rel  # noqa: E402


@triton.jit
def _comb(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


@triton.jit
def rows_kernel(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, y_ptr,
                SIZE_D, L, N: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    nblk = (SIZE_D + BLOCK_D - 1) // BLOCK_D
    pid_d = pid % nblk
    b = pid // nblk
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    od = offs_d[:, None]
    md = od < SIZE_D
    offs_t = tl.arange(0, CHUNK)
    on = tl.arange(0, BLOCK_N)[None, :]
    hc = tl.zeros((BLOCK_D, BLOCK_N), tl.float32)
    bias = tl.load(bias_ptr + od, mask=md, other=0.0)
    Dv = tl.load(D_ptr + od, mask=md, other=0.0)
    row = b * SIZE_D * L + od * L
    bn = b * N * L
    last = offs_t[None, :] == CHUNK - 1
    for t0 in range(0, L, CHUNK):
        tt = t0 + offs_t[None, :]
        mt = tt < L
        m = md & mt
        dt = tl.load(dt_ptr + row + tt, mask=m, other=0.0).to(tl.float32) + bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp2(dt * 1.4426950408889634)))
        u = tl.load(u_ptr + row + tt, mask=m, other=0.0).to(tl.float32)
        dtu = dt * u
        acc = tl.zeros((BLOCK_D, CHUNK), tl.float32)
        for n in tl.static_range(N):
            An = tl.load(A_ptr + od * N + n, mask=md, other=0.0) * 1.4426950408889634
            a = tl.where(mt, tl.exp2(dt * An), 1.0)
            Bn = tl.load(B_ptr + bn + n * L + tt, mask=mt, other=0.0).to(tl.float32)
            bb = dtu * Bn
            hn = tl.sum(tl.where(on == n, hc, 0.0), 1)[:, None]
            Aa, Bb = tl.associative_scan((a, bb), axis=1, combine_fn=_comb)
            H = Aa * hn + Bb
            Cn = tl.load(C_ptr + bn + n * L + tt, mask=mt, other=0.0).to(tl.float32)
            acc += H * Cn
            hl = tl.sum(tl.where(last, H, 0.0), 1)[:, None]
            hc = tl.where(on == n, hl, hc)
        z = tl.load(z_ptr + row + tt, mask=m, other=0.0).to(tl.float32)
        y = (acc + Dv * u) * (z / (1.0 + tl.exp2(-z * 1.4426950408889634)))
        tl.store(y_ptr + row + tt, y.to(y_ptr.dtype.element_ty), mask=m)


def run_rows(ins, BLOCK_D, CHUNK, warps, maxnreg=0):
    u, delta, A, B, C, D, z, bias = ins
    b, d, L = u.shape
    n = A.shape[1]
    y = torch.empty_like(u)
    grid = (b * triton.cdiv(d, BLOCK_D),)
    rows_kernel[grid](u, delta, A, B, C, D, z, bias, y, d, L, N=n, BLOCK_N=triton.next_power_of_2(n),
                      BLOCK_D=BLOCK_D, CHUNK=CHUNK, num_warps=warps,
                      **({"maxnreg": maxnreg} if maxnreg else {}))
    return y


def reference(ins):
    u, delta, A, B, C, D, z, bias = [x.double() for x in ins]
    dt = torch.nn.functional.softplus(delta + bias[None, :, None])
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=torch.float64, device=u.device)
    ys = []
    for t in range(u.shape[2]):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + D[None, :, None] * u
    return y * torch.nn.functional.silu(z)


CONFIGS = [(1, 256, 1), (1, 512, 1), (1, 512, 2), (1, 1024, 2), (1, 1024, 4), (1, 2048, 4),
           (2, 256, 2), (2, 512, 2), (4, 128, 2), (4, 256, 4)]


def generated(L, configs):
    """ssmc's rendered rows kernel for the same naive loop, each config timed with do_bench."""
    from benchmarks.bench_gpu import lowered_graph
    from benchmarks.run import mamba1_loop
    from ssmc.runtime.op import lookup
    from ssmc.targets import triton as T
    b, d, n = 8, 1536, 16
    first = {"variant": "rows", "BLOCK_D": configs[0][0], "CHUNK": configs[0][1], "num_warps": configs[0][2],
             "num_stages": 1}
    configs = [tuple(c) + (0,) * (5 - len(c)) for c in configs]
    T.TritonKernel._autotune = lambda self, inputs, arch, bucket: dict(first)     # no search here
    gm, rep = lowered_graph(mamba1_loop, mamba1_inputs(b, d, n, 16, torch.bfloat16, 0), target="triton")
    k = lookup(rep.regions[0].key).kernel
    ins = mamba1_inputs(b, d, n, L, torch.bfloat16, L)
    ref = reference(ins)
    gm(*ins)
    out = {}
    for bd, ch, w, mr, un in configs:
        cfg = {"variant": "rows", "BLOCK_D": bd, "CHUNK": ch, "num_warps": w, "num_stages": 1,
               **({"maxnreg": mr} if mr else {}), **({"UNROLL": un} if un else {})}
        k.chosen = {key: dict(cfg) for key in k.chosen}
        k._replays.clear()
        y = gm(*ins)[0]
        name = f"gen_bd{bd}_c{ch}_w{w}_r{mr}_u{un}"
        out[name] = {"ms": bench(lambda: gm(*ins)), "rel_err": rel(y, ref), "config": k.config}
        print(L, name, out[name], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="4096,2048")
    ap.add_argument("--configs", default="", help="bd:chunk:warps[:maxnreg[:unroll]],... (default: all of CONFIGS)")
    ap.add_argument("--generated", action="store_true", help="ssmc's rendered rows kernel, per config, too")
    ap.add_argument("--only-generated", action="store_true", help="no baseline, no prototype")
    args = ap.parse_args()
    global CONFIGS
    if args.configs:
        CONFIGS = [tuple(map(int, c.split(":"))) for c in args.configs.split(",")]
    res = {}
    ext = None
    try:
        if not args.only_generated:
            from benchmarks import baselines as BL
            ext = BL.build_selective_scan_fwd()
    except Exception as e:
        res["baseline_error"] = repr(e)
    b, d, n = 8, 1536, 16
    for L in map(int, args.lengths.split(",")):
        ins = mamba1_inputs(b, d, n, L, torch.bfloat16, L)
        ref = reference(ins)
        r = res[f"L{L}"] = {}
        if ext is not None:
            f = lambda: ext.fwd(ins[0], ins[1], ins[2], ins[3].unsqueeze(1), ins[4].unsqueeze(1),
                                ins[5], ins[6], ins[7], True)[2]
            r["mamba_ssm"] = {"ms": bench(f), "rel_err": rel(f(), ref)}
            print(L, "mamba-ssm", r["mamba_ssm"], flush=True)
        if args.generated or args.only_generated:
            r.update(generated(L, CONFIGS))
        for c in [] if args.only_generated else CONFIGS:
            bd, ch, w, mr = (tuple(c) + (0,) * (4 - len(c)))[:4]
            name = f"bd{bd}_c{ch}_w{w}_r{mr}_static"
            try:
                out = run_rows(ins, bd, ch, w, mr)
                err = rel(out, ref)
                r[name] = {"ms": bench(lambda: run_rows(ins, bd, ch, w, mr)), "rel_err": err}
            except Exception as e:
                r[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(L, name, r[name], flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
