"""``torch.ops.ssmc.region``: one call per recurrence region, autograd included.

The graph holds only a key; the key names a `Compiled` entry (region IR + the target's kernel)
registered at compile time. The fake implementation gives output shapes from the region IR, so
AOTAutograd and Inductor can trace around the op; the backward is a second op,
``ssmc.region_bwd``, that the target implements from the same IR.

Training calls (an input needs a gradient) go through ``ssmc.region_train`` where the kernel
keeps a residual for its backward (`Compiled.residual_specs`: the Triton seq kernels'
checkpoints, so the backward need not run the forward recurrence again): the region's outputs,
then the residual, which autograd saves beside the inputs.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ssmc.ir import Region, to_dtype

_REGISTRY: dict[str, "Compiled"] = {}


@dataclasses.dataclass
class Compiled:
    key: str
    region: Region
    strategy: str
    target: str
    kernel: Any              # .forward(inputs) -> list[Tensor]; .backward(inputs, grads, needs)
    source: str | None = None
    failure: str | None = None   # set when the kernel failed at run time and the reference took over

    def output_shapes(self, inputs) -> list[tuple]:
        r = self.region
        sizes = {a: inputs[i].shape[d] for a, (i, d) in zip(r.axes, r.axis_size)}
        L = inputs[r.length[0]].shape[r.length[1]]
        return [tuple(L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index)
                for o in r.outputs]

    def empty_outputs(self, inputs) -> list[torch.Tensor]:
        dev = inputs[0].device
        return [torch.empty(s, dtype=to_dtype(o.dtype), device=dev)
                for s, o in zip(self.output_shapes(inputs), self.region.outputs)]

    def residual_specs(self, inputs) -> list[tuple]:
        """[(shape, dtype)] of what a training forward keeps for the backward ([]: nothing);
        the compiled kernel's, fixed when it was made: a kernel that later falls back to the
        reference still returns tensors of these shapes (with a flag that says they are empty)."""
        if "_residual" not in self.__dict__:
            self._residual = getattr(self.kernel, "residual_specs", None)
        return self._residual(inputs) if self._residual is not None else []


def register(entry: Compiled) -> str:
    _REGISTRY[entry.key] = entry
    return entry.key


def lookup(key: str) -> Compiled:
    try:
        return _REGISTRY[key]
    except KeyError:
        raise RuntimeError(f"ssmc: no compiled region {key!r} in this process") from None


def check_inputs(entry: Compiled, inputs) -> None:
    """Clear errors naming the bad argument instead of a crash deep inside a kernel. A call
    whose shapes, dtypes and devices passed before is not checked again."""
    sig = tuple((x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x) for x in inputs)
    checked = entry.__dict__.setdefault("_checked", set())
    if sig in checked:
        return
    _check_inputs(entry, inputs)
    if len(checked) < 1024:
        checked.add(sig)


def _check_inputs(entry: Compiled, inputs) -> None:
    r = entry.region
    if len(inputs) != len(r.inputs):
        raise ValueError(f"ssmc region {r.name}: expected {len(r.inputs)} inputs, got {len(inputs)}")
    dev = None
    loaded = {ld.input for ld in _all_loads(r)}
    for i, (x, spec) in enumerate(zip(inputs, r.inputs)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ssmc region {r.name}: input {i} ({spec.name}) is {type(x).__name__}, not a tensor")
        if x.dim() != spec.ndim:
            raise ValueError(f"ssmc region {r.name}: input {i} ({spec.name}) has {x.dim()} dims, expected {spec.ndim}")
        if x.is_complex() or not (x.is_floating_point() or x.dtype == torch.bool or i not in loaded):
            raise TypeError(f"ssmc region {r.name}: input {i} ({spec.name}) has unsupported dtype {x.dtype}")
        if dev is None:
            dev = x.device
        elif x.device != dev:
            raise ValueError(f"ssmc region {r.name}: input {i} ({spec.name}) is on {x.device}, "
                             f"input 0 ({r.inputs[0].name}) on {dev}")
    sizes: dict = {}
    for e in _all_loads(r):
        for d, ix in enumerate(e.index):
            if isinstance(ix, str):
                n = inputs[e.input].shape[d]
                if ix in sizes and sizes[ix][0] != n and n != 1:
                    raise ValueError(f"ssmc region {r.name}: input {e.input} ({r.inputs[e.input].name}) "
                                     f"has size {n} at dim {d} for axis {ix}, but input {sizes[ix][1]} has {sizes[ix][0]}")
                sizes.setdefault(ix, (n, e.input))


def _all_loads(r: Region):
    from ssmc.ir import loads
    out = loads(r.decay) + loads(r.drive) + (loads(r.mix.expr) if r.mix is not None else [])
    for o in r.outputs:
        out += loads(o.expr)
    return out


def _run(entry: Compiled, method: str, *args):
    """Run the target's kernel; if a generated kernel fails at run time, the torch reference
    runs instead (the model keeps working) and the failure is logged once."""
    try:
        return getattr(entry.kernel, method)(*args)
    except Exception as e:
        if entry.target == "torch":
            raise
        import logging
        from ssmc.targets.reference import ReferenceKernel
        logging.getLogger("ssmc").warning(
            "ssmc: %s kernel of region %s failed (%s: %s); using the torch reference from now on",
            entry.target, entry.region.name, type(e).__name__, e)
        entry.failure = f"{entry.target} kernel failed at run time: {type(e).__name__}: {e}"
        entry.kernel, entry.target = ReferenceKernel(entry.region), "torch"
        if method == "backward":
            args = args[:3]                  # the reference keeps no residual
        return getattr(entry.kernel, method)(*args)


def _own(outs, inputs) -> list[torch.Tensor]:
    """The outputs as tensors of their own: a kernel may give one as a view of another (the
    final state as the last of the stacked states) or as an input (no step taken); the caller
    may change any in place (`h.mul_(0.5)`, `h.detach_()`) as eager's results allow."""
    ids = {id(x) for x in inputs}
    return [o.clone() if isinstance(o, torch.Tensor) and (o._base is not None or id(o) in ids) else o
            for o in outs]


def _forward(key: str, inputs) -> list[torch.Tensor]:
    entry = lookup(key)
    check_inputs(entry, inputs)
    return _own(_run(entry, "forward", list(inputs)), inputs)


def _forward_train(key: str, inputs) -> list[torch.Tensor]:
    """The outputs, then the residual (`Compiled.residual_specs`): from the kernel's
    forward_train, or zeros (its flag 0: nothing kept) where the reference runs instead."""
    entry = lookup(key)
    check_inputs(entry, inputs)
    inputs = list(inputs)
    if hasattr(entry.kernel, "forward_train"):
        try:
            outs, res = entry.kernel.forward_train(inputs)
            return _own(outs, inputs) + list(res)
        except Exception as e:           # the plain forward (or its fallback) runs instead
            import logging
            logging.getLogger("ssmc").warning(
                "ssmc: training forward of region %s failed (%s: %s); the forward runs without "
                "checkpoints", entry.region.name, type(e).__name__, e)
    outs = _own(_run(entry, "forward", inputs), inputs)
    dev = inputs[0].device
    return outs + [torch.zeros(s, dtype=dt, device=dev) for s, dt in entry.residual_specs(inputs)]


@torch.library.custom_op("ssmc::region", mutates_args=())
def region(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return _forward(key, inputs)


def call_region(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """How an eagerly run graph calls a region (the backend puts this in place of the op): the
    kernel straight away when the op's machinery has nothing to do, that is no input needs a
    gradient, no tracing, mode or profiler is active and the inputs are plain tensors; the
    custom op otherwise (``region_train`` when an input needs a gradient and the kernel keeps a
    residual). The op's dispatch (autograd wrapper, redispatch, aliasing checks) costs tens of
    microseconds a call, most of a decode step's time."""
    if _plain(inputs):
        return _forward(key, inputs)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        entry = lookup(key)
        if entry.residual_specs(inputs):
            return torch.ops.ssmc.region_train.default(key, inputs)[:len(entry.region.outputs)]
    return torch.ops.ssmc.region.default(key, inputs)


def _plain(inputs) -> bool:
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch.autograd._profiler_enabled() or torch.compiler.is_compiling()
            or torch._C._functorch.peek_interpreter_stack() is not None):   # vmap, grad, ...
        return False
    grad = torch.is_grad_enabled()
    return all(type(x) is torch.Tensor and not (grad and x.requires_grad) for x in inputs)


@region.register_fake
def _region_fake(key, inputs):
    return lookup(key).empty_outputs(inputs)


@torch.library.custom_op("ssmc::region_train", mutates_args=())
def region_train(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return _forward_train(key, inputs)


@region_train.register_fake
def _region_train_fake(key, inputs):
    entry = lookup(key)
    dev = inputs[0].device
    return entry.empty_outputs(inputs) + [torch.empty(s, dtype=dt, device=dev) for s, dt in entry.residual_specs(inputs)]


@torch.library.custom_op("ssmc::region_bwd", mutates_args=())
def region_bwd(key: str, inputs: list[torch.Tensor], grads: list[torch.Tensor],
               needs: list[bool], residual: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = lookup(key)
    args = [list(inputs), list(grads), list(needs)]
    if residual and entry.target != "torch":      # a kernel that fell back ignores it
        out = _run(entry, "backward", *args, list(residual))
    else:
        out = _run(entry, "backward", *args)
    return _grads_out(out, inputs, needs)


def _grads_out(out, inputs, needs):
    """Input gradients as the fake kernels describe them: contiguous, whatever the input's
    strides (a transposed weight's gradient would otherwise come back with other strides than
    Inductor was told, and its stride assertion fails), empty where not needed."""
    return [g.contiguous() if (need and g is not None) else x.new_empty(0) for g, x, need in zip(out, inputs, needs)]


def _grads_fake(inputs, needs):
    return [x.new_empty(x.shape) if need else x.new_empty(0) for x, need in zip(inputs, needs)]


@region_bwd.register_fake
def _region_bwd_fake(key, inputs, grads, needs, residual):
    return _grads_fake(inputs, needs)


def output_sources(r: Region) -> list:
    """Per output, the inputs its value depends on: those its expression loads and, where it
    reads the state, every input of the decay, the drive, the transition and the initial state."""
    from ssmc.ir import loads, uses_state
    state = {ld.input for e in (r.decay, r.drive, r.mix.expr if r.mix is not None else None) if e is not None
             for ld in loads(e)} | ({r.init} if r.init is not None else set())
    return [frozenset({ld.input for ld in loads(o.expr)} | (state if uses_state(o.expr) else set())) for o in r.outputs]


def _setup(ctx, inputs, output, residual=()):
    key, xs = inputs
    ctx.key = key
    ctx.needs = [bool(x.requires_grad) and x.is_floating_point() for x in xs]
    ctx.n_inputs = len(xs)
    ctx.save_for_backward(*xs, *residual)
    # an output that depends on no input needing a gradient needs none itself, as in eager (a final
    # state carried into the next segment while only the readout trains)
    entry = _REGISTRY.get(key)
    if entry is not None and any(ctx.needs):
        r, outs = entry.region, list(output)
        n_in, n_out = len(r.inputs), len(r.outputs)
        dead = [outs[g * n_out + k] for g in range(getattr(entry, "n_groups", 1))     # grouped: per group
                for k, deps in enumerate(output_sources(r)) if not any(ctx.needs[g * n_in + i] for i in deps)]
        if dead:
            ctx.mark_non_differentiable(*dead)


def _setup_train(ctx, inputs, output):
    ctx.n_outputs = len(lookup(inputs[0]).region.outputs)
    residual = output[ctx.n_outputs:]
    _setup(ctx, inputs, output, residual)
    ctx.mark_non_differentiable(*residual)
    ctx.set_materialize_grads(False)     # no zeros of the residual's size for its (absent) gradient


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    xs, residual = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
    grads = grads[:getattr(ctx, "n_outputs", len(grads))]      # none for the residual
    gs = [g if g is not None else xs[0].new_empty(0) for g in grads]
    out = torch.ops.ssmc.region_bwd(ctx.key, xs, gs, ctx.needs, residual)
    return None, [g if need else None for g, need in zip(out, ctx.needs)]


def _no_double_backward(ctx, grads):
    raise RuntimeError("ssmc: a gradient of a gradient (create_graph=True: a gradient penalty, a "
                       "Hessian-vector product, MAML) through an ssmc region is not supported; compile "
                       "that model without ssmc, or take the higher-order gradient outside it")


def _setup_nothing(ctx, inputs, output):
    pass


region.register_autograd(_backward, setup_context=_setup)
region_bwd.register_autograd(_no_double_backward, setup_context=_setup_nothing)
region_train.register_autograd(_backward, setup_context=_setup_train)


# -- grouped regions (mixtures of experts, passes/moe_grouping.py) --------------------------------

@dataclasses.dataclass
class GroupCompiled:
    """One region run for `n_groups` input lists of `arity` tensors each, by one grouped kernel
    (ssmc/targets/moe.py). The op takes the lists concatenated and returns the outputs the same
    way: group 0's outputs, then group 1's, ..."""
    key: str
    region: Region
    arity: int
    n_groups: int
    kernel: Any              # .forward(groups) -> list[list[Tensor]]; .backward(groups, grads, needs)
    members: list            # the member regions' names, for the report
    failure: str | None = None

    def split(self, flat, per: int) -> list[list]:
        return [list(flat[i * per:(i + 1) * per]) for i in range(self.n_groups)]

    def empty_outputs(self, inputs) -> list[torch.Tensor]:
        one = Compiled(self.key, self.region, "", "", None)
        return [t for g in self.split(inputs, self.arity) for t in one.empty_outputs(g)]


def run_grouped(entry: GroupCompiled, method: str, *args):
    """Run the grouped kernel; if it fails at run time, every group runs the torch reference
    from then on (logged once, kept in ``entry.failure`` for the report)."""
    try:
        return getattr(entry.kernel, method)(*args)
    except Exception as e:
        from ssmc.targets.moe import GroupedKernel
        from ssmc.targets.reference import ReferenceKernel
        if type(entry.kernel) is GroupedKernel and isinstance(entry.kernel.member, ReferenceKernel):
            raise
        import logging
        logging.getLogger("ssmc").warning("ssmc: grouped kernel %s failed (%s: %s); using the torch "
                                          "reference per group from now on", entry.key, type(e).__name__, e)
        entry.failure = f"grouped kernel failed at run time: {type(e).__name__}: {e}"
        entry.kernel = GroupedKernel(entry.region, ReferenceKernel(entry.region))
        return getattr(entry.kernel, method)(*args)


@torch.library.custom_op("ssmc::grouped", mutates_args=())
def grouped(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    entry = lookup(key)
    outs = run_grouped(entry, "forward", entry.split(list(inputs), entry.arity))
    return [o for g in outs for o in g]


@grouped.register_fake
def _grouped_fake(key, inputs):
    return lookup(key).empty_outputs(inputs)


@torch.library.custom_op("ssmc::grouped_bwd", mutates_args=())
def grouped_bwd(key: str, inputs: list[torch.Tensor], grads: list[torch.Tensor],
                needs: list[bool]) -> list[torch.Tensor]:
    entry = lookup(key)
    k, n = entry.arity, len(entry.region.outputs)
    out = run_grouped(entry, "backward", entry.split(list(inputs), k), entry.split(list(grads), n),
                      entry.split(list(needs), k))
    return _grads_out([g for grp in out for g in grp], inputs, needs)


@grouped_bwd.register_fake
def _grouped_bwd_fake(key, inputs, grads, needs):
    return _grads_fake(inputs, needs)


def _grouped_backward(ctx, grads):
    xs = list(ctx.saved_tensors)
    gs = [g if g is not None else xs[0].new_empty(0) for g in grads]
    out = torch.ops.ssmc.grouped_bwd(ctx.key, xs, gs, ctx.needs)
    return None, [g if need else None for g, need in zip(out, ctx.needs)]


grouped.register_autograd(_grouped_backward, setup_context=_setup)
grouped_bwd.register_autograd(_no_double_backward, setup_context=_setup_nothing)
