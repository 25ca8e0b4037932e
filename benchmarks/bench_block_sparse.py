"""Block-sparse transitions (issue 9), side by side in one run. Writes JSON as it goes.

    python -m benchmarks.bench_block_sparse --out results.json          # GPU: the issue's shape
    python -m benchmarks.bench_block_sparse --tiny --out tiny.json      # CPU smoke run

The recurrence (tests/block_sparse_programs.py `euler_matmul`): h = h + dt * (h @ (A*mask).T)
+ B x, readout sum_n h*C; x, dt, B, C bf16, A and the state fp32. Shape: b32, L4096,
256 channels, d_state 64, 8x8 blocks, 25% block density (the diagonal blocks and one more
per block row). Rows:
  ssmc block-sparse [t]   the sparse mask through ssmc (strategy block_sparse) on target t
  ssmc dense A [t]        the same program with an all-ones mask through ssmc (every block)
  eager loop          the naive loop in eager PyTorch, at a smaller L (labelled), on fp32 copies
                      of the bf16 inputs (eager PyTorch cannot multiply the program's bf16 state
                      by the fp32 A; ssmc keeps the state in fp32)
Each ssmc row is first checked against a float64 eager run at L256 (same b and d), then timed with
triton.testing.do_bench (median; perf_counter medians on CPU). Time per nonzero block and
step is reported against dense; the summary compares the fastest sparse row with the fastest
dense one. A row that fails is recorded with its error; the JSON is
rewritten after every row. With --backward, also forward+backward of the sparse mask (the
gradients of x, dt, A, B, C; ssmc/targets/mix_adjoint.py) per target, its gradients checked
against float64 autograd at L256 first, and the eager loop's forward+backward at the eager length.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import ssmc  # noqa: E402
from block_sparse_programs import euler_matmul  # noqa: E402

FULL = dict(b=32, L=4096, d=256, n=64, bs=8, density=0.25, eager_L=512)
TINY = dict(b=2, L=32, d=12, n=16, bs=4, density=0.25, eager_L=16)


def say(msg):
    print(msg, flush=True)


def make_mask(n, bs, density, gen):
    """Diagonal blocks plus random others up to `density` of the blocks."""
    nb = n // bs
    blocks = torch.eye(nb, dtype=torch.bool)
    extra = max(0, round(density * nb * nb) - nb)
    off = (~blocks).flatten().nonzero().flatten()
    blocks.view(-1)[off[torch.randperm(len(off), generator=gen)[:extra]]] = True
    return blocks.repeat_interleave(bs, 0).repeat_interleave(bs, 1).float()


def make_inputs(b, L, d, n, mask, dev, gen, seq_dtype):
    r = lambda *s: torch.randn(*s, generator=gen)
    A = (-torch.eye(n) + 0.5 * r(n, n) / n ** 0.5)          # stable: I + dt*A contracts
    dt = torch.rand(b, L, d, generator=gen) * 0.1
    x, B, C = r(b, L, d), r(b, L, n), r(b, L, n)
    seq = [t.to(dev, seq_dtype) for t in (x, dt)]
    return (seq[0], seq[1], A.to(dev), mask.to(dev), B.to(dev, seq_dtype), C.to(dev, seq_dtype))


def timer(dev):
    if dev.type == "cuda":
        import triton.testing

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        return bench

    def bench(fn, reps=5):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    return bench


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _choice(text: str):
    """'1,m2' -> (1, "m2"); '4,False' -> (4, False) (a lane instance)."""
    w, v = (x.strip() for x in text.split(","))
    return int(w), {"False": False, "True": True}.get(v, v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--targets", default=None,
                    help="ssmc targets, comma-separated, each a row pair (default: cuda,triton on CUDA, torch on CPU)")
    ap.add_argument("--backward", action="store_true",
                    help="also time forward+backward of the sparse mask per target, and of the eager loop")
    ap.add_argument("--backward-only", action="store_true", help="--backward without the forward rows")
    ap.add_argument("--step-elements", default="",
                    help="with --backward: comma-separated sizes of the backward's chunk tensors "
                         "(mix_adjoint's STEP_ELEMENTS and GPU_STEP_ELEMENTS), a row each (default: its own)")
    ap.add_argument("--sums", default="kernel",
                    help="with --backward: comma-separated, a row each: 'kernel' (the backward's two-factor "
                         "sums by the mul_sum kernel where it runs them) and/or 'torch' (by torch ops)")
    ap.add_argument("--profile", action="store_true",
                    help="with --backward: one forward+backward under torch.profiler, its top ops in the row")
    ap.add_argument("--choices", default="",
                    help="kernel choices to time, each forced in turn, ';'-separated 'warps,variant' "
                         "(e.g. '1,m2;4,m2'; 'w,False' for a lane instance); default: the autotuner's pick "
                         "among all")
    ap.add_argument("--batch", type=int, default=None, help="batch size instead of the shape's (32)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                    help="x, dt, B, C dtype (default: bf16 on CUDA, fp32 on CPU); A and the state are fp32")
    args = ap.parse_args(argv)
    if set(args.sums.split(",")) - {"kernel", "torch"}:
        ap.error(f"--sums: {args.sums!r}: each must be 'kernel' or 'torch'")
    cfg = dict(TINY if args.tiny else FULL)
    if args.batch:
        cfg["b"] = args.batch
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    targets = (args.targets or ("cuda,triton" if dev.type == "cuda" else "torch")).split(",")
    seq_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    from benchmarks.bench_gpu import lowered_graph
    out = Path(args.out)
    res = {"env": {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                   "torch": torch.__version__, "ssmc": ssmc.__version__, "targets": targets,
                   "config": cfg, "seq_dtype": str(seq_dtype).replace("torch.", ""), "state_dtype": "float32"},
           "rows": []}
    try:
        import subprocess
        import os
        res["env"]["commit"] = os.environ.get("SSMC_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        import triton
        res["env"]["triton"] = triton.__version__
    except Exception:
        pass

    def write():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))

    gen = torch.Generator().manual_seed(0)
    b, L, d, n, bs = cfg["b"], cfg["L"], cfg["d"], cfg["n"], cfg["bs"]
    sparse = make_mask(n, bs, cfg["density"], gen)
    nnz = int(sparse[::bs, ::bs].sum())
    say(f"block-sparse benchmark on {res['env']['device']}: b{b} L{L} channels {d} d_state {n}, "
        f"{bs}x{bs} blocks, {nnz}/{(n // bs) ** 2} nonzero, targets {targets}")
    bench = timer(dev)
    # The lowered graph reads L from its inputs but keeps the batch and channel sizes of the
    # capture (the loop's zero initial state is built at those), so capture, check and timing
    # share b and d and differ in L only.
    small = dict(b=b, L=min(L, 16), d=d)
    check = dict(b=b, L=min(L, 256), d=d)
    cases = [(f"ssmc {kind} [{t}]", m, t) for t in targets
             for kind, m in (("block-sparse", sparse), ("dense A", torch.ones(n, n)))]
    if args.backward_only:
        args.backward, cases = True, []
    forced = [_choice(c) for c in args.choices.split(";") if c.strip()]
    for label, mask, target in cases:
        row = {"variant": label, "L": L, "b": b, "channels": d, "d_state": n}
        try:
            say(f"[{label}] compiling (captured at L{small['L']}, reused at any L)")
            t0 = time.perf_counter()
            fn, report = lowered_graph(euler_matmul, make_inputs(n=n, mask=mask, dev=dev, gen=gen,
                                                                 seq_dtype=seq_dtype, **small), target=target)
            row["compile_s"] = time.perf_counter() - t0
            info = report.regions[0]
            row.update(strategy=info.strategy, target=info.target, block=info.ir.mix.block,
                       nonzero_blocks=len(info.ir.mix.blocks), density=info.ir.mix.density,
                       strategy_reason=info.strategy_reason)
            from ssmc.runtime.op import lookup
            kern = lookup(info.key).kernel
            say(f"[{label}] {info.strategy} on {info.target}: {info.strategy_reason}")
            if "block_sparse" not in {p.name for p in report.passes}:
                raise RuntimeError("the block_sparse pass is not registered: reinstall ssmc "
                                   "(pip install -e .) so its entry point is found")
            if info.target != target:
                raise RuntimeError(f"the region runs on {info.target}, not {target}: {info.target_reasons}")
            ins = make_inputs(n=n, mask=mask, dev=dev, gen=gen, seq_dtype=seq_dtype, **check)
            got = fn(*ins)
            got = got[0] if isinstance(got, (tuple, list)) else got
            ref = euler_matmul(*[t.double() for t in ins])
            row["rel_err_vs_float64"] = rel(got, ref)
            row["check_shape"] = check
            say(f"[{label}] rel err vs float64 at b{check['b']} L{check['L']}: {row['rel_err_vs_float64']:.3g}")
            if forced and not hasattr(kern, "force_groups"):
                raise RuntimeError(f"--choices: the {info.target} kernel has no choices to force")
            mine = [c for c in forced if c in kern.choices()] if forced else []
            if forced and len(mine) < len(forced):
                row["choices_not_offered"] = [str(c) for c in forced if c not in mine]
                say(f"[{label}] --choices not offered for this mask: {row['choices_not_offered']}")
            if hasattr(kern, "choices") and hasattr(kern, "force_groups"):      # every kernel the timing may pick
                row["rel_err_per_choice"] = {}
                try:
                    for c in mine or kern.choices():
                        kern.force_groups = c
                        o = fn(*ins)
                        o = o[0] if isinstance(o, (tuple, list)) else o
                        row["rel_err_per_choice"][str(c)] = rel(o, ref)
                finally:                  # the timing below picks among all of them again
                    kern.force_groups = None
                say(f"[{label}] rel err per kernel choice: {row['rel_err_per_choice']}")
            if getattr(kern, "fallback", None):
                row["fallback"] = kern.fallback
            ins = make_inputs(b=b, L=L, d=d, n=n, mask=mask, dev=dev, gen=gen, seq_dtype=seq_dtype)
            if mine:                          # each forced choice timed; the row's time is the fastest
                row["ms_per_choice"] = {}
                for c in mine:
                    kern.force_groups = c
                    row["ms_per_choice"][str(c)] = bench(lambda: fn(*ins))
                    say(f"[{label}] {c}: {row['ms_per_choice'][str(c)]:.3f} ms")
                best = min(mine, key=lambda c: row["ms_per_choice"][str(c)])
                kern.force_groups = best
            row["ms"] = bench(lambda: fn(*ins))
            if getattr(kern, "config", None):
                row["config"] = kern.config
            if getattr(kern, "last_launch", None):
                row["launch"] = kern.last_launch
            if getattr(kern, "describe", None):
                row["kernel"] = kern.describe()
            row["us_per_step"] = row["ms"] * 1e3 / L
            steps = L * b * d                                  # (row, step) pairs
            row["ns_per_nonzero_block_step_row"] = row["ms"] * 1e6 / (steps * row["nonzero_blocks"])
            row["ps_per_nonzero_entry_step_row"] = row["ms"] * 1e9 / (steps * row["nonzero_blocks"] * row["block"] ** 2)
            say(f"[{label}] {row['ms']:.3f} ms ({row['block']}x{row['block']} blocks, "
                f"{row['nonzero_blocks']} nonzero)")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            say(f"[{label}] FAILED: {row['error']}\n{traceback.format_exc()}")
        res["rows"].append(row)
        write()
    if args.backward:
        from ssmc.targets import mix_adjoint as M
        default = M.STEP_ELEMENTS, M.GPU_STEP_ELEMENTS
        from ssmc.targets import mul_sum as MS
        usable = MS.usable
        for target in targets:
            for se in [int(v) for v in args.step_elements.split(",") if v] or [None]:
                for sums in args.sums.split(","):
                    if se:
                        M.STEP_ELEMENTS = M.GPU_STEP_ELEMENTS = se
                    MS.usable = usable if sums == "kernel" else (lambda a, b: False)
                    try:
                        row = backward_row(target, cfg, sparse, dev, gen, seq_dtype, bench, small, check, args.profile)
                    finally:
                        MS.usable = usable
                    elements = M.step_elements(dev, 4)
                    row.update(step_elements=elements, chunk_steps=M.chunk_steps(b * d * n, L, None, elements),
                               sums=sums)
                    M.STEP_ELEMENTS, M.GPU_STEP_ELEMENTS = default
                    if se:
                        row["variant"] += f" (chunk tensors of {se} elements)"
                    if sums != "kernel":
                        row["variant"] += f" (sums by {sums})"
                    res["rows"].append(row)
                    write()
        res["rows"].append(backward_row(None, cfg, sparse, dev, gen, torch.float32, bench, small, check))
        write()
    row = {}
    if not args.backward_only:
        row = {"variant": f"eager loop (L{cfg['eager_L']})", "L": cfg["eager_L"], "b": b, "channels": d, "d_state": n,
               "input_dtype": "float32"}
        try:
            say(f"[eager] timing the naive loop at L{cfg['eager_L']} on fp32 inputs")
            ins = make_inputs(b=b, L=cfg["eager_L"], d=d, n=n, mask=sparse, dev=dev, gen=gen, seq_dtype=torch.float32)
            with torch.no_grad():
                row["ms"] = bench(lambda: euler_matmul(*ins))
            row["ms_scaled_to_L"] = row["ms"] * L / cfg["eager_L"]
            say(f"[eager] {row['ms']:.2f} ms at L{cfg['eager_L']} (~{row['ms_scaled_to_L']:.1f} ms at L{L})")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            say(f"[eager] FAILED: {row['error']}")
        res["rows"].append(row)

    def best(kind):
        got = [r for r in res["rows"] if r["variant"].startswith(f"ssmc {kind} [") and r.get("ms")]
        return min(got, key=lambda r: r["ms"]) if got else {}
    sp, de = best("block-sparse"), best("dense A")
    summary = {}
    if sp.get("ms") and de.get("ms"):      # the fastest of each across the targets
        summary.update(sparse=sp["variant"], dense=de["variant"], speedup_sparse_vs_dense=de["ms"] / sp["ms"],
                       time_per_nonzero_block_sparse_over_dense=(
                           sp["ns_per_nonzero_block_step_row"] / de["ns_per_nonzero_block_step_row"]))
    if sp.get("ms") and row.get("ms"):
        summary["speedup_sparse_vs_eager_scaled"] = row["ms_scaled_to_L"] / sp["ms"]
    tr = [r for r in res["rows"] if r["variant"].startswith("ssmc block-sparse fwd+bwd") and r.get("ms")]
    eager_tr = next((r for r in res["rows"] if r["variant"].startswith("eager loop fwd+bwd") and r.get("ms")), None)
    if tr:
        fastest = min(tr, key=lambda r: r["ms"])
        summary["train"] = fastest["variant"]
        if sp.get("ms"):
            summary["fwd_bwd_over_fwd"] = fastest["ms"] / sp["ms"]
        if eager_tr:
            summary["speedup_fwd_bwd_vs_eager_scaled"] = eager_tr["ms_scaled_to_L"] / fastest["ms"]
    res["summary"] = summary
    write()
    say("variant                         ms        rel_err     block  nnz")
    for r in res["rows"]:
        say(f"{r['variant']:<30} {r.get('ms', float('nan')):>9.3f}  {r.get('rel_err_vs_float64', float('nan')):>9.2e}"
            f"  {r.get('block', '')!s:>5}  {r.get('nonzero_blocks', '')!s:>4}  {r.get('error', '')}")
    say(f"summary: {json.dumps(summary)}")
    say(f"wrote {out}")
    return res


def backward_row(target, cfg, mask, dev, gen, seq_dtype, bench, small, check, profile=False) -> dict:
    """Forward+backward of the sparse mask (gradients of every input but the mask) through ssmc
    on `target`, checked against float64 autograd at the check length; None: the eager loop at
    the eager length (fp32 inputs)."""
    from benchmarks.bench_gpu import lowered_graph
    b, L, d, n = cfg["b"], cfg["L"], cfg["d"], cfg["n"]
    label = f"ssmc block-sparse fwd+bwd [{target}]" if target else f"eager loop fwd+bwd (L{cfg['eager_L']})"
    row = {"variant": label, "L": L if target else cfg["eager_L"], "b": b, "channels": d, "d_state": n}

    def fwd_bwd(fn, ins):
        xs = [t.detach().requires_grad_(i != 3) for i, t in enumerate(ins)]       # 3: the mask
        y = fn(*xs)
        y = y[0] if isinstance(y, (tuple, list)) else y
        w = torch.cos(torch.arange(y.numel(), device=y.device, dtype=torch.float32)).view(y.shape)
        return torch.autograd.grad((y.float() * w.to(y.dtype)).sum(), [x for x in xs if x.requires_grad])
    try:
        if target is None:
            ins = make_inputs(b=b, L=cfg["eager_L"], d=d, n=n, mask=mask, dev=dev, gen=gen, seq_dtype=seq_dtype)
            row["ms"] = bench(lambda: fwd_bwd(euler_matmul, ins))
            row["ms_scaled_to_L"] = row["ms"] * L / cfg["eager_L"]
            say(f"[{label}] {row['ms']:.2f} ms (~{row['ms_scaled_to_L']:.1f} ms at L{L})")
            return row
        fn, report = lowered_graph(euler_matmul, make_inputs(n=n, mask=mask, dev=dev, gen=gen, seq_dtype=seq_dtype,
                                                             **small), target=target)
        info = report.regions[0]
        row.update(target=info.target, strategy=info.strategy)
        ins = make_inputs(n=n, mask=mask, dev=dev, gen=gen, seq_dtype=seq_dtype, **check)
        got = fwd_bwd(fn, ins)
        want = fwd_bwd(euler_matmul, [t.double() for t in ins])
        names = ["x", "dt", "A", "B", "C"]
        row["grad_rel_err_vs_float64"] = {k: rel(a, b_) for k, a, b_ in zip(names, got, want)}
        say(f"[{label}] gradients' rel err vs float64 at L{check['L']}: {row['grad_rel_err_vs_float64']}")
        from ssmc.runtime.op import lookup
        kern = lookup(info.key).kernel
        row["backward"] = kern.backward_note() if hasattr(kern, "backward_note") else None
        ins = make_inputs(b=b, L=L, d=d, n=n, mask=mask, dev=dev, gen=gen, seq_dtype=seq_dtype)
        row["ms"] = bench(lambda: fwd_bwd(fn, ins))
        say(f"[{label}] {row['ms']:.3f} ms; {row['backward']}")
        if profile:
            row["profile"] = profiled(lambda: fwd_bwd(fn, ins), dev)
            say("\n".join(row["profile"]))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        say(f"[{label}] FAILED: {row['error']}\n{traceback.format_exc()}")
    return row


def profiled(fn, dev, top: int = 25) -> list[str]:
    """One call of fn under torch.profiler: the wall time, then the top ops by device (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    return [f"wall {wall:.1f} ms under the profiler"] + table.splitlines()


if __name__ == "__main__":
    main()
