"""Mixture-of-experts SSM: one grouped launch against ssmc's single-expert kernels one at a time.

    python -m benchmarks.bench_moe --out benchmarks/results/h200_moe.json     # GPU: the issue's shapes
    python -m benchmarks.bench_moe --tiny --out /tmp/moe.json                  # CPU, tiny shapes
    python -m benchmarks.bench_moe --variant scan --out h200_moe_scan.json    # only the scan configs (comma list)

8 experts with d_state 8, 8, 16, 16, 32, 32, 64, 64 (each its own A, B/C projections, D, bias),
b64 d1536 L2048, bf16 activations, fp32 state; routing "balanced" (a random permutation cut
into equal parts) and "skewed" (experts drawn with probabilities 0.3, 0.2, 0.15, 0.1, 0.1,
0.05, 0.05, 0.05). Each expert's recurrence is captured through torch's scan op (one FX node
at any length); ``--form loop`` writes it as the naive Python loop (Dynamo unrolls it, so
short lengths only; the default with --tiny). Both give the same region.

Per routing, in this order (a failing row records its error and the next row runs):
1. check: the compiled layer (moe_grouping on) against the float64 eager layer;
2. ssm_grouped: the grouped kernel alone, one launch for all experts, on the region inputs the
   compiled layer passed it;
3. ssm_per_expert: the same compiled per-expert region's kernel called once per expert on the
   same inputs (what ssmc runs with moe_grouping switched off);
4. layer_grouped / layer_per_expert: the whole compiled layer (gathers, projections, scatters
   included) with moe_grouping on / off (``disable_passes``);
5. ssm_grouped_bwd / ssm_per_expert_bwd: the backward of the grouped kernel (one launch) and of
   the member kernel once per expert, on the same output gradients (their gradients compared);
6. eager: the eager layer at --eager-L (the loop is slow), for reference.
Times are medians of triton.testing.do_bench on a GPU (of repeated perf_counter runs on CPU).
The padded work / useful work of the grouped launch is recorded with each row.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from programs import mamba1_expert  # noqa: E402   (the naive per-expert loop the tests use)

STATES = (8, 8, 16, 16, 32, 32, 64, 64)
SKEW = (0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05)


def expert(x, dt, A, B, C, D, bias):
    """One expert: h = exp(delta*A) h + delta*x*B, y = sum_n h*C + D*x (fp32 state)."""
    def step(h, xs):
        x_t, dt_t, B_t, C_t = xs
        delta = F.softplus(dt_t + bias)
        h = torch.exp(delta[..., None] * A) * h + (delta * x_t)[..., None] * B_t[:, None]
        return h, (h * C_t[:, None]).sum(-1)
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h0 = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=sdt, device=x.device)
    _, ys = scan(step, h0, (x, dt, B, C), dim=1)
    if ys.shape[1] != x.shape[1]:            # torch < 2.13 stacks scan outputs along dim 0
        ys = ys.movedim(0, 1)
    return (ys + D * x).to(x.dtype)


def make_layer(run_expert):
    def moe_layer(x, dt, idxs, params):
        """The naive mixture: gather each expert's sequences, run it, scatter back."""
        out = torch.zeros_like(x)
        for idx, (A, WB, WC, D, bias) in zip(idxs, params):
            xe = x[idx]
            out[idx] = run_expert(xe, dt[idx], A, xe @ WB, xe @ WC, D, bias)
        return out
    return moe_layer


LAYERS = {"scan": make_layer(expert), "loop": make_layer(mamba1_expert)}   # loop: Dynamo unrolls it
moe_layer = LAYERS["scan"]


def make_inputs(b, d, L, states, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    x, dt = r(b, L, d).to(device, dtype), (r(b, L, d) * 0.5 - 1.0).to(device, dtype)
    params = []
    for n in states:
        params.append(((-torch.rand(d, n, generator=g) - 0.1).to(device),        # A, fp32
                       (r(d, n) / d ** 0.5).to(device, dtype), (r(d, n) / d ** 0.5).to(device, dtype),
                       r(d).to(device), (r(d) * 0.1).to(device)))
    return x, dt, params


def routing(kind, b, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        route = torch.randperm(b, generator=g) % E
    else:
        route = torch.multinomial(torch.tensor(SKEW[:E] if E <= len(SKEW) else [1.0] * E), b,
                                  replacement=True, generator=g)
    return [torch.nonzero(route == e).squeeze(1).to(device) for e in range(E)]


def double(params):
    return [tuple(p.double() for p in ps) for ps in params]


def bench(fn, gpu: bool, reps: int) -> float:
    if gpu:
        import triton.testing
        fn()                                  # first call: autotuning, compiles
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def compiled_layer(moe_layer, disable: list, rest: str):
    import ssmc
    report = ssmc.Report()
    opts = {"rest": rest, "disable_passes": disable}

    def backend(gm, ex):
        return ssmc.ssmc_backend(gm, ex, options=opts, _report=report)
    torch._dynamo.reset()
    return torch.compile(moe_layer, backend=backend), report


def record_groups(entry):
    """The per-group inputs the compiled layer hands the grouped kernel (wraps forward once)."""
    seen = {}
    fwd = entry.kernel.forward

    def spy(groups):
        seen["groups"] = [list(g) for g in groups]
        return fwd(groups)
    entry.kernel.forward = spy
    return seen, lambda: setattr(entry.kernel, "forward", fwd)


class _Skip(Exception):
    pass


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(args) -> dict:
    from ssmc.runtime.op import lookup
    from ssmc.targets.moe import _rows, describe_padding, padding
    gpu = torch.cuda.is_available() and not args.tiny
    device = "cuda" if gpu else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, d, L = args.b, args.d, args.L
    states = tuple(int(s) for s in args.states.split(","))
    res = {"config": {"b": b, "d": d, "L": L, "states": states, "dtype": args.dtype, "device": device, "form": args.form,
                      "eager_L": args.eager_L, "variant": args.variant, "fwd_variants": args.fwd_variants,
                      "bwd_variants": args.bwd_variants}, "env": env_info(gpu), "rows": []}
    x, dt, params = make_inputs(b, d, L, states, dtype, device)
    layer = LAYERS[args.form]
    for kind in args.routings.split(","):
        idxs = routing(kind, b, len(states), device, seed=1)
        counts = [int(i.numel()) for i in idxs]
        row = {"routing": kind, "sequences_per_expert": counts, "error": None}
        res["rows"].append(row)
        print(f"[bench_moe] routing {kind}: sequences per expert {counts}", flush=True)
        try:
            fast, report = compiled_layer(layer, [], args.rest)
            out = fast(x, dt, idxs, params)
            grp = report.groups[0] if report.groups else None
            row["group_status"] = grp.status if grp else "no group formed"
            if grp is None or not grp.key:
                raise RuntimeError(f"moe_grouping did not group the experts: {row['group_status']}; "
                                   f"fallbacks {report.fallbacks}")
            entry = lookup(grp.key)
            seen, restore = record_groups(entry)
            fast(x, dt, idxs, params)
            restore()
            groups = seen["groups"]
            print(f"[bench_moe]   grouped kernel: {entry.kernel.describe()}", flush=True)
            ref = layer(x.double(), dt.double(), idxs, double(params))
            row["rel_err_vs_float64"] = rel_err(out, ref)
            del ref
            print(f"[bench_moe]   check: rel. error vs float64 {row['rel_err_vs_float64']:.2e}", flush=True)
            stats = entry.kernel.stats or padding(entry.region, groups)
            row["useful_work"], row["computed_work"] = stats["useful"], stats["computed"]
            row["padded_over_useful"] = stats["wasted_fraction"]
            row["padded_over_useful_if_padded_to_max"] = stats["wasted_fraction_if_padded_to_max"]
            row["padding"] = describe_padding(stats)
            row["grouped_kernel"] = entry.kernel.kind
            row["grouped_config"] = getattr(entry.kernel, "config", None)
            row["grouped_config_ms"] = {str(k): v for k, v in getattr(entry.kernel, "timings", {}).items()}
            member = entry.kernel.member
            times = {}
            ts = {"ssm_grouped": lambda: entry.kernel.forward(groups),
                  "ssm_per_expert": lambda: [member.forward(g) for g in groups if _rows(entry.region, g)]}
            for name, fn in ts.items():
                try:
                    times[name] = bench(fn, gpu, args.reps)
                    print(f"[bench_moe]   {name}: {times[name]:.3f} ms", flush=True)
                except Exception as e:
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                    print(f"[bench_moe]   {name} FAILED: {e}", flush=True)
            for name, disable in (("layer_grouped", []), ("layer_per_expert", ["moe_grouping"])):
                if name in args.skip:
                    continue
                try:
                    f, rep = compiled_layer(layer, disable, args.rest) if disable else (fast, report)
                    f(x, dt, idxs, params)
                    times[name] = bench(lambda: f(x, dt, idxs, params), gpu, args.reps)
                    print(f"[bench_moe]   {name}: {times[name]:.3f} ms", flush=True)
                except Exception as e:
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                    print(f"[bench_moe]   {name} FAILED: {e}", flush=True)
            if "bwd" not in args.skip:        # the backward: one grouped launch against per expert
                live = [i for i, g in enumerate(groups) if _rows(entry.region, g)]
                outs = entry.kernel.forward(groups)
                gen = torch.Generator(device=device).manual_seed(5)
                grads = [[torch.randn(o.shape, device=device, generator=gen).to(o.dtype) / 16 for o in os_]
                         for os_ in outs]
                needs = [[x.is_floating_point() for x in g] for g in groups]
                try:
                    got = entry.kernel.backward(groups, grads, needs)
                    row["grouped_bwd"] = entry.kernel.describe()
                    per = [member.backward(groups[i], grads[i], needs[i]) for i in live]
                    row["bwd_rel_err_grouped_vs_per_expert"] = max(
                        rel_err(a, b) for i, p_ in zip(live, per) for a, b in zip(got[i], p_) if b is not None)
                    print(f"[bench_moe]   backward: {row['grouped_bwd']}; grouped against per expert "
                          f"{row['bwd_rel_err_grouped_vs_per_expert']:.2e}", flush=True)
                    for name, fn in (("ssm_grouped_bwd", lambda: entry.kernel.backward(groups, grads, needs)),
                                     ("ssm_per_expert_bwd", lambda: [member.backward(groups[i], grads[i], needs[i])
                                                                     for i in live])):
                        times[name] = bench(fn, gpu, args.reps)
                        print(f"[bench_moe]   {name}: {times[name]:.3f} ms", flush=True)
                except Exception as e:
                    row["bwd_error"] = f"{type(e).__name__}: {e}"[:500]
                    print(f"[bench_moe]   backward FAILED: {e}", flush=True)
                if "ssm_grouped_bwd" in times and "ssm_per_expert_bwd" in times:
                    row["speedup_ssm_bwd"] = times["ssm_per_expert_bwd"] / times["ssm_grouped_bwd"]
            row["ms"] = times
            if "ssm_grouped" in times and "ssm_per_expert" in times:
                row["speedup_ssm"] = times["ssm_per_expert"] / times["ssm_grouped"]
            if "layer_grouped" in times and "layer_per_expert" in times:
                row["speedup_layer"] = times["layer_per_expert"] / times["layer_grouped"]
            try:
                if not args.eager_L or "eager" in args.skip:
                    raise _Skip()
                xe, dte = x[:, :args.eager_L].contiguous(), dt[:, :args.eager_L].contiguous()
                row["eager_ms_at_eager_L"] = bench(lambda: layer(xe, dte, idxs, params), gpu, 1 if gpu else args.reps)
                print(f"[bench_moe]   eager at L{args.eager_L}: {row['eager_ms_at_eager_L']:.3f} ms", flush=True)
            except _Skip:
                pass
            except Exception as e:
                row["eager_error"] = f"{type(e).__name__}: {e}"
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()
            print(f"[bench_moe]   FAILED: {row['error']}", flush=True)
        print(f"[bench_moe]   row: {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}", flush=True)
        write(args.out, res)                   # after every row: a run cut short keeps its rows
    return res


def write(path, res):
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


def env_info(gpu: bool) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    except Exception:
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    if gpu:
        info["gpu"] = torch.cuda.get_device_name()
        info["driver"] = torch.version.cuda
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (a smoke test)")
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--states", default=",".join(map(str, STATES)))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--routings", default="balanced,skewed")
    ap.add_argument("--eager-L", dest="eager_L", type=int, default=256, help="0: no eager row")
    ap.add_argument("--form", default=None, choices=list(LAYERS),
                    help="expert written with torch's scan op (default) or as a Python loop (default with --tiny)")
    ap.add_argument("--rest", default="eager", help="how the rest of the layer runs: eager | inductor | auto")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per row on CPU")
    ap.add_argument("--skip", default="", help="rows to leave out: layer_grouped,layer_per_expert,eager,bwd")
    ap.add_argument("--variant", default=None,
                    help="only the grouped kernel's configs of these variants, comma-separated (those "
                         "of templates/triton/moe_scan_fwd.configs.json; default: all, autotuned)")
    ap.add_argument("--fwd-variants", default="",
                    help="cut the single-region forward's config table to these variants (e.g. seq4): the "
                         "per-expert forward kernels autotune within them only (a shorter GPU call; the "
                         "per-expert forward row is then not the fully tuned baseline)")
    ap.add_argument("--bwd-variants", default="",
                    help="cut the single-region backward's config table to these variants (e.g. seq4), for the "
                         "per-expert backward and the grouped one's candidates alike: a shorter GPU call")
    args = ap.parse_args(argv)
    from ssmc.targets import triton as T, triton_bwd as TB
    tables = (T.load_configs, TB.load_configs)       # put back after the run (only_variants replaces them)
    if args.fwd_variants or args.bwd_variants:
        from benchmarks.bench_train import only_variants
        if args.fwd_variants:
            only_variants(set(args.fwd_variants.split(",")), backward=False)
        if args.bwd_variants:
            only_variants(set(args.bwd_variants.split(",")), forward=False)
    args.skip = set(filter(None, args.skip.split(",")))
    args.form = args.form or ("loop" if args.tiny else "scan")
    if args.tiny:
        args.b, args.d, args.L, args.dtype = 8, 8, 8, "fp32"
        args.eager_L = min(args.eager_L, 8)
        args.states = "2,3,4,5"
    print(f"[bench_moe] {vars(args)}", flush=True)
    if args.variant:
        from ssmc.targets import moe as M
        wanted = set(args.variant.split(","))
        if wanted - set(M.config_variants()):
            ap.error(f"--variant: unknown {sorted(wanted - set(M.config_variants()))}; "
                     f"the table's: {', '.join(M.config_variants())}")
        table = {k: [c for c in v if M.variant_of(c) in wanted] if isinstance(v, list) else v
                 for k, v in M.load_configs().items()}
        restore, M.load_configs = M.load_configs, lambda: table
    try:
        res = run(args)
    except Exception as e:   # still write what there is
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(), "rows": []}
        print(f"[bench_moe] FAILED: {res['error']}", flush=True)
    if args.variant:
        M.load_configs = restore
    T.load_configs, TB.load_configs = tables
    write(args.out, res)
    print(f"[bench_moe] wrote {args.out}", flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
