"""Feature rows partitioned across hosts (issue 21): ownership, FAP replicas within a budget,
the request router, the on-disk format and ``quiver partition``."""

import json

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.cli import main
from quiver.feature.partition import (
    Router,
    assign_owners,
    load_partition,
    make_partition,
    parse_budget,
    remote_share,
    route,
    save_partition,
)
from quiver.pyg import GraphSageSampler


def skewed_topo(n=2000, e=16000, seed=0):
    rng = np.random.default_rng(seed)
    src = (n * rng.random(e) ** 2).astype(np.int64)
    dst = rng.integers(0, n, e)
    return CSRTopo.from_edge_index(torch.from_numpy(np.stack([src, dst])), num_nodes=n)


def test_owners_cover_every_row_in_balanced_blocks():
    topo = skewed_topo()
    for method in ("bfs", "hash"):
        owner = assign_owners(topo, 3, method)
        assert owner.shape == (2000,) and owner.dtype == np.int32
        counts = np.bincount(owner, minlength=3)
        assert counts.sum() == 2000 and counts.max() - counts.min() <= 1
    assert (assign_owners(topo, 1) == 0).all()


@pytest.mark.parametrize("policy", ["fap", "degree", "random"])
@pytest.mark.parametrize("budget,rows", [(0, 0), (37, 37), ("0.05", 100), ("2%", 40)])
def test_replicas_are_remote_distinct_and_within_budget(policy, budget, rows):
    topo = skewed_topo()
    part = make_partition(topo, 4, budget=budget, policy=policy, sizes=[5, 3])
    assert part.info["budget_rows"] == rows
    for h, reps in enumerate(part.replicas):
        assert reps.size <= rows
        assert np.array_equal(reps, np.unique(reps))
        assert (part.owner[reps] != h).all()
        if policy != "fap":  # FAP skips rows its host never reads
            assert reps.size == rows
    assert part.info["replica_rows"] == [r.size for r in part.replicas]


def test_budget_larger_than_the_remote_rows_replicates_them_all():
    topo = skewed_topo(n=100, e=600)
    part = make_partition(topo, 2, budget=10_000, policy="degree", sizes=[3])
    for h, reps in enumerate(part.replicas):
        assert np.array_equal(reps, np.flatnonzero(part.owner != h))


def test_router_sends_a_request_to_the_host_it_touches_most():
    # row 0 samples from 1, 2, 3 (its in-neighbours in the sampling direction); 4 is alone
    topo = CSRTopo(torch.tensor([[0, 0, 0, 4], [1, 2, 3, 4]]))
    assert topo.indices[topo.indptr[0] : topo.indptr[1]].tolist() == [1, 2, 3]
    owner = np.array([0, 1, 1, 1, 0], dtype=np.int32)
    nbr_host = 1
    assert route([4], owner) == 0 and route([0], owner) == 0
    assert route([0], owner, topo) == nbr_host  # seed on 0 but its neighbours on 1
    assert route([], owner) == 0
    holds = np.zeros((2, 5), dtype=bool)
    holds[1, [0, 1, 2, 3]] = True  # host 1 replicated row 0
    holds[0, [0, 4]] = True
    assert route([0, 4, 4], holds) == 0 and route([0, 1, 2], holds) == 1
    with pytest.raises(ValueError, match="seed ids"):
        route([5], owner)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda t: make_partition(t, 0), "hosts must be >= 1"),
        (lambda t: make_partition(t, 5000), "exceeds the node count"),
        (lambda t: make_partition(t, 2, budget=-1), "must be >= 0 rows"),
        (lambda t: make_partition(t, 2, budget="1.5"), r"fraction must lie in \[0, 1\]"),
        (lambda t: make_partition(t, 2, budget="lots"), "row count"),
        (lambda t: make_partition(t, 2, policy="pagerank"), "unknown replica policy"),
        (lambda t: make_partition(t, 2, method="metis"), "unknown partition method"),
        (lambda t: make_partition(t, 2, sizes=[]), "at least one hop"),
        (lambda t: make_partition(t, 2, batch_size=0), "batch_size"),
    ],
)
def test_bad_arguments_are_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as e:
        call(skewed_topo())
    assert "\n" not in str(e.value)


def test_parse_budget_forms():
    assert parse_budget(0, 10) == 0 and parse_budget("7", 10) == 7 and parse_budget(0.5, 10) == 5
    assert parse_budget("1.0", 10) == 10 and parse_budget("30%", 10) == 3


def _stream(topo, n, q, requests, size, seed):
    rng = np.random.default_rng(seed)
    return [np.unique(rng.choice(n, size=size, p=q)) for _ in range(requests)]


def test_fap_replicas_read_fewer_remote_rows_than_random_on_a_skewed_workload():
    topo = skewed_topo(n=3000, e=24000, seed=1)
    n, sizes = 3000, [5, 3]
    rng = np.random.default_rng(2)
    w = 1.0 / np.arange(1, n + 1) ** 1.1
    q = rng.permutation(w / w.sum())
    log = rng.choice(n, size=50_000, p=q)  # FAP learns from a past log of the same stream
    seeds = _stream(topo, n, q, 300, 8, seed=3)  # the stream it is then judged on
    sampler = GraphSageSampler(topo, sizes, mode="CPU", seed=4)
    n_ids = [sampler.sample(torch.from_numpy(s))[0] for s in seeds]
    share = {}
    for policy in ("fap", "degree", "random"):
        part = make_partition(
            topo, 4, budget="0.1", policy=policy, sizes=sizes, seed_prob=log, batch_size=8
        )
        router = Router(part, topo)
        by_host = [[] for _ in range(4)]
        for s, ids in zip(seeds, n_ids, strict=True):
            by_host[router(s)].append(ids)
        share[policy] = remote_share(part, by_host)
    nothing = make_partition(topo, 4, budget=0, sizes=sizes)
    base = remote_share(nothing, [[ids for ids in n_ids]] + [[]] * 3)  # all on host 0
    assert 0 < share["fap"] < base
    assert share["fap"] < 0.85 * share["random"], share
    assert share["fap"] <= share["degree"] + 0.02, share


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep") / "tiny"
    assert main(["prepare", "--dataset", "tiny", "--out", str(d), "--no-progress"]) == 0
    return d


def test_old_directories_have_no_partition_and_partition_round_trips(prepared, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    assert load_partition(d) is None
    from quiver.datasets import load_prepared

    topo = load_prepared(d).topo
    part = make_partition(topo, 3, budget=5, policy="random", sizes=[3, 2])
    save_partition(d, part)
    back = load_partition(d)
    assert np.array_equal(back.owner, part.owner)
    assert all(np.array_equal(a, b) for a, b in zip(back.replicas, part.replicas, strict=True))
    assert back.info["hosts"] == 3 and back.info["budget_rows"] == 5
    assert load_prepared(d).num_nodes == topo.node_count  # the dataset still loads


def test_cli_writes_the_partition_and_reports_bad_arguments_in_one_line(prepared, tmp_path, capsys):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(prepared, d)
    rc = main(["partition", str(d), "--hosts", "2", "--replicate-budget", "5%", "--sizes", "4,2"])
    assert rc == 0
    m = json.loads((d / "manifest.json").read_text())["partition"]
    assert m["hosts"] == 2 and m["policy"] == "fap" and m["budget_rows"] == 10
    assert (d / m["files"]["owner"]).exists()
    capsys.readouterr()
    for argv, msg in [
        (["--hosts", "0"], "hosts must be >= 1"),
        (["--hosts", "2", "--replicate-budget", "x"], "row count"),
        (["--hosts", "2", "--sizes", "a,b"], "--sizes"),
        (["--hosts", "2", "--request-log", str(tmp_path / "no.npy")], "missing --request-log"),
    ]:
        assert main(["partition", str(d), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("quiver partition: error:") and msg in err and "\n" not in err
    assert main(["partition", str(tmp_path / "none"), "--hosts", "2"]) == 2
    assert "not a prepared dataset" in capsys.readouterr().err
