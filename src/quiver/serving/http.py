"""Run a FastAPI app with uvicorn in a background thread (tests, ``quiver.Server``, benchmarks).

uvicorn has no timeout for reading a request: a client that sends its headers, or part of its
body, and then stops holds the connection (and a waiting request task) until it goes away, and
a graceful stop waits for that request. :func:`guarded_protocol` adds the missing bounds to
uvicorn's HTTP protocol, and :class:`HTTPThread` bounds the graceful stop as a whole.

Where the HTTP server is not ours to configure (Ray Serve's proxy in front of ``quiver serve
--replicas``), :class:`ReadGuard` gives the same body bounds as plain ASGI middleware: 413 from
the declared ``content-length`` before any of the body is read, and 408 when the body has not
all arrived within ``read_timeout_s`` of the request's headers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

_REASONS = {408: b"Request Timeout", 503: b"Service Unavailable"}


def guarded_protocol(read_timeout_s: float, on_error=None):
    """uvicorn's HTTP protocol class with a read timeout and a prompt stop for unsent bodies.

    Args:
        read_timeout_s: a request's headers must arrive within this of the connection opening
            or the previous response on it, and its body within this of its headers; when not,
            the client gets 408 (an idle connection is just closed) and the connection closes.
        on_error: called with the status of every error this layer answers itself (408, 503,
            and uvicorn's 400 for an unparseable request), e.g. a ``/metrics`` counter.

    On a graceful stop a request whose body is still arriving is answered 503 at once and its
    connection closed, instead of keeping the stop waiting for the rest of the body.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        _timer = None
        _armed_cycle = None
        _got_bytes = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._got_bytes = True
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before and not self.transport.is_closing():
                self._arm()  # a new request's headers arrived: now its body has the timeout

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers have the timeout

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if on_error is not None:
                on_error(400)
            super().send_400_response(msg)

        def shutdown(self) -> None:
            cycle = self.cycle
            if _reading_body(cycle):
                self._refuse(503, "server shutting down before the request body arrived")
            else:
                super().shutdown()

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._armed_cycle, self._got_bytes = self.cycle, False
            self._timer = self.loop.call_later(read_timeout_s, self._expired)

        def _expired(self) -> None:
            self._timer = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is not self._armed_cycle:
                return
            if cycle is None or cycle.response_complete:  # waiting for a request's headers
                if self._got_bytes:
                    self._refuse(408, f"request headers not received within {read_timeout_s:g} s")
                else:
                    self.transport.close()  # idle: nothing to answer
            elif _reading_body(cycle):
                self._refuse(408, f"request body not received within {read_timeout_s:g} s")

        def _refuse(self, status: int, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
            head += b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
            self.transport.write(head + b"connection: close\r\n\r\n" + body)
            self.transport.close()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # the app waiting for the body gets a disconnect and ends; nothing more is sent
                cycle.disconnected = True
                cycle.message_event.set()
            if on_error is not None:
                on_error(status)

    return GuardedHTTPProtocol


class ReadGuard:
    """ASGI middleware bounding a request body in size and arrival time, for any HTTP server.

    Args:
        app: the ASGI app behind it; it gets the body whole, read by this middleware.
        max_body_bytes: a body longer than this is answered 413: from a declared
            ``content-length`` at once, without reading any of it; from a chunked body as soon
            as it passes the limit.
        read_timeout_s: the whole body must arrive within this many seconds of the request
            reaching the app (its headers complete), however it trickles in; else 408.
        on_error: called with 408 or 413 for each refusal this middleware answers itself.

    Refusals are JSON ``{"error": message}`` with ``connection: close``, as
    :func:`guarded_protocol` answers them: the rest of the body is never read. Headers that
    never finish are not seen by ASGI middleware; the server's own bounds (uvicorn's keep-alive
    timeout, or :func:`guarded_protocol`) cover them.
    """

    def __init__(self, app, max_body_bytes: int, read_timeout_s: float, on_error=None):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.read_timeout_s = float(read_timeout_s)
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.read_timeout_s
        length = _declared_length(scope)
        if length is not None and length > self.max_body_bytes:
            await self._refuse(send, 413, self._too_large(f"{length} bytes"))
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                why = f"request body not received within {self.read_timeout_s:g} s"
                await self._refuse(send, 408, why)
                return
            if msg["type"] != "http.request":  # the client went away
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.max_body_bytes:  # chunked, or more than the declared length
                await self._refuse(send, 413, self._too_large("more"))
                return
        body = b"".join(chunks)
        sent = False

        async def whole():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect

        await self.app(scope, whole, send)

    def _too_large(self, got: str) -> str:
        return f"request body too large: {got}; at most {self.max_body_bytes} bytes"

    async def _refuse(self, send, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        if self.on_error is not None:
            self.on_error(status)


def _declared_length(scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _reading_body(cycle) -> bool:
    """A request in progress whose body has not all arrived and whose answer has not begun."""
    return (
        cycle is not None
        and not cycle.response_complete
        and not cycle.response_started
        and cycle.more_body
    )


class HTTPThread:
    """uvicorn in a daemon thread; ``port=0`` picks a free loopback port (see ``self.port``).

    Args:
        app: the ASGI app.
        host: interface to bind (default loopback only).
        port: TCP port, 0 for any free one.
        read_timeout_s: see :func:`guarded_protocol` (default: the app's
            ``app.state.serve_config.read_timeout_s`` when ``create_app`` built it, else 5 s).
        shutdown_timeout_s: :meth:`stop` cancels requests still running after this (default:
            the app's ``serve_config.shutdown_timeout_s``, else 5 s).
        on_error: counts the statuses the protocol answers itself (default: the app's
            ``app.state.on_http_error``, when it has one).
    """

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        read_timeout_s: float | None = None,
        shutdown_timeout_s: float | None = None,
        on_error=None,
    ):
        import uvicorn

        state = getattr(app, "state", None)
        cfg = getattr(state, "serve_config", None)
        read_timeout_s = read_timeout_s or getattr(cfg, "read_timeout_s", 5.0)
        self.shutdown_timeout_s = shutdown_timeout_s or getattr(cfg, "shutdown_timeout_s", 5.0)
        on_error = on_error or getattr(state, "on_http_error", None)
        cfg = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            http=guarded_protocol(read_timeout_s, on_error),
            timeout_graceful_shutdown=self.shutdown_timeout_s,
        )
        self.server = uvicorn.Server(cfg)
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="quiver-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> HTTPThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"HTTP server failed to start on {self.host}:{self.port}")
            if time.monotonic() > deadline:
                raise TimeoutError("HTTP server did not start in time")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop listening, answer 503 to bodies still arriving, let running requests finish
        (cancelled after ``shutdown_timeout_s``), then return; ``timeout`` bounds the wait
        (default ``shutdown_timeout_s`` + 2 s)."""
        self.server.should_exit = True
        self._thread.join(self.shutdown_timeout_s + 2.0 if timeout is None else timeout)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_serve(dataset_dir, checkpoint, *extra: str, port: int | None = None, nice: int = 0):
    """Start ``quiver serve`` as its own process on a loopback port.

    ``nice`` > 0 lowers the server's CPU priority: a load generator on the same cores then
    keeps sending on schedule instead of being starved by the server it measures.

    Returns ``(process, url)``; the process's stdout (with stderr) is a text pipe. The caller
    waits with ``quiver.serving.client.wait_until_ready(url, proc=process)`` and stops it with
    SIGTERM (it drains, then exits 0).
    """
    import subprocess
    import sys

    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "quiver.cli",
        "serve",
        str(dataset_dir),
        "--checkpoint",
        str(checkpoint),
        "--port",
        str(port),
        *extra,
    ]
    import os

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    return proc, f"http://127.0.0.1:{port}"
