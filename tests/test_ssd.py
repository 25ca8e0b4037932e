"""The Triton target's dedicated kernels: chunked SSD (Mamba-2 prefill) and the decode step.

- plans: what the SSD kernel reads off a Mamba-2 region (rows p, columns n, log decay, the
  drive's factors, the readout), and its refusals with reasons (the selective-scan kernel then
  runs the region, and the kernel source says why);
- compile-only for sm_80 and sm_90 (no GPU): Mamba-2 regions at several head/state sizes, bf16
  and fp32 (tensor-core mma / wgmma; fp32 as 3xTF32), and the step kernel (evict-first state);
- numerics under TRITON_INTERPRET=1 on tiny shapes (chunk 8, so several chunks and a partial
  one run; two row blocks; masked p and n), fp32 and bf16, with and without h0, final state
  out, outputs poisoned with NaN, against float64 eager, end to end through the backend;
- the decode step kernel (also in place), and prefill-then-step equivalence through
  torch.compile: prefill of L tokens (chunked SSD) then decode steps (the step kernel, also
  run at one token) equals one pass over all tokens;
- on a GPU (marker gpu): b8 L4096 h24 p64 n128 bf16, every candidate config, and decode at
  batch 64 / 256, against float64 references.

Precision: with bf16 inputs the matmuls take bf16 operands (16-bit x, B, C enter unrounded; the
fp32 scales and the state are rounded to bf16) and accumulate in fp32; with fp32 inputs they run
as 3xTF32 (input_precision="tf32x3"), fp32-accurate, so fp32 is held to the usual 1e-5.
"""
from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import ssmc
from conftest import TOL, as_tuple, grads_match, reference, rel_err, ssmc_run
from ssmc import ir
from ssmc.ir import Load, Op
from ssmc.runtime.op import lookup
from test_triton import interp, poison_outputs  # noqa: F401  (interp: a fixture used by name)
from test_triton import region_inputs as zeros_region_inputs

triton = pytest.importorskip("triton")
T = pytest.importorskip("ssmc.targets.triton")
S = pytest.importorskip("ssmc.targets.triton_ssd")


# -- programs: Mamba-2 as people write it (fp32 state, 16-bit storage, D skip, z gate) ------------

def _step(h, x_t, dt_t, A, B_t, C_t, D, z_t, f):
    dA = torch.exp(dt_t.to(f) * A)                                          # one scalar per head
    h = dA[:, :, None, None] * h + (dt_t.to(f)[..., None] * x_t.to(f))[..., None] * B_t[:, None, None, :].to(f)
    y = torch.einsum("bhpn,bn->bhp", h, C_t.to(f)) + D[:, None] * x_t.to(f)
    return h, (y * F.silu(z_t.to(f))).to(x_t.dtype)


def mamba2(x, dt, A, B, C, D, z):
    """Zero initial state; outputs y and the final state."""
    b, L, H, Pd = x.shape
    f = torch.promote_types(x.dtype, torch.float32)
    h = torch.zeros(b, H, Pd, B.shape[-1], dtype=f, device=x.device)
    ys = []
    for t in range(L):
        h, y = _step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, z[:, t], f)
        ys.append(y)
    return torch.stack(ys, 1), h


def mamba2_h0(x, dt, A, B, C, D, z, h0):
    """The state passed in and returned: prefill and decode are this one function."""
    f = torch.promote_types(x.dtype, torch.float32)
    h = h0
    ys = []
    for t in range(x.shape[1]):
        h, y = _step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, z[:, t], f)
        ys.append(y)
    return torch.stack(ys, 1), h


def inputs(b=2, L=21, H=2, Pd=16, N=16, dtype=torch.float32, seed=0, h0=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    ins = [r(b, L, H, Pd).to(dtype), F.softplus(r(b, L, H) - 1).to(dtype), -torch.rand(H, generator=g) - 0.2,
           r(b, L, N).to(dtype), r(b, L, N).to(dtype), r(H), r(b, L, H, Pd).to(dtype)]
    if h0:
        ins.append(r(b, H, Pd, N))                       # fp32 state, as a cache keeps it
    return tuple(x.to(device) for x in ins)


def tokens(args, t0, t1):
    """The inputs for tokens [t0, t1) (time is dim 1 of x, dt, B, C, z)."""
    return tuple(x[:, t0:t1] if i in (0, 1, 3, 4, 6) else x for i, x in enumerate(args))


# -- helpers --------------------------------------------------------------------------------------

def pin(monkeypatch, **config):
    """The SSD kernel's interpreter configs are this one."""
    table = dict(S._table(S.SSD_CONFIGS))
    table["interpreter"] = [{**table["interpreter"][0], **config}]
    monkeypatch.setattr(S.SSDKernel, "table", lambda self: table)


def region_of(fn, args) -> ir.Region:
    return ssmc_run(fn, args, target="torch", rest="eager")[1].regions[0].ir


def region_inputs(region, fn, args) -> list:
    """The region's inputs for fn(*args), by the names Dynamo gave them ("l_x_" for x); every
    input here is an argument (test_triton's version also makes the zeros of an inner state)."""
    params = {n.lower(): a for n, a in zip(inspect.signature(fn).parameters, args)}
    return [params[s.name.split(" ")[0][2:-1]] for s in region.inputs]


def check_run(fn, args, strategy, kernel_cls, tol=None):
    """Compile with target "triton" and run once: the report names the strategy and the
    target, the dedicated kernel ran (no fallback of any kind), outputs match float64 eager."""
    out, report = ssmc_run(fn, args, target="triton", rest="eager")
    assert len(report.regions) == 1, str(report)
    info = report.regions[0]
    assert info.strategy == strategy and info.target == "triton", str(report)
    assert f"# kernel: {kernel_cls.kind}" in info.kernel_source
    entry = lookup(info.key)
    kern = entry.kernel
    assert entry.target == "triton" and entry.failure is None, entry.failure
    assert type(kern) is kernel_cls and kern.fallback is None and kern.config is not None, kern.fallback
    out, ref = as_tuple(out), reference(fn, args)
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        err = rel_err(o, r)
        assert err <= (tol or TOL[args[0].dtype]), f"rel err {err:.3g} of {tuple(o.shape)}\n{report}"
    return report, kern


def ast_source(fn, signature, constexprs):
    try:
        return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    except TypeError:       # older Triton spelled it `constants`
        return triton.compiler.ASTSource(fn=fn, signature=signature, constants=constexprs)


# -- plans and refusals -----------------------------------------------------------------------------

def test_ssd_plan_of_mamba2():
    r = region_of(mamba2, inputs(L=4, seed=1))
    plan = S.make_ssd_plan(r)
    assert not isinstance(plan, str), plan
    assert (plan.p, plan.n, plan.programs) == ("i2", "i3", ("i0", "i1"))      # rows p, columns n
    dt, A = Load(0, ("i0", "t", "i1")), Load(1, ("i1",))
    floor = ir.Const(S.LOG_DECAY_FLOOR)                                         # exp(dt * A) -> dt * A, at least -64
    assert plan.log_decay == Op("maximum", (Op("mul", (dt, A)), floor))
    assert plan.w == dt                                                         # the per-step scale
    assert ir.axes_of(plan.x, r.axes) == {"i0", "i1", "i2", "t"}                # x(t, p)
    assert ir.axes_of(plan.g, r.axes) == {"i0", "i3", "t"}                      # B(t, n)
    assert ir.axes_of(plan.c, r.axes) == {"i0", "i3", "t"} and plan.y_scale is None   # C(t, n)


def kernel_text(src: str, name: str) -> str:
    """One @triton.jit function of a rendered module, by the end of its name ("_ssd", ...)."""
    body = src[src.index(f"{name}(\n"):]
    return body[:body.index("@triton.jit")] if "@triton.jit" in body else body


def test_ssd_source():
    r = region_of(mamba2, inputs(L=4, seed=2))
    plan = S.make_ssd_plan(r)
    for opd in ("tl.bfloat16", "tl.float32"):
        src = S.render_ssd(r, plan, opd)
        compile(src, "<kernel>", "exec")
        body = kernel_text(src, "_ssd")
        before, inside = body.split("for t0 in range(0, L, CHUNK):")
        assert inside.count("tl.dot(") == 4                    # C h^T, C G^T, (L o CG) X, X^T G
        assert "tl.associative_scan(u, 0, _add)" in inside     # the log decay's prefix sum
        assert "tl.exp(" not in body and "tl.exp2(" in inside
        assert "in1_ptr" in before and "in1_ptr" not in inside          # A: once per program
        assert "in5_ptr" in before                                       # D: once per program
        assert "in7_ptr" not in inside                                   # no initial state here
        assert re.search(r"tl\.store\(out0_ptr.*mask=mq & mp_", inside)  # y per chunk, fused epilogue
        assert re.search(r"tl\.store\(out1_ptr", body.split("# after the last step")[1])
        assert ('input_precision="tf32x3"' in inside) == (opd == "tl.float32")
        # time split: segment end states (the state update only), then the outputs per segment
        states = kernel_text(src, "_ssd_states")
        assert states.count("tl.dot(") == 1 and "out0_ptr" not in states and "in4_ptr" not in states   # no C
        assert "tl.store(st_ptr" in states and "tl.store(dec_ptr" in states
        seg = kernel_text(src, "_ssd_seg")
        assert seg.count("tl.dot(") == 4 and "tl.load(st_ptr" in seg
        assert re.search(r"if seg == NSEG - 1:\n\s+tl\.store\(out1_ptr", seg)     # the final state: last segment
        assert "_ssd_combine(st_ptr, dec_ptr, NSEG, SIZE_PN" in src


def _mamba1_region():
    import programs as P
    return region_of(P.mamba1("final"), P.mamba1_inputs(seed=3))


@pytest.mark.parametrize("case,why", [
    ("decay_load", "not exp(u)"),
    ("decay_one_minus", "not exp(u)"),
    ("drive_sum", "not an outer product"),
    ("per_element", "varies along the readout axis"),
    ("fp64", "float64"),
])
def test_ssd_declines_with_reason(case, why, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = region_of(mamba2, inputs(L=4, seed=4))
    if case == "decay_load":                     # a decay handed in as is: may be <= 0
        r = dataclasses.replace(r, decay=Load(0, ("i0", "t", "i1")))
    elif case == "decay_one_minus":
        r = dataclasses.replace(r, decay=Op("sub", (ir.Const(1.0), Op("sigmoid", (Load(0, ("i0", "t", "i1")),)))))
    elif case == "drive_sum":
        r = dataclasses.replace(r, drive=Op("add", (r.drive, r.drive)))
    elif case == "per_element":
        r = _mamba1_region()
    else:
        r = dataclasses.replace(r, inputs=tuple(dataclasses.replace(s, dtype="float64") for s in r.inputs))
    got = S.make_ssd_plan(r)
    assert isinstance(got, str) and why in got, got
    # the region still runs on the selective-scan kernel, and the source header says why
    tgt = T.TritonTarget()
    assert tgt.supports(r, "chunked_ssd", 90, "cuda") is True
    kern = tgt.compile(r, "chunked_ssd", ssmc.make_options(cache_dir=str(tmp_path)))
    assert type(kern) is T.TritonKernel and why in kern.note
    src = tgt.source(kern)
    assert "# kernel: selective scan" in src and "chunked SSD kernel declined" in src


def test_log_decay_forms():
    u, v = Load(0, ("t",)), Load(1, ("t",))
    assert S.log_decay(Op("exp", (u,))) == u
    assert S.log_decay(Op("sigmoid", (u,))) == Op("logsigmoid", (u,))
    got = S.log_decay(Op("mul", (Op("exp", (u,)), ir.Const(0.5))))
    assert isinstance(got, Op) and got.name == "add"
    assert isinstance(S.log_decay(Op("pow", (Op("sigmoid", (v,)), ir.Const(2.0)))), Op)
    assert isinstance(S.log_decay(ir.Const(-0.5)), str)
    assert isinstance(S.log_decay(Op("tanh", (u,))), str)


def test_step_declines_without_a_state_passed_in(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = _mamba1_region()
    assert r.init is not None and S.make_step_plan(r) == T.make_plan(r)   # in-loop zeros are passed in too
    r = dataclasses.replace(r, init=None)                                 # a region built without h_0
    assert "no state passed in" in S.make_step_plan(r)
    kern = T.TritonTarget().compile(r, "step", ssmc.make_options(cache_dir=str(tmp_path)))
    assert type(kern) is T.TritonKernel and "decode step kernel declined" in T.TritonTarget().source(kern)


# -- compile-only for sm_80 / sm_90 -------------------------------------------------------------------

SHAPES = [(24, 64, 128), (8, 32, 64), (4, 64, 16)]        # heads, head dim p, state n


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h%dp%dn%d" % s)
def test_ssd_and_step_compile_for_sm80_sm90(shape, cc, monkeypatch, tmp_path):
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    H, Pd, N = shape
    opts = ssmc.make_options(cache_dir=str(tmp_path))
    # the first (largest) config of the table at the benchmark shape, a smaller one elsewhere
    # (compiling is seconds per config); fp32 inputs (3xTF32) at the first shape
    small = {"variant": "ssd", "CHUNK": 32, "BLOCK_P": 32, "num_warps": 4, "num_stages": 2}
    dtypes = [torch.bfloat16] if shape != SHAPES[0] else [torch.bfloat16, torch.float32]
    for dt in dtypes:
        r = region_of(mamba2_h0, inputs(b=2, L=4, H=H, Pd=Pd, N=N, dtype=dt, seed=5, h0=True))
        kern = T.TritonTarget().compile(r, "chunked_ssd", opts)
        assert type(kern) is S.SSDKernel
        first = shape == SHAPES[0] and dt == torch.bfloat16
        cfg = kern.table()[f"sm_{cc}"][0] if first else small
        cfg = {**cfg, "BLOCK_P": min(cfg["BLOCK_P"], Pd)}
        fn, sig, cx = kern.signature(cfg, max(16, N))
        assert sig["in2_ptr"] == ("*bf16" if dt == torch.bfloat16 else "*fp32")
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        ptx = ck.asm["ptx"]
        assert f".target sm_{cc}" in ptx and ck.asm.get("cubin")
        mma = re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.\S+", ptx)
        assert mma, "the chunk matmuls must run on tensor cores"
        kind = "bf16" if dt == torch.bfloat16 else "tf32"
        assert all(kind in m for m in mma), sorted(set(mma))
        if cc == 90 and first:
            assert any(m.startswith("wgmma") for m in mma)
    step = T.TritonTarget().compile(r, "step", opts)
    assert type(step) is S.StepKernel
    cfg = step.table()[f"sm_{cc}"][-1]
    fn, sig, cx = step.signature(cfg, N)
    ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                        options={"num_warps": cfg["num_warps"], "num_stages": 1})
    assert ".target sm_%d" % cc in ck.asm["ptx"] and "evict_first" in ck.asm["ptx"]


# -- numerics under the interpreter ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h0", [False, True], ids=["zeros", "h0"])
def test_ssd_numerics(h0, dtype, interp):
    # L=21: chunks of 8, 8 and a partial 5; p=16 in two row blocks of 8
    fn = mamba2_h0 if h0 else mamba2
    _, kern = check_run(fn, inputs(L=21, dtype=dtype, seed=6, h0=h0), "chunked_ssd", S.SSDKernel)
    assert kern.config["CHUNK"] == 8 and kern.config["BLOCK_P"] == 8
    assert ("tl.bfloat16" in kern.source) == (dtype == torch.bfloat16)


def test_ssd_masked_sizes_and_one_row_block(interp, monkeypatch):
    """p=12, n=12 (not powers of two: masked rows and columns), 3 heads, chunk 4, one row block."""
    pin(monkeypatch, CHUNK=4, BLOCK_P=16)
    _, kern = check_run(mamba2_h0, inputs(L=10, H=3, Pd=12, N=12, seed=7, h0=True), "chunked_ssd", S.SSDKernel)
    assert kern.config["CHUNK"] == 4 and kern.config["BLOCK_P"] == 16


def test_ssd_one_token_strides_and_extreme_decays(interp):
    """One kernel, several calls: L=1 (one partial chunk); x and z with other strides (heads
    outermost in memory); decays exp(dt A) down to ~1e-30 in a step; decays above 1."""
    fn = mamba2_h0
    args = inputs(L=9, seed=8, h0=True)
    region = region_of(fn, args)
    kern = T.TritonTarget().compile(region, "chunked_ssd", ssmc.make_options())
    assert type(kern) is S.SSDKernel
    x, dt, A, *rest = inputs(L=19, seed=14, h0=True)
    for a in (tokens(args, 0, 1),
              tuple(x.transpose(1, 2).contiguous().transpose(1, 2) if i in (0, 6) else x for i, x in enumerate(args)),
              (x, dt * 3, A * 8, *rest), (x, dt, A * -0.1, *rest)):
        got = kern.forward(region_inputs(region, fn, a))
        for g, w in zip(got, reference(fn, a)):
            assert rel_err(g, w) <= TOL[torch.float32]
        assert kern.fallback is None


def gla(x, g, k, q):
    """Gated linear attention: decay sigmoid(g) per head (its log: logsigmoid), k and q per head."""
    b, L, H, Pd = x.shape
    h = torch.zeros(b, H, Pd, k.shape[-1], dtype=x.dtype)
    ys = []
    for t in range(L):
        h = torch.sigmoid(g[:, t])[:, :, None, None] * h + x[:, t, :, :, None] * k[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, q[:, t]))
    return torch.stack(ys, 1)


def test_ssd_sigmoid_decay(interp):
    gen = torch.Generator().manual_seed(13)
    r = lambda *s: torch.randn(*s, generator=gen)
    args = (r(2, 19, 2, 16), r(2, 19, 2) + 2, r(2, 19, 2, 8), r(2, 19, 2, 8))
    report, kern = check_run(gla, args, "chunked_ssd", S.SSDKernel)
    assert "log decay logsigmoid(" in report.regions[0].kernel_source
    kern.force_segments = 3                      # time split: chunks of 8, 8 and 3, one a segment
    got = kern.forward(zeros_region_inputs(report.regions[0].ir, gla, args))
    assert kern.last_launch["segments"] == 3
    assert rel_err(got[0], reference(gla, args)[0]) <= TOL[torch.float32]


def _exp_decay(x, u, k, q):
    """A Mamba-2 style head written with its log decay u: h = exp(u_t) h + x_t k_t^T."""
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], k.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(u[:, t])[:, :, None, None] * h + x[:, t, :, :, None] * k[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, q[:, t]))
    return torch.stack(ys, 1), h


def _reset_inputs(reset: float, L: int = 21):
    gen = torch.Generator().manual_seed(31)
    r = lambda *s: torch.randn(*s, generator=gen)        # noqa: E731
    u = -torch.rand(2, L, 2, generator=gen)
    u[:, 6], u[1, 13] = -reset, -reset                   # hard resets inside the first and a later chunk
    return r(2, L, 2, 8), u, r(2, L, 2, 8), r(2, L, 2, 8)


@pytest.mark.parametrize("reset", [float("inf"), 1e8, 1e4], ids=["inf", "1e8", "1e4"])
def test_ssd_forms_keep_hard_resets(reset):
    """A step whose decay is exp(-inf) or exp(-1e8) (a reset): the SSD's matmul form (the torch
    target) differences prefix sums of the log decay inside a chunk, which gave NaN (-inf - -inf)
    or lost digits at -1e8 (the sums' magnitude); each step's log decay is taken as at least
    -64 instead. Values and gradients against float64 eager."""
    args = _reset_inputs(reset)
    out, report = ssmc_run(_exp_decay, args, target="torch", chunk=8)
    assert [i.strategy for i in report.regions] == ["chunked_ssd"], str(report)
    for o, w in zip(as_tuple(out), reference(_exp_decay, args)):
        assert rel_err(o, w) <= TOL[torch.float32]
    grads_match(_exp_decay, args, tol=1e-5, target="torch", chunk=8)


def test_ssd_kernel_keeps_hard_resets(interp):
    """The same resets through the Triton SSD kernel (chunk 8: resets inside chunks)."""
    check_run(_exp_decay, _reset_inputs(float("inf")), "chunked_ssd", S.SSDKernel)


def _strong_decay_grad_of_A(target):
    """d/dA of a Mamba-2 head whose decay per step is ~exp(-20): float64 eager against ssmc fp32."""
    def m2(x, dt, A, B, C):
        h, ys = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1]), []
        for t in range(x.shape[1]):
            dtt = F.softplus(dt[:, t])
            h = torch.exp(dtt * A)[:, :, None, None] * h + (dtt[:, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]
            ys.append(torch.einsum("bhpn,bn->bhp", h, C[:, t]))
        return torch.stack(ys, 1), h
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(2, 17, 2, 8, generator=g), torch.randn(2, 17, 2, generator=g) * 0.1 + 0.5
    A, B, C = -20 * (1 + 0.05 * torch.rand(2, generator=g)), torch.randn(2, 17, 8, generator=g), torch.randn(2, 17, 8, generator=g)
    w1, w2 = torch.randn(2, 17, 2, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 8, 8, generator=g, dtype=torch.float64)

    def grad_A(fn, dtype):
        ins = [v.to(dtype).requires_grad_() for v in (x, dt, A, B, C)]
        y, h = fn(*ins)
        ((y.double() * w1).sum() + (h.double() * w2).sum()).backward()
        return ins[2].grad.double()
    want = grad_A(m2, torch.float64)
    torch._dynamo.reset()
    got = grad_A(torch.compile(m2, backend="ssmc", options={"target": target}), torch.float32)
    return got, want


def test_ssd_backward_keeps_small_decay_gradients():
    """With strong decays dA is ~1e-7; the matmul form took the decays as differences of prefix
    sums, and their gradient as large terms that cancel: dA came out ~1e-6 off (sign flipped)."""
    got, want = _strong_decay_grad_of_A("torch")
    assert rel_err(got, want) < 1e-4, (got, want)


def test_ssd_core_kernels_keep_small_decay_gradients(interp):
    """The same through the SSD core's Triton backward (du as masked sums, no differences)."""
    got, want = _strong_decay_grad_of_A("triton")
    assert rel_err(got, want) < 1e-4, (got, want)


# -- backward: the chunked SSD's matmul form under autograd --------------------------------------------

def _f64(args):
    return tuple(x.double() for x in args)


def scaled_readout(x, dt, A, B, C, s):
    """Mamba-2 without D and z, a per-head, per-step scale inside the readout's sum (a readout
    factor free of n: the plan's y_scale)."""
    b, L, H, Pd = x.shape
    h = torch.zeros(b, H, Pd, B.shape[-1], dtype=x.dtype)
    ys = []
    for t in range(L):
        h = torch.exp(dt[:, t] * A)[:, :, None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] \
            * B[:, t, None, None, :]
        ys.append((h * C[:, t, None, None, :] * s[:, t, :, None, None]).sum(-1))
    return torch.stack(ys, 1)


BWD_CASES = {     # L 21 and 19: chunks of 4 and 8 leave a partial last chunk
    "mamba2_z_final": (mamba2, lambda: _f64(inputs(L=21, Pd=4, N=3, seed=41))),
    "mamba2_h0": (mamba2_h0, lambda: _f64(inputs(L=21, Pd=4, N=3, seed=42, h0=True))),
    "scaled_readout": (scaled_readout, lambda: _f64((*inputs(L=21, Pd=4, N=3, seed=43)[:5], torch.randn(2, 21, 2)))),
    "gla_sigmoid": (gla, lambda: _f64((torch.randn(2, 19, 2, 3), torch.randn(2, 19, 2) + 2,
                                       torch.randn(2, 19, 2, 5), torch.randn(2, 19, 2, 5)))),
}


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("case", sorted(BWD_CASES))
def test_ssd_matmul_backward_equals_the_adjoint(case, chunk):
    """ssd_autograd: outputs and every input's gradient (h0's too) in float64 equal the torch
    target's forward and its adjoint recurrence, whatever the chunk."""
    from ssmc.targets.reference import adjoint_run, run
    from ssmc.targets.ssd_autograd import ssd_backward, ssd_outputs
    fn, make = BWD_CASES[case]
    torch.manual_seed(7)
    args = make()
    region = region_of(fn, args)
    plan = S.make_ssd_plan(region, float64=True)
    assert not isinstance(plan, str), plan
    xs = zeros_region_inputs(region, fn, args)
    want_out = run(region, xs, 5)
    for o, w in zip(ssd_outputs(region, plan, xs, chunk), want_out):
        assert rel_err(o, w) <= 1e-12
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in want_out]
    needs = [x.is_floating_point() for x in xs]
    want = adjoint_run(region, xs, grads, needs, 5)
    got = ssd_backward(region, plan, xs, grads, needs, chunk)
    for i, (a, w) in enumerate(zip(got, want)):
        assert a.shape == xs[i].shape and rel_err(a, w) <= 1e-10, (i, region.inputs[i].name, rel_err(a, w))
    needs[0] = False                                           # an input nobody asks about
    assert ssd_backward(region, plan, xs, grads, needs, chunk)[0] is None


@pytest.mark.parametrize("case", sorted(BWD_CASES))
def test_ssd_core_kernels_equal_the_adjoint(case, interp):
    """ssd_core.py's Triton kernels (interpreted) for the core map: outputs and every input's
    gradient of fp32 inputs equal the float64 adjoint, at chunks 16 and 32 (L 19-21: a partial
    last chunk), with B and C shared by the heads (their gradients summed over the heads) where
    the case has them."""
    from ssmc.targets.reference import adjoint_run, run
    from ssmc.targets.ssd_autograd import ssd_backward, ssd_outputs
    fn, make = BWD_CASES[case]
    torch.manual_seed(7)
    args = make()
    region = region_of(fn, args)
    plan = S.make_ssd_plan(region, float64=True)
    xs = zeros_region_inputs(region, fn, args)
    want_out = run(region, xs, 5)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in want_out]
    needs = [x.is_floating_point() for x in xs]
    want = adjoint_run(region, xs, grads, needs, 5)
    x32 = [x.float() if x.is_floating_point() else x for x in xs]
    for chunk in (16, 32):
        for o, w in zip(ssd_outputs(region, plan, x32, chunk, core="triton"), want_out):
            assert rel_err(o, w) <= 2e-6
        got = ssd_backward(region, plan, x32, [v.float() for v in grads], needs, chunk, core="triton")
        for i, (a, w) in enumerate(zip(got, want)):
            assert a.shape == xs[i].shape and rel_err(a, w) <= 3e-6, (chunk, region.inputs[i].name, rel_err(a, w))


def _adjoint_case(case: str, seed: int, grad_seed: int, dtype):
    """BWD_CASES[case] (region, plan, inputs in `dtype`, float64 output gradients, needs, the
    float64 adjoint's gradients of those same input values)."""
    from ssmc.targets.reference import adjoint_run, run
    fn, make = BWD_CASES[case]
    torch.manual_seed(seed)
    args = make()
    region = region_of(fn, args)
    plan = S.make_ssd_plan(region, float64=True)
    xs = [x.to(dtype) if x.is_floating_point() else x for x in zeros_region_inputs(region, fn, args)]
    x64 = [x.double() if x.is_floating_point() else x for x in xs]
    g = torch.Generator().manual_seed(grad_seed)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in run(region, x64, 5)]
    needs = [x.is_floating_point() for x in xs]
    return region, plan, xs, grads, needs, adjoint_run(region, x64, grads, needs, 5)


def test_ssd_core_kernels_bf16_and_deterministic(interp):
    """bf16 inputs: the kernels' dots take bf16 operands (rounded to nearest) and the gradients
    stay within bf16 rounding of the float64 adjoint of the same bf16 values; B's and C's
    gradients are summed over the heads inside ssd_bwd_dbc (no buffer of the heads' size), and
    deterministic mode gives the same gradients bit for bit (n fits one block here: no atomic
    adds in either mode)."""
    from ssmc.targets import ssd_core
    from ssmc.targets.ssd_autograd import ssd_backward
    region, plan, xs, grads, needs, want = _adjoint_case("mamba2_z_final", 7, 3, torch.bfloat16)
    got = ssd_backward(region, plan, xs, [v.float() for v in grads], needs, 16, core="triton")
    for i, (a, w) in enumerate(zip(got, want)):
        assert a.dtype == torch.bfloat16 and rel_err(a, w) <= 1e-2, (region.inputs[i].name, rel_err(a, w))
    x32 = [x.float() if x.is_floating_point() else x for x in xs]
    seen = []
    orig = ssd_core._grad_buffer

    def spy(t, full, det, **kw):
        got = orig(t, full, det, **kw)
        seen.append((det, got[1], tuple(got[0].shape) != tuple(t.shape)))
        return got
    import unittest.mock
    with unittest.mock.patch.object(ssd_core, "_grad_buffer", spy):
        a1 = ssd_backward(region, plan, x32, [v.float() for v in grads], needs, 16, core="triton")
        a2 = ssd_backward(region, plan, x32, [v.float() for v in grads], needs, 16, core="triton",
                          deterministic=True)
    assert seen and not any(expanded for _, _, expanded in seen)    # no per-head buffers
    assert {det for det, _, _ in seen} == {False, True}
    assert not any(atomic for _, atomic, _ in seen)
    for a, b in zip(a1, a2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("heads", ["loop", "atomic", "store"])
def test_ssd_core_heads_modes_equal_the_adjoint(heads, interp, monkeypatch):
    """Each way ssd_bwd_dbc sums the gradients of B and C over the heads that share them
    (CONFIG's "heads") gives the float64 adjoint's gradients; "atomic" adds atomically into
    one buffer of B's shape, "store" writes a buffer per head, "loop" neither."""
    from ssmc.targets import ssd_core
    from ssmc.targets.ssd_autograd import ssd_backward
    monkeypatch.setitem(ssd_core.CONFIG, "bwd_dbc", {**ssd_core.CONFIG["bwd_dbc"], "heads": heads})
    region, plan, x64, grads, needs, want = _adjoint_case("mamba2_z_final", 8, 4, torch.float64)
    seen = []
    orig = ssd_core._grad_buffer

    def spy(t, full, det, **kw):
        got = orig(t, full, det, **kw)
        seen.append((got[1], tuple(got[0].shape) != tuple(t.shape)))
        return got
    x32 = [x.float() if x.is_floating_point() else x for x in x64]
    import unittest.mock
    with unittest.mock.patch.object(ssd_core, "_grad_buffer", spy):
        got = ssd_backward(region, plan, x32, [v.float() for v in grads], needs, 16, core="triton")
    for i, (a, w) in enumerate(zip(got, want)):
        assert rel_err(a, w) <= 3e-6, (heads, region.inputs[i].name, rel_err(a, w))
    # the five factors' buffers (u, w, x, g, c): g's and c's are the last two
    assert len(seen) == 5, seen
    assert [s[0] for s in seen[3:]] == [heads == "atomic"] * 2, seen
    assert [s[1] for s in seen[3:]] == [heads == "store"] * 2, seen


def _kept_states_check(keep, b, h, L, p, n, chunk, dtype=torch.float32, device="cpu", seed=12):
    """The core's kernels with states kept every `keep` chunks: outputs, final state and the
    gradient of every factor against the float64 matmul form of the same values (B and C
    shared by the heads); the state buffers hold one state per group of chunks."""
    from ssmc.targets import ssd_core
    from ssmc.targets.ssd_autograd import _flat, _torch_core
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)          # noqa: E731
    dt = F.softplus(r(b, h, L, 1) - 1)
    f64 = [dt * -torch.rand(1, h, 1, 1, generator=gen, dtype=torch.float64), dt, r(b, h, L, p),
           r(b, 1, L, n), r(b, 1, L, n)]
    f64 = [t.to(dtype).double() if k > 1 else t for k, t in enumerate(f64)]    # the values the kernels see
    h0 = r(b, h, p, n)
    opd = ssd_core.opd_of([dtype])
    sp = ssd_core.Spec((b, h), L, p, n, chunk, opd, False, keep=keep)
    NC = -(-L // chunk)
    assert (sp.NC, sp.NS) == (NC, -(-NC // keep))
    ins = [t.to(device=device, dtype=dtype if k > 1 else torch.float32) for k, t in enumerate(f64)]
    ins.append(h0.float().to(device))
    y, hl, H, A = ssd_core._forward(sp, *ins)
    assert tuple(H.shape) == (b * h, sp.NS, p, n) and tuple(A.shape) == (b * h, sp.NS)
    dy, dh = r(b * h, L, p), r(b * h, p, n)
    (du, dw, dx, dg, dc), dh0 = ssd_core._backward(sp, *ins[:5], H, A, dy.float().to(device).reshape(y.shape),
                                                   dh.float().to(device))
    i64 = [t.detach().requires_grad_(True) for t in (*f64, h0)]
    fl = [_flat(t, (b, h), L, k) for t, k in zip(i64[:5], (1, 1, p, n, n))]
    y64, h64 = _torch_core(*fl, i64[5].reshape(b * h, p, n), chunk, lambda a, c: a @ c)
    tol = 5e-6 if dtype == torch.float32 else 1.5e-2
    assert rel_err(y.reshape(y64.shape).cpu(), y64) <= tol and rel_err(hl.cpu(), h64) <= tol
    want = torch.autograd.grad((y64, h64), i64, (dy, dh))
    for name, a, w in zip(("u", "w", "x", "g", "c", "h0"), (du, dw, dx, dg, dc, dh0.reshape(h0.shape)), want):
        assert a.shape == w.shape and rel_err(a.cpu(), w) <= tol, (keep, name, rel_err(a.cpu(), w))


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_ssd_core_states_kept_every_few_chunks(keep, interp):
    """L 23 in chunks of 4: six chunks, the last partial; keep 4 leaves a partial last group."""
    _kept_states_check(keep, 2, 2, 23, 16, 16, 4)


@pytest.mark.parametrize("deterministic", [False, True])
def test_ssd_core_blocks_of_n_and_p_add_up(deterministic, interp, monkeypatch):
    """Tiles smaller than the state (n 40 in blocks of 16, p 24 in blocks of 16, so partial
    blocks): du and dw summed over the blocks of n (atomically; deterministic mode in a slot per block),
    B and C shared by the heads, a time-constant x scale; against the torch matmul form in float64."""
    from ssmc.targets import ssd_core
    from ssmc.targets.ssd_autograd import _flat, _torch_core
    for k in ssd_core.CONFIG:
        monkeypatch.setitem(ssd_core.CONFIG, k, {**ssd_core.CONFIG[k], **{b: 16 for b in ("BLOCK_P", "BLOCK_N")
                                                                          if b in ssd_core.CONFIG[k]}})
    monkeypatch.setitem(ssd_core.CONFIG, "pass", {"BLOCK": 128, "num_warps": 4})
    gen = torch.Generator().manual_seed(11)
    b, h, L, p, n = 2, 3, 37, 24, 40
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)          # noqa: E731
    dt = F.softplus(r(b, h, L, 1))
    f64 = [dt * -torch.rand(1, h, 1, 1, generator=gen, dtype=torch.float64), dt, r(b, h, 1, p),
           r(b, 1, L, n), r(b, 1, L, n)]
    h0 = r(b, h, p, n)
    sp = ssd_core.Spec((b, h), L, p, n, 16, "tl.float32", deterministic)
    ins = [t.float().requires_grad_(True) for t in (*f64, h0)]
    y, hl = ssd_core.core(sp, *ins)
    dy, dh = r(b * h, L, p), r(b * h, p, n)
    atomics = []
    orig = ssd_core._grad_buffer
    monkeypatch.setattr(ssd_core, "_grad_buffer", lambda *a, **kw: atomics.append(orig(*a, **kw)[1]) or orig(*a, **kw))
    got = torch.autograd.grad((y, hl), ins, (dy.float().reshape(y.shape), dh.float()))
    assert atomics == ([False] * 5 if deterministic else [True, True, False, False, False])   # du, dw: n blocks
    i64 = [t.detach().requires_grad_(True) for t in (*f64, h0)]
    fl = [_flat(t, (b, h), L, k) for t, k in zip(i64[:5], (1, 1, p, n, n))]
    y64, h64 = _torch_core(*fl, i64[5].reshape(b * h, p, n), 16, lambda a, c: a @ c)
    assert rel_err(y.reshape(y64.shape), y64) <= 2e-6 and rel_err(hl, h64) <= 2e-6
    want = torch.autograd.grad((y64, h64), i64, (dy, dh))
    for name, a, w in zip(("u", "w", "x", "g", "c", "h0"), got, want):
        assert a.shape == w.shape and rel_err(a, w) <= 5e-6, (name, rel_err(a, w))


@pytest.mark.parametrize("case", sorted(BWD_CASES))
def test_ssd_epilogue_kernel_equals_the_adjoint(case, interp):
    """ssd_epilogue.py's generated kernel (interpreted) for the per-step epilogue's backward,
    with the core's kernels: every input's gradient of fp32 inputs equals the float64 adjoint;
    D's gradient (summed over batch, time and p through slots) and z's (the gate, read by the
    epilogue only) included. An input nobody asks about gets no gradient and no buffer."""
    from ssmc.targets import ssd_epilogue as E
    from ssmc.targets.ssd_autograd import ssd_backward
    region, plan, xs, grads, needs, want = _adjoint_case(case, 7, 3, torch.float64)
    ep = E.make_epilogue(region, plan, tuple(needs))
    assert not isinstance(ep, str), ep
    read = {region.inputs[ld.input].name for ld, _ in ep.grads if ld.input < len(xs)}
    if case.startswith("mamba2"):        # x (the skip), D, z: the epilogue's own inputs
        assert {"l_x_", "l_d_", "l_z_"} <= {n.split(" ")[0] for n in read}, read
    x32 = [x.float() if x.is_floating_point() else x for x in xs]
    calls, bufs = [], []
    orig = E.backward
    from ssmc.targets import ssd_core
    orig_buf = ssd_core._grad_buffer

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    def spy_buf(t, *a, **k):
        bufs.append(tuple(t.shape))
        return orig_buf(t, *a, **k)
    import unittest.mock
    with unittest.mock.patch.object(E, "backward", spy), unittest.mock.patch.object(ssd_core, "_grad_buffer", spy_buf):
        got = ssd_backward(region, plan, x32, [v.float() for v in grads], needs, 16, core="triton", epilogue=ep)
    assert calls
    if case.startswith("mamba2"):        # dx goes into the epilogue's gradient of x: no buffer of its own
        assert len(bufs) == 4, bufs
    for i, (a, w) in enumerate(zip(got, want)):
        assert a.shape == xs[i].shape and rel_err(a, w) <= 3e-6, (region.inputs[i].name, rel_err(a, w))
    last = max(i for i, n in enumerate(needs) if n)
    needs[last] = False
    ep2 = E.make_epilogue(region, plan, tuple(needs))
    assert all(ld.input != last for ld, _ in ep2.grads)
    got2 = ssd_backward(region, plan, x32, [v.float() for v in grads], needs, 16, core="triton", epilogue=ep2)
    assert got2[last] is None and rel_err(got2[0], want[0]) <= 3e-6


def test_ssd_epilogue_declines_with_reason():
    """A per-step output not laid out along every axis of the kernel's tiles is declined, with
    the output named."""
    from ssmc.targets import ssd_epilogue as E
    fn, make = BWD_CASES["mamba2_z_final"]
    args = make()
    region = region_of(fn, args)
    plan = S.make_ssd_plan(region, float64=True)
    k = next(k for k, o in enumerate(region.outputs) if o.kind == "steps")
    o = region.outputs[k]
    bad = dataclasses.replace(o, index=tuple(1 if ix == plan.p else ix for ix in o.index))
    region2 = dataclasses.replace(region, outputs=region.outputs[:k] + (bad,) + region.outputs[k + 1:])
    why = E.make_epilogue(region2, plan)
    assert isinstance(why, str) and f"per-step output {k}" in why, why


@pytest.mark.parametrize("cc", [80, 90])
def test_ssd_core_kernels_compile_for_sm80_sm90(cc, monkeypatch, tmp_path):
    """The core's kernels compile for sm_80 and sm_90 at the Mamba-2 shape (p 64, n 128, bf16
    dots, states kept as CONFIG says), their matmuls on tensor cores."""
    from triton.backends.compiler import GPUTarget
    from ssmc.targets import ssd_core
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    mod = ssd_core._module("tl.bfloat16", 2, str(tmp_path))
    C = ssd_core.CONFIG
    dbc = C["bwd_dbc"]
    kernels = {
        "ssd_chunk_state": ({"BLOCK_P": C["chunk_state"]["BLOCK_P"], "BLOCK_N": C["chunk_state"]["BLOCK_N"]}, C["chunk_state"]),
        "ssd_chunk_dstate": ({"BLOCK_P": C["chunk_state"]["BLOCK_P"], "BLOCK_N": C["chunk_state"]["BLOCK_N"]}, C["chunk_state"]),
        "ssd_chunk_fwd": ({"BLOCK_P": C["chunk_fwd"]["BLOCK_P"], "BLOCK_N": 128}, C["chunk_fwd"]),
        "ssd_bwd_dx": ({"BLOCK_P": C["bwd_dx"]["BLOCK_P"], "BLOCK_N": 128}, C["bwd_dx"]),
        "ssd_bwd_dbc": ({"BLOCK_P": dbc["BLOCK_P"], "BLOCK_N": dbc["BLOCK_N"], "NPB": 64 // dbc["BLOCK_P"],
                         "ATOMIC_U": True, "ATOMIC_W": True}, dbc),
    }
    ck = triton.compile(ast_source(mod.ssd_pass, {a: "constexpr" if a in ("HAS_H0", "REVERSE", "BLOCK") else
                                                  "*fp32" if a.endswith("_ptr") else "i32" for a in mod.ssd_pass.arg_names},
                                   {"HAS_H0": True, "REVERSE": True, "BLOCK": C["pass"]["BLOCK"]}),
                        target=GPUTarget("cuda", cc, 32), options={"num_warps": C["pass"]["num_warps"]})
    assert f".target sm_{cc}" in ck.asm["ptx"] and ck.asm.get("cubin")
    keep = C["core"]["KEEP"]
    for name, (cx, cfg) in kernels.items():
        fn = getattr(mod, name)
        # the state kernels run over groups of KEEP chunks; the others over chunks, given KEEP
        grouped = name in ("ssd_chunk_state", "ssd_chunk_dstate")
        cx = {**cx, "CHUNK": 64 * keep if grouped else 64, "DOT_UP": False, **({} if grouped else {"KEEP": keep})}
        sig = {a: "constexpr" if a in cx else "*fp32" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"]})
        ptx = ck.asm["ptx"]
        assert f".target sm_{cc}" in ptx and ck.asm.get("cubin"), name
        mma = re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.\S+", ptx)
        assert mma and all("bf16" in m for m in mma), (name, sorted(set(mma)))
    # the epilogue's backward of Mamba-2 (D skip, z gate) at p 64
    from ssmc.targets import ssd_epilogue as E
    fn, make = BWD_CASES["mamba2_z_final"]
    region = region_of(fn, make())
    ep = E.make_epilogue(region, S.make_ssd_plan(region, float64=True))
    emod = E._module(ep, str(tmp_path), False)
    fn = getattr(emod, T.kernel_name(ep.region) + "_epi_bwd")
    cx = {"BLOCK_T": E.TILE // 64, "BLOCK_P": 64}
    sig = {a: "constexpr" if a in cx else "*bf16" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
    ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                        options={"num_warps": E.NUM_WARPS})
    assert f".target sm_{cc}" in ck.asm["ptx"] and ck.asm.get("cubin")


def test_ssd_training_runs_the_matmul_backward(interp):
    """Through torch.compile and autograd: the SSD kernel's backward is the matmul form, the
    report says so, and the gradients equal eager autograd's of the loop in float64."""
    args = inputs(L=13, Pd=16, N=16, seed=44, h0=True)
    fn = mamba2_h0
    xs = [x.detach().requires_grad_(True) for x in args]
    out, report = ssmc_run(fn, xs, target="triton", rest="eager")
    info = report.regions[0]
    assert info.strategy == "chunked_ssd", str(report)
    y, h = out
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad((y, h), xs, (gy, gh))
    x64 = [x.detach().double().requires_grad_(True) for x in args]
    y64, h64 = fn(*x64)
    want = torch.autograd.grad((y64, h64), x64, (gy.double(), gh.double()))
    for i, (a, w) in enumerate(zip(got, want)):
        assert rel_err(a, w) <= 1e-5, (i, rel_err(a, w))
    kern = lookup(info.key).kernel
    note = kern.backward_note()
    assert note.startswith("backward: the chunked SSD") and "Triton kernels of ssmc/targets/ssd_core.py" in note, note
    assert "epilogue's backward: the generated kernel of ssmc/targets/ssd_epilogue.py" in note, note
    from ssmc.explain import refresh
    refresh(report)
    assert "the core map through the Triton kernels" in str(report.regions[0])


# -- time split into segments (grids too small for the device) ---------------------------------------

def mamba2_y(x, dt, A, B, C, D, z):
    """mamba2 without the final state out."""
    return mamba2(x, dt, A, B, C, D, z)[0]


def mamba2_h0_y(x, dt, A, B, C, D, z, h0):
    """mamba2_h0 without the final state out."""
    return mamba2_h0(x, dt, A, B, C, D, z, h0)[0]


# case -> (program, h0 passed in, dt scale); "none": the region built without an initial state
SPLIT_CASES = {
    "zeros": (mamba2, False, 1.0), "zeros_y": (mamba2_y, False, 1.0),
    "h0": (mamba2_h0, True, 1.0), "h0_y": (mamba2_h0_y, True, 1.0),
    "none": (mamba2, False, 1.0), "none_y": (mamba2_y, False, 1.0),
    "h0_slow": (mamba2_h0, True, 0.05),       # decays near 1: every segment's start state matters
}


def _split_kernel(fn, h0, dtype=torch.float32, L=37, scale=1.0, seed=20, init=True):
    """The SSD kernel of fn's region (captured at 4 tokens) and its inputs at L tokens."""
    args = inputs(L=L, dtype=dtype, seed=seed, h0=h0)
    args = (args[0], (args[1].float() * scale).to(dtype)) + args[2:]
    region = region_of(fn, inputs(L=4, dtype=dtype, seed=seed, h0=h0))
    rin = (region_inputs if h0 else zeros_region_inputs)(region, fn, args)
    if not init:
        region = dataclasses.replace(region, init=None)
    kern = T.TritonTarget().compile(region, "chunked_ssd", ssmc.make_options())
    assert type(kern) is S.SSDKernel
    return kern, rin, args


@pytest.mark.parametrize("case", list(SPLIT_CASES) + ["h0_bf16"])
def test_ssd_split_numerics(case, interp):
    """Time in 2 and 3 segments (forced) equals float64 eager and the one-segment kernel. L=37:
    chunks of 8, 8, 8, 8 and a partial 5; 2 segments of 24 and 13 steps, 3 of 16, 16 and 5 (the
    last segment and its last chunk partial); p=16 in two row blocks. Replays follow the knob."""
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    fn, h0, scale = SPLIT_CASES[case.replace("_bf16", "")]
    kern, rin, args = _split_kernel(fn, h0, dtype, scale=scale, init=not case.startswith("none"))
    ref = reference(fn, args)
    one = kern.forward(rin)                              # no SM count on CPU: one segment
    ll = kern.last_launch
    assert (ll["segments"], ll["seg_len"], ll["programs"]) == (1, 37, 8) and "not on a GPU" in ll["reason"]
    assert len(one) == len(ref)
    for n, seg_len in ((2, 24), (3, 16)):
        kern.force_segments = n
        got = kern.forward(rin)
        assert kern.fallback is None
        ll = kern.last_launch
        assert (ll["segments"], ll["seg_len"], ll["grid"]) == (n, seg_len, (8, n)), ll
        assert "forced" in ll["reason"] and f"time in {n} segments of {seg_len} steps" in kern.describe()
        for g, o, w in zip(got, one, ref):
            assert g.shape == w.shape and g.dtype == o.dtype
            assert rel_err(g, w) <= TOL[dtype], f"{n} segments: rel err {rel_err(g, w):.3g} of {tuple(g.shape)}"
            if dtype == torch.float32:
                assert rel_err(g, o) <= 1e-6
    kern.force_segments = None
    kern.forward(rin)
    assert kern.last_launch["segments"] == 1


def test_ssd_split_policy(tmp_path, monkeypatch):
    """Segments from the grid and the SM count (shapes only: meta tensors): b4 L16384 h24 p64
    n128 on 132 SMs gives 96 programs, so 8 segments (5.5 per SM); b8 fills the SMs; short L keeps one."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    region = region_of(mamba2_h0, inputs(L=4, H=3, Pd=8, N=8, seed=21, h0=True))
    kern = T.TritonTarget().compile(region, "chunked_ssd", ssmc.make_options(cache_dir=str(tmp_path)))
    cfg = {"variant": "ssd", "CHUNK": 64, "BLOCK_P": 64, "num_warps": 4, "num_stages": 2}

    def split(b, L, H=24, Pd=64, N=128):
        m = lambda *s: torch.empty(*s, device="meta")
        args = (m(b, L, H, Pd), m(b, L, H), m(H), m(b, L, N), m(b, L, N), m(H), m(b, L, H, Pd), m(b, H, Pd, N))
        got = kern.split(region_inputs(region, mamba2_h0, args), cfg)
        return got.segments, got.seg_len, got.programs, got.reason

    assert split(4, 16384)[:3] == (1, 16384, 96) and "not on a GPU" in split(4, 16384)[3]
    kern.sm_count = 132
    n, seg_len, progs, why = split(4, 16384)
    assert (n, seg_len, progs) == (8, 32 * 64, 96) and why == "96 programs for 132 SMs: 8 segments for 5.5 per SM"
    assert split(8, 4096)[:3] == (1, 4096, 192)                      # the grid fills the SMs
    n, _, _, why = split(4, 1024)                                    # 16 chunks: at least 16 per segment
    assert n == 1 and "capped at 1" in why
    n, seg_len, _, why = split(1, 16384)                              # 24 programs: 31 wanted, 16 at most
    assert (n, seg_len) == (16, 16 * 64) and "capped at 16" in why
    assert split(1, 16384, H=1)[:2] == (16, 16 * 64)                 # 1 program: at most 256 / 16 chunks
    kern.force_segments = 5
    n, seg_len, _, why = split(4, 16384)
    assert (n, seg_len) == (5, 52 * 64) and why.startswith("forced")
    kern.force_segments = 2
    assert split(4, 64)[:2] == (1, 64)                               # one chunk: one segment


def test_ssd_split_end_to_end(interp, monkeypatch):
    """Through the backend with the policy choosing (16 SMs given, at least one chunk per
    segment): 8 programs -> 4 segments wanted, 3 of whole 8-step chunks at L=37; explain's
    notes and the source header say so."""
    from ssmc.explain import refresh
    table = dict(S._table(S.SSD_CONFIGS))
    table["segments"] = {**table["segments"], "min_chunks": 1, "programs_per_sm": 2}
    monkeypatch.setattr(S.SSDKernel, "table", lambda self: table)
    monkeypatch.setattr(S.SSDKernel, "sm_count", 16)
    report, kern = check_run(mamba2_h0, inputs(L=37, seed=22, h0=True), "chunked_ssd", S.SSDKernel)
    ll = kern.last_launch
    assert (ll["segments"], ll["seg_len"], ll["programs"], ll["sms"]) == (3, 16, 8, 16), ll
    assert ll["reason"] == "8 programs for 16 SMs: 4 segments for 2 per SM; 3 of whole 8-step chunks"
    refresh(report)
    assert any("time in 3 segments of 16 steps" in n for n in report.regions[0].notes), report.regions[0].notes
    head = T.TritonTarget().source(kern).split("\n# ssmc:")[0]
    assert "# launch: time split into segments when the grid has fewer than 1 programs per SM" in head
    assert "time in 3 segments of 16 steps" in head


@pytest.mark.parametrize("cc", [80, 90])
def test_ssd_split_kernels_compile_for_sm80_sm90(cc, monkeypatch, tmp_path):
    """The segment-state, combine and per-segment kernels at the benchmark shape, bf16, with the
    arch's first config: tensor-core matmuls in both region kernels."""
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    r = region_of(mamba2_h0, inputs(b=2, L=4, H=24, Pd=64, N=128, dtype=torch.bfloat16, seed=23, h0=True))
    kern = T.TritonTarget().compile(r, "chunked_ssd", ssmc.make_options(cache_dir=str(tmp_path)))
    cfg = kern.table()[f"sm_{cc}"][0]
    opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    for name in ("ssd_states", "ssd_seg", "ssd_combine"):
        fn, sig, cx = kern.signature(cfg, 128, kernel=name)
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options=opts if name != "ssd_combine" else {"num_warps": 4})
        ptx = ck.asm["ptx"]
        assert f".target sm_{cc}" in ptx and ck.asm.get("cubin"), name
        mma = re.findall(r"(?:wgmma\.mma_async|mma\.sync)\.\S+", ptx)
        if name != "ssd_combine":
            assert mma and all("bf16" in m for m in mma), (name, sorted(set(mma)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_numerics_and_in_place(dtype, interp):
    fn = mamba2_h0
    args = inputs(b=3, L=2, Pd=12, N=16, dtype=dtype, seed=9, h0=True)      # 2 tokens: strategy "step"
    report, kern = check_run(fn, args, "step", S.StepKernel)
    assert "evict_first" in kern.source
    # one token, the new state written over the old one (the same buffer)
    one = tokens(args, 0, 1)
    region = report.regions[0].ir
    rin = region_inputs(region, fn, one)
    state = rin[region.init].clone()
    rin[region.init] = state
    outs = kern.outputs(rin)
    k_y, k_h = (next(k for k, o in enumerate(region.outputs) if o.kind == kind) for kind in ("steps", "final"))
    outs[k_h] = state
    kern.launch(rin, kern.config, outs)
    y, h = reference(fn, one)
    assert rel_err(outs[k_y], y) <= TOL[dtype] and rel_err(state, h) <= TOL[torch.float32]


def _keep_graph(fn, args, **options):
    """Compile with ssmc, run once; returns (outputs, report, call) where call(*args) runs the
    lowered graph (the region op inside) on new inputs of any length."""
    held = {}

    def backend(gm, ex):
        report = ssmc.Report()
        out = ssmc.ssmc_backend(gm, ex, options=options, _report=report)
        held.update(gm=gm, report=report)
        return out
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*args)
    names = list(inspect.signature(fn).parameters)
    order = [names.index(n.target[2:-1]) for n in held["gm"].graph.nodes if n.op == "placeholder"]
    return out, held["report"], lambda *a: held["gm"](*[a[i] for i in order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_then_steps_equal_one_pass(dtype, interp):
    """Prefill of 13 tokens (chunked SSD), a 2-token decode call and two 1-token decode calls
    (step kernel) equal one pass over 17 tokens."""
    L, k = 13, 4
    args = inputs(L=L + k, dtype=dtype, seed=10, h0=True)
    y_all, h_all = reference(mamba2_h0, args)
    # prefill
    (y1, h1), rep = ssmc_run(mamba2_h0, tokens(args, 0, L), target="triton", rest="eager")
    info = rep.regions[0]
    assert (info.strategy, info.target) == ("chunked_ssd", "triton") and "# kernel: chunked SSD" in info.kernel_source
    assert type(lookup(info.key).kernel) is S.SSDKernel and lookup(info.key).kernel.fallback is None
    assert h1.dtype == torch.float32
    # decode: a 2-token call compiles the step region; its lowered graph then runs 1-token steps
    with_state = lambda a, h: a[:-1] + (h,)
    (y2, h2), rep, call = _keep_graph(mamba2_h0, with_state(tokens(args, L, L + 2), h1), target="triton", rest="eager")
    info = rep.regions[0]
    assert (info.strategy, info.target) == ("step", "triton") and "# kernel: decode step" in info.kernel_source
    step = lookup(info.key).kernel
    assert type(step) is S.StepKernel
    ys, h = [y1, y2], h2
    for t in range(L + 2, L + k):
        y, h = call(*with_state(tokens(args, t, t + 1), h))
        ys.append(y)
    assert step.fallback is None and lookup(info.key).failure is None
    y = torch.cat(ys, 1)
    assert rel_err(y, y_all) <= TOL[dtype] and rel_err(h, h_all) <= TOL[dtype]


# -- on a GPU --------------------------------------------------------------------------------------------

def _gpu_kernel(fn, strategy, dtype, tmp_path, **shape):
    """The region captured on small CPU inputs, compiled for the GPU."""
    small = dict(shape, b=2, L=4, h0=fn is mamba2_h0)
    region = region_of(fn, inputs(dtype=dtype, seed=11, **small))
    kern = T.TritonTarget().compile(region, strategy, ssmc.make_options(cache_dir=str(tmp_path)))
    assert kern.arch and kern.arch >= 80
    return region, kern


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,L", [(torch.bfloat16, 4096), (torch.float32, 1024)], ids=["bf16", "fp32"])
def test_gpu_ssd(dtype, L, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    poison_outputs(monkeypatch)
    if dtype == torch.float32:             # two configs (compiling all is half a minute)
        table = {k: (v[:2] if isinstance(v, list) else v) for k, v in S._table(S.SSD_CONFIGS).items()}
        monkeypatch.setattr(S.SSDKernel, "table", lambda self: table)
    shape = dict(H=24, Pd=64, N=128)
    region, kern = _gpu_kernel(mamba2_h0, "chunked_ssd", dtype, tmp_path, **shape)
    assert type(kern) is S.SSDKernel
    args = inputs(b=8, L=L, dtype=dtype, seed=L, h0=True, device="cuda", **shape)
    rin = region_inputs(region, mamba2_h0, args)
    got = kern.forward(rin)
    torch.cuda.synchronize()
    assert kern.fallback is None, kern.fallback
    ref = reference(mamba2_h0, args)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for g, w in zip(got, ref):
        assert g.is_cuda and torch.isfinite(g).all()
        assert rel_err(g, w) <= tol, f"rel err {rel_err(g, w):.3g} with config {kern.config}"
    for cfg in kern.candidates(rin, kern.arch):            # every candidate, not only the tuner's pick
        for g, w in zip(kern.launch(rin, cfg), ref):
            assert rel_err(g, w) <= tol, f"config {cfg}: rel err {rel_err(g, w):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_ssd_core_states_kept(dtype, monkeypatch, tmp_path):
    """The training core's kernels at Mamba-2's p 64 n 128 (B, C shared by 4 heads; dB, dC in
    blocks of n), chunk 64, states kept every second chunk, L 1000 (a partial last chunk and an
    odd number of chunks), against float64."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    _kept_states_check(2, 2, 4, 1000, 64, 128, 64, dtype=dtype, device="cuda")


@pytest.mark.gpu
def test_gpu_ssd_split_long(monkeypatch, tmp_path):
    """b4 L16384 h24 p64 n128 bf16: b * heads * p / BLOCK_P = 96 programs leave SMs idle on a
    132-SM H200, so time is split (3 segments there); outputs and final state against float64
    eager, and the one-segment kernel (forced) against it too. dt is scaled down so that decays
    stay near 1 across a segment and every segment's start state matters."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    poison_outputs(monkeypatch)
    table = {k: (v[:1] if isinstance(v, list) else v) for k, v in S._table(S.SSD_CONFIGS).items()}
    monkeypatch.setattr(S.SSDKernel, "table", lambda self: table)     # one config: nothing to autotune
    shape = dict(H=24, Pd=64, N=128)
    region, kern = _gpu_kernel(mamba2_h0, "chunked_ssd", torch.bfloat16, tmp_path, **shape)
    assert type(kern) is S.SSDKernel
    args = inputs(b=4, L=16384, dtype=torch.bfloat16, seed=16384, h0=True, device="cuda", **shape)
    args = (args[0], (args[1].float() * 0.05).to(torch.bfloat16)) + args[2:]
    rin = region_inputs(region, mamba2_h0, args)
    got = kern.forward(rin)
    torch.cuda.synchronize()
    assert kern.fallback is None, kern.fallback
    ll = kern.last_launch
    if ll["programs"] < ll["sms"]:
        assert ll["segments"] > 1, ll
    ref = reference(mamba2_h0, args)
    for g, w in zip(got, ref):
        assert g.is_cuda and torch.isfinite(g).all()
        assert rel_err(g, w) <= 1e-2, f"rel err {rel_err(g, w):.3g}: {kern.describe()}"
    kern.force_segments = 1
    one = kern.forward(rin)
    torch.cuda.synchronize()
    assert kern.last_launch["segments"] == 1
    for g, w in zip(one, ref):
        assert rel_err(g, w) <= 1e-2, f"one segment: rel err {rel_err(g, w):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [64, 256])
def test_gpu_decode_step(batch, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    poison_outputs(monkeypatch)
    shape = dict(H=24, Pd=64, N=128)
    region, kern = _gpu_kernel(mamba2_h0, "step", torch.bfloat16, tmp_path, **shape)
    assert type(kern) is S.StepKernel
    args = inputs(b=batch, L=1, dtype=torch.bfloat16, seed=batch, h0=True, device="cuda", **shape)
    got = kern.forward(region_inputs(region, mamba2_h0, args))
    torch.cuda.synchronize()
    assert kern.fallback is None, kern.fallback
    for g, w in zip(got, reference(mamba2_h0, args)):
        assert torch.isfinite(g).all()
        assert rel_err(g, w) <= (TOL[torch.bfloat16] if g.dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
def test_gpu_decode_loop_runs_without_inductor_or_the_op(monkeypatch, tmp_path):
    """A compiled decode of two tokens a call (one token has no loop to re-roll) with default
    options holds nothing but its region, so the graph runs eagerly (no Inductor), calls the
    kernel without the custom op under no_grad, and launches through the compiled launcher from
    the third call on: fresh data each call, poisoned outputs, against float64."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    poison_outputs(monkeypatch)
    report = ssmc.Report()
    torch._dynamo.reset()
    f = torch.compile(mamba2_h0, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, options={"target": "triton"},
                                                                          _report=report))
    shape = dict(H=24, Pd=64, N=128)
    for seed in range(4):
        args = inputs(b=64, L=2, dtype=torch.bfloat16, seed=70 + seed, h0=True, device="cuda", **shape)
        with torch.no_grad():
            got = f(*args)
        for g, w in zip(got, reference(mamba2_h0, args)):
            assert torch.isfinite(g).all()
            assert rel_err(g, w) <= (TOL[torch.bfloat16] if g.dtype == torch.bfloat16 else 1e-5), f"call {seed}"
    assert len(report.graphs) == 1 and report.graphs[0].rest == "eager", str(report)
    kern = lookup(report.regions[0].key).kernel
    assert type(kern) is S.StepKernel
    (replay,) = kern._replays.values()
    assert replay.direct.launches == 2


@pytest.mark.gpu
def test_gpu_end_to_end_prefill_and_decode(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    poison_outputs(monkeypatch)
    args = inputs(b=2, L=64, H=4, Pd=64, N=128, dtype=torch.bfloat16, seed=12, h0=True, device="cuda")
    check_run(mamba2_h0, args, "chunked_ssd", S.SSDKernel)
    check_run(mamba2_h0, tokens(args, 0, 2), "step", S.StepKernel)


def test_core_config_overrides_restore_and_name_bad_kernels():
    """ssd_core.overridden merges per-kernel overrides for its block only, and names a kernel
    CONFIG does not have."""
    from ssmc.targets import ssd_core
    before = {k: dict(v) for k, v in ssd_core.CONFIG.items()}
    with ssd_core.overridden({"core": {"KEEP": 2}, "bwd_dbc": {"BLOCK_N": 64}}):
        assert ssd_core.config("core", "tl.bfloat16")["KEEP"] == 2
        assert ssd_core.CONFIG["bwd_dbc"]["BLOCK_N"] == 64 and ssd_core.CONFIG["bwd_dbc"]["heads"] == before["bwd_dbc"]["heads"]
        assert ssd_core.Spec((2, 3), 300, 8, 8, None, "tl.bfloat16", False).keep == 2
    assert ssd_core.CONFIG == before
    assert ssd_core.Spec((2, 3), 300, 8, 8, None, "tl.bfloat16", False).keep == before["core"]["KEEP"]
    # a group is never longer than the sequence, and stays a power of two
    assert ssd_core.Spec((1,), 100, 8, 8, 16, "tl.float32", False, keep=8).keep == 4      # 7 chunks
    with pytest.raises(ValueError, match="KEEP .* power of two, not 3"):
        ssd_core.Spec((1,), 100, 8, 8, 16, "tl.float32", False, keep=3)
    with pytest.raises(KeyError, match="no kernel \\['bwd_db'\\]"):
        with ssd_core.overridden({"bwd_db": {"BLOCK_N": 64}}):
            pass
    assert ssd_core.CONFIG == before
