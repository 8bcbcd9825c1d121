"""HTTP hardening: body-size limit (413), JSON nesting (400), ids past int64 (422), non-JSON
content type (415), unknown fields (422), half-sent requests (408, and a prompt stop), /docs off
by default, cheap refusals (no 429s for the valid requests after a bad one), and every error
counted in /metrics by status; the server keeps serving."""

import socket
import time

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
    eng.warmup()  # numba loads its kernels here, not in a timed request
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


# ---- /docs offline ---------------------------------------------------------------------------
def test_docs_off_by_default_openapi_still_served(served):
    """/docs is off by default (--docs turns it on: tests/quiver/test_docs_offline.py)."""
    eng, http = served
    assert httpx.get(f"{http.url}/docs").status_code == 404
    assert httpx.get(f"{http.url}/redoc").status_code == 404
    schema = httpx.get(f"{http.url}/openapi.json").json()
    assert "/v1/predict" in schema["paths"]


def test_docs_flag_turns_the_pages_on(world):
    eng = Engine(world.sampler, world.x, world.model, world.n, ServeConfig(docs=True))
    app = create_app(eng)
    assert {"/docs", "/redoc", "/docs/static", "/openapi.json"} <= {r.path for r in app.routes}


def test_unknown_field_is_a_422_naming_it(served):
    eng, http = served
    r = httpx.post(f"{http.url}/v1/predict", json={"nodes": [1], "outptu": "logits"})
    assert r.status_code == 422 and "unknown field 'outptu'" in r.json()["error"]


# ---- read timeout and a bounded stop ---------------------------------------------------------
HEAD = (
    b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: 100\r\n\r\n"
)


def _half_sent(http, n):
    """``n`` connections: even ones sent their headers and part of the body, odd ones part of
    their headers; none sends more."""
    socks = []
    for i in range(n):
        s = socket.create_connection((http.host, http.port), timeout=10)
        s.sendall(HEAD + b'{"nodes": [1' if i % 2 == 0 else HEAD[:40])
        socks.append(s)
    return socks


def _reply(s) -> bytes:
    """What the server sent before closing (b"" when it closed without a word)."""
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except OSError:
        pass
    s.close()
    return data


def test_half_sent_requests_get_408_and_the_connection_closes(world):
    cfg = ServeConfig(read_timeout_s=0.5, shed_late=False)
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.warmup()  # numba loads its kernels here, not in a timed request
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    try:
        socks = _half_sent(http, 10)
        idle = socket.create_connection((http.host, http.port), timeout=10)
        t0 = time.monotonic()
        replies = [_reply(s) for s in socks]
        assert time.monotonic() - t0 < 3
        for i, r in enumerate(replies):
            assert r.startswith(b"HTTP/1.1 408"), r
            assert (b"body" if i % 2 == 0 else b"headers") in r and b"within 0.5 s" in r
        assert _reply(idle) == b""  # an idle connection is just closed
        _still_serving(http)
        assert _errors(http)["408"] == 10
    finally:
        http.stop()
        eng.stop()


def test_stop_does_not_wait_for_half_sent_bodies(world):
    """20 clients stuck mid-request (read timeout 5 s): the stop answers the bodies 503, closes
    the rest, and returns well before any timeout (it once took 11 s)."""
    eng = Engine(world.sampler, world.x, world.model, world.n, ServeConfig(shed_late=False))
    eng.warmup()  # numba loads its kernels here, not in a timed request
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    socks = _half_sent(http, 20)
    _still_serving(http)
    t0 = time.monotonic()
    http.stop()
    took = time.monotonic() - t0
    eng.stop()
    assert took < 2.0, took
    replies = [_reply(s) for s in socks]
    assert all(r.startswith(b"HTTP/1.1 503") for r in replies[0::2]), replies[0]
    assert all(r == b"" for r in replies[1::2])


@pytest.mark.slow  # a `quiver serve` process: ~10 s of start-up on a busy 2-core machine
def test_sigterm_with_half_sent_bodies_exits_promptly(tmp_path):
    """``quiver serve`` under SIGTERM with 20 half-sent requests: drains and exits 0 in < 3 s."""
    import signal

    from quiver.datasets import synthetic
    from quiver.models import ModelConfig, build_model, save_checkpoint
    from quiver.serving.client import wait_until_ready
    from quiver.serving.http import spawn_serve

    synthetic("tiny", seed=0, out=tmp_path)
    ckpt = tmp_path / "m.pt"
    save_checkpoint(ckpt, build_model(ModelConfig("sage", 8, 4, 8, 2)), {"fanouts": [3, 2]})
    proc, url = spawn_serve(tmp_path, ckpt)
    try:
        wait_until_ready(url, proc=proc, timeout=60)
        host, port = url.removeprefix("http://").split(":")
        http = type("Addr", (), {"host": host, "port": int(port)})
        socks = _half_sent(http, 20)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        took = time.monotonic() - t0
        assert rc == 0 and took < 3.0, (rc, took)
        replies = [_reply(s) for s in socks]
        assert all(r.startswith(b"HTTP/1.1 503") for r in replies[0::2]), replies[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- refusing is cheap: the valid requests after a bad one are not shed ----------------------
def _raw_post(http, body: bytes, length: int | None = None) -> bytes:
    with socket.create_connection((http.host, http.port), timeout=10) as s:
        head = (
            b"POST /v1/predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (len(body) if length is None else length)
        )
        try:
            s.sendall(head + body)
        except OSError:  # the server may close on us once it has answered
            pass
        return s.recv(4096)


def test_bad_requests_do_not_make_the_next_valid_ones_429(world):
    """After a 30 MB body (413 unread), a 1,000,000-id request within the body limit (422 on its
    count), a malformed 2 MB body (400) and a valid-JSON one with an unknown field (422), 50
    valid requests are all answered: the loop-lag shedder is on (bound 50 ms) but does not count
    the time spent refusing. (Before: up to all 50 got 429.)"""
    cfg = ServeConfig(slo_ms=200, max_body_bytes=8 << 20, max_request_nodes=64)
    eng = Engine(world.sampler, world.x, world.model, world.n, cfg)
    eng.warmup()  # numba loads its kernels here, not in a timed request
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    million = b'{"nodes": [' + b"1," * 999_999 + b"1]}"
    bad = [
        (b'{"nodes": [' + b"1, " * 10_000_000 + b"1]}", b"413"),
        (million, b"422"),
        (million[:-2] + b",]}", b"400"),
        (b'{"nodes": [1], "x": [' + million[11:], b"422"),
    ]
    try:
        _still_serving(http)
        with httpx.Client(base_url=http.url, timeout=10) as client:
            for body, status in bad:
                reply = _raw_post(http, body)
                assert reply.startswith(b"HTTP/1.1 " + status), reply[:200]
                codes = [
                    client.post("/v1/predict", json={"nodes": [1, 2]}).status_code
                    for _ in range(50)
                ]
                assert codes == [200] * 50, (status, codes.count(429))
    finally:
        http.stop()
        eng.stop()


def test_every_error_status_is_counted_by_status(world, exploding_sampler):
    """500 (a failed batch), 404, 405, uvicorn's own 400 for a request that is not HTTP, 429
    (queue full) and 503 (shutting down): each counted once under its status."""
    cfg = ServeConfig(shed_late=False)
    eng = Engine(exploding_sampler(world.sampler), world.x, world.model, world.n, cfg)
    eng.warmup()  # numba loads its kernels here, not in a timed request
    eng.start()
    http = HTTPThread(create_app(eng)).start()
    try:
        assert httpx.get(f"{http.url}/nope").status_code == 404
        assert httpx.get(f"{http.url}/v1/predict").status_code == 405
        with socket.create_connection((http.host, http.port), timeout=10) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 400")
        _still_serving(http)
        assert httpx.post(f"{http.url}/v1/predict", json={"nodes": [13]}).status_code == 500
        eng.stop()  # HTTP still up: the engine is shutting down
        assert httpx.post(f"{http.url}/v1/predict", json={"nodes": [2]}).status_code == 503
        assert {k: _errors(http)[k] for k in ("500", "404", "405", "400", "503")} == dict.fromkeys(
            ("500", "404", "405", "400", "503"), 1
        )
    finally:
        http.stop()
        eng.stop()
    cfg = ServeConfig(shed_late=False, queue_capacity=1)
    idle = Engine(world.sampler, world.x, world.model, world.n, cfg)  # never started
    http = HTTPThread(create_app(idle)).start()
    try:
        idle.submit([1])  # fills the queue: nothing drains it
        assert httpx.post(f"{http.url}/v1/predict", json={"nodes": [2]}).status_code == 429
        assert _errors(http)["429"] == 1
    finally:
        http.stop()
        idle.stop()
