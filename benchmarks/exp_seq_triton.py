"""Prototype of a Triton layout before it goes into the generator: the sequential form, no
scan across lanes. A program owns BD rows; a tile is (BD rows, NQ lanes a row, CH steps), the
CH steps of a row in one thread's registers (sizePerThread [1, 1, CH]); each lane keeps S = 4
of the row's N = NQ * S state elements as carries between chunks, scans its CH steps in
registers (tl.associative_scan along a thread-local axis: no shuffles), and the readout is
summed over the NQ lanes once per step (tl.sum over axis 1). Every tile has the full
(BD, NQ, CH) shape (B and C offsets broadcast over rows) so that Triton gives all of them the
load's layout. softplus through ex2/lg2.approx. Mamba-1 forward, b8 d1536 n16 (n = 16 only),
L a multiple of CH; against float64 and mamba-ssm's CUDA forward and ssmc's generated Triton
kernel in the same run. B and C are read as bf16, or converted to fp32 first (inside the timed
call: bf16 -> fp32 is 2 of the ~14 instructions a state-step in the loop, compiled for sm_90).

    python -m benchmarks.exp_seq_triton --out F [--lengths 4096,2048]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gpu import bench, env_info, lowered_graph, mamba1_inputs, mamba1_naive, rel  # noqa: E402

@triton.jit
def _last(h, rt, CH: tl.constexpr):
    return tl.sum(tl.where(rt == CH - 1, h, 0.0), axis=2)

@triton.jit
def _state(c, A2, dts, dtx, Bp, Cp, rt, CH: tl.constexpr):
    a = tl.exp2(dts * A2)                      # (BD, NQ, CH)
    b = dtx * tl.load(Bp).to(tl.float32)       # (1, NQ, CH) broadcast
    b = tl.where(rt == 0, a * c[:, :, None] + b, b)
    _, h = tl.associative_scan((a, b), axis=2, combine_fn=_comb)
    return h, h * tl.load(Cp).to(tl.float32)

_INTERP = tl.constexpr(bool(os.environ.get("TRITON_INTERPRET")))

@triton.jit
def _lg2(x):
    if _INTERP:
        r = tl.log2(x)
    else:
        r = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    return r

@triton.jit
def _softplus(v):
    return tl.where(v > 20.0, v, _lg2(1.0 + tl.exp2(v * 1.4426950408889634)) * 0.6931471805599453)

@triton.jit
def _comb(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2

@triton.jit
def seq_fwd(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, Dm, L,
            BD: tl.constexpr, NQ: tl.constexpr, CH: tl.constexpr):
    S: tl.constexpr = 4
    N: tl.constexpr = NQ * S
    pid = tl.program_id(0)
    nblk = tl.cdiv(Dm, BD)
    bi = pid // nblk
    d0 = (pid % nblk) * BD
    rd = d0 + tl.arange(0, BD)[:, None, None]
    rq = tl.arange(0, NQ)[None, :, None]
    rt = tl.arange(0, CH)[None, None, :]
    zq = rq * 0
    row = (bi * Dm + rd) * L                          # (BD,1,1)
    bias = tl.load(bias_ptr + rd + zq)                # (BD,NQ,1)
    Dv = tl.load(D_ptr + rd + zq)
    LOG2E: tl.constexpr = 1.4426950408889634
    A0 = tl.load(A_ptr + rd * N + rq * S + 0) * LOG2E
    A1 = tl.load(A_ptr + rd * N + rq * S + 1) * LOG2E
    A2 = tl.load(A_ptr + rd * N + rq * S + 2) * LOG2E
    A3 = tl.load(A_ptr + rd * N + rq * S + 3) * LOG2E
    c0 = tl.zeros((BD, NQ), tl.float32)
    c1 = tl.zeros((BD, NQ), tl.float32)
    c2 = tl.zeros((BD, NQ), tl.float32)
    c3 = tl.zeros((BD, NQ), tl.float32)
    bn = (bi * N + rq * S) * L                        # (1,NQ,1)
    for t0 in range(0, L, CH):
        off = row + t0 + rt + zq                      # (BD,NQ,CH), same for the NQ lanes of a row
        dtr = tl.load(dt_ptr + off).to(tl.float32) + bias
        dts = _softplus(dtr)
        xv = tl.load(x_ptr + off).to(tl.float32)
        dtx = dts * xv
        bo = bn + t0 + rt + rd * 0
        h, y = _state(c0, A0, dts, dtx, B_ptr + bo, C_ptr + bo, rt, CH)
        c0 = _last(h, rt, CH)
        h, y1 = _state(c1, A1, dts, dtx, B_ptr + bo + L, C_ptr + bo + L, rt, CH)
        c1 = _last(h, rt, CH)
        y += y1
        h, y1 = _state(c2, A2, dts, dtx, B_ptr + bo + 2 * L, C_ptr + bo + 2 * L, rt, CH)
        c2 = _last(h, rt, CH)
        y += y1
        h, y1 = _state(c3, A3, dts, dtx, B_ptr + bo + 3 * L, C_ptr + bo + 3 * L, rt, CH)
        c3 = _last(h, rt, CH)
        y += y1
        ys = tl.sum(y, axis=1)                        # (BD, CH): over the row's lanes
        o2 = (bi * Dm + d0 + tl.arange(0, BD)[:, None]) * L + t0 + tl.arange(0, CH)[None, :]
        zv = tl.load(z_ptr + o2).to(tl.float32)
        xv2 = tl.load(x_ptr + o2).to(tl.float32)
        Dv2 = tl.load(D_ptr + d0 + tl.arange(0, BD)[:, None])
        out = (ys + Dv2 * xv2) * (zv / (1.0 + tl.exp2(zv * -1.4426950408889634)))
        tl.store(out_ptr + o2, out.to(out_ptr.dtype.element_ty))

def run(x, dt, A, B, C, D, z, bias, BD=8, NQ=4, CH=8, num_warps=1, out=None):
    b, d, L = x.shape
    out = torch.empty_like(x) if out is None else out
    seq_fwd[(b * triton.cdiv(d, BD),)](x, dt, A, B, C, D, z, bias, out, d, L, BD=BD, NQ=NQ, CH=CH, num_warps=num_warps)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="4096,2048")
    ap.add_argument("--generated", action="store_true", help="ssmc's generated Triton kernel too (autotunes: ~2 min cold)")
    args = ap.parse_args()
    from benchmarks import baselines as BL
    res = {"env": env_info(), "shape": {"b": 8, "d": 1536, "n": 16, "dtype": "bfloat16"}}
    save = lambda: Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    b, d, n = 8, 1536, 16
    small = mamba1_inputs(b, d, n, 16, torch.bfloat16, 0)
    gm64, _ = lowered_graph(mamba1_naive, [x.double() if x.is_floating_point() else x for x in small], target="torch")
    gmt = lowered_graph(mamba1_naive, small, target="triton")[0] if args.generated else None
    try:
        ext = BL.build_selective_scan_fwd()
    except Exception as e:
        ext, res["mamba_ssm_error"] = None, f"{type(e).__name__}: {e}"[:300]
    for L in map(int, args.lengths.split(",")):
        ins = mamba1_inputs(b, d, n, L, torch.bfloat16, L)
        ref = gm64(*[x.double() for x in ins])[0]
        out = res[f"L{L}"] = {}
        if ext is not None:
            f = lambda: ext.fwd(ins[0], ins[1], ins[2], ins[3].unsqueeze(1), ins[4].unsqueeze(1), ins[5], ins[6], ins[7], True)[2]
            out["mamba_ssm"] = {"ms": bench(f), "rel_err": rel(f(), ref)}
        if gmt is not None:
            out["ssmc_triton_generated"] = {"ms": bench(lambda: gmt(*ins)), "rel_err": rel(gmt(*ins)[0], ref)}
        print(L, out, flush=True)
        for bd, nq, ch, w in [(8, 4, 8, 1), (16, 4, 8, 2), (32, 4, 8, 4), (8, 4, 16, 1), (16, 4, 16, 2), (8, 4, 4, 1)]:
            for f32 in (False, True):
                name = f"seq_bd{bd}_nq{nq}_ch{ch}_w{w}" + ("_bc32" if f32 else "")
                buf = torch.full_like(ins[0], float("nan"))           # poisoned: the call must write it all

                def call():
                    Bm, Cm = (ins[3].float(), ins[4].float()) if f32 else (ins[3], ins[4])
                    return run(ins[0], ins[1], ins[2], Bm, Cm, ins[5], ins[6], ins[7], BD=bd, NQ=nq, CH=ch,
                               num_warps=w, out=buf)
                try:
                    y = call().clone()
                    out[name] = {"ms": bench(call), "rel_err": rel(y, ref)}
                except Exception as e:
                    out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(L, name, out[name], flush=True)
                save()
    save()


if __name__ == "__main__":
    main()
