"""The folded first layer for a user's own PyG model (``SAGEConv``, ``GCNConv``, ``GraphConv``,
``GINConv``, ``GATConv``): served folded, its logits and embeddings equal the unfolded module's
(fp32 rounding, argmax 100%); models it cannot fold are refused in one line naming why, and
``auto`` decides by measurement."""

import re
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.datasets import save_prepared
from quiver.pyg import GraphSageSampler
from quiver.serving import ServeConfig
from quiver.serving import folded as folded_mod
from quiver.serving.folded import FoldedFirstLayer, measure_fold, why_not_foldable
from quiver.serving.server import Server
from quiver.usermodel import ServedModel, save_model

N, DIM, CLASSES = 400, 12, 5
FANOUTS = [4, 3]

FACTORIES = '''
import torch
from torch import nn
import torch_geometric.nn as pyg


def first_layer(kind, d_in, hidden):
    """``(layer, its output width)`` of each foldable kind and setting under test."""
    if kind == "sage":
        return pyg.SAGEConv(d_in, hidden), hidden
    if kind == "sage_no_root":
        return pyg.SAGEConv(d_in, hidden, root_weight=False), hidden
    if kind == "sage_sum_normalize":
        return pyg.SAGEConv(d_in, hidden, aggr="sum", normalize=True), hidden
    if kind == "gcn":
        return pyg.GCNConv(d_in, hidden), hidden
    if kind == "gcn_unnormalised":
        return pyg.GCNConv(d_in, hidden, normalize=False), hidden
    if kind == "graph":
        return pyg.GraphConv(d_in, hidden), hidden
    if kind == "graph_mean":
        return pyg.GraphConv(d_in, hidden, aggr="mean"), hidden
    if kind == "gin":
        mlp = nn.Sequential(
            nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, hidden)
        )
        return pyg.GINConv(mlp, eps=0.3, train_eps=True), hidden
    if kind == "gin_mlp":
        return pyg.GINConv(pyg.MLP([d_in, hidden, hidden], norm="batch_norm")), hidden
    if kind == "gat":
        return pyg.GATConv(d_in, hidden // 4, heads=4), hidden
    if kind == "gat_two_maps":  # lin_src and lin_dst: the attention of x_dst by its own map
        return pyg.GATConv((d_in, d_in), hidden // 2, heads=2), hidden
    if kind == "gat_mean_residual":
        return pyg.GATConv(d_in, hidden, heads=3, concat=False, residual=True), hidden
    raise ValueError(kind)


class Net(nn.Module):
    """The user's model: a foldable first layer, then a SAGE layer."""

    def __init__(self, kind, d_in, hidden, classes):
        super().__init__()
        self.conv1, width = first_layer(kind, d_in, hidden)
        self.conv2 = pyg.SAGEConv(width, classes)

    def forward(self, x, edge_index):
        return self.conv2(torch.relu(self.conv1(x, edge_index)), edge_index)


def net(kind, d_in, hidden, classes, seed=0):
    torch.manual_seed(seed)
    model = Net(kind, d_in, hidden, classes)
    with torch.no_grad():  # trained-like weights: BatchNorm statistics and eps away from 0/1
        for name, p in model.named_parameters():
            if p.dim() > 0:
                p.normal_(0.0, 0.4)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.normal_(0.0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


class LinearFirst(nn.Module):
    """A Linear before the first layer: the layer does not take the raw features."""

    def __init__(self, d_in, hidden, classes):
        super().__init__()
        self.lin = nn.Linear(d_in, d_in)
        self.conv1 = pyg.SAGEConv(d_in, hidden)
        self.conv2 = pyg.SAGEConv(hidden, classes)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(self.lin(x), edge_index).relu(), edge_index)


class RawSkip(nn.Module):
    """The raw features read again after the first layer (a skip connection)."""

    def __init__(self, d_in, hidden, classes):
        super().__init__()
        self.conv1 = pyg.SAGEConv(d_in, hidden)
        self.conv2 = pyg.SAGEConv(hidden, classes)
        self.skip = nn.Linear(d_in, classes)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index) + self.skip(x)


class TwoLayers(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.conv1, self.conv2 = first, second

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)
'''

KINDS = [
    "sage",
    "sage_no_root",
    "sage_sum_normalize",
    "gcn",
    "gcn_unnormalised",
    "graph",
    "graph_mean",
    "gin",
    "gin_mlp",
    "gat",
    "gat_two_maps",
    "gat_mean_residual",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A skewed graph (nodes 0..9 without in-edges), its prepared dataset and the factories."""
    d = tmp_path_factory.mktemp("folded_pyg")
    (d / "quiver_fold_factories.py").write_text(textwrap.dedent(FACTORIES))
    sys.path.insert(0, str(d))
    import quiver_fold_factories as fac

    rng = np.random.default_rng(0)
    dst = (N * rng.random(4000) ** 1.5).astype(np.int64)
    src = (N * rng.random(4000) ** 2).astype(np.int64)
    keep = dst >= 10
    ei = np.stack([src[keep], dst[keep]])
    topo = CSRTopo.from_edge_index(torch.from_numpy(ei), num_nodes=N)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    labels = rng.integers(0, CLASSES, N)
    save_prepared(d / "data", topo, x, labels, {}, {"name": "folded_pyg", "fanouts": FANOUTS})
    yield {"dir": d, "data": d / "data", "topo": topo, "x": torch.from_numpy(x), "fac": fac}
    sys.path.remove(str(d))


def _served(world, kind, seed=0):
    return ServedModel(world["fac"].net(kind, DIM, 16, CLASSES, seed))


def _close(got, want):
    """Folded against unfolded: fp32 rounding only (relative to the logits' scale), same
    argmax everywhere."""
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= 1e-5 * scale, float(np.abs(got - want).max())
    assert (got.argmax(1) == want.argmax(1)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_folded_batches_equal_the_unfolded_module(world, kind):
    served = _served(world, kind)
    assert why_not_foldable(served) is None
    x = world["x"]
    fold = FoldedFirstLayer(served, x, chunk_rows=64)  # several chunks
    assert fold.shape == (N, 16) and fold.num_nodes == N
    sizes = FANOUTS + FANOUTS[-1:] * served.extra_hops  # GCN: its degree hop
    sampler = GraphSageSampler(world["topo"], sizes, mode="CPU", seed=3, frontier=True)
    for seeds in (torch.arange(0, 40), torch.tensor([3]), torch.arange(N)):
        n_id, _, adjs = sampler.sample(seeds)
        with torch.inference_mode():
            want_emb, want = served.forward_all(x[n_id], adjs)
            pre, rest = fold.gather_layer(n_id, adjs)
            emb, got = fold.tail.forward_all(pre, rest)
            assert torch.equal(fold.tail(pre, rest), got)
        assert pre.shape == (n_id.numel(), 16) and len(rest) == len(adjs)
        _close(got.numpy(), want.numpy())
        _close(emb.numpy(), want_emb.numpy())
    # the unfolded module still runs as it did (its first layer answers a folded batch only)
    with torch.inference_mode():
        again = served(x[n_id], adjs)
    assert torch.equal(again, want)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin", "gat"])
def test_bf16_tables_stay_close(world, kind):
    served = _served(world, kind)
    x = world["x"]
    fold = FoldedFirstLayer(served, x, dtype=torch.bfloat16)
    assert fold.dtype == torch.bfloat16
    assert fold.nbytes == N * sum(t.shape[1] for t in fold.tables) * 2
    sizes = FANOUTS + FANOUTS[-1:] * served.extra_hops
    sampler = GraphSageSampler(world["topo"], sizes, mode="CPU", seed=0, frontier=True)
    n_id, _, adjs = sampler.sample(torch.arange(N))
    with torch.inference_mode():
        want = served(x[n_id], adjs)
        got = fold.tail(*fold.gather_layer(n_id, adjs))
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05 * max(1.0, float(want.abs().max()))
    assert float((got.argmax(1) == want.argmax(1)).float().mean()) >= 0.95


def test_table_layout_per_layer(world):
    """What is precomputed: SAGE/GraphConv two maps, GCN and GIN one, GAT ``W x`` of every
    head and both attention terms per head (and its residual map)."""
    x = world["x"]
    widths = {
        k: [t.shape[1] for t in FoldedFirstLayer(_served(world, k), x).tables]
        for k in ("sage", "graph", "gcn", "gin", "gat", "gat_mean_residual")
    }
    assert widths == {
        "sage": [16, 16],
        "graph": [16, 16],
        "gcn": [16],
        "gin": [16],
        "gat": [16, 8],
        "gat_mean_residual": [48, 6, 16],
    }
    served = _served(world, "gcn")
    conv = served.module.conv1
    fold = FoldedFirstLayer(served, x)
    torch.testing.assert_close(fold.tables[0], x @ conv.lin.weight.detach().t())
    assert folded_mod.fold_table_bytes(served, N, torch.float32) == fold.nbytes
    assert "1 x 400 x 16 fp32" == fold.describe()


def _refused(world, module):
    return why_not_foldable(ServedModel(module.eval()))


def test_why_not_foldable_names_the_reason(world):
    import torch_geometric.nn as pyg

    fac = world["fac"]
    sage2 = pyg.SAGEConv(16, CLASSES)
    cases = {
        "not one of SAGEConv, GCNConv": fac.TwoLayers(pyg.GATv2Conv(DIM, 16), sage2),
        "not a plain mean or sum aggregation (aggr='max')": fac.TwoLayers(
            pyg.SAGEConv(DIM, 16, aggr="max"), sage2
        ),
        "GraphConv aggregates with 'max'": fac.TwoLayers(pyg.GraphConv(DIM, 16, aggr="max"), sage2),
        "cached=True": fac.TwoLayers(pyg.GCNConv(DIM, 16, cached=True), sage2),
        "takes edge features": fac.TwoLayers(pyg.GATConv(DIM, 16, edge_dim=3), sage2),
        "MLP does not start with a Linear": fac.TwoLayers(
            pyg.GINConv(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(DIM, 16))), sage2
        ),
        "does not take the raw features": fac.LinearFirst(DIM, 16, CLASSES),
        "reads its raw features outside its first SAGEConv": fac.RawSkip(DIM, 16, CLASSES),
        "one-layer model": pyg.GCN(DIM, 16, 1),
    }
    for reason, module in cases.items():
        got = _refused(world, module)
        assert got is not None and reason in got and "\n" not in got, (reason, got)
    assert "no message-passing layer is visible" in _refused(world, torch.nn.Linear(DIM, 4))
    adjs = ServedModel(fac.net("sage", DIM, 16, CLASSES), convention="adjs")
    assert "takes (x, adjs)" in why_not_foldable(adjs)
    # PyG's own GraphSAGE / GCN / GIN / GAT models fold (their first conv takes x)
    for model in (
        pyg.GraphSAGE(DIM, 16, 2, CLASSES),
        pyg.GCN(DIM, 16, 2, CLASSES),
        pyg.GIN(DIM, 16, 2, CLASSES),
        pyg.GAT(DIM, 16, 2, CLASSES, heads=2),
    ):
        assert _refused(world, model) is None, type(model).__name__
    # the check leaves the module as it was; a fold routes its first layer (and GIN's Linear)
    served = _served(world, "gin")
    conv = served.module.conv1
    assert why_not_foldable(served) is None
    assert "forward" not in conv.__dict__ and "forward" not in conv.nn[0].__dict__
    FoldedFirstLayer(served, world["x"])
    assert "forward" in conv.__dict__ and "forward" in conv.nn[0].__dict__
    with pytest.raises(ValueError, match="cannot fold this model: .*does not take the raw"):
        FoldedFirstLayer(ServedModel(fac.LinearFirst(DIM, 16, CLASSES).eval()), world["x"])
    with pytest.raises(ValueError, match="takes 12 features per node; the dataset has 7"):
        FoldedFirstLayer(_served(world, "gat"), torch.zeros(N, 7))


def test_pyg_basic_gnn_with_trimming_folds_exactly(world):
    """PyG's ``GraphSAGE`` takes the per-hop counts and trims its later layers: its first conv
    still sees the whole sample, folded."""
    import torch_geometric.nn as pyg

    torch.manual_seed(0)
    served = ServedModel(pyg.GIN(DIM, 16, 3, CLASSES).eval())
    assert served.pass_counts
    x = world["x"]
    fold = FoldedFirstLayer(served, x)
    sampler = GraphSageSampler(world["topo"], [4, 3, 2], mode="CPU", seed=1, frontier=True)
    n_id, _, adjs = sampler.sample(torch.arange(0, N, 3))
    with torch.inference_mode():
        want = served(x[n_id], adjs)
        got = fold.tail(*fold.gather_layer(n_id, adjs))
    _close(got.numpy(), want.numpy())


def _checkpoint(world, kind):
    path = world["dir"] / f"{kind}.pt"
    module = world["fac"].net(kind, DIM, 16, CLASSES)
    kwargs = {"kind": kind, "d_in": DIM, "hidden": 16, "classes": CLASSES}
    save_model(path, module, "quiver_fold_factories:net", kwargs, FANOUTS)
    return path


def _serve(world, ckpt, **kw):
    cfg = ServeConfig(max_batch_nodes=N, max_request_nodes=N)
    spec = "quiver_fold_factories:net"
    with Server.from_dataset(world["data"], ckpt, cfg, seed=0, model=spec, **kw) as server:
        logits = np.asarray(server.predict(list(range(N)), output="logits").values)
        emb = np.asarray(server.predict(list(range(0, N, 3)), output="embedding").values)
        return logits, emb, server


@pytest.mark.parametrize("kind", ["sage", "gcn", "graph", "gin", "gat"])
def test_served_folded_equals_served_unfolded(world, kind):
    """``quiver serve --fold-first-layer on`` with a user's checkpoint (its factory recorded):
    the same logits and embeddings as ``off``, the same sampling (seeded)."""
    ckpt = _checkpoint(world, kind)
    want, want_emb, plain = _serve(world, ckpt, fold="off")
    got, got_emb, server = _serve(world, ckpt, fold="on")
    assert not isinstance(plain.engine.features, FoldedFirstLayer)
    assert isinstance(server.engine.features, FoldedFirstLayer)
    assert re.search(r"first layer folded into (\d x 400 x 16|400 x \([\d +]+\)) fp32", server.info)
    _close(got, want)
    _close(got_emb, want_emb)


def test_fold_on_refuses_a_model_it_cannot_fold(world, tmp_path):
    import torch_geometric.nn as pyg

    module = pyg.GraphSAGE(DIM, 16, 2, CLASSES, aggr="max").eval()
    kwargs = {"in_channels": DIM, "hidden_channels": 16, "num_layers": 2, "out_channels": CLASSES}
    path = tmp_path / "max.pt"
    save_model(path, module, "torch_geometric.nn:GraphSAGE", {**kwargs, "aggr": "max"}, FANOUTS)
    with pytest.raises(ValueError, match="--fold-first-layer on: cannot fold: its first SAGEConv"):
        Server.from_dataset(world["data"], path, model="torch_geometric.nn:GraphSAGE", fold="on")


def test_auto_decides_by_measurement_for_a_user_model(world, monkeypatch, tmp_path):
    """``auto`` folds a user's GCN when the measured folded path is faster, not when it is
    within the margin; the real measurement finds the folded answers equal."""
    import shutil

    shutil.copytree(world["data"], tmp_path / "data")
    world = {**world, "data": tmp_path / "data"}
    ckpt = _checkpoint(world, "gcn")
    real = folded_mod.measure_fold
    seen = {}

    def timed(unfolded, folded):
        def fake(sampler, features, model, folds, *a, **k):
            seen.update(real(sampler, features, model, folds, *a, **k))
            return {"unfolded_s": unfolded, "folded_s": dict.fromkeys(folds, folded)}

        return fake

    monkeypatch.setattr(folded_mod, "measure_fold", timed(2.0, 1.0))
    _, _, server = _serve(world, ckpt, fold="auto")
    assert isinstance(server.engine.features, FoldedFirstLayer)
    assert "2.00x faster on sampled batches" in server.info
    assert seen["agreement"]["fp32"] == 1.0 and seen["max_abs_diff"]["fp32"] < 1e-4
    monkeypatch.setattr(folded_mod, "measure_fold", timed(1.0, 0.99))
    _, _, server = _serve(world, ckpt, fold="auto")  # the stored decision, not re-measured
    assert isinstance(server.engine.features, FoldedFirstLayer)
    assert "auto, from the manifest" in server.info
    import json

    manifest = world["data"] / "manifest.json"
    m = json.loads(manifest.read_text())
    m.pop("fold")
    manifest.write_text(json.dumps(m))
    _, _, server = _serve(world, ckpt, fold="auto")
    assert not isinstance(server.engine.features, FoldedFirstLayer)
    assert "first layer not folded (measured 1.01x" in server.info


def test_measure_fold_on_a_user_model(world):
    served = _served(world, "gat")
    x = world["x"]
    fold = FoldedFirstLayer(served, x)
    sampler = GraphSageSampler(world["topo"], FANOUTS, mode="CPU", seed=0, frontier=True)
    m = measure_fold(sampler, x, served, {"fp32": fold}, N, batch_sizes=(8, 64), repeats=2)
    assert m["unfolded_s"] > 0 and m["folded_s"]["fp32"] > 0
    assert m["agreement"]["fp32"] == 1.0 and m["max_abs_diff"]["fp32"] < 1e-4


@pytest.mark.parametrize("kind", ["gin", "gat"])
def test_bf16_serving_folds_with_a_bf16_model(world, kind):
    """``--precision bf16``: bf16 tables and a bf16 copy of the model, whose first layer (and a
    GIN MLP's first Linear) still answers the folded batch."""
    ckpt = _checkpoint(world, kind)
    want, _, _ = _serve(world, ckpt, fold="off")
    got, got_emb, server = _serve(world, ckpt, fold="on", precision="bf16")
    assert server.engine.features.dtype == torch.bfloat16 and "model bf16" in server.info
    assert np.isfinite(got).all() and np.isfinite(got_emb).all()
    assert float((got.argmax(1) == want.argmax(1)).mean()) >= 0.95


def test_lanes_on_several_threads_keep_their_batches_apart(world):
    """Each lane runs its own batches through the shared module on its own thread: the folded
    output its first layer answers with is handed over per thread, so concurrent requests get
    the same answers as one by one, unfolded."""
    from concurrent.futures import ThreadPoolExecutor

    ckpt = _checkpoint(world, "gat")
    cfg = ServeConfig(
        max_batch_nodes=N, max_request_nodes=N, num_lanes=3, torch_threads=1, shed_late=False
    )  # every request answered, however long the held lanes make it wait
    spec = "quiver_fold_factories:net"
    # all-neighbour fanouts: a node's answer does not depend on its batch's sample
    with Server.from_dataset(
        world["data"], ckpt, cfg, seed=0, model=spec, fold="on", fanouts=[-1, -1]
    ) as server:
        assert isinstance(server.engine.features, FoldedFirstLayer)
        # hold each lane between handing over its batch and its first layer reading it, so
        # the lanes' model steps overlap
        module = server.engine.model.served.module
        module.register_forward_pre_hook(lambda *_: time.sleep(0.02))
        groups = [list(range(i, N, 7)) for i in range(7)]
        with ThreadPoolExecutor(7) as pool:
            outs = list(pool.map(lambda g: server.predict(g, output="logits").values, groups * 3))
    with Server.from_dataset(
        world["data"],
        ckpt,
        ServeConfig(max_batch_nodes=N, max_request_nodes=N),
        seed=0,
        model=spec,
        fold="off",
        fanouts=[-1, -1],
    ) as plain:
        want = np.asarray(plain.predict(list(range(N)), output="logits").values)
    for g, out in zip(groups * 3, outs):
        _close(np.asarray(out), want[g])


def test_jumping_knowledge_model_on_one_subgraph_folds(world):
    """``GraphSAGE(jk='cat')`` gets one plain subgraph (``subgraph`` input): its first conv
    folds, and the concatenation of every layer's output is unchanged."""
    import torch_geometric.nn as pyg

    torch.manual_seed(0)
    served = ServedModel(pyg.GraphSAGE(DIM, 16, 2, CLASSES, jk="cat").eval())
    assert served.convention == "subgraph" and why_not_foldable(served) is None
    x = world["x"]
    fold = FoldedFirstLayer(served, x)
    sampler = GraphSageSampler(world["topo"], FANOUTS, mode="CPU", seed=2, frontier=True)
    n_id, _, adjs = sampler.sample(torch.arange(0, N, 5))
    with torch.inference_mode():
        want = served(x[n_id], adjs)
        got = fold.tail(*fold.gather_layer(n_id, adjs))
    _close(got.numpy(), want.numpy())
