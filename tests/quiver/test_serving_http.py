"""The HTTP API over real loopback sockets: answers, every bad-input case, metrics, OpenAPI."""

import threading

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiver.serving import Engine, ServeConfig
from quiver.serving.app import create_app
from quiver.serving.client import Client, ServerError
from quiver.serving.http import HTTPThread


@pytest.fixture
def served(world):
    # no shedding: the clients share this process's GIL with the server, so its event loop
    # lags by design here; these tests check answers (shedding: test_serving_shed/engine)
    cfg = ServeConfig(max_request_nodes=50, shed_late=False)
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    yield world, eng, http
    http.stop()
    eng.stop()


def test_predict_matches_offline_and_client_round_trip(served):
    world, eng, http = served
    nodes = [5, 17, 5, 299]
    with Client(http.url) as c:
        body = c.predict(nodes, output="logits")
        assert body["nodes"] == nodes and body["output"] == "logits"
        np.testing.assert_allclose(np.array(body["values"]), world.offline(nodes), atol=1e-5)
        cls = c.predict(nodes)["values"]
        assert cls == world.offline(nodes).argmax(1).tolist()
        assert c.health()["status"] == "ok"


@pytest.mark.parametrize(
    "content,status,fragment",
    [
        (b'{"nodes": [1, 2', 400, "malformed JSON"),
        (b"[1, 2]", 422, "body"),
        (b'{"output": "class"}', 422, "missing field 'nodes'"),
        (b'{"nodes": [1, "two"]}', 422, "nodes"),
        (b'{"nodes": [1, 2.5]}', 422, "nodes"),
        (b'{"nodes": [1, true]}', 422, "nodes"),
        (b'{"nodes": "1,2"}', 422, "nodes"),
        (b'{"nodes": [300]}', 422, "out of range"),
        (b'{"nodes": [-1]}', 422, "negative"),
        (b'{"nodes": []}', 422, "empty"),
        (b'{"nodes": [1], "output": "probs"}', 422, "output"),
        (b'{"nodes": ' + str(list(range(51))).encode() + b"}", 422, "at most 50"),
    ],
)
def test_bad_input_is_a_4xx_json_error_and_serving_continues(served, content, status, fragment):
    world, eng, http = served
    r = httpx.post(
        f"{http.url}/v1/predict", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    ok = httpx.post(f"{http.url}/v1/predict", json={"nodes": [1]})
    assert ok.status_code == 200


def test_client_raises_server_error_with_message(served):
    _, _, http = served
    with Client(http.url) as c, pytest.raises(ServerError, match="out of range") as ei:
        c.predict([10_000])
    assert ei.value.status == 422


def test_many_concurrent_http_clients_get_their_own_answers(served):
    world, eng, http = served
    want = world.offline(range(world.n))
    bad, answered = [], []

    def worker(k):
        rng = np.random.default_rng(100 + k)
        with httpx.Client(base_url=http.url, timeout=30) as c:
            for _ in range(10):
                nodes = rng.choice(world.n, size=int(rng.integers(1, 12)), replace=False).tolist()
                r = c.post("/v1/predict", json={"nodes": nodes, "output": "logits"})
                if r.status_code != 200:
                    bad.append((nodes, r.status_code, r.text))
                    continue
                answered.append(nodes)
                if not np.allclose(np.array(r.json()["values"]), want[nodes], atol=1e-5):
                    bad.append((nodes, "wrong values"))

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not bad
    assert len(answered) == 60  # every worker finished all its requests


def test_metrics_parse_as_prometheus_text(served):
    _, _, http = served
    httpx.post(f"{http.url}/v1/predict", json={"nodes": [1, 2]})
    httpx.post(f"{http.url}/v1/predict", json={"nodes": [-5]})
    text = httpx.get(f"{http.url}/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "quiver_request_latency_seconds",
        "quiver_queue_depth",
        "quiver_overloaded",
        "quiver_batch_seed_nodes",
        "quiver_batches",
        "quiver_rejected_requests",
        "quiver_late_requests",
    ):
        assert name in fams, name
    assert fams["quiver_overloaded"].samples[0].value == 0.0  # two requests: no overload
    lanes = {s.labels["lane"]: s.value for s in fams["quiver_lane_batches"].samples}
    assert set(lanes) == {"fast", "split", "pipeline"} and sum(lanes.values()) >= 1
    lat = {s.name: s.value for s in fams["quiver_request_latency_seconds"].samples}
    assert lat["quiver_request_latency_seconds_count"] >= 1
    rejected = {
        s.labels["reason"]: s.value
        for s in fams["quiver_rejected_requests"].samples
        if s.name.endswith("_total")
    }
    assert rejected["invalid"] == 1


def test_openapi_schema_served(served):
    _, _, http = served
    schema = httpx.get(f"{http.url}/openapi.json").json()
    assert "/v1/predict" in schema["paths"]
    assert "PredictRequest" in schema["components"]["schemas"]


def test_unknown_route_and_method_are_json_errors(served):
    _, _, http = served
    r = httpx.get(f"{http.url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]
    r = httpx.get(f"{http.url}/v1/predict")
    assert r.status_code == 405 and r.json()["error"]
