"""The ``ssmc`` torch.compile backend (entry point group ``torch_dynamo_backends``).

Dynamo graph -> passes (reroll, detect_recurrence, fuse_prologue, fuse_epilogue,
select_strategy, plugins) -> each region compiled by its target and lowered to one
``torch.ops.ssmc.region`` call -> the rest of the graph to Inductor (CUDA) or eager.
Whatever ssmc cannot do falls back to the captured graph, with the reason in the report.
"""
from __future__ import annotations

import copy
import logging
import operator
import time

import torch
import torch.fx as fx

from .plugins import load as load_plugins
from .assemble import AssembleError
from .capture import erase_unused
from .explain import Dumper, GraphReport, RegionInfo, Report
from .lower import Lowering, finish_lowering
from .ops import impure
from .options import Options, check_names, make_options

log = logging.getLogger("ssmc")

LAST_REPORT = Report()      # the most recent compile's report, for users of torch.compile
_LAST_COMPILE_ID = None     # the frame compile LAST_REPORT belongs to, when DDP split it


def _ddp_piece_of():
    """Dynamo's id of the frame compile now running when DDP's graph splitter is at work (a
    DDP forward is active), else None. Graphs that share it are pieces of one frame, handed
    over one by one; outside DDP a second graph under the same id is a restarted attempt,
    which replaces the first."""
    try:
        from torch._guards import CompileContext
        from torch.nn.parallel import DistributedDataParallel
        if DistributedDataParallel._get_active_ddp_module() is None:
            return None
        cid = CompileContext.current_compile_id()
    except Exception:
        return None
    return None if cid is None else str(cid)


def _device(example_inputs) -> tuple[str, int | None]:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cuda":
                major, minor = torch.cuda.get_device_capability(x.device)
                return "cuda", major * 10 + minor
            return x.device.type, None
    return "cpu", None


def _inductor_patches(mode: str | None) -> tuple[dict, str | None]:
    """(Inductor config patches, a note) for ``torch.compile(..., mode=...)``: the mode is
    Inductor's and applies to the graph outside the regions, without CUDA graphs (the regions'
    first calls autotune and some read their inputs on the host)."""
    if mode in (None, "default"):
        return {}, None
    from torch._inductor import list_mode_options
    try:
        patches = dict(list_mode_options(mode))
    except RuntimeError as e:
        raise ValueError(f"ssmc: torch.compile(mode={mode!r}): {e}") from None
    note = f"mode={mode!r}: Inductor compiles the graph outside the regions with {sorted(patches) or 'its defaults'}"
    if patches.pop("triton.cudagraphs", False):
        note += "; without CUDA graphs (not taken with ssmc's regions)"
    return patches, note


def ssmc_backend(gm: fx.GraphModule, example_inputs, options=None, _report: Report | None = None,
                 mode: str | None = None, **kw):
    patches, mode_note = _inductor_patches(mode)
    opts = make_options(options, **kw)
    plugins = load_plugins()
    check_names(opts, {p.name for p in plugins if p.group == "ssmc.passes"},
                {p.name for p in plugins if p.group == "ssmc.targets"})
    global LAST_REPORT, _LAST_COMPILE_ID
    cid = _ddp_piece_of()
    if _report is not None:
        report = _report
    elif cid is not None and cid == _LAST_COMPILE_ID:   # another piece of the same frame
        report = LAST_REPORT
    else:
        report = Report()
    greport = GraphReport(nodes_in=len(gm.graph.nodes))
    report.graphs.append(greport)
    LAST_REPORT, _LAST_COMPILE_ID = report, cid
    t0 = time.perf_counter()
    device, arch = _device(example_inputs)
    greport.rest = opts.rest_for(device)
    captured = copy.deepcopy(gm.graph)     # the graph as Dynamo captured it (`gm.forward` is not:
    n_regions = 0                          # a lazy module's forward runs its latest graph)
    try:
        n_regions = _compile(gm, example_inputs, opts, device, arch, greport)
    except Exception as e:  # never crash the user's model
        log.warning("ssmc: falling back to the captured graph: %s: %s", type(e).__name__, e)
        log.debug("ssmc: fallback traceback", exc_info=True)
        greport.fallbacks.append(("backend", f"internal error, graph runs as captured: {type(e).__name__}: {e}"))
        greport.regions.clear()
        greport.groups.clear()
        greport.nodes_out = greport.nodes_in
        greport.rest = "eager"
        greport.compile_ms = (time.perf_counter() - t0) * 1e3
        gm.graph = captured
        gm.recompile()
        return gm.forward
    greport.nodes_out = len(gm.graph.nodes)
    greport.compile_ms = (time.perf_counter() - t0) * 1e3
    log.info("ssmc: graph of %d nodes -> %d nodes, %d region(s), %.0f ms",
             greport.nodes_in, greport.nodes_out, len(greport.regions), greport.compile_ms)
    n_regions += _compile_bodies(gm, report, opts, device, arch)
    _rest_for_unrolled_loops(greport, opts)
    if greport.rest == "inductor" and n_regions and _only_regions(gm):
        greport.rest = "eager"
        log.info("ssmc: nothing outside the regions for Inductor; the graph runs eagerly")
    if n_regions:
        _direct_calls(gm)
    if mode_note:
        greport.log.append(mode_note if greport.rest == "inductor" else
                           f"mode={mode!r} is Inductor's, which does not run this graph (the rest runs with {greport.rest})")
    written = gm.meta.get("ssmc_written_inputs", [])
    slow = None
    if written:                # the captured graph, for calls where an updated input shares memory
        slow = fx.GraphModule(gm, captured).forward
    if greport.rest == "inductor":
        from torch._inductor.compile_fx import compile_fx
        return _alias_checked(compile_fx(gm, example_inputs, config_patches=patches), slow, written)
    if not n_regions and greport.nodes_in > 2000:
        log.info("ssmc: no region found; running the captured graph of %d nodes eagerly", greport.nodes_in)
    return _alias_checked(gm.forward, slow, written)


def _alias_checked(fast, slow, written: list):
    """`fast` where the inputs the graph updates in place (rewritten as new values, the last
    copied back: `capture.functionalize_updates`) share memory with no other input; else the
    captured graph (`h` passed with `h[0]`: the view must see every update)."""
    if not written:
        return fast

    def shared(args) -> bool:
        for i in written:
            p = args[i].untyped_storage().data_ptr()
            if any(j != i and isinstance(b, torch.Tensor) and b.untyped_storage().data_ptr() == p
                   for j, b in enumerate(args)):
                return True
        return False
    if getattr(fast, "_boxed_call", False):      # called with one list of inputs
        def run_boxed(args):
            return slow(*args) if shared(args) else fast(args)
        run_boxed._boxed_call = True
        return run_boxed

    def run(*args):
        return slow(*args) if shared(args) else fast(*args)
    return run


def _lowered_as_map(gm, c, live, greport: GraphReport) -> bool:
    """A loop declined because nothing passes from one step to the next (a map over the steps)
    runs as one vmapped call of its step instead of its unrolled steps (`lower.lower_map`),
    unless another loop's region reads what it replaces. Says so in the report."""
    lp = c.loop
    if lp.n_carry or c.split is not None or c.declined_by != "detect_recurrence" or \
            any(impure(n) for n in lp.body.graph.nodes if n.op in ("call_function", "call_method")):
        return False
    mine = set(lp.erase) | {n for r in lp.results for n in r.replace}
    theirs = set()
    for o in live:
        ol = o.loop
        theirs |= {r.source for r in ol.reads} | {n for n in ol.invariants if isinstance(n, fx.Node)}
        theirs |= {n for n in ol.carry_init if isinstance(n, fx.Node)} | {ol.anchor} | set(ol.erase)
    if mine & theirs:
        return False
    refs = [r.source for r in lp.reads] + [n for n in (*lp.invariants, lp.anchor, *lp.erase) if isinstance(n, fx.Node)]
    if any(getattr(n, "_erased", False) for n in refs):
        return False               # it reads what a map lowered before it replaced: it runs as written
    from .lower import lower_map
    try:
        lower_map(gm, lp, keep={n for o in live for n in o.loop.made})
    except Exception as e:
        log.debug("ssmc: %s not lowered as a map: %s", c.name, e)
        return False
    greport.log.extend(c.notes)
    greport.log.append(f"{c.name}: nothing passes from one step to the next (a map over the steps): its step "
                       f"runs once, vmapped over the {lp.length} steps, instead of unrolled")
    return True


def _rest_for_unrolled_loops(greport: GraphReport, opts: Options) -> None:
    """With ``rest="auto"``, a graph that still holds a loop running as written (a fallback) and
    more than ``opts.rest_max_nodes`` nodes runs eagerly instead of through Inductor, whose compile
    time grows with the unrolled steps (measured on a CPU: 92 s for a 1024-step loop of 4102
    nodes, 200 s for 2048 steps). The report and the log say so; ``rest="inductor"`` compiles
    it anyway."""
    if (greport.rest != "inductor" or opts.rest != "auto" or not greport.fallbacks
            or not opts.rest_max_nodes or greport.nodes_out <= opts.rest_max_nodes):
        return
    greport.rest = "eager"
    loops = ", ".join(dict.fromkeys(str(name) for name, _ in greport.fallbacks))
    msg = (f"the graph outside the regions has {greport.nodes_out} nodes and runs as written where ssmc "
           f"fell back ({loops}); Inductor's compile time grows with a loop's unrolled steps (minutes at "
           f"thousands of nodes), so this graph runs eagerly (over rest_max_nodes={opts.rest_max_nodes}). "
           "options={'rest': 'inductor'} compiles it anyway")
    log.warning("ssmc: %s", msg)
    greport.log.append(msg)


def _for_effect(n: fx.Node) -> bool:
    """A node of the captured graph nothing reads that is not a known pure tensor op (Dynamo
    leaves dead views and arithmetic in too: those may go)."""
    from ssmc.ops import canonical
    if n.users or n.op not in ("call_function", "call_method"):
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return canonical(n) is None and name not in _PURE


_PURE = {"_add_batch_dim", "_remove_batch_dim", "zeros", "ones", "empty", "full", "zeros_like",
         "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full"}


def _compile_bodies(gm: fx.GraphModule, report: Report, opts: Options, device, arch) -> int:
    """Loops in checkpointed code: Dynamo captures torch.utils.checkpoint as a
    tag_activation_checkpoint node calling a subgraph, run (through an fx Interpreter) in the
    forward and again in the backward. Each such body is compiled as a graph of its own (its
    own entry in the report); one that fails runs as captured, its graph restored. Returns the
    regions made."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    made, seen = 0, set()
    for n in list(gm.graph.nodes):
        if hop is None or n.op != "call_function" or n.target is not hop or not n.args \
                or getattr(n.args[0], "op", None) != "get_attr":
            continue
        name = n.args[0].target
        sub = getattr(gm, name, None)
        if not isinstance(sub, fx.GraphModule) or name in seen:   # a body called twice: once
            continue
        seen.add(name)
        ex = [p.meta.get("example_value") for p in sub.graph.nodes if p.op == "placeholder"]
        greport = GraphReport(nodes_in=len(sub.graph.nodes), rest=report.graphs[-1].rest,
                              within=f"the checkpointed body {name} of {n.name}")
        report.graphs.append(greport)
        t0, captured = time.perf_counter(), copy.deepcopy(sub.graph)
        try:
            k = _compile(sub, ex, opts, device, arch, greport)
        except Exception as e:  # never crash the user's model
            log.warning("ssmc: %s runs as captured: %s: %s", name, type(e).__name__, e)
            greport.fallbacks.append((name, f"internal error, the body runs as captured: {type(e).__name__}: {e}"))
            greport.regions.clear()
            sub.graph = captured
            k = 0
        if k:
            _direct_calls(sub)
        greport.nodes_out = len(sub.graph.nodes)
        greport.compile_ms = (time.perf_counter() - t0) * 1e3
        made += k
    return made


def _only_regions(gm: fx.GraphModule) -> bool:
    """Whether the graph computes nothing but region calls, their outputs' selection and
    `.contiguous()` of them (a result laid out as eager's)."""
    import operator
    return all(n.op in ("placeholder", "output") or
               (n.op == "call_function" and n.target in (torch.ops.ssmc.region.default, operator.getitem)) or
               (n.op == "call_method" and n.target == "contiguous")
               for n in gm.graph.nodes)


def _direct_calls(gm: fx.GraphModule) -> None:
    """The graph calls its regions through `call_region`: run eagerly, it skips the custom
    op's dispatch when nothing needs it (inference); traced again (AOTAutograd under
    Inductor), it records the op, ``region_train`` where an input needs a gradient (the
    kernel's residual then becomes a saved tensor of the joint graph)."""
    from ssmc.runtime.op import call_region
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.ssmc.region.default:
            n.target = call_region
    gm.recompile()


_LENGTHS: dict[str, set] = {}     # region key -> the lengths its unrolled loop was captured at


def _note_lengths(cands, infos, greport: GraphReport) -> None:
    """Dynamo unrolls a Python loop for one length: another length is another trace of the whole
    loop (the region's kernels are reused), and after torch._dynamo.config.recompile_limit
    recompiles Dynamo runs the function eagerly. Said once a region, at its second length."""
    by_name = {i.name: i for i in infos}
    for c in cands:
        info = by_name.get(c.name)
        if info is None or c.loop.origin != "unrolled" or not isinstance(c.loop.length, int):
            continue
        seen = _LENGTHS.setdefault(info.key, set())
        if c.loop.length in seen or len(_LENGTHS) > 4096:
            continue
        seen.add(c.loop.length)
        if len(seen) == 2:
            limit = getattr(torch._dynamo.config, "recompile_limit", None) or \
                getattr(torch._dynamo.config, "cache_size_limit", "?")
            msg = (f"{c.name} was captured again for another length ({sorted(seen)}): Dynamo unrolls a Python "
                   f"loop for each length, so each new length is traced again (ssmc's kernels are reused), and "
                   f"after {limit} recompiles (torch._dynamo.config.recompile_limit) Dynamo runs the function "
                   "eagerly. For many lengths write the step with torch._higher_order_ops.scan (one graph for "
                   "every length) or pad inputs to a few lengths")
            log.warning("ssmc: %s", msg)
            greport.log.append(msg)


def _compile(gm, example_inputs, opts: Options, device, arch, greport: GraphReport) -> int:
    """Run the passes and lower every region into `gm`; returns the number of regions."""
    from ssmc.passes.base import PassContext
    from ssmc.passes.pipeline import run_pipeline
    if greport.nodes_in > 2000:
        log.info("ssmc: re-rolling a graph of %d nodes", greport.nodes_in)
    for n in gm.graph.nodes:       # lowering's dead-code sweep leaves what Dynamo kept with no
        if _for_effect(n):         # reader for its effect (vmap's level pushes and pops)
            n.meta["ssmc_effect"] = True
    loaded = load_plugins()
    ctx = PassContext(gm, list(example_inputs), opts, device, arch, targets=loaded.loaded("ssmc.targets"))
    dumper = Dumper(opts.debug_dir) if opts.debug_dir else None
    if dumper:
        dumper.write("000_input.py", gm.code)
    before = _fingerprint(gm)
    greport.passes = run_pipeline(ctx, dumper.after_pass if dumper else None)
    greport.log.extend(ctx.log)
    greport.fallbacks.extend(ctx.fallbacks)
    for c in ctx.candidates:       # a split loop's pieces run as regions together or not at all
        bad = next((m for m in c.split.members if m.declined), None) if c.split and not c.declined else None
        if bad is not None:
            c.decline(bad.declined_by, f"{bad.name}, another state of {c.split.name}, was declined: {bad.declined}")
    live = [c for c in ctx.candidates if c.declined is None]
    for c in ctx.candidates:
        if c.declined and _lowered_as_map(gm, c, live, greport):
            continue
        if c.declined:
            greport.fallbacks.append((c.name, f"{c.declined_by}: {c.declined} (the loop runs as written)"))
            erase_unused(gm, c.loop.made)
    if not live:
        if opts.validate and _fingerprint(gm) != before:    # rewritten (in-place updates as values)
            _validate(gm)
        return 0
    pkg = {p.name: f"{p.package} {p.version}" for p in loaded if p.group == "ssmc.targets"}
    from ssmc.runtime.cache import get_cache
    from ssmc.runtime.op import Compiled, register
    cache = get_cache(opts.cache_dir)
    seen_events = len(cache.events)
    lowered = []

    def info(cand, entry):
        if dumper and entry.source:
            dumper.write(f"kernel_{entry.key}.{'cu' if entry.target == 'cuda' else 'py'}", entry.source)
        names = entry.target.removeprefix("auto(").rstrip(")").split("|")
        plugin = ", ".join(dict.fromkeys(pkg.get(n, "?") for n in names))
        return RegionInfo(cand.name, entry.strategy, cand.strategy_reason or "default", entry.target,
                          dict(cand.target_reasons), plugin, str(entry.region),
                          cand.loop.python(), entry.source, entry.key, list(cand.notes),
                          getattr(entry.kernel, "cache_status", ""), entry.region)

    pending = list(live)           # what loops not lowered yet made stays until they are
    for cand in reversed(live):
        pending.remove(cand)
        keep = {n for c in pending for n in c.loop.made}
        if cand.split is not None:
            if cand is cand.split.members[-1]:       # the whole split loop, once
                lowered.extend(reversed([info(m, e) for m, e in _lower_split(gm, cand.split, ctx, opts, greport,
                                                                             keep)]))
            continue
        try:
            entry = _compile_region(cand, ctx, opts)
        except Exception as e:
            greport.fallbacks.append((cand.name, f"compile failed, the loop runs as written: {type(e).__name__}: {e}"))
            continue
        register(entry)
        try:
            Lowering(gm, cand, entry.key, keep).run()
        except Exception as e:
            log.debug("ssmc: lowering failed", exc_info=True)
            raise RuntimeError(f"lowering {cand.name} failed: {e}") from e
        lowered.append(info(cand, entry))
    gm.graph.eliminate_dead_code(is_impure_node=impure)    # what a loop that failed to compile made
    gm.recompile()
    greport.regions.extend(reversed(lowered))
    _note_lengths(live, lowered, greport)
    for group in getattr(ctx, "groups", []):
        greport.groups.append(_lower_group(gm, group, opts, device, arch))
    greport.log.extend(cache.events[seen_events:])      # corrupt entries rebuilt, unwritable cache dir
    if opts.validate:
        _validate(gm)
    if dumper:
        dumper.write("999_lowered.py", gm.code)
    return len(lowered)


def _lower_split(gm, split, ctx, opts, greport, keep=frozenset()) -> list:
    """The pieces of a split loop (split_states), lowered in order before the loop: each piece's
    stacked per-step values replace the stand-ins later pieces read; the loop's nodes go at the
    end. When a piece fails to compile, the loop runs as written. Returns [(candidate, entry)]."""
    from ssmc.loop import Read
    from ssmc.runtime.op import register
    entries = []
    for m in split.members:
        try:
            entries.append(_compile_region(m, ctx, opts))
        except Exception as e:
            greport.fallbacks.append((m.name, f"compile failed, {split.name} runs as written: {type(e).__name__}: {e}"))
            for c in split.members:
                erase_unused(gm, c.loop.made)
            return []
    given = {}
    for m, entry in zip(split.members, entries):
        register(entry)
        lp = m.loop
        lp.reads[:] = [Read(given.get(r.source, r.source), r.dim, r.start) for r in lp.reads]
        m.plan.sources[:] = [(s[0], given.get(s[1], s[1]), *s[2:]) if s[0] == "outer" else s for s in m.plan.sources]
        try:
            low = Lowering(gm, m, entry.key)
            low.run(finish=False)
        except Exception as e:
            log.debug("ssmc: lowering failed", exc_info=True)
            raise RuntimeError(f"lowering {m.name} failed: {e}") from e
        for r, v in zip(lp.results, low.values):
            for n in r.replace:
                if n in split.bridges:
                    v.meta.setdefault("example_value", n.meta.get("example_value"))
                    given[n] = v
        for old, (new, init) in split.shifted.items():
            if new in given and old not in given:
                given[old] = _one_step_late(gm, given[new], init)
    finish_lowering(gm, split.erase, keep)
    return list(zip(split.members, entries))


def _one_step_late(gm, new: fx.Node, init) -> fx.Node:
    """A state's values before each update from its new values (steps along dim 0): the initial
    value (a node, a number, None for zeros), then the new values but the last."""
    from .capture import _Builder, _fake_mode
    b = _Builder(gm.graph, _fake_mode(gm.graph))
    anchor = new.next
    head = b.call(anchor, operator.getitem, (new, slice(0, 1)))
    if isinstance(init, fx.Node):
        first = b.call(anchor, torch.Tensor.expand_as, (b.call(anchor, torch.Tensor.unsqueeze, (init, 0)), head))
    else:
        first = b.call(anchor, torch.full_like, (head, float(init or 0.0)))
    rest = b.call(anchor, operator.getitem, (new, slice(0, -1)))
    return b.call(anchor, torch.cat, ([first, rest], 0))


def _lower_group(gm, group, opts, device, arch):
    """One grouped call for a group's members (already lowered each to its own region call);
    a group that cannot be merged keeps the members' own calls, with the reason."""
    from .explain import GroupInfo
    from .lower import lower_group
    from ssmc.runtime.op import GroupCompiled, lookup, register
    from .targets.moe import make_grouped
    info = GroupInfo(group.name, [c.name for c in group.members], group.source, group.scatter,
                     group.region, group.state_sizes)
    calls = {n.args[0]: n for n in gm.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.ssmc.region.default}
    keys = [next((k for k in calls if k.startswith(f"{c.name}-")), None) for c in group.members]
    if None in keys:
        info.status = "not grouped: a member was not lowered (see its fallback); members run one by one"
        return info
    canon = lookup(keys[[c.plan.region for c in group.members].index(group.region)])
    try:
        kernel = make_grouped(group.region, canon.kernel, canon.target, opts, device, arch)
        key = f"{group.name}-{group.region.key()}-{len(keys)}-{canon.target}"
        entry = GroupCompiled(key, group.region, len(group.region.inputs), len(keys), kernel,
                              info.members)
        register(entry)
        lower_group(gm, [calls[k] for k in keys], key, len(group.region.outputs))
    except Exception as e:
        log.debug("ssmc: grouping failed", exc_info=True)
        info.status = f"not grouped: {type(e).__name__}: {e}; members run one by one"
        return info
    info.key, info.kernel = key, kernel.kind
    info.status = f"grouped: {len(keys)} experts in one op ({kernel.kind})"
    return info


def _compile_region(cand, ctx, opts):
    from ssmc.runtime.op import Compiled
    region = cand.plan.region
    strategy = cand.strategy or "chunked_scan"
    target = cand.target or "torch"
    if cand.strategy is None and cand.target is None:
        asked = f"; target={opts.target!r} is applied by select_strategy, so it was not" \
            if opts.target not in ("auto", "torch") else ""
        cand.notes.append(f"no strategy chosen (select_strategy did not run): the torch target runs the "
                          f"region{asked}")
    chain = [target] + [t for t in ("triton", "torch") if t != target and (t == "torch" or target == "cuda")]
    kernel = None
    for i, name in enumerate(chain):
        t = ctx.targets.get(name)
        if t is None:
            continue
        try:
            kernel = t.compile(region, strategy, opts)
            target = name
            break
        except Exception as e:   # the report carries the compiler's message; the next target runs
            if name == "torch":
                raise
            cand.notes.append(f"target {name} failed to compile, falling back to {chain[i + 1]}: "
                              f"{type(e).__name__}: {e}")
            log.warning("ssmc: target %s failed to compile %s: %s", name, region.name, e)
    key = f"{region.name}-{region.key()}-{target}-{strategy}"
    source = t.source(kernel)
    rivals = {}
    for name in getattr(cand, "alternatives", []):
        if name == target:
            continue
        try:
            rivals[name] = ctx.targets[name].compile(region, strategy, opts)
        except Exception as e:
            cand.notes.append(f"target {name} failed to compile: {type(e).__name__}: {e}")
    for k in [kernel, *rivals.values()]:
        _lend_backward(k, rivals.get("triton"), region, strategy, ctx, opts)
    if rivals:
        from ssmc.runtime.autotune import MeasuredChoice
        kernels = {target: kernel, **rivals}
        versions = {n: getattr(ctx.targets[n], "version", "") for n in kernels}
        kernel = MeasuredChoice(region, kernels, versions, opts.cache_dir)
        sources = [f"# --- {n} ---\n{ctx.targets[n].source(k) or ''}" for n, k in kernels.items()]
        source = "\n".join(sources)
        target = "auto(" + "|".join(kernels) + ")"
        key = f"{region.name}-{region.key()}-{target}-{strategy}"
    return Compiled(key, region, strategy, target, kernel, source)


def _lend_backward(kernel, triton_kernel, region, strategy, ctx, opts):
    """A kernel without a generated backward of its own (``backward_partner`` unset: the CUDA
    target) gets the Triton kernel of the same region for its backward: the rival when there is
    one, else one compiled on the first backward (a failure there leaves the torch reference)."""
    if getattr(kernel, "backward_partner", False) is not None or "triton" not in ctx.targets:
        return
    if triton_kernel is not None:
        kernel.backward_partner = lambda: triton_kernel
    else:
        kernel.backward_partner = lambda: ctx.targets["triton"].compile(region, strategy, opts)


def _fingerprint(gm: fx.GraphModule) -> int:
    return hash(tuple((n.op, str(n.target), n.args.__repr__()) for n in gm.graph.nodes))


def _validate(work: fx.GraphModule):
    """Shape-check the rewritten graph with Dynamo's own fake values."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    phs = [n for n in work.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("example_value") for n in phs]
    mode = next((getattr(v, "fake_mode", None) for v in vals if getattr(v, "fake_mode", None)), None)
    if mode is None:
        return
    FakeTensorProp(work, mode=mode).propagate_dont_convert_inputs(*vals)
