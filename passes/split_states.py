"""split_states: a loop that carries several states becomes one loop per state.

Expects candidates with a step body (reroll). Leaves, for a loop carrying k values, k candidates
of one carried value each (`Candidate.split` ties them together), in an order where every loop
comes after the loops whose states it reads; other candidates are left alone.

States that update each other (``p, q = a*p - b*q + x, b*p + a*q``: a rotation written as two
real states; a damped oscillator's position and velocity) are first stacked into one state with
a new last axis, their transition a small matrix per element (`stack_states`), which
detect_recurrence proves and block_sparse runs like any non-diagonal transition. So is a state
whose update reads another one from before that one's update (``h1, h2 = a*h1 + x, b*h2 + h1``,
or h2's line written above h1's): it needs h1 one step back, a row of the stacked transition.

Two accumulators updated side by side (RWKV's numerator and denominator), an mLSTM's matrix
memory and its normaliser, a cascade (h2 = a * h2 + h1): each state's update may read its own
previous value and the new values of states earlier in that order, never each other in a
cycle (those are the stacked groups above). What a step computes from
several states (``num / den``) goes to the last loop among the states it reads; the values it
takes from earlier loops (``num + e^k v``, computed from one state only) are stacked outputs
of those loops, read by the later loop step by step like any input. Each loop is then proved,
fused and compiled on its own; the backend lowers a split loop's pieces together, and when one
piece is declined they all run as written.
"""
from __future__ import annotations

import dataclasses
import operator
from contextlib import nullcontext

import torch
import torch.fx as fx

from ssmc.capture import _Builder, _fake_mode
from ssmc.loop import Loop, Read, Result
from ssmc.ops import canonical, dtype, reaches, shape

from .base import Candidate, Decline, Pass
from .detect_recurrence import LINEAR_EW, _describe


@dataclasses.dataclass
class Split:
    """The pieces of one split loop (in lowering order) and what they replace together."""
    name: str
    members: list                        # Candidates, earlier states first
    erase: list                          # the outer nodes of the loop (erased once, at the end)
    bridges: set                         # stand-in outer nodes later pieces read (earlier pieces' outputs)
    shifted: dict = dataclasses.field(default_factory=dict)   # stand-in of a state's values before
    # each update -> (the stand-in of its new values, its initial value): filled one step late


class SplitStates(Pass):
    """Expects: candidates with a step body. Leaves: one candidate per carried value of a loop
    that carries several, tied by `Candidate.split` (states that update each other stacked into
    one first); what cannot be split or stacked is declined with the reason."""
    name = "split_states"
    after = "reroll"

    def run(self, ctx) -> bool:
        out, changed = [], False
        for cand in ctx.candidates:
            if cand.declined is not None or cand.loop.n_carry < 2:
                out.append(cand)
                continue
            try:
                loops, bridges, text, shifted = split(ctx.gm, cand.loop)
            except Decline as e:
                cand.decline(self.name, str(e))
                out.append(cand)
                continue
            if len(loops) == 1:                  # coupled states stacked into one
                cand.loop = loops[0]
                cand.notes.append(f"{cand.loop.name}: {text[cand.loop.name]}")
                out.append(cand)
                changed = True
                continue
            group = Split(cand.loop.name, [], list(cand.loop.erase), bridges, shifted)
            for lp in loops:
                member = Candidate(loop=lp, split=group, notes=list(cand.notes))
                member.notes.append(f"split from {group.name} (it carries {len(loops)} states): {text[lp.name]}")
                group.members.append(member)
            out.extend(group.members)
            changed = True
        ctx.candidates[:] = out
        return changed


def split(gm: fx.GraphModule, lp: Loop):
    """(loops, the stand-in nodes later loops read, {loop name: note}, the shifted stand-ins: see
    `Split.shifted`)."""
    if lp.complex_results:
        raise Decline("a loop carrying several complex states is not split")
    body = lp.body.graph
    carries, outs = lp.carry_nodes(), lp.carry_outputs()
    k = len(carries)
    names = [str(o) for o in outs]
    for i, o in enumerate(outs):
        if not isinstance(o, fx.Node):
            raise Decline(f"the carried value {names[i]} is not a tensor computed in the step")
    # which carried values each node depends on
    S: dict = {}
    for n in body.nodes:
        if n.op == "placeholder":
            S[n] = frozenset([carries.index(n)]) if n in carries else frozenset()
        elif n.op != "output":
            S[n] = frozenset().union(*(S[a] for a in n.all_input_nodes))
    deps = {i: S[outs[i]] - {i} for i in range(k)}
    # an update that reads another state's value from before that state's update (``h1, h2 =
    # a*h1 + x, b*h2 + h1``; h2's update written first) needs h1 one step back: the two go
    # together as one stacked state, like states that update each other
    back = {(j, i) for i in range(k) for j in deps[i]
            if reaches(outs[i], {carries[j]}, through_not=set(outs) - {outs[i]}) and _same_kind(carries[i], carries[j])}
    coupled = _coupled(k, deps, {i for i in range(k) if i not in S[outs[i]]}, back)
    if coupled:                               # one group at a time: the carries renumber
        g = coupled[0]
        stack_states(gm, lp, g)
        late = [(j, i) for j, i in sorted(back) if i in g and j in g and g not in _coupled(k, deps)]
        how = (f"{names[late[0][1]]}'s update reads {names[late[0][0]]} from before its update" if late else
               f"the states {' and '.join(names[i] for i in g)} update each other")
        why = f"{how}: stacked into one state with a last axis of {len(g)} ({len(g)}x{len(g)} transition blocks)"
        if lp.n_carry == 1:
            return [lp], set(), {lp.name: why}, {}
        loops, stand_ins, text, shifted = split(gm, lp)
        return loops, stand_ins, {k: f"{why}; {v}" for k, v in text.items()}, shifted
    for i, o in enumerate(outs):
        if i not in S[o]:
            raise Decline(f"the carried value {names[i]} does not depend on its previous value "
                          "(a value passed from one step to the next, not a state)")
    order = _topo(k, deps)
    pos = {c: p for p, c in enumerate(order)}
    results = lp.result_values()

    def latest(v):
        deps = S.get(v, frozenset()) if isinstance(v, fx.Node) else frozenset()
        return max(deps, key=pos.get) if deps else None

    def owner(v) -> int:
        o = latest(v)
        return order[0] if o is None else o

    roots = {i: [outs[i]] for i in range(k)}
    own_results = {i: [] for i in range(k)}
    for j, v in enumerate(results):
        own_results[owner(v)].append(j)
        if isinstance(v, fx.Node):
            roots[owner(v)].append(v)
    bridges = {i: [] for i in range(k)}         # per state: nodes later loops read per step
    olds = set()                                 # states whose values before the update later loops read
    needed = {}
    for i in reversed(order):
        todo = roots[i] + bridges[i]
        seen = set()
        while todo:
            n = todo.pop()
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            j = latest(n)
            if j is not None and j != i:       # made by the piece of an earlier state
                if _reads_old(n, carries[j], outs[j]):
                    bad = _not_linear(body, carries[j], outs[j])
                    if bad:
                        raise Decline(f"the state {names[j]} goes through {bad}, which is not linear, "
                                      "and other states read it")
                    # its value before the update (torchscale's RetNet: `prev_scale.sqrt()`):
                    # the earlier piece's new values one step late; what reads it is made here
                    if n is carries[j]:
                        olds.add(j)
                        if outs[j] not in bridges[j]:
                            bridges[j].append(outs[j])
                    else:
                        todo.extend(n.all_input_nodes)
                    continue
                if n not in bridges[j]:
                    bridges[j].append(n)
                continue
            todo.extend(n.all_input_nodes)
        needed[i] = seen
    outer = _Builder(gm.graph, _fake_mode(gm.graph))
    length = lp.length or shape(lp.reads[0].source)[lp.reads[0].dim] - lp.reads[0].start
    stand_in, shifted = {}, {}
    for i in order:
        for b in bridges[i]:
            stand_in[b] = outer.call(lp.anchor, torch.empty, ((length, *shape(b)),),
                                     {"dtype": dtype(b), "device": b.meta["example_value"].device})
    for j in olds:
        c = carries[j]
        stand_in[c] = outer.call(lp.anchor, torch.empty, ((length, *shape(c)),),
                                 {"dtype": dtype(c), "device": c.meta["example_value"].device})
        shifted[stand_in[c]] = (stand_in[outs[j]], lp.carry_init[j])
    loops, text = [], {}
    for i in order:
        name = f"{lp.name}.{i}"
        loops.append(_piece(gm, lp, i, needed[i], own_results[i], bridges[i], stand_in, name))
        if i in olds:
            loops[-1].made.append(stand_in[carries[i]])
        reads_from = sorted({str(b) for b in needed[i] if b in stand_in and b not in bridges[i]
                             and b is not carries[i]})
        parts = [f"state {names[i]}"]
        if bridges[i]:
            parts.append(f"its per-step values {', '.join(map(str, bridges[i]))} feed later pieces")
        if reads_from:
            parts.append(f"reads {', '.join(reads_from)} from earlier pieces")
        if i in olds:
            parts.append("its values before each update feed later pieces (its new values one step late)")
        text[name] = "; ".join(parts)
    return loops, set(stand_in.values()), text, shifted


def _not_linear(body: fx.Graph, carry: fx.Node, new: fx.Node) -> str | None:
    """An op on the way from a carried value to its new value that no linear update goes
    through (``max(m + w, k)``, a stabiliser), named as in detect_recurrence's reasons; None if
    every op there may be linear."""
    for n in body.nodes:
        if n.op in ("call_function", "call_method") and reaches(n, {carry}) and reaches(new, {n}):
            c = canonical(n)
            if c is None or (c.kind == "ew" and c.op not in LINEAR_EW):
                return _describe(n)
    return None


def _reads_old(n: fx.Node, carry: fx.Node, new: fx.Node) -> bool:
    """Whether n reads the carried value other than through its new value."""
    return n is not new and reaches(n, {carry}, through_not={new})


def _same_kind(a: fx.Node, b: fx.Node) -> bool:
    return shape(a) == shape(b) and dtype(a) == dtype(b)


def _coupled(k: int, deps: dict, delays: set = frozenset(), back: set = frozenset()) -> list:
    """Groups of two or more states whose updates read each other (strongly connected). A
    `delay` (a carried value computed from other states and not from its own previous value:
    ``hp = h`` before h's update, so that an output can read h_(t-1) and h_t) goes with the
    states it reads: it is their value one step back, a row of their transition. A pair (j, i)
    of `back` (i's update reads j before j's update) is grouped the same way."""
    reach = {i: set(deps[i]) for i in range(k)}
    for i in delays:
        for j in deps[i]:
            reach[j].add(i)
    for j, i in back:
        reach[j].add(i)
    changed = True
    while changed:
        changed = False
        for i in range(k):
            more = set().union(*(reach[j] for j in reach[i])) - reach[i]
            if more:
                reach[i] |= more
                changed = True
    groups, seen = [], set()
    for i in range(k):
        g = sorted({i} | {j for j in reach[i] if i in reach[j]})
        if len(g) > 1 and i not in seen:
            groups.append(g)
            seen.update(g)
    return groups


def stack_states(gm: fx.GraphModule, lp: Loop, group: list) -> None:
    """States that update each other (``p, q = a*p - b*q + x, b*p + a*q``; a second-order
    recurrence carrying h_(t-1)) become one state with a new last axis of len(group): each new
    value is proved linear in every state of the group (detect_recurrence's algebra, one state
    at a time), h'_i = sum_j a_ij h_j + b_i, written as a matrix product along that axis, which
    detect_recurrence then finds as a non-diagonal transition. What read a new value reads its
    slot of the stacked state. Rewrites `lp` in place; Decline when the states differ in shape
    or dtype, or a coefficient depends on a state of the group."""
    from .detect_recurrence import _Linear, _Mat, _fake_mode_outer
    body = lp.body.graph
    carries, outs = lp.carry_nodes(), lp.carry_outputs()
    cs, os_ = [carries[i] for i in group], [outs[i] for i in group]
    names = " and ".join(str(o) for o in os_)
    sshape, dt = shape(cs[0]), dtype(cs[0])
    if any(shape(c) != sshape or dtype(c) != dt for c in cs) or any(shape(o) != sshape for o in os_):
        raise Decline(f"the carried values {names} update each other but differ in shape or dtype")
    if dt is None or not dt.is_floating_point:
        raise Decline(f"the carried values {names} are not floating-point")
    if not all(isinstance(d, int) for d in sshape):
        raise Decline(f"the carried values {names} update each other; stacking them under a symbolic "
                      "size (a recompile for another batch or length) is not supported")
    mode = _fake_mode(lp.body.graph) or _fake_mode_outer(lp)
    b = _Builder(body, mode)
    m = len(group)
    first = next(n for n in body.nodes if n.op != "placeholder")
    out_node = next(n for n in body.nodes if n.op == "output")
    dev = cs[0].meta["example_value"].device

    depends = reaches

    def path_from(c, v):
        dep = {c}
        for n in body.nodes:
            if any(a in dep for a in n.all_input_nodes) and n.op != "output":
                dep.add(n)
        anc, todo = set(), [v]
        while todo:
            n = todo.pop()
            if isinstance(n, fx.Node) and n not in anc and n in dep:
                anc.add(n)
                todo.extend(n.all_input_nodes)
        return anc

    def full(x, anchor):
        """A coefficient as a tensor of the state's shape."""
        if x is None or isinstance(x, (int, float)):
            return b.call(anchor, torch.full, (tuple(sshape), float(x or 0.0)), {"dtype": dt, "device": dev})
        return b.call(anchor, torch.broadcast_to, (x, tuple(sshape)))

    rows, drives = [], []
    for o in os_:
        v, coef = o, []
        for c in cs:
            if not depends(v, {c}):
                coef.append(None)
                continue
            a, v = _Linear(b, c, path_from(c, v), sshape).of(v)
            if isinstance(a, _Mat):
                raise Decline(f"the carried values {names} update each other through a matrix product")
            if isinstance(a, fx.Node) and depends(a, set(cs)):
                raise Decline(f"the update of {o} is not linear in the states {names}")
            coef.append(a)
        if isinstance(v, fx.Node) and depends(v, set(cs)):
            raise Decline(f"the update of {o} is not linear in the states {names}")
        rows.append(coef)
        drives.append(v)
    # the stacked state and the slots of the old states
    with body.inserting_before(cs[0]):
        H = body.placeholder(f"carry_{group[0]}_stacked")
    with (mode if mode is not None else nullcontext()):
        H.meta["example_value"] = torch.stack([c.meta["example_value"] for c in cs], -1)
    for j, c in enumerate(cs):
        with body.inserting_before(first):
            sel = body.call_function(operator.getitem, (H, (Ellipsis, j)))
        sel.meta["example_value"] = c.meta["example_value"]
        c.replace_all_uses_with(sel)
    anchor = out_node
    M = b.call(anchor, torch.stack, ([b.call(anchor, torch.stack, ([full(a, anchor) for a in row], -1))
                                      for row in rows], -2))
    letters = "abcdefgh"[:len(sshape)]
    Mh = b.call(anchor, torch.einsum, (f"{letters}ij,{letters}j->{letters}i", M, H))
    new = b.call(anchor, operator.add, (Mh, b.call(anchor, torch.stack, ([full(d, anchor) for d in drives], -1))))
    eye = b.call(anchor, torch.eye, (m,), {"dtype": dt, "device": dev})
    slots = []
    for j, o in enumerate(os_):
        e = b.call(anchor, operator.getitem, (eye, j))
        slots.append(b.call(anchor, torch.sum, (b.call(anchor, operator.mul, (new, e)), -1)))
    vals = list(out_node.args[0])
    for o, slot in zip(os_, slots):
        for u in list(o.users):
            if u is not out_node and u not in slots:
                u.replace_input_with(o, slot)
        vals = [slot if (v is o and i >= lp.n_carry) else v for i, v in enumerate(vals)]
    keep = [i for i in range(lp.n_carry) if i not in group[1:]]
    carry_vals = [new if i == group[0] else vals[i] for i in keep]
    out_node.args = ((*carry_vals, *vals[lp.n_carry:]),)
    inits = [lp.carry_init[i] for i in group]
    for c in cs:
        body.erase_node(c)
    _resort(body)
    body.eliminate_dead_code()
    lp.body.recompile()
    lp.carry_init[:] = [_stacked_init(gm, lp, inits, sshape, dt) if i == group[0] else lp.carry_init[i] for i in keep]


def _resort(g: fx.Graph) -> None:
    """Order the nodes so that each comes after its inputs, keeping the order they had where
    it already does (the slots read before the stacked update was formed)."""
    pos = {n: i for i, n in enumerate(g.nodes)}
    done, order = set(), []

    def visit(n):
        stack = [(n, False)]
        while stack:
            x, expanded = stack.pop()
            if x in done:
                continue
            if expanded:
                done.add(x)
                order.append(x)
                continue
            stack.append((x, True))
            for a in sorted(x.all_input_nodes, key=pos.get, reverse=True):
                if a not in done:
                    stack.append((a, False))
    for n in list(g.nodes):
        visit(n)
    out = next(n for n in g.nodes if n.op == "output")
    for n in order:
        if n.op not in ("placeholder", "output"):
            out.prepend(n)


def _stacked_init(gm, lp: Loop, inits: list, sshape, dt):
    """The stacked state's initial value: None (zeros) when every part starts at zero."""
    if all(x is None or (isinstance(x, (int, float)) and x == 0) for x in inits):
        return None
    if any(not isinstance(x, fx.Node) and x is not None and x != 0 for x in inits):
        raise Decline("coupled states starting at a non-zero constant")
    ref = next(x for x in inits if isinstance(x, fx.Node))
    outer = _Builder(gm.graph, _fake_mode(gm.graph))
    parts = []
    for x in inits:
        if not isinstance(x, fx.Node):
            x = outer.call(lp.anchor, torch.zeros_like, (ref,))
            lp.made.append(x)
        parts.append(x)
    st = outer.call(lp.anchor, torch.stack, (parts, -1))
    lp.made.append(st)
    return st


def _topo(k: int, deps: dict) -> list:
    """States in an order where each comes after the states it reads (no cycles: coupled groups
    are stacked before this runs)."""
    order, done = [], set()

    def visit(i):
        if i not in done:
            done.add(i)
            for j in sorted(deps[i]):
                visit(j)
            order.append(i)
    for i in range(k):
        visit(i)
    return order


def _piece(gm, lp: Loop, i: int, needed: set, own: list, bridges: list, stand_in: dict, name: str) -> Loop:
    """The loop of state i: its update, the results it owns, the per-step values later pieces
    read (stacked outputs), and the values earlier pieces give it (reads of their outputs)."""
    old = lp.body.graph
    carries, reads_ph, invs_ph = lp.carry_nodes(), lp.read_nodes(), lp.invariant_nodes()
    g = fx.Graph()
    env = {}
    carry = g.placeholder("carry_0")
    carry.meta.update(carries[i].meta)
    env[carries[i]] = carry
    reads, invariants = [], []
    for ph, r in zip(reads_ph, lp.reads):
        if ph in needed:
            env[ph] = g.placeholder(f"read_{len(reads)}")
            env[ph].meta.update(ph.meta)
            reads.append(r)
    for b in (n for n in old.nodes if n in needed and n in stand_in and n not in bridges and n not in env):
        env[b] = g.placeholder(f"read_{len(reads)}")
        env[b].meta["example_value"] = b.meta.get("example_value")
        reads.append(Read(stand_in[b], 0, 0))
    if not reads and lp.reads:       # a state no per-step value drives: a read for the length alone
        g.placeholder("read_0").meta.update(reads_ph[0].meta)
        reads.append(lp.reads[0])
    for ph, inv in zip(invs_ph, lp.invariants):
        if ph in needed:
            env[ph] = g.placeholder(f"inv_{len(invariants)}")
            env[ph].meta.update(ph.meta)
            invariants.append(inv)
    for n in old.nodes:
        if n.op in ("placeholder", "output") or n not in needed or n in env:
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    res_vals = lp.result_values()
    out_vals = [env[lp.carry_outputs()[i]]]
    results = []
    for j in own:
        v = res_vals[j]
        out_vals.append(env[v] if isinstance(v, fx.Node) else v)
        results.append(lp.results[j])
    for b in bridges:
        out_vals.append(env[b])
        results.append(Result("steps", "stack", 0, [stand_in[b]]))
    g.output(tuple(out_vals))
    g.eliminate_dead_code()
    return Loop(name, fx.GraphModule(gm, g), lp.length, [lp.carry_init[i]], reads, invariants,
                results, [], anchor=lp.anchor, origin=lp.origin, foreign=lp.foreign,
                made=[*lp.made, *(stand_in[b] for b in bridges)])
