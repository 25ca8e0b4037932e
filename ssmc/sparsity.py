"""Structural zeros of a region's transition matrix, and its block pattern.

The transition of a region with a `Mix` is diag(a) + m along the last state axis. Which of its
(i, j) entries can be nonzero follows from the expression and the values of its inputs: a product
is zero where any factor is (``A * mask``), a sum where all terms are (``I + dt * A``), and a load
is zero where the input tensor is zero at every other index (batch, time, channels); a load
that varies along neither the row nor the column (a step size per channel) counts as nonzero
and is not read. Unknown
values and ops that do not keep zeros (``exp``, ``sigmoid``) count as nonzero everywhere, so the
pattern always covers the true nonzeros.

The block_sparse pass runs this on the example inputs (the block size, the mask and the density
in the report); the block-sparse kernels run it again on the actual inputs at every call (a few
small tensor ops on the device, no synchronisation), so a mask that changes between calls never
gives a stale result.
"""
from __future__ import annotations

import torch

from . import ir
from .ir import Const, Load, Op, Region

# ops that map zero to zero in their first argument
_ZERO_KEEPING = {"neg", "abs", "sin", "tanh", "sqrt", "relu", "expm1", "silu", "cast", "log1p"}
BLOCK_SIZES = (16, 8, 4, 2)


def _load(ld: Load, x: torch.Tensor | None, row: str, dev) -> torch.Tensor:
    if x is None or not isinstance(x, torch.Tensor) or _is_fake(x) \
            or not {row, ir.MIX_COL} & set(ld.index):       # a scale (dt per channel): not read
        return torch.ones((), dtype=torch.bool, device=dev)
    nz = x != 0
    keep = []
    for d in reversed(range(len(ld.index))):
        ix = ld.index[d]
        if isinstance(ix, int):
            nz = nz.select(d, ix)
        elif ix not in (row, ir.MIX_COL):
            nz = nz.any(dim=d)
        else:
            keep.insert(0, ix)
    if keep == [ir.MIX_COL, row]:
        nz = nz.transpose(0, 1)
    if keep == [row]:
        nz = nz.unsqueeze(1)
    return nz


def _is_fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(x, FakeTensor) or x.device.type == "meta"


def _pattern(e, inputs, row, dev, memo) -> torch.Tensor:
    if e in memo:
        return memo[e]
    if isinstance(e, Load):
        p = _load(e, inputs[e.input] if e.input < len(inputs) else None, row, dev)
    elif isinstance(e, Const):
        p = torch.tensor(e.value != 0, device=dev)
    elif isinstance(e, Op) and e.name in ("mul", "div") or isinstance(e, Op) and e.name in _ZERO_KEEPING:
        args = e.args[:1] if e.name != "mul" else e.args
        p = _pattern(args[0], inputs, row, dev, memo)
        for a in args[1:]:
            p = p & _pattern(a, inputs, row, dev, memo)
    elif isinstance(e, Op) and e.name in ("add", "sub", "maximum", "minimum", "where"):
        args = e.args[1:] if e.name == "where" else e.args
        p = _pattern(args[0], inputs, row, dev, memo)
        for a in args[1:]:
            p = p | _pattern(a, inputs, row, dev, memo)
    else:
        p = torch.ones((), dtype=torch.bool, device=dev)
    memo[e] = p
    return p


def transition_pattern(region: Region, inputs, n: int, diag: bool = True) -> torch.Tensor:
    """(n, n) bool: entries of the transition diag(a) + m (of m alone without `diag`) that can
    be nonzero. `inputs` holds the region's input tensors; None for one whose value is unknown
    (taken as nonzero)."""
    dev = next((x.device for x in inputs if isinstance(x, torch.Tensor) and not _is_fake(x)),
               torch.device("cpu"))
    p = _pattern(region.mix.expr, inputs, region.axes[-1], dev, {}).expand(n, n)
    if diag and not (isinstance(region.decay, Const) and region.decay.value == 0):
        p = p | torch.eye(n, dtype=torch.bool, device=dev)
    return p


def block_pattern(p: torch.Tensor, block: int) -> torch.Tensor:
    nb = p.shape[0] // block
    return p.reshape(nb, block, nb, block).any(3).any(1)


BLOCK_OVERHEAD = 16     # per nonzero block and step: loading its slice of h, the loop, in entries


def choose_block(p: torch.Tensor) -> int:
    """The block size with the least work: nonzero blocks * (block^2 + a fixed cost per block);
    the larger one on a tie (bigger tiles use the hardware better)."""
    n = p.shape[0]
    sizes = [b for b in BLOCK_SIZES if n % b == 0] or [n]
    work = {b: int(block_pattern(p, b).sum()) * (b * b + BLOCK_OVERHEAD) for b in sizes}
    return min(sizes, key=lambda b: (work[b], -b))


def block_csr(bp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block row: the column blocks that are nonzero, first, and how many (int32, on the
    device of the pattern; no synchronisation)."""
    nb = bp.shape[0]
    cols = torch.argsort((~bp).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return cols.contiguous(), bp.sum(1).to(torch.int32)


class PatternCache:
    """The block pattern of a region's transition on the actual inputs (`transition_pattern`,
    then `block_pattern`), and what a kernel derives from it, kept while the tensors the pattern
    reads are the same ones, unmodified: the cache holds them (their memory cannot be reused by
    another tensor) and compares storage, shape, strides and the version counter (an in-place
    update of a mask, through any view, bumps it). Inference tensors have no version counter and
    are never cached."""

    def __init__(self, region: Region):
        self.region = region
        rowcol = {region.axes[-1], ir.MIX_COL}
        self.used = sorted({ld.input for ld in ir.loads(region.mix.expr) if rowcol & set(ld.index)})
        self._held = None

    def get(self, inputs, n: int, bs: int, derive):
        xs = [inputs[i] for i in self.used]
        key = None
        if not any(x.is_inference() for x in xs):
            key = (n, bs) + tuple((x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.device) for x in xs)
            if self._held is not None and self._held[0] == key:
                return self._held[2]
        got = derive(block_pattern(transition_pattern(self.region, inputs, n, diag=False), bs))
        self._held = (key, xs, got) if key is not None else None
        return got


def uncovered(bp: torch.Tensor, mix, bs: int, memo: dict) -> torch.Tensor:
    """int32 (1,) on the pattern's device: 0 when the compiled mask (``mix.blocks``) covers the
    block pattern `bp` of the inputs, 1 otherwise; no synchronisation. `memo` keeps the compiled
    mask per device."""
    n = bp.shape[0] * bs
    if mix.nblocks * mix.block != n or mix.block != bs:
        return torch.ones(1, dtype=torch.int32, device=bp.device)
    if bp.device not in memo:
        c = torch.zeros(mix.nblocks, mix.nblocks, dtype=torch.bool)
        for i, j in mix.blocks:
            c[i, j] = True
        memo[bp.device] = c.to(bp.device)
    return (bp & ~memo[bp.device]).any().to(torch.int32).reshape(1)
