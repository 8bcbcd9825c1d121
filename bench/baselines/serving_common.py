"""What the PyG and DGL serving baselines share: dataset files, the request file, the rate sweep.

Runs in any of the three environments (main venv, `.bench-env/pyg`, `.bench-env/dgl`): it needs
only numpy and the standard library, and loads `quiver.serving.loadgen` by file path, since our
package does not install in the DGL env (it needs torch >= 2.3).

A baseline server is a `ThreadPoolServer` subclass that implements `logits(seeds)` (classes
are its argmax; one request, no cross-request batching, as PyG/DGL users serve); `send` is
the async target `loadgen.run_open_loop` drives, the same interface as Quiver's
`loadgen.engine_target`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
LOADGEN_PATH = REPO / "src" / "quiver" / "serving" / "loadgen.py"

#: Sequential requests sent before the first rate, so first-call costs (JIT, allocator, page
#: cache) are not measured.
WARMUP_REQUESTS = 20


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


# ---- serving ------------------------------------------------------------------------------------
class ThreadPoolServer:
    """One request at a time per worker thread: sample, gather, forward, answer.

    Args:
        num_workers: worker threads (PyG/DGL users run a small pool; 1 or 2 on 2 cores).
        slo_ms: a request answered later than this after its arrival counts as late.
        max_queue_ms: a request that waited this long before a worker picked it up is shed
            (answered "rejected" without work), so an overloaded run drains in bounded time;
            such a run already misses any SLO, so shedding changes no sustained figure.
    """

    def __init__(self, num_workers: int, slo_ms: float = 30.0, max_queue_ms: float = 1000.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.slo_ms = slo_ms
        self.max_queue_ms = max_queue_ms
        self.pool = ThreadPoolExecutor(num_workers, thread_name_prefix="baseline")
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
    """Sweep the rates of `args.requests`, write `args.out` JSON (results and stage times)."""
    rates, requests, seeds = load_requests(args.requests)
    t0 = time.perf_counter()
    stop_ms = args.stop_ms or args.slo_ms
    # shed only requests that already waited far past any figure the sweep reports
    server.max_queue_ms = max(server.max_queue_ms, 3 * stop_ms)
    results = run_sweep(server.send, rates, requests, seeds, stop_ms, progress=print)
    served = max(server.num_served, 1)
    out = {
        "results": results,
        "num_workers": server.num_workers,
        "wall_s": time.perf_counter() - t0,
        # mean per-request stage times (ms), over every request served (warm-up included)
        "stage_ms": {k: v * 1e3 / served for k, v in server.stage_s.items()},
    }
    server.close()
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def add_common_args(p) -> None:
    """Options every baseline server takes."""
    p.add_argument("dataset_dir", help="prepared dataset directory")
    p.add_argument("--requests", help="request file written by bench/serving.py (.npz)")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--workers", type=int, default=1, help="worker threads (1)")
    p.add_argument("--torch-threads", type=int, default=0, help="intra-op threads (0: 2/workers)")
    p.add_argument("--slo-ms", type=float, default=30.0, help="latency SLO (30 ms)")
    p.add_argument(
        "--stop-ms",
        type=float,
        default=0.0,
        help="stop the sweep after two rates with p99 above this (0: the SLO)",
    )
    p.add_argument(
        "--verify", help="npz with seeds and Quiver's logits: check our logits equal them, exit"
    )


def torch_threads(args) -> int:
    import os

    cores = os.cpu_count() or 1
    return args.torch_threads or max(1, cores // args.workers)


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
