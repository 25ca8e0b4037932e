"""HF transformers' recurrent and linear-attention models at lengths of several chunks (L150,
L300; chunk fields set to 32 where a config has one): eager against ssmc (logits, parameter
gradients of logits.square().sum()), graphs, regions, fallbacks. Needs transformers (not a
dependency of ssmc); CPU. Results: $SSMC_PROBE_OUT/results.jsonl (default /tmp/ssmc_probe_long).

    python -m benchmarks.probe_hf_long              every model, one subprocess each
    python -m benchmarks.probe_hf_long NAME L       one model in this process
"""
import json, os, subprocess, sys, time, traceback

OUT = os.environ.get("SSMC_PROBE_OUT", "/tmp/ssmc_probe_long")
H, V, B = 64, 64, 2
C = dict(vocab_size=V, hidden_size=H, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
ATT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64, max_position_embeddings=1024)
GDN = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
KDA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
           linear_num_heads=4, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, num_attention_heads=4,
           num_key_value_heads=4, intermediate_size=64, num_hidden_layers=2, num_expert_group=1, topk_group=1)
M2 = lambda ck: dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=ck)
CH = 32  # chunk size wherever a config field sets it

# name -> (model_type, config kwargs, chunk description, seq lengths)
CONFIGS = {
 "qwen3_next": ("qwen3_next", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **ATT, **GDN, **MOE, **C), "64 (fn default, no config field)", [150, 300]),
 "qwen3_5_text": ("qwen3_5_text", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **ATT, **GDN, **C), "64 (fn default)", [150, 300]),
 "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **ATT, **GDN, **MOE, **C), "64 (fn default)", [150, 300]),
 "qwen4_exp_text": ("qwen4_exp_text", dict(num_hidden_layers=2, layer_types=["linear_attention", "linear_attention"], **ATT, **GDN, **MOE, hc_count=2, hc_lowrank=8, ple_layer_ids=[], ple_embed_dim=32, ngram_vocab_size_base=1000, split_ngram_parts=4, heads_per_ngram=4, **C), "64 (fn default)", [150, 300]),
 "lara_mini": ("lara_mini", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], sliding_window=64, **ATT, **GDN, **MOE, **C), "64 (fn default)", [150, 300]),
 "olmo_hybrid": ("olmo_hybrid", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **{**ATT, "num_key_value_heads": 4}, **{**GDN, "linear_num_key_heads": 4}, **C), "64 (fn default)", [150, 300]),
 "kimi_linear": ("kimi_linear", dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], head_dim=16, qk_head_dim=16, max_position_embeddings=1024, **KDA, **C), "64 (fn default)", [150, 300]),
 "bailing_hybrid": ("bailing_hybrid", dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1, layer_group_size=2, head_dim=16, qk_head_dim=16, num_nextn_predict_layers=0, expert_swiglu_limit_list=[0, 0], share_expert_swiglu_limit_list=[0, 0], **KDA, **C), "64 (fn default)", [150, 300]),
 "glm5_next_text": ("glm5_next_text", dict(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"], mlp_layer_types=["dense", "sparse"], num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=16, index_topk=32, index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=4, hc_mult=2, max_position_embeddings=1024, **C), "64 (fn default)", [150, 300]),
 "minimax": ("minimax", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **ATT, num_local_experts=4, num_experts_per_tok=2, block_size=CH, **C), f"block_size={CH}", [150]),
 "lfm2": ("lfm2", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], **{k: v for k, v in ATT.items() if k != "head_dim"}, block_auto_adjust_ff_dim=False, **C), "n/a (conv)", [150]),
 "lfm2_moe": ("lfm2_moe", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], num_dense_layers=1, **{k: v for k, v in ATT.items() if k != "head_dim"}, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **C), "n/a (conv)", [150]),
 "lfm3": ("lfm3", dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], **ATT, sliding_window=64, **C), "n/a (conv)", [150]),
 "mamba": ("mamba", dict(num_hidden_layers=2, state_size=16, expand=2, time_step_rank=8, **C), "n/a (scan)", [150]),
 "falcon_mamba": ("falcon_mamba", dict(num_hidden_layers=2, state_size=16, expand=2, time_step_rank=8, **C), "n/a (scan)", [150]),
 "jamba": ("jamba", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_d_state=16, mamba_dt_rank=8, use_mamba_kernels=False, max_position_embeddings=1024, **C), "n/a (scan)", [150]),
 "recurrent_gemma": ("recurrent_gemma", dict(num_hidden_layers=2, block_types=["recurrent", "attention"], lru_width=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=64, attention_window_size=64, **C), "n/a (scan)", [150]),
 "rwkv": ("rwkv", dict(num_hidden_layers=2, attention_hidden_size=64, intermediate_size=128, context_length=1024, **C), "n/a (wkv loop)", [150]),
 "xlstm": ("xlstm", dict(num_hidden_layers=2, num_blocks=2, embedding_dim=64, num_heads=4, chunk_size=CH, autocast_kernel_dtype="float32", mode="inference", **C), f"chunk_size={CH}", [150]),
 "mamba2": ("mamba2", dict(num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2, chunk_size=CH, num_hidden_layers=2, time_step_rank=8, **C), f"chunk_size={CH}", [150]),
 "bamba": ("bamba", dict(num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, **M2(CH), max_position_embeddings=1024, **C), f"mamba_chunk_size={CH}", [150]),
 "zamba2": ("zamba2", dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], n_mamba_heads=8, mamba_expand=2, mamba_d_state=16, mamba_ngroups=2, chunk_size=CH, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, adapter_rank=8, max_position_embeddings=1024, **C), f"chunk_size={CH}", [150]),
 "falcon_h1": ("falcon_h1", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_d_ssm=128, **M2(CH), max_position_embeddings=1024, **C), f"mamba_chunk_size={CH}", [150]),
 "nemotron_h": ("nemotron_h", dict(layers_block_type=["mamba", "attention"], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=16, expand=2, ssm_state_size=16, n_groups=2, chunk_size=CH, max_position_embeddings=1024, n_routed_experts=4, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, **C), f"chunk_size={CH}", [150]),
 "granitemoehybrid": ("granitemoehybrid", dict(num_hidden_layers=2, layer_types=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **M2(CH), max_position_embeddings=1024, **C), f"mamba_chunk_size={CH}", [150]),
 "zamba": ("zamba", dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], attention_hidden_size=128, attention_head_dim=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, n_mamba_heads=2, mamba_d_state=16, mamba_dt_rank=8, use_mamba_kernels=False, max_position_embeddings=1024, **C), "n/a (scan)", [150]),
 "zaya": ("zaya", dict(num_hidden_layers=2, layer_types=["hybrid", "hybrid"], num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=16, max_position_embeddings=1024, **C), "n/a (conv)", [150]),
 "inkling2_text": ("inkling2_text", dict(num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid_sliding"], num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=64, d_rel=8, rel_extent=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_layers_per_attn_res_block=1, unpadded_vocab_size=V, max_position_embeddings=1024, **C), "n/a", [150]),
}


def tail(e, n=8):
    return "".join(traceback.format_exception(e)).strip().splitlines()[-n:]


def run_one(name, L):
    import torch, ssmc
    torch.set_num_threads(int(os.environ.get("NT", "1")))
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    mt, kw, chunk, _ = CONFIGS[name]
    out = {"model": name, "L": L, "chunk": chunk}
    try:
        if mt == "glm5_next_text":  # only a ForConditionalGeneration head: tiny vision tower, ids below image tokens
            import transformers
            tc = {k: v for k, v in kw.items() if k != "tie_word_embeddings"}
            cfg = AutoConfig.for_model("glm5_next", text_config=tc, tie_word_embeddings=False, vision_config=dict(
                depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                projection_intermediate_size=64), image_token_id=60, video_token_id=61, image_start_token_id=62,
                image_end_token_id=63, video_start_token_id=58, video_end_token_id=59)
            model = transformers.Glm5NextForConditionalGeneration(cfg).float().eval()
        else:
            cfg = AutoConfig.for_model(mt, **kw)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        out["cls"] = type(model).__name__
    except Exception as e:
        out["build_error"] = tail(e); return out
    ids = torch.randint(3, 58 if mt == "glm5_next_text" else V, (B, L), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def logits_grads(fn):
        t0 = time.perf_counter(); y = fn(ids); t1 = time.perf_counter()
        gs = torch.autograd.grad(y.square().sum(), params, allow_unused=True)
        t2 = time.perf_counter()
        return y.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)], t1 - t0, t2 - t1

    f = lambda x: model(x, use_cache=False).logits
    try:
        y0, g0, te, _ = logits_grads(f); out["eager_s"] = round(te, 2)
    except Exception as e:
        out["eager_error"] = tail(e); return out
    try:
        torch._dynamo.reset()
        cf = torch.compile(f, backend="ssmc")
        y1, g1, tf, tb = logits_grads(cf)
        out["compile_fwd_s"], out["first_bwd_s"] = round(tf, 1), round(tb, 1)
        out["logits_diff"] = (y1 - y0).abs().max().item()
        out["logits_rel"] = out["logits_diff"] / max(y0.abs().max().item(), 1e-30)
        gmax = max(g.abs().max().item() for g in g0)
        diffs = [(a - b).abs().max().item() for a, b in zip(g0, g1)]
        out["grad_rel_diff"] = max(diffs) / gmax if gmax else max(diffs)
        out["worst_grad_param"] = names[max(range(len(diffs)), key=diffs.__getitem__)]
        out["nonfinite"] = bool(not torch.isfinite(y1).all() or any(not torch.isfinite(g).all() for g in g1))
    except Exception as e:
        out["compile_error"] = tail(e, 30)
    try:
        torch._dynamo.reset()
        rep = ssmc.explain(f, ids)
        out["n_graphs"] = len(rep.graphs)
        out["strategies"] = [r.strategy for r in rep.regions]
        s = str(rep)
        out["lines"] = sorted({l.strip() for l in s.splitlines() if "fallback" in l or "not taken" in l})
        os.makedirs(f"{OUT}/reports", exist_ok=True)
        open(f"{OUT}/reports/{name}_L{L}.txt", "w").write(s)
    except Exception as e:
        out["explain_error"] = tail(e, 30)
    return out


def spawn(name, L):
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "benchmarks.probe_hf_long", name, str(L)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "NT": os.environ.get("NT", "1")})
        line = [l for l in p.stdout.splitlines() if l.startswith("{")]
        res = json.loads(line[-1]) if line else {"model": name, "L": L, "build_error": p.stderr.splitlines()[-10:]}
    except subprocess.TimeoutExpired:
        res = {"model": name, "L": L, "build_error": ["timeout 600s"]}
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def main(names, par):
    from concurrent.futures import ThreadPoolExecutor
    os.makedirs(OUT, exist_ok=True)
    jobs = sorted([(n, L) for n in names for L in CONFIGS[n][3]], key=lambda j: j[1])
    with ThreadPoolExecutor(par) as ex, open(f"{OUT}/results.jsonl", "a") as fh:
        for res in ex.map(lambda j: spawn(*j), jobs):
            fh.write(json.dumps(res) + "\n"); fh.flush()
            print(json.dumps(res)[:600], flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in CONFIGS:
        print(json.dumps(run_one(sys.argv[1], int(sys.argv[2])), default=str))
    else:
        main(sys.argv[2:] or list(CONFIGS), int(sys.argv[1]) if len(sys.argv) > 1 else 2)
