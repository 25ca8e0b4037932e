r"""Per-config check and timing of the chunked SSD kernel on the GPU (Mamba-2 region, b8 L4096
h24 p64 n128 bf16 by default), each config in its own process: a config that faults the GPU
(an illegal address kills the CUDA context) is reported and cannot poison the others. Used to
choose the per-arch table templates/triton/ssd_fwd.configs.json.

    python -m benchmarks.tune_ssd --out ssd_configs.json

Time split (``--segments``): each config is timed at each segment count given ("auto": the
kernel's policy, ssd_fwd.configs.json "segments"; a number: forced through
``SSDKernel.force_segments``); each row says how many segments ran and why. ``--baseline``
adds mamba-ssm's ``mamba_chunk_scan_combined`` (chunk 256, D and z, as benchmarks/run.py calls
it) at the same shape and inputs. The long Mamba-2 shape, auto against one segment against
mamba-ssm, over the arch's table configs:

    python -m benchmarks.tune_ssd --out benchmarks/results/h200_ssd_segments.json --configs table \
        --shape '{"b": 4, "h": 24, "p": 64, "n": 128, "L": 16384}' --segments auto,1,2,3,4 --baseline
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _oracle_and_inputs(shape: dict):
    from benchmarks.run import lowered, mamba2_inputs, mamba2_loop
    L = shape.pop("L")
    small = mamba2_inputs(shape, 8, torch.bfloat16, "cuda")
    ins = mamba2_inputs(shape, L, torch.bfloat16, "cuda", seed=L)
    oracle = lowered(mamba2_loop, [x.double() for x in small], target="torch")["gm"]
    ref = oracle(*[x.double() for x in ins])[0]
    return small, ins, ref


def one(cfg: dict, shape: dict, segments: str = "auto") -> dict:
    import triton.testing
    import ssmc
    from benchmarks.run import mamba2_loop, rel
    from test_triton import region_inputs, region_of
    from ssmc.targets import triton as T
    small, ins, ref = _oracle_and_inputs(shape)
    region = region_of(mamba2_loop, [x.cpu() for x in small])
    kern = T.TritonTarget().compile(region, "chunked_ssd", ssmc.make_options())
    kern.force_segments = None if segments == "auto" else int(segments)
    rin = region_inputs(region, mamba2_loop, ins)
    out = kern.launch(rin, cfg)
    torch.cuda.synchronize()
    got = out[0]
    ms = triton.testing.do_bench(lambda: kern.launch(rin, cfg), warmup=10, rep=50, return_mode="median")
    ll = kern.last_launch
    return {"rel_err": rel(got, ref), "ms": ms, "segments_run": ll["segments"], "seg_len": ll["seg_len"],
            "programs": ll["programs"], "sms": ll["sms"], "why": ll["reason"]}


def baseline(shape: dict) -> dict:
    """mamba-ssm's mamba_chunk_scan_combined on the same inputs."""
    import triton.testing
    from benchmarks import baselines as B
    from benchmarks.run import rel
    _, ins, ref = _oracle_and_inputs(shape)
    combined, _ = B.import_mamba_triton()
    f = lambda: combined(ins[0], ins[1], ins[2], ins[3][:, :, None], ins[4][:, :, None], chunk_size=256,
                         D=ins[5], z=ins[6])
    got = f()
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
    return {"rel_err": rel(got, ref), "ms": ms}


def _child(argv: list[str], timeout: int) -> dict:
    try:
        p = subprocess.run([sys.executable, "-m", "benchmarks.tune_ssd", "--out", "-", *argv],
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        return json.loads(got[0][7:]) if got else {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}


def configs(which: str) -> list[dict]:
    """"sweep": CHUNK x BLOCK_P x warps (the search the table came from); "table": this GPU's
    arch's configs in ssd_fwd.configs.json; "first": the table's first (its measured best)."""
    if which in ("table", "first"):
        from ssmc.targets import triton as T
        from ssmc.targets.triton_ssd import SSD_CONFIGS, _table
        major, minor = torch.cuda.get_device_capability()
        rows = [dict(c) for c in _table(SSD_CONFIGS)[T.arch_key(major * 10 + minor)]]
        return rows[:1] if which == "first" else rows
    return [{"variant": "ssd", "CHUNK": chunk, "BLOCK_P": bp, "num_warps": warps, "num_stages": stages}
            for chunk, bp, warps, stages in itertools.product([64, 128], [32, 64], [4, 8], [2])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one-baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default='{"b": 8, "h": 24, "p": 64, "n": 128, "L": 4096}')
    ap.add_argument("--segments", default="auto",
                    help="comma-separated segment counts per config: auto (the kernel's policy) or numbers (forced)")
    ap.add_argument("--configs", default="sweep", choices=["sweep", "table", "first"])
    ap.add_argument("--baseline", action="store_true", help="also time mamba-ssm's mamba_chunk_scan_combined")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per child process")
    args = ap.parse_args()
    shape = json.loads(args.shape)
    if args.one_baseline:
        print("RESULT " + json.dumps(baseline(shape)), flush=True)
        return
    if args.one:
        print("RESULT " + json.dumps(one(json.loads(args.one), shape, args.segments)), flush=True)
        return
    rows = []

    def add(row):                  # the file is rewritten after each row: a time limit keeps what ran
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"shape": shape, "gpu": torch.cuda.get_device_name(),
                                              "triton": __import__("triton").__version__, "rows": rows}, indent=1))
    if args.baseline:
        add({"config": "mamba-ssm mamba_chunk_scan_combined (chunk 256)",
             **_child(["--one-baseline", "--shape", args.shape], args.timeout)})
    for cfg in configs(args.configs):
        for seg in args.segments.split(","):
            add({"config": cfg, "segments": seg,
                 **_child(["--one", json.dumps(cfg), "--shape", args.shape, "--segments", seg], args.timeout)})


if __name__ == "__main__":
    main()
