"""What the PyG and DGL serving baselines share: dataset files, the request file, the rate sweep.

Runs in any of the three environments (main venv, `.bench-env/pyg`, `.bench-env/dgl`): it needs
only numpy and the standard library, and loads `quiver.serving.loadgen` by file path, since our
package does not install in the DGL env (it needs torch >= 2.3).

A baseline server is a `ThreadPoolServer` subclass that implements `logits(seeds)` (classes
are its argmax; one request, no cross-request batching, as PyG/DGL users serve); `send` is
the async target `loadgen.run_open_loop` drives, the same interface as Quiver's
`loadgen.engine_target`.

The rate search (`search_configs`) is shared too, so every system is measured by one rule:
a coarse rate grid per configuration, then a bisection of each latency bound's knee
(`next_probe`) between the last rate that met it and the first that did not. The requests of
a rate are a function of the rate and the plan's seed (`requests_for`), so every system that
runs a rate runs the same requests at the same arrival times.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
LOADGEN_PATH = REPO / "src" / "quiver" / "serving" / "loadgen.py"

#: Sequential requests sent before the first rate, so first-call costs (JIT, allocator, page
#: cache) are not measured.
WARMUP_REQUESTS = 20
#: ... and before a refinement probe of a configuration that was not the last one run (its
#: threads are new, the rest is warm).
REWARM_REQUESTS = 5


def load_loadgen():
    """`quiver.serving.loadgen` loaded from its file (no `quiver` import needed)."""
    name = "quiver_loadgen_by_path"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, LOADGEN_PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def load_graph(dataset_dir) -> tuple[np.ndarray, np.ndarray, int]:
    """`(indptr (N+1,), indices (E,), N)` of a prepared directory; row v = in-neighbours of v."""
    d = Path(dataset_dir)
    # read into RAM (not memory-mapped): the baselines' best case
    indptr = np.load(d / "indptr.npy")
    indices = np.load(d / "indices.npy")
    return np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64), len(indptr) - 1


def load_features(dataset_dir) -> np.ndarray:
    """`(N, F)` float32 features, read into RAM (the baselines' best case: no page faults)."""
    return np.ascontiguousarray(np.load(Path(dataset_dir) / "features.npy"), dtype=np.float32)


# ---- request file -------------------------------------------------------------------------------
def save_requests(path, rates: list[float], requests: list[list[list[int]]], seeds: list[int]):
    """Write one request list per rate (`requests[r]` is a list of node-id lists) to an .npz."""
    arrays = {"rates": np.asarray(rates, dtype=np.float64), "seeds": np.asarray(seeds)}
    for r, reqs in enumerate(requests):
        sizes = np.asarray([len(q) for q in reqs], dtype=np.int64)
        arrays[f"offsets_{r}"] = np.concatenate([[0], np.cumsum(sizes)])
        arrays[f"ids_{r}"] = np.asarray([i for q in reqs for i in q], dtype=np.int64)
    np.savez(path, **arrays)


def load_requests(path) -> tuple[list[float], list[list[list[int]]], list[int]]:
    """Inverse of `save_requests`: `(rates, requests per rate, arrival seed per rate)`."""
    z = np.load(path)
    rates = [float(r) for r in z["rates"]]
    out = []
    for r in range(len(rates)):
        off, ids = z[f"offsets_{r}"], z[f"ids_{r}"]
        out.append([ids[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)])
    return rates, out, [int(s) for s in z["seeds"]]


# ---- the rate search ----------------------------------------------------------------------------
@dataclass
class Plan:
    """How every system's rates are searched (written by `bench/serving.py`, read by all).

    Args:
        rates: the coarse grid, requests/s, ascending.
        bounds_ms: the p99 bounds whose knee is bisected.
        stop_ms: the coarse sweep stops after two rates in a row miss this p99 (the largest
            bound: higher rates only do worse).
        tol: bisect until the first failing rate is within ``1 + tol`` of the last passing.
        refine_steps: at most this many probes per configuration and bound.
        node_count / min_size / max_size: the request mix (uniform ids, uniform sizes).
        duration_s / min_requests / max_requests: requests per rate: ``rate x duration``,
            clamped to ``[min_requests, max_requests]``.
        seed: requests and arrivals of a rate are drawn from it and the rate.
    """

    rates: list[float]
    bounds_ms: list[float]
    stop_ms: float
    node_count: int
    tol: float = 0.10
    refine_steps: int = 3
    min_size: int = 1
    max_size: int = 64
    duration_s: float = 8.0
    min_requests: int = 40
    max_requests: int = 6000
    seed: int = 0
    extra: dict = field(default_factory=dict)  # what a system's own driver adds

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path) -> Plan:
        return cls(**json.loads(Path(path).read_text()))


def requests_for(plan: Plan, rate: float) -> tuple[list[list[int]], int]:
    """``(requests, arrival seed)`` of one rate: the same for every system that runs it."""
    lg = load_loadgen()
    n = max(plan.min_requests, min(plan.max_requests, int(rate * plan.duration_s)))
    key = int(round(rate * 100))
    mix = lg.RequestMix(plan.node_count, plan.min_size, plan.max_size)
    return mix.draw(n, seed=plan.seed + key), plan.seed + 100 + key


def _passes(r: dict, bound_ms: float) -> bool:
    return (
        r["sent"] > 0
        and r["rejected"] == 0
        and r["errors"] == 0
        and math.isfinite(r["p99_ms"])
        and r["p99_ms"] <= bound_ms
    )


def knee(points: list[dict], bound_ms: float) -> tuple[float, float | None]:
    """``(lo, hi)``: the highest offered rate whose p99 met the bound (0 if none) and the
    lowest rate above it that did not (None if none). Results are `LoadResult` dicts."""
    lo = max((r["offered_rps"] for r in points if _passes(r, bound_ms)), default=0.0)
    hi = min(
        (r["offered_rps"] for r in points if r["offered_rps"] > lo and not _passes(r, bound_ms)),
        default=None,
    )
    return lo, hi


def next_probe(
    points: list[dict], bound_ms: float, tol: float = 0.10, floor: float = 0.0
) -> float | None:
    """The next rate to run for this bound, or None when its knee is resolved.

    Bisects (geometrically) between the last rate that met ``bound_ms`` and the first that did
    not, until they are within a factor ``1 + tol``. None also when nothing met the bound
    (the figure is 0 at the grid's lowest rate), when nothing above the passing rate failed
    (the system met it at every rate tried), or when the failing rate is at most ``floor``:
    another configuration already met the bound there, so this one cannot be the best.
    """
    if tol <= 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    lo, hi = knee(points, bound_ms)
    if lo <= 0 or hi is None or hi <= floor or hi <= lo * (1 + tol):
        return None
    return round(math.sqrt(lo * hi), 1)


def search_configs(
    configs: list[str], activate, plan: Plan, progress=print
) -> dict[str, list[dict]]:
    """Every configuration's coarse sweep, then the bisection of each bound's knee.

    Args:
        configs: labels of the configurations (e.g. ``"2w x 1t"``).
        activate: ``activate(label, warmup: int) -> send``: makes that configuration the one
            serving, sends ``warmup`` sequential requests through it, returns its target.
        plan: rates, bounds and requests.

    Returns ``{label: [LoadResult dicts, ascending offered rate]}``. A bound is refined first
    on the configuration that met it at the highest rate; another is refined only while its
    first failing rate is above that (it could still be the best).
    """
    lg = load_loadgen()
    points: dict[str, list[dict]] = {}
    active = None

    def run(label: str, rate: float) -> dict:
        reqs, seed = requests_for(plan, rate)
        res = asdict(asyncio.run(lg.run_open_loop(send, reqs, rate, seed=seed)))
        progress(
            f"  {label:<10} {rate:>7.1f}/s: {res['throughput_rps']:7.1f} rps, p50 "
            f"{res['p50_ms']:7.2f} ms, p99 {res['p99_ms']:8.2f} ms, late {res['late']}, "
            f"shed {res['rejected']}"
        )
        time.sleep(0.2)  # let the server drain between rates
        return res

    for label in configs:
        send = activate(label, WARMUP_REQUESTS)
        active = label
        points[label] = []
        failed = 0
        for rate in plan.rates:
            res = run(label, rate)
            points[label].append(res)
            failed = 0 if _passes(res, plan.stop_ms) else failed + 1
            if failed >= 2:
                break
    for bound in sorted(plan.bounds_ms):
        order = sorted(configs, key=lambda c: -knee(points[c], bound)[0])
        for label in order:
            for _ in range(plan.refine_steps):
                floor = max((knee(points[c], bound)[0] for c in configs if c != label), default=0)
                rate = next_probe(points[label], bound, plan.tol, floor)
                if rate is None:
                    break
                if active != label:
                    send = activate(label, REWARM_REQUESTS)
                    active = label
                points[label].append(run(f"{label} (p99<={bound:g})", rate))
    return {k: sorted(v, key=lambda r: r["offered_rps"]) for k, v in points.items()}


def parse_thread_configs(text: str) -> list[tuple[int, int]]:
    """``"1x1,1x2,2x1"`` -> ``[(workers, threads per worker), ...]``; ValueError when malformed.

    Combinations using more threads than there are cores are allowed (the caller warns)."""
    out = []
    for item in text.split(","):
        w, sep, t = item.strip().partition("x")
        if not sep or not w.isdigit() or not t.isdigit() or int(w) < 1 or int(t) < 1:
            raise ValueError(f"configs: write WORKERSxTHREADS, e.g. 2x1; got {item!r}")
        out.append((int(w), int(t)))
    return out


def config_label(workers: int, threads: int) -> str:
    return f"{workers}w x {threads}t"


# ---- serving ------------------------------------------------------------------------------------
class ThreadPoolServer:
    """One request at a time per worker thread: sample, gather, forward, answer.

    Args:
        num_workers: worker threads (PyG/DGL users run a small pool; 1 or 2 on 2 cores).
        slo_ms: a request answered later than this after its arrival counts as late.
        max_queue_ms: a request that waited this long before a worker picked it up is shed
            (answered "rejected" without work), so an overloaded run drains in bounded time;
            such a run already misses any SLO, so shedding changes no sustained figure.
        torch_threads: intra-op threads each worker thread sets for itself (0: leave them).

    ``configure(workers, threads)`` replaces the pool (new threads, new thread settings).
    """

    def __init__(
        self,
        num_workers: int,
        slo_ms: float = 30.0,
        max_queue_ms: float = 1000.0,
        torch_threads: int = 0,
    ):
        self.slo_ms = slo_ms
        self.max_queue_ms = max_queue_ms
        self.pool = None
        self.configure(num_workers, torch_threads)

    def set_threads(self, num_threads: int) -> None:
        """Run in each new worker thread: give it ``num_threads`` intra-op threads (override)."""

    def configure(self, num_workers: int, torch_threads: int = 0) -> None:
        """A new pool of ``num_workers`` threads, each with ``torch_threads`` intra-op threads;
        stage times and the served count start again from zero."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.num_workers = num_workers
        self.torch_threads = torch_threads
        init = (self.set_threads, (torch_threads,)) if torch_threads else (None, ())
        self.pool = ThreadPoolExecutor(
            num_workers, thread_name_prefix="baseline", initializer=init[0], initargs=init[1]
        )
        self.stage_s = {"sample": 0.0, "gather": 0.0, "model": 0.0}
        self.num_served = 0

    def logits(self, seeds: np.ndarray) -> np.ndarray:
        """Logits `(n, classes)` of `seeds` (int64 `(n,)`, unique), one forward pass."""
        raise NotImplementedError

    def _predict(self, seeds: np.ndarray) -> np.ndarray:
        """Class ids of `seeds`: the argmax of `logits`."""
        return self.logits(seeds).argmax(axis=1)

    def _handle(self, nodes: list[int], arrival: float) -> str:
        if (time.perf_counter() - arrival) * 1e3 > self.max_queue_ms:
            return "rejected"
        unique, inverse = np.unique(np.asarray(nodes, dtype=np.int64), return_inverse=True)
        classes = self._predict(unique)[inverse]
        assert classes.shape == (len(nodes),), "one answer per requested node"
        self.num_served += 1
        return "late" if (time.perf_counter() - arrival) * 1e3 > self.slo_ms else "ok"

    async def send(self, nodes: list[int]) -> str:
        """The loadgen target: run one request on the pool, return its status."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, self._handle, nodes, time.perf_counter())
        except Exception:
            return "error"

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def run_sweep(
    send,
    rates: list[float],
    requests: list[list[list[int]]],
    seeds: list[int],
    stop_ms: float,
    max_failed_rates: int = 2,
    progress=print,
) -> list[dict]:
    """Open-loop run per rate on the given requests; stops once `max_failed_rates` in a row have
    p99 above `stop_ms` or shed requests (higher rates only do worse). Returns `LoadResult`
    dicts, one per rate run."""
    lg = load_loadgen()

    async def warm():
        for nodes in requests[0][:WARMUP_REQUESTS]:
            await send(nodes)

    asyncio.run(warm())
    results, failed = [], 0
    for rate, reqs, seed in zip(rates, requests, seeds):
        res = asyncio.run(lg.run_open_loop(send, reqs, rate, seed=seed))
        results.append(asdict(res))
        progress(
            f"  rate {rate:>7.0f}/s: {res.throughput_rps:7.1f} rps, p50 {res.p50_ms:7.2f} ms, "
            f"p99 {res.p99_ms:8.2f} ms, late {res.late}, shed {res.rejected}"
        )
        ok = res.p99_ms <= stop_ms and res.rejected == 0 and res.errors == 0
        failed = 0 if ok else failed + 1
        if failed >= max_failed_rates:
            break
        time.sleep(0.2)  # let the server drain between rates
    return results


def bench_main(server: ThreadPoolServer, args) -> None:
    """Search the plan of ``args.plan`` over the thread configurations of ``args.configs``;
    write ``args.out`` JSON (results and stage times per configuration)."""
    import os

    plan = Plan.load(args.plan)
    t0 = time.perf_counter()
    # shed only requests that already waited far past any figure the sweep reports
    server.max_queue_ms = max(server.max_queue_ms, 3 * plan.stop_ms)
    configs = {config_label(w, t): (w, t) for w, t in parse_thread_configs(args.configs)}
    cores = os.cpu_count() or 1
    stages: dict[str, dict] = {}

    def book() -> None:
        """Add the serving configuration's stage times to its totals."""
        label = config_label(server.num_workers, server.torch_threads)
        tot = stages.setdefault(label, {"served": 0, **{k: 0.0 for k in server.stage_s}})
        tot["served"] += server.num_served
        for k, v in server.stage_s.items():
            tot[k] += v

    def activate(label: str, warmup: int):
        book()
        w, t = configs[label]
        server.configure(w, t)
        note = " (more threads than cores)" if w * t > cores else ""
        print(f"  configuration {label}{note}", flush=True)

        async def warm():
            reqs, _ = requests_for(plan, plan.rates[0])
            for nodes in reqs[:warmup]:
                await server.send(nodes)

        asyncio.run(warm())
        return server.send

    results = search_configs(list(configs), activate, plan, progress=print)
    book()
    out = {
        "results": results,
        "configs": {k: list(v) for k, v in configs.items()},
        "wall_s": time.perf_counter() - t0,
        # mean per-request stage times (ms) per configuration, over every request it served
        "stage_ms": {
            k: {s: v[s] * 1e3 / max(v["served"], 1) for s in server.stage_s}
            for k, v in stages.items()
            if v["served"]
        },
    }
    server.close()
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def add_common_args(p) -> None:
    """Options every baseline server takes."""
    p.add_argument("dataset_dir", help="prepared dataset directory")
    p.add_argument("--plan", help="rate-search plan written by bench/serving.py (.json)")
    p.add_argument("--out", help="results JSON")
    p.add_argument(
        "--configs",
        default="1x1,1x2,2x1",
        help="thread configurations to search, WORKERSxTHREADS (worker threads x intra-op "
        "threads each), e.g. 1x1,1x2,2x1 (default)",
    )
    p.add_argument("--slo-ms", type=float, default=30.0, help="latency SLO (30 ms)")
    p.add_argument(
        "--verify", help="npz with seeds and Quiver's logits: check our logits equal them, exit"
    )


def verify_main(logits_fn, path) -> None:
    """Compare `logits_fn(seeds)` with Quiver's logits stored in `path`; exit 1 when unequal."""
    z = np.load(path)
    seeds, want = z["seeds"], z["logits"]
    got = np.asarray(logits_fn(seeds))
    err = float(np.abs(got - want).max())
    same_class = bool((got.argmax(1) == want.argmax(1)).all())
    ok = got.shape == want.shape and err < 1e-4 and same_class
    print(f"verify: {len(seeds)} seeds, max |logit diff| {err:.2e}, equal classes {same_class}")
    if not ok:
        sys.exit("verify: FAILED: predictions differ from Quiver's")
    print("verify: OK")
