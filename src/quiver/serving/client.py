"""Python client of the HTTP API: ``quiver.Client(url).predict(nodes)``."""

from __future__ import annotations

import httpx


class ServerError(RuntimeError):
    """The server answered with an error; ``status`` is the HTTP code, the message its text."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class Client:
    """Blocking client of a Quiver server.

    Args:
        url: base URL, e.g. ``"http://127.0.0.1:8000"``.
        timeout: seconds per request (default 30).
        token: the server's token (``--auth-token-file``), sent as ``Authorization: Bearer``;
            default ``$QUIVER_AUTH_TOKEN`` when set.
    """

    def __init__(self, url: str, timeout: float = 30.0, token: str | None = None):
        from quiver.serving.auth import load_token

        self.url = url.rstrip("/")
        token = token if token is not None else load_token()
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def predict(self, nodes, output: str = "class") -> dict:
        """Predict for ``nodes``; returns the JSON body (``values`` has one entry per node)."""
        r = self._http.post(
            "/v1/predict", json={"nodes": [int(n) for n in nodes], "output": output}
        )
        return self._json(r)

    def update(self, record: dict) -> dict:
        """Apply one update (``{"op": "add_nodes", "features": [[...]]}``, ``add_edges``,
        ``remove_edges``, ``set_features``: see docs/quiver/updates.md); returns what it did
        (the new ids of ``add_nodes``) once the server has logged it durably."""
        return self._json(self._http.post("/v1/update", json=record))

    def health(self) -> dict:
        return self._json(self._http.get("/healthz"))

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        r.raise_for_status()
        return r.text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _json(r: httpx.Response) -> dict:
        if r.status_code >= 400:
            try:
                msg = r.json().get("error", r.text)
            except ValueError:
                msg = r.text
            raise ServerError(r.status_code, msg)
        return r.json()


def wait_until_ready(url: str, timeout: float = 120.0, proc=None) -> dict:
    """Poll ``GET /healthz`` until the server answers; returns its JSON.

    Args:
        url: the server's base URL.
        timeout: seconds to wait before ``TimeoutError``.
        proc: optional ``subprocess.Popen`` of the server; if it exits first, ``RuntimeError``
            carries its output.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url.rstrip("/") + "/healthz", timeout=2).json()
        except httpx.HTTPError:
            if proc is not None and proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                raise RuntimeError(f"server exited before it was ready: {out}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout:.0f} s") from None
            time.sleep(0.2)
