"""A Mamba block written the plain way, a Python loop over time, compiled with ssmc.

    python examples/naive_mamba.py                 # CPU or GPU, prints speedup vs eager
    python examples/naive_mamba.py --length 2048 --batch 8 --d-model 768   # the GPU benchmark shape

No `import ssmc` is needed for torch.compile(backend="ssmc"): the backend is found through
the torch_dynamo_backends entry point. ssmc is imported here only to print its report.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class NaiveMamba(nn.Module):
    """in_proj -> causal depthwise conv1d -> x_proj / dt_proj -> selective scan loop ->
    gate with silu(z) -> out_proj. The scan is the naive recurrence, one step per token."""

    def __init__(self, d_model=64, d_state=16, expand=2, d_conv=4, dt_rank=None):
        super().__init__()
        d_inner = expand * d_model
        self.d_inner, self.d_state = d_inner, d_state
        self.dt_rank = dt_rank or math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, u):                                  # u: (b, L, d_model)
        b, L, _ = u.shape
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :L].transpose(1, 2))
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))                  # (b, L, d_inner)
        A = -torch.exp(self.A_log.float())                 # (d_inner, d_state)
        h = torch.zeros(b, self.d_inner, self.d_state, device=u.device, dtype=torch.float32)
        ys = []
        for t in range(L):
            dA = torch.exp(dt[:, t, :, None] * A)
            dBx = dt[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
            h = dA * h + dBx
            ys.append((h * C[:, t, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + x * self.D
        y = y * F.silu(z)
        return self.out_proj(y)


def _time(fn, x, reps):
    fn(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target", default="auto")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = NaiveMamba(args.d_model).to(dev)
    u = torch.randn(args.batch, args.length, args.d_model, device=dev)
    debug_dir = os.environ.get("SSMC_DEBUG_DIR") or tempfile.mkdtemp(prefix="ssmc_naive_mamba_")
    opts = {"target": args.target, "debug_dir": debug_dir}
    print(f"naive Mamba block: batch {args.batch}, length {args.length}, d_model {args.d_model}, "
          f"d_inner {model.d_inner}, d_state {model.d_state}, on {dev}")
    t0 = time.perf_counter()
    fast = torch.compile(model, backend="ssmc", options=opts)
    with torch.no_grad():
        y = fast(u)
        compile_s = time.perf_counter() - t0
        ref = model(u)
        err = ((y - ref).norm() / ref.norm()).item()
        t_eager = _time(model, u, max(1, args.reps // 2))
        t_ssmc = _time(fast, u, args.reps)
    import ssmc
    report = ssmc.backend.LAST_REPORT
    print(f"compile (Dynamo capture + ssmc): {compile_s:.1f} s; relative error vs eager: {err:.2e}")
    print(f"eager {t_eager * 1e3:.2f} ms, ssmc {t_ssmc * 1e3:.2f} ms: speedup {t_eager / t_ssmc:.2f}x")
    for r in report.regions:
        print(f"region {r.name}: strategy {r.strategy}, target {r.target}")
    for where, why in report.fallbacks:
        print(f"fallback at {where}: {why}")
    print(f"IR after each pass, generated kernels and the lowered graph: {debug_dir}")


if __name__ == "__main__":
    main()
