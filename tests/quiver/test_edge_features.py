"""Edge features served (issue 36 item 2): ``quiver prepare --edge-features`` stores them in the
edge list's order beside the CSR; the server gathers the sampled edges' rows and passes them as
``edge_attr`` to edge-aware PyG layers. With all-neighbour fanouts every node's served logits
equal the module's forward on the full graph with ``data.edge_attr``."""

import gzip
import sys
import textwrap

import numpy as np
import pytest
import torch

from quiver.cli import main as cli_main
from quiver.datasets import load_ogb, load_prepared, save_prepared
from quiver.datasets.loaders import from_pyg
from quiver.serving import ServeConfig
from quiver.serving.server import Server
from quiver.usermodel import import_factory, save_model

N, DIM, EDIM, CLASSES, E = 60, 6, 3, 4, 260

FACTORIES = '''
from torch import nn
from torch_geometric.nn import GATConv, GINEConv, NNConv, TransformerConv

DIM, EDIM, CLASSES, HID = 6, 3, 4, 8


class GINE(nn.Module):
    def __init__(self):
        super().__init__()
        mlp = nn.Sequential(nn.Linear(DIM, HID), nn.ReLU(), nn.Linear(HID, HID))
        self.c1 = GINEConv(mlp, edge_dim=EDIM)
        self.c2 = GINEConv(nn.Linear(HID, CLASSES), edge_dim=EDIM)

    def forward(self, x, edge_index, edge_attr):
        return self.c2(self.c1(x, edge_index, edge_attr).relu(), edge_index, edge_attr)


class GAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = GATConv(DIM, HID, heads=2, edge_dim=EDIM)
        self.c2 = GATConv(2 * HID, CLASSES, edge_dim=EDIM)

    def forward(self, x, edge_index, edge_attr):
        return self.c2(self.c1(x, edge_index, edge_attr).relu(), edge_index, edge_attr)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = TransformerConv(DIM, HID, heads=2, edge_dim=EDIM)
        self.c2 = TransformerConv(2 * HID, CLASSES, edge_dim=EDIM)

    def forward(self, x, edge_index, edge_attr):
        return self.c2(self.c1(x, edge_index, edge_attr).relu(), edge_index, edge_attr)


class NN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = NNConv(DIM, HID, nn.Linear(EDIM, DIM * HID), aggr="mean")
        self.c2 = NNConv(HID, CLASSES, nn.Linear(EDIM, HID * CLASSES), aggr="add")

    def forward(self, x, edge_index, edge_attr):
        return self.c2(self.c1(x, edge_index, edge_attr).relu(), edge_index, edge_attr)


class GINEAdjs(nn.Module):
    """The legacy ``forward(x, adjs, edge_attr)``: one edge_attr tensor per hop."""

    def __init__(self):
        super().__init__()
        mlp = nn.Sequential(nn.Linear(DIM, HID), nn.ReLU(), nn.Linear(HID, HID))
        self.convs = nn.ModuleList(
            [GINEConv(mlp, edge_dim=EDIM), GINEConv(nn.Linear(HID, CLASSES), edge_dim=EDIM)]
        )

    def forward(self, x, adjs, edge_attr):
        for i, ((edge_index, _, size), ea) in enumerate(zip(adjs, edge_attr)):
            x = self.convs[i]((x, x[: size[1]]), edge_index, ea)
            if i < len(self.convs) - 1:
                x = x.relu()
        return x
'''

MODELS = ["GINE", "GAT", "Transformer", "NN"]
SPEC = "quiver_edge_factories:{}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An edge list with repeated edges and self-loops, node and edge features, and one
    checkpoint per model (saved with its factory)."""
    d = tmp_path_factory.mktemp("edgefeat")
    (d / "quiver_edge_factories.py").write_text(textwrap.dedent(FACTORIES))
    sys.path.insert(0, str(d))
    rng = np.random.default_rng(0)
    edges = rng.integers(0, N, (E, 2))
    edges[:5] = edges[5:10]  # repeated edges, each with its own features
    edges[10:13, 1] = edges[10:13, 0]  # self-loops
    np.save(d / "edges.npy", edges)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    ea = rng.standard_normal((E, EDIM)).astype(np.float32)
    np.save(d / "x.npy", x)
    np.save(d / "ea.npy", ea)
    np.save(d / "ea_shuffled.npy", ea[rng.permutation(E)])
    np.save(d / "ea_short.npy", ea[:-1])
    ckpts, modules = {}, {}
    for name in MODELS + ["GINEAdjs"]:
        torch.manual_seed(1)
        m = import_factory(SPEC.format(name))().eval()
        ckpts[name] = d / f"{name}.pt"
        save_model(ckpts[name], m, SPEC.format(name), fanouts=[-1, -1])
        modules[name] = m
    yield {
        "dir": d,
        "edges": edges,
        "x": torch.from_numpy(x),
        "ea": torch.from_numpy(ea),
        "ckpts": ckpts,
        "modules": modules,
    }
    sys.path.remove(str(d))


def _prepare(world, out, edge_features="ea.npy", undirected=False) -> int:
    d = world["dir"]
    argv = ["prepare", "--edges", str(d / "edges.npy"), "--features", str(d / "x.npy")]
    if edge_features:
        argv += ["--edge-features", str(d / edge_features)]
    if undirected:
        argv.append("--undirected")
    return cli_main(argv + ["--out", str(d / out), "--no-progress"])


@pytest.fixture(scope="module")
def prepared(world):
    """Prepared directories: directed, undirected, shuffled edge features, none."""
    assert _prepare(world, "directed") == 0
    assert _prepare(world, "undirected", undirected=True) == 0
    assert _prepare(world, "shuffled", "ea_shuffled.npy") == 0
    assert _prepare(world, "plain", None) == 0
    return {k: world["dir"] / k for k in ("directed", "undirected", "shuffled", "plain")}


def _full_graph(world, undirected):
    ei = torch.from_numpy(world["edges"].T.copy())
    ea = world["ea"]
    if undirected:  # the reverse edge carries its forward edge's features
        ei, ea = torch.cat([ei, ei.flip(0)], 1), torch.cat([ea, ea])
    return ei, ea


def _reference(world, name, undirected=False):
    module = world["modules"][name]
    ei, ea = _full_graph(world, undirected)
    with torch.inference_mode():
        if name == "GINEAdjs":
            adjs = [(ei, None, (N, N))] * 2
            return module(world["x"], adjs, [ea, ea]).numpy()
        return module(world["x"], ei, ea).numpy()


def _served(world, data, name, **kw):
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N, max_wait_ms=0.5)
    with Server.from_dataset(
        data, world["ckpts"][name], cfg, seed=0, model=SPEC.format(name), **kw
    ) as server:
        logits = server.predict(list(range(N)), output="logits").values
        single = np.stack([server.predict([v], output="logits").values[0] for v in (0, 7, N - 1)])
    return logits, single, server.info


def test_prepare_stores_edge_features_in_input_order(world, prepared):
    ds = load_prepared(prepared["directed"])
    assert ds.manifest["edge_features"] == {"file": "edge_features.npy", "rows": E, "dim": EDIM}
    torch.testing.assert_close(ds.edge_features, world["ea"], rtol=0, atol=0)
    # slot j of the CSR holds edge eid[j] of the input: its target is the row, its source the
    # neighbour, and its features are row eid[j]
    eid = ds.topo.eid.numpy()
    dst = np.repeat(np.arange(N), np.diff(ds.topo.indptr.numpy()))
    np.testing.assert_array_equal(world["edges"][eid, 0], ds.topo.indices.numpy())
    np.testing.assert_array_equal(world["edges"][eid, 1], dst)
    und = load_prepared(prepared["undirected"])
    assert und.topo.edge_count == 2 * E and und.edge_features.shape == (E, EDIM)
    # every input row is read twice: by its edge and by the reverse edge
    assert np.bincount(und.topo.eid.numpy(), minlength=E).tolist() == [2] * E


@pytest.mark.parametrize("kind", ["directed", "undirected"])
def test_sampled_edge_ids_name_the_input_rows(world, prepared, kind):
    """The CPU sampler's ``e_id`` of a sampled edge ``u -> v`` is the input row holding
    ``(u, v)`` (or ``(v, u)`` for a reverse edge added by ``--undirected``)."""
    from quiver.pyg import GraphSageSampler

    ds = load_prepared(prepared[kind])
    sampler = GraphSageSampler(ds.topo, [3, 2], mode="CPU", seed=0, frontier=True)
    n_id, _, adjs = sampler.sample(torch.tensor([0, 7, 19, N - 1]))
    for edge_index, e_id, _ in adjs:
        pairs = np.stack([n_id[edge_index[0]].numpy(), n_id[edge_index[1]].numpy()], 1)
        rows = world["edges"][e_id.numpy()]
        same = (rows == pairs).all(1)
        if kind == "undirected":
            same |= (rows[:, ::-1] == pairs).all(1)
        assert e_id.numel() and same.all()


@pytest.mark.parametrize("name", MODELS + ["GINEAdjs"])
def test_served_logits_equal_pyg_on_the_full_graph(world, prepared, name):
    want = _reference(world, name)
    got, single, info = _served(world, prepared["directed"], name)
    assert f"edge_attr ({EDIM} per edge)" in info
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(single, want[[0, 7, N - 1]], rtol=0, atol=1e-5)
    assert (got.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("name", ["GINE", "GAT"])
def test_undirected_reverse_edges_carry_their_edge_features(world, prepared, name):
    want = _reference(world, name, undirected=True)
    got, _, _ = _served(world, prepared["undirected"], name)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert (got.argmax(1) == want.argmax(1)).all()


def test_subgraph_convention_gets_edge_attr_in_edge_index_order(world, prepared):
    want = _reference(world, "GAT")
    got, _, info = _served(world, prepared["directed"], "GAT", convention="subgraph")
    assert "input subgraph" in info
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_shuffled_edge_features_on_disk_fail_the_comparison(world, prepared):
    """Negative control: the same graph with its edge feature rows permuted serves other
    logits, so the comparisons above can fail."""
    want = _reference(world, "GINE")
    got, _, _ = _served(world, prepared["shuffled"], "GINE")
    assert float(np.abs(got - want).max()) > 1e-2


def test_edge_feature_rows_must_match_the_edge_count(world, capsys):
    assert _prepare(world, "short", "ea_short.npy") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"has {E - 1} rows" in err and f"has {E} edges" in err
    d = world["dir"]
    argv = ["prepare", "--dataset", "tiny", "--edge-features", str(d / "ea.npy")]
    assert cli_main(argv + ["--out", str(d / "t"), "--no-progress"]) == 2
    assert "--edge-features applies to --edges" in capsys.readouterr().err


def test_model_needing_edge_attr_on_a_dataset_without_them_is_refused(world, prepared):
    with pytest.raises(ValueError, match=r"needs edge_attr, but .*plain/edge_features.npy does"):
        Server.from_dataset(
            prepared["plain"], world["ckpts"]["GINE"], model=SPEC.format("GINE"), fanouts=[-1, -1]
        )


def test_folding_refuses_a_model_with_edge_attributes(world, prepared):
    with pytest.raises(ValueError, match="cannot fold: it takes edge attributes"):
        Server.from_dataset(
            prepared["directed"],
            world["ckpts"]["GAT"],
            model=SPEC.format("GAT"),
            fanouts=[-1, -1],
            fold="on",
        )


def test_from_pyg_and_ogb_bring_their_edge_features(tmp_path):
    from torch_geometric.data import Data

    ei = torch.tensor([[0, 1, 2, 3, 1], [1, 2, 0, 1, 3]])
    ea = torch.arange(10, dtype=torch.float32).view(5, 2)
    ds = from_pyg(Data(x=torch.ones(4, 2), edge_index=ei, edge_attr=ea))
    save_prepared(tmp_path / "p", ds.topo, ds.features, ds.labels, ds.splits, {}, edge_features=ea)
    back = load_prepared(tmp_path / "p")
    # the CSR slot's source and target are those of the input edge whose features it reads
    eid = back.topo.eid
    assert torch.equal(back.topo.indices, ei[0, eid])
    assert torch.equal(back.edge_features, ea)
    with pytest.raises(ValueError, match="data.edge_attr has 4 rows but data.edge_index has 5"):
        from_pyg(Data(x=torch.ones(4, 2), edge_index=ei, edge_attr=ea[:4]))

    root = tmp_path / "ogb"

    def write(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            f.writelines(",".join(str(v) for v in r) + "\n" for r in rows)

    write(root / "raw" / "edge.csv.gz", ei.T.tolist())
    write(root / "raw" / "edge-feat.csv.gz", ea.tolist())
    write(root / "raw" / "node-feat.csv.gz", [[1.0]] * 4)
    write(root / "raw" / "node-label.csv.gz", [[0]] * 4)
    for name in ("train", "valid", "test"):
        write(root / "split" / "random" / f"{name}.csv.gz", [[0]])
    o = load_ogb(root, undirected=True)
    assert o.topo.edge_count == 10 and torch.equal(o.edge_features, ea)
    assert torch.equal(o.topo.eid.sort().values, torch.arange(5).repeat_interleave(2))
    write(root / "raw" / "edge-feat.csv.gz", ea[:3].tolist())
    with pytest.raises(ValueError, match="edge-feat.csv.gz has 3 rows but edge.csv.gz has 5"):
        load_ogb(root)


def test_pyg_basic_gnn_with_optional_edge_attr_and_trimming(world, prepared, tmp_path):
    """PyG's ``GAT(edge_dim=...)`` takes ``edge_attr=None`` and the per-hop counts: served with
    both (its ``trim_to_layer`` trims the edge features too) it equals the full graph; on a
    dataset without edge features its optional ``edge_attr`` is left out, not refused."""
    from torch_geometric.nn import GAT

    kwargs = {"in_channels": DIM, "hidden_channels": 8, "num_layers": 2, "out_channels": CLASSES}
    torch.manual_seed(2)
    model = GAT(**kwargs, edge_dim=EDIM).eval()
    ckpt = tmp_path / "gat.pt"
    spec = "torch_geometric.nn:GAT"
    save_model(ckpt, model, spec, {**kwargs, "edge_dim": EDIM}, [-1, -1])
    ei, ea = _full_graph(world, False)
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N, max_wait_ms=0.5)
    with torch.inference_mode():
        want = model(world["x"], ei, edge_attr=ea).numpy()
        want_plain = model(world["x"], ei).numpy()
    for data, expect in ((prepared["directed"], want), (prepared["plain"], want_plain)):
        with Server.from_dataset(data, ckpt, cfg, seed=0, model=spec) as server:
            assert server.engine.model.pass_counts
            got = server.predict(list(range(N)), output="logits").values
        np.testing.assert_allclose(got, expect, rtol=0, atol=1e-5)
    assert float(np.abs(want - want_plain).max()) > 1e-3  # the edge features count


def test_bf16_model_gets_bf16_edge_features(world, prepared):
    """``--precision bf16``: the edge rows are cast with the node rows; answers stay close."""
    want = _reference(world, "GINE")
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N, max_wait_ms=0.5)
    with Server.from_dataset(
        prepared["directed"],
        world["ckpts"]["GINE"],
        cfg,
        seed=0,
        model=SPEC.format("GINE"),
        precision="bf16",
    ) as server:
        got = server.predict(list(range(N)), output="logits").values
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) < 0.05 * scale


def test_edge_feature_width_mismatch_is_one_line(world, tmp_path):
    """A dataset whose edge features are wider than the model's ``edge_dim``: one line naming
    the layer and both widths, at start-up."""
    d = world["dir"]
    np.save(tmp_path / "wide.npy", np.ones((E, EDIM + 2), np.float32))
    argv = ["prepare", "--edges", str(d / "edges.npy"), "--features", str(d / "x.npy")]
    argv += ["--edge-features", str(tmp_path / "wide.npy"), "--out", str(tmp_path / "w")]
    assert cli_main(argv + ["--no-progress"]) == 0
    for name, layer in (("GAT", "GATConv"), ("GINE", "GINEConv")):
        with pytest.raises(ValueError, match=f"its {layer} takes {EDIM} edge features") as e:
            Server.from_dataset(
                tmp_path / "w", world["ckpts"][name], model=SPEC.format(name), fanouts=[-1, -1]
            )
        assert f"has {EDIM + 2} per edge" in str(e.value) and "\n" not in str(e.value)
