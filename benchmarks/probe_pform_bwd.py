"""The chunked SSD in parallel form (tests/test_parallel_form.py `chunked_ssd`, final state
returned): one forward+backward through ssmc per shape, each in its own process (a fault on
the GPU cannot hide the next shape's result), gradients against float64 autograd of the same
function on the same rounded inputs. Prints one JSON line a shape.

    python -m benchmarks.probe_pform_bwd --dtype bfloat16 --shape 4,2048,24,64,128,256 [--shape ...]
        [--variant nospec_ints+keep1 ...]

--variant runs each shape again with experiments on ssd_core's kernels ('+'-joined, patched in
before anything renders them: no int argument of ssd_bwd_dbc specialized, 8 warps or BLOCK_P 32
for it, KEEP 1, ...; VARIANTS below), as used to find the miscompile of KEEP 2
(benchmarks/NOTES.md, third session of 2026-12-07).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


VARIANTS = ("nospec_heads", "nospec_ints", "dbc_p32", "dbc_w8", "at_fsum", "at_max", "keep1")


def _variant(vs: str):
    """Experiments on ssd_core's kernels ('+'-joined), set before anything renders them."""
    for v in filter(None, vs.split("+")):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {VARIANTS}")
        _one_variant(v)


def _one_variant(v: str):
    import re
    from ssmc.targets import ssd_core
    if v.startswith("at_"):
        render = ssd_core.render
        new = ("    return tl.sum(tl.where(where, x, 0.0), axis)\n" if v == "at_fsum" else
               "    return tl.max(tl.where(where, x, -float('inf')), axis)\n")

        def patched_at(opd, nprog):
            src = render(opd, nprog)
            i = src.index("def _at(")
            j = src.index("    return r\n", i) + len("    return r\n")
            body_start = src.index("\n", src.index("):", i)) + 1
            return src[:body_start] + new + src[j:]
        ssd_core.render = patched_at
    elif v.startswith("nospec"):
        render = ssd_core.render

        def patched(opd, nprog):
            src = render(opd, nprog)
            head = src[src.index("def ssd_bwd_dbc("):]
            head = head[:head.index("):")]
            ints = ["HEADS"] if v == "nospec_heads" else \
                [a for a in re.findall(r"\b([A-Za-z_]\w*)\b", head) if not a.endswith("_ptr")
                 and "constexpr" not in a and a not in ("def", "ssd_bwd_dbc", "tl", "constexpr")]
            ints = [a for a in ints if not head.split(a, 1)[1].lstrip().startswith(": tl.constexpr")]
            return src.replace("@triton.jit\ndef ssd_bwd_dbc(",
                               f"@triton.jit(do_not_specialize={ints!r})\ndef ssd_bwd_dbc(")
        ssd_core.render = patched
    elif v == "dbc_p32":
        ssd_core.CONFIG["bwd_dbc"]["BLOCK_P"] = 32
    elif v == "keep1":
        ssd_core.CONFIG["core"]["KEEP"] = 1
    elif v == "dbc_w8":
        ssd_core.CONFIG["bwd_dbc"]["num_warps"] = 8


def one(shape: str, dtype: str, variant: str = "") -> dict:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    _variant(variant)
    import ssmc
    from ssmc.runtime.op import lookup
    from test_parallel_form import chunked_ssd, inputs
    import traceback
    from ssmc.targets import ssd_autograd
    inner = ssd_autograd.ssd_backward

    def loud(*args, **kw):          # the chunked SSD backward's own failure, before any fallback runs
        try:
            return inner(*args, **kw)
        except Exception:
            traceback.print_exc()
            raise
    ssd_autograd.ssd_backward = loud
    b, L, h, p, n, cs = map(int, shape.split(","))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fn = lambda x, a, B, C: chunked_ssd(x, a, B, C, cs, final=True)     # noqa: E731
    report = ssmc.Report()
    ours = torch.compile(fn, backend=lambda gm, ex: ssmc.ssmc_backend(gm, ex, _report=report))
    ins = [t.to(dev, getattr(torch, dtype)).requires_grad_() for t in inputs(b=b, L=L, h=h, p=p, n=n, seed=1)]
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    row = {"shape": shape, "dtype": dtype, "variant": variant}
    y, hT = ours(*ins)
    gy, gh = torch.randn_like(y), torch.randn_like(hT)
    got = torch.autograd.grad([y, hT], ins, [gy, gh])
    if dev == "cuda":
        torch.cuda.synchronize()
    wy, wh = fn(*ins64)
    want = torch.autograd.grad([wy, wh], ins64, [gy.double(), gh.double()])
    err = lambda g, w: float((g.double() - w).abs().max() / w.abs().max())    # noqa: E731
    row["rel_err"] = {"y": err(y, wy), "state": err(hT, wh),
                      **{f"d{k}": err(g, w) for k, g, w in zip("xaBC", got, want)}}
    info = report.regions[0] if report.regions else None
    row["strategy"] = info.strategy if info else None
    if info is not None:
        kern = lookup(info.key).kernel
        row["kernel"] = type(kern).__name__
        row["backward"] = kern.backward_note() if hasattr(kern, "backward_note") else None
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", required=True, help="b,L,h,p,n,chunk")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--variant", action="append", help=f"experiments, '+'-joined: {VARIANTS} (default: none)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one(a.shape[0], a.dtype, (a.variant or [""])[0])), flush=True)
        return
    for s, v in ((s, v) for s in a.shape for v in (a.variant or [""])):
        try:
            r = subprocess.run([sys.executable, "-m", "benchmarks.probe_pform_bwd", "--one", "--shape", s,
                                "--dtype", a.dtype, *(["--variant", v] if v else [])], cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if lines else json.dumps({"shape": s, "dtype": a.dtype, "rc": r.returncode,
                                                      "stderr": r.stderr[-1500:]}), flush=True)
        except subprocess.TimeoutExpired:
            print(json.dumps({"shape": s, "dtype": a.dtype, "error": f"timeout {a.timeout} s"}), flush=True)


if __name__ == "__main__":
    main()
