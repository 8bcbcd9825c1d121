"""Serving a heterogeneous GNN: one ``Engine`` per target node type over a shared sampler,
feature store and model (``quiver serve`` on a hetero dataset directory).

A request names a node type and ids (``{"node_type": "paper", "nodes": [3, 7]}``); requests
of one type are batched together by that type's engine, which samples the typed k-hop
neighbourhood (:class:`~quiver.hetero.sampler.HeteroSampler`), gathers each type's feature rows
(:class:`~quiver.hetero.model.HeteroFeatures`: a ``quiver.Feature`` per type, hot rows by
per-type FAP in the RAM cache) and runs the user's model. Batching, lanes, deadlines, overload
answers and metrics are the homogeneous server's (:class:`quiver.serving.engine.Engine`).

Sampling runs on the CPU: the typed sampler has no GPU path yet, so PSGS only sizes batches
(the batcher's PSGS budget), it routes nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from quiver.hetero.graph import HeteroGraph, edge_type_name
from quiver.hetero.model import (
    HeteroFeatures,
    HeteroServedModel,
    load_hetero_model,
    read_hetero_checkpoint,
)
from quiver.hetero.sampler import HeteroSampler, resolve_fanouts
from quiver.hetero.workload import hetero_fap, hetero_psgs, hot_rows, relation_edges
from quiver.serving.config import ServeConfig
from quiver.serving.engine import Engine
from quiver.serving.fastpath import CountErrors, answer
from quiver.serving.update_route import add_update_route, graph_gauges, read_json, unauthorised

__all__ = ["HeteroServer", "TypeSampler", "create_hetero_app"]

log = logging.getLogger("quiver.serving")


class TypeSampler:
    """The engine's sampler for one target type: ``sample(seeds) -> (batch, batch_size, [])``.

    With a live graph, sampling and the feature gather read one immutable version, taken when
    the batch starts: the batch sees one version, and neither waits for updates nor they for
    it."""

    def __init__(self, sampler: HeteroSampler, node_type: str, features=None, live=None):
        self.sampler = sampler
        self.node_type = node_type
        self.features = features
        self.live = live

    def sample(self, seeds):
        if self.live is None:
            batch = self.sampler.sample({self.node_type: seeds})
        else:
            with self.live.reading() as version:
                batch = self.sampler.sample({self.node_type: seeds}, version)
                batch.inputs = self.features.gather(batch, version)
        return batch, batch.batch_size[self.node_type], []


def _parse_fanouts(fanouts):
    """A list, a dict, ``"15,10"`` or a JSON object text ``{"a__r__b": [15, 10], ...}``."""
    if isinstance(fanouts, str):
        text = fanouts.strip()
        if text.startswith("{"):
            try:
                return json.loads(text)
            except ValueError as e:
                raise ValueError(f"--fanouts: not a JSON object ({e})") from None
        try:
            return [int(k) for k in text.split(",")]
        except ValueError:
            raise ValueError(
                f"--fanouts {text!r}: give counts like 15,10 or a JSON object"
            ) from None
    return fanouts


def embedding_rows(module: torch.nn.Module, types) -> dict[str, int]:
    """Featureless node type -> rows of the ``nn.Embedding`` the module keeps for it (one
    registered under the type's name, as in ``ModuleDict({type: Embedding})``); types
    without one are left out (their room is unknown, nothing is refused for them)."""
    rows = {}
    for name, m in module.named_modules():
        t = name.rpartition(".")[2]
        if t in types and isinstance(m, torch.nn.Embedding):
            rows[t] = min(rows.get(t, m.num_embeddings), m.num_embeddings)
    return rows


class HeteroServer:
    """Engines per target node type, their HTTP front end, and what they share.

    Args:
        engines: node type -> its :class:`Engine`.
        graph: the served graph.
        info: one line printed at start.
    """

    def __init__(self, engines: dict[str, Engine], graph: HeteroGraph, info: str = ""):
        self.engines = engines
        self.graph = graph
        self.info = info
        self.http = None
        self.stopped_cleanly = True

    @classmethod
    def from_dataset(
        cls,
        dataset_dir,
        checkpoint,
        cfg: ServeConfig | None = None,
        fanouts=None,
        targets=None,
        model: str | None = None,
        trust_pickle: bool = False,
        seed: int | None = None,
        feature_cache: int | str = "1G",
        record: bool = False,
        updates: bool = True,
    ) -> HeteroServer:
        """Load a hetero dataset directory and a factory checkpoint, build the engines.

        Args:
            dataset_dir: written by ``quiver prepare --hetero ...``.
            checkpoint: ``quiver.usermodel.save_model``'s file for the hetero module.
            cfg: batching and threading config (one per engine).
            fanouts: per-hop counts for every relation (``[15, 10]`` or ``"15,10"``), or a
                dict per edge type; default the checkpoint's, else the manifest's.
            targets: node types requests may name (default: the manifest's ``target``, else
                every type with labels).
            model, trust_pickle: see :func:`quiver.hetero.model.load_hetero_model`.
            seed: sampler seed (None: fresh).
            feature_cache: RAM for the hottest feature rows over all types (bytes or "1G");
                the rest is read from the memory-mapped files.
            record: engines keep every batch (tests).
            updates: take updates (``POST /v1/update``, :meth:`update`), logged durably to
                the dataset directory's ``updates.log`` and replayed now; the directory is
                locked against ``quiver compact`` while served.

        Raises:
            ValueError, FileNotFoundError: one line naming the problem.
        """
        from quiver.feature.sizes import parse_bytes

        cfg = cfg or ServeConfig()
        graph = HeteroGraph.load(dataset_dir)
        lock = None
        if updates:
            from quiver.hetero.updates import dataset_lock

            lock = dataset_lock(dataset_dir)
        manifest = graph.manifest
        if targets is None:
            targets = [manifest["target"]] if manifest.get("target") else list(graph.labels)
        targets = [targets] if isinstance(targets, str) else list(targets)
        if not targets:
            raise ValueError(
                f"{dataset_dir}: no target node type (the manifest names none and no type has "
                "labels); pass --target TYPE"
            )
        for t in targets:
            if t not in graph.num_nodes:
                raise ValueError(
                    f"--target {t}: no such node type; the graph has {', '.join(graph.num_nodes)}"
                )
        obj = read_hetero_checkpoint(checkpoint)  # read once: its fanouts, then its weights
        ckpt_fanouts = obj.get("fanouts") if isinstance(obj, dict) else None
        fanouts = _parse_fanouts(fanouts) or ckpt_fanouts or manifest.get("fanouts")
        if not fanouts:
            raise ValueError("no fanouts: pass --fanouts (e.g. 15,10: one per model layer)")
        fanouts = resolve_fanouts(graph, fanouts)
        live = None
        # FAP per type for the first target decides which rows sit in the RAM cache
        budget = parse_bytes(feature_cache, "--feature-cache")
        row_bytes = {t: int(x.shape[1]) * x.element_size() for t, x in graph.features.items()}
        fap = hetero_fap(graph, fanouts, targets[0], batch_size=cfg.max_batch_nodes)
        hot = hot_rows(fap, row_bytes, budget)
        tables = {}
        for t, x in graph.features.items():
            if graph.path is not None:
                from quiver.feature import Feature

                order = torch.argsort(fap[t], descending=True, stable=True)
                tables[t] = Feature(order=order, host_cache_size=hot[t] * row_bytes[t]).from_mmap(
                    str(graph.data_path / "features" / f"{t}.npy")
                )
            else:
                tables[t] = x
        if updates:
            from quiver.hetero.updates import LiveGraph

            live = LiveGraph(graph, tables)  # replays the update log
        sampler = HeteroSampler(graph, fanouts, seed, live=live)
        features = HeteroFeatures(tables, live=live, edge_tables=graph.edge_features)
        probe_node = {targets[0]: torch.zeros(1, dtype=torch.int64)}
        probe = features[sampler.sample(probe_node)] if graph.num_nodes[targets[0]] else None
        module, minfo = load_hetero_model(checkpoint, model, trust_pickle, probe, obj=obj)
        hops = len(next(iter(fanouts.values()))) if fanouts else 0
        if minfo["num_layers"] and hops != minfo["num_layers"]:
            # too few hops miss messages (a silent wrong answer); too many only cost time,
            # but say so either way, as the homogeneous server does
            raise ValueError(
                f"{hops} fanouts per relation but the model has {minfo['num_layers']} "
                "message-passing layers; give one per layer with --fanouts (e.g. "
                f"{','.join(['-1'] * minfo['num_layers'])} for all neighbours)"
            )
        psgs = hetero_psgs(graph, fanouts)
        engines = {
            t: Engine(
                TypeSampler(sampler, t, features, live),
                features,
                HeteroServedModel(module, t),
                sampler.num_nodes[t],
                cfg,
                psgs_table=psgs[t],
                record=record,
            )
            for t in targets
        }
        edges = relation_edges(graph, fanouts, targets[0])
        busiest = sorted(edges.items(), key=lambda kv: -kv[1])[:3]
        cached = ", ".join(f"{t} {hot[t]:,}/{graph.num_nodes[t]:,}" for t in hot) or "none"
        lists = list(fanouts.values())
        if all(ks == lists[0] for ks in lists):
            fan = f"{lists[0]} on every relation"
        else:
            fan = "; ".join(f"{edge_type_name(et)} {ks}" for et, ks in fanouts.items())
        info = (
            f"{graph.manifest.get('name', dataset_dir)}: {graph.describe()}; {minfo['kind']}; "
            f"targets {', '.join(targets)}; fanouts {fan}; mean PSGS of a {targets[0]} seed "
            f"{float(psgs[targets[0]].mean()):.1f} nodes; busiest relations per seed "
            + ", ".join(f"{k} {v:.1f}" for k, v in busiest)
            + f"; feature rows cached by FAP: {cached}; sampling on cpu"
        )
        if live is not None:
            info += f"; updates on (replayed to seq {live.seq})"
            live.capacity = embedding_rows(module, [t for t in graph.num_nodes if t not in tables])
        server = cls(engines, graph, info)
        server.fanouts = fanouts
        server.fap = fap
        server.live = live
        server._lock = lock
        if live is not None:
            live.listeners.append(server._on_update)
            for t in engines:  # nodes the replayed log added: PSGS rows for them
                server._on_update("add_nodes", {"node_type": t})
        return server

    def _on_update(self, op: str, record: dict) -> None:
        """New nodes are served at once: the engine's id range and PSGS table grow (new rows
        get the type's mean PSGS until a compaction and restart recompute it)."""
        if op != "add_nodes":
            return
        t = record["node_type"]
        engine = self.engines.get(t)
        if engine is None:
            return
        engine.grow_nodes(self.live.num_nodes[t])

    def update(self, record: dict) -> dict:
        """Apply one update (see :meth:`quiver.hetero.updates.LiveGraph.update`); durable
        when this returns. Raises ``UpdateError`` (its ``status`` is the HTTP one)."""
        if self.live is None:
            from quiver.hetero.updates import UpdateError

            raise UpdateError("this server was started without updates", status=403)
        return self.live.update(record)

    # ------------------------------------------------------------------ lifecycle
    def start(self, host: str = "127.0.0.1", port: int | None = None) -> HeteroServer:
        """Warm up and start every engine; with ``port`` (0 = any free one) also serve HTTP.

        Raises ``ValueError`` (one line) when the model fails on its first sampled subgraph.
        """
        for t, engine in self.engines.items():
            try:
                engine.warmup()
            except Exception as e:
                text = (str(e).strip().splitlines() or [""])[0][:300]
                raise ValueError(
                    f"the model failed on a sampled {t} subgraph: {type(e).__name__}: {text}"
                ) from None
            engine.start()
        if port is not None and self.http is None:
            from quiver.serving.http import HTTPThread

            self.http = HTTPThread(create_hetero_app(self), host, port).start()
        return self

    @property
    def url(self) -> str | None:
        return self.http.url if self.http else None

    def engine_for(self, node_type: str | None) -> Engine:
        """The engine of ``node_type`` (None: the only one). Raises ``ValueError``."""
        if node_type is None:
            if len(self.engines) == 1:
                return next(iter(self.engines.values()))
            raise ValueError(f"name a node_type: one of {', '.join(self.engines)}")
        engine = self.engines.get(node_type)
        if engine is None:
            known = ", ".join(self.engines)
            if node_type in self.graph.num_nodes:
                raise ValueError(f"node type {node_type!r} is not served; served: {known}")
            raise ValueError(f"unknown node type {node_type!r}; served: {known}")
        return engine

    def predict(self, node_type, nodes, output: str = "class", timeout: float | None = 60.0):
        """In-process prediction for ``nodes`` of ``node_type`` (see ``Engine.predict``)."""
        return self.engine_for(node_type).predict(nodes, output, timeout)

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()
            self.http = None
        for engine in self.engines.values():
            engine.stop()
        live = getattr(self, "live", None)
        if live is not None and live.log is not None:
            live.log.close()
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()
            self._lock = None

    def __enter__(self) -> HeteroServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def render_metrics(self) -> str:
        """Every engine's Prometheus text, samples labelled ``node_type``; one HELP/TYPE each."""
        seen, lines = set(), []
        for t, engine in self.engines.items():
            for line in engine.metrics.render().decode().splitlines():
                if line.startswith("#"):
                    if line not in seen:
                        seen.add(line)
                        lines.append(line)
                    continue
                if not line.strip():
                    continue
                name, _, rest = line.partition(" ")
                label = f'node_type="{t}"'
                if "{" in name:
                    head, _, tail = name.partition("{")
                    name = f"{head}{{{label},{tail}" if tail != "}" else f"{head}{{{label}}}"
                else:
                    name = f"{name}{{{label}}}"
                lines.append(f"{name} {rest}")
        if self.live is not None:
            lines += graph_gauges(self.live.stats())
        return "\n".join(lines) + "\n"


def create_hetero_app(server: HeteroServer):
    """FastAPI app: ``POST /v1/predict`` (``node_type``, ``nodes``, ``output``), ``GET
    /healthz``, ``GET /metrics``. Errors are JSON ``{"error": ...}``: 400 malformed JSON, 413
    over ``max_body_bytes`` (from the declared length, before reading), 415 not JSON, 422 bad
    fields, ids or node type, 429 overloaded, 503 shutting down, 500 a failed batch."""
    engines = list(server.engines.values())
    cfg = engines[0].cfg

    class HeteroPredictRequest(BaseModel):
        """Body of ``POST /v1/predict`` on a heterogeneous graph."""

        model_config = ConfigDict(extra="forbid")
        node_type: str | None = Field(
            None, description="the requested nodes' type (optional when one type is served)"
        )
        nodes: list[StrictInt] = Field(..., description="ids within that node type")
        output: Literal["class", "logits", "embedding"] = Field("class")

    app = FastAPI(
        title="Quiver heterogeneous GNN serving",
        version=__import__("quiver").__version__,
        docs_url=None,
        redoc_url=None,
    )

    def count_error(status: int) -> None:
        engines[0].metrics.http_errors.labels(str(status)).inc()

    app.add_middleware(CountErrors, on_error=count_error)
    app.state.serve_config = cfg
    app.state.on_http_error = count_error

    def error(status: int, msg: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": msg})

    @app.post("/v1/predict")
    async def predict(request: Request):
        """Predict for nodes of one type (see the module docstring)."""
        if cfg.auth_predict and (denied := unauthorised(request, cfg.auth_token)) is not None:
            return denied
        status, data = await read_json(request, cfg.max_body_bytes)
        if status != 200:
            return error(status, data)
        try:
            req = HeteroPredictRequest.model_validate(data)
        except ValidationError as e:
            errs = e.errors()  # a misspelt field explains its missing twin: report it first
            first = next((x for x in errs if x.get("type") == "extra_forbidden"), errs[0])
            loc = ".".join(str(p) for p in first.get("loc", ())) or "body"
            if first.get("type") == "extra_forbidden":
                return error(
                    422, f"unknown field '{loc}'; a request has node_type, nodes and output"
                )
            if first.get("type") == "missing":
                return error(422, f"missing field '{loc}'")
            return error(422, f"invalid '{loc}': {first.get('msg', 'invalid')}")
        try:
            engine = server.engine_for(req.node_type)
        except ValueError as e:
            return error(422, str(e))
        status, payload = await answer(engine, req.nodes, req.output)
        if status == 200:
            payload["node_type"] = req.node_type or next(iter(server.engines))
        return JSONResponse(status_code=status, content=payload)

    add_update_route(app, cfg, server.update)

    @app.get("/healthz")
    async def healthz():
        """Liveness: live node counts per type (edge counts per relation and the update
        log's length with updates on), the served types and their queue depths."""
        body = {"status": "ok", "node_types": dict(server.graph.num_nodes)}
        if server.live is not None:
            stats = server.live.stats()
            body["node_types"] = stats["num_nodes"]
            body["edge_types"] = stats["num_edges"]
            body["update_seq"] = stats["seq"]
            body["update_log_records"] = stats["log_records"]
        body["served"] = {t: {"queue_depth": e.queue_depth()} for t, e in server.engines.items()}
        return body

    @app.get("/metrics")
    async def metrics():
        """Prometheus metrics of every served type's engine, labelled ``node_type``."""
        return Response(server.render_metrics(), media_type="text/plain; version=0.0.4")

    return app
