"""Neighbour sampling benchmark: Quiver's CPU kernel (1 and 2 threads) and its GPU-mode torch
kernel (run on the CPU here) side by side with PyG and DGL, in one run, with ratios.

Graphs: the skewed 1M-node / 20M-edge graph of issue 3 (src = perm[floor(N u^1.5)],
dst = perm[floor(N u^2)], u uniform, perm a random permutation of the ids) and, when prepared,
``products-like`` (``--products DIR``, default ``data/products-like``). Fanouts [15,10,5];
batch sizes 1, 16, 256, 1024; per-batch latency p50/p99 and sampled edges/s.

Semantics differ between libraries and are compared like for like:
- DGL's NeighborSampler expands every node of the previous block, like PyG's legacy
  NeighborSampler, torch-quiver and our default (``legacy``);
- PyG's NeighborLoader expands only each hop's new nodes: our ``frontier`` mode does the same.

Baselines run in their own environments (``make bench-env``) through
bench/baselines/sampling_worker.py on the same graph files and the same seed batches; a
baseline whose environment is missing is skipped with the reason printed. Also measured: the
sampler's working memory, the random-read limits of this machine, and (``--gen-products``)
the time to generate ``products-like``.

    .venv/bin/python bench/sampling.py                 # skewed graph (+ products-like if present)
    .venv/bin/python bench/sampling.py --quick         # 100k/2M graph, few batches (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
ENV = REPO / ".bench-env"
WORKER = REPO / "bench" / "baselines" / "sampling_worker.py"
CACHE = REPO / "data" / "bench"


def skewed_graph(n: int, e: int, seed: int = 0) -> Path:
    """The issue's skewed graph, built once and cached as a CSRTopo directory."""
    from quiver.graph import CSRTopo

    d = CACHE / f"skewed-{n}-{e}-s{seed}"
    if (d / "topo.json").exists():
        return d
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    src = perm[np.minimum((n * rng.random(e) ** 1.5).astype(np.int64), n - 1)]
    dst = perm[np.minimum((n * rng.random(e) ** 2).astype(np.int64), n - 1)]
    topo = CSRTopo.from_edge_index(np.stack([src, dst]), num_nodes=n)
    CSRTopo.from_csr(topo.indptr, topo.indices, validate=False).save(d)  # no eid: not needed
    print(f"built skewed graph {n:,} nodes / {e:,} edges in {time.perf_counter() - t0:.1f} s")
    return d


def seed_batches(n: int, batch_sizes, counts, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for bs in batch_sizes:
        out[f"bs{bs}"] = np.stack(
            [rng.choice(n, bs, replace=False) for _ in range(counts[bs])]
        ).astype(np.int64)
    return out


def time_ours(sampler, batches: np.ndarray, warmup: int = 3):
    for b in batches[:warmup]:
        sampler.sample_subgraph(torch.from_numpy(b))
    lat, edges = [], []
    for b in batches:
        seeds = torch.from_numpy(b)
        t0 = time.perf_counter()
        out = sampler.sample_subgraph(seeds)
        lat.append(time.perf_counter() - t0)
        edges.append(out.num_edges)
    return {"lat_s": lat, "edges": edges}


def run_worker(framework: str, graph: Path, seeds_file: Path, fanouts, threads: int):
    py = ENV / framework / "bin" / "python"
    if not py.exists():
        return None, f"{py} missing (run `make bench-env`)"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [
        str(py),
        str(WORKER),
        "--framework",
        framework,
        "--graph",
        str(graph),
        "--seeds",
        str(seeds_file),
        "--fanouts",
        ",".join(map(str, fanouts)),
        "--threads",
        str(threads),
    ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    except subprocess.TimeoutExpired:
        return None, "timed out after 1800 s"
    if p.returncode != 0:
        return (
            None,
            f"worker failed: {p.stderr.strip().splitlines()[-1] if p.stderr else p.returncode}",
        )
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out, out["version"]


def summarize(r) -> dict:
    lat = np.asarray(r["lat_s"]) * 1e3
    edges = np.asarray(r["edges"])
    return {
        "p50_ms": float(np.median(lat)),
        "p99_ms": float(np.percentile(lat, 99)),
        "edges_per_s": float(edges.sum() / (lat.sum() / 1e3)),
        "edges_per_batch": float(edges.mean()),
    }


def working_memory(sampler, out) -> tuple[int, int]:
    """``(working, output)`` bytes the CPU kernel allocates for one call, from its sizes.

    Working memory: the per-thread marker, the slack of ``n_id`` (grown by doubling) and the
    largest hop's per-target arrays (row starts, degrees, offsets). Output: the returned
    ``n_id`` and per-hop ``src``/``dst``/``e_id``, allocated once at their exact size. numba's
    allocations bypass Python's allocator, so this is computed rather than traced.
    """
    n = out.n_id.numel()
    hop_tmp = 0
    for h in range(out.num_hops):
        first = out.num_nodes[h - 1] if (sampler.frontier and h > 0) else 0
        hop_tmp = max(hop_tmp, 24 * (out.num_nodes[h] - first))
    working = sampler.workspace_bytes + 8 * n + hop_tmp
    return working, 8 * (n + 3 * out.num_edges)


def memory_limits(indices: np.ndarray) -> dict:
    """Random-read limits on this machine over an array as large as the graph's ``indices``."""
    import numba

    @numba.njit(nogil=True)
    def chase(nxt, start, steps):
        i = start
        for _ in range(steps):
            i = nxt[i]
        return i

    @numba.njit(parallel=True, nogil=True)
    def gather(a, pos):
        s = 0
        for i in numba.prange(pos.shape[0]):
            s += a[pos[i]]
        return s

    n = indices.shape[0]
    rng = np.random.default_rng(0)
    # one random cycle through a 2M-entry sample of slots spread over the whole array
    m = min(n, 1 << 21)
    slots = np.sort(rng.choice(n, m, replace=False))
    order = rng.permutation(m)
    nxt = np.zeros(n, dtype=np.int64)
    nxt[slots[order]] = slots[np.roll(order, -1)]
    steps = 2_000_000
    chase(nxt, slots[0], 1000)
    t0 = time.perf_counter()
    chase(nxt, slots[0], steps)
    chase_ns = (time.perf_counter() - t0) / steps * 1e9
    del nxt
    pos = rng.integers(0, n, 4_000_000)
    out = {"dependent_read_ns": chase_ns}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        gather(indices, pos[:1000])
        t0 = time.perf_counter()
        gather(indices, pos)
        out[f"independent_read_ns_{threads}t"] = (time.perf_counter() - t0) / pos.size * 1e9
    return out


def bench_graph(name, graph_dir, args, results):
    from quiver.graph import CSRTopo
    from quiver.sampling import CPUSampler, TorchSampler

    topo = CSRTopo.load(graph_dir, mmap=False)
    deg = topo.degree.numpy()
    print(
        f"\n=== {name}: {topo.node_count:,} nodes, {topo.edge_count:,} edges, in-degree "
        f"median {np.median(deg):g}, max {deg.max():,}; fanouts {args.fanouts}"
    )
    counts = {1: args.batches1, 16: args.batches16, 256: args.batches256, 1024: args.batches1024}
    seeds = seed_batches(topo.node_count, args.batch_sizes, counts)
    tmp = Path(tempfile.mkdtemp(prefix="qsb-"))
    np.savez(tmp / "seeds.npz", **seeds)
    systems = {}
    ours = [
        ("quiver CPU 1t", lambda: CPUSampler(topo, args.fanouts, seed=0, num_threads=1)),
        ("quiver CPU 2t", lambda: CPUSampler(topo, args.fanouts, seed=0, num_threads=2)),
        (
            "quiver CPU 2t frontier",
            lambda: CPUSampler(topo, args.fanouts, seed=0, num_threads=2, frontier=True),
        ),
        ("quiver GPU-mode on CPU", lambda: TorchSampler(topo, args.fanouts, seed=0)),
    ]
    for label, make in ours:
        sampler = make()
        systems[label] = {k: summarize(time_ours(sampler, v)) for k, v in seeds.items()}
        if label == "quiver CPU 2t":
            big = seeds[f"bs{max(args.batch_sizes)}"]
            sizes = [
                working_memory(sampler, sampler.sample_subgraph(torch.from_numpy(b)))
                for b in big[:5]
            ]
            work, output = max(w for w, _ in sizes), max(o for _, o in sizes)
            results.setdefault("memory", {})[name] = {
                "working_bytes": work,
                "output_bytes": output,
                "graph_bytes": topo.nbytes,
            }
            print(
                f"  batch-{max(args.batch_sizes)} call: working memory {work / 2**20:.1f} MiB "
                f"= {100 * work / topo.nbytes:.1f}% of the graph's {topo.nbytes / 2**20:.0f} "
                f"MiB (marker {sampler.workspace_bytes / 2**20:.1f} MiB); output "
                f"{output / 2**20:.1f} MiB"
            )
        del sampler
    skipped = {}
    if not args.skip_baselines:
        for framework, threads in (("dgl", 1), ("dgl", 2), ("pyg", 1)):
            out, info = run_worker(framework, graph_dir, tmp / "seeds.npz", args.fanouts, threads)
            label = f"{framework.upper()} {threads}t"
            if out is None:
                skipped[label] = info
                continue
            systems[f"{label} ({info})"] = {k: summarize(v) for k, v in out["results"].items()}
    print_table(systems, args.batch_sizes)
    for label, why in skipped.items():
        print(f"  skipped {label}: {why}")
    print_ratios(systems, args.batch_sizes)
    results[name] = {
        "systems": systems,
        "skipped": skipped,
        "nodes": topo.node_count,
        "edges": topo.edge_count,
    }


def print_table(systems, batch_sizes):
    print(
        f"  {'system':52s} {'batch':>5s} {'p50 ms':>9s} {'p99 ms':>9s} {'Medges/s':>9s} "
        f"{'edges/batch':>11s}"
    )
    for label, per in systems.items():
        for bs in batch_sizes:
            s = per[f"bs{bs}"]
            print(
                f"  {label:52s} {bs:5d} {s['p50_ms']:9.3f} {s['p99_ms']:9.3f} "
                f"{s['edges_per_s'] / 1e6:9.2f} {s['edges_per_batch']:11.0f}"
            )


def _find(systems, prefix):
    return next((v for k, v in systems.items() if k.startswith(prefix)), None)


def print_ratios(systems, batch_sizes):
    pairs = [
        ("quiver CPU 2t", "DGL 2t", "legacy vs DGL, 2 threads each"),
        ("quiver CPU 1t", "DGL 1t", "legacy vs DGL, 1 thread each"),
        ("quiver CPU 2t frontier", "PYG 1t", "frontier vs PyG NeighborLoader sampler"),
        ("quiver GPU-mode on CPU", "DGL 2t", "torch kernel on CPU vs DGL 2 threads"),
    ]
    print("  ratios (baseline p50 / ours p50 = latency speedup; ours / baseline edges/s):")
    for ours, base, what in pairs:
        a, b = _find(systems, ours), _find(systems, base)
        if a is None or b is None:
            continue
        cells = []
        for bs in batch_sizes:
            x, y = a[f"bs{bs}"], b[f"bs{bs}"]
            cells.append(
                f"bs{bs}: {y['p50_ms'] / x['p50_ms']:.2f}x / "
                f"{x['edges_per_s'] / y['edges_per_s']:.2f}x"
            )
        print(f"    {what:44s} " + "   ".join(cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--edges", type=int, default=20_000_000)
    ap.add_argument("--fanouts", type=lambda s: [int(k) for k in s.split(",")], default=[15, 10, 5])
    ap.add_argument(
        "--batch-sizes", type=lambda s: [int(k) for k in s.split(",")], default=[1, 16, 256, 1024]
    )
    ap.add_argument("--batches1", type=int, default=400)
    ap.add_argument("--batches16", type=int, default=200)
    ap.add_argument("--batches256", type=int, default=40)
    ap.add_argument("--batches1024", type=int, default=15)
    ap.add_argument(
        "--products",
        default=str(REPO / "data" / "products-like"),
        help="prepared products-like directory (skipped when absent)",
    )
    ap.add_argument(
        "--gen-products",
        action="store_true",
        help="time generating products-like into a temporary directory",
    )
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--quick", action="store_true", help="100k/2M graph, few batches")
    ap.add_argument("--json", help="write all figures to this file")
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.edges = 100_000, 2_000_000
        args.batches1, args.batches16, args.batches256, args.batches1024 = 50, 30, 10, 5
    print(
        f"bench/sampling.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  "
        f"cpus={os.cpu_count()} torch={torch.__version__}"
    )
    results = {}
    skewed = skewed_graph(args.nodes, args.edges)
    bench_graph(f"skewed {args.nodes:,}/{args.edges:,}", skewed, args, results)

    from quiver.graph import CSRTopo

    lim = memory_limits(CSRTopo.load(skewed, mmap=False).indices.numpy())
    results["memory_limits"] = lim
    print(
        f"  random reads over `indices` ({args.edges * 8 / 2**20:.0f} MiB): dependent "
        f"{lim['dependent_read_ns']:.1f} ns; independent {lim['independent_read_ns_1t']:.1f} "
        f"ns (1 thread), {lim['independent_read_ns_2t']:.1f} ns (2 threads) per read"
    )

    if args.gen_products:
        from quiver.datasets import synthetic

        with tempfile.TemporaryDirectory(dir=REPO / "data") as d:
            t0 = time.perf_counter()
            ds = synthetic("products-like", seed=0, out=d)
            secs = time.perf_counter() - t0
            results["products_generation_s"] = secs
            print(
                f"\n  products-like generated in {secs:.1f} s "
                f"({ds.manifest['generation_seconds']}); degree {ds.manifest['degree']}"
            )
    if Path(args.products, "manifest.json").exists() and not args.quick:
        bench_graph("products-like", Path(args.products), args, results)
    else:
        print(
            f"\n  products-like skipped: no prepared dataset at {args.products} "
            "(`quiver prepare --dataset products-like --out data/products-like`)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
