"""The ``cuda`` target: CUDA C rendered with Jinja from the region IR, compiled by NVRTC through
CuPy for the device's own sm_XX, launched on torch's current stream.

Kernel: ``templates/cuda/selective_scan_fwd.cu.j2`` (the chunked selective scan; see its header
for the thread, warp and block roles), with the region's expressions printed into it by
``ssmc/targets/cuda_printer.py``; per-arch variants (block sizes, items per thread, the exp2
split between SFU and FMA polynomial, the shared-memory layout) in
``templates/cuda/variants.j2``. One rendered source per arch holds every variant; each kernel
instance is its own NVRTC build of it (``-DSSMC_ONE_KERNEL -DSSMC_KERNEL_<name>``, ~1 s),
made on first launch; ``compile()`` builds the long-sequence one for the current GPU, so a
failure shows at compile time. Each call picks the layout from the inputs' strides (lanes along
time when time is contiguous, lanes along rows otherwise) and the instance from the sequence
length and the number of rows; ``kernel.last_launch`` says which ran. A third algorithm, "seq"
(no scan: a row's state elements in registers across a few adjacent lanes, each walking all of
time), is the sm_90 pick when there are many rows and N is fixed at compile time.

Strategy "block_sparse" has its own kernel, ``ssmc/targets/cuda_block_sparse.py``
(``templates/cuda/block_sparse_fwd.cu.j2``); `CudaTarget` hands such regions to it.

Toolchain, found at run time:
- NVRTC: CuPy's low-level ``cupy_backends.cuda.libs.nvrtc`` (needs no GPU, so CPU CI compiles
  for sm_80 and sm_90 with the arch given). CuPy loads libnvrtc itself, through
  cuda-pathfinder (a CuPy dependency): a system CUDA (the GPU machine's /usr/local/cuda) or the
  ``nvidia-cuda-nvrtc`` wheel (site-packages/nvidia/cu13/lib). Pin that wheel to the toolkit
  series tested with (13.0).
- Headers (``cuda_fp16.h``, ``cuda_bf16.h``): cuda-pathfinder's "cudart" header directory (a
  system CUDA, or the ``nvidia-cuda-runtime`` wheel), else /usr/local/cuda/include, else the
  nvidia wheels under site-packages. ``pip install "ssmc[cuda]"`` brings all of it.

Binaries are cached through runtime/cache.py (key: rendered source, arch, NVRTC version, ssmc
version, flags); the rendered source of every compiled kernel is written beside its entry, and
a failed compile raises `CudaCompileError` with that path, the options and the NVRTC log, so
the backend falls back (triton, then torch) and the report shows why.

Backward: the CUDA template has no adjoint; a kernel runs its region's generated Triton
backward when the backend gives it one (``backward_partner``), else the torch reference
(``ReferenceKernel(region).backward``); ``backward_note()`` says which.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import logging
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from ssmc import ir
from ssmc.targets.cuda_printer import CTYPES, ITEMSIZE, ScanPlan, Unsupported, emit, plan, stage_plan

log = logging.getLogger("ssmc")

KERNEL_VERSION = "2"
TEMPLATE = "cuda/selective_scan_fwd.cu.j2"
VARIANTS = "cuda/variants.j2"
STRATEGIES = ("chunked_scan", "chunked_ssd", "step")   # one kernel, numerically right for all
MIN_ARCH = 80
SMEM_DEFAULT = 48 * 1024        # dynamic shared memory without opting in
NS_MAX = 64                     # state sizes up to this get an instance with N fixed at compile time
STAGE_MAX = 40 * 1024           # static shared memory the sequential kernel's stage may take (both buffers)


class CudaCompileError(RuntimeError):
    """NVRTC rejected a rendered kernel; the message has the source path, options and log."""


# -- toolchain -----------------------------------------------------------------------------------

def nvrtc():
    """CuPy's low-level NVRTC bindings (raises ImportError/OSError with the cause)."""
    from cupy_backends.cuda.libs import nvrtc as mod
    return mod


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str | None:
    try:
        major, minor = nvrtc().getVersion()
        return f"{major}.{minor}"
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def include_dirs() -> tuple[str, ...]:
    """Directories that hold cuda_fp16.h / cuda_bf16.h (and CCCL's nv/target) for NVRTC."""
    found = []
    try:
        import cuda.pathfinder as pf
        for lib in ("cudart", "cccl"):
            try:
                d = pf.find_nvidia_header_directory(lib)
            except Exception:
                d = None
            if d:
                found.append(Path(d))
    except ImportError:
        pass
    found.append(Path("/usr/local/cuda/include"))
    for sp in map(Path, sys.path):
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cu12/include"):
            found.append(sp / sub)
    out, seen = [], set()
    for d in found:
        if ((d / "cuda_fp16.h").is_file() or (d / "nv" / "target").is_file()) and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    # headers of NVRTC's own CUDA major first (torch's wheels may bring CUDA 12 headers along)
    major = (nvrtc_version() or "0").split(".")[0]
    out.sort(key=lambda d: _cuda_major(d) not in (major, None))
    return tuple(str(d) for d in out)


def _cuda_major(d: Path) -> str | None:
    try:
        m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", (d / "cuda_runtime_api.h").read_text(errors="ignore"))
    except OSError:
        return None
    return str(int(m.group(1)) // 1000) if m else None


def toolchain_problem() -> str | None:
    """Why the cuda target cannot compile here, or None."""
    try:
        import cupy  # noqa: F401
    except Exception as e:
        return f"cupy is not installed or does not load ({type(e).__name__}: {e}); pip install 'ssmc[cuda]'"
    if nvrtc_version() is None:
        try:
            nvrtc().getVersion()
        except Exception as e:
            return f"NVRTC does not load ({type(e).__name__}: {e}); pip install 'nvidia-cuda-nvrtc==13.0.*'"
    if not any(Path(d, "cuda_bf16.h").is_file() for d in include_dirs()):
        return "cuda_bf16.h not found (no CUDA toolkit, no nvidia-cuda-runtime wheel); pip install 'ssmc[cuda]'"
    return None


def nvrtc_compile(source: str, arch: int, name: str, extra_flags=()) -> tuple[bytes, str, list[str], str]:
    """Compile for sm_<arch>: (binary, "cubin" | "ptx", options, log). Archs this NVRTC does not
    know get PTX for the newest compute_XX below them, which the driver finishes."""
    mod = nvrtc()
    try:
        known = sorted(int(a) for a in mod.getSupportedArchs())
    except Exception:
        known = [arch]
    if arch in known:
        target, fmt = f"--gpu-architecture=sm_{arch}", "cubin"
    else:
        below = [a for a in known if a <= arch]
        if not below:
            raise CudaCompileError(f"NVRTC {nvrtc_version()} knows archs {known}, none at or below sm_{arch}")
        target, fmt = f"--gpu-architecture=compute_{below[-1]}", "ptx"
    opts = [target, "-std=c++17", "-lineinfo", *(f"-I{d}" for d in include_dirs()), *extra_flags]
    prog = mod.createProgram(source, name, [], [])
    try:
        try:
            mod.compileProgram(prog, opts)
        except mod.NVRTCError as e:
            raise _CompileFailed(str(e), mod.getProgramLog(prog), opts) from None
        binary = mod.getCUBIN(prog) if fmt == "cubin" else mod.getPTX(prog)
        return bytes(binary), fmt, opts, mod.getProgramLog(prog)
    finally:
        mod.destroyProgram(prog)


class _CompileFailed(Exception):
    def __init__(self, status, log_text, opts):
        super().__init__(status)
        self.status, self.log, self.opts = status, log_text, opts


# -- rendering -----------------------------------------------------------------------------------

def _load_template(name: str):
    path = importlib.resources.files("ssmc.templates").joinpath(name)
    text = path.read_text()
    return text, str(path), lambda: True


@functools.lru_cache(maxsize=None)
def jinja_env():
    import jinja2
    return jinja2.Environment(loader=jinja2.FunctionLoader(_load_template), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def variant_table() -> dict:
    return jinja_env().get_template(VARIANTS).module.selective_scan_fwd


def variant_for(arch: int) -> tuple[str, dict]:
    """The declared variant with the largest sm_YY <= arch."""
    table = variant_table()
    keys = sorted((int(k[3:]), k) for k in table)
    fit = [k for a, k in keys if a <= arch] or [keys[0][1]]
    return fit[-1], table[fit[-1]]


def configs_of(variant: dict, prefix: str) -> list[dict]:
    """Every kernel instance of a variant: algorithm, block size, items, knobs, kernel name.

    The variant's lists are per data layout: "time_major" entries are tried for inputs that are
    contiguous in time, "row_major" entries for (b, L, d) inputs. An entry runs the algorithm
    named by its "kernel" key (default: the list's own name): "time_major" (lanes along time,
    ``threads`` x ``rows``) or "row_major" (lanes along rows, ``warps`` along time). Optional
    knobs per entry: ``group`` (state elements in flight, default 1), ``poly`` (overrides the
    variant's exp2_poly_every), ``min_blocks`` (overrides the variant's table), ``strided``
    (whole chunks read runs as strided scalars, for inputs not contiguous in time; default: true
    for the row_major algorithm, false for time_major, whose whole chunks read 16-byte vectors
    when every run is contiguous and aligned, and fall back to the masked path otherwise). One kernel
    instance can serve both lists (the same name); ``layouts`` lists the data layouts it is
    declared for, in the order of the table."""
    poly0 = int(variant.get("exp2_poly_every", 0) or 0)
    pair = variant.get("totals", "split") == "pair"
    mins = {int(k): int(v) for k, v in dict(variant.get("min_blocks", {})).items()}
    out: list[dict] = []
    for data_layout in ("time_major", "row_major"):
        for pos, c in enumerate(variant.get(data_layout, [])):
            algo = c.get("kernel", data_layout)
            it, grp = int(c["items"]), int(c.get("group", 1))
            poly = int(c.get("poly", poly0))
            if algo == "time_major":
                t, rows = int(c["threads"]), int(c.get("rows", 1))
                if t % 32 or not 32 <= t * rows <= 1024 or it < 1 or rows < 1:
                    raise ValueError(f"time_major variant {c}: threads a multiple of 32, threads * rows <= 1024")
                name = f"{prefix}_tm{t}x{it}" + (f"r{rows}" if rows > 1 else "")
                block, per_block, targs = t * rows, rows, f"{t}, {rows}"
            elif algo == "row_major":
                w = int(c["warps"])
                if not 1 <= w <= 32 or it < 1:
                    raise ValueError(f"row_major variant {c}: warps must be in [1, 32]")
                name, block, per_block, targs = f"{prefix}_rm{w}x{it}", 32 * w, 32, f"{w}"
            elif algo == "seq":
                rows, states = int(c.get("rows", 32)), int(c.get("states", 4))
                stage = bool(c.get("stage", False))
                if not 1 <= rows <= 1024 or states < 1 or it < 1:
                    raise ValueError(f"seq variant {c}: rows in [1, 1024], states and items >= 1")
                # threads per row = N / states, known when N is (an instance per N): see _seq_split
                name, block, per_block = f"{prefix}_sq{rows}n{states}x{it}" + ("b" if stage else ""), None, rows
                targs = f"{rows}, {states}, {'true' if stage else 'false'}"
            else:
                raise ValueError(f"variant {c}: unknown kernel {algo!r}")
            if grp < 1:
                raise ValueError(f"variant {c}: group must be >= 1")
            vec = not c.get("strided", algo == "row_major" or (algo == "seq" and data_layout == "row_major"))
            name += (f"g{grp}" if grp > 1 else "") + ("" if vec == (algo != "row_major") else "s" if not vec else "v")
            name += f"p{poly}" if poly != poly0 else ""
            if block:
                mb = int(c.get("min_blocks", mins.get(block, 1)))
                name += f"m{mb}" if "min_blocks" in c else ""
            else:      # the sequential kernel: blocks per SM for `warps` resident warps (register cap)
                wps = int(c.get("warps", 12))
                mb = f"ssmc_seq_min_blocks({rows}, SSMC_NS, {states}, {it}, {wps})"
                name += f"w{wps}" if "warps" in c else ""
            bounds = str(block) if block else f"ssmc_seq_block({rows}, SSMC_NS, {states}, {it})"
            cfg = dict(layout=algo, kernel=name, block=block, bounds=bounds, rows_per_block=per_block, template_args=targs,
                       states=states if algo == "seq" else None, stage=algo == "seq" and stage,
                       items=it, poly=poly, pair=pair, min_blocks=mb, group=grp, vec=vec, max_len=c.get("max_len"),
                       min_rows=int(c.get("min_rows") or 0), layouts=(data_layout,))
            same = next((o for o in out if o["kernel"] == name), None)
            if same is None:
                out.append(cfg)
            else:
                same["layouts"] = tuple(dict.fromkeys((*same["layouts"], data_layout)))
            # where this entry stands in the list of its data layout, and when it applies
            rules = (same or cfg).setdefault("rules", {})
            if data_layout in rules:
                raise ValueError(f"{data_layout} variant {c}: kernel {name} is declared twice in that list")
            rules[data_layout] = (pos, c.get("max_len"), int(c.get("min_rows") or 0))
    return out


@dataclasses.dataclass(frozen=True)
class Rendered:
    arch: int
    variant: str
    source: str
    configs: tuple


def render(region: ir.Region, arch: int, variant: dict | None = None, p: ScanPlan | None = None) -> Rendered:
    """The CUDA C source of one region for sm_<arch> (or for an explicit variant dict)."""
    p = p or plan(region)
    vname = "custom"
    if variant is None:
        vname, variant = variant_for(arch)
    prefix = "ssmc_" + "".join(ch if ch.isalnum() else "_" for ch in region.name)
    configs = configs_of(variant, prefix)
    code = emit(p)
    src = jinja_env().get_template(TEMPLATE).render(
        name=prefix, region_name=region.name, region_text=str(region), compute=p.compute, code=code,
        params=[x.decl for x in p.params], args=[x.name for x in p.params],
        outer=[region.axes.index(a) for a in p.outer], inner=[region.axes.index(a) for a in p.inner],
        configs=configs, stage_max=STAGE_MAX)
    src = re.sub(r"\n(?:[ \t]*\n)+(?=[ \t]+\S)", "\n", src)   # blank lines left by empty sections
    return Rendered(arch, vname, src, tuple(configs))


# -- the kernel ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Built:
    rendered: Rendered
    kernel: str
    binary: bytes
    fmt: str                   # "cubin" | "ptx"
    source_path: str
    cache: str                 # "hit" | "miss"


def _write_text(path: Path, text: str) -> Path:
    """Atomic write (temp file + rename); a read-only cache dir falls back to the temp dir."""
    for p in (path, Path(tempfile.gettempdir()) / "ssmc-cuda" / path.parent.name / path.name):
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, p)
            return p
        except OSError:
            continue
    return path


def build(rendered: Rendered, kernel: str, cache, extra_flags=(), ns: int = 0) -> Built:
    """NVRTC-compile one kernel of a rendered source (``-DSSMC_ONE_KERNEL``) through the cache;
    ``ns`` > 0: the instance for state size N = ns fixed at compile time (``-DSSMC_NS``)."""
    from ssmc import __version__
    from ssmc.runtime.cache import cache_key
    if kernel not in {c["kernel"] for c in rendered.configs}:
        raise KeyError(f"no kernel {kernel!r} in the rendered source")
    flags = ("-DSSMC_ONE_KERNEL", f"-DSSMC_KERNEL_{kernel}", *((f"-DSSMC_NS={int(ns)}",) if ns else ()),
             *extra_flags)
    key = cache_key("ssmc-cuda", KERNEL_VERSION, rendered.source, rendered.arch, nvrtc_version(), __version__,
                    "-std=c++17 -lineinfo", " ".join(flags), " ".join(include_dirs()))
    for fmt in ("cubin", "ptx"):
        data = cache.get(key, f"kernel.{fmt}")
        if data is not None:
            return Built(rendered, kernel, data, fmt, str(cache.path_of(key, "kernel.cu")), "hit")
    src_path = _write_text(cache.path_of(key, "kernel.cu"), rendered.source)
    name = f"{kernel}.cu"
    t0 = time.perf_counter()
    try:
        binary, fmt, opts, _ = nvrtc_compile(rendered.source, rendered.arch, name, flags)
    except _CompileFailed as e:
        text = e.log if len(e.log) < 6000 else e.log[:6000] + "\n... (log truncated)"
        raise CudaCompileError(f"NVRTC {nvrtc_version()} ({e.status}) failed to compile {kernel} for "
                               f"sm_{rendered.arch}\n  source: {src_path}\n  options: {' '.join(e.opts)}\n"
                               f"  log:\n{text}") from None
    cache.put(key, f"kernel.{fmt}", binary)
    log.info("ssmc: NVRTC compiled %s for sm_%d in %.2f s (%s)", kernel, rendered.arch,
             time.perf_counter() - t0, src_path)
    return Built(rendered, kernel, binary, fmt, str(src_path), "miss")


class CudaKernel:
    """The generated kernel for one region. ``forward`` launches it on the inputs' device and
    torch's current stream. The CUDA template has no adjoint: ``backward`` runs the generated
    Triton backward of the same region when the backend gave this kernel a
    ``backward_partner`` (a function returning a Triton kernel of the region, called on the first
    backward), else the torch reference (``ReferenceKernel.backward``); ``backward_note()`` says
    which ran and why.

    ``poison``: allocate outputs filled with NaN (tests: an element the kernel never writes
    shows). ``force_layout``: "time_major" | "row_major" instead of choosing by strides;
    ``force_kernel``: one kernel instance by name (tests, tuning: see ``rendered(arch).configs``).
    ``variants``: a variant dict to use instead of the per-arch table (tests, tuning).
    """

    def __init__(self, region: ir.Region, p: ScanPlan, cache, variants: dict | None = None, extra_flags=()):
        from ssmc.targets.reference import ReferenceKernel
        self.region, self.plan, self.cache = region, p, cache
        self.stage = stage_plan(p)        # the loads a staging sequential kernel reads once per block
        self.variants, self.extra_flags = variants, tuple(extra_flags)
        self.poison = False
        self.force_layout: str | None = None
        self.force_kernel: str | None = None
        self.cache_status = ""
        self.last_launch: dict | None = None
        self._reference = ReferenceKernel(region)
        self.backward_partner = None       # () -> a kernel whose .backward is generated (backend sets it)
        self._partner = None               # what backward_partner returned, or why it failed (str)
        self._rendered: dict[int, Rendered] = {}
        self._built: dict[tuple, Built] = {}
        self._functions: dict = {}
        self._smem_limit: dict = {}
        self._streams: dict = {}
        self._plans: dict = {}
        self.static_n = True      # N <= NS_MAX: an instance with N fixed at compile time (False: one for any N)
        self._lock = threading.Lock()

    # -- rendering and compiling, per arch ------------------------------------------------------
    def rendered(self, arch: int) -> Rendered:
        if arch not in self._rendered:
            self._rendered[arch] = render(self.region, arch, self.variants, self.plan)
        return self._rendered[arch]

    def built(self, arch: int, kernel: str | None = None, ns: int = 0) -> Built:
        """The binary of one kernel instance for sm_<arch> (default: the last time-major one,
        used for long sequences); ``ns`` > 0: with the state size fixed at ns."""
        rend = self.rendered(arch)
        if kernel is None:
            kernel = [c["kernel"] for c in rend.configs if c["layout"] == "time_major"][-1]
        with self._lock:
            if (arch, kernel, ns) not in self._built:
                b = build(rend, kernel, self.cache, self.extra_flags, ns)
                self._built[(arch, kernel, ns)] = b
                self.cache_status = self.cache_status or b.cache
            return self._built[(arch, kernel, ns)]

    @property
    def source(self) -> str | None:
        if self._rendered:
            return next(iter(self._rendered.values())).source
        return None

    # -- running --------------------------------------------------------------------------------
    def forward(self, inputs):
        idx, arch = device_arch(inputs)
        return self.run(inputs, arch, functools.partial(self._launch_cuda, idx, arch))

    def backward(self, inputs, grads, needs):
        partner = self._backward_kernel()
        if partner is not None:
            return partner.backward(inputs, grads, needs)
        return self._reference.backward(inputs, grads, needs)

    def _backward_kernel(self):
        if self._partner is None and self.backward_partner is not None:
            with self._lock:
                if self._partner is None:
                    try:
                        self._partner = self.backward_partner()
                    except Exception as e:     # the reference runs; backward_note says why
                        self._partner = f"{type(e).__name__}: {e}"
                        log.warning("ssmc: region %s: no generated backward: %s", self.region.name, e)
        return None if isinstance(self._partner, str) else self._partner

    def backward_note(self) -> str | None:
        """Which backward ran (None before the first one)."""
        if isinstance(self._partner, str):
            return f"backward: torch reference (the Triton backward could not be made: {self._partner})"
        if self._partner is not None:
            note = getattr(self._partner, "backward_note", lambda: None)()
            return note and note + " (the CUDA template has no adjoint)"
        return None

    def run(self, inputs, arch: int, launch):
        """Allocate the outputs, choose the kernel instance and its launch shape, marshal the
        arguments, and call ``launch(config, grid, block, smem_bytes, args, ns)``; ``args`` is a
        list of (kind, value) with kind "ptr" | "i64" | "i32", in the kernel's parameter order;
        ``ns``: the state size the instance is compiled for (0: read at run time).

        Everything but the data pointers and the outputs is a function of the inputs' shapes,
        strides and dtypes (and the force_* knobs): it is computed once per such key and kept
        (``_plans``), so a repeated call costs a dict look-up and the pointer reads."""
        key = (arch, self.force_kernel, self.force_layout, self.static_n,
               tuple((x.dtype, tuple(x.shape), x.stride()) for x in inputs))
        pl = self._plans.get(key)
        if pl is None:
            pl = self._plan_launch(inputs, arch)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = pl
        if pl.get("empty"):
            return self._reference.forward(inputs)
        outputs = self._outputs_from(pl["out_shapes"], inputs[0].device)
        if pl["rows"] == 0:
            return outputs
        args = [(k, inputs[v].data_ptr() if src == "in" else outputs[v].data_ptr() if src == "out" else v)
                for k, src, v in pl["args"]]
        self.last_launch = pl["info"]
        launch(pl["cfg"], pl["grid"], pl["block"], pl["smem"], args, pl["ns"])
        return outputs

    def _plan_launch(self, inputs, arch: int) -> dict:
        r, p = self.region, self.plan
        for i, (x, s) in enumerate(zip(inputs, r.inputs)):
            if ir.dtype_name(x.dtype) != s.dtype:
                raise TypeError(f"input {i} ({s.name}) is {x.dtype}; the kernel was generated for {s.dtype}")
        sizes = {a: int(inputs[i].shape[d]) for a, (i, d) in zip(r.axes, r.axis_size)}
        L = int(inputs[r.length[0]].shape[r.length[1]])
        if L == 0:
            return {"empty": True}
        rows = _prod(sizes[a] for a in p.outer)
        N = _prod(sizes[a] for a in p.inner)
        out_shapes = self._out_shapes(sizes, L)
        pl = {"rows": rows, "out_shapes": out_shapes}
        if rows == 0:
            return pl
        if L >= 2**31 - 2**20 or N >= 2**31:
            raise ValueError(f"sequence length {L} / state size {N} beyond the kernel's int32 indexing")
        rend = self.rendered(arch)
        probe = self._outputs_from(out_shapes, inputs[0].device, meta=True)
        ns = N if (self.static_n and N <= NS_MAX) else 0
        if self.force_kernel:
            cfg = next(c for c in rend.configs if c["kernel"] == self.force_kernel)
            layout = self.force_layout or cfg["layouts"][0]
            if cfg["layout"] == "seq" and not _seq_split(cfg, ns):
                raise ValueError(f"{cfg['kernel']} has no instance for state size {N}"
                                 f"{'' if ns else ' read at run time'}")
            if cfg.get("stage") and not self._stage_ok(cfg, sizes, ns):
                raise ValueError(f"{cfg['kernel']} stages inputs that differ between the rows of a block here")
        else:
            layout = self._layout(inputs, probe, sizes, N)
            cfg = _pick(rend.configs, layout, L, rows, ns, lambda c: self._stage_ok(c, sizes, ns))
        esize = 8 if p.compute == "double" else 4
        if not self.force_kernel and cfg["layout"] == "row_major" and 2 * N * 32 * esize > SMEM_DEFAULT:
            cfg = _pick(rend.configs, "time_major", L, rows, ns,   # the row-major carry [2][N][32] would not fit
                        lambda c: self._stage_ok(c, sizes, ns))
        block = cfg["block"] or cfg["rows_per_block"] * _seq_split(cfg, ns)
        grid, smem = -(-rows // cfg["rows_per_block"]), _carry_bytes(cfg, N, esize)
        if grid >= 2**31:
            raise ValueError(f"{rows} rows exceed the grid limit")
        pl.update(cfg=cfg, grid=grid, block=block, smem=smem, ns=ns,
                  args=self._arg_plan(inputs, probe, sizes, L, rows, N),
                  info=dict(kernel=cfg["kernel"], layout=layout, algorithm=cfg["layout"], grid=grid,
                            block=block, smem=smem, items=cfg["items"], group=cfg["group"], ns=ns,
                            arch=arch, variant=rend.variant))
        return pl

    def _stage_ok(self, cfg, sizes, ns: int) -> bool:
        """Whether a staging instance of the sequential kernel may run: the staged loads are the
        same for every row of each block, and their stage fits (as SSMC_STAGED in the kernel)."""
        st = self.stage
        if not st.loads or not _seq_split(cfg, ns):
            return False
        esize = 8 if self.plan.compute == "double" else 4
        raw = sum(ITEMSIZE[self.region.inputs[ld.input].dtype] for ld in st.loads)
        fits = 2 * ns * cfg["items"] * (len(st.loads) * esize + raw) <= STAGE_MAX
        return fits and st.block_uniform(sizes, self.plan.outer, cfg["rows_per_block"])

    def _out_shapes(self, sizes, L) -> list:
        return [(tuple(L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index), ir.to_dtype(o.dtype))
                for o in self.region.outputs]

    def _outputs_from(self, shapes, dev, meta: bool = False):
        outs = []
        for shape, dt in shapes:
            if meta:
                outs.append(torch.empty(shape, dtype=dt, device="meta"))
            elif self.poison:
                outs.append(torch.full(shape, float("nan") if dt.is_floating_point else 1, dtype=dt, device=dev))
            else:
                outs.append(torch.empty(shape, dtype=dt, device=dev))
        return outs

    def _layout(self, inputs, outputs, sizes, N) -> str:
        """Lanes along time when the big per-row tensors are contiguous in time; lanes along
        rows when they are contiguous along the last row axis (a (b, L, d) layout)."""
        if self.force_layout:
            return self.force_layout
        p = self.plan
        if not p.outer:
            return "time_major"
        last = p.outer[-1]
        along_t = along_row = 0
        seen = set()
        tensors = [(ld.index, inputs[ld.input], ITEMSIZE[self.region.inputs[ld.input].dtype])
                   for ld in _loads(p) if ld not in seen and not seen.add(ld)]
        tensors += [(o.spec.index, outputs[o.k], ITEMSIZE[o.spec.dtype]) for o in p.outputs if o.where == "row"]
        for index, x, w in tensors:
            if "t" not in index or set(index) & set(p.inner):
                continue
            td = index.index("t")
            if x.shape[td] > 1 and x.stride(td) == 1:
                along_t += w
            elif last in index and x.stride(index.index(last)) == 1 and x.shape[index.index(last)] > 1:
                along_row += w
        return "row_major" if along_row > along_t else "time_major"

    def _arg_plan(self, inputs, outputs, sizes, L, rows, N) -> list:
        """(kind, source, value) per kernel parameter: source "in"/"out" (value: which tensor,
        whose data pointer is read per call) or "const" (value: the number)."""
        out = []
        for prm in self.plan.params:
            s = prm.source
            if s[0] == "in":
                out.append((prm.kind, "in", s[1]))
                continue
            if s[0] == "out":
                out.append((prm.kind, "out", s[1]))
                continue
            if s[0] in ("in_stride", "out_stride"):
                x = (inputs if s[0] == "in_stride" else outputs)[s[1]]
                v = 0 if x.shape[s[2]] == 1 else x.stride(s[2])
            elif s[0] == "size":
                v = sizes[s[1]]
            else:
                v = {"L": L, "rows": rows, "N": N}[s[0]]
            out.append((prm.kind, "const", int(v)))
        return out

    def _launch_cuda(self, idx: int, arch: int, cfg, grid, block, smem, args, ns=0):
        import cupy
        conv = _ARG_TYPES()
        values = tuple(conv[k](v) for k, v in args)
        stream_ptr = torch.cuda.current_stream(idx).cuda_stream
        with cupy.cuda.Device(idx):
            fn = self._function(idx, arch, cfg["kernel"], smem, ns)
            stream = self._stream(idx, stream_ptr)
            fn((grid, 1, 1), (block, 1, 1), values, shared_mem=smem, stream=stream)

    def _function(self, idx: int, arch: int, name: str, smem: int, ns: int = 0):
        fn = self._functions.get((idx, name, ns))
        if fn is None:
            import cupy
            mod = cupy.cuda.function.Module()
            mod.load(self.built(arch, name, ns).binary)
            fn = mod.get_function(name)          # keeps its module alive
            self._functions[(idx, name, ns)] = fn
            self._smem_limit[(idx, name, ns)] = SMEM_DEFAULT
        if smem > self._smem_limit[(idx, name, ns)]:
            from cupy.cuda import driver
            driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            self._smem_limit[(idx, name, ns)] = smem
        return fn

    def _stream(self, idx: int, ptr: int):
        s = self._streams.get((idx, ptr))
        if s is None:
            import cupy
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                s = cupy.cuda.ExternalStream(ptr, idx)
            self._streams[(idx, ptr)] = s
        return s


def _loads(p: ScanPlan):
    out = ir.loads(p.decay) + ir.loads(p.drive)
    for o in p.outputs:
        out += ir.loads(o.expr)
    return out


def _carry_bytes(cfg, N: int, esize: int) -> int:
    """Dynamic shared memory of one block: the carried state of the chunked scans, [rows][2][N]
    (double buffered by chunk); none for the sequential kernel (its state is in registers)."""
    if cfg["layout"] == "seq":
        return 0
    return 2 * N * cfg["rows_per_block"] * esize


def _seq_split(cfg, ns: int) -> int:
    """Threads per row of a sequential-kernel instance for state size ns fixed at compile time
    (as ssmc_seq_split in the prelude), 0 when it has none: N read at run time, N not a multiple
    of the config's states, or the split not a power of two <= 32 dividing the chunk, or the block
    not whole warps (the row's lanes exchange with full-warp shuffles) within 1024 threads."""
    states, it = cfg["states"], cfg["items"]
    if ns <= 0 or ns % states:
        return 0
    split = ns // states
    if split > 32 or split & (split - 1) or it % split:
        return 0
    block = cfg["rows_per_block"] * split
    return split if block <= 1024 and (split == 1 or block % 32 == 0) else 0


def _pick(configs, layout: str, L: int, rows: int, ns: int = 0, stage_ok=lambda c: False) -> dict:
    """The first entry of the data layout's list whose max_len (None: any) and min_rows admit
    the call; the list's last entry otherwise. Sequential-kernel entries need the state size ns
    fixed at compile time, fitting their states (`_seq_split`); staging ones also `stage_ok`."""
    cands = sorted((c["rules"][layout] + (c,) for c in configs if layout in c["rules"]
                    and (c["layout"] != "seq" or _seq_split(c, ns))
                    and (not c.get("stage") or stage_ok(c))), key=lambda x: x[0])
    if not cands:
        raise ValueError(f"the variant table declares no kernel for {layout} inputs")
    for _, max_len, min_rows, c in cands:
        if (max_len is None or L <= int(max_len)) and rows >= min_rows:
            return c
    return cands[-1][-1]


@functools.lru_cache(maxsize=None)
def _ARG_TYPES():
    import numpy as np
    return {"ptr": np.uint64, "i64": np.int64, "i32": np.int32}


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def device_arch(inputs) -> tuple[int, int]:
    """(device index, sm_XX) of the inputs' CUDA device; RuntimeError for another device."""
    dev = inputs[0].device
    if dev.type != "cuda":
        raise RuntimeError(f"the cuda kernel got inputs on {dev}")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return idx, _capability(idx)


@functools.lru_cache(maxsize=None)
def _capability(idx: int) -> int:
    major, minor = torch.cuda.get_device_capability(idx)
    return major * 10 + minor


# -- the target ----------------------------------------------------------------------------------

class CudaTarget:
    """Target "cuda": see the module docstring."""
    name = "cuda"

    def __init__(self):
        self.version = f"{KERNEL_VERSION}+nvrtc{nvrtc_version() or '-none'}"

    def supports(self, region, strategy, arch, device_type):
        if device_type != "cuda":
            return f"runs on CUDA devices only (the graph is on {device_type})"
        if arch is None or arch < MIN_ARCH:
            return f"needs sm_{MIN_ARCH} or newer (device is sm_{arch})"
        if strategy not in STRATEGIES and strategy != "block_sparse":
            return f"has no kernel for strategy {strategy!r}"
        why = toolchain_problem()
        if why:
            return why
        if strategy == "block_sparse":
            from .cuda_block_sparse import bsp_plan
            try:
                bsp_plan(region)
            except Unsupported as e:
                return f"the block-sparse kernel does not cover this region: {e}"
            return True
        try:
            plan(region)
        except Unsupported as e:
            return f"the chunked-scan kernel does not cover this region: {e}"
        return True

    def compile(self, region, strategy, options, variants: dict | None = None, extra_flags=()):
        """Plan and render now; on a machine with a GPU also NVRTC-compile for the current
        device, so that a failure surfaces here and the backend falls back."""
        from ssmc.runtime.cache import get_cache
        if strategy == "block_sparse":
            from .cuda_block_sparse import CudaBlockSparseKernel, bsp_plan
            kernel = CudaBlockSparseKernel(region, bsp_plan(region), get_cache(options.cache_dir),
                                           extra_flags or EXTRA_FLAGS)
            if torch.cuda.is_available():      # the instances contiguous inputs will run
                kernel.arch = _capability(torch.cuda.current_device())
                kernel._prebuild(kernel.arch, [kernel.instance(c) for c in kernel.choices()])
            else:
                kernel.rendered(kernel.choices()[0])
            return kernel
        p = plan(region)
        kernel = CudaKernel(region, p, get_cache(options.cache_dir), variants, extra_flags or EXTRA_FLAGS)
        if torch.cuda.is_available():
            kernel.built(_capability(torch.cuda.current_device()))
        else:
            kernel.rendered(90)
        return kernel

    def source(self, kernel) -> str | None:
        return kernel.source


EXTRA_FLAGS: tuple[str, ...] = ()   # appended to every NVRTC command line (tests inject failures here)
__all__ = ["CudaTarget", "CudaKernel", "CudaCompileError", "render", "build", "nvrtc_compile",
           "include_dirs", "nvrtc_version", "toolchain_problem", "variant_for", "CTYPES"]
