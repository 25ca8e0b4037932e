"""The ``cuda`` target: CUDA C rendered from the region IR, compiled by NVRTC, run by CuPy.

Without a GPU (CI):
- structure: what the plan hoists where (softplus once per step, exp2 with log2(e) folded into
  A once per state element), the reasons supports() and plan() give;
- every kernel renders and compiles through NVRTC for sm_80 and sm_90, for the Mamba-1, Mamba-2
  and gated regions, with fp32, bf16 and fp16 inputs, and a region using every op of
  ssmc.ops.ELEMENTWISE (skipped without CuPy/NVRTC/headers: pip install -e ".[cuda]");
- numerics of the generated source itself, compiled with g++ against tests/cuda_emu.h (a CPU
  emulation of blocks, warps, shuffles and shared memory), against the float64 torch
  reference: both layouts, every scan path (one or several warps per row, one or several rows
  per block), several chunks, L not a multiple of any block, L = 1, non-contiguous and
  misaligned inputs, bf16/fp16/fp64, every op, every kernel of the sm_90 table (skipped
  without g++).
With a GPU (``pytest -m gpu``): numerics on the device at L in {1, 7, 513, 2048}, fp32 and bf16,
non-contiguous inputs, poisoned outputs, every kernel of the GPU's table, a second GPU, end to
end through torch.compile, and a failed NVRTC compile falling back with the log in the report.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import programs as P
from conftest import TOL, as_tuple, reference, rel_err, ssmc_run
from ssmc import ir
from ssmc.options import make_options
from ssmc.runtime.cache import get_cache
from ssmc.targets import cuda
from ssmc.targets.cuda_printer import Unsupported, emit, plan
from ssmc.targets.reference import run as reference_run

HERE = Path(__file__).parent


# -- regions, captured once ---------------------------------------------------------------------

def _capture(fn, inputs) -> ir.Region:
    _, rep = ssmc_run(fn, inputs, target="torch")
    assert len(rep.regions) == 1, str(rep)
    return rep.regions[0].ir


@pytest.fixture(scope="module")
def regions():
    x, dt, A, B, C, *_ = P.mamba1_inputs()
    return {
        "mamba1": _capture(P.mamba1("final"), P.mamba1_inputs()),           # (b, L, d), + final state
        "mamba1_bdl": _capture(P.mamba1_bdl(), P.mamba1_inputs(layout="bdl")),  # time contiguous
        "mamba2": _capture(P.mamba2("final"), P.mamba2_inputs(with_h0=True)),
        "gated": _capture(P.gated(), P.gated_inputs()),
        "s4d": _capture(P.s4d(), P.s4d_inputs()),
        "scan": _capture(P.mamba1_scan(), P.mamba1_inputs()),               # output laid out (t, b, d)
    }


def with_dtype(r: ir.Region, dtype: str) -> ir.Region:
    """The same region for other input dtypes: float inputs and per-step outputs in `dtype`, the
    state (initial and final) in fp32."""
    ins = tuple(dataclasses.replace(s, dtype=dtype) if i != r.init else s for i, s in enumerate(r.inputs))
    outs = tuple(dataclasses.replace(o, dtype=dtype if o.kind == "steps" else o.dtype) for o in r.outputs)
    return dataclasses.replace(r, inputs=ins, outputs=outs)


def region_inputs(name: str, r: ir.Region, L: int, dtype=torch.float32, seed=0, n: int = 4,
                  d: int = 3, b: int = 2) -> list[torch.Tensor]:
    """Random inputs for a captured region, in its input order, at sequence length L (Mamba-1
    forms and s4d: state size n, d channels, batch b)."""
    g = torch.Generator().manual_seed(seed)
    if name in ("mamba1", "mamba1_bdl", "scan"):
        x, dt, A, B, C, D, z, bias = P.mamba1_inputs(b, L, d, n, seed=seed, layout="bdl" if name == "mamba1_bdl" else "bld")
        named = {"l_x_": x, "l_dt_": dt, "l_a_": A, "l_b_": B, "l_c_": C, "l_d_": D, "l_z_": z, "l_bias_": bias,
                 "h": torch.randn(b, d, n, generator=g), "h0": torch.randn(b, d, n, generator=g)}
    elif name == "mamba2":
        x, dt, A, B, C, D, h0 = P.mamba2_inputs(b, L, 2, 3, 5, seed=seed, with_h0=True)
        named = {"l_x_": x, "l_dt_": dt, "l_a_": A, "l_b_": B, "l_c_": C, "l_d_": D, "l_h0_0_": h0}
    elif name == "gated":
        x, gate, z, w = P.gated_inputs(b, L, 5, seed=seed)
        named = {"l_x_": x, "l_gate_": gate, "l_z_": z, "l_w_": w, "h": torch.randn(b, 5, generator=g)}
    elif name == "s4d":
        x, log_dt, A, Bm, Cm = P.s4d_inputs(b, L, d, n, seed=seed)
        dA = torch.exp(torch.exp(log_dt).unsqueeze(-1) * A)
        named = {"l_x_": x, "dA": dA, "dB": (dA - 1) / A * Bm, "l_cm_": Cm, "h": torch.randn(b, d, n, generator=g)}
    else:
        raise KeyError(name)
    out = []
    for i, s in enumerate(r.inputs):
        t = named[s.name.split(" (")[0]]
        out.append(t.to(dtype) if (t.is_floating_point() and i != r.init) else t.float())
    return out


def scramble(x: torch.Tensor, how: str | None) -> torch.Tensor:
    """The same values in another memory layout (on x's device)."""
    if how == "strided":         # every other element of a wider buffer along the last dim
        buf = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype, device=x.device)
        buf[..., ::2] = x
        return buf[..., ::2]
    if how == "misaligned":      # contiguous, one element off the allocation's alignment
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        out = buf[1:].view(x.shape)
        out.copy_(x)
        return out
    if how == "transposed":      # first and last dims swapped in memory
        return x.transpose(0, -1).contiguous().transpose(0, -1) if x.dim() > 1 else x
    return x


def check_close(outs, ref, dtype, what=""):
    tol = TOL[dtype] if dtype != torch.float16 else 2e-3
    for k, (o, r) in enumerate(zip(outs, ref)):
        assert o.shape == r.shape, (what, k, o.shape, r.shape)
        assert torch.isfinite(o.double()).all(), f"{what}: output {k} has unwritten (NaN) or inf elements"
        err = rel_err(o, r)
        assert err <= tol, f"{what}: output {k} rel err {err:.3g} > {tol}"


# -- structure: no toolchain needed ----------------------------------------------------------------

def test_mamba1_plan_hoists_per_level(regions):
    p = plan(regions["mamba1"])
    assert p.inner == ("i2",) and p.outer == ("i0", "i1")
    assert [o.where for o in p.outputs] == ["row", "final"]
    code = emit(p)
    time_code, state_code, st_code = "\n".join(code.time), "\n".join(code.state), "\n".join(code.st)
    assert "ssmc_softplus" in time_code and "ssmc_softplus" not in st_code   # once per step, not per n
    assert "1.4426950408889634" in state_code                             # log2(e) folded into A, per n
    assert "ssmc_exp2_it<POLY>" in st_code and "ssmc_exp(" not in st_code  # the decay: one exp2 per (t, n)
    assert any(line.startswith("acc0[i] +=") for line in code.replay)   # the readout: a sum in registers


def test_mamba2_decay_is_per_step_not_per_state_element(regions):
    p = plan(regions["mamba2"])
    assert p.inner == ("i3",) and p.outer == ("i0", "i1", "i2")
    code = emit(p)
    assert any("ssmc_exp2_it" in line for line in code.time)               # shared decay: once per step
    assert not any("exp2" in line for line in code.st)


def test_gated_has_no_readout_sum(regions):
    p = plan(regions["gated"])
    assert p.inner == () and p.reduces == ()
    assert [o.where for o in p.outputs] == ["inner"]                      # reads h directly


def test_supports_gives_reasons(regions):
    t = cuda.CudaTarget()
    r = regions["mamba1"]
    assert "CUDA devices only" in t.supports(r, "chunked_scan", None, "cpu")
    assert "sm_80" in t.supports(r, "chunked_scan", 75, "cuda")
    assert "strategy" in t.supports(r, "grouped", 90, "cuda")
    rev = dataclasses.replace(r, reverse=True)
    why = t.supports(rev, "chunked_scan", 90, "cuda")
    assert why is not True and ("reverse" in why or "cupy" in why or "NVRTC" in why or "cuda_bf16" in why)
    assert t.version.startswith(cuda.KERNEL_VERSION + "+nvrtc")


def test_unsupported_regions_say_why(regions):
    r = regions["mamba1"]
    two_sums = dataclasses.replace(r, outputs=(
        *r.outputs, ir.OutputSpec("steps", ir.Reduce(ir.State(), ("i1", "i2")), ("i0", "t"), "float32")))
    with pytest.raises(Unsupported, match="different state axes"):
        plan(two_sums)
    with pytest.raises(Unsupported, match="reverse"):
        plan(dataclasses.replace(r, reverse=True))


@pytest.mark.parametrize("arch", [80, 90])
def test_every_region_renders(regions, arch):
    for name, r in regions.items():
        src = cuda.render(r, arch).source
        assert "__shfl_up_sync" in src and "__syncthreads" in src, name
        code = [line for line in src.splitlines() if not line.lstrip().startswith("//")]
        assert not any("None" in line or "Undefined" in line for line in code), name
        kernels = re.findall(r'extern "C" __global__ void __launch_bounds__\((?:\d+|ssmc_seq_block\([\w, ]+\)), (?:\d+|ssmc_seq_min_blocks\([\w, ]+\))\)\n(\w+)\(', src)
        assert len(kernels) == len(cuda.render(r, arch).configs) >= 2, name
    _, v80 = cuda.variant_for(86)
    _, v90 = cuda.variant_for(120)
    assert cuda.variant_for(86)[0] == "sm_80" and cuda.variant_for(120)[0] == "sm_90"
    assert v90 != v80                                        # per-arch tables, not one table


# -- NVRTC: every kernel compiles for sm_80 and sm_90, without a GPU ---------------------------------

def _toolchain():
    try:
        why = cuda.toolchain_problem()
    except Exception as e:   # pragma: no cover
        why = f"{type(e).__name__}: {e}"
    if why:
        pytest.skip(f"no CUDA toolchain for compile-only tests: {why}")


DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("name", ["mamba1", "mamba2", "gated"])
def test_nvrtc_compiles(regions, name, arch, dtype):
    """The short-sequence kernel of each layout, in one NVRTC program (the long-sequence ones:
    test_every_variant_builds_through_the_cache); the PTX holds the warp scan, the SFU exp2
    and vector loads."""
    _toolchain()
    rend = cuda.render(with_dtype(regions[name], dtype), arch)
    picks = [[c for c in rend.configs if c["layout"] == lay][0]["kernel"] for lay in ("time_major", "row_major")]
    flags = ["-DSSMC_ONE_KERNEL", *(f"-DSSMC_KERNEL_{k}" for k in picks)]
    mod = cuda.nvrtc()
    prog = mod.createProgram(rend.source, f"{name}.cu", [], [])
    try:
        try:
            mod.compileProgram(prog, [f"--gpu-architecture=sm_{arch}", "-std=c++17",
                                      *(f"-I{d}" for d in cuda.include_dirs()), *flags])
        except mod.NVRTCError:
            pytest.fail(mod.getProgramLog(prog))
        cubin, ptx, log = mod.getCUBIN(prog), mod.getPTX(prog), mod.getProgramLog(prog)
    finally:
        mod.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert len(cubin) > 1000 and "warning" not in log, log
    for k in picks:
        assert k.encode() in cubin
    assert "shfl.sync.up" in ptx and "bar.sync" in ptx
    if name != "gated":                                  # gated's decay is a sigmoid, no exp2 of its own
        assert "ex2.approx.ftz.f32" in ptx
    assert re.search(r"ld\.global\.nc(\.L2::256B)?\.v[24]\.", ptx)     # a run of 4 items: one 16- or 8-byte load


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nvrtc_compiles_every_op(regions, dtype):
    """Every op of ssmc.ops.ELEMENTWISE prints as device code NVRTC accepts, in fp32 and fp64
    math, without warnings."""
    _toolchain()
    rend = cuda.render(with_dtype(every_op_region(regions["gated"]), dtype), 80)
    k = rend.configs[0]["kernel"]
    binary, fmt, _, log = cuda.nvrtc_compile(rend.source, 80, "every_op.cu", ("-DSSMC_ONE_KERNEL", f"-DSSMC_KERNEL_{k}"))
    assert fmt == "cubin" and k.encode() in binary
    assert "warning" not in log, log


@pytest.mark.parametrize("arch", [80, 90])
def test_every_variant_builds_through_the_cache(regions, arch, tmp_path):
    """The kernels of the per-arch table (sm_90: all; sm_80: the long-sequence one of each
    layout; the short ones compile in test_nvrtc_compiles), through build(): a miss writes the
    source and the binary, the same build again is a hit."""
    _toolchain()
    r = with_dtype(regions["mamba1"], "bfloat16")
    cache = get_cache(str(tmp_path / "cache"))
    kernel = cuda.CudaKernel(r, plan(r), cache)
    rend = kernel.rendered(arch)
    configs = rend.configs if arch == 90 else [
        [c for c in rend.configs if c["layout"] == lay][-1] for lay in ("time_major", "row_major")]
    for c in configs:
        b = kernel.built(arch, c["kernel"])
        assert b.cache == "miss" and b.fmt == "cubin" and len(b.binary) > 1000
        assert Path(b.source_path).read_text() == rend.source
    again = cuda.CudaKernel(r, plan(r), cache)
    assert again.built(arch, rend.configs[-1]["kernel"]).cache == "hit"
    assert again.cache_status == "hit"


def test_compile_error_carries_log_and_source_path(regions, tmp_path):
    _toolchain()
    r = regions["gated"]
    kernel = cuda.CudaKernel(r, plan(r), get_cache(str(tmp_path / "cache")), extra_flags=("-DSSMC_NS=no_such_fn",))
    with pytest.raises(cuda.CudaCompileError) as e:
        kernel.built(90)
    msg = str(e.value)
    assert "sm_90" in msg and "-DSSMC_NS=no_such_fn" in msg and "no_such_fn" in msg.split("log:")[1]
    path = re.search(r"source: (\S+)", msg).group(1)
    assert Path(path).read_text() == kernel.rendered(90).source


def test_target_compile_without_gpu_renders_only(regions, tmp_path):
    kernel = cuda.CudaTarget().compile(regions["mamba1"], "chunked_scan", make_options(cache_dir=str(tmp_path)))
    assert "_time_major<" in cuda.CudaTarget().source(kernel)


# -- numerics of the generated source, emulated on the CPU ------------------------------------------

SMALL = {   # small blocks so that short sequences span several chunks; every scan path, both smem layouts
    "pair": {"time_major": [{"max_len": 8, "threads": 32, "rows": 3, "items": 2},    # a warp per row
                            {"threads": 64, "rows": 2, "items": 4}],                   # 2 warps per row
             "row_major": [{"warps": 2, "items": 4}],
             "exp2_poly_every": 2, "totals": "pair", "min_blocks": {}},
    "split": {"time_major": [{"threads": 32, "rows": 4, "items": 8}],
              "row_major": [{"warps": 3, "items": 2}],
              "exp2_poly_every": 0, "totals": "split", "min_blocks": {}},
    # several state elements in flight (group; with N = 3 or 5 the group shrinks to a divisor),
    # the time-major algorithm declared for (b, L, d) data (strided whole chunks), the exp2
    # polynomial on every other item
    "group": {"time_major": [{"max_len": 8, "threads": 32, "rows": 3, "items": 2, "group": 2},
                             {"max_len": 100, "threads": 64, "rows": 2, "items": 4, "group": 4},
                             {"threads": 32, "rows": 2, "items": 2, "group": 3, "poly": 2}],
              "row_major": [{"max_len": 100, "warps": 2, "items": 4, "group": 2},
                            {"kernel": "time_major", "threads": 32, "rows": 2, "items": 4, "group": 2}],
              "exp2_poly_every": 0, "totals": "pair", "min_blocks": {}},
    # the sequential kernel staging B and C in shared memory (a block's rows share them when its
    # rows divide the channels: d = 16 with 8 rows, Mamba-2's h * p = 6 with 3), else a scan
    "stage": {"time_major": [{"kernel": "seq", "rows": 8, "states": 2, "items": 8, "stage": True},
                             {"kernel": "seq", "rows": 3, "states": 5, "items": 4, "stage": True},
                             {"threads": 32, "items": 4}],
              "row_major": [{"kernel": "seq", "rows": 8, "states": 2, "items": 8, "stage": True},
                            {"kernel": "seq", "rows": 3, "states": 5, "items": 4, "stage": True},
                            {"warps": 2, "items": 4}],
              "exp2_poly_every": 0, "totals": "pair", "min_blocks": {}},
    # the sequential kernel: a thread per (row, share of the state elements), lanes along rows;
    # several rows a block (spare rows), the shares' sums added across lanes
    # (N = 6: a thread or 2 threads a row; N = 8: 4 or 8 threads a row; Mamba-2's N = 5 and the
    # gated recurrence's N = 1, decays shared by the state elements: a thread a row; the chunked
    # scans when no entry fits N, or N is read at run time)
    "seq": {"time_major": [{"max_len": 8, "kernel": "seq", "rows": 32, "states": 6, "items": 2},
                           {"kernel": "seq", "rows": 16, "states": 3, "items": 4},
                           {"kernel": "seq", "rows": 8, "states": 2, "items": 8},
                           {"kernel": "seq", "rows": 32, "states": 5, "items": 4},
                           {"kernel": "seq", "rows": 32, "states": 1, "items": 4},
                           {"threads": 32, "items": 4}],
            "row_major": [{"max_len": 8, "kernel": "seq", "rows": 16, "states": 3, "items": 2, "poly": 2},
                          {"kernel": "seq", "rows": 4, "states": 1, "items": 8},
                          {"kernel": "seq", "rows": 32, "states": 5, "items": 4},
                          {"kernel": "seq", "rows": 32, "states": 1, "items": 4},
                          {"warps": 2, "items": 4}],
            "exp2_poly_every": 0, "totals": "pair", "min_blocks": {}},
}


GXX = ["g++", "-std=c++20", "-O1", "-fPIC", "-pthread", "-DSSMC_EMULATE"]


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    """A work dir with the emulator header precompiled (each kernel build then takes ~1 s)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found: the CUDA emulator needs it")
    if not (HERE / "cuda_emu.h").is_file():
        pytest.fail("tests/cuda_emu.h is missing (the CUDA emulator header)")
    d = tmp_path_factory.mktemp("cuda_emu")
    shutil.copy(HERE / "cuda_emu.h", d / "cuda_emu.h")
    subprocess.run([*GXX, "-x", "c++-header", str(d / "cuda_emu.h"), "-o", str(d / "cuda_emu.h.gch")],
                   capture_output=True)    # without the .gch, g++ reads the header itself
    return d


def _emulator(source: str, workdir: Path, ns: int = 0) -> ctypes.CDLL:
    """The rendered source built for the CPU (``ns`` > 0: with the state size fixed at ns, as the
    GPU build of that instance)."""
    key = hashlib.sha256((source + (HERE / "cuda_emu.h").read_text() + f"ns={ns}").encode()).hexdigest()[:16]
    lib = workdir / f"{key}.so"
    if not lib.exists():
        src = workdir / f"{key}.cpp"
        src.write_text(source)
        cmd = [*GXX, "-shared", "-include", str(workdir / "cuda_emu.h"), "-Wno-unknown-pragmas",
               *([f"-DSSMC_NS={ns}"] if ns else []), "-x", "c++", str(src), "-o", str(lib)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
    return ctypes.CDLL(str(lib))


def emulate(kernel: cuda.CudaKernel, inputs, workdir: Path, arch: int = 90):
    """kernel.run with the launch done by the CPU emulator instead of a GPU."""
    types = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32}

    def launch(cfg, grid, block, smem, args, ns=0):
        lib = _emulator(kernel.rendered(arch).source, workdir, ns)
        f = getattr(lib, cfg["kernel"] + "_emulate")
        f.argtypes = [ctypes.c_uint] * 3 + [types[k] for k, _ in args]
        f.restype = None
        f(grid, block, smem, *[v for _, v in args])
    return kernel.run(inputs, arch, launch)


def _emu_case(regions, emu_dir, name, L, dtype, layout, variant="pair", how=None, seed=0, n=4, static_n=True,
              region=None, d=3, b=2):
    r = region or regions[name]
    if dtype != torch.float32:
        r = with_dtype(r, ir.dtype_name(dtype))
    kernel = cuda.CudaKernel(r, plan(r), get_cache(str(emu_dir / "cache")), variants=SMALL[variant])
    kernel.poison = True
    kernel.force_layout = layout
    kernel.static_n = static_n
    xs = region_inputs(name, r, L, dtype, seed, n=n, d=d, b=b)
    if how:
        xs = [scramble(x, how) for x in xs]
    outs = emulate(kernel, xs, emu_dir)
    ref = reference_run(r, [x.double() for x in xs])
    check_close(outs, ref, dtype, f"{name} L={L} {dtype} {layout} {how or 'contiguous'}")
    return kernel


@pytest.mark.parametrize("layout", ["time_major", "row_major"])
@pytest.mark.parametrize("L", [1, 7, 300])
def test_emulated_mamba1(regions, emu_dir, L, layout):
    k = _emu_case(regions, emu_dir, "mamba1", L, torch.float32, layout)
    assert k.last_launch["layout"] == layout


@pytest.mark.parametrize("name", ["mamba1_bdl", "mamba2", "gated", "s4d", "scan"])
def test_emulated_regions(regions, emu_dir, name):
    for L in (5, 137):      # 5: one warp per row, 3 rows a block (spare rows); 137: 2 warps per row
        for layout in ("time_major", "row_major"):
            _emu_case(regions, emu_dir, name, L, torch.float32, layout, seed=1)


@pytest.mark.parametrize("b,n", [(1, 4), (2, 1)])
def test_emulated_size_one_axes(emu_dir, b, n):
    """Batch 1 and d_state 1, captured at that size (Dynamo specialises sizes of 1): the
    output index names the size-1 state axis, and the kernel writes every element."""
    r = _capture(P.mamba1("final"), P.mamba1_inputs(b=b, n=n))
    assert all(a in o.index or a == "i2" for o in r.outputs for a in r.axes), [str(o) for o in r.outputs]
    for layout in ("time_major", "row_major"):
        _emu_case(None, emu_dir, "mamba1", 7, torch.float32, layout, region=r, n=n, b=b)


@pytest.mark.parametrize("how", ["strided", "misaligned", "transposed"])
def test_emulated_non_contiguous(regions, emu_dir, how):
    for name in ("mamba1", "mamba1_bdl"):
        k = _emu_case(regions, emu_dir, name, 93, torch.float32, None, how=how, seed=2)
        assert k.last_launch["layout"] in ("time_major", "row_major")


@pytest.mark.parametrize("name,dtype,layout", [("mamba1_bdl", torch.bfloat16, "time_major"),
                                               ("mamba1", torch.bfloat16, "row_major"),
                                               ("mamba1_bdl", torch.float16, "time_major"),
                                               ("mamba1", torch.float64, "time_major")])   # fp64: double math
def test_emulated_dtypes(regions, emu_dir, name, dtype, layout):
    # 520: two whole chunks of 256 (16-byte loads of 8 bf16/fp16 items where time is contiguous) and a tail
    _emu_case(regions, emu_dir, name, 520, dtype, layout, variant="split", seed=3)


SEQ_PICKS = {   # (N, L, layout) -> the kernel of SMALL["seq"] that takes it (None: a chunked scan)
    (6, 5, "time_major"): "sq32n6x2", (6, 37, "time_major"): "sq16n3x4",
    (8, 5, "time_major"): "sq8n2x8", (8, 37, "time_major"): "sq8n2x8",
    (6, 5, "row_major"): "sq16n3x2sp2", (6, 37, "row_major"): None,
    (8, 5, "row_major"): "sq4n1x8s", (8, 37, "row_major"): "sq4n1x8s",
    **{(5, L, lay): "sq32n5x4" + sfx for L in (5, 37) for lay, sfx in (("time_major", ""), ("row_major", "s"))},
    **{(1, L, "time_major"): "sq32n1x4" for L in (5, 37)},
    **{(1, L, "row_major"): "sq4n1x8s" for L in (5, 37)},     # a thread a row: 4-thread blocks are allowed
}
SEQ_N = {"mamba2": 5, "gated": 1}   # the regions whose state size region_inputs fixes


@pytest.mark.parametrize("name", ["mamba1", "mamba1_bdl", "mamba2", "gated", "s4d", "scan"])
def test_emulated_seq(regions, emu_dir, name):
    """The sequential kernel (state in registers, a row's state elements shared by 1 to 8 lanes):
    short and long sequences (a partial last chunk, whole chunks), both data layouts, spare rows;
    entries whose states do not divide N, and every entry when N is read at run time, are passed
    over for a chunked scan."""
    for n in (SEQ_N[name],) if name in SEQ_N else (6, 8):
        for L in (5, 37):
            for layout in ("time_major", "row_major"):
                for static_n in (True, False):
                    k = _emu_case(regions, emu_dir, name, L, torch.float32, layout, variant="seq", seed=7,
                                  n=n, static_n=static_n)
                    want = SEQ_PICKS[(n, L, layout)] if static_n else None
                    if want:
                        assert k.last_launch["kernel"].endswith(want), (n, L, layout, k.last_launch)
                    else:                          # no entry fits N, or N is read at run time
                        assert k.last_launch["algorithm"] != "seq", k.last_launch


@pytest.mark.parametrize("name", ["mamba1", "mamba1_bdl", "mamba2"])
def test_emulated_seq_stage(regions, emu_dir, name):
    """The sequential kernel with B and C staged in shared memory once per block: asynchronous
    copies a chunk ahead (whole, contiguous chunks), read from memory at the stage otherwise (the
    partial last chunk, (b, L, d) data, misaligned runs); 4 lanes a row reading the swizzled
    stage; bf16 and fp32. Where a block's rows would not share B and C (d = 3 with 8 rows a
    block), the table passes the entry over."""
    r = regions[name]
    assert [ld.input for ld in cuda.stage_plan(plan(r)).loads], "B and C are the staged loads"
    n, want = (5, "sq3n5x4b") if name == "mamba2" else (8, "sq8n2x8b")
    for dtype in (torch.float32, torch.bfloat16):
        for L in (5, 37, 40):      # 40: five whole chunks, every run 16-byte aligned (the copies a chunk ahead)
            for layout in ("time_major", "row_major"):
                for how in (None, "misaligned") if layout == "time_major" else (None,):
                    k = _emu_case(regions, emu_dir, name, L, dtype, layout, variant="stage", how=how, seed=L, n=n, d=16)
                    assert k.last_launch["kernel"].endswith(want + ("" if layout == "time_major" else "s")), k.last_launch
    if name != "mamba2":
        k = _emu_case(regions, emu_dir, name, 37, torch.float32, "time_major", variant="stage", seed=1, n=8, d=3)
        assert k.last_launch["algorithm"] != "seq", k.last_launch


def test_emulated_seq_bf16(regions, emu_dir):
    """16-byte loads of 8 bf16 items per run where time is contiguous, a partial last chunk; 4
    threads a row, each computing the per-step values of 2 items of a chunk."""
    variant = {"time_major": [{"kernel": "seq", "rows": 8, "states": 4, "items": 8}],
               "row_major": [], "exp2_poly_every": 0, "totals": "pair", "min_blocks": {}}
    r = with_dtype(regions["mamba1_bdl"], "bfloat16")
    kernel = cuda.CudaKernel(r, plan(r), get_cache(str(emu_dir / "cache")), variants=variant)
    kernel.poison, kernel.force_layout = True, "time_major"
    xs = region_inputs("mamba1_bdl", r, 53, torch.bfloat16, 8, n=16)
    outs = emulate(kernel, xs, emu_dir)
    check_close(outs, reference_run(r, [x.double() for x in xs]), torch.bfloat16, "seq bf16")
    assert kernel.last_launch["kernel"].endswith("sq8n4x8") and kernel.last_launch["block"] == 32


def every_op_region(gated: ir.Region) -> ir.Region:
    """The gated region with a drive that uses every op of ssmc.ops.ELEMENTWISE, on per-step
    values (item arrays) and on per-row values (scalars), in safe domains."""
    from ssmc.ir import Const, Load, Op
    from ssmc.ops import ELEMENTWISE
    x, z, w = Load(2, ("i0", "t", "i1")), Load(3, ("i0", "t", "i1")), Load(1, ("i1",))
    ax = Op("add", (Op("abs", (x,)), Const(1.0)))                       # >= 1
    terms = [
        Op("sub", (Op("div", (x, ax)), Op("neg", (z,)))),
        Op("pow", (ax, Const(1.5))), Op("pow", (x, Const(2.0))), Op("pow", (ax, Const(0.5))), Op("pow", (ax, Const(-1.0))),
        Op("pow", (ax, Op("sigmoid", (z,)))),
        Op("maximum", (x, z)), Op("minimum", (x, w)),
        Op("where", (Op("gt", (x, z)), Op("lt", (x, Const(0.5))), Op("ge", (z, w)))),
        Op("add", (Op("le", (x, Const(0.0))), Op("eq", (Op("gt", (x, Const(0.0))), Const(1.0))))),
        Op("ne", (Op("ge", (z, Const(0.0))), Const(0.0))),
        Op("exp", (Op("mul", (Op("neg", (ax,)), w)),)), Op("exp2", (Op("neg", (ax,)),)), Op("exp", (w,)),
        Op("expm1", (Op("mul", (x, Const(0.1))),)), Op("log", (ax,)), Op("log1p", (Op("abs", (z,)),)),
        Op("sqrt", (ax,)), Op("rsqrt", (ax,)), Op("tanh", (z,)), Op("logsigmoid", (x,)),
        Op("softplus", (x,), (("beta", 2.0), ("threshold", 1.0))), Op("silu", (z,)), Op("relu", (x,)),
        Op("reciprocal", (ax,)), Op("sin", (x,)), Op("cos", (w,)),
        Op("cast", (Op("gt", (x, Const(0.0))),), (("dtype", "bool"),)),
        Op("mul", (Op("cast", (Op("mul", (x, Const(3.0))),), (("dtype", "int64"),)), Const(0.25))),
    ]
    used = {e.name for t in terms for e in ir.walk(t) if isinstance(e, Op)}
    assert used >= set(ELEMENTWISE), set(ELEMENTWISE) - used
    terms = [terms[0]] + [Op("mul", (t, Const(0.05))) for t in terms[1:]]
    while len(terms) > 1:                       # a balanced sum (ir's printer is exponential in depth)
        terms = [Op("add", tuple(terms[j:j + 2])) if j + 1 < len(terms) else terms[j] for j in range(0, len(terms), 2)]
    return dataclasses.replace(gated, drive=terms[0])


def test_emulated_every_op(regions, emu_dir):
    r = every_op_region(regions["gated"])
    for layout in ("time_major", "row_major"):
        kernel = cuda.CudaKernel(r, plan(r), get_cache(str(emu_dir / "cache")), variants=SMALL["pair"])
        kernel.poison, kernel.force_layout = True, layout
        xs = region_inputs("gated", r, 70, seed=6)
        outs = emulate(kernel, xs, emu_dir)
        check_close(outs, reference_run(r, [x.double() for x in xs]), torch.float32, f"every op, {layout}")


def test_layout_follows_strides(regions, emu_dir):
    """(b, L, d) inputs get lanes along rows; (b, d, L) lanes along time; the state loop's smem
    for the row layout is bounded."""
    for name, want in (("mamba1", "row_major"), ("mamba1_bdl", "time_major")):
        k = _emu_case(regions, emu_dir, name, 40, torch.float32, None, seed=4)
        assert k.last_launch["layout"] == want, name


def test_table_picks_and_duplicates():
    """The sm_90 picks for Mamba-1-sized calls are the measured ones (see variants.j2), and a
    kernel declared twice in one list is an error (its second rule would silently replace the
    first)."""
    cs = cuda.configs_of(cuda.variant_for(90)[1], "k")
    # many rows and N = 16 fixed: the sequential kernel, 4 lanes a row (both layouts)
    assert cuda._pick(cs, "time_major", 4096, 12288, 16)["kernel"] == "k_sq32n4x16"
    assert cuda._pick(cs, "row_major", 4096, 12288, 16)["kernel"] == "k_sq32n4x16s"
    # ... staging B and C in shared memory where a block's rows share them
    staged = lambda c: True
    assert cuda._pick(cs, "time_major", 4096, 12288, 16, staged)["kernel"] == "k_sq32n4x32b"
    assert cuda._pick(cs, "row_major", 4096, 12288, 16, staged)["kernel"] == "k_sq32n4x16bs"
    # N read at run time, or fewer rows (b2 d1536): a warp per row, 4 rows a block
    assert cuda._pick(cs, "time_major", 4096, 12288, 0)["kernel"] == "k_tm32x16r4g2p32"
    assert cuda._pick(cs, "time_major", 16384, 3072, 16)["kernel"] == "k_tm32x16r4g2p32"
    assert cuda._pick(cs, "row_major", 4096, 12288, 0)["kernel"] == "k_rm4x8g4"
    assert cuda._pick(cs, "time_major", 4096, 64, 16)["kernel"] == "k_tm64x16g2"     # few rows: 2 warps a row, 2 in flight
    twice = {"time_major": [{"threads": 32, "items": 4, "max_len": 8}, {"threads": 32, "items": 4}], "row_major": []}
    with pytest.raises(ValueError, match="declared twice"):
        cuda.configs_of(twice, "k")


def test_emulated_production_variants(regions, emu_dir):
    """The sm_90 table itself: every kernel instance, forced in turn, over several chunks; and
    the one chosen for these shapes (few rows, L > 1024: 128 threads x 16 items)."""
    r = regions["mamba1_bdl"]
    kernel = cuda.CudaKernel(r, plan(r), get_cache(str(emu_dir / "cache")))
    kernel.poison = True
    xs = region_inputs("mamba1_bdl", r, 2100, torch.float32, seed=5)
    ref = reference_run(r, [x.double() for x in xs])
    outs = emulate(kernel, xs, emu_dir, arch=90)
    assert kernel.last_launch["kernel"] == cuda._pick(kernel.rendered(90).configs, "time_major", 2100, 6)["kernel"]
    assert kernel.last_launch["ns"] == 4 and kernel.last_launch["group"] > 1
    check_close(outs, ref, torch.float32, "sm_90 table")
    xs16 = region_inputs("mamba1_bdl", r, 300, torch.float32, seed=6, n=16)   # the sequential entries' N
    ref16 = reference_run(r, [x.double() for x in xs16])
    xs32 = region_inputs("mamba1_bdl", r, 304, torch.float32, seed=7, n=16, d=32)   # blocks of rows sharing B, C
    ref32 = reference_run(r, [x.double() for x in xs32])
    for c in kernel.rendered(90).configs:
        kernel.force_kernel = c["kernel"]
        if c.get("stage"):
            check_close(emulate(kernel, xs32, emu_dir, arch=90), ref32, torch.float32, c["kernel"])
        elif c["layout"] == "seq" and not cuda._seq_split(c, 4):
            assert cuda._seq_split(c, 16), c["kernel"]
            check_close(emulate(kernel, xs16, emu_dir, arch=90), ref16, torch.float32, c["kernel"])
        else:
            check_close(emulate(kernel, xs, emu_dir, arch=90), ref, torch.float32, c["kernel"])


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("static_n", [True, False])
def test_emulated_groups(regions, emu_dir, n, static_n):
    """Several state elements in flight (groups of 2, 3, 4, shrunk to a divisor of N), with N
    fixed at compile time or read at run time, N not a power of two; lanes along time on (b, d, L)
    data (L = 1, one partial chunk, whole chunks with 16-byte loads plus a tail) and on (b, L, d)
    data (the time-major algorithm with strided whole chunks, and the row-major one)."""
    for L in (1, 7, 64, 203, 204):      # 204: whole chunks of 64 take the vector path (203: not aligned)
        _emu_case(regions, emu_dir, "mamba1_bdl", L, torch.float32, "time_major", "group", seed=L, n=n,
                  static_n=static_n)
    for L in (1, 50, 203):
        k = _emu_case(regions, emu_dir, "mamba1", L, torch.float32, "row_major", "group", seed=L, n=n,
                      static_n=static_n)
        assert k.last_launch["algorithm"] == ("row_major" if L <= 100 else "time_major")
        assert k.last_launch["ns"] == (n if static_n else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_emulated_groups_dtypes(regions, emu_dir, dtype):
    """The vector path of 16-bit inputs (a run of 4 items: 8-byte loads; L a multiple of 4 so
    that every run is aligned) and fp64 math, with groups; mamba2 and gated (a decay shared by
    the state elements: one product per chunk), s4d (the decay an input: a product per element)."""
    _emu_case(regions, emu_dir, "mamba1_bdl", 200, dtype, "time_major", "group", seed=11)
    _emu_case(regions, emu_dir, "mamba1", 203, dtype, "row_major", "group", seed=12)
    for name in ("mamba2", "gated", "s4d"):
        _emu_case(regions, emu_dir, name, 160, dtype, "time_major", "group", seed=13)


def test_emulated_state_output_per_step(regions, emu_dir):
    """A per-step output indexed by the state axis (h itself, besides the readout): written in
    the replay, where each state element of a group needs its own index."""
    r = regions["mamba1_bdl"]
    ax = r.axes
    out_h = ir.OutputSpec("steps", ir.State(), (ax[0], ax[1], ax[2], "t"), "float32")
    r2 = dataclasses.replace(r, outputs=(*r.outputs, out_h))
    p = plan(r2)
    assert [o.where for o in p.outputs][-1] == "inner"
    for layout, L in (("time_major", 130), ("row_major", 77), ("row_major", 130)):
        _emu_case(regions, emu_dir, "mamba1_bdl", L, torch.float32, layout, "group", seed=L, region=r2)


def test_decay_kinds(regions):
    """How each region's product of decays is formed: exp2(x_t * y_n) factorised (Mamba-1: one
    exp2 per state element and thread instead of a product over the items), shared over the state
    (Mamba-2, gated), a product per element (s4d: the decay is an input)."""
    kinds = {name: emit(plan(regions[name])).decay_kind for name in ("mamba1", "mamba1_bdl", "mamba2", "gated", "s4d")}
    assert kinds == {"mamba1": "factor", "mamba1_bdl": "factor", "mamba2": "time", "gated": "time", "s4d": "chain"}


def test_sm90_table_has_no_spills(regions):
    """ptxas -v for the sm_90 kernels the table picks on its own (each layout, short and long
    sequences) at N = 16 and bf16: no spills (a register cap that spills is a slowdown no CPU
    test would see)."""
    _toolchain()
    r = with_dtype(regions["mamba1_bdl"], "bfloat16")
    rend = cuda.render(r, 90)
    picks = {cuda._pick(rend.configs, lay, L, rows, ns, lambda c: st)["kernel"] for lay in ("time_major", "row_major")
             for L in (100, 200, 1000, 4096) for rows in (3072, 12288) for ns in (0, 16) for st in (False, True)}
    # spill under their caps and are still the fastest measured: tm32x16r4g2p32 8 bytes (loads 12),
    # sq32n4x32b 460 (loads 664; its 32-item arrays; sq32n4x16b, no spills, is 10% slower)
    allowed = {"ssmc_loop0_tm32x16r4g2p32": 12, "ssmc_loop0_sq32n4x32b": 700}
    for k in sorted(picks):
        _, _, _, log = cuda.nvrtc_compile(rend.source, 90, f"{k}.cu", ("-DSSMC_ONE_KERNEL", f"-DSSMC_KERNEL_{k}",
                                                                      "-DSSMC_NS=16", "--ptxas-options=-v"))
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert spills and all(int(a) <= allowed.get(k, 0) and int(b) <= allowed.get(k, 0) for a, b in spills), \
            (k, log[-600:])


# -- on the GPU -----------------------------------------------------------------------------------

GPU_L = [1, 7, 513, 2048]


@pytest.fixture(scope="module")
def gpu_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda_gpu_cache")     # kernels built once for the module's tests


def _gpu_kernel(r, cache_dir):
    kernel = cuda.CudaTarget().compile(r, "chunked_scan", make_options(cache_dir=str(cache_dir)))
    kernel.poison = True
    return kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", GPU_L)
@pytest.mark.parametrize("name", ["mamba1", "mamba1_bdl", "mamba2", "gated"])
def test_gpu_numerics(regions, gpu_cache, name, L, dtype):
    r = regions[name] if dtype == torch.float32 else with_dtype(regions[name], ir.dtype_name(dtype))
    kernel = _gpu_kernel(r, gpu_cache)
    for how in (None, "strided", "transposed", "misaligned"):
        xs = [scramble(x.cuda(), how) for x in region_inputs(name, r, L, dtype, seed=L)]
        outs = kernel.forward(xs)
        torch.cuda.synchronize()
        ref = reference_run(r, [x.double().cpu() for x in xs])
        check_close([o.cpu() for o in outs], ref, dtype, f"{name} L={L} {how} {kernel.last_launch}")


@pytest.mark.gpu
def test_gpu_every_variant_large(regions, gpu_cache):
    """Every kernel instance of this GPU's table, forced in turn, at b8 d64 n16, L 2048 and
    4100, bf16 in, fp32 state, outputs poisoned."""
    r = with_dtype(regions["mamba1"], "bfloat16")
    kernel = _gpu_kernel(r, gpu_cache)
    arch = cuda._capability(torch.cuda.current_device())
    for L in (2048, 4100):
        x, dt, A, B, C, D, z, bias = P.mamba1_inputs(8, L, 64, 16, dtype=torch.bfloat16, seed=L)
        named = {"l_x_": x, "l_dt_": dt, "l_a_": A, "l_b_": B, "l_c_": C, "l_d_": D, "l_z_": z, "l_bias_": bias,
                 "h": torch.randn(8, 64, 16)}
        xs = [named[s.name.split(" (")[0]].cuda() for s in r.inputs]
        ref = reference_run(r, [x.double().cpu() for x in xs])
        for c in kernel.rendered(arch).configs:
            kernel.force_kernel = c["kernel"]
            outs = kernel.forward(xs)
            check_close([o.cpu() for o in outs], ref, torch.bfloat16, f"L={L} {kernel.last_launch}")


@pytest.mark.gpu
def test_gpu_staged_copies(regions, gpu_cache):
    """The staging instances of the sequential kernel on (b, d, L) data, where B and C runs are
    contiguous and aligned, so the stage is filled by asynchronous copies a chunk ahead (the
    emulator's copies are synchronous: only a GPU shows a missing wait): b2 d64 n16, whole
    chunks and a partial one, bf16 in, outputs poisoned."""
    r = with_dtype(regions["mamba1_bdl"], "bfloat16")
    kernel = _gpu_kernel(r, gpu_cache)
    arch = cuda._capability(torch.cuda.current_device())
    staged = [c for c in kernel.rendered(arch).configs if c.get("stage")]
    assert staged
    for L in (2048, 4104):
        xs = [x.cuda() for x in region_inputs("mamba1_bdl", r, L, torch.bfloat16, seed=L, n=16, d=64)]
        ref = reference_run(r, [x.double().cpu() for x in xs])
        for c in staged:
            kernel.force_kernel = c["kernel"]
            outs = kernel.forward(xs)
            assert kernel.last_launch["kernel"] == c["kernel"]
            check_close([o.cpu() for o in outs], ref, torch.bfloat16, f"L={L} {kernel.last_launch}")


@pytest.mark.gpu
def test_gpu_second_device(regions, gpu_cache):
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    r = regions["mamba1"]
    kernel = _gpu_kernel(r, gpu_cache)
    xs = [x.to("cuda:1") for x in region_inputs("mamba1", r, 513)]
    with torch.cuda.device(0):
        outs = kernel.forward(xs)
    assert all(o.device == torch.device("cuda:1") for o in outs)
    check_close([o.cpu() for o in outs], reference_run(r, [x.double().cpu() for x in xs]), torch.float32, "cuda:1")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_end_to_end(tmp_path, dtype):
    fn = P.mamba1("stack")
    xs = [x.cuda() for x in P.mamba1_inputs(L=64, dtype=dtype, seed=7)]
    out, rep = ssmc_run(fn, xs, target="cuda", cache_dir=str(tmp_path), rest="eager")
    assert rep.regions[0].target == "cuda", str(rep)
    assert "__shfl_up_sync" in rep.regions[0].kernel_source
    for o, r in zip(as_tuple(out), reference(fn, [x.cpu() for x in xs])):
        assert rel_err(o.cpu(), r) <= TOL[dtype]


@pytest.mark.gpu
def test_gpu_failed_nvrtc_compile_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda, "EXTRA_FLAGS", ("-DSSMC_NS=no_such_fn",))   # every kernel fails to compile
    fn = P.mamba1("stack")
    xs = [x.cuda() for x in P.mamba1_inputs(L=16, seed=8)]
    out, rep = ssmc_run(fn, xs, target="cuda", cache_dir=str(tmp_path), rest="eager")
    reg = rep.regions[0]
    assert reg.target in ("triton", "torch"), str(rep)
    note = " ".join(reg.notes)
    assert "target cuda failed to compile" in note and "NVRTC" in note and "source: " in note, note
    assert "no_such_fn" in note                                              # the NVRTC log itself
    assert rel_err(as_tuple(out)[0].cpu(), reference(fn, [x.cpu() for x in xs])[0]) <= TOL[torch.float32]
