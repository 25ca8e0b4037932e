"""Kernel targets. Each is a plugin (entry-point group ``ssmc.targets``), ssmc's own included.

A target has a `name`, a `version` (part of every kernel cache key), `supports(region,
strategy, arch, device_type) -> True | reason`, `compile(region, strategy, options) -> kernel`
(an object with ``forward(inputs)`` and ``backward(inputs, grads, needs)``) and
`source(kernel) -> str | None` for ``ssmc.explain``.
"""
