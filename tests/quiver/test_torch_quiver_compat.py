"""torch-quiver drop-in compatibility: its documented call patterns (README, examples, tests)
run on quiver on CPU and give torch-quiver's results.

Expected values are built the way torch-quiver's sources define them (``CSRTopo(edge_index)``
is a scipy COO -> CSR of ``(edge_index[0], edge_index[1])``; ``feature_order[v]`` is node
``v``'s row in a reordered feature tensor), not from quiver's code.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.multiprocessing as mp

import quiver
from quiver.feature import DeviceConfig, Feature
from quiver.pyg import GraphSageSampler
from quiver.workload import access_probability, psgs

N = 40


def _directed_edges(seed: int = 0, n: int = N, e: int = 300) -> torch.Tensor:
    """A directed graph with repeated edges (a multigraph), as a ``[2, E]`` tensor."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    return torch.cat([ei, ei[:, :50]], dim=1)  # 50 edges twice


def _torch_quiver_rows(ei: torch.Tensor) -> list[list[int]]:
    """torch-quiver's rows: ``csr_matrix((data, (ei[0], ei[1])))`` sums repeats, sorts rows."""
    m = sp.csr_matrix((np.ones(ei.shape[1]), (ei[0].numpy(), ei[1].numpy())), shape=(N, N))
    m.sum_duplicates()
    return [m.indices[m.indptr[v] : m.indptr[v + 1]].tolist() for v in range(N)]


def _rows(topo) -> list[list[int]]:
    ip, ix = topo.indptr.tolist(), topo.indices.tolist()
    return [ix[ip[v] : ip[v + 1]] for v in range(topo.node_count)]


# ---------------------------------------------------------------------------- import


def test_import_quiver_alone_exposes_torch_quiver_names():
    code = (
        "import sys, quiver\n"
        "cheap = 'torch' not in sys.modules\n"
        "names = [quiver.pyg.GraphSageSampler, quiver.utils.CSRTopo, quiver.CSRTopo,\n"
        "         quiver.Feature, quiver.feature.DeviceConfig, quiver.p2pCliqueTopo,\n"
        "         quiver.init_p2p, quiver.generate_neighbour_num, quiver.HybridSampler,\n"
        "         quiver.InferenceServer_Debug, quiver.shard_tensor.ShardTensorConfig,\n"
        "         quiver.partition.partition_without_replication, quiver.feature.PartitionInfo]\n"
        "assert quiver.utils.CSRTopo is quiver.CSRTopo\n"
        "print(cheap)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # `import quiver` alone does not import torch


# ---------------------------------------------------------------------------- CSRTopo


def test_csrtopo_edge_index_follows_torch_quiver_on_a_directed_multigraph():
    ei = _directed_edges()
    topo = quiver.CSRTopo(ei)
    assert topo.orientation == "out"
    assert _rows(topo) == _torch_quiver_rows(ei)  # rows = ei[0], repeats dropped
    assert topo.edge_count < ei.shape[1]
    # eid points at an edge with the stored (row, neighbour)
    src, dst = ei[0][topo.eid], ei[1][topo.eid]
    row = torch.repeat_interleave(torch.arange(N), topo.degree)
    assert torch.equal(src, row) and torch.equal(dst, topo.indices)


def test_sampler_samples_out_neighbours_like_torch_quiver():
    ei = _directed_edges(seed=1)
    rows = _torch_quiver_rows(ei)
    sampler = GraphSageSampler(quiver.CSRTopo(ei), [-1], device=0, mode="CPU")
    seeds = torch.tensor([3, 7, 11])
    n_id, batch_size, adjs = sampler.sample(seeds)
    ((edge_index, _, size),) = adjs
    assert batch_size == 3 and tuple(size) == (n_id.numel(), 3)
    for t, s in enumerate(seeds.tolist()):
        got = sorted(n_id[edge_index[0][edge_index[1] == t]].tolist())
        assert got == rows[s]  # all out-neighbours ei[1] of ei[0] == s, each once


def test_pyg_in_neighbour_convention_is_explicit():
    ei = _directed_edges(seed=2)
    pyg = quiver.CSRTopo(ei, orientation="in", coalesce=False)
    ref = quiver.CSRTopo.from_edge_index(ei)  # quiver's PyG-convention constructor
    assert pyg.orientation == ref.orientation == "in"
    assert _rows(pyg) == _rows(ref)
    for v in range(N):  # row v = sources of the edges into v, repeats kept
        assert sorted(_rows(pyg)[v]) == sorted(ei[0][ei[1] == v].tolist())
    with pytest.raises(ValueError, match="orientation"):
        quiver.CSRTopo(ei, orientation="rows")


def test_csrtopo_from_csr_arrays_and_feature_order_property():
    indptr, indices = torch.tensor([0, 2, 3, 3]), torch.tensor([1, 2, 0])
    topo = quiver.CSRTopo(indptr=indptr, indices=indices)
    assert topo.node_count == 3 and topo.edge_count == 3 and topo.feature_order is None
    topo.feature_order = torch.tensor([2, 0, 1])
    assert topo.feature_order.tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="feature_order"):
        topo.feature_order = torch.tensor([0, 1])


def test_preset_feature_order_is_honoured():
    ei = _directed_edges(seed=3)
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(0))
    topo = quiver.CSRTopo(ei)
    # torch-quiver's convention: the tensor is stored reordered, row feature_order[v] = node v
    prev_order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    feature_order = torch.empty_like(prev_order)
    feature_order[prev_order] = torch.arange(N)
    topo.feature_order = feature_order
    feature = Feature(rank=0, device_list=[], device_cache_size=0, csr_topo=topo)
    feature.from_cpu_tensor(x[prev_order])
    ids = torch.tensor([0, 5, 39, 5, 12])
    assert torch.equal(feature[ids], x[ids])
    assert torch.equal(feature.hot_order(), prev_order)  # the stored order is the hot order


def test_unset_feature_order_is_left_as_a_permutation_by_from_cpu_tensor():
    """torch-quiver fills an unset ``csr_topo.feature_order`` in ``from_cpu_tensor``; quiver
    keeps the caller's rows as given (its hot order stays inside the store), so the order it
    leaves is the identity: row ``feature_order[v]`` of ``x`` is node ``v``, and more stores
    from the same ``x`` and topology answer alike, still with the FAP hot order."""
    ei = _directed_edges(seed=4)
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(0))
    topo = quiver.CSRTopo(ei)
    first = Feature(0, [], 0, csr_topo=topo).from_cpu_tensor(x)
    order = topo.feature_order
    assert order is not None and torch.equal(torch.sort(order).values, torch.arange(N))
    assert torch.equal(x[torch.argsort(order)][order], x)
    again = Feature(0, [], 0, csr_topo=topo).from_cpu_tensor(x)
    ids = torch.tensor([0, 5, 39, 5, 12])
    assert torch.equal(first[ids], x[ids]) and torch.equal(again[ids], x[ids])
    assert torch.equal(again.hot_order(), first.hot_order())


def test_reindex_feature_sorts_by_degree_and_returns_the_feature_order():
    from quiver.utils import reindex_feature

    ei = _directed_edges(seed=5)
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(0))
    topo = quiver.CSRTopo(ei)
    degree = topo.indptr[1:] - topo.indptr[:-1]
    reordered, order = reindex_feature(topo, x, 0.0)
    assert torch.equal(reordered[order], x)  # row feature_order[v] holds node v
    node_at = torch.argsort(order)
    assert (degree[node_at][:-1] >= degree[node_at][1:]).all()  # hottest (highest degree) first
    # ratio > 0 shuffles the leading rows among themselves only
    torch.manual_seed(0)
    shuffled, order2 = reindex_feature(topo, x, 0.5)
    assert torch.equal(shuffled[order2], x)
    assert torch.equal(
        torch.sort(node_at[N // 2 :]).values, torch.sort(torch.argsort(order2)[N // 2 :]).values
    )
    # torch-quiver's pattern: set the order on the topology, store the reordered rows
    topo.feature_order = order2
    feature = Feature(0, [], 0, csr_topo=topo).from_cpu_tensor(shuffled)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(feature[ids], x[ids])
    # shuffle_only reshuffles the leading rows of the already reordered tensor
    again, order3 = reindex_feature(topo, shuffled, 0.5, shuffle_only=True)
    assert torch.equal(again[order3], x) and torch.equal(topo.feature_order, order3)


def test_set_mmap_file_reads_the_rows_not_held_from_the_file(tmp_path):
    """torch-quiver's disk pattern: the store holds some rows (``from_mmap`` with a
    ``DeviceConfig``), ``disk_map[v]`` is node ``v``'s row there or -1 for the file."""
    x = np.random.default_rng(1).standard_normal((N, 4)).astype(np.float32)
    path = tmp_path / "feat.npy"
    np.save(path, x)
    gpu_part, cpu_part = torch.tensor([5, 1, 9]), torch.tensor([0, 2])
    feature = Feature(0, [], 0)
    feature.from_mmap(np.load(path, mmap_mode="r"), DeviceConfig([gpu_part], cpu_part))
    disk_map = torch.full((N,), -1, dtype=torch.int64)
    held = torch.cat([gpu_part, cpu_part])
    disk_map[held] = torch.arange(held.numel())
    feature.set_mmap_file(str(path), disk_map)
    ids = torch.tensor([5, 7, 0, 39, 9, 7])
    assert torch.equal(feature[ids], torch.from_numpy(x[ids.numpy()]))
    clone = pickle.loads(pickle.dumps(feature))
    assert torch.equal(clone[ids], torch.from_numpy(x[ids.numpy()]))
    with pytest.raises(ValueError, match="disk_map"):
        feature.set_mmap_file(str(path), torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------- devices


@pytest.mark.parametrize("device", [-1, 0, "CPU", "cpu", None])
def test_cpu_mode_device_forms(device):
    sampler = GraphSageSampler(quiver.CSRTopo(_directed_edges()), [5, 3], device=device, mode="CPU")
    n_id, _, adjs = sampler.sample(torch.tensor([0, 1, 2]))
    assert n_id.device.type == "cpu" and all(a.edge_index.device.type == "cpu" for a in adjs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("mode", ["GPU", "UVA"])
def test_gpu_modes_without_cuda_raise_a_clear_value_error(mode):
    topo = quiver.CSRTopo(_directed_edges())
    with pytest.raises(ValueError, match="CUDA"):
        GraphSageSampler(topo, [5], device=0, mode=mode)
    with pytest.raises(ValueError, match="mode='CPU'"):
        GraphSageSampler(topo, [5], device=-1, mode="GPU")


# ---------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("frontier", [False, True])
def test_repeated_seeds_as_in_the_unsupervised_example(frontier):
    ei = _directed_edges(seed=4)
    rows = _torch_quiver_rows(ei)
    sampler = GraphSageSampler(quiver.CSRTopo(ei), [4, 3], mode="CPU", seed=0, frontier=frontier)
    g = torch.Generator().manual_seed(5)
    batch = torch.randint(0, N, (8,), generator=g)
    pos, neg = batch.roll(1), torch.randint(0, N, (8,), generator=g)
    seeds = torch.cat([batch, pos, neg])  # repeats for sure (pos is batch rolled)
    n_id, batch_size, adjs = sampler.sample(seeds)
    assert batch_size == 24 and torch.equal(n_id[:24], seeds)
    assert len(set(n_id[24:].tolist())) == n_id.numel() - 24  # the rest once each
    assert not set(n_id[24:].tolist()) & set(seeds.tolist())
    num_targets = [a.size[1] for a in adjs]
    assert num_targets[-1] == 24
    for edge_index, _, (num_src, num_dst) in adjs:
        assert int(edge_index[0].max()) < num_src and int(edge_index[1].max()) < num_dst
        for s_loc, t_loc in edge_index.t().tolist():
            assert int(n_id[s_loc]) in rows[int(n_id[t_loc])]  # a real out-neighbour
    # occurrences of one node share its sampled neighbours
    last = adjs[-1].edge_index
    nbrs = [sorted(n_id[last[0][last[1] == t]].tolist()) for t in range(24)]
    for p in range(24):
        for q in range(24):
            if seeds[p] == seeds[q]:
                assert nbrs[p] == nbrs[q]
        assert len(nbrs[p]) == min(4, len(rows[int(seeds[p])]))
    # a GraphSAGE forward over the adjs runs (target nodes first, as in the example)
    x = torch.randn(n_id.numel(), 3)
    for edge_index, _, size in adjs:
        agg = torch.zeros(size[1], 3).index_add_(0, edge_index[1], x[edge_index[0]])
        x = x[: size[1]] + agg
    assert x.shape == (24, 3)


def test_quiver_samplers_still_reject_repeats_by_default():
    from quiver.sampling import CPUSampler

    with pytest.raises(ValueError, match="duplicate"):
        CPUSampler(quiver.CSRTopo(_directed_edges()), [3]).sample(torch.tensor([1, 1]))


# ---------------------------------------------------------------------------- workload


def test_sample_prob_is_the_access_probability_of_the_training_nodes():
    topo = quiver.CSRTopo(_directed_edges(seed=6))
    sampler = GraphSageSampler(topo, [5, 3], device=0, mode="CPU")
    train_idx = torch.arange(0, N, 4)
    prob = sampler.sample_prob(train_idx, N)
    assert prob.shape == (N,) and prob.dtype == torch.float32
    assert torch.all(prob[train_idx] == 1) and torch.all((prob >= 0) & (prob <= 1))
    p0 = torch.zeros(N, dtype=torch.float64)
    p0[train_idx] = 1
    assert torch.allclose(prob, access_probability(topo, [5, 3], p0))
    with pytest.raises(ValueError, match="total_node_count"):
        sampler.sample_prob(train_idx, N + 1)


def test_generate_neighbour_num_writes_torch_quivers_file(tmp_path):
    ei = _directed_edges(seed=7)
    table = quiver.generate_neighbour_num(N, ei, [25, 10], str(tmp_path), [0], mode="CPU")
    saved = np.load(tmp_path / "25_10_neighbour_num_False.npy")
    assert saved.dtype == np.int32 and saved.shape == (N,)
    expected = psgs(quiver.CSRTopo(ei), [25, 10])
    assert torch.allclose(table, expected)
    assert np.array_equal(saved, np.rint(expected.numpy()).astype(np.int32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_p2p_helpers_are_no_ops_with_a_message_on_cpu():
    with pytest.warns(UserWarning, match="CUDA is not available"):
        topo = quiver.p2pCliqueTopo([0, 1])
    assert topo.p2p_clique == {0: [0], 1: [1]} and topo.get_clique_id(1) == 1
    assert "Devices [0] support p2p access" in topo.info()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert quiver.init_p2p([0, 1]) is None


# ---------------------------------------------------------------------------- features


def test_from_mmap_with_device_config(tmp_path):
    x = np.random.default_rng(0).standard_normal((N, 4)).astype(np.float32)
    path = tmp_path / "feat.npy"
    np.save(path, x)
    arr = np.load(path, mmap_mode="r")
    gpu_part, cpu_part = torch.tensor([5, 1, 9]), torch.tensor([0, 2, 3, 4, 6])
    feature = Feature(0, [], 0, "device_replicate")
    feature.from_mmap(arr, DeviceConfig([gpu_part], cpu_part))
    held = torch.cat([gpu_part, cpu_part])
    assert feature.shape == (8, 4)
    assert torch.equal(feature[torch.arange(8)], torch.from_numpy(x[held.numpy()]))
    # parts given as feature tensors (array None), then node ids mapped by set_local_order
    feature2 = Feature(0, [], 0)
    parts = DeviceConfig([torch.from_numpy(x[gpu_part.numpy()])], torch.from_numpy(x[[7]]))
    feature2.from_mmap(None, parts)
    feature2.set_local_order(torch.tensor([3, 0, 2, 1]))  # row i holds node local_order[i]
    assert torch.equal(feature2[torch.tensor([3, 1])], torch.from_numpy(x[[5, 7]]))
    with pytest.raises(ValueError, match="DeviceConfig"):
        feature.from_mmap(arr, (gpu_part, cpu_part))


# ---------------------------------------------------------------------------- processes


def _worker(rank, sampler, topo, feature, handles, seeds, out_dir):
    sampler_b = GraphSageSampler.lazy_from_ipc_handle(handles[0])
    feature_b = Feature.new_from_ipc_handle(rank, handles[1])
    n_id, _, adjs = sampler.sample(seeds)
    result = {
        "shared": [topo.indptr.is_shared(), topo.indices.is_shared()],
        "n_id": n_id,
        "edge_index": adjs[-1].edge_index,
        "n_id_b": sampler_b.sample(seeds)[0],
        "rows": feature[n_id],
        "rows_b": feature_b[n_id],
    }
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


@pytest.mark.dist
def test_sampler_topology_and_feature_pass_to_mp_spawn(tmp_path):
    topo = quiver.CSRTopo(_directed_edges(seed=8))
    topo.share_memory_()
    assert topo.indptr.is_shared()
    x = torch.randn(N, 3, generator=torch.Generator().manual_seed(2))
    feature = Feature(0, [], 0, csr_topo=topo, placement="degree")
    feature.from_cpu_tensor(x)
    sampler = GraphSageSampler(topo, [4, 2], device=0, mode="CPU", seed=3, num_threads=1)
    handles = (sampler.share_ipc(), feature.share_ipc())
    seeds = torch.tensor([1, 2, 3, 1])
    args = (sampler, topo, feature, handles, seeds, str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    # the parent's first call, with the same seed, is what each child's first call returns
    ref = GraphSageSampler(topo, [4, 2], mode="CPU", seed=3, num_threads=1)
    n_id, _, adjs = ref.sample(seeds)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["shared"] == [True, True]
        assert torch.equal(got["n_id"], n_id) and torch.equal(got["n_id_b"], n_id)
        assert torch.equal(got["edge_index"], adjs[-1].edge_index)
        assert torch.equal(got["rows"], x[n_id]) and torch.equal(got["rows_b"], x[n_id])


def test_feature_and_sampler_pickle_round_trip(tmp_path):
    x = np.random.default_rng(1).standard_normal((N, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    topo = quiver.CSRTopo(_directed_edges(seed=9))
    feature = Feature(0, [], 0, csr_topo=topo, host_cache_size=5 * 16)  # host + disk tiers
    feature.from_mmap(str(tmp_path / "x.npy"))
    back = pickle.loads(pickle.dumps(feature))
    assert [t.name for t in back.tiers] == ["host", "disk"]
    ids = torch.tensor([0, 39, 17, 17])
    assert torch.equal(back[ids], torch.from_numpy(x[ids.numpy()]))
    s = GraphSageSampler(topo, [3, 3], mode="GPU", seed=4)  # torch kernel on the CPU
    s2 = pickle.loads(pickle.dumps(s))
    assert torch.equal(s.sample(ids)[0], s2.sample(ids)[0])


# ---------------------------------------------------------------------------- hybrid


@pytest.mark.dist
def test_hybrid_sampler_names_both_designs():
    from quiver.hybrid import HybridSampler, QueueHybridSampler

    topo = quiver.CSRTopo(_directed_edges())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = HybridSampler(topo, [3, 2], 10.0, gpu_device="cpu")
    assert type(ours) is HybridSampler
    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue()]
    theirs = quiver.HybridSampler(
        csr_topo=topo, sizes=[3, 2], device_num=1, worker_num_per_device=1,
        batched_queue_list=[tasks, [ctx.Queue()]],
    )  # fmt: skip
    assert type(theirs) is QueueHybridSampler
    theirs.start()
    try:
        tasks[0].put(torch.tensor([0, 1, 2]))
        (n_id, batch_size, adjs), seconds = theirs.sampled_request_queue_list()[0][0].get(
            timeout=60
        )
        assert batch_size == 3 and torch.equal(n_id[:3], torch.tensor([0, 1, 2]))
        assert len(adjs) == 2 and seconds >= 0
    finally:
        theirs.stop()
    with pytest.raises(ValueError, match="device_num"):
        HybridSampler(topo, [3], 0, 1, [[], []])


# ---------------------------------------------------------------------------- partition API


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _partition_worker(rank, port, result_path, x, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # torch-quiver's pattern: load this host's partition, build its feature and info
        book, res, cache = quiver.load_quiver_feature_partition(rank, result_path)
        local = torch.cat([res, cache]) if cache is not None else res
        feature = quiver.Feature(0, [], 0).from_cpu_tensor(x[local])
        info = quiver.PartitionInfo("cpu", rank, 2, book, cache)
        dist_feature = quiver.DistFeature(feature, info, None)
        ids = torch.randint(0, x.shape[0], (25,), generator=torch.Generator().manual_seed(rank))
        torch.save((ids, dist_feature[ids]), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_partition_api_and_dist_feature_with_partition_info(tmp_path):
    """torch-quiver's multi-host pattern: ``quiver_partition_feature`` by access probability,
    ``load_quiver_feature_partition`` per host, ``DistFeature(feature, PartitionInfo, comm)``;
    every host's gather equals ``x[ids]`` (two gloo processes)."""
    g = torch.Generator().manual_seed(0)
    n = 300
    probs = [torch.rand(n, generator=g), torch.rand(n, generator=g)]
    x = torch.randn(n, 4, generator=g)
    result = tmp_path / "parts"
    book, res, cache = quiver.partition.quiver_partition_feature(
        probs, str(result), cache_memory_budget=16 * 20, per_feature_size=16, chunk_size=32
    )
    owned = torch.cat(res)
    assert torch.equal(torch.sort(owned).values, torch.arange(n))  # each node one owner
    assert abs(res[0].numel() - res[1].numel()) <= 32
    for k in range(2):
        assert torch.equal(book[res[k]], torch.full_like(res[k], k))
        assert cache[k].numel() == 10 and bool((book[cache[k]] != k).all())
        # a partition favours the nodes it reads more than the other does
        assert float((probs[k] - probs[1 - k])[res[k]].mean()) > 0.2
    loaded = quiver.load_quiver_feature_partition(1, str(result))
    assert torch.equal(loaded[0], book) and torch.equal(loaded[1], res[1])
    with pytest.raises(ValueError, match="already exists"):
        quiver.quiver_partition_feature(probs, str(result))
    port = _free_port()
    mp.spawn(_partition_worker, args=(port, str(result), x, str(tmp_path)), nprocs=2)
    for rank in range(2):
        ids, rows = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(rows, x[ids])


def test_partition_info_dispatch_routes_to_owners_and_replicas():
    book = torch.tensor([0, 1, 1, 0, 1, 0])
    info = quiver.PartitionInfo("cpu", 0, 2, book, replicate=torch.tensor([4]))
    assert info.local_order.tolist() == [0, 3, 5, 4]
    host_ids, host_orders = info.dispatch(torch.tensor([4, 2, 5, 1]))
    # node 4 is replicated here (local row 3); 2 and 1 are host 1's rows 1 and 0
    assert host_ids[0].tolist() == [3, 2] and host_orders[0].tolist() == [0, 2]
    assert host_ids[1].tolist() == [1, 0] and host_orders[1].tolist() == [1, 3]


# ---------------------------------------------------------------------------- mixed sampler


def _seed_job(seeds: torch.Tensor, batch: int):
    """torch-quiver's example job: batches of training seeds, reshuffled every epoch."""

    class SeedJob(quiver.SampleJob):
        def __init__(self):
            self.seeds, self.batch, self.shuffles = seeds, batch, 0

        def __getitem__(self, index):
            return self.seeds[index * self.batch : (index + 1) * self.batch]

        def __len__(self):
            return (self.seeds.numel() + self.batch - 1) // self.batch

        def shuffle(self):
            self.shuffles += 1
            self.seeds = self.seeds[torch.randperm(self.seeds.numel())]

    return SeedJob()


def test_mixed_graph_sage_sampler_iterates_a_sample_job():
    from quiver.pyg import MixedGraphSageSampler

    topo = quiver.CSRTopo(_directed_edges(seed=6))
    job = _seed_job(torch.arange(N), 7)
    sampler = MixedGraphSageSampler(job, 3, topo, [-1, -1], device=0, mode="UVA_CPU_MIXED")
    reference = GraphSageSampler(topo, [-1, -1], mode="CPU")
    for epoch in (1, 2):
        results = list(sampler)
        assert job.shuffles == epoch and len(results) == len(job) == 6
        for i, (n_id, batch_size, adjs) in enumerate(results):
            want_n_id, want_size, want_adjs = reference.sample(job[i])
            assert batch_size == want_size == job[i].numel()
            assert torch.equal(n_id, want_n_id)
            for a, b in zip(adjs, want_adjs):
                assert torch.equal(a.edge_index, b.edge_index) and tuple(a.size) == tuple(b.size)
    clone = MixedGraphSageSampler.lazy_from_ipc_handle(sampler.share_ipc())
    assert len(list(clone)) == 6
    with pytest.raises(ValueError, match="mode"):
        MixedGraphSageSampler(job, 1, topo, [2], mode="CPU_ONLY")


# ---------------------------------------------------------------------------- serving queues


class _AdjsSAGE(torch.nn.Module):
    """torch-quiver's serving model: ``forward(x, adjs)`` over bipartite hops."""

    def __init__(self):
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.convs = torch.nn.ModuleList([SAGEConv(5, 8), SAGEConv(8, 3)])

    def forward(self, x, adjs):
        for i, (edge_index, _, size) in enumerate(adjs):
            x = self.convs[i]((x, x[: size[1]]), edge_index)
            if i == 0:
                x = torch.relu(x)
        return x


@pytest.mark.parametrize("mode", ["CPU", "GPU"])
def test_request_batcher_and_inference_server_pipeline(tmp_path, mode):
    """torch-quiver's serving example: stream queues -> RequestBatcher -> HybridSampler (CPU
    mode) -> InferenceServer -> result queues; each output is the model on that batch's
    all-neighbour sample."""
    ei = _directed_edges(seed=7)
    topo = quiver.CSRTopo(ei)
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _AdjsSAGE().eval()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    ctx = mp.get_context("spawn")
    streams = [ctx.Queue()]
    batcher = quiver.RequestBatcher(1, streams, 1, sample_mode=mode)
    tasks = batcher.batched_request_queue_list()
    sampler = None
    if mode == "CPU":
        sampler = quiver.HybridSampler(topo, [-1, -1], 1, 1, tasks)
        sampler.start()
        tasks = sampler.sampled_request_queue_list()
    server = quiver.InferenceServer(
        str(path), [0], x, tasks, mode, topo, [-1, -1], proc_num_per_device=1
    )
    results = server.result_queue_list()
    server.start(join=False)
    try:
        batches = [torch.tensor([0, 5, 7]), torch.tensor([39, 1])]
        reference = GraphSageSampler(topo, [-1, -1], mode="CPU")
        for seeds in batches:
            streams[0].put(seeds)
            out = results[0].get(timeout=60)
            n_id, _, adjs = reference.sample(seeds)
            with torch.no_grad():
                want = model(x[n_id], adjs)
            assert out.shape == (seeds.numel(), 3)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    finally:
        server.stop()
        streams[0].put(None)
        if sampler is not None:
            sampler.stop()


def _serving_world(tmp_path):
    ei = _directed_edges(seed=7)
    topo = quiver.CSRTopo(ei)
    x = torch.randn(N, 5, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _AdjsSAGE().eval()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return topo, x, model, path


def test_inference_server_start_blocks_as_in_torch_quivers_serving_example(tmp_path):
    """torch-quiver's ``start()`` is ``mp.spawn(..., join=True)`` and its example
    (``examples/serving/reddit/reddit_serving.py``) calls it last, after starting the request
    and result-printing processes: it serves until the workers end. Here the reader stops the
    server once it has every answer, and the blocked ``start()`` then returns."""
    import threading

    topo, x, model, path = _serving_world(tmp_path)
    ctx = mp.get_context("spawn")
    streams = [ctx.Queue()]
    batcher = quiver.RequestBatcher(1, streams, 1, sample_mode="GPU")
    server = quiver.InferenceServer(
        model_path=str(path), device_list=[0], x_feature=x,
        task_queue_list=batcher.batched_request_queue_list(), sample_mode="GPU",
        csr_topo=topo, sizes=[-1, -1], proc_num_per_device=1,
    )  # fmt: skip
    results = server.result_queue_list()
    batches = [torch.tensor([0, 5, 7]), torch.tensor([39, 1]), torch.tensor([3])]
    got = []

    def print_result():  # the example's result process
        try:
            for _ in batches:
                got.append(results[0].get(timeout=60))
        finally:
            server.stop()  # also when an answer never came: start() must not hang the test

    reader = threading.Thread(target=print_result, daemon=True)
    reader.start()
    for seeds in batches:  # the example's request process, started before start()
        streams[0].put(seeds)
    server.start()  # blocks until the reader stops the server
    reader.join(5)
    assert not reader.is_alive() and len(got) == len(batches)
    reference = GraphSageSampler(topo, [-1, -1], mode="CPU")
    for seeds, out in zip(batches, got):
        n_id, _, adjs = reference.sample(seeds)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x[n_id], adjs), rtol=0, atol=1e-5)
    streams[0].put(None)


@pytest.mark.parametrize("mode", ["CPU", "GPU"])
def test_inference_server_debug_reports_latency_and_saves_rows(tmp_path, mode, capsys):
    """``quiver.InferenceServer_Debug`` with torch-quiver's arguments (``result_path``,
    ``exp_id``, ``ignord_length``): an idle queue makes each worker print its summary and save
    ``{exp_id}_{CPU|GPU}_{rank}.npy``, one row per batch after the ignored ones."""
    topo, x, _, path = _serving_world(tmp_path)
    ctx = mp.get_context("spawn")
    streams = [ctx.Queue()]
    batcher = quiver.RequestBatcher(1, streams, 1, sample_mode=mode)
    tasks = batcher.batched_request_queue_list()
    sampler = None
    if mode == "CPU":
        sampler = quiver.HybridSampler(topo, [-1, -1], 1, 1, tasks)
        sampler.start()
        tasks = sampler.sampled_request_queue_list()
    out_dir = tmp_path / "result"
    server = quiver.InferenceServer_Debug(
        model_path=str(path), device_list=[0], x_feature=x, task_queue_list=tasks,
        sample_mode=mode, csr_topo=topo, sizes=[-1, -1], result_path=str(out_dir),
        exp_id="exp", ignord_length=1, proc_num_per_device=1,
    )  # fmt: skip
    server.idle_s = 0.5
    server.start(join=False)
    try:
        for i in range(4):
            streams[0].put(torch.tensor([i, i + 10]))
        deadline = time.monotonic() + 60
        while not server.summaries and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
        streams[0].put(None)
        if sampler is not None:
            sampler.stop()
    (summary,) = server.summaries
    assert summary["kind"] == mode and summary["total"] == 6  # 3 batches of 2 after 1 ignored
    rows = np.load(out_dir / f"exp_{mode}_0.npy")
    assert rows.shape == (3, 5) and rows[:, 3].tolist() == [2, 2, 2]
    assert bool((rows[:, 2] >= rows[:, 0]).all()) and bool((rows[:, 4] >= 2).all())
    assert f"{mode} Rank 0: Avg Latency:" in capsys.readouterr().out
    assert server.result_queue_list()[0].empty()  # timings, not outputs


# ---------------------------------------------------------------------------- shard_tensor


def test_shard_tensor_host_parts_as_torch_quivers_feature_builds_them():
    """``from quiver.shard_tensor import ShardTensor, ShardTensorConfig`` (torch-quiver's
    ``feature.py`` and DGL benchmarks): parts appended in order, ``shard[ids]`` in row order."""
    from quiver.shard_tensor import ShardTensor, ShardTensorConfig

    assert quiver.shard_tensor.ShardTensor is ShardTensor
    x = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
    shard = ShardTensor(0, ShardTensorConfig({}))
    shard.append(x, -1)
    ids = torch.tensor([29, 0, 7, 7])
    assert torch.equal(shard[ids], x[ids]) and shard.shape == [30, 4] and shard.size(0) == 30
    whole = ShardTensor(0, ShardTensorConfig({}))
    whole.from_cpu_tensor(x)  # no budgets: every row in host memory
    assert torch.equal(whole[ids], x[ids]) and whole.cpu_tensor is not None
    clone = ShardTensor.new_from_share_ipc(whole.share_ipc(), 0)
    assert torch.equal(clone[ids], x[ids])
    with pytest.raises(ValueError, match="appended last"):
        shard.append(x, -1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_shard_tensor_gpu_parts_without_cuda_raise_one_line():
    from quiver.shard_tensor import ShardTensor, ShardTensorConfig

    x = torch.randn(30, 4)
    with pytest.raises(ValueError, match="device 0 is a GPU and CUDA is not available"):
        ShardTensor(0, ShardTensorConfig({})).append(x[:10], 0)
    with pytest.raises(ValueError, match="CUDA is not available"):
        ShardTensor(0, ShardTensorConfig({0: "64"})).from_cpu_tensor(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shard_tensor_gpu_and_host_parts():
    from quiver.shard_tensor import ShardTensor, ShardTensorConfig

    x = torch.randn(30, 4)
    shard = ShardTensor(0, ShardTensorConfig({0: 10 * 4 * 4}))
    shard.from_cpu_tensor(x)
    ids = torch.tensor([29, 0, 9, 10])
    got = shard[ids]
    assert got.device.type == "cuda" and torch.equal(got.cpu(), x[ids])
    assert shard.shard_tensor_config.tensor_offset_device[0].end == 10


# ---------------------------------------------------------------------------- partition names


def test_partition_without_replication_as_torch_quivers_preprocess_calls_it():
    """torch-quiver's ``benchmarks/*/preprocess.py``: ``_, nz = select_nodes(0, probs, None)``;
    ``res = partition_without_replication(0, probs, nz.squeeze())``;
    ``global2host[res[h]] = h``. Every accessed node gets exactly one host, hosts get equal
    shares per round, and each host mostly gets the nodes it reads more."""
    from quiver.partition import partition_without_replication, select_nodes

    g = torch.Generator().manual_seed(0)
    n, hosts = 500, 2
    probs = [torch.rand(n, generator=g) for _ in range(hosts)]
    probs[0][:50] = 0
    probs[1][:50] = 0  # nobody reads the first 50
    prob_sum, nz = select_nodes(0, probs, None)
    assert torch.allclose(prob_sum, probs[0] + probs[1]) and nz.shape == (450, 1)
    res = partition_without_replication(0, probs, nz.squeeze())
    global2host = torch.full((n,), -1, dtype=torch.int32)
    for h in range(hosts):
        global2host[res[h]] = h
    assert torch.equal(torch.sort(torch.cat(res)).values, nz.squeeze())  # one host each
    assert bool((global2host[:50] == -1).all())
    assert abs(res[0].numel() - res[1].numel()) <= 32
    for h in range(hosts):
        assert float((probs[h] - probs[1 - h])[res[h]].mean()) > 0.2
    whole = partition_without_replication("cpu", probs, None)  # every node, ids 0..N-1
    assert torch.equal(torch.sort(torch.cat(whole)).values, torch.arange(n))
    # the local split of the same script: a subset's positions, one list per GPU
    local = partition_without_replication(0, [p[:100] for p in probs], torch.arange(10, 90))
    assert torch.equal(torch.sort(torch.cat(local)).values, torch.arange(10, 90))


def test_partition_info_is_reachable_as_quiver_feature_partition_info():
    """torch-quiver's training scripts build ``quiver.feature.PartitionInfo(device, host,
    hosts, global2host, replicate)``; it is the class ``DistFeature`` reads."""
    book = torch.tensor([0, 1, 1, 0])
    info = quiver.feature.PartitionInfo(0, 1, 2, book)
    assert quiver.feature.PartitionInfo is quiver.PartitionInfo is quiver.partition.PartitionInfo
    assert info.local_order.tolist() == [1, 2]
    host_ids, _ = info.dispatch(torch.tensor([3, 2]))
    assert host_ids[0].tolist() == [1] and host_ids[1].tolist() == [1]
