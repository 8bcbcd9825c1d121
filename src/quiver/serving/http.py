"""Run a FastAPI app with uvicorn in a background thread (tests, ``quiver.Server``, benchmarks)."""

from __future__ import annotations

import threading
import time


class HTTPThread:
    """uvicorn in a daemon thread; ``port=0`` picks a free loopback port (see ``self.port``).

    Args:
        app: the ASGI app.
        host: interface to bind (default loopback only).
        port: TCP port, 0 for any free one.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
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

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)


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
