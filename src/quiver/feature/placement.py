"""Placement policies: which feature rows are hottest (go to the fastest tier).

``fap`` ranks by feature access probability (:func:`quiver.workload.fap`), ``degree`` by
in-degree (torch-quiver's choice), ``random`` by a seeded permutation (the floor).
"""

from __future__ import annotations

import torch

__all__ = ["PLACEMENTS", "hot_order"]

PLACEMENTS = ("fap", "degree", "random")


def hot_order(
    placement: str,
    node_count: int,
    csr_topo=None,
    sizes=(15, 10, 5),
    seed_prob=None,
    batch_size: int = 64,
    seed: int = 0,
) -> torch.Tensor:
    """Node ids ordered hottest first under a placement policy.

    Args:
        placement: ``"fap"``, ``"degree"`` or ``"random"``.
        node_count: number of feature rows.
        csr_topo: the graph (needed by ``fap`` and ``degree``).
        sizes: fanouts used to compute FAP.
        seed_prob: seed distribution for FAP (``None`` = uniform, or a request log of ids).
        batch_size: seeds per request batch for FAP.
        seed: RNG seed of the ``random`` policy.

    Returns:
        ``[node_count]`` int64 permutation; ties keep id order.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if placement == "random":
        g = torch.Generator().manual_seed(int(seed))
        return torch.randperm(node_count, generator=g)
    if csr_topo is None:
        raise ValueError(f"placement {placement!r} needs csr_topo (the graph)")
    if csr_topo.node_count != node_count:
        raise ValueError(
            f"csr_topo has {csr_topo.node_count} nodes but the features have {node_count} rows"
        )
    if placement == "degree":
        score = csr_topo.degree.cpu().to(torch.float64)
    else:
        from quiver.workload import fap

        score = fap(csr_topo, sizes, seed_prob=seed_prob, batch_size=batch_size).to(torch.float64)
    return torch.sort(score, descending=True, stable=True).indices
