"""reroll: find the loop in an unrolled Dynamo graph and collapse its L copies into one step.

Expects the Dynamo graph (reads normalized to ``torch.select`` by `ssmc.capture.normalize`).
Leaves one `Candidate` per loop on the context, holding a `Loop` (the step body as a small FX
graph). The outer graph is not changed here: lowering replaces the loop once a region exists.

How: each family of reads of ``X.select(dim, t)`` (any spelling, see `ssmc.capture`) for
consecutive t anchors one loop; the first
use of each read is spaced K nodes apart, K being the size of one iteration. Every node gets a
signature that abstracts the step: reads become "X at this step", values of the same step
"local j", values of the previous step "carried j", everything else "invariant". Iterations
1..L-1 must have equal signatures; iteration 0 may differ only where later iterations read a
carried value, and what it reads there is the initial value. Linear in the graph size.
A ``torch.ops.higher_order.scan`` node already is one step body and is taken as it is.

Also: in-place updates of a tensor the graph allocates become new values first
(`ssmc.capture.functionalize_updates`); indices that go down (``reversed(range(L))``) give a
loop run forward on flipped reads, its results flipped back (`Result.reverse`); a step whose
outputs read the state before its update is cut one step later (`_rotated`); a carried value
computed from the step's inputs alone is recomputed from the previous step's inputs
(`_recompute_delays`).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections import defaultdict

import torch
import torch.fx as fx

from ssmc.capture import (_Builder, _expand_index, _fake_mode, _fresh, _is_int, _maybe_view, _name, _scatter_of,
                          _unit_slice, copies_as_writes, decompose_composites, detach_no_grad_values, diagonal_products, erase_unused,
                          find_reads, forward_stored_values, functionalize_updates, hoist_scalar_arithmetic, metadata_updates_as_values,
                          stack_list_inputs, transformed,
                          unstack, view_root, views_of)
from ssmc.gauge import gauge_states
from ssmc.inlined_scan import find_inlined_scans, symbolic_trees
from ssmc.parallel_form import find_forms, has_parallel_scan, loop_from_form
from ssmc.loop import Loop, Read, Result
from ssmc.ops import ancestors, descendants, impure, is_tensor, mutated, reaches, shape, value as value_of

from .base import Candidate, Pass

log = logging.getLogger("ssmc")


class Reroll(Pass):
    """Expects: a Dynamo FX graph. Leaves: one candidate per unrolled loop or scan node, with
    its step body; loops it cannot re-roll are left alone and listed with the reason."""
    name = "reroll"
    after = None
    required = True

    def run(self, ctx) -> bool:
        hoist_scalar_arithmetic(ctx.gm)
        n = metadata_updates_as_values(ctx.gm)
        if n:
            ctx.note(f"reroll: {n} in-place shape change(s) (squeeze_, ...) of tensors the graph made taken as values")
        n = detach_no_grad_values(ctx.gm)
        if n:
            ctx.note(f"reroll: {n} value(s) computed under no_grad read through .detach() after it")
        n = copies_as_writes(ctx.gm)
        if n:
            ctx.note(f"reroll: {n} copy_ into a view of one index rewritten as writes (out[:, t] = y)")
        n = forward_stored_values(ctx.gm)
        if n:
            ctx.note(f"reroll: {n} read(s) of a slot written earlier (y[:, t - 1]) take the value written")
        n = functionalize_updates(ctx.gm)
        if n:
            ctx.note(f"reroll: {n} in-place update(s) of tensors the graph allocates rewritten as new values")
        loops = []
        hops = {getattr(torch.ops.higher_order, "scan", None): loop_from_scan,
                getattr(torch.ops.higher_order, "associative_scan", None): loop_from_associative_scan}
        hops.pop(None, None)
        for node in list(ctx.gm.graph.nodes):
            if node.op == "call_function" and node.target in hops:
                try:
                    lp = hops[node.target](ctx.gm, node)
                    if _reads_previous_state(lp):       # `y = f(carry)` before the update
                        _delay_previous_states(ctx.gm, lp)
                    loops.append(lp)
                except ValueError as e:
                    ctx.fallbacks.append((node.name, f"{node.target} not taken: {e}"))
        try:
            loops += loops_from_inlined_scans(ctx.gm)
        except Exception as e:      # the search is best effort: the rest of the graph goes on
            log.debug("ssmc: inlined scan search failed", exc_info=True)
            ctx.fallbacks.append(("inlined associative_scan", f"search failed: {type(e).__name__}: {e}"))
        written = []
        try:
            written = loops_from_written_scans(ctx, {n for lp in loops for n in lp.erase})
        except Exception as e:      # best effort, as the inlined scans' search
            log.debug("ssmc: written scan search failed", exc_info=True)
            ctx.fallbacks.append(("written parallel scan", f"search failed: {type(e).__name__}: {e}"))
        loops += written
        taken = {n for lp in written for n in lp.erase}
        loops += _parallel_forms(ctx)
        for n in symbolic_trees(ctx.gm.graph)[:1]:
            ctx.fallbacks.append((n.name, "associative_scan (generic, inlined) not taken: its length is "
                                  "symbolic (Dynamo recompiled for another length), the tree runs as captured"))
        before = len(ctx.fallbacks)
        order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
        spans = [(min(lp.erase, key=order.__getitem__), max(lp.erase, key=order.__getitem__)) for lp in written]
        unrolled = find_unrolled(ctx.gm, ctx, spans)
        if not unrolled:            # a list of per-step tensors passed in: stacked, then searched again
            lists = stack_list_inputs(ctx.gm)
            if lists:
                said = len(ctx.fallbacks)
                unrolled = find_unrolled(ctx.gm, ctx, spans)
                if not unrolled:        # what that search said is about the stacks, now undone
                    del ctx.fallbacks[said:]
                used = {r.source for lp in unrolled for r in lp.reads}
                for st in lists:
                    if st.stack in used or any(r in used for r in st.reads):
                        ctx.note(f"reroll: the {len(st.elements)} tensors of list argument {st.name} were "
                                 "stacked into one (its elements are the steps)")
                    else:
                        unstack(ctx.gm, st)
        if taken:       # a written scan's own nodes: no other loop, nor a word on why they are none
            unrolled = [lp for lp in unrolled if not taken & set(lp.erase)]
            names = {n.name for n in taken}
            ctx.fallbacks[:] = [f for i, f in enumerate(ctx.fallbacks) if i < before or f[0] not in names]
        loops += unrolled
        if not loops and not ctx.fallbacks:
            ctx.note("reroll: no loop here: no tensor is read at consecutive indices (x[:, t], "
                     "select, unbind, narrow, index_select; or every k-th) by steps that repeat, and "
                     "no scan node")
            if has_parallel_scan(ctx.gm.graph):
                ctx.note("reroll: the graph computes a scan in parallel form (a cumsum of log-decays under a "
                         "triangular mask, then exp: a chunked SSD or a decay-masked attention); ssmc captures "
                         "loops and scan nodes, not this form, so it runs as written")
        for i, lp in enumerate(sorted(loops, key=lambda lp: _order(ctx.gm, lp))):
            lp.name = f"loop{i}"
            if decompose_composites(lp.body.graph):
                lp.body.recompile()
            notes = _made_notes(lp)
            diag = diagonal_products(lp)
            if diag:
                decompose_composites(lp.body.graph)
                lp.body.recompile()
                notes.append(f"{lp.name}: {diag} product(s) with a diagonal matrix (torch.diag, diag_embed, eye * v) "
                             "taken as elementwise products")
            try:
                gauged = gauge_states(ctx.gm, lp)
            except Exception as e:      # this loop runs as written; the graph's others go on
                log.debug("ssmc: running maxima of %s failed", lp.name, exc_info=True)
                erase_unused(ctx.gm, lp.made)
                ctx.fallbacks.append((lp.name, "running maxima not taken out of the loop "
                                      f"({type(e).__name__}: {e}); it runs as written"))
                continue
            if gauged:
                notes.append(f"{lp.name}: running maxima {gauged} (m = max(m + a, b), a and b from the step's inputs) "
                             "computed for all steps before the loop (cumsum and cummax, float64); read, not carried")
            ctx.candidates.append(Candidate(loop=lp, notes=notes))
        return bool(loops)


def _parallel_forms(ctx) -> list[Loop]:
    """Chunked SSDs written without a loop (ssmc.parallel_form), each proven by evaluation."""
    try:
        found = find_forms(ctx.gm.graph)
    except Exception as e:      # the search is best effort: the rest of the graph goes on
        log.debug("ssmc: parallel form search failed", exc_info=True)
        ctx.fallbacks.append(("parallel form", f"search failed: {type(e).__name__}: {e}"))
        return []
    loops = []
    for f, _ in found:
        if f is None:
            continue
        try:
            loops.append(loop_from_form(ctx.gm, f))
        except Exception as e:      # that form runs as written
            log.debug("ssmc: parallel form %s failed", f.out.name, exc_info=True)
            ctx.fallbacks.append(("parallel form", f"{f.out.name}: making its loop failed: {type(e).__name__}: {e}"))
    if not loops:
        ctx.fallbacks += [("parallel form", why) for f, why in found if f is None]
    for lp in loops:
        *a, x, B, C = (r.source.name for r in lp.reads)
        what, step = (("a chunked SSD in parallel form (exp of segment sums)", f"h = exp({a[0]}) h") if a else
                      ("chunked linear attention in parallel form (scores masked to zero)", "h = h"))
        ctx.note(f"reroll: {what} proven equal, by a random evaluation at its sizes, to the scan "
                 f"{step} + {x} {B}^T, y = h {C}; taken as that loop")
    return loops


def _made_notes(lp: Loop) -> list[str]:
    """What the outer nodes made for a loop say about how it was read (for `explain`)."""
    notes = []
    tables = [n for n in lp.made if n.target is torch.tensor]
    if tables:
        notes.append(f"{lp.name}: {len(tables)} Python number(s) that change from step to step read from "
                     f"a table of the {lp.length} steps' values")
    strided = [n for n in lp.made if n.target is operator.getitem and isinstance(n.args[1], tuple)
               and any(isinstance(i, slice) and i.step not in (None, 1) for i in n.args[1])]
    if strided:
        k = next(i.step for i in strided[0].args[1] if isinstance(i, slice) and i.step not in (None, 1))
        notes.append(f"{lp.name}: the steps read one index in every {k} (strided views of {len(strided)} input(s))")
    return notes


def _order(gm, lp):
    for i, n in enumerate(gm.graph.nodes):
        if n is lp.anchor:
            return i
    return 0


# -- signatures ------------------------------------------------------------------------------

def _freeze(a, ref):
    if isinstance(a, fx.Node):
        return ref(a)
    if isinstance(a, slice):
        return ("slice", _freeze(a.start, ref), _freeze(a.stop, ref), _freeze(a.step, ref))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, *(_freeze(x, ref) for x in a))
    if isinstance(a, dict):
        return ("dict", *sorted((k, _freeze(v, ref)) for k, v in a.items()))
    try:
        hash(a)
        return a
    except TypeError:
        return ("obj", repr(a))


# ops whose Python-number operand may differ step to step (read from a table at t): arithmetic,
# and comparisons (``x[:, t] * (lengths > t)``, the mask of padded sequences of different lengths)
_ARITH = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, torch.add, torch.sub,
          torch.mul, torch.div, torch.true_divide, torch.pow, torch.rsub,
          operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne,
          torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne,
          torch.greater, torch.less, torch.greater_equal, torch.less_equal}
_ARITH_METHODS = {"add", "sub", "mul", "div", "true_divide", "pow", "rsub",
                  "gt", "lt", "ge", "le", "eq", "ne", "greater", "less", "greater_equal", "less_equal",
                  "__gt__", "__lt__", "__ge__", "__le__"}


def _arith(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _ARITH) or (n.op == "call_method" and n.target in _ARITH_METHODS)


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


class _Segment:
    """Signatures of the nodes in [s, s + L*K) for one candidate start s."""

    def __init__(self, nodes, pos, reads, s, K, L, step=1, numbers=False):
        self.nodes, self.pos, self.s, self.K, self.L = nodes, pos, s, K, L
        self.step = step                   # +1: step k reads index i0 + k; -1: i0 - k (reverse)
        self.numbers = numbers             # Python numbers in arithmetic may differ step to step
        self.depth = 1                     # the most steps back a step reads (`_try_segment`)
        self.e = s + K * L
        # families read at the same indices in every step (a[l] of an inner loop over layers,
        # unrolled inside each step) are loop invariants here, not reads along this loop's time
        # (so are reads made before the loop that every step uses alike: ``a, b = cc[0], cc[1]``)
        seen: dict = defaultdict(lambda: (set(), set()))
        for p in range(s, min(s + 2 * K, len(nodes))):
            for a in (nodes[p], *nodes[p].all_input_nodes):
                r = reads.get(a)
                if r is not None:
                    seen[r[0]][(p - s) // K].add(r[1])
        fixed = {f for f, (a, b) in seen.items() if a and a == b}
        self.reads = {n: r for n, r in reads.items() if r[0] not in fixed} if fixed else reads
        self.strides = self._strides() if step > 0 and L >= 2 else {}
        if self.step > 1 and 1 in self.strides.values():
            self.step = 1                  # the loop's time is the family read once a step

    def _strides(self) -> dict:
        """{family: d} for the families a step reads d indices further on than the step before
        (the last two steps): k[:, 2t] and k[:, 2t + 1] in the step that reads q[:, t] (an inner
        loop of two updates a step). Forward loops only; the rest read at the loop's own step."""
        idx: list = [defaultdict(set), defaultdict(set)]
        b = self.s + (self.L - 2) * self.K
        for p in range(b, min(b + 2 * self.K, len(self.nodes))):
            r = self.reads.get(self.nodes[p])
            if r is not None:
                idx[(p - b) // self.K][r[0]].add(r[1])
        out = {}
        for f in idx[0].keys() & idx[1].keys():
            a, c = sorted(idx[0][f]), sorted(idx[1][f])
            if len(a) == len(c) and len({y - x for x, y in zip(a, c)}) == 1 and c[0] > a[0]:
                out[f] = c[0] - a[0]
        return out

    def stride(self, fam) -> int:
        """How many indices family `fam` advances a step."""
        return self.strides.get(fam, self.step)

    def inside(self, n) -> bool:
        return self.s <= self.pos[n] < self.e

    def it(self, p) -> int:
        return (p - self.s) // self.K

    def sig(self, p):
        n, k = self.nodes[p], self.it(p)
        if n in self.reads:
            fam, idx, rest = self.reads[n]
            return ("read", fam, idx - self.stride(fam) * k, _freeze(rest, str))

        def ref(a):
            pa = self.pos.get(a)
            if pa is not None and self.s <= pa < self.e:
                ka, j = self.it(pa), (pa - self.s) % self.K
                return ("L", j) if ka == k else ("C", j) if ka == k - 1 else ("F", k - ka, j)
            if a in self.reads:
                fam, idx, rest = self.reads[a]
                return ("R", fam, idx - self.stride(fam) * k, _freeze(rest, str))
            return ("I", pa)
        if n.op == "call_function" and n.target is operator.setitem:
            buf, idx, val = n.args
            idx = idx if isinstance(idx, tuple) else (idx,)
            if ref(buf)[0] == "L":         # a buffer of the step's own: its indices are constants
                return ("setitem", ref(buf), _freeze(idx, ref), _freeze(val, ref))
            idx = tuple(("T", i - self.step * k) if _is_int(i) else
                        ("TS", _unit_slice(i) - self.step * k) if _unit_slice(i) is not None else
                        _freeze(i, ref) for i in idx)
            return ("setitem", ref(buf), idx, _freeze(val, ref))
        args = n.args
        if self.numbers and _arith(n):
            args = tuple(("num", type(a).__name__) if _number(a) else a for a in args)
        return (n.op, n.target, _freeze(args, ref), _freeze(n.kwargs, ref))

    def iteration(self, k):
        b = self.s + k * self.K
        return [self.sig(p) for p in range(b, b + self.K)]

    def same(self, k1: int, k2: int) -> bool:
        """iteration(k1) == iteration(k2), stopping at the first slot that differs."""
        b1, b2 = self.s + k1 * self.K, self.s + k2 * self.K
        return all(self.sig(b1 + j) == self.sig(b2 + j) for j in range(self.K))

    def depth_of(self, k: int) -> int:
        """`_depth` of iteration(k) from the graph's edges: the most steps back a node of step
        k (not a read) takes an argument from, at least 1."""
        b, d = self.s + k * self.K, 1
        for p in range(b, b + self.K):
            n = self.nodes[p]
            if n in self.reads:
                continue
            for a in n.all_input_nodes:
                pa = self.pos.get(a)
                if pa is not None and self.s <= pa < self.e:
                    d = max(d, k - self.it(pa))
        return d


def _unify(first, later, binding, k: int, tmpl: list, seg) -> bool:
    """Step k (before the template step `tmpl`) against the template: equal, except where the
    template reads a value computed m steps back (("C", j): one, ("F", m, j): m) that step k reads
    from before the loop (k < m): there it reads the initial value of slot j at time k - m, the
    same one wherever it is read (``binding[(j, k - m)]``): an outer node, a constant, or, where
    slot j is itself a read (``x[:, t]`` passed to the next step), that read at time k - m made
    before the loop (a loop cut after its first step: ("read", family, index, None))."""
    m = _distance(later)
    if m is not None:
        if k - m >= 0:
            return first == later
        j = later[-1]
        slot = tmpl[j]
        if isinstance(first, tuple) and first and first[0] == "R" and slot[0] == "read" \
                and first[1:] == (slot[1], slot[2] - seg.stride(slot[1]) * m, slot[3]) and slot[3] is None:
            first = ("read", slot[1], slot[2] + seg.stride(slot[1]) * (k - m), None)      # index at step 0
        elif isinstance(first, tuple) and first and first[0] == "R":
            first = ("R@", first[1], first[2] + seg.stride(first[1]) * k, first[3])      # a read made before the
            # loop (``h = x[:, 0]``, then the steps from t = 1): that node, by its index
        elif isinstance(first, tuple) and first and first[0] in ("L", "C", "F", "read"):
            return False
        prev = binding.setdefault((j, k - m), first)
        return prev == first
    if isinstance(later, tuple) and isinstance(first, tuple):
        return len(later) == len(first) and all(_unify(f, l, binding, k, tmpl, seg) for f, l in zip(first, later))
    return first == later and type(first) is type(later)


def _distance(sig) -> int | None:
    """m for a reference to the value of slot j computed m steps back: ("C", j) or ("F", m, j)."""
    if isinstance(sig, tuple) and sig and sig[0] == "C" and len(sig) == 2 and _is_int(sig[1]):
        return 1
    if isinstance(sig, tuple) and sig and sig[0] == "F" and len(sig) == 3 and _is_int(sig[1]) and _is_int(sig[2]):
        return sig[1]
    return None


MAX_DEPTH = 8      # a step may read values computed up to this many steps back (h, h_prev = ..., h)


# -- finding unrolled loops -----------------------------------------------------------------

def find_unrolled(gm: fx.GraphModule, ctx, skip=()) -> list[Loop]:
    """The unrolled loops of the graph; `skip`: (first, last) nodes of spans other loops took
    (their reads are not searched)."""
    loops, spans, failed = [], list(skip), []      # spans: (first, last) node of each loop's steps
    inside = transformed(gm.graph)
    why = ("torch.func", "reads inside torch.vmap or another torch.func transform are not searched for "
           "loops (their tensors are batched): such a loop runs as written")
    if any(n in inside for n in find_reads(gm.graph)) and why not in ctx.fallbacks:
        ctx.fallbacks.append(why)
    deadline = time.monotonic() + SEARCH_SECONDS
    for _ in range(MAX_ROUNDS):     # again on the reads no loop took: a second loop over the
        # same tensor (a bidirectional layer's backward scan), or over the stacked values of
        # the first one (``ys[t]``, see `gather_steps`); the graph is read anew each round
        before = len(loops)
        try:
            _find_round(gm, loops, spans, failed, deadline)
        except _OutOfTime as e:
            ctx.fallbacks.append(("reroll", f"the search for unrolled loops stopped after {SEARCH_SECONDS:.0f} s "
                                  f"in a graph of {len(gm.graph.nodes)} nodes ({e}); the loops not found by "
                                  "then run as written"))
            log.info("ssmc: loop search stopped after %.0f s (%s)", SEARCH_SECONDS, e)
            break
        if len(loops) == before:
            break
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    covered = [(pos[a], pos[b] + 1) for a, b in spans]
    taken = {n for lp in loops for n in lp.erase}
    # a few steps of a tensor a loop reads (its first steps, peeled: an AR filter's start), or
    # element reads of a tensor a loop's step uses whole (a[k] of a coefficient vector): a note
    sources = {r.source for lp in loops for r in lp.reads}
    whole = {v for lp in loops for v in lp.invariants if isinstance(v, fx.Node)}
    said = set()
    for a0, src, msg, members, L in failed:    # reads inside a loop found later (an inner loop
        # unrolled within each step), or taken into one, or of a loop's own stacked steps, are not news
        if not any(lo <= pos.get(a0, -1) < hi for lo, hi in covered) and not any(n in taken for n in members) \
                and src not in taken and msg not in said:
            said.add(msg)
            if src in whole or src in sources and L <= MAX_DEPTH + 1:
                ctx.note(f"reroll: {msg} (steps around a loop that reads {src.name}; they run as written)")
                continue
            ctx.fallbacks.append((src.name, msg))
            log.info("ssmc: %s", msg)
    return loops


MAX_ROUNDS = 4
SEARCH_SECONDS = 60.0      # the search for unrolled loops in one graph stops after this long


class _OutOfTime(Exception):
    pass


def _find_round(gm, loops, spans, failed, deadline: float = float("inf")) -> None:
    """One search over the read families, leaving out reads first used inside a loop already
    found; appends to loops, spans (their steps' first and last nodes) and failed."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    inside = transformed(gm.graph)
    found = {n: rs for n, rs in find_reads(gm.graph).items() if n not in inside}
    covered = [(pos[a], pos[b] + 1) for a, b in spans]

    def cover(seg):
        spans.append((nodes[seg.s], nodes[seg.e - 1]))
        covered.append((seg.s, seg.e))

    def first_use(n):
        return min((pos[u] for u in n.users if u in pos), default=pos[n])
    fams: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for n, rs in found.items():
        if covered and any(lo <= first_use(n) < hi for lo, hi in covered):
            continue
        for r in rs:
            fams[(pos[r.source], r.dim, r.width)][r.index].append(n)
    fams = {k: v for k, v in fams.items() if len(v) >= 2}
    reads: dict[fx.Node, tuple] = {}
    for n, rs in found.items():
        for r in rs:
            key = (pos[r.source], r.dim, r.width)
            if key in fams:
                reads[n] = (key, r.index, r.rest)
                break
    runs = []
    for key, by_idx in fams.items():
        alts = _runs(by_idx, pos)
        if alts:
            runs.append((*alts[0], key, alts[1:]))
    for a0, K, L, step, key, alts in sorted(runs, key=lambda r: r[:4]):
        if any(lo <= a0 < hi for lo, hi in covered):
            continue
        found_lp, seg, why = _first_loop(gm, nodes, pos, reads, a0, K, L, step, deadline)
        first = a0
        for b0, K2, L2, step2 in alts:     # a shorter chain of another stride (steps that
            if found_lp is not None:       # alternate: `if t % 2`, a loop over pairs of steps)
                break
            if not any(lo <= b0 < hi for lo, hi in covered):
                found_lp, seg, _ = _first_loop(gm, nodes, pos, reads, b0, K2, L2, step2, deadline)
                first = b0
        if found_lp is None:
            src = nodes[key[0]]
            msg = f"reads of {src.name} along dim {key[1]} ({L} steps) were not re-rolled: {why}"
            if key[2] == 1:
                failed.append((nodes[a0], src, msg, [n for ns in fams[key].values() for n in ns], L))
            else:        # equal slices (q, k, v cut from one tensor) are often no loop at all
                log.debug("ssmc: slices of width %d: %s", key[2], msg)
            continue
        if seg.step > 0:                # a reverse loop's reads run forward first (below)
            _shift_passed_values(gm, found_lp)
        cover(seg)
        if first < seg.s:               # cut later (the first step's reads run as written, before
            spans.append((nodes[first], nodes[seg.s - 1]))    # it): its reads are this loop's too
            covered.append((first, seg.s))
        if _reads_previous_state(found_lp):
            found_lp, seg = _rotated(gm, seg, found_lp)
            cover(seg)
        if _reads_previous_state(found_lp):
            _delay_previous_states(gm, found_lp)
        _cat_accumulators(found_lp)
        _chunk_views(gm, found_lp)
        if seg.step < 0:
            _run_forward(gm, found_lp)
            _shift_passed_values(gm, found_lp)
        loops.append(found_lp)
        if gather_steps(gm, found_lp) | own_sinks(gm, found_lp):   # the graph changed: the next
            return                                                  # round reads it anew


def _last_two_equal(seg: _Segment) -> bool:
    """Whether the last two steps have the same signatures, compared node by node until the
    first difference. Needed where a loop is longer than MAX_DEPTH + 1 steps (its template step
    is then at most MAX_DEPTH, and every step after it equals it); shorter runs pass."""
    return seg.L < MAX_DEPTH + 2 or seg.same(seg.L - 2, seg.L - 1)


def _same_ops(nodes, reads, s_lo: int, s_hi: int, K: int, L: int):
    """For the starts s_lo..s_hi: whether the last two steps from s run the same op at every slot
    (a read, or the same op and target), which every loop `_try_segment` takes needs (equal
    signatures, or unifying ones, have the same ops). One pass over the nodes for all the starts
    (each would otherwise build its segment first: K starts of K nodes each)."""
    if L < 2:
        return lambda s: True

    def key(n):
        return ("read",) if n in reads else (n.op, n.target)
    lo = s_lo + (L - 2) * K
    miss = [0]
    for p in range(lo, s_hi + (L - 1) * K):
        q = p + K
        miss.append(miss[-1] + (0 if q < len(nodes) and key(nodes[p]) == key(nodes[q]) else 1))
    return lambda s: miss[s + (L - 2) * K - lo + K] == miss[s + (L - 2) * K - lo]


def _first_loop(gm, nodes, pos, reads, a0, K, L, step, deadline: float = float("inf")):
    """(loop, segment, why): the latest start from a0 back whose steps line up, so that a step
    ends with what it computes from its new state (outputs) rather than beginning with the
    previous step's outputs; (None, None, why) where none does. A start whose steps read values
    from two or more steps back is taken only where no start reads from one step back alone (a
    value made early in a step and used late in the next one reads two steps back from some
    starts: carried twice there for nothing)."""
    why, deep = "the steps do not repeat the same operations", None
    same_ops = _same_ops(nodes, reads, max(0, a0 - K + 1), a0, K, L)
    for numbers in (False, True):       # then with the Python numbers of arithmetic per step
        for s in range(a0, max(0, a0 - K + 1) - 1, -1):
            if time.monotonic() > deadline:
                if deep is not None:
                    erase_unused(gm, deep[0].made)
                raise _OutOfTime(f"at a run of {L} steps of {K} nodes")
            if not same_ops(s):
                continue
            seg = _Segment(nodes, pos, reads, s, K, L, step, numbers)
            if seg.e >= len(nodes) or not _last_two_equal(seg):
                continue
            try:
                lp = _try_segment(gm, seg)
            except _NotALoop as e:
                why = why if numbers else str(e)
                continue
            if lp is None:
                continue
            if seg.depth == 1:
                if deep is not None:
                    erase_unused(gm, deep[0].made)
                return lp, seg, why
            if deep is None:
                deep = (lp, seg)
            else:
                erase_unused(gm, lp.made)
        if deep is not None:
            return (*deep, why)
    # no start takes all L steps: cut one step later, L - 1 steps (what follows the steps' results,
    # a stack of the state before each update, ``ys.append(h)`` then ``h = ...``, holds the
    # initial state and the first L - 1 new states; the last update is peeled)
    same_ops = _same_ops(nodes, reads, a0 + 1, a0 + K - 1, K, L - 1)
    for s in range(a0 + 1, a0 + K) if L >= 3 else ():
        if time.monotonic() > deadline:
            raise _OutOfTime(f"at a run of {L} steps of {K} nodes")
        if not same_ops(s):
            continue
        seg = _Segment(nodes, pos, reads, s, K, L - 1, step, False)
        if seg.e >= len(nodes) or not _last_two_equal(seg):
            continue
        try:
            lp = _try_segment(gm, seg)
        except _NotALoop:
            continue
        if lp is not None and seg.depth == 1:
            log.info("ssmc: no start takes the %d steps; cut one step later, %d steps", L, L - 1)
            return lp, seg, why
        if lp is not None:
            erase_unused(gm, lp.made)
    return None, None, why


def _chunk_views(gm, lp: Loop) -> None:
    """A loop over chunks (reads ``x[:, t*w:(t+1)*w]``) reads step t of the source viewed as
    (..., chunks, w, ...) along its time dim: an outer node made here (`Loop.made`)."""
    views: dict = {}
    outer = _Builder(gm.graph, _fake_mode(gm.graph))
    for k, r in enumerate(lp.reads):
        if r.width == 1:
            continue
        key = (r.source, r.dim, r.width)
        if key not in views:
            n = shape(r.source)[r.dim] // r.width
            cut = outer.call(r.source.next, torch.narrow, (r.source, r.dim, 0, n * r.width))
            view = outer.call(cut.next, torch.unflatten, (cut, r.dim, (n, r.width)))
            views[key] = view
            lp.made.extend([cut, view])
        lp.reads[k] = Read(views[key], r.dim, r.start)


def _run_forward(gm, lp: Loop) -> None:
    """A loop over decreasing indices as a loop forward in time: its reads come from the indices
    they read, flipped along their time dim (outer nodes made here, before the loop; `Loop.made`
    lists them), and its per-step results are flipped back when lowered (`Result.reverse`).
    Only what the steps read is flipped: a source may be longer, also of a size Dynamo keeps
    symbolic."""
    span: dict = {}
    for r in lp.reads:            # step k reads r.start - k
        lo, hi = span.get((r.source, r.dim), (r.start - lp.length + 1, r.start))
        span[(r.source, r.dim)] = (min(lo, r.start - lp.length + 1), max(hi, r.start))
    flips: dict = {}
    outer = _Builder(gm.graph, _fake_mode(gm.graph))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for k, r in enumerate(lp.reads):
        key = (r.source, r.dim)
        lo, hi = span[key]
        if key not in flips:
            at = _after_writes(r.source, lp.anchor, order)
            part = outer.call(at, torch.narrow, (r.source, r.dim, lo, hi - lo + 1))
            flips[key] = outer.call(at, torch.flip, (part, [r.dim]))
            lp.made.append(part)
        lp.reads[k] = Read(flips[key], r.dim, hi - r.start)
    lp.made.extend(flips.values())


def _after_writes(src: fx.Node, anchor, order: dict) -> fx.Node:
    """Where a copy of src taken before a loop goes: after the last write into src (or a view of
    it) that comes before the loop (a buffer filled in place, `dq[:, i] = d`, then walked
    backwards), else right after src."""
    alias = views_of(src)
    end = order.get(anchor, len(order)) if anchor is not None else len(order)
    writes = [u for a in alias for u in a.users if mutated(u) in alias and order.get(u, end) < end]
    return max(writes, key=order.__getitem__).next if writes else src.next


def _cat_accumulators(lp: Loop) -> None:
    """``out = torch.cat([out, y.unsqueeze(1)], 1)`` each step: `out` is no state but the
    steps' values collected along dim 1 after its initial value. The carry becomes a per-step
    result with a cat sink (its initial value as the prefix), replacing the final value."""
    g = lp.body.graph
    for j in reversed(range(lp.n_carry)):
        c, o = lp.carry_nodes()[j], lp.carry_outputs()[j]
        if not (isinstance(o, fx.Node) and o.op == "call_function" and o.target is torch.cat):
            continue
        seq = o.args[0] if o.args else o.kwargs.get("tensors")
        dim = o.args[1] if len(o.args) > 1 else o.kwargs.get("dim", 0)
        if not isinstance(seq, (list, tuple)) or len(seq) != 2 or seq[0] is not c or not _is_int(dim):
            continue
        v = seq[1]
        outs = lp.outputs()
        last = [i for i, r in enumerate(lp.results) if r.kind == "last" and outs[lp.n_carry + i] is o]
        if list(c.users) != [o] or not isinstance(v, fx.Node) or len(shape(v)) != len(shape(c)) \
                or any(u.op != "output" for u in o.users) or len(last) != 1 or reaches(v, {c}):
            continue
        init = lp.carry_init[j]
        if not isinstance(init, fx.Node):
            continue
        k = last[0]
        old = lp.results[k]
        lp.results[k] = Result("steps", "cat", dim % len(shape(c)), old.replace, prefix=[init])
        out = next(n for n in g.nodes if n.op == "output")
        vals = list(out.args[0])
        vals[lp.n_carry + k] = v
        del vals[j]
        out.args = (tuple(vals),)
        g.erase_node(o)
        g.erase_node(c)
        del lp.carry_init[j]
    lp.body.recompile()


def _reads_previous_state(lp: Loop) -> bool:
    """True when a step reads a carried value other than to compute the new carried values
    (``y = C @ h; h = A @ h + B @ x``: the output reads the state before the update), or a
    per-step result is made from a carried value and not from any new one (``u = -K @ x``
    both fed back into the update and returned: a feedback gain, a filter's innovation)."""
    anc = ancestors(lp.carry_outputs())
    if any(u not in anc for c in lp.carry_nodes() for u in c.users):
        return True
    new = {v for v in lp.carry_outputs() if isinstance(v, fx.Node)} - set(lp.carry_nodes())
    old = descendants(lp.carry_nodes())
    return any(isinstance(v, fx.Node) and r.kind == "steps" and v in old and not ancestors([v]) & new
               for v, r in zip(lp.result_values(), lp.results))


def _rotated(gm, seg: _Segment, found: Loop):
    """The same loop cut one step later: each step runs the update, then what the next step
    computed from the state before its update, now reading the new state. The first step's
    outputs (from the initial state) and the last step's update stay outside as peeled steps.
    Returns (loop, segment); the given ones when no cut of L - 1 steps avoids the previous state
    without carrying more values from one step to the next."""
    if seg.L < 3:
        return found, seg
    for s in range(seg.s + 1, seg.s + seg.K):
        rot = _Segment(seg.nodes, seg.pos, seg.reads, s, seg.K, seg.L - 1, seg.step, seg.numbers)
        if rot.e >= len(seg.nodes):
            break
        try:
            lp = _try_segment(gm, rot)
        except _NotALoop:
            continue
        if lp is None:
            continue
        _recompute_delays(lp, seg.step)
        if seg.step > 0:
            _shift_passed_values(gm, lp)
        if not _reads_previous_state(lp) and lp.n_carry <= found.n_carry:
            log.info("ssmc: the step's outputs read the state before its update; the loop is cut "
                     "one step later (%d steps, the first step's outputs and the last update peeled)",
                     rot.L)
            erase_unused(gm, found.made)
            return lp, rot
        erase_unused(gm, lp.made)
    return found, seg


def _delay_previous_states(gm, lp: Loop) -> None:
    """Where a step computes something other than the new states from a state before its
    update (``y = h - hp`` with ``hp = h``; an output read before the update that cutting the
    loop later did not remove), that value is carried one step as a state of its own: its new
    value is a copy of the state made in the step, and what read the old state reads the copy.
    split_states stacks it with the state it copies; the outputs then read new values only."""
    g = lp.body.graph
    b = _Builder(g, _fake_mode(g) or _fake_mode(gm.graph))
    carries = lp.carry_nodes()
    anc = ancestors(lp.carry_outputs())
    first = next(n for n in g.nodes if n.op != "placeholder")
    out = next(n for n in g.nodes if n.op == "output")
    new_outs = []
    nc = len(carries)
    for j, c in enumerate(carries):
        late = [u for u in c.users if u not in anc and u is not out]
        in_results = any(v is c and r.kind == "steps" for v, r in zip(out.args[0][nc:], lp.results))
        if not late and not in_results:
            continue
        copy = b.call(first, torch.clone, (c,))
        for u in late:
            u.replace_input_with(c, copy)
        if in_results:                # a result that is the old state itself
            vals = list(out.args[0])
            out.args = (tuple(vals[:nc] + [copy if v is c and r.kind == "steps" else v
                                           for v, r in zip(vals[nc:], lp.results)]),)
        with g.inserting_after(lp.carry_nodes()[-1]):
            ph = g.placeholder(f"carry_{lp.n_carry}")
        ph.meta["example_value"] = c.meta.get("example_value")
        lp.carry_init.append(None)            # read by nothing: the copy of step -1's state
        new_outs.append(copy)
    if new_outs:
        vals = list(out.args[0])
        out.args = (tuple(vals[:nc] + new_outs + vals[nc:]),)
        lp.body.recompile()
        log.info("ssmc: %d state(s) read before the update by other work of the step carried one "
                 "step as states of their own", len(new_outs))


def _recompute_delays(lp: Loop, step: int = 1) -> None:
    """Carried values that are no state: a value computed from the step's inputs alone and used
    by the next step (``ek = exp(k[t])`` made before a cut and used after it) is computed again
    in the step that uses it, from its inputs one step back (reads at start - 1; at start + 1
    in a loop over decreasing indices, `step` < 0), and stops being carried. Left carried where
    such a read would start outside its source."""
    back = -1 if step > 0 else 1
    for j in reversed(range(lp.n_carry)):
        o = lp.carry_outputs()[j]
        if not isinstance(o, fx.Node) or o in lp.carry_nodes():
            continue
        # another carry's new value read here is that carry's value in the next step
        others = {v: c for k, (v, c) in enumerate(zip(lp.carry_outputs(), lp.carry_nodes()))
                  if k != j and isinstance(v, fx.Node) and v not in lp.carry_nodes()}
        anc = ancestors([o], stop=set(others))
        reads = dict(zip(lp.read_nodes(), lp.reads))
        used = [p for p in lp.read_nodes() if p in anc]
        if any(c in anc for c in lp.carry_nodes()) or not all(_inside(reads[p], back) for p in used):
            continue
        phs = _add_reads(lp, [Read(reads[p].source, reads[p].dim, reads[p].start + back, reads[p].width) for p in used],
                         [p.meta.get("example_value") for p in used])
        env = {**{v: c for v, c in others.items() if v in anc}, **dict(zip(used, phs))}
        init = _drop_carry(lp, j, _copy_from(lp, anc - set(others), o, env))
        if isinstance(init, fx.Node) and init in lp.made and not init.users:
            init.graph.erase_node(init)
            lp.made.remove(init)
    lp.body.recompile()


def _inside(r: Read, back: int) -> bool:
    """Whether read r moved `back` steps still starts inside its source (moved up, a size Dynamo
    keeps symbolic: not known, so no)."""
    if back < 0:
        return r.start + back >= 0
    n = shape(r.source)[r.dim]
    return type(n) is int and (r.start + back + 1) * r.width <= n


def _shift_passed_values(gm, lp: Loop) -> None:
    """Carried values that are no state, computed from the step's reads alone and used by the
    next step (``xp = x[:, t]``: RWKV's token shift, a filter's previous input), become reads: a
    step computes the value the previous step passed from its reads one step back (a copy of
    each read's source with its first step repeated in front), and takes the initial value at
    step 0 (``torch.where`` on a first-step flag read per step). Left carried where a read is a
    chunk of several steps."""
    g = lp.body.graph
    L = lp.length
    if not isinstance(L, int) or L < 2:
        return
    mode = _fake_mode(gm.graph)
    outer = _Builder(gm.graph, mode)
    inner = _Builder(g, _fake_mode(g) or mode)
    for j in reversed(range(lp.n_carry)):
        carries, o = lp.carry_nodes(), lp.carry_outputs()[j]
        if not isinstance(o, fx.Node) or o in carries:
            continue
        anc = ancestors([o])
        reads = dict(zip(lp.read_nodes(), lp.reads))
        used = [p for p in lp.read_nodes() if p in anc]
        if any(c in anc for c in carries) or any(reads[p].width != 1 for p in used):
            continue
        anchor = lp.anchor
        shifted = []
        for p in used:
            r = reads[p]
            head = outer.call(anchor, torch.narrow, (r.source, r.dim, r.start, 1))
            rest = outer.call(anchor, torch.narrow, (r.source, r.dim, r.start, L - 1))
            cat = outer.call(anchor, torch.cat, ([head, rest], r.dim))
            shifted.append(Read(cat, r.dim, 0, 1))
            lp.made.extend([head, rest, cat])
        dev = value_of(used[0]).device if used else value_of(o).device
        ar = outer.call(anchor, torch.arange, (L,), {"device": dev})
        first = Read(outer.call(anchor, operator.eq, (ar, 0)), 0, 0, 1)
        lp.made.extend([ar, first.source])
        with (mode or contextlib.nullcontext()):
            metas = [torch.select(value_of(r.source), r.dim, 0) for r in shifted + [first]]
        *phs, flag = _add_reads(lp, shifted + [first], metas)
        init = lp.carry_init[j]
        if isinstance(init, fx.Node):
            with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
                init_ph = g.placeholder(f"inv_{len(lp.invariants)}")
            init_ph.meta["example_value"] = value_of(init)
            lp.invariants.append(init)
            init = init_ph
        first_op = next(n for n in g.nodes if n.op != "placeholder")     # the copies go before it
        val = _copy_from(lp, anc, o, dict(zip(used, phs)))
        _drop_carry(lp, j, inner.call(first_op, torch.where, (flag, 0.0 if init is None else init, val)))
        log.info("ssmc: a value passed from one step to the next (no state) is computed from the "
                 "reads one step back")
    lp.body.recompile()


def _add_reads(lp: Loop, reads: list, metas: list) -> list:
    """Body placeholders for new reads (after the others, before the invariants), with their
    example values; the reads join `lp.reads`."""
    g = lp.body.graph
    invs = lp.invariant_nodes()
    phs = []
    with g.inserting_before(invs[0] if invs else next(n for n in g.nodes if n.op != "placeholder")):
        for r, m in zip(reads, metas):
            phs.append(g.placeholder(f"read_{len(lp.reads)}"))
            phs[-1].meta["example_value"] = m
            lp.reads.append(r)
    return phs


def _copy_from(lp: Loop, anc: set, o: fx.Node, env: dict) -> fx.Node:
    """o made again before the body's first op: copies of the nodes of `anc`, with the
    placeholders in `env` read instead (the invariants as they are); returns o's copy."""
    g = lp.body.graph
    env = {**{p: p for p in lp.invariant_nodes()}, **env}
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        for n in list(g.nodes):
            if n in anc and n.op != "placeholder":
                env[n] = g.node_copy(n, lambda a: env[a])
    return env[o]


def _drop_carry(lp: Loop, j: int, value: fx.Node):
    """Carry j stops being carried: what read it reads `value`. Returns its initial value."""
    g = lp.body.graph
    c = lp.carry_nodes()[j]
    c.replace_all_uses_with(value)
    out = next(n for n in g.nodes if n.op == "output")
    vals = list(out.args[0])
    del vals[j]
    out.args = (tuple(vals),)
    g.erase_node(c)
    g.eliminate_dead_code()
    return lp.carry_init.pop(j)


STRIDES = (1, -1, 2, -2, 3, -3, 4, -4)     # index steps of the loops looked for (range(0, L, 2): 2)


def _runs(by_idx: dict, pos: dict) -> list:
    """[(first anchor, K, L, step)]: per index step (STRIDES), the longest chain of step indices
    whose reads are first used K nodes apart, with the index going up (step 1) or down (step -1:
    a loop over ``reversed(range(L))``), longest first. An index may be read by several nodes
    (x[:, 0] also read before the loop to size the state); each is a candidate anchor."""
    cands = {i: sorted({min((pos[u] for u in n.users), default=pos[n]) for n in nodes})
             for i, nodes in by_idx.items()}
    sets = {i: set(c) for i, c in cands.items()}
    out = []
    for step in STRIDES:
        best = None
        diffs: dict[int, int] = defaultdict(int)
        for i, c in cands.items():
            for a in c[:4]:
                for b in cands.get(i + step, [])[:4]:
                    if b > a:
                        diffs[b - a] += 1
        for K in sorted(diffs, key=lambda k: -diffs[k])[:3]:
            for i0 in sorted(cands):
                if i0 - step in sets and any(a - K in sets[i0 - step] for a in cands[i0]):
                    continue    # not the start of a chain
                for a in cands[i0]:
                    m = 1
                    while i0 + step * m in sets and a + m * K in sets[i0 + step * m]:
                        m += 1
                    if m >= 2 and (best is None or m > best[2]):
                        best = (a, K, m, step)
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda r: -r[2])


class _NotALoop(Exception):
    pass


class _Lazy:
    """The signatures of step k of a segment, each made on first use."""

    def __init__(self, seg: _Segment, k: int):
        self.seg, self.b, self.memo = seg, seg.s + k * seg.K, {}

    def __getitem__(self, j):
        if j not in self.memo:
            self.memo[j] = self.seg.sig(self.b + j)
        return self.memo[j]


def _try_segment(gm, seg: _Segment) -> Loop | None:
    """The loop of segment `seg`, or None where its steps do not line up from this start. The
    template is step D, where D is the most steps back a step reads a value (1 for a first-order
    recurrence; 2 for ``h, hp = a*h + b*hp + x, h``): the steps before it read initial values
    where it reads earlier steps' values."""
    L = seg.L
    D = seg.depth_of(L - 1)
    if D > MAX_DEPTH:
        if L >= 2 and seg.same(L - 2, L - 1):      # the steps line up: a true read that far
            raise _NotALoop(f"a step reads a value from {D} steps back (at most {MAX_DEPTH})")
        return None
    if L < D + 1:
        return None
    if D != L - 1 and not seg.same(D, L - 1):
        return None
    tmpl = _Lazy(seg, D)
    seg.depth = D
    binding: dict[tuple, object] = {}
    for k in range(D):          # slot by slot, each signature made when first needed
        b = seg.s + k * seg.K
        if not all(_unify(seg.sig(b + j), tmpl[j], binding, k, tmpl, seg) for j in range(seg.K)):
            return None
    for k in range(D + 1, L - 1):
        if not seg.same(k, D):
            raise _NotALoop(f"step {k} differs from step {D}")
    return _build(gm, seg, D, binding)


def _build(gm, seg: _Segment, T: int, binding) -> Loop:
    """The loop with step T as its body (`_try_segment`). Slot j's values m steps back (m up to
    the most its reads go back) are carried: (j, 1) is the new value of j, (j, m) the carried
    (j, m - 1), from the initial values ``binding[(j, -m)]``."""
    nodes, pos, K, L, s = seg.nodes, seg.pos, seg.K, seg.L, seg.s
    tmpl = [nodes[s + T * K + j] for j in range(K)]
    depth: dict[int, int] = {}
    for j, t in binding:
        depth[j] = max(depth.get(j, 0), -t)
    carry_slots = [(j, m) for j in sorted(depth) for m in range(1, depth[j] + 1)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    carry_ph = {jm: body.placeholder(f"carry_{i}") for i, jm in enumerate(carry_slots)}
    read_keys: dict[tuple, fx.Node] = {}
    reads: list[Read] = []
    invariants: list[fx.Node] = []
    inv_ph: dict[fx.Node, fx.Node] = {}
    outer_reads = []

    def collect(a):
        if isinstance(a, fx.Node):
            pa = pos[a]
            if seg.s <= pa < seg.e:
                return
            if a in seg.reads:
                outer_reads.append(a)
            elif a not in inv_ph:
                inv_ph[a] = None
                invariants.append(a)

    for n in tmpl:
        if n in seg.reads:
            outer_reads.append(n)
        else:
            fx.node.map_aggregate((n.args, n.kwargs), collect)
    def read_key(r):
        fam, idx, rest = seg.reads[r]
        return (*fam[:2], idx - T * seg.stride(fam), fam[2])    # index at step 0 (the template is step T)

    strides: list[int] = []            # per read: the indices it advances a step
    for r in outer_reads:
        key = read_key(r)
        if key not in read_keys:
            read_keys[key] = r
            reads.append(Read(nodes[key[0]], key[1], key[2], key[3]))
            strides.append(abs(seg.stride(seg.reads[r][0])))
            if strides[-1] > 1 and key[3] != 1:
                raise _NotALoop(f"reads of chunks every {strides[-1]} chunks")
    stride = abs(seg.step)
    read_ph = {}
    mode = _fake_mode(gm.graph)
    for i, (key, r) in enumerate(read_keys.items()):
        ph = read_ph[key] = body.placeholder(f"read_{i}")
        src = value_of(nodes[key[0]])
        with (mode if mode is not None else contextlib.nullcontext()):
            ph.meta["example_value"] = torch.select(src, key[1], 0) if key[3] == 1 else \
                torch.narrow(src, key[1], 0, key[3])
    tables = _tables(seg, T)            # numbers that differ step to step: a table each, read at t
    table_ph = {}
    dev = next((value_of(r.source).device for r in reads if isinstance(r.source, fx.Node)
                and is_tensor(value_of(r.source))), torch.device("cpu"))
    for (j, i), vals in tables.items():
        reads.append(Read(None, 0, 0 if seg.step > 0 else L - 1))     # its source made below
        ph = table_ph[(j, i)] = body.placeholder(f"read_{len(reads) - 1}")
        with (mode if mode is not None else contextlib.nullcontext()):
            ph.meta["example_value"] = torch.empty((), **_table_type(tmpl[j], vals, dev))
    for i, inv in enumerate(invariants):
        inv_ph[inv] = body.placeholder(f"inv_{i}")
        inv_ph[inv].meta["example_value"] = inv.meta.get("example_value")
    for (j, _), ph in carry_ph.items():
        ph.meta["example_value"] = tmpl[j].meta.get("example_value")
    rest_nodes: dict = {}

    def read_value(r):
        """The body value of read node r: its placeholder, then its remaining index."""
        key = read_key(r)
        rest = seg.reads[r][2]
        if rest is None:
            return read_ph[key]
        k = (key, _freeze(rest, str))
        if k not in rest_nodes:
            v = body.call_function(operator.getitem, (read_ph[key], rest))
            v.meta["example_value"] = r.meta.get("example_value")
            rest_nodes[k] = v
        return rest_nodes[k]

    def body_arg(a):
        pa = pos[a]
        if seg.s <= pa < seg.e:
            ka, j = seg.it(pa), (pa - s) % K
            if ka == T:
                return env[a]
            if (j, T - ka) in carry_ph:
                return carry_ph[(j, T - ka)]
            raise _NotALoop("a step reads a later step")
        if a in seg.reads:
            return read_value(a)
        return inv_ph[a]

    for n in tmpl:
        x = _written(n)
        if x is not None and (not n.users or any(pos[u] > pos[n] for u in x.users if u is not n)):
            raise _NotALoop(f"`{n.target if isinstance(n.target, str) else n.target.__name__}` "
                            f"(node {n.name}) updates {x.name} in place where later code reads it")
    results: list[Result] = []
    result_vals: list[fx.Node] = []
    for j, n in enumerate(tmpl):
        if n in seg.reads:
            env[n] = read_value(n)
            continue
        if n.op == "call_function" and n.target is operator.setitem:
            buf, idx, val = n.args
            if seg.inside(buf) if isinstance(buf, fx.Node) else True:
                local = _step_local_write(n, seg, T, body, body_arg)
                if local is None:
                    raise _NotALoop("writes into a tensor made inside the loop")
                env[buf] = local           # later reads of the buffer in the step see the write
                continue
            if stride > 1:
                raise _NotALoop(f"writes `{buf.name}[...] = ...` every {stride} indices")
            full = _expand_index(idx, len(shape(buf)))
            tpos = [i for i, x in enumerate(full or []) if _is_int(x) or _unit_slice(x) is not None]
            if not full or len(tpos) != 1 or any(not (isinstance(x, slice) and x == slice(None))
                                                   for i, x in enumerate(full) if i != tpos[0]):
                raise _NotALoop(f"`{buf.name}[...] = ...` writes are supported as out[:, t] = y "
                                "or out[:, t:t+1] = y only")
            at = full[tpos[0]]
            unit = not _is_int(at)                 # out[:, t:t+1] = y: y keeps a dim of size 1 there
            if unit:
                v = val if isinstance(val, fx.Node) else None
                if v is None or len(shape(v)) != len(shape(buf)) or shape(v)[tpos[0]] != 1:
                    raise _NotALoop(f"`{buf.name}[..., t:t+1] = ...` writes a value without its size-1 time dim")
                at = _unit_slice(at)
            start = at - T * seg.step                               # template is step T
            if seg.step < 0:
                start -= L - 1                  # the steps write buffer[start + L - 1 - t]
            if start < 0 or start + L > shape(buf)[tpos[0]]:
                raise _NotALoop(f"writes into {buf.name} do not cover it step by step")
            writes = [nodes[s + k * K + j] for k in range(L)]
            results.append(Result("steps", "setitem", tpos[0], writes, buffer=buf, start=start,
                                  reverse=seg.step < 0))
            rv = fx.node.map_arg(val, body_arg)
            bb = _Builder(body, _fake_mode(gm.graph))
            if unit:
                rv = bb.call(None, torch.squeeze, (rv, tpos[0]))
            slot = tuple(d for i, d in enumerate(shape(buf)) if i != tpos[0])
            if isinstance(rv, fx.Node) and tuple(shape(rv)) != slot:   # as the write broadcasts:
                vs = list(shape(rv))                                   # leading 1s dropped, expanded
                while len(vs) > len(slot) and vs[0] == 1:
                    vs.pop(0)
                try:
                    ok = len(vs) <= len(slot) and tuple(torch.broadcast_shapes(tuple(vs), slot)) == slot
                except RuntimeError:
                    ok = False
                if not ok:
                    raise _NotALoop(f"writes into {buf.name} a value of shape {tuple(shape(rv))} for a slot of {slot}")
                rv = bb.call(None, torch.broadcast_to, (bb.call(None, torch.reshape, (rv, tuple(vs))), slot))
            result_vals.append(rv)
            continue
        env[n] = body.node_copy(n, body_arg)
        if any(jj == j for jj, _ in table_ph):
            env[n].args = tuple(table_ph.get((j, i), a) for i, a in enumerate(env[n].args))

    # values leaving the loop: stacked sinks, last-step values, nothing else
    sinks: dict[fx.Node, tuple] = {}
    last_uses: dict[tuple, list] = defaultdict(list)
    gathered: dict[int, list] = defaultdict(list)
    outside = []
    for p in range(seg.s, seg.e):
        n = nodes[p]
        for u in n.users:
            if seg.inside(u):
                continue
            k, j = seg.it(p), (p - s) % K
            if u in sinks:
                continue
            sink = _stack_sink(u, seg)
            if sink is not None:
                sinks[u] = sink
            else:
                outside.append((u, n, k, j))
    # ys[t] of a list read by later code: a slot any step of which is read there other than at
    # the end (its last value, or one still carried) is stacked, and all its reads go there
    stacked = {j for u, n, k, j in outside if k != L - 1 and (j, L - 1 - k) not in carry_ph}
    for u, n, k, j in outside:
        if j in stacked:
            if u.op == "call_function" and u.target in (torch.stack, torch.cat):   # steps interleaved
                raise _NotALoop(f"{u.name} uses {n.name}, a value of step {k}, after the loop")
            gathered[j].append((u, n, k))
        elif k == L - 1:
            last_uses[(j, 0)].append(n)
        else:                              # an earlier step's value, still carried at the end
            last_uses[(j, L - 1 - k)].append(n)
    for u, (j, kind, dim, pre, post, rev, drop) in sinks.items():
        results.append(Result("steps", kind, dim, [u], prefix=pre, suffix=post, reverse=rev, drop_last=drop))
        result_vals.append(env[tmpl[j]])
    gathers = []
    for j, uses in gathered.items():      # its stack node made once the loop is taken, in time
        rev = seg.step < 0                # order (a reverse loop's last step first)
        results.append(Result("steps", "stack", 0, [], reverse=rev))
        result_vals.append(env[tmpl[j]])
        steps = [nodes[s + k * K + j] for k in range(L)]           # in graph order
        gathers.append((results[-1], steps[::-1] if rev else steps, steps[-1],
                        [(u, n, L - 1 - k if rev else k) for u, n, k in uses]))
    for (j, m), outer in last_uses.items():
        results.append(Result("last", replace=list(dict.fromkeys(outer))))
        result_vals.append(env[tmpl[j]] if m == 0 else carry_ph[(j, m)])
    carry_out = [env[tmpl[j]] if m == 1 else carry_ph[(j, m - 1)] for j, m in carry_slots]
    body.output((*carry_out, *result_vals))
    body.eliminate_dead_code()
    gm_body = fx.GraphModule(gm, body)
    erase = [nodes[p] for p in range(seg.s, seg.e)] + list(sinks)
    outer = _Builder(gm.graph, mode)
    made = []
    for r, ((j, i), vals) in zip(reads[len(reads) - len(tables):], tables.items()):
        r.source = outer.call(nodes[s], torch.tensor, (vals if seg.step > 0 else vals[::-1],), _table_type(tmpl[j], vals, dev))
        made.append(r.source)
    views: dict = {}
    for r, d in zip(reads, strides):    # every d-th index: a strided view, read at consecutive ones
        if d == 1:
            continue
        key = (r.source, r.dim, r.start % d, d)
        if key not in views:
            at = tuple([slice(None)] * r.dim + [slice(r.start % d, None, d)])
            views[key] = outer.call(nodes[s], operator.getitem, (r.source, at))
            made.append(views[key])
        r.source, r.start = views[key], r.start // d
    inits = []
    for j, m in carry_slots:
        b = binding[(j, -m)]
        if isinstance(b, tuple) and b and b[0] == "read":     # slot j's read, made before the loop
            (src_pos, dim, width), idx = b[1], b[2]
            src = nodes[src_pos]
            made.append(outer.call(nodes[s], torch.select, (src, dim, idx)) if width == 1 else
                        outer.call(nodes[s], torch.narrow, (src, dim, idx, width)))
            inits.append(made[-1])
        elif isinstance(b, tuple) and b and b[0] == "R@":
            inits.append(next(n for n, r in seg.reads.items() if pos[n] < s and (r[0], r[1], _freeze(r[2], str)) == b[1:]))
        else:
            inits.append(nodes[b[1]] if isinstance(b, tuple) and b and b[0] == "I" else b)
    written = {mutated(nodes[p]) for p in range(seg.s, seg.e)} - {None}
    for r in reads:                # a read of what the steps write reads the values they wrote
        if r.source is not None and views_of(view_root(r.source)) & written:
            raise _NotALoop(f"the steps read {r.source.name}, which they write (a buffer read back "
                            "in a later step, not forwarded: its dtype or shape differ from the value written)")
    return Loop("", gm_body, L, inits, reads, invariants, results, erase, anchor=nodes[seg.s], made=made,
                gathers=gathers)


def gather_steps(gm, lp: Loop) -> bool:
    """For a loop taken: the values of single steps that code after the loop reads (``ys[t]``
    of a list another loop walks) become reads of one stacked result, ``stack(ys)[t]``, made
    right after the last of them. Done only once the loop is taken, so that the graph the
    search walks does not change under it; True when it changed the graph."""
    mode = _fake_mode(gm.graph)
    for res, steps, last, uses in lp.gathers:
        b = _Builder(gm.graph, mode)
        st = b.call(last.next, torch.stack, (list(steps), 0))      # right after the last one
        for u, n, i in uses:
            u.replace_input_with(n, b.call(u, operator.getitem, (st, i)))
        res.replace.append(st)
        lp.erase.append(st)
    done, lp.gathers = bool(lp.gathers), []
    return done


def own_sinks(gm, lp: Loop) -> bool:
    """For a loop taken: a stack or cat that holds other values around the loop's steps (steps
    peeled off it, another loop's steps: a state reset per segment, chunks of `x.split` each
    walked by its own loop, all appended to one list) becomes a cat of the values before, a
    stack of the loop's steps alone, and the values after, so that each loop's result is a
    node of its own (two loops sharing one stack failed in lowering). True when it changed the
    graph."""
    mode = _fake_mode(gm.graph)
    changed = False
    for r in lp.results:
        if r.kind != "steps" or r.sink not in ("stack", "cat") or not (r.prefix or r.suffix) or len(r.replace) != 1:
            continue
        u = r.replace[0]
        if u.op != "call_function" or u.target not in (torch.stack, torch.cat):
            continue
        seq = u.args[0] if u.args else u.kwargs.get("tensors")
        if not isinstance(seq, (list, tuple)) or list(seq[:len(r.prefix)]) != r.prefix or \
                (r.suffix and list(seq[len(seq) - len(r.suffix):]) != r.suffix):
            continue
        b = _Builder(gm.graph, mode)
        steps = seq[len(r.prefix):len(seq) - len(r.suffix)]
        mid = b.call(u, u.target, (steps, r.dim))
        if u.target is torch.stack:
            parts = [b.call(u, torch.stack, (list(p), r.dim)) if p else None for p in (r.prefix, r.suffix)]
            parts = [x for x in (parts[0], mid, parts[1]) if x is not None]
        else:
            parts = [*r.prefix, mid, *r.suffix]
        whole = b.call(u, torch.cat, (parts, r.dim))
        u.replace_all_uses_with(whole)
        if u in lp.erase:
            lp.erase[lp.erase.index(u)] = mid
        gm.graph.erase_node(u)
        r.replace, r.prefix, r.suffix = [mid], [], []
        changed = True
    return changed


def _tables(seg: _Segment, T: int) -> dict:
    """{(slot j, argument i): the L steps' values} for the Python numbers in the template's
    arithmetic that differ step to step (``x[:, t] / (t + 1)``; `_Segment.numbers` only)."""
    out = {}
    if not seg.numbers:
        return out
    for j in range(seg.K):
        n = seg.nodes[seg.s + T * seg.K + j]
        if not _arith(n):
            continue
        for i, a in enumerate(n.args):
            if _number(a):
                vals = [seg.nodes[seg.s + k * seg.K + j].args[i] for k in range(seg.L)]
                if len(set(vals)) > 1:
                    out[(j, i)] = vals
    return out


def _table_type(n: fx.Node, vals, device) -> dict:
    """dtype and device of a table standing for the numbers `vals` in `n`'s arithmetic: that of
    its tensor operand (floating at least float32), so that the result's type is the same; where
    the arithmetic is on numbers alone (``t / L`` with a symbolic L), int64 for ints, else float64
    (as Python's), on the loop's device."""
    ts = [value_of(a) for a in n.args if isinstance(a, fx.Node) and is_tensor(value_of(a))]
    t = ts[0] if ts else value_of(n)
    if not is_tensor(t):        # Python computes these in double: float64 (the region casts to its own type)
        floats = isinstance(value_of(n), (float, torch.SymFloat))       # beta ** (t + 1): ints in, a float out
        return {"dtype": torch.int64 if all(isinstance(v, int) for v in vals) and not floats else torch.float64,
                "device": device}
    dt = t.dtype
    if not (dt.is_floating_point or dt.is_complex):
        dt = torch.int64 if all(isinstance(v, int) for v in vals) else torch.get_default_dtype()
    elif dt in (torch.bfloat16, torch.float16):
        dt = torch.float32
    elif dt.is_complex:
        dt = torch.float64 if dt == torch.complex128 else torch.float32
    return {"dtype": dt, "device": t.device}


def _step_local_write(n: fx.Node, seg, T: int, body: fx.Graph, body_arg):
    """``buf[..., j] = v`` into a buffer the same step allocates (a per-chunk matrix filled
    column by column by an inner loop), as its out-of-place ``select_scatter`` (or
    ``slice_scatter``) in the body; None where that could change a result: the buffer is not a
    fresh allocation of this step, a view of it is taken, or the index is not one int or slice
    along one dim."""
    buf, _, val = n.args
    if not isinstance(buf, fx.Node) or seg.it(seg.pos[buf]) != T or not _fresh(buf):
        return None
    if any(u.target is not operator.setitem and _maybe_view(u) or
           u.target is operator.setitem and u.args[0] is not buf for u in buf.users):
        return None
    got = _scatter_of(n)
    if got is None:
        return None
    fn, extra, want = got
    b = _Builder(body, _fake_mode(body))
    v = body_arg(val) if isinstance(val, fx.Node) else val
    src = b.call(None, torch.full, (want, v), {"dtype": value_of(buf).dtype}) if not isinstance(v, fx.Node) else \
        b.call(None, torch.broadcast_to, (b.call(None, torch.Tensor.to, (v, value_of(buf).dtype)), want))
    return b.call(None, fn, (body_arg(buf), src, *extra))


def _written(n: fx.Node):
    """The tensor node `n` writes in place, besides ``out[:, t] = y`` sinks: a method ending in
    an underscore, an augmented assignment (``h += x``), an ``out=`` argument; or None."""
    if n.target is not operator.setitem and mutated(n) is not None:
        return mutated(n)
    if n.op == "call_function" and getattr(n.target, "__module__", None) == "_operator" \
            and n.target.__name__.startswith("i") and n.target.__name__ not in ("is_", "is_not", "index", "inv", "invert") \
            and n.args and isinstance(n.args[0], fx.Node) and is_tensor(value_of(n.args[0])):
        return n.args[0]
    out = n.kwargs.get("out") if n.op == "call_function" else None
    return out if isinstance(out, fx.Node) else None


def _stack_sink(u: fx.Node, seg: _Segment):
    """(template position, "stack"|"cat", dim, prefix, suffix, reverse, drop_last) when u stacks
    one value per step, in order or in reverse order (reverse), or, stacked in order, every
    step's value but the last's (drop_last: `ys.append(h)` before the update with the final h
    returned, so the last update is in the graph); values before and after the steps (peeled
    steps, an initial state) are kept."""
    if u.op != "call_function" or u.target not in (torch.stack, torch.cat):
        return None
    seq = u.args[0] if u.args else u.kwargs.get("tensors")
    dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)
    if not isinstance(seq, (list, tuple)) or not _is_int(dim):
        return None
    inside = [i for i, x in enumerate(seq) if isinstance(x, fx.Node) and seg.inside(x)]
    n = len(inside)
    if not inside or n not in (seg.L, seg.L - 1) or inside != list(range(inside[0], inside[0] + n)):
        return None
    js = set()
    its = [seg.it(seg.pos[seq[i]]) for i in inside]
    rev = its == list(range(seg.L - 1, -1, -1))
    drop_last = n == seg.L - 1 and n >= 1 and its == list(range(n)) and u.target is torch.stack
    if its != list(range(seg.L)) and not rev and not drop_last:
        return None
    for i in inside:
        x = seq[i]
        js.add((seg.pos[x] - seg.s) % seg.K)
    if len(js) != 1:
        return None
    pre, post = list(seq[:inside[0]]), list(seq[inside[-1] + 1:])
    if not all(isinstance(x, fx.Node) and not seg.inside(x) for x in pre + post):
        return None
    ndim = len(shape(u))
    return js.pop(), "stack" if u.target is torch.stack else "cat", dim % ndim, pre, post, rev, drop_last


# -- the scan higher-order op ------------------------------------------------------------------

def _getitems(node: fx.Node, what: str) -> dict:
    """A scan node's outputs by index: {i: [getitem nodes]}; any other use raises."""
    getitems = defaultdict(list)
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and _is_int(u.args[1]):
            getitems[u.args[1]].append(u)
        else:
            raise ValueError(f"{what} output used by {u.name} directly")
    return getitems


def loop_from_scan(gm: fx.GraphModule, node: fx.Node) -> Loop:
    args = list(node.args)
    if len(args) == 4:
        fn, init, xs, extra = args
        dim, reverse = 0, False
    elif len(args) == 6:
        fn, init, xs, dim, reverse, extra = args
    else:
        raise ValueError(f"unknown scan signature with {len(args)} arguments")
    if reverse:
        raise ValueError("reverse scans are not supported yet")
    if fn.op != "get_attr":
        raise ValueError("combine function is not a subgraph")
    sub: fx.GraphModule = getattr(gm, fn.target)
    body = fx.Graph()
    env = {}
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    names = ([f"carry_{i}" for i in range(len(init))] + [f"read_{i}" for i in range(len(xs))]
             + [f"inv_{i}" for i in range(len(extra))])
    if len(phs) != len(names):
        raise ValueError("combine function inputs do not match init/xs/additional_inputs")
    for ph, nm in zip(phs, names):
        env[ph] = body.placeholder(nm)
        env[ph].meta.update(ph.meta)
    out_vals = None
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out_vals = list(fx.node.map_arg(n.args[0], lambda a: env[a]))
            continue
        env[n] = body.node_copy(n, lambda a: env[a])
    nc = len(init)
    results, vals = [], []
    getitems = _getitems(node, "scan")
    for i, v in enumerate(out_vals):
        if i < nc:
            if getitems.get(i):
                results.append(Result("last", replace=getitems[i]))
                vals.append(v)
        else:
            results.append(Result("steps", "scan", int(dim), getitems.get(i, [])))
            vals.append(v)
    body.output((*out_vals[:nc], *vals))
    body.eliminate_dead_code()
    for x in xs:
        if not isinstance(x, fx.Node):
            raise ValueError("xs must be tensors")
    return Loop("", fx.GraphModule(gm, body), None, list(init),
                [Read(x, int(dim), 0) for x in xs], list(extra), results,
                erase=[node, *[u for us in getitems.values() for u in us]], anchor=node, origin="scan")


# -- the associative_scan higher-order op -----------------------------------------------------

def _pair_roles(sub: fx.GraphModule) -> int | None:
    """Which of the two scanned operands is the decay: 0 when the combine function is the
    linear-recurrence pair ((a1, b1), (a2, b2)) -> (a1 * a2, a2 * b1 + b2), 1 when it is that pair
    with the operands the other way round ((b, a)); None for any other function. Decided by
    running the combine in float64 on random operands of either sign and three magnitudes (two
    polynomials that agree on random points are equal), so any spelling counts: `torch.addcmul`,
    `mul`/`add` methods, either order of the factors."""
    phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(phs) != 4:
        return None
    shapes = []
    for n in phs:
        v = n.meta.get("example_value", n.meta.get("val"))
        shapes.append(tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor)
                      and all(isinstance(d, int) for d in v.shape) else (3,))
    g = torch.Generator().manual_seed(0)
    runs = []
    for scale in (1.0, 1e3, 1e-3):        # both signs, large and small: `abs`, `relu`, a clamp differ
        xs = [torch.randn(sh, generator=g, dtype=torch.float64) * scale for sh in shapes]
        try:
            out = sub(*xs)
        except Exception:             # noqa: BLE001 -- a combine that will not run on these is no pair
            return None
        if not isinstance(out, (tuple, list)) or len(out) != 2 or \
                not all(isinstance(o, torch.Tensor) for o in out):
            return None
        runs.append((xs, out))
    for r in (0, 1):
        ok = True
        for (l0, l1, r0, r1), out in runs:
            (a1, b1), (a2, b2) = ((l0, l1), (r0, r1)) if r == 0 else ((l1, l0), (r1, r0))
            want = {r: a1 * a2, 1 - r: a2 * b1 + b2}
            ok &= all(out[k].shape == want[k].shape and torch.allclose(out[k], want[k], rtol=1e-12, atol=0)
                      for k in (0, 1))
        if ok:
            return r
    return None


def loop_from_associative_scan(gm: fx.GraphModule, node: fx.Node) -> Loop:
    fn, xs, extra = (list(node.args) + [[]])[:3]
    if fn.op != "get_attr" or len(xs) != 2 or extra:
        raise ValueError("only associative_scan(combine, (a, b)) with the linear-recurrence pair")
    r = _pair_roles(getattr(gm, fn.target))
    if r is None:
        raise ValueError("the combine function is not (a1*a2, a2*b1 + b2) of the pair (a, b) or (b, a)")
    getitems = _getitems(node, "associative_scan")
    dead = _dead_users(getitems.get(r, []))
    if dead is None:
        raise ValueError(f"the running product of the decays (output {r}) is used")
    return _pair_loop(gm, xs[r], xs[1 - r], getitems.get(1 - r, []),
                      [node, *[u for us in getitems.values() for u in us], *dead], node,
                      "associative_scan")


def loops_from_inlined_scans(gm: fx.GraphModule) -> list[Loop]:
    """associative_scan(..., combine_mode="generic") inlined by Dynamo (ssmc.inlined_scan)."""
    return [_pair_loop(gm, s.decays, s.inputs, s.outputs, list(s.outputs), s.outputs[0],
                       "associative_scan (generic, inlined)")
            for s in find_inlined_scans(gm.graph)]


def loops_from_written_scans(ctx, claimed=frozenset()) -> list[Loop]:
    """Scans written out in torch ops (ssmc.written_scan), skipping what `claimed` (other
    captures' nodes) holds: an autograd.Function whose forward is one and whose backward checks
    out (the function goes whole); the log-space and prefix-product closed forms (their output
    node stands for the states; the log form's exps are made here); doubling, or up- and
    down-sweeps on views in place, where each output's readers are moved to a new node standing
    for the scan, placed before the first of them: the region goes there, and the scan's own
    nodes (its writes in place included) go."""
    from ssmc.written_scan import find_closed_forms, find_written_scans, function_scan
    gm = ctx.gm
    loops = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}     # the nodes made below are no readers
    afa = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    for hop in [n for n in gm.graph.nodes if afa is not None and n.op == "call_function" and n.target is afa
                and n not in claimed]:
        f = function_scan(gm, hop)
        if isinstance(f, str):
            ctx.fallbacks.append((hop.name, f))
        elif f is not None:
            outs = sorted(f.outputs, key=order.__getitem__)
            loops.append(_pair_loop(gm, f.decays, f.inputs, outs, [hop, *outs], outs[0],
                                    "parallel scan (written out) in an autograd.Function", f.dim))
    for s in find_closed_forms(gm.graph):
        if s.output in claimed:
            continue
        if not s.logs:
            loops.append(_pair_loop(gm, s.decays, s.inputs, [s.output], [s.output], s.output,
                                    "prefix-product scan (written out)", s.dim))
            continue
        with gm.graph.inserting_before(s.output):
            a, b = (gm.graph.call_function(torch.exp, (x,)) for x in (s.decays, s.inputs))
        for e, x in ((a, s.decays), (b, s.inputs)):
            e.meta["example_value"] = _exp_value(x)
        loops.append(_pair_loop(gm, a, b, [s.output], [s.output], s.output, "log-space scan (written out)",
                                s.dim))
        loops[-1].made = [a, b]
    scans, why = find_written_scans(gm.graph)
    ctx.fallbacks.extend(why)
    for s in scans:
        if claimed & set(s.erase):        # another capture (an inlined associative_scan) took it
            continue
        own = set(s.erase)
        readers = sorted({u for n in s.outputs for u in n.users if u not in own}, key=order.__getitem__)
        with gm.graph.inserting_before(readers[0]):
            stand = gm.graph.call_function(torch.Tensor.view_as, (s.outputs[0], s.outputs[0]))
        stand.meta["example_value"] = s.outputs[0].meta.get("example_value")
        for n in s.outputs:
            for u in list(n.users):
                if u not in own and u is not stand:
                    u.replace_input_with(n, stand)
        loops.append(_pair_loop(gm, s.decays, s.inputs, [stand], [*s.erase, stand], stand,
                                "parallel scan (written out)", s.dim))
    return loops


def _exp_value(x: fx.Node):
    """The example value of exp(x), under the graph's fake mode."""
    mode = _fake_mode(x.graph)
    with (mode if mode is not None else contextlib.nullcontext()):
        return torch.exp(value_of(x))


def _pair_loop(gm, a, b, replace, erase, anchor, origin, dim: int = 0) -> Loop:
    """The loop h_t = a_t * h_{t-1} + b_t over dim `dim` of a and b from a zero state, its stacked
    states standing for the outer nodes `replace`."""
    mode = _fake_mode(gm.graph)
    body = fx.Graph()
    h = body.placeholder("carry_0")
    ra, rb = body.placeholder("read_0"), body.placeholder("read_1")
    with (mode if mode is not None else contextlib.nullcontext()):
        for ph, src in ((ra, a), (rb, b)):
            ph.meta["example_value"] = torch.select(value_of(src), dim, 0)
        h.meta["example_value"] = torch.select(value_of(b), dim, 0)
        m = body.call_function(operator.mul, (ra, h))
        m.meta["example_value"] = h.meta["example_value"] * ra.meta["example_value"]
        new = body.call_function(operator.add, (m, rb))
        new.meta["example_value"] = m.meta["example_value"] + rb.meta["example_value"]
    body.output((new, new))
    return Loop("", fx.GraphModule(gm, body), None, [None], [Read(a, dim, 0), Read(b, dim, 0)], [],
                [Result("steps", "scan", dim, list(replace))], erase=erase, anchor=anchor,
                origin=origin)


def _dead_users(roots: list) -> list | None:
    """The nodes computed from `roots` (their users, transitively), in graph order, when none of
    them reaches the output or writes in place, so all can go; None when one is live. (torch's
    own `associative_scan` moves the scan dim back on every output, the unused ones too.)"""
    seen, todo = {}, list(roots)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op == "output" or impure(n):
            return None
        seen[n] = None
        todo.extend(n.users)
    order = {n: i for i, n in enumerate(roots[0].graph.nodes)} if roots else {}
    return sorted((n for n in seen if n not in roots), key=order.__getitem__)
