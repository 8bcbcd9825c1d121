"""``quiver.multiprocessing`` (torch-quiver's): a ``quiver.Feature``, ``quiver.CSRTopo`` and
``quiver.pyg.GraphSageSampler`` go to real spawned ``torch.multiprocessing`` workers, which read
the same rows and sample valid neighbours from memory they share, and the parent's own objects
keep working afterwards (torch's default reduction moved their storage and left the store's
numpy views dangling: the parent's next gather crashed)."""

import io
import os
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import quiver
import quiver.multiprocessing  # noqa: F401  (the reductions)

pytestmark = pytest.mark.dist

N, DIM, FANOUTS = 3000, 16, [4, 3]
SEEDS = torch.arange(0, N, 37)


def _graph():
    gen = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, N, (2, 6 * N), generator=gen)
    topo = quiver.CSRTopo(edge_index, num_nodes=N)
    x = torch.randn(N, DIM, generator=gen)
    return topo, x


def _edges_valid(topo, n_id, adjs) -> bool:
    """Every sampled edge (source local id, target local id) is a CSR edge target -> source."""
    indptr, indices = topo.indptr, topo.indices
    for adj in adjs:
        src, dst = n_id[adj.edge_index[0]], n_id[adj.edge_index[1]]
        for s, d in zip(src.tolist(), dst.tolist()):
            if s not in indices[indptr[d] : indptr[d + 1]].tolist():
                return False
    return True


def _maps(name_part: str) -> list[str]:
    with open(f"/proc/{os.getpid()}/maps") as f:
        return [line for line in f if name_part in line]


def _worker(rank, feature, topo, sampler, ids, marker_pos, both_read, written, out_dir):
    torch.set_num_threads(1)
    got = feature[ids]
    assert both_read.wait(60) is not None  # both have read before anyone writes
    host = feature.tiers[0].rows  # the store's rows, as this worker maps them
    if rank == 0:  # write through the shared rows; the other worker must see it
        host[marker_pos] = 12345.0
        written.set()
    else:
        assert written.wait(60), "worker 0 never wrote"
    seen = feature[ids][:1]
    n_id, batch_size, adjs = sampler.sample(SEEDS)
    result = {
        "rows": got,
        "seen": seen,
        "shared": [host.is_shared(), topo.indptr.is_shared(), sampler.csr_topo.indices.is_shared()],
        "n_id": n_id,
        "batch_size": batch_size,
        "valid": _edges_valid(topo, n_id, adjs),
        "node_count": topo.node_count,
    }
    torch.save(result, os.path.join(out_dir, f"w{rank}.pt"))


def test_spawned_workers_share_the_feature_and_sample_valid_neighbours(tmp_path):
    topo, x = _graph()
    feature = quiver.Feature(0, [], 0, csr_topo=topo).from_cpu_tensor(x)
    sampler = quiver.pyg.GraphSageSampler(topo, FANOUTS, seed=1)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, N, (500,), generator=gen)
    # node ids[0]'s row sits at hot position pos: worker 0 overwrites it in the shared rows
    pos = int((feature.hot_order() == ids[0]).nonzero()[0, 0])
    ctx = mp.get_context("spawn")
    both_read, written = ctx.Barrier(2), ctx.Event()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, feature, topo, sampler, ids, pos, both_read, written, str(tmp_path)),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"
    for r in range(2):
        res = torch.load(tmp_path / f"w{r}.pt")
        assert torch.equal(res["rows"], x[ids])  # the same rows as the parent's store
        assert res["shared"] == [True, True, True]
        assert res["node_count"] == N
        assert res["valid"] and res["batch_size"] == SEEDS.numel()
        assert torch.equal(res["n_id"][: SEEDS.numel()], SEEDS)
    # one copy for both workers: worker 0's write reached worker 1's store
    res1 = torch.load(tmp_path / "w1.pt")
    assert torch.all(res1["seen"] == 12345.0), res1["seen"]
    # the parent's own objects are untouched and still work
    assert torch.equal(feature[ids], x[ids])
    n_id, _, adjs = sampler.sample(SEEDS)
    assert _edges_valid(topo, n_id, adjs)


def test_pickling_for_workers_leaves_the_parent_store_working():
    """Before quiver.multiprocessing, ForkingPickler moved the host rows into shared memory in
    place and freed the memory the store's numpy view still read (a segfault next gather)."""
    topo, x = _graph()
    big = torch.randn(100_000, DIM)
    feature = quiver.Feature(0, [], 0).from_cpu_tensor(big)
    sampler = quiver.pyg.GraphSageSampler(topo, FANOUTS, seed=1)
    sampler.sample(SEEDS)  # the sampler's CSR views exist before the trip
    for obj in (feature, sampler, topo):
        ForkingPickler(io.BytesIO()).dump(obj)
    # reuse the freed memory, so a dangling view would read garbage (or fault)
    junk = [torch.full_like(big, 7.0) for _ in range(3)]
    ids = torch.randint(0, big.shape[0], (2000,))
    assert torch.equal(feature[ids], big[ids])
    n_id, _, adjs = sampler.sample(SEEDS)
    assert _edges_valid(topo, n_id, adjs)
    del junk


def test_each_tensor_is_copied_to_shared_memory_once():
    from quiver.multiprocessing import shared

    topo, _ = _graph()
    a = shared(topo.indptr)
    assert a.is_shared() and not topo.indptr.is_shared()
    assert shared(topo.indptr) is a  # the second trip maps the same copy
    assert torch.equal(a, topo.indptr)
    already = torch.arange(10).share_memory_()
    assert shared(already) is already


def test_feature_and_topo_round_trip_through_the_forking_pickler():
    topo, x = _graph()
    topo.share_memory_()
    feature = quiver.Feature(0, [], 0, csr_topo=topo).from_cpu_tensor(x)
    feature.set_local_order(torch.randperm(N, generator=torch.Generator().manual_seed(5)))
    buf = io.BytesIO()
    ForkingPickler(buf).dump((feature, topo))
    f2, t2 = ForkingPickler.loads(buf.getvalue())
    ids = torch.arange(0, N, 7)
    assert torch.equal(f2[ids], feature[ids])  # the local order travelled too
    assert torch.equal(t2.indptr, topo.indptr) and torch.equal(t2.indices, topo.indices)
    # a topology already in shared memory travels as is, not copied
    assert t2.indptr.data_ptr() == topo.indptr.data_ptr() or t2.indptr.is_shared()
    assert np.array_equal(f2.csr_topo.feature_order.numpy(), topo.feature_order.numpy())


def test_import_quiver_feature_registers_the_reductions():
    """torch-quiver registered them at ``import quiver``; here reaching ``quiver.Feature`` does."""
    import subprocess
    import sys

    code = (
        "import quiver; from multiprocessing.reduction import ForkingPickler as P; "
        "assert 'Feature' not in {c.__name__ for c in P._extra_reducers}; "
        "F = quiver.Feature; import quiver.pyg as g, quiver.graph as t; "
        "assert {F, g.GraphSageSampler, g.MixedGraphSageSampler, t.CSRTopo} "
        "<= set(P._extra_reducers)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
