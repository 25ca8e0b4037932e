"""ssmc: a torch.compile backend that turns naive state-space-model loops into fused kernels.

    fast = torch.compile(model, backend="ssmc")        # no import needed: entry point
    print(ssmc.explain(model, *example_inputs))         # regions, passes, strategy, kernels
"""
__version__ = "0.1.0"

import os as _os

# ssmc.passes, ssmc.runtime and ssmc.templates live in the top-level folders passes/, runtime/
# and templates/ (pyproject maps them at install time). In a source checkout, or an editable
# install made by a setuptools without that mapping, find them next to this package.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "passes", "pipeline.py")) and _root not in __path__:
    __path__.append(_root)

import logging as _logging

_logging.getLogger("ssmc").addHandler(_logging.NullHandler())

from .backend import ssmc_backend  # noqa: E402
from .explain import Report, explain  # noqa: E402
from .options import Options, make_options  # noqa: E402
from .plugins import plugins  # noqa: E402
from . import runtime as _runtime  # noqa: E402,F401  (ssmc.runtime is a separate top-level folder)


def _register_ops():
    import ssmc.runtime.op  # noqa: F401  registers torch.ops.ssmc.*


_register_ops()

__all__ = ["ssmc_backend", "explain", "Report", "Options", "make_options", "plugins", "__version__"]
