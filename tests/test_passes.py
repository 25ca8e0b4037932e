"""Structural tests, one or more per pass: what each pass leaves, and switching passes off."""
import re

import pytest
import torch

import programs as P
import ssmc
from conftest import TOL, rel_err, reference, ssmc_run
from ssmc.ir import Const, Load, Op, Reduce, State


def two_layer(x, a1, a2):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = a1[:, t] * h + x[:, t]
        ys.append(h)
    y = torch.stack(ys, 1)
    g = torch.zeros_like(x[:, 0])
    zs = []
    for t in range(x.shape[1]):
        g = a2[:, t] * g + y[:, t]
        zs.append(g)
    return torch.stack(zs, 1)


def test_reroll_finds_each_loop_once():
    ins = (torch.randn(2, 6, 3), torch.rand(2, 6, 3), torch.rand(2, 6, 3))
    out, rep = ssmc_run(two_layer, ins)
    assert [r.name for r in rep.regions] == ["loop0", "loop1"]
    loop = rep.regions[0].loop
    assert "6 steps" in loop and "carry_0" in loop and "read_0" in loop
    assert rel_err(out, reference(two_layer, ins)[0]) < TOL[torch.float32]
    # the rewritten graph has no unrolled step left: 2 region calls and a handful of nodes
    assert rep.graphs[0].nodes_out < 20 < rep.graphs[0].nodes_in


def residual_layers(x, a1, a2):
    """The second loop reads the first's output through elementwise work (a residual add, a
    gate): the first may pull that work as its epilogue, the second must not also take it as
    its prologue (it would read a tensor the first region replaces)."""
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = a1[:, t] * h + x[:, t]
        ys.append(h)
    y = torch.stack(ys, 1)
    x1 = x + 0.5 * y
    g = torch.zeros_like(x[:, 0])
    zs = []
    for t in range(x.shape[1]):
        g = a2[:, t] * g + x1[:, t]
        zs.append(g)
    return torch.stack(zs, 1)


def test_loop_fed_by_elementwise_work_on_another_loop():
    ins = (torch.randn(2, 6, 3), torch.rand(2, 6, 3), torch.rand(2, 6, 3))
    out, rep = ssmc_run(residual_layers, ins)
    assert not rep.graphs[0].fallbacks, rep.graphs[0].fallbacks
    assert [r.name for r in rep.regions] == ["loop0", "loop1"]
    assert rel_err(out, reference(residual_layers, ins)[0]) < TOL[torch.float32]


def affine(x, c):
    h = torch.zeros_like(x[:, 0])
    ys = []
    for t in range(x.shape[1]):
        h = (h + x[:, t]) * c[:, t]          # a = c, b = x * c
        ys.append(h)
    return torch.stack(ys, 1)


def test_detect_recurrence_builds_a_and_b():
    ins = (torch.randn(2, 5, 3), torch.rand(2, 5, 3))
    _, rep = ssmc_run(affine, ins, disable_passes=["fuse_prologue", "fuse_epilogue"])
    r = rep.regions[0].ir
    # without prologue fusion a and b are loads of values computed before the region
    assert isinstance(r.decay, Load) and isinstance(r.drive, Load)
    _, rep = ssmc_run(affine, ins)
    r = rep.regions[0].ir
    x_in = next(i for i, s in enumerate(r.inputs) if s.name.startswith("l_x_"))
    c_in = next(i for i, s in enumerate(r.inputs) if s.name.startswith("l_c_"))
    assert r.decay == Load(c_in, ("i0", "t", "i1"))
    assert r.drive == Op("mul", (Load(x_in, ("i0", "t", "i1")), Load(c_in, ("i0", "t", "i1"))))
    assert r.outputs[0].expr == State()


def test_detect_recurrence_sums_paths():
    def fn(x):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = 0.5 * h + 0.25 * h - x[:, t]
            ys.append(h)
        return torch.stack(ys, 1)
    ins = (torch.randn(2, 5, 3),)
    out, rep = ssmc_run(fn, ins)
    r = rep.regions[0].ir
    assert r.decay == Const(0.75) and r.decay_kind == "lti"
    assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


def test_fuse_prologue_on_off():
    ins = P.mamba1_inputs(seed=31)
    fn = P.mamba1_precomputed()
    out_off, rep_off = ssmc_run(fn, ins, disable_passes=["fuse_prologue"])
    out_on, rep_on = ssmc_run(fn, ins)
    off, on = rep_off.regions[0].ir, rep_on.regions[0].ir
    assert isinstance(off.decay, Load)                       # dA read as a (b, L, d, n) tensor
    assert "exp" in str(on.decay) and "softplus" in str(on.decay)
    assert len([s for s in off.inputs if s.ndim == 4]) >= 1  # a 4-d sequence tensor is an input
    assert all(s.ndim <= 3 for s in on.inputs)                # ... and is never materialised
    assert [p.skipped for p in rep_off.passes if p.name == "fuse_prologue"] == ["disabled"]
    ref = reference(fn, ins)[0]
    assert rel_err(out_off, ref) < TOL[torch.float32] and rel_err(out_on, ref) < TOL[torch.float32]


def test_fuse_epilogue_on_off():
    ins = P.mamba1_inputs(seed=32)
    fn = P.mamba1("stack")
    out_off, rep_off = ssmc_run(fn, ins, disable_passes=["fuse_epilogue"])
    out_on, rep_on = ssmc_run(fn, ins)
    off, on = rep_off.regions[0].ir, rep_on.regions[0].ir
    assert [o.expr for o in off.outputs] == [State()]         # the states leave the region
    assert off.outputs[0].index == ("t", "i0", "i1", "i2")        # stacked states, time first
    assert any(isinstance(x, Reduce) for o in on.outputs for x in __import__("ssmc").ir.walk(o.expr))
    assert on.outputs[0].index == ("i0", "t", "i1")
    ref = reference(fn, ins)[0]
    assert rel_err(out_off, ref) < TOL[torch.float32] and rel_err(out_on, ref) < TOL[torch.float32]


def test_fuse_epilogue_pulls_work_after_the_loop():
    ins = P.mamba1_inputs(seed=33)
    _, rep = ssmc_run(P.mamba1_precomputed(), ins)
    text = str(rep.regions[0].ir.outputs[0].expr)
    assert "silu" in text and text.count("+") >= 1         # + D*x and * silu(z) after the loop


@pytest.mark.parametrize("prog,strategy", [("mamba1", "chunked_scan"), ("mamba2", "chunked_ssd"),
                                           ("decode", "step")])
def test_select_strategy(prog, strategy):
    if prog == "mamba1":
        fn, ins = P.mamba1("stack"), P.mamba1_inputs(seed=34)
    elif prog == "mamba2":
        fn, ins = P.mamba2(), P.mamba2_inputs(P=8, N=16, seed=35)
    else:
        fn, ins = P.mamba2("final"), P.mamba2_inputs(L=2, P=8, N=16, with_h0=True, seed=36)
    _, rep = ssmc_run(fn, ins)
    assert rep.regions[0].strategy == strategy, rep.regions[0].strategy_reason
    assert rep.regions[0].strategy_reason


def test_disable_by_environment(monkeypatch):
    monkeypatch.setenv("SSMC_DISABLE_PASSES", "fuse_epilogue")
    _, rep = ssmc_run(P.mamba1("stack"), P.mamba1_inputs(seed=37))
    assert {p.name: p.skipped for p in rep.passes}["fuse_epilogue"] == "disabled"


def test_required_pass_cannot_be_disabled():
    out, rep = ssmc_run(P.mamba1("stack"), P.mamba1_inputs(seed=38), disable_passes=["reroll"])
    assert len(rep.regions) == 1
    assert any("required" in m for g in rep.graphs for m in g.log)


def test_unknown_option_is_a_clear_error():
    with pytest.raises(Exception, match="unknown option"):
        ssmc_run(P.mamba1("stack"), P.mamba1_inputs(), targt="torch")


@pytest.mark.parametrize("opts, what", [
    ({"target": "trition"}, "target='trition' is no installed target"),
    ({"disable_passes": ["fuse_epilog"]}, "names ['fuse_epilog'], not a pass"),
    ({"disable_passes": 3}, "disable_passes=3 must be a list"),
    ({"chunk": "abc"}, "chunk='abc' must be an int"),
    ({"chunk": -1}, "chunk=-1 must be an int"),
    ({"deterministic": "no"}, "deterministic='no' must be True or False"),
    ({"cache_dir": 5}, "cache_dir=5 must be a path"),
])
def test_bad_option_values_are_errors_naming_them(opts, what):
    """A misspelt target or pass name, a wrong type: an error that names the option (they ran
    silently on another target, disabled nothing, or fell back with an unrelated message)."""
    with pytest.raises(Exception, match=re.escape(what)):
        ssmc_run(P.mamba1("stack"), P.mamba1_inputs(seed=40), **opts)


def test_pass_timings_reported():
    _, rep = ssmc_run(P.mamba1("stack"), P.mamba1_inputs(seed=39))
    names = [p.name for p in rep.passes]
    assert names == ["reroll", "sink_consumers", "split_states", "detect_recurrence", "fuse_prologue", "fuse_epilogue", "block_sparse", "moe_grouping",
                     "select_strategy"]
    assert all(p.ms >= 0 for p in rep.passes)
    name, ms, changed = rep.passes[0]
    assert name == "reroll" and changed


def test_reduce_over_an_axis_the_value_does_not_vary_along():
    def fn(x, c):
        h = torch.zeros(x.shape[0], 3, 4)
        ys = []
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t, :, None]
            ys.append((h * 0.0 + c[:, t, :, None]).sum(-1))     # sums a value constant over n
        return torch.stack(ys, 1)
    ins = (torch.randn(2, 5, 3), torch.randn(2, 5, 3))
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1
    assert rel_err(out, reference(fn, ins)[0]) < TOL[torch.float32]


def test_deep_expressions_print_quickly():
    from ssmc.ir import Const, Load, Op
    e = Load(0, ("i0",))
    for _ in range(60):
        e = Op("add", (e, e))
    assert len(str(e)) > 60
