"""Loaders for real data: the OGB node-property layout, plain edge lists, PyG ``Data``.

Every loader checks what it reads and raises ``ValueError`` with the file and row for ragged
rows, ids out of range and mismatched lengths, and ``FileNotFoundError`` for missing files, so
``quiver prepare`` can print one clear line.
"""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import numpy as np
import torch

from quiver.datasets.prepared import PreparedDataset
from quiver.graph import CSRTopo

__all__ = ["from_pyg", "load_edge_list", "load_ogb", "read_table"]

_BLOCK = 1 << 20  # lines parsed per block


def _open_text(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def read_table(
    path, dtype, delimiter=",", ncols=None, comments="#", bar=None, skip_header=False
) -> np.ndarray:
    """Read a (possibly gzipped) delimited numeric table into a ``[rows, cols]`` array.

    Args:
        path: file path (``.gz`` is decompressed on the fly).
        dtype: numpy dtype of the result.
        delimiter: column separator; ``None`` splits on whitespace.
        ncols: expected column count (default: that of the first row).
        comments: lines starting with this are skipped (``None``: none).
        bar: optional tqdm bar updated with the number of rows read.
        skip_header: skip the first line (a CSV header).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a row has a different number of values, or a value does not parse.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"missing file: {path}")
    blocks, row0 = [], 0
    with _open_text(path) as f:
        if skip_header:
            f.readline()
            row0 = 1
        while True:
            lines = [
                ln
                for ln in itertools.islice(f, _BLOCK)
                if ln.strip() and not (comments and ln.lstrip().startswith(comments))
            ]
            if not lines:
                break
            for i, ln in enumerate(lines):
                n = len(ln.split(delimiter)) if delimiter else len(ln.split())
                if ncols is None:
                    ncols = n
                if n != ncols:
                    raise ValueError(
                        f"{path.name}: row {row0 + i + 1} has {n} values, expected {ncols}"
                    )
            try:
                a = np.loadtxt(lines, dtype=dtype, delimiter=delimiter, ndmin=2)
            except ValueError as e:
                raise ValueError(f"{path.name}: cannot parse rows {row0 + 1}..: {e}") from None
            blocks.append(a)
            row0 += len(lines)
            if bar is not None:
                bar.update(len(lines))
    if not blocks:
        return np.empty((0, ncols or 0), dtype=dtype)
    return np.concatenate(blocks) if len(blocks) > 1 else blocks[0]


def _edges_to_topo(
    edges: np.ndarray,
    num_nodes: int | None,
    undirected: bool,
    name: str,
    num_nodes_from: str = "num_nodes",
):
    """``[E, 2]`` (src, dst) rows -> CSRTopo, with range checks naming ``name`` (and where the
    node count came from, ``num_nodes_from``).

    ``eid[j]`` is the input row of the edge at CSR slot ``j``; with ``undirected`` the reverse
    of row ``i`` is added and has ``eid == i`` too, so it reads its forward edge's features.
    """
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise ValueError(f"{name}: expected 2 columns (source, target), got shape {edges.shape}")
    if edges.size:
        lo, hi = int(edges.min()), int(edges.max())
        if lo < 0:
            row = int(np.flatnonzero((edges < 0).any(1))[0]) + 1
            raise ValueError(f"{name}: row {row} holds negative node id {lo}")
        if num_nodes is not None and hi >= num_nodes:
            row = int(np.flatnonzero((edges >= num_nodes).any(1))[0]) + 1
            raise ValueError(
                f"{name}: row {row} holds node id {hi} >= {num_nodes_from} ({num_nodes})"
            )
    ei = np.ascontiguousarray(edges.T)
    num_input = ei.shape[1]
    if undirected:
        ei = np.concatenate([ei, ei[::-1]], axis=1)
    topo = CSRTopo.from_edge_index(ei, num_nodes=num_nodes)
    if undirected and num_input:
        topo.eid.remainder_(num_input)  # the reverse of input row i is edge i + E: row i
    return topo


def load_edge_list(
    path, num_nodes: int | None = None, undirected: bool = False, num_nodes_from: str = "num_nodes"
) -> CSRTopo:
    """Load an edge list: ``.txt`` (whitespace, ``#`` comments, SNAP style), ``.csv`` (comma,
    an optional header line), or ``.npy`` (``[2, E]`` or ``[E, 2]`` integers).

    Args:
        path: the file (``.txt``/``.csv`` may be gzipped: ``.txt.gz``, ``.csv.gz``).
        num_nodes: node count (nodes after the largest id are isolated); default
            ``max id + 1``.
        undirected: add the reverse of every edge.
        num_nodes_from: where ``num_nodes`` came from, for the message when an id exceeds it.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"missing file: {path}")
    suffixes = [s for s in path.suffixes if s != ".gz"]
    kind = suffixes[-1] if suffixes else ""
    if kind == ".npy":
        a = np.load(path)
        if a.ndim != 2 or 2 not in a.shape:
            raise ValueError(f"{path.name}: expected shape [2, E] or [E, 2], got {list(a.shape)}")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{path.name}: node ids must be integers, got dtype {a.dtype}")
        edges = a.T if a.shape[0] == 2 and a.shape[1] != 2 else a
        return _edges_to_topo(
            edges.astype(np.int64), num_nodes, undirected, path.name, num_nodes_from
        )
    if kind == ".csv":
        with _open_text(path) as f:
            first = f.readline()
        header = bool(first) and not first.split(",")[0].strip().lstrip("-").isdigit()
        edges = read_table(path, np.int64, delimiter=",", skip_header=header)
    elif kind == ".txt":
        edges = read_table(path, np.int64, delimiter=None)
    else:
        raise ValueError(f"{path.name}: unsupported edge list type; use .txt, .csv or .npy")
    return _edges_to_topo(edges, num_nodes, undirected, path.name, num_nodes_from)


def _ogb_file(root: Path, *parts) -> Path:
    for cand in (root.joinpath(*parts), root.joinpath(*parts).with_suffix("")):
        if cand.exists():
            return cand
    raise FileNotFoundError(f"missing file: {root.joinpath(*parts)}")


def load_ogb(directory, undirected: bool = False, progress: bool = False) -> PreparedDataset:
    """Load an OGB node-property dataset directory (as ``ogb`` downloads it, unpacked).

    Reads ``raw/edge.csv.gz`` (one ``src,dst`` per row), ``raw/num-node-list.csv.gz`` (if
    present), ``raw/node-feat.csv.gz``, ``raw/node-label.csv.gz`` (``nan`` = unlabelled -> -1),
    ``raw/edge-feat.csv.gz`` (if present: one row of edge features per row of ``edge.csv.gz``),
    and ``split/<scheme>/{train,valid,test}.csv.gz``. Uncompressed ``.csv`` files work too.

    Args:
        directory: the dataset root (the folder holding ``raw/`` and ``split/``).
        undirected: add reverse edges (OGB's undirected datasets, e.g. products, store each
            edge once).
        progress: show tqdm progress bars.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"OGB directory not found: {root}")

    def bar(desc):
        if not progress:
            return None
        from tqdm import tqdm

        return tqdm(desc=desc, unit="row", unit_scale=True, leave=False)

    def read(path, dtype, desc):
        b = bar(desc)
        try:
            return read_table(path, dtype, bar=b)
        finally:
            if b is not None:
                b.close()

    edges = read(_ogb_file(root, "raw", "edge.csv.gz"), np.int64, "edges")
    feats = read(_ogb_file(root, "raw", "node-feat.csv.gz"), np.float32, "features")
    label_path = _ogb_file(root, "raw", "node-label.csv.gz")
    labels_f = read(label_path, np.float64, "labels")
    num_nodes = feats.shape[0]
    try:
        nn_path = _ogb_file(root, "raw", "num-node-list.csv.gz")
        declared = int(read_table(nn_path, np.int64)[0, 0])
        if declared != num_nodes:
            raise ValueError(
                f"node-feat.csv.gz has {num_nodes} rows but num-node-list says {declared} nodes"
            )
    except FileNotFoundError:
        pass
    if labels_f.shape[0] != num_nodes:
        raise ValueError(
            f"node-label.csv.gz has {labels_f.shape[0]} rows but node-feat.csv.gz has {num_nodes}"
        )
    if labels_f.shape[1] != 1:
        raise ValueError(f"node-label.csv.gz: expected 1 column, got {labels_f.shape[1]}")
    labels = np.where(np.isnan(labels_f[:, 0]), -1, labels_f[:, 0]).astype(np.int64)
    topo = _edges_to_topo(edges, num_nodes, undirected, "edge.csv.gz")
    edge_features = None
    try:
        ef_path = _ogb_file(root, "raw", "edge-feat.csv.gz")
    except FileNotFoundError:
        ef_path = None
    if ef_path is not None:
        edge_features = read(ef_path, np.float32, "edge features")
        if edge_features.shape[0] != edges.shape[0]:
            raise ValueError(
                f"edge-feat.csv.gz has {edge_features.shape[0]} rows but edge.csv.gz has "
                f"{edges.shape[0]} edges"
            )
        edge_features = torch.from_numpy(edge_features)
    split_root = root / "split"
    schemes = sorted(p for p in split_root.iterdir() if p.is_dir()) if split_root.is_dir() else []
    if not schemes:
        raise FileNotFoundError(f"missing split directory: {split_root}/<scheme>/train.csv.gz")
    splits = {}
    for name in ("train", "valid", "test"):
        ids = read_table(_ogb_file(schemes[0], f"{name}.csv.gz"), np.int64)[:, 0]
        if ids.size and (ids.min() < 0 or ids.max() >= num_nodes):
            raise ValueError(f"split {name}: node id {int(ids.max())} outside [0, {num_nodes})")
        splits[name] = torch.from_numpy(ids)
    manifest = {
        "name": root.name,
        "source": {
            "kind": "ogb",
            "path": str(root),
            "undirected": undirected,
            "split_scheme": schemes[0].name,
        },
    }
    return PreparedDataset(
        topo,
        torch.from_numpy(feats),
        torch.from_numpy(labels),
        splits,
        manifest,
        edge_features=edge_features,
    )


def from_pyg(data, name: str = "pyg") -> PreparedDataset:
    """Wrap a ``torch_geometric.data.Data`` (``edge_index``, optional ``x``, ``y``,
    ``edge_attr`` (``[E]`` or ``[E, D]``, in ``edge_index``'s order) and
    ``train_mask``/``val_mask``/``test_mask``)."""
    topo = CSRTopo.from_pyg(data)
    n = topo.node_count
    edge_attr = getattr(data, "edge_attr", None)
    if edge_attr is not None:
        edge_attr = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
        if edge_attr.dim() != 2 or edge_attr.size(0) != topo.edge_count:
            raise ValueError(
                f"data.edge_attr has {edge_attr.size(0)} rows but data.edge_index has "
                f"{topo.edge_count} edges"
            )
        edge_attr = edge_attr.float()
    x = data.x if getattr(data, "x", None) is not None else torch.zeros(n, 0)
    if x.size(0) != n:
        raise ValueError(f"data.x has {x.size(0)} rows but the graph has {n} nodes")
    y = getattr(data, "y", None)
    y = torch.full((n,), -1, dtype=torch.long) if y is None else y.view(-1).long()
    if y.numel() != n:
        raise ValueError(f"data.y has {y.numel()} entries but the graph has {n} nodes")
    splits = {}
    for name, attr in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        mask = getattr(data, attr, None)
        splits[name] = (
            mask.nonzero().view(-1) if mask is not None else torch.empty(0, dtype=torch.long)
        )
    manifest = {"name": name, "source": {"kind": "pyg"}}
    return PreparedDataset(topo, x.float(), y, splits, manifest, edge_features=edge_attr)
