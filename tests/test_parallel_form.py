"""Chunked SSDs written without a loop (ssmc.parallel_form): found, proven by evaluation, and
compiled as the scan they compute; forms that are not that scan run as written."""
import pytest
import torch
import torch.nn.functional as F

import ssmc
from test_triton import interp, poison_outputs  # noqa: F401  (interp: a fixture used by name)
from ssmc.parallel_form import find_forms

NEG = float("-inf")


def chunked_ssd(x, a, B, C, cs, final=False, drop_inter=False, a_time_last=False, h0=None, scale=None,
                shift=False, poke=False, np_state=False):
    """y_t = sum_s C_t.B_s exp(a_s+1 + ... + a_t) x_s computed chunk by chunk, with no loop:
    x (b, L, h, p), a (b, L, h) or (b, h, L) log-decays, B and C (b, L, h, n); from the state
    h0 (b, 1, h, p, n) if given; `scale` multiplies the chunked outputs (not a scan's input);
    `shift` decays each input by its own step's decay too within a chunk (a near miss); `poke`
    doubles the padded x in place once the chunks have read it ("view": through its chunked view); `np_state` lays states out as
    (n, p), h0 and the final state too."""
    b, L, h, p = x.shape
    pad = (-L) % cs
    T = L + pad
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    if a_time_last:
        ac = F.pad(a, (0, pad)).reshape(b, h, T // cs, cs)
    else:
        ac = F.pad(a, (0, 0, 0, pad)).reshape(b, T // cs, cs, h).permute(0, 3, 1, 2)
    xc, Bc, Cc = (t.reshape(b, T // cs, cs, h, -1) for t in (x, B, C))
    acum = ac.cumsum(-1)                                              # b h c l
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    seg = acum[..., :, None] - acum[..., None, :] + (ac[..., None, :] if shift else 0)
    within = torch.exp(seg.masked_fill(~causal, NEG))
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, within, xc)
    to_end = torch.exp(acum[..., -1:] - acum)
    sp = "np" if np_state else "pn"
    states = torch.einsum(f"bclhn,bhcl,bclhp->bch{sp}", Bc, to_end, xc)
    if poke == "view":
        xc.mul_(2)
    elif poke:
        x.mul_(2)
    states = torch.cat([torch.zeros_like(states[:, :1]) if h0 is None else h0, states], 1)
    ccum = F.pad(acum[..., -1], (1, 0)).cumsum(-1)                     # b h c+1
    n_c = ccum.shape[-1]
    cmask = torch.ones(n_c, n_c, dtype=torch.bool, device=x.device).tril()
    across = torch.exp((ccum[..., :, None] - ccum[..., None, :]).masked_fill(~cmask, NEG))
    new = torch.einsum(f"bhzc,bch{sp}->bzh{sp}", across, states)
    if not drop_inter:
        y = y + torch.einsum(f"bclhn,bch{sp},bhcl->bclhp", Cc, new[:, :-1], torch.exp(acum))
    if scale is not None:
        y = y * scale
    y = y.reshape(b, T, h, p)[:, :L]
    return (y, new[:, -1]) if final else y


def naive(x, a, B, C, a_time_last=False, h0=None):
    """The same scan as a loop, float64."""
    h = torch.zeros(*x.shape[:1], x.shape[2], x.shape[3], B.shape[3], dtype=torch.float64) if h0 is None else h0[:, 0]
    ys = []
    for t in range(x.shape[1]):
        at = a[:, :, t] if a_time_last else a[:, t]
        h = torch.exp(at)[..., None, None] * h + x[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def inputs(b=2, L=20, h=3, p=4, n=5, dtype=torch.float64, a_time_last=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, h, p, generator=g, dtype=dtype)
    a = -torch.rand(b, h, L, generator=g, dtype=dtype) if a_time_last else -torch.rand(b, L, h, generator=g, dtype=dtype)
    B = torch.randn(b, L, h, n, generator=g, dtype=dtype)
    C = torch.randn(b, L, h, n, generator=g, dtype=dtype)
    return x, a, B, C


def _regions(fn, *args):
    torch._dynamo.reset()
    rep = ssmc.explain(fn, *args)
    return rep, str(rep)


@pytest.mark.parametrize("L,cs", [(20, 8), (16, 8), (5, 8), (21, 4)])
def test_chunked_ssd_is_taken_and_equals_the_loop(L, cs):
    x, a, B, C = inputs(L=L)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, cs)     # noqa: E731
    rep, text = _regions(fn, x, a, B, C)
    assert "1 region(s)" in text, text
    assert "chunked SSD in parallel form" in text and "strategy chunked_s" in text, text
    want, _ = naive(x, a, B, C)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(x, a, B, C)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_inputs_in_lower_precision(dtype, tol):
    x, a, B, C = inputs(L=40, h=2, p=8, n=4)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 16)     # noqa: E731
    low = [t.to(dtype) for t in (x, a, B, C)]
    _, text = _regions(fn, *low)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(*low).double()
    want, _ = naive(*(t.double() for t in low))
    assert (got - want).abs().max() < tol * want.abs().max()


def test_final_state_and_gradients():
    x, a, B, C = (t.requires_grad_() for t in inputs(L=19))
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 8, final=True)     # noqa: E731
    _, text = _regions(fn, x, a, B, C)
    assert "1 region(s)" in text and "fallback" not in text.split("\n")[0].replace("0 fallback", ""), text
    torch._dynamo.reset()
    y, hT = torch.compile(fn, backend="ssmc")(x, a, B, C)
    wy, wh = naive(x, a, B, C)
    assert (y - wy).abs().max() < 1e-10 * wy.abs().max()
    assert (hT - wh).abs().max() < 1e-10 * wh.abs().max()
    g = torch.randn_like(wy), torch.randn_like(wh)
    got = torch.autograd.grad((y * g[0]).sum() + (hT * g[1]).sum(), (x, a, B, C))
    want = torch.autograd.grad((wy * g[0]).sum() + (wh * g[1]).sum(), (x, a, B, C))
    for u, v in zip(got, want):
        assert (u - v).abs().max() < 1e-9 * v.abs().max()


def test_decays_laid_out_time_last_and_inputs_in_another_order():
    x, a, B, C = inputs(L=18, a_time_last=True)
    fn = lambda C, a, x, B: chunked_ssd(x, a, B, C, 4, a_time_last=True)     # noqa: E731
    _, text = _regions(fn, C, a, x, B)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(C, a, x, B)
    want, _ = naive(x, a, B, C, a_time_last=True)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()


def test_symbolic_lengths():
    """Under dynamic shapes the sizes are symbols: the proof runs at the traced sizes and the
    region reads its length at run time; each length after the first runs the same graph."""
    rep = ssmc.Report()
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 8, final=True)     # noqa: E731
    torch._dynamo.reset()
    cf = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep), dynamic=True)
    for L in (20, 29, 37):
        x, a, B, C = inputs(L=L, seed=L)
        y, hT = cf(x, a, B, C)
        wy, wh = naive(x, a, B, C)
        assert (y - wy).abs().max() < 1e-10 * wy.abs().max()
        assert (hT - wh).abs().max() < 1e-10 * wh.abs().max()
    assert len(rep.graphs) == 1 and len(rep.regions) == 1, str(rep)


def test_one_tensor_as_both_B_and_C():
    x, a, B, _ = inputs(L=20)
    fn = lambda x, a, B: chunked_ssd(x, a, B, B, 8)     # noqa: E731
    _, text = _regions(fn, x, a, B)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(x, a, B)
    want, _ = naive(x, a, B, B)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()


def test_chunks_by_unflatten_and_flatten():
    x, a, B, C = inputs(L=24)

    def fn(x, a, B, C, cs=8):
        b, L, h, p = x.shape
        xc, Bc, Cc = (t.unflatten(1, (L // cs, cs)) for t in (x, B, C))
        acum = a.unflatten(1, (L // cs, cs)).permute(0, 3, 1, 2).cumsum(-1)          # b h c l
        causal = torch.ones(cs, cs, dtype=torch.bool).tril()
        within = torch.exp((acum[..., :, None] - acum[..., None, :]).masked_fill(~causal, NEG))
        y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, within, xc)
        states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, torch.exp(acum[..., -1:] - acum), xc)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
        ccum = F.pad(acum[..., -1], (1, 0)).cumsum(-1)
        cmask = torch.ones(L // cs + 1, L // cs + 1, dtype=torch.bool).tril()
        across = torch.exp((ccum[..., :, None] - ccum[..., None, :]).masked_fill(~cmask, NEG))
        new = torch.einsum("bhzc,bchpn->bzhpn", across, states)
        y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, new[:, :-1], torch.exp(acum))
        return y.flatten(1, 2)

    _, text = _regions(fn, x, a, B, C)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(x, a, B, C)
    want, _ = naive(x, a, B, C)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()


def test_a_write_after_every_read_is_a_new_value():
    """The padded x doubled in place once both einsums have read its chunks (the chunks are used
    up before the write): the write is a new value nothing reads, and the form is taken."""
    x, a, B, C = inputs(L=16)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 4, poke=True)     # noqa: E731
    _, text = _regions(fn, x.clone(), a, B, C)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    got, want = torch.compile(fn, backend="ssmc")(x.clone(), a, B, C), fn(x.clone(), a, B, C)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()


@pytest.mark.parametrize("kw,why", [
    (dict(drop_inter=True), "not the scan"),       # without the states passed between chunks
    (dict(poke="view"), "used after it"),          # a write into the chunks after the reads: xc is read on
])
def test_declined_forms_run_as_written(kw, why):
    x, a, B, C = inputs(L=16)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 4, **kw)     # noqa: E731
    _, text = _regions(fn, x.clone(), a, B, C)
    assert "0 region(s)" in text and why in text, text
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="ssmc")(x.clone(), a, B, C), fn(x.clone(), a, B, C))


@pytest.mark.parametrize("L,cs", [(20, 4), (600, 64)])
def test_a_decay_off_by_one_step_is_not_the_scan(L, cs):
    x, a, B, C = inputs(L=L, h=2, p=3, n=2)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, cs, shift=True)     # noqa: E731
    _, text = _regions(fn, x, a, B, C)
    assert "0 region(s)" in text and "not the scan" in text, text


def test_an_initial_state():
    """HF's prefill after a cached state, minimal SSD's `initial_states`: the one tensor from
    outside the chunks is the state before the first step (its unit dim squeezed)."""
    x, a, B, C = (t.requires_grad_() for t in inputs(L=21))
    h0 = torch.randn(2, 1, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda x, a, B, C, h0: chunked_ssd(x, a, B, C, 8, final=True, h0=h0)     # noqa: E731
    _, text = _regions(fn, x, a, B, C, h0)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    y, hT = torch.compile(fn, backend="ssmc")(x, a, B, C, h0)
    wy, wh = naive(x, a, B, C, h0=h0)
    assert (y - wy).abs().max() < 1e-10 * wy.abs().max()
    assert (hT - wh).abs().max() < 1e-10 * wh.abs().max()
    got = torch.autograd.grad(y.sum() + hT.sum(), (x, a, h0))
    want = torch.autograd.grad(wy.sum() + wh.sum(), (x, a, h0))
    for u, v in zip(got, want):
        assert (u - v).abs().max() < 1e-9 * v.abs().max()


def test_states_laid_out_n_by_p():
    """fla's layout (keys by values): the initial state is transposed into the loop's carry and
    the final state out of it."""
    x, a, B, C = inputs(L=19, p=4, n=4)
    h0 = torch.randn(2, 1, 3, 4, 4, dtype=torch.float64)
    fn = lambda x, a, B, C, h0: chunked_ssd(x, a, B, C, 8, final=True, h0=h0, np_state=True)     # noqa: E731
    _, text = _regions(fn, x, a, B, C, h0)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    y, hT = torch.compile(fn, backend="ssmc")(x, a, B, C, h0)
    wy, wh = naive(x, a, B, C, h0=h0.transpose(-1, -2))
    assert (y - wy).abs().max() < 1e-10 * wy.abs().max()
    assert (hT - wh.transpose(-1, -2)).abs().max() < 1e-10 * wh.abs().max()


def test_a_second_tensor_from_outside_is_declined_with_the_reason():
    x, a, B, C = inputs(L=16)
    h0 = torch.randn(2, 1, 3, 4, 5, dtype=torch.float64)
    scale = torch.randn(3, 4, dtype=torch.float64)
    fn = lambda x, a, B, C, h0, s: chunked_ssd(x, a, B, C, 8, h0=h0, scale=s)     # noqa: E731
    _, text = _regions(fn, x, a, B, C, h0, scale)
    assert "0 region(s)" in text and "nor the one initial state" in text, text
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="ssmc")(x, a, B, C, h0, scale), fn(x, a, B, C, h0, scale))


def test_find_forms_names_the_roles():
    x, a, B, C = inputs(L=12)
    seen = {}

    def backend(gm, ex):
        seen["forms"] = find_forms(gm.graph)
        return gm

    torch._dynamo.reset()
    torch.compile(lambda x, a, B, C: chunked_ssd(x, a, B, C, 4), backend=backend)(x, a, B, C)
    forms = [f for f, _ in seen["forms"] if f is not None]
    assert len(forms) == 1
    # (a, x, B, C), each the padding of the argument of that name
    assert [r.all_input_nodes[0].name for r in forms[0].roles] == ["l_a_", "l_x_", "l_b_", "l_c_"]


def chunked_linear_attention(q, k, v, cs, mask="masked_fill_", final=False, scale=None):
    """o_t = sum_{s<=t} (q_t . k_s) v_s chunk by chunk, with no decay: the states k^T v summed
    over the earlier chunks (a cumsum), a chunk's own scores masked to zero above the diagonal
    (in place, by tril or by where; "diagonal" masks the diagonal too: a near miss); q (b, L, h,
    dk) scaled after the split by `scale`; with `final`, the state after the last chunk (h, dk, dv)."""
    b, L, h, _ = q.shape
    nc = L // cs
    qc, kc, vc = (t.reshape(b, nc, cs, h, t.shape[-1]) for t in (q, k, v))
    if scale is not None:
        qc = qc.transpose(2, 3) * scale
        qc = qc.transpose(2, 3)
    kv = torch.einsum("bcshk,bcshv->bchkv", kc, vc)
    upto = kv.cumsum(1)
    before = torch.cat([torch.zeros_like(upto[:, :1]), upto[:, :-1]], 1)
    inter = torch.einsum("bclhk,bchkv->bclhv", qc, before)
    scores = torch.einsum("bclhk,bcshk->bchls", qc, kc)
    above = torch.ones(cs, cs, dtype=torch.bool, device=q.device).triu(1 if mask != "diagonal" else 0)
    if mask in ("masked_fill_", "diagonal"):
        scores.masked_fill_(above, 0)
    elif mask == "tril":
        scores = scores.tril()
    else:
        scores = torch.where(above, 0.0, scores)
    o = (inter + torch.einsum("bchls,bcshv->bclhv", scores, vc)).reshape(b, L, h, -1)
    return (o, upto[:, -1]) if final else o


def attention_loop(q, k, v):
    """The same as a loop over steps: S += k_t^T v_t, o_t = q_t S."""
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=q.dtype)
    outs = []
    for t in range(q.shape[1]):
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, 1), S


def qkv(b=2, L=24, h=3, dk=4, dv=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, L, h, d, generator=g, dtype=dtype) for d in (dk, dk, dv)]


@pytest.mark.parametrize("mask", ["masked_fill_", "tril", "where"])
@pytest.mark.parametrize("final", [False, True], ids=["o", "o_and_state"])
def test_chunked_linear_attention_is_taken(mask, final):
    """No decay: the chunk's scores masked to zero (in place too) and the states summed over the
    chunks by a cumsum are the scan h = h + v k^T, o = h q; the final state is laid out (dk, dv)."""
    q, k, v = qkv()
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 8, mask, final)     # noqa: E731
    _, text = _regions(fn, q, k, v)
    assert "1 region(s), 0 fallback(s)" in text and "chunked linear attention in parallel form" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(q, k, v)
    wo, wh = attention_loop(q, k, v)
    o = got[0] if final else got
    assert (o - wo).abs().max() < 1e-10 * wo.abs().max()
    if final:
        assert (got[1] - wh).abs().max() < 1e-10 * wh.abs().max()


def test_a_scale_after_the_split_moves_onto_the_input():
    """`rearrange(q, ...) * scale`: the product with a number moves before the split (the same
    values), so the scaled q is the scan's C; the gradients reach q through it."""
    q, k, v = (t.requires_grad_() for t in qkv(L=16, seed=3))
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 4, "tril", scale=0.25)     # noqa: E731
    _, text = _regions(fn, q, k, v)
    assert "1 region(s), 0 fallback(s)" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(q, k, v)
    want, _ = attention_loop(q * 0.25, k, v)
    assert (got - want).abs().max() < 1e-10 * want.abs().max()
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        assert (a - b).abs().max() < 1e-10 * b.abs().max()


def test_a_mask_off_by_the_diagonal_is_declined_and_runs_as_written():
    q, k, v = qkv(seed=5)
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 8, "diagonal", scale=0.5)     # noqa: E731
    _, text = _regions(fn, q, k, v)
    assert "0 region(s)" in text and "not the scan h = h + x B^T" in text, text
    torch._dynamo.reset()
    got = torch.compile(fn, backend="ssmc")(q, k, v)
    assert torch.equal(got, fn(q, k, v))


def test_softmax_in_chunks_is_no_candidate():
    """A mask filled with -inf (softmax attention within chunks) is no zero mask: no form, no
    reason in the report."""
    q, k, v = qkv(seed=6)

    def fn(q, k, v):
        b, L, h, d = q.shape
        qc, kc, vc = (t.reshape(b, L // 8, 8, h, t.shape[-1]) for t in (q, k, v))
        s = torch.einsum("bclhk,bcshk->bchls", qc, kc)
        s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return torch.einsum("bchls,bcshv->bclhv", s, vc).reshape(b, L, h, -1)
    _, text = _regions(fn, q, k, v)
    assert "parallel form" not in text, text
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="ssmc")(q, k, v), fn(q, k, v))


def test_zero_masked_scores_over_one_chunk_are_no_candidate():
    """A zero-filled (L, L) mask with the sequence "cut" into one chunk is how attention masks
    look too (HF models): no form without decays unless there are two chunks or more."""
    q, k, v = qkv(L=8, seed=9)
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 8, "tril")     # noqa: E731
    _, text = _regions(fn, q, k, v)
    assert "parallel form" not in text, text
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="ssmc")(q, k, v), fn(q, k, v))


def test_a_zero_mask_between_a_batch_cut_and_its_merge_is_no_candidate():
    """HF decoder layers view (b * L, d) tokens as (b, L, d) and back, with zero-filled (L, L)
    masks between: one tensor cut, so no x and B of a scan, no form and no reason."""
    x = torch.randn(2 * 8, 4, dtype=torch.float64)

    def fn(x):
        xv = x.view(2, 8, 4)
        s = (xv @ xv.transpose(1, 2)).tril()
        return (s @ xv).reshape(16, 4)
    _, text = _regions(fn, x)
    assert "parallel form" not in text, text


def test_chunked_linear_attention_gradients():
    q, k, v = (t.requires_grad_() for t in qkv(L=20, seed=7))
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 4, "masked_fill_", True)     # noqa: E731
    torch._dynamo.reset()
    o, hT = torch.compile(fn, backend="ssmc")(q, k, v)
    wo, wh = attention_loop(q, k, v)
    go, gh = torch.randn_like(wo), torch.randn_like(wh)
    got = torch.autograd.grad([o, hT], (q, k, v), [go, gh])
    want = torch.autograd.grad([wo, wh], (q, k, v), [go, gh])
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-10 * b.abs().max()


@pytest.mark.gpu
def test_chunked_ssd_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    x, a, B, C = inputs(b=2, L=300, h=4, p=16, n=16, dtype=torch.float32)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 64, final=True)     # noqa: E731
    dev = [t.cuda() for t in (x, a, B, C)]
    _, text = _regions(fn, *dev)
    assert "1 region(s)" in text, text
    torch._dynamo.reset()
    y, hT = torch.compile(fn, backend="ssmc")(*dev)
    wy, wh = naive(*(t.double() for t in (x, a, B, C)))
    assert (y.double().cpu() - wy).abs().max() < 1e-4 * wy.abs().max()
    assert (hT.double().cpu() - wh).abs().max() < 1e-4 * wh.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_chunked_ssd_gradients_on_the_gpu(dtype, tol):
    """Training through the region: B and C per head (no heads share them), p 64, several
    chunks. In bf16 this shape made Triton 3.6 miscompile ssd_bwd_dbc while the core kept a
    state every second chunk (an illegal address on an H100; wrong dB and du in nearby
    specializations): every gradient against float64 autograd of the same rounded inputs."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from ssmc.runtime.op import lookup
    ins = [t.cuda().to(dtype).requires_grad_() for t in inputs(b=1, L=256, h=2, p=64, n=32, seed=9)]
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 64, final=True)     # noqa: E731
    torch._dynamo.reset()
    report = ssmc.Report()
    ours = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=report))
    y, hT = ours(*ins)
    g = torch.Generator(device="cuda").manual_seed(0)
    gy = torch.randn(y.shape, generator=g, device="cuda").to(y.dtype)
    gh = torch.randn(hT.shape, generator=g, device="cuda").to(hT.dtype)
    got = torch.autograd.grad([y, hT], ins, [gy, gh])
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    wy, wh = fn(*ins64)
    want = torch.autograd.grad([wy, wh], ins64, [gy.double(), gh.double()])
    for name, o, w in [("y", y, wy), ("state", hT, wh), *zip(("dx", "da", "dB", "dC"), got, want)]:
        assert torch.isfinite(o).all(), name
        err = float((o.double() - w).abs().max() / w.abs().max())
        assert err < tol, f"{name}: rel err {err:.3g}\n{report}"
    note = lookup(report.regions[0].key).kernel.backward_note() or ""
    assert "ssmc/targets/ssd_core.py" in note, note

@pytest.mark.gpu
def test_chunked_linear_attention_on_the_gpu():
    """fla-style chunked linear attention (in-place mask, q scaled after the split) on the GPU:
    output, final state and gradients against float64 autograd of the same rounded inputs."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    ins = [t.cuda().float().requires_grad_() for t in qkv(b=2, L=256, h=2, dk=64, dv=64, seed=11)]
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 64, "masked_fill_", True, scale=0.125)  # noqa: E731
    torch._dynamo.reset()
    report = ssmc.Report()
    o, hT = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=report))(*ins)
    assert len(report.regions) == 1, str(report)
    g = torch.Generator(device="cuda").manual_seed(1)
    go, gh = (torch.randn(t.shape, generator=g, device="cuda") for t in (o, hT))
    got = torch.autograd.grad([o, hT], ins, [go, gh])
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    wo, wh = fn(*ins64)
    want = torch.autograd.grad([wo, wh], ins64, [go.double(), gh.double()])
    for name, a, w in [("o", o, wo), ("state", hT, wh), *zip(("dq", "dk", "dv"), got, want)]:
        err = float((a.double() - w).abs().max() / w.abs().max())
        assert err < 1e-4, f"{name}: rel err {err:.3g}\n{report}"


@pytest.mark.parametrize("final", [False, True], ids=["y", "y_and_state"])
def test_the_triton_ssd_kernel_runs_it_under_the_interpreter(final, interp):
    """The region a parallel form becomes runs the chunked SSD's Triton kernel (interpreted,
    outputs poisoned first), equal to float64 eager; the padded tail and the final state too."""
    from test_ssd import S, check_run
    x, a, B, C = (t.float() for t in inputs(L=21, h=2, p=16, n=16, seed=4))
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 8, final=final)     # noqa: E731
    report, _ = check_run(fn, (x, a, B, C), "chunked_ssd", S.SSDKernel)
    assert "chunked SSD in parallel form" in str(report)


def test_chunked_linear_attention_runs_the_triton_ssd_kernel_under_the_interpreter(interp):
    """No decay (a = 0) on the chunked SSD's Triton kernel (interpreted, outputs poisoned first),
    the output and the final state equal to float64 eager."""
    from test_ssd import S, check_run
    q, k, v = (t.float() for t in qkv(L=24, h=2, dk=16, dv=16, seed=8))
    fn = lambda q, k, v: chunked_linear_attention(q, k, v, 8, "masked_fill_", True)     # noqa: E731
    report, _ = check_run(fn, (q, k, v), "chunked_ssd", S.SSDKernel)
    assert "chunked linear attention in parallel form" in str(report)


def test_a_failure_making_the_loop_leaves_the_form_as_written(monkeypatch):
    import ssmc.passes.reroll as R

    def broken(gm, form):
        raise RuntimeError("no loop today")

    monkeypatch.setattr(R, "loop_from_form", broken)
    x, a, B, C = inputs(L=16)
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, 8)     # noqa: E731
    _, text = _regions(fn, x, a, B, C)
    assert "0 region(s)" in text and "making its loop failed" in text and "no loop today" in text, text
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="ssmc")(x, a, B, C), fn(x, a, B, C))
