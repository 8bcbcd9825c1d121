"""``make demo`` for Quiver: runs each capability that exists, on an embedded default.

Add a step to ``STEPS`` per capability; each is a function of a scratch directory (removed at
the end) that prints its own results. Steps share data through helpers like ``small_dataset``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path


def _info(work: Path) -> None:
    from quiver.cli import main as cli_main

    cli_main(["info"])


def small_dataset(work: Path) -> Path:
    """The demo's dataset: the ``small`` preset, generated once into ``work/small``."""
    d = work / "small"
    if not (d / "manifest.json").exists():
        from quiver.datasets import synthetic

        synthetic("small", seed=0, out=d)
    return d


def _prepare_and_sample(work: Path) -> None:
    """``quiver prepare`` on the small preset, then our sampler's throughput on a 100k-node
    products-like graph (same degree shape, 1/24 of the nodes)."""
    import numpy as np
    import torch

    from quiver.cli import main as cli_main
    from quiver.datasets import scaled, synthetic
    from quiver.pyg import GraphSageSampler

    cli_main(["prepare", "--dataset", "small", "--out", str(work / "small"), "--no-progress"])
    ds = synthetic(scaled("products-like", 100_000), seed=0)
    print(f"   products-like at 100k nodes: {ds.topo.edge_count:,} edges")
    rng = np.random.default_rng(0)
    for mode in ("CPU", "GPU"):
        sampler = GraphSageSampler(ds.topo, [15, 10, 5], mode=mode, seed=0)
        for bs, reps in ((1, 200 if mode == "CPU" else 20), (1024, 10 if mode == "CPU" else 2)):
            batches = [
                torch.from_numpy(rng.choice(100_000, bs, replace=False)) for _ in range(reps)
            ]
            sampler.sample(batches[0])  # warm-up (compiles or loads the kernel)
            lat, edges = [], 0
            for b in batches:
                t0 = time.perf_counter()
                _, _, adjs = sampler.sample(b)
                lat.append(time.perf_counter() - t0)
                edges += sum(a.edge_index.size(1) for a in adjs)
            label = "CPU (numba)" if mode == "CPU" else "GPU-mode torch kernel on CPU"
            print(
                f"   {label:30s} batch {bs:4d}: p50 {1e3 * np.median(lat):8.3f} ms, "
                f"{edges / sum(lat) / 1e6:6.2f} M sampled edges/s"
            )


def _workload_and_features(work: Path) -> None:
    """PSGS and FAP on the ``small`` preset; FAP vs degree vs random placement; PSGS routing."""
    import numpy as np
    import torch

    from quiver.datasets import load_prepared
    from quiver.feature import Feature
    from quiver.hybrid import HybridSampler
    from quiver.pyg import GraphSageSampler
    from quiver.serving.loadgen import RequestMix
    from quiver.workload import psgs

    ds = load_prepared(small_dataset(work))
    topo, x, sizes = ds.topo, torch.as_tensor(np.asarray(ds.features)), [15, 10, 5]
    table = psgs(topo, sizes)
    print(
        f"   PSGS {sizes}: min {table.min():.0f}, median {table.median():.0f}, "
        f"max {table.max():.0f} expected sampled nodes per seed"
    )
    # a skewed request stream; FAP is computed from a log of earlier requests of the same kind
    mix = RequestMix(topo.node_count, 1, 16, zipf=1.1)
    log = np.concatenate(mix.draw(500, seed=1))
    requests = mix.draw(300, seed=2)
    sampler = GraphSageSampler(topo, sizes, seed=0)
    cache = int(0.1 * topo.node_count) * x.shape[1] * 4
    for placement in ("fap", "degree", "random"):
        f = Feature(
            0,
            ["cpu"],
            cache,
            csr_topo=topo,
            placement=placement,
            sizes=sizes,
            seed_prob=log if placement == "fap" else None,
        ).from_cpu_tensor(x)
        for nodes in requests:
            f[sampler.sample(torch.tensor(sorted(set(nodes))))[0]]
        print(
            f"   10% cache, {placement:<6} placement: hit rate {f.stats()['share']['device']:.1%}"
        )
    hybrid = HybridSampler(topo, sizes, threshold=20_000, gpu_device="cpu", psgs_table=table)
    for n in (4, 256):
        seeds = torch.randperm(topo.node_count)[:n]
        path, p = hybrid.route(seeds)
        print(f"   batch of {n:>3} seeds: PSGS {p:>9,.0f} -> {path} path (threshold 20,000)")


def _update(url: str, d: Path) -> None:
    """One node added while serving, wired in, and answered at once (docs/quiver/updates.md)."""
    import json

    from quiver.serving.client import Client

    width = json.loads((d / "manifest.json").read_text())["num_features"]
    with Client(url) as client:
        new = client.update({"op": "add_nodes", "features": [[0.1] * width]})["ids"][0]
        client.update({"op": "add_edges", "src": [0, 1, 2], "dst": [new, new, new]})
        cls = client.predict([new])["values"][0]
        health = client.health()
    print(
        f"   POST /v1/update: node {new} added with 3 in-edges (durable, logged), class {cls} "
        f"at once; the graph now has {health['node_count']:,} nodes, {health['edge_count']:,} "
        "edges"
    )


def _serve(work: Path) -> None:
    """Train a GraphSAGE briefly, serve it with ``quiver serve`` (its own process) on loopback,
    and run a short open-loop load against it over HTTP."""
    import signal

    from quiver.datasets import load_prepared
    from quiver.serving import loadgen
    from quiver.serving.client import wait_until_ready
    from quiver.serving.http import spawn_serve
    from quiver.training import TrainConfig, train_model

    d = small_dataset(work)
    ckpt = work / "sage.pt"
    cfg = TrainConfig(fanouts=(10, 5), epochs=3, batch_size=128)
    _, rep = train_model(load_prepared(d), cfg, out=ckpt, progress=False)
    print(
        f"   trained GraphSAGE: val acc {rep.val_acc:.3f} (features-only MLP "
        f"{rep.mlp_val_acc:.3f}) in {rep.seconds:.1f} s"
    )
    server, url = spawn_serve(d, ckpt)
    try:
        wait_until_ready(url, proc=server)
        print(f"   $ quiver serve {d.name} --checkpoint {ckpt.name}  ({url})")

        async def target():
            return await loadgen.http_target(url)

        mix = loadgen.RequestMix(2000, 1, 64)
        res = loadgen.sweep(target, mix, [25, 50, 100], duration_s=3.0, progress=False)
        _update(url, d)
    finally:
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=60)
    print(loadgen.format_table({"quiver": res}))
    print(
        f"   sustained at p99 <= 30 ms: {loadgen.sustained_rps(res, 30.0):.0f} requests/s "
        "(HTTP on loopback; load generator and server share the 2 cores)"
    )
    print("   " + out.strip().splitlines()[-1])


#: (title, function) pairs run in order by ``make demo``.
STEPS = [
    ("environment", _info),
    ("prepare a dataset, sampler throughput", _prepare_and_sample),
    ("workload metrics, feature store, PSGS routing", _workload_and_features),
    ("serving: train, serve over HTTP, open-loop load", _serve),
]


def main() -> int:
    from quiver import __version__

    print(f"== Quiver {__version__} demo")
    work = Path(tempfile.mkdtemp(prefix="quiver-demo-"))
    try:
        for title, fn in STEPS:
            t0 = time.perf_counter()
            print(f"\n-- {title}")
            fn(work)
            print(f"   ({time.perf_counter() - t0:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
