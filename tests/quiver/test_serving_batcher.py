"""Admission and dynamic batching: validation, closing rules, bounded queue, drain on close."""

import threading
import time

import numpy as np
import pytest

from quiver.serving.batcher import DynamicBatcher, Overloaded, ShuttingDown, validate_nodes
from quiver.serving.config import ServeConfig


@pytest.mark.parametrize(
    "nodes,match",
    [
        ([], "empty"),
        ("12", "list of integer"),
        (5, "list of integer"),
        ([1, 2.5], "integers"),
        ([1, True], "integers"),
        ([[1, 2]], "flat list"),
        ([1, -3], "negative"),
        ([1, 100], "out of range"),
        (list(range(11)), "at most 10"),
    ],
)
def test_validate_nodes_rejects_bad_input(nodes, match):
    with pytest.raises(ValueError, match=match):
        validate_nodes(nodes, node_count=100, max_request_nodes=10)


def test_validate_nodes_accepts_and_keeps_order():
    out = validate_nodes([5, 1, 5, 99], 100, 10)
    assert out.dtype == np.int64 and out.tolist() == [5, 1, 5, 99]


def test_batch_closes_on_node_limit_without_splitting_requests():
    b = DynamicBatcher(ServeConfig(max_batch_nodes=5, max_wait_ms=1000), node_count=100)
    r1 = b.submit([1, 2, 3])
    r2 = b.submit([4, 5])
    r3 = b.submit([6, 7])
    t0 = time.perf_counter()
    batch = b.next_batch(timeout=1)
    assert time.perf_counter() - t0 < 0.5, "a full batch must not wait for max_wait"
    assert batch.requests == [r1, r2] and batch.closed_by == "nodes"
    assert batch.seeds.tolist() == [1, 2, 3, 4, 5]
    b.close()
    rest = b.next_batch(timeout=1)
    assert rest.requests == [r3]


def test_batch_closes_on_wait():
    b = DynamicBatcher(ServeConfig(max_batch_nodes=100, max_wait_ms=30), node_count=100)
    b.submit([1])
    t0 = time.perf_counter()
    batch = b.next_batch(timeout=2)
    waited = time.perf_counter() - t0
    assert batch.closed_by == "wait" and len(batch.requests) == 1
    assert 0.02 <= waited < 0.5


def test_late_arrivals_join_an_open_batch():
    b = DynamicBatcher(ServeConfig(max_batch_nodes=100, max_wait_ms=200), node_count=100)
    b.submit([1])
    threading.Timer(0.05, lambda: b.submit([2, 3])).start()
    batch = b.next_batch(timeout=2)
    assert batch.seeds.tolist() == [1, 2, 3]


def test_batch_closes_on_psgs_budget():
    table = np.zeros(100)
    table[[1, 2, 3]] = [10.0, 30.0, 50.0]
    cfg = ServeConfig(max_batch_nodes=100, max_batch_psgs=45.0, max_wait_ms=1000)
    b = DynamicBatcher(cfg, node_count=100, psgs_table=table)
    r1 = b.submit([1, 2])  # psgs 40
    b.submit([3])  # psgs 50: would exceed 45
    batch = b.next_batch(timeout=1)
    assert batch.requests == [r1] and batch.closed_by == "psgs" and batch.psgs == 40.0


def test_full_queue_rejects_and_close_refuses_new():
    b = DynamicBatcher(ServeConfig(queue_capacity=2), node_count=10)
    b.submit([1])
    b.submit([2])
    with pytest.raises(Overloaded):
        b.submit([3])
    assert b.depth() == 2
    b.close()
    with pytest.raises(ShuttingDown):
        b.submit([4])
    # admitted requests are still released after close
    got = b.next_batch(timeout=1)
    assert [r.nodes.tolist() for r in got.requests] == [[1], [2]]
    assert b.next_batch(timeout=0.1) is None


def test_unknown_output_rejected():
    b = DynamicBatcher(ServeConfig(), node_count=10)
    with pytest.raises(ValueError, match="output"):
        b.submit([1], output="probabilities")


@pytest.mark.parametrize(
    "kwargs", [dict(queue_capacity=0), dict(max_wait_ms=-1), dict(max_batch_psgs=0)]
)
def test_bad_serve_config(kwargs):
    with pytest.raises(ValueError, match="serve config"):
        ServeConfig(**kwargs)


def test_standing_queue_refuses_new_requests_once_service_is_timed():
    b = DynamicBatcher(ServeConfig(slo_ms=100), node_count=10)
    old = b.submit([1])
    old.arrival -= 0.5  # the oldest request has queued 500 ms
    b.submit([2])  # no service estimate yet: nothing is shed
    b.observe_service(0.02)
    assert b.max_queue_s() == pytest.approx(0.08)
    with pytest.raises(Overloaded, match="wait"):
        b.submit([3])
    assert b.depth() == 2  # the refused request was not queued
    assert b.too_late(old, time.perf_counter())


def test_service_slower_than_slo_still_serves():
    # the bound never drops below one service time: a slow server answers late, not never
    b = DynamicBatcher(ServeConfig(slo_ms=10), node_count=10)
    b.observe_service(0.05)
    assert b.max_queue_s() == pytest.approx(0.05)
    req = b.submit([1])
    assert not b.too_late(req, req.arrival + 0.04) and b.too_late(req, req.arrival + 0.06)


def test_shedding_off_keeps_count_bound_only():
    b = DynamicBatcher(ServeConfig(slo_ms=1, shed_late=False), node_count=10)
    b.observe_service(0.05)
    b.submit([1]).arrival -= 10.0
    b.submit([2])  # admitted: only queue_capacity bounds admission
    assert b.depth() == 2


def test_in_flight_limit_refuses_at_the_door_and_reopens_as_answers_come():
    from quiver.serving.batcher import IN_FLIGHT_SLO_SHARE, MIN_IN_FLIGHT

    cfg = ServeConfig(slo_ms=1, max_batch_nodes=1, max_wait_ms=0, queue_capacity=10_000)
    b = DynamicBatcher(cfg, node_count=100)
    assert b.in_flight_limit(time.perf_counter()) == float("inf")  # no rate measured yet
    for i in range(200):  # one-request batches answered at once: thousands per second
        req = b.submit([i % 100])
        b.next_batch(timeout=1)
        req.future.set_result(None)
    now = time.perf_counter()
    rate = b.drain_rate(now)
    assert rate is not None and rate > 1000
    limit = b.in_flight_limit(now)
    # the limit follows the peak drain rate, which is at least the current one
    assert limit >= 0.99 * max(MIN_IN_FLIGHT, rate * 1e-3 * IN_FLIGHT_SLO_SHARE)
    # now nothing is answered: requests pile up in flight until the door closes
    held = []
    with pytest.raises(Overloaded, match="in flight"):
        for _ in range(5000):
            held.append(b.submit([1]))
            time.sleep(1e-4)
    assert 0.9 * limit <= len(held) < 5000  # the peak, and so the limit, decays meanwhile
    assert b.refusal(time.perf_counter()) is not None
    for req in held:  # answers come back: in-flight drops and the door opens again
        req.future.set_result(None)
    assert b.refusal(time.perf_counter()) is None
    b.submit([1])


def test_in_flight_limit_waits_for_slow_answers_before_refusing():
    from quiver.serving.batcher import MIN_IN_FLIGHT

    cfg = ServeConfig(slo_ms=1000, max_wait_ms=0)  # a long SLO: a VM stall is no slow answer
    b = DynamicBatcher(cfg, node_count=100)
    for _ in range(2):  # a slow trickle: a drain rate of a few requests per second
        req = b.submit([1])
        b.next_batch(timeout=1)
        req.future.set_result(None)
        time.sleep(0.2)
    assert b.drain_rate(time.perf_counter()) < 20
    # a burst past the limit is admitted while nobody has waited long (no answer is slow yet)
    burst = [b.submit([i]) for i in range(MIN_IN_FLIGHT + 8)]
    assert len(burst) == MIN_IN_FLIGHT + 8
    time.sleep(0.75)  # now the oldest has been in flight past IN_FLIGHT_SLO_SHARE of the 1 s SLO
    with pytest.raises(Overloaded, match="in flight"):
        b.submit([0])


def test_overloaded_door_stays_closed_until_answers_are_fast_again():
    from quiver.serving.batcher import MIN_IN_FLIGHT

    cfg = ServeConfig(slo_ms=1000, max_wait_ms=0)
    b = DynamicBatcher(cfg, node_count=100)
    for _ in range(2):  # a slow trickle: the limit is the MIN_IN_FLIGHT floor
        req = b.submit([1])
        b.next_batch(timeout=1)
        req.future.set_result(None)
        time.sleep(0.2)
    first = [b.submit([i]) for i in range(MIN_IN_FLIGHT + 8)]
    time.sleep(0.35)  # past the limit, the oldest in for 35% of the SLO: not yet overload
    second = [b.submit([i]) for i in range(MIN_IN_FLIGHT + 8)]
    assert not b.overloaded
    time.sleep(0.4)  # the oldest now in for 75% of the SLO: overload, the door closes
    with pytest.raises(Overloaded, match="in flight"):
        b.submit([0])
    assert b.overloaded
    for req in first:  # the oldest are answered; the next are in for ~40%, still past the
        req.future.set_result(None)  # 20% exit share: the door stays closed (hysteresis)
    with pytest.raises(Overloaded, match="in flight"):
        b.submit([0])
    for req in second:  # everything answered: overload over, the door opens
        req.future.set_result(None)
    b.submit([0])
    assert not b.overloaded


def test_answered_requests_are_not_retained():
    # the soak once grew by ~3.7 KB per request: the admission bookkeeping kept every request
    import gc
    import weakref

    b = DynamicBatcher(ServeConfig(max_wait_ms=0), node_count=100)
    refs = []
    for _ in range(500):
        req = b.submit([1, 2])
        b.next_batch(timeout=1)
        req.future.set_result(None)
        refs.append(weakref.ref(req))
    del req
    gc.collect()
    assert sum(r() is not None for r in refs) <= 2
