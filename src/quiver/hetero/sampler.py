"""Typed k-hop neighbour sampling with per-relation fanouts (PyG's hetero ``NeighborLoader``).

Semantics, those of PyG's ``NeighborLoader`` on a ``HeteroData`` (pyg-lib's
``hetero_neighbor_sample``, directed, without replacement, not disjoint):

- hop 0's frontier is the seeds (of one or more node types);
- at hop ``h`` every relation ``(src, rel, dst)`` samples, for every ``dst`` node of the
  frontier, ``min(deg, k)`` distinct sources uniformly without replacement (``k = -1``: all;
  ``k = 0``: none), where ``k`` is that relation's fanout for hop ``h``;
- a source not seen before (in its type) gets the next local id of its type; the nodes first
  seen during hop ``h`` are hop ``h + 1``'s frontier, so a node is expanded once, at the hop
  after it arrives (not re-sampled at every hop as the homogeneous ``GraphSageSampler`` does);
- every sampled edge is kept, also when its source was already in the subgraph.

So a node's local id is its position in its type's ``node_ids``, seeds first in request
order, then nodes in order of arrival; ``edge_index[et]`` is ``[2, E]`` local ``(src, dst)``, what
PyG's hetero models (``to_hetero``, ``HeteroConv``) take as ``edge_index_dict``. With every
fanout ``-1`` and as many hops as the model has layers, a target's logits equal those of a
full-graph forward (tested against PyG on the whole graph).

Neighbours of a node come in their CSR (input) order, as the homogeneous sampler gives them,
so order-sensitive aggregators see one canonical sequence. Randomness: row ``i`` of relation
``r`` at hop ``h`` of call ``c`` draws from a stream keyed by ``(seed, c, h * R + r)``.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numba
import numpy as np
import torch

from quiver.hetero.graph import HeteroGraph, edge_type_name, parse_edge_type
from quiver.sampling._cpu_kernel import _map_row, _row_positions, row_offsets, stream_key

__all__ = ["HeteroBatch", "HeteroSampler", "resolve_fanouts"]


@numba.njit(nogil=True, cache=True)
def _relabel(cols, marker, base):  # pragma: no cover - compiled
    """Local ids of ``cols`` (global ids of one type); unseen ids get ``base, base+1, ...``.

    Returns ``(local [S], fresh [S'])``: ``fresh`` are the newly seen global ids in order.
    """
    local = np.empty(cols.shape[0], dtype=np.int64)
    fresh = np.empty(cols.shape[0], dtype=np.int64)
    nf = 0
    for i in range(cols.shape[0]):
        c = cols[i]
        m = marker[c]
        if m < 0:
            m = base + nf
            marker[c] = m
            fresh[nf] = c
            nf += 1
        local[i] = m
    return local, fresh[:nf]


@numba.njit(nogil=True, cache=True)
def _sample_patched(
    indptr, indices, eid, base_n, p_start, p_deg, p_indices, p_eid, targets, k, key
):  # pragma: no cover - compiled
    """Up to ``k`` sources of each target's current row: ``(offs [T+1], src [S], eids [S])``.

    A row is read from the patch buffers when ``p_start[v] >= 0`` (an updated row, see
    :mod:`quiver.hetero.updates`), else from the base CSR (``v < base_n``), else it is empty (a
    node added since). Positions are drawn as the homogeneous kernel draws them (same stream,
    same row index), so an unpatched graph samples exactly what ``_sample_rows`` would.
    """
    nt = targets.shape[0]
    starts = np.empty(nt, dtype=np.int64)
    degs = np.empty(nt, dtype=np.int64)
    patched = np.zeros(nt, dtype=np.bool_)
    n_patch = p_start.shape[0]
    for i in range(nt):
        t = targets[i]
        if t < n_patch and p_start[t] >= 0:
            patched[i] = True
            starts[i] = p_start[t]
            degs[i] = p_deg[t]
        elif t < base_n:
            starts[i] = indptr[t]
            degs[i] = indptr[t + 1] - indptr[t]
        else:
            starts[i] = 0
            degs[i] = 0
    offs = row_offsets(degs, k)
    m = offs[nt]
    cols = np.empty(m, dtype=np.int64)
    eids = np.empty(m, dtype=np.int64)
    for i in range(nt):
        _row_positions(degs[i], k, key, i, eids, offs[i])
    for i in range(nt):  # the homogeneous kernel's row mapping, from one of the two stores
        if patched[i]:
            _map_row(p_indices, p_eid, True, starts[i], offs[i], offs[i + 1], cols, eids)
        else:
            _map_row(indices, eid, True, starts[i], offs[i], offs[i + 1], cols, eids)
    return offs, cols, eids


_NO_PATCH = np.zeros(0, dtype=np.int64)


def resolve_fanouts(graph: HeteroGraph, fanouts) -> dict[tuple[str, str, str], list[int]]:
    """Per-relation fanouts from a list (every relation alike) or a dict keyed by edge type
    (``(src, rel, dst)`` or ``"src__rel__dst"``; a relation left out gets 0, no edges).

    Raises:
        ValueError: an unknown edge type, hop counts that differ, a fanout below -1.
    """
    if isinstance(fanouts, dict):
        out = {}
        for k, v in fanouts.items():
            et = parse_edge_type(k)
            if et not in graph.relations:
                known = ", ".join(edge_type_name(e) for e in graph.relations)
                raise ValueError(f"fanouts name unknown edge type {edge_type_name(et)}; {known}")
            out[et] = [int(x) for x in v]
        hops = {len(v) for v in out.values()}
        if len(hops) > 1:
            raise ValueError(f"fanouts: every edge type needs the same hop count, got {hops}")
        n = hops.pop() if hops else 0
        for et in graph.relations:
            out.setdefault(et, [0] * n)
        out = {et: out[et] for et in graph.relations}  # the graph's relation order
    else:
        ks = [int(x) for x in fanouts]
        out = {et: list(ks) for et in graph.relations}
    for et, ks in out.items():
        if not ks:
            raise ValueError("fanouts must name at least one hop")
        for k in ks:
            if k < -1:
                raise ValueError(
                    f"fanout {k} of {edge_type_name(et)} is invalid: a count >= 0, or -1 for all"
                )
    return out


@dataclass
class HeteroBatch:
    """A sampled heterogeneous subgraph.

    Attributes:
        node_ids: node type -> ``[n_t]`` int64 global ids (seeds first in their type).
        edge_index: edge type -> ``[2, E_r]`` int64 local ``(src, dst)``.
        edge_ids: edge type -> ``[E_r]`` int64 positions in the relation's input edge list.
        batch_size: node type -> seeds of that type (the first rows of ``node_ids``).
        num_sampled_nodes: node type -> nodes that arrived at each hop (hop 0 = seeds).
    """

    node_ids: dict
    edge_index: dict
    edge_ids: dict
    batch_size: dict
    num_sampled_nodes: dict
    #: the model inputs, when the sampler's caller gathered them under the same version
    inputs: object = None

    @property
    def num_nodes(self) -> int:
        return sum(int(v.numel()) for v in self.node_ids.values())

    @property
    def num_edges(self) -> int:
        return sum(int(v.shape[1]) for v in self.edge_index.values())


class HeteroSampler:
    """Sample typed k-hop neighbourhoods of a :class:`HeteroGraph` (see the module docstring).

    Args:
        graph: the graph (its relations' CSRs may be memory-mapped).
        fanouts: per-hop fanouts: a list for every relation, or a dict per edge type.
        seed: random seed (``None``: fresh entropy).

    Thread-safe: each calling thread keeps its own id-marker arrays (8 bytes per node).
    """

    def __init__(self, graph: HeteroGraph, fanouts, seed: int | None = 0, live=None):
        self.graph = graph
        #: a :class:`quiver.hetero.updates.LiveGraph`: ``sample(..., version=v)`` samples its
        #: version ``v`` (default: the current one)
        self.live = live
        self.fanouts = resolve_fanouts(graph, fanouts)
        self.num_hops = len(next(iter(self.fanouts.values()))) if self.fanouts else 0
        self.seed = int(np.random.SeedSequence().entropy % (2**63)) if seed is None else seed
        self._calls = itertools.count()
        self._local = threading.local()
        self._static = {
            et: (
                np.ascontiguousarray(r.indptr, dtype=np.int64),
                np.ascontiguousarray(r.indices, dtype=np.int64),
                np.ascontiguousarray(r.eid, dtype=np.int64),
                int(r.indptr.shape[0] - 1),
                _NO_PATCH,
                _NO_PATCH,
                _NO_PATCH,
                _NO_PATCH,
            )  # fmt: skip
            for et, r in graph.relations.items()
        }

    @property
    def num_nodes(self) -> dict[str, int]:
        """Node counts of the sampled version (they grow with a live graph's new nodes)."""
        return self.live.num_nodes if self.live is not None else self.graph.num_nodes

    def _markers(self) -> dict[str, np.ndarray]:
        m = getattr(self._local, "markers", None)
        if m is None:
            m = {t: np.full(n, -1, dtype=np.int64) for t, n in self.num_nodes.items()}
            self._local.markers = m
        for t, n in self.num_nodes.items():
            if m[t].shape[0] < n:  # nodes were added: all -1 between batches, so regrow
                m[t] = np.full(max(n, 2 * m[t].shape[0]), -1, dtype=np.int64)
        return m

    def sample(self, seeds, version=None) -> HeteroBatch:
        """Sample around ``seeds``: ``{node_type: ids}`` (distinct ids per type), in a live
        graph's ``version`` (a :class:`quiver.hetero.updates.Version`; default the current).

        Raises:
            ValueError: an unknown node type, ids out of range or repeated.
        """
        if self.live is not None and version is None:
            version = self.live.version
        num_nodes = version.num_nodes if version is not None else self.graph.num_nodes
        markers = self._markers()
        node_ids: dict[str, list[np.ndarray]] = {t: [] for t in num_nodes}
        count = dict.fromkeys(num_nodes, 0)
        frontier: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        batch_size = dict.fromkeys(num_nodes, 0)
        arrived = {t: [] for t in num_nodes}
        try:
            for t, ids in seeds.items():
                if t not in num_nodes:
                    raise ValueError(
                        f"unknown node type {t!r}; the graph has {', '.join(num_nodes)}"
                    )
                ids = np.ascontiguousarray(torch.as_tensor(ids).numpy(), dtype=np.int64)
                if ids.size and (ids.min() < 0 or ids.max() >= num_nodes[t]):
                    raise ValueError(f"{t} ids must lie in [0, {num_nodes[t]})")
                local, fresh = _relabel(ids, markers[t], 0)
                node_ids[t].append(ids)  # before any raise: the finally resets its markers
                if fresh.size != ids.size:
                    raise ValueError(f"repeated {t} ids in the seeds")
                count[t] = batch_size[t] = ids.size
                frontier[t] = (ids, local)
            rels = [
                (et, version.rels[et].arrays() if version is not None else arrays)
                for et, arrays in self._static.items()
            ]
            edges: dict = {et: [] for et, _ in rels}
            call = next(self._calls)
            n_rel = len(rels)
            for t in num_nodes:
                arrived[t].append(batch_size[t])
            for h in range(self.num_hops):
                fresh_of: dict[str, list[np.ndarray]] = {t: [] for t in num_nodes}
                for r, (et, arrays) in enumerate(rels):
                    src, _, dst = et
                    k = self.fanouts[et][h]
                    if k == 0 or dst not in frontier or frontier[dst][0].size == 0:
                        continue
                    targets, targets_local = frontier[dst]
                    key = np.uint64(stream_key(self.seed, call, h * n_rel + r))
                    offs, cols, eids = _sample_patched(*arrays, targets, k, key)
                    local, fresh = _relabel(cols, markers[src], count[src])
                    count[src] += fresh.size
                    if fresh.size:
                        fresh_of[src].append(fresh)
                    dst_local = np.repeat(targets_local, np.diff(offs))
                    edges[et].append((local, dst_local, eids))
                frontier = {}
                for t, parts in fresh_of.items():
                    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
                    arrived[t].append(int(ids.size))
                    if ids.size:
                        start = sum(a.size for a in node_ids[t])
                        node_ids[t].append(ids)
                        frontier[t] = (ids, np.arange(start, start + ids.size, dtype=np.int64))
            out_nodes = {
                t: torch.from_numpy(np.concatenate(p) if p else np.zeros(0, dtype=np.int64))
                for t, p in node_ids.items()
            }
        finally:
            for t, parts in node_ids.items():
                for p in parts:
                    markers[t][p] = -1
        ei, eids_out = {}, {}
        for et, parts in edges.items():
            if parts:
                ei[et] = torch.from_numpy(
                    np.stack(
                        [
                            np.concatenate([p[0] for p in parts]),
                            np.concatenate([p[1] for p in parts]),
                        ]
                    )
                )
                eids_out[et] = torch.from_numpy(np.concatenate([p[2] for p in parts]))
            else:
                ei[et] = torch.zeros(2, 0, dtype=torch.int64)
                eids_out[et] = torch.zeros(0, dtype=torch.int64)
        return HeteroBatch(out_nodes, ei, eids_out, batch_size, arrived)
