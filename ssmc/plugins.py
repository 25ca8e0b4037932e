"""Passes and kernel targets come from entry points: groups ``ssmc.passes`` and ``ssmc.targets``.

ssmc's own are registered the same way in its pyproject.toml. A plugin that fails to import or
does not look like a pass/target is skipped with a warning and listed by `ssmc.plugins()`.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from importlib.metadata import entry_points

log = logging.getLogger("ssmc")

GROUPS = ("ssmc.passes", "ssmc.targets")
# Used only when ssmc itself is not installed (no entry points at all), e.g. from a source tree.
_BUILTIN = {
    "ssmc.passes": {
        "reroll": "ssmc.passes.reroll:Reroll",
        "sink_consumers": "ssmc.passes.sink_consumers:SinkConsumers",
        "split_states": "ssmc.passes.split_states:SplitStates",
        "detect_recurrence": "ssmc.passes.detect_recurrence:DetectRecurrence",
        "fuse_prologue": "ssmc.passes.fuse_prologue:FusePrologue",
        "fuse_epilogue": "ssmc.passes.fuse_epilogue:FuseEpilogue",
        "block_sparse": "ssmc.passes.block_sparse:BlockSparse",
        "moe_grouping": "ssmc.passes.moe_grouping:MoeGrouping",
        "select_strategy": "ssmc.passes.select_strategy:SelectStrategy",
    },
    "ssmc.targets": {"torch": "ssmc.targets.reference:TorchTarget",
                     "triton": "ssmc.targets.triton:TritonTarget",
                     "cuda": "ssmc.targets.cuda:CudaTarget"},
}


@dataclasses.dataclass
class Plugin:
    group: str
    name: str
    value: str                  # "module:attr"
    package: str
    version: str
    obj: object = None          # the pass class, or the target instance
    error: str | None = None

    def __str__(self):
        status = "ok" if self.error is None else f"FAILED: {self.error}"
        return f"{self.group:13s} {self.name:20s} {self.package} {self.version:10s} {self.value}  [{status}]"


class Plugins(list):
    def __str__(self):
        return "\n".join(str(p) for p in self) or "(no plugins)"

    def loaded(self, group: str) -> dict:
        return {p.name: p.obj for p in self if p.group == group and p.error is None}

    def failed(self) -> list:
        return [p for p in self if p.error is not None]


_CACHE: Plugins | None = None


def _check(group: str, obj) -> str | None:
    if group == "ssmc.passes":
        missing = [a for a in ("name", "run") if not hasattr(obj, a)]
        if not isinstance(obj, type):
            return "a pass plugin must be a class"
    else:
        missing = [a for a in ("name", "version", "supports", "compile") if not hasattr(obj, a)]
    return f"missing {', '.join(missing)}" if missing else None


def _load_one(group, name, value, package, version) -> Plugin:
    p = Plugin(group, name, value, package, version)
    try:
        mod, _, attr = value.partition(":")
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if group == "ssmc.targets" and isinstance(obj, type):
            obj = obj()
        err = _check(group, obj)
        if err is None and getattr(obj, "name", name) != name:
            err = f"declares name {obj.name!r} but is registered as {name!r}"
        if err:
            raise TypeError(err)
        p.obj = obj
    except Exception as e:  # a broken plugin never breaks ssmc
        p.error = f"{type(e).__name__}: {e}"
        warnings.warn(f"ssmc: plugin {name!r} ({group}, from {package}) skipped: {p.error}", stacklevel=2)
        log.warning("ssmc: plugin %s (%s) skipped: %s", name, group, p.error)
    return p


def load(refresh: bool = False) -> Plugins:
    global _CACHE
    if _CACHE is not None and not refresh:
        return _CACHE
    out = Plugins()
    for group in GROUPS:
        seen = {}

        def package(ep):
            dist = getattr(ep, "dist", None)
            return (dist.name, dist.version) if dist else ("?", "?")
        # ssmc's own first: another package registering one of its names cannot replace it
        eps = sorted(entry_points(group=group), key=lambda ep: package(ep)[0] != "ssmc")
        if not any(package(ep)[0] == "ssmc" for ep in eps):    # ssmc not installed: from the source tree
            from ssmc import __version__
            for name, value in _BUILTIN[group].items():
                seen[name] = "ssmc (source tree)"
                out.append(_load_one(group, name, value, "ssmc (source tree)", __version__))
        for ep in eps:
            pkg, version = package(ep)
            if seen.get(ep.name) == pkg:
                continue            # the same package's entry twice (two copies of its metadata)
            if ep.name in seen:
                p = Plugin(group, ep.name, ep.value, pkg, version)
                p.error = f"the name {ep.name!r} is taken by the plugin from {seen[ep.name]}"
                warnings.warn(f"ssmc: plugin {ep.name!r} ({group}, from {pkg}) skipped: {p.error}", stacklevel=2)
                out.append(p)
                continue
            seen[ep.name] = pkg
            out.append(_load_one(group, ep.name, ep.value, pkg, version))
    _CACHE = out
    return out


def plugins(refresh: bool = False) -> Plugins:
    """What was loaded, from which package and version, and what failed with the error."""
    return load(refresh)
