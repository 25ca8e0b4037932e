"""Running maxima that only stabilise a recurrence, computed before its loop.

Recurrences with exponential weights keep a running maximum `m` to stay in floating-point
range (RWKV-4's wkv, the mLSTM's stabiliser):

    q = max(m + w, k_t)                       # m_t = max(m_{t-1} + alpha_t, beta_t)
    num = exp(m + w - q) * num + exp(k_t - q) * v_t
    m = q

`max` is not linear, so such a loop ran as written. But `m` reads nothing but itself and the
step's inputs, and its recurrence is linear in the (max, +) semiring, so all its steps follow at
once:

    m_t = A_t + max(m_0, max_{s <= t} (beta_s - A_s)),   A_t = alpha_1 + ... + alpha_t

(in float64, composed by doubling: see `max_plus_scan`). `gauge_states` computes them before the loop and makes `m`
two per-step reads (its value before and after each step) instead of a carried value; what is
left of the step (`num` above) is then linear and becomes a region. The values are the loop's own
running maxima (not a rescaling), so results, the final `m` included, match the loop's.

A running log-sum-exp `m = logaddexp(m + alpha_t, beta_t)` (a recurrence kept in log space) is
the same in the (logaddexp, +) semiring.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .capture import _Builder, _fake_mode
from .lower import _sub_graph, _Vmapped
from .ops import canonical, reaches, value

_SUMS = {torch.maximum: "max", torch.max: "max", torch.logaddexp: "logaddexp"}     # the semiring's "sum"
_SUM_METHODS = {"maximum": "max", "max": "max", "logaddexp": "logaddexp"}


def max_plus_scan(alpha, beta, m0, length: int, alpha_steps: bool, beta_steps: bool, dtype, kind: str = "max"):
    """(m_{t-1}, m_t) for t = 1..length, stacked along dim 0, of m_t = max(m_{t-1} + alpha_t,
    beta_t) from m0 (kind "logaddexp": logaddexp instead of max).
    `alpha`/`beta` have the steps along dim 0 where `*_steps` (else they are the same every
    step); either may be a Python number. Summed in float64, returned as `dtype`, each step of
    the shape m0, alpha_t and beta_t broadcast to (sizes are read here, not fixed in the graph:
    Dynamo may make them symbolic)."""
    a = torch.as_tensor(alpha, dtype=torch.float64, device=m0.device)
    b = torch.as_tensor(beta, dtype=torch.float64, device=m0.device)
    length = a.shape[0] if alpha_steps else b.shape[0] if beta_steps else length
    a_t, b_t = (a[0] if alpha_steps else a), (b[0] if beta_steps else b)
    shape = torch.broadcast_shapes(m0.shape, a_t.shape, b_t.shape)

    def steps(v, along):                          # (length, *shape)
        if not along:
            return v.broadcast_to(shape).unsqueeze(0).expand(length, *shape)
        return v.reshape(length, *[1] * (len(shape) + 1 - v.dim()), *v.shape[1:]).broadcast_to((length, *shape))
    a, b = steps(a, alpha_steps), steps(b, beta_steps)
    plus = torch.maximum if kind == "max" else torch.logaddexp
    # Step t is the map m -> plus(m + a_t, b_t); two such maps compose to (a1 + a2, plus(b1 + a2, b2)).
    # Composed by doubling (log2(length) rounds), nothing is differenced: a decay of -inf (a reset)
    # or of -1e20 leaves the other steps' sums exact, where A_t - A_s of the prefix sums would not.
    d = 1
    while d < length:
        a, b = torch.cat([a[:d], a[:-d] + a[d:]]), torch.cat([b[:d], plus(b[:-d] + a[d:], b[d:])])
        d *= 2
    m = plus(m0.double() + a, b)
    m = m.to(dtype).contiguous()
    return torch.cat([m0.to(dtype).broadcast_to(shape).unsqueeze(0), m[:-1]], 0), m


def _same(n):
    """n without identities and casts to its own dtype (``.to(torch.float32)`` of a float32)."""
    while isinstance(n, fx.Node):
        c = canonical(n)
        if c is None or not (c.kind == "identity" or (c.kind == "ew" and c.op == "cast")) or not c.tensor_args():
            return n
        src = c.tensor_args()[0]
        if getattr(value(src), "dtype", None) != getattr(value(n), "dtype", None):
            return n
        n = src
    return n


def _split_sum(n: fx.Node):
    """(kind, a, b) of a two-operand maximum or logaddexp, else None."""
    n = _same(n)
    if n.op == "call_function" and n.target in _SUMS and len(n.args) == 2 and not n.kwargs:
        kind, (a, b) = _SUMS[n.target], n.args
    elif n.op == "call_method" and n.target in _SUM_METHODS and len(n.args) == 2 and not n.kwargs:
        kind, (a, b) = _SUM_METHODS[n.target], n.args
    else:
        return None
    return (kind, a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


def _plus(n, m: fx.Node):
    """alpha where n is m + alpha, alpha + m or m - c (alpha a node or a number), 0 where n is m
    itself (a running maximum that does not decay: online softmax's max(m, s_t)), else None."""
    if not isinstance(n, fx.Node):
        return None
    if _same(n) is m:
        return 0.0
    c = canonical(n)
    if c is None or c.kind != "ew" or len(c.args) != 2 or c.params.get("alpha", 1) != 1:
        return None
    x, y = (_same(a) for a in c.args)
    if c.op == "add":
        return y if x is m else x if y is m else None
    if c.op == "sub" and x is m and not isinstance(y, fx.Node) and isinstance(y, (int, float)):
        return -y
    return None


def gauge_states(gm: fx.GraphModule, lp) -> list[str]:
    """Make each carried value of `lp` whose update is ``max(m + alpha, beta)`` or
    ``logaddexp(m + alpha, beta)`` (alpha and beta computed from the step's reads and invariants
    only) two reads of sequences computed before the loop (`max_plus_scan`). Returns the names
    of the values taken out of the carry."""
    if lp.length is None or any(r.width != 1 for r in lp.reads):
        return []
    done = []
    while True:
        carries, outs = lp.carry_nodes(), lp.carry_outputs()
        found = None
        for k, (m, q) in enumerate(zip(carries, outs)):
            split = _split_sum(q) if isinstance(q, fx.Node) else None
            if split is None or not isinstance(lp.carry_init[k], fx.Node):
                continue
            kind, *parts = split
            for a, b in (parts, parts[::-1]):
                alpha = _plus(a, m)
                if alpha is None:
                    continue
                if reaches([alpha, b], set(carries)):
                    continue
                found = (k, m, q, alpha, b, kind)
                break
            if found:
                break
        if not found:
            return done
        k, m, q, alpha, beta, kind = found
        _take_out(gm, lp, k, m, q, alpha, beta, kind)
        done.append(m.name)


def _take_out(gm, lp, k, m, q, alpha, beta, kind) -> None:
    body = lp.body.graph
    b = _Builder(gm.graph, _fake_mode(gm.graph))

    def call(target, args):
        """Insert right after the latest of args (later passes may move the loop's anchor
        earlier, never before its inputs)."""
        ins = []
        fx.node.map_arg(args, ins.append)
        order = {n: i for i, n in enumerate(gm.graph.nodes)} if ins else {}
        last = max(ins, key=order.__getitem__, default=None)
        n = b.call(last.next if last is not None else lp.anchor, target, args)
        lp.made.append(n)
        return n

    reads, invs = lp.read_nodes(), lp.invariant_nodes()
    L = lp.length
    # alpha and beta for all steps: the body nodes they need, vmapped over the reads' time dim
    nodes = [v for v in (alpha, beta) if isinstance(v, fx.Node)]
    mod, takes = _sub_graph(lp, nodes, {})
    args, dims = [], []
    for ph in takes:
        if ph in reads:
            r = lp.reads[reads.index(ph)]
            src = r.source
            if not (r.start == 0 and value(src).shape[r.dim] == L):
                src = call(torch.narrow, (src, r.dim, r.start, L))
            args.append(src)
            dims.append(r.dim)
        else:
            args.append(lp.invariants[invs.index(ph)])
            dims.append(None)
    seqs = []
    if nodes:
        both = call(_Vmapped(mod, dims), tuple(args))
        seqs = [call(operator.getitem, (both, i)) for i in range(len(nodes))]
    stepped = any(d is not None for d in dims)
    it = iter(seqs)
    a_val = next(it) if isinstance(alpha, fx.Node) else alpha
    b_val = next(it) if isinstance(beta, fx.Node) else beta
    pair = call(max_plus_scan, (a_val, b_val, lp.carry_init[k], L,
                                             stepped and isinstance(alpha, fx.Node),
                                             stepped and isinstance(beta, fx.Node),
                                             value(m).dtype, kind))
    prev, new = call(operator.getitem, (pair, 0)), call(operator.getitem, (pair, 1))
    # in the body: m is read (its value before the step), its new value too; no longer carried
    first_inv = invs[0] if invs else next(n for n in body.nodes if n.op != "placeholder")
    first_inv.prepend(m)
    with body.inserting_before(first_inv):
        q_read = body.placeholder(f"{m.name}_next")
    q_read.meta = dict(m.meta)
    _same(q).replace_all_uses_with(q_read)       # the maximum itself (q may be a cast of it)
    q.replace_all_uses_with(q_read)
    out = next(n for n in body.nodes if n.op == "output")
    vals = list(out.args[0])
    del vals[k]
    out.args = (tuple(vals),)
    body.eliminate_dead_code()
    lp.carry_init.pop(k)
    from .loop import Read
    lp.reads += [Read(prev, 0), Read(new, 0)]
    lp.body.recompile()
