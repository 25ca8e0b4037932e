"""The fuzzer's long run: random naive recurrent programs (fuzz_programs.py) through ssmc on a
device and its targets, tallied to JSON instead of stopping at the first failure.

Each program is drawn by hypothesis, made on SSMC_FUZZ_DEVICE and checked against the same
program run eagerly in float64 on that device:
- a linear program runs once per target in SSMC_FUZZ_TARGETS (options target=<t>): it must
  give exactly one region and match the reference within the dtype's tolerance (or 20x the
  error of eager in the program's own dtype, whichever is larger);
- a non-linear program must give no region and match too; it runs once (no region is made, so
  the target does not matter), under the targets in turn.
Every run is counted as exactly one of
  ok            right, and the region ran on the target asked for (on "auto": a generated target);
  fell_back     right, but the target declined the region (``supports()``, or a kernel's own
                run-time refusal such as a too-large register axis) and the next target ran it;
                the reason is counted in ``fell_back_reasons``;
  kernel_failed right, but the target accepted the region and then failed to compile or run
                it, so ssmc fell back on its own (a bug in the target, not a decline);
  wrong         a result outside the tolerance, a wrong shape, dtype or device, a linear
                program without its one region or a non-linear one with a region;
  crashed       an exception reached the caller.
The goal is wrong == crashed == kernel_failed == 0.

Environment (read by ``Config.from_env``):
  SSMC_FUZZ_DEVICE    cpu | cuda                            (default: the caller's choice)
  SSMC_FUZZ_TARGETS   comma-separated ssmc targets           (default cuda: triton,cuda,auto; cpu: torch)
  SSMC_FUZZ_EXAMPLES  programs to draw, over all workers     (default 200)
  SSMC_FUZZ_SECONDS   wall-time budget; after it no new program starts, the run stops cleanly
                      and the tally says how many were tried (default: none)
  SSMC_FUZZ_OUT       path of the tally JSON                 (default: not written)
  SSMC_FUZZ_DTYPES    dtypes drawn from, repeats weight them (default cuda: fp32,fp32,fp64,bf16;
                      cpu: fp32,fp32,fp64)
  SSMC_FUZZ_REST      ssmc's rest option: eager (default; Inductor would compile every
                      non-region graph, seconds per program) | inductor | auto
  SSMC_FUZZ_WORKERS   processes to split the programs over (default 1). Compiling is CPU-bound
                      (Dynamo, Triton, NVRTC), so on a GPU machine several workers share one
                      GPU; each has its own kernel cache and hypothesis seed.
  SSMC_FUZZ_SEED      hypothesis seed (default: derandomized, the same programs every run;
                      worker i of a parallel run uses seed + i)
  SSMC_FUZZ_LINEAR    1: only linear programs (the ones that reach a GPU kernel), 0: only
                      non-linear ones (default: both, half each)
  SSMC_FUZZ_POISON    0: kernels' outputs are not pre-filled with NaN (default 1)
  SSMC_FUZZ_MAX_L     longest sequence length drawn (default cuda: 24, cpu: 6, the CPU test's);
                      above 6, half the programs get 7..MAX_L steps, so chunked kernels carry
                      their state across chunks (Dynamo unrolls the loop: longer costs compile time)
  SSMC_FUZZ_ALL_CONFIGS  0: check only the config the Triton autotuner picked (default 1: every
                      candidate config of the region's Triton kernel is launched on the same
                      inputs and must agree with the picked one, which was checked end to end;
                      the autotuner compiled them all already, so this costs launches only)
A program hypothesis draws again (same source, dtype and shapes) is skipped, so `tried` counts
distinct programs.

Run as a script (``python tests/fuzz_harness.py``) or through tests/test_fuzz.py's
``test_gpu_programs``; the script exits 3 when anything went wrong.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fuzz_programs as FP  # noqa: E402
from conftest import as_tuple, ssmc_run  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Base tolerance by the dtype the program computes its state in (bf16 inputs read with
# .float() compute in fp32); the bound used is max(this, 20 x eager's own error).
TOL = {torch.float32: 2e-5, torch.float64: 1e-9, torch.bfloat16: 1e-2}
KINDS = ("ok", "fell_back", "kernel_failed", "wrong", "crashed")
GPU_TARGETS = ("triton", "cuda")
KEEP_FAILURES = 200          # sources kept in the JSON per run (the counts are always complete)
KEEP_FALLBACK_EXAMPLES = 20  # one example program per distinct fallback reason, up to this many
EXIT_FOUND = 3               # the script's exit status when something went wrong (crashes exit 1)
GRACE_S = 60                 # a parallel run: how long past the deadline a worker may take


@dataclasses.dataclass
class Config:
    device: str = "cpu"
    targets: tuple = ("torch",)
    examples: int = 200
    seconds: float | None = None
    out: str | None = None
    dtypes: tuple = ("fp32", "fp32", "fp64")
    rest: str = "eager"
    workers: int = 1
    seed: int | None = None
    shard: str = "0/1"
    linear: bool | None = None      # only linear (True) or non-linear (False) programs; None: both
    poison: bool = True             # kernels' outputs start as NaN (see instrumented)
    all_configs: bool = True        # Triton: every candidate config checked, not only the tuner's pick
    max_len: int = 6                # longest sequence drawn (> 6: half the programs are 7..max_len)

    @classmethod
    def from_env(cls, device: str = "cpu", **overrides) -> "Config":
        env = os.environ.get
        device = env("SSMC_FUZZ_DEVICE") or device
        gpu = device.startswith("cuda")
        cfg = cls(
            device=device,
            targets=_split(env("SSMC_FUZZ_TARGETS")) or (("triton", "cuda", "auto") if gpu else ("torch",)),
            examples=int(env("SSMC_FUZZ_EXAMPLES") or 200),
            seconds=float(env("SSMC_FUZZ_SECONDS")) if env("SSMC_FUZZ_SECONDS") else None,
            out=env("SSMC_FUZZ_OUT") or None,
            dtypes=_split(env("SSMC_FUZZ_DTYPES")) or (("fp32", "fp32", "fp64", "bf16") if gpu
                                                        else ("fp32", "fp32", "fp64")),
            rest=env("SSMC_FUZZ_REST") or "eager",
            workers=int(env("SSMC_FUZZ_WORKERS") or 1),
            seed=int(env("SSMC_FUZZ_SEED")) if env("SSMC_FUZZ_SEED") else None,
            shard=env("SSMC_FUZZ_SHARD") or "0/1",
            linear={"1": True, "0": False}.get(env("SSMC_FUZZ_LINEAR") or ""),
            poison=(env("SSMC_FUZZ_POISON") or "1") != "0",
            all_configs=(env("SSMC_FUZZ_ALL_CONFIGS") or "1") != "0",
            max_len=int(env("SSMC_FUZZ_MAX_L") or (24 if gpu else 6)),
        )
        cfg = dataclasses.replace(cfg, **overrides)
        unknown = [d for d in cfg.dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"SSMC_FUZZ_DTYPES: unknown {unknown}; known {sorted(DTYPES)}")
        return cfg


def _split(v):
    return tuple(s.strip() for s in (v or "").split(",") if s.strip())


# -- one program, one target ----------------------------------------------------------------------

def _finite_rel_err(out, ref, eager) -> tuple[float, str | None]:
    """Relative error of out against ref over the elements where eager is finite; out must be
    non-finite exactly where eager is (NaN and Inf propagate as eager does)."""
    out, ref, eager = out.double(), ref.double(), eager.double()
    fin = torch.isfinite(eager) & torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), torch.isfinite(eager)):
        return float("inf"), "non-finite values where eager has none (or the reverse)"
    o, r = out[fin], ref[fin]
    if r.numel() == 0:
        return 0.0, None
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item(), None


def _classify_region(info, requested: str, device: str) -> tuple[str, str, str]:
    """(kind, reason, ran_on) for a linear program's one region: ok, fell_back or kernel_failed."""
    from ssmc.runtime.op import lookup
    entry = lookup(info.key)
    failed = [n for n in info.notes if "failed to compile" in n]
    declined = []
    if entry.failure:
        failed.append(entry.failure)
    k = entry.kernel
    kernels = dict(getattr(k, "kernels", {}) or {})           # MeasuredChoice (auto): every rival
    kernels = kernels or {entry.target: k}
    for name, e in (getattr(k, "errors", {}) or {}).items():
        failed.append(f"{name} failed while timed: {e}")
    for name, kk in kernels.items():
        fb = getattr(kk, "fallback", None)                     # TritonKernel's run-time refusal
        if fb:
            (failed if fb.startswith("every Triton config failed") else declined).append(f"{name}: {fb}")
    decided = sorted(set(getattr(k, "decided", {}).values()))
    ran_on = "|".join(decided) if decided else entry.target
    if failed:
        return "kernel_failed", "; ".join(failed), ran_on
    if requested == "auto":
        if not (info.target.startswith("auto(") or info.target in GPU_TARGETS):
            why = "; ".join(f"{t}: {w}" for t, w in info.target_reasons.items())
            return "fell_back", why or f"auto chose {info.target} on {device}", ran_on
    elif info.target != requested:
        return "fell_back", f"{requested}: " + info.target_reasons.get(requested, f"ran on {info.target}"), ran_on
    if declined:
        return "fell_back", "; ".join(declined), ran_on
    return "ok", "", ran_on


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str = ""
    reason: str = ""          # fell_back / kernel_failed: why
    ran_on: str = ""
    seconds: float = 0.0
    configs: int = 0          # extra Triton configs launched and compared


def check_run(prog, inputs, ref, eager, target: str, cfg: Config) -> Outcome:
    """Compile `prog` with ssmc for `target` on fresh Dynamo state, run it once, classify."""
    fn = prog.fn()
    t0 = time.perf_counter()
    # auto: no recording, whose copies would slow Triton down in auto's timing of the targets
    _RECORD["on"] = cfg.all_configs and target != "auto"
    try:
        out, rep = ssmc_run(fn, inputs, target=target, rest=cfg.rest)
        out = as_tuple(out)
        if cfg.device.startswith("cuda"):
            torch.cuda.synchronize()
    except Exception:
        return Outcome("crashed", traceback.format_exc(limit=-8), seconds=time.perf_counter() - t0)
    finally:
        _RECORD["on"] = False
    secs = time.perf_counter() - t0
    problems = []
    if prog.linear and len(rep.regions) != 1:
        problems.append(f"{len(rep.regions)} regions for a linear program; fallbacks: {rep.fallbacks}")
    if not prog.linear and rep.regions:
        problems.append(f"a non-linear program was compiled into {len(rep.regions)} region(s)")
    if len(out) != len(ref):
        problems.append(f"{len(out)} outputs, eager gives {len(ref)}")
    tdt = prog.state_dtype or prog.dtype
    for i, (o, r, e) in enumerate(zip(out, ref, eager)):
        if o.shape != r.shape or o.dtype != e.dtype or o.device != e.device:
            problems.append(f"output {i}: {tuple(o.shape)} {o.dtype} on {o.device}, eager gives "
                            f"{tuple(e.shape)} {e.dtype} on {e.device}")
            continue
        eager_err, _ = _finite_rel_err(e, r, e)
        tol = max(TOL[tdt], 20 * eager_err)
        err, why = _finite_rel_err(o, r, e)
        if why or not err <= tol:
            problems.append(f"output {i}: {why or f'rel err {err:.3g} > tol {tol:.3g}'} "
                            f"(eager's own error {eager_err:.3g})")
    if problems:
        return Outcome("wrong", "\n".join(problems) + "\n" + _report_text(rep), seconds=secs)
    if not prog.linear:
        return Outcome("ok", seconds=secs)
    kind, reason, ran_on = _classify_region(rep.regions[0], target, cfg.device)
    configs = 0
    if kind == "ok" and cfg.all_configs and target != "auto":     # auto: the triton run checks them
        configs, problems = _check_configs(rep.regions[0])
        if problems:
            return Outcome("wrong", "\n".join(problems) + "\n" + _report_text(rep), ran_on=ran_on,
                           seconds=time.perf_counter() - t0, configs=configs)
    return Outcome(kind, reason=reason, ran_on=ran_on, seconds=secs, configs=configs)


def _check_configs(info) -> tuple[int, list]:
    """Every candidate config of the region's Triton kernel(s), launched on the inputs of the
    call just checked, against that call's outputs (the picked config's, right end to end).
    Returns (configs launched, problems)."""
    from ssmc.runtime.op import lookup
    from ssmc.targets.triton import TritonKernel, _arch
    k = lookup(info.key).kernel
    n, problems = 0, []
    for kk in (getattr(k, "kernels", None) or {"": k}).values():
        call = getattr(kk, "_fuzz_call", None)
        if not isinstance(kk, TritonKernel) or call is None or kk.fallback or kk.config is None:
            continue
        ins, want = call
        kk._fuzz_call = None
        arch = _arch(ins[0].device) if ins[0].device.type == "cuda" else None
        for c in kk.candidates(ins, arch):
            if c == kk.config:
                continue
            n += 1
            try:
                got = kk.launch(ins, c)
                if ins[0].device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:
                problems.append(f"Triton config {c} (picked {kk.config}) failed: {type(e).__name__}: {e}")
                continue
            for i, (g, w) in enumerate(zip(got, want)):
                err, why = _finite_rel_err(g, w, w)
                tol = TOL.get(w.dtype, 2e-5)
                if why or not err <= tol:
                    problems.append(f"Triton config {c}: output {i} {why or f'rel err {err:.3g} > {tol:.3g}'} "
                                    f"against the picked config {kk.config}")
    return n, problems


def _report_text(rep, limit: int = 4000) -> str:
    try:
        s = str(rep)
    except Exception as e:       # the report must not hide the failure
        s = f"(report unprintable: {e})"
    return s[:limit]


# -- the tally ------------------------------------------------------------------------------------

def _target_tally():
    return {"tried": 0, "linear": 0, "nonlinear": 0, **{k: 0 for k in KINDS},
            "configs_checked": 0, "ran_on": {}, "fell_back_reasons": {}, "seconds": 0.0}


class Tally:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.programs = Counter()       # tried, linear, nonlinear
        self.by_dtype, self.by_form = Counter(), Counter()
        self.per_target = {t: _target_tally() for t in cfg.targets}
        self.failures: list = []
        self.fallback_examples: dict = {}
        self.stopped_by_deadline = False
        self.aborted: str | None = None

    def program(self, prog):
        self.programs["tried"] += 1
        self.programs["linear" if prog.linear else "nonlinear"] += 1
        dt = DTYPE_NAMES[prog.dtype] + ("->fp32" if prog.state_dtype else "")
        self.by_dtype[dt] += 1
        self.by_form[prog.form] += 1

    def run(self, prog, seed, target, o: Outcome):
        t = self.per_target[target]
        t["tried"] += 1
        t["linear" if prog.linear else "nonlinear"] += 1
        t[o.kind] += 1
        t["seconds"] += o.seconds
        t["configs_checked"] += o.configs
        if o.ran_on:
            t["ran_on"][o.ran_on] = t["ran_on"].get(o.ran_on, 0) + 1
        rec = {"target": target, "kind": o.kind, "linear": prog.linear, "form": prog.form,
               "dtype": DTYPE_NAMES[prog.dtype],
               "state_dtype": DTYPE_NAMES[prog.state_dtype] if prog.state_dtype else None,
               "L": prog.L, "seed": seed, "shapes": {k: list(v) for k, v in prog.shapes.items()},
               "source": prog.source}
        if o.kind == "fell_back":
            key = o.reason[:160]
            t["fell_back_reasons"][key] = t["fell_back_reasons"].get(key, 0) + 1
            if key not in self.fallback_examples and len(self.fallback_examples) < KEEP_FALLBACK_EXAMPLES:
                self.fallback_examples[key] = {**rec, "reason": o.reason}
        elif o.kind != "ok" and len(self.failures) < KEEP_FAILURES:
            self.failures.append({**rec, "reason": o.reason, "detail": o.detail[-6000:]})

    def as_dict(self) -> dict:
        runs = {k: sum(t[k] for t in self.per_target.values()) for k in ("tried",) + KINDS}
        elapsed = time.monotonic() - self.t0
        dev = self.cfg.device
        name = torch.cuda.get_device_name() if dev.startswith("cuda") and torch.cuda.is_available() else dev
        return {
            "_doc": "tried/linear/nonlinear count programs; runs = program x target runs (a non-linear "
                    "program runs once); ok/fell_back/kernel_failed/wrong/crashed count runs; "
                    "see tests/fuzz_harness.py",
            "device": dev, "device_name": name, "targets": list(self.cfg.targets),
            "dtypes": list(self.cfg.dtypes), "max_len": self.cfg.max_len, "rest": self.cfg.rest,
            "seed": self.cfg.seed, "poison": self.cfg.poison, "all_configs": self.cfg.all_configs,
            "shard": self.cfg.shard, "workers": self.cfg.workers,
            "examples_requested": self.cfg.examples, "seconds_limit": self.cfg.seconds,
            "stopped_by_deadline": self.stopped_by_deadline, "aborted": self.aborted,
            "elapsed_s": round(elapsed, 2),
            "seconds_per_program": round(elapsed / self.programs["tried"], 3) if self.programs["tried"] else None,
            "tried": self.programs["tried"], "linear": self.programs["linear"],
            "nonlinear": self.programs["nonlinear"], "distinct_programs": self.programs["tried"],
            "runs": runs["tried"], **{k: runs[k] for k in KINDS},
            "by_dtype": dict(self.by_dtype), "by_form": dict(self.by_form),
            "per_target": self.per_target,
            "failures": self.failures,
            "fallback_examples": list(self.fallback_examples.values()),
            "versions": _versions(),
        }


def _versions() -> dict:
    import ssmc
    v = {"torch": torch.__version__, "python": sys.version.split()[0],
         "ssmc": os.path.dirname(os.path.abspath(ssmc.__file__))}
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:
        pass
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v


def summary_line(d: dict) -> str:
    per = "; ".join(f"{t}: " + ", ".join(f"{d['per_target'][t][k]} {k}" for k in KINDS if d['per_target'][t][k])
                    for t in d["targets"] if d["per_target"][t]["tried"])
    stop = " (stopped at the time limit)" if d["stopped_by_deadline"] else ""
    return (f"ssmc fuzz on {d['device']}: {d['tried']} programs tried{stop} ({d['linear']} linear, "
            f"{d['nonlinear']} not), {d['runs']} runs: {d['wrong']} wrong, "
            f"{d['crashed']} crashed, {d['kernel_failed']} kernel failed, {d['fell_back']} fell back "
            f"[{per}] in {d['elapsed_s']:.0f} s")


def bad(d: dict) -> int:
    return d["wrong"] + d["crashed"] + d["kernel_failed"] + len(d.get("worker_errors", [])) + bool(d.get("aborted"))


# -- driving hypothesis ---------------------------------------------------------------------------

class _Stop(Exception):
    """Raised from the test body to end hypothesis's loop early (enough programs, time up)."""


def _key(prog) -> str:
    raw = repr((prog.source, str(prog.dtype), str(prog.state_dtype), sorted(prog.shapes.items())))
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def run_fuzz(cfg: Config, progress=None) -> dict:
    """Run up to cfg.examples distinct programs (fewer if cfg.seconds runs out; a program
    hypothesis draws a second time is skipped) through every target, in this process. Never
    raises for a failing program: the tally has it."""
    tally = Tally(cfg)
    deadline = None if cfg.seconds is None else time.monotonic() + cfg.seconds
    if os.environ.get("SSMC_FUZZ_DEADLINE"):     # a parallel run's end, the same for every worker
        left = float(os.environ["SSMC_FUZZ_DEADLINE"]) - time.time()
        deadline = min(deadline or math.inf, time.monotonic() + left)
    dtypes = [DTYPES[d] for d in cfg.dtypes]
    state = {"n": 0, "seen": set(), "drawn": 0}

    def snapshot() -> dict:
        d = tally.as_dict()
        d["drawn"] = state["drawn"]
        d["keys"] = sorted(state["seen"])        # for merging workers' distinct counts
        return d

    def body(prog, seed):
        if tally.stopped_by_deadline or tally.aborted or tally.programs["tried"] >= cfg.examples:
            raise _Stop()
        if deadline is not None and time.monotonic() > deadline:
            tally.stopped_by_deadline = True
            raise _Stop()
        state["drawn"] += 1
        key = _key(prog)
        if key in state["seen"]:
            return
        state["seen"].add(key)
        tally.program(prog)
        inputs = prog.make(seed, cfg.device)
        try:
            ref = as_tuple(prog.ref_fn()(*[x.double() for x in inputs]))
            eager = as_tuple(prog.fn()(*inputs))
        except Exception:        # a generator bug: the program does not even run eagerly
            o = Outcome("crashed", "eager run failed:\n" + traceback.format_exc(limit=-8))
            tally.run(prog, seed, cfg.targets[0], o)
            return
        if prog.linear:
            targets = cfg.targets
        else:
            targets = (cfg.targets[state["n"] % len(cfg.targets)],)
            state["n"] += 1
        for target in targets:
            o = check_run(prog, inputs, ref, eager, target, cfg)
            tally.run(prog, seed, target, o)
            if o.kind == "crashed" and _device_lost(o.detail):
                tally.aborted = f"the device is unusable after a crash, stopped: {o.detail.strip().splitlines()[-1]}"
                return
        if cfg.out and tally.programs["tried"] % 10 == 0:     # a killed worker's work still counts
            write_json(cfg.out, snapshot())
        if progress and tally.programs["tried"] % 50 == 0:
            progress(summary_line(tally.as_dict()))

    test = settings(max_examples=4 * max(1, cfg.examples) + 10, deadline=None, database=None,
                    derandomize=cfg.seed is None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))(
        given(FP.programs(linear=cfg.linear, dtypes=dtypes, max_len=cfg.max_len), st.integers(0, 2 ** 16))(body))
    if cfg.seed is not None:
        test = hypothesis_seed(cfg.seed)(test)
    with instrumented(cfg.poison):
        try:
            test()
        except _Stop:
            pass
    d = snapshot()
    if cfg.out:
        write_json(cfg.out, d)
    d.pop("keys")
    return d


_RECORD = {"on": False}      # check_run sets it: Triton kernels keep their last call


@contextlib.contextmanager
def instrumented(poison: bool = True):
    """Triton kernels keep their last forward call's inputs and outputs (for _check_configs);
    with `poison`, outputs the Triton and CUDA kernels allocate start as NaN: an element a
    kernel does not write shows up as wrong instead of as stale memory."""
    import ssmc.targets.cuda as C
    import ssmc.targets.triton as T
    t_orig, c_orig, f_orig = T.TritonKernel.outputs, C.CudaKernel._outputs_from, T.TritonKernel.forward

    def forward(self, inputs):
        outs = f_orig(self, inputs)
        if _RECORD["on"]:
            self._fuzz_call = (list(inputs), [o.clone() for o in outs])
        return outs

    def nan(o):
        return o.fill_(float("nan")) if o.is_floating_point() else o

    def t_out(self, inputs):
        return [nan(o) for o in t_orig(self, inputs)]

    def c_out(self, shapes, dev, meta=False):
        outs = c_orig(self, shapes, dev, meta)
        return outs if meta else [nan(o) for o in outs]
    T.TritonKernel.forward = forward
    if poison:
        T.TritonKernel.outputs, C.CudaKernel._outputs_from = t_out, c_out
    try:
        yield
    finally:
        T.TritonKernel.outputs, C.CudaKernel._outputs_from, T.TritonKernel.forward = t_orig, c_orig, f_orig


def _device_lost(detail: str) -> bool:
    return any(s in detail for s in ("illegal memory access", "CUDA error: unspecified launch failure",
                                     "device-side assert", "CUDA error: an illegal instruction"))


def write_json(path: str, d: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(d, f, indent=1, default=str)


# -- several worker processes ---------------------------------------------------------------------

def run_parallel(cfg: Config, progress=None) -> dict:
    """cfg.workers processes of this file, each drawing its share of cfg.examples with its own
    hypothesis seed and kernel cache; their tallies merged."""
    n = max(1, cfg.workers)
    base = cfg.seed or 0
    tmp = tempfile.mkdtemp(prefix="ssmc_fuzz_")
    gpus = torch.cuda.device_count() if cfg.device.startswith("cuda") else 0
    procs = []
    t0 = time.monotonic()
    import ssmc                                  # the workers import the same ssmc as this process
    root = os.path.dirname(os.path.dirname(os.path.abspath(ssmc.__file__)))
    pypath = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    end = None if cfg.seconds is None else time.time() + cfg.seconds
    for i in range(n):
        env = dict(os.environ,
                   SSMC_FUZZ_DEVICE=cfg.device, SSMC_FUZZ_TARGETS=",".join(cfg.targets),
                   SSMC_FUZZ_EXAMPLES=str(cfg.examples // n + (i < cfg.examples % n)),
                   SSMC_FUZZ_DTYPES=",".join(cfg.dtypes), SSMC_FUZZ_REST=cfg.rest,
                   SSMC_FUZZ_WORKERS="1", SSMC_FUZZ_SEED=str(base + i), SSMC_FUZZ_SHARD=f"{i}/{n}",
                   SSMC_FUZZ_OUT=os.path.join(tmp, f"part{i}.json"),
                   SSMC_CACHE_DIR=os.path.join(tmp, f"cache{i}"),
                   SSMC_FUZZ_LINEAR={True: "1", False: "0", None: ""}[cfg.linear],
                   SSMC_FUZZ_POISON="1" if cfg.poison else "0",
                   SSMC_FUZZ_ALL_CONFIGS="1" if cfg.all_configs else "0",
                   SSMC_FUZZ_MAX_L=str(cfg.max_len),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=pypath)
        env.pop("SSMC_FUZZ_SECONDS", None)
        env.pop("SSMC_FUZZ_DEADLINE", None)
        if end is not None:
            env["SSMC_FUZZ_DEADLINE"] = repr(end)
        if gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        log = open(os.path.join(tmp, f"worker{i}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    # a worker starts no program after the deadline; the one in flight gets GRACE_S to finish
    limit = None if cfg.seconds is None else cfg.seconds + GRACE_S
    try:
        for p, log in procs:
            try:
                p.wait(timeout=None if limit is None else max(1.0, limit - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:                                     # interrupted: no worker outlives this process
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    parts, errors = [], []
    for i, (p, _) in enumerate(procs):
        path = os.path.join(tmp, f"part{i}.json")
        if os.path.exists(path):
            with open(path) as f:
                parts.append(json.load(f))
        if p.returncode not in (0, EXIT_FOUND):
            with open(os.path.join(tmp, f"worker{i}.log")) as f:
                errors.append(f"worker {i} exited {p.returncode} ({'a partial tally is counted' if os.path.exists(path) else 'no tally'}): "
                              f"...{f.read()[-3000:]}")
    d = merge(cfg, parts, errors, time.monotonic() - t0)
    shutil.rmtree(tmp, ignore_errors=True)       # the workers' kernel caches; logs are in `errors`
    if cfg.out:
        write_json(cfg.out, d)
    return d


def merge(cfg: Config, parts: list, errors: list, elapsed: float) -> dict:
    d = Tally(cfg).as_dict()
    d.update(workers=cfg.workers, shard=f"merged {len(parts)}/{cfg.workers}", worker_errors=errors,
             elapsed_s=round(elapsed, 2), worker_seeds=[p["seed"] for p in parts],
             aborted="; ".join(p["aborted"] for p in parts if p.get("aborted")) or None,
             stopped_by_deadline=any(p["stopped_by_deadline"] for p in parts))
    for k in ("tried", "linear", "nonlinear", "runs") + KINDS:
        d[k] = sum(p[k] for p in parts)
    d["distinct_programs"] = len(set(k for p in parts for k in p.get("keys", [])))   # workers may share some
    d["drawn"] = sum(p.get("drawn", 0) for p in parts)
    for key in ("by_dtype", "by_form"):
        c = Counter()
        for p in parts:
            c.update(p[key])
        d[key] = dict(c)
    for t, agg in d["per_target"].items():
        for p in parts:
            pt = p["per_target"].get(t, {})
            for k, v in pt.items():
                if isinstance(v, dict):
                    for kk, vv in v.items():
                        agg[k][kk] = agg[k].get(kk, 0) + vv
                else:
                    agg[k] += v
    d["failures"] = [f for p in parts for f in p["failures"]][:KEEP_FAILURES]
    seen = {}
    for p in parts:
        for f in p["fallback_examples"]:
            seen.setdefault(f["reason"][:160], f)
    d["fallback_examples"] = list(seen.values())[:KEEP_FALLBACK_EXAMPLES]
    d["seconds_per_program"] = round(elapsed / d["tried"], 3) if d["tried"] else None
    return d


def main(cfg: Config | None = None, progress=None) -> dict:
    cfg = cfg or Config.from_env()
    if cfg.workers > 1:
        return run_parallel(cfg, progress)
    return run_fuzz(cfg, progress)


if __name__ == "__main__":
    res = main(progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(summary_line(res), flush=True)
    for f in res["failures"][:5]:
        print(f"--- {f['kind']} on {f['target']} ({f['dtype']}, {f['form']}, seed {f['seed']}):\n"
              f"{f['source']}\n{f['reason'] or f['detail'][:1500]}", flush=True)
    sys.exit(EXIT_FOUND if bad(res) else 0)
