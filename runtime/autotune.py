"""Choosing between targets by measured time.

On ``target="auto"`` with several generated targets supporting a region (cuda and triton on a
GPU), `MeasuredChoice` runs each on the first real inputs of a shape bucket, times them (wall
clock between device synchronisations, batches of calls interleaved over rounds, the median
kept), and keeps the fastest. The decision is stored in
the kernel cache, keyed by the region, the arch, the shape bucket and the targets' versions,
so a second process decides nothing. `describe()` says which won and by how much, for ssmc.explain.
"""
from __future__ import annotations

import json
import logging
import math

import torch

from .cache import cache_key, get_cache

log = logging.getLogger("ssmc")


def shape_bucket(inputs) -> tuple:
    """Input shapes with every size rounded up to a power of two, and the dtypes."""
    def up(n):
        return 1 << max(0, math.ceil(math.log2(max(1, n))))
    return tuple((tuple(up(s) for s in x.shape), str(x.dtype).replace("torch.", "")) for x in inputs)


def _time_all(fns: dict, rounds: int, batch_ms: float = 2.0) -> tuple[dict, dict]:
    """Milliseconds per call of each fn, wall clock between device-wide synchronisations:
    whatever stream a target launches on, and its launch overhead, are counted. Each fn runs
    in batches of calls that take about `batch_ms` (a 0.1 ms kernel timed alone is mostly
    noise), the candidates' batches interleaved over `rounds` rounds (clocks and caches drift
    alike for all), the median round kept. Returns (times, errors)."""
    import statistics
    import time
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls, errors = {}, {}
    for name, fn in fns.items():
        try:
            fn()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            one = (time.perf_counter() - t0) * 1e3
            calls[name] = max(1, min(1000, math.ceil(batch_ms / max(one, 1e-3))))
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    samples = {n: [] for n in calls}
    for _ in range(rounds):
        for name in list(samples):
            try:
                sync()
                t0 = time.perf_counter()
                for _ in range(calls[name]):
                    fns[name]()
                sync()
                samples[name].append((time.perf_counter() - t0) * 1e3 / calls[name])
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
                del samples[name]
    return {n: statistics.median(s) for n, s in samples.items()}, errors


class MeasuredChoice:
    """A kernel that is the fastest of several, decided per shape bucket on first use."""

    def __init__(self, region, kernels: dict, versions: dict, cache_dir: str, reps: int = 10):
        self.region, self.kernels, self.versions = region, dict(kernels), versions
        self.cache = get_cache(cache_dir)
        self.reps = reps
        self.decided: dict = {}          # bucket -> target name
        self.exact: dict = {}            # the inputs' exact (shape, dtype)s -> target name
        self.timings: dict = {}          # bucket -> {target: ms}
        self.errors: dict = {}

    def _key(self, bucket, arch) -> str:
        return cache_key("choice", self.region.key(), arch, bucket, sorted(self.versions.items()))

    def choose(self, inputs) -> str:
        exact = tuple((x.shape, x.dtype) for x in inputs)
        hit = self.exact.get(exact)
        if hit is not None:           # the per-call path: one dict lookup
            return hit
        bucket = shape_bucket(inputs)
        if bucket not in self.decided:
            self._decide(bucket, inputs)
        self.exact[exact] = self.decided[bucket]
        return self.decided[bucket]

    def _decide(self, bucket, inputs) -> None:
        """Fills decided[bucket] and timings[bucket], from the disk cache or by timing."""
        dev = inputs[0].device
        arch = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else "cpu"
        key = self._key(bucket, arch)
        raw = self.cache.get(key, "choice.json")
        if raw is not None:
            rec = json.loads(raw)
            if rec.get("target") in self.kernels:
                self.decided[bucket], self.timings[bucket] = rec["target"], rec.get("timings", {})
                return
        ready = {}
        for name, k in self.kernels.items():
            try:
                k.forward(list(inputs))                       # compiles / autotunes
                ready[name] = (lambda k=k: k.forward(list(inputs)))
            except Exception as e:
                self.errors[name] = f"{type(e).__name__}: {e}"
                log.warning("ssmc: target %s failed while being timed: %s", name, e)
        times, errors = _time_all(ready, self.reps)
        self.errors.update(errors)
        if not times:
            raise RuntimeError(f"every target failed: {self.errors}")
        best = min(times, key=times.get)
        self.decided[bucket], self.timings[bucket] = best, times
        self.cache.put(key, "choice.json", json.dumps({"target": best, "timings": times}).encode())
        log.info("ssmc: region %s: %s", self.region.name, self.describe())

    def forward(self, inputs):
        return self.kernels[self.choose(inputs)].forward(inputs)

    def backward(self, inputs, grads, needs):
        return self.kernels[self.choose(inputs)].backward(inputs, grads, needs)

    def backward_note(self) -> str | None:
        notes = {n: getattr(k, "backward_note", lambda: None)() for n, k in self.kernels.items()}
        return "; ".join(f"{n}: {v}" for n, v in notes.items() if v) or None

    def describe(self) -> str:
        parts = []
        for bucket, times in self.timings.items():
            best = self.decided[bucket]
            others = ", ".join(f"{n} {ms:.3f} ms ({ms / times[best]:.2f}x)" for n, ms in sorted(times.items())
                               if n != best)
            parts.append(f"measured: {best} {times[best]:.3f} ms" + (f" beats {others}" if others else ""))
        for n, e in self.errors.items():
            parts.append(f"{n} failed when timed: {e}")
        return "; ".join(parts) or f"measured choice among {', '.join(self.kernels)} on the first call"
