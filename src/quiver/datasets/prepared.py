"""Prepared dataset directories: ``manifest.json`` plus ``.npy`` arrays, loadable memory-mapped.

Layout::

    manifest.json        name, source, shapes, dtypes, degree statistics, default fanouts, ...
    indptr.npy indices.npy [eid.npy] topo.json     the CSRTopo (CSRTopo.save layout)
    features.npy         [N, F] float32, or bfloat16 stored as its uint16 bit patterns
                         (manifest ``dtypes.features == "bfloat16"``; numpy has no bfloat16)
    labels.npy           [N] int64 (-1 = unlabelled)
    split/train.npy split/valid.npy split/test.npy     int64 node ids
    [edge_features.npy]  [E_in, D] float32 edge features, in the INPUT edge list's order: CSR
                         slot j reads row eid[j] (eid.npy is then required); a reverse edge
                         added by ``--undirected`` shares its forward edge's row

Other tools add their own keys to the manifest (PSGS/FAP tables, calibration) with
:func:`update_manifest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from quiver.graph import CSRTopo

__all__ = [
    "EDGE_FEATURES",
    "FEATURE_DTYPES",
    "MANIFEST",
    "PreparedDataset",
    "convert_features",
    "data_dir",
    "degree_stats",
    "feature_dtype",
    "load_prepared",
    "save_prepared",
    "update_manifest",
]

MANIFEST = "manifest.json"
#: the edge feature file of a prepared directory (optional)
EDGE_FEATURES = "edge_features.npy"
SPLITS = ("train", "valid", "test")
#: on-disk feature dtypes (manifest ``dtypes.features``): name -> torch dtype
FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class PreparedDataset:
    """A graph with node features, labels and splits.

    Attributes:
        topo: the in-neighbour CSR topology.
        features: ``[N, F]`` float32 or bfloat16, as the manifest's ``dtypes.features`` says
            (a memory-mapped tensor when loaded with ``mmap=True``).
        labels: ``[N]`` int64 class ids, ``-1`` where unknown.
        splits: ``{"train", "valid", "test"}`` -> int64 node ids.
        manifest: the metadata (``manifest.json``).
        path: the directory it was loaded from, if any.
        edge_features: optional ``[E_in, D]`` float32 edge features in the input edge order:
            the edge at CSR slot ``j`` has row ``topo.eid[j]`` (memory-mapped when loaded with
            ``mmap=True``); ``None`` when the dataset has none.
    """

    topo: CSRTopo
    features: torch.Tensor
    labels: torch.Tensor
    splits: dict[str, torch.Tensor]
    manifest: dict = field(default_factory=dict)
    path: Path | None = None
    edge_features: torch.Tensor | None = None

    @property
    def data_path(self) -> Path | None:
        """The folder holding the arrays: :attr:`path`, or the generation folder a compaction
        of served updates switched the manifest to (its ``"data"`` entry)."""
        return None if self.path is None else data_dir(self.path, self.manifest)

    @property
    def num_nodes(self) -> int:
        return self.topo.node_count

    @property
    def num_classes(self) -> int:
        return int(self.manifest.get("num_classes", int(self.labels.max()) + 1))

    def to_pyg(self):
        """A ``torch_geometric.data.Data`` (x, y, edge_index in CSR order, split masks)."""
        from torch_geometric.data import Data

        data = Data(
            x=self.features,
            y=self.labels,
            edge_index=self.topo.to_edge_index(),
            num_nodes=self.num_nodes,
        )
        for name, idx in self.splits.items():
            mask = torch.zeros(self.num_nodes, dtype=torch.bool)
            mask[idx] = True
            data[f"{name}_mask"] = mask
        return data


def degree_stats(indptr: np.ndarray) -> dict:
    """In-degree statistics: min, median, mean, p99, max and the isolated share."""
    deg = np.diff(np.asarray(indptr))
    if deg.size == 0:
        return {"min": 0, "median": 0.0, "mean": 0.0, "p99": 0.0, "max": 0, "isolated_share": 0.0}
    return {
        "min": int(deg.min()),
        "median": float(np.median(deg)),
        "mean": float(deg.mean()),
        "p99": float(np.percentile(deg, 99)),
        "max": int(deg.max()),
        "isolated_share": float((deg == 0).mean()),
    }


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def data_dir(directory, manifest: dict) -> Path:
    """Where a prepared directory's arrays are: the directory itself, or the generation
    folder its manifest names (``"data"``, written by ``quiver compact``)."""
    d = Path(directory)
    sub = manifest.get("data", ".")
    if not isinstance(sub, str) or "/" in sub or "\\" in sub or sub.startswith(".."):
        raise ValueError(f"{d / MANIFEST}: 'data' must name a folder inside {d}, got {sub!r}")
    return d / sub


def update_manifest(directory, **entries) -> dict:
    """Merge ``entries`` into ``directory/manifest.json`` and return the new manifest."""
    path = Path(directory) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(entries)
    path.write_text(json.dumps(manifest, indent=2, default=_json_default) + "\n")
    return manifest


def save_prepared(
    directory,
    topo: CSRTopo,
    features,
    labels,
    splits: dict,
    manifest: dict,
    in_place: tuple[str, ...] = (),
    edge_features=None,
) -> Path:
    """Write a prepared dataset directory and its manifest.

    Args:
        directory: output directory (created).
        topo: the topology.
        features: ``[N, F]`` float array or tensor.
        labels: ``[N]`` integer array or tensor (``-1`` = unlabelled).
        splits: ``{"train"|"valid"|"test": ids}``.
        manifest: extra metadata merged into the generated manifest.
        in_place: arrays (``"indices"``, ``"features"``) already written to their ``.npy``
            files in ``directory`` through memory maps; they are flushed, not rewritten.
        edge_features: optional ``[E_in, D]`` float edge features in the input edge order
            (row ``topo.eid[j]`` belongs to CSR slot ``j``); written as ``edge_features.npy``
            (float32). Needs ``topo.eid``.
    """
    d = Path(directory)
    (d / "split").mkdir(parents=True, exist_ok=True)
    n = topo.node_count
    feats = features.numpy() if isinstance(features, torch.Tensor) else features
    labs = labels.numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if feats.ndim != 2 or feats.shape[0] != n:
        raise ValueError(f"features have shape {list(feats.shape)}, expected [{n}, F]")
    if labs.shape != (n,):
        raise ValueError(f"labels have shape {list(labs.shape)}, expected [{n}]")
    if topo.device.type != "cpu":
        topo = topo.to("cpu")
    if "indices" in in_place:
        # indices.npy was streamed to disk by the generator: add the rest of the CSRTopo layout
        assert topo.eid is None
        np.save(d / "indptr.npy", topo.indptr.numpy())
        (d / "topo.json").write_text(json.dumps(topo._meta(), indent=2) + "\n")
    else:
        topo.save(d)
    if "features" in in_place:
        feats.flush()
    else:
        np.save(d / "features.npy", np.ascontiguousarray(feats, dtype=np.float32))
    np.save(d / "labels.npy", labs.astype(np.int64, copy=False))
    split_sizes = {}
    for name in SPLITS:
        ids = splits.get(name, np.empty(0, dtype=np.int64))
        ids = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)
        np.save(d / "split" / f"{name}.npy", ids.astype(np.int64, copy=False))
        split_sizes[name] = int(ids.size)
    efeat_entry = None
    if edge_features is not None:
        ef = edge_features.numpy() if isinstance(edge_features, torch.Tensor) else edge_features
        ef = np.asarray(ef)
        if ef.ndim == 1:
            ef = ef.reshape(-1, 1)
        if ef.ndim != 2:
            raise ValueError(f"edge features have shape {list(ef.shape)}, expected [E, D]")
        if topo.eid is None:
            raise ValueError("edge features need the topology's eid (CSR slot -> input edge)")
        top = int(topo.eid.max()) + 1 if topo.edge_count else 0
        if ef.shape[0] < top:
            raise ValueError(
                f"edge features have {ef.shape[0]} rows but the edge list has {top} edges"
            )
        np.save(d / EDGE_FEATURES, np.ascontiguousarray(ef, dtype=np.float32))
        efeat_entry = {"file": EDGE_FEATURES, "rows": int(ef.shape[0]), "dim": int(ef.shape[1])}
    elif (d / EDGE_FEATURES).exists():
        (d / EDGE_FEATURES).unlink()
    labelled = labs[labs >= 0]
    full = {
        "format": "quiver.prepared/1",
        "num_nodes": n,
        "num_edges": topo.edge_count,
        "num_features": int(feats.shape[1]),
        "num_classes": int(labelled.max()) + 1 if labelled.size else 0,
        "dtypes": {"indptr": "int64", "indices": "int64", "features": "float32", "labels": "int64"},
        "split_sizes": split_sizes,
        "degree": degree_stats(topo.indptr.numpy()),
        "fanouts": [15, 10, 5],
    }
    if efeat_entry is not None:
        full["edge_features"] = efeat_entry
        full["dtypes"]["edge_features"] = "float32"
    full.update(manifest)
    (d / MANIFEST).write_text(json.dumps(full, indent=2, default=_json_default) + "\n")
    return d


def load_prepared(directory, mmap: bool = True) -> PreparedDataset:
    """Load a prepared dataset directory.

    Args:
        directory: written by ``quiver prepare`` or :func:`save_prepared`.
        mmap: memory-map the topology and features (copy-on-write, O(1) memory to open).

    Raises:
        FileNotFoundError: the directory, its manifest or an array is missing.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"prepared dataset directory not found: {d}")
    if not (d / MANIFEST).exists():
        raise FileNotFoundError(f"{d} has no {MANIFEST}; create it with `quiver prepare`")
    manifest = json.loads((d / MANIFEST).read_text())
    top, d = d, data_dir(d, manifest)
    for name in ("features.npy", "labels.npy"):
        if not (d / name).exists():
            raise FileNotFoundError(f"missing {name} in {d}")
    topo = CSRTopo.load(d, mmap=mmap)
    feats = np.load(d / "features.npy", mmap_mode="c" if mmap else None)
    features = torch.from_numpy(feats)
    if feature_dtype(manifest) == "bfloat16":
        if feats.dtype != np.uint16:
            raise ValueError(
                f"{d / 'features.npy'} holds {feats.dtype}, but the manifest says bfloat16 "
                "(stored as uint16 bit patterns)"
            )
        features = features.view(torch.bfloat16)
    labels = torch.from_numpy(np.load(d / "labels.npy"))
    edge_features = None
    if (d / EDGE_FEATURES).exists():
        if topo.eid is None:
            raise ValueError(
                f"{d / EDGE_FEATURES} needs {d / 'eid.npy'} (CSR slot -> input edge), which is "
                "missing; prepare the dataset again"
            )
        ef = np.load(d / EDGE_FEATURES, mmap_mode="c" if mmap else None)
        if ef.ndim != 2 or ef.dtype != np.float32:
            raise ValueError(
                f"{d / EDGE_FEATURES} holds {list(ef.shape)} {ef.dtype}, expected [E, D] float32"
            )
        want = (manifest.get("edge_features") or {}).get("rows")
        if want is not None and ef.shape[0] != want:
            raise ValueError(
                f"{d / EDGE_FEATURES} has {ef.shape[0]} rows but the manifest says {want}"
            )
        edge_features = torch.from_numpy(ef)
    splits = {}
    for name in SPLITS:
        p = d / "split" / f"{name}.npy"
        splits[name] = (
            torch.from_numpy(np.load(p)) if p.exists() else torch.empty(0, dtype=torch.long)
        )
    return PreparedDataset(topo, features, labels, splits, manifest, top, edge_features)


def feature_dtype(manifest: dict) -> str:
    """The on-disk feature dtype a manifest names (``"float32"`` for manifests without one)."""
    name = (manifest.get("dtypes") or {}).get("features", "float32")
    if name not in FEATURE_DTYPES:
        raise ValueError(
            f"manifest dtypes.features is {name!r}; this version reads {sorted(FEATURE_DTYPES)}"
        )
    return name


def convert_features(directory, dtype: str, chunk_rows: int = 1 << 16) -> dict:
    """Rewrite ``directory/features.npy`` in ``dtype`` (``"float32"`` or ``"bfloat16"``) and
    record it in the manifest; returns the new manifest.

    Rows are converted in chunks of ``chunk_rows`` (memory stays bounded for large tables)
    into a temporary file that then replaces the old one. bfloat16 rounds to nearest even
    (``torch.Tensor.to``) and is stored as its ``uint16`` bit patterns.
    """
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype must be one of {sorted(FEATURE_DTYPES)}, got {dtype!r}")
    d = Path(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    old = feature_dtype(manifest)
    if old == dtype:
        return manifest
    top, d = d, data_dir(d, manifest)
    src = np.load(d / "features.npy", mmap_mode="r")
    tmp = d / ".features.npy.tmp"
    out = np.lib.format.open_memmap(
        tmp, mode="w+", dtype=np.uint16 if dtype == "bfloat16" else np.float32, shape=src.shape
    )
    for lo in range(0, src.shape[0], chunk_rows):
        block = torch.from_numpy(np.array(src[lo : lo + chunk_rows]))
        if old == "bfloat16":
            block = block.view(torch.bfloat16)
        block = block.to(FEATURE_DTYPES[dtype])
        out[lo : lo + chunk_rows] = (
            block.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else block
        )
    out.flush()
    del out, src
    tmp.replace(d / "features.npy")
    return update_manifest(top, dtypes={**manifest.get("dtypes", {}), "features": dtype})
