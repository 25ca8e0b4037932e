"""The backward of regions with a non-diagonal transition (ssmc/targets/mix_adjoint.py): the
derived forward regions its scans run (ssmc.autodiff.chunk_scans), the transition's gradients
without the per-row outer product where the matrix factors, and the same backward with the scans
on the Triton kernel (TRITON_INTERPRET=1) and on the CUDA kernel (the CPU emulator), each against
float64 autograd."""
import pytest
import torch

import block_sparse_programs as P
from conftest import as_tuple, rel_err, ssmc_run
from ssmc import ir
from ssmc.autodiff import chunk_scans, mix_loads
from ssmc.runtime.op import lookup
from ssmc.targets import mix_adjoint as M
from ssmc.targets.reference import grads_by_autograd, run
from test_block_sparse import _emulate_bsp, _region_and_inputs, interp  # noqa: F401
from test_cuda_codegen import emu_dir  # noqa: F401


def case(form, g, dtype=torch.float64):
    mask = P.block_mask(4, 2, 0.25, g)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    if form == "euler_matmul":
        return P.euler_matmul, P.euler_inputs(2, 7, 3, 8, mask, g, dtype)
    if form == "euler_einsum":                   # returns the final state too
        return P.euler_einsum, (r(2, 7), torch.rand(2, 7, generator=g, dtype=dtype) * 0.2, r(8, 8) / 3,
                                mask.to(dtype), r(2, 7, 8), r(2, 7, 8))
    if form == "given_abar":                     # a matrix per row and step: the outer product formed
        return P.given_abar, (r(2, 7), r(2, 7, 8, 8) / 3, r(2, 7, 8), r(2, 7, 8))
    if form == "lti_matmul":
        return P.lti_matmul, (r(2, 7, 3), r(8, 8) / 3, mask.to(dtype), r(2, 7, 8), r(2, 7, 8))
    return P.rotary, (r(2, 7, 3), r(2, 7, 3, 4), torch.rand(2, 7, 3, 4, generator=g, dtype=dtype),
                      r(2, 7, 4), r(2, 7, 4))


def test_chunk_scans_structure(monkeypatch):
    """States and checkpoints read what the forward reads; the adjoint reads only the decay's
    and the matrix's inputs, its matrix is the transpose (the column axis and the state's last
    axis swapped) and so is its block mask; its drive and initial state are extra inputs."""
    g = torch.Generator().manual_seed(1)
    mask = torch.eye(4).repeat_interleave(8, 0).repeat_interleave(8, 1)
    mask[0:8, 16:24] = 1                                   # block (0, 2): not symmetric
    r, xs = _region_and_inputs(P.euler_matmul, P.euler_inputs(2, 7, 3, 32, mask, g), monkeypatch)
    assert r.mix.block == 8 and (0, 2) in r.mix.blocks
    final, states, adjoint = chunk_scans(r, "float64")
    reg = r.axes[-1]
    fwd_reads = {ld.input for e in (r.decay, r.drive, r.mix.expr) for ld in ir.loads(e)}
    assert set(states.reads) >= fwd_reads and states.reads == final.reads
    assert [o.kind for o in states.region.outputs] == ["steps"] and [o.kind for o in final.region.outputs] == ["final"]
    assert states.region.outputs[0].index == ("t", *r.axes)
    assert set(adjoint.reads) == {ld.input for ld in ir.loads(r.mix.expr)}     # dt and W: no x, B, C
    assert adjoint.backwards and adjoint.extra == ("g", "lam0") and states.extra == ("h0",)
    assert not states.backwards and states.time_dims() is None
    assert adjoint.time_dims() == {**{k: d for k, d in enumerate(adjoint.tdim) if d is not None},
                                   len(adjoint.reads): 0}           # g along time, lam0 not
    assert adjoint.region.mix.blocks == tuple(sorted((c, b) for b, c in r.mix.blocks))
    assert (2, 0) in adjoint.region.mix.blocks and (0, 2) not in adjoint.region.mix.blocks
    w = next(ld for ld in ir.loads(r.mix.expr) if reg in ld.index)
    wt = next(ld for ld in ir.loads(adjoint.region.mix.expr) if ir.MIX_COL in ld.index and reg in ld.index)
    assert w.index.index(reg) == wt.index.index(ir.MIX_COL) and w.index.index(ir.MIX_COL) == wt.index.index(reg)
    assert adjoint.region.drive == ir.Load(len(adjoint.reads), ("t", *r.axes))
    # the matrix's gradient factors (no outer product formed) for m = dt W; not for a given Abar_t
    fac, dense = M.split_mix_grads(r, mix_loads(r))
    assert len(fac) == 2 and not dense
    ra, _ = _region_and_inputs(*case("given_abar", g), monkeypatch)
    fac, dense = M.split_mix_grads(ra, mix_loads(ra))
    assert not fac and len(dense) == 1
    # inputs that cannot be cut into chunks of steps: a reason (the backward then runs autograd)
    from ssmc.autodiff import time_dims
    two = ir.Op("add", (ir.Load(0, ("t", "i0")), ir.Load(0, ("i0", "t"))))
    fixed = ir.Op("add", (ir.Load(0, ("t", "i0")), ir.Load(0, (0, "i0"))))
    assert "two dims" in time_dims(r, [two]) and "fixed step" in time_dims(r, [fixed])
    assert time_dims(r, [ir.Load(0, ("t", "i0")), ir.Load(1, ("i0",))]) == {0: 0}


@pytest.mark.parametrize("form", ["euler_matmul", "euler_einsum", "given_abar", "lti_matmul", "rotary"])
@pytest.mark.parametrize("steps", [1, 3, None])
def test_backward_against_autograd(form, steps, monkeypatch):
    """Every input's gradient (the initial state's too) against autograd through the reference
    forward, float64, with chunks of 1, 3 and all 7 steps; each chunk runs the three scans."""
    g = torch.Generator().manual_seed(2)
    r, xs = _region_and_inputs(*case(form, g), monkeypatch)
    outs = run(r, xs)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    calls = []

    def scan(reg, ins):
        calls.append(reg.name.rsplit("_", 1)[1])
        return run(reg, ins)
    got = M.backward(r, xs, grads, needs, scan, steps)
    want = grads_by_autograd(lambda ins: run(r, ins), xs, grads, needs)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if b is not None:
            assert a.shape == b.shape and rel_err(a, b) < 1e-10, (form, i, rel_err(a, b))
    chunks = -(-7 // (steps or 7))
    assert calls == ["final"] * chunks + ["states", "adjoint"] * chunks


def grads_of(fn, xs, compiled, **options):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out, report = ssmc_run(fn, xs, **options) if compiled else (fn(*xs), None)
    loss = sum((o.double() * torch.cos(torch.arange(o.numel(), dtype=torch.float64)).view(o.shape)).sum()
               for o in as_tuple(out))
    return torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True), report


@pytest.mark.parametrize("step_elements", [1, 1 << 25])
@pytest.mark.parametrize("form", ["euler_matmul", "euler_einsum"])
def test_triton_backward_scans(form, step_elements, interp, monkeypatch):
    """The Triton kernel's backward: its scans run on Triton block-sparse kernels (the adjoint's
    with the transposed mask), in chunks of one step and in one chunk; fp32 against float64."""
    monkeypatch.setattr(M, "STEP_ELEMENTS", step_elements)
    monkeypatch.setattr(M, "GPU_STEP_ELEMENTS", step_elements)
    g = torch.Generator().manual_seed(3)
    fn, ins = case(form, g, torch.float32)
    got, report = grads_of(fn, ins, True, target="triton")
    want, _ = grads_of(fn, [x.double() for x in ins], False)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < 1e-5, (i, rel_err(a, b))
    k = lookup(report.regions[0].key).kernel
    assert not k.scans.declined, k.scans.declined
    names = {kk.region.name.rsplit("_", 1)[1]: kk for kk in k.scans.kernels.values()}
    assert set(names) == {"final", "states", "adjoint"}
    assert all(type(kk).__name__ == "BlockSparseKernel" for kk in names.values())
    assert names["adjoint"].region.mix.blocks == tuple(sorted((c, b) for b, c in k.region.mix.blocks))
    assert "on Triton block-sparse kernels" in k.backward_note()


@pytest.mark.parametrize("dtype,mma", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                       (torch.float32, "m2x2"), (torch.float32, "m4p2")])
def test_cuda_backward_scans_emulated(dtype, mma, emu_dir, monkeypatch, tmp_path):
    """The CUDA kernel's backward with its scans on CUDA block-sparse kernels run by the CPU
    emulator (outputs NaN-poisoned; a lane a row, the tensor-core instances, split over two warps
    or as a two-warp pipeline on a block-triangular mask), in chunks of 3 steps, the adjoint's
    walking time backwards through negated strides, its states written into the backward's
    buffer; against float64 autograd."""
    from ssmc.runtime.cache import get_cache
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    monkeypatch.setattr(M, "STEP_ELEMENTS", 3 * (2 * 3 * 16))        # 3 steps of the (2, 3, 16) state
    g = torch.Generator().manual_seed(4)
    mask = P.block_mask(4, 4, 0.3, g) if not isinstance(mma, str) else \
        torch.tensor([[1.0, 0.0], [1.0, 1.0]]).repeat_interleave(8, 0).repeat_interleave(8, 1)
    ins = P.euler_inputs(2, 7, 3, 16, mask, g)
    ins = tuple(t.to(dtype) if t.dim() == 3 else t for t in ins)
    r, xs = _region_and_inputs(P.euler_matmul, ins, monkeypatch)
    cache = get_cache(str(tmp_path / "cache"))
    k = CudaBlockSparseKernel(r, bsp_plan(r), cache)
    ran = []

    class Emulated:
        walks_back = True

        def __init__(self, reg):
            self.k = CudaBlockSparseKernel(reg, bsp_plan(reg), cache)
            self.k.poison = True
            if mma:
                self.k.force_groups = next(c for c in self.k.choices() if isinstance(c[1], str)
                                           and (mma is True or c[1] == mma))

        def forward(self, inputs, backwards=None, out=None):
            got = _emulate_bsp(self.k, inputs, emu_dir, backwards=backwards, out=out)
            assert out is None or all(a is b for a, b in zip(got, out))
            ran.append((self.k.region.name, isinstance(self.k.last_launch["split"], str)))
            walked.append((self.k.region.name.rsplit("_", 1)[1], backwards is not None))
            return got
    walked = []
    k.scans.make = Emulated
    outs = run(r, [x.double() for x in xs])
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    got = k.backward(xs, [x.to(o.dtype) for x, o in zip(grads, run(r, xs))], needs)
    want = grads_by_autograd(lambda ins: run(r, ins), [x.double() for x in xs], grads, needs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < tol, (i, rel_err(a, b))
    assert not k.scans.declined and len(ran) == 3 * 3            # 3 chunks of the 7 steps, 3 scans each
    assert {m for _, m in ran} == {bool(mma)}
    assert set(walked) == {("final", False), ("states", False), ("adjoint", True)}


def test_chunk_size_policy(monkeypatch):
    """Chunk tensors of GPU_STEP_ELEMENTS on a GPU whose free memory holds twenty of them, halved
    down to STEP_ELEMENTS on one that does not; STEP_ELEMENTS on the CPU; steps capped by L."""
    assert M.step_elements(torch.device("cpu"), 4) == M.STEP_ELEMENTS
    free = {"bytes": 64 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (free["bytes"], 141 << 30))
    gpu = torch.device("cuda", 0)
    assert M.step_elements(gpu, 4) == M.GPU_STEP_ELEMENTS == 1 << 28
    free["bytes"] = 20 * 4 * (1 << 26)
    assert M.step_elements(gpu, 4) == 1 << 26
    free["bytes"] = 1 << 20
    assert M.step_elements(gpu, 4) == M.STEP_ELEMENTS
    assert M.chunk_steps(32 * 256 * 64, 4096, None, 1 << 27) == 256
    assert M.chunk_steps(32 * 256 * 64, 100, None, 1 << 27) == 100 and M.chunk_steps(10, 100, 7) == 7


def test_scan_that_fails_falls_back_with_the_reason(monkeypatch):
    """A derived region its target cannot compile runs on the torch reference: the gradients
    stay right and the kernel's backward note (what explain shows) names the region and why."""
    g = torch.Generator().manual_seed(5)
    r, xs = _region_and_inputs(*case("euler_matmul", g), monkeypatch)
    outs = run(r, xs)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]

    def make(reg):
        raise RuntimeError(f"no kernel for {reg.name}")
    scans = M.Scans(make)
    got = M.backward(r, xs, grads, needs, scans, 3)
    want = grads_by_autograd(lambda ins: run(r, ins), xs, grads, needs)
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (b is None or rel_err(a, b) < 1e-10)
    assert set(scans.declined) == {f"{r.name}_final", f"{r.name}_states", f"{r.name}_adjoint"}
    note = scans.note("CUDA")
    assert f"{r.name}_adjoint (compile: RuntimeError: no kernel for {r.name}_adjoint)" in note


def _product_summed(vals, keep):
    """The product of `vals` in float64, summed over the dims where `keep` is 1."""
    want = vals[0].double()
    for v in vals[1:]:
        want = want * v.double()
    return want.sum(dim=[d for d in range(len(keep)) if keep[d] == 1], keepdim=True)


@pytest.mark.parametrize("shapes, keep", [
    ([(5, 3, 6, 1), (1, 1, 6, 6), (5, 3, 1, 6), ()], (5, 3, 1, 1)),   # lam_i W_ij h_j: ds
    ([(5, 3, 4, 1), (5, 3, 4, 6)], (5, 3, 1, 6)),                      # sum_d dy h: dC
    ([(5, 3, 4, 6), (5, 3, 1, 6)], (5, 3, 4, 1)),                      # sum_n lam B: dx
    ([(5, 3, 4, 6), (5, 3, 4, 6)], (1, 1, 4, 6)),                      # equal shapes, summed over time and batch
    ([(5, 1, 4, 6), (1, 3, 1, 6), (5, 3, 4, 1)], (1, 1, 1, 1)),        # a dim only some vary along
])
def test_contract_against_the_product_summed(shapes, keep, monkeypatch):
    """`reference.contract` equals the full product summed in float64, and where the last two
    factors vary along the same dims it multiplies and sums (an einsum there is a batched dot
    product: one cuBLAS launch per 65535 dots)."""
    from ssmc.targets import reference as R
    g = torch.Generator().manual_seed(3)
    vals = [torch.randn(*s, generator=g) if s else torch.tensor(0.7) for s in shapes]
    vals = [v.reshape(v.shape if v.dim() else (1, 1, 1, 1)) for v in vals]
    want = _product_summed(vals, keep)
    big = max(v.numel() for v in vals)
    seen = []
    real = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda eq, *ops: seen.append([o.numel() for o in ops]) or real(eq, *ops))
    got = R.contract(vals, keep)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-6
    # a batched dot product needs two of the largest factors in one einsum
    assert all(sizes.count(big) < 2 for sizes in seen), seen


@pytest.mark.parametrize("shapes, keep", [
    ([(4, 3, 5, 6), (4, 3, 5, 1), (4, 3, 1, 6)], (4, 3, 1, 1)),        # sum_ij lam_ij v_i k_j (beta's)
    ([(4, 3, 5, 6), (4, 3, 5, 6), (4, 3, 1, 1)], (4, 3, 1, 1)),        # sum_ij lam_ij h_ij a (a decay's)
    ([(4, 3, 5, 6), (1, 1, 1, 6), (4, 3, 5, 1)], (4, 1, 1, 6)),        # a dim only the largest varies along
])
def test_contract_pairs_the_largest_value_on_the_kernel(shapes, keep, interp, monkeypatch):
    """Where `mul_sum` runs (as on a GPU; here the kernel under TRITON_INTERPRET), `contract`
    sums the largest value times one other over the dims no third value varies along, merged
    into one (`mul_sum_dims`): equal to the product summed in float64, and no torch op writes a
    value of the largest one's size (no outer product of the small values, no full product)."""
    from torch.overrides import TorchFunctionMode

    from ssmc.targets import mul_sum as MS
    from ssmc.targets import reference as R
    monkeypatch.setattr(MS, "FORCE", True)
    g = torch.Generator().manual_seed(4)
    vals = [torch.randn(*s, generator=g) for s in shapes]
    want = _product_summed(vals, keep)
    big = max(v.numel() for v in vals)
    written = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            views = ("expand", "as_strided", "reshape", "view", "__get__", "to", "squeeze", "unsqueeze", "narrow")
            if isinstance(out, torch.Tensor) and out.numel() >= big and getattr(func, "__name__", "") not in views:
                written.append(getattr(func, "__name__", str(func)))
            return out
    ran = []
    real = MS.mul_sum
    monkeypatch.setattr(MS, "mul_sum", lambda a, b, d: ran.append(d) or real(a, b, d))
    with Watch():
        got = R.contract(vals, keep)
    assert got.shape == want.shape and rel_err(got, want) < 1e-6, rel_err(got, want)
    assert ran and not written, (ran, written)


def test_mul_sum_over_merged_dims(interp, monkeypatch):
    """`mul_sum_dims` sums over consecutive dims as one where both operands' strides allow it
    (an operand broadcast along all of them too), equal to the product summed in float64; it
    declines (None) dims that are not consecutive and operands whose strides do not merge."""
    from ssmc.targets import mul_sum as MS
    monkeypatch.setattr(MS, "FORCE", True)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(3, 4, 5, 6, generator=g)
    b = torch.randn(3, 1, 5, 6, generator=g)
    c = torch.randn(3, 4, 1, 1, generator=g)
    for x, y, dims in ((a, b, [2, 3]), (a, c, [2, 3]), (a, a, [1, 2, 3]), (a, a, [0, 1])):
        want = (x.double() * y.double()).sum(dim=dims, keepdim=True)
        got = MS.mul_sum_dims(x, y, dims)
        assert got is not None and got.shape == want.shape and rel_err(got, want) < 1e-6, dims
    assert MS.mul_sum_dims(a, b, [1, 3]) is None                        # not consecutive
    assert MS.mul_sum_dims(a, b, [1, 2, 3]) is None                     # b broadcast along 1 only
    assert MS.mul_sum_dims(a.transpose(2, 3).contiguous().transpose(2, 3), b, [2, 3]) is None


@pytest.mark.parametrize("sa, sb, dim", [
    ((5, 3, 40, 1), (5, 3, 40, 24), 2),        # dC: summed along a strided dim, the output's contiguous
    ((5, 3, 40, 24), (5, 3, 1, 24), 3),        # dx: summed along the contiguous dim
    ((5, 3, 40, 24), (5, 3, 40, 24), 3),       # equal shapes
    ((7, 1, 150), (1, 9, 150), 2),             # each broadcast along a dim the other varies along
    ((3, 1, 5, 2, 1, 4, 3), (1, 2, 5, 2, 3, 4, 3), 2),   # four outer dims and an inner one
    ((2, 2, 2, 2, 2, 2, 5), (2, 2, 2, 2, 2, 2, 5), 6),   # five outer dims: torch
    ((300,), (300,), 0),                       # no output dim left
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mul_sum_kernel(sa, sb, dim, dtype, interp, monkeypatch):
    """`mul_sum` (the Triton kernel under TRITON_INTERPRET) against the product summed in float64,
    its output poisoned first; the kernel runs where it indexes the dims, torch where it does not."""
    from ssmc.targets import mul_sum as MS
    monkeypatch.setattr(MS, "FORCE", True)
    ran = []
    real_module = MS._module
    monkeypatch.setattr(MS, "_module", lambda outer, *a: ran.append(outer) or real_module(outer, *a))
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(*sa, generator=g).to(dtype), torch.randn(*sb, generator=g).to(dtype)
    want = (a.double() * b.double()).sum(dim, keepdim=True)
    got = MS.mul_sum(a, b, dim)
    assert got.shape == want.shape and got.dtype == dtype
    poisoned = torch.full(want.shape, float("nan"), dtype=dtype)
    assert MS.mul_sum(a, b, dim, out=poisoned) is poisoned and torch.equal(poisoned, got)
    with pytest.raises(ValueError, match="mul_sum: out is"):
        MS.mul_sum(a, b, dim, out=torch.empty(3, dtype=dtype))
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 1e-2), rel_err(got, want)
    others = sum(1 for d, (x, y) in enumerate(zip(sa, sb)) if d != dim and max(x, y) > 1)
    assert ran == ([] if others > MS.MAX_OUTER + 1 else [max(0, others - 1)] * 2)


def test_backward_sums_by_the_kernel(interp, monkeypatch):
    """The fp32 backward with its two-factor sums on the `mul_sum` kernel and the transition's
    gradients on the `transition_grads` kernel (as on a GPU) against float64 autograd; `mul_sum`
    ran in every chunk, summing over channels and over the state; `transition_grads` once a
    chunk (the state before each step is a view of one buffer), G and rs in one pass."""
    from ssmc.targets import mul_sum as MS
    from ssmc.targets import transition_grads as TG
    monkeypatch.setattr(MS, "FORCE", True)
    monkeypatch.setattr(TG, "FORCE", True)
    ran, tg = [], []
    real = MS.mul_sum
    monkeypatch.setattr(MS, "mul_sum", lambda a, b, d: ran.append(d) or real(a, b, d))
    real_module = TG._module
    monkeypatch.setattr(TG, "_module", lambda *a: tg.append(a) or real_module(*a))
    real_gr = M.gram_and_rows
    wants = []
    monkeypatch.setattr(M, "gram_and_rows", lambda lam, h, fr, fm: wants.append((fr is not None, fm is not None))
                        or real_gr(lam, h, fr, fm))
    g = torch.Generator().manual_seed(2)
    r, xs = _region_and_inputs(*case("euler_matmul", g, torch.float32), monkeypatch)
    outs = run(r, xs)
    grads = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    needs = [x.is_floating_point() for x in xs]
    got = M.backward(r, xs, grads, needs, None, 3)
    xd = [x.double() if x.is_floating_point() else x for x in xs]
    want = grads_by_autograd(lambda ins: run(r, ins), xd, [x.double() for x in grads], needs)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if b is not None:
            assert rel_err(a, b) < 1e-5, (i, rel_err(a, b))
    assert len(ran) >= 3 * 3 and set(ran) == {2, 3}, ran    # over channels (dC, dB) and the state (dx, dt)
    assert wants == [(True, True)] * 3 and len(tg) == 3     # chunks of 3, 3, 1 steps: one pass each


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("r_fast", [True, False])
def test_mul_sum_compiles_for_gpu(cc, r_fast, monkeypatch, tmp_path):
    """The `mul_sum` kernel compiles for sm_80 and sm_90 (bf16 and fp32 operands, two outer dims,
    either tile layout)."""
    import triton
    from test_triton import ast_source
    from triton.backends.compiler import GPUTarget
    from ssmc.targets import mul_sum as MS
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mod = MS._module(2, str(tmp_path), False)
    fn = getattr(mod, MS.kname(2))
    ints = [f"{p}{d}" for d in range(2) for p in ("size", "a_s", "b_s", "o_s")]
    ints += ["SIZE_I", "a_si", "b_si", "o_si", "R", "a_sr", "b_sr"]
    sig = {"a_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*fp32", **{k: "i64" for k in ints}}
    cx = {"BLOCK_I": 64, "BLOCK_R": 64, "R_FAST": r_fast, ("a_sr" if r_fast else "a_si"): 1}
    sig.update({k: "constexpr" for k in cx})
    ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
    ptx = ck.asm["ptx"]
    assert f".target sm_{cc}" in ptx and "ld.global" in ptx and "st.global" in ptx


@pytest.mark.gpu
def test_gpu_mul_sum():
    """`mul_sum` on the GPU at the block-sparse backward's layouts (dC, dB over channels; dx, dt
    over the state; fp32 with bf16), against float64, and chosen by `contract` for CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ssmc.targets import mul_sum as MS
    from ssmc.targets import reference as R
    g = torch.Generator().manual_seed(6)
    T, b, d, n = 33, 4, 96, 64
    lam = torch.randn(T, b, d, n, generator=g).cuda()
    dy = torch.randn(T, b, d, 1, generator=g).cuda().to(torch.bfloat16)
    B = torch.randn(T, b, 1, n, generator=g).cuda().to(torch.bfloat16)
    for a, c, dim in ((dy, lam, 2), (lam, B, 3), (lam, lam, 3), (lam, dy, 0)):
        assert MS.usable(a, c)
        want = (a.double() * c.double()).sum(dim, keepdim=True)
        got = MS.mul_sum(a, c, dim)
        assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5, (dim, rel_err(got, want))
    keep = (T, b, 1, n)
    assert rel_err(R.contract([dy, lam], keep), (dy.double() * lam.double()).sum(2, keepdim=True)) < 1e-5


def test_walking_back_checks_its_arguments(monkeypatch, tmp_path):
    """The CUDA kernel's `run` names an `out` tensor of the wrong shape or dtype and a backwards
    input of another length, before any launch."""
    from ssmc.runtime.cache import get_cache
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    g = torch.Generator().manual_seed(4)
    r, xs = _region_and_inputs(*case("euler_matmul", g, torch.float32), monkeypatch)
    k = CudaBlockSparseKernel(r, bsp_plan(r), get_cache(str(tmp_path / "cache")))
    want = run(r, xs)

    def launch(*a):
        raise AssertionError("launched")
    shape = tuple(want[0].shape)
    with pytest.raises(ValueError, match=rf"out\[0\] is \({shape[0]}, .* torch.float64; output 0 of region"):
        k.run(xs, launch, out=[torch.empty(shape, dtype=torch.float64)])
    short = (shape[0], shape[1] - 1, *shape[2:])
    with pytest.raises(ValueError, match=rf"out\[0\] is \({short[0]}, {short[1]},"):
        k.run(xs, launch, out=[torch.empty(short, dtype=want[0].dtype)])
    x0 = xs[0]
    t = next(d for d in range(x0.dim()) if x0.shape[d] == 7)
    with pytest.raises(ValueError, match=rf"backwards: input 0 \(.*\) has {x0.shape[(t + 1) % x0.dim()]} steps along dim"):
        k.run(xs, launch, backwards={0: (t + 1) % x0.dim()})


@pytest.mark.parametrize("K, n", [(300, 64), (37, 8), (129, 20), (1, 128)])
def test_transition_grads_kernel(K, n, interp, monkeypatch):
    """`gram_and_rows` on the Triton kernel (TRITON_INTERPRET) against float64: G = (fr lam)^T h
    and rs = lam . (h fm^T), each alone and together; several programs, a tail block, n below
    16 and not a power of two; torch where the kernel does not run (float64)."""
    from ssmc.targets import transition_grads as TG
    monkeypatch.setattr(TG, "FORCE", True)
    g = torch.Generator().manual_seed(7)
    lam, h, fr, fm = (torch.randn(K, n, generator=g), torch.randn(K, n, generator=g),
                      torch.rand(K, generator=g), torch.randn(n, n, generator=g))
    Gw = (lam.double() * fr.double()[:, None]).T @ h.double()
    rw = (lam.double() * (h.double() @ fm.double().T)).sum(1)
    G, rs = TG.gram_and_rows(lam, h, fr, fm)
    assert G.shape == (n, n) and rs.shape == (K,)
    assert rel_err(G, Gw) < 1e-6 and rel_err(rs, rw) < 1e-6, (rel_err(G, Gw), rel_err(rs, rw))
    G1, none = TG.gram_and_rows(lam, h, fr, None)
    none2, rs1 = TG.gram_and_rows(lam, h, None, fm)
    assert none is None and none2 is None and torch.equal(G1, G) and torch.equal(rs1, rs)
    assert TG.gram_and_rows(lam, h) == (None, None)
    assert not TG.usable(lam.double())
    Gd, rsd = TG.gram_and_rows(lam.double(), h.double(), fr.double(), fm.double())
    assert rel_err(Gd, Gw) < 1e-12 and rel_err(rsd, rw) < 1e-12


@pytest.mark.parametrize("cc", [80, 90])
def test_transition_grads_compiles_for_gpu(cc, monkeypatch, tmp_path):
    """The `transition_grads` kernel compiles for sm_80 and sm_90 with tf32x3 dots, both outputs on."""
    import triton
    from test_triton import ast_source
    from triton.backends.compiler import GPUTarget
    from ssmc.targets import transition_grads as TG
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = getattr(TG._module("tf32x3", str(tmp_path), False), TG.KNAME)
    sig = {k: "*fp32" for k in ("lam_ptr", "h_ptr", "fr_ptr", "fm_ptr", "g_ptr", "rs_ptr")}
    sig.update({"K": "i64", "N": "i32", "NPROG": "i32"})
    cx = {"BLOCK_K": TG.CONFIG["BLOCK_K"], "BLOCK_N": 64, "WANT_G": True, "WANT_RS": True}
    sig.update({k: "constexpr" for k in cx})
    ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
    assert f".target sm_{cc}" in ck.asm["ptx"] and "mma" in ck.asm["ptx"]


@pytest.mark.gpu
def test_gpu_transition_grads():
    """`gram_and_rows` on the GPU (tf32x3 dots) against float64 at a chunk-like size."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ssmc.targets import transition_grads as TG
    g = torch.Generator().manual_seed(8)
    K, n = 3 * 8192 + 5, 64
    lam, h, fr, fm = (torch.randn(K, n, generator=g), torch.randn(K, n, generator=g),
                      torch.rand(K, generator=g), torch.randn(n, n, generator=g) / 8)
    assert TG.usable(lam.cuda())
    G, rs = TG.gram_and_rows(lam.cuda(), h.cuda(), fr.cuda(), fm.cuda())
    Gw = (lam.double() * fr.double()[:, None]).T @ h.double()
    rw = (lam.double() * (h.double() @ fm.double().T)).sum(1)
    assert rel_err(G.cpu(), Gw) < 1e-5 and rel_err(rs.cpu(), rw) < 1e-5, (rel_err(G.cpu(), Gw), rel_err(rs.cpu(), rw))


def test_sum_kernels_that_fail_fall_back_to_torch(interp, monkeypatch):
    """A `mul_sum` or `transition_grads` kernel that fails to compile: the sums come from torch ops
    (the same values, float64-checked), no later call tries the kernel, and the backward's note
    names the failure."""
    from ssmc.targets import mul_sum as MS
    from ssmc.targets import transition_grads as TG
    for mod in (MS, TG):
        monkeypatch.setattr(mod, "FORCE", True)
        monkeypatch.setattr(mod, "FAILED", None)
    tries = []

    def broken(*a):
        tries.append(a)
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(MS, "_module", broken)
    monkeypatch.setattr(TG, "_module", broken)
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(5, 3, 40, 1, generator=g), torch.randn(5, 3, 40, 24, generator=g)
    want = (a.double() * b.double()).sum(2, keepdim=True)
    assert rel_err(MS.mul_sum(a, b, 2), want) < 1e-6 and rel_err(MS.mul_sum(a, b, 2), want) < 1e-6
    lam, h, fr, fm = (torch.randn(70, 8, generator=g), torch.randn(70, 8, generator=g),
                      torch.rand(70, generator=g), torch.randn(8, 8, generator=g))
    G, rs = TG.gram_and_rows(lam, h, fr, fm)
    assert rel_err(G, (lam.double() * fr.double()[:, None]).T @ h.double()) < 1e-6
    assert rel_err(rs, (lam.double() * (h.double() @ fm.double().T)).sum(1)) < 1e-6
    TG.gram_and_rows(lam, h, fr, fm)
    assert len(tries) == 2                  # one try each, then torch
    assert not MS.usable(a, b) and not TG.usable(lam)
    note = M.Scans(lambda r: None).note("CUDA")
    assert "mul_sum by torch ops (the kernel failed: RuntimeError: no compiler here)" in note
    assert "transition_grads by torch ops (the kernel failed: RuntimeError: no compiler here)" in note
