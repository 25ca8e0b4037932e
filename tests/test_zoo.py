"""Recurrences written the way other people write them (RG-LRU, QRNN, SRU, LMU, RetNet, HGRN2,
LRU, masks and resets, shift registers, a Mamba mixer step by step, ...), each a plain loop: regions
with the strategy named, or a decline with its reason; values and gradients equal to float64
eager, on the CPU and (the `gpu` tests) on CUDA at odd sizes through the generated kernels."""
import random

import pytest
import torch
import torch.nn.functional as F

import ssmc

from conftest import as_tuple, grads_match, reference, rel_err, ssmc_run
from test_forms import _masked as _padding_mask     # padded steps keep the state (torch.where)


def _rg_lru(x, wa, ba, wx, bx, lam):
    """Griffin's RG-LRU, step by step, its gates projected from the step's input in the loop."""
    h = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype, device=x.device)
    outs = []
    for t in range(x.shape[1]):
        xt = x[:, t]
        r, i = torch.sigmoid(F.linear(xt, wa, ba)), torch.sigmoid(F.linear(xt, wx, bx))
        a = torch.exp(-8.0 * r * F.softplus(lam))
        h = a * h + torch.sqrt(1 - a ** 2) * (i * xt)
        outs.append(h)
    return torch.stack(outs, dim=1)


def _qrnn(z, f, o):
    """QRNN's fo-pooling."""
    c = torch.zeros_like(z[:, 0])
    hs = []
    for t in range(z.shape[1]):
        ft = torch.sigmoid(f[:, t])
        c = ft * c + (1 - ft) * torch.tanh(z[:, t])
        hs.append(torch.sigmoid(o[:, t]) * c)
    return torch.stack(hs, 1)


def _sru(x, wx, f, r):
    """SRU: a tanh of the state in the readout, a highway to the input."""
    c = x.new_zeros(x.shape[0], x.shape[2])
    hs = []
    for t in range(x.shape[1]):
        ft, rt = torch.sigmoid(f[:, t]), torch.sigmoid(r[:, t])
        c = ft * c + (1 - ft) * wx[:, t]
        hs.append(rt * torch.tanh(c) + (1 - rt) * x[:, t])
    return torch.stack(hs, 1)


def _lerp_addcmul(x, f, g):
    """Two states, one by `torch.lerp`, one by `torch.addcmul`."""
    h, k = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.lerp(x[:, t], h, torch.sigmoid(f[:, t]))
        k = torch.addcmul(x[:, t], torch.sigmoid(g[:, t]), k)
        ys.append(h * k)
    return torch.stack(ys, 1)


def _lmu(u, A, Bv, C):
    """An LMU-style memory: fixed dense matrices through `F.linear`."""
    m = u.new_zeros(u.shape[0], A.shape[0])
    ys = []
    for t in range(u.shape[1]):
        m = F.linear(m, A) + F.linear(u[:, t], Bv)
        ys.append(F.linear(m, C))
    return torch.stack(ys, 1)


def _retnet(q, k, v, gamma):
    """RetNet's recurrent retention, time-first (L, b, heads, ...), a decay per head."""
    S = q.new_zeros(q.shape[1], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[0]):
        S = gamma.view(1, -1, 1, 1) * S + k[t].unsqueeze(-1) * v[t].unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[t], S))
    return torch.stack(outs)


def _chunks_of_steps(x, a):
    """An outer loop over chunks, an inner one over their steps; `clone` of each state."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for c0 in range(0, x.shape[1], 5):
        for t in range(c0, min(c0 + 5, x.shape[1])):
            h = h.mul(torch.sigmoid(a[:, t])).add(x[:, t])
            ys.append(h.clone())
    return torch.stack(ys, 1)


def _heads_by_view(x, dt, A, B, C):
    """Mamba-2's step with the heads split by `view` inside the loop, readout by `@`."""
    bsz, L, D = x.shape
    H = A.shape[0]
    h = x.new_zeros(bsz, H, D // H, B.shape[-1])
    ys = []
    for t in range(L):
        xt = x[:, t].view(bsz, H, D // H)
        dA = torch.exp(dt[:, t] * A)
        h = h * dA[:, :, None, None] + (dt[:, t, :, None] * xt)[..., None] * B[:, t, None, None, :]
        ys.append((h @ C[:, t, None, :, None]).squeeze(-1).reshape(bsz, D))
    return torch.stack(ys, 1)


def _resets(x, a, r):
    """Document boundaries reset the state; the final state returned too."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = h * (1.0 - r[:, t, None])
        h = a * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1), h


def _lru(x, nu, theta, Bre, Bim, C):
    """LRU: a complex diagonal from `torch.polar`, complex input matrix, real part read out."""
    lam = torch.polar(torch.exp(-torch.exp(nu)), theta)
    Bc = torch.complex(Bre, Bim)
    h = torch.zeros(x.shape[0], nu.shape[0], dtype=lam.dtype, device=x.device)
    ys = []
    for t in range(x.shape[1]):
        h = lam * h + x[:, t].to(Bc.dtype) @ Bc.T
        ys.append((h @ C.to(h.dtype).T).real)
    return torch.stack(ys, 1)


def _hgrn2(q, f, i, lb):
    """HGRN2: an outer-product state, its forget gate bounded below."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[2])
    ys = []
    for t in range(q.shape[1]):
        g = lb + (1 - lb) * torch.sigmoid(f[:, t])
        S = g[:, :, None] * S + (1 - g)[:, :, None] * i[:, t, None, :]
        ys.append(torch.einsum("bd,bde->be", q[:, t], S))
    return torch.stack(ys, 1)


def _ema_layer_norm(x, w):
    """A fixed EMA, each step's state layer-normed and projected."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = 0.9 * h + 0.1 * x[:, t]
        ys.append(F.layer_norm(h, (h.shape[-1],)) @ w)
    return torch.stack(ys, 1)


def _mlstm_stabilized(q, k, v, ig, fg):
    """xLSTM's mLSTM with its running-max stabiliser: the maximum is computed before the loop
    (ssmc.gauge), then memory and normaliser are two linear states."""
    C = q.new_zeros(q.shape[0], q.shape[2], v.shape[2])
    nrm, m = q.new_zeros(q.shape[0], q.shape[2]), q.new_zeros(q.shape[0], 1)
    hs = []
    for t in range(q.shape[1]):
        logf = F.logsigmoid(fg[:, t, None])
        m_new = torch.maximum(logf + m, ig[:, t, None])
        fa, ia = torch.exp(logf + m - m_new), torch.exp(ig[:, t, None] - m_new)
        C = fa[..., None] * C + ia[..., None] * k[:, t, :, None] * v[:, t, None, :]
        nrm = fa * nrm + ia * k[:, t]
        m = m_new
        den = torch.maximum((q[:, t] * nrm).sum(-1, keepdim=True).abs(), torch.exp(-m))
        hs.append(torch.einsum("bk,bkv->bv", q[:, t], C) / den)
    return torch.stack(hs, 1)


def _wkv4(k, v, decay, bonus):
    """RWKV-4's time mixing as its RNN mode writes it: (aa, bb) a weighted sum of the past values
    and of their weights, pp their running maximum exponent (the maximum first, ssmc.gauge)."""
    aa, bb = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
    pp = torch.full_like(k[:, 0], -1e30)
    w = -torch.exp(decay)
    out = []
    for t in range(k.shape[1]):
        ww = bonus + k[:, t]
        p = torch.maximum(pp, ww)
        e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
        out.append((e1 * aa + e2 * v[:, t]) / (e1 * bb + e2))
        ww = pp + w
        p = torch.maximum(ww, k[:, t])
        e1, e2 = torch.exp(ww - p), torch.exp(k[:, t] - p)
        aa, bb, pp = e1 * aa + e2 * v[:, t], e1 * bb + e2, p
    return torch.stack(out, 1)


def _elman(x, W, a):
    """The state through tanh: no linear recurrence (declined)."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = a * h + torch.tanh(h @ W) + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def _shift_register(u, w):
    """A delay line (H3's shift SSM): the newest input in front, the rest moved one slot by
    slicing and `torch.cat`; read out by fixed taps."""
    h = u.new_zeros(u.shape[0], u.shape[2], w.shape[-1])
    ys = []
    for t in range(u.shape[1]):
        h = torch.cat([u[:, t, :, None], h[..., :-1]], -1)
        ys.append((h * w).sum(-1))
    return torch.stack(ys, 1)


def _shift_by_pad(u, w):
    """The same delay line by `F.pad` of a slice plus the input padded into the first slot."""
    h = u.new_zeros(u.shape[0], u.shape[2], w.shape[-1])
    ys = []
    for t in range(u.shape[1]):
        h = F.pad(h[..., :-1], (1, 0)) + F.pad(u[:, t, :, None], (0, w.shape[-1] - 1))
        ys.append((h * w).sum(-1))
    return torch.stack(ys, 1)


def _mamba_step_by_step(x, conv_w, conv_b, W_dt, dt_bias, W_B, W_C, A_log, D):
    """A Mamba mixer run as an RNN: the causal conv's state rolled and its last slot written
    (`conv_state[:, :, -1] = x_t`, as in decoding code), then the selective scan's step."""
    A = -torch.exp(A_log)
    conv_state = torch.zeros(x.shape[0], x.shape[2], conv_w.shape[-1], device=x.device)
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[-1], device=x.device)
    ys = []
    for t in range(x.shape[1]):
        conv_state = torch.roll(conv_state, shifts=-1, dims=-1)
        conv_state[:, :, -1] = x[:, t]
        xc = F.silu(torch.sum(conv_state * conv_w, dim=-1) + conv_b)
        dt = F.softplus(xc @ W_dt + dt_bias)
        h = torch.exp(dt[..., None] * A) * h + (dt * xc)[..., None] * (xc @ W_B)[:, None, :]
        ys.append((h * (xc @ W_C)[:, None, :]).sum(-1) + D * xc)
    return torch.stack(ys, 1)


def _per_sample(x, a):
    h = torch.zeros_like(x[0])
    ys = []
    for t in range(x.shape[0]):
        h = a * h + x[t]
        ys.append(h)
    return torch.stack(ys)


def _vmapped(x, a):
    """A per-sample loop under `torch.vmap`: its tensors are batched, which the region op has no
    rule for (declined)."""
    return torch.vmap(_per_sample, in_dims=(0, None))(x, a)


def _inputs(name, s, g):
    """The program's inputs at sizes s (b, L, d, n), from generator g."""
    b, L, d, n = s["b"], s["L"], s["d"], s["n"]
    r = lambda *sh: torch.randn(*sh, generator=g)
    u = lambda *sh: torch.rand(*sh, generator=g)
    if name == "rg_lru":
        return (r(b, L, d), r(d, d) / d ** 0.5, r(d), r(d, d) / d ** 0.5, r(d), r(d))
    if name in ("qrnn", "sru"):
        return tuple(r(b, L, d) for _ in range({"qrnn": 3, "sru": 4}[name]))
    if name == "lerp_addcmul":
        return (r(b, L, d), r(b, L, d), r(b, L, d))
    if name == "lmu":
        return (r(b, L, 1), 0.9 * torch.eye(n) + 0.05 * r(n, n) / n ** 0.5, r(n, 1), r(3, n))
    if name == "retnet":
        return (r(L, b, 2, n), r(L, b, 2, n) / n ** 0.5, r(L, b, 2, d), 0.5 + 0.5 * u(2))
    if name == "chunks_of_steps":
        return (r(b, L, d), r(b, L, d))
    if name == "heads_by_view":
        return (r(b, L, 2 * d), 0.1 * u(b, L, 2), -u(2), r(b, L, n), r(b, L, n))
    if name == "padding_mask":
        return (r(b, L, d), u(b, L, d), u(b, L) > 0.3)
    if name == "resets":
        return (r(b, L, d), u(d), (u(b, L) > 0.8).float())
    if name == "lru":
        return (r(b, L, d), r(n) - 1, r(n), r(n, d) / d ** 0.5, r(n, d) / d ** 0.5, r(3, n))
    if name == "hgrn2":
        return (r(b, L, n), r(b, L, n), r(b, L, n), 0.5 * u(n))
    if name == "ema_layer_norm":
        return (r(b, L, d), r(d, 3))
    if name == "mlstm_stabilized":
        return (r(b, L, n), r(b, L, n) / n ** 0.5, r(b, L, d), r(b, L), r(b, L) + 2)
    if name in ("shift_register", "shift_by_pad"):
        return (r(b, L, d), r(d, 4))
    if name == "mamba_step_by_step":
        return (r(b, L, d), 0.5 * r(d, 4), r(d), r(d, d) / d ** 0.5, r(d), r(d, n) / d ** 0.5,
                r(d, n) / d ** 0.5, r(d, n), r(d))
    if name == "vmapped":
        return (r(b, L, d), u(d))
    if name == "elman":
        return (r(b, L, d), 0.1 * r(d, d), u(d))
    if name == "wkv4":
        return (3 * r(b, L, d), r(b, L, d), r(d), r(d))
    raise KeyError(name)


# name -> (program, the strategies of its regions (a|b: either, by size), or the start of the
# decline's reason)
ZOO = {
    "rg_lru": (_rg_lru, ("chunked_scan",)),
    "qrnn": (_qrnn, ("chunked_scan",)),
    "sru": (_sru, ("chunked_scan",)),
    "lerp_addcmul": (_lerp_addcmul, ("chunked_scan", "chunked_scan")),     # two states, split
    "lmu": (_lmu, ("block_sparse",)),
    "retnet": (_retnet, ("chunked_scan|chunked_ssd",)),     # by size
    "chunks_of_steps": (_chunks_of_steps, ("chunked_scan",)),
    "heads_by_view": (_heads_by_view, ("chunked_scan|chunked_ssd",)),
    "padding_mask": (_padding_mask, ("chunked_scan",)),
    "resets": (_resets, ("chunked_scan",)),
    "lru": (_lru, ("block_sparse",)),
    "hgrn2": (_hgrn2, ("chunked_scan",)),
    "ema_layer_norm": (_ema_layer_norm, ("chunked_scan|chunked_ssd",)),   # by size (an LTI decay)
    "mlstm_stabilized": (_mlstm_stabilized, ("chunked_scan", "chunked_scan")),   # the maximum first (gauge)
    "elman": (_elman, "detect_recurrence: the state goes through `tanh`"),
    "wkv4": (_wkv4, ("chunked_scan", "chunked_scan")),             # the maximum first (gauge)
    "vmapped": (_vmapped, "reads inside torch.vmap"),
    "shift_register": (_shift_register, ("block_sparse",)),     # the shift: a constant 0/1 matrix
    "shift_by_pad": (_shift_by_pad, ("block_sparse",)),
    "mamba_step_by_step": (_mamba_step_by_step, ("block_sparse", "chunked_scan")),
}
SMALL = dict(b=2, L=9, d=5, n=4)
LARGE = dict(b=3, L=131, d=40, n=16)          # odd sizes: masked tiles in the kernels


def _check(name, inputs, tol, **options):
    fn, expect = ZOO[name]
    out, rep = ssmc_run(fn, inputs, **options)
    if isinstance(expect, tuple):
        assert len(rep.regions) == len(expect) and not rep.fallbacks, str(rep)
        assert all(r.strategy in e.split("|") for r, e in zip(rep.regions, expect)), str(rep)
    else:
        assert not rep.regions and any(w.startswith(expect) for _, w in rep.fallbacks), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, [x.cpu() for x in inputs])):
        assert o.shape == r.shape and rel_err(o.cpu(), r) < tol, f"rel err {rel_err(o.cpu(), r):.3g}\n{rep}"
    return rep


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo(name):
    ins = _inputs(name, SMALL, torch.Generator().manual_seed(sorted(ZOO).index(name)))
    _check(name, ins, 1e-6)
    grads_match(ZOO[name][0], ins, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_on_the_gpu(name):
    """At odd sizes on CUDA: the region runs a generated kernel (no runtime fallback to the torch
    reference), values and gradients against float64 eager."""
    from ssmc.runtime.op import lookup
    ins = tuple(x.cuda() for x in _inputs(name, LARGE, torch.Generator().manual_seed(7)))
    rep = _check(name, ins, 1e-4)
    for r in rep.regions:
        assert r.target != "torch", str(rep)
        assert getattr(lookup(r.key).kernel, "fallback", None) is None, str(rep)
    grads_match(ZOO[name][0], ins, 1e-4)


@pytest.mark.parametrize("name", ["shift_register", "mamba_step_by_step"])
def test_zoo_shift_registers_on_the_triton_interpreter(name, monkeypatch, tmp_path):
    """The shift register's region (a 0/1 transition matrix) and the scan after it on the
    generated Triton kernels (interpreter): values and gradients against float64."""
    from ssmc.runtime.op import lookup
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    ins = _inputs(name, SMALL, torch.Generator().manual_seed(9))
    rep = _check(name, ins, 1e-5, target="triton")
    for r in rep.regions:
        assert r.target == "triton" and lookup(r.key).kernel.fallback is None, str(rep)
    grads_match(ZOO[name][0], ins, 1e-5, target="triton")


def _random_shift_program(seed):
    """A loop whose state moves along one dim by one of the spellings above (cat of slices or of
    narrow views, roll, pad, slot and slice writes, pieces from two values, a block of new values,
    elementwise ops on the slices),
    after an optional decay; (fn, inputs, description)."""
    rnd = random.Random(seed)
    N = rnd.choice([3, 4, 5, 8])
    d = rnd.choice([1, 2])          # state (b, c, N) along 2, or (b, N, c) along 1
    kind = rnd.choice(["cat_front", "cat_back", "roll", "roll_set", "pad", "slot", "slice_set", "two_src",
                       "cat_block", "ew_slices"])
    k = rnd.randint(1, N - 1)
    dec = rnd.choice([None, "scalar", "vec"])
    def fn(x, a, w):
        c = x.shape[2]
        shp = (x.shape[0], c, N) if d == 2 else (x.shape[0], N, c)
        h = x.new_zeros(shp); ys = []
        for t in range(x.shape[1]):
            xt = x[:, t].unsqueeze(d)          # (b, c, 1) or (b, 1, c)
            g = h if dec is None else (h * 0.9 if dec == "scalar" else h * a)
            if kind == "cat_front":
                h = torch.cat([xt, g.narrow(d, 0, N - 1)], d)
            elif kind == "cat_back":
                h = torch.cat([g.narrow(d, 1, N - 1), xt], d)
            elif kind == "roll":
                h = torch.roll(g, k, d) + torch.cat([xt, torch.zeros_like(g.narrow(d, 1, N - 1))], d)
            elif kind == "roll_set":
                h = torch.roll(g, shifts=-k, dims=d)
                if d == 2: h[:, :, N - 1] = x[:, t]
                else: h[:, N - 1, :] = x[:, t]
            elif kind == "pad":
                pads = (k, 0) if d == 2 else (0, 0, k, 0)
                h = F.pad(g.narrow(d, 0, N - k), pads) + xt
            elif kind == "slot":
                h = g.clone() if dec is None else g
                if d == 2: h[:, :, k] = x[:, t]
                else: h[:, k] = x[:, t]
            elif kind == "slice_set":
                h = g * 1.0
                if d == 2: h[:, :, :k] = xt
                else: h[:, :k] = xt
            elif kind == "two_src":
                h = torch.cat([g.narrow(d, 1, N - 1) * 0.5, (g * 0.3 + xt).narrow(d, 0, 1)], d)
            elif kind == "ew_slices":
                sl = g.narrow(d, 0, N - 1)
                h = torch.cat([xt - (sl + xt) / 2.0 if k % 2 else 1.0 - (-sl * 0.5), xt * 0.1], d)
            elif kind == "cat_block":
                blk = xt.expand(*[-1 if i != d else k for i in range(3)]) * 0.7
                h = torch.cat([g.narrow(d, k, N - k), blk], d)
            ys.append((h * w).sum(d))
        return torch.stack(ys, 1)
    c = rnd.choice([1, 3])
    g = torch.Generator().manual_seed(seed)
    wshape = (c, N) if d == 2 else (N, c)
    ins = (torch.randn(2, 7, c, generator=g), torch.rand(*wshape, generator=g), torch.randn(*wshape, generator=g))
    return fn, ins, f"{kind} N{N} d{d} k{k} dec{dec} c{c}"


@pytest.mark.parametrize("seed", range(16))
def test_random_shift_registers(seed):
    """Random shift-register loops: values and gradients against float64 (or, declined, the loop as
    written with the reason; 120 seeds were run on the CPU and 30 on the Triton interpreter while
    writing this, every one taken, none wrong)."""
    fn, ins, desc = _random_shift_program(seed)
    out, rep = ssmc_run(fn, ins)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5, f"{desc}\n{rep}"
    assert rep.regions or rep.fallbacks, desc
    grads_match(fn, ins, 1e-5)


@pytest.mark.parametrize("name", sorted(n for n, (_, e) in ZOO.items() if isinstance(e, tuple)))
def test_zoo_kernels_compile_for_sm90(name, monkeypatch, tmp_path):
    """Each region of the zoo that the Triton target takes on a GPU: its forward kernel (the first
    config of its sm_90 table) compiles to PTX and a cubin for sm_90 on this CPU-only machine,
    which the interpreter alone does not prove (tl.arange sizes, tl.dot shapes, types)."""
    import triton
    from test_triton import ast_source
    from triton.backends.compiler import GPUTarget
    from ssmc.targets.triton import TritonTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, rep = ssmc_run(ZOO[name][0], _inputs(name, SMALL, torch.Generator().manual_seed(3)))
    compiled = 0
    for r in rep.regions:
        if TritonTarget().supports(r.ir, r.strategy, 90, "cuda") is not True:
            continue
        kern = TritonTarget().compile(r.ir, r.strategy, ssmc.make_options(cache_dir=str(tmp_path)))
        for cfg in kern.table()["sm_90"]:     # the first variant rendered for this region
            try:
                fn, sig, cx = kern.signature(cfg, 16)
                break
            except AttributeError:           # a variant the region does not take (rows, seq: no state axis)
                continue
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                            options={k: cfg[k] for k in ("num_warps", "num_stages") if k in cfg})
        assert ".target sm_90" in ck.asm["ptx"] and ck.asm.get("cubin")
        compiled += 1
    assert compiled, f"no region of {name} runs on the Triton target: {rep}"
