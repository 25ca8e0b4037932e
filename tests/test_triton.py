"""The ``triton`` target.

- compile-only for sm_80 and sm_90 (no GPU needed): Mamba-1, Mamba-2 and the gated recurrence;
- numerics under TRITON_INTERPRET=1 on tiny shapes, end to end through the backend with
  target "triton", both kernel variants, outputs poisoned with NaN, against float64 eager;
- every elementwise op the printer knows, against the float64 torch reference;
- plans, refusals with reasons, the kernel cache (second process, same bucket);
- on a GPU (marker gpu): b8 d1536 n16, L in {1, 7, 512, 2048, 4096}, fp32 and bf16.

TRITON_INTERPRET is read by Triton when @triton.jit decorates a function, i.e. when ssmc imports
a rendered kernel module; the fixtures set it per test (monkeypatch restores it) and ssmc keeps
interpreted and compiled imports of one source apart.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

import programs as P
import ssmc
import ssmc.ops
from conftest import TOL, as_tuple, reference, rel_err, ssmc_run
from ssmc import ir
from ssmc.ir import Const, InputSpec, Load, Op, OutputSpec, Reduce, Region, State
from ssmc.runtime import cache as kcache
from ssmc.runtime.op import lookup

triton = pytest.importorskip("triton")
T = pytest.importorskip("ssmc.targets.triton")

VARIANTS = ["loop", "scan", "rows"]      # the interpreter table's (the seq variants: test_seq_variant)
FLAT_VARIANTS = ["loop", "scan"]     # what runs a region without a register axis (rows declines it)


# -- more capture forms: the scan higher-order op (one node at any length), fp32 state -----------

def mamba1_scan_cast(x, dt, A, B, C, D, z, bias):
    def combine(h, xs):
        x_t, dt_t, B_t, C_t, z_t = xs
        delta = F.softplus(dt_t.float() + bias.float())
        h = torch.exp(delta.unsqueeze(-1) * A.float()) * h + \
            (delta * x_t.float()).unsqueeze(-1) * B_t.float().unsqueeze(1)
        y = (h * C_t.float().unsqueeze(1)).sum(-1) + D.float() * x_t.float()
        return h, (y * F.silu(z_t.float())).to(x_t.dtype)
    h0 = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=torch.float32, device=x.device)
    hT, ys = scan(combine, h0, (x, dt, B, C, z), dim=1)
    return ys, hT


def mamba2_scan_cast(x, dt, A, B, C, D):
    b, L, H, Pd = x.shape

    def combine(h, xs):
        x_t, dt_t, B_t, C_t = xs
        dA = torch.exp(dt_t.float() * A.float())
        h = dA[:, :, None, None] * h + \
            (dt_t.float()[:, :, None] * x_t.float())[..., None] * B_t.float()[:, None, None, :]
        y = torch.einsum("bhpn,bn->bhp", h, C_t.float()) + D.float()[:, None] * x_t.float()
        return h, y.to(x_t.dtype)
    h0 = torch.zeros(b, H, Pd, B.shape[-1], dtype=torch.float32, device=x.device)
    hT, ys = scan(combine, h0, (x, dt, B, C), dim=1)
    return ys, hT


def gated_scan_cast(x, gate, z, w):
    def combine(h, xs):
        x_t, g_t, z_t = xs
        f = torch.sigmoid(g_t.float() + w.float())
        h = f * h + (1 - f) * torch.tanh(x_t.float())
        return h, (h * F.silu(z_t.float()) + 0.5 * h).to(x_t.dtype)
    h0 = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device)
    hT, ys = scan(combine, h0, (x, gate, z), dim=1)
    return ys, hT


def mamba1_keepdim(x, dt, A, B, C, D, z, bias):
    """A per-step output with a size-1 dim (sum with keepdim) and the final state."""
    h = torch.zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        delta = F.softplus(dt[:, t] + bias)
        h = torch.exp(delta.unsqueeze(-1) * A) * h + (delta * x[:, t]).unsqueeze(-1) * B[:, t].unsqueeze(1)
        ys.append((h * C[:, t].unsqueeze(1)).sum(-1, keepdim=True))
    return torch.stack(ys, 1), h


def mamba2_sum_two_axes(x, dt, A, B, C, D):
    """The readout sums over two state axes (p and n): not what the kernel holds in registers."""
    b, L, H, Pd = x.shape
    h = x.new_zeros(b, H, Pd, B.shape[-1])
    ys = []
    for t in range(L):
        h = torch.exp(dt[:, t] * A)[:, :, None, None] * h + \
            (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]
        ys.append((h * C[:, t, None, None, :]).sum((-1, -2)))
    return torch.stack(ys, 1)


# -- fixtures and helpers ---------------------------------------------------------------------------

def poison_outputs(monkeypatch):
    """Every output the kernel allocates starts as NaN: an element it does not write shows."""
    orig = T.TritonKernel.allocate

    def poisoned(specs, dev):
        return [o.fill_(float("nan")) if o.is_floating_point() else o for o in orig(specs, dev)]
    monkeypatch.setattr(T.TritonKernel, "allocate", staticmethod(poisoned))


@pytest.fixture
def interp(monkeypatch, tmp_path):
    """Triton's CPU interpreter on, a fresh kernel cache, outputs poisoned."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path / "cache"))
    poison_outputs(monkeypatch)
    return tmp_path


def pin(monkeypatch, variant: str):
    """Only configs of one kernel variant are candidates."""
    table = dict(T.load_configs())
    for k, v in table.items():
        if isinstance(v, list):
            table[k] = [c for c in v if c["variant"] == variant]
    monkeypatch.setattr(T, "load_configs", lambda: table)


def run_triton(fn, inputs, variant=None, **options):
    """Compile with target "triton" and run once; the Triton kernel must have run."""
    out, report = ssmc_run(fn, inputs, target="triton", **options)
    assert len(report.regions) == 1, str(report)
    info = report.regions[0]
    assert info.target == "triton", str(report)
    entry = lookup(info.key)
    kern = entry.kernel
    assert entry.target == "triton" and entry.failure is None, entry.failure
    assert isinstance(kern, T.TritonKernel) and kern.fallback is None, kern.fallback
    assert kern.config is not None
    if variant:
        assert kern.config["variant"] == variant
    return as_tuple(out), report, kern


def check(fn, inputs, variant=None, tol=None, **options):
    out, report, kern = run_triton(fn, inputs, variant, **options)
    ref = reference(fn, inputs)
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        err = rel_err(o, r)
        assert err <= (tol or TOL[inputs[0].dtype]), f"rel err {err:.3g}\n{report}"
    return report, kern


def region_of(fn, inputs) -> Region:
    return ssmc_run(fn, inputs, target="torch")[1].regions[0].ir


def region_inputs(region: Region, fn, args) -> list:
    """The region's inputs for a call fn(*args): Dynamo names a graph input for argument `x`
    "l_x_"; the initial state, created inside the loop, is zeros of the state's shape."""
    import inspect
    params = {p.lower(): a for p, a in zip(inspect.signature(fn).parameters, args)}
    dev = args[0].device
    out = []
    for i, spec in enumerate(region.inputs):
        base = spec.name.split(" ")[0]               # "l_dt_ (time along dim 1)" -> "l_dt_"
        name = base[2:-1] if base.startswith("l_") and base.endswith("_") else None
        if name in params:
            out.append(params[name])
        elif i == region.init:
            out.append(None)
        else:
            raise KeyError(f"region input {spec.name} is not an argument of {fn.__name__}")
    sizes = {a: out[i].shape[d] for a, (i, d) in zip(region.axes, region.axis_size) if out[i] is not None}
    if region.init is not None:
        out[region.init] = torch.zeros([sizes[a] for a in region.axes], dtype=ir.to_dtype(
            region.inputs[region.init].dtype), device=dev)
    return out


def match_outputs(got, want):
    """Region outputs against the function's outputs, paired by shape."""
    want = list(want)
    pairs = []
    for g in got:
        j = next(j for j, w in enumerate(want) if tuple(w.shape) == tuple(g.shape))
        pairs.append((g, want.pop(j)))
    return pairs


def ast_source(fn, signature, constexprs):
    try:
        return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    except TypeError:       # older Triton spelled it `constants`
        return triton.compiler.ASTSource(fn=fn, signature=signature, constants=constexprs)


# -- compile-only for sm_80 / sm_90 -------------------------------------------------------------------

COMPILE_PROGRAMS = {
    "mamba1": (lambda: P.mamba1("final"), lambda: P.mamba1_inputs(seed=1)),
    "mamba2": (lambda: P.mamba2("final"), lambda: P.mamba2_inputs(seed=2, with_h0=True)),
    "gated": (P.gated, lambda: P.gated_inputs(seed=3)),
}


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("name", sorted(COMPILE_PROGRAMS))
def test_compiles_for_sm80_sm90_without_gpu(name, cc, monkeypatch, tmp_path):
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    build, make = COMPILE_PROGRAMS[name]
    region = region_of(build(), make())
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options(cache_dir=str(tmp_path)))
    seq = {i: torch.bfloat16 for i, s in enumerate(region.inputs) if i != region.init and s.ndim >= 3}
    block_n = 16 if kern.plan.reg else 1
    table = T.load_configs()[f"sm_{cc}"]
    for variant in VARIANTS + ["seq4"] if kern.plan.reg else FLAT_VARIANTS:
        cfg = next(c for c in table if c["variant"] == variant)
        fn, sig, cx = kern.signature(cfg, block_n, seq)
        assert isinstance(fn, triton.runtime.jit.JITFunction)
        assert "*bf16" in sig.values()
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        ptx = ck.asm["ptx"]
        assert f".target sm_{cc}" in ptx and ck.asm.get("cubin")
        assert "ex2.approx" in ptx                        # exps are exp2 on the SFU
    if kern.plan.reg:       # rows with part of the state axis unrolled, registers capped
        cfg = {"variant": "rows", "BLOCK_D": 1, "CHUNK": 256, "num_warps": 1, "num_stages": 1,
               "maxnreg": 128, "UNROLL": 4}
        fn, sig, cx = kern.signature(cfg, block_n, seq)
        assert cx["UNROLL_N"] == 4
        opts = T.launch_options(cfg, torch.device("cuda"))
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32), options=opts)
        assert ".maxnreg 128" in ck.asm["ptx"] and ck.asm.get("cubin")


def test_every_op_compiles_for_sm90(monkeypatch, tmp_path):
    """Every printed op form (the op-coverage region below) is valid Triton for the GPU."""
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    region = _op_region()
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options(cache_dir=str(tmp_path)))
    cfg = next(c for c in T.load_configs()["sm_90"] if c["variant"] == "scan")
    fn, sig, cx = kern.signature(cfg, 1)
    ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": cfg["num_warps"]})
    assert ".target sm_90" in ck.asm["ptx"]


# -- the plan and the rendered source -------------------------------------------------------------------

def test_plan_mamba1_mamba2_gated():
    m1 = T.make_plan(region_of(P.mamba1("stack"), P.mamba1_inputs(seed=4)))
    assert (m1.reg, m1.block, m1.scalars) == ("i2", "i1", ("i0",))       # n in registers, d blocked, b
    m2 = T.make_plan(region_of(P.mamba2("stack"), P.mamba2_inputs(seed=5)))
    assert (m2.reg, m2.block, m2.scalars) == ("i3", "i2", ("i0", "i1"))  # n; p blocked; b, head
    g = T.make_plan(region_of(P.gated(), P.gated_inputs(seed=6)))
    assert (g.reg, g.block, g.scalars) == (None, "i1", ("i0",))


def _body(src: str, variant: str) -> str:
    start = src.index(f"_{variant}(\n")
    end = src.find("@triton.jit", start)
    return src[start:end if end > 0 else None]


def test_rendered_source_hoists_and_folds():
    r = region_of(P.mamba1("stack"), P.mamba1_inputs(seed=7))
    src = T.render(r, T.make_plan(r))
    compile(src, "<kernel>", "exec")
    for variant in FLAT_VARIANTS:
        body = _body(src, variant)
        loop_at = body.index("for t0 in range(")
        before, inside = body[:loop_at], body[loop_at:]
        # A (d, n) is loaded once before the time loop, log2(e) folded into it there
        assert "in2_ptr" in before and "in2_ptr" not in inside
        assert "* 1.4426950408889634" in before
        assert "tl.exp(" not in body                      # every exp is an exp2
        # softplus(dt + bias) is per (b, d, t): dt's load reads channel offsets, no state offsets
        assert len([l for l in inside.splitlines() if "_log1p(" in l]) == (2 if variant == "loop" else 1)
        dt_line = next(l for l in inside.splitlines() if "in0_ptr" in l)
        assert re.search(r"\bod3?\b", dt_line) and not re.search(r"\bon3?\b", dt_line)
        assert "_sum(" in inside                           # the readout is a register reduction
    assert "tl.associative_scan(" in _body(src, "scan")
    # rows: per chunk, softplus(dt + bias) once outside the loop over n; A (d, n) loaded as a
    # tile before the time loop with log2(e) folded there, its column n read inside the loop;
    # the readout accumulated across the loop, no register sum
    body = _body(src, "rows")
    loop_at = body.index("for t0 in tl.range(0, L_full, CHUNK, num_stages=NUM_STAGES):")
    before, chunks = body[:loop_at], body[loop_at:]
    # whole chunks with a constant time mask (its selects fold away), then the partial last one
    full, tail = chunks.split("for t0 in range(L_full, L, CHUNK):")
    assert "mt = tl.full((1, CHUNK), 1, tl.int1)" in full and "mt = tt < L" in tail
    chunk = full
    outer, inner = chunk.split("for n in tl.static_range(BLOCK_N):")
    inner, after = inner.split("\n        v", 1)          # the loop body ends at the chunk's indent
    assert "_log1p(" in outer and "_log1p(" not in inner
    assert "in2_ptr" in before and "in2_ptr" not in chunk and "* 1.4426950408889634" in before
    assert re.search(r"tl\.where\(on == n, p\d+, 0\.0\)", inner)
    assert "acc0 += tl.where(nm, " in inner and "acc0" in after and "tl.store(out0_ptr" in after
    assert "tl.associative_scan((a, b), axis=1" in inner and "_sum(tl.where(mn" not in body
    # Mamba-2: the decay is one scalar per program and step (no offsets, no mask)
    r2 = region_of(P.mamba2("stack"), P.mamba2_inputs(seed=8))
    body = _body(T.render(r2, T.make_plan(r2)), "loop")
    dt_line = next(l for l in body.splitlines() if "tl.load(in0_ptr" in l)
    assert "mask" not in dt_line and not re.search(r"\bo[dn]3?\b", dt_line)


# -- numerics under the interpreter ---------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["stack", "setitem"])
def test_mamba1_forms(form, variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    # L=9: chunks of 4 and a remainder; d=6: a partial channel block; n=5: masked register lanes
    check(P.mamba1(form), P.mamba1_inputs(b=2, L=9, d=6, n=5, seed=len(form)), variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mamba1_scan_hop_bdl_and_h0(variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    check(P.mamba1_scan(), P.mamba1_inputs(L=7, seed=21), variant)
    check(P.mamba1_bdl(), P.mamba1_inputs(L=6, layout="bdl", seed=22), variant)
    x, dt, A, B, C, *_ = P.mamba1_inputs(L=5, seed=23)
    h0 = torch.randn(x.shape[0], x.shape[2], A.shape[1])
    check(P.mamba1_h0(), (x, dt.abs(), A, B, C, h0), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("h0", [False, True])
def test_mamba2(h0, variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    rep, kern = check(P.mamba2("final"), P.mamba2_inputs(L=9, P=6, seed=24, with_h0=h0), variant)
    assert rep.regions[0].ir.decay_kind == "shared"


@pytest.mark.parametrize("variant", VARIANTS)
def test_s4d_and_gated(variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    rep, _ = check(P.s4d(), P.s4d_inputs(L=10, seed=25), variant)
    assert rep.regions[0].ir.decay_kind == "lti"
    if variant in FLAT_VARIANTS:
        rep, kern = check(P.gated(), P.gated_inputs(L=9, d=5, seed=26), variant)
        assert kern.plan.reg is None
    else:
        r = region_of(P.gated(), P.gated_inputs(seed=26))
        assert "no register axis" in T.rows_declines(r, T.make_plan(r))


@pytest.mark.parametrize("variant", VARIANTS)
def test_scan_forms_bf16(variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    bf = torch.bfloat16
    check(mamba1_scan_cast, P.mamba1_inputs(L=6, dtype=bf, seed=27), variant, rest="eager")
    check(mamba2_scan_cast, P.mamba2_inputs(L=6, dtype=bf, seed=28), variant, rest="eager")
    if variant in FLAT_VARIANTS:
        check(gated_scan_cast, P.gated_inputs(L=6, dtype=bf, seed=29), variant, rest="eager")


@pytest.mark.parametrize("variant", VARIANTS)
def test_edge_shapes(variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    check(P.mamba1_scan(), P.mamba1_inputs(L=1, seed=30), variant)                 # one step
    fn = P.mamba1("final")                                    # and a kernel of 9 steps run for 1
    region = region_of(fn, P.mamba1_inputs(L=9, seed=30))
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    args = P.mamba1_inputs(L=1, seed=30)
    for g, w in match_outputs(kern.forward(region_inputs(region, fn, args)), reference(fn, args)):
        assert rel_err(g, w) <= TOL[torch.float32]
    assert kern.fallback is None and kern.config["variant"] == variant
    check(mamba1_keepdim, P.mamba1_inputs(L=5, d=6, n=4, seed=31), variant)       # (b, L, d, 1) output
    x, dt, A, B, C, D, z, bias = P.mamba1_inputs(L=5, d=6, n=4, seed=32, layout="bdl")
    strided = (x.transpose(1, 2), dt.transpose(1, 2), A.t().contiguous().t(), B.transpose(1, 2),
               C.transpose(1, 2), D, z.transpose(1, 2), bias)
    assert not strided[0].is_contiguous() and not strided[2].is_contiguous()
    check(P.mamba1("final"), strided, variant)                                     # strides at run time


def test_one_input_read_along_two_state_axes(interp):
    """k k^T: two loads of one input with different indices in the drive."""
    g = torch.Generator().manual_seed(36)
    check(P.covariance, (torch.randn(2, 9, 5, generator=g), torch.rand(2, 9, generator=g),
                         torch.randn(2, 9, 5, generator=g)))


def test_mamba1_fp64_computes_in_fp64(interp):
    rep, kern = check(P.mamba1("final"), P.mamba1_inputs(L=5, dtype=torch.float64, seed=33))
    assert "compute dtype tl.float64" in kern.source


@pytest.mark.parametrize("n", [4, 5])
def test_rows_every_config(n, interp):
    """Every interpreter config of the rows variant (all state indices unrolled, or UNROLL of
    them per iteration of a loop), a state axis that fills BLOCK_N (EVEN_N) and one that does
    not, a partial channel block and a length that is no multiple of CHUNK."""
    fn = P.mamba1("final")
    args = P.mamba1_inputs(L=11, d=3, n=n, seed=50 + n)
    region = region_of(fn, args)
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    rin = region_inputs(region, fn, args)
    want = reference(fn, args)
    cfgs = [c for c in kern.candidates(rin, None) if c["variant"] == "rows"]
    assert any("UNROLL" in c for c in cfgs) and any("UNROLL" not in c for c in cfgs)
    for cfg in cfgs:
        outs = [o.fill_(float("nan")) for o in kern.outputs(rin)]
        for g, w in match_outputs(kern.launch(rin, cfg, outs), want):
            assert rel_err(g, w) <= TOL[torch.float32], f"n={n} {cfg}"


def only(monkeypatch, cfg: dict):
    """The interpreter's one candidate config is `cfg`."""
    table = dict(T.load_configs())
    table["interpreter"] = [cfg]
    monkeypatch.setattr(T, "load_configs", lambda: table)


ROWS_PREFETCH = [
    {"variant": "rows", "BLOCK_D": 2, "CHUNK": 4, "num_warps": 1, "num_stages": 1, "PREFETCH": 1},
    {"variant": "rows", "BLOCK_D": 1, "CHUNK": 4, "num_warps": 1, "num_stages": 2, "PREFETCH": 1, "UNROLL": 2},
]


@pytest.mark.parametrize("cfg", ROWS_PREFETCH, ids=["unrolled", "unroll2"])
def test_rows_prefetch(cfg, interp, monkeypatch):
    """PREFETCH (the loads once per chunk double-buffered across the whole chunks) end to end
    against the reference: whole chunks and a partial one, whole chunks only, no whole chunk,
    a state axis that does not fill BLOCK_N, a partial channel block, (b, d, L) and strided
    inputs, an initial state, bf16 inputs, Mamba-2."""
    only(monkeypatch, cfg)
    _, kern = check(P.mamba1("final"), P.mamba1_inputs(L=11, d=3, n=5, seed=70), "rows")    # 2 whole + 3
    assert kern.config["PREFETCH"] == 1 and kern.rows_buffers() == 3                     # dt, x, z
    body = _body(kern.source, "rows")
    assert len(re.findall(r"v\d+_q = tl\.load\(", body)) == 3 and "if PREFETCH else tl.load(" in body
    check(P.mamba1("final"), P.mamba1_inputs(L=8, d=4, n=4, seed=71), "rows")            # whole chunks only
    check(P.mamba1_scan(), P.mamba1_inputs(L=3, seed=72), "rows")                        # no whole chunk
    check(P.mamba1_bdl(), P.mamba1_inputs(L=9, layout="bdl", seed=73), "rows")
    x, dt, A, B, C, *_ = P.mamba1_inputs(L=10, seed=74)
    check(P.mamba1_h0(), (x, dt.abs(), A, B, C, torch.randn(x.shape[0], x.shape[2], A.shape[1])), "rows")
    x, dt, A, B, C, D, z, bias = P.mamba1_inputs(L=9, d=6, n=4, seed=75, layout="bdl")
    strided = (x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D,
               z.transpose(1, 2), bias)
    check(P.mamba1("final"), strided, "rows")
    check(mamba1_scan_cast, P.mamba1_inputs(L=10, dtype=torch.bfloat16, seed=76), "rows", rest="eager")
    check(P.mamba2("final"), P.mamba2_inputs(L=9, P=6, seed=77, with_h0=True), "rows")


def mamba1_states_out(x, dt, A, B, C, D, z, bias):
    """Mamba-1's recurrence returning its readout and every step's state (a per-step output
    indexed by the register axis n)."""
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys, hs = [], []
    for t in range(x.shape[1]):
        delta = F.softplus(dt[:, t] + bias)
        h = torch.exp(delta[..., None] * A) * h + (delta * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
        hs.append(h * 2.0)
    return torch.stack(ys, 1), torch.stack(hs, 1)


SEQ = [
    {"variant": "seq2", "BLOCK_D": 2, "CHUNK": 4, "num_warps": 1, "num_stages": 1},
    {"variant": "seq4", "BLOCK_D": 4, "CHUNK": 2, "num_warps": 1, "num_stages": 1},
    # the whole chunks in a loop over intervals of 4 steps (2 chunks an interval)
    {"variant": "seq2", "BLOCK_D": 2, "CHUNK": 2, "NEST": 4, "num_warps": 1, "num_stages": 1},
]


@pytest.mark.parametrize("cfg", SEQ, ids=["s2", "s4", "s2_nest"])
def test_seq_variant(cfg, interp, monkeypatch):
    """The seq variant (the register axis split over lanes and unrolled copies, steps along a
    thread-local time axis) end to end against the reference: whole chunks and a partial one, a
    state axis that does not fill BLOCK_N (and one whose BLOCK_N the copies do not divide:
    another variant runs), a partial channel block, (b, d, L) and strided inputs, an initial
    state and the final state, bf16 and fp64 inputs, Mamba-2."""
    only(monkeypatch, cfg)
    _, kern = check(P.mamba1("final"), P.mamba1_inputs(L=11, d=3, n=6, seed=90), cfg["variant"])
    body = _body(kern.source, cfg["variant"])
    assert "= _steps(a, b, hc" in body and "_sum(acc0, 1)" in body
    assert kern.config == cfg                            # L11: NEST kept (more than one interval)
    check(P.mamba1("final"), P.mamba1_inputs(L=8, d=4, n=4, seed=91), cfg["variant"])
    check(P.mamba1_scan(), P.mamba1_inputs(L=3, seed=92), cfg["variant"])            # no whole chunk
    check(P.mamba1_bdl(), P.mamba1_inputs(L=9, layout="bdl", seed=93), cfg["variant"])
    x, dt, A, B, C, *_ = P.mamba1_inputs(L=10, seed=94)
    check(P.mamba1_h0(), (x, dt.abs(), A, B, C, torch.randn(x.shape[0], x.shape[2], A.shape[1])), cfg["variant"])
    x, dt, A, B, C, D, z, bias = P.mamba1_inputs(L=9, d=6, n=4, seed=95, layout="bdl")
    strided = (x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), D,
               z.transpose(1, 2), bias)
    check(P.mamba1("final"), strided, cfg["variant"])
    check(mamba1_scan_cast, P.mamba1_inputs(L=10, dtype=torch.bfloat16, seed=96), cfg["variant"], rest="eager")
    check(P.mamba2("final"), P.mamba2_inputs(L=9, P=6, seed=97, with_h0=True), cfg["variant"])
    check(P.mamba1("final"), P.mamba1_inputs(L=6, d=5, n=8, dtype=torch.float64, seed=98), cfg["variant"])


def test_seq_declines_and_candidates(monkeypatch):
    """seq configs are candidates only where S divides BLOCK_N; regions without a register axis
    (the gated recurrence) or whose per-step output indexes it are declined."""
    gated = region_of(P.gated(), P.gated_inputs(L=7, seed=98))
    assert T.seq_declines(gated, T.make_plan(gated)) == "no register axis to loop over"
    per_state = region_of(mamba1_states_out, P.mamba1_inputs(L=5, seed=98))
    assert "indexes the register axis" in T.seq_declines(per_state, T.make_plan(per_state))
    fn = P.mamba1("final")
    region = region_of(fn, P.mamba1_inputs(L=9, n=16, seed=99))
    assert T.seq_declines(region, T.make_plan(region)) is None
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    table = dict(T.load_configs())
    table["sm_90"] = [dict(SEQ[0], CHUNK=16), dict(SEQ[1], CHUNK=16), {"variant": "seq8", "BLOCK_D": 4, "CHUNK": 16,
                      "num_warps": 1, "num_stages": 1}]
    monkeypatch.setattr(T, "load_configs", lambda: table)
    for n, want in ((16, {"seq2", "seq4", "seq8"}), (4, {"seq2", "seq4"}), (2, {"seq2"})):
        args = P.mamba1_inputs(b=1, L=64, d=8, n=n, seed=99)
        got = {c["variant"] for c in kern.candidates(region_inputs(region, fn, args), 90)}
        assert got == want, (n, got)


def test_autotune_prunes_slow_families(monkeypatch, tmp_path):
    """autotune='prune' times each variant family's first config, then the rest of only the
    families within prune_ratio of the best first one (a family whose first config fails is
    skipped too) and says what it skipped; autotune='all' times every candidate, and does not
    take the pruned search's cached pick."""
    fn = P.mamba1("final")
    region = region_of(fn, P.mamba1_inputs(L=9, n=16, seed=77))
    rin = region_inputs(region, fn, P.mamba1_inputs(b=1, L=64, d=8, n=16, seed=77))
    lead_ms = {"seq": 1.0, "scan": 1.4, "rows": 2.0}          # loop's first config fails

    def fake(kern, timed):
        firsts = {}

        def time_config(inputs, c, cuda):
            fam = T._family(c)
            timed.append(c)
            if fam not in firsts:
                firsts[fam] = c
                if fam == "loop":
                    raise RuntimeError("out of resources")
                return lead_ms[fam]
            return lead_ms.get(fam, 3.0) * 0.9 - 0.01 * len(timed)
        monkeypatch.setattr(kern, "_time_config", time_config)

    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options(cache_dir=str(tmp_path)))
    cands = kern.candidates(rin, 90)
    fams = {f: [c for c in cands if T._family(c) == f] for f in ("seq", "rows", "scan", "loop")}
    assert all(len(v) > 1 for v in fams.values()), fams
    timed = []
    fake(kern, timed)
    best = kern._config(rin, 90)                   # autotunes, and caches the pick
    want = fams["seq"] + fams["scan"] + fams["rows"][:1] + fams["loop"][:1]
    assert sorted(map(str, timed)) == sorted(map(str, want))
    assert T._family(best) == "seq" and best != fams["seq"][0]   # the fastest of the timed seq configs
    why = " ".join(next(iter(kern.pruned.values())))
    assert f"{len(fams['rows']) - 1} more rows" in why and "2.00x" in why and "loop config failed" in why
    assert "autotune for sm_90 skipped" in T.TritonTarget().source(kern)

    kern = T.TritonTarget().compile(region, "chunked_scan",
                                    ssmc.make_options(cache_dir=str(tmp_path), autotune="all"))
    timed = []
    fake(kern, timed)
    kern._config(rin, 90)                          # the same cache: a full search is not the pruned one's
    assert len(timed) == len(cands) and not kern.pruned
    with pytest.raises(ValueError, match="autotune"):
        ssmc.make_options(autotune="some")


def test_rows_prefetch_candidates(monkeypatch):
    """PREFETCH configs are candidates where the rows kernel has loads to double-buffer, and
    their buffers count against max_tile_per_thread."""
    fn = P.mamba1("final")
    args = P.mamba1_inputs(b=1, L=4096, d=2, n=16, dtype=torch.bfloat16, seed=78)
    region = region_of(fn, P.mamba1_inputs(L=9, n=16, seed=78))
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    rin = region_inputs(region, fn, args)
    table = dict(T.load_configs())              # no sm_90 entry uses PREFETCH (measured slower): add two
    table["sm_90"] = table["sm_90"] + [dict(c, PREFETCH=1) for c in table["sm_90"]
                                       if c["variant"] == "rows" and c["CHUNK"] == 256 and c.get("UNROLL") in (None, 8)
                                       and "maxnreg" not in c]
    monkeypatch.setattr(T, "load_configs", lambda: table)
    pf = [c for c in kern.candidates(rin, 90) if c.get("PREFETCH")]
    assert {c.get("UNROLL") for c in pf} == {None, 8} and all(c["CHUNK"] == 256 for c in pf)
    table = dict(table)
    table["max_tile_per_thread"] = 16           # CHUNK 256 a warp: 8 a thread, 32 with dt, x, z buffered
    monkeypatch.setattr(T, "load_configs", lambda: table)
    cands = kern.candidates(rin, 90)
    assert not any(c.get("PREFETCH") for c in cands)
    assert any(c["variant"] == "rows" and c["CHUNK"] == 256 for c in cands)


def _launch_like(kern, cfg, seq):
    """ASTSource for `cfg` with the hints a launch on contiguous tensors gets: each tensor's
    last stride the constant 1, every other integer argument divisible by 16."""
    fn, sig, cx = kern.signature(cfg, 16, seq)
    names = list(sig)
    last = {}
    for n in names:
        m = re.fullmatch(r"((?:in|out)\d+)_s(\d+)", n)
        if m:
            last[m.group(1)] = max(last.get(m.group(1), -1), int(m.group(2)))
    for base, d in last.items():
        sig[f"{base}_s{d}"] = "constexpr"
        cx[f"{base}_s{d}"] = 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] != "constexpr"}
    return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cx.items()},
                                     attrs=attrs)


@pytest.mark.parametrize("cc", [80, 90])
def test_seq_keeps_time_in_registers(cc, monkeypatch, tmp_path):
    """The seq kernel compiled with the hints a launch on time-contiguous tensors gets: every
    tile takes the loads' layout (a thread's CHUNK steps in its registers), so its only
    shuffles are the readout's sum over a row's NQ lanes, log2(NQ) rounds a step in each of the
    two chunk loops (Triton put the scan's time axis across 8 lanes, 272 shuffles in the loop,
    where B and C loaded as (1, NQ, CHUNK) tiles)."""
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    region = region_of(P.mamba1_bdl(), P.mamba1_inputs(layout="bdl", seed=1))       # (b, d, L): time contiguous
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options(cache_dir=str(tmp_path)))
    seq = {i: torch.bfloat16 for i, s in enumerate(region.inputs) if i != region.init and s.ndim >= 3}
    cfg = {"variant": "seq4", "BLOCK_D": 8, "CHUNK": 8, "num_warps": 1, "num_stages": 1}
    ck = triton.compile(_launch_like(kern, cfg, seq), target=GPUTarget("cuda", cc, 32),
                        options=T.launch_options(cfg, torch.device("cuda")))
    ptx = ck.asm["ptx"]
    assert ptx.count("shfl.sync") <= 2 * cfg["CHUNK"] * 2, ptx.count("shfl.sync")     # NQ = 16 / 4 lanes
    assert ptx.count("ex2.approx") >= 2 * 4 * cfg["CHUNK"]                              # an exp a state-step


@pytest.mark.parametrize("cfg", [
    {"variant": "rows", "BLOCK_D": 1, "CHUNK": 256, "num_warps": 1, "num_stages": 1, "PREFETCH": 1},
    {"variant": "rows", "BLOCK_D": 1, "CHUNK": 256, "num_warps": 1, "num_stages": 1, "UNROLL": 8, "PREFETCH": 1},
    {"variant": "rows", "BLOCK_D": 1, "CHUNK": 256, "num_warps": 1, "num_stages": 2},
], ids=["prefetch", "prefetch_unroll8", "stages2"])
def test_rows_prefetch_compiles_for_sm90(cfg, monkeypatch, tmp_path):
    """The double-buffered rows kernel compiles for sm_90 ((b, d, L) inputs: time contiguous, as
    rows wants): the whole-chunk loop carries the bf16 rows of the next chunk (dt and x here);
    with num_stages 2 Triton's pipeliner stages the chunk's loads in shared memory (async
    copies) instead."""
    from triton.backends.compiler import GPUTarget
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    region = region_of(P.mamba1_bdl(), P.mamba1_inputs(layout="bdl", seed=1))
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options(cache_dir=str(tmp_path)))
    seq = {i: torch.bfloat16 for i, s in enumerate(region.inputs) if i != region.init and s.ndim >= 3}
    ck = triton.compile(_launch_like(kern, cfg, seq), target=GPUTarget("cuda", 90, 32),
                        options=T.launch_options(cfg, torch.device("cuda")))
    assert ".target sm_90" in ck.asm["ptx"] and ck.asm.get("cubin")
    ttgir = ck.asm["ttgir"]
    loop = next(l for l in ttgir.splitlines() if "scf.for" in l)       # the whole-chunk loop
    carried = loop.split("->", 1)[1].count("x256xbf16")
    assert kern.rows_buffers() == 2 and carried == (2 if cfg.get("PREFETCH") else 0)
    assert ("async_copy_global_to_local" in ttgir) == (cfg["num_stages"] > 1)


def test_autotune_bucket_tells_layouts_apart():
    """The same shapes stored (b, d, L) and (b, L, d) are tuned apart (rows wants time
    contiguous, the loop variant channels)."""
    fn = P.mamba1("final")
    args = P.mamba1_inputs(L=9, seed=60)
    region = region_of(fn, args)
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    rin = region_inputs(region, fn, args)
    moved = [x.transpose(-1, -2).contiguous().transpose(-1, -2) if x is not None and x.dim() == 3 else x for x in rin]
    assert [x.shape for x in moved] == [x.shape for x in rin]
    assert kern.bucket(moved) != kern.bucket(rin)


def fp64_constants(u0, u1):
    """From the GPU fuzzer: constants fp32 cannot hold (0.9, log2 e inside silu) in fp64 code."""
    h = torch.zeros(u0.shape[0], 3, 4, dtype=u0.dtype)
    ys = []
    for t in range(u0.shape[1]):
        h = 0.9 * (h - u0[:, t]) + torch.nn.functional.silu(u1[:, t]) * 0.3
        ys.append((h * u1[:, t]).sum(-1))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("variant", ["loop", "scan"])
def test_fp64_constants_stay_fp64(variant, interp, monkeypatch):
    pin(monkeypatch, variant)
    g = torch.Generator().manual_seed(35)
    u0, u1 = torch.randn(2, 19, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, 19, 3, 4, generator=g,
                                                                                    dtype=torch.float64)
    rep, kern = check(fp64_constants, [u0, u1], variant, tol=1e-12)
    assert "tl.full((), 0.9, tl.float64)" in kern.source


def test_mamba1_bf16_casts(interp):
    check(P.mamba1_cast(), P.mamba1_inputs(L=6, dtype=torch.bfloat16, seed=34))


# -- every elementwise op -----------------------------------------------------------------------------------

def _op_region() -> Region:
    X, W, H = Load(0, ("i0", "t", "i1")), Load(1, ("i1",)), State()
    c = Const
    Pos = Op("add", (Op("abs", (X,)), c(0.5)))

    def o(name, *args, **attrs):
        return Op(name, tuple(args), tuple(sorted(attrs.items())))
    small = o("mul", X, c(1e-3))
    exprs = [
        o("add", X, H), o("sub", X, W), o("mul", X, H), o("div", X, Pos),
        o("pow", Pos, X), o("pow", X, c(2.0)), o("pow", X, c(3.0)), o("pow", Pos, c(0.5)),
        o("pow", Pos, c(-0.5)), o("pow", Pos, c(-1.0)), o("pow", Pos, c(-2.0)), o("pow", X, c(5.0)),
        o("pow", Pos, c(1.7)), o("pow", c(2.0), X), o("pow", X, c(0.0)), o("pow", X, c(1.0)),
        o("maximum", X, H), o("minimum", X, W), o("maximum", X, c(0.1)), o("minimum", c(-0.2), H),
        o("gt", X, W), o("lt", X, W), o("ge", X, c(0.0)), o("le", X, H), o("eq", X, X), o("ne", X, W),
        o("where", o("gt", X, W), X, H), o("where", o("lt", X, c(0.0)), c(1.0), H),
        o("neg", X), o("exp", X), o("exp", o("mul", X, W)), o("exp", o("mul", c(0.5), X)),
        o("exp2", X), o("expm1", X), o("expm1", small), o("log", Pos), o("log1p", o("sub", Pos, c(0.4))),
        o("log1p", o("mul", X, c(1e-4))), o("sqrt", Pos), o("rsqrt", Pos), o("tanh", X), o("tanh", small),
        o("tanh", o("mul", X, c(30.0))), o("sigmoid", o("mul", X, c(10.0))),
        o("logsigmoid", o("mul", X, c(10.0))), o("softplus", X, beta=1.0, threshold=20.0),
        o("softplus", X, beta=2.0, threshold=3.0),
        o("softplus", o("mul", X, c(30.0)), beta=1.0, threshold=20.0),
        o("silu", X), o("relu", X), o("abs", X), o("reciprocal", Pos), o("sin", X), o("cos", X),
        o("cast", o("mul", X, c(3.0)), dtype="int64"), o("cast", o("gt", X, c(0.0)), dtype="float32"),
        o("cast", o("relu", X), dtype="bool"), o("mul", o("add", c(1.0), c(2.0)), X),
    ]
    names = {x.name for e in exprs for x in ir.walk(e) if isinstance(x, Op)}
    assert set(ssmc.ops.ELEMENTWISE) <= names
    outs = tuple(OutputSpec("steps", e, ("i0", "t", "i1"), "float32") for e in exprs)
    outs += (OutputSpec("final", o("mul", H, o("cos", X)), ("i0", "i1"), "float32"),)
    return Region("ops", ("i0", "i1"), ((0, 0), (0, 2)), (0, 1),
                  (InputSpec("x", 3, "float32"), InputSpec("w", 1, "float32"), InputSpec("h0", 2, "float32")),
                  o("sigmoid", o("add", X, W)), o("mul", o("tanh", X), c(0.3)), outs, init=2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")    # numpy: log(0) in unselected branches
@pytest.mark.parametrize("variant", FLAT_VARIANTS)
def test_every_elementwise_op(variant, interp, monkeypatch):
    from ssmc.targets.reference import ReferenceKernel
    pin(monkeypatch, variant)
    region = _op_region()
    assert T.TritonTarget().supports(region, "chunked_scan", None, "cpu") is True
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    g = torch.Generator().manual_seed(35)
    inputs = [torch.randn(2, 6, 5, generator=g), torch.randn(5, generator=g), torch.randn(2, 5, generator=g)]
    got = kern.forward(inputs)
    assert kern.fallback is None and kern.config["variant"] == variant
    want = ReferenceKernel(region).forward([x.double() for x in inputs])
    for o, w, spec in zip(got, want, region.outputs):
        err = rel_err(o, w.double())
        assert err <= 1e-5, f"{spec.expr}: rel err {err:.3g}"


def test_sum_of_a_value_constant_along_the_register_axis(interp):
    """sum over n of x[b, t] (constant along n) is n * x, as in the reference."""
    from ssmc.targets.reference import ReferenceKernel
    X, Cn = Load(0, ("i0", "t")), Load(1, ("i0", "t", "i1"))
    red = Reduce(Op("mul", (State(), Cn)), ("i1",))
    const = Reduce(X, ("i1",))
    out = OutputSpec("steps", Op("add", (red, const)), ("i0", "t"), "float32")
    region = Region("rc", ("i0", "i1"), ((1, 0), (1, 2)), (0, 1),
                    (InputSpec("x", 2, "float32"), InputSpec("c", 3, "float32"), InputSpec("h0", 2, "float32")),
                    Const(0.9), Op("mul", (X, Cn)), (out,), init=2)
    assert T.make_plan(region).reg == "i1"
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    g = torch.Generator().manual_seed(45)
    inputs = [torch.randn(3, 7, generator=g), torch.randn(3, 7, 5, generator=g), torch.randn(3, 5, generator=g)]
    got = kern.forward(inputs)
    want = ReferenceKernel(region).forward([x.double() for x in inputs])
    assert kern.fallback is None and rel_err(got[0], want[0]) <= 1e-5


# -- refusals -------------------------------------------------------------------------------------------

def test_supports_gives_reasons(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = T.TritonTarget()
    r = region_of(P.mamba1("stack"), P.mamba1_inputs(seed=36))
    assert t.supports(r, "chunked_scan", 90, "cuda") is True
    assert t.supports(r, "step", 80, "cuda") is True
    assert "sm_80" in t.supports(r, "chunked_scan", 75, "cuda")
    assert "TRITON_INTERPRET" in t.supports(r, "chunked_scan", None, "cpu")
    assert "reverse" in t.supports(dataclasses.replace(r, reverse=True), "chunked_scan", 90, "cuda")
    odd = dataclasses.replace(r, decay=Op("erf", (r.decay,)))
    assert "erf" in t.supports(odd, "chunked_scan", 90, "cuda")
    two = region_of(mamba2_sum_two_axes, P.mamba2_inputs(seed=37))
    assert "reduce over" in t.supports(two, "chunked_ssd", 90, "cuda")


def test_declined_region_falls_back_to_torch_with_reason(interp):
    ins = P.mamba2_inputs(L=5, seed=38)
    out, report = ssmc_run(mamba2_sum_two_axes, ins, target="triton")
    info = report.regions[0]
    assert info.target == "torch" and "reduce over" in info.target_reasons["triton"], str(report)
    assert rel_err(out, reference(mamba2_sum_two_axes, ins)[0]) <= TOL[torch.float32]


# -- the kernel cache -----------------------------------------------------------------------------------------

def test_cache_second_process_and_same_bucket(interp, monkeypatch):
    fn = P.mamba1("final")
    _, rep, k1 = run_triton(fn, P.mamba1_inputs(L=7, seed=39))
    assert rep.regions[0].cache == "miss" and k1.timings                 # rendered, autotuned
    cfg = k1.config
    src = T.TritonTarget().source(k1)
    assert "kernel cache miss" in src and "config for interpreter" in src and "def ssmc_" in src
    # a new process: nothing in memory, everything from disk
    monkeypatch.setattr(kcache, "_CACHES", {})
    monkeypatch.setattr(T, "_MODULES", {})
    _, rep, k2 = run_triton(fn, P.mamba1_inputs(L=7, seed=40))
    assert rep.regions[0].cache == "hit" and not k2.timings and k2.config == cfg
    # a new length in the same bucket (6 and 7 both round up to 8) reuses the tuned config
    _, rep, k3 = run_triton(fn, P.mamba1_inputs(L=6, seed=41))
    assert rep.regions[0].cache == "hit" and not k3.timings and k3.config == cfg
    # a length in another bucket is tuned anew
    _, rep, k4 = run_triton(fn, P.mamba1_inputs(L=12, seed=42))
    assert k4.timings


def test_corrupt_source_file_is_rewritten(interp, monkeypatch):
    fn = P.gated()
    monkeypatch.setattr(T, "_MODULES", {})          # imported from this test's cache dir
    _, rep, k1 = run_triton(fn, P.gated_inputs(L=4, seed=43))
    k1.path.write_text("this is not python")
    monkeypatch.setattr(kcache, "_CACHES", {})
    monkeypatch.setattr(T, "_MODULES", {})
    out, rep, k2 = run_triton(fn, P.gated_inputs(L=4, seed=44))
    assert k2.path == k1.path and k2.path.read_text() == k2.source


# -- on a GPU ------------------------------------------------------------------------------------------------
# Regions are captured from the naive loops at a small length (Dynamo unrolls the loop: ~15 ms
# a step), then the kernel runs on full-size inputs; a float64 eager run of the same loop is
# the reference. A short end-to-end run through torch.compile checks the wiring on the GPU.

GPU_LENGTHS = [1, 7, 512, 2048, 4096]
GPU_PROGRAMS = {
    "mamba1": (lambda: P.mamba1("final"),
               lambda L, dt: P.mamba1_inputs(b=8, L=L, d=1536, n=16, dtype=dt, seed=L)),
    "mamba2": (lambda: P.mamba2("final"),
               lambda L, dt: P.mamba2_inputs(b=8, L=L, H=24, P=64, N=16, dtype=dt, seed=L)),
    "gated": (P.gated, lambda L, dt: P.gated_inputs(b=8, L=L, d=1536, dtype=dt, seed=L)),
}


def _tol(o) -> float:
    return TOL[torch.bfloat16] if o.dtype == torch.bfloat16 else 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("L", GPU_LENGTHS)
@pytest.mark.parametrize("name", sorted(GPU_PROGRAMS))
def test_gpu_numerics(name, L, dtype, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    poison_outputs(monkeypatch)
    build, make = GPU_PROGRAMS[name]
    fn = build()
    region = region_of(fn, tuple(x[:2, :8].contiguous() if x.dim() >= 3 else x for x in make(8, dtype)))
    strategy = "step" if L <= 4 else "chunked_scan"
    kern = T.TritonTarget().compile(region, strategy, ssmc.make_options(cache_dir=str(tmp_path)))
    assert kern.arch and kern.arch >= 80
    args = tuple(x.cuda() for x in make(L, dtype))
    rin = region_inputs(region, fn, args)
    got = kern.forward(rin)
    torch.cuda.synchronize()
    assert kern.fallback is None, kern.fallback
    ref = reference(fn, args)
    for g, w in match_outputs(got, ref):
        assert g.is_cuda and torch.isfinite(g).all()
        err = rel_err(g, w)
        assert err <= _tol(g), f"{name} L={L} {dtype}: rel err {err:.3g} with config {kern.config}"
    if L in (7, 2048):                       # every candidate config, not only the tuner's pick
        for cfg in kern.candidates(rin, kern.arch):
            for g, w in match_outputs(kern.launch(rin, cfg), ref):
                err = rel_err(g, w)
                assert err <= _tol(g), f"{name} L={L} {dtype} config {cfg}: rel err {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(GPU_PROGRAMS))
def test_gpu_end_to_end(name, dtype, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    poison_outputs(monkeypatch)
    build, make = GPU_PROGRAMS[name]
    args = tuple(x.cuda() for x in make(64, dtype))
    check(build(), args)


@pytest.mark.gpu
def test_gpu_replay_launches_directly(monkeypatch, tmp_path):
    """On a GPU a replay calls the compiled kernel's launcher itself after its first JIT launch:
    fresh data each call, right each time; an input off the 16-byte alignment the kernel was
    specialized on goes back through the JIT (and is right too)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    poison_outputs(monkeypatch)
    fn = P.mamba1("final")
    make = lambda seed: tuple(x.cuda() for x in P.mamba1_inputs(b=2, L=33, d=64, n=16, seed=seed))
    region = region_of(fn, tuple(x.cpu() for x in make(50)))
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options(cache_dir=str(tmp_path)))
    for seed in (51, 52, 53, 54):
        args = make(seed)
        got = kern.forward(region_inputs(region, fn, args))
        for g, w in match_outputs(got, reference(fn, args)):
            assert rel_err(g, w) <= TOL[torch.float32], f"seed {seed}"
    (replay,) = kern._replays.values()
    assert replay.direct.launches == 2                  # calls 3 and 4 (call 2 kept the JIT's kernel)
    args = list(make(55))
    base = torch.empty(args[0].numel() + 1, device="cuda", dtype=args[0].dtype)
    args[0] = base[1:].view_as(args[0]).copy_(args[0])  # same shape and strides, 4 bytes off
    got = kern.forward(region_inputs(region, fn, args))
    assert replay.direct.launches == 2 and len(kern._replays) == 1
    for g, w in match_outputs(got, reference(fn, args)):
        assert rel_err(g, w) <= TOL[torch.float32], "misaligned input"


def test_replayed_launch_reads_new_data(interp):
    """A second call with the same shapes replays the prepared launch: it must read the new
    call's tensors (not the first call's) and write fresh outputs; new strides prepare anew."""
    fn = P.mamba1("final")
    region = region_of(fn, P.mamba1_inputs(L=7, seed=40))
    kern = T.TritonTarget().compile(region, "chunked_scan", ssmc.make_options())
    outs = []
    for seed in (41, 42):
        args = P.mamba1_inputs(L=7, seed=seed)
        got = kern.forward(region_inputs(region, fn, args))
        for g, w in match_outputs(got, reference(fn, args)):
            assert rel_err(g, w) <= TOL[torch.float32], f"seed {seed}"
        outs.append(got)
    assert len(kern._replays) == 1                      # the second call was a replay
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(*outs))
    args = list(P.mamba1_inputs(L=7, seed=43))          # other strides: prepared again
    args[0] = args[0].transpose(1, 2).contiguous().transpose(1, 2)
    got = kern.forward(region_inputs(region, fn, args))
    assert len(kern._replays) == 2
    for g, w in match_outputs(got, reference(fn, args)):
        assert rel_err(g, w) <= TOL[torch.float32]


def test_reverse_time_and_output_before_update(interp):
    """Loops re-rolled into forward regions (a reverse-time loop on flipped reads; a loop whose
    output reads the state before its update, cut one step later) on the Triton kernel."""
    x, dt, A, B, C, D, z, _ = P.mamba1_inputs(L=9, d=6, n=5, seed=31)
    check(P.reversed_loop("list"), (x, dt.abs(), A, B, C, D, z))
    check(P.output_before_update("stack"), P.output_before_update_inputs(L=9, seed=32))


def test_interpreter_self_check(monkeypatch):
    """Under TRITON_INTERPRET=1 the target first runs a one-line kernel looping over an int
    argument; where the interpreter cannot (Triton 3.6 with NumPy 2.4), Triton declines every
    region with that reason instead of failing each kernel at run time."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    T.interpreter_problem.cache_clear()
    try:
        assert T.interpreter_problem() is None        # this environment's interpreter runs it
    finally:
        T.interpreter_problem.cache_clear()
    region = next(iter(ssmc.explain(P.mamba1("stack"), *P.mamba1_inputs(seed=3)).regions)).ir
    assert T.TritonTarget().supports(region, "chunked_scan", None, "cpu") is True
    monkeypatch.setattr(T, "interpreter_problem", lambda: "the interpreter is broken here")
    assert T.TritonTarget().supports(region, "chunked_scan", None, "cpu") == "the interpreter is broken here"
