"""Prefix scans written out in torch ops, as Dynamo captures them: a scan by doubling
(Hillis-Steele: ``h[:, s:] + a[:, s:] * h[:, :-s]`` and a ``cat``, or a shifted ``pad``), or an
up- and down-sweep on views written in place (Blelloch's, as mamba.py's ``pscan`` writes it:
``xv = x.view(B, T // 2, 2, ...)``, ``xv[:, :, 1].add_(av[:, :, 1] * xv[:, :, 0])``). This module
proves which node holds the linear recurrence ``h_t = a_t * h_(t-1) + b_t`` of two tensors along
one of their dims, so `reroll` can hand it on as one loop, as it does the scan node. Inside a
``torch.autograd.Function`` the same proof runs on its forward, and its backward is checked by
evaluation (`function_scan`). The closed forms (log-space, prefix products: `find_closed_forms`)
are identities, matched as written.

The proof follows every element along that dim as a fact, with ssmc.inlined_scan's algebra
(leaf, prod, scan, part; here also "zero" and "one" for padding, "unknown" for anything else).
A tracked tensor is a storage of facts (its root: a leaf, or a node that made new values) and, for
every element along the scan's dims, the position in that storage it reads: views (indexing,
select, narrow, view, transpose, permute) read the storage they alias; ``add_``, ``mul_``,
``+=``, ``*=`` and ``x[idx] = v`` write into it, and a tensor read later sees what was written.
Other dims must pass through untouched. Sound by construction where it is not sure:
- ``reshape``, ``contiguous`` (a view or a copy, as strides fall) copy, and freeze both
  storages: a later write to either makes them unknown;
- any other in-place op on a tracked tensor, or on what an unknown op made from one (it may be a
  view), makes that storage unknown;
- a leaf written in place, or sharing memory with a tensor written in place anywhere in the
  graph, is not a leaf: no scan of it is taken.
A node all of whose elements k are scan(a, b, 0, k), read only after the last write of its
storage, is the recurrence's output; everything between the leaves and it must have no other
reader (it is erased).

Leaves are found from the shapes a scan leaves behind: a tensor sliced along one dim both from an
offset on and up to that offset from the end (``h[:, s:]``, ``h[:, :-s]``), shifted by a pad cut
back to its length, read every k-th element from two offsets (``x[:, 1::2]``, ``x[:, 0::2]``), or
split into pairs (``view(..., T // 2, 2, ...)``) whose halves are both read; the walk goes back
from there through clones, transposes, pads and casts to the tensor made by other ops.
"""
from __future__ import annotations

import dataclasses
import operator

import numpy as np
import torch
import torch.fx as fx

from ssmc.capture import _changed_in_place
from ssmc.inlined_scan import _add as _add_facts, _mul as _mul_facts
from ssmc.ops import _arg, canonical, dtype, mutated, shape

ZERO, ONE, UNKNOWN = ("zero",), ("one",), ("unknown",)
BUDGET = 1_000_000           # facts followed in one graph at most (tracked nodes x their elements)
MAX_LEN = 1 << 16           # the longest scan followed
_INPLACE = {"add_": "add", "mul_": "mul", "iadd": "add", "imul": "mul"}
_PAD = (torch._C._nn.pad, torch.nn.functional.pad)


@dataclasses.dataclass(frozen=True)
class WrittenScan:
    decays: fx.Node            # a (a leaf), read along `dim`
    inputs: fx.Node            # b
    dim: int
    outputs: list              # nodes holding the stacked states, read only after the scan's writes
    erase: list                # the scan's own nodes, in graph order


@dataclasses.dataclass
class _T:
    """A tracked tensor: `idx` (one axis per dim of `sdims`, in that order) holds, for each element
    along the scan's dims, its position in the storage of `root`; `shape` is the node's."""
    root: fx.Node
    idx: np.ndarray
    sdims: tuple
    shape: tuple

    @property
    def free(self) -> tuple:
        return tuple(s for d, s in enumerate(self.shape) if d not in self.sdims)


def _mul(p, q):
    if p is UNKNOWN or q is UNKNOWN:
        return UNKNOWN
    if p == ZERO or q == ZERO:
        return ZERO
    if p == ONE:
        return q
    if q == ONE:
        return p
    return _mul_facts(p, q) or UNKNOWN


def _add(p, q):
    if p is UNKNOWN or q is UNKNOWN:
        return UNKNOWN
    if p == ZERO:
        return q
    if q == ZERO:
        return p
    return _add_facts(p, q) or UNKNOWN


_RULES = {"mul": np.frompyfunc(_mul, 2, 1), "add": np.frompyfunc(_add, 2, 1)}


def find_written_scans(graph: fx.Graph, free=frozenset()) -> tuple[list[WrittenScan], list[tuple[str, str]]]:
    """The recurrences that hand-written parallel scans compute, and (node, why) for each
    proven scan that cannot be taken (its intermediate values read elsewhere). Readers in `free`
    may read any of the scan's values (an autograd.Function's output: what it saves)."""
    seeds = _seeds(graph)
    if not seeds:
        return [], []
    s = _Follow(graph, seeds)
    if not s.run():
        return [], []
    return s.results(free)


# -- where the leaves are ------------------------------------------------------------------------

def _filled(dims: tuple, fact) -> np.ndarray:
    """An object array of shape `dims` holding `fact` everywhere (np.full would spread a tuple)."""
    out = np.empty(dims, dtype=object)
    out.reshape(-1)[:] = [fact] * out.size
    return out


def _pad_widths(p: fx.Node, nd: int) -> list | None:
    """(before, after) for each of the nd dims a pad node pads (F.pad lists the last dim first);
    None where its list does not fit nd dims."""
    pad = list(_arg(p, 1, "pad", ()))
    if len(pad) % 2 or len(pad) > 2 * nd:
        return None
    widths = [(0, 0)] * nd
    for k in range(len(pad) // 2):
        widths[nd - 1 - k] = (pad[2 * k], pad[2 * k + 1])
    return widths


_FILLS = {torch.zeros: ZERO, torch.ones: ONE, torch.zeros_like: ZERO, torch.ones_like: ONE,
          "new_zeros": ZERO, "new_ones": ONE}
_FULLS = (torch.full, torch.full_like, "new_full")


def _scalar_fact(v):
    """ZERO or ONE for the numbers 0 and 1 (True and False as they convert), else None."""
    return {0: ZERO, 1: ONE}.get(v) if isinstance(v, (int, float)) else None


def _const_fill(n) -> tuple | None:
    """ZERO or ONE where n is a tensor made full of that number (zeros, ones, full, their _like
    and new_ forms) and never written in place; None otherwise."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return None
    t = n.target
    if t in _FULLS:
        k = 2 if t == "new_full" else 1          # (size, fill) / (input, fill) / (self, size, fill)
        fact = _scalar_fact(_arg(n, k, "fill_value", None))
    else:
        fact = _FILLS.get(t)
    if fact is None or any(mutated(u) is n for u in n.users):
        return None
    return fact


def _index_tuple(n: fx.Node):
    idx = n.args[1]
    return idx if isinstance(idx, tuple) else (idx,)


def _dims_of_index(idx: tuple, ndim: int):
    """[(input dim, index element)] of a basic index (slices, ints; one Ellipsis); None for
    anything else (None, tensors, lists)."""
    if sum(e is Ellipsis for e in idx) > 1:
        return None
    out, d = [], 0
    for k, e in enumerate(idx):
        if e is Ellipsis:
            d += ndim - (len(idx) - 1)
            continue
        if not isinstance(e, (slice, int)) or isinstance(e, bool):
            return None
        if isinstance(e, slice) and not all(v is None or isinstance(v, int) for v in (e.start, e.stop, e.step)):
            return None
        out.append((d, e))
        d += 1
    return out if d <= ndim else None


def _shifts(n: fx.Node) -> set:
    """The dims along which n is read both from an offset on and up to that offset from the end."""
    nd = len(shape(n))
    starts, stops = set(), set()
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[0] is n:
            for d, e in _dims_of_index(_index_tuple(u), nd) or ():
                if isinstance(e, slice) and (e.step or 1) == 1:
                    if (e.start or 0) > 0 and e.stop is None:
                        starts.add((d, e.start))
                    if e.start in (None, 0) and isinstance(e.stop, int) and e.stop < 0:
                        stops.add((d, -e.stop))
    return {d for d, k in starts if (d, k) in stops}


def _strided(n: fx.Node) -> set:
    """The dims along which n is read every k-th element (k >= 2) from two different offsets
    (``x[:, 1::2]`` and ``x[:, 0::2]``; ``x[:, 2s-1::2s]`` and ``x[:, s-1::2s]``)."""
    nd, seen = len(shape(n)), {}
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[0] is n:
            for d, e in _dims_of_index(_index_tuple(u), nd) or ():
                if isinstance(e, slice) and (e.step or 1) >= 2:
                    seen.setdefault((d, e.step), set()).add(e.start or 0)
    return {d for (d, _), starts in seen.items() if len(starts) >= 2}


def _pair_split(n: fx.Node) -> int | None:
    """The dim of n a view splits into (T // 2, 2) whose two halves are both read, or None."""
    for u in n.users:
        if u.op != "call_method" or u.target != "view" or u.args[0] is not n:
            continue
        m = _split_dims(shape(n), shape(u))
        if m is None:
            continue
        (d, (lo, hi)) = m
        if hi - lo != 2 or shape(u)[lo + 1] != 2:
            continue
        picks = set()
        for w in u.users:
            if w.op == "call_function" and w.target is operator.getitem:
                for dd, e in _dims_of_index(_index_tuple(w), len(shape(u))) or ():
                    if dd == lo + 1 and isinstance(e, int):
                        picks.add(e % 2)
        if picks == {0, 1}:
            return d
    return None


def _fill_shift(n: fx.Node) -> set:
    """The dims along which n cut short at the end (``x[:, :-s]``) is concatenated after a fill
    of s elements (``torch.cat([x.new_zeros(.., s, ..), x[:, :-s]], 1)``): x shifted by s."""
    out, nd = set(), len(shape(n))
    for u in n.users:
        if not (u.op == "call_function" and u.target is operator.getitem and u.args[0] is n):
            continue
        items = [(d, e) for d, e in _dims_of_index(_index_tuple(u), nd) or ()
                 if not (isinstance(e, slice) and e == slice(None))]
        if len(items) != 1 or not isinstance(items[0][1], slice):
            continue
        d, e = items[0]
        if not (e.start in (None, 0) and e.step in (None, 1) and isinstance(e.stop, int) and e.stop < 0):
            continue
        for c in u.users:
            if c.op == "call_function" and c.target is torch.cat and _arg(c, 1, "dim", 0) % nd == d:
                parts = list(c.args[0])
                if len(parts) >= 2 and parts[1] is u and _const_fill(parts[0]) and shape(parts[0])[d] == -e.stop:
                    out.add(d)
    return out


def _roll_args(n: fx.Node) -> tuple | None:
    """(shift, dim) of ``torch.roll(x, s, d)`` / ``x.roll(s, d)`` by a whole number of steps
    along one dim (one-element lists unwrapped); None for anything else."""
    if not (n.target is torch.roll or n.target == "roll"):
        return None
    sh, d = _arg(n, 1, "shifts", None), _arg(n, 2, "dims", None)
    sh, d = (x[0] if isinstance(x, (tuple, list)) and len(x) == 1 else x for x in (sh, d))
    return (sh, d) if isinstance(sh, int) and isinstance(d, int) else None


def _rolled(n: fx.Node) -> set:
    """The dims along which n is rolled (``torch.roll(x, s, d)``)."""
    nd = len(shape(n))
    return {r[1] % nd for u in n.users if u.args and u.args[0] is n and (r := _roll_args(u)) is not None}


def _pad_shift(n: fx.Node) -> set:
    """The dims along which n is padded at the front and the result cut back to n's length
    (``F.pad(h, (.., s, 0))[:, :L]``: h shifted by s)."""
    out, sh = set(), shape(n)
    for p in n.users:
        if p.op != "call_function" or p.target not in _PAD or p.args[0] is not n:
            continue
        widths = _pad_widths(p, len(sh))
        moved = [d for d, w in enumerate(widths or ()) if w != (0, 0)]
        if len(moved) != 1 or widths[moved[0]][0] <= 0:
            continue
        d = moved[0]
        for u in p.users:
            if u.op == "call_function" and u.target is operator.getitem:
                items = dict(_dims_of_index(_index_tuple(u), len(sh)) or ())
                e = items.get(d)
                if isinstance(e, slice) and e.start in (None, 0) and e.stop == sh[d] and e.step in (None, 1):
                    out.add(d)
    return out


def _split_dims(a: tuple, b: tuple):
    """(dim of a, (first, end) dims of b) where b is a with that one dim split into several and
    every other dim the same (the first dim from the left that differs); None otherwise."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    if i >= len(a) or len(b) - len(a) < 1:
        return None
    end = len(b) - (len(a) - i - 1)
    if tuple(a[i + 1:]) != tuple(b[end:]) or int(np.prod(b[i:end])) != a[i]:
        return None
    return i, (i, end)


def _back(n: fx.Node, d: int):
    """From a node and a dim, back through ops that keep that dim's elements where they were
    (clone, transposes, pads, casts, full slices) to the node another op made."""
    for _ in range(64):
        if n.op not in ("call_function", "call_method") or not n.args or not isinstance(n.args[0], fx.Node):
            return n, d
        t, src = n.target, n.args[0]
        if len(shape(src)) != len(shape(n)):
            return n, d
        if t in ("clone", "contiguous", "float", "to", "type_as") or t is torch.clone:
            n = src
        elif t in ("transpose", "swapaxes", "swapdims") or t is torch.transpose:
            d0, d1 = (_arg(n, 1, "dim0", 0) % len(shape(n)), _arg(n, 2, "dim1", 0) % len(shape(n)))
            n, d = src, {d0: d1, d1: d0}.get(d, d)
        elif t == "permute" or t is torch.permute:
            perm = n.args[1] if isinstance(n.args[1], (tuple, list)) else n.args[1:]
            n, d = src, perm[d] % len(shape(n))
        elif t in _PAD:
            n = src
        else:
            return n, d
    return n, d


def _seeds(graph: fx.Graph) -> dict:
    """{leaf node: dim} from the scans' signatures (`_shifts`, `_pair_split`)."""
    out = {}
    for n in graph.nodes:
        if not isinstance(n.meta.get("example_value"), torch.Tensor) or not n.meta["example_value"].is_floating_point():
            continue
        dims = _shifts(n) | _pad_shift(n) | _strided(n) | _fill_shift(n) | _rolled(n)
        p = _pair_split(n)
        if p is not None:
            dims.add(p)
        for d in dims:
            leaf, ld = _back(n, d)
            sh = shape(leaf)
            if all(type(s) is int for s in sh) and 2 <= sh[ld] <= MAX_LEN:
                out.setdefault(leaf, ld)
    return out


# -- following the facts -------------------------------------------------------------------------

class _Follow:
    def __init__(self, graph: fx.Graph, seeds: dict):
        self.graph, self.seeds = graph, seeds
        self.t: dict[fx.Node, _T] = {}
        self.store: dict[fx.Node, np.ndarray] = {}
        self.writes: dict[fx.Node, fx.Node] = {}      # root -> its last write
        self.frozen: set = set()
        self.maybe: dict[fx.Node, set] = {}           # untracked node -> roots it may alias
        self.machinery: set = set()                   # in-place nodes writing tracked storages
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.leaves: dict[fx.Node, int] = {}
        self.cost = 0

    def run(self) -> bool:
        for n in self.graph.nodes:
            if n in self.seeds and not any(x in self.t for x in n.all_input_nodes):
                self._seed(n, self.seeds[n])
                continue
            if n.op not in ("call_function", "call_method"):
                continue
            tracked = [x for x in n.all_input_nodes if x in self.t or x in self.maybe]
            if not tracked:
                continue
            try:
                if self._inplace(n):
                    continue
            except (ValueError, IndexError, TypeError):      # a write not followed: its storage unknown
                dst = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
                for r in ({self.t[dst].root} if dst in self.t else self.maybe.get(dst, set())):
                    self._poison(r, n)
                self.maybe[n] = {self.t[dst].root} if dst in self.t else set(self.maybe.get(dst, set()))
                continue
            try:
                v = self._value(n) if all(type(s) is int for s in shape(n)) else None
            except (ValueError, IndexError, TypeError):
                v = None
            if v is not None:
                self.t[n] = v
                self.cost += v.idx.size
                if self.cost > BUDGET:
                    return False
            else:
                roots = {self.t[x].root for x in tracked if x in self.t}
                for x in tracked:
                    roots |= self.maybe.get(x, set())
                self.maybe[n] = roots
        return True

    # the storages

    def _seed(self, n, d):
        L = shape(n)[d]
        self.store[n] = np.empty(L, dtype=object)
        self.store[n][:] = [("leaf", n, k) for k in range(L)]
        self.t[n] = _T(n, np.arange(L), (d,), tuple(shape(n)))
        self.leaves[n] = d

    def _new(self, n, facts: np.ndarray, sdims) -> _T:
        self.store[n] = facts.reshape(-1).copy()
        return _T(n, np.arange(facts.size).reshape(facts.shape), tuple(sdims), tuple(shape(n)))

    def facts(self, t: _T) -> np.ndarray:
        return self.store[t.root][t.idx]

    def _write(self, t: _T, facts, at: fx.Node):
        st = self.store[t.root]
        if t.root in self.frozen or t.root in self.leaves:
            facts = UNKNOWN
        if facts is UNKNOWN:
            st[t.idx.reshape(-1)] = [UNKNOWN] * t.idx.size
        else:
            st[t.idx.reshape(-1)] = list(np.broadcast_to(facts, t.idx.shape).reshape(-1))
        self.writes[t.root] = at

    def _poison(self, root, at):
        self.store[root][:] = [UNKNOWN] * self.store[root].size
        self.writes[root] = at

    # in-place writes

    def _inplace(self, n) -> bool:
        """Handle n if it writes a tensor in place (True); False if it does not."""
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        is_set = n.op == "call_function" and n.target is operator.setitem
        if not (is_set or (name.endswith("_") and not name.startswith("_")) or name in _INPLACE):
            return False
        if not n.args or not isinstance(n.args[0], fx.Node):
            return False
        dst = n.args[0]
        if dst in self.maybe and dst not in self.t:
            for r in self.maybe[dst]:
                self._poison(r, n)
            self.maybe[n] = set(self.maybe[dst])
            return True
        if dst not in self.t:
            # an untracked tensor written with tracked values: nothing tracked changes
            return False
        t = self.t[dst]
        self.machinery.add(n)
        if is_set:
            view = self._index(t, n.args[1], shape(dst))
            src = n.args[2]
            if view is not None and _scalar_fact(src) is not None:
                self._write(view, _filled(view.idx.shape, _scalar_fact(src)), n)
            elif view is None or src not in self.t or tuple(self.t[src].idx.shape) != tuple(view.idx.shape) \
                    or self.t[src].free != view.free:
                self._write(view if view is not None else t, UNKNOWN, n)
            else:
                self._write(view, self.facts(self.t[src]), n)
            return True
        op = _INPLACE.get(name)
        other = n.args[1] if len(n.args) > 1 else None
        ok = (op is not None and len(n.args) == 2 and not n.kwargs and isinstance(other, fx.Node)
              and other in self.t and self._aligned(t, self.t[other], t.shape))
        if ok:
            self._write(t, _RULES[op](self.facts(t), self.facts(self.t[other])), n)
        else:
            self._poison(t.root, n) if op is None else self._write(t, UNKNOWN, n)
        self.t[n] = t                       # the op returns the tensor it wrote
        return True

    def _aligned(self, x: _T, y: _T, out: tuple) -> bool:
        """x and y at the same positions along the scan, their other dims broadcasting to `out`."""
        return (x.sdims == y.sdims and x.idx.shape == y.idx.shape and len(x.shape) == len(y.shape) == len(out)
                and all(u in (o, 1) and v in (o, 1) for u, v, o in zip(x.shape, y.shape, out)))

    # values

    def _value(self, n) -> _T | None:
        t, args = n.target, n.args
        x = args[0] if args and isinstance(args[0], fx.Node) else None
        tx = self.t.get(x)
        if tx is not None:
            v = self._view(n, tx)
            if v is not None:
                return v
            if t == "clone" or t is torch.clone:
                return self._new(n, self.facts(tx), tx.sdims)
            if t in _PAD:
                return self._pad(n, tx)
            same = dtype(n) == dtype(x)
            if same and tuple(shape(n)) == tx.shape and t in ("contiguous", "to", "float", "type_as"):
                return self._copy_or_view(n, tx, tx)
            if same and (t in ("reshape", "flatten") or t in (torch.reshape, torch.flatten)):
                r = self._reshape(n, tx)
                return None if r is None else self._copy_or_view(n, tx, r)
            if _roll_args(n) is not None:
                return self._roll(n, tx)
            if t in (torch.ones_like, torch.zeros_like) and tuple(shape(n)) == tx.shape:
                return self._new(n, _filled(tx.idx.shape, ONE if t is torch.ones_like else ZERO), tx.sdims)
        if t is torch.cat:
            return self._cat(n)
        if t is torch.stack:
            return self._stack(n)
        c = canonical(n)
        if c is None or c.kind != "ew" or c.op not in ("mul", "add") or c.params or len(c.args) != 2:
            return None
        a, b = c.args
        if a not in self.t or b not in self.t or not self._aligned(self.t[a], self.t[b], tuple(shape(n))):
            return None
        return self._new(n, _RULES[c.op](self.facts(self.t[a]), self.facts(self.t[b])), self.t[a].sdims)

    def _copy_or_view(self, n, src: _T, like: _T) -> _T:
        """An op that returns a view or a copy as strides fall: a copy whose storage, and its
        source's, a later write makes unknown."""
        self.frozen.add(src.root)
        out = self._new(n, self.facts(like), like.sdims)
        self.frozen.add(n)
        return out

    def _view(self, n, tx: _T) -> _T | None:
        t, args = n.target, n.args
        nd = len(tx.shape)
        if n.op == "call_function" and t is operator.getitem:
            return self._index(tx, args[1], tx.shape)
        if t == "select" or t is torch.select:
            d, i = _arg(n, 1, "dim", 0), _arg(n, 2, "index", 0)
            return self._index(tx, (slice(None),) * (d % nd) + (i,), tx.shape)
        if t == "narrow" or t is torch.narrow:
            d, s, ln = _arg(n, 1, "dim", 0), _arg(n, 2, "start", 0), _arg(n, 3, "length", 0)
            return self._index(tx, (slice(None),) * (d % nd) + (slice(s, s + ln),), tx.shape)
        if t == "view" and n.op == "call_method":
            return self._reshape(n, tx)
        if t in ("transpose", "swapaxes", "swapdims") or t is torch.transpose:
            d0, d1 = _arg(n, 1, "dim0", 0) % nd, _arg(n, 2, "dim1", 0) % nd
            perm = list(range(nd))
            perm[d0], perm[d1] = d1, d0
            return self._permute(tx, perm, n)
        if t == "permute" or t is torch.permute:
            perm = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            return self._permute(tx, [p % nd for p in perm], n)
        return None

    def _index(self, tx: _T, idx, full: tuple) -> _T | None:
        idx = idx if isinstance(idx, tuple) else (idx,)
        items = _dims_of_index(idx, len(full))
        if items is None:
            return None
        ix, sd, new_shape, out_sdims, removed = tx.idx, list(tx.sdims), list(full), [], set()
        keys = [slice(None)] * ix.ndim
        for d, e in items:
            if d in sd:
                keys[sd.index(d)] = e
                if isinstance(e, int):
                    removed.add(d)
            elif not (isinstance(e, slice) and e.step in (None, 1) and (e.start or 0) == 0
                      and (e.stop is None or e.stop >= full[d])):
                return None
        ix = ix[tuple(keys)]
        kept = [d for d in range(len(full)) if d not in removed]
        ax = 0
        for d in kept:
            if d in sd:
                new_shape[d] = ix.shape[ax]
                out_sdims.append(kept.index(d))
                ax += 1
        shp = tuple(new_shape[d] for d in kept)
        if not out_sdims:
            return None
        return _T(tx.root, ix, tuple(out_sdims), shp)

    def _reshape(self, n, tx: _T) -> _T | None:
        new = tuple(shape(n))
        old = tx.shape
        i = 0
        while i < min(len(old), len(new)) and old[i] == new[i] and i not in tx.sdims:
            i += 1
        j = 0
        while j < min(len(old), len(new)) - i and old[-1 - j] == new[-1 - j] and (len(old) - 1 - j) not in tx.sdims:
            j += 1
        mid_old = tuple(range(i, len(old) - j))
        if tuple(tx.sdims) != mid_old or not mid_old:
            return None
        mid_new = new[i:len(new) - j]
        if int(np.prod(mid_new)) != tx.idx.size:
            return None
        return _T(tx.root, tx.idx.reshape(mid_new), tuple(range(i, len(new) - j)), new)

    def _permute(self, tx: _T, perm, n) -> _T | None:
        free_old = [d for d in range(len(tx.shape)) if d not in tx.sdims]
        free_new = [p for p in perm if p not in tx.sdims]
        if free_old != free_new:
            return None
        new_sdims = [k for k, p in enumerate(perm) if p in tx.sdims]
        order = [tx.sdims.index(perm[k]) for k in new_sdims]
        return _T(tx.root, np.transpose(tx.idx, order), tuple(new_sdims), tuple(tx.shape[p] for p in perm))

    def _pad(self, n, tx: _T) -> _T | None:
        mode, value = _arg(n, 2, "mode", "constant"), _arg(n, 3, "value", None)
        fill = (ZERO if value is None else _scalar_fact(value)) if mode == "constant" else None
        widths = _pad_widths(n, len(tx.shape))
        if fill is None or widths is None:
            return None
        if any(w != (0, 0) for d, w in enumerate(widths) if d not in tx.sdims) or any(v < 0 for w in widths for v in w):
            return None
        f = self.facts(tx)
        out = _filled(tuple(s + a + b for s, (a, b) in zip(f.shape, (widths[d] for d in tx.sdims))), fill)
        inner = tuple(slice(a, a + s) for s, (a, _) in zip(f.shape, (widths[d] for d in tx.sdims)))
        out[inner] = f
        return self._new(n, out, tx.sdims)

    def _cat(self, n) -> _T | None:
        """A cat along a scan dim of tracked tensors and of fills (zeros, ones) shaped like them."""
        parts, d = n.args[0], _arg(n, 1, "dim", 0)
        if not parts or not all(isinstance(p, fx.Node) and (p in self.t or _const_fill(p)) for p in parts):
            return None
        ts = [self.t[p] for p in parts if p in self.t]
        if not ts:
            return None
        nd, like = len(ts[0].shape), ts[0]
        d %= nd
        if d not in like.sdims or any(t.sdims != like.sdims or t.free != like.free for t in ts):
            return None
        ax = like.sdims.index(d)
        facts = []
        for p in parts:
            if p in self.t:
                facts.append(self.facts(self.t[p]))
                continue
            sh = tuple(shape(p))
            if len(sh) != nd or any(sh[k] != like.shape[k] for k in range(nd) if k != d):
                return None
            dims = list(like.idx.shape)
            dims[ax] = sh[d]
            facts.append(_filled(tuple(dims), _const_fill(p)))
        return self._new(n, np.concatenate(facts, axis=ax), like.sdims)

    def _stack(self, n) -> _T | None:
        """A stack of tracked tensors alike: the new dim is a scan dim too (stacked next to the
        scan dim and flattened into it, two tensors interleave: a JAX-style odd-even scan's
        `_interleave`)."""
        parts, k = n.args[0], _arg(n, 1, "dim", 0)
        if not parts or not all(isinstance(p, fx.Node) and p in self.t for p in parts):
            return None
        ts = [self.t[p] for p in parts]
        like = ts[0]
        if any(t.sdims != like.sdims or t.shape != like.shape for t in ts) or list(like.sdims) != sorted(like.sdims):
            return None
        k %= len(like.shape) + 1
        sdims = sorted([d + (d >= k) for d in like.sdims] + [k])
        return self._new(n, np.stack([self.facts(t) for t in ts], axis=sdims.index(k)), tuple(sdims))

    def _roll(self, n, tx: _T) -> _T | None:
        """``torch.roll`` by a whole number of steps along one scan dim: the facts rolled."""
        sh, d = _roll_args(n)
        d %= len(tx.shape)
        if d not in tx.sdims:
            return None
        return self._new(n, np.roll(self.facts(tx), sh, axis=tx.sdims.index(d)), tx.sdims)

    # the outcome

    def results(self, free=frozenset()):
        found, why = {}, []
        for n, t in self.t.items():
            if n in self.leaves:
                continue
            ext = [u for u in n.users if u not in self.t and u not in self.machinery]
            if not ext or len(t.sdims) != 1:
                continue
            f = self.facts(t)
            if f.size < 2:
                continue
            first = f[0]
            if first[0] != "leaf" or first[1] not in self.leaves:
                continue
            b = first[1]
            a = next((e[1] for e in f[1:2] if e[0] == "scan"), None)
            if a is None or a not in self.leaves or len(f) != shape(b)[self.leaves[b]] \
                    or any(e != ("scan", a, b, 0, k) for k, e in enumerate(f) if k):
                continue
            d = self.leaves[b]
            if a in self.writes or b in self.writes or _changed_in_place(a, mutated) \
                    or _changed_in_place(b, mutated):     # a leaf (or what it views) written in place
                continue
            sa = tuple(shape(a))
            if self.leaves[a] != d or t.sdims != (d,) or t.shape != tuple(shape(b)) or len(sa) != len(t.shape) \
                    or sa[d] != t.shape[d] or any(u not in (o, 1) for u, o in zip(sa, t.shape)):
                continue
            last = self.writes.get(t.root)
            if last is not None and any(self.pos[u] < self.pos[last] for u in ext):
                why.append((n.name, "a hand-written parallel scan's states are read before its last write"))
                continue
            found.setdefault((a, b), []).append(n)
        out = []
        for (a, b), nodes in found.items():
            own = self._own(a, b)
            # views of a leaf read elsewhere too stay (the scan's writes never reach a leaf)
            own -= {m for m in own if m in self.t and self.t[m].root in self.leaves and m not in self.machinery
                    and any(u not in own and u not in free for u in m.users)}
            bad = [m for m in own if m not in nodes and any(u not in own and u not in free for u in m.users)]
            if bad:
                why.append((bad[0].name, "a hand-written parallel scan's intermediate values are read elsewhere "
                            f"({bad[0].name}): it runs as written"))
                continue
            out.append(WrittenScan(a, b, self.leaves[a], nodes, sorted(own, key=self.pos.__getitem__)))
        return out, why

    def _own(self, a, b) -> set:
        """The nodes made from a and b's tracked values (their storages' views and writes)."""
        roots, own = set(), set()
        for n, t in self.t.items():
            if n not in self.leaves and self._derives(n, (a, b)):
                own.add(n)
                roots.add(t.root)
        own |= {m for m in self.machinery if self.t.get(m.args[0]) is not None and self.t[m.args[0]].root in roots}
        # fills made after a tracked tensor (``h.new_zeros(...)``: its dtype and device only) for
        # the scan's own cats
        own |= {u for m in own for u in m.users if _const_fill(u) and u.users and all(w in own for w in u.users)}
        return own

    def _derives(self, n, leaves) -> bool:
        seen, todo = set(), [n]
        while todo:
            m = todo.pop()
            if m in leaves:
                return True
            if m in seen or m not in self.t:
                continue
            seen.add(m)
            todo.extend(m.all_input_nodes)
        return False


# -- the same scan inside an autograd.Function ---------------------------------------------------

CHECK_BYTES = 1 << 32       # on a CPU, the backward's check holds at most about this much


@dataclasses.dataclass(frozen=True)
class FunctionScan:
    decays: fx.Node            # the outer arguments that are a and b
    inputs: fx.Node
    dim: int
    outputs: list              # the outer getitems of the function's output


def function_scan(gm: fx.GraphModule, hop: fx.Node):
    """An autograd.Function (Dynamo's ``autograd_function_apply``) whose forward is a written
    scan of two of its arguments and nothing more, saving only those and the states, and whose
    backward gives that scan's exact gradients on a random evaluation at the graph's sizes:
    a FunctionScan; a reason (str) it is not taken; None where its forward holds no scan. (The
    region replacing it has its own backward: the function's is checked, then not used.)"""
    fwd, bwd = (getattr(gm, x.target, None) if isinstance(x, fx.Node) and x.op == "get_attr" else None
                for x in hop.args[:2])
    if not isinstance(fwd, fx.GraphModule) or not isinstance(bwd, fx.GraphModule):
        return None
    ret = next(n for n in fwd.graph.nodes if n.op == "output")
    scans, _ = find_written_scans(fwd.graph, free={ret})
    if not scans:
        return None
    what = "an autograd.Function's forward is a written scan, but "
    if len(scans) > 1:
        return what + "it holds more than one"
    s = scans[0]
    phs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    args = list(hop.args[2:])
    if len(args) != len(phs) or set(phs) != {s.decays, s.inputs}:
        return what + "its arguments are not the scan's two operands"
    out = ret.args[0]
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], (tuple, list))):
        return what + "its outputs are not laid out as Dynamo lays them out"
    outs = out[0]      # (torch 2.11 lists the forward's intermediates after its output; none read outside)
    if not outs or outs[0] not in s.outputs:
        return what + "its output is not the states"
    own = set(s.erase) | set(s.outputs) | set(phs)
    extra = [n for n in fwd.graph.nodes if n.op != "output" and n not in own
             and not (n.op == "call_function" and n.target is torch._C._set_grad_enabled)]
    if extra:
        return what + f"its forward also computes {extra[0].name}"
    users = list(hop.users)
    if not users or any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] != 0 for u in users):
        return what + "its outputs are used other than as the states"
    why = _check_backward(fwd, bwd, s, phs)
    if why:
        return what + why
    return FunctionScan(args[phs.index(s.decays)], args[phs.index(s.inputs)], s.dim, users)


def _check_backward(fwd: fx.GraphModule, bwd: fx.GraphModule, s: WrittenScan, phs: list) -> str | None:
    """Why the function's backward is not the scan's gradient (None: it is). Checked on a random
    evaluation at the graph's sizes, on the device and in the dtype of its operands (about one
    forward and backward of the function, at compile time): its forward must give the scan's
    states, and its backward, on what the forward saved, the scan's gradients, against a scan run
    step by step in float32 (float64 for float64 operands)."""
    ex = s.inputs.meta.get("example_value")
    if not isinstance(ex, torch.Tensor):
        return "its operands' sizes are not known"
    d, dev, dt = s.dim, ex.device, ex.dtype
    ref = torch.float64 if dt == torch.float64 else torch.float32
    need = ex.numel() * 4 * 16
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
        if need > free:
            return f"checking its backward needs {need / 2**30:.1f} GiB, more than the GPU has free"
    elif need > CHECK_BYTES:
        return f"checking its backward needs {need / 2**30:.1f} GiB (more than {CHECK_BYTES / 2**30:.0f} on a CPU)"
    gen = torch.Generator(device=dev).manual_seed(0)
    ea = s.decays.meta.get("example_value")
    if not isinstance(ea, torch.Tensor) or ea.dtype != dt:
        return "its operands' sizes or dtypes are not known alike"
    a = (torch.rand(ea.shape, generator=gen, device=dev) * 0.5 + 0.5).to(dt)
    b, g = (torch.randn(ex.shape, generator=gen, device=dev).to(dt) for _ in range(2))
    try:
        with torch.no_grad():
            vals = {s.decays: a, s.inputs: b}
            outs, saved = fwd(*[vals[p] for p in phs])
            # a gradient for each forward output (torch 2.11 lists its intermediates too, as
            # placeholders its backward does not read), then what the forward saved
            if sum(n.op == "placeholder" for n in bwd.graph.nodes) != len(outs) + len(saved):
                return "its backward takes other inputs than its outputs' gradients and what it saved"
            got = bwd(g, *[None] * (len(outs) - 1), *saved)
    except Exception as e:      # noqa: BLE001 - its own error, reported
        return f"running it on a check failed: {type(e).__name__}: {e}"
    a, b, g = (t.to(ref) for t in (a, b, g))
    L = b.shape[d]
    h, dx = torch.empty_like(b), torch.empty_like(b)
    acc = torch.zeros_like(b.select(d, 0))
    for t in range(L):
        acc = a.select(d, t) * acc + b.select(d, t)
        h.select(d, t).copy_(acc)
    acc = torch.zeros_like(b.select(d, 0))
    for t in reversed(range(L)):
        acc = g.select(d, t) + (a.select(d, t + 1) * acc if t + 1 < L else 0)
        dx.select(d, t).copy_(acc)
    prev = torch.cat([torch.zeros_like(h.narrow(d, 0, 1)), h.narrow(d, 0, L - 1)], d)
    da = dx * prev
    wide = [k for k, (u, v) in enumerate(zip(a.shape, da.shape)) if u == 1 and v != 1]
    want = {s.decays: da.sum(wide, keepdim=True) if wide else da, s.inputs: dx}
    tol = 1e-8 if dt == torch.float64 else 1e-4 if dt == torch.float32 else 3e-2
    if _rel(outs[0], h) > tol:
        return "its forward's states differ from the scan's on a check"
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    if len(got) != len(phs):
        return "its backward returns another number of gradients than it has arguments"
    for ph, v in zip(phs, got):
        w = tuple(want[ph].shape)
        if isinstance(v, torch.Tensor) and tuple(v.shape) != w and len(v.shape) == len(w) \
                and all(u in (x, 1) for u, x in zip(w, v.shape)):
            v = v.sum_to_size(w)                   # as autograd takes a gradient of the broadcast shape
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != w:
            return f"its backward's gradient of {ph.name} is not a tensor of its shape"
        err = _rel(v, want[ph])
        if not err <= tol:
            return (f"its backward's gradient of {ph.name} is not the scan's (relative error {err:.2g} on a "
                    "random check): the function runs as written, its own backward kept")
    return None


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


# -- the log-space scan (Heinsen's) --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ClosedForm:
    decays: fx.Node            # a, or log a where `logs`
    inputs: fx.Node            # b, or log b
    dim: int
    output: fx.Node            # the node holding the states
    logs: bool                 # decays and inputs given as their logs


def _scan_op(n, names) -> tuple | None:
    """(input, dim) of a cumsum/logcumsumexp node named in `names`, else None."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return None
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name not in names or not n.args or not isinstance(n.args[0], fx.Node) or set(n.kwargs) - {"dim"}:
        return None
    d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return (n.args[0], d) if isinstance(d, int) else None


def find_closed_forms(graph: fx.Graph) -> list[ClosedForm]:
    """Closed forms of the scan h_t = a_t h_(t-1) + b_t from zero, each an identity, matched as
    written:
    - ``exp(A + logcumsumexp(log_b - A, d))`` with ``A = cumsum(log_a, d)`` (exp(A_t - A_s) is
      the product of the decays s+1..t), as minGRU's and Heinsen's log-space scan writes it;
    - ``P * cumsum(b / P, d)`` with ``P = cumprod(a, d)`` (either product order), as simple
      linear-RNN listings write it; the loop needs no division (nor P's underflow)."""
    out = []
    for n in graph.nodes:
        s = _log_form(n) or _product_form(n)
        if s is not None:
            out.append(s)
    return out


def _ew(n, op: str):
    """n's canonical form if it is the elementwise `op` (no parameters), else None."""
    c = canonical(n) if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") else None
    return c if c is not None and c.kind == "ew" and c.op == op and not c.params else None


def _form(n, outer: str, first: str, second: str, inner: str, logs: bool) -> ClosedForm | None:
    """n = outer(X, second(inner(y, X))) with X = first(x) along one dim, the operands of n's
    shape: (x, y, that dim) as a ClosedForm."""
    c = _ew(n, outer)
    if c is None or len(c.tensor_args()) != 2:
        return None
    for X, S in (c.args, c.args[::-1]):
        f, g = _scan_op(X, (first,)), _scan_op(S, (second,))
        q = _ew(g[0], inner) if f is not None and g is not None else None
        if q is None or q.args[1] is not X or not isinstance(q.args[0], fx.Node):
            continue
        nd, sh = len(shape(X)), tuple(shape(n))
        if g[1] % nd == f[1] % nd and _same_sizes(shape(q.args[0]), shape(X)) and _same_sizes(shape(X), sh):
            return ClosedForm(f[0], q.args[0], f[1] % nd, n, logs)
    return None


def _same_sizes(x, y) -> bool:
    """Equal shapes, a symbolic size (Dynamo recompiled for another length or batch) equal only
    to the same symbol: no guard is asked for."""
    def key(v):
        return v if type(v) is int else str(getattr(getattr(v, "node", None), "expr", v))
    return len(x) == len(y) and all(key(a) == key(b) for a, b in zip(x, y))


def _log_form(n) -> ClosedForm | None:
    c = _ew(n, "exp")
    s = _form(c.args[0], "add", "cumsum", "logcumsumexp", "sub", True) if c is not None else None
    return None if s is None else dataclasses.replace(s, output=n)      # the states: exp of the logs


def _product_form(n) -> ClosedForm | None:
    return _form(n, "mul", "cumprod", "cumsum", "div", False)
