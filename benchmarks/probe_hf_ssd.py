"""HF transformers' models with the Mamba2 mixer's torch path (its chunked SSD written without a
loop, `segment_sum`): tiny configs, eager against ssmc (logits, gradients), regions, fallbacks.
Needs transformers (not a dependency of ssmc); CPU.

    python -m benchmarks.probe_hf_ssd            every model, one subprocess each; writes
                                                 $SSMC_PROBE_OUT/results.json (default
                                                 /tmp/ssmc_probe_hf) and prints a table
    python -m benchmarks.probe_hf_ssd NAME       one model in this process, one JSON line
"""
import json, os, subprocess, sys, time, traceback

OUT = os.environ.get("SSMC_PROBE_OUT", "/tmp/ssmc_probe_hf")

H, V, T, B = 32, 64, 20, 2
# mamba: expand 2 -> intermediate 64 = 8 heads x head_dim 8; d_state 8; chunk 8
COMMON = dict(vocab_size=V, hidden_size=H, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)

CONFIGS = {
    "mamba2": lambda: dict(num_heads=8, head_dim=8, expand=2, state_size=8, n_groups=2, chunk_size=8,
                           num_hidden_layers=2, **COMMON),
    "bamba": lambda: dict(num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, mamba_n_heads=8, mamba_d_head=8,
                          mamba_expand=2, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8,
                          max_position_embeddings=64, **COMMON),
    "zamba2": lambda: dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], n_mamba_heads=8,
                           mamba_expand=2, mamba_d_state=8, mamba_ngroups=2, chunk_size=8,
                           num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                           adapter_rank=8, max_position_embeddings=64, **COMMON),
    "falcon_h1": lambda: dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                              mamba_expand=2, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8,
                              max_position_embeddings=64, **COMMON),
    "nemotron_h": lambda: dict(layers_block_type=["mamba", "mlp"], num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                               mamba_num_heads=8, mamba_head_dim=8, expand=2, ssm_state_size=8, n_groups=2,
                               chunk_size=8, max_position_embeddings=64, n_routed_experts=4,
                               moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                               **COMMON),
    "granitemoehybrid": lambda: dict(num_hidden_layers=2, layer_types=["mamba", "mamba"],
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                     shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                     mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_n_groups=2,
                                     mamba_d_state=8, mamba_chunk_size=8, max_position_embeddings=64,
                                     **COMMON),
}
# Variants with an attention layer: with only mamba layers, NemotronH and GraniteMoeHybrid fail in HF's
# own eager code for use_cache=True (create_causal_mask on a cache holding only LinearAttention layers).
CONFIGS["bamba+allmamba"] = lambda: {**CONFIGS["bamba"](), "attn_layer_indices": []}
CONFIGS["nemotron_h+attn"] = lambda: {**CONFIGS["nemotron_h"](), "layers_block_type": ["mamba", "attention"]}
CONFIGS["granitemoehybrid+attn"] = lambda: {**CONFIGS["granitemoehybrid"](), "layer_types": ["mamba", "attention"]}


def tail(e, n=6):
    return "".join(traceback.format_exception(e)).strip().splitlines()[-n:]


def run_one(name):
    import torch, transformers, ssmc
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    out = {"model": name, "rows": []}
    try:
        cfg = AutoConfig.for_model(name.split("+")[0], **CONFIGS[name]())
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        out["cls"] = type(model).__name__
        out["config"] = {k: getattr(cfg, k, None) for k in
                         ("layers_block_type", "layer_types", "attn_layer_indices", "chunk_size",
                          "mamba_chunk_size") if getattr(cfg, k, None) is not None}
    except Exception as e:
        out["build_error"] = tail(e)
        return out
    # count calls of ssmc's torch-target SSD kernel (instrumentation only, wraps in this process)
    import ssmc.targets.ssd_autograd as sa
    K, calls = sa.TorchSSDKernel, {"fwd": 0, "bwd": 0, "reference_ran": []}
    if not hasattr(K, "_probe_orig"):
        K._probe_orig = (K.forward, K.backward)
        def fw(self, inputs):
            calls["fwd"] += 1
            o = K._probe_orig[0](self, inputs)
            if self.last:
                calls["reference_ran"].append(self.last)
            return o
        def bw(self, *a):
            calls["bwd"] += 1
            return K._probe_orig[1](self, *a)
        K.forward, K.backward = fw, bw
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]

    def logits_grads(fn):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        y = fn(ids)
        t1 = time.perf_counter()
        gs = torch.autograd.grad(y.square().sum(), params, allow_unused=True)
        t2 = time.perf_counter()
        gs = [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]
        return y.detach(), gs, t1 - t0, t2 - t1

    for use_cache in (False, True):
        row = {"cache": use_cache}
        out["rows"].append(row)
        f = lambda x, uc=use_cache: model(x, use_cache=uc).logits
        try:
            y0, g0, _, _ = logits_grads(f)
        except Exception as e:
            row["eager_error"] = tail(e)
            continue
        try:
            torch._dynamo.reset()
            cf = torch.compile(f, backend="ssmc")
            calls.update(fwd=0, bwd=0, reference_ran=[])
            y1, g1, tf, tb = logits_grads(cf)
            row["compile_fwd_s"] = round(tf, 2)
            row["first_bwd_s"] = round(tb, 2)
            row["ssd_kernel_calls"] = dict(calls)
            row["logits_diff"] = (y1 - y0).abs().max().item()
            gmax = max(g.abs().max().item() for g in g0)
            gd = max((a - b).abs().max().item() for a, b in zip(g0, g1))
            row["grad_rel_diff"] = gd / gmax if gmax else gd
            worst = max(zip(g0, g1, [n for n, p in model.named_parameters() if p.requires_grad]),
                        key=lambda t: (t[0] - t[1]).abs().max().item())
            row["worst_grad_param"] = worst[2]
            # second call: steady state
            t0 = time.perf_counter(); cf(ids); row["second_fwd_s"] = round(time.perf_counter() - t0, 3)
        except Exception as e:
            row["compile_error"] = tail(e)
        try:
            torch._dynamo.reset()
            rep = ssmc.explain(f, ids)
            row["n_regions"] = len(rep.regions)
            row["strategies"] = [r.strategy for r in rep.regions]
            row["n_graphs"] = len(rep.graphs)
            row["n_fallbacks"] = len(rep.fallbacks)
            s = str(rep)
            row["lines"] = [l.strip() for l in s.splitlines()
                            if any(k in l for k in ("fallback", "parallel form", "not taken"))]
            os.makedirs(f"{OUT}/reports", exist_ok=True)
            with open(f"{OUT}/reports/{name}_cache{int(use_cache)}.txt", "w") as fh:
                fh.write(s)
        except Exception as e:
            row["explain_error"] = tail(e)
    return out


def main():
    import transformers
    d = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = sorted(m for m in os.listdir(d) if os.path.isfile(os.path.join(d, m, f"modeling_{m}.py"))
                   and "def segment_sum" in open(os.path.join(d, m, f"modeling_{m}.py")).read())
    missing = [m for m in found if m not in CONFIGS]
    print("models with def segment_sum:", found, "| without a tiny config here:", missing, flush=True)
    results = []
    for name in CONFIGS:
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, "-m", "benchmarks.probe_hf_ssd", name], capture_output=True,
                               text=True, timeout=900)
            line = [l for l in p.stdout.splitlines() if l.startswith("{")]
            res = json.loads(line[-1]) if line else {"model": name, "build_error": p.stderr.splitlines()[-8:]}
        except subprocess.TimeoutExpired:
            res = {"model": name, "build_error": ["timeout 900s"]}
        res["wall_s"] = round(time.time() - t0, 1)
        results.append(res)
        print(json.dumps(res), flush=True)
    os.makedirs(OUT, exist_ok=True)
    json.dump(results, open(f"{OUT}/results.json", "w"), indent=1)
    table(results)


def table(results):
    print(f"\n{'model':18s} {'cache':5s} {'regions':34s} {'logits':>9s} {'grad rel':>9s} {'cmp s':>6s}")
    lines = {}
    for r in results:
        if "build_error" in r:
            print(f"{r['model']:18s} BUILD ERROR: {' | '.join(r['build_error'][-2:])}")
            continue
        for row in r["rows"]:
            c = str(row["cache"])
            if "eager_error" in row:
                print(f"{r['model']:18s} {c:5s} EAGER ERROR: {row['eager_error'][-1]}")
                continue
            reg = f"{row.get('n_regions', '?')} {row.get('strategies', row.get('explain_error', ['?'])[-1:])}"
            if "compile_error" in row:
                print(f"{r['model']:18s} {c:5s} {reg:34s} COMPILE ERROR: {row['compile_error'][-1]}")
            else:
                print(f"{r['model']:18s} {c:5s} {reg:34s} {row['logits_diff']:9.2e} {row['grad_rel_diff']:9.2e} "
                      f"{row['compile_fwd_s']:6.1f}  kernel f/b {row['ssd_kernel_calls']['fwd']}/{row['ssd_kernel_calls']['bwd']}")
            for l in row.get("lines", []):
                lines.setdefault(l, []).append(f"{r['model']}/{c}")
    print("\nfallback / parallel form / not taken lines (deduplicated):")
    for l, where in lines.items():
        print(f"  [{', '.join(where)}] {l}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(run_one(sys.argv[1]), default=str))
    else:
        main()
