"""Front-door load shedding: answer 429 at once while the server's event loop lags.

The engine sheds requests that queue too long *inside* it (``ServeConfig.shed_late``). When the
HTTP front end itself saturates (one Python process: the event loop shares the GIL and the
cores with the engine threads), requests wait in the socket backlog and in the loop before the
engine ever sees them, and that wait is invisible to it. Event-loop lag, how late a timer
fires, is the standard signal for that state (Fastify's ``under-pressure``, Node's
``toobusy``): while it exceeds a bound, prediction requests are refused before their body is
parsed, which costs a fraction of serving them and lets the backlog drain.

Lag alone does not decide: a host busy with other work (another process, a CPU-bound thread)
delays the loop's timers too, and refusing then would turn away requests an idle server can
answer at once. So a request is refused only while the server is behind on work of its own:
another request is inside the front end, or the engine has requests queued or in flight.
"""

from __future__ import annotations

import asyncio
import json


class LoopLag:
    """How late the event loop runs: a timer's lateness, fast attack, 30% decay per tick.

    Time the loop spent refusing a bad request (a body that is not a valid prediction, parsed
    and answered 4xx) is not load from valid requests: :meth:`excuse` takes it out of the next
    sample, so one oversized or malformed request does not make the requests after it 429.

    Args:
        interval_s: the timer's period.
    """

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.lag_s = 0.0
        self._excused_s = 0.0
        self._task = None

    def ensure_running(self) -> None:
        """Start the monitor on the running loop, once (call from a coroutine)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._monitor())

    def excuse(self, seconds: float) -> None:
        """Do not count ``seconds`` the loop just spent (refusing a bad request) as lag."""
        self._excused_s += seconds

    async def _monitor(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            self._excused_s = 0.0
            await asyncio.sleep(self.interval_s)
            late = loop.time() - t0 - self.interval_s - self._excused_s
            self.lag_s = max(late, 0.7 * self.lag_s, 0.0)


class LoopLagShedder:
    """ASGI middleware answering 429 for ``path`` while the event loop lags ``max_lag_s``.

    Args:
        app: the wrapped ASGI app.
        max_lag_s: lag bound in seconds; ``None`` disables shedding (the monitor still runs).
        path: the route to protect (others, e.g. ``/healthz`` and ``/metrics``, always pass).
        interval_s: the monitor's timer period (when ``lag`` is not given).
        on_reject: called once per refused request (e.g. a metrics counter).
        lag: the :class:`LoopLag` to read (shared with the fast path, which excuses the time it
            spends refusing bad requests); default a new one.
        pending: returns how many requests the engine has queued or in flight (default: none
            counted); with none there and no other request inside the front end, a request
            is never refused, whatever the lag.

    A refusal does not read the body: the HTTP server discards what the client still sends
    (uvicorn does, and keeps the connection), so refusing a large body costs no more than a
    small one.
    """

    def __init__(
        self,
        app,
        max_lag_s,
        path="/v1/predict",
        interval_s=0.01,
        on_reject=None,
        lag: LoopLag | None = None,
        pending=None,
    ):
        self.app = app
        self.pending = pending
        self._active = 0  # requests on self.path inside the wrapped app now
        self.max_lag_s = max_lag_s
        self.path = path
        self.on_reject = on_reject
        self.lag = lag or LoopLag(interval_s)

    @property
    def lag_s(self) -> float:
        """The current lag estimate in seconds."""
        return self.lag.lag_s

    def behind(self) -> bool:
        """Whether the server has work of its own: a request inside the front end or the
        engine's queue. Without any, lag is the host's, not this server's."""
        return self._active > 0 or (self.pending is not None and self.pending() > 0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != self.path:
            if scope["type"] == "http":
                self.lag.ensure_running()
            await self.app(scope, receive, send)
            return
        self.lag.ensure_running()
        if self.max_lag_s is not None and self.lag.lag_s > self.max_lag_s and self.behind():
            await self._refuse(send)
            return
        self._active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._active -= 1

    async def _refuse(self, send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        body = json.dumps(
            {
                "error": f"overloaded: the server runs {self.lag.lag_s * 1e3:.0f} ms behind "
                f"(bound {self.max_lag_s * 1e3:.0f} ms); retry later"
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
