"""What ssmc did, for a reader: regions found, passes and their timing, strategy and target
with reasons, generated kernel source, and every fallback with its reason."""
from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import torch


@dataclasses.dataclass
class RegionInfo:
    name: str
    strategy: str
    strategy_reason: str
    target: str
    target_reasons: dict
    plugin: str                  # package that provided the target
    region: str                  # the region IR, printed
    loop: str                    # the re-rolled step body, printed as Python
    kernel_source: str | None
    key: str
    notes: list
    cache: str = ""              # "hit" | "miss" | "" (no cache for this target)
    ir: object = None            # the ssmc.ir.Region object itself
    backward: str = ""           # which backward ran, once one has (filled in by refresh)

    def __str__(self):
        lines = [f"region {self.name}: strategy {self.strategy} ({self.strategy_reason})",
                 f"  target {self.target} (from {self.plugin})"]
        for t, why in self.target_reasons.items():
            lines.append(f"  target {t} declined: {why}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.cache:
            lines.append(f"  kernel cache: {self.cache}")
        if self.backward:
            lines.append(f"  {self.backward}")
        lines.append(_indent("re-rolled step:\n" + _indent(self.loop)))
        lines.append(_indent("region IR:\n" + _indent(self.region)))
        if self.kernel_source:
            numbered = "\n".join(f"{i + 1:4d}  {l}" for i, l in enumerate(self.kernel_source.splitlines()))
            lines.append(_indent("kernel source:\n" + numbered))
        return "\n".join(lines)


def _indent(s: str, n: int = 4) -> str:
    return "\n".join(" " * n + l for l in s.splitlines())


@dataclasses.dataclass
class GroupInfo:
    """A group of expert regions run by one grouped op (passes/moe_grouping.py)."""
    name: str
    members: list                # member region names
    source: str                  # the tensor the experts gather from
    scatter: str                 # how results go back ("setitem", "index_copy", ...)
    region: object               # the shared ssmc.ir.Region
    state_sizes: list            # per member: state shape at capture time
    status: str = ""
    key: str = ""
    kernel: str = ""
    notes: list = dataclasses.field(default_factory=list)

    def padding(self) -> dict:
        """Padding at the captured sizes: each member's state tile is the next power of two of
        its own state size (the axis the readout sums over)."""
        from ssmc.targets.moe import _pow2, reg_axis
        r = self.region
        k = r.axes.index(reg_axis(r)) if reg_axis(r) in r.axes else len(r.axes) - 1
        rows = []
        for s in self.state_sizes:
            other = 1
            for i, v in enumerate(s):
                other *= v if i != k else 1
            rows.append((s[0] if k else 1, s[k], _pow2(s[k]), other))
        useful = sum(o * n for _, n, _, o in rows)
        computed = sum(o * t for _, _, t, o in rows)
        top = max((t for _, _, t, _ in rows), default=1)
        return {"groups": rows, "wasted_fraction": (computed - useful) / useful if useful else 0.0,
                "wasted_fraction_if_padded_to_max": (sum(o for *_, o in rows) * top - useful) / useful
                if useful else 0.0}

    def __str__(self):
        lines = [f"group {self.name}: {self.status}",
                 f"  experts {', '.join(self.members)} gather from {self.source}"
                 f"{', scatter by ' + self.scatter if self.scatter else ''}"]
        if any(v < 0 for s in self.state_sizes for v in s):
            lines.append("  sizes are data-dependent: padding is reported after a run (notes)")
        else:
            p = self.padding()
            lines += ["  at capture: " + "; ".join(f"{m}: {b} seq, state {n} -> tile {t}"
                                                   for m, (b, n, t, _) in zip(self.members, p["groups"])),
                      f"  padded work {100 * p['wasted_fraction']:.1f}% of useful work (padding every "
                      f"expert to the largest state: {100 * p['wasted_fraction_if_padded_to_max']:.1f}%)"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclasses.dataclass
class GraphReport:
    nodes_in: int = 0
    nodes_out: int = 0
    compile_ms: float = 0.0
    passes: list = dataclasses.field(default_factory=list)
    regions: list = dataclasses.field(default_factory=list)
    groups: list = dataclasses.field(default_factory=list)      # GroupInfo: grouped experts
    fallbacks: list = dataclasses.field(default_factory=list)
    log: list = dataclasses.field(default_factory=list)
    rest: str = ""
    within: str = ""           # a body a node of another graph calls (checkpointed code)


@dataclasses.dataclass
class Report:
    """``report.regions``, ``report.passes`` (name, ms, changed), ``report.fallbacks`` (where, reason)."""
    graphs: list = dataclasses.field(default_factory=list)

    @property
    def regions(self) -> list[RegionInfo]:
        return [r for g in self.graphs for r in g.regions]

    @property
    def passes(self) -> list:
        return [p for g in self.graphs for p in g.passes]

    @property
    def groups(self) -> list:
        return [x for g in self.graphs for x in g.groups]

    @property
    def fallbacks(self) -> list:
        return [f for g in self.graphs for f in g.fallbacks]

    def __str__(self):
        out = [f"ssmc: {len(self.graphs)} graph(s), {len(self.regions)} region(s), "
               f"{len(self.fallbacks)} fallback(s)"]
        for gi, g in enumerate(self.graphs):
            where = f" ({g.within})" if g.within else ""
            out.append(f"\ngraph {gi}{where}: {g.nodes_in} FX nodes from Dynamo -> {g.nodes_out} after ssmc "
                       f"({g.compile_ms:.0f} ms in ssmc; the rest of the graph runs with {g.rest})")
            out.append("  passes:")
            for p in g.passes:
                state = p.skipped or ("changed" if p.changed else "no change")
                out.append(f"    {p.name:20s} {p.ms:9.2f} ms  {state}")
            for r in g.regions:
                out.append(_indent(str(r), 2))
            for grp in g.groups:
                out.append(_indent(str(grp), 2))
            for where, why in g.fallbacks:
                out.append(f"  fallback at {where}: {why}")
            for msg in g.log:
                out.append(f"  note: {msg}")
        if not self.graphs:
            out.append("\nnote: Dynamo handed ssmc no graph: the function ran eagerly (a graph break "
                       "inside a loop, from `.item()`, printing or Python control flow on tensor values, "
                       "makes Dynamo skip the whole function); `torch._dynamo.explain(fn)(*args)` lists "
                       "the breaks")
        elif len(self.graphs) > 1 and not self.regions:
            out.append(f"\nnote: Dynamo cut the function into {len(self.graphs)} graphs and none holds a loop "
                       "ssmc re-rolls: a loop cut by graph breaks (`.item()`, printing, Python control "
                       "flow on tensor values) is not seen whole; `torch._dynamo.explain(fn)(*args)` "
                       "lists the breaks")
        return "\n".join(out)


class Dumper:
    """SSMC_DEBUG_DIR / options debug_dir: the IR after each pass and every generated source."""

    _count = 0

    def __init__(self, root: str):
        Dumper._count += 1
        self.dir = Path(root) / f"graph_{os.getpid()}_{Dumper._count:03d}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._give_up(e)

    def _give_up(self, e: OSError) -> None:
        """An unusable directory costs the dump, never the model's compile."""
        warnings.warn(f"ssmc: debug_dir {str(self.dir.parent)!r} cannot be written ({type(e).__name__}: {e}); "
                      "nothing is dumped for this graph", stacklevel=3)
        self.dir = None

    def write(self, name: str, text: str) -> Path | None:
        if self.dir is None:
            return None
        p = self.dir / name
        try:
            p.write_text(text)
        except OSError as e:
            self._give_up(e)
            return None
        return p

    def after_pass(self, i: int, name: str, ctx):
        parts = []
        for c in ctx.candidates:
            if c.declined:
                parts.append(f"# {c.name}: declined by {c.declined_by}: {c.declined}")
            elif c.plan is not None:
                extra = f"\n# strategy: {c.strategy}, target: {c.target}" if c.strategy else ""
                parts.append(str(c.plan.region) + extra)
            else:
                parts.append(c.loop.python())
        self.write(f"{i:03d}_{name}.py", "\n\n".join(parts) + "\n")


def explain(fn, *example_inputs, **options) -> Report:
    """Compile `fn` (a function or module) with ssmc on `example_inputs` and report what happened.

    Resets Dynamo first (torch._dynamo.reset()) so that the report always reflects a fresh
    capture; other compiled functions recompile on their next call."""
    from .backend import ssmc_backend
    torch._dynamo.reset()
    report = Report()

    def backend(gm, ex):
        return ssmc_backend(gm, ex, options=options, _report=report)
    backend.__name__ = "ssmc_explain"
    compiled = torch.compile(fn, backend=backend)
    compiled(*example_inputs)
    refresh(report)
    return report


def refresh(report: Report) -> Report:
    """Fill in what is only known after a run: which target a measured choice picked."""
    from ssmc.runtime.op import lookup
    for grp in report.groups:
        if not grp.key:
            continue
        try:
            entry = lookup(grp.key)
        except RuntimeError:
            continue
        msgs = [entry.kernel.describe()] + ([entry.failure] if entry.failure else [])
        grp.notes[:] = [m for m in msgs if m]
    for r in report.regions:
        try:
            entry = lookup(r.key)
        except RuntimeError:
            continue
        describe = getattr(entry.kernel, "describe", None)
        if describe is not None:
            msg = describe()
            if msg not in r.notes:
                r.notes.append(msg)
        note = getattr(entry.kernel, "backward_note", None)
        r.backward = (note() if note is not None else None) or r.backward
        if entry.failure and entry.failure not in r.notes:
            r.notes.append(entry.failure)
    return report
