"""fla's chunk-wise reference functions (naive_chunk_*, *_chunk_ref, chunkwise) under ssmc, one
case a process: eager float32 against ssmc (outputs and input gradients of sum(out**2)), eager
float32 against float64 (every float32 request made float64: the noise), regions, fallbacks.
Needs fla and einops (not dependencies of ssmc); CPU.

    python -m benchmarks.probe_fla_chunk CASE T C [--out file.json]

Cases: the names in `make` below (simple_gla, gated_delta_rule, kda, titans, ...).
"""
import sys, time, json, re, traceback, importlib, warnings, os
warnings.filterwarnings("ignore")
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
import ssmc

B, H, D = 2, 2, 16

class F64Mode(TorchFunctionMode):
    """Redirect every float32 request (.float(), .to(float32), dtype=float32) to float64."""
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        sub = lambda a: torch.float64 if a is torch.float32 else a
        args = tuple(sub(a) for a in args)
        kwargs = {k: sub(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

def nrm(x): return F.normalize(x, dim=-1)

def make(case, T, C):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)
    neg = lambda *s: -0.1 * u(*s)
    sig = lambda *s: torch.sigmoid(r(*s))
    btk = lambda: [r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)]
    btkn = lambda: [r(B, T, H, D), nrm(r(B, T, H, D)), r(B, T, H, D)]
    bhtk = lambda: [r(B, H, T, D), r(B, H, T, D), r(B, H, T, D)]
    m = "fla.ops."
    if case == "simple_gla":
        return m+"simple_gla.naive", "naive_chunk_simple_gla", btk() + [neg(B, T, H)], dict(output_final_state=True, chunk_size=C), None
    if case == "linear_attn":
        return m+"linear_attn.naive", "naive_chunk_linear_attn", btk(), {}, None
    if case == "linear_attn_norm":
        return m+"linear_attn.naive", "naive_chunk_linear_attn", [r(B,T,H,D), r(B,T,H,D).sigmoid(), r(B,T,H,D)], dict(normalize=True), None
    if case == "hgrn":
        return m+"hgrn.naive", "naive_chunk_hgrn", [r(B, T, H*D), neg(B, T, H*D)], dict(output_final_state=True, chunk_size=C), None
    if case == "based":
        return m+"based.naive", "naive_chunk_based", [0.5*r(B,H,T,D), 0.5*r(B,H,T,D), r(B,H,T,D)], dict(chunk_size=C), None
    if case == "rwkv6":
        return m+"rwkv6.chunk_naive", "naive_chunk_rwkv6", bhtk() + [neg(B, H, T, D), r(H, D)], dict(chunk_size=C), None
    if case == "gated_delta_rule":
        return m+"gated_delta_rule.naive", "naive_chunk_gated_delta_rule", btkn() + [neg(B, T, H), sig(B, T, H)], dict(chunk_size=C, output_final_state=True), None
    if case == "kda":
        return m+"kda.naive", "naive_chunk_kda", btkn() + [neg(B, T, H, D), sig(B, T, H)], dict(output_final_state=True, chunk_size=C), None
    if case == "comba":
        return m+"comba.naive", "naive_chunk_comba", btkn() + [nrm(r(B, T, H, D)), neg(B, T, H), sig(B, T, H)], dict(chunk_size=C, output_final_state=True), None
    if case == "gdn2":
        return m+"gdn2.naive", "naive_chunk_gdn2", btkn() + [neg(B, T, H, D), sig(B, T, H, D), sig(B, T, H, D)], dict(output_final_state=True, chunk_size=C), None
    if case == "delta_rule_chunkwise":
        return m+"delta_rule.naive", "delta_rule_chunkwise", [r(B,H,T,D), nrm(r(B,H,T,D)), r(B,H,T,D), sig(B,H,T)], dict(chunk_size=C), None
    if case == "iplr":
        return m+"generalized_delta_rule.iplr.naive", "iplr_chunkwise", bhtk() + [nrm(r(B,H,T,D)), -nrm(r(B,H,T,D))*u(B,H,T,1)], dict(chunk_size=C), None
    if case == "dplr":
        return m+"generalized_delta_rule.dplr.naive", "dplr_chunkwise", bhtk() + [nrm(r(B,H,T,D)), -nrm(r(B,H,T,D))*u(B,H,T,1), neg(B,H,T,D)], dict(chunk_size=C), None
    if case == "ttt":
        # the function does `q *= scale` on a view of q: pass a non-leaf copy
        wrap = lambda fn: (lambda q, *a, **kw: fn(q.clone(), *a, **kw))
        return m+"ttt.naive", "chunk_ttt_linear_ref", btk() + [r(H, D), 0.1*r(H, D), 0.05*u(B, T, H, 1)], dict(mini_batch_size=C, output_final_state=True), wrap
    if case == "titans":
        return m+"titans.naive", "chunk_titans_linear_ref", btk() + [r(H, D), 0.1*r(H, D), 0.01*u(B,T,H,1)+0.001, 0.1*u(B,T,H,1), 0.5+0.4*u(B,T,H,1)], dict(chunk_size=C, output_final_state=True), None
    if case == "momentum":
        return m+"momentum_delta_rule.naive", "chunk_momentum_delta_rule_ref", btkn() + [nrm(r(B,T,H,D)), neg(B,T,H), neg(B,T,H)-0.1, sig(B,T,H), sig(B,T,H)], dict(output_final_state=True, chunk_size=C), None
    if case == "mesa_cg":
        return m+"mesa_net.naive", "naive_mesa_net_CG", [nrm(r(B,T,H,D)), nrm(r(B,T,H,D)), r(B,T,H,D), neg(B,T,H), u(H,D)+0.5, sig(B,T,H)], dict(chunk_size=C), None
    if case == "gdp":
        # k, v, beta have T*num_householder rows
        n = 2
        return m+"gated_delta_product.chunk_ref", "chunk_gated_delta_product_ref", [r(B,T,H,D), nrm(r(B,T*n,H,D)), r(B,T*n,H,D), neg(B,T,H), sig(B,T*n,H), n], dict(output_final_state=True), None
    if case == "ttt_bwd_norm":
        NT = -(-T // C)
        return (m+"ttt.chunk", "chunk_ttt_linear_bwd_norm_ref",
                [r(B,T,H,D), r(B,T,H,D), r(B,T,H,D), r(B,T,H,D), r(B,T,H,D), r(B,T,H,D), r(H,D), 0.1*r(H,D), 0.05*u(B,T,H,1),
                 r(B,H,D,D), 0.1*r(B,NT,H,D,D), r(B,H,D,D), r(B,T,H,D), r(B,T,H,D), D**-0.5, 1e-6],
                dict(chunk_size=C), (lambda fn: (lambda *a, **kw: fn(*[x.clone() if torch.is_tensor(x) else x for x in a], **kw))))
    raise KeyError(case)

def flat(o):
    if torch.is_tensor(o): return [o]
    if isinstance(o, (tuple, list)): return [y for x in o for y in flat(x)]
    return []

NOTES = []
def run(fn, args, kw, dtype, grad=True, f64mode=False):
    try:
        return run_(fn, args, kw, dtype, grad, f64mode)
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e): raise
        NOTES.append(f"eager {dtype} backward needed torch.autograd.graph.allow_mutation_on_saved_tensors()")
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            return run_(fn, args, kw, dtype, grad, f64mode)

def run_(fn, args, kw, dtype, grad=True, f64mode=False):
    xs = [a.detach().to(dtype).requires_grad_(grad and a.is_floating_point()) if torch.is_tensor(a) else a for a in args]
    ctx = F64Mode() if f64mode else None
    if ctx: ctx.__enter__(); old = torch.get_default_dtype(); torch.set_default_dtype(torch.float64)
    try:
        outs = flat(fn(*xs, **kw))
        lt = [x for x in xs if torch.is_tensor(x) and x.requires_grad]
        grads = None
        if grad:
            loss = sum(o.square().sum() for o in outs if o.requires_grad)
            grads = torch.autograd.grad(loss, lt, allow_unused=True)
            grads = [g.detach() if g is not None else None for g in grads]
    finally:
        if ctx: ctx.__exit__(None, None, None); torch.set_default_dtype(old)
    return [o.detach() for o in outs], grads

def rel(a, b):
    """max over tensors of max|a-b| / max|b|"""
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None: continue
        x, y = x.double(), y.double()
        if x.shape != y.shape: return float("nan")
        d = (x - y).abs().max().item(); s = y.abs().max().item()
        if not (d == d): return float("nan")
        worst = max(worst, d / max(s, 1e-30))
    return worst

def main():
    case, T, C = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = sys.argv[4] if len(sys.argv) > 4 else None
    res = dict(case=case, T=T, C=C)
    try:
        mod, name, args, kw, wrap = make(case, T, C)
        fn0 = getattr(importlib.import_module(mod), name)
        fn = wrap(fn0) if wrap else fn0
        res["fn"] = name
        grad = True
        e32, g32 = run(fn, args, kw, torch.float32)
        res["out_shapes"] = [tuple(o.shape) for o in e32]
        try:
            e64, g64 = run(fn, args, kw, torch.float64, f64mode=True)
            res["noise_out"], res["noise_grad"] = rel(e32, e64), rel(g32, g64)
            # sanity that f64 really ran in f64
            res["f64_dtypes"] = sorted({str(o.dtype) for o in e64})
        except Exception as e:
            res["f64_error"] = f"{type(e).__name__}: {e}"[:300]
        torch._dynamo.reset()
        cf = torch.compile(fn, backend="ssmc")
        xs = [a.detach().float().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args]
        t0 = time.perf_counter()
        try:
            outs = flat(cf(*xs, **kw))
            res["compile_fwd_s"] = time.perf_counter() - t0
            lt = [x for x in xs if torch.is_tensor(x) and x.requires_grad]
            t1 = time.perf_counter()
            loss = sum(o.square().sum() for o in outs if o.requires_grad)
            gc = torch.autograd.grad(loss, lt, allow_unused=True)
            res["bwd_first_s"] = time.perf_counter() - t1
            res["out_diff"] = rel([o.detach() for o in outs], e32)
            res["grad_diff"] = rel(gc, g32)
            res["per_out_diff"] = [rel([a.detach()], [b]) for a, b in zip(outs, e32)]
            res["per_grad_diff"] = [rel([a], [b]) if a is not None and b is not None else None for a, b in zip(gc, g32)]
            # second call with fresh inputs (recompile / cache path)
            xs2 = [a.detach().float().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args]
            t2 = time.perf_counter(); outs2 = flat(cf(*xs2, **kw)); res["second_call_s"] = time.perf_counter() - t2
            res["out_diff_2nd"] = rel([o.detach() for o in outs2], e32)
        except Exception as e:
            res["compile_error"] = f"{type(e).__name__}: {e}"[:600]
            tb = traceback.format_exc()
            res["tb_main"] = [l for l in tb.splitlines() if "/work/main" in l][-8:]
            res["tb_tail"] = tb.splitlines()[-6:]
        try:
            torch._dynamo.reset()
            xs = [a.detach().float() if torch.is_tensor(a) else a for a in args]
            rep = ssmc.explain(lambda *a: fn(*a, **kw), *xs)
            s = str(rep)
            res["n_graphs"] = len(rep.graphs)
            res["regions"] = [getattr(r_, "strategy", "?") for r_ in rep.regions]
            res["fallbacks"] = [f"{w}: {why}" for w, why in rep.fallbacks]
            res["lines"] = [l.strip() for l in s.splitlines() if re.search(r"fallback|not taken|parallel form", l, re.I)]
            res["loop_lines"] = [l.strip() for l in s.splitlines() if "# loop" in l]
            res["explain_head"] = s.splitlines()[0]
        except Exception as e:
            res["explain_error"] = f"{type(e).__name__}: {e}"[:600]
            tb = traceback.format_exc()
            res["explain_tb_main"] = [l for l in tb.splitlines() if "/work/main" in l][-8:]
    except Exception as e:
        res["eager_error"] = f"{type(e).__name__}: {e}"[:400]
    res["notes"] = NOTES
    print(json.dumps(res))
    if out:
        with open(out, "w") as f: json.dump(res, f, indent=1)

main()
