"""Random delta-rule programs for the fuzzer, written out as Python source as a user would write
them: the matrix state S (b, h, dk, dv) or transposed (b, h, dv, dk), inputs laid out (b, h, L, d)
or fla's (b, L, h, d), a decay (none, a scalar per head, a vector along dk), k^T S spelled as a
broadcast sum, a mean, an einsum or a matmul, the rank-1 update with beta folded in or expanded
(or no beta), a readout with q as a sum or an einsum (or none: the final state only), outputs
stacked or written into a buffer, a zero or given initial state. Non-linear ones pass k^T S
through tanh (ssmc must leave them alone).
"""
from __future__ import annotations

import dataclasses
import textwrap

import torch
import torch.nn.functional as F  # noqa: F401  (used by generated code)
from hypothesis import strategies as st

@dataclasses.dataclass
class DeltaProgram:
    source: str
    shapes: dict            # input name -> shape
    linear: bool

    def make(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        out = []
        for name, shp in self.shapes.items():
            x = torch.randn(*shp, generator=g)
            if name == "k":
                x = x / shp[-1] ** 0.5
            elif name in ("g", "gk"):
                x = -x.abs() * 0.3
            out.append(x)
        return out

    def fn(self):
        ns = {"torch": torch, "F": F}
        exec(self.source, ns)
        return ns["program"]


@st.composite
def delta_programs(draw, linear=None):
    L = draw(st.integers(2, 7))
    B, H = draw(st.sampled_from([2, 2, 1])), draw(st.sampled_from([2, 2, 1]))     # sizes of 1 too (Dynamo specialises them)
    dk, dv = draw(st.sampled_from([3, 4])), draw(st.sampled_from([2, 5]))
    fla = draw(st.booleans())                          # inputs (b, L, h, d), else (b, h, L, d)
    tr = draw(st.booleans())                           # S laid out (b, h, dv, dk)
    decay = draw(st.sampled_from(["none", "head", "head_sigmoid", "dk"]))
    kv_form = draw(st.sampled_from(["sum", "mean", "einsum", "matmul"]))
    update = draw(st.sampled_from(["delta", "expanded", "no_beta"]))
    readout = draw(st.sampled_from(["sum", "einsum", "none"]))
    collect = draw(st.sampled_from(["stack", "setitem"]))
    init = draw(st.booleans())
    is_linear = draw(st.booleans()) if linear is None else linear

    seq = (lambda d: (B, L, H, d)) if fla else (lambda d: (B, H, L, d))
    at = "[:, t]" if fla else "[:, :, t]"              # a step of a per-step input: (b, h[, d])
    tdim = 1 if fla else 2
    shapes = {"q": seq(dk), "k": seq(dk), "v": seq(dv), "beta": seq(1)[:-1]}
    if decay in ("head", "head_sigmoid"):
        shapes["g"] = seq(1)[:-1]
    elif decay == "dk":
        shapes["gk"] = seq(dk)
    kd = -1 if tr else -2                              # S's dk dim
    col = (lambda x: f"{x}[..., None, :]") if tr else (lambda x: f"{x}[..., :, None]")      # along dk
    row = (lambda x: f"{x}[..., :, None]") if tr else (lambda x: f"{x}[..., None, :]")      # along dv
    sub = "bhvk" if tr else "bhkv"

    def read(x):                                       # x^T S: (b, h, dv)
        if kv_form == "sum":
            return f"(S * {col(x)}).sum({kd})"
        if kv_form == "mean":
            return f"(S * {col(x)}).mean({kd}) * {dk}"
        if kv_form == "einsum":
            return f'torch.einsum("bhk,{sub}->bhv", {x}, S)'
        return f"(S @ {x}.unsqueeze(-1)).squeeze(-1)" if tr else f"({x}.unsqueeze(-2) @ S).squeeze(-2)"

    body = ["q_t, k_t, v_t = q" + at + ", k" + at + ", v" + at, "beta_t = torch.sigmoid(beta" + at + ")"]
    if decay == "head":
        body.append("S = S * torch.exp(g" + at + ")[..., None, None]")
    elif decay == "head_sigmoid":
        body.append("S = S * torch.sigmoid(g" + at + ")[..., None, None]")
    elif decay == "dk":
        body.append("S = S * " + col("torch.exp(gk" + at + ")"))
    kv = read("k_t")
    body.append(f"kv = {kv}" if is_linear else f"kv = torch.tanh({kv})")
    if update == "delta":
        body.append(f"S = S + {col('k_t')} * {row('(beta_t[..., None] * (v_t - kv))')}")
    elif update == "expanded":
        body.append(f"S = S - beta_t[..., None, None] * {col('k_t')} * {row('kv')} "
                    f"+ beta_t[..., None, None] * {col('k_t')} * {row('v_t')}")
    else:
        body.append(f"S = S + {col('k_t')} * {row('(v_t - kv)')}")
    shape_S = f"(q.shape[0], {H}, {dv}, {dk})" if tr else f"(q.shape[0], {H}, {dk}, {dv})"
    head = ["S = S0" if init else f"S = q.new_zeros{shape_S}"]
    rets = []
    if readout != "none":
        o = (f"(S * {col('q_t')}).sum({kd})" if readout == "sum"
             else f'torch.einsum("bhk,{sub}->bhv", q_t, S)')
        if collect == "stack":
            head.append("ys = []")
            body.append(f"ys.append({o})")
            rets.append(f"torch.stack(ys, {tdim})")
        else:
            head.append("out = v.new_empty(v.shape)")
            body.append(f"out{at} = {o}")
            rets.append("out")
    if readout == "none" or draw(st.booleans()):
        rets.append("S")
    lines = head + [f"for t in range(q.shape[{tdim}]):"] + ["    " + b for b in body] + ["return " + ", ".join(rets)]
    args = list(shapes) + (["S0"] if init else [])
    if init:
        shapes["S0"] = (B, H, dv, dk) if tr else (B, H, dk, dv)
    src = "def program(" + ", ".join(args) + "):\n" + textwrap.indent("\n".join(lines), "    ")
    return DeltaProgram(src, shapes, is_linear)
