"""Heterogeneous graphs (issue 36 item 1): prepare, typed sampling, workload metrics, serving.

The core check: served logits equal an independent PyG forward of the same module on the
*whole* graph (``HeteroData`` built from the prepared files) for 200 random target nodes, for
a ``HeteroConv`` model with embedding tables for featureless types, an RGCN-style model and a
``to_hetero`` model; a deliberately too-shallow sampling (one hop for two layers) is shown to
differ, so the comparison can fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest
import torch

from quiver.hetero import (
    HeteroGraph,
    HeteroSampler,
    HeteroServer,
    hetero_fap,
    hetero_psgs,
    mag_like,
    resolve_fanouts,
)
from quiver.hetero.workload import relation_edges
from quiver.serving.config import ServeConfig
from quiver.usermodel import save_model


@pytest.fixture(scope="module")
def mag(tmp_path_factory):
    d = tmp_path_factory.mktemp("hetero") / "mag"
    g = mag_like(0.002, seed=1)
    g.save(d)
    return g, d


def _kwargs(g: HeteroGraph, hidden=16):
    return dict(
        num_nodes=g.num_nodes,
        in_dims={t: int(x.shape[1]) for t, x in g.features.items()},
        edge_types=[list(e) for e in g.edge_types],
        hidden=hidden,
        out_dim=5,
        num_layers=2,
        target="paper",
    )


def _full_forward(module, g: HeteroGraph):
    """The module on the whole graph, from PyG's HeteroData (ids for featureless types)."""
    data = g.to_pyg()
    x = {
        t: data[t].x if "x" in data[t] else torch.arange(data[t].num_nodes) for t in data.node_types
    }
    with torch.no_grad():
        out = module.eval()(x, data.edge_index_dict)
    return out["paper"] if isinstance(out, dict) else out


# ------------------------------------------------------------------ graph and prepare


def test_save_load_roundtrip_keeps_every_relation_in_input_order(mag):
    g, d = mag
    h = HeteroGraph.load(d)
    assert h.num_nodes == g.num_nodes and h.edge_types == g.edge_types
    for et in g.edge_types:
        a, b = g.to_pyg()[et].edge_index, h.to_pyg()[et].edge_index
        assert torch.equal(a, b)
    assert torch.equal(h.features["paper"], g.features["paper"])
    assert torch.equal(h.labels["paper"], g.labels["paper"])
    assert "author" not in h.features


def test_from_pyg_and_back_is_the_same_graph():
    from torch_geometric.data import HeteroData

    data = HeteroData()
    data["user"].x = torch.randn(5, 3)
    data["item"].num_nodes = 4
    data["user", "rates", "item"].edge_index = torch.tensor([[0, 1, 4, 2], [3, 0, 0, 1]])
    data["item", "rev_rates", "user"].edge_index = torch.tensor([[3, 0, 0, 1], [0, 1, 4, 2]])
    g = HeteroGraph.from_pyg(data)
    back = g.to_pyg()
    for et in data.edge_types:
        assert torch.equal(back[et].edge_index, data[et].edge_index)
    # CSR over destinations: item 0's sources, in input order
    r = g.relations[("user", "rates", "item")]
    assert r.indices[r.indptr[0] : r.indptr[1]].tolist() == [1, 4]


@pytest.mark.parametrize(
    "edges, message",
    [
        ({("user", "rates", "thing"): [[0], [0]]}, "unknown node type 'thing'"),
        ({("user", "rates", "item"): [[7], [0]]}, "user id 7 outside [0, 5)"),
        ({("user", "rates", "item"): [[0, 1, 2]]}, "edge_index must be [2, E]"),
    ],
)
def test_bad_edges_are_one_line_errors(edges, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HeteroGraph.from_edges({"user": 5, "item": 3}, edges)


def test_feature_rows_must_match_the_node_count():
    with pytest.raises(ValueError, match="features of 'user' have shape"):
        HeteroGraph.from_edges({"user": 5}, {}, features={"user": torch.zeros(4, 2)})


# ------------------------------------------------------------------ sampling


def _reference_sample(g: HeteroGraph, seeds: dict, hops: int):
    """All-neighbour typed sampling in plain Python, as PyG's NeighborLoader defines it."""
    local = {t: {} for t in g.num_nodes}
    order = {t: [] for t in g.num_nodes}
    for t, ids in seeds.items():
        for v in ids:
            local[t][v] = len(order[t])
            order[t].append(v)
    frontier = {t: list(ids) for t, ids in seeds.items()}
    edges = {et: [] for et in g.edge_types}
    for _ in range(hops):
        fresh = {t: [] for t in g.num_nodes}
        for et, r in g.relations.items():
            src, _, dst = et
            for v in frontier.get(dst, []):
                for u in r.indices[r.indptr[v] : r.indptr[v + 1]].tolist():
                    if u not in local[src]:
                        local[src][u] = len(order[src])
                        order[src].append(u)
                        fresh[src].append(u)
                    edges[et].append((local[src][u], local[dst][v]))
        frontier = fresh
    return order, edges


def test_all_neighbour_sampling_equals_the_reference(mag):
    g, _ = mag
    s = HeteroSampler(g, [-1, -1], seed=3)
    seeds = {"paper": [5, 17, 400], "author": [9]}
    b = s.sample({t: torch.tensor(v) for t, v in seeds.items()})
    order, edges = _reference_sample(g, seeds, 2)
    for t in g.num_nodes:
        assert b.node_ids[t].tolist() == order[t], t
    for et in g.edge_types:
        got = list(map(tuple, b.edge_index[et].t().tolist()))
        assert Counter(got) == Counter(edges[et]), et
    assert b.batch_size == {"paper": 3, "author": 1, "institution": 0, "field_of_study": 0}


def test_fanouts_cap_each_rows_sample_and_the_seed_reproduces_it(mag):
    g, _ = mag
    fan = {("paper", "cites", "paper"): [3, 2], ("author", "writes", "paper"): [2, 0]}
    s1, s2 = HeteroSampler(g, fan, seed=7), HeteroSampler(g, fan, seed=7)
    seeds = {"paper": torch.arange(50)}
    b1, b2 = s1.sample(seeds), s2.sample(seeds)
    for et in g.edge_types:
        assert torch.equal(b1.edge_index[et], b2.edge_index[et])
    # relations left out of the dict sample nothing; each destination gets <= k distinct
    assert b1.edge_index[("paper", "rev_writes", "author")].shape[1] == 0
    cites = b1.edge_index[("paper", "cites", "paper")]
    r = g.relations[("paper", "cites", "paper")]
    ids = b1.node_ids["paper"]
    first = cites[:, : int((cites[1] < 50).sum())]
    for v in range(50):
        nbrs = ids[first[0][first[1] == v]].tolist()
        row = r.indices[r.indptr[v] : r.indptr[v + 1]].tolist()
        # min(deg, k) distinct row positions (a multigraph row may repeat an id), in CSR order
        assert len(nbrs) == min(3, len(row))
        it = iter(row)
        assert all(u in it for u in nbrs), (nbrs, row)  # a subsequence of the row
    # a different seed draws differently somewhere
    b3 = HeteroSampler(g, fan, seed=8).sample(seeds)
    assert not torch.equal(b3.edge_index[("paper", "cites", "paper")], cites)


def test_sampler_refuses_bad_seeds_and_stays_usable(mag):
    g, _ = mag
    s = HeteroSampler(g, [2], seed=0)
    with pytest.raises(ValueError, match="repeated paper ids"):
        s.sample({"paper": torch.tensor([1, 1])})
    with pytest.raises(ValueError, match="unknown node type 'venue'"):
        s.sample({"venue": torch.tensor([1])})
    with pytest.raises(ValueError, match=r"author ids must lie in \[0, "):
        s.sample({"author": torch.tensor([10**7])})
    b = s.sample({"paper": torch.tensor([1])})  # markers were reset after each failure
    assert b.node_ids["paper"][0] == 1


def test_fanout_dicts_are_checked(mag):
    g, _ = mag
    with pytest.raises(ValueError, match="unknown edge type paper__likes__paper"):
        resolve_fanouts(g, {"paper__likes__paper": [1]})
    with pytest.raises(ValueError, match="same hop count"):
        resolve_fanouts(g, {"paper__cites__paper": [1], "author__writes__paper": [1, 2]})


# ------------------------------------------------------------------ workload metrics


def test_fap_and_relation_edges_match_sampling_frequencies(mag):
    """FAP per type against the empirical read frequency over 3,000 sampled batches (fixed
    seed), and expected edges per relation against the mean sampled edges."""
    g, _ = mag
    fan = resolve_fanouts(g, [2, 1])
    fap = hetero_fap(g, fan, "paper", batch_size=1)
    s = HeteroSampler(g, fan, seed=11)
    rng = np.random.default_rng(0)
    hits = {t: np.zeros(n) for t, n in g.num_nodes.items()}
    edges = Counter()
    trials = 3000
    for _ in range(trials):
        b = s.sample({"paper": torch.tensor([int(rng.integers(g.num_nodes["paper"]))])})
        for t, ids in b.node_ids.items():
            hits[t][ids.numpy()] += 1
        for et, ei in b.edge_index.items():
            edges["__".join(et)] += ei.shape[1]
    for t in ("paper", "author", "field_of_study"):
        emp, model = hits[t] / trials, fap[t].numpy()
        # totals: expected rows read per batch of the type, within 10%
        assert abs(emp.sum() - model.sum()) <= 0.1 * model.sum() + 0.05, t
    expect = relation_edges(g, fan, "paper")
    for name, e in expect.items():
        assert abs(edges[name] / trials - e) <= 0.1 * e + 0.1, name
    psgs = hetero_psgs(g, fan)["paper"]
    assert psgs.min() >= 1.0 and float(psgs.mean()) > 1.0


# ------------------------------------------------------------------ serving, exactly


@pytest.mark.parametrize("factory", ["hetero_sage", "rgcn"])
def test_served_logits_equal_a_full_graph_pyg_forward(mag, tmp_path, factory):
    g, d = mag
    from quiver.hetero import examples

    torch.manual_seed(0)
    kw = _kwargs(g)
    module = getattr(examples, factory)(**kw)
    ckpt = tmp_path / "m.pt"
    save_model(ckpt, module, f"quiver.hetero.examples:{factory}", kw, fanouts=[-1, -1])
    full = _full_forward(module, g)
    ids = torch.randperm(g.num_nodes["paper"], generator=torch.Generator().manual_seed(1))[:200]
    with HeteroServer.from_dataset(d, ckpt, ServeConfig(), trust_pickle=True, seed=0) as srv:
        res = srv.predict("paper", ids.tolist(), output="logits")
        cls = srv.predict("paper", ids.tolist())
    got = torch.from_numpy(res.values)
    assert torch.allclose(got, full[ids], atol=1e-5, rtol=1e-5)
    assert cls.values.tolist() == full[ids].argmax(1).tolist()
    # one hop for a two-layer model would miss messages: refused at start-up
    with pytest.raises(ValueError, match="1 fanouts per relation but the model has 2"):
        HeteroServer.from_dataset(d, ckpt, ServeConfig(), fanouts=[-1], trust_pickle=True)


TO_HETERO = textwrap.dedent(
    """
    import torch
    from torch_geometric.nn import SAGEConv, to_hetero


    class GNN(torch.nn.Module):
        def __init__(self, hidden, out):
            super().__init__()
            self.conv1 = SAGEConv((-1, -1), hidden)
            self.conv2 = SAGEConv((-1, -1), out)

        def forward(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


    def build(node_types, edge_types, hidden=8, out=3):
        meta = (list(node_types), [tuple(e) for e in edge_types])
        return to_hetero(GNN(hidden, out), meta, aggr="mean")
    """
)


def test_a_to_hetero_model_with_lazy_layers_is_served_exactly(tmp_path):
    """PyG's ``to_hetero`` over lazy ``SAGEConv((-1, -1))``: every type with features."""
    (tmp_path / "user_hetero.py").write_text(TO_HETERO)
    sys.path.insert(0, str(tmp_path))
    try:
        from user_hetero import build

        gen = torch.Generator().manual_seed(0)
        n = {"user": 60, "item": 40}
        e = {
            ("user", "buys", "item"): torch.stack(
                [
                    torch.randint(0, 60, (300,), generator=gen),
                    torch.randint(0, 40, (300,), generator=gen),
                ]
            ),
        }
        e[("item", "rev_buys", "user")] = e[("user", "buys", "item")].flip(0)
        g = HeteroGraph.from_edges(
            n,
            e,
            features={
                "user": torch.randn(60, 4, generator=gen),
                "item": torch.randn(40, 6, generator=gen),
            },
            manifest={"target": "user"},
        )
        d = g.save(tmp_path / "ds")
        kw = {"node_types": list(n), "edge_types": [list(x) for x in e]}
        module = build(**kw)
        data = g.to_pyg()
        with torch.no_grad():
            full = module(data.x_dict, data.edge_index_dict)["user"]  # materialises, then runs
        save_model(tmp_path / "m.pt", module, "user_hetero:build", kw, fanouts=[-1, -1])
        with HeteroServer.from_dataset(d, tmp_path / "m.pt", model="user_hetero:build") as srv:
            got = torch.from_numpy(srv.predict("user", list(range(60)), output="logits").values)
        assert torch.allclose(got, full, atol=1e-5, rtol=1e-5)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_hetero", None)


# ------------------------------------------------------------------ HTTP


def test_http_requests_name_a_node_type_and_bad_ones_are_4xx(mag, tmp_path):
    import httpx

    g, d = mag
    from quiver.hetero import examples

    kw = _kwargs(g, hidden=8)
    torch.manual_seed(0)
    module = examples.hetero_sage(**kw)
    save_model(tmp_path / "m.pt", module, "quiver.hetero.examples:hetero_sage", kw)
    srv = HeteroServer.from_dataset(
        d, tmp_path / "m.pt", ServeConfig(max_body_bytes=4096), fanouts="4,2",
        model="quiver.hetero.examples:hetero_sage", seed=0,
    )  # fmt: skip
    with srv:
        srv.start(port=0)
        url = srv.url
        with httpx.Client(timeout=10) as c:
            r = c.post(f"{url}/v1/predict", json={"node_type": "paper", "nodes": [1, 2, 3]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["node_type"] == "paper" and len(body["values"]) == 3
            assert all(0 <= v < 5 for v in body["values"])
            # node_type may be left out when one type is served
            assert c.post(f"{url}/v1/predict", json={"nodes": [4]}).status_code == 200
            cases = [
                ({"node_type": "venue", "nodes": [1]}, 422, "unknown node type 'venue'"),
                ({"node_type": "author", "nodes": [1]}, 422, "'author' is not served"),
                ({"node_type": "paper", "nodes": [10**9]}, 422, "ids"),
                ({"node_type": "paper", "nodez": [1]}, 422, "unknown field 'nodez'"),
                ({"node_type": "paper"}, 422, "missing field 'nodes'"),
            ]
            for req, status, text in cases:
                r = c.post(f"{url}/v1/predict", json=req)
                assert r.status_code == status and text in r.json()["error"], (req, r.text)
            r = c.post(
                f"{url}/v1/predict", content=b"{nope", headers={"content-type": "application/json"}
            )
            assert r.status_code == 400
            r = c.post(
                f"{url}/v1/predict",
                content=b"x" * 5000,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 413
            health = c.get(f"{url}/healthz").json()
            assert health["node_types"] == g.num_nodes and list(health["served"]) == ["paper"]
            metrics = c.get(f"{url}/metrics").text
            assert 'node_type="paper"' in metrics
            assert metrics.count("# TYPE quiver_request_latency_seconds histogram\n") == 1


def test_cli_prepare_from_typed_edge_lists_and_heterodata(tmp_path):
    """``quiver prepare --hetero DIR`` reads one edge file per relation; a saved HeteroData
    file loads too; both give the same graph."""
    from torch_geometric.data import HeteroData

    edir = tmp_path / "edges"
    edir.mkdir()
    (edir / "user__rates__item.csv").write_text("0,1\n2,1\n3,0\n")
    np.save(edir / "item__rev_rates__user.npy", np.array([[1, 1, 0], [0, 2, 3]]))
    np.save(edir / "user.features.npy", np.arange(8, dtype=np.float32).reshape(4, 2))
    (edir / "nodes.json").write_text(json.dumps({"user": 4, "item": 3}))
    out = tmp_path / "prep"
    cmd = [sys.executable, "-m", "quiver.cli", "prepare", "--hetero", str(edir), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    g = HeteroGraph.load(out)
    assert g.num_nodes == {"user": 4, "item": 3}
    assert g.to_pyg()[("user", "rates", "item")].edge_index.tolist() == [[0, 2, 3], [1, 1, 0]]
    assert g.features["user"].shape == (4, 2) and "item" not in g.features

    data = HeteroData()
    data["user"].x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    data["item"].num_nodes = 3
    data["user", "rates", "item"].edge_index = torch.tensor([[0, 2, 3], [1, 1, 0]])
    torch.save(data, tmp_path / "data.pt")
    out2 = tmp_path / "prep2"
    cmd = [sys.executable, "-m", "quiver.cli", "prepare", "--hetero", str(tmp_path / "data.pt"),
           "--out", str(out2), "--trust-pickle"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    g2 = HeteroGraph.load(out2)
    assert torch.equal(
        g2.to_pyg()[("user", "rates", "item")].edge_index,
        g.to_pyg()[("user", "rates", "item")].edge_index,
    )
    # a bad file is one line, no traceback
    (edir / "user__rates__item.csv").write_text("0,1\n9,1\n")
    r = subprocess.run(
        cmd[:5] + [str(edir), "--out", str(tmp_path / "p3")], capture_output=True, text=True
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "user id 9 outside [0, 4)" in r.stderr


def test_quiver_serve_cli_on_a_hetero_directory(mag, tmp_path):
    """``quiver serve DIR`` notices a hetero dataset, answers node-typed requests, stops on
    SIGTERM; an option it cannot honour there is one line."""
    import signal
    import socket
    import time

    import httpx

    g, d = mag
    kw = _kwargs(g, hidden=8)
    torch.manual_seed(0)
    from quiver.hetero import examples

    save_model(
        tmp_path / "m.pt",
        examples.hetero_sage(**kw),
        "quiver.hetero.examples:hetero_sage",
        kw,
        fanouts=[3, 2],
    )
    base = [
        sys.executable,
        "-m",
        "quiver.cli",
        "serve",
        str(d),
        "--checkpoint",
        str(tmp_path / "m.pt"),
    ]
    r = subprocess.run(base + ["--precision", "bf16"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--precision: not available for a heterogeneous dataset" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = base + ["--model", "quiver.hetero.examples:hetero_sage", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/predict",
                    json={"node_type": "paper", "nodes": [0, 1], "output": "logits"},
                    timeout=5,
                )
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.3)
        assert r.status_code == 200, r.text
        assert len(r.json()["values"]) == 2 and len(r.json()["values"][0]) == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "targets paper" in out and "quiver serve: stopped" in out
