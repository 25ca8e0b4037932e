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
    if isinstance(options, Options):
        return options.with_(**kw) if kw else options
    merged = dict(options or {})
    merged.update(kw)
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(merged) - fields)
    if unknown:
        raise ValueError(f"ssmc: unknown option(s) {unknown}; known options are {sorted(fields)}")
    env_disabled = _split(os.environ.get("SSMC_DISABLE_PASSES"))
    disabled = merged.get("disable_passes", ())
    if isinstance(disabled, str):
        disabled = _split(disabled)
    merged["disable_passes"] = tuple(dict.fromkeys((*env_disabled, *disabled)))
    merged.setdefault("target", os.environ.get("SSMC_TARGET") or "auto")
    merged.setdefault("debug_dir", os.environ.get("SSMC_DEBUG_DIR") or None)
    merged.setdefault("cache_dir", default_cache_dir())
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
    return Options(**merged)
