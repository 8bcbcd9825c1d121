"""The read timeout is a deadline (issue 35): a request's headers must all arrive within
``read_timeout_s`` of the connection opening, and its body within ``read_timeout_s`` of its
headers, however the bytes trickle in; each new byte does not buy more time."""

import asyncio
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request

from quiver.cli import build_parser
from quiver.commands.serve import serve_config
from quiver.serving.http import HTTPThread

TIMEOUT = 0.6
SLOW = 0.45  # seconds the /slow route takes to answer
HEAD = (
    b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n"
)


@pytest.fixture(scope="module")
def http():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.post("/slow")
    async def slow(request: Request):
        await request.body()
        await asyncio.sleep(SLOW)
        return {}

    # the timeout as `quiver serve --read-timeout 0.6` sets it (HTTPThread reads the app's)
    args = build_parser().parse_args(
        ["serve", "data", "--checkpoint", "c.pt", "--read-timeout", str(TIMEOUT)]
    )
    app.state.serve_config = serve_config(args)
    server = HTTPThread(app).start()
    yield server
    server.stop()


def _trickle(sock, data: bytes, every: float, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:  # the server closed the connection
            return


def _reply_while_trickling(http, first: bytes, rest: bytes, every: float = 0.1):
    """Send ``first``, then ``rest`` one byte every ``every`` s; returns the reply and its
    delay from the end of ``first``."""
    s = socket.create_connection((http.host, http.port), timeout=10)
    s.sendall(first)
    t0 = time.monotonic()
    stop = threading.Event()
    sender = threading.Thread(target=_trickle, args=(s, rest, every, stop))
    sender.start()
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
            if b"\r\n\r\n" in data and data.split(b"\r\n\r\n", 1)[1]:
                break
    except OSError:
        pass
    took = time.monotonic() - t0
    stop.set()
    sender.join(5)
    s.close()
    return data, took


def test_a_body_trickled_a_byte_every_tenth_of_a_second_gets_408(http):
    """100 bytes announced, 25 of them sent one every 0.1 s: the 408 comes at the deadline,
    not 0.6 s after the last byte (2.5 s on)."""
    reply, took = _reply_while_trickling(http, HEAD % 100, b"1" * 25)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"request body not received within 0.6 s" in reply
    assert TIMEOUT - 0.05 <= took <= TIMEOUT + 1.2, took


def test_headers_trickled_a_byte_every_tenth_of_a_second_get_408(http):
    reply, took = _reply_while_trickling(http, HEAD[:1], HEAD[1:26])
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"request headers not received within 0.6 s" in reply
    assert took <= TIMEOUT + 1.2, took


def test_a_slow_body_that_arrives_within_the_deadline_is_served(http):
    reply, took = _reply_while_trickling(http, HEAD % 4, b"[12]", every=0.05)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert reply.endswith(b'{"bytes":4}'), reply


def _response(s) -> bytes:
    """One whole response (its headers and ``content-length`` bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := s.recv(4096)):
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
    while len(data) < len(head) + 4 + length and (chunk := s.recv(4096)):
        data += chunk
    return data


def test_the_headers_deadline_restarts_at_each_response(http):
    """On a kept-alive connection the next request's headers have ``read_timeout_s`` from
    the previous response, not from that request's headers (which came ``SLOW`` s before)."""
    s = socket.create_connection((http.host, http.port), timeout=10)
    try:
        s.sendall(HEAD.replace(b"/echo", b"/slow") % 2 + b"{}")
        first = _response(s)
        assert first.startswith(b"HTTP/1.1 200"), first
        nxt = HEAD % 2 + b"{}"
        s.sendall(nxt[:20])  # the next request's headers, in two parts 0.3 s apart
        time.sleep(0.3)
        s.sendall(nxt[20:])
        second = _response(s)
        assert second.startswith(b"HTTP/1.1 200"), second
        assert second.endswith(b'{"bytes":2}'), second
    finally:
        s.close()


# -- the same bounds as ASGI middleware (quiver.serving.http.ReadGuard), for servers that are not
# ours to configure: Ray Serve's proxy in front of `quiver serve --replicas` runs plain uvicorn.
# Here the guard runs under plain uvicorn too (its default protocol, no guarded_protocol), so
# every bound these tests see comes from the middleware alone.

LIMIT = 1000


@pytest.fixture(scope="module")
def guarded():
    import uvicorn

    from quiver.serving.http import ReadGuard

    app = FastAPI()
    seen = []

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    server = uvicorn.Server(
        uvicorn.Config(
            ReadGuard(app, max_body_bytes=LIMIT, read_timeout_s=TIMEOUT, on_error=seen.append),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            access_log=False,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield type("Guarded", (), {"host": "127.0.0.1", "port": port, "errors": seen})
    server.should_exit = True
    thread.join(10)


def test_guard_answers_a_short_body_408_within_the_deadline(guarded):
    """100 bytes announced, 10 sent, then nothing: 408 at the deadline, connection closed."""
    s = socket.create_connection((guarded.host, guarded.port), timeout=10)
    try:
        s.sendall(HEAD % 100 + b"1" * 10)
        t0 = time.monotonic()
        reply = _response(s)
        took = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"request body not received within 0.6 s" in reply
        assert b"connection: close" in reply.lower()
        assert TIMEOUT - 0.05 <= took <= TIMEOUT + 1.2, took
        assert s.recv(4096) == b""  # closed: the rest of the body is never read
    finally:
        s.close()
    assert 408 in guarded.errors


def test_guard_answers_a_trickled_body_408_at_the_deadline(guarded):
    reply, took = _reply_while_trickling(guarded, HEAD % 100, b"1" * 25)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert TIMEOUT - 0.05 <= took <= TIMEOUT + 1.2, took


def test_guard_answers_413_from_the_declared_length_before_reading_the_body(guarded):
    """50 MB announced and none of it sent: the 413 comes at once (the body was never awaited)."""
    s = socket.create_connection((guarded.host, guarded.port), timeout=10)
    try:
        t0 = time.monotonic()
        s.sendall(HEAD % (50 << 20))
        reply = _response(s)
        assert time.monotonic() - t0 < TIMEOUT / 2  # not after waiting for the body
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert b"request body too large: %d bytes; at most %d bytes" % (50 << 20, LIMIT) in reply
    finally:
        s.close()
    assert 413 in guarded.errors


def test_guard_answers_413_for_a_chunked_body_past_the_limit(guarded):
    s = socket.create_connection((guarded.host, guarded.port), timeout=10)
    try:
        head = HEAD.replace(b"content-length: %d\r\n", b"transfer-encoding: chunked\r\n")
        chunk = b"%x\r\n%s\r\n" % (600, b"1" * 600)
        s.sendall(head + chunk + chunk)  # 1200 bytes, no end chunk: over the limit of 1000
        reply = _response(s)
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert b"request body too large: more" in reply
    finally:
        s.close()


def test_guard_passes_bodies_within_the_bounds(guarded):
    import httpx

    url = f"http://{guarded.host}:{guarded.port}"
    with httpx.Client(base_url=url, timeout=10) as client:
        r = client.post("/echo", content=b"[" + b"1," * 300 + b"1]")
        assert r.status_code == 200 and r.json() == {"bytes": 603}
        r = client.post("/echo", content=b"x" * LIMIT)  # exactly the limit
        assert r.status_code == 200 and r.json() == {"bytes": LIMIT}
        assert client.get("/healthz").json() == {"ok": True}
    # a slow body that is complete before the deadline is served
    reply, _ = _reply_while_trickling(guarded, HEAD % 4, b"[12]", every=0.05)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":4}'), reply


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"max_body_bytes": 0, "read_timeout_s": 1.0}, "max_body_bytes must be >= 1"),
        ({"max_body_bytes": 10, "read_timeout_s": 0}, "read_timeout_s must be > 0"),
    ],
)
def test_guard_refuses_bad_bounds(kwargs, msg):
    from quiver.serving.http import ReadGuard

    with pytest.raises(ValueError, match=msg):
        ReadGuard(None, **kwargs)
