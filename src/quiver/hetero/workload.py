"""PSGS and FAP of typed sampling (:mod:`quiver.hetero.sampler`), per node type and relation.

The homogeneous formulas of :mod:`quiver.workload` (frontier semantics: a node is expanded once,
at the hop after it arrives), with each relation a bipartite mat-vec from its destination type
to its source type. With ``w_{r,h}(v) = min(d_r(v), k_{r,h}) / d_r(v)`` for relation ``r``'s
in-degree ``d_r`` and hop-``h`` fanout ``k_{r,h}``:

- **PSGS** of a seed ``v`` of type ``d``: ``S_L = 1`` for every type, ``S_l(v) = 1 + sum over
  relations r into d of w_{r,l+1}(v) * sum_{u in N_r(v)} S_{l+1}(u)``, result ``S_0``: the
  expected sampled nodes of every type, counted as a tree. The expected sampled edges of each
  relation per seed come from the same recursion (:func:`relation_edges`).
- **FAP** per node type: the probability that a node's feature row is read by one request
  batch of ``batch_size`` seeds drawn uniformly from the target type, tracking arrival-time
  distributions per type as :func:`quiver.workload.access_probability` does.

The server orders each type's rows by FAP (hottest first) and fills the RAM cache with the
hottest rows over all types by probability per byte (:func:`hot_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from quiver.hetero.graph import HeteroGraph, edge_type_name
from quiver.workload import _column_sum, _pick_probability, _row_sum

__all__ = ["hetero_fap", "hetero_psgs", "hot_rows", "relation_edges"]


def _rel_arrays(graph: HeteroGraph):
    for et, r in graph.relations.items():
        yield (
            et,
            np.ascontiguousarray(r.indptr, dtype=np.int64),
            np.ascontiguousarray(r.indices, dtype=np.int64),
        )


def hetero_psgs(graph: HeteroGraph, fanouts: dict) -> dict[str, torch.Tensor]:
    """Per node type, ``[N_t]`` float32 expected sampled nodes (all types) with it as seed.

    Args:
        graph: the graph.
        fanouts: :func:`quiver.hetero.sampler.resolve_fanouts`'s dict.
    """
    hops = len(next(iter(fanouts.values())))
    s = {t: np.ones(n) for t, n in graph.num_nodes.items()}
    for h in reversed(range(hops)):
        nxt = {t: np.ones(n) for t, n in graph.num_nodes.items()}
        for et, indptr, indices in _rel_arrays(graph):
            src, _, dst = et
            tmp = np.empty(graph.num_nodes[dst])
            _row_sum(indptr, indices, s[src], tmp)
            nxt[dst] += _pick_probability(np.diff(indptr), fanouts[et][h]) * tmp
        s = nxt
    return {t: torch.from_numpy(v.astype(np.float32)) for t, v in s.items()}


def relation_edges(graph: HeteroGraph, fanouts: dict, target: str) -> dict[str, float]:
    """Expected sampled edges per relation for one uniform seed of ``target`` (as a tree)."""
    hops = len(next(iter(fanouts.values())))
    # expected nodes of each type that arrive at hop h per seed, counted as a tree
    reach = {t: np.zeros(n) for t, n in graph.num_nodes.items()}
    reach[target] = np.full(graph.num_nodes[target], 1.0 / graph.num_nodes[target])
    out = {edge_type_name(et): 0.0 for et in graph.relations}
    for h in range(hops):
        nxt = {t: np.zeros(n) for t, n in graph.num_nodes.items()}
        for et, indptr, indices in _rel_arrays(graph):
            src, _, dst = et
            w = _pick_probability(np.diff(indptr), fanouts[et][h])
            y = reach[dst] * w
            out[edge_type_name(et)] += float((y * np.diff(indptr)).sum())
            _column_sum(indptr, indices, y, nxt[src])
        reach = nxt
    return out


def hetero_fap(
    graph: HeteroGraph, fanouts: dict, target: str, batch_size: int = 64
) -> dict[str, torch.Tensor]:
    """Per node type, ``[N_t]`` float32 probability that one batch reads the node's row.

    Args:
        graph: the graph.
        fanouts: :func:`quiver.hetero.sampler.resolve_fanouts`'s dict.
        target: the node type requests name (seeds uniform over it).
        batch_size: seeds per batch.
    """
    if target not in graph.num_nodes:
        raise ValueError(f"unknown target node type {target!r}")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    hops = len(next(iter(fanouts.values())))
    n_t = graph.num_nodes[target]
    p0 = {t: np.zeros(n) for t, n in graph.num_nodes.items()}
    if n_t:
        p0[target][:] = -np.expm1(int(batch_size) * np.log1p(-1.0 / n_t))
    arrival = {t: [p0[t]] for t in graph.num_nodes}
    cum = {t: p0[t].copy() for t in graph.num_nodes}
    with np.errstate(divide="ignore"):
        log_not_seed = {t: np.log1p(-p0[t]) for t in graph.num_nodes}
    rels = list(_rel_arrays(graph))
    weights = {
        et: [_pick_probability(np.diff(indptr), k) for k in fanouts[et]] for et, indptr, _ in rels
    }
    for step in range(1, hops + 1):
        scatter = {t: np.zeros(n) for t, n in graph.num_nodes.items()}
        for et, indptr, indices in rels:
            src, _, dst = et
            picked = np.zeros(graph.num_nodes[dst])
            for t in range(step):
                picked += arrival[dst][t] * weights[et][t]
            with np.errstate(divide="ignore"):
                log_keep = np.log1p(-np.minimum(picked, 1.0))
            _column_sum(indptr, indices, log_keep, scatter[src])
        for t in graph.num_nodes:
            new = np.maximum(-np.expm1(log_not_seed[t] + scatter[t]), cum[t])
            arrival[t].append(new - cum[t])
            cum[t] = new
    return {t: torch.from_numpy(v.astype(np.float32)) for t, v in cum.items()}


def hot_rows(fap: dict, row_bytes: dict[str, int], budget: int) -> dict[str, int]:
    """Rows of each type to keep in the RAM cache: the hottest rows over all types by FAP per
    byte until ``budget`` bytes (types absent from ``row_bytes`` have no rows to cache)."""
    if budget <= 0 or not row_bytes:
        return dict.fromkeys(row_bytes, 0)
    keys, dens, sizes = [], [], []
    for t, b in row_bytes.items():
        p = np.sort(fap[t].numpy())[::-1]
        keys.append(np.full(p.size, len(keys)))
        dens.append(p / b)
        sizes.append(np.full(p.size, b))
    types = list(row_bytes)
    key, den, size = np.concatenate(keys), np.concatenate(dens), np.concatenate(sizes)
    order = np.argsort(-den, kind="stable")
    fits = np.cumsum(size[order]) <= budget
    chosen = key[order][fits]
    return {t: int((chosen == i).sum()) for i, t in enumerate(types)}
