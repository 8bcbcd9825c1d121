"""Neighbour sampling kernels: validity, exact fanouts, uniformity, reproducibility, errors.

Both kernels run here on CPU tensors: the numba CPU kernel and the vectorized torch kernel that
``mode="GPU"`` uses. Statistical tests use fixed seeds and a significance level of 1e-3.
"""

import itertools
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from quiver.graph import CSRTopo
from quiver.sampling import CPUSampler, TorchSampler, sample_neighbors

KERNELS = ["cpu", "torch"]


def make_sampler(kind, topo, sizes, seed=0, **kw):
    if kind == "cpu":
        return CPUSampler(topo, sizes, seed=seed, **kw)
    return TorchSampler(topo, sizes, seed=seed, **kw)


@pytest.fixture(scope="module")
def graph():
    """A skewed random graph without multi-edges: 400 nodes, hubs of in-degree ~100."""
    rng = np.random.default_rng(0)
    n = 400
    u = rng.random(6000)
    dst = (n * u**2).astype(np.int64)  # low ids collect many in-edges
    src = rng.integers(0, n, 6000)
    pairs = np.unique(np.stack([src, dst], 1), axis=0)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    rng.shuffle(pairs)
    ei = torch.from_numpy(pairs.T.copy())
    return ei, CSRTopo.from_edge_index(ei, num_nodes=n + 5)  # 5 isolated nodes at the end


def in_neighbours(ei, n):
    rows = [set() for _ in range(n)]
    for s, d in ei.t().tolist():
        rows[d].add(s)
    return rows


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("frontier", [False, True])
def test_sample_is_a_valid_relabelled_subgraph(graph, kind, frontier):
    ei, topo = graph
    rows = in_neighbours(ei, topo.node_count)
    deg = topo.degree
    sizes = [15, 10, 5]
    sampler = make_sampler(kind, topo, sizes, seed=3, frontier=frontier)
    seeds = torch.tensor([0, 7, 150, 399, 404, 2, 33])
    out = sampler.sample_subgraph(seeds)
    n_id = out.n_id
    assert out.batch_size == 7
    assert torch.equal(n_id[:7], seeds), "seeds come first, in order"
    assert n_id.unique().numel() == n_id.numel(), "n_id is unique"
    assert out.num_nodes[0] == 7 and out.num_nodes[-1] == n_id.numel()
    for h, k in enumerate(sizes):
        adj = out.hop(h)
        src, dst = adj.edge_index
        num_src, num_dst = adj.size
        assert num_src == out.num_nodes[h + 1] and num_dst == out.num_nodes[h]
        assert bool((src >= 0).all() and (src < num_src).all())
        assert bool((dst >= 0).all() and (dst < num_dst).all())
        gs, gd = n_id[src], n_id[dst]
        # every sampled edge exists, and its e_id names it in the input edge list
        assert all(s in rows[d] for s, d in zip(gs.tolist(), gd.tolist()))
        assert torch.equal(ei[0, adj.e_id], gs) and torch.equal(ei[1, adj.e_id], gd)
        # targets: all gathered nodes, or (frontier) only the previous hop's new nodes
        first = out.num_nodes[h - 1] if (frontier and h > 0) else 0
        counts = torch.bincount(dst, minlength=num_dst)
        expect = torch.zeros(num_dst, dtype=torch.long)
        expect[first:] = deg[n_id[first:num_dst]].clamp(max=k)
        assert torch.equal(counts, expect), "each target gets min(degree, fanout) neighbours"
        per_target = Counter(zip(dst.tolist(), gs.tolist()))
        assert max(per_target.values()) == 1, "neighbours of a target are distinct"
        # every source of this hop is already known or was added by this hop
        assert int(src.max()) < out.num_nodes[h + 1]


@pytest.mark.parametrize("kind", KERNELS)
def test_adjs_in_legacy_neighborsampler_order(graph, kind):
    _, topo = graph
    n_id, bs, adjs = make_sampler(kind, topo, [4, 3]).sample(torch.tensor([1, 2]))
    assert bs == 2 and len(adjs) == 2
    edge_index, e_id, size = adjs[-1]  # the last Adj targets the seeds
    assert size[1] == 2
    assert adjs[0].size[0] == n_id.numel()  # the first Adj's sources are all nodes
    assert adjs[0].size[1] == adjs[1].size[0]


def _subset_counts(sample_fn, deg_node, k, trials):
    counts = Counter()
    for nbrs in sample_fn(deg_node, k, trials):
        counts[tuple(sorted(nbrs))] += 1
    return counts


@pytest.mark.parametrize("kind", KERNELS)
def test_uniform_over_subsets_chi_square(kind):
    # node 0 has 6 in-neighbours; k=2 gives 15 equally likely pairs
    ei = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 0]])
    topo = CSRTopo.from_edge_index(ei)
    trials = 6000
    nodes = torch.zeros(trials, dtype=torch.long)  # one independent draw per repeated row
    if kind == "cpu":
        counts, nbrs, _ = sample_neighbors(topo, nodes, 2, seed=11)
    else:
        g = torch.Generator().manual_seed(11)
        counts, nbrs, _ = sample_neighbors(topo, nodes, 2, generator=g)
    assert bool((counts == 2).all())
    pairs = Counter(tuple(sorted(p)) for p in nbrs.view(-1, 2).tolist())
    assert set(pairs) == set(itertools.combinations(range(1, 7), 2))
    observed = np.array([pairs[p] for p in sorted(pairs)])
    assert stats.chisquare(observed).pvalue > 1e-3
    assert all(a != b for a, b in pairs)


@pytest.mark.parametrize("kind", KERNELS)
def test_uniform_neighbour_frequencies_across_calls(graph, kind, one_torch_thread):
    # repeated multi-hop calls on a hub: each in-neighbour is picked with probability k/deg
    ei, topo = graph
    hub = int(torch.argmax(topo.degree))
    deg = int(topo.degree[hub])
    assert deg > 60
    sampler = make_sampler(kind, topo, [10], seed=5)
    freq = Counter()
    calls = 1500
    for _ in range(calls):
        n_id, _, adjs = sampler.sample(torch.tensor([hub]))
        freq.update(n_id[adjs[0].edge_index[0]].tolist())
    nbrs = sorted(in_neighbours(ei, topo.node_count)[hub])
    observed = np.array([freq[v] for v in nbrs])
    assert observed.sum() == calls * 10
    assert stats.chisquare(observed).pvalue > 1e-3


@pytest.fixture
def one_torch_thread():
    # many tiny torch ops: intra-op threads only add barrier waits on shared cores
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_gpu_kernel_agrees_in_distribution_with_cpu_kernel(graph, one_torch_thread):
    _, topo = graph
    hub = int(torch.argmax(topo.degree))
    seeds = torch.tensor([hub, 3, 9])
    hists, sizes = [], []
    for kind in KERNELS:
        sampler = make_sampler(kind, topo, [8, 4], seed=21)
        freq = Counter()
        n_sizes = []
        for _ in range(400):
            out = sampler.sample_subgraph(seeds)
            a, b = out.edge_ptr[0], out.edge_ptr[1]
            hub_edges = out.dst[a:b] == 0
            freq.update(out.n_id[out.src[a:b][hub_edges]].tolist())
            n_sizes.append(out.n_id.numel())
        hists.append(freq)
        sizes.append(np.array(n_sizes))
    keys = sorted(set(hists[0]) | set(hists[1]))
    table = np.array([[h[k] for k in keys] for h in hists])
    assert stats.chi2_contingency(table).pvalue > 1e-3
    # the size of the sampled subgraph has the same distribution too
    assert stats.ks_2samp(sizes[0], sizes[1]).pvalue > 1e-3


@pytest.mark.parametrize("kind", KERNELS)
def test_same_seed_same_result_different_seed_differs(graph, kind):
    _, topo = graph
    seeds = torch.arange(0, 40)
    a = make_sampler(kind, topo, [10, 5], seed=1)
    b = make_sampler(kind, topo, [10, 5], seed=1)
    c = make_sampler(kind, topo, [10, 5], seed=2)
    for _ in range(2):  # the call sequence repeats too
        ra, rb, rc = (s.sample_subgraph(seeds) for s in (a, b, c))
        assert torch.equal(ra.n_id, rb.n_id) and torch.equal(ra.e_id, rb.e_id)
        assert not torch.equal(ra.e_id, rc.e_id)


def test_cpu_result_does_not_depend_on_thread_count(graph, monkeypatch):
    import quiver.sampling.cpu as cpu

    _, topo = graph
    monkeypatch.setattr(cpu, "PARALLEL_MIN_TARGETS", 1)  # force the parallel path
    seeds = torch.arange(100, 300)
    one = CPUSampler(topo, [15, 10, 5], seed=9, num_threads=1).sample_subgraph(seeds)
    two = CPUSampler(topo, [15, 10, 5], seed=9, num_threads=2).sample_subgraph(seeds)
    assert torch.equal(one.n_id, two.n_id) and torch.equal(one.e_id, two.e_id)
    assert torch.equal(one.src, two.src) and torch.equal(one.dst, two.dst)


def test_concurrent_threads_share_one_cpu_sampler(graph):
    """Three threads on one sampler: every call of every thread finishes with a valid sample
    (a race on shared marker arrays shows as duplicate ids, a wrong seed prefix or an
    exception in a thread, each of which fails the test), and the sampler stays usable."""
    ei, topo = graph
    edges = set(zip(ei[0].tolist(), ei[1].tolist()))
    sampler = CPUSampler(topo, [10, 5], seed=4)
    errors: list[BaseException] = []
    done = []

    def work(offset):
        try:
            for i in range(50):
                seeds = torch.arange(offset + i % 7, offset + 40 + i % 7)
                out = sampler.sample_subgraph(seeds)
                assert out.n_id.unique().numel() == out.n_id.numel()
                assert torch.equal(out.n_id[:40], seeds)
                # every sampled edge (local src -> local dst) is an edge of the graph
                pairs = set(zip(out.n_id[out.src].tolist(), out.n_id[out.dst].tolist()))
                assert pairs <= edges
            done.append(offset)
        except BaseException as e:  # noqa: BLE001 - any exception in a thread fails the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(o,)) for o in (0, 100, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(done) == [0, 100, 200]
    # the shared sampler itself is left consistent (its markers were restored)
    after = sampler.sample_subgraph(torch.arange(5))
    assert after.n_id.unique().numel() == after.n_id.numel() > 5


@pytest.mark.parametrize("kind", KERNELS)
def test_empty_seeds_give_empty_well_formed_result(graph, kind):
    _, topo = graph
    for seeds in (torch.empty(0, dtype=torch.long), []):
        n_id, bs, adjs = make_sampler(kind, topo, [5, 5]).sample(seeds)
        assert bs == 0 and n_id.numel() == 0 and n_id.dtype == torch.int64
        assert len(adjs) == 2
        for edge_index, e_id, size in adjs:
            assert edge_index.shape == (2, 0) and e_id.numel() == 0 and size == (0, 0)


@pytest.mark.parametrize("kind", KERNELS)
def test_isolated_seed_has_no_edges(graph, kind):
    _, topo = graph
    n_id, bs, adjs = make_sampler(kind, topo, [5, 5]).sample(torch.tensor([topo.node_count - 1]))
    assert n_id.tolist() == [topo.node_count - 1]
    assert all(a.edge_index.shape == (2, 0) for a in adjs)


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize(
    "seeds,match",
    [
        (torch.tensor([1, -1]), "negative"),
        (torch.tensor([1, 405]), "node_count"),
        (torch.tensor([1.0, 2.0]), "integer"),
        (torch.tensor([[1, 2]]), "1-D"),
        (np.array([0.5]), "integers"),
        (torch.tensor([3, 4, 3]), "duplicate"),
    ],
)
def test_bad_seeds_raise_value_error(graph, kind, seeds, match):
    _, topo = graph
    sampler = make_sampler(kind, topo, [5])
    with pytest.raises(ValueError, match=match):
        sampler.sample(seeds)
    # a failed call leaves the sampler usable
    assert sampler.sample(torch.tensor([3, 4]))[0][:2].tolist() == [3, 4]


@pytest.mark.parametrize("sizes", [[], [0], [3, -2], "ab"])
def test_bad_fanouts(graph, sizes):
    _, topo = graph
    with pytest.raises(ValueError):
        CPUSampler(topo, sizes)


@pytest.mark.parametrize("kind", KERNELS)
def test_fanout_minus_one_takes_every_neighbour(graph, kind):
    ei, topo = graph
    rows = in_neighbours(ei, topo.node_count)
    out = make_sampler(kind, topo, [-1]).sample_subgraph(torch.tensor([0, 1]))
    got = set(zip(out.n_id[out.dst].tolist(), out.n_id[out.src].tolist()))
    assert got == {(d, s) for d in (0, 1) for s in rows[d]}


def test_sample_neighbors_one_hop_both_kernels(graph):
    ei, topo = graph
    rows = in_neighbours(ei, topo.node_count)
    nodes = torch.tensor([0, 0, 5, 404])  # repeats allowed here
    for gen in (None, torch.Generator().manual_seed(0)):
        counts, nbrs, e = sample_neighbors(topo, nodes, 4, generator=gen)
        assert counts.tolist() == [min(len(rows[v]), 4) for v in nodes.tolist()]
        owner = torch.repeat_interleave(nodes, counts)
        assert torch.equal(ei[0, e], nbrs) and torch.equal(ei[1, e], owner)


def test_csr_without_eid_reports_csr_positions(graph):
    _, topo = graph
    bare = CSRTopo.from_csr(topo.indptr, topo.indices)
    for kind in KERNELS:
        out = make_sampler(kind, bare, [6]).sample_subgraph(torch.tensor([0, 1, 2]))
        assert torch.equal(bare.indices[out.e_id], out.n_id[out.src])


def test_uva_without_cuda_is_a_clear_error(graph):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    _, topo = graph
    with pytest.raises(ValueError, match="CUDA"):
        TorchSampler(topo, [5], mode="UVA")


def _reference_fill(indices, starts, degs, k, key):
    """Row by row in plain Python: Floyd's positions from stream ``(key, i)``, sorted, then the
    ids."""
    from quiver.sampling import _cpu_kernel as K

    cols, eids = [], []
    for i, (start, deg) in enumerate(zip(starts.tolist(), degs.tolist())):
        if deg <= k:
            pos = list(range(deg))
        else:
            # numba hands uint64 back as Python ints: keep the state a uint64 between calls
            with np.errstate(over="ignore"):
                state = np.uint64(K._mix(np.uint64(key) ^ (np.uint64(i) * K._GOLDEN)))
            pos = []
            for m in range(k):
                j = deg - k + m
                state, r = K._below(state, j + 1)
                state = np.uint64(state)
                pos.append(j if r in pos else int(r))
            pos.sort()  # canonical: the row's (CSR) order
        cols += [int(indices[start + p]) for p in pos]
        eids += [start + p for p in pos]
    return cols, eids


@pytest.mark.parametrize("k", [1, 3, 7])
def test_two_pass_row_fill_equals_row_by_row_floyd(k):
    """The kernel draws every row's positions first and reads the graph after; the result is
    exactly the row-by-row algorithm's, chunk by chunk and over the whole hop."""
    from quiver.sampling import _cpu_kernel as K

    rng = np.random.default_rng(5)
    degs = rng.integers(0, 12, size=300).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(degs)[:-1]]).astype(np.int64)
    indices = rng.integers(0, 1000, size=int(degs.sum())).astype(np.int64)
    key = np.uint64(K.stream_key(11, 2, 1))
    offs = K.row_offsets(degs, k)
    cols = np.empty(offs[-1], dtype=np.int64)
    eids = np.empty(offs[-1], dtype=np.int64)
    empty = np.empty(0, dtype=np.int64)
    for lo, hi in [(0, 120), (120, 121), (121, 300)]:
        K.fill_range(indices, empty, False, starts, degs, k, key, offs, cols, eids, lo, hi)
    want_cols, want_eids = _reference_fill(indices, starts, degs, k, key)
    assert cols.tolist() == want_cols and eids.tolist() == want_eids


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("frontier", [False, True])
def test_sampled_neighbours_come_in_csr_order(graph, kind, frontier):
    """A target's sampled neighbours reach the model in its row's (CSR) order, however the
    draws fell, so an order-sensitive aggregator (LSTM) sees one canonical sequence."""
    _, topo = graph
    bare = CSRTopo.from_csr(topo.indptr, topo.indices)  # e_id = CSR positions
    sampler = make_sampler(kind, bare, [8, 4], seed=1, frontier=frontier)
    out = sampler.sample_subgraph(torch.tensor([0, 1, 2, 3, 50, 120]))  # hubs: rows > 8
    drawn = 0
    for _src, dst, e_id in out.hops:
        assert bool((dst[1:] >= dst[:-1]).all())  # grouped by target
        same = dst[1:] == dst[:-1]
        assert bool((e_id[1:][same] > e_id[:-1][same]).all()), "not in CSR order"
        targets, counts = torch.unique_consecutive(dst, return_counts=True)
        drawn += int((bare.degree[out.n_id[targets]] > counts).sum())
    assert drawn > 0  # some rows were drawn from, not taken whole
