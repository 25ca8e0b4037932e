"""Find the per-step reads of a Dynamo graph, in every spelling people use.

Step t is read as ``x[:, t]``, ``x[:, t, :, None]``, ``x.select(1, t)``, ``x.unbind(1)[t]``
(what ``for x_t in x.unbind(1)`` and ``zip(...)`` trace to), ``x[:, t:t+1]``,
``x.narrow(1, t, 1)`` or ``x.split(1, dim=1)[t]``; a loop over chunks reads
``x[:, t*w:(t+1)*w]`` (`ReadOf.width`). Each is described as a `ReadOf`: the
tensor, the time dim, the step index, and the index still applied to ``x.select(dim, t)``
afterwards (``rest``: extra ``None``s, unit slices, constant indices). The graph is not
changed, so this is one cheap pass over the nodes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator

import torch
import torch.fx as fx

from .ops import is_tensor, mutated, shape, value


@dataclasses.dataclass(frozen=True)
class ReadOf:
    source: fx.Node
    dim: int
    index: int
    rest: tuple | None = None     # getitem index applied after select(dim, index); None: nothing
    width: int = 1                # > 1: x[:, i*w:(i+1)*w], step i of x.unflatten(dim, (-1, w))


def _fake_mode(graph: fx.Graph):
    for n in graph.nodes:
        mode = getattr(value(n), "fake_mode", None)
        if mode is not None:
            return mode
    return None


class _Builder:
    """Inserts nodes before `anchor` (None: at the graph's insert point, its end unless moved),
    filling in example values with the graph's fake mode."""

    def __init__(self, graph: fx.Graph, mode):
        self.graph, self.mode = graph, mode

    def call(self, anchor: fx.Node | None, target, args, kwargs=None) -> fx.Node:
        if anchor is None:
            n = self.graph.call_function(target, tuple(args), kwargs or {})
        else:
            with self.graph.inserting_before(anchor):
                n = self.graph.call_function(target, tuple(args), kwargs or {})
        return self.example(n)

    def example(self, n: fx.Node) -> fx.Node:
        """Fill in n's example value (a call_function or call_method node) from its arguments'."""
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: value(a))
        fn = n.target if n.op == "call_function" else getattr(args[0], n.target)
        if n.op != "call_function":
            args = args[1:]
        with self.mode if self.mode is not None else contextlib.nullcontext():
            n.meta["example_value"] = fn(*args, **kwargs)
        return n


@dataclasses.dataclass
class StackedList:
    """Graph inputs that are the elements 0..L-1 of one Python list argument, stacked along a
    new dim 0 (`stack_list_inputs`); ``reads[k]`` is ``stack.select(0, k)``, which replaced
    element k in every use."""
    name: str
    stack: fx.Node
    elements: list
    reads: list


def stack_list_inputs(gm: fx.GraphModule) -> list[StackedList]:
    """A function called with a list of per-step tensors (``forward(self, xs: list[Tensor])``)
    gets each element as a graph input of its own: no tensor is read at consecutive indices, so
    no loop can be found. Elements 0..L-1 (L >= 2) of one list argument with one shape, dtype
    and device (Dynamo's sources say which inputs they are) are stacked into one tensor, read at
    index k where element k was read. `unstack` undoes it."""
    groups: dict = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder" or not is_tensor(value(n)):
            continue
        src = getattr(n.meta.get("grapharg"), "source", None)
        if type(src).__name__ == "GetItemSource" and isinstance(getattr(src, "index", None), int) \
                and not getattr(src, "index_is_slice", False):
            name = getattr(src.base, "name", None)
            name = name() if callable(name) else name if isinstance(name, str) else repr(src.base)
            groups.setdefault(name, {})[src.index] = n
    out = []
    mode = _fake_mode(gm.graph)
    b = _Builder(gm.graph, mode)
    last_ph = [n for n in gm.graph.nodes if n.op == "placeholder"][-1:] or [None]
    inside = transformed(gm.graph)
    for base, by_index in groups.items():
        els = []        # elements 0, 1, ... while they are there and alike
        while by_index.get(len(els)) is not None and (not els or _alike(els[0], by_index[len(els)])):
            els.append(by_index[len(els)])
        if len(els) < 2 or any(u in inside for e in els for u in e.users):
            continue        # (read inside torch.vmap: batched there, no loop is searched for)
        anchor = last_ph[0].next
        st = b.call(anchor, torch.stack, (els, 0))
        reads = []
        for k, e in enumerate(els):
            users = [u for u in e.users if u is not st]
            r = b.call(anchor, torch.select, (st, 0, k))
            for u in users:
                u.replace_input_with(e, r)
            reads.append(r)
        out.append(StackedList(base, st, els, reads))
    if out:
        gm.recompile()
    return out


def _alike(a: fx.Node, b: fx.Node) -> bool:
    va, vb = value(a), value(b)
    return (tuple(va.shape), va.dtype, va.device) == (tuple(vb.shape), vb.dtype, vb.device)


def unstack(gm: fx.GraphModule, st: StackedList) -> None:
    """Undo `stack_list_inputs` for one list: each read of the stack becomes its element again."""
    for e, r in zip(st.elements, st.reads):
        r.replace_all_uses_with(e)
        gm.graph.erase_node(r)
    gm.graph.erase_node(st.stack)
    gm.recompile()


def erase_unused(gm: fx.GraphModule, nodes) -> None:
    """Erase outer nodes a pass made for a loop that then runs as written (or is not kept)."""
    for n in reversed(nodes):      # (a split loop's pieces share the loop's nodes: erased once)
        if n.graph is gm.graph and not n.users and not getattr(n, "_erased", False):
            gm.graph.erase_node(n)
    if nodes:
        gm.recompile()


def _expand_index(idx, ndim: int) -> list | None:
    idx = list(idx) if isinstance(idx, tuple) else [idx]
    if sum(i is Ellipsis for i in idx) > 1:
        return None
    consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx[k:k + 1] = [slice(None)] * (ndim - consumed)
    else:
        idx += [slice(None)] * (ndim - consumed)
    return idx


def _is_int(i) -> bool:
    return isinstance(i, int) and not isinstance(i, bool)


def _unit_slice(s) -> int | None:
    if isinstance(s, slice) and _is_int(s.start) and _is_int(s.stop) and s.step in (None, 1) \
            and s.stop == s.start + 1 and s.start >= 0:
        return s.start
    return None


def _chunk_slice(s):
    """(i, w) for a slice i*w : (i+1)*w with w > 1 (one chunk of a loop over chunks), or None."""
    if isinstance(s, slice) and _is_int(s.start) and _is_int(s.stop) and s.step in (None, 1):
        w = s.stop - s.start
        if w > 1 and s.start >= 0 and s.start % w == 0:
            return s.start // w, w
    return None


def _index(i: int, size) -> int | None:
    """i counted from the front (negative: from the back of a dim of `size`); None where that
    needs a size Dynamo left symbolic."""
    if i >= 0:
        return i
    size = _concrete(size)
    return None if size is None else i % size


def _concrete(size) -> int | None:
    """A size as an int, also a SymInt Dynamo specialized (a loop's length); None while symbolic."""
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return size


def _nd(x) -> int:
    return len(shape(x))


def reads_of(node: fx.Node) -> list[ReadOf]:
    """Every way `node` can be seen as ``source.select(dim, t)`` followed by `rest`."""
    if node.op == "call_method" and node.target == "select" or (
            node.op == "call_function" and node.target is torch.select):
        x, d, i = (list(node.args) + [None] * 3)[:3]
        if is_tensor(x) and _is_int(d) and _is_int(i):
            i = _index(i, shape(x)[d])
            return [ReadOf(x, d % _nd(x), i)] if i is not None else []
        return []
    if node.op == "call_method" and node.target == "narrow" or (
            node.op == "call_function" and node.target is torch.narrow):
        x, d, start, length = (list(node.args) + [None] * 4)[:4]
        if is_tensor(x) and _is_int(d) and _is_int(start) and length == 1:
            d %= _nd(x)
            return [ReadOf(x, d, start, tuple([slice(None)] * d + [None]))]
        return []
    if node.op != "call_function" or node.target is not operator.getitem:
        return []
    src, idx = node.args
    if not isinstance(src, fx.Node):
        return []
    if _is_int(idx) and src.op in ("call_method", "call_function"):
        name = src.target if isinstance(src.target, str) else getattr(src.target, "__name__", "")
        x = src.args[0] if src.args else None
        if name == "unbind" and is_tensor(x):
            d = (src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)) % _nd(x)
            return [ReadOf(x, d, idx)]
        if name in ("split", "chunk") and is_tensor(x) and shape(node):
            d = (src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)) % _nd(x)
            if shape(node)[d] == 1 and shape(node)[:d] == shape(x)[:d]:
                return [ReadOf(x, d, idx, tuple([slice(None)] * d + [None]))]
        # else an element of a tensor (`for x_t in x.transpose(0, 1)`) or of some other tuple
    if not is_tensor(src) or not is_tensor(node):
        return []
    full = _expand_index(idx, _nd(src))
    if full is None or any(isinstance(i, (fx.Node, torch.Tensor, list, bool)) for i in full):
        return []
    out = []
    d = 0
    for k, i in enumerate(full):
        if i is None:
            continue
        t = i if _is_int(i) else _unit_slice(i)
        w = _chunk_slice(i)
        if t is None and w is not None and shape(src)[d] >= max(2, w[0] + 1) * w[1]:   # whole chunks
            rest = tuple(full[:k] + [slice(None)] + full[k + 1:])
            trivial = all(isinstance(r, slice) and r == slice(None) for r in rest)
            out.append(ReadOf(src, d, w[0], None if trivial else rest, w[1]))
        if t is not None:
            rest = full[:k] + ([None] if not _is_int(i) else []) + full[k + 1:]
            rest = tuple(rest)
            trivial = all(isinstance(r, slice) and r == slice(None) for r in rest)
            t = _index(t, shape(src)[d])
            if t is not None:
                out.append(ReadOf(src, d, t, None if trivial else rest))
        d += 1
    return out


def find_reads(graph: fx.Graph) -> dict[fx.Node, list[ReadOf]]:
    out = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method"):
            r = reads_of(n)
            if r:
                out[n] = r
    return out


def transformed(graph: fx.Graph) -> set[fx.Node]:
    """Nodes inside a torch.func transform's level (vmap, grad, jvp: between Dynamo's
    ``_<transform>_increment_nesting`` and its ``_decrement_nesting``). Their tensors are batched
    or wrapped, which a region's op has no rule for."""
    inside, depth = set(), 0
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name.endswith("_increment_nesting"):
            depth += 1
        elif name.endswith("_decrement_nesting"):
            depth = max(0, depth - 1)
        elif depth:
            inside.add(n)
    return inside

# -- in-place state updates ------------------------------------------------------------------------

_INPLACE = {"add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "copy_", "exp_", "neg_",
            "tanh_", "sigmoid_", "relu_", "clamp_", "abs_", "sqrt_", "pow_", "log_", "sin_", "cos_"}
_FRESH = {"zeros", "zeros_like", "empty", "empty_like", "ones", "ones_like", "full", "full_like",
          "new_zeros", "new_empty", "new_ones", "new_full", "clone"}


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")


_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv}


def _inplace_self(n: fx.Node):
    """The tensor `n` updates in place (``h.mul_(a)``, ``h.add_(b)``, ``h.copy_(v)``,
    ``h += x``), or None."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.op == "call_method" and n.target in _INPLACE:
        return n.args[0]
    if n.op == "call_function" and n.target in _AUGMENTED and is_tensor(value(n.args[0])):
        return n.args[0]
    if n.op == "call_function" and n.target is operator.setitem and len(n.args) == 3 \
            and is_tensor(value(n.args[0])) and _scatter_of(n) is not None:
        return n.args[0]
    return None


def one_dim_index(idx, nd: int, ints: bool = True):
    """(d, entry) for an index of an nd-dim tensor that is one int (with `ints`) or one slice at
    dim d, every other dim whole (``x[..., 1:]``, ``x[:, :, -1]``); None otherwise."""
    full = _expand_index(idx, nd)
    kinds = (int, slice) if ints else (slice,)
    if full is None or len(full) != nd or any(not isinstance(i, kinds) for i in full):
        return None
    cut = [k for k, i in enumerate(full) if i != slice(None)]
    if len(cut) != 1:
        return None
    i = full[cut[0]]
    if isinstance(i, slice) and not all(v is None or _is_int(v) for v in (i.start, i.stop, i.step)):
        return None            # a bound computed in the graph (a symbolic size)
    return None if isinstance(i, bool) else (cut[0], i)


def _scatter_of(n: fx.Node):
    """``x[idx] = v`` with idx one int or one unit-step slice along a dim (every other dim whole)
    as (select_scatter or slice_scatter, its extra arguments, the shape v must have); None
    otherwise."""
    x = value(n.args[0])
    got = one_dim_index(n.args[1], x.dim())
    if got is None or not isinstance(x.shape[got[0]], int):
        return None
    (d, i), size = got, x.shape[got[0]]
    if isinstance(i, int):
        if not -size <= i < size:
            return None
        return torch.select_scatter, (d, i % size), tuple(x.shape[:d]) + tuple(x.shape[d + 1:])
    start, stop, step = i.indices(size)
    if step != 1 or stop <= start:
        return None
    return torch.slice_scatter, (d, start, stop), tuple(x.shape[:d]) + (stop - start,) + tuple(x.shape[d + 1:])


def _fresh(r: fx.Node) -> bool:
    """Whether `r` is memory of its own: an allocation, or the result of an op that always
    makes a new tensor (not a view, not an op that may return its input, not an input)."""
    if r.op not in ("call_function", "call_method"):
        return False
    name = _name(r)
    return name in _FRESH or not (_maybe_view(r) or name in _MAY_ALIAS or r.target in _AUGMENTED)


_COMPOSITE = {"lerp", "addmm", "baddbmm", "addbmm", "addmv", "addr", "einsum", "addcdiv"}
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_SHAPED_AS = {"expand_as": torch.broadcast_to, "view_as": torch.reshape, "reshape_as": torch.reshape}


def decompose_composites(graph: fx.Graph) -> int:
    """Composite ops of a step body written as the plain ops they are, so that the passes after
    re-rolling see the linear ops they know: ``lerp(h, x, w)`` is ``h + w * (x - h)``;
    ``addcdiv(x, t1, t2)`` is ``x + value * t1 / t2``; ``addmm(b, h, W)`` is ``beta * b + alpha * (h @ W)``, and ``baddbmm``, ``addbmm`` (summed
    over the batch), ``addmv`` and ``addr`` (an outer product) alike; ``F.linear(h, W, b)`` (an
    ``nn.Linear`` applied to the state) is ``h @ W.T + b``; a matrix times a vector through a
    size-1 dim (``(A @ h[..., None])[..., 0]``, ``torch.bmm(A_t, h.unsqueeze(-1)).squeeze(-1)``),
    through transposes (``(A @ h.T).T``) or by ``torch.mv`` is an einsum; an einsum that sums over
    nothing (``"bdn,bdn->bdn"``, ``"bd,bn->bdn"``) is the product of its operands' views; and
    ``x.expand_as(h)`` (``view_as``, ``reshape_as``) takes h's static shape, not h, so that the
    state's shape read there is no use of the state; ``torch.linalg.solve(A, B)`` is
    ``inv(A) @ B`` (`_solve_as_matmul`). Only the loop's own body
    is rewritten: a loop that is then declined runs the captured graph as it was. Returns the
    nodes rewritten."""
    b = _Builder(graph, _fake_mode(graph))
    count = 0
    for n in list(graph.nodes):
        if n.op == "call_method" and n.target in _SHAPED_AS and len(n.args) == 2:
            size = shape(n.args[1]) if isinstance(n.args[1], fx.Node) else None
            if size is not None and all(isinstance(k, int) for k in size):
                n.replace_all_uses_with(b.call(n, _SHAPED_AS[n.target], (n.args[0], tuple(size))))
                graph.erase_node(n)
                count += 1
            continue
        r = _matvec_as_einsum(b, n)
        if r is not None:          # (W @ h[..., None])[..., 0], (h[..., None, :] @ W).squeeze(-2), mv
            n.replace_all_uses_with(r)
            _erase_dead(graph, n)
            count += 1
            continue
        if n.op == "call_function" and n.target in _AS_MATMUL:
            r = _AS_MATMUL[n.target](b, n)
            if r is not None:
                n.replace_all_uses_with(r)
                graph.erase_node(n)
                count += 1
            continue
        if n.op not in ("call_function", "call_method") or _name(n) not in _COMPOSITE or "out" in n.kwargs:
            continue
        if n.op == "call_function" and getattr(torch, _name(n), None) is not n.target:
            continue
        op, args, kw = _name(n), list(n.args), dict(n.kwargs)
        if op == "einsum":
            r = _einsum_as_product(b, n)
            if r is None:
                r = _einsum_pairwise(b, n)
            if r is None:
                continue
        elif op == "addcdiv":                 # x + value * t1 / t2
            if len(args) < 3 or set(kw) - {"value"}:
                continue
            q = b.call(n, torch.div, (args[1], args[2]))
            r = b.call(n, torch.add, (args[0], q if kw.get("value", 1) == 1 else b.call(n, torch.mul, (q, kw["value"]))))
        elif op == "lerp":
            if len(args) < 3 and "weight" not in kw:
                continue
            start, end, weight = args[0], args[1] if len(args) > 1 else kw["end"], \
                args[2] if len(args) > 2 else kw["weight"]
            d = b.call(n, torch.sub, (end, start))
            r = b.call(n, torch.add, (start, b.call(n, torch.mul, (weight, d))))
        else:
            if len(args) < 3:
                continue
            x, m1, m2 = args[:3]
            beta, alpha = kw.get("beta", 1), kw.get("alpha", 1)
            if op == "addr":
                u = b.call(n, torch.unsqueeze, (m1, -1))
                prod = b.call(n, torch.mul, (u, b.call(n, torch.unsqueeze, (m2, 0))))
            else:
                prod = b.call(n, torch.matmul, (m1, m2))
                if op == "addbmm":
                    prod = b.call(n, torch.sum, (prod, 0))
            if alpha != 1:
                prod = b.call(n, torch.mul, (prod, alpha))
            if beta == 0:            # torch ignores the input then (nan and inf included)
                r = prod
            else:
                r = b.call(n, torch.add, (x if beta == 1 else b.call(n, torch.mul, (x, beta)), prod))
        n.replace_all_uses_with(r)
        graph.erase_node(n)
        count += 1
    return count


_MATMULS = (torch.matmul, operator.matmul, torch.bmm)


def _is_matmul(m: fx.Node) -> bool:
    """``a @ b``, ``torch.matmul``/``bmm``, or their methods (``a.matmul(b)``, ``a.bmm(b)``)."""
    return (m.op == "call_function" and m.target in _MATMULS) or \
        (m.op == "call_method" and m.target in ("matmul", "__matmul__", "bmm"))


def _unit_dim(n: fx.Node, pos: int, added: bool) -> bool:
    """Whether view n is its input with a size-1 dim inserted at `pos` (-1 or -2; `added`) or
    taken out there (not `added`), nothing else."""
    from .ops import canonical
    x = n.args[0] if n.args else None
    if not isinstance(x, fx.Node) or not is_tensor(x) or not is_tensor(n):
        return False
    c = canonical(n)
    if c is None or c.kind != "view" or c.params.get("consts"):
        return False
    big, small = (list(shape(n)), list(shape(x))) if added else (list(shape(x)), list(shape(n)))
    if len(big) != len(small) + 1 or big[pos] != 1:
        return False
    del big[pos]
    return big == small


def _is_transpose(n) -> bool:
    """Whether n is a view swapping the two dims of a 2-d input (``h.T``, ``h.t()``, ``.mT``)."""
    from .ops import view_map
    if not isinstance(n, fx.Node) or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    x = n.args[0]
    if not is_tensor(x) or len(shape(x)) != 2 or len(shape(n) or ()) != 2:
        return False
    info = view_map(n)
    return info is not None and tuple(info[0]) == (1, 0) and not info[1]


def _matvec_as_einsum(b: _Builder, n: fx.Node) -> fx.Node | None:
    """A matrix times a vector written through a size-1 dim, ``(W @ v.unsqueeze(-1)).squeeze(-1)``
    (bmm too) or ``(v.unsqueeze(-2) @ W).squeeze(-2)``, through transposes of a (b, n) batch of
    them, ``(W @ v.T).T``, or ``torch.mv(W, v)``: the einsum it is,
    so that the state's matrix product is one contraction of the state's own shape. None for
    anything else, or batch dims that broadcast a size 1 against another size."""
    if n.op == "call_function" and n.target is torch.mv and len(n.args) == 2 and not n.kwargs:
        w, v = n.args
        return b.call(n, torch.einsum, ("ij,j->i", w, v)) if isinstance(w, fx.Node) and isinstance(v, fx.Node) else None
    if n.op not in ("call_function", "call_method") or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    m = n.args[0]
    if not _is_matmul(m) or len(m.args) != 2 or m.kwargs or len(m.users) != 1:
        return None
    if _is_transpose(n) and all(isinstance(a, fx.Node) for a in m.args):    # (W @ v.T).T
        w, u = m.args
        if _is_transpose(u) and len(shape(w)) == 2:
            return b.call(n, torch.einsum, ("ik,bk->bi", w, u.args[0]))
    for pos in (-1, -2):
        if not _unit_dim(n, pos, added=False):
            continue
        w, u = m.args if pos == -1 else m.args[::-1]
        if not isinstance(u, fx.Node) or not isinstance(w, fx.Node) or not _unit_dim(u, pos, added=True):
            continue
        v, sw, sv = u.args[0], list(shape(w)), list(shape(u.args[0]))
        if len(sw) < 2 or not sv:
            continue
        bw, bv = sw[:-2], sv[:-1]
        nb = max(len(bw), len(bv))
        pw, pv = [None] * (nb - len(bw)) + bw, [None] * (nb - len(bv)) + bv
        if any(x is not None and y is not None and x != y for x, y in zip(pw, pv)):
            continue
        letters = "abcdefghpqrstuvw"[:nb]
        ew = "".join(ch for ch, x in zip(letters, pw) if x is not None)
        ev = "".join(ch for ch, x in zip(letters, pv) if x is not None)
        eq = f"{ew}ik,{ev}k->{letters}i" if pos == -1 else f"{ew}ki,{ev}k->{letters}i"
        return b.call(n, torch.einsum, (eq, w, v))
    return None


def _erase_dead(graph: fx.Graph, n: fx.Node) -> None:
    """Erase n and the inputs it leaves unused, while they are call nodes."""
    todo = [n]
    while todo:
        x = todo.pop()
        if x.users or x.op not in ("call_function", "call_method"):
            continue
        ins = list(x.all_input_nodes)
        graph.erase_node(x)
        todo.extend(ins)


def _linear_as_matmul(b: _Builder, n: fx.Node) -> fx.Node | None:
    """``linear(x, W, bias)`` as ``x @ W.T + bias`` (None for a weight that is not a matrix)."""
    names = ("input", "weight", "bias")
    args = dict(zip(names, n.args), **{k: v for k, v in n.kwargs.items() if k in names})
    x, w, bias = args.get("input"), args.get("weight"), args.get("bias")
    if not isinstance(w, fx.Node) or len(shape(w) or ()) != 2 or len(n.args) + len(n.kwargs) > 3:
        return None
    r = b.call(n, torch.matmul, (x, b.call(n, torch.transpose, (w, 0, 1))))
    return r if bias is None else b.call(n, torch.add, (r, bias))


def _solve_as_matmul(b: _Builder, n: fx.Node) -> fx.Node | None:
    """``torch.linalg.solve(A, B)`` as ``inv(A) @ B`` (``B @ inv(A)`` with ``left=False``; a batch
    of vectors B (one dim fewer than A) through a size-1 dim): linear in B, so that an implicit
    step ``h = solve(I - dt A, h + dt B x)`` is a matrix product of the state, the inverse made
    once before the region when A does not change. None for other arguments."""
    names = ("A", "B")
    args = dict(zip(names, n.args), **{k: v for k, v in n.kwargs.items() if k in names})
    left = n.kwargs.get("left", True)
    a, rhs = args.get("A"), args.get("B")
    if set(n.kwargs) - {"A", "B", "left"} or len(n.args) > 2 or not isinstance(a, fx.Node) \
            or not isinstance(rhs, fx.Node) or not isinstance(left, bool):
        return None
    na, nb = len(shape(a) or ()), len(shape(rhs) or ())
    if na < 2:
        return None
    inv = b.call(n, torch.linalg.inv, (a,))
    if not left:
        return b.call(n, torch.matmul, (rhs, inv)) if nb >= 2 else None
    if nb == na - 1:             # vectors: solve treats B as a batch of them
        col = b.call(n, torch.unsqueeze, (rhs, -1))
        sq = b.call(n, torch.squeeze, (b.call(n, torch.matmul, (inv, col)), -1))
        r = _matvec_as_einsum(b, sq)
        if r is None:
            return sq
        _erase_dead(sq.graph, sq)
        return r
    return b.call(n, torch.matmul, (inv, rhs))


_AS_MATMUL = {torch.linalg.solve: _solve_as_matmul, **{f: _linear_as_matmul for f in _LINEAR}}


def _einsum_as_product(b: _Builder, n: fx.Node) -> fx.Node | None:
    """An einsum of two or more operands that sums over no letter, as the product of each
    operand permuted to the output's order with its missing letters as size-1 dims."""
    from ssmc.ops import canonical
    c = canonical(n)
    if c is None or c.kind != "contract" or len(c.args) < 2:
        return None
    subs, out = c.params["subs"], c.params["out"]
    if len(set(out)) != len(out) or any(len(set(s)) != len(s) or set(s) - set(out) for s in subs):
        return None
    r = None
    for x, s in zip(c.args, subs):
        if not isinstance(x, fx.Node):
            return None
        order = sorted(range(len(s)), key=lambda i: out.index(s[i]))
        if order != list(range(len(s))):
            x = b.call(n, torch.permute, (x, order))
        if len(s) < len(out):
            x = b.call(n, operator.getitem, (x, tuple(slice(None) if ch in s else None for ch in out)))
        r = x if r is None else b.call(n, operator.mul, (r, x))
    return r


def _einsum_pairwise(b: _Builder, n: fx.Node) -> fx.Node | None:
    """An einsum of three or more operands that sums over some letter (RWKV-7's
    ``einsum("bhik,bhk,bhj->bhij", S, a, b)``, (S a) b^T) as two-operand einsums from the left,
    each keeping the letters a later operand or the output needs: the same sums, so each
    operand's role (the state, a vector, a matrix) is one the passes know."""
    from ssmc.ops import canonical
    c = canonical(n)
    if c is None or c.kind != "contract" or len(c.args) < 3 or not all(isinstance(x, fx.Node) for x in c.args):
        return None
    subs, out = list(c.params["subs"]), c.params["out"]
    cur, cs = c.args[0], subs[0]
    for i in range(1, len(subs)):
        later = set(out).union(*subs[i + 1:])
        keep = out if i == len(subs) - 1 else "".join(dict.fromkeys(ch for ch in cs + subs[i] if ch in later))
        e = b.call(n, torch.einsum, (f"{cs},{subs[i]}->{keep}", cur, c.args[i]))
        cur = _einsum_as_product(b, e)          # an outer product, (S a) b^T's last step
        if cur is None:
            cur = e
        else:
            b.graph.erase_node(e)
        cs = keep
    return cur


def forward_stored_values(gm: fx.GraphModule) -> int:
    """A read of a slot the graph wrote earlier (``y[:, t] = a[:, t] * y[:, t - 1] + x[:, t]``: a
    recurrence kept in its output buffer) is the value written, so that the step-to-step data
    flow is in the graph and the buffer is only the loop's output; the writes stay. Only where
    that cannot change a result: the buffer is a fresh allocation (or an input, checked at each
    call for memory shared with another input) whose uses are writes and reads
    at one int index along one dim (`one_dim_index`) and uses after its last write; the value
    written has the slot's shape and dtype; the read is used only by ops that neither view nor
    change it, all before the slot is written again. A slot read before any write, of a buffer
    made by ``zeros``, is ``new_zeros`` of the slot's shape, made with the buffer. Returns the
    reads forwarded."""
    g = gm.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    count = 0
    zeros: dict = {}
    phs = [n for n in nodes if n.op == "placeholder"]
    for buf in nodes:
        if not (_fresh(buf) or buf.op == "placeholder") or not is_tensor(buf) \
                or not any(u.target is operator.setitem for u in buf.users):
            continue
        bv = value(buf)
        slots, writes, reads = {}, [], []
        last_write = max(pos[u] for u in buf.users if u.target is operator.setitem)
        ok = True
        for u in sorted(buf.users, key=pos.get):
            is_write = u.op == "call_function" and u.target is operator.setitem and u.args[0] is buf
            is_read = u.op == "call_function" and u.target is operator.getitem and u.args[0] is buf
            if is_write or is_read:
                got = one_dim_index(u.args[1], bv.dim())
                if got is None or not isinstance(got[1], int) or not isinstance(bv.shape[got[0]], int):
                    ok = False
                    break
                slots[u] = (got[0], got[1] % bv.shape[got[0]])
                if is_read and _written_through(u, mutated):
                    ok = False         # a write through the read (`C[0][:, -1] = x`: it is a view)
                    break
                (writes if is_write else reads).append(u)
            elif pos[u] < last_write or _maybe_view(u) or mutated(u) is not None:
                ok = False
                break
        if not ok or len({d for d, _ in slots.values()}) != 1:
            continue
        for r in reads:
            before = [w for w in writes if pos[w] < pos[r] and slots[w] == slots[r]]
            after = [pos[w] for w in writes if pos[w] > pos[r] and slots[w] == slots[r]]
            if any(_maybe_view(u) or mutated(u) is not None or u.target is operator.setitem
                   or (after and pos[u] > min(after)) for u in r.users):
                continue       # the read is viewed, changed, or used after its slot is written again
            if not before:     # a slot never written: zeros where the buffer was made of them
                size = tuple(value(r).shape)
                if (buf.target in (torch.zeros, torch.zeros_like) or buf.target == "new_zeros") \
                        and all(isinstance(k, int) for k in size):
                    z = zeros.get((buf, slots[r]))
                    if z is None:                         # one per slot, made with the buffer
                        with g.inserting_after(buf):
                            z = zeros[(buf, slots[r])] = g.call_method("new_zeros", (buf, size))
                        z.meta["example_value"] = r.meta.get("example_value")
                    r.replace_all_uses_with(z)
                    g.erase_node(r)
                    count += 1
                continue
            v = before[-1].args[2]
            if not isinstance(v, fx.Node) or not is_tensor(v) or value(v).dtype != bv.dtype \
                    or tuple(value(v).shape) != tuple(value(r).shape):
                continue
            if _changed_in_place(v, mutated):      # the copy written would differ from v later
                continue
            r.replace_all_uses_with(v)
            g.erase_node(r)
            count += 1
            if buf.op == "placeholder":   # an input (a rollout buffer)
                _note_written_input(gm, phs.index(buf))
    if count:
        gm.recompile()
    return count


def _note_written_input(gm: fx.GraphModule, i: int) -> None:
    """Input i is written by the graph as rewritten here, which holds only while no other input
    shares its memory: the backend checks that at each call (`backend._alias_checked`)."""
    written = gm.meta.setdefault("ssmc_written_inputs", [])
    if i not in written:
        written.append(i)


def views_of(n: fx.Node) -> set:
    """n and every view taken of it, and of those."""
    out, todo = set(), [n]
    while todo:
        x = todo.pop()
        if x in out:
            continue
        out.add(x)
        todo.extend(u for u in x.users if _maybe_view(u) and u.args and u.args[0] is x)
    return out


def view_root(n: fx.Node) -> fx.Node:
    """The tensor n is a view of, through views of views (n where it is none)."""
    while _maybe_view(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _written_through(v: fx.Node, mutated) -> bool:
    """Whether v, or a view taken of it, is changed in place (v's own base not counted)."""
    alias = views_of(v)
    return any(mutated(u) in alias for a in alias for u in a.users)


def _changed_in_place(v: fx.Node, mutated) -> bool:
    """Whether any tensor sharing memory with v (v's view bases, and every view of those) is
    changed in place anywhere in the graph."""
    alias = views_of(view_root(v))
    return any(mutated(u) in alias or u.target is operator.setitem and u.args[0] in alias
               for a in alias for u in a.users)


def copies_as_writes(gm: fx.GraphModule) -> int:
    """``out[:, t].copy_(y)``, ``out.select(1, t).copy_(y)``, ``out.narrow(1, t, 1).copy_(y)``:
    a copy into a view of one index of a tensor, the view used for nothing else, becomes the
    write ``out[:, t] = y`` it is (same broadcasting and cast), which re-rolling collects like
    any per-step write. Returns the copies rewritten."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if not (n.op == "call_method" and n.target == "copy_" and len(n.args) == 2 and not n.kwargs
                and not n.users and isinstance(n.args[0], fx.Node)):
            continue
        view = n.args[0]
        if len(view.users) != 1 or not isinstance(n.args[1], (fx.Node, int, float)):
            continue
        idx = _view_index(view)
        if idx is None:
            continue
        with g.inserting_before(n):
            w = g.call_function(operator.setitem, (view.args[0], idx, n.args[1]))
        w.meta["example_value"] = None
        g.erase_node(n)
        g.erase_node(view)
        done += 1
    if done:
        gm.recompile()
    return done


def _view_index(view: fx.Node):
    """The getitem index of a view of one index along a dim (select, narrow by 1, or an index
    with ints and slices of its own), or None."""
    if not isinstance(view.args[0] if view.args else None, fx.Node) or not is_tensor(value(view.args[0])):
        return None
    if view.op == "call_function" and view.target is operator.getitem:
        idx = view.args[1]
        parts = idx if isinstance(idx, tuple) else (idx,)
        ok = all(_is_int(i) or (isinstance(i, slice) and all(v is None or _is_int(v) for v in (i.start, i.stop, i.step)))
                 or i is Ellipsis for i in parts)
        return idx if ok else None
    rs = reads_of(view)
    if len(rs) != 1 or rs[0].source is not view.args[0] or rs[0].width != 1:
        return None
    r = rs[0]
    at = r.index if r.rest is None else slice(r.index, r.index + 1)
    return tuple([slice(None)] * r.dim + [at])


def _scalar_arith(n: fx.Node) -> bool:
    """Arithmetic on Python numbers alone (symbolic ones included): an operator or math function,
    or ``.item()`` of a 0-d input, whose value is no tensor."""
    if is_tensor(value(n)) or n.kwargs:
        return False
    if n.op == "call_method":
        return n.target == "item"
    mod = getattr(n.target, "__module__", None)
    return n.op == "call_function" and (mod in ("_operator", "math") or getattr(n.target, "__name__", "").startswith("sym_"))


def hoist_scalar_arithmetic(gm: fx.GraphModule) -> int:
    """Moves arithmetic on the graph's numbers (a float hyperparameter Dynamo made symbolic: its
    ``.item()``, ``1 - beta``) right after its operands. Dynamo records such a value once, where
    the first step of a loop computes it, and every later step reuses it; left there, the first
    step has nodes the others lack and the steps do not line up. A node is moved only where no
    other node does the same arithmetic on other numbers (``beta ** (t + 1)``: one a step, the
    steps' own). Returns how many moved."""
    moved, hoisted = 0, set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    scalars = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and _scalar_arith(n)]

    def sig(n):
        return n.op, n.target, tuple(a if isinstance(a, fx.Node) else type(a).__name__ for a in n.args)
    count = {}
    for n in scalars:
        count[sig(n)] = count.get(sig(n), 0) + 1
    order = {m: i for i, m in enumerate(gm.graph.nodes)}
    for n in scalars:
        # one of a family differing in its numbers alone (``beta ** (t + 1)`` a step) is the steps' own
        if count[sig(n)] > 1:
            continue
        ins = n.all_input_nodes
        if not all(a.op == "placeholder" or a in hoisted for a in ins):
            continue
        if n.op == "call_method" and not (ins and ins[0].op == "placeholder"):
            continue
        if n.op == "call_method" and any(mutated(u) is not None for v in views_of(ins[0]) for u in v.users):
            continue               # `.item()` of an input the graph writes: its value depends on where
        hoisted.add(n)
        after = max(ins, key=order.__getitem__, default=placeholders[-1] if placeholders else None)
        if after is None or after.next is n:
            continue
        after.append(n)
        order = {m: i for i, m in enumerate(gm.graph.nodes)}      # places again, after a move only
        moved += 1
    if moved:
        gm.recompile()
    return moved


_METADATA_INPLACE = {"squeeze_": "squeeze", "unsqueeze_": "unsqueeze", "transpose_": "transpose", "t_": "t",
                     "swapdims_": "swapdims", "swapaxes_": "swapaxes"}


def metadata_updates_as_values(gm: fx.GraphModule) -> int:
    """``q_t.squeeze_(2)`` on a tensor the graph made (a step's view ``q[:, :, t:t + 1]``, xLSTM's
    step): it changes that tensor's shape, not any values, so it is its out-of-place form, and
    what reads the tensor afterwards reads the result. (Not on an input: the caller would see its
    tensor's new shape.) Returns how many were rewritten."""
    count = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        if n.op != "call_method" or n.target not in _METADATA_INPLACE or not n.args:
            continue
        v = n.args[0]
        if not isinstance(v, fx.Node) or v.op == "placeholder" or not is_tensor(value(v)):
            continue
        # v's example value is the tensor object Dynamo traced, which the method reshaped: v's own
        # value (before it) is made again from v's operands
        mode = _fake_mode(gm.graph)
        if mode is None or v.op not in ("call_function", "call_method"):
            continue
        try:
            with mode:
                a, kw = fx.node.map_arg((v.args, v.kwargs), value)
                before = getattr(a[0], v.target)(*a[1:], **kw) if v.op == "call_method" else v.target(*a, **kw)
        except Exception:
            continue
        if not is_tensor(before):
            continue
        n.meta = {**n.meta, "example_value": value(v)}
        v.meta = {**v.meta, "example_value": before}
        n.target = _METADATA_INPLACE[n.target]
        for u in list(v.users):
            if u is not n and order.get(u, -1) > order[n]:
                u.replace_input_with(v, n)
        count += 1
    if count:
        gm.recompile()
    return count


def detach_no_grad_values(gm: fx.GraphModule) -> int:
    """Values computed under ``torch.no_grad()`` (Dynamo brackets them with
    ``torch._C._set_grad_enabled(False)`` ... ``(True)``) are read through ``.detach()`` wherever
    they are used outside that bracket: no gradient flows through them however the passes
    regroup the graph (a region fuses work from both sides of the bracket, and its backward
    would otherwise differentiate all of it). In-place updates inside the bracket are left as
    they are. Returns the values detached."""
    g = gm.graph
    enabled, span, span_of = True, 0, {}
    for n in g.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            enabled, span = bool(n.args[0]), span + 1
        elif not enabled and n.op in ("call_function", "call_method") and is_tensor(value(n)):
            span_of[n] = span
    count = 0
    for n, sp in span_of.items():
        if _name(n).endswith("_") or n.target is operator.setitem or _name(n) == "detach":
            continue
        outside = [u for u in n.users if span_of.get(u) != sp
                   and not (u.op == "call_function" and u.target is torch._C._set_grad_enabled)]
        if not outside:
            continue
        with g.inserting_after(n):
            d = g.call_method("detach", (n,))
        d.meta["example_value"] = value(n).detach()
        for u in outside:
            u.args = fx.node.map_arg(u.args, lambda a: d if a is n else a)
            u.kwargs = fx.node.map_arg(u.kwargs, lambda a: d if a is n else a)
        count += 1
    if count:
        gm.recompile()
    return count


def functionalize_updates(gm: fx.GraphModule) -> int:
    """Rewrite in-place updates of a tensor the graph allocates itself (``h = torch.zeros(..)``
    then ``h.mul_(dA).add_(dBx)`` each step) or of an input (a state cache passed in, ``h *= a;
    h += x[:, t]``) as new values: each update becomes its out-of-place op, and every later use
    of the tensor reads the latest value, so the step-to-step data flow a recurrence needs is in
    the graph; an input gets its last value copied back at the end (the caller sees the update).
    Only where that cannot change a result: the tensor is a fresh allocation or an input (not a
    view), no view of it is ever taken, and each update keeps its shape and dtype (no
    broadcasting or promotion). Returns the updates rewritten."""
    g = gm.graph
    root: dict = {}
    for n in g.nodes:
        s = _inplace_self(n)
        if s is not None:
            root[n] = root.get(s, s)
    if not root:
        return 0
    members: dict = {}
    for n, r in root.items():
        members.setdefault(r, []).append(n)
    order = {n: i for i, n in enumerate(g.nodes)}
    ok = set()
    for r, ms in members.items():
        if not (_fresh(r) or r.op == "placeholder"):
            continue
        rv = value(r)
        if not is_tensor(rv):
            continue
        if len({repr(m.args[1]) for m in ms if m.target is operator.setitem}) > 1:
            continue       # a buffer written at several places (out[:, t] = y): the loop's sink
        safe = True
        for a in [r, *ms]:
            for u in a.users:
                if root.get(u) is r and u.args[0] is a:
                    continue
                if u.target is operator.setitem or _name(u) in _WRITES or "out" in u.kwargs:
                    safe = False          # written by an op this rewrite does not follow
                    continue
                if u.op == "output" or (u.op in ("call_function", "call_method") and not _maybe_view(u)):
                    continue
                if not _used_before_next_write(u, ms, order):
                    safe = False
        for m in ms:
            if m.target is operator.setitem:         # x[idx] = v: v of x's dtype, broadcast to the slice
                v = value(m.args[2]) if isinstance(m.args[2], fx.Node) else None
                want = _scatter_of(m)[2]
                if v is None or not is_tensor(v) or v.dtype != rv.dtype or len(v.shape) > len(want) \
                        or tuple(torch.broadcast_shapes(tuple(v.shape), want)) != want:
                    safe = False
                continue
            args = [value(x) for x in m.args[1:] if isinstance(x, fx.Node)]
            if any(not is_tensor(x) or x.dtype != rv.dtype for x in args):
                safe = False
            elif m.target == "copy_" and (len(args) != 1 or tuple(args[0].shape) != tuple(rv.shape)):
                safe = False
            elif args and tuple(torch.broadcast_shapes(rv.shape, *(x.shape for x in args))) != tuple(rv.shape):
                safe = False
        if safe:
            ok.add(r)
    if not ok:
        return 0
    current = {r: r for r in ok}
    count = 0

    def latest(a):
        r = root.get(a, a)
        return current[r] if r in current else a

    for n in list(g.nodes):
        r = root.get(n)
        n.args = fx.node.map_arg(n.args, lambda a: latest(a) if a is not n else a)
        n.kwargs = fx.node.map_arg(n.kwargs, latest)
        if r in ok:
            if n.target is operator.setitem:        # a new value: x with the slice replaced
                fn, extra, want = _scatter_of(n)
                v = n.args[2]
                if tuple(value(v).shape) != want:
                    with g.inserting_after(n):
                        v = g.call_function(torch.broadcast_to, (v, want))
                    v.meta["example_value"] = torch.broadcast_to(value(n.args[2]), want)
                with g.inserting_after(v if v is not n.args[2] else n):
                    new = g.call_function(fn, (n.args[0], v, *extra))
                new.meta["example_value"] = fn(value(n.args[0]), value(v), *extra)
                current[r] = new
                count += 1
                continue
            if n.target == "copy_":
                current[r] = n.args[1]
            elif n.target in _AUGMENTED:
                n.target = _AUGMENTED[n.target]
                current[r] = n
            else:
                n.target = n.target[:-1]
                current[r] = n
            count += 1
    for n in reversed(list(g.nodes)):
        if n.op == "call_method" and n.target == "copy_" and not n.users and root.get(n) in ok:
            g.erase_node(n)
        elif n.target is operator.setitem and root.get(n) in ok:
            g.erase_node(n)
    out = next(n for n in g.nodes if n.op == "output")
    phs = [n for n in g.nodes if n.op == "placeholder"]
    for r in ok:                   # an input updated in place: the caller's tensor gets the last value
        if r.op == "placeholder" and current[r] is not r:
            # what reads its value before the updates reads a copy: a region saves its inputs for
            # the backward, and the copy-back below would change the one it saved
            with g.inserting_after(phs[-1]):
                first = g.call_method("clone", (r,))
            first.meta = dict(r.meta)
            r.replace_all_uses_with(first, delete_user_cb=lambda u: u is not first)
            with g.inserting_before(out):
                g.call_method("copy_", (r, current[r]))
            last = current[r]       # returned, it is the caller's tensor itself, as in eager
            out.args = fx.node.map_arg(out.args, lambda a: r if a is last else a)
            _note_written_input(gm, phs.index(r))
    gm.recompile()
    return count


_WRITES = {"ifloordiv", "ipow", "imod", "iand", "ior", "ixor", "ilshift", "irshift", "imatmul"}
_MAY_ALIAS = {"broadcast_to", "atleast_1d", "atleast_2d", "atleast_3d", "cpu", "cuda", "type", "alias",
              "data", "requires_grad_", "set_"}
_VIEWS = {"getitem", "select", "narrow", "view", "view_as", "reshape", "reshape_as", "expand",
          "expand_as", "transpose", "t", "permute", "squeeze", "unsqueeze", "flatten", "unflatten",
          "unbind", "split", "chunk", "diagonal", "as_strided", "movedim", "swapaxes", "contiguous",
          "detach", "unfold", "view_as_real", "view_as_complex", "real", "imag", "to", "type_as",
          "float", "double", "half", "bfloat16", "getattr", "__getitem__"}


def _used_before_next_write(u: fx.Node, writes: list, order: dict) -> bool:
    """Whether view (or alias) `u` of a tensor updated in place by `writes` is used up before the
    tensor's next update: every use of it an op that is neither a view nor a write, placed before
    that update (``s.copy_(a * s + b); y = einsum("bdn,bn->bd", s.to(dtype), C)``, mamba_ssm's
    step). Then reading the latest value instead of the alias changes no result."""
    if _name(u) not in _VIEWS:
        return False
    later = [order[w] for w in writes if order[w] > order[u]]
    end = min(later) if later else len(order)
    for w in u.users:
        if w.op == "output":
            if later:
                return False
            continue
        if w.op not in ("call_function", "call_method") or _maybe_view(w) or w.target is operator.setitem \
                or _name(w) in _WRITES or "out" in w.kwargs or order[w] >= end:
            return False
    return True


def _maybe_view(u: fx.Node) -> bool:
    """Whether `u` may return a tensor sharing memory with its input (a view, or the input
    itself: ``.to()`` and ``.float()`` of a tensor already of that type)."""
    return _name(u) in _VIEWS or _name(u).endswith("_")


# -- products with a diagonal matrix ---------------------------------------------------------

def _vector(x) -> bool:
    return isinstance(x, fx.Node) and is_tensor(x) and len(shape(x) or ()) >= 1


def _swaps_last_two(n: fx.Node) -> bool:
    """Whether view n swaps its input's last two dims and keeps the others (``D.T``, ``D.mT``,
    ``D.transpose(-1, -2)``, ``D.permute(0, 2, 1)``)."""
    from .ops import view_map
    if not isinstance(n, fx.Node) or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.op == "call_function" and n.target is getattr and n.args[1:] in (("T",), ("mT",)):
        nd = len(shape(n.args[0]) or ())
        return nd == 2 or (nd > 2 and n.args[1] == "mT")
    nd = len(shape(n.args[0]) or ())
    if nd < 2 or len(shape(n) or ()) != nd:
        return False
    info = view_map(n)
    return info is not None and not info[1] and tuple(info[0]) == tuple(range(nd - 2)) + (nd - 1, nd - 2)


def diagonal_of(n, outer: dict | None = None):
    """The vector v when `n` is the matrix with v on its diagonal and zeros elsewhere, whatever v
    holds: ``torch.diag(v)`` (v 1-d), ``torch.diag_embed(v)`` (a batch of them), ``torch.eye(k) * v``,
    or a transpose of one of these; `outer` maps a step body's invariant placeholders to the outer
    nodes they stand for (v is then an outer node). None for anything else."""
    if not isinstance(n, fx.Node):
        return None
    if outer is not None and n in outer:
        v = diagonal_of(outer[n])
        return ("outer", v) if v is not None else None
    name = _name(n)
    args = list(n.args)
    if n.op == "call_function" and name in ("diag", "diag_embed") and getattr(torch, name) is n.target \
            or n.op == "call_method" and name in ("diag", "diag_embed"):
        v = args[0] if args else None
        extra = args[1:] + list(n.kwargs.values())
        if not _vector(v) or any(e not in (0,) for e in extra[:1]) or extra[1:] not in ([], [-2, -1]):
            return None
        if name == "diag" and len(shape(v)) != 1:        # diag of a matrix reads its diagonal
            return None
        return v
    if n.op == "call_function" and n.target in (operator.mul, torch.mul) and len(args) == 2 and not n.kwargs:
        for e, v in (args, args[::-1]):
            if isinstance(e, fx.Node) and e.op == "call_function" and e.target is torch.eye \
                    and len(shape(e) or ()) == 2 and shape(e)[0] == shape(e)[1] \
                    and _vector(v) and len(shape(v)) == 1 and shape(v)[0] == shape(e)[0] \
                    and tuple(shape(n)) == tuple(shape(e)):
                return v
        return None
    if _swaps_last_two(n):
        return diagonal_of(n.args[0], outer)
    return None


def diagonal_products(lp) -> int:
    """Products with a diagonal matrix in a loop's step body, written as the elementwise products
    they are: a two-operand contraction (``@``, ``matmul``, ``mm``, ``bmm``, ``einsum``; its
    letters as `ssmc.ops.canonical` reads them) with one (`diagonal_of` lists the diagonal
    matrices known) is the einsum of its vector with the matrix's column letter renamed to its
    row letter (``diag(v) @ X`` is ``einsum("i,ij->ij", v, X)``), which sums over nothing and
    becomes a product (`_einsum_as_product`). The state's transition then stays elementwise (one
    multiply per element) instead of an n x n matrix (block_sparse) or, for a diagonal that
    changes every step, (L, n, n) matrices made before the loop. A diagonal matrix built outside
    the loop enters as a new loop invariant, its vector. Returns the products rewritten."""
    from .ops import _contract, canonical
    graph = lp.body.graph
    b = _Builder(graph, _fake_mode(graph))
    outer = dict(zip(lp.invariant_nodes(), lp.invariants))
    added: dict = {}

    def here(v):
        """v as a body value: a diagonal made outside the loop enters as a new invariant."""
        if not (isinstance(v, tuple) and v[0] == "outer"):
            return v
        v = v[1]
        if v not in added:
            with graph.inserting_after(lp.placeholders()[-1]):
                ph = graph.placeholder(f"diag_{len(lp.invariants)}")
            ph.meta["example_value"] = value(v)
            lp.invariants.append(v)
            added[v] = ph
        return added[v]

    count = 0
    for n in list(graph.nodes):
        if n.op not in ("call_function", "call_method") or not is_tensor(n):
            continue
        c = canonical(n)
        if c is None and n.op == "call_method" and n.target in ("mm", "bmm") and len(n.args) == 2:
            c = _contract(n, "matmul")
        if c is None or c.kind != "contract" or len(c.args) != 2 or n.kwargs:
            continue
        r = _diagonal_contraction(b, n, c, outer, here)
        if r is None:
            continue
        if tuple(shape(r)) != tuple(shape(n)) or value(r).dtype != value(n).dtype:
            _erase_dead(graph, r)
            continue
        n.replace_all_uses_with(r)
        _erase_dead(graph, n)
        count += 1
    return count


def _diagonal_contraction(b: _Builder, n: fx.Node, c, outer: dict, here) -> fx.Node | None:
    """The einsum of `diagonal_products` for contraction `c` (canonical form of n), or None."""
    subs, out = list(c.params["subs"]), c.params["out"]
    for k in (0, 1):
        s = subs[k]
        v = diagonal_of(c.args[k], outer)
        if v is None or not isinstance(c.args[1 - k], fx.Node) or len(s) < 2 or s[-1] == s[-2]:
            continue
        row, col = s[-2], s[-1]
        if row in s[:-2] or col in s[:-2]:
            continue
        other = subs[1 - k].replace(col, row)
        new_out = out.replace(col, row)
        if len(set(other)) != len(other) or len(set(new_out)) != len(new_out):
            continue
        vs = s[:-2] + row
        if len(shape(v[1] if isinstance(v, tuple) else v)) != len(vs):
            continue
        new_subs, ops = [None, None], [None, None]
        new_subs[k], ops[k] = vs, here(v)
        new_subs[1 - k], ops[1 - k] = other, c.args[1 - k]
        return b.call(n, torch.einsum, (f"{new_subs[0]},{new_subs[1]}->{new_out}", *ops))
    return None
