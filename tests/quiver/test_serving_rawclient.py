"""The lean load-generator client over real loopback sockets: statuses, keep-alive, failures."""

import asyncio
import json

import pytest

from quiver.serving import loadgen
from quiver.serving.http import HTTPThread, free_port
from quiver.serving.rawclient import RawHTTPPool, encode_post


class _App:
    """Answers by the first node id: 0 ok, 1 late, 2 -> 429, 3 -> 500, 4 ok + Connection: close,
    5 ok but chunked (not framed by Content-Length)."""

    def __init__(self):
        self.clients = set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.clients.add(scope["client"])
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        first = json.loads(body)["nodes"][0]
        status = {2: 429, 3: 500}.get(first, 200)
        out = json.dumps({"late": first == 1}).encode()
        headers = [(b"content-type", b"application/json")]
        if first != 5:  # 5: no length, so uvicorn sends it chunked
            headers.append((b"content-length", b"%d" % len(out)))
        if first == 4:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})


@pytest.fixture
def app_url():
    app = _App()
    http = HTTPThread(app).start()
    yield app, http.url
    http.stop()


def test_open_loop_counts_every_outcome(app_url):
    app, url = app_url
    reqs = [[k % 4, 7] for k in range(200)]
    res = asyncio.run(loadgen.run_open_loop_http(url, reqs, rate=2000.0))
    assert (res.sent, res.ok, res.late, res.rejected, res.errors) == (200, 50, 50, 50, 50)
    assert res.nodes_per_s > 0 and res.p99_ms >= res.p50_ms > 0
    assert res.reject_p99_ms > 0


def test_sequential_requests_reuse_one_connection_and_survive_close(app_url):
    app, url = app_url
    port = int(url.rsplit(":", 1)[1])

    async def go():
        pool = RawHTTPPool("127.0.0.1", port)
        got = []
        for first in (0, 0, 4, 0, 0):  # 4: the server closes after answering
            done = asyncio.get_running_loop().create_future()
            data = encode_post("x", "/v1/predict", json.dumps({"nodes": [first]}).encode())
            pool.request(data, lambda st, body, done=done: done.set_result((st, body)))
            got.append(await asyncio.wait_for(done, 10))
        pool.close()
        return got

    got = asyncio.run(go())
    assert [st for st, _ in got] == [200] * 5
    assert json.loads(got[0][1]) == {"late": False}
    assert len(app.clients) == 2  # one connection until the close, then a second one


def test_no_server_means_errors_not_a_hang():
    url = f"http://127.0.0.1:{free_port()}"
    res = asyncio.run(loadgen.run_open_loop_http(url, [[0]] * 20, rate=1000.0, timeout_s=5))
    assert res.errors == 20 and res.ok == 0


def test_unanswered_requests_count_as_errors_after_the_timeout():
    async def go():
        async def silent(reader, writer):  # reads, never answers
            await reader.read(1 << 16)
            await asyncio.sleep(30)

        srv = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            return await loadgen.run_open_loop_http(
                f"http://127.0.0.1:{port}", [[0]] * 5, rate=1000.0, timeout_s=0.5
            )
        finally:
            srv.close()

    res = asyncio.run(go())
    assert res.errors == 5 and res.duration_s < 5


def test_a_chunked_answer_is_an_error_and_the_next_request_still_works(app_url):
    _, url = app_url
    res = asyncio.run(loadgen.run_open_loop_http(url, [[5], [0], [5], [0]], rate=50.0))
    assert (res.errors, res.ok) == (2, 2)
