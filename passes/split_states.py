"""split_states: a loop that carries several states becomes one loop per state.

Expects candidates with a step body (reroll). Leaves, for a loop carrying k values, k candidates
of one carried value each (`Candidate.split` ties them together), in an order where every loop
comes after the loops whose states it reads; other candidates are left alone.

Two accumulators updated side by side (RWKV's numerator and denominator), an mLSTM's matrix
memory and its normaliser, a cascade (h2 = a * h2 + h1): each state's update may read its own
previous value and the new values of states earlier in that order, never each other in a
cycle (a coupled system is declined with the two states named). What a step computes from
several states (``num / den``) goes to the last loop among the states it reads; the values it
takes from earlier loops (``num + e^k v``, computed from one state only) are stacked outputs
of those loops, read by the later loop step by step like any input. Each loop is then proved,
fused and compiled on its own; the backend lowers a split loop's pieces together, and when one
piece is declined they all run as written.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch
import torch.fx as fx

from ssmc.capture import _fake_mode
from ssmc.loop import Loop, Read, Result
from ssmc.ops import dtype, shape

from .base import Candidate, Decline, Pass


@dataclasses.dataclass
class Split:
    """The pieces of one split loop (in lowering order) and what they replace together."""
    name: str
    members: list                        # Candidates, earlier states first
    erase: list                          # the outer nodes of the loop (erased once, at the end)
    bridges: dict                        # stand-in outer node -> the piece whose output it is


class SplitStates(Pass):
    """Expects: candidates with a step body. Leaves: one candidate per carried value of a loop
    that carries several, tied by `Candidate.split`; a loop whose states update each other is
    declined with the reason."""
    name = "split_states"
    after = "reroll"

    def run(self, ctx) -> bool:
        out, changed = [], False
        for cand in ctx.candidates:
            if cand.declined is not None or cand.loop.n_carry < 2:
                out.append(cand)
                continue
            try:
                loops, bridges, text = split(ctx.gm, cand.loop)
            except Decline as e:
                cand.decline(self.name, str(e))
                out.append(cand)
                continue
            group = Split(cand.loop.name, [], list(cand.loop.erase), bridges)
            for lp in loops:
                member = Candidate(loop=lp, split=group)
                member.notes.append(f"split from {group.name} (it carries {len(loops)} states): {text[lp.name]}")
                group.members.append(member)
            group.bridges = {d: group.members[i] for d, i in bridges.items()}
            out.extend(group.members)
            changed = True
        ctx.candidates[:] = out
        return changed


def split(gm: fx.GraphModule, lp: Loop):
    """(loops, {stand-in node: index of the loop that makes it}, {loop name: note})."""
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
    for i, o in enumerate(outs):
        if i not in S[o]:
            raise Decline(f"the carried value {names[i]} does not depend on its previous value "
                          "(a value passed from one step to the next, not a state)")
    order = _topo(k, {i: S[outs[i]] - {i} for i in range(k)}, names)
    pos = {c: p for p, c in enumerate(order)}
    results = lp.result_values()

    def owner(v) -> int:
        deps = S.get(v, frozenset()) if isinstance(v, fx.Node) else frozenset()
        return max(deps, key=pos.get) if deps else order[0]

    roots = {i: [outs[i]] for i in range(k)}
    own_results = {i: [] for i in range(k)}
    for j, v in enumerate(results):
        own_results[owner(v)].append(j)
        if isinstance(v, fx.Node):
            roots[owner(v)].append(v)
    bridges = {i: [] for i in range(k)}         # per state: nodes later loops read per step
    needed = {}
    for i in reversed(order):
        todo = roots[i] + bridges[i]
        seen = set()
        while todo:
            n = todo.pop()
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            src = S[n]
            if len(src) == 1 and next(iter(src)) != i:
                (j,) = src
                if n in carries:
                    raise Decline(f"the step reads the state before the update of {names[j]} "
                                  f"together with other states")
                if n not in bridges[j]:
                    bridges[j].append(n)
                continue
            todo.extend(n.all_input_nodes)
        needed[i] = seen
    mode = _fake_mode(gm.graph)
    length = lp.length or shape(lp.reads[0].source)[lp.reads[0].dim] - lp.reads[0].start
    stand_in = {}
    with gm.graph.inserting_before(lp.anchor):
        for i in order:
            for b in bridges[i]:
                ex = b.meta.get("example_value")
                size = (length, *shape(b))
                d = gm.graph.call_function(torch.empty, (size,), {"dtype": dtype(b), "device": ex.device})
                with (mode if mode is not None else nullcontext()):
                    d.meta["example_value"] = torch.empty(size, dtype=dtype(b), device=ex.device)
                stand_in[b] = d
    loops, made_by, text = [], {}, {}
    for i in order:
        name = f"{lp.name}.{i}"
        sub = _piece(gm, lp, i, needed[i], own_results[i], bridges[i], stand_in, name, length)
        for b in bridges[i]:
            made_by[stand_in[b]] = len(loops)
        loops.append(sub)
        reads_from = sorted({str(b) for b in needed[i] if b in stand_in and b not in bridges[i]})
        parts = [f"state {names[i]}"]
        if bridges[i]:
            parts.append(f"its per-step values {', '.join(map(str, bridges[i]))} feed later pieces")
        if reads_from:
            parts.append(f"reads {', '.join(reads_from)} from earlier pieces")
        text[name] = "; ".join(parts)
    return loops, made_by, text


def _topo(k: int, deps: dict, names: list) -> list:
    order, done, visiting = [], set(), []

    def visit(i):
        if i in done:
            return
        if i in visiting:
            cyc = visiting[visiting.index(i):]
            raise Decline(f"the carried values {' and '.join(names[c] for c in cyc)} update each "
                          "other (a coupled system of states); ssmc splits states whose updates "
                          "read each other one way only")
        visiting.append(i)
        for j in sorted(deps[i]):
            visit(j)
        visiting.pop()
        done.add(i)
        order.append(i)
    for i in range(k):
        visit(i)
    return order


def _piece(gm, lp: Loop, i: int, needed: set, own: list, bridges: list, stand_in: dict, name: str,
           length: int) -> Loop:
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
    for b in (n for n in old.nodes if n in needed and n in stand_in and n not in bridges):
        env[b] = g.placeholder(f"read_{len(reads)}")
        env[b].meta["example_value"] = b.meta.get("example_value")
        reads.append(Read(stand_in[b], 0, 0))
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
                made=[stand_in[b] for b in bridges])
