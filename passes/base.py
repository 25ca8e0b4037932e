"""The pass contract and the context passes share.

A pass is a class with a `name`, the pass it runs `after` (None: after the built-in pipeline), whether other passes
need it (`required`: it cannot be disabled), a docstring saying what it expects and what it
leaves, and `run(ctx) -> bool` (changed or not). Passes keep no state between runs; everything
they produce lives on the `PassContext` and its `Candidate`s.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx as fx

from ssmc.options import Options


class Pass:
    name: str = ""
    after: str | None = None
    required: bool = False

    def run(self, ctx: "PassContext") -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class Decline(Exception):
    """Raised inside a pass to decline one candidate; the message is the reason users see."""


@dataclasses.dataclass
class Candidate:
    """One loop on its way to becoming a region."""
    loop: Any                                   # ssmc.loop.Loop
    declined: str | None = None                 # reason, once declined
    declined_by: str | None = None
    rec: Any = None                             # detect_recurrence's findings
    fuse_prologue: bool = False                 # set by fuse_prologue
    fuse_epilogue: bool = False                 # set by fuse_epilogue
    plan: Any = None                            # ssmc.assemble.Plan: region + what runs around it
    strategy: str | None = None
    strategy_reason: str = ""
    target: str | None = None
    target_reasons: dict = dataclasses.field(default_factory=dict)
    alternatives: list = dataclasses.field(default_factory=list)   # other targets to time against
    notes: list = dataclasses.field(default_factory=list)
    split: Any = None                           # split_states: the pieces of one loop (a Split)

    @property
    def name(self) -> str:
        return self.loop.name

    def decline(self, by: str, reason: str):
        self.declined, self.declined_by = reason, by


@dataclasses.dataclass
class PassContext:
    gm: fx.GraphModule
    example_inputs: list
    options: Options
    device_type: str = "cpu"
    arch: int | None = None                     # e.g. 90 for sm_90; None on CPU
    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    targets: dict = dataclasses.field(default_factory=dict)   # name -> target object
    fallbacks: list = dataclasses.field(default_factory=list)  # (where, reason)
    groups: list = dataclasses.field(default_factory=list)     # moe_grouping: candidates run as one
    log: list = dataclasses.field(default_factory=list)

    def live(self) -> list[Candidate]:
        return [c for c in self.candidates if c.declined is None]

    def note(self, msg: str):
        self.log.append(msg)
