"""A synthetic OGB-MAG-like heterogeneous graph (``quiver prepare --hetero mag-like``).

Node and edge counts are OGB-MAG's (ogbn-mag, Hu et al. 2020, the OGB node-property table:
736,389 papers, 1,134,649 authors, 8,740 institutions, 59,965 fields of study; 7,145,660
writes, 5,416,271 cites, 7,505,078 has_topic and 1,043,998 affiliated_with edges), times
``scale``. Features (128 wide) on papers only, as in ogbn-mag without metapath2vec, and 349
paper classes. Which endpoint an edge takes is drawn from a Zipf-like popularity per node type
(exponent 0.8; a few papers gather most citations, a few fields most topics), and a paper's
features are its class's centre plus noise, so a model can learn something. This is no
stand-in for MAG's real structure, only for its sizes, types and skew.

``reverse=True`` adds the reverse relations (``rev_writes``, ``rev_has_topic``,
``rev_affiliated_with``) and makes ``cites`` symmetric, as PyG's ``ToUndirected`` does for
its MAG examples, so papers receive messages from authors and fields.
"""

from __future__ import annotations

import numpy as np
import torch

from quiver.hetero.graph import HeteroGraph

__all__ = ["MAG_COUNTS", "MAG_EDGES", "mag_like"]

#: ogbn-mag node counts (OGB's dataset table)
MAG_COUNTS = {
    "paper": 736_389,
    "author": 1_134_649,
    "institution": 8_740,
    "field_of_study": 59_965,
}
#: ogbn-mag edge counts per relation (OGB's dataset table)
MAG_EDGES = {
    ("author", "affiliated_with", "institution"): 1_043_998,
    ("author", "writes", "paper"): 7_145_660,
    ("paper", "cites", "paper"): 5_416_271,
    ("paper", "has_topic", "field_of_study"): 7_505_078,
}
MAG_FEATURES = 128
MAG_CLASSES = 349
_ZIPF = 0.8


def _popular(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``size`` ids in ``[0, n)`` drawn with Zipf-like weights over a random id permutation."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** _ZIPF
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(size), side="right")
    return rng.permutation(n)[np.minimum(ranks, n - 1)]


def mag_like(
    scale: float = 1.0, seed: int = 0, reverse: bool = True, num_features: int = MAG_FEATURES
) -> HeteroGraph:
    """Build the graph (see the module docstring); ``scale=1`` is full size (~1.9M nodes,
    ~21M edges before reversing, ~380 MB of paper features).

    Raises:
        ValueError: ``scale`` not in ``(0, 4]``.
    """
    if not 0 < scale <= 4:
        raise ValueError(f"scale must lie in (0, 4], got {scale}")
    rng = np.random.default_rng(seed)
    counts = {t: max(2, int(round(n * scale))) for t, n in MAG_COUNTS.items()}
    edges = {}
    for (src, rel, dst), m in MAG_EDGES.items():
        m = max(1, int(round(m * scale)))
        s = _popular(rng, counts[src], m) if src != "author" else rng.integers(0, counts[src], m)
        d = _popular(rng, counts[dst], m)
        if src == dst:  # no self-citations
            keep = s != d
            s, d = s[keep], d[keep]
        edges[(src, rel, dst)] = np.stack([s, d]).astype(np.int64)
    n_paper = counts["paper"]
    classes = min(MAG_CLASSES, max(2, n_paper // 20))
    y = rng.integers(0, classes, n_paper)
    centres = rng.standard_normal((classes, num_features)).astype(np.float32)
    x = centres[y] + rng.standard_normal((n_paper, num_features), dtype=np.float32)
    g = HeteroGraph.from_edges(
        counts,
        edges,
        features={"paper": torch.from_numpy(x)},
        labels={"paper": torch.from_numpy(y)},
        manifest={
            "name": f"mag-like@{scale:g}",
            "source": "synthetic",
            "target": "paper",
            "seed": seed,
        },
    )
    return g.add_reverse() if reverse else g
