"""Prefix scans written out in torch ops (ssmc.written_scan): by doubling (a cat of shifted
halves, or a shifted pad), or an up- and down-sweep in place on views of the operands (the form
of mamba.py's pscan), each proven element by element and compiled as the loop it computes;
near misses and scans whose workings are read elsewhere run as written."""
import pytest
import torch
import torch.nn.functional as F

from conftest import ssmc_run
from test_triton import interp, poison_outputs  # noqa: F401  (interp: a fixture used by name)


def sweep_(a, x, dim, skip_level=False, snoop=None):
    """h_t = a_t h_(t-1) + x_t along `dim` (its length a power of two), in place in x: an
    up-sweep combining neighbours into the right one of each pair, then a down-sweep completing
    the left ones from the pair before. `skip_level` leaves the finest down-sweep out (wrong for
    odd steps); `snoop` is called on x between the sweeps."""
    views, av, xv = [], a, x
    while xv.shape[dim] > 1:
        T = xv.shape[dim]
        av, xv = (v.view(*v.shape[:dim], T // 2, 2, *v.shape[dim + 1:]) for v in (av, xv))
        views.append((av, xv))
        lo = (slice(None),) * dim
        xv[lo + (slice(None), 1)] += av[lo + (slice(None), 1)] * xv[lo + (slice(None), 0)]
        av[lo + (slice(None), 1)] *= av[lo + (slice(None), 0)]
        av, xv = av[lo + (slice(None), 1)], xv[lo + (slice(None), 1)]
    if snoop is not None:
        snoop(x)
    for k, (av, xv) in enumerate(reversed(views)):
        if skip_level and k == len(views) - 1:
            break
        lo = (slice(None),) * dim
        xv[lo + (slice(1, None), 0)].add_(av[lo + (slice(1, None), 0)] * xv[lo + (slice(None, -1), 1)])
        av[lo + (slice(1, None), 0)].mul_(av[lo + (slice(None, -1), 1)])


def sweep_scan(a, x, skip_level=False, snoop=None):
    """(b, L, d, n) operands padded to a power of two along L, moved to (b, d, L, n) and swept in
    place on clones; the states cut back to L."""
    L = x.shape[1]
    P = 1 << (L - 1).bit_length()
    a = F.pad(a, (0, 0, 0, 0, 0, P - L)).transpose(2, 1)
    x = F.pad(x, (0, 0, 0, 0, 0, P - L)).transpose(2, 1)
    sweep_(a, x, 2, skip_level, snoop)
    return x.transpose(2, 1)[:, :L]


class SweepScan(torch.autograd.Function):
    """`sweep_scan` with the gradient autograd cannot take through its writes in place: the
    adjoint recurrence (dh_t = g_t + a_(t+1) dh_(t+1)) swept on the reversed steps."""

    @staticmethod
    def forward(ctx, a, x):
        h = sweep_scan(a, x)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, g):
        a, h = ctx.saved_tensors
        return _adjoint(a, h, g)


def strided_sweep_(A, X):
    """h_t = a_t h_(t-1) + x_t along dim 2 of (B, D, T, N) tensors (T a power of two), in place in
    X, through strided slices of the tensors themselves: up, position 2s m - 1 takes the one s
    before it; down, position 2s m + s - 1 takes the prefix ending at 2s m - 1."""
    T = X.shape[2]
    s = 1
    while s < T:
        r, l = slice(2 * s - 1, None, 2 * s), slice(s - 1, None, 2 * s)
        X[:, :, r].add_(A[:, :, r] * X[:, :, l])
        A[:, :, r].mul_(A[:, :, l])
        s *= 2
    s //= 4
    while s >= 1:
        tgt, src = slice(3 * s - 1, None, 2 * s), slice(2 * s - 1, T - s, 2 * s)
        X[:, :, tgt].add_(A[:, :, tgt] * X[:, :, src])
        A[:, :, tgt].mul_(A[:, :, src])
        s //= 2


class StridedPScan(torch.autograd.Function):
    """Laid out as mamba.py's pscan is: (b, L, d, n) operands padded to a power of two, moved to
    (b, d, T, n) and swept in place; it saves the padded states as swept, and its backward
    sweeps the reversed adjoint with the same routine."""

    @staticmethod
    def forward(ctx, a_in, x_in):
        L = x_in.shape[1]
        T = 1 << (L - 1).bit_length()
        A = F.pad(a_in, (0, 0, 0, 0, 0, T - L)).transpose(2, 1)
        X = F.pad(x_in, (0, 0, 0, 0, 0, T - L)).transpose(2, 1)
        strided_sweep_(A, X)
        ctx.save_for_backward(a_in, X)
        return X.transpose(2, 1)[:, :L]

    @staticmethod
    def backward(ctx, g):
        a_in, X = ctx.saved_tensors
        L = g.shape[1]
        T = X.shape[2]
        h = X.transpose(2, 1)[:, :L]
        A = F.pad(a_in[:, 1:].flip(1), (0, 0, 0, 0, 1, T - L)).transpose(2, 1)
        G = F.pad(g.flip(1), (0, 0, 0, 0, 0, T - L)).transpose(2, 1)
        strided_sweep_(A, G)
        dh = G.transpose(2, 1)[:, :L].flip(1)
        return dh * F.pad(h[:, :-1], (0, 0, 0, 0, 1, 0)), dh


def doubling_cat(a, h):
    L, s = h.shape[1], 1
    while s < L:
        h = torch.cat([h[:, :s], h[:, s:] + a[:, s:] * h[:, :-s]], 1)
        a = torch.cat([a[:, :s], a[:, s:] * a[:, :-s]], 1)
        s *= 2
    return h


def doubling_pad(a, h):
    L, s = h.shape[1], 1
    while s < L:
        pad = [0, 0] * (h.dim() - 2) + [s, 0]
        h = h + a * F.pad(h, pad)[:, :L]
        a = a * F.pad(a, pad, value=1.0)[:, :L]
        s *= 2
    return h


def doubling_zeros(a, h):
    """Doubling with the shifted-in fill made from scratch (``new_zeros``, ``torch.ones``)."""
    L, s = h.shape[1], 1
    while s < L:
        rest = h.shape[2:]
        h = h + a * torch.cat([h.new_zeros(h.shape[0], s, *rest), h[:, :-s]], 1)
        a = a * torch.cat([torch.ones(a.shape[0], s, *a.shape[2:], dtype=a.dtype, device=a.device), a[:, :-s]], 1)
        s *= 2
    return h


def doubling_roll(a, h):
    """Doubling by ``torch.roll``, the wrapped-around front overwritten with the fill."""
    L, s = h.shape[1], 1
    while s < L:
        hp, ap = torch.roll(h, s, 1), torch.roll(a, shifts=s, dims=1)
        hp[:, :s] = 0
        ap[:, :s] = 1.0
        h = h + a * hp
        a = a * ap
        s *= 2
    return h


SCANS = {"sweep": SweepScan.apply, "strided": StridedPScan.apply, "doubling_cat": doubling_cat,
         "doubling_pad": doubling_pad, "doubling_zeros": doubling_zeros, "doubling_roll": doubling_roll}


def mixer(scan, per_channel=False):
    """A Mamba-1 selective scan around a parallel scan: discretization, scan, readout, skip;
    `per_channel`: one decay per channel (A's first column), broadcast over the state."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * (A[:, :1] if per_channel else A))
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        hs = scan(dA, BX)
        return (hs @ C.unsqueeze(-1)).squeeze(3) + D * x
    return fn


def loop_mixer(dt, A, B, C, x, D, per_channel=False):
    """The same as a plain loop."""
    dA = torch.exp(dt.unsqueeze(-1) * (A[:, :1] if per_channel else A))
    BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h, ys = torch.zeros_like(BX[:, 0]), []
    for t in range(x.shape[1]):
        h = dA[:, t] * h + BX[:, t]
        ys.append((h * C[:, t, None]).sum(-1))
    return torch.stack(ys, 1) + D * x


def inputs(b=2, L=13, d=4, n=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    dt = torch.rand(b, L, d, generator=g, dtype=dtype) * 0.2
    A = -torch.rand(d, n, generator=g, dtype=dtype) - 0.1
    B, C, x = (torch.randn(b, L, k, generator=g, dtype=dtype) for k in (n, n, d))
    return dt, A, B, C, x, torch.randn(d, generator=g, dtype=dtype)


def _err(a, b):
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("L", [1, 2, 8, 13, 32])
@pytest.mark.parametrize("scan", list(SCANS))
def test_written_scans_compile_to_one_region(scan, L):
    """Each form at lengths a power of two and not: one region, values and gradients equal to the
    plain loop in float64 (fresh inputs per case)."""
    ins = [t.requires_grad_() for t in inputs(L=L, seed=L * 7 + len(scan))]
    fn = mixer(SCANS[scan])
    out, report = ssmc_run(fn, ins)
    want = loop_mixer(*ins)
    if L == 1:          # no scan to write out: one step, whatever form
        assert _err(out, want) < 1e-12
        return
    assert len(report.regions) == 1, str(report)
    assert "parallel scan (written out)" in str(report), str(report)
    assert ("autograd.Function" in str(report)) == (scan in ("sweep", "strided")), str(report)
    assert not report.fallbacks, str(report)
    assert _err(out, want) < 1e-12, str(report)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(L), dtype=out.dtype)
    got, ref = torch.autograd.grad(out, ins, gy), torch.autograd.grad(want, ins, gy)
    for name, p, q in zip("dt A B C x D".split(), got, ref):
        assert _err(p, q) < 1e-10, f"d{name}: {_err(p, q):.3g}\n{report}"


@pytest.mark.parametrize("scan", list(SCANS))
def test_a_decay_per_channel_broadcast_over_the_state(scan):
    """Decays (b, L, d, 1) against inputs (b, L, d, n): the products broadcast; one region, values
    and gradients (A's first column only) equal to the loop."""
    ins = [t.requires_grad_() for t in inputs(L=11, seed=20 + len(scan))]
    out, report = ssmc_run(mixer(SCANS[scan], per_channel=True), ins)
    want = loop_mixer(*ins, per_channel=True)
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    assert _err(out, want) < 1e-12, str(report)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    for p, q in zip(torch.autograd.grad(out, ins, gy), torch.autograd.grad(want, ins, gy)):
        assert _err(p, q) < 1e-10, str(report)


def test_the_sweep_fuses_its_discretization_and_readout():
    """The scan's operands (exp(dt A), dt B x) and its readout (hs @ C) join the region: the
    graph keeps the region call and the skip term only."""
    _, report = ssmc_run(mixer(sweep_scan), inputs(L=16))
    text = str(report)
    assert len(report.regions) == 1, text
    g = report.graphs[0]
    assert g.nodes_out < 15 < g.nodes_in, text
    changed = {name for name, _, ch in report.passes if ch}
    assert {"fuse_prologue", "sink_consumers"} <= changed, text


def test_a_wrong_sweep_is_not_taken():
    """The finest down-sweep left out: the odd steps miss their last term; no region, and the
    compiled function computes what it computed before (wrong as the code is)."""
    fn = mixer(lambda a, x: sweep_scan(a, x, skip_level=True))
    ins = inputs(L=16, seed=3)
    out, report = ssmc_run(fn, ins)
    assert not report.regions, str(report)
    assert _err(out, fn(*ins)) < 1e-12
    assert _err(out, loop_mixer(*ins)) > 1e-3       # the program really is wrong


def test_fills_by_full_and_full_like():
    """The fills written as ``torch.full_like(h[:, :s], 0.0)`` and ``torch.full((..), 1.0)``:
    one region, equal to the loop."""
    def scan(a, h):
        L, s = h.shape[1], 1
        while s < L:
            h = h + a * torch.cat([torch.full_like(h[:, :s], 0.0), h[:, :-s]], 1)
            a = a * torch.cat([torch.full((a.shape[0], s, *a.shape[2:]), 1.0, dtype=a.dtype), a[:, :-s]], 1)
            s *= 2
        return h
    ins = inputs(L=9, seed=14)
    out, report = ssmc_run(mixer(scan), ins)
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    assert _err(out, loop_mixer(*ins)) < 1e-12


@pytest.mark.parametrize("miss", ["wrapped", "half_fill", "fill_written", "short_fill"])
def test_near_misses_of_the_fill_and_roll_doublings_run_as_written(miss):
    """A roll whose wrapped-around front is kept, a fill of 0.5 where the fill must be 0, a fill
    written in place before the cat, a fill one step short: no region, the function as written."""
    def scan(a, h):
        L, s = h.shape[1], 1
        while s < L:
            if miss == "wrapped":
                hp, ap = torch.roll(h, s, 1), torch.roll(a, s, 1)
                ap[:, :s] = 1.0
            else:
                z = h.new_full((h.shape[0], s, *h.shape[2:]), 0.5 if miss == "half_fill" else 0.0)
                if miss == "fill_written":
                    z[:, :1] += 1.0
                hp = torch.cat([z, h[:, :-s]], 1)
                if miss == "short_fill":
                    hp = torch.cat([h.new_zeros(h.shape[0], s - 1, *h.shape[2:]), h[:, :-s],
                                    h.new_zeros(h.shape[0], 1, *h.shape[2:])], 1)
                ap = torch.cat([torch.ones_like(a[:, :s]), a[:, :-s]], 1)
            h = h + a * hp
            a = a * ap
            s *= 2
        return h
    fn = mixer(scan)
    ins = inputs(L=8, seed=9)
    out, report = ssmc_run(fn, ins)
    assert not report.regions, str(report)
    assert _err(out, fn(*ins)) < 1e-12
    assert _err(out, loop_mixer(*ins)) > 1e-3       # each really is another function


def test_the_running_products_read_elsewhere_leave_the_scan_as_written():
    """The doubling's decay products also returned: its workings cannot go, so it runs as
    written, with the reason shown."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * A)
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        a, h, s = dA, BX, 1
        while s < h.shape[1]:
            h = torch.cat([h[:, :s], h[:, s:] + a[:, s:] * h[:, :-s]], 1)
            a = torch.cat([a[:, :s], a[:, s:] * a[:, :-s]], 1)
            s *= 2
        return (h @ C.unsqueeze(-1)).squeeze(3), a
    ins = inputs(L=8, seed=4)
    out, report = ssmc_run(fn, ins)
    assert not report.regions and "intermediate values are read elsewhere" in str(report), str(report)
    for o, w in zip(out, fn(*ins)):
        assert _err(o, w) < 1e-12


def test_a_view_of_an_operand_read_elsewhere_stays():
    """The doubling slices the decays, and one of those slices (the last step's decays) is also
    returned: it stays in the graph, the scan becomes the region."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * A)
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        h = torch.cat([BX[:, :1], BX[:, 1:] + dA[:, 1:] * BX[:, :-1]], 1)
        a = torch.cat([dA[:, :1], dA[:, 1:] * dA[:, :-1]], 1)
        h = torch.cat([h[:, :2], h[:, 2:] + a[:, 2:] * h[:, :-2]], 1)
        return (h @ C.unsqueeze(-1)).squeeze(3), dA[:, 1:].sum()
    ins = inputs(L=4, seed=14)
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == 1, str(report)
    want = fn(*ins)
    assert _err(out[0], loop_mixer(*ins) - ins[5] * ins[4]) < 1e-12 and _err(out[1], want[1]) < 1e-12


def test_states_read_between_the_sweeps_leave_the_scan_as_written():
    """A sum of the half-swept states taken between the sweeps: read before the last write."""
    seen = []

    def fn(dt, A, B, C, x, D):
        y = mixer(lambda a, h: sweep_scan(a, h, snoop=lambda v: seen.append(v.sum(-1))))(dt, A, B, C, x, D)
        return y, seen[-1]
    ins = inputs(L=8, seed=5)
    out, report = ssmc_run(fn, ins)
    assert not report.regions, str(report)
    assert "read before its last write" in str(report) or "read elsewhere" in str(report), str(report)
    seen.clear()
    want = fn(*ins)
    for o, w in zip(out, want):
        assert _err(o, w) < 1e-12


@pytest.mark.parametrize("through_view", [False, True])
def test_a_leaf_written_in_place_is_not_a_leaf(through_view):
    """The decays doubled in place after the doubling read them. Written through a view of them
    (`dA[:, :1].mul_(2)`), a loop reading them at the region's place would see the doubled
    values: no region. Written whole (`dA.mul_(2)`) after every read of its views, the write is a
    new value (capture.functionalize_updates) and the doubling reads the old one: one region."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * A)
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        hs = doubling_cat(dA, BX)
        if through_view:
            dA[:, :1].mul_(2)
        else:
            dA.mul_(2)
        return (hs @ C.unsqueeze(-1)).squeeze(3) + dA.sum(-1)
    ins = inputs(L=8, seed=6)
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == (0 if through_view else 1), str(report)
    assert _err(out, fn(*ins)) < 1e-12


def test_a_leaf_viewing_a_tensor_written_later_is_not_a_leaf():
    """The inputs are views (a slice) of a buffer that is written in place after the scan read
    them: the region would read the written values; no region."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * A)
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        buf = torch.stack([dA, BX])
        hs = doubling_cat(buf[0], buf[1])
        buf.mul_(3)
        return (hs @ C.unsqueeze(-1)).squeeze(3) + buf[0].sum(-1)
    ins = inputs(L=8, seed=13)
    out, report = ssmc_run(fn, ins)
    assert not report.regions, str(report)
    assert _err(out, fn(*ins)) < 1e-12


def test_a_write_through_an_op_it_does_not_follow_is_not_lost():
    """The swept tensor written through an unsqueezed view (an op the proof does not follow)
    between the sweeps: its storage becomes unknown; no region, values as written."""
    def snoop(v):
        v.unsqueeze(0)[0, :, :, :1].mul_(0.5)
    fn = mixer(lambda a, h: sweep_scan(a, h, snoop=snoop))
    ins = inputs(L=8, seed=7)
    out, report = ssmc_run(fn, ins)
    assert not report.regions, str(report)
    assert _err(out, fn(*ins)) < 1e-12


def test_reshape_then_a_write_is_not_trusted():
    """reshape may view or copy; the sweep run on a reshaped tensor whose source is read after:
    not taken (both storages frozen), values as written."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * A)
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        a, h = dA.clone(), BX.clone()
        b, L = h.shape[:2]
        a2, h2 = a.reshape(b, L, -1), h.reshape(b, L, -1)
        sweep_(a2, h2, 1)
        return (h @ C.unsqueeze(-1)).squeeze(3)
    ins = inputs(L=8, seed=8)
    out, report = ssmc_run(fn, ins)
    assert not report.regions, str(report)
    assert _err(out, fn(*ins)) < 1e-12


def _adjoint(a, h, g, scale=1.0):
    a_next = F.pad(a[:, 1:], (0, 0, 0, 0, 0, 1))
    dh = sweep_scan(a_next.flip(1), g.flip(1)).flip(1) * scale
    return dh * F.pad(h[:, :-1], (0, 0, 0, 0, 1, 0)), dh


class HalvedGradient(SweepScan):
    """The same forward with a backward that is not its gradient (halved, as a user might damp
    it on purpose): ssmc must keep it."""

    @staticmethod
    def backward(ctx, g):
        a, h = ctx.saved_tensors
        return _adjoint(a, h, g, 0.5)


def test_a_function_whose_backward_is_not_the_scans_gradient_keeps_it():
    """The forward is a proven scan, but the function's own backward is something else: no
    region, the reason shown, and the gradients are the function's (halved), as eagerly."""
    fn = mixer(HalvedGradient.apply)
    ins = [t.requires_grad_() for t in inputs(L=8, seed=11)]
    out, report = ssmc_run(fn, ins)
    assert not report.regions and "is not the scan's" in str(report), str(report)
    want = fn(*ins)
    assert _err(out, want) < 1e-12
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    for p, q in zip(torch.autograd.grad(out, ins, gy), torch.autograd.grad(want, ins, gy)):
        assert _err(p, q) < 1e-12


def test_the_function_without_gradients_is_inlined_and_compiled():
    """Called with no input needing a gradient, Dynamo inlines the function's forward: the
    written scan is found in the graph itself."""
    ins = inputs(L=12, seed=12)
    out, report = ssmc_run(mixer(SweepScan.apply), ins)
    assert len(report.regions) == 1 and "parallel scan (written out) capture" in str(report), str(report)
    assert _err(out, loop_mixer(*ins)) < 1e-12


def test_the_sweep_on_the_triton_target_under_the_interpreter(interp, monkeypatch):
    """The region a sweep becomes runs a generated Triton kernel (interpreted, outputs poisoned
    first), equal to the float64 loop."""
    ins = inputs(L=16, d=8, n=4, seed=9, dtype=torch.float32)
    poison_outputs(monkeypatch)
    out, report = ssmc_run(mixer(sweep_scan), ins, target="triton")
    assert len(report.regions) == 1 and report.regions[0].target == "triton", str(report)
    want = loop_mixer(*[t.double() for t in ins])
    assert _err(out.double(), want) < 1e-5, str(report)


@pytest.mark.gpu
def test_written_scans_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    for name, scan in SCANS.items():
        ins = [t.float().cuda().requires_grad_() for t in inputs(b=2, L=100, d=64, n=16, seed=10)]
        out, report = ssmc_run(mixer(scan), ins)
        assert len(report.regions) == 1, f"{name}\n{report}"
        ins64 = [t.detach().double().requires_grad_() for t in ins]
        want = loop_mixer(*ins64)
        assert _err(out.double(), want) < 1e-5, f"{name}\n{report}"
        gy = torch.randn_like(out)
        got = torch.autograd.grad(out, ins, gy)
        ref = torch.autograd.grad(want, ins64, gy.double())
        for p, q in zip(got, ref):
            assert _err(p.double(), q) < 1e-4, f"{name}\n{report}"


# -- the log-space scan (minGRU's, after Heinsen) ------------------------------------------------

def log_scan(log_coeffs, log_values, dim=1):
    a_star = log_coeffs.cumsum(dim=dim)
    log_h0_plus_b_star = (log_values - a_star).logcumsumexp(dim=dim)
    return (a_star + log_h0_plus_b_star).exp()


def _log_g(x):
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


def min_gru(x, W, h0=None):
    """minGRU in log space: gate z = sigmoid(k), h = (1 - z) h + z g(v), scanned as one."""
    hidden, gate = (x @ W).chunk(2, dim=-1)
    log_coeffs, log_values = -F.softplus(gate), -F.softplus(-gate) + _log_g(hidden)
    if h0 is not None:          # the state carried in as step 0, as minGRU does
        log_values = torch.cat((h0.log(), log_values), dim=1)
        log_coeffs = F.pad(log_coeffs, (0, 0, 1, 0))
    return log_scan(log_coeffs, log_values)[:, -x.shape[1]:]


def min_gru_loop(x, W, h0=None):
    hidden, gate = (x @ W).chunk(2, dim=-1)
    z, g = torch.sigmoid(gate), torch.where(hidden >= 0, hidden + 0.5, torch.sigmoid(hidden))
    h, out = (torch.zeros_like(hidden[:, 0]) if h0 is None else h0[:, 0]), []
    for t in range(x.shape[1]):
        h = (1 - z[:, t]) * h + z[:, t] * g[:, t]
        out.append(h)
    return torch.stack(out, 1)


@pytest.mark.parametrize("with_h0", [False, True])
def test_a_log_space_scan_is_one_region(with_h0):
    """minGRU's log-space form (cumsum of log gates, logcumsumexp, exp): one region, its gates
    fused; values and gradients equal to the plain loop in float64."""
    g = torch.Generator().manual_seed(21 + with_h0)
    x = torch.randn(2, 37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(8, 32, generator=g, dtype=torch.float64, requires_grad=True)
    ins = (x, W) + ((torch.rand(2, 1, 16, generator=g, dtype=torch.float64).add(0.1).requires_grad_(),) if with_h0 else ())
    out, report = ssmc_run(min_gru, ins)
    assert len(report.regions) == 1 and "log-space scan" in str(report), str(report)
    want = min_gru_loop(*ins)
    assert _err(out, want) < 1e-12, str(report)
    gy = torch.randn(out.shape, generator=g, dtype=out.dtype)
    for p, q in zip(torch.autograd.grad(out, ins, gy), torch.autograd.grad(want, ins, gy)):
        assert _err(p, q) < 1e-10, str(report)


def test_a_log_space_near_miss_runs_as_written():
    """logcumsumexp of log b minus another cumsum than the one added back: no scan."""
    def fn(la, lb):
        A = la.cumsum(1)
        return (A + (lb - 2 * A).logcumsumexp(1)).exp()
    g = torch.Generator().manual_seed(23)
    la, lb = -torch.rand(2, 9, 4, generator=g, dtype=torch.float64), torch.randn(2, 9, 4, generator=g, dtype=torch.float64)
    out, report = ssmc_run(fn, (la, lb))
    assert not report.regions, str(report)
    assert _err(out, fn(la, lb)) < 1e-12


@pytest.mark.gpu
def test_a_log_space_scan_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    g = torch.Generator().manual_seed(24)
    x = torch.randn(4, 300, 64, generator=g).cuda().requires_grad_()
    W = (torch.randn(64, 256, generator=g) / 8).cuda().requires_grad_()
    out, report = ssmc_run(min_gru, (x, W))
    assert len(report.regions) == 1, str(report)
    x64, W64 = (t.detach().double().requires_grad_() for t in (x, W))
    want = min_gru_loop(x64, W64)
    assert _err(out.double(), want) < 1e-5, str(report)
    gy = torch.randn_like(out)
    for p, q in zip(torch.autograd.grad(out, (x, W), gy), torch.autograd.grad(want, (x64, W64), gy.double())):
        assert _err(p.double(), q) < 1e-4, str(report)


def test_a_prefix_product_scan_is_one_region():
    """``P * cumsum(x / P)`` with ``P = cumprod(a)``: the loop, with no division; values and
    gradients equal to the plain loop, and finite where the products underflow (eager: nan)."""
    def fn(dt, A, B, C, x, D):
        dA = torch.exp(dt.unsqueeze(-1) * A)
        BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
        P = torch.cumprod(dA, dim=1)
        hs = P * torch.cumsum(BX / P, dim=1)
        return (hs @ C.unsqueeze(-1)).squeeze(3) + D * x
    ins = [t.requires_grad_() for t in inputs(L=17, seed=25)]
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == 1 and "prefix-product scan" in str(report), str(report)
    want = loop_mixer(*ins)
    assert _err(out, want) < 1e-10, str(report)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    for p, q in zip(torch.autograd.grad(out, ins, gy), torch.autograd.grad(want, ins, gy)):
        assert _err(p, q) < 1e-8, str(report)
    long = [t.float() for t in inputs(L=3000, seed=26)]        # cumprod underflows in float32
    long[0] = long[0] + 1.0
    got, _ = ssmc_run(fn, long)
    assert torch.isfinite(got).all() and not torch.isfinite(fn(*long)).all()
    assert _err(got.double(), loop_mixer(*[t.double() for t in long])) < 1e-4


def test_closed_forms_keep_their_region_when_recompiled_for_other_sizes():
    """A second length and a second batch make Dynamo trace again with symbolic sizes: the
    log-space and prefix-product forms are matched there too (each graph one region), equal
    to the loop at every size, gradients included."""
    import ssmc
    from ssmc.backend import ssmc_backend

    def prefix(a, b):
        P = torch.cumprod(a, 1)
        return P * torch.cumsum(b / P, 1)
    g = torch.Generator().manual_seed(31)
    for fn in (min_gru, prefix):
        torch._dynamo.reset()
        rep = ssmc.Report()
        cf = torch.compile(fn, backend=lambda gm, ex: ssmc_backend(gm, ex, options={}, _report=rep))
        for b, L in ((2, 8), (2, 13), (3, 11)):
            if fn is min_gru:
                ins = (torch.randn(b, L, 4, generator=g, dtype=torch.float64).requires_grad_(),
                       torch.randn(4, 16, generator=g, dtype=torch.float64).requires_grad_())
                want = min_gru_loop(*ins)
            else:
                ins = ((torch.rand(b, L, 3, generator=g, dtype=torch.float64) * 0.5 + 0.4).requires_grad_(),
                       torch.randn(b, L, 3, generator=g, dtype=torch.float64).requires_grad_())
                want = prefix(*ins)
            out = cf(*ins)
            assert _err(out, want) < 1e-10
            gy = torch.randn(out.shape, generator=g, dtype=out.dtype)
            for p, q in zip(torch.autograd.grad(out, ins, gy), torch.autograd.grad(want, ins, gy)):
                assert _err(p, q) < 1e-8
        assert len(rep.graphs) >= 2 and all(len(gr.regions) == 1 for gr in rep.graphs), \
            [(len(gr.regions), gr.fallbacks) for gr in rep.graphs]


def odd_even_scan(a, x, dim):
    """h_t = a_t h_(t-1) + x_t along `dim` by the recursive odd-even scheme of JAX's
    `lax.associative_scan` as torch ports write it: combine neighbouring pairs, scan the pairs,
    fix up the even positions from the odd ones, interleave the two by stack + flatten (any
    length: the shorter half padded, the interleave cut back)."""
    def at(start, stop=None, step=None):
        return (slice(None),) * dim + (slice(start, stop, step),)

    def combine(l, r):
        return l[0] * r[0], r[0] * l[1] + r[1]

    def interleave(u, v):
        cut = u.shape[dim] == v.shape[dim] + 1
        if cut:
            pad = [0, 0] * v.dim()
            pad[2 * (v.dim() - dim - 1) + 1] = 1
            v = F.pad(v, pad)
        w = torch.stack([u, v], dim + 1).flatten(dim, dim + 1)
        return w[at(0, w.shape[dim] - 1)] if cut else w

    def scan(pair):
        n = pair[0].shape[dim]
        if n < 2:
            return pair
        odd = scan(combine([e[at(0, -1, 2)] for e in pair], [e[at(1, None, 2)] for e in pair]))
        first = [e[at(0, -1)] for e in odd] if n % 2 == 0 else odd
        even = combine(first, [e[at(2, None, 2)] for e in pair])
        even = [torch.cat([e[at(0, 1)], r], dim) for e, r in zip(pair, even)]
        return [interleave(e, o) for e, o in zip(even, odd)]
    return scan([a, x])[1]


@pytest.mark.parametrize("L", [2, 5, 8, 11])
def test_odd_even_scan_interleaved_by_stack(L):
    """The recursive odd-even scan (S5 and GateLoop torch ports of JAX's associative_scan), its
    halves interleaved by `torch.stack` then `flatten`: a stack of followed tensors is followed
    too (it ran as written)."""
    g = torch.Generator().manual_seed(L)
    a, x = torch.rand(2, L, 3, generator=g), torch.randn(2, L, 3, generator=g)

    def fn(a, x):
        return odd_even_scan(a, x, 1) * 2
    out, rep = ssmc_run(fn, (a, x))
    assert len(rep.regions) == 1, str(rep)
    h, ref = torch.zeros(2, 3, dtype=torch.float64), []
    for t in range(L):
        h = a[:, t].double() * h + x[:, t].double()
        ref.append(2 * h)
    assert torch.allclose(out.double(), torch.stack(ref, 1), atol=1e-5)
    ag, xg = a.clone().requires_grad_(), x.clone().requires_grad_()
    got = torch.autograd.grad(ssmc_run(fn, (ag, xg))[0].sum(), (ag, xg))
    a64, x64 = a.double().requires_grad_(), x.double().requires_grad_()
    want = torch.autograd.grad(fn(a64, x64).sum(), (a64, x64))
    for u, w in zip(got, want):
        assert torch.allclose(u.double(), w, atol=1e-4)
