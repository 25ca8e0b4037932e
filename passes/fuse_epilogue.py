"""fuse_epilogue: pull the readout and gating into the region.

Expects a candidate with `rec`. The per-step outputs computed from the new state (the readout
sum_n h * C, einsum or matmul forms, + D * x, * silu(z), casts) become the region's output
expressions, so only y (b, L, d) leaves the kernel instead of the states (b, L, d, n). What
cannot be fused is computed after the region, for all steps at once, from the region's
outputs. Leaves a re-assembled plan with the epilogue fused.
"""
from __future__ import annotations

from ssmc.assemble import AssembleError, assemble

from .base import Pass


class FuseEpilogue(Pass):
    """Expects: candidates with `rec`. Leaves: plans whose outputs are the fused readout and
    epilogue expressions; a candidate whose fused form fails keeps its plan, with a note."""
    name = "fuse_epilogue"
    after = "fuse_prologue"

    def run(self, ctx) -> bool:
        changed = False
        for cand in ctx.live():
            try:
                plan = assemble(cand.loop, cand.rec, cand.fuse_prologue, True)
            except AssembleError as e:
                cand.notes.append(f"fuse_epilogue declined: {e}")
                continue
            changed |= plan.region != cand.plan.region
            cand.plan, cand.fuse_epilogue = plan, True
        return changed
