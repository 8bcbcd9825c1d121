"""The in-process serving engine: exact answers, no mix-ups under concurrency, errors, drain."""

import threading

import numpy as np
import pytest
import torch

from quiver.pyg import GraphSageSampler
from quiver.serving import Engine, Overloaded, ServeConfig, ShuttingDown


def test_answers_equal_offline_forward_on_the_same_sampled_subgraph(make_skewed_world):
    # a skewed graph whose rows exceed the fanouts: answers depend on the random sample, so the
    # engine records each batch's subgraph and the test recomputes it offline
    n = 500
    topo, x, model = make_skewed_world(n, 6000, seed=1)
    sampler = GraphSageSampler(topo, [5, 3], mode="CPU", seed=3)
    # a generous SLO: the first call may load the compiled kernel
    cfg = ServeConfig(max_wait_ms=0, num_sampler_workers=1, slo_ms=60_000)
    with Engine(sampler, x, model, n, cfg, record=True) as eng:
        requests = [[0, 1, 2], [7], [450, 3, 7]]
        results = [eng.predict(r, output="logits") for r in requests]
    assert len(eng.recorded) == len(requests)  # one batch per sequential request
    for req, res, (seeds, n_id, adjs) in zip(requests, results, eng.recorded):
        with torch.inference_mode():
            want = model(x[n_id], adjs).numpy()
        pos = np.searchsorted(seeds.numpy(), req)  # seeds are the sorted unique request ids
        np.testing.assert_allclose(res.values, want[pos], rtol=1e-6, atol=1e-6)
        assert res.nodes.tolist() == req and not res.late


def test_concurrent_clients_never_get_each_others_answers(world):
    x, model, sampler = world.x, world.model, world.sampler
    n = world.n
    want = world.offline(range(n))
    cfg = ServeConfig(max_batch_nodes=64, max_wait_ms=5, num_sampler_workers=2, slo_ms=60_000)
    errors = []
    with Engine(sampler, x, model, n, cfg) as eng:

        def client(k):
            rng = np.random.default_rng(k)
            for _ in range(15):
                nodes = rng.choice(n, size=rng.integers(1, 20), replace=False).tolist()
                res = eng.predict(nodes, output="logits", timeout=30)
                if not np.allclose(res.values, want[nodes], atol=1e-5):
                    errors.append((k, nodes))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, f"mixed-up answers: {errors[:3]}"
    text = eng.metrics.render().decode()
    assert 'quiver_requests_total{status="ok"} 120.0' in text
    # batching happened: fewer batches than requests
    batches = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("quiver_batches_total{")
    )
    assert 0 < batches < 120


def test_outputs_class_and_embedding(world):
    topo, x, model, sampler = world.topo, world.x, world.model, world.sampler
    with Engine(sampler, x, model, topo.node_count) as eng:
        logits = eng.predict([3, 4], output="logits").values
        cls = eng.predict([3, 4], output="class").values
        emb = eng.predict([3, 4], output="embedding").values
    assert cls.tolist() == logits.argmax(1).tolist()
    assert emb.shape == (2, 16)
    # every node has in-degree 3 <= the fanouts (4, 4): sampling takes all neighbours, so the
    # served outputs must equal the model's own offline pass on the same subgraph
    import numpy as np

    n_id, _, adjs = sampler.sample(torch.tensor([3, 4]))
    with torch.no_grad():
        want_emb, want_logits = model.forward_all(x[n_id], adjs)
    np.testing.assert_allclose(emb, want_emb[:2].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, want_logits[:2].numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(emb).max() > 1e-3


def test_a_failing_batch_answers_its_requests_with_the_error_and_serving_continues(
    world, exploding_sampler
):
    topo, x, model, sampler = world.topo, world.x, world.model, world.sampler
    cfg = ServeConfig(max_wait_ms=0)
    with Engine(exploding_sampler(sampler), x, model, topo.node_count, cfg) as eng:
        with pytest.raises(RuntimeError, match="crashed"):
            eng.predict([13, 2])
        assert eng.predict([2]).values.shape == (1,)
    text = eng.metrics.render().decode()
    assert 'quiver_requests_total{status="error"} 1.0' in text
    assert 'quiver_requests_total{status="ok"} 1.0' in text


def test_a_failing_batch_logs_one_warning_line_and_its_traceback_only_at_debug(
    world, exploding_sampler, caplog
):
    """A peer that stays down fails batch after batch: one warning line each, no traceback
    unless the log asks for debug."""
    import logging

    cfg = ServeConfig(max_wait_ms=0)
    with caplog.at_level(logging.DEBUG, logger="quiver.serving"):
        with Engine(exploding_sampler(world.sampler), world.x, world.model, world.n, cfg) as eng:
            with pytest.raises(RuntimeError, match="crashed"):
                eng.predict([13, 2])
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].exc_info is None
    assert "failed for a batch of 1 requests: RuntimeError: " in warned[0].getMessage()
    assert "\n" not in warned[0].getMessage()
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)


def test_overload_rejects_and_stop_drains_admitted_requests(world):
    topo, x, model, sampler = world.topo, world.x, world.model, world.sampler
    gate = threading.Event()

    class Slow:
        def sample(self, seeds):
            gate.wait(10)
            return sampler.sample(seeds)

    cfg = ServeConfig(  # the count bound alone (shedding would answer the gated ones 429)
        queue_capacity=3,
        max_batch_nodes=1,
        max_wait_ms=0,
        num_sampler_workers=1,
        pipeline_depth=1,
        shed_late=False,
    )
    eng = Engine(Slow(), x, model, topo.node_count, cfg).start()
    futures, rejected = [], 0
    for v in range(20):
        try:
            futures.append(eng.submit([v]))
        except Overloaded:
            rejected += 1
    assert rejected > 0 and len(futures) <= 3 + 1 + 1 + 1 + 1  # queue + stage buffers + workers
    gate.set()
    eng.stop(timeout=30)
    # every admitted request was answered before stop returned
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(ShuttingDown):
        eng.submit([1])


def test_late_requests_are_answered_and_counted(world):
    topo, x, model, sampler = world.topo, world.x, world.model, world.sampler
    cfg = ServeConfig(slo_ms=0.0, max_wait_ms=1)
    with Engine(sampler, x, model, topo.node_count, cfg) as eng:
        res = eng.predict([1, 2])
    assert res.late and res.values.shape == (2,)
    assert "quiver_late_requests_total 1.0" in eng.metrics.render().decode()


def test_invalid_ids_rejected_at_admission(world):
    topo, x, model, sampler = world.topo, world.x, world.model, world.sampler
    with Engine(sampler, x, model, topo.node_count) as eng:
        with pytest.raises(ValueError, match="out of range"):
            eng.submit([topo.node_count])
        assert eng.predict([0]).values.shape == (1,)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_thread_is_restarted_and_its_batch_answered(world, thread_killing_sampler):
    cfg = ServeConfig(max_wait_ms=0, num_sampler_workers=1)
    # the pipelined path: an idle engine's fast lane would sample on the batcher thread
    # (test_serving_fastlane.py kills that one)
    killer = thread_killing_sampler(world.sampler)
    with Engine(killer, world.x, world.model, world.n, cfg, fast_lane=False) as eng:
        with pytest.raises(RuntimeError, match="sampler thread died"):
            eng.predict([1, 2], timeout=10)
        # the only sampler thread died; the supervisor restarts it and serving goes on
        for _ in range(3):
            assert eng.predict([3], timeout=10).values.shape == (1,)
    text = eng.metrics.render().decode()
    assert 'quiver_thread_restarts_total{stage="sampler"} 1.0' in text


def _flood(world, shed_late: bool):
    """60 requests at ~3x the capacity of a 30 ms/batch engine; returns (refused, futures)."""
    import time

    class Slow:
        def sample(self, seeds):
            time.sleep(0.03)
            return world.sampler.sample(seeds)

    cfg = ServeConfig(
        slo_ms=100,
        max_batch_nodes=1,
        max_wait_ms=0,
        num_sampler_workers=1,
        pipeline_depth=1,
        shed_late=shed_late,
    )
    refused, futures = 0, []
    with Engine(Slow(), world.x, world.model, world.n, cfg) as eng:
        for v in range(5):  # warm up (kernel load) and give the shedder a service estimate
            eng.predict([v], timeout=30)
        for v in range(60):
            try:
                futures.append(eng.submit([v % world.n]))
            except Overloaded:
                refused += 1
            time.sleep(0.01)
    assert all(f.done() for f in futures)  # stop() answered every admitted request
    return refused, futures


def test_overload_is_shed_so_admitted_requests_keep_the_slo(world):
    refused, futures = _flood(world, shed_late=True)
    shed = [f for f in futures if isinstance(f.exception(), Overloaded)]
    served = [f.result() for f in futures if f.exception() is None]
    assert refused + len(shed) >= 20  # about 2/3 of the load is excess
    assert len(served) >= 10
    # queue wait <= slo - service, then one service: admitted requests stay near the SLO
    # (slack for a loaded CI machine); without shedding the wait grows with the backlog
    assert max(r.latency_ms for r in served) < 250
    assert all(f.exception() is None or isinstance(f.exception(), Overloaded) for f in futures)


def test_without_shedding_the_same_overload_turns_into_latency(world):
    refused, futures = _flood(world, shed_late=False)
    served = [f.result() for f in futures]  # nothing rejected: the queue absorbs it
    assert refused == 0 and len(served) == 60
    assert max(r.latency_ms for r in served) > 500
