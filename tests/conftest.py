import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import ssmc  # noqa: E402


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def ssmc_run(fn, inputs, **options):
    """Compile fn with ssmc (fresh Dynamo state) and run it once; returns (outputs, report)."""
    report = ssmc.Report()

    def backend(gm, ex):
        return ssmc.ssmc_backend(gm, ex, options=options, _report=report)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(*inputs)
    return out, report


def compile_per_call(fn, calls, **options):
    """fn compiled once with ssmc (options as torch.compile's) and called with each argument
    tuple in turn (Dynamo recompiles where a call needs it): the outputs and every graph's
    report."""
    reports = []

    def backend(gm, ex):
        rep = ssmc.Report()
        reports.append(rep)
        return ssmc.ssmc_backend(gm, ex, options=options, _report=rep)
    torch._dynamo.reset()
    f = torch.compile(fn, backend=backend)
    return [f(*args) for args in calls], reports


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference(fn, inputs):
    return as_tuple(fn(*[x.double() if x.is_floating_point() else x for x in inputs]))


def writes_states(region) -> bool:
    """Whether some output of the region (its IR) has time and every state axis: the region
    writes all its states."""
    return any("t" in o.index and all(ax in o.index for ax in region.axes) for o in region.outputs)


TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 1e-2}


def grads_match(fn, inputs, tol: float = 1e-5, **options) -> None:
    """The gradients of the outputs' sum through ssmc (compiled with `options`) equal float64
    eager's, input by input, shapes too (the same inputs unused in both); at least one input
    gets a gradient."""
    xs = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = as_tuple(ssmc_run(fn, xs, **options)[0])
    x64 = [x.double().requires_grad_() if x.is_floating_point() else x for x in inputs]
    ref = as_tuple(fn(*x64))
    diff = [i for i, x in enumerate(xs) if x.is_floating_point()]
    got = torch.autograd.grad(sum(o.sum() for o in out if o is not None), [xs[i] for i in diff], allow_unused=True)
    want = torch.autograd.grad(sum(r.sum() for r in ref if r is not None), [x64[i] for i in diff], allow_unused=True)
    assert any(w is not None for w in want)
    for i, a, b in zip(diff, got, want):
        assert (a is None) == (b is None), f"input {i}: gradient {'missing' if a is None else 'unexpected'}"
        assert b is None or (a.shape == b.shape and rel_err(a, b) < tol), \
            f"input {i}: shape {tuple(a.shape)} against {tuple(b.shape)}, rel err {rel_err(a, b):.3g}"


def declined(fn, inputs, why: str, untouched: bool = False):
    """Compile fn with ssmc: no region, a fallback whose reason contains `why`, the outputs equal
    to float64 eager (and with `untouched`, the graph left as Dynamo captured it: stand-ins and
    helper nodes made for the loop erased). Returns the report."""
    out, rep = ssmc_run(fn, inputs)
    assert not rep.regions and any(why in w for _, w in rep.fallbacks), str(rep)
    if untouched:
        assert all(g.nodes_out == g.nodes_in for g in rep.graphs), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, inputs)):
        assert rel_err(o, r) < 1e-6, str(rep)
    return rep


@pytest.fixture
def run():
    return ssmc_run


def pytest_terminal_summary(terminalreporter):
    try:
        import test_fuzz
    except ImportError:
        return
    if test_fuzz.TALLY["tried"]:
        t = test_fuzz.TALLY
        terminalreporter.write_line(
            f"ssmc fuzz: {t['tried']} programs tried ({t['linear']} linear, {t['nonlinear']} not), "
            f"{t['wrong']} wrong, {t['crashed']} crashed")
    if test_fuzz.GPU_RESULT:
        import fuzz_harness
        terminalreporter.write_line(fuzz_harness.summary_line(test_fuzz.GPU_RESULT))
