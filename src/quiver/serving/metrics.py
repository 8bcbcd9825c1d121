"""Prometheus metrics of one serving engine (its own registry, so engines never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latency buckets in seconds: dense around typical SLOs (1-100 ms).
LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class _LiveGauges:
    """Collector that reads queue depth, the overload state, lane counts and feature-tier hits
    at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        g = GaugeMetricFamily("quiver_queue_depth", "Requests admitted and waiting to be batched")
        g.add_metric([], self.engine.queue_depth())
        yield g
        o = GaugeMetricFamily(
            "quiver_overloaded", "1 while admission holds requests in flight at the limit (429s)"
        )
        o.add_metric([], float(self.engine.batcher.overloaded))
        yield o
        lanes = CounterMetricFamily(
            "quiver_lane_batches",
            "Batches answered by lane: fast (idle, or a --lanes lane: one thread), split, pipeline",
            labels=["lane"],
        )
        for lane, count in self.engine.lanes.items():
            lanes.add_metric([lane], float(count))
        yield lanes
        stats = self.engine.feature_stats()
        if stats:
            t = GaugeMetricFamily(
                "quiver_feature_rows_total", "Feature rows served per tier", labels=["tier"]
            )
            for tier, rows in stats.items():
                t.add_metric([str(tier)], float(rows))
            yield t


class EngineMetrics:
    """Counters and histograms the engine updates; ``render()`` gives Prometheus text."""

    def __init__(self, engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "quiver_request_latency_seconds",
            "Time from admission to answer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "quiver_stage_seconds",
            "Per batch: queue (first arrival to pick-up), sample, gather, model_wait, model",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_nodes = Histogram(
            "quiver_batch_seed_nodes", "Seed nodes per batch", buckets=BATCH_BUCKETS, registry=r
        )
        self.requests = Counter(
            "quiver_requests", "Requests answered, by status", ["status"], registry=r
        )
        self.rejected = Counter(
            "quiver_rejected_requests",
            "Requests rejected (429/4xx/503) at admission or shed after queueing, by reason",
            ["reason"],
            registry=r,
        )
        self.late = Counter(
            "quiver_late_requests", "Requests answered after their deadline", registry=r
        )
        self.batches = Counter(
            "quiver_batches",
            "Batches run, by sampling path and closing reason (nodes, psgs, wait, slo: the "
            "adaptive cap)",
            ["path", "closed_by"],
            registry=r,
        )
        self.http_errors = Counter(
            "quiver_http_errors",
            "HTTP error responses (4xx/5xx) by status code, on every route",
            ["status"],
            registry=r,
        )
        self.restarts = Counter(
            "quiver_thread_restarts",
            "Serving threads restarted after dying, by stage",
            ["stage"],
            registry=r,
        )
        if engine is not None:
            r.register(_LiveGauges(engine))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
