"""``quiver prepare``: write a prepared dataset directory (``manifest.json`` + ``.npy`` arrays).

Sources: a synthetic preset (``--dataset products-like``), an OGB node-property directory
(``--from-ogb DIR``, with ``raw/edge-feat.csv.gz`` when it has one) or an edge list
(``--edges FILE``, optionally with ``--features``, ``--labels`` and ``--edge-features``
``.npy`` files).

Edge features (``--edge-features FILE.npy``, ``[E, D]``, one row per edge of ``--edges`` in
its order) are stored as ``edge_features.npy`` beside the CSR, in that input order (the CSR's
``eid.npy`` maps each slot to its row); with ``--undirected`` the added reverse of an edge
carries the same row.

Splits of an edge list: ``--train/--valid/--test FILE.npy`` (node ids, or boolean masks of
length N), or ``--split 0.8,0.1,0.1``: a seeded (``--seed``) random split of the labelled
nodes, on by default (at 0.8,0.1,0.1) when ``--labels`` is given.
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
    src.add_argument(
        "--hetero",
        metavar="SOURCE",
        help="a heterogeneous graph: 'mag-like' (synthetic, OGB-MAG sized times --scale), a "
        "directory of src__relation__dst.csv edge files (+ TYPE.features.npy, TYPE.labels.npy, "
        "nodes.json), or a torch.save'd PyG HeteroData (with --trust-pickle)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of a synthetic preset or of --split (default 0)"
    )
    p.add_argument(
        "--undirected",
        action="store_true",
        help="add the reverse of every edge (OGB/edge-list sources)",
    )
    p.add_argument(
        "--num-nodes",
        type=int,
        help="node count for --edges (default: the rows of --features or --labels, else the "
        "largest id + 1)",
    )
    p.add_argument("--features", metavar="FILE", help="[N, F] .npy features for --edges")
    p.add_argument("--labels", metavar="FILE", help="[N] .npy integer labels for --edges")
    p.add_argument(
        "--edge-features",
        metavar="FILE",
        help="[E, D] .npy edge features for --edges, one row per edge in the file's order (a "
        "reverse edge added by --undirected carries its edge's row)",
    )
    p.add_argument(
        "--split",
        metavar="TRAIN,VALID,TEST",
        help="random split of the labelled nodes by these fractions, seeded by --seed "
        "(default 0.8,0.1,0.1 when --labels is given and no split files are)",
    )
    for name in SPLIT_NAMES:
        p.add_argument(
            f"--{name}",
            metavar="FILE",
            help=f"{name} node ids (or an [N] boolean mask) as .npy, for --edges",
        )
    p.add_argument(
        "--feature-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="feature storage: fp32, or bf16 (half the bytes to read and gather; served as "
        "bf16 rows, see `quiver serve --precision`) (default fp32)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=0.1,
        help="--hetero mag-like: fraction of OGB-MAG's size (1 = 1.9M nodes, 21M edges; "
        "default 0.1)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="--hetero FILE.pt: allow unpickling the saved HeteroData (runs code it names)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


SPLIT_NAMES = ("train", "valid", "test")
DEFAULT_SPLIT = (0.8, 0.1, 0.1)


def parse_split(text: str) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> three fractions in [0, 1] summing to at most 1."""
    try:
        fracs = tuple(float(f) for f in text.split(","))
    except ValueError:
        raise ValueError(f"--split must be three comma-separated fractions, got {text!r}") from None
    if len(fracs) != 3 or any(not 0 <= f <= 1 for f in fracs) or sum(fracs) > 1 + 1e-9:
        raise ValueError(
            f"--split must be three fractions in [0, 1] summing to at most 1 (train,valid,test), "
            f"got {text!r}"
        )
    return fracs


def random_split(labels, fracs, seed: int) -> dict:
    """Seeded split of the labelled nodes (``labels >= 0``): ``{"train", "valid", "test"}``."""
    import numpy as np

    labelled = np.flatnonzero(np.asarray(labels) >= 0)
    perm = np.random.default_rng(seed).permutation(labelled)
    n = perm.size
    n_train = int(round(fracs[0] * n))
    n_valid = min(int(round(fracs[1] * n)), n - n_train)
    n_test = min(int(round(fracs[2] * n)), n - n_train - n_valid)
    cuts = [0, n_train, n_train + n_valid, n_train + n_valid + n_test]
    return {name: np.sort(perm[cuts[i] : cuts[i + 1]]) for i, name in enumerate(SPLIT_NAMES)}


def _split_file(path, name: str, n: int):
    import numpy as np

    a = _load_npy(path, f"--{name}")
    if a.dtype == np.bool_:
        if a.shape != (n,):
            raise ValueError(f"--{name} {path}: a mask must have shape [{n}], got {list(a.shape)}")
        return np.flatnonzero(a)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(
            f"--{name} {path}: expected 1-D integer node ids, got {list(a.shape)} {a.dtype}"
        )
    if a.size and (a.min() < 0 or a.max() >= n):
        bad = int(a.min()) if a.min() < 0 else int(a.max())
        raise ValueError(f"--{name} {path}: node id {bad} outside [0, {n})")
    return a.astype(np.int64)


def _splits(args, labels, n: int) -> dict:
    files = {name: getattr(args, name) for name in SPLIT_NAMES if getattr(args, name)}
    if files and args.split:
        raise ValueError("give --split or --train/--valid/--test files, not both")
    if files:
        out = {name: _split_file(path, name, n) for name, path in files.items()}
        if args.labels:
            for name, ids in out.items():
                unlabelled = int((labels[ids] < 0).sum())
                if unlabelled:
                    raise ValueError(
                        f"--{name} {files[name]}: {unlabelled} of its nodes have no label (-1)"
                    )
        return out
    if args.split and not args.labels:
        raise ValueError("--split needs --labels (it splits the labelled nodes)")
    if args.labels:
        fracs = parse_split(args.split) if args.split else DEFAULT_SPLIT
        return random_split(labels, fracs, args.seed)
    return {}


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
    if getattr(args, "hetero", None):
        return _run_hetero(args, out)
    if not args.edges and (args.split or any(getattr(args, k) for k in SPLIT_NAMES)):
        raise ValueError("--split and --train/--valid/--test apply to --edges sources only")
    if not args.edges and getattr(args, "edge_features", None):
        raise ValueError(
            "--edge-features applies to --edges sources only (an OGB directory brings "
            "raw/edge-feat.csv.gz)"
        )
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} exists and is not a directory")
    t0 = time.perf_counter()
    if args.dataset:
        ds = datasets.synthetic(args.dataset, seed=args.seed, out=out, progress=progress)
    else:
        if args.from_ogb:
            ds = datasets.load_ogb(args.from_ogb, undirected=args.undirected, progress=progress)
        else:
            feats = _load_npy(args.features, "features") if args.features else None
            labels = _load_npy(args.labels, "labels") if args.labels else None
            if feats is not None and feats.ndim != 2:
                raise ValueError(f"--features has shape {list(feats.shape)}, expected [N, F]")
            if labels is not None and (
                labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer)
            ):
                raise ValueError(
                    f"--labels must be [N] integers, got {list(labels.shape)} {labels.dtype}"
                )
            # the node count: --num-nodes, else the feature (or label) rows, so nodes after the
            # largest id in the edge list (isolated ones) keep their rows; else max id + 1
            n, origin = args.num_nodes, "--num-nodes"
            for rows, what in ((feats, "--features"), (labels, "--labels")):
                if rows is None:
                    continue
                if n is None:
                    n, origin = int(rows.shape[0]), f"the {what} rows"
                elif rows.shape[0] != n:
                    verb = "is" if origin == "--num-nodes" else "are"
                    raise ValueError(f"{what} has {rows.shape[0]} rows but {origin} {verb} {n}")
            topo = datasets.load_edge_list(args.edges, n, args.undirected, num_nodes_from=origin)
            n = topo.node_count
            efeats = None
            if args.edge_features:
                efeats = _load_npy(args.edge_features, "edge features")
                if efeats.ndim == 1:
                    efeats = efeats.reshape(-1, 1)
                num_input = topo.edge_count // (2 if args.undirected else 1)
                if efeats.ndim != 2 or not np.issubdtype(efeats.dtype, np.number):
                    raise ValueError(
                        f"--edge-features {args.edge_features} has shape {list(efeats.shape)} "
                        f"{efeats.dtype}, expected [E, D] numbers"
                    )
                if efeats.shape[0] != num_input:
                    raise ValueError(
                        f"--edge-features {args.edge_features} has {efeats.shape[0]} rows but "
                        f"--edges {args.edges} has {num_input} edges"
                    )
            if feats is None:
                feats = np.zeros((n, 0), np.float32)
            if labels is None:
                labels = np.full(n, -1, np.int64)
            ds = datasets.PreparedDataset(
                topo,
                feats,
                labels,
                _splits(args, labels, n),
                {
                    "name": Path(args.edges).stem,
                    "source": {"kind": "edge-list", "path": str(args.edges)},
                },
                edge_features=efeats,
            )
        manifest = dict(ds.manifest)
        manifest["source"] = {**manifest.get("source", {}), "undirected": args.undirected}
        datasets.save_prepared(
            out,
            ds.topo,
            ds.features,
            ds.labels,
            ds.splits,
            manifest,
            edge_features=ds.edge_features,
        )
        ds = datasets.load_prepared(out)
    if args.feature_dtype == "bf16":
        datasets.convert_features(out, "bfloat16")
        ds = datasets.load_prepared(out)
    m = ds.manifest
    deg = m["degree"]
    fdtype = m.get("dtypes", {}).get("features", "float32")
    print(
        f"prepared {m.get('name', out.name)} in {out}: {m['num_nodes']:,} nodes, "
        f"{m['num_edges']:,} edges, {m['num_features']} {fdtype} features, "
        f"{m['num_classes']} classes "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    if m.get("edge_features"):
        ef = m["edge_features"]
        print(f"edge features: {ef['rows']:,} rows x {ef['dim']} float32 ({ef['file']})")
    sizes = m.get("split_sizes", {})
    if sizes:
        print("splits: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
    print(
        f"in-degree min {deg['min']} median {deg['median']:g} mean {deg['mean']:.1f} "
        f"p99 {deg['p99']:g} max {deg['max']}, isolated {100 * deg['isolated_share']:.2f}%"
    )
    return 0


def _run_hetero(args: argparse.Namespace, out) -> int:
    """``quiver prepare --hetero SOURCE``: write a hetero dataset directory."""
    import time

    from quiver.hetero.prepare import load_source

    if args.features or args.labels or args.split or args.num_nodes or args.edge_features:
        raise ValueError(
            "--features/--labels/--edge-features/--split/--num-nodes apply to --edges; a "
            "--hetero directory holds TYPE.features.npy, TYPE.labels.npy and nodes.json"
        )
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} exists and is not a directory")
    t0 = time.perf_counter()
    g = load_source(args.hetero, args.scale, args.seed, args.undirected, args.trust_pickle)
    g.save(out)
    print(f"wrote {out}: {g.describe()} in {time.perf_counter() - t0:.1f}s")
    return 0
