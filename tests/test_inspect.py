"""What a user sees: explain, the CLI, the debug directory, the entry point."""
import os
import subprocess
import sys
import textwrap

import torch

import programs as P
import ssmc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_explain_report_fields():
    rep = ssmc.explain(P.mamba1("stack"), *P.mamba1_inputs(seed=51))
    text = str(rep)
    assert len(rep.regions) == 1
    r = rep.regions[0]
    assert r.strategy == "chunked_scan" and r.target == "torch" and r.plugin.startswith("ssmc")
    for needle in ("region loop0", "re-rolled step", "def forward", "region IR", "decay: per-element",
                   "reroll", "detect_recurrence", "select_strategy", "ms"):
        assert needle in text, needle
    assert all(len(tuple(p)) == 3 for p in rep.passes)


def test_explain_shows_fallback_reason():
    rep = ssmc.explain(P.nonlinear("tanh"), *P.nonlinear_inputs())
    assert not rep.regions
    (where, why), = [f for f in rep.fallbacks if "detect_recurrence" in f[1]]
    assert "tanh" in why and "not linear" in why
    assert "fallback" in str(rep)


def decay(v):                                         # [..., i, j] = exp(v[j+1] + ... + v[i]), i >= j
    n = v.shape[-1]
    low = torch.ones(n, n, dtype=torch.bool).tril(-1)
    s = v[..., :, None].expand(*v.shape, n).masked_fill(~low, 0).cumsum(-2)
    return s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).exp()


def _chunked_decay_scan(x, loga, k, q, chunk: int = 4):
    """h_t = exp(loga_t) h_{t-1} + k_t x_t^T, y_t = q_t h_t, without a time loop: within a chunk
    by a decay matrix from cumulative sums under a triangular mask, across chunks by the same
    on the chunks' totals (x: (b, T, p), loga: (b, T), k, q: (b, T, n))."""
    b, T, p = x.shape
    c = T // chunk
    xc, kc, qc = (v.reshape(b, c, chunk, v.shape[-1]) for v in (x, k, q))
    la = loga.reshape(b, c, chunk)


    within = torch.einsum("bcin,bcjn,bcij,bcjp->bcip", qc, kc, decay(la), xc)
    cum = la.cumsum(-1)
    ends = torch.einsum("bcjn,bcj,bcjp->bcnp", kc, (cum[..., -1:] - cum).exp(), xc)
    starts = torch.einsum("bzc,bcnp->bznp", decay(torch.nn.functional.pad(cum[..., -1], (1, 0)))[:, :-1, :-1],
                          torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], 1))
    across = torch.einsum("bcin,bcnp,bci->bcip", qc, starts, cum.exp())
    return (within + across).reshape(b, T, p)


def test_explain_names_a_scan_in_parallel_form():
    """A chunked scan written without a loop (segment sums) is taken as the scan it computes
    (ssmc.parallel_form); the same decays as one masked attention over all steps (no chunks)
    run as written, and the report says what they are rather than only that no loop was found."""
    g = torch.Generator().manual_seed(53)
    b, T, p, n = 2, 8, 3, 2
    x, k, q = (torch.randn(b, T, m, generator=g, dtype=torch.float64) for m in (p, n, n))
    loga = -torch.rand(b, T, generator=g, dtype=torch.float64)
    h, ys = torch.zeros(b, n, p, dtype=torch.float64), []
    for t in range(T):                                # the same recurrence as a loop
        h = loga[:, t, None, None].exp() * h + k[:, t, :, None] * x[:, t, None, :]
        ys.append(torch.einsum("bn,bnp->bp", q[:, t], h))
    want = torch.stack(ys, 1)
    assert (_chunked_decay_scan(x, loga, k, q) - want).abs().max() < 1e-12
    rep = ssmc.explain(_chunked_decay_scan, x, loga, k, q)
    assert len(rep.regions) == 1 and "chunked SSD in parallel form" in str(rep), str(rep)
    torch._dynamo.reset()
    got = torch.compile(_chunked_decay_scan, backend="ssmc")(x, loga, k, q)
    assert (got - want).abs().max() < 1e-12

    def attention(x, loga, k, q):                     # decay-masked attention: no chunks to find
        return torch.einsum("bin,bjn,bij,bjp->bip", q, k, decay(loga), x)

    assert (attention(x, loga, k, q) - want).abs().max() < 1e-12
    rep = ssmc.explain(attention, x, loga, k, q)
    assert not rep.regions
    assert "scan in parallel form" in str(rep) and "runs as written" in str(rep), str(rep)
    plain = ssmc.explain(lambda x: x.cumsum(1).exp(), x)       # a cumsum alone is no such form
    assert "parallel form" not in str(plain)


def test_explain_points_at_graph_breaks():
    """A loop with `.item()` in each step: Dynamo runs it eagerly or in pieces; no region, and
    the report says why ssmc saw no loop."""
    def fn(x, a):
        h = torch.zeros_like(x[:, 0])
        ys = []
        for t in range(x.shape[1]):
            h = a * h + x[:, t] * float(x[0, t, 0].item() > 0)
            ys.append(h)
        return torch.stack(ys, 1)
    g = torch.Generator().manual_seed(52)
    x, a = torch.randn(2, 4, 3, generator=g), torch.rand(3, generator=g)
    rep = ssmc.explain(fn, x, a)
    assert not rep.regions and len(rep.graphs) != 1, str(rep)
    assert "graph break" in str(rep) and "torch._dynamo.explain" in str(rep)


def test_cli_explain(tmp_path):
    f = tmp_path / "model.py"
    f.write_text(textwrap.dedent("""
        import torch
        def loop(x, a):
            h = torch.zeros_like(x[:, 0])
            ys = []
            for t in range(x.shape[1]):
                h = a[:, t] * h + x[:, t]
                ys.append(h)
            return torch.stack(ys, 1)
        def factory():
            return loop, (torch.randn(2, 5, 3), torch.rand(2, 5, 3))
    """))
    out = subprocess.run([sys.executable, "-m", "ssmc", "explain", f"{f}:factory"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "region loop0" in out.stdout and "strategy chunked_scan" in out.stdout


def test_debug_dir(tmp_path):
    ssmc.explain(P.mamba1("stack"), *P.mamba1_inputs(seed=52), debug_dir=str(tmp_path))
    (gdir,) = list(tmp_path.iterdir())
    names = sorted(p.name for p in gdir.iterdir())
    assert names[:10] == ["000_input.py", "001_reroll.py", "002_sink_consumers.py", "003_split_states.py",
                          "004_detect_recurrence.py", "005_fuse_prologue.py", "006_fuse_epilogue.py", "007_block_sparse.py",
                          "008_moe_grouping.py", "009_select_strategy.py"]
    assert "999_lowered.py" in names
    assert "def forward" in (gdir / "001_reroll.py").read_text()
    assert "torch.ops.ssmc.region" in (gdir / "999_lowered.py").read_text()


def test_backend_found_without_import():
    code = textwrap.dedent("""
        import sys, torch
        def loop(x, a):
            h = torch.zeros_like(x[:, 0])
            ys = []
            for t in range(x.shape[1]):
                h = a[:, t] * h + x[:, t]
                ys.append(h)
            return torch.stack(ys, 1)
        x, a = torch.randn(2, 5, 3), torch.rand(2, 5, 3)
        y = torch.compile(loop, backend="ssmc")(x, a)
        assert torch.allclose(y, loop(x, a), atol=1e-6)
        assert "ssmc" in sys.modules
        import ssmc
        assert len(ssmc.backend.LAST_REPORT.regions) == 1
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_plugins_listed():
    pl = ssmc.plugins()
    names = {(p.group, p.name) for p in pl if p.error is None}
    assert {("ssmc.passes", "reroll"), ("ssmc.targets", "torch")} <= names
    assert "reroll" in str(pl)
