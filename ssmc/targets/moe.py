"""Grouped kernels: one region run for every expert of a mixture (passes/moe_grouping.py).

A grouped kernel takes one input list per group (expert) and returns one output list per
group. `GroupedKernel` is the portable one: it runs the member kernel (any target) once per
group; on CPU that is the torch reference. `GroupedTritonKernel` runs all groups in one launch
of templates/triton/moe_scan_fwd.py.j2: programs are (group, sequence, block of channels), each
group's state tile is the next power of two of its own state size (a static branch per tile
present), so padding never reaches beyond a group's own tile. The body per tile is the
single-expert kernel's (the same macros and printed variants as ssmc/targets/triton.py):
config "variant" "loop" (sequential steps), "scan" (tl.associative_scan over chunks of
steps), "seq<S>" (a row's steps in one thread's registers, S state elements a lane; every state
tile gets TILE / tile channels a program, so all programs have the same lanes and work per
step) or "seqn<Q>" (the same body with Q lanes a row at every tile), autotuned with the rest of
the config. `GroupedTritonKernel.backward` runs all groups in one launch of
templates/triton/moe_scan_bwd.py.j2: the single-region backward kernel's bodies
(ssmc/targets/triton_bwd.py; its seq layout where the region offers it, else its scan layout),
one config per state tile, each group's scratch and gradient buffers (per-program slots of the
gradients its programs share included) as that kernel's launch for the group would have them;
what it declines runs the member kernel's backward per group (``bwd_fallback`` says why).

`padding(stats)` is what ``ssmc.explain`` shows: per group its sequences, state size and tile,
and the work computed on padding against the useful work.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import math
import time

import torch

from ssmc import ir
from ssmc.ir import Region

TEMPLATE = "triton/moe_scan_fwd.py.j2"
BWD_TEMPLATE = "triton/moe_scan_bwd.py.j2"
CONFIGS = "triton/moe_scan_fwd.configs.json"


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def group_sizes(r: Region, inputs) -> tuple[dict, int]:
    sizes = {a: int(inputs[i].shape[d]) for a, (i, d) in zip(r.axes, r.axis_size)}
    return sizes, int(inputs[r.length[0]].shape[r.length[1]])


def reg_axis(r: Region) -> str | None:
    """The state axis the readout sums over (held whole per program, padded to a tile): a sum
    over one state axis of something that reads the state (not a sum over channels inside an
    input's projection, ``x_t @ WC``, which reads no state)."""
    for o in r.outputs:
        for x in ir.walk(o.expr):
            if isinstance(x, ir.Reduce) and len(x.axes) == 1 and x.axes[0] in r.axes and ir.uses_state(x.arg):
                return x.axes[0]
    return r.axes[-1] if r.axes else None


def padding(r: Region, groups, block_d: dict | None = None) -> dict:
    """Work per group in state-element steps: useful (its own sizes), computed (its tile, and
    its channel blocks when `block_d` maps tile -> channels per program), and what padding
    every group to the largest state would cost."""
    reg = reg_axis(r)
    rows = []
    for ins in groups:
        sizes, L = group_sizes(r, ins)
        n = sizes.get(reg, 1)
        other = math.prod(s for a, s in sizes.items() if a != reg)
        tile = _pow2(n)
        chan = other
        if block_d and len(r.axes) > 1:         # channels rounded up to whole blocks
            d = sizes[[a for a in r.axes if a != reg][-1]]
            bd = block_d.get(tile, 1)
            chan = other // max(d, 1) * (-(-d // bd) * bd)
        rows.append({"sequences": sizes.get(r.axes[0], 1) if r.axes[0] != reg else 1,
                     "state": n, "tile": tile, "useful": other * n * L, "computed": chan * tile * L,
                     "other": other, "L": L})
    useful = sum(g["useful"] for g in rows)
    computed = sum(g["computed"] for g in rows)
    top = max((g["tile"] for g in rows), default=1)
    padmax = sum(g["other"] * top * g["L"] for g in rows)
    return {"groups": rows, "useful": useful, "computed": computed,
            "wasted_fraction": (computed - useful) / useful if useful else 0.0,
            "wasted_fraction_if_padded_to_max": (padmax - useful) / useful if useful else 0.0}


def describe_padding(p: dict) -> str:
    parts = [f"g{i}: {g['sequences']} seq, state {g['state']} -> tile {g['tile']}"
             for i, g in enumerate(p["groups"])]
    return (f"{len(p['groups'])} groups ({'; '.join(parts)}); padded work "
            f"{100 * p['wasted_fraction']:.1f}% of useful work (padding all to the largest "
            f"state: {100 * p['wasted_fraction_if_padded_to_max']:.1f}%)")


class GroupedKernel:
    """Every group through the member kernel, one call each (any target; the CPU path)."""
    kind = "per-group calls"

    def __init__(self, region: Region, member):
        self.region, self.member = region, member
        self.stats: dict | None = None
        self.launches = 0
        self.bwd_launches = 0                  # launches of the last backward

    def forward(self, groups):
        self.stats = padding(self.region, groups)
        self.launches = sum(1 for g in groups if _rows(self.region, g))
        return [self.member.forward(ins) if _rows(self.region, ins) else _empty(self.region, ins)
                for ins in groups]

    def backward(self, groups, grads, needs):
        """Per group, the member kernel's backward (`needs`: one list per group)."""
        out = []
        self.bwd_launches = sum(1 for g in groups if _rows(self.region, g))
        for ins, gs, nd in zip(groups, grads, needs):
            if _rows(self.region, ins):
                out.append(self.member.backward(ins, gs, nd))
            else:
                out.append([torch.zeros_like(x) if n else None for x, n in zip(ins, nd)])
        return out

    def describe(self) -> str:
        if self.stats is None:
            return "grouped: not run yet"
        how = "one Triton launch" if self.launches == 1 and self.kind == GroupedTritonKernel.kind \
            else f"{self.launches} launch(es), one per group with work"
        return f"last run: {how}; {describe_padding(self.stats)}"


def _rows(r: Region, ins) -> int:
    sizes, L = group_sizes(r, ins)
    return math.prod(sizes.values()) * L


def _empty(r: Region, ins):
    sizes, L = group_sizes(r, ins)
    dev = ins[0].device
    return [torch.zeros([L if ix == "t" else 1 if ix == 1 else sizes[ix] for ix in o.index],
                        dtype=ir.to_dtype(o.dtype), device=dev) for o in r.outputs]


@functools.lru_cache(maxsize=None)
def load_configs() -> dict:
    return json.loads((importlib.resources.files("ssmc.templates") / CONFIGS).read_text())


def variant_of(config: dict) -> str:
    """A config's variant ("loop" when it names none)."""
    return str(config.get("variant", "loop"))


def config_variants() -> list[str]:
    """Every variant the config table names, in its order: one entry kernel each."""
    return list(dict.fromkeys(variant_of(c) for v in load_configs().values() if isinstance(v, list) for c in v))


def _seq_states(variant: str, tile: int, states=(2, 4, 8)) -> int | None:
    """State elements a lane for a state tile under a seq variant: "seq<S>", the largest S' <= S
    that divides the tile; "seqn<Q>", Q lanes a row at every tile (S' = tile / Q, within the
    rendered states, the nearest below); None (the loop body) where none fits (tiles below 2)."""
    if not variant.startswith("seq"):
        return None
    want = tile // int(variant[4:]) if variant.startswith("seqn") else int(variant[3:])
    fit = [s for s in states if s <= max(want, min(states)) and s <= tile and tile % s == 0]
    return max(fit) if fit else None


def _seq_body(variant: str, tile: int, states) -> str | None:
    """The body function a seq entry runs for a state tile (None: the loop body)."""
    s = _seq_states(variant, tile, states) if states else None
    return f"seq{s}" if s else None


def entry_name(r: Region, config: dict) -> str:
    """The grouped template's entry kernel for a config's variant ("loop" when it names none)."""
    from .triton import kernel_name
    return f"{kernel_name(r)}_moe_grouped_{variant_of(config)}"


def tile_params(config: dict, tiles, d_max: int | None = None, L_max: int | None = None) -> dict:
    """tile -> (BD, CH): channels per program and time steps per chunk for that state tile.
    BD = TILE / tile (a power of two, at least 1, at most the channel count rounded up); CH =
    CHUNK, at most the longest length rounded up; for the scan variant, whose chunk is a
    (BD, tile, CH) tile of registers, CH is halved until that tile is at most TILE * CHUNK
    (states larger than TILE, where BD is already 1). Variant "seqn<Q>" takes no TILE: its rows
    have Q lanes at every tile (S = tile / Q state elements a lane), BD = 32 num_warps / Q."""
    out = {}
    variant = variant_of(config)
    for t in tiles:
        if variant.startswith("seqn"):          # 32 lanes a warp: BD rows of Q lanes at every tile
            s = _seq_states(variant, t) or 1
            bd = max(1, 32 * int(config.get("num_warps", 1)) * s // t)
        else:
            bd = max(1, _pow2(max(1, config["TILE"] // t)))
        if d_max is not None:
            bd = min(bd, _pow2(d_max))
        ch = max(1, int(config["CHUNK"]))
        if L_max is not None:
            ch = min(ch, _pow2(max(1, L_max)))
        if variant == "scan":
            while ch > 1 and bd * t * ch > config["TILE"] * config["CHUNK"]:
                ch //= 2
        out[t] = (bd, ch)
    return out


class GroupedTritonKernel(GroupedKernel):
    """All groups in one launch of the grouped Triton template (see the module docstring)."""
    kind = "one Triton launch"

    def __init__(self, region: Region, member, options, arch=None):
        from .triton import make_plan
        super().__init__(region, member)
        plan = make_plan(region)
        if isinstance(plan, str):
            raise ValueError(f"grouped Triton kernel: {plan}")
        self.plan, self.options, self.arch = plan, options, arch
        self.chosen: dict = {}
        self.config: dict | None = None
        self.ran: str | None = None            # the entry kernel of the last launch
        self.timings: dict = {}                # bucket -> {config json: ms} of the last search
        self.fallback: str | None = None
        self.sources: dict = {}                # (cdt, tiles) -> (source, path)
        self._table_key = None
        self._table = None
        self.fields = self._fields()
        names = [n for n, _ in self.fields]
        self._size_n = names.index("SIZE_N") if "SIZE_N" in names else None
        self._bwd = None                       # the single-region backward kernel, or why none
        self.bwd_fallback: str | None = None   # why the last backward ran per group (None: one launch)
        self.bwd_configs: dict = {}            # tile -> backward config of the last one-launch backward
        self.bwd_sources: dict = {}            # (cdt, tiles, consts) -> source
        from .triton import _print_seq
        # the seq variants exist where the single-expert kernel has them (a register axis whose
        # sum is the readout, no per-step output indexing it)
        self.has_seq = bool(plan.reg) and _print_seq(region, plan, "tl.float32") is not None

    def _fields(self) -> list:
        """The per-group table row after (first program, channel blocks, tile): per pointer
        argument of the body its element offset, then its strides; then the sizes."""
        from .triton import kernel_args
        r, p = self.region, self.plan
        args = kernel_args(r, p)
        fields = []
        for a in args:
            if a.endswith("_ptr"):
                k = a[:-4]
                n = r.inputs[int(k[2:])].ndim if k.startswith("in") else len(r.outputs[int(k[3:])].index)
                fields += [(a, "offset")] + [(f"{k}_s{d}", "int") for d in range(n)]
        return fields + [(a, "int") for a in args if a.startswith("size_") or a in ("SIZE_D", "SIZE_N", "L")]

    # -- source ----------------------------------------------------------------------------------
    def render(self, cdt: str, tiles: tuple, consts: tuple = ()) -> str:
        from .triton import SEQ_STATES, _env, _print_seq, _print_variant, kernel_args, kernel_name
        r, p = self.region, self.plan
        args = kernel_args(r, p)
        ptrs = [a for a in args if a.endswith("_ptr")]
        fields = self.fields
        seq = _print_seq(r, p, cdt) if self.has_seq else None
        states = SEQ_STATES if seq is not None else ()
        return _env().get_template(TEMPLATE).render(
            region_name=r.name, region_key=r.key(), region_text=str(r), cdt=cdt,
            kname=kernel_name(r) + "_moe", plan=p, tiles=list(tiles),
            args=[", ".join(args) + ","], bases=[", ".join(ptrs) + ","], fields=fields,
            row=3 + len(fields), call=", ".join(args), consts=dict(consts),
            loop=_print_variant(r, p, cdt, False), scan=_print_variant(r, p, cdt, True),
            seq=seq, seq_states=states,
            variants=[v for v in dict.fromkeys(["loop", "scan", *config_variants()])
                      if states or not v.startswith("seq")],
            seq_body_for=lambda v, t: _seq_body(v, t, states))

    def module(self, cdt: str, tiles: tuple, consts: tuple = ()):
        """The kernel module for a compute dtype, the tiles present and `consts`: strides that
        are 0 or 1 in every group (printed as literals) and offsets that are multiples of 16
        bytes in every group (declared so): unit strides and aligned rows give wide loads."""
        from ssmc.runtime.cache import cache_key, get_cache
        from .triton import import_source
        if (cdt, tiles, consts) not in self.sources:
            self.sources[(cdt, tiles, consts)] = self.render(cdt, tiles, consts)
        src = self.sources[(cdt, tiles, consts)]
        return import_source(src, cache_key("triton-moe-source", src), get_cache(self.options.cache_dir))[0]

    def source(self) -> str:
        if not self.sources:
            self.sources[("tl.float32", (16,), ())] = self.render("tl.float32", (16,))
        return "\n".join(self.sources.values())

    def signature(self, config: dict, tiles: tuple, dtypes: dict | None = None, consts: tuple = ()):
        """(jit function, signature, constexprs) for a compile-only ``triton.compile`` (no GPU
        needed): base pointers typed by the region's dtypes (`dtypes`: input index -> torch
        dtype overrides), the table int64, the group count int32."""
        from .triton import _TL_PTR
        r = self.region
        dts = {i: ir.to_dtype(s.dtype) for i, s in enumerate(r.inputs)}
        dts.update(dtypes or {})
        sig = {}
        for name, kind in self.fields:
            if kind == "offset":
                k = name[:-4]
                dt = dts[int(k[2:])] if k.startswith("in") else ir.to_dtype(r.outputs[int(k[3:])].dtype)
                sig[name] = "*" + _TL_PTR[dt]
        sig.update({"table_ptr": "*i64", "G": "i32"})
        cx = {}
        for t, (bd, ch) in tile_params(config, tiles).items():
            sig[f"BD_{t}"] = sig[f"CH_{t}"] = "constexpr"
            cx[f"BD_{t}"], cx[f"CH_{t}"] = bd, ch
            if variant_of(config).startswith("seq"):
                sig[f"EVEN_{t}"], cx[f"EVEN_{t}"] = "constexpr", True
        cdt = "tl.float64" if torch.float64 in dts.values() else "tl.float32"
        mod = self.module(cdt, tuple(tiles), tuple(consts))
        return getattr(mod, entry_name(r, config)), sig, cx

    # -- launching ---------------------------------------------------------------------------------
    def _why_not(self, groups) -> str | None:
        from .triton import _TL_PTR, MAX_BLOCK_N, interpreting
        live = [g for g in groups if _rows(self.region, g)]
        if not live:
            return "no group has work"
        dev = live[0][0].device
        if dev.type == "cpu" and not interpreting():
            return "CPU tensors without TRITON_INTERPRET=1"
        if dev.type not in ("cpu", "cuda"):
            return f"device {dev.type}"
        for ins in live:
            for x in ins:
                if x.dtype not in _TL_PTR:
                    return f"input dtype {x.dtype}"
            sizes, _ = group_sizes(self.region, ins)
            if self.plan.reg and _pow2(sizes[self.plan.reg]) > MAX_BLOCK_N:
                return f"a state of {sizes[self.plan.reg]} > {MAX_BLOCK_N} elements"
        return None

    def _layout(self, groups, outs, config):
        """(base tensors, table rows, number of programs, tiles, tile -> (BD, CH)) for one launch."""
        r, p = self.region, self.plan
        from .triton import kernel_args
        live = [i for i, g in enumerate(groups) if _rows(r, g)]
        tiles = tuple(sorted({_pow2(group_sizes(r, groups[i])[0][p.reg]) if p.reg else 1 for i in live}))
        d_max = max(group_sizes(r, groups[i])[0][p.block] if p.block else 1 for i in live)
        L_max = max(group_sizes(r, groups[i])[1] for i in live)
        tp = tile_params(config, tiles, d_max, L_max)
        bd = {t: b for t, (b, _) in tp.items()}
        tensors = {}
        for i in live:
            ins, os_ = groups[i], outs[i]
            for k in p.inputs:
                tensors.setdefault(f"in{k}_ptr", []).append(ins[k])
            for k, o in enumerate(os_):
                tensors.setdefault(f"out{k}_ptr", []).append(o)
        bases = {}
        for name, ts in tensors.items():
            bases[name] = max(ts, key=lambda x: x.numel())
        rows, start = [], 0
        for i in live:
            ins, os_ = groups[i], outs[i]
            sizes, L = group_sizes(r, ins)
            tile = _pow2(sizes[p.reg]) if p.reg else 1
            d = sizes[p.block] if p.block else 1
            nblk = -(-d // bd[tile])
            nrows = math.prod(sizes[a] for a in p.scalars)
            vals = {}
            for k in p.inputs:
                vals[f"in{k}"] = ins[k]
            for k, o in enumerate(os_):
                vals[f"out{k}"] = o
            row = [start, nblk, tile]
            for name, kind in self.fields:
                if kind == "offset":
                    x, base = vals[name[:-4]], bases[name]
                    diff = x.data_ptr() - base.data_ptr()
                    if diff % x.element_size() or x.dtype != base.dtype:
                        raise ValueError("group tensors are not aligned to one element type")
                    row.append(diff // x.element_size())
                elif name.startswith(("in", "out")) and "_s" in name:
                    t, dd = name.rsplit("_s", 1)
                    x, dd = vals[t], int(dd)
                    row.append(0 if x.shape[dd] == 1 else x.stride(dd))
                elif name.startswith("size_"):
                    row.append(sizes[name[5:]])
                elif name == "SIZE_D":
                    row.append(d)
                elif name == "SIZE_N":
                    row.append(sizes[p.reg] if p.reg else 1)
                elif name == "L":
                    row.append(L)
                else:
                    raise ValueError(f"unknown table field {name}")
            rows.append(row)
            start += nrows * nblk
        return bases, rows, start, tiles, tp

    def launch(self, groups, config, outs=None):
        r = self.region
        outs = [_empty(r, g) for g in groups] if outs is None else outs
        bases, rows, nprog, tiles, tp = self._layout(groups, outs, config)
        if nprog == 0:
            return outs
        dev = next(iter(bases.values())).device
        key = (tuple(rows[i][j] for i in range(len(rows)) for j in range(len(rows[i]))), str(dev))
        if key != self._table_key:
            self._table = torch.tensor(rows, dtype=torch.int64).to(dev)
            self._table_key = key
        cdt = "tl.float64" if any(x.dtype == torch.float64 for g in groups for x in g) else "tl.float32"
        consts = []
        for j, (name, kind) in enumerate(self.fields):
            col = [r[3 + j] for r in rows]
            if kind == "offset":       # every group's tensor 16-byte aligned: wide loads stay possible
                base = bases[name]
                vec = 16 // base.element_size()
                if base.data_ptr() % 16 == 0 and all(v % vec == 0 for v in col):
                    consts.append((name, vec))
            elif "_s" in name and col[0] in (0, 1) and all(v == col[0] for v in col):
                consts.append((name, col[0]))
        consts = tuple(consts)
        mod = self.module(cdt, tiles, consts)
        fn = getattr(mod, entry_name(r, config))
        from .triton import launch_options
        extra = launch_options(config, dev)
        names = [n for n, k in self.fields if k == "offset"]
        cx = {}
        for t, (bd, ch) in tp.items():
            cx[f"BD_{t}"], cx[f"CH_{t}"] = bd, ch
            if variant_of(config).startswith("seq"):
                cx[f"EVEN_{t}"] = all(row[2] != t or row[3 + self._size_n] == t for row in rows)
        fn[(nprog,)](*[bases[n] for n in names], self._table, len(rows), **cx, **extra)
        self.stats = padding(r, groups, {t: bd for t, (bd, _) in tp.items()})
        self.launches = 1
        self.ran = entry_name(r, config)
        return outs

    def forward(self, groups):
        why = self._why_not(groups)
        if why is not None:
            self.fallback = f"per-group calls on the last run: {why}"
            return super().forward(groups)
        self.fallback = None
        from .triton import _arch, arch_key
        dev = next(g[0].device for g in groups if _rows(self.region, g))
        arch = _arch(dev) if dev.type == "cuda" else None
        outs = [_empty(self.region, g) for g in groups]
        config = self._config(groups, arch, outs)
        self.config = config
        return self.launch(groups, config, outs)

    def _config(self, groups, arch, outs) -> dict:
        from .triton import arch_key
        cands = [c for c in load_configs()[arch_key(arch)]
                 if self.has_seq or not variant_of(c).startswith("seq")]
        live = [g for g in groups if _rows(self.region, g)]
        bucket = (arch_key(arch), tuple(x.dtype for x in live[0]),
                  tuple(sorted(_pow2(group_sizes(self.region, g)[0].get(self.plan.reg, 1)) for g in live)),
                  _pow2(sum(_rows(self.region, g) for g in live)))
        if bucket in self.chosen:
            return self.chosen[bucket]
        if len(cands) == 1 or live[0][0].device.type != "cuda":
            self.chosen[bucket] = cands[0]
            return cands[0]
        times = {}
        for c in cands:
            try:
                self.launch(groups, c, outs)
                torch.cuda.synchronize()
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(5):
                    self.launch(groups, c, outs)
                t1.record()
                torch.cuda.synchronize()
                times[json.dumps(c, sort_keys=True)] = t0.elapsed_time(t1) / 5
            except Exception as e:  # a config out of registers: the next one
                self.fallback = f"config {c} failed: {type(e).__name__}: {e}"
        self.timings[bucket] = times
        if not times:
            raise RuntimeError(f"every grouped Triton config failed: {self.fallback}")
        best = json.loads(min(times, key=times.get))
        self.chosen[bucket] = best
        return best

    # -- backward ---------------------------------------------------------------------------------
    def bwd_kernel(self):
        """The single-region backward kernel (triton_bwd.BackwardKernel) whose bodies, configs
        and buffers the grouped backward uses (made once), or why there is none."""
        if self._bwd is None:
            from .triton_bwd import BackwardKernel, make_bwd_plan
            plan = make_bwd_plan(self.region)
            if isinstance(plan, str):
                self._bwd = plan
            else:
                try:
                    self._bwd = BackwardKernel(self.region, getattr(self.member, "strategy", "chunked_scan"),
                                               plan, self.options, self.arch)
                except Exception as e:      # a render or import failure: per-group calls
                    self._bwd = f"backward kernel failed to build: {type(e).__name__}: {e}"
        return self._bwd

    def _bwd_fields(self) -> list:
        """The per-group table row after (first program, programs, tile): per argument of the
        backward bodies (triton_bwd.kernel_args) its element offset (pointers) or its value."""
        from .triton_bwd import kernel_args
        return [(a, "offset" if a.endswith("_ptr") else "int") for a in kernel_args(self.region, self._bwd.plan)]

    def render_bwd(self, cdt: str, tiles: tuple, consts: tuple = ()) -> str:
        """The grouped backward's source; `tiles`: ((state tile, body variant), ...) present."""
        from .triton import _env, kernel_name
        from .triton_bwd import bwd_pieces, kernel_args
        r, bp = self.region, self._bwd.plan
        args = kernel_args(r, bp)
        fields = self._bwd_fields()
        return _env().get_template(BWD_TEMPLATE).render(**{
            **bwd_pieces(r, bp, cdt), "kname": kernel_name(r) + "_moe", "tiles": list(tiles),
            "body_variants": sorted({v for _, v in tiles}), "fields": fields, "row": 3 + len(fields),
            "bases": [", ".join(a for a in args if a.endswith("_ptr")) + ","], "call": ", ".join(args),
            "consts": dict(consts), "need_kw": "".join(f", NEED_{i}=NEED_{i}" for i in bp.grad_inputs(r))})

    def bwd_module(self, cdt: str, tiles: tuple, consts: tuple = ()):
        from ssmc.runtime.cache import cache_key, get_cache
        from .triton import import_source
        key = (cdt, tiles, consts)
        if key not in self.bwd_sources:
            self.bwd_sources[key] = self.render_bwd(cdt, tiles, consts)
        src = self.bwd_sources[key]
        return import_source(src, cache_key("triton-moe-bwd-source", src), get_cache(self.options.cache_dir))[0]

    def bwd_entry(self) -> str:
        from .triton import kernel_name
        return f"{kernel_name(self.region)}_moe_grouped_bwd"

    def bwd_signature(self, configs: dict, dtypes: dict | None = None, consts: tuple = ()):
        """(jit function, signature, constexprs) of the grouped backward for a compile-only
        ``triton.compile``: `configs` maps each state tile to its backward config; pointers
        typed as BackwardKernel.signature types them (`dtypes`: input index -> torch dtype
        overrides), every gradient needed, the seq bodies' masks constant."""
        from .triton import _seq_states
        from .triton_bwd import _seg
        bk = self.bwd_kernel()
        if isinstance(bk, str):
            raise ValueError(f"grouped Triton backward: {bk}")
        _, one, _ = bk.signature(next(iter(configs.values())), dtypes=dtypes)
        sig = {n: one[n] for n, kind in self._bwd_fields() if kind == "offset"}
        sig.update({"flag_ptr": "*i32", "table_ptr": "*i64", "G": "i32"})
        cx = {}
        for t, c in sorted(configs.items()):
            cx[f"BD_{t}"], cx[f"CH_{t}"] = c["BLOCK_D"], c["CHUNK"]
            if _seq_states(c):
                cx.update({f"EVEN_N_{t}": True, f"EVEN_D_{t}": True, f"EVEN_L_{t}": True, f"SEG_{t}": _seg(c)})
        cx["DETERMINISTIC"] = bk.deterministic
        cx.update({f"NEED_{i}": True for i in bk.plan.grad_inputs(self.region)})
        sig.update({k: "constexpr" for k in cx})
        dts = [ir.to_dtype(x.dtype) for x in self.region.inputs] + list((dtypes or {}).values())
        cdt = "tl.float64" if torch.float64 in dts else "tl.float32"
        tiles = tuple((t, c.get("variant", "scan")) for t, c in sorted(configs.items()))
        return getattr(self.bwd_module(cdt, tiles, tuple(consts)), self.bwd_entry()), sig, cx

    def _why_not_bwd(self, groups, grads) -> str | None:
        from .triton_bwd import _Call
        why = self._why_not(groups)
        if why is not None:
            return why
        bk = self.bwd_kernel()
        if isinstance(bk, str):
            return f"no Triton backward for the region: {bk}"
        for ins, gs in zip(groups, grads):
            if _rows(self.region, ins):
                call = _Call(ins, gs, [False] * len(ins))
                why = bk._why_not(call, *bk.sizes(call))
                if why is not None:
                    return why
        return None

    def _bwd_configs(self, bk, calls: dict, tile_of: dict, arch) -> dict:
        """tile -> the backward config its groups run: the single-region kernel's first
        candidate for the tile's largest group, a seq one where it offers one (its recurrences
        run in a thread's registers), with the largest tile's num_warps where a candidate has
        it (one launch compiles for one num_warps: another tile's config runs with it too)."""
        from .triton import _seq_states
        cands = {}
        for t in sorted(set(tile_of.values())):
            big = max((calls[i] for i in calls if tile_of[i] == t), key=lambda c: _rows(self.region, c))
            got = bk.candidates(big, arch)
            cands[t] = [c for c in got if _seq_states(c)] + [c for c in got if not _seq_states(c)]
        warps = cands[max(cands)][0]["num_warps"]
        return {t: next((c for c in cs if c["num_warps"] == warps), cs[0]) for t, cs in cands.items()}

    def launch_bwd(self, groups, grads, needs) -> list:
        """One launch of the grouped backward for every group with work; the gradients per
        group (None where its `needs` is false). Raises _Declined where the groups' tensors
        cannot share a base pointer."""
        from .triton import _arch, _seq_states, launch_options
        from .triton_bwd import _Call, _seg, _zero_flag
        r, bk = self.region, self._bwd
        bp = bk.plan
        live = [i for i, g in enumerate(groups) if _rows(r, g)]
        # NEED_<i> are constexprs of the launch: what any group needs (the rest dropped after)
        need = [any(needs[i][k] for i in live) for k in range(len(r.inputs))]
        calls = {i: _Call(groups[i], grads[i], need) for i in live}
        tile_of = {i: _pow2(bk.sizes(calls[i])[0][bp.reg]) if bp.reg else 1 for i in live}
        dev = groups[live[0]][0].device
        cfg = self._bwd_configs(bk, calls, tile_of, _arch(dev) if dev.type == "cuda" else None)
        fields = self._bwd_fields()
        bases, bufs, rows, start = {}, {}, [], 0
        for i in live:
            call, c = calls[i], cfg[tile_of[i]]
            bufs[i] = bk.buffers(call, c)
            n = bk.grid(call, c)[0]
            row = [start, n, tile_of[i]]
            for (name, _), v in zip(fields, bk.launch_args(call, c, bufs[i])):
                if isinstance(v, torch.Tensor):
                    base = bases.setdefault(name, v)
                    diff = v.data_ptr() - base.data_ptr()
                    if v.dtype != base.dtype or diff % v.element_size():
                        raise _Declined(f"the groups' {name} tensors are not of one element type")
                    row.append(diff // v.element_size())
                else:
                    row.append(int(v))
            rows.append(row)
            start += n
        consts = []
        for j, (name, kind) in enumerate(fields):
            col = [row[3 + j] for row in rows]
            if kind == "offset":       # every group's tensor 16-byte aligned: wide loads stay possible
                vec = 16 // bases[name].element_size()
                if bases[name].data_ptr() % 16 == 0 and all(v % vec == 0 for v in col):
                    consts.append((name, vec))
            elif "_s" in name and col[0] in (0, 1) and all(v == col[0] for v in col):
                consts.append((name, col[0]))          # unit or broadcast strides as literals
        cx = {"DETERMINISTIC": bk.deterministic, **{f"NEED_{k}": need[k] for k in bp.grad_inputs(r)}}
        for t, c in cfg.items():
            cx[f"BD_{t}"], cx[f"CH_{t}"] = c["BLOCK_D"], c["CHUNK"]
            if _seq_states(c):         # masks constant only where every group of the tile is whole
                each = [bk.constexprs(calls[i], c) for i in live if tile_of[i] == t]
                for k in ("EVEN_N", "EVEN_D", "EVEN_L"):
                    cx[f"{k}_{t}"] = all(x[k] for x in each)
                cx[f"SEG_{t}"] = _seg(c)
        cdt = "tl.float64" if any(bk._cdt(c) == "tl.float64" for c in calls.values()) else "tl.float32"
        tiles = tuple((t, c.get("variant", "scan")) for t, c in sorted(cfg.items()))
        fn = getattr(self.bwd_module(cdt, tiles, tuple(consts)), self.bwd_entry())
        table = torch.tensor(rows, dtype=torch.int64).to(dev)
        ptrs = [bases[n] for n, kind in fields if kind == "offset"]
        fn[(start,)](*ptrs, _zero_flag(dev), table, len(rows), **cx, **launch_options(cfg[max(cfg)], dev))
        self.bwd_launches, self.bwd_configs = 1, cfg
        out = []
        for i, (ins, nd) in enumerate(zip(groups, needs)):
            if i in calls:
                out.append([g if n else None for g, n in zip(bk._finish(calls[i], bufs[i]), nd)])
            else:
                out.append([torch.zeros_like(x) if n else None for x, n in zip(ins, nd)])
        return out

    def backward(self, groups, grads, needs):
        """Every group's gradients in one launch of the grouped backward; what it declines runs
        the member kernel's backward per group (``bwd_fallback`` says why)."""
        why = self._why_not_bwd(groups, grads)
        if why is None:
            try:
                out = self.launch_bwd(groups, grads, needs)
            except _Declined as e:
                why = str(e)
            else:
                self.bwd_fallback = None
                return out
        self.bwd_fallback = f"per-group calls on the last backward: {why}"
        self.bwd_configs = {}
        return super().backward(groups, grads, needs)

    def describe(self) -> str:
        text = super().describe()
        if self.config:
            text += f"; config {json.dumps(self.config, sort_keys=True)}"
        if self.fallback:
            text += f"; note: {self.fallback}"
        if self.bwd_fallback:
            text += f"; backward: {self.bwd_fallback}"
        elif self.bwd_configs:
            cfgs = ", ".join(f"tile {t}: {json.dumps(c, sort_keys=True)}" for t, c in sorted(self.bwd_configs.items()))
            text += f"; backward: one Triton launch ({cfgs})"
        return text


class _Declined(Exception):
    """Why one grouped backward launch cannot take these groups (they run per group instead)."""


def make_grouped(region: Region, member, target: str, options, device_type: str, arch=None):
    """The grouped kernel for a group whose members run `member` (compiled by `target`): one
    Triton launch where the Triton target supports the region here, else per-group calls."""
    from .triton import TritonTarget, make_plan
    names = target.removeprefix("auto(").rstrip(")").split("|")
    if any(n in ("triton", "cuda") for n in names) and not isinstance(make_plan(region), str) and \
            TritonTarget().supports(region, "chunked_scan", arch, device_type) is True:
        return GroupedTritonKernel(region, member, options, arch)
    return GroupedKernel(region, member)
