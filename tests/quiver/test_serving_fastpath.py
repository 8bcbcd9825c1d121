"""The plain-ASGI prediction route: answers well-formed requests itself, hands the rest over."""

import asyncio
import json

import numpy as np
import pytest

from quiver.serving import Engine, ServeConfig
from quiver.serving.fastpath import PredictFastPath, dumps, parse


@pytest.mark.parametrize(
    "body,want",
    [
        (b'{"nodes": [1, 2, 3]}', ([1, 2, 3], "class")),
        (b'{"nodes": [4], "output": "logits"}', ([4], "logits")),
        (b'{"nodes": [1, true]}', None),  # bool: the schema's StrictInt refuses it
        (b'{"nodes": [1.0]}', None),
        (b'{"nodes": "12"}', None),
        (b'{"nodes": [1], "extra": 1}', None),
        (b'{"nodes": [1], "output": "probs"}', None),
        (b'{"nodes": [1]', None),
        (b"[1, 2]", None),
        (b"", None),
    ],
)
def test_parse_accepts_only_well_formed_bodies(body, want):
    assert parse(body) == want


def test_dumps_writes_standard_json_for_non_finite_values():
    out = json.loads(dumps({"values": [[1.5, float("nan")], [float("inf"), 2.0]], "late": False}))
    assert out == {"values": [[1.5, None], [None, 2.0]], "late": False}


def _call(app, body_chunks, content_type=b"application/json", path="/v1/predict"):
    """Drive an ASGI app with one request; returns (status, body bytes)."""
    msgs = [
        {"type": "http.request", "body": c, "more_body": i < len(body_chunks) - 1}
        for i, c in enumerate(body_chunks)
    ]
    sent = []

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", content_type)],
    }
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


class _Inner:
    """Stands in for the FastAPI app: records what it was handed and answers 299."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"inner"})


@pytest.fixture
def engine(world):
    eng = Engine(world.sampler, world.x, world.model, world.n, ServeConfig(max_request_nodes=8))
    eng.start()
    yield eng
    eng.stop()


def test_well_formed_request_is_answered_without_the_app(world, engine):
    inner = _Inner()
    app = PredictFastPath(inner, engine)
    status, body = _call(app, [b'{"nodes": [5, 17', b', 5], "output": "logits"}'])
    assert status == 200 and inner.bodies == []
    out = json.loads(body)
    assert out["nodes"] == [5, 17, 5] and out["output"] == "logits"
    np.testing.assert_allclose(np.array(out["values"]), world.offline([5, 17, 5]), atol=1e-5)


@pytest.mark.parametrize(
    "chunks,content_type",
    [
        ([b'{"nodes": [1, true]}'], b"application/json"),
        ([b'{"nodes": ', b"[1], ", b'"x": 2}'], b"application/json"),  # replayed in pieces
        ([b'{"nodes": [1, ', b" " * 4000, b"1.5]}"], b"application/json"),  # long, a bad id
    ],
)
def test_anything_else_reaches_the_app_with_its_body_intact(engine, chunks, content_type):
    inner = _Inner()
    status, body = _call(PredictFastPath(inner, engine), chunks, content_type)
    assert (status, body) == (299, b"inner")
    assert inner.bodies == [b"".join(chunks)]


def test_too_many_ids_is_a_422_from_their_count_alone(engine):
    """More ids than ``max_request_nodes`` (8 here): refused on the list's length, without the
    full app and without checking each id (a bad id among them does not matter)."""
    inner = _Inner()
    status, body = _call(
        PredictFastPath(inner, engine), [b'{"nodes": [' + b"1, " * 400 + b"true]}"]
    )
    assert status == 422 and inner.bodies == []
    assert json.loads(body)["error"] == "request names 401 nodes; at most 8 are allowed"


def test_engine_outcomes_map_to_statuses(engine):
    app = PredictFastPath(_Inner(), engine)
    status, body = _call(app, [b'{"nodes": [1000000]}'])
    assert status == 422 and "out of range" in json.loads(body)["error"]
    engine.stop()
    status, body = _call(app, [b'{"nodes": [1]}'])
    assert status == 503 and "error" in json.loads(body)


def test_other_routes_pass_through(engine):
    inner = _Inner()
    assert _call(PredictFastPath(inner, engine), [b"{}"], path="/healthz")[0] == 299


def test_overloaded_engine_refuses_before_parsing(world):
    # not started: nothing drains the queue, so it fills after two requests
    cfg = ServeConfig(queue_capacity=2)
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.submit([1])
    eng.submit([2])
    inner = _Inner()
    status, body = _call(PredictFastPath(inner, eng), [b'{"nodes": [1, true]}'])
    assert status == 429 and "queue full" in json.loads(body)["error"]
    assert inner.bodies == []  # refused before parsing: even a malformed body gets the 429
