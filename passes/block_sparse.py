"""block_sparse: read the block structure of a non-diagonal transition (block-sparse A).

Expects candidates whose region has a `Mix` (detect_recurrence found h = a*h + M h + b). Finds
which entries of the transition can be nonzero from the expression and the values the inputs
have at compile time (`ssmc.sparsity`: a constant mask buffer, a frozen boolean parameter, zeros
of A itself), picks the block size that multiplies the fewest entries, and records (for the matrix part m;
the diagonal a_t of h = a*h + m h + b costs one multiply per element and is applied apart) the block
size, the nonzero blocks and the density on the region (`Mix.block`, `.blocks`). The kernels
recompute the pattern from the actual inputs at each call, so the compile-time mask only
steers the choice and the report; it is never trusted for correctness. Leaves a note with the
mask on each such candidate; regions without a Mix are left alone.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ssmc import ir
from ssmc.assemble import _time_dependent
from ssmc.lower import _sub_graph
from ssmc.ops import shape
from ssmc.sparsity import block_pattern, choose_block, transition_pattern

from .base import Pass


MAX_EVAL_NODES = 64      # a loop-invariant value computed in the graph: evaluated when this small


def example_values(ctx, cand) -> list:
    """The compile-time value of each region input: an input or attribute of the graph, or a
    small computation on those (``W = (A * mask).T`` before the loop), evaluated on the example
    inputs; None where it is unknown."""
    phs = {n: i for i, n in enumerate(n for n in ctx.gm.graph.nodes if n.op == "placeholder")}
    memo: dict = {}

    def ev(node, budget):
        if not isinstance(node, fx.Node):
            return node
        if node in memo:
            return memo[node]
        if budget[0] <= 0:
            raise _Unknown()
        budget[0] -= 1
        if node.op == "placeholder":
            i = phs[node]
            if i >= len(ctx.example_inputs):
                raise _Unknown()
            v = ctx.example_inputs[i]
        elif node.op == "get_attr":
            v = ctx.gm
            for part in str(node.target).split("."):
                v = getattr(v, part)
        elif node.op in ("call_function", "call_method"):
            args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: ev(a, budget))
            v = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" \
                else node.target(*args, **kwargs)
        else:
            raise _Unknown()
        memo[node] = v
        return v

    loop = cand.loop
    invs = dict(zip(loop.invariant_nodes(), loop.invariants))
    step_dep = _time_dependent(loop)
    region = cand.plan.region
    rowcol = {region.mix_axis, ir.MIX_COL}
    needed = {ld.input for ld in ir.loads(region.mix.expr) if rowcol & set(ld.index)}
    out = []
    for k, src in enumerate(cand.plan.sources):
        v = None
        if k not in needed:         # not read by the pattern analysis (ssmc.sparsity)
            out.append(None)
            continue
        try:
            with torch.no_grad():
                if src[0] == "outer":
                    v = ev(src[1], [MAX_EVAL_NODES])
                elif src[0] == "pre" and src[1] not in step_dep:
                    # a loop invariant computed in the step ((A * mask).T): run that part of the
                    # step body on the invariants' values
                    mod, takes = _sub_graph(loop, [src[1]], {})
                    if all(p in invs for p in takes) and len(mod.graph.nodes) <= MAX_EVAL_NODES:
                        v = mod(*[ev(invs[p], [MAX_EVAL_NODES]) for p in takes])[0]
        except Exception:       # anything not evaluable here counts as nonzero everywhere
            v = None
        out.append(v if isinstance(v, torch.Tensor) else None)
    return out


class _Unknown(Exception):
    pass


class BlockSparse(Pass):
    """Expects: candidates with a plan. Leaves: on regions with a non-diagonal transition, the
    block size, nonzero blocks and density (`region.mix`), and a note with the block mask."""
    name = "block_sparse"
    after = "fuse_epilogue"

    def run(self, ctx) -> bool:
        changed = False
        for cand in ctx.live():
            region = cand.plan.region
            if region.mix is None:
                continue
            n = shape(cand.rec.prev)[region.axes.index(region.mix_axis)]
            vals = example_values(ctx, cand)
            # what the kernel multiplies (a transition along another axis: as held, that axis last)
            pat = transition_pattern(region.mixed_last()[0], vals, n, diag=False).cpu()
            b = choose_block(pat)
            bp = block_pattern(pat, b)
            mix = dataclasses.replace(region.mix, block=b, nblocks=n // b,
                                      blocks=tuple((int(r), int(c)) for r, c in bp.nonzero().tolist()))
            cand.plan.region = dataclasses.replace(region, mix=mix)
            cand.notes.append(f"block mask: {b}x{b} blocks of a {n}x{n} transition, {len(mix.blocks)}/"
                              f"{mix.nblocks ** 2} nonzero (density {mix.density:.1%}, "
                              f"{int(pat.sum())}/{n * n} entries may be nonzero; the diagonal a_t is applied apart)")
            if mix.nblocks <= 32:
                cand.notes.append("block mask (# nonzero):\n" + "\n".join("        " + r for r in mix.mask_text().splitlines()))
            changed = True
        return changed
