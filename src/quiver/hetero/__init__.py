"""Heterogeneous graphs in Quiver: typed prepare, typed sampling, serving a user's hetero model.

- :class:`HeteroGraph` (``graph``): typed nodes and relations, features and labels per type,
  saved to / memory-mapped from a prepared directory;
- :func:`mag_like` (``synthetic``): an OGB-MAG-sized synthetic graph;
- :class:`HeteroSampler` (``sampler``): per-relation fanouts, PyG hetero ``NeighborLoader``
  semantics;
- :func:`hetero_psgs`, :func:`hetero_fap` (``workload``): PSGS and FAP per type and relation;
- :class:`HeteroServer` (``server``): ``quiver serve`` for a ``to_hetero`` / ``HeteroConv``
  model, a request naming a node type and ids.
"""

from quiver.hetero.graph import HeteroGraph, Relation, edge_type_name, is_hetero_dir
from quiver.hetero.model import HeteroFeatures, HeteroServedModel, load_hetero_model
from quiver.hetero.sampler import HeteroBatch, HeteroSampler, resolve_fanouts
from quiver.hetero.server import HeteroServer
from quiver.hetero.synthetic import mag_like
from quiver.hetero.workload import hetero_fap, hetero_psgs

__all__ = [
    "HeteroBatch",
    "HeteroFeatures",
    "HeteroGraph",
    "HeteroSampler",
    "HeteroServedModel",
    "HeteroServer",
    "Relation",
    "edge_type_name",
    "hetero_fap",
    "hetero_psgs",
    "is_hetero_dir",
    "load_hetero_model",
    "mag_like",
    "resolve_fanouts",
]
