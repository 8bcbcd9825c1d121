"""Sampler interface: validate seeds in one place, let subclasses do the sampling.

A sampler returns indices only (sampled node ids, relabelled edges, edge ids); features are
gathered in a separate stage, as in PyG's ``sampler``/``loader`` split.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "Adj",
    "BaseSampler",
    "RepeatedSeedsError",
    "SampledSubgraph",
    "check_fanouts",
    "check_seeds",
    "expand_repeated_seeds",
]


class RepeatedSeedsError(ValueError):
    """A sampler kernel was given repeated seed ids; ``sample_subgraph(..., repeats=True)``
    accepts them."""


class Adj(NamedTuple):
    """One hop's bipartite graph, as PyG's legacy ``NeighborSampler`` yields it.

    Attributes:
        edge_index: ``[2, E_h]`` int64 local ids, row 0 source (index into ``n_id``), row 1
            target (index into the first ``size[1]`` entries of ``n_id``).
        e_id: ``[E_h]`` int64 ids of the sampled edges in the original graph.
        size: ``(num_source_nodes, num_target_nodes)``.
    """

    edge_index: torch.Tensor
    e_id: torch.Tensor
    size: tuple[int, int]

    def to(self, *args, **kwargs) -> Adj:
        """Move ``edge_index`` and ``e_id`` (``Tensor.to`` arguments)."""
        return Adj(self.edge_index.to(*args, **kwargs), self.e_id.to(*args, **kwargs), self.size)


class SampledSubgraph:
    """Everything one k-hop sample produced, hop by hop (innermost hop first).

    Attributes:
        n_id: ``[M]`` int64 global ids of the sampled nodes, seeds first (as given, so they
            repeat if the seeds did), then each further node once.
        batch_size: number of seeds.
        num_nodes: ``L + 1`` counts: ``len(n_id)`` before hop 0 (= batch_size) and after each hop.
        edge_ptr: ``L + 1`` offsets of each hop's edges in the flat ``src``/``dst``/``e_id``.
        hops: per hop ``(src [E_h], dst [E_h], e_id [E_h])``: int64 local source ids
            (in-neighbours), local target ids, and edge ids (original edge order when the
            topology has ``eid``, else CSR positions).

    ``src``, ``dst`` and ``e_id`` concatenate the hops (computed on first use).
    """

    __slots__ = ("n_id", "batch_size", "num_nodes", "edge_ptr", "hops", "_flat")

    def __init__(self, n_id, batch_size: int, num_nodes, hops):
        self.n_id = n_id
        self.batch_size = int(batch_size)
        self.num_nodes = [int(x) for x in num_nodes]
        self.hops = list(hops)
        ptr = [0]
        for src, _, _ in self.hops:
            ptr.append(ptr[-1] + src.numel())
        self.edge_ptr = ptr
        self._flat = None

    @property
    def num_hops(self) -> int:
        return len(self.num_nodes) - 1

    @property
    def num_edges(self) -> int:
        return int(self.edge_ptr[-1])

    def _concat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._flat is None:
            if self.hops:
                self._flat = tuple(torch.cat([hop[i] for hop in self.hops]) for i in range(3))
            else:
                e = self.n_id.new_empty(0)
                self._flat = (e, e, e)
        return self._flat

    @property
    def src(self) -> torch.Tensor:
        """``[S]`` local source ids of all hops."""
        return self._concat()[0]

    @property
    def dst(self) -> torch.Tensor:
        """``[S]`` local target ids of all hops."""
        return self._concat()[1]

    @property
    def e_id(self) -> torch.Tensor:
        """``[S]`` edge ids of all hops."""
        return self._concat()[2]

    def hop(self, h: int) -> Adj:
        """The ``Adj`` of hop ``h`` (0 = the hop whose targets are the seeds)."""
        src, dst, e_id = self.hops[h]
        edge_index = torch.stack([src, dst])
        return Adj(edge_index, e_id, (self.num_nodes[h + 1], self.num_nodes[h]))

    def adjs(self) -> list[Adj]:
        """Hops ordered from the outermost to the seeds, as PyG's ``NeighborSampler`` returns."""
        return [self.hop(h) for h in reversed(range(self.num_hops))]

    def __repr__(self) -> str:
        return (
            f"SampledSubgraph(batch_size={self.batch_size}, num_nodes={self.num_nodes}, "
            f"num_edges={self.num_edges})"
        )


def check_seeds(seeds, node_count: int) -> torch.Tensor:
    """Return ``seeds`` as a 1-D int64 tensor, raising ``ValueError`` naming any problem.

    Accepts a tensor, a numpy array or a list of ints. Checks dtype (integer), shape (1-D) and
    range (``0 <= id < node_count``). Duplicates are reported by the samplers.
    """
    if isinstance(seeds, torch.Tensor):
        if seeds.dtype.is_floating_point or seeds.dtype.is_complex or seeds.dtype == torch.bool:
            raise ValueError(f"seeds must be an integer tensor, got dtype {seeds.dtype}")
        t = seeds
    else:
        a = np.asarray(seeds)
        if a.size == 0 and a.ndim == 1:
            a = a.astype(np.int64)
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"seeds must be integers, got dtype {a.dtype}")
        t = torch.from_numpy(a.astype(np.int64, copy=False))
    if t.dim() != 1:
        raise ValueError(f"seeds must be a 1-D tensor of node ids, got shape {list(t.shape)}")
    t = t.to(torch.int64)
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0:
            raise ValueError(f"seeds hold a negative node id ({lo})")
        if hi >= node_count:
            raise ValueError(f"seeds hold node id {hi} >= node_count ({node_count})")
    return t


def check_fanouts(sizes) -> list[int]:
    """Validate per-hop fanouts (innermost first); ``-1`` means all neighbours."""
    if isinstance(sizes, (str, bytes)):
        raise ValueError(f"sizes must be a list of ints, got {sizes!r}")
    try:
        out = [int(k) for k in sizes]
    except (TypeError, ValueError) as e:
        raise ValueError(f"sizes must be a list of ints, got {sizes!r}") from e
    if not out:
        raise ValueError("sizes must name at least one hop, e.g. [15, 10, 5]")
    if any(k != int(s) for k, s in zip(out, sizes)):
        raise ValueError(f"sizes must be integers, got {list(sizes)!r}")
    if any(k < -1 or k == 0 for k in out):
        raise ValueError(f"each fanout must be positive or -1 (all neighbours), got {out}")
    return out


class BaseSampler(ABC):
    """k-hop neighbour sampler over a ``CSRTopo``.

    Subclasses implement :meth:`_sample`; :meth:`sample_subgraph` validates the seeds first.

    Args:
        node_count: number of nodes of the graph (seed range).
        sizes: per-hop fanouts, innermost (the seeds' hop) first; ``-1`` takes all neighbours.
    """

    def __init__(self, node_count: int, sizes):
        self.node_count = int(node_count)
        self.sizes = check_fanouts(sizes)

    def sample_subgraph(self, seeds, repeats: bool = False) -> SampledSubgraph:
        """Sample the k-hop neighbourhood of ``seeds``.

        Args:
            seeds: 1-D integer node ids in ``[0, node_count)``.
            repeats: allow repeated seeds (torch-quiver and PyG's legacy ``NeighborSampler``
                do): each occurrence is its own target (``n_id[:len(seeds)] == seeds``) and
                all occurrences of a node share one sample of its neighbourhood. Otherwise
                repeated seeds raise :class:`RepeatedSeedsError` (a ``ValueError``).
        """
        seeds = check_seeds(seeds, self.node_count)
        if not repeats:
            return self._sample(seeds)
        try:
            return self._sample(seeds)  # the kernels detect repeats for free
        except RepeatedSeedsError:
            uniq, first, inverse = _first_occurrences(seeds)
            return expand_repeated_seeds(self._sample(uniq), seeds, first, inverse)

    def sample(self, seeds, repeats: bool = False) -> tuple[torch.Tensor, int, list[Adj]]:
        """``(n_id, batch_size, adjs)`` in the format of PyG's legacy ``NeighborSampler``."""
        out = self.sample_subgraph(seeds, repeats=repeats)
        return out.n_id, out.batch_size, out.adjs()

    @abstractmethod
    def _sample(self, seeds: torch.Tensor) -> SampledSubgraph:
        """Sample from validated 1-D int64 ``seeds``."""


def _first_occurrences(seeds: torch.Tensor):
    """``(uniq [U], first [U], inverse [B])``: distinct seeds in order of first occurrence,
    the position of each one's first occurrence, and each position's index into ``uniq``."""
    b = seeds.numel()
    u, inv = torch.unique(seeds, return_inverse=True)
    pos = torch.arange(b, device=seeds.device)
    first = torch.full((u.numel(),), b, dtype=torch.int64, device=seeds.device)
    first.scatter_reduce_(0, inv, pos, reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=seeds.device)
    return u[order], first[order], rank[inv]


def expand_repeated_seeds(
    sub: SampledSubgraph, seeds: torch.Tensor, first: torch.Tensor, inverse: torch.Tensor
) -> SampledSubgraph:
    """Turn a sample of the distinct seeds into one of ``seeds`` with repeats.

    ``sub`` was sampled from ``uniq`` (distinct, in first-occurrence order; ``first[j]`` the
    position of ``uniq[j]``'s first occurrence in ``seeds``, ``inverse[p]`` the index into
    ``uniq`` of ``seeds[p]``). Every edge into a seed is copied to each of its occurrences;
    an edge *from* a seed starts at its first occurrence; the other nodes shift by the number
    of repeats.
    """
    b, u = seeds.numel(), first.numel()
    extra = b - u
    dev = seeds.device
    mult = torch.bincount(inverse, minlength=u)  # occurrences of each distinct seed
    grouped = torch.argsort(inverse, stable=True)  # positions, grouped by distinct seed
    group_start = torch.cumsum(mult, 0) - mult

    def shift(local: torch.Tensor) -> torch.Tensor:
        return torch.where(local < u, first[local.clamp(max=u - 1)], local + extra)

    hops = []
    for src, dst, e_id in sub.hops:
        is_seed = dst < u
        d = dst.clamp(max=u - 1)
        copies = torch.where(is_seed, mult[d], torch.ones_like(dst))
        idx = torch.repeat_interleave(torch.arange(dst.numel(), device=dev), copies)
        k = torch.arange(idx.numel(), device=dev) - torch.repeat_interleave(
            torch.cumsum(copies, 0) - copies, copies
        )
        dd = dst[idx]
        new_dst = torch.where(dd < u, grouped[group_start[dd.clamp(max=u - 1)] + k], dd + extra)
        hops.append((shift(src[idx]), new_dst, e_id[idx]))
    n_id = torch.cat([seeds.to(sub.n_id.device), sub.n_id[u:]])
    num_nodes = [b] + [n + extra for n in sub.num_nodes[1:]]
    return SampledSubgraph(n_id, b, num_nodes, hops)
