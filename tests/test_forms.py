"""Every capture form, every recurrence family: one region, equal to float64 eager."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import programs as P
import ssmc
from conftest import (TOL, as_tuple, compile_per_call, declined, grads_match, reference, rel_err, ssmc_run,
                      writes_states)


def check(fn, inputs, n_regions=1, tol=None, **options):
    out, report = ssmc_run(fn, inputs, **options)
    assert len(report.regions) == n_regions, str(report)
    out = as_tuple(out)
    ref = reference(fn, inputs)
    dt = inputs[0].dtype
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        err = rel_err(o, r)
        assert err <= (tol or TOL[dt]), f"rel err {err:.3g}\n{report}"
    return report


@pytest.mark.parametrize("form", ["stack", "cat", "setitem", "unbind", "final"])
def test_mamba1_forms(form):
    check(P.mamba1(form), P.mamba1_inputs(seed=hash(form) % 1000))


@pytest.mark.parametrize("readout", ["sum", "einsum", "matmul"])
def test_mamba1_readouts(readout):
    check(P.mamba1("stack", readout), P.mamba1_inputs(seed=3))


def test_mamba1_bdl_layout():
    rep = check(P.mamba1_bdl(), P.mamba1_inputs(layout="bdl", seed=4))
    assert "t]" in rep.regions[0].region        # time is the last index of the inputs


def test_mamba1_initial_state_and_final_state():
    x, dt, A, B, C, *_ = P.mamba1_inputs(seed=5)
    h0 = torch.randn(x.shape[0], x.shape[2], A.shape[1])
    check(P.mamba1_h0(), (x, dt.abs(), A, B, C, h0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba1_casts(dtype):
    check(P.mamba1_cast(), P.mamba1_inputs(dtype=dtype, seed=6))


def test_mamba1_precomputed_discretization_is_fused():
    rep = check(P.mamba1_precomputed(), P.mamba1_inputs(seed=7))
    text = rep.regions[0].region
    # dA and dBx (b, L, d, n) are pulled into the kernel: the region loads dt, A, B, x, not dA
    assert "exp(" in text and "softplus(" in text, text


def test_scan_hop():
    rep = check(P.mamba1_scan(), P.mamba1_inputs(seed=8))
    assert "scan" in rep.regions[0].loop


@pytest.mark.parametrize("form", ["stack", "final"])
@pytest.mark.parametrize("h0", [False, True])
def test_mamba2(form, h0):
    rep = check(P.mamba2(form), P.mamba2_inputs(seed=9, with_h0=h0))
    assert rep.regions[0].strategy in ("chunked_ssd", "chunked_scan")
    assert "shared" in rep.regions[0].region


def test_s4d_lti():
    rep = check(P.s4d(), P.s4d_inputs(seed=10))
    assert "decay: lti" in rep.regions[0].region


def test_gated_recurrence():
    check(P.gated(), P.gated_inputs(seed=11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba1_dtypes(dtype):
    check(P.mamba1("stack"), P.mamba1_inputs(dtype=dtype, seed=12))


@pytest.mark.parametrize("kind", ["tanh", "square", "gate_from_h"])
def test_not_associative_falls_back(kind):
    fn = P.nonlinear(kind)
    ins = P.nonlinear_inputs(seed=13)
    out, report = ssmc_run(fn, ins)
    assert not report.regions
    reasons = " ".join(r for _, r in report.fallbacks)
    assert "detect_recurrence" in reasons, reasons
    assert torch.equal(out, fn(*ins))        # runs unchanged


def _assoc_scan_graph(combine, products=None):
    """A graph as Dynamo captures torch.associative_scan(combine, (a, b), dim=0) (pointwise mode
    needs CUDA to trace, so the CPU test builds the same graph by hand). `products`: "dead" adds
    the unused movedim torch's frontend puts on the running product (output 0), "live" returns
    that product too."""
    import operator
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    root = torch.nn.Module()
    root.comb = fx.symbolic_trace(combine)
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    fn = g.get_attr("comb")
    n = g.call_function(torch.ops.higher_order.associative_scan, (fn, [a, b], []))
    outs = [g.call_function(operator.getitem, (n, 1))]
    if products:
        p0 = g.call_function(operator.getitem, (n, 0))
        prod = g.call_function(torch.movedim, (p0, 0, 0))
        outs += [prod] if products == "live" else []
    g.output(tuple(outs))
    gm = fx.GraphModule(root, g)
    xa, xb = torch.rand(7, 2, 3), torch.randn(7, 2, 3)
    a.meta["example_value"], b.meta["example_value"] = mode.from_tensor(xa), mode.from_tensor(xb)
    if products:                # as Dynamo gives every node: the products' example values
        p0.meta["example_value"] = prod.meta["example_value"] = mode.from_tensor(xa)
    return gm, (xa, xb)


def test_associative_scan_hop():
    import ssmc
    gm, (xa, xb) = _assoc_scan_graph(lambda a1, b1, a2, b2: (a1 * a2, a2 * b1 + b2))
    rep = ssmc.Report()
    fn = ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert len(rep.regions) == 1 and "associative_scan" in rep.regions[0].loop
    (y,) = fn(xa, xb)
    h, ref = torch.zeros(2, 3), []
    for t in range(7):
        h = xa[t] * h + xb[t]
        ref.append(h)
    assert torch.allclose(y, torch.stack(ref), atol=1e-6)


def test_associative_scan_with_an_unused_running_product():
    """torch's frontend moves the scan dim back on every output (HF transformers' Mamba unpacks
    `_, states = associative_scan(...)`): the dead movedim of the products goes with the scan, a
    live use of them declines."""
    import ssmc
    pair = lambda a1, b1, a2, b2: (a1 * a2, a2 * b1 + b2)   # noqa: E731
    gm, (xa, xb) = _assoc_scan_graph(pair, products="dead")
    rep = ssmc.Report()
    fn = ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert len(rep.regions) == 1, str(rep)
    assert not any(n.target is torch.movedim for n in gm.graph.nodes)
    (y,) = fn(xa, xb)
    assert torch.allclose(y, _assoc_scan_graph(pair)[0](xa, xb)[0], atol=1e-6)
    gm, _ = _assoc_scan_graph(pair, products="live")
    rep = ssmc.Report()
    y, prod = ssmc.ssmc_backend(gm, [xa, xb], _report=rep)(xa, xb)
    assert not rep.regions and any("running product" in why for _, why in rep.fallbacks)
    assert torch.allclose(prod, torch.cumprod(xa, 0), atol=1e-6)


@pytest.mark.parametrize("combine, order", [
    (lambda a1, b1, a2, b2: (a2 * a1, torch.addcmul(b2, a2, b1)), "ab"),
    (lambda a1, b1, a2, b2: (torch.mul(a1, a2), b2.add(b1.mul(a2))), "ab"),
    (lambda b1, a1, b2, a2: (torch.addcmul(b2, b1, a2), a1 * a2), "ba"),
], ids=["addcmul", "methods", "inputs_first"])
def test_associative_scan_hop_combine_in_other_spellings(combine, order):
    """The combine is recognised by what it computes (run in float64 on random operands), not by
    its ops: addcmul, methods, and the pair given as (b, a)."""
    import ssmc
    gm, (xa, xb) = _assoc_scan_graph(combine)
    if order == "ba":          # the scan reads (b, a): swap the placeholders' roles, state is output 0
        out = next(n for n in gm.graph.nodes if n.op == "output")
        gi = out.args[0][0]
        gi.args = (gi.args[0], 0)
        xa, xb = xb, xa.abs() + 0.1
    rep = ssmc.Report()
    fn = ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert len(rep.regions) == 1, str(rep)
    (y,) = fn(xa, xb)
    a, b = (xa, xb) if order == "ab" else (xb, xa)
    h, ref = torch.zeros(2, 3, dtype=torch.float64), []
    for t in range(7):
        h = a[t].double() * h + b[t].double()
        ref.append(h)
    assert torch.allclose(y.double(), torch.stack(ref), atol=1e-6)


def test_associative_scan_other_combine_is_left_alone():
    import ssmc
    gm, (xa, xb) = _assoc_scan_graph(lambda a1, b1, a2, b2: (a1 + a2, b1 + b2))
    rep = ssmc.Report()
    ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert not rep.regions
    assert any("not (a1*a2, a2*b1 + b2)" in why for _, why in rep.fallbacks)


def test_peeled_first_step_and_initial_value_in_the_stack():
    """The output buffer made in the first step, the initial state stacked before the steps:
    the irregular first step stays as written, the rest becomes the region."""
    def fn(x, a):
        h = x[:, 0] * 0
        hs = [h]
        out = None
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            if out is None:
                out = torch.empty(x.shape[0], x.shape[1], x.shape[2])
            out[:, t] = h * 2
            hs.append(h)
        return out, torch.stack(hs, 1)
    ins = (torch.randn(2, 7, 3), torch.rand(2, 7, 3))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1
    for o, r in zip(out, reference(fn, ins)):
        assert rel_err(o, r) < 1e-6


def test_setitem_into_a_buffer_passed_in():
    def fn(x, a, out):
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t] = h
        return out
    x, a = torch.randn(2, 6, 3), torch.rand(2, 6, 3)
    buf = torch.full((2, 6, 3), float("nan"))
    out, rep = ssmc_run(fn, (x, a, buf))
    assert len(rep.regions) == 1
    ref = fn(x.double(), a.double(), torch.empty(2, 6, 3, dtype=torch.float64))
    assert rel_err(buf, ref) < 1e-6 and out.data_ptr() == buf.data_ptr()


def _reversed_inputs(seed):
    x, dt, A, B, C, D, z, _ = P.mamba1_inputs(seed=seed)
    return (x, dt.abs(), A, B, C, D, z)


@pytest.mark.parametrize("form", ["list", "setitem", "append", "append_flip"])
def test_reverse_time_loop(form):
    """A loop from the last token to the first runs forward on flipped reads; its per-step
    results come back in the order the code collects them."""
    rep = check(P.reversed_loop(form), _reversed_inputs(seed=hash(form) % 100))
    assert "flip" in rep.regions[0].loop or form == "append", rep.regions[0].loop


def test_reverse_time_scan_hop():
    from torch._higher_order_ops.scan import scan

    def fn(x, a, C):
        def step(h, xt):
            h = a * h + xt[..., None]
            return h, (h * C).sum(-1)
        return scan(step, x.new_zeros(x.shape[1], x.shape[2], C.shape[-1]), x, reverse=True)
    g = torch.Generator().manual_seed(3)
    check(fn, (torch.randn(6, 2, 3, generator=g), torch.rand(3, 4, generator=g), torch.randn(4, generator=g)))


def test_scan_hop_output_read_before_the_update():
    """`scan`'s combine returning y computed from the carry it was given (the state before the
    update): that state is carried one step as a state of its own, and the region is taken."""
    from torch._higher_order_ops.scan import scan

    def fn(x, a, c, h0):
        def step(h, xs):
            xt, at, ct = xs
            return at * h + xt, (h * ct).sum(-1)
        hT, ys = scan(step, h0, (x, a, c))
        return ys, hT
    g = torch.Generator().manual_seed(5)
    ins = (torch.randn(6, 2, 3, generator=g), torch.rand(6, 2, 3, generator=g),
           torch.randn(6, 2, 3, generator=g), torch.randn(2, 3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    grads_match(fn, ins)


def test_reverse_loop_with_time_dependent_work_after_it():
    """Elementwise work on the stacked result that reads other per-step tensors is not pulled
    into a reverse loop's region (its steps run in the other order)."""
    def fn(x, a, w):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in reversed(range(x.shape[1])):
            h = a[:, t] * h + x[:, t]
            ys.append(h)
        return torch.stack(ys[::-1], 1) * w + 1
    g = torch.Generator().manual_seed(4)
    check(fn, (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g)))


@pytest.mark.parametrize("form", ["stack", "einsum_setitem"])
def test_output_read_before_the_update(form):
    """y_k = C h_k + D u_k before h_{k+1} = A h_k + B u_k: the loop is cut one step later, so
    each step's output reads its new state; the first output (from h0) and the last update are
    peeled."""
    rep = check(P.output_before_update(form), P.output_before_update_inputs(seed=len(form)))
    assert rep.regions[0].strategy == "chunked_scan"


def test_output_read_before_the_update_dense_matrix():
    """The control-textbook loop with a dense A: x_{k+1} = A x_k + B u_k, y_k = C x_k."""
    def fn(u, A, B, C):
        x = u.new_zeros(u.shape[0], A.shape[0])
        ys = []
        for k in range(u.shape[1]):
            ys.append(x @ C.T)
            x = x @ A.T + u[:, k] @ B.T
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(5)
    check(fn, (torch.randn(2, 7, 2, generator=g), 0.3 * torch.randn(4, 4, generator=g),
               torch.randn(4, 2, generator=g), torch.randn(3, 4, generator=g)))


def _new_plus_old(x, a, C):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        new = a * h + x[:, t]
        ys.append(new + h)
        h = new
    return torch.stack(ys, 1)


def _trapezoid_readout(x, a, C):
    """y_t = C . (h_t + h_(t-1)) / 2 over a (b, d, n) state."""
    h = x.new_zeros(x.shape[0], x.shape[2], C.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        hp = h
        h = a[..., None] * h + x[:, t, :, None]
        ys.append(((h + hp) * C).sum(-1) / 2)
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("fn", [_new_plus_old, _trapezoid_readout])
def test_output_reading_the_new_and_the_previous_state(fn):
    """The previous state is carried one more step as a state of its own (a copy made in the
    step), stacked with the state it copies: the output reads new values only."""
    g = torch.Generator().manual_seed(25)
    ins = (torch.randn(2, 6, 3, generator=g), torch.rand(3, generator=g), torch.randn(4, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks and "stacked" in " ".join(rep.regions[0].notes), str(rep)
    grads_match(fn, ins)


def _error_feedback(x, a, c):
    """y = c * h is returned and fed back: h = a * h + (x - y)."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        y = c[0] * h
        h = a * h + (x[:, t] - y)
        ys.append(y)
    return torch.stack(ys, 1)


def _feedback_gain(x, a, c):
    """u = -K x (a gain to 2 inputs) is returned and drives the update through B u."""
    K, B = c[:, :2] * 0.3, c[:, 1:3].T
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        u = -(h @ K)
        h = a * h + u @ B + x[:, t]
        ys.append(u)
    return torch.stack(ys, 1), h


def _innovation(x, a, c):
    """A filter's innovation e = x - H (A h), returned and fed back through the gain."""
    H, K = c[:2], 0.2 * c[:, :2]
    h = torch.zeros_like(x[:, 0, :])
    ys = []
    for t in range(x.shape[1]):
        hp = a * h
        e = x[:, t, :2] - hp @ H.T
        h = hp + e @ K.T
        ys.append(e)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_error_feedback, _feedback_gain, _innovation])
def test_result_from_the_previous_state_fed_into_the_update(fn):
    """A step's result computed from the state before its update that is also a term of the
    update (output feedback, a feedback gain, a filter's innovation): the loop is cut one step
    later and that value is made again from the carried state, not carried as a second state;
    one region, values and gradients equal to float64 eager."""
    g = torch.Generator().manual_seed(37)
    ins = (torch.randn(2, 8, 3, generator=g), torch.rand(3, generator=g), torch.randn(3, 3, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def _step_slot_write(x, a):
    """A step-made tensor written at one slot (``u[:, 1] = 2 x``), state-free: computed for all
    steps before the region."""
    h = x.new_zeros(x.shape[0], 3)
    ys = []
    for t in range(x.shape[1]):
        u = x.new_zeros(x.shape[0], 3)
        u[:, 1] = x[:, t] * 2.0
        h = a * h + u
        ys.append(h)
    return torch.stack(ys, 1)


def test_slot_write_gradients():
    """The slot write becomes a select_scatter, which runs under torch.func.vmap over the steps;
    vmap gives select_scatter a wrong gradient (torch 2.13), so the vmapped steps use the
    slice_scatter of a size-1 slice (`ssmc.lower._vmap_safe`). Values and gradients equal float64
    (the gradient of x was off by a relative 2.0 before)."""
    g = torch.Generator().manual_seed(41)
    ins = (torch.randn(2, 7, generator=g), torch.rand(3, generator=g))
    check(_step_slot_write, ins)
    grads_match(_step_slot_write, ins)


def _buffer_filled_by_an_inner_loop(q, k, v):
    """A chunk loop whose step fills a fresh (C, C) matrix column by column (``A[..., j] = ...``,
    an inner loop over the chunk), then reads it: the chunk-level state S is a recurrence."""
    b, N, C, d = q.shape
    S = q.new_zeros(b, d, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(N):
        A = q.new_zeros(b, C, C)
        for j in range(C):
            A[..., j] = (q[:, i] * k[:, i, j, None, :]).sum(-1)
        o[:, i] = A.tril() @ v[:, i] + q[:, i] @ S
        S = 0.9 * S + k[:, i].transpose(-1, -2) @ v[:, i]
    return o, S


def _buffer_viewed_in_the_step(q, k, v):
    """The same with a view of the buffer taken before it is written: runs as written."""
    b, N, C, d = q.shape
    S = q.new_zeros(b, d, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(N):
        A = q.new_zeros(b, C, C)
        first = A[..., 0]
        for j in range(C):
            A[..., j] = (q[:, i] * k[:, i, j, None, :]).sum(-1)
        o[:, i] = A.tril() @ v[:, i] + q[:, i] @ S + first[..., None]
        S = 0.9 * S + k[:, i].transpose(-1, -2) @ v[:, i]
    return o, S


def test_buffer_filled_in_the_step():
    """Writes into a tensor the step itself allocates (declined before: "writes into a tensor
    made inside the loop") are the step's out-of-place scatters: one region, values and
    gradients equal float64; with a view of the buffer taken, the loop runs as written."""
    g = torch.Generator().manual_seed(43)
    ins = (torch.randn(2, 5, 3, 4, generator=g), torch.randn(2, 5, 3, 4, generator=g), torch.randn(2, 5, 3, 2, generator=g))
    check(_buffer_filled_by_an_inner_loop, ins)
    grads_match(_buffer_filled_by_an_inner_loop, ins)
    out, rep = ssmc_run(_buffer_viewed_in_the_step, ins)
    assert not rep.regions, str(rep)
    for o, r in zip(as_tuple(out), reference(_buffer_viewed_in_the_step, ins)):
        assert rel_err(o, r) < 1e-6


def _recurrence_in_its_buffer(a, x):
    """The recurrence kept in its output buffer: y[:, t] = a[:, t] * y[:, t - 1] + x[:, t]."""
    y = torch.empty_like(x)
    y[:, 0] = x[:, 0]
    for t in range(1, x.shape[1]):
        y[:, t] = a[:, t] * y[:, t - 1] + x[:, t]
    return y


def _recurrence_in_its_buffer_ahead(a, x):
    """Written one slot ahead into a zeroed buffer (fla's chunked RWKV-6 reference does this)."""
    y = torch.zeros_like(x)
    for t in range(x.shape[1] - 1):
        y[:, t + 1] = y[:, t] * a[:, t] + x[:, t]
    return y


def _functional_twin(fn):
    def twin(a, x):
        ys = [x[:, 0]] if fn is _recurrence_in_its_buffer else [torch.zeros_like(x[:, 0])]
        for t in range(1, x.shape[1]):
            ys.append(a[:, t] * ys[-1] + x[:, t] if fn is _recurrence_in_its_buffer else ys[-1] * a[:, t - 1] + x[:, t - 1])
        return torch.stack(ys, 1)
    return twin


@pytest.mark.parametrize("fn", [_recurrence_in_its_buffer, _recurrence_in_its_buffer_ahead])
def test_recurrence_kept_in_its_output_buffer(fn):
    """A read of the slot the previous step wrote is that step's value (the writes stay): one
    region (it ran as written: no value passed from step to step but through the buffer), values equal to float64 eager and
    gradients to the same recurrence written with a list (eager's own backward of this form
    fails: the read views a slot that is written again)."""
    g = torch.Generator().manual_seed(49)
    ins = (torch.rand(2, 9, 3, generator=g), torch.randn(2, 9, 3, generator=g))
    check(fn, ins)
    xs = [x.clone().requires_grad_() for x in ins]
    got = torch.autograd.grad(ssmc_run(fn, xs)[0].sum(), xs)
    x64 = [x.double().requires_grad_() for x in ins]
    want = torch.autograd.grad(_functional_twin(fn)(*x64).sum(), x64)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


def _biquad_in_its_buffer(x, b, a):
    """An IIR biquad as signal-processing code writes it, the output buffer zeroed first."""
    y = torch.zeros_like(x)
    for n in range(2, x.shape[-1]):
        y[..., n] = b[0] * x[..., n] + b[1] * x[..., n - 1] + b[2] * x[..., n - 2] \
            - a[0] * y[..., n - 1] - a[1] * y[..., n - 2]
    return y


def _biquad_twin(x, b, a):
    ys = [torch.zeros_like(x[..., 0]), torch.zeros_like(x[..., 0])]
    for n in range(2, x.shape[-1]):
        ys.append(b[0] * x[..., n] + b[1] * x[..., n - 1] + b[2] * x[..., n - 2] - a[0] * ys[-1] - a[1] * ys[-2])
    return torch.stack(ys, -1)


def test_iir_filter_in_its_buffer():
    """Slots read one and two steps back (a second-order filter) and slots 0 and 1 never written
    (zeros): one region (two stacked states); values equal float64 eager, gradients equal the
    filter written with a list."""
    g = torch.Generator().manual_seed(53)
    ins = (torch.randn(2, 3, 14, generator=g), 0.5 * torch.randn(3, generator=g), torch.tensor([-0.5, 0.2]))
    check(_biquad_in_its_buffer, ins)
    xs = [x.clone().requires_grad_() for x in ins]
    got = torch.autograd.grad(ssmc_run(_biquad_in_its_buffer, xs)[0].sum(), xs)
    x64 = [x.double().requires_grad_() for x in ins]
    want = torch.autograd.grad(_biquad_twin(*x64).sum(), x64)
    for u, w in zip(got, want):
        assert rel_err(u, w) < 1e-5


def _changed_after_it_is_written(a, x):
    """The value written into the slot is changed in place afterwards: the buffer holds the
    copy made at the write."""
    y = torch.zeros_like(x)
    outs = []
    for t in range(1, x.shape[1]):
        v = a[:, t] * y[:, t - 1] + x[:, t]
        y[:, t] = v
        v.mul_(2.0)
        outs.append(v)
    return torch.stack(outs, 1), y


def _read_then_written_again(a, x):
    """A slot read, then written again, then the read used: the read (a view) sees the new value."""
    y = torch.zeros_like(x)
    outs = []
    for t in range(1, x.shape[1]):
        y[:, t] = x[:, t]
        prev = y[:, t]
        y[:, t] = a[:, t] * prev
        outs.append(prev * 2.0)
    return torch.stack(outs, 1), y


@pytest.mark.parametrize("fn", [_changed_after_it_is_written, _read_then_written_again])
def test_slot_reads_that_are_not_the_value_written(fn):
    """Where the value written is changed afterwards, or the read is used after its slot is
    written again, the read is left a read of the buffer: values equal eager."""
    g = torch.Generator().manual_seed(57)
    ins = (torch.rand(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g))
    out, rep = ssmc_run(fn, ins)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-6, str(rep)


def test_declined_reverse_loop_leaves_the_graph_as_captured():
    """The flipped reads made for a reverse loop go again when the loop is declined."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in reversed(range(x.shape[1])):
            h = torch.tanh(a[:, t] * h + x[:, t])
            ys.append(h)
        return torch.stack(ys, 1)
    declined(fn, (torch.randn(2, 6, 3), torch.rand(2, 6, 3)), "tanh", untouched=True)


def test_in_place_state_updates():
    """``h.mul_(dA).add_(dBx)`` on a state the loop allocates: rewritten as new values, one region."""
    def fn(dA, dBx, C):
        h = torch.zeros_like(dA[:, 0])
        ys = []
        for t in range(dA.shape[1]):
            h.mul_(dA[:, t]).add_(dBx[:, t])
            ys.append((h * C[:, t, None]).sum(-1))
        return torch.stack(ys, 1), h
    g = torch.Generator().manual_seed(6)
    ins = (torch.rand(2, 6, 3, 4, generator=g), torch.randn(2, 6, 3, 4, generator=g), torch.randn(2, 6, 4, generator=g))
    rep = check(fn, ins)
    assert any("in-place update" in line for line in rep.graphs[0].log), rep.graphs[0].log


@pytest.mark.parametrize("form", ["mul_then_iadd", "iadd_of_a_product", "exp_of_a_clone"])
def test_in_place_forms(form):
    """Mixed in-place spellings: each update's effect is followed (a discarded ``h.mul_(a)``
    result used to be dropped silently), or the loop runs as written."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            if form == "mul_then_iadd":
                h.mul_(a)
                h += x[:, t]
                ys.append(h * 1)
            elif form == "iadd_of_a_product":
                h = h * a
                h += x[:, t]
                ys.append(h)
            else:
                h = a * h + x[:, t]
                g = h.clone()
                g.exp_()
                ys.append(g + h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(14)
    check(fn, (torch.randn(2, 6, 3, generator=g), torch.rand(3, generator=g)))


def test_in_place_write_that_is_not_followed_declines():
    """A partial write of the state (``h[:, 0] = 0``) is not rewritten; the loop runs as written
    and equals eager."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h.mul_(a).add_(x[:, t])
            h[:, 0] = 0.0
            ys.append(h * 1)
        return torch.stack(ys, 1)
    ins = (torch.randn(2, 6, 3), torch.rand(3))
    out, rep = ssmc_run(fn, ins)
    assert not rep.regions and rep.fallbacks, str(rep)
    assert rel_err(out, fn(*ins)) < 1e-6


def test_in_place_updates_that_must_stay():
    """A state passed in is updated in place as written (the caller sees it); a state with a
    view taken of it is left alone; results equal eager."""
    def into_input(x, a, h):
        ys = []
        for t in range(x.shape[1]):
            h.mul_(a).add_(x[:, t])
            ys.append(h * 2)
        return torch.stack(ys, 1)

    def with_view(x, a):
        h = torch.zeros_like(x[:, 0])
        first = h[:, 0]                       # a view: sees every later update
        ys = []
        for t in range(x.shape[1]):
            h.mul_(a).add_(x[:, t])
            ys.append(first * 1)
        return torch.stack(ys, 1)
    x, a = torch.randn(2, 5, 3), torch.rand(3)
    h_ssmc, h_eager = torch.randn(2, 3), None
    h_eager = h_ssmc.clone()
    out, _ = ssmc_run(into_input, (x, a, h_ssmc))
    assert rel_err(out, into_input(x, a, h_eager)) < 1e-6 and rel_err(h_ssmc, h_eager) < 1e-6
    out, _ = ssmc_run(with_view, (x, a))
    assert rel_err(out, with_view(x, a)) < 1e-6


def test_reverse_loop_with_output_before_update():
    """Both rewrites at once: reversed indices, and the output read before the update."""
    def fn(x, A, B, C):
        h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
        ys = [None] * x.shape[1]
        for t in reversed(range(x.shape[1])):
            ys[t] = (h * C[:, t, None]).sum(-1)
            h = torch.exp(A) * h + B[:, t, None] * x[:, t, :, None]
        return torch.stack(ys, 1), h
    g = torch.Generator().manual_seed(8)
    check(fn, (torch.randn(2, 7, 3, generator=g), -torch.rand(3, 4, generator=g),
               torch.randn(2, 7, 4, generator=g), torch.randn(2, 7, 4, generator=g)))


@pytest.mark.parametrize("sink", ["setitem", "list"])
def test_reverse_loop_cut_later_recomputes_a_value_of_the_step(sink):
    """Reversed indices, the output read before the update, and a value of the step's input made
    before the output and used by the update: the loop cut one step later computes that value
    again from the step before (in a reverse loop, the index above). Was an internal error (the
    read taken one index below, past the start)."""
    def fn(x, k, a):
        h = torch.zeros_like(x[:, 0])
        out, ys = torch.zeros_like(x), []
        for t in range(x.shape[1] - 1, -1, -1):
            e = torch.exp(k[:, t])
            if sink == "setitem":
                out[:, t] = h * e
            else:
                ys.append((h * e).sum(-1))
            h = a * h + e * x[:, t]
        return (out if sink == "setitem" else torch.stack(ys, 1)), h
    g = torch.Generator().manual_seed(12)
    ins = (torch.randn(2, 6, 3, generator=g), 0.1 * torch.randn(2, 6, 3, generator=g), torch.rand(2, 3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("sink", ["stack", "setitem"])
def test_the_state_before_its_update_returned_as_is(sink, backward):
    """``ys.append(h)`` before ``h = ...``: the outputs are the initial state and the first L - 1
    new states (the last update feeds nothing). No start takes all L steps; the loop cut one
    step later takes L - 1, the last update peeled. Forward and over decreasing t."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        out, ys = torch.empty_like(x), []
        for t in (range(x.shape[1] - 1, -1, -1) if backward else range(x.shape[1])):
            if sink == "setitem":
                out[:, t] = h
            else:
                ys.append(h)
            h = torch.sigmoid(a[:, t]) * h + x[:, t]
        return out if sink == "setitem" else torch.stack(ys, 1)
    g = torch.Generator().manual_seed(13)
    check(fn, (torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g)))


def test_unit_slice_writes():
    """``out[:, t:t+1] = y[:, None]``: a write of one step that keeps its size-1 time dim."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        out = torch.zeros_like(x)
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t:t + 1] = (2 * h).unsqueeze(1)
        return out
    g = torch.Generator().manual_seed(10)
    check(fn, (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g)))


@pytest.mark.parametrize("start", ["empty", "none"])
def test_growing_cat(start):
    """``out = torch.cat([out, y[:, None]], 1)`` each step: a collected output, not a state."""
    def fn(x, a, C):
        h = torch.zeros(x.shape[0], x.shape[2], C.shape[-1], dtype=x.dtype)
        out = x[:, :0] if start == "empty" else None
        for t in range(x.shape[1]):
            h = a[:, t, :, None] * h + x[:, t, :, None]
            y = (h * C[:, t, None]).sum(-1)
            out = y[:, None] if out is None else torch.cat((out, y[:, None]), 1)
        return out, h
    g = torch.Generator().manual_seed(11)
    check(fn, (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g), torch.randn(2, 6, 4, generator=g)))


@pytest.mark.parametrize("L", [16, 18])
def test_loop_over_chunks(L):
    """Chunked linear attention written as a loop over ``x[:, i:i+C]`` (the last chunk partial
    when C does not divide L): the chunks are the steps, read from a (chunks, C) view; the
    output reads the state before the update."""
    C = 4

    def fn(q, k, v):
        S = q.new_zeros(q.shape[0], q.shape[2], v.shape[-1])
        mask = torch.ones(C, C, dtype=q.dtype).tril()
        outs = []
        for i in range(0, q.shape[1], C):
            qc, kc, vc = q[:, i:i + C], k[:, i:i + C], v[:, i:i + C]
            c = qc.shape[1]
            attn = (qc @ kc.transpose(1, 2)) * mask[:c, :c]
            outs.append(qc @ S + attn @ vc)
            S = S + kc.transpose(1, 2) @ vc
        return torch.cat(outs, 1), S
    g = torch.Generator().manual_seed(L)
    rep = check(fn, (torch.randn(2, L, 3, generator=g), torch.randn(2, L, 3, generator=g), torch.randn(2, L, 5, generator=g)))
    assert "unflatten" in rep.regions[0].loop


def _masked(x, a, m):
    """Padding: the state stays where the mask is off."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.where(m[:, t, None], a[:, t] * h + x[:, t], h)
        ys.append(h)
    return torch.stack(ys, 1)


def _reset(x, a, m):
    """Document boundaries: the state restarts from zero where the mask is on."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.where(m[:, t, None], torch.zeros_like(h), h)
        h = a[:, t] * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_masked, _reset])
def test_masked_and_reset_updates(fn):
    """torch.where on a state-free condition is linear in the state: where(m, a, 1) * h + ..."""
    g = torch.Generator().manual_seed(13)
    ins = (torch.randn(2, 7, 3, generator=g), torch.rand(2, 7, 3, generator=g), torch.rand(2, 7, generator=g) > 0.4)
    check(fn, ins)
    xs = [ins[0].clone().requires_grad_(), ins[1].clone().requires_grad_(), ins[2]]
    out, _ = ssmc_run(fn, xs)
    got = torch.autograd.grad(out.sum(), xs[:2])
    x64 = [ins[0].double().requires_grad_(), ins[1].double().requires_grad_(), ins[2]]
    want = torch.autograd.grad(fn(*x64).sum(), x64[:2])
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


def test_where_on_the_state_is_declined():
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = torch.where(h > 1, a * h, h) + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    declined(fn, (torch.randn(2, 6, 3), torch.rand(3)), "condition computed from the state")


def test_random_ops_in_the_step():
    """Dropout on a step's input draws a new mask every step (vmap with different randomness);
    a draw that depends on no per-step input is declined rather than repeated."""
    def drop(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + torch.nn.functional.dropout(x[:, t], 0.5, training=True)
            ys.append(h)
        return torch.stack(ys, 1)

    def pure_noise(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t] + torch.randn(x.shape[0], x.shape[2])
            ys.append(h)
        return torch.stack(ys, 1)
    torch.manual_seed(15)
    out, rep = ssmc_run(drop, (torch.ones(4, 50, 64), torch.zeros(64)))      # a = 0: y_t = dropout(1)
    assert len(rep.regions) == 1, str(rep)
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    assert 0.4 < (out == 0).float().mean().item() < 0.6                      # 12800 draws
    assert 0.3 < (out[:, 1:] != out[:, :-1]).float().mean().item() < 0.7     # a new mask each step
    ins = (torch.randn(2, 6, 3), torch.rand(3))
    out, rep = ssmc_run(pure_noise, ins)
    assert not rep.regions and any("draws random numbers" in w for _, w in rep.fallbacks), str(rep)
    assert out.shape == (2, 6, 3)


def test_equal_slices_that_are_no_loop_stay_quiet():
    """q, k, v cut from one tensor by equal slices look like chunk reads; with no loop behind
    them nothing is reported and the graph runs as written."""
    def fn(x, W):
        qkv = x @ W
        q, k, v = qkv[..., 0:4], qkv[..., 4:8], qkv[..., 8:12]
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    ins = (torch.randn(2, 5, 8), torch.randn(8, 12))
    out, rep = ssmc_run(fn, ins)
    assert not rep.regions and not rep.fallbacks, str(rep)
    assert rel_err(out, fn(*ins)) < 1e-6


def _token_shift(x, mix, a, sx0):
    """A value passed to the next step that is no state: the previous token (RWKV's token
    shift), from an initial value given."""
    h = torch.zeros_like(x[:, 0])
    prev = sx0
    ys = []
    for t in range(x.shape[1]):
        xt = x[:, t]
        h = a * h + mix * xt + (1 - mix) * prev
        prev = xt
        ys.append(h)
    return torch.stack(ys, 1), prev


def _passed_function(x, mix, a, sx0):
    """The passed value is computed from the step's input (starts at ones, not at sx0)."""
    h = torch.zeros_like(x[:, 0])
    p = torch.ones_like(h)
    ys = []
    for t in range(x.shape[1]):
        h = a * h + p * x[:, t]
        p = torch.sigmoid(mix * x[:, t])
        ys.append(h)
    return torch.stack(ys, 1)


def _shift_from_first_token(x, mix, a, sx0):
    """The loop starts at t = 1, the first token read before it."""
    h = torch.zeros_like(x[:, 0])
    prev = x[:, 0]
    ys = []
    for t in range(1, x.shape[1]):
        h = a * h + x[:, t] - mix * prev
        prev = x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def _rwkv6_recurrent(r, k, v, w, u, x, mix):
    """RWKV-6's recurrent form: a matrix state read before its update, decay and key from the
    token-shifted input."""
    b, L, d = k.shape
    s = k.new_zeros(b, d, d)
    prev = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(L):
        xx = x[:, t] + mix * (prev - x[:, t])
        prev = x[:, t]
        kt = k[:, t] * torch.sigmoid(xx)
        kv = kt[:, :, None] * v[:, t, None, :]
        ys.append(torch.einsum("bi,bij->bj", r[:, t], u[:, None] * kv + s))
        s = kv + torch.exp(-torch.exp(w[:, t]))[:, :, None] * s
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_token_shift, _passed_function, _shift_from_first_token])
def test_values_passed_to_the_next_step(fn):
    """A value a step passes to the next one without being a state becomes a read of the
    previous step's inputs (its initial value at the first step): one region, values and
    gradients equal to float64 eager."""
    g = torch.Generator().manual_seed(21)
    ins = (torch.randn(2, 7, 3, generator=g), torch.rand(3, generator=g), torch.rand(3, generator=g),
           torch.randn(2, 3, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def test_token_shift_with_output_before_the_update():
    """Both at once (RWKV-6): the loop is cut one step later and the previous token is read
    one step back."""
    g = torch.Generator().manual_seed(22)
    b, L, d = 2, 7, 3
    ins = (torch.randn(b, L, d, generator=g), 0.5 * torch.randn(b, L, d, generator=g), torch.randn(b, L, d, generator=g),
           torch.randn(b, L, d, generator=g), torch.randn(d, generator=g), torch.randn(b, L, d, generator=g),
           torch.rand(d, generator=g))
    rep = check(_rwkv6_recurrent, ins)
    assert not rep.fallbacks, str(rep)


def _lerp(x, z, W, v):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.lerp(h, x[:, t], z[:, t])
        ys.append(h.lerp(x[:, t], 0.25))
    return torch.stack(ys, 1)


def _addmm(x, z, W, v):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.addmm(x[:, t], h, 0.3 * W, beta=0.5, alpha=2.0)
        ys.append(torch.addmv(x[:, t, 0], h, v, alpha=0.5))         # a readout x + 0.5 h @ v
    return torch.stack(ys, 1)


def _baddbmm_addr(x, z, W, v):
    """A matrix state S = g*S + k v^T written with baddbmm and the readout with addr's
    per-row outer products."""
    b, L, d = x.shape
    S = x.new_zeros(b, d, d)
    ys = []
    for t in range(L):
        kv = x[:, t, :, None] * z[:, t, None, :]
        S = torch.baddbmm(kv, S, torch.diag_embed(z[:, t]), beta=1.0, alpha=0.9)
        ys.append(torch.addr(S[0] @ W, v, x[0, t]).sum(-1))
    return torch.stack(ys, 0)


def _einsum_products(x, z, W, v):
    """einsums that sum over nothing: the decay (elementwise), the input (an outer product with
    the operand's letters out of order) and a scale by a vector."""
    h = x.new_zeros(x.shape[0], 3, x.shape[2])
    ys = []
    for t in range(x.shape[1]):
        h = torch.einsum("bnd,bnd->bnd", z[:, t, None, :].expand_as(h), h) \
            + torch.einsum("db,n->bnd", x[:, t].T, v) + torch.einsum("bd,n,bd->bnd", x[:, t], v, z[:, t])
        ys.append(torch.einsum("bnd,nd->bd", h, W))
    return torch.stack(ys, 1)


def _linear(x, z, W, v):
    """F.linear on the state (with a bias, and without), and on the input."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = F.linear(h, 0.3 * W, v) + F.linear(x[:, t], W.T)
        ys.append(F.linear(h, W[:1]).squeeze(-1))
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_lerp, _addmm, _baddbmm_addr, _einsum_products, _linear])
def test_composite_ops_in_the_step(fn):
    """lerp, addmm, addmv, baddbmm, addr, linear and einsums that sum over nothing in a step are written as the plain ops they are
    (in the loop's body only): one region, values and gradients equal to float64 eager."""
    g = torch.Generator().manual_seed(23)
    ins = (torch.randn(2, 7, 3, generator=g), torch.rand(2, 7, 3, generator=g), torch.randn(3, 3, generator=g),
           torch.randn(3, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def _diag_outside(x, lam, W):
    """h @ diag(lam), the matrix made before the loop (the textbook LTI form), read out by W."""
    D = torch.diag(lam)
    h = x.new_zeros(x.shape[0], lam.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = h @ D + x[:, t]
        ys.append(h @ W)
    return torch.stack(ys, 1)


def _diag_left_column(x, lam, W):
    """A column state (n, b): diag(lam) @ h, and its transpose written D.T."""
    h = x.new_zeros(lam.shape[0], x.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.diag(torch.sigmoid(lam)).T @ h + x[:, t].T
        ys.append(h.T)
    return torch.stack(ys, 1)


def _diag_embed_per_step(x, lam, W):
    """A diagonal that changes every step, diag_embed of a gate, applied by bmm through a size-1 dim."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        a = torch.diag_embed(torch.sigmoid(x[:, t] + lam))
        h = torch.bmm(a, h.unsqueeze(-1)).squeeze(-1) + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def _eye_times_vector(x, lam, W):
    """torch.eye(n) * lam by einsum, and F.linear with a diagonal weight."""
    A = torch.eye(lam.shape[0], device=lam.device) * torch.sigmoid(lam)
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.einsum("ij,bj->bi", A, h) + F.linear(x[:, t], torch.diag(lam))
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_diag_outside, _diag_left_column, _diag_embed_per_step, _eye_times_vector])
def test_products_with_a_diagonal_matrix(fn):
    """A product of the state with a matrix built as a diagonal (torch.diag(v), diag_embed(v),
    eye(n) * v, transposed or not; by @, bmm, einsum or F.linear) is the elementwise product it
    is: an elementwise recurrence (no transition matrix), values and gradients equal to float64."""
    g = torch.Generator().manual_seed(29)
    ins = (torch.randn(2, 7, 3, generator=g), torch.randn(3, generator=g), torch.randn(3, 2, generator=g))
    rep = check(fn, ins)
    assert rep.regions[0].strategy == "chunked_scan" and "M_t" not in rep.regions[0].region, str(rep)
    assert any("diagonal matrix" in n for n in rep.regions[0].notes), str(rep)
    grads_match(fn, ins)


def _off_diagonal(x, lam, W):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = 0.5 * h + h @ torch.diag(lam[:-1], 1) + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def _diagonal_by_value(x, lam, W):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = h @ W + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_off_diagonal, _diagonal_by_value])
def test_matrices_that_are_not_built_as_diagonals_stay_matrices(fn):
    """A matrix off the main diagonal (torch.diag(v, 1)), or one that is diagonal only by its
    current values (a weight that training may fill in), stays a transition matrix."""
    g = torch.Generator().manual_seed(31)
    ins = (torch.randn(2, 7, 3, generator=g), torch.randn(3, generator=g), torch.diag(torch.randn(3, generator=g)))
    rep = check(fn, ins)
    assert rep.regions[0].strategy == "block_sparse", str(rep)
    assert not any("diagonal matrix" in n for n in rep.regions[0].notes), str(rep)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [_diag_outside, _diag_embed_per_step, _eye_times_vector, _error_feedback,
                                _feedback_gain, _innovation, _step_slot_write])
def test_diagonal_feedback_and_slot_forms_on_the_gpu(fn):
    """The diagonal matrices, the results fed back into the update and the slot write above on
    CUDA (target auto), L 301: a generated kernel runs (no torch reference), values and
    gradients against float64 eager on the CPU."""
    from ssmc.runtime.op import lookup
    g = torch.Generator().manual_seed(47)
    if fn in (_diag_outside, _diag_embed_per_step, _eye_times_vector):
        ins = (torch.randn(4, 301, 16, generator=g), torch.rand(16, generator=g), torch.randn(16, 2, generator=g))
    elif fn is _step_slot_write:
        ins = (torch.randn(4, 301, generator=g), torch.rand(3, generator=g))
    else:
        ins = (torch.randn(4, 301, 3, generator=g), torch.rand(3, generator=g), 0.5 * torch.randn(3, 3, generator=g))
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    info = rep.regions[0]
    assert info.target != "torch" and getattr(lookup(info.key).kernel, "fallback", None) is None, str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o.cpu(), r) < 1e-4, str(rep)
    grads_match(fn, tuple(x.cuda() for x in ins), tol=1e-4)


def test_composite_op_in_a_declined_loop_is_left_as_written():
    def fn(x, z):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = torch.tanh(torch.lerp(h, x[:, t], z[:, t]))
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(24)
    declined(fn, (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g)), "tanh", untouched=True)


def _iterate_tensor(x, a):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for xt in x.transpose(0, 1):                # Dynamo: transpose(...)[t], an int index
        h = a * h + xt
        ys.append(h)
    return torch.stack(ys, 1)


def _first_value_init(x, a):
    h = x[:, 0]                                 # the first step's value, read before the loop
    ys = [h]
    for t in range(1, x.shape[1]):
        h = a * h + (1 - a) * x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_iterate_tensor, _first_value_init])
def test_reads_spelled_otherwise(fn):
    g = torch.Generator().manual_seed(25)
    ins = (torch.randn(2, 7, 3, generator=g), torch.rand(3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    grads_match(fn, ins)


def _running_mean(x, a):
    m = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        m = m * (t / (t + 1)) + x[:, t] / (t + 1)
        ys.append(m)
    return torch.stack(ys, 1)


def _time_schedule_reversed(x, a):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1] - 1, -1, -1):
        h = torch.exp(-a * (0.1 * t)) * h + torch.mul(x[:, t], t)
        ys.append(h)
    return torch.stack(ys[::-1], 1)


@pytest.mark.parametrize("fn", [_running_mean, _time_schedule_reversed])
def test_numbers_that_change_step_to_step(fn):
    """Python numbers computed from t (``x[:, t] / (t + 1)``) differ from step to step: each
    becomes a table of the L values, read at t like any input."""
    g = torch.Generator().manual_seed(26)
    ins = (torch.randn(2, 7, 3, generator=g), torch.rand(3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    assert re.search(r"in\d+\[t\]", rep.regions[0].region), rep.regions[0].region      # the table
    assert any("read from a table" in n for n in rep.regions[0].notes), str(rep)
    grads_match(fn, ins)


def _every_other(x, a, z):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(0, x.shape[1], 2):
        h = a * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def _every_third_backwards(x, a, z):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1] - 2, 0, -3):
        h = a * h + x[:, t] * z[:, t - 1]
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_every_other, _every_third_backwards])
def test_loops_over_every_kth_index(fn):
    """``range(0, L, 2)``: the steps read strided views of the sources, at consecutive indices."""
    g = torch.Generator().manual_seed(27)
    ins = (torch.randn(2, 11, 3, generator=g), torch.rand(3, generator=g), torch.randn(2, 11, 3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    assert any("one index in every" in n for n in rep.regions[0].notes), str(rep)
    grads_match(fn, ins)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [_iterate_tensor, _first_value_init, _running_mean, _time_schedule_reversed,
                                _every_other, _every_third_backwards])
def test_capture_forms_on_the_gpu(fn):
    """The forms above on CUDA inputs (tables and strided views made on the inputs' device),
    against float64 eager on the CPU."""
    g = torch.Generator().manual_seed(28)
    ins = (torch.randn(4, 301, 16, generator=g), 0.9 * torch.rand(16, generator=g), torch.randn(4, 301, 16, generator=g))
    ins = ins[:2] if fn in (_iterate_tensor, _first_value_init, _running_mean, _time_schedule_reversed) else ins
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    assert rel_err(out.cpu(), reference(fn, ins)[0]) < 1e-4, str(rep)


@pytest.mark.parametrize("fn", [_running_mean, _time_schedule_reversed, _every_other, _every_third_backwards])
def test_tables_and_strides_on_the_triton_interpreter(fn, monkeypatch, tmp_path):
    """The generated Triton kernel (under the interpreter) reads the tables and strided views."""
    from ssmc.runtime.op import lookup
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(29)
    ins = (torch.randn(2, 11, 3, generator=g), torch.rand(3, generator=g), torch.randn(2, 11, 3, generator=g))
    ins = ins if fn in (_every_other, _every_third_backwards) else ins[:2]
    out, rep = ssmc_run(fn, ins, target="triton")
    assert [r.target for r in rep.regions] == ["triton"], str(rep)
    entry = lookup(rep.regions[0].key)
    assert entry.failure is None and getattr(entry.kernel, "fallback", None) is None, entry.failure
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5


def test_two_different_updates_per_iteration():
    """``for t in range(0, L, 2)`` with two different updates and one output per iteration: the
    chain of single steps does not repeat, the chain of pairs (stride 2) does."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(0, x.shape[1], 2):
            h = a * h + x[:, t]
            h = 0.5 * h - x[:, t + 1]
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(30)
    ins = (torch.randn(2, 10, 3, generator=g), torch.rand(3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    grads_match(fn, ins)


def test_declines_name_what_does_not_repeat():
    """A Python branch on t's parity (one output per step, two kinds of step) and a value from
    five steps back are declined, each with its own reason."""
    def parity(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t] if t % 2 == 0 else 0.5 * h - x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)

    def nine_back(x, a):
        hs = [torch.zeros_like(x[:, 0])] * 9
        ys = []
        for t in range(x.shape[1]):
            h = a * hs[0] + 0.1 * hs[8] + x[:, t]
            hs = [h] + hs[:-1]
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(31)
    ins = (torch.randn(2, 14, 3, generator=g), torch.rand(3, generator=g))
    declined(parity, ins, "the steps do not repeat the same operations")
    declined(nine_back, ins, "a step reads a value from 9 steps back")


def test_a_map_over_the_steps_runs_vmapped():
    """A loop whose steps pass nothing to the next one is no recurrence and gets no region: its
    step runs once, vmapped over the steps, instead of unrolled (the report says so). Collected
    by stack, by cat or as the last step's value; collected into a buffer, it runs as written and
    the reason says why (not "the loop carries 0 values")."""
    def stacked(x, w):
        ys = []
        for t in range(x.shape[1]):
            ys.append(torch.tanh(x[:, t] * w + 1.0))
        return torch.stack(ys, 1)

    def cat_and_last(x, w):
        ys = []
        for t in range(x.shape[1]):
            y = torch.sigmoid(x[:, t]) * w
            ys.append(y[:, None])
        return torch.cat(ys, 1), y

    def into_a_buffer(x, w):
        out = torch.empty_like(x)
        for t in range(x.shape[1]):
            out[:, t] = torch.tanh(x[:, t] * w + 1.0)
        return out
    g = torch.Generator().manual_seed(59)
    ins = (torch.randn(2, 6, 3, generator=g), torch.randn(3, generator=g))
    for fn in (stacked, cat_and_last):
        out, rep = ssmc_run(fn, ins)
        (graph,) = rep.graphs
        assert not rep.regions and not rep.fallbacks, str(rep)
        assert any("a map over the steps" in m and "vmapped over the 6 steps" in m for m in graph.log), str(rep)
        assert graph.nodes_out < graph.nodes_in / 2, str(rep)
        for o, r in zip(as_tuple(out), reference(fn, ins)):
            assert o.shape == r.shape and rel_err(o, r) < 1e-6
        grads_match(fn, ins)
    declined(into_a_buffer, ins, "no value passes from one step to the next")


def _five_back(x, a):
    h = h1 = h2 = h3 = h4 = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h, h1, h2, h3, h4 = a * h + 0.1 * h4 + x[:, t], h, h1, h2, h3
        ys.append(h)
    return torch.stack(ys, 1)


def _ar6_from_the_outputs(x, a):
    """An AR(6) filter reading its own earlier outputs from the list, the first steps with fewer
    terms (a Python branch on t)."""
    ys = []
    for t in range(x.shape[1]):
        y = x[:, t]
        for k in range(1, 7):
            if t - k >= 0:
                y = y + 0.3 * a[k - 1] * ys[t - k]
        ys.append(y)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_five_back, _ar6_from_the_outputs])
def test_values_from_up_to_eight_steps_back(fn):
    """Values from five and six steps back (once declined at four): carried as delayed copies,
    stacked into one state with a companion transition; values and gradients equal to float64.
    The AR filter's first steps (fewer terms) run as written: a note, not a fallback."""
    g = torch.Generator().manual_seed(33)
    ins = (torch.randn(2, 16, 3, generator=g), torch.rand(6, generator=g) if fn is _ar6_from_the_outputs
           else torch.rand(3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    if fn is _ar6_from_the_outputs:
        assert any("steps around a loop" in line for g_ in rep.graphs for line in g_.log), str(rep)
    grads_match(fn, ins)


def _copy_into_index(x, a):
    h = torch.zeros_like(x[:, 0])
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        h = a * h + x[:, t]
        out[:, t].copy_(h)
    return out


def _copy_into_narrow(x, a):
    h = torch.zeros_like(x[:, 0])
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        h = a * h + x[:, t]
        out.narrow(1, t, 1).copy_(h.unsqueeze(1))
    return out


@pytest.mark.parametrize("fn", [_copy_into_index, _copy_into_narrow])
def test_copies_into_a_step_of_a_buffer(fn):
    """``out[:, t].copy_(y)`` and ``out.narrow(1, t, 1).copy_(...)`` are the writes
    ``out[:, t] = y``: one region, values and gradients equal to float64 eager."""
    g = torch.Generator().manual_seed(32)
    ins = (torch.randn(2, 9, 3, generator=g), torch.rand(3, generator=g))
    rep = check(fn, ins)
    assert not rep.fallbacks, str(rep)
    grads_match(fn, ins)


def _pair(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


def _generic_scans():
    from torch._higher_order_ops.associative_scan import associative_scan

    def states(a, b):
        return associative_scan(_pair, (a, b), dim=1, combine_mode="generic")[1] * 2

    def reversed_(a, b):
        return associative_scan(_pair, (a, b), dim=0, reverse=True, combine_mode="generic")[1]

    def swapped(a, b):      # inputs first, and the product written the other way round
        def comb(left, right):
            return right[0] + left[0] * right[1], right[1] * left[1]
        return associative_scan(comb, (b, a), dim=1, combine_mode="generic")[0]

    def with_products(a, b):
        prods, hs = associative_scan(_pair, (a, b), dim=1, combine_mode="generic")
        return hs, prods

    def addcmul(a, b):
        def comb(left, right):
            return left[0] * right[0], torch.addcmul(right[1], right[0], left[1])
        return associative_scan(comb, (a, b), dim=1, combine_mode="generic")[1]
    return [states, reversed_, swapped, with_products, addcmul]


@pytest.mark.parametrize("L", [2, 5, 8, 11])
@pytest.mark.parametrize("fn", _generic_scans(), ids=lambda f: f.__name__)
def test_generic_associative_scan_inlined_by_dynamo(fn, L):
    """combine_mode="generic" (HF transformers' Mamba off the GPU) has no scan node: Dynamo
    inlines torch's odd-even tree, and the recurrence is proved from it."""
    g = torch.Generator().manual_seed(L)
    ins = (torch.rand(3, L, 4, generator=g), torch.randn(3, L, 4, generator=g))
    if fn.__name__ == "reversed_":
        ins = tuple(x.transpose(0, 1).contiguous() for x in ins)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and "generic" in rep.regions[0].loop, str(rep)
    if fn.__name__ != "with_products":      # the tree goes, its unused products too
        assert 2 * rep.graphs[0].nodes_out < rep.graphs[0].nodes_in, str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(fn, ins)


def test_generic_associative_scan_of_another_combine_runs_as_written():
    from torch._higher_order_ops.associative_scan import associative_scan

    def fn(a, b):
        return associative_scan(lambda l, r: (l[0] * r[0], torch.maximum(r[0] * l[1], r[1])),
                                (a, b), dim=1, combine_mode="generic")[1]
    ins = (torch.rand(2, 9, 3), torch.randn(2, 9, 3))
    out, rep = ssmc_run(fn, ins)
    assert not rep.regions
    assert rel_err(out, reference(fn, ins)[0]) < 1e-6


def test_generic_associative_scan_over_a_symbolic_length_says_why():
    """A second length makes Dynamo recompile with the length symbolic: the odd-even tree runs
    as captured, the reason in the report, the values right."""
    import ssmc.backend
    from torch._higher_order_ops.associative_scan import associative_scan
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: associative_scan(_pair, (a, b), dim=1, combine_mode="generic")[1],
                      backend="ssmc")
    for L, regions in ((9, 1), (13, 0)):
        a, b = torch.rand(2, L, 3), torch.randn(2, L, 3)
        out = f(a, b)
        rep = ssmc.backend.LAST_REPORT
        assert len(rep.regions) == regions, str(rep)
        assert regions or any("its length is symbolic" in why for _, why in rep.fallbacks), str(rep)
        h, ref = torch.zeros(2, 3, dtype=torch.float64), []
        for t in range(L):
            h = a[:, t].double() * h + b[:, t].double()
            ref.append(h)
        assert rel_err(out, torch.stack(ref, 1)) < 1e-6


def test_inlined_scan_search_that_fails_leaves_the_other_loops(monkeypatch):
    import ssmc.passes.reroll as reroll_mod

    def boom(graph):
        raise RuntimeError("boom")
    monkeypatch.setattr(reroll_mod, "find_inlined_scans", boom)
    fn, ins = P.mamba1("stack"), P.mamba1_inputs(seed=71)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and any("search failed: RuntimeError: boom" in why for _, why in rep.fallbacks)
    assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


def _mixer_scan(mode):
    """A Mamba-1 mixer written around torch's associative_scan (the way HF transformers' Mamba
    does when compiled: pointwise mode on CUDA, generic elsewhere): discretise over the whole
    sequence, scan along dim 2, unpack `_, states`, read out with a batched matmul, return the
    last state too."""
    from torch._higher_order_ops.associative_scan import associative_scan

    def comb(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]

    def fn(x, dt, A, B, C):             # x, dt (b, d, L); A (d, n); B, C (b, n, L)
        dA = torch.exp(A[None, :, None, :] * dt[..., None])
        dBx = dt[..., None] * B.transpose(1, 2)[:, None] * x[..., None]
        _, states = associative_scan(comb, (dA, dBx), dim=2, combine_mode=mode)
        y = torch.matmul(states.transpose(1, 2), C.transpose(1, 2).unsqueeze(-1)).squeeze(-1)
        return y.transpose(1, 2), states[:, :, -1]
    return fn


def _covariance_weighted(k, a, w):
    """The same with a loop invariant read along both axes too: (k k^T) * (w w^T)."""
    h = torch.zeros(k.shape[0], w.shape[0], w.shape[0])
    ys = []
    for t in range(k.shape[1]):
        h = a[:, t, None, None] * h + k[:, t, :, None] * k[:, t, None, :] * (w[:, None] * w[None, :])
        ys.append(h.sum(-1))
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [P.covariance, _covariance_weighted], ids=lambda f: f.__name__)
def test_one_input_read_along_two_state_axes(fn):
    """An outer product of a vector with itself once merged the two state axes it spans ("state
    axes i1 and i2 are mixed"): now each view of the input is a load with its own index."""
    g = torch.Generator().manual_seed(35)
    third = torch.randn(2, 9, 4, generator=g) if fn is P.covariance else torch.randn(4, generator=g)
    ins = (torch.randn(2, 9, 4, generator=g), torch.rand(2, 9, generator=g), third)
    rep = check(fn, ins)
    assert not rep.fallbacks and "in1[i0, t, i1] * in1[i0, t, i2]" in str(rep.regions[0].ir), str(rep)
    grads_match(fn, ins)


def test_a_batch_of_one():
    """Dynamo specialises a batch of 1 and no state axis is labelled with a size-1 dim: the
    mixer around the generic scan (HF transformers' Mamba off the GPU) reads the batch's size
    from no input, and per-step outputs do not index it. Both are still one region, values and
    gradients equal to float64 eager."""
    g = torch.Generator().manual_seed(33)
    b, d, n, L = 1, 6, 4, 9
    ins = (torch.randn(b, d, L, generator=g), torch.rand(b, d, L, generator=g) * 0.2,
           -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, n, L, generator=g), torch.randn(b, n, L, generator=g))
    for fn, xs in ((_mixer_scan("generic"), ins), (P.mamba1("stack"), P.mamba1_inputs(b=1, seed=34))):
        out, rep = ssmc_run(fn, xs)
        assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
        assert all("i0" in o.index for o in rep.regions[0].ir.outputs), str(rep.regions[0].ir)
        for o, r in zip(as_tuple(out), reference(fn, xs)):
            assert rel_err(o, r) < 1e-6
        grads_match(fn, xs)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pointwise", "generic"])
def test_mixer_written_with_associative_scan_on_the_gpu(mode):
    """The scan HOP as CUDA code reaches the backend (pointwise: a scan node whose products only
    a dead movedim reads; generic: the odd-even tree inlined): one region, values and gradients
    against float64 eager."""
    fn = _mixer_scan(mode)
    g = torch.Generator().manual_seed(31)
    b, d, n, L = 2, 24, 8, 67
    ins = (torch.randn(b, d, L, generator=g), torch.rand(b, d, L, generator=g) * 0.2,
           -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, n, L, generator=g), torch.randn(b, n, L, generator=g))
    xs = [x.cuda().requires_grad_() for x in ins]
    out, rep = ssmc_run(fn, xs)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    assert not writes_states(rep.regions[0].ir), str(rep)      # the matmul readout runs in the region
    x64 = [x.double().requires_grad_() for x in ins]
    ref = _mixer_scan("generic")(*x64)          # pointwise mode runs on CUDA only
    for o, r in zip(out, ref):
        assert rel_err(o.cpu(), r) < 1e-5, str(rep)
    got = torch.autograd.grad(sum(o.sum() for o in out), xs)
    want = torch.autograd.grad(sum(r.sum() for r in ref), x64)
    for i, (p, q) in enumerate(zip(got, want)):
        assert rel_err(p.cpu(), q) < 1e-4, f"input {i}"


class _LinearRNN(torch.nn.Module):
    """A linear RNN written with nn.Linear modules: ``h = A(h) + B(x_t)``, readout ``C(h)``."""
    def __init__(self, d):
        super().__init__()
        self.A, self.B, self.C = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, 2)
        with torch.no_grad():
            self.A.weight.mul_(0.3)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], x.shape[2])
        ys = []
        for x_t in x.unbind(1):
            h = self.A(h) + self.B(x_t)
            ys.append(self.C(h))
        return torch.stack(ys, 1)


def test_linear_module_on_the_state():
    """nn.Linear on the state: one non-diagonal region; values and the modules' gradients
    against float64."""
    RNN = _LinearRNN
    torch.manual_seed(25)
    m, x = RNN(4), torch.randn(2, 7, 4)
    out, rep = ssmc_run(m, (x,))
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "block_sparse" and not rep.fallbacks, str(rep)
    m64 = copy.deepcopy(m).double()
    assert rel_err(out, m64(x.double())) < 1e-5
    out = ssmc_run(m, (x.clone().requires_grad_(),))[0]
    got = torch.autograd.grad(out.sum(), list(m.parameters()))
    want = torch.autograd.grad(m64(x.double()).sum(), list(m64.parameters()))
    for (name, _), a, b in zip(m.named_parameters(), got, want):
        assert rel_err(a, b) < 1e-5, f"{name}: {rel_err(a, b):.3g}"


@pytest.mark.gpu
def test_linear_module_on_the_state_on_the_gpu():
    """The same module on CUDA (target auto), 16 channels, L 300, against float64 on the CPU."""
    torch.manual_seed(26)
    m, x = _LinearRNN(16), torch.randn(2, 300, 16)
    with torch.no_grad():
        m.A.weight.mul_(0.5)
    out, rep = ssmc_run(copy.deepcopy(m).cuda(), (x.cuda(),))
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "block_sparse" and not rep.fallbacks, str(rep)
    assert rel_err(out.cpu(), copy.deepcopy(m).double()(x.double())) < 1e-4, str(rep)


def _invariants_from_one_tensor(x, p):
    a, b = p[0], p[1]                   # two rows of one parameter, read before the loop
    c = p[2, 0]
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = a * h + b * x[:, t]
        ys.append(c * h)
    return torch.stack(ys, 1)


def _invariants_unpacked(x, p):
    a, b, c = p.unbind(0)               # the same, unpacked
    h1, h2 = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
    ys = []
    for x_t in x.unbind(1):
        h1, h2 = a * h1 + 0.2 * h2 + x_t, b * h2 + c * h1
        ys.append(h2)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_invariants_from_one_tensor, _invariants_unpacked])
def test_invariants_read_from_one_tensor_before_the_loop(fn):
    """Reads of one tensor at a few indices before the loop, used alike by every step, are
    loop invariants, not a second loop's time reads that keep the real loop from re-rolling."""
    g = torch.Generator().manual_seed(27)
    ins = (torch.randn(2, 7, 3, generator=g), 0.3 + 0.5 * torch.rand(3, 3, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def _bidirectional(x, a):
    """A bidirectional layer: a forward scan and a backward scan over the same inputs."""
    hf, hb = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
    yf, yb = [], []
    for t in range(x.shape[1]):
        hf = torch.sigmoid(a[:, t]) * hf + x[:, t]
        yf.append(hf)
    for t in range(x.shape[1] - 1, -1, -1):
        hb = torch.sigmoid(-a[:, t]) * hb + x[:, t]
        yb.append(hb)
    return torch.stack(yf, 1) * torch.stack(yb[::-1], 1)


def _two_forward_loops(x, a):
    """Two forward loops reading the same inputs, one after the other (the second also reads
    the first's outputs)."""
    h, g = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
    ys, zs = [], []
    for t in range(x.shape[1]):
        h = torch.sigmoid(a[:, t]) * h + x[:, t]
        ys.append(h)
    for t in range(x.shape[1]):
        g = 0.5 * g + x[:, t] * ys[t]
        zs.append(g)
    return torch.stack(zs, 1)


def _two_reverse_loops(x, a):
    """Two loops over decreasing t, on different inputs (each flips its inputs before the
    region; lowering the second used to drop the first one's flips as dead code: a crash)."""
    h, g = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
    hs, gs = [], []
    for t in reversed(range(x.shape[1])):
        h = torch.sigmoid(a[:, t]) * h + x[:, t]
        hs.append(h)
    for t in reversed(range(a.shape[1])):
        g = 0.5 * g + a[:, t]
        gs.append(g)
    return torch.stack(hs, 1) + torch.stack(gs, 1)


def _layers_as_lists(x, a):
    """Stacked layers passing lists: the next layer walks the list the last one appended to
    (``for y in ys``, ``inp[t]``); a reverse layer writes ``ys[t] = h``."""
    inp = list(x.unbind(1))
    for layer in range(2):
        h, out = torch.zeros_like(inp[0]), []
        for t in range(len(inp)):
            h = torch.sigmoid(a[:, t] + layer) * h + inp[t]
            out.append(torch.tanh(h))
        inp = out
    h, back = torch.zeros_like(inp[0]), [None] * len(inp)
    for t in reversed(range(len(inp))):
        h = 0.7 * h + inp[t]
        back[t] = h
    g, zs = torch.zeros_like(h), []
    for y in back:
        g = 0.5 * g + y
        zs.append(g)
    return torch.stack(zs, 1) + (back[2] * back[-1])[:, None]


@pytest.mark.parametrize("fn,n", [(_bidirectional, 2), (_two_forward_loops, 2), (_two_reverse_loops, 2),
                                  (_layers_as_lists, 4)])
def test_two_loops_over_the_same_inputs(fn, n):
    """Each loop over the same tensor is found (the reads are searched again once a loop has
    taken its own); a loop's step values that later code reads one by one (``ys[t]``) become
    one stacked result read at t: a region each, values and gradients against float64."""
    g = torch.Generator().manual_seed(28)
    ins = (torch.randn(2, 7, 3, generator=g), torch.randn(2, 7, 3, generator=g))
    check(fn, ins, n_regions=n)
    grads_match(fn, ins)


@pytest.mark.gpu
@pytest.mark.parametrize("fn,n", [(_bidirectional, 2), (_two_forward_loops, 2), (_two_reverse_loops, 2),
                                  (_layers_as_lists, 4)])
def test_two_loops_over_the_same_inputs_on_the_gpu(fn, n):
    """The same loops on CUDA (target auto), L 200, against float64 eager on the CPU."""
    g = torch.Generator().manual_seed(30)
    ins = (torch.randn(2, 200, 16, generator=g), torch.randn(2, 200, 16, generator=g))
    out, rep = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(rep.regions) == n and not rep.fallbacks, str(rep)
    assert rel_err(out.cpu(), reference(fn, ins)[0]) < 1e-4, str(rep)


def _slot_write(x, a):
    """A state with one slot written in place each step (``s[:, :, 0] = x_t`` after a decay)."""
    s = torch.zeros(x.shape[0], x.shape[2], 3)
    ys = []
    for t in range(x.shape[1]):
        s = a * s
        s[:, :, 0] = x[:, t]
        ys.append(s.sum(-1))
    return torch.stack(ys, 1)


def _slot_write_viewed(x, a):
    """The same with a view of the state read after the write (it sees the write): left as
    written, whatever ssmc then does with the loop."""
    s = torch.zeros(x.shape[0], x.shape[2], 3)
    ys = []
    for t in range(x.shape[1]):
        s = a * s
        first = s[:, :, 0]
        s[:, :, 0] = x[:, t]
        ys.append(first * 2 + s.sum(-1))
    return torch.stack(ys, 1)


def test_slot_writes_into_a_state():
    """``s[idx] = v`` on a tensor the step made (one int or slice along one dim) is the new value
    ``select_scatter``/``slice_scatter`` of it, when no view of it is taken: the state's slot
    replaced: kept slots times a 0/1 vector (nothing moves, so the decay stays elementwise) plus
    the written value. With a view taken, the write stays; the values equal float64 eager either
    way."""
    g = torch.Generator().manual_seed(31)
    ins = (torch.randn(2, 7, 4, generator=g), torch.rand(3, generator=g))
    rep = check(_slot_write, ins)
    assert rep.regions[0].strategy == "chunked_scan", str(rep)
    grads_match(_slot_write, ins)
    out, rep = ssmc_run(_slot_write_viewed, ins)
    assert rel_err(out, reference(_slot_write_viewed, ins)[0]) < 1e-6, str(rep)


def _over_a_list(xs, a):
    h = torch.zeros_like(xs[0])
    ys = []
    for x_t in xs[:-1]:
        h = a * h + x_t
        ys.append(h)
    return torch.stack(ys, 1) * xs[-1].square().sum()


def _list_not_steps(ws, x):
    return ws[0] * x + ws[1] * ws[2]


def test_a_list_of_steps_passed_in():
    """``forward(xs: list[Tensor])``: each element is a graph input of its own, so no tensor is
    read at consecutive indices; the elements alike (0..L-1, one shape) are stacked and the loop
    found over the stack (values and gradients). A list whose elements are no steps is left as
    captured (the stack undone)."""
    g = torch.Generator().manual_seed(32)
    xs = [torch.randn(2, 3, generator=g) for _ in range(6)] + [torch.randn(5, generator=g)]
    a = torch.rand(3, generator=g)
    rep = ssmc.Report()
    torch._dynamo.reset()
    f = torch.compile(_over_a_list, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep))
    xg = [t.clone().requires_grad_() for t in xs]
    ag = a.clone().requires_grad_()
    out = f(xg, ag)
    x64 = [t.double().requires_grad_() for t in xs]
    a64 = a.double().requires_grad_()
    ref = _over_a_list(x64, a64)
    assert [r.strategy for r in rep.regions] == ["chunked_scan"], str(rep)
    assert any("6 tensors of list argument" in m for m in rep.graphs[0].log), str(rep)
    assert rel_err(out, ref) < 1e-6
    for p, q in zip(torch.autograd.grad(out.sum(), xg + [ag]), torch.autograd.grad(ref.sum(), x64 + [a64])):
        assert rel_err(p, q) < 1e-6
    rep = ssmc.Report()
    torch._dynamo.reset()
    ws, x = [torch.rand(3, generator=g) for _ in range(3)], torch.randn(3, generator=g)
    f = torch.compile(_list_not_steps, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep))
    assert torch.equal(f(ws, x), _list_not_steps(ws, x))
    assert not rep.regions and rep.graphs[0].nodes_out == rep.graphs[0].nodes_in, str(rep)


# -- spellings found by probing code written elsewhere (2026-12-07) --------------------------

def _outer_by_matmul(k, v):
    """Delta rule with its outer product a column times a row by `@`: nothing is summed."""
    S = torch.zeros(k.shape[0], k.shape[2], v.shape[2], dtype=k.dtype)
    ys = []
    for t in range(k.shape[1]):
        u = v[:, t] - (k[:, t, :, None] * S).sum(1)
        S = S + k[:, t, :, None] @ u[:, None, :]
        ys.append(S.sum(1))
    return torch.stack(ys, 1)


def _outer_by_bmm(k, v):
    S = torch.zeros(k.shape[0], k.shape[2], v.shape[2], dtype=k.dtype)
    for t in range(k.shape[1]):
        u = v[:, t] - (k[:, t, :, None] * S).sum(1)
        S = S + torch.bmm(k[:, t].unsqueeze(2), u.unsqueeze(1))
    return S


def _paper_delta_rule(k, v):
    """S (dv, dk) with column vectors: S - (S k - v) k^T, k^T as a transpose of the step's view."""
    S = torch.zeros(k.shape[0], v.shape[2], k.shape[2], dtype=k.dtype)
    for t in range(k.shape[1]):
        kt = k[:, t, :, None]
        S = S - (S @ kt - v[:, t, :, None]) @ kt.transpose(-1, -2)
    return S


def _covariance_by_transpose(k, v):
    """A diagonal recurrence whose drive is k k^T, both factors views of one step's read."""
    S = torch.zeros(k.shape[0], k.shape[2], k.shape[2], dtype=k.dtype)
    ys = []
    for t in range(k.shape[1]):
        kt = k[:, t, :, None]
        S = 0.9 * S + kt @ kt.transpose(-1, -2)
        ys.append((S * v[:, t, :3, None]).sum(1))
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_outer_by_matmul, _outer_by_bmm, _paper_delta_rule, _covariance_by_transpose])
def test_outer_products_by_matmul_and_transposed_views(fn):
    """`a @ b` of a column and a row is the broadcast product (it mixed state axes before); a view
    of a view of a step's read (kt.transpose of kt = k[:, t, :, None]) is loaded on its own
    axes. One region each, values and gradients equal to float64 eager."""
    g = torch.Generator().manual_seed(21)
    ins = (F.normalize(torch.randn(2, 7, 3, generator=g), dim=-1), torch.randn(2, 7, 4, generator=g))
    rep = check(fn, ins)
    assert "rank_one" in str(rep) or fn is _covariance_by_transpose, str(rep)
    grads_match(fn, ins)


def _padded_by_lengths(x, a, lengths):
    """Sequences of different lengths: the loop index compared with a lengths tensor."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.where((t < lengths)[:, None], a[:, t] * h + x[:, t], h)
        ys.append(h * (lengths > t)[:, None])
    return torch.stack(ys, 1)


def test_loop_index_compared_with_lengths():
    """`t < lengths` and `lengths > t` differ step to step: read from a table of the steps' indices
    (as `x / (t + 1)` is), one region."""
    g = torch.Generator().manual_seed(22)
    ins = (torch.randn(3, 9, 4, generator=g), torch.rand(3, 9, 4, generator=g), torch.tensor([9, 5, 2]))
    rep = check(_padded_by_lengths, ins)
    assert any("read from a table" in n for n in rep.regions[0].notes), str(rep)
    grads_match(_padded_by_lengths, ins)


def test_in_place_state_read_through_an_alias_used_at_once():
    """mamba_ssm's step: ``s.copy_(...)`` then ``einsum(..., s.to(dtype), C)``, and a shift
    register written back from a cat of its own slice: aliases used up before the next update
    read the new value, one region. An alias kept past the next update runs as written."""
    def step_style(x, a, C):
        s = torch.zeros(x.shape[0], x.shape[2], C.shape[2], dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            s.copy_(a[:, t, :, None] * s + x[:, t, :, None])
            ys.append(torch.einsum("bdn,bn->bd", s.to(x.dtype), C[:, t]))
        return torch.stack(ys, 1)

    def shift_back(x, w):
        cs = torch.zeros(x.shape[0], x.shape[2], 3, dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            cs.copy_(torch.cat([cs[..., 1:], x[:, t, :, None]], -1))
            ys.append((cs * w).sum(-1))
        return torch.stack(ys, 1)

    def kept(x, a, C):
        s = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype)
        ys, views = [], []
        for t in range(x.shape[1]):
            s.copy_(a[:, t] * s + x[:, t])
            ys.append(s * C[:, t, :1])
            views.append(s[:, :2])            # sees every later update
        return torch.stack(ys, 1), torch.stack(views, 1)
    g = torch.Generator().manual_seed(23)
    x, a, C = torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g), torch.randn(2, 6, 4, generator=g)
    with torch.no_grad():
        check(step_style, (x, a, C))
        check(shift_back, (x, torch.randn(3, generator=g)))
        out, rep = ssmc_run(kept, (x, a, C))
        assert not rep.regions, str(rep)
        for o, r in zip(out, kept(x, a, C)):
            assert rel_err(o, r) < 1e-6


def test_values_computed_under_no_grad_get_no_gradient():
    """``with torch.no_grad():`` around a step's drive, or around a decay computed for the whole
    sequence before the loop: a region fuses that work, and its backward must not differentiate
    it (eager gives those inputs no gradient)."""
    def in_step(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            with torch.no_grad():
                u = x[:, t] * 2
            h = a[:, t] * h + u
            ys.append(h)
        return torch.stack(ys, 1)

    def before(x, dt, A):
        with torch.no_grad():
            dA = torch.exp(dt[..., None] * A)
        h = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = dA[:, t] * h + dt[:, t, :, None] * x[:, t, :, None]
            ys.append(h.sum(-1))
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(24)
    for fn, ins in ((in_step, (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g))),
                    (before, (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g),
                              -torch.rand(3, 2, generator=g)))):
        xs = [x.double().requires_grad_() for x in ins]
        out, rep = ssmc_run(fn, xs)
        assert len(rep.regions) == 1 and any("no_grad" in line for line in rep.graphs[0].log), str(rep)
        ys = [x.double().requires_grad_() for x in ins]
        ref = fn(*ys)
        assert rel_err(out, ref) < 1e-10
        got = torch.autograd.grad(out.sum(), xs, allow_unused=True)
        want = torch.autograd.grad(ref.sum(), ys, allow_unused=True)
        for a, b in zip(got, want):
            assert (a is None) == (b is None), (fn.__name__, a, b)
            if b is not None:
                assert rel_err(a, b) < 1e-10


def test_stacked_results_are_laid_out_as_eager():
    """A result computed after the region (an int mask's product) and a fused readout of heads
    come back contiguous, as eager's stack: user code may ``.view`` them."""
    def masked(x, a, m):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            ys.append(h * m[:, t, None])
        return torch.stack(ys, 1).view(x.shape[0], -1)

    def heads(x, dt, B, C):
        h = torch.zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[2], dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = torch.exp(-dt[:, t])[:, :, None, None] * h + x[:, t, :, :, None] * B[:, t, None, None, :]
            ys.append(torch.einsum("bhpn,bn->bhp", h, C[:, t]))
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(25)
    check(masked, (torch.randn(2, 5, 3, generator=g), torch.rand(2, 5, 3, generator=g),
                   (torch.rand(2, 5, generator=g) > 0.3).long()))
    ins = (torch.randn(2, 7, 2, 3, generator=g), torch.rand(2, 7, 2, generator=g), torch.randn(2, 7, 4, generator=g),
           torch.randn(2, 7, 4, generator=g))
    out, _ = ssmc_run(heads, ins)
    assert out.is_contiguous() and rel_err(out, heads(*ins)) < 1e-5


@pytest.mark.parametrize("form", ["addcmul_value", "addcdiv", "matmul_method"])
def test_more_spellings_of_the_update(form):
    """``h.mul_(a).addcmul_(x, w, value=v)`` (Dynamo writes it as prims.fma), ``torch.addcdiv``
    and ``M.matmul(h.unsqueeze(-1))`` are the linear ops they are."""
    def fn(x, a, w, M):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            if form == "addcmul_value":
                h = h.mul_(a[:, t]).addcmul_(x[:, t], w, value=0.5)
            elif form == "addcdiv":
                h = torch.addcdiv(a[:, t] * h, x[:, t], w, value=2.0)
            else:
                h = M.matmul(h.unsqueeze(-1)).squeeze(-1) * a[:, t] + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(26)
    ins = (torch.randn(2, 6, 4, generator=g), torch.rand(2, 6, 4, generator=g), torch.rand(4, generator=g) + 1,
           0.3 * torch.randn(4, 4, generator=g))
    check(fn, ins)
    if form != "addcmul_value":         # (in-place on a tensor that requires grad: eager refuses too)
        grads_match(fn, ins)


def test_gradients_through_a_flat_branch_are_zero_not_nan():
    """``sqrt(relu(v))`` in the drive and in a readout: sqrt's gradient at 0 is inf, and relu's
    backward selects it away (0, as torch gives), not inf * 0 = nan spread through the adjoint."""
    def fn(v, a):
        h = torch.zeros_like(v[:, 0])
        ys = []
        for t in range(v.shape[1]):
            h = a[:, t] * h + torch.sqrt(torch.relu(v[:, t]))
            ys.append(torch.sqrt(torch.clamp(h - 0.5, min=0.0)) + h)
        return torch.stack(ys, 1)
    v = torch.tensor([[[1.0, -1.0], [0.5, -2.0], [-1.0, 2.0], [3.0, -0.5]]]).repeat(2, 1, 1)
    a = torch.full((2, 4, 2), 0.5)
    xs = [v.clone().double().requires_grad_(), a.clone().double().requires_grad_()]
    out, rep = ssmc_run(fn, xs)
    assert len(rep.regions) == 1, str(rep)
    got = torch.autograd.grad(out.sum(), xs)
    ys = [v.clone().double().requires_grad_(), a.clone().double().requires_grad_()]
    want = torch.autograd.grad(fn(*ys).sum(), ys)
    for g, w in zip(got, want):
        assert torch.isfinite(w).all() and torch.isfinite(g).all(), (g, w)
        assert rel_err(g, w) < 1e-10


@pytest.mark.parametrize("form", ["peeled", "branch", "before_update"])
def test_work_after_a_stack_with_peeled_steps_covers_them(form):
    """Steps run outside the region (the first one peeled, `if t == 0`, an output read before the
    update) are stacked around its result; elementwise work after the stack (`* g`) covers them
    too, so it is not pulled into the region (it was: one step short, the rest misaligned)."""
    def fn(a, b, g):
        h = b[:, 0] if form == "peeled" else torch.zeros_like(b[:, 0])
        ys = [h] if form == "peeled" else []
        for t in range(1 if form == "peeled" else 0, a.shape[1]):
            if form == "before_update":
                ys.append(h + b[:, t])
            h = b[:, t] if form == "branch" and t == 0 else a[:, t] * h + b[:, t]
            if form != "before_update":
                ys.append(h)
        return (torch.stack(ys, 1) * g).exp()
    g = torch.Generator().manual_seed(27)
    ins = (torch.rand(2, 10, 3, generator=g), torch.randn(2, 10, 3, generator=g), torch.randn(2, 10, 3, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def test_two_complex_loops_in_one_graph():
    """Two complex-diagonal layers: the real view of each loop's initial state is kept until its
    own loop is lowered (lowering the other one dropped it as dead code: no region at all)."""
    def layer(u, lam):
        h = torch.zeros(u.shape[0], u.shape[1], lam.shape[-1], dtype=lam.dtype)
        ys = []
        for t in range(u.shape[-1]):
            h = lam * h + u[:, :, t, None]
            ys.append(h.real.sum(-1))
        return torch.stack(ys, -1)

    def two(u, l1, l2):
        return layer(u, l1) + layer(u, l2)
    g = torch.Generator().manual_seed(28)
    lam = lambda: torch.polar(torch.rand(4, 2, generator=g, dtype=torch.float64) * 0.9,     # noqa: E731
                              torch.rand(4, 2, generator=g, dtype=torch.float64))
    u = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    check(two, (u, lam(), lam()), n_regions=2)


def test_a_loop_cut_later_is_found_once():
    """A reverse loop of 3 steps collecting the bare state before its update is cut one step
    later (2 steps); its first step's reads, before the cut, are this loop's too: a second
    round of the search took the same steps again as a second loop (an internal error in
    lowering; found by the fuzzer)."""
    def fn(u0, u1):
        h = torch.zeros(u0.shape[0], 3, 4, 2, dtype=u0.dtype)
        ys = []
        for t in range(u0.shape[1] - 1, -1, -1):
            y = h
            h = torch.sigmoid(u0[:, t] + u1[:, t]) * h + u0[:, t]
            ys.append(y)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(29)
    rep = check(fn, (torch.randn(2, 3, 1, 1, 1, generator=g), torch.randn(2, 3, 1, 1, 1, generator=g)))
    assert not rep.fallbacks, str(rep)


def _cache_in_place(x, a, h):
    for t in range(x.shape[1]):
        h *= a
        h += x[:, t]
    return h


def _cache_in_place_no_return(x, a, h):
    for t in range(x.shape[1]):
        h.mul_(a).add_(x[:, t])


def _accumulate_into(x, a, acc):
    for t in range(x.shape[1]):
        acc += a * x[:, t]
    return acc * 2


@pytest.mark.parametrize("fn", [_cache_in_place, _cache_in_place_no_return, _accumulate_into],
                         ids=lambda f: f.__name__)
def test_an_input_updated_in_place_gets_its_last_value(fn):
    """A state cache passed in and updated in place (`h *= a; h += x[:, t]`, `h.mul_(a).add_()`,
    an accumulator): the loop is one region and the caller's tensor ends as eager leaves it (it
    was left unchanged: the writes were taken as new values)."""
    g = torch.Generator().manual_seed(30)
    x, a, h0 = torch.randn(2, 6, 3, generator=g), torch.rand(3, generator=g), torch.randn(2, 3, generator=g)
    he, hc = h0.clone(), h0.clone()
    want = fn(x, a, he)
    got, rep = ssmc_run(fn, (x, a, hc))
    assert len(rep.regions) == 1, str(rep)
    assert rel_err(hc, he) < 1e-6
    if want is not None:
        assert rel_err(got, want) < 1e-6


def test_an_input_updated_in_place_under_autograd():
    """The same cache while x and a need gradients: the region saved the cache for its backward
    and the copy-back of the last value changed it ("modified by an inplace operation"); the
    region now reads a copy taken before the updates."""
    def fn(x, a, h):
        ys = []
        for t in range(x.shape[1]):
            h *= a[:, t]
            h += x[:, t]
            ys.append(h * 2)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(32)
    x, a, h0 = torch.randn(2, 5, 3, generator=g), torch.rand(2, 5, 3, generator=g), torch.randn(2, 3, generator=g)
    grads, caches = [], []
    for compiled in (False, True):
        xs, as_, h = x.clone().requires_grad_(), a.clone().requires_grad_(), h0.clone()
        if compiled:
            y, rep = ssmc_run(fn, (xs, as_, h))
            assert len(rep.regions) == 1, str(rep)
        else:
            y = fn(xs, as_, h)
        grads.append(torch.autograd.grad(y.sum(), (xs, as_)))
        caches.append(h)
    assert rel_err(caches[1], caches[0]) < 1e-6
    for got, want in zip(grads[1], grads[0]):
        assert rel_err(got, want) < 1e-5


def test_squeeze_in_place_of_a_step_slice():
    """xLSTM's step takes `q[:, :, t:t + 1]` and calls `.squeeze_(2)` on it: a new shape for that
    view, no values written; it was taken as a write into q (the loop ran as written)."""
    def fn(q, a):
        h, ys = torch.zeros_like(q[:, :, 0]), []
        for t in range(q.shape[2]):
            qt = q[:, :, t:t + 1]
            qt.squeeze_(2)
            h = a[:, :, t] * h + qt
            ys.append(h)
        return torch.stack(ys, 2)
    g = torch.Generator().manual_seed(34)
    q, a = torch.randn(2, 3, 6, 4, generator=g), torch.rand(2, 3, 6, 4, generator=g)
    want = fn(q, a)
    got, rep = ssmc_run(fn, (q, a))
    assert len(rep.regions) == 1, str(rep)
    assert got.shape == want.shape and rel_err(got, want) < 1e-6 and q.shape == (2, 3, 6, 4)


def test_a_buffer_keeps_its_layout():
    """fla's naive GLA: inputs transposed to (B, H, T, K), `o = zeros_like(v)` (which keeps v's
    transposed layout), `o[:, :, t] = ...`, `o.transpose(1, 2)` returned: eager's result is
    contiguous, and a caller's `.view` of it works; ssmc's was the transpose of a contiguous
    buffer, and the `.view` raised."""
    def fn(v, a):
        v = v.transpose(1, 2)                     # (B, T, H, K) -> (B, H, T, K)
        a = a.transpose(1, 2)
        o, h = torch.zeros_like(v), torch.zeros_like(v[:, :, 0])
        for t in range(v.shape[2]):
            h = a[:, :, t] * h + v[:, :, t]
            o[:, :, t] = h
        return o.transpose(1, 2)
    g = torch.Generator().manual_seed(33)
    v, a = torch.randn(2, 5, 3, 4, generator=g), torch.rand(2, 5, 3, 4, generator=g)
    want = fn(v, a)
    got, rep = ssmc_run(fn, (v, a))
    assert len(rep.regions) == 1, str(rep)
    assert got.stride() == want.stride() and rel_err(got, want) < 1e-6
    assert got.view(2, 5, -1).shape == (2, 5, 12)


@pytest.mark.parametrize("buf_dtype, state_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float64)])
def test_a_buffer_keeps_its_dtype(buf_dtype, state_dtype):
    """`out[:, t] = h` into a buffer of a narrower dtype than the state: each write rounds, and
    the buffer comes back in its own dtype (it came back in the state's: a matmul with a bf16
    weight after it then raised)."""
    def fn(x, a, W):
        out = torch.empty_like(x)
        h = torch.zeros(x.shape[0], x.shape[2], dtype=a.dtype)
        for t in range(x.shape[1]):
            h = a * h + x[:, t].to(a.dtype)
            out[:, t] = h
        return out, out @ W
    g = torch.Generator().manual_seed(31)
    x = torch.randn(2, 6, 3, generator=g).to(buf_dtype)
    a, W = torch.rand(3, generator=g, dtype=state_dtype), torch.randn(3, 3, generator=g).to(buf_dtype)
    want = fn(x, a, W)
    got, rep = ssmc_run(fn, (x, a, W))
    assert len(rep.regions) == 1, str(rep)
    for o, w in zip(got, want):
        assert o.dtype == w.dtype
        assert rel_err(o.double(), w.double()) < 1e-6


def _segments_reset(x, a):
    ys = []
    for s in range(2):
        h = torch.zeros_like(x[:, 0])
        for t in range(4 * s, 4 * s + 4):
            h = a * h + x[:, t]
            ys.append(h)
    return torch.stack(ys, 1)


def _chunks_of_split(x, a):
    h, ys = torch.zeros_like(x[:, 0]), []
    for xc in x.split(4, dim=1):
        for j in range(xc.shape[1]):
            h = a * h + xc[:, j]
            ys.append(h)
    return torch.stack(ys, 1)


def _truncated_bptt(x, a):
    h, ys = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        if t % 4 == 0:
            h = h.detach()
        h = a * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("fn", [_segments_reset, _chunks_of_split, _truncated_bptt], ids=lambda f: f.__name__)
def test_loops_sharing_one_stack(fn):
    """Several loops appending to one list stacked once (a state reset per segment, the chunks
    of `x.split`, truncated backprop's detach every k steps): one region each, the stack a cat of
    theirs (lowering failed on the shared stack: an internal error, the graph ran as captured);
    gradients as eager's, truncated where it detaches."""
    g = torch.Generator().manual_seed(32)
    ins = (torch.randn(2, 8, 3, generator=g), torch.rand(3, generator=g))
    rep = check(fn, ins, n_regions=2)
    assert not rep.fallbacks, str(rep)
    grads_match(fn, ins)


@pytest.mark.parametrize("h0_shape", [(3,), (), (4, 3)], ids=["vector", "scalar", "per_channel"])
def test_initial_state_of_fewer_dims(h0_shape):
    """A learned initial state with fewer dims than the state (`nn.Parameter(torch.zeros(H))`
    broadcast by the first step) is broadcast from the left as eager does (the region raised:
    "has 1 dims, expected 2"); its gradient sums over the broadcast dims."""
    def fn(x, a, h0):
        h, ys = h0, []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(33)
    shape = (2, 5, 4, 3) if len(h0_shape) == 2 else (2, 5, 3)
    ins = (torch.randn(*shape, generator=g), torch.rand(*shape, generator=g), torch.randn(h0_shape, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def test_results_are_tensors_of_their_own():
    """The returned final state is no view of another output (in grad mode `h.mul_(0.5)` raised
    "Output 1 ... is a view and is being modified inplace", and `h.detach_()` "Can't detach views
    in-place"); `y[:, -1]` of returned steps stays a view of them, as in eager (it was the final
    state: `h.zero_()` zeroed it)."""
    def fn(x, a):
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            ys.append(h)
        y = torch.stack(ys, 1)
        return y, h, y[:, -1]
    g = torch.Generator().manual_seed(34)
    x, a = torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g)
    xg = x.clone().requires_grad_()
    (y, h, last), rep = ssmc_run(fn, (xg, a))
    assert len(rep.regions) == 1, str(rep)
    h.mul_(0.5)                        # raised before
    (y.sum() + h.sum()).backward()
    xe = x.clone().requires_grad_()
    ye, he, _ = fn(xe, a)
    he.mul_(0.5)
    (ye.sum() + he.sum()).backward()
    assert rel_err(xg.grad, xe.grad) < 1e-5
    h.detach_()
    (y, h, last), _ = ssmc_run(fn, (x, a))
    h.zero_()
    assert last.abs().sum() > 0 and last._base is not None
    y.mul_(0)
    assert last.abs().sum() == 0


def _slot_written_through_a_read(x, c0):
    C = torch.zeros(1, x.shape[0], 3)           # a cache indexed by layer, HF Mamba2Cache-style
    C[0] = c0
    outs = []
    for t in range(x.shape[1]):
        C[0][:, -1] = x[:, t]                   # a write through the read C[0] (a view)
        outs.append(C[0].sum(-1))
    return torch.stack(outs, 1)


def _slot_written_then_changed(x, y):
    aux, outs = torch.zeros_like(x), []
    for i in range(x.shape[1]):
        d = x[:, i] * 2
        aux[:, i] = d                           # the slot holds d as it is now
        d += y[:, i]
        outs.append(aux[:, i] * 1)
    return torch.stack(outs, 1)


def _buffer_later_loop(x, y):                   # fla's naive_recurrent_rwkv6_bwd, in small
    dq = torch.zeros_like(x)
    for i in range(x.shape[1]):
        d = x[:, i] * 3
        dq[:, i] = d
        d += y[:, i]
    dw = torch.zeros_like(x)
    for i in range(x.shape[1] - 2, -1, -1):
        dw[:, i] = dw[:, i + 1] + dq[:, i + 1]
    return dw


@pytest.mark.parametrize("fn", [_slot_written_through_a_read, _slot_written_then_changed, _buffer_later_loop],
                         ids=lambda f: f.__name__)
def test_slot_reads_see_every_write(fn):
    """A read of a buffer's slot is the value written there only while nothing else writes it: a
    write through another read of the slot (a view), or the written tensor changed afterwards by
    `+=`, keep the read as it is (both read the first write: silently wrong values)."""
    g = torch.Generator().manual_seed(35)
    ins = (torch.randn(2, 5, generator=g), torch.randn(2, 3 if fn is _slot_written_through_a_read else 5, generator=g))
    out, _ = ssmc_run(fn, ins)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-6


def test_a_step_value_with_leading_unit_dims_into_a_buffer():
    """SRU's CPU path: steps read from `.chunk(L)` are (1, b, d), the state starts (b, d), and
    `h[t] = c` drops the leading 1 as eager's write does (the buffer came back (L, 1, b, d))."""
    def fn(x, f, c0):
        L = x.shape[0]
        h = x.new_zeros(L, *c0.shape)
        c = c0
        for t, (xt, ft) in enumerate(zip(x.chunk(L), f.chunk(L))):
            c = ft * c + (1 - ft) * xt
            h[t] = c
        return h, c
    g = torch.Generator().manual_seed(36)
    ins = (torch.randn(7, 2, 4, generator=g), torch.rand(7, 2, 4, generator=g), torch.randn(2, 4, generator=g))
    check(fn, ins)
    grads_match(fn, ins)


def _h0_vector(x, a, h0):
    h, ys = h0, []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def _bf16_buffer(x, a, h0):
    out = torch.empty_like(x, dtype=torch.bfloat16)
    h = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        out[:, t] = h
    return out


@pytest.mark.parametrize("fn", [_h0_vector, _bf16_buffer], ids=lambda f: f.__name__)
def test_this_sessions_forms_on_the_triton_interpreter(fn, monkeypatch, tmp_path):
    """The generated Triton kernel (interpreted) with an initial state of fewer dims and with a
    bf16 buffer filled from an fp32 state."""
    from ssmc.runtime.op import lookup
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(37)
    ins = (torch.randn(2, 5, 3, generator=g), torch.rand(2, 5, 3, generator=g), torch.randn(3, generator=g))
    out, rep = ssmc_run(fn, ins, target="triton")
    assert [r.target for r in rep.regions] == ["triton"], str(rep)
    entry = lookup(rep.regions[0].key)
    assert entry.failure is None and getattr(entry.kernel, "fallback", None) is None, entry.failure
    if fn is _h0_vector:
        assert rel_err(out, fn(*[x.double() for x in ins])) < 1e-5
    else:                          # bf16 written from fp32: within the rounding of one bf16 step
        assert out.dtype == torch.bfloat16
        assert rel_err(out.double(), fn(*[x.double() for x in ins]).double()) < 1e-2


def test_a_symbolic_float_on_the_triton_interpreter(monkeypatch, tmp_path):
    """A float hyperparameter that changed between calls goes into the kernel as a 0-d tensor."""
    from ssmc.runtime.op import lookup
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(38))
    outs, reports = compile_per_call(P.ema, [(x, 0.9), (x, 0.5)], target="triton")
    for o, d in zip(outs, (0.9, 0.5)):
        assert rel_err(o, P.ema(x.double(), d)) < 1e-5
    rep = reports[-1]
    assert [r.target for r in rep.regions] == ["triton"], str(rep)
    entry = lookup(rep.regions[0].key)
    assert entry.failure is None and getattr(entry.kernel, "fallback", None) is None, entry.failure


def test_rwkv7_with_a_three_operand_einsum():
    """fla's naive RWKV-7: `einsum('bhik,bhk,bhj->bhij', S, a, b)`, (S a) b^T in one einsum, is
    taken as two-operand einsums from the left (it was declined: "contracts the state with 2
    operands"): a rank-one transition."""
    def fn(r, w, k, v, a, b):
        S = torch.zeros(*r.shape[:2], r.shape[-1], r.shape[-1], dtype=r.dtype)
        o = torch.zeros_like(v)
        for t in range(r.shape[2]):
            S = S * w[:, :, t, None, :] + torch.einsum('bhik,bhk,bhj->bhij', S, a[:, :, t], b[:, :, t]) \
                + v[:, :, t, :, None] * k[:, :, t, None, :]
            o[:, :, t] = torch.einsum('bhj,bhij->bhi', r[:, :, t], S)
        return o
    g = torch.Generator().manual_seed(39)
    shp = (2, 2, 6, 4)
    r, k, v = (torch.randn(*shp, generator=g) for _ in range(3))
    kk = F.normalize(torch.randn(*shp, generator=g), dim=-1)
    ins = (r, 0.5 + 0.5 * torch.rand(*shp, generator=g), k, v, -kk, kk * torch.rand(*shp, generator=g))
    rep = check(fn, ins)
    assert rep.regions[0].strategy == "rank_one", str(rep)
    grads_match(fn, ins, tol=1e-4)


@pytest.mark.parametrize("h0", [False, True])
def test_state_collected_before_its_update_and_the_final_state_returned(h0):
    """`ys.append(h)` above `h = ...` with the final h returned too: the last update is in the
    graph, so the stack holds every step's new value but the last's, after the initial state
    (it was not re-rolled: "stack uses h_1, a value of step 0, after the loop")."""
    def fn(x, a, h):
        ys = []
        for t in range(x.shape[1]):
            ys.append(h)
            h = a[:, t] * h + x[:, t]
        return torch.stack(ys, 1), h
    g = torch.Generator().manual_seed(40)
    x, a = torch.randn(2, 7, 3, generator=g), torch.rand(2, 7, 3, generator=g)
    init = torch.randn(2, 3, generator=g) if h0 else torch.zeros(2, 3)
    rep = check(fn, (x, a, init))
    assert not rep.fallbacks, str(rep)
    grads_match(fn, (x, a, init))


def _cache_promoted(x, a, h):
    for t in range(x.shape[1]):
        h *= a                      # h bf16, a fp32: each update rounds to bf16
        h += x[:, t]
    return h


def _cache_zeroed_after(x, a, h):
    for t in range(x.shape[1]):
        h *= a
        h += x[:, t]
    y = h * 2
    h.zero_()
    return y


def _cache_and_its_view(x, a, h, h0):
    ys = []
    for t in range(x.shape[1]):
        h *= a
        h += x[:, t]
        ys.append(h0 * 1)           # h0 is h[0]: it sees every update
    return torch.stack(ys, 0)


def test_inputs_updated_in_place_in_other_ways():
    """Updates of an input that are not rewritten as values (a promoting dtype, a write after the
    loop) keep the loop as written (the region dropped the caller's update); an input passed
    with a view of it runs the captured graph at that call (the view saw no update); a returned
    updated input is the caller's tensor itself."""
    g = torch.Generator().manual_seed(41)
    x, a = torch.randn(2, 5, 3, generator=g), torch.rand(3, generator=g)
    for fn, h0, dt in [(_cache_promoted, torch.randn(2, 3, generator=g), torch.bfloat16),
                       (_cache_zeroed_after, torch.randn(2, 3, generator=g), torch.float32)]:
        he, hc = h0.to(dt).clone(), h0.to(dt).clone()
        want = fn(x, a, he)
        got, _ = ssmc_run(fn, (x, a, hc))
        assert rel_err(hc.double(), he.double()) < 1e-6 and rel_err(got.double(), want.double()) < 1e-6
    h = torch.randn(2, 3, generator=g)
    he, hc = h.clone(), h.clone()
    want = _cache_and_its_view(x, a, he, he[0])
    got, _ = ssmc_run(_cache_and_its_view, (x, a, hc, hc[0]))
    assert rel_err(got, want) < 1e-6 and rel_err(hc, he) < 1e-6
    hc = h.clone()
    got, _ = ssmc_run(_cache_in_place, (x, a, hc))
    assert got is hc


def test_a_buffer_read_back_where_its_writes_are_not_forwarded():
    """`out[:, t] = h` into a float32 buffer of a float64 state, read back a step later: the read
    is no input of the loop (the region read the buffer as it was before the loop)."""
    def fn(x, a):
        out = torch.zeros(x.shape, dtype=torch.float32)
        h = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype)
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t] = h
            if t > 0:
                h = h + 0.1 * out[:, t - 1]
        return out
    g = torch.Generator().manual_seed(42)
    ins = (torch.randn(1, 7, 2, generator=g, dtype=torch.float64), torch.rand(1, 7, 2, generator=g, dtype=torch.float64))
    out, _ = ssmc_run(fn, ins)
    assert rel_err(out, fn(*ins)) < 1e-6


def test_a_rounding_buffer_read_after_the_loop():
    """A bf16 buffer of an fp32 state read after the loop (`out.float().sum(-1)`): the sum is of
    the rounded values (the work moved into the step summed the unrounded state)."""
    def fn(x, a):
        out = torch.empty_like(x, dtype=torch.bfloat16)
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            out[:, t] = h
        return out.float().sum(-1)
    g = torch.Generator().manual_seed(43)
    ins = (torch.randn(2, 6, 4, generator=g), torch.rand(2, 6, 4, generator=g))
    out, _ = ssmc_run(fn, ins)
    assert rel_err(out, fn(*ins)) < 1e-6


@pytest.mark.parametrize("combine", [
    lambda a1, b1, a2, b2: ((a1 * a2).abs(), a2.abs() * b1 + b2),
    lambda a1, b1, a2, b2: (a1 * a2, torch.relu(a2) * b1 + b2),
    lambda a1, b1, a2, b2: (a1 * a2, torch.clamp(a2 * b1 + b2, max=100.0)),
], ids=["abs", "relu", "clamp"])
def test_associative_scan_hop_combines_equal_to_the_pair_only_for_some_signs(combine):
    """Combines that agree with the linear pair on positive operands are no pair: they are
    checked on operands of either sign and three magnitudes (they were taken)."""
    import ssmc
    gm, (xa, xb) = _assoc_scan_graph(combine)
    rep = ssmc.Report()
    ssmc.ssmc_backend(gm, [xa, xb], _report=rep)
    assert not rep.regions, str(rep)


def test_a_state_no_input_drives_needs_no_gradient():
    """A step counter's final value does not require grad because x, read for the length alone,
    does."""
    def fn(x):
        s, n = torch.zeros_like(x[:, 0]), x.new_zeros(x.shape[0], 1)
        for t in range(x.shape[1]):
            s = s + x[:, t]
            n = n + 1
        return s / n, n
    x = torch.randn(2, 6, 3, requires_grad=True)
    (m, n), rep = ssmc_run(fn, (x,))
    assert len(rep.regions) == 2, str(rep)
    assert not n.requires_grad and m.requires_grad
    assert torch.equal(n, torch.full((2, 1), 6.0))


def _returns_into(returns, rewards, masks, next_value):
    returns[-1] = next_value
    for step in reversed(range(rewards.size(0))):
        returns[step] = returns[step + 1] * 0.99 * masks[step + 1] + rewards[step]
    return returns


def test_a_recurrence_in_a_buffer_passed_in():
    """An RL rollout buffer passed in holding the discounted returns (`returns[step] =
    returns[step + 1] * gamma * mask + r`): a region (it ran as written, `explain` calling it a
    map over the steps); the caller's buffer holds the returns, also at a call where another
    input views the buffer (the captured graph runs then)."""
    g = torch.Generator().manual_seed(44)
    S, N = 8, 3
    r, m, nv = torch.randn(S, N, generator=g), (torch.rand(S + 1, N, generator=g) > 0.2).float(), torch.randn(N, generator=g)
    want = _returns_into(torch.zeros(S + 1, N, dtype=torch.float64), r.double(), m.double(), nv.double())
    buf = torch.zeros(S + 1, N)
    out, rep = ssmc_run(_returns_into, (buf, r, m, nv))
    assert len(rep.regions) == 1, str(rep)
    assert rel_err(out, want) < 1e-6 and rel_err(buf, want) < 1e-6
    big = torch.zeros(S + 1, N)
    out, _ = ssmc_run(_returns_into, (big, big[:S], m, nv))      # rewards alias the buffer
    ref = torch.zeros(S + 1, N)
    _returns_into(ref, ref[:S], m, nv)
    assert rel_err(out, ref) < 1e-6


def test_the_state_passed_on_through_a_size_one_slice():
    """lucidrains' minGRU sequential step: `out = lerp(h, x_t, gate)`, `h = out[:, -1:]` (a slice of
    the size-1 time dim: the same values), `to_out(out)` read out. The readout read `out`, not the
    carried slice, and was taken as a read of the previous state (the loop ran as written)."""
    def fn(x, h, W):
        outs = []
        for t in range(x.shape[1]):
            out = torch.lerp(h, x[:, t:t + 1], x[:, t:t + 1].sigmoid())
            h = out[:, -1:]
            outs.append(torch.nn.functional.linear(out, W))
        return torch.cat(outs, 1), h
    g = torch.Generator().manual_seed(35)
    args = (torch.randn(2, 7, 5, generator=g), torch.rand(2, 1, 5, generator=g), torch.randn(4, 5, generator=g))
    rep = check(fn, args)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
