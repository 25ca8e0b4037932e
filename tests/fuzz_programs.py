"""Random naive recurrent programs for the fuzzer, written out as Python source so Dynamo
traces them exactly as it would a user's code.

A program has a state of random rank (b, d[, n[, m]]), per-step inputs with random broadcast
patterns, random decay / drive / epilogue expressions, a random capture form, a loop over
increasing or (a quarter of them) decreasing t, the readout after the update or (a quarter) of
the state before it, and is either a
linear recurrence (ssmc must compile it and match eager) or deliberately not one (ssmc must
leave it alone). Tensors it creates live on its first input's device, so the same program runs
on CPU or CUDA inputs. `programs(dtypes=...)` picks the dtypes drawn from (default fp32, fp32,
fp64, the CPU test's); bf16 programs either run in bf16 throughout or read bf16 inputs with
`.float()` and keep an fp32 state (drawn per program). Lengths are 2..6 (`max_len` > 6: half
of them 7..max_len, so that kernels working in chunks of time carry state across chunks).
"""
from __future__ import annotations

import dataclasses
import textwrap

import torch
import torch.nn.functional as F  # noqa: F401  (used by generated code)
from hypothesis import strategies as st

FORMS = ["stack", "cat", "setitem", "unbind", "final", "h0", "scan", "after", "after_setitem"]
# "after": the loop stacks its states and the work on them follows the loop ({x}: the stacked
# states (b, L, *state), {u}: an input, time at dim 1 too); "after_setitem": the states are
# written into a buffer step by step instead
AFTER = ["({x} * {u}).sum(-1)", "{x}[:, -1]", "({x} * {u}).sum(-1, keepdim=True) + {u}",
         "{x}.transpose(1, 2)[:, :, -1] * 2.0", "{x}.mean(1)", "torch.tanh({x}) * {u}",
         "({x} * {u}).sum(-1).movedim(1, 0) * 2.0", "({x}.movedim(1, 0) * {u}.movedim(1, 0)).sum(-1) + 1.0",
         "{x}[:, -1] + ({x} * {u}).sum(1)", "{x}[:, -1].sum(-1) * 3.0 + {x}[:, 0].sum(-1)",
         "{x} * {u} + 1.0", "torch.exp(-torch.abs({x})) * 2.0"]      # elementwise over every step
UNARY_SAFE = ["torch.tanh({})", "torch.sigmoid({})", "F.silu({})", "torch.sin({})",
              "(0.5 * {})", "F.softplus({})", "torch.exp(-torch.abs({}))", "torch.sqrt(1.0 + {} * {})"]
BINARY = ["({} + {})", "({} * {})", "({} - {})", "torch.maximum({}, {})", "({} / (1.5 + torch.abs({})))"]
DECAYS = ["torch.sigmoid({})", "torch.exp(-F.softplus({}))", "torch.exp({} * A)", "0.9",
          "(1 - torch.sigmoid({}))", "torch.exp(-torch.exp({}))"]


@dataclasses.dataclass
class Program:
    source: str
    shapes: dict            # input name -> shape (time dim included for per-step inputs)
    linear: bool
    form: str
    dtype: torch.dtype
    L: int
    state_dtype: torch.dtype | None = None   # dtype of the state and an h0 input (None: dtype)

    def make(self, seed: int, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        out = []
        for name, shp in self.shapes.items():
            x = torch.randn(*shp, generator=g)
            if name == "A":
                x = -x.abs() - 0.1
            dt = (self.state_dtype or self.dtype) if name == "h0" else self.dtype
            out.append(x.to(dt).to(device))
        return out

    def fn(self, source: str | None = None):
        ns = {"torch": torch, "F": F}
        exec(source or self.source, ns)
        return ns["program"]

    def ref_fn(self):
        """The program with its explicit fp32 casts and fp32 tensors made fp64: called on fp64
        inputs, every step runs in fp64 (the reference)."""
        return self.fn(self.source.replace(".float()", ".double()").replace("torch.float32", "torch.float64"))


@st.composite
def programs(draw, linear=None, dtypes=None, max_len=6):
    rank = draw(st.integers(2, 4))
    sizes = [draw(st.sampled_from([2, 2, 1])), 3, 4, 2][:rank]    # (b, d, n, m); batch 1 too
    if max_len <= 6:
        L = draw(st.integers(2, max_len))
    else:                                            # half short, half long enough for several chunks
        L = draw(st.one_of(st.integers(2, 6), st.integers(7, max_len)))
    form = draw(st.sampled_from(FORMS))
    dtype = draw(st.sampled_from(dtypes or [torch.float32, torch.float32, torch.float64]))
    cast = dtype == torch.bfloat16 and draw(st.booleans())   # bf16 inputs, fp32 state
    is_linear = draw(st.booleans()) if linear is None else linear
    n_in = draw(st.integers(1, 3))
    shapes, names = {}, []
    for i in range(n_in):
        # which state axes this per-step input varies along (batch always)
        keep = [0] + [k for k in range(1, rank) if draw(st.booleans())]
        shp = [sizes[k] if k in keep else 1 for k in range(rank)]
        shapes[f"u{i}"] = (shp[0], L, *shp[1:])      # time at dim 1
        names.append(f"u{i}")
    shapes["A"] = tuple(sizes[1:rank]) if rank > 1 else (1,)

    def step(name):                                   # the value of input `name` at step t
        return f"{name}[:, t]" + (".float()" if cast else "")

    def leaf():
        return step(draw(st.sampled_from(names)))

    def expr(depth):
        if depth == 0 or draw(st.integers(0, 2)) == 0:
            return leaf()
        if draw(st.booleans()):
            e = expr(depth - 1)
            return draw(st.sampled_from(UNARY_SAFE)).format(e, e)
        a, b = expr(depth - 1), expr(depth - 1)
        return draw(st.sampled_from(BINARY)).format(a, b)

    decay = draw(st.sampled_from(DECAYS)).format(expr(1))
    drive = expr(2)
    if is_linear:
        update = draw(st.sampled_from(["h = {a} * h + {b}", "h = ({b}) + h * {a}",
                                       "h = {a} * (h - {b}) + {b}", "h = h * {a} - (-{b})"]))
    else:
        update = draw(st.sampled_from(["h = torch.tanh({a} * h + {b})", "h = {a} * h * h + {b}",
                                       "h = torch.sigmoid(h) * h + {b}", "h = {a} * torch.abs(h) + {b}"]))
    update = update.format(a=decay, b=drive)
    readout = draw(st.sampled_from(["h", "(h * {c}).sum(-1)", "torch.tanh(h) * {c}", "h * 2.0 + {c}",
                                    "F.silu({c}) * h"])).format(c=leaf())
    if rank == 2 and ".sum(-1)" in readout or form.startswith("after"):
        readout = "h"
    state = ", ".join(["u0.shape[0]"] + [str(s) for s in sizes[1:rank]])
    # the readout of the state before its update (the bare state only from 4 steps on: the
    # last update feeds nothing and is not in the graph, so a loop of 3 leaves two updates, cut
    # later one, which run as written)
    early = form != "scan" and (readout != "h" or L >= 4) and draw(st.integers(0, 3)) == 0
    body = f"y = {readout}\n{update}" if early else f"{update}\ny = {readout}"
    sdt = "torch.float32" if cast else "u0.dtype"
    zeros = f"torch.zeros({state}, dtype={sdt}, device=u0.device)"
    if form == "scan":
        upd = update.replace("[:, t]", "")
        ro = readout.replace("[:, t]", "")
        src = "\n".join([
            "from torch._higher_order_ops.scan import scan",
            f"def program({', '.join(shapes)}):",
            "    def step(h, xs):",
            f"        {', '.join(names)}, = xs",
            f"        {upd}",
            f"        y = {ro}",
            "        return h, y + 0.0",
            f"    h, ys = scan(step, {zeros}, ({', '.join(names)},), dim=1)",
            "    if ys.shape[1] != u0.shape[1]:",
            "        ys = ys.movedim(0, 1)",
            "    return ys, h"])
    else:
        head = {"stack": "ys = []", "cat": "ys = []", "unbind": "ys = []", "final": "ys = []",
                "h0": "ys = []", "setitem": None, "after": "ys = []", "after_setitem": None}[form]
        backward = form != "unbind" and draw(st.integers(0, 3)) == 0       # over decreasing t
        loop = "for t in range(u0.shape[1] - 1, -1, -1):" if backward else "for t in range(u0.shape[1]):"
        init = zeros if form != "h0" else "h0"
        lines = [f"h = {init}"]
        if form in ("setitem", "after_setitem"):
            ysz = sizes[1:rank] if ".sum(-1)" not in readout else sizes[1:rank - 1]
            lines.append(f"out = torch.empty(u0.shape[0], u0.shape[1], {', '.join(map(str, ysz))}, dtype={sdt}, device=u0.device)")
        else:
            lines.append(head)
        lines.append(loop)
        lines += ["    " + l for l in body.splitlines()]
        if form == "setitem":
            lines += ["    out[:, t] = y"]
            ret = "return out"
        elif form == "after_setitem":
            lines += ["    out[:, t] = y"]
            ret = "return " + draw(st.sampled_from(AFTER)).format(x="out", u=leaf().replace("[:, t]", ""))
        elif form == "cat":
            lines.append("    ys.append(y.unsqueeze(1))")
            ret = "return torch.cat(ys, 1)"
        elif form in ("final", "h0"):
            lines.append("    ys.append(y)")
            ret = "return torch.stack(ys, 1), h"
        elif form == "after":
            lines.append("    ys.append(y)")
            after = draw(st.sampled_from(AFTER)).format(x="hs", u=leaf().replace("[:, t]", ""))
            ret = f"hs = torch.stack(ys, 1)\nreturn {after}"
        else:
            lines.append("    ys.append(y)")
            ret = "return torch.stack(ys, 1)"
        if form == "unbind":
            its = ", ".join(f"{n}.unbind(1)" for n in names)
            lines[2] = f"for t, ({', '.join(n + '_t' for n in names)},) in enumerate(zip({its})):"
            lines = [l.replace("[:, t]", "_t") if i > 2 else l for i, l in enumerate(lines)]
            lines = [l.replace("u0_t.shape", "u0.shape") for l in lines]
        lines.append(ret)
        args = list(shapes) + (["h0"] if form == "h0" else [])
        src = "def program(" + ", ".join(args) + "):\n" + textwrap.indent("\n".join(lines), "    ")
        if form == "h0":
            shapes["h0"] = (sizes[0], *sizes[1:rank])
    return Program(src, shapes, is_linear, form, dtype, L, torch.float32 if cast else None)
