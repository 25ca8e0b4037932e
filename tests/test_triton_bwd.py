"""Generated Triton backward kernels (ssmc/targets/triton_bwd.py).

- gradcheck in float64 through the region op (forward and backward both generated Triton
  kernels under TRITON_INTERPRET=1) on a tiny shape;
- gradients of every input for Mamba-1 (stack, final state, initial state), Mamba-2 with h0,
  S4D and the gated recurrence: end to end through torch.compile against eager autograd of the
  naive loop (float64), and the kernel against the reference adjoint (ssmc.autodiff) in float64;
- deterministic mode (no atomics: per-program slots summed by torch): bitwise-equal reruns;
- what the kernel declines runs the reference with the reason recorded; inputs broadcast at run
  time, gradients not needed, an output without a gradient; no scratch of size (b, d, n, L);
- compile-only of the backward kernels for sm_80 and sm_90 (no GPU needed);
- on a GPU (marker gpu): b8 d1536 n16 L2048 in fp32 and bf16 against a float64 reference.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import programs as P
import ssmc
from conftest import as_tuple, rel_err, ssmc_run
from ssmc import ir
from ssmc.ir import Const, InputSpec, Load, Op, OutputSpec, Reduce, Region, State
from ssmc.runtime.op import lookup

triton = pytest.importorskip("triton")
T = pytest.importorskip("ssmc.targets.triton")
B = pytest.importorskip("ssmc.targets.triton_bwd")


@pytest.fixture
def interp(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def captured(fn, inputs, **options):
    """Compile fn with target "triton", run it once; (region, the op's own inputs, kernel,
    region key, outputs)."""
    import ssmc.runtime.op as op
    seen = {}
    orig = op.check_inputs

    def spy(entry, xs):
        seen["inputs"] = [x.detach().clone() for x in xs]
        return orig(entry, xs)
    op.check_inputs = spy
    try:
        out, rep = ssmc_run(fn, inputs, target="triton", **options)
    finally:
        op.check_inputs = orig
    assert len(rep.regions) == 1 and rep.regions[0].target == "triton", str(rep)
    entry = lookup(rep.regions[0].key)
    return rep.regions[0].ir, seen["inputs"], entry.kernel, rep.regions[0].key, as_tuple(out)


def fresh_grads(outs, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]


def assert_kernel_ran(kern):
    assert isinstance(kern.bwd, B.BackwardKernel), kern.bwd
    assert kern.bwd_fallback is None, kern.bwd_fallback
    assert kern.bwd.config is not None


def check_against_adjoint(kern, region, xs, tol=1e-10, needs=None, grads=None):
    """The kernel's gradients in float64 equal the reference adjoint's."""
    from ssmc.targets.reference import ReferenceKernel, adjoint_run
    xs = [x.double() if x.is_floating_point() else x for x in xs]
    if region.init is not None:                         # a nonzero initial state
        xs[region.init] = torch.randn(xs[region.init].shape, generator=torch.Generator().manual_seed(3),
                                      dtype=torch.float64)
    outs = ReferenceKernel(region).forward(xs)
    grads = fresh_grads(outs) if grads is None else grads
    needs = [x.is_floating_point() for x in xs] if needs is None else needs
    got = kern.backward(xs, grads, needs)
    assert_kernel_ran(kern)
    want = adjoint_run(region, xs, grads, needs, chunk=3)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"input {i} got a gradient it did not ask for"
            continue
        assert g.shape == xs[i].shape and g.dtype == xs[i].dtype
        err = rel_err(g, w)
        assert err <= tol, f"input {i} ({region.inputs[i].name}): rel err {err:.3g}"
    return got


# -- gradcheck through the region op ----------------------------------------------------------------

def test_gradcheck_through_the_region_op(interp):
    """Forward and backward of the op are both generated kernels; float64, b2 L5 d2 n3."""
    x, dt, A, Bm, C, *_ = P.mamba1_inputs(b=2, L=5, d=2, n=3, dtype=torch.float64, seed=1)
    h0 = torch.randn(2, 2, 3, dtype=torch.float64)
    region, xs, kern, key, _ = captured(P.mamba1_h0(), (x, dt.abs(), A, Bm, C, h0))
    assert region.init is not None and all(x.dtype == torch.float64 for x in xs)
    xs = [x.detach().requires_grad_(True) for x in xs]

    def f(*args):
        return tuple(torch.ops.ssmc.region(key, list(args)))
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True,
                                    check_undefined_grad=False)   # that path: test_broadcast_...

    assert_kernel_ran(kern)
    assert kern.fallback is None


# -- every input's gradient, every program ------------------------------------------------------------

def _h0_case():
    x, dt, A, Bm, C, *_ = P.mamba1_inputs(b=2, L=7, d=5, n=3, seed=23)
    return x, dt.abs(), A, Bm, C, torch.randn(2, 5, 3)


CASES = {
    # L not a multiple of the chunk (4) and d not of the block (4): partial chunk, masked lanes
    "mamba1": (P.mamba1("stack"), lambda: P.mamba1_inputs(b=2, L=7, d=5, n=3, seed=21)),
    "mamba1_final_state": (P.mamba1("final"), lambda: P.mamba1_inputs(b=2, L=6, d=4, n=3, seed=22)),
    "mamba1_h0": (P.mamba1_h0(), _h0_case),
    "mamba2_h0": (P.mamba2("final"), lambda: P.mamba2_inputs(b=2, L=6, H=2, P=3, N=3, seed=25, with_h0=True)),
    "s4d": (P.s4d(), lambda: P.s4d_inputs(b=2, L=7, d=3, n=3, seed=26)),
    "gated": (P.gated(), lambda: P.gated_inputs(b=2, L=7, d=5, seed=27)),
    # sizes of 1, which Dynamo specialises and labels no state axis with: batch 1 (inference),
    # d_state 1 (the readout's sum over it traced as none), one head and batch 1 together
    "mamba1_batch1": (P.mamba1("final"), lambda: P.mamba1_inputs(b=1, L=7, d=5, n=3, seed=30)),
    "mamba1_dstate1": (P.mamba1("stack"), lambda: P.mamba1_inputs(b=2, L=7, d=5, n=1, seed=31)),
    "mamba2_batch1_heads1": (P.mamba2("final"), lambda: P.mamba2_inputs(b=1, L=6, H=1, P=3, N=3, seed=32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_eager_and_the_reference_adjoint(case, interp):
    fn, make = CASES[case]
    inputs = make()
    outs = as_tuple(fn(*inputs))
    cots = fresh_grads([o.double() for o in outs], seed=99)
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    # torch.compile (training through AOTAutograd) with the generated backward, fp32
    region, rin, kern, _, out = captured(fn, xs)
    loss = sum((o.double() * c).sum() for o, c in zip(out, cots))
    got = torch.autograd.grad(loss, xs)
    assert_kernel_ran(kern)
    # eager autograd of the naive loop in float64
    x64 = [x.detach().double().requires_grad_(True) for x in inputs]
    loss = sum((o * c).sum() for o, c in zip(as_tuple(fn(*x64)), cots))
    want = torch.autograd.grad(loss, x64)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-5, f"input {i}: rel err {rel_err(a, b):.3g}"
    # the kernel itself against the reference adjoint, float64
    check_against_adjoint(kern, region, rin)


SEQ_CASES = {
    "mamba1_n3": CASES["mamba1"],                  # n 3 in BLOCK_N 4: masked state lanes
    "mamba1_final_state": CASES["mamba1_final_state"],
    "mamba1_h0": CASES["mamba1_h0"],
    "mamba1_n8": (P.mamba1("stack"), lambda: P.mamba1_inputs(b=2, L=9, d=5, n=8, seed=28)),
    # whole chunks, channel blocks and state tiles: the masks are constants (EVEN_L, EVEN_D, EVEN_N)
    "mamba1_even": (P.mamba1("stack"), lambda: P.mamba1_inputs(b=2, L=8, d=8, n=8, seed=29)),
    "s4d": CASES["s4d"],
}


@pytest.mark.parametrize("variant", ["seq2", "seq4", "seq4/SEG2", "seq2/SEG3"])
@pytest.mark.parametrize("case", sorted(SEQ_CASES))
def test_seq_backward_matches_the_reference_adjoint(case, variant, interp, monkeypatch):
    """The seq layout's backward (S state elements a lane, S copies of the per-index code, the
    chunk's steps in a thread): every input's gradient against the reference adjoint in
    float64, poisoned buffers, a partial last chunk and masked channel lanes; with SEG > 1 a
    checkpoint every SEG chunks and each segment recomputed (a partial last segment too)."""
    fn, make = SEQ_CASES[case]
    region, rin, kern, _, _ = captured(fn, make())
    bp = B.make_bwd_plan(region)
    assert B.seq_bwd_declines(region, bp) is None
    table = dict(B.load_configs())
    name, _, seg = variant.partition("/SEG")
    cfg = {"variant": name, "BLOCK_D": 4, "CHUNK": 2 if seg else 4, "num_warps": 1, "num_stages": 1}
    if seg:
        cfg["SEG"] = int(seg)
    table["interpreter"] = [cfg]
    monkeypatch.setattr(B, "load_configs", lambda: table)
    orig = torch.empty

    def poisoned(*a, **k):                               # every buffer the kernel must fill: NaN
        x = orig(*a, **k)
        return x.fill_(float("nan")) if x.is_floating_point() else x
    monkeypatch.setattr(B.torch, "empty", poisoned)
    check_against_adjoint(kern, region, rin)
    assert kern.bwd.config == cfg


def _checkpoint_tables(monkeypatch, fwd="seq2", chunk=2):
    """Tiny shapes: checkpoints every 4 steps, a forward seq config that writes them and a
    backward seq config that reads them (CHUNK 2 * SEG 2)."""
    monkeypatch.setattr(T, "CKPT_EVERY", 4)
    ft = dict(T.load_configs())
    ft["interpreter"] = [{"variant": fwd, "BLOCK_D": 2, "CHUNK": chunk, "num_warps": 1, "num_stages": 1}]
    monkeypatch.setattr(T, "load_configs", lambda: ft)
    bt = dict(B.load_configs())
    bt["interpreter"] = [{"variant": "seq2", "BLOCK_D": 4, "CHUNK": 2, "SEG": 2, "num_warps": 1, "num_stages": 1}]
    monkeypatch.setattr(B, "load_configs", lambda: bt)


@pytest.mark.parametrize("fwd", ["seq2", "seq4"])
@pytest.mark.parametrize("case", ["mamba1_n3", "mamba1_final_state", "mamba1_h0", "s4d"])
def test_training_forward_checkpoints_feed_the_seq_backward(case, fwd, interp, monkeypatch):
    """A training forward (forward_train) writes the state every CKPT_EVERY steps and sets the
    flag; the seq backward whose CHUNK * SEG is that interval reads them instead of running the
    forward recurrence: the same checkpoints its own pass writes (another BLOCK_D and S than
    the forward's), float64 gradients equal to the reference adjoint; poisoned checkpoints
    with the flag set reach the gradients (they are read), with the flag clear they do not."""
    from ssmc.targets.reference import adjoint_run
    fn, make = SEQ_CASES[case]
    region, rin, kern, _, _ = captured(fn, make())
    _checkpoint_tables(monkeypatch, fwd, chunk=4 if fwd == "seq4" else 2)
    xs = [x.double() if x.is_floating_point() else x for x in rin]
    if region.init is not None:
        xs[region.init] = torch.randn(xs[region.init].shape, generator=torch.Generator().manual_seed(3),
                                      dtype=torch.float64)
    (nck,), dt = kern.residual_specs(xs)[0]
    outs, res = kern.forward_train(xs)
    assert res[1].item() == 1 and res[0].shape == (nck,) and res[0].dtype == dt == torch.float64
    assert kern.config["variant"] == fwd
    for o, w in zip(outs, kern._reference().forward(xs)):
        assert rel_err(o, w) < 1e-12
    again, res2 = kern.forward_train(xs)                 # the prepared launch: fresh tensors, same values
    assert len(kern._train_replays) == 1 and res2[0] is not res[0] and res2[1].item() == 1
    assert torch.equal(res2[0], res[0]) and all(torch.equal(a, b) for a, b in zip(again, outs))
    grads = fresh_grads(outs)
    needs = [x.is_floating_point() for x in xs]
    want = adjoint_run(region, xs, grads, needs, chunk=3)

    def run(ck, flag):
        got = kern.backward(xs, grads, needs, [ck, flag])
        assert_kernel_ran(kern)
        assert kern.bwd.given
        return got
    for g, w in zip(run(*res), want):
        if w is not None:
            assert rel_err(g, w) < 1e-10
    assert "read the forward's checkpoints (every 4 steps)" in kern.backward_note()
    own = torch.full_like(res[0], float("nan"))          # flag clear: the backward fills ck itself
    for g, w in zip(run(own, torch.zeros_like(res[1])), want):
        if w is not None:
            assert rel_err(g, w) < 1e-10
    assert torch.allclose(own, res[0], rtol=1e-12, atol=1e-14)
    got = run(torch.full_like(res[0], float("nan")), res[1])
    assert any(g is not None and torch.isnan(g).any() for g in got)


def test_training_through_torch_compile_keeps_the_forward_checkpoints(interp, monkeypatch):
    """torch.compile training, the graph run eagerly and through Inductor (AOTAutograd traces
    ``region_train`` and saves its residual): the forward writes the checkpoints, the backward
    reads them, gradients of every input equal eager autograd of the naive loop in float64.
    Inference calls keep nothing (the plain region op)."""
    import ssmc.runtime.op as op
    _checkpoint_tables(monkeypatch)
    calls = []
    orig = op._forward_train
    monkeypatch.setattr(op, "_forward_train", lambda k, i: (calls.append(k), orig(k, i))[1])
    fn = P.mamba1("stack")
    inputs = P.mamba1_inputs(b=2, L=9, d=5, n=3, seed=21)
    x64 = [x.detach().double().requires_grad_(True) for x in inputs]
    loss = sum((o ** 2).sum() for o in as_tuple(fn(*x64)))
    want = torch.autograd.grad(loss, x64)
    for rest in ("eager", "inductor"):
        xs = [x.detach().clone().requires_grad_(True) for x in inputs]
        n0 = len(calls)
        out, rep = ssmc_run(fn, xs, target="triton", rest=rest)
        assert rep.graphs[0].rest == rest and len(calls) == n0 + 1
        loss = sum((o.double() ** 2).sum() for o in as_tuple(out))
        got = torch.autograd.grad(loss, xs)
        kern = lookup(rep.regions[0].key).kernel
        assert kern.bwd.given, kern.backward_note()
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_err(a, b) < 1e-5, f"{rest}: input {i}: rel err {rel_err(a, b):.3g}"
    with torch.no_grad():
        torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, options={"target": "triton"}))(*inputs)
    assert len(calls) == 2


def test_residual_only_where_a_seq_backward_reads_it(interp):
    """No residual for a region the seq kernels decline (no register axis: the gated
    recurrence); Mamba-1's: the state every CKPT_EVERY steps of every (b, d, n padded)."""
    _, rin, kern, _, _ = captured(P.gated(), P.gated_inputs(b=2, L=7, d=5, seed=27))
    assert kern.residual_specs(rin) == []
    _, rin, kern, _, _ = captured(P.mamba1("stack"), P.mamba1_inputs(b=2, L=70, d=5, n=3, seed=21))
    assert kern.residual_specs(rin) == [((2 * 2 * 5 * 4,), torch.float32), ((1,), torch.int32)]


def _mamba1_backward_call(b, L, d, n):
    """The backward kernel of Mamba-1 (captured at L6) and a call of it at (b, L, d, n)."""
    from test_triton import region_inputs
    fn = P.mamba1("stack")
    region, _, kern, _, _ = captured(fn, P.mamba1_inputs(b=2, L=6, d=d, n=n, seed=5))
    xs = region_inputs(region, fn, P.mamba1_inputs(b=b, L=L, d=d, n=n, seed=5))
    call = B._Call(xs, fresh_grads(kern._reference().forward(xs)), [True] * len(xs))
    return B.backward_kernel(kern), call


def test_seq_backward_checkpoints_every_seg_chunks(interp):
    """SEG > 1: the state every SEG chunks, plus one segment's chunk-start states a program."""
    b, L, d, n = 2, 64, 8, 4
    bk, call = _mamba1_backward_call(b, L, d, n)
    tile = (b * d // 4) * 4 * 4                                     # programs x BLOCK_D x BLOCK_N
    for seg, cks, sks in ((1, 16, 0), (4, 4, 4), (5, 4, 5)):       # 16 chunks of 4 steps
        cfg = {"variant": "seq2", "BLOCK_D": 4, "CHUNK": 4, "SEG": seg, "num_warps": 1, "num_stages": 1}
        bufs = bk.buffers(call, cfg)
        assert bufs.ck.numel() == cks * tile and bufs.sk.numel() == max(sks * tile, 1)


def test_backward_autotune_keeps_less_memory_within_the_slack(interp, monkeypatch):
    """Among configs within memory_slack of the fastest the autotuner keeps the one with the
    least checkpoint memory (scratch_bytes, as buffers allocates it) and says why; slack 1
    keeps the fastest."""
    bk, call = _mamba1_backward_call(2, 256, 8, 16)             # 64 chunks: 64 tiles, or 4 + 16 at SEG 16
    fast = {"variant": "seq4", "BLOCK_D": 8, "CHUNK": 4, "num_warps": 1, "num_stages": 1}
    lean = {**fast, "SEG": 16}
    slow = {"BLOCK_D": 8, "CHUNK": 2, "num_warps": 2, "num_stages": 1}
    for cfg in (fast, lean, slow):
        bufs = bk.buffers(call, cfg)
        assert bk.scratch_bytes(call, cfg) == 4 * (bufs.ck.numel() + bufs.sk.numel())
    assert bk.scratch_bytes(call, lean) < bk.scratch_bytes(call, fast)
    ms = {str(fast): 1.0, str(lean): 1.08, str(slow): 0.99 * 1.2}
    monkeypatch.setattr(bk, "candidates", lambda call, arch: [fast, lean, slow])
    monkeypatch.setattr(bk, "_time_config", lambda inputs, c, cuda: ms[str(c)])
    monkeypatch.setattr(bk.cache, "get", lambda *a, **k: None)      # no cached pick
    table = dict(bk.table())
    monkeypatch.setattr(bk, "table", lambda: table)
    for slack, want in ((1.1, lean), (1.0, fast), (1.05, fast)):
        table["memory_slack"] = slack
        bk.chosen.clear(), bk.picked.clear()
        assert bk._config(call, 90) == want, slack
        assert bool(bk.picked) == (want is lean)
    bk.chosen.clear()
    table["memory_slack"] = 1.1
    bk._config(call, 90)
    why = next(iter(bk.picked.values()))
    assert "1.080 ms" in why and "1.000 ms" in why and "memory_slack 1.1" in why, why


def test_seq_backward_declines():
    """What the seq backward cannot lay out: no register axis, per-step outputs indexing it."""
    from test_triton import mamba1_states_out, region_of
    gated = region_of(P.gated(), P.gated_inputs(L=7, seed=98))
    assert B.seq_bwd_declines(gated, B.make_bwd_plan(gated)) == "no register axis to loop over"
    per_state = region_of(mamba1_states_out, P.mamba1_inputs(L=5, seed=98))
    assert "indexes the register axis" in B.seq_bwd_declines(per_state, B.make_bwd_plan(per_state))


# -- the plan ---------------------------------------------------------------------------------------------

def test_plan_owned_and_shared_gradients():
    from test_adjoint import region_and_inputs
    r, _ = region_and_inputs(P.mamba1("stack"), P.mamba1_inputs(seed=4))
    bp = B.make_bwd_plan(r)
    names = {g.input: r.inputs[g.input].name.split(" ")[0] for g in bp.grads}
    shared = {names[g.input]: g.missing for g in bp.grads if g.shared}
    owned = sorted(names[g.input] for g in bp.grads if not g.shared)
    assert owned == ["l_dt_", "l_x_", "l_z_"]                   # per (b, t, d): one program each
    assert shared == {"l_a_": ("i0",), "l_bias_": ("i0",), "l_d_": ("i0",),   # over batch
                      "l_b_": ("i1",), "l_c_": ("i1",)}                        # over channels
    assert [g.timed for g in bp.grads if names[g.input] in ("l_a_", "l_d_")] == [False, False]
    assert bp.init_grad                                          # the zeros h0 is an input


def test_scratch_is_one_state_tile_per_chunk(interp):
    """Nothing of size (b, d, n, L): the chunk-start states and gradient-sized buffers only."""
    b, L, d, n = 2, 64, 8, 4
    bk, call = _mamba1_backward_call(b, L, d, n)
    xs = list(call)
    cfg = {"BLOCK_D": 4, "CHUNK": 16, "num_warps": 4, "num_stages": 1}
    bufs = bk.buffers(call, cfg)
    assert bufs.ck.numel() == (L // 16) * (b * d // 4) * 4 * 4       # chunks x programs x tile
    assert bufs.ck.numel() * 16 == b * d * n * L
    for i, buf, slots in bufs.grads:
        assert buf.numel() <= max(xs[i].numel(), 1) * slots < b * d * n * L
    src = bk.source
    scan = src[src.index("_bwd("):src.index("_bwd_seq")] if "_bwd_seq" in src else src[src.index("_bwd("):]
    assert scan.count("tl.store(ck") == 1 and "tl.atomic_add(" in scan
    assert "tl.associative_scan((a, a * direct, one3, zero3)" in src and "reverse=True" in src


# -- deterministic mode ------------------------------------------------------------------------------------

def test_deterministic_mode_is_bitwise_reproducible(interp):
    fn, make = CASES["mamba1_final_state"]
    region, xs, kern, _, _ = captured(fn, make(), deterministic=True)
    bk = B.backward_kernel(kern)
    assert bk.deterministic and kern.options.deterministic
    outs = kern._reference().forward(xs)
    grads = fresh_grads(outs)
    needs = [x.is_floating_point() for x in xs]
    first = kern.backward(xs, grads, needs)
    assert_kernel_ran(kern)
    assert bk.constexprs(B._Call(xs, grads, needs), bk.config)["DETERMINISTIC"] is True
    second = kern.backward(xs, grads, needs)
    for a, b in zip(first, second):
        assert (a is None and b is None) or torch.equal(a, b)
    # the same gradients as the atomics
    _, _, k2, _, _ = captured(fn, make())
    other = k2.backward(xs, grads, needs)
    assert not B.backward_kernel(k2).deterministic
    for a, b in zip(first, other):
        assert (a is None and b is None) or rel_err(a, b) < 1e-6


# -- what is declined, and unusual calls ------------------------------------------------------------------

def _two_patterns_region() -> Region:
    """x is read at [i0, t, i1] by the drive and at [i0, t, 0] by the output: two patterns."""
    X, X0, W = Load(0, ("i0", "t", "i1")), Load(0, ("i0", "t", 0)), Load(1, ("i1",))
    out = OutputSpec("steps", Op("mul", (State(), X0)), ("i0", "t", "i1"), "float32")
    return Region("two", ("i0", "i1"), ((0, 0), (0, 2)), (0, 1),
                  (InputSpec("x", 3, "float32"), InputSpec("w", 1, "float32")),
                  Op("sigmoid", (W,)), Op("mul", (X, W)), (out,))


def _constant_sum_region() -> Region:
    """sum over n of x[b, t] (constant along n) is n * x; the IR adjoint loses the factor n."""
    X, Cn = Load(0, ("i0", "t")), Load(1, ("i0", "t", "i1"))
    out = OutputSpec("steps", Op("add", (Reduce(Op("mul", (State(), Cn)), ("i1",)), Reduce(X, ("i1",)))),
                     ("i0", "t"), "float32")
    return Region("rc", ("i0", "i1"), ((1, 0), (1, 2)), (0, 1),
                  (InputSpec("x", 2, "float32"), InputSpec("c", 3, "float32"), InputSpec("h0", 2, "float32")),
                  Const(0.9), Op("mul", (X, Cn)), (out,), init=2)


def test_declined_regions_run_the_reference_with_the_reason(interp):
    from ssmc.targets.reference import ReferenceKernel
    g = torch.Generator().manual_seed(11)
    for region, shapes, why in [(_two_patterns_region(), [(2, 5, 3), (3,)], "two index patterns"),
                                (_constant_sum_region(), [(2, 5), (2, 5, 3), (2, 3)], "size factor")]:
        assert why in B.make_bwd_plan(region)
        kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
        xs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        outs = ReferenceKernel(region).forward(xs)
        grads = fresh_grads(outs)
        got = kern.backward(xs, grads, [True] * len(xs))
        assert kern.bwd == B.make_bwd_plan(region) and why in kern.bwd_fallback
        want = ReferenceKernel(region).backward_autograd(xs, grads, [True] * len(xs))   # autograd
        for a, b in zip(got, want):
            assert rel_err(a, b) < 1e-10


def test_broadcast_inputs_unneeded_grads_and_a_missing_output_grad(interp):
    fn, make = CASES["mamba1_final_state"]
    region, xs, kern, _, _ = captured(fn, make())
    xs = [x.double() for x in xs]
    names = [s.name.split(" ")[0] for s in region.inputs]
    # D and bias of one element, read along d: broadcast at run time
    for nm in ("l_d_", "l_bias_"):
        xs[names.index(nm)] = xs[names.index(nm)][:1].clone()
    check_against_adjoint(kern, region, xs)
    # only some gradients needed; the per-step output has no gradient (only the final state is used)
    from ssmc.targets.reference import ReferenceKernel
    outs = ReferenceKernel(region).forward(xs)
    grads = fresh_grads(outs)
    steps = next(k for k, o in enumerate(region.outputs) if o.kind == "steps")
    grads[steps] = torch.empty(0, dtype=grads[steps].dtype)
    needs = [nm in ("l_a_", "l_b_", "l_dt_") for nm in names]
    got = check_against_adjoint(kern, region, xs, needs=needs, grads=grads)
    assert [g is not None for g in got] == needs


# -- compile-only for sm_80 / sm_90 ---------------------------------------------------------------------------

@pytest.mark.parametrize("cc, program, deterministic", [(80, "mamba1", False), (90, "mamba1", True),
                                                        (90, "mamba2", False)])
def test_backward_compiles_for_sm80_sm90_without_gpu(cc, program, deterministic, monkeypatch, tmp_path):
    from test_triton import ast_source, region_of
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    build, make = {"mamba1": (lambda: P.mamba1("final"), lambda: P.mamba1_inputs(seed=1)),
                   "mamba2": (lambda: P.mamba2("final"), lambda: P.mamba2_inputs(seed=2, with_h0=True))}[program]
    region = region_of(build(), make())
    bp = B.make_bwd_plan(region)
    opts = ssmc.make_options(cache_dir=str(tmp_path), deterministic=deterministic)
    bk = B.BackwardKernel(region, "chunked_scan", bp, opts, None)
    seq = {i: torch.bfloat16 for i, s in enumerate(region.inputs) if i != region.init and s.ndim >= 3}
    table = B.load_configs()[f"sm_{cc}"]
    cfgs = [table[0]]
    if B.seq_bwd_declines(region, bp) is None:         # the seq layout's backward too
        cfgs.append(next(c for c in table if c.get("variant") == "seq4"))
    for cfg in cfgs:
        fn, sig, cx = bk.signature(cfg, 16, seq)
        assert isinstance(fn, triton.runtime.jit.JITFunction) and "*bf16" in sig.values()
        assert fn.__name__.endswith("_bwd_seq4" if cfg.get("variant") else "_bwd")
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        ptx = ck.asm["ptx"]
        assert f".target sm_{cc}" in ptx and ck.asm.get("cubin")
        atomics = "red.global" in ptx or "atom.global" in ptx
        assert atomics != deterministic                # shared gradients: atomics or slots
    assert program != "mamba1" or len(cfgs) == 2


# -- on a GPU -----------------------------------------------------------------------------------------------------

GPU_PROGRAMS = {
    "mamba1": (lambda: P.mamba1("final"),
               lambda L, dt: P.mamba1_inputs(b=8, L=L, d=1536, n=16, dtype=dt, seed=L)),
    "gated": (P.gated, lambda L, dt: P.gated_inputs(b=8, L=L, d=1536, dtype=dt, seed=L)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(GPU_PROGRAMS))
def test_gpu_gradients(name, dtype, deterministic, monkeypatch, tmp_path):
    """b8 d1536 n16 L2048: every input's gradient against the float64 reference adjoint."""
    from test_triton import region_inputs, region_of
    from ssmc.targets.reference import ReferenceKernel, adjoint_run
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    build, make = GPU_PROGRAMS[name]
    fn = build()
    region = region_of(fn, tuple(x[:2, :8].contiguous() if x.dim() >= 3 else x for x in make(8, dtype)))
    kern = T.TritonTarget().compile(region, "chunked_scan",
                                    ssmc.make_options(cache_dir=str(tmp_path), deterministic=deterministic))
    L = 2048
    xs = region_inputs(region, fn, tuple(x.cuda() for x in make(L, dtype)))
    if region.init is not None:
        xs[region.init] = torch.randn_like(xs[region.init]) * 0.1
    outs, res = kern.forward_train(xs)             # with the checkpoints where a seq backward reads them
    grads = [(torch.randn(o.shape, device="cuda", dtype=torch.float64) / 16).to(o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    got = kern.backward(xs, grads, needs, res)
    torch.cuda.synchronize()
    assert_kernel_ran(kern)
    x64 = [x.double() for x in xs]
    want = adjoint_run(region, x64, [g.double() for g in grads], needs, chunk=256)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        assert g.dtype == xs[i].dtype and torch.isfinite(g).all()
        err = rel_err(g, w)
        assert err <= tol, f"{name} {dtype} input {i} ({region.inputs[i].name}): rel err {err:.3g}, config {kern.bwd.config}"
    if deterministic:
        again = kern.backward(xs, grads, needs, res)
        assert all(a is None or torch.equal(a, b) for a, b in zip(got, again))
    for cfg in kern.bwd.candidates(B._Call(xs, grads, needs), kern.bwd.arch):   # every config
        for residual in ((), res) if res else ((),):
            call = B._Call(xs, grads, needs, residual)
            for i, (g, w) in enumerate(zip(kern.bwd.launch(call, cfg), want)):
                if w is not None:
                    assert rel_err(g, w) <= tol, (f"config {cfg} (forward's checkpoints: {kern.bwd.given}) "
                                                  f"input {i}: rel err {rel_err(g, w):.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_mamba2_gradients(dtype, monkeypatch, tmp_path):
    """Mamba-2 at b8 L4096 h24 p64 n128 with h0, on the chunked SSD forward: every input's
    gradient (h0's too) against the float64 reference adjoint."""
    from test_triton import region_inputs, region_of
    from ssmc.targets.reference import adjoint_run
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = P.mamba2("final")
    shape = dict(H=24, P=64, N=128, with_h0=True)
    region = region_of(fn, P.mamba2_inputs(b=2, L=4, dtype=dtype, seed=3, **shape))
    kern = T.TritonTarget().compile(region, "chunked_ssd", ssmc.make_options(cache_dir=str(tmp_path)))
    xs = region_inputs(region, fn, tuple(x.cuda() for x in P.mamba2_inputs(b=8, L=4096, dtype=dtype, seed=4, **shape)))
    outs = kern.forward(xs)
    grads = [(torch.randn(o.shape, device="cuda", dtype=torch.float64) / 16).to(o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    got = kern.backward(xs, grads, needs)
    torch.cuda.synchronize()
    want = adjoint_run(region, [x.double() for x in xs], [g.double() for g in grads], needs, chunk=256)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    for i, (g, w) in enumerate(zip(got, want)):
        if w is not None:
            assert g is not None and torch.isfinite(g).all()
            err = rel_err(g, w)
            assert err <= tol, f"input {i} ({region.inputs[i].name}): rel err {err:.3g} ({kern.backward_note()})"
    assert "the core map through the Triton kernels" in kern.backward_note(), kern.backward_note()


# -- a CUDA forward borrows the Triton backward ---------------------------------------------------------

def test_cuda_kernels_borrow_the_generated_triton_backward(interp):
    """The CUDA template has no adjoint: the backend lends a CUDA kernel (alone or inside auto's
    measured choice) the Triton backward of the same region, and explain says which ran. When no
    Triton kernel can be made, the torch reference runs and the reason is shown."""
    import types
    from ssmc.backend import _lend_backward
    from ssmc.runtime.autotune import MeasuredChoice
    C = pytest.importorskip("ssmc.targets.cuda")
    from ssmc.targets.reference import adjoint_run
    fn = P.mamba1("final")
    region, xs, _, _, _ = captured(fn, P.mamba1_inputs(b=2, L=7, d=5, n=3, dtype=torch.float64, seed=31))
    opts = ssmc.make_options()
    ctx = types.SimpleNamespace(targets={"triton": T.TritonTarget(), "cuda": C.CudaTarget()})
    outs = T.TritonTarget().compile(region, "chunked_scan", opts).forward(xs)
    grads, needs = fresh_grads(outs), [x.is_floating_point() for x in xs]
    want = adjoint_run(region, xs, grads, needs, chunk=3)

    alone = C.CudaKernel(region, C.plan(region), None)
    assert alone.backward_note() is None
    _lend_backward(alone, None, region, "chunked_scan", ctx, opts)     # compiled on first backward
    rival = T.TritonTarget().compile(region, "chunked_scan", opts)
    paired = C.CudaKernel(region, C.plan(region), None)
    _lend_backward(paired, rival, region, "chunked_scan", ctx, opts)
    _lend_backward(rival, None, region, "chunked_scan", ctx, opts)     # has its own: untouched
    assert not hasattr(rival, "backward_partner")
    for kern in (alone, paired):
        got = kern.backward(xs, grads, needs)
        for i, (g, w) in enumerate(zip(got, want)):
            assert (g is None) == (w is None) and (w is None or rel_err(g, w) <= 1e-10), i
        assert kern.backward_note().startswith("backward: generated Triton kernel"), kern.backward_note()
    assert_kernel_ran(rival)                                           # paired's backward ran in it
    choice = MeasuredChoice(region, {"cuda": paired, "triton": rival}, {}, str(interp))
    assert "cuda: backward: generated Triton kernel" in choice.backward_note()

    broken = types.SimpleNamespace(targets={"triton": types.SimpleNamespace(
        compile=lambda *a: (_ for _ in ()).throw(RuntimeError("no triton here")))})
    ref = C.CudaKernel(region, C.plan(region), None)
    _lend_backward(ref, None, region, "chunked_scan", broken, opts)
    got = ref.backward(xs, grads, needs)
    assert all(w is None or rel_err(g, w) <= 1e-10 for g, w in zip(got, want))
    assert "torch reference" in ref.backward_note() and "no triton here" in ref.backward_note()
