"""Updates on a served homogeneous graph (issue 43 item 1, ``quiver.serving.live``).

The oracle is independent of Quiver's sampler: the test keeps its own edge list, feature rows
and edge feature rows, applies every update to them, and runs the user's PyG module on that
full graph. With all-neighbour fanouts every served logit must equal it, after each kind of
update, after a restart (log replay) and after ``quiver compact``; bf16 serving agrees on the
argmax. Hostile updates are refused with nothing logged; a SIGKILL mid-stream loses no
acknowledged update."""

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from quiver.cli import main as cli_main
from quiver.datasets import load_prepared
from quiver.hetero.updates import UpdateError
from quiver.serving import ServeConfig
from quiver.serving.server import Server
from quiver.usermodel import import_factory, save_model

N, DIM, EDIM, CLASSES, E = 50, 6, 3, 4, 200

FACTORIES = """
from torch import nn
from torch_geometric.nn import GATConv, GCNConv, GINEConv, SAGEConv

DIM, EDIM, CLASSES, HID = 6, 3, 4, 8


class SAGE(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = SAGEConv(DIM, HID)
        self.c2 = SAGEConv(HID, CLASSES)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = GCNConv(DIM, HID)
        self.c2 = GCNConv(HID, CLASSES)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


class GAT(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = GATConv(DIM, HID, heads=2)
        self.c2 = GATConv(2 * HID, CLASSES)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


class GINE(nn.Module):
    def __init__(self):
        super().__init__()
        mlp = nn.Sequential(nn.Linear(DIM, HID), nn.ReLU(), nn.Linear(HID, HID))
        self.c1 = GINEConv(mlp, edge_dim=EDIM)
        self.c2 = GINEConv(nn.Linear(HID, CLASSES), edge_dim=EDIM)

    def forward(self, x, edge_index, edge_attr):
        return self.c2(self.c1(x, edge_index, edge_attr).relu(), edge_index, edge_attr)
"""
SPEC = "quiver_live_factories:{}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("live")
    (d / "quiver_live_factories.py").write_text(textwrap.dedent(FACTORIES))
    sys.path.insert(0, str(d))
    rng = np.random.default_rng(0)
    edges = rng.integers(0, N, (E, 2))
    edges[:4] = edges[4:8]  # repeated edges, each with its own features
    np.save(d / "edges.npy", edges)
    np.save(d / "x.npy", rng.standard_normal((N, DIM)).astype(np.float32))
    np.save(d / "ea.npy", rng.standard_normal((E, EDIM)).astype(np.float32))
    ckpts, modules = {}, {}
    for name in ("SAGE", "GCN", "GAT", "GINE"):
        torch.manual_seed(1)
        modules[name] = import_factory(SPEC.format(name))().eval()
        ckpts[name] = d / f"{name}.pt"
        save_model(ckpts[name], modules[name], SPEC.format(name), fanouts=[-1, -1])
    yield {"dir": d, "ckpts": ckpts, "modules": modules}
    sys.path.remove(str(d))


def _prepare(world, out):
    d = world["dir"]
    argv = ["prepare", "--edges", str(d / "edges.npy"), "--features", str(d / "x.npy")]
    argv += ["--edge-features", str(d / "ea.npy"), "--out", str(out), "--no-progress"]
    assert cli_main(argv) == 0
    return out


class Oracle:
    """The graph as the test believes it is: edges in a list, rows in tensors."""

    def __init__(self, world):
        d = world["dir"]
        self.edges = [tuple(e) for e in np.load(d / "edges.npy").tolist()]
        self.ea = [torch.from_numpy(r) for r in np.load(d / "ea.npy")]
        self.x = torch.from_numpy(np.load(d / "x.npy"))
        self.modules = world["modules"]

    def apply(self, u: dict) -> None:
        op = u["op"]
        if op == "set_features":
            self.x[u["ids"]] = torch.tensor(u["features"])
        elif op == "add_nodes":
            self.x = torch.cat([self.x, torch.tensor(u["features"])])
        elif op == "add_edges":
            self.edges += list(zip(u["src"], u["dst"], strict=True))
            self.ea += [torch.tensor(r) for r in u["edge_features"]]
        else:  # remove_edges takes every copy of (src, dst)
            gone = set(zip(u["src"], u["dst"], strict=True))
            keep = [i for i, e in enumerate(self.edges) if e not in gone]
            self.edges = [self.edges[i] for i in keep]
            self.ea = [self.ea[i] for i in keep]

    def logits(self, name: str) -> np.ndarray:
        ei = torch.tensor(self.edges, dtype=torch.int64).T.contiguous()
        with torch.inference_mode():
            if name == "GINE":
                return self.modules[name](self.x, ei, torch.stack(self.ea)).numpy()
            return self.modules[name](self.x, ei).numpy()


def _cfg():
    return ServeConfig(max_batch_nodes=256, max_request_nodes=256, max_wait_ms=0.5)


def _serve(world, data, name, **kw):
    return Server.from_dataset(
        data, world["ckpts"][name], _cfg(), seed=0, model=SPEC.format(name), updates=True, **kw
    )


def _logits(server) -> np.ndarray:
    n = server.engine.node_count
    return server.predict(list(range(n)), output="logits").values


UPDATES = [
    {"op": "set_features", "ids": [3, 7], "features": [[0.5] * DIM, [-1.0] * DIM]},
    {"op": "add_nodes", "features": [[0.25] * DIM, [1.5] * DIM]},  # ids 50, 51
    {
        "op": "add_edges",
        "src": [50, 51, 5, 3],
        "dst": [3, 50, 51, 3],
        "edge_features": [[0.1, 0.2, 0.3], [1.0, 0.0, -1.0], [0.0, 2.0, 0.0], [0.3, 0.3, 0.3]],
    },
    {"op": "remove_edges", "edge_type": "node__to__node"},  # src, dst filled in below
    {"op": "set_features", "ids": [50], "features": [[-0.75] * DIM]},
]


CASES = [("SAGE", "off"), ("GINE", "off"), ("SAGE", "on"), ("GCN", "on"), ("GAT", "on")]


@pytest.mark.parametrize("name,fold", CASES, ids=[f"{n}-fold-{f}" for n, f in CASES])
def test_every_kind_of_update_is_exact_then_after_restart_and_compaction(
    world, tmp_path, name, fold
):
    """Folded (the first layer's tables updated with the rows) or not, every answer equals
    the module on the oracle's full graph."""
    data = _prepare(world, tmp_path / "g")
    oracle = Oracle(world)
    victim = oracle.edges[20]  # a base edge to remove (every copy of it)
    with _serve(world, data, name, fold=fold) as server:
        assert "updates on" in server.info
        assert ("first layer folded" in server.info) == (fold == "on"), server.info
        np.testing.assert_allclose(_logits(server), oracle.logits(name), atol=1e-5)
        for u in UPDATES:
            if u["op"] == "remove_edges":
                u = {**u, "src": [int(victim[0])], "dst": [int(victim[1])]}
            out = server.update(u)
            oracle.apply(u)
            if u["op"] == "add_nodes":
                assert out["ids"] == [N, N + 1]
            np.testing.assert_allclose(_logits(server), oracle.logits(name), atol=1e-5)
        before = _logits(server)
    with _serve(world, data, name, fold=fold) as server:  # the log replayed
        assert "replayed to seq 5" in server.info
        np.testing.assert_allclose(_logits(server), before, atol=0)
    assert cli_main(["compact", str(data)]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["data"] == "gen-5" and manifest["compacted_seq"] == 5
    assert (data / "updates.log").read_bytes() == b""
    assert not (data / "features.npy").exists()  # the old generation is gone
    ds = load_prepared(data)
    assert ds.num_nodes == N + 2 and ds.topo.edge_count == len(oracle.edges)
    with _serve(world, data, name, fold=fold) as server:  # the compacted files, no replay
        assert "replayed to seq 5" in server.info
        np.testing.assert_allclose(_logits(server), oracle.logits(name), atol=1e-5)
        server.update({"op": "add_edges", "src": [1], "dst": [2], "edge_features": [[1.0] * 3]})
        oracle.apply({"op": "add_edges", "src": [1], "dst": [2], "edge_features": [[1.0] * 3]})
        np.testing.assert_allclose(_logits(server), oracle.logits(name), atol=1e-5)


def test_a_graph_without_updates_samples_as_the_read_only_server(world, tmp_path):
    """Fanouts below the degrees: the live sampler draws the read-only sampler's streams."""
    data = _prepare(world, tmp_path / "g")
    spec, ckpt = SPEC.format("SAGE"), world["ckpts"]["SAGE"]
    kw = dict(fanouts=[2, 2], seed=5, model=spec, hybrid=False)
    with Server.from_dataset(data, ckpt, _cfg(), **kw) as plain:
        want = [plain.predict([v], output="logits").values for v in range(N)]
    with Server.from_dataset(data, ckpt, _cfg(), updates=True, **kw) as live:
        got = [live.predict([v], output="logits").values for v in range(N)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))


def test_bf16_serving_casts_updated_rows_and_agrees_on_the_argmax(world, tmp_path):
    data = _prepare(world, tmp_path / "g")
    oracle = Oracle(world)
    with _serve(world, data, "SAGE", precision="bf16") as server:
        assert "gather bf16" in server.info
        for u in UPDATES[:3]:
            server.update(u)
            oracle.apply(u)
        got = _logits(server)
    want = oracle.logits("SAGE")
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.95
    np.testing.assert_allclose(got, want, atol=0.1)


def test_the_fap_cache_serves_updated_rows_from_host_memory(world, tmp_path):
    data = _prepare(world, tmp_path / "g")
    oracle = Oracle(world)
    cache = 20 * DIM * 4  # 20 of the 50 rows in the cache
    with _serve(world, data, "SAGE", feature_cache=cache) as server:
        for u in UPDATES[:3]:
            server.update(u)
            oracle.apply(u)
        np.testing.assert_allclose(_logits(server), oracle.logits("SAGE"), atol=1e-5)


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_bf16_folded_tables_follow_updates_as_a_fresh_fold_would(world, tmp_path, stored):
    """bf16 rows and bf16 folded tables: after the updates the answers equal a server
    started (read-only) on the compacted graph, whose fold saw the updated rows from the
    start (stored in fp32, or rounded to bf16 in a bf16-stored dataset)."""
    from quiver.datasets.prepared import convert_features

    data = _prepare(world, tmp_path / "g")
    convert_features(data, stored)
    kw = dict(precision="bf16", fold="on")
    odd = [[0.1 + 0.013 * i for i in range(DIM)]]  # not bf16 numbers: rounded when stored
    with _serve(world, data, "SAGE", **kw) as server:
        for u in [*UPDATES[:3], {"op": "set_features", "ids": [4], "features": odd}]:
            server.update(u)
        got = _logits(server)
    assert cli_main(["compact", str(data)]) == 0
    spec, ckpt = SPEC.format("SAGE"), world["ckpts"]["SAGE"]
    with Server.from_dataset(data, ckpt, _cfg(), seed=0, model=spec, **kw) as fresh:
        assert "first layer folded" in fresh.info and "bf16" in fresh.info
        want = _logits(fresh)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_feature_shards_are_refused_with_updates_and_a_directory_has_one_server(world, tmp_path):
    data = _prepare(world, tmp_path / "g")
    with pytest.raises(ValueError, match="serves read-only: add --read-only"):
        _serve(world, data, "SAGE", peers=object())
    with _serve(world, data, "SAGE"):
        with pytest.raises(ValueError, match="in use by pid"):
            _serve(world, data, "SAGE")


HOSTILE = [
    ({"op": "add_edges", "src": [1.5], "dst": [2], "edge_features": [[0.0] * 3]}, "integer ids"),
    ({"op": "add_edges", "src": ["1"], "dst": [2], "edge_features": [[0.0] * 3]}, "integer ids"),
    ({"op": "add_edges", "src": [True], "dst": [2], "edge_features": [[0.0] * 3]}, "integer"),
    ({"op": "add_edges", "src": [1], "dst": [N], "edge_features": [[0.0] * 3]}, "not in"),
    ({"op": "add_edges", "src": [1], "dst": [2]}, "edge_features"),
    ({"op": "add_edges", "src": [1], "dst": [2], "edge_features": [[0.0] * 2]}, r"\[1, 3\]"),
    ({"op": "set_features", "ids": [1], "features": [[float("nan")] * DIM]}, "finite"),
    ({"op": "set_features", "ids": [1], "features": [[0.0] * (DIM + 1)]}, "must be"),
    ({"op": "set_features", "ids": [1, 1], "features": [[0.0] * DIM] * 2}, "repeated"),
    ({"op": "add_nodes", "features": [["1"] * DIM]}, "numbers"),
    ({"op": "add_nodes", "count": 2}, "need 'features'"),
    ({"op": "add_nodes", "node_type": "paper", "features": [[0.0] * DIM]}, "unknown node type"),
    ({"op": "remove_edges", "src": [0], "dst": [0]}, "no edge"),
    ({"op": "drop_graph"}, "unknown op"),
    ({"op": "set_features", "ids": [1], "features": [[0.0] * DIM], "x": 1}, "unknown field"),
]


@pytest.mark.parametrize("update,match", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_updates_are_refused_and_nothing_is_logged(world, tmp_path, update, match):
    data = _prepare(world, tmp_path / "g")
    with _serve(world, data, "SAGE") as server:
        if update["op"] == "remove_edges":  # make sure 0 -> 0 is not an edge
            assert 0 not in server.live.rels[("node", "to", "node")].row(0)[0].tolist()
        with pytest.raises(UpdateError, match=match):
            server.update(update)
        assert server.live.seq == 0
    assert not (data / "updates.log").exists() or (data / "updates.log").read_bytes() == b""


def test_http_update_needs_the_token_and_healthz_follows(world, tmp_path, monkeypatch):
    import httpx

    data = _prepare(world, tmp_path / "g")
    cfg = ServeConfig(max_batch_nodes=256, max_request_nodes=256, auth_token="s3cret")
    spec, ckpt = SPEC.format("SAGE"), world["ckpts"]["SAGE"]
    server = Server.from_dataset(data, ckpt, cfg, seed=0, model=spec, updates=True)
    with server.start(port=0):
        url = server.url
        u = {"op": "add_nodes", "features": [[0.0] * DIM]}
        r = httpx.post(f"{url}/v1/update", json=u)
        assert r.status_code == 401 and server.live.seq == 0
        r = httpx.post(f"{url}/v1/update", json=u, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and server.live.seq == 0
        auth = {"Authorization": "Bearer s3cret"}
        r = httpx.post(f"{url}/v1/update", json=u, headers=auth)
        assert r.status_code == 200 and r.json()["ids"] == [N]
        big = {"op": "add_nodes", "features": [[0.0] * DIM] * 60000}  # over 1 MiB
        r = httpx.post(f"{url}/v1/update", json=big, headers=auth)
        assert r.status_code == 413 and server.live.seq == 1
        r = httpx.post(f"{url}/v1/update", json={"op": "add_nodes"}, headers=auth)
        assert r.status_code == 422
        health = httpx.get(f"{url}/healthz").json()
        assert health["node_count"] == N + 1 and health["update_seq"] == 1
        assert health["edge_count"] == E and health["update_log_records"] == 1
        r = httpx.post(f"{url}/v1/predict", json={"nodes": [N]})  # the new node is served
        assert r.status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        assert f'quiver_graph_nodes{{node_type="node"}} {N + 1}' in metrics
        assert "quiver_update_log_records 1" in metrics


def test_a_read_only_server_answers_403_naming_why(world, tmp_path):
    import httpx

    data = _prepare(world, tmp_path / "g")
    spec, ckpt = SPEC.format("SAGE"), world["ckpts"]["SAGE"]
    with Server.from_dataset(data, ckpt, _cfg(), model=spec).start(port=0) as server:
        r = httpx.post(f"{server.url}/v1/update", json={"op": "add_nodes"})
        assert r.status_code == 403 and "read-only" in r.json()["error"]


def test_open_host_with_updates_and_no_token_refuses_to_start(world, tmp_path, capsys):
    data = _prepare(world, tmp_path / "g")
    argv = ["serve", str(data), "--checkpoint", str(world["ckpts"]["SAGE"])]
    argv += ["--model", SPEC.format("SAGE"), "--host", "0.0.0.0", "--port", "0"]
    assert cli_main(argv) != 0
    err = capsys.readouterr().err
    assert "--auth-token-file" in err and "--read-only" in err
    assert len(err.strip().splitlines()) == 1


def test_sigkill_mid_stream_loses_no_acknowledged_update(world, tmp_path):
    import httpx

    from quiver.serving.http import free_port

    data = _prepare(world, tmp_path / "g")
    port = free_port()
    cmd = [sys.executable, "-m", "quiver.cli", "serve", str(data), "--checkpoint",
           str(world["ckpts"]["SAGE"]), "--model", SPEC.format("SAGE"), "--port", str(port),
           "--seed", "0", "--no-shed"]  # fmt: skip
    env_path = str(world["dir"])
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([env_path, *sys.path])}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.3)
    acked, unanswered = [], None
    rng = np.random.default_rng(3)
    killer = threading.Timer(1.0, proc.kill)  # SIGKILL while updates stream in
    killer.start()
    with httpx.Client(timeout=10) as c:
        for i in range(100000):
            row = rng.standard_normal((1, DIM)).round(3).tolist()
            u = {"op": "add_nodes", "features": row} if i % 2 else {
                "op": "set_features", "ids": [i % N], "features": row}  # fmt: skip
            try:
                r = c.post(f"{url}/v1/update", json=u)
            except httpx.TransportError:
                unanswered = u  # logged or not: either is right, it was never acknowledged
                break
            assert r.status_code == 200, r.text
            acked.append((u, r.json()))
    proc.wait(30)
    killer.cancel()
    assert len(acked) >= 5, "too few updates before the kill to test anything"
    with _serve(world, data, "SAGE") as server:
        live = server.live
        assert live.seq >= len(acked)  # the one in flight may have been logged, unanswered
        want = {}
        for u, out in acked:
            ids = out["ids"]
            for v, row in zip(ids, u["features"], strict=True):
                want[v] = row
        if unanswered is not None and unanswered["op"] == "set_features" and live.seq > len(acked):
            want[unanswered["ids"][0]] = unanswered["features"][0]  # it was logged: replayed
        ids = sorted(want)
        got = live.features["node"].gather(torch.tensor(ids)).numpy()
        np.testing.assert_allclose(got, np.array([want[v] for v in ids]), atol=1e-6)
