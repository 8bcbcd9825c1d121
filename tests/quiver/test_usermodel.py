"""The user's own PyG models served: state_dict + factory, torch.export, legacy ``(x, adjs)``.

Served logits equal the same module run offline on the same sampled subgraph, and with
all-neighbour fanouts the module on the full graph (GCN included, through its extra hop).
"""

import sys
import textwrap

import numpy as np
import pytest
import torch

from quiver import CSRTopo
from quiver.datasets import save_prepared
from quiver.pyg import GraphSageSampler
from quiver.serving import ServeConfig
from quiver.serving.engine import Engine
from quiver.serving.server import Server
from quiver.usermodel import ServedModel, load_served_model

DIM, CLASSES, N = 8, 4, 150

FACTORIES = '''
import torch
from torch import nn
from torch_geometric.nn import GAT, GCN, GIN, GraphSAGE, MessagePassing, SAGEConv

DIM, CLASSES = 8, 4


def sage():
    return GraphSAGE(DIM, 16, 2, CLASSES)


def gcn():
    return GCN(DIM, 16, 2, CLASSES)


def gat():
    return GAT(DIM, 16, 2, CLASSES, heads=2)


def gin():
    return GIN(DIM, 16, 2, CLASSES)


class MeanConv(MessagePassing):
    """A user-written layer: mean of neighbours, its own linear maps."""

    def __init__(self, d_in, d_out):
        super().__init__(aggr="mean")
        self.lin = nn.Linear(d_in, d_out)
        self.root = nn.Linear(d_in, d_out)

    def forward(self, x, edge_index):
        return self.lin(self.propagate(edge_index, x=x)) + self.root(x)

    def message(self, x_j):
        return x_j


class UserNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = MeanConv(DIM, 16)
        self.conv2 = MeanConv(16, CLASSES)

    def forward(self, x, edge_index):
        return self.conv2(torch.relu(self.conv1(x, edge_index)), edge_index)


def user():
    return UserNet()


class LegacySAGE(nn.Module):
    """torch-quiver's example model: forward(x, adjs) over bipartite hops."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([SAGEConv(DIM, 16), SAGEConv(16, CLASSES)])

    def forward(self, x, adjs):
        for i, (edge_index, _, size) in enumerate(adjs):
            x = self.convs[i]((x, x[: size[1]]), edge_index)
            if i != len(self.convs) - 1:
                x = torch.relu(x)
        return x

    def full(self, x, edge_index):
        return self.convs[1](torch.relu(self.convs[0](x, edge_index)), edge_index)


def legacy():
    return LegacySAGE()


def broken():
    raise RuntimeError("factory exploded")
'''

EDGE_INDEX_MODELS = ["sage", "gcn", "gat", "gin", "user"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A prepared dataset (in-degrees above the sampled fanouts) and the factory module."""
    d = tmp_path_factory.mktemp("usermodel")
    (d / "quiver_test_factories.py").write_text(textwrap.dedent(FACTORIES))
    sys.path.insert(0, str(d))
    import quiver_test_factories as fac

    rng = np.random.default_rng(0)
    dst = rng.integers(0, N, 1200)
    src = rng.integers(0, N, 1200)
    ei = np.unique(np.stack([src, dst]), axis=1)
    ei = ei[:, ei[0] != ei[1]]
    topo = CSRTopo.from_edge_index(torch.from_numpy(ei), num_nodes=N)
    torch.manual_seed(0)
    x = torch.randn(N, DIM)
    labels = rng.integers(0, CLASSES, N)
    data = d / "data"
    save_prepared(data, topo, x, labels, {}, {"name": "usermodel", "fanouts": [3, 2]})
    ckpts = {}
    modules = {}
    for name in EDGE_INDEX_MODELS + ["legacy"]:
        torch.manual_seed(1)
        m = getattr(fac, name)().eval()
        ckpts[name] = d / f"{name}.pt"
        torch.save(m.state_dict(), ckpts[name])
        modules[name] = m
    yield {
        "dir": d,
        "data": data,
        "x": x,
        "edge_index": torch.from_numpy(ei),
        "ckpts": ckpts,
        "modules": modules,
        "fac": fac,
    }
    sys.path.remove(str(d))


def _serve(world, name, fanouts, **kw):
    return Server.from_dataset(
        world["data"],
        world["ckpts"][name],
        ServeConfig(max_wait_ms=0.5),
        fanouts=fanouts,
        seed=0,
        model=f"quiver_test_factories:{name}",
        **kw,
    )


NODES = [0, 5, 17, 42, 99, 149, 5]


def _edge_index_of(adjs):
    """The sampled subgraph as NeighborLoader gives it: hops innermost first."""
    return torch.cat([a[0] for a in reversed(adjs)], dim=1)


@pytest.mark.parametrize("name", EDGE_INDEX_MODELS)
def test_full_fanouts_equal_the_module_on_the_full_graph(world, name):
    module = world["modules"][name]
    server = _serve(world, name, [-1, -1])
    with server:
        res = server.predict(NODES, "logits")
    with torch.inference_mode():
        full = module(world["x"], world["edge_index"])[NODES].numpy()
    diff = float(np.abs(res.values - full).max())
    assert diff <= 1e-4, f"{name}: served vs full graph differ by {diff}"


@pytest.mark.parametrize("name", EDGE_INDEX_MODELS)
def test_sampled_logits_equal_the_module_on_the_same_subgraph(world, name):
    module = world["modules"][name]
    server = _serve(world, name, [3, 2])
    server.engine.record = True
    with server:
        res = server.predict(NODES, "logits")
    seeds, n_id, adjs = server.engine.recorded[-1]
    with torch.inference_mode():
        # plain PyG call on the whole subgraph (no trim_to_layer): the seeds' rows must agree
        offline = module(world["x"][n_id], _edge_index_of(adjs))[: len(seeds)]
    row = {int(s): i for i, s in enumerate(seeds)}
    expect = offline.numpy()[[row[v] for v in NODES]]
    diff = float(np.abs(res.values - expect).max())
    assert diff <= 1e-5, f"{name}: served vs offline on the same subgraph differ by {diff}"


def test_gcn_samples_one_extra_hop_for_its_degrees(world):
    served, info = load_served_model(
        world["ckpts"]["gcn"], "quiver_test_factories:gcn", convention=None
    )
    assert info["extra_hops"] == 1 and info["frontier"]
    module = world["modules"]["gcn"]
    topo = CSRTopo.from_edge_index(world["edge_index"], num_nodes=N)
    seeds = torch.tensor([0, 5, 17])
    with torch.inference_mode():
        full = module(world["x"], world["edge_index"])[seeds]
        outs = {}
        for extra in (0, 1):
            s = ServedModel(module, extra_hops=extra)
            n_id, _, adjs = GraphSageSampler(topo, [-1] * (2 + extra), frontier=True).sample(seeds)
            outs[extra] = s(world["x"][n_id], adjs)
    assert (outs[1] - full).abs().max() <= 1e-5
    # without it the outer hop's degrees are 1 and the logits are visibly off
    assert (outs[0] - full).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["sage", "gat", "user"])
def test_embedding_is_the_input_of_the_last_layer(world, name):
    module = world["modules"][name]
    last = module.convs[-1] if hasattr(module, "convs") else module.conv2
    caught = []
    handle = last.register_forward_pre_hook(lambda m, a: caught.append(a[0]))
    try:
        with torch.inference_mode():
            module(world["x"], world["edge_index"])
    finally:
        handle.remove()
    server = _serve(world, name, [-1, -1])
    with server:
        res = server.predict(NODES, "embedding")
    assert res.values.shape == (len(NODES), 16)
    assert np.abs(res.values - caught[0][NODES].numpy()).max() <= 1e-4


def test_legacy_adjs_model_full_and_sampled(world):
    module = world["modules"]["legacy"]
    server = _serve(world, "legacy", [-1, -1])
    with server:
        res = server.predict(NODES, "logits")
        emb = server.predict(NODES, "embedding")
    with torch.inference_mode():
        full = module.full(world["x"], world["edge_index"])[NODES].numpy()
        hidden = torch.relu(module.convs[0](world["x"], world["edge_index"]))[NODES].numpy()
    assert np.abs(res.values - full).max() <= 1e-4
    assert np.abs(emb.values - hidden).max() <= 1e-4
    assert not server.engine.sampler.frontier  # torch-quiver's sampling semantics

    server = _serve(world, "legacy", [3, 2])
    server.engine.record = True
    with server:
        res = server.predict(NODES, "logits")
    seeds, n_id, adjs = server.engine.recorded[-1]
    with torch.inference_mode():
        offline = module(world["x"][n_id], adjs).numpy()
    row = {int(s): i for i, s in enumerate(seeds)}
    assert np.abs(res.values - offline[[row[v] for v in NODES]]).max() <= 1e-5


def test_torch_export_archive(world):
    module = world["modules"]["sage"]
    x, ei = world["x"], world["edge_index"]
    nodes, edges = torch.export.Dim("nodes", min=2), torch.export.Dim("edges", min=2)
    program = torch.export.export(module, (x, ei), dynamic_shapes=({0: nodes}, {1: edges}))
    path = world["dir"] / "sage.pt2"
    torch.export.save(program, path)
    _, info = load_served_model(path)
    assert (info["num_layers"], info["extra_hops"]) == (2, 0)  # read from the program
    server = Server.from_dataset(world["data"], path, fanouts=[-1, -1], seed=0)
    with server:
        res = server.predict(NODES, "logits")
        with pytest.raises(ValueError, match="embeddings"):
            server.predict(NODES, "embedding")  # refused at admission (HTTP 422), not a 500
        assert server.predict([1], "class").values.shape == (1,)
    with torch.inference_mode():
        full = module(x, ei)[NODES].numpy()
    assert np.abs(res.values - full).max() <= 1e-4


def _export(module, x, edge_index, path):
    nodes, edges = torch.export.Dim("nodes", min=2), torch.export.Dim("edges", min=2)
    program = torch.export.export(module, (x, edge_index), dynamic_shapes=({0: nodes}, {1: edges}))
    torch.export.save(program, path)
    return path


@pytest.fixture(scope="module")
def gcn_pt2(world):
    """The 2-layer GCN of ``world`` exported with torch.export."""
    return _export(world["modules"]["gcn"], world["x"], world["edge_index"], world["dir"] / "g.pt2")


def test_torch_export_gcn_reads_its_layers_and_degrees(world, gcn_pt2):
    """The export's layers and degree normalisation are read from the program itself."""
    served, info = load_served_model(gcn_pt2)
    assert info["num_layers"] == 2 and info["extra_hops"] == 1 and info["frontier"]
    eager, eager_info = load_served_model(world["ckpts"]["gcn"], "quiver_test_factories:gcn")
    assert (info["num_layers"], info["extra_hops"]) == (
        eager_info["num_layers"],
        eager_info["extra_hops"],
    )


def test_torch_export_gcn_with_one_fanout_per_layer_is_exact(world, gcn_pt2):
    """Two fanouts for the two-layer exported GCN: its degrees' extra hop is sampled too."""
    module = world["modules"]["gcn"]
    server = Server.from_dataset(world["data"], gcn_pt2, fanouts=[-1, -1], seed=0)
    with server:
        res = server.predict(NODES, "logits")
    with torch.inference_mode():
        full = module(world["x"], world["edge_index"])[NODES].numpy()
    assert np.abs(res.values - full).max() <= 1e-4

    # sampled fanouts: the exported program's answers are its eager source's on the subgraph
    server = Server.from_dataset(world["data"], gcn_pt2, fanouts=[3, 2], seed=0)
    server.engine.record = True
    with server:
        res = server.predict(NODES, "logits")
    seeds, n_id, adjs = server.engine.recorded[-1]
    assert len(adjs) == 3  # two layers and the extra hop
    with torch.inference_mode():
        offline = module(world["x"][n_id], _edge_index_of(adjs))[: len(seeds)].numpy()
    row = {int(s): i for i, s in enumerate(seeds)}
    assert np.abs(res.values - offline[[row[v] for v in NODES]]).max() <= 1e-5


@pytest.mark.parametrize("fanouts", [[-1], [-1, -1, -1]])
def test_torch_export_fanouts_not_one_per_layer_are_refused(world, gcn_pt2, fanouts, capsys):
    from quiver.cli import main as quiver_main

    with pytest.raises(ValueError, match=f"{len(fanouts)} fanouts .* has 2 message-passing"):
        Server.from_dataset(world["data"], gcn_pt2, fanouts=fanouts)
    text = ",".join(str(k) for k in fanouts)
    argv = ["serve", str(world["data"]), "--checkpoint", str(gcn_pt2), "--port", "0"]
    assert quiver_main([*argv, "--fanouts", text]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{len(fanouts)} fanouts" in err and "2 message-passing layers" in err


def test_pickled_module_needs_trust_pickle(world):
    path = world["dir"] / "whole.pt"
    torch.save(world["modules"]["sage"], path)
    with pytest.raises(ValueError, match="--trust-pickle"):
        load_served_model(path)
    served, info = load_served_model(path, trust_pickle=True)
    assert info["convention"] == "edge_index" and served.num_layers == 2


def test_python_api_module_without_forward_all_serves_embeddings(world):
    """The Engine wraps a plain ``forward(x, adjs)`` module: embeddings, not a 500."""
    module = world["modules"]["legacy"]
    topo = CSRTopo.from_edge_index(world["edge_index"], num_nodes=N)
    sampler = GraphSageSampler(topo, [-1, -1], seed=0)
    with Engine(sampler, world["x"], module, N, ServeConfig(max_wait_ms=0.5)) as engine:
        res = engine.predict([3, 4], "embedding")
        assert res.values.shape == (2, 16)
        assert engine.predict([3, 4], "class").values.shape == (2,)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The shipped ``tiny`` preset (``quiver prepare --dataset tiny``) and its full graph."""
    from quiver.datasets import synthetic

    d = tmp_path_factory.mktemp("tiny") / "data"
    ds = synthetic("tiny", seed=0, out=d)
    topo = ds.topo
    dst = torch.repeat_interleave(torch.arange(topo.node_count), topo.degree)
    full_ei = torch.stack([topo.indices, dst])  # rows are in-neighbours: source -> row
    return d, torch.as_tensor(np.asarray(ds.features)).float(), full_ei


@pytest.mark.parametrize("convention", [None, "subgraph"])
def test_jumping_knowledge_model_is_served_on_one_plain_subgraph(tiny, tmp_path, convention):
    """``GraphSAGE(jk='cat')`` concatenates every layer's output, so every layer must see the
    same nodes: with ``subgraph`` (chosen by default for it) it gets one relabelled ``(x,
    edge_index)`` of the whole sample and no per-hop counts, and with all-neighbour fanouts
    its seeds' answers are its full-graph forward's (the per-hop counts trimmed the layers
    and the concatenation failed at start-up)."""
    from torch_geometric.nn import GraphSAGE

    from quiver.usermodel import save_model

    data, x, full_ei = tiny
    kwargs = dict(in_channels=x.shape[1], hidden_channels=16, out_channels=4, num_layers=2)
    torch.manual_seed(0)
    model = GraphSAGE(**kwargs, jk="cat").eval()
    ckpt = tmp_path / "jk.pt"
    save_model(ckpt, model, "torch_geometric.nn:GraphSAGE", {**kwargs, "jk": "cat"}, [-1, -1])
    n = x.shape[0]
    cfg = ServeConfig(max_batch_nodes=n, max_request_nodes=n)
    with Server.from_dataset(
        data, ckpt, cfg, model="torch_geometric.nn:GraphSAGE", convention=convention
    ) as server:
        assert "input subgraph" in server.info
        nodes = [5, 0, 77, n - 1, 12]
        got = np.stack([server.predict([v], output="logits").values[0] for v in nodes])
        got_all = server.predict(list(range(n)), output="logits").values
    with torch.no_grad():
        want = model(x, full_ei).numpy()
    np.testing.assert_allclose(got, want[nodes], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_all, want, rtol=0, atol=1e-5)
    assert (got_all.argmax(1) == want.argmax(1)).all() and np.abs(want).max() > 0.1


def test_model_input_subgraph_is_a_serve_option():
    from quiver.cli import build_parser

    argv = ["serve", "data", "--checkpoint", "m.pt", "--model-input", "subgraph"]
    assert build_parser().parse_args(argv).model_input == "subgraph"


KHOP_FACTORIES = '''
from torch import nn
from torch_geometric.nn import APPNP


class LinearAPPNP(nn.Module):
    """A linear map, then K personalised-PageRank propagation steps (one APPNP module)."""

    def __init__(self, d_in, d_out, K):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.prop = APPNP(K=K, alpha=0.1)

    def forward(self, x, edge_index):
        return self.prop(self.lin(x), edge_index)
'''

K_HOP_MODELS = {
    "SGConv": ("torch_geometric.nn:SGConv", 2),
    "TAGConv": ("torch_geometric.nn:TAGConv", 3),
    "APPNP": ("quiver_khop_factories:LinearAPPNP", 3),
}


def _k_hop_checkpoint(tiny, tmp_path, monkeypatch, name):
    (tmp_path / "quiver_khop_factories.py").write_text(textwrap.dedent(KHOP_FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))
    from quiver.usermodel import import_factory, save_model

    _, x, _ = tiny
    spec, k = K_HOP_MODELS[name]
    if name == "APPNP":
        kwargs = {"d_in": x.shape[1], "d_out": 4, "K": k}
    else:
        kwargs = {"in_channels": x.shape[1], "out_channels": 4, "K": k}
    torch.manual_seed(0)
    model = import_factory(spec)(**kwargs).eval()
    ckpt = tmp_path / f"{name}.pt"
    save_model(ckpt, model, spec, kwargs)
    return model, ckpt, spec, k


@pytest.mark.parametrize("name", sorted(K_HOP_MODELS))
def test_k_hop_layer_needs_one_fanout_per_hop_and_is_exact(tiny, tmp_path, monkeypatch, name):
    """``SGConv(K)``, ``TAGConv(K)`` and ``APPNP(K)`` propagate K hops in one module: served with
    K all-neighbour fanouts (plus the degree hop their normalisation needs) the seeds' answers
    are the module's full-graph forward (one fanout per module was accepted and inexact)."""
    model, ckpt, spec, k = _k_hop_checkpoint(tiny, tmp_path, monkeypatch, name)
    data, x, full_ei = tiny
    _, info = load_served_model(ckpt, spec)
    assert info["num_layers"] == k and info["extra_hops"] == 1
    n = x.shape[0]
    cfg = ServeConfig(max_batch_nodes=n, max_request_nodes=n)
    with Server.from_dataset(data, ckpt, cfg, fanouts=[-1] * k, model=spec) as server:
        nodes = [5, 0, 77, n - 1, 12]
        got = np.stack([server.predict([v], output="logits").values[0] for v in nodes])
        got_all = server.predict(list(range(n)), output="logits").values
    with torch.no_grad():
        want = model(x, full_ei).numpy()
    np.testing.assert_allclose(got, want[nodes], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_all, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(K_HOP_MODELS))
def test_k_hop_layer_with_one_fanout_per_module_is_refused(tiny, tmp_path, monkeypatch, name):
    _, ckpt, spec, k = _k_hop_checkpoint(tiny, tmp_path, monkeypatch, name)
    for fanouts in ([-1], [-1] * (k + 1)):
        with pytest.raises(ValueError) as err:
            Server.from_dataset(tiny[0], ckpt, fanouts=fanouts, model=spec)
        text = str(err.value)
        assert "\n" not in text
        assert f"propagates {k} hops ({name} K={k}" in text and f"give {k} fanouts" in text


@pytest.mark.parametrize("name", ["SGConv", "APPNP"])
def test_torch_export_k_hop_layer_counts_its_hops(tiny, tmp_path, monkeypatch, name):
    """An exported K-hop layer calls its aggregation K times: the export is served with K
    fanouts (plus the degree hop) and equals the module's full-graph forward; one fanout for
    the module is refused naming K."""
    model, _, _, k = _k_hop_checkpoint(tiny, tmp_path, monkeypatch, name)
    data, x, full_ei = tiny
    pt2 = _export(model, x, full_ei, tmp_path / f"{name}.pt2")
    _, info = load_served_model(pt2)
    assert info["num_layers"] == k and info["extra_hops"] == 1
    with pytest.raises(ValueError, match=f"propagates {k} hops \\({name} K={k}"):
        Server.from_dataset(data, pt2, fanouts=[-1])
    n = x.shape[0]
    cfg = ServeConfig(max_batch_nodes=n, max_request_nodes=n)
    with Server.from_dataset(data, pt2, cfg, fanouts=[-1] * k) as server:
        got = server.predict(list(range(n)), output="logits").values
    with torch.no_grad():
        want = model(x, full_ei).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def local_graphs(tmp_path_factory):
    """``{symmetric: (data dir, x, full edge_index)}``: a sparse graph of local edges (each node's
    in-neighbours within 6 ids of it), so a few hops reach a small part of it, as given
    (directed) and with every edge both ways (symmetric)."""
    n = 300
    rng = np.random.default_rng(0)
    dst = np.repeat(np.arange(n), 2)
    src = (dst + rng.integers(-6, 7, dst.size)) % n
    ei = np.unique(np.stack([src, dst]), axis=1)
    ei = torch.from_numpy(ei[:, ei[0] != ei[1]])
    x = torch.from_numpy(rng.standard_normal((n, DIM)).astype(np.float32))
    out = {}
    for symmetric in (False, True):
        e = torch.unique(torch.cat([ei, ei.flip(0)], 1), dim=1) if symmetric else ei
        topo = CSRTopo.from_edge_index(e, num_nodes=n)
        d = tmp_path_factory.mktemp("local") / "data"
        save_prepared(d, topo, x.numpy(), np.zeros(n, np.int64), {}, {"name": "local"})
        dst_t = torch.repeat_interleave(torch.arange(n), topo.degree)
        out[symmetric] = (d, x, torch.stack([topo.indices, dst_t]))
    return out


#: layer: (its settings, the hops it propagates, the extra degree hops, a symmetric graph)
MULTI_HOP_MODELS = {
    "ChebConv": ({"K": 3}, 2, 2, True),  # order K - 1 = 2 in the Laplacian; out-degrees
    "MixHopConv": ({"powers": [0, 1, 3]}, 3, 1, False),  # A^0 x, A^1 x, A^3 x
    "ARMAConv": ({"num_stacks": 2, "num_layers": 2}, 2, 1, False),  # 2 propagations per stack
    # the K-hop layers again, on a graph their hops do not cover whole (tiny's 4 hops do)
    "SGConv": ({"K": 2}, 2, 1, False),
    "TAGConv": ({"K": 3}, 3, 1, False),
}


@pytest.mark.parametrize("name", sorted(MULTI_HOP_MODELS))
def test_multi_hop_layer_counts_its_receptive_field_and_is_exact(local_graphs, tmp_path, name):
    """``ChebConv(K)`` propagates K - 1 hops, ``MixHopConv`` max(powers), ``ARMAConv``
    num_layers (read from PyG's forward): served with that many all-neighbour fanouts (plus the
    degree hops their normalisation needs) the seeds' answers are the module's full-graph
    forward; ChebConv's Laplacian counts out-degrees, so it gets two degree hops and is exact
    on a symmetric graph. One fanout for the module is refused naming its hops."""
    from quiver.usermodel import import_factory, save_model

    settings, hops, extra, symmetric = MULTI_HOP_MODELS[name]
    data, x, full_ei = local_graphs[symmetric]
    spec = f"torch_geometric.nn:{name}"
    kwargs = {"in_channels": x.shape[1], "out_channels": 4, **settings}
    torch.manual_seed(0)
    model = import_factory(spec)(**kwargs).eval()
    ckpt = tmp_path / f"{name}.pt"
    save_model(ckpt, model, spec, kwargs)
    _, info = load_served_model(ckpt, spec)
    assert info["num_layers"] == hops and info["extra_hops"] == extra
    assert info["hop_detail"].startswith(f"{name} ")
    assert f"{hops} hops" in info["hop_detail"] or f"K={hops}" in info["hop_detail"]
    n = x.shape[0]
    cfg = ServeConfig(max_batch_nodes=n, max_request_nodes=n)
    with Server.from_dataset(data, ckpt, cfg, fanouts=[-1] * hops, model=spec) as server:
        nodes = [5, 0, 77, n - 1, 12]
        got = np.stack([server.predict([v], output="logits").values[0] for v in nodes])
        got_all = server.predict(list(range(n)), output="logits").values
        sampled = server.engine.sampler.sample(torch.tensor([77]))[0].numel()
    assert sampled < n // 2  # the hops reach a part of the graph, not all of it
    with torch.no_grad():
        want = model(x, full_ei).numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want[nodes], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_all, want, rtol=0, atol=1e-5)
    for fanouts in ([-1], [-1] * (hops + 1)):
        with pytest.raises(ValueError) as err:
            Server.from_dataset(data, ckpt, fanouts=fanouts, model=spec)
        text = str(err.value)
        assert "\n" not in text and f"propagates {hops} hops ({name} " in text, text
        assert f"give {hops} fanouts" in text


def test_multi_hop_layer_with_fewer_hops_served_is_not_exact(local_graphs):
    """The counted hops are needed: a sample one hop short (what one fanout per module gave)
    differs from the full graph for each multi-hop layer."""
    from torch_geometric.nn import ARMAConv, ChebConv, MixHopConv

    for make, symmetric in (
        (lambda d: ChebConv(d, 4, K=3), True),
        (lambda d: MixHopConv(d, 4, powers=[0, 1, 3]), False),
        (lambda d: ARMAConv(d, 4, num_stacks=2, num_layers=2), False),
    ):
        _, x, full_ei = local_graphs[symmetric]
        torch.manual_seed(0)
        module = make(x.shape[1]).eval()
        served = ServedModel(module)
        topo = CSRTopo.from_edge_index(full_ei, num_nodes=x.shape[0])
        with torch.no_grad():
            want = module(x, full_ei)
        diffs = []
        for short in (0, 1):
            sizes = [-1] * (served.num_layers - short + served.extra_hops)
            sampler = GraphSageSampler(topo, sizes, mode="CPU", seed=0, frontier=True)
            n_id, _, adjs = sampler.sample(torch.arange(0, x.shape[0], 9))
            with torch.no_grad():
                diffs.append(float((served(x[n_id], adjs) - want[::9]).abs().max()))
        assert diffs[0] < 1e-5 < diffs[1], (type(module).__name__, diffs)


@pytest.mark.parametrize("name", ["ChebConv", "MixHopConv", "ARMAConv"])
def test_torch_export_multi_hop_layer_counts_its_hops(local_graphs, tmp_path, name):
    """An exported multi-hop layer counts one hop per propagation and its degree hops
    (ChebConv's normalisation is its ``__norm__``: two) and equals its full-graph forward."""
    import torch_geometric.nn as pyg

    settings, hops, extra, symmetric = MULTI_HOP_MODELS[name]
    data, x, full_ei = local_graphs[symmetric]
    torch.manual_seed(0)
    model = getattr(pyg, name)(x.shape[1], 4, **settings).eval()
    pt2 = _export(model, x, full_ei, tmp_path / f"{name}.pt2")
    _, info = load_served_model(pt2)
    assert info["num_layers"] == hops and info["extra_hops"] == extra
    n = x.shape[0]
    cfg = ServeConfig(max_batch_nodes=n, max_request_nodes=n)
    nodes = list(range(0, n, 23))
    with Server.from_dataset(data, pt2, cfg, fanouts=[-1] * hops) as server:
        got = np.stack([server.predict([v], output="logits").values[0] for v in nodes])
    with torch.no_grad():
        want = model(x, full_ei).numpy()
    np.testing.assert_allclose(got, want[nodes], rtol=0, atol=1e-5)


def test_chebconv_on_a_directed_graph_says_it_is_not_exact(local_graphs, tmp_path):
    """ChebConv's Laplacian counts out-degrees, which a sample of in-neighbours holds only on
    a symmetric graph: on a directed one the start-up line and the log say the answers differ
    from the full graph (they do), on a symmetric one nothing is said."""
    from quiver.usermodel import graph_is_symmetric, import_factory, save_model

    spec = "torch_geometric.nn:ChebConv"
    kwargs = {"in_channels": DIM, "out_channels": 4, "K": 3}
    torch.manual_seed(0)
    model = import_factory(spec)(**kwargs).eval()
    ckpt = tmp_path / "cheb.pt"
    save_model(ckpt, model, spec, kwargs)
    assert load_served_model(ckpt, spec)[1]["out_degrees"]
    for symmetric in (False, True):
        data, x, full_ei = local_graphs[symmetric]
        assert graph_is_symmetric(CSRTopo.from_edge_index(full_ei, num_nodes=x.shape[0])) is (
            symmetric
        )
        with Server.from_dataset(data, ckpt, fanouts=[-1, -1], model=spec) as server:
            said = "sampled exactly only on a symmetric graph" in server.info
            got = np.stack([server.predict([v], output="logits").values[0] for v in (3, 150)])
        with torch.no_grad():
            want = model(x, full_ei).numpy()[[3, 150]]
        assert said is not symmetric
        assert (float(np.abs(got - want).max()) < 1e-5) is symmetric
