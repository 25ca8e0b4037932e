"""What ssmc did, for a reader: regions found, passes and their timing, strategy and target
with reasons, generated kernel source, and every fallback with its reason."""
from __future__ import annotations

import dataclasses
import os
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

    def __str__(self):
        lines = [f"region {self.name}: strategy {self.strategy} ({self.strategy_reason})",
                 f"  target {self.target} (from {self.plugin})"]
        for t, why in self.target_reasons.items():
            lines.append(f"  target {t} declined: {why}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.cache:
            lines.append(f"  kernel cache: {self.cache}")
        lines.append(_indent("re-rolled step:\n" + _indent(self.loop)))
        lines.append(_indent("region IR:\n" + _indent(self.region)))
        if self.kernel_source:
            numbered = "\n".join(f"{i + 1:4d}  {l}" for i, l in enumerate(self.kernel_source.splitlines()))
            lines.append(_indent("kernel source:\n" + numbered))
        return "\n".join(lines)


def _indent(s: str, n: int = 4) -> str:
    return "\n".join(" " * n + l for l in s.splitlines())


@dataclasses.dataclass
class GraphReport:
    nodes_in: int = 0
    nodes_out: int = 0
    compile_ms: float = 0.0
    passes: list = dataclasses.field(default_factory=list)
    regions: list = dataclasses.field(default_factory=list)
    fallbacks: list = dataclasses.field(default_factory=list)
    log: list = dataclasses.field(default_factory=list)
    rest: str = ""


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
    def fallbacks(self) -> list:
        return [f for g in self.graphs for f in g.fallbacks]

    def __str__(self):
        out = [f"ssmc: {len(self.graphs)} graph(s), {len(self.regions)} region(s), "
               f"{len(self.fallbacks)} fallback(s)"]
        for gi, g in enumerate(self.graphs):
            out.append(f"\ngraph {gi}: {g.nodes_in} FX nodes from Dynamo -> {g.nodes_out} after ssmc "
                       f"({g.compile_ms:.0f} ms in ssmc; the rest of the graph runs with {g.rest})")
            out.append("  passes:")
            for p in g.passes:
                state = p.skipped or ("changed" if p.changed else "no change")
                out.append(f"    {p.name:20s} {p.ms:9.2f} ms  {state}")
            for r in g.regions:
                out.append(_indent(str(r), 2))
            for where, why in g.fallbacks:
                out.append(f"  fallback at {where}: {why}")
            for msg in g.log:
                out.append(f"  note: {msg}")
        return "\n".join(out)


class Dumper:
    """SSMC_DEBUG_DIR / options debug_dir: the IR after each pass and every generated source."""

    _count = 0

    def __init__(self, root: str):
        Dumper._count += 1
        self.dir = Path(root) / f"graph_{os.getpid()}_{Dumper._count:03d}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, text: str) -> Path:
        p = self.dir / name
        p.write_text(text)
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
        if entry.failure and entry.failure not in r.notes:
            r.notes.append(entry.failure)
    return report
