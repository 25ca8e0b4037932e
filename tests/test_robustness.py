"""Bad inputs give clear errors or correct fallbacks; NaN/Inf propagate as in eager."""
import pytest
import torch

import programs as P
from conftest import TOL, compile_per_call, reference, rel_err, ssmc_run
import ssmc  # noqa: F401  (registers the "ssmc" backend)


@pytest.fixture(scope="module")
def compiled_region():
    ins = P.mamba1_inputs(seed=41)
    _, rep = ssmc_run(P.mamba1("stack"), ins)
    info = rep.regions[0]
    r = info.ir
    # region inputs rebuilt from the program inputs by name
    by_name = dict(zip(["l_x_", "l_dt_", "l_a_", "l_b_", "l_c_", "l_d_", "l_z_", "l_bias_"], ins))
    xs = []
    for spec in r.inputs:
        base = spec.name.split(" ")[0]
        xs.append(by_name[base] if base in by_name else torch.zeros(2, 4, 3))
    return info.key, xs


def test_region_rejects_wrong_dtype(compiled_region):
    key, xs = compiled_region
    bad = list(xs)
    bad[0] = bad[0].to(torch.int64)
    with pytest.raises(TypeError, match=r"input 0 \(.*\) has unsupported dtype torch.int64"):
        torch.ops.ssmc.region(key, bad)


def test_region_rejects_mismatched_shapes(compiled_region):
    key, xs = compiled_region
    bad = list(xs)
    i = next(k for k, x in enumerate(bad) if x.dim() == 3 and x.shape[1] > 1)
    bad[i] = torch.randn(bad[i].shape[0] + 1, *bad[i].shape[1:])
    with pytest.raises(ValueError, match=r"input \d+ \(.*\) has size \d at dim 0 for axis i0, but input \d+ has"):
        torch.ops.ssmc.region(key, bad)


@pytest.mark.gpu
def test_region_rejects_mixed_devices(compiled_region):
    key, xs = compiled_region
    bad = [x.cuda() for x in xs]
    bad[1] = bad[1].cpu()
    with pytest.raises(ValueError, match=r"input 1 \(.*\) is on cpu"):
        torch.ops.ssmc.region(key, bad)


def test_region_rejects_wrong_rank(compiled_region):
    key, xs = compiled_region
    bad = list(xs)
    bad[0] = bad[0][0]
    with pytest.raises(ValueError, match="input 0 .* has 2 dims, expected 3"):
        torch.ops.ssmc.region(key, bad)


def test_nan_and_inf_propagate_like_eager():
    fn = P.mamba1("stack")
    x, dt, A, B, C, D, z, bias = P.mamba1_inputs(seed=42)
    x = x.clone()
    x[0, 3, 1] = float("nan")
    dt = dt.clone()
    dt[1, 5, 2] = float("inf")
    ins = (x, dt, A, B, C, D, z, bias)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1
    ref = fn(*ins)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    ok = torch.isfinite(ref)
    assert torch.allclose(out[ok], ref[ok], rtol=1e-4, atol=1e-5)


def test_shapes_changing_between_calls_recompile():
    fn = P.mamba1("stack")
    torch._dynamo.reset()
    f = torch.compile(fn, backend="ssmc")
    for L, b in ((6, 2), (9, 3), (6, 2)):
        ins = P.mamba1_inputs(b=b, L=L, seed=L)
        out = f(*ins)
        assert out.shape == (b, L, 4)
        assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


def test_length_one_loop_runs():
    fn = P.mamba1("final")
    ins = P.mamba1_inputs(L=1, seed=43)
    out, rep = ssmc_run(fn, ins)
    for o, r in zip(out, reference(fn, ins)):
        assert rel_err(o, r) < TOL[torch.float32]


def test_batch_zero():
    fn = P.mamba1("stack")
    ins = P.mamba1_inputs(b=0, seed=44)
    out, rep = ssmc_run(fn, ins)
    assert out.shape == (0, 8, 4)


def test_large_decays_are_stable():
    """|dt*A| up to ~100: decays underflow to 0 exactly, nothing overflows."""
    fn = P.mamba1("stack")
    x, dt, A, B, C, D, z, bias = P.mamba1_inputs(L=16, seed=45)
    ins = (x, dt * 40, A * 3, B, C, D, z, bias)
    out, rep = ssmc_run(fn, ins)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


def test_decays_near_one_over_many_steps():
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    x = torch.randn(2, 64, 3)
    a = torch.tensor([1 - 1e-7, 1 - 1e-6, 0.999])
    out, rep = ssmc_run(fn, (x, a))
    assert len(rep.regions) == 1
    assert rel_err(out, reference(fn, (x, a))[0]) < 1e-5


def test_dynamic_batch_keeps_the_fusion():
    """After a recompile with a symbolic batch size the region is the same: views are still
    understood, nothing is computed outside the kernel."""
    fn = P.mamba1("stack")
    torch._dynamo.reset()
    f = torch.compile(fn, backend="ssmc")
    f(*P.mamba1_inputs(b=2, L=6, seed=1))
    f(*P.mamba1_inputs(b=3, L=6, seed=2))
    r = ssmc.backend.LAST_REPORT.regions[0].ir
    assert not any("before the region" in s.name for s in r.inputs), str(r)
    ins = P.mamba1_inputs(b=5, L=6, seed=3)
    assert rel_err(f(*ins), reference(fn, ins)[0]) < TOL[torch.float32]


def test_eager_graphs_skip_the_op_only_when_nothing_needs_it(monkeypatch, compiled_region):
    """An eagerly run graph calls its region through call_region: under no_grad the kernel runs
    without the custom op; with an input that needs a gradient, under a dispatch mode, or while
    profiling, the op runs (autograd, tracing and profiles see it); results agree either way."""
    import torch.utils._python_dispatch as pd
    from ssmc.runtime.op import call_region
    ins = P.mamba1_inputs(seed=60)
    fn = P.mamba1("stack")
    torch._dynamo.reset()
    f = torch.compile(fn, backend="ssmc")
    want = reference(fn, ins)
    with torch.no_grad():
        f(*ins)                                          # compiles
    real, calls = torch.ops.ssmc.region.default, []
    monkeypatch.setattr(torch.ops.ssmc.region, "default", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = f(*ins)
    assert calls == [] and rel_err(got, want[0]) <= TOL[torch.float32]
    x = ins[0].clone().requires_grad_()
    got = f(x, *ins[1:])                                 # (a recompile for requires_grad may trace it too)
    assert calls and rel_err(got.detach(), want[0]) <= TOL[torch.float32]
    got.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    calls.clear()

    class Mode(pd.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    key, xs = compiled_region
    plain = call_region(key, xs)
    assert calls == []
    with Mode():
        traced = call_region(key, xs)
    assert calls == [1]
    with torch.profiler.profile():
        call_region(key, xs)
    assert calls == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))


def _decay_loop(x, a, dt):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(-a * dt[:, t]) * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1), h


def _decay_loop_reversed(x, a, dt):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in reversed(range(x.shape[1])):
        h = torch.exp(-a * dt[:, t]) * h + x[:, t]
        ys.append(h)
    return torch.stack(ys[::-1], 1), h


@pytest.mark.parametrize("fn", [_decay_loop, _decay_loop_reversed])
def test_recompiles_with_sizes_dynamo_made_dynamic(fn):
    """Called again with other sizes, Dynamo recompiles with symbolic sizes: the batch, and the
    time dim of an input the loop reads only up to its length (dt longer than x). Each graph
    gets its region; values and gradients equal float64 eager."""
    rep = ssmc.Report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep))
    g = torch.Generator().manual_seed(43)
    for b, L, Ld in [(2, 9, 9), (3, 9, 9), (3, 7, 10), (4, 7, 12)]:
        xs = [torch.randn(b, L, 4, generator=g), torch.rand(4, generator=g), torch.rand(b, Ld, 4, generator=g)]
        xs = [x.requires_grad_() for x in xs]
        out = compiled(*xs)
        x64 = [x.detach().double().requires_grad_() for x in xs]
        ref = fn(*x64)
        got = torch.autograd.grad(out[0].sum() + out[1].sum(), xs)
        want = torch.autograd.grad(ref[0].sum() + ref[1].sum(), x64)
        for o, r in [*zip(out, ref), *zip(got, want)]:
            assert rel_err(o, r) < 1e-5, str(rep)
    assert len(rep.graphs) >= 3 and not rep.fallbacks, str(rep)
    assert all(gr.regions for gr in rep.graphs), str(rep)


def test_another_length_is_another_trace_and_says_so(caplog):
    """Each new length of an unrolled loop is another Dynamo trace: said once, at the second
    length, with what to do (scan, or a few padded lengths); not again at a third length, and
    not for a length seen before."""
    import logging
    from ssmc import backend

    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t] * 0.37
            ys.append(h)
        return torch.stack(ys, 1)
    torch._dynamo.reset()
    backend._LENGTHS.clear()
    compiled = torch.compile(fn, backend="ssmc")
    g = torch.Generator().manual_seed(44)
    said = []
    for L in (6, 6, 9, 11, 6):
        x, a = torch.randn(2, L, 3, generator=g), torch.rand(3, generator=g)
        with caplog.at_level(logging.WARNING, logger="ssmc"):
            caplog.clear()
            assert rel_err(compiled(x, a), fn(x.double(), a.double())) < 1e-6
        said.append([r.getMessage() for r in caplog.records if "captured again for another length" in r.getMessage()])
        if L == 9:          # and in the report, as a note
            assert any("captured again" in m for m in backend.LAST_REPORT.graphs[-1].log), str(backend.LAST_REPORT)
    assert [len(m) for m in said] == [0, 0, 1, 0, 0], said
    assert "[6, 9]" in said[2][0] and "torch._higher_order_ops.scan" in said[2][0]


def test_torch_compile_mode_goes_to_inductor():
    """``torch.compile(..., backend="ssmc", mode=...)``: the mode is Inductor's, for the graph
    outside the regions (without CUDA graphs), said in the report; an unknown mode is a clear
    error naming it (before: "unknown option(s) ['mode']")."""
    from ssmc import backend
    from torch._dynamo.exc import BackendCompilerFailed
    x, a = torch.randn(2, 6, 3), torch.rand(3)
    torch._dynamo.reset()
    out = torch.compile(_decay_loop, backend="ssmc", mode="max-autotune")(x, a, torch.rand(2, 6, 3))
    assert out[0].shape == x.shape
    assert any("mode='max-autotune' is Inductor's" in m for g in backend.LAST_REPORT.graphs for m in g.log), \
        str(backend.LAST_REPORT)
    rep = ssmc.Report()        # with Inductor running the rest (forced here; the default on a GPU)
    torch._dynamo.reset()
    dt = torch.rand(2, 6, 3)
    fn = torch.compile(_decay_loop, backend=lambda gm, ex: ssmc.ssmc_backend(
        gm, ex, options={"rest": "inductor"}, mode="max-autotune-no-cudagraphs", _report=rep))
    for o, r in zip(fn(x, a, dt), _decay_loop(x.double(), a.double(), dt.double())):
        assert rel_err(o, r) < 1e-6
    assert rep.regions and any("coordinate_descent_tuning" in m for m in rep.graphs[0].log), str(rep)
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match="mode='fastest'"):
        torch.compile(_decay_loop, backend="ssmc", mode="fastest")(x, a, dt)


def test_vmapped_code_beside_a_region():
    """Dynamo inlines torch.vmap as level pushes and pops that nothing reads: lowering a region
    in the same graph keeps them (swept as dead code, the vmapped ops ran outside any level)."""
    def fn(x, a, w):
        y = torch.vmap(lambda r: r * w + r.sin())(x)
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + y[:, t]
            out.append(h)
        return torch.stack(out, 1)
    ins = (torch.randn(2, 7, 3), torch.rand(2, 7, 3), torch.randn(7, 3))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1, str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


@pytest.mark.parametrize("rest,device", [("eager", "cpu"), ("inductor", "cpu"),
                                         pytest.param("inductor", "cuda", marks=pytest.mark.gpu)])
def test_loop_in_checkpointed_code(rest, device):
    """torch.utils.checkpoint reaches the backend as a node calling a subgraph: the loop inside
    is compiled there (its own graph in the report), values and gradients equal eager's."""
    from torch.utils.checkpoint import checkpoint

    def scan(x, a):
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = a[:, t] * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)

    def fn(x, a):
        y = checkpoint(scan, x.sin(), a, use_reentrant=False)
        return checkpoint(scan, y, a, use_reentrant=False) * 2     # the same body again
    g = torch.Generator().manual_seed(70)
    x, a = (v.to(device).requires_grad_() for v in (torch.randn(2, 6, 3, generator=g), torch.rand(2, 6, 3, generator=g)))
    out, rep = ssmc_run(fn, [x, a], rest=rest)
    bodies = [g for g in rep.graphs if g.within]
    assert len(rep.regions) == len(bodies) >= 1 and "checkpointed body" in str(rep), str(rep)
    got = torch.autograd.grad(out.sum(), [x, a])
    x64, a64 = (v.detach().double().requires_grad_() for v in (x, a))
    ref = fn(x64, a64)
    want = torch.autograd.grad(ref.sum(), [x64, a64])
    assert rel_err(out, ref) < TOL[torch.float32]
    assert all(rel_err(p, q) < TOL[torch.float32] for p, q in zip(got, want))


def test_checkpointed_body_that_fails_runs_as_captured(monkeypatch):
    """A body whose compile raises after changing it runs as Dynamo captured it, the reason in
    the report."""
    import ssmc.backend as backend
    from torch.utils.checkpoint import checkpoint
    real = backend._compile

    def broken(gm, *args):
        if hasattr(gm, "wrap_body_0"):          # the outer graph
            return real(gm, *args)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = ((None,),)
        gm.recompile()
        raise RuntimeError("boom")
    monkeypatch.setattr(backend, "_compile", broken)

    def fn(x, a):
        return checkpoint(lambda x, a: a * x.cos(), x, a, use_reentrant=False) + 1
    x, a = torch.randn(2, 3), torch.rand(2, 3)
    out, rep = ssmc_run(fn, [x, a])
    assert any("the body runs as captured: RuntimeError: boom" in why for _, why in rep.fallbacks), str(rep)
    assert torch.allclose(out, fn(x, a))


def test_a_rewrite_that_breaks_the_graph_with_no_region_left_falls_back(monkeypatch):
    """The passes rewrite the captured graph before they know whether a loop is taken (in-place
    updates as values). Where no region is left, the rewritten graph is shape-checked first: a
    rewrite that broke it (poisoned here: a reshape that cannot be) falls back to the graph as
    captured, with the reason, instead of failing when the model runs."""
    import ssmc.passes.reroll as reroll_mod

    def poison(gm):
        ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(ph):
            gm.graph.call_function(torch.reshape, (ph, (-7,)))
        gm.recompile()
        return 1

    def elman(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = torch.tanh(a * h + x[:, t])
            ys.append(h)
        return torch.stack(ys, 1)
    monkeypatch.setattr(reroll_mod, "functionalize_updates", poison)
    g = torch.Generator().manual_seed(45)
    x, a = torch.randn(2, 5, 3, generator=g), torch.rand(3, generator=g)
    rep = ssmc.Report()
    torch._dynamo.reset()
    out = torch.compile(elman, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep))(x, a)
    assert rel_err(out, elman(x.double(), a.double())) < 1e-6
    assert not rep.regions and any("internal error, graph runs as captured" in why for _, why in rep.fallbacks), str(rep)


def _tanh_loop(x, a):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.tanh(a * h + x[:, t])      # not linear: the loop runs as written
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("steps, opts, rest", [(200, {"rest_max_nodes": 500}, "eager"),
                                                (200, {"rest_max_nodes": 0}, "inductor"),
                                                (200, {"rest_max_nodes": 500, "rest": "inductor"}, "inductor"),
                                                (20, {"rest_max_nodes": 500}, "inductor")])
def test_long_loop_running_as_written_skips_inductor(monkeypatch, steps, opts, rest):
    """rest="auto" where it means Inductor (a GPU, simulated): a graph still holding a loop that
    runs as written and over rest_max_nodes nodes runs eagerly, with the reason in the report;
    a smaller graph, rest_max_nodes=0 or rest="inductor" asked for still goes to Inductor."""
    from ssmc import backend as Bk
    from ssmc.options import Options
    monkeypatch.setattr(Options, "rest_for", lambda self, device: "inductor" if self.rest == "auto" else self.rest)
    compiled = []
    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx",
                        lambda gm, ins, **kw: compiled.append(len(gm.graph.nodes)) or gm.forward)
    torch._dynamo.reset()
    x, a = torch.randn(2, steps, 3), torch.rand(3)
    out = torch.compile(_tanh_loop, backend="ssmc", options=opts)(x, a)
    assert rel_err(out, _tanh_loop(x, a)) == 0
    g = Bk.LAST_REPORT.graphs[-1]
    assert g.fallbacks and not g.regions
    assert g.rest == rest
    assert bool(compiled) == (rest == "inductor")
    said = [m for m in g.log if "rest_max_nodes" in m]
    assert bool(said) == (rest == "eager")
    if said:
        assert f"{g.nodes_out} nodes" in said[0] and "{'rest': 'inductor'}" in said[0]


def test_rest_max_nodes_is_checked():
    from ssmc.options import make_options
    for bad in (-1, 2.5, "many", True):
        with pytest.raises(ValueError, match="rest_max_nodes"):
            make_options({"rest_max_nodes": bad})
    assert make_options({"rest_max_nodes": 0}).rest_max_nodes == 0


def test_the_loop_search_stops_at_its_time_budget(monkeypatch):
    """A graph whose loop search runs past reroll.SEARCH_SECONDS (minutes on graphs of tens of
    thousands of nodes with long steps) keeps what it found and runs the rest as written, saying so."""
    import ssmc.passes.reroll as R
    monkeypatch.setattr(R, "SEARCH_SECONDS", 0.0)

    def ema(x):
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)

    x = torch.randn(2, 12, 3, dtype=torch.float64)
    torch._dynamo.reset()
    rep = ssmc.explain(ema, x)
    assert not rep.regions
    assert any("stopped after 0 s" in why for _, why in rep.fallbacks), str(rep)
    torch._dynamo.reset()
    assert torch.allclose(torch.compile(ema, backend="ssmc")(x), ema(x))


def test_a_float_hyperparameter_that_changes_between_calls():
    """`decay` passed as a Python float that changes: Dynamo recompiles with a symbolic float,
    which goes into the region as a 0-d tensor (an internal error made the loop run as written);
    `t / L` with a symbolic length is a table of t."""
    def ramp(x):
        h, ys = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = (t / x.shape[1]) * h + x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(2, 6, 4, generator=g)
    outs, reps = compile_per_call(P.ema, [(x, 0.9), (x, 0.5), (x, 0.1)])
    for o, d in zip(outs, (0.9, 0.5, 0.1)):
        assert rel_err(o, P.ema(x.double(), d)) < 1e-6
    assert all(len(r.regions) == 1 and not r.fallbacks for r in reps), [str(r) for r in reps]
    xs = [torch.randn(2, L, 3, generator=g) for L in (6, 8)]
    outs, reps = compile_per_call(ramp, [(v,) for v in xs])
    for o, v in zip(outs, xs):
        assert rel_err(o, ramp(v.double())) < 1e-6
    assert all(len(r.regions) == 1 and not r.fallbacks for r in reps), [str(r) for r in reps]


@pytest.mark.parametrize("dt", [torch.int64, torch.int32, torch.uint8])
def test_integer_tensors_read_by_the_recurrence(dt):
    """An integer tensor as the drive (a token id), the decay or the initial state: eager's
    arithmetic promotes it to the float state's dtype; the region reads it cast to that dtype
    (its input check raised on the integer tensor at the first call)."""
    def drive(a, tok):
        h, ys = torch.zeros(a.shape[0], a.shape[2], dtype=a.dtype), []
        for t in range(a.shape[1]):
            h = a[:, t] * h + tok[:, t, None]
            ys.append(h)
        return torch.stack(ys, 1)

    def decay(k, v, h0):
        h, ys = h0, []
        for t in range(v.shape[1]):
            h = k[:, t] * h + v[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(4)
    ints = lambda *s: torch.randint(0, 3, s, generator=g).to(dt)      # noqa: E731
    for fn, args in ((drive, (torch.rand(2, 7, 3, generator=g), ints(2, 7))),
                     (decay, (ints(2, 7, 3), torch.randn(2, 7, 3, generator=g), ints(2, 3)))):
        out, rep = ssmc_run(fn, args)
        assert len(rep.regions) == 1, str(rep)
        want = fn(*args)
        assert out.dtype == want.dtype and torch.allclose(out, want, rtol=1e-5, atol=1e-5)


def test_integer_arithmetic_stays_in_its_type():
    """`a * h + (-v) + v` with v uint8: eager negates in uint8 (wraps: -1 is 255) before adding to
    the float; the drive regrouped as one step value `(-v) + v` would wrap to 0, and the region
    would compute in float. Such loops run as written, with the reason."""
    def fn(a, v):
        h, out = torch.zeros(a.shape[0], a.shape[2]), []
        for t in range(a.shape[1]):
            h = a[:, t] * h + (-v[:, t]) + v[:, t]
            out.append(h)
        return torch.stack(out, 1)
    a = torch.full((1, 4, 3), 0.5)
    for v in (torch.tensor([1, 2, 200], dtype=torch.uint8).repeat(1, 4, 1),
              torch.tensor([-128, 127, 100], dtype=torch.int8).repeat(1, 4, 1)):
        got, rep = ssmc_run(fn, (a, v))
        assert torch.equal(got, fn(a, v)), str(rep)
        assert any("integer" in why for _, why in rep.fallbacks) or any(
            "integer" in " ".join(r.notes) for r in rep.regions), str(rep)


def test_bitwise_and_of_masks_is_no_write():
    """`done[:, t] & valid[:, t]` (operator.and_): a name ending in `_` was taken for an in-place
    write of `done` (the loop ran as written)."""
    def fn(x, a, done, valid):
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            keep = ~(done[:, t] & valid[:, t])
            h = torch.where(keep[:, None], a[:, t] * h, torch.zeros_like(h)) + x[:, t]
            out.append(h)
        return torch.stack(out, 1)
    g = torch.Generator().manual_seed(6)
    x, a = torch.randn(2, 7, 3, generator=g), torch.rand(2, 7, 3, generator=g)
    done, valid = torch.rand(2, 7, generator=g) > 0.7, torch.rand(2, 7, generator=g) > 0.3
    got, rep = ssmc_run(fn, (x, a, done, valid))
    assert len(rep.regions) == 1, str(rep)
    assert rel_err(got, fn(x.double(), a.double(), done, valid)) < 1e-6


def test_tables_of_symbolic_numbers_in_float64():
    """`1 - beta ** (t + 1)` with a symbolic beta in a float64 model: the table of the steps'
    numbers was float32 (1e-7 off); Python computes them in double."""
    def fn(x, beta: float):
        m, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            m = beta * m + (1 - beta) * x[:, t]
            out.append(m / (1 - beta ** (t + 1)))
        return torch.stack(out, 1)
    x = torch.randn(2, 6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    betas = (0.9, 0.8123456789, 0.7123456789)
    outs, reps = compile_per_call(fn, [(x, b) for b in betas])
    for o, b in zip(outs, betas):
        assert rel_err(o, fn(x, b)) < 1e-12
    assert all(len(r.regions) == 1 for r in reps), [str(r) for r in reps]


def test_bias_correction_by_a_symbolic_float():
    """An EMA with Adam's bias correction 1 - beta ** (t + 1), beta a float that changes between
    calls: Dynamo records beta's `.item()` and `1 - beta` once, inside the first step, which left
    the first step with two nodes more than the others (the loop ran as written). They are moved
    before the loop; `beta ** (t + 1)`, one a step, stays the steps' own (a table)."""
    def ema_bc(x, beta: float):
        m, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            m = beta * m + (1 - beta) * x[:, t]
            out.append(m / (1 - beta ** (t + 1)))
        return torch.stack(out, 1)
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(3))
    betas = (0.9, 0.5, 0.99)
    outs, reps = compile_per_call(ema_bc, [(x, b) for b in betas])
    for o, b in zip(outs, betas):
        assert rel_err(o, ema_bc(x.double(), b)) < 1e-5           # 1 / (1 - 0.99): fp32 roundings x 100
    assert all(len(r.regions) == 1 and not r.fallbacks for r in reps), [str(r) for r in reps]


def test_a_number_read_from_an_input_written_before_it():
    """`.item()` of an input the graph writes first (a step counter bumped in place) is not moved
    before the write when scalar arithmetic is moved ahead of the loop."""
    def fn(x, step):
        step += 1
        beta = step.item() * 0.1
        m, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            m = beta * m + x[:, t]
            out.append(m)
        return torch.stack(out, 1)
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(5))
    s_eager, s_ssmc = torch.tensor(2.0), torch.tensor(2.0)
    want = fn(x, s_eager)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got, rep = ssmc_run(fn, (x, s_ssmc))
    assert rel_err(got, want) < 1e-6 and s_ssmc.item() == s_eager.item() == 3.0, str(rep)


def test_coupled_states_under_a_symbolic_batch_are_declined_with_the_reason():
    """A second-order recurrence recompiled for another batch: stacking the states under a
    symbolic size is declined for that loop, with the reason (the generated graph named an
    undefined size: an internal error, the whole graph as captured)."""
    def fn(x, a1, a2):
        h, hp, ys = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h, hp = a1 * h + a2 * hp + x[:, t], h
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(43)
    a1, a2 = 0.5 * torch.rand(3, generator=g), 0.3 * torch.rand(3, generator=g)
    calls = [(torch.randn(b, 6, 3, generator=g), a1, a2) for b in (2, 3)]
    outs, reps = compile_per_call(fn, calls)
    for o, args in zip(outs, calls):
        assert rel_err(o, fn(*[v.double() for v in args])) < 1e-6
    assert len(reps[0].regions) == 1
    assert not any("internal error" in why for r in reps for _, why in r.fallbacks), [str(r) for r in reps]


def test_a_map_over_another_maps_results():
    """Two maps over the steps, the second reading the first's stacked results (SRU's
    `u[..., 1] + b[0]`, `u[..., 2] + b[1]`, then sigmoids): the first is vmapped, the second
    runs as written (it read the stack the first replaced: an internal error)."""
    def fn(u, b):
        u1 = u[..., 1] + b[0]
        u2 = u[..., 2] + b[1]
        return u1.sigmoid() * u2.sigmoid()
    g = torch.Generator().manual_seed(44)
    ins = (torch.randn(7, 2, 4, 3, generator=g), torch.randn(2, 4, generator=g))
    out, rep = ssmc_run(fn, ins)
    assert not any("internal error" in why for _, why in rep.fallbacks), str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-6


def test_dropout_in_eval_mode_is_the_identity():
    """`nn.Dropout` on the state in eval mode is x (the loop was declined: "the state goes
    through dropout"); in train mode it stays declined and runs as written."""
    class RNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x, a):
            h, ys = x.new_zeros(x.shape[0], x.shape[2]), []
            for t in range(x.shape[1]):
                h = self.drop(a[:, t] * h + x[:, t])
                ys.append(h)
            return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(45)
    ins = (torch.randn(2, 6, 4, generator=g), torch.rand(2, 6, 4, generator=g))
    m = RNN().eval()
    out, rep = ssmc_run(m, ins)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    assert rel_err(out, m(*ins)) < 1e-6
    _, rep = ssmc_run(m.train(), ins)
    assert not rep.regions and any("dropout" in why for _, why in rep.fallbacks), str(rep)


def test_a_gradient_of_a_gradient_is_a_clear_error():
    """create_graph=True then differentiating the gradient: an error that says ssmc does not
    support it (it was torch's "no autograd formula was registered")."""
    g = torch.Generator().manual_seed(46)
    x = torch.randn(2, 6, 3, generator=g, requires_grad=True)
    a = torch.rand(2, 6, 3, generator=g, requires_grad=True)
    y, _ = ssmc_run(_ema, (x, a))
    (ga,) = torch.autograd.grad(y.sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="gradient of a gradient"):
        torch.autograd.grad(ga.pow(2).sum(), x)


def _ema(x, a):
    h, ys = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)
