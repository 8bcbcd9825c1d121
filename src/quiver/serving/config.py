"""Serving configuration: one dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUTS = ("class", "logits", "embedding")


@dataclass
class ServeConfig:
    """How the serving engine admits, batches and runs requests.

    Args:
        max_request_nodes: largest number of node ids one request may name (default 1024);
            larger requests are rejected with a 4xx error.
        queue_capacity: requests admitted but not yet batched (default 1024); when full, new
            requests are rejected (HTTP 429) instead of growing the queue.
        max_batch_nodes: a batch closes once its seed count reaches this (default 256).
        max_batch_psgs: a batch also closes once its summed PSGS reaches this (default: no
            limit); needs a PSGS table.
        max_wait_ms: a batch closes this long after its first request arrived (default 2 ms).
        slo_ms: each request's deadline after arrival (default 30 ms); a request answered later
            is counted as late (and still answered).
        num_sampler_workers: threads that sample and gather features for batches concurrently
            (default 2); the model stage runs in its own thread, so stages overlap.
        pipeline_depth: batches allowed to wait between stages (default 2); bounds memory.
        torch_threads: intra-op threads for the model forward (default 1, leaving cores to the
            sampler threads); with ``num_lanes``, each lane's.
        shed_late: reject (HTTP 429) requests that queueing alone would make miss their deadline
            (default True): a new request is refused at once while the oldest queued one has
            waited longer than ``max(slo - service, service)`` (``service``: median time from a
            batch's pick-up to its answer over the last 32 batches), and a request that waited
            that long when its batch is picked up is answered with 429 instead of being run.
            Under a sustained overload the door also holds the unanswered requests at an
            in-flight limit (``DynamicBatcher.in_flight_limit``, with hysteresis). A
            count-bounded queue alone absorbs overload as latency; this sheds it instead, so
            admitted requests keep the SLO. False: only ``queue_capacity`` bounds admission.
        fast_lane: an idle engine runs its next batch's stages back to back on one thread
            without the batch window (default True; ``Engine`` documents it).
        num_lanes: 0 (default) runs the staged pipeline (batcher thread -> ``num_sampler_workers``
            sampler threads -> one model thread, with the fast lane when idle). N >= 1 runs N
            *lanes* instead: each lane thread takes what is queued when it is free and runs
            that batch's sampling, gather and model back to back, with ``torch_threads``
            intra-op threads of its own (``Server.from_dataset`` gives its sampling and
            gather calls no helper threads: the lanes are the parallelism). A request
            arriving while one lane runs a large batch starts at once on a free lane rather
            than queueing behind it, and batches grow with the queue (not with a window) when
            every lane is busy. On 2 cores, 2 lanes x 1 torch thread keep exactly two
            computing threads, so no OpenMP team waits for a descheduled member;
            ``max_wait_ms``, ``num_sampler_workers``, ``pipeline_depth`` and ``fast_lane``
            are unused.
        adaptive_batch: cap a batch's seeds by the SLO: when a batch closes, its oldest
            request has ``slo - waited`` left, and the batch takes only as many seeds as the
            measured service time (``a + b x seeds``, fitted over recent batches) fits in that
            (always its first request; ``max_batch_nodes`` at most). When the oldest request
            cannot make its deadline anyway the cap is ``max_batch_nodes``, so an overload is
            served at the highest throughput. False: ``max_batch_nodes`` only. Default
            (None): on with lanes, where a busy lane's next batch would otherwise be the whole
            queue (slower, so a longer queue forms behind it: a snowball the cap cuts), off
            for the staged pipeline, whose short batch window already keeps batches small
            and whose single model thread pays each extra batch's overhead.
        split_seeds: with lanes, a batch of at least this many distinct seeds taken while
            every other lane is idle is split in two: this lane runs the first half and a
            helper thread the second, each sampling, gathering and running the model on its
            half, so a large request at light load uses both cores without an OpenMP team.
            0 (default) never splits. The two halves are sampled separately, so a node they
            share is sampled twice (an answer is a sample either way).
        max_body_bytes: largest ``POST /v1/predict`` body (default 1 MiB); a longer one is
            answered 413 as soon as its ``content-length`` or its first bytes past the limit
            arrive, without reading the rest.
        read_timeout_s: a request's headers must arrive within this many seconds of the
            connection opening (or of the previous answer on it), and its body within this of
            its headers (default 5 s); otherwise the server answers 408 and closes the
            connection, so a client that stops mid-request holds nothing.
        shutdown_timeout_s: on stop, requests still running after this many seconds are
            cancelled (default 5 s); bodies still arriving are answered 503 at once.
        docs: serve the interactive ``/docs`` (Swagger UI) and ``/redoc`` pages (default
            False), their assets served by the server itself, so they render offline; needs
            the ``serve-docs`` extra (``fastapi-offline``). ``/openapi.json`` is always served.
        auth_token: the token ``POST /v1/update`` needs as ``Authorization: Bearer TOKEN``
            (and ``/v1/predict`` with ``auth_predict``), compared in constant time; a request
            without it gets 401 before its body is read. None (default): no token. Kept out
            of the config's repr. See :mod:`quiver.serving.auth`.
        auth_predict: ``/v1/predict`` needs the token too (default False: reads are open).
    """

    max_request_nodes: int = 1024
    queue_capacity: int = 1024
    max_batch_nodes: int = 256
    max_batch_psgs: float | None = None
    max_wait_ms: float = 2.0
    slo_ms: float = 30.0
    num_sampler_workers: int = 2
    pipeline_depth: int = 2
    torch_threads: int = 1
    shed_late: bool = True
    fast_lane: bool = True
    num_lanes: int = 0
    adaptive_batch: bool | None = None
    split_seeds: int = 0
    max_body_bytes: int = 1 << 20
    read_timeout_s: float = 5.0
    shutdown_timeout_s: float = 5.0
    docs: bool = False
    auth_token: str | None = field(default=None, repr=False)
    auth_predict: bool = False

    @property
    def batch_cap_on(self) -> bool:
        """Whether the adaptive batch cap applies (``adaptive_batch``, resolved)."""
        if self.adaptive_batch is None:
            return self.num_lanes > 0
        return bool(self.adaptive_batch)

    def __post_init__(self):
        for name in (
            "max_body_bytes",
            "max_request_nodes",
            "queue_capacity",
            "max_batch_nodes",
            "num_sampler_workers",
            "pipeline_depth",
            "torch_threads",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"serve config: {name} must be >= 1, got {getattr(self, name)}")
        if int(self.split_seeds) < 0 or int(self.split_seeds) == 1:
            raise ValueError(
                f"serve config: split_seeds must be 0 (off) or >= 2, got {self.split_seeds}"
            )
        if int(self.num_lanes) < 0:
            raise ValueError(f"serve config: num_lanes must be >= 0, got {self.num_lanes}")
        for name in ("max_wait_ms", "slo_ms"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"serve config: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("read_timeout_s", "shutdown_timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"serve config: {name} must be > 0, got {getattr(self, name)}")
        if self.max_batch_psgs is not None and self.max_batch_psgs <= 0:
            raise ValueError(f"serve config: max_batch_psgs must be > 0, got {self.max_batch_psgs}")
