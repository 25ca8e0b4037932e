"""Recurrences kept in range by a running maximum (ssmc.gauge): the maximum is computed for all
steps before the loop, and the rest of the step becomes a region."""
import pytest
import torch

from conftest import TOL, as_tuple, declined, grads_match, reference, rel_err, ssmc_run
from ssmc.gauge import max_plus_scan


def _wkv(w, u, k, v, state=None):
    """An RWKV-4 style weighted average of the values: sum_s exp(w (t-1-s) + k_s) v_s over the
    past plus a bonus exp(u + k_t) v_t for the current step, divided by the same sum of weights;
    a running maximum `big` of the exponents keeps every exp <= 1. Returns (y, (num, den, big))."""
    b, L, d = k.shape
    if state is None:
        num, den = k.new_zeros(b, d), k.new_zeros(b, d)
        big = k.new_full((b, d), -1e38)
    else:
        num, den, big = state
    decay = -torch.exp(w)
    y = torch.empty_like(v)
    for t in range(L):
        kt, vt = k[:, t], v[:, t]
        top = torch.maximum(big, u + kt)                      # the output's own maximum
        old, cur = torch.exp(big - top), torch.exp(u + kt - top)
        y[:, t] = (old * num + cur * vt) / (old * den + cur)
        nxt = torch.maximum(big + decay, kt)                  # the state's maximum
        old, cur = torch.exp(big + decay - nxt), torch.exp(kt - nxt)
        num = old * num + cur * vt
        den = old * den + cur
        big = nxt
    return y, (num, den, big)


def _wkv_out(w, u, k, v):
    y, (num, den, big) = _wkv(w, u, k, v)
    return y, num, den, big


def _mlstm(q, k, v, i_pre, f_pre):
    """A matrix-memory LSTM cell with exponential input gates, stabilised by the running maximum
    `m` of the log gates (q, k, v: (b, h, L, e); gates: (b, h, L))."""
    b, h, L, e = q.shape
    C, n = q.new_zeros(b, h, e, e), q.new_zeros(b, h, e)
    m = q.new_zeros(b, h)
    outs = []
    for t in range(L):
        log_f = torch.nn.functional.logsigmoid(f_pre[:, :, t])
        m_new = torch.maximum(log_f + m, i_pre[:, :, t])
        ig, fg = torch.exp(i_pre[:, :, t] - m_new), torch.exp(log_f + m - m_new)
        C = fg[..., None, None] * C + ig[..., None, None] * (v[:, :, t, :, None] * k[:, :, t, None, :])
        n = fg[..., None] * n + ig[..., None] * k[:, :, t]
        num = torch.einsum("bhij,bhj->bhi", C, q[:, :, t])
        den = torch.maximum((n * q[:, :, t]).sum(-1).abs(), torch.exp(-m_new))
        outs.append(num / den[..., None])
        m = m_new
    return torch.stack(outs, 2)


def _mlstm_cast_state(q, k, v, i_pre, f_pre):
    """The same cell written with its states cast to float32 on the way in and out of each step
    and ``torch.max(a, b)``, the maximum kept as a (b, h, 1) column."""
    b, h, L, e = q.shape
    C, n, m = q.new_zeros(b, h, e, e), q.new_zeros(b, h, e), q.new_zeros(b, h, 1)
    outs = []
    for t in range(L):
        C0, n0, m0 = C.to(torch.float32), n.to(torch.float32), m.to(torch.float32)
        log_f = torch.nn.functional.logsigmoid(f_pre[:, :, t, None])
        m1 = torch.max(log_f + m0, i_pre[:, :, t, None])
        fg, ig = torch.exp(log_f + m0 - m1), torch.exp(i_pre[:, :, t, None] - m1)
        C1 = fg[..., None] * C0 + ig[..., None] * (k[:, :, t, :, None] @ v[:, :, t, None, :])
        n1 = fg * n0 + ig * k[:, :, t]
        num = (q[:, :, t, None, :] @ C1).squeeze(2)
        den = torch.maximum((q[:, :, t, None, :] @ n1[..., None]).squeeze(2).abs(), torch.exp(-m1)) + 1e-6
        outs.append(num / den)
        C, n, m = C1.to(torch.float32), n1.to(torch.float32), m1.to(torch.float32)
    return torch.stack(outs, 2), m


def _peak_hold(x, release):
    """An envelope follower: the peak decays by `release` a step unless the input is higher."""
    p = torch.full_like(x[:, 0], float("-inf"))
    ps = []
    for t in range(x.shape[1]):
        p = torch.maximum(p - release, x[:, t].abs())
        ps.append(p)
    return torch.stack(ps, 1)


def _wkv_inputs(seed, L=9, scale=2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, d = 2, 5
    return (torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype),
            (scale * torch.randn(b, L, d, generator=g)).to(dtype), torch.randn(b, L, d, generator=g).to(dtype))


def _mlstm_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, L, e = 2, 2, 8, 3
    return (torch.randn(b, h, L, e, generator=g), torch.randn(b, h, L, e, generator=g) / 2,
            torch.randn(b, h, L, e, generator=g), 3 * torch.randn(b, h, L, generator=g),
            torch.randn(b, h, L, generator=g) + 2)


def _check(fn, ins, tol=None):
    out, rep = ssmc_run(fn, ins)
    assert rep.regions and not rep.fallbacks, str(rep)
    assert any("running maxima" in n for r in rep.regions for n in r.notes), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert o.shape == r.shape and rel_err(o, r) <= (tol or TOL[ins[-1].dtype]), str(rep)
    return rep


@pytest.mark.parametrize("fn", [lambda *a: _wkv(*a)[0], _wkv_out])
def test_wkv_with_its_running_maximum(fn):
    """The state's and the output's maxima: the first becomes two reads, the second is then
    computed from inputs; num and den are linear regions. The final state (num, den, big) is the
    loop's own, big included."""
    ins = _wkv_inputs(1)
    _check(fn, ins)
    grads_match(fn, ins)


def test_wkv_in_float64_and_with_an_initial_state():
    ins = _wkv_inputs(2, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    st = (torch.randn(2, 5, generator=g, dtype=torch.float64), torch.rand(2, 5, generator=g, dtype=torch.float64),
          torch.randn(2, 5, generator=g, dtype=torch.float64))

    def fn(w, u, k, v, num, den, big):
        y, s = _wkv(w, u, k, v, (num, den, big))
        return (y, *s)
    _check(fn, (*ins, *st))


def test_wkv_stays_in_range_with_large_keys():
    """Keys of +-100 overflow exp in float32 without the maximum: the captured loop keeps it, so
    its outputs are as close to float64 as eager's own. The final num and den are scaled by
    exp(-big) for a `big` summed in float64, not step by step in float32 as the loop does, so
    they differ by float32 roundings of |big| ~ 100 (their ratio, all later outputs read, does
    not: both carry the same factors)."""
    ins = _wkv_inputs(4, L=40, scale=50.0)
    out, rep = ssmc_run(_wkv_out, ins)
    assert rep.regions, str(rep)
    ref, own = reference(_wkv_out, ins), _wkv_out(*ins)
    for o in out:
        assert torch.isfinite(o).all()
    y, num, den, big = out
    assert rel_err(y, ref[0]) <= max(20 * rel_err(own[0], ref[0]), 1e-5)
    assert rel_err(num / den, ref[1] / ref[2]) <= max(20 * rel_err(own[1] / own[2], ref[1] / ref[2]), 1e-5)
    assert rel_err(big, ref[3]) <= 1e-6
    assert rel_err(num, ref[1]) < 2e-4 and rel_err(den, ref[2]) < 2e-4


def test_mlstm_stabilised():
    ins = _mlstm_inputs(5)
    _check(_mlstm, ins)
    grads_match(_mlstm, ins, tol=1e-4)


def test_mlstm_with_casts_and_a_column_maximum():
    _check(_mlstm_cast_state, _mlstm_inputs(11))


def test_a_running_maximum_alone():
    """A peak hold (m = max(m - r, |x_t|)) is all maximum: once it is computed before the loop
    nothing passes from step to step; no region, the step runs vmapped over the steps."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 11, 3, generator=g)
    def fn(x):
        return _peak_hold(x, 0.3)
    out, rep = ssmc_run(fn, (x,))
    assert rel_err(out, reference(fn, (x,))[0]) < 1e-6, str(rep)
    assert not rep.regions and not rep.fallbacks, str(rep)
    assert any("running maxima" in m for m in rep.graphs[0].log), str(rep)
    assert any("a map over the steps" in m for m in rep.graphs[0].log), str(rep)


def _log_space(x, log_a, v):
    """A decayed softmax average of v kept in log space: lz_t = log(sum_s a^(t-s) exp(x_s)) by
    logaddexp, and avg_t = sum_s a^(t-s) exp(x_s - lz_t) v_s, rescaled every step."""
    lz = torch.full_like(x[:, 0], float("-inf"))
    avg = torch.zeros_like(v[:, 0])
    ys = []
    for t in range(x.shape[1]):
        lz_new = torch.logaddexp(log_a[:, t] + lz, x[:, t])
        avg = torch.exp(log_a[:, t] + lz - lz_new) * avg + torch.exp(x[:, t] - lz_new) * v[:, t]
        lz = lz_new
        ys.append(avg)
    return torch.stack(ys, 1), lz


def test_a_running_log_sum_exp():
    """The (logaddexp, +) recurrence is computed before the loop too (logcumsumexp); what it
    rescales is a region."""
    g = torch.Generator().manual_seed(12)
    ins = (3 * torch.randn(2, 9, 3, generator=g), -torch.rand(2, 9, 3, generator=g), torch.randn(2, 9, 3, generator=g))
    _check(_log_space, ins)
    grads_match(_log_space, ins)
    x, log_a = ins[0].double(), ins[1].double()
    prev, new = max_plus_scan(log_a.transpose(0, 1), x.transpose(0, 1), torch.full((2, 3), float("-inf"),
                              dtype=torch.float64), 9, True, True, torch.float64, "logaddexp")
    assert rel_err(new[-1], reference(_log_space, ins)[1]) < 1e-12


def test_maxima_that_are_no_such_recurrence_run_as_written():
    """m = max(a m, x) (a product, not a sum) and m = max(m + s, x) with s another state are not
    (max, +) recurrences of the inputs: the loops run as written, with the reason."""
    g = torch.Generator().manual_seed(7)
    x, a = torch.randn(2, 6, 3, generator=g), torch.rand(3, generator=g)

    def scaled(x, a):
        m = torch.zeros_like(x[:, 0])
        ms = []
        for t in range(x.shape[1]):
            m = torch.maximum(a * m, x[:, t])
            ms.append(m)
        return torch.stack(ms, 1)

    def coupled(x, a):
        m, s = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
        ms = []
        for t in range(x.shape[1]):
            s = a * s + x[:, t]
            m = torch.maximum(m + s, x[:, t])
            ms.append(m)
        return torch.stack(ms, 1)
    def then_nonlinear(x, a):
        """The maximum is taken out and the loop split; its second state is not linear, so both
        pieces run as written and the nodes made for them (the maxima) are erased again."""
        num, s = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
        big = torch.full_like(x[:, 0], -1e30)
        ys = []
        for t in range(x.shape[1]):
            nxt = torch.maximum(big - 0.5, x[:, t])
            num = torch.exp(big - 0.5 - nxt) * num + torch.exp(x[:, t] - nxt) * a
            s = torch.tanh(s) + num
            big = nxt
            ys.append(num + s)
        return torch.stack(ys, 1)
    declined(scaled, (x, a), "maximum")
    declined(coupled, (x, a), "maximum")
    declined(then_nonlinear, (x, a), "tanh", untouched=True)


def test_a_failure_taking_maxima_out_declines_that_loop_only(monkeypatch):
    """An error inside the rewrite (here: computing the maxima before the loop) leaves that loop
    as written, with the reason; the graph's other loop is still a region."""
    import ssmc.gauge as G

    def broken(*a, **k):
        raise RuntimeError("no maxima today")

    monkeypatch.setattr(G, "max_plus_scan", broken)

    def fn(w, u, k, v):
        y, _ = _wkv(w, u, k, v)
        h, ys = torch.zeros_like(v[:, 0]), []
        for t in range(v.shape[1]):            # an EMA of the output: a loop of its own
            h = 0.9 * h + y[:, t]
            ys.append(h)
        return torch.stack(ys, 1)

    ins = _wkv_inputs(5)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1, str(rep)
    assert any("running maxima not taken out" in why and "no maxima today" in why for _, why in rep.fallbacks), str(rep)
    assert rel_err(out, reference(fn, ins)[0]) <= TOL[torch.float32]


def test_max_plus_scan_against_its_loop():
    g = torch.Generator().manual_seed(8)
    L = 13
    alpha = torch.randn(L, 4, generator=g, dtype=torch.float64)
    beta = torch.randn(L, 3, 4, generator=g, dtype=torch.float64)
    beta[4, 1] = float("-inf")
    for m0 in (torch.randn(3, 4, generator=g, dtype=torch.float64), torch.full((3, 4), float("-inf"), dtype=torch.float64)):
        prev, new = max_plus_scan(alpha, beta, m0, L, True, True, torch.float64)
        m, want = m0, []
        for t in range(L):
            m = torch.maximum(m + alpha[t], beta[t])
            want.append(m)
        want = torch.stack(want)
        assert torch.allclose(new, want, atol=1e-12, rtol=0)
        assert torch.equal(prev[0], m0) and torch.equal(prev[1:], new[:-1])
    prev, new = max_plus_scan(-0.5, beta[:, 0], torch.zeros(4, dtype=torch.float64), L, False, True, torch.float32)
    m, want = torch.zeros(4, dtype=torch.float64), []
    for t in range(L):
        m = torch.maximum(m - 0.5, beta[t, 0])
        want.append(m)
    assert new.dtype == torch.float32 and torch.allclose(new.double(), torch.stack(want), atol=1e-6, rtol=0)


def _online_softmax(s, v):
    """Attention over the prefix by a running maximum that does not decay (Aaren's recurrence):
    m = max(m, s_t), no "+ w"."""
    m = torch.full_like(s[:, 0], -1e30)
    u, w, outs = torch.zeros_like(v[:, 0]), torch.zeros_like(s[:, 0]), []
    for t in range(s.shape[1]):
        q = torch.maximum(m, s[:, t])
        u = torch.exp(m - q)[:, None] * u + torch.exp(s[:, t] - q)[:, None] * v[:, t]
        w = torch.exp(m - q) * w + torch.exp(s[:, t] - q)
        m = q
        outs.append(u / w[:, None])
    return torch.stack(outs, 1)


def test_a_running_maximum_without_decay():
    g = torch.Generator().manual_seed(5)
    ins = (3 * torch.randn(2, 8, generator=g), torch.randn(2, 8, 3, generator=g))
    _check(_online_softmax, ins)
    grads_match(_online_softmax, ins)


@pytest.mark.parametrize("kind", ["max", "logaddexp"])
def test_max_plus_scan_keeps_resets(kind):
    """A step with alpha = -inf (a gate rounded to 0: log(0)) or -1e20: prefix sums A_t and
    differences b_s - A_s gave NaN after it (and lost every digit at -1e20); the composed maps
    keep each m_t the loop's."""
    g = torch.Generator().manual_seed(9)
    plus = torch.maximum if kind == "max" else torch.logaddexp
    for spike in (float("-inf"), -1e20):
        alpha = -torch.rand(11, 3, generator=g, dtype=torch.float64)
        alpha[2, 0], alpha[7] = spike, spike
        beta = torch.randn(11, 3, generator=g, dtype=torch.float64)
        m0 = torch.randn(3, generator=g, dtype=torch.float64)
        m, want = m0, []
        for t in range(11):
            m = plus(m + alpha[t], beta[t])
            want.append(m)
        new = max_plus_scan(alpha, beta, m0, 11, True, True, torch.float64, kind)[1]
        assert torch.allclose(new, torch.stack(want), atol=1e-12, rtol=0), (spike, new)


def test_log_space_loop_with_a_zero_gate():
    """End to end: the log-space loop with log_a = -inf at one step (eager stays finite)."""
    g = torch.Generator().manual_seed(12)
    ins = (3 * torch.randn(2, 9, 3, generator=g), -torch.rand(2, 9, 3, generator=g), torch.randn(2, 9, 3, generator=g))
    ins[1][:, 4] = float("-inf")
    _check(_log_space, ins)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["wkv", "mlstm"])
def test_running_maxima_on_the_gpu(which):
    """On CUDA (generated kernels, the rest through Inductor): values and gradients against
    float64 eager on the CPU."""
    fn, ins = (_wkv_out, _wkv_inputs(9, L=64)) if which == "wkv" else (_mlstm, _mlstm_inputs(10))
    xs = [x.cuda().requires_grad_() for x in ins]
    out, rep = ssmc_run(fn, xs)
    assert rep.regions and all(r.target != "torch" for r in rep.regions), str(rep)
    x64 = [x.double().requires_grad_() for x in ins]
    ref = as_tuple(fn(*x64))
    out = as_tuple(out)
    for o, r in zip(out, ref):
        assert rel_err(o.cpu(), r) < 1e-4, str(rep)
    got = torch.autograd.grad(sum(o.sum() for o in out), xs)
    want = torch.autograd.grad(sum(r.sum() for r in ref), x64)
    for a, b in zip(got, want):
        assert rel_err(a.cpu(), b) < 1e-3, str(rep)


def test_wkv_at_another_batch():
    """A second batch size makes Dynamo's sizes symbolic: the maxima read their shapes at run
    time (a shape fixed in the graph named an unbound size symbol)."""
    torch._dynamo.reset()
    fast = torch.compile(_wkv_out, backend="ssmc")
    for b, seed in ((2, 13), (3, 14), (5, 15)):
        g = torch.Generator().manual_seed(seed)
        ins = (torch.randn(4, generator=g), torch.randn(4, generator=g), 2 * torch.randn(b, 7, 4, generator=g),
               torch.randn(b, 7, 4, generator=g))
        for o, r in zip(fast(*ins), reference(_wkv_out, ins)):
            assert o.shape == r.shape and rel_err(o, r) < 1e-5
