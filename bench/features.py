"""Feature placement and gather throughput: FAP vs degree vs random placement.

For cache sizes of 5/10/20/40% of rows, on a prepared dataset (default ``products-like``) with
fanouts [15,10,5], under a uniform and a skewed (Zipf) request stream: the fast tier's hit
rate and the gather throughput (GB/s) of :class:`quiver.Feature` for each placement, beside the
machine's limits (a random-row ``index_select`` from RAM with all rows resident, and a
sequential memcpy). Then features served from the memory-mapped ``features.npy`` with a RAM
cache of 14% of rows (papers-like's 8 GB over 57 GB), two passes.
(Benchmark, not a test.)

    .venv/bin/python bench/features.py --dataset data/products-like
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from quiver.datasets import load_prepared
from quiver.feature import Feature, hot_order
from quiver.pyg import GraphSageSampler

PLACEMENTS = ("fap", "degree", "random")


def _best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def request_stream(n, sampler, num_requests, request_size, q, rng):
    """``(log, n_ids)``: the seeds of each request and the node ids its sampled subgraph reads."""
    n_ids = []
    for _ in range(num_requests):
        seeds = np.unique(rng.choice(n, size=request_size, p=q))
        n_ids.append(sampler.sample(torch.from_numpy(seeds))[0])
    return n_ids


def _evict(path: Path) -> None:
    """Drop the file's pages from the OS page cache, so reads go to the disk (cold start)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def machine_limits(x: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """GB/s of a random-row index_select from RAM and of a sequential copy of all rows."""
    out = torch.empty((ids.numel(), x.shape[1]), dtype=x.dtype)
    row = x.shape[1] * x.element_size()
    t = _best_of(lambda: torch.index_select(x, 0, ids, out=out))
    rand = ids.numel() * row / t / 1e9
    y = torch.empty_like(x)
    t = _best_of(lambda: y.copy_(x))
    seq = x.numel() * x.element_size() / t / 1e9
    return rand, seq


def gather_stream(feat: Feature, n_ids) -> tuple[float, float]:
    """(fast-tier hit rate, GB/s) of gathering every request's rows."""
    feat.reset_stats()
    row = feat.shape[1] * feat.dtype.itemsize
    rows = sum(i.numel() for i in n_ids)
    for i in n_ids[:20]:  # warm-up
        feat[i]
    feat.reset_stats()
    t = _best_of(lambda: [feat[i] for i in n_ids], repeats=2)
    s = feat.stats()
    fast = feat.tiers[0].name
    hit = s["rows"][fast] / s["total"]
    return hit, rows * row / t / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="data/products-like")
    ap.add_argument("--sizes", default="15,10,5")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--request-size", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--fractions", default="0.05,0.1,0.2,0.4")
    ap.add_argument(
        "--mmap-dataset", default=None, help="dataset for the mmap test (default: --dataset)"
    )
    ap.add_argument("--ram-cache-fraction", type=float, default=0.14)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    if not Path(args.dataset, "manifest.json").exists():
        raise SystemExit(f"{args.dataset} is not a prepared dataset (run `quiver prepare`)")
    data = load_prepared(args.dataset)
    topo = data.topo
    x = data.features.clone().contiguous()  # all rows resident in RAM
    n, dim = x.shape
    row = dim * x.element_size()
    rng = np.random.default_rng(args.seed)
    print(f"== {args.dataset}: {n:,} rows x {dim} {x.dtype} ({n * row / 2**30:.2f} GiB)")
    sampler = GraphSageSampler(topo, sizes, mode="CPU", seed=args.seed)

    w = 1.0 / np.arange(1, n + 1) ** args.zipf
    zipf_q = rng.permutation(w / w.sum())
    streams = {"uniform": None, "zipf": zipf_q}
    results = {}
    for sname, q in streams.items():
        t0 = time.perf_counter()
        n_ids = request_stream(n, sampler, args.requests, args.request_size, q, rng)
        total_rows = sum(i.numel() for i in n_ids)
        # FAP learns from a separate request log of the same distribution
        log = None if q is None else rng.choice(n, size=200_000, p=q)
        orders = {
            p: hot_order(p, n, topo, sizes, seed_prob=log, batch_size=args.request_size)
            for p in PLACEMENTS
        }
        print(
            f"\n-- {sname} stream: {args.requests} requests x {args.request_size} seeds, "
            f"{total_rows:,} rows read ({time.perf_counter() - t0:.0f} s to sample + place)"
        )
        print(
            f"{'cache':>6} " + " ".join(f"{p + ' hit':>11} {p + ' GB/s':>11}" for p in PLACEMENTS)
        )
        for frac in fractions:
            cells = []
            for p in PLACEMENTS:
                # the CPU tiering (d): a RAM cache of hot rows over the memory-mapped file
                feat = Feature(host_cache_size=int(frac * n) * row, order=orders[p])
                feat.from_mmap(Path(args.dataset) / "features.npy")
                hit, gbs = gather_stream(feat, n_ids)
                results[(sname, frac, p)] = (hit, gbs)
                cells.append(f"{hit * 100:10.1f}% {gbs:11.2f}")
                feat.close()
                del feat
            print(f"{frac * 100:5.0f}% " + " ".join(cells))
        fa, de = results[(sname, 0.1, "fap")][0], results[(sname, 0.1, "degree")][0]
        print(f"   at 10%: FAP hit rate - degree hit rate = {(fa - de) * 100:+.1f} points")

    # the machine's limits vs the RAM tier (all rows in host memory, one tier)
    ids = torch.cat(n_ids)
    rand, seq = machine_limits(x, ids)
    ram = Feature(order=orders["fap"]).from_cpu_tensor(x)  # one RAM tier, FAP-ordered rows
    buf = torch.empty((ids.numel(), dim), dtype=x.dtype)
    ram_gbs = ids.numel() * row / _best_of(lambda: ram.gather(ids, out=buf)) / 1e9
    fresh_gbs = ids.numel() * row / _best_of(lambda: ram[ids]) / 1e9
    print(
        f"\n-- limits ({ids.numel():,} rows): random-row index_select {rand:.2f} GB/s, "
        f"sequential memcpy {seq:.2f} GB/s; Feature RAM tier gather into a preallocated "
        f"output {ram_gbs:.2f} GB/s = {ram_gbs / rand * 100:.0f}% of the random-gather limit "
        f"(into a fresh output each call: {fresh_gbs:.2f} GB/s)"
    )

    # memory-mapped file + RAM cache (DESIGN (d)); papers-like's 8 GB cache over its 57 GB of
    # features is 14% of rows, the default fraction here
    mdir = Path(args.mmap_dataset or args.dataset)
    path = mdir / "features.npy"
    mtopo = load_prepared(mdir).topo if args.mmap_dataset else topo
    arr = np.load(path, mmap_mode="r")
    cache = int(args.ram_cache_fraction * arr.shape[0]) * arr.shape[1] * arr.itemsize
    t0 = time.perf_counter()
    feat = Feature(
        csr_topo=mtopo, host_cache_size=cache, sizes=sizes, batch_size=args.request_size
    ).from_mmap(path)
    print(
        f"\n-- {path} memory-mapped ({path.stat().st_size / 2**30:.2f} GiB), RAM cache "
        f"{cache / 2**30:.2f} GiB = {args.ram_cache_fraction:.0%} of rows, FAP placement "
        f"({time.perf_counter() - t0:.0f} s to place and fill)"
    )
    mn = mtopo.node_count
    msampler = GraphSageSampler(mtopo, sizes, mode="CPU", seed=args.seed)
    m_ids = request_stream(mn, msampler, args.requests, args.request_size, None, rng)
    rows = sum(i.numel() for i in m_ids)
    # POSIX_FADV_DONTNEED first; pages this process maps may stay cached, so pass 1 is only
    # "colder": on this 24 GiB machine the 0.9 GiB file is page-cache resident either way
    _evict(path)
    for rnd in (1, 2):
        feat.reset_stats()
        t0 = time.perf_counter()
        for i in m_ids:
            feat[i]
        dt = time.perf_counter() - t0
        share = feat.stats()["share"]
        print(
            f"   pass {rnd}: RAM-cache hit rate {share['host'] * 100:.1f}%, "
            f"gather {rows * arr.shape[1] * arr.itemsize / dt / 1e9:.2f} GB/s "
            f"({rows:,} rows, {args.requests} requests)"
        )
    feat.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
