"""``quiver prepare``: write a prepared dataset directory (``manifest.json`` + ``.npy`` arrays).

Sources: a synthetic preset (``--dataset products-like``), an OGB node-property directory
(``--from-ogb DIR``) or an edge list (``--edges FILE``, optionally with ``--features`` and
``--labels`` ``.npy`` files).
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="write a prepared dataset directory (synthetic preset, OGB directory, edge list)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--dataset",
        metavar="PRESET",
        help="synthetic preset: tiny, small, reddit-like, products-like, papers-like",
    )
    src.add_argument("--from-ogb", metavar="DIR", help="OGB node-property dataset root")
    src.add_argument("--edges", metavar="FILE", help="edge list: .txt, .csv or .npy")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic preset (default 0)")
    p.add_argument(
        "--undirected",
        action="store_true",
        help="add the reverse of every edge (OGB/edge-list sources)",
    )
    p.add_argument("--num-nodes", type=int, help="node count for --edges (default max id + 1)")
    p.add_argument("--features", metavar="FILE", help="[N, F] .npy features for --edges")
    p.add_argument("--labels", metavar="FILE", help="[N] .npy integer labels for --edges")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def _load_npy(path, what):
    from pathlib import Path

    import numpy as np

    if not Path(path).exists():
        raise FileNotFoundError(f"missing {what} file: {path}")
    return np.load(path)


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    import numpy as np

    from quiver import datasets

    progress = not args.no_progress
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} exists and is not a directory")
    t0 = time.perf_counter()
    if args.dataset:
        ds = datasets.synthetic(args.dataset, seed=args.seed, out=out, progress=progress)
    else:
        if args.from_ogb:
            ds = datasets.load_ogb(args.from_ogb, undirected=args.undirected, progress=progress)
        else:
            topo = datasets.load_edge_list(args.edges, args.num_nodes, args.undirected)
            n = topo.node_count
            feats = np.zeros((n, 0), np.float32)
            labels = np.full(n, -1, np.int64)
            if args.features:
                feats = _load_npy(args.features, "features")
                if feats.ndim != 2 or feats.shape[0] != n:
                    raise ValueError(
                        f"--features has shape {list(feats.shape)}, expected [{n}, F] "
                        f"(the edge list has {n} nodes)"
                    )
            if args.labels:
                labels = _load_npy(args.labels, "labels")
                if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
                    raise ValueError(
                        f"--labels must be [{n}] integers, got {list(labels.shape)} {labels.dtype}"
                    )
            ds = datasets.PreparedDataset(
                topo,
                feats,
                labels,
                {},
                {
                    "name": Path(args.edges).stem,
                    "source": {"kind": "edge-list", "path": str(args.edges)},
                },
            )
        manifest = dict(ds.manifest)
        manifest["source"] = {**manifest.get("source", {}), "undirected": args.undirected}
        datasets.save_prepared(out, ds.topo, ds.features, ds.labels, ds.splits, manifest)
        ds = datasets.load_prepared(out)
    m = ds.manifest
    deg = m["degree"]
    print(
        f"prepared {m.get('name', out.name)} in {out}: {m['num_nodes']:,} nodes, "
        f"{m['num_edges']:,} edges, {m['num_features']} features, {m['num_classes']} classes "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    print(
        f"in-degree min {deg['min']} median {deg['median']:g} mean {deg['mean']:.1f} "
        f"p99 {deg['p99']:g} max {deg['max']}, isolated {100 * deg['isolated_share']:.2f}%"
    )
    return 0
