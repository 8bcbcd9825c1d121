"""A lean HTTP/1.1 client for load generation: keep-alive connections, callbacks, no tasks.

A load generator that shares the cores with the server it measures must cost far less per
request than the server, or it measures itself. aiohttp costs about 0.4 ms of CPU per request
here (a task, a response object, header parsing into a multidict); at 1,200 requests/s its
event loop fell 0.5 s behind its own schedule. This client writes pre-encoded requests to idle
keep-alive connections and parses only the status line and ``Content-Length`` of each answer,
calling a plain callback, so a request costs a few tens of microseconds of Python.

It speaks only what the load generator needs: one request in flight per connection (no
pipelining) and responses framed by ``Content-Length``. Anything else (a chunked answer, a
closed connection) completes the request with status 0, which the caller counts as an error.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Callable

#: ``callback(status, body)``; status 0 means the request failed without an HTTP answer.
Callback = Callable[[int, bytes], None]

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)


def encode_post(host: str, path: str, body: bytes, token: str | None = None) -> bytes:
    """The bytes of one ``POST path`` with a JSON body, ready to write to a connection (with
    ``Authorization: Bearer token`` when given)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Connection(asyncio.Protocol):
    def __init__(self, pool: RawHTTPPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.callback: Callback | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, data: bytes, callback: Callback) -> None:
        assert self.callback is None, "one request in flight per connection"
        self.callback = callback
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end])
        m = _CONTENT_LENGTH.search(head)
        if m is None or not head.startswith(b"HTTP/1.1 "):
            self._fail()  # not framed by Content-Length: not ours to parse
            return
        total = end + 4 + int(m.group(1))
        if len(self.buf) < total:
            return
        body = bytes(self.buf[end + 4 : total])
        del self.buf[:total]
        callback, self.callback = self.callback, None
        keep = b"\r\nconnection: close" not in head.lower()
        if keep:
            self.pool._release(self)
        else:
            self.transport.close()
        if callback is not None:
            callback(int(head[9:12]), body)

    def _fail(self) -> None:
        callback, self.callback = self.callback, None
        self.transport.close()
        if callback is not None:
            callback(0, b"")

    def connection_lost(self, exc) -> None:
        self.pool._lost(self)
        callback, self.callback = self.callback, None
        if callback is not None:
            callback(0, b"")


class RawHTTPPool:
    """Keep-alive connections to one ``host:port``, opened on demand up to ``max_connections``.

    Args:
        host / port: the server (loopback in benchmarks).
        max_connections: cap on open connections; requests beyond it wait for a free one
            (that wait counts in their latency, as a client's would).
    """

    def __init__(self, host: str, port: int, max_connections: int = 4096):
        self.host, self.port = host, port
        self.max_connections = max_connections
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiting: deque[tuple[bytes, Callback]] = deque()
        self._closed = False

    def request(self, data: bytes, callback: Callback) -> None:
        """Send ``data`` (see :func:`encode_post`); ``callback(status, body)`` runs on answer."""
        if self._idle:
            self._idle.pop().send(data, callback)
        elif self._open < self.max_connections:
            self._open += 1
            asyncio.get_running_loop().create_task(self._connect_and_send(data, callback))
        else:
            self._waiting.append((data, callback))

    async def _connect_and_send(self, data: bytes, callback: Callback) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError:
            self._open -= 1
            callback(0, b"")
            return
        conn.send(data, callback)

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn.transport.close()
        elif self._waiting:
            conn.send(*self._waiting.popleft())
        else:
            self._idle.append(conn)

    def _lost(self, conn: _Connection) -> None:
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        if self._waiting and not self._closed and self._open < self.max_connections:
            self._open += 1
            data, callback = self._waiting.popleft()
            asyncio.get_running_loop().create_task(self._connect_and_send(data, callback))

    @property
    def connections(self) -> int:
        """Connections open now."""
        return self._open

    def close(self) -> None:
        """Close idle connections now and busy ones as they finish; fail the waiting ones."""
        self._closed = True
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()
        while self._waiting:
            self._waiting.popleft()[1](0, b"")
