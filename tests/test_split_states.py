"""split_states: loops carrying several states run as one region per state, equal to float64
eager, gradients too; loops whose states cannot be split run as written, with the reason."""
import pytest
import torch

from conftest import as_tuple, declined, grads_match, reference, rel_err, ssmc_run
from ssmc.runtime.op import lookup


def rwkv_wkv(k, v, w, u):
    """RWKV-4's time mixing without the max-stabiliser: two accumulators, the output read from
    them before the step's update."""
    b, L, d = k.shape
    num = k.new_zeros(b, d)
    den = k.new_zeros(b, d)
    ys = []
    for t in range(L):
        ek, euk = torch.exp(k[:, t]), torch.exp(u + k[:, t])
        ys.append((num + euk * v[:, t]) / (den + euk))
        num = torch.exp(-torch.exp(w)) * num + ek * v[:, t]
        den = torch.exp(-torch.exp(w)) * den + ek
    return torch.stack(ys, 1)


def mlstm(q, k, v, f_pre, i_pre):
    """An mLSTM-style memory: a matrix state C and a normaliser n of another shape, read
    together (C q) / max(|n . q|, 1); the final states returned."""
    b, L, dk = q.shape
    C = q.new_zeros(b, dk, v.shape[-1])
    n = q.new_zeros(b, dk)
    hs = []
    for t in range(L):
        f, i = torch.sigmoid(f_pre[:, t]), torch.exp(i_pre[:, t])
        C = f[:, None, None] * C + i[:, None, None] * k[:, t, :, None] * v[:, t, None, :]
        n = f[:, None] * n + i[:, None] * k[:, t]
        num = torch.einsum("bkv,bk->bv", C, q[:, t])
        den = torch.clamp((n * q[:, t]).sum(-1, keepdim=True).abs(), min=1.0)
        hs.append(num / den)
    return torch.stack(hs, 1), C, n


def cascade(x, a1, a2):
    """Two states in series: the second reads the first's new value."""
    h1 = torch.zeros_like(x[:, 0])
    h2 = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h1 = a1[:, t] * h1 + x[:, t]
        h2 = a2 * h2 + 0.5 * h1
        ys.append(h2 - h1)
    return torch.stack(ys, 1), h1


def _inputs(name, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    if name == "rwkv":
        return (0.5 * r(2, 7, 4), r(2, 7, 4), r(4), 0.5 * r(4))
    if name == "mlstm":
        return (r(2, 6, 3), r(2, 6, 3), r(2, 6, 5), r(2, 6), 0.3 * r(2, 6))
    return (r(2, 7, 3), torch.rand(2, 7, 3, generator=g), torch.rand(3, generator=g))


PROGRAMS = {"rwkv": rwkv_wkv, "mlstm": mlstm, "cascade": cascade}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_split_values_and_gradients(name):
    fn, ins = PROGRAMS[name], _inputs(name, seed=len(name))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 2 and not rep.fallbacks, str(rep)
    assert all("split from loop0" in " ".join(r.notes) for r in rep.regions), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5, str(rep)
    xs = [x.clone().requires_grad_() for x in ins]
    out = as_tuple(ssmc_run(fn, xs)[0])
    g = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out]
    got = torch.autograd.grad(sum((o.double() * c).sum() for o, c in zip(out, cots)), xs)
    x64 = [x.double().requires_grad_() for x in ins]
    want = torch.autograd.grad(sum((o * c).sum() for o, c in zip(as_tuple(fn(*x64)), cots)), x64)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-4, f"input {i}: {rel_err(a, b):.3g}"


@pytest.mark.parametrize("name", ["cascade", "rotation_pair", "second_order_rebound"])
def test_split_and_stacked_states_on_the_triton_interpreter(name, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    fn, ins, n = (cascade, _inputs("cascade", seed=3), 2) if name == "cascade" else \
        (COUPLED[name][0], _coupled_inputs(name, seed=3), 1)
    out, rep = ssmc_run(fn, ins, target="triton")
    assert [r.target for r in rep.regions] == ["triton"] * n, str(rep)
    for r in rep.regions:                      # the generated kernel ran, not a fallback
        entry = lookup(r.key)
        assert entry.failure is None and getattr(entry.kernel, "fallback", None) is None, entry.failure
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5


def _coupled_nonlinear(x, a):
    p = torch.zeros_like(x[:, 0])
    q = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        p, q = a * p - 0.5 * q * p + x[:, t], a * q + 0.5 * p      # p and q read each other, q * p
        ys.append(p)
    return torch.stack(ys, 1)


def _coupled_shapes(x, a):
    p = torch.zeros_like(x[:, 0])
    q = torch.zeros_like(x[:, 0, :1])
    ys = []
    for t in range(x.shape[1]):
        p, q = a * p - q + x[:, t], 0.5 * q + p.sum(-1, keepdim=True)
        ys.append(p)
    return torch.stack(ys, 1)


def _one_nonlinear(x, a):
    h1 = torch.zeros_like(x[:, 0])
    h2 = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h1 = a * h1 + x[:, t]
        h2 = torch.tanh(a * h2 + x[:, t])
        ys.append(h1 + h2)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn, why", [
    (_coupled_nonlinear, "is not linear in the states"),
    (_coupled_shapes, "differ in shape"),
    (_one_nonlinear, "another state of loop0, was declined"),
])
def test_unsplittable_loops_run_as_written(fn, why):
    declined(fn, (torch.randn(2, 6, 3), torch.rand(3)), why, untouched=True)


def test_split_states_can_be_disabled():
    ins = _inputs("cascade", seed=4)
    out, rep = ssmc_run(cascade, ins, disable_passes=["split_states"])
    assert not rep.regions and any("carries 2 values" in w for _, w in rep.fallbacks), str(rep)


def rotation_pair(x, a, b):
    """A rotation-scale written as two real states that read each other."""
    p = torch.zeros_like(x[:, 0])
    q = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        p, q = a * p - b * q + x[:, t], b * p + a * q
        ys.append(p + 0.5 * q)
    return torch.stack(ys, 1), q


def oscillator(x, w, g):
    """A damped oscillator (semi-implicit Euler), damping read from the input at each step."""
    pos = torch.zeros_like(x[:, 0])
    vel = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        vel = (1 - g[:, t]) * vel - w * pos + x[:, t]
        pos = pos + 0.1 * vel
        ys.append(pos)
    return torch.stack(ys, 1)


def pair_and_energy(x, a, b):
    """A coupled pair, and an accumulator of a nonlinear function of it (a third state)."""
    p = torch.zeros_like(x[:, 0])
    q = torch.zeros_like(x[:, 0])
    s = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        p, q = a * p - b * q + x[:, t], b * p + a * q
        s = 0.9 * s + p * p + q * q
        ys.append(s / (1 + q.abs()))
    return torch.stack(ys, 1)


def second_order(x, a1, a2):
    """h_t = a1_t h_(t-1) + a2 h_(t-2) + x_t, the value two steps back carried as its own state."""
    h = torch.zeros_like(x[:, 0])
    hp = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        new = a1[:, t] * h + a2 * hp + x[:, t]
        hp = h.clone()
        h = new
        ys.append(h)
    return torch.stack(ys, 1), hp


def second_order_rebound(x, a1, a2, h0, h1):
    """The same recurrence as users write it with tuple rebinding (``h, hp = new, h``): a step
    reads the value two steps back, which re-rolling carries as a second state; nonzero initial
    states, and both final states returned (hp ends as step L-2's value)."""
    h, hp = h0, h1
    ys = []
    for t in range(x.shape[1]):
        h, hp = a1[:, t] * h + a2 * hp + x[:, t], h
        ys.append(h)
    return torch.stack(ys, 1), h, hp


def third_order_rebound(x, a1, a2, a3):
    """Three steps back: h, h1, h2 = new, h, h1."""
    h = torch.zeros_like(x[:, 0])
    h1 = torch.zeros_like(h)
    h2 = torch.zeros_like(h)
    ys = []
    for t in range(x.shape[1]):
        h, h1, h2 = a1 * h + a2 * h1 + a3 * h2 + x[:, t], h, h1
        ys.append(h - 0.5 * h)
    return torch.stack(ys, 1)


def _coupled_inputs(name, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 3, generator=g)
    if name == "oscillator":
        return (x, torch.rand(3, generator=g), 0.2 * torch.rand(2, 7, 3, generator=g))
    if name == "second_order":
        return (x, 0.5 * torch.rand(2, 7, 3, generator=g), 0.3 * torch.randn(3, generator=g))
    if name == "second_order_rebound":
        return (x, 0.5 * torch.rand(2, 7, 3, generator=g), 0.3 * torch.randn(3, generator=g),
                torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g))
    if name == "third_order_rebound":
        return (x, 0.4 * torch.rand(3, generator=g), 0.3 * torch.randn(3, generator=g), 0.2 * torch.randn(3, generator=g))
    return (x, 0.8 * torch.rand(3, generator=g), 0.3 * torch.randn(3, generator=g))


COUPLED = {"rotation_pair": (rotation_pair, 1), "oscillator": (oscillator, 1), "pair_and_energy": (pair_and_energy, 2),
           "second_order": (second_order, 1), "second_order_rebound": (second_order_rebound, 1),
           "third_order_rebound": (third_order_rebound, 1)}


@pytest.mark.parametrize("name", sorted(COUPLED))
def test_coupled_states_stacked(name):
    """States that read each other become one state with a 2x2 transition per element."""
    fn, n_regions = COUPLED[name]
    ins = _coupled_inputs(name, seed=len(name))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == n_regions and not rep.fallbacks, str(rep)
    assert rep.regions[0].strategy == "block_sparse" and "update each other: stacked" in " ".join(rep.regions[0].notes)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5, str(rep)
    xs = [x.clone().requires_grad_() for x in ins]
    out = as_tuple(ssmc_run(fn, xs)[0])
    x64 = [x.double().requires_grad_() for x in ins]
    got = torch.autograd.grad(sum(o.sum() for o in out), xs)
    want = torch.autograd.grad(sum(o.sum() for o in as_tuple(fn(*x64))), x64)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-4, f"input {i}: {rel_err(a, b):.3g}"


def test_reverse_loop_with_two_states():
    def fn(k, v, w):
        num = torch.zeros_like(k[:, 0])
        den = torch.zeros_like(k[:, 0])
        ys = []
        for t in range(k.shape[1] - 1, -1, -1):
            num = torch.exp(-w) * num + torch.exp(k[:, t]) * v[:, t]
            den = torch.exp(-w) * den + torch.exp(k[:, t])
            ys.append(num / den)
        return torch.stack(ys[::-1], 1)
    g = torch.Generator().manual_seed(9)
    ins = (0.5 * torch.randn(2, 7, 3, generator=g), torch.randn(2, 7, 3, generator=g), torch.rand(3, generator=g))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 2 and not rep.fallbacks, str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5


def test_layers_unrolled_inside_each_step():
    """A stack of recurrent layers written as an inner loop over layers inside the time loop:
    a[l] is read at the same index in every step (an invariant, not a time read), each layer's
    state is a piece, tanh between layers runs after each piece."""
    def fn(x, a):
        hs = [torch.zeros_like(x[:, 0]) for _ in range(3)]
        ys = []
        for t in range(x.shape[1]):
            inp = x[:, t]
            for layer in range(3):
                hs[layer] = a[layer] * hs[layer] + inp
                inp = torch.tanh(hs[layer])
            ys.append(inp)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(12)
    ins = (torch.randn(2, 6, 3, generator=g), torch.rand(3, 3, generator=g))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 3 and not rep.fallbacks, str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5


def cascade_tuple(x, a, h0):
    """A cascade written as one tuple assignment: h2's update reads h1 from before its update."""
    h1, h2 = h0, torch.zeros_like(h0)
    ys = []
    for t in range(x.shape[1]):
        h1, h2 = a[:, t] * h1 + x[:, t], 0.5 * h2 + h1
        ys.append(h2 - h1)
    return torch.stack(ys, 1), h2


def cascade_reordered(x, a, h0):
    """The same cascade with h2's line written above h1's (and h1 read after its update too)."""
    h1, h2 = h0, torch.zeros_like(h0)
    ys = []
    for t in range(x.shape[1]):
        h2 = 0.5 * h2 + h1
        h1 = a[:, t] * h1 + x[:, t]
        ys.append(h2 * h1)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [cascade_tuple, cascade_reordered])
def test_state_read_before_its_update_by_a_later_state(fn):
    """h2 needs h1 one step back: the two are stacked (a 2x2 transition, a row of it h1's old
    value), not declined; values and gradients against float64."""
    g = torch.Generator().manual_seed(21)
    ins = (torch.randn(2, 7, 3, generator=g), torch.rand(2, 7, 3, generator=g), torch.randn(2, 3, generator=g))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    assert rep.regions[0].strategy == "block_sparse", str(rep)
    assert "from before its update: stacked" in " ".join(rep.regions[0].notes), rep.regions[0].notes
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5, str(rep)
    grads_match(fn, ins, tol=1e-4)


def _old_in_another_shape(x, a):
    """A (b, d, n) state reading a (b, d) one from before that one's update (no stacking: the
    shapes differ)."""
    h1 = torch.zeros_like(x[:, 0])
    h2 = x.new_zeros(*x[:, 0].shape, 4)
    ys = []
    for t in range(x.shape[1]):
        h2 = 0.5 * h2 + h1[..., None]
        h1 = a * h1 + x[:, t]
        ys.append(h2.sum(-1))
    return torch.stack(ys, 1)


def _running_mean(x):
    """A cumulative average with a tensor step counter: a state no per-step input drives."""
    s = torch.zeros_like(x[:, 0])
    n = x.new_zeros(x.shape[0], 1)
    ys = []
    for t in range(x.shape[1]):
        s = s + x[:, t]
        n = n + 1
        ys.append(s / n)
    return torch.stack(ys, 1)


def _retention_normalised(q, k, v, decay):
    """Recurrent retention with torchscale's scale normaliser: the scale state has no per-step
    input, and the memory's update reads it before and after its own update (under a sqrt)."""
    b, h, L, _ = q.shape
    kv = q.new_zeros(b, h, k.shape[-1], v.shape[-1])
    scale = q.new_zeros(b, h, 1, 1)
    outs = []
    for t in range(L):
        cur = k[:, :, t].unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        prev_scale = scale
        scale = prev_scale * decay.view(h, 1, 1) + 1
        kv = kv * (prev_scale.sqrt() * decay.view(h, 1, 1) / scale.sqrt()) + cur / scale.sqrt()
        outs.append(torch.sum(q[:, :, t].unsqueeze(-1) * kv, dim=-2))
    return torch.stack(outs, 2)


def _old_read_inputs(name, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "retention":
        r = lambda *s: torch.randn(*s, generator=g)     # noqa: E731
        return (r(2, 2, 7, 3), r(2, 2, 7, 3), r(2, 2, 7, 4), 0.4 + 0.5 * torch.rand(2, generator=g))
    if name == "running_mean":
        return (torch.randn(2, 7, 3, generator=g),)
    return (torch.randn(2, 6, 3, generator=g), torch.rand(3, generator=g))


OLD_READS = {"another_shape": _old_in_another_shape, "running_mean": _running_mean,
             "retention": _retention_normalised}


@pytest.mark.parametrize("name", sorted(OLD_READS))
def test_state_read_before_its_update_feeds_a_later_piece(name):
    """A state read before its update by a later state of another shape, or through an op that
    is not linear (RetNet's `prev_scale.sqrt()`), is given to the later piece as its new values
    one step late; a state with no per-step input (a step counter) gets its length from the
    loop's reads."""
    fn, ins = OLD_READS[name], _old_read_inputs(name, seed=len(name))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 2 and not rep.fallbacks, str(rep)
    if name != "running_mean":
        assert "before each update feed later pieces" in " ".join(n for r in rep.regions for n in r.notes), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5, str(rep)
    grads_match(fn, ins, tol=1e-4)


@pytest.mark.parametrize("name", ["running_mean", "retention"])
def test_state_read_before_its_update_on_the_triton_interpreter(name, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    fn, ins = OLD_READS[name], _old_read_inputs(name, seed=2)
    out, rep = ssmc_run(fn, ins, target="triton")
    assert [r.target for r in rep.regions] == ["triton"] * 2, str(rep)
    for r in rep.regions:
        entry = lookup(r.key)
        assert entry.failure is None and getattr(entry.kernel, "fallback", None) is None, entry.failure
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5


def test_result_read_from_the_state_before_its_update_and_fed_into_it():
    """m = a * h is both a result of the step and a term of the update (it was declined: "a
    result of the step is computed from the state before its update"): the loop is cut one step
    later and m, carried across the cut, is computed again from the state it was made from."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            m = a * h
            h = m + x[:, t]
            ys.append(m)
        return torch.stack(ys, 1)
    ins = (torch.randn(2, 6, 3), torch.rand(3))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5, str(rep)
    grads_match(fn, ins)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rwkv", "mlstm", "cascade", "rotation_pair", "oscillator", "second_order_rebound"])
def test_new_forms_on_the_gpu(name):
    """Split and stacked loops on CUDA (target auto: the generated kernels), against float64
    eager on the CPU, with fresh inputs of a moderate length."""
    fn = {**PROGRAMS, **{k: v[0] for k, v in COUPLED.items()}}[name]
    ins = _inputs(name, seed=7) if name in PROGRAMS else _coupled_inputs(name, seed=7)
    if name == "rotation_pair":          # |eigenvalues| under 1 over the longer run
        ins = (ins[0], 0.8 * ins[1], ins[2].clamp(-0.3, 0.3))
    ins = tuple(torch.cat([x] * 40, 1) if x.dim() >= 2 and x.shape[1] in (6, 7) else x for x in ins)
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert rep.regions and not rep.fallbacks, str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o.cpu(), r) < 1e-4, str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OLD_READS))
def test_state_read_before_its_update_by_a_later_piece_on_the_gpu(name):
    """The pieces fed one step late, and a piece with no per-step input, on CUDA (target auto),
    L 280, against float64 eager on the CPU."""
    fn, ins = OLD_READS[name], _old_read_inputs(name, seed=23)
    ins = tuple(torch.cat([x] * 40, -2 if name == "retention" else 1) if x.dim() >= 3 else x for x in ins)
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(rep.regions) == 2 and not rep.fallbacks, str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o.cpu(), r) < 1e-4, str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [cascade_tuple, cascade_reordered])
def test_state_read_before_its_update_on_the_gpu(fn):
    """The stacked cascade on CUDA (target auto), L 280, against float64 eager on the CPU."""
    g = torch.Generator().manual_seed(22)
    ins = (torch.randn(2, 280, 3, generator=g), torch.rand(2, 280, 3, generator=g), torch.randn(2, 3, generator=g))
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "block_sparse" and not rep.fallbacks, str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o.cpu(), r) < 1e-4, str(rep)


def test_stabilised_accumulators_name_the_max():
    """RWKV-4's log-space form: numerator and denominator rescaled by a running maximum
    (m = max(m + w, k)). The maximum is no linear update; the reason names it."""
    def fn(k, v, w, u):
        num, den = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
        m = torch.full_like(k[:, 0], -1e30)
        ys = []
        for t in range(k.shape[1]):
            mo = torch.maximum(m, u + k[:, t])
            ys.append((torch.exp(m - mo) * num + torch.exp(u + k[:, t] - mo) * v[:, t])
                      / (torch.exp(m - mo) * den + torch.exp(u + k[:, t] - mo)))
            mn = torch.maximum(m - torch.exp(w), k[:, t])
            num = torch.exp(m - torch.exp(w) - mn) * num + torch.exp(k[:, t] - mn) * v[:, t]
            den = torch.exp(m - torch.exp(w) - mn) * den + torch.exp(k[:, t] - mn)
            m = mn
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(13)
    declined(fn, (torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g), torch.randn(3, generator=g),
                  torch.randn(3, generator=g)), "goes through `maximum`")


def _random_multi_state(rng) -> str:
    """The source of a loop of 2 or 3 states of one shape, each updated linearly from its own
    value, some of the others (old or new, as the statement order or a tuple assignment makes
    it) and the input, with coefficients constant, per-step or read from a parameter matrix."""
    k, rank3 = rng.choice([2, 2, 3]), rng.random() < 0.4
    e = ", :, None" if rank3 else ""

    def coef(i, j):
        r = rng.random()
        return (f"{rng.uniform(-0.5, 0.5):.3f}" if r < 0.4 else
                f"0.3 * torch.tanh(w[:, t, {j}, None{', None' if rank3 else ''}])" if r < 0.7 else f"c{i}{j}")
    exprs = {}
    for i in range(k):
        decay = rng.choice([f"torch.sigmoid(z[:, t{e}])", f"{rng.uniform(0.3, 0.95):.3f}",
                            f"torch.exp(-F.softplus(z[:, t{e}] + {i}))"])
        terms = [f"{decay} * h{i}"] + [f"{coef(i, j)} * h{j}" for j in range(k) if j != i and rng.random() < 0.6]
        terms.append("x[:, t, :, None] * u[:, t, None, :]" if rank3 else f"{rng.uniform(0.5, 1.5):.2f} * x[:, t]")
        exprs[i] = " + ".join(terms)
    order = rng.sample(range(k), k)
    body = ([f"{', '.join(f'h{i}' for i in order)} = {', '.join(exprs[i] for i in order)}"]
            if rng.random() < 0.35 else [f"h{i} = {exprs[i]}" for i in order])
    out = " + ".join(f"{rng.uniform(-1, 1):.2f} * h{i}" for i in range(k))
    shape = "x.shape[0], x.shape[2], 4" if rank3 else "x.shape[0], x.shape[2]"
    lines = ["def program(x, z, w, u, cc):"]
    lines += [f"    c{i}{j} = cc[{i}, {j}]" for i in range(k) for j in range(k) if i != j]
    lines += [f"    h{i} = x.new_zeros({shape})" for i in range(k)]
    lines += ["    ys = []", "    for t in range(x.shape[1]):"] + ["        " + b for b in body]
    lines += [f"        ys.append({out})", "    return torch.stack(ys, 1), h0"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("seed", range(24))
def test_random_multi_state_loops(seed):
    """Random loops of several linear states (coupled, cascaded, read before or after their
    update, tuple or sequential assignment): each compiles to regions (stacked or split) with no
    fallback, and values and gradients equal float64 eager."""
    import random
    src = _random_multi_state(random.Random(seed))
    ns = {"torch": torch, "F": torch.nn.functional}
    exec(src, ns)
    fn = ns["program"]
    g = torch.Generator().manual_seed(seed)
    L = (3, 5, 9)[seed % 3]
    ins = (torch.randn(2, L, 3, generator=g), torch.randn(2, L, 3, generator=g), torch.randn(2, L, 3, generator=g),
           torch.randn(2, L, 4, generator=g), 0.4 * torch.randn(3, 3, generator=g))
    out, rep = ssmc_run(fn, ins)
    assert rep.regions and not rep.fallbacks, f"{rep}\n{src}"
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-5, f"{rep}\n{src}"
    grads_match(fn, ins, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
def test_random_multi_state_loops_on_the_gpu(seed):
    """The random multi-state loops on CUDA (target auto: stacked states of 2 or 3 on the
    block-sparse kernels, split ones on the scans), L 40, against float64 eager on the CPU."""
    import random
    src = _random_multi_state(random.Random(seed))
    ns = {"torch": torch, "F": torch.nn.functional}
    exec(src, ns)
    fn = ns["program"]
    g = torch.Generator().manual_seed(seed)
    ins = (torch.randn(2, 40, 3, generator=g), torch.randn(2, 40, 3, generator=g), torch.randn(2, 40, 3, generator=g),
           torch.randn(2, 40, 4, generator=g), 0.4 * torch.randn(3, 3, generator=g))
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert rep.regions and not rep.fallbacks, f"{rep}\n{src}"
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o.cpu(), r) < 1e-4, f"{rep}\n{src}"
