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
