"""Datasets: synthetic paper-shaped graphs (R-MAT presets), loaders, prepared directories.

- :func:`synthetic` / :data:`PRESETS`: ``tiny``, ``small``, ``reddit-like``, ``products-like``,
  ``papers-like`` with features, labels and splits.
- :func:`load_ogb`, :func:`load_edge_list`, :func:`from_pyg`: real data.
- :func:`load_prepared` / :func:`save_prepared`: the directory ``quiver prepare`` writes.
"""

from quiver.datasets.loaders import from_pyg, load_edge_list, load_ogb
from quiver.datasets.prepared import (
    PreparedDataset,
    convert_features,
    degree_stats,
    load_prepared,
    save_prepared,
    update_manifest,
)
from quiver.datasets.rmat import RMat, rmat_edges
from quiver.datasets.synthetic import PRESETS, Preset, scaled, synthetic

__all__ = [
    "PRESETS",
    "Preset",
    "PreparedDataset",
    "RMat",
    "convert_features",
    "degree_stats",
    "from_pyg",
    "load_edge_list",
    "load_ogb",
    "load_prepared",
    "rmat_edges",
    "save_prepared",
    "scaled",
    "synthetic",
    "update_manifest",
]
