"""Feature shards across hosts (issue 21): remote-row share by replica policy, exchange cost.

On a products-like synthetic graph (``quiver.datasets.synthetic.scaled``, default 100K nodes,
products' mean degree) with fanouts [15,10,5] and a skewed (Zipf) request stream of 8-seed
requests: rows are owned by K BFS blocks (``quiver.feature.partition``), every host
replicates ``--budget`` of all rows chosen by FAP (its own routed seeds, learned from a
separate request log of the same stream), degree or random, and each request goes to the host
holding most of the rows it touches. The table gives the share of gathered rows that are read
remotely, at K = 2, 4, 8 (plus hash ownership without replicas, the floor). Then two real
processes over gloo (loopback) gather their routed batches with ``DistFeature`` at K = 2:
milliseconds per batch in the exchange and in the whole gather. (Benchmark, not a test.)

    .venv/bin/python bench/scale_out.py [--nodes 100000] [--budget 0.05]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys  # noqa: E402
import time
from pathlib import Path  # noqa: E402

import numpy as np
import torch
import torch.multiprocessing as mp

from quiver.datasets.synthetic import scaled, synthetic
from quiver.feature.partition import Router, make_partition, remote_share
from quiver.pyg import GraphSageSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exchange_worker(rank, port, x, part, batches, result):
    import torch.distributed as dist

    from quiver.feature import DistFeature

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    ids = torch.from_numpy(part.local_ids(rank))
    feat = DistFeature(x[ids], ids, part.owner)
    mine = batches[rank]
    for b in mine[:5]:  # warm-up
        feat[b]
    feat.reset_stats()
    t0 = time.perf_counter()
    for b in mine[5:]:
        assert torch.equal(feat[b], x[b])
    wall = time.perf_counter() - t0
    s = feat.stats()
    result[rank] = (wall, s["exchange_s"], s["gathers"], s["remote_rows"], s["local_rows"])
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--budget", default="0.05", help="replicated rows per host (count/fraction)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--request-size", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--hosts", default="2,4,8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = [15, 10, 5]
    t0 = time.perf_counter()
    ds = synthetic(scaled("products-like", args.nodes, name="products-scaled"), seed=args.seed)
    topo, x = ds.topo, torch.as_tensor(ds.features)
    n = topo.node_count
    rng = np.random.default_rng(args.seed)
    w = 1.0 / np.arange(1, n + 1) ** args.zipf
    q = rng.permutation(w / w.sum())
    log = rng.choice(n, size=200_000, p=q)
    seeds = [np.unique(rng.choice(n, size=args.request_size, p=q)) for _ in range(args.requests)]
    sampler = GraphSageSampler(topo, sizes, mode="CPU", seed=args.seed)
    n_ids = [sampler.sample(torch.from_numpy(s))[0] for s in seeds]
    rows = sum(i.numel() for i in n_ids)
    print(f"== {cpu_model()}, {os.cpu_count()} CPUs")
    print(
        f"products-like scaled to {n:,} nodes, {topo.edge_count:,} edges, {x.shape[1]} features; "
        f"{args.requests} Zipf({args.zipf}) requests x {args.request_size} seeds, fanouts "
        f"{sizes}, {rows:,} rows gathered; replica budget {args.budget} of rows per host "
        f"({time.perf_counter() - t0:.0f} s to build)"
    )
    cols = ["hash, none", "bfs, none", "bfs + fap", "bfs + degree", "bfs + random"]
    print(f"\nremote-row share (lower is better)\n{'K':>3} " + " ".join(f"{c:>13}" for c in cols))
    parts = {}
    for k in [int(h) for h in args.hosts.split(",")]:
        cells = []
        for method, policy, budget in [
            ("hash", "random", 0),
            ("bfs", "random", 0),
            ("bfs", "fap", args.budget),
            ("bfs", "degree", args.budget),
            ("bfs", "random", args.budget),
        ]:
            part = make_partition(
                topo, k, budget, policy, method, sizes, seed_prob=log, batch_size=8
            )
            router = Router(part, topo)
            by_host = [[] for _ in range(k)]
            for s, ids in zip(seeds, n_ids, strict=True):
                by_host[router(s)].append(ids)
            cells.append(remote_share(part, by_host))
            if k == 2 and policy == "fap":
                parts[k] = (part, by_host)
        print(f"{k:>3} " + " ".join(f"{c * 100:12.1f}%" for c in cells))

    part, by_host = parts[2]
    m = min(len(b) for b in by_host)
    batches = [[b.clone() for b in by_host[h][:m]] for h in range(2)]
    if m <= 5:
        print("\n(too few batches per host for the exchange measurement)")
        return 0
    result = mp.Manager().dict()
    mp.start_processes(
        _exchange_worker,
        args=(_free_port(), x, part, batches, result),
        nprocs=2,
        start_method="spawn",
    )
    print(
        f"\nexchange with 2 processes over gloo (loopback), K = 2, bfs + fap, {m - 5} batches/host"
    )
    print(
        f"{'host':>4} {'gather ms/batch':>16} {'exchange ms/batch':>18} {'remote rows/batch':>18}"
    )
    for h in range(2):
        wall, ex, g, rem, loc = result[h]
        print(f"{h:>4} {wall / g * 1e3:16.2f} {ex / g * 1e3:18.2f} {rem / g:18.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
