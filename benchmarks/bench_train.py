"""Forward+backward of ssmc's regions against mamba-ssm's, side by side in one run (issue: training).

    python -m benchmarks.bench_train --out train.json [--workloads mamba1,mamba2] [--baseline] [--configs]

mamba1: the naive Mamba-1 loop of benchmarks.run (softplus(delta + bias), D, z gate; (b, d, L)
        tensors, bf16 in, fp32 state) at b8 d1536 n16 L2048, compiled by ssmc at L16 and run at
        L2048 (the lowered graph reads L from its inputs), per target. Every input's gradient is
        checked against float64 autograd of the same graph on the torch target before timing.
        --baseline builds mamba-ssm's CUDA selective_scan forward and backward (bf16 and fp32
        only) from the sdist under .carry/ and runs its fwd+bwd on the same inputs.
        --configs times every backward config of the Triton kernel alone, with atomics (at
        L2048, measured once: the deterministic mode within 2% of it; without the gradients of B and C
        20% less, 4.9 against 6.2 ms).
mamba2: the naive Mamba-2 loop at b8 L4096 h24 p64 n128 bf16 (+D, z) against mamba-ssm's
        mamba_chunk_scan_combined forward+backward (chunk 256); gradients checked at L256.

Times are triton.testing.do_bench medians of one whole fwd+bwd (inputs' .grad not kept: the
gradients are returned by torch.autograd.grad); peak memory is the allocator's peak during one
such step above what the inputs hold.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gpu import env_info, lowered_graph, rel  # noqa: E402
from benchmarks.run import mamba1_inputs, mamba1_loop, mamba2_inputs, mamba2_loop  # noqa: E402
from ssmc.runtime.op import lookup  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"     # CPU: a smoke run of the script (--small)


def bench(fn, warmup=5, rep=50):
    if DEV == "cpu":
        import time
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from benchmarks.bench_gpu import bench as gpu_bench
    return gpu_bench(fn, warmup=warmup, rep=rep)


def fwd_bwd(f, ins, dout):
    """() -> gradients of every floating input of f(*ins), for output gradient dout."""
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in ins]
    want = [x for x in xs if x.requires_grad]

    def step():
        out = f(*xs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return torch.autograd.grad(out, want, dout)
    return step


def peak_mb(step) -> float | None:
    if DEV == "cpu":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def grad_errors(got, want) -> list[float]:
    return [rel(g, w) for g, w in zip(got, want)]


def add_timing(row: dict, step, reps=50):
    row["ms"] = bench(step, warmup=5, rep=reps)
    row["peak_MB"] = peak_mb(step)


# -- mamba-1 -------------------------------------------------------------------------------------------

M1 = {"b": 8, "d": 1536, "n": 16}
M1_NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]


def mamba_ssm_calls(ext, ins, dout):
    """mamba-ssm's selective_scan: (forward, forward then backward), as its autograd Function
    calls them; the backward's gradients in M1_NAMES' order."""
    u, delta, A, B, C, D, z, bias = ins
    B4, C4 = B.unsqueeze(1), C.unsqueeze(1)

    def fwd():
        return ext.fwd(u, delta, A, B4, C4, D, z, bias, True)

    def step():
        out, x, out_z = fwd()
        du, ddelta, dA, dB, dC, dD, dbias, dz = ext.bwd(u, delta, A, B4, C4, D, z, bias, dout, x, out, None,
                                                         True, False)[:8]
        return du, ddelta, dA, dB.squeeze(1), dC.squeeze(1), dD, dz, dbias
    return fwd, step


def run_mamba1(res, L, targets, baseline, configs, ncu_once=False, profile=False, no_ckpt=False):
    dtype = torch.bfloat16
    small = mamba1_inputs(M1, 16, dtype, DEV, seed=0)
    graphs = {t: lowered_graph(mamba1_loop, small, target=t) for t in targets}
    gm64, _ = lowered_graph(mamba1_loop, [x.double() for x in small], target="torch")
    ins = mamba1_inputs(M1, L, dtype, DEV, seed=L)
    dout = (torch.randn(M1["b"], M1["d"], L, device=DEV) / 16).to(dtype)
    want = fwd_bwd(gm64, [x.double() for x in ins], dout.double())()
    rows = {}
    if baseline:
        try:
            from benchmarks import baselines as BL
            ext = BL.build_selective_scan_fwd(backward=("bf16_real", "fp32_real"))
            fwd, step = mamba_ssm_calls(ext, ins, dout)
            row = rows["mamba_ssm_cuda"] = {"grad_rel_err": dict(zip(M1_NAMES, grad_errors(step(), want)))}
            add_timing(row, step)
            row["fwd_ms"] = bench(fwd, warmup=5, rep=50)
            print(f"mamba-ssm: {row}", flush=True)
            if profile and DEV == "cuda":
                res.setdefault("profiles", {})["mamba1 mamba_ssm_cuda"] = table = profile_table(step)
                print(table, flush=True)
        except Exception as e:
            rows["mamba_ssm_cuda"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print("mamba-ssm failed:", rows["mamba_ssm_cuda"]["error"], flush=True)
    from ssmc.targets import triton as T
    every = T.CKPT_EVERY
    runs = [(t, g, every) for t, g in graphs.items()]
    if no_ckpt:                          # the same graphs, the training forward keeping no checkpoints
        runs += [(f"{t}_no_forward_checkpoints", g, 0) for t, g in graphs.items()]
    for t, (gm, rep), k in runs:
        T.CKPT_EVERY = k
        row = rows[t] = {"target_used": rep.regions[0].target if rep.regions else None,
                         "forward_checkpoints_every": k}
        step = fwd_bwd(gm, ins, dout)
        errs = grad_errors(step(), want)
        row["grad_rel_err"] = dict(zip(M1_NAMES, errs))
        ok = max(errs) < 5e-2
        if ok:
            add_timing(row, step)
            row["fwd_ms"] = bench(lambda: gm(*ins), warmup=5, rep=50)
            if profile and DEV == "cuda":
                table = profile_table(step)
                res.setdefault("profiles", {})[f"mamba1 {t}"] = table
                print(table, flush=True)
        if rep.regions:
            entry = lookup(rep.regions[0].key)
            note = getattr(entry.kernel, "backward_note", lambda: None)()
            row["backward"] = note
            bwd = getattr(entry.kernel, "bwd", None)
            row["bwd_config"] = getattr(bwd, "config", None)
            row["bwd_timings_ms"] = {cfg: ms for per_bucket in getattr(bwd, "timings", {}).values()
                                     for cfg, ms in per_bucket.items()}
            row["fwd_config"] = getattr(entry.kernel, "config", None)
        print(f"ssmc {t}: {row}", flush=True)
        if ncu_once and ok:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()        # ncu --profile-from-start off profiles this step only
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    T.CKPT_EVERY = every
    base = rows.get("mamba_ssm_cuda", {}).get("ms")
    for t in rows:
        if base and t != "mamba_ssm_cuda" and rows[t].get("ms"):
            rows[t]["speedup_vs_mamba_ssm"] = base / rows[t]["ms"]
    res[f"mamba1_b8_d1536_n16_L{L}_bf16_fwd_bwd"] = rows
    if configs and "triton" in graphs:
        res[f"mamba1_L{L}_bwd_configs"] = bwd_configs(graphs["triton"], ins, dout)


def bwd_configs(graph, ins, dout) -> list:
    """The Triton backward kernel alone, every config, atomics and deterministic, all gradients
    and all but B and C."""
    import ssmc
    from ssmc.targets import triton_bwd as TB
    from ssmc.targets.triton import TritonTarget
    gm, rep = graph
    fwd_kernel = lookup(rep.regions[0].key).kernel
    region = fwd_kernel.region
    # the region's own inputs for this call: record them at the op's entry
    import ssmc.runtime.op as op
    seen, orig = {}, op.check_inputs

    def spy(entry, xs):
        seen["xs"] = list(xs)
        return orig(entry, xs)
    op.check_inputs = spy
    try:
        gm(*ins)
    finally:
        op.check_inputs = orig
    xs = seen["xs"]
    outs = fwd_kernel.forward(xs)
    grads = [torch.randn_like(o) / 16 if o.is_floating_point() else None for o in outs]
    all_needs = [x.is_floating_point() for x in xs]
    rows = []
    for det in (False,):                  # deterministic mode timed the same (H200, this shape)
        kern = TritonTarget().compile(region, "chunked_scan", ssmc.make_options(deterministic=det))
        bk = TB.backward_kernel(kern)
        if isinstance(bk, str):
            return [{"error": bk}]
        for needs_name, needs in (("all", all_needs),):
            call = TB._Call(xs, grads, needs)
            for cfg in bk.candidates(call, bk.arch):
                try:
                    ms = bench(lambda: bk.launch(call, cfg), warmup=3, rep=20)
                except Exception as e:
                    ms = f"{type(e).__name__}: {e}"[:200]
                rows.append({"deterministic": det, "needs": needs_name, "config": cfg, "ms": ms})
                print("bwd", rows[-1], flush=True)
    return rows


# -- mamba-2 -------------------------------------------------------------------------------------------

M2 = {"b": 8, "h": 24, "p": 64, "n": 128}
M2_NAMES = ["x", "dt", "A", "B", "C", "D", "z"]


def profile_table(step, rows=20) -> str:
    """The top CUDA kernels of one call of step (torch.profiler)."""
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def run_mamba2(res, L, targets, baseline, check_L=None, profile=False):
    check_L = check_L or min(L, 256)
    dtype = torch.bfloat16
    small = mamba2_inputs(M2, 16, dtype, DEV, seed=0)
    graphs = {t: lowered_graph(mamba2_loop, small, target=t) for t in targets}
    gm64, _ = lowered_graph(mamba2_loop, [x.double() for x in small], target="torch")
    combined = None
    if baseline:
        try:
            from benchmarks import baselines as BL
            combined, _ = BL.import_mamba_triton()
        except Exception as e:
            res["mamba_ssm_import_error"] = f"{type(e).__name__}: {e}"[:300]

    def mssm(x, dt, A, B, C, D, z):
        return combined(x, dt, A, B[:, :, None], C[:, :, None], chunk_size=256, D=D, z=z)
    rows = {}
    for Lx in sorted({check_L, L}):
        ins = mamba2_inputs(M2, Lx, dtype, DEV, seed=Lx)
        dout = (torch.randn(M2["b"], Lx, M2["h"], M2["p"], device=DEV) / 16).to(dtype)
        want = fwd_bwd(gm64, [x.double() for x in ins], dout.double())() if Lx == check_L else None
        cands = dict(graphs)
        if combined is not None:
            cands["mamba_ssm_chunk_scan_combined"] = (mssm, None)
        for t, (f, rep) in cands.items():
            row = rows.setdefault(t, {})
            step = fwd_bwd(f, ins, dout)
            try:
                got = step()
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            if want is not None:
                row["grad_rel_err_L%d" % Lx] = dict(zip(M2_NAMES, grad_errors(got, want)))
                row["ok"] = max(row["grad_rel_err_L%d" % Lx].values()) < 5e-2
                if rep is not None and rep.regions:
                    row["target_used"] = rep.regions[0].target
                    row["backward"] = getattr(lookup(rep.regions[0].key).kernel, "backward_note", lambda: None)()
            if row.get("ok") and Lx == L:
                add_timing(row, step, reps=20)
                if profile and DEV == "cuda":
                    table = profile_table(step)
                    res.setdefault("profiles", {})[f"mamba2 {t}"] = table
                    print(table, flush=True)
                row["fwd_ms"] = bench(lambda: f(*ins), warmup=5, rep=20)
            print(f"mamba2 L{Lx} {t}: {row}", flush=True)
    base = rows.get("mamba_ssm_chunk_scan_combined", {}).get("ms")
    for t, row in rows.items():
        if base and row.get("ms"):
            row["speedup_vs_mamba_ssm"] = base / row["ms"]
    res[f"mamba2_b8_L{L}_h24_p64_n128_bf16_fwd_bwd"] = rows


def only_variants(names, forward: bool = True, backward: bool = True):
    """Cut the selective-scan forward and/or backward config tables to the entries of `names`
    (an entry without "variant" is the table's default family: "scan" in the backward's, as
    written in the forward's). Every arch keeps at least its first entry."""
    from ssmc.targets import triton as T, triton_bwd as TB
    tables = ([(T, None)] if forward else []) + ([(TB, "scan")] if backward else [])
    for mod, default in tables:
        table = mod.load_configs()
        cut = {k: ([c for c in v if c.get("variant", default) in names] or v[:1]) if isinstance(v, list) else v
               for k, v in table.items()}
        mod.load_configs = lambda cut=cut: cut
        print(f"[bench_train] {mod.__name__} configs: { {k: len(v) for k, v in cut.items() if isinstance(v, list)} }", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="mamba1,mamba2")
    ap.add_argument("--targets", default="triton,auto")
    ap.add_argument("--baseline", action="store_true")
    ap.add_argument("--configs", action="store_true")
    ap.add_argument("--m1-length", type=int, default=2048)
    ap.add_argument("--m2-length", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="a torch.profiler table of one fwd+bwd per row")
    ap.add_argument("--m1-no-ckpt", action="store_true", help="Mamba-1 rows again with the training forward "
                    "keeping no checkpoints (the backward runs the forward recurrence itself)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--ncu-once", action="store_true", help="one more mamba1 fwd+bwd per target between "
                    "cudaProfilerStart/Stop (ncu --profile-from-start off)")
    ap.add_argument("--core-config", default="", help='JSON merged into ssd_core.CONFIG per kernel, '
                    'e.g. \'{"core": {"CHUNK": 128}, "bwd_dbc": {"heads": "atomic"}}\'')
    ap.add_argument("--m1-variants", default="", help="only these variants of the Mamba-1 forward and "
                    "backward config tables (e.g. seq4: fewer compiles in a short GPU call)")
    args = ap.parse_args()
    if args.m1_variants:
        only_variants(args.m1_variants.split(","))
    from ssmc.targets import ssd_core
    with ssd_core.overridden(json.loads(args.core_config or "{}")):
        run_all(args)


def run_all(args):
    from ssmc.targets import ssd_core
    if args.small:
        M1.update(b=2, d=8, n=4)
        M2.update(b=2, h=2, p=4, n=8)
    res = {"env": env_info() if DEV == "cuda" else {"device": "cpu"}}
    res["ssd_core_config"] = ssd_core.CONFIG
    targets = args.targets.split(",")
    out = Path(args.out)
    for w in args.workloads.split(","):
        try:
            if w == "mamba1":
                run_mamba1(res, args.m1_length, targets, args.baseline, args.configs, args.ncu_once,
                           profile=args.profile, no_ckpt=args.m1_no_ckpt)
            elif w == "mamba2":
                run_mamba2(res, args.m2_length, targets, args.baseline, profile=args.profile)
        except Exception as e:
            res[f"{w}_error"] = f"{type(e).__name__}: {e}"[:500]
            import traceback
            traceback.print_exc()
        out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str)[:3000])


if __name__ == "__main__":
    main()
