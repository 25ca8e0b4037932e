"""torch's associative_scan in its "generic" combine mode, as Dynamo captures it.

Dynamo makes no scan node for ``associative_scan(fn, (a, b), dim, combine_mode="generic")`` (the
mode HF transformers' Mamba takes off the GPU): it inlines torch's odd-even scan, a tree of
step-2 slices of the operands, the combine function applied to halves (vmapped: its level
pushes and pops around plain elementwise ops), and interleaves (stack, flatten, pad, slice, cat)
of the partial results. This module proves which outer node of such a tree holds the linear
recurrence ``h_t = a_t * h_{t-1} + b_t`` of two tensors along dim 0, so `reroll` can hand it on
as one loop, as it does the scan node.

The proof is an abstract interpretation over the graph in order. Each value along dim 0 is
followed element by element as a fact about a run of steps lo..hi, true whatever role the
tensors play:
  ("leaf", x, k)               element k of leaf x (a tensor the tree slices by twos)
  ("prod", a, lo, hi)          a_lo * ... * a_hi
  ("scan", a, b, lo, hi)       the recurrence over steps lo..hi from a zero state
  ("part", a, b, lo, mid, hi)  prod(a, mid+1, hi) * scan(a, b, lo, mid)
  ("zero",)                    padding
A product of products over adjacent runs is a product; a product times a scan of the run just
before it is a part; a part plus the scan of the rest of its run is the scan of the whole run.
Only mul and add of two followed values of one shape (and addcmul, the two in one) are taken;
any other op on one ends the trail there. A node all of whose elements k are scan(a, b, 0, k)
is the recurrence's output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ssmc.ops import canonical, shape

_aten = torch.ops.aten
_SLICE = (_aten.slice, _aten.slice.Tensor)
_PAD = (torch._C._nn.pad, torch.nn.functional.pad)
_BATCH = ("_add_batch_dim", "_remove_batch_dim")


@dataclass
class InlinedScan:
    decays: fx.Node            # a, read along dim 0
    inputs: fx.Node            # b, read along dim 0
    outputs: list              # the outer nodes holding the stacked states (dim 0 is time)


def find_inlined_scans(graph: fx.Graph) -> list[InlinedScan]:
    """The recurrences computed by inlined odd-even scan trees, one per (decays, inputs) pair."""
    vals: dict[fx.Node, list] = {}
    for n in graph.nodes:
        v = _step(n, vals)
        if v is None and _sliced_by_twos(n):
            v = [("leaf", n, k) for k in range(_len0(n))]
        if v is not None:
            vals[n] = v
    found: dict[tuple, InlinedScan] = {}
    for n, v in vals.items():
        if len(v) < 2 or v[1][0] != "scan" or not n.users or any(u in vals for u in n.users):
            continue
        a, b = v[1][1], v[1][2]
        full = v[0] == ("leaf", b, 0) and all(t == ("scan", a, b, 0, k) for k, t in enumerate(v) if k)
        if full and len(v) == _len0(b) == _len0(a) and _same_shape(a, b, n):
            found.setdefault((a, b), InlinedScan(a, b, [])).outputs.append(n)
    return list(found.values())


def symbolic_trees(graph: fx.Graph) -> list[fx.Node]:
    """Operands an odd-even tree slices by twos whose length along dim 0 is symbolic (Dynamo
    made it so on a recompile): no proof runs over a length not known."""
    return [n for n in graph.nodes if _twos(n) and _len0(n) is None]


def _len0(n) -> int | None:
    s = shape(n) if isinstance(n, fx.Node) else None
    return int(s[0]) if s and isinstance(s[0], int) else None


def _same_shape(*nodes) -> bool:
    shapes = [tuple(shape(n) or ()) for n in nodes]
    return bool(shapes[0]) and all(s == shapes[0] for s in shapes)


def _sliced_by_twos(n: fx.Node) -> bool:
    return _twos(n) and (_len0(n) or 0) >= 2


def _twos(n: fx.Node) -> bool:
    """The first op torch's tree does on an operand: elements 0, 2, 4, ... and 1, 3, 5, ..."""
    steps = {(_arg(u, 2, "start", 0), _arg(u, 4, "step", 1)) for u in n.users
             if u.op == "call_function" and u.target in _SLICE and _arg(u, 1, "dim", 0) == 0}
    return (0, 2) in steps and (1, 2) in steps


def _arg(n: fx.Node, i: int, name: str, default):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _step(n: fx.Node, vals: dict) -> list | None:
    """The followed value of node n from its inputs', or None."""
    if n.op not in ("call_function", "call_method"):
        return None
    if not any(x in vals for x in n.all_input_nodes):
        return None
    t, args = n.target, n.args
    name = getattr(t, "__name__", "")
    if name in _BATCH and args and args[0] in vals:
        dim = args[1] if name == "_add_batch_dim" else (args[3] if len(args) > 3 else None)
        return vals[args[0]] if dim == 0 else None
    if t in _SLICE and args[0] in vals and _arg(n, 1, "dim", 0) == 0:
        start, end, step = _arg(n, 2, "start", None), _arg(n, 3, "end", None), _arg(n, 4, "step", 1)
        return vals[args[0]][slice(start, end, step)]
    if t is torch.cat and _arg(n, 1, "dim", 0) == 0 and all(x in vals for x in args[0]):
        return [e for x in args[0] for e in vals[x]]
    if t is torch.stack and _arg(n, 1, "dim", 0) == 1 and len(args[0]) == 2 \
            and all(x in vals for x in args[0]) and len(vals[args[0][0]]) == len(vals[args[0][1]]):
        return [("pair", p, q) for p, q in zip(vals[args[0][0]], vals[args[0][1]])]
    if t is torch.flatten and args[0] in vals and (_arg(n, 1, "start_dim", 0), _arg(n, 2, "end_dim", -1)) == (0, 1):
        v = vals[args[0]]
        return [e for p in v for e in p[1:]] if all(p[0] == "pair" for p in v) else None
    if t in _PAD and args[0] in vals:
        pad = list(_arg(n, 1, "pad", ()))
        mode, value = _arg(n, 2, "mode", "constant"), _arg(n, 3, "value", None)
        if mode != "constant" or value not in (None, 0, 0.0) or any(pad[:-2]) or len(pad) < 2:
            return None
        before, after = pad[-2], pad[-1]
        if len(pad) != 2 * len(shape(args[0]) or ()) or before < 0 or after < 0:
            return None
        return [("zero",)] * before + vals[args[0]] + [("zero",)] * after
    c = canonical(n)
    if c is not None and c.kind == "ew" and c.op == "addcmul" and c.params.get("value", 1) == 1:
        x, y, z = c.args                   # x + y * z, as `torch.addcmul(b2, a2, b1)` spells the combine
        if all(e in vals for e in c.args) and len({len(vals[e]) for e in c.args}) == 1 and _same_shape(x, y, z):
            prods = [_mul(q, r) for q, r in zip(vals[y], vals[z])]
            out = [None if m is None else _add(p, m) for p, m in zip(vals[x], prods)]
            return None if any(e is None for e in out) else out
        return None
    if c is None or c.kind != "ew" or c.op not in ("mul", "add") or c.params or len(c.args) != 2:
        return None
    x, y = c.args
    if x not in vals or y not in vals or len(vals[x]) != len(vals[y]) or not _same_shape(x, y):
        return None
    rule = _mul if c.op == "mul" else _add
    out = [rule(p, q) for p, q in zip(vals[x], vals[y])]
    return None if any(e is None for e in out) else out


def _as_prod(t):
    if t[0] == "leaf":
        return t[1], t[2], t[2]
    return t[1:] if t[0] == "prod" else None


def _as_scan(t, a):
    """t as a scan with decays a: (b, lo, hi); a single element is the scan of one step."""
    if t[0] == "leaf":
        return t[1], t[2], t[2]
    return (t[2], t[3], t[4]) if t[0] == "scan" and t[1] is a else None


def _mul(p, q):
    pp, qp = _as_prod(p), _as_prod(q)
    if pp and qp and pp[0] is qp[0]:
        (a, lo1, hi1), (_, lo2, hi2) = pp, qp
        if hi1 + 1 == lo2 or hi2 + 1 == lo1:
            return ("prod", a, min(lo1, lo2), max(hi1, hi2))
        return None
    for x, y in ((p, q), (q, p)):
        d = _as_prod(x)
        s = _as_scan(y, d[0]) if d else None
        if s and s[2] + 1 == d[1] and s[0] is not d[0]:
            return ("part", d[0], s[0], s[1], s[2], d[2])
    return None


def _add(p, q):
    for x, y in ((p, q), (q, p)):
        if x[0] == "part":
            _, a, b, lo, mid, hi = x
            s = _as_scan(y, a)
            if s and s[0] is b and (s[1], s[2]) == (mid + 1, hi):
                return ("scan", a, b, lo, hi)
    return None
