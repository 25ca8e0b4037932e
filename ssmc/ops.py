"""What ssmc knows about torch operations.

`canonical(node)` turns one FX node of a Dynamo graph (call_function or call_method, in any of
the spellings people use: ``torch.exp(x)``, ``x.exp()``, ``F.softplus``, ``x * y``, ``x.float()``)
into a `Canon`: a kind (elementwise / view / reduce / contract / identity), a canonical op name,
its tensor-or-scalar operands and its parameters. Everything downstream works on `Canon`, never
on raw targets. `ELEMENTWISE` is the op set every target's expression printer must cover.
"""
from __future__ import annotations

import dataclasses
import operator
import string
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

# name -> arity. The region IR and every target printer speak these names.
ELEMENTWISE: dict[str, int] = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "pow": 2, "maximum": 2, "minimum": 2,
    "gt": 2, "lt": 2, "ge": 2, "le": 2, "eq": 2, "ne": 2, "where": 3,
    "neg": 1, "exp": 1, "exp2": 1, "expm1": 1, "log": 1, "log1p": 1, "sqrt": 1, "rsqrt": 1,
    "tanh": 1, "sigmoid": 1, "logsigmoid": 1, "softplus": 1, "silu": 1, "relu": 1, "abs": 1,
    "reciprocal": 1, "sin": 1, "cos": 1, "cast": 1,
}

_EW_FUNCS: dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.pow: "pow", operator.gt: "gt", operator.lt: "lt",
    operator.ge: "ge", operator.le: "le", operator.eq: "eq", operator.ne: "ne",
    torch.add: "add", torch.sub: "sub", torch.subtract: "sub", torch.mul: "mul",
    torch.multiply: "mul", torch.div: "div", torch.true_divide: "div", torch.divide: "div",
    torch.pow: "pow", torch.maximum: "maximum", torch.minimum: "minimum", torch.where: "where",
    torch.gt: "gt", torch.lt: "lt", torch.ge: "ge", torch.le: "le", torch.eq: "eq", torch.ne: "ne",
    torch.neg: "neg", torch.negative: "neg", torch.exp: "exp", torch.exp2: "exp2",
    torch.expm1: "expm1", torch.log: "log", torch.log1p: "log1p", torch.sqrt: "sqrt",
    torch.rsqrt: "rsqrt", torch.tanh: "tanh", torch.sigmoid: "sigmoid", torch.abs: "abs",
    torch.reciprocal: "reciprocal", torch.relu: "relu", torch.sin: "sin", torch.cos: "cos",
    torch.special.expit: "sigmoid", torch.special.exp2: "exp2", torch.special.expm1: "expm1",
    torch.special.log1p: "log1p",
    F.silu: "silu", F.sigmoid: "sigmoid", F.tanh: "tanh", F.relu: "relu", F.logsigmoid: "logsigmoid",
    F.softplus: "softplus",
}
_EW_METHODS = {
    "add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul", "div": "div",
    "true_divide": "div", "divide": "div", "pow": "pow", "maximum": "maximum",
    "minimum": "minimum", "gt": "gt", "lt": "lt", "ge": "ge", "le": "le", "eq": "eq", "ne": "ne",
    "neg": "neg", "negative": "neg", "exp": "exp", "exp2": "exp2", "expm1": "expm1", "log": "log",
    "log1p": "log1p", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "sigmoid": "sigmoid",
    "abs": "abs", "reciprocal": "reciprocal", "relu": "relu", "sin": "sin", "cos": "cos",
    "__add__": "add", "__radd__": "add", "__mul__": "mul", "__rmul__": "mul", "__sub__": "sub",
    "__truediv__": "div", "__neg__": "neg",
}
MATMUL_METHODS = ("matmul", "__matmul__", "bmm", "mm")     # x.matmul(y) and alike: a matrix product
_CAST_METHODS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                 "bfloat16": torch.bfloat16}
_IDENTITY_METHODS = {"contiguous", "clone"}
_VIEW_METHODS = {"unsqueeze", "squeeze", "permute", "transpose", "t", "movedim", "moveaxis",
                 "expand", "expand_as", "view", "reshape", "flatten", "unflatten", "select",
                 "swapaxes", "swapdims", "view_as", "reshape_as"}
_VIEW_FUNCS = {torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze", torch.permute: "permute",
               torch.transpose: "transpose", torch.t: "t", torch.movedim: "movedim",
               torch.moveaxis: "movedim", torch.reshape: "reshape", torch.flatten: "flatten",
               torch.select: "select", torch.swapaxes: "transpose", torch.swapdims: "transpose",
               torch.broadcast_to: "expand", torch.unflatten: "unflatten",
               operator.getitem: "getitem"}
_CONTRACT_FUNCS = {torch.einsum: "einsum", torch.matmul: "matmul", operator.matmul: "matmul",
                   torch.bmm: "matmul", torch.mm: "matmul"}


@dataclasses.dataclass
class Canon:
    kind: str                  # "ew" | "view" | "reduce" | "contract" | "identity"
    op: str                    # ELEMENTWISE name, "sum", "einsum", view name, "identity"
    args: tuple                # operands: fx.Node or python scalars
    params: dict = dataclasses.field(default_factory=dict)

    def tensor_args(self) -> list[fx.Node]:
        return [a for a in self.args if isinstance(a, fx.Node)]


def value(node: Any):
    """The example value Dynamo recorded for a node (a FakeTensor), or the object itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


_AUGMENTED = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
              operator.ipow, operator.imod, operator.iand, operator.ior, operator.ixor, operator.imatmul)


def mutated(n: fx.Node):
    """The tensor an in-place node writes (``out[idx] = y``, ``out.index_copy_(...)``), or None."""
    if n.op == "call_function" and n.target is operator.setitem:
        return n.args[0]
    if n.op == "call_function" and n.target in _AUGMENTED and n.args and is_tensor(n.args[0]):
        return n.args[0]               # `h += x` on a tensor writes h
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if n.op == "call_function" and getattr(n.target, "__module__", None) == "_operator":
        return None                    # `operator.and_`, `or_`: `a & b`, no write (`&=` is `iand`)
    if n.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_") \
            and n.args and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def impure(n: fx.Node) -> bool:
    """A node that must stay though nothing reads it: torch's own idea of impure, an in-place
    write, or what Dynamo kept with no reader for its effect (``ssmc_effect``, set by the
    backend: vmap's level pushes and pops)."""
    return n.is_impure() or mutated(n) is not None or n.meta.get("ssmc_effect", False)


def reaches(roots, targets, through_not=()) -> bool:
    """Whether a node of `targets` is among `roots` or their inputs, transitively; the walk does
    not go on past nodes in `through_not`."""
    seen, todo = set(), [r for r in (roots if isinstance(roots, (list, tuple)) else [roots])
                         if isinstance(r, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n in targets:
            return True
        seen.add(n)
        if n not in through_not:
            todo.extend(n.all_input_nodes)
    return False


def ancestors(nodes, stop=frozenset()) -> set:
    """The nodes among `nodes` (nodes or constants) and all they are made from; the nodes in
    `stop` are included but not looked through."""
    anc, todo = set(), [n for n in nodes if isinstance(n, fx.Node)]
    while todo:
        n = todo.pop()
        if n not in anc:
            anc.add(n)
            if n not in stop:
                todo.extend(n.all_input_nodes)
    return anc


def descendants(nodes) -> set:
    """The nodes made from any of `nodes`, those included."""
    out, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(n.users)
    return out


def shape(node: Any) -> tuple:
    """The node's shape; a data-dependent size (an unbacked symbol, e.g. the row count of
    ``x[nonzero(mask)]`` under ``capture_dynamic_output_shape_ops``) reads as a stand-in
    integer >= UNBACKED, the same for one symbol everywhere, so passes can compare it."""
    v = value(node)
    return tuple(_size(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()


UNBACKED = 1 << 40
_STANDIN: dict = {}


def _size(s):
    if isinstance(s, torch.SymInt) and getattr(s.node, "hint", 0) is None:
        return _STANDIN.setdefault(str(s.node.expr), UNBACKED + len(_STANDIN))
    return s


def dtype(node: Any) -> torch.dtype | None:
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_tensor(node: Any) -> bool:
    return isinstance(value(node), torch.Tensor)


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _inactive_dropout(node: fx.Node) -> bool:
    """``F.dropout(x, p, training=False)`` (an ``nn.Dropout`` in eval mode) or ``p == 0``: x."""
    t = node.target
    if t in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout):
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    elif t is torch.dropout:
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
    else:
        return False
    return bool(node.args) and isinstance(node.args[0], fx.Node) and (training is False or p == 0) \
        and _arg(node, 3, "inplace", False) is False


def canonical(node: fx.Node) -> Canon | None:
    """Describe one node in ssmc's op vocabulary; None when ssmc does not know the op."""
    if node.op == "call_function":
        t = node.target
        if t in _EW_FUNCS:
            return _elementwise(node, _EW_FUNCS[t])
        if t in _CONTRACT_FUNCS:
            return _contract(node, _CONTRACT_FUNCS[t])
        if t in (torch.sum, torch.mean):
            return _reduce(node, "sum" if t is torch.sum else "mean")
        if t is torch.addcmul:
            return Canon("ew", "addcmul", tuple(node.args[:3]), {"value": node.kwargs.get("value", 1)})
        if str(t) == "prims.fma.default" and len(node.args) == 3 and not node.kwargs:   # a * b + c: Dynamo's addcmul_(value=)
            return Canon("ew", "addcmul", (node.args[2], node.args[0], node.args[1]), {"value": 1})
        if t is torch.clone or _inactive_dropout(node):
            return Canon("identity", "identity", (node.args[0],))
        if t in (torch.clamp, torch.clip):
            return _clamp(node)
        if t in _VIEW_FUNCS:
            return _view(node)
        return None
    if node.op == "call_method":
        m = node.target
        if m in _EW_METHODS:
            return _elementwise(node, _EW_METHODS[m])
        if m in _CAST_METHODS:
            return Canon("ew", "cast", (node.args[0],), {"dtype": _CAST_METHODS[m]})
        if m in ("to", "type", "type_as"):
            return _cast(node)
        if m in _IDENTITY_METHODS:
            return Canon("identity", "identity", (node.args[0],))
        if m in ("sum", "mean"):
            return _reduce(node, m)
        if m in MATMUL_METHODS:
            return _contract(node, "matmul")
        if m in ("clamp", "clip", "clamp_min", "clamp_max"):
            return _clamp(node)
        if m == "addcmul":
            return Canon("ew", "addcmul", tuple(node.args[:3]), {"value": node.kwargs.get("value", 1)})
        if m in _VIEW_METHODS:
            return _view(node)
    return None


def _elementwise(node: fx.Node, op: str) -> Canon | None:
    args = list(node.args)
    kw = dict(node.kwargs)
    if op == "softplus":
        beta = _arg(node, 1, "beta", 1.0)
        threshold = _arg(node, 2, "threshold", 20.0)
        return Canon("ew", "softplus", (args[0],), {"beta": beta, "threshold": threshold})
    if op in ("add", "sub") and (kw.get("alpha", 1) != 1 or len(args) > 2):
        alpha = kw.get("alpha", args[2] if len(args) > 2 else 1)
        return Canon("ew", op, (args[0], args[1]), {"alpha": alpha})
    if op == "div" and kw.get("rounding_mode") is not None:
        return None
    if set(kw) - {"alpha"}:
        return None
    n = ELEMENTWISE.get(op)
    if n is None or len(args) != n:
        return None
    return Canon("ew", op, tuple(args))


def _clamp(node: fx.Node) -> Canon | None:
    x = node.args[0]
    if node.target == "clamp_min":
        lo, hi = _arg(node, 1, "min"), None
    elif node.target == "clamp_max":
        lo, hi = None, _arg(node, 1, "max")
    else:
        lo, hi = _arg(node, 1, "min"), _arg(node, 2, "max")
    return Canon("ew", "clamp", (x,), {"min": lo, "max": hi})


def _cast(node: fx.Node) -> Canon | None:
    x = node.args[0]
    out = dtype(node)
    if out is None or dtype(x) is None:
        return None
    if node.target == "to":
        # only dtype changes are casts; a device move is not something we fuse
        vx, vo = value(x), value(node)
        if vx.device != vo.device:
            return None
    return Canon("ew", "cast", (x,), {"dtype": out})


def _reduce(node: fx.Node, op: str) -> Canon | None:
    x = node.args[0]
    nd = len(shape(x))
    dim = _arg(node, 1, "dim", None)
    keepdim = bool(_arg(node, 2, "keepdim", False))
    if node.kwargs.get("dtype") is not None:
        return None
    if dim is None:
        dims = tuple(range(nd))
    elif isinstance(dim, int):
        dims = (dim % nd,)
    else:
        dims = tuple(d % nd for d in dim)
    return Canon("reduce", op, (x,), {"dims": tuple(sorted(set(dims))), "keepdim": keepdim})


def _contract(node: fx.Node, op: str) -> Canon | None:
    if op == "einsum":
        eq = node.args[0]
        ops = node.args[1:]
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if not isinstance(eq, str) or "..." in eq:
            return None
        eq = eq.replace(" ", "")
        if "->" not in eq:
            return None
        lhs, out = eq.split("->")
        subs = lhs.split(",")
        if len(subs) != len(ops):
            return None
        return Canon("contract", "einsum", tuple(ops), {"subs": tuple(subs), "out": out})
    a, b = node.args[0], node.args[1]
    sa, sb = shape(a), shape(b)
    na, nb = len(sa), len(sb)
    if na == 0 or nb == 0:
        return None
    if na >= 2 and nb >= 2 and sa[-1] == 1 and sb[-2] == 1 and not node.kwargs:
        # a column times a row (``k[..., :, None] @ u[..., None, :]``, bmm alike): nothing is summed,
        # it is the broadcast product, with the batch dims broadcast the same way
        return Canon("ew", "mul", (a, b))
    letters = iter(string.ascii_letters)
    k = next(letters)  # contracted letter
    if na == 1 and nb == 1:
        return Canon("contract", "einsum", (a, b), {"subs": (k, k), "out": ""})
    nbatch = max(na, nb) - 2
    batch = [next(letters) for _ in range(nbatch)]
    i, j = next(letters), next(letters)
    sa = (batch[nbatch - (na - 2):] if na > 2 else []) + ([i, k] if na >= 2 else [k])
    sb = (batch[nbatch - (nb - 2):] if nb > 2 else []) + ([k, j] if nb >= 2 else [k])
    out = batch + ([i] if na >= 2 else []) + ([j] if nb >= 2 else [])
    return Canon("contract", "einsum", (a, b),
                 {"subs": ("".join(sa), "".join(sb)), "out": "".join(out)})


def _view(node: fx.Node) -> Canon | None:
    info = view_map(node)
    if info is None:
        return None
    src, consts = info
    ins, outs = shape(node.args[0]), shape(node)
    if not consts and same_shape(ins, outs) and len(src) == len(ins) and \
            all(s == d or (s is None and _is_one_size(ins[d])) for d, s in enumerate(src)):
        return Canon("identity", "identity", (node.args[0],))      # out[:, -1:] of a size-1 dim: the same values
    return Canon("view", str(node.target if node.op == "call_method" else _VIEW_FUNCS[node.target]),
                 (node.args[0],), {"src": src, "consts": consts})


def same_shape(a, b) -> bool:
    """Whether two shapes are the same, without a guard on symbolic sizes (``==`` of two SymInts
    makes Dynamo specialise, so a later length recompiles): sizes compared as ints or as the
    same symbolic expression."""
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt):
            if x.node.expr != y.node.expr:
                return False
        else:
            return False
    return True


def _is_one_size(s) -> bool:
    return isinstance(s, int) and s == 1         # (Dynamo specialises sizes 0 and 1: never symbolic)


def view_map(node: fx.Node) -> tuple[tuple, dict] | None:
    """For a view node, which input dim each output dim reads (None: a size-1 or broadcast dim)
    and which input dims are fixed to a constant index. None when the view is not a plain
    re-indexing (slices with offsets or steps, merges, splits, copies).

    Found by running the op on meta "probe" tensors, one per input dim, whose only nonzero
    stride is that dim's: the output strides then say which input dim each output dim reads.
    """
    x = node.args[0]
    if not is_tensor(x) or not is_tensor(node):
        return None
    in_shape, out_shape = _hint(shape(x)), _hint(shape(node))
    if in_shape is None or out_shape is None:
        return None  # sizes without a known value
    nd = len(in_shape)
    src: list = [None] * len(out_shape)
    hits = [0] * len(out_shape)
    consts: dict[int, int] = {}
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, (fx.Node, torch.Tensor, list)) or (isinstance(i, slice) and any(
                isinstance(v, fx.Node) for v in (i.start, i.stop, i.step))) for i in idx):
            return None
    for d in range(nd):
        strides = [0] * nd
        strides[d] = 1
        probe = torch.empty_strided(in_shape, strides, device="meta")
        try:
            out = _call_on(node, probe)
        except Exception:
            return None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != out_shape:
            return None
        if out.storage_offset():
            consts[d] = int(out.storage_offset())
        for i, (s, size) in enumerate(zip(out.stride(), out.shape)):
            if size == 1 or s == 0:
                continue
            if s != 1 or size != in_shape[d]:
                return None
            src[i] = d
            hits[i] += 1
    if any(h > 1 for h in hits):
        return None
    used = {s for s in src if s is not None}
    for d in range(nd):
        if d in used and d in consts:
            return None  # slice with an offset
        if d not in used and d not in consts and in_shape[d] != 1:
            return None  # a dim of size > 1 vanished without being indexed
    return tuple(src), consts


def _hint(sizes):
    """Concrete sizes: symbolic sizes (dynamic shapes) by the value they had when captured."""
    out = []
    for s in sizes:
        if isinstance(s, torch.SymInt):
            h = getattr(s.node, "hint", None)
            s = h if h is not None else _size(s) - UNBACKED + 2     # a data-dependent size: >= 2
        out.append(int(s))
    return tuple(out)


def _meta_like(a):
    if isinstance(a, fx.Node):
        v = value(a)
        if isinstance(v, torch.Tensor):
            return torch.empty(_hint(v.shape), dtype=v.dtype, device="meta")
        return _meta_like(v)
    if isinstance(a, torch.SymInt):
        return _hint((a,))[0]
    return a


def _call_on(node: fx.Node, probe: torch.Tensor):
    args = (probe, *[fx.node.map_aggregate(a, _meta_like) for a in node.args[1:]])
    kwargs = {k: fx.node.map_aggregate(v, _meta_like) for k, v in node.kwargs.items()}
    if node.op == "call_method":
        return getattr(probe, node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)
