"""Neighbour sampling: a small ``BaseSampler``, a numba CPU kernel and a vectorized torch kernel.

- :class:`CPUSampler`: numba, ``nogil``, rows sampled in parallel; the serving CPU path.
- :class:`TorchSampler`: whole-tensor torch ops on any device (``GPU``; ``UVA`` = pinned host
  topology read by the GPU).
- :func:`sample_neighbors`: one hop, no relabelling, for callers that build their own loop.

``quiver.pyg.GraphSageSampler`` wraps both behind torch-quiver's interface.
"""

from __future__ import annotations

import torch

from quiver.sampling.base import Adj, BaseSampler, SampledSubgraph, check_seeds
from quiver.sampling.cpu import CPUSampler
from quiver.sampling.gpu import TorchSampler

__all__ = [
    "Adj",
    "BaseSampler",
    "CPUSampler",
    "SampledSubgraph",
    "TorchSampler",
    "sample_neighbors",
]


def sample_neighbors(topo, nodes, k: int, seed: int = 0, generator=None):
    """Sample up to ``k`` distinct uniform in-neighbours of each node (``k = -1``: all).

    Runs the numba kernel for a CPU topology and the torch kernel elsewhere (or when a
    ``generator`` is given). Node ids are validated like seeds but may repeat.

    Args:
        topo: a ``CSRTopo``.
        nodes: 1-D integer node ids.
        k: fanout.
        seed: random stream of the numba kernel.
        generator: torch generator; selects the torch kernel.

    Returns:
        ``(counts [T], neighbours [sum counts], e_id [sum counts])``: global ids, node ``i``'s
        neighbours in the ``i``-th block.
    """
    nodes = check_seeds(nodes, topo.node_count)
    if k == 0 or k < -1:
        raise ValueError(f"k must be positive or -1, got {k}")
    if topo.device.type == "cpu" and generator is None:
        from quiver.sampling import _cpu_kernel as K

        ip, ix = topo.numpy()
        eid = topo.eid.numpy() if topo.eid is not None else ip[:0]
        counts, nbrs, e = K.sample_one_hop(ip, ix, eid, nodes.numpy(), int(k), int(seed), 0)
        return torch.from_numpy(counts), torch.from_numpy(nbrs), torch.from_numpy(e)
    from quiver.sampling._torch_kernel import sample_hop

    return sample_hop(topo.indptr, topo.indices, topo.eid, nodes.to(topo.device), int(k), generator)
