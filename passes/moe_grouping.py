"""moe_grouping: per-expert loops over gathered sequences -> one grouped launch.

Expects candidates with plans (after fuse_epilogue). A mixture of experts written the naive way
is a Python loop over experts, each gathering its sequences (``x[idx]``, ``x.index_select(0,
idx)``), running its own time loop with its own parameters and state size, and scattering the
result back; Dynamo unrolls it into one loop (candidate) per expert. This pass finds the loops
that

- compute one region structure: the same IR up to input names and sizes (state sizes are read
  from the inputs, so experts with d_state 8 and 64 print alike); an expert with one sequence,
  whose IR Dynamo specialised (size-1 dims are not axes), joins when its IR is the group's IR
  with those axes pinned to index 0;
- read a gather of one common tensor, each expert by its own index;
- do not read each other's results (so they can all run at once).

Leaves ``ctx.groups``: one `Group` per set of at least two such candidates. Lowering replaces
the members' region calls by one ``torch.ops.ssmc.grouped`` call; the grouped kernel (ssmc/
targets/moe.py) runs all experts in one launch, each group's state tile padded to the next
power of two of its own state size only. Candidates it cannot group keep their own regions,
with the reason as a note.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from ssmc.ir import Load, Op, OutputSpec, Reduce, Region, walk
from ssmc.ops import UNBACKED, reaches, shape

from .base import Pass


@dataclasses.dataclass
class Group:
    name: str
    members: list            # Candidates, in graph order
    region: Region           # the IR every member runs (the canonical member's)
    source: str              # the gathered tensor's name, e.g. "l_x_"
    scatter: str             # how the results go back ("setitem", "index_copy", ...; "" unseen)
    state_sizes: list        # per member: the state shape at capture time (hints for sizes)


def hint(s) -> int:
    """A size at capture time; -1 when it is data-dependent (known only at run time)."""
    if isinstance(s, torch.SymInt):
        h = getattr(s.node, "hint", None)
        return int(h) if h is not None else -1
    return -1 if s >= UNBACKED else int(s)


# -- structure -------------------------------------------------------------------------------------

def _pin(e, axes: frozenset, memo: dict):
    """`e` with loads along `axes` pinned to index 0 (what assemble builds for a size-1 dim)."""
    if e in memo:
        return memo[e]
    if isinstance(e, Load):
        out = Load(e.input, tuple(0 if ix in axes else ix for ix in e.index))
    elif isinstance(e, Op):
        out = Op(e.name, tuple(_pin(a, axes, memo) for a in e.args), e.attrs)
    elif isinstance(e, Reduce):
        kept = tuple(a for a in e.axes if a not in axes)
        arg = _pin(e.arg, axes, memo)
        out = Reduce(arg, kept, e.op) if kept else arg
    else:
        out = e
    memo[e] = out
    return out


def structure(r: Region, pinned: frozenset = frozenset()) -> tuple:
    """What must agree for two regions to run as one: everything but names and sizes."""
    memo: dict = {}
    outs = tuple((o.kind, tuple(1 if ix in pinned else ix for ix in o.index), o.dtype,
                  _pin(o.expr, pinned, memo)) for o in r.outputs)
    return (r.axes, r.init, r.state_dtype, r.reverse, tuple((s.ndim, s.dtype) for s in r.inputs),
            _pin(r.decay, pinned, memo), _pin(r.drive, pinned, memo), outs)


def _unit_axes(cand) -> frozenset:
    sshape = shape(cand.rec.prev)
    r = cand.plan.region
    return frozenset(a for a, s in zip(r.axes, sshape) if hint(s) == 1)


# -- gathers and scatters --------------------------------------------------------------------------

def gather_of(n) -> tuple | None:
    """(source, index node) when `n` is ``source[idx]`` / ``source.index_select(0, idx)`` with a
    1-d integer index tensor (or ``source[mask]``, a 1-d boolean mask) along dim 0."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return None
    if n.target is operator.getitem and len(n.args) == 2:
        src, idx = n.args
        if isinstance(idx, tuple) and len(idx) >= 1 and all(
                i == slice(None) or i is Ellipsis for i in idx[1:]):
            idx = idx[0]
        if _is_index(idx) and isinstance(src, fx.Node):
            return src, idx
        return None
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name == "index_select":
        src, dim, idx = (list(n.args) + [n.kwargs.get("dim"), n.kwargs.get("index")])[:3]
        if dim == 0 and _is_index(idx) and isinstance(src, fx.Node):
            return src, idx
    return None


def _is_index(idx) -> bool:
    if not isinstance(idx, fx.Node):
        return False
    v = idx.meta.get("example_value", idx.meta.get("val"))
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.dtype in (torch.int64, torch.int32, torch.bool)


def _gathers(roots, limit: int = 256) -> dict:
    """source node -> index node, for every gather among the ancestors of `roots`."""
    out, seen, stack = {}, set(), [r for r in roots if isinstance(r, fx.Node)]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        g = gather_of(n)
        if g is not None:
            out.setdefault(g[0], g[1])
            continue
        stack.extend(n.all_input_nodes)
    return out


_SCATTERS = {"index_copy", "index_copy_", "index_add", "index_add_", "index_put", "index_put_"}


def scatter_kind(results) -> str:
    """How a member's results go back (for the report): the first scatter reached from them."""
    seen, stack = set(), list(results)
    while stack and len(seen) < 32:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u.target is operator.setitem and len(u.args) == 3 and _is_index(u.args[1]):
                return "setitem"
            name = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", "")
            if name in _SCATTERS:
                return name
            stack.append(u)
    return ""


def _outer_inputs(cand) -> list:
    lp = cand.loop
    roots = [r.source for r in lp.reads] + [i for i in lp.invariants if isinstance(i, fx.Node)]
    roots += [c for c in lp.carry_init if isinstance(c, fx.Node)]
    return roots


# -- the pass ------------------------------------------------------------------------------------

class MoeGrouping(Pass):
    """Expects: candidates with plans. Leaves: ``ctx.groups`` (see the module docstring); each
    member gets a note naming its group; declines nothing."""
    name = "moe_grouping"
    after = "block_sparse"

    def run(self, ctx) -> bool:
        live = [c for c in ctx.live() if c.plan is not None and c.rec is not None]
        if len(live) < 2:
            return False
        info = {}                # candidate index -> (gathers, size-1 state axes)
        for i, c in enumerate(live):
            gathers = _gathers(_outer_inputs(c))
            if gathers:
                info[i] = (gathers, _unit_axes(c))
        # a group's IR comes from a member with the fewest size-1 state axes; others join when
        # their IR is that IR with their own size-1 axes pinned
        buckets: dict = {}
        for i in sorted(info, key=lambda i: len(info[i][1])):
            gathers, unit = info[i]
            for src in gathers:
                key = next((k for k in buckets if k[1] is src and unit >= k[2] and
                            structure(live[i].plan.region, unit) == structure(live[k[0]].plan.region, unit)),
                           None)
                if key is None:
                    buckets[(i, src, unit)] = [i]
                else:
                    buckets[key].append(i)
        taken: set = set()
        order = {n: k for k, n in enumerate(ctx.gm.graph.nodes)}
        for (first, src, _), members in buckets.items():
            canon = live[first].plan.region
            members = sorted((i for i in members if i not in taken), key=lambda i: order.get(live[i].loop.anchor, 0))
            if len(members) < 2 or len({info[i][0][src] for i in members}) < len(members):
                continue
            cands = [live[i] for i in members]
            outs = set()
            for c in cands:
                outs.update(c.loop.erase)
            if any(reaches(list(_outer_inputs(c)), outs - set(c.loop.erase)) for c in cands):
                for c in cands:
                    c.notes.append("moe_grouping declined: an expert reads another expert's result")
                continue
            name = f"moe{len(ctx.groups)}"
            results = [n for c in cands for r in c.loop.results for n in r.replace]
            ctx.groups.append(Group(name, cands, canon, src.name, scatter_kind(results),
                                    [tuple(hint(s) for s in shape(c.rec.prev)) for c in cands]))
            taken.update(members)
            for c in cands:
                c.notes.append(f"grouped into {name} with {len(cands) - 1} other expert(s) "
                               f"gathering from {src.name}: one launch for all")
        if ctx.groups:
            ctx.note(", ".join(f"{g.name}: {len(g.members)} experts gathered from {g.source}"
                               for g in ctx.groups))
        return bool(ctx.groups)
