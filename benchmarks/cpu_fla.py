"""fla's naive recurrent functions (flash-linear-attention's own reference loops: code ssmc's
authors did not write) compiled with ssmc on the CPU: the regions and strategies found, the
fallbacks, outputs and input gradients against the same function in float64 (float32 for the
two that cast their inputs themselves), then forward medians against the function run eagerly
(calls interleaved, one process), and with ``--backward`` forward+backward too.

    pip install flash-linear-attention einops      # not dependencies of ssmc
    python -m benchmarks.cpu_fla --out benchmarks/results/cpu_fla.json [--only gla,kda] [--backward]
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
import warnings

import torch
import torch.nn.functional as F

import ssmc


def cases(B, T, H, K, V):
    """{name: (fla module, function, make inputs, the float64 reference works)}: each function
    called with its leading arguments only (defaults for scale, states and the rest)."""
    r, u = torch.randn, torch.rand
    ls = lambda *s: F.logsigmoid(torch.randn(*s))           # noqa: E731
    nrm = lambda x: F.normalize(x, dim=-1)                  # noqa: E731
    bhtk = lambda: (r(B, H, T, K), nrm(r(B, H, T, K)), r(B, H, T, V))   # noqa: E731
    btk = lambda: (r(B, T, H, K), nrm(r(B, T, H, K)), r(B, T, H, V))    # noqa: E731
    return {
        "gla": ("gla.naive", "naive_recurrent_gla", lambda: (*btk(), ls(B, T, H, K)), True),
        "simple_gla": ("simple_gla.naive", "naive_recurrent_simple_gla", lambda: (*btk(), ls(B, T, H)), True),
        "linear_attn": ("linear_attn.naive", "naive_recurrent_linear_attn", btk, True),
        "hgrn": ("hgrn.naive", "naive_recurrent_hgrn", lambda: (r(B, T, H * K), ls(B, T, H * K)), True),
        "rwkv6": ("rwkv6.recurrent_naive", "naive_recurrent_rwkv6",
                  lambda: (*bhtk(), ls(B, H, T, K), r(H, K)), True),
        "gsa": ("gsa.naive", "naive_recurrent_gsa", lambda: (*btk(), r(B, T, H, 8), ls(B, T, H, 8)), True),
        "gated_delta": ("gated_delta_rule.naive", "naive_recurrent_gated_delta_rule",
                        lambda: (*btk(), u(B, T, H), ls(B, T, H)), True),
        "kda": ("kda.naive", "naive_recurrent_kda", lambda: (*btk(), ls(B, T, H, K), u(B, T, H)), True),
        "comba": ("comba.naive", "naive_recurrent_comba",
                  lambda: (*btk(), nrm(r(B, T, H, K)), u(B, T, H), ls(B, T, H)), True),
        "gdn2": ("gdn2.naive", "naive_recurrent_gdn2",
                 lambda: (*btk(), ls(B, T, H, K), u(B, T, H, K), u(B, T, H, V)), True),
        "iplr": ("generalized_delta_rule.iplr.naive", "iplr_recurrence",
                 lambda: (*bhtk(), nrm(r(B, H, T, K)), -nrm(r(B, H, T, K)) * u(B, H, T, 1)), False),
        "dplr": ("generalized_delta_rule.dplr.naive", "dplr_recurrence",
                 lambda: (*bhtk(), nrm(r(B, H, T, K)), -nrm(r(B, H, T, K)) * u(B, H, T, 1), ls(B, H, T, K)), False),
        "momentum_delta": ("momentum_delta_rule.naive", "recurrent_momentum_delta_rule_ref",
                           lambda: (*btk(), ls(B, T, H), ls(B, T, H), nrm(r(B, T, H, K)), u(B, T, H), u(B, T, H)), True),
        "mesa_exact": ("mesa_net.naive", "naive_mesa_net_exact",
                       lambda: (*btk(), ls(B, T, H), u(H, K) + 0.5, u(B, T, H)), True),
    }


def flat(o):
    if torch.is_tensor(o):
        return [o]
    if isinstance(o, (tuple, list)):
        return [y for x in o for y in flat(x)]
    return []


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def loss(outs):
    return sum(o.float().sum() for o in outs)


def check(fn, make, f64: bool) -> dict:
    """Regions, fallbacks, and errors of outputs and gradients at the small shape."""
    args = make()
    fn(*args)                                   # imports fla's modules outside Dynamo's trace
    rep = ssmc.explain(fn, *args)
    torch._dynamo.reset()
    cf = torch.compile(fn, backend="ssmc")
    xs = [a.clone().requires_grad_() for a in args]
    ref_dt = torch.float64 if f64 else torch.float32
    ys = [a.detach().to(ref_dt).requires_grad_() for a in args]
    got, want = flat(cf(*xs)), flat(fn(*ys))
    g1 = torch.autograd.grad(loss(got), xs, allow_unused=True)
    g2 = torch.autograd.grad(loss(want), ys, allow_unused=True)
    return {"regions": [(r.strategy, r.target) for r in rep.regions],
            "fallbacks": [f"{w}: {why}" for w, why in rep.fallbacks],
            "rel_err": max(rel(a, b) for a, b in zip(got, want)),
            "grad_rel_err": max((rel(a, b) for a, b in zip(g1, g2) if a is not None and b is not None), default=None),
            "reference_dtype": str(ref_dt)}


def timed(fn, cf, make, backward: bool, reps: int) -> dict:
    args = make()
    if backward:
        args = [a.requires_grad_() for a in args]

    def call(f):
        if backward:
            loss(flat(f(*args))).backward()
        else:
            with torch.no_grad():
                f(*args)
    call(fn), call(cf)
    te, tc = [], []
    for _ in range(reps):
        t0 = time.perf_counter(); call(fn); te.append(time.perf_counter() - t0)      # noqa: E702
        t0 = time.perf_counter(); call(cf); tc.append(time.perf_counter() - t0)      # noqa: E702
    me, mc = sorted(te)[reps // 2] * 1e3, sorted(tc)[reps // 2] * 1e3
    return {"eager_ms": me, "ssmc_ms": mc, "speedup": me / mc}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    ap.add_argument("--shape", default="2,128,4,64,64", help="B,T,H,K,V of the timed calls")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    small, full = cases(2, 12, 2, 8, 8), cases(B, T, H, K, V)
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "shape": dict(B=B, T=T, H=H, K=K, V=V), "rows": {}}
    for name in [n for n in small if not args.only or n in args.only.split(",")]:
        mod, fname, make, f64 = small[name]
        row = res["rows"][name] = {}
        try:
            fn = getattr(importlib.import_module("fla.ops." + mod), fname)
            row.update(check(fn, make, f64))
            torch._dynamo.reset()
            cf = torch.compile(fn, backend="ssmc")
            row["forward"] = timed(fn, cf, full[name][2], False, args.reps)
            if args.backward:
                row["forward_backward"] = timed(fn, cf, full[name][2], True, args.reps)
        except Exception as e:        # one function failing leaves the others
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        print(name, row, flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
