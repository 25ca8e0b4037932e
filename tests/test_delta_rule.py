"""Delta-rule recurrences: the state S (b, h, dk, dv) is read through k^T S and updated by a
rank-1 product, S' = S + k (beta (v - k^T S))^T = (I - beta k k^T) S + beta k v^T: linear in S,
the transition a matrix along dk (not the state's last dim)."""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import ssmc

from conftest import as_tuple, grads_match, reference, rel_err, ssmc_run


def _delta(q, k, v, beta):                        # (b, h, L, d); beta (b, h, L)
    b, h, L, dk = q.shape
    S = q.new_zeros(b, h, dk, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(L):
        k_t, v_t = k[:, :, i], v[:, :, i].clone()
        v_t = (v_t - (S.clone() * k_t[..., None]).sum(-2)) * beta[:, :, i][..., None]
        S = S.clone() + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        o[:, :, i] = torch.einsum("bhd,bhdm->bhm", q[:, :, i], S)
    return o, S


def _gated_delta(q, k, v, beta, g):               # g (b, h, L): a log decay per head
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for i in range(q.shape[2]):
        S = S * g[:, :, i].exp()[..., None, None]
        kv = (S * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        d = (v[:, :, i] - kv) * beta[:, :, i].unsqueeze(-1)
        S = S + k[:, :, i].unsqueeze(-1) * d.unsqueeze(-2)
        out.append((S * q[:, :, i].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(out, 2), S


def _delta_per_channel_decay(q, k, v, beta, g):   # a decay per key channel (KDA-like), mean form
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for i in range(q.shape[2]):
        S = S * torch.sigmoid(g[:, :, i])[..., None, None] * k[:, :, i].abs().unsqueeze(-1).exp().neg().exp()
        err = v[:, :, i] - q.shape[3] * (S * k[:, :, i].unsqueeze(-1)).mean(-2)
        S = S + beta[:, :, i, None, None] * k[:, :, i].unsqueeze(-1) * err.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, i], S))
    return torch.stack(out, 2)


def _delta_transposed(q, k, v, beta):            # S laid out (b, h, dv, dk): the transition along the last dim
    S = q.new_zeros(q.shape[0], q.shape[1], v.shape[3], q.shape[3])
    out = []
    for i in range(q.shape[2]):
        k_t = k[:, :, i]
        u = (v[:, :, i] - (S * k_t[:, :, None, :]).sum(-1)) * beta[:, :, i, None]
        S = S + u[..., None] * k_t[:, :, None, :]
        out.append((S * q[:, :, i, None, :]).sum(-1))
    return torch.stack(out, 2)


def _delta_einsum(q, k, v, beta):                # k^T S and the update written as einsums
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for i in range(q.shape[2]):
        kv = torch.einsum("bhk,bhkv->bhv", k[:, :, i], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, :, i], (v[:, :, i] - kv) * beta[:, :, i, None])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, i], S))
    return torch.stack(out, 2), S


def _delta_matmul(q, k, v, beta):                 # k^T S as a matmul, its summed dim kept (size 1)
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for i in range(q.shape[2]):
        kv = k[:, :, i].unsqueeze(-2) @ S
        S = S + k[:, :, i].unsqueeze(-1) * ((v[:, :, i].unsqueeze(-2) - kv) * beta[:, :, i, None, None])
        out.append((q[:, :, i].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(out, 2), S


def _delta_product(q, k, v, beta, g):            # two Householder updates a step (DeltaProduct)
    """Step t reads k, v, beta (2L long) at 2t and 2t + 1 (an inner loop of two updates) and q, g
    (L long) at t. The second update reads the first one's result through k^T S."""
    L = q.shape[2]
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for i in range(L):
        S = S * g[:, :, i].exp()[..., None, None]
        for j in range(2):
            k_j, v_j, b_j = k[:, :, 2 * i + j], v[:, :, 2 * i + j], beta[:, :, 2 * i + j]
            S = S + (v_j - (S * k_j[..., None]).sum(-2)).unsqueeze(-2) * k_j[..., None] * b_j[..., None, None]
        out.append((S * q[:, :, i, :, None]).sum(-2))
    return torch.stack(out, 2), S


def _inputs(seed, b=2, h=2, L=7, dk=4, dv=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, L, dk, generator=g)
    k = F.normalize(torch.randn(b, h, L, dk, generator=g), dim=-1)
    v = torch.randn(b, h, L, dv, generator=g)
    beta = torch.rand(b, h, L, generator=g)
    return q, k, v, beta, F.logsigmoid(torch.randn(b, h, L, generator=g))


def _init_state_form(S, q, k, v, beta):
    out = []
    for i in range(q.shape[2]):
        kv = (S * k[:, :, i, :, None]).sum(-2)
        S = S + k[:, :, i, :, None] * ((v[:, :, i] - kv) * beta[:, :, i, None])[:, :, None, :]
        out.append((S * q[:, :, i, :, None]).sum(-2))
    return torch.stack(out, 2), S


CASES = [(_delta, 4), (_gated_delta, 5), (_delta_per_channel_decay, 5), (_delta_transposed, 4),
         (_delta_einsum, 4), (_delta_matmul, 4)]


@pytest.mark.parametrize("rest", ["eager", "inductor"])
@pytest.mark.parametrize("fn,n", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_delta_rules_are_linear_recurrences(fn, n, rest):
    """With Inductor as the rest of the graph too: it checks the region's outputs have the
    strides the op's fake kernel promised (contiguous), which the executor's state layout (dk
    moved last) must not change."""
    ins = _inputs(90)[:n]
    out, rep = ssmc_run(fn, ins, rest=rest)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    info = rep.regions[0]
    assert info.ir.mix is not None and info.strategy == "rank_one", str(rep)
    want_axis = "i3" if fn is _delta_transposed else "i2"          # dk: the transition's rows and columns
    assert info.ir.mix_axis == want_axis and f"transition along {want_axis}" in str(info.ir), str(info.ir)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(fn, ins)


def test_a_longer_sequence_over_several_time_chunks():
    """Chunks of 3 steps: the state and the adjoint carried from chunk to chunk."""
    ins = _inputs(91, L=11)[:4]
    out, rep = ssmc_run(_delta, ins, chunk=3)
    assert len(rep.regions) == 1, str(rep)
    for o, r in zip(out, reference(_delta, ins)):
        assert rel_err(o, r) < 1e-6
    xs = [x.clone().requires_grad_() for x in ins]
    got = torch.autograd.grad(ssmc_run(_delta, xs, chunk=3)[0][0].sum(), xs)
    x64 = [x.double().requires_grad_() for x in ins]
    want = torch.autograd.grad(_delta(*x64)[0].sum(), x64)
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(got, want))


def test_an_initial_state_passed_in():
    """The initial state is laid out (b, h, dk, dv); the executor runs the region with dk moved
    last, and the gradient of the initial state comes back in the caller's layout."""
    fn = _init_state_form
    q, k, v, beta, _ = _inputs(92, dk=3, dv=5)
    S0 = torch.randn(2, 2, 3, 5, generator=torch.Generator().manual_seed(93))
    ins = (S0, q, k, v, beta)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and rep.regions[0].ir.mix_axis == "i2", str(rep)
    for o, r in zip(out, reference(fn, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(fn, ins)


@pytest.fixture
def interp(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))


def _on_triton(fn, ins):
    """Values and gradients through the Triton target against float64 eager; the kernel that ran."""
    from ssmc.runtime.op import lookup
    from ssmc.targets.triton_rank_one import RankOneKernel
    xs = [x.clone().requires_grad_() for x in ins]
    out, rep = ssmc_run(fn, xs, target="triton")
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "rank_one", str(rep)
    entry = lookup(rep.regions[0].key)
    assert entry.target == "triton" and entry.failure is None, entry.failure
    kern = entry.kernel
    assert isinstance(kern, RankOneKernel) and kern.fallback is None, kern.fallback
    x64 = [x.double().requires_grad_() for x in ins]
    ref = as_tuple(fn(*x64))
    for o, r in zip(as_tuple(out), ref):
        assert rel_err(o, r) < 1e-6
    import ssmc.targets.mix_adjoint as MA
    flips, real = [], MA._flipped
    with mock.patch.object(MA, "_flipped", lambda *a: flips.append(a[1].name) or real(*a)):
        got = torch.autograd.grad(sum(o.sum() for o in as_tuple(out)), xs)
    want = torch.autograd.grad(sum(r.sum() for r in ref), x64)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-5, f"input {i}: {rel_err(a, b):.3g}"
    assert not flips, f"the backward flipped copies for {flips}: the kernel walks time backwards itself"
    assert not kern.scans.declined and kern.scans.kernels, kern.backward_note()
    assert all(isinstance(k, RankOneKernel) and k.fallback is None for k in kern.scans.kernels.values())
    return kern


@pytest.mark.parametrize("fn,n", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_triton_rank_one_kernel(fn, n, interp):
    """The generated kernel (TRITON_INTERPRET=1) runs every delta-rule form, forward and the
    backward's scans; dk = 6 and dv = 5 are padded to 8 lanes and cut by the masks."""
    kern = _on_triton(fn, _inputs(97, L=6, dk=6, dv=5)[:n])
    assert "r1s0 = tl.expand_dims(_sum(tl.where(mn," in kern.source and "rank-one transition" in kern.plan_text()


def test_the_triton_kernel_reads_the_initial_state_in_the_callers_layout(interp):
    """S0 is (b, h, dk, dv); the kernel holds dk last and reads S0 through a permuted view."""
    q, k, v, beta, _ = _inputs(98, dk=3, dv=5)
    S0 = torch.randn(2, 2, 3, 5, generator=torch.Generator().manual_seed(99))
    kern = _on_triton(_init_state_form, (S0, q, k, v, beta))
    assert kern.perm == (0, 1, 3, 2) and "moved last" in kern.plan_text()


@pytest.mark.parametrize("b,h,dk", [(1, 2, 4), (2, 1, 4), (1, 1, 3)])
def test_the_triton_kernel_at_sizes_of_one(b, h, dk, interp):
    """Batch 1, one head, both: Dynamo specialises sizes of 1 and labels no state axis with
    them; the outputs still index every axis they vary along, and the kernel runs them."""
    _on_triton(_gated_delta, _inputs(96, b=b, h=h, dk=dk))


@pytest.mark.parametrize("fn", [_gated_delta, _delta_product], ids=lambda f: f.__name__)
@pytest.mark.parametrize("cc", [80, 90])
def test_the_rank_one_kernel_compiles_for_gpu(cc, fn, tmp_path):
    import triton
    from test_triton import ast_source
    from triton.backends.compiler import GPUTarget
    from ssmc.targets import triton as T
    _, rep = ssmc_run(fn, (_product_inputs(100, 4) if fn is _delta_product else _inputs(100))[:5])
    region = rep.regions[0].ir
    kern = T.TritonTarget().compile(region, "rank_one", ssmc.make_options(cache_dir=str(tmp_path)))
    for cfg in kern.table()[f"sm_{cc}"]:
        fn, sig, cx = kern.signature(cfg, 128, {i: torch.bfloat16 for i in (1, 3, 5)})
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"]})
        assert f".target sm_{cc}" in ck.asm["ptx"]


def _product_inputs(seed, L, **kw):
    """q and g L steps long, k, v and beta 2L (two updates a step)."""
    q, k, v, beta, g = _inputs(seed, L=2 * L, **kw)
    return q[:, :, :L].contiguous(), k, v, beta, g[:, :, :L].contiguous()


def test_two_updates_a_step_read_every_second_index(interp):
    """DeltaProduct's form: the loop is re-rolled with k, v, beta read at 2t and 2t + 1 (strided
    views) beside q and g at t, the transition proven linear through the second update's k^T S
    of the first update's result (a sum of two products u w^T, no matrix formed), and the
    Triton kernel runs both terms, forward and backward."""
    ins = _product_inputs(101, L=4, dk=6, dv=5)
    out, rep = ssmc_run(_delta_product, ins)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    info = rep.regions[0]
    assert info.strategy == "rank_one" and "sum of 2 products" in info.strategy_reason, str(rep)
    assert any("one index in every 2" in n for n in info.notes), info.notes
    from ssmc import ir
    assert "i3" not in ir.axes_of(info.ir.mix.expr, info.ir.axes)     # composed weights free of dv
    for o, r in zip(as_tuple(out), reference(_delta_product, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(_delta_product, ins)
    kern = _on_triton(_delta_product, ins)
    assert kern.source.count("r1s1 = tl.expand_dims") >= 1 and "a sum of 2 products" in kern.plan_text()


def _matrix_then_sum(x, W, k):                   # a matrix update, then a rank-1 update reading its result
    h = x.new_zeros(x.shape[0], W.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = h @ W + x[:, t]
        h = h - 0.1 * (h * k[:, t]).sum(-1, keepdim=True) * k[:, t]
        ys.append(h.sum(-1))
    return torch.stack(ys, 1)


def _kda(q, k, v, beta, g):                      # KDA: a log decay per key channel, before the read
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for i in range(q.shape[2]):
        S = S * g[:, :, i].exp()[..., None]
        err = v[:, :, i] - (S * k[:, :, i, :, None]).sum(-2)
        S = S + beta[:, :, i, None, None] * k[:, :, i, :, None] * err[:, :, None, :]
        out.append((S * q[:, :, i, :, None]).sum(-2))
    return torch.stack(out, 2), S


def test_a_decay_per_key_channel_takes_its_gradient_without_the_outer_product(monkeypatch):
    """KDA's transition is (I - beta k (k * exp g)^T) diag(exp g): g is a factor of the column
    side w_j = -beta k_j exp(g_j), and its adjoint's other factor k_i lies along the rows. Its
    gradient is (sum_i lam_i k_i) h_j w_j, no (dk x dk) outer product a step (the first version
    of that path formed one: 6x the eager loop's time at B2 T128 H4 K=V=64 on a CPU)."""
    from ssmc.targets import mix_adjoint

    def formed(*a, **k):
        raise AssertionError("the outer product lam_i h_j was formed")
    monkeypatch.setattr(mix_adjoint, "_outer_product_grads", formed)
    q, k, v, beta, _ = _inputs(93)
    g = F.logsigmoid(torch.randn(q.shape, generator=torch.Generator().manual_seed(94)))
    ins = (q, k, v, beta, g)
    out, rep = ssmc_run(_kda, ins)
    assert [r.strategy for r in rep.regions] == ["rank_one"], str(rep)
    for o, r in zip(as_tuple(out), reference(_kda, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(_kda, ins)


def test_autograd_through_the_executor_equals_the_adjoint(monkeypatch):
    """The executor steps rank-one regions in place in a buffer, which autograd cannot
    differentiate; under autograd (`grads_by_autograd`, the backward of inputs that cannot be
    cut along time) it builds each step anew instead. Both ways, float64, the same gradients."""
    from test_block_sparse import _region_and_inputs
    from ssmc.targets.reference import adjoint_run, grads_by_autograd, run
    r, xs = _region_and_inputs(_gated_delta, _inputs(95), monkeypatch)
    xs = [x.double() if x.is_floating_point() else x for x in xs]
    outs = run(r, xs)
    g = torch.Generator().manual_seed(96)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    want = grads_by_autograd(lambda ins: run(r, ins), xs, grads, needs)
    got = adjoint_run(r, xs, grads, needs)
    assert any(b is not None for b in want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (b is None or rel_err(a, b) < 1e-10)


def test_a_sum_over_a_matrix_updates_result():
    """The sum reads a matrix product's result (no product terms known): it folds into the
    matrix's column sums, and the step is one region, right in values and gradients."""
    g = torch.Generator().manual_seed(102)
    ins = (torch.randn(2, 6, 4, generator=g), 0.3 * torch.randn(4, 4, generator=g), torch.randn(2, 6, 4, generator=g))
    out, rep = ssmc_run(_matrix_then_sum, ins)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    for o, r in zip(as_tuple(out), as_tuple(reference(_matrix_then_sum, ins))):
        assert rel_err(o, r) < 1e-6
    grads_match(_matrix_then_sum, ins)


def _longhorn(q, k, v, beta):                    # the step size beta / (1 + beta k . k): a sum of inputs in u
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[2]):
        kt = k[:, :, t]
        eps = beta[:, :, t] / (1 + beta[:, :, t] * (kt * kt).sum(-1))
        S = S - eps[..., None, None] * kt[..., :, None] * ((S * kt[..., :, None]).sum(-2) - v[:, :, t])[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
    return torch.stack(out, 2)


def test_a_sum_of_inputs_in_the_step_size(interp):
    """Longhorn's beta / (1 + beta k . k) is a factor of u: strategy rank_one (u (w . S) on the
    executor); the Triton kernel declines the sum in the drive, with the reason."""
    ins = _inputs(101)[:4]
    out, rep = ssmc_run(_longhorn, ins, target="triton")
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "rank_one", str(rep)
    assert rep.regions[0].target == "torch" and "reduction" in rep.regions[0].target_reasons["triton"], str(rep)
    assert rel_err(out, reference(_longhorn, ins)[0]) < 1e-6
    grads_match(_longhorn, ins)


def _sum_over_two_dims(q, k, v, beta):
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    for i in range(q.shape[2]):
        S = S + k[:, :, i, :, None] * (v[:, :, i] - (S * k[:, :, i, :, None]).sum((-2, -1), keepdim=True)[..., 0])[:, :, None, :]
    return S


def _gate_from_the_state(q, k, v, beta):
    S = q.new_zeros(q.shape[0], q.shape[1], q.shape[3], v.shape[3])
    for i in range(q.shape[2]):
        kv = torch.tanh((S * k[:, :, i, :, None]).sum(-2))
        S = S + k[:, :, i, :, None] * (v[:, :, i] - kv)[:, :, None, :]
    return S


@pytest.mark.parametrize("fn,why", [(_sum_over_two_dims, "sums the state over 2 dims"),
                                    (_gate_from_the_state, "not linear")],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_what_is_not_a_rank_one_transition_runs_as_written(fn, why):
    ins = _inputs(95)[:4]
    out, rep = ssmc_run(fn, ins)
    assert not rep.regions and any(why in w for _, w in rep.fallbacks), str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("fn,n", CASES[:2] + [(_delta_product, 5)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_delta_rules_on_the_gpu(fn, n):
    """On CUDA inputs the Triton rank-one kernel runs it (the CUDA target has none); values and
    gradients against float64 on the CPU."""
    ins = (_product_inputs(96, 19, dk=16, dv=24) if fn is _delta_product else _inputs(96, L=37, dk=16, dv=24))[:n]
    xs = [x.cuda().requires_grad_() for x in ins]
    out, rep = ssmc_run(fn, xs)
    assert len(rep.regions) == 1 and rep.regions[0].target == "triton", str(rep)
    x64 = [x.double().requires_grad_() for x in ins]
    ref = fn(*x64)
    for o, r in zip(out, ref):
        assert rel_err(o.cpu(), r) < 1e-5
    got = torch.autograd.grad(sum(o.sum() for o in out), xs)
    want = torch.autograd.grad(sum(r.sum() for r in ref), x64)
    assert all(rel_err(p.cpu(), q) < 1e-4 for p, q in zip(got, want))


# -- random delta-rule programs (tests/delta_programs.py) ------------------------------------------

def _check_program(prog, seed, **options):
    fn = prog.fn()
    ins = prog.make(seed)
    xs = [x.clone().requires_grad_() for x in ins]
    out, rep = ssmc_run(fn, xs, **options)
    x64 = [x.double().requires_grad_() for x in ins]
    ref = as_tuple(fn(*x64))
    for o, r in zip(as_tuple(out), ref):
        assert rel_err(o, r) < 1e-6, prog.source
    if not prog.linear:
        assert not rep.regions and rep.fallbacks, prog.source + "\n" + str(rep)
        return rep
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "rank_one", prog.source + "\n" + str(rep)
    got = torch.autograd.grad(sum(o.sum() for o in as_tuple(out)), xs, allow_unused=True)
    want = torch.autograd.grad(sum(r.sum() for r in ref), x64, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), f"input {i}: gradient {a is None} / {b is None}\n{prog.source}"
        assert b is None or rel_err(a, b) < 1e-5, f"input {i}: {rel_err(a, b):.3g}\n{prog.source}"
    return rep


def _fuzz(**settings):
    from hypothesis import HealthCheck, given, settings as hsettings
    from hypothesis import strategies as st
    from delta_programs import delta_programs
    return lambda f: hsettings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                               **settings)(given(prog=delta_programs(), seed=st.integers(0, 2 ** 16))(f))


@_fuzz(max_examples=60)
def test_random_delta_rule_programs(prog, seed):
    """Linear ones: one rank_one region, values and gradients equal float64 eager; the others
    (k^T S through tanh): no region, the loop runs as written."""
    _check_program(prog, seed)


@_fuzz(max_examples=15)
def test_random_delta_rule_programs_on_the_triton_kernel(prog, seed):
    import os
    os.environ["TRITON_INTERPRET"] = "1"      # restored below (hypothesis re-runs the body: no fixture)
    try:
        rep = _check_program(prog, seed, target="triton")
        if prog.linear:
            assert rep.regions[0].target == "triton", str(rep)
    finally:
        del os.environ["TRITON_INTERPRET"]
