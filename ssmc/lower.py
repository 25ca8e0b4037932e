"""Lowering: replace a re-rolled loop in the outer graph by one call of ``torch.ops.ssmc.region``,
with what the plan says runs before it (state-free step values the kernel does not compute,
vmapped over time) and after it (unfused outputs, vmapped over time), and the loop's results
rerouted: stacked outputs, ``out[:, t] = y`` buffers, final states, scan outputs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import ir
from .ops import dtype, impure, mutated, same_shape, shape, value

_ALLOC = {torch.empty, torch.zeros, torch.empty_like, torch.zeros_like, torch.ones, torch.full,
          "new_empty", "new_zeros", "new_full", "new_ones"}


def _sub_graph(loop, wanted: list, cut: dict):
    """A GraphModule computing `wanted` body nodes from body placeholders and `cut` nodes
    (which become placeholders too). Returns (module, list of body nodes it takes)."""
    need, stack = set(), list(wanted)
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in need:
            continue
        need.add(n)
        if n in cut or n.op == "placeholder":
            continue
        stack.extend(n.all_input_nodes)
    g, env, takes = fx.Graph(), {}, []
    for n in loop.body.graph.nodes:
        if n in need and (n.op == "placeholder" or n in cut):
            env[n] = g.placeholder(n.name)
            takes.append(n)
    for n in loop.body.graph.nodes:
        if n in need and n not in env and n.op != "output":
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[w] if isinstance(w, fx.Node) else w for w in wanted))
    return fx.GraphModule(loop.body, g), takes


def _vmap_safe(mod: fx.GraphModule) -> fx.GraphModule:
    """`mod` with ``select_scatter(x, v, d, i)`` written as ``slice_scatter(x, v.unsqueeze(d), d,
    i, i + 1)``: the same values, but under torch.func.vmap select_scatter's gradient is wrong
    (torch 2.13: every input of a vmapped ``select_scatter(zeros, v, 0, 1)`` gets a wrong
    gradient; slice_scatter's is right; `tests/test_forms.py::test_slot_write_gradients`)."""
    g = mod.graph
    changed = False
    for n in list(g.nodes):
        fn = n.op == "call_function" and n.target is torch.select_scatter
        meth = n.op == "call_method" and n.target == "select_scatter"
        if not (fn or meth) or n.kwargs or len(n.args) != 4:
            continue
        x, v, d, i = n.args
        if not isinstance(i, int) or not isinstance(d, int):
            continue
        if i < 0:                  # counted from the end: the size makes it a start
            size = shape(x)[d] if isinstance(x, fx.Node) and shape(x) is not None else None
            if not isinstance(size, int):
                continue
            i %= size
        with g.inserting_before(n):
            u = g.call_function(torch.unsqueeze, (v, d))
            r = g.call_function(torch.slice_scatter, (x, u, d, i, i + 1))
        r.meta.update(n.meta)
        n.replace_all_uses_with(r)
        g.erase_node(n)
        changed = True
    if changed:
        mod.recompile()
    return mod


class _Vmapped:
    """A step function applied to all steps at once (torch.func.vmap over time)."""

    def __init__(self, fn, in_dims):
        self.fn, self.in_dims = _vmap_safe(fn) if isinstance(fn, fx.GraphModule) else fn, tuple(in_dims)
        self.__name__ = "ssmc_vmap_steps"

    def __call__(self, *args):
        if all(d is None for d in self.in_dims):
            return self.fn(*args)
        # random ops (dropout on a step's input) draw anew for every step, as the loop did
        return torch.func.vmap(self.fn, in_dims=self.in_dims, out_dims=0, randomness="different")(*args)


class Lowering:
    def __init__(self, gm: fx.GraphModule, cand, key: str, keep=frozenset()):
        self.gm, self.g, self.cand, self.key = gm, gm.graph, cand, key
        self.loop, self.plan = cand.loop, cand.plan
        self.keep = keep          # nodes made for loops lowered later: no dead code yet

    def _device(self):
        """The device of the region's tensor inputs (where a number given at run time goes)."""
        for src in self.plan.sources:
            v = value(src[1]) if src[0] in ("outer", "pre") else None
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    def _narrow(self, node, dim, start):
        L = self.loop.length
        if dim is None or L is None or (start == 0 and shape(node)[dim] == L):
            return node
        return self.g.call_function(torch.narrow, (node, dim, start, L))

    def _body_input(self, ph, last=False):
        """The outer value for a body placeholder, with its vmap in_dim."""
        lp = self.loop
        reads, invs = lp.read_nodes(), lp.invariant_nodes()
        if ph in reads:
            r = lp.reads[reads.index(ph)]
            src = self._narrow(r.source, r.dim, r.start)
            if last:
                n = shape(src)[r.dim] if lp.length is None else lp.length
                return self.g.call_function(torch.select, (src, r.dim, (n - 1) if lp.length else -1)), None
            return src, r.dim
        if ph in invs:
            return lp.invariants[invs.index(ph)], None
        raise ValueError(f"{ph.name} is not available outside the loop")

    def run(self, finish: bool = True):
        """Insert the region call and route the loop's results to it. `finish=False` leaves the
        loop's nodes and dead code in place (a split loop's pieces are finished together);
        `values` holds the outer value of each result afterwards."""
        lp, plan, g = self.loop, self.plan, self.g
        with g.inserting_before(lp.anchor):
            pre_vals = self._pre()
            ins = []
            for i, src in enumerate(plan.sources):
                if src[0] == "outer" and not isinstance(value(src[1]), torch.Tensor):   # a symbolic number
                    ins.append(g.call_function(torch.scalar_tensor, (src[1],), {
                        "dtype": ir.to_dtype(plan.region.inputs[i].dtype), "device": self._device()}))
                elif src[0] == "outer" and i == plan.region.length[0] and i not in _loaded(plan.region):
                    # read for its length alone (a state no per-step input drives): no gradient
                    ins.append(g.call_method("detach", (self._narrow(src[1], src[2], src[3]),)))
                elif src[0] == "outer":
                    ins.append(self._narrow(src[1], src[2], src[3]))
                elif src[0] == "pre":
                    ins.append(pre_vals[src[1]])
                else:
                    init = lp.carry_init[0]
                    for _ in range(len(plan.region.axes) - len(shape(init) or ())):
                        init = g.call_method("unsqueeze", (init, 0))   # (H,) broadcast to (b, H)
                    ins.append(init)
            for i, (spec, src) in enumerate(zip(plan.region.inputs, plan.sources)):
                # integer inputs are read as the state's float dtype (assemble's InputSpec)
                v = value(lp.carry_init[0] if src[0] == "init" else src[1])
                have = v.dtype if isinstance(v, torch.Tensor) else None
                want = ir.to_dtype(spec.dtype)
                if have is not None and have != want and not (have.is_floating_point or have == torch.bool):
                    ins[i] = g.call_method("to", (ins[i], want))
            call = g.call_function(torch.ops.ssmc.region.default, (self.key, ins))
            outs = [g.call_function(operator.getitem, (call, i)) for i in range(len(plan.region.outputs))]
            vals = []
            for r, how in zip(lp.results, plan.results):
                if how[0] == "out":
                    v = outs[how[1]]
                    if r.reverse:          # a reverse-time loop: its steps, last first
                        v = g.call_function(torch.flip, (v, [r.dim]))
                    if how[2] is not None:
                        v = g.call_function(torch.flatten, (v, how[2], how[2] + 1))
                    if r.kind != "last":   # laid out as eager's stack or cat (a target may not)
                        v = g.call_method("contiguous", (v,))
                else:
                    v = self._post(r, how[1], outs)
                want = dtype(r.buffer) if r.sink == "setitem" else None
                have = ir.to_dtype(plan.region.outputs[how[1]].dtype) if how[0] == "out" else None
                if want is not None and want != have and len(vals) not in lp.complex_results:
                    v = g.call_method("to", (v, want))     # as each write into the buffer casts
                if len(vals) in lp.complex_results:     # real (..., 2) pairs -> complex
                    v = g.call_function(torch.view_as_complex, (g.call_method("contiguous", (v,)),))
                vals.append(v)
        pulled = []
        for r, how, v in zip(lp.results, plan.results, vals):
            chain = how[3] if how[0] == "out" and len(how) > 3 else None
            if chain:      # elementwise work after the loop that the region now computes
                chain[-1].replace_all_uses_with(v)
                pulled.extend(chain)
            else:
                self._reroute(r, v)
        for n in reversed(pulled):
            g.erase_node(n)
        self.values = vals
        if finish:
            finish_lowering(self.gm, lp.erase, self.keep)


    def _pre(self) -> dict:
        pre = [s[1] for s in self.plan.sources if s[0] == "pre"]
        if not pre:
            return {}
        out = {}
        from .assemble import _time_dependent
        dep = _time_dependent(self.loop)
        for group in ([n for n in pre if n in dep], [n for n in pre if n not in dep]):
            if not group:
                continue
            mod, takes = _sub_graph(self.loop, group, {})
            args, dims = zip(*(self._body_input(p) for p in takes)) if takes else ((), ())
            fn = self.g.call_function(_Vmapped(mod, dims), tuple(args))
            for i, n in enumerate(group):
                out[n] = self.g.call_function(operator.getitem, (fn, i))
        return out

    def _post(self, r, v, outs):
        """An unfused result: the step function from the region's stacked outputs."""
        plan = self.plan
        if not isinstance(v, fx.Node):
            raise ValueError("a constant per-step result")
        cut = dict(plan.boundary)
        mod, takes = _sub_graph(self.loop, [v], cut)
        last = r.kind == "last"
        args, dims = [], []
        for p in takes:
            if p in cut:
                o = outs[cut[p]]
                if last:
                    o = self.g.call_function(torch.select, (o, 0, -1))
                args.append(o)
                dims.append(None if last else 0)
            else:
                a, d = self._body_input(p, last)
                args.append(a)
                dims.append(d)
        res = self.g.call_function(operator.getitem, (self.g.call_function(_Vmapped(mod, dims), tuple(args)), 0))
        if last:
            return res
        res = self.g.call_function(torch.movedim, (res, 0, r.dim))
        if r.reverse:
            res = self.g.call_function(torch.flip, (res, [r.dim]))
        if r.sink == "cat":
            res = self.g.call_function(torch.flatten, (res, r.dim, r.dim + 1))
        # laid out as eager's stack, cat or buffer (contiguous), not time-major: user code may
        # `.view` it
        return self.g.call_method("contiguous", (res,))

    def _reroute(self, r, v):
        g = self.g
        if r.sink == "setitem":
            buf = r.buffer
            writes = set(r.replace)
            later = [u for u in buf.users if u not in writes]
            n = self.loop.length
            whole = r.start == 0 and shape(buf)[r.dim] == n
            laid = _contiguous(value(buf))
            # (a buffer laid out otherwise, `zeros_like` of a transposed tensor, is written into, so
            # that what reads it sees eager's strides: a later `.view` of it works as in eager)
            if whole and laid and _is_alloc(buf) and all(_after(u, r.replace[-1]) for u in later):
                for u in later:
                    u.replace_input_with(buf, v)
                return
            with g.inserting_before(r.replace[-1].next):     # buf[..., start:start + L, ...] = v
                idx = (slice(None),) * r.dim + (slice(r.start, r.start + n),)
                g.call_function(operator.setitem, (buf, idx, v))
            return
        if r.drop_last:                # the sink holds every step's value but the last's
            with g.inserting_before(r.replace[0]):
                v = g.call_function(operator.getitem, (v, (slice(None),) * r.dim + (slice(None, -1),)))
                v = g.call_method("contiguous", (v,))
        if r.prefix or r.suffix:       # peeled steps around the loop's
            with g.inserting_before(r.replace[0]):
                if r.sink == "stack":
                    parts = [g.call_function(torch.stack, (list(p), r.dim)) for p in (r.prefix, r.suffix) if p]
                    parts = ([parts.pop(0)] if r.prefix else []) + [v] + parts
                else:
                    parts = [*r.prefix, v, *r.suffix]
                v = g.call_function(torch.cat, (parts, r.dim))
        for n in r.replace:
            n.replace_all_uses_with(v)


def _contiguous(v) -> bool:
    """Whether a (fake) tensor is laid out contiguously, read off its strides with no guard on
    symbolic sizes (`is_contiguous()` would make Dynamo specialise them)."""
    if not isinstance(v, torch.Tensor):
        return False
    want = 1
    for size, stride in reversed(list(zip(v.shape, v.stride()))):
        if isinstance(size, int) and size == 1:
            continue
        if not same_shape((stride,), (want,)):
            return False
        want = want * size
    return True


def _loaded(r) -> set:
    """The inputs a region's expressions load."""
    exprs = [r.decay, r.drive, *(o.expr for o in r.outputs), *([r.mix.expr] if r.mix is not None else [])]
    return {ld.input for e in exprs for ld in ir.loads(e)}


def finish_lowering(gm: fx.GraphModule, erase: list, keep=frozenset()) -> None:
    """Erase a loop's outer nodes (its writes into buffers too) and what became dead, but for
    `keep` (nodes made for loops lowered later, which nothing uses until then: a reverse
    loop's flipped inputs)."""
    g = gm.graph
    for n in reversed(erase):
        if n.graph is g and not getattr(n, "_erased", False):
            for u in list(n.users):
                if u.op == "call_function" and u.target is operator.setitem:
                    g.erase_node(u)
            g.erase_node(n)
    # in-place writes stay (out.index_add_(...))
    g.eliminate_dead_code(is_impure_node=lambda n: impure(n) or n in keep)
    gm.recompile()


def _is_alloc(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method") and n.target in _ALLOC


def _after(u: fx.Node, ref: fx.Node) -> bool:
    n = ref.next
    while n.op != "root":
        if n is u:
            return True
        n = n.next
    return False


# -- grouped regions ---------------------------------------------------------------------------------

def lower_group(gm: fx.GraphModule, calls: list, key: str, n_out: int) -> None:
    """Replace the region calls of one group's members by one ``torch.ops.ssmc.grouped`` call
    (`n_out`: outputs per member).

    The grouped call goes where the last member's call was (every member's inputs exist there);
    what used an earlier member's outputs between its call and that point (its scatter
    ``out[idx] = y``) moves after the grouped call, in order. Raises ValueError, leaving the
    graph as it was, when moving would reorder a write and a read of one tensor."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    calls = sorted(calls, key=order.get)
    for c in calls:
        for u in c.users:
            if u.op != "call_function" or u.target is not operator.getitem:
                raise ValueError(f"region call {c.name} used by {u.name}, not by indexing")
    if len({len(c.args[1]) for c in calls}) != 1:
        raise ValueError("members with different numbers of inputs")
    first, last = calls[0], calls[-1]
    window = [n for n in g.nodes if order[first] < order[n] < order[last]]
    dep = set(calls[:-1])
    moved = []
    for n in window:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
            if n.target is not operator.getitem or n.args[0] not in calls:
                moved.append(n)
    staying = [n for n in window if n not in dep]
    written = {mutated(n) for n in moved} - {None}
    read_later = {a for n in moved for a in n.all_input_nodes}
    for n in staying:
        if written & (set(n.all_input_nodes) | {n}) or (mutated(n) is not None and mutated(n) in read_later):
            raise ValueError(f"{n.name} reads or writes a tensor an expert's scatter writes")
    flat = [x for c in calls for x in c.args[1]]
    with g.inserting_after(last):
        grouped = g.call_function(torch.ops.ssmc.grouped.default, (key, flat))
    anchor = grouped
    for k, c in enumerate(calls):
        for u in list(c.users):
            with g.inserting_after(anchor):
                v = g.call_function(operator.getitem, (grouped, k * n_out + u.args[1]))
            anchor = v
            u.replace_all_uses_with(v)
            g.erase_node(u)
    for n in moved:
        anchor.append(n)
        anchor = n
    for c in calls:
        g.erase_node(c)
    g.lint()
    gm.recompile()


class _MapPlan:
    boundary: tuple = ()


def lower_map(gm: fx.GraphModule, lp, keep=frozenset()) -> None:
    """A loop that passes nothing from one step to the next (a map over the steps): each result
    becomes the step function vmapped over the steps' reads, one call instead of L unrolled
    steps. Results collected by stack, cat or a scan, or the last step's value, whose shape and
    dtype the vmapped call reproduces (checked on fake tensors first); anything else raises
    ValueError and leaves the graph as it was."""
    if lp.n_carry or lp.gathers or lp.complex_results or lp.anchor is None:
        raise ValueError("not a plain map over the steps")
    for r in lp.results:
        if not (r.kind == "last" or r.sink in ("stack", "cat", "scan")) or r.prefix or r.suffix or r.drop_last \
                or len(r.replace) != 1:
            raise ValueError(f"a result collected by {r.sink or r.kind}")
    low = Lowering.__new__(Lowering)
    low.gm, low.g, low.loop, low.plan, low.keep = gm, gm.graph, lp, _MapPlan(), keep
    before = set(gm.graph.nodes)
    try:
        with gm.graph.inserting_before(lp.anchor):
            vals = [low._post(r, v, []) for r, v in zip(lp.results, lp.result_values())]
        _fake_check(gm, [n for n in gm.graph.nodes if n not in before])
        for r, v in zip(lp.results, vals):
            want, got = value(r.replace[0]), value(v)
            if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
                raise ValueError(f"the vmapped steps give {tuple(got.shape)} {got.dtype}, the loop "
                                 f"{tuple(want.shape)} {want.dtype}")
    except Exception:
        for n in reversed([n for n in gm.graph.nodes if n not in before]):
            gm.graph.erase_node(n)
        raise
    for r, v in zip(lp.results, vals):
        low._reroute(r, v)
    finish_lowering(gm, lp.erase, keep)


def _fake_check(gm: fx.GraphModule, nodes) -> None:
    """Example values for new nodes, computed on the graph's fake tensors (raises where a node
    cannot run on them)."""
    from .capture import _Builder, _fake_mode
    b = _Builder(gm.graph, _fake_mode(gm.graph))
    for n in nodes:
        b.example(n)
