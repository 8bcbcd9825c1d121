"""Synthetic datasets shaped like the paper's: R-MAT graphs with features, labels and splits.

A preset fixes sizes *and* degree statistics. Plain R-MAT at products scale has a max
in-degree near 157k and about a quarter of the nodes isolated; real graphs have neither. Each
preset therefore tunes R-MAT's quadrant probabilities (``a + c`` sets in-degree skew), adds
per-level noise, and gives every node ``degree_floor`` in-edges.

Learnability: labels are drawn first; a fraction ``homophily`` of R-MAT edges and of floor
edges take their source from the target's class, and features are a class centroid plus
Gaussian noise. Features alone are a weak signal; averaging over same-class neighbours
strengthens it, so a GNN beats a feature-only MLP (tests check this on ``small``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from quiver.datasets.build import build_csr
from quiver.datasets.prepared import PreparedDataset, degree_stats, load_prepared, save_prepared
from quiver.datasets.rmat import RMat, node_permutation, rmat_edges
from quiver.graph import CSRTopo

__all__ = ["PRESETS", "Preset", "synthetic"]


@dataclass(frozen=True)
class Preset:
    """Parameters of a synthetic dataset.

    Args:
        name: preset name.
        num_nodes: node count.
        num_edges: total edge count (R-MAT edges plus ``num_nodes * degree_floor``).
        num_features: feature dimension.
        num_classes: label classes.
        a, b, c, d: R-MAT quadrant probabilities (see ``RMat``).
        noise: R-MAT per-level noise.
        degree_floor: in-edges every node gets besides R-MAT's (removes isolated nodes).
        homophily: fraction of edges whose source is drawn from the target's class.
        feature_signal: norm of the class centroids; noise has unit variance per feature.
        class_skew: class ``i`` has weight ``(i + 1) ** -class_skew`` (0 = balanced).
        labelled: fraction of nodes in the splits (papers100M labels ~1.4%).
        split: (train, valid, test) fractions of the labelled nodes.
        fanouts: default sampling fanouts recorded in the manifest.
    """

    name: str
    num_nodes: int
    num_edges: int
    num_features: int
    num_classes: int
    a: float = 0.57
    b: float = 0.19
    c: float = 0.19
    d: float = 0.05
    noise: float = 0.1
    degree_floor: int = 1
    homophily: float = 0.7
    feature_signal: float = 1.0
    class_skew: float = 0.5
    labelled: float = 1.0
    split: tuple[float, float, float] = (0.6, 0.2, 0.2)
    fanouts: tuple[int, ...] = (15, 10, 5)

    def __post_init__(self):
        if self.num_edges < self.num_nodes * self.degree_floor:
            raise ValueError(
                f"num_edges ({self.num_edges}) < num_nodes * degree_floor "
                f"({self.num_nodes * self.degree_floor})"
            )
        if not 0 <= self.homophily <= 1:
            raise ValueError(f"homophily must be in [0, 1], got {self.homophily}")
        if self.num_classes < 1 or self.num_features < 1:
            raise ValueError("num_classes and num_features must be positive")
        if not 0 < self.labelled <= 1 or abs(sum(self.split) - 1) > 1e-6:
            raise ValueError("labelled must be in (0, 1] and split must sum to 1")

    @property
    def rmat(self) -> RMat:
        return RMat(
            self.num_nodes,
            self.num_edges - self.num_nodes * self.degree_floor,
            self.a,
            self.b,
            self.c,
            self.d,
            self.noise,
        )


# Real targets (the paper's datasets, undirected edges counted both ways):
#   Reddit        232,965 nodes, 114.6M edges, mean degree ~492, 602 features, 41 classes
#   ogbn-products 2,449,029 nodes, 123.7M edges, mean ~50.5, max ~17.5k, 100 features, 47 classes
#   ogbn-papers100M 111M nodes, 1.6B edges, mean ~14.5, 128 features, 172 classes, ~1.4% labelled
# ``a + c`` (the chance a target-id bit stays 0) is set so the max in-degree lands in the real
# range at each scale; ``degree_floor`` removes isolated nodes.
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("tiny", 200, 2_000, 8, 4, a=0.5, b=0.2, c=0.15, d=0.15, degree_floor=2),
        Preset("small", 2_000, 30_000, 32, 8, a=0.5, b=0.2, c=0.15, d=0.15, degree_floor=3),
        Preset(
            "reddit-like",
            232_965,
            114_615_892,
            602,
            41,
            a=0.45,
            b=0.25,
            c=0.15,
            d=0.15,
            degree_floor=20,
            split=(0.66, 0.10, 0.24),
        ),
        Preset(
            "products-like",
            2_449_029,
            123_718_280,
            100,
            47,
            a=0.50,
            b=0.20,
            c=0.15,
            d=0.15,
            degree_floor=3,
            split=(0.08, 0.02, 0.90),
        ),
        Preset(
            "papers-like",
            111_059_956,
            1_615_685_872,
            128,
            172,
            a=0.50,
            b=0.20,
            c=0.18,
            d=0.12,
            degree_floor=1,
            labelled=0.014,
            split=(0.78, 0.08, 0.14),
        ),
    ]
}


def _labels(p: Preset, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0x1A])
    w = (np.arange(p.num_classes) + 1.0) ** -p.class_skew
    return rng.choice(p.num_classes, size=p.num_nodes, p=w / w.sum()).astype(np.int64)


class _ClassIndex:
    """Draw uniform random nodes of given classes: nodes grouped by class."""

    def __init__(self, labels: np.ndarray, num_classes: int):
        self.nodes = np.argsort(labels, kind="stable").astype(np.int64)
        counts = np.bincount(labels, minlength=num_classes)
        self.ptr = np.zeros(num_classes + 1, dtype=np.int64)
        np.cumsum(counts, out=self.ptr[1:])
        self.size = counts

    def draw(self, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        u = rng.random(classes.size)
        return self.nodes[self.ptr[classes] + (u * self.size[classes]).astype(np.int64)]


def _edge_stream(p: Preset, seed: int, labels: np.ndarray, index: _ClassIndex, chunk: int):
    """Edge stream: R-MAT edges (partly rewired to same-class sources), then floor edges."""
    perm = node_permutation(p.num_nodes, seed)
    rm = p.rmat

    def stream():
        if rm.num_edges:
            for ci, (src, dst) in enumerate(rmat_edges(rm, seed, chunk_size=chunk, perm=perm)):
                rng = np.random.default_rng([seed, 0xE0, ci])
                same = rng.random(src.size) < p.homophily
                src[same] = index.draw(labels[dst[same]], rng)
                yield src, dst
        nodes_per_chunk = max(1, chunk // max(1, p.degree_floor))
        for ci, lo in enumerate(range(0, p.num_nodes if p.degree_floor else 0, nodes_per_chunk)):
            rng = np.random.default_rng([seed, 0xF0, ci])
            dst = np.repeat(np.arange(lo, min(lo + nodes_per_chunk, p.num_nodes)), p.degree_floor)
            src = rng.integers(0, p.num_nodes, dst.size)
            same = rng.random(dst.size) < p.homophily
            src[same] = index.draw(labels[dst[same]], rng)
            yield src, dst

    return stream


def _features(p: Preset, seed: int, labels: np.ndarray, out: np.ndarray, chunk: int, bar=None):
    rng = np.random.default_rng([seed, 0xFE])
    centroids = rng.standard_normal((p.num_classes, p.num_features))
    centroids *= p.feature_signal / np.linalg.norm(centroids, axis=1, keepdims=True)
    centroids = centroids.astype(np.float32)
    rows = max(1, chunk // p.num_features)
    for ci, lo in enumerate(range(0, p.num_nodes, rows)):
        hi = min(lo + rows, p.num_nodes)
        r = np.random.default_rng([seed, 0xFF, ci])
        block = r.standard_normal((hi - lo, p.num_features), dtype=np.float32)
        block += centroids[labels[lo:hi]]
        out[lo:hi] = block
        if bar is not None:
            bar.update(hi - lo)


def _splits(p: Preset, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 0x5B])
    num_labelled = max(3, int(round(p.labelled * p.num_nodes)))
    ids = rng.permutation(p.num_nodes)[:num_labelled]
    n_train = int(round(p.split[0] * num_labelled))
    n_valid = int(round(p.split[1] * num_labelled))
    return {
        "train": np.sort(ids[:n_train]),
        "valid": np.sort(ids[n_train : n_train + n_valid]),
        "test": np.sort(ids[n_train + n_valid :]),
    }


def _edge_homophily(indptr, indices, labels, seed, samples=1_000_000) -> float:
    """Share of edges joining same-class nodes, estimated on a random sample of CSR slots."""
    e = indices.shape[0]
    if e == 0:
        return 0.0
    pos = np.sort(np.random.default_rng([seed, 0x40]).integers(0, e, min(samples, e)))
    dst = np.searchsorted(indptr, pos, side="right") - 1
    return float((labels[np.asarray(indices[pos])] == labels[dst]).mean())


def synthetic(
    preset: str | Preset,
    seed: int = 0,
    out=None,
    progress: bool = False,
    chunk_size: int = 1 << 16,
) -> PreparedDataset:
    """Generate a synthetic dataset, in memory or streamed into a prepared directory.

    Args:
        preset: a name in :data:`PRESETS` or a :class:`Preset`.
        seed: random seed; the dataset is a deterministic function of ``(preset, seed)``.
        out: directory to write (``manifest.json`` and ``.npy`` files); edges and features are
            written through memory maps, so presets larger than RAM can be generated. ``None``
            keeps everything in memory.
        progress: show tqdm progress bars.
        chunk_size: edges per generation chunk.

    Returns:
        The dataset (memory-mapped from ``out`` when given).
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    p = preset
    t0 = time.perf_counter()
    d = Path(out) if out is not None else None
    if d is not None:
        d.mkdir(parents=True, exist_ok=True)
        import shutil

        need = 8 * (p.num_edges + p.num_nodes) + 4 * p.num_nodes * p.num_features
        free = shutil.disk_usage(d).free
        if need > free:
            raise ValueError(
                f"{p.name} needs about {need / 2**30:.1f} GiB in {d}, only {free / 2**30:.1f} "
                "GiB free"
            )

    def alloc(name, shape, dtype):
        if d is None:
            return np.empty(shape, dtype)
        return np.lib.format.open_memmap(d / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)

    labels = _labels(p, seed)
    index = _ClassIndex(labels, p.num_classes)
    stream = _edge_stream(p, seed, labels, index, chunk_size)
    bars = {}

    def on_chunk(pass_no, m):
        if not progress:
            return
        if pass_no not in bars:
            from tqdm import tqdm

            for b in bars.values():
                b.close()
            what = "generate" if pass_no == 1 else "place"
            bars[pass_no] = tqdm(
                total=p.num_edges,
                desc=f"{p.name}: edges ({what})",
                unit="e",
                unit_scale=True,
                leave=False,
            )
        bars[pass_no].update(m)

    indptr, indices = build_csr(stream, p.num_nodes, alloc, on_chunk, spill_dir=d)
    for b in bars.values():
        b.close()
    t_graph = time.perf_counter() - t0
    feats = alloc("features", (p.num_nodes, p.num_features), np.float32)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=p.num_nodes, desc=f"{p.name}: features", unit="row", unit_scale=True, leave=False
        )
    _features(p, seed, labels, feats, chunk_size * 16, bar)
    if bar is not None:
        bar.close()
    splits = _splits(p, seed)
    labels_out = labels.copy()
    if p.labelled < 1:
        known = np.zeros(p.num_nodes, dtype=bool)
        for ids in splits.values():
            known[ids] = True
        labels_out[~known] = -1
    topo = CSRTopo.from_csr(indptr, indices, validate=False)
    manifest = {
        "name": p.name,
        "source": {"kind": "synthetic", "preset": asdict(p), "seed": seed},
        "fanouts": list(p.fanouts),
        "degree": degree_stats(indptr),
        "edge_homophily": _edge_homophily(indptr, indices, labels, seed),
        "generation_seconds": {
            "graph": round(t_graph, 2),
            "total": round(time.perf_counter() - t0, 2),
        },
    }
    if d is None:
        ds = PreparedDataset(
            topo,
            torch.from_numpy(feats),
            torch.from_numpy(labels_out),
            {k: torch.from_numpy(v) for k, v in splits.items()},
        )
        counts = {k: int(v.size) for k, v in splits.items()}
        ds.manifest = {
            **manifest,
            "num_nodes": p.num_nodes,
            "num_edges": int(indices.shape[0]),
            "num_features": p.num_features,
            "num_classes": p.num_classes,
            "split_sizes": counts,
        }
        return ds
    save_prepared(d, topo, feats, labels_out, splits, manifest, in_place=("indices", "features"))
    del topo, feats, indices
    return load_prepared(d, mmap=True)


def scaled(preset: str | Preset, num_nodes: int, **changes) -> Preset:
    """A copy of a preset at another size, keeping its mean degree (for quick experiments)."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    mean = p.num_edges / p.num_nodes
    return replace(p, num_nodes=num_nodes, num_edges=int(mean * num_nodes), **changes)
