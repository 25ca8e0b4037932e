"""sink_consumers: move the work done after a loop on its stacked steps into the step body.

Code that collects the states and reads them out afterwards (``hs = torch.stack(hs, 1)``, or
``hs[:, t] = h`` into a buffer, then
``(hs @ C.unsqueeze(-1)).squeeze(-1)``; ``_, hs = associative_scan(...)`` then a matmul; a
final state taken as ``hs[:, -1]``) would have the region write every state, (b, L, d, n),
for a readout that needs one number a channel. An op on the stacked steps that treats their
time dim as a batch dim (elementwise, its other operands read at the same step or constant in
time; a sum or a contraction over other dims; a view that keeps the time dim) equals the op
applied to each step, so it can run in the step, where fuse_epilogue finds it. Taking the step
at the last index is the value after the last step.

A chain moves only when it reaches such a readout (a sum or contraction) or the last step;
after a readout only elementwise ops and views follow it in. No op may make the steps larger:
a dim of size > 1 that only another operand has (``y @ W_out``, an expand) stops the chain. Operands computed after the loop
in graph order move before it when they do not depend on any loop. What stays after the loop
keeps reading the stacked steps, which the region then still writes.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ssmc.capture import _fake_mode
from ssmc.loop import Loop, Read, Result
from ssmc.lower import _is_alloc
from ssmc.ops import canonical, impure, shape, value

from .base import Pass


class SinkConsumers(Pass):
    """Expects: candidates with their step bodies (reroll). Leaves: the same loops with the
    per-step work done on their stacked results after the loop moved into the body, each moved
    op a new result or internal to the step; results nothing reads any more dropped."""
    name = "sink_consumers"
    after = "reroll"

    def run(self, ctx) -> bool:
        owned = set()
        for c in ctx.candidates:
            owned |= _owned(c.loop)
        changed = False
        for cand in ctx.live():
            mode = _fake_mode(ctx.gm.graph)
            if mode is None:
                continue
            moved = _Sink(ctx.gm, cand.loop, owned, mode).run()
            owned |= _owned(cand.loop)
            if moved:
                changed = True
                cand.notes.append(f"{cand.name}: {moved} op(s) done after the loop on its stacked steps "
                                  f"run in the step instead (sink_consumers)")
        if changed:
            ctx.gm.graph.lint()
            ctx.gm.recompile()
        return changed


def _owned(lp: Loop) -> set:
    out = set(lp.erase) | set(lp.made)
    for r in lp.results:
        out |= set(r.replace) | ({r.buffer} if r.buffer is not None else set())
    return out


@dataclasses.dataclass
class _Step:
    """How one outer node runs in the step: its kind, where time is in its output, and per
    tensor operand: ("sunk", time dim) | ("read", dim, hoist) | ("inv", hoist), hoist the outer
    nodes to move before the loop for it."""
    kind: str                      # "op" | "last"
    j: int = 0
    operands: dict = dataclasses.field(default_factory=dict)
    readout: bool = False          # a sum or contraction is on the way to it


class _Sink:
    def __init__(self, gm, lp: Loop, owned: set, mode):
        self.gm, self.lp, self.owned, self.mode = gm, lp, owned, mode
        self.pos = {n: i for i, n in enumerate(gm.graph.nodes)}

    # -- which nodes can move ------------------------------------------------------------
    def roots(self) -> dict:
        """{outer node standing for a result: (result index, time dim)} for the results whose
        steps sit whole along one dim (no peeled steps, forward time, real values)."""
        out, lp = {}, self.lp
        n = lp.length
        if n is None:                  # a scan: as many steps as its reads have
            sizes = {shape(r.source)[r.dim] - r.start for r in lp.reads if _ints(shape(r.source))}
            n = sizes.pop() if len(sizes) == 1 else None
        for i, (r, v) in enumerate(zip(self.lp.results, self.lp.result_values())):
            if r.kind != "steps" or r.sink not in ("stack", "scan", "setitem") or r.prefix or r.suffix or r.drop_last \
                    or r.reverse or i in self.lp.complex_results or not isinstance(v, fx.Node):
                continue
            if r.sink == "setitem":    # a buffer the loop fills whole, read after its last write
                R = r.buffer           # (in the values' own dtype: a write that rounds is no move)
                if n is not None and n >= 2 and _is_alloc(R) and r.start == 0 and _ints(shape(R)) \
                        and value(R).dtype == value(v).dtype \
                        and r.dim < len(shape(R)) and shape(R)[r.dim] == n and all(self.pos[u] > self.pos[r.replace[-1]]
                                                                    for u in self.users(R)):
                    out[R] = (i, r.dim)
                continue
            for R in r.replace:
                if value(R) is None or not _ints(shape(R)):
                    continue
                if r.dim >= len(shape(R)) or shape(R)[r.dim] != n or n < 2:
                    continue
                out[R] = (i, r.dim)
        self.L = n
        return out

    def run(self) -> int:
        roots = self.roots()
        if not roots:
            return 0
        tdim = {R: k for R, (_, k) in roots.items()}
        readout = {R: False for R in roots}
        steps: dict = {}
        todo = sorted({u for R in roots for u in self.users(R)}, key=self.pos.__getitem__)
        while todo:
            u = todo.pop(0)
            if u in steps or u in tdim:
                continue
            st = self.classify(u, tdim, readout)
            if st is None:
                continue
            steps[u] = st
            if st.kind == "last":
                continue
            tdim[u], readout[u] = st.j, st.readout
            todo = sorted(set(todo) | set(u.users), key=self.pos.__getitem__)
        if not any(st.kind == "last" or st.readout for st in steps.values()):
            return 0
        self.commit(roots, steps)
        return len(steps)

    def users(self, R: fx.Node) -> list:
        """The outer nodes reading R's steps (a filled buffer: all but the loop's writes)."""
        writes = {w for r in self.lp.results if r.buffer is R for w in r.replace}
        return [u for u in R.users if u not in writes]

    def classify(self, u: fx.Node, tdim: dict, readout: dict) -> _Step | None:
        if u.op not in ("call_function", "call_method") or impure(u) or u in self.owned:
            return None
        if value(u) is None or not isinstance(value(u), torch.Tensor) or not _ints(shape(u)):
            return None
        ins = u.all_input_nodes
        sunk = [a for a in ins if a in tdim]
        if not sunk or any(self.reaches_loop(a) for a in ins if a not in tdim):
            return None
        after = any(readout[a] for a in sunk)
        c = canonical(u)
        if c is None:
            return None
        L, out_nd = self.L, len(shape(u))
        if c.kind in ("identity", "view"):
            x = c.args[0]
            if x not in tdim:
                return None
            k = tdim[x]
            if c.kind == "identity":
                return _Step("op", k, {x: ("sunk", k)}, after)
            src, consts = c.params["src"], c.params["consts"]
            if k in consts:            # the last step alone, the other dims as they were
                rest = tuple(d for d in range(len(shape(x))) if d != k)
                if any(w.op == "output" for w in x.users):
                    return None        # the steps are returned too: `y[:, -1]` stays a view of y
                return _Step("last") if consts == {k: L - 1} and tuple(src) == rest else None
            if k not in src or any(d is None and size != 1 for d, size in zip(src, shape(u))):
                return None            # (an expand makes the steps larger: left after the loop)
            j = src.index(k)
            return self.checked(u, _Step("op", j, {x: ("sunk", k)}, after))
        if c.kind == "ew":
            js = {tdim[a] + out_nd - len(shape(a)) for a in sunk}
            if len(js) != 1:
                return None
            j = js.pop()
            if not self.no_new_dims(shape(u), [shape(a) for a in sunk]):
                return None
            ops = {a: ("sunk", tdim[a]) for a in sunk}
            for x in c.tensor_args():
                if x in tdim:
                    continue
                p = j - (out_nd - len(shape(x)))
                how = self.operand(x, p)
                if how is None:
                    return None
                ops[x] = how
            return self.checked(u, _Step("op", j, ops, after))
        if after:                      # one readout a chain
            return None
        if c.kind == "reduce":
            x = c.args[0]
            k, dims = tdim.get(x), c.params["dims"]
            if k is None or k in dims:
                return None
            j = k if c.params["keepdim"] else k - sum(d < k for d in dims)
            return self.checked(u, _Step("op", j, {x: ("sunk", k)}, True))
        if c.kind == "contract":
            subs, out = c.params["subs"], c.params["out"]
            letters = {subs[i][tdim[a]] for i, a in enumerate(c.args) if a in tdim}
            if len(letters) != 1:
                return None
            tau = letters.pop()
            if tau not in out or out.count(tau) != 1:
                return None
            mine = {ch for i, a in enumerate(c.args) if a in tdim for ch in subs[i]}
            if any(ch not in mine and size != 1 for ch, size in zip(out, shape(u))):
                return None            # a dim from the other operand (y @ W_out): no readout
            ops = {}
            for s, x in zip(subs, c.args):
                if not isinstance(x, fx.Node):
                    return None
                if s.count(tau) > 1:
                    return None
                if x in tdim:
                    if s.index(tau) != tdim[x]:
                        return None
                    ops[x] = ("sunk", tdim[x])
                    continue
                how = self.operand(x, s.index(tau) if tau in s else -1)
                if how is None:
                    return None
                ops[x] = how
            return self.checked(u, _Step("op", out.index(tau), ops, True))
        return None

    @staticmethod
    def no_new_dims(out_shape, sunk_shapes) -> bool:
        """Whether every dim of the output larger than 1 is, broadcast right-aligned, a dim of
        one of the operands from the loop: the op makes the steps no larger."""
        for d, size in enumerate(out_shape):
            off = len(out_shape) - d
            if size != 1 and not any(len(sh) >= off and sh[len(sh) - off] == size for sh in sunk_shapes):
                return False
        return True

    def operand(self, x, p: int):
        """How an operand from outside the loop enters the step: read at step t along dim p,
        or the same every step (p < 0: no dim there; or size 1)."""
        if not isinstance(value(x), torch.Tensor) or not _ints(shape(x)):
            return None
        hoist = self.hoistable(x)
        if hoist is None:
            return None
        if p < 0 or shape(x)[p] == 1:
            return ("inv", hoist)
        if shape(x)[p] == self.L:
            return ("read", p, hoist)
        return None

    def checked(self, u, st: _Step) -> _Step | None:
        """st when the outer op, given its operands with one step where time was (size 1),
        gives its output with size 1 at st.j: the op does not depend on how many steps there
        are (no sizes spelled out, no squeeze of every size-1 dim)."""
        if shape(u)[st.j] != self.L or any(a not in st.operands for a in u.all_input_nodes):
            return None

        def one_step(a):
            how, v = st.operands[a], value(a)
            return v.narrow(how[1], 0, 1) if how[0] in ("sunk", "read") else v
        args, kwargs = fx.node.map_arg((u.args, u.kwargs), one_step)
        try:
            with self.mode:
                out = getattr(args[0], u.target)(*args[1:], **kwargs) if u.op == "call_method" \
                    else u.target(*args, **kwargs)
        except Exception:
            return None
        want = list(shape(u))
        want[st.j] = 1
        return st if isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(want) else None

    def reaches_loop(self, x) -> bool:
        """Whether x is computed from what a loop owns (its steps, its results)."""
        seen, todo = set(), [x]
        while todo:
            n = todo.pop()
            if n in seen or not isinstance(n, fx.Node):
                continue
            if n in self.owned:
                return True
            seen.add(n)
            if self.pos[n] > self.pos[self.lp.anchor]:
                todo.extend(n.all_input_nodes)
        return False

    def hoistable(self, x) -> tuple | None:
        """The outer nodes after the loop's anchor that x needs (to move before it), or None
        when one cannot move."""
        a, need, seen, todo = self.pos[self.lp.anchor], [], set(), [x]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if self.pos[n] < a:
                continue
            if n in self.owned or impure(n) or n.op in ("placeholder", "output", "get_attr"):
                return None
            need.append(n)
            todo.extend(n.all_input_nodes)
        return tuple(need)

    # -- moving them ----------------------------------------------------------------------
    def commit(self, roots: dict, steps: dict) -> None:
        lp, g = self.lp, self.lp.body.graph
        hoist = {n for st in steps.values() for how in st.operands.values() if how[0] != "sunk" for n in how[-1]}
        for n in sorted(hoist, key=self.pos.__getitem__):
            lp.anchor.prepend(n)
        out_node = next(n for n in g.nodes if n.op == "output")
        vals = lp.result_values()
        bval = {R: vals[i] for R, (i, _) in roots.items()}
        cache: dict = {}
        new_results, new_vals = [], []
        order = sorted(steps, key=self.pos.__getitem__)
        for u in order:
            st = steps[u]
            if st.kind == "last":
                x = u.args[0]
                new_results.append(Result("last", replace=[u]))
                new_vals.append(bval[x])
                continue

            def arg(a, st=st):
                if not isinstance(a, fx.Node):
                    return a
                how = st.operands.get(a)
                if how is None:
                    raise AssertionError(f"{a} has no place in the step")
                key = (a, how[0], how[1] if how[0] != "inv" else None)
                if key not in cache:
                    cache[key] = self.enter(a, how, bval, out_node)
                return cache[key]
            with g.inserting_before(out_node):
                n = g.node_copy(u, arg)
                n.meta = {}
                n.meta["example_value"] = self.fake(n)
                bval[u] = self.call(out_node, torch.select, (n, st.j, 0))
            if any(w not in steps for w in u.users):
                new_results.append(Result("steps", "stack", st.j, [u]))
                new_vals.append(bval[u])
        # results whose outer nodes nobody outside the moved ops reads any more go
        def read_after(r):
            return [r.buffer] if r.sink == "setitem" else r.replace
        keep = [i for i, r in enumerate(lp.results)
                if not (read_after(r) and all(R in roots for R in read_after(r))
                        and all(w in steps for R in read_after(r) for w in self.users(R)))]
        carry_out = lp.carry_outputs()
        lp.results = [lp.results[i] for i in keep] + new_results
        out_node.args = ((*carry_out, *[vals[i] for i in keep], *new_vals),)
        lp.complex_results = frozenset(keep.index(i) for i in lp.complex_results if i in keep)
        lp.erase.extend(order)
        g.eliminate_dead_code()
        lp.body.recompile()

    def enter(self, a, how, bval, out_node):
        """The body value standing for outer operand `a` at step t, with a size-1 dim where
        time was, so the outer op applies unchanged."""
        lp, g = self.lp, self.lp.body.graph
        if how[0] == "sunk":
            return self.call(out_node, torch.unsqueeze, (bval[a], how[1]))
        if how[0] == "read":
            with self.mode:
                meta = torch.select(value(a), how[1], 0)
            invs = lp.invariant_nodes()
            with g.inserting_before(invs[0] if invs else next(n for n in g.nodes if n.op != "placeholder")):
                ph = g.placeholder(f"read_{len(lp.reads)}")
            ph.meta["example_value"] = meta
            lp.reads.append(Read(a, how[1], 0))
            return self.call(out_node, torch.unsqueeze, (ph, how[1]))
        with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
            ph = g.placeholder(f"inv_{len(lp.invariants)}")
        ph.meta["example_value"] = value(a)
        lp.invariants.append(a)
        return ph

    def call(self, before, target, args) -> fx.Node:
        g = self.lp.body.graph
        with g.inserting_before(before):
            n = g.call_function(target, args)
        n.meta["example_value"] = self.fake(n)
        return n

    def fake(self, n: fx.Node):
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["example_value"])
        with self.mode:
            if n.op == "call_method":
                return getattr(args[0], n.target)(*args[1:], **kwargs)
            return n.target(*args, **kwargs)


def _ints(sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)
