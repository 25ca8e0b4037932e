"""GPU benchmarks, side by side in one run. Writes JSON (and prints a table).

    python -m benchmarks.bench_gpu --out results.json [--workloads mamba1,block,compile]

mamba1:  the Mamba-1 region (softplus(dt + bias), D, z gate; bf16 in, fp32 state) at
         b8 d1536 n16, L 2048 and 4096, for each ssmc target, against mamba-ssm's CUDA
         selective_scan forward and torch associative_scan + Inductor. Checked against a float64
         reference first (fresh random inputs), then timed with triton.testing.do_bench (median).
block:   the naive Mamba block of examples/naive_mamba.py at b8 L2048 d_model 768, ssmc vs eager,
         time and peak memory, once per --block-targets entry (default auto).
compile: cold and warm compile time of that block at L2048 (warm = a second process, caches kept).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ssmc  # noqa: E402
from benchmarks import baselines  # noqa: E402
from benchmarks.run import Lowered, mamba1_loop as mamba1_naive  # noqa: E402  (one naive loop for both)

H200_BW = 4.3e12          # measured device-to-device copy, bytes/s (read + write)


def env_info():
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "capability": "sm_%d%d" % torch.cuda.get_device_capability()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except ImportError:
        pass
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    info["commit"] = os.environ.get("SSMC_COMMIT") or subprocess.run(    # the device copy's .git may be stale
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    info["ssmc"] = ssmc.__version__
    return info


def bench(fn, warmup=25, rep=100):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# -- inputs of the naive Mamba-1 loop (benchmarks.run.mamba1_loop), in mamba-ssm's layout -----------

def mamba1_inputs(b, d, n, L, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    u = r(b, d, L).to(dtype)
    delta = (r(b, d, L) * 0.5 - 1.0).to(dtype)
    A = -torch.exp(r(d, n) * 0.5)                 # fp32, as mamba-ssm keeps it
    B, C = r(b, n, L).to(dtype), r(b, n, L).to(dtype)
    D = r(d)
    z = r(b, d, L).to(dtype)
    delta_bias = r(d) * 0.1
    return u, delta, A, B, C, D, z, delta_bias


def lowered_graph(fn, small_inputs, **options):
    """Compile fn with ssmc on short inputs; the lowered graph reads L from its inputs, so it
    runs the same region at any length (Dynamo would otherwise re-capture L steps)."""
    holder = {}

    def backend(gm, ex):
        report = ssmc.Report()
        out = ssmc.ssmc_backend(gm, ex, options={"rest": "eager", **options}, _report=report)
        holder["gm"], holder["report"] = gm, report
        return out
    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*small_inputs)
    return Lowered(holder["gm"], fn), holder["report"]


def mamba1_floors(b, d, n, L, dtype):
    es = torch.tensor([], dtype=dtype).element_size()
    bytes_ = (3 * b * d * L + 2 * b * n * L + b * d * L) * es      # u, delta, z, B, C in; y out
    return bytes_, b * d * n * L


def run_mamba1(res, lengths, targets):
    b, d, n = 8, 1536, 16
    dtype = torch.bfloat16
    small = mamba1_inputs(b, d, n, 16, dtype, seed=0)
    graphs = {}
    for t in targets:
        gm, rep = lowered_graph(mamba1_naive, small, target=t)
        graphs[t] = (gm, rep)
        r = rep.regions[0] if rep.regions else None
        res.setdefault("mamba1_compile", {})[t] = {
            "target_used": r.target if r else None, "notes": r.notes if r else [],
            "fallbacks": [list(f) for f in rep.fallbacks]}
    small64 = [x.double() if x.is_floating_point() else x for x in small]
    gm64, _ = lowered_graph(mamba1_naive, small64, target="torch")
    try:
        ext = baselines.build_selective_scan_fwd()
    except Exception as e:
        ext = None
        res["mamba_ssm_build_error"] = f"{type(e).__name__}: {e}"
    assoc = torch.compile(baselines.assoc_scan_mamba1)
    for L in lengths:
        ins = mamba1_inputs(b, d, n, L, dtype, seed=L)
        ref = gm64(*[x.double() for x in ins])[0]
        row = {}
        byts, exps = mamba1_floors(b, d, n, L, dtype)
        for t, (gm, rep) in graphs.items():
            out = gm(*ins)[0]
            err = rel(out, ref)
            ms = bench(lambda: gm(*ins)) if err < 2e-2 else None
            row[t] = {"ms": ms, "rel_err": err}
        if ext is not None:
            u, delta, A, B, C, D, z, bias = ins
            B4, C4 = B.unsqueeze(1), C.unsqueeze(1)        # (b, groups=1, n, L), as selective_scan_fn passes them
            f = lambda: ext.fwd(u, delta, A, B4, C4, D, z, bias, True)
            try:
                out = f()[2]
                row["mamba_ssm_cuda"] = {"ms": bench(f), "rel_err": rel(out, ref)}
            except Exception as e:
                row["mamba_ssm_cuda"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        try:
            out = assoc(*ins)
            row["assoc_scan_inductor"] = {"ms": bench(lambda: assoc(*ins)), "rel_err": rel(out, ref)}
        except Exception as e:
            row["assoc_scan_inductor"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        for k, v in row.items():
            if v.get("ms"):
                v["GB_per_s"] = byts / (v["ms"] * 1e-3) / 1e9
                v["frac_of_byte_floor"] = (byts / H200_BW) / (v["ms"] * 1e-3)
                v["Gexp_per_s"] = exps / (v["ms"] * 1e-3) / 1e9
        base = row.get("mamba_ssm_cuda", {}).get("ms")
        if base:
            for k, v in row.items():
                if v.get("ms"):
                    v["speedup_vs_mamba_ssm"] = base / v["ms"]
        res[f"mamba1_b{b}_d{d}_n{n}_L{L}_bf16"] = row
        print(f"L={L}: " + ", ".join(f"{k} {v.get('ms') or 0:.3f} ms (err {v.get('rel_err', float('nan')):.1e})"
                                     for k, v in row.items()), flush=True)
    res["floors"] = {"bytes_L4096": mamba1_floors(b, d, n, 4096, dtype)[0], "copy_bw": H200_BW}


def run_block(res, L=2048, target="auto"):
    from examples.naive_mamba import NaiveMamba
    torch.manual_seed(0)
    model = NaiveMamba(768).cuda()
    u = torch.randn(8, L, 768, device="cuda")
    torch._dynamo.reset()
    t0 = time.perf_counter()
    fast = torch.compile(model, backend="ssmc", options={"target": target})
    with torch.no_grad():
        y = fast(u)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        report = ssmc.backend.LAST_REPORT
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        ref = model(u)
        torch.cuda.synchronize()
        eager_peak = torch.cuda.max_memory_allocated() - base_mem
        err = rel(y, ref)
        t_eager = bench(lambda: model(u), warmup=1, rep=3)
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        fast(u)
        torch.cuda.synchronize()
        ssmc_peak = torch.cuda.max_memory_allocated() - base_mem
        t_ssmc = bench(lambda: fast(u))
    key = f"naive_block_b8_L{L}_d768" + ("" if target == "auto" else f"_{target}")
    res[key] = {
        "eager_ms": t_eager, "ssmc_ms": t_ssmc, "speedup": t_eager / t_ssmc, "rel_err_vs_eager": err,
        "eager_peak_bytes": eager_peak, "ssmc_peak_bytes": ssmc_peak, "first_call_s": compile_s,
        "ssmc_compile_ms": report.graphs[0].compile_ms if report.graphs else None,
        "regions": [(r.name, r.strategy, r.target) for r in report.regions],
        "fallbacks": [list(f) for f in report.fallbacks]}
    print(json.dumps(res[key], indent=1), flush=True)


def run_compile(res, L=2048):
    """Cold: fresh ssmc and Triton caches; warm: a second process reusing them."""
    code = (f"import time, torch, sys; sys.path.insert(0, {str(ROOT)!r});"
            "from examples.naive_mamba import NaiveMamba; torch.manual_seed(0);"
            f"m = NaiveMamba(768).cuda(); u = torch.randn(8, {L}, 768, device='cuda');"
            "t0 = time.perf_counter(); f = torch.compile(m, backend='ssmc');"
            "torch.no_grad().__enter__(); f(u); torch.cuda.synchronize();"
            "import ssmc; g = ssmc.backend.LAST_REPORT.graphs[0];"
            "print('RESULT', time.perf_counter() - t0, g.compile_ms)")
    env = dict(os.environ, SSMC_CACHE_DIR="/tmp/ssmc_cold_cache", TRITON_CACHE_DIR="/tmp/ssmc_cold_triton")
    out = {}
    for phase in ("cold", "warm"):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
        if not line:
            out[phase] = {"error": p.stderr[-1500:]}
            continue
        _, total, ssmc_ms = line[0].split()
        out[phase] = {"first_call_s": float(total), "ssmc_s": float(ssmc_ms) / 1e3}
    res[f"compile_block_L{L}"] = out
    print(json.dumps(out, indent=1), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="mamba1,block,compile")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--targets", default="triton,cuda,torch")
    ap.add_argument("--block-targets", default="auto", help="ssmc targets the block runs with, e.g. auto,triton")
    args = ap.parse_args()
    res = {"env": env_info()}
    work = args.workloads.split(",")
    for w in work:
        try:
            if w == "mamba1":
                run_mamba1(res, [int(x) for x in args.lengths.split(",")], args.targets.split(","))
            elif w == "block":
                for t in args.block_targets.split(","):
                    run_block(res, target=t)
            elif w == "compile":
                run_compile(res)
        except Exception as e:
            import traceback
            res[f"{w}_error"] = traceback.format_exc()[-3000:]
            print(res[f"{w}_error"], flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
