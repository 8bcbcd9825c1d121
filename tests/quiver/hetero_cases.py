"""A MAG-like heterogeneous directory and a ``hetero_sage`` checkpoint for it: the serving
world the hetero tests share (imported by name: ``tests/quiver/conftest.py`` puts this
directory on ``sys.path``)."""

from __future__ import annotations

import torch

from quiver.hetero import mag_like
from quiver.hetero.examples import hetero_sage
from quiver.usermodel import save_model

FACTORY = "quiver.hetero.examples:hetero_sage"


def mag_sage(root, *, scale=0.001, seed=3, room=0, out_dim=4, hidden=8):
    """Save ``mag_like(scale, seed)`` under ``root / "ds"`` and a 2-layer ``hetero_sage``
    (``torch.manual_seed(0)``) under ``root / "m.pt"``, with ``room`` embedding rows per type
    beyond the graph's nodes (for nodes added while served).

    Returns ``(graph, dataset_dir, module, factory_kwargs, checkpoint)``.
    """
    g = mag_like(scale, seed=seed)
    d = g.save(root / "ds")
    kw = dict(
        num_nodes={t: n + room for t, n in g.num_nodes.items()},
        in_dims={t: int(x.shape[1]) for t, x in g.features.items()},
        edge_types=[list(e) for e in g.edge_types],
        hidden=hidden,
        out_dim=out_dim,
        num_layers=2,
        target="paper",
    )
    torch.manual_seed(0)
    module = hetero_sage(**kw)
    save_model(root / "m.pt", module, FACTORY, kw, fanouts=[-1, -1])
    return g, d, module, kw, root / "m.pt"
