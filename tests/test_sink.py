"""sink_consumers: work done after a loop on its stacked steps runs in the step, so the region
writes the readout, not every state."""
import pytest
import torch

from conftest import as_tuple, grads_match, reference, rel_err, ssmc_run, writes_states
from test_forms import _mixer_scan


def _stack_then_einsum(x, dt, A, B, C):         # x, dt (b, L, d); A (d, n); B, C (b, L, n)
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    hs = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        hs.append(h)
    return torch.einsum("bldn,bln->bld", torch.stack(hs, 1), C)


def _stack_then_matmul(x, dt, A, B, C):
    """Discretised for the whole sequence first; the readout a matmul of the stacked states,
    then + x, and the final state as hs[:, -1]."""
    dA = torch.exp(dt.unsqueeze(-1) * A)
    BX = dt.unsqueeze(-1) * B.unsqueeze(2) * x.unsqueeze(-1)
    h = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    hs = []
    for t in range(x.shape[1]):
        h = dA[:, t] * h + BX[:, t]
        hs.append(h)
    hs = torch.stack(hs, dim=1)
    y = (hs @ C.unsqueeze(-1)).squeeze(3)
    return y + 0.5 * x, hs[:, -1]


def _buffer_then_sum(x, dt, A, B, C):
    """The states written into a buffer step by step, read after the loop."""
    b, L, d = x.shape
    hs = torch.empty(b, L, d, A.shape[1])
    h = x.new_zeros(b, d, A.shape[1])
    for t in range(L):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        hs[:, t] = h
    return (hs * C.unsqueeze(2)).sum(-1), hs[:, -1]


def _scan_hop_then_sum(x, dt, A, B, C):
    from torch._higher_order_ops.scan import scan

    def step(h, xs):
        x_t, d_t, B_t = xs
        h = torch.exp(d_t.unsqueeze(-1) * A) * h + (d_t * x_t).unsqueeze(-1) * B_t.unsqueeze(1)
        return h, h.clone()
    h0 = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    _, hs = scan(step, h0, (x.movedim(1, 0), dt.movedim(1, 0), B.movedim(1, 0)))   # steps along dim 0
    return (hs * C.movedim(1, 0).unsqueeze(2)).sum(-1).movedim(0, 1)


def _mixer(x, dt, A, B, C):
    y, last = _mixer_scan("generic")(x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2))
    return y.transpose(1, 2), last


def _inputs(seed, b=2, L=9, d=4, n=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, L, d, generator=g), torch.rand(b, L, d, generator=g), -torch.rand(d, n, generator=g),
            torch.randn(b, L, n, generator=g), torch.randn(b, L, n, generator=g))


FORMS = [_stack_then_einsum, _stack_then_matmul, _buffer_then_sum, _scan_hop_then_sum, _mixer]


@pytest.mark.parametrize("fn", FORMS, ids=lambda f: f.__name__)
def test_readout_after_the_loop_runs_in_the_step(fn):
    ins = _inputs(80)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and not rep.fallbacks, str(rep)
    info = rep.regions[0]
    assert not writes_states(info.ir), str(rep)
    assert any("sink_consumers" in n for n in info.notes), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(fn, ins)


@pytest.mark.parametrize("fn", FORMS, ids=lambda f: f.__name__)
def test_without_the_pass_the_states_are_written(fn):
    ins = _inputs(81)
    out, rep = ssmc_run(fn, ins, disable_passes=["sink_consumers"])
    assert len(rep.regions) == 1 and writes_states(rep.regions[0].ir), str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-6


def _loop(x, a):
    h, hs = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        hs.append(h)
    return torch.stack(hs, 1)


def _readout_and_mean_over_time(x, a, c):
    hs = _loop(x, a)
    return (hs * c).sum(-1), hs.mean(1)          # the mean over time stays after the loop


def _scaled_by_its_own_mean(x, a, c):
    hs = _loop(x, a)
    return (hs * hs.mean(1, keepdim=True) * c).sum(-1)     # an operand computed from the loop


def _first_step_and_merged(x, a, c):
    hs = _loop(x, a)
    return hs[:, 0] * 2, hs.reshape(hs.shape[0], -1).sum(-1)   # not the last step; time merged


def _buffer_read_with_its_mean(x, a, c):
    hs = torch.zeros(x.shape[0], x.shape[1], x.shape[2])
    h = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        hs[:, t] = h
    return ((hs - hs.mean(1, keepdim=True)) * c).sum(-1)    # the mean needs every write first


def _projected(x, a, c):
    return _loop(x, a) @ c[:3].T                  # y @ W_out: a dim only W has, no readout


def _elementwise_only(x, a, c):
    return _loop(x, a) * c                        # no readout: left to fuse_epilogue


def _two_layers(x, a, c):
    y = (_loop(x, a) * c).sum(-1, keepdim=True)
    return (_loop(y.expand_as(x) + x, a) * c).sum(-1)


def _small(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 7, 3, generator=g), torch.rand(2, 7, 3, generator=g), torch.randn(7, 3, generator=g))


@pytest.mark.parametrize("fn,moved,regions", [(_readout_and_mean_over_time, True, 1), (_scaled_by_its_own_mean, False, 1),
                                              (_first_step_and_merged, False, 1), (_elementwise_only, False, 1),
                                              (_buffer_read_with_its_mean, False, 1), (_projected, False, 1),
                                              (_two_layers, True, 2)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_what_cannot_run_in_the_step_stays_after_the_loop(fn, moved, regions):
    """Consumers that need the steps together (a mean over time, an operand computed from the
    steps, a merge of time with another dim, another step than the last) keep the stacked
    states; the values stay right either way."""
    ins = _small(82)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == regions and not rep.fallbacks, str(rep)
    notes = [n for r in rep.regions for n in r.notes if "sink_consumers" in n]
    assert bool(notes) == moved, str(rep)
    for o, r in zip(as_tuple(out), reference(fn, ins)):
        assert rel_err(o, r) < 1e-6
    grads_match(fn, ins)


def test_operands_computed_after_the_loop_move_before_it():
    """C's layout work is written after the loop: it moves before the region, which reads it."""
    def fn(x, a, c):
        hs = _loop(x, a)
        cc = (c * 2).exp().unsqueeze(0)
        return (hs * cc).sum(-1)
    ins = _small(83)
    out, rep = ssmc_run(fn, ins)
    assert len(rep.regions) == 1 and not writes_states(rep.regions[0].ir), str(rep)
    assert rel_err(out, reference(fn, ins)[0]) < 1e-6
