"""A client that disconnects while sending its body (a slow upload cut short) costs the
server one log line at most: no traceback, no error logged, and the server keeps answering."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hetero_cases import FACTORY, mag_sage

from quiver.hetero import HeteroServer
from quiver.hetero.server import create_hetero_app
from quiver.serving.config import ServeConfig


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    _, d, _, _, ckpt = mag_sage(tmp_path_factory.mktemp("disconnect"))
    with HeteroServer.from_dataset(d, ckpt, ServeConfig(), model=FACTORY, seed=0) as srv:
        yield create_hetero_app(srv)


def _call(app, path: str, chunks: list[bytes], disconnect: bool) -> list[dict]:
    """Run one request through the ASGI app: the body in ``chunks``, then (with
    ``disconnect``) the client goes away instead of sending the rest."""
    events = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    events.append(
        {"type": "http.disconnect"}
        if disconnect
        else {"type": "http.request", "body": b"", "more_body": False}
    )
    sent: list[dict] = []

    async def receive():
        if events:
            return events.pop(0)
        await asyncio.sleep(3600)  # nothing more comes

    async def send(msg):
        sent.append(msg)

    declared = sum(len(c) for c in chunks) + (100 if disconnect else 0)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(declared).encode()),
        ],
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    return sent


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/predict", {"node_type": "paper", "nodes": [0, 1, 2]}),
        ("/v1/update", {"op": "add_edges", "edge_type": ["paper", "cites", "paper"]}),
    ],
)
def test_a_disconnect_mid_body_logs_one_line_and_no_traceback(app, caplog, path, body):
    raw = json.dumps(body).encode()
    caplog.set_level(logging.DEBUG)
    sent = _call(app, path, [raw[:10]], disconnect=True)  # no exception reaches the server
    records = [r for r in caplog.records if "disconnect" in r.getMessage().lower()]
    assert len(records) <= 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert not starts or starts[0]["status"] == 499  # an answer no one reads, if any
    if path == "/v1/predict":  # the next request is answered as before
        (start, *_) = [m for m in _call(app, path, [raw], disconnect=False) if "status" in m]
        assert start["status"] == 200
