"""The hot route without the framework: ``POST /v1/predict`` as plain ASGI.

Under load the HTTP front end, not the model, holds the GIL most: a py-spy ``--gil`` profile of
``quiver serve`` at 700 requests/s put about two thirds of the GIL's busy time in FastAPI's
routing, dependency solving and Starlette's middleware and exception wrappers, which then
starve the engine threads and delay every answer, 429s included. This middleware answers a
well-formed prediction request itself: parse the JSON, check the shape, submit to the engine,
write the response. Anything it does not recognise as well formed (bad JSON, a wrong type, an
unexpected field, a body longer than ids need) is handed, with the body it already read, to
the FastAPI app behind it, so every error keeps the one shape and message the app defines.
It answers itself, without reading further, a non-JSON ``content-type`` (415), a body past
``ServeConfig.max_body_bytes`` (413) and JSON nested too deeply for the parser (400).
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


class TooDeep(ValueError):
    """A JSON body nested beyond what the parser's recursion allows."""


def parse(body: bytes) -> tuple[list[int], str] | None:
    """``(nodes, output)`` of a well-formed request body; None when the full app must judge it.

    Raises ``TooDeep`` for a body nested too deeply to parse (answered 400, never a 500).
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    except RecursionError:
        raise TooDeep("malformed JSON: nested too deeply") from None
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
        limit_bytes: bodies longer than this are answered 413 without reading the rest
            (default ``engine.cfg.max_body_bytes``).

    A request whose ``content-type`` is not ``application/json`` is answered 415.
    """

    def __init__(
        self,
        app,
        engine,
        path: str = "/v1/predict",
        max_body_bytes: int | None = None,
        limit_bytes: int | None = None,
    ):
        self.app = app
        self.engine = engine
        self.path = path
        self.max_body_bytes = max_body_bytes or 22 * engine.cfg.max_request_nodes + 1024
        self.limit_bytes = limit_bytes or getattr(engine.cfg, "max_body_bytes", 1 << 20)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        ctype = _header(scope, b"content-type")
        if ctype is None or ctype.split(b";", 1)[0].strip().lower() != b"application/json":
            got = "none" if ctype is None else repr(ctype.decode("latin-1"))
            await _respond(
                send, 415, {"error": f"header content-type must be application/json, got {got}"}
            )
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit_bytes:
            await _respond(send, 413, self._too_large(int(length)))
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
            if size > self.limit_bytes:  # chunked or lying content-length: stop reading here
                await _respond(send, 413, self._too_large(None))
                return
        body = b"".join(chunks)
        why = self.engine.refusal()
        if why is not None:  # overloaded: refuse before paying for parsing and validation
            status, payload = 429, {"error": why}
        else:
            try:
                parsed = parse(body) if size <= self.max_body_bytes else None
            except TooDeep as e:
                await _respond(send, 400, {"error": str(e)})
                return
            if parsed is None:
                await self.app(scope, _replay([body], receive, more=False), send)
                return
            status, payload = await answer(self.engine, *parsed)
        await _respond(send, status, payload)

    def _too_large(self, length: int | None) -> dict:
        got = f"{length} bytes" if length is not None else "more"
        return {"error": f"request body too large: {got}; at most {self.limit_bytes} bytes"}


async def _respond(send, status: int, payload: dict) -> None:
    data = dumps(payload)
    headers = [*_JSON_HEADERS, (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class CountErrors:
    """ASGI middleware counting every 4xx/5xx response by status (``on_error(status)``)."""

    def __init__(self, app, on_error):
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(msg):
            if msg["type"] == "http.response.start" and msg["status"] >= 400:
                self.on_error(msg["status"])
            await send(msg)

        await self.app(scope, receive, counted)


def _replay(chunks: list[bytes], receive, more: bool):
    """A ``receive`` that first returns the chunks already read, then defers to ``receive``."""
    pending = list(chunks)

    async def replayed():
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending) or more}
        return await receive()  # the rest of the body, or (after it) the disconnect

    return replayed
