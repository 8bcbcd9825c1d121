"""HTTP hardening: body-size limit (413), JSON nesting (400), ids past int64 (422), non-JSON
content type (415), and every error counted in /metrics by status; the server keeps serving."""

import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiver.serving import Engine, ServeConfig
from quiver.serving.app import create_app
from quiver.serving.http import HTTPThread

LIMIT = 4096


@pytest.fixture
def served(world):
    cfg = ServeConfig(max_request_nodes=50, shed_late=False, max_body_bytes=LIMIT)
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    yield eng, http
    http.stop()
    eng.stop()


def _still_serving(http):
    r = httpx.post(f"{http.url}/v1/predict", json={"nodes": [1, 2]})
    assert r.status_code == 200 and len(r.json()["values"]) == 2


def _errors(http) -> dict:
    text = httpx.get(f"{http.url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "quiver_http_errors":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["status"]] = s.value
    return out


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "content,headers,status,fragment",
    [
        (b'{"nodes":' + b"[" * 1000 + b"]" * 1000 + b"}", JSON, 400, "nested too deeply"),
        (b'{"nodes":' + b"[" * 100000 + b"]" * 100000 + b"}", JSON, 413, "too large"),
        (b'{"nodes": [' + b"1, " * 2000 + b"1]}", JSON, 413, f"at most {LIMIT} bytes"),
        (b'{"nodes": [9223372036854775808]}', JSON, 422, "9223372036854775808 is out of range"),
        (b'{"nodes": [18446744073709551616]}', JSON, 422, "18446744073709551616 is out of range"),
        (b'{"nodes": [1]}', {"content-type": "text/plain"}, 415, "content-type"),
        (b'{"nodes": [1]}', {}, 415, "content-type must be application/json"),
    ],
)
def test_bad_request_is_a_4xx_counted_and_serving_continues(
    served, content, headers, status, fragment
):
    eng, http = served
    before = _errors(http).get(str(status), 0)
    r = httpx.post(f"{http.url}/v1/predict", content=content, headers=headers)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    _still_serving(http)
    assert _errors(http)[str(status)] == before + 1


def test_oversized_body_is_refused_before_it_is_read(served):
    """A 413 arrives while most of the declared body is still unsent."""
    eng, http = served
    with socket.create_connection((http.host, http.port), timeout=10) as s:
        head = (
            "POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {100 * 1024 * 1024}\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"nodes": [')
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413") and "too large" in reply
    _still_serving(http)


def test_chunked_body_past_the_limit_is_413(served):
    eng, http = served

    def chunks():
        yield b'{"nodes": ['
        for _ in range(300):
            yield b"1, " * 10

    r = httpx.post(f"{http.url}/v1/predict", content=chunks(), headers=JSON)
    assert r.status_code == 413 and "too large" in r.json()["error"]
    _still_serving(http)
