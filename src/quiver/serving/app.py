"""HTTP API over an ``Engine`` (FastAPI): ``POST /v1/predict``, ``GET /healthz``, ``GET /metrics``.

Every error is JSON ``{"error": message}``, counted in ``/metrics`` by status
(``quiver_http_errors_total``): 400 for malformed JSON (nested too deeply included), 413 for a
body past ``ServeConfig.max_body_bytes``, 415 for a non-JSON content type, 422 for a body that is
valid JSON but names bad ids or fields, 429 when overloaded (queue full, queueing past the
deadline budget, or an event loop running behind: ``quiver.serving.shed``), 503 while shutting
down, 500 when a batch failed inside the server. Requests whose headers or body do not arrive
within ``ServeConfig.read_timeout_s`` get 408 from the HTTP server
(``quiver.serving.http.guarded_protocol``), counted the same way.

The OpenAPI schema is served at ``/openapi.json``. The interactive ``/docs`` page (Swagger UI)
and ``/redoc`` page (ReDoc) are off by default (``ServeConfig.docs``); when on, their scripts,
styles and icon are served by this app from ``/docs/static/``, out of the ``fastapi-offline``
package (the ``serve-docs`` extra), so the pages render on a server without internet access.
FastAPI's own pages would load them from a CDN and be blank offline.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from quiver.serving.engine import Engine
from quiver.serving.fastpath import CountErrors, PredictFastPath, answer
from quiver.serving.shed import LoopLag, LoopLagShedder


class PredictRequest(BaseModel):
    """Body of ``POST /v1/predict``; any other field is refused (422), so a misspelt
    ``output`` is never silently ignored."""

    model_config = ConfigDict(extra="forbid")

    nodes: list[StrictInt] = Field(..., description="node ids to predict, in [0, node_count)")
    output: Literal["class", "logits", "embedding"] = Field(
        "class", description="per-node class id, class logits, or the last hidden embedding"
    )


class PredictResponse(BaseModel):
    """Body of a successful prediction: one entry of ``values`` per requested node."""

    nodes: list[int] = Field(..., description="the requested node ids, in order")
    output: str = Field(..., description="the output asked for: class, logits or embedding")
    values: list = Field(
        ..., description="per node: a class id, a list of logits or a list of embedding values"
    )
    latency_ms: float = Field(..., description="time from arrival to answer inside the server")
    late: bool = Field(..., description="whether the answer missed the request's deadline")
    path: str = Field(..., description="the sampler that ran the batch: cpu or gpu")


class ErrorResponse(BaseModel):
    """Body of every error answer (4xx, 5xx): one message naming the problem."""

    error: str = Field(..., description="what went wrong, e.g. \"unknown field 'nodez'\"")


#: the error statuses of ``POST /v1/predict``, as the OpenAPI schema documents them
_PREDICT_ERRORS = {
    400: "malformed JSON (nested too deeply included)",
    408: "headers or body not received within the read timeout (the connection closes)",
    413: "a body over the size limit (answered on content-length, without reading the rest)",
    415: "a content-type other than application/json",
    422: "bad ids or fields: non-integer, negative, out of range, empty, too many, unknown",
    429: "overloaded: queue full, queueing past the deadline budget, or the event loop behind",
    500: "the batch failed inside the server (the server keeps serving)",
    503: "shutting down",
}


class HealthResponse(BaseModel):
    """Body of ``GET /healthz``."""

    status: Literal["ok"] = Field(..., description="always ok while the server answers")
    node_count: int = Field(..., description="nodes of the served graph (live: after updates)")
    queue_depth: int = Field(..., description="requests admitted and not yet batched")
    edge_count: int | None = Field(None, description="edges of the live graph (updates on)")
    update_seq: int | None = Field(None, description="the last update applied (updates on)")
    update_log_records: int | None = Field(
        None, description="updates logged since the last compaction (updates on)"
    )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


def _describe(err: RequestValidationError) -> tuple[int, str]:
    """Turn pydantic's error list into one message; malformed JSON is a 400."""
    errors = err.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return 400, f"malformed JSON: {first.get('ctx', {}).get('error', 'cannot parse body')}"
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        return 422, f"missing field '{loc}'"
    if first.get("type") == "extra_forbidden":
        return 422, f"unknown field '{loc}'; a request has 'nodes' and optionally 'output'"
    return 422, f"invalid '{loc}': {msg}" + (
        f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    )


#: where the pages' scripts, styles and icon are served from, under the app's root path
DOCS_STATIC = "/docs/static"


def offline_docs_app():
    """``fastapi_offline.FastAPIOffline``, which builds a FastAPI app whose ``/docs`` (Swagger UI)
    and ``/redoc`` pages load their assets from the app itself; a one-line ``ValueError`` when
    the ``serve-docs`` extra (``fastapi-offline``) is not installed."""
    try:
        from fastapi_offline import FastAPIOffline
    except ImportError:
        raise ValueError(
            "--docs needs the packaged Swagger UI, which is not installed; install it with "
            "pip install 'maestro-quiver[serve-docs]' (or pip install fastapi-offline)"
        ) from None
    return FastAPIOffline


def create_app(engine: Engine, update=None) -> FastAPI:
    """Build the FastAPI app serving ``engine`` (the caller starts and stops the engine).

    ``update(record) -> dict`` (a ``quiver.Server``'s :meth:`~quiver.Server.update`) serves
    ``POST /v1/update`` (``quiver.serving.update_route``); without it the route answers 404.
    With a live graph (``engine.live``), ``/healthz`` and ``/metrics`` report its node and edge
    counts and the update log's length.

    ``app.state.serve_config`` (the engine's ``ServeConfig``) and ``app.state.on_http_error``
    (counts a status in ``/metrics``) tell ``quiver.serving.http.HTTPThread`` the read timeout
    and how to count the 408s the HTTP server answers itself.

    Raises ``ValueError`` (one line) when ``cfg.docs`` is on and the packaged Swagger UI is not
    installed (see :func:`offline_docs_app`).
    """
    cfg = engine.cfg
    meta = dict(
        title="Quiver GNN serving",
        version=__import__("quiver").__version__,
        description="Low-latency GNN predictions for graph nodes.",
    )
    if getattr(cfg, "docs", False):
        # no validator badge: Swagger UI would fetch it from validator.swagger.io
        app = offline_docs_app()(
            static_url=DOCS_STATIC, swagger_ui_parameters={"validatorUrl": None}, **meta
        )
    else:  # FastAPI's own pages would load their assets from a CDN: none
        app = FastAPI(docs_url=None, redoc_url=None, **meta)
    # the front door's bound: a quarter of the deadline, but never under 20 ms (the GIL's 5 ms
    # switch interval makes a few ms of lag normal while the engine threads run)
    max_lag = max(0.02, cfg.slo_ms / 4e3) if cfg.shed_late else None
    rejected = engine.metrics.rejected.labels("loop_lag")
    # added last = outermost: the shedder refuses before the fast path parses anything; both
    # share one lag monitor, so the fast path can excuse the time it spends refusing bad bodies
    lag = LoopLag()
    app.add_middleware(PredictFastPath, engine=engine, lag=lag)
    app.add_middleware(
        LoopLagShedder,
        max_lag_s=max_lag,
        on_reject=rejected.inc,
        lag=lag,
        pending=getattr(engine, "pending", None),
    )
    errors = engine.metrics.http_errors

    def count_error(status: int) -> None:
        errors.labels(str(status)).inc()

    app.add_middleware(CountErrors, on_error=count_error)
    app.state.serve_config = cfg
    app.state.on_http_error = count_error

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(request: Request, exc: RequestValidationError):
        status, msg = _describe(exc)
        engine.metrics.rejected.labels("invalid").inc()
        return _error(status, msg)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException):
        # unparseable bodies, unknown routes, wrong methods: same JSON error shape
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in msg:
            msg = "malformed JSON: cannot parse the request body"
        return JSONResponse(
            status_code=exc.status_code,
            content={"error": msg},
            headers=getattr(exc, "headers", None),
        )

    @app.post(
        "/v1/predict",
        response_model=PredictResponse,
        responses={
            s: {"model": ErrorResponse, "description": d} for s, d in _PREDICT_ERRORS.items()
        },
    )
    async def predict(body: PredictRequest):
        """Predict for graph nodes: each id's k-hop neighbourhood is sampled, its features
        gathered and the model run; the request is batched with others that arrive meanwhile.
        ``values`` holds one entry per requested node, in order; ``late`` says whether the
        answer missed the request's deadline; ``path`` names the sampler that ran it."""
        # reached only for requests the fast path hands over (see quiver.serving.fastpath)
        status, payload = await answer(engine, body.nodes, body.output)
        return payload if status == 200 else JSONResponse(status_code=status, content=payload)

    @app.get("/healthz", responses={200: {"model": HealthResponse, "description": "serving"}})
    async def healthz():
        """Liveness and load: the served graph's node count and the admission queue's depth."""
        body = {
            "status": "ok",
            "node_count": engine.node_count,
            "queue_depth": engine.queue_depth(),
        }
        live = getattr(engine, "live", None)
        if live is not None:
            from quiver.serving.live import NODE

            stats = live.stats()  # one version: the counts agree with each other
            body["node_count"] = stats["num_nodes"][NODE]
            body["edge_count"] = sum(stats["num_edges"].values())
            body["update_seq"] = stats["seq"]
            body["update_log_records"] = stats["log_records"]
        return body

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
    )
    async def metrics():
        """Prometheus metrics: request latency histogram, per-stage times, queue depth, the
        overload state, batches by lane, path and size, feature rows per tier, rejected
        requests by reason and HTTP errors by status."""
        text = engine.metrics.render()
        live = getattr(engine, "live", None)
        if live is not None:
            from quiver.serving.update_route import graph_gauges

            text += ("\n".join(graph_gauges(live.stats())) + "\n").encode()
        return Response(text, media_type="text/plain; version=0.0.4")

    if update is not None:
        from quiver.serving.update_route import add_update_route

        add_update_route(app, cfg, update)
    return app
