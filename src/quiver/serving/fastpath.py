"""The hot route without the framework: ``POST /v1/predict`` as plain ASGI.

Under load the HTTP front end, not the model, holds the GIL most: a py-spy ``--gil`` profile of
``quiver serve`` at 700 requests/s put about two thirds of the GIL's busy time in FastAPI's
routing, dependency solving and Starlette's middleware and exception wrappers, which then
starve the engine threads and delay every answer, 429s included. This middleware answers a
well-formed prediction request itself: parse the JSON, check the shape, submit to the engine,
write the response. Anything it does not recognise as well formed (bad JSON, a wrong type, an
unexpected field, an oversized or non-JSON body) is handed, with the body it already read, to
the FastAPI app behind it, so every error keeps the one shape and message the app defines.
Under overload it refuses with 429 before parsing at all (so a malformed request may get 429
rather than 4xx then): a refusal must cost much less than an answer, or shedding load adds load.
"""

from __future__ import annotations

import asyncio
import json
import math

from quiver.serving.batcher import Overloaded, ShuttingDown
from quiver.serving.config import OUTPUTS

_JSON_HEADERS = [(b"content-type", b"application/json")]
_FIELDS = frozenset(("nodes", "output"))


async def answer(engine, nodes, output: str) -> tuple[int, dict]:
    """Submit one prediction and wait for it: ``(HTTP status, JSON-able body)``.

    The single place that maps the engine's outcomes to statuses: 422 for bad ids, 429 when
    overloaded (at admission or shed after queueing), 503 while shutting down, 500 when the
    batch failed inside the server.
    """
    try:
        fut = engine.submit(nodes, output)
    except ValueError as e:
        return 422, {"error": str(e)}
    except Overloaded as e:
        return 429, {"error": str(e)}
    except ShuttingDown as e:
        return 503, {"error": str(e)}
    try:
        res = await asyncio.wrap_future(fut)
    except Overloaded as e:
        return 429, {"error": str(e)}
    except Exception as e:  # a failed batch: answered, never dropped
        return 500, {"error": f"prediction failed: {type(e).__name__}: {e}"}
    return 200, {
        "nodes": res.nodes.tolist(),
        "output": res.output,
        "values": res.values.tolist(),
        "latency_ms": res.latency_ms,
        "late": res.late,
        "path": res.path,
    }


def dumps(body: dict) -> bytes:
    """Standard JSON; a non-finite float (a diverged model's logits) becomes ``null``."""
    try:
        return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        return json.dumps(_finite(body), separators=(",", ":")).encode()


def _finite(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, list):
        return [_finite(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def parse(body: bytes) -> tuple[list[int], str] | None:
    """``(nodes, output)`` of a well-formed request body; None when the full app must judge it."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if type(obj) is not dict or not obj.keys() <= _FIELDS:
        return None
    nodes, output = obj.get("nodes"), obj.get("output", "class")
    if type(nodes) is not list or output not in OUTPUTS:
        return None
    # exact type: bool is an int subclass, and the schema's StrictInt refuses it
    if not all(type(v) is int for v in nodes):
        return None
    return nodes, output


class PredictFastPath:
    """ASGI middleware serving well-formed ``POST path`` requests directly from ``engine``.

    Args:
        app: the full app; it answers every other route and every request the fast path does
            not recognise as well formed (with the body replayed).
        engine: the ``quiver.serving.Engine`` to submit to.
        path: the prediction route.
        max_body_bytes: bodies longer than this go to the full app (default: room for
            ``engine.cfg.max_request_nodes`` ids of 20 digits).
    """

    def __init__(self, app, engine, path: str = "/v1/predict", max_body_bytes: int | None = None):
        self.app = app
        self.engine = engine
        self.path = path
        self.max_body_bytes = max_body_bytes or 22 * engine.cfg.max_request_nodes + 1024

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if more and size > self.max_body_bytes:
                await self.app(scope, _replay(chunks, receive, more=True), send)
                return
        body = b"".join(chunks)
        why = self.engine.refusal()
        if why is not None:  # overloaded: refuse before paying for parsing and validation
            status, payload = 429, {"error": why}
        else:
            parsed = parse(body) if size <= self.max_body_bytes else None
            if parsed is None:
                await self.app(scope, _replay([body], receive, more=False), send)
                return
            status, payload = await answer(self.engine, *parsed)
        data = dumps(payload)
        headers = [*_JSON_HEADERS, (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def _is_json(scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def _replay(chunks: list[bytes], receive, more: bool):
    """A ``receive`` that first returns the chunks already read, then defers to ``receive``."""
    pending = list(chunks)

    async def replayed():
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending) or more}
        return await receive()  # the rest of the body, or (after it) the disconnect

    return replayed
