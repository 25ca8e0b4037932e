"""Block-sparse transitions (issue 9): capture of h = a*h + M h + b from naive loops, the block
mask read by the block_sparse pass, the torch reference and the Triton block-sparse kernel
against float64 eager, gradients, and a mask that changes between calls. Complex diagonal decays
(LRU-style loops over complex tensors) run as real pairs with 2x2 rotation-scale blocks, against
complex128 eager."""
import dataclasses

import pytest
import torch

import block_sparse_programs as P
import ssmc
from conftest import TOL, as_tuple, grads_match, reference, rel_err, ssmc_run
from ssmc import ir
from ssmc.runtime.op import lookup
from ssmc.sparsity import BLOCK_OVERHEAD, block_pattern, choose_block, transition_pattern
from test_cuda_codegen import emu_dir  # noqa: F401  (the CPU emulator's work dir)


def check(fn, inputs, tol=None, **options):
    out, report = ssmc_run(fn, inputs, **options)
    assert len(report.regions) == 1, str(report)
    ref = reference(fn, inputs)
    for o, r in zip(as_tuple(out), ref):
        assert o.shape == r.shape
        err = rel_err(o, r)
        assert err <= (tol or TOL[inputs[0].dtype]), f"rel err {err:.3g}\n{report}"
    return report.regions[0]


@pytest.mark.parametrize("bs", [4, 8, 16])
@pytest.mark.parametrize("density", [1 / 8, 1 / 2, 1.0])
def test_random_masks_against_float64(bs, density):
    g = torch.Generator().manual_seed(bs * 10 + int(density * 8))
    mask = P.block_mask(4, bs, density, g)
    info = check(P.euler_matmul, P.euler_inputs(2, 5, 3, 4 * bs, mask, g))
    assert info.strategy == "block_sparse"
    mix = info.ir.mix
    true_blocks = int(block_pattern(mask.bool(), bs).sum())
    # the pass keeps the mask's structure: the block size it picked costs no more
    assert len(mix.blocks) * (mix.block ** 2 + BLOCK_OVERHEAD) <= true_blocks * (bs * bs + BLOCK_OVERHEAD)
    assert f"density {mix.density:.1%}" in str(info)


def test_lti_and_structure():
    g = torch.Generator().manual_seed(1)
    mask = P.block_mask(4, 8, 0.25, g)
    x, _, A, _, B, C = P.euler_inputs(2, 6, 3, 32, mask, g)
    info = check(P.lti_matmul, (x, A, mask, B, C))
    r = info.ir
    assert r.decay_kind == "matrix" and r.mix.block == 8 and len(r.mix.blocks) == 4
    assert "t" not in {ix for ld in __import__("ssmc").ir.loads(r.mix.expr) for ix in ld.index}   # LTI
    text = str(info)
    assert "block mask: 8x8 blocks of a 32x32 transition, 4/16 nonzero (density 25.0%" in text
    assert "sum_j(m[i2, j] * h[..., j])" in text
    report = str(ssmc.explain(P.lti_matmul, x, A, mask, B, C))
    assert "strategy block_sparse" in report and "density 25.0%" in report
    assert all(line in report for line in r.mix.mask_text().splitlines())      # the mask itself


def test_einsum_forms_and_final_state():
    g = torch.Generator().manual_seed(2)
    mask = P.block_mask(4, 4, 0.25, g)
    n = 16
    ins = (torch.randn(2, 6, generator=g), torch.rand(2, 6, generator=g) * 0.2,
           torch.randn(n, n, generator=g) / 4, mask, torch.randn(2, 6, n, generator=g),
           torch.randn(2, 6, n, generator=g))
    info = check(P.euler_einsum, ins)
    assert info.ir.mix is not None
    # a given per-step transition (input-dependent, batched)
    Abar = torch.randn(2, 6, n, n, generator=g) * mask / 3
    info = check(P.given_abar, (torch.randn(2, 6, generator=g), Abar, ins[4], ins[5]))
    assert info.ir.mix.blocks and info.ir.mix.density <= 0.25 + 1e-9


def test_rotary_state():
    g = torch.Generator().manual_seed(3)
    b, L, d, m = 2, 6, 3, 4
    ins = (torch.randn(b, L, d, generator=g), torch.randn(b, L, d, m, generator=g),
           torch.rand(b, L, d, m, generator=g), torch.randn(b, L, m, generator=g),
           torch.randn(b, L, m, generator=g))
    info = check(P.rotary, ins)
    assert info.ir.mix.block == 2


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(5)
    mask = P.block_mask(2, 4, 0.5, g)
    x, dt, A, _, B, C = (t.double() for t in P.euler_inputs(1, 3, 2, 8, mask, g))
    torch._dynamo.reset()
    rep = ssmc.Report()
    compiled = torch.compile(P.euler_matmul, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep))
    args = [t.clone().requires_grad_() for t in (x, dt, A)]
    fn = lambda x, dt, A, B, C: compiled(x, dt, A, mask.double(), B, C)
    assert torch.autograd.gradcheck(fn, (*args, B.requires_grad_(), C.requires_grad_()))
    assert len(rep.regions) == 1 and rep.regions[0].strategy == "block_sparse", str(rep)


def test_mask_changed_between_calls_is_not_stale():
    class Net(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.A = torch.nn.Parameter(torch.randn(16, 16) / 4)
            self.register_buffer("mask", mask.bool())

        def forward(self, x, dt, B, C):
            return P.euler_matmul(x, dt, self.A, self.mask, B, C)
    g = torch.Generator().manual_seed(6)
    net = Net(P.block_mask(4, 4, 0.25, g))
    x, dt, _, _, B, C = P.euler_inputs(2, 5, 3, 16, net.mask, g)
    torch._dynamo.reset()
    rep = ssmc.Report()
    fast = torch.compile(net, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=rep))
    with torch.no_grad():
        assert rel_err(fast(x, dt, B, C), net(x, dt, B, C)) < 1e-5
        assert len(rep.regions) == 1 and rep.regions[0].ir.mix.density == 0.25, str(rep)
        net.mask.copy_(P.block_mask(4, 4, 0.5, g).bool())       # another mask, same tensor
        assert rel_err(fast(x, dt, B, C), net(x, dt, B, C)) < 1e-5


def test_sparsity_analysis_is_conservative():
    g = torch.Generator().manual_seed(7)
    mask = P.block_mask(4, 4, 0.25, g)
    _, report = ssmc_run(P.euler_matmul, P.euler_inputs(1, 3, 2, 16, mask, g))
    r = report.regions[0].ir
    pat = transition_pattern(r, [None] * len(r.inputs), 16)      # values unknown: dense
    assert pat.all()
    assert choose_block(torch.ones(16, 16, dtype=torch.bool)) == 16
    assert choose_block(torch.eye(16, dtype=torch.bool)) in (2, 4)


def test_other_targets_decline_matrix_transitions():
    g = torch.Generator().manual_seed(8)
    mask = P.block_mask(4, 4, 0.25, g)
    _, report = ssmc_run(P.euler_matmul, P.euler_inputs(1, 3, 2, 16, mask, g))
    r = report.regions[0].ir
    from ssmc.targets import triton as T
    from ssmc.targets.cuda_printer import Unsupported, plan
    assert "non-diagonal" in T.make_plan(r)
    with pytest.raises(Unsupported):
        plan(r)
    # with the block_sparse pass off the region still runs right (every block counted)
    info = check(P.euler_matmul, P.euler_inputs(1, 3, 2, 16, mask, g), disable_passes=["block_sparse"])
    assert info.strategy == "block_sparse" and not info.ir.mix.block


# -- the Triton kernel under TRITON_INTERPRET=1 ---------------------------------------------------

@pytest.fixture
def interp(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path / "cache"))


def check_triton(fn, inputs, mode):
    info = check(fn, inputs, target="triton")
    entry = lookup(info.key)
    assert entry.target == "triton" and entry.failure is None, entry.failure
    kern = entry.kernel
    assert kern.fallback is None, kern.fallback
    assert kern.plan.mode == mode, kern.plan_text()
    return kern


@pytest.mark.parametrize("bs,mode", [(4, "fma2"), (16, "dot")])
def test_triton_kernel(bs, mode, interp):
    g = torch.Generator().manual_seed(9)
    mask = P.block_mask(2, bs, 0.5, g)
    check_triton(P.euler_matmul, P.euler_inputs(2, 3, 3, 2 * bs, mask, g), mode)


def test_small_blocks_coarsened_to_tensor_core_tiles(interp):
    """8x8 blocks of a 32x32 shared transition run as 16x16 tiles on tl.dot: a tile is nonzero
    when any of its blocks is (the diagonal blocks and one more); results equal float64 eager."""
    g = torch.Generator().manual_seed(12)
    mask = torch.zeros(32, 32)
    for i in range(4):
        mask[8 * i:8 * i + 8, 8 * i:8 * i + 8] = 1
    mask[0:8, 24:32] = 1                                  # block (0, 3): tile (0, 1)
    kern = check_triton(P.euler_matmul, P.euler_inputs(2, 3, 3, 32, mask, g), "dot")
    assert kern.plan.bs == 16 and set(kern.region.mix.blocks) == {(0, 0), (1, 1), (0, 1)}
    assert "8x8 blocks (5 nonzero) run as 16x16 tiles on tl.dot (3 nonzero)" in kern.plan_text()


@pytest.mark.parametrize("form", ["einsum", "matmul"])
def test_triton_kernel_changed_mask(form, interp):
    """The compiled mask runs unrolled; a denser mask in the same compiled graph takes the
    block-CSR path of the same kernel (the pattern is read from the inputs at each call)."""
    g = torch.Generator().manual_seed(10)
    mask = P.block_mask(4, 2, 0.25, g)
    if form == "einsum":       # per-row transition tiles
        fn, mode = P.euler_einsum, "fma3"
        ins = (torch.randn(2, 3, generator=g), torch.rand(2, 3, generator=g) * 0.2,
               torch.randn(8, 8, generator=g) / 3, mask, torch.randn(2, 3, 8, generator=g),
               torch.randn(2, 3, 8, generator=g))
    else:
        fn, mode = P.euler_matmul, "fma2"
        ins = P.euler_inputs(2, 3, 3, 8, mask, g)
    check_triton(fn, ins, mode)
    torch._dynamo.reset()
    fast = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, options={"target": "triton"}))
    fast(*ins)
    ins2 = (*ins[:3], P.block_mask(4, 2, 0.75, g), *ins[4:])
    for o, r in zip(as_tuple(fast(*ins2)), reference(fn, ins2)):
        assert rel_err(o, r) < 1e-5
    ins2[3].fill_(1.0)                  # in place: the kernel's cached block pattern is stale
    for o, r in zip(as_tuple(fast(*ins2)), reference(fn, ins2)):
        assert rel_err(o, r) < 1e-5


def _column_state(u, A, B, C):
    """x = A x + B u on a column state (n, b), read out by C: an odd-sized dense transition."""
    x = u.new_zeros(A.shape[0], u.shape[0])
    ys = []
    for k in range(u.shape[1]):
        x = A @ x + B @ u[:, k].T
        ys.append((C @ x).T)
    return torch.stack(ys, 1)


def _odd_inputs(n, g):
    return (torch.randn(2, 9, 2, generator=g), 0.9 * torch.eye(n) + 0.1 * torch.randn(n, n, generator=g) / n ** 0.5,
            torch.randn(n, 2, generator=g), torch.randn(3, n, generator=g))


@pytest.mark.parametrize("n", [3, 5, 7])
def test_odd_sized_transition_on_the_triton_kernel(n, interp):
    """A transition of 3, 5 or 7 rows is one block of that size, which tl.arange cannot take: the
    Triton kernel runs it in 1x1 blocks (it ran on the torch reference before); values and
    gradients equal float64 eager."""
    g = torch.Generator().manual_seed(40 + n)
    ins = _odd_inputs(n, g)
    info = check(_column_state, ins, target="triton")
    assert info.ir.mix.block == n
    entry = lookup(info.key)
    assert entry.target == "triton" and entry.failure is None, entry.failure
    assert entry.kernel.fallback is None and entry.kernel.plan.bs == 1, entry.kernel.plan_text()
    grads_match(_column_state, ins, tol=1e-4, target="triton")


@pytest.mark.parametrize("cc", [80, 90])
def test_triton_kernel_compiles_for_gpu(cc, monkeypatch, tmp_path):
    import triton
    from test_triton import ast_source
    from triton.backends.compiler import GPUTarget
    from ssmc.targets import triton as T
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    g = torch.Generator().manual_seed(11)
    from ssmc.targets import triton_block_sparse as TB
    coarsen = TB.coarsened
    # 8x8 blocks of a shared matrix run as 16x16 tiles on tensor cores; kept at 8x8 (as for a
    # d_state that is no multiple of 16), they are multiplied and summed
    for nb, bs, has_mma in ((4, 8, True), (4, 16, True), (4, 8, False)):
        monkeypatch.setattr(TB, "coarsened", coarsen if has_mma else (lambda r, p: None))
        mask = P.block_mask(nb, bs, 0.25, g)
        _, report = ssmc_run(P.euler_matmul, P.euler_inputs(2, 2, 2, nb * bs, mask, g))
        region = report.regions[0].ir
        kern = T.TritonTarget().compile(region, "block_sparse", ssmc.make_options(cache_dir=str(tmp_path)))
        assert (kern.coarsened_from is not None) == (region.mix.block < 16 and has_mma), (bs, kern.coarsened_from)
        assert kern.plan.mode == ("dot" if has_mma else "fma2")
        cfg = kern.table()[f"sm_{cc}"][0]
        fn, sig, cx = kern.signature(cfg, nb * bs, {0: torch.bfloat16, 1: torch.bfloat16})
        ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"]})
        assert f".target sm_{cc}" in ck.asm["ptx"]
        assert ("mma" in ck.asm["ptx"]) == has_mma
    _, report = ssmc_run(_column_state, _odd_inputs(5, g))           # 1x1 blocks (tl.arange(0, 1))
    kern = T.TritonTarget().compile(report.regions[0].ir, "block_sparse", ssmc.make_options(cache_dir=str(tmp_path)))
    cfg = kern.table()[f"sm_{cc}"][0]
    fn, sig, cx = kern.signature(cfg, 8, {0: torch.float32})
    assert cx["BS"] == 1
    ck = triton.compile(ast_source(fn, sig, cx), target=GPUTarget("cuda", cc, 32), options={"num_warps": cfg["num_warps"]})
    assert f".target sm_{cc}" in ck.asm["ptx"]


@pytest.mark.gpu
def test_gpu_block_sparse_bf16():
    g = torch.Generator().manual_seed(12)
    mask = P.block_mask(8, 8, 0.25, g)
    ins = P.euler_inputs(4, 64, 32, 64, mask, g)
    ins = tuple(t.cuda() for t in ins)
    ins = (ins[0].bfloat16(), ins[1].bfloat16(), ins[2], ins[3], ins[4].bfloat16(), ins[5].bfloat16())
    out, report = ssmc_run(P.euler_matmul, ins, target="triton")
    info = report.regions[0]
    assert info.target == "triton" and info.strategy == "block_sparse", str(report)
    assert lookup(info.key).kernel.fallback is None
    ref = reference(P.euler_matmul, ins)[0]
    assert rel_err(out, ref) < 2e-2
    # gradients (the backward's scans on Triton kernels, ssmc/targets/mix_adjoint.py) against float64 autograd
    A = ins[2].clone().requires_grad_()
    out, report = ssmc_run(P.euler_matmul, (*ins[:2], A, *ins[3:]), target="triton")
    (gA,) = torch.autograd.grad(out.float().square().sum(), A)
    A64 = ins[2].double().requires_grad_()
    ref = P.euler_matmul(*[t.double() for t in ins[:2]], A64, *[t.double() for t in ins[3:]])
    (rA,) = torch.autograd.grad(ref.square().sum(), A64)
    assert rel_err(gA, rA) < 2e-2
    scans = lookup(report.regions[0].key).kernel.scans
    assert len(scans.kernels) == 3 and not scans.declined, scans.declined


# -- the CUDA kernel: numerics on the CPU emulator, NVRTC builds for sm_80/sm_90, the GPU ---------

def _region_and_inputs(fn, inputs, monkeypatch):
    """The captured region and the tensors its op receives (the torch target on the CPU)."""
    from ssmc.targets.reference import ReferenceKernel
    seen, orig = [], ReferenceKernel.forward

    def spy(self, xs):
        seen.append(list(xs))
        return orig(self, xs)
    with monkeypatch.context() as m:
        m.setattr(ReferenceKernel, "forward", spy)
        _, report = ssmc_run(fn, inputs)
    assert len(report.regions) == 1 and seen, str(report)
    return report.regions[0].ir, seen[0]


def _emulate_bsp(kernel, xs, workdir, **run):
    import ctypes
    from test_cuda_codegen import _emulator
    types = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32}

    def launch(g, grid, block, args):
        rend = kernel.rendered(g)
        lib = _emulator(rend.source, workdir)
        f = getattr(lib, rend.kname + "_emulate")
        f.argtypes = [ctypes.c_uint] * 3 + [types[k] for k, _ in args]
        f(grid, block, 0, *[v for _, v in args])
        assert lib.ssmc_emu_named_left() == 0, f"{rend.kname}: a block ended with a named barrier's phase open"
    return kernel.run(xs, launch, **run)


def _bsp_case(form, bs, dtype, g):
    n = 4 * bs
    mask = P.block_mask(4, bs, 0.3, g)
    if form == "euler_einsum":       # state (b, n); returns (y, h_L)
        ins = (torch.randn(3, 5, generator=g), torch.rand(3, 5, generator=g) * 0.2,
               torch.randn(n, n, generator=g) / 3, mask, torch.randn(3, 5, n, generator=g),
               torch.randn(3, 5, n, generator=g))
        return P.euler_einsum, ins
    x, dt, A, _, B, C = P.euler_inputs(2, 5, 37, n, mask, g)     # 74 rows: a partial last block
    if form == "lti_matmul":
        return P.lti_matmul, (x, A, mask, B, C)
    ins = (x, dt, A, mask, B, C)
    return P.euler_matmul, tuple(t.to(dtype) if t.dim() == 3 else t for t in ins)


@pytest.mark.parametrize("form,bs,dtype", [("euler_matmul", 4, torch.float32), ("euler_matmul", 4, torch.bfloat16),
                                           ("euler_einsum", 4, torch.float32), ("lti_matmul", 8, torch.float32)])
def test_cuda_kernel_emulated(form, bs, dtype, emu_dir, monkeypatch, tmp_path):
    """Every warp count against float64 on the compiled mask, and with a denser transition at
    run time (the pattern is not covered: the second kernel, every block, runs); NaN-poisoned
    outputs, 74 rows (a partial block of 32)."""
    from ssmc.runtime.cache import get_cache
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    from ssmc.targets.reference import ReferenceKernel
    g = torch.Generator().manual_seed(21)
    fn, ins = _bsp_case(form, bs, dtype, g)
    r, xs = _region_and_inputs(fn, ins, monkeypatch)
    k = CudaBlockSparseKernel(r, bsp_plan(r), get_cache(str(tmp_path / "cache")))
    k.poison = True
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    from ssmc.sparsity import PatternCache
    w = PatternCache(r).used[-1]      # an input the pattern reads (W, or the mask)
    dense = list(xs)
    dense[w] = xs[w] + 0.05           # nonzero everywhere: outside the compiled mask
    assert len(k.choices()) >= 2 or r.mix.nblocks == 1
    n = r.mix.block * r.mix.nblocks       # inputs along the state with stride 2: the scalar-load instance
    strided = [torch.repeat_interleave(x, 2, -1)[..., ::2] if x.dim() >= 2 and x.shape[-1] == n else x for x in xs]
    assert any(not x.is_contiguous() for x in strided)
    for case in (xs, dense, strided):
        ref = ReferenceKernel(r).forward([x.double() for x in case])
        for groups in k.choices():
            k.force_groups = groups
            outs = _emulate_bsp(k, case, emu_dir)
            for o, e in zip(outs, ref):
                assert rel_err(o, e) < tol, (form, groups, case is dense, rel_err(o, e))
            assert (k.last_launch["groups"], k.last_launch["split"]) == groups
            assert k.last_launch["vec"] == (case is not strided or not k.rendered(groups).run_loads)


@pytest.mark.parametrize("bs,dtype", [(8, torch.bfloat16), (16, torch.float32), (4, torch.float32)])
def test_cuda_mma_instances_emulated(bs, dtype, emu_dir, monkeypatch):
    """The tensor-core instances against float64: 16 channels (the two rows of a lane share their
    batch's loads), 3 x 16 rows (a block of 4 warps with one idle), L7 (not a multiple of the load
    depth), blocks of 16 (four tiles each) and of 4 (tiles shared by blocks), the every-tile path,
    loads along the state with stride 2 (no vector loads); 2 and 4 warps a tile (the state's tiles
    split over them, exchanged each step)."""
    from ssmc.runtime.cache import get_cache
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    from ssmc.targets.cuda_bsp_mma import _variant, tiles_of
    from ssmc.targets.reference import ReferenceKernel
    g = torch.Generator().manual_seed(26)
    n = 32
    mask = P.block_mask(n // bs, bs, 0.3, g)
    ins = P.euler_inputs(3, 7, 16, n, mask, g)
    ins = tuple(t.to(dtype) if t.dim() == 3 else t for t in ins)
    r, xs = _region_and_inputs(P.euler_matmul, ins, monkeypatch)
    p = bsp_plan(r)
    k = CudaBlockSparseKernel(r, p, get_cache(str(emu_dir / f"mma{bs}")))
    k.poison = True
    tiles = tiles_of(p, p.blocks)
    assert all(any(a * 8 < (i + 1) * bs and i * bs < (a + 1) * 8 and c * 8 < (j + 1) * bs and j * bs < (c + 1) * 8
                   for (a, c) in tiles) for (i, j) in p.blocks)       # every block inside the tiles
    from ssmc.sparsity import PatternCache
    w = PatternCache(r).used[-1]
    dense = list(xs)
    dense[w] = xs[w] + 0.05
    strided = [torch.repeat_interleave(x, 2, -1)[..., ::2] if x.dim() == 3 and x.shape[-1] == n else x for x in xs]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    mma = [c for c in k.choices() if isinstance(c[1], str)]
    assert mma and k.mma_why is None and "m2x2" in {c[1] for c in mma}
    mma.append((4, "m2x4"))          # 4 warps a tile: not timed (see SPLITS), still right
    for case in (xs, dense, strided):
        ref = ReferenceKernel(r).forward([x.double() for x in case])
        for c in mma:
            k.force_groups = c
            outs = _emulate_bsp(k, case, emu_dir)
            for o, e in zip(outs, ref):
                assert rel_err(o, e) < tol, (bs, c, rel_err(o, e))
            assert k.last_launch["shared_rows"] and k.last_launch["vec"] == (case is not strided)
            split = _variant(c[1])[1]            # warps a 16-row tile
            assert k.last_launch["grid"] == -(-3 // (c[0] // split))


def _dag_mask(n: int, bs: int, gen) -> torch.Tensor:
    """Diagonal blocks and random blocks below them, then the groups of max(bs, 8) columns (and
    rows alike) in a random order: no cycle between 8-column tiles but inside a block (a pipeline
    exists)."""
    nb = n // bs
    blocks = torch.eye(nb, dtype=torch.bool) | torch.tril(torch.rand(nb, nb, generator=gen) < 0.5, -1)
    m = blocks.repeat_interleave(bs, 0).repeat_interleave(bs, 1)
    grp = max(bs, 8)
    order = torch.randperm(n // grp, generator=gen)
    idx = (order[:, None] * grp + torch.arange(grp)).flatten()
    return m[idx][:, idx].float()


@pytest.mark.parametrize("bs,dtype,form", [(8, torch.bfloat16, "euler_matmul"), (4, torch.float32, "euler_matmul"),
                                           (16, torch.float32, "euler_matmul"), (8, torch.float32, "euler_einsum")])
def test_cuda_mma_pipeline_emulated(bs, dtype, form, emu_dir, monkeypatch):
    """The pipelines (two warps a tile, the upstream part handing the downstream one its state and
    partial sums through a ring of pages) against float64: L 7, 9 and 2 (pages past the end, fewer
    steps than the ring), 3 x 16 rows, blocks of 4, 8 and 16, a final output (the state and its
    readout: euler_einsum), and a denser pattern at run time (the every-tile path, an exchange a
    step); no upstream column tile reads a downstream one."""
    from ssmc.runtime.cache import get_cache
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    from ssmc.targets.cuda_bsp_mma import PIPES, _variant, pipe_fits, pipeline, tiles_of
    from ssmc.targets.reference import ReferenceKernel
    from ssmc.sparsity import PatternCache
    g = torch.Generator().manual_seed(27)
    n = 32
    mask = _dag_mask(n, bs, g)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for L in (7, 9, 2):
        if form == "euler_einsum":
            ins = (torch.randn(48, L, generator=g), torch.rand(48, L, generator=g) * 0.2,
                   torch.randn(n, n, generator=g) / 3, mask, torch.randn(48, L, n, generator=g),
                   torch.randn(48, L, n, generator=g))
            fn = P.euler_einsum
        else:
            ins = P.euler_inputs(3, L, 16, n, mask, g)
            ins = tuple(t.to(dtype) if t.dim() == 3 else t for t in ins)
            fn = P.euler_matmul
        r, xs = _region_and_inputs(fn, ins, monkeypatch)
        p = bsp_plan(r)
        up, down = pipeline(p)
        assert up and down and not {c for j, c in tiles_of(p, p.blocks) if j in up} - set(up)
        k = CudaBlockSparseKernel(r, p, get_cache(str(emu_dir / f"pipe{bs}")))
        k.poison = True
        assert f"tiles {up} upstream of {down}" in k.describe()
        pipes = [c for c in k.choices() if isinstance(c[1], str) and "p" in c[1]]
        assert pipes == [c for c in PIPES if pipe_fits(r, p, c[1])] and pipes
        pipes += [c for c in ((3, "m4p2x3"), (4, "m2p1x4")) if pipe_fits(r, p, c[1])]     # not timed, still right
        assert {_variant(c[1])[1] for c in pipes} == ({2} if bs == 16 else {2, 3, 4})    # 16: two tile groups
        w = PatternCache(r).used[-1]
        dense = list(xs)
        dense[w] = xs[w] + 0.05
        for case in (xs, dense):
            ref = ReferenceKernel(r).forward([x.double() for x in case])
            for c in pipes:
                k.force_groups = c
                outs = _emulate_bsp(k, case, emu_dir)
                for o, e in zip(outs, ref):
                    assert rel_err(o, e) < tol, (bs, L, c, case is dense, rel_err(o, e))
                assert k.last_launch["grid"] == 3


def test_pipeline_parts():
    """`pipeline` on masks with and without a cut: the parts cover the tiles, upstream reads only
    upstream, a cycle through every tile (dense, a ring) has none, and the cost is balanced."""
    from ssmc.targets.cuda_block_sparse import CudaBSPlan
    from ssmc.targets.cuda_bsp_mma import make_pipe, pipeline

    def plan(blocks, n=64):
        return CudaBSPlan(reg="n", rows=("b",), n=n, bs=8, blocks=tuple(blocks), terms=((None, None),), compute="float")
    assert pipeline(plan([(i, j) for i in range(8) for j in range(8)])) is None
    assert pipeline(plan([(i, i) for i in range(8)] + [((i + 1) % 8, i) for i in range(8)])) is None
    chain = plan([(i, i) for i in range(8)] + [(i + 1, i) for i in range(7)])      # 0 -> 1 -> ... -> 7
    up, down = pipeline(chain)
    assert up == [0, 1, 2, 3] and down == [4, 5, 6, 7] and make_pipe(chain, (up, down), 4, 2).sent[0] == (3,)
    four = make_pipe(chain, pipeline(chain, 4), 4, 2)
    assert four.parts == ((0, 1), (2, 3), (4, 5), (6, 7)) and four.sent[:3] == ((1,), (3,), (5,))
    assert four.readers == ((1, 3), (2, 3), (3,), ()) and four.fin() == 13
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        m = _dag_mask(64, 8, g)[::8, ::8].bool()
        p = plan([(i, j) for i in range(8) for j in range(8) if m[i, j]])
        for stages in (2, 3, 4):
            parts = pipeline(p, stages)
            stage = {j: w for w, part in enumerate(parts) for j in part}
            assert sorted(stage) == list(range(8)) and all(parts)
            assert all(stage[j] <= stage[i] for i in range(8) for j in range(8) if m[i, j])


def test_cuda_mma_declines():
    from ssmc.targets.cuda_block_sparse import CudaBSPlan
    from ssmc.targets.cuda_bsp_mma import mma_unsupported
    base = dict(reg="n", rows=("b",), bs=4, blocks=((0, 0),), terms=((None, None),), compute="float")
    assert mma_unsupported(None, CudaBSPlan(n=64, **base)) is None
    assert "float64" in mma_unsupported(None, CudaBSPlan(n=64, **{**base, "compute": "double"}))
    assert "12 elements" in mma_unsupported(None, CudaBSPlan(n=12, **base))
    assert "do not fit" in mma_unsupported(None, CudaBSPlan(n=64, **{**base, "terms": ((None, None),) * 2}))


def test_cuda_kernel_groups_balance_and_declines(monkeypatch):
    from ssmc.targets.cuda_block_sparse import bsp_plan, groups
    from ssmc.targets.cuda_printer import Unsupported
    g = torch.Generator().manual_seed(22)
    mask = P.block_mask(8, 8, 0.25, g)
    r, _ = _region_and_inputs(P.euler_matmul, P.euler_inputs(1, 3, 2, 64, mask, g), monkeypatch)
    p = bsp_plan(r)
    for G in (2, 4, 8):
        rows = groups(p, p.blocks, G)
        assert sorted(i for grp in rows for i in grp) == list(range(8)) and len(rows) == G
        cost = [sum(1 + sum(1 for (a, _) in p.blocks if a == i) for i in grp) for grp in rows]
        worst = max(1 + sum(1 for (a, _) in p.blocks if a == i) for i in range(8))
        assert max(cost) - min(cost) <= worst            # largest-first onto the least loaded
    # moving blocks off the heaviest rows: every block still multiplied once, loads within one
    from ssmc.targets.cuda_block_sparse import tables
    tab = tables(p, 8, split=True)
    assert tab["moved"][0] > 0 and tab["hslots"] >= 1
    kept = {(i, tab["cols"][0][z]) for i in range(8) for z in range(tab["start"][0][i], tab["start"][0][i + 1])}
    moved = {(i, j) for w in tab["help"][0] for (i, j, slot) in w if i >= 0}
    assert kept | moved == set(p.blocks) and not kept & moved and len(moved) == tab["moved"][0]
    loads = []
    for w in range(8):
        own = [i for i in tab["rows"][0][w] if i >= 0]
        loads.append(sum(tab["start"][0][i + 1] - tab["start"][0][i] for i in own)
                     + sum(1 for (i, _, _) in tab["help"][0][w] if i >= 0))
    assert max(loads) - min(loads) <= 1 or tab["moved"][0] == 8
    for i, slots in enumerate(tab["parts"][0]):                 # the owner adds each moved block once
        assert sorted(x for x in slots if x >= 0) == sorted(sl for w in tab["help"][0] for (r, _, sl) in w if r == i)
    # a transition that changes every step and along the batch: the Triton kernel's (fma3)
    mask = P.block_mask(4, 4, 0.25, g)
    Abar = torch.randn(2, 4, 16, 16, generator=g) * mask
    r2, _ = _region_and_inputs(P.given_abar, (torch.randn(2, 4, generator=g), Abar, torch.randn(2, 4, 16, generator=g),
                                              torch.randn(2, 4, 16, generator=g)), monkeypatch)
    with pytest.raises(Unsupported, match="varies along time or a parallel axis"):
        bsp_plan(r2)
    with pytest.raises(Unsupported, match="reverse-time"):
        bsp_plan(dataclasses.replace(r, reverse=True))
    from ssmc.targets import cuda
    monkeypatch.setattr(cuda, "toolchain_problem", lambda: None)      # the answer is the plan's
    why = cuda.CudaTarget().supports(r2, "block_sparse", 90, "cuda")
    assert isinstance(why, str) and "block-sparse kernel does not cover" in why and "varies along time" in why
    assert cuda.CudaTarget().supports(r, "block_sparse", 90, "cuda") is True


def test_cuda_kernel_times_each_warp_count_once(monkeypatch, tmp_path):
    """The first call of a shape times every warp count and keeps the fastest; later calls of
    the shape launch it without timing (launches recorded, nothing run)."""
    from ssmc.runtime.cache import get_cache
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    g = torch.Generator().manual_seed(25)
    fn, ins = _bsp_case("euler_matmul", 4, torch.float32, g)
    r, xs = _region_and_inputs(fn, ins, monkeypatch)
    k = CudaBlockSparseKernel(r, bsp_plan(r), get_cache(str(tmp_path)))
    launched, timed, built = [], [], []
    choices = k.choices()
    fake_ms = {c: 10.0 - i for i, c in enumerate(choices)}       # the last one is the fastest

    def timer(f):
        n = len(launched)
        f()
        timed.append(launched[n])
        return fake_ms[launched[n]]
    keys = []
    launch = lambda groups, grid, block, args: (launched.append(tuple(groups[:2])), keys.append(tuple(groups)))
    k.run(xs, launch, timer=timer, prebuild=built.append)
    assert timed == choices and (2, False) in choices and (4, False) in choices
    assert any(isinstance(c[1], str) for c in choices)          # tensor-core instances among them
    assert built == [[c + (True, False) for c in choices]]      # vector loads; 37 channels: rows share nothing
    assert launched[-1] == choices[-1] and k.last_launch["groups"] == choices[-1][0]
    assert all(key[2] for key in keys) and k.last_launch["vec"]     # contiguous inputs: the vector-load instance
    n = len(launched)
    k.run(xs, launch, timer=timer)
    assert launched[n:] == [choices[-1]] and len(timed) == len(choices)     # the same bucket: no timing
    # B along the state with stride 2 (a view of a wider tensor): the scalar-load instance, timed anew
    wide = [x for x in xs]
    b_in = next(i for i, s in enumerate(r.inputs) if tuple(xs[i].shape) == tuple(ins[4].shape))
    wide[b_in] = torch.repeat_interleave(xs[b_in], 2, dim=-1)[..., ::2]
    assert not wide[b_in].is_contiguous() and torch.equal(wide[b_in], xs[b_in])
    k.run(wide, launch, timer=timer)
    assert not keys[-1][2] and not k.last_launch["vec"]


@pytest.mark.parametrize("cc", [80, 90])
def test_cuda_kernel_nvrtc_builds(cc, monkeypatch, tmp_path):
    from ssmc.runtime.cache import get_cache
    from ssmc.targets import cuda
    from ssmc.targets.cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
    why = cuda.toolchain_problem()
    if why:
        pytest.skip(why)
    g = torch.Generator().manual_seed(23)
    mask = P.block_mask(8, 8, 0.25, g)
    ins = P.euler_inputs(1, 3, 2, 64, mask, g)
    ins = tuple(t.bfloat16() if t.dim() == 3 else t for t in ins)
    r, _ = _region_and_inputs(P.euler_matmul, ins, monkeypatch)
    k = CudaBlockSparseKernel(r, bsp_plan(r), get_cache(str(tmp_path)))
    binary = k.built(4, cc)
    assert len(binary) > 1000
    assert k.mma_why is None and len(k.built((4, "m2", True, True), cc)) > 1000     # tensor cores (mma.sync tf32)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in k.rendered((4, "m2", True, True)).source
    assert "__nv_bfloat16* __restrict__ in" in k.rendered(4).source
    assert "bsp_rows[2][4]" in k.rendered(4).source     # work lists: the compiled mask, and every block


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_block_sparse(dtype):
    g = torch.Generator().manual_seed(24)
    mask = P.block_mask(8, 8, 0.25, g)
    ins = [t.cuda() for t in P.euler_inputs(4, 64, 96, 64, mask, g)]
    ins = tuple(t.to(dtype) if t.dim() == 3 else t for t in ins)
    torch._dynamo.reset()
    report = ssmc.Report()
    fast = torch.compile(P.euler_matmul, backend=lambda gm, ex: ssmc.ssmc_backend(
        gm, ex, options={"target": "cuda"}, _report=report))
    out = fast(*ins)
    info = report.regions[0]
    assert info.target == "cuda" and info.strategy == "block_sparse", str(report)
    kern = lookup(info.key).kernel
    assert kern.last_launch is not None
    assert (kern.last_launch["groups"], kern.last_launch["split"]) in kern.choices()
    # fp32: the tensor cores' fp32 accumulation is not IEEE-rounded; the state grows here (A is not
    # contracting), so relative errors of a few 1e-5 at L64 are fp32 accuracy (measured: 1.5e-5)
    tol = 5e-5 if dtype == torch.float32 else 2e-2
    want = reference(P.euler_matmul, ins)[0]
    assert rel_err(out, want) < tol
    ins2 = (*ins[:3], torch.ones_like(ins[3]), *ins[4:])     # dense at run time: the second kernel
    want2 = reference(P.euler_matmul, ins2)[0]
    assert rel_err(fast(*ins2), want2) < tol
    assert any(isinstance(c[1], str) for c in kern.choices())        # tensor cores on this GPU
    try:
        for c in kern.choices():                  # every instance the timing may pick, both paths
            kern.force_groups = c
            assert rel_err(fast(*ins), want) < tol, (c, kern.last_launch)
            assert rel_err(fast(*ins2), want2) < tol, (c, kern.last_launch)
            assert kern.last_launch["vec"] and kern.last_launch["shared_rows"] == isinstance(c[1], str)
    finally:
        kern.force_groups = None
    # gradients of every input: the backward's scans on CUDA kernels (mix_adjoint), against float64
    xs = [t.detach().clone().requires_grad_() for t in ins]
    out, report = ssmc_run(P.euler_matmul, xs, target="cuda")        # inputs needing gradients: a new graph
    w = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
    got = torch.autograd.grad((out.float() * w).sum(), xs)
    x64 = [t.detach().double().requires_grad_() for t in ins]
    want = torch.autograd.grad((P.euler_matmul(*x64) * w.double()).sum(), x64)
    errs = [rel_err(a, b) for a, b in zip(got, want)]           # the mask's too (dense: d mask = A * dW)
    assert max(errs) < (2e-4 if dtype == torch.float32 else 3e-2), errs
    scans = lookup(report.regions[0].key).kernel.scans
    assert len(scans.kernels) == 3 and not scans.declined, (scans.kernels, scans.declined)


@pytest.mark.gpu
def test_gpu_cuda_block_sparse_pipelines():
    """The pipeline instances on the GPU (real barriers, the ring raced by two warps): every one
    against float64 on a mask with an upstream part, and dense at run time (the every-tile path),
    L 203 (pages past the end)."""
    from ssmc.targets.cuda_bsp_mma import PIPES, pipe_fits
    g = torch.Generator().manual_seed(29)
    mask = _dag_mask(64, 8, g)
    ins = [t.cuda() for t in P.euler_inputs(4, 203, 96, 64, mask, g)]
    ins = tuple(t.to(torch.bfloat16) if t.dim() == 3 else t for t in ins)
    torch._dynamo.reset()
    report = ssmc.Report()
    fast = torch.compile(P.euler_matmul, backend=lambda gm, ex: ssmc.ssmc_backend(
        gm, ex, options={"target": "cuda"}, _report=report))
    fast(*ins)
    kern = lookup(report.regions[0].key).kernel
    pipes = [c for c in kern.choices() if "p" in str(c[1])]
    assert pipes == [c for c in PIPES if pipe_fits(report.regions[0].ir, kern.plan, c[1])] and pipes
    ins2 = (*ins[:3], torch.ones_like(ins[3]), *ins[4:])
    want, want2 = reference(P.euler_matmul, ins)[0], reference(P.euler_matmul, ins2)[0]
    try:
        for c in pipes:
            kern.force_groups = c
            for _ in range(3):                    # the race, if any, more than once
                assert rel_err(fast(*ins), want) < 2e-2, (c, kern.last_launch)
            assert kern.last_launch["split"] == c[1]
            assert rel_err(fast(*ins2), want2) < 2e-2, (c, kern.last_launch)
    finally:
        kern.force_groups = None


def test_grad_of_transposed_input_under_inductor():
    """The region reads W = (A * mask).T, a transposed view. The backward op's real outputs must
    have the strides its fake kernel gave Inductor (the H200 run of the GPU test above failed
    Inductor's assert_size_stride on dA: fake (1, 64), real (64, 1)); the rest of the graph runs
    through Inductor here, as on a GPU."""
    # a cached graph keeps an old fake's strides (a context, not monkeypatch: torch 2.11's config
    # loses this alias of torch.compiler.config's option when monkeypatch restores it)
    with torch._inductor.config.patch(force_disable_caches=True):
        _transposed_input_grads()


def _transposed_input_grads():
    g = torch.Generator().manual_seed(12)
    mask = P.block_mask(8, 8, 0.25, g)
    ins = P.euler_inputs(2, 16, 8, 64, mask, g)
    A = ins[2].clone().requires_grad_()
    out, report = ssmc_run(P.euler_matmul, (*ins[:2], A, *ins[3:]), target="torch", rest="inductor")
    assert report.regions and report.regions[0].strategy == "block_sparse", str(report)
    (gA,) = torch.autograd.grad(out.square().sum(), A)
    A64 = ins[2].double().requires_grad_()
    ref = P.euler_matmul(*[t.double() for t in ins[:2]], A64, *[t.double() for t in ins[3:]])
    (rA,) = torch.autograd.grad(ref.square().sum(), A64)
    assert rel_err(gA, rA) < 1e-5
    # the op itself: real outputs contiguous, as the fake says, for a transposed input
    from ssmc.runtime.op import _region_bwd_fake
    xs = [ins[0], ins[2].T]
    fake = _region_bwd_fake("unused", xs, [], [True, True], [])
    assert all(f.is_contiguous() for f in fake)


def test_benchmark_tiny_cpu(tmp_path):
    import json
    from benchmarks import bench_block_sparse
    out = tmp_path / "tiny.json"
    bench_block_sparse.main(["--tiny", "--backward", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    train = rows["ssmc block-sparse fwd+bwd [torch]"]
    assert "error" not in train and train["ms"] > 0, train
    assert set(train["grad_rel_err_vs_float64"]) == {"x", "dt", "A", "B", "C"}
    assert max(train["grad_rel_err_vs_float64"].values()) < 1e-5
    assert rows["eager loop fwd+bwd (L16)"]["ms"] > 0 and "fwd_bwd_over_fwd" in data["summary"]
    for v in ("ssmc block-sparse [torch]", "ssmc dense A [torch]"):
        assert "error" not in rows[v], rows[v]
        assert rows[v]["ms"] > 0 and rows[v]["rel_err_vs_float64"] < 1e-5
        assert rows[v]["strategy"] == "block_sparse"
    assert rows["ssmc block-sparse [torch]"]["density"] == 0.25 and rows["ssmc dense A [torch]"]["density"] == 1.0
    assert any(v.startswith("eager loop") and "ms" in r for v, r in rows.items())
    assert "time_per_nonzero_block_sparse_over_dense" in data["summary"]


def test_benchmark_tiny_cpu_bf16(tmp_path):
    """bf16 inputs as on the GPU: every row runs (the H200 run's eager row failed: bf16 state @
    fp32 A does not run eagerly; it now runs on fp32 copies)."""
    import json
    from benchmarks import bench_block_sparse
    out = tmp_path / "tiny16.json"
    bench_block_sparse.main(["--tiny", "--dtype", "bf16", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert all("error" not in r and r["ms"] > 0 for r in rows), rows
    assert all(r["rel_err_vs_float64"] < 1e-2 for r in rows if r["variant"].startswith("ssmc"))


def test_composed_products_and_declines():
    def two_products(x, W1, mask, W2):
        h = x.new_zeros(x.shape[0], W1.shape[0])
        ys = []
        for t in range(x.shape[1]):
            h = h @ (W1 * mask) @ W2 * 0.5 + x[:, t]
            ys.append(h.sum(-1))
        return torch.stack(ys, 1)

    def left_product(x, W):            # mixes the state's middle dim, not its last
        h = x.new_zeros(x.shape[0], W.shape[0], 3)
        ys = []
        for t in range(x.shape[1]):
            h = W @ (0.9 * h) + x[:, t, :, None]
            ys.append(h.sum(-1))
        return torch.stack(ys, 1)

    def both_sides(x, W):              # W h W^T: two products along different dims
        h = x.new_zeros(x.shape[0], W.shape[0], W.shape[0])
        ys = []
        for t in range(x.shape[1]):
            h = W @ h @ W.T + x[:, t, :, None]
            ys.append(h.sum(-1))
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(13)
    n = 8
    mask = P.block_mask(2, 4, 0.5, g)
    W1, W2 = torch.randn(n, n, generator=g) / 3, torch.randn(n, n, generator=g) / 3
    x = torch.randn(2, 4, n, generator=g)
    info = check(two_products, (x, W1, mask, W2))
    assert info.ir.mix is not None
    info = check(left_product, (x, W1))
    assert info.ir.mix is not None and info.ir.mix_axis == info.ir.axes[1], str(info.ir)
    out, report = ssmc_run(both_sides, (x, W1))
    assert rel_err(out, reference(both_sides, (x, W1))[0]) < 1e-5
    assert not report.regions and "along another dim" in report.fallbacks[0][1], str(report)


def _textbook(u, A, B, C):
    """x_(k+1) = A x_k + B u_k, y_k = C x_k with column vectors: x of shape (n, 1)."""
    x = A.new_zeros(A.shape[0], 1)
    ys = []
    for k in range(u.shape[0]):
        x = A @ x + B @ u[k]
        ys.append(C @ x)
    return torch.stack(ys, 0)


def _textbook_batched(u, A, B, C):
    """The same with a batch in front (torch.matmul broadcasting A) and a per-step gate."""
    x = A.new_zeros(u.shape[1], A.shape[0], 1)
    ys = []
    for k in range(u.shape[0]):
        x = torch.matmul(A * torch.sigmoid(u[k, 0, 0]), x) + (u[k] @ B.T)[..., None]
        ys.append((C @ x).squeeze(-1))
    return torch.stack(ys, 1)


def _textbook_inputs(fn, seed: int, L: int, n: int = 6, scale: float = 0.3):
    """(u, A, B, C) for `_textbook` (u (L, 2, 1), C (1, n)) or `_textbook_batched` (u (L, 4, 2))."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(L, 4, 2, generator=g) if fn is _textbook_batched else torch.randn(L, 2, 1, generator=g)
    C = torch.randn(2, n, generator=g)
    return (u, scale * torch.randn(n, n, generator=g), torch.randn(n, 2, generator=g),
            C if fn is _textbook_batched else C[:1])


@pytest.mark.parametrize("fn", [_textbook, _textbook_batched])
def test_left_multiplied_column_state(fn):
    """The textbook form ``x = A @ x + B @ u[k]`` with x a column (n, 1): a transition along
    the state's first dim, not its last; values and gradients against float64."""
    ins = _textbook_inputs(fn, 14, 9)
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    assert report.regions[0].strategy == "block_sparse", str(report)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5
    grads_match(fn, ins)


def _kalman_column(z, A, K, H):
    """A steady-state Kalman filter on column states (n, b): predict x' = A x, correct with the
    gain K (n, m) on the innovation z - H x' (m rows: the state through another number of rows)."""
    x = z.new_zeros(A.shape[0], z.shape[2])
    xs = []
    for t in range(z.shape[0]):
        xp = A @ x
        x = xp + K @ (z[t] - H @ xp)
        xs.append(x)
    return torch.stack(xs)


def _kalman_row(z, A, K, H):
    """The same on row states (b, n), matrices applied from the right."""
    x = z.new_zeros(z.shape[2], A.shape[0])
    xs = []
    for t in range(z.shape[0]):
        xp = x @ A.T
        x = xp + (z[t].T - xp @ H.T) @ K.T
        xs.append(x)
    return torch.stack(xs)


def _state_feedback(z, A, K, H):
    """u = -K^T x (a feedback gain to m inputs), x = A (0.5 x) + H^T u + noise, by einsum."""
    x = z.new_zeros(z.shape[2], A.shape[0])
    ys = []
    for t in range(z.shape[0]):
        u = -torch.einsum("nm,bn->bm", K, x)
        x = torch.einsum("ij,bj->bi", A, 0.5 * x) + torch.einsum("mn,bm->bn", H, u) + z[t].T
        ys.append(x)
    return torch.stack(ys)


@pytest.mark.parametrize("fn", [_kalman_column, _kalman_row, _state_feedback])
def test_matrix_products_through_another_number_of_rows(fn):
    """Matrix products in a row along one state dim, one of them to m != n rows and the next
    back to n (a Kalman filter's H and K, a feedback gain), the first along the column state's
    first dim: one transition (their composition); values and gradients equal float64."""
    g = torch.Generator().manual_seed(47)
    n, m = 5, 2
    ins = (torch.randn(9, m, 3, generator=g), 0.9 * torch.eye(n) + 0.05 * torch.randn(n, n, generator=g),
           0.1 * torch.randn(n, m, generator=g), torch.randn(m, n, generator=g))
    if fn is _state_feedback:
        ins = (torch.randn(9, n, 3, generator=g), *ins[1:])
    info = check(fn, ins)
    assert info.strategy == "block_sparse" and info.ir.mix is not None, str(info)
    grads_match(fn, ins)


def _chunked_delta_rule(q, w, u, kd, decay):
    """The chunk loop of a chunked (gated) delta rule, its per-chunk terms given: a chunk's new
    values v = u - w S map the (dk, dv) state through C rows; the output q S + v; the state
    decays and takes kd^T v (back to dk rows)."""
    b, nh, N, C, dk = w.shape
    S = q.new_zeros(b, nh, dk, u.shape[-1])
    outs = []
    for i in range(N):
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append(q[:, :, i] @ S + v_new)
        S = S * decay[:, :, i, None, None] + kd[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, 2), S


def test_chunk_loop_of_a_chunked_delta_rule():
    """The state multiplied along its first matrix dim through C rows and back (as in HF's
    `torch_chunk_gated_delta_rule` chunk loop, which ran as written): one block_sparse region,
    a dk x dk transition per chunk; values and gradients equal float64 eager."""
    g = torch.Generator().manual_seed(67)
    b, nh, N, C, dk, dv = 2, 2, 5, 3, 4, 3
    ins = (torch.randn(b, nh, N, C, dk, generator=g), 0.3 * torch.randn(b, nh, N, C, dk, generator=g),
           torch.randn(b, nh, N, C, dv, generator=g), 0.3 * torch.randn(b, nh, N, C, dk, generator=g),
           torch.rand(b, nh, N, generator=g))
    info = check(_chunked_delta_rule, ins)
    assert info.strategy == "block_sparse", str(info)
    grads_match(_chunked_delta_rule, ins)


@pytest.mark.parametrize("module,name", [("qwen3_next", "torch_chunk_gated_delta_rule"),
                                         ("kimi_linear", "chunk_kimi_delta_attention")])
def test_hf_chunked_delta_rules(module, name):
    """HF transformers' own chunked delta rules (where installed): their chunk loop is one region;
    values and gradients equal float64 eager."""
    pytest.importorskip("transformers")
    import importlib
    try:
        f = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {module}.{name}")

    def fn(q, k, v, g, beta):
        return f(q, k, v, g, beta, chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True)
    gen = torch.Generator().manual_seed(71)
    b, L, h, dk, dv = 2, 16, 2, 4, 3
    gshape = (b, L, h, dk) if module == "kimi_linear" else (b, L, h)
    ins = (torch.randn(b, L, h, dk, generator=gen), torch.randn(b, L, h, dk, generator=gen),
           torch.randn(b, L, h, dv, generator=gen), -torch.rand(*gshape, generator=gen), torch.rand(b, L, h, generator=gen))
    info = check(fn, ins)
    assert info.strategy == "block_sparse", str(info)
    grads_match(fn, ins, tol=1e-4)


def _rk4_row(x, A, dt):
    """A classic Runge-Kutta step of h' = h A^T + u (u held over the step): the input enters the
    state directly (k1) and through the matrix (k2..k4)."""
    h = x.new_zeros(x.shape[0], A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        u = x[:, t]
        k1 = h @ A.T + u
        k2 = (h + dt / 2 * k1) @ A.T + u
        k3 = (h + dt / 2 * k2) @ A.T + u
        k4 = (h + dt * k3) @ A.T + u
        h = h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(h)
    return torch.stack(ys, 1)


def _rk4_column(x, A, dt):
    h = x.new_zeros(A.shape[0], x.shape[0])
    ys = []
    for t in range(x.shape[1]):
        u = x[:, t].T
        k1 = A @ h + u
        k2 = A @ (h + dt / 2 * k1) + u
        k3 = A @ (h + dt / 2 * k2) + u
        k4 = A @ (h + dt * k3) + u
        h = h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(h.T)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_rk4_row, _rk4_column])
def test_runge_kutta_step(fn, interp):
    """RK4 of a linear ODE: the matrix composed with itself up to four times; the input both in
    the drive directly and through the matrix (row form: the drive's products computed before
    the region, `apply_matrix`, where the assembler would tie u's dim to both a row and a
    column). Torch reference and the Triton kernel (interpreter): values and gradients."""
    g = torch.Generator().manual_seed(59)
    ins = (torch.randn(2, 9, 4, generator=g), 0.3 * torch.randn(4, 4, generator=g), torch.tensor(0.1))
    for target in ("torch", "triton"):
        info = check(fn, ins, target=target)
        assert info.strategy == "block_sparse" and info.target == target, str(info)
        grads_match(fn, ins, target=target)


def _implicit_column(x, A, dt):
    """Backward Euler, h = (I - dt A)^-1 (h + dt x), by torch.linalg.solve on (b, n, 1) columns."""
    M = torch.eye(A.shape[0], device=A.device) - dt * A
    h = x.new_zeros(x.shape[0], A.shape[0], 1)
    ys = []
    for t in range(x.shape[1]):
        h = torch.linalg.solve(M, h + dt * x[:, t, :, None])
        ys.append(h[..., 0])
    return torch.stack(ys, 1)


def _implicit_row(x, A, dt):
    """The same on rows, solve(..., left=False): h (I - dt A) = h_prev + dt x."""
    h = x.new_zeros(x.shape[0], A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.linalg.solve(torch.eye(A.shape[0], device=A.device) - dt * A, h + dt * x[:, t], left=False)
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_implicit_column, _implicit_row])
def test_implicit_step_by_solve(fn):
    """torch.linalg.solve(A, B) in a step is inv(A) @ B, linear in B: one block_sparse region;
    values and gradients equal float64 eager."""
    g = torch.Generator().manual_seed(61)
    ins = (torch.randn(2, 9, 4, generator=g), 0.3 * torch.randn(4, 4, generator=g), torch.tensor(0.1))
    info = check(fn, ins)
    assert info.strategy == "block_sparse", str(info)
    grads_match(fn, ins)


@pytest.mark.parametrize("form", ["euler_einsum", "rotary", "lti_matmul"])
def test_gradients_match_eager(form):
    """The reference backward runs the adjoint (lam = direct + a lam' + M^T lam') in chunks."""
    g = torch.Generator().manual_seed(14)
    mask = P.block_mask(4, 2, 0.25, g)
    if form == "euler_einsum":
        ins = (torch.randn(2, 7, generator=g), torch.rand(2, 7, generator=g) * 0.2,
               torch.randn(8, 8, generator=g) / 3, mask, torch.randn(2, 7, 8, generator=g),
               torch.randn(2, 7, 8, generator=g))
    elif form == "rotary":
        ins = (torch.randn(2, 7, 3, generator=g), torch.randn(2, 7, 3, 4, generator=g),
               torch.rand(2, 7, 3, 4, generator=g), torch.randn(2, 7, 4, generator=g),
               torch.randn(2, 7, 4, generator=g))
    else:
        ins = (torch.randn(2, 7, 3, generator=g), torch.randn(8, 8, generator=g) / 3, mask,
               torch.randn(2, 7, 8, generator=g), torch.randn(2, 7, 8, generator=g))
    fn = getattr(P, form)

    def grads(compiled, xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = as_tuple(ssmc_run(fn, xs, chunk=3)[0] if compiled else fn(*xs))
        loss = sum((o.double() * torch.cos(torch.arange(o.numel(), dtype=torch.float64)).view(o.shape)).sum()
                   for o in out)
        return torch.autograd.grad(loss, xs, allow_unused=True)
    got = grads(True, ins)
    ref = grads(False, [x.double() for x in ins])
    for i, (a, b) in enumerate(zip(got, ref)):
        assert rel_err(a, b) < 1e-4, f"input {i}: {rel_err(a, b):.3g}"


def test_matrix_used_in_two_roles():
    """A matrix that is a term of the transition and also a factor of a composed product
    (h @ W then W's result through V), and one the readout adds to the state: each must not be
    read along its diagonal (they ran right, or fall back; never a wrong or crashing region)."""
    def reused(x, W, V):
        h = x.new_zeros(x.shape[0], W.shape[0])
        ys = []
        for t in range(x.shape[1]):
            g = h @ W
            h = 0.5 * g + g @ V + x[:, t]
            ys.append(h.sum(-1))
        return torch.stack(ys, 1)

    def epilogue(x, a, W):
        h = x.new_zeros(x.shape[0], W.shape[0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t]
            ys.append(h + h @ W)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(15)
    W, V = torch.randn(4, 4, generator=g) / 3, torch.randn(4, 4, generator=g) / 3
    x = torch.randn(2, 5, 4, generator=g)
    info = check(reused, (x, W, V))
    assert info.ir.mix is not None
    ins = (x, torch.rand(4, generator=g), W)
    out, report = ssmc_run(epilogue, ins)
    assert rel_err(out, reference(epilogue, ins)[0]) < TOL[torch.float32], str(report)


# -- complex diagonal decays (LRU): real pairs, 2x2 rotation-scale blocks --------------------------

def _c128(x):
    return x.to(torch.complex128) if x.is_complex() else x.double() if x.is_floating_point() else x


def crel_err(out, ref) -> float:
    """rel_err for real or complex outputs (complex compared as (re, im) pairs)."""
    if out.is_complex() or ref.is_complex():
        assert out.is_complex() and ref.is_complex(), (out.dtype, ref.dtype)
        out, ref = torch.view_as_real(out.resolve_conj()), torch.view_as_real(ref.resolve_conj())
    return rel_err(out, ref)


CTOL = {torch.complex64: 1e-5, torch.complex128: 1e-10}


def check_complex(fn, inputs, cdt=torch.complex64, **options):
    """Compile with ssmc and compare every output against complex128 eager; returns the
    region's info."""
    out, report = ssmc_run(fn, inputs, **options)
    assert len(report.regions) == 1, str(report)
    ref = as_tuple(fn(*[_c128(x) for x in inputs]))
    for o, r in zip(as_tuple(out), ref):
        assert o.shape == r.shape and o.is_complex() == r.is_complex()
        err = crel_err(o, r)
        assert err <= CTOL[cdt], f"rel err {err:.3g}\n{report}"
    return report.regions[0]


def _assert_rotation_region(info, d):
    r = info.ir
    assert info.strategy == "block_sparse" and r.decay_kind == "matrix"
    assert r.mix.block == 2 and r.mix.nblocks == 1 and r.mix.blocks == ((0, 0),)
    assert any("rotation-scale block" in n and "carried as real pairs" in n for n in info.notes), info.notes


@pytest.mark.parametrize("cdt", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("b,L,d,n", [(1, 3, 2, 1), (2, 6, 5, 3), (3, 8, 16, 4)])
def test_lru_lti(b, L, d, n, cdt):
    g = torch.Generator().manual_seed(20 + b * 7 + d)
    info = check_complex(P.lru, P.lru_inputs(b, L, d, n, g, cdt), cdt)
    _assert_rotation_region(info, d)
    r = info.ir
    assert "t" not in ir.axes_of(r.decay, r.axes) and "t" not in ir.axes_of(r.mix.expr, r.axes)   # LTI
    assert len(r.axes) == 3      # (b, d, 2): complex channels as (re, im) pairs
    kinds = sorted(o.kind for o in r.outputs)
    assert kinds == ["final", "steps"]                          # readout fused; final complex state


@pytest.mark.parametrize("b,L,d", [(1, 4, 3), (2, 7, 8)])
def test_lru_input_dependent(b, L, d):
    g = torch.Generator().manual_seed(30 + d)
    ins = (torch.randn(b, L, generator=g), torch.rand(b, L, generator=g) + 0.1, torch.randn(d, generator=g) - 1,
           torch.randn(d, generator=g), torch.randn(d, generator=g, dtype=torch.complex64),
           torch.randn(d, generator=g, dtype=torch.complex64))
    info = check_complex(P.lru_input_dependent, ins)
    _assert_rotation_region(info, d)
    r = info.ir
    assert "t" in ir.axes_of(r.decay, r.axes) and "t" in ir.axes_of(r.mix.expr, r.axes)   # per step
    # lam_t is fused: computed in the region from dt, nu_log and theta, not materialised
    assert {"exp", "cos", "sin"} <= {x.name for x in ir.walk(r.mix.expr) if isinstance(x, ir.Op)} | \
        {x.name for x in ir.walk(r.decay) if isinstance(x, ir.Op)}


def test_lru_given_lambda_initial_state_and_complex_outputs():
    g = torch.Generator().manual_seed(40)
    b, L, d = 2, 6, 5
    lam = torch.polar(torch.rand(b, L, d, generator=g) * 0.5 + 0.45, torch.randn(b, L, d, generator=g))
    ins = (torch.randn(b, L, generator=g), lam, torch.randn(d, generator=g, dtype=torch.complex64),
           torch.randn(b, d, generator=g, dtype=torch.complex64))
    info = check_complex(P.lru_given_lambda, ins)
    _assert_rotation_region(info, d)
    assert info.ir.init is not None


def test_lru_readouts():
    g = torch.Generator().manual_seed(41)
    d = 6
    lam = torch.polar(torch.rand(d, generator=g) * 0.5 + 0.45, torch.randn(d, generator=g))
    ins = (torch.randn(3, 7, generator=g), lam, torch.randn(d, generator=g, dtype=torch.complex64),
           torch.randn(d, generator=g, dtype=torch.complex64), torch.randn(4, d, generator=g, dtype=torch.complex64))
    info = check_complex(P.lru_readouts, ins)
    _assert_rotation_region(info, d)
    ins128 = tuple(_c128(x) for x in ins)
    check_complex(P.lru_readouts, ins128, torch.complex128)


def test_lru_conj_in_update():
    """conj(h) in the update is a matrix product along the pair axis, composed with the rotation."""
    g = torch.Generator().manual_seed(42)
    d = 5
    ins = (torch.randn(2, 6, generator=g), torch.rand(d, generator=g) * 0.5 + 0.45, torch.randn(d, generator=g),
           torch.randn(d, generator=g, dtype=torch.complex64))
    info = check_complex(P.lru_conj, ins)
    assert info.ir.mix.block == 2


def test_lru_explain():
    g = torch.Generator().manual_seed(43)
    ins = P.lru_inputs(2, 5, 4, 3, g)
    report = ssmc.explain(P.lru, *ins)
    text = str(report)
    assert len(report.regions) == 1 and not report.fallbacks, text
    assert "strategy block_sparse (non-diagonal transition along i2: 2x2 blocks, 1/1 nonzero" in text
    assert "complex state complex64[2, 4] carried as real pairs float32[2, 4, 2]" in text
    assert "rotation-scale block [[re lam, -im lam], [im lam, re lam]] per complex channel" in text
    assert "m[i2, j] = " in text and "sum_j(m[i2, j] * h[..., j])" in text
    assert "complex: the body gives view_as_real of it" in text      # the final state comes back complex


@pytest.mark.parametrize("kind,why", [("tanh", "`tanh`"), ("abs", "`abs`"), ("square", "by itself"),
                                      ("real", "`.real`")])
def test_complex_nonlinear_falls_back(kind, why):
    fn = P.complex_nonlinear(kind)
    g = torch.Generator().manual_seed(44)
    lam = torch.polar(torch.rand(4, generator=g) * 0.5 + 0.3, torch.randn(4, generator=g))
    ins = (torch.randn(2, 5, generator=g), lam, torch.randn(4, generator=g, dtype=torch.complex64) * 0.3)
    out, report = ssmc_run(fn, ins)
    assert not report.regions
    (where, reason), = report.fallbacks
    assert "complex state not split into real pairs" in reason and why in reason, reason
    assert "the loop runs as written" in reason
    assert rel_err(out, fn(*ins)) < 1e-6          # the loop as written, not a wrong region
    assert "fallback" in str(ssmc.explain(fn, *ins))


def test_complex_state_needs_the_split():
    """With the split impossible (a complex op ssmc does not split) the reason names the op."""
    def fn(x, lam):
        h = torch.zeros(x.shape[0], lam.shape[0], dtype=lam.dtype)
        ys = []
        for t in range(x.shape[1]):
            h = lam * h + x[:, t, None]
            ys.append(torch.sigmoid(h).real)
        return torch.stack(ys, 1)
    ins = (torch.randn(2, 4), torch.polar(torch.rand(3), torch.randn(3)))
    out, report = ssmc_run(fn, ins)
    assert not report.regions and "`sigmoid` of a complex value" in report.fallbacks[0][1], str(report)
    assert rel_err(out, fn(*ins)) < 1e-6


@pytest.mark.parametrize("form", ["lru", "lru_input_dependent"])
def test_lru_gradients_match_eager(form):
    """Gradients through the region's adjoint and back through the complex views (torch.real,
    view_as_real, view_as_complex) reach the original parameters, real and complex."""
    g = torch.Generator().manual_seed(45)
    if form == "lru":
        ins = P.lru_inputs(2, 7, 4, 3, g)
    else:
        ins = (torch.randn(2, 7, generator=g), torch.rand(2, 7, generator=g) + 0.1, torch.randn(4, generator=g) - 1,
               torch.randn(4, generator=g), torch.randn(4, generator=g, dtype=torch.complex64),
               torch.randn(4, generator=g, dtype=torch.complex64))
    fn = getattr(P, form)

    def grads(compiled, xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        out = as_tuple(ssmc_run(fn, xs, chunk=3)[0] if compiled else fn(*xs))
        loss = 0
        for o in out:
            o = torch.view_as_real(o) if o.is_complex() else o
            w = torch.cos(torch.arange(o.numel(), dtype=torch.float64)).view(o.shape)
            loss = loss + (o.double() * w).sum()
        return torch.autograd.grad(loss, xs)
    got = grads(True, ins)
    ref = grads(False, [_c128(x) for x in ins])
    for i, (a, b) in enumerate(zip(got, ref)):
        assert crel_err(a, b) < 1e-4, f"input {i}: {crel_err(a, b):.3g}"


def test_lru_triton_declines_a_readout_summed_over_channels(interp):
    """Re(h * C).sum(-1) sums over the channels and the pair axis: the block-sparse Triton kernel
    sums over the mixed (pair) axis only, so the torch target runs the region, with the reason."""
    g = torch.Generator().manual_seed(46)
    ins = (torch.randn(2, 4, generator=g), torch.rand(2, 4, generator=g) + 0.1, torch.randn(3, generator=g) - 1,
           torch.randn(3, generator=g), torch.randn(3, generator=g, dtype=torch.complex64),
           torch.randn(3, generator=g, dtype=torch.complex64))
    info = check_complex(P.lru_input_dependent, ins, target="triton")
    assert info.target == "torch" and "nested" in info.target_reasons["triton"], info.target_reasons


@pytest.mark.parametrize("form", ["lru", "lru_given_lambda"])
def test_triton_kernel_lru(form, interp):
    g = torch.Generator().manual_seed(47)
    if form == "lru":
        ins = P.lru_inputs(2, 3, 3, 2, g)
    else:
        lam = torch.polar(torch.rand(2, 3, 3, generator=g) * 0.5 + 0.45, torch.randn(2, 3, 3, generator=g))
        ins = (torch.randn(2, 3, generator=g), lam, torch.randn(3, generator=g, dtype=torch.complex64),
               torch.randn(2, 3, generator=g, dtype=torch.complex64))
    info = check_complex(getattr(P, form), ins, target="triton")
    entry = lookup(info.key)
    assert entry.target == "triton" and entry.failure is None, entry.failure
    kern = entry.kernel
    assert kern.fallback is None, kern.fallback
    assert kern.plan.mode == "fma2" and kern.plan.bs == 2 and kern.plan.reg == "i2", kern.plan_text()


@pytest.mark.gpu
def test_gpu_lru_triton():
    g = torch.Generator().manual_seed(48)
    ins = tuple(x.cuda() for x in P.lru_inputs(4, 64, 32, 16, g))
    info = check_complex(P.lru, ins, target="triton")
    assert info.target == "triton" and info.strategy == "block_sparse", info.target_reasons
    assert lookup(info.key).kernel.fallback is None



def test_matrix_transition_with_a_broadcast_initial_state():
    """An initial state of shape (b, n, 1) that the first step broadcasts to (b, n, m) (the
    drive is wider): the executor and the adjoint expand it, its gradient sums back."""
    def fn(u, A, B, x0):
        x, ys = x0, []
        for k in range(u.shape[0]):
            x = torch.matmul(A * torch.sigmoid(u[k, 0, 0]), x) + B @ u[k]
            ys.append(x.sum(-2))
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(15)
    n = 6
    ins = (torch.randn(9, 2, 2, generator=g), 0.3 * torch.randn(n, n, generator=g), torch.randn(n, 2, generator=g),
           torch.randn(2, n, 1, generator=g))
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5
    grads_match(fn, ins)


def _matvec_unsqueezed(x, A, At):
    h = x.new_zeros(x.shape[0], A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = (A @ h.unsqueeze(-1)).squeeze(-1) + x[:, t]
        ys.append((h[:, None, :] @ A).squeeze(-2))          # the row form in the readout
    return torch.stack(ys, 1)


def _matvec_bmm(x, A, At):
    h = x.new_zeros(x.shape[0], A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.bmm(At[:, t], h[..., None])[..., 0] + x[:, t]    # a given per-step Abar
        ys.append(h)
    return torch.stack(ys, 1)


def _matvec_mv(x, A, At):
    h = x.new_zeros(A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = torch.mv(A, h) + x[0, t]
        ys.append(h)
    return torch.stack(ys, 0)


def _matvec_transposed(x, A, At):
    h = x.new_zeros(x.shape[0], A.shape[0])
    ys = []
    for t in range(x.shape[1]):
        h = (A @ h.T).T + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_matvec_unsqueezed, _matvec_bmm, _matvec_mv, _matvec_transposed])
def test_matrix_vector_products_through_a_unit_dim(fn):
    """``(A @ h.unsqueeze(-1)).squeeze(-1)``, ``torch.bmm(A_t, h[..., None])[..., 0]``,
    ``torch.mv(A, h)`` and ``(A @ h.T).T`` are the einsums they are: one block_sparse region;
    values and gradients against float64."""
    g = torch.Generator().manual_seed(16)
    n = 5
    ins = (torch.randn(2, 8, n, generator=g), 0.3 * torch.randn(n, n, generator=g),
           0.3 * torch.randn(2, 8, n, n, generator=g))
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == 1 and report.regions[0].strategy == "block_sparse" and not report.fallbacks, \
        str(report)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5
    grads_match(fn, ins)


def test_matrix_used_as_transition_and_readout():
    """A read by the transition (rows, columns) and by the readout (rows summed, columns a new
    output axis): one load cannot carry both labels, so the readout is not fused (it ran into a
    ValueError at run time before); values and gradients against float64."""
    def fn(x, A):
        h = x.new_zeros(x.shape[0], A.shape[0])
        ys = []
        for t in range(x.shape[1]):
            h = torch.einsum("ik,ak->ai", A, h) + x[:, t]
            ys.append(torch.einsum("ki,ak->ai", A, h))
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(17)
    ins = (torch.randn(2, 6, 5, generator=g), 0.3 * torch.randn(5, 5, generator=g))
    out, report = ssmc_run(fn, ins)
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5
    grads_match(fn, ins)


@pytest.mark.parametrize("fn", [_textbook, _textbook_batched])
def test_triton_kernel_transition_along_another_axis(fn, interp):
    """The Triton block-sparse kernel holds a transition along another axis than the last with
    that axis last (the initial state permuted, its gradient permuted back): values and
    gradients against float64 under the interpreter."""
    ins = _textbook_inputs(fn, 18, 7)
    out, report = ssmc_run(fn, ins, target="triton")
    assert [r.target for r in report.regions] == ["triton"], str(report)
    assert "moved last" in lookup(report.regions[0].key).kernel.plan_text()
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5
    grads_match(fn, ins, target="triton")


def _column_squeezed(u, A, Bv):
    """An LMU-style memory as a (b, n, 1) column by `torch.baddbmm`, read out squeezed."""
    m = u.new_zeros(u.shape[0], A.shape[0], 1)
    ys = []
    for t in range(u.shape[1]):
        m = torch.baddbmm(Bv * u[:, t, :, None], A.expand(u.shape[0], -1, -1), m)
        ys.append(m.squeeze(-1))
    return torch.stack(ys, 1)


def _row_unsqueezed(u, A, Bv):
    """The same as a (b, 1, n) row multiplied on the right, read out as ``h[:, 0]``."""
    h = u.new_zeros(u.shape[0], 1, A.shape[0])
    ys = []
    for t in range(u.shape[1]):
        h = h @ A.T + u[:, t, None, :] * Bv[:, 0]
        ys.append(h[:, 0])
    return torch.stack(ys, 1)


@pytest.mark.parametrize("fn", [_column_squeezed, _row_unsqueezed])
def test_triton_kernel_state_with_a_size_one_dim(fn, interp):
    """A state with a size-1 dim read out without it (squeezed or indexed 0): the readout's sum
    over that one element is dropped (`Region.without_unit_sums`), so the Triton block-sparse
    kernel runs it (before: declined, "the readout sums over i2"); values and gradients."""
    g = torch.Generator().manual_seed(20)
    n = 8
    ins = (torch.randn(3, 9, 1, generator=g), 0.9 * torch.eye(n) + 0.05 * torch.randn(n, n, generator=g),
           torch.randn(n, 1, generator=g))
    out, report = ssmc_run(fn, ins, target="triton")
    assert [r.target for r in report.regions] == ["triton"], str(report)
    assert report.regions[0].ir.unit_axes, str(report.regions[0].ir)
    assert lookup(report.regions[0].key).kernel.fallback is None
    assert rel_err(out, reference(fn, ins)[0]) < 1e-5
    grads_match(fn, ins, target="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [_textbook, _textbook_batched, _matvec_bmm, _matvec_transposed,
                                _column_squeezed, _row_unsqueezed])
def test_left_products_on_the_gpu(fn):
    """The textbook column form and the matrix-vector spellings on CUDA (target auto), L 300,
    against float64 eager on the CPU."""
    g = torch.Generator().manual_seed(19)
    n = 16
    if fn in (_textbook, _textbook_batched):
        ins = _textbook_inputs(fn, 19, 300, n, 0.2)
    elif fn in (_column_squeezed, _row_unsqueezed):
        ins = (torch.randn(4, 300, 1, generator=g), 0.9 * torch.eye(n) + 0.02 * torch.randn(n, n, generator=g),
               torch.randn(n, 1, generator=g))
    else:
        ins = (torch.randn(4, 300, n, generator=g), 0.2 * torch.randn(n, n, generator=g),
               0.2 * torch.randn(4, 300, n, n, generator=g))
    out, report = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    assert rel_err(out.cpu(), reference(fn, ins)[0]) < 1e-4, str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [_column_state, _kalman_column, _kalman_row, _state_feedback])
def test_odd_sizes_and_compositions_on_the_gpu(fn):
    """An odd-sized transition (7 rows, 1x1 blocks on Triton) and the matrix products through
    another number of rows, on CUDA (target auto), L 300: a generated kernel runs (no torch
    reference), values against float64 eager on the CPU."""
    g = torch.Generator().manual_seed(53)
    n, m = 7, 3
    A = 0.9 * torch.eye(n) + 0.05 * torch.randn(n, n, generator=g)
    if fn is _column_state:
        ins = (torch.randn(4, 300, 2, generator=g), A, torch.randn(n, 2, generator=g), torch.randn(3, n, generator=g))
    else:
        ins = (torch.randn(300, n if fn is _state_feedback else m, 4, generator=g), A,
               0.1 * torch.randn(n, m, generator=g), torch.randn(m, n, generator=g))
    out, report = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    info = report.regions[0]
    assert info.target != "torch" and getattr(lookup(info.key).kernel, "fallback", None) is None, str(report)
    assert rel_err(out.cpu(), reference(fn, ins)[0]) < 1e-4, str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [_chunked_delta_rule, _rk4_row, _rk4_column, _implicit_column, _implicit_row])
def test_chunk_loops_and_integrators_on_the_gpu(fn):
    """A chunked delta rule's chunk loop (dk 16, 40 chunks of 8), Runge-Kutta and implicit steps
    (L 300) on CUDA (target auto): a generated kernel runs, values and gradients against float64
    eager."""
    g = torch.Generator().manual_seed(73)
    if fn is _chunked_delta_rule:
        b, nh, N, C, dk, dv = 2, 2, 40, 8, 16, 8
        ins = (torch.randn(b, nh, N, C, dk, generator=g), 0.05 * torch.randn(b, nh, N, C, dk, generator=g),
               torch.randn(b, nh, N, C, dv, generator=g), 0.05 * torch.randn(b, nh, N, C, dk, generator=g),
               torch.rand(b, nh, N, generator=g))
    else:
        ins = (torch.randn(4, 300, 8, generator=g), 0.3 * torch.randn(8, 8, generator=g), torch.tensor(0.1))
    out, report = ssmc_run(fn, tuple(x.cuda() for x in ins))
    assert len(report.regions) == 1 and not report.fallbacks, str(report)
    info = report.regions[0]
    assert info.target != "torch" and getattr(lookup(info.key).kernel, "fallback", None) is None, str(report)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o.cpu(), r) < 1e-4, str(report)
    grads_match(fn, tuple(x.cuda() for x in ins), tol=1e-4)
