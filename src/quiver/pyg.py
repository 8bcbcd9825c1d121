"""torch-quiver compatible sampling API, and a PyG ``BaseSampler`` for ``NodeLoader``.

``GraphSageSampler(csr_topo, sizes, device, mode).sample(seeds)`` returns
``(n_id, batch_size, adjs)`` exactly like torch-quiver and PyG's legacy ``NeighborSampler``,
so existing training and inference loops (``for edge_index, _, size in adjs``) run unchanged.
"""

from __future__ import annotations

import torch

from quiver.graph import CSRTopo
from quiver.sampling import CPUSampler, TorchSampler
from quiver.sampling.base import Adj, SampledSubgraph

__all__ = ["GraphSageSampler", "QuiverNodeSampler"]

MODES = ("CPU", "GPU", "UVA")


def _build_sampler(csr_topo, sizes, device, mode, seed, num_threads, frontier):
    if not isinstance(csr_topo, CSRTopo):
        raise ValueError(f"csr_topo must be a quiver.CSRTopo, got {type(csr_topo).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "CPU":
        return CPUSampler(
            csr_topo.to("cpu"), sizes, seed=seed, num_threads=num_threads, frontier=frontier
        )
    return TorchSampler(csr_topo, sizes, device=device, mode=mode, seed=seed, frontier=frontier)


class GraphSageSampler:
    """GraphSAGE-style k-hop neighbour sampler with torch-quiver's interface.

    Args:
        csr_topo: the graph (``quiver.CSRTopo``).
        sizes: per-hop fanouts, innermost first, e.g. ``[15, 10, 5]``; ``-1`` = all neighbours.
        device: device of the returned tensors; in ``GPU`` mode also where the kernel and the
            topology live (default: the topology's device); in ``UVA`` mode the CUDA device.
        mode: ``"CPU"`` (numba kernel on host threads), ``"GPU"`` (vectorized torch kernel on
            ``device``; on CPU tensors it runs on the CPU) or ``"UVA"`` (torch kernel on the GPU
            reading a pinned host topology; raises ``ValueError`` without CUDA).
        seed: seed for reproducible sampling; ``None`` draws one.
        num_threads: CPU mode only: numba threads per call (default: all cores).
        frontier: ``False`` (default, torch-quiver's and PyG's legacy ``NeighborSampler``'s
            semantics) samples every gathered node at each hop; ``True`` only each hop's new
            nodes, as PyG's ``NeighborLoader``: the hops' edges then never repeat, so their
            concatenation is the subgraph a ``forward(x, edge_index)`` model runs on.
    """

    def __init__(
        self,
        csr_topo: CSRTopo,
        sizes,
        device=None,
        mode: str = "CPU",
        seed: int | None = None,
        num_threads: int | None = None,
        frontier: bool = False,
    ):
        self.mode = mode
        self.sizes = list(sizes)
        self.frontier = bool(frontier)
        self.sampler = _build_sampler(
            csr_topo, sizes, device, mode, seed, num_threads, self.frontier
        )
        if device is None:
            device = getattr(self.sampler, "device", torch.device("cpu"))
        self.device = torch.device(device)

    def sample_subgraph(self, seeds) -> SampledSubgraph:
        """The flat :class:`~quiver.sampling.SampledSubgraph` (on the sampler's device)."""
        return self.sampler.sample_subgraph(seeds)

    def sample(self, seeds) -> tuple[torch.Tensor, int, list[Adj]]:
        """Sample the k-hop neighbourhood of ``seeds``.

        Args:
            seeds: 1-D integer node ids, distinct, in ``[0, node_count)``.

        Returns:
            ``(n_id, batch_size, adjs)``: ``n_id`` global ids with the seeds first;
            ``batch_size = len(seeds)``; ``adjs[i] = (edge_index, e_id, size)`` from the
            outermost hop to the seeds' hop, ``edge_index`` in local ids (row 0 source).

        Raises:
            ValueError: seeds of a non-integer dtype, not 1-D, negative, ``>= node_count``, or
                repeated.
        """
        n_id, batch_size, adjs = self.sampler.sample(seeds)
        if n_id.device != self.device:
            n_id = n_id.to(self.device)
            adjs = [a.to(self.device) for a in adjs]
        return n_id, batch_size, adjs


def _pyg_base():
    from torch_geometric.sampler import BaseSampler

    return BaseSampler


class QuiverNodeSampler(_pyg_base()):
    """A ``torch_geometric.sampler.BaseSampler`` so PyG's ``NodeLoader`` can use our kernels.

    It samples like PyG's ``NeighborSampler`` (only the nodes a hop adds are expanded at the
    next hop), so the edges of different hops never repeat and a ``Data`` batch from
    ``NodeLoader`` feeds a PyG model directly.

    Args:
        csr_topo: the graph; its ``eid`` (set by ``CSRTopo.from_edge_index``/``from_pyg``) maps
            sampled edges back to the ``Data``'s edge order, which ``NodeLoader`` uses to slice
            edge attributes.
        num_neighbors: per-hop fanouts, innermost first.
        mode: ``"CPU"`` or ``"GPU"`` (the torch kernel on the topology's device).
        seed: seed for reproducible sampling.
        num_threads: CPU mode only: numba threads per call.

    Example::

        loader = NodeLoader(data, QuiverNodeSampler(CSRTopo.from_pyg(data), [15, 10]),
                            input_nodes=train_idx, batch_size=1024)
    """

    def __init__(
        self,
        csr_topo: CSRTopo,
        num_neighbors,
        mode: str = "CPU",
        seed: int | None = None,
        num_threads: int | None = None,
    ):
        if mode == "UVA":
            raise ValueError("QuiverNodeSampler supports mode 'CPU' or 'GPU'")
        self.sampler = _build_sampler(csr_topo, num_neighbors, None, mode, seed, num_threads, True)

    def sample_from_nodes(self, index, **kwargs):
        """Sample from ``index.node`` (a ``NodeSamplerInput``); returns a PyG ``SamplerOutput``."""
        from torch_geometric.sampler import SamplerOutput

        out = self.sampler.sample_subgraph(index.node)
        return SamplerOutput(
            node=out.n_id.cpu(),
            row=out.src.cpu(),
            col=out.dst.cpu(),
            edge=out.e_id.cpu(),
            num_sampled_nodes=[b - a for a, b in zip([0] + out.num_nodes[:-1], out.num_nodes)],
            num_sampled_edges=[b - a for a, b in zip(out.edge_ptr[:-1], out.edge_ptr[1:])],
            metadata=(index.input_id, index.time),
        )

    def sample_from_edges(self, index, neg_sampling=None):
        raise NotImplementedError("QuiverNodeSampler samples from nodes only")
