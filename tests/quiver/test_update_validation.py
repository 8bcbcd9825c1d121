# ruff: noqa: E501  (tables of update bodies read best one per line)
"""Strict update validation (issue 43 item 2): the hostile inputs ``/v1/predict`` refuses are
refused by ``/v1/update`` too, with nothing logged; the documented body limit; no featureless
nodes past the model's embedding rows; live counts in ``/healthz`` and ``/metrics``."""

from __future__ import annotations

import httpx
import pytest
from hetero_cases import FACTORY, mag_sage

from quiver.hetero import HeteroServer
from quiver.hetero.updates import LOG_FILE
from quiver.serving.config import ServeConfig

ROOM = 4  # embedding rows beyond the graph's authors: room for 4 new ones
LIMIT = 8192


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for every test here (start-up is the slow part)."""
    g, d, _, _, ckpt = mag_sage(tmp_path_factory.mktemp("val"), room=ROOM)
    srv = HeteroServer.from_dataset(
        d, ckpt, ServeConfig(max_body_bytes=LIMIT), model=FACTORY, seed=0
    )
    srv.start(port=0)
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield g, d, srv, client
    srv.stop()


def _log(d) -> bytes:
    path = d / LOG_FILE
    return path.read_bytes() if path.exists() else b""


W = 128  # paper feature width


def _set_row(value: str) -> str:
    """A set_features body whose one paper row is ``value`` W times (raw JSON text)."""
    row = ", ".join([value] * W)
    return f'{{"op": "set_features", "node_type": "paper", "ids": [0], "features": [[{row}]]}}'


HOSTILE = [
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": [1.5], "dst": [2]}',
        422,
        "integer ids",
    ),
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": ["1"], "dst": [2]}',
        422,
        "integer ids",
    ),
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": [true], "dst": [2]}',
        422,
        "integer ids",
    ),
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": 1, "dst": 2}',
        422,
        "integer ids",
    ),
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": [1], "dst": [100000]}',
        404,
        "not in",
    ),
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": [-1], "dst": [2]}',
        404,
        "not in",
    ),
    (
        '{"op": "add_edges", "edge_type": "paper__cites__paper", "src": [99999999999999999999], "dst": [2]}',
        422,
        "int64",
    ),
    (
        '{"op": "remove_edges", "edge_type": "paper__cites__paper", "src": [1.0], "dst": [2]}',
        422,
        "integer ids",
    ),
    (
        '{"op": "set_features", "node_type": "paper", "ids": [2.0], "features": [[0]]}',
        422,
        "integer ids",
    ),
    (
        '{"op": "set_features", "node_type": "paper", "ids": [0], "features": [[0, 1]]}',
        422,
        "must be [1, 128]",
    ),
    (_set_row("NaN"), 422, "finite"),
    (_set_row("Infinity"), 422, "finite"),
    (_set_row('"1.5"'), 422, "rows of numbers"),
    (_set_row("true"), 422, "rows of numbers"),
    ('{"op": "add_nodes", "node_type": "paper", "features": [[1, 2], [3]]}', 422, "features"),
    ('{"op": "add_nodes", "node_type": "author", "count": 1.0}', 422, "positive integer"),
    ('{"op": "add_nodes", "node_type": "author", "count": true}', 422, "positive integer"),
    ('{"op": "add_nodes", "node_type": "nobody", "count": 1}', 422, "unknown node type"),
    ('{"op": "drop_table"}', 422, "unknown op"),
    ("[1, 2]", 422, "JSON object"),
    ("{not json", 400, ""),
]


@pytest.mark.parametrize("body,status,message", HOSTILE)
def test_hostile_updates_are_refused_and_nothing_is_logged(served, body, status, message):
    g, d, srv, client = served
    before, seq = _log(d), srv.live.seq
    r = client.post("/v1/update", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert _log(d) == before and srv.live.seq == seq


def test_the_body_limit_is_the_documented_one(served):
    g, d, srv, client = served
    before = _log(d)
    n = LIMIT // 2  # a valid update over the limit ("1," and "2," per edge: 4 bytes)
    body = {"op": "add_edges", "edge_type": "paper__cites__paper", "src": [1] * n, "dst": [2] * n}
    r = client.post("/v1/update", json=body)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]
    assert _log(d) == before


def test_featureless_nodes_past_the_embedding_rows_are_refused(served):
    g, d, srv, client = served
    # author: no features; the model embeds num_nodes + ROOM of them
    left = ROOM - (srv.live.num_nodes["author"] - g.num_nodes["author"])
    before = _log(d)
    r = client.post(
        "/v1/update", json={"op": "add_nodes", "node_type": "author", "count": left + 1}
    )
    assert r.status_code == 409
    assert "'author'" in r.json()["error"] and f"room for {left} more" in r.json()["error"]
    assert _log(d) == before
    # what fits is taken, and the new nodes are served (predict touching them works)
    r = client.post("/v1/update", json={"op": "add_nodes", "node_type": "author", "count": left})
    assert r.status_code == 200, r.text
    new = r.json()["ids"]
    r = client.post(
        "/v1/update",
        json={
            "op": "add_edges",
            "edge_type": "author__writes__paper",
            "src": new,
            "dst": [0] * len(new),
        },
    )
    assert r.status_code == 200, r.text
    assert (
        client.post("/v1/predict", json={"node_type": "paper", "nodes": [0, 1]}).status_code == 200
    )
    r = client.post("/v1/update", json={"op": "add_nodes", "node_type": "author", "count": 1})
    assert r.status_code == 409 and "room for 0 more" in r.json()["error"]


def test_healthz_and_metrics_follow_updates(served):
    g, d, srv, client = served
    h0 = client.get("/healthz").json()
    r = client.post(
        "/v1/update", json={"op": "add_nodes", "node_type": "paper", "features": [[0.5] * W] * 2}
    )
    assert r.status_code == 200, r.text
    new = r.json()["ids"]
    r = client.post(
        "/v1/update",
        json={"op": "add_edges", "edge_type": "paper__cites__paper", "src": new, "dst": [0, 1]},
    )
    assert r.status_code == 200
    h1 = client.get("/healthz").json()
    assert h1["node_types"]["paper"] == h0["node_types"]["paper"] + 2
    assert h1["edge_types"]["paper__cites__paper"] == h0["edge_types"]["paper__cites__paper"] + 2
    assert h1["update_log_records"] == h0["update_log_records"] + 2 == srv.live.seq
    r = client.post(
        "/v1/update",
        json={
            "op": "remove_edges",
            "edge_type": "paper__cites__paper",
            "src": [new[0]],
            "dst": [0],
        },
    )
    assert r.status_code == 200
    h2 = client.get("/healthz").json()
    assert h2["edge_types"]["paper__cites__paper"] == h1["edge_types"]["paper__cites__paper"] - 1
    full = srv.live.materialise()
    assert (
        h2["edge_types"]["paper__cites__paper"]
        == full.relations[("paper", "cites", "paper")].indices.shape[0]
    )
    text = client.get("/metrics").text
    assert f'quiver_graph_nodes{{node_type="paper"}} {h2["node_types"]["paper"]}' in text
    assert f"quiver_update_log_records {h2['update_log_records']}" in text
