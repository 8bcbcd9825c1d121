"""The serving engine: admission, batcher, sampler workers, model stage, per-request answers.

Stages run in their own threads and overlap: while the model thread runs batch k, sampler
workers already sample and gather batch k+1 (the numba sampler and torch release the GIL).
An idle engine skips the hand-offs: its next batch closes at once and runs every stage on the
batcher thread (the fast lane, ``Engine(fast_lane=True)``, the default). With
``ServeConfig.num_lanes = N`` the stages are not split over threads at all: N lane threads
each take the queued requests as one batch when free and run it back to back, so a request
never queues behind a batch while a lane is free.
Bounded queues between stages keep memory flat; a full admission queue rejects (HTTP 429), and
with ``shed_late`` so does a queue whose wait alone would break the deadline (see ServeConfig).
Every request is answered: with its result (flagged ``late`` past its deadline) or an error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from quiver.serving.batcher import Batch, DynamicBatcher, Overloaded, ShuttingDown
from quiver.serving.config import ServeConfig
from quiver.serving.metrics import EngineMetrics

log = logging.getLogger("quiver.serving")


def _log_failure(what: str, num_requests: int, e: BaseException) -> None:
    """One warning line per failed batch (its requests get the error); the traceback only at
    debug level, so a peer that stays down does not flood the log."""
    text = (str(e).strip().splitlines() or [""])[0][:300]
    log.warning(
        "%s failed for a batch of %d requests: %s: %s", what, num_requests, type(e).__name__, text
    )
    log.debug("%s failure traceback", what, exc_info=e)


_STOP = object()


@dataclass
class Result:
    """The answer to one request.

    Args:
        nodes: the request's node ids, in request order.
        output: what ``values`` holds: ``"class"`` (int64 ``(n,)``), ``"logits"``
            (``(n, classes)``) or ``"embedding"`` (``(n, hidden)``).
        values: numpy array, one row per requested node, in request order.
        latency_ms: admission to answer.
        late: answered after the request's deadline.
        path: sampling path of its batch (``"cpu"`` or ``"gpu"``).
    """

    nodes: np.ndarray
    output: str
    values: np.ndarray
    latency_ms: float
    late: bool
    path: str


@dataclass
class _Sampled:
    batch: Batch
    inverse: np.ndarray  # (len(batch.seeds),) position of each seed among the unique seeds
    x: torch.Tensor  # (len(n_id), F) gathered features
    adjs: list
    path: str
    picked: float  # perf_counter() when a sampler worker took the batch
    sampled: float = 0.0  # ... when sampling finished
    gathered: float = 0.0  # ... when the feature gather finished
    closed: float = 0.0  # ... when the batcher closed the batch
    lane: str = "pipeline"  # "fast": every stage on the batcher thread; "split": sampled there
    # a lane's batch split in two (ServeConfig.split_seeds): the helper's (emb, logits) of the
    # unique seeds after this half's
    other_half: object = None


class Engine:
    """Serve GNN predictions for node ids, batching concurrent requests.

    Args:
        sampler: object with ``sample(seeds: LongTensor) -> (n_id, batch_size, adjs)`` (e.g.
            ``quiver.pyg.GraphSageSampler`` or ``quiver.HybridSampler``). If it also has
            ``route(seeds) -> (path, psgs)`` (HybridSampler), the path labels the batch in
            the metrics.
        features: ``quiver.Feature`` or a tensor; ``features[n_id]`` gives ``(len(n_id), F)``.
            An object with ``gather_layer(n_id, adjs) -> (x, adjs_left)`` (a
            ``quiver.serving.folded.FoldedFirstLayer``) replaces the gather and the model's
            first layers; ``model`` then runs on what it returns.
        model: ``forward(x, adjs)`` for logits and ``forward_all(x, adjs)`` for
            ``(embedding, logits)`` (a ``quiver.models.SampledGNN`` or a
            ``quiver.usermodel.ServedModel``); any other ``forward(x, adjs)`` module is wrapped
            in a ``ServedModel``, which finds its embeddings. Put in eval mode here.
        node_count: number of graph nodes (ids are validated against it).
        cfg: batching and threading config.
        psgs_table: optional per-node PSGS for the batcher's PSGS budget.
        record: keep ``(seeds, n_id, adjs)`` of every batch in ``self.recorded`` (tests).
        fast_lane: (default: ``cfg.fast_lane``, True) when no batch is in the pipeline, close
            a batch without waiting ``max_wait_ms`` and run its stages back to back on the
            batcher thread (no hand-offs to sleeping stage threads); if requests queue up
            meanwhile, the sampled batch goes to the model thread and the batcher returns to
            batching. Under load (a batch in flight) batches take the overlapped pipeline.
            ``self.lanes`` counts batches per lane.
        live: a ``quiver.hetero.updates.LiveGraph`` of one node type (a homogeneous graph
            taking updates, ``quiver.serving.live``): each batch samples and gathers from the
            one version current when it starts (``sampler.sample(seeds, version)``, the rows
            from ``version``); ``features`` is then the base store (its cache statistics).

    Set ``engine.trace = []`` to record every answered batch's stage timestamps (benchmarks).
    """

    def __init__(
        self,
        sampler,
        features,
        model: torch.nn.Module,
        node_count: int,
        cfg: ServeConfig | None = None,
        psgs_table=None,
        record: bool = False,
        fast_lane: bool | None = None,
        live=None,
    ):
        self.cfg = cfg or ServeConfig()
        #: a live graph (``quiver.serving.live.open_live``): the sampler then takes the
        #: version as its second argument and the rows are gathered from that same version
        self.live = live
        self.sampler = sampler
        self.features = features
        self._gather_layer = getattr(features, "gather_layer", None)
        if not callable(getattr(model, "forward_all", None)):
            from quiver.usermodel import ServedModel

            model = ServedModel(model, convention="adjs")
        self.model = model.eval()
        self._has_embedding = bool(getattr(model, "has_embedding", True))
        first = next(model.parameters(), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self.node_count = int(node_count)
        self.batcher = DynamicBatcher(self.cfg, self.node_count, psgs_table)
        self.metrics = EngineMetrics(self)
        self.record = record
        self.recorded: list[tuple] = []
        self._sample_q: queue.Queue = queue.Queue(maxsize=self.cfg.pipeline_depth)
        self._model_q: queue.Queue = queue.Queue(maxsize=self.cfg.pipeline_depth)
        self._roles: dict = {}
        self._threads: dict[str, threading.Thread] = {}
        self._done: set[str] = set()
        self._supervisor: threading.Thread | None = None
        self._model_stops = 0
        self._started = False
        self.fast_lane = self.cfg.fast_lane if fast_lane is None else bool(fast_lane)
        self.lanes = {"fast": 0, "split": 0, "pipeline": 0}  # batches answered per lane
        self.trace: list | None = None  # per-batch stage timestamps, when a list
        self._in_pipeline = 0  # batches closed and not yet answered (or failed, or shed)
        self._pipe_lock = threading.Lock()
        self._splitter = None  # a one-thread pool running second halves (split_seeds)
        self.splits = 0  # batches split in two

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the stage threads and their supervisor (idempotent)."""
        if self._started:
            return self
        torch.set_num_threads(self.cfg.torch_threads)
        if self.cfg.num_lanes > 0:
            self._roles = {f"lane-{i}": self._lane_loop for i in range(self.cfg.num_lanes)}
            if self.cfg.split_seeds and not self.record:
                from concurrent.futures import ThreadPoolExecutor

                self._splitter = ThreadPoolExecutor(1, thread_name_prefix="quiver-split")
        else:
            self._roles = {"batcher": self._batch_loop, "model": self._model_loop}
            for i in range(self.cfg.num_sampler_workers):
                self._roles[f"sampler-{i}"] = self._sample_loop
        for name in self._roles:
            self._spawn(name)
        self._supervisor = threading.Thread(
            target=self._supervise, name="quiver-supervisor", daemon=True
        )
        self._supervisor.start()
        self._started = True
        return self

    def warmup(self, node: int = 0) -> None:
        """Run one node through sampler, gather and model, outside the metrics.

        Loads compiled kernels and touches the model's code paths so the first client request
        does not pay for them (seconds with numba's cache load). A seeded sampler's stream
        advances by one call.
        """
        if self.node_count == 0:
            return
        torch.set_num_threads(self.cfg.torch_threads)
        *_, x, adjs, _ = self._sample_gather(torch.tensor([int(node)], dtype=torch.int64))
        self._forward(x, adjs)

    def gather_inputs(self, n_id, adjs) -> tuple:
        """``(model input, hops the model runs)`` of a sampled batch: the gathered rows and
        every hop, or a folded store's first-layer output and the hops after it."""
        if self._gather_layer is not None:
            with torch.inference_mode():
                return self._gather_layer(n_id, adjs)
        return self.features[n_id], adjs

    def _sample_gather(self, seeds: torch.Tensor):
        """``(n_id, batch_size, adjs, model input, hops the model runs, time sampled)`` of
        ``seeds``: sampled and gathered from one graph (one version of a live graph)."""
        if self.live is None:
            n_id, batch_size, adjs = self.sampler.sample(seeds)
            sampled = time.perf_counter()
            return (n_id, batch_size, adjs, *self.gather_inputs(n_id, adjs), sampled)
        from quiver.serving.live import NODE

        with self.live.reading() as version:
            n_id, batch_size, adjs = self.sampler.sample(seeds, version)
            sampled = time.perf_counter()
            if self._gather_layer is None:
                x = version.features[NODE].gather(n_id)
                return n_id, batch_size, adjs, x, adjs, sampled
            fold = version.derived  # a folded first layer: its tables' rows of this version
            if not any(f.used for f in fold.values()):  # none updated: the base tables
                return n_id, batch_size, adjs, *self.gather_inputs(n_id, adjs), sampled
            rows = [f.gather(n_id) for f in fold.values()]
            with torch.inference_mode():
                x, model_adjs = self._gather_layer(n_id, adjs, rows)
            return n_id, batch_size, adjs, x, model_adjs, sampled

    def _forward(self, x, adjs, want_emb: bool = False):
        """``(embedding or None, logits)`` of the seeds, on the model's device."""
        # the sampler, the feature store and the model may sit on different devices
        x = x.to(self._device, non_blocking=True)
        adjs = [(ei.to(self._device, non_blocking=True), eid, size) for ei, eid, size in adjs]
        with torch.inference_mode():
            if want_emb:
                return self.model.forward_all(x, adjs)
            return None, self.model(x, adjs)

    def _spawn(self, name: str) -> None:
        loop = self._roles[name]

        def run():
            loop()
            self._done.add(name)  # a normal exit, after the shutdown sentinel

        t = threading.Thread(target=run, name=f"quiver-{name}", daemon=True)
        self._threads[name] = t
        t.start()

    def _supervise(self) -> None:
        """Restart any stage thread that died (its batch was already answered with the error)."""
        while len(self._done) < len(self._roles):
            time.sleep(0.05)
            for name, t in list(self._threads.items()):
                if not t.is_alive() and name not in self._done:
                    log.error("serving thread %s died; restarting it", name)
                    self.metrics.restarts.labels(name.split("-")[0]).inc()
                    self._spawn(name)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop admitting, answer every admitted request, then join the threads."""
        self.batcher.close()
        deadline = time.monotonic() + timeout
        while len(self._done) < len(self._roles) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._supervisor is not None:
            self._supervisor.join(max(0.0, deadline - time.monotonic()))
        if self._splitter is not None:
            self._splitter.shutdown(wait=False)
        self._started = False

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests --------------------------------------------------------------------------
    def submit(self, nodes, output: str = "class"):
        """Admit a request; returns its ``concurrent.futures.Future`` of a ``Result``.

        Raises ``ValueError`` (bad ids or output), ``Overloaded`` (queue full) or
        ``ShuttingDown``.
        """
        try:
            if output == "embedding" and not self._has_embedding:
                raise ValueError(
                    "this model cannot give embeddings (no embed method and no message-passing "
                    "layer to read); ask for 'class' or 'logits'"
                )
            req = self.batcher.submit(nodes, output)
        except ValueError:
            self.metrics.rejected.labels("invalid").inc()
            raise
        except Overloaded:
            self.metrics.rejected.labels("overloaded").inc()
            raise
        except ShuttingDown:
            self.metrics.rejected.labels("shutting_down").inc()
            raise
        return req.future

    def predict(self, nodes, output: str = "class", timeout: float | None = 60.0) -> Result:
        """Blocking convenience: submit and wait for the ``Result``."""
        return self.submit(nodes, output).result(timeout)

    def grow_nodes(self, n: int) -> None:
        """Serve ids up to ``n`` (nodes a live graph's update added): the id range and the
        batcher's PSGS table grow, new rows with the mean PSGS until a restart recomputes it."""
        table = self.batcher.psgs_table
        if table is not None and table.shape[0] < n:
            mean = float(table.mean()) if table.size else 1.0
            self.batcher.psgs_table = np.concatenate([table, np.full(n - table.shape[0], mean)])
        self.batcher.node_count = self.node_count = n

    def queue_depth(self) -> int:
        return self.batcher.depth()

    def pending(self) -> int:
        """Requests admitted and not answered yet (queued or in a batch)."""
        return self.batcher.pending()

    def refusal(self) -> str | None:
        """Why a request arriving now would get 429 (None: it would be admitted); counted.

        A cheap early answer for a front end under overload, before it parses the request.
        """
        why = self.batcher.refusal(time.perf_counter())
        if why is not None:
            self.metrics.rejected.labels("overloaded").inc()
        return why

    def feature_stats(self) -> dict:
        stats = getattr(self.features, "stats", None)
        if not callable(stats):
            return {}
        st = stats()
        return dict(st.get("rows", st))  # quiver.Feature nests rows per tier under "rows"

    # ---- stages ----------------------------------------------------------------------------
    def _batch_loop(self) -> None:
        while True:
            # only this thread feeds the pipeline, so "idle" stays true while it waits here
            idle = self.fast_lane and self._in_pipeline == 0
            # idle: close at once; waiting for company only pays when a batch is running
            batch = self.batcher.next_batch(timeout=0.1, max_wait_ms=0.0 if idle else None)
            if batch is None:
                if self.batcher._closed and self.batcher.depth() == 0:
                    break
                continue
            closed = time.perf_counter()
            self._enter_pipeline()
            if idle:
                self._run_fast(batch, closed)
            else:
                self._sample_q.put((batch, closed))
        for _ in range(self.cfg.num_sampler_workers):
            self._sample_q.put(_STOP)

    def _lane_loop(self) -> None:
        """One lane (``cfg.num_lanes > 0``): take what is queued, run it back to back, repeat.

        No batch window: a free lane starts a request at once, and while every lane is busy
        the queue grows into the next batch (capped by the SLO, see ``slo_batch_cap``).
        """
        while True:
            batch = self.batcher.next_batch(timeout=0.1, max_wait_ms=0.0)
            if batch is None:
                if self.batcher._closed and self.batcher.depth() == 0:
                    return
                continue
            closed = time.perf_counter()
            self._enter_pipeline()
            try:
                batch = self._shed(batch, closed)
                if batch is None:
                    continue
                s = self._sample(batch, closed, closed, split=self._splitter is not None)
                s.lane = "fast"
                self._run_model(s)
            except Exception as e:  # one bad batch answers its requests with the error
                _log_failure("lane", len(batch.requests), e)
                self._fail(batch, e)
            except BaseException as e:  # the thread dies: answer first, the supervisor restarts it
                self._fail(batch, RuntimeError(f"lane thread died: {e!r}"))
                raise
            finally:
                self._leave_pipeline()

    def _enter_pipeline(self) -> None:
        with self._pipe_lock:
            self._in_pipeline += 1

    def _leave_pipeline(self) -> None:
        with self._pipe_lock:
            self._in_pipeline -= 1
            assert self._in_pipeline >= 0, "a batch left the pipeline twice"

    def _run_fast(self, batch: Batch, closed: float) -> None:
        """Run an idle server's batch on this (the batcher) thread: no hand-off wake-ups.

        Requests that arrive while it samples are the sign of load: then the model thread
        runs the sampled batch, and this thread goes back to batching them at once.
        """
        handed_off = False
        try:
            batch = self._shed(batch, closed)
            if batch is None:
                return
            s = self._sample(batch, closed, closed)
            if self.batcher.depth() > 0:
                s.lane = "split"
                self._model_q.put(s)
                handed_off = True
                return
            s.lane = "fast"
            self._run_model(s)
        except Exception as e:  # one bad batch answers its requests with the error
            _log_failure("fast lane", len(batch.requests), e)
            self._fail(batch, e)
        except BaseException as e:  # the thread dies: answer first, the supervisor restarts it
            self._fail(batch, RuntimeError(f"batcher thread died: {e!r}"))
            raise
        finally:
            if not handed_off:
                self._leave_pipeline()

    def _sample_loop(self) -> None:
        while True:
            item = self._sample_q.get()
            if item is _STOP:
                self._model_q.put(_STOP)
                return
            batch, closed = item
            picked = time.perf_counter()
            batch = self._shed(batch, picked)
            if batch is None:
                self._leave_pipeline()
                continue
            try:
                self._model_q.put(self._sample(batch, picked, closed))
            except Exception as e:  # one bad batch answers its requests with the error
                _log_failure("sampling", len(batch.requests), e)
                self._fail(batch, e)
                self._leave_pipeline()
            except BaseException as e:  # the thread dies: answer first, the supervisor restarts it
                self._fail(batch, RuntimeError(f"sampler thread died: {e!r}"))
                self._leave_pipeline()
                raise

    def _shed(self, batch: Batch, now: float) -> Batch | None:
        """Answer requests that queued too long with ``Overloaded``; the rest of the batch runs.

        Only while other requests wait behind this batch: shedding makes room for them, and
        with none (a busy host, not a busy server, made this one late) it would refuse a
        request an idle server is about to answer; it is answered, marked late.
        """
        if self.batcher.pending() <= len(batch.requests):
            return batch
        flags = [self.batcher.too_late(r, now) for r in batch.requests]  # once: the bound moves
        if not any(flags):
            return batch
        late = [r for r, f in zip(batch.requests, flags) if f]
        for req in late:
            self.metrics.rejected.labels("shed").inc()
            waited = (now - req.arrival) * 1e3
            req.future.set_exception(
                Overloaded(
                    f"overloaded: waited {waited:.0f} ms in the queue, too long to meet the "
                    f"{self.cfg.slo_ms:g} ms deadline; retry later"
                )
            )
        keep = [r for r, f in zip(batch.requests, flags) if not f]
        if not keep:
            return None
        seeds = np.concatenate([r.nodes for r in keep])
        return Batch(keep, seeds, sum(r.psgs for r in keep), batch.closed_by)

    def _own_threads(self) -> None:
        """Run this thread's torch ops on ``cfg.torch_threads`` intra-op threads.

        Checked per batch: another engine in the process (a benchmark's other configuration,
        a test) may have changed the setting since this one started.
        """
        if torch.get_num_threads() != self.cfg.torch_threads:
            torch.set_num_threads(self.cfg.torch_threads)

    def _half(self, seeds: torch.Tensor, want_emb: bool):
        """``(embedding or None, logits)`` of ``seeds``, sampled, gathered and run here (the
        second half of a split batch, on the splitter thread)."""
        self._own_threads()
        *_, x, adjs, _ = self._sample_gather(seeds)
        return self._forward(x, adjs, want_emb)

    def _sample(self, batch: Batch, picked: float, closed: float, split: bool = False) -> _Sampled:
        self._own_threads()
        unique, inverse = np.unique(batch.seeds, return_inverse=True)
        other = None
        if (
            split
            and len(unique) >= self.cfg.split_seeds
            and self._in_pipeline == 1  # every other lane is idle: a core to spare
            and self.batcher.depth() == 0
            and self.live is None  # both halves must read one version of a live graph
        ):
            half = len(unique) // 2
            want_emb = any(r.output == "embedding" for r in batch.requests)
            rest = torch.from_numpy(unique[half:])
            other = self._splitter.submit(self._half, rest, want_emb)
            unique = unique[:half]
            self.splits += 1
        seeds = torch.from_numpy(unique)
        route = getattr(self.sampler, "route", None)
        path = "cpu"
        if route is not None:  # HybridSampler: routing is deterministic in the batch's PSGS
            path = route(seeds)
            path = path[0] if isinstance(path, tuple) else path
        n_id, batch_size, adjs, x, model_adjs, sampled = self._sample_gather(seeds)
        assert batch_size == len(unique), "sampler must put the seeds first in n_id"
        if self.record:
            self.recorded.append((seeds, n_id, adjs))
        gathered = time.perf_counter()
        return _Sampled(
            batch, inverse, x, model_adjs, str(path), picked, sampled, gathered, closed,
            other_half=other,
        )  # fmt: skip

    def _model_loop(self) -> None:
        while self._model_stops < self.cfg.num_sampler_workers:
            item = self._model_q.get()
            if item is _STOP:
                self._model_stops += 1
                continue
            try:
                self._run_model(item)
            except Exception as e:
                _log_failure("model", len(item.batch.requests), e)
                self._fail(item.batch, e)
            except BaseException as e:
                self._fail(item.batch, RuntimeError(f"model thread died: {e!r}"))
                raise
            finally:
                self._leave_pipeline()

    def _run_model(self, s: _Sampled) -> None:
        batch = s.batch
        want_emb = any(r.output == "embedding" for r in batch.requests)
        self._own_threads()
        started = time.perf_counter()
        emb, logits = self._forward(s.x, s.adjs, want_emb)
        if s.other_half is not None:  # the unique seeds' second half, from the splitter
            emb2, logits2 = s.other_half.result()
            logits = torch.cat([logits, logits2])
            emb = torch.cat([emb, emb2]) if emb is not None else None
        # rows per seed of the batch, in request order: (len(batch.seeds), C)
        logits_np = logits.float().cpu().numpy()[s.inverse]
        classes = logits_np.argmax(axis=1)
        emb_np = emb.float().cpu().numpy()[s.inverse] if emb is not None else None
        now = time.perf_counter()
        self.batcher.observe_service(now - s.picked, len(batch.seeds))
        first = min(r.arrival for r in batch.requests)
        for stage, dt in (
            ("queue", s.picked - first),
            ("sample", s.sampled - s.picked),
            ("gather", s.gathered - s.sampled),
            ("model_wait", started - s.gathered),
            ("model", now - started),
        ):
            self.metrics.stage.labels(stage).observe(dt)
        self.metrics.batches.labels(s.path, batch.closed_by).inc()
        self.lanes[s.lane] += 1
        if self.trace is not None:
            self.trace.append(
                {
                    "futures": [r.future for r in batch.requests],
                    "arrivals": [r.arrival for r in batch.requests],
                    "seeds": len(batch.seeds),
                    "lane": s.lane,
                    "closed": s.closed,
                    "picked": s.picked,
                    "sampled": s.sampled,
                    "gathered": s.gathered,
                    "started": started,
                    "answered": now,  # futures are resolved right after this
                }
            )
        self.metrics.batch_nodes.observe(len(batch.seeds))
        start = 0
        for req in batch.requests:
            n = len(req.nodes)
            sl = slice(start, start + n)
            start += n
            if req.output == "class":
                values = classes[sl]
            elif req.output == "logits":
                values = logits_np[sl]
            else:
                values = emb_np[sl]
            late = now > req.deadline
            latency = now - req.arrival
            self.metrics.latency.observe(latency)
            self.metrics.requests.labels("ok").inc()
            if late:
                self.metrics.late.inc()
            req.future.set_result(
                Result(req.nodes, req.output, values, latency * 1e3, late, s.path)
            )
        assert start == len(batch.seeds), "every seed of the batch is answered exactly once"

    def _fail(self, batch: Batch, err: Exception) -> None:
        for req in batch.requests:
            self.metrics.requests.labels("error").inc()
            if not req.future.done():
                req.future.set_exception(err)
