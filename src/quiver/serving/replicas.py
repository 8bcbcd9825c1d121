"""``quiver serve DATA --replicas N``: engine replicas as a Ray Serve deployment.

Each replica is a Ray actor holding one ``quiver.Server`` engine (built by
``Server.from_dataset`` from the same dataset directory, checkpoint, options and seed) behind the
same FastAPI app as the single-process server (``quiver.serving.app.create_app``), so request
validation, error shapes and 429 admission are the engine's own, per replica. Ray's HTTP proxy
routes each request to one replica and restarts a replica whose process died; Ray Serve's
autoscaler moves the replica count between ``min_replicas`` and ``max_replicas`` on the number
of ongoing requests per replica.

The routes, and what answers them:

- ``POST /v1/predict``: one replica, chosen by the proxy.
- ``POST /v1/update``: 403, naming why (replicas serve read-only: an update acknowledged by one
  replica would be missing from the others' answers).
- ``GET /healthz``: per replica (the one the proxy chose), with its ``replica`` id and ``pid``.
- ``GET /metrics``: aggregated: the replica the proxy chose asks every live replica for its
  Prometheus text (``DeploymentHandle.broadcast``) and answers them merged, each sample labelled
  ``replica="..."``; a replica that does not answer within a second is left out.

Bodies are bounded as on the single-process server (``--max-body-bytes``, ``--read-timeout``):
Ray's HTTP proxy reads every request body whole into a queue for the replica, and its uvicorn
has no read timeout, so :func:`run_replicas` installs ``quiver.serving.http.ReadGuard`` in the
proxy itself (Ray calls :func:`proxy_middlewares`, named by ``RAY_SERVE_HTTP_PROXY_CALLBACK_
IMPORT_PATH``, when the proxy starts): a declared ``content-length`` over the limit is answered
413 before any of the body is read, and a body not all arrived within the read timeout 408;
the proxy's uvicorn also gets ``guarded_protocol``'s deadline for the headers. Each
replica's app is wrapped in the same guard too, which bounds the body again when the proxy was
started without it (a cluster joined with ``--ray-address`` whose Serve already ran).

Replicas on one host open the prepared dataset memory-mapped (``load_prepared`` maps
``features.npy`` and the CSR arrays copy-on-write), so its pages sit once in the page cache and
count as shared file pages (``RssFile``) in every replica, not as private memory.

Ray is imported only here, and only when a deployment is built: the single-process server never
imports it. Install it with ``pip install 'maestro-quiver[scale]'``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

APP_NAME = "quiver"
DEPLOYMENT_NAME = "QuiverEngine"
_METRICS_TIMEOUT_S = 1.0
# how the proxy learns the body bounds: Ray calls proxy_middlewares() with no arguments, in the
# proxy's own process, which inherits the environment of the `ray.init` that started the cluster
_PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
_PROXY_CALLBACK = "quiver.serving.replicas.proxy_middlewares"
_MAX_BODY_ENV = "QUIVER_PROXY_MAX_BODY_BYTES"
_READ_TIMEOUT_ENV = "QUIVER_PROXY_READ_TIMEOUT_S"


def import_serve():
    """``(ray, ray.serve)``; a one-line ``ValueError`` when Ray Serve is not installed."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError(
            f"--replicas needs Ray Serve, which is not installed ({e}); install it with "
            "pip install 'maestro-quiver[scale]' (or pip install 'ray[serve]')"
        ) from None
    return ray, serve


@dataclass(kw_only=True)
class ReplicaConfig:
    """How many engine replicas run, where, and how they scale.

    Args:
        num_replicas: replicas started (default 2); the fixed count when no bounds are given,
            else the autoscaler's initial count.
        min_replicas: the autoscaler's lower bound (default None). Giving either bound turns
            autoscaling on; a missing one then defaults as ``bounds`` says.
        max_replicas: the autoscaler's upper bound (default None).
        target_ongoing_requests: the autoscaler adds replicas while the ongoing requests per
            replica exceed this, and removes them while below (default 16: a few batches'
            worth, since each replica batches its concurrent requests).
        max_ongoing_requests: requests Ray sends one replica at a time (default: the engine's
            ``queue_capacity``, so the engine's own admission, not Ray's, answers 429).
        num_cpus: CPUs Ray reserves for each replica (default 1); scheduling only, the engine's
            threads are set by the serve options.
        ray_address: a running Ray cluster to join (``ray start --head`` prints it); default
            None starts a local one in this process.
    """

    num_replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int | None = None
    num_cpus: float = 1.0
    ray_address: str | None = None

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.num_replicas}")
        if self.min_replicas is not None and self.min_replicas < 0:
            raise ValueError(f"--min-replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"--max-replicas must be >= 1, got {self.max_replicas}")
        lo, hi = self.bounds
        if lo > hi:
            raise ValueError(f"--min-replicas {lo} must be <= --max-replicas {hi}")
        if not lo <= self.num_replicas <= hi:
            raise ValueError(
                f"--replicas {self.num_replicas} must lie within --min-replicas {lo} and "
                f"--max-replicas {hi}"
            )
        if not self.target_ongoing_requests > 0:
            raise ValueError(
                f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}"
            )
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if not self.num_cpus >= 0:
            raise ValueError(f"--replica-cpus must be >= 0, got {self.num_cpus}")

    @property
    def autoscaling(self) -> bool:
        """Whether either bound was given (else the replica count stays ``num_replicas``)."""
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        """``(min, max)`` replicas: a missing lower bound is 1, a missing upper one the larger
        of ``num_replicas`` and the lower bound; both ``num_replicas`` without autoscaling."""
        if not self.autoscaling:
            return self.num_replicas, self.num_replicas
        lo = 1 if self.min_replicas is None else self.min_replicas
        hi = max(self.num_replicas, lo) if self.max_replicas is None else self.max_replicas
        return lo, hi

    def deployment_options(self, queue_capacity: int) -> dict:
        """Keyword arguments for ``serve.deployment(...)``."""
        opts = dict(
            name=DEPLOYMENT_NAME,
            max_ongoing_requests=self.max_ongoing_requests or queue_capacity,
            ray_actor_options={"num_cpus": self.num_cpus},
        )
        if self.autoscaling:
            lo, hi = self.bounds
            opts["autoscaling_config"] = {
                "min_replicas": lo,
                "initial_replicas": self.num_replicas,
                "max_replicas": hi,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


# the app of the engine in this process: one replica per Ray actor process
_REPLICA_APP = None


def _replica_app():
    """``serve.ingress``'s builder, called in the replica after its constructor ran."""

    async def app(scope, receive, send):
        await _REPLICA_APP(scope, receive, send)

    return app


class EngineReplica:
    """One replica: a started engine with its HTTP app (``serve.ingress`` makes it the ingress).

    Args:
        server_kwargs: ``Server.from_dataset`` keyword arguments (the same in every replica).
    """

    def __init__(self, server_kwargs: dict):
        global _REPLICA_APP
        from ray import serve

        from quiver.serving.app import create_app
        from quiver.serving.http import ReadGuard
        from quiver.serving.server import Server

        self.server = Server.from_dataset(**server_kwargs).start()
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        self._handle = (ctx.deployment, ctx.app_name)
        # Server.update answers 403 naming why: replicas serve read-only
        app = create_app(self.server.engine, self.server.update)
        cfg = self.server.engine.cfg
        guarded = ReadGuard(
            app, cfg.max_body_bytes, cfg.read_timeout_s, on_error=app.state.on_http_error
        )
        _REPLICA_APP = _ReplicaRoutes(guarded, self)

    def metrics_text(self) -> tuple[str, str]:
        """``(replica id, this replica's Prometheus text)`` (broadcast to by ``/metrics``)."""
        return self.replica, self.server.engine.metrics.render().decode()

    def health(self) -> dict:
        """This replica's ``/healthz`` body: the single-process one plus ``replica`` and ``pid``."""
        engine = self.server.engine
        return {
            "status": "ok",
            "node_count": engine.node_count,
            "queue_depth": engine.queue_depth(),
            "replica": self.replica,
            "pid": os.getpid(),
        }

    async def all_metrics(self) -> bytes:
        """Every live replica's metrics, merged, each sample labelled with its replica."""
        from ray import serve

        handle = serve.get_deployment_handle(*self._handle)
        if not hasattr(handle, "broadcast"):  # Ray before broadcast(): this replica only
            return merge_metrics([self.metrics_text()]).encode()
        answers = await handle.broadcast("metrics_text").results_async(
            timeout_s=_METRICS_TIMEOUT_S, return_exceptions=True
        )
        texts = [a for a in answers if isinstance(a, tuple)]
        return merge_metrics(texts or [self.metrics_text()]).encode()

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


class _ReplicaRoutes:
    """ASGI: ``GET /healthz`` and ``GET /metrics`` answered for the deployment, the rest by the
    engine's app."""

    def __init__(self, app, replica: EngineReplica):
        self.app = app
        self.replica = replica

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET":
            if scope["path"] == "/healthz":
                from quiver.serving.fastpath import dumps

                return await _send(send, dumps(self.replica.health()), b"application/json")
            if scope["path"] == "/metrics":
                body = await self.replica.all_metrics()
                return await _send(send, body, b"text/plain; version=0.0.4")
        await self.app(scope, receive, send)


async def _send(send, body: bytes, ctype: bytes) -> None:
    headers = [(b"content-type", ctype), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Merge ``(replica, Prometheus text)`` pairs into one exposition.

    Each family's ``# HELP``/``# TYPE`` appears once, followed by every replica's samples of
    it with a ``replica`` label added (the text format wants a family's samples together).
    """
    families: dict[str, list[str]] = {}
    for replica, text in texts:
        family = None
        label = 'replica="' + replica.replace("\\", "\\\\").replace('"', '\\"') + '"'
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = families.setdefault(family, [])
                    if not any(x.startswith(f"# {parts[1]} {family} ") for x in lines):
                        lines.insert(0 if parts[1] == "HELP" else len(_headers(lines)), line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, rest = m.groups()
            labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
            families.setdefault(family or name, []).append(name + labels + rest)
    return "".join(line + "\n" for lines in families.values() for line in lines)


def _headers(lines: list[str]) -> list[str]:
    return [x for x in lines if x.startswith("# ")]


def proxy_middlewares() -> list:
    """The Starlette middlewares Ray's HTTP proxy applies (called by Ray in the proxy process).

    ``[ReadGuard]`` with the bounds :func:`run_replicas` put in the environment; none when they
    are absent (a proxy started by someone else's ``ray.init``).
    """
    from starlette.middleware import Middleware

    from quiver.serving.http import ReadGuard

    limit, timeout = os.environ.get(_MAX_BODY_ENV), os.environ.get(_READ_TIMEOUT_ENV)
    if limit is None or timeout is None:
        return []
    _guard_proxy_headers(float(timeout))
    return [Middleware(ReadGuard, max_body_bytes=int(limit), read_timeout_s=float(timeout))]


# the proxy's HTTP protocol class (set in the proxy process by _guard_proxy_headers)
_PROXY_PROTOCOL = None


def _guard_proxy_headers(read_timeout_s: float) -> None:
    """Give the proxy's uvicorn :func:`~quiver.serving.http.guarded_protocol`, so a request's
    headers too must arrive within ``read_timeout_s`` (ASGI middleware never sees headers
    that do not finish). Ray builds its uvicorn with the ``auto`` HTTP protocol after calling
    :func:`proxy_middlewares`, in the proxy's own process, so ``auto`` is pointed here there."""
    global _PROXY_PROTOCOL
    import uvicorn.config

    from quiver.serving.http import guarded_protocol

    _PROXY_PROTOCOL = guarded_protocol(read_timeout_s)
    uvicorn.config.HTTP_PROTOCOLS["auto"] = f"{__name__}:_PROXY_PROTOCOL"


def _guard_the_proxy(serve_cfg) -> None:
    """Put the body bounds where the proxy Ray is about to start will read them."""
    os.environ[_PROXY_CALLBACK_ENV] = _PROXY_CALLBACK
    os.environ[_MAX_BODY_ENV] = str(int(serve_cfg.max_body_bytes))
    os.environ[_READ_TIMEOUT_ENV] = repr(float(serve_cfg.read_timeout_s))


def build_app(server_kwargs: dict, cfg: ReplicaConfig, queue_capacity: int):
    """The Ray Serve application (bound, not yet run) serving ``server_kwargs``'s engine."""
    _, serve = import_serve()
    cls = serve.ingress(_replica_app)(EngineReplica)
    return serve.deployment(**cfg.deployment_options(queue_capacity))(cls).bind(server_kwargs)


def run_replicas(
    server_kwargs: dict,
    cfg: ReplicaConfig,
    queue_capacity: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    init_kwargs: dict | None = None,
):
    """Connect to (or start) Ray, start Serve's HTTP proxy on ``host:port`` and deploy.

    Returns once every replica is up. ``init_kwargs`` go to ``ray.init`` when it starts a local
    cluster (e.g. ``num_cpus``). Joining a cluster whose Serve already runs keeps that Serve's
    HTTP address (Ray ignores ``host``/``port`` then) and its proxy, which then lacks the body
    guard (each replica still applies it; see the module docstring).
    """
    from quiver.serving.config import ServeConfig

    ray, serve = import_serve()
    if cfg.ray_address is None:  # before ray.init: the local cluster's processes inherit it
        _guard_the_proxy(server_kwargs.get("cfg") or ServeConfig())
    if not ray.is_initialized():
        kwargs = dict(init_kwargs or {})
        kwargs.setdefault("include_dashboard", False)
        if cfg.ray_address is not None:
            kwargs = {"address": cfg.ray_address}
        ray.init(**kwargs)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(server_kwargs, cfg, queue_capacity)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop_replicas(shutdown_ray: bool = True) -> None:
    """Delete the application (replicas drain and stop), then shut Serve and Ray down."""
    ray, serve = import_serve()
    serve.delete(APP_NAME)
    if shutdown_ray:
        serve.shutdown()
        ray.shutdown()
