"""The benchmark CLI: ``python -m benchmarks.run`` (from the repo root).

Workloads (Mamba-1 region, Mamba-2 region, decode step, whole naive Mamba block; forward and
forward+backward), a sweep of L, each ssmc target, each pass switched off in turn by name, and
the baselines (eager naive loop, torch associative_scan + Inductor, mamba-ssm's kernels when
importable: selective_scan (CUDA), mamba_chunk_scan_combined and selective_state_update
(Triton)). Prints one table, writes JSON to benchmarks/results/, draws PNG plots.

mamba2: the region at the preset's shape over its lengths, plus the long shape (h200: b4 L16384);
TFLOP/s counts the chunked SSD's work at mamba-ssm's chunk 256 (`ssd_flops`). decode: one token
per sequence at each batch size, state (fp32) in and out; the region is captured at 2 tokens
(strategy "step") and its lowered graph runs 1 (Dynamo's capture of a 1-step loop has no loop to
re-roll); bytes/s counts the state read and written once.

    python -m benchmarks.run                      # CPU: torch target only, small shapes
    python -m benchmarks.run --preset h200        # the shapes of DESIGN.md, every target
    python -m benchmarks.run --workloads mamba1 --lengths 512,2048 --targets triton,cuda

Every ssmc variant is checked against a float64 reference before it is timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import ssmc  # noqa: E402

COLUMNS = ["workload", "variant", "kind", "pass", "L", "shape", "ms", "speedup_vs_eager",
           "GB_per_s", "frac_of_byte_floor", "TFLOP_per_s", "rel_err", "compile_cold_s", "compile_warm_s",
           "peak_mem_bytes", "target_used"]
PASSES = ["fuse_prologue", "fuse_epilogue", "select_strategy"]
ABLATIONS = True                  # --no-ablations: no passes-off rows
COPY_BW = {"cuda": 4.3e12, "cpu": 2e10}      # bytes/s ceilings used for the byte floor


@dataclasses.dataclass
class Preset:
    device: str
    lengths: list
    targets: list
    mamba1: dict
    mamba2: dict
    mamba2_long: dict | None      # one more mamba2 shape, with its length "L"
    decode: dict                  # "batches": decode batch sizes
    block: dict
    dtype: torch.dtype
    reps: int


PRESETS = {
    "cpu": Preset("cpu", [64, 256], ["torch"], dict(b=2, d=64, n=16), dict(b=2, h=4, p=8, n=16), None,
                  dict(batches=[8], h=4, p=8, n=16), dict(b=2, d_model=32), torch.float32, 5),
    "h200": Preset("cuda", [512, 2048, 4096], ["torch", "triton", "cuda", "auto"],
                   dict(b=8, d=1536, n=16), dict(b=8, h=24, p=64, n=128), dict(b=4, h=24, p=64, n=128, L=16384),
                   dict(batches=[64, 256], h=24, p=64, n=128), dict(b=8, d_model=768), torch.bfloat16, 50),
}


# -- naive programs (what users write) ---------------------------------------------------------

def mamba1_loop(u, delta, A, B, C, D, z, delta_bias):          # (b, d, L) layout, as mamba-ssm
    b, d, L = u.shape
    f = torch.promote_types(u.dtype, torch.float32)              # fp32 math (fp64 for the oracle)
    h = torch.zeros(b, d, A.shape[1], device=u.device, dtype=f)
    ys = []
    for t in range(L):
        dt = F.softplus(delta[:, :, t].to(f) + delta_bias)
        h = torch.exp(dt[..., None] * A) * h + (dt * u[:, :, t].to(f))[..., None] * B[:, None, :, t].to(f)
        y = (h * C[:, None, :, t].to(f)).sum(-1) + D * u[:, :, t].to(f)
        ys.append((y * F.silu(z[:, :, t].to(f))).to(u.dtype))
    return torch.stack(ys, dim=-1)


def mamba1_inputs(cfg, L, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)
    b, d, n = cfg["b"], cfg["d"], cfg["n"]
    return (r(b, d, L).to(dtype), (r(b, d, L) * 0.5 - 1).to(dtype), -torch.exp(r(d, n) * 0.5),
            r(b, n, L).to(dtype), r(b, n, L).to(dtype), r(d), r(b, d, L).to(dtype), r(d) * 0.1)


def mamba2_loop(x, dt, A, B, C, D, z):                          # x (b, L, h, p); B, C (b, L, n)
    b, L, H, P = x.shape
    f = torch.promote_types(x.dtype, torch.float32)
    h = torch.zeros(b, H, P, B.shape[-1], device=x.device, dtype=f)
    ys = []
    for t in range(L):
        dA = torch.exp(dt[:, t].to(f) * A)
        h = dA[:, :, None, None] * h + (dt[:, t].to(f)[..., None] * x[:, t].to(f))[..., None] \
            * B[:, t, None, None, :].to(f)
        y = torch.einsum("bhpn,bn->bhp", h, C[:, t].to(f)) + D[:, None] * x[:, t].to(f)
        ys.append((y * F.silu(z[:, t].to(f))).to(x.dtype))
    return torch.stack(ys, 1)


def mamba2_inputs(cfg, L, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)
    b, H, P, n = cfg["b"], cfg["h"], cfg["p"], cfg["n"]
    return (r(b, L, H, P).to(dtype), F.softplus(r(b, L, H) - 2).to(dtype), -torch.exp(r(H) * 0.3),
            r(b, L, n).to(dtype), r(b, L, n).to(dtype), r(H), r(b, L, H, P).to(dtype))


def decode_loop(x, dt, A, B, C, D, h):                          # a few tokens, state in and out
    f = h.dtype
    ys = []
    for t in range(x.shape[1]):
        dA = torch.exp(dt[:, t].to(f) * A)
        h = dA[:, :, None, None] * h + (dt[:, t].to(f)[..., None] * x[:, t].to(f))[..., None] \
            * B[:, t, None, None, :].to(f)
        ys.append(torch.einsum("bhpn,bn->bhp", h, C[:, t].to(f)) + D[:, None] * x[:, t].to(f))
    return torch.stack(ys, 1), h


def ssd_flops(ins, chunk=256):
    """Work of the chunked SSD on mamba2 inputs, counted as mamba-ssm's algorithm at its chunk:
    per token and head, C B^T and its product with x over the causal half of a chunk
    (chunk * (n + p)), the chunk state and its readout (4 * p * n), two flops per multiply-add."""
    b, L, H, P = ins[0].shape
    n = ins[3].shape[-1]
    return 2 * b * L * H * (chunk * (n + P) / 2 + 2 * P * n)


def decode_inputs(cfg, dtype, device, seed=0, steps=1):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)
    B_, H, P, n = cfg["batch"], cfg["h"], cfg["p"], cfg["n"]
    return (r(B_, steps, H, P).to(dtype), F.softplus(r(B_, steps, H) - 2).to(dtype), -torch.exp(r(H) * 0.3),
            r(B_, steps, n).to(dtype), r(B_, steps, n).to(dtype), r(H), r(B_, H, P, n))


# -- measuring ---------------------------------------------------------------------------------

def timer(device):
    if device == "cuda":
        import triton.testing
        return lambda fn, reps: triton.testing.do_bench(fn, warmup=10, rep=max(reps, 20), return_mode="median")

    def cpu(fn, reps):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] * 1e3
    return cpu


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def lowered(fn, small, **options):
    """ssmc's lowered graph of fn, captured on short inputs; it runs at any L."""
    holder = {}

    def backend(gm, ex):
        rep = ssmc.Report()
        out = ssmc.ssmc_backend(gm, ex, options={"rest": "eager", **options}, _report=rep)
        holder.update(gm=gm, report=rep)
        return out
    torch._dynamo.reset()
    t0 = time.perf_counter()
    torch.compile(fn, backend=backend)(*small)
    holder["compile_s"] = time.perf_counter() - t0
    holder["gm"] = Lowered(holder["gm"], fn)
    return holder


class Lowered:
    """Calls a lowered graph with the arguments of the function it was captured from (Dynamo
    orders graph inputs by first use, not by the signature)."""

    def __init__(self, gm, fn):
        import inspect
        names = list(inspect.signature(fn).parameters)
        order = []
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                order.append(names.index(n.target[2:-1]))   # "L_delta_" -> "delta"
        self.gm, self.order = gm, order

    def __call__(self, *args):
        return self.gm(*[args[i] for i in self.order])


def measured_choice(report) -> str | None:
    """target "auto": which target each region's measured choice took, and the timings."""
    from ssmc.runtime.op import lookup
    out = []
    for r in report.regions:
        k = lookup(r.key).kernel
        if hasattr(k, "decided"):
            out.append(f"{r.name}: {k.describe()}")
    return "; ".join(out) or None


def nbytes(xs):
    return sum(x.numel() * x.element_size() for x in xs if isinstance(x, torch.Tensor))


class Runner:
    def __init__(self, preset: Preset, args):
        self.p, self.args = preset, args
        self.rows = []
        self.time = timer(preset.device)
        self.t_start = time.time()

    def log(self, msg):
        print(f"[{time.time() - self.t_start:7.1f}s] {msg}", flush=True)

    def add(self, **kw):
        row = {c: None for c in COLUMNS}
        row.update(kw)
        self.rows.append(row)
        ms = row["ms"]
        self.log(f"{row['workload']:8s} {row['variant']:34s} L={row['L']!s:6s} "
                 f"{(f'{ms:9.3f} ms' if ms else 'n/a'):>12s}  err {row['rel_err'] if row['rel_err'] is not None else float('nan'):.1e}")

    def region_workload(self, name, loop, make, cfg, lengths, floor_bytes, baselines, flops=None):
        p = self.p
        small = make(cfg, 8, p.dtype, p.device)
        small64 = [x.double() if x.is_floating_point() else x for x in make(cfg, 8, torch.float64, p.device)]
        oracle = lowered(loop, small64, target="torch")["gm"]
        variants = [(f"ssmc[{t}]", dict(target=t), None) for t in p.targets]
        variants += [(f"ssmc[-{ps}]", dict(target=p.targets[-1], disable_passes=[ps]), ps) for ps in PASSES
                     if ABLATIONS]
        compiled = {}
        for label, opts, ps in variants:
            h = lowered(loop, small, **opts)
            r = h["report"].regions
            compiled[label] = (h, ps, r[0].target if r else "eager (no region)")
        for L in lengths:
            ins = make(cfg, L, p.dtype, p.device, seed=L)
            ref = oracle(*[x.double() if x.is_floating_point() else x for x in ins])[0]
            fb = floor_bytes(ins)
            eager_ms = None
            if L <= self.args.eager_max_len:
                out = loop(*ins)
                eager_ms = self.time(lambda: loop(*ins), 1 if p.device == "cuda" else 2)
                self.add(workload=name, variant="eager loop", kind="baseline", L=L, ms=eager_ms,
                         rel_err=rel(out, ref), GB_per_s=fb / eager_ms / 1e6)
            for label, (h, ps, used) in compiled.items():
                gm = h["gm"]
                out = gm(*ins)[0]
                err = rel(out, ref)
                ok = err < (3e-2 if p.dtype != torch.float32 else 1e-4)
                ms = self.time(lambda: gm(*ins), p.reps) if ok else None
                if p.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    gm(*ins)
                    peak = torch.cuda.max_memory_allocated()
                else:
                    peak = None
                self.add(workload=name, variant=label, kind="ssmc", **{"pass": ps}, L=L, ms=ms, rel_err=err,
                         choice=measured_choice(h["report"]),
                         speedup_vs_eager=(eager_ms / ms) if (eager_ms and ms) else None,
                         GB_per_s=(fb / ms / 1e6) if ms else None,
                         TFLOP_per_s=(flops(ins) / ms / 1e9) if (ms and flops) else None,
                         frac_of_byte_floor=(fb / COPY_BW[p.device] * 1e3 / ms) if ms else None,
                         compile_cold_s=h["compile_s"], peak_mem_bytes=peak, target_used=used,
                         shape=str(tuple(ins[0].shape)))
            for bl_name, bl in baselines:
                try:
                    f = bl(ins)
                    out = f()
                    out = out[0] if isinstance(out, (tuple, list)) else out
                    ms = self.time(f, p.reps)
                    self.add(workload=name, variant=bl_name, kind="baseline", L=L, ms=ms, rel_err=rel(out, ref),
                             speedup_vs_eager=(eager_ms / ms) if eager_ms else None, GB_per_s=fb / ms / 1e6,
                             frac_of_byte_floor=fb / COPY_BW[p.device] * 1e3 / ms,
                             TFLOP_per_s=flops(ins) / ms / 1e9 if flops else None, shape=str(tuple(ins[0].shape)))
                except Exception as e:
                    self.log(f"baseline {bl_name} unavailable: {type(e).__name__}: {str(e)[:200]}")

    def run_mamba1(self):
        from benchmarks import baselines as B
        bls = []
        if self.p.device == "cuda":
            assoc = torch.compile(B.assoc_scan_mamba1)
            bls.append(("associative_scan+inductor", lambda ins: (lambda: assoc(*ins))))
            try:
                ext = B.build_selective_scan_fwd()
                bls.append(("mamba-ssm selective_scan (CUDA)",
                            lambda ins: (lambda: ext.fwd(ins[0], ins[1], ins[2], ins[3].unsqueeze(1), ins[4].unsqueeze(1),
                                                         ins[5], ins[6], ins[7], True)[2])))
            except Exception as e:
                self.log(f"mamba-ssm CUDA not available: {e}")
        self.region_workload("mamba1", mamba1_loop, mamba1_inputs, self.p.mamba1, self.p.lengths,
                             lambda ins: nbytes([ins[0], ins[1], ins[3], ins[4], ins[6]]) + nbytes([ins[0]]), bls)

    def run_mamba2(self):
        bls = []
        if self.p.device == "cuda":
            try:
                from benchmarks import baselines as B
                combined, _ = B.import_mamba_triton()
                bls.append(("mamba-ssm chunk_scan_combined (Triton)",
                            lambda ins: (lambda: combined(ins[0], ins[1], ins[2], ins[3][:, :, None], ins[4][:, :, None],
                                                          chunk_size=256, D=ins[5], z=ins[6]))))
            except Exception as e:
                self.log(f"mamba-ssm Triton not available: {e}")
        byts = lambda ins: nbytes([ins[0], ins[1], ins[3], ins[4], ins[6]]) + nbytes([ins[0]])
        self.region_workload("mamba2", mamba2_loop, mamba2_inputs, self.p.mamba2, self.p.lengths, byts, bls,
                             flops=ssd_flops)
        if self.p.mamba2_long:
            cfg = dict(self.p.mamba2_long)
            L = cfg.pop("L")
            self.region_workload("mamba2", mamba2_loop, mamba2_inputs, cfg, [L], byts, bls, flops=ssd_flops)

    def run_decode(self):
        p, cfg = self.p, self.p.decode
        small = decode_inputs({**cfg, "batch": 2}, p.dtype, p.device, steps=2)     # strategy "step"
        compiled = {}
        for t in p.targets:
            h = lowered(decode_loop, small, target=t)
            r = h["report"].regions
            compiled[t] = (h, f"{r[0].target} ({r[0].strategy})" if r else "eager (no region)")
        ssu = None
        if p.device == "cuda":
            try:
                from benchmarks import baselines as B
                ssu = B.import_mamba_triton()[1]
            except Exception as e:
                self.log(f"mamba-ssm Triton not available: {e}")
        for batch in cfg["batches"]:
            ins = decode_inputs({**cfg, "batch": batch}, p.dtype, p.device, seed=batch)   # one token
            ref64 = decode_loop(*[x.double() for x in ins])
            sb = 2 * nbytes([ins[6]])                    # the state, read once and written once
            row = dict(workload="decode", L=1, shape=str(tuple(ins[6].shape)))
            speed = lambda ms: dict(ms=ms, GB_per_s=sb / ms / 1e6, frac_of_byte_floor=sb / COPY_BW[p.device] * 1e3 / ms)
            for t, (h, used) in compiled.items():
                gm = h["gm"]
                y, hN = gm(*ins)
                ms = self.time(lambda: gm(*ins), p.reps)
                self.add(**row, variant=f"ssmc[{t}]", kind="ssmc", rel_err=max(rel(y, ref64[0]), rel(hN, ref64[1])),
                         target_used=used, compile_cold_s=h["compile_s"], **speed(ms))
            ms = self.time(lambda: decode_loop(*ins), p.reps)
            self.add(**row, variant="eager loop", kind="baseline", rel_err=rel(decode_loop(*ins)[1], ref64[1]),
                     **speed(ms))
            if ssu is not None:
                try:
                    f, state = selective_state_update_call(ssu, ins)
                    y = f()                                  # one step from the fresh state: checked
                    err = max(rel(y, ref64[0][:, 0]), rel(state, ref64[1]))
                    ms = self.time(f, p.reps)                # (timing steps the state on: harmless)
                    self.add(**row, variant="mamba-ssm selective_state_update (Triton)", kind="baseline",
                             rel_err=err, **speed(ms))
                except Exception as e:
                    self.log(f"baseline selective_state_update unavailable: {type(e).__name__}: {str(e)[:200]}")

    def run_block(self):
        from examples.naive_mamba import NaiveMamba
        p, cfg = self.p, self.p.block
        L = max(p.lengths) if p.device == "cpu" else 2048
        torch.manual_seed(0)
        model = NaiveMamba(cfg["d_model"]).to(p.device)
        u = torch.randn(cfg["b"], L, cfg["d_model"], device=p.device)
        for mode in ("fwd", "fwd+bwd"):
            torch._dynamo.reset()
            fast = torch.compile(model, backend="ssmc")
            t0 = time.perf_counter()
            run = (lambda f: (lambda: f(u))) if mode == "fwd" else (lambda f: (lambda: f(u).square().mean().backward()))
            with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                y = fast(u)
                cold = time.perf_counter() - t0
                ref = model(u)
                err = rel(y, ref)
                t_e = self.time(run(model), 1)
                t_s = self.time(run(fast), p.reps)
            self.add(workload="block", variant=f"ssmc naive block {mode}", kind="ssmc", L=L, ms=t_s,
                     speedup_vs_eager=t_e / t_s, rel_err=err, compile_cold_s=cold,
                     shape=str(tuple(u.shape)))
            self.add(workload="block", variant=f"eager naive block {mode}", kind="baseline", L=L, ms=t_e)


def selective_state_update_call(ssu, ins):
    """mamba-ssm's decode step on decode_loop's one-token inputs, in its Mamba-2 conventions
    (as mamba_ssm.modules.mamba2 calls it): per-head dt, A, D and dt_bias expanded over the head
    dim with stride 0 (its tie_hdim path: one decay per head), B and C with a group dim of 1;
    dt is already positive (no softplus, zero bias). It updates a copy of the state in place."""
    x, dt, A, Bm, Cm, D, h = ins
    H, P, n = h.shape[1:]
    state = h.clone()
    args = (state, x[:, 0], dt[:, 0, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, n),
            Bm[:, 0, None, :], Cm[:, 0, None, :])
    kw = dict(D=D[:, None].expand(-1, P), z=None,
              dt_bias=torch.zeros(H, device=x.device, dtype=torch.float32)[:, None].expand(-1, P), dt_softplus=False)
    return (lambda: ssu(*args, **kw)), state


def plots(rows, out_dir: Path, stem: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e '.[bench]')")
        return []
    made = []
    for wl in sorted({r["workload"] for r in rows if r["workload"] in ("mamba1", "mamba2")}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for v in sorted({r["variant"] for r in rows if r["workload"] == wl and not r["pass"]}):
            pts = sorted((r["L"], r["ms"]) for r in rows if r["workload"] == wl and r["variant"] == v and r["ms"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        ax.set(xscale="log", yscale="log", xlabel="L", ylabel="ms", title=f"{wl}: time vs L")
        ax.legend(fontsize=7)
        f = out_dir / f"{stem}_{wl}_time_vs_L.png"
        fig.tight_layout(); fig.savefig(f, dpi=110); plt.close(fig); made.append(f)
        fig, ax = plt.subplots(figsize=(6, 4))
        sub = [r for r in rows if r["workload"] == wl and r["frac_of_byte_floor"]]
        Lmax = max((r["L"] for r in sub), default=None)
        sub = [r for r in sub if r["L"] == Lmax]
        ax.barh([r["variant"] for r in sub], [r["frac_of_byte_floor"] for r in sub])
        ax.set(xlabel="fraction of the byte floor (1 = copy speed)", title=f"{wl} L={Lmax}: roofline fraction")
        f = out_dir / f"{stem}_{wl}_roofline.png"
        fig.tight_layout(); fig.savefig(f, dpi=110); plt.close(fig); made.append(f)
        full = {r["L"]: r["ms"] for r in rows if r["workload"] == wl and r["variant"].startswith("ssmc[")
                and not r["pass"] and r["ms"]}
        offs = [r for r in rows if r["workload"] == wl and r["pass"] and r["ms"] and r["L"] == Lmax]
        if offs and Lmax in full:
            fig, ax = plt.subplots(figsize=(6, 3))
            ax.barh([r["pass"] for r in offs], [r["ms"] / full[Lmax] for r in offs])
            ax.set(xlabel="time with the pass off / time with all passes", title=f"{wl} L={Lmax}: what each pass buys")
            f = out_dir / f"{stem}_{wl}_passes.png"
            fig.tight_layout(); fig.savefig(f, dpi=110); plt.close(fig); made.append(f)
    return made


def table(rows) -> str:
    cols = ["workload", "variant", "L", "ms", "speedup_vs_eager", "GB_per_s", "frac_of_byte_floor", "TFLOP_per_s",
            "rel_err", "compile_cold_s", "target_used"]
    fmt = lambda v: "" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
    data = [[fmt(r[c]) for c in cols] for r in rows]
    w = [max(len(c), *(len(d[i]) for d in data)) if data else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(cols))]
    lines += ["  ".join(d[i].ljust(w[i]) for i in range(len(cols))) for d in data]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h200" if torch.cuda.is_available() else "cpu", choices=sorted(PRESETS))
    ap.add_argument("--workloads", default="mamba1,mamba2,decode,block")
    ap.add_argument("--lengths", default=None)
    ap.add_argument("--targets", default=None)
    ap.add_argument("--eager-max-len", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--no-ablations", action="store_true", help="no ssmc[-pass] rows (passes on/off)")
    ap.add_argument("--batch", type=int, default=None, help="the mamba1 and mamba2 shapes' batch (1: inference)")
    args = ap.parse_args(argv)
    global ABLATIONS
    ABLATIONS = not args.no_ablations
    preset = PRESETS[args.preset]
    if args.lengths:
        preset.lengths = [int(x) for x in args.lengths.split(",")]
    if args.targets:
        preset.targets = args.targets.split(",")
    if args.batch:
        preset.mamba1 = {**preset.mamba1, "b": args.batch}
        preset.mamba2 = {**preset.mamba2, "b": args.batch}
    runner = Runner(preset, args)
    for w in args.workloads.split(","):
        runner.log(f"workload {w}")
        getattr(runner, f"run_{w}")()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"bench_{args.preset}"
    env = {"device": torch.cuda.get_device_name() if preset.device == "cuda" else "cpu", "torch": torch.__version__,
           "ssmc": ssmc.__version__, "preset": args.preset,
           "commit": os.environ.get("SSMC_COMMIT") or subprocess.run(   # the device's copy has a stale .git
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
           "columns": COLUMNS}
    if preset.device == "cuda":                # GPU, capability, triton, cupy and driver versions
        from benchmarks.bench_gpu import env_info
        env.update(env_info())
    (out_dir / f"{stem}.json").write_text(json.dumps({"env": env, "rows": runner.rows}, indent=1, default=str) + "\n")
    made = plots(runner.rows, out_dir, stem)
    print(table(runner.rows))
    print(f"wrote {out_dir / (stem + '.json')}" + "".join(f", {m}" for m in made))


if __name__ == "__main__":
    main()
