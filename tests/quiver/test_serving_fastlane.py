"""The engine's idle fast lane: an idle engine runs a batch back to back on the batcher thread
without waiting the batch window; a busy one keeps the overlapped pipeline; answers, errors,
restarts and drain are the same as on the pipelined path."""

import threading

import numpy as np
import pytest
import torch

from quiver.pyg import GraphSageSampler
from quiver.serving import Engine, ServeConfig
from quiver.serving.batcher import DynamicBatcher


class _Recording:
    """Wraps a sampler: records the thread of every call; optionally blocks the first call."""

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner = inner
        self.gate = gate
        self.threads: list[str] = []
        self.entered = [threading.Event(), threading.Event()]  # first, second call started

    def sample(self, seeds):
        k = len(self.threads)
        self.threads.append(threading.current_thread().name)
        if k < 2:
            self.entered[k].set()
        if k == 0 and self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        return self.inner.sample(seeds)


class _GatedModel(torch.nn.Module):
    """The model, but its first forward waits for ``gate`` (records the thread of each call)."""

    def __init__(self, inner, gate: threading.Event):
        super().__init__()
        self.inner = inner
        self.gate = gate
        self.threads: list[str] = []

    def forward(self, x, adjs):
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == 1:
            assert self.gate.wait(10), "test gate never opened"
        return self.inner(x, adjs)


def test_an_idle_engine_runs_each_batch_on_the_batcher_thread_without_the_window(world):
    sampler = _Recording(world.sampler)
    # a window far longer than the answer may take: an idle engine must not wait it out
    cfg = ServeConfig(max_wait_ms=2_000, slo_ms=60_000)
    eng = Engine(sampler, world.x, world.model, world.n, cfg)
    eng.warmup()
    with eng:
        results = [eng.predict([v, v + 1], output="logits", timeout=30) for v in range(5)]
    assert sampler.threads[1:] == ["quiver-batcher"] * 5  # [0]: warmup, on this thread
    assert eng.lanes == {"fast": 5, "split": 0, "pipeline": 0}
    assert max(r.latency_ms for r in results) < 1_000
    want = world.offline(range(6))
    for v, r in enumerate(results):
        np.testing.assert_allclose(r.values, want[[v, v + 1]], atol=1e-5)
    assert eng._in_pipeline == 0


def test_without_the_fast_lane_an_idle_engine_waits_the_window_and_hands_off(world):
    sampler = _Recording(world.sampler)
    cfg = ServeConfig(max_wait_ms=300, slo_ms=60_000, fast_lane=False)
    assert Engine(sampler, world.x, world.model, world.n, cfg, fast_lane=True).fast_lane
    eng = Engine(sampler, world.x, world.model, world.n, cfg)  # the config turns it off
    eng.warmup()
    with eng:
        res = eng.predict([1], timeout=30)
    assert sampler.threads[1:] == ["quiver-sampler-0"]
    assert eng.lanes == {"fast": 0, "split": 0, "pipeline": 1}
    assert res.latency_ms >= 290  # the window, which the fast lane skips


def test_requests_arriving_during_a_fast_batch_send_it_on_and_take_the_pipeline(world):
    sample_gate, model_gate = threading.Event(), threading.Event()
    sampler = _Recording(world.sampler, sample_gate)
    model = _GatedModel(world.model, model_gate)
    cfg = ServeConfig(max_wait_ms=0, num_sampler_workers=1, slo_ms=60_000)
    with Engine(sampler, world.x, model, world.n, cfg) as eng:
        eng.trace = []
        a = eng.submit([5, 6], output="logits")
        assert sampler.entered[0].wait(10)  # A is sampling on the batcher thread
        b = eng.submit([7], output="logits")  # queues behind it: the engine is busy
        sample_gate.set()
        # A went on to the model thread (held by the gate) and B to the sampler thread
        assert sampler.entered[1].wait(10)
        model_gate.set()
        ra, rb = a.result(30), b.result(30)
    assert sampler.threads == ["quiver-batcher", "quiver-sampler-0"]
    assert model.threads == ["quiver-model", "quiver-model"]
    assert eng.lanes == {"fast": 0, "split": 1, "pipeline": 1}
    assert [t["lane"] for t in eng.trace] == ["split", "pipeline"]
    want = world.offline([5, 6, 7])
    np.testing.assert_allclose(ra.values, want[:2], atol=1e-5)
    np.testing.assert_allclose(rb.values, want[2:], atol=1e-5)
    assert eng._in_pipeline == 0


def test_fast_lane_answers_equal_the_pipelined_path_with_a_seeded_sampler(make_skewed_world):
    # rows longer than the fanouts: answers depend on the random sample, so equal answers mean
    # the same sampler stream and the same forward on either path
    n = 400
    topo, x, model = make_skewed_world(n, 5000, seed=2)
    requests = [[0, 1, 2], [9], [350, 3, 9], [1, 1, 4]]
    out = {}
    for fast in (True, False):
        sampler = GraphSageSampler(topo, [4, 3], mode="CPU", seed=11)
        cfg = ServeConfig(max_wait_ms=0, num_sampler_workers=1, slo_ms=60_000)
        with Engine(sampler, x, model, n, cfg, record=True, fast_lane=fast) as eng:
            out[fast] = [eng.predict(r, output="logits", timeout=30).values for r in requests]
        assert eng.lanes["fast" if fast else "pipeline"] == len(requests)
    for got, want in zip(out[True], out[False]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the seed matters: a different sampling seed changes some answer
    sampler = GraphSageSampler(topo, [4, 3], mode="CPU", seed=12)
    cfg = ServeConfig(max_wait_ms=0, slo_ms=60_000)
    with Engine(sampler, x, model, n, cfg) as eng:
        other = [eng.predict(r, output="logits", timeout=30).values for r in requests]
    assert any(not np.allclose(a, b) for a, b in zip(other, out[True]))


def test_a_failing_fast_batch_is_answered_with_the_error_and_serving_continues(
    world, exploding_sampler
):
    cfg = ServeConfig(max_wait_ms=0)
    with Engine(exploding_sampler(world.sampler), world.x, world.model, world.n, cfg) as eng:
        with pytest.raises(RuntimeError, match="crashed"):
            eng.predict([13, 2], timeout=30)
        assert eng.predict([2], timeout=30).values.shape == (1,)
        assert eng.lanes["fast"] == 1  # the failed batch is not counted as answered
    text = eng.metrics.render().decode()
    assert 'quiver_requests_total{status="error"} 1.0' in text
    assert eng._in_pipeline == 0


def test_late_fast_requests_are_answered_and_counted(world):
    with Engine(world.sampler, world.x, world.model, world.n, ServeConfig(slo_ms=0.0)) as eng:
        res = eng.predict([1, 2], timeout=30)
    assert res.late and eng.lanes["fast"] == 1
    assert "quiver_late_requests_total 1.0" in eng.metrics.render().decode()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_batcher_thread_dying_in_the_fast_lane_is_answered_and_restarted(
    world, thread_killing_sampler
):
    killer = thread_killing_sampler(world.sampler)
    with Engine(killer, world.x, world.model, world.n, ServeConfig(max_wait_ms=0)) as eng:
        with pytest.raises(RuntimeError, match="batcher thread died"):
            eng.predict([1, 2], timeout=10)
        for _ in range(3):  # the supervisor restarted the batcher; serving goes on
            assert eng.predict([3], timeout=10).values.shape == (1,)
    assert 'quiver_thread_restarts_total{stage="batcher"} 1.0' in eng.metrics.render().decode()
    assert eng._in_pipeline == 0


def test_stop_drains_a_fast_batch_and_the_requests_queued_behind_it(world):
    gate = threading.Event()
    sampler = _Recording(world.sampler, gate)
    eng = Engine(sampler, world.x, world.model, world.n, ServeConfig(max_wait_ms=0)).start()
    futures = [eng.submit([1])]
    assert sampler.entered[0].wait(10)
    futures += [eng.submit([v]) for v in range(2, 6)]
    stopper = threading.Thread(target=eng.stop, kwargs={"timeout": 30})
    stopper.start()
    gate.set()
    stopper.join(40)
    assert not stopper.is_alive()
    assert all(f.done() and f.exception() is None for f in futures)
    assert sum(eng.lanes.values()) >= 2 and eng.lanes["split"] == 1
    assert eng._in_pipeline == 0


def test_next_batch_max_wait_override_closes_at_once():
    import time

    b = DynamicBatcher(ServeConfig(max_wait_ms=5_000), node_count=10)
    b.submit([1])
    t0 = time.perf_counter()
    batch = b.next_batch(timeout=1, max_wait_ms=0)
    assert batch is not None and batch.seeds.tolist() == [1]
    assert time.perf_counter() - t0 < 1.0  # not the configured 5 s


@pytest.mark.parametrize("flag, want", [([], True), (["--no-fast-lane"], False)])
def test_serve_cli_fast_lane_flag(flag, want):
    from quiver.cli import build_parser
    from quiver.commands.serve import serve_config

    args = build_parser().parse_args(["serve", "data", "--checkpoint", "c.pt", *flag])
    assert serve_config(args).fast_lane is want
