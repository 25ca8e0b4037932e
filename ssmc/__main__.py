"""``python -m ssmc explain path/to/file.py:factory [--option key=value ...]``

`factory()` returns ``(fn_or_module, example_inputs_tuple)``; the ssmc report is printed.
``python -m ssmc plugins`` lists the loaded passes and targets.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _load_factory(spec: str):
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise SystemExit(f"expected path/to/file.py:factory, got {spec!r}")
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"no such file: {path}")
    mod_spec = importlib.util.spec_from_file_location(p.stem, p)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[p.stem] = mod
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, name):
        raise SystemExit(f"{path} has no function {name!r}")
    return getattr(mod, name)


def _parse_opt(s: str):
    """key=value, the value read as the option's type (Options' default says which): a list of
    names, True/False, an int, else the string as given (a directory named 2024 stays a path)."""
    import dataclasses
    from ssmc.options import Options
    k, _, v = s.partition("=")
    default = {f.name: f.default for f in dataclasses.fields(Options)}.get(k)
    if k == "disable_passes":
        return k, [x for x in v.split(",") if x]
    if isinstance(default, bool) and v.lower() in ("true", "false"):
        return k, v.lower() == "true"
    if isinstance(default, int) and not isinstance(default, bool):
        try:
            return k, int(v)
        except ValueError:
            return k, v
    return k, v


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ssmc")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("explain", help="compile a factory's model with ssmc and print the report")
    e.add_argument("factory", help="path/to/file.py:factory, factory() -> (fn, example_inputs)")
    e.add_argument("--option", "-o", action="append", default=[], help="key=value ssmc option")
    sub.add_parser("plugins", help="list loaded passes and targets")
    args = ap.parse_args(argv)
    import ssmc
    if args.cmd == "plugins":
        print(ssmc.plugins())
        return 0
    fn, inputs = _load_factory(args.factory)()
    opts = dict(_parse_opt(s) for s in args.option)
    try:
        ssmc.make_options(opts)            # a bad option: its message, not a traceback
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(ssmc.explain(fn, *inputs, **opts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
