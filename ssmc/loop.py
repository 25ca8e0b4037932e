"""A re-rolled loop: one step body as a small FX graph, plus where its inputs and results live
in the outer (Dynamo) graph. Produced by the `reroll` pass, consumed by every later pass.

Body placeholders, in order: the carried values (``carry_k``), the per-step reads
(``read_k``: step t sees ``source.select(dim, start + t)``), the loop invariants (``inv_k``).
Body output: ``(carry_out..., result...)``. A result is either one value per step, collected
into a sink (``torch.stack``/``torch.cat`` of the steps, ``out[:, t] = y`` writes, or a scan's
stacked output), or the value at the last step (``kind="last"``: a final state returned).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx


@dataclasses.dataclass
class Read:
    source: fx.Node
    dim: int
    start: int = 0
    width: int = 1                     # reroll only: a chunk of w steps (made a plain read of a
                                       # (chunks, w) view of the source before the loop leaves it)


@dataclasses.dataclass
class Result:
    kind: str                          # "steps" | "last"
    sink: str = ""                     # steps: "stack" | "cat" | "setitem" | "scan"
    dim: int = 0                       # where the time axis goes in the sink
    replace: list = dataclasses.field(default_factory=list)  # outer nodes standing for this result
    buffer: fx.Node | None = None      # setitem: the tensor written into
    start: int = 0                     # setitem: the loop writes buffer[start : start + L] along dim
    prefix: list = dataclasses.field(default_factory=list)   # stack/cat: peeled values before
    suffix: list = dataclasses.field(default_factory=list)   # ... and after the loop's steps
    reverse: bool = False              # the sink holds the steps last first (a reverse-time loop)
    drop_last: bool = False            # stack: the sink holds every step's value but the last's
                                       # (`ys.append(h)` before the update, the final h returned)


@dataclasses.dataclass
class Loop:
    name: str
    body: fx.GraphModule
    length: int | None                 # None: the length of the reads (a scan's xs)
    carry_init: list[Any]              # per carry: outer node, python number, or None (zeros)
    reads: list[Read]
    invariants: list[fx.Node]
    results: list[Result]
    erase: list[fx.Node]               # outer nodes the region replaces
    anchor: fx.Node | None = None      # insert the region before this outer node
    origin: str = "unrolled"           # "unrolled" | "scan"
    foreign: frozenset = frozenset()   # outer nodes other loops replace (fusion stops at them)
    made: list = dataclasses.field(default_factory=list)   # outer nodes made for the loop (flipped
                                                           # reads); erased when it is declined
    gathers: list = dataclasses.field(default_factory=list)  # (result, step nodes, the last in the graph,
                                       # [(user, node, index)]):
                                       # single steps' values read after the loop; `gather_steps`
    complex_results: frozenset = frozenset()   # results the body gives as real (..., 2) pairs of
                                               # complex values (ssmc.complex_state); lowering
                                               # turns them back with view_as_complex

    @property
    def n_carry(self) -> int:
        return len(self.carry_init)

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.body.graph.nodes if n.op == "placeholder"]

    def carry_nodes(self) -> list[fx.Node]:
        return self.placeholders()[: self.n_carry]

    def read_nodes(self) -> list[fx.Node]:
        return self.placeholders()[self.n_carry: self.n_carry + len(self.reads)]

    def invariant_nodes(self) -> list[fx.Node]:
        return self.placeholders()[self.n_carry + len(self.reads):]

    def outputs(self) -> list:
        out = next(n for n in self.body.graph.nodes if n.op == "output")
        return list(out.args[0])

    def carry_outputs(self) -> list:
        return self.outputs()[: self.n_carry]

    def result_values(self) -> list:
        return self.outputs()[self.n_carry:]

    def python(self) -> str:
        """The step body printed as Python, with where its inputs come from."""
        lines = [f"# loop {self.name}: {self.length or '?'} steps, from {self.origin} capture"]
        for ph, init in zip(self.carry_nodes(), self.carry_init):
            src = init.name if isinstance(init, fx.Node) else repr(init)
            lines.append(f"#   {ph.name}: carried, starts as {src}")
        for ph, r in zip(self.read_nodes(), self.reads):
            lines.append(f"#   {ph.name} = {r.source.name}.select({r.dim}, {r.start} + t)")
        for ph, inv in zip(self.invariant_nodes(), self.invariants):
            lines.append(f"#   {ph.name} = {inv.name if isinstance(inv, fx.Node) else inv!r}")
        for i, r in enumerate(self.results):
            where = f"{r.sink} along dim {r.dim}" if r.kind == "steps" else "value after the last step"
            if r.reverse:
                where += ", last step first"
            if i in self.complex_results:
                where += ", complex: the body gives view_as_real of it"
            lines.append(f"#   result {i}: {where}")
        lines.append(self.body.code.strip())
        return "\n".join(lines)
