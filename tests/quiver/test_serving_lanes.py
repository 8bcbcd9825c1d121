"""Latency under load: lanes (``ServeConfig.num_lanes``), where a request starts on a free lane
instead of queueing behind a running batch, and the adaptive batch cap, which sizes a batch to
what its oldest request's deadline still fits."""

import threading
import time

import numpy as np
import pytest
import torch

from quiver.serving import Engine, ServeConfig
from quiver.serving.batcher import (
    BATCH_SLO_SHARE,
    DynamicBatcher,
    ServiceFit,
    fit_service,
    slo_batch_cap,
)


class _HoldBigBatches(torch.nn.Module):
    """The model, but a forward over a batch of at least ``big`` seeds waits for ``gate``."""

    def __init__(self, inner, gate: threading.Event, big: int):
        super().__init__()
        self.inner = inner
        self.gate = gate
        self.big = big
        self.entered_big = threading.Event()
        self.threads: list[str] = []

    def forward(self, x, adjs):
        self.threads.append(threading.current_thread().name)
        num_seeds = adjs[-1][2][1]  # the last hop's targets are the seeds
        if num_seeds >= self.big:
            self.entered_big.set()
            assert self.gate.wait(10), "test gate never opened"
        return self.inner(x, adjs)


def _big_then_small(world, cfg):
    """Submit a 40-seed request whose forward blocks, then a 1-seed one; returns
    ``(small answered while the big one was held, big result, small result, engine)``."""
    gate = threading.Event()
    model = _HoldBigBatches(world.model, gate, big=40)
    eng = Engine(world.sampler, world.x, model, world.n, cfg).start()
    try:
        big = eng.submit(list(range(40)), output="logits")
        assert model.entered_big.wait(10)  # the big batch is in its forward, held there
        small = eng.submit([250], output="logits")
        try:
            small.result(timeout=2)
            overtook = True
        except TimeoutError:
            overtook = False
        gate.set()
        return overtook, big.result(30), small.result(30), eng
    finally:
        gate.set()
        eng.stop()


def test_with_two_lanes_a_small_request_is_not_queued_behind_a_large_batch(world):
    cfg = ServeConfig(num_lanes=2, slo_ms=60_000)
    overtook, big, small, eng = _big_then_small(world, cfg)
    assert overtook, "the 1-seed request waited for the held 40-seed batch"
    want = world.offline(list(range(40)) + [250])
    np.testing.assert_allclose(big.values, want[:40], atol=1e-5)
    np.testing.assert_allclose(small.values, want[40:], atol=1e-5)
    assert eng.lanes == {"fast": 2, "split": 0, "pipeline": 0}
    assert eng._in_pipeline == 0


def test_with_one_model_stage_the_small_request_waits_behind_the_large_batch(world):
    # the staged pipeline has one model thread: the same small request cannot overtake
    cfg = ServeConfig(num_sampler_workers=2, slo_ms=60_000)
    overtook, _, small, _ = _big_then_small(world, cfg)
    assert not overtook
    assert small.values.shape == (1, 4)


def test_lanes_answer_concurrent_clients_exactly_and_drain_on_stop(world):
    cfg = ServeConfig(num_lanes=2, max_batch_nodes=16, slo_ms=60_000)
    rng = np.random.default_rng(0)
    requests = [rng.integers(0, world.n, size=rng.integers(1, 9)).tolist() for _ in range(40)]
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg).start()
    futures = [eng.submit(r, output="logits") for r in requests]
    eng.stop(timeout=30)  # answers every admitted request before it returns
    want = world.offline(range(world.n))
    for r, f in zip(requests, futures):
        np.testing.assert_allclose(f.result(0).values, want[r], atol=1e-5)
    assert set(eng._threads) == {"lane-0", "lane-1"}
    assert sum(eng.lanes.values()) == eng.lanes["fast"] <= len(requests)


def test_a_failing_batch_in_a_lane_is_answered_and_serving_continues(world, exploding_sampler):
    cfg = ServeConfig(num_lanes=2)
    with Engine(exploding_sampler(world.sampler), world.x, world.model, world.n, cfg) as eng:
        with pytest.raises(RuntimeError, match="crashed"):
            eng.predict([13, 2], timeout=30)
        assert eng.predict([2], timeout=30).values.shape == (1,)
    assert eng._in_pipeline == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_lane_is_answered_and_restarted(world, thread_killing_sampler):
    killer = thread_killing_sampler(world.sampler)
    with Engine(killer, world.x, world.model, world.n, ServeConfig(num_lanes=1)) as eng:
        with pytest.raises(RuntimeError, match="lane thread died"):
            eng.predict([1, 2], timeout=10)
        for _ in range(3):
            assert eng.predict([3], timeout=10).values.shape == (1,)
    assert 'quiver_thread_restarts_total{stage="lane"} 1.0' in eng.metrics.render().decode()


def test_bad_lane_count():
    with pytest.raises(ValueError, match="num_lanes"):
        ServeConfig(num_lanes=-1)


# ---- the adaptive batch cap ---------------------------------------------------------------
def test_slo_batch_cap_fits_the_oldest_requests_remaining_deadline():
    fit = ServiceFit(per_batch_s=0.002, per_seed_s=0.0002)  # 2 ms + 0.2 ms per seed
    slo = 0.030
    # fresh: 0.8 * 30 ms - 2 ms = 22 ms of service -> 110 seeds
    assert slo_batch_cap(0.0, slo, fit, first_nodes=10, max_nodes=256) == 110
    # the oldest waited 10 ms: 12 ms left -> 60 seeds
    assert slo_batch_cap(0.010, slo, fit, first_nodes=10, max_nodes=256) == 60
    # never below the oldest request itself, never above the ceiling
    assert slo_batch_cap(0.018, slo, fit, first_nodes=20, max_nodes=256) == 20  # 4 ms left
    assert slo_batch_cap(0.0, 1.0, fit, first_nodes=10, max_nodes=256) == 256
    # the oldest cannot make it anyway: a backlog is served at full batches
    assert slo_batch_cap(0.025, slo, fit, first_nodes=10, max_nodes=256) == 256
    # not measured yet: no cap
    assert slo_batch_cap(0.0, slo, None, first_nodes=10, max_nodes=256) == 256
    assert BATCH_SLO_SHARE == 0.8  # the numbers above assume it


def test_fit_service_recovers_a_cost_line_and_stays_non_negative():
    assert fit_service([(10, 0.01)] * 3) is None  # too few points
    pts = [(n, 0.002 + 0.0002 * n) for n in (1, 8, 32, 64, 128, 256)]
    fit = fit_service(pts)
    assert fit.per_batch_s == pytest.approx(0.002) and fit.per_seed_s == pytest.approx(0.0002)
    # one seed count only: through the origin at the median per-seed time
    flat = fit_service([(32, 0.0064)] * 5)
    assert flat.per_batch_s == 0 and flat.per_seed_s == pytest.approx(0.0002)
    # noise giving a negative slope does not give a negative per-seed time
    noisy = fit_service([(8, 0.010), (16, 0.009), (32, 0.008), (64, 0.007)])
    assert noisy.per_batch_s >= 0 and noisy.per_seed_s > 0


def test_the_cap_is_on_with_lanes_and_off_for_the_staged_pipeline_by_default():
    assert ServeConfig(num_lanes=2).batch_cap_on and not ServeConfig().batch_cap_on
    assert ServeConfig(adaptive_batch=True).batch_cap_on
    assert not ServeConfig(num_lanes=2, adaptive_batch=False).batch_cap_on


def _batcher_with_service(adaptive: bool, slo_ms: float = 30.0) -> DynamicBatcher:
    cfg = ServeConfig(max_batch_nodes=256, max_wait_ms=0, slo_ms=slo_ms, adaptive_batch=adaptive)
    b = DynamicBatcher(cfg, node_count=1000)
    for n in (4, 16, 32, 64, 128):  # measured: 2 ms + 0.2 ms per seed
        b.observe_service(0.002 + 0.0002 * n, seeds=n)
    return b


def test_a_queue_longer_than_the_deadline_fits_is_split_into_batches_that_fit():
    b = _batcher_with_service(adaptive=True)
    reqs = [b.submit(list(range(40 * i, 40 * i + 40))) for i in range(5)]  # 200 seeds queued
    first = b.next_batch(timeout=1)
    # 110 seeds fit 0.8 x 30 ms: two 40-seed requests (a third would make 120)
    assert first.requests == reqs[:2] and first.closed_by == "slo"
    assert b.last_cap <= 110
    predicted = b.service_fit.predict(len(first.seeds))
    assert predicted <= BATCH_SLO_SHARE * 0.030
    second = b.next_batch(timeout=1)
    assert second.requests == reqs[2:4]


def test_without_the_adaptive_cap_the_queue_goes_out_as_one_batch():
    b = _batcher_with_service(adaptive=False)
    reqs = [b.submit(list(range(40 * i, 40 * i + 40))) for i in range(5)]
    batch = b.next_batch(timeout=1)
    assert batch.requests == reqs and batch.closed_by == "wait"


def test_a_backlog_past_its_deadline_is_served_in_full_batches():
    b = _batcher_with_service(adaptive=True)
    reqs = [b.submit(list(range(40 * i, 40 * i + 40))) for i in range(5)]
    time.sleep(0.03)  # the oldest has used its whole deadline waiting
    batch = b.next_batch(timeout=1)
    assert batch.requests == reqs  # throughput first: all 200 seeds at once
    assert b.last_cap == 256


def test_the_engine_feeds_the_cap_its_measured_service_times(world):
    with Engine(world.sampler, world.x, world.model, world.n, ServeConfig(num_lanes=1)) as eng:
        for size in (1, 2, 4, 8, 16):
            eng.predict(list(range(size)), timeout=30)
    fit = eng.batcher.service_fit
    assert fit is not None and fit.per_seed_s > 0
    assert [n for n, _ in eng.batcher._service_pts] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], {"num_lanes": 0, "torch_threads": 1, "batch_cap_on": False}),
        (["--lanes", "2"], {"num_lanes": 2, "torch_threads": 1, "batch_cap_on": True}),
        (
            ["--lanes", "2", "--torch-threads", "1", "--no-adaptive-batch"],
            {"num_lanes": 2, "torch_threads": 1, "batch_cap_on": False},
        ),
        (["--adaptive-batch"], {"num_lanes": 0, "batch_cap_on": True}),
        (["--torch-threads", "2"], {"num_lanes": 0, "torch_threads": 2, "batch_cap_on": False}),
    ],
)
def test_serve_cli_lane_and_batch_options(flags, want):
    from quiver.cli import build_parser
    from quiver.commands.serve import serve_config

    args = build_parser().parse_args(["serve", "data", "--checkpoint", "c.pt", *flags])
    cfg = serve_config(args)
    assert {k: getattr(cfg, k) for k in want} == want


def test_a_lone_lanes_large_batch_is_split_over_two_threads(world, monkeypatch):
    """``split_seeds``: with the other lane idle, a large request's unique seeds are halved and
    the second half runs on the splitter thread; the answers equal an unsplit engine's."""
    halves = []
    real = Engine._half

    def spy(self, seeds, want_emb):
        halves.append((threading.current_thread().name, seeds.tolist()))
        return real(self, seeds, want_emb)

    monkeypatch.setattr(Engine, "_half", spy)
    split = ServeConfig(num_lanes=2, split_seeds=8, max_batch_nodes=64, slo_ms=60_000)
    plain = ServeConfig(num_lanes=2, max_batch_nodes=64, slo_ms=60_000)
    engines = [
        Engine(world.sampler, world.x, world.model, world.n, c).start() for c in (split, plain)
    ]
    try:
        nodes = [5, 9, 9, 40, 41, 77, 120, 3, 200, 150, 5, 260]  # 10 distinct, 2 repeated
        for output in ("logits", "embedding", "class"):
            got, want = (e.predict(nodes, output=output, timeout=30).values for e in engines)
            np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(
            engines[0].predict(nodes, output="logits", timeout=30).values,
            world.offline(range(world.n))[nodes], atol=1e-5,
        )  # fmt: skip
        assert engines[0].splits == 4 and engines[1].splits == 0
        # the second half of the sorted distinct seeds, on the splitter thread
        assert halves[0] == ("quiver-split_0", [77, 120, 150, 200, 260])
        engines[0].predict([1, 2, 3], output="logits", timeout=30)  # under split_seeds
        assert engines[0].splits == 4
    finally:
        for e in engines:
            e.stop(timeout=30)


def test_split_seeds_must_be_off_or_at_least_two():
    with pytest.raises(ValueError, match="split_seeds must be 0"):
        ServeConfig(num_lanes=2, split_seeds=1)
