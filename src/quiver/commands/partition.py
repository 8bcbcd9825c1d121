"""``quiver partition DATA``: split a prepared dataset's feature rows across K hosts.

Every node's row gets one owner host (``--method bfs``: K equal blocks of a breadth-first
order along the sampling direction, so a seed and the neighbours it samples tend to share a
host; ``hash``: ``v mod K``). Then each host replicates the remote rows its own requests read
most, up to ``--replicate-budget`` rows per host (a count ``20000``, a fraction of all rows
``0.05`` or ``5%``), ranked by ``--policy``: ``fap`` (feature access probability under the
seeds routed to that host), ``degree`` or ``random``. A request is routed to the host holding
most of the rows its seeds and their in-neighbours touch.

Writes ``partition/{owner,replicas,replica_offsets}.npy`` and a ``partition`` manifest entry
into DATA (running it again replaces them). Serving hosts then run ``quiver serve DATA
--host-rank R --hosts K --peer-addr HOST:PORT`` (``quiver.feature.peer.PeerFeature``);
training hosts load their shard with ``quiver.feature.DistFeature.from_prepared(DATA)``.
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "partition",
        help="assign feature rows to K hosts and replicate hot remote rows by FAP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("data", metavar="DATA", help="prepared dataset directory")
    p.add_argument("--hosts", type=int, required=True, metavar="K", help="number of hosts")
    p.add_argument(
        "--replicate-budget",
        default="0",
        metavar="ROWS|FRACTION",
        help="remote rows each host replicates: a count, a fraction of all rows or N%% "
        "(default 0: no replicas)",
    )
    p.add_argument(
        "--policy", choices=["fap", "degree", "random"], default="fap", help="replica ranking"
    )
    p.add_argument(
        "--method", choices=["bfs", "hash"], default="bfs", help="row ownership (default bfs)"
    )
    p.add_argument("--sizes", default=None, help="fanouts for FAP (default: the manifest's)")
    p.add_argument("--batch-size", type=int, default=64, help="seeds per request batch (FAP)")
    p.add_argument(
        "--request-log", metavar="FILE.npy", help="node ids of past requests (FAP's seeds)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    import numpy as np

    from quiver.datasets import load_prepared
    from quiver.feature.partition import make_partition, save_partition

    d = Path(args.data)
    if not (d / "manifest.json").exists():
        raise FileNotFoundError(f"{d} is not a prepared dataset (no manifest.json)")
    ds = load_prepared(d)
    if args.sizes:
        try:
            sizes = [int(s) for s in args.sizes.split(",")]
        except ValueError:
            raise ValueError(
                f"--sizes must be comma-separated integers, got {args.sizes!r}"
            ) from None
    else:
        sizes = list(ds.manifest.get("fanouts") or (15, 10, 5))
    log = None
    if args.request_log:
        if not Path(args.request_log).exists():
            raise FileNotFoundError(f"missing --request-log file: {args.request_log}")
        log = np.load(args.request_log)
        if log.ndim != 1 or not np.issubdtype(log.dtype, np.integer):
            raise ValueError(f"--request-log must hold 1-D integer node ids, got {log.dtype}")
    t0 = time.perf_counter()
    part = make_partition(
        ds.topo,
        args.hosts,
        budget=args.replicate_budget,
        policy=args.policy,
        method=args.method,
        sizes=sizes,
        seed_prob=log,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    save_partition(d, part)
    info = part.info
    print(
        f"{d}: {info['hosts']} hosts ({info['method']}), owned rows {info['owned_rows']}, "
        f"replicas by {info['policy']} (budget {info['budget_rows']} rows/host) "
        f"{info['replica_rows']} in {time.perf_counter() - t0:.1f} s"
    )
    print(json.dumps({"partition": {k: info[k] for k in ("hosts", "policy", "budget_rows")}}))
    return 0
