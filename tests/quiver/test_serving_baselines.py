"""The parts of the serving benchmark that run in the main venv: the PyG-to-DGL weight mapping, the
PyG baseline's full-subgraph forward, the request file, the baseline thread-pool server and the
equal-logits graph. (The baselines' sweeps themselves are benchmarks, not tests.)"""

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from quiver.graph import CSRTopo
from quiver.models import ModelConfig, build_model
from quiver.pyg import GraphSageSampler

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


sys.path.insert(0, str(REPO / "bench" / "baselines"))
export_weights = _load("export_weights_under_test", REPO / "bench/baselines/export_weights.py")
pyg_server = _load("pyg_server_under_test", REPO / "bench/baselines/pyg_server.py")
common = _load("serving_common_under_test", REPO / "bench/baselines/serving_common.py")
serving_bench = _load("serving_bench_under_test", REPO / "bench/serving.py")


def _random_graph(num_nodes: int, num_edges: int, seed: int) -> CSRTopo:
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, num_nodes, (2, num_edges), generator=gen)
    return CSRTopo(edge_index=edge_index, num_nodes=num_nodes, orientation="in", coalesce=False)


def _dgl_mean_sage_numpy(layers: dict, x: np.ndarray, adjs) -> np.ndarray:
    """DGL SAGEConv('mean') semantics in numpy: fc_neigh(mean of in-neighbours) + fc_self(x_dst),
    bias in fc_self; blocks outermost first, relu between layers."""
    num_layers = len(adjs)
    for i, (edge_index, _, (_num_src, num_dst)) in enumerate(adjs):
        src, dst = edge_index.numpy()
        agg = np.zeros((num_dst, x.shape[1]), dtype=np.float64)
        np.add.at(agg, dst, x[src])
        deg = np.bincount(dst, minlength=num_dst)[:, None]
        mean = agg / np.maximum(deg, 1)
        h = (
            mean @ layers[f"layer{i}_fc_neigh"].T
            + x[:num_dst] @ layers[f"layer{i}_fc_self"].T
            + layers[f"layer{i}_bias"]
        )
        x = np.maximum(h, 0) if i != num_layers - 1 else h
    return x


def test_sage_to_dgl_weights_reproduce_the_pyg_model():
    torch.manual_seed(0)
    model = build_model(ModelConfig("sage", in_dim=6, out_dim=3, hidden_dim=8, num_layers=2))
    # non-zero biases so that a dropped or duplicated bias shows
    with torch.no_grad():
        for conv in model.convs:
            conv.lin_l.bias.normal_()
    model.eval()
    topo = _random_graph(60, 400, seed=1)
    sampler = GraphSageSampler(topo, [4, 3], mode="CPU", seed=0)
    n_id, batch_size, adjs = sampler.sample(torch.arange(10))
    x = torch.randn(60, 6, generator=torch.Generator().manual_seed(2))[n_id]
    with torch.no_grad():
        want = model(x, adjs).numpy()
    layers = export_weights.sage_to_dgl(model.state_dict(), 2)
    assert layers["layer0_fc_neigh"].shape == (8, 6) and layers["layer1_bias"].shape == (3,)
    got = _dgl_mean_sage_numpy(layers, x.numpy().astype(np.float64), adjs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # swapping the neighbour and self weights must not pass
    swapped = dict(
        layers, layer0_fc_neigh=layers["layer0_fc_self"], layer0_fc_self=layers["layer0_fc_neigh"]
    )
    assert not np.allclose(_dgl_mean_sage_numpy(swapped, x.numpy(), adjs), want, atol=1e-3)


def test_sage_to_dgl_rejects_other_models():
    gcn = build_model(ModelConfig("gcn", in_dim=4, out_dim=2, hidden_dim=4, num_layers=2))
    with pytest.raises(ValueError, match="not a GraphSAGE"):
        export_weights.sage_to_dgl(gcn.state_dict(), 2)


def test_export_writes_config_and_weights(tmp_path):
    from quiver.models import save_checkpoint

    model = build_model(ModelConfig("sage", in_dim=5, out_dim=2, hidden_dim=4, num_layers=3))
    save_checkpoint(tmp_path / "m.pt", model, {"fanouts": [4, 3, 2]})
    cfg = export_weights.export(tmp_path / "m.pt", tmp_path / "w.npz")
    assert cfg == {"kind": "sage", "num_layers": 3, "fanouts": [4, 3, 2]}
    z = np.load(tmp_path / "w.npz")
    np.testing.assert_array_equal(z["layer2_fc_self"], model.convs[2].lin_r.weight.detach())


def _low_degree_graph(num_nodes: int, max_deg: int, seed: int) -> CSRTopo:
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, size=num_nodes)
    indptr = np.concatenate([[0], np.cumsum(deg)])
    indices = np.concatenate([rng.choice(num_nodes, size=k, replace=False) for k in deg])
    return CSRTopo(indptr=indptr, indices=indices)


# GCN is left out: its normalisation reads each source's degree inside the edge set it is given,
# which differs between one whole subgraph and per-hop edge sets even when nothing is dropped.
@pytest.mark.parametrize("kind", ["sage", "gat"])
def test_full_subgraph_forward_equals_hopwise_forward(kind):
    torch.manual_seed(3)
    model = build_model(ModelConfig(kind, in_dim=5, out_dim=4, hidden_dim=8, num_layers=3)).eval()
    # in-degrees <= 3 < every fanout: each hop takes all in-edges, as PyG's sampler does then
    topo = _low_degree_graph(200, 3, seed=4)
    sampler = GraphSageSampler(topo, [4, 4, 4], mode="CPU", seed=1)
    seeds = torch.tensor([5, 17, 42, 99, 150])
    n_id, batch_size, adjs = sampler.sample(seeds)
    x = torch.randn(len(n_id), 5, generator=torch.Generator().manual_seed(5))
    # the outermost hop holds the in-edges of every node within two hops: the whole subgraph
    edge_index = adjs[0][0]
    with torch.no_grad():
        want = model(x, adjs)
        got = pyg_server.full_subgraph_forward(model, x, edge_index, batch_size)
    assert got.shape == (5, 4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # dropping the seeds' own in-edges changes the answer, so the check has teeth
    keep = edge_index[1] >= batch_size
    if (~keep).any():
        with torch.no_grad():
            cut = pyg_server.full_subgraph_forward(model, x, edge_index[:, keep], batch_size)
        assert not torch.allclose(cut, want, atol=1e-4)


def test_request_file_round_trip(tmp_path):
    reqs = [[[1, 2, 3], [4]], [[5], [6, 7], [8, 9, 10, 11]]]
    common.save_requests(tmp_path / "r.npz", [10.0, 20.0], reqs, [7, 8])
    rates, back, seeds = common.load_requests(tmp_path / "r.npz")
    assert rates == [10.0, 20.0] and back == reqs and seeds == [7, 8]


class _SleepyServer(common.ThreadPoolServer):
    def __init__(self, sleep_s, **kw):
        super().__init__(**kw)
        self.sleep_s = sleep_s
        self.seen = []

    def _predict(self, seeds):
        self.seen.append(seeds.tolist())
        time.sleep(self.sleep_s)
        return np.zeros(len(seeds), dtype=np.int64)


def test_thread_pool_server_statuses():
    fast = _SleepyServer(0.0, num_workers=1, slo_ms=1000.0)
    assert asyncio.run(fast.send([3, 1, 3])) == "ok"
    assert fast.seen == [[1, 3]]  # unique seeds, one forward
    fast.close()
    slow = _SleepyServer(0.05, num_workers=1, slo_ms=10.0, max_queue_ms=120.0)

    async def burst():
        return await asyncio.gather(*(slow.send([i]) for i in range(6)))

    statuses = asyncio.run(burst())
    slow.close()
    # one worker, 50 ms each: the first ones are late, the ones queued past 120 ms are shed
    assert statuses[0] == "late"
    assert statuses[-1] == "rejected"
    assert set(statuses) <= {"late", "rejected"}
    assert len(slow.seen) == statuses.count("late")


def test_run_sweep_stops_after_failed_rates():
    server = _SleepyServer(0.02, num_workers=1, slo_ms=5.0, max_queue_ms=100.0)
    rates = [50.0, 100.0, 200.0, 400.0]
    reqs = [[[i] for i in range(5)] for _ in rates]
    res = common.run_sweep(server.send, rates, reqs, [0, 1, 2, 3], 5.0, progress=lambda s: None)
    server.close()
    assert len(res) == 2  # every rate misses a 5 ms SLO at 20 ms per request
    assert all(r["sent"] == 5 and r["p99_ms"] > 5.0 for r in res)


def test_verify_graph_degrees_are_below_fanouts(tmp_path):
    from quiver.datasets import load_prepared

    d = serving_bench.verify_graph(tmp_path / "g", in_dim=7, seed=0, num_nodes=100, max_deg=4)
    ds = load_prepared(d)
    indptr, indices = ds.topo.numpy()
    deg = np.diff(indptr)
    assert deg.max() <= 4 < min(serving_bench.FANOUTS)
    assert ds.features.shape == (100, 7)
    for v in range(100):
        row = indices[indptr[v] : indptr[v + 1]]
        assert len(set(row.tolist())) == len(row)  # distinct in-neighbours


# ---- the rate search (bench/baselines/serving_common.py) and the report (bench/serving.py) ----
def _point(rate, p99, rejected=0):
    return {"offered_rps": rate, "p99_ms": p99, "sent": 10, "rejected": rejected, "errors": 0}


def test_next_probe_bisects_a_knee_to_within_the_tolerance():
    # a system meeting 30 ms up to 20 req/s, run on the coarse grid
    p99 = lambda r: 10.0 if r <= 20 else 500.0  # noqa: E731
    points = [_point(r, p99(r)) for r in (2, 4, 8, 16, 32, 64)]
    probes = []
    while (r := common.next_probe(points, 30.0, tol=0.10)) is not None:
        probes.append(r)
        points.append(_point(r, p99(r)))
        assert len(probes) < 10
    assert probes[0] == pytest.approx((16 * 32) ** 0.5, abs=0.1)  # geometric midpoint
    lo, hi = common.knee(points, 30.0)
    assert lo <= 20 < hi and hi <= lo * 1.10  # resolved, and the truth is inside
    assert len(probes) == 3  # a factor 2 to within 10%


def test_next_probe_stops_where_no_knee_can_be_found_or_won():
    grid = (2, 4, 8)
    assert common.next_probe([_point(r, 99.0) for r in grid], 30.0) is None  # never met
    assert common.next_probe([_point(r, 9.0) for r in grid], 30.0) is None  # always met
    shed = [_point(2, 9.0), _point(4, 9.0, rejected=3)]  # shedding fails a rate
    assert common.knee(shed, 30.0) == (2, 4)
    # another configuration already met the bound at 8: this one's knee (2-4) cannot win
    assert common.next_probe(shed, 30.0, floor=8.0) is None
    assert common.next_probe(shed, 30.0, floor=1.0) == pytest.approx(2.8)
    # a noisy dip: the highest passing rate counts, as loadgen.sustained_rps does
    dip = [_point(2, 9.0), _point(4, 99.0), _point(8, 9.0), _point(16, 99.0)]
    assert common.knee(dip, 30.0) == (8, 16)
    with pytest.raises(ValueError, match="tol"):
        common.next_probe(dip, 30.0, tol=0)


def test_search_configs_refines_only_configurations_that_can_win(monkeypatch):
    capacity = {"A": 20.0, "B": 12.0}  # the rate each configuration keeps p99 <= 30 ms to
    calls = []
    lg = common.load_loadgen()

    async def fake_run(send, reqs, rate, seed=0):
        label = send()
        p99 = 10.0 if rate <= capacity[label] else 900.0
        return lg.LoadResult(rate, len(reqs), len(reqs), 0, 0, 0, 1.0, rate, rate, p99, p99, p99)

    fake = type("LG", (), {"run_open_loop": staticmethod(fake_run), "RequestMix": lg.RequestMix})
    monkeypatch.setattr(common, "load_loadgen", lambda: fake)
    monkeypatch.setattr(common.time, "sleep", lambda s: None)

    def activate(label, warmup):
        calls.append((label, warmup))
        return lambda: label

    plan = common.Plan(
        rates=[2, 4, 8, 16, 32, 64], bounds_ms=[30.0], stop_ms=30.0, node_count=100, tol=0.1
    )
    res = common.search_configs(["A", "B"], activate, plan, progress=lambda s: None)
    rates = {k: [r["offered_rps"] for r in v] for k, v in res.items()}
    # coarse: each stops after two failing rates; then only A (knee 16-32) is bisected:
    # B failed at 16, below A's passing 16, so it cannot be the best
    assert rates["B"] == [2, 4, 8, 16, 32]
    assert rates["A"] == [2, 4, 8, 16, 19.0, 20.7, 22.6, 32, 64]  # 3 probes, sorted in
    lo, hi = common.knee(res["A"], 30.0)
    assert lo <= 20 < hi <= lo * 1.1
    assert calls == [("A", common.WARMUP_REQUESTS), ("B", common.WARMUP_REQUESTS),
                     ("A", common.REWARM_REQUESTS)]  # fmt: skip


def test_requests_of_a_rate_are_the_same_for_every_system():
    plan = common.Plan(rates=[2, 8], bounds_ms=[30], stop_ms=30, node_count=1000, min_requests=5)
    a, seed_a = common.requests_for(plan, 8.0)
    b, seed_b = common.requests_for(common.Plan(**vars(plan)), 8.0)
    assert a == b and seed_a == seed_b and len(a) == max(5, int(8 * plan.duration_s))
    other, seed_o = common.requests_for(plan, 8.5)
    assert other != a and seed_o != seed_a


def test_plan_round_trips_and_thread_configs_parse(tmp_path):
    plan = common.Plan(rates=[2, 4], bounds_ms=[30, 100], stop_ms=100, node_count=7)
    plan.save(tmp_path / "plan.json")
    assert common.Plan.load(tmp_path / "plan.json") == plan
    assert common.parse_thread_configs("1x1, 1x2,2x1") == [(1, 1), (1, 2), (2, 1)]
    for bad in ("2", "0x1", "ax1", "1x"):
        with pytest.raises(ValueError, match="WORKERSxTHREADS"):
            common.parse_thread_configs(bad)


def test_reconfiguring_a_baseline_gives_new_threads_their_thread_count():
    seen = []

    class Recording(common.ThreadPoolServer):
        def set_threads(self, n):
            import threading

            seen.append((threading.current_thread().name, n))

        def _predict(self, seeds):
            return np.zeros(len(seeds), dtype=np.int64)

    server = Recording(1, slo_ms=1000.0)
    assert asyncio.run(server.send([1])) == "ok" and seen == []  # 0: threads left alone
    server.configure(2, 1)
    assert (server.num_workers, server.torch_threads, server.num_served) == (2, 1, 0)

    async def four():
        return await asyncio.gather(*(server.send([i]) for i in range(4)))

    assert asyncio.run(four()) == ["ok"] * 4
    assert seen and all(n == 1 for _, n in seen)
    server.close()


def test_report_takes_each_bound_and_rate_from_the_best_configuration():
    res = {
        "1w x 2t": [_point(2, 12.0), _point(4, 25.0), _point(8, 80.0)],
        "2w x 1t": [_point(2, 15.0), _point(4, 20.0), _point(8, 28.0), _point(16, 200.0)],
    }
    for r in res.values():
        for p in r:
            p["errors"] = 0
    assert serving_bench.best_per_bound(res, [30.0, 100.0]) == {
        30.0: (8, "2w x 1t"),
        100.0: (8, "2w x 1t"),
    }
    light = serving_bench.best_light(res, [2.0, 4.0, 16.0, 32.0])
    assert light[2.0] == (12.0, "1w x 2t") and light[4.0] == (20.0, "2w x 1t")
    assert np.isnan(light[32.0][0])
    run = {"quiver": {"results": res}, "dgl": {"results": {"2w x 1t": res["1w x 2t"]}}}
    summary = serving_bench.summarize_run(run, [30.0, 100.0], [2.0])
    assert summary["open_ended"]["quiver"] == {30.0: False, 100.0: False}
    assert summary["ratios"]["sustained p99<=30 quiver/dgl"] == 2.0  # 8 / 4 req/s
    assert summary["open_ended"]["dgl"][100.0]  # met at its highest rate, 8: a lower bound
    assert serving_bench.ratio(3.0, 0.0) == float("inf")
    assert np.isnan(serving_bench.ratio(0.0, 0.0))
    assert serving_bench.median([1.0, float("nan"), 3.0, float("inf")]) == 3.0


def test_targets_are_printed_as_pass_and_fail_lines():
    medians = {
        "sustained p99<=30 quiver/dgl": 3.5,
        "sustained p99<=100 quiver/dgl": 1.2,
        "p99 at 2 req/s quiver/dgl": 0.4,
    }
    runs = [{"ratios": medians}]
    lines = serving_bench.target_lines(medians, runs, [30.0, 100.0], [2.0])
    text = "\n".join(lines)
    assert "PASS  sustained req/s at p99 <= 30 ms, Quiver / best DGL >= 3x: 3.50x" in text
    assert "FAIL  sustained req/s at p99 <= 100 ms, Quiver / best DGL >= 3x: 1.20x" in text
    assert "PASS  p99 at 2 req/s, Quiver / best DGL <= 0.5x: 0.40x" in text
    assert "n/a   sustained req/s at p99 <= 30 ms, Quiver / best PYG >= 10x: pyg not run" in text
    assert len(lines) == 4  # rates not run (4, 8, 16) have no line


def test_quiver_configurations_parse():
    assert serving_bench.parse_mode("staged") == {
        "cfg": {},
        "fast_lane": True,
        "single_thread_calls": False,
    }
    lanes = serving_bench.parse_mode("lanes2x1-nocap")
    assert lanes["cfg"] == {"num_lanes": 2, "torch_threads": 1, "adaptive_batch": False}
    assert lanes["single_thread_calls"]  # a lane samples and gathers on its own thread
    assert not serving_bench.parse_mode("lanes2x1-mt")["single_thread_calls"]
    pipe = serving_bench.parse_mode("pipeline-1t")
    assert pipe["fast_lane"] is False and pipe["single_thread_calls"]
    assert serving_bench.parse_mode("staged-cap")["cfg"] == {"adaptive_batch": True}
    assert serving_bench.parse_mode("stagedx1")["cfg"] == {"torch_threads": 1}
    assert serving_bench.parse_mode("lanes2")["cfg"] == {"num_lanes": 2, "torch_threads": 1}
    split = serving_bench.parse_mode("lanes2x1-split24")
    assert split["cfg"] == {"num_lanes": 2, "torch_threads": 1, "split_seeds": 24}
    for bad in ("lanes", "lanes0x1", "lanes2x0", "fastest", "stagedxa", "staged-xyz",
                "lanes2-1t-mt", "staged-cap-nocap", "lanes2-splitx",
                "lanes2-split2-split3"):  # fmt: skip
        with pytest.raises(ValueError):
            serving_bench.parse_mode(bad)


def test_the_default_three_run_benchmark_is_estimated_within_half_an_hour():
    args = serving_bench.parse_args(["--runs", "3"])
    plan = common.Plan(
        rates=[float(r) for r in args.rates.split(",")],
        bounds_ms=[30.0, 100.0],
        stop_ms=100.0,
        node_count=2_449_029,
        tol=args.tol,
        refine_steps=args.refine_steps,
        duration_s=args.duration,
        min_requests=args.min_requests,
    )
    configs = {
        "quiver": len(args.quiver_configs.split(",")),
        "dgl": len(args.baseline_configs.split(",")),
        "pyg": len(args.baseline_configs.split(",")),
    }
    typical, most = serving_bench.estimate_s(plan, configs, args.runs)
    assert typical <= most
    assert typical <= 30 * 60, f"default --runs 3 expected to take {typical / 60:.0f} min"
    quick = serving_bench.parse_args(["--quick"])
    assert quick.runs == 1 and quick.baseline_configs == "1x2,2x1"
