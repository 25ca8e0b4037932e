"""auto picks between generated targets by measured time, once per shape bucket, cached."""
import time
import types

import torch

from ssmc.passes.select_strategy import choose_target
from ssmc.runtime.autotune import MeasuredChoice, shape_bucket


class FakeKernel:
    def __init__(self, delay, value):
        self.delay, self.value, self.calls = delay, value, 0

    def forward(self, inputs):
        self.calls += 1
        time.sleep(self.delay)
        return [inputs[0] * self.value]

    def backward(self, inputs, grads, needs):
        return [g * self.value for g in grads]


REGION = types.SimpleNamespace(name="loop0", key=lambda: "abc123")


def test_fastest_target_wins_and_the_choice_is_cached(tmp_path):
    fast, slow = FakeKernel(0.0, 2.0), FakeKernel(0.004, 3.0)
    ch = MeasuredChoice(REGION, {"slow": slow, "fast": fast}, {"slow": "1", "fast": "1"}, str(tmp_path), reps=3)
    x = torch.ones(4, 8)
    assert torch.equal(ch.forward([x])[0], x * 2)
    assert "measured: fast" in ch.describe() and "slow" in ch.describe()
    calls = fast.calls
    ch.forward([torch.ones(4, 7)])                   # same bucket (7 -> 8): no new timing
    assert fast.calls == calls + 1
    # a second process: the decision comes from the disk cache, nothing is timed
    fast2, slow2 = FakeKernel(0.0, 2.0), FakeKernel(0.004, 3.0)
    from ssmc.runtime import cache
    cache._CACHES.clear()
    ch2 = MeasuredChoice(REGION, {"slow": slow2, "fast": fast2}, {"slow": "1", "fast": "1"}, str(tmp_path))
    ch2.forward([x])
    assert slow2.calls == 0 and fast2.calls == 1


def test_a_failing_target_is_skipped(tmp_path):
    class Broken(FakeKernel):
        def forward(self, inputs):
            raise RuntimeError("launch failed")
    ok = FakeKernel(0.0, 5.0)
    ch = MeasuredChoice(REGION, {"broken": Broken(0, 0), "ok": ok}, {}, str(tmp_path), reps=2)
    assert torch.equal(ch.forward([torch.ones(2)])[0], torch.full((2,), 5.0))
    assert "broken failed when timed: RuntimeError: launch failed" in ch.describe()


def test_shape_bucket_rounds_up():
    assert shape_bucket([torch.empty(3, 1000)]) == (((4, 1024), "float32"),)


def test_auto_on_cuda_times_every_supporting_target():
    class T:
        def __init__(self, ok):
            self.ok = ok

        def supports(self, region, strategy, arch, device_type):
            return self.ok
    ctx = types.SimpleNamespace(options=types.SimpleNamespace(target="auto"), device_type="cuda", arch=90,
                                targets={"cuda": T(True), "triton": T(True), "torch": T(True)})
    assert choose_target(None, "chunked_scan", ctx) == ("cuda", {}, ["triton"])
    ctx.targets["cuda"] = T("no cupy")
    assert choose_target(None, "chunked_scan", ctx) == ("triton", {"cuda": "no cupy"}, [])
    ctx.options.target = "cuda"
    assert choose_target(None, "chunked_scan", ctx)[0] == "torch"


def test_a_call_after_the_first_of_a_shape_is_one_lookup(tmp_path, monkeypatch):
    """The shape bucket is computed once per distinct input shape; later calls of that shape
    look the decision up (a few microseconds of host time on a 0.1 ms kernel matter)."""
    import ssmc.runtime.autotune as A
    seen = []
    orig = A.shape_bucket
    monkeypatch.setattr(A, "shape_bucket", lambda xs: seen.append(1) or orig(xs))
    fast, slow = FakeKernel(0.0, 2.0), FakeKernel(0.002, 3.0)
    ch = MeasuredChoice(REGION, {"slow": slow, "fast": fast}, {}, str(tmp_path), reps=3)
    for _ in range(3):
        assert torch.equal(ch.forward([torch.ones(4, 8)])[0], torch.full((4, 8), 2.0))
    assert len(seen) == 1
    timed = slow.calls
    ch.forward([torch.ones(4, 7)])                   # a new shape, the same bucket: no timing
    assert len(seen) == 2 and slow.calls == timed
    assert ch.choose([torch.ones(4, 7)]) == "fast" and len(seen) == 2
