"""Heterogeneous graphs: typed nodes, typed relations, features and labels per node type.

A relation ``(src, rel, dst)`` is stored as a CSR over its *destination* nodes: row ``v`` of
``dst`` lists the ``src`` nodes with an edge ``src -> v``. That is the direction messages flow
in PyG (``edge_index[0]`` = source, ``[1]`` = target) and the one a sampler walks: the
neighbours sampled for a node are the sources of its incoming edges, per relation, as PyG's
hetero ``NeighborLoader`` does. Inside a row, edges keep their input order (a stable sort), and
``eid`` maps each CSR slot back to its position in the input edge list, so edge features stored
in input order stay addressable.

Directory layout (``HeteroGraph.save`` / ``load``, memory-mapped on load)::

    manifest.json                      {"kind": "hetero", node types, relations, ...}
    rel_<i>/indptr.npy indices.npy eid.npy     relation i's CSR (int64)
    features/<type>.npy                [N_type, F_type] float32, for typed with features
    labels/<type>.npy                  [N_type] int64, -1 = unlabelled (optional)
    edge_features/rel_<i>.npy          [E_i, D_i] float32 of relation i, in its INPUT edge
                                       order (``eid`` finds a CSR slot's row; optional)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from quiver.graph import _counting_sort_by_row

__all__ = ["HeteroGraph", "Relation", "edge_type_name", "parse_edge_type"]

MANIFEST = "manifest.json"
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or "__" in name:
        raise ValueError(
            f"{what} {name!r}: use letters, digits, '-' and single '_' only (it names files)"
        )
    return name


def edge_type_name(et: tuple[str, str, str]) -> str:
    """``("author", "writes", "paper")`` -> ``"author__writes__paper"`` (PyG's own join)."""
    return "__".join(et)


def parse_edge_type(text) -> tuple[str, str, str]:
    """``"author__writes__paper"`` (or a 3-tuple) -> ``("author", "writes", "paper")``."""
    if isinstance(text, (tuple, list)) and len(text) == 3:
        return tuple(str(p) for p in text)
    parts = str(text).split("__")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"edge type {text!r}: write it as src__relation__dst")
    return tuple(parts)


def _as_numpy(a, dtype=None) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a.astype(dtype, copy=False) if dtype is not None else a


@dataclass
class Relation:
    """One relation's CSR over its destination nodes.

    Attributes:
        edge_type: ``(src, rel, dst)``.
        indptr: ``[N_dst + 1]`` int64.
        indices: ``[E]`` int64 source ids of each destination's incoming edges.
        eid: ``[E]`` int64 position of each CSR slot's edge in the input edge list.
    """

    edge_type: tuple[str, str, str]
    indptr: np.ndarray
    indices: np.ndarray
    eid: np.ndarray

    @property
    def edge_count(self) -> int:
        return int(self.indices.shape[0])

    @property
    def degree(self) -> np.ndarray:
        """``[N_dst]`` in-degree of every destination node in this relation."""
        return np.diff(self.indptr)

    def to_edge_index(self) -> torch.Tensor:
        """``[2, E]`` int64 ``(src, dst)`` in CSR order."""
        dst = np.repeat(np.arange(self.indptr.shape[0] - 1, dtype=np.int64), self.degree)
        return torch.from_numpy(np.stack([np.asarray(self.indices), dst]))


@dataclass
class HeteroGraph:
    """A heterogeneous graph with features and labels per node type.

    Attributes:
        num_nodes: node type -> node count.
        relations: edge type -> :class:`Relation`.
        features: node type -> ``[N_type, F_type]`` float32 (types without features absent).
        labels: node type -> ``[N_type]`` int64 (``-1`` unlabelled; optional per type).
        edge_features: edge type -> ``[E, D]`` float32 in the relation's input edge order
            (optional per relation; row ``eid[j]`` belongs to CSR slot ``j``).
        manifest: extra metadata (name, source, default fanouts, target type, workload).
    """

    num_nodes: dict[str, int]
    relations: dict[tuple[str, str, str], Relation]
    features: dict[str, torch.Tensor] = field(default_factory=dict)
    labels: dict[str, torch.Tensor] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    path: Path | None = None
    edge_features: dict = field(default_factory=dict)
    #: where the data files are (``path``, or a compaction's generation folder under it)
    data_path: Path | None = None

    # ------------------------------------------------------------------ building
    @classmethod
    def from_edges(
        cls,
        num_nodes: dict[str, int],
        edges: dict,
        features: dict | None = None,
        labels: dict | None = None,
        manifest: dict | None = None,
        edge_features: dict | None = None,
    ) -> HeteroGraph:
        """Build from ``{(src, rel, dst): edge_index [2, E]}`` and node counts per type.

        Raises:
            ValueError: an unknown node type, an id out of range, a feature or label table
                whose row count is not its type's node count, an unusable type name.
        """
        num_nodes = {_check_name(t, "node type"): int(n) for t, n in num_nodes.items()}
        for t, n in num_nodes.items():
            if n < 0:
                raise ValueError(f"node type {t!r}: node count {n} is negative")
        rels: dict = {}
        for et, ei in edges.items():
            et = parse_edge_type(et)
            src, rel, dst = et
            _check_name(rel, "relation")
            name = edge_type_name(et)
            for t in (src, dst):
                if t not in num_nodes:
                    raise ValueError(f"edge type {name}: unknown node type {t!r}")
            ei = _as_numpy(ei, np.int64)
            if ei.ndim != 2 or ei.shape[0] != 2:
                raise ValueError(f"edge type {name}: edge_index must be [2, E], got {ei.shape}")
            for row, t in ((ei[0], src), (ei[1], dst)):
                if row.size and (row.min() < 0 or row.max() >= num_nodes[t]):
                    bad = int(row.max()) if row.size and row.max() >= num_nodes[t] else -1
                    raise ValueError(
                        f"edge type {name}: {t} id {bad if bad >= 0 else int(row.min())} "
                        f"outside [0, {num_nodes[t]})"
                    )
            indptr, indices, eid = _counting_sort_by_row(
                np.ascontiguousarray(ei[0]), np.ascontiguousarray(ei[1]), num_nodes[dst]
            )
            rels[et] = Relation(et, indptr, indices, eid)
        feats = {}
        for t, x in (features or {}).items():
            if t not in num_nodes:
                raise ValueError(f"features for unknown node type {t!r}")
            x = torch.as_tensor(_as_numpy(x, np.float32))
            if x.ndim != 2 or x.shape[0] != num_nodes[t]:
                raise ValueError(
                    f"features of {t!r} have shape {list(x.shape)}, expected "
                    f"[{num_nodes[t]}, F] (one row per {t} node)"
                )
            feats[t] = x
        labs = {}
        for t, y in (labels or {}).items():
            if t not in num_nodes:
                raise ValueError(f"labels for unknown node type {t!r}")
            y = torch.as_tensor(_as_numpy(y, np.int64)).reshape(-1)
            if y.shape[0] != num_nodes[t]:
                raise ValueError(f"labels of {t!r} have {y.shape[0]} rows, expected {num_nodes[t]}")
            labs[t] = y
        efeats = {}
        for et, a in (edge_features or {}).items():
            et = parse_edge_type(et)
            if et not in rels:
                raise ValueError(f"edge features for unknown edge type {edge_type_name(et)}")
            a = torch.as_tensor(_as_numpy(a, np.float32))
            a = a.reshape(-1, 1) if a.ndim == 1 else a
            if a.ndim != 2 or a.shape[0] != rels[et].edge_count:
                raise ValueError(
                    f"edge features of {edge_type_name(et)} have {a.shape[0]} rows, expected "
                    f"{rels[et].edge_count} (one per edge, in the edge list's order)"
                )
            efeats[et] = a
        g = cls(num_nodes, rels, feats, labs, dict(manifest or {}))
        g.edge_features = efeats
        return g

    @classmethod
    def from_pyg(cls, data, manifest: dict | None = None) -> HeteroGraph:
        """From a PyG ``HeteroData``: ``x`` and ``y`` per node type where present (a
        multi-column ``y`` keeps its first column), every edge type's ``edge_index``."""
        num_nodes, feats, labs = {}, {}, {}
        for t in data.node_types:
            store = data[t]
            n = store.num_nodes
            if n is None:
                raise ValueError(f"HeteroData node type {t!r} has no num_nodes and no x")
            num_nodes[t] = int(n)
            if getattr(store, "x", None) is not None:
                feats[t] = store.x
            y = getattr(store, "y", None)
            if y is not None:
                labs[t] = y[:, 0] if y.ndim == 2 else y
        edges, eattr = {}, {}
        for et in data.edge_types:
            if data[et].get("edge_attr") is not None:
                eattr[et] = data[et].edge_attr
            ei = data[et].get("edge_index")
            if ei is None:
                raise ValueError(
                    f"HeteroData edge type {edge_type_name(et)} has no edge_index (an "
                    "adj_t-only store: convert it back with ToSparseTensor's inverse)"
                )
            edges[et] = ei
        return cls.from_edges(num_nodes, edges, feats, labs, manifest, eattr)

    def add_reverse(self) -> HeteroGraph:
        """Add ``(dst, rev_rel, src)`` for every relation whose reverse is missing
        (PyG's ``ToUndirected`` naming: ``rev_`` + relation); a same-type relation gets
        its reverse edges merged in instead, as ``ToUndirected`` does."""
        edges = {et: r.to_edge_index()[:, np.argsort(r.eid)] for et, r in self.relations.items()}
        out, eout = dict(edges), dict(self.edge_features)
        for (src, rel, dst), ei in edges.items():
            ef = self.edge_features.get((src, rel, dst))
            if src == dst:
                out[(src, rel, dst)] = torch.cat([ei, ei.flip(0)], 1)
                if ef is not None:  # a reversed edge carries its forward edge's features
                    eout[(src, rel, dst)] = torch.cat([ef, ef])
            elif not any(e[0] == dst and e[2] == src for e in edges):
                out[(dst, f"rev_{rel}", src)] = ei.flip(0)
                if ef is not None:
                    eout[(dst, f"rev_{rel}", src)] = ef
        return HeteroGraph.from_edges(
            self.num_nodes, out, self.features, self.labels, self.manifest, eout
        )

    # ------------------------------------------------------------------ views
    @property
    def node_types(self) -> list[str]:
        return list(self.num_nodes)

    @property
    def edge_types(self) -> list[tuple[str, str, str]]:
        return list(self.relations)

    def metadata(self) -> tuple[list[str], list[tuple[str, str, str]]]:
        """``(node_types, edge_types)``, what PyG's ``to_hetero`` takes."""
        return self.node_types, self.edge_types

    @property
    def edge_count(self) -> int:
        return sum(r.edge_count for r in self.relations.values())

    def to_pyg(self):
        """The whole graph as a PyG ``HeteroData`` (edges in their input order)."""
        from torch_geometric.data import HeteroData

        data = HeteroData()
        for t, n in self.num_nodes.items():
            data[t].num_nodes = n
            if t in self.features:
                data[t].x = self.features[t].float()
            if t in self.labels:
                data[t].y = self.labels[t]
        for et, r in self.relations.items():
            ei = r.to_edge_index()
            data[et].edge_index = ei[:, np.argsort(r.eid, kind="stable")]
            if et in self.edge_features:
                data[et].edge_attr = self.edge_features[et].float()
        return data

    def describe(self) -> str:
        types = ", ".join(
            f"{t} {n:,}" + (f" (F={self.features[t].shape[1]})" if t in self.features else "")
            for t, n in self.num_nodes.items()
        )
        return (
            f"{sum(self.num_nodes.values()):,} nodes ({types}); {self.edge_count:,} edges in "
            f"{len(self.relations)} relations"
        )

    # ------------------------------------------------------------------ files
    def save(self, directory, write_manifest: bool = True) -> Path:
        """Write the directory layout of the module docstring (atomically per file); with
        ``write_manifest=False`` only the data files (a compaction's new generation)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for i, (_, r) in enumerate(self.relations.items()):
            rd = d / f"rel_{i}"
            rd.mkdir(exist_ok=True)
            for name in ("indptr", "indices", "eid"):
                _save_npy(rd / f"{name}.npy", np.asarray(getattr(r, name), dtype=np.int64))
        if self.edge_features:
            (d / "edge_features").mkdir(exist_ok=True)
        for i, et in enumerate(self.relations):
            if et in self.edge_features:
                _save_npy(d / "edge_features" / f"rel_{i}.npy", self.edge_features[et].numpy())
        for sub, table in (("features", self.features), ("labels", self.labels)):
            if table:
                (d / sub).mkdir(exist_ok=True)
            for t, a in table.items():
                _save_npy(d / sub / f"{t}.npy", a.numpy())
        if write_manifest:
            manifest = self.manifest_for(".")
            tmp = d / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=2) + "\n")
            os.replace(tmp, d / MANIFEST)
            self.manifest = manifest
            self.path = self.data_path = d
        return d

    def manifest_for(self, data: str) -> dict:
        """The manifest describing this graph with its data files under ``data`` (a folder
        relative to the dataset directory: ``.``, or a compaction's ``gen-<seq>``)."""
        return {
            **self.manifest,
            "kind": "hetero",
            "format": "quiver.HeteroGraph/1",
            "data": data,
            "node_types": {
                t: {
                    "count": n,
                    "features": int(self.features[t].shape[1]) if t in self.features else None,
                    "labels": t in self.labels,
                }
                for t, n in self.num_nodes.items()
            },
            "relations": [
                {
                    "edge_type": list(et),
                    "dir": f"rel_{i}",
                    "edges": r.edge_count,
                    "edge_features": (
                        int(self.edge_features[et].shape[1]) if et in self.edge_features else None
                    ),
                }
                for i, (et, r) in enumerate(self.relations.items())
            ],
        }

    @classmethod
    def load(cls, directory, mmap: bool = True) -> HeteroGraph:
        """Load a directory written by :meth:`save` (memory-mapped by default).

        Raises:
            ValueError: not a hetero dataset, or a missing/mismatched file (one line).
        """
        d = Path(directory)
        mpath = d / MANIFEST
        if not mpath.exists():
            raise ValueError(f"{d}: no {MANIFEST} (prepare it with `quiver prepare --hetero`)")
        try:
            manifest = json.loads(mpath.read_text())
        except ValueError as e:
            raise ValueError(f"{mpath}: not valid JSON ({e})") from None
        if manifest.get("kind") != "hetero":
            raise ValueError(f"{d}: not a heterogeneous dataset (manifest kind is not 'hetero')")
        mode = "r" if mmap else None
        root = d
        d = root / manifest.get("data", ".")

        def load(path: Path, rows: int | None = None) -> np.ndarray:
            if not path.exists():
                raise ValueError(f"{root}: missing {path.relative_to(root)}")
            a = np.load(path, mmap_mode=mode)
            if rows is not None and a.shape[0] != rows:
                raise ValueError(f"{path}: {a.shape[0]} rows, the manifest says {rows}")
            return a

        num_nodes = {t: int(v["count"]) for t, v in manifest["node_types"].items()}
        rels, efeats = {}, {}
        for i, r in enumerate(manifest["relations"]):
            et = tuple(r["edge_type"])
            rd = d / r["dir"]
            indptr = load(rd / "indptr.npy", num_nodes[et[2]] + 1)
            indices = load(rd / "indices.npy", int(r["edges"]))
            eid = load(rd / "eid.npy", int(r["edges"]))
            rels[et] = Relation(et, indptr, indices, eid)
            if r.get("edge_features"):
                efeats[et] = _tensor(load(d / "edge_features" / f"rel_{i}.npy", int(r["edges"])))
        feats, labs = {}, {}
        for t, v in manifest["node_types"].items():
            if v.get("features"):
                feats[t] = _tensor(load(d / "features" / f"{t}.npy", num_nodes[t]))
            if v.get("labels"):
                labs[t] = _tensor(load(d / "labels" / f"{t}.npy", num_nodes[t]))
        g = cls(num_nodes, rels, feats, labs, manifest, root)
        g.data_path = d
        g.edge_features = efeats
        return g


def _tensor(a: np.ndarray) -> torch.Tensor:
    if isinstance(a, np.memmap) and not a.flags.writeable:
        import warnings

        with warnings.catch_warnings():  # read-only mmap: torch warns, we never write to it
            warnings.simplefilter("ignore")
            return torch.from_numpy(a)
    return torch.from_numpy(np.asarray(a))


def _save_npy(path: Path, a: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, a)
    os.replace(tmp, path)


def is_hetero_dir(directory) -> bool:
    """Whether ``directory`` holds a hetero dataset (``manifest.json`` of kind ``hetero``)."""
    p = Path(directory) / MANIFEST
    try:
        return json.loads(p.read_text()).get("kind") == "hetero"
    except (OSError, ValueError):
        return False
