"""The Triton kernel of strategy "rank_one": a recurrence whose transition is one product
u w^T along a state axis, or a sum of a few (templates/triton/rank_one_fwd.py.j2): the delta
rule's S - beta k (k^T S) and its gated, per-channel-decay and DPLR relatives, DeltaProduct's
Householder updates, as detect_recurrence finds them (`reference.low_rank`).

M h is sum_r u_r (w_r . h): a dot product a row, term and step, O(n) instead of the (n, n) matrix. The
kernel runs the region with the mixed axis last (`Region.mixed_last`; a delta rule's state
(b, h, dk, dv) is mixed along dk): that axis is held whole per row and summed by the
readout, the other state axes are parallel as in the selective-scan kernel (a channel axis
blocked by BLOCK_D rows, one program per index of the rest). The caller's initial state is
passed as a permuted view, so nothing is copied.

Backward: `ssmc.targets.mix_adjoint`, its three scans (a chunk's last state, its states, lam
with the transposed product w u^T, which this kernel runs from the last step back through
negated time strides: `walks_back`) on kernels of this class, the gradients by torch ops and
`mul_sum` passes (the rank-one sums of `_rank_one_grads`, no outer product).
"""
from __future__ import annotations

import dataclasses
import functools

from ssmc.ir import Region

from . import triton as T
from .reference import low_rank
from .triton_block_sparse import mixed_layout
from .triton_ssd import _table

TEMPLATE = "triton/rank_one_fwd.py.j2"
CONFIGS = "triton/rank_one_fwd.configs.json"


@dataclasses.dataclass(frozen=True)
class RankOnePlan(T.Plan):
    terms: tuple = ()               # (u, w): the row factor (free of the column axis) and the
                                    # column factor (free of the row axis) of each product


def make_rank_one_plan(r: Region) -> RankOnePlan | str:
    """The plan for `r` with its mixed axis last (the caller moves it), or why not."""
    if r.mix is None:
        return "no non-diagonal transition"
    last = r.axes[-1]
    if r.mix_axis != last:
        return f"the transition acts along {r.mix_axis}: run Region.mixed_last first"
    terms = low_rank(r.mix.expr, last)
    if terms is None:
        return "the transition is not a sum of a few products u w^T of a row part and a column part"
    got = mixed_layout(r, drive_sums=True)
    if isinstance(got, str):
        return got
    return RankOnePlan(last, *got, tuple(terms))


def render(r: Region, plan: RankOnePlan, cdt: str) -> str:
    v = T._print_variant(r, plan, cdt, False, also=tuple(e for uw in plan.terms for e in uw))
    base = T.Plan(plan.reg, plan.block, plan.scalars, plan.inputs)
    return T._env().get_template(TEMPLATE).render(
        region_name=r.name, region_key=r.key(), region_text=str(r), cdt=cdt, kname=T.kernel_name(r),
        plan=base, args=T.arg_lines(T.kernel_args(r, base)), v=v)


class RankOneKernel(T.MixedLast, T.TritonKernel):
    """Forward of a rank-one recurrence. `region` is the caller's (mixed along any state axis);
    the kernel holds it with that axis last (``self.region``) and ``perm``, the permutation of
    the state dims that takes the caller's initial state to the kernel's."""
    kind = "rank-one recurrence"
    template = TEMPLATE
    configs_file = CONFIGS

    def __init__(self, region: Region, strategy: str, options, arch):
        self.given = region
        moved, self.perm = region.mixed_last()
        plan = make_rank_one_plan(moved)
        if isinstance(plan, str):
            raise ValueError(f"triton target cannot compile region {region.name}: {plan}")
        super().__init__(moved, strategy, plan, options, arch)

    def table(self) -> dict:
        return _table(CONFIGS)

    def _render(self, cdt: str) -> str:
        return render(self.region, self.plan, cdt)

    def plan_text(self) -> str:
        p = self.plan
        moved = "" if self.given.mix_axis == p.reg and self.given.axes[-1] == p.reg else \
            f" (moved last from the caller's layout, permutation {list(self.perm)})"
        what = "u (w . h)" if len(p.terms) == 1 else f"a sum of {len(p.terms)} products u (w . h)"
        return (f"rank-one transition {what} along {p.reg}, held whole per row{moved}; channel axis "
                f"{p.block}, one program per index of {list(p.scalars)}")

    def candidates(self, inputs, arch) -> list[dict]:
        sizes, L = self.sizes(inputs)
        bd = T._pow2(sizes[self.plan.block]) if self.plan.block else 1
        out = []
        for c in self.table()[T.arch_key(arch)]:
            c = {**c, "BLOCK_D": max(1, min(int(c["BLOCK_D"]), bd)), "CHUNK": max(1, min(int(c["CHUNK"]), T._pow2(L)))}
            if c not in out:
                out.append(c)
        return out

    def constexprs(self, inputs, config) -> dict:
        sizes, _ = self.sizes(inputs)
        return {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": T._pow2(sizes[self.plan.reg]), "CHUNK": config["CHUNK"]}

    def signature(self, config: dict, block_n: int = 16, dtypes: dict | None = None):
        fn, sig, _ = super().signature({**config, "variant": "r1"}, block_n, dtypes)
        cx = {"BLOCK_D": config["BLOCK_D"], "BLOCK_N": block_n, "CHUNK": config["CHUNK"]}
        sig.update({k: "constexpr" for k in cx})
        return fn, sig, cx

    walks_back = True     # forward(..., backwards=, out=) runs time backwards without copies

    def forward(self, inputs, backwards: dict | None = None, out: list | None = None):
        """The outputs; with ``backwards`` ({input: time dim}, as `mix_adjoint.walk` passes it)
        the steps run from the last to the first: those inputs and the per-step outputs are
        passed at their last step with the time stride negated (nothing flipped or copied), the
        outputs written into ``out`` where given, in the inputs' time order. Calls the kernel
        does not run go to the reference on flipped copies (`mix_adjoint._flipped`)."""
        ins = self.moved(inputs)
        if backwards is None and out is None:
            return super().forward(ins)
        from .mix_adjoint import _flipped
        sizes, L = self.sizes(ins)
        dev = ins[0].device
        config = None
        if self._why_not(ins, sizes, L) is None:
            config = self._config(ins, T._arch(dev) if dev.type == "cuda" else None)
        fits = out is None or [(tuple(o.shape), o.dtype) for o in out] == self.output_specs(ins)
        if config is None or not fits:
            return _flipped(lambda xs: T.TritonKernel.forward(self, xs), self.region, ins, backwards, out)
        self.config = config
        outs = self.outputs(ins) if out is None else list(out)
        args, cx = self.call_args(ins, outs, config)
        if backwards is not None:
            args = self._walked(args, ins, outs, backwards)
        fn = self._fn(self._module(self._cdt(ins)), config["variant"])
        fn[self.grid(ins, config)](*args, **cx, **T.launch_options(config, dev))
        return outs

    def _walked(self, args: list, inputs, outs, backwards: dict) -> list:
        """`launch_args` with the inputs in `backwards` and the per-step outputs passed at their
        last step, their time strides negated."""
        args = list(args)
        tensors = [(inputs[i], backwards.get(i)) for i in self.plan.inputs]
        tensors += [(o, spec.index.index("t") if "t" in spec.index else None)
                    for o, spec in zip(outs, self.region.outputs)]
        pos = len(tensors)                       # the strides follow the pointers (`tensor_args`)
        for k, (x, d) in enumerate(tensors):
            if d is not None and x.shape[d] > 1:
                args[k] = x.narrow(d, x.shape[d] - 1, 1)
                args[pos + d] = -x.stride(d)
            pos += x.dim()
        return args

    def forward_train(self, inputs):
        return self.forward(inputs), []          # no checkpoints: the backward runs its own scans

    def backward_note(self) -> str:
        return self.scans.note("Triton rank-one")

    @functools.cached_property
    def scans(self):
        """The backward's derived regions (`ssmc.autodiff.chunk_scans`) on kernels like this one."""
        from .mix_adjoint import Scans
        return Scans(lambda r: RankOneKernel(r, self.strategy, self.options, self.arch))
