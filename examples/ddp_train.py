"""Data-parallel training of the naive Mamba LM compiled with ssmc.

    torchrun --nproc_per_node=2 examples/ddp_train.py --steps 50 --json out.json
    python examples/ddp_train.py --steps 50            # one process (world size 1)

Each rank compiles its own copy of the model with backend="ssmc" (compile the module, then
wrap it in DDP, so Dynamo sees the whole model as one graph and the loop is not cut at DDP's
bucket boundaries). Kernels run on each rank's own device and current stream. With --json,
rank 0 writes the losses, throughput and per-rank peak memory.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.naive_lm import NaiveMambaLM, batch  # noqa: E402


def _free_port() -> int:
    """A port nobody listens on (one process without torchrun: nothing else needs to find it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-state", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--backend", default="ssmc", help="torch.compile backend, or 'eager'")
    ap.add_argument("--profile", default=None,
                    help="write rank 0's torch.profiler table of one steady step to this file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            init_method=None if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{_free_port()}")
    torch.manual_seed(0)                                   # same initial weights on every rank
    model = NaiveMambaLM(d_model=args.d_model, n_layers=args.layers, d_state=args.d_state).to(device)
    if args.backend != "eager":
        model = torch.compile(model, backend=args.backend)
    model = DDP(model, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    per_rank = args.global_batch // world
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(args.steps):
        x, y = batch(args.global_batch, args.length, generator=g, device=device)   # same global batch
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        if cuda:
            torch.cuda.synchronize()
        profiled = bool(args.profile) and rank == 0 and step == args.steps - 2
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) if profiled else contextlib.nullcontext() as prof:
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
        times.append(float("nan") if profiled else time.perf_counter() - t0)   # left out of the median
        if profiled:
            key = "cuda_time_total" if cuda else "cpu_time_total"
            Path(args.profile).write_text(prof.key_averages().table(sort_by=key, row_limit=40)
                                          + "\n\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d} loss {losses[-1]:.4f}", flush=True)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    steady = sorted(t for t in times[len(times) // 2:] if t == t)
    step_s = steady[len(steady) // 2]
    if rank == 0:
        res = {"world_size": world, "global_batch": args.global_batch, "length": args.length,
               "d_model": args.d_model, "layers": args.layers, "d_state": args.d_state, "lr": args.lr,
               "losses": losses, "step_s_median_2nd_half": step_s,
               "tokens_per_s": args.global_batch * args.length / step_s,
               "peak_bytes_per_rank": [int(p.item()) for p in peaks], "backend": args.backend,
               "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
        if args.backend == "ssmc":
            import ssmc
            rep = ssmc.backend.LAST_REPORT
            res["ssmc_regions"] = [(r.name, r.strategy, r.target) for r in rep.regions]
            res["ssmc_graphs"] = len(rep.graphs)     # > 1: DDP's graph splitter cut the model
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}))
        if args.json:
            Path(args.json).write_text(json.dumps(res) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
