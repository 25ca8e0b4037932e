"""select_strategy: pick each region's kernel strategy and target.

Expects candidates with a plan. Strategy from the IR and the shapes: "step" for a few tokens
with a state passed in (decoding), "chunked_ssd" when the decay is shared over state axes
large enough for matrix units (Mamba-2), "chunked_scan" otherwise (Mamba-1, S4D, any
elementwise recurrence), "rank_one" for a transition u w^T (delta rules), "block_sparse" for
any other non-diagonal transition. Target: the one asked for (``options.target``), or on "auto" the
first of cuda, triton, torch that supports the region on this device; every refusal's reason
is kept for ``ssmc.explain``. Leaves `strategy`, `target` and the reasons on each candidate.
"""
from __future__ import annotations

import math

from ssmc.ops import shape
from ssmc.targets.reference import low_rank

from .base import Pass

STEP_MAX_TOKENS = 4
SSD_MIN_SHARED = 64      # elements the decay is constant over, per (batch, head)


def choose_strategy(cand, ctx) -> tuple[str, str]:
    region = cand.plan.region
    L = cand.loop.length
    if region.mix is not None:
        m = region.mix
        terms = low_rank(m.expr, region.mix_axis)
        if terms is not None and len(terms) == 1:
            return "rank_one", (f"the transition along {region.mix_axis} is one product u w^T (a delta rule's "
                                "I - beta k k^T): u (w . h) a row and step, never the matrix")
        if terms is not None:
            return "rank_one", (f"the transition along {region.mix_axis} is a sum of {len(terms)} products "
                                "u w^T (Householder updates in sequence): a dot product a row, term and step, "
                                "never the matrix")
        if region.mix_axis != region.axes[-1]:
            return "block_sparse", (f"non-diagonal transition along {region.mix_axis}, not the last state axis: "
                                    "the torch executor runs it, step by step")
        if not m.block:
            return "block_sparse", "non-diagonal transition; block_sparse did not run, so every block counts as nonzero"
        return "block_sparse", (f"non-diagonal transition along {region.axes[-1]}: {m.block}x{m.block} blocks, "
                                f"{len(m.blocks)}/{m.nblocks ** 2} nonzero (density {m.density:.1%}); "
                                "each step multiplies only the nonzero blocks")
    if L is not None and L <= STEP_MAX_TOKENS and region.init is not None:
        return "step", f"{L} token(s) with a state passed in: decode step"
    kind = region.decay_kind
    if kind != "per-element":
        sshape = shape(cand.rec.prev)
        shared = [a for a in region.axes if a not in region.decay_axes()]
        n = math.prod(sshape[region.axes.index(a)] for a in shared)
        if n >= SSD_MIN_SHARED:
            return "chunked_ssd", (f"decay is {kind}: the same over {shared} ({n} elements), "
                                   "so a chunk's output is a masked matmul")
        return "chunked_scan", f"decay is {kind}, shared over only {n} elements: too few for matrix units"
    return "chunked_scan", "decay differs per state element"


def _supports(t, region, strategy, ctx):
    try:
        ok = t.supports(region, strategy, ctx.arch, ctx.device_type)
    except Exception as e:  # a target's check failing is its refusal
        ok = f"supports() raised {type(e).__name__}: {e}"
    return True if ok is True else (str(ok) if ok else "declined")


def choose_target(region, strategy, ctx) -> tuple[str, dict, list]:
    """(target, refusal reasons, the other GPU targets that also support the region). On
    "auto" with several generated targets, the kernel runs them once on the first inputs and
    keeps the fastest (ssmc.runtime.autotune)."""
    reasons = {}
    requested = ctx.options.target
    order = [requested] if requested != "auto" else (
        ["cuda", "triton", "torch"] if ctx.device_type == "cuda" else ["torch"])
    ok_names = []
    for name in order:
        t = ctx.targets.get(name)
        if t is None:
            reasons[name] = "no such target is installed" if requested != "auto" else "not installed"
            continue
        ok = _supports(t, region, strategy, ctx)
        if ok is True:
            ok_names.append(name)
            if requested != "auto" or name == "torch":
                break
        else:
            reasons[name] = ok
    if not ok_names:
        return "torch", reasons, []
    gpu = [n for n in ok_names if n != "torch"]
    return ok_names[0], reasons, gpu[1:] if requested == "auto" else []


class SelectStrategy(Pass):
    """Expects: candidates with a plan. Leaves: strategy, target and the reasons for both."""
    name = "select_strategy"
    after = "fuse_epilogue"

    def run(self, ctx) -> bool:
        for cand in ctx.live():
            cand.strategy, cand.strategy_reason = choose_strategy(cand, ctx)
            cand.target, cand.target_reasons, cand.alternatives = choose_target(cand.plan.region, cand.strategy, ctx)
        return bool(ctx.live())
