"""CSRTopo: construction from every input kind, in-neighbour orientation, save/load, errors."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import quiver
from quiver.graph import CSRTopo


def _random_edges(n=50, e=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (2, e), generator=g)


def _rows(topo):
    ip, ix = topo.indptr.tolist(), topo.indices.tolist()
    return [sorted(ix[ip[v] : ip[v + 1]]) for v in range(topo.node_count)]


def _expected_in_rows(edge_index, n):
    rows = [[] for _ in range(n)]
    for s, d in edge_index.t().tolist():
        rows[d].append(s)
    return [sorted(r) for r in rows]


def test_exported_lazily_from_package():
    assert quiver.CSRTopo is CSRTopo


def test_from_edge_index_holds_in_neighbours():
    ei = _random_edges()
    topo = CSRTopo(edge_index=ei, num_nodes=60, orientation="in", coalesce=False)
    assert topo.node_count == 60 and topo.edge_count == 400
    assert topo.indptr.dtype == topo.indices.dtype == torch.int64
    assert _rows(topo) == _expected_in_rows(ei, 60)
    assert torch.equal(topo.degree, torch.bincount(ei[1], minlength=60))
    # eid points each CSR slot back at its edge: same source and target
    dst = torch.repeat_interleave(torch.arange(60), topo.degree)
    assert torch.equal(ei[0, topo.eid], topo.indices)
    assert torch.equal(ei[1, topo.eid], dst)


def test_default_node_count_is_max_id_plus_one():
    topo = CSRTopo.from_edge_index(torch.tensor([[0, 7], [3, 2]]))
    assert topo.node_count == 8
    assert topo.degree.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


def test_from_csr_and_to_edge_index_round_trip():
    ei = _random_edges(seed=1)
    a = CSRTopo.from_edge_index(ei, num_nodes=50)
    b = CSRTopo.from_csr(a.indptr.numpy(), a.indices.numpy())
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
    back = b.to_edge_index()
    assert sorted(map(tuple, back.t().tolist())) == sorted(map(tuple, ei.t().tolist()))


def test_from_scipy_uses_row_as_source():
    ei = _random_edges(n=30, e=200, seed=2)
    # deduplicate: scipy sums duplicates
    ei = torch.unique(ei, dim=1)
    m = sp.coo_matrix((np.ones(ei.shape[1]), (ei[0].numpy(), ei[1].numpy())), shape=(30, 30))
    topo = CSRTopo.from_scipy(m.tocsr())
    assert _rows(topo) == _expected_in_rows(ei, 30)


def test_from_pyg_data():
    from torch_geometric.data import Data

    ei = _random_edges(n=20, e=80, seed=3)
    topo = CSRTopo.from_pyg(Data(edge_index=ei, num_nodes=25))
    assert topo.node_count == 25
    assert _rows(topo) == _expected_in_rows(ei, 25)


@pytest.mark.parametrize("mmap", [False, True])
def test_save_load_round_trip(tmp_path, mmap):
    topo = CSRTopo.from_edge_index(_random_edges(seed=4), num_nodes=50)
    topo.save(tmp_path / "g")
    back = CSRTopo.load(tmp_path / "g", mmap=mmap)
    assert torch.equal(back.indptr, topo.indptr)
    assert torch.equal(back.indices, topo.indices)
    assert torch.equal(back.eid, topo.eid)
    assert back.node_count == 50 and back.edge_count == 400


def test_mmap_load_does_not_read_the_file(tmp_path):
    topo = CSRTopo.from_edge_index(_random_edges(n=1000, e=200_000, seed=5))
    topo.save(tmp_path)
    back = CSRTopo.load(tmp_path, mmap=True)
    # the tensor's storage is the mapped file, not a heap copy
    maps = open("/proc/self/maps").read()
    assert str((tmp_path / "indices.npy").resolve()) in maps
    assert torch.equal(back.indices[:1000], topo.indices[:1000])
    # writes to a copy-on-write map never reach the file
    back.indices[0] = -5
    assert np.load(tmp_path / "indices.npy")[0] == topo.indices[0]


def test_to_device_returns_same_on_same_device():
    topo = CSRTopo.from_edge_index(_random_edges())
    assert topo.to("cpu") is topo


def test_pin_memory_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning works")
    with pytest.raises(ValueError, match="CUDA"):
        CSRTopo.from_edge_index(_random_edges()).pin_memory()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(edge_index=torch.zeros(3, 4, dtype=torch.long)), r"\[2, E\]"),
        (dict(edge_index=torch.zeros(2, 4)), "integers"),
        (dict(edge_index=torch.tensor([[0, -1], [1, 1]])), "negative"),
        (dict(edge_index=torch.tensor([[0, 5], [1, 1]]), num_nodes=3), "num_nodes"),
        (dict(indptr=[0, 2, 1], indices=[0, 1]), "non-decreasing|indptr"),
        (dict(indptr=[1, 2], indices=[0]), r"indptr\[0\]"),
        (dict(indptr=[0, 1, 3], indices=[0, 1]), "len\\(indices\\)"),
        (dict(indptr=[0, 1, 2], indices=[0, 2]), "out of range"),
        (dict(indptr=[0, 1]), "indptr and indices"),
    ],
)
def test_bad_inputs_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CSRTopo(**kwargs)


def test_load_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        CSRTopo.load(tmp_path / "nope")
