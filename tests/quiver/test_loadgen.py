"""The open-loop load generator: counts, percentiles, rejection timing, request mixes."""

import asyncio
import math

import numpy as np
import pytest

from quiver.serving import loadgen


def test_counts_and_open_loop_latency_from_scheduled_time():
    # one request at a time: arrivals at 1000/s queue behind a 5 ms server, and open-loop
    # latency must include that queueing (no coordinated omission)
    lock = asyncio.Lock()
    k = iter(range(10**6))

    async def send(nodes):
        i = next(k)
        if i % 4 == 3:
            return "rejected"
        async with lock:
            await asyncio.sleep(0.005)
        return "late" if i % 4 == 2 else "ok"

    reqs = loadgen.RequestMix(100, 1, 4).draw(40, seed=0)
    res = asyncio.run(loadgen.run_open_loop(send, reqs, rate=1000.0, seed=0))
    assert (res.sent, res.ok, res.late, res.rejected, res.errors) == (40, 20, 10, 10, 0)
    # 30 served one after another at 5 ms: the last waited ~150 ms after its scheduled send
    assert res.p99_ms > 100 and res.p50_ms >= 5
    assert res.reject_p99_ms < res.p99_ms  # rejections come back without queueing
    assert res.throughput_rps == pytest.approx(30 / res.duration_s)


def test_no_rejections_gives_nan_reject_time():
    async def send(nodes):
        return "ok"

    res = asyncio.run(loadgen.run_open_loop(send, [[1]] * 5, rate=500.0))
    assert math.isnan(res.reject_p99_ms) and res.ok == 5


def test_request_mix_sizes_and_determinism():
    mix = loadgen.RequestMix(50, 2, 6)
    a, b = mix.draw(200, seed=3), mix.draw(200, seed=3)
    assert a == b
    sizes = np.array([len(r) for r in a])
    assert sizes.min() >= 2 and sizes.max() <= 6 and set(sizes) == {2, 3, 4, 5, 6}
    assert all(0 <= v < 50 for r in a for v in r)
    with pytest.raises(ValueError, match="sizes"):
        loadgen.RequestMix(50, 0, 3)
    with pytest.raises(ValueError, match="rate"):
        asyncio.run(loadgen.run_open_loop(lambda n: None, [[1]], rate=0))


def test_engine_target_counts_shed_requests_as_rejected():
    from concurrent.futures import Future

    from quiver.serving.batcher import Overloaded

    class FakeEngine:
        def __init__(self):
            self.k = 0

        def submit(self, nodes):
            self.k += 1
            if self.k == 1:
                raise Overloaded("queue full")  # refused at admission
            fut = Future()
            if self.k == 2:
                fut.set_exception(Overloaded("waited too long"))  # shed at pick-up
            elif self.k == 3:
                fut.set_exception(RuntimeError("model failed"))
            else:
                fut.set_result(type("R", (), {"late": self.k == 4})())
            return fut

    res = asyncio.run(
        loadgen.run_open_loop(loadgen.engine_target(FakeEngine()), [[1]] * 5, rate=1000.0)
    )
    assert (res.rejected, res.errors, res.late, res.ok) == (2, 1, 1, 1)
