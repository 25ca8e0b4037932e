"""Mixture of experts: per-expert loops over gathered sequences run as one grouped op.

- numerics against the per-expert naive loop run eagerly in float64, for routings where an
  expert gets no sequence, one, or all of them; gather forms ``x[idx]`` and
  ``index_select``; scatter forms ``out[idx] = y``, ``index_copy`` and ``index_add_``;
- gradients of every input through the grouped op, against float64 autograd of the loop;
- the report: groups, their sizes, padding and wasted work; what is not grouped, and why;
- routing inside the graph (``nonzero``) with capture_dynamic_output_shape_ops;
- the grouped Triton kernel under TRITON_INTERPRET=1 (one launch for all experts), every
  config of each variant (sequential loop, chunked associative scan) pinned in turn;
- the grouped Triton backward under TRITON_INTERPRET=1: one launch for all experts (launches
  counted), float64 gradients of every input against eager autograd of the loop, the scan and
  seq bodies; what it declines runs per group with the reason; compile-only for sm_80 / sm_90;
- the benchmark in tiny mode; on a GPU (marker gpu): bf16 and fp32 against float64.
"""
from __future__ import annotations

import importlib.resources
import json
import re

import pytest
import torch

import programs as P
import ssmc
from conftest import ssmc_run
from ssmc.runtime.op import lookup

STATES = (2, 4, 3, 4)        # d_state of each expert


expert = P.mamba1_expert      # one expert: Mamba-1's selective scan, the naive loop


def moe(gather="getitem", scatter="setitem"):
    def fn(x, dt, idxs, params):
        out = torch.zeros_like(x)
        for idx, (A, WB, WC, D, bias) in zip(idxs, params):
            xe = x[idx] if gather == "getitem" else x.index_select(0, idx)
            y = expert(xe, dt[idx], A, xe @ WB, xe @ WC, D, bias)
            if scatter == "setitem":
                out[idx] = y
            elif scatter == "index_copy":
                out = out.index_copy(0, idx, y)
            else:
                out.index_add_(0, idx, y)
        return out
    return fn


def inputs(b=6, L=5, d=4, states=STATES, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x, dt = r(b, L, d), r(b, L, d) * 0.5
    params = [(-torch.rand(d, n, generator=g, dtype=torch.float64) - 0.1, r(d, n) * 0.5, r(d, n) * 0.5,
               r(d), r(d) * 0.1) for n in states]
    cast = lambda t: t.to(device=device, dtype=dtype)
    return cast(x), cast(dt), [tuple(cast(p) for p in ps) for ps in params]


def split(route, E, device="cpu"):
    route = torch.as_tensor(route)
    return [torch.nonzero(route == e).squeeze(1).to(device) for e in range(E)]


ROUTES = {"mixed": [0, 2, 2, 0, 1, 3], "empty_and_single": [0, 0, 2, 0, 1, 0],
          "all_to_one": [3, 3, 3, 3, 3, 3]}


def check(out, ref, tol):
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err < tol, err


def check_grads(got, want):
    """Every gradient within 1e-9 of float64 eager; where eager has none (or zero), none or zero."""
    for g, w in zip(got, want):
        if w is None or not w.abs().sum():
            assert g is None or not g.abs().sum()
        else:
            check(g, w, 1e-9)


@pytest.mark.parametrize("gather,scatter", [("getitem", "setitem"), ("index_select", "index_copy"),
                                            ("getitem", "index_add_")])
def test_grouped_matches_the_naive_loop(gather, scatter):
    fn = moe(gather, scatter)
    x, dt, params = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ssmc")
    routes = ROUTES if scatter == "setitem" else {"empty_and_single": ROUTES["empty_and_single"]}
    for name, route in routes.items():
        idxs = split(route, len(params))
        check(compiled(x, dt, idxs, params), fn(x, dt, idxs, params), 1e-10)
    report = ssmc.backend.LAST_REPORT
    assert report.groups and report.groups[0].status.startswith("grouped"), report


def test_report_shows_groups_padding_and_waste():
    x, dt, params = inputs(states=(2, 4, 3))
    idxs = split([0, 2, 2, 0, 1, 2], 3)                       # 2, 1 and 3 sequences
    report = ssmc.explain(moe(), x, dt, idxs, params[:3])
    names = [p.name for p in report.passes]
    assert names.index("fuse_epilogue") < names.index("block_sparse") < names.index("moe_grouping") \
        < names.index("select_strategy")
    (grp,) = report.groups
    assert len(grp.members) == 3 and grp.scatter == "setitem" and grp.source == "l_x_"
    pad = grp.padding()
    assert [(b, n, t) for b, n, t, _ in pad["groups"]] == [(2, 2, 2), (1, 4, 4), (3, 3, 4)]
    assert pad["wasted_fraction"] == pytest.approx((3 * 4 * 1) / (2 * 4 * 2 + 4 * 4 + 3 * 4 * 3))
    text = str(report)
    assert "group moe0: grouped: 3 experts in one op" in text
    assert "padded work 17.6% of useful work" in text and "tile 4" in text
    assert "g1: 1 seq, state 4 -> tile 4" in text              # after the run: the kernel's table
    assert all("grouped into moe0" in " ".join(r.notes) for r in report.regions)


def test_report_state_sizes_with_projections_inside_the_step():
    """C_t = x_t @ WC inside each expert's step: the region holds a sum over channels besides the
    readout's sum over the state; the report's state sizes are the experts' (2, 4, 8), not the
    channel count, and nothing is padded."""
    def ssm(x, dt, A, WB, WC):
        h, ys = x.new_zeros(x.shape[0], x.shape[2], A.shape[1]), []
        for t in range(x.shape[1]):
            Bt, Ct = x[:, t] @ WB, x[:, t] @ WC
            h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * Bt[:, None] * x[:, t, :, None]
            ys.append((h * Ct[:, None]).sum(-1))
        return torch.stack(ys, 1)

    def fn(x, dt, idxs, ps):
        out = torch.zeros_like(x)
        for idx, (A, WB, WC) in zip(idxs, ps):
            out[idx] = ssm(x[idx], dt[idx], A, WB, WC)
        return out
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(6, 5, 3, generator=g), torch.rand(6, 5, 3, generator=g) * 0.3
    ps = [(-torch.rand(3, n, generator=g), torch.randn(3, n, generator=g), torch.randn(3, n, generator=g))
          for n in (2, 4, 8)]
    report = ssmc.explain(fn, x, dt, split([0, 1, 2, 0, 1, 0], 3), ps)
    (grp,) = report.groups
    pad = grp.padding()
    assert [(n, t) for _, n, t, _ in pad["groups"]] == [(2, 2), (4, 4), (8, 8)], str(report)
    assert pad["wasted_fraction"] == 0


def test_gradients_match_float64_autograd():
    fn = moe()
    x, dt, params = inputs(seed=3)
    idxs = split([1, 0, 1, 1, 3, 1], 4)                       # expert 2 gets nothing, 0 and 3 one

    def grads(f):
        leaves = [x.clone().requires_grad_(), dt.clone().requires_grad_()]
        ps = [tuple(p.clone().requires_grad_() for p in ps) for ps in params]
        out = f(leaves[0], leaves[1], idxs, ps)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return [t.grad for t in leaves] + [p.grad for ps_ in ps for p in ps_]
    torch._dynamo.reset()
    got = grads(torch.compile(fn, backend="ssmc"))
    want = grads(fn)
    assert ssmc.backend.LAST_REPORT.groups[0].status.startswith("grouped")
    check_grads(got, want)


def moe_spans(S: int):
    """The second routing form: token spans of S steps, each routed to an expert and run from a
    zero state, written as sequences of the reshaped input (README, "Which form to write")."""
    def fn(x, dt, idxs, params):
        b, L, d = x.shape
        xs, dts = x.reshape(b * (L // S), S, d), dt.reshape(b * (L // S), S, d)
        out = torch.zeros_like(xs)
        for idx, (A, WB, WC, D, bias) in zip(idxs, params):
            xe = xs[idx]
            out[idx] = expert(xe, dts[idx], A, xe @ WB, xe @ WC, D, bias)
        return out.reshape(b, L, d)
    return fn


def test_token_spans_grouped():
    """Spans of 4 steps (3 sequences of 8: 6 spans), one expert with none; grouped into one op;
    values and gradients against float64 eager."""
    fn = moe_spans(4)
    x, dt, params = inputs(b=3, L=8, seed=4)
    idxs = split([2, 0, 2, 3, 0, 2], 4)                        # expert 1 gets no span

    def grads(f):
        leaves = [x.clone().requires_grad_(), dt.clone().requires_grad_()]
        ps = [tuple(p.clone().requires_grad_() for p in ps) for ps in params]
        out = f(leaves[0], leaves[1], idxs, ps)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return out.detach(), [t.grad for t in leaves] + [p.grad for ps_ in ps for p in ps_]
    torch._dynamo.reset()
    out, got = grads(torch.compile(fn, backend="ssmc"))
    ref, want = grads(fn)
    grp = ssmc.backend.LAST_REPORT.groups[0]
    assert grp.status.startswith("grouped: 4 experts"), grp.status
    check(out, ref, 1e-10)
    check_grads(got, want)


@pytest.fixture
def dynamic_output_shapes():
    """Dynamo captures data-dependent sizes (nonzero, boolean masks) in the graph. Through
    config.patch: monkeypatching the attribute breaks Dynamo's config module on torch 2.13."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


def test_routing_inside_the_graph(dynamic_output_shapes):
    """``nonzero`` in the compiled function: one graph with capture_dynamic_output_shape_ops,
    a graph per expert (each correct, not grouped) without."""
    def fn(x, dt, route, params):
        out = torch.zeros_like(x)
        for e, (A, WB, WC, D, bias) in enumerate(params):
            idx = torch.nonzero(route == e).squeeze(1)
            xe = x[idx]
            out = out.index_copy(0, idx, expert(xe, dt[idx], A, xe @ WB, xe @ WC, D, bias))
        return out
    x, dt, params = inputs(seed=5)
    route = torch.tensor([0, 2, 2, 0, 1, 3])
    out, report = ssmc_run(fn, (x, dt, route, params))
    check(out, fn(x, dt, route, params), 1e-10)
    assert len(report.graphs) == 1 and report.groups and report.groups[0].status.startswith("grouped")
    assert "data-dependent" in str(report)


class Expert(torch.nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.A = torch.nn.Parameter(-torch.rand(d, n) - 0.1)
        self.proj = torch.nn.Linear(d, 2 * n, bias=False)
        self.D = torch.nn.Parameter(torch.randn(d))
        self.bias = torch.nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, x, dt):
        B, C = self.proj(x).chunk(2, dim=-1)
        return expert(x, dt, self.A, B, C, self.D, self.bias)


class MoE(torch.nn.Module):
    """A router inside the module, boolean masks, experts of an nn.ModuleList."""
    def __init__(self, d, states):
        super().__init__()
        self.experts = torch.nn.ModuleList(Expert(d, n) for n in states)
        self.router = torch.nn.Linear(d, len(states))

    def forward(self, x, dt):
        route = self.router(x.mean(1)).argmax(-1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            mask = route == e
            out[mask] = ex(x[mask], dt[mask])
        return out


def test_module_with_router_and_masks_trains(dynamic_output_shapes):
    torch.manual_seed(0)
    m = MoE(4, STATES).double()
    x, dt = torch.randn(6, 5, 4, dtype=torch.float64), torch.randn(6, 5, 4, dtype=torch.float64) * 0.5
    torch._dynamo.reset()
    fast = torch.compile(m, backend="ssmc")
    got = fast(x, dt)
    got.square().sum().backward()
    g_fast = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad()
    want = m(x, dt)
    want.square().sum().backward()
    g_ref = [p.grad for p in m.parameters() if p.grad is not None]
    check(got, want, 1e-10)
    assert len(g_fast) == len(g_ref) > 0
    for a, b in zip(g_fast, g_ref):
        check(a, b, 1e-9)
    report = ssmc.backend.LAST_REPORT
    assert len(report.graphs) == 1 and report.groups[0].status.startswith("grouped")


def test_not_grouped_when_an_expert_reads_another():
    def fn(x, dt, idxs, params):
        (A0, WB0, WC0, D0, b0), (A1, WB1, WC1, D1, b1) = params[:2]
        x0 = x[idxs[0]]
        y0 = expert(x0, dt[idxs[0]], A0, x0 @ WB0, x0 @ WC0, D0, b0)
        idx1 = torch.argsort(y0.sum((1, 2)))                  # expert 1's routing reads expert 0
        x1 = x[idx1]
        return expert(x1, dt[idx1], A1, x1 @ WB1, x1 @ WC1, D1, b1)
    x, dt, params = inputs(seed=7)
    idxs = [torch.tensor([0, 1]), torch.tensor([3, 4])]
    out, report = ssmc_run(fn, (x, dt, idxs, params))
    check(out, fn(x, dt, idxs, params), 1e-10)
    assert not report.groups and len(report.regions) == 2
    assert any("reads another expert's result" in n for r in report.regions for n in r.notes)


def test_disabled_by_name():
    x, dt, params = inputs(seed=8)
    idxs = split(ROUTES["mixed"], 4)
    out, report = ssmc_run(moe(), (x, dt, idxs, params), disable_passes=["moe_grouping"])
    check(out, moe()(x, dt, idxs, params), 1e-10)
    assert not report.groups and len(report.regions) == 4


def test_triton_grouped_kernel_interpreted(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    pytest.importorskip("triton")
    x, dt, params = inputs(b=5, L=6, d=3, states=(2, 5, 3), dtype=torch.float32, seed=11)
    fn = moe()
    for route in ([0, 2, 2, 0, 1], [1, 1, 1, 1, 1]):
        idxs = split(route, 3)
        out, report = ssmc_run(fn, (x, dt, idxs, params), target="triton")
        (grp,) = report.groups
        entry = lookup(grp.key)
        assert entry.kernel.kind == "one Triton launch" and entry.failure is None
        assert entry.kernel.launches == 1 and entry.kernel.fallback is None
        ref = fn(x.double(), dt.double(), idxs, [tuple(p.double() for p in ps) for ps in params])
        check(out, ref, 1e-5)
        src = "\n".join(entry.kernel.sources.values())
        tiles = {1 << (params[e][0].shape[1] - 1).bit_length() for e in range(3) if len(idxs[e])}
        assert set(int(t) for t in re.findall(r"BLOCK_N=(\d+),", src)) >= tiles   # a branch per tile


def pin_grouped(monkeypatch, keep):
    """Only the grouped configs for which keep(config) holds are candidates."""
    from ssmc.targets import moe as M
    table = {k: [c for c in v if keep(c)] if isinstance(v, list) else v for k, v in M.load_configs().items()}
    monkeypatch.setattr(M, "load_configs", lambda: table)


def _interp_configs():
    table = json.loads((importlib.resources.files("ssmc.templates") / "triton/moe_scan_fwd.configs.json").read_text())
    return table["interpreter"]


@pytest.mark.parametrize("cfg", _interp_configs(), ids=lambda c: f"{c['variant']}-T{c.get('TILE', 0)}-C{c['CHUNK']}")
def test_triton_grouped_every_config_interpreted(cfg, monkeypatch, tmp_path):
    """Each interpreter config pinned in turn: the entry kernel of its variant runs (one launch),
    against float64 for random routings (experts with no sequence and with one among them), a
    state larger than the scan config's TILE (its chunk shortened) and a length that is not a
    multiple of the chunk."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    pytest.importorskip("triton")
    pin_grouped(monkeypatch, lambda c: c == cfg)
    states = (2, 9, 3, 1)
    x, dt, params = inputs(b=5, L=7, d=3, states=states, dtype=torch.float32, seed=21)
    fn = moe()
    gen = torch.Generator().manual_seed(4)
    routes = [[0, 0, 2, 0, 1]] + [torch.randint(0, 4, (5,), generator=gen).tolist() for _ in range(2)]
    assert sorted(len(i) for i in split(routes[0], 4)) == [0, 1, 1, 3]     # empty and single
    for route in routes:
        idxs = split(route, 4)
        out, report = ssmc_run(fn, (x, dt, idxs, params), target="triton")
        (grp,) = report.groups
        entry = lookup(grp.key)
        kern = entry.kernel
        assert entry.failure is None and kern.fallback is None, (entry.failure, kern.fallback)
        assert kern.launches == 1 and kern.config == cfg, kern.describe()
        assert kern.ran.endswith(f"_moe_grouped_{cfg['variant']}"), kern.ran
        ref = fn(x.double(), dt.double(), idxs, [tuple(p.double() for p in ps) for ps in params])
        check(out, ref, 1e-5)


def test_grouped_tile_params():
    from ssmc.targets.moe import tile_params
    scan = {"variant": "scan", "TILE": 128, "CHUNK": 16}
    # states up to TILE: BD * tile == TILE and the full chunk; beyond: BD 1, the chunk shortened
    assert tile_params(scan, (8, 64, 128, 512, 1024), 1536, 2048) == \
        {8: (16, 16), 64: (2, 16), 128: (1, 16), 512: (1, 4), 1024: (1, 2)}
    assert tile_params(scan, (8,), 3, 5) == {8: (4, 8)}          # few channels, a short sequence
    loop = {"variant": "loop", "TILE": 128, "CHUNK": 8}
    assert tile_params(loop, (8, 1024), 1536, 2048) == {8: (16, 8), 1024: (1, 8)}
    # seq4: TILE / tile rows (32 lanes); seqn4: 4 lanes a row at every tile (S = tile / 4 within
    # 2..8), so 8 rows up to tile 32 and 4 at tile 64 (S 8: 8 lanes a row)
    assert tile_params({"variant": "seq4", "TILE": 128, "CHUNK": 8}, (8, 16, 64), 1536, 2048) == \
        {8: (16, 8), 16: (8, 8), 64: (2, 8)}
    assert tile_params({"variant": "seqn4", "CHUNK": 8, "num_warps": 1}, (8, 16, 32, 64), 1536, 2048) == \
        {8: (8, 8), 16: (8, 8), 32: (8, 8), 64: (4, 8)}
    from ssmc.targets.moe import _seq_states
    assert [_seq_states("seqn4", t) for t in (1, 2, 4, 8, 16, 32, 64)] == [None, 2, 2, 2, 4, 8, 8]
    assert [_seq_states("seq4", t) for t in (1, 2, 4, 8, 64)] == [None, 2, 4, 4, 4]


def test_failing_grouped_kernel_falls_back_to_the_reference(monkeypatch, tmp_path):
    from ssmc.targets.moe import GroupedTritonKernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))

    def broken(self, *a, **k):
        raise RuntimeError("out of resources")
    monkeypatch.setattr(GroupedTritonKernel, "launch", broken)
    x, dt, params = inputs(b=4, L=3, d=2, states=(2, 3), dtype=torch.float32, seed=14)
    idxs = split([0, 1, 1, 0], 2)
    out, report = ssmc_run(moe(), (x, dt, idxs, params), target="triton")
    check(out, moe()(x.double(), dt.double(), idxs, [tuple(p.double() for p in ps) for ps in params]), 1e-5)
    assert "out of resources" in lookup(report.groups[0].key).failure


def _grouped_for_compile(monkeypatch, tmp_path):
    """A grouped kernel of the mixed routing's region for compile-only checks (no GPU, the
    interpreter off), and the bf16 overrides of its per-sequence inputs."""
    from ssmc.targets.moe import GroupedTritonKernel
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, dt, params = inputs(dtype=torch.float32, seed=12)
    report = ssmc.explain(moe(), x, dt, split(ROUTES["mixed"], 4), params)
    region = report.groups[0].region
    kern = GroupedTritonKernel(region, None, ssmc.make_options(cache_dir=str(tmp_path)))
    seq = {i: torch.bfloat16 for i, s in enumerate(region.inputs) if s.ndim >= 3 and i != region.init}
    return kern, region, seq


@pytest.mark.parametrize("variant", ["loop", "scan", "seq4", "seqn4"])
def test_grouped_kernel_compiles_for_sm90_without_gpu(variant, monkeypatch, tmp_path):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    kern, region, seq = _grouped_for_compile(monkeypatch, tmp_path)
    cfg = next(c for c in json.loads(
        (importlib.resources.files("ssmc.templates") / "triton/moe_scan_fwd.configs.json").read_text())["sm_90"]
        if c["variant"] == variant)
    consts = tuple((n, 4) if k == "offset" else (n, 1) for n, k in kern.fields
                   if k == "offset" or n.endswith("_s2"))       # aligned rows, unit inner strides
    fn, sig, cx = kern.signature(cfg, (8, 64), seq, consts)
    assert "*bf16" in sig.values() and sig["table_ptr"] == "*i64" and fn.__name__.endswith(f"_grouped_{variant}")
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx)
    except TypeError:           # older Triton spelled it `constants`
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constants=cx)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
    assert ".target sm_90" in ck.asm["ptx"]


def leaf_grads(f, x, dt, idxs, params):
    """Gradients of every input (x, dt, each expert's parameters) of f's output weighted by a ramp."""
    leaves = [x.clone().requires_grad_(), dt.clone().requires_grad_()]
    ps = [tuple(p.clone().requires_grad_() for p in ps) for ps in params]
    out = f(leaves[0], leaves[1], idxs, ps)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [t.grad for t in leaves] + [p.grad for ps_ in ps for p in ps_]


def pin_backward(monkeypatch, configs):
    """The single-region backward's interpreter configs (the grouped backward takes its own from them)."""
    from ssmc.targets import triton_bwd as B
    table = dict(B.load_configs())
    table["interpreter"] = configs
    monkeypatch.setattr(B, "load_configs", lambda: table)


@pytest.fixture
def kernel_launches(monkeypatch):
    """The names of the Triton kernels launched (interpreted), in order."""
    from triton.runtime.interpreter import InterpretedFunction
    names = []
    orig = InterpretedFunction.run

    def run(self, *a, **k):
        names.append(self.fn.__name__)
        return orig(self, *a, **k)
    monkeypatch.setattr(InterpretedFunction, "run", run)
    return names


SCAN_BWD = {"BLOCK_D": 2, "CHUNK": 4, "num_warps": 1, "num_stages": 1}


@pytest.mark.parametrize("bodies", ["scan", "seq2", "seq4/SEG2"])
def test_triton_grouped_backward_is_one_launch_interpreted(bodies, monkeypatch, tmp_path, kernel_launches):
    """Experts of states 2, 3, 4 and 8 (tiles 2, 4, 4, 8), random routings with experts that
    get no sequence, one or all of them: the backward of all experts is one launch of the
    grouped kernel, and every input's float64 gradient equals eager autograd of the loop. The
    bodies: the scan layout at every tile; seq2 at every tile; seq4 (SEG 2: segments
    recomputed) at tiles 4 and 8 and the scan layout at tile 2 (S must divide the tile), in one
    launch. A length (7) not a multiple of the chunk, channels (3) not of the block."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    pytest.importorskip("triton")
    name, _, seg = bodies.partition("/SEG")
    seq = [] if name == "scan" else [{"variant": name, "BLOCK_D": 2, "CHUNK": 2, "num_warps": 1, "num_stages": 1,
                                      **({"SEG": int(seg)} if seg else {})}]
    pin_backward(monkeypatch, seq + [SCAN_BWD])
    x, dt, params = inputs(b=5, L=7, d=3, states=(2, 3, 4, 8), seed=31)
    fn = moe()
    gen = torch.Generator().manual_seed(6)
    routes = [[1, 0, 1, 1, 3], [2, 2, 2, 2, 2]] + [torch.randint(0, 4, (5,), generator=gen).tolist() for _ in range(2)]
    assert sorted(len(i) for i in split(routes[0], 4)) == [0, 1, 1, 3]        # empty and single
    for route in routes:
        idxs = split(route, 4)
        want = leaf_grads(fn, x, dt, idxs, params)
        report = ssmc.Report()
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(
            gm, ex, options={"target": "triton"}, _report=report))
        kernel_launches.clear()
        got = leaf_grads(compiled, x, dt, idxs, params)
        (grp,) = report.groups
        entry = lookup(grp.key)
        kern = entry.kernel
        assert entry.failure is None and kern.bwd_fallback is None, (entry.failure, kern.describe())
        bwd = [n for n in kernel_launches if "_bwd" in n]
        assert bwd == [kern.bwd_entry()] and kern.bwd_launches == 1, kernel_launches
        tiles = {1 << (params[e][0].shape[1] - 1).bit_length() for e in range(4) if len(idxs[e])}
        assert set(kern.bwd_configs) == tiles
        for t, c in kern.bwd_configs.items():
            assert c.get("variant", "scan") == (name if name != "scan" and t % int(name[3:]) == 0 else "scan"), c
        assert "backward: one Triton launch" in kern.describe()
        check_grads(got, want)


def test_triton_grouped_backward_deterministic_interpreted(monkeypatch, tmp_path):
    """Deterministic mode: the gradients shared across programs (A, D, dt bias over sequences;
    B and C over channels) go to per-program slots summed by torch, not atomics; channels (5)
    in three blocks, so B's and C's slots are several per group. One launch, float64 gradients
    equal to eager autograd, in both modes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    pytest.importorskip("triton")
    pin_backward(monkeypatch, [SCAN_BWD])
    x, dt, params = inputs(b=5, L=6, d=5, states=(2, 3, 8), seed=33)
    idxs = split([0, 2, 2, 0, 2], 3)
    fn = moe()
    want = leaf_grads(fn, x, dt, idxs, params)
    for det in (True, False):
        report = ssmc.Report()
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(
            gm, ex, options={"target": "triton", "deterministic": det}, _report=report))
        got = leaf_grads(compiled, x, dt, idxs, params)
        kern = lookup(report.groups[0].key).kernel
        assert kern.bwd_launches == 1 and kern.bwd_fallback is None and kern.bwd_kernel().deterministic == det
        check_grads(got, want)


def test_triton_grouped_backward_falls_back_per_group_with_the_reason(monkeypatch, tmp_path):
    """What the grouped backward declines runs the member's backward per group, the reason in
    `bwd_fallback` and describe(), the gradients still right: output gradients of two element
    types (no one base pointer for them); a region without a Triton backward (an input read at
    two index patterns)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    pytest.importorskip("triton")
    from ssmc.targets.moe import GroupedTritonKernel
    from ssmc.targets.reference import ReferenceKernel
    from ssmc.targets.triton import TritonTarget
    from test_triton_bwd import _two_patterns_region
    pin_backward(monkeypatch, [SCAN_BWD])
    seen = []
    orig = GroupedTritonKernel.backward

    def spy(self, groups, grads, needs):      # what the grouped op passes
        seen.append((self, groups, grads, needs))
        return orig(self, groups, grads, needs)
    monkeypatch.setattr(GroupedTritonKernel, "backward", spy)
    x, dt, params = inputs(states=(2, 4, 3), seed=35)
    idxs = split([0, 1, 1, 0, 0, 1], 3)                       # expert 2 gets nothing
    report = ssmc.Report()
    torch._dynamo.reset()
    leaf_grads(torch.compile(moe(), backend=lambda gm, ex: ssmc.ssmc_backend(
        gm, ex, options={"target": "triton"}, _report=report)), x, dt, idxs, params)
    (moe_kern, groups, grads, needs), = seen
    assert moe_kern.bwd_launches == 1 and moe_kern.bwd_fallback is None
    grads = [list(gs) for gs in grads]
    grads[1] = [gr.float() for gr in grads[1]]
    region = moe_kern.region
    g = torch.Generator().manual_seed(2)
    two = _two_patterns_region()
    cases = [(region, moe_kern, groups, grads, needs, "not of one element type")]
    groups2 = [[torch.randn(s, generator=g, dtype=torch.float64) for s in ((b, 5, 3), (3,))] for b in (2, 0, 1)]
    outs2 = [ReferenceKernel(two).forward(ins) for ins in groups2]
    grads2 = [[torch.randn(o.shape, generator=g, dtype=torch.float64) for o in os_] for os_ in outs2]
    options = ssmc.make_options(cache_dir=str(tmp_path))
    kern2 = GroupedTritonKernel(two, TritonTarget().compile(two, "chunked_scan", options), options)
    cases.append((two, kern2, groups2, grads2, [[True, True]] * 3, "two index patterns"))
    for r, kern, groups, grads, needs, why in cases:
        got = kern.backward(groups, grads, needs)
        assert why in kern.bwd_fallback and why in kern.describe(), kern.bwd_fallback
        live = [i for i, ins in enumerate(groups) if ins[0].numel()]
        assert kern.bwd_launches == len(live) < len(groups)
        ref = ReferenceKernel(r)
        for ins, gs, nd, gots in zip(groups, grads, needs, got):
            want = ref.backward_autograd([x.double() for x in ins], [x.double() for x in gs], nd)
            for a, b in zip(gots, want):
                assert (a is None) == (b is None)
                if b is not None and b.abs().sum():
                    check(a, b, 1e-5)


@pytest.mark.parametrize("cc, bodies", [(90, ("seq4", "scan")), (80, ("scan", "scan")), (90, ("seq2", "seq2"))])
def test_grouped_backward_compiles_without_gpu(cc, bodies, monkeypatch, tmp_path):
    """The grouped backward kernel compiles for sm_90 and sm_80 (bf16 sequences, fp32
    parameters): tiles 64 and 8, each with its own body and config."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from ssmc.targets import triton_bwd as B
    kern, region, seq = _grouped_for_compile(monkeypatch, tmp_path)
    table = B.load_configs()[f"sm_{cc}"]
    pick = lambda v: next(c for c in table if c.get("variant", "scan") == v and "SEG" not in c)
    configs = {64: pick(bodies[0]), 8: pick(bodies[1])}
    fn, sig, cx = kern.bwd_signature(configs, seq)
    assert "*bf16" in sig.values() and sig["table_ptr"] == "*i64" and fn.__name__ == kern.bwd_entry()
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx)
    except TypeError:           # older Triton spelled it `constants`
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constants=cx)
    ck = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": configs[64]["num_warps"]})
    assert f".target sm_{cc}" in ck.asm["ptx"]
    text = "".join(kern.bwd_sources.values())
    assert all(f"_body_{v}(" in text for v in bodies)


def test_benchmark_tiny(tmp_path):
    from benchmarks import bench_moe
    out = tmp_path / "moe.json"
    from ssmc.targets import triton as T, triton_bwd as TB
    tables = (T.load_configs, TB.load_configs)
    bench_moe.main(["--tiny", "--out", str(out), "--reps", "1", "--skip", "layer_per_expert,eager",
                    "--fwd-variants", "loop,rows,scan", "--bwd-variants", "scan"])
    assert (T.load_configs, TB.load_configs) == tables          # the cut tables are put back
    res = json.loads(out.read_text())
    assert (res["config"]["fwd_variants"], res["config"]["bwd_variants"]) == ("loop,rows,scan", "scan")
    assert res["rows"] and all(r.get("error") is None for r in res["rows"]), res["rows"]
    assert {r["routing"] for r in res["rows"]} == {"balanced", "skewed"}
    assert all(r["ms"]["ssm_grouped"] > 0 and r["padded_over_useful"] >= 0 for r in res["rows"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_grouped_triton(dtype, monkeypatch):
    """Two configs of each arch's table: with all of them (the autotuner compiles and times 16 a
    dtype) the test did not finish within 250 s on an H100 nor 130 s on an H200 (not profiled)."""
    from ssmc.targets import moe as M
    firsts = [c for v in M.load_configs().values() if isinstance(v, list) for c in v[:2]]
    pin_grouped(monkeypatch, lambda c: c in firsts)
    x, dt, params = inputs(b=16, L=64, d=128, states=(8, 16, 32, 64), dtype=dtype, seed=13, device="cuda")
    fn = moe()
    idxs = split(torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(0)), 4, "cuda")
    out, report = ssmc_run(fn, (x, dt, idxs, params), rest="eager")
    (grp,) = report.groups
    kernel = lookup(grp.key).kernel
    assert kernel.kind == "one Triton launch" and kernel.launches == 1, kernel.describe()
    assert kernel.stats["wasted_fraction"] == 0.0          # power-of-two states: no padding
    ref = fn(x.double(), dt.double(), idxs, [tuple(p.double() for p in ps) for ps in params])
    check(out, ref, 1e-5 if dtype == torch.float32 else 2e-2)
