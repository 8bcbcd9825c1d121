"""Front-door load shedding: answer 429 at once while the server's event loop lags.

The engine sheds requests that queue too long *inside* it (``ServeConfig.shed_late``). When the
HTTP front end itself saturates (one Python process: the event loop shares the GIL and the
cores with the engine threads), requests wait in the socket backlog and in the loop before the
engine ever sees them, and that wait is invisible to it. Event-loop lag, how late a timer
fires, is the standard signal for that state (Fastify's ``under-pressure``, Node's
``toobusy``): while it exceeds a bound, prediction requests are refused before their body is
parsed, which costs a fraction of serving them and lets the backlog drain.
"""

from __future__ import annotations

import asyncio
import json


class LoopLagShedder:
    """ASGI middleware answering 429 for ``path`` while the event loop lags ``max_lag_s``.

    Args:
        app: the wrapped ASGI app.
        max_lag_s: lag bound in seconds; ``None`` disables shedding (the monitor still runs).
        path: the route to protect (others, e.g. ``/healthz`` and ``/metrics``, always pass).
        interval_s: the monitor's timer period.
        on_reject: called once per refused request (e.g. a metrics counter).
    """

    def __init__(self, app, max_lag_s, path="/v1/predict", interval_s=0.01, on_reject=None):
        self.app = app
        self.max_lag_s = max_lag_s
        self.path = path
        self.interval_s = interval_s
        self.on_reject = on_reject
        self.lag_s = 0.0  # fast attack, decays by 30% per tick once the loop is on time
        self._task = None

    async def _monitor(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.interval_s)
            late = max(0.0, loop.time() - t0 - self.interval_s)
            self.lag_s = max(late, 0.7 * self.lag_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._monitor())
            if (
                self.max_lag_s is not None
                and scope.get("path") == self.path
                and self.lag_s > self.max_lag_s
            ):
                await self._refuse(receive, send)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, receive, send) -> None:
        more = True
        while more:  # drain the body so the keep-alive connection stays usable
            msg = await receive()
            more = msg.get("type") == "http.request" and msg.get("more_body", False)
        if self.on_reject is not None:
            self.on_reject()
        body = json.dumps(
            {
                "error": f"overloaded: the server runs {self.lag_s * 1e3:.0f} ms behind "
                f"(bound {self.max_lag_s * 1e3:.0f} ms); retry later"
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
