"""How much slower is work right after an idle gap on this machine? (Benchmark, not a test.)

Serving at light load leaves the cores idle between requests. On the 2-core VM we develop on,
the first work after a gap runs several times slower than the same work back to back (caches,
TLB and vCPU wake-up). This measures that penalty for three kinds of work, with the gap spent
sleeping or spinning, so light-load latency figures in BENCHMARKS.md can be read against it:

- 10,000 random reads from a 1 GiB array (a feature gather / CSR walk in miniature),
- a small matrix product (a model layer),
- Quiver's CPU sampler on one 1-64 seed request (``--dataset``, optional).

    .venv/bin/python bench/idle_penalty.py [--dataset data/products-like]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _measure(work, n: int, gap_s: float, mode: str) -> float:
    """Median ms of ``work(i)`` over ``n`` calls with ``gap_s`` of sleep/spin between calls."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        work(i)
        times.append((time.perf_counter() - t0) * 1e3)
        if gap_s and mode == "sleep":
            time.sleep(gap_s)
        elif gap_s:
            _spin(gap_s)
    return float(np.median(times[5:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", default=None, help="prepared dataset dir for the sampler row")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=50.0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    big = rng.integers(0, 1 << 30, size=1 << 27)  # 1 GiB of int64
    idx = [rng.integers(0, big.shape[0], size=10_000) for _ in range(args.calls)]
    small = rng.random((2000, 2000))
    works = {
        "10k random reads (1 GiB)": lambda i: big[idx[i]].sum(),
        "200x2000 @ 2000x200 matmul": lambda i: small[:200] @ small[:, :200],
    }
    if args.dataset:
        import torch

        from quiver.datasets import load_prepared
        from quiver.pyg import GraphSageSampler

        ds = load_prepared(args.dataset)
        n = ds.topo.node_count
        reqs = [
            torch.from_numpy(np.unique(rng.integers(0, n, size=rng.integers(1, 65))))
            for _ in range(args.calls)
        ]
        for threads in (1, 2):
            s = GraphSageSampler(ds.topo, [15, 10, 5], mode="CPU", seed=1, num_threads=threads)
            s.sample(reqs[0])  # kernel load
            works[f"sampler, 1 request, {threads} thread(s)"] = lambda i, s=s: s.sample(reqs[i])

    gap = args.gap_ms / 1e3
    print(f"median ms per call; gap {args.gap_ms:g} ms between calls")
    cols = ("back to back", "after sleep", "after spin", "ratio")
    print(f"{'work':34s} {cols[0]:>13s} {cols[1]:>12s} {cols[2]:>11s} {cols[3]:>6s}")
    for name, work in works.items():
        hot = _measure(work, args.calls, 0.0, "sleep")
        slept = _measure(work, args.calls, gap, "sleep")
        spun = _measure(work, args.calls, gap, "spin")
        print(f"{name:34s} {hot:13.2f} {slept:12.2f} {spun:11.2f} {slept / hot:5.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
