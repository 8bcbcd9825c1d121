"""quiver.datasets: R-MAT, streaming CSR build, presets, prepared directories, learnability."""

import json

import numpy as np
import pytest
import torch

from quiver.datasets import (
    PRESETS,
    Preset,
    RMat,
    load_prepared,
    rmat_edges,
    synthetic,
)
from quiver.datasets.build import build_csr
from quiver.graph import CSRTopo


def _all_edges(params, seed, **kw):
    chunks = list(rmat_edges(params, seed, **kw))
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def test_rmat_is_deterministic_and_in_range():
    p = RMat(1000, 50_000)
    s1, d1 = _all_edges(p, 7, chunk_size=4096)
    s2, d2 = _all_edges(p, 7, chunk_size=4096, workers=2)  # threads do not change the result
    s3, _ = _all_edges(p, 8, chunk_size=4096)
    assert np.array_equal(s1, s2) and np.array_equal(d1, d2)
    assert not np.array_equal(s1, s3)
    assert s1.size == 50_000
    assert s1.min() >= 0 and max(s1.max(), d1.max()) < 1000


def test_rmat_quadrant_probabilities_control_in_degree_skew():
    # a + c is the chance a target bit stays 0: higher means more skewed in-degrees
    skewed = RMat(1 << 12, 200_000, a=0.57, b=0.19, c=0.19, d=0.05, noise=0.0, permute=False)
    flat = RMat(1 << 12, 200_000, a=0.25, b=0.25, c=0.25, d=0.25, noise=0.0, permute=False)
    deg_s = np.bincount(_all_edges(skewed, 0)[1], minlength=1 << 12)
    deg_f = np.bincount(_all_edges(flat, 0)[1], minlength=1 << 12)
    assert deg_s.max() > 20 * deg_f.max()
    # without permutation node 0 (all bits 0) is the largest hub; expected share (a+c)^scale
    assert deg_s.argmax() == 0
    expected = 200_000 * 0.76**12
    assert abs(deg_s[0] - expected) < 5 * np.sqrt(expected)
    # uniform quadrants give Poisson in-degrees: the mean is E / N and the variance matches
    assert abs(deg_f.var() / deg_f.mean() - 1) < 0.15


@pytest.mark.parametrize("kwargs", [dict(a=0.5, b=0.5, c=0.5, d=0.5), dict(noise=1.5)])
def test_rmat_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        RMat(100, 10, **kwargs)


def test_streaming_build_equals_in_memory_csr(tmp_path):
    rng = np.random.default_rng(0)
    chunks = [(rng.integers(0, 300, m), rng.integers(0, 300, m)) for m in (100, 0, 2500, 7)]

    def alloc(name, shape, dtype):
        return np.lib.format.open_memmap(tmp_path / f"{name}.npy", "w+", dtype, shape)

    indptr, indices = build_csr(iter(chunks), 300, alloc)
    # a budget of a few hundred bytes spills every bucket to disk: same result
    indptr2, indices2 = build_csr(iter(chunks), 300, memory_budget=800, spill_dir=tmp_path)
    assert np.array_equal(indptr, indptr2) and np.array_equal(indices, indices2)
    assert not list(tmp_path.glob("csr-spill-*")), "spill files are removed"
    ref = CSRTopo.from_edge_index(
        np.stack([np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])]),
        num_nodes=300,
    )
    assert np.array_equal(indptr, ref.indptr.numpy())
    assert np.array_equal(indices, ref.indices.numpy())  # same order inside each row
    assert isinstance(indices, np.memmap)


def test_streaming_build_rejects_out_of_range_ids():
    chunks = [(np.array([0, 1]), np.array([1, 2])), (np.array([5]), np.array([0]))]
    with pytest.raises(ValueError, match="edge 2 holds node id 5"):
        build_csr(lambda: iter(chunks), 3)


def test_tiny_preset_shape_and_statistics():
    p = PRESETS["tiny"]
    ds = synthetic("tiny", seed=0)
    assert ds.topo.node_count == p.num_nodes and ds.topo.edge_count == p.num_edges
    assert ds.features.shape == (p.num_nodes, p.num_features)
    assert ds.features.dtype == torch.float32
    assert int(ds.labels.min()) >= 0 and int(ds.labels.max()) < p.num_classes
    deg = ds.manifest["degree"]
    assert deg["min"] >= p.degree_floor and deg["isolated_share"] == 0.0
    assert deg["mean"] == pytest.approx(p.num_edges / p.num_nodes)
    assert deg["min"] <= deg["median"] <= deg["p99"] <= deg["max"]
    # homophily: the preset fraction plus chance agreement of the rest
    assert ds.manifest["edge_homophily"] >= p.homophily
    parts = [set(ds.splits[k].tolist()) for k in ("train", "valid", "test")]
    assert sum(map(len, parts)) == p.num_nodes and not (parts[0] & parts[1] | parts[1] & parts[2])


def test_synthetic_is_deterministic_and_disk_equals_memory(tmp_path):
    a = synthetic("tiny", seed=3)
    b = synthetic("tiny", seed=3, out=tmp_path / "t", chunk_size=123)  # other chunking, on disk
    c = synthetic("tiny", seed=4)
    assert not torch.equal(a.topo.indices, c.topo.indices)
    # chunk size changes the R-MAT stream, so compare two on-disk runs with equal chunking
    b2 = synthetic("tiny", seed=3, out=tmp_path / "t2", chunk_size=123)
    assert torch.equal(b.topo.indices, b2.topo.indices)
    assert torch.equal(b.features, b2.features) and torch.equal(b.labels, b2.labels)
    m = synthetic("tiny", seed=3, chunk_size=123)
    assert torch.equal(m.topo.indices, b.topo.indices) and torch.equal(m.features, b.features)
    assert torch.equal(a.labels, b.labels)  # labels do not depend on chunking


def test_prepared_directory_round_trip(tmp_path):
    ds = synthetic("tiny", seed=1, out=tmp_path / "d")
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    for key in ("num_nodes", "num_edges", "num_features", "num_classes", "degree", "fanouts"):
        assert key in manifest
    assert manifest["source"]["preset"]["name"] == "tiny"
    again = load_prepared(tmp_path / "d", mmap=False)
    assert torch.equal(again.topo.indices, ds.topo.indices)
    assert torch.equal(again.features, ds.features)
    assert torch.equal(again.splits["valid"], ds.splits["valid"])
    data = again.to_pyg()
    assert int(data.train_mask.sum()) == ds.splits["train"].numel()


def test_load_prepared_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prepared(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="manifest"):
        load_prepared(tmp_path / "empty")


def test_unknown_preset_and_bad_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        synthetic("arxiv-like")
    with pytest.raises(ValueError, match="degree_floor"):
        Preset("x", 100, 50, 4, 2, degree_floor=1)


def test_big_presets_match_the_paper_shapes():
    shapes = {
        "reddit-like": (232_965, 114_615_892, 602, 41),
        "products-like": (2_449_029, 123_718_280, 100, 47),
        "papers-like": (111_059_956, 1_615_685_872, 128, 172),
    }
    for name, shape in shapes.items():
        p = PRESETS[name]
        assert (p.num_nodes, p.num_edges, p.num_features, p.num_classes) == shape


def _accuracy(ds, gnn: bool, epochs=60):
    from torch_geometric.nn import SAGEConv

    torch.manual_seed(0)
    data = ds.to_pyg()
    f_in, c = data.x.size(1), ds.num_classes
    if gnn:
        convs = torch.nn.ModuleList([SAGEConv(f_in, 32), SAGEConv(32, c)])

        def fwd(x):
            return convs[1](torch.relu(convs[0](x, data.edge_index)), data.edge_index)

        params = convs.parameters()
    else:
        mlp = torch.nn.Sequential(
            torch.nn.Linear(f_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, c)
        )
        fwd, params = mlp, mlp.parameters()
    opt = torch.optim.Adam(params, lr=0.02)
    tr, te = ds.splits["train"], ds.splits["test"]
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(fwd(data.x)[tr], data.y[tr]).backward()
        opt.step()
    with torch.no_grad():
        return (fwd(data.x)[te].argmax(1) == data.y[te]).float().mean().item()


@pytest.fixture
def one_torch_thread():
    # tiny full-batch models: intra-op threads only add barrier waits on shared cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_gnn_beats_feature_only_mlp_on_small(one_torch_thread):
    ds = synthetic("small", seed=0)
    mlp, gnn = _accuracy(ds, gnn=False), _accuracy(ds, gnn=True)
    chance = 1 / ds.num_classes
    assert mlp > chance + 0.05, "features alone carry some class signal"
    assert gnn > mlp + 0.2, f"GNN {gnn:.2f} should clearly beat the MLP {mlp:.2f}"
