"""What is alive at the peak of one Mamba-2 training step, and which lines allocated it.

    python -m benchmarks.probe_train_memory --out mem.json

The bf16 Mamba-2 region of bench_train (b8 L4096 h24 p64 n128), compiled by ssmc: the step's
peak above its start, then one step under the allocator's history: the allocations of 8 MiB or
more alive at its peak, each with the innermost frames of ssmc or the benchmarks that made it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench_gpu import env_info, lowered_graph
from benchmarks.bench_train import M2, fwd_bwd
from benchmarks.run import mamba2_inputs, mamba2_loop


def at_peak(step, min_mb=8) -> dict:
    """One more step under the allocator's history: the allocations alive at the step's peak,
    each with the innermost frames of ssmc or the benchmarks that made it."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for dev in snap["device_traces"] for e in dev]
    live, total, best, best_live = {}, 0, -1, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > best:
            best, best_live = total, dict(live)

    def where(e):
        fr = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in e.get("frames", [])
              if any(k in f["filename"] for k in ("ssmc", "benchmarks", "targets", "runtime"))]
        return fr[:4]
    rows = [{"MB": round(e["size"] / 2**20, 1), "where": where(e)} for e in best_live.values()
            if e["size"] >= min_mb * 2**20]
    return {"peak_of_step_allocs_MB": best / 2**20, "live": sorted(rows, key=lambda r: -r["MB"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    small = mamba2_inputs(M2, 16, torch.bfloat16, "cuda", seed=0)
    gm, _ = lowered_graph(mamba2_loop, small, target="triton")
    ins = mamba2_inputs(M2, 4096, torch.bfloat16, "cuda", seed=1)
    dout = (torch.randn(M2["b"], 4096, M2["h"], M2["p"], device="cuda") / 16).to(torch.bfloat16)
    step = fwd_bwd(gm, ins, dout)
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    res = {"env": env_info(), "inputs_MB": base / 2**20}
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    res["peak_above_start_MB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    res["at_peak"] = at_peak(step)
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
