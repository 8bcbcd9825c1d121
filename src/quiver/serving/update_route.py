"""``POST /v1/update`` for both servers (homogeneous and heterogeneous): one route, one rulebook.

The route checks the token first (401 before the body is read: an unauthorised client costs no
parsing and nothing is logged or applied), reads the body under the documented
``--max-body-bytes`` limit (413 above it, from the declared length before reading, or while
reading), parses JSON (400 malformed, 415 not JSON) and hands the object to ``update`` on a
worker thread, since it fsyncs. ``update`` raises ``UpdateError`` (its ``status`` the HTTP
one) for a bad update; the route answers that status with the error's one line.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from quiver.serving.auth import UNAUTHORISED, authorised

__all__ = ["DISCONNECTED", "add_update_route", "graph_gauges", "read_json", "unauthorised"]

log = logging.getLogger("quiver.serving")

#: :func:`read_json`'s status when the client went away before its body was read (nginx's
#: "client closed request"; the answer reaches no one)
DISCONNECTED = 499


def unauthorised(request: Request, token: str | None) -> JSONResponse | None:
    """A 401 answer when ``request`` lacks ``token`` (None when it carries it or no token is
    set)."""
    if authorised(request.headers.get("authorization"), token):
        return None
    return JSONResponse(
        status_code=401, content={"error": UNAUTHORISED}, headers={"WWW-Authenticate": "Bearer"}
    )


async def read_json(request: Request, limit: int):
    """``(200, parsed body)`` or ``(status, message)``: 415 not JSON, 413 over ``limit`` (from
    the declared length before reading, or while reading), 400 malformed, :data:`DISCONNECTED`
    when the client disconnected before sending it all (one log line, no traceback)."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if ctype not in ("application/json", ""):
        return 415, f"content-type {ctype!r}: send application/json"
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return 413, f"body of {declared} bytes over the {limit}-byte limit"
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return 413, f"body over the {limit}-byte limit"
    except ClientDisconnect:
        log.info(
            "%s: the client disconnected after %d bytes of its body", request.url.path, len(body)
        )
        return DISCONNECTED, "the client disconnected before sending its whole body"
    try:
        return 200, json.loads(body)
    except (ValueError, RecursionError) as e:
        return 400, f"malformed JSON: {e}"


def add_update_route(app, cfg, update) -> None:
    """Add ``POST /v1/update`` to ``app``: ``update(record) -> dict`` applies one update
    durably (``quiver.hetero.updates.LiveGraph.update`` or a server's ``update``); ``cfg`` (a
    ``ServeConfig``) gives the token and the body limit."""

    def error(status: int, msg: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": msg})

    @app.post("/v1/update")
    async def update_route(request: Request):
        """Apply one update (add_nodes, add_edges, remove_edges, set_features); answered once
        it is fsynced to the update log and visible to the next batch."""
        from quiver.hetero.updates import UpdateError

        if (denied := unauthorised(request, cfg.auth_token)) is not None:
            return denied
        # the documented limit, as for predict: a larger update is split by the client
        status, data = await read_json(request, cfg.max_body_bytes)
        if status != 200:
            return error(status, data)
        try:
            result = await asyncio.to_thread(update, data)
        except UpdateError as e:
            return error(e.status, str(e))
        return JSONResponse(status_code=200, content=result)


def graph_gauges(stats: dict) -> list[str]:
    """Prometheus lines of a live graph's ``stats()``: nodes per type, edges per relation, the
    update log's length."""
    nodes, edges = stats["num_nodes"].items(), stats["num_edges"].items()
    return [
        "# HELP quiver_graph_nodes Nodes per type in the served (live) graph.",
        "# TYPE quiver_graph_nodes gauge",
        *(f'quiver_graph_nodes{{node_type="{t}"}} {n}' for t, n in nodes),
        "# HELP quiver_graph_edges Edges per relation in the served (live) graph.",
        "# TYPE quiver_graph_edges gauge",
        *(f'quiver_graph_edges{{edge_type="{t}"}} {n}' for t, n in edges),
        "# HELP quiver_update_log_records Updates logged since the last compaction.",
        "# TYPE quiver_update_log_records gauge",
        f"quiver_update_log_records {stats['log_records']}",
    ]
