"""Property-based fuzzing: random naive recurrent programs through ssmc.

Linear ones must compile to one region and match float64 eager; non-linear ones must be left
alone (no region) and run unchanged; nothing may crash. SSMC_FUZZ_EXAMPLES sets how many
programs (default 200 here; the GPU run uses thousands). The tally is printed at the end.

`test_random_programs` is the CI run on CPU (stops at the first failure and shrinks it).
`test_gpu_programs` is the long run on a GPU (tests/fuzz_harness.py: the same programs on CUDA
tensors through targets triton, cuda and auto, every run tallied to JSON, env-configured):

    SSMC_FUZZ_EXAMPLES=2000 SSMC_FUZZ_SECONDS=220 SSMC_FUZZ_WORKERS=12 SSMC_FUZZ_OUT=fuzz.json \
        python -m pytest -q -m gpu tests/test_fuzz.py -k gpu_programs

The `harness` tests run that same code on CPU (target torch, cuda declining, the Triton
interpreter) and check that its JSON counts, and that a wrong or crashing kernel is counted.
"""
import dataclasses
import json
import os
import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz_harness as H
import fuzz_programs as FP
from conftest import as_tuple, rel_err, ssmc_run

N = int(os.environ.get("SSMC_FUZZ_EXAMPLES", "200"))
TALLY = {"tried": 0, "linear": 0, "nonlinear": 0, "wrong": 0, "crashed": 0}
FAILURES: list[str] = []
TOL = {torch.float32: 2e-5, torch.float64: 1e-9}


@settings(max_examples=N, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(FP.programs(), st.integers(0, 2 ** 16))
def test_random_programs(prog, seed):
    TALLY["tried"] += 1
    TALLY["linear" if prog.linear else "nonlinear"] += 1
    fn = prog.fn()
    ins = prog.make(seed)
    ref = as_tuple(fn(*[x.double() for x in ins]))
    eager = as_tuple(fn(*ins))
    try:
        out, rep = ssmc_run(fn, ins)
    except Exception:
        TALLY["crashed"] += 1
        FAILURES.append(prog.source + "\n" + traceback.format_exc())
        raise
    out = as_tuple(out)
    try:
        if prog.linear:
            assert len(rep.regions) == 1, f"no region for a linear program:\n{rep}"
        else:
            assert not rep.regions, f"a non-linear program was compiled:\n{rep}"
        for o, r, e in zip(out, ref, eager):
            assert o.shape == r.shape and o.dtype == e.dtype
            tol = max(TOL[prog.dtype], 20 * rel_err(e, r))
            assert rel_err(o, r) <= tol, f"rel err {rel_err(o, r):.3g} > {tol:.3g}"
    except AssertionError:
        TALLY["wrong"] += 1
        FAILURES.append(prog.source)
        raise


# -- the GPU run ----------------------------------------------------------------------------------

GPU_RESULT: dict = {}


@pytest.mark.gpu
def test_gpu_programs(tmp_path, monkeypatch):
    """Thousands of programs on the GPU through the real targets (env: see fuzz_harness.py;
    defaults here: device cuda, targets triton,cuda,auto, 200 programs, at most 300 s)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not os.environ.get("SSMC_CACHE_DIR"):
        monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path / "cache"))
    cfg = H.Config.from_env(device="cuda")
    if cfg.seconds is None:
        cfg = dataclasses.replace(cfg, seconds=300.0)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=str(tmp_path / "fuzz_gpu.json"))
    d = H.main(cfg, progress=print)
    GPU_RESULT.update(d)
    print(H.summary_line(d))
    assert d["tried"] > 0, d
    for t in cfg.targets:              # a target that declined everything would pass vacuously
        pt = d["per_target"][t]
        if t in H.GPU_TARGETS + ("auto",) and pt["linear"] >= 10:
            assert pt["ok"] > 0, f"target {t} ran no region itself: {pt['fell_back_reasons']}"
    assert H.bad(d) == 0, H.summary_line(d) + "\n" + _failures_text(d)


def _failures_text(d, n=5) -> str:
    return "\n".join(f"--- {f['kind']} on {f['target']} ({f['dtype']}, {f['form']}, seed {f['seed']}):\n"
                     f"{f['source']}\n{f['reason']}\n{f['detail'][-2000:]}" for f in d["failures"][:n]) + \
        "".join(f"\n{e}" for e in d.get("worker_errors", []))


# -- the same code on CPU -------------------------------------------------------------------------

def _cpu_cfg(tmp_path, **kw) -> "H.Config":
    base = dict(device="cpu", targets=("torch",), examples=6, seconds=None, out=str(tmp_path / "fuzz.json"),
                dtypes=("fp32", "fp64"), rest="eager", workers=1, seed=None, linear=None, poison=True)
    return H.Config(**{**base, **kw})


def test_harness_tally_json(tmp_path, monkeypatch):
    """device cpu, targets torch, cuda (declines on CPU: counted as fell back, with the reason)
    and auto; bf16 programs included: the JSON has every count and they add up."""
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path / "cache"))
    cfg = _cpu_cfg(tmp_path, targets=("torch", "cuda", "auto"), examples=8, dtypes=("fp32", "fp64", "bf16"))
    ret = H.main(cfg)
    d = json.loads((tmp_path / "fuzz.json").read_text())
    assert d["tried"] == ret["tried"] == 8 and d["distinct_programs"] == 8
    assert d["linear"] > 0 and d["nonlinear"] > 0 and d["linear"] + d["nonlinear"] == 8
    assert d["runs"] == 3 * d["linear"] + d["nonlinear"]
    assert (d["wrong"], d["crashed"], d["kernel_failed"]) == (0, 0, 0), H.summary_line(d) + _failures_text(d)
    assert d["failures"] == [] and H.bad(d) == 0
    assert sum(d[k] for k in H.KINDS) == d["runs"]
    pt = d["per_target"]
    assert pt["torch"]["ok"] == pt["torch"]["tried"]
    assert pt["torch"]["ran_on"] == {"torch": pt["torch"]["linear"]}
    assert pt["cuda"]["fell_back"] == pt["cuda"]["linear"] > 0
    assert list(pt["cuda"]["fell_back_reasons"]) == ["cuda: runs on CUDA devices only (the graph is on cpu)"]
    assert pt["auto"]["fell_back"] == pt["auto"]["linear"]
    assert sum(t["nonlinear"] for t in pt.values()) == d["nonlinear"]
    assert {f["target"] for f in d["fallback_examples"]} == {"cuda", "auto"}
    assert all("def program(" in f["source"] and f["reason"] for f in d["fallback_examples"])
    assert sum(d["by_dtype"].values()) == 8 and d["stopped_by_deadline"] is False


@pytest.mark.parametrize("fault", ["wrong", "crashed"])
def test_harness_counts_a_bad_kernel(fault, tmp_path, monkeypatch):
    """A kernel that perturbs its output (or raises) is counted as wrong (crashed), with the
    program's source in the JSON; non-linear programs (no kernel) stay ok."""
    from ssmc.targets.reference import ReferenceKernel
    orig = ReferenceKernel.forward

    def bad_forward(self, inputs):
        if fault == "crashed":
            raise RuntimeError("injected kernel fault")
        return [o * (1 + 1e-3) + 1e-3 for o in orig(self, inputs)]
    monkeypatch.setattr(ReferenceKernel, "forward", bad_forward)
    d = H.main(_cpu_cfg(tmp_path, examples=5))
    assert json.loads((tmp_path / "fuzz.json").read_text())[fault] == d[fault]
    assert d["linear"] > 0 and d[fault] == d["linear"] and d["ok"] == d["nonlinear"]
    assert H.bad(d) == d["linear"] and len(d["failures"]) == d["linear"]
    f = d["failures"][0]
    assert f["kind"] == fault and f["target"] == "torch" and "def program(" in f["source"]
    assert ("rel err" in f["detail"]) if fault == "wrong" else ("injected kernel fault" in f["detail"])


def test_harness_config_from_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SSMC_FUZZ_"):
            monkeypatch.delenv(k)
    c = H.Config.from_env(device="cuda")
    assert c.targets == ("triton", "cuda", "auto") and "bf16" in c.dtypes and c.max_len > 6
    assert c.seconds is None and c.workers == 1 and c.examples == 200 and c.rest == "eager"
    assert H.Config.from_env().targets == ("torch",) and H.Config.from_env().max_len == 6
    for k, v in dict(SSMC_FUZZ_DEVICE="cuda", SSMC_FUZZ_TARGETS="triton, cuda", SSMC_FUZZ_EXAMPLES="2000",
                     SSMC_FUZZ_SECONDS="220", SSMC_FUZZ_OUT="/x/y.json", SSMC_FUZZ_DTYPES="bf16",
                     SSMC_FUZZ_WORKERS="12", SSMC_FUZZ_SEED="7", SSMC_FUZZ_LINEAR="1",
                     SSMC_FUZZ_MAX_L="32").items():
        monkeypatch.setenv(k, v)
    c = H.Config.from_env()
    assert (c.device, c.targets, c.examples, c.seconds, c.out, c.dtypes, c.workers, c.seed, c.linear,
            c.max_len) == ("cuda", ("triton", "cuda"), 2000, 220.0, "/x/y.json", ("bf16",), 12, 7, True, 32)
    monkeypatch.setenv("SSMC_FUZZ_DTYPES", "int8")
    with pytest.raises(ValueError, match="int8"):
        H.Config.from_env()


def test_harness_deadline_stops_cleanly(tmp_path):
    d = H.main(_cpu_cfg(tmp_path, examples=50, seconds=0.0))
    assert d["stopped_by_deadline"] and d["tried"] == 0 and d["runs"] == 0
    assert json.loads((tmp_path / "fuzz.json").read_text())["stopped_by_deadline"]


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "bad_unpicked_config"])
def test_harness_triton_interpreter(fault, tmp_path, monkeypatch):
    """The Triton target itself (its kernels under TRITON_INTERPRET=1, outputs poisoned with
    NaN): three linear programs (seed 1's draws, whose kernels have candidate configs besides
    the pick) run on triton and are ok, every candidate config checked. A config the autotuner did not pick that
    computes garbage makes its program wrong (the end-to-end result alone would not show it)."""
    pytest.importorskip("triton")
    import ssmc.targets.triton as T
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path / "cache"))
    if fault:
        orig = T.TritonKernel.launch

        def launch(self, inputs, config, outs=None):      # garbage from a config not picked
            got = orig(self, inputs, config, outs)
            return [o.add_(0.5) for o in got] if self.config not in (None, config) else got
        monkeypatch.setattr(T.TritonKernel, "launch", launch)
    d = H.main(_cpu_cfg(tmp_path, targets=("triton",), examples=3, linear=True, max_len=12, seed=1))
    assert d["tried"] == d["linear"] == 3, d
    pt = d["per_target"]["triton"]
    assert pt["configs_checked"] >= 1 and pt["ran_on"].get("triton", 0) == 3, pt
    if fault:
        assert pt["wrong"] >= 1 and pt["ok"] + pt["wrong"] == 3, pt
        assert all("against the picked config" in f["detail"] and "def program(" in f["source"]
                   for f in d["failures"])
        return
    assert H.bad(d) == 0, _failures_text(d)
    assert pt["ok"] == 3


def test_harness_merges_workers(tmp_path):
    """What a parallel run does with its workers' tallies (run_parallel spawns them; here two
    in-process runs with different seeds stand in for them)."""
    parts = []
    for i in range(2):
        out = tmp_path / f"part{i}.json"
        H.main(_cpu_cfg(tmp_path, examples=2, seed=i, out=str(out), shard=f"{i}/2"))
        parts.append(json.loads(out.read_text()))
    d = H.merge(_cpu_cfg(tmp_path, workers=2), parts, [], 1.0)
    assert d["tried"] == 4 and d["worker_seeds"] == [0, 1] and d["worker_errors"] == []
    assert d["per_target"]["torch"]["tried"] == sum(p["per_target"]["torch"]["tried"] for p in parts)
    assert d["ok"] == d["runs"] == sum(p["runs"] for p in parts) and H.bad(d) == 0
    assert 1 <= d["distinct_programs"] <= 4
    assert H.bad(H.merge(_cpu_cfg(tmp_path, workers=2), parts, ["worker 1 exited -9"], 1.0)) == 1
