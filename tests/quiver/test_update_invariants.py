"""Invariants of heterogeneous graphs and their updates that no end-to-end test could see
(issue 46 items 6-9): the fsync order of an acknowledged update, reversed same-type edges'
features, the typed sampler's frontier, and edge features of an update whose destinations
come unsorted (live, after a restart, after compaction)."""

from __future__ import annotations

import os

import pytest
import torch

from quiver.hetero import HeteroGraph, HeteroSampler
from quiver.hetero.updates import LiveGraph, compact

CITES = ("paper", "cites", "paper")


def _edge_features_by_pair(g: HeteroGraph, et) -> dict[tuple[int, int], list[float]]:
    """``{(src, dst): feature row}`` of one relation, through PyG's view (edge_index and
    edge_attr in the same order)."""
    data = g.to_pyg()
    ei, ea = data[et].edge_index, data[et].edge_attr
    out: dict = {}
    for (s, d), f in zip(ei.t().tolist(), ea.tolist(), strict=True):
        assert (s, d) not in out, f"edge {s}->{d} twice"
        out[(s, d)] = f
    return out


def _cites_graph(tmp_path=None):
    """12 papers, i -> i + 2 (mod 12), one feature per edge that names it (100 s + d)."""
    n = 12
    src = torch.arange(n)
    dst = (src + 2) % n
    ef = (100.0 * src + dst).float().unsqueeze(1)  # [E, 1], distinct per edge
    g = HeteroGraph.from_edges(
        {"paper": n},
        {CITES: torch.stack([src, dst])},
        features={"paper": torch.randn(n, 3, generator=torch.Generator().manual_seed(0))},
        edge_features={CITES: ef},
    )
    if tmp_path is not None:
        g.save(tmp_path / "ds")
        return HeteroGraph.load(tmp_path / "ds"), tmp_path / "ds"
    return g


def test_an_acknowledged_update_is_fsynced_once_before_it_is_published(tmp_path, monkeypatch):
    """Item 6. A kill cannot show this (the page cache survives a SIGKILL): intercept
    ``os.fsync``. Each update fsyncs the log exactly once, with the record already in the
    file and the new version not yet visible; ``update`` returns only after it."""
    g, d = _cites_graph(tmp_path)
    live = LiveGraph(g, durable=True)
    calls = []
    real = os.fsync

    def spy(fd):
        calls.append(
            {"seq_visible": live.seq, "log": (d / live.log.path.name).read_bytes().count(b"\n")}
        )
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    updates = [
        {"op": "add_nodes", "node_type": "paper", "features": [[1.0, 2.0, 3.0]]},
        {
            "op": "add_edges",
            "edge_type": "paper__cites__paper",
            "src": [12],
            "dst": [0],
            "edge_features": [[1200.0]],
        },  # fmt: skip
        {"op": "set_features", "node_type": "paper", "ids": [3], "features": [[0.0, 0.0, 1.0]]},
        {"op": "remove_edges", "edge_type": "paper__cites__paper", "src": [4], "dst": [6]},
    ]
    for i, u in enumerate(updates, start=1):
        before = len(calls)
        out = live.update(u)
        assert out["seq"] == i and live.seq == i
        assert len(calls) == before + 1, "one fsync per acknowledged update"
        # at the fsync: the record written (i lines), the version before it still served
        assert calls[-1] == {"seq_visible": i - 1, "log": i}
    # a rejected update is neither logged nor fsynced
    with pytest.raises(ValueError):
        live.update(
            {"op": "set_features", "node_type": "paper", "ids": [99], "features": [[0.0] * 3]}
        )
    assert len(calls) == len(updates)
    live.log.close()


def test_a_reversed_same_type_edge_carries_its_own_forward_edges_features():
    """Item 7. ``add_reverse`` merges the reverse of a same-type relation into it: edge
    (d, s) must carry exactly the features of (s, d), edge by edge (every value distinct)."""
    g = _cites_graph()
    forward = _edge_features_by_pair(g, CITES)
    both = _edge_features_by_pair(g.add_reverse(), CITES)
    assert len(both) == 2 * len(forward)
    for (s, d), f in forward.items():
        assert both[(s, d)] == f
        assert both[(d, s)] == f, (s, d)


def test_a_type_without_new_nodes_is_not_expanded_again():
    """Item 8. paper <-> author, all neighbours for 3 hops. From paper 0: hop 1 brings its
    authors; hop 2 their papers, which are only paper 0 (no new paper); so hop 3 expands no
    paper. Re-expanding an old frontier would sample its edges twice: every relation's edge
    ids must be distinct, and each edge of the 2-hop neighbourhood appears exactly once."""
    writes, rev = ("author", "writes", "paper"), ("paper", "rev_writes", "author")
    # paper 0 by authors 0, 1; paper 1 by author 2 (outside the neighbourhood of paper 0)
    w = torch.tensor([[0, 1, 2], [0, 0, 1]])
    g = HeteroGraph.from_edges({"paper": 2, "author": 3}, {writes: w, rev: w.flip(0)})
    batch = HeteroSampler(g, [-1, -1, -1], seed=0).sample({"paper": [0]})
    for et, eids in batch.edge_ids.items():
        assert eids.unique().numel() == eids.numel(), (et, eids.tolist())
    assert sorted(batch.edge_ids[writes].tolist()) == [0, 1]  # authors 0, 1 -> paper 0, once
    assert sorted(batch.edge_ids[rev].tolist()) == [0, 1]  # paper 0 -> authors 0, 1, once
    assert batch.num_sampled_nodes["paper"] == [1, 0, 0, 0]
    assert batch.num_sampled_nodes["author"] == [0, 2, 0, 0]


def test_unsorted_destinations_keep_each_edges_features_live_after_restart_and_compaction(
    tmp_path,
):
    """Item 9. One update adds 1 -> 2 with [12] and 2 -> 1 with [21] (destinations unsorted):
    each edge keeps its own row while served, after the log's replay and after compaction."""
    g, d = _cites_graph(tmp_path)
    live = LiveGraph(g, durable=True)
    live.update({"op": "add_edges", "edge_type": "paper__cites__paper", "src": [1, 5, 2],
                 "dst": [2, 0, 1], "edge_features": [[12.0], [50.0], [21.0]]})  # fmt: skip
    want = {(1, 2): [12.0], (5, 0): [50.0], (2, 1): [21.0]}

    def check(graph, when):
        got = _edge_features_by_pair(graph, CITES)
        for pair, f in want.items():
            assert got[pair] == f, (when, pair, got[pair])
        assert got[(0, 2)] == [2.0] and got[(11, 1)] == [1101.0], when  # old edges untouched

    check(live.materialise(), "served")
    live.log.close()
    replayed = LiveGraph(HeteroGraph.load(d), durable=True)
    check(replayed.materialise(), "after a restart")
    replayed.log.close()
    assert compact(d)[0] == 1
    check(HeteroGraph.load(d), "after compaction")
    check(LiveGraph(HeteroGraph.load(d), durable=False).materialise(), "compacted, live")
