"""Compiler and cache faults: each recovers, and the report says what happened."""
import multiprocessing as mp
import os
import stat

import pytest
import torch

from ssmc.runtime.cache import KernelCache, cache_key, get_cache
from torch._higher_order_ops.scan import scan


def _writer(root, i):
    c = KernelCache(root)
    for _ in range(50):
        c.put(cache_key("same"), "k.bin", b"x" * 100_000)
        c.mem.clear()
        assert c.get(cache_key("same"), "k.bin") == b"x" * 100_000


def test_two_processes_writing_one_entry(tmp_path):
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_writer, args=(str(tmp_path), i)) for i in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(120)
        assert p.exitcode == 0
    assert KernelCache(tmp_path).get(cache_key("same"), "k.bin") == b"x" * 100_000


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_cache_directory_degrades_to_memory(tmp_path):
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        c = KernelCache(tmp_path / "sub")
        assert c.put("k" * 64, "a.bin", b"data") is None
        assert not c.writable and "not writable" in c.events[-1]
        assert c.get("k" * 64, "a.bin") == b"data"
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_unwritable_cache_directory_degrades_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = KernelCache(blocker / "cache")          # a path under a regular file: mkdir fails, even as root
    assert c.put("k" * 64, "a.bin", b"data") is None
    assert not c.writable and "not writable" in c.events[-1]
    assert c.get("k" * 64, "a.bin") == b"data"


def test_truncated_entry_is_rebuilt(tmp_path):
    c = KernelCache(tmp_path)
    key = cache_key("x")
    p = c.put(key, "a.bin", b"0123456789")
    p.write_bytes(p.read_bytes()[:-3])
    c.mem.clear()
    assert c.get(key, "a.bin") is None and "corrupt" in c.events[-1] and not p.exists()


def test_very_long_sequences_with_decays_near_zero_and_one():
    """L = 65536 (through the scan op: one node, no unrolling): decays within 1e-6 of 1 and of
    0 against a float64 loop; nothing overflows or underflows into NaN."""
    from conftest import ssmc_run

    def fn(x, a):
        def step(h, xs):
            x_t, a_t = xs
            h = a_t * h + x_t
            return h, h + 0.0
        h, ys = scan(step, torch.zeros_like(x[:, 0]), (x, a), dim=1)
        if ys.shape[1] != x.shape[1]:
            ys = ys.movedim(0, 1)
        return ys, h
    L = 65536
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, L, 2, generator=g)
    a = torch.empty(2, L, 2)
    a[..., 0] = 1 - 1e-6 * torch.rand(2, L, generator=g)       # near one: long memory
    a[..., 1] = 1e-6 * torch.rand(2, L, generator=g)           # near zero: forgets at once
    (ys, h), rep = ssmc_run(fn, (x, a))
    assert len(rep.regions) == 1
    assert torch.isfinite(ys).all()
    hh = torch.zeros(2, 2, dtype=torch.float64)
    ref = torch.empty(2, L, 2, dtype=torch.float64)
    xd, ad = x.double(), a.double()
    for t in range(L):
        hh = ad[:, t] * hh + xd[:, t]
        ref[:, t] = hh
    err = ((ys.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-4, err
    assert torch.allclose(h.double(), ref[:, -1], rtol=1e-4, atol=1e-4)


def test_strided_and_expanded_inputs():
    from conftest import TOL, reference, rel_err, ssmc_run
    import programs as P
    fn = P.mamba1("stack")
    x, dt, A, B, C, D, z, bias = P.mamba1_inputs(seed=81)
    x = x.transpose(0, 1).contiguous().transpose(0, 1)            # non-contiguous
    B = B[:, :, :1].expand(B.shape)                                # stride 0 along n
    z = torch.randn(2, 16, 4)[:, ::2]                              # a strided slice
    ins = (x, dt, A, B, C, D, z, bias)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1
    assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


def test_missing_cupy_and_old_arch_are_declined_with_reasons(monkeypatch):
    """No CuPy, or a GPU older than sm_80: the targets decline the region with the reason (the
    backend then falls back, and the report carries it), never crash; on CPU a CUDA target is
    declined too, and the model runs right."""
    import sys
    from conftest import TOL, reference, rel_err, ssmc_run
    import programs as P
    from ssmc.targets import cuda as C
    from ssmc.targets import triton as T
    ins = P.mamba1_inputs(seed=82)
    out, rep = ssmc_run(P.mamba1("stack"), ins, target="cuda")
    region = rep.regions[0]
    assert region.target == "torch" and "target cuda declined: runs on CUDA devices only" in str(rep), str(rep)
    assert rel_err(out, reference(P.mamba1("stack"), ins)[0]) <= TOL[torch.float32]
    monkeypatch.setitem(sys.modules, "cupy", None)               # `import cupy` raises ImportError
    why = C.toolchain_problem()
    assert why and "cupy" in why
    assert C.CudaTarget().supports(region.ir, "chunked_scan", 90, "cuda") == why
    assert "sm_80" in C.CudaTarget().supports(region.ir, "chunked_scan", 75, "cuda")
    assert "sm_80" in T.TritonTarget().supports(region.ir, "chunked_scan", 75, "cuda")
