"""Times the `transition_grads` kernel's launch configurations against the torch ops it replaces,
at one chunk of the block-sparse benchmark's backward (512 steps x 8192 rows, d_state 64). GPU.

    python -m benchmarks.probe_transition_grads --out tg.json [--K 4194304]

Rows: torch (the matrix product and the product summed), then each config with both outputs (the
first, or with --split every one, also with G alone and rs alone); every kernel row checked
against the torch one first.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from ssmc.targets import transition_grads as TG


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--K", type=int, default=512 * 8192)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--split", action="store_true", help="time G alone and rs alone for every config")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    K, n = args.K, args.n
    lam, h = torch.randn(K, n, device="cuda", generator=g), torch.randn(K, n, device="cuda", generator=g)
    fr, fm = torch.rand(K, device="cuda", generator=g), torch.randn(n, n, device="cuda", generator=g) / 8
    bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
    Gt = (lam * fr[:, None]).T @ h
    rt = (lam * (h @ fm.T)).sum(1)
    rows = [{"variant": "torch", "ms": bench(lambda: ((lam * fr[:, None]).T @ h, (lam * (h @ fm.T)).sum(1)))}]
    gb = 2 * K * n * 4 / 1e9
    print(f"torch {rows[0]['ms']:.3f} ms ({gb / rows[0]['ms']:.2f} TB/s over lam and h)", flush=True)
    configs = [(64, 4, 4, None), (128, 8, 4, None), (64, 8, 4, None), (32, 4, 4, None), (128, 4, 2, None),
               (64, 4, 1, 2), (32, 2, 8, None), (64, 4, 2, 2), (32, 4, 2, 2)]
    for i, (bk, nw, pps, ns) in enumerate(configs):
        cfg = {"BLOCK_K": bk, "num_warps": nw, "programs_per_sm": pps, "num_stages": ns}
        row = {"variant": "kernel", "config": cfg}
        try:
            G, rs = TG.gram_and_rows(lam, h, fr, fm, cfg)
            row["rel_err"] = max(((G - Gt).norm() / Gt.norm()).item(), ((rs - rt).norm() / rt.norm()).item())
            row["ms"] = bench(lambda: TG.gram_and_rows(lam, h, fr, fm, cfg))
            if i == 0 or args.split:          # each output alone
                row["ms_G"] = bench(lambda: TG.gram_and_rows(lam, h, fr, None, cfg))
                row["ms_rs"] = bench(lambda: TG.gram_and_rows(lam, h, None, fm, cfg))
            print(f"{cfg}: {row['ms']:.3f} ms (G alone {row.get('ms_G', float('nan')):.3f}, rs alone "
                  f"{row.get('ms_rs', float('nan')):.3f}; {gb / row['ms']:.2f} TB/s), rel err {row['rel_err']:.2e}",
                  flush=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"{cfg}: FAILED {row['error']}", flush=True)
        rows.append(row)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "K": K, "n": n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
