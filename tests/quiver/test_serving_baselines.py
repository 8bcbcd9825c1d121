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
