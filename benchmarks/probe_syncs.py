"""Where a training step of the block-sparse benchmark makes the host wait for the GPU, and how
much of the step the GPU is busy. GPU only.

    python -m benchmarks.probe_syncs --out syncs.json [--batch 32] [--L 4096]

One forward+backward of bench_block_sparse's recurrence (the sparse mask, the CUDA target) runs
under torch.cuda.set_sync_debug_mode("warn"): every synchronizing torch call is recorded with the
ssmc frames of its stack (counted per call site). Then the step is timed on the host
(perf_counter, synchronized at both ends) and by the kernels' own sum under torch.profiler;
host time well above kernel time means the GPU waits for the host. ``--cprofile FILE``: one
more step under cProfile, where the host's time goes.
"""
from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings

import torch

from benchmarks.bench_block_sparse import FULL, make_inputs, make_mask
from benchmarks.bench_gpu import lowered_graph
from block_sparse_programs import euler_matmul  # noqa: E402 (tests/ is on the path: bench_block_sparse)


def step(fn, ins):
    xs = [t.detach().requires_grad_(i != 3) for i, t in enumerate(ins)]
    y = fn(*xs)
    y = y[0] if isinstance(y, (tuple, list)) else y
    return torch.autograd.grad(y.float().sum(), [x for x in xs if x.requires_grad])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=FULL["b"])
    ap.add_argument("--L", type=int, default=FULL["L"])
    ap.add_argument("--step-elements", type=int, default=None,
                    help="the backward's chunk tensors (mix_adjoint.GPU_STEP_ELEMENTS), default its own")
    ap.add_argument("--cprofile", default="", help="also one step under cProfile, its top functions "
                                                   "(by own time and by cumulative time) written to this file")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.step_elements:
        from ssmc.targets import mix_adjoint as M
        M.GPU_STEP_ELEMENTS = args.step_elements
    gen = torch.Generator().manual_seed(0)
    b, d, n, bs = args.batch, FULL["d"], FULL["n"], FULL["bs"]
    mask = make_mask(n, bs, FULL["density"], gen)
    fn, _ = lowered_graph(euler_matmul, make_inputs(b, 16, d, n, mask, dev, gen, torch.bfloat16), target="cuda")
    ins = make_inputs(b, args.L, d, n, mask, dev, gen, torch.bfloat16)
    step(fn, ins)                                   # compiles, tunes, fills the caches
    torch.cuda.synchronize()
    seen = []

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                      for f in traceback.extract_stack()[:-1] if "/ssmc/" in f.filename or "/benchmarks/" in f.filename]
            seen.append(" <- ".join(reversed(frames[-4:])))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(fn, ins)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(seen)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(fn, ins)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(fn, ins)
        torch.cuda.synchronize()
    kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    if args.cprofile:
        import cProfile
        import io
        import pstats
        prof_ = cProfile.Profile()
        prof_.enable()
        step(fn, ins)
        torch.cuda.synchronize()
        prof_.disable()
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof_, stream=text).sort_stats(key).print_stats(45)
        with open(args.cprofile, "w") as f:
            f.write(text.getvalue())
    from ssmc.targets import mix_adjoint as M
    res = {"device": torch.cuda.get_device_name(), "shape": dict(b=b, L=args.L, d=d, n=n, bs=bs),
           "chunk_steps": M.chunk_steps(b * d * n, args.L, None, M.step_elements(dev, 4)),
           "host_ms_median": sorted(times)[len(times) // 2], "host_ms": times, "kernel_ms": kernel_ms,
           "syncs": len(seen), "sync_sites": dict(sites.most_common())}
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
