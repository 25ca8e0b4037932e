"""Property-based fuzzing: random naive recurrent programs through ssmc.

Linear ones must compile to one region and match float64 eager; non-linear ones must be left
alone (no region) and run unchanged; nothing may crash. SSMC_FUZZ_EXAMPLES sets how many
programs (default 200 here; the GPU run uses thousands). The tally is printed at the end.
"""
import os
import traceback

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
