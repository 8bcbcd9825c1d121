"""Open-loop load generator: Poisson arrivals at a target rate, latency percentiles per rate.

Open loop means a request is sent at its scheduled arrival time whether or not earlier ones
have been answered, and its latency counts from that scheduled time, so a slow server cannot
hide queueing delay (no coordinated omission). Targets are async callables, so the same
generator drives an in-process ``Engine`` (``engine_target``) or an HTTP URL (``http_target``).
"""

from __future__ import annotations

import asyncio
import csv
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import numpy as np

#: An async target: ``await send(nodes)`` returns ``"ok"``, ``"late"``, ``"rejected"`` or
#: ``"error"``.
Target = Callable[[list[int]], Awaitable[str]]


@dataclass
class RequestMix:
    """Which requests the generator sends.

    Args:
        node_count: node ids are drawn from ``[0, node_count)``.
        min_size / max_size: request sizes are uniform in ``[min_size, max_size]`` nodes
            (default 1-64).
        zipf: 0 for uniform node ids; > 0 draws ids from a Zipf-like skew with this exponent
            over a random permutation of the nodes (hot nodes recur).
    """

    node_count: int
    min_size: int = 1
    max_size: int = 64
    zipf: float = 0.0

    def __post_init__(self):
        if not 1 <= self.min_size <= self.max_size:
            raise ValueError(
                f"request sizes need 1 <= min <= max, got {self.min_size}-{self.max_size}"
            )
        if self.node_count < 1:
            raise ValueError("node_count must be >= 1")

    def draw(self, num_requests: int, seed: int = 0) -> list[list[int]]:
        """``num_requests`` node-id lists, deterministic for a seed."""
        rng = np.random.default_rng(seed)
        sizes = rng.integers(self.min_size, self.max_size + 1, size=num_requests)
        total = int(sizes.sum())
        if self.zipf > 0:
            ranks = np.arange(1, self.node_count + 1, dtype=np.float64)
            p = ranks**-self.zipf
            p /= p.sum()
            perm = rng.permutation(self.node_count)
            ids = perm[rng.choice(self.node_count, size=total, p=p)]
        else:
            ids = rng.integers(0, self.node_count, size=total)
        out, start = [], 0
        for s in sizes:
            out.append(ids[start : start + s].tolist())
            start += s
        return out


@dataclass
class LoadResult:
    """Figures of one open-loop run at one offered rate."""

    offered_rps: float
    sent: int
    ok: int
    late: int
    rejected: int
    errors: int
    duration_s: float
    throughput_rps: float
    nodes_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    reject_p99_ms: float = float("nan")  # how fast a 429 came back (scheduled send to answer)
    reject_p50_ms: float = float("nan")
    send_lag_p99_ms: float = 0.0  # how late the generator itself sent (it shares the cores)


async def run_open_loop(
    send: Target, requests: list[list[int]], rate: float, seed: int = 0
) -> LoadResult:
    """Send ``requests`` with exponential inter-arrival times of mean ``1/rate``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(requests)))
    latencies: list[float] = []
    reject_ms: list[float] = []
    send_lag_ms: list[float] = []
    status_counts = {"ok": 0, "late": 0, "rejected": 0, "error": 0}
    answered_nodes = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(nodes: list[int], at: float) -> None:
        nonlocal answered_nodes
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        send_lag_ms.append(max(0.0, loop.time() - (t0 + at)) * 1e3)
        status = await send(nodes)
        status_counts[status] = status_counts.get(status, 0) + 1
        if status in ("ok", "late"):
            latencies.append((loop.time() - (t0 + at)) * 1e3)
            answered_nodes += len(nodes)
        elif status == "rejected":
            reject_ms.append((loop.time() - (t0 + at)) * 1e3)

    await asyncio.gather(*(one(n, a) for n, a in zip(requests, arrivals)))
    return _summary(
        rate, len(requests), status_counts, latencies, reject_ms, send_lag_ms, answered_nodes,
        loop.time() - t0,
    )  # fmt: skip


def _summary(rate, sent, counts, latencies, reject_ms, send_lag_ms, answered_nodes, duration):
    lat = np.array(latencies) if latencies else np.array([np.nan])
    answered = counts["ok"] + counts["late"]
    return LoadResult(
        offered_rps=rate,
        sent=sent,
        ok=counts["ok"],
        late=counts["late"],
        rejected=counts["rejected"],
        errors=counts["error"],
        duration_s=duration,
        throughput_rps=answered / duration,
        nodes_per_s=answered_nodes / duration,
        p50_ms=float(np.percentile(lat, 50)),
        p95_ms=float(np.percentile(lat, 95)),
        p99_ms=float(np.percentile(lat, 99)),
        reject_p99_ms=float(np.percentile(reject_ms, 99)) if reject_ms else float("nan"),
        reject_p50_ms=float(np.percentile(reject_ms, 50)) if reject_ms else float("nan"),
        send_lag_p99_ms=float(np.percentile(send_lag_ms, 99)) if send_lag_ms else 0.0,
    )


async def run_open_loop_http(
    url: str, requests: list[list[int]], rate: float, seed: int = 0, timeout_s: float = 60.0
) -> LoadResult:
    """``run_open_loop`` against ``{url}/v1/predict`` with the lean client of
    ``quiver.serving.rawclient``: the same arrivals for a seed, a fraction of the client CPU.

    Requests are encoded before the clock starts; each is written at its scheduled time on an
    idle keep-alive connection (a new one when none is idle). Answers still missing
    ``timeout_s`` after the last send count as errors.
    """
    import functools

    from quiver.serving.rawclient import RawHTTPPool

    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    host, port, encode = _predict_endpoint(url)
    payloads = [encode(n) for n in requests]
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(requests))).tolist()
    latencies: list[float] = []
    reject_ms: list[float] = []
    send_lag_ms: list[float] = []
    counts = {"ok": 0, "late": 0, "rejected": 0, "error": 0}
    answered_nodes = 0
    pending = len(requests)
    loop = asyncio.get_running_loop()
    all_done = loop.create_future()
    pool = RawHTTPPool(host, port)

    def finish(at: float, n: int, status: int, body: bytes) -> None:
        nonlocal answered_nodes, pending
        if all_done.done():  # after the timeout: already counted as an error
            return
        ms = (loop.time() - at) * 1e3
        outcome = _outcome(status, body)
        counts[outcome] += 1
        if outcome in ("ok", "late"):
            latencies.append(ms)
            answered_nodes += n
        elif outcome == "rejected":
            reject_ms.append(ms)
        pending -= 1
        if pending == 0 and not all_done.done():
            all_done.set_result(None)

    t0 = loop.time()
    try:
        for data, nodes, offset in zip(payloads, requests, arrivals):
            at = t0 + offset
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            send_lag_ms.append(max(0.0, loop.time() - at) * 1e3)
            pool.request(data, functools.partial(finish, at, len(nodes)))
        if pending:
            try:
                await asyncio.wait_for(asyncio.shield(all_done), timeout_s)
            except asyncio.TimeoutError:
                counts["error"] += pending  # never answered
                all_done.set_result(None)
    finally:
        pool.close()
    return _summary(
        rate, len(requests), counts, latencies, reject_ms, send_lag_ms, answered_nodes,
        loop.time() - t0,
    )  # fmt: skip


def engine_target(engine) -> Target:
    """A target that submits to an in-process ``quiver.serving.Engine``."""
    from quiver.serving.batcher import Overloaded, ShuttingDown

    async def send(nodes: list[int]) -> str:
        try:
            fut = engine.submit(nodes)
        except (Overloaded, ShuttingDown):
            return "rejected"
        try:
            res = await asyncio.wrap_future(fut)
        except Overloaded:  # shed after queueing past its deadline budget: a 429 over HTTP
            return "rejected"
        except Exception:
            return "error"
        return "late" if res.late else "ok"

    return send


async def http_target(url: str, connections: int = 512, token: str | None = None):
    """A target posting to ``{url}/v1/predict``; returns ``(send, aclose)``. Call in a loop.

    Uses the lean keep-alive client of ``quiver.serving.rawclient`` (as ``run_open_loop_http``
    does), so the generator costs far less CPU than the server it measures when both share the
    cores; ``connections`` caps the open connections; ``token`` is sent as a Bearer token
    (a server started with ``--auth predict``).
    """
    from quiver.serving.rawclient import RawHTTPPool

    host, port, encode = _predict_endpoint(url, token)
    pool = RawHTTPPool(host, port, max_connections=connections)

    async def send(nodes: list[int]) -> str:
        done = asyncio.get_running_loop().create_future()
        pool.request(encode(nodes), lambda status, body: done.set_result((status, body)))
        status, body = await done
        return _outcome(status, body)

    async def close() -> None:
        pool.close()

    return send, close


def _predict_endpoint(url: str, token: str | None = None):
    """``(host, port, encode)`` for ``{url}/v1/predict``; ``encode(nodes)`` gives request bytes."""
    import json
    from urllib.parse import urlsplit

    from quiver.serving.rawclient import encode_post

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path.rstrip("/") + "/v1/predict"

    def encode(nodes: list[int]) -> bytes:
        return encode_post(f"{host}:{port}", path, json.dumps({"nodes": nodes}).encode(), token)

    return host, port, encode


def _outcome(status: int, body: bytes) -> str:
    """``ok``, ``late``, ``rejected`` or ``error`` for one HTTP answer (status 0: none came)."""
    if status == 200:
        return "late" if b'"late":true' in body or b'"late": true' in body else "ok"
    return "rejected" if status == 429 else "error"


def sweep(
    make_target: Callable[[], Awaitable[tuple[Target, Callable[[], Awaitable[None]]]]],
    mix: RequestMix,
    rates: list[float],
    duration_s: float = 5.0,
    max_requests: int = 20000,
    seed: int = 0,
    progress: bool = True,
) -> list[LoadResult]:
    """Run one open-loop load per rate (each ``duration_s`` long, bounded by ``max_requests``).

    ``make_target()`` is awaited once per rate and returns ``(send, close)``.
    """
    from tqdm import tqdm

    results = []
    for i, rate in enumerate(tqdm(rates, desc="load sweep", unit="rate", disable=not progress)):
        n = max(1, min(max_requests, int(rate * duration_s)))
        reqs = mix.draw(n, seed=seed + i)

        async def go(reqs=reqs, rate=rate, i=i):
            send, close = await make_target()
            try:
                # warm-up: a few sequential requests so first-call costs are not measured
                for nodes in reqs[:3]:
                    await send(nodes)
                return await run_open_loop(send, reqs, rate, seed=seed + i)
            finally:
                await close()

        results.append(asyncio.run(go()))
        time.sleep(0.2)  # let the server drain between rates
    return results


def sustained_rps(results: list[LoadResult], slo_ms: float) -> float:
    """Highest throughput among runs whose p99 met the SLO with nothing rejected or failed."""
    good = [
        r.throughput_rps
        for r in results
        if r.p99_ms <= slo_ms and r.rejected == 0 and r.errors == 0 and r.sent > 0
    ]
    return max(good, default=0.0)


def write_csv(path, results: list[LoadResult], label: str = "") -> None:
    rows = [{"system": label, **asdict(r)} for r in results]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot(path, curves: dict[str, list[LoadResult]], slo_ms: float | None = None) -> None:
    """Latency (p50 and p99) against achieved throughput, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, res in curves.items():
        x = [r.throughput_rps for r in res]
        line = ax.plot(x, [r.p99_ms for r in res], marker="o", label=f"{label} p99")[0]
        ax.plot(x, [r.p50_ms for r in res], ls="--", color=line.get_color(), label=f"{label} p50")
    if slo_ms:
        ax.axhline(slo_ms, color="grey", lw=0.8, ls=":", label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(curves: dict[str, list[LoadResult]]) -> str:
    """A plain-text table of every run."""
    head = (
        f"{'system':<10} {'offered':>8} {'rps':>8} {'nodes/s':>9} {'p50ms':>7} {'p95ms':>7} "
        f"{'p99ms':>7} {'late':>5} {'rej':>5} {'err':>4}"
    )
    lines = [head]
    for label, res in curves.items():
        for r in res:
            lines.append(
                f"{label:<10} {r.offered_rps:>8.0f} {r.throughput_rps:>8.1f} {r.nodes_per_s:>9.0f} "
                f"{r.p50_ms:>7.2f} {r.p95_ms:>7.2f} {r.p99_ms:>7.2f} {r.late:>5} {r.rejected:>5} "
                f"{r.errors:>4}"
            )
    return "\n".join(lines)
