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
Refusing a bad request is kept cheap too: the 413 goes out on ``content-length`` alone, a
request naming more ids than ``ServeConfig.max_request_nodes`` is answered 422 from the JSON
parser's list without checking each id, and the time spent refusing a bad request (4xx other
than 429) is excused from the event-loop lag the front door sheds on
(``quiver.serving.shed.LoopLag.excuse``), so the valid requests after it are served, not shed.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from quiver.serving.auth import UNAUTHORISED, authorised
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


def parse(body: bytes, max_nodes: int | None = None) -> tuple[list[int], str] | None:
    """``(nodes, output)`` of a well-formed request body; None when the full app must judge it.

    Args:
        body: the request body.
        max_nodes: a ``nodes`` list longer than this is returned without checking each id
            (admission refuses it on its length alone, so checking would be wasted work).

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
    if max_nodes is not None and len(nodes) > max_nodes:
        return nodes, output
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
        limit_bytes: bodies longer than this are answered 413 without reading the rest
            (default ``engine.cfg.max_body_bytes``).
        lag: the front door's ``quiver.serving.shed.LoopLag``; the time spent refusing a bad
            request is excused from it (default: none to tell).

    A request whose ``content-type`` is not ``application/json`` is answered 415.
    """

    def __init__(
        self,
        app,
        engine,
        path: str = "/v1/predict",
        limit_bytes: int | None = None,
        lag=None,
    ):
        self.app = app
        self.engine = engine
        self.path = path
        self.max_nodes = engine.cfg.max_request_nodes
        self.limit_bytes = limit_bytes or getattr(engine.cfg, "max_body_bytes", 1 << 20)
        self.lag = lag

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        cfg = self.engine.cfg
        if getattr(cfg, "auth_predict", False) and not authorised(
            (_header(scope, b"authorization") or b"").decode("latin-1"), cfg.auth_token
        ):  # before reading the body: an unauthorised client costs no parsing
            await _respond(send, 401, {"error": UNAUTHORISED}, [(b"www-authenticate", b"Bearer")])
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
            await _respond(send, 429, {"error": why})
            return
        t0 = time.perf_counter()
        try:
            parsed = parse(body, self.max_nodes)
        except TooDeep as e:
            await _respond(send, 400, {"error": str(e)})
            self._excuse(400, t0)
            return
        if parsed is None:  # not well formed: the full app finds the words for what is wrong
            status = await self._full_app(scope, body, receive, send)
        else:
            status, payload = await answer(self.engine, *parsed)
            await _respond(send, status, payload)
        self._excuse(status, t0)

    async def _full_app(self, scope, body: bytes, receive, send) -> int:
        """Hand the request, body replayed, to the full app; the status it answered."""
        sent = [0]

        async def seen(msg):
            if msg["type"] == "http.response.start":
                sent[0] = msg["status"]
            await send(msg)

        await self.app(scope, _replay([body], receive, more=False), seen)
        return sent[0]

    def _excuse(self, status: int, t0: float) -> None:
        # a refused bad request's parse and answer is not load from valid requests (see the
        # module docstring); the engine's 429/503 and successful answers stay counted
        if self.lag is not None and 400 <= status < 500 and status != 429:
            self.lag.excuse(time.perf_counter() - t0)

    def _too_large(self, length: int | None) -> dict:
        got = f"{length} bytes" if length is not None else "more"
        return {"error": f"request body too large: {got}; at most {self.limit_bytes} bytes"}


async def _respond(send, status: int, payload: dict, extra=()) -> None:
    data = dumps(payload)
    headers = [*_JSON_HEADERS, (b"content-length", b"%d" % len(data)), *extra]
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
