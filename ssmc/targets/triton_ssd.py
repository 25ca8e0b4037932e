"""Dedicated Triton kernels for two strategies: "chunked_ssd" (Mamba-2 prefill) and "step" (decode).

`TritonTarget.compile` (triton.py) looks the strategy up in `DEDICATED`; each kernel class
says with `make_plan(region) -> plan | reason` whether it computes the region, and a region
it declines runs on the selective-scan kernels with the reason in the kernel source header.

Chunked SSD (templates/triton/ssd_fwd.py.j2). The region must be, per program (one index of
every *program* axis, e.g. batch and head):
- the decay one scalar per step, the same over the two state axes the matmuls run over: p
  (rows, the head dim) and n (columns, the axis the readout sums over); its log is what the
  kernel scans, so the decay must be exp(u) (u is used directly), sigmoid(v) (logsigmoid), a
  positive constant, or products, quotients and constant powers of those. Anything else (a
  decay loaded as is, 1 - sigmoid, ...) may be <= 0 and is declined;
- the drive an outer product w(t) * x(t, p) * g(t, n): a product of factors each free of p or
  of n; the factors free of both (dt) are a per-step scale w that the kernel applies to the
  (chunk, chunk) matrix and the state update rather than to x, so x (a 16-bit load) enters the
  matmul unrounded;
- the readout sum over n of h * c(t, n) (times factors free of n), the state appearing in
  per-step outputs nowhere else; the epilogue (D skip, z gate, casts) is printed around it.
Final outputs (the state after the last step) are printed on the (p, n) state tile.
Inputs in fp64 are declined (the matmuls run in fp32 / 16-bit on tensor cores). A call whose
shapes the kernel cannot take (n above MAX_BLOCK_N) runs the selective-scan kernel instead and
says so in ``fallback``.

Time split. Each program walks all of time, so a grid of fewer programs than the device has SMs
(b4 h24 p64 on a 132-SM H200: 96) leaves SMs idle however long L is. `SSDKernel.split` then
cuts time into segments of whole chunks, run by programs of their own: one launch computes
each segment's end state from a zero start (segment 0 from the initial state) and its total
log decay, a second combines them in order into each segment's start state (fp32), a third
runs the kernel above per segment from that state; only the last segment writes final
outputs. All three kernels are rendered from the same region expressions as the one-segment
kernel, which runs unchanged when the grid fills the device (policy: the "segments" entry of
ssd_fwd.configs.json; ``force_segments`` and ``sm_count`` on the kernel for tests and tuning).

Decode step (templates/triton/step_fwd.py.j2): the selective-scan plan (register axis whole,
a channel block per program, one launch for the batch), the state read once and written once
with evict-first hints; a region without a state passed in (nothing to read) is declined.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import importlib.resources
import json
import math
import re

import torch

from ssmc import ir
from ssmc.ir import Const, Load, Op, Reduce, Region, State, factors, product

from . import triton as T
from .triton_printer import LOG2E, Frame, TritonPrinter

log = logging.getLogger("ssmc")

SSD_TEMPLATE = "triton/ssd_fwd.py.j2"
SSD_CONFIGS = "triton/ssd_fwd.configs.json"
STEP_TEMPLATE = "triton/step_fwd.py.j2"
STEP_CONFIGS = "triton/step_fwd.configs.json"
MAX_BLOCK_N = 256            # the (p, n) state tile and the (chunk, n) tiles live in registers
LOG_DECAY_FLOOR = -64.0      # a step's log decay, at least (exp(-64) ~ 1.6e-28: a reset stays a reset); the
                             # chunk forms difference prefix sums of it, which a -inf or -1e8 (a hard reset
                             # written as exp(-inf)) would turn into NaN or into lost digits

_DOT_DTYPES = {torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}


@functools.lru_cache(maxsize=None)
def _table(name: str) -> dict:
    return json.loads((importlib.resources.files("ssmc.templates") / name).read_text())


# -- analysing the region ----------------------------------------------------------------------------

def log_decay(d):
    """log(d) as an expression finite wherever d's inputs are, or why there is none:
    exp(u) -> u, sigmoid(v) -> logsigmoid(v), c > 0 -> log(c), and products, quotients,
    reciprocals and constant powers of those. Float casts are looked through."""
    if isinstance(d, Const):
        return Const(math.log(d.value)) if d.value > 0 else f"a constant decay {d.value} <= 0"
    if isinstance(d, Op):
        n, a = d.name, d.args
        if n == "exp":
            return a[0]
        if n == "exp2":
            return Op("mul", (a[0], Const(math.log(2.0))))
        if n == "sigmoid":
            return Op("logsigmoid", (a[0],))
        if n == "cast" and ir.to_dtype(d.attr("dtype")).is_floating_point:
            return log_decay(a[0])
        if n in ("mul", "div") and not d.attrs:
            la, lb = log_decay(a[0]), log_decay(a[1])
            for x in (la, lb):
                if isinstance(x, str):
                    return x
            return Op("add" if n == "mul" else "sub", (la, lb))
        if n == "reciprocal":
            la = log_decay(a[0])
            return la if isinstance(la, str) else Op("neg", (la,))
        if n == "pow" and isinstance(a[1], Const):
            la = log_decay(a[0])
            return la if isinstance(la, str) else Op("mul", (la, a[1]))
    return (f"the decay {d} is not exp(u), sigmoid(u), a positive constant or a product of those; "
            "its log, which the SSD kernel scans, may be undefined")


def _is_state(e) -> bool:
    while isinstance(e, Op) and e.name == "cast" and ir.to_dtype(e.attr("dtype")).is_floating_point:
        e = e.args[0]
    return isinstance(e, State)


def _state_outside(e, keep) -> bool:
    """Does `e` read the state other than inside the node `keep`?"""
    seen = set()

    def go(x):
        if x is keep or x == keep or x in seen:
            return False
        seen.add(x)
        if isinstance(x, State):
            return True
        return any(go(c) for c in ir.children(x))
    return go(e)


@dataclasses.dataclass(frozen=True)
class SSDPlan:
    p: str                          # state axis of the chunk matmuls' rows (head dim)
    n: str                          # state axis the readout sums over (columns)
    programs: tuple[str, ...]       # the other state axes: one program per index
    log_decay: ir.Expr              # natural log of the decay, per program and step
    w: ir.Expr                      # drive factor free of p and n (per program and step)
    x: ir.Expr                      # drive factor along p
    g: ir.Expr                      # drive factor along n
    readout: Reduce | None          # the sum over n in the per-step outputs
    c: ir.Expr | None               # readout factor along n
    y_scale: ir.Expr | None         # readout factors free of n
    inputs: tuple[int, ...]         # region inputs the kernel reads
    generic: T.Plan                 # the selective-scan plan (run-time fallback)
    decay_n: bool = False           # the decay varies along n too (GLA's per-key decay): the
                                    # torch matmul form only (make_ssd_plan's decay_along_n)

    def describe(self) -> str:
        return (f"rows {self.p}, columns {self.n} (summed by the readout), one program per index "
                f"of {list(self.programs)}; log decay {self.log_decay.args[0]} (at least {LOG_DECAY_FLOOR:g}); "
                f"drive ({self.w}) * ({self.x}) * ({self.g})"
                + (f"; readout sum_{self.n} h * ({self.c})" if self.readout is not None else ""))


def make_ssd_plan(r: Region, float64: bool = False, decay_along_n: bool = False) -> SSDPlan | str:
    """The chunked SSD kernel's plan for `r`, or why it cannot compute it. ``float64``: plan a
    region of fp64 inputs too (the matmul-form backward of ssd_autograd.py runs them; the
    kernel does not). ``decay_along_n``: a decay that varies along the readout's axis n too
    (``decay_n``; the torch matmul form of ssd_autograd.py computes it, the kernels do not)."""
    generic = T.make_plan(r)
    if isinstance(generic, str):
        return generic
    if not float64 and any(s.dtype == "float64" for s in r.inputs):
        return "float64 inputs (its matmuls run in fp32 or 16-bit on tensor cores)"
    steps = [o for o in r.outputs if o.kind == "steps"]
    readouts = {x for o in steps for x in ir.walk(o.expr) if isinstance(x, Reduce)}
    if len(readouts) > 1:
        return f"{len(readouts)} different readouts (sums over state axes); the kernel computes one"
    readout = next(iter(readouts), None)
    dec = r.decay_axes() - {"t"}
    free = [a for a in r.axes if a not in dec]
    if readout is not None:
        if len(readout.axes) != 1:
            return f"the readout sums over {list(readout.axes)}, not one axis"
        n = readout.axes[0]
        if n in dec and not decay_along_n:
            return f"the decay varies along the readout axis {n}"
        rows = [a for a in free if a != n]
    else:
        if len(free) < 2:
            return f"the decay is shared over {free} only: no (p, n) pair of state axes"
        n, rows = free[-1], free[:-1]
    if not rows:
        return f"the decay varies along every state axis but {n}: no axis for the chunk matmuls"
    p = rows[-1]
    programs = tuple(a for a in r.axes if a not in (p, n))
    u = log_decay(r.decay)
    if isinstance(u, str):
        return u
    u = Op("maximum", (u, Const(LOG_DECAY_FLOOR)))
    ws, xs, gs = [], [], []
    for f in factors(r.drive):
        ax = ir.axes_of(f, r.axes)
        if p in ax and n in ax:
            return (f"the drive is not an outer product x(t, {p}) * g(t, {n}): "
                    f"its factor {f} varies along both")
        (gs if n in ax else xs if p in ax else ws).append(f)
    c = y_scale = None
    if readout is not None:
        fs = factors(readout.arg)
        hs = [f for f in fs if _is_state(f)]
        rest = [f for f in fs if not _is_state(f)]
        if len(hs) != 1 or any(ir.uses_state(f) for f in rest):
            return f"the readout {readout} is not sum over {n} of h * c"
        cs, ss = [], []
        for f in rest:
            ax = ir.axes_of(f, r.axes)
            if n in ax and p in ax:
                return f"the readout factor {f} varies along both {p} and {n}"
            (cs if n in ax else ss).append(f)
        c = product(cs)
        y_scale = product(ss) if ss else None
    for o in steps:
        if n in o.index:
            return f"a per-step output along {n} (the kernel keeps the state in registers)"
        if _state_outside(o.expr, readout):
            return f"a per-step output reads the state other than through the readout: {o.expr}"
    for o in r.outputs:
        if o.kind == "final":
            for x in ir.walk(o.expr):
                if isinstance(x, Reduce) and x.axes != (n,):
                    return f"a final output sums over {list(x.axes)} (the kernel sums over {n} only)"
    return SSDPlan(p, n, programs, u, product(ws), product(xs), product(gs), readout, c, y_scale,
                   generic.inputs, generic, decay_n=n in dec)


# -- printing -------------------------------------------------------------------------------------

class _Printer(TritonPrinter):
    """A printer whose hoisted temporaries are named apart (two printers, one kernel) and
    that can stand a precomputed tile in for an expression (the readout)."""

    def __init__(self, region, cdt, prefix, hoist_prefix):
        super().__init__(region, cdt, prefix)
        self.hoist_prefix = hoist_prefix

    def _name(self, hoisted: bool) -> str:
        self._n += 1
        return f"{self.hoist_prefix if hoisted else self.prefix}{self._n}"

    def bind(self, e, code: str):
        """In the current block, `e` reads as `code`."""
        self._memo[e] = code


def _store(printer, k: int, o: ir.OutputSpec, value: str, evict: bool = False) -> str:
    s = T._store(printer, k, o, value)
    return s[:-1] + ', eviction_policy="evict_first")' if evict else s


def states_inputs(r: Region, plan: SSDPlan) -> tuple[int, ...]:
    """The inputs the segment-state kernel reads: the decay's, the drive's and the initial state."""
    used = {ld.input for e in (plan.log_decay, plan.w, plan.x, plan.g) for ld in ir.loads(e)}
    return tuple(i for i in plan.inputs if i in used or i == r.init)


def ssd_args(r: Region, plan: SSDPlan, kernel: str = "ssd") -> list[str]:
    """The runtime arguments of one of the region's kernels, in order (constexprs follow):
    "ssd" (one segment: all of time), "ssd_seg" (one segment of NSEG, from the segment start
    states in st_ptr), "ssd_states" (segment end states into st_ptr, total decays into
    dec_ptr; no outputs)."""
    outs = kernel != "ssd_states"
    ins = plan.inputs if outs else states_inputs(r, plan)
    extra = {"ssd": [], "ssd_seg": ["st_ptr"], "ssd_states": ["st_ptr", "dec_ptr"]}[kernel]
    args = [f"in{i}_ptr" for i in ins] + ([f"out{k}_ptr" for k in range(len(r.outputs))] if outs else [])
    args += extra
    args += [f"in{i}_s{d}" for i in ins for d in range(r.inputs[i].ndim)]
    if outs:
        args += [f"out{k}_s{d}" for k, o in enumerate(r.outputs) for d in range(len(o.index))]
    args += [f"size_{a}" for a in plan.programs] + ["SIZE_P", "SIZE_N", "L"]
    return args + (["NSEG", "SEG_LEN"] if kernel != "ssd" else [])


def _chunk_lines(pm: _Printer, plan: SSDPlan, progs: dict, readout: bool) -> dict:
    """The per-chunk pieces printed by `pm`: decay (its log), w, g (and c), x."""
    out = {}
    out["decay_lines"] = pm.block(Frame({**progs, "t": ("tv", "mv")}, None, None, None))
    out["decay"] = pm.expr(plan.log_decay)
    out["w"] = pm.expr(plan.w)
    out["n_lines"] = pm.block(Frame({**progs, plan.n: ("on_", "mn_"), "t": ("tq", "mq")}, None, None, None))
    out["g"] = pm.expr(plan.g)
    out["c"] = pm.expr(plan.c) if readout else None
    out["p_lines"] = pm.block(Frame({**progs, plan.p: ("op_", "mp_"), "t": ("tq", "mq")}, None, None, None))
    out["x"] = pm.expr(plan.x)
    return out


def render_ssd(r: Region, plan: SSDPlan, opd: str) -> str:
    cdt = "tl.float32"
    progs = {a: (f"idx_{a}", None) for a in plan.programs}
    pm = _Printer(r, cdt, "v", "p")
    pm.set_prelude_frame(Frame({**progs, plan.p: ("op_", "mp_"), plan.n: ("on_", "mn_")}, None, None, None))
    fused = _chunk_lines(pm, plan, progs, plan.readout is not None)
    post = []
    pm.switch(post)
    if plan.readout is not None:
        y = "y"
        if plan.y_scale is not None:
            post.append(f"ys = y * {pm.expr(plan.y_scale)}")
            y = "ys"
        pm.bind(plan.readout, y)
    for k, o in enumerate(r.outputs):
        if o.kind == "steps":
            post.append(_store(pm, k, o, pm.expr(o.expr)))
    # the state tile (p rows, n columns): the initial state before the loop, final outputs after
    state_codes = {**progs, plan.p: ("ops", "mps"), plan.n: ("on_", "mn_")}

    def state_printer(prefix, hoist_prefix):
        pr = _Printer(r, cdt, prefix, hoist_prefix)
        pr.set_prelude_frame(Frame(state_codes, None, 1, "mn_"))
        pr.block(Frame(state_codes, None, 1, "mn_"))
        return pr, (pr.expr(Load(r.init, tuple(r.axes))) if r.init is not None else None)
    pf, init = state_printer("w", "q")
    final = pf.block(Frame({**state_codes, "t": ("t_last", None)}, "h", 1, "mn_"))
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            final.append(_store(pf, k, o, pf.expr(o.expr)))
    # the segment-state kernel: the state update only, printed apart (its own prelude)
    ps = _Printer(r, cdt, "e", "f")
    ps.set_prelude_frame(Frame({**progs, plan.p: ("op_", "mp_"), plan.n: ("on_", "mn_")}, None, None, None))
    states = _chunk_lines(ps, plan, progs, False)
    pi, states["init"] = state_printer("i", "j")
    states["prelude"] = ps.prelude + pi.prelude
    prec = {"tl.float32": "tf32x3"}.get(opd, "")
    return T._env().get_template(SSD_TEMPLATE).render(
        region_name=r.name, region_key=r.key(), region_text=str(r) + "\n# SSD plan: " + plan.describe(),
        kname=T.kernel_name(r), opd=opd, prec=prec,
        prec_kw=f', input_precision="{prec}"' if prec else "", log2e=repr(LOG2E),
        programs=plan.programs, args=T.arg_lines(ssd_args(r, plan)),
        states_args=T.arg_lines(ssd_args(r, plan, "ssd_states")),
        seg_args=T.arg_lines(ssd_args(r, plan, "ssd_seg")),
        prelude=pm.prelude + pf.prelude, init=init, fused=fused, states=states,
        readout=plan.readout is not None, post=post, final=final)


def _state_load(r: Region, frame: Frame, cdt: str) -> str:
    """The initial state's tile, read once: evict-first (nothing reads it again)."""
    scal, vec, masks = [], [], []
    for d, a in enumerate(r.axes):
        code, mask = frame.codes[a]
        (vec if mask else scal).append(f"{code} * in{r.init}_s{d}")
        if mask and mask not in masks:
            masks.append(mask)
    off = " + ".join(scal + vec) or "0"
    m = f", mask={' & '.join(masks)}, other=0.0" if masks else ""
    return f'tl.load(in{r.init}_ptr + ({off}){m}, eviction_policy="evict_first").to({cdt})'


def render_step(r: Region, plan: T.Plan, cdt: str) -> str:
    p = TritonPrinter(r, cdt)
    pre_f, body_f, final_f = T._frames(plan, False)
    p.set_prelude_frame(pre_f)
    init = _state_load(r, pre_f, cdt)
    pre = p.block(body_f)
    a, b = p.expr(r.decay), p.expr(r.drive)
    post = []
    p.switch(post, state="h")
    for k, o in enumerate(r.outputs):
        if o.kind == "steps":
            post.append(_store(p, k, o, p.expr(o.expr)))
    final = p.block(final_f)
    for k, o in enumerate(r.outputs):
        if o.kind == "final":
            final.append(_store(p, k, o, p.expr(o.expr), evict=isinstance(o.expr, State)))
    v = T.Variant(list(p.prelude), init, pre, a, b, post, final)
    return T._env().get_template(STEP_TEMPLATE).render(
        region_name=r.name, region_key=r.key(), region_text=str(r), cdt=cdt, kname=T.kernel_name(r),
        plan=plan, args=T.arg_lines(T.kernel_args(r, plan)), v=v)


# -- kernels ----------------------------------------------------------------------------------------

def _sig_ptr(r: Region, name: str, dts: list) -> str:
    if name in ("st_ptr", "dec_ptr"):                 # the segment buffers
        return "*fp32"
    if name.startswith("in"):
        return "*" + T._TL_PTR[dts[int(name[2:-4])]]
    return "*" + T._TL_PTR[ir.to_dtype(r.outputs[int(name[3:-4])].dtype)]


@dataclasses.dataclass(frozen=True)
class Split:
    """How one call splits time: `segments` segments of `seg_len` steps (whole chunks; the last
    one shorter), each run by its own programs, and why."""
    segments: int
    seg_len: int
    programs: int              # the one-segment grid: program indices x row blocks
    sms: int | None            # the device's SM count (None: unknown, not on a GPU)
    reason: str


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int | None:
    """The SM count of a CUDA device (read once per device), None for other devices."""
    if device.type != "cuda":
        return None
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


class SSDKernel(T.TritonKernel):
    """Chunked SSD forward of one region; the selective-scan kernel runs calls it cannot take.

    Time split: a call whose grid (program indices x row blocks) leaves SMs idle and whose
    length has enough chunks runs time in segments (`split`; the policy is the "segments"
    entry of ssd_fwd.configs.json): segment end states, a combine over segments, then the
    outputs per segment, three launches (templates/triton/ssd_fwd.py.j2). ``last_launch`` says
    how the last call ran (config, grid, segments and why), ``describe()`` in words.
    ``force_segments``: this many segments whatever the policy says (tests, tuning; fewer
    when the length has fewer chunks); ``sm_count``: the SM count the policy fills instead of
    the device's (tests on CPU, where there is none).
    """
    kind = "chunked SSD"
    template = SSD_TEMPLATE
    configs_file = SSD_CONFIGS
    make_plan = staticmethod(make_ssd_plan)
    force_segments: int | None = None
    sm_count: int | None = None

    def __init__(self, region, strategy, plan: SSDPlan, options, arch):
        self._options = options
        self._generic_kernel = None
        self.last_launch: dict | None = None
        self._replay_knobs = (None, None)
        super().__init__(region, strategy, plan, options, arch)

    def plan_text(self) -> str:
        return self.plan.describe()

    def launch_text(self) -> str:
        pol = self.policy()
        text = (f"time split into segments when the grid has fewer than {pol['split_below']:g} programs per SM "
                f"(enough for >= {pol['programs_per_sm']} per SM, >= {pol['min_chunks']} chunks each, "
                f"at most {pol['max_segments']})")
        if self.last_launch is not None:
            text += "; " + self.describe()
        return text

    def describe(self) -> str:
        ll = self.last_launch
        if ll is None:
            return "chunked SSD: not run yet"
        c = ll["config"]
        how = (f"time in {ll['segments']} segments of {ll['seg_len']} steps, 3 launches (segment states, "
               f"combine, outputs)" if ll["segments"] > 1 else "time in one segment, one launch")
        return (f"last call: CHUNK {c['CHUNK']}, BLOCK_P {c['BLOCK_P']}, {c.get('num_warps')} warps, "
                f"{ll['programs']} programs; {how} ({ll['reason']})")

    def table(self) -> dict:
        return _table(SSD_CONFIGS)

    # -- source: one rendering per dtype of the matmul operands ----------------------------------
    def _flavor(self, dtypes) -> str:
        """The dtype of the tl.dot operands: 16-bit when every input the matmuls read (the drive
        and readout factors) is that 16-bit type, else fp32."""
        p = self.plan
        used = {ld.input for e in (p.x, p.g, p.c) if e is not None for ld in ir.loads(e)}
        got = {dtypes[i] for i in used if dtypes[i].is_floating_point}
        if len(got) == 1 and next(iter(got)) in _DOT_DTYPES:
            return _DOT_DTYPES[next(iter(got))]
        return "tl.float32"

    def _render(self, flavor: str) -> str:
        return render_ssd(self.region, self.plan, flavor)

    # -- shapes -------------------------------------------------------------------------------------
    def bucket(self, inputs) -> tuple:
        sizes, L = self.sizes(inputs)
        p = self.plan
        others = math.prod(sizes[a] for a in p.programs)
        return (tuple(ir.dtype_name(x.dtype) for x in inputs), T._pow2(sizes[p.n]), T._pow2(sizes[p.p]),
                min(T._pow2(others), 1 << 16), min(T._pow2(L), 1 << 14))

    def _min_dot(self, cuda: bool) -> int:
        return int(self.table().get("min_dot", 16)) if cuda else 1

    def candidates(self, inputs, arch) -> list[dict]:
        """This arch's configs fitted to the shapes: CHUNK clamped to the length's power of
        two, BLOCK_P to p's (both at least min_dot on a GPU, BLOCK_P at least the arch's
        min_block_p), too-large tiles dropped (the
        smallest kept when all are), duplicates removed."""
        table = self.table()
        sizes, L = self.sizes(inputs)
        lo = self._min_dot(inputs[0].device.type == "cuda")
        bn = max(lo, T._pow2(sizes[self.plan.n]))
        lo_p = max(lo, int(table.get("min_block_p", {}).get(T.arch_key(arch), 0))) if lo > 1 else lo
        budget = int(table.get("max_tile_per_thread", 256)) * 32
        fits, tiles, seen = [], [], set()
        for c in table[T.arch_key(arch)]:
            c = dict(c)
            c["CHUNK"] = max(lo, min(int(c["CHUNK"]), T._pow2(L)))
            c["BLOCK_P"] = max(lo_p, min(int(c["BLOCK_P"]), T._pow2(sizes[self.plan.p])))
            sig = tuple(sorted(c.items()))
            if sig in seen:
                continue
            seen.add(sig)
            q, bp = c["CHUNK"], c["BLOCK_P"]
            tile = bp * bn + q * q + q * bp + 2 * q * bn
            tiles.append((tile / c["num_warps"], c))
            if tile <= budget * c["num_warps"]:
                fits.append(c)
        return fits or [min(tiles, key=lambda x: x[0])[1]]

    # -- launching ------------------------------------------------------------------------------------
    def launch_args(self, inputs, outs) -> list:
        p = self.plan
        sizes, L = self.sizes(inputs)
        args = T.tensor_args([inputs[i] for i in p.inputs] + list(outs))
        args += [sizes[a] for a in p.programs]
        return args + [sizes[p.p], sizes[p.n], L]

    def constexprs(self, inputs, config) -> dict:
        sizes, _ = self.sizes(inputs)
        cuda = inputs[0].device.type == "cuda"
        return {"CHUNK": config["CHUNK"], "BLOCK_P": config["BLOCK_P"],
                "BLOCK_N": max(self._min_dot(cuda), T._pow2(sizes[self.plan.n])),
                "DOT_UP": (not cuda) and self._cdt(inputs) != "tl.float32"}

    def grid(self, inputs, config) -> tuple[int]:
        sizes, _ = self.sizes(inputs)
        rows = -(-sizes[self.plan.p] // config["BLOCK_P"])
        return (math.prod(sizes[a] for a in self.plan.programs) * rows,)

    def signature(self, config: dict, block_n: int = 16, dtypes: dict | None = None, kernel: str = "ssd"):
        """(jit function, signature, constexprs) for a compile-only triton.compile of one of
        the region's kernels (`kernel`: "ssd", "ssd_states", "ssd_seg" or "ssd_combine");
        `dtypes` (input index -> torch dtype) overrides the region's input dtypes."""
        r = self.region
        dts = [ir.to_dtype(s.dtype) for s in r.inputs]
        for i, dt in (dtypes or {}).items():
            dts[i] = dt
        fn = self._fn(self._module(self._flavor(dts)), kernel)
        if kernel == "ssd_combine":
            return fn, {"st_ptr": "*fp32", "dec_ptr": "*fp32", "NSEG": "i32", "SIZE_PN": "i32",
                        "BLOCK": "constexpr"}, {"BLOCK": config.get("BLOCK", 1024)}
        sig = {n: _sig_ptr(r, n, dts) if n.endswith("_ptr") else "i32" for n in ssd_args(r, self.plan, kernel)}
        cx = {"CHUNK": config["CHUNK"], "BLOCK_P": config["BLOCK_P"], "BLOCK_N": block_n, "DOT_UP": False}
        sig.update({k: "constexpr" for k in cx})
        return fn, sig, cx

    def _why_not(self, inputs, sizes: dict, L: int) -> str | None:
        """Why this call runs the torch reference instead (None: a Triton kernel runs)."""
        dev = inputs[0].device
        if L == 0:
            return "zero steps"
        if dev.type == "cpu" and not T.interpreting():
            return "CPU tensors without TRITON_INTERPRET=1"
        if dev.type not in ("cpu", "cuda"):
            return f"device {dev.type}"
        for x in inputs:
            if x.dtype not in T._TL_PTR:
                return f"input dtype {x.dtype}"
            if x.numel() > T._INT32_MAX:
                return "an input of more than 2**31 elements (32-bit offsets)"
        for o in self.region.outputs:
            if math.prod(L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index) > T._INT32_MAX:
                return "an output of more than 2**31 elements (32-bit offsets)"
        return None

    def _ssd_refusal(self, inputs, sizes: dict) -> str | None:
        """Why this call runs the selective-scan kernel instead (None: the SSD kernel runs)."""
        if T._pow2(sizes[self.plan.n]) > MAX_BLOCK_N:
            return f"{self.plan.n} of {sizes[self.plan.n]} > {MAX_BLOCK_N} (the state tile lives in registers)"
        if any(x.dtype == torch.float64 for x in inputs):
            return "float64 inputs"
        return None

    def _generic(self) -> T.TritonKernel:
        if self._generic_kernel is None:
            self._generic_kernel = T.TritonKernel(self.region, self.strategy, self.plan.generic,
                                                  self._options, self.arch)
        return self._generic_kernel

    def forward(self, inputs):
        sizes, _ = self.sizes(inputs)
        why = self._ssd_refusal(inputs, sizes)
        if why is not None:
            self.fallback = f"{why}: the {T.TritonKernel.kind} kernel ran instead"
            self.last_launch = None
            return self._generic().forward(inputs)
        knobs = (self.force_segments, self.sm_count)
        if knobs != self._replay_knobs:           # replays were prepared under other knobs
            self._replays.clear()
            self._replay_knobs = knobs
        return super().forward(inputs)

    # -- backward -------------------------------------------------------------------------------------
    _ssd_bwd: str | None = None       # "ok", or why the matmul-form backward did not run
    _ssd_core: str | None = None      # why the core ran in torch matmuls, not ssd_core's kernels
    _ssd_epi: str | None = None       # why the epilogue's backward ran under torch autograd
    _ssd_chunk: int | None = None     # the backward's chunk

    def backward(self, inputs, grads, needs):
        """The chunked SSD's backward (ssd_autograd.py): the factors' expressions under autograd,
        the core map from the factors to y and the final state as the Triton kernels of
        ssd_core.py (in torch matmuls where they do not run), the per-step epilogue's backward
        as the generated kernel of ssd_epilogue.py where it applies; the selective-scan backward
        kernel where that fails (``backward_note()`` says which ran and why)."""
        from .ssd_autograd import CHUNK, kernel_chunk, ssd_backward, use_kernels
        if self.sizes(inputs)[1] == 0:           # nothing to chunk
            return super().backward(inputs, grads, needs)
        self._ssd_core = use_kernels(self.region, self.plan, inputs)
        self._ssd_chunk = CHUNK if self._ssd_core else kernel_chunk(self.plan, inputs)
        ep = None
        if self._ssd_core is None:
            ep = self._epilogue(tuple(bool(n) for n in needs))
            self._ssd_epi = ep if isinstance(ep, str) else None
        try:
            got = ssd_backward(self.region, self.plan, inputs, grads, needs,
                               core="torch" if self._ssd_core else "triton",
                               deterministic=bool(getattr(self.options, "deterministic", False)),
                               cache_dir=getattr(self.options, "cache_dir", None), epilogue=ep)
            self._ssd_bwd = "ok"
            return got
        except Exception as e:       # e.g. out of memory: the per-element backward runs
            self._ssd_bwd = f"{type(e).__name__}: {e}"
            log.warning("ssmc: region %s: chunked SSD backward failed (%s); the selective-scan "
                        "backward runs instead", self.region.name, self._ssd_bwd)
        return super().backward(inputs, grads, needs)

    def _epilogue(self, needs: tuple):
        """ssd_epilogue's plan for these needs (or why there is none), made once per needs."""
        from .ssd_epilogue import make_epilogue
        memo = self.__dict__.setdefault("_epilogues", {})
        if needs not in memo:
            memo[needs] = make_epilogue(self.region, self.plan, needs)
        return memo[needs]

    def backward_note(self) -> str | None:
        if self._ssd_bwd == "ok":
            if self._ssd_core is None:
                core = "the Triton kernels of ssmc/targets/ssd_core.py"
                epi = ("; the per-step epilogue's backward: the generated kernel of "
                       "ssmc/targets/ssd_epilogue.py" if self._ssd_epi is None
                       else f"; the per-step epilogue under autograd ({self._ssd_epi})")
            else:
                core, epi = f"torch matmuls ({self._ssd_core})", ""
            return (f"backward: the chunked SSD, chunk {self._ssd_chunk}: factors under autograd, "
                    f"the core map through {core}{epi} (ssmc/targets/ssd_autograd.py)")
        note = super().backward_note()
        if self._ssd_bwd is not None and note:
            return f"{note}; the chunked SSD backward failed: {self._ssd_bwd}"
        return note

    # -- splitting time ---------------------------------------------------------------------------
    def policy(self) -> dict:
        """When to split time (the "segments" entry of the configs table, with defaults)."""
        pol = {"split_below": 1.0, "programs_per_sm": 5.5, "min_chunks": 16, "max_segments": 64}
        pol.update({k: v for k, v in self.table().get("segments", {}).items() if not k.startswith("_")})
        return pol

    def split(self, inputs, config) -> Split:
        """How this call splits time. Forced (``force_segments``), or: one segment unless the
        grid has fewer than split_below programs per SM; then enough segments for
        programs_per_sm programs per SM, as long as each keeps min_chunks chunks, at most
        max_segments. Segments are whole chunks, so the count may come out lower."""
        sizes, L = self.sizes(inputs)
        chunk = int(config["CHUNK"])
        rows = self.grid(inputs, config)[0]
        sms = self.sm_count if self.sm_count is not None else sm_count(inputs[0].device)
        chunks = -(-L // chunk)
        pol = self.policy()
        if self.force_segments is not None:            # (grid axis 1 holds at most 65535)
            want, why = min(int(self.force_segments), 65535), f"forced (force_segments={self.force_segments})"
        elif sms is None:
            return Split(1, L, rows, None, "no SM count to fill (not on a GPU)")
        elif rows >= pol["split_below"] * sms:
            return Split(1, L, rows, sms, f"{rows} programs for {sms} SMs")
        else:
            want = -(-int(pol["programs_per_sm"] * sms) // max(rows, 1))
            cap = min(chunks // int(pol["min_chunks"]), int(pol["max_segments"]))
            why = f"{rows} programs for {sms} SMs: {want} segments for {pol['programs_per_sm']} per SM"
            if cap < want:
                want = cap
                why += (f", capped at {max(cap, 1)} ({chunks} chunks of {chunk}, >= {pol['min_chunks']} per "
                        f"segment, at most {pol['max_segments']})")
        if rows == 0 or want <= 1:
            return Split(1, L, rows, sms, why)
        seg_len = -(-chunks // want) * chunk
        n = -(-L // seg_len)
        if n <= 1:
            return Split(1, L, rows, sms, f"{why}; {L} steps make one segment")
        if n != want:
            why += f"; {n} of whole {chunk}-step chunks"
        progs = math.prod(sizes[a] for a in self.plan.programs)
        if progs * (n - 1) * sizes[self.plan.p] * sizes[self.plan.n] > T._INT32_MAX:
            return Split(1, L, rows, sms, f"{why}; the segment states would pass 2**31 elements (32-bit offsets)")
        return Split(n, seg_len, rows, sms, why)

    def _arg_values(self, names, inputs, outs, extra: dict) -> list:
        """Launch arguments by name (see ssd_args): tensors, their strides (0 along a size-1
        dim, as T.tensor_args), sizes, and `extra` (segment buffers and counts)."""
        sizes, L = self.sizes(inputs)
        p = self.plan
        vals = {"SIZE_P": sizes[p.p], "SIZE_N": sizes[p.n], "L": L, **extra}
        vals.update({f"size_{a}": sizes[a] for a in p.programs})
        out = []
        for name in names:
            m = re.fullmatch(r"(in|out)(\d+)_(?:ptr|s(\d+))", name)
            if m is None:
                out.append(vals[name])
                continue
            x = (inputs if m[1] == "in" else outs)[int(m[2])]
            out.append(x if m[3] is None else 0 if x.shape[int(m[3])] == 1 else x.stride(int(m[3])))
        return out

    def launch(self, inputs, config, outs=None) -> list[torch.Tensor]:
        """One config: in one launch, or with time split (`split`) in three."""
        sp = self.split(inputs, config)
        grid = self.grid(inputs, config) + ((sp.segments,) if sp.segments > 1 else ())
        self.last_launch = {"config": config, "grid": grid, "programs": sp.programs, "sms": sp.sms,
                            "segments": sp.segments, "seg_len": sp.seg_len, "reason": sp.reason}
        if sp.segments == 1:
            return super().launch(inputs, config, outs)
        outs = self.outputs(inputs) if outs is None else outs
        mod = self._module(self._cdt(inputs))
        cpu = inputs[0].device.type == "cpu"
        extra = T.launch_options(config, inputs[0].device)
        cx = self.constexprs(inputs, config)
        sizes, _ = self.sizes(inputs)
        P, N = sizes[self.plan.p], sizes[self.plan.n]
        progs = math.prod(sizes[a] for a in self.plan.programs)
        rows, n = sp.programs, sp.segments
        dev = inputs[0].device
        st = torch.empty((progs, n - 1, P, N), dtype=torch.float32, device=dev)
        dec = torch.empty((progs, n - 1), dtype=torch.float32, device=dev)
        bufs = {"st_ptr": st, "dec_ptr": dec, "NSEG": n, "SEG_LEN": sp.seg_len}
        r = self.region
        self._fn(mod, "ssd_states")[(rows, n - 1)](
            *self._arg_values(ssd_args(r, self.plan, "ssd_states"), inputs, outs, bufs), **cx, **extra)
        block = min(1024, T._pow2(P * N))
        self._fn(mod, "ssd_combine")[(progs, -(-P * N // block))](
            st, dec, n, P * N, BLOCK=block, **({} if cpu else {"num_warps": 4}))
        self._fn(mod, "ssd_seg")[(rows, n)](
            *self._arg_values(ssd_args(r, self.plan, "ssd_seg"), inputs, outs, bufs), **cx, **extra)
        return outs

    def _replayable(self, inputs, config) -> bool:
        return self.last_launch is not None and self.last_launch["segments"] == 1

    def _replay(self, inputs, config, outs):
        run, info = super()._replay(inputs, config, outs), self.last_launch

        def replay(xs):
            self.last_launch = info
            return run(xs)
        return replay


def make_step_plan(r: Region) -> T.Plan | str:
    plan = T.make_plan(r)
    if isinstance(plan, str):
        return plan
    if r.init is None:
        return "no state passed in (nothing to read: the selective-scan loop is the same kernel)"
    return plan


class StepKernel(T.TritonKernel):
    """The decode step of one region: the state read once, written once."""
    kind = "decode step"
    template = STEP_TEMPLATE
    configs_file = STEP_CONFIGS
    make_plan = staticmethod(make_step_plan)

    def table(self) -> dict:
        return _table(STEP_CONFIGS)

    def _render(self, cdt: str) -> str:
        return render_step(self.region, self.plan, cdt)

    def candidates(self, inputs, arch) -> list[dict]:
        table = self.table()
        sizes, _ = self.sizes(inputs)
        bn = T._pow2(sizes[self.plan.reg]) if self.plan.reg else 1
        bd_max = T._pow2(sizes[self.plan.block]) if self.plan.block else 1
        budget = int(table.get("max_tile_per_thread", 64)) * 32
        fits, tiles, seen = [], [], set()
        for c in table[T.arch_key(arch)]:
            c = dict(c)
            c["BLOCK_D"] = max(1, min(int(c["BLOCK_D"]), bd_max))
            sig = tuple(sorted(c.items()))
            if sig in seen:
                continue
            seen.add(sig)
            tiles.append((c["BLOCK_D"] * bn / c["num_warps"], c))
            if c["BLOCK_D"] * bn <= budget * c["num_warps"]:
                fits.append(c)
        return fits or [min(tiles, key=lambda x: x[0])[1]]

    def constexprs(self, inputs, config) -> dict:
        sizes, _ = self.sizes(inputs)
        return {"BLOCK_D": config["BLOCK_D"],
                "BLOCK_N": T._pow2(sizes[self.plan.reg]) if self.plan.reg else 1}

    def signature(self, config: dict, block_n: int = 16, dtypes: dict | None = None):
        fn, sig, _ = super().signature({**config, "CHUNK": 1, "variant": "step"}, block_n, dtypes)
        del sig["CHUNK"]
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": block_n if self.plan.reg else 1}
        return fn, sig, cx


DEDICATED = {"chunked_ssd": SSDKernel, "step": StepKernel}
