"""Hetero models to start from (and that the tests and ``bench/hetero.py`` serve).

Both take ``(x_dict, edge_index_dict)`` as :mod:`quiver.hetero.model` describes: featureless
types arrive as global node ids and go through an ``nn.Embedding`` of their own.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["hetero_gat", "hetero_sage", "rgcn"]


class _Inputs(nn.Module):
    """Per-type input layer: a Linear for types with features, an Embedding for the rest."""

    def __init__(self, num_nodes: dict, in_dims: dict, hidden: int):
        super().__init__()
        self.lin = nn.ModuleDict({t: nn.Linear(d, hidden) for t, d in in_dims.items() if d})
        self.emb = nn.ModuleDict(
            {t: nn.Embedding(n, hidden) for t, n in num_nodes.items() if not in_dims.get(t)}
        )

    def forward(self, x_dict: dict) -> dict:
        return {t: self.lin[t](x) if t in self.lin else self.emb[t](x) for t, x in x_dict.items()}


def _layers(convs, h: dict, edge_index_dict: dict, **kwargs) -> dict:
    """Run ``HeteroConv`` layers, ReLU between them; a type no relation reaches keeps zeros."""
    for i, conv in enumerate(convs):
        out = conv(h, edge_index_dict, **kwargs)
        h = {t: out.get(t, torch.zeros_like(v)) for t, v in h.items()}
        if i < len(convs) - 1:
            h = {t: v.relu() for t, v in h.items()}
    return h


class HeteroSAGE(nn.Module):
    """``HeteroConv`` of ``SAGEConv`` per relation (sum over relations), ReLU between layers."""

    def __init__(self, num_nodes, in_dims, edge_types, hidden, out_dim, num_layers, target):
        super().__init__()
        from torch_geometric.nn import HeteroConv, SAGEConv

        self.target = target
        self.inputs = _Inputs(num_nodes, in_dims, hidden)
        ets = [tuple(e) for e in edge_types]
        self.convs = nn.ModuleList(
            HeteroConv({et: SAGEConv(hidden, hidden) for et in ets}, aggr="sum")
            for _ in range(num_layers)
        )
        self.head = nn.Linear(hidden, out_dim)

    def embed(self, x_dict, edge_index_dict):
        return _layers(self.convs, self.inputs(x_dict), edge_index_dict)

    def forward(self, x_dict, edge_index_dict):
        return {self.target: self.head(self.embed(x_dict, edge_index_dict)[self.target])}


def hetero_sage(
    num_nodes: dict,
    in_dims: dict,
    edge_types: list,
    hidden: int = 64,
    out_dim: int = 2,
    num_layers: int = 2,
    target: str = "paper",
) -> nn.Module:
    """A ``HeteroConv``/``SAGEConv`` model (factory for ``quiver.usermodel.save_model``).

    Args:
        num_nodes: node type -> count (for the embedding tables of featureless types).
        in_dims: node type -> feature width (0 or absent: no features).
        edge_types: ``[[src, rel, dst], ...]``.
        hidden, out_dim, num_layers: sizes; ``target``: the type the head answers for.
    """
    return HeteroSAGE(num_nodes, in_dims, edge_types, hidden, out_dim, num_layers, target)


class RGCN(nn.Module):
    """R-GCN style: ``to_hetero``-free, one ``RGCNConv`` over a flattened typed graph."""

    def __init__(self, num_nodes, in_dims, edge_types, hidden, out_dim, num_layers, target):
        super().__init__()
        from torch_geometric.nn import RGCNConv

        self.types = list(num_nodes)
        self.edge_types = [tuple(e) for e in edge_types]
        self.target = target
        self.inputs = _Inputs(num_nodes, in_dims, hidden)
        self.convs = nn.ModuleList(
            RGCNConv(hidden, hidden, len(self.edge_types)) for _ in range(num_layers)
        )
        self.head = nn.Linear(hidden, out_dim)

    def forward(self, x_dict, edge_index_dict):
        h = self.inputs(x_dict)
        offsets, start = {}, 0
        for t in self.types:
            offsets[t] = start
            start += h[t].shape[0]
        x = torch.cat([h[t] for t in self.types])
        eis, rels = [], []
        for r, et in enumerate(self.edge_types):
            ei = edge_index_dict[et]
            eis.append(torch.stack([ei[0] + offsets[et[0]], ei[1] + offsets[et[2]]]))
            rels.append(torch.full((ei.shape[1],), r, dtype=torch.int64))
        ei, rel = torch.cat(eis, 1), torch.cat(rels)
        for i, conv in enumerate(self.convs):
            x = conv(x, ei, rel)
            if i < len(self.convs) - 1:
                x = x.relu()
        t0 = offsets[self.target]
        return self.head(x[t0 : t0 + h[self.target].shape[0]])


def rgcn(
    num_nodes: dict,
    in_dims: dict,
    edge_types: list,
    hidden: int = 32,
    out_dim: int = 2,
    num_layers: int = 2,
    target: str = "paper",
) -> nn.Module:
    """An ``RGCNConv`` model (factory for ``quiver.usermodel.save_model``); args as
    :func:`hetero_sage`."""
    return RGCN(num_nodes, in_dims, edge_types, hidden, out_dim, num_layers, target)


class HeteroGAT(nn.Module):
    """``HeteroConv`` with an edge-aware ``GATConv(edge_dim=D)`` on relations that have edge
    features and ``SAGEConv`` on the rest; takes ``(x_dict, edge_index_dict, edge_attr_dict)``."""

    def __init__(
        self, num_nodes, in_dims, edge_types, edge_dims, hidden, out_dim, num_layers, target
    ):
        super().__init__()
        from torch_geometric.nn import GATConv, HeteroConv, SAGEConv

        self.target = target
        self.inputs = _Inputs(num_nodes, in_dims, hidden)
        names = {"__".join(e): tuple(e) for e in edge_types}

        def conv(name):
            d = edge_dims.get(name)
            if d:
                return GATConv(
                    hidden, hidden, heads=2, concat=False, edge_dim=d, add_self_loops=False
                )
            return SAGEConv(hidden, hidden)

        self.convs = nn.ModuleList(
            HeteroConv({et: conv(n) for n, et in names.items()}, aggr="sum")
            for _ in range(num_layers)
        )
        self.head = nn.Linear(hidden, out_dim)

    def forward(self, x_dict, edge_index_dict, edge_attr_dict):
        h = _layers(self.convs, self.inputs(x_dict), edge_index_dict, edge_attr_dict=edge_attr_dict)
        return {self.target: self.head(h[self.target])}


def hetero_gat(
    num_nodes: dict,
    in_dims: dict,
    edge_types: list,
    edge_dims: dict,
    hidden: int = 32,
    out_dim: int = 2,
    num_layers: int = 2,
    target: str = "paper",
) -> nn.Module:
    """An edge-aware hetero model (factory for ``quiver.usermodel.save_model``); ``edge_dims``
    maps ``"src__rel__dst"`` to its edge feature width; other args as :func:`hetero_sage`."""
    return HeteroGAT(num_nodes, in_dims, edge_types, edge_dims, hidden, out_dim, num_layers, target)
