"""Scans written without a loop: the chunked SSD in its parallel form, as HF transformers'
Mamba2 family and the "minimal SSD" listings compute it, and chunked linear attention.

Such code cuts the sequence into chunks (``x.reshape(b, -1, chunk, ...)``), builds the decays
within a chunk as ``exp`` of masked segment sums of the log-decays (or, with no decay, masks a
chunk's scores q k^T to zero above the diagonal), runs the states across chunks, and merges the
chunks back (``y.reshape(b, -1, ...)``). What it computes is the scan

    h_t = exp(a_t) * h_{t-1} + x_t (outer) B_t,     y_t = h_t . C_t,

(a = 0 without decays) over the chunked length, from zeros or a state passed in, and often
returns the last state too.
This module finds the pieces, and proves the claim the way one proves two analytic functions
equal: it evaluates the graph's nodes between the chunk splits and the merge on random inputs
at the graph's own sizes and compares with the scan (float64, a sample of rows). Which input
plays which role (a, x, B, C, the initial state) and which node used afterwards is the final
state are found the same way, among those whose shapes fit. What holds becomes a `Loop` of that
step, which the passes after `reroll` compile like any written loop; what does not is left as
written, with the reason.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.fx as fx

from .capture import _Builder, _fake_mode, _name
from .loop import Loop, Read, Result
from .ops import _hint, ancestors, descendants, impure, mutated, shape, value

_VIEWS = {"reshape", "view", "_unsafe_view", "unflatten", "flatten"}
_MASKS = {"tril", "triu", "masked_fill", "masked_fill_", "tril_", "triu_", "where"}
# in-place masks a form may hold, on a tensor it computed with one of _FRESH: ops whose result is
# a new tensor, never a view of an argument (a write to it changes no input)
_INPLACE_MASKS = {"masked_fill_", "tril_", "triu_"}
_FRESH = {"matmul", "bmm", "einsum", "mul", "add", "sub", "div", "truediv", "exp", "cumsum", "tril",
          "triu", "masked_fill", "where", "clone", "zeros_like", "ones_like", "neg", "pow", "sum"}


class NotTaken(ValueError):
    """A parallel form found but not taken; the message says why."""


def _segment_sums(graph: fx.Graph, depth: int = 8) -> list[fx.Node]:
    """`exp` nodes reading a `cumsum` through a triangular mask within `depth` nodes."""
    found = []
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method") or _name(n) not in ("exp", "exp_"):
            continue
        seen, todo, masked = set(), [(n, 0)], False
        while todo:
            m, d = todo.pop()
            if m in seen or d > depth:
                continue
            seen.add(m)
            masked |= _name(m) in _MASKS
            if _name(m) == "cumsum" and masked:
                found.append(n)
                break
            todo += [(a, d + 1) for a in m.all_input_nodes]
    return found


def _zero_masks(graph: fx.Graph) -> list[fx.Node]:
    """Square (..., c, c) tensors computed from the graph's inputs and masked to zero by a
    triangular pattern: `tril`/`triu` of them, or `masked_fill`/`where` with 0, as a chunk's
    scores q k^T are in chunked linear attention (a softmax's mask fills -inf instead)."""
    found, memo = [], {}
    for n in graph.nodes:
        if n.op not in ("call_function", "call_method") or _name(n) not in _MASKS or not n.args:
            continue
        shp = _hshape(n)
        if len(shp) < 2 or shp[-1] != shp[-2] or shp[-1] < 2 or _constant(n, memo):
            continue
        name = _name(n)
        if name in ("masked_fill", "masked_fill_"):
            fill = n.args[2] if len(n.args) > 2 else n.kwargs.get("value")
        elif name == "where":           # where(mask, 0, scores) or where(mask, scores, 0)
            fill = next((a for a in n.args[1:3] if not isinstance(a, fx.Node)), None)
        else:
            fill = 0
        if isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0:
            found.append(n)
    return found


def has_parallel_scan(graph: fx.Graph) -> bool:
    """Whether the graph has the segment sums of a scan in parallel form (for the report)."""
    return bool(_segment_sums(graph))


def _is_view(n: fx.Node) -> bool:
    return (n.op in ("call_function", "call_method") and _name(n) in _VIEWS and bool(n.args)
            and isinstance(n.args[0], fx.Node) and len(_hshape(n.args[0])) > 0)


def _split_dim(src: tuple, out: tuple, cs: int) -> int | None:
    """The dim of `src` that `out` cuts into (chunks, cs), the others unchanged."""
    if len(out) != len(src) + 1:
        return None
    for i in range(len(src)):
        if (src[:i] == out[:i] and src[i + 1:] == out[i + 2:] and out[i + 1] == cs
                and out[i] * cs == src[i] and out[i] > 0):
            return i
    return None


def _size_value(n: fx.Node):
    """A size the graph computes (a SymInt under dynamic shapes, by its traced value), or None."""
    v = value(n)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return getattr(v.node, "hint", None)
    return v if isinstance(v, (int, float, bool)) and not isinstance(v, torch.Tensor) else None


def _hshape(n) -> tuple:
    """The node's shape, symbolic sizes by their traced values."""
    v = value(n)
    return _hint(v.shape) if isinstance(v, torch.Tensor) else ()


def _constant(n: fx.Node, memo: dict) -> bool:
    """Computed from no tensor input of the graph (masks from torch.ones, aranges, fills; sizes)."""
    if n not in memo:
        memo[n] = False
        memo[n] = _size_value(n) is not None or (
            n.op in ("call_function", "call_method") and not impure(n)
            and all(_constant(a, memo) for a in n.all_input_nodes))
    return memo[n]


class _Form:
    """One candidate: the chunked inputs, the merged output, and the nodes between."""

    def __init__(self, graph, sources, out, out_dim):
        self.sources, self.out, self.out_dim = sources, out, out_dim
        order = {n: i for i, n in enumerate(graph.nodes)}
        src = set(sources)
        inner = (descendants(src) & ancestors([out])) - ancestors(src)
        # in-place masks of its tensors (`scores.masked_fill_(mask, 0)`, its value unused): no
        # data edge leads from them to the output, but they are part of what it computes
        for n in graph.nodes:
            if _name(n) in _INPLACE_MASKS and mutated(n) in inner:
                inner.add(n)
        self.nodes = sorted(inner, key=order.__getitem__)
        # what the region replaces: the nodes read by each other alone (the in-place writes among
        # them too, which dead-code elimination would keep), erased last to first after `out`
        dead = inner - {out}
        while True:
            used = {n for n in dead if any(u not in dead and u is not out for u in n.users)}
            if not used:
                break
            dead -= used
        self.dead = sorted(dead, key=order.__getitem__)
        memo: dict = {}
        self.init = None                # a tensor from outside: at most one, the initial state
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a in inner or a in src or _constant(a, memo):
                    continue
                if self.init not in (None, a) or not isinstance(value(a), torch.Tensor):
                    raise NotTaken(f"{n.name} reads {a.name}, which is neither a chunked input nor a constant "
                                   f"nor the one initial state{f' ({self.init.name})' if self.init else ''}")
                self.init = a
        # values computed from its inside alone and used after it (HF's `new_states[:, -1]` for
        # the cache): each must be the final state, which the evaluation checks with the roles
        grown = set(inner) - {out}
        for n in graph.nodes:
            if (n not in inner and n.op in ("call_function", "call_method") and not impure(n)
                    and any(a in grown for a in n.all_input_nodes)
                    and all(a in grown or _constant(a, memo) for a in n.all_input_nodes)):
                grown.add(n)
        self.derived = sorted(grown - inner, key=order.__getitem__)
        self.consts = sorted((a for a, c in memo.items() if c), key=order.__getitem__)
        self.extra = [n for n in sorted(grown, key=order.__getitem__)
                      if any(u not in grown and u is not out for u in n.users)]
        self.used = [s for s in sources if any(u in inner for u in s.users)]
        later = [u for n in self.extra for u in n.users if u not in grown and u is not out]
        self.anchor = min([out, *later], key=order.__getitem__)
        late = [s for s in [*self.used, *([self.init] if self.init is not None else [])]
                if order[s] > order[self.anchor]]
        if late:
            raise NotTaken(f"its final state is used (by {self.anchor.name}) before {late[0].name} is computed")
        # the region reads its inputs at the anchor: nothing may write in place before that, but
        # for a mask on a form's own new tensor (`scores.masked_fill_(mask, 0)`), which no input
        # aliases
        first = order[self.nodes[0]] if self.nodes else order[out]
        for n in graph.nodes:
            m = mutated(n)
            if first <= order[n] < order[self.anchor] and m is not None \
                    and not (_name(n) in _INPLACE_MASKS and m in inner and _name(m) in _FRESH):
                raise NotTaken(f"{n.name} writes in place among its nodes")

    def evaluate(self, values: dict) -> dict:
        """The output's and the extras' values for real `values` of the sources, node by node
        (each value dropped after its last use: the graph's intermediates can be large)."""
        order = [*self.consts, *self.nodes, *self.derived]
        keep, consts = {self.out, *self.extra}, set(self.consts)
        last = {a: i for i, n in enumerate(order) for a in n.all_input_nodes}
        env = dict(values)
        for i, n in enumerate(order):
            if n in consts and _size_value(n) is not None:
                env[n] = _size_value(n)
                continue
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            else:
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
            for a in n.all_input_nodes:
                if last.get(a) == i and a not in keep and a not in values:
                    del env[a]
        return env


def _scan_rows(a, x, B, C, rows, h0=None):
    """The scan's outputs for the flat batch rows `rows` (time first, float64, on the CPU) and
    its final state, from the state `h0` (rows, p, n) or zeros."""
    a, x, B, C = (t[:, rows].double().cpu() for t in (a, x, B, C))
    h = torch.zeros(len(rows), x.shape[-1], B.shape[-1], dtype=torch.float64) if h0 is None else h0[rows]
    ys = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # thousands of tiny ops: threads only wait on each other
    try:
        da = torch.exp(a)
        for t in range(a.shape[0]):
            h = da[t][:, None, None] * h + x[t][:, :, None] * B[t][:, None, :]
            ys.append((h * C[t][:, None, :]).sum(-1))
    finally:
        torch.set_num_threads(threads)
    return torch.stack(ys), h


def _unit_dims(have: tuple, want: tuple) -> list | None:
    """The dims of size 1 to drop from `have` to get `want`, or None if that does not do it."""
    drop, j = [], 0
    for i, d in enumerate(have):
        if j < len(want) and d == want[j]:
            j += 1
        elif d == 1:
            drop.append(i)
        else:
            return None
    return drop if j == len(want) else None


def _close(got, want, tol: float) -> bool:
    return bool((got - want).norm() <= tol * want.norm())


def _decays(shp: tuple, dim: int, T: int, gen) -> torch.Tensor:
    """Log-decays for the proof, their scale varying over the batch rows from about -2 over the
    whole length (every chunk's state reaches the later ones) to about -0.5 a step (a decay off by
    one step is far off)."""
    a = -torch.rand(shp, generator=gen, dtype=torch.float64).movedim(dim, 0)
    rows = a[0].numel()
    lo, hi = torch.log(torch.tensor(4.0 / T)), torch.log(torch.tensor(1.0))
    scale = torch.exp(lo + (hi - lo) * torch.rand(rows, generator=gen, dtype=torch.float64))
    return (a.reshape(T, rows) * scale).reshape(a.shape).movedim(0, dim)


def _roles(form: _Form, dims: dict, T: int):
    """(a, x, B, C) among the sources, proven by evaluation; NotTaken if none fits."""
    S = {s: tuple(d for i, d in enumerate(_hshape(s)) if i != dims[s]) for s in form.used}
    y_shape = tuple(d for i, d in enumerate(_hshape(form.out)) if i != form.out_dim)
    dev = value(form.out).device
    # a graph that rounds to half precision inside is compared at that precision (the decays'
    # spread keeps a wrong structure far off, below)
    half = any(getattr(value(n), "dtype", None) in (torch.float16, torch.bfloat16)
               for n in [*form.nodes, *form.sources])
    tol = 3e-2 if half else 1e-4
    tried = 0
    # decays read from one of the inputs; with no segment sums, none (a = 0)
    for a in (form.used if form.decayed else [None]):
        batch = S[a] if a is not None else y_shape[:-1]
        rest = [s for s in form.used if s is not a]
        # each of the others plays one role; B and C may be one tensor (tied)
        fits = [(x, B, C) for x, B, C in itertools.product(rest, repeat=3)
                if {x, B, C} == set(rest) and x not in (B, C) and y_shape[:-1] == batch
                and S[x] == y_shape and S[B][:-1] == batch and S[C] == S[B]]
        if not fits:
            continue
        gen = torch.Generator().manual_seed(0)
        vals = {s: torch.randn(_hshape(s), generator=gen, dtype=torch.float64) for s in form.used}
        if a is not None:
            vals[a] = _decays(_hshape(a), dims[a], T, gen)
        if form.init is not None:
            vals[form.init] = torch.randn(_hshape(form.init), generator=gen, dtype=torch.float64)
        # float64 where the graph's inputs are; otherwise their own dtype (ops that do not promote
        # mix them with the graph's constants), the reference reading the same rounded values
        wide = all(value(s).dtype == torch.float64 for s in vals)
        typed = {s: v if wide else v.to(value(s).dtype) for s, v in vals.items()}
        vals = {s: v.double() for s, v in typed.items()}
        try:
            env = form.evaluate({s: v.to(dev) for s, v in typed.items()})
        except Exception as e:      # noqa: BLE001 - the graph's own error, reported
            raise NotTaken(f"evaluating it failed: {type(e).__name__}: {e}") from e
        got = env[form.out]
        n_rows = got.numel() // (T * y_shape[-1])
        got = got.movedim(form.out_dim, 0).reshape(T, n_rows, -1).double().cpu()
        rows = torch.randperm(n_rows, generator=gen)[:8]
        for x, B, C in fits:
            ts = [vals[s].movedim(dims[s], 0) for s in (x, B, C)]
            ts.insert(0, ts[0].new_zeros(T, *batch) if a is None else vals[a].movedim(dims[a], 0))
            p, n = S[x][-1], S[B][-1]
            # a state from outside or read after: batch dims then (p, n), or (n, p) (flipped)
            for flip in ((False, True) if form.init is not None else (False,)):
                h0 = None
                if form.init is not None:
                    if _unit_dims(_hshape(form.init), (*batch, *((n, p) if flip else (p, n)))) is None:
                        continue
                    h0 = vals[form.init].reshape(n_rows, *((n, p) if flip else (p, n)))
                    h0 = h0.transpose(1, 2) if flip else h0
                want, last = _scan_rows(*(t.reshape(T, n_rows, *t.shape[1 + len(batch):]) for t in ts), rows, h0)
                tried += 1
                if not _close(got[:, rows], want, tol):
                    continue
                form.init_flip, form.extra_flip = flip, {}
                for e in form.extra:
                    for ef in (False, True):
                        v = env[e]
                        if tuple(v.shape) == (*batch, *((n, p) if ef else (p, n))):
                            v = v.reshape(n_rows, *((n, p) if ef else (p, n)))[rows].double().cpu()
                            if _close(v.transpose(1, 2) if ef else v, last, tol):
                                form.extra_flip[e] = ef
                                break
                    else:
                        raise NotTaken(f"{e.name} is used after it and is not its final state")
                return a, x, B, C
    if tried:
        h0 = f" from the state {form.init.name}" if form.init is not None else ""
        scan = "h = exp(a) h + x B^T" if form.decayed else "h = h + x B^T"
        raise NotTaken(f"it is not the scan {scan}, y = h C{h0} for any assignment of its inputs "
                       f"({tried} tried against a random evaluation)")
    if form.decayed:
        raise NotTaken("its inputs' shapes fit no (a, x, B, C) of the scan (a: batch dims, x and y: batch + p, "
                       "B and C: batch + n)")
    raise NotTaken("its inputs' shapes fit no (x, B, C) of the scan h = h + x B^T, y = h C (x and y: batch + p, "
                   "B and C: batch + n)")


_SCALE_OPS = {"mul", "truediv", "div"}
_CHAIN_VIEWS = _VIEWS | {"permute", "transpose", "movedim", "contiguous", "unsqueeze", "squeeze"}


def _hoist_scales(graph: fx.Graph, cs: int) -> None:
    """A chunk split whose views lead, each their only user, to a product with a number
    (`rearrange(q, "b (n c) h d -> b h n c d") * scale`): the product moves before the split,
    onto the tensor split (the same values), so that the scaled tensor is the form's input."""
    for v in list(graph.nodes):
        if not _is_view(v) or _split_dim(_hshape(v.args[0]), _hshape(v), cs) is None:
            continue
        n = v
        while len(n.users) == 1:
            u = next(iter(n.users))
            name = _name(u) if u.op in ("call_function", "call_method") else ""
            if name in _CHAIN_VIEWS and u.args and u.args[0] is n:
                n = u
                continue
            num = [a for a in u.args if not isinstance(a, fx.Node)]
            src = v.args[0]
            if (name in _SCALE_OPS and len(u.args) == 2 and not u.kwargs and len(num) == 1
                    and isinstance(num[0], (int, float)) and not isinstance(num[0], bool)
                    and (name == "mul" or u.args[0] is n) and getattr(value(src), "is_floating_point", lambda: False)()
                    and value(u).dtype == value(src).dtype):
                args = tuple(src if a is n else a for a in u.args)
                with graph.inserting_before(v):
                    m = graph.call_function(u.target, args) if u.op == "call_function" else \
                        graph.call_method(u.target, args)
                _Builder(graph, _fake_mode(graph)).example(m)
                v.replace_input_with(src, m)
                u.replace_all_uses_with(n)
                graph.erase_node(u)
            break


def find_forms(graph: fx.Graph) -> list[tuple[_Form | None, str]]:
    """Candidates (form, "") and the reasons forms were found but not taken (None, reason)."""
    out, taken = [], set()
    sums, masks = _segment_sums(graph), _zero_masks(graph)
    sizes = sorted({_hshape(e)[-1] for e in [*sums, *masks] if len(_hshape(e)) >= 2})
    for cs in sizes:
        _hoist_scales(graph, cs)
        sources, dims = [], {}
        for n in graph.nodes:
            if _is_view(n):
                d = _split_dim(_hshape(n.args[0]), _hshape(n), cs)
                if d is not None and n.args[0] not in dims:
                    sources.append(n.args[0])
                    dims[n.args[0]] = d
        if not sources:
            continue
        lengths = {_hshape(s)[dims[s]] for s in sources}
        below = descendants(sources)
        merges = []
        for n in graph.nodes:
            if n in below and _is_view(n) and n not in dims:
                d = _split_dim(_hshape(n), _hshape(n.args[0]), cs)
                if d is not None and _hshape(n)[d] in lengths:
                    merges.append((n, d))
        for m, d in merges:
            T = _hshape(m)[d]
            above = ancestors([m])
            srcs = [s for s in sources if _hshape(s)[dims[s]] == T and s in above]
            if not any(_hshape(e)[-1] == cs for e in sums):
                # zero masks only: scores of chunked inputs (x and B are two of them) over two
                # chunks or more; a mask over one chunk, or one not computed from the chunks, is an
                # attention's (HF models: a position bias between a (b * L) -> (b, L) cut and back)
                reached = descendants(srcs)
                if len(srcs) < 2 or T < 2 * cs or not any(
                        _hshape(e)[-1] == cs and e in reached and (mutated(e) or e) in above for e in masks):
                    continue
            try:
                form = _Form(graph, srcs, m, d)
                inside = set(form.nodes)
                form.decayed = any(e in inside for e in sums)
                if not (form.decayed or any(e in inside for e in masks)) or taken & inside:
                    continue            # no anchor of its own, or inside a form already taken
                form.roles = _roles(form, dims, T)
                form.dims, form.length = dims, T
                out.append((form, ""))
                taken |= {*form.nodes, *form.derived}
            except NotTaken as e:
                out.append((None, f"{m.name}: a chunked scan in parallel form (chunks of {cs}) not taken: {e}"))
    return out


def loop_from_form(gm: fx.GraphModule, form: _Form) -> Loop:
    """The step h = exp(a) h + x B^T (h = h + x B^T without decays), y = h C over the form's
    chunked inputs."""
    a, x, B, C = form.roles
    srcs = [s for s in (a, x, B, C) if s is not None]
    body = fx.Graph()
    b = _Builder(body, _fake_mode(gm.graph))
    h = body.placeholder("carry_0")
    reads = [body.placeholder(f"read_{i}") for i in range(len(srcs))]
    with b.mode if b.mode is not None else contextlib.nullcontext():
        for ph, src in zip(reads, srcs):
            ph.meta["example_value"] = torch.select(value(src), form.dims[src], 0)
        xv, Bv = reads[-3].meta["example_value"], reads[-2].meta["example_value"]
        h.meta["example_value"] = xv[..., :, None] * Bv[..., None, :]
    rx, rB, rC = reads[-3:]
    xB = b.call(None, torch.mul, (b.call(None, torch.unsqueeze, (rx, -1)), b.call(None, torch.unsqueeze, (rB, -2))))
    if a is None:
        new = b.call(None, torch.add, (h, xB))
    else:
        dA = b.call(None, torch.exp, (reads[0],))
        dA = b.call(None, torch.unsqueeze, (b.call(None, torch.unsqueeze, (dA, -1)), -1))
        new = b.call(None, torch.add, (b.call(None, torch.mul, (dA, h)), xB))
    y = b.call(None, torch.sum, (b.call(None, torch.mul, (new, b.call(None, torch.unsqueeze, (rC, -2)))), -1))
    results, lasts = [Result("steps", "stack", form.out_dim, [form.out])], []
    for flip in (False, True):         # the final state, however many nodes hold it, per layout
        held = [e for e in form.extra if form.extra_flip[e] == flip]
        if held:
            results.append(Result("last", replace=held))
            lasts.append(b.call(None, torch.transpose, (new, -1, -2)) if flip else new)
    body.output((new, y, *lasts))
    fixed = all(isinstance(shape(s)[form.dims[s]], int) for s in srcs)
    init, made = None, []
    if form.init is not None:          # the initial state as the carry's shape
        init = form.init
        hs = _hint(value(h).shape)
        outer = _Builder(gm.graph, b.mode)
        for d in reversed(_unit_dims(_hshape(init), (*hs[:-2], hs[-1], hs[-2]) if form.init_flip else hs)):
            init = outer.call(form.anchor, torch.squeeze, (init, d))
            made.append(init)
        if form.init_flip:
            init = outer.call(form.anchor, torch.transpose, (init, -1, -2))
            made.append(init)
    return Loop("", fx.GraphModule(gm, body), form.length if fixed else None, [init],
                [Read(s, form.dims[s], 0) for s in srcs], [], results, erase=[*form.dead, form.out], anchor=form.anchor,
                origin="chunked SSD in parallel form" if a is not None else "chunked linear attention in parallel form",
                made=made)

