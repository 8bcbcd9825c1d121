"""Hetero sources for ``quiver prepare --hetero``: typed edge lists, a saved ``HeteroData``, or
the synthetic ``mag-like`` graph.

A typed edge-list directory holds::

    <src>__<relation>__<dst>.{txt,csv,npy}   one file per relation, (src id, dst id) per edge
                                             (.txt whitespace, .csv comma with an optional
                                             header, .npy [2, E] or [E, 2]; .gz text allowed)
    <type>.features.npy                      [N_type, F] features (optional, per type)
    <type>.labels.npy                        [N_type] integer labels (optional, -1 unlabelled)
    <src>__<relation>__<dst>.edge_features.npy   [E, D] edge features, rows in the relation
                                             file's edge order (optional)
    nodes.json                               {"<type>": count, ...} (optional; default: the
                                             feature or label rows, else the largest id + 1)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from quiver.hetero.graph import HeteroGraph, parse_edge_type

__all__ = ["load_heterodata", "load_source", "load_typed_edges"]

_EDGE_SUFFIXES = (".txt", ".csv", ".npy", ".txt.gz", ".csv.gz")


def _edge_array(path: Path) -> np.ndarray:
    """``[2, E]`` int64 (src, dst) of one relation's file."""
    from quiver.datasets.loaders import read_table

    name = path.name
    if name.endswith(".npy"):
        a = np.load(path)
        if a.ndim != 2 or 2 not in a.shape:
            raise ValueError(f"{name}: expected shape [2, E] or [E, 2], got {list(a.shape)}")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name}: node ids must be integers, got dtype {a.dtype}")
        return (a if a.shape[0] == 2 and a.shape[1] != 2 else a.T).astype(np.int64)
    if ".csv" in name:
        with __import__("gzip").open(path, "rt") if name.endswith(".gz") else open(path) as f:
            first = f.readline()
        header = bool(first) and not first.split(",")[0].strip().lstrip("-").isdigit()
        t = read_table(path, np.int64, delimiter=",", skip_header=header)
    else:
        t = read_table(path, np.int64, delimiter=None)
    if t.size and t.shape[1] != 2:
        raise ValueError(f"{name}: expected 2 columns (src, dst), got {t.shape[1]}")
    return t.reshape(-1, 2).T.copy()


def load_typed_edges(directory, undirected: bool = False) -> HeteroGraph:
    """Read a typed edge-list directory (module docstring).

    Raises:
        ValueError: no relation files, a bad file name, an id past its type's count, feature
            or label rows that disagree with ``nodes.json`` (one line naming the file).
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"--hetero {d}: no such directory")
    edges = {}
    for p in sorted(d.iterdir()):
        stem = next((p.name[: -len(s)] for s in _EDGE_SUFFIXES if p.name.endswith(s)), None)
        if (
            stem is None
            or "__" not in stem
            or p.name.endswith((".features.npy", ".labels.npy", ".edge_features.npy"))
        ):
            continue
        try:
            et = parse_edge_type(stem)
        except ValueError:
            raise ValueError(f"{p.name}: name relation files src__relation__dst.csv") from None
        edges[et] = _edge_array(p)
    if not edges:
        raise ValueError(f"--hetero {d}: no src__relation__dst.{{txt,csv,npy}} edge files")
    efeats = {}
    for p in sorted(d.glob("*.edge_features.npy")):
        efeats[parse_edge_type(p.name[: -len(".edge_features.npy")])] = np.load(p)
    feats, labels = {}, {}
    for p in sorted(d.glob("*.features.npy")):
        if p.name.endswith(".edge_features.npy"):
            continue
        feats[p.name[: -len(".features.npy")]] = np.load(p)
    for p in sorted(d.glob("*.labels.npy")):
        labels[p.name[: -len(".labels.npy")]] = np.load(p)
    counts: dict[str, int] = {}
    if (d / "nodes.json").exists():
        try:
            counts = {str(k): int(v) for k, v in json.loads((d / "nodes.json").read_text()).items()}
        except (ValueError, AttributeError, TypeError) as e:
            raise ValueError(f'{d / "nodes.json"}: expected {{"type": count}} ({e})') from None
    types = {t for et in edges for t in (et[0], et[2])} | set(feats) | set(labels)
    for t in sorted(types):
        if t in counts:
            continue
        rows = feats.get(t, labels.get(t))
        if rows is not None:
            counts[t] = int(rows.shape[0])
        else:
            ids = [e[0] for et, e in edges.items() if et[0] == t]
            ids += [e[1] for et, e in edges.items() if et[2] == t]
            counts[t] = max((int(a.max()) + 1 for a in ids if a.size), default=0)
    g = HeteroGraph.from_edges(
        counts,
        edges,
        feats,
        labels,
        manifest={"name": d.name, "source": f"typed edge lists {d}"},
        edge_features=efeats,
    )
    return g.add_reverse() if undirected else g


def load_heterodata(path, trust_pickle: bool = False, undirected: bool = False) -> HeteroGraph:
    """A ``torch.save``'d PyG ``HeteroData``: unpickling runs code the file chose, so it needs
    ``trust_pickle`` (``--trust-pickle``)."""
    p = Path(path)
    if not trust_pickle:
        raise ValueError(
            f"--hetero {p}: loading a saved HeteroData unpickles it (code the file chose "
            "runs); pass --trust-pickle if you trust it"
        )
    try:
        data = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as e:
        msg = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"--hetero {p}: cannot load ({type(e).__name__}: {msg})") from None
    from torch_geometric.data import HeteroData

    if not isinstance(data, HeteroData):
        raise ValueError(f"--hetero {p}: holds a {type(data).__name__}, not a HeteroData")
    g = HeteroGraph.from_pyg(data, manifest={"name": p.stem, "source": f"HeteroData {p}"})
    return g.add_reverse() if undirected else g


def load_source(
    source: str,
    scale: float = 0.1,
    seed: int = 0,
    undirected: bool = False,
    trust_pickle: bool = False,
) -> HeteroGraph:
    """``mag-like`` (synthetic, ``scale`` of OGB-MAG, reverse relations always added), a
    typed edge-list directory, or a saved ``HeteroData`` file."""
    if source == "mag-like":
        from quiver.hetero.synthetic import mag_like

        return mag_like(scale, seed=seed)
    p = Path(source)
    if p.is_dir():
        return load_typed_edges(p, undirected)
    if p.is_file():
        return load_heterodata(p, trust_pickle, undirected)
    raise FileNotFoundError(
        f"--hetero {source}: not 'mag-like', a typed edge-list directory or a HeteroData file"
    )
