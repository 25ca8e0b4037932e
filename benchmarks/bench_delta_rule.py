"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) written as a naive loop
in fla's layout (q, k (B, T, H, K), v (B, T, H, V), beta and the log decay g (B, T, H)), side by
side in one run; with ``--form kda``, Kimi Delta Attention instead: a log decay per key channel,
g (B, T, H, K) (fla rows: its kda kernels):

  ssmc               strategy rank_one: the Triton kernel u (w . h) a row and step (auto target)
  ssmc torch         the same region on the torch executor (target "torch": what ran before)
  eager              the loop in eager PyTorch
  fla recurrent      fla's fused_recurrent_gated_delta_rule (hand-written Triton, sequential)
  fla chunk          fla's chunk_gated_delta_rule (hand-written Triton, chunked on tensor cores)

fla rows need flash-linear-attention (a wheel carried to the GPU machine; skipped when missing)
and run with scale=1.0 (the loop does not scale q). Every row is first checked against a float64
run of the loop at a small shape (fresh inputs; outputs, final state and, with --backward, the
gradients of q, k, v, beta, g), then timed at the full shape with triton.testing.do_bench
(median), forward and (with --backward) forward+backward.

    python -m benchmarks.bench_delta_rule --out results.json [--shape B,T,H,K,V] [--backward] [--form kda]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ssmc  # noqa: E402
from benchmarks.bench_gpu import bench, env_info, rel  # noqa: E402


def gated_delta(q, k, v, beta, g):
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kv = (S * k[:, t, :, :, None]).sum(-2)
        d = (v[:, t] - kv) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * d[:, :, None, :]
        out.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, 1), S


def kda(q, k, v, beta, g):                 # g (B, T, H, K): the decay per key channel
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kv = (S * k[:, t, :, :, None]).sum(-2)
        d = (v[:, t] - kv) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * d[:, :, None, :]
        out.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, 1), S


FORMS = {"gated": gated_delta, "kda": kda}


def inputs(B, T, H, K, V, seed, dev="cuda", form="gated"):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)    # noqa: E731
    decay = F.logsigmoid(r(B, T, H) + 3.0) if form == "gated" else F.logsigmoid(r(B, T, H, K) + 3.0)
    return (r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V),
            torch.rand(B, T, H, device=dev, generator=g), decay)


def row_fn(kind, form="gated"):
    """fn(q, k, v, beta, g) -> (o, S) for a row, or None where it cannot run here."""
    if kind in ("ssmc", "ssmc_torch"):
        rep = ssmc.Report()
        opts = {"target": "torch"} if kind == "ssmc_torch" else {}
        torch._dynamo.reset()
        f = torch.compile(FORMS[form], backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, options=opts, _report=rep))
        f.report = rep
        return f
    if kind == "eager":
        return FORMS[form]
    try:
        if form == "kda":
            from fla.ops.kda import chunk_kda as chunk, fused_recurrent_kda as recurrent
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    except Exception:
        return None
    op = recurrent if kind == "fla_recurrent" else chunk
    return lambda q, k, v, beta, g: op(q, k, v, g=g, beta=beta, scale=1.0, output_final_state=True)


def grads(f, xs):
    xs = [x.detach().requires_grad_() for x in xs]
    o, S = f(*xs)
    return torch.autograd.grad(o.sum() + S.sum(), xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4,1024,16,128,128", help="B,T,H,K,V")
    ap.add_argument("--rows", default="ssmc,ssmc_torch,eager,fla_recurrent,fla_chunk")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--form", choices=sorted(FORMS), default="gated")
    args = ap.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    res = {"env": env_info(), "form": args.form,
           "shape": dict(B=B, T=T, H=H, K=K, V=V, dtype="float32"), "rows": {}}
    loop = FORMS[args.form]
    small = inputs(2, 64, 4, 32, 48, seed=1, form=args.form)
    want = loop(*[x.double() for x in small])
    want_g = grads(loop, [x.double() for x in small]) if args.backward else None
    full = inputs(B, T, H, K, V, seed=2, form=args.form)
    for kind in args.rows.split(","):
        row = res["rows"][kind] = {}
        try:
            f = row_fn(kind, args.form)
            if f is None:
                row["error"] = "not installed"
                continue
            row["rel_err_small"] = [rel(o, w) for o, w in zip(f(*small), want)]
            f = row_fn(kind, args.form)      # each shape its own compile
            f(*full)
            rep = getattr(f, "report", None)
            if rep is not None:
                row["regions"] = [(r.strategy, r.target) for r in rep.regions]
                from ssmc.runtime.op import lookup
                kerns = [lookup(r.key).kernel for r in rep.regions]
                row["configs"] = [getattr(k, "config", None) for k in kerns]
                row["config_ms"] = [{str(b): t for b, t in getattr(k, "timings", {}).items()} for k in kerns]
            torch.cuda.synchronize()
            row["fwd_ms"] = bench(lambda: f(*full))
        except Exception as e:          # one row failing leaves the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        if args.backward and "fwd_ms" in row:
            try:                        # a backward that fails leaves the forward's numbers
                row["grad_rel_err_small"] = [rel(a, b) for a, b in zip(grads(row_fn(kind, args.form), small), want_g)]
                xs = [x.detach().requires_grad_() for x in full]
                grads(f, xs)
                row["fwd_bwd_ms"] = bench(lambda: grads(f, xs))
            except Exception as e:
                row["bwd_error"] = f"{type(e).__name__}: {e}"[:500]
        print(kind, row, flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
