"""One frozen options object, passed down explicitly.

This is the only module that reads environment variables:

    SSMC_DISABLE_PASSES   comma-separated pass names to switch off
    SSMC_TARGET           default target ("auto", "torch", "triton", "cuda", or a plugin's name)
    SSMC_DEBUG_DIR        write the IR after each pass and every generated source here
    SSMC_CACHE_DIR        kernel cache directory (default ~/.cache/ssmc)
    SSMC_AUTOTUNE         "prune" (default) or "all": how much of a config table the autotuner times
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

_RESTS = ("auto", "inductor", "eager")
_AUTOTUNES = ("prune", "all")


@dataclasses.dataclass(frozen=True)
class Options:
    target: str = "auto"
    disable_passes: tuple[str, ...] = ()
    rest: str = "auto"            # what runs the graph outside the regions: inductor | eager | auto
    debug_dir: str | None = None
    cache_dir: str = ""
    chunk: int = 0                # time-chunk of the torch reference executor (0: by state size)
    validate: bool = True         # shape-check the rewritten graph with fake tensors
    deterministic: bool = False   # backward kernels: no atomics (partial sums + a torch sum)
    autotune: str = "prune"       # prune: skip the rest of a variant family whose first config is slow; all
    rest_max_nodes: int = 3000    # rest "auto": a graph with a loop running as written and more nodes runs eagerly

    def with_(self, **kw) -> "Options":
        return dataclasses.replace(self, **kw)

    def rest_for(self, device_type: str) -> str:
        if self.rest != "auto":
            return self.rest
        return "inductor" if device_type == "cuda" else "eager"


def _split(v: str | None) -> tuple[str, ...]:
    return tuple(s.strip() for s in (v or "").split(",") if s.strip())


def default_cache_dir() -> str:
    return os.environ.get("SSMC_CACHE_DIR") or str(Path.home() / ".cache" / "ssmc")


def make_options(options: Mapping[str, Any] | Options | None = None, **kw) -> Options:
    """Options from the environment, overridden by a mapping (torch.compile's ``options=``)."""
    if isinstance(options, Options):        # checked as a mapping would be (a hand-made Options too)
        options = {f.name: getattr(options, f.name) for f in dataclasses.fields(Options)}
    merged = dict(options or {})
    merged.update(kw)
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(merged) - fields)
    if unknown:
        raise ValueError(f"ssmc: unknown option(s) {unknown}; known options are {sorted(fields)}")
    env_disabled = _split(os.environ.get("SSMC_DISABLE_PASSES"))
    disabled = merged.get("disable_passes", ()) or ()
    if isinstance(disabled, str):
        disabled = _split(disabled)
    if not isinstance(disabled, (list, tuple, set, frozenset)) or not all(isinstance(d, str) for d in disabled):
        raise ValueError(f"ssmc: option disable_passes={disabled!r} must be a list of pass names")
    merged["disable_passes"] = tuple(dict.fromkeys((*env_disabled, *disabled)))
    merged.setdefault("target", os.environ.get("SSMC_TARGET") or "auto")
    merged.setdefault("debug_dir", os.environ.get("SSMC_DEBUG_DIR") or None)
    merged.setdefault("cache_dir", default_cache_dir())
    if merged["cache_dir"] is None or merged["cache_dir"] == "":     # None or "": the default, not the cwd
        merged["cache_dir"] = default_cache_dir()
    if merged["debug_dir"] == "":
        merged["debug_dir"] = None
    merged.setdefault("autotune", os.environ.get("SSMC_AUTOTUNE") or "prune")
    if merged["autotune"] not in _AUTOTUNES:
        raise ValueError(f"ssmc: option autotune={merged['autotune']!r} must be one of {_AUTOTUNES}")
    if merged.get("rest", "auto") not in _RESTS:
        raise ValueError(f"ssmc: option rest={merged['rest']!r} must be one of {_RESTS}")
    m = merged.get("rest_max_nodes", 3000)
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"ssmc: option rest_max_nodes={m!r} must be an int >= 0 (0: no limit)")
    if not isinstance(merged["target"], str):
        raise ValueError(f"ssmc: option target must be a string, got {merged['target']!r}")
    c = merged.get("chunk", 0)
    if isinstance(c, bool) or not isinstance(c, int) or c < 0:
        raise ValueError(f"ssmc: option chunk={c!r} must be an int >= 0 (0: chosen by the state's size)")
    for name in ("deterministic", "validate"):
        if not isinstance(merged.get(name, False), bool):
            raise ValueError(f"ssmc: option {name}={merged[name]!r} must be True or False")
    for name in ("cache_dir", "debug_dir"):
        d = merged.get(name)
        if d is not None:
            if not isinstance(d, (str, os.PathLike)):
                raise ValueError(f"ssmc: option {name}={d!r} must be a path")
            merged[name] = os.fspath(d)
    return Options(**merged)


def check_names(opts: Options, passes, targets) -> None:
    """The pass and target names the options give are loaded ones (or failed plugins of those
    names, see `ssmc.plugins()`): a misspelt name is an error naming it, not a silent no-op."""
    unknown = [p for p in opts.disable_passes if p not in passes]
    if unknown:
        src = " (SSMC_DISABLE_PASSES or disable_passes)" if os.environ.get("SSMC_DISABLE_PASSES") else ""
        raise ValueError(f"ssmc: option disable_passes{src} names {unknown}, not a pass; the passes are "
                         f"{sorted(passes)}")
    if opts.target != "auto" and opts.target not in targets:
        src = " (from SSMC_TARGET)" if os.environ.get("SSMC_TARGET") == opts.target else ""
        raise ValueError(f"ssmc: option target={opts.target!r}{src} is no installed target; the targets are "
                         f"{['auto', *sorted(targets)]}")
