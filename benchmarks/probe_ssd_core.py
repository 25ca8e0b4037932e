"""The chunked SSD core's Triton kernels (ssmc/targets/ssd_core.py) alone, per tile config.

Factors laid out as a bf16 Mamba-2 call at b8 L4096 h24 p64 n128 hands them over (u = dt A in
fp32; dt, x, B, C the bf16 inputs as they are: permuted views of (b, L, h, .) tensors, B and C
shared by the heads), checked first (all fp32) against the torch matmul form in float64 at L 512; then do_bench medians of the forward (chunk states + outputs) and the
backward (end-state gradients + per-chunk gradients) for each config of one kernel at a time
(or of the chunk, "core"), the others at their defaults, atomic and deterministic; and the
backward's peak memory above what was allocated before it.

    python -m benchmarks.probe_ssd_core --out ssd_core.json
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from benchmarks.bench_gpu import bench, env_info, rel
from ssmc.targets import ssd_core
from ssmc.targets.ssd_autograd import _flat, _torch_core

SHAPE = dict(b=8, L=4096, h=24, p=64, n=128)
VARIANTS = {
    "core": [{"CHUNK": q} for q in (64, 128)],
    "bwd_dbc": [{"BLOCK_P": 64, "BLOCK_N": bn, "num_warps": w, "heads": hd} for hd, bn, w in
                (("loop", 128, 8), ("loop", 64, 8), ("loop", 64, 4), ("loop", 32, 4),
                 ("atomic", 128, 4), ("atomic", 128, 8), ("atomic", 64, 4), ("store", 128, 4))],
    "bwd_dx": [{"BLOCK_P": bp, "num_warps": w} for bp, w in ((64, 4), (64, 8))],
    "pass": [{"BLOCK": bl, "num_warps": w} for bl, w in ((256, 2), (1024, 4))],
}


def factors(b, L, h, p, n, dev, dtype=torch.float32, seed=0, raw=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)            # noqa: E731
    dt = torch.nn.functional.softplus(r(b, L, h) - 1)
    A = -torch.rand(h, generator=g).to(dev) - 0.5
    u = (dt * A).permute(0, 2, 1)[..., None]                       # (b, h, L, 1)
    w = dt.permute(0, 2, 1)[..., None]
    x = r(b, L, h, p).permute(0, 2, 1, 3)                           # (b, h, L, p)
    B = r(b, L, n)[:, None]                                         # (b, 1, L, n)
    C = r(b, L, n)[:, None]
    dy = r(b, h, L, p) / 16
    # as a bf16 Mamba-2 call hands them over: u computed in fp32, the others the inputs as they are
    return [u.to(dtype)] + [t.to(raw) for t in (w, x, B, C)], dy.to(dtype)


def check(dev) -> dict:
    sh = dict(SHAPE, L=512)
    (u, w, x, g, c), dy = factors(**sh, dev=dev, seed=1, raw=torch.float32)
    S, L, p, n = (sh["b"], sh["h"]), sh["L"], sh["p"], sh["n"]
    sp = ssd_core.Spec(S, L, p, n, 64, "tl.float32", False)
    ins = [t.detach().requires_grad_(True) for t in (u, w, x, g, c)]
    y, hl = ssd_core.core(sp, *ins, None)
    dh = torch.randn_like(hl)
    got = torch.autograd.grad((y, hl), ins, (dy.reshape(y.shape), dh))
    i64 = [t.detach().double().requires_grad_(True) for t in (u, w, x, g, c)]
    fl = [_flat(t, S, L, k) for t, k in zip(i64, (1, 1, p, n, n))]
    P = S[0] * S[1]
    y64, h64 = _torch_core(*fl, torch.zeros(P, p, n, dtype=torch.float64, device=dev), 64, lambda a, b: a @ b)
    want = torch.autograd.grad((y64, h64), i64, (dy.double().reshape(y64.shape), dh.double()))
    out = {"y": rel(y.reshape(y64.shape), y64), "h_final": rel(hl, h64)}
    out.update({f"d{k}": rel(a, b) for k, a, b in zip("uwxgc", got, want)})
    return out


def time_one(S, L, p, n, opd, det, fs, dy, row) -> dict:
    """fwd_ms, bwd_ms and the backward's peak memory at CONFIG as it stands (or the error)."""
    u, w, x, g, c = fs
    sp = ssd_core.Spec(S, L, p, n, ssd_core.config("core", opd)["CHUNK"], opd, det)
    try:
        y, hl, H, A = ssd_core._forward(sp, u, w, x, g, c, None)
        row["fwd_ms"] = bench(lambda: ssd_core._forward(sp, u, w, x, g, c, None))
        row["bwd_ms"] = bench(lambda: ssd_core._backward(sp, u, w, x, g, c, H, A, dy, None))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ssd_core._backward(sp, u, w, x, g, c, H, A, dy, None)
        torch.cuda.synchronize()
        row["bwd_peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del y, hl, H, A
    except Exception as e:
        import traceback
        at = [f.line for f in traceback.extract_tb(e.__traceback__) if f.filename.endswith("ssd_core.py")]
        row["error"] = f"{type(e).__name__}: {e}"[:300] + (f" (at {at[-1]})" if at else "")
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="", help="JSON list of CONFIG overrides ({kernel: {key: value}}) "
                    "to time instead of VARIANTS, bf16, not deterministic")
    args = ap.parse_args()
    dev = "cuda"
    try:
        ck = check(dev)
    except Exception as e:
        ck = {"error": f"{type(e).__name__}: {e}"[:300]}
    res = {"env": env_info(), "shape": SHAPE, "check_fp32_vs_fp64_L512": ck}
    print(res["check_fp32_vs_fp64_L512"], flush=True)
    (u, w, x, g, c), dy = factors(**SHAPE, dev=dev)
    S, L, p, n = (SHAPE["b"], SHAPE["h"]), SHAPE["L"], SHAPE["p"], SHAPE["n"]
    default = copy.deepcopy(ssd_core.CONFIG)
    rows = []
    for over in json.loads(args.configs or "[]"):
        with ssd_core.overridden(over):
            rows.append(time_one(S, L, p, n, "tl.bfloat16", False, (u, w, x, g, c), dy, {"config": over}))
    for opd in ("tl.bfloat16", "tl.float32") if not args.configs else ():
        for det in (False, True):
            for kern, cfgs in VARIANTS.items():
                for cfg in cfgs:
                    if (opd != "tl.bfloat16" or det) and cfg != {k: default[kern][k] for k in cfg}:
                        continue                      # fp32 and deterministic: the defaults only
                    with ssd_core.overridden({kern: cfg}):
                        rows.append(time_one(S, L, p, n, opd, det, (u, w, x, g, c), dy,
                                             {"opd": opd, "deterministic": det, "kernel": kern, **cfg}))
    res["rows"] = rows
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
