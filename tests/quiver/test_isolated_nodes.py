"""Nodes after the largest id of an edge list (isolated ones) keep their feature rows: ``quiver
prepare --edges`` counts the ``--features`` rows, the server answers for those nodes exactly,
and ``CSRTopo(edge_index)`` (largest id + 1, as torch-quiver) says how to keep them."""

import numpy as np
import pytest
import torch

from quiver import CSRTopo, Feature
from quiver.cli import main as quiver_main
from quiver.datasets import load_prepared

N, CONNECTED, DIM = 12, 9, 4  # nodes 9, 10, 11 appear in no edge


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("isolated")
    rng = np.random.default_rng(0)
    edges = rng.integers(0, CONNECTED, (40, 2))
    edges[0] = (CONNECTED - 1, 0)  # the largest id in the list is CONNECTED - 1
    np.savetxt(d / "edges.txt", edges, fmt="%d")
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    np.save(d / "feats.npy", x)
    np.save(d / "labels.npy", rng.integers(0, 3, N))
    return d, edges, x


@pytest.fixture(scope="module")
def prepared(files):
    """``quiver prepare --edges --features --labels`` without ``--num-nodes``."""
    d, _, _ = files
    out = d / "data"
    rc = quiver_main(
        ["prepare", "--edges", str(d / "edges.txt"), "--features", str(d / "feats.npy"),
         "--labels", str(d / "labels.npy"), "--out", str(out), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    return out


def test_prepare_counts_the_feature_rows(files, prepared):
    _, _, x = files
    ds = load_prepared(prepared)
    assert ds.num_nodes == N and ds.topo.node_count == N
    np.testing.assert_array_equal(np.asarray(ds.features), x)
    assert ds.topo.degree[CONNECTED:].sum() == 0


def test_prepare_refuses_ids_beyond_the_feature_rows_in_one_line(files, tmp_path, capsys):
    d, _, _ = files
    np.save(tmp_path / "few.npy", np.zeros((CONNECTED - 2, DIM), np.float32))
    rc = quiver_main(
        ["prepare", "--edges", str(d / "edges.txt"), "--features", str(tmp_path / "few.npy"),
         "--out", str(tmp_path / "data"), "--no-progress"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"node id {CONNECTED - 1}" in err[0] and "--features" in err[0], err


def test_served_isolated_nodes_equal_a_full_graph_forward(files, prepared, tmp_path):
    """The server answers for every node, isolated ones included, as PyG on the whole graph."""
    from torch_geometric.nn import GraphSAGE

    from quiver.serving.server import Server
    from quiver.usermodel import save_model

    _, edges, x = files
    torch.manual_seed(0)
    kwargs = dict(in_channels=DIM, hidden_channels=8, out_channels=3, num_layers=2)
    model = GraphSAGE(**kwargs).eval()
    ckpt = tmp_path / "sage.pt"
    save_model(ckpt, model, "torch_geometric.nn:GraphSAGE", kwargs, fanouts=[-1, -1])
    nodes = list(range(N))
    with Server.from_dataset(
        prepared, ckpt, model="torch_geometric.nn:GraphSAGE", fold="off", sampler_threads=1
    ) as server:
        got = server.predict(nodes, output="logits").values
    with torch.no_grad():
        want = model(torch.from_numpy(x), torch.from_numpy(edges.T.copy())).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_feature_rows_beyond_an_edge_lists_nodes(files):
    """torch-quiver's positional ``CSRTopo(edge_index)`` counts the largest id + 1; ``num_nodes``
    keeps the isolated nodes after it, and a short topology's refusal says so."""
    _, edges, x = files
    ei = torch.from_numpy(edges.T.copy())
    assert CSRTopo(ei).node_count == CONNECTED
    with pytest.raises(ValueError, match=rf"CSRTopo\(edge_index, num_nodes={N}\)"):
        Feature(0, [], 0, csr_topo=CSRTopo(ei)).from_cpu_tensor(torch.from_numpy(x))
    topo = CSRTopo(ei, None, None, None, N)  # torch-quiver's positional order, then num_nodes
    assert topo.node_count == N and topo.degree[CONNECTED:].sum() == 0
    feature = Feature(0, [], 0, csr_topo=topo).from_cpu_tensor(torch.from_numpy(x))
    ids = torch.arange(N)
    torch.testing.assert_close(feature[ids], torch.from_numpy(x), rtol=0, atol=0)
