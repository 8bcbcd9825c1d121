"""Admission and dynamic batching: a bounded queue of requests released as batches.

A batch closes when its seed count reaches ``max_batch_nodes``, its summed PSGS reaches
``max_batch_psgs``, or ``max_wait_ms`` has passed since its first request (Ray Serve's
``@serve.batch`` policy, plus the PSGS budget); with the adaptive cap
(``ServeConfig.adaptive_batch``) the seed limit is lowered to what the oldest request's
remaining deadline fits (``slo_batch_cap``). Every request owns one future.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from quiver.serving.config import OUTPUTS, ServeConfig

#: Floor of the in-flight admission limit: a burst this large is always let in (when the queue
#: is not otherwise past its deadline budget), so light load with bursty clients is not shed.
MIN_IN_FLIGHT = 32
#: The in-flight limit targets a mean time to answer of this share of the SLO (Little's law).
#: The tail is about twice the mean: at 2x overload (2 cores, 100 ms SLO) 0.7 gave an admitted
#: p99 of 109-128 ms, 0.5 gave 95-101 ms and 0.4 gave 63-77 ms (RELIABILITY.md, 2026-11-30).
IN_FLIGHT_SLO_SHARE = 0.4
#: The door starts enforcing the in-flight limit only once the oldest unanswered request has
#: been in the server this share of the SLO (evidence of overload: a burst under moderate load
#: briefly puts many requests in flight without making anyone slow) ...
OVERLOAD_ENTER_SHARE = 0.7
#: ... and keeps enforcing it until the oldest is younger than this share (hysteresis: under a
#: sustained overload the limit alone holds the oldest near IN_FLIGHT_SLO_SHARE, so a single
#: gate between the two would keep reopening the door to a rush of requests).
OVERLOAD_EXIT_SHARE = 0.2
#: Time constant (s) with which the remembered peak drain rate decays.
PEAK_RATE_DECAY_S = 10.0
#: Batches whose (seeds, service time) the adaptive batch cap fits its cost line to.
SERVICE_FIT_BATCHES = 64
#: The adaptive cap plans a batch to be answered by this share of its oldest request's
#: deadline, leaving the rest for the spread of service times around the fitted line.
BATCH_SLO_SHARE = 0.8


class Overloaded(RuntimeError):
    """The server cannot answer in time (queue full or too long a wait): retry later (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The engine no longer admits requests (HTTP 503)."""


@dataclass
class Request:
    """One admitted request.

    Args:
        nodes: int64 node ids, shape ``(n,)``, validated.
        output: ``"class"``, ``"logits"`` or ``"embedding"``.
        arrival: ``time.perf_counter()`` at admission.
        deadline: ``arrival + slo``; answering later counts the request as late.
        future: resolved with a ``Result`` or an exception.
    """

    nodes: np.ndarray
    output: str
    arrival: float
    deadline: float
    future: Future = field(default_factory=Future)
    psgs: float = 0.0


@dataclass
class Batch:
    """Requests released together; ``seeds`` concatenates their nodes in request order."""

    requests: list[Request]
    seeds: np.ndarray
    psgs: float
    closed_by: str


@dataclass(frozen=True)
class ServiceFit:
    """A batch's pick-up-to-answer time as ``per_batch_s + per_seed_s x seeds``."""

    per_batch_s: float
    per_seed_s: float

    def predict(self, seeds: int) -> float:
        return self.per_batch_s + self.per_seed_s * seeds


def fit_service(points) -> ServiceFit | None:
    """Least-squares ``ServiceFit`` to ``(seeds, seconds)`` points; None with fewer than 4.

    Both coefficients are kept >= 0: with too little spread in the seed counts (or a
    negative slope from noise) the line goes through the origin with the median per-seed time.
    """
    if len(points) < 4:
        return None
    x = np.fromiter((p[0] for p in points), dtype=np.float64, count=len(points))
    y = np.fromiter((p[1] for p in points), dtype=np.float64, count=len(points))
    if x.min() < 1:
        return None
    var = float(((x - x.mean()) ** 2).mean())
    if var > 0:
        slope = float(((x - x.mean()) * (y - y.mean())).mean()) / var
        icpt = float(y.mean()) - slope * float(x.mean())
        if slope > 0 and icpt >= 0:
            return ServiceFit(icpt, slope)
    return ServiceFit(0.0, float(np.median(y / x)))


def slo_batch_cap(
    waited_s: float, slo_s: float, fit: ServiceFit | None, first_nodes: int, max_nodes: int
) -> int:
    """Most seeds a batch may take so that its oldest request is still answered in time.

    Args:
        waited_s: how long the batch's oldest request has waited so far.
        slo_s: its deadline after arrival.
        fit: the service-time line (None: not measured yet, no cap).
        first_nodes: the oldest request's own seeds (a batch always takes it).
        max_nodes: the configured ceiling (``max_batch_nodes``).

    The batch is planned to finish by ``BATCH_SLO_SHARE`` of the deadline. When even the
    oldest request alone cannot make that, no cap helps it: the ceiling is returned, so a
    backlog is served at the highest throughput (larger batches cost less per seed).
    """
    if fit is None or fit.per_seed_s <= 0:
        return max_nodes
    budget = BATCH_SLO_SHARE * slo_s - waited_s - fit.per_batch_s
    fits = int(budget / fit.per_seed_s + 1e-9) if budget > 0 else -1  # 1e-9: float rounding
    if fits < first_nodes:
        return max_nodes
    return max(first_nodes, min(max_nodes, fits))


def validate_nodes(nodes, node_count: int, max_request_nodes: int) -> np.ndarray:
    """Check a request's node ids and return them as int64; ``ValueError`` names the problem."""
    if isinstance(nodes, (str, bytes)) or not hasattr(nodes, "__len__"):
        raise ValueError("'nodes' must be a list of integer node ids")
    if len(nodes) == 0:
        raise ValueError("'nodes' is empty: name at least one node id")
    if len(nodes) > max_request_nodes:
        raise ValueError(
            f"request names {len(nodes)} nodes; at most {max_request_nodes} are allowed"
        )
    if isinstance(nodes, (list, tuple)) and any(isinstance(v, bool) for v in nodes):
        raise ValueError("node ids must be integers; got a boolean")
    arr = np.asarray(nodes)
    if arr.dtype == np.uint64 or arr.dtype == object:  # ids past int64: name one, exactly
        big = next((v for v in nodes if isinstance(v, int) and not 0 <= v < node_count), None)
        if big is not None:
            raise ValueError(f"node id {big} is out of range; ids are in [0, {node_count})")
    if arr.ndim != 1:
        raise ValueError("'nodes' must be a flat list of integer node ids")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        bad = next(
            (v for v in nodes if isinstance(v, bool) or not isinstance(v, (int, np.integer))), None
        )
        raise ValueError(f"node ids must be integers; got {bad!r}")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"node id {lo} is negative; ids are in [0, {node_count})")
    if hi >= node_count:
        raise ValueError(f"node id {hi} is out of range; ids are in [0, {node_count})")
    return arr


class DynamicBatcher:
    """Thread-safe admission queue that releases batches by size, PSGS budget or wait time.

    Args:
        cfg: the serving config (queue capacity, batch limits, SLO).
        node_count: number of graph nodes, for id validation.
        psgs_table: optional per-node PSGS, shape ``(node_count,)``; enables the PSGS budget.
    """

    def __init__(self, cfg: ServeConfig, node_count: int, psgs_table=None):
        self.cfg = cfg
        self.node_count = int(node_count)
        self.psgs_table = None if psgs_table is None else np.asarray(psgs_table, dtype=np.float64)
        self._queue: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._service: deque[float] = deque(maxlen=32)  # recent pick-up-to-answer seconds
        self.service_s = 0.0  # their median (robust to a warm-up or GC outlier); 0: none yet
        self._service_pts: deque[tuple[int, float]] = deque(maxlen=SERVICE_FIT_BATCHES)
        self.service_fit: ServiceFit | None = None  # seconds against seeds, for the batch cap
        self.last_cap = cfg.max_batch_nodes  # the seed cap the latest batch was closed under
        self._picked: deque[tuple[float, int]] = deque()  # (time, requests) of recent pick-ups
        self._picked_sum = 0  # requests in _picked
        self._peak_rate, self._peak_at = 0.0, 0.0  # highest recent drain rate and when
        self._in_flight = 0  # admitted requests whose future is not done yet
        self._admitted: deque[Request] = deque()  # admission order; done ones leave lazily
        self.overloaded = False  # the door enforces the in-flight limit (see OVERLOAD_*_SHARE)

    def observe_service(self, seconds: float, seeds: int | None = None) -> None:
        """Record one batch's pick-up-to-answer time; ``service_s`` is the median of the last 32.

        With ``seeds`` (the batch's seed count) the point also refits ``service_fit``, the line
        the adaptive batch cap predicts a batch's service time from.
        """
        self._service.append(float(seconds))
        self.service_s = statistics.median(self._service)
        if seeds is not None and seeds > 0:
            self._service_pts.append((int(seeds), float(seconds)))
            self.service_fit = fit_service(self._service_pts)

    def batch_cap(self, first: Request, now: float) -> int:
        """Seed cap of a batch whose oldest request is ``first`` (see ``slo_batch_cap``)."""
        if not self.cfg.batch_cap_on:
            return self.cfg.max_batch_nodes
        return slo_batch_cap(
            now - first.arrival,
            self.cfg.slo_ms / 1e3,
            self.service_fit,
            len(first.nodes),
            self.cfg.max_batch_nodes,
        )

    def max_queue_s(self) -> float:
        """Longest queue wait that still leaves time for service before the deadline.

        ``max(slo - service, service)`` with ``service`` the recent median: the second term
        keeps a server whose service time alone exceeds the SLO serving (late) rather than
        shedding everything.
        """
        slo = self.cfg.slo_ms / 1e3
        return max(slo - self.service_s, self.service_s)

    def drain_rate(self, now: float) -> float | None:
        """Requests per second taken into batches over the last second; None with < 2 batches.

        Under overload this is the server's capacity.
        """
        while self._picked and now - self._picked[0][0] > 1.0:
            self._picked_sum -= self._picked.popleft()[1]
        if len(self._picked) < 2 or now <= self._picked[0][0]:
            return None
        return self._picked_sum / (now - self._picked[0][0])

    def in_flight_limit(self, now: float) -> float:
        """Most unanswered requests admitted at once (``inf`` until a drain rate is measured).

        ``max(MIN_IN_FLIGHT, peak * slo * IN_FLIGHT_SLO_SHARE)`` with ``peak`` the highest
        drain rate of the last ~10 s (it decays with that time constant). Under overload the
        peak is the capacity, so by Little's law the limit holds the mean time to answer at
        that share of the SLO. The peak, not the current rate, sets it: refusals lower the
        current rate, and a limit that followed it would keep shrinking. The floor lets a burst
        in at once under light load.
        """
        rate = self.drain_rate(now)
        if rate is None and self._peak_rate == 0.0:
            return math.inf
        decay = math.exp(-(now - self._peak_at) / PEAK_RATE_DECAY_S)
        if rate is not None and rate >= self._peak_rate * decay:
            self._peak_rate, self._peak_at = rate, now
        peak = max(rate or 0.0, self._peak_rate * decay)
        return max(MIN_IN_FLIGHT, peak * self.cfg.slo_ms * IN_FLIGHT_SLO_SHARE / 1e3)

    def _oldest_in_flight_s(self, now: float) -> float:
        """How long the oldest unanswered admitted request has been in the server."""
        admitted = self._admitted
        while admitted and admitted[0].future.done():
            admitted.popleft()
        return now - admitted[0].arrival if admitted else 0.0

    def _finished(self, _future) -> None:
        with self._cond:
            self._in_flight -= 1

    def too_late(self, req: Request, now: float) -> bool:
        """Whether ``req`` has queued too long to be answered in time (when shedding is on)."""
        # no shedding before the first batch is timed: the bound needs a service estimate
        if not self.cfg.shed_late or self.service_s == 0.0:
            return False
        return now - req.arrival > self.max_queue_s()

    def pending(self) -> int:
        """Admitted requests not answered yet (an int read: no lock on the front door's path)."""
        return self._in_flight

    def refusal(self, now: float) -> str | None:
        """Why a request arriving now would be refused as overload (None: it would be admitted).

        The HTTP fast path asks before it parses a body; ``submit`` asks again on admission.
        """
        with self._cond:
            return self._refusal(now)

    def _refusal(self, now: float) -> str | None:
        if len(self._queue) >= self.cfg.queue_capacity:
            return f"queue full ({self.cfg.queue_capacity} requests); retry later"
        if not self.cfg.shed_late:
            return None
        queue = self._queue
        if queue and self.too_late(queue[0], now):
            # a standing queue: the oldest request already waited past the bound, so a new
            # one would too; refusing now is faster for the client than shedding it later
            return (
                f"overloaded: queued requests wait {(now - queue[0].arrival) * 1e3:.0f} ms, "
                f"past the {self.cfg.slo_ms:g} ms deadline budget; retry later"
            )
        slo = self.cfg.slo_ms / 1e3
        full = self._in_flight >= self.in_flight_limit(now)
        oldest = self._oldest_in_flight_s(now)
        if self.overloaded:
            self.overloaded = oldest >= OVERLOAD_EXIT_SHARE * slo
        else:
            self.overloaded = full and oldest > OVERLOAD_ENTER_SHARE * slo
        if full and self.overloaded:
            # Little's law: at the measured capacity more unanswered requests would only
            # queue. Refusing at the door is quick; refusing after a wait (at pick-up) is slow.
            return (
                f"overloaded: {self._in_flight} requests in flight, the most that keep the "
                f"{self.cfg.slo_ms:g} ms deadline at this server's rate; retry later"
            )
        return None

    def submit(self, nodes, output: str = "class") -> Request:
        """Validate and enqueue; raises ``ValueError``, ``Overloaded`` or ``ShuttingDown``."""
        if output not in OUTPUTS:
            raise ValueError(f"'output' must be one of {list(OUTPUTS)}, got {output!r}")
        arr = validate_nodes(nodes, self.node_count, self.cfg.max_request_nodes)
        now = time.perf_counter()
        req = Request(arr, output, now, now + self.cfg.slo_ms / 1e3)
        if self.psgs_table is not None:
            req.psgs = float(self.psgs_table[arr].sum())
        with self._cond:
            if self._closed:
                raise ShuttingDown("server is shutting down")
            refusal = self._refusal(now)
            if refusal is not None:
                raise Overloaded(refusal)
            self._in_flight += 1
            self._oldest_in_flight_s(now)  # drops answered requests from the front
            self._admitted.append(req)
            req.future.add_done_callback(self._finished)
            self._queue.append(req)
            self._cond.notify()
        return req

    def depth(self) -> int:
        """Requests waiting to be batched."""
        return len(self._queue)

    def close(self) -> None:
        """Stop admitting; ``next_batch`` keeps releasing what is queued, then returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def next_batch(
        self, timeout: float | None = None, max_wait_ms: float | None = None
    ) -> Batch | None:
        """Block until a batch closes; None when closed and drained (or on ``timeout``).

        ``max_wait_ms`` overrides ``cfg.max_wait_ms`` for this batch (the engine passes 0 when
        no batch is running, so an idle server does not wait for company).
        """
        cfg = self.cfg
        wait_ms = cfg.max_wait_ms if max_wait_ms is None else max_wait_ms
        with self._cond:
            if not self._cond.wait_for(lambda: self._queue or self._closed, timeout):
                return None
            if not self._queue:
                return None
            first = self._queue[0]
            close_at = first.arrival + wait_ms / 1e3
            taken: list[Request] = []
            nodes = 0
            psgs = 0.0
            limit_psgs = cfg.max_batch_psgs
            while True:
                stop = None
                # the SLO cap is taken as each pass starts: the oldest request's budget shrinks
                cap = self.batch_cap(first, time.perf_counter())
                while self._queue:  # take every queued request that still fits
                    req = self._queue[0]
                    if taken and nodes + len(req.nodes) > cap:
                        stop = "nodes" if cap == cfg.max_batch_nodes else "slo"
                        break
                    if taken and limit_psgs is not None and psgs + req.psgs > limit_psgs:
                        stop = "psgs"
                        break
                    taken.append(self._queue.popleft())
                    nodes += len(req.nodes)
                    psgs += req.psgs
                if stop is None and nodes >= cap:
                    stop = "nodes" if cap == cfg.max_batch_nodes else "slo"
                if stop is None and limit_psgs is not None and psgs >= limit_psgs:
                    stop = "psgs"
                if stop is None:
                    remaining = close_at - time.perf_counter()
                    if remaining <= 0 or self._closed:
                        stop = "wait"
                    else:
                        self._cond.wait(remaining)
                        continue
                break
            self.last_cap = cap
            self._picked.append((time.perf_counter(), len(taken)))
            self._picked_sum += len(taken)
        seeds = np.concatenate([r.nodes for r in taken])
        return Batch(taken, seeds, psgs, stop)
