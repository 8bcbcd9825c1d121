"""Front-door shedding on event-loop lag (ASGI middleware, in-process, no sockets)."""

import asyncio
import time

import httpx

from quiver.serving.shed import LoopLagShedder


async def _ok_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _run(max_lag_s, pending=lambda: 1):
    """Block the loop ~150 ms between requests; ``pending``: the engine's unanswered work."""
    refused, lag_seen = [], []
    app = LoopLagShedder(_ok_app, max_lag_s, on_reject=lambda: refused.append(1), pending=pending)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = await c.post("/v1/predict", json={"nodes": [1]})  # starts the monitor
            await asyncio.sleep(0.03)
            time.sleep(0.15)  # the loop is blocked: the next timer fires ~150 ms late
            await asyncio.sleep(0.015)
            lagging = await c.post("/v1/predict", json={"nodes": [1]})
            lag_seen.append(app.lag_s)
            health = await c.get("/healthz")  # other routes always pass
            await asyncio.sleep(0.3)  # on time again: the lag estimate decays
            after = await c.post("/v1/predict", json={"nodes": [1]})
            return first, lagging, health, after

    return asyncio.run(go()), refused, app, lag_seen[0]


def test_lagging_loop_refuses_predictions_with_429_then_recovers():
    (first, lagging, health, after), refused, app, _ = _run(max_lag_s=0.05)
    assert first.status_code == 200
    assert lagging.status_code == 429 and "overloaded" in lagging.json()["error"]
    assert health.status_code == 200
    assert after.status_code == 200 and app.lag_s < 0.05
    assert len(refused) == 1


def test_lag_alone_never_refuses_a_server_with_nothing_to_do():
    # the host, not the server, made the loop late: nothing queued, nothing in flight
    (first, lagging, health, after), refused, app, lag = _run(max_lag_s=0.05, pending=lambda: 0)
    assert lag > 0.05
    assert lagging.status_code == 200 and after.status_code == 200 and not refused


def test_disabled_shedder_never_refuses():
    (first, lagging, health, after), refused, app, lag = _run(max_lag_s=None)
    assert lagging.status_code == 200 and after.status_code == 200 and not refused
    assert lag > 0.05  # the monitor measured the lag all the same
