"""fuse_prologue: pull the discretization into the region.

Expects a candidate with `rec` (detect_recurrence). Moves the state-free elementwise work that
produces a_t and b_t into the region's decay/drive expressions: softplus(dt + bias),
exp(dt * A), dt * B * x, casts and broadcasting views, inside the step body and also when the
code computes them for the whole sequence before the loop (``dA = exp(dt[..., None] * A)``,
then ``dA[:, t]`` in the loop): such a (b, L, d, n) tensor is then never materialised. What
cannot be fused (a matmul inside the step, a slice with an offset) is computed for all steps at
once before the region. Leaves a re-assembled plan with the prologue fused.
"""
from __future__ import annotations

from ssmc.assemble import AssembleError, assemble, elementwise_closure

from .base import Pass


class FusePrologue(Pass):
    """Expects: candidates with `rec`. Leaves: plans whose decay/drive expressions hold the fused
    prologue; a candidate whose fused form fails keeps its unfused plan, with a note."""
    name = "fuse_prologue"
    after = "detect_recurrence"

    def run(self, ctx) -> bool:
        changed = False
        live = ctx.live()
        owned = {id(c): elementwise_closure([m for r in c.loop.results for m in r.replace]) | set(c.loop.erase)
                 for c in live}
        for cand in live:   # another loop's results, and work it may pull as its epilogue, stay outside
            cand.loop.foreign = frozenset().union(*(owned[id(o)] for o in live if o is not cand))
        for cand in live:
            try:
                plan = assemble(cand.loop, cand.rec, True, cand.fuse_epilogue)
            except AssembleError as e:
                cand.notes.append(f"fuse_prologue declined: {e}")
                continue
            changed |= plan.region != cand.plan.region
            cand.plan, cand.fuse_prologue = plan, True
        return changed
