"""The pipeline: one literal ordered list, and the manager that runs it.

Plugin passes (entry-point group ``ssmc.passes``) go right after the pass they name in
``after``. Each pass can be switched off by name (``options={"disable_passes": [...]}`` or
``SSMC_DISABLE_PASSES``) unless it is `required`.
"""
from __future__ import annotations

import logging
import time

from ssmc.plugins import load as load_plugins

log = logging.getLogger("ssmc")

PIPELINE = ["reroll", "sink_consumers", "split_states", "detect_recurrence", "fuse_prologue", "fuse_epilogue", "block_sparse", "moe_grouping",
            "select_strategy"]


def ordered(passes: dict) -> list:
    """Pass classes in pipeline order; plugins after the pass they declare."""
    names = [n for n in PIPELINE if n in passes]
    extra = [n for n in sorted(passes) if n not in names]
    pending = list(extra)
    while pending:
        progressed = False
        for n in list(pending):
            after = getattr(passes[n], "after", None)
            if after is None:
                names.append(n)
            elif after in names:
                i = names.index(after) + 1
                while i < len(names) and names[i] not in PIPELINE and getattr(passes[names[i]], "after", None) == after:
                    i += 1
                names.insert(i, n)
            else:
                continue
            pending.remove(n)
            progressed = True
        if not progressed:
            for n in pending:
                log.warning("ssmc: pass %s runs after unknown pass %r; appended at the end",
                            n, getattr(passes[n], "after", None))
            names.extend(pending)
            break
    return [passes[n] for n in names]


class PassRecord:
    def __init__(self, name, ms, changed, skipped="", plugin=""):
        self.name, self.ms, self.changed, self.skipped, self.plugin = name, ms, changed, skipped, plugin

    def __iter__(self):  # name, milliseconds, changed
        return iter((self.name, self.ms, self.changed))

    def __repr__(self):
        return f"PassRecord({self.name!r}, {self.ms:.2f} ms, changed={self.changed}{', ' + self.skipped if self.skipped else ''})"


class PassFailed(RuntimeError):
    """A pass raised: its name and package, the error after them."""


def run_pipeline(ctx, dump=None) -> list[PassRecord]:
    loaded = load_plugins()
    passes = loaded.loaded("ssmc.passes")
    origin = {p.name: p.package for p in loaded if p.group == "ssmc.passes"}
    records = []
    disabled = set(ctx.options.disable_passes)
    unknown = disabled - set(passes)
    for n in sorted(unknown):
        ctx.note(f"disable_passes names {n!r}, which is not a loaded pass")
    for i, cls in enumerate(ordered(passes), start=1):
        name = cls.name
        if name in disabled and not getattr(cls, "required", False):
            records.append(PassRecord(name, 0.0, False, "disabled", origin.get(name, "")))
            continue
        if name in disabled:
            ctx.note(f"pass {name} is required by later passes and cannot be disabled")
        t0 = time.perf_counter()
        try:
            changed = bool(cls().run(ctx))
        except Exception as e:      # the graph then runs as captured; the reason names the pass
            raise PassFailed(f"pass {name} (from {origin.get(name, '?')}) raised {type(e).__name__}: {e}") from e
        ms = (time.perf_counter() - t0) * 1e3
        records.append(PassRecord(name, ms, changed, "", origin.get(name, "")))
        log.debug("ssmc: pass %s: %.1f ms, changed=%s", name, ms, changed)
        if dump is not None:
            dump(i, name, ctx)
    return records
