"""Train the naive Mamba LM with ssmc and with eager from the same start; plot both loss curves.

    python examples/train_lm.py --steps 300 --plot benchmarks/results/train_lm_cpu.png
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.naive_lm import NaiveMambaLM, batch  # noqa: E402


def train(model, steps, bs, L, device, seed, log_every=25):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        x, y = batch(bs, L, generator=g, device=device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"  step {step:4d} loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return losses, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    base = NaiveMambaLM().to(args.device)
    runs = {}
    for name in ("eager", "ssmc"):
        model = copy.deepcopy(base)
        if name == "ssmc":
            torch._dynamo.reset()
            model = torch.compile(model, backend="ssmc")
        print(f"{name}:", flush=True)
        runs[name] = train(model, args.steps, args.batch, args.length, args.device, seed=1)
    le, ls = runs["eager"][0], runs["ssmc"][0]
    diff = max(abs(a - b) for a, b in zip(le, ls))
    print(f"eager {runs['eager'][1]:.1f} s, ssmc {runs['ssmc'][1]:.1f} s (first step includes compiling); "
          f"final loss eager {le[-1]:.4f} ssmc {ls[-1]:.4f}; largest per-step difference {diff:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"eager": le, "ssmc": ls, "seconds": {k: v[1] for k, v in runs.items()},
                                               "device": args.device, "steps": args.steps}) + "\n")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(le, label="eager", lw=2.5, alpha=0.6)
        ax.plot(ls, label="ssmc", lw=1)
        ax.set(xlabel="step", ylabel="cross-entropy", yscale="log",
               title=f"naive Mamba LM, {args.device}: ssmc vs eager")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
