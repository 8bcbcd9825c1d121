"""Feature store: every placement and tier mix gathers exactly ``x[n_id]``; capacities, stats,
cliques and errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from quiver.feature import Feature, detect_cliques, hot_order, parse_bytes
from quiver.graph import CSRTopo
from quiver.workload import fap

N, DIM = 500, 6


@pytest.fixture(scope="module")
def topo() -> CSRTopo:
    rng = np.random.default_rng(0)
    w = 1.0 / np.arange(1, N + 1)
    src = rng.choice(N, size=4000, p=w / w.sum())
    dst = rng.integers(0, N, size=4000)
    return CSRTopo(edge_index=np.stack([src, dst]), num_nodes=N, orientation="in", coalesce=False)


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(N, DIM, generator=torch.Generator().manual_seed(1))


def _ids_hitting_every_tier(feat: Feature) -> torch.Tensor:
    """Ids covering every tier's first and last row, repeated, shuffled, plus random ids."""
    order = feat.hot_order()
    pos = []
    for t in feat.tiers:
        pos += [t.start, t.stop - 1, (t.start + t.stop) // 2]
    ids = order[torch.tensor(pos)]
    rand = torch.randint(0, N, (300,), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([ids, ids, rand])
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))]


def _expected_counts(feat: Feature, ids: torch.Tensor) -> dict[str, int]:
    pos = torch.empty(N, dtype=torch.int64)
    pos[feat.hot_order()] = torch.arange(N)
    p = pos[ids]
    return {t.name: int(((p >= t.start) & (p < t.stop)).sum()) for t in feat.tiers}


ROW = DIM * 4
CONFIGS = {
    # name: (constructor kwargs, source)
    "cpu-host-only": (dict(), "tensor"),
    "replicated+host": (dict(device_list=["cpu", "cpu"], device_cache_size=ROW * 50), "tensor"),
    "replicated-all": (dict(device_list=["cpu"], device_cache_size="1M"), "tensor"),
    "clique+host": (
        dict(
            device_list=["cpu"] * 4,
            device_cache_size=ROW * 40,
            cache_policy="p2p_clique_replicate",
            rank=3,
            peer_access=lambda i, j: (i < 2) == (j < 2),  # cliques {0,1} and {2,3}
        ),
        "tensor",
    ),
    "ram+disk": (dict(host_cache_size=ROW * 100), "mmap"),
    "disk-only": (dict(), "mmap"),
    "replicated+ram+disk": (
        dict(device_list=["cpu"], device_cache_size=ROW * 30, host_cache_size=ROW * 70),
        "mmap",
    ),
    "clique+ram+disk": (
        dict(
            device_list=["cpu"] * 3,
            device_cache_size=ROW * 20,
            cache_policy="p2p_clique_replicate",
            host_cache_size="4K",
        ),
        "mmap",
    ),
}


def _build(kwargs, source, x, tmp_path, **extra) -> Feature:
    feat = Feature(**kwargs, **extra)
    if source == "tensor":
        return feat.from_cpu_tensor(x)
    path = tmp_path / "features.npy"
    np.save(path, x.numpy())  # the test writes the file the disk tier memory-maps
    return feat.from_mmap(path)


@pytest.mark.parametrize("placement", ["fap", "degree", "random"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gather_equals_indexing_for_every_placement_and_tier_mix(
    config, placement, topo, x, tmp_path
):
    kwargs, source = CONFIGS[config]
    feat = _build(kwargs, source, x, tmp_path, csr_topo=topo, placement=placement)
    ids = _ids_hitting_every_tier(feat)
    out = feat[ids]
    assert out.dtype == x.dtype and out.shape == (ids.numel(), DIM)
    assert torch.equal(out, x[ids])
    stats = feat.stats()
    assert stats["rows"] == _expected_counts(feat, ids)
    assert all(c > 0 for c in stats["rows"].values())  # every tier was hit
    assert stats["total"] == ids.numel()
    assert sum(stats["tier_rows"].values()) == N
    # empty and single-id requests, list input
    assert feat[torch.empty(0, dtype=torch.int64)].shape == (0, DIM)
    assert feat[[]].shape == (0, DIM)
    assert torch.equal(feat[[7]], x[[7]])
    feat.close()


def test_tier_sizes_follow_byte_capacities(topo, x, tmp_path):
    feat = Feature(0, ["cpu"], ROW * 30 + ROW - 1, csr_topo=topo).from_cpu_tensor(x)
    assert feat.stats()["tier_rows"] == {"device": 30, "host": N - 30}
    assert feat.stats()["tier_bytes"]["device"] == 30 * ROW
    clique = Feature(
        0, ["cpu"] * 3, ROW * 10, "p2p_clique_replicate", csr_topo=topo
    ).from_cpu_tensor(x)
    # one clique of three devices caches three times one device's rows, split disjointly
    assert clique.stats()["tier_rows"]["clique"] == 30
    assert [(lo, hi) for _, lo, hi, _ in clique.tiers[0].shards] == [(0, 10), (10, 20), (20, 30)]
    np.save(tmp_path / "f.npy", x.numpy())
    mm = Feature(csr_topo=topo, host_cache_size=f"{ROW * 64 / 1024}K").from_mmap(tmp_path / "f.npy")
    assert mm.stats()["tier_rows"] == {"host": 64, "disk": N - 64}


def test_hottest_rows_are_in_the_fast_tier(topo, x):
    feat = Feature(0, ["cpu"], ROW * 50, csr_topo=topo, placement="fap").from_cpu_tensor(x)
    score = fap(topo, (15, 10, 5), batch_size=64)
    cached = feat.hot_order()[:50]
    # the cached rows are exactly the 50 largest FAP values (ties broken by id)
    assert score[cached].min() >= score[feat.hot_order()[50:]].max()
    deg = Feature(0, ["cpu"], ROW * 50, csr_topo=topo, placement="degree").from_cpu_tensor(x)
    d = topo.degree
    assert d[deg.hot_order()[:50]].min() >= d[deg.hot_order()[50:]].max()


def test_random_placement_is_seeded():
    a = hot_order("random", 100, seed=5)
    assert torch.equal(a, hot_order("random", 100, seed=5))
    assert not torch.equal(a, hot_order("random", 100, seed=6))
    assert torch.equal(torch.sort(a).values, torch.arange(100))


def test_explicit_order_and_no_topology(x):
    order = torch.randperm(N, generator=torch.Generator().manual_seed(9))
    feat = Feature(0, ["cpu"], ROW * 10, order=order).from_cpu_tensor(x)
    assert torch.equal(feat.hot_order(), order)
    feat[order[:10]]
    assert feat.stats()["rows"] == {"device": 10, "host": 0}
    plain = Feature().from_cpu_tensor(x)  # no graph: id order, a single host tier
    assert torch.equal(plain.hot_order(), torch.arange(N))
    assert torch.equal(plain[torch.tensor([3, 3, 1])], x[[3, 3, 1]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int64, torch.uint8])
@pytest.mark.parametrize("dim", [1, 3, 17])
def test_gather_any_dtype_and_row_width(dtype, dim, tmp_path):
    n = 300
    x = (torch.randn(n, dim) * 100).to(dtype)
    ids = torch.randint(0, n, (3000,), generator=torch.Generator().manual_seed(4))
    np.save(tmp_path / "x.npy", x.numpy())
    mm = Feature(host_cache_size=x[0].numel() * x.element_size() * 40, num_threads=3)
    mm.from_mmap(tmp_path / "x.npy")
    assert torch.equal(mm[ids], x[ids])
    mem = Feature(0, ["cpu"], x.element_size() * dim * 25).from_cpu_tensor(x)
    assert torch.equal(mem[ids], x[ids])


def test_concurrent_multithreaded_gathers_are_exact(x, topo):
    feat = Feature(csr_topo=topo, num_threads=4).from_cpu_tensor(x)
    results, errors = {}, []

    def worker(k: int) -> None:
        try:
            ids = torch.randint(0, N, (20000,), generator=torch.Generator().manual_seed(k))
            results[k] = torch.equal(feat[ids], x[ids])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {k: True for k in range(4)}
    assert feat.stats()["total"] == 80000
    feat.reset_stats()
    assert feat.stats()["total"] == 0


def test_features_larger_than_the_ram_cache_come_from_the_file(tmp_path):
    """A file written by the test, read through a 1-row RAM cache: rows come from disk."""
    n, dim = 2000, 8
    path = tmp_path / "big.npy"
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, dim))
    arr[:] = np.arange(n * dim, dtype=np.float32).reshape(n, dim)
    arr.flush()
    del arr
    feat = Feature(host_cache_size=dim * 4).from_mmap(str(path))
    ids = torch.arange(n - 1, -1, -3)
    out = feat[ids]
    assert torch.equal(out[:, 0], (ids * dim).float())
    assert feat.stats()["rows"]["disk"] == ids.numel() - int((ids == 0).sum())
    assert feat.stats()["tier_bytes"]["host"] == dim * 4


# ----------------------------------------------------------------------- capacities


@pytest.mark.parametrize(
    "text,expected",
    [
        (0, 0),
        (123, 123),
        ("123", 123),
        ("2G", 2 << 30),
        ("512M", 512 << 20),
        ("1.5K", 1536),
        ("4KiB", 4096),
        ("3 MB", 3 << 20),
        ("1t", 1 << 40),
        ("7B", 7),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "bad", ["-1G", "abc", "", "1X", "G", -5, True, None, float("nan"), "1..2G"]
)
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        parse_bytes(bad, "device_cache_size")


# --------------------------------------------------------------------------- cliques


def test_detect_cliques():
    assert detect_cliques(4, lambda i, j: True) == [[0, 1, 2, 3]]
    assert detect_cliques(3, lambda i, j: i == j) == [[0], [1], [2]]
    # DGX-1-like: two fully connected quads
    assert detect_cliques(8, lambda i, j: (i < 4) == (j < 4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # one-way access is not peer access
    assert detect_cliques(2, lambda i, j: i <= j) == [[0], [1]]
    # three cliques of different sizes, interleaved ids
    group = {0: "a", 1: "b", 2: "a", 3: "c", 4: "b", 5: "a"}
    assert detect_cliques(6, lambda i, j: group[i] == group[j]) == [[0, 2, 5], [1, 4], [3]]


def test_clique_rank_reads_only_its_clique(x):
    seen = []

    def peer(i, j):
        seen.append((i, j))
        return (i < 2) == (j < 2)

    feat = Feature(
        2, ["cpu"] * 4, ROW * 5, "p2p_clique_replicate", peer_access=peer
    ).from_cpu_tensor(x)
    assert feat.cliques == [[0, 1], [2, 3]] and seen
    ids = torch.arange(12)
    assert torch.equal(feat[ids], x[ids])
    assert feat.stats()["rows"] == {"clique": 10, "host": 2}


# ---------------------------------------------------------------------------- errors


def test_user_errors_raise_value_error(x, topo, tmp_path):
    for kwargs in [
        dict(device_list=["cpu"], device_cache_size="-1G"),
        dict(device_list=["cpu"], device_cache_size="abc"),
        dict(host_cache_size="lots"),
        dict(cache_policy="lru"),
        dict(placement="hottest"),
        dict(device_list=["cpu"], rank=1),
        dict(device_cache_size="1G"),  # no devices to hold it
    ]:
        with pytest.raises(ValueError):
            Feature(**kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            Feature(0, [0], "1M")
    feat = Feature(csr_topo=topo).from_cpu_tensor(x)
    for bad in [torch.tensor([N]), torch.tensor([-1]), torch.tensor([0.5]), [[1, 2]], [True]]:
        with pytest.raises(ValueError):
            feat[bad]
    with pytest.raises(ValueError):
        Feature()[torch.tensor([0])]  # nothing loaded
    with pytest.raises(ValueError):
        Feature(csr_topo=topo).from_cpu_tensor(x[:10])  # rows != nodes
    with pytest.raises(ValueError):
        Feature().from_cpu_tensor(torch.zeros(5))
    with pytest.raises(ValueError):
        Feature(order=torch.zeros(N, dtype=torch.int64)).from_cpu_tensor(x)
    with pytest.raises(ValueError):
        Feature(placement="degree").from_cpu_tensor(x)  # needs a graph
    with pytest.raises(FileNotFoundError):
        Feature().from_mmap(tmp_path / "missing.npy")


def test_gather_into_preallocated_output(x, topo):
    feat = Feature(0, ["cpu"], ROW * 50, csr_topo=topo).from_cpu_tensor(x)
    ids = torch.randint(0, N, (400,), generator=torch.Generator().manual_seed(5))
    out = torch.full((400, DIM), float("nan"))
    assert feat.gather(ids, out=out) is out
    assert torch.equal(out, x[ids])
    for bad in [
        torch.empty(399, DIM),
        torch.empty(400, DIM, dtype=torch.float64),
        torch.empty(DIM, 400).T,
    ]:
        with pytest.raises(ValueError):
            feat.gather(ids, out=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["device_replicate", "p2p_clique_replicate"])
def test_cuda_tiers_gather_exactly(policy, topo, x, tmp_path):
    """GPU tiers on real devices: replicated/clique rows on CUDA, pinned host rest."""
    devices = list(range(torch.cuda.device_count()))
    feat = Feature(0, devices, ROW * 60, policy, csr_topo=topo).from_cpu_tensor(x)
    assert feat.tiers[-1].rows.is_pinned()
    ids = _ids_hitting_every_tier(feat).cuda()
    out = feat[ids]
    assert out.device == torch.device("cuda", 0)
    assert torch.equal(out.cpu(), x[ids.cpu()])
    np.save(tmp_path / "f.npy", x.numpy())
    mm = Feature(0, devices, ROW * 60, policy, csr_topo=topo, host_cache_size=ROW * 100)
    mm.from_mmap(tmp_path / "f.npy")
    assert torch.equal(mm[ids].cpu(), x[ids.cpu()])


def test_torch_paths_of_device_tiers_on_cpu_tensors(x):
    """The torch index_select/index_copy_ code the GPU runs, exercised on CPU tensors."""
    from quiver.feature.tiers import CliqueTier, ReplicatedTier

    block = x[:40].contiguous()
    local = np.array([39, 0, 7, 7, 21], dtype=np.int64)
    sel = np.array([4, 0, 2, 1, 3], dtype=np.int64)
    rep = ReplicatedTier(0, 40, {torch.device("cpu"): block}, gather=None)
    out = torch.zeros(5, DIM)
    rep.read_into(local, out, sel)
    assert torch.equal(out[torch.from_numpy(sel)], block[torch.from_numpy(local)])
    shards = [(torch.device("cpu"), 0, 25, block[:25]), (torch.device("cpu"), 25, 40, block[25:])]
    clique = CliqueTier(0, 40, shards, gather=None)
    out2 = torch.zeros(5, DIM)
    clique.read_into(local, out2, sel)
    assert torch.equal(out2, out)
